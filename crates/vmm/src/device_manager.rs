//! Placement of virtio-mmio devices: each gets a 4 KiB MMIO window in the 32-bit MMIO gap and a
//! legacy IRQ, is put on the MMIO bus, has its interrupt wired as an irqfd and its queue
//! notifications as ioeventfds, and is announced to the guest on the kernel command line
//! (`virtio_mmio.device=4K@<GPA>:<IRQ>`, Linux `drivers/virtio/virtio_mmio.c`).

use std::sync::{Arc, Mutex};

use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use crate::arch::{IRQ_BASE, IRQ_MAX, MMIO_BASE};
use crate::devices::bus::{self, Bus};
use crate::devices::virtio::mmio::{
    self, cmdline_device_param, MmioTransport, MMIO_DEVICE_SIZE, NOTIFY_REG_OFFSET,
};
use crate::devices::virtio::{IrqTrigger, VirtioDevice};
use crate::vstate::vm::{self, Vm};

/// Errors from placing a virtio-mmio device.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Every legacy IRQ available to virtio devices is taken.
    #[error("too many virtio devices: no interrupt line left (IRQs {IRQ_BASE}..={IRQ_MAX})")]
    NoIrq,
    /// The interrupt eventfd could not be created.
    #[error("cannot create a device interrupt eventfd: {0}")]
    EventFd(std::io::Error),
    /// The transport rejected the device.
    #[error(transparent)]
    Transport(#[from] mmio::Error),
    /// The MMIO window could not be placed on the bus.
    #[error(transparent)]
    Bus(#[from] bus::Error),
    /// irqfd or ioeventfd registration failed.
    #[error(transparent)]
    Vm(#[from] vm::Error),
}

/// Where a device was placed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MmioSlot {
    /// GPA of the device's MMIO window.
    pub base: u64,
    /// The device's legacy IRQ (IOAPIC pin).
    pub irq: u32,
}

/// Allocates MMIO windows and IRQs for virtio devices, in registration order.
#[derive(Debug)]
pub struct MmioDeviceManager {
    next_base: u64,
    next_irq: u32,
    cmdline_params: Vec<String>,
    transports: Vec<Arc<Mutex<MmioTransport>>>,
}

impl Default for MmioDeviceManager {
    fn default() -> Self {
        MmioDeviceManager {
            next_base: MMIO_BASE,
            next_irq: IRQ_BASE,
            cmdline_params: Vec::new(),
            transports: Vec::new(),
        }
    }
}

impl MmioDeviceManager {
    /// Places `device` behind a new virtio-mmio transport.
    ///
    /// # Errors
    /// [`Error::NoIrq`] after `IRQ_MAX - IRQ_BASE + 1` devices, and the transport, bus and KVM
    /// registration errors.
    pub fn register(
        &mut self,
        vm: &Vm,
        mem: &GuestMemoryMmap,
        bus: &mut Bus,
        device: Arc<Mutex<dyn VirtioDevice>>,
    ) -> Result<MmioSlot, Error> {
        if self.next_irq > IRQ_MAX {
            return Err(Error::NoIrq);
        }
        let slot = MmioSlot {
            base: self.next_base,
            irq: self.next_irq,
        };
        let irq_evt = EventFd::new(libc::EFD_NONBLOCK).map_err(Error::EventFd)?;
        let interrupt = Arc::new(IrqTrigger::new(irq_evt));
        let transport = MmioTransport::new(mem.clone(), device, interrupt.clone())?;
        vm.register_irqfd(interrupt.eventfd(), slot.irq)?;
        for (index, evt) in transport.queue_evts().iter().enumerate() {
            vm.register_mmio_ioevent(evt, slot.base + NOTIFY_REG_OFFSET, index as u32)?;
        }
        let transport = Arc::new(Mutex::new(transport));
        bus.insert(slot.base, MMIO_DEVICE_SIZE, transport.clone())?;
        self.transports.push(transport);
        self.cmdline_params
            .push(cmdline_device_param(slot.base, MMIO_DEVICE_SIZE, slot.irq));
        self.next_base += MMIO_DEVICE_SIZE;
        self.next_irq += 1;
        Ok(slot)
    }

    /// The kernel command-line parameters announcing every registered device.
    pub fn cmdline_params(&self) -> &[String] {
        &self.cmdline_params
    }

    /// Every registered device's transport, in registration order (for snapshots).
    pub fn transports(&self) -> &[Arc<Mutex<MmioTransport>>] {
        &self.transports
    }
}
