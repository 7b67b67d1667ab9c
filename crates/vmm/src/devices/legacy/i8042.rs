//! The i8042 PS/2 controller, as much of it as a Linux guest's driver needs to probe quickly and
//! as its `reboot` (with `reboot=k`) needs to end the VM.
//!
//! Ports: data 0x60, command/status 0x64. The controller answers the commands Linux's i8042 driver
//! sends while probing (read/write the controller configuration byte, self test, interface test,
//! enable/disable the keyboard and aux ports), so the probe finishes with no timeouts. No keyboard
//! or mouse is attached: bytes sent to the keyboard are acknowledged and dropped. The CPU-reset
//! command (0xfe), or clearing the reset bit through "write output port" (0xd1), signals the VMM's
//! reset event. Reference: the IBM PC/AT technical reference's 8042 command set, as used by
//! `drivers/input/serio/i8042.c`.
//!
//! The controller's few registers are saved in snapshots as [`I8042State`].

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};
use vm_superio::Trigger;

use super::EventFdTrigger;
use crate::devices::bus::BusDevice;

/// First port of the controller (data port 0x60; command/status port is 0x64).
pub const I8042_PORT: u64 = 0x60;
/// Ports 0x60..=0x64.
pub const I8042_PORT_COUNT: u64 = 5;
/// Legacy IRQ of the keyboard port.
pub const I8042_KBD_IRQ: u32 = 1;

const DATA_OFFSET: u64 = 0;
const COMMAND_OFFSET: u64 = 4;

// Status register bits.
const SB_OUT_FULL: u8 = 0x01;
const SB_SYSTEM_FLAG: u8 = 0x04;
const SB_LAST_WAS_CMD: u8 = 0x08;
const SB_KBD_UNLOCKED: u8 = 0x10;

// Controller configuration byte ("CTR") bits.
const CB_KBD_INT: u8 = 0x01;
const CB_POST_OK: u8 = 0x04;
const CB_KBD_DISABLE: u8 = 0x10;
const CB_AUX_DISABLE: u8 = 0x20;
const CB_TRANSLATE: u8 = 0x40;

// Controller commands (written to port 0x64).
const CMD_READ_CTR: u8 = 0x20;
const CMD_WRITE_CTR: u8 = 0x60;
const CMD_AUX_DISABLE: u8 = 0xa7;
const CMD_AUX_ENABLE: u8 = 0xa8;
const CMD_AUX_TEST: u8 = 0xa9;
const CMD_SELF_TEST: u8 = 0xaa;
const CMD_KBD_TEST: u8 = 0xab;
const CMD_KBD_DISABLE: u8 = 0xad;
const CMD_KBD_ENABLE: u8 = 0xae;
const CMD_READ_OUTPORT: u8 = 0xd0;
const CMD_WRITE_OUTPORT: u8 = 0xd1;
const CMD_WRITE_KBD_OUTBUF: u8 = 0xd2;
const CMD_RESET_CPU: u8 = 0xfe;

// Replies.
const SELF_TEST_OK: u8 = 0x55;
const PORT_TEST_OK: u8 = 0x00;
const KBD_ACK: u8 = 0xfa;
/// Output port value: bit 0 clear would hold the CPU in reset, bit 1 is the A20 gate.
const OUTPORT_DEFAULT: u8 = 0x03;

/// Bound on queued output bytes; a guest that never reads cannot grow it further.
pub const OUTPUT_QUEUE_MAX: usize = 16;
/// Status bits the controller keeps (the output-buffer-full bit follows the output queue).
const SB_KEPT: u8 = SB_SYSTEM_FLAG | SB_LAST_WAS_CMD | SB_KBD_UNLOCKED;

/// Errors from restoring the controller.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The saved output queue is longer than the controller ever holds.
    #[error("i8042 state in the snapshot queues {len} output bytes; at most 16 are kept")]
    OutputTooLong {
        /// Bytes in the saved queue.
        len: usize,
    },
    /// The saved status register has bits the controller never sets.
    #[error("i8042 state in the snapshot has an invalid status register {0:#04x}")]
    Status(u8),
}

