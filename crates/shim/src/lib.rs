//! `containerd-shim-bulkhead-v2`: the containerd shim v2 that runs containers in bulkhead
//! microVMs (runtime name [`RUNTIME_NAME`], `io.containerd.bulkhead.v2`).
//!
//! containerd starts one shim process per *group* of tasks and speaks the ttRPC task API v2 to
//! it (Create, Start, State, Wait, Kill, Delete, Exec, ...). bulkhead groups by pod: every
//! container whose OCI annotations name the same `io.kubernetes.cri.sandbox-id` shares one shim
//! and one microVM, and a plain `ctr run` task is a pod of its own ([`pod_id`]).
//!
//! The crate is in three layers, so that the part with the rules can be tested without
//! containerd, ttRPC or a VM:
//!
//! 1. [`state`]: the task-state machine — containers, their init process and exec processes,
//!    statuses (created, running, stopped), exit statuses and times, waiters — and the events
//!    each transition publishes, in transition order, to an [`EventSink`]. Synchronous, pure Rust.
//! 2. [`service`]: [`TaskService`], which checks a request against the state machine, asks the
//!    [`Backend`] (the microVM side: create a container, start a process, signal it, resize its
//!    terminal, close its stdin, report its exit and whether it was OOM-killed, update its
//!    limits, stats) to do the work, and records the outcome.
//! 3. [`ttrpc`]: the thin adapter from containerd's protobuf requests to the service and from its
//!    errors to the ttRPC status codes containerd expects; [`shim`]: the `start`/`delete`
//!    subcommands and the process's main loop (the `containerd-shim` crate's async `Shim`).
//!
//! The binary's backend is [`vm::VmBackend`]: one bulkhead sandbox per pod, the OCI process run
//! by the guest agent as a container exec ([`oci`]) in the rootfs containerd prepared
//! ([`rootfs`]), shared into the guest; what it does not do yet is listed there and in
//! `docs/kubernetes.md`.
#![deny(missing_docs)]

pub mod backend;
pub mod events;
pub mod network;
pub mod oci;
pub mod pod_cgroup;
pub mod pod_roots;
pub mod ports;
pub mod rootfs;
pub mod service;
pub mod shim;
pub mod state;
pub mod ttrpc;
pub mod update;
pub mod vm;

#[cfg(test)]
mod tests;

pub use backend::{Backend, BackendError};
pub use events::{EventSink, TaskEvent};
pub use service::{ServiceError, TaskService};
pub use state::{Exit, ProcessKey, StateError, Status, Tasks};

/// The runtime name containerd knows this shim by (`--runtime io.containerd.bulkhead.v2`,
/// `runtime_type` in containerd's configuration); containerd derives the binary's name,
/// `containerd-shim-bulkhead-v2`, from it.
pub const RUNTIME_NAME: &str = "io.containerd.bulkhead.v2";

/// The OCI annotation the CRI plugin puts on every container of a pod, naming the pod sandbox.
pub const SANDBOX_ID_ANNOTATION: &str = "io.kubernetes.cri.sandbox-id";

/// The kind of failure an error is, as containerd classifies them (its `errdefs`); the ttRPC
/// adapter turns each into the matching status code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// No such container or process.
    NotFound,
    /// A container or exec id that is already taken.
    AlreadyExists,
    /// The request is valid but not in the process's current state (delete a running task,
    /// start a stopped one).
    FailedPrecondition,
    /// The request itself is malformed (empty id, bad spec).
    InvalidArgument,
    /// Something bulkhead does not do (yet).
    Unimplemented,
    /// The backend failed (the VM did not boot, the agent went away).
    Internal,
}

/// The pod a container belongs to: its `io.kubernetes.cri.sandbox-id` annotation when the CRI
/// plugin set one, else the container itself (a plain `ctr run` task is a pod of its own).
pub fn pod_id<'a>(
    container_id: &'a str,
    annotations: &'a std::collections::HashMap<String, String>,
) -> &'a str {
    match annotations.get(SANDBOX_ID_ANNOTATION) {
        Some(sandbox) if !sandbox.is_empty() => sandbox,
        _ => container_id,
    }
}
