//! Restoring a VM from a snapshot directory into a new [`Vmm`].

use std::path::{Path, PathBuf};
use std::time::Instant;

use super::{format, memory, Error, VmSnapshot, MEMORY_FILE, STATE_FILE};
use crate::arch;
use crate::builder::{self, VmParts};
use crate::config::{DiskConfig, SerialOutput, ShareConfig, VmConfig};
use crate::vmm::{BootTimeline, Vmm};
use crate::vstate::kvm::{KvmContext, KVM_PATH};
use crate::vstate::vm::Vm;

/// What a restore takes from its caller rather than from the snapshot: the host-side ends of
/// the VM, which belong to the new VMM process.
#[derive(Debug, Clone, Default)]
pub struct RestoreConfig {
    /// The snapshot directory (`state` and `memory`).
    pub dir: PathBuf,
    /// The vsock device's host socket; required when the snapshot has a vsock device.
    pub vsock_uds: Option<PathBuf>,
    /// The serial console's output.
    pub serial: SerialOutput,
    /// The debug port's output file.
    pub debugcon: Option<PathBuf>,
    /// The host directory of each virtio-fs share of the snapshot, by tag (every saved tag,
    /// no others).
    pub shares: Vec<ShareConfig>,
    /// The file of each saved virtio-blk disk, in device order, where the restore opens it
    /// instead of the saved path (e.g. a copy of a writable disk, so that every restore writes
    /// its own); each read-only exactly where the saved one was. Empty: the saved paths.
    pub disks: Vec<DiskConfig>,
    /// Guest RAM the caller expects, MiB; a snapshot of another size is refused.
    pub memory_mib: Option<u32>,
    /// vCPUs the caller expects; a snapshot with another count is refused.
    pub vcpus: Option<u8>,
}

/// Restores the snapshot in `config.dir` using `/dev/kvm`.
///
/// # Errors
/// As [`restore_with_kvm`].
pub fn restore(config: &RestoreConfig) -> Result<Vmm, Error> {
    restore_with_kvm(config, Path::new(KVM_PATH))
}

/// Restores the snapshot in `config.dir` with the KVM device node at `kvm_path`: checks the
/// state file (format, version, architecture, digest) and that this host's CPU offers what the
/// saved CPUID advertises, maps the memory file copy-on-write, builds the VM's devices as a boot
/// would, then puts the saved state into KVM and the devices. The returned VM resumes where the
/// snapshot paused it once [`Vmm::run`] starts it.
///
/// # Errors
/// [`Error::Format`] (missing, truncated, corrupt or foreign state file), [`Error::Mismatch`]
/// (the restore asks for something the snapshot is not), [`Error::Memory`], [`Error::VmState`],
/// [`Error::Device`], [`Error::Build`]. Nothing is left running and no file is created when it
/// fails, except the vsock socket's which the failed build removes.
pub fn restore_with_kvm(config: &RestoreConfig, kvm_path: &Path) -> Result<Vmm, Error> {
    load(config)?.restore_with_kvm(kvm_path)
}

/// A snapshot's state file read and checked against its [`RestoreConfig`], not yet restored: a
/// jailed VMM plans its jail from it ([`LoadedSnapshot::jail_config`]), then restores it, and
/// reads (and digests, and parses) the state file once.
#[derive(Debug)]
pub struct LoadedSnapshot {
    config: RestoreConfig,
    snapshot: VmSnapshot,
    vm_config: VmConfig,
}

/// Reads and checks the state file in `config.dir` (format, version, architecture, digest) and
/// merges the saved configuration with `config`'s host-side paths.
///
/// # Errors
/// [`Error::Format`] for a missing, truncated, corrupt or foreign state file,
/// [`Error::Mismatch`].
pub fn load(config: &RestoreConfig) -> Result<LoadedSnapshot, Error> {
    let snapshot: VmSnapshot = format::read_file(&config.dir.join(STATE_FILE))?;
    let vm_config = merge_config(&snapshot, config)?;
    Ok(LoadedSnapshot {
        config: config.clone(),
        snapshot,
        vm_config,
    })
}

impl LoadedSnapshot {
    /// The configuration a jail's mount plan is made from (`crate::jail::MountPlan::for_vm`):
    /// the saved configuration with the caller's host-side paths, and the snapshot's `state`
    /// and `memory` files as its kernel and initramfs, the files a restore reads (read-only) in
    /// their place.
    pub fn jail_config(&self) -> VmConfig {
        let mut merged = self.vm_config.clone();
        merged.kernel = self.config.dir.join(STATE_FILE);
        merged.initrd = Some(self.config.dir.join(MEMORY_FILE));
        merged
    }

