//! Pause, resume and templates against the real daemon process with the fake VMM, whose
//! "snapshots" are a state file and a sparse memory file (the guest's processes and files are
//! the host's here: `tests/guest.rs` checks that a real guest continues where it was).

mod common;

use std::path::{Path, PathBuf};

use bulkhead_client::{Client, CreateSandbox, ExecSpec, MountSpec, SandboxState};
use common::{alive, api_error, list, rt, spec_with_labels, TestDaemon};

/// `<state>/paused/<id>`.
fn saved_vm(daemon: &TestDaemon, id: &str) -> PathBuf {
    daemon.state_dir.join("paused").join(id)
}

/// The names of the files in `dir`, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = list(dir)
        .iter()
        .filter_map(|p| p.file_name()?.to_str().map(str::to_owned))
        .collect();
    names.sort();
    names
}

/// The PID of the process that runs commands in the sandbox (under the fake VMM: the VMM).
async fn exec_parent(client: &Client, id: &str) -> String {
    let out = client
        .exec_collect(id, &ExecSpec::new(["sh", "-c", "echo $PPID"]))
        .await
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

#[test]
fn a_paused_sandbox_has_no_vmm_refuses_exec_and_resumes_under_its_id() {
    // Arrange
    let daemon = TestDaemon::start();
    let client = daemon.client();
    let rt = rt();
    let created = rt.block_on(client.create(&spec_with_labels(&[("k", "v")])));
    let created = created.unwrap();
    let old_vmm = created.vmm_pid.unwrap();

    // Act
    let paused = rt.block_on(client.pause(&created.id)).unwrap();
    let saved = names(&saved_vm(&daemon, &created.id));
    let cgroups_while_paused = daemon.vm_cgroups();
    let runtime_while_paused = daemon.vms_dir().join(&created.id).exists();
    let exec_while_paused = rt.block_on(client.exec_collect(&created.id, &ExecSpec::new(["true"])));
    let listed = rt.block_on(client.list(&Default::default())).unwrap();
    let resumed = rt.block_on(client.resume(&created.id)).unwrap();
    let parent = rt.block_on(exec_parent(&client, &created.id));

    // Assert
    assert_eq!(paused.state, SandboxState::Paused);
    assert_eq!(paused.vmm_pid, None);
    assert!(!alive(old_vmm), "the VMM still runs after the pause");
    assert_eq!(saved, ["memory", "sandbox.json", "state"]);
    assert!(cgroups_while_paused.is_empty(), "{cgroups_while_paused:?}");
    assert!(!runtime_while_paused, "the runtime directory stays");
    let err = exec_while_paused.unwrap_err();
    assert_eq!(err.status(), Some(409), "{err}");
    assert!(err.to_string().contains("is paused"), "{err}");
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].state, SandboxState::Paused);
    assert_eq!(resumed.id, created.id);
    assert_eq!(resumed.state, SandboxState::Running);
    assert_eq!(resumed.limits, created.limits, "same cgroup and limits");
    assert_eq!(resumed.labels, created.labels);
    let new_vmm = resumed.vmm_pid.unwrap();
    assert_ne!(new_vmm, old_vmm);
    assert_eq!(parent, new_vmm.to_string(), "exec reaches the new VMM");
    assert!(
        !saved_vm(&daemon, &created.id).exists(),
        "the saved VM stays"
    );
    rt.block_on(client.delete(&created.id)).unwrap();
    assert_eq!(daemon.leftovers(&[old_vmm, new_vmm]), Vec::<String>::new());
}

#[test]
fn deleting_a_paused_sandbox_deletes_its_saved_vm() {
    // Arrange
    let daemon = TestDaemon::start();
    let client = daemon.client();
    let rt = rt();
    let sb = rt.block_on(client.create(&spec_with_labels(&[]))).unwrap();
    rt.block_on(client.pause(&sb.id)).unwrap();

    // Act
    rt.block_on(client.delete(&sb.id)).unwrap();

    // Assert
    assert!(list(&daemon.state_dir.join("paused")).is_empty());
    assert_eq!(
        daemon.leftovers(&[sb.vmm_pid.unwrap()]),
        Vec::<String>::new()
    );
    let gone = rt.block_on(client.get(&sb.id));
    assert_eq!(gone.unwrap_err().status(), Some(404));
}

