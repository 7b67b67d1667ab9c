//! Legacy PC devices on the port-I/O bus: the 8250 UART console, the i8042 controller's CPU-reset
//! line and a debug port.

pub mod debugcon;
pub mod i8042;
pub mod panic_watch;
pub mod serial;

use std::io;

use vmm_sys_util::eventfd::EventFd;

/// An [`EventFd`] that devices signal to raise an interrupt (through an irqfd) or to report an
/// event to the VMM's event loop.
#[derive(Debug)]
pub struct EventFdTrigger(EventFd);

impl EventFdTrigger {
    /// Wraps `evt`.
    pub fn new(evt: EventFd) -> Self {
        EventFdTrigger(evt)
    }

    /// The wrapped event file descriptor.
    pub fn eventfd(&self) -> &EventFd {
        &self.0
    }
}

impl vm_superio::Trigger for EventFdTrigger {
    type E = io::Error;

    fn trigger(&self) -> io::Result<()> {
        self.0.write(1)
    }
}
