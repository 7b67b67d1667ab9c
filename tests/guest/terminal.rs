//! Terminals and byte strings in a real guest: `tty` execs (the guest kernel's pseudo-terminal,
//! resizes, Ctrl-C), `bulkhead run -t` under a terminal of our own (raw mode restored, also
//! after SIGTERM), and argv/env/cwd that are not UTF-8.

use std::os::fd::OwnedFd;
use std::process::Stdio;
use std::time::Duration;

use bulkhead_protocol::client::{ExecEvent, ExecSession};
use bulkhead_protocol::{ByteString, ExecRequest, WindowSize};
use bulkhead_sandbox::{Sandbox, SandboxConfig};
use bulkhead_tests::pty::{collect, lflag, terminal};
use bulkhead_tests::{artifacts, guest_test, sandbox_config};

/// Long enough for anything here in the nested test host.
const PATIENCE: Duration = Duration::from_secs(120);

fn config() -> SandboxConfig {
    SandboxConfig {
        memory_mib: 256,
        ..sandbox_config()
    }
}

/// Reads a `tty` exec's output until it contains `needle`.
fn read_until(session: &mut ExecSession, seen: &mut String, needle: &str) {
    while !seen.contains(needle) {
        match session.next_event().unwrap() {
            Some(ExecEvent::Stdout(b)) => seen.push_str(&String::from_utf8_lossy(&b)),
            other => panic!("waiting for {needle:?} in {seen:?}, got {other:?}"),
        }
    }
}

