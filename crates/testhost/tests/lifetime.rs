//! QEMU must not outlive the process that started it, even when that process is SIGKILLed, and a
//! `bulkhead-testhost run` stopped by SIGTERM leaves no run directory behind.

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// True while `/proc/<pid>` exists and is not a zombie.
fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z')),
        Err(_) => false,
    }
}

/// Reads stderr lines until the `-v` line naming QEMU's pid and the run directory.
fn qemu_pid_and_run_dir_from(stderr: &mut impl BufRead) -> (i32, PathBuf) {
    let mut line = String::new();
    loop {
        line.clear();
        assert_ne!(stderr.read_line(&mut line).unwrap(), 0, "no qemu pid line");
        if let Some(rest) = line.strip_prefix("bulkhead-testhost: qemu pid ") {
            let mut fields = rest.split(", ");
            let pid = fields.next().unwrap().parse().unwrap();
            let dir = fields.next().unwrap().strip_prefix("run dir ").unwrap();
            return (pid, PathBuf::from(dir));
        }
    }
}

/// Starts `bulkhead-testhost run -v` with a command that prints `started` and sleeps ten
/// minutes; returns the child, QEMU's pid and the run directory once the command has started.
fn start_long_run() -> (Child, i32, PathBuf) {
    let mut cli = Command::new(env!("CARGO_BIN_EXE_bulkhead-testhost"))
        .args(["run", "-v", "--", "sh", "-c", "echo started; sleep 600"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(cli.stderr.take().unwrap());
    let (qemu, run_dir) = qemu_pid_and_run_dir_from(&mut stderr);
    let mut started = [0u8; 8];
    cli.stdout.take().unwrap().read_exact(&mut started).unwrap();
    assert_eq!(&started, b"started\n");
    (cli, qemu, run_dir)
}

/// Waits up to 10 s for QEMU `pid` to be gone.
fn wait_gone(pid: i32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while alive(pid) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn qemu_dies_when_its_starter_is_sigkilled() {
    // Arrange: a CLI run whose command would last ten minutes.
    let (mut cli, qemu, _) = start_long_run();
    assert!(alive(qemu), "QEMU should be running while the command runs");

    // Act
    cli.kill().unwrap();
    cli.wait().unwrap();
    wait_gone(qemu);

    // Assert
    assert!(!alive(qemu), "QEMU {qemu} outlived its SIGKILLed starter");
}

#[test]
fn sigterm_ends_the_run_with_143_and_removes_its_run_directory() {
    // Arrange
    let (mut cli, qemu, run_dir) = start_long_run();
    assert!(
        run_dir.is_dir(),
        "{} should exist while the run lasts",
        run_dir.display()
    );

    // Act
    // SAFETY: kill(2) with a valid signal number on our own child's pid; no memory is involved.
    let rc = unsafe { libc::kill(cli.id() as i32, libc::SIGTERM) };
    let status = cli.wait().unwrap();
    wait_gone(qemu);

    // Assert
    assert_eq!(rc, 0);
    assert_eq!(status.code(), Some(143), "{status:?}");
    assert!(!run_dir.exists(), "{} was left behind", run_dir.display());
    assert!(!alive(qemu), "QEMU {qemu} outlived the SIGTERMed run");
}
