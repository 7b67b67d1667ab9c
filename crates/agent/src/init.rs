//! PID-1 duties: pseudo-filesystems, console descriptors, hostname, debug-port banner and
//! the final reboot.

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::fd::AsRawFd;

use crate::log;

/// Hostname when the boot parameters give none (`bulkhead.hostname=`).
pub const DEFAULT_HOSTNAME: &str = "bulkhead";

/// `PATH` of the agent itself.
pub const AGENT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// One mount: source, target, type, flags, data.
type MountSpec = (
    &'static str,
    &'static str,
    &'static str,
    libc::c_ulong,
    &'static str,
);

const NOSUID: libc::c_ulong = libc::MS_NOSUID;
const NODEV: libc::c_ulong = libc::MS_NODEV;
const NOEXEC: libc::c_ulong = libc::MS_NOEXEC;

/// The guest's pseudo-filesystems, in mount order.
const MOUNTS: [MountSpec; 7] = [
    ("proc", "/proc", "proc", NOSUID | NODEV | NOEXEC, ""),
    ("sysfs", "/sys", "sysfs", NOSUID | NODEV | NOEXEC, ""),
    ("devtmpfs", "/dev", "devtmpfs", NOSUID, "mode=0755"),
    (
        "devpts",
        "/dev/pts",
        "devpts",
        NOSUID | NOEXEC,
        "mode=0620,ptmxmode=0666",
    ),
    ("tmpfs", "/dev/shm", "tmpfs", NOSUID | NODEV, "mode=1777"),
    ("tmpfs", "/tmp", "tmpfs", NOSUID | NODEV, "mode=1777"),
    ("tmpfs", "/run", "tmpfs", NOSUID | NODEV, "mode=0755"),
];

/// `/dev` symlinks that shells expect (process substitution, `/dev/stdin`).
const DEV_LINKS: [(&str, &str); 4] = [
    ("/proc/self/fd", "/dev/fd"),
    ("/proc/self/fd/0", "/dev/stdin"),
    ("/proc/self/fd/1", "/dev/stdout"),
    ("/proc/self/fd/2", "/dev/stderr"),
];

/// Mounts the pseudo-filesystems, points fds 0–2 at `/dev/console`, switches logging to the
/// console and sets `PATH`. Call first thing in `main`, before any thread.
pub fn setup() {
    for spec in MOUNTS {
        mount(spec);
    }
    for (target, link) in DEV_LINKS {
        let _ = std::os::unix::fs::symlink(target, link);
    }
    console_on_std_fds();
    log::use_console();
    std::env::set_var("PATH", AGENT_PATH);
}

/// Sets the guest's hostname to `name` (the boot parameter's, already validated), or
/// [`DEFAULT_HOSTNAME`]; a failure is logged.
pub fn hostname(name: Option<&str>) {
    let name = name.unwrap_or(DEFAULT_HOSTNAME);
    if let Err(e) = set_hostname(name) {
        log!("sethostname {name}: {e}");
    }
}

fn mount((source, target, fstype, flags, data): MountSpec) {
    let _ = fs::create_dir_all(target);
    let (Ok(src), Ok(dst), Ok(ty), Ok(opts)) = (
        CString::new(source),
        CString::new(target),
        CString::new(fstype),
        CString::new(data),
    ) else {
        return;
    };
    // SAFETY: every pointer is a NUL-terminated string that outlives the call.
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            dst.as_ptr(),
            ty.as_ptr(),
            flags,
            opts.as_ptr().cast(),
        )
    };
    if rc != 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EBUSY) {
            log!("mount {fstype} on {target}: {e}");
        }
    }
}

/// Makes fds 0, 1 and 2 refer to `/dev/console`, so that anything printed (a panic message)
/// reaches the console. Leaves them alone when the console cannot be opened.
fn console_on_std_fds() {
    let Ok(console) = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/console")
    else {
        return;
    };
    for fd in 0..3 {
        // SAFETY: dup2 onto 0..=2 only replaces the standard descriptors, which the agent
        // uses for nothing but diagnostics; `console` is a valid open descriptor.
        unsafe { libc::dup2(console.as_raw_fd(), fd) };
    }
}

/// `sethostname(2)`; `name` must already be valid (see `bulkhead_protocol::boot::check_hostname`).
pub(crate) fn set_hostname(name: &str) -> io::Result<()> {
    // SAFETY: `name` points to `name.len()` readable bytes for the duration of the call.
    if unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Writes `bytes` to the debug I/O port 0xe9, which the VMM copies to its log even when the
/// serial console is off. x86_64 only; a no-op elsewhere.
#[cfg(target_arch = "x86_64")]
pub fn debug_port_write(bytes: &[u8]) {
    const PORT: u16 = 0xe9;
    // SAFETY: ioperm only changes this process's I/O permission bitmap.
    if unsafe { libc::ioperm(libc::c_ulong::from(PORT), 1, 1) } != 0 {
        log!("ioperm 0xe9: {}", io::Error::last_os_error());
        return;
    }
    for b in bytes {
        // SAFETY: ioperm above granted access to port 0xe9, the VMM's debug port; an OUT to
        // it touches no memory.
        unsafe {
            std::arch::asm!("out dx, al", in("dx") PORT, in("al") *b, options(nomem, nostack))
        };
    }
}

/// Writes `bytes` to the debug port (x86_64 only; nothing to do here).
#[cfg(not(target_arch = "x86_64"))]
pub fn debug_port_write(_bytes: &[u8]) {}

/// Flushes filesystems and resets the guest (`reboot(RB_AUTOBOOT)`), which the VMM treats as
/// a clean exit. If the kernel refuses, the agent exits (as PID 1 that panics the guest).
pub fn reboot() -> ! {
    // SAFETY: sync and reboot take no pointers; as PID 1 with CAP_SYS_BOOT this ends the VM.
    let rc = unsafe {
        libc::sync();
        libc::reboot(libc::RB_AUTOBOOT)
    };
    log!("reboot failed ({rc}): {}", io::Error::last_os_error());
    std::process::exit(1)
}
