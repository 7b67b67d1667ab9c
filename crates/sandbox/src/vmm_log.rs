//! The VMM's log as errors quote it: its last lines, or what an empty log means.

use std::fs;
use std::io;
use std::path::Path;

/// Lines of the VMM log quoted in errors.
pub(crate) const LOG_TAIL_LINES: usize = 20;

/// Most bytes read from the end of a log to find its last lines (64 KiB).
const TAIL_BYTES: u64 = 64 * 1024;

/// How [`Error::ReadyTimeout`] appends the VMM's log tail: nothing when it is empty.
pub(crate) fn log_suffix(log: &str) -> String {
    if log.trim().is_empty() {
        String::new()
    } else {
        format!("; VMM log:\n{log}")
    }
}

/// The VMM's log tail for [`Error::VmExited`]; when it is empty and the VMM ended cleanly
/// (`clean`), the guest rebooted by itself, and the text says what that usually means.
pub(crate) fn log_or_explanation(log: String, clean: bool) -> String {
    if !log.trim().is_empty() || !clean {
        return log;
    }
    "(empty: the guest rebooted or powered off by itself, as a kernel does after a panic such \
     as finding no usable /init; check that the initramfs holds the bulkhead agent as /init, and \
     keep the guest console (`bulkhead run --console FILE`, `SandboxConfig::console`) to see why)"
        .to_owned()
}

/// The last `count` lines of the file at `path`, read from at most its last [`TAIL_BYTES`].
pub(crate) fn tail_lines(path: &Path, count: usize) -> String {
    let text = match read_tail(path) {
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(_) => String::new(),
    };
    let lines: Vec<&str> = text.lines().collect();
    let start = lines.len().saturating_sub(count);
    lines[start..].join("\n")
}

fn read_tail(path: &Path) -> io::Result<Vec<u8>> {
    use std::io::{Read, Seek, SeekFrom};
    let mut file = fs::File::open(path)?;
    let len = file.metadata()?.len();
    file.seek(SeekFrom::Start(len.saturating_sub(TAIL_BYTES)))?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)?;
    Ok(bytes)
}
