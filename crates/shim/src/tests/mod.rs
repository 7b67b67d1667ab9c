//! Unit tests of the task service through containerd's ttRPC task API, against a fake backend
//! and a fake event sink: every request goes through [`TtrpcTask`] as containerd's would, and
//! the tests assert the answers, the status codes, what the backend was asked and the events.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::task::{Context, Waker};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use containerd_shim::asynchronous::ExitSignal;
use containerd_shim_protos::api;
use containerd_shim_protos::protobuf::well_known_types::any::Any;
use containerd_shim_protos::protobuf::MessageField;
use containerd_shim_protos::shim_async::Task;
use containerd_shim_protos::ttrpc::{self, r#async::TtrpcContext, Code};
use tokio::sync::oneshot;

use crate::backend::{
    Backend, BackendError, ContainerSpec, Ended, Resources, StartSpec, Started, Stats,
};
use crate::events::{EventSink, TaskEvent};
use crate::service::TaskService;
use crate::state::{Exit, ProcessKey};
use crate::ttrpc::TtrpcTask;

mod lifecycle;
mod requests;
mod resources;

/// What the fake backend was asked to do.
#[derive(Debug, Clone, PartialEq)]
pub enum Call {
    Create(ContainerSpec),
    Start(StartSpec),
    Kill(ProcessKey, u32, bool),
    Resize(ProcessKey, u32, u32),
    CloseStdin(ProcessKey),
    Update(String, Resources),
    Stats(String),
    Delete(String, String),
}

#[derive(Debug, Default)]
struct FakeState {
    calls: Vec<Call>,
    exits: HashMap<ProcessKey, oneshot::Sender<Ended>>,
    next_pid: u32,
    fail_create: bool,
    fail_start: bool,
    /// Refuse the next start as a command that cannot be run (`InvalidArgument`).
    not_runnable: bool,
    /// Creates wait for this before they finish (a VM that boots while the test acts).
    create_gate: Option<Arc<tokio::sync::Semaphore>>,
    /// The pod VM's cgroup directory and size that `update` applies to, once given.
    cgroup: Option<(std::path::PathBuf, u32, u8)>,
}

/// A backend that records its calls and whose processes exit when the test says so.
#[derive(Debug, Clone, Default)]
pub struct FakeBackend {
    state: Arc<Mutex<FakeState>>,
}

/// The pid the fake backend reports for the first create or start (then +1 each).
pub const FIRST_PID: u32 = 100;

impl FakeBackend {
    fn with<T>(&self, f: impl FnOnce(&mut FakeState) -> T) -> T {
        f(&mut self.state.lock().unwrap())
    }

    fn next_pid(&self) -> u32 {
        self.with(|s| {
            let pid = FIRST_PID + s.next_pid;
            s.next_pid += 1;
            pid
        })
    }

    pub fn calls(&self) -> Vec<Call> {
        self.with(|s| s.calls.clone())
    }

    /// Makes creates wait until the returned gate gets a permit.
    pub fn gate_creates(&self) -> Arc<tokio::sync::Semaphore> {
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        self.with(|s| s.create_gate = Some(gate.clone()));
        gate
    }

    pub fn fail_create(&self) {
        self.with(|s| s.fail_create = true);
    }

    pub fn fail_start(&self) {
        self.with(|s| s.fail_start = true);
    }

    /// Makes starts fail as a command the guest cannot run does.
    pub fn not_runnable(&self) {
        self.with(|s| s.not_runnable = true);
    }

    /// Makes a started process exit with `status` at `at`.
    pub fn exit(&self, key: &ProcessKey, status: u32, at: SystemTime) {
        self.end(key, Ended::exited(Exit { status, at }));
    }

    /// Makes a started process end as `ended` says.
    pub fn end(&self, key: &ProcessKey, ended: Ended) {
        let sender = self
            .with(|s| s.exits.remove(key))
            .expect("the process was started");
        sender.send(ended).expect("the service awaits the exit");
    }

    /// Has `update` apply resources to the cgroup directory `dir` of a pod VM with `memory_mib`
    /// of RAM and `vcpus`, as the microVM backend does to the pod's host cgroup.
    pub fn use_cgroup(&self, dir: &std::path::Path, memory_mib: u32, vcpus: u8) {
        self.with(|s| s.cgroup = Some((dir.to_owned(), memory_mib, vcpus)));
    }

    /// Loses a started process: its exit channel closes without an exit.
    pub fn lose(&self, key: &ProcessKey) {
        self.with(|s| s.exits.remove(key))
            .expect("the process was started");
    }

    fn record(&self, call: Call) {
        self.with(|s| s.calls.push(call));
    }
}

#[async_trait]
impl Backend for FakeBackend {
    async fn create(&self, spec: &ContainerSpec) -> Result<u32, BackendError> {
        self.record(Call::Create(spec.clone()));
        if let Some(gate) = self.with(|s| s.create_gate.clone()) {
            let _ = gate.acquire().await;
        }
        if self.with(|s| s.fail_create) {
            return Err(BackendError::Failed("the VM did not boot".into()));
        }
        Ok(self.next_pid())
    }

    async fn start(&self, spec: &StartSpec) -> Result<Started, BackendError> {
        self.record(Call::Start(spec.clone()));
        if self.with(|s| s.fail_start) {
            return Err(BackendError::Failed("the agent went away".into()));
        }
        if self.with(|s| s.not_runnable) {
            return Err(BackendError::InvalidArgument(
                "[\"/no/such\"] could not be run".into(),
            ));
        }
        let (sender, exit) = oneshot::channel();
        self.with(|s| s.exits.insert(spec.key.clone(), sender));
        Ok(Started {
            pid: self.next_pid(),
            exit,
        })
    }

    async fn kill(&self, key: &ProcessKey, signal: u32, all: bool) -> Result<(), BackendError> {
        self.record(Call::Kill(key.clone(), signal, all));
        Ok(())
    }

    async fn resize_pty(&self, key: &ProcessKey, w: u32, h: u32) -> Result<(), BackendError> {
        self.record(Call::Resize(key.clone(), w, h));
        Ok(())
    }

    async fn close_stdin(&self, key: &ProcessKey) -> Result<(), BackendError> {
        self.record(Call::CloseStdin(key.clone()));
        Ok(())
    }

    async fn update(&self, id: &str, resources: &Resources) -> Result<(), BackendError> {
        self.record(Call::Update(id.to_owned(), resources.clone()));
        let Some((dir, memory_mib, vcpus)) = self.with(|s| s.cgroup.clone()) else {
            return Ok(());
        };
        let vm = crate::update::PodVm {
            cgroup_dir: &dir,
            memory_mib,
            vcpus,
        };
        Ok(crate::update::apply(&vm, resources)?)
    }

    async fn stats(&self, id: &str) -> Result<Stats, BackendError> {
        self.record(Call::Stats(id.to_owned()));
        Ok(Stats {
            memory_usage_bytes: 4096,
            memory_limit_bytes: 1 << 26,
            cpu_usage_ns: 7,
            pids: 2,
        })
    }

    async fn delete(&self, id: &str, pod: &str) -> Result<(), BackendError> {
        self.record(Call::Delete(id.to_owned(), pod.to_owned()));
        Ok(())
    }
}

/// An event sink that keeps what it is given.
#[derive(Debug, Default)]
pub struct FakeSink {
    events: Mutex<Vec<TaskEvent>>,
}

impl EventSink for FakeSink {
    fn publish(&self, event: TaskEvent) {
        self.events.lock().unwrap().push(event);
    }
}

/// A task service on fakes, with a bundle directory holding an OCI spec.
pub struct Harness {
    pub task: TtrpcTask<FakeBackend>,
    pub backend: FakeBackend,
    pub sink: Arc<FakeSink>,
    pub exit: Arc<ExitSignal>,
    pub bundle: tempfile::TempDir,
}

/// A fixed exit time, so that tests can compare it.
pub fn exit_time() -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::new(1_800_000_000, 123_000_000)
}

