//! Create, Start, State, Wait, Kill and Delete of containers' init processes, and the events
//! they publish.

use std::collections::HashMap;

use containerd_shim_protos::api;
use containerd_shim_protos::shim_async::Task;
use containerd_shim_protos::ttrpc::Code;

use super::*;
use crate::events::Mount;
use crate::state::Stdio;

#[tokio::test]
async fn create_returns_the_backends_pid_and_publishes_task_create() {
    let h = Harness::new();

    let created = h.create("c1").await.unwrap();

    assert_eq!(created.pid, FIRST_PID);
    let stdio = Stdio {
        stdout: "/run/fifo/c1-stdout".into(),
        ..Default::default()
    };
    let rootfs = vec![Mount {
        kind: "overlay".into(),
        source: "overlay".into(),
        target: String::new(),
        options: vec!["lowerdir=/l".into()],
    }];
    let spec = ContainerSpec {
        id: "c1".into(),
        pod: "c1".into(),
        bundle: h.bundle(),
        rootfs: rootfs.clone(),
        stdio: stdio.clone(),
        annotations: HashMap::new(),
    };
    assert_eq!(h.backend.calls(), vec![Call::Create(spec)]);
    let event = TaskEvent::Create {
        container_id: "c1".into(),
        bundle: h.bundle(),
        rootfs,
        stdio,
        pid: FIRST_PID,
    };
    assert_eq!(h.events(), vec![event]);
}

#[tokio::test]
async fn containers_of_one_cri_sandbox_share_a_pod() {
    let annotations =
        HashMap::from([(crate::SANDBOX_ID_ANNOTATION.to_owned(), "pod-1".to_owned())]);
    let h = Harness::with_annotations(&annotations);

    h.create("pause").await.unwrap();
    h.create("app").await.unwrap();

    let pods: Vec<_> = h
        .backend
        .calls()
        .into_iter()
        .map(|call| match call {
            Call::Create(spec) => spec.pod,
            other => panic!("unexpected call {other:?}"),
        })
        .collect();
    assert_eq!(pods, ["pod-1", "pod-1"]);
}

#[tokio::test]
async fn create_twice_is_refused_with_already_exists() {
    let h = Harness::new();
    h.create("c1").await.unwrap();

    let again = h.create("c1").await;

    assert_eq!(code(again), Code::ALREADY_EXISTS);
    assert_eq!(h.backend.calls().len(), 1);
    assert_eq!(h.topics(), ["/tasks/create"]);
}

#[tokio::test]
async fn create_without_an_oci_spec_is_invalid_argument() {
    let h = Harness::new();
    let mut req = h.create_request("c1");
    req.bundle = h.bundle.path().join("missing").to_str().unwrap().into();

    let created = h.task.create(&ctx(), req).await;

    assert_eq!(code(created), Code::INVALID_ARGUMENT);
    assert!(h.backend.calls().is_empty());
}

#[tokio::test]
async fn create_from_a_checkpoint_is_invalid_argument() {
    let h = Harness::new();
    let mut req = h.create_request("c1");
    req.checkpoint = "/var/lib/checkpoint".into();

    assert_eq!(
        code(h.task.create(&ctx(), req).await),
        Code::INVALID_ARGUMENT
    );
}

#[tokio::test]
async fn create_with_an_empty_id_is_invalid_argument() {
    let h = Harness::new();

    assert_eq!(code(h.create("").await), Code::INVALID_ARGUMENT);
}

#[tokio::test]
async fn a_failed_create_leaves_no_container_and_the_id_free() {
    let h = Harness::new();
    h.backend.fail_create();

    let created = h.create("c1").await;

    assert_eq!(code(created), Code::INTERNAL);
    assert_eq!(code(h.state(&init("c1")).await), Code::NOT_FOUND);
    assert!(h.events().is_empty());
}

#[tokio::test]
async fn state_of_an_unknown_id_is_not_found() {
    let h = Harness::new();

    assert_eq!(code(h.state(&init("nope")).await), Code::NOT_FOUND);
}

