//! The task-state machine: containers, their init process and exec processes, and what each
//! request may do to them.
//!
//! Every process is `Created` until the backend has started it, `Running` until it exits, and
//! `Stopped` from then on, with its exit status and time; a `Stopped` process stays until
//! containerd deletes it, and anyone waiting on it is released when it stops. The rules follow
//! containerd's own shim (runc v2), because containerd and the CRI plugin rely on them:
//!
//! * a container id or an exec id is taken once ([`StateError::AlreadyExists`]);
//! * an exec is added and started only while the init process runs;
//! * killing a created init process stops it without running it (status 128 + signal); killing a
//!   created exec is refused; killing a stopped process is [`StateError::NotFound`] ("process
//!   already finished"), which containerd treats as success;
//! * a running process cannot be deleted, nor an init process while one of its execs runs;
//! * deleting the init process deletes the container and its remaining execs.
//!
//! The machine publishes the event of each transition (see [`crate::events`]) while it makes it,
//! so the events' order is the transitions' order. It is synchronous and does no I/O: the task
//! service calls the backend between its steps ([`Tasks::begin_start`], [`Tasks::finish_start`]).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::SystemTime;

use tokio::sync::watch;

use crate::events::{EventSink, Mount, TaskEvent};
use crate::{backend::ExecProcess, ErrorKind};

/// What a request to the state machine can fail with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    /// No such container or process.
    #[error("{0}: not found")]
    NotFound(String),
    /// The id is taken.
    #[error("{0}: already exists")]
    AlreadyExists(String),
    /// Not allowed in the process's current state.
    #[error("{0}")]
    FailedPrecondition(String),
    /// A malformed request.
    #[error("{0}")]
    InvalidArgument(String),
}

impl StateError {
    /// How containerd should classify the error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            StateError::NotFound(_) => ErrorKind::NotFound,
            StateError::AlreadyExists(_) => ErrorKind::AlreadyExists,
            StateError::FailedPrecondition(_) => ErrorKind::FailedPrecondition,
            StateError::InvalidArgument(_) => ErrorKind::InvalidArgument,
        }
    }
}

/// A process: a container's init process (`exec` is `None`) or one of its execs.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProcessKey {
    /// The container id.
    pub container: String,
    /// The exec id; `None` for the init process.
    pub exec: Option<String>,
}

impl ProcessKey {
    /// The init process of `container`.
    pub fn init(container: &str) -> ProcessKey {
        ProcessKey {
            container: container.to_owned(),
            exec: None,
        }
    }

    /// Exec `exec` of `container`.
    pub fn exec(container: &str, exec: &str) -> ProcessKey {
        ProcessKey {
            container: container.to_owned(),
            exec: Some(exec.to_owned()),
        }
    }

    /// From containerd's two fields, where an empty exec id means the init process.
    pub fn from_request(container: &str, exec: &str) -> ProcessKey {
        match exec {
            "" => ProcessKey::init(container),
            exec => ProcessKey::exec(container, exec),
        }
    }

    /// The id containerd names the process by in events: the exec id, or the container id.
    pub fn event_id(&self) -> &str {
        self.exec.as_deref().unwrap_or(&self.container)
    }
}

impl std::fmt::Display for ProcessKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.exec {
            None => write!(f, "container {}", self.container),
            Some(exec) => write!(f, "exec {exec} of container {}", self.container),
        }
    }
}

/// A process's status, as containerd's task API names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Created, not started.
    Created,
    /// Started, not exited.
    Running,
    /// Exited.
    Stopped,
}

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exit {
    /// Its exit status (128 + signal number when a signal ended it).
    pub status: u32,
    /// When it ended.
    pub at: SystemTime,
}

/// A process's stdio: the paths of containerd's FIFOs (empty when not wanted) and whether it has a
/// terminal.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Stdio {
    /// stdin FIFO.
    pub stdin: String,
    /// stdout FIFO.
    pub stdout: String,
    /// stderr FIFO (unused with a terminal).
    pub stderr: String,
    /// Whether the process gets a pseudo-terminal.
    pub terminal: bool,
}

