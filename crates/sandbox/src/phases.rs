//! Phase timestamps of a sandbox's cold start or restore, all on one timeline: time since its
//! `bulkhead-vmm` process started, on the host's monotonic clock.
//!
//! | phase | source |
//! |---|---|
//! | `vmm_start` | the VMM's `main` entry (the origin, always 0) |
//! | `vm_created` | VMM: `KVM_CREATE_VM` returned and guest memory is registered |
//! | `memory_ready` | VMM: kernel, initramfs, command line and boot structures are in guest memory |
//! | `kernel_entry` | VMM: the vCPU threads start (each enters the guest at the kernel's entry) |
//! | `guest_init` | agent: its `main` started (estimated, see below) |
//! | `agent_ready` | host: the sandbox received the agent's `Ready` on vsock |
//! | `first_output` | host: the first output or exit status of a command ([`crate::Sandbox::mark_first_output`]) |
//! | `vm_destroyed` | host: the VMM process was stopped and reaped ([`crate::Sandbox::destroy_timed`]) |
//!
//! The VMM's moments come from its timings report (`bulkhead-vmm --timings-json`, written into
//! the runtime directory's `vmm/` as soon as the vCPUs run and before the VMM services any device, so it
//! is complete by the time the agent's `Ready` arrives: no waiting). The report carries the VMM's
//! start as `CLOCK_MONOTONIC` nanoseconds, which places host moments of this process on the same
//! timeline.
//!
//! A restore from a snapshot ([`crate::Sandbox::restore`]) has the same phases, but for
//! `guest_init` (its guest booted when the template was made), and three of them mean the
//! restore's steps:
//!
//! | phase | a restore's moment |
//! |---|---|
//! | `vm_created` | VMM: the state file is read and checked, the memory file mapped copy-on-write, `KVM_CREATE_VM` returned |
//! | `memory_ready` | VMM: the devices and every vCPU's saved state are in KVM (the VM is whole, paused) |
//! | `kernel_entry` | VMM: the vCPU threads start: the guest resumes where the snapshot paused it |
//! | `agent_ready` | host: the agent acknowledged the restore (`Restored`: entropy, clock, hostname) |
//!
//! **`guest_init` is an approximation.** The guest has its own clock; the agent reports
//! `CLOCK_BOOTTIME` at the start of its `main`. That clock starts near zero when the guest kernel
//! sets up its clocks, shortly *after* kernel entry, so `kernel_entry + boottime` is anchored at
//! kernel entry and runs early by however long the kernel ran before its clock started: 60-130
//! ms in the nested test host (the guest's "kvm-clock: using sched offset" line gives the clock's
//! start in ns since the VM was created; see `benches/results/README.md`), so that much of
//! `kernel_entry → guest_init` is booked to `guest_init → agent_ready`. When the test host
//! stalls early in the guest's boot the error grows: 0.45 s in one profiled boot (part 5 of that
//! README). Compare `kernel_entry → agent_ready` when the split matters. The estimate is clamped
//! to `[kernel_entry, agent_ready]`, the interval in which the agent's start certainly lies.

use std::path::Path;
use std::time::{Duration, Instant};

use bulkhead_protocol::Ready;
use bulkhead_vmm::timings::{monotonic_ns, TimingsReport};

/// The VMM's timings report, relative to a sandbox's runtime directory: in `vmm/`, the one
/// sub-directory a jailed VMM may write (see [`crate::jail`]).
pub const REPORT_FILE: &str = "vmm/timings.json";

/// Names of the phases, in timeline order (the keys of the bench JSON, see [`Phases::named`]).
pub const PHASE_NAMES: [&str; 8] = [
    "vmm_start",
    "vm_created",
    "memory_ready",
    "kernel_entry",
    "guest_init",
    "agent_ready",
    "first_output",
    "vm_destroyed",
];

/// When a sandbox reached each start-up phase: time since its VMM process started (see the
/// module docs for each phase's source).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Phases {
    /// KVM VM created and guest memory registered.
    pub vm_created: Duration,
    /// The boot payload is in guest memory.
    pub memory_ready: Duration,
    /// The vCPU threads start (kernel entry).
    pub kernel_entry: Duration,
    /// The guest agent's `main` started (an estimate from the guest's clock); `None` for a
    /// restore, whose guest did not boot.
    pub guest_init: Option<Duration>,
    /// The host received the agent's readiness announcement.
    pub agent_ready: Duration,
    /// The first output (or exit status) of a command arrived, once
    /// [`crate::Sandbox::mark_first_output`] was called.
    pub first_output: Option<Duration>,
    /// The VMM was stopped and reaped, in [`crate::Sandbox::destroy_timed`].
    pub vm_destroyed: Option<Duration>,
}