#[tokio::test]
async fn state_of_an_unknown_exec_is_not_found() {
    let h = Harness::new();
    h.running("c1").await;

    assert_eq!(code(h.state(&exec("c1", "nope")).await), Code::NOT_FOUND);
}

#[tokio::test]
async fn state_after_create_is_created_with_bundle_pid_and_stdio() {
    let h = Harness::new();
    h.create("c1").await.unwrap();

    let state = h.state(&init("c1")).await.unwrap();

    assert_eq!(state.status(), api::Status::CREATED);
    assert_eq!(
        (state.id.as_str(), state.bundle, state.pid),
        ("c1", h.bundle(), FIRST_PID)
    );
    assert_eq!(state.stdout, "/run/fifo/c1-stdout");
    assert!(state.exited_at.is_none());
}

#[tokio::test]
async fn start_runs_the_init_process_and_publishes_task_start() {
    let h = Harness::new();
    h.create("c1").await.unwrap();

    let started = h.start(&init("c1")).await.unwrap();

    assert_eq!(started.pid, FIRST_PID + 1);
    let state = h.state(&init("c1")).await.unwrap();
    assert_eq!(
        (state.status(), state.pid),
        (api::Status::RUNNING, FIRST_PID + 1)
    );
    let start = TaskEvent::Start {
        container_id: "c1".into(),
        pid: FIRST_PID + 1,
    };
    assert_eq!(h.events().last(), Some(&start));
}

#[tokio::test]
async fn start_twice_is_failed_precondition() {
    let h = Harness::new();
    h.running("c1").await;

    assert_eq!(code(h.start(&init("c1")).await), Code::FAILED_PRECONDITION);
}

#[tokio::test]
async fn start_of_an_unknown_id_is_not_found() {
    let h = Harness::new();

    assert_eq!(code(h.start(&init("nope")).await), Code::NOT_FOUND);
}

#[tokio::test]
async fn a_failed_start_stops_the_task_so_that_a_plain_delete_removes_it() {
    // Arrange
    let h = Harness::new();
    h.create("c1").await.unwrap();
    h.backend.fail_start();

    // Act
    let started = h.start(&init("c1")).await;
    let state = h.state(&init("c1")).await.unwrap();
    let deleted = h.delete(&init("c1")).await;

    // Assert
    assert_eq!(code(started), Code::INTERNAL);
    assert_eq!(state.status(), api::Status::STOPPED);
    assert_eq!(state.exit_status, crate::service::LOST_STATUS);
    assert!(deleted.is_ok(), "{deleted:?}");
    assert_eq!(
        h.topics(),
        ["/tasks/create", "/tasks/exit", "/tasks/delete"]
    );
}

#[tokio::test]
async fn a_shutdown_while_a_vm_boots_undoes_that_create_before_the_shim_exits() {
    // Arrange: a create whose VM boot the test holds; containerd gives up on it (its client
    // went away): Delete finds no task yet, then Shutdown.
    let h = std::sync::Arc::new(Harness::new());
    let gate = h.backend.gate_creates();
    let creating = tokio::spawn({
        let h = h.clone();
        async move { h.create("c1").await }
    });
    while !h
        .backend
        .calls()
        .iter()
        .any(|c| matches!(c, Call::Create(_)))
    {
        tokio::task::yield_now().await;
    }
    let deleted = h.delete(&init("c1")).await;

    // Act
    let shutting = tokio::spawn({
        let h = h.clone();
        async move {
            h.task
                .shutdown(&ctx(), api::ShutdownRequest::default())
                .await
        }
    });
    tokio::task::yield_now().await;
    let exited_before_the_boot = is_ready(h.exit.wait());
    gate.add_permits(1);
    let created = creating.await.unwrap();
    let shut = shutting.await.unwrap();

    // Assert
    assert_eq!(code(deleted), Code::NOT_FOUND);
    assert!(!exited_before_the_boot);
    assert!(created.is_err(), "{created:?}");
    assert!(shut.is_ok(), "{shut:?}");
    assert!(is_ready(h.exit.wait()));
    assert!(
        h.backend
            .calls()
            .iter()
            .any(|c| matches!(c, Call::Delete(id, _) if id == "c1")),
        "{:?}",
        h.backend.calls()
    );
    assert_eq!(code(h.state(&init("c1")).await), Code::NOT_FOUND);
}

