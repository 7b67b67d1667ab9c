//! Container execs in a real guest (the containerd shim's building block): the guest kernel's
//! PID namespaces, and a root moved over the initramfs root (where `pivot_root(2)` is refused),
//! with the guest's own view left as it was.

use bulkhead_protocol::client::ExecEvent;
use bulkhead_protocol::{ContainerExec, ExecRequest};
use bulkhead_sandbox::{Sandbox, SandboxConfig};
use bulkhead_tests::{guest_test, sandbox_config};

/// The container's root in guest RAM, made from the guest's own busybox.
const ROOT: &str = "/c";

const MAKE_ROOT: &str = "mkdir -p /c/bin /c/proc /c/dev /c/sys /c/tmp && cp /bin/busybox /c/bin/ \
    && for a in sh cat ls grep echo touch; do ln -s busybox /c/bin/$a; done \
    && echo inside > /c/marker";

fn config() -> SandboxConfig {
    SandboxConfig {
        memory_mib: 256,
        ..sandbox_config()
    }
}

fn sh(script: &str) -> ExecRequest {
    ExecRequest::new(["sh", "-c", script])
}

fn in_container(script: &str, join_pid: Option<u32>) -> ExecRequest {
    let mut req = sh(script);
    req.env = vec!["PATH=/bin".into()];
    let mut spec = ContainerExec::new(ROOT);
    spec.join_pid = join_pid;
    req.container = Some(spec);
    req
}

fn stdout_of(sandbox: &Sandbox, req: &ExecRequest) -> String {
    let out = sandbox.exec(req).unwrap().wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

guest_test!(
    fn a_container_gets_its_own_root_and_pids_and_an_exec_joins_them() {
        // Arrange: a first process that waits on its stdin.
        let sandbox = Sandbox::start(&config()).unwrap();
        stdout_of(&sandbox, &sh(MAKE_ROOT));
        let mut first = in_container("echo pid=$$; cat /marker; touch /tmp/seen; cat", None);
        first.stdin = true;
        let mut session = sandbox.exec(&first).unwrap();
        let pid = session.pid().unwrap();
        let mut seen = String::new();
        while !seen.contains("inside\n") {
            match session.next_event().unwrap() {
                Some(ExecEvent::Stdout(b)) => seen.push_str(&String::from_utf8_lossy(&b)),
                other => panic!("waiting for the first process's output in {seen:?}: {other:?}"),
            }
        }
        let join = in_container(
            "ls /tmp; echo pid=$$; ls /proc | grep -c '^[0-9]'",
            Some(pid),
        );

        // Act
        let joined = stdout_of(&sandbox, &join);
        session.writer().close_stdin().unwrap();
        let first_end = session.wait_with_output().unwrap();
        let guest_view = stdout_of(
            &sandbox,
            &sh("ls /c/proc | wc -l; ls /proc | grep -c '^[0-9]'"),
        );

        // Assert
        assert_eq!(seen, "pid=1\ninside\n");
        let lines: Vec<&str> = joined.lines().collect();
        assert_eq!(lines[0], "seen", "{joined}");
        assert_ne!(lines[1], "pid=1", "{joined}");
        let procs: u32 = lines[2].parse().unwrap();
        assert!((2..=5).contains(&procs), "{joined}");
        assert!(first_end.status.success(), "{:?}", first_end.status);
        // The container's /proc mount stayed in its mount namespace; the guest sees its own
        // processes (the agent, kernel threads) in its /proc.
        let view: Vec<u32> = guest_view.lines().map(|l| l.parse().unwrap()).collect();
        assert_eq!(view[0], 0, "{guest_view}");
        assert!(view[1] > procs, "{guest_view}");
    }
);

guest_test!(
    fn a_container_killed_after_execs_joined_it_stops() {
        // Arrange: a container whose first process waits, and two execs that join it and end.
        let dir = bulkhead_tests::scratch_dir();
        let console = dir.path().join("console.log");
        let sandbox = Sandbox::start(&SandboxConfig {
            console: bulkhead_vmm::config::SerialOutput::File(console.clone()),
            ..config()
        })
        .unwrap();
        stdout_of(&sandbox, &sh(MAKE_ROOT));
        let mut first = in_container("echo up; exec sleep 1000", None);
        first.stdin = true;
        let mut session = sandbox.exec(&first).unwrap();
        let pid = session.pid().unwrap();
        assert!(matches!(
            session.next_event().unwrap(),
            Some(ExecEvent::Stdout(_))
        ));
        // As the containerd shim runs `ctr task exec`: stdin open, closed after the exit.
        for _ in 0..3 {
            let mut join = in_container("echo joined", Some(pid));
            join.stdin = true;
            let mut exec = sandbox.exec(&join).unwrap();
            let writer = exec.writer();
            while let Ok(Some(event)) = exec.next_event() {
                if matches!(event, ExecEvent::Exit(_)) {
                    break;
                }
            }
            let _ = writer.close_stdin();
        }

        // Act
        session.writer().signal(libc::SIGKILL).unwrap();
        let end = session.wait_with_output();

        // Assert
        let shown = std::fs::read_to_string(&console).unwrap_or_default();
        let end = end.unwrap_or_else(|e| panic!("{e}\n--- console\n{shown}"));
        assert_eq!(
            end.status.signal,
            Some(libc::SIGKILL),
            "{:?}\n--- console\n{shown}",
            end.status
        );
    }
);
