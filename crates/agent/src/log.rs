//! Where the agent's own messages go: `/dev/console` (or the kernel log) as PID 1, stderr in
//! test mode. Every line starts with `bulkhead-agent: ` and is written with one `write(2)`, so
//! lines from several threads do not interleave.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::OnceLock;

static CONSOLE: OnceLock<File> = OnceLock::new();

/// Sends later log lines to `/dev/console` (opened write-only, without becoming the
/// controlling terminal), or to the kernel log (`/dev/kmsg`, read with `dmesg`) when the guest
/// has no console. Stays on stderr when neither can be opened.
pub fn use_console() {
    let open = |path| {
        OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NOCTTY)
            .open(path)
    };
    if let Ok(file) = open("/dev/console").or_else(|_| open("/dev/kmsg")) {
        let _ = CONSOLE.set(file);
    }
}

/// Writes one line `bulkhead-agent: <args>\n` to the console (or stderr).
pub fn line(args: fmt::Arguments<'_>) {
    let text = format!("bulkhead-agent: {args}\n");
    let _ = match CONSOLE.get() {
        Some(mut console) => console.write_all(text.as_bytes()),
        None => std::io::stderr().write_all(text.as_bytes()),
    };
}

/// `format!`-style logging to the agent's console; see [`line()`].
#[macro_export]
macro_rules! log {
    ($($arg:tt)*) => {
        $crate::log::line(format_args!($($arg)*))
    };
}
