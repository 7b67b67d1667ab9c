//! Container execs end to end over the agent's Unix socket (test mode, on the host): a
//! busybox root file system in a temporary directory plays the container's `rootfs`. Making
//! namespaces and mounts needs root, as the agent has in the guest.

mod common;

use std::os::unix::fs::symlink;
use std::path::Path;

use bulkhead_protocol::client::ClientError;
use bulkhead_protocol::{ContainerExec, ErrorCode, ExecRequest, Rlimit};
use common::Agent;

/// busybox-static, which `scripts/setup.sh` installs.
const BUSYBOX: &str = "/bin/busybox";

fn assert_root() {
    // SAFETY: getuid has no preconditions.
    let root = unsafe { libc::getuid() } == 0;
    assert!(
        root,
        "this test needs root (its name ends in _needs_root; scripts/test.sh skips those when not root)"
    );
}

/// A root file system with busybox as `sh` and friends, `/proc`, `/dev`, `/sys`, `/tmp`, an
/// `/etc/passwd` and a marker file.
fn busybox_root(dir: &Path) {
    for sub in ["bin", "proc", "dev", "sys", "tmp", "etc"] {
        std::fs::create_dir(dir.join(sub)).unwrap();
    }
    std::fs::copy(BUSYBOX, dir.join("bin/busybox")).unwrap();
    for applet in [
        "sh", "cat", "echo", "ls", "id", "grep", "sleep", "touch", "wc",
    ] {
        symlink("busybox", dir.join("bin").join(applet)).unwrap();
    }
    std::fs::write(
        dir.join("etc/passwd"),
        "root:x:0:0::/root:/bin/sh\napp:x:1234:4321::/home/app:/bin/sh\n",
    )
    .unwrap();
    std::fs::write(dir.join("marker"), "inside the container\n").unwrap();
}

/// As root: a busybox root file system in a new temporary directory and an agent.
fn busybox_container() -> (tempfile::TempDir, Agent) {
    assert_root();
    let dir = tempfile::tempdir().unwrap();
    busybox_root(dir.path());
    (dir, Agent::start())
}

fn container_sh(root: &Path, script: &str) -> ExecRequest {
    let mut req = ExecRequest::new(["sh", "-c", script]);
    req.env = vec!["PATH=/bin".into()];
    req.container = Some(ContainerExec::new(root.to_str().unwrap()));
    req
}

fn stdout_of(agent: &Agent, req: &ExecRequest) -> String {
    let out = agent
        .client()
        .exec(req)
        .unwrap()
        .wait_with_output()
        .unwrap();
    assert!(
        out.status.success(),
        "{:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn a_containers_first_process_is_pid_1_in_its_own_root_and_proc_needs_root() {
    // Arrange
    let (dir, agent) = busybox_container();
    let req = container_sh(
        dir.path(),
        "echo pid=$$; cat /marker; ls /; echo procs=$(ls /proc | grep -c '^[0-9]')",
    );

    // Act
    let out = stdout_of(&agent, &req);

    // Assert
    assert!(out.starts_with("pid=1\ninside the container\n"), "{out}");
    assert!(out.contains("marker"), "{out}");
    // `sh`, its `$(...)` subshell, `ls` and `grep`: none of the host's processes are visible.
    let procs: u32 = out.rsplit("procs=").next().unwrap().trim().parse().unwrap();
    assert!((1..=4).contains(&procs), "{out}");
}

#[test]
fn an_exec_into_a_running_container_shares_its_root_and_processes_needs_root() {
    // Arrange: a first process that waits on its stdin.
    let (dir, agent) = busybox_container();
    let mut first = container_sh(dir.path(), "touch /tmp/from-first; echo ready; cat");
    first.stdin = true;
    let mut session = agent.client().exec(&first).unwrap();
    let pid = session.pid().unwrap();
    let ready = session.next_event().unwrap();
    assert!(
        matches!(ready, Some(bulkhead_protocol::client::ExecEvent::Stdout(ref b)) if b == b"ready\n"),
        "{ready:?}"
    );
    let mut join = container_sh(
        dir.path(),
        "ls /tmp; echo pid=$$; ls /proc | grep -c '^[0-9]'",
    );
    join.container.as_mut().unwrap().join_pid = Some(pid);

    // Act
    let out = stdout_of(&agent, &join);
    session.writer().close_stdin().unwrap();
    let first_out = session.wait_with_output().unwrap();

    // Assert
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "from-first", "{out}");
    assert_ne!(lines[1], "pid=1", "{out}");
    let procs: u32 = lines[2].parse().unwrap();
    assert!((2..=5).contains(&procs), "{out}");
    assert!(first_out.status.success(), "{:?}", first_out.status);
}

