//! The agent's exec service, end to end over a Unix socket.

mod common;

use std::thread;
use std::time::{Duration, Instant};

use bulkhead_protocol::client::{ClientError, ExecEvent};
use bulkhead_protocol::ErrorCode;
use bulkhead_protocol::ExecRequest;
use common::{group_is_gone, noise, sha256, wait_until, Agent, PATIENCE};

const MIB: usize = 1024 * 1024;

fn sh(script: &str) -> ExecRequest {
    ExecRequest::new(["/bin/sh", "-c", script])
}

#[test]
fn echo_output_arrives_on_stdout_with_exit_code_zero() {
    // Arrange
    let agent = Agent::start();

    // Act
    let out = agent
        .client()
        .exec(&sh("echo hello"))
        .unwrap()
        .wait_with_output()
        .unwrap();

    // Assert
    assert_eq!(out.stdout, b"hello\n");
    assert!(out.stderr.is_empty());
    assert!(out.status.success(), "{:?}", out.status);
}

#[test]
fn exit_code_is_reported() {
    // Arrange
    let agent = Agent::start();

    // Act
    let out = agent
        .client()
        .exec(&sh("exit 7"))
        .unwrap()
        .wait_with_output()
        .unwrap();

    // Assert
    assert_eq!((out.status.code, out.status.signal), (Some(7), None));
}

#[test]
fn death_by_signal_is_reported_as_the_signal() {
    // Arrange
    let agent = Agent::start();

    // Act
    let out = agent
        .client()
        .exec(&sh("kill -9 $$"))
        .unwrap()
        .wait_with_output()
        .unwrap();

    // Assert
    assert_eq!((out.status.code, out.status.signal), (None, Some(9)));
    assert!(!out.status.timed_out);
}

#[test]
fn stderr_is_kept_apart_from_stdout() {
    // Arrange
    let agent = Agent::start();

    // Act
    let out = agent
        .client()
        .exec(&sh("echo out; echo err >&2; echo out2"))
        .unwrap()
        .wait_with_output()
        .unwrap();

    // Assert
    assert_eq!(out.stdout, b"out\nout2\n");
    assert_eq!(out.stderr, b"err\n");
}

#[test]
fn ten_mib_of_binary_output_arrives_identical() {
    // Arrange
    let agent = Agent::start();
    let data = noise(10 * MIB, 1);
    let path = agent.dir().join("blob");
    std::fs::write(&path, &data).unwrap();
    let req = ExecRequest::new(["cat", path.to_str().unwrap()]);

    // Act
    let out = agent
        .client()
        .exec(&req)
        .unwrap()
        .wait_with_output()
        .unwrap();

    // Assert
    assert_eq!(out.stdout.len(), data.len());
    assert_eq!(sha256(&out.stdout), sha256(&data));
    assert!(out.status.success());
}

