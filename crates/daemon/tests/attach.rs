//! Attached execs (`POST /v1/sandboxes/{id}/exec/attach`, `bulkhead exec -i/-t`) against a
//! real daemon whose fake VMM runs the real agent on this host: streamed stdin of any size,
//! an exec that ends while our stdin is still open, terminals (size, resize, Ctrl-C, the local
//! terminal's mode restored), and bad requests.

mod common;

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bulkhead_client::{ExecEvent, ExecSpec, WindowSize};
use bulkhead_tests::pty::{collect, lflag, terminal};
use common::{cli, rt, spec_with_labels, wait_until, TestDaemon};

/// Long enough for anything here on a loaded 2-core CI machine.
const PATIENCE: Duration = Duration::from_secs(60);

/// A daemon with one running sandbox; returns it and the sandbox's ID.
fn daemon_with_sandbox() -> (TestDaemon, String) {
    let daemon = TestDaemon::start();
    let created = rt()
        .block_on(daemon.client().create(&spec_with_labels(&[])))
        .unwrap();
    (daemon, created.id)
}

/// `bulkhead exec --socket S FLAGS ID -- ARGS...`.
fn exec_cli(daemon: &TestDaemon, flags: &[&str], id: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(cli());
    cmd.arg("exec")
        .arg("--socket")
        .arg(&daemon.socket)
        .args(flags)
        .arg(id)
        .arg("--")
        .args(args);
    cmd
}

/// True when a `sleep` runs in session `sid` in the terminal's foreground process group (its
/// pgrp is the terminal's `tpgid`; the fake VMM runs the agent on this host), so Ctrl-C reaches
/// it: an interactive shell forks the job first and hands it the terminal a moment later.
fn sleeping_in_foreground(sid: u32) -> bool {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return false;
    };
    dir.flatten().any(|entry| {
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let Some((head, tail)) = stat.rsplit_once(") ") else {
            return false;
        };
        // After the name: state ppid pgrp session tty_nr tpgid ...
        let fields: Vec<&str> = tail.split(' ').collect();
        head.ends_with("(sleep")
            && fields.get(3) == Some(&sid.to_string().as_str())
            && fields
                .get(2)
                .is_some_and(|pgrp| fields.get(5) == Some(pgrp))
    })
}

#[test]
fn exec_i_streams_200_mib_of_stdin_through_sha256sum() {
    // Arrange: 200 MiB, far beyond what a request body may carry.
    let (daemon, id) = daemon_with_sandbox();
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("input");
    let mut file = std::fs::File::create(&input).unwrap();
    let block: Vec<u8> = (0..1024 * 1024).map(|i| (i * 7 % 251) as u8).collect();
    for _ in 0..200 {
        file.write_all(&block).unwrap();
    }
    drop(file);
    let expected = Command::new("sha256sum").arg(&input).output().unwrap();
    let expected = String::from_utf8_lossy(&expected.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned();

    // Act
    let out = exec_cli(&daemon, &["-i"], &id, &["sha256sum"])
        .stdin(std::fs::File::open(&input).unwrap())
        .output()
        .unwrap();

    // Assert
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stdout.split_whitespace().next(), Some(expected.as_str()));
}

#[test]
fn exec_i_ends_with_the_command_while_our_stdin_stays_open() {
    // Arrange: stdin is a pipe whose write end we keep open (as `sleep 100 | bulkhead exec -i`).
    let (daemon, id) = daemon_with_sandbox();
    let mut child = exec_cli(&daemon, &["-i"], &id, &["echo", "hi"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let _held_open = child.stdin.take().unwrap();

    // Act
    let ended = wait_until(PATIENCE, || child.try_wait().unwrap().is_some());

    // Assert
    assert!(ended, "exec -i waited for our stdin instead of the command");
    let mut stdout = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut stdout)
        .unwrap();
    assert_eq!(stdout, "hi\n");
    assert_eq!(child.wait().unwrap().code(), Some(0));
}

#[test]
fn exec_it_gives_a_terminal_of_our_size_and_restores_our_terminal_after() {
    // Arrange
    let (daemon, id) = daemon_with_sandbox();
    let (master, slave) = terminal(31, 97);
    let before = lflag(&slave);
    let output = collect(&master);
    let tty = |fd: &OwnedFd| Stdio::from(fd.try_clone().unwrap());

    // Act
    let status = exec_cli(&daemon, &["-it"], &id, &["sh", "-c", "tty; stty size"])
        .stdin(tty(&slave))
        .stdout(tty(&slave))
        .stderr(tty(&slave))
        .status()
        .unwrap();

    // Assert
    assert!(
        wait_until(PATIENCE, || output.lock().unwrap().contains("31 97")),
        "{:?}",
        output.lock().unwrap()
    );
    let text = output.lock().unwrap().clone();
    assert!(text.contains("/dev/pts/"), "{text:?}");
    assert!(status.success(), "{status:?}: {text:?}");
    assert_eq!(
        lflag(&slave),
        before,
        "the terminal's mode was not restored"
    );
}

#[test]
fn exec_it_killed_with_sigterm_restores_our_terminal() {
    // Arrange: a session that would run 100 s; our terminal goes raw while it runs.
    let (daemon, id) = daemon_with_sandbox();
    let (master, slave) = terminal(24, 80);
    let before = lflag(&slave);
    let output = collect(&master);
    let tty = |fd: &OwnedFd| Stdio::from(fd.try_clone().unwrap());
    let mut child = exec_cli(
        &daemon,
        &["-it"],
        &id,
        &["sh", "-c", "echo $((40+2)); sleep 100"],
    )
    .stdin(tty(&slave))
    .stdout(tty(&slave))
    .stderr(tty(&slave))
    .spawn()
    .unwrap();
    assert!(wait_until(PATIENCE, || output
        .lock()
        .unwrap()
        .contains("42")));
    assert_ne!(lflag(&slave), before, "raw mode was never entered");

    // Act
    let started = Instant::now();
    // SAFETY: kill(2) with a pid we spawned.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();

    // Assert
    assert!(started.elapsed() < PATIENCE);
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{status:?}");
    assert_eq!(
        lflag(&slave),
        before,
        "the terminal's mode was not restored"
    );
}

#[test]
fn exec_t_without_a_terminal_is_refused_before_anything_runs() {
    // Arrange
    let (daemon, id) = daemon_with_sandbox();

    // Act
    let out = exec_cli(&daemon, &["-t"], &id, &["touch", "/tmp/ran"])
        .stdin(Stdio::null())
        .output()
        .unwrap();

    // Assert
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(125), "{stderr}");
    assert!(stderr.contains("the input device is not a TTY"), "{stderr}");
}

