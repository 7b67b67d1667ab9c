//! Sandbox lifecycle against the real daemon process: concurrency, TTL, VM crashes, SIGTERM
//! policies, and restarts after `kill -9` — each checked for leftovers (VMM processes, runtime
//! files, records, cgroups).

mod common;

use std::time::Duration;

use bulkhead_client::{ExecEvent, ExecSpec, SandboxState};
use common::{alive, rt, spec_with_labels, wait_until, TestDaemon};

#[test]
fn twenty_concurrent_sandboxes_run_and_leave_nothing_behind() {
    // Arrange
    let daemon = TestDaemon::start();
    let client = daemon.client();
    let rt = rt();

    // Act
    let outputs = rt.block_on(async {
        let tasks: Vec<_> = (0..20)
            .map(|_| {
                let client = client.clone();
                tokio::spawn(async move {
                    let sb = client.create(&spec_with_labels(&[])).await.unwrap();
                    let nproc = client
                        .exec_collect(&sb.id, &ExecSpec::new(["nproc"]))
                        .await
                        .unwrap();
                    // Under the fake VMM a command is a child of its sandbox's VMM process.
                    let parent = client
                        .exec_collect(&sb.id, &ExecSpec::new(["sh", "-c", "echo $PPID"]))
                        .await
                        .unwrap();
                    client.delete(&sb.id).await.unwrap();
                    (sb.vmm_pid.unwrap(), nproc, parent)
                })
            })
            .collect();
        let mut outputs = Vec::new();
        for task in tasks {
            outputs.push(task.await.unwrap());
        }
        outputs
    });

    // Assert
    assert_eq!(outputs.len(), 20);
    for (vmm_pid, nproc, parent) in &outputs {
        assert!(nproc.exit.success() && !nproc.stdout.is_empty());
        let parent = String::from_utf8_lossy(&parent.stdout);
        assert_eq!(
            parent.trim(),
            vmm_pid.to_string(),
            "the exec ran in another sandbox"
        );
    }
    let pids: Vec<u32> = outputs.iter().map(|(pid, _, _)| *pid).collect();
    assert_eq!(daemon.leftovers(&pids), Vec::<String>::new());
}

#[test]
fn a_sandbox_with_ttl_3_is_gone_within_5_seconds() {
    // Arrange
    let daemon = TestDaemon::start();
    let client = daemon.client();
    let rt = rt();
    let mut spec = spec_with_labels(&[]);
    spec.ttl_s = Some(3);
    let created = rt.block_on(client.create(&spec)).unwrap();
    let started = std::time::Instant::now();

    // Act
    let gone = wait_until(Duration::from_secs(5), || {
        rt.block_on(client.get(&created.id))
            .is_err_and(|e| e.status() == Some(404))
    });

    // Assert
    assert!(gone, "still there after {:?}", started.elapsed());
    assert!(
        started.elapsed() >= Duration::from_millis(2500),
        "destroyed too early"
    );
    assert_eq!(
        daemon.leftovers(&[created.vmm_pid.unwrap()]),
        Vec::<String>::new()
    );
}

#[test]
fn a_vmm_that_dies_makes_the_sandbox_failed_with_reason_and_log() {
    // Arrange: the fake VMM runs commands as its children, so $PPID is the VMM itself.
    let daemon = TestDaemon::start();
    let client = daemon.client();
    let rt = rt();
    let sb = rt.block_on(client.create(&spec_with_labels(&[]))).unwrap();
    let _ = rt.block_on(client.exec_collect(&sb.id, &ExecSpec::new(["sh", "-c", "kill -9 $PPID"])));

    // Act
    let failed = wait_until(Duration::from_secs(10), || {
        rt.block_on(client.get(&sb.id)).unwrap().state == SandboxState::Failed
    });
    let info = rt.block_on(client.get(&sb.id)).unwrap();
    let exec = rt
        .block_on(client.exec_collect(&sb.id, &ExecSpec::new(["true"])))
        .unwrap_err();
    rt.block_on(client.delete(&sb.id)).unwrap();

    // Assert
    assert!(failed);
    let failure = info.failure.unwrap();
    assert_eq!(failure.reason, "killed");
    assert!(failure.message.contains("signal 9"), "{}", failure.message);
    assert!(
        failure.log_tail.contains("fake-vmm: booting"),
        "{}",
        failure.log_tail
    );
    assert_eq!(exec.status(), Some(409));
    assert!(rt.block_on(client.health()).is_ok());
    assert_eq!(
        daemon.leftovers(&[sb.vmm_pid.unwrap()]),
        Vec::<String>::new()
    );
}

