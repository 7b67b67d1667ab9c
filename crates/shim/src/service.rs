//! The task service: containerd's task API over the state machine ([`Tasks`]) and a
//! [`Backend`], in plain Rust types (the ttRPC adapter is [`crate::ttrpc`]).
//!
//! Each request is checked against the state machine first, so the backend is asked only for
//! transitions the machine allows; the lock on the machine is never held across a backend call.
//! A started process's exit is awaited on a task of its own, which records it (publishing
//! `TaskExit`, after `TaskOOM` when the backend says the process was OOM-killed) and releases
//! the process's waiters.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

use crate::backend::{
    Backend, BackendError, ContainerSpec, Ended, ExecProcess, Resources, StartSpec, Stats,
};
use crate::events::{EventSink, Mount};
use crate::state::{
    Deleted, Exit, KillAction, NewContainer, ProcessKey, ProcessState, StateError, Stdio, Tasks,
};
use crate::ErrorKind;

/// Counts a create out of [`Inner::creating`] when dropped (whatever way the create ends).
struct Decrement<'a>(&'a tokio::sync::watch::Sender<usize>);

impl Drop for Decrement<'_> {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// The exit status of a process whose backend lost it (the VM or the agent went away).
pub const LOST_STATUS: u32 = 255;

/// Exit status of a process whose command could not be run in the guest (missing, not
/// executable, a bad working directory), as a shell reports a command it cannot find.
pub const NOT_RUNNABLE_STATUS: u32 = 127;

/// SIGKILL's number (9 on every Linux architecture).
const SIGKILL: u32 = 9;

/// What a task request can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// The state machine refused it.
    #[error(transparent)]
    State(#[from] StateError),
    /// The backend failed it.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The request is malformed.
    #[error("{0}")]
    InvalidArgument(String),
}

impl ServiceError {
    /// How containerd should classify the error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            ServiceError::State(e) => e.kind(),
            ServiceError::Backend(e) => e.kind(),
            ServiceError::InvalidArgument(_) => ErrorKind::InvalidArgument,
        }
    }
}

/// A `Create` request.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CreateTask {
    /// The container id.
    pub id: String,
    /// The bundle directory.
    pub bundle: String,
    /// The root file-system mounts.
    pub rootfs: Vec<Mount>,
    /// The init process's stdio.
    pub stdio: Stdio,
    /// The OCI spec's annotations (read from the bundle's `config.json`).
    pub annotations: HashMap<String, String>,
    /// A checkpoint to restore from (not supported: must be empty).
    pub checkpoint: String,
}

/// The task service (see the module documentation). Cheap to clone: clones share the state.
pub struct TaskService<B: Backend> {
    inner: Arc<Inner<B>>,
}

struct Inner<B> {
    backend: B,
    tasks: Mutex<Tasks>,
    /// How many creates are in the backend (their VMs booting).
    creating: tokio::sync::watch::Sender<usize>,
}

impl<B: Backend> Clone for TaskService<B> {
    fn clone(&self) -> Self {
        TaskService {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<B: Backend> std::fmt::Debug for TaskService<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TaskService")
            .field("containers", &self.tasks().len())
            .finish()
    }
}

impl<B: Backend> TaskService<B> {
    /// A service with no containers, over `backend`, publishing to `events`.
    pub fn new(backend: B, events: Arc<dyn EventSink>) -> TaskService<B> {
        let inner = Inner {
            backend,
            tasks: Mutex::new(Tasks::new(events)),
            creating: tokio::sync::watch::Sender::new(0),
        };
        TaskService {
            inner: Arc::new(inner),
        }
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.inner.backend
    }