/// What [`Tasks::state`] reports of a process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessState {
    /// The process.
    pub key: ProcessKey,
    /// The container's bundle.
    pub bundle: String,
    /// Its pid (0 before it is known).
    pub pid: u32,
    /// Its status.
    pub status: Status,
    /// Its stdio.
    pub stdio: Stdio,
    /// How it ended, once `Stopped`.
    pub exit: Option<Exit>,
}

/// What a container to create is, apart from the backend's work.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewContainer {
    /// Its id.
    pub id: String,
    /// Its pod ([`crate::pod_id`]).
    pub pod: String,
    /// Its bundle.
    pub bundle: String,
    /// Its root file-system mounts.
    pub rootfs: Vec<Mount>,
    /// Its init process's stdio.
    pub stdio: Stdio,
}

/// What the backend needs to start a process, from [`Tasks::begin_start`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartPlan {
    /// The process's stdio.
    pub stdio: Stdio,
    /// For an exec, its process spec.
    pub exec: Option<ExecProcess>,
    /// stdin was closed before the start.
    pub stdin_closed: bool,
}

/// What a `Kill` must do, from [`Tasks::kill`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KillAction {
    /// Nothing more: the process was created, never started, and is now stopped.
    Stopped,
    /// Ask the backend to signal the running process.
    Signal,
}

/// What a deleted process was, from [`Tasks::delete`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Deleted {
    /// Its pid.
    pub pid: u32,
    /// How it ended (a never-started process: status 0, deleted now).
    pub exit: Exit,
    /// The pod of its container.
    pub pod: String,
}

#[derive(Debug)]
struct Process {
    pid: u32,
    status: Status,
    /// The backend is starting it (still `Created` to containerd).
    starting: bool,
    stdin_closed: bool,
    stdio: Stdio,
    exec: Option<ExecProcess>,
    exit: watch::Sender<Option<Exit>>,
}

impl Process {
    fn new(stdio: Stdio, exec: Option<ExecProcess>) -> Process {
        Process {
            pid: 0,
            status: Status::Created,
            starting: false,
            stdin_closed: false,
            stdio,
            exec,
            exit: watch::channel(None).0,
        }
    }

    fn exit(&self) -> Option<Exit> {
        *self.exit.borrow()
    }
}

#[derive(Debug)]
struct Container {
    pod: String,
    bundle: String,
    /// The backend has created it (`Create` has returned).
    ready: bool,
    init: Process,
    execs: BTreeMap<String, Process>,
}

/// The shim's containers and processes (see the module documentation).
pub struct Tasks {
    containers: BTreeMap<String, Container>,
    events: Arc<dyn EventSink>,
}

impl std::fmt::Debug for Tasks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tasks")
            .field("containers", &self.containers)
            .finish_non_exhaustive()
    }
}

fn not_found(what: impl std::fmt::Display) -> StateError {
    StateError::NotFound(what.to_string())
}

impl Tasks {
    /// An empty machine publishing to `events`.
    pub fn new(events: Arc<dyn EventSink>) -> Tasks {
        Tasks {
            containers: BTreeMap::new(),
            events,
        }
    }

    /// How many containers there are (created but not yet deleted ones included).
    pub fn len(&self) -> usize {
        self.containers.len()
    }

    /// Whether there are no containers.
    pub fn is_empty(&self) -> bool {
        self.containers.is_empty()
    }

    /// Reserves a container id before the backend creates it. Refused when the id is taken.
    pub fn reserve(&mut self, new: &NewContainer) -> Result<(), StateError> {
        if new.id.is_empty() {
            return Err(StateError::InvalidArgument("container id is empty".into()));
        }
        if self.containers.contains_key(&new.id) {
            return Err(StateError::AlreadyExists(format!("container {}", new.id)));
        }
        let container = Container {
            pod: new.pod.clone(),
            bundle: new.bundle.clone(),
            ready: false,
            init: Process::new(new.stdio.clone(), None),
            execs: BTreeMap::new(),
        };
        self.containers.insert(new.id.clone(), container);
        Ok(())
    }

