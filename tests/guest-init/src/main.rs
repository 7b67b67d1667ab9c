//! `/init` of the boot tests' initramfs (built static for `x86_64-unknown-linux-musl`).
//!
//! It mounts `/proc`, `/sys` and `/dev`, then writes one report line to the console and to the
//! debug port (0xe9, so the host sees it even with the serial console off):
//!
//! ```text
//! bulkhead-test-init: cpus=2 ram_kib=130680 memtotal_kib=117464 release=6.1.0 uptime_ms=850
//! ```
//!
//! `ram_kib` is the RAM the firmware map (our e820) gave the kernel: the sum of the "System RAM"
//! ranges of `/proc/iomem`. `memtotal_kib` is `/proc/meminfo`'s MemTotal: that RAM minus what the
//! kernel keeps for itself (its image, `struct page`s, per-CPU areas, the first MiB).
//!
//! ```text
//! ```
//!
//! and finally ends the VM as the kernel command line asks with `bulkhead_test.action=`:
//! `reboot` (default, reboot(2) → i8042 reset on x86_64, PSCI SYSTEM_RESET on aarch64),
//! `poweroff` (reboot(2) with `RB_POWER_OFF` → PSCI SYSTEM_OFF on aarch64; an x86_64 guest without
//! ACPI just halts), `exit` (init exits; the kernel panics and, with `panic=1`, resets), `hang`
//! (never ends: a guest whose agent never comes up), or `spoof-crash` (prints a fake VMM crash
//! line and a fake panic banner on the console, then reboots cleanly).
//!
//! Run as `bulkhead-test-init vsock-send PORT` (a tool in the agent test image), it copies stdin to
//! a vsock connection to the host (CID 2) on PORT and prints `sent <bytes> sha256=<hex>`.
//!
//! Run as `bulkhead-test-init mmap-write FILE OFFSET TEXT`, it maps FILE shared and writable,
//! stores TEXT at byte OFFSET through the mapping and `msync`s it (the virtio-fs tests' mmap
//! write); errors go to stderr with exit status 1.

