//! `/init` of the boot tests' initramfs (built static for `x86_64-unknown-linux-musl`).
//!
//! It mounts `/proc`, `/sys` and `/dev`, then writes one report line to the console and to the
//! debug port (0xe9, so the host sees it even with the serial console off):
//!
//! ```text
//! bulkhead-test-init: cpus=2 memtotal_kib=123456 release=6.1.0 uptime_ms=850
//! ```
//!
//! and finally ends the VM as the kernel command line asks with `bulkhead_test.action=`:
//! `reboot` (default, reboot(2) → i8042 reset), `poweroff` (reboot(2) POWER_OFF; on x86 without ACPI
//! the kernel halts and init's exit panics into a reset), or `exit` (init exits; the kernel panics
//! and, with `panic=1`, resets).

use std::fs;
use std::io::Write;

fn main() {
    mount_pseudo_filesystems();
    let report = format!(
        "bulkhead-test-init: cpus={} memtotal_kib={} release={} uptime_ms={}\n",
        online_cpus(),
        mem_total_kib(),
        kernel_release(),
        uptime_ms()
    );
    print!("{report}");
    let _ = std::io::stdout().flush();
    debug_port_write(report.as_bytes());
    match requested_action().as_str() {
        "exit" => {}
        "poweroff" => power(libc::RB_POWER_OFF),
        _ => power(libc::RB_AUTOBOOT),
    }
}

fn mount_pseudo_filesystems() {
    for (src, target, fstype) in [
        ("proc", "/proc", "proc"),
        ("sysfs", "/sys", "sysfs"),
        ("devtmpfs", "/dev", "devtmpfs"),
    ] {
        let _ = fs::create_dir_all(target);
        let src = std::ffi::CString::new(src).unwrap_or_default();
        let target_c = std::ffi::CString::new(target).unwrap_or_default();
        let fstype = std::ffi::CString::new(fstype).unwrap_or_default();
        // SAFETY: all pointers are NUL-terminated strings that outlive the call; data is null.
        let rc = unsafe {
            libc::mount(
                src.as_ptr(),
                target_c.as_ptr(),
                fstype.as_ptr(),
                0,
                std::ptr::null(),
            )
        };
        if rc != 0 {
            eprintln!(
                "bulkhead-test-init: mount {target}: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

/// Number of online CPUs, from `/sys/devices/system/cpu/online` ("0-1" → 2).
fn online_cpus() -> usize {
    let text = fs::read_to_string("/sys/devices/system/cpu/online").unwrap_or_default();
    text.trim()
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|range| match range.split_once('-') {
            Some((a, b)) => {
                let a: usize = a.parse().unwrap_or(0);
                let b: usize = b.parse().unwrap_or(a);
                b.saturating_sub(a) + 1
            }
            None => 1,
        })
        .sum()
}

fn mem_total_kib() -> u64 {
    let text = fs::read_to_string("/proc/meminfo").unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Guest uptime at the time of the report, ms (first field of `/proc/uptime`).
fn uptime_ms() -> u64 {
    let text = fs::read_to_string("/proc/uptime").unwrap_or_default();
    let secs: f64 = text
        .split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    (secs * 1000.0) as u64
}

fn kernel_release() -> String {
    fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "unknown".into())
}

fn requested_action() -> String {
    let cmdline = fs::read_to_string("/proc/cmdline").unwrap_or_default();
    cmdline
        .split_whitespace()
        .find_map(|p| p.strip_prefix("bulkhead_test.action="))
        .unwrap_or("reboot")
        .to_owned()
}

#[cfg(target_arch = "x86_64")]
fn debug_port_write(bytes: &[u8]) {
    const PORT: u16 = 0xe9;
    // SAFETY: ioperm only changes this process's I/O permission bitmap.
    if unsafe { libc::ioperm(u64::from(PORT), 1, 1) } != 0 {
        eprintln!("bulkhead-test-init: ioperm: {}", std::io::Error::last_os_error());
        return;
    }
    for b in bytes {
        // SAFETY: port 0xe9 is the VMM's debug port; ioperm above granted access to it and an OUT
        // to it has no effect on memory.
        unsafe { std::arch::asm!("out dx, al", in("dx") PORT, in("al") *b, options(nomem, nostack)) };
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn debug_port_write(_bytes: &[u8]) {}

fn power(cmd: libc::c_int) {
    // SAFETY: sync and reboot take no pointers; as PID 1 with CAP_SYS_BOOT this ends the VM.
    unsafe {
        libc::sync();
        libc::reboot(cmd);
    }
}
