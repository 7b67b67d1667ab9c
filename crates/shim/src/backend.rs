//! The microVM side of the shim, behind one small trait so that the task service can be tested
//! with a fake.
//!
//! A backend owns one microVM per pod (the pod is [`ContainerSpec::pod`]): `create` boots the
//! pod's VM or joins the one already running and prepares the container's root file system in it;
//! `start` runs a process there and hands back a channel that reports its exit (and whether it
//! was OOM-killed); the rest act on a
//! running process or container. The task service calls it only for transitions the state machine
//! allows, and never while it holds its lock.

use std::collections::HashMap;

use async_trait::async_trait;
use tokio::sync::oneshot;

use crate::events::Mount;
use crate::state::{Exit, ProcessKey, Stdio};
use crate::ErrorKind;

/// What the backend can fail with.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The container or process is unknown to the backend.
    #[error("{0}: not found in the microVM")]
    NotFound(String),
    /// The request cannot be carried out as given (a bad process spec, a bad signal).
    #[error("{0}")]
    InvalidArgument(String),
    /// Something this backend does not do.
    #[error("{0}")]
    Unimplemented(String),
    /// The VM or its agent failed.
    #[error("microVM backend: {0}")]
    Failed(String),
}

impl BackendError {
    /// How containerd should classify the error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            BackendError::NotFound(_) => ErrorKind::NotFound,
            BackendError::InvalidArgument(_) => ErrorKind::InvalidArgument,
            BackendError::Unimplemented(_) => ErrorKind::Unimplemented,
            BackendError::Failed(_) => ErrorKind::Internal,
        }
    }
}

/// A container to create.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerSpec {
    /// The container id.
    pub id: String,
    /// The pod (microVM) it belongs to ([`crate::pod_id`]).
    pub pod: String,
    /// The OCI bundle directory (`config.json` is there).
    pub bundle: String,
    /// The root file-system mounts containerd passed.
    pub rootfs: Vec<Mount>,
    /// The init process's stdio (containerd's FIFOs) and whether it gets a terminal.
    pub stdio: Stdio,
    /// The OCI spec's annotations.
    pub annotations: HashMap<String, String>,
}

/// The OCI process of an exec, as containerd sends it (`runtime-spec` `Process`, JSON), parsed
/// far enough to be checked; the backend gets the document itself too.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
pub struct ExecProcess {
    /// The command and its arguments (not empty).
    pub args: Vec<String>,
    /// `NAME=value` entries.
    #[serde(default)]
    pub env: Vec<String>,
    /// The working directory.
    #[serde(default)]
    pub cwd: String,
    /// Whether the process wants a terminal.
    #[serde(default)]
    pub terminal: bool,
}

impl ExecProcess {
    /// Parses and checks an exec's process spec.
    pub fn from_json(json: &[u8]) -> Result<ExecProcess, BackendError> {
        let process: ExecProcess = serde_json::from_slice(json).map_err(|e| {
            BackendError::InvalidArgument(format!("exec process spec is not valid: {e}"))
        })?;
        if process.args.is_empty() {
            return Err(BackendError::InvalidArgument(
                "exec process spec has no args".into(),
            ));
        }
        Ok(process)
    }
}

/// A process to start: the init process of a container or one of its execs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartSpec {
    /// Which process.
    pub key: ProcessKey,
    /// Its stdio.
    pub stdio: Stdio,
    /// For an exec: its process spec (the init process's is in the bundle).
    pub exec: Option<ExecProcess>,
    /// containerd already closed the process's stdin (`CloseIO` before `Start`).
    pub stdin_closed: bool,
}

/// How a started process ended, as the backend reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ended {
    /// Its exit status and time.
    pub exit: Exit,
    /// It was killed for want of memory: by the guest's OOM killer (the agent's claim, which is
    /// reported and trusted for nothing else) or, with the pod's VM, by the host's (an
    /// `oom_kill` counted in the pod cgroup's `memory.events`). The service publishes `TaskOOM`
    /// for its container before `TaskExit`.
    pub oom_killed: bool,
}

impl Ended {
    /// An end without an OOM kill.
    pub fn exited(exit: Exit) -> Ended {
        Ended {
            exit,
            oom_killed: false,
        }
    }
}

/// A started process: its pid and the channel that reports its end. A backend that drops the
/// sender without sending (the VM died) makes the process exit with status 255.
#[derive(Debug)]
pub struct Started {
    /// The process's pid.
    pub pid: u32,
    /// Receives the process's end, once.
    pub exit: oneshot::Receiver<Ended>,
}

/// The `Update` request's new resources, as containerd sends them (a protobuf `Any`; for Linux
/// containers the JSON of the OCI `LinuxResources`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Resources {
    /// The `Any`'s type URL.
    pub type_url: String,
    /// Its value.
    pub value: Vec<u8>,
    /// Annotations sent with the update.
    pub annotations: HashMap<String, String>,
}

/// A container's resource usage (`Stats`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Stats {
    /// Memory in use, in bytes.
    pub memory_usage_bytes: u64,
    /// The memory limit, in bytes (0: none).
    pub memory_limit_bytes: u64,
    /// CPU time used, in nanoseconds.
    pub cpu_usage_ns: u64,
    /// Number of processes.
    pub pids: u64,
}

/// The microVM side of the shim (see the module documentation).
#[async_trait]
pub trait Backend: Send + Sync + 'static {
    /// Boots the pod's microVM or joins it, and prepares the container; returns the pid that
    /// `Create` reports.
    async fn create(&self, spec: &ContainerSpec) -> Result<u32, BackendError>;
    /// Starts a process of a created container.
    async fn start(&self, spec: &StartSpec) -> Result<Started, BackendError>;
    /// Sends `signal` to a running process (`all`: to every process of the container).
    async fn kill(&self, key: &ProcessKey, signal: u32, all: bool) -> Result<(), BackendError>;
    /// Resizes a running process's terminal.
    async fn resize_pty(
        &self,
        key: &ProcessKey,
        width: u32,
        height: u32,
    ) -> Result<(), BackendError>;
    /// Closes a running process's stdin.
    async fn close_stdin(&self, key: &ProcessKey) -> Result<(), BackendError>;
    /// Applies new resource limits to a container.
    async fn update(&self, container_id: &str, resources: &Resources) -> Result<(), BackendError>;
    /// Reports a container's resource usage.
    async fn stats(&self, container_id: &str) -> Result<Stats, BackendError>;
    /// Removes a container whose processes have all stopped; stops the pod's VM with its last
    /// container.
    async fn delete(&self, container_id: &str, pod: &str) -> Result<(), BackendError>;
}
