//! Builds a [`Vmm`] from a [`VmConfig`]: KVM, guest memory, the boot payload, devices and vCPUs.
//!
//! Steps run in an order that leaves nothing behind on failure: every check and every in-memory
//! step comes first, and the files the VM writes (serial and debug-port output) are created last.

use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use event_manager::{MutEventSubscriber, SubscriberOps};
use kvm_ioctls::VcpuFd;
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use crate::arch;
use crate::boot;
use crate::config::{DiskConfig, SerialOutput, ShareConfig, VmConfig};
use crate::device_manager::{self, MmioDeviceManager, MmioSlot};
use crate::devices::bus::{self, Bus};
use crate::devices::legacy::panic_watch::{GuestPanic, PanicWatch};
use crate::devices::legacy::serial;
use crate::devices::virtio::block::{self, Block, BlockConfig};
use crate::devices::virtio::fs::{self, Fs, FsConfig};
use crate::devices::virtio::mmio::MmioTransport;
use crate::devices::virtio::vsock::{self, Vsock};
use crate::devices::virtio::VirtioDevice;
use crate::snapshot::LegacyHandles;
use crate::vmm::{BootTimeline, EventLoop, Persist, Vmm};
use crate::vstate::kvm::{self, KvmContext, KVM_PATH};
use crate::vstate::vcpu::{Vcpu, VcpuShared};
use crate::vstate::{memory, vm};