    fn tasks(&self) -> MutexGuard<'_, Tasks> {
        // A panic while the lock was held cannot leave the machine half-changed in a way that
        // matters more than refusing every later request would, so a poisoned lock is used as is.
        self.inner
            .tasks
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// `Create`: reserves the id, has the backend create the container, records it; returns
    /// the pid the backend reports.
    pub async fn create(&self, req: CreateTask) -> Result<u32, ServiceError> {
        if !req.checkpoint.is_empty() {
            return Err(ServiceError::InvalidArgument(
                "restoring a container from a checkpoint is not supported".into(),
            ));
        }
        let new = NewContainer {
            id: req.id.clone(),
            pod: crate::pod_id(&req.id, &req.annotations).to_owned(),
            bundle: req.bundle.clone(),
            rootfs: req.rootfs.clone(),
            stdio: req.stdio.clone(),
        };
        self.tasks().reserve(&new)?;
        let spec = ContainerSpec {
            id: req.id,
            pod: new.pod.clone(),
            bundle: req.bundle,
            rootfs: req.rootfs,
            stdio: req.stdio,
            annotations: req.annotations,
        };
        self.inner.creating.send_modify(|n| *n += 1);
        let _done = Decrement(&self.inner.creating);
        match self.inner.backend.create(&spec).await {
            Ok(pid) => match self.record_created(new, pid) {
                Ok(()) => Ok(pid),
                Err(e) => {
                    // Given up while its VM booted (containerd shut the shim down after its
                    // client went away, [`TaskService::shut_down`]): what the backend made
                    // for it would otherwise outlive the task.
                    if let Err(undo) = self.inner.backend.delete(&spec.id, &spec.pod).await {
                        tracing::warn!("undoing the create of {}: {undo}", spec.id);
                    }
                    Err(e.into())
                }
            },
            Err(e) => {
                self.tasks().abandon(&spec.id);
                Err(e.into())
            }
        }
    }

    /// Records a container the backend created (the state lock released on return).
    fn record_created(&self, new: NewContainer, pid: u32) -> Result<(), StateError> {
        self.tasks().created(new, pid)
    }

    /// `Start`: starts a created process; returns its pid.
    pub async fn start(&self, key: &ProcessKey) -> Result<u32, ServiceError> {
        let plan = self.tasks().begin_start(key)?;
        let spec = StartSpec {
            key: key.clone(),
            stdio: plan.stdio,
            exec: plan.exec,
            stdin_closed: plan.stdin_closed,
        };
        let started = match self.inner.backend.start(&spec).await {
            Ok(started) => started,
            Err(e) => {
                // The process can never run now: it stops, as a runc task whose command is
                // missing does (at its create), so that containerd's plain Delete (`ctr run
                // --rm`'s clean-up) removes it and, for an init process, its VM.
                self.tasks().finish_start(key, None).ok();
                let status = match e {
                    BackendError::InvalidArgument(_) => NOT_RUNNABLE_STATUS,
                    _ => LOST_STATUS,
                };
                let exit = Exit {
                    status,
                    at: SystemTime::now(),
                };
                self.record_exit(key, exit).await;
                return Err(e.into());
            }
        };
        self.tasks().finish_start(key, Some(started.pid))?;
        // Spawned after `TaskStart` is queued, so `TaskExit` always comes after it.
        let service = self.clone();
        let key = key.clone();
        tokio::spawn(async move {
            let lost = Ended::exited(Exit {
                status: LOST_STATUS,
                at: SystemTime::now(),
            });
            let ended = started.exit.await.unwrap_or(lost);
            if ended.oom_killed {
                // Before `TaskExit`, as containerd's CRI plugin expects to mark the exit OOMKilled.
                if let Err(e) = service.report_oom(&key.container) {
                    tracing::warn!("reporting the OOM kill of {key}: {e}");
                }
            }
            service.record_exit(&key, ended.exit).await;
        });
        Ok(started.pid)
    }

    /// Records a process's exit; when it is an init process, its running execs die with it and
    /// the backend is told to kill them.
    async fn record_exit(&self, key: &ProcessKey, exit: Exit) {
        let orphans = self.tasks().exited(key, exit);
        for orphan in orphans {
            if let Err(e) = self.inner.backend.kill(&orphan, SIGKILL, false).await {
                tracing::warn!("killing {orphan} after its container's exit: {e}");
            }
        }
    }

    /// `State`.
    pub fn state(&self, key: &ProcessKey) -> Result<ProcessState, ServiceError> {
        Ok(self.tasks().state(key)?)
    }