    /// The snapshot directory.
    pub fn dir(&self) -> &Path {
        &self.config.dir
    }

    /// [`restore_with_kvm`] of this snapshot.
    ///
    /// # Errors
    /// As [`restore_with_kvm`].
    pub fn restore_with_kvm(self, kvm_path: &Path) -> Result<Vmm, Error> {
        restore_loaded(self, kvm_path)
    }
}

fn restore_loaded(loaded: LoadedSnapshot, kvm_path: &Path) -> Result<Vmm, Error> {
    let mut timeline = BootTimeline {
        build_started: Some(Instant::now()),
        ..Default::default()
    };
    let LoadedSnapshot {
        config,
        snapshot,
        vm_config,
    } = loaded;
    let config = &config;
    check_counts(&snapshot, &vm_config)?;
    let kvm = KvmContext::open(kvm_path).map_err(|e| build_err(e.into()))?;
    check_vcpu_limit(&kvm, &snapshot)?;
    check_host(&kvm, &snapshot)?;
    let mem = memory::map_private(
        &config.dir.join(MEMORY_FILE),
        &snapshot.memory,
        arch::arch_memory_regions,
    )?;
    let total: u64 = snapshot.memory.iter().map(|r| r.size).sum();
    if total != u64::from(vm_config.memory_mib) << 20 {
        return Err(Error::Mismatch(format!(
            "the memory file holds {} MiB, the saved configuration says {} MiB",
            total >> 20,
            vm_config.memory_mib
        )));
    }
    let vm = Vm::new(&kvm, &mem).map_err(|e| build_err(e.into()))?;
    restore_vm_state_early(&vm, &snapshot)?;
    timeline.vm_created = Some(Instant::now());
    let mut parts = VmParts::new(&vm_config, kvm, vm, mem, timeline).map_err(build_err)?;
    restore_devices(&parts, &snapshot)?;
    restore_vcpus(&parts, &snapshot)?;
    restore_vm_state_late(&parts.vm, &snapshot)?;
    parts.timeline.payload_loaded = Some(Instant::now());
    let vmm = parts.finish(true).map_err(build_err)?;
    vmm.persist
        .legacy
        .restore(&snapshot.legacy)
        .map_err(|reason| Error::Device {
            index: usize::MAX,
            reason,
        })?;
    Ok(vmm)
}

fn build_err(e: builder::Error) -> Error {
    Error::Build(Box::new(e))
}

/// The saved configuration with the caller's host-side paths.
fn merge_config(snapshot: &VmSnapshot, config: &RestoreConfig) -> Result<VmConfig, Error> {
    let mut merged = snapshot.config.clone();
    merged.serial = config.serial.clone();
    merged.debugcon = config.debugcon.clone();
    if let Some(mib) = config.memory_mib.filter(|&m| m != merged.memory_mib) {
        return Err(Error::Mismatch(format!(
            "the snapshot has {} MiB of guest memory, not {mib} MiB; a restore cannot change it",
            merged.memory_mib
        )));
    }
    if let Some(n) = config.vcpus.filter(|&n| n != merged.vcpus) {
        return Err(Error::Mismatch(format!(
            "the snapshot has {} vCPUs, not {n}; a restore cannot change them",
            merged.vcpus
        )));
    }
    match (&mut merged.vsock, &config.vsock_uds) {
        (Some(vsock), Some(path)) => vsock.uds_path = path.clone(),
        (None, None) => {}
        (Some(_), None) => {
            return Err(Error::Mismatch(
                "the snapshot has a vsock device: give its host socket path".into(),
            ))
        }
        (None, Some(_)) => {
            return Err(Error::Mismatch(
                "the snapshot has no vsock device; a restore cannot add one".into(),
            ))
        }
    }
    merged.shares = merge_shares(&snapshot.config.shares, &config.shares)?;
    if !config.disks.is_empty() {
        merged.disks = merge_disks(&snapshot.config.disks, &config.disks)?;
    }
    merged.validate().map_err(|e| build_err(e.into()))?;
    Ok(merged)
}