/// What the next byte written to the data port means.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DataTarget {
    /// A command for the (absent) keyboard.
    Keyboard,
    /// The new controller configuration byte (after 0x60).
    Ctr,
    /// The new output port value (after 0xd1).
    OutputPort,
    /// A byte to place in the output buffer as if the keyboard sent it (after 0xd2).
    KbdOutputBuffer,
}

/// The controller's state in a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct I8042State {
    /// Status register bits (system flag, last write was a command, keyboard unlocked); the
    /// output-buffer-full bit is derived from `output`.
    pub status: u8,
    /// Controller configuration byte.
    pub ctr: u8,
    /// Output port (bit 0: CPU not in reset, bit 1: A20).
    pub outport: u8,
    /// Bytes waiting for the guest to read from the data port, oldest first (at most 16).
    pub output: Vec<u8>,
    /// What the next data-port write means.
    pub data_target: DataTarget,
}

/// The i8042 on the port-I/O bus.
#[derive(Debug)]
pub struct I8042 {
    reset: EventFdTrigger,
    kbd_irq: Option<EventFdTrigger>,
    status: u8,
    ctr: u8,
    outport: u8,
    output: VecDeque<u8>,
    data_target: DataTarget,
}

impl I8042 {
    /// A controller that signals `reset` when the guest resets the CPU and, if `kbd_irq` is given,
    /// raises IRQ 1 when it has a byte for the guest and the guest enabled keyboard interrupts.
    pub fn new(reset: EventFdTrigger, kbd_irq: Option<EventFdTrigger>) -> Self {
        I8042 {
            reset,
            kbd_irq,
            status: SB_SYSTEM_FLAG | SB_KBD_UNLOCKED,
            ctr: CB_KBD_INT | CB_POST_OK | CB_TRANSLATE,
            outport: OUTPORT_DEFAULT,
            output: VecDeque::new(),
            data_target: DataTarget::Keyboard,
        }
    }

    /// The controller's registers, for a snapshot.
    pub fn state(&self) -> I8042State {
        I8042State {
            status: self.status,
            ctr: self.ctr,
            outport: self.outport,
            output: self.output.iter().copied().collect(),
            data_target: self.data_target,
        }
    }

    /// Restores the registers of `state` (from a snapshot; untrusted), keeping this controller's
    /// reset event and interrupt line.
    ///
    /// # Errors
    /// [`Error::OutputTooLong`] or [`Error::Status`]; the controller is unchanged on error.
    pub fn restore(&mut self, state: &I8042State) -> Result<(), Error> {
        if state.output.len() > OUTPUT_QUEUE_MAX {
            return Err(Error::OutputTooLong {
                len: state.output.len(),
            });
        }
        if state.status & !SB_KEPT != 0 {
            return Err(Error::Status(state.status));
        }
        self.status = state.status;
        self.ctr = state.ctr;
        self.outport = state.outport;
        self.output = state.output.iter().copied().collect();
        self.data_target = state.data_target;
        Ok(())
    }

    fn push_output(&mut self, byte: u8) {
        if self.output.len() >= OUTPUT_QUEUE_MAX {
            return;
        }
        self.output.push_back(byte);
        if self.ctr & CB_KBD_INT != 0 {
            if let Some(irq) = &self.kbd_irq {
                if let Err(e) = irq.trigger() {
                    tracing::debug!("i8042 interrupt failed: {e}");
                }
            }
        }
    }

    fn request_reset(&self) {
        if let Err(e) = self.reset.trigger() {
            tracing::error!("cannot signal the guest's reset request: {e}");
        }
    }

    fn status(&self) -> u8 {
        let full = if self.output.is_empty() {
            0
        } else {
            SB_OUT_FULL
        };
        self.status | full
    }

