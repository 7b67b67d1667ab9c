//! Process resource limits the VMM needs for itself.
//!
//! The virtio-fs server (fuse-backend-rs's passthrough file system) keeps one open file
//! descriptor per inode the guest has looked up and not yet forgotten, so a guest walking a
//! share of a few thousand files needs a few thousand descriptors. Login sessions and many
//! service managers start processes with a soft `RLIMIT_NOFILE` of 1024, where `find` over a
//! real repository fails in the guest with `EMFILE` ("Too many open files").
//! [`raise_open_files_limit`] lifts the soft limit to the hard one (and, with
//! `CAP_SYS_RESOURCE`, the hard one to [`OPEN_FILES_TARGET`]), which also bounds how many host
//! descriptors one guest can pin.

use std::io;

/// Open files the VMM asks for: 2^20 (1,048,576), Linux's default `fs.nr_open`, the ceiling
/// for a per-process limit.
pub const OPEN_FILES_TARGET: u64 = 1 << 20;

/// The process's `RLIMIT_NOFILE` as `(soft, hard)`.
///
/// # Errors
/// `getrlimit(2)` failed (it does not for `RLIMIT_NOFILE` on Linux).
pub fn open_files_limit() -> io::Result<(u64, u64)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `rlimit` to the valid, exclusively borrowed `lim`.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((lim.rlim_cur, lim.rlim_max))
}

fn set_open_files_limit(soft: u64, hard: u64) -> io::Result<()> {
    let lim = libc::rlimit {
        rlim_cur: soft,
        rlim_max: hard,
    };
    // SAFETY: setrlimit only reads the `rlimit` behind the valid reference.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Raises the soft `RLIMIT_NOFILE` as far as this process may, up to [`OPEN_FILES_TARGET`]:
/// first the hard limit to the target when that is higher (needs `CAP_SYS_RESOURCE`; without it
/// the hard limit stays), then the soft limit to `min(hard, target)`. Never lowers a limit.
/// Returns the new `(soft, hard)`.
///
/// # Errors
/// `getrlimit`/`setrlimit` failed for another reason than a missing capability.
///
/// # Examples
/// ```
/// let (soft, hard) = bulkhead_vmm::limits::raise_open_files_limit().unwrap();
/// assert!(soft == hard || soft == bulkhead_vmm::limits::OPEN_FILES_TARGET);
/// ```
pub fn raise_open_files_limit() -> io::Result<(u64, u64)> {
    let (soft, mut hard) = open_files_limit()?;
    if hard < OPEN_FILES_TARGET {
        match set_open_files_limit(soft, OPEN_FILES_TARGET) {
            Ok(()) => hard = OPEN_FILES_TARGET,
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => {}
            Err(e) => return Err(e),
        }
    }
    let wanted = hard.min(OPEN_FILES_TARGET);
    if soft < wanted {
        set_open_files_limit(wanted, hard)?;
    }
    open_files_limit()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_limit_reaches_the_hard_limit_or_the_target() {
        // Arrange: a low soft limit, as a login session would give.
        let (_, hard) = open_files_limit().unwrap();
        set_open_files_limit(hard.min(256), hard).unwrap();

        // Act
        let (soft, new_hard) = raise_open_files_limit().unwrap();

        // Assert
        assert!(new_hard >= hard, "the hard limit never goes down");
        assert_eq!(soft, new_hard.min(OPEN_FILES_TARGET));
    }
}
