//! The PC's port-I/O devices: the 8250 UART (COM1), the i8042 reset line and the debug port.

use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};

use vmm_sys_util::eventfd::EventFd;

use crate::builder::{serial_sink, Error, LegacyDevices};
use crate::config::VmConfig;
use crate::devices::bus::Bus;
use crate::devices::legacy::debugcon::{DebugCon, DEBUGCON_PORT};
use crate::devices::legacy::i8042::{I8042, I8042_KBD_IRQ, I8042_PORT, I8042_PORT_COUNT};
use crate::devices::legacy::serial::{SerialDevice, COM1_IRQ, COM1_PORT, COM1_PORT_COUNT};
use crate::devices::legacy::EventFdTrigger;
use crate::vstate::vm::Vm;

/// Puts the 8250 UART, the i8042 reset line and the debug port on a new port-I/O bus (the MMIO
/// bus is not used on x86_64).
pub(crate) fn legacy_devices(
    config: &VmConfig,
    vm: &Vm,
    _mmio: &mut Bus,
) -> Result<LegacyDevices, Error> {
    let mut pio = Bus::default();

    let reset_evt = EventFd::new(libc::EFD_NONBLOCK).map_err(Error::EventFd)?;
    let reset = reset_evt.try_clone().map_err(Error::EventFd)?;
    let kbd_irq = EventFd::new(libc::EFD_NONBLOCK).map_err(Error::EventFd)?;
    vm.register_irqfd(&kbd_irq, I8042_KBD_IRQ)?;
    let i8042 = Arc::new(Mutex::new(I8042::new(
        EventFdTrigger::new(reset),
        Some(EventFdTrigger::new(kbd_irq)),
    )));
    pio.insert(I8042_PORT, I8042_PORT_COUNT, i8042.clone())?;

    let debugcon_sink = open_optional_file(config.debugcon.as_deref())?;
    let debugcon = DebugCon::new(debugcon_sink);
    let first_write = debugcon.first_write();
    pio.insert(DEBUGCON_PORT, 1, Arc::new(Mutex::new(debugcon)))?;

    let irq = EventFd::new(libc::EFD_NONBLOCK).map_err(Error::EventFd)?;
    vm.register_irqfd(&irq, COM1_IRQ)?;
    let (sink, guest_panic) = match serial_sink(&config.serial) {
        Ok(sink) => sink,
        Err(e) => {
            remove_created(config.debugcon.as_deref());
            return Err(e);
        }
    };
    let serial = Arc::new(Mutex::new(SerialDevice::new(
        EventFdTrigger::new(irq),
        sink,
    )));
    pio.insert(COM1_PORT, COM1_PORT_COUNT, serial.clone())?;
    Ok(LegacyDevices {
        pio,
        reset_evt,
        debug_first_write: first_write,
        guest_panic,
        serial,
        i8042: Some(i8042),
    })
}

/// Creates the file at `path`, if any, for a device's output.
fn open_optional_file(path: Option<&Path>) -> Result<Option<Box<dyn Write + Send>>, Error> {
    let Some(path) = path else { return Ok(None) };
    let file = std::fs::File::create(path).map_err(|source| Error::DebugCon {
        path: path.to_owned(),
        source,
    })?;
    Ok(Some(Box::new(file)))
}

/// Removes a file [`open_optional_file`] created, when building fails later.
fn remove_created(path: Option<&Path>) {
    if let Some(path) = path {
        let _ = std::fs::remove_file(path);
    }
}