    /// With no finished container, drops every reservation (creates still in the backend will
    /// find theirs gone) and returns true; with one, changes nothing and returns false.
    pub fn drop_reservations(&mut self) -> bool {
        if self.containers.values().any(|c| c.ready) {
            return false;
        }
        self.containers.clear();
        true
    }

    /// Drops a reservation whose creation failed.
    pub fn abandon(&mut self, id: &str) {
        if self.containers.get(id).is_some_and(|c| !c.ready) {
            self.containers.remove(id);
        }
    }

    /// Records a created container (its init process `Created` with `pid`); publishes
    /// `TaskCreate`.
    pub fn created(&mut self, new: NewContainer, pid: u32) -> Result<(), StateError> {
        let container = self
            .containers
            .get_mut(&new.id)
            .filter(|c| !c.ready)
            .ok_or_else(|| not_found(format!("container {}", new.id)))?;
        container.ready = true;
        container.init.pid = pid;
        self.events.publish(TaskEvent::Create {
            container_id: new.id,
            bundle: new.bundle,
            rootfs: new.rootfs,
            stdio: new.stdio,
            pid,
        });
        Ok(())
    }

    fn container(&self, id: &str) -> Result<&Container, StateError> {
        self.containers
            .get(id)
            .filter(|c| c.ready)
            .ok_or_else(|| not_found(format!("container {id}")))
    }

    fn container_mut(&mut self, id: &str) -> Result<&mut Container, StateError> {
        self.containers
            .get_mut(id)
            .filter(|c| c.ready)
            .ok_or_else(|| not_found(format!("container {id}")))
    }

    fn process(&self, key: &ProcessKey) -> Result<&Process, StateError> {
        let container = self.container(&key.container)?;
        match &key.exec {
            None => Ok(&container.init),
            Some(exec) => container.execs.get(exec).ok_or_else(|| not_found(key)),
        }
    }

    fn process_mut(&mut self, key: &ProcessKey) -> Result<&mut Process, StateError> {
        let container = self.container_mut(&key.container)?;
        match &key.exec {
            None => Ok(&mut container.init),
            Some(exec) => container.execs.get_mut(exec).ok_or_else(|| not_found(key)),
        }
    }

    /// The pod of a container.
    pub fn pod(&self, container: &str) -> Result<String, StateError> {
        Ok(self.container(container)?.pod.clone())
    }

    /// Adds an exec process (`Created`) to a container whose init process runs; publishes
    /// `TaskExecAdded`.
    pub fn add_exec(
        &mut self,
        key: &ProcessKey,
        stdio: Stdio,
        exec: ExecProcess,
    ) -> Result<(), StateError> {
        let Some(exec_id) = key.exec.clone() else {
            return Err(StateError::InvalidArgument("exec id is empty".into()));
        };
        let container = self.container_mut(&key.container)?;
        if container.execs.contains_key(&exec_id) {
            return Err(StateError::AlreadyExists(key.to_string()));
        }
        if container.init.status != Status::Running {
            return Err(StateError::FailedPrecondition(format!(
                "container {} is not running: cannot add {key}",
                key.container
            )));
        }
        container
            .execs
            .insert(exec_id.clone(), Process::new(stdio, Some(exec)));
        self.events.publish(TaskEvent::ExecAdded {
            container_id: key.container.clone(),
            exec_id,
        });
        Ok(())
    }

    /// Marks a `Created` process as being started and returns what the backend needs. An exec
    /// starts only while its container's init process runs.
    pub fn begin_start(&mut self, key: &ProcessKey) -> Result<StartPlan, StateError> {
        let init_running = self.container(&key.container)?.init.status == Status::Running;
        let process = self.process_mut(key)?;
        if process.status != Status::Created || process.starting {
            let what = if process.starting {
                "being started"
            } else {
                "already started"
            };
            return Err(StateError::FailedPrecondition(format!("{key} is {what}")));
        }
        if key.exec.is_some() && !init_running {
            return Err(StateError::FailedPrecondition(format!(
                "container {} is not running: cannot start {key}",
                key.container
            )));
        }
        process.starting = true;
        Ok(StartPlan {
            stdio: process.stdio.clone(),
            exec: process.exec.clone(),
            stdin_closed: process.stdin_closed,
        })
    }

