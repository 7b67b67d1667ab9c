//! Taking a snapshot of a running VM (on the event-loop thread).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use std::os::unix::fs::DirBuilderExt;

use serde::{Deserialize, Serialize};
use vm_memory::GuestMemoryMmap;

use super::{format, memory, Error, VcpuState, VmSnapshot};
use crate::config::VmConfig;
use crate::devices::virtio::mmio::MmioTransport;
use crate::vstate::vcpu::{VcpuHandle, VcpuRequest, VcpuResponse};
use crate::vstate::vm::Vm;

/// Name of the state file in a snapshot directory.
pub const STATE_FILE: &str = "state";
/// Name of the guest memory file in a snapshot directory.
pub const MEMORY_FILE: &str = "memory";

/// How long a vCPU may take to answer a pause or save request. A vCPU answers as soon as its
/// thread is out of KVM_RUN, which a kick forces within microseconds; only a wedged host misses
/// this.
pub const VCPU_ANSWER_TIMEOUT: Duration = Duration::from_secs(5);

/// A request to snapshot a running VM (see `bulkhead-vmm --api-sock`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotRequest {
    /// Directory to write `state` and `memory` into (created if missing; existing snapshot
    /// files in it are replaced).
    pub dir: PathBuf,
    /// Keep the VM running afterwards (default: the VM stops once the snapshot is written, as
    /// for a template or a pause).
    #[serde(default)]
    pub resume: bool,
}

/// What a snapshot is taken from: the parts of a running VMM.
pub(crate) struct SaveSources<'a> {
    pub(crate) vcpus: &'a [VcpuHandle],
    pub(crate) msrs: &'a Arc<Vec<u32>>,
    pub(crate) vm: &'a Vm,
    pub(crate) mem: &'a GuestMemoryMmap,
    pub(crate) transports: &'a [Arc<Mutex<MmioTransport>>],
    pub(crate) legacy: &'a super::legacy::LegacyHandles,
    pub(crate) config: &'a VmConfig,
}

/// Pauses every vCPU: each has left KVM_RUN with its I/O exits completed when this returns.
///
/// # Errors
/// [`Error::Vcpu`] when a vCPU does not pause (the ones that did are resumed first).
pub(crate) fn pause_vcpus(vcpus: &[VcpuHandle]) -> Result<(), Error> {
    let mut paused = 0;
    let result = vcpus.iter().try_for_each(|vcpu| {
        vcpu.send(VcpuRequest::Pause).map_err(vcpu_err)?;
        match vcpu.recv(VCPU_ANSWER_TIMEOUT).map_err(vcpu_err)? {
            VcpuResponse::Paused => {
                paused += 1;
                Ok(())
            }
            other => Err(Error::Vcpu(format!(
                "vCPU {} answered {other:?} to a pause",
                vcpu.id()
            ))),
        }
    });
    if result.is_err() {
        // Best effort: the VM is being torn down or continues on the vCPUs that answered.
        let _ = resume_vcpus(&vcpus[..paused]);
    }
    result
}

/// Resumes every vCPU.
///
/// # Errors
/// [`Error::Vcpu`] naming the first vCPU that did not resume.
pub(crate) fn resume_vcpus(vcpus: &[VcpuHandle]) -> Result<(), Error> {
    for vcpu in vcpus {
        vcpu.send(VcpuRequest::Resume).map_err(vcpu_err)?;
        match vcpu.recv(VCPU_ANSWER_TIMEOUT).map_err(vcpu_err)? {
            VcpuResponse::Resumed => {}
            other => {
                return Err(Error::Vcpu(format!(
                    "vCPU {} answered {other:?} to a resume",
                    vcpu.id()
                )))
            }
        }
    }
    Ok(())
}

fn vcpu_err(e: crate::vstate::vcpu::Error) -> Error {
    Error::Vcpu(e.to_string())
}