#[tokio::test]
async fn a_command_the_guest_cannot_run_stops_with_127() {
    // Arrange
    let h = Harness::new();
    h.create("c1").await.unwrap();
    h.backend.not_runnable();

    // Act
    let started = h.start(&init("c1")).await;
    let state = h.state(&init("c1")).await.unwrap();

    // Assert
    assert_eq!(code(started), Code::INVALID_ARGUMENT);
    assert_eq!(state.status(), api::Status::STOPPED);
    assert_eq!(state.exit_status, crate::service::NOT_RUNNABLE_STATUS);
}

#[tokio::test]
async fn wait_returns_the_exit_status_and_time_the_backend_reported() {
    let h = Harness::new();
    h.running("c1").await;

    let waited = h.exit(&init("c1"), 3).await;

    assert_eq!(waited.exit_status, 3);
    assert_eq!(waited.exited_at.unwrap(), exit_time().into());
}

#[tokio::test]
async fn wait_after_exit_returns_at_once_with_the_same_exit() {
    let h = Harness::new();
    h.running("c1").await;
    h.exit(&init("c1"), 3).await;

    let again = h.wait(&init("c1")).await.unwrap();

    assert_eq!(
        (again.exit_status, again.exited_at.unwrap()),
        (3, exit_time().into())
    );
}

#[tokio::test]
async fn wait_blocks_until_the_process_exits() {
    let h = Harness::new();
    h.running("c1").await;

    let pending = is_ready(h.wait(&init("c1")));

    assert!(!pending, "Wait returned before the process exited");
}

#[tokio::test]
async fn wait_of_an_unknown_id_is_not_found() {
    let h = Harness::new();

    assert_eq!(code(h.wait(&init("nope")).await), Code::NOT_FOUND);
}

#[tokio::test]
async fn state_after_exit_is_stopped_with_exit_status_and_time() {
    let h = Harness::new();
    h.running("c1").await;
    h.exit(&init("c1"), 42).await;

    let state = h.state(&init("c1")).await.unwrap();

    assert_eq!(
        (state.status(), state.exit_status),
        (api::Status::STOPPED, 42)
    );
    assert_eq!(state.exited_at.unwrap(), exit_time().into());
}

#[tokio::test]
async fn a_process_the_backend_loses_exits_with_255() {
    let h = Harness::new();
    h.running("c1").await;

    h.backend.lose(&init("c1"));
    let waited = h.wait(&init("c1")).await.unwrap();

    assert_eq!(waited.exit_status, crate::service::LOST_STATUS);
}

#[tokio::test]
async fn kill_of_a_running_task_signals_it_through_the_backend() {
    let h = Harness::new();
    h.running("c1").await;

    h.kill(&init("c1"), 15).await.unwrap();

    assert_eq!(
        h.backend.calls().last(),
        Some(&Call::Kill(init("c1"), 15, false))
    );
    assert_eq!(
        h.state(&init("c1")).await.unwrap().status(),
        api::Status::RUNNING
    );
}

#[tokio::test]
async fn kill_before_start_stops_the_task_with_128_plus_the_signal() {
    let h = Harness::new();
    h.create("c1").await.unwrap();

    h.kill(&init("c1"), 9).await.unwrap();

    let waited = h.wait(&init("c1")).await.unwrap();
    assert_eq!(waited.exit_status, 137);
    assert_eq!(
        h.state(&init("c1")).await.unwrap().status(),
        api::Status::STOPPED
    );
    assert_eq!(h.topics(), ["/tasks/create", "/tasks/exit"]);
    assert!(!h
        .backend
        .calls()
        .iter()
        .any(|c| matches!(c, Call::Kill(..))));
}

#[tokio::test]
async fn a_task_killed_before_start_cannot_be_started() {
    let h = Harness::new();
    h.create("c1").await.unwrap();
    h.kill(&init("c1"), 9).await.unwrap();

    assert_eq!(code(h.start(&init("c1")).await), Code::FAILED_PRECONDITION);
}

