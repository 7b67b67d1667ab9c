//! A built VM and its lifecycle: start the vCPU threads, run the event loop until the guest (or the
//! embedder) ends the VM, then stop and join every vCPU. Requests on the control socket (pause,
//! resume, snapshot; see [`crate::control`]) are carried out on the event-loop thread between
//! events.

use std::fs::File;
use std::os::unix::io::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use event_manager::{EventManager, EventOps, Events, MutEventSubscriber, SubscriberOps};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use crate::config::VmConfig;
use crate::control::{Answer, AttachShare, ControlSocket, Inbox, Request};
use crate::devices::legacy::panic_watch::GuestPanic;
use crate::devices::virtio::fs::{Fs, ShareFs};
use crate::devices::virtio::mmio::MmioTransport;
use crate::seccomp::{ThreadFilters, ThreadKind};
use crate::snapshot;
use crate::vstate::vcpu::{self, ExitReason, Vcpu, VcpuHandle, VcpuShared};
use crate::vstate::vm::Vm;

/// Errors while running a VM.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A vCPU thread could not be started.
    #[error(transparent)]
    Vcpu(#[from] vcpu::Error),
    /// The event loop failed.
    #[error("event loop failed: {0}")]
    EventLoop(String),
    /// A vCPU thread panicked.
    #[error("vCPU thread {0} panicked")]
    VcpuPanic(usize),
    /// The event loop's seccomp filter could not be installed.
    #[error(transparent)]
    Seccomp(#[from] crate::seccomp::Error),
}

/// Moments of a VM's start-up, for phase timings.
#[derive(Debug, Clone, Default)]
pub struct BootTimeline {
    /// The VMM started building the VM (before opening /dev/kvm).
    pub build_started: Option<Instant>,
    /// KVM_CREATE_VM returned and guest memory was registered.
    pub vm_created: Option<Instant>,
    /// Kernel, initramfs, command line and boot structures are in guest memory.
    pub payload_loaded: Option<Instant>,
    /// The vCPU threads are about to be started (kernel entry: each thread's first KVM_RUN
    /// follows within its thread's start-up).
    pub vcpus_started: Option<Instant>,
    /// The guest's first write to the debug port (its init announcing itself).
    pub guest_first_debug_write: Option<Instant>,
    /// The VM ended and every vCPU thread was joined.
    pub exited: Option<Instant>,
}

impl BootTimeline {
    /// Each recorded moment as milliseconds since `origin` (e.g. the VMM process's start), in
    /// phase order; phases not reached are `None`.
    pub fn offsets_ms(&self, origin: Instant) -> TimelineMs {
        let ms =
            |t: Option<Instant>| t.map(|t| t.saturating_duration_since(origin).as_secs_f64() * 1e3);
        TimelineMs {
            build_started: ms(self.build_started),
            vm_created: ms(self.vm_created),
            payload_loaded: ms(self.payload_loaded),
            vcpus_started: ms(self.vcpus_started),
            guest_init: ms(self.guest_first_debug_write),
            exited: ms(self.exited),
        }
    }
}

/// [`BootTimeline`] as milliseconds from an origin, for reports (`bulkhead-vmm --timings-json`).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TimelineMs {
    /// Build started, ms.
    pub build_started: Option<f64>,
    /// VM created and memory registered, ms.
    pub vm_created: Option<f64>,
    /// Boot payload in guest memory, ms.
    pub payload_loaded: Option<f64>,
    /// vCPU threads started (kernel entry), ms.
    pub vcpus_started: Option<f64>,
    /// The guest's first debug-port write (its init announcing itself), ms.
    pub guest_init: Option<f64>,
    /// VM ended, ms.
    pub exited: Option<f64>,
}