/// The error code of a ttRPC error.
pub fn code<T: std::fmt::Debug>(result: ttrpc::Result<T>) -> Code {
    match result {
        Err(ttrpc::Error::RpcStatus(status)) => status.code(),
        other => panic!("expected a ttRPC status, got {other:?}"),
    }
}

/// Polls a future once: whether it is already done.
pub fn is_ready<F: Future>(future: F) -> bool {
    let mut future = std::pin::pin!(future);
    future
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()))
        .is_ready()
}

pub fn ctx() -> TtrpcContext {
    TtrpcContext {
        mh: Default::default(),
        metadata: HashMap::new(),
        timeout_nano: 0,
    }
}

pub fn init(id: &str) -> ProcessKey {
    ProcessKey::init(id)
}

pub fn exec(id: &str, exec: &str) -> ProcessKey {
    ProcessKey::exec(id, exec)
}

impl Harness {
    pub fn new() -> Harness {
        Harness::with_annotations(&HashMap::new())
    }

    pub fn with_annotations(annotations: &HashMap<String, String>) -> Harness {
        let bundle = tempfile::tempdir().unwrap();
        let spec = serde_json::json!({ "ociVersion": "1.0.2", "annotations": annotations });
        std::fs::write(bundle.path().join("config.json"), spec.to_string()).unwrap();
        let backend = FakeBackend::default();
        let sink = Arc::new(FakeSink::default());
        let exit = Arc::new(ExitSignal::default());
        let service = TaskService::new(backend.clone(), Arc::clone(&sink) as Arc<dyn EventSink>);
        let task = TtrpcTask::new(service, Arc::clone(&exit));
        Harness {
            task,
            backend,
            sink,
            exit,
            bundle,
        }
    }