#[test]
fn the_user_groups_limits_and_no_new_privileges_apply_inside_needs_root() {
    // Arrange
    let (dir, agent) = busybox_container();
    let mut req = container_sh(
        dir.path(),
        "echo $(id -u):$(id -g):$(id -G); ulimit -n; echo $HOME; grep NoNewPrivs /proc/self/status",
    );
    req.user = Some("app".into());
    let spec = req.container.as_mut().unwrap();
    spec.groups = vec![5, 6];
    spec.rlimits = vec![Rlimit {
        kind: "RLIMIT_NOFILE".into(),
        soft: 64,
        hard: 128,
    }];
    spec.no_new_privileges = true;

    // Act
    let out = stdout_of(&agent, &req);

    // Assert
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "1234:4321:4321 5 6", "{out}");
    assert_eq!(lines[1], "64", "{out}");
    assert_eq!(lines[2], "/home/app", "{out}");
    assert_eq!(
        lines[3].split_whitespace().collect::<Vec<_>>(),
        ["NoNewPrivs:", "1"],
        "{out}"
    );
}

#[test]
fn a_bad_container_request_is_refused_before_anything_runs() {
    // Arrange: no root needed, nothing is mounted.
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start();
    let missing_root = container_sh(Path::new("/no/such/rootfs"), "true");
    let mut bad_limit = container_sh(dir.path(), "true");
    bad_limit.container.as_mut().unwrap().rlimits = vec![Rlimit {
        kind: "RLIMIT_WISHES".into(),
        soft: 3,
        hard: 3,
    }];

    // Act
    let results = [missing_root, bad_limit].map(|r| agent.client().exec(&r).map(|_| ()));

    // Assert
    for result in results {
        match result {
            Err(ClientError::Agent(e)) => assert_eq!(e.code, ErrorCode::InvalidRequest, "{e:?}"),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }
}

#[test]
fn writes_go_to_the_containers_own_layer_and_a_read_only_root_refuses_them_needs_root() {
    // Arrange
    let (dir, agent) = busybox_container();
    let write = "echo changed > /marker && echo new > /made && cat /marker /made";
    let mut read_only = container_sh(dir.path(), "echo x > /made 2>/dev/null || echo refused");
    read_only.container.as_mut().unwrap().read_only_root = true;

    // Act
    let first = stdout_of(&agent, &container_sh(dir.path(), write));
    let second = stdout_of(
        &agent,
        &container_sh(dir.path(), "cat /marker; ls /made 2>&1 || true"),
    );
    let refused = stdout_of(&agent, &read_only);

    // Assert: the container saw its writes; the root and the next container did not.
    assert_eq!(first, "changed\nnew\n");
    assert!(second.starts_with("inside the container\n"), "{second}");
    assert!(!second.contains("\n/made\n"), "{second}");
    assert_eq!(
        std::fs::read_to_string(dir.path().join("marker")).unwrap(),
        "inside the container\n"
    );
    assert!(!dir.path().join("made").exists());
    assert_eq!(refused, "refused\n");
}

#[test]
fn a_signal_reaches_a_containers_first_process_that_handles_it_needs_root() {
    // Arrange: PID 1 of its namespace gets only the signals it has a handler for.
    let (dir, agent) = busybox_container();
    let req = container_sh(
        dir.path(),
        "trap 'echo got-term; exit 143' TERM; echo ready; while :; do sleep 1; done",
    );
    let mut session = agent.client().exec(&req).unwrap();
    let ready = session.next_event().unwrap();
    assert!(
        matches!(ready, Some(bulkhead_protocol::client::ExecEvent::Stdout(ref b)) if b == b"ready\n"),
        "{ready:?}"
    );

    // Act
    session.writer().signal(libc::SIGTERM).unwrap();
    let out = session.wait_with_output().unwrap();

    // Assert
    assert_eq!(String::from_utf8_lossy(&out.stdout), "got-term\n");
    assert_eq!(out.status.code, Some(143), "{:?}", out.status);
}