#[test]
fn a_paused_sandbox_stays_paused_across_daemon_restarts_and_then_resumes() {
    // Arrange: the default shutdown policy destroys sandboxes, but a paused one runs nothing.
    let mut daemon = TestDaemon::start();
    let rt = rt();
    let sb = rt
        .block_on(daemon.client().create(&spec_with_labels(&[])))
        .unwrap();
    rt.block_on(daemon.client().pause(&sb.id)).unwrap();

    // Act
    assert!(daemon.terminate(), "{}", daemon.log());
    daemon.spawn(&[]);
    let after_sigterm = rt.block_on(daemon.client().get(&sb.id)).unwrap();
    daemon.kill9();
    daemon.spawn(&[]);
    let after_kill = rt.block_on(daemon.client().get(&sb.id)).unwrap();
    let resumed = rt.block_on(daemon.client().resume(&sb.id)).unwrap();
    let parent = rt.block_on(exec_parent(&daemon.client(), &sb.id));

    // Assert
    assert_eq!(after_sigterm.state, SandboxState::Paused);
    assert_eq!(after_kill.state, SandboxState::Paused);
    assert_eq!(resumed.state, SandboxState::Running);
    assert_eq!(parent, resumed.vmm_pid.unwrap().to_string());
}

#[test]
fn a_failed_resume_keeps_the_sandbox_paused_with_its_saved_vm_for_a_retry() {
    // Arrange: the saved VM's state file damaged, as a full disk might leave it.
    let daemon = TestDaemon::start();
    let client = daemon.client();
    let rt = rt();
    let sb = rt.block_on(client.create(&spec_with_labels(&[]))).unwrap();
    rt.block_on(client.pause(&sb.id)).unwrap();
    let state = saved_vm(&daemon, &sb.id).join("state");
    let good = std::fs::read(&state).unwrap();
    std::fs::write(&state, b"garbage").unwrap();

    // Act
    let failed = api_error(rt.block_on(client.resume(&sb.id)));
    let after_failure = rt.block_on(client.get(&sb.id)).unwrap();
    let kept = names(&saved_vm(&daemon, &sb.id));
    std::fs::write(&state, good).unwrap();
    let retried = rt.block_on(client.resume(&sb.id)).unwrap();

    // Assert
    // Refused before a VMM starts: the state file is read first for its share slots.
    assert_eq!(
        (failed.0, failed.1.as_str()),
        (500, "start_failed"),
        "{failed:?}"
    );
    assert!(failed.2.contains("the sandbox stays paused"), "{failed:?}");
    assert!(failed.2.contains("state"), "{failed:?}");
    assert_eq!(after_failure.state, SandboxState::Paused);
    assert_eq!(kept, ["memory", "sandbox.json", "state"]);
    assert_eq!(retried.state, SandboxState::Running);
    assert!(!daemon.vm_cgroups().is_empty(), "the retry has its cgroup");
}

#[test]
fn pause_and_resume_twice_change_nothing_and_a_failed_sandbox_is_a_conflict() {
    // Arrange
    let daemon = TestDaemon::start();
    let client = daemon.client();
    let rt = rt();
    let sb = rt.block_on(client.create(&spec_with_labels(&[]))).unwrap();
    let crashed = rt.block_on(client.create(&spec_with_labels(&[]))).unwrap();
    // SAFETY: kill(2) of a VMM this test created through the daemon.
    unsafe { libc::kill(crashed.vmm_pid.unwrap() as libc::pid_t, libc::SIGKILL) };
    let failed = common::wait_until(std::time::Duration::from_secs(10), || {
        let info = rt.block_on(client.get(&crashed.id)).unwrap();
        info.state == SandboxState::Failed
    });
    assert!(failed, "the crashed sandbox never became failed");

    // Act
    let resume_running = rt.block_on(client.resume(&sb.id)).unwrap();
    rt.block_on(client.pause(&sb.id)).unwrap();
    let pause_paused = rt.block_on(client.pause(&sb.id)).unwrap();
    let pause_failed = api_error(rt.block_on(client.pause(&crashed.id)));
    let resume_failed = api_error(rt.block_on(client.resume(&crashed.id)));
    let unknown = api_error(rt.block_on(client.pause("ffffffffffff")));

    // Assert
    assert_eq!(
        resume_running.vmm_pid, sb.vmm_pid,
        "a running sandbox is left alone"
    );
    assert_eq!(pause_paused.state, SandboxState::Paused);
    assert_eq!(pause_failed.0, 409, "{pause_failed:?}");
    assert!(pause_failed.2.contains("is failed"), "{pause_failed:?}");
    assert_eq!(resume_failed.0, 409, "{resume_failed:?}");
    assert_eq!(unknown.0, 404, "{unknown:?}");
}

