//! `tty` execs: the command runs on a pseudo-terminal that the host drives (size, resizes,
//! typed input including Ctrl-C and Ctrl-D), end to end over a Unix socket.

mod common;

use bulkhead_protocol::client::{ExecEvent, ExecSession};
use bulkhead_protocol::{ExecRequest, ExitStatus, WindowSize};
use common::{wait_until, Agent};

/// A `tty` request for `script` run by `sh`, with stdin, at `rows` × `cols`.
fn tty_sh(script: &str, rows: u16, cols: u16) -> ExecRequest {
    let mut req = ExecRequest::new(["/bin/sh", "-c", script]);
    req.tty = true;
    req.stdin = true;
    req.window = Some(WindowSize { rows, cols });
    req
}

/// Reads events until the terminal's output contains `needle`; returns all output so far.
/// Panics on `Stderr` (a terminal has one output) or when the exec ends first.
fn read_until(session: &mut ExecSession, seen: &mut String, needle: &str) {
    while !seen.contains(needle) {
        match session.next_event().unwrap() {
            Some(ExecEvent::Stdout(bytes)) => seen.push_str(&String::from_utf8_lossy(&bytes)),
            other => panic!("waiting for {needle:?} in {seen:?}, got {other:?}"),
        }
    }
}

/// Reads the rest of the output and the exit status.
fn finish(session: &mut ExecSession, seen: &mut String) -> ExitStatus {
    loop {
        match session.next_event().unwrap() {
            Some(ExecEvent::Stdout(bytes)) => seen.push_str(&String::from_utf8_lossy(&bytes)),
            Some(ExecEvent::Exit(status)) => return status,
            other => panic!("expected output or exit, got {other:?} after {seen:?}"),
        }
    }
}

/// True when a process named `comm` runs in session `sid` on this host in the terminal's
/// foreground process group (its pgrp is the terminal's `tpgid`), so Ctrl-C reaches it: an
/// interactive shell forks the job first and hands it the terminal a moment later.
fn in_foreground(sid: u32, comm: &str) -> bool {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return false;
    };
    dir.flatten().any(|entry| {
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        // pid (comm) state ppid pgrp session tty_nr tpgid ...
        let Some((head, tail)) = stat.rsplit_once(") ") else {
            return false;
        };
        let fields: Vec<&str> = tail.split(' ').collect();
        head.ends_with(&format!("({comm}"))
            && fields.get(3) == Some(&sid.to_string().as_str())
            && fields
                .get(2)
                .is_some_and(|pgrp| fields.get(5) == Some(pgrp))
    })
}

#[test]
fn the_command_gets_a_terminal_of_the_requested_size_and_one_output() {
    // Arrange
    let agent = Agent::start();
    let req = tty_sh("tty; stty size; echo to-stderr >&2; echo $TERM", 33, 101);

    // Act
    let out = agent
        .client()
        .exec(&req)
        .unwrap()
        .wait_with_output()
        .unwrap();

    // Assert
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().map(|l| l.trim_end_matches('\r')).collect();
    assert!(lines[0].starts_with("/dev/pts/"), "{text:?}");
    assert_eq!(&lines[1..], ["33 101", "to-stderr", "xterm"], "{text:?}");
    assert!(out.stderr.is_empty(), "a terminal has one output");
    assert!(out.status.success(), "{:?}", out.status);
}

#[test]
fn a_resize_reaches_the_foreground_process_as_sigwinch() {
    // Arrange
    let agent = Agent::start();
    let req = tty_sh(
        "trap 'stty size; exit 0' WINCH; echo $((40+2)); while :; do sleep 0.05; done",
        24,
        80,
    );
    let mut session = agent.client().exec(&req).unwrap();
    let mut seen = String::new();
    read_until(&mut session, &mut seen, "42");

    // Act
    session
        .writer()
        .resize(WindowSize {
            rows: 50,
            cols: 132,
        })
        .unwrap();
    let status = finish(&mut session, &mut seen);

    // Assert
    assert!(seen.contains("50 132"), "{seen:?}");
    assert!(status.success(), "{status:?}: {seen:?}");
}

#[test]
fn ctrl_c_interrupts_the_foreground_job_and_the_shell_survives() {
    // Arrange: an interactive shell on the terminal, running `sleep 100` in the foreground.
    let agent = Agent::start();
    let mut req = tty_sh("", 24, 80);
    req.argv = vec!["/bin/sh".into(), "-i".into()];
    let mut session = agent.client().exec(&req).unwrap();
    let sid = session.pid().unwrap();
    let writer = session.writer();
    writer.write_stdin(b"sleep 100; echo rc=$?\n").unwrap();
    assert!(
        wait_until(|| in_foreground(sid, "sleep")),
        "sleep never ran in the foreground"
    );

    // Act
    writer.write_stdin(&[0x03]).unwrap();
    writer.write_stdin(b"echo alive-$((20+1))\n").unwrap();
    let mut seen = String::new();
    read_until(&mut session, &mut seen, "alive-21");
    writer.write_stdin(b"exit 3\n").unwrap();
    let status = finish(&mut session, &mut seen);

    // Assert: the interrupted line did not go on (`echo rc=` would need sleep to end normally
    // or be followed; an interactive shell drops the rest of the list), the shell lived on.
    // Interrupted, `sleep` did not end normally, so the list was cut short: no `rc=0`.
    assert!(
        !seen.contains("rc=0"),
        "Ctrl-C did not interrupt sleep: {seen:?}"
    );
    assert!(!in_foreground(sid, "sleep"), "sleep survived Ctrl-C");
    assert_eq!(status.code, Some(3), "{status:?}: {seen:?}");
}

#[test]
fn end_of_stdin_is_typed_as_ctrl_d() {
    // Arrange
    let agent = Agent::start();
    let req = tty_sh("cat; echo cat-done-$((1+1))", 24, 80);
    let mut session = agent.client().exec(&req).unwrap();
    let writer = session.writer();

    // Act
    writer.write_stdin(b"hello\n").unwrap();
    writer.close_stdin().unwrap();
    let mut seen = String::new();
    let status = finish(&mut session, &mut seen);

    // Assert: the terminal echoed the line, cat printed it, and ended at ^D.
    assert!(seen.matches("hello").count() >= 2, "{seen:?}");
    assert!(seen.contains("cat-done-2"), "{seen:?}");
    assert!(status.success(), "{status:?}");
}