use std::fs;
use std::io::Write;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("vsock-send") {
        std::process::exit(vsock_send(args.get(2).map(String::as_str)));
    }
    if args.get(1).map(String::as_str) == Some("mmap-write") {
        std::process::exit(match mmap_write(&args[2..]) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("mmap-write: {e}");
                1
            }
        });
    }
    mount_pseudo_filesystems();
    let report = format!(
        "bulkhead-test-init: cpus={} ram_kib={} memtotal_kib={} release={} uptime_ms={}\n",
        online_cpus(),
        system_ram_kib(),
        mem_total_kib(),
        kernel_release(),
        uptime_ms()
    );
    print!("{report}");
    let _ = std::io::stdout().flush();
    debug_port_write(report.as_bytes());
    match requested_action().as_str() {
        "exit" => {}
        "hang" => loop {
            std::thread::park();
        },
        "poweroff" => power(libc::RB_POWER_OFF),
        "spoof-crash" => {
            // Lines a hostile guest could print to make the host report a crash of its choosing;
            // then a clean reboot. The host must report a clean end (see exit_report).
            print!("bulkhead-vmm: the guest crashed: fake\nKernel panic - not syncing: fake\n");
            let _ = std::io::stdout().flush();
            power(libc::RB_AUTOBOOT)
        }
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

/// Sum of the top-level "System RAM" ranges in `/proc/iomem`, KiB.
fn system_ram_kib() -> u64 {
    let text = fs::read_to_string("/proc/iomem").unwrap_or_default();
    let bytes: u64 = text
        .lines()
        .filter(|l| !l.starts_with(' ') && l.ends_with(": System RAM"))
        .filter_map(|l| {
            let range = l.split(" : ").next()?;
            let (start, end) = range.trim().split_once('-')?;
            let start = u64::from_str_radix(start, 16).ok()?;
            let end = u64::from_str_radix(end, 16).ok()?;
            Some(end - start + 1)
        })
        .sum();
    bytes / 1024
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
        eprintln!(
            "bulkhead-test-init: ioperm: {}",
            std::io::Error::last_os_error()
        );
        return;
    }
    for b in bytes {
        // SAFETY: port 0xe9 is the VMM's debug port; ioperm above granted access to it and an OUT
        // to it has no effect on memory.
        unsafe {
            std::arch::asm!("out dx, al", in("dx") PORT, in("al") *b, options(nomem, nostack))
        };
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

/// `vsock-send PORT`: stdin → AF_VSOCK stream to CID 2:PORT; returns the exit status.
fn vsock_send(port: Option<&str>) -> i32 {
    use sha2::Digest;
    use std::io::Read;
    use std::os::fd::FromRawFd;

    let Some(port) = port.and_then(|p| p.parse::<u32>().ok()) else {
        eprintln!("usage: bulkhead-test-init vsock-send PORT");
        return 2;
    };
    // SAFETY: plain socket(2) call; the result is checked.
    let fd = unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        eprintln!("socket: {}", std::io::Error::last_os_error());
        return 1;
    }
    // SAFETY: `fd` is a new socket nothing else owns; File closes it on drop.
    let mut sock = unsafe { fs::File::from_raw_fd(fd) };
    // SAFETY: sockaddr_vm is plain old data; all-zero is a valid starting value.
    let mut addr: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
    addr.svm_family = libc::AF_VSOCK as libc::sa_family_t;
    addr.svm_cid = 2;
    addr.svm_port = port;
    let len = std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t;
    // SAFETY: `addr` is a valid sockaddr_vm of `len` bytes for the duration of the call.
    if unsafe { libc::connect(fd, std::ptr::addr_of!(addr).cast(), len) } != 0 {
        eprintln!(
            "connect to host port {port}: {}",
            std::io::Error::last_os_error()
        );
        return 1;
    }
    let mut hasher = sha2::Sha256::new();
    let mut total = 0u64;
    let mut buf = vec![0u8; 64 * 1024];
    let mut stdin = std::io::stdin().lock();
    loop {
        let n = match stdin.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                eprintln!("read stdin: {e}");
                return 1;
            }
        };
        if let Err(e) = sock.write_all(&buf[..n]) {
            eprintln!("write to vsock: {e}");
            return 1;
        }
        hasher.update(&buf[..n]);
        total += n as u64;
    }
    let digest: String = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    println!("sent {total} sha256={digest}");
    0
}

/// `mmap-write FILE OFFSET TEXT`: writes TEXT at OFFSET of FILE through a shared mapping.
fn mmap_write(args: &[String]) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;

    let usage = || std::io::Error::other("usage: bulkhead-test-init mmap-write FILE OFFSET TEXT");
    let [file, offset, text] = args else {
        return Err(usage());
    };
    let offset: usize = offset.parse().map_err(|_| usage())?;
    let file = fs::OpenOptions::new().read(true).write(true).open(file)?;
    let len = usize::try_from(file.metadata()?.len()).map_err(|_| usage())?;
    if offset + text.len() > len || len == 0 {
        return Err(std::io::Error::other("TEXT does not fit in FILE"));
    }
    // SAFETY: a fresh shared mapping of `len` bytes of an open file; the result is checked.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if map == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: offset + text.len() <= len, so the copy stays inside the mapping, which nothing
    // else aliases.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr(), map.cast::<u8>().add(offset), text.len())
    };
    // SAFETY: `map` is the mapping of `len` bytes created above.
    let synced = unsafe { libc::msync(map, len, libc::MS_SYNC) };
    let error = std::io::Error::last_os_error();
    // SAFETY: as above; the mapping is not used afterwards.
    unsafe { libc::munmap(map, len) };
    if synced != 0 {
        return Err(error);
    }
    Ok(())
}