    /// Records the backend's answer to a start: `Some(pid)`, the process runs (publishes
    /// `TaskStart` or `TaskExecStarted`); `None`, it stays `Created`.
    pub fn finish_start(&mut self, key: &ProcessKey, pid: Option<u32>) -> Result<(), StateError> {
        let process = self.process_mut(key)?;
        process.starting = false;
        let Some(pid) = pid else { return Ok(()) };
        process.status = Status::Running;
        process.pid = pid;
        let container_id = key.container.clone();
        self.events.publish(match &key.exec {
            None => TaskEvent::Start { container_id, pid },
            Some(exec_id) => TaskEvent::ExecStarted {
                container_id,
                exec_id: exec_id.clone(),
                pid,
            },
        });
        Ok(())
    }

    /// Records a process's exit: `Stopped` with `exit`, `TaskExit` published, waiters released.
    /// Returns the container's execs still running when the init process exited (their processes
    /// die with it; the backend should be told). Nothing happens for a process already stopped or
    /// gone.
    pub fn exited(&mut self, key: &ProcessKey, exit: Exit) -> Vec<ProcessKey> {
        let Ok(container) = self.container_mut(&key.container) else {
            return Vec::new();
        };
        let orphans = match key.exec {
            None => container
                .execs
                .iter()
                .filter(|(_, p)| p.status == Status::Running)
                .map(|(id, _)| ProcessKey::exec(&key.container, id))
                .collect(),
            Some(_) => Vec::new(),
        };
        let Ok(process) = self.process_mut(key) else {
            return Vec::new();
        };
        if process.status == Status::Stopped {
            return Vec::new();
        }
        process.status = Status::Stopped;
        process.starting = false;
        let pid = process.pid;
        self.events.publish(TaskEvent::Exit {
            container_id: key.container.clone(),
            id: key.event_id().to_owned(),
            pid,
            exit,
        });
        // Waiters are released after the event is queued, so whoever a waiter wakes sees
        // `TaskExit` before anything it does next.
        self.process_mut(key)
            .map(|p| p.exit.send_replace(Some(exit)))
            .ok();
        orphans
    }

    /// Decides what a `Kill` of `key` does. A created init process stops here, with status
    /// 128 + `signal` (it never ran); a created exec cannot be signalled; a stopped process is
    /// "not found", as containerd expects.
    pub fn kill(&mut self, key: &ProcessKey, signal: u32) -> Result<KillAction, StateError> {
        let process = self.process(key)?;
        match (process.status, process.starting, &key.exec) {
            (Status::Stopped, _, _) => Err(not_found(format!("{key}: process already finished"))),
            (Status::Created, true, _) => Err(StateError::FailedPrecondition(format!(
                "{key} is being started"
            ))),
            (Status::Created, false, Some(_)) => Err(StateError::FailedPrecondition(format!(
                "{key} is not started: nothing to signal"
            ))),
            (Status::Created, false, None) => {
                let exit = Exit {
                    status: 128 + signal,
                    at: SystemTime::now(),
                };
                self.exited(key, exit);
                Ok(KillAction::Stopped)
            }
            (Status::Running, _, _) => Ok(KillAction::Signal),
        }
    }

    /// Checks that `key` may be deleted (see [`Tasks::delete`]) without deleting it.
    pub fn check_delete(&self, key: &ProcessKey) -> Result<(), StateError> {
        let container = self.container(&key.container)?;
        let process = self.process(key)?;
        if process.status == Status::Running || process.starting {
            return Err(StateError::FailedPrecondition(format!(
                "{key} is running: kill it and wait for its exit before deleting it"
            )));
        }
        let running_exec = container
            .execs
            .iter()
            .find(|(_, p)| p.status == Status::Running);
        if let (None, Some((exec, _))) = (&key.exec, running_exec) {
            return Err(StateError::FailedPrecondition(format!(
                "{key} has a running exec ({exec}): it cannot be deleted yet"
            )));
        }
        Ok(())
    }

