//! vCPU threads and their run loop.
//!
//! Each vCPU runs on its own thread as a small state machine:
//!
//! ```text
//!            KVM_RUN → handled exit (port I/O, MMIO)
//!          ┌──────────┐
//!          ▼          │
//!      ┌─────────┐ ───┘
//!      │ Running │ ── guest reset/shutdown, fatal exit, or stop request ──► Exiting ──► Exited
//!      └─────────┘
//! ```
//!
//! - `Running`: enter the guest with KVM_RUN and handle the vCPU exit that ends it. Port I/O and
//!   MMIO exits go to the [`Bus`]es; the state stays `Running`.
//! - `Exiting(reason)`: the vCPU will not run again. It records `reason` as the VM's exit reason if
//!   no other vCPU did so first, signals the VMM's exit event and moves to `Exited`.
//!
//! The VMM stops vCPUs by setting the shared stop flag and sending each thread [`kick_signal`]. The
//! signal handler sets `kvm_run.immediate_exit`, so a kick that lands before KVM_RUN is entered is
//! not lost: the next KVM_RUN returns EINTR at once and the loop sees the flag.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::thread::{self, JoinHandle};

use kvm_ioctls::{VcpuExit, VcpuFd};
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::signal::{register_signal_handler, SIGRTMIN};

use crate::devices::bus::Bus;
use crate::seccomp::{ThreadFilters, ThreadKind};

/// Errors from starting vCPU threads.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The thread could not be spawned.
    #[error("cannot start the thread of vCPU {id}: {source}")]
    Spawn {
        /// The vCPU index.
        id: u8,
        /// The OS error.
        source: std::io::Error,
    },
    /// The kick signal handler could not be installed.
    #[error("cannot install the vCPU kick signal handler: {0}")]
    SignalHandler(vmm_sys_util::errno::Error),
}

/// Why a VM stopped running, as seen by the vCPU that stopped first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExitReason {
    /// The guest asked for a reset (i8042 0xfe or KVM_SYSTEM_EVENT_RESET). bulkhead never restarts
    /// a guest: a reset ends the VM, which is how `reboot` shuts a guest down.
    Reset,
    /// The guest powered off (KVM_SYSTEM_EVENT_SHUTDOWN, or a halted vCPU without in-kernel irqchip).
    PowerOff,
    /// The VMM stopped the VM.
    Stopped,
    /// The guest crashed in a way KVM reported: KVM_SYSTEM_EVENT_CRASH, or KVM_EXIT_SHUTDOWN (a
    /// triple fault; our `reboot=k` command line resets through the i8042, so a triple fault is a
    /// crash — a guest booted with `reboot=t` is reported as crashed when it reboots).
    GuestCrash,
    /// KVM or the vCPU failed; the VM cannot continue.
    Fatal(String),
}

impl ExitReason {
    /// Whether the guest ended itself cleanly (reset or power-off).
    pub fn is_clean(&self) -> bool {
        matches!(self, ExitReason::Reset | ExitReason::PowerOff)
    }
}

/// What the vCPU threads share with the VMM.
#[derive(Debug)]
pub struct VcpuShared {
    /// Set by the VMM to ask every vCPU to exit.
    pub stop: AtomicBool,
    /// The first exit reason reported by any vCPU.
    pub exit_reason: Mutex<Option<ExitReason>>,
    /// Signalled by a vCPU when it leaves the `Running` state.
    pub exit_evt: EventFd,
}

impl VcpuShared {
    /// Shared state with a fresh, non-blocking exit event.
    ///
    /// # Errors
    /// The OS error when the eventfd cannot be created.
    pub fn new() -> std::io::Result<Self> {
        Ok(VcpuShared {
            stop: AtomicBool::new(false),
            exit_reason: Mutex::new(None),
            exit_evt: EventFd::new(libc::EFD_NONBLOCK)?,
        })
    }

    /// Records `reason` unless an earlier one is recorded, then signals [`Self::exit_evt`].
    pub fn record_exit(&self, reason: ExitReason) {
        let mut slot = self
            .exit_reason
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        slot.get_or_insert(reason);
        drop(slot);
        if let Err(e) = self.exit_evt.write(1) {
            tracing::error!("cannot signal the VM exit event: {e}");
        }
    }
}

/// The real-time signal used to kick vCPU threads out of KVM_RUN (SIGRTMIN + 0).
pub fn kick_signal() -> libc::c_int {
    SIGRTMIN()
}