/// The saved shares in their saved order, each with the caller's directory.
fn merge_shares(saved: &[ShareConfig], given: &[ShareConfig]) -> Result<Vec<ShareConfig>, Error> {
    fn tags(shares: &[ShareConfig]) -> Vec<&str> {
        let mut t: Vec<&str> = shares.iter().map(|s| s.tag.as_str()).collect();
        t.sort_unstable();
        t
    }
    if tags(saved) != tags(given) {
        return Err(Error::Mismatch(format!(
            "the snapshot's virtio-fs tags are {:?}; the restore gives {:?} (every tag needs a \
             directory, and no new device can be added)",
            tags(saved),
            tags(given)
        )));
    }
    Ok(saved
        .iter()
        .filter_map(|s| given.iter().find(|g| g.tag == s.tag).cloned())
        .collect())
}

/// The saved disks, each at the caller's path: as many as saved, read-only where saved so (the
/// guest's driver negotiated `VIRTIO_BLK_F_RO` or not; virtio 1.2 §5.2.3).
fn merge_disks(saved: &[DiskConfig], given: &[DiskConfig]) -> Result<Vec<DiskConfig>, Error> {
    if saved.len() != given.len() {
        return Err(Error::Mismatch(format!(
            "the snapshot has {} disks; the restore gives {} (give one file per saved disk, in \
             order, or none)",
            saved.len(),
            given.len()
        )));
    }
    saved
        .iter()
        .zip(given)
        .enumerate()
        .map(|(index, (saved, given))| {
            if saved.read_only != given.read_only {
                let mode = |ro: bool| if ro { "read-only" } else { "writable" };
                return Err(Error::Mismatch(format!(
                    "the snapshot's disk {index} ({}) is {}; the restore gives {} as {}",
                    saved.path.display(),
                    mode(saved.read_only),
                    given.path.display(),
                    mode(given.read_only)
                )));
            }
            Ok(DiskConfig {
                path: given.path.clone(),
                backing: given.backing.clone(),
                ..saved.clone()
            })
        })
        .collect()
}

/// The state lists as many vCPUs and devices as the configuration builds.
fn check_counts(snapshot: &VmSnapshot, config: &VmConfig) -> Result<(), Error> {
    if snapshot.vcpus.len() != usize::from(config.vcpus) {
        return Err(Error::Mismatch(format!(
            "the state has {} vCPUs, its configuration {}",
            snapshot.vcpus.len(),
            config.vcpus
        )));
    }
    let devices = usize::from(config.vsock.is_some()) + config.disks.len() + config.shares.len();
    if snapshot.devices.len() != devices {
        return Err(Error::Mismatch(format!(
            "the state has {} virtio devices, its configuration {devices}",
            snapshot.devices.len()
        )));
    }
    Ok(())
}

/// The snapshot's vCPU count fits this host's KVM.
fn check_vcpu_limit(kvm: &KvmContext, snapshot: &VmSnapshot) -> Result<(), Error> {
    if usize::from(snapshot.config.vcpus) > kvm.max_vcpus() {
        return Err(Error::Mismatch(format!(
            "the snapshot has {} vCPUs; this host's KVM allows {}",
            snapshot.config.vcpus,
            kvm.max_vcpus()
        )));
    }
    Ok(())
}

/// x86_64: this host's CPU offers what every saved vCPU's CPUID advertises.
#[cfg(target_arch = "x86_64")]
fn check_host(kvm: &KvmContext, snapshot: &VmSnapshot) -> Result<(), Error> {
    for vcpu in &snapshot.vcpus {
        arch::x86_64::persist::check_cpuid(kvm.kvm(), &vcpu.cpuid)
            .map_err(|e| Error::Mismatch(e.to_string()))?;
    }
    Ok(())
}

