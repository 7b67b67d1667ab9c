//! The SIGSYS handler: reports a blocked system call and ends the process.
//!
//! With `SECCOMP_RET_TRAP` the kernel skips the blocked call and sends the calling thread SIGSYS
//! with the call's number in `si_syscall`. The handler only formats into a stack buffer, makes one
//! `write(2)` to stderr and calls `_exit(2)` — all async-signal-safe, and both calls are in every
//! thread's allowlist. It cannot return: the interrupted code would go on with a call that never
//! happened.

use std::cell::Cell;
use std::io;
use std::sync::atomic::{AtomicI32, Ordering};

use super::ThreadKind;

/// Exit status of `bulkhead-vmm` when a seccomp filter blocked a system call.
pub const EXIT_BLOCKED_SYSCALL: i32 = 4;

/// `si_code` of a SIGSYS sent by seccomp (`SYS_SECCOMP` in `<asm-generic/siginfo.h>`).
const SYS_SECCOMP: libc::c_int = 1;

thread_local! {
    /// The kind of filter this thread installed, for the log line. `const`-initialised and
    /// without a destructor, so reading it is a plain TLS load, safe in a signal handler.
    static KIND: Cell<Option<ThreadKind>> = const { Cell::new(None) };
}

/// The exit file's descriptor (`bulkhead-vmm --exit-file`), or -1: where the handler writes its
/// report (see [`crate::exit_report`]). An atomic load is async-signal-safe.
static REPORT_FD: AtomicI32 = AtomicI32::new(-1);

/// Makes the handler also write its exit report to `fd` (which must stay open for the life of
/// the process).
pub(super) fn set_report_fd(fd: libc::c_int) {
    REPORT_FD.store(fd, Ordering::SeqCst);
}

/// Records which filter the calling thread runs under.
pub(super) fn set_thread_kind(kind: ThreadKind) {
    KIND.with(|k| k.set(Some(kind)));
}

/// The start of a 64-bit Linux `siginfo_t` as SIGSYS fills it (`struct { int si_signo, si_errno,
/// si_code; union { ... struct { void *_call_addr; int _syscall; unsigned int _arch; } } }`; the
/// union is 8-byte aligned, hence the padding).
#[repr(C)]
struct SigsysInfo {
    signo: libc::c_int,
    errno: libc::c_int,
    code: libc::c_int,
    _pad: libc::c_int,
    call_addr: *mut libc::c_void,
    syscall: libc::c_int,
    arch: libc::c_uint,
}

const _: () = assert!(std::mem::size_of::<SigsysInfo>() <= std::mem::size_of::<libc::siginfo_t>());

extern "C" fn on_sigsys(_: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    let syscall = if info.is_null() {
        None
    } else {
        // SAFETY: the kernel passes a valid siginfo_t (SA_SIGINFO), at least as large as
        // SigsysInfo, whose layout matches the SIGSYS member of its union on 64-bit Linux.
        let info = unsafe { &*info.cast::<SigsysInfo>() };
        (info.code == SYS_SECCOMP).then_some(info.syscall)
    };
    let kind = KIND.with(Cell::get);
    let mut buf = [0u8; 128];
    let len = format_message(&mut buf, syscall, kind);
    let mut report = [0u8; 256];
    let report_len = format_report(&mut report, syscall, kind);
    let report_fd = REPORT_FD.load(Ordering::SeqCst);
    // SAFETY: write(2) reads `len` (`report_len`) initialised bytes of `buf` (`report`); a bad
    // descriptor only makes it fail; _exit(2) never returns. Both are async-signal-safe and
    // allowed by every filter.
    unsafe {
        libc::write(libc::STDERR_FILENO, buf.as_ptr().cast(), len);
        if report_fd >= 0 {
            libc::write(report_fd, report.as_ptr().cast(), report_len);
        }
        libc::_exit(EXIT_BLOCKED_SYSCALL);
    }
}

/// Writes the exit report (`crate::exit_report::ExitReport` as JSON, reason `seccomp`) into
/// `buf` without allocating; returns its length (truncated to `buf`).
fn format_report(buf: &mut [u8], syscall: Option<libc::c_int>, kind: Option<ThreadKind>) -> usize {
    let mut out = Cursor { buf, len: 0 };
    out.put(b"{\"version\":1,\"reason\":\"seccomp\",\"exit_code\":");
    out.put_int(i64::from(EXIT_BLOCKED_SYSCALL));
    let thread = kind
        .map_or("unfiltered thread", ThreadKind::label)
        .as_bytes();
    match syscall {
        Some(nr) => {
            out.put(b",\"blocked_syscall\":{\"nr\":");
            out.put_int(i64::from(nr));
            out.put(b",\"thread\":\"");
            out.put(thread);
            out.put(b"\"}}\n");
        }
        None => {
            out.put(b",\"detail\":\"SIGSYS not sent by a filter (");
            out.put(thread);
            out.put(b")\"}\n");
        }
    }
    out.len
}

