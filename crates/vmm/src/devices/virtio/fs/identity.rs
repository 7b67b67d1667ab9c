//! Whose credentials the file server's host operations run with.
//!
//! The guest's FUSE requests carry the uid/gid of the guest process; they mean nothing on the host
//! and are ignored. Instead every operation runs as the share's *owner*:
//!
//! - When the VMM runs as root, [`Identity::assume`] switches the calling thread's effective uid,
//!   effective gid and supplementary groups (to just the owner's gid) for the duration of one
//!   request, and the returned guard switches back. Raw `setresuid`/`setresgid`/`setgroups`
//!   system calls are used because the libc wrappers change every thread of the process. Leaving
//!   uid 0 clears the thread's effective capabilities, so the kernel checks permissions exactly as
//!   for the owner; returning to uid 0 restores them (the real and saved uids stay 0).
//! - Without root the VMM cannot switch; its own identity is the owner, and operations run as it.
//!
//! The process umask is a separate matter: the passthrough file system applies the guest's umask
//! itself and expects the process umask to be 0 when it creates files. [`UmaskCleared`] sets it to
//! 0 around such calls and restores it afterwards, one holder at a time (a process-wide lock), so
//! concurrent holders cannot leave it at 0. The umask is process-wide, so a file another thread of
//! the VMM creates during that window is created without it.

use std::io;
use std::sync::{Mutex, MutexGuard};

/// `(uid_t)-1` / `(gid_t)-1`: "leave this ID unchanged" for `setresuid`/`setresgid`.
const UNCHANGED: u32 = u32::MAX;
/// `_LINUX_CAPABILITY_VERSION_3` (64-bit capability sets, two `CapData` words).
const CAPABILITY_VERSION_3: u32 = 0x2008_0522;
/// `CAP_DAC_READ_SEARCH`.
const CAP_DAC_READ_SEARCH: u32 = 2;

/// The host identity a share is served as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Identity {
    /// Owner uid: the effective uid of host operations and of the files the guest creates.
    pub uid: u32,
    /// Owner gid.
    pub gid: u32,
    /// Whether the VMM must switch credentials to act as the owner (it runs as root and the owner
    /// is someone else).
    switch: bool,
}

impl Identity {
    /// The identity for a share whose directory is owned by `dir_owner`, given the configured
    /// `owner` (if any) and the VMM's effective uid/gid `process`.
    ///
    /// As root: the configured owner, else the directory's owner. Without root: the VMM's own
    /// identity, which a configured owner must match.
    ///
    /// # Errors
    /// `(uid, gid)` of a configured owner the VMM cannot act as, as `Err((uid, gid))`.
    pub fn resolve(
        owner: Option<(u32, u32)>,
        dir_owner: (u32, u32),
        process: (u32, u32),
    ) -> Result<Identity, (u32, u32)> {
        let privileged = process.0 == 0;
        let (uid, gid) = match (privileged, owner) {
            (true, Some(owner)) => owner,
            (true, None) => dir_owner,
            (false, Some(owner)) if owner != process => return Err(owner),
            (false, _) => process,
        };
        let switch = privileged && (uid, gid) != process;
        Ok(Identity { uid, gid, switch })
    }

    /// The identity of the running VMM (effective uid and gid).
    pub fn process() -> (u32, u32) {
        // SAFETY: geteuid and getegid only read the calling thread's credentials.
        unsafe { (libc::geteuid(), libc::getegid()) }
    }

    /// Whether operations run as host root (uid 0).
    pub fn is_root(&self) -> bool {
        self.uid == 0
    }

    /// Switches the calling thread to the owner's credentials until the guard is dropped (no-op
    /// when no switch is needed).
    ///
    /// # Errors
    /// The OS error of a failed switch; whatever was switched is switched back.
    pub fn assume(&self) -> io::Result<Assumed> {
        if !self.switch {
            return Ok(Assumed { saved: None });
        }
        // The guard exists before the first change, so a partial switch is undone on error.
        let guard = Assumed {
            saved: Some(Saved::capture()?),
        };
        set_groups(&[self.gid])?;
        set_egid(self.gid)?;
        set_euid(self.uid)?;
        Ok(guard)
    }
}

/// The calling thread runs as a share's owner until this is dropped.
#[derive(Debug)]
#[must_use = "the credentials are switched back when the guard is dropped"]
pub struct Assumed {
    saved: Option<Saved>,
}