#[test]
fn ten_mib_of_stdin_arrives_identical() {
    // Arrange
    let agent = Agent::start();
    let data = noise(10 * MIB, 2);
    let path = agent.dir().join("from-stdin");
    let mut req = sh(&format!("cat > '{}'", path.display()));
    req.stdin = true;
    let session = agent.client().exec(&req).unwrap();
    let writer = session.writer();

    // Act
    writer.write_stdin(&data).unwrap();
    writer.close_stdin().unwrap();
    let out = session.wait_with_output().unwrap();

    // Assert
    assert!(
        out.status.success(),
        "{:?} {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(sha256(&std::fs::read(&path).unwrap()), sha256(&data));
}

#[test]
fn stdin_echoed_through_cat_streams_both_ways_at_once() {
    // Arrange: 10 MiB is far more than the pipes and sockets hold, so this only finishes if
    // stdin and stdout flow concurrently.
    let agent = Agent::start();
    let data = noise(10 * MIB, 3);
    let mut req = ExecRequest::new(["cat"]);
    req.stdin = true;
    let (writer, reader) = agent.client().exec(&req).unwrap().split();
    let input = data.clone();

    // Act
    let feeder = thread::spawn(move || {
        writer.write_stdin(&input).unwrap();
        writer.close_stdin().unwrap();
    });
    let out = reader.collect_output().unwrap();
    feeder.join().unwrap();

    // Assert
    assert_eq!(sha256(&out.stdout), sha256(&data));
    assert!(out.status.success());
}

#[test]
fn nul_bytes_and_split_utf8_pass_through_unchanged() {
    // Arrange: "é" (C3 A9) is split across two printf calls, around NULs and invalid bytes.
    let agent = Agent::start();
    let script = r"printf '\000a\303'; printf '\251\000\377'; printf 'x\000' >&2";

    // Act
    let out = agent
        .client()
        .exec(&sh(script))
        .unwrap()
        .wait_with_output()
        .unwrap();

    // Assert
    assert_eq!(out.stdout, [0, b'a', 0xC3, 0xA9, 0, 0xFF]);
    assert_eq!(out.stderr, [b'x', 0]);
}

#[test]
fn nul_bytes_on_stdin_reach_the_command_unchanged() {
    // Arrange
    let agent = Agent::start();
    let mut req = ExecRequest::new(["cat"]);
    req.stdin = true;
    let input = [0u8, 0xC3, 0, 0xA9, b'\n', 0];
    let session = agent.client().exec(&req).unwrap();

    // Act
    session.writer().write_stdin(&input[..2]).unwrap();
    session.writer().write_stdin(&input[2..]).unwrap();
    session.writer().close_stdin().unwrap();
    let out = session.wait_with_output().unwrap();

    // Assert
    assert_eq!(out.stdout, input);
}

#[test]
fn timeout_kills_the_whole_process_group_quickly() {
    // Arrange
    let agent = Agent::start();
    let mut req = sh("sleep 100 & sleep 100");
    req.timeout_ms = Some(1000);
    let started = Instant::now();

    // Act
    let session = agent.client().exec(&req).unwrap();
    let pgid = session.pid().unwrap();
    let out = session.wait_with_output().unwrap();
    let elapsed = started.elapsed();

    // Assert
    assert!(out.status.timed_out);
    assert_eq!(out.status.signal, Some(9));
    assert!(elapsed >= Duration::from_millis(1000), "{elapsed:?}");
    assert!(elapsed < PATIENCE, "{elapsed:?}");
    assert!(
        wait_until(|| group_is_gone(pgid)),
        "a process of group {pgid} survived"
    );
}

#[test]
fn eight_concurrent_execs_each_get_their_own_output_and_code() {
    // Arrange: all eight are started first and block on stdin, so they run at the same time.
    let agent = Agent::start();
    let sessions: Vec<_> = (0..8)
        .map(|_| {
            let mut req = sh("read n; echo \"task $n\"; echo \"err $n\" >&2; exit $n");
            req.stdin = true;
            agent.client().exec(&req).unwrap()
        })
        .collect();

    // Act: release them in reverse order, then collect each on its own thread.
    for (n, session) in sessions.iter().enumerate().rev() {
        session
            .writer()
            .write_stdin(format!("{n}\n").as_bytes())
            .unwrap();
    }
    let handles: Vec<_> = sessions
        .into_iter()
        .map(|s| thread::spawn(move || s.wait_with_output().unwrap()))
        .collect();
    let outputs: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();

    // Assert
    for (n, out) in outputs.iter().enumerate() {
        assert_eq!(out.stdout, format!("task {n}\n").into_bytes());
        assert_eq!(out.stderr, format!("err {n}\n").into_bytes());
        assert_eq!(out.status.code, Some(n as i32));
    }
}

#[test]
fn missing_program_exits_127_with_a_message_on_stderr() {
    // Arrange
    let agent = Agent::start();
    let req = ExecRequest::new(["no-such-program-bulkhead"]);

    // Act
    let session = agent.client().exec(&req).unwrap();
    let pid = session.pid();
    let out = session.wait_with_output().unwrap();

    // Assert
    assert_eq!(pid, None);
    assert_eq!(out.status.code, Some(127));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no-such-program-bulkhead"), "{stderr}");
}

#[test]
fn host_disconnect_kills_the_command_even_if_it_ignores_sighup() {
    // Arrange: wait until the shell ignores SIGHUP and has a background child, so only the
    // SIGKILL that follows the SIGHUP can end the group.
    let agent = Agent::start();
    let script = "trap '' HUP; sleep 100 & echo up; sleep 100";
    let mut session = agent.client().exec(&sh(script)).unwrap();
    let pgid = session.pid().unwrap();
    assert_eq!(
        session.next_event().unwrap(),
        Some(ExecEvent::Stdout(b"up\n".to_vec()))
    );

    // Act
    session.writer().disconnect().unwrap();
    drop(session);

    // Assert
    assert!(
        wait_until(|| group_is_gone(pgid)),
        "group {pgid} survived the disconnect"
    );
}

#[test]
fn signal_request_reaches_the_whole_process_group() {
    // Arrange: a background child holds stdout, so Exit comes only once it is gone too.
    let agent = Agent::start();
    let mut session = agent
        .client()
        .exec(&sh("sleep 100 & echo up; wait"))
        .unwrap();
    let pgid = session.pid().unwrap();
    assert_eq!(
        session.next_event().unwrap(),
        Some(ExecEvent::Stdout(b"up\n".to_vec()))
    );
    let started = Instant::now();

    // Act
    session.writer().signal(libc::SIGTERM).unwrap();
    let out = session.wait_with_output().unwrap();

    // Assert
    assert_eq!(out.status.signal, Some(libc::SIGTERM));
    assert!(!out.status.timed_out);
    assert!(started.elapsed() < PATIENCE, "{:?}", started.elapsed());
    assert!(wait_until(|| group_is_gone(pgid)));
}

#[test]
fn cwd_and_env_are_applied_and_nothing_else_is_inherited() {
    // Arrange
    let agent = Agent::start();
    let cwd = agent.dir().canonicalize().unwrap();
    let mut req = sh("pwd; echo \"$FOO|${HOME-unset}\"; echo \"$PATH\"");
    req.cwd = Some(cwd.as_os_str().into());
    req.env = vec!["FOO=bar=baz".into()];

    // Act
    let out = agent
        .client()
        .exec(&req)
        .unwrap()
        .wait_with_output()
        .unwrap();

    // Assert
    let expected = format!(
        "{}\nbar=baz|unset\n/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n",
        cwd.display()
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), expected);
}