thread_local! {
    /// This thread's `kvm_run.immediate_exit` byte, or null on non-vCPU threads.
    static IMMEDIATE_EXIT: Cell<*mut u8> = const { Cell::new(std::ptr::null_mut()) };
}

extern "C" fn handle_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    let ptr = IMMEDIATE_EXIT.with(Cell::get);
    if !ptr.is_null() {
        // SAFETY: the pointer targets the `immediate_exit` field of this thread's mmap'd kvm_run
        // area, set by the vCPU thread for its own vCPU and cleared before the VcpuFd is dropped.
        // A single volatile byte store is async-signal-safe.
        unsafe { std::ptr::write_volatile(ptr, 1) };
    }
}

fn install_kick_handler() -> Result<(), Error> {
    static INSTALL: Once = Once::new();
    let mut result = Ok(());
    INSTALL.call_once(|| {
        result = register_signal_handler(kick_signal(), handle_kick).map_err(Error::SignalHandler);
    });
    result
}

/// One virtual CPU with the buses its exits are routed to.
#[derive(Debug)]
pub struct Vcpu {
    fd: VcpuFd,
    id: u8,
    pio: Arc<Bus>,
    mmio: Arc<Bus>,
    shared: Arc<VcpuShared>,
}

enum State {
    Running,
    Exiting(ExitReason),
}

impl Vcpu {
    /// A vCPU (already configured for boot) routing port I/O to `pio` and MMIO to `mmio`.
    pub fn new(fd: VcpuFd, id: u8, pio: Arc<Bus>, mmio: Arc<Bus>, shared: Arc<VcpuShared>) -> Self {
        Vcpu {
            fd,
            id,
            pio,
            mmio,
            shared,
        }
    }

    /// Starts the vCPU's thread (`vcpu<id>`) without a seccomp filter.
    ///
    /// # Errors
    /// [`Error::Spawn`], [`Error::SignalHandler`].
    pub fn start(self) -> Result<JoinHandle<()>, Error> {
        self.start_confined(Arc::new(ThreadFilters::disabled()))
    }

    /// Starts the vCPU's thread (`vcpu<id>`), which installs the vCPU seccomp filter of
    /// `seccomp` before its first KVM_RUN. A filter that cannot be installed ends the vCPU (and
    /// so the VM) with [`ExitReason::Fatal`] before the guest runs on it.
    ///
    /// # Errors
    /// [`Error::Spawn`], [`Error::SignalHandler`].
    pub fn start_confined(self, seccomp: Arc<ThreadFilters>) -> Result<JoinHandle<()>, Error> {
        install_kick_handler()?;
        let id = self.id;
        thread::Builder::new()
            .name(format!("vcpu{id}"))
            .stack_size(super::THREAD_STACK_BYTES)
            .spawn(move || {
                if let Err(e) = seccomp.install(ThreadKind::Vcpu) {
                    self.exiting(ExitReason::Fatal(e.to_string()));
                    return;
                }
                self.run();
            })
            .map_err(|source| Error::Spawn { id, source })
    }

    fn run(mut self) {
        let immediate_exit = std::ptr::addr_of_mut!(self.fd.get_kvm_run().immediate_exit);
        IMMEDIATE_EXIT.with(|c| c.set(immediate_exit));
        let mut state = State::Running;
        loop {
            state = match state {
                State::Running => self.running(),
                State::Exiting(reason) => {
                    self.exiting(reason);
                    break;
                }
            };
        }
        IMMEDIATE_EXIT.with(|c| c.set(std::ptr::null_mut()));
    }

