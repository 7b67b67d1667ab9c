//! OOM kills the backend reports (`TaskOOM`) and `Update` applied to a pod VM's cgroup files.

use std::path::Path;

use containerd_shim_protos::shim_async::Task;
use containerd_shim_protos::ttrpc::Code;

use super::*;

fn oom_killed() -> Ended {
    Ended {
        exit: Exit {
            status: 137,
            at: exit_time(),
        },
        oom_killed: true,
    }
}

fn oom(container: &str) -> TaskEvent {
    TaskEvent::Oom {
        container_id: container.into(),
    }
}

#[tokio::test]
async fn an_oom_killed_process_publishes_task_oom_for_its_container_before_its_exit() {
    // Arrange
    let h = Harness::new();
    h.running("c1").await;
    h.running("c2").await;

    // Act
    h.backend.end(&init("c2"), oom_killed());
    let waited = h.wait(&init("c2")).await.unwrap();

    // Assert
    assert_eq!(waited.exit_status, 137);
    let events = h.events();
    let ooms: Vec<_> = events
        .iter()
        .filter(|e| e.topic() == "/tasks/oom")
        .collect();
    assert_eq!(ooms, [&oom("c2")]);
    let oom_at = events.iter().position(|e| *e == oom("c2"));
    let exit_at = events
        .iter()
        .position(|e| matches!(e, TaskEvent::Exit { container_id, .. } if container_id == "c2"));
    assert!(oom_at < exit_at, "{events:?}");
}

#[tokio::test]
async fn an_oom_killed_exec_publishes_task_oom_for_the_container_it_runs_in() {
    // Arrange
    let h = Harness::new();
    h.running("c1").await;
    h.exec(&exec("c1", "e1")).await.unwrap();
    h.start(&exec("c1", "e1")).await.unwrap();

    // Act
    h.backend.end(&exec("c1", "e1"), oom_killed());
    h.wait(&exec("c1", "e1")).await.unwrap();

    // Assert
    assert!(h.events().contains(&oom("c1")));
    assert_eq!(
        h.state(&init("c1")).await.unwrap().status(),
        api::Status::RUNNING
    );
}

#[tokio::test]
async fn a_process_that_exits_without_an_oom_kill_publishes_no_task_oom() {
    // Arrange
    let h = Harness::new();
    h.running("c1").await;

    // Act
    h.exit(&init("c1"), 137).await;

    // Assert
    assert!(!h.topics().contains(&"/tasks/oom"));
}

fn update_request(id: &str, json: &str) -> api::UpdateTaskRequest {
    api::UpdateTaskRequest {
        id: id.into(),
        resources: MessageField::some(Any {
            type_url: crate::update::LINUX_RESOURCES.into(),
            value: json.as_bytes().to_vec(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A pod VM cgroup directory with the files a 256 MiB, 2-vCPU pod's cgroup starts with.
fn cgroup_dir(h: &Harness) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (file, value) in [
        ("cpu.max", "max 100000"),
        ("cpu.weight", "100"),
        ("memory.max", "335544320"),
        ("pids.max", "64"),
    ] {
        std::fs::write(dir.path().join(file), value).unwrap();
    }
    h.backend.use_cgroup(dir.path(), 256, 2);
    dir
}

fn read(dir: &Path, file: &str) -> String {
    std::fs::read_to_string(dir.join(file)).unwrap()
}

#[tokio::test]
async fn update_writes_cpu_memory_and_pids_limits_to_the_pod_vms_cgroup() {
    // Arrange
    let h = Harness::new();
    h.running("c1").await;
    let dir = cgroup_dir(&h);
    let json = r#"{"cpu":{"shares":1024,"quota":150000,"period":100000},
        "memory":{"limit":536870912},"pids":{"limit":500}}"#;

    // Act
    h.task
        .update(&ctx(), update_request("c1", json))
        .await
        .unwrap();

    // Assert
    assert_eq!(read(dir.path(), "cpu.max"), "150000 100000");
    assert_eq!(read(dir.path(), "cpu.weight"), "39");
    // 512 MiB plus the VMM's 64 MiB allowance, as the cgroup is made at create.
    assert_eq!(
        read(dir.path(), "memory.max"),
        ((512 + 64) << 20).to_string()
    );
    assert_eq!(read(dir.path(), "pids.max"), "500");
}

#[tokio::test]
async fn update_below_the_guests_ram_is_refused_and_changes_nothing() {
    // Arrange
    let h = Harness::new();
    h.running("c1").await;
    let dir = cgroup_dir(&h);
    let json = r#"{"cpu":{"quota":50000},"memory":{"limit":134217728}}"#;

    // Act
    let refused = h.task.update(&ctx(), update_request("c1", json)).await;

    // Assert
    let Err(ttrpc::Error::RpcStatus(status)) = refused else {
        panic!("an update below the guest's RAM was accepted: {refused:?}");
    };
    assert_eq!(status.code(), Code::INVALID_ARGUMENT);
    assert!(
        status.message.contains("cannot shrink"),
        "{}",
        status.message
    );
    assert_eq!(read(dir.path(), "memory.max"), "335544320");
    assert_eq!(read(dir.path(), "cpu.max"), "max 100000");
}

#[tokio::test]
async fn update_of_a_stopped_task_is_refused_and_changes_nothing() {
    // Arrange
    let h = Harness::new();
    h.running("c1").await;
    h.exit(&init("c1"), 0).await;
    let dir = cgroup_dir(&h);

    // Act
    let refused = h
        .task
        .update(&ctx(), update_request("c1", r#"{"pids":{"limit":500}}"#))
        .await;

    // Assert
    assert_eq!(code(refused), Code::FAILED_PRECONDITION);
    assert_eq!(read(dir.path(), "pids.max"), "64");
}
