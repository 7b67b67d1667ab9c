//! `kill_group_on_exit` (`docker run` semantics): `Exit` follows the command itself, not the
//! processes that still hold its output pipes.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use bulkhead_protocol::ExecRequest;
use common::{group_is_gone, noise, wait_until, Agent, PATIENCE};

/// Set (to the path of its go file) in the environment of [`big_pipe_writer`]'s re-run.
const WRITER_ENV: &str = "BULKHEAD_TEST_BIG_PIPE_WRITER";

/// Bytes [`big_pipe_writer`] leaves in its stderr pipe: more than the agent reads from a pipe
/// per wakeup (64 KiB), less than the pipe it grows to 1 MiB.
const WRITER_BYTES: usize = 768 * 1024;

/// `sh -c SCRIPT` with `kill_group_on_exit` set.
fn run_like_docker(script: &str) -> ExecRequest {
    let mut req = ExecRequest::new(["/bin/sh", "-c", script]);
    req.kill_group_on_exit = true;
    req
}

#[test]
fn a_background_process_holding_stdout_no_longer_delays_exit_and_is_killed() {
    // Arrange
    let agent = Agent::start();
    let started = Instant::now();

    // Act
    let session = agent
        .client()
        .exec(&run_like_docker("sleep 1000 & echo done"))
        .unwrap();
    let pgid = session.pid().unwrap();
    let out = session.wait_with_output().unwrap();

    // Assert
    assert_eq!(out.stdout, b"done\n");
    assert_eq!((out.status.code, out.status.timed_out), (Some(0), false));
    assert!(started.elapsed() < PATIENCE, "{:?}", started.elapsed());
    assert!(
        wait_until(|| group_is_gone(pgid)),
        "the background sleep of group {pgid} survived"
    );
}

#[test]
fn output_the_command_wrote_before_exiting_is_all_delivered() {
    // Arrange: 40 000 lines (about 400 KB, several pipe buffers) from the shell itself, while a
    // background child keeps the pipes open.
    let agent = Agent::start();
    let script = "sleep 1000 & i=0; while [ $i -lt 40000 ]; do echo line$i; i=$((i+1)); done";
    let expected: String = (0..40_000).map(|i| format!("line{i}\n")).collect();

    // Act
    let out = agent
        .client()
        .exec(&run_like_docker(script))
        .unwrap()
        .wait_with_output()
        .unwrap();

    // Assert
    assert_eq!(out.status.code, Some(0));
    assert_eq!(out.stdout.len(), expected.len());
    assert!(out.stdout == expected.as_bytes(), "output altered");
}

#[test]
fn a_process_outside_the_group_holding_stdout_does_not_delay_exit() {
    // Arrange: a child in its own session (so not killed with the group) that holds stdout for
    // 30 s; the shell waits until it has left the group (its pid file exists), then exits.
    let agent = Agent::start();
    let pid_file = agent.dir().join("escaped.pid");
    let script = format!(
        "setsid sh -c 'echo $$ > {f}.tmp && mv {f}.tmp {f}; exec sleep 30' & \
         while [ ! -s {f} ]; do sleep 0.01; done; echo done",
        f = pid_file.display()
    );
    let started = Instant::now();

    // Act
    let out = agent
        .client()
        .exec(&run_like_docker(&script))
        .unwrap()
        .wait_with_output()
        .unwrap();
    let elapsed = started.elapsed();

    // Assert
    assert_eq!(out.stdout, b"done\n");
    assert_eq!(out.status.code, Some(0));
    assert!(elapsed < Duration::from_secs(20), "{elapsed:?}");
    kill_escaped(&pid_file);
}

/// Kills the process whose pid `file` holds (it left the group, so nothing else will).
fn kill_escaped(file: &std::path::Path) {
    let pid: libc::pid_t = std::fs::read_to_string(file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // SAFETY: kill(2) takes no pointers; the pid is the escaped `sleep` started by this test.
    unsafe { libc::kill(pid, libc::SIGKILL) };
}

#[test]
fn output_still_in_the_pipes_when_the_command_is_reaped_is_delivered() {
    // Arrange: the agent is stopped while the command writes 768 KiB into its (1 MiB) stderr
    // pipe and exits, so when the agent resumes, the status and most of the output are both
    // waiting: only the final read after the group kill can deliver that output.
    let agent = Agent::start();
    let go = agent.dir().join("go");
    let session = agent.client().exec(&big_pipe_writer_request(&go)).unwrap();
    let pid = session.pid().unwrap();
    let agent_pid = proc_stat(pid).1;
    signal(agent_pid, libc::SIGSTOP);
    std::fs::write(&go, b"").unwrap();
    let reaped_later = wait_until(|| proc_stat(pid).0 == 'Z');
    signal(agent_pid, libc::SIGCONT);

    // Act
    let out = session.wait_with_output().unwrap();

    // Assert
    assert!(reaped_later, "the writer never finished");
    assert_eq!(out.status.code, Some(0));
    assert_eq!(out.stderr.len(), WRITER_BYTES);
    assert!(out.stderr == noise(WRITER_BYTES, 7), "output altered");
}

/// This test binary, re-run as the command: only [`big_pipe_writer`], with [`WRITER_ENV`].
fn big_pipe_writer_request(go: &Path) -> ExecRequest {
    let exe = std::env::current_exe().unwrap();
    let mut req = ExecRequest::new([
        exe.to_str().unwrap(),
        "--exact",
        "big_pipe_writer",
        "--ignored",
    ]);
    req.env = vec![format!("{WRITER_ENV}={}", go.display()).into()];
    req.kill_group_on_exit = true;
    req
}

/// Not a test of its own: the command of
/// `output_still_in_the_pipes_when_the_command_is_reaped_is_delivered`. Waits for the go file,
/// grows its stderr pipe to 1 MiB, writes [`WRITER_BYTES`] into it and exits at once.
#[test]
#[ignore = "the command of another test, run by it"]
fn big_pipe_writer() {
    let go = std::env::var_os(WRITER_ENV).expect("only run by another test");
    assert!(wait_until(|| Path::new(&go).exists()), "no go file");
    // SAFETY: fcntl(2) F_SETPIPE_SZ on our own stderr descriptor; no pointers.
    let size = unsafe { libc::fcntl(2, libc::F_SETPIPE_SZ, 1 << 20) };
    assert!(size >= WRITER_BYTES as libc::c_int, "pipe size {size}");
    let data = noise(WRITER_BYTES, 7);
    let mut written = 0;
    while written < data.len() {
        let rest = &data[written..];
        // SAFETY: `rest` is valid for reads of `rest.len()` bytes during the call.
        let n = unsafe { libc::write(2, rest.as_ptr().cast(), rest.len()) };
        assert!(n > 0, "write: {}", std::io::Error::last_os_error());
        written += n as usize;
    }
    std::process::exit(0);
}

/// State letter and parent pid of process `pid`, from `/proc/PID/stat` (proc(5)).
fn proc_stat(pid: u32) -> (char, libc::pid_t) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after_name = &stat[stat.rfind(')').unwrap() + 2..];
    let mut fields = after_name.split(' ');
    let state = fields.next().unwrap().chars().next().unwrap();
    (state, fields.next().unwrap().parse().unwrap())
}

fn signal(pid: libc::pid_t, signo: libc::c_int) {
    // SAFETY: kill(2) takes no pointers; `pid` is the agent process this test started.
    assert_eq!(unsafe { libc::kill(pid, signo) }, 0);
}
