//! VM snapshots: pause a running VM, save everything that makes it that VM, and restore it as a
//! new VMM process, or as many.
//!
//! A snapshot is a directory with two files:
//! - `state` ([`format`]): a header, then [`VmSnapshot`] as JSON: the configuration it was built
//!   from, each vCPU's registers, the VM's interrupt controllers and clocks, each virtio-mmio
//!   transport with its device's queue positions, the legacy devices.
//! - `memory` ([`memory`]): the guest RAM, zero pages left as holes; a restore maps it
//!   copy-on-write, so clones of one snapshot share its page cache.
//!
//! Saving ([`save`]) runs on the event-loop thread: the vCPUs are paused first (each leaves
//! KVM_RUN with its I/O completed, see [`crate::vstate::vcpu`]), so neither the guest nor a
//! device handler changes anything while the state is read. Restoring ([`restore`]) builds the
//! VM as a boot does (same devices in the same slots, wired the same way), then puts the saved
//! state into it instead of loading a kernel, in the order KVM needs (see the architecture's
//! `persist` module: `crate::arch::x86_64::persist`; on aarch64 `crate::arch::aarch64::persist`
//! and `crate::arch::aarch64::gic_persist`).
//!
//! What does not survive a snapshot: host-side vsock connections (the guest gets a transport
//! reset and its connected sockets are closed; listeners stay), an open virtio-fs session (a VM
//! is snapshotted with its shares unmounted, and gets its shares on restore).

pub mod format;
mod legacy;
pub mod memory;
mod restore;
mod save;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::config::VmConfig;
use crate::devices::virtio::mmio::persist::MmioTransportState;

pub(crate) use legacy::LegacyHandles;
pub use legacy::LegacyState;
pub use restore::{load, restore, restore_with_kvm, LoadedSnapshot, RestoreConfig};
pub(crate) use save::{pause_vcpus, resume_vcpus, save, SaveSources};
pub use save::{SnapshotRequest, MEMORY_FILE, STATE_FILE, VCPU_ANSWER_TIMEOUT};

/// Errors taking or restoring a snapshot.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The state file could not be written or read back.
    #[error(transparent)]
    Format(#[from] format::Error),
    /// Guest memory could not be saved or mapped.
    #[error(transparent)]
    Memory(#[from] memory::Error),
    /// A vCPU could not be paused, saved or resumed.
    #[error("vCPU: {0}")]
    Vcpu(String),
    /// The VM-level state (interrupt controllers, clocks) could not be saved or restored.
    #[error("VM state: {0}")]
    VmState(String),
    /// A device cannot be saved or restored.
    #[error("device {index}: {reason}")]
    Device {
        /// The device's index in registration order.
        index: usize,
        /// Why.
        reason: String,
    },
    /// The snapshot directory could not be created.
    #[error("snapshot directory {path}: {source}")]
    Dir {
        /// The directory.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The snapshot does not fit what the restore asks for.
    #[error("cannot restore: {0}")]
    Mismatch(String),
    /// The restored VM could not be built.
    #[error(transparent)]
    Build(#[from] Box<crate::builder::Error>),
    /// This architecture cannot take snapshots yet.
    #[error("snapshots are not supported on {} yet", std::env::consts::ARCH)]
    Unsupported,
}

/// One vCPU's saved state (x86_64: see [`crate::arch::x86_64::persist::VcpuState`]).
#[cfg(target_arch = "x86_64")]
pub use crate::arch::x86_64::persist::VcpuState;
/// The VM-level saved state (x86_64: PIC, IOAPIC, PIT, kvmclock).
#[cfg(target_arch = "x86_64")]
pub use crate::arch::x86_64::persist::VmState;

/// The VM-level saved state (aarch64: the GICv3, see
/// [`crate::arch::aarch64::gic_persist::GicState`]).
#[cfg(target_arch = "aarch64")]
pub use crate::arch::aarch64::gic_persist::GicState as VmState;
/// One vCPU's saved state (aarch64: see [`crate::arch::aarch64::persist::VcpuState`]).
#[cfg(target_arch = "aarch64")]
pub use crate::arch::aarch64::persist::VcpuState;

/// One vCPU's saved state: none on this architecture (no value exists).
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum VcpuState {}

/// The VM-level saved state: none on this architecture (no value exists).
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum VmState {}

/// Everything in a snapshot's `state` file.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmSnapshot {
    /// The configuration the VM was built from (paths as the VMM saw them).
    pub config: VmConfig,
    /// Each vCPU's state, by index.
    pub vcpus: Vec<VcpuState>,
    /// Interrupt controllers and clocks.
    pub vm: VmState,
    /// Each virtio-mmio transport and its device, in registration order.
    pub devices: Vec<MmioTransportState>,
    /// The legacy devices (serial console, i8042).
    pub legacy: legacy::LegacyState,
    /// Where each guest RAM region is in the `memory` file.
    pub memory: Vec<memory::RegionState>,
}

/// Saves one vCPU's state; called on the vCPU's own thread while it is paused.
///
/// # Errors
/// The architecture's error, as text (it crosses the vCPU thread's channel).
#[cfg(target_arch = "x86_64")]
pub(crate) fn save_vcpu(fd: &kvm_ioctls::VcpuFd, msrs: &[u32]) -> Result<VcpuState, String> {
    crate::arch::x86_64::persist::save_vcpu(fd, msrs).map_err(|e| e.to_string())
}

/// Saves one vCPU's state (aarch64: no MSRs; every register KVM lists); called on the vCPU's
/// own thread while it is paused.
///
/// # Errors
/// The architecture's error, as text.
#[cfg(target_arch = "aarch64")]
pub(crate) fn save_vcpu(fd: &kvm_ioctls::VcpuFd, _msrs: &[u32]) -> Result<VcpuState, String> {
    crate::arch::aarch64::persist::save_vcpu(fd).map_err(|e| e.to_string())
}

/// Saves one vCPU's state: not supported on this architecture.
///
/// # Errors
/// Always.
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
pub(crate) fn save_vcpu(_fd: &kvm_ioctls::VcpuFd, _msrs: &[u32]) -> Result<VcpuState, String> {
    Err(Error::Unsupported.to_string())
}

/// The virtio-fs tags of the snapshot in `dir`, in device order: a restore gives each of them a
/// host directory ([`RestoreConfig::shares`]).
///
/// # Errors
/// [`Error::Format`] for a missing, truncated, corrupt or foreign state file.
pub fn share_tags(dir: &std::path::Path) -> Result<Vec<String>, Error> {
    Ok(saved_config(dir)?
        .shares
        .into_iter()
        .map(|s| s.tag)
        .collect())
}

/// The virtio-blk disks of the snapshot in `dir`, in device order, as its VM had them: a
/// restore opens each again at its path, with its mode.
///
/// # Errors
/// [`Error::Format`] for a missing, truncated, corrupt or foreign state file.
pub fn disks(dir: &std::path::Path) -> Result<Vec<crate::config::DiskConfig>, Error> {
    Ok(saved_config(dir)?.disks)
}

/// The VM configuration saved in the snapshot in `dir`.
fn saved_config(dir: &std::path::Path) -> Result<VmConfig, Error> {
    /// The part of [`VmSnapshot`] this reads.
    #[derive(Deserialize)]
    struct Saved {
        config: VmConfig,
    }
    let saved: Saved = format::read_file(&dir.join(STATE_FILE))?;
    Ok(saved.config)
}
