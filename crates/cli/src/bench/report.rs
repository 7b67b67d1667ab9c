//! The bench JSON (`bulkhead bench --json FILE`), its validation, and the series derived from
//! it for tables, plots and comparisons.
//!
//! Schema `bulkhead-bench/1`, one object:
//!
//! ```text
//! {
//!   "schema": "bulkhead-bench/1",
//!   "created_unix_s": 1764500000,            // when the bench ran (host wall clock)
//!   "host": {"kernel_release": "6.1.0-...", "cpus": 2},
//!   "config": {"runs": 20, "concurrency": 1, "mode": "sequential", "image": null,
//!              "template": null, "vcpus": 1, "memory_mib": 256, "command": ["true"]},
//!   "phases": ["vmm_start", "vm_created", ..., "vm_destroyed"],   // timeline order
//!   "runs": [{
//!     "index": 0, "ok": true, "error": null, "exit_code": 0,
//!     "create_to_vmm_start_ms": 3.1,      // Sandbox::start began → VMM process start
//!     "create_to_ready_ms": 880.4,        // Sandbox::start (or restore) began → agent ready
//!     "create_to_first_output_ms": 905.2, // end to end: create → first output (or exit)
//!     "phases_ms": {"vmm_start": 0.0, "vm_created": 4.2, ..., "vm_destroyed": 960.0},
//!     "memory": {"vmm_rss_kib": 30000, "guest_rss_kib": 27000, "overhead_kib": 3000}
//!   }, ...]
//! }
//! ```
//!
//! `phases_ms` values are ms since the run's VMM process started (host monotonic clock; see
//! `bulkhead_sandbox::phases`); a phase not reached is `null`. A run restored from a template
//! (`config.template`) has the restore's phases, with `guest_init` always `null` (its guest did
//! not boot; files written before restores had phases have every phase and
//! `create_to_vmm_start_ms` `null`). A run through the daemon (`config.daemon`, its socket) has
//! no phases: `create_to_ready_ms` is the create request's answer, and its `memory` is `null`.
//! A failed run (`ok: false`) has its reason in `error` and whatever phases it reached. `memory`
//! is sampled after the command's exit status arrived, before the VM is destroyed (see `rss`);
//! `null` when it could not be read. Readers must ignore unknown fields; a new field keeps the schema name, a
//! changed meaning bumps it.

use std::path::{Path, PathBuf};

use bulkhead_sandbox::PHASE_NAMES;
use serde::{Deserialize, Serialize};

/// The schema name of this format.
pub const SCHEMA: &str = "bulkhead-bench/1";

/// Largest bench result file `--compare` reads (64 MiB: a million runs' phases fit).
pub const MAX_REPORT_BYTES: u64 = 64 << 20;

/// A whole bench result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchReport {
    /// Always [`SCHEMA`].
    pub schema: String,
    /// When the bench ran, seconds since the Unix epoch.
    pub created_unix_s: u64,
    /// The machine it ran on.
    pub host: HostInfo,
    /// What was run.
    pub config: BenchConfig,
    /// Phase names in timeline order (the keys of [`PhasesMs`]).
    pub phases: Vec<String>,
    /// Every run, in start order.
    pub runs: Vec<RunRecord>,
}

/// The machine a bench ran on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HostInfo {
    /// `uname -r`.
    pub kernel_release: String,
    /// Online CPUs.
    pub cpus: usize,
}