/// A VM ready to run, made by [`crate::builder::build`].
pub struct Vmm {
    // Field order matters for drop: vCPUs and the VM are closed before guest memory is unmapped.
    pub(crate) vcpus: Vec<Vcpu>,
    pub(crate) shared: Arc<VcpuShared>,
    pub(crate) vm: Vm,
    pub(crate) guest_memory: GuestMemoryMmap,
    pub(crate) reset_evt: EventFd,
    pub(crate) debug_first_write: Arc<OnceLock<Instant>>,
    pub(crate) guest_panic: GuestPanic,
    pub(crate) timeline: BootTimeline,
    pub(crate) event_manager: EventLoop,
    /// What a snapshot saves beyond the KVM objects: the configuration, the transports, the
    /// legacy devices and the MSRs to save.
    pub(crate) persist: Persist,
    /// The virtio-fs devices, for [`Request::AttachShare`].
    pub(crate) shares: Vec<Arc<Mutex<Fs>>>,
    pub(crate) control: Option<Inbox>,
}

/// The parts of a VMM only snapshots need.
pub(crate) struct Persist {
    pub(crate) config: VmConfig,
    pub(crate) transports: Vec<Arc<Mutex<MmioTransport>>>,
    pub(crate) legacy: snapshot::LegacyHandles,
    pub(crate) msrs: Arc<Vec<u32>>,
}

/// The VMM's event loop: device queue and backend events, and the VM exit events.
pub(crate) type EventLoop = EventManager<Arc<Mutex<dyn MutEventSubscriber + Send>>>;

impl std::fmt::Debug for Vmm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vmm")
            .field("vcpus", &self.vcpus.len())
            .field("vm", &self.vm)
            .field("timeline", &self.timeline)
            .finish_non_exhaustive()
    }
}

/// A handle to stop a running VM from another thread.
#[derive(Debug, Clone)]
pub struct StopHandle {
    shared: Arc<VcpuShared>,
}

impl StopHandle {
    /// Asks the VM to stop; [`Vmm::run`] then returns [`ExitReason::Stopped`] unless the guest
    /// ended first. Safe to call many times and from any thread.
    pub fn stop(&self) {
        self.shared.record_exit(ExitReason::Stopped);
    }
}

/// The result of running a VM.
#[derive(Debug, Clone)]
pub struct RunOutcome {
    /// Why the VM ended, as KVM and the VMM saw it.
    pub reason: ExitReason,
    /// Text the guest wrote: the reason after a Linux panic banner on its console, if one
    /// appeared (see [`crate::devices::legacy::panic_watch`]). A claim, not an observation.
    pub console_panic: Option<String>,
    /// When each start-up phase happened.
    pub timeline: BootTimeline,
}

impl Vmm {
    /// A handle that stops this VM when asked.
    pub fn stop_handle(&self) -> StopHandle {
        StopHandle {
            shared: self.shared.clone(),
        }
    }

    /// The guest's memory.
    pub fn guest_memory(&self) -> &GuestMemoryMmap {
        &self.guest_memory
    }

    /// The KVM VM.
    pub fn vm(&self) -> &Vm {
        &self.vm
    }

    /// Serves `socket` from the event loop once the VM runs (see [`crate::control`]).
    pub fn serve_control(&mut self, socket: ControlSocket) {
        self.control = Some(socket.inbox());
        self.event_manager
            .add_subscriber(Arc::new(Mutex::new(socket)));
    }

    /// Runs the guest until it resets or powers off, a vCPU fails, or a [`StopHandle`] stops it.
    /// Every vCPU thread has been joined when this returns.
    ///
    /// # Errors
    /// [`Error::Vcpu`] when a vCPU thread cannot start (the VM is stopped first),
    /// [`Error::EventLoop`], [`Error::VcpuPanic`].
    pub fn run(self) -> Result<RunOutcome, Error> {
        self.run_observed(|_| {})
    }

    /// Like [`Vmm::run`], calling `on_started` once, on this thread, right after the vCPU threads
    /// have started and before the event loop first runs (so before any virtio device is
    /// serviced), with the timeline so far (`vcpus_started` set). `bulkhead-vmm` writes its
    /// timings report there. Not called when a vCPU thread cannot start.
    ///
    /// # Errors
    /// As [`Vmm::run`].
    pub fn run_observed(self, on_started: impl FnOnce(&BootTimeline)) -> Result<RunOutcome, Error> {
        self.run_confined(Arc::new(ThreadFilters::disabled()), on_started)
    }

