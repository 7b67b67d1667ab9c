//! Exec processes, Pids, ResizePty, CloseIO, Update, Stats, Connect, Shutdown, the OOM event,
//! the unsupported methods, and the events' protobuf form.

use containerd_shim_protos::api;
use containerd_shim_protos::cgroups::metrics::Metrics;
use containerd_shim_protos::events::task as ev;
use containerd_shim_protos::protobuf::Message;
use containerd_shim_protos::shim_async::Task;
use containerd_shim_protos::ttrpc::Code;

use super::*;
use crate::backend::ExecProcess;
use crate::state::Stdio;

#[tokio::test]
async fn exec_adds_a_created_process_and_publishes_task_exec_added() {
    let h = Harness::new();
    h.running("c1").await;

    h.exec(&exec("c1", "e1")).await.unwrap();

    let state = h.state(&exec("c1", "e1")).await.unwrap();
    assert_eq!(state.status(), api::Status::CREATED);
    assert_eq!((state.id.as_str(), state.exec_id.as_str()), ("e1", "e1"));
    let added = TaskEvent::ExecAdded {
        container_id: "c1".into(),
        exec_id: "e1".into(),
    };
    assert_eq!(h.events().last(), Some(&added));
}

#[tokio::test]
async fn exec_with_an_id_that_collides_is_refused_with_already_exists() {
    let h = Harness::new();
    h.running("c1").await;
    h.exec(&exec("c1", "e1")).await.unwrap();

    let again = h.exec(&exec("c1", "e1")).await;

    assert_eq!(code(again), Code::ALREADY_EXISTS);
    assert_eq!(
        h.topics()
            .iter()
            .filter(|t| **t == "/tasks/exec-added")
            .count(),
        1
    );
}

#[tokio::test]
async fn exec_ids_are_per_container() {
    let h = Harness::new();
    h.running("c1").await;
    h.running("c2").await;
    h.exec(&exec("c1", "e1")).await.unwrap();

    let other = h.exec(&exec("c2", "e1")).await;

    assert!(other.is_ok(), "{other:?}");
}

#[tokio::test]
async fn exec_in_a_container_that_is_not_running_is_failed_precondition() {
    let h = Harness::new();
    h.create("c1").await.unwrap();

    assert_eq!(
        code(h.exec(&exec("c1", "e1")).await),
        Code::FAILED_PRECONDITION
    );
}

#[tokio::test]
async fn exec_in_an_unknown_container_is_not_found() {
    let h = Harness::new();

    assert_eq!(code(h.exec(&exec("nope", "e1")).await), Code::NOT_FOUND);
}

#[tokio::test]
async fn exec_with_an_empty_exec_id_is_invalid_argument() {
    let h = Harness::new();
    h.running("c1").await;

    assert_eq!(code(h.exec(&init("c1")).await), Code::INVALID_ARGUMENT);
}