    fn command(&mut self, cmd: u8) {
        self.status |= SB_LAST_WAS_CMD;
        match cmd {
            CMD_READ_CTR => self.push_output(self.ctr),
            CMD_WRITE_CTR => self.data_target = DataTarget::Ctr,
            CMD_AUX_DISABLE => self.ctr |= CB_AUX_DISABLE,
            CMD_AUX_ENABLE => self.ctr &= !CB_AUX_DISABLE,
            CMD_SELF_TEST => self.push_output(SELF_TEST_OK),
            CMD_KBD_TEST | CMD_AUX_TEST => self.push_output(PORT_TEST_OK),
            CMD_KBD_DISABLE => self.ctr |= CB_KBD_DISABLE,
            CMD_KBD_ENABLE => self.ctr &= !CB_KBD_DISABLE,
            CMD_READ_OUTPORT => self.push_output(self.outport),
            CMD_WRITE_OUTPORT => self.data_target = DataTarget::OutputPort,
            CMD_WRITE_KBD_OUTBUF => self.data_target = DataTarget::KbdOutputBuffer,
            CMD_RESET_CPU => self.request_reset(),
            other => tracing::debug!("i8042: ignoring command {other:#x}"),
        }
    }

    fn data(&mut self, value: u8) {
        self.status &= !SB_LAST_WAS_CMD;
        match std::mem::replace(&mut self.data_target, DataTarget::Keyboard) {
            DataTarget::Ctr => self.ctr = value,
            DataTarget::OutputPort => {
                self.outport = value;
                if value & 0x01 == 0 {
                    self.request_reset();
                }
            }
            DataTarget::KbdOutputBuffer => self.push_output(value),
            // No keyboard is attached; acknowledge so the driver does not wait.
            DataTarget::Keyboard => self.push_output(KBD_ACK),
        }
    }
}