/// Writes a snapshot of the paused VM into `dir` (created mode 0700 if missing; the files are
/// mode 0600): memory first, then the state file, written
/// under a temporary name and renamed, so a `state` file only ever names a complete snapshot.
///
/// # Errors
/// [`Error::Dir`], [`Error::Device`] (a device that cannot be saved now, e.g. a mounted
/// virtio-fs share), [`Error::Vcpu`], [`Error::VmState`], [`Error::Memory`], [`Error::Format`].
pub(crate) fn save(sources: &SaveSources<'_>, dir: &Path) -> Result<(), Error> {
    let devices = save_devices(sources.transports)?;
    let vcpus = save_vcpus(sources.vcpus, sources.msrs)?;
    // The VM after the vCPUs: on aarch64 the GIC's per-vCPU registers are named by the MPIDRs
    // the vCPUs' states hold, and the GIC flushes its pending tables to guest RAM, saved next.
    let vm = save_vm(sources.vm, &vcpus)?;
    let legacy = sources.legacy.save();
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|source| Error::Dir {
            path: dir.to_owned(),
            source,
        })?;
    let memory = memory::save(sources.mem, &dir.join(MEMORY_FILE))?;
    let mut config = sources.config.clone();
    // save_devices made every copy-on-write disk whole: the snapshot needs only its overlay.
    for disk in &mut config.disks {
        disk.backing = None;
    }
    let snapshot = VmSnapshot {
        config,
        vcpus,
        vm,
        devices,
        legacy,
        memory,
    };
    let partial = dir.join(format!("{STATE_FILE}.partial"));
    format::write_file(&partial, &snapshot)?;
    std::fs::rename(&partial, dir.join(STATE_FILE)).map_err(|source| Error::Dir {
        path: dir.to_owned(),
        source,
    })
}

/// Every device's state; first asks each whether it can be saved now, so that none does work
/// for a snapshot (a copy-on-write disk's copy) that another device then refuses.
fn save_devices(
    transports: &[Arc<Mutex<MmioTransport>>],
) -> Result<Vec<crate::devices::virtio::mmio::persist::MmioTransportState>, Error> {
    fn lock(t: &Mutex<MmioTransport>) -> std::sync::MutexGuard<'_, MmioTransport> {
        t.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn device_error(index: usize, e: crate::devices::virtio::mmio::Error) -> Error {
        Error::Device {
            index,
            reason: e.to_string(),
        }
    }
    for (index, t) in transports.iter().enumerate() {
        lock(t)
            .check_snapshot()
            .map_err(|e| device_error(index, e))?;
    }
    transports
        .iter()
        .enumerate()
        .map(|(index, t)| lock(t).save().map_err(|e| device_error(index, e)))
        .collect()
}

fn save_vcpus(vcpus: &[VcpuHandle], msrs: &Arc<Vec<u32>>) -> Result<Vec<VcpuState>, Error> {
    vcpus
        .iter()
        .map(|vcpu| {
            vcpu.send(VcpuRequest::SaveState(Arc::clone(msrs)))
                .map_err(vcpu_err)?;
            match vcpu.recv(VCPU_ANSWER_TIMEOUT).map_err(vcpu_err)? {
                VcpuResponse::State(state) => Ok(*state),
                VcpuResponse::Failed(reason) => Err(Error::Vcpu(reason)),
                other => Err(Error::Vcpu(format!(
                    "vCPU {} answered {other:?} to a save",
                    vcpu.id()
                ))),
            }
        })
        .collect()
}

#[cfg(target_arch = "x86_64")]
fn save_vm(vm: &Vm, _vcpus: &[VcpuState]) -> Result<super::VmState, Error> {
    crate::arch::x86_64::persist::save_vm(vm.fd()).map_err(|e| Error::VmState(e.to_string()))
}

#[cfg(target_arch = "aarch64")]
fn save_vm(vm: &Vm, vcpus: &[VcpuState]) -> Result<super::VmState, Error> {
    use crate::arch::aarch64::gic_persist::{self, save_gic};
    let gic = vm
        .irqchip()
        .ok_or_else(|| Error::VmState(gic_persist::Error::NoDevice.to_string()))?;
    let mpidrs: Vec<u64> = vcpus.iter().map(|v| v.mpidr).collect();
    save_gic(gic, &mpidrs).map_err(|e| Error::VmState(e.to_string()))
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn save_vm(_vm: &Vm, _vcpus: &[VcpuState]) -> Result<super::VmState, Error> {
    Err(Error::Unsupported)
}