#[test]
fn commands_start_with_default_signal_dispositions_whatever_the_agent_inherited() {
    // Arrange: an agent that inherited SIGINT and SIGQUIT ignored (`nohup agent &` in a script).
    let agent = Agent::start_ignoring_sigint();

    // Act
    let out = agent
        .client()
        .exec(&ExecRequest::new(["grep", "SigIgn", "/proc/self/status"]))
        .unwrap()
        .wait_with_output()
        .unwrap();

    // Assert: no standard signal (1-31) ignored, so Ctrl-C on a command's terminal interrupts
    // it. (Bit N-1 stands for signal N; glibc keeps its realtime signals to itself.)
    let text = String::from_utf8_lossy(&out.stdout);
    let hex = text
        .trim()
        .strip_prefix("SigIgn:")
        .map(str::trim)
        .unwrap_or_default();
    let ignored = u64::from_str_radix(hex, 16).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    assert_eq!(ignored & 0x7fff_ffff, 0, "ignored signals: {ignored:#x}");
}

#[test]
fn numeric_user_runs_the_command_with_those_ids_needs_root() {
    // Arrange: switching users needs root (the agent is root inside a VM).
    // SAFETY: getuid has no preconditions.
    let root = unsafe { libc::getuid() } == 0;
    assert!(root, "this test needs root (its name ends in _needs_root; scripts/test.sh skips those when not root)");
    let agent = Agent::start();
    let mut req = sh("echo $(id -u):$(id -g):$(id -G)");
    req.user = Some("4321:8765".into());

    // Act
    let out = agent
        .client()
        .exec(&req)
        .unwrap()
        .wait_with_output()
        .unwrap();

    // Assert
    assert_eq!(out.stdout, b"4321:8765:8765\n");
}