    /// `Running`: one KVM_RUN and the handling of the exit that ended it.
    fn running(&mut self) -> State {
        if self.shared.stop.load(Ordering::Acquire) {
            return State::Exiting(ExitReason::Stopped);
        }
        match self.fd.run() {
            Ok(VcpuExit::Shutdown) => {
                self.log_shutdown();
                State::Exiting(ExitReason::GuestCrash)
            }
            Ok(exit) => handle_exit(exit, &self.pio, &self.mmio),
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                self.fd.set_kvm_immediate_exit(0);
                State::Running
            }
            Err(e) => State::Exiting(ExitReason::Fatal(format!("KVM_RUN failed: {e}"))),
        }
    }

    /// KVM_EXIT_SHUTDOWN: the guest triple-faulted. Logs the registers (on AMD SVM, KVM has already
    /// reset the vCPU by then, so they show the reset vector, not the fault).
    #[cfg(target_arch = "x86_64")]
    fn log_shutdown(&self) {
        let rip = self.fd.get_regs().map(|r| r.rip).unwrap_or_default();
        let (cr2, cr3) = self
            .fd
            .get_sregs()
            .map(|s| (s.cr2, s.cr3))
            .unwrap_or_default();
        tracing::warn!(
            "vCPU {}: KVM_EXIT_SHUTDOWN (triple fault): the guest crashed; rip {rip:#x}, cr2 {cr2:#x}, cr3 {cr3:#x}",
            self.id
        );
    }

    /// KVM_EXIT_SHUTDOWN outside x86_64 (arm64 KVM reports guest power-off and reset as
    /// system events instead).
    #[cfg(not(target_arch = "x86_64"))]
    fn log_shutdown(&self) {
        tracing::warn!("vCPU {}: KVM_EXIT_SHUTDOWN: the guest crashed", self.id);
    }

    /// `Exiting`: report the reason and wake the VMM.
    fn exiting(&self, reason: ExitReason) {
        match &reason {
            ExitReason::Fatal(msg) => tracing::error!("vCPU {} stopped: {msg}", self.id),
            other => tracing::debug!("vCPU {} exiting: {other:?}", self.id),
        }
        self.shared.record_exit(reason);
    }
}

/// KVM_SYSTEM_EVENT_* types (linux/kvm.h).
const SYSTEM_EVENT_SHUTDOWN: u32 = 1;
const SYSTEM_EVENT_RESET: u32 = 2;
const SYSTEM_EVENT_CRASH: u32 = 3;

/// Maps one vCPU exit to the next state, performing the device access it asks for.
fn handle_exit(exit: VcpuExit<'_>, pio: &Bus, mmio: &Bus) -> State {
    match exit {
        VcpuExit::IoIn(port, data) => {
            pio.read(u64::from(port), data);
            State::Running
        }
        VcpuExit::IoOut(port, data) => {
            pio.write(u64::from(port), data);
            State::Running
        }
        VcpuExit::MmioRead(addr, data) => {
            mmio.read(addr, data);
            State::Running
        }
        VcpuExit::MmioWrite(addr, data) => {
            mmio.write(addr, data);
            State::Running
        }
        VcpuExit::Shutdown => State::Exiting(ExitReason::GuestCrash),
        VcpuExit::Hlt => State::Exiting(ExitReason::PowerOff),
        VcpuExit::SystemEvent(kind, _) => State::Exiting(system_event_reason(kind)),
        VcpuExit::FailEntry(reason, cpu) => State::Exiting(ExitReason::Fatal(format!(
            "VM entry failed: hardware reason {reason:#x} on host CPU {cpu}"
        ))),
        VcpuExit::InternalError => State::Exiting(ExitReason::Fatal(
            "KVM internal error (KVM_EXIT_INTERNAL_ERROR)".into(),
        )),
        other => State::Exiting(ExitReason::Fatal(format!(
            "unexpected vCPU exit: {other:?}"
        ))),
    }
}

fn system_event_reason(kind: u32) -> ExitReason {
    match kind {
        SYSTEM_EVENT_SHUTDOWN => ExitReason::PowerOff,
        SYSTEM_EVENT_RESET => ExitReason::Reset,
        SYSTEM_EVENT_CRASH => ExitReason::GuestCrash,
        other => ExitReason::Fatal(format!("unknown KVM system event {other}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn system_events_map_to_exit_reasons() {
        assert_eq!(system_event_reason(1), ExitReason::PowerOff);
        assert_eq!(system_event_reason(2), ExitReason::Reset);
        assert_eq!(system_event_reason(3), ExitReason::GuestCrash);
        assert!(matches!(system_event_reason(99), ExitReason::Fatal(_)));
    }

    #[test]
    fn first_exit_reason_wins() {
        let shared = VcpuShared::new().unwrap();

        shared.record_exit(ExitReason::Reset);
        shared.record_exit(ExitReason::Stopped);

        assert_eq!(*shared.exit_reason.lock().unwrap(), Some(ExitReason::Reset));
        assert_eq!(shared.exit_evt.read().unwrap(), 2);
    }

    #[test]
    fn triple_fault_is_a_guest_crash_and_io_keeps_running() {
        let bus = Bus::default();
        let mut data = [0u8; 1];

        assert!(matches!(
            handle_exit(VcpuExit::Shutdown, &bus, &bus),
            State::Exiting(ExitReason::GuestCrash)
        ));
        assert!(matches!(
            handle_exit(VcpuExit::IoIn(0x3f8, &mut data), &bus, &bus),
            State::Running
        ));
        assert_eq!(data, [0xff]);
    }
}