    /// Like [`Vmm::run_observed`], with seccomp filters: each vCPU thread installs the vCPU
    /// filter of `seccomp` before its first KVM_RUN, and this thread installs the event-loop
    /// filter after `on_started` returns, right before the event loop first runs. The filter
    /// stays on this thread after the VM ended (teardown runs under it).
    ///
    /// # Errors
    /// As [`Vmm::run`], and [`Error::Seccomp`] when this thread's filter cannot be installed (the
    /// VM is stopped first).
    pub fn run_confined(
        mut self,
        seccomp: Arc<ThreadFilters>,
        on_started: impl FnOnce(&BootTimeline),
    ) -> Result<RunOutcome, Error> {
        let reset_evt = self
            .reset_evt
            .try_clone()
            .map_err(|e| Error::EventLoop(e.to_string()))?;
        let exit = Arc::new(Mutex::new(ExitWatcher::new(self.shared.clone(), reset_evt)));
        self.event_manager.add_subscriber(exit.clone());

        self.timeline.vcpus_started = Some(Instant::now());
        let (handles, started) = start_vcpus(std::mem::take(&mut self.vcpus), &seccomp);
        let looped = match started {
            Ok(()) => {
                on_started(&self.timeline);
                match seccomp.install(ThreadKind::EventLoop) {
                    Ok(()) => self.event_loop(&exit, &handles),
                    Err(e) => Err(e.into()),
                }
            }
            Err(e) => Err(e),
        };
        let joined = stop_vcpus(&self.shared, handles);
        self.timeline.exited = Some(Instant::now());
        self.timeline.guest_first_debug_write = self.debug_first_write.get().copied();
        looped?;
        joined?;
        let reason = self
            .shared
            .exit_reason
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .unwrap_or(ExitReason::Stopped);
        Ok(RunOutcome {
            reason,
            console_panic: self.guest_panic.get().cloned(),
            timeline: self.timeline.clone(),
        })
    }
}

impl Vmm {
    /// Dispatches events until the VM exit event fires, carrying out control requests between
    /// events.
    fn event_loop(
        &mut self,
        exit: &Arc<Mutex<ExitWatcher>>,
        vcpus: &[VcpuHandle],
    ) -> Result<(), Error> {
        loop {
            if exit.lock().unwrap_or_else(|p| p.into_inner()).fired {
                return Ok(());
            }
            match self.event_manager.run() {
                Ok(_) => {}
                // A signal (e.g. SIGCHLD or a kick) interrupting epoll_wait is not an error.
                Err(event_manager::Error::Epoll(e)) if e.errno() == libc::EINTR => {}
                Err(e) => return Err(Error::EventLoop(e.to_string())),
            }
            self.serve_requests(vcpus);
        }
    }

    /// Carries out every control request received so far and answers it.
    fn serve_requests(&mut self, vcpus: &[VcpuHandle]) {
        let Some(inbox) = &self.control else {
            return;
        };
        let pending = std::mem::take(&mut *inbox.lock().unwrap_or_else(|p| p.into_inner()));
        for mut request in pending {
            let file = request.file.take();
            let result = self.carry_out(&request.request, file, vcpus);
            if let Err(e) = &result {
                tracing::warn!("control request {:?} failed: {e}", request.request);
            }
            request.answer(&Answer::of(result));
        }
    }

    /// Serves the directory `dir` (received with the request) from the idle virtio-fs device
    /// `attach.tag`.
    fn attach_share(&self, attach: &AttachShare, dir: Option<File>) -> Result<(), String> {
        let dir = dir.ok_or("attach_share needs the directory's descriptor (SCM_RIGHTS)")?;
        let device = self
            .shares
            .iter()
            .find(|fs| fs.lock().unwrap_or_else(|p| p.into_inner()).tag() == attach.tag)
            .ok_or_else(|| format!("the VM has no virtio-fs device {:?}", attach.tag))?;
        let label = PathBuf::from(format!("(attached to {})", attach.tag));
        let share = ShareFs::from_root(dir, &label, attach.read_only, attach.owner)
            .map_err(|e| e.to_string())?;
        device
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .attach_share(share)
            .map_err(|e| e.to_string())?;
        tracing::info!(tag = %attach.tag, read_only = attach.read_only, "directory attached");
        Ok(())
    }