/// Errors from building a VM.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] crate::config::Error),
    /// An input file (kernel, initramfs) cannot be read.
    #[error("cannot read {what} {path}: {source}")]
    Input {
        /// "kernel" or "initramfs".
        what: &'static str,
        /// The path given.
        path: std::path::PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// KVM could not be opened or lacks a capability.
    #[error(transparent)]
    Kvm(#[from] kvm::Error),
    /// More vCPUs than this host's KVM allows.
    #[error("{asked} vCPUs requested, but this host's KVM allows at most {max}")]
    TooManyVcpus {
        /// vCPUs asked for.
        asked: u8,
        /// KVM_CAP_MAX_VCPUS.
        max: usize,
    },
    /// Guest memory could not be created.
    #[error(transparent)]
    Memory(#[from] memory::Error),
    /// The VM could not be created.
    #[error(transparent)]
    Vm(#[from] vm::Error),
    /// The kernel, initramfs or command line could not be loaded.
    #[error(transparent)]
    Boot(#[from] boot::Error),
    /// Architecture boot set-up failed.
    #[error(transparent)]
    Arch(#[from] arch::Error),
    /// KVM_CREATE_VCPU failed.
    #[error("cannot create vCPU {id}: {source}")]
    CreateVcpu {
        /// The vCPU index.
        id: u8,
        /// The KVM error.
        source: kvm_ioctls::Error,
    },
    /// An eventfd could not be created.
    #[error("cannot create an eventfd: {0}")]
    EventFd(std::io::Error),
    /// A device could not be placed on its bus.
    #[error("cannot place a device: {0}")]
    Bus(#[from] bus::Error),
    /// The serial console output could not be set up.
    #[error(transparent)]
    Serial(#[from] serial::Error),
    /// The vsock device could not be created.
    #[error("vsock: {0}")]
    Vsock(#[from] vsock::Error),
    /// A disk could not be opened.
    #[error("disk: {0}")]
    Block(#[from] block::Error),
    /// A shared directory could not be set up.
    #[error("share: {0}")]
    Fs(#[from] fs::Error),
    /// A virtio device could not be placed.
    #[error(transparent)]
    DeviceManager(#[from] device_manager::Error),
    /// The event loop could not be created.
    #[error("cannot create the event loop: {0}")]
    EventLoop(String),
    /// The debug-port output file could not be created.
    #[error("cannot create debug port output file {path}: {source}")]
    DebugCon {
        /// The file asked for.
        path: std::path::PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
}

/// Builds a VM from `config`, ready for [`Vmm::run`], using `/dev/kvm`.
///
/// # Errors
/// Any [`Error`]; nothing is left on disk when building fails.
pub fn build(config: &VmConfig) -> Result<Vmm, Error> {
    build_with_kvm(config, Path::new(KVM_PATH))
}

/// Like [`build`], with the KVM device node at `kvm_path`.
///
/// # Errors
/// Any [`Error`]; nothing is left on disk when building fails.
pub fn build_with_kvm(config: &VmConfig, kvm_path: &Path) -> Result<Vmm, Error> {
    let mut timeline = BootTimeline {
        build_started: Some(Instant::now()),
        ..Default::default()
    };
    config.validate()?;
    check_readable("kernel", &config.kernel)?;
    if let Some(initrd) = &config.initrd {
        check_readable("initramfs", initrd)?;
    }
    let kvm = KvmContext::open(kvm_path)?;
    if usize::from(config.vcpus) > kvm.max_vcpus() {
        return Err(Error::TooManyVcpus {
            asked: config.vcpus,
            max: kvm.max_vcpus(),
        });
    }
    let guest_memory = memory::create_guest_memory(config.memory_mib, arch::arch_memory_regions)?;
    let vm = vm::Vm::new(&kvm, &guest_memory)?;
    timeline.vm_created = Some(Instant::now());
    let mut parts = VmParts::new(config, kvm, vm, guest_memory, timeline)?;
    let step = Instant::now();
    // x86_64 guests learn of virtio-mmio devices from the command line, arm64 ones from the
    // device tree (where the interrupt is a GIC SPI, not a Linux IRQ number).
    let device_params = if arch::VIRTIO_MMIO_ON_CMDLINE {
        parts.devices.cmdline_params()
    } else {
        &[]
    };
    let boot_state = load_payload(config, &parts.mem, device_params, &parts.slots)?;
    tracing::debug!(
        ms = ms_since(step),
        "kernel, initramfs and boot structures loaded"
    );
    let step = Instant::now();
    arch::setup_vcpus(
        parts.kvm.kvm(),
        parts.vm.fd(),
        &parts.vcpu_fds,
        &boot_state,
        &parts.mem,
    )?;
    tracing::debug!(
        ms = ms_since(step),
        vcpus = config.vcpus,
        "vCPUs configured"
    );
    parts.timeline.payload_loaded = Some(Instant::now());
    parts.finish(false)
}

/// A VM being built, by a boot ([`build_with_kvm`]) or a restore ([`crate::snapshot`]): KVM, the
/// VM with its guest memory, the vCPUs (created, not yet configured) and the virtio devices on
/// their MMIO bus and in the event loop.
pub(crate) struct VmParts {
    config: VmConfig,
    pub(crate) kvm: KvmContext,
    pub(crate) vm: vm::Vm,
    pub(crate) mem: GuestMemoryMmap,
    pub(crate) vcpu_fds: Vec<VcpuFd>,
    shared: Arc<VcpuShared>,
    event_manager: EventLoop,
    mmio: Bus,
    pub(crate) devices: MmioDeviceManager,
    pub(crate) slots: Vec<MmioSlot>,
    /// The virtio-fs devices, in registration order (for [`Vmm::attach_share`]).
    shares: Vec<Arc<Mutex<Fs>>>,
    pub(crate) timeline: BootTimeline,
}

impl VmParts {
    /// Creates the vCPUs and the interrupt controller, then the virtio devices of `config` in
    /// their fixed order (vsock, disks, shares), each behind its transport and in the event
    /// loop.
    ///
    /// # Errors
    /// [`Error::CreateVcpu`], [`Error::Arch`], [`Error::EventFd`], [`Error::EventLoop`] and the
    /// devices' errors.
    pub(crate) fn new(
        config: &VmConfig,
        kvm: KvmContext,
        mut vm: vm::Vm,
        mem: GuestMemoryMmap,
        timeline: BootTimeline,
    ) -> Result<VmParts, Error> {
        let step = Instant::now();
        // vCPUs and the interrupt controller exist before any device wires an irqfd (arm64 KVM
        // refuses irqfds until its GIC, which needs every vCPU, is initialised).
        let vcpu_fds = create_vcpus(&vm, config.vcpus)?;
        vm.set_irqchip(arch::setup_irqchip(vm.fd(), &vcpu_fds)?);
        tracing::debug!(ms = ms_since(step), vcpus = config.vcpus, "vCPUs created");
        let step = Instant::now();
        let shared = Arc::new(VcpuShared::new().map_err(Error::EventFd)?);
        let mut event_manager = EventLoop::new().map_err(|e| Error::EventLoop(e.to_string()))?;
        let mut virtio = VirtioContext {
            vm: &vm,
            mem: &mem,
            mmio: Bus::default(),
            devices: MmioDeviceManager::default(),
            slots: Vec::new(),
            event_manager: &mut event_manager,
        };
        if let Some(vsock) = &config.vsock {
            virtio.attach(Vsock::new(vsock.guest_cid, &vsock.uds_path)?)?;
        }
        for disk in &config.disks {
            virtio.attach(Block::new(block_config(disk))?)?;
        }
        let shares = config
            .shares
            .iter()
            .map(|share| virtio.attach(Fs::new(fs_config(share))?))
            .collect::<Result<Vec<_>, Error>>()?;
        let VirtioContext {
            mmio,
            devices,
            slots,
            ..
        } = virtio;
        tracing::debug!(ms = ms_since(step), "virtio devices created");
        Ok(VmParts {
            config: config.clone(),
            kvm,
            vm,
            mem,
            vcpu_fds,
            shared,
            event_manager,
            mmio,
            devices,
            slots,
            shares,
            timeline,
        })
    }

    /// Every virtio device's transport, in registration order.
    pub(crate) fn transports(&self) -> &[Arc<Mutex<MmioTransport>>] {
        self.devices.transports()
    }

    /// The vCPUs' file descriptors, by index.
    pub(crate) fn vcpu_fds(&self) -> &[VcpuFd] {
        &self.vcpu_fds
    }

    /// Adds the legacy devices and makes the [`Vmm`]; `restored` marks its vCPUs as restored
    /// from a snapshot (see [`Vcpu::mark_restored`]).
    ///
    /// # Errors
    /// The legacy devices' errors (serial and debug-port files are created here, last).
    pub(crate) fn finish(self, restored: bool) -> Result<Vmm, Error> {
        let VmParts {
            config,
            kvm,
            vm,
            mem,
            vcpu_fds,
            shared,
            event_manager,
            mut mmio,
            devices,
            shares,
            timeline,
            ..
        } = self;
        let msrs = Arc::new(saveable_msrs(&kvm));
        let legacy = arch::legacy_devices(&config, &vm, &mut mmio)?;
        let pio = Arc::new(legacy.pio);
        let mmio = Arc::new(mmio);
        let vcpus = vcpu_fds
            .into_iter()
            .enumerate()
            .map(|(id, fd)| {
                let mut vcpu = Vcpu::new(fd, id as u8, pio.clone(), mmio.clone(), shared.clone());
                if restored {
                    vcpu.mark_restored();
                }
                vcpu
            })
            .collect();
        let persist = Persist {
            transports: devices.transports().to_vec(),
            legacy: LegacyHandles {
                serial: legacy.serial,
                i8042: legacy.i8042,
            },
            msrs,
            config,
        };
        Ok(Vmm {
            vcpus,
            shared,
            vm,
            guest_memory: mem,
            reset_evt: legacy.reset_evt,
            debug_first_write: legacy.debug_first_write,
            guest_panic: legacy.guest_panic,
            timeline,
            event_manager,
            persist,
            shares,
            control: None,
        })
    }
}

/// The MSRs a snapshot saves (x86_64: KVM's saveable list); empty when KVM cannot list them,
/// which only a snapshot would notice (its restore then fails on the missing MSRs' defaults
/// being wrong, never silently: see [`crate::arch::x86_64::persist`]).
#[cfg(target_arch = "x86_64")]
fn saveable_msrs(kvm: &KvmContext) -> Vec<u32> {
    crate::arch::x86_64::persist::saveable_msrs(kvm.kvm()).unwrap_or_else(|e| {
        tracing::warn!("cannot list the MSRs to snapshot: {e}");
        Vec::new()
    })
}

/// No MSRs outside x86_64.
#[cfg(not(target_arch = "x86_64"))]
fn saveable_msrs(_kvm: &KvmContext) -> Vec<u32> {
    Vec::new()
}

/// Milliseconds since `start`, for the build steps' debug log.
fn ms_since(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1e3
}

/// Fails early, before touching KVM, when an input file cannot be opened for reading.
fn check_readable(what: &'static str, path: &Path) -> Result<(), Error> {
    match std::fs::File::open(path) {
        Ok(f) if f.metadata().is_ok_and(|m| m.is_file()) => Ok(()),
        Ok(_) => Err(Error::Input {
            what,
            path: path.to_owned(),
            source: std::io::Error::other("not a regular file"),
        }),
        Err(source) => Err(Error::Input {
            what,
            path: path.to_owned(),
            source,
        }),
    }
}

/// Loads kernel and initramfs, builds the command line, writes the boot structures; returns
/// what the vCPUs start from.
fn load_payload(
    config: &VmConfig,
    mem: &GuestMemoryMmap,
    device_params: &[String],
    devices: &[MmioSlot],
) -> Result<arch::BootState, Error> {
    let step = Instant::now();
    let kernel = arch::load_kernel(mem, &config.kernel)?;
    tracing::debug!(ms = ms_since(step), "kernel loaded");
    let step = Instant::now();
    let initrd = match &config.initrd {
        Some(path) => Some(boot::load_initrd(mem, path, kernel.end)?),
        None => None,
    };
    tracing::debug!(ms = ms_since(step), "initramfs loaded");
    let base = config
        .cmdline
        .as_deref()
        .unwrap_or(boot::cmdline::DEFAULT_CMDLINE);
    let cmdline = boot::cmdline::build_cmdline(base, device_params)?;
    let boot_config = arch::BootConfig {
        kernel: &kernel,
        cmdline: &cmdline,
        initrd,
        vcpus: config.vcpus,
        devices,
    };
    Ok(arch::setup_boot(mem, &boot_config)?)
}

/// What placing a virtio device needs: the VM, guest memory, the MMIO bus being built, the
/// address/IRQ allocator, where each device went and the event loop.
struct VirtioContext<'a> {
    vm: &'a vm::Vm,
    mem: &'a GuestMemoryMmap,
    mmio: Bus,
    devices: MmioDeviceManager,
    slots: Vec<MmioSlot>,
    event_manager: &'a mut EventLoop,
}

impl VirtioContext<'_> {
    /// Places `device` behind a virtio-mmio transport and adds it to the event loop. Devices are
    /// announced to the guest in this order (so the first disk is `/dev/vda`).
    fn attach<D>(&mut self, device: D) -> Result<Arc<Mutex<D>>, Error>
    where
        D: VirtioDevice + MutEventSubscriber + 'static,
    {
        let device = Arc::new(Mutex::new(device));
        let slot = self
            .devices
            .register(self.vm, self.mem, &mut self.mmio, device.clone())?;
        self.slots.push(slot);
        self.event_manager.add_subscriber(device.clone());
        Ok(device)
    }
}

fn fs_config(share: &ShareConfig) -> FsConfig {
    FsConfig {
        tag: share.tag.clone(),
        shared_dir: share.path.clone(),
        read_only: share.read_only,
        owner: share.owner,
    }
}

fn block_config(disk: &DiskConfig) -> BlockConfig {
    BlockConfig {
        path: disk.path.clone(),
        read_only: disk.read_only,
        id: disk.id.clone(),
        backing: disk.backing.clone(),
    }
}

/// Creates vCPUs `0..count` (KVM_CREATE_VCPU); [`arch::setup_vcpus`] configures them later.
fn create_vcpus(vm: &vm::Vm, count: u8) -> Result<Vec<VcpuFd>, Error> {
    (0..count)
        .map(|id| {
            vm.fd()
                .create_vcpu(u64::from(id))
                .map_err(|source| Error::CreateVcpu { id, source })
        })
        .collect()
}

/// The legacy devices (console, and on x86_64 the PC's port-I/O devices) and the host-side ends
/// of their signals; made by [`arch::legacy_devices`].
pub(crate) struct LegacyDevices {
    /// The port-I/O bus (empty where the architecture has no port I/O).
    pub(crate) pio: Bus,
    /// Signalled by the i8042 when the guest asks for a CPU reset (never on aarch64, where
    /// PSCI SYSTEM_RESET ends the VM through a vCPU exit).
    pub(crate) reset_evt: EventFd,
    /// When the guest first wrote to the debug port.
    pub(crate) debug_first_write: Arc<OnceLock<Instant>>,
    /// The reason of a kernel panic the guest printed on its console.
    pub(crate) guest_panic: GuestPanic,
    /// The serial console (also on the bus), for saving and restoring its registers.
    pub(crate) serial: Arc<Mutex<crate::devices::legacy::serial::SerialDevice>>,
    /// The i8042 (also on the bus; x86_64 only), for saving and restoring its registers.
    pub(crate) i8042: Option<Arc<Mutex<crate::devices::legacy::i8042::I8042>>>,
}

/// Where the serial console's output goes, watched for a kernel panic (see [`PanicWatch`]).
pub(crate) fn serial_sink(
    output: &SerialOutput,
) -> Result<(Box<dyn Write + Send>, GuestPanic), Error> {
    let sink: Box<dyn Write + Send> = match output {
        SerialOutput::Stdout => Box::new(std::io::stdout()),
        SerialOutput::Off => Box::new(std::io::sink()),
        SerialOutput::File(path) => serial::file_sink(path)?,
    };
    let (watched, panic) = PanicWatch::new(sink);
    Ok((Box::new(watched), panic))
}
