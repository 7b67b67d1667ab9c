//! Watching host processes from guest tests through pidfds (pidfd_open(2), Linux 5.3+): a pidfd
//! names one process and no other, even once its pid is reused.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

/// A pidfd of `pid`: readable once the process has ended.
///
/// # Panics
/// When the process does not exist (any more).
pub fn pidfd(pid: u32) -> OwnedFd {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    assert!(
        fd >= 0,
        "pidfd_open({pid}): {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: `fd` is a freshly opened descriptor that nothing else owns.
    unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) }
}

/// Whether the process behind the pidfd `fd` ends within `limit` (at most about 24 days).
pub fn ends_within(fd: &OwnedFd, limit: Duration) -> bool {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = limit.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: poll reads and writes the one valid pollfd for the duration of the call.
    unsafe { libc::poll(&mut pfd, 1, ms) == 1 }
}
