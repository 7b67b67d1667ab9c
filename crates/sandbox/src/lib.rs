//! The host side of a bulkhead sandbox.
//!
//! A [`Sandbox`] is one microVM in its own `bulkhead-vmm` process, with the guest agent reachable
//! over virtio-vsock (Firecracker's hybrid Unix-socket protocol). Starting one:
//!
//! 1. creates a private runtime directory holding the VM's configuration, its vsock socket
//!    (`vm.sock`) and the VMM's log;
//! 2. binds the readiness listener `vm.sock_1025` *before* the VM starts, so the agent's
//!    announcement (a guest connection to CID 2, port [`READY_PORT`]) cannot be missed;
//! 3. spawns `bulkhead-vmm --config vm.json` — as root, jailed ([`jail`]: own namespaces, a
//!    private root, an unprivileged uid/gid, no capabilities);
//! 4. waits, without polling, until either the agent announces itself or the VMM exits
//!    (`poll(2)` on the listener and a pidfd of the VMM process).
//!
//! A sandbox may get a host project directory at `/workspace` ([`workspace`]): shared
//! read-write (direct), or read-only under a private overlay (clone) whose changes
//! [`Sandbox::workspace_diff`] lists and [`Sandbox::export_workspace`] writes as a git patch or
//! a tar archive, with the paths that run code on the host implicitly flagged for review.
//!
//! [`Sandbox::timings`] places every phase of the cold start — VMM start, VM created, guest
//! memory ready, kernel entry, guest init, agent ready, first output, VM destroyed — on one
//! timeline ([`phases`]).
//!
//! Commands then run through [`Sandbox::exec`]; [`Sandbox::destroy`] (or dropping the sandbox)
//! stops the VMM with SIGTERM, escalates to SIGKILL after a grace period, and removes the runtime
//! directory.
//!
//! [`READY_PORT`]: bulkhead_protocol::READY_PORT
#![deny(missing_docs)]

pub mod cgroup;
pub mod egress;
pub mod host_tuning;
pub mod ingress;
pub mod jail;
pub mod mounts;
pub mod paths;
pub mod phases;
mod process;
mod sandbox;
mod sandbox_config;
pub mod snapshot;
pub mod spec;
pub mod storage;
mod vmm_log;
mod vmm_process;
pub mod workspace;

pub use jail::JailError;
pub use mounts::{Mount, MountError};
pub use phases::{PhaseClock, Phases, Timings, PHASE_NAMES};
pub use sandbox::{Error, Sandbox, SandboxConfig, SandboxState, EXIT_FILE};
pub use spec::{
    build, ExecDefaults, FileRef, HostSettings, Recipe, ResourceLimits, SandboxSpec, SpecError,
};
pub use storage::{Storage, StorageError};
pub use vmm_process::{start_time_of, VmEnd, VmmExit};
pub use workspace::{
    ExportFormat, Workspace, WorkspaceDiff, WorkspaceError, WorkspaceInfo, WorkspaceMode,
};

/// Helpers shared by this crate's unit tests.
#[cfg(test)]
mod testing {
    /// Fails the calling test unless it runs as root (chown, root-owned directories).
    pub fn require_root() {
        // SAFETY: geteuid only reads the calling thread's credentials.
        let root = unsafe { libc::geteuid() } == 0;
        assert!(root, "this test needs root (its name ends in _needs_root; scripts/test.sh skips those when not root)");
    }
}