/// What a bench ran.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchConfig {
    /// Cold starts asked for.
    pub runs: usize,
    /// Most sandboxes alive at once.
    pub concurrency: usize,
    /// `sequential`, `burst` or `staggered:MS`.
    pub mode: String,
    /// `--image`, if any.
    pub image: Option<String>,
    /// `--template`: the template every run was restored from instead of booting (absent in
    /// files written before templates existed: none).
    #[serde(default)]
    pub template: Option<String>,
    /// vCPUs per sandbox.
    pub vcpus: u8,
    /// Guest RAM per sandbox, MiB.
    pub memory_mib: u32,
    /// `--console`: the guests' serial consoles went to their VMM output (absent in files
    /// written before the flag existed: off).
    #[serde(default)]
    pub console: bool,
    /// The guest kernel booted (absent in files written before it was recorded: empty).
    #[serde(default)]
    pub kernel: PathBuf,
    /// The initramfs booted (absent in older files: empty).
    #[serde(default)]
    pub initrd: PathBuf,
    /// `--kernel-arg`s appended to the default guest command line (absent: none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kernel_args: Vec<String>,
    /// The command run in each sandbox.
    pub command: Vec<String>,
    /// `--daemon`: the socket of the `bulkheadd` every sandbox was created through (absent: the
    /// bench ran the VMMs itself).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub daemon: Option<PathBuf>,
}

/// One cold start.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunRecord {
    /// Position in start order, from 0.
    pub index: usize,
    /// Booted, ran the command with exit status 0, and reported every phase.
    pub ok: bool,
    /// Why the run failed.
    #[serde(default)]
    pub error: Option<String>,
    /// The command's exit code, when it exited.
    #[serde(default)]
    pub exit_code: Option<i32>,
    /// `Sandbox::start` began → the VMM process started, ms (`None` for a restore).
    #[serde(default)]
    pub create_to_vmm_start_ms: Option<f64>,
    /// `Sandbox::start` (or `Sandbox::restore`) began → the agent was ready, ms (absent in files
    /// written before it was recorded).
    #[serde(default)]
    pub create_to_ready_ms: Option<f64>,
    /// `Sandbox::start` began → first output or exit status of the command, ms.
    #[serde(default)]
    pub create_to_first_output_ms: Option<f64>,
    /// Each phase, ms since the VMM process started.
    pub phases_ms: PhasesMs,
    /// VMM memory, sampled once the command had exited.
    #[serde(default)]
    pub memory: Option<MemorySample>,
    /// The last lines of VMM output (`vmm.log`: the VMM's own messages, such as why the guest
    /// stopped, plus the guest console if one was kept), oldest first, of a run whose sandbox
    /// did not start or whose command did not exit 0; empty otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub vmm_log_tail: Vec<String>,
}

impl RunRecord {
    /// Run number `index` before anything was measured: not ok, nothing recorded.
    pub fn unmeasured(index: usize) -> RunRecord {
        RunRecord {
            index,
            ok: false,
            error: None,
            exit_code: None,
            create_to_vmm_start_ms: None,
            create_to_ready_ms: None,
            create_to_first_output_ms: None,
            phases_ms: PhasesMs::default(),
            memory: None,
            vmm_log_tail: Vec::new(),
        }
    }
}

/// Each phase of one run, ms since its VMM process started; `None` (JSON `null`) when not
/// reached. Field names are [`PHASE_NAMES`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct PhasesMs {
    /// Always 0 when known.
    pub vmm_start: Option<f64>,
    /// KVM VM created, guest memory registered.
    pub vm_created: Option<f64>,
    /// Boot payload in guest memory.
    pub memory_ready: Option<f64>,
    /// vCPUs started (kernel entry).
    pub kernel_entry: Option<f64>,
    /// Agent `main` started (estimated from the guest clock).
    pub guest_init: Option<f64>,
    /// Host received the agent's `Ready`.
    pub agent_ready: Option<f64>,
    /// First output or exit status of the command.
    pub first_output: Option<f64>,
    /// VMM stopped and reaped.
    pub vm_destroyed: Option<f64>,
}

