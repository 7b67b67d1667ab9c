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
//!      └─────────┘                                                          ▲
//!       │      ▲                                                             │
//!  Pause│      │Resume                                                       │
//!       ▼      │                                                             │
//!      ┌─────────┐ ── stop request, or the VMM dropped its request channel ──┘
//!      │ Paused  │ ◄─┐ SaveState: reply with the vCPU's state
//!      └─────────┘ ──┘
//! ```
//!
//! - `Running`: enter the guest with KVM_RUN and handle the vCPU exit that ends it. Port I/O and
//!   MMIO exits go to the [`Bus`]es; the state stays `Running`.
//! - `Exiting(reason)`: the vCPU will not run again. It records `reason` as the VM's exit reason if
//!   no other vCPU did so first, signals the VMM's exit event and moves to `Exited`.
//!
//! - `Paused`: the vCPU is out of KVM_RUN with every I/O exit completed, waiting for the VMM's next
//!   [`VcpuRequest`]: `SaveState` (answered with the vCPU's registers, see
//!   [`crate::snapshot`]), `Resume`, or the end of the VM.
//!
//! The VMM stops vCPUs by setting the shared stop flag and sending each thread [`kick_signal`]. The
//! signal handler sets `kvm_run.immediate_exit`, so a kick that lands before KVM_RUN is entered is
//! not lost: the next KVM_RUN returns EINTR at once and the loop sees the flag.
//!
//! It pauses them the same way: it sends [`VcpuRequest::Pause`] on the vCPU's channel, then the
//! kick. The request is looked at only when KVM_RUN returned EINTR, never right after a port-I/O
//! or MMIO exit: KVM completes such an exit (e.g. puts an MMIO read's value in the destination
//! register) only when KVM_RUN is entered again, and that pending completion is in no state
//! userspace can save (Linux `Documentation/virt/kvm/api.rst`, `immediate_exit`). Entering
//! KVM_RUN with `immediate_exit` set completes it without running a guest instruction.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, Once};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use kvm_ioctls::{VcpuExit, VcpuFd};
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::signal::{register_signal_handler, Killable, SIGRTMIN};

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
    /// The vCPU thread has ended, so it cannot take a request.
    #[error("vCPU {0} has stopped")]
    Gone(u8),
    /// The vCPU thread did not answer a request in time.
    #[error("vCPU {id} did not answer within {ms} ms")]
    Timeout {
        /// The vCPU index.
        id: u8,
        /// How long the VMM waited, ms.
        ms: u128,
    },
    /// The kick signal could not be sent.
    #[error("cannot kick vCPU {id}: {source}")]
    Kick {
        /// The vCPU index.
        id: u8,
        /// The OS error.
        source: vmm_sys_util::errno::Error,
    },
}

/// What the VMM asks of a vCPU thread (with a kick, see the module docs).
#[derive(Debug)]
pub enum VcpuRequest {
    /// Leave the guest and wait in `Paused`; answered with [`VcpuResponse::Paused`].
    Pause,
    /// Go back to running the guest; answered with [`VcpuResponse::Resumed`].
    Resume,
    /// Only while paused: save the vCPU's state, with these MSRs (x86_64: KVM's saveable list);
    /// answered with [`VcpuResponse::State`] or [`VcpuResponse::Failed`].
    SaveState(Arc<Vec<u32>>),
}

/// A vCPU thread's answer to a [`VcpuRequest`].
#[derive(Debug)]
pub enum VcpuResponse {
    /// The vCPU is out of the guest and waits.
    Paused,
    /// The vCPU runs the guest again.
    Resumed,
    /// The vCPU's state.
    State(Box<crate::snapshot::VcpuState>),
    /// The request failed; the vCPU stays paused.
    Failed(String),
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
    /// The vCPU's state was restored from a snapshot: tell the guest's kvmclock it was paused
    /// before the first KVM_RUN.
    restored: bool,
}

