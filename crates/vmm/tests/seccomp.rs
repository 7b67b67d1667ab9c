//! The seccomp filters in a real process: each test re-runs this test binary as a child (only its
//! `child_process` helper, told what to do by an environment variable), which installs one of
//! `bulkhead-vmm`'s filters on its thread and then makes a system call outside the allowlist.
//! Host-only: no KVM, no guest.

use std::process::{Command, Output};

use bulkhead_vmm::seccomp::{SeccompMode, ThreadFilters, ThreadKind, EXIT_BLOCKED_SYSCALL};

/// Names the child's case; unset in a normal test run.
const CASE_ENV: &str = "BULKHEAD_SECCOMP_TEST_CASE";

/// Runs `child_process` in a new process with `case`.
fn run_child(case: &str) -> Output {
    Command::new(std::env::current_exe().unwrap())
        .args(["child_process", "--exact", "--ignored", "--nocapture"])
        .args(["--test-threads", "1"])
        .env(CASE_ENV, case)
        .output()
        .unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn a_socket_outside_the_event_loop_allowlist_ends_the_process_with_the_logged_call() {
    let out = run_child("inet-socket");

    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(
        out.status.code(),
        Some(EXIT_BLOCKED_SYSCALL),
        "{stdout}\n{stderr}"
    );
    let line = format!(
        "bulkhead-vmm: seccomp: blocked syscall {} (event loop)\n",
        libc::SYS_socket
    );
    assert!(stderr.contains(&line), "{stderr}");
    // Allowed calls worked under the filter (the status file was read), and the kernel reports
    // the thread in filter mode.
    assert!(
        stdout.contains("filtered thread: Seccomp:\t2\n"),
        "{stdout}"
    );
    assert!(!stdout.contains("socket returned"), "{stdout}");
}

#[test]
fn opening_a_file_on_a_vcpu_thread_is_blocked_and_attributed_to_the_vcpu() {
    let out = run_child("vcpu-open");

    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(EXIT_BLOCKED_SYSCALL), "{stderr}");
    let line = format!(
        "bulkhead-vmm: seccomp: blocked syscall {} (vcpu)\n",
        libc::SYS_openat
    );
    assert!(stderr.contains(&line), "{stderr}");
}

#[test]
fn execve_is_blocked_on_the_signal_thread() {
    let out = run_child("signal-execve");

    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(EXIT_BLOCKED_SYSCALL), "{stderr}");
    let line = format!(
        "bulkhead-vmm: seccomp: blocked syscall {} (signal)\n",
        libc::SYS_execve
    );
    assert!(stderr.contains(&line), "{stderr}");
}

#[test]
fn log_mode_lets_the_call_through() {
    let out = run_child("log-socket");

    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(stdout.contains("socket returned a descriptor"), "{stdout}");
    assert!(
        stdout.contains("filtered thread: Seccomp:\t2\n"),
        "{stdout}"
    );
    assert!(!stderr.contains("seccomp: blocked"), "{stderr}");
}

/// The child's side; does nothing unless [`CASE_ENV`] is set.
#[test]
#[ignore = "runs only as the child process of the other tests"]
fn child_process() {
    let Ok(case) = std::env::var(CASE_ENV) else {
        return;
    };
    match case.as_str() {
        "inet-socket" => {
            confine(SeccompMode::On, ThreadKind::EventLoop);
            print_seccomp_status();
            try_inet_socket();
        }
        "vcpu-open" => {
            confine(SeccompMode::On, ThreadKind::Vcpu);
            let opened = std::fs::File::open("/proc/self/status");
            println!("open returned {opened:?}");
        }
        "signal-execve" => {
            confine(SeccompMode::On, ThreadKind::Signal);
            // SAFETY: a NUL-terminated path and a null-terminated argv of one valid string.
            let ret = unsafe {
                libc::execv(
                    c"/bin/true".as_ptr(),
                    [c"true".as_ptr(), std::ptr::null()].as_ptr(),
                )
            };
            println!("execv returned {ret}");
        }
        "log-socket" => {
            confine(SeccompMode::Log, ThreadKind::EventLoop);
            print_seccomp_status();
            try_inet_socket();
        }
        other => panic!("unknown case {other}"),
    }
}

fn confine(mode: SeccompMode, kind: ThreadKind) {
    ThreadFilters::new(mode).unwrap().install(kind).unwrap();
}

/// Prints this thread's `Seccomp:` line (2 = filter mode). `/proc/self` would show the main
/// thread's, which has no filter.
fn print_seccomp_status() {
    let status = std::fs::read_to_string("/proc/thread-self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("Seccomp:")).unwrap();
    println!("filtered thread: {line}");
}

fn try_inet_socket() {
    // SAFETY: socket(2) takes no pointers; the descriptor is closed below when valid.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
    if fd >= 0 {
        println!("socket returned a descriptor");
        // SAFETY: `fd` was just returned by socket(2) and is closed once.
        unsafe { libc::close(fd) };
    } else {
        println!("socket returned {fd}");
    }
}