impl PhasesMs {
    /// Every phase as `(name, ms)` in timeline order.
    pub fn named(&self) -> [(&'static str, Option<f64>); 8] {
        let values = [
            self.vmm_start,
            self.vm_created,
            self.memory_ready,
            self.kernel_entry,
            self.guest_init,
            self.agent_ready,
            self.first_output,
            self.vm_destroyed,
        ];
        let mut named = [("", None); 8];
        for (slot, (name, v)) in named.iter_mut().zip(PHASE_NAMES.iter().zip(values)) {
            *slot = (*name, v);
        }
        named
    }

    /// Checks that every phase is present and none comes before the one listed ahead of it;
    /// for a `restored` run, every phase but `guest_init` (its guest did not boot).
    ///
    /// # Errors
    /// A message naming the first missing phase or the first pair out of order.
    pub fn check_complete_and_monotonic(&self, restored: bool) -> Result<(), String> {
        let mut previous: Option<(&str, f64)> = None;
        for (name, value) in self.named() {
            if restored && name == "guest_init" {
                continue;
            }
            let value = value.ok_or_else(|| format!("phase {name} missing"))?;
            if let Some((before, at)) = previous {
                if value < at {
                    return Err(format!(
                        "phase {name} ({value:.3} ms) precedes {before} ({at:.3} ms)"
                    ));
                }
            }
            previous = Some((name, value));
        }
        Ok(())
    }
}

/// Memory of one VMM process (see `rss` for what is measured), KiB.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemorySample {
    /// `VmRSS` of the VMM process.
    pub vmm_rss_kib: u64,
    /// Resident pages of its guest RAM mappings.
    pub guest_rss_kib: u64,
    /// `vmm_rss_kib - guest_rss_kib`: what the VMM itself costs.
    pub overhead_kib: u64,
}

/// One measured quantity across the successful runs, e.g. a phase or a step between phases.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// Its name as printed, e.g. `kernel_entry → guest_init`.
    pub label: String,
    /// One value per successful run that has it, ms.
    pub values: Vec<f64>,
}

impl BenchReport {
    /// Successful runs.
    pub fn ok_runs(&self) -> impl Iterator<Item = &RunRecord> {
        self.runs.iter().filter(|r| r.ok)
    }

    /// What the runs were: `cold starts`, or `restores of template NAME`.
    pub fn kind(&self) -> String {
        match (&self.config.template, &self.config.daemon) {
            (Some(name), None) => format!("restores of template {name}"),
            (None, None) => "cold starts".to_owned(),
            (Some(name), Some(_)) => format!("creates from template {name} through bulkheadd"),
            (None, Some(_)) => "cold creates through bulkheadd".to_owned(),
        }
    }

    /// Whether the runs have phases: cold starts and restores run by the bench itself (the
    /// daemon's VMMs report theirs to the daemon).
    pub fn has_phases(&self) -> bool {
        self.config.daemon.is_none()
    }

    /// Whether the runs were restores from a template, whose phases have no `guest_init`.
    pub fn restored(&self) -> bool {
        self.config.template.is_some()
    }

    /// The phases this result's runs have, in timeline order: [`PHASE_NAMES`] without
    /// `guest_init` for restores.
    fn phase_indices(&self) -> Vec<usize> {
        (0..PHASE_NAMES.len())
            .filter(|&i| !(self.restored() && PHASE_NAMES[i] == "guest_init"))
            .collect()
    }

    /// Failed runs.
    pub fn failures(&self) -> impl Iterator<Item = &RunRecord> {
        self.runs.iter().filter(|r| !r.ok)
    }

    /// Time to reach each phase (ms since VMM start), then the end-to-end time.
    pub fn phase_series(&self) -> Vec<Series> {
        let mut series: Vec<Series> = self
            .phase_indices()
            .into_iter()
            .map(|i| Series {
                label: PHASE_NAMES[i].to_owned(),
                values: self
                    .ok_runs()
                    .filter_map(|r| r.phases_ms.named()[i].1)
                    .collect(),
            })
            .collect();
        series.push(self.end_to_end());
        series
    }