    pub fn bundle(&self) -> String {
        self.bundle.path().to_str().unwrap().to_owned()
    }

    pub fn events(&self) -> Vec<TaskEvent> {
        self.sink.events.lock().unwrap().clone()
    }

    pub fn topics(&self) -> Vec<&'static str> {
        self.events().iter().map(TaskEvent::topic).collect()
    }

    pub fn create_request(&self, id: &str) -> api::CreateTaskRequest {
        api::CreateTaskRequest {
            id: id.into(),
            bundle: self.bundle(),
            stdout: format!("/run/fifo/{id}-stdout"),
            rootfs: vec![api::Mount {
                type_: "overlay".into(),
                source: "overlay".into(),
                options: vec!["lowerdir=/l".into()],
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    pub async fn create(&self, id: &str) -> ttrpc::Result<api::CreateTaskResponse> {
        self.task.create(&ctx(), self.create_request(id)).await
    }

    pub async fn start(&self, key: &ProcessKey) -> ttrpc::Result<api::StartResponse> {
        let req = api::StartRequest {
            id: key.container.clone(),
            exec_id: key.exec.clone().unwrap_or_default(),
            ..Default::default()
        };
        self.task.start(&ctx(), req).await
    }

    /// Creates and starts container `id`.
    pub async fn running(&self, id: &str) {
        self.create(id).await.unwrap();
        self.start(&init(id)).await.unwrap();
    }

    pub async fn state(&self, key: &ProcessKey) -> ttrpc::Result<api::StateResponse> {
        let req = api::StateRequest {
            id: key.container.clone(),
            exec_id: key.exec.clone().unwrap_or_default(),
            ..Default::default()
        };
        self.task.state(&ctx(), req).await
    }

    pub fn wait_request(key: &ProcessKey) -> api::WaitRequest {
        api::WaitRequest {
            id: key.container.clone(),
            exec_id: key.exec.clone().unwrap_or_default(),
            ..Default::default()
        }
    }

    pub async fn wait(&self, key: &ProcessKey) -> ttrpc::Result<api::WaitResponse> {
        self.task.wait(&ctx(), Harness::wait_request(key)).await
    }

    pub async fn kill(&self, key: &ProcessKey, signal: u32) -> ttrpc::Result<api::Empty> {
        let req = api::KillRequest {
            id: key.container.clone(),
            exec_id: key.exec.clone().unwrap_or_default(),
            signal,
            ..Default::default()
        };
        self.task.kill(&ctx(), req).await
    }

    pub async fn delete(&self, key: &ProcessKey) -> ttrpc::Result<api::DeleteResponse> {
        let req = api::DeleteRequest {
            id: key.container.clone(),
            exec_id: key.exec.clone().unwrap_or_default(),
            ..Default::default()
        };
        self.task.delete(&ctx(), req).await
    }

    pub fn exec_request(key: &ProcessKey, spec: &str) -> api::ExecProcessRequest {
        api::ExecProcessRequest {
            id: key.container.clone(),
            exec_id: key.exec.clone().unwrap_or_default(),
            stdout: "/run/fifo/exec-stdout".into(),
            spec: MessageField::some(Any {
                type_url: "types.containerd.io/opencontainers/runtime-spec/1/Process".into(),
                value: spec.as_bytes().to_vec(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    pub async fn exec(&self, key: &ProcessKey) -> ttrpc::Result<api::Empty> {
        let spec = r#"{"args": ["ls", "-l"], "env": ["PATH=/bin"], "cwd": "/"}"#;
        self.task
            .exec(&ctx(), Harness::exec_request(key, spec))
            .await
    }

    /// Makes a started process exit with `status` and waits until the service has recorded it.
    pub async fn exit(&self, key: &ProcessKey, status: u32) -> api::WaitResponse {
        self.backend.exit(key, status, exit_time());
        self.wait(key).await.unwrap()
    }
}