#[tokio::test]
async fn kill_of_a_stopped_task_is_not_found() {
    let h = Harness::new();
    h.running("c1").await;
    h.exit(&init("c1"), 0).await;

    assert_eq!(code(h.kill(&init("c1"), 15).await), Code::NOT_FOUND);
}

#[tokio::test]
async fn kill_with_signal_0_is_invalid_argument() {
    let h = Harness::new();
    h.running("c1").await;

    assert_eq!(code(h.kill(&init("c1"), 0).await), Code::INVALID_ARGUMENT);
}

#[tokio::test]
async fn kill_with_all_is_passed_to_the_backend() {
    let h = Harness::new();
    h.running("c1").await;
    let req = api::KillRequest {
        id: "c1".into(),
        signal: 9,
        all: true,
        ..Default::default()
    };

    h.task.kill(&ctx(), req).await.unwrap();

    assert_eq!(
        h.backend.calls().last(),
        Some(&Call::Kill(init("c1"), 9, true))
    );
}

#[tokio::test]
async fn delete_of_a_running_task_is_refused() {
    let h = Harness::new();
    h.running("c1").await;

    let deleted = h.delete(&init("c1")).await;

    assert_eq!(code(deleted), Code::FAILED_PRECONDITION);
    assert_eq!(
        h.state(&init("c1")).await.unwrap().status(),
        api::Status::RUNNING
    );
    assert!(!h
        .backend
        .calls()
        .iter()
        .any(|c| matches!(c, Call::Delete(..))));
}

#[tokio::test]
async fn delete_after_exit_returns_the_exit_and_publishes_task_delete() {
    let h = Harness::new();
    h.running("c1").await;
    h.exit(&init("c1"), 3).await;

    let deleted = h.delete(&init("c1")).await.unwrap();

    assert_eq!((deleted.pid, deleted.exit_status), (FIRST_PID + 1, 3));
    assert_eq!(deleted.exited_at.unwrap(), exit_time().into());
    assert_eq!(
        h.backend.calls().last(),
        Some(&Call::Delete("c1".into(), "c1".into()))
    );
    assert_eq!(code(h.state(&init("c1")).await), Code::NOT_FOUND);
}

#[tokio::test]
async fn delete_of_a_created_task_is_allowed() {
    let h = Harness::new();
    h.create("c1").await.unwrap();

    let deleted = h.delete(&init("c1")).await.unwrap();

    assert_eq!((deleted.pid, deleted.exit_status), (FIRST_PID, 0));
    assert_eq!(h.topics(), ["/tasks/create", "/tasks/delete"]);
}

#[tokio::test]
async fn delete_of_an_unknown_id_is_not_found() {
    let h = Harness::new();

    assert_eq!(code(h.delete(&init("nope")).await), Code::NOT_FOUND);
}

#[tokio::test]
async fn a_deleted_id_can_be_created_again() {
    let h = Harness::new();
    h.create("c1").await.unwrap();
    h.delete(&init("c1")).await.unwrap();

    let again = h.create("c1").await;

    assert!(again.is_ok(), "{again:?}");
}

#[tokio::test]
async fn events_of_a_task_lifecycle_are_published_in_order() {
    let h = Harness::new();
    h.running("c1").await;
    h.exit(&init("c1"), 7).await;

    h.delete(&init("c1")).await.unwrap();

    let pid = FIRST_PID + 1;
    let exit = Exit {
        status: 7,
        at: exit_time(),
    };
    let expected = [
        TaskEvent::Start {
            container_id: "c1".into(),
            pid,
        },
        TaskEvent::Exit {
            container_id: "c1".into(),
            id: "c1".into(),
            pid,
            exit,
        },
        TaskEvent::Delete {
            container_id: "c1".into(),
            pid,
            exit,
        },
    ];
    assert_eq!(
        h.topics(),
        [
            "/tasks/create",
            "/tasks/start",
            "/tasks/exit",
            "/tasks/delete"
        ]
    );
    assert_eq!(h.events()[1..], expected);
}