    /// Duration of each step between consecutive phases (`create → vmm_start` first; a
    /// restore's `kernel_entry → agent_ready` spans the missing `guest_init`), then the
    /// end-to-end time.
    pub fn step_series(&self) -> Vec<Series> {
        let mut series = vec![Series {
            label: format!("create → {}", PHASE_NAMES[0]),
            values: self
                .ok_runs()
                .filter_map(|r| r.create_to_vmm_start_ms)
                .collect(),
        }];
        let indices = self.phase_indices();
        for pair in indices.windows(2) {
            let (from, to) = (pair[0], pair[1]);
            series.push(Series {
                label: format!("{} → {}", PHASE_NAMES[from], PHASE_NAMES[to]),
                values: self
                    .ok_runs()
                    .filter_map(|r| {
                        let named = r.phases_ms.named();
                        Some(named[to].1? - named[from].1?)
                    })
                    .collect(),
            });
        }
        series.push(self.end_to_end());
        series
    }

    /// Create (or restore) → agent ready of the successful runs.
    pub fn ready_series(&self) -> Series {
        Series {
            label: "create → agent ready".to_owned(),
            values: self
                .ok_runs()
                .filter_map(|r| r.create_to_ready_ms)
                .collect(),
        }
    }

    /// The series that a result of creates through the daemon has values for (it has no
    /// phases): create → agent ready, then the end-to-end time.
    pub fn daemon_series(&self) -> Vec<Series> {
        vec![self.ready_series(), self.end_to_end()]
    }

    /// Create → first output of the successful runs.
    pub fn end_to_end(&self) -> Series {
        Series {
            label: "end to end: create → first_output".to_owned(),
            values: self
                .ok_runs()
                .filter_map(|r| r.create_to_first_output_ms)
                .collect(),
        }
    }

    /// VMM RSS overhead of the successful runs that have a memory sample, KiB.
    pub fn overhead_kib(&self) -> Vec<f64> {
        self.ok_runs()
            .filter_map(|r| r.memory.map(|m| m.overhead_kib as f64))
            .collect()
    }

    /// Writes the report as pretty JSON.
    ///
    /// # Errors
    /// A one-line message naming the file.
    pub fn save(&self, path: &Path) -> Result<(), String> {
        let json = serde_json::to_vec_pretty(self).map_err(|e| e.to_string())?;
        std::fs::write(path, json).map_err(|e| format!("cannot write {}: {e}", path.display()))
    }

    /// Reads a report written by [`BenchReport::save`] (at most [`MAX_REPORT_BYTES`]).
    ///
    /// # Errors
    /// A one-line message naming the file when it cannot be read, is not JSON of this shape,
    /// or has another schema.
    pub fn load(path: &Path) -> Result<BenchReport, String> {
        use std::io::Read;
        let mut text = Vec::new();
        std::fs::File::open(path)
            .and_then(|f| f.take(MAX_REPORT_BYTES + 1).read_to_end(&mut text))
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        if text.len() as u64 > MAX_REPORT_BYTES {
            return Err(format!(
                "{} is larger than {MAX_REPORT_BYTES} bytes: not a bench result",
                path.display()
            ));
        }
        let report: BenchReport = serde_json::from_slice(&text)
            .map_err(|e| format!("{} is not a bench result: {e}", path.display()))?;
        if report.schema != SCHEMA {
            return Err(format!(
                "{} has schema {:?}; this bulkhead reads {SCHEMA:?}",
                path.display(),
                report.schema
            ));
        }
        report
            .check_times()
            .map_err(|e| format!("{}: {e}: not a bench result", path.display()))?;
        Ok(report)
    }