#[test]
fn kill_9_during_an_exec_then_restart_adopts_the_vm_and_nothing_leaks() {
    // Arrange
    let mut daemon = TestDaemon::start();
    let client = daemon.client();
    let rt = rt();
    let sb = rt.block_on(client.create(&spec_with_labels(&[]))).unwrap();
    let mut stream = rt
        .block_on(client.exec(
            &sb.id,
            &ExecSpec::new(["sh", "-c", "echo started; sleep 600"]),
        ))
        .unwrap();
    let first = rt.block_on(stream.next_event()).unwrap();

    // Act
    daemon.kill9();
    let broken = rt.block_on(stream.next_event()).unwrap_err();
    daemon.spawn(&[]);
    let adopted = rt.block_on(client.get(&sb.id)).unwrap();
    let out = rt
        .block_on(client.exec_collect(&sb.id, &ExecSpec::new(["echo", "still here"])))
        .unwrap();
    rt.block_on(client.delete(&sb.id)).unwrap();

    // Assert
    assert_eq!(first, Some(ExecEvent::Stdout(b"started\n".to_vec())));
    assert!(
        broken
            .to_string()
            .contains("before the command's exit status"),
        "{broken}"
    );
    assert_eq!(adopted.state, SandboxState::Running);
    assert_eq!(adopted.vmm_pid, sb.vmm_pid);
    assert_eq!(out.stdout, b"still here\n");
    assert_eq!(
        daemon.leftovers(&[sb.vmm_pid.unwrap()]),
        Vec::<String>::new()
    );
}

#[test]
fn kill_9_then_restart_with_destroy_policy_removes_every_vm() {
    // Arrange
    let mut daemon = TestDaemon::start();
    let client = daemon.client();
    let rt = rt();
    let a = rt.block_on(client.create(&spec_with_labels(&[]))).unwrap();
    let b = rt.block_on(client.create(&spec_with_labels(&[]))).unwrap();

    // Act
    daemon.kill9();
    let survived = alive(a.vmm_pid.unwrap()) && alive(b.vmm_pid.unwrap());
    daemon.spawn(&["--on-restart", "destroy"]);
    let listed = rt.block_on(client.list(&Default::default())).unwrap();

    // Assert
    assert!(survived, "the VMs must outlive the daemon");
    assert!(listed.is_empty(), "{listed:?}");
    assert_eq!(
        daemon.leftovers(&[a.vmm_pid.unwrap(), b.vmm_pid.unwrap()]),
        Vec::<String>::new()
    );
}

#[test]
fn a_vm_that_died_while_the_daemon_was_down_is_reported_failed() {
    // Arrange
    let mut daemon = TestDaemon::start();
    let client = daemon.client();
    let rt = rt();
    let sb = rt.block_on(client.create(&spec_with_labels(&[]))).unwrap();
    daemon.kill9();
    // SAFETY: kill(2) of the VMM, which this test created through the daemon.
    unsafe { libc::kill(sb.vmm_pid.unwrap() as libc::pid_t, libc::SIGKILL) };
    assert!(wait_until(Duration::from_secs(5), || !alive(
        sb.vmm_pid.unwrap()
    )));

    // Act
    daemon.spawn(&[]);
    let info = rt.block_on(client.get(&sb.id)).unwrap();
    rt.block_on(client.delete(&sb.id)).unwrap();

    // Assert
    assert_eq!(info.state, SandboxState::Failed);
    assert_eq!(info.failure.unwrap().reason, "vanished");
    assert_eq!(daemon.leftovers(&[]), Vec::<String>::new());
}

