//! The console of an arm64 VM: a 16550 UART on the MMIO bus (the device tree's `ns16550a`).
//! There is no port I/O, no i8042 (PSCI SYSTEM_RESET/SYSTEM_OFF end the VM through a vCPU exit)
//! and no debug port.

use std::sync::{Arc, Mutex, OnceLock};

use vmm_sys_util::eventfd::EventFd;

use super::layout::{SERIAL_BASE, SERIAL_IRQ, SERIAL_SIZE};
use crate::builder::{serial_sink, Error, LegacyDevices};
use crate::config::VmConfig;
use crate::devices::bus::Bus;
use crate::devices::legacy::serial::SerialDevice;
use crate::devices::legacy::EventFdTrigger;
use crate::vstate::vm::Vm;

/// Puts the UART on `mmio` at [`SERIAL_BASE`] with SPI [`SERIAL_IRQ`].
pub(crate) fn legacy_devices(
    config: &VmConfig,
    vm: &Vm,
    mmio: &mut Bus,
) -> Result<LegacyDevices, Error> {
    if config.debugcon.is_some() {
        tracing::warn!("the debug port (0xe9) exists only on x86_64; no output will be written");
    }
    let irq = EventFd::new(libc::EFD_NONBLOCK).map_err(Error::EventFd)?;
    vm.register_irqfd(&irq, SERIAL_IRQ)?;
    let (sink, guest_panic) = serial_sink(&config.serial)?;
    let serial = Arc::new(Mutex::new(SerialDevice::new(
        EventFdTrigger::new(irq),
        sink,
    )));
    mmio.insert(SERIAL_BASE, SERIAL_SIZE, serial.clone())?;
    Ok(LegacyDevices {
        pio: Bus::default(),
        reset_evt: EventFd::new(libc::EFD_NONBLOCK).map_err(Error::EventFd)?,
        debug_first_write: Arc::new(OnceLock::new()),
        guest_panic,
        serial,
        i8042: None,
    })
}