    /// Every time in the runs is a duration: not negative (JSON has no NaN or infinity).
    fn check_times(&self) -> Result<(), String> {
        for run in &self.runs {
            let times = run.phases_ms.named().into_iter().chain([
                ("create_to_vmm_start_ms", run.create_to_vmm_start_ms),
                ("create_to_ready_ms", run.create_to_ready_ms),
                ("create_to_first_output_ms", run.create_to_first_output_ms),
            ]);
            for (name, ms) in times {
                if let Some(ms) = ms.filter(|ms| *ms < 0.0) {
                    return Err(format!("run {} has {name} = {ms} ms", run.index));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A complete, monotonic run whose phases are `scale` × (0, 1, 2, ..., 7) ms.
    pub(crate) fn run(index: usize, scale: f64) -> RunRecord {
        let at = |i: f64| Some(i * scale);
        RunRecord {
            index,
            ok: true,
            error: None,
            exit_code: Some(0),
            create_to_vmm_start_ms: Some(scale),
            create_to_ready_ms: Some(6.0 * scale),
            create_to_first_output_ms: Some(7.0 * scale),
            phases_ms: PhasesMs {
                vmm_start: at(0.0),
                vm_created: at(1.0),
                memory_ready: at(2.0),
                kernel_entry: at(3.0),
                guest_init: at(4.0),
                agent_ready: at(5.0),
                first_output: at(6.0),
                vm_destroyed: at(7.0),
            },
            memory: Some(MemorySample {
                vmm_rss_kib: 5000,
                guest_rss_kib: 3000,
                overhead_kib: 2000,
            }),
            vmm_log_tail: Vec::new(),
        }
    }

    /// A report of `runs`.
    pub(crate) fn report(runs: Vec<RunRecord>) -> BenchReport {
        BenchReport {
            schema: SCHEMA.to_owned(),
            created_unix_s: 1,
            host: HostInfo {
                kernel_release: "6.1.0".into(),
                cpus: 2,
            },
            config: BenchConfig {
                runs: runs.len(),
                concurrency: 1,
                mode: "sequential".into(),
                image: None,
                template: None,
                vcpus: 1,
                memory_mib: 128,
                console: false,
                kernel: "/k/vmlinux".into(),
                initrd: "/k/initramfs.cpio.gz".into(),
                kernel_args: vec!["mitigations=off".into()],
                command: vec!["true".into()],
                daemon: None,
            },
            phases: PHASE_NAMES.iter().map(|s| (*s).to_owned()).collect(),
            runs,
        }
    }

    #[test]
    fn a_report_round_trips_through_its_json_file() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bench.json");
        let mut failed = run(1, 2.0);
        failed.ok = false;
        failed.error = Some("boom".into());
        failed.phases_ms.first_output = None;
        let original = report(vec![run(0, 1.0), failed]);

        // Act
        original.save(&path).unwrap();
        let back = BenchReport::load(&path).unwrap();

        // Assert
        assert_eq!(back, original);
        let json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(json["schema"], "bulkhead-bench/1");
        assert_eq!(json["runs"][0]["phases_ms"]["guest_init"], 4.0);
        assert!(json["runs"][1]["phases_ms"]["first_output"].is_null());
        assert_eq!(json["config"]["kernel_args"][0], "mitigations=off");
    }

    #[test]
    fn a_file_from_before_kernel_args_templates_and_ready_times_were_recorded_still_loads() {
        // Arrange: today's JSON without the newer keys
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("older.json");
        report(vec![run(0, 1.0)]).save(&path).unwrap();
        let mut json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let config = json["config"].as_object_mut().unwrap();
        for key in ["kernel", "initrd", "kernel_args", "template"] {
            config.remove(key);
        }
        let first_run = json["runs"][0].as_object_mut().unwrap();
        first_run.remove("create_to_ready_ms");
        std::fs::write(&path, serde_json::to_vec(&json).unwrap()).unwrap();

        // Act
        let back = BenchReport::load(&path).unwrap();

        // Assert
        assert!(back.config.kernel_args.is_empty());
        assert_eq!(back.config.kernel, PathBuf::new());
        assert_eq!(back.config.template, None);
        assert_eq!(back.runs[0].create_to_ready_ms, None);
    }

    #[test]
    fn a_result_of_restores_has_the_same_fields_as_one_of_cold_starts() {
        // Arrange: a restore has no phases and no VMM start time
        let cold = report(vec![run(0, 1.0)]);
        let mut restored_run = run(0, 1.0);
        restored_run.phases_ms = PhasesMs::default();
        restored_run.create_to_vmm_start_ms = None;
        let mut restored = report(vec![restored_run]);
        restored.config.template = Some("py".into());
        let keys = |r: &BenchReport| {
            let json = serde_json::to_value(r).unwrap();
            let mut keys: Vec<String> = ["config", "runs"]
                .iter()
                .flat_map(|k| {
                    let obj = match *k {
                        "runs" => json[k][0].clone(),
                        _ => json[k].clone(),
                    };
                    let names: Vec<String> = obj.as_object().unwrap().keys().cloned().collect();
                    names.into_iter().map(move |n| format!("{k}.{n}"))
                })
                .collect();
            keys.extend(
                json["runs"][0]["phases_ms"]
                    .as_object()
                    .unwrap()
                    .keys()
                    .cloned(),
            );
            keys
        };

        // Act
        let (cold_keys, restored_keys) = (keys(&cold), keys(&restored));

        // Assert
        assert_eq!(cold_keys, restored_keys);
        assert!(cold_keys.contains(&"config.template".to_owned()));
        assert!(cold_keys.contains(&"runs.create_to_ready_ms".to_owned()));
        assert_eq!(cold.kind(), "cold starts");
        assert_eq!(restored.kind(), "restores of template py");
    }

    #[test]
    fn another_schema_is_refused_with_its_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("old.json");
        let mut other = report(vec![]);
        other.schema = "bulkhead-bench/0".into();
        other.save(&path).unwrap();

        let err = BenchReport::load(&path).unwrap_err();

        assert!(err.contains("bulkhead-bench/0"), "{err}");
    }

    #[test]
    fn a_negative_time_is_refused_with_the_run_and_phase() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("edited.json");
        let mut bad = run(3, 1.0);
        bad.phases_ms.agent_ready = Some(-40.0);
        report(vec![run(0, 1.0), bad]).save(&path).unwrap();

        let err = BenchReport::load(&path).unwrap_err();

        assert!(
            err.contains("run 3") && err.contains("agent_ready = -40"),
            "{err}"
        );
    }

    #[test]
    fn complete_increasing_phases_pass_the_check() {
        assert_eq!(
            run(0, 1.0).phases_ms.check_complete_and_monotonic(false),
            Ok(())
        );
    }

    #[test]
    fn a_phase_before_its_predecessor_is_named() {
        let mut r = run(0, 1.0);
        r.phases_ms.guest_init = Some(2.5);

        let err = r.phases_ms.check_complete_and_monotonic(false).unwrap_err();

        assert!(
            err.contains("guest_init") && err.contains("kernel_entry"),
            "{err}"
        );
    }

    #[test]
    fn a_missing_phase_is_named() {
        let mut r = run(0, 1.0);
        r.phases_ms.vm_destroyed = None;

        let err = r.phases_ms.check_complete_and_monotonic(false).unwrap_err();

        assert!(err.contains("vm_destroyed"), "{err}");
    }

    #[test]
    fn steps_are_differences_of_consecutive_phases_of_successful_runs_only() {
        let mut failed = run(2, 100.0);
        failed.ok = false;
        let r = report(vec![run(0, 1.0), run(1, 3.0), failed]);

        let steps = r.step_series();

        assert_eq!(steps.len(), PHASE_NAMES.len() + 1);
        assert_eq!(steps[0].label, "create → vmm_start");
        assert_eq!(steps[4].label, "kernel_entry → guest_init");
        assert_eq!(steps[4].values, vec![1.0, 3.0]);
        assert_eq!(steps.last().unwrap().values, vec![7.0, 21.0]);
        assert_eq!(r.phase_series()[5].values, vec![5.0, 15.0]);
        assert_eq!(r.overhead_kib(), vec![2000.0, 2000.0]);
    }
}
