//! Running the cold starts: when each one starts ([`Mode`], [`schedule`]) and what one is
//! ([`ColdStart`]: a boot, or a restore from a template).

use std::fmt;
use std::path::Path;
use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Barrier, Condvar, Mutex};
use std::time::{Duration, Instant};

use bulkhead_protocol::client::ExecEvent;
use bulkhead_protocol::ExecRequest;
use bulkhead_sandbox::{Sandbox, SandboxConfig, Storage, Timings};
use bulkhead_vmm::snapshot::MEMORY_FILE;

use super::report::{MemorySample, PhasesMs, RunRecord};
use super::rss;

/// When runs start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Each of `concurrency` workers starts its next run as soon as its last one is destroyed
    /// (with concurrency 1: one after another).
    Sequential,
    /// Waves of `concurrency` runs released at the same instant; a wave starts when the last
    /// one is done.
    Burst,
    /// Run `i` starts `i × interval` after the bench started, or later when `concurrency` runs
    /// are already in flight.
    Staggered(Duration),
}

impl FromStr for Mode {
    type Err = String;

    fn from_str(s: &str) -> Result<Mode, String> {
        match s {
            "sequential" => Ok(Mode::Sequential),
            "burst" => Ok(Mode::Burst),
            _ => match s.strip_prefix("staggered:").map(str::parse::<u64>) {
                Some(Ok(ms)) => Ok(Mode::Staggered(Duration::from_millis(ms))),
                _ => Err(format!(
                    "`{s}` is not a mode: sequential, burst or staggered:MS"
                )),
            },
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Mode::Sequential => f.write_str("sequential"),
            Mode::Burst => f.write_str("burst"),
            Mode::Staggered(d) => write!(f, "staggered:{}", d.as_millis()),
        }
    }
}

/// How many runs, how many at once, and when.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    /// Runs in all.
    pub runs: usize,
    /// Most runs in flight at once (≥ 1).
    pub concurrency: usize,
    /// When runs start.
    pub mode: Mode,
}

/// Runs `job(0)` … `job(runs - 1)` as `plan` says, calling `done` after each; returns the
/// results in index order.
pub fn schedule<T: Send>(
    plan: &Plan,
    job: impl Fn(usize) -> T + Sync,
    done: impl Fn(&T) + Sync,
) -> Vec<T> {
    let slots: Vec<Mutex<Option<T>>> = (0..plan.runs).map(|_| Mutex::new(None)).collect();
    let k = plan.concurrency.max(1);
    let run = |i: usize| {
        let result = job(i);
        done(&result);
        *slots[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(result);
    };
    match plan.mode {
        Mode::Sequential => {
            let next = AtomicUsize::new(0);
            std::thread::scope(|s| {
                for _ in 0..k.min(plan.runs) {
                    s.spawn(|| loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= plan.runs {
                            break;
                        }
                        run(i);
                    });
                }
            });
        }
        Mode::Burst => {
            for wave in (0..plan.runs).collect::<Vec<_>>().chunks(k) {
                let barrier = Barrier::new(wave.len());
                std::thread::scope(|s| {
                    for &i in wave {
                        let (barrier, run) = (&barrier, &run);
                        s.spawn(move || {
                            barrier.wait();
                            run(i);
                        });
                    }
                });
            }
        }
        Mode::Staggered(interval) => {
            let in_flight = (Mutex::new(0usize), Condvar::new());
            let start = Instant::now();
            std::thread::scope(|s| {
                for i in 0..plan.runs {
                    // The schedule itself: run i is due at start + i × interval.
                    let due = start + interval.saturating_mul(i as u32);
                    std::thread::sleep(due.saturating_duration_since(Instant::now()));
                    let (count, freed) = &in_flight;
                    let mut n = count.lock().unwrap_or_else(|p| p.into_inner());
                    while *n >= k {
                        n = freed.wait(n).unwrap_or_else(|p| p.into_inner());
                    }
                    *n += 1;
                    drop(n);
                    let (in_flight, run) = (&in_flight, &run);
                    s.spawn(move || {
                        run(i);
                        *in_flight.0.lock().unwrap_or_else(|p| p.into_inner()) -= 1;
                        in_flight.1.notify_one();
                    });
                }
            });
        }
    }
    slots
        .into_iter()
        .filter_map(|slot| slot.into_inner().unwrap_or_else(|p| p.into_inner()))
        .collect()
}

/// One cold start: boot a sandbox (or restore one from a template), run the command, wait for
/// its first output (or exit status) and its exit, sample the VMM's memory, destroy the
/// sandbox.
#[derive(Debug)]
pub struct ColdStart<'a> {
    /// The sandbox to boot.
    pub config: &'a SandboxConfig,
    /// Its disks.
    pub storage: &'a Storage,
    /// The command.
    pub request: &'a ExecRequest,
    /// The template's snapshot directory to restore from instead of booting.
    pub restore_from: Option<&'a Path>,
}