#[test]
fn a_sandbox_with_a_clone_workspace_is_paused_and_resumed_with_it() {
    // Arrange
    let root = tempfile::tempdir().unwrap();
    let daemon = TestDaemon::start_with(&["--mount-root", root.path().to_str().unwrap()]);
    let client = daemon.client();
    let rt = rt();
    let request = CreateSandbox {
        workspace: Some(bulkhead_client::WorkspaceSpec {
            path: root.path().display().to_string(),
            mode: bulkhead_client::WorkspaceMode::Clone,
        }),
        ..spec_with_labels(&[])
    };
    let sb = rt.block_on(client.create(&request)).unwrap();

    // Act
    let paused = rt.block_on(client.pause(&sb.id)).unwrap();
    let resumed = rt.block_on(client.resume(&sb.id)).unwrap();

    // Assert
    assert_eq!(paused.state, SandboxState::Paused);
    assert_eq!(resumed.state, SandboxState::Running);
    assert_eq!(
        resumed.workspace.as_ref().map(|w| w.mode),
        Some(bulkhead_client::WorkspaceMode::Clone)
    );
    assert!(alive(resumed.vmm_pid.unwrap()));
}

/// `target/<profile>/bulkhead`, built alongside this test (`cargo build --workspace --bins`).
fn cli() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let cli = exe
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .join("bulkhead");
    assert!(
        cli.is_file(),
        "{} is missing: run `cargo build --workspace --bins` first",
        cli.display()
    );
    cli
}

