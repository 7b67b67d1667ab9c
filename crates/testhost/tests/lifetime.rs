//! QEMU must not outlive the process that started it, even when that process is SIGKILLed.

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
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

/// Reads stderr lines until the `-v` line naming QEMU's pid.
fn qemu_pid_from(stderr: &mut impl BufRead) -> i32 {
    let mut line = String::new();
    loop {
        line.clear();
        assert_ne!(stderr.read_line(&mut line).unwrap(), 0, "no qemu pid line");
        if let Some(rest) = line.strip_prefix("bulkhead-testhost: qemu pid ") {
            return rest.split(',').next().unwrap().parse().unwrap();
        }
    }
}

#[test]
fn qemu_dies_when_its_starter_is_sigkilled() {
    // Arrange: a CLI run whose command would last ten minutes.
    let mut cli = Command::new(env!("CARGO_BIN_EXE_bulkhead-testhost"))
        .args(["run", "-v", "--", "sh", "-c", "echo started; sleep 600"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(cli.stderr.take().unwrap());
    let qemu = qemu_pid_from(&mut stderr);
    let mut started = [0u8; 8];
    cli.stdout.take().unwrap().read_exact(&mut started).unwrap();
    assert!(alive(qemu), "QEMU should be running while the command runs");

    // Act
    cli.kill().unwrap();
    cli.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while alive(qemu) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }

    // Assert
    assert_eq!(&started, b"started\n");
    assert!(!alive(qemu), "QEMU {qemu} outlived its SIGKILLed starter");
}
