//! The ttRPC adapter: containerd's task API v2 (`containerd.task.v2.Task`) over [`TaskService`].
//!
//! Each method converts the protobuf request into the service's types, calls the service, and
//! converts the answer back; errors become the status codes containerd's `errdefs` understands
//! ([`status_of`]). `Pause`, `Resume` and `Checkpoint` are not supported and say so with
//! `UNIMPLEMENTED`.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::SystemTime;

use async_trait::async_trait;
use containerd_shim::asynchronous::ExitSignal;
use containerd_shim_protos::api;
use containerd_shim_protos::cgroups::metrics::{
    CPUStat, CPUUsage, MemoryEntry, MemoryStat, Metrics, PidsStat,
};
use containerd_shim_protos::events::task as ev;
use containerd_shim_protos::protobuf::well_known_types::{any::Any, timestamp::Timestamp};
use containerd_shim_protos::protobuf::{Message, MessageDyn, MessageField};
use containerd_shim_protos::shim_async::Task;
use containerd_shim_protos::ttrpc::{self, r#async::TtrpcContext, Code};

use crate::backend::{Backend, Resources, Stats};
use crate::events::{Mount, TaskEvent};
use crate::service::{CreateTask, ServiceError, TaskService};
use crate::state::{ProcessKey, Status, Stdio};
use crate::ErrorKind;

/// The version `Connect` reports.
pub const SHIM_VERSION: &str = concat!("bulkhead ", env!("CARGO_PKG_VERSION"));

/// The ttRPC status an error becomes.
pub fn status_of(error: &ServiceError) -> ttrpc::Error {
    let code = match error.kind() {
        ErrorKind::NotFound => Code::NOT_FOUND,
        ErrorKind::AlreadyExists => Code::ALREADY_EXISTS,
        ErrorKind::FailedPrecondition => Code::FAILED_PRECONDITION,
        ErrorKind::InvalidArgument => Code::INVALID_ARGUMENT,
        ErrorKind::Unimplemented => Code::UNIMPLEMENTED,
        ErrorKind::Internal => Code::INTERNAL,
    };
    ttrpc::Error::RpcStatus(ttrpc::get_status(code, error))
}

fn invalid(message: impl ToString) -> ttrpc::Error {
    ttrpc::Error::RpcStatus(ttrpc::get_status(Code::INVALID_ARGUMENT, message))
}

fn unimplemented(what: &str) -> ttrpc::Error {
    let message = format!("{what} is not supported by the bulkhead shim");
    ttrpc::Error::RpcStatus(ttrpc::get_status(Code::UNIMPLEMENTED, message))
}

trait OrStatus<T> {
    fn or_status(self) -> ttrpc::Result<T>;
}

impl<T> OrStatus<T> for Result<T, ServiceError> {
    fn or_status(self) -> ttrpc::Result<T> {
        self.map_err(|e| status_of(&e))
    }
}

/// A protobuf timestamp.
pub fn timestamp(at: SystemTime) -> MessageField<Timestamp> {
    MessageField::some(Timestamp::from(at))
}

/// Reads the annotations of the OCI spec in `bundle/config.json`.
pub fn bundle_annotations(bundle: &Path) -> Result<HashMap<String, String>, ServiceError> {
    #[derive(serde::Deserialize)]
    struct Spec {
        #[serde(default)]
        annotations: HashMap<String, String>,
    }
    let path = bundle.join("config.json");
    let bad = |e: &dyn std::fmt::Display| {
        ServiceError::InvalidArgument(format!("reading the OCI spec {}: {e}", path.display()))
    };
    let json = std::fs::read(&path).map_err(|e| bad(&e))?;
    let spec: Spec = serde_json::from_slice(&json).map_err(|e| bad(&e))?;
    Ok(spec.annotations)
}

fn mount_of(m: &api::Mount) -> Mount {
    Mount {
        kind: m.type_.clone(),
        source: m.source.clone(),
        target: m.target.clone(),
        options: m.options.clone(),
    }
}

fn proto_mount(m: &Mount) -> api::Mount {
    api::Mount {
        type_: m.kind.clone(),
        source: m.source.clone(),
        target: m.target.clone(),
        options: m.options.clone(),
        ..Default::default()
    }
}

/// The protobuf message of an event, ready for containerd's publisher.
pub fn event_message(event: &TaskEvent) -> Box<dyn MessageDyn> {
    match event.clone() {
        TaskEvent::Create {
            container_id,
            bundle,
            rootfs,
            stdio,
            pid,
        } => Box::new(ev::TaskCreate {
            container_id,
            bundle,
            rootfs: rootfs.iter().map(proto_mount).collect(),
            io: MessageField::some(ev::TaskIO {
                stdin: stdio.stdin,
                stdout: stdio.stdout,
                stderr: stdio.stderr,
                terminal: stdio.terminal,
                ..Default::default()
            }),
            pid,
            ..Default::default()
        }),
        TaskEvent::Start { container_id, pid } => Box::new(ev::TaskStart {
            container_id,
            pid,
            ..Default::default()
        }),
        TaskEvent::ExecAdded {
            container_id,
            exec_id,
        } => Box::new(ev::TaskExecAdded {
            container_id,
            exec_id,
            ..Default::default()
        }),
        TaskEvent::ExecStarted {
            container_id,
            exec_id,
            pid,
        } => Box::new(ev::TaskExecStarted {
            container_id,
            exec_id,
            pid,
            ..Default::default()
        }),
        TaskEvent::Exit {
            container_id,
            id,
            pid,
            exit,
        } => Box::new(ev::TaskExit {
            container_id,
            id,
            pid,
            exit_status: exit.status,
            exited_at: timestamp(exit.at),
            ..Default::default()
        }),
        TaskEvent::Delete {
            container_id,
            pid,
            exit,
        } => Box::new(ev::TaskDelete {
            container_id,
            pid,
            exit_status: exit.status,
            exited_at: timestamp(exit.at),
            ..Default::default()
        }),
        TaskEvent::Oom { container_id } => Box::new(ev::TaskOOM {
            container_id,
            ..Default::default()
        }),
    }
}

/// The type URL of cgroups v1 `Metrics` in a `Stats` answer: the message's full name, as the Go
/// shims' `typeurl.MarshalAny` writes it. containerd 1.6 finds the type by that name in gogo's
/// registry, which has no `type.googleapis.com/` form (with it, `ctr task metrics` fails);
/// later containerd accepts both.
pub const METRICS_TYPE_URL: &str = "io.containerd.cgroups.v1.Metrics";

/// cgroups v1 `Metrics` (what containerd's `ctr task metrics` and the CRI plugin decode) from
/// the backend's stats, under [`METRICS_TYPE_URL`].
pub fn metrics_any(stats: &Stats) -> Result<Any, ServiceError> {
    let metrics = Metrics {
        pids: MessageField::some(PidsStat {
            current: stats.pids,
            ..Default::default()
        }),
        cpu: MessageField::some(CPUStat {
            usage: MessageField::some(CPUUsage {
                total: stats.cpu_usage_ns,
                ..Default::default()
            }),
            ..Default::default()
        }),
        memory: MessageField::some(MemoryStat {
            usage: MessageField::some(MemoryEntry {
                usage: stats.memory_usage_bytes,
                limit: stats.memory_limit_bytes,
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    let value = metrics
        .write_to_bytes()
        .map_err(|e| ServiceError::InvalidArgument(format!("encoding the stats: {e}")))?;
    Ok(Any {
        type_url: METRICS_TYPE_URL.to_owned(),
        value,
        ..Default::default()
    })
}

fn proto_status(status: Status) -> api::Status {
    match status {
        Status::Created => api::Status::CREATED,
        Status::Running => api::Status::RUNNING,
        Status::Stopped => api::Status::STOPPED,
    }
}

/// containerd's task service on a [`TaskService`]; `Shutdown` signals `exit` once no container is
/// left.
pub struct TtrpcTask<B: Backend> {
    service: TaskService<B>,
    exit: Arc<ExitSignal>,
}

impl<B: Backend> std::fmt::Debug for TtrpcTask<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TtrpcTask")
            .field("service", &self.service)
            .finish_non_exhaustive()
    }
}

impl<B: Backend> TtrpcTask<B> {
    /// The adapter over `service`.
    pub fn new(service: TaskService<B>, exit: Arc<ExitSignal>) -> TtrpcTask<B> {
        TtrpcTask { service, exit }
    }

    /// The service behind it.
    pub fn service(&self) -> &TaskService<B> {
        &self.service
    }
}

#[async_trait]
impl<B: Backend> Task for TtrpcTask<B> {
    async fn state(
        &self,
        _: &TtrpcContext,
        req: api::StateRequest,
    ) -> ttrpc::Result<api::StateResponse> {
        let key = ProcessKey::from_request(&req.id, &req.exec_id);
        let state = self.service.state(&key).or_status()?;
        // As containerd's runc shim answers: `id` names the process (the exec id for an exec).
        Ok(api::StateResponse {
            id: key.event_id().to_owned(),
            exec_id: req.exec_id,
            bundle: state.bundle,
            pid: state.pid,
            status: proto_status(state.status).into(),
            stdin: state.stdio.stdin,
            stdout: state.stdio.stdout,
            stderr: state.stdio.stderr,
            terminal: state.stdio.terminal,
            exit_status: state.exit.map_or(0, |e| e.status),
            exited_at: state.exit.map_or(MessageField::none(), |e| timestamp(e.at)),
            ..Default::default()
        })
    }

    async fn create(
        &self,
        _: &TtrpcContext,
        req: api::CreateTaskRequest,
    ) -> ttrpc::Result<api::CreateTaskResponse> {
        if req.id.is_empty() {
            return Err(invalid("container id is empty"));
        }
        let annotations = bundle_annotations(Path::new(&req.bundle)).or_status()?;
        let create = CreateTask {
            id: req.id,
            bundle: req.bundle,
            rootfs: req.rootfs.iter().map(mount_of).collect(),
            stdio: Stdio {
                stdin: req.stdin,
                stdout: req.stdout,
                stderr: req.stderr,
                terminal: req.terminal,
            },
            annotations,
            checkpoint: req.checkpoint,
        };
        let pid = self.service.create(create).await.or_status()?;
        Ok(api::CreateTaskResponse {
            pid,
            ..Default::default()
        })
    }

    async fn start(
        &self,
        _: &TtrpcContext,
        req: api::StartRequest,
    ) -> ttrpc::Result<api::StartResponse> {
        let key = ProcessKey::from_request(&req.id, &req.exec_id);
        let pid = self.service.start(&key).await.or_status()?;
        Ok(api::StartResponse {
            pid,
            ..Default::default()
        })
    }

    async fn delete(
        &self,
        _: &TtrpcContext,
        req: api::DeleteRequest,
    ) -> ttrpc::Result<api::DeleteResponse> {
        let key = ProcessKey::from_request(&req.id, &req.exec_id);
        let deleted = self.service.delete(&key).await.or_status()?;
        Ok(api::DeleteResponse {
            pid: deleted.pid,
            exit_status: deleted.exit.status,
            exited_at: timestamp(deleted.exit.at),
            ..Default::default()
        })
    }

    async fn pids(
        &self,
        _: &TtrpcContext,
        req: api::PidsRequest,
    ) -> ttrpc::Result<api::PidsResponse> {
        let pids = self.service.pids(&req.id).or_status()?;
        let processes = pids
            .into_iter()
            .map(|(pid, _exec)| api::ProcessInfo {
                pid,
                ..Default::default()
            })
            .collect();
        Ok(api::PidsResponse {
            processes,
            ..Default::default()
        })
    }

    async fn pause(&self, _: &TtrpcContext, _: api::PauseRequest) -> ttrpc::Result<api::Empty> {
        Err(unimplemented("Pause"))
    }

    async fn resume(&self, _: &TtrpcContext, _: api::ResumeRequest) -> ttrpc::Result<api::Empty> {
        Err(unimplemented("Resume"))
    }

    async fn checkpoint(
        &self,
        _: &TtrpcContext,
        _: api::CheckpointTaskRequest,
    ) -> ttrpc::Result<api::Empty> {
        Err(unimplemented("Checkpoint"))
    }

    async fn kill(&self, _: &TtrpcContext, req: api::KillRequest) -> ttrpc::Result<api::Empty> {
        let key = ProcessKey::from_request(&req.id, &req.exec_id);
        self.service
            .kill(&key, req.signal, req.all)
            .await
            .or_status()?;
        Ok(api::Empty::default())
    }

    async fn exec(
        &self,
        _: &TtrpcContext,
        req: api::ExecProcessRequest,
    ) -> ttrpc::Result<api::Empty> {
        if req.exec_id.is_empty() {
            return Err(invalid("exec id is empty"));
        }
        let key = ProcessKey::exec(&req.id, &req.exec_id);
        let stdio = Stdio {
            stdin: req.stdin,
            stdout: req.stdout,
            stderr: req.stderr,
            terminal: req.terminal,
        };
        let spec = req.spec.as_ref().map_or(&[][..], |any| &any.value[..]);
        self.service.exec(&key, stdio, spec).or_status()?;
        Ok(api::Empty::default())
    }

    async fn resize_pty(
        &self,
        _: &TtrpcContext,
        req: api::ResizePtyRequest,
    ) -> ttrpc::Result<api::Empty> {
        let key = ProcessKey::from_request(&req.id, &req.exec_id);
        self.service
            .resize_pty(&key, req.width, req.height)
            .await
            .or_status()?;
        Ok(api::Empty::default())
    }

    async fn close_io(
        &self,
        _: &TtrpcContext,
        req: api::CloseIORequest,
    ) -> ttrpc::Result<api::Empty> {
        let key = ProcessKey::from_request(&req.id, &req.exec_id);
        if req.stdin {
            self.service.close_stdin(&key).await.or_status()?;
        } else {
            self.service.state(&key).or_status()?;
        }
        Ok(api::Empty::default())
    }

    async fn update(
        &self,
        _: &TtrpcContext,
        req: api::UpdateTaskRequest,
    ) -> ttrpc::Result<api::Empty> {
        let resources = Resources {
            type_url: req.resources.type_url.clone(),
            value: req.resources.value.clone(),
            annotations: req.annotations,
        };
        self.service.update(&req.id, &resources).await.or_status()?;
        Ok(api::Empty::default())
    }

    async fn wait(
        &self,
        _: &TtrpcContext,
        req: api::WaitRequest,
    ) -> ttrpc::Result<api::WaitResponse> {
        let key = ProcessKey::from_request(&req.id, &req.exec_id);
        let exit = self.service.wait(&key).await.or_status()?;
        Ok(api::WaitResponse {
            exit_status: exit.status,
            exited_at: timestamp(exit.at),
            ..Default::default()
        })
    }

    async fn stats(
        &self,
        _: &TtrpcContext,
        req: api::StatsRequest,
    ) -> ttrpc::Result<api::StatsResponse> {
        let stats = self.service.stats(&req.id).await.or_status()?;
        let any = metrics_any(&stats).or_status()?;
        Ok(api::StatsResponse {
            stats: MessageField::some(any),
            ..Default::default()
        })
    }

    async fn connect(
        &self,
        _: &TtrpcContext,
        req: api::ConnectRequest,
    ) -> ttrpc::Result<api::ConnectResponse> {
        Ok(api::ConnectResponse {
            shim_pid: std::process::id(),
            task_pid: self.service.task_pid(&req.id),
            version: SHIM_VERSION.to_owned(),
            ..Default::default()
        })
    }

    async fn shutdown(
        &self,
        _: &TtrpcContext,
        _: api::ShutdownRequest,
    ) -> ttrpc::Result<api::Empty> {
        if self.service.shut_down().await {
            self.exit.signal();
        }
        Ok(api::Empty::default())
    }
}