enum State {
    Running,
    Paused,
    Exiting(ExitReason),
}

/// A started vCPU thread and its request channel.
#[derive(Debug)]
pub struct VcpuHandle {
    id: u8,
    thread: JoinHandle<()>,
    requests: Sender<VcpuRequest>,
    responses: Receiver<VcpuResponse>,
}

impl VcpuHandle {
    /// The vCPU index.
    pub fn id(&self) -> u8 {
        self.id
    }

    /// Sends `request` and kicks the thread out of KVM_RUN.
    ///
    /// # Errors
    /// [`Error::Gone`], [`Error::Kick`].
    pub fn send(&self, request: VcpuRequest) -> Result<(), Error> {
        self.requests
            .send(request)
            .map_err(|_| Error::Gone(self.id))?;
        self.kick()
    }

    /// Waits up to `timeout` for the thread's next answer.
    ///
    /// # Errors
    /// [`Error::Timeout`], [`Error::Gone`].
    pub fn recv(&self, timeout: Duration) -> Result<VcpuResponse, Error> {
        self.responses.recv_timeout(timeout).map_err(|e| match e {
            RecvTimeoutError::Timeout => Error::Timeout {
                id: self.id,
                ms: timeout.as_millis(),
            },
            RecvTimeoutError::Disconnected => Error::Gone(self.id),
        })
    }

    /// Sends the kick signal unless the thread has ended.
    ///
    /// # Errors
    /// [`Error::Kick`].
    pub fn kick(&self) -> Result<(), Error> {
        if self.thread.is_finished() {
            return Ok(());
        }
        self.thread
            .kill(kick_signal())
            .map_err(|source| Error::Kick {
                id: self.id,
                source,
            })
    }

    /// Drops the request channel (a paused vCPU then exits) and returns the thread to join.
    pub fn into_thread(self) -> JoinHandle<()> {
        self.thread
    }
}