impl ColdStart<'_> {
    /// Runs cold start number `index`. Never fails: a failure is a record with `ok: false`.
    pub fn run(&self, index: usize) -> RunRecord {
        let mut record = RunRecord::unmeasured(index);
        let started = match self.restore_from {
            Some(dir) => Sandbox::restore(self.config, dir),
            None => Sandbox::start_with(self.config, self.storage),
        };
        let sandbox = match started {
            Ok(sandbox) => sandbox,
            Err(e) => {
                let message = e.to_string();
                record.error = Some(first_line(&message));
                record.vmm_log_tail = last_lines(message.lines().skip(1), LOG_TAIL_LINES);
                return record;
            }
        };
        let exited = run_command(&sandbox, self.request, self.config.ready_timeout);
        let memory = self.sample_memory(&sandbox);
        // Before destroying (the log goes with the runtime directory), and only when the command
        // did not succeed: a good run's teardown, measured as `vm_destroyed`, reads nothing.
        let log_tail = match exited {
            Ok(0) => String::new(),
            _ => sandbox.log_tail(LOG_TAIL_LINES),
        };
        let destroyed = sandbox.destroy_timed();
        if let Ok(timings) = &destroyed {
            fill_timings(&mut record, timings);
        }
        record.memory = memory.as_ref().ok().copied();
        record.exit_code = exited.as_ref().ok().copied();
        record.error = match (exited, destroyed, memory) {
            (Err(e), _, _) => Some(e),
            (Ok(code), _, _) if code != 0 => Some(format!("the command exited {code}")),
            (_, Err(e), _) => Some(format!("destroying the sandbox: {e}")),
            (_, _, Err(e)) => Some(format!("memory sample: {e}")),
            _ => record
                .phases_ms
                .check_complete_and_monotonic(self.restore_from.is_some())
                .err(),
        };
        record.ok = record.error.is_none();
        if !record.ok {
            record.vmm_log_tail = last_lines(log_tail.lines(), LOG_TAIL_LINES);
        }
        record
    }

    /// The VMM's memory: guest RAM found by the ranges the VMM reports, or for a restore by
    /// the snapshot's memory file it maps.
    fn sample_memory(&self, sandbox: &Sandbox) -> Result<MemorySample, String> {
        let Some(pid) = sandbox.vm_pid() else {
            return Err("the VMM has exited".into());
        };
        match (self.restore_from, sandbox.runtime_path()) {
            (Some(dir), _) => rss::sample_restored(pid, &dir.join(MEMORY_FILE)),
            (None, Some(runtime)) => rss::sample(pid, runtime),
            (None, None) => Err("the VMM has exited".into()),
        }
    }
}

/// How many lines of VMM output a failed run keeps ([`RunRecord::vmm_log_tail`]).
const LOG_TAIL_LINES: usize = 20;

/// The last `count` non-blank lines of `lines`, oldest first.
fn last_lines<'a>(lines: impl Iterator<Item = &'a str>, count: usize) -> Vec<String> {
    let kept: Vec<&str> = lines.filter(|l| !l.trim().is_empty()).collect();
    kept[kept.len().saturating_sub(count)..]
        .iter()
        .map(|l| (*l).to_owned())
        .collect()
}

/// Runs `request`, marking the sandbox's first output; returns the exit code (128+N for
/// signal N). Connecting and each wait for an event may take up to `patience` (the boot
/// timeout): in a burst, a guest that just announced itself can need far longer than the
/// client's default 10 s to answer while its neighbours boot.
fn run_command(
    sandbox: &Sandbox,
    request: &ExecRequest,
    patience: Duration,
) -> Result<i32, String> {
    let (_writer, mut reader) = sandbox
        .client()
        .with_timeout(patience)
        .exec(request)
        .map_err(|e| format!("exec: {e}"))?
        .split();
    // A started session waits for output without a bound; a guest that stalls mid-command
    // would hold the whole bench.
    reader
        .set_event_timeout(Some(patience))
        .map_err(|e| format!("exec: {e}"))?;
    loop {
        let event = reader.next_event().map_err(|e| format!("exec: {e}"))?;
        sandbox.mark_first_output();
        match event {
            Some(ExecEvent::Stdout(_) | ExecEvent::Stderr(_)) => {}
            Some(ExecEvent::Exit(status)) => return Ok(status.shell_code().unwrap_or(-1)),
            None => return Err("the agent closed the connection without an exit status".into()),
        }
    }
}

/// Milliseconds of `d`.
fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn fill_timings(record: &mut RunRecord, timings: &Timings) {
    record.create_to_vmm_start_ms = timings.vmm_start.map(ms);
    record.create_to_ready_ms = Some(ms(timings.ready));
    record.create_to_first_output_ms = timings.create_to_first_output().map(ms);
    if let Some(phases) = timings.phases {
        let [a, b, c, d, e, f, g, h] = phases.named().map(|(_, at)| at.map(ms));
        record.phases_ms = PhasesMs {
            vmm_start: a,
            vm_created: b,
            memory_ready: c,
            kernel_entry: d,
            guest_init: e,
            agent_ready: f,
            first_output: g,
            vm_destroyed: h,
        };
    } else {
        record.error = Some("the VMM's timings report was unreadable".into());
    }
}

