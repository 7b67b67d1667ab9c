//! The signal thread's allowlist.
//!
//! The thread blocks reading signal-hook's socket pair until SIGTERM, SIGINT or SIGHUP arrives,
//! then records the stop (a mutex and an eventfd `write`) and ends, closing the socket pair.

use super::rules::{common, Allowlist, Arg};

/// [`common`] plus signal-hook's wait.
pub(super) fn allowlist() -> Allowlist {
    let mut list = common();
    // signal-hook's iterator reads its socket pair (std's `read` on a Unix stream is a
    // `recvfrom` without an address), blocking and with MSG_DONTWAIT to drain it.
    list.allow(&[libc::SYS_read]);
    for flags in [0, libc::MSG_DONTWAIT] {
        list.allow_if(
            libc::SYS_recvfrom,
            &[Arg::Eq(3, flags as u64), Arg::Null(4)],
        );
    }
    // The thread's end drops signal-hook's socket pair.
    list.allow(&[libc::SYS_close]);
    list
}