/// Polls `done` every 50 ms for up to [`PATIENCE`].
fn eventually(mut done: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + PATIENCE;
    while std::time::Instant::now() < deadline {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

guest_test!(
    fn tty_execs_get_a_sized_terminal_resizes_and_ctrl_c_and_bytes_round_trip() {
        // Arrange
        let sandbox = Sandbox::start(&config()).unwrap();
        let mut sized = ExecRequest::new(["sh", "-c", "tty; stty size"]);
        sized.tty = true;
        sized.window = Some(WindowSize {
            rows: 37,
            cols: 111,
        });
        // Traps run between commands (an interactive busybox shell's line editor would take the
        // terminal's signals itself), so both scripts wait in short commands.
        let mut winch = ExecRequest::new([
            "sh",
            "-c",
            "trap 'stty size; exit 0' WINCH; echo $((6*7)); while :; do sleep 0.05; done",
        ]);
        winch.tty = true;
        winch.stdin = true;
        let mut interrupt = ExecRequest::new([
            "sh",
            "-c",
            "trap 'echo caught-$((1+1))' INT; echo $((6*7)); sleep 100; echo after-$?",
        ]);
        interrupt.tty = true;
        interrupt.stdin = true;
        let odd = ByteString::from(b"caf\xe9-\xff".to_vec());
        let mut dir = b"/tmp/d-".to_vec();
        dir.extend_from_slice(odd.as_bytes());
        let mkdir = ExecRequest::new([ByteString::from("mkdir"), ByteString::from(dir.clone())]);
        let mut bytes = ExecRequest::new([
            ByteString::from("sh"),
            ByteString::from("-c"),
            ByteString::from("printf '%s|%s|' \"$1\" \"$ODD\"; pwd"),
            ByteString::from("sh"),
            odd.clone(),
        ]);
        let mut env = b"ODD=".to_vec();
        env.extend_from_slice(odd.as_bytes());
        bytes.env = vec![env.into()];
        bytes.cwd = Some(dir.clone().into());

        // Act: a sized terminal.
        let sized = sandbox.exec(&sized).unwrap().wait_with_output().unwrap();
        // A resize reaches the terminal's foreground process as SIGWINCH.
        let mut session = sandbox.exec(&winch).unwrap();
        let mut seen = String::new();
        read_until(&mut session, &mut seen, "42");
        session
            .writer()
            .resize(WindowSize {
                rows: 45,
                cols: 150,
            })
            .unwrap();
        read_until(&mut session, &mut seen, "45 150");
        let winch_exit = session.wait_with_output().unwrap().status;
        // Ctrl-C interrupts the foreground `sleep 100`; the shell lives on.
        let mut session = sandbox.exec(&interrupt).unwrap();
        let writer = session.writer();
        let mut typed = String::new();
        read_until(&mut session, &mut typed, "42");
        let sleeping = || {
            let out = sandbox
                .exec(&ExecRequest::new(["pidof", "sleep"]))
                .unwrap()
                .wait_with_output()
                .unwrap();
            out.status.success()
        };
        assert!(eventually(sleeping), "sleep never started: {typed:?}");
        writer.write_stdin(&[0x03]).unwrap();
        read_until(&mut session, &mut typed, "after-130");
        let interrupted_exit = session.wait_with_output().unwrap().status;
        // Byte strings.
        let made = sandbox.exec(&mkdir).unwrap().wait_with_output().unwrap();
        let echoed = sandbox.exec(&bytes).unwrap().wait_with_output().unwrap();

        // Assert
        let text = String::from_utf8_lossy(&sized.stdout);
        let lines: Vec<&str> = text.lines().map(|l| l.trim_end_matches('\r')).collect();
        assert!(lines[0].starts_with("/dev/pts/"), "{text:?}");
        assert_eq!(lines[1], "37 111", "{text:?}");
        assert!(winch_exit.success(), "{winch_exit:?}: {seen:?}");
        assert!(typed.contains("caught-2"), "{typed:?}");
        assert!(!sleeping(), "Ctrl-C left sleep running");
        assert!(
            interrupted_exit.success(),
            "{interrupted_exit:?}: {typed:?}"
        );
        assert!(made.status.success(), "{made:?}");
        let mut expected = odd.as_bytes().to_vec();
        expected.push(b'|');
        expected.extend_from_slice(odd.as_bytes());
        expected.push(b'|');
        expected.extend_from_slice(&dir);
        expected.push(b'\n');
        assert_eq!(echoed.stdout, expected, "{echoed:?}");
    }
);

/// `bulkhead run -t -- ARGS` with stdio on `slave`.
fn run_t(slave: &OwnedFd, args: &[&str]) -> std::process::Child {
    let a = artifacts();
    let tty = || Stdio::from(slave.try_clone().unwrap());
    a.cli_command()
        .args(["run", "-t", "--"])
        .args(args)
        .stdin(tty())
        .stdout(tty())
        .stderr(tty())
        .spawn()
        .unwrap()
}

guest_test!(
    fn run_t_uses_our_terminal_size_and_restores_our_terminal_even_after_sigterm() {
        // Arrange
        let (master, slave) = terminal(29, 91);
        let before = lflag(&slave);
        let output = collect(&master);

        // Act: a run that ends by itself, then one ended by SIGTERM while in raw mode.
        let status = run_t(&slave, &["sh", "-c", "tty; stty size"])
            .wait()
            .unwrap();
        let after_run = lflag(&slave);
        let mut killed = run_t(&slave, &["sh", "-c", "echo $((40+2)); sleep 100"]);
        let raw = eventually(|| output.lock().unwrap().contains("42") && lflag(&slave) != before);
        // SAFETY: kill(2) of our own child.
        unsafe { libc::kill(killed.id() as libc::pid_t, libc::SIGTERM) };
        let killed_status = killed.wait().unwrap();

        // Assert
        let text = output.lock().unwrap().clone();
        assert!(status.success(), "{status:?}: {text:?}");
        assert!(
            text.contains("/dev/pts/") && text.contains("29 91"),
            "{text:?}"
        );
        assert_eq!(after_run, before, "the terminal's mode was not restored");
        assert!(
            raw,
            "the second run never put the terminal in raw mode: {text:?}"
        );
        assert_eq!(killed_status.code(), Some(128 + libc::SIGTERM), "{text:?}");
        assert_eq!(lflag(&slave), before, "not restored after SIGTERM");
    }
);
