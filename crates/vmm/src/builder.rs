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
use vm_memory::{GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use crate::arch;
use crate::boot;
use crate::config::{DiskConfig, SerialOutput, ShareConfig, VmConfig};
use crate::device_manager::{self, MmioDeviceManager};
use crate::devices::bus::{self, Bus};
use crate::devices::legacy::debugcon::{DebugCon, DEBUGCON_PORT};
use crate::devices::legacy::i8042::{I8042, I8042_KBD_IRQ, I8042_PORT, I8042_PORT_COUNT};
use crate::devices::legacy::serial::{self, SerialDevice, COM1_IRQ, COM1_PORT, COM1_PORT_COUNT};
use crate::devices::legacy::EventFdTrigger;
use crate::devices::virtio::block::{self, Block, BlockConfig};
use crate::devices::virtio::fs::{self, Fs, FsConfig};
use crate::devices::virtio::vsock::{self, Vsock};
use crate::devices::virtio::VirtioDevice;
use crate::vmm::{BootTimeline, EventLoop, Vmm};
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
    /// KVM_GET_SUPPORTED_CPUID failed.
    #[error("cannot read the CPUID KVM supports: {0}")]
    SupportedCpuid(kvm_ioctls::Error),
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
    let step = Instant::now();

    let shared = Arc::new(VcpuShared::new().map_err(Error::EventFd)?);
    let mut event_manager = EventLoop::new().map_err(|e| Error::EventLoop(e.to_string()))?;
    let mut virtio = VirtioContext {
        vm: &vm,
        mem: &guest_memory,
        mmio: Bus::default(),
        devices: MmioDeviceManager::default(),
        event_manager: &mut event_manager,
    };
    if let Some(vsock) = &config.vsock {
        virtio.attach(Vsock::new(vsock.guest_cid, &vsock.uds_path)?)?;
    }
    for disk in &config.disks {
        virtio.attach(Block::new(block_config(disk))?)?;
    }
    for share in &config.shares {
        virtio.attach(Fs::new(fs_config(share))?)?;
    }
    let VirtioContext { mmio, devices, .. } = virtio;
    tracing::debug!(ms = ms_since(step), "virtio devices created");
    let step = Instant::now();
    let entry = load_payload(config, &guest_memory, devices.cmdline_params())?;
    tracing::debug!(
        ms = ms_since(step),
        "kernel, initramfs and boot structures loaded"
    );
    let step = Instant::now();
    let vcpu_fds = create_vcpus(&kvm, &vm, &guest_memory, config.vcpus, entry)?;
    tracing::debug!(ms = ms_since(step), vcpus = config.vcpus, "vCPUs created");
    timeline.payload_loaded = Some(Instant::now());

    let legacy = legacy_devices(config, &vm)?;
    let pio = Arc::new(legacy.pio);
    let mmio = Arc::new(mmio);
    let vcpus = vcpu_fds
        .into_iter()
        .enumerate()
        .map(|(id, fd)| Vcpu::new(fd, id as u8, pio.clone(), mmio.clone(), shared.clone()))
        .collect();
    Ok(Vmm {
        vcpus,
        shared,
        vm,
        guest_memory,
        reset_evt: legacy.reset_evt,
        debug_first_write: legacy.debug_first_write,
        timeline,
        event_manager,
    })
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

/// Loads kernel, initramfs and command line, writes the boot structures; returns the kernel entry.
fn load_payload(
    config: &VmConfig,
    mem: &GuestMemoryMmap,
    device_params: &[String],
) -> Result<GuestAddress, Error> {
    let step = Instant::now();
    let kernel = boot::load_kernel(mem, &config.kernel)?;
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
    let (cmdline_addr, cmdline_size) = boot::cmdline::load_cmdline(mem, &cmdline)?;
    let info = arch::BootInfo {
        cmdline_addr,
        cmdline_size,
        initrd: initrd.map(|i| (i.addr, i.size)),
        setup_header: kernel.setup_header,
    };
    arch::configure_system(mem, &info, config.vcpus)?;
    Ok(kernel.entry)
}

/// What placing a virtio device needs: the VM, guest memory, the MMIO bus being built, the
/// address/IRQ allocator and the event loop.
struct VirtioContext<'a> {
    vm: &'a vm::Vm,
    mem: &'a GuestMemoryMmap,
    mmio: Bus,
    devices: MmioDeviceManager,
    event_manager: &'a mut EventLoop,
}