/// The first line of a (possibly multi-line, log-quoting) error.
fn first_line(message: &str) -> String {
    message.lines().next().unwrap_or_default().to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_and_print_back() {
        for text in ["sequential", "burst", "staggered:250"] {
            assert_eq!(text.parse::<Mode>().unwrap().to_string(), text);
        }
        assert!("staggered:x".parse::<Mode>().is_err());
        assert!("fast".parse::<Mode>().unwrap_err().contains("staggered:MS"));
    }

    /// Runs `plan` with jobs that count how many are in flight and each wait (at most 5 s)
    /// until `gather` jobs have arrived; returns (results, most in flight at once).
    fn in_flight_peak(plan: Plan, gather: usize) -> (Vec<usize>, usize) {
        let (now, peak) = (AtomicUsize::new(0), AtomicUsize::new(0));
        let (arrived, cond) = (Mutex::new(0usize), Condvar::new());
        let results = schedule(
            &plan,
            |i| {
                let n = now.fetch_add(1, Ordering::SeqCst) + 1;
                peak.fetch_max(n, Ordering::SeqCst);
                let mut seen = arrived.lock().unwrap();
                *seen += 1;
                cond.notify_all();
                let deadline = Instant::now() + Duration::from_secs(5);
                while *seen < gather && Instant::now() < deadline {
                    seen = cond
                        .wait_timeout(seen, Duration::from_millis(50))
                        .unwrap()
                        .0;
                }
                drop(seen);
                now.fetch_sub(1, Ordering::SeqCst);
                i
            },
            |_| {},
        );
        (results, peak.load(Ordering::SeqCst))
    }

    #[test]
    fn every_mode_runs_each_index_once_in_order_and_never_more_than_concurrency() {
        for mode in [
            Mode::Sequential,
            Mode::Burst,
            Mode::Staggered(Duration::from_millis(1)),
        ] {
            let plan = Plan {
                runs: 7,
                concurrency: 3,
                mode,
            };

            let (results, peak) = in_flight_peak(plan, 0);

            assert_eq!(results, (0..7).collect::<Vec<_>>(), "{mode}");
            assert!(peak <= 3, "{mode}: {peak} in flight");
        }
    }

    #[test]
    fn a_burst_wave_is_in_flight_all_at_once() {
        let plan = Plan {
            runs: 4,
            concurrency: 4,
            mode: Mode::Burst,
        };

        let (_, peak) = in_flight_peak(plan, 4);

        assert_eq!(peak, 4);
    }

    fn empty_record() -> RunRecord {
        RunRecord::unmeasured(0)
    }

    #[test]
    fn a_restore_records_its_phases_without_guest_init_and_its_end_to_end_time() {
        // Arrange: a restore's timings: its VMM started 3 ms after the create, no guest_init.
        let ms = Duration::from_millis;
        let timings = Timings {
            spawn: ms(2),
            ready: ms(30),
            vmm_start: Some(ms(3)),
            phases: Some(bulkhead_sandbox::Phases {
                vm_created: ms(10),
                memory_ready: ms(15),
                kernel_entry: ms(18),
                guest_init: None,
                agent_ready: ms(27),
                first_output: Some(ms(42)),
                vm_destroyed: Some(ms(50)),
            }),
        };
        let mut record = empty_record();

        // Act
        fill_timings(&mut record, &timings);

        // Assert
        assert_eq!(record.create_to_ready_ms, Some(30.0));
        assert_eq!(record.create_to_first_output_ms, Some(45.0));
        assert_eq!(record.create_to_vmm_start_ms, Some(3.0));
        assert_eq!(record.phases_ms.kernel_entry, Some(18.0));
        assert_eq!(record.phases_ms.guest_init, None);
        assert_eq!(record.error, None);
        assert_eq!(record.phases_ms.check_complete_and_monotonic(true), Ok(()));
        assert!(record
            .phases_ms
            .check_complete_and_monotonic(false)
            .is_err());
    }

    #[test]
    fn a_cold_start_without_the_vmms_report_is_a_failure_with_its_ready_time() {
        let timings = Timings {
            spawn: Duration::from_millis(2),
            ready: Duration::from_millis(900),
            vmm_start: None,
            phases: None,
        };
        let mut record = empty_record();

        fill_timings(&mut record, &timings);

        assert_eq!(record.create_to_ready_ms, Some(900.0));
        assert!(record.error.unwrap().contains("unreadable"));
    }

    #[test]
    fn the_first_line_of_an_error_is_kept() {
        assert_eq!(first_line("boom\nlog line"), "boom");
    }

    #[test]
    fn a_failed_runs_log_keeps_its_last_non_blank_lines_in_order() {
        // Arrange
        let log = "one\n\ntwo\n  \nthree\nfour\n";

        // Act
        let tail = last_lines(log.lines(), 3);
        let all = last_lines(log.lines(), 10);

        // Assert
        assert_eq!(tail, ["two", "three", "four"]);
        assert_eq!(all, ["one", "two", "three", "four"]);
        assert!(last_lines("".lines(), 3).is_empty());
    }
}
