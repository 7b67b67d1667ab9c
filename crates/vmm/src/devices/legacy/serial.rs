//! The 8250/16550 UART guest console on COM1 (port 0x3f8, IRQ 4).
//!
//! The register model is vm-superio's; this module puts it on the port-I/O bus and chooses where the
//! guest's output goes.

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use vm_superio::Serial;

use super::EventFdTrigger;
use crate::devices::bus::BusDevice;

/// First port of COM1.
pub const COM1_PORT: u64 = 0x3f8;
/// Number of ports a UART decodes.
pub const COM1_PORT_COUNT: u64 = 8;
/// Legacy IRQ (IOAPIC pin) of COM1.
pub const COM1_IRQ: u32 = 4;

/// Errors from setting up the serial console.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The output file could not be created.
    #[error("cannot create serial output file {path}: {source}")]
    CreateFile {
        /// The file asked for.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
}

/// Opens the sink for `--serial FILE`: a new or truncated file.
///
/// # Errors
/// [`Error::CreateFile`] when the file cannot be created.
pub fn file_sink(path: &Path) -> Result<Box<dyn Write + Send>, Error> {
    let file = File::create(path).map_err(|source| Error::CreateFile {
        path: path.to_owned(),
        source,
    })?;
    Ok(Box::new(file))
}

/// A UART on the port-I/O bus. Guest writes to the transmit register go to the sink; the
/// interrupt line is an irqfd-backed [`EventFdTrigger`].
pub struct SerialDevice {
    uart: Serial<EventFdTrigger, vm_superio::serial::NoEvents, Box<dyn Write + Send>>,
}

impl std::fmt::Debug for SerialDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SerialDevice").finish_non_exhaustive()
    }
}

impl SerialDevice {
    /// A UART raising `irq` and writing guest output to `sink`.
    pub fn new(irq: EventFdTrigger, sink: Box<dyn Write + Send>) -> Self {
        SerialDevice {
            uart: Serial::new(irq, sink),
        }
    }
}

impl BusDevice for SerialDevice {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if data.len() != 1 || offset >= COM1_PORT_COUNT {
            data.fill(0xff);
            return;
        }
        data[0] = self.uart.read(offset as u8);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if data.len() != 1 || offset >= COM1_PORT_COUNT {
            return;
        }
        if let Err(e) = self.uart.write(offset as u8, data[0]) {
            // The sink failing (e.g. a closed stdout) must not stop the guest.
            tracing::debug!("serial output failed: {e:?}");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

    use super::*;

    #[derive(Clone, Default)]
    struct SharedBuf(Arc<Mutex<Vec<u8>>>);

    impl Write for SharedBuf {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn guest_bytes_reach_the_sink_and_raise_the_irq() {
        let irq = EventFd::new(EFD_NONBLOCK).unwrap();
        let out = SharedBuf::default();
        let mut dev = SerialDevice::new(
            EventFdTrigger::new(irq.try_clone().unwrap()),
            Box::new(out.clone()),
        );
        dev.write(1, &[0x02]); // IER: enable THR-empty interrupt

        for b in b"hi\n" {
            dev.write(0, &[*b]);
        }

        assert_eq!(out.0.lock().unwrap().as_slice(), b"hi\n");
        assert!(irq.read().unwrap() > 0);
    }

    #[test]
    fn wide_accesses_are_ignored() {
        let irq = EventFd::new(EFD_NONBLOCK).unwrap();
        let out = SharedBuf::default();
        let mut dev = SerialDevice::new(EventFdTrigger::new(irq), Box::new(out.clone()));
        let mut data = [0u8; 2];

        dev.write(0, b"ab");
        dev.read(0, &mut data);

        assert!(out.0.lock().unwrap().is_empty());
        assert_eq!(data, [0xff, 0xff]);
    }
}
