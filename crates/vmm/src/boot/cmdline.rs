//! The kernel command line: building it from parts and placing it in guest memory.

use linux_loader::cmdline::Cmdline;
use vm_memory::GuestMemoryError;
#[cfg(target_arch = "x86_64")]
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::arch::CMDLINE_MAX_SIZE;
// Only x86_64 guests read the command line from guest memory; arm64 ones from the device tree.
#[cfg(target_arch = "x86_64")]
use crate::arch::CMDLINE_START;

/// Command line used when the user gives none, per architecture (on x86_64: serial console on
/// the first UART, reboot through the keyboard controller, reboot 1 s after a panic).
pub const DEFAULT_CMDLINE: &str = crate::arch::DEFAULT_CMDLINE;

/// Errors building or loading the command line.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A part contains a character the kernel cannot take.
    #[error("kernel command line part {part:?} contains {what}")]
    BadCharacter {
        /// The offending part.
        part: String,
        /// What was found ("a NUL byte", "a newline", ...).
        what: &'static str,
    },
    /// The whole command line is longer than the kernel accepts.
    #[error(
        "kernel command line is {len} bytes with its terminating NUL; the limit is {max} bytes"
    )]
    TooLong {
        /// Length in bytes, NUL included.
        len: usize,
        /// The limit, NUL included.
        max: usize,
    },
    /// linux-loader refused the command line.
    #[error("invalid kernel command line: {0}")]
    Invalid(linux_loader::cmdline::Error),
    /// Writing to guest memory failed.
    #[error("cannot write the kernel command line at GPA {addr:#x}: {source}")]
    Write {
        /// Its GPA.
        addr: u64,
        /// The guest memory error.
        source: GuestMemoryError,
    },
}

/// What is wrong with `part`, if anything: NUL, newline, or any byte outside printable ASCII.
fn bad_character(part: &str) -> Option<&'static str> {
    if part.contains('\0') {
        Some("a NUL byte")
    } else if part.contains(['\n', '\r']) {
        Some("a newline")
    } else if !part.chars().all(|c| matches!(c, ' '..='~')) {
        Some("a character that is not printable ASCII")
    } else {
        None
    }
}

/// Joins `base` and each of `extra` (each may hold several space-separated parameters) into a
/// command line of at most [`CMDLINE_MAX_SIZE`] bytes including the terminating NUL.
///
/// ```
/// use bulkhead_vmm::boot::{build_cmdline, DEFAULT_CMDLINE};
///
/// let cmdline = build_cmdline(DEFAULT_CMDLINE, &["quiet".to_string()]).unwrap();
/// let text = cmdline.as_cstring().unwrap().into_string().unwrap();
/// assert!(text.starts_with("console=ttyS0 ") && text.ends_with(" quiet"));
///
/// assert!(build_cmdline("console=ttyS0", &["a\nb".to_string()]).is_err());
/// ```
pub fn build_cmdline(base: &str, extra: &[String]) -> Result<Cmdline, super::Error> {
    Ok(join_parts(base, extra)?)
}

fn join_parts(base: &str, extra: &[String]) -> Result<Cmdline, Error> {
    let parts: Vec<&str> = std::iter::once(base)
        .chain(extra.iter().map(String::as_str))
        .map(str::trim)
        .filter(|part| !part.is_empty())
        .collect();
    if let Some((part, what)) = parts.iter().find_map(|p| bad_character(p).map(|w| (p, w))) {
        return Err(Error::BadCharacter {
            part: (*part).to_string(),
            what,
        });
    }
    let len = parts.iter().map(|p| p.len()).sum::<usize>() + parts.len().max(1);
    if len > CMDLINE_MAX_SIZE {
        return Err(Error::TooLong {
            len,
            max: CMDLINE_MAX_SIZE,
        });
    }
    let mut cmdline = Cmdline::new(CMDLINE_MAX_SIZE).map_err(Error::Invalid)?;
    for part in parts {
        cmdline.insert_str(part).map_err(Error::Invalid)?;
    }
    Ok(cmdline)
}