/// aarch64: the saved GIC state has the layout this VMM writes (checked before anything is
/// built). Whether this host's CPU can run the saved vCPUs shows when KVM refuses one of their
/// ID registers on restore.
#[cfg(target_arch = "aarch64")]
fn check_host(_kvm: &KvmContext, snapshot: &VmSnapshot) -> Result<(), Error> {
    arch::aarch64::gic_persist::check_layout(&snapshot.vm, snapshot.vcpus.len())
        .map_err(|e| Error::Mismatch(e.to_string()))?;
    for (id, vcpu) in snapshot.vcpus.iter().enumerate() {
        arch::aarch64::persist::check_sizes(&vcpu.regs)
            .map_err(|e| Error::Mismatch(format!("vCPU {id}: {e}")))?;
    }
    Ok(())
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn check_host(_kvm: &KvmContext, _snapshot: &VmSnapshot) -> Result<(), Error> {
    Err(Error::Unsupported)
}

/// The VM-level state KVM needs before the vCPUs exist (x86_64: PIT, clock, PICs, IOAPIC).
#[cfg(target_arch = "x86_64")]
fn restore_vm_state_early(vm: &Vm, snapshot: &VmSnapshot) -> Result<(), Error> {
    arch::x86_64::persist::restore_vm(vm.fd(), &snapshot.vm)
        .map_err(|e| Error::VmState(e.to_string()))
}

/// Nothing before the vCPUs on aarch64: the GIC is restored after them.
#[cfg(not(target_arch = "x86_64"))]
fn restore_vm_state_early(_vm: &Vm, _snapshot: &VmSnapshot) -> Result<(), Error> {
    Ok(())
}

/// The VM-level state restored after the vCPUs (aarch64: the GICv3, whose per-vCPU registers
/// are addressed by the MPIDRs the restored vCPUs have).
#[cfg(target_arch = "aarch64")]
fn restore_vm_state_late(vm: &Vm, snapshot: &VmSnapshot) -> Result<(), Error> {
    use arch::aarch64::gic_persist::{restore_gic, Error as GicError};
    let gic = vm
        .irqchip()
        .ok_or_else(|| Error::VmState(GicError::NoDevice.to_string()))?;
    let mpidrs: Vec<u64> = snapshot.vcpus.iter().map(|v| v.mpidr).collect();
    restore_gic(gic, &mpidrs, &snapshot.vm).map_err(|e| Error::VmState(e.to_string()))
}

/// Nothing after the vCPUs on x86_64.
#[cfg(not(target_arch = "aarch64"))]
fn restore_vm_state_late(_vm: &Vm, _snapshot: &VmSnapshot) -> Result<(), Error> {
    Ok(())
}

/// Puts each transport's saved registers and queues back, in registration order.
fn restore_devices(parts: &VmParts, snapshot: &VmSnapshot) -> Result<(), Error> {
    for (index, (transport, state)) in parts.transports().iter().zip(&snapshot.devices).enumerate()
    {
        transport
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .restore(state)
            .map_err(|e| Error::Device {
                index,
                reason: e.to_string(),
            })?;
    }
    Ok(())
}

#[cfg(target_arch = "x86_64")]
fn restore_vcpus(parts: &VmParts, snapshot: &VmSnapshot) -> Result<(), Error> {
    for (id, (fd, state)) in parts.vcpu_fds().iter().zip(&snapshot.vcpus).enumerate() {
        arch::x86_64::persist::restore_vcpu(fd, state)
            .map_err(|e| Error::Vcpu(format!("vCPU {id}: {e}")))?;
    }
    Ok(())
}

#[cfg(target_arch = "aarch64")]
fn restore_vcpus(parts: &VmParts, snapshot: &VmSnapshot) -> Result<(), Error> {
    for (id, (fd, state)) in parts.vcpu_fds().iter().zip(&snapshot.vcpus).enumerate() {
        arch::aarch64::persist::restore_vcpu(parts.vm.fd(), fd, state)
            .map_err(|e| Error::Vcpu(format!("vCPU {id}: {e}")))?;
    }
    Ok(())
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn restore_vcpus(_parts: &VmParts, _snapshot: &VmSnapshot) -> Result<(), Error> {
    Err(Error::Unsupported)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn disk(path: &str, read_only: bool) -> DiskConfig {
        DiskConfig {
            path: path.into(),
            read_only,
            id: Some("saved-id".into()),
            backing: None,
        }
    }

    #[test]
    fn given_disks_replace_the_saved_paths_in_order_when_count_and_modes_match() {
        // Arrange
        let saved = [
            disk("/images/rootfs.ext4", true),
            disk("/run/a/scratch.ext4", false),
        ];
        let given = [
            disk("/images/rootfs.ext4", true),
            disk("/run/b/scratch.ext4", false),
        ];
        let too_few = [disk("/images/rootfs.ext4", true)];
        let writable_root = [disk("/images/rootfs.ext4", false), disk("/run/b/s", false)];

        // Act
        let merged = merge_disks(&saved, &given).unwrap();
        let count = merge_disks(&saved, &too_few).unwrap_err().to_string();
        let mode = merge_disks(&saved, &writable_root).unwrap_err().to_string();

        // Assert
        assert_eq!(merged[1].path, PathBuf::from("/run/b/scratch.ext4"));
        assert_eq!(
            merged[1].id.as_deref(),
            Some("saved-id"),
            "the serial stays the saved one"
        );
        assert!(
            count.contains("has 2 disks; the restore gives 1"),
            "{count}"
        );
        assert!(
            mode.contains("disk 0 (/images/rootfs.ext4) is read-only"),
            "{mode}"
        );
    }
}