/// The vCPU thread's ends of its request channel.
struct Channel {
    requests: Receiver<VcpuRequest>,
    responses: Sender<VcpuResponse>,
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
            restored: false,
        }
    }

    /// Marks the vCPU as restored from a snapshot (see [`crate::snapshot`]): before its first
    /// KVM_RUN the thread tells the guest it was paused (KVM_KVMCLOCK_CTRL, x86_64), so the
    /// guest's watchdogs do not count the time it spent saved as a lockup.
    pub fn mark_restored(&mut self) {
        self.restored = true;
    }

    /// The vCPU's file descriptor (for restoring its state before it starts).
    pub fn fd(&self) -> &VcpuFd {
        &self.fd
    }

    /// Starts the vCPU's thread (`vcpu<id>`) without a seccomp filter.
    ///
    /// # Errors
    /// [`Error::Spawn`], [`Error::SignalHandler`].
    pub fn start(self) -> Result<VcpuHandle, Error> {
        self.start_confined(Arc::new(ThreadFilters::disabled()))
    }

    /// Starts the vCPU's thread (`vcpu<id>`), which installs the vCPU seccomp filter of
    /// `seccomp` before its first KVM_RUN. A filter that cannot be installed ends the vCPU (and
    /// so the VM) with [`ExitReason::Fatal`] before the guest runs on it.
    ///
    /// # Errors
    /// [`Error::Spawn`], [`Error::SignalHandler`].
    pub fn start_confined(self, seccomp: Arc<ThreadFilters>) -> Result<VcpuHandle, Error> {
        install_kick_handler()?;
        let id = self.id;
        let (requests_tx, requests) = mpsc::channel();
        let (responses, responses_rx) = mpsc::channel();
        let channel = Channel {
            requests,
            responses,
        };
        let thread = thread::Builder::new()
            .name(format!("vcpu{id}"))
            .stack_size(super::THREAD_STACK_BYTES)
            .spawn(move || {
                if let Err(e) = seccomp.install(ThreadKind::Vcpu) {
                    self.exiting(ExitReason::Fatal(e.to_string()));
                    return;
                }
                self.run(&channel);
            })
            .map_err(|source| Error::Spawn { id, source })?;
        Ok(VcpuHandle {
            id,
            thread,
            requests: requests_tx,
            responses: responses_rx,
        })
    }

    fn run(mut self, channel: &Channel) {
        let immediate_exit = std::ptr::addr_of_mut!(self.fd.get_kvm_run().immediate_exit);
        IMMEDIATE_EXIT.with(|c| c.set(immediate_exit));
        if self.restored {
            self.tell_guest_it_was_paused();
        }
        let mut state = State::Running;
        loop {
            state = match state {
                State::Running => self.running(channel),
                State::Paused => self.paused(channel),
                State::Exiting(reason) => {
                    self.exiting(reason);
                    break;
                }
            };
        }
        IMMEDIATE_EXIT.with(|c| c.set(std::ptr::null_mut()));
    }

    /// `Running`: one KVM_RUN and the handling of the exit that ended it.
    fn running(&mut self, channel: &Channel) -> State {
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
                // Every I/O exit is complete now: a pause may begin here (module docs).
                match channel.requests.try_recv() {
                    Ok(VcpuRequest::Pause) => {
                        let _ = channel.responses.send(VcpuResponse::Paused);
                        State::Paused
                    }
                    Ok(other) => {
                        self.refuse(channel, &other, "running");
                        State::Running
                    }
                    Err(_) => State::Running,
                }
            }
            Err(e) => State::Exiting(ExitReason::Fatal(format!("KVM_RUN failed: {e}"))),
        }
    }

    /// `Paused`: waits for the VMM's next request. The VMM dropping its end of the channel, or
    /// the stop flag, ends the vCPU.
    fn paused(&mut self, channel: &Channel) -> State {
        let Ok(request) = channel.requests.recv() else {
            return State::Exiting(ExitReason::Stopped);
        };
        if self.shared.stop.load(Ordering::Acquire) {
            return State::Exiting(ExitReason::Stopped);
        }
        match request {
            VcpuRequest::Resume => {
                self.tell_guest_it_was_paused();
                let _ = channel.responses.send(VcpuResponse::Resumed);
                State::Running
            }
            VcpuRequest::SaveState(msrs) => {
                let answer = match crate::snapshot::save_vcpu(&self.fd, &msrs) {
                    Ok(state) => VcpuResponse::State(Box::new(state)),
                    Err(e) => VcpuResponse::Failed(format!("vCPU {}: {e}", self.id)),
                };
                let _ = channel.responses.send(answer);
                State::Paused
            }
            VcpuRequest::Pause => {
                let _ = channel.responses.send(VcpuResponse::Paused);
                State::Paused
            }
        }
    }

    /// Answers a request that is not valid in the current state.
    fn refuse(&self, channel: &Channel, request: &VcpuRequest, state: &str) {
        let _ = channel.responses.send(VcpuResponse::Failed(format!(
            "vCPU {}: {request:?} while {state}",
            self.id
        )));
    }

    /// KVM_KVMCLOCK_CTRL: marks the guest's kvmclock page so its soft-lockup watchdog does not
    /// count the time the vCPU was paused (Linux `Documentation/virt/kvm/api.rst` §4.76). Fails
    /// with EINVAL when the guest does not use kvmclock, which is harmless.
    #[cfg(target_arch = "x86_64")]
    fn tell_guest_it_was_paused(&self) {
        if let Err(e) = self.fd.kvmclock_ctrl() {
            tracing::debug!("vCPU {}: KVM_KVMCLOCK_CTRL: {e}", self.id);
        }
    }

    /// arm64 has no KVM_KVMCLOCK_CTRL (its timers are part of the saved vCPU state).
    #[cfg(not(target_arch = "x86_64"))]
    fn tell_guest_it_was_paused(&self) {}

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
