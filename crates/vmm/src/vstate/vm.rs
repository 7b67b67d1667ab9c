//! The KVM VM: creation, architecture-level set-up (irqchip, PIT), guest memory registration,
//! irqfd and ioeventfd wiring.

use kvm_ioctls::{DeviceFd, IoEventAddress, VmFd};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use super::kvm::KvmContext;
use super::memory;

/// Errors from creating and configuring the VM.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// KVM_CREATE_VM failed.
    #[error("cannot create the KVM VM: {0}")]
    Create(kvm_ioctls::Error),
    /// An architecture set-up ioctl failed.
    #[error("cannot set up the VM ({what}): {source}")]
    ArchSetup {
        /// Which step failed.
        what: &'static str,
        /// The KVM error.
        source: kvm_ioctls::Error,
    },
    /// Guest memory could not be registered.
    #[error(transparent)]
    Memory(#[from] memory::Error),
    /// KVM_IRQFD failed.
    #[error("cannot wire an irqfd to GSI {gsi}: {source}")]
    Irqfd {
        /// The interrupt line.
        gsi: u32,
        /// The KVM error.
        source: kvm_ioctls::Error,
    },
    /// KVM_IOEVENTFD failed.
    #[error("cannot register an ioeventfd at {addr:#x}: {source}")]
    Ioeventfd {
        /// The MMIO or port address.
        addr: u64,
        /// The KVM error.
        source: kvm_ioctls::Error,
    },
}

/// A KVM VM with its guest memory registered.
#[derive(Debug)]
pub struct Vm {
    fd: VmFd,
    /// The in-kernel interrupt controller's device, where it is one (aarch64: the vGICv3).
    irqchip: Option<DeviceFd>,
}

impl Vm {
    /// Creates a VM, performs the architecture's VM-level set-up (on x86_64: TSS and identity-map
    /// addresses, in-kernel IOAPIC/PIC/LAPIC, PIT) and registers `mem`.
    ///
    /// The in-kernel irqchip must exist before any vCPU is created.
    ///
    /// # Errors
    /// [`Error::Create`], [`Error::ArchSetup`], [`Error::Memory`].
    pub fn new(kvm: &KvmContext, mem: &GuestMemoryMmap) -> Result<Self, Error> {
        let fd = kvm.kvm().create_vm().map_err(Error::Create)?;
        arch_setup(&fd)?;
        memory::register_guest_memory(&fd, mem)?;
        Ok(Vm { fd, irqchip: None })
    }

    /// The VM file descriptor.
    pub fn fd(&self) -> &VmFd {
        &self.fd
    }

    /// Keeps the interrupt controller's device (`crate::arch::setup_irqchip`), for snapshots.
    pub fn set_irqchip(&mut self, device: Option<DeviceFd>) {
        self.irqchip = device;
    }

    /// The interrupt controller's device, where the architecture has one (aarch64: the vGICv3).
    pub fn irqchip(&self) -> Option<&DeviceFd> {
        self.irqchip.as_ref()
    }

    /// Makes every signal of `evt` inject interrupt `gsi` into the guest (KVM_IRQFD).
    ///
    /// # Errors
    /// [`Error::Irqfd`].
    pub fn register_irqfd(&self, evt: &EventFd, gsi: u32) -> Result<(), Error> {
        self.fd
            .register_irqfd(evt, gsi)
            .map_err(|source| Error::Irqfd { gsi, source })
    }

    /// Makes 4-byte guest MMIO writes of `datamatch` to `addr` signal `evt` in the kernel, without a
    /// vCPU exit to userspace (KVM_IOEVENTFD with datamatch). virtio-mmio uses one per virtqueue:
    /// the driver writes the queue index to QueueNotify.
    ///
    /// # Errors
    /// [`Error::Ioeventfd`].
    pub fn register_mmio_ioevent(
        &self,
        evt: &EventFd,
        addr: u64,
        datamatch: u32,
    ) -> Result<(), Error> {
        self.fd
            .register_ioevent(evt, &IoEventAddress::Mmio(addr), datamatch)
            .map_err(|source| Error::Ioeventfd { addr, source })
    }
}

#[cfg(target_arch = "x86_64")]
fn arch_setup(fd: &VmFd) -> Result<(), Error> {
    use kvm_bindings::{kvm_pit_config, KVM_PIT_SPEAKER_DUMMY};
    /// GPA of the one-page identity map KVM needs on Intel hosts (in the 32-bit MMIO gap, above
    /// every virtio-mmio device).
    const KVM_IDENTITY_MAP_START: u64 = 0xfffb_c000;
    /// GPA of the three pages KVM uses for the real-mode TSS on Intel hosts.
    const KVM_TSS_START: u64 = KVM_IDENTITY_MAP_START + 0x1000;

    let step = |what| move |source| Error::ArchSetup { what, source };
    fd.set_identity_map_address(KVM_IDENTITY_MAP_START)
        .map_err(step("identity map address"))?;
    fd.set_tss_address(KVM_TSS_START as usize)
        .map_err(step("TSS address"))?;
    fd.create_irq_chip().map_err(step("in-kernel irqchip"))?;
    let pit = kvm_pit_config {
        flags: KVM_PIT_SPEAKER_DUMMY,
        ..Default::default()
    };
    fd.create_pit2(pit).map_err(step("in-kernel PIT"))
}

/// Nothing to do at VM creation on aarch64: the GICv3 is sized for the vCPUs, so
/// `arch::setup_vcpus` creates it once they exist.
#[cfg(target_arch = "aarch64")]
fn arch_setup(_fd: &VmFd) -> Result<(), Error> {
    Ok(())
}
