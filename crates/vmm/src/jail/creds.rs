//! Credentials and limits of the jailed VMM: the two-step drop from root to the jail's uid/gid
//! with no capabilities (see the module docs of [`super`]).
//!
//! Raw `capget`/`capset` use the version 3 ABI (`_LINUX_CAPABILITY_VERSION_3`, two 32-bit words
//! per set; capability(7)). Capability sets are per thread: everything here runs while the VMM
//! has one thread, and `setresuid` through glibc applies to every thread anyway.

use super::{check, Error};

/// `_LINUX_CAPABILITY_VERSION_3`.
const CAPABILITY_VERSION_3: u32 = 0x2008_0522;
/// `CAP_DAC_OVERRIDE`: bypass file read, write and execute permission checks.
const CAP_DAC_OVERRIDE: u32 = 1;
/// `CAP_DAC_READ_SEARCH`: bypass file read and directory search checks.
const CAP_DAC_READ_SEARCH: u32 = 2;
/// Highest capability number tried when emptying the bounding set; the kernel's own last one
/// (`/proc/sys/kernel/cap_last_cap`, 40 on 6.x) ends the loop earlier with `EINVAL`.
const MAX_CAPABILITY: u32 = 63;
/// "Leave unchanged" for `setresuid`.
const UNCHANGED: libc::uid_t = libc::uid_t::MAX;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// Sets `RLIMIT_CORE` to 0 (soft and hard): a crashing VMM leaves no image of guest memory.
pub(super) fn no_core_dumps() -> Result<(), Error> {
    let zero = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: setrlimit only reads the rlimit behind the valid reference.
    let rc = unsafe { libc::setrlimit(libc::RLIMIT_CORE, &zero) };
    check(rc.into(), || "setrlimit(RLIMIT_CORE, 0)".into())
}

/// First step, as root: empties the bounding and ambient sets, sets no_new_privs and
/// non-dumpable, makes `gid` the only group and every gid, and `uid` the effective uid with only
/// `CAP_DAC_OVERRIDE` and `CAP_DAC_READ_SEARCH` effective (the real and saved uids stay 0 until
/// [`finish`]).
pub(super) fn enter(uid: u32, gid: u32) -> Result<(), Error> {
    prctl(libc::PR_SET_DUMPABLE, 0, "PR_SET_DUMPABLE")?;
    drop_bounding_set()?;
    prctl(
        libc::PR_CAP_AMBIENT,
        libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
        "PR_CAP_AMBIENT_CLEAR_ALL",
    )?;
    prctl(libc::PR_SET_NO_NEW_PRIVS, 1, "PR_SET_NO_NEW_PRIVS")?;
    // SAFETY: setgroups with a zero count reads no memory.
    let rc = unsafe { libc::setgroups(0, std::ptr::null()) };
    check(rc.into(), || "setgroups([])".into())?;
    // SAFETY: setresgid takes three ids and no pointers.
    let rc = unsafe { libc::setresgid(gid, gid, gid) };
    check(rc.into(), || format!("setresgid({gid})"))?;
    // Leaving euid 0 clears the effective set; the permitted set stays (the real uid is 0).
    // SAFETY: setresuid takes three ids and no pointers.
    let rc = unsafe { libc::setresuid(UNCHANGED, uid, UNCHANGED) };
    check(rc.into(), || format!("seteuid({uid})"))?;
    let mut caps = capget()?;
    caps[0].effective = (1 << CAP_DAC_OVERRIDE) | (1 << CAP_DAC_READ_SEARCH);
    caps[1].effective = 0;
    for word in &mut caps {
        word.inheritable = 0;
    }
    capset(&caps)
}

/// Second step, after the build: every uid becomes `uid` (clearing the permitted and effective
/// sets), the sets are written empty for good measure, and the result is checked.
pub(super) fn finish(uid: u32, gid: u32) -> Result<(), Error> {
    // SAFETY: setresuid takes three ids and no pointers.
    let rc = unsafe { libc::setresuid(uid, uid, uid) };
    check(rc.into(), || format!("setresuid({uid})"))?;
    capset(&[CapData::default(); 2])?;
    verify(uid, gid)
}

/// Checks that nothing of root is left: no capability in any set, every uid and gid the
/// jail's, no supplementary group.
fn verify(uid: u32, gid: u32) -> Result<(), Error> {
    let caps = capget()?;
    if caps
        .iter()
        .any(|c| c.effective | c.permitted | c.inheritable != 0)
    {
        return Err(Error::PrivilegesRemain("capabilities".into()));
    }
    for cap in 0..=MAX_CAPABILITY {
        // SAFETY: PR_CAPBSET_READ takes a capability number and reads no memory.
        let rc = unsafe { libc::prctl(libc::PR_CAPBSET_READ, cap as libc::c_ulong) };
        if rc > 0 {
            return Err(Error::PrivilegesRemain(format!("bounding set has {cap}")));
        }
        if rc < 0 {
            break;
        }
    }
    let (mut r, mut e, mut s) = (0, 0, 0);
    // SAFETY: getresuid writes three ids to the valid, exclusively borrowed locals.
    let rc = unsafe { libc::getresuid(&mut r, &mut e, &mut s) };
    check(rc.into(), || "getresuid".into())?;
    let (mut rg, mut eg, mut sg) = (0, 0, 0);
    // SAFETY: getresgid writes three ids to the valid, exclusively borrowed locals.
    let rc = unsafe { libc::getresgid(&mut rg, &mut eg, &mut sg) };
    check(rc.into(), || "getresgid".into())?;
    // SAFETY: getgroups with a zero size only returns the number of groups.
    let groups = unsafe { libc::getgroups(0, std::ptr::null_mut()) };
    if [r, e, s] != [uid; 3] || [rg, eg, sg] != [gid; 3] || groups != 0 {
        return Err(Error::PrivilegesRemain(format!(
            "uids {r}/{e}/{s}, gids {rg}/{eg}/{sg}, {groups} supplementary groups"
        )));
    }
    Ok(())
}

/// Removes every capability from the bounding set (needs `CAP_SETPCAP`, so before any uid
/// change); the process's own sets are not touched by this.
fn drop_bounding_set() -> Result<(), Error> {
    for cap in 0..=MAX_CAPABILITY {
        // SAFETY: PR_CAPBSET_DROP takes a capability number and reads no memory.
        let rc = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong) };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EINVAL) && cap > 0 {
                return Ok(());
            }
            return Err(Error::Sys {
                what: format!("PR_CAPBSET_DROP({cap})"),
                source: err,
            });
        }
    }
    Ok(())
}

fn prctl(option: libc::c_int, arg: libc::c_ulong, what: &str) -> Result<(), Error> {
    let zero: libc::c_ulong = 0;
    // SAFETY: the options used here take integer arguments and read no memory.
    let rc = unsafe { libc::prctl(option, arg, zero, zero, zero) };
    check(rc.into(), || what.into())
}

fn capget() -> Result<[CapData; 2], Error> {
    let mut header = CapHeader {
        version: CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: capget reads `header` and writes two CapData words (version 3) into `data`; both
    // live across the call.
    let rc = unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) };
    check(rc, || "capget".into())?;
    Ok(data)
}

fn capset(data: &[CapData; 2]) -> Result<(), Error> {
    let mut header = CapHeader {
        version: CAPABILITY_VERSION_3,
        pid: 0,
    };
    // SAFETY: capset reads `header` and two CapData words from `data`, both valid for the call;
    // it changes only the calling thread's capability sets.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) };
    check(rc, || "capset".into())
}