#[test]
fn an_attached_terminal_takes_resizes_ctrl_c_and_typed_input() {
    // Arrange: an interactive shell on a terminal, through the client library.
    let (daemon, id) = daemon_with_sandbox();
    let client = daemon.client();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut spec = ExecSpec::new(["sh", "-i"]);
    spec.tty = true;
    spec.window = Some(WindowSize { rows: 24, cols: 80 });
    let exec = rt.block_on(client.exec_attach(&id, &spec)).unwrap();
    let sid = exec.pid;
    let (mut input, mut output) = (exec.input, exec.output);
    let mut seen = String::new();
    let mut read_until = |needle: &str, seen: &mut String| {
        while !seen.contains(needle) {
            match rt.block_on(output.next_event()).unwrap() {
                Some(ExecEvent::Stdout(b)) => seen.push_str(&String::from_utf8_lossy(&b)),
                other => panic!("waiting for {needle:?} in {seen:?}: {other:?}"),
            }
        }
    };

    // Act
    rt.block_on(input.write_stdin(b"trap 'stty size' WINCH; echo $((6*7))\n"))
        .unwrap();
    read_until("42", &mut seen);
    rt.block_on(input.resize(WindowSize {
        rows: 40,
        cols: 120,
    }))
    .unwrap();
    // A shell waiting for input runs its traps once it has read the next line.
    rt.block_on(input.write_stdin(b"\n")).unwrap();
    read_until("40 120", &mut seen);
    rt.block_on(input.write_stdin(b"sleep 100; echo rc=$?\n"))
        .unwrap();
    assert!(
        wait_until(PATIENCE, || sleeping_in_foreground(sid)),
        "sleep never ran in the foreground"
    );
    rt.block_on(input.write_stdin(&[0x03])).unwrap();
    rt.block_on(input.write_stdin(b"echo alive-$((20+1)); exit 5\n"))
        .unwrap();
    read_until("alive-21", &mut seen);

    // Assert
    // Interrupted, `sleep` did not end normally, so the list was cut short: no `rc=0`.
    assert!(
        !seen.contains("rc=0"),
        "Ctrl-C did not interrupt sleep: {seen:?}"
    );
    assert!(!sleeping_in_foreground(sid), "sleep survived Ctrl-C");
    let exit = loop {
        match rt.block_on(output.next_event()).unwrap() {
            Some(ExecEvent::Exit(exit)) => break exit,
            Some(_) => {}
            None => panic!("no exit status"),
        }
    };
    assert_eq!(exit.code, Some(5), "{seen:?}");
}

#[test]
fn attach_without_an_upgrade_or_with_buffered_stdin_is_a_400() {
    // Arrange
    let (daemon, id) = daemon_with_sandbox();
    let client = daemon.client();
    let mut buffered = ExecSpec::new(["cat"]);
    buffered.stdin = Some("aGk=".into());
    let body = serde_json::to_vec(&ExecSpec::new(["true"])).unwrap();

    // Act
    let plain = rt().block_on(client.raw(
        hyper::Method::POST,
        &format!("/v1/sandboxes/{id}/exec/attach"),
        Some(body.into()),
        &[("content-type", "application/json")],
    ));
    let with_stdin = rt().block_on(client.exec_attach(&id, &buffered));

    // Assert
    let (status, text) = plain.unwrap();
    assert_eq!(status, 400, "{text:?}");
    assert!(String::from_utf8_lossy(&text).contains("Upgrade: bulkhead-exec"));
    let err = with_stdin.unwrap_err();
    assert_eq!(err.status(), Some(400), "{err}");
    assert!(err.to_string().contains("leave `stdin` out"), "{err}");
}