    /// Deletes a process that is not running: an exec, or the init process and with it the
    /// container and its remaining execs (publishes `TaskDelete`). A waiter on a deleted
    /// process that never stopped is released with an error.
    pub fn delete(&mut self, key: &ProcessKey) -> Result<Deleted, StateError> {
        self.check_delete(key)?;
        let container = self.container_mut(&key.container)?;
        let pod = container.pod.clone();
        let process = match &key.exec {
            Some(exec) => container.execs.remove(exec).ok_or_else(|| not_found(key))?,
            None => {
                self.containers
                    .remove(&key.container)
                    .ok_or_else(|| not_found(key))?
                    .init
            }
        };
        let exit = process.exit().unwrap_or(Exit {
            status: 0,
            at: SystemTime::now(),
        });
        if key.exec.is_none() {
            self.events.publish(TaskEvent::Delete {
                container_id: key.container.clone(),
                pid: process.pid,
                exit,
            });
        }
        Ok(Deleted {
            pid: process.pid,
            exit,
            pod,
        })
    }

    /// A process's state.
    pub fn state(&self, key: &ProcessKey) -> Result<ProcessState, StateError> {
        let container = self.container(&key.container)?;
        let process = self.process(key)?;
        Ok(ProcessState {
            key: key.clone(),
            bundle: container.bundle.clone(),
            pid: process.pid,
            status: process.status,
            stdio: process.stdio.clone(),
            exit: process.exit(),
        })
    }

    /// A receiver that holds the process's exit once it has stopped.
    pub fn waiter(&self, key: &ProcessKey) -> Result<watch::Receiver<Option<Exit>>, StateError> {
        Ok(self.process(key)?.exit.subscribe())
    }

    /// The pids of a container's processes that run, with their exec ids (`None`: init).
    pub fn pids(&self, container: &str) -> Result<Vec<(u32, Option<String>)>, StateError> {
        let container = self.container(container)?;
        let init = (container.init.status == Status::Running).then_some((container.init.pid, None));
        let execs = container
            .execs
            .iter()
            .filter(|(_, p)| p.status == Status::Running)
            .map(|(id, p)| (p.pid, Some(id.clone())));
        Ok(init.into_iter().chain(execs).collect())
    }

    /// Records that containerd closed a process's stdin. Returns whether the process runs (then
    /// the backend must close it); a created process starts with it closed.
    pub fn close_stdin(&mut self, key: &ProcessKey) -> Result<bool, StateError> {
        let process = self.process_mut(key)?;
        process.stdin_closed = true;
        Ok(process.status == Status::Running)
    }

    /// Checks that a process runs (for `ResizePty`).
    pub fn require_running(&self, key: &ProcessKey) -> Result<(), StateError> {
        match self.process(key)?.status {
            Status::Running => Ok(()),
            status => Err(StateError::FailedPrecondition(format!(
                "{key} is not running ({status:?})"
            ))),
        }
    }

    /// Checks that a container's init process has not stopped (for `Update`).
    pub fn require_live(&self, container: &str) -> Result<(), StateError> {
        match self.container(container)?.init.status {
            Status::Stopped => Err(StateError::FailedPrecondition(format!(
                "container {container} has stopped"
            ))),
            _ => Ok(()),
        }
    }

    /// Publishes `TaskOOM` for a container.
    pub fn oom(&self, container: &str) -> Result<(), StateError> {
        self.container(container)?;
        self.events.publish(TaskEvent::Oom {
            container_id: container.to_owned(),
        });
        Ok(())
    }

    /// The init process's pid of a container, if it exists.
    pub fn init_pid(&self, container: &str) -> Option<u32> {
        self.container(container).ok().map(|c| c.init.pid)
    }
}