#[test]
fn sigterm_destroys_every_sandbox_by_default() {
    // Arrange
    let mut daemon = TestDaemon::start();
    let client = daemon.client();
    let rt = rt();
    let sb = rt.block_on(client.create(&spec_with_labels(&[]))).unwrap();

    // Act
    let clean_exit = daemon.terminate();

    // Assert
    assert!(clean_exit);
    assert!(!daemon.socket.exists(), "the socket file is removed");
    assert!(
        !daemon.vms_dir().exists(),
        "the empty VM runtime root is removed"
    );
    assert_eq!(
        daemon.leftovers(&[sb.vmm_pid.unwrap()]),
        Vec::<String>::new()
    );
}

#[test]
fn sigterm_with_leave_keeps_the_vms_for_the_next_start() {
    // Arrange
    let mut daemon = TestDaemon::start_with(&["--on-shutdown", "leave"]);
    let client = daemon.client();
    let rt = rt();
    let sb = rt.block_on(client.create(&spec_with_labels(&[]))).unwrap();

    // Act
    assert!(daemon.terminate());
    let kept = alive(sb.vmm_pid.unwrap());
    daemon.spawn(&[]);
    let out = rt
        .block_on(client.exec_collect(&sb.id, &ExecSpec::new(["echo", "back"])))
        .unwrap();
    rt.block_on(client.delete(&sb.id)).unwrap();

    // Assert
    assert!(kept, "the VM keeps running while no daemon runs");
    assert_eq!(out.stdout, b"back\n");
    assert_eq!(
        daemon.leftovers(&[sb.vmm_pid.unwrap()]),
        Vec::<String>::new()
    );
}

#[test]
fn half_created_and_unrecorded_leftovers_are_cleaned_at_start() {
    // Arrange: a daemon killed mid-create leaves a `creating` record, a runtime dir and a VMM;
    // one killed before writing a record leaves a runtime dir and a VMM with no record.
    let mut daemon = TestDaemon::start();
    daemon.kill9();
    let vms = daemon.vms_dir();
    let mut stray_vmms = Vec::new();
    for id in ["0123456789ab", "ba9876543210"] {
        let dir = vms.join(id).join("sb-x");
        std::fs::create_dir_all(&dir).unwrap();
        // A long-lived process whose command line names the runtime dir, as a VMM's does.
        let vmm = std::process::Command::new("perl")
            .args(["-e", "sleep 600", "--"])
            .arg(dir.join("vm.json"))
            .spawn()
            .unwrap();
        wait_for_cmdline(vmm.id(), &dir);
        stray_vmms.push(vmm);
    }
    let record = serde_json::json!({
        "id": "0123456789ab", "spec": {}, "created_at_ms": 1, "expires_at_ms": null,
        "phase": "creating", "runtime_parent": vms.join("0123456789ab"), "cgroup": null,
        "limits": {"memory_bytes": 1, "cpu_quota": null, "pids_max": 64, "cgroup": null},
        "sandbox": null, "failure": null
    });
    std::fs::write(
        daemon.state_dir.join("sandboxes/0123456789ab.json"),
        record.to_string(),
    )
    .unwrap();

    // Act
    daemon.spawn(&[]);
    let killed: Vec<bool> = stray_vmms
        .iter_mut()
        .map(|c| c.wait().unwrap().code().is_none())
        .collect();

    // Assert
    assert_eq!(killed, [true, true]);
    assert_eq!(daemon.leftovers(&[]), Vec::<String>::new());
}

/// Waits until `/proc/PID/cmdline` names `dir`: a vfork-based spawn returns while the child is
/// still inside execve, before its new argument list is readable.
fn wait_for_cmdline(pid: u32, dir: &std::path::Path) {
    let needle = dir.to_str().unwrap().as_bytes();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if cmdline.windows(needle.len()).any(|w| w == needle) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "process {pid} never showed its arguments"
        );
        std::thread::yield_now();
    }
}