impl VirtioContext<'_> {
    /// Places `device` behind a virtio-mmio transport and adds it to the event loop. Devices are
    /// announced to the guest in this order (so the first disk is `/dev/vda`).
    fn attach<D>(&mut self, device: D) -> Result<(), Error>
    where
        D: VirtioDevice + MutEventSubscriber + 'static,
    {
        let device = Arc::new(Mutex::new(device));
        self.devices
            .register(self.vm, self.mem, &mut self.mmio, device.clone())?;
        self.event_manager.add_subscriber(device);
        Ok(())
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
    }
}

fn create_vcpus(
    kvm: &KvmContext,
    vm: &vm::Vm,
    mem: &GuestMemoryMmap,
    count: u8,
    entry: GuestAddress,
) -> Result<Vec<VcpuFd>, Error> {
    let cpuid = kvm
        .kvm()
        .get_supported_cpuid(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
        .map_err(Error::SupportedCpuid)?;
    (0..count)
        .map(|id| {
            let fd = vm
                .fd()
                .create_vcpu(u64::from(id))
                .map_err(|source| Error::CreateVcpu { id, source })?;
            arch::configure_vcpu(&fd, &cpuid, id, count, entry, mem)?;
            Ok(fd)
        })
        .collect()
}

/// The port-I/O devices of a PC and the host-side ends of their signals.
struct LegacyDevices {
    pio: Bus,
    /// Signalled by the i8042 when the guest asks for a CPU reset.
    reset_evt: EventFd,
    debug_first_write: Arc<OnceLock<Instant>>,
}

/// Puts the 8250 UART, the i8042 reset line and the debug port on a new port-I/O bus.
fn legacy_devices(config: &VmConfig, vm: &vm::Vm) -> Result<LegacyDevices, Error> {
    let mut pio = Bus::default();

    let reset_evt = EventFd::new(libc::EFD_NONBLOCK).map_err(Error::EventFd)?;
    let reset = reset_evt.try_clone().map_err(Error::EventFd)?;
    let kbd_irq = EventFd::new(libc::EFD_NONBLOCK).map_err(Error::EventFd)?;
    vm.register_irqfd(&kbd_irq, I8042_KBD_IRQ)?;
    let i8042 = I8042::new(
        EventFdTrigger::new(reset),
        Some(EventFdTrigger::new(kbd_irq)),
    );
    pio.insert(I8042_PORT, I8042_PORT_COUNT, Arc::new(Mutex::new(i8042)))?;

    let debugcon_sink = open_optional_file(config.debugcon.as_deref())?;
    let debugcon = DebugCon::new(debugcon_sink);
    let first_write = debugcon.first_write();
    pio.insert(DEBUGCON_PORT, 1, Arc::new(Mutex::new(debugcon)))?;

    let irq = EventFd::new(libc::EFD_NONBLOCK).map_err(Error::EventFd)?;
    vm.register_irqfd(&irq, COM1_IRQ)?;
    let sink = match serial_sink(&config.serial) {
        Ok(sink) => sink,
        Err(e) => {
            remove_created(config.debugcon.as_deref());
            return Err(e);
        }
    };
    let uart = SerialDevice::new(EventFdTrigger::new(irq), sink);
    pio.insert(COM1_PORT, COM1_PORT_COUNT, Arc::new(Mutex::new(uart)))?;
    Ok(LegacyDevices {
        pio,
        reset_evt,
        debug_first_write: first_write,
    })
}

fn serial_sink(output: &SerialOutput) -> Result<Box<dyn Write + Send>, Error> {
    Ok(match output {
        SerialOutput::Stdout => Box::new(std::io::stdout()),
        SerialOutput::Off => Box::new(std::io::sink()),
        SerialOutput::File(path) => serial::file_sink(path)?,
    })
}

fn open_optional_file(path: Option<&Path>) -> Result<Option<Box<dyn Write + Send>>, Error> {
    let Some(path) = path else { return Ok(None) };
    let file = std::fs::File::create(path).map_err(|source| Error::DebugCon {
        path: path.to_owned(),
        source,
    })?;
    Ok(Some(Box::new(file)))
}

fn remove_created(path: Option<&Path>) {
    if let Some(path) = path {
        let _ = std::fs::remove_file(path);
    }
}
