//! The task events the shim publishes to containerd, as plain Rust values, and the sink they go
//! to.
//!
//! containerd learns of task transitions only through these events (`ctr events` shows them; the
//! CRI plugin waits for `/tasks/exit`), so they must arrive in the order the transitions happened.
//! The state machine publishes them while it holds its lock, and [`EventSink::publish`] is
//! synchronous: the sink only queues the event, so its order is the transitions' order.

use crate::state::{Exit, Stdio};

/// A root file-system mount containerd passes with `Create` (usually one overlay mount).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Mount {
    /// The mount type (`overlay`, `bind`, ...).
    pub kind: String,
    /// The mount source.
    pub source: String,
    /// Where it is mounted, relative to the rootfs (empty for the root itself).
    pub target: String,
    /// Mount options (`lowerdir=...`, `ro`, ...).
    pub options: Vec<String>,
}

/// One event for containerd, named after the topic it is published on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TaskEvent {
    /// `/tasks/create`: a container was created (its init process has not started).
    Create {
        /// The container.
        container_id: String,
        /// Its OCI bundle directory.
        bundle: String,
        /// Its root file-system mounts.
        rootfs: Vec<Mount>,
        /// The init process's stdio.
        stdio: Stdio,
        /// The pid `Create` returned.
        pid: u32,
    },
    /// `/tasks/start`: the init process started.
    Start {
        /// The container.
        container_id: String,
        /// The init process's pid.
        pid: u32,
    },
    /// `/tasks/exec-added`: an exec process was added (not started).
    ExecAdded {
        /// The container.
        container_id: String,
        /// The exec id.
        exec_id: String,
    },
    /// `/tasks/exec-started`: an exec process started.
    ExecStarted {
        /// The container.
        container_id: String,
        /// The exec id.
        exec_id: String,
        /// Its pid.
        pid: u32,
    },
    /// `/tasks/exit`: a process exited.
    Exit {
        /// The container.
        container_id: String,
        /// The process: the exec id, or the container id for the init process.
        id: String,
        /// Its pid.
        pid: u32,
        /// Its exit status and time.
        exit: Exit,
    },
    /// `/tasks/delete`: a container (its init process) was deleted.
    Delete {
        /// The container.
        container_id: String,
        /// The init process's pid.
        pid: u32,
        /// The init process's exit status and time.
        exit: Exit,
    },
    /// `/tasks/oom`: the container ran out of memory.
    Oom {
        /// The container.
        container_id: String,
    },
}

impl TaskEvent {
    /// The containerd topic the event is published on.
    pub fn topic(&self) -> &'static str {
        match self {
            TaskEvent::Create { .. } => "/tasks/create",
            TaskEvent::Start { .. } => "/tasks/start",
            TaskEvent::ExecAdded { .. } => "/tasks/exec-added",
            TaskEvent::ExecStarted { .. } => "/tasks/exec-started",
            TaskEvent::Exit { .. } => "/tasks/exit",
            TaskEvent::Delete { .. } => "/tasks/delete",
            TaskEvent::Oom { .. } => "/tasks/oom",
        }
    }
}

/// Where events go. `publish` must not block: it queues the event (the ttRPC sink forwards its
/// queue to containerd on a task of its own) so that the state machine can call it under its lock.
pub trait EventSink: Send + Sync {
    /// Queues one event.
    fn publish(&self, event: TaskEvent);
}
