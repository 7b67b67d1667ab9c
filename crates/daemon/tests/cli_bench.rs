//! `bulkhead bench --daemon` against a real daemon with the fake VMM: every run creates a
//! sandbox through the API, runs the command with one exec and deletes the sandbox; the report
//! says so, failures are counted, and a daemon that does not answer stops the bench before any
//! run.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::{cli, rt, TestDaemon};

/// `bulkhead bench --daemon --socket SOCKET ARGS...`.
fn bench(socket: &Path, args: &[&str]) -> Output {
    Command::new(cli())
        .args(["bench", "--daemon", "--socket"])
        .arg(socket)
        .args(args)
        .output()
        .unwrap()
}

/// The runs of the JSON report at `path`.
fn runs(path: &Path) -> Vec<serde_json::Value> {
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    report["runs"].as_array().unwrap().clone()
}

#[test]
fn each_run_creates_execs_and_deletes_a_sandbox_through_the_daemon() {
    // Arrange
    let daemon = TestDaemon::start();
    let json = daemon.dir.path().join("bench.json");

    // Act
    let out = bench(
        &daemon.socket,
        &[
            "--runs",
            "2",
            "--json",
            json.to_str().unwrap(),
            "--",
            "echo",
            "hi",
        ],
    );

    // Assert: two good runs, each create answered before the command's first output, and no
    // sandbox left behind.
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("2 cold creates through bulkheadd"),
        "{stdout}"
    );
    assert!(stdout.contains("create → agent ready"), "{stdout}");
    let runs = runs(&json);
    assert_eq!(runs.len(), 2);
    for run in &runs {
        assert_eq!(run["ok"], true, "{run}");
        let ready = run["create_to_ready_ms"].as_f64().unwrap();
        let first = run["create_to_first_output_ms"].as_f64().unwrap();
        assert!(0.0 < ready && ready <= first, "{run}");
    }
    let left = rt()
        .block_on(daemon.client().list(&Default::default()))
        .unwrap();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn a_failing_command_fails_its_runs_and_the_bench() {
    // Arrange
    let daemon = TestDaemon::start();

    // Act
    let out = bench(&daemon.socket, &["--runs", "2", "--", "false"]);

    // Assert
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("0 ok, 2 failed"), "{stdout}");
    assert!(stdout.contains("run 1: the command exited 1"), "{stdout}");
    let left = rt()
        .block_on(daemon.client().list(&Default::default()))
        .unwrap();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn sigint_stops_the_bench_and_deletes_the_sandbox_it_was_using() {
    // Arrange: a bench whose first run's command sleeps.
    let daemon = TestDaemon::start();
    let client = daemon.client();
    let rt = rt();
    let mut child = Command::new(cli())
        .args(["bench", "--daemon", "--socket"])
        .arg(&daemon.socket)
        .args(["--runs", "5", "--", "sleep", "30"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let listed = || rt.block_on(client.list(&Default::default())).unwrap();
    let running = common::wait_until(std::time::Duration::from_secs(30), || listed().len() == 1);
    assert!(
        running,
        "the first run's sandbox never appeared\n{}",
        daemon.log()
    );

    // Act
    // SAFETY: kill(2) with the pid of our own child process, which has not been reaped.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
    let ended = common::wait_until(std::time::Duration::from_secs(30), || {
        child.try_wait().unwrap().is_some()
    });
    if !ended {
        let _ = child.kill();
    }
    let out = child.wait_with_output().unwrap();

    // Assert: 128 + SIGINT, said so, and nothing left in the daemon.
    assert!(ended, "the bench did not end within 30 s of SIGINT");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert!(
        stderr.contains("every sandbox it created was deleted"),
        "{stderr}"
    );
    assert!(listed().is_empty(), "{:?}", listed());
}

#[test]
fn a_daemon_that_does_not_answer_stops_the_bench_before_any_run() {
    // Arrange
    let dir = tempfile::tempdir().unwrap();

    // Act
    let out = bench(&dir.path().join("no.sock"), &["--runs", "2"]);

    // Assert
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(125), "{stderr}");
    assert!(stderr.contains("no.sock does not answer"), "{stderr}");
}