impl BusDevice for I8042 {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        let value = match offset {
            DATA_OFFSET => self.output.pop_front().unwrap_or(0),
            COMMAND_OFFSET => self.status(),
            _ => 0xff,
        };
        data.fill(value);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let Some(&value) = data.first() else { return };
        match offset {
            DATA_OFFSET => self.data(value),
            COMMAND_OFFSET => self.command(value),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

    use super::*;

    fn controller() -> (I8042, EventFd) {
        let reset = EventFd::new(EFD_NONBLOCK).unwrap();
        let dev = I8042::new(EventFdTrigger::new(reset.try_clone().unwrap()), None);
        (dev, reset)
    }

    fn read(dev: &mut I8042, offset: u64) -> u8 {
        let mut b = [0u8];
        dev.read(offset, &mut b);
        b[0]
    }

    #[test]
    fn reset_command_signals_the_reset_event() {
        let (mut dev, reset) = controller();

        dev.write(COMMAND_OFFSET, &[CMD_RESET_CPU]);

        assert_eq!(reset.read().unwrap(), 1);
    }

    #[test]
    fn clearing_the_reset_line_of_the_output_port_resets() {
        let (mut dev, reset) = controller();

        dev.write(COMMAND_OFFSET, &[CMD_WRITE_OUTPORT]);
        dev.write(DATA_OFFSET, &[0x02]);

        assert_eq!(reset.read().unwrap(), 1);
    }

    #[test]
    fn other_writes_do_not_reset() {
        let (mut dev, reset) = controller();

        dev.write(COMMAND_OFFSET, &[0x55]);
        dev.write(DATA_OFFSET, &[CMD_RESET_CPU]);

        assert!(reset.read().is_err(), "no reset expected");
    }

    #[test]
    fn ctr_round_trips_like_the_linux_probe_expects() {
        let (mut dev, _reset) = controller();

        dev.write(COMMAND_OFFSET, &[CMD_READ_CTR]);
        let full = read(&mut dev, COMMAND_OFFSET) & SB_OUT_FULL;
        let ctr = read(&mut dev, DATA_OFFSET);
        dev.write(COMMAND_OFFSET, &[CMD_WRITE_CTR]);
        dev.write(DATA_OFFSET, &[0x61]);
        dev.write(COMMAND_OFFSET, &[CMD_READ_CTR]);

        assert_eq!(full, SB_OUT_FULL);
        assert_eq!(ctr, CB_KBD_INT | CB_POST_OK | CB_TRANSLATE);
        assert_eq!(read(&mut dev, DATA_OFFSET), 0x61);
        assert_eq!(read(&mut dev, COMMAND_OFFSET) & SB_OUT_FULL, 0);
    }

    #[test]
    fn self_test_and_keyboard_commands_are_answered() {
        let (mut dev, _reset) = controller();

        dev.write(COMMAND_OFFSET, &[CMD_SELF_TEST]);
        dev.write(COMMAND_OFFSET, &[CMD_KBD_TEST]);
        dev.write(DATA_OFFSET, &[0xf2]); // keyboard "identify"

        assert_eq!(read(&mut dev, DATA_OFFSET), SELF_TEST_OK);
        assert_eq!(read(&mut dev, DATA_OFFSET), PORT_TEST_OK);
        assert_eq!(read(&mut dev, DATA_OFFSET), KBD_ACK);
    }

    #[test]
    fn output_queue_is_bounded() {
        let (mut dev, _reset) = controller();

        for _ in 0..1000 {
            dev.write(COMMAND_OFFSET, &[CMD_SELF_TEST]);
        }

        assert_eq!(dev.output.len(), OUTPUT_QUEUE_MAX);
    }

    #[test]
    fn restored_state_keeps_the_configuration_byte_and_pending_output() {
        let (mut saved, _reset) = controller();
        saved.write(COMMAND_OFFSET, &[CMD_WRITE_CTR]);
        saved.write(DATA_OFFSET, &[0x47]);
        saved.write(COMMAND_OFFSET, &[CMD_SELF_TEST]);
        saved.write(COMMAND_OFFSET, &[CMD_WRITE_OUTPORT]);
        let state = saved.state();
        let json = serde_json::to_string(&state).unwrap();
        let (mut restored, reset) = controller();

        restored
            .restore(&serde_json::from_str(&json).unwrap())
            .unwrap();

        assert_eq!(restored.state(), state);
        assert_eq!(
            read(&mut restored, COMMAND_OFFSET) & SB_OUT_FULL,
            SB_OUT_FULL
        );
        assert_eq!(read(&mut restored, DATA_OFFSET), SELF_TEST_OK);
        // The pending "write output port" takes the next data byte: clearing bit 0 resets.
        restored.write(DATA_OFFSET, &[0x02]);
        assert_eq!(reset.read().unwrap(), 1);
        restored.write(COMMAND_OFFSET, &[CMD_READ_CTR]);
        assert_eq!(read(&mut restored, DATA_OFFSET), 0x47);
    }

    #[test]
    fn restore_refuses_an_oversized_output_queue_and_unknown_status_bits() {
        let (mut dev, _reset) = controller();
        let before = dev.state();
        let long = I8042State {
            output: vec![0; OUTPUT_QUEUE_MAX + 1],
            ..before.clone()
        };
        let bad_status = I8042State {
            status: 0x80,
            ..before.clone()
        };

        let long_result = dev.restore(&long);
        let status_result = dev.restore(&bad_status);

        assert!(matches!(long_result, Err(Error::OutputTooLong { len: 17 })));
        assert!(matches!(status_result, Err(Error::Status(0x80))));
        assert_eq!(dev.state(), before);
    }

    #[test]
    fn keyboard_interrupt_fires_when_enabled() {
        let reset = EventFd::new(EFD_NONBLOCK).unwrap();
        let irq = EventFd::new(EFD_NONBLOCK).unwrap();
        let mut dev = I8042::new(
            EventFdTrigger::new(reset),
            Some(EventFdTrigger::new(irq.try_clone().unwrap())),
        );

        dev.write(COMMAND_OFFSET, &[CMD_SELF_TEST]);

        assert_eq!(irq.read().unwrap(), 1);
    }
}