    /// `Wait`: returns once the process has stopped, with how it ended.
    pub async fn wait(&self, key: &ProcessKey) -> Result<Exit, ServiceError> {
        let mut waiter = self.tasks().waiter(key)?;
        let exit = waiter.wait_for(Option::is_some).await.map(|exit| *exit);
        match exit {
            Ok(Some(exit)) => Ok(exit),
            _ => Err(StateError::NotFound(format!("{key}: deleted before it exited")).into()),
        }
    }

    /// `Kill`: signals a running process; a created init process stops without running.
    pub async fn kill(&self, key: &ProcessKey, signal: u32, all: bool) -> Result<(), ServiceError> {
        if signal == 0 || signal > 64 {
            return Err(ServiceError::InvalidArgument(format!(
                "signal {signal} is not valid"
            )));
        }
        let action = self.tasks().kill(key, signal)?;
        match action {
            KillAction::Stopped => Ok(()),
            KillAction::Signal => Ok(self.inner.backend.kill(key, signal, all).await?),
        }
    }

    /// `Delete`: removes a process that is not running; the init process takes its container
    /// (and the backend's part of it) along.
    pub async fn delete(&self, key: &ProcessKey) -> Result<Deleted, ServiceError> {
        self.tasks().check_delete(key)?;
        if key.exec.is_none() {
            let pod = self.tasks().pod(&key.container)?;
            self.inner.backend.delete(&key.container, &pod).await?;
        }
        Ok(self.tasks().delete(key)?)
    }

    /// `Pids`: the running processes of a container, with their exec ids.
    pub fn pids(&self, container: &str) -> Result<Vec<(u32, Option<String>)>, ServiceError> {
        Ok(self.tasks().pids(container)?)
    }

    /// `Exec`: adds an exec process (not started) to a running container. `spec` is the OCI
    /// process as JSON.
    pub fn exec(&self, key: &ProcessKey, stdio: Stdio, spec: &[u8]) -> Result<(), ServiceError> {
        let process = ExecProcess::from_json(spec)?;
        Ok(self.tasks().add_exec(key, stdio, process)?)
    }

    /// `ResizePty`.
    pub async fn resize_pty(
        &self,
        key: &ProcessKey,
        width: u32,
        height: u32,
    ) -> Result<(), ServiceError> {
        self.tasks().require_running(key)?;
        Ok(self.inner.backend.resize_pty(key, width, height).await?)
    }

    /// `CloseIO` with `stdin`: closes a running process's stdin; a created one starts with it
    /// closed; a stopped one has nothing left to close.
    pub async fn close_stdin(&self, key: &ProcessKey) -> Result<(), ServiceError> {
        let running = self.tasks().close_stdin(key)?;
        if running {
            self.inner.backend.close_stdin(key).await?;
        }
        Ok(())
    }

    /// `Update`: new resource limits for a container that has not stopped.
    pub async fn update(&self, container: &str, resources: &Resources) -> Result<(), ServiceError> {
        self.tasks().require_live(container)?;
        Ok(self.inner.backend.update(container, resources).await?)
    }

    /// `Stats`.
    pub async fn stats(&self, container: &str) -> Result<Stats, ServiceError> {
        self.tasks().pod(container)?;
        Ok(self.inner.backend.stats(container).await?)
    }

    /// `Connect`: the init process's pid of `container` (0 when there is no such container, as
    /// containerd's own shim answers).
    pub fn task_pid(&self, container: &str) -> u32 {
        self.tasks().init_pid(container).unwrap_or(0)
    }

    /// `Shutdown`: whether the shim may exit, which it may once it has no containers left (one
    /// shim serves every container of a pod): a container containerd has (a finished create)
    /// keeps it. Creates still in the backend were given up by containerd (it shuts a shim down
    /// after a failed or cancelled create, e.g. `ctr run` killed, a kubelet deadline): their
    /// reservations go, and this waits until each has undone what the backend made for it.
    pub async fn shut_down(&self) -> bool {
        if !self.tasks().drop_reservations() {
            return false;
        }
        let mut creating = self.inner.creating.subscribe();
        let _ = creating.wait_for(|n| *n == 0).await;
        self.tasks().is_empty()
    }

    /// Publishes `TaskOOM` for a container (what a process's [`Ended::oom_killed`] becomes).
    pub fn report_oom(&self, container: &str) -> Result<(), ServiceError> {
        Ok(self.tasks().oom(container)?)
    }
}
