//! The 8250/16550 UART guest console on COM1 (port 0x3f8, IRQ 4).
//!
//! The register model is vm-superio's; this module puts it on the port-I/O bus and chooses where the
//! guest's output goes. Its registers are saved in snapshots as [`SerialDeviceState`].

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use vm_superio::serial::{NoEvents, SerialState};
use vm_superio::Serial;

use super::EventFdTrigger;
use crate::devices::bus::BusDevice;

/// First port of COM1.
pub const COM1_PORT: u64 = 0x3f8;
/// Number of ports a UART decodes.
pub const COM1_PORT_COUNT: u64 = 8;
/// Legacy IRQ (IOAPIC pin) of COM1.
pub const COM1_IRQ: u32 = 4;
/// Bytes the UART's receive FIFO holds (a 16550's, as vm-superio models it).
pub const FIFO_SIZE: usize = 64;

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
    /// A saved UART state holds more received bytes than the FIFO can.
    #[error("serial state in the snapshot holds {len} received bytes; the FIFO holds {FIFO_SIZE}")]
    FifoOverflow {
        /// Bytes in the saved receive buffer.
        len: usize,
    },
    /// The UART could not be rebuilt from a saved state.
    #[error("cannot restore the serial console: {0}")]
    Restore(String),
}

/// The UART's registers in a snapshot: a serde mirror of vm-superio's `SerialState` (the 8250/16550
/// register file: divisor latch, IER, IIR, LCR, LSR, MCR, MSR, scratch, and the receive FIFO).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SerialDeviceState {
    /// Divisor latch, low byte (DLL).
    pub baud_divisor_low: u8,
    /// Divisor latch, high byte (DLM).
    pub baud_divisor_high: u8,
    /// Interrupt Enable Register.
    pub interrupt_enable: u8,
    /// Interrupt Identification Register.
    pub interrupt_identification: u8,
    /// Line Control Register.
    pub line_control: u8,
    /// Line Status Register.
    pub line_status: u8,
    /// Modem Control Register.
    pub modem_control: u8,
    /// Modem Status Register.
    pub modem_status: u8,
    /// Scratch Register.
    pub scratch: u8,
    /// Received bytes the guest has not read, oldest first (at most [`FIFO_SIZE`]).
    pub in_buffer: Vec<u8>,
}

impl From<SerialState> for SerialDeviceState {
    fn from(s: SerialState) -> Self {
        SerialDeviceState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer,
        }
    }
}

impl From<&SerialDeviceState> for SerialState {
    fn from(s: &SerialDeviceState) -> Self {
        SerialState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer.clone(),
        }
    }
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
    uart: Serial<EventFdTrigger, NoEvents, Box<dyn Write + Send>>,
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

    /// The UART's registers, for a snapshot.
    pub fn state(&self) -> SerialDeviceState {
        self.uart.state().into()
    }

    /// Restores the registers of `state` (from a snapshot; untrusted), keeping this UART's
    /// interrupt line and output sink. An interrupt the saved state has pending (THR empty or
    /// data received, and enabled) is raised again.
    ///
    /// # Errors
    /// [`Error::FifoOverflow`] for more than [`FIFO_SIZE`] received bytes; [`Error::Restore`]
    /// when the interrupt eventfd cannot be duplicated or signalled. The UART is unchanged on
    /// error.
    pub fn restore(&mut self, state: &SerialDeviceState) -> Result<(), Error> {
        if state.in_buffer.len() > FIFO_SIZE {
            return Err(Error::FifoOverflow {
                len: state.in_buffer.len(),
            });
        }
        let irq = self
            .uart
            .interrupt_evt()
            .eventfd()
            .try_clone()
            .map_err(|e| Error::Restore(format!("cannot duplicate the interrupt eventfd: {e}")))?;
        let placeholder: Box<dyn Write + Send> = Box::new(io::sink());
        let mut uart = Serial::from_state(
            &state.into(),
            EventFdTrigger::new(irq),
            NoEvents,
            placeholder,
        )
        .map_err(|e| Error::Restore(e.to_string()))?;
        std::mem::swap(uart.writer_mut(), self.uart.writer_mut());
        self.uart = uart;
        Ok(())
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

    fn serial(irq: &EventFd) -> (SerialDevice, SharedBuf) {
        let out = SharedBuf::default();
        let dev = SerialDevice::new(
            EventFdTrigger::new(irq.try_clone().unwrap()),
            Box::new(out.clone()),
        );
        (dev, out)
    }

    fn read(dev: &mut SerialDevice, offset: u64) -> u8 {
        let mut data = [0u8];
        dev.read(offset, &mut data);
        data[0]
    }

    #[test]
    fn restored_state_keeps_line_control_interrupt_enable_and_divisor() {
        let irq = EventFd::new(EFD_NONBLOCK).unwrap();
        let (mut saved, _) = serial(&irq);
        saved.write(3, &[0x80]); // LCR: DLAB on
        saved.write(0, &[0x0c]); // DLL: 9600 baud
        saved.write(1, &[0x00]); // DLM
        saved.write(3, &[0x1b]); // LCR: 8 data bits, even parity, DLAB off
        saved.write(1, &[0x01]); // IER: received data available
        saved.write(7, &[0x5a]); // scratch
        let state = saved.state();
        let (mut restored, out) = serial(&irq);

        restored.restore(&state).unwrap();

        assert_eq!(restored.state(), state);
        assert_eq!(read(&mut restored, 3), 0x1b);
        assert_eq!(read(&mut restored, 1), 0x01);
        assert_eq!(read(&mut restored, 7), 0x5a);
        restored.write(3, &[0x9b]); // DLAB on again: offsets 0/1 are the divisor latch
        assert_eq!(
            (read(&mut restored, 0), read(&mut restored, 1)),
            (0x0c, 0x00)
        );
        restored.write(3, &[0x1b]);
        restored.write(0, b"k");
        assert_eq!(out.0.lock().unwrap().as_slice(), b"k");
    }

    #[test]
    fn state_survives_a_json_round_trip() {
        let irq = EventFd::new(EFD_NONBLOCK).unwrap();
        let (mut dev, _) = serial(&irq);
        dev.write(3, &[0x03]);
        let state = dev.state();

        let json = serde_json::to_string(&state).unwrap();

        assert_eq!(
            serde_json::from_str::<SerialDeviceState>(&json).unwrap(),
            state
        );
    }

    #[test]
    fn restore_refuses_more_received_bytes_than_the_fifo_holds() {
        let irq = EventFd::new(EFD_NONBLOCK).unwrap();
        let (mut dev, _) = serial(&irq);
        dev.write(3, &[0x03]);
        let before = dev.state();
        let state = SerialDeviceState {
            in_buffer: vec![b'x'; FIFO_SIZE + 1],
            ..before.clone()
        };

        let result = dev.restore(&state);

        assert!(matches!(result, Err(Error::FifoOverflow { len: 65 })));
        assert_eq!(dev.state(), before);
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