impl Assumed {
    /// Makes `CAP_DAC_READ_SEARCH` effective again while acting as the owner, if the thread still
    /// has it in its permitted set. Kernels before 6.10 require it for `linkat(AT_EMPTY_PATH)`,
    /// which is how the passthrough file system creates hard links from its `O_PATH` fds. It stays
    /// effective until the guard is dropped; the next switch to the owner clears it again.
    ///
    /// # Errors
    /// The `capget`/`capset` error.
    pub fn allow_link_by_fd(&self) -> io::Result<()> {
        if self.saved.is_none() {
            return Ok(());
        }
        let mut header = CapHeader {
            version: CAPABILITY_VERSION_3,
            pid: 0,
        };
        let mut data = [CapData::default(); 2];
        // SAFETY: capget writes two CapData words (version 3) into `data` and reads `header`;
        // both live across the call.
        check(unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) })?;
        let bit = 1u32 << CAP_DAC_READ_SEARCH;
        if data[0].permitted & bit == 0 {
            return Ok(());
        }
        data[0].effective |= bit;
        // SAFETY: capset reads `header` and two CapData words from `data`, both valid; it only
        // changes the calling thread's capability sets.
        check(unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) })
    }
}

impl Drop for Assumed {
    fn drop(&mut self) {
        let Some(saved) = self.saved.take() else {
            return;
        };
        // The uid first: back at uid 0 the thread has CAP_SETGID again for the rest.
        let restored = set_euid(saved.euid)
            .and_then(|()| set_egid(saved.egid))
            .and_then(|()| set_groups(&saved.groups));
        if let Err(e) = restored {
            tracing::error!("virtio-fs: cannot restore the event loop's credentials: {e}");
        }
    }
}

/// The thread's credentials before a switch.
#[derive(Debug)]
struct Saved {
    euid: u32,
    egid: u32,
    groups: Vec<libc::gid_t>,
}

impl Saved {
    fn capture() -> io::Result<Saved> {
        let (euid, egid) = Identity::process();
        Ok(Saved {
            euid,
            egid,
            groups: get_groups()?,
        })
    }
}

/// The calling thread's supplementary groups.
fn get_groups() -> io::Result<Vec<libc::gid_t>> {
    // SAFETY: with a zero size getgroups only returns the number of groups.
    let count = unsafe { libc::getgroups(0, std::ptr::null_mut()) };
    let len = usize::try_from(count).map_err(|_| io::Error::last_os_error())?;
    let mut groups = vec![0; len];
    // SAFETY: `groups` has room for `count` gid_t values, the size passed.
    let got = unsafe { libc::getgroups(count, groups.as_mut_ptr()) };
    let got = usize::try_from(got).map_err(|_| io::Error::last_os_error())?;
    groups.truncate(got);
    Ok(groups)
}

/// Sets the calling thread's supplementary groups (not the whole process's).
fn set_groups(groups: &[libc::gid_t]) -> io::Result<()> {
    // SAFETY: setgroups reads `groups.len()` gid_t values from a live slice.
    check(unsafe { libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) })
}

/// Sets the calling thread's effective uid, leaving the real and saved uids.
fn set_euid(uid: u32) -> io::Result<()> {
    // SAFETY: setresuid takes three integers and touches no memory.
    check(unsafe { libc::syscall(libc::SYS_setresuid, UNCHANGED, uid, UNCHANGED) })
}

/// Sets the calling thread's effective gid, leaving the real and saved gids.
fn set_egid(gid: u32) -> io::Result<()> {
    // SAFETY: setresgid takes three integers and touches no memory.
    check(unsafe { libc::syscall(libc::SYS_setresgid, UNCHANGED, gid, UNCHANGED) })
}

fn check(ret: libc::c_long) -> io::Result<()> {
    if ret == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `struct __user_cap_header_struct`.
#[repr(C)]
#[derive(Debug)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

/// `struct __user_cap_data_struct`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// Serialises [`UmaskCleared`] holders.
static UMASK_LOCK: Mutex<()> = Mutex::new(());

/// The process umask is 0 until this is dropped, then back to its previous value.
#[derive(Debug)]
#[must_use = "the umask is restored when the guard is dropped"]
pub struct UmaskCleared {
    previous: libc::mode_t,
    /// Released after `drop` restored the umask.
    _exclusive: MutexGuard<'static, ()>,
}

impl UmaskCleared {
    /// Clears the umask, waiting for any other holder to restore it first.
    pub fn new() -> UmaskCleared {
        let exclusive = UMASK_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: umask only swaps the process's file mode creation mask.
        let previous = unsafe { libc::umask(0) };
        UmaskCleared {
            previous,
            _exclusive: exclusive,
        }
    }
}

impl Default for UmaskCleared {
    fn default() -> Self {
        UmaskCleared::new()
    }
}

impl Drop for UmaskCleared {
    fn drop(&mut self) {
        // SAFETY: as in `new`.
        unsafe { libc::umask(self.previous) };
    }
}