#[cfg(target_arch = "x86_64")]
/// Writes `cmdline` with its terminating NUL at [`CMDLINE_START`]; returns that GPA and the
/// size written in bytes (NUL included), as `BootInfo` wants them.
pub fn load_cmdline(
    mem: &GuestMemoryMmap,
    cmdline: &Cmdline,
) -> Result<(GuestAddress, usize), super::Error> {
    Ok(write_cmdline(mem, cmdline)?)
}

#[cfg(target_arch = "x86_64")]
fn write_cmdline(mem: &GuestMemoryMmap, cmdline: &Cmdline) -> Result<(GuestAddress, usize), Error> {
    let text = cmdline.as_cstring().map_err(Error::Invalid)?;
    let bytes = text.as_bytes_with_nul();
    if bytes.len() > CMDLINE_MAX_SIZE {
        return Err(Error::TooLong {
            len: bytes.len(),
            max: CMDLINE_MAX_SIZE,
        });
    }
    mem.write_slice(bytes, GuestAddress(CMDLINE_START))
        .map_err(|source| Error::Write {
            addr: CMDLINE_START,
            source,
        })?;
    Ok((GuestAddress(CMDLINE_START), bytes.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(cmdline: &Cmdline) -> String {
        cmdline.as_cstring().unwrap().into_string().unwrap()
    }

    #[test]
    fn joins_base_and_extras_with_single_spaces() {
        let extra = vec![
            "  root=/dev/vda ".to_string(),
            String::new(),
            "ro".to_string(),
        ];

        let cmdline = build_cmdline("console=ttyS0", &extra).unwrap();

        assert_eq!(text(&cmdline), "console=ttyS0 root=/dev/vda ro");
    }

    #[test]
    fn default_cmdline_builds_as_is() {
        let cmdline = build_cmdline(DEFAULT_CMDLINE, &[]).unwrap();

        assert_eq!(text(&cmdline), DEFAULT_CMDLINE);
    }

    #[test]
    fn accepts_exactly_the_limit() {
        let base = "a".repeat(CMDLINE_MAX_SIZE - 1);

        let cmdline = build_cmdline(&base, &[]).unwrap();

        assert_eq!(
            cmdline.as_cstring().unwrap().as_bytes_with_nul().len(),
            2048
        );
    }

    #[test]
    fn refuses_one_byte_over_the_limit() {
        let base = "a".repeat(CMDLINE_MAX_SIZE - 3);

        let err = build_cmdline(&base, &["bc".to_string()]).unwrap_err();

        assert!(
            matches!(
                err,
                super::super::Error::Cmdline(Error::TooLong {
                    len: 2049,
                    max: 2048
                })
            ),
            "{err}"
        );
        assert!(err.to_string().contains("2049 bytes"), "{err}");
    }

    #[test]
    fn refuses_nul_and_newline() {
        let nul = build_cmdline("console=ttyS0", &["init=/a\0b".to_string()]).unwrap_err();
        let newline = build_cmdline("console=ttyS0\nquiet", &[]).unwrap_err();
        let tab = build_cmdline("a\tb", &[]).unwrap_err();

        assert!(nul.to_string().contains("NUL"), "{nul}");
        assert!(newline.to_string().contains("newline"), "{newline}");
        assert!(tab.to_string().contains("not printable ASCII"), "{tab}");
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn loads_nul_terminated_at_the_cmdline_address() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let cmdline = build_cmdline("console=ttyS0", &[]).unwrap();

        let (addr, size) = load_cmdline(&mem, &cmdline).unwrap();

        let mut buf = vec![0u8; size];
        mem.read_slice(&mut buf, addr).unwrap();
        assert_eq!((addr.0, size), (CMDLINE_START, 14));
        assert_eq!(buf, b"console=ttyS0\0");
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn loading_without_memory_there_is_an_error() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x1000)]).unwrap();
        let cmdline = build_cmdline("console=ttyS0", &[]).unwrap();

        let err = load_cmdline(&mem, &cmdline).unwrap_err();

        assert!(err.to_string().contains("GPA 0x20000"), "{err}");
    }
}
