//! The CLI binary's daemon verbs against a real daemon with the fake VMM: what happens to their
//! output when our stdout is closed, full or its reader goes away. The CLI binary is the one
//! `cargo build --workspace --bins` put next to this test's own binaries (scripts/test.sh builds
//! it before the tests).

mod common;

use std::io::Read as _;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{cli, rt, spec_with_labels, TestDaemon};

/// A daemon with one running sandbox; returns it and the sandbox's ID.
fn daemon_with_sandbox() -> (TestDaemon, String) {
    let daemon = TestDaemon::start();
    let client = daemon.client();
    let created = rt()
        .block_on(client.create(&spec_with_labels(&[])))
        .unwrap();
    (daemon, created.id)
}

/// `bulkhead exec --socket S ID -- ARGS...` with piped stdout and stderr.
fn exec_command(daemon: &TestDaemon, id: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(cli());
    cmd.arg("exec")
        .arg("--socket")
        .arg(&daemon.socket)
        .arg(id)
        .arg("--")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

#[test]
fn exec_with_stdout_closed_fails_with_125_and_still_delivers_stderr() {
    // Arrange
    let (daemon, id) = daemon_with_sandbox();
    let mut cmd = exec_command(&daemon, &id, &["sh", "-c", "echo lost; echo seen >&2"]);
    // SAFETY: close(2) is async-signal-safe; the closure touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            libc::close(libc::STDOUT_FILENO);
            Ok(())
        });
    }

    // Act
    let out = cmd.output().unwrap();

    // Assert: like a local `echo lost >&-`, the lost output is an error, not a silent 0.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(125), "{stderr}");
    assert!(stderr.starts_with("seen\n"), "{stderr}");
    assert!(stderr.contains("stdout was closed"), "{stderr}");
}

#[test]
fn exec_whose_output_reader_goes_away_ends_with_141() {
    // Arrange: `yes` never ends by itself.
    let (daemon, id) = daemon_with_sandbox();
    let mut child = exec_command(&daemon, &id, &["yes"]).spawn().unwrap();
    let mut first = [0u8; 4];
    child.stdout.take().unwrap().read_exact(&mut first).unwrap();

    // Act: our end of the pipe was dropped above; the CLI's next write gets EPIPE.
    let status = wait_at_most(&mut child, Duration::from_secs(60));

    // Assert: 128 + SIGPIPE, as a local `yes | head` reports for `yes`.
    let stderr = child.wait_with_output().unwrap().stderr;
    let stderr = String::from_utf8_lossy(&stderr);
    assert_eq!(&first, b"y\ny\n");
    assert_eq!(status.code(), Some(141), "{status}: {stderr}");
}

/// Waits for `child`, killing it (and failing) after `limit`.
fn wait_at_most(child: &mut std::process::Child, limit: Duration) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("bulkhead exec did not end within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `bulkhead create --socket S` with stdout `closed` (`>&-`) or on `/dev/full`.
fn create_with_bad_stdout(daemon: &TestDaemon, closed: bool) -> std::process::Output {
    let mut cmd = Command::new(cli());
    cmd.arg("create")
        .arg("--socket")
        .arg(&daemon.socket)
        .stdin(Stdio::null())
        .stderr(Stdio::piped());
    if closed {
        // SAFETY: close(2) is async-signal-safe; the closure touches no memory of the parent.
        unsafe {
            cmd.pre_exec(|| {
                libc::close(libc::STDOUT_FILENO);
                Ok(())
            });
        }
    } else {
        cmd.stdout(std::fs::File::create("/dev/full").unwrap());
    }
    cmd.output().unwrap()
}

#[test]
fn create_whose_id_cannot_be_printed_fails_and_leaves_no_sandbox() {
    // Arrange
    let daemon = TestDaemon::start();

    // Act
    let closed = create_with_bad_stdout(&daemon, true);
    let full = create_with_bad_stdout(&daemon, false);

    // Assert: both fail, and nobody is left with a sandbox whose ID they never saw.
    let listed = rt()
        .block_on(daemon.client().list(&Default::default()))
        .unwrap();
    let closed_err = String::from_utf8_lossy(&closed.stderr);
    let full_err = String::from_utf8_lossy(&full.stderr);
    assert_eq!(closed.status.code(), Some(125), "{closed_err}");
    assert!(closed_err.contains("stdout was closed"), "{closed_err}");
    assert_eq!(full.status.code(), Some(125), "{full_err}");
    assert!(full_err.contains("destroyed"), "{full_err}");
    assert!(listed.is_empty(), "left behind: {listed:?}");
}

/// `bulkhead rm --socket S [EXTRA...] IDS...`, run to its end.
fn rm(daemon: &TestDaemon, extra: &[&str], ids: &[&str]) -> std::process::Output {
    Command::new(cli())
        .arg("rm")
        .arg("--socket")
        .arg(&daemon.socket)
        .args(extra)
        .args(ids)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

#[test]
fn rm_of_an_unknown_id_fails_but_still_removes_the_others() {
    // Arrange
    let (daemon, id) = daemon_with_sandbox();

    // Act
    let out = rm(&daemon, &[], &["0123456789ab", &id]);

    // Assert
    let stderr = String::from_utf8_lossy(&out.stderr);
    let listed = rt()
        .block_on(daemon.client().list(&Default::default()))
        .unwrap();
    assert_eq!(out.status.code(), Some(125), "{stderr}");
    assert!(stderr.contains("0123456789ab"), "{stderr}");
    assert!(!stderr.contains(&id), "{stderr}");
    assert!(listed.is_empty(), "left behind: {listed:?}");
}

#[test]
fn rm_force_of_an_unknown_id_succeeds_quietly() {
    // Arrange
    let daemon = TestDaemon::start();

    // Act
    let out = rm(&daemon, &["--force"], &["0123456789ab"]);

    // Assert
    assert_eq!(out.status.code(), Some(0));
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