impl Phases {
    /// Every phase as `(name, time since the VMM started)` in [`PHASE_NAMES`] order;
    /// `vmm_start` is zero, phases not reached are `None`.
    pub fn named(&self) -> [(&'static str, Option<Duration>); 8] {
        let at = [
            Some(Duration::ZERO),
            Some(self.vm_created),
            Some(self.memory_ready),
            Some(self.kernel_entry),
            self.guest_init,
            Some(self.agent_ready),
            self.first_output,
            self.vm_destroyed,
        ];
        let mut named = [("", None); 8];
        for (slot, (name, at)) in named.iter_mut().zip(PHASE_NAMES.iter().zip(at)) {
            *slot = (*name, at);
        }
        named
    }

    /// Builds the phases from the VMM's report, the agent's announcement and the moment the
    /// host received it. `None` when the report lacks a VMM phase (it was not written while the
    /// VM ran, e.g. by an older `bulkhead-vmm`).
    pub(crate) fn from_report(
        report: &TimingsReport,
        clock: &PhaseClock,
        ready: &Ready,
        ready_at: Instant,
    ) -> Option<Phases> {
        let mut phases = Phases::from_restore_report(report, clock, ready_at)?;
        let boottime = Duration::from_nanos(ready.init_started.boottime_ns);
        let kernel_entry = phases.kernel_entry;
        let guest_init = kernel_entry
            .saturating_add(boottime)
            .clamp(kernel_entry, phases.agent_ready.max(kernel_entry));
        phases.guest_init = Some(guest_init);
        Some(phases)
    }

    /// Builds a restore's phases from the VMM's report and the moment the agent acknowledged
    /// the restore (see the module docs): every phase but `guest_init`, which a cold start
    /// adds ([`Phases::from_report`]). `None` when the report lacks a VMM phase.
    pub(crate) fn from_restore_report(
        report: &TimingsReport,
        clock: &PhaseClock,
        acknowledged_at: Instant,
    ) -> Option<Phases> {
        let ms = |v: Option<f64>| v.and_then(|ms| Duration::try_from_secs_f64(ms / 1e3).ok());
        let t = &report.timeline;
        Some(Phases {
            vm_created: ms(t.vm_created)?,
            memory_ready: ms(t.payload_loaded)?,
            kernel_entry: ms(t.vcpus_started)?,
            guest_init: None,
            agent_ready: clock.offset(acknowledged_at),
            first_output: None,
            vm_destroyed: None,
        })
    }
}

/// Start-up phase timings of a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timings {
    /// From the start of [`crate::Sandbox::start`] to the VMM process being spawned.
    pub spawn: Duration,
    /// From the start of [`crate::Sandbox::start`] to the agent's readiness announcement.
    pub ready: Duration,
    /// From the start of [`crate::Sandbox::start`] to the VMM process's start (the origin of
    /// [`Timings::phases`]); `None` without phases.
    pub vmm_start: Option<Duration>,
    /// Every phase as time since the VMM process started (see the [module docs](self)); `None`
    /// when the VMM's timings report was unreadable, and for adopted sandboxes.
    pub phases: Option<Phases>,
}

impl Timings {
    /// From the start of [`crate::Sandbox::start`] to the first output, when both are known (the
    /// end-to-end cold start that public sandbox benchmarks report).
    pub fn create_to_first_output(&self) -> Option<Duration> {
        Some(self.vmm_start? + self.phases?.first_output?)
    }
}

/// The VMM's timeline and the phases up to agent-ready; `(None, None)` when its timings report
/// (written before the VMM serves the device that carried `ready`) is unreadable.
pub(crate) fn read(
    report: &Path,
    ready: &Ready,
    ready_at: Instant,
) -> (Option<PhaseClock>, Option<Phases>) {
    read_with(report, |report, clock| {
        Phases::from_report(report, clock, ready, ready_at)
    })
}

/// [`read`] for a restore whose agent acknowledged it at `acknowledged_at`.
pub(crate) fn read_restored(
    report: &Path,
    acknowledged_at: Instant,
) -> (Option<PhaseClock>, Option<Phases>) {
    read_with(report, |report, clock| {
        Phases::from_restore_report(report, clock, acknowledged_at)
    })
}

fn read_with(
    report: &Path,
    phases: impl FnOnce(&TimingsReport, &PhaseClock) -> Option<Phases>,
) -> (Option<PhaseClock>, Option<Phases>) {
    let report = match TimingsReport::read(report) {
        Ok(report) => report,
        Err(e) => {
            tracing::debug!("no phase timings: {e}");
            return (None, None);
        }
    };
    let clock = PhaseClock::from_monotonic(report.origin_monotonic_ns);
    let phases = clock.and_then(|c| phases(&report, &c));
    (clock, phases)
}

/// Places host [`Instant`]s on a VMM's timeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PhaseClock {
    origin: Instant,
}

impl PhaseClock {
    /// The clock whose origin is `origin_monotonic_ns` (host `CLOCK_MONOTONIC`, ns), converted
    /// to an [`Instant`] through a reading of both clocks now. `None` when the origin is in the
    /// future or unrepresentable (not a report of this host's boot).
    pub fn from_monotonic(origin_monotonic_ns: u64) -> Option<PhaseClock> {
        let (now, now_ns) = (Instant::now(), monotonic_ns());
        let ago = Duration::from_nanos(now_ns.checked_sub(origin_monotonic_ns)?);
        Some(PhaseClock {
            origin: now.checked_sub(ago)?,
        })
    }