#[test]
fn invalid_requests_are_refused_with_an_error() {
    // Arrange
    let agent = Agent::start();
    let mut bad_cwd = sh("true");
    bad_cwd.cwd = Some("/no/such/dir".into());
    let mut bad_version = sh("true");
    bad_version.version = 99;
    let mut bad_env = sh("true");
    bad_env.env = vec!["NOEQUALS".into()];
    let empty = ExecRequest::new(Vec::<String>::new());

    // Act
    let errors: Vec<(String, ErrorCode)> = [bad_cwd, bad_version, bad_env, empty]
        .iter()
        .map(|req| match agent.client().exec(req) {
            Err(ClientError::Agent(e)) => (e.message, e.code),
            other => panic!("expected an agent error, got {other:?}"),
        })
        .collect();

    // Assert
    assert!(errors[0].0.contains("/no/such/dir"), "{:?}", errors[0]);
    assert!(errors[1].0.contains("version 99"), "{:?}", errors[1]);
    assert!(errors[2].0.contains("NOEQUALS"), "{:?}", errors[2]);
    assert!(errors[3].0.contains("argv is empty"), "{:?}", errors[3]);
    let codes: Vec<ErrorCode> = errors.iter().map(|e| e.1).collect();
    assert_eq!(
        codes,
        [
            ErrorCode::InvalidRequest,
            ErrorCode::UnsupportedVersion,
            ErrorCode::InvalidRequest,
            ErrorCode::InvalidRequest
        ]
    );
}

#[test]
fn background_process_holding_stdout_delays_exit_until_it_closes() {
    // Arrange: the shell prints and exits; its child, still holding stdout, writes only after
    // the shell has exited and been reaped.
    let agent = Agent::start();
    let req = sh("(while kill -0 $$ 2>/dev/null; do sleep 0.01; done; echo late) & echo early");

    // Act
    let out = agent
        .client()
        .exec(&req)
        .unwrap()
        .wait_with_output()
        .unwrap();

    // Assert
    assert_eq!(out.stdout, b"early\nlate\n");
    assert_eq!(out.status.code, Some(0));
}

#[test]
fn command_sees_only_stdin_stdout_and_stderr() {
    // Arrange: `ls` lists its own fds; 3 is the directory it reads.
    let agent = Agent::start();
    let req = ExecRequest::new(["ls", "/proc/self/fd"]);

    // Act
    let out = agent
        .client()
        .exec(&req)
        .unwrap()
        .wait_with_output()
        .unwrap();

    // Assert
    assert_eq!(String::from_utf8_lossy(&out.stdout), "0\n1\n2\n3\n");
}

#[test]
fn finished_execs_leave_no_descriptors_open_in_the_agent() {
    // Arrange: the baseline is taken after a warm-up exec (the Ready connection is closed by
    // then); it may still include that exec's last few descriptors, so the endings below are
    // repeated 5 times: a leak of even one descriptor per exec would add 20.
    let agent = Agent::start();
    agent
        .client()
        .exec(&sh("true"))
        .unwrap()
        .wait_with_output()
        .unwrap();
    let baseline = agent.open_fds();
    let mut timed = sh("sleep 100");
    timed.timeout_ms = Some(10);
    let mut fed = sh("cat");
    fed.stdin = true;

    // Act: one of each ending: exit, timeout, spawn failure, disconnect.
    for _ in 0..5 {
        agent
            .client()
            .exec(&sh("echo hi"))
            .unwrap()
            .wait_with_output()
            .unwrap();
        agent
            .client()
            .exec(&timed)
            .unwrap()
            .wait_with_output()
            .unwrap();
        let missing = ExecRequest::new(["/nonexistent"]);
        agent
            .client()
            .exec(&missing)
            .unwrap()
            .wait_with_output()
            .unwrap();
        let dropped = agent.client().exec(&fed).unwrap();
        let pgid = dropped.pid().unwrap();
        dropped.writer().disconnect().unwrap();
        drop(dropped);
        assert!(wait_until(|| group_is_gone(pgid)));
    }

    // Assert
    assert!(
        wait_until(|| agent.open_fds() <= baseline),
        "agent has {} fds open, {baseline} before",
        agent.open_fds()
    );
}