    /// Carries out one request; `file` is the descriptor that came with it.
    fn carry_out(
        &mut self,
        request: &Request,
        file: Option<File>,
        vcpus: &[VcpuHandle],
    ) -> Result<(), String> {
        let result = match request {
            Request::Pause => snapshot::pause_vcpus(vcpus),
            Request::Resume => snapshot::resume_vcpus(vcpus),
            Request::Snapshot(req) => self.snapshot(req, vcpus),
            Request::AttachShare(attach) => return self.attach_share(attach, file),
        };
        result.map_err(|e| e.to_string())
    }

    /// Pauses the vCPUs, saves the VM to `req.dir`, then resumes them or (without
    /// `req.resume`) stops the VM.
    fn snapshot(
        &mut self,
        req: &snapshot::SnapshotRequest,
        vcpus: &[VcpuHandle],
    ) -> Result<(), snapshot::Error> {
        snapshot::pause_vcpus(vcpus)?;
        let sources = snapshot::SaveSources {
            vcpus,
            msrs: &self.persist.msrs,
            vm: &self.vm,
            mem: &self.guest_memory,
            transports: &self.persist.transports,
            legacy: &self.persist.legacy,
            config: &self.persist.config,
        };
        let saved = snapshot::save(&sources, &req.dir);
        if req.resume || saved.is_err() {
            snapshot::resume_vcpus(vcpus)?;
        } else {
            tracing::info!("snapshot written to {}; stopping the VM", req.dir.display());
            self.shared.record_exit(ExitReason::Stopped);
        }
        saved
    }
}

/// Starts every vCPU thread (each installs its seccomp filter); on failure returns the threads
/// already started with the error.
fn start_vcpus(
    vcpus: Vec<Vcpu>,
    seccomp: &Arc<ThreadFilters>,
) -> (Vec<VcpuHandle>, Result<(), Error>) {
    let mut handles = Vec::with_capacity(vcpus.len());
    for vcpu in vcpus {
        match vcpu.start_confined(Arc::clone(seccomp)) {
            Ok(h) => handles.push(h),
            Err(e) => return (handles, Err(e.into())),
        }
    }
    (handles, Ok(()))
}

/// Sets the stop flag, kicks every vCPU out of KVM_RUN (a paused one wakes when its request
/// channel closes) and joins the threads.
fn stop_vcpus(shared: &VcpuShared, handles: Vec<VcpuHandle>) -> Result<(), Error> {
    shared.stop.store(true, Ordering::Release);
    for h in &handles {
        if let Err(e) = h.kick() {
            tracing::warn!("{e}");
        }
    }
    let mut result = Ok(());
    for (i, h) in handles.into_iter().enumerate() {
        if h.into_thread().join().is_err() {
            result = Err(Error::VcpuPanic(i));
        }
    }
    result
}

/// Event-loop subscriber that notices when the guest (a vCPU exit or the i8042 reset line) or a
/// [`StopHandle`] ends the VM.
struct ExitWatcher {
    shared: Arc<VcpuShared>,
    reset_evt: EventFd,
    fired: bool,
}

impl ExitWatcher {
    fn new(shared: Arc<VcpuShared>, reset_evt: EventFd) -> Self {
        ExitWatcher {
            shared,
            reset_evt,
            fired: false,
        }
    }
}

impl MutEventSubscriber for ExitWatcher {
    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        // The counters only wake us; the reason is in `exit_reason`.
        if events.fd() == self.reset_evt.as_raw_fd() {
            let _ = self.reset_evt.read();
            self.shared.record_exit(ExitReason::Reset);
        }
        if events.fd() == self.shared.exit_evt.as_raw_fd() {
            let _ = self.shared.exit_evt.read();
        }
        self.fired = true;
    }

    fn init(&mut self, ops: &mut EventOps) {
        for fd in [&self.shared.exit_evt, &self.reset_evt] {
            if let Err(e) = ops.add(Events::new(fd, EventSet::IN)) {
                tracing::error!("cannot watch a VM exit event: {e}");
                self.fired = true;
            }
        }
    }
}