    /// The VMM's start as an [`Instant`].
    pub fn origin(&self) -> Instant {
        self.origin
    }

    /// Time from the VMM's start to `at` (zero for moments before it).
    pub fn offset(&self, at: Instant) -> Duration {
        at.saturating_duration_since(self.origin)
    }
}

#[cfg(test)]
mod tests {
    use bulkhead_protocol::BootTimestamps;
    use bulkhead_vmm::timings::ProcessClock;
    use bulkhead_vmm::BootTimeline;

    use super::*;

    fn ready(boottime_ms: u64) -> Ready {
        Ready {
            version: 1,
            agent_version: String::new(),
            init_started: BootTimestamps {
                boottime_ns: boottime_ms * 1_000_000,
                realtime_ns: 0,
            },
            listening: BootTimestamps::default(),
        }
    }

    /// A report whose VMM started at `origin`, with vm created at 2 ms, payload at 5 ms and
    /// kernel entry at 10 ms.
    fn report(origin: ProcessClock) -> TimingsReport {
        let at = |ms| Some(origin.instant + Duration::from_millis(ms));
        let timeline = BootTimeline {
            build_started: at(1),
            vm_created: at(2),
            payload_loaded: at(5),
            vcpus_started: at(10),
            ..BootTimeline::default()
        };
        TimingsReport::new(&timeline, origin, true, Vec::new())
    }

    fn close(a: Duration, b: Duration) -> bool {
        a.abs_diff(b) < Duration::from_micros(50)
    }

    #[test]
    fn guest_init_is_anchored_at_kernel_entry_and_every_phase_is_placed() {
        // Arrange: the VMM "started" 100 ms ago; the agent's main ran 40 ms after kernel entry.
        let origin = ProcessClock {
            instant: Instant::now() - Duration::from_millis(100),
            monotonic_ns: monotonic_ns() - 100_000_000,
        };
        let clock = PhaseClock::from_monotonic(origin.monotonic_ns).unwrap();

        // Act
        let phases = Phases::from_report(&report(origin), &clock, &ready(40), Instant::now());

        // Assert
        let p = phases.unwrap();
        assert!(close(p.vm_created, Duration::from_millis(2)), "{p:?}");
        assert!(close(p.memory_ready, Duration::from_millis(5)), "{p:?}");
        assert!(close(p.kernel_entry, Duration::from_millis(10)), "{p:?}");
        assert!(
            close(p.guest_init.unwrap(), Duration::from_millis(50)),
            "{p:?}"
        );
        assert!(p.agent_ready >= Duration::from_millis(100), "{p:?}");
        let names: Vec<_> = p.named().iter().map(|(n, _)| *n).collect();
        assert_eq!(names, PHASE_NAMES);
    }

    #[test]
    fn a_guest_clock_reading_past_agent_ready_is_clamped_to_it() {
        // Arrange: the VMM started 20 ms ago, but the guest claims 500 ms since boot.
        let origin = ProcessClock {
            instant: Instant::now() - Duration::from_millis(20),
            monotonic_ns: monotonic_ns() - 20_000_000,
        };
        let clock = PhaseClock::from_monotonic(origin.monotonic_ns).unwrap();
        let received = Instant::now();

        // Act
        let p = Phases::from_report(&report(origin), &clock, &ready(500), received).unwrap();

        // Assert
        assert_eq!(p.guest_init, Some(p.agent_ready));
    }

    #[test]
    fn a_report_without_kernel_entry_gives_no_phases() {
        let origin = ProcessClock::now();
        let mut r = report(origin);
        r.timeline.vcpus_started = None;
        let clock = PhaseClock::from_monotonic(origin.monotonic_ns).unwrap();

        let phases = Phases::from_report(&r, &clock, &ready(1), Instant::now());

        assert_eq!(phases, None);
    }

    #[test]
    fn a_restores_phases_are_the_vmms_restore_steps_and_the_acknowledgement_without_guest_init() {
        // Arrange: the VMM "started" 100 ms ago; its report has the restore's steps.
        let origin = ProcessClock {
            instant: Instant::now() - Duration::from_millis(100),
            monotonic_ns: monotonic_ns() - 100_000_000,
        };
        let clock = PhaseClock::from_monotonic(origin.monotonic_ns).unwrap();

        // Act
        let p = Phases::from_restore_report(&report(origin), &clock, Instant::now()).unwrap();

        // Assert
        assert!(close(p.vm_created, Duration::from_millis(2)), "{p:?}");
        assert!(close(p.memory_ready, Duration::from_millis(5)), "{p:?}");
        assert!(close(p.kernel_entry, Duration::from_millis(10)), "{p:?}");
        assert_eq!(p.guest_init, None);
        assert!(p.agent_ready >= Duration::from_millis(100), "{p:?}");
        assert_eq!(p.named()[4], ("guest_init", None));
    }

    #[test]
    fn an_origin_in_the_future_is_refused() {
        assert_eq!(PhaseClock::from_monotonic(u64::MAX), None);
    }
}