/// Runs `bulkhead VERB --socket S ARGS...`; returns its exit status and stderr.
fn run_cli(daemon: &TestDaemon, verb: &str, args: &[&str]) -> (Option<i32>, String) {
    let out = std::process::Command::new(cli())
        .arg(verb)
        .arg("--socket")
        .arg(&daemon.socket)
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_cli_pauses_and_resumes_every_sandbox_it_can_and_fails_for_the_others() {
    // Arrange
    let daemon = TestDaemon::start();
    let client = daemon.client();
    let rt = rt();
    let sb = rt.block_on(client.create(&spec_with_labels(&[]))).unwrap();

    // Act
    let paused = run_cli(&daemon, "pause", &["ffffffffffff", &sb.id]);
    let state_paused = rt.block_on(client.get(&sb.id)).unwrap().state;
    let resumed = run_cli(&daemon, "resume", &[&sb.id[..4]]);
    let state_resumed = rt.block_on(client.get(&sb.id)).unwrap().state;

    // Assert
    assert_eq!(paused.0, Some(125), "{}", paused.1);
    assert!(
        paused.1.contains("ffffffffffff: bulkheadd: no sandbox"),
        "{}",
        paused.1
    );
    assert_eq!(
        state_paused,
        SandboxState::Paused,
        "the other ID was paused"
    );
    assert_eq!(resumed, (Some(0), String::new()));
    assert_eq!(state_resumed, SandboxState::Running);
}

/// A daemon with template `name` in its state dir: the saved VM of a paused 64 MiB sandbox,
/// copied (that sandbox is then deleted).
fn daemon_with_template(name: &str) -> TestDaemon {
    let daemon = TestDaemon::start();
    save_template(&daemon, name, 64);
    daemon
}

/// A create request for a restore of template `name`.
fn from_template(name: &str) -> CreateSandbox {
    CreateSandbox {
        template: Some(name.into()),
        ..CreateSandbox::default()
    }
}

/// Saves template `name` in `daemon`'s state dir: a paused sandbox of `memory_mib`, copied (that
/// sandbox is then deleted).
fn save_template(daemon: &TestDaemon, name: &str, memory_mib: u32) {
    let client = daemon.client();
    let rt = rt();
    let request = CreateSandbox {
        memory_mib,
        ..spec_with_labels(&[])
    };
    let sb = rt.block_on(client.create(&request)).unwrap();
    rt.block_on(client.pause(&sb.id)).unwrap();
    let template = daemon.state_dir.join("templates").join(name);
    std::fs::create_dir_all(&template).unwrap();
    for file in list(&saved_vm(daemon, &sb.id)) {
        std::fs::copy(&file, template.join(file.file_name().unwrap())).unwrap();
    }
    rt.block_on(client.delete(&sb.id)).unwrap();
}

#[test]
fn a_sandbox_created_from_a_template_runs_with_the_templates_size() {
    // Arrange
    let daemon = daemon_with_template("base");
    let client = daemon.client();
    let rt = rt();
    let request = from_template("base");

    // Act
    let sb = rt.block_on(client.create(&request)).unwrap();
    let parent = rt.block_on(exec_parent(&client, &sb.id));
    rt.block_on(client.delete(&sb.id)).unwrap();

    // Assert
    assert_eq!(sb.state, SandboxState::Running);
    assert_eq!(sb.template.as_deref(), Some("base"));
    assert_eq!((sb.vcpus, sb.memory_mib), (1, 64), "the template's");
    assert_eq!(sb.limits.memory_bytes, (64 + 64) << 20);
    assert_eq!(parent, sb.vmm_pid.unwrap().to_string());
    assert!(daemon.state_dir.join("templates/base/memory").is_file());
    assert_eq!(
        daemon.leftovers(&[sb.vmm_pid.unwrap()]),
        Vec::<String>::new()
    );
}

#[test]
fn a_template_replaced_by_a_rename_is_read_again_by_the_next_create() {
    // Arrange: a create from the 64 MiB template `base`, then a 96 MiB template renamed over it
    // (the way docs/daemon.md says to replace one).
    let daemon = daemon_with_template("base");
    let client = daemon.client();
    let rt = rt();
    let request = from_template("base");
    let first = rt.block_on(client.create(&request)).unwrap();
    rt.block_on(client.delete(&first.id)).unwrap();
    save_template(&daemon, "bigger", 96);
    let templates = daemon.state_dir.join("templates");
    std::fs::rename(templates.join("base"), templates.join("old")).unwrap();
    std::fs::rename(templates.join("bigger"), templates.join("base")).unwrap();

    // Act
    let second = rt.block_on(client.create(&request)).unwrap();
    rt.block_on(client.delete(&second.id)).unwrap();

    // Assert
    assert_eq!((first.memory_mib, second.memory_mib), (64, 96));
}

#[test]
fn template_requests_the_daemon_cannot_honour_are_refused_clearly() {
    // Arrange
    let daemon = daemon_with_template("base");
    let client = daemon.client();
    let rt = rt();
    let ask = |template: &str, change: fn(&mut CreateSandbox)| {
        let mut request = CreateSandbox {
            template: Some(template.to_owned()),
            ..CreateSandbox::default()
        };
        change(&mut request);
        api_error(rt.block_on(client.create(&request)))
    };

    // Act
    let unknown = ask("nosuch", |_| {});
    let bad_name = ask("../base", |_| {});
    let other_memory = ask("base", |r| r.memory_mib = 512);
    let with_image = ask("base", |r| r.image = Some("debian".into()));
    let with_mount = ask("base", |r| {
        r.mounts = vec![MountSpec {
            host: "/".into(),
            guest: "/data".into(),
            ro: true,
        }]
    });

    // Assert
    assert_eq!((unknown.0, unknown.1.as_str()), (404, "template_not_found"));
    assert!(unknown.2.contains("the templates base"), "{unknown:?}");
    assert_eq!(bad_name.0, 400, "{bad_name:?}");
    assert_eq!(other_memory.0, 400, "{other_memory:?}");
    assert!(other_memory
        .2
        .contains("memory_mib: 512 differs from template base's 64"));
    assert_eq!(with_image.0, 400, "{with_image:?}");
    assert!(with_image
        .2
        .contains("image: not supported with a template yet"));
    // The fake's template was a sandbox booted without share slots.
    assert_eq!(with_mount.0, 400, "{with_mount:?}");
    assert!(with_mount.2.contains("0 share slots"), "{with_mount:?}");
    assert_eq!(daemon.leftovers(&[]), Vec::<String>::new());
}

#[test]
fn an_exec_running_when_its_sandbox_is_paused_ends_with_a_paused_error() {
    // Arrange: a command that says its PID, then runs on.
    let daemon = TestDaemon::start();
    let client = daemon.client();
    let rt = rt();
    let created = rt.block_on(client.create(&spec_with_labels(&[]))).unwrap();
    let marker = daemon.dir.path().join("running");
    let script = format!("echo $$ > {}; exec sleep 20", marker.display());
    let exec = {
        let client = client.clone();
        let id = created.id.clone();
        std::thread::spawn(move || {
            common::rt()
                .block_on(client.exec_collect(&id, &ExecSpec::new(["sh", "-c", script.as_str()])))
        })
    };
    let started = common::wait_until(std::time::Duration::from_secs(10), || {
        std::fs::read_to_string(&marker).is_ok_and(|s| s.ends_with('\n'))
    });

    // Act
    let paused = rt.block_on(client.pause(&created.id));
    let ended = exec.join().unwrap();

    // Assert
    assert!(started, "the command did not start");
    assert_eq!(paused.unwrap().state, SandboxState::Paused);
    match ended {
        Err(bulkhead_client::Error::Api {
            status,
            code,
            message,
        }) => {
            assert_eq!((status, code.as_str()), (409, "paused"), "{message}");
            assert!(
                message.contains("was paused while the command ran"),
                "{message}"
            );
        }
        other => panic!("expected a 409 paused, got {other:?}"),
    }
    let pid = std::fs::read_to_string(&marker).unwrap();
    // SAFETY: kill with a PID read back from the test's own command; no pointers.
    unsafe { libc::kill(pid.trim().parse().unwrap(), libc::SIGKILL) };
    rt.block_on(client.delete(&created.id)).unwrap();
}