/// Writes `bulkhead-vmm: seccomp: blocked syscall N (<kind>)\n` into `buf` without allocating;
/// returns its length (truncated to `buf`).
fn format_message(buf: &mut [u8], syscall: Option<libc::c_int>, kind: Option<ThreadKind>) -> usize {
    let mut out = Cursor { buf, len: 0 };
    match syscall {
        Some(nr) => {
            out.put(b"bulkhead-vmm: seccomp: blocked syscall ");
            out.put_int(i64::from(nr));
        }
        None => out.put(b"bulkhead-vmm: seccomp: SIGSYS not sent by a filter"),
    }
    out.put(b" (");
    out.put(
        kind.map_or("unfiltered thread", ThreadKind::label)
            .as_bytes(),
    );
    out.put(b")\n");
    out.len
}

/// A bounded, allocation-free writer.
struct Cursor<'a> {
    buf: &'a mut [u8],
    len: usize,
}

impl Cursor<'_> {
    fn put(&mut self, bytes: &[u8]) {
        for &b in bytes {
            if let Some(slot) = self.buf.get_mut(self.len) {
                *slot = b;
                self.len += 1;
            }
        }
    }

    fn put_int(&mut self, value: i64) {
        if value < 0 {
            self.put(b"-");
        }
        let mut digits = [0u8; 20];
        let mut n = value.unsigned_abs();
        let mut start = digits.len();
        loop {
            start -= 1;
            digits[start] = b'0' + (n % 10) as u8;
            n /= 10;
            if n == 0 {
                break;
            }
        }
        self.put(&digits[start..]);
    }
}

/// Installs [`on_sigsys`] as the process's SIGSYS handler.
pub(super) fn install_handler() -> io::Result<()> {
    // SAFETY: an all-zero sigaction is valid (empty mask, no flags); the fields are set below.
    let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
    action.sa_sigaction = on_sigsys as *const () as libc::sighandler_t;
    action.sa_flags = libc::SA_SIGINFO;
    // SAFETY: `action` is a valid sigaction whose handler only performs async-signal-safe work;
    // the old action is not requested.
    let ret = unsafe { libc::sigaction(libc::SIGSYS, &action, std::ptr::null_mut()) };
    if ret != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(syscall: Option<libc::c_int>, kind: Option<ThreadKind>) -> String {
        let mut buf = [0u8; 128];
        let len = format_message(&mut buf, syscall, kind);
        String::from_utf8(buf[..len].to_vec()).unwrap()
    }

    #[test]
    fn message_names_the_call_and_the_thread_kind() {
        assert_eq!(
            message(Some(41), Some(ThreadKind::EventLoop)),
            "bulkhead-vmm: seccomp: blocked syscall 41 (event loop)\n"
        );
        assert_eq!(
            message(Some(0), Some(ThreadKind::Vcpu)),
            "bulkhead-vmm: seccomp: blocked syscall 0 (vcpu)\n"
        );
        assert_eq!(
            message(Some(-7), None),
            "bulkhead-vmm: seccomp: blocked syscall -7 (unfiltered thread)\n"
        );
    }

    #[test]
    fn a_signal_not_from_seccomp_says_so() {
        assert_eq!(
            message(None, Some(ThreadKind::Signal)),
            "bulkhead-vmm: seccomp: SIGSYS not sent by a filter (signal)\n"
        );
    }

    #[test]
    fn the_report_is_an_exit_report_naming_the_call() {
        // Arrange
        let mut buf = [0u8; 256];

        // Act
        let len = format_report(&mut buf, Some(41), Some(ThreadKind::Vcpu));
        let unfiltered = {
            let mut other = [0u8; 256];
            let n = format_report(&mut other, None, None);
            crate::exit_report::ExitReport::parse(&other[..n]).unwrap()
        };

        // Assert
        let report = crate::exit_report::ExitReport::parse(&buf[..len]).unwrap();
        assert_eq!(report.exit_code, EXIT_BLOCKED_SYSCALL);
        assert_eq!(
            report.describe(),
            "the VMM's seccomp filter blocked syscall 41 (vcpu)"
        );
        assert!(unfiltered
            .describe()
            .contains("not sent by a filter (unfiltered thread)"));
    }

    #[test]
    fn a_short_buffer_truncates_instead_of_overflowing() {
        let mut buf = [0u8; 10];

        let len = format_message(&mut buf, Some(i32::MAX), Some(ThreadKind::Vcpu));

        assert_eq!(&buf[..len], b"bulkhead-v");
    }
}