#[tokio::test]
async fn exec_with_a_spec_without_args_is_invalid_argument() {
    let h = Harness::new();
    h.running("c1").await;
    let req = Harness::exec_request(&exec("c1", "e1"), r#"{"args": []}"#);

    assert_eq!(code(h.task.exec(&ctx(), req).await), Code::INVALID_ARGUMENT);
}

#[tokio::test]
async fn exec_with_a_spec_that_is_not_json_is_invalid_argument() {
    let h = Harness::new();
    h.running("c1").await;
    let req = Harness::exec_request(&exec("c1", "e1"), "\u{0}garbage");

    assert_eq!(code(h.task.exec(&ctx(), req).await), Code::INVALID_ARGUMENT);
}

#[tokio::test]
async fn start_of_an_exec_gives_the_backend_its_spec_and_publishes_exec_started() {
    let h = Harness::new();
    h.running("c1").await;
    h.exec(&exec("c1", "e1")).await.unwrap();

    let started = h.start(&exec("c1", "e1")).await.unwrap();

    let process = ExecProcess {
        args: vec!["ls".into(), "-l".into()],
        env: vec!["PATH=/bin".into()],
        cwd: "/".into(),
        terminal: false,
    };
    let spec = StartSpec {
        key: exec("c1", "e1"),
        stdio: Stdio {
            stdout: "/run/fifo/exec-stdout".into(),
            ..Default::default()
        },
        exec: Some(process),
        stdin_closed: false,
    };
    assert_eq!(h.backend.calls().last(), Some(&Call::Start(spec)));
    let event = TaskEvent::ExecStarted {
        container_id: "c1".into(),
        exec_id: "e1".into(),
        pid: started.pid,
    };
    assert_eq!(h.events().last(), Some(&event));
}

#[tokio::test]
async fn an_exec_exit_is_published_with_the_exec_id_and_waited_for() {
    let h = Harness::new();
    h.running("c1").await;
    h.exec(&exec("c1", "e1")).await.unwrap();
    let pid = h.start(&exec("c1", "e1")).await.unwrap().pid;

    let waited = h.exit(&exec("c1", "e1"), 2).await;

    assert_eq!(waited.exit_status, 2);
    let exit = Exit {
        status: 2,
        at: exit_time(),
    };
    let event = TaskEvent::Exit {
        container_id: "c1".into(),
        id: "e1".into(),
        pid,
        exit,
    };
    assert_eq!(h.events().last(), Some(&event));
    assert_eq!(
        h.state(&init("c1")).await.unwrap().status(),
        api::Status::RUNNING
    );
}

#[tokio::test]
async fn kill_of_an_exec_before_start_is_failed_precondition() {
    let h = Harness::new();
    h.running("c1").await;
    h.exec(&exec("c1", "e1")).await.unwrap();

    assert_eq!(
        code(h.kill(&exec("c1", "e1"), 9).await),
        Code::FAILED_PRECONDITION
    );
}

#[tokio::test]
async fn delete_of_an_exited_exec_removes_only_it_without_task_delete() {
    let h = Harness::new();
    h.running("c1").await;
    h.exec(&exec("c1", "e1")).await.unwrap();
    h.start(&exec("c1", "e1")).await.unwrap();
    h.exit(&exec("c1", "e1"), 0).await;

    h.delete(&exec("c1", "e1")).await.unwrap();

    assert_eq!(code(h.state(&exec("c1", "e1")).await), Code::NOT_FOUND);
    assert_eq!(
        h.state(&init("c1")).await.unwrap().status(),
        api::Status::RUNNING
    );
    assert!(!h.topics().contains(&"/tasks/delete"));
    assert!(!h
        .backend
        .calls()
        .iter()
        .any(|c| matches!(c, Call::Delete(..))));
}

#[tokio::test]
async fn delete_of_a_running_exec_is_refused() {
    let h = Harness::new();
    h.running("c1").await;
    h.exec(&exec("c1", "e1")).await.unwrap();
    h.start(&exec("c1", "e1")).await.unwrap();

    assert_eq!(
        code(h.delete(&exec("c1", "e1")).await),
        Code::FAILED_PRECONDITION
    );
}

#[tokio::test]
async fn the_init_exit_kills_the_running_execs_through_the_backend() {
    let h = Harness::new();
    h.running("c1").await;
    h.exec(&exec("c1", "e1")).await.unwrap();
    h.start(&exec("c1", "e1")).await.unwrap();

    h.exit(&init("c1"), 0).await;

    assert_eq!(
        h.backend.calls().last(),
        Some(&Call::Kill(exec("c1", "e1"), 9, false))
    );
}

#[tokio::test]
async fn delete_of_an_init_process_whose_exec_still_runs_is_refused() {
    let h = Harness::new();
    h.running("c1").await;
    h.exec(&exec("c1", "e1")).await.unwrap();
    h.start(&exec("c1", "e1")).await.unwrap();
    h.exit(&init("c1"), 0).await;

    assert_eq!(code(h.delete(&init("c1")).await), Code::FAILED_PRECONDITION);
}

#[tokio::test]
async fn pids_lists_the_running_processes() {
    let h = Harness::new();
    h.running("c1").await;
    h.exec(&exec("c1", "e1")).await.unwrap();
    let exec_pid = h.start(&exec("c1", "e1")).await.unwrap().pid;
    h.exec(&exec("c1", "e2")).await.unwrap();

    let req = api::PidsRequest {
        id: "c1".into(),
        ..Default::default()
    };
    let pids = h.task.pids(&ctx(), req).await.unwrap();

    let pids: Vec<u32> = pids.processes.iter().map(|p| p.pid).collect();
    assert_eq!(pids, [FIRST_PID + 1, exec_pid]);
}

#[tokio::test]
async fn pids_of_an_unknown_id_is_not_found() {
    let h = Harness::new();
    let req = api::PidsRequest {
        id: "nope".into(),
        ..Default::default()
    };

    assert_eq!(code(h.task.pids(&ctx(), req).await), Code::NOT_FOUND);
}

fn resize(id: &str, exec_id: &str) -> api::ResizePtyRequest {
    api::ResizePtyRequest {
        id: id.into(),
        exec_id: exec_id.into(),
        width: 120,
        height: 40,
        ..Default::default()
    }
}

#[tokio::test]
async fn resize_pty_of_a_running_process_goes_to_the_backend() {
    let h = Harness::new();
    h.running("c1").await;

    h.task.resize_pty(&ctx(), resize("c1", "")).await.unwrap();

    assert_eq!(
        h.backend.calls().last(),
        Some(&Call::Resize(init("c1"), 120, 40))
    );
}

#[tokio::test]
async fn resize_pty_of_a_created_process_is_failed_precondition() {
    let h = Harness::new();
    h.create("c1").await.unwrap();

    let resized = h.task.resize_pty(&ctx(), resize("c1", "")).await;

    assert_eq!(code(resized), Code::FAILED_PRECONDITION);
}

fn close_stdin(id: &str, exec_id: &str) -> api::CloseIORequest {
    api::CloseIORequest {
        id: id.into(),
        exec_id: exec_id.into(),
        stdin: true,
        ..Default::default()
    }
}

#[tokio::test]
async fn close_io_of_a_running_process_closes_its_stdin_in_the_backend() {
    let h = Harness::new();
    h.running("c1").await;

    h.task
        .close_io(&ctx(), close_stdin("c1", ""))
        .await
        .unwrap();

    assert_eq!(
        h.backend.calls().last(),
        Some(&Call::CloseStdin(init("c1")))
    );
}

#[tokio::test]
async fn close_io_before_start_starts_the_process_with_stdin_closed() {
    let h = Harness::new();
    h.create("c1").await.unwrap();
    h.task
        .close_io(&ctx(), close_stdin("c1", ""))
        .await
        .unwrap();

    h.start(&init("c1")).await.unwrap();

    let starts: Vec<bool> = h
        .backend
        .calls()
        .into_iter()
        .filter_map(|c| match c {
            Call::Start(spec) => Some(spec.stdin_closed),
            _ => None,
        })
        .collect();
    assert_eq!(starts, [true]);
}

#[tokio::test]
async fn close_io_of_an_unknown_process_is_not_found() {
    let h = Harness::new();

    assert_eq!(
        code(h.task.close_io(&ctx(), close_stdin("nope", "")).await),
        Code::NOT_FOUND
    );
}

fn update(id: &str) -> api::UpdateTaskRequest {
    api::UpdateTaskRequest {
        id: id.into(),
        resources: MessageField::some(Any {
            type_url: "types.containerd.io/opencontainers/runtime-spec/1/LinuxResources".into(),
            value: br#"{"memory":{"limit":67108864}}"#.to_vec(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[tokio::test]
async fn update_passes_the_resources_to_the_backend() {
    let h = Harness::new();
    h.running("c1").await;

    h.task.update(&ctx(), update("c1")).await.unwrap();

    let Some(Call::Update(id, resources)) = h.backend.calls().pop() else {
        panic!("no update reached the backend")
    };
    assert_eq!(id, "c1");
    assert_eq!(resources.value, br#"{"memory":{"limit":67108864}}"#);
}

#[tokio::test]
async fn update_of_a_stopped_task_is_failed_precondition() {
    let h = Harness::new();
    h.running("c1").await;
    h.exit(&init("c1"), 0).await;

    assert_eq!(
        code(h.task.update(&ctx(), update("c1")).await),
        Code::FAILED_PRECONDITION
    );
}

#[tokio::test]
async fn stats_are_cgroups_v1_metrics() {
    let h = Harness::new();
    h.running("c1").await;
    let req = api::StatsRequest {
        id: "c1".into(),
        ..Default::default()
    };

    let stats = h.task.stats(&ctx(), req).await.unwrap();

    let any = stats.stats.unwrap();
    assert_eq!(any.type_url, "io.containerd.cgroups.v1.Metrics");
    let metrics = Metrics::parse_from_bytes(&any.value).unwrap();
    assert_eq!(metrics.memory.usage.usage, 4096);
    assert_eq!(metrics.memory.usage.limit, 1 << 26);
    assert_eq!((metrics.cpu.usage.total, metrics.pids.current), (7, 2));
}

#[tokio::test]
async fn stats_of_an_unknown_id_is_not_found() {
    let h = Harness::new();
    let req = api::StatsRequest {
        id: "nope".into(),
        ..Default::default()
    };

    assert_eq!(code(h.task.stats(&ctx(), req).await), Code::NOT_FOUND);
}

#[tokio::test]
async fn connect_reports_the_shim_and_task_pids() {
    let h = Harness::new();
    h.running("c1").await;
    let req = api::ConnectRequest {
        id: "c1".into(),
        ..Default::default()
    };

    let connected = h.task.connect(&ctx(), req).await.unwrap();

    assert_eq!(
        (connected.shim_pid, connected.task_pid),
        (std::process::id(), FIRST_PID + 1)
    );
    assert_eq!(connected.version, crate::ttrpc::SHIM_VERSION);
}

#[tokio::test]
async fn shutdown_with_a_container_left_keeps_the_shim() {
    let h = Harness::new();
    h.create("c1").await.unwrap();

    h.task
        .shutdown(&ctx(), api::ShutdownRequest::default())
        .await
        .unwrap();

    assert!(!is_ready(h.exit.wait()));
}

#[tokio::test]
async fn shutdown_after_the_last_delete_ends_the_shim() {
    let h = Harness::new();
    h.create("c1").await.unwrap();
    h.delete(&init("c1")).await.unwrap();

    h.task
        .shutdown(&ctx(), api::ShutdownRequest::default())
        .await
        .unwrap();

    assert!(is_ready(h.exit.wait()));
}

#[tokio::test]
async fn an_oom_report_publishes_task_oom() {
    let h = Harness::new();
    h.running("c1").await;

    h.task.service().report_oom("c1").unwrap();

    assert_eq!(
        h.events().last(),
        Some(&TaskEvent::Oom {
            container_id: "c1".into()
        })
    );
}

#[tokio::test]
async fn an_oom_report_for_an_unknown_container_is_not_found() {
    let h = Harness::new();

    let reported = h.task.service().report_oom("nope");

    assert_eq!(reported.unwrap_err().kind(), crate::ErrorKind::NotFound);
}

#[tokio::test]
async fn pause_resume_and_checkpoint_are_unimplemented() {
    let h = Harness::new();
    h.running("c1").await;

    let paused = h.task.pause(&ctx(), api::PauseRequest::default()).await;
    let resumed = h.task.resume(&ctx(), api::ResumeRequest::default()).await;
    let checkpointed = h
        .task
        .checkpoint(&ctx(), api::CheckpointTaskRequest::default())
        .await;

    assert_eq!(
        [code(paused), code(resumed), code(checkpointed)],
        [Code::UNIMPLEMENTED; 3]
    );
}

#[test]
fn a_task_exit_event_carries_its_fields_in_protobuf() {
    let exit = Exit {
        status: 137,
        at: exit_time(),
    };
    let event = TaskEvent::Exit {
        container_id: "c1".into(),
        id: "e1".into(),
        pid: 7,
        exit,
    };

    let message = crate::ttrpc::event_message(&event);

    let proto = message.downcast_ref::<ev::TaskExit>().unwrap();
    assert_eq!(
        (proto.container_id.as_str(), proto.id.as_str()),
        ("c1", "e1")
    );
    assert_eq!((proto.pid, proto.exit_status), (7, 137));
    assert_eq!(*proto.exited_at, exit_time().into());
}

#[test]
fn every_event_goes_to_its_containerd_topic() {
    let exit = Exit {
        status: 0,
        at: exit_time(),
    };
    let events = [
        TaskEvent::Start {
            container_id: "c".into(),
            pid: 1,
        },
        TaskEvent::ExecAdded {
            container_id: "c".into(),
            exec_id: "e".into(),
        },
        TaskEvent::ExecStarted {
            container_id: "c".into(),
            exec_id: "e".into(),
            pid: 1,
        },
        TaskEvent::Delete {
            container_id: "c".into(),
            pid: 1,
            exit,
        },
        TaskEvent::Oom {
            container_id: "c".into(),
        },
    ];

    let topics: Vec<_> = events.iter().map(TaskEvent::topic).collect();

    use containerd_shim_protos::topics::*;
    let expected = [
        TASK_START_EVENT_TOPIC,
        TASK_EXEC_ADDED_EVENT_TOPIC,
        TASK_EXEC_STARTED_EVENT_TOPIC,
        TASK_DELETE_EVENT_TOPIC,
        TASK_OOM_EVENT_TOPIC,
    ];
    assert_eq!(topics, expected);
}

#[test]
fn a_plain_ctr_task_is_a_pod_of_its_own() {
    let annotations = HashMap::new();

    assert_eq!(crate::pod_id("c1", &annotations), "c1");
}
