//! Support for bulkhead's benchmarks (`benches/boot.rs`, `benches/storage.rs`,
//! `crates/daemon/benches`): [`run`] runs one where guests can boot, one [`Row`] per measured
//! quantity is printed as a table and written as JSON under `target/bulkhead-bench/`, and
//! [`env_count`] reads their sample counts.

use std::env;
use std::io;
use std::path::PathBuf;
use std::time::Duration;

use bulkhead_vmm::vstate::kvm::host_kvm;

use crate::{inner_script, target_dir, INNER_ENV};

/// Longest a benchmark may run inside the test host. A benchmark boots dozens of guests in one
/// process, so the limit of one delegated test (10 min) is too short for it; this one only
/// catches a hung run.
pub const BENCH_TIMEOUT: Duration = Duration::from_secs(90 * 60);

/// Runs the benchmark `body` where guests can boot: right here (hardware KVM, or already inside
/// the test host), or by re-running the current executable inside the shared test host, whose
/// stdout and stderr are passed through while it runs (so progress shows during long runs).
///
/// # Panics
/// When the test host cannot be started, the run exceeds [`BENCH_TIMEOUT`], or the benchmark
/// fails (non-zero status) in the test host.
pub fn run(body: impl FnOnce()) {
    if env::var_os(INNER_ENV).is_some() || host_kvm().can_boot_stock_kernel() {
        body();
        return;
    }
    let status = crate::hosts::lease(true)
        .host()
        .run_streaming(
            &inner_script(&[]),
            BENCH_TIMEOUT,
            &mut io::stdout(),
            &mut io::stderr(),
        )
        .unwrap_or_else(|e| panic!("running the benchmark in the test host failed: {e}"));
    assert!(
        status == 0,
        "the benchmark failed in the test host (status {status})"
    );
}

/// Unit of a [`Row`]'s samples. Durations are [`Unit::Ms`] (lower is better); throughputs
/// [`Unit::MibPerS`] (higher is better, so a throughput row's p90 is its fast side).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Unit {
    /// Milliseconds.
    #[default]
    Ms,
    /// Mebibytes (2^20 bytes) per second.
    MibPerS,
}

impl Unit {
    /// The unit as printed in tables: `ms`, `MiB/s`.
    pub fn label(self) -> &'static str {
        match self {
            Unit::Ms => "ms",
            Unit::MibPerS => "MiB/s",
        }
    }

    /// Suffix of the JSON keys (`samples_<suffix>`, `p50_<suffix>`, `p90_<suffix>`): `ms`, so
    /// the keys of millisecond rows stay what they were before rows had units, and `mib_per_s`.
    pub fn json_suffix(self) -> &'static str {
        match self {
            Unit::Ms => "ms",
            Unit::MibPerS => "mib_per_s",
        }
    }
}

/// The samples of one measured quantity, sorted ascending.
#[derive(Debug, Clone)]
pub struct Row {
    /// What was measured, e.g. `run: spawn → agent ready`.
    pub name: String,
    /// Samples in [`Row::unit`], sorted.
    pub samples: Vec<f64>,
    /// Unit of the samples.
    pub unit: Unit,
}

impl Row {
    /// A row of `samples` in milliseconds (any order).
    pub fn new(name: impl Into<String>, samples: Vec<f64>) -> Self {
        Self::with_unit(name, samples, Unit::Ms)
    }

    /// A row of `samples` (any order) in `unit`.
    ///
    /// ```
    /// use bulkhead_tests::bench::{Row, Unit};
    /// let row = Row::with_unit("read", vec![120.0, 80.0], Unit::MibPerS);
    /// assert_eq!((row.pct(0.0), row.unit.label()), (80.0, "MiB/s"));
    /// ```
    pub fn with_unit(name: impl Into<String>, mut samples: Vec<f64>, unit: Unit) -> Self {
        samples.sort_by(f64::total_cmp);
        Row {
            name: name.into(),
            samples,
            unit,
        }
    }

    /// The `p` quantile (0.0..=1.0) by nearest rank, in the row's unit; `NaN` without samples.
    ///
    /// ```
    /// let row = bulkhead_tests::bench::Row::new("x", vec![3.0, 1.0, 2.0]);
    /// assert_eq!(row.pct(0.5), 2.0);
    /// ```
    pub fn pct(&self, p: f64) -> f64 {
        if self.samples.is_empty() {
            return f64::NAN;
        }
        let idx = ((self.samples.len() as f64 - 1.0) * p).round() as usize;
        self.samples[idx.min(self.samples.len() - 1)]
    }
}

/// A sample count from the environment variable `var` (e.g. `BULKHEAD_BENCH_RUNS`): its value
/// when it is a positive integer; `default` when it is unset, not a number, or 0.
///
/// ```
/// assert_eq!(bulkhead_tests::bench::env_count("BULKHEAD_DOCTEST_UNSET_COUNT", 5), 5);
/// ```
pub fn env_count(var: &str, default: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or(default)
}

/// Prints `rows` as a table: name, n, unit, p50, p90, min, max.
pub fn print_table(rows: &[Row]) {
    let width = rows
        .iter()
        .map(|r| r.name.chars().count())
        .max()
        .unwrap_or(5);
    println!(
        "{:<width$} {:>5} {:>6} {:>10} {:>10} {:>10} {:>10}",
        "phase", "n", "unit", "p50", "p90", "min", "max"
    );
    for r in rows {
        println!(
            "{:<width$} {:>5} {:>6} {:>10.1} {:>10.1} {:>10.1} {:>10.1}",
            r.name,
            r.samples.len(),
            r.unit.label(),
            r.pct(0.5),
            r.pct(0.9),
            r.pct(0.0),
            r.pct(1.0)
        );
    }
}

/// Writes `rows` as JSON to `target/bulkhead-bench/<file>` and returns the path: per row
/// `phase`, `unit` ([`Unit::label`]) and `samples_<s>`, `p50_<s>`, `p90_<s>` with `<s>` the
/// unit's [`Unit::json_suffix`] (`samples_ms`, ... for durations). Failures are reported on
/// stderr (a benchmark's table is its main output).
pub fn write_json(rows: &[Row], file: &str) -> PathBuf {
    let dir = target_dir().join("bulkhead-bench");
    let path = dir.join(file);
    let json: Vec<_> = rows
        .iter()
        .map(|r| {
            let s = r.unit.json_suffix();
            let mut row = serde_json::Map::new();
            row.insert("phase".into(), r.name.clone().into());
            row.insert("unit".into(), r.unit.label().into());
            row.insert(format!("samples_{s}"), r.samples.clone().into());
            row.insert(format!("p50_{s}"), r.pct(0.5).into());
            row.insert(format!("p90_{s}"), r.pct(0.9).into());
            serde_json::Value::Object(row)
        })
        .collect();
    let text = serde_json::to_string_pretty(&json).unwrap_or_default();
    if let Err(e) = std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, text)) {
        eprintln!("cannot write {}: {e}", path.display());
    }
    path
}

/// Seconds between the two readings of an `uptime <before> <after>` line in a benchmark
/// script's output (each a `/proc/uptime` first field, 10 ms resolution), e.g.
/// `uptime 12.34 15.67` → 3.33.
///
/// # Errors
/// No such line, or a run shorter than the clock's resolution; the message quotes `out`.
pub fn uptime_elapsed(out: &str) -> Result<f64, String> {
    let times: Vec<f64> = out
        .lines()
        .find_map(|l| l.strip_prefix("uptime "))
        .map(|t| {
            t.split_whitespace()
                .filter_map(|v| v.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    let [before, after] = times[..] else {
        return Err(format!("no `uptime` line in {out:?}"));
    };
    let seconds = after - before;
    if seconds <= 0.0 {
        return Err(format!(
            "the run took less than /proc/uptime's 10 ms resolution: {out:?}"
        ));
    }
    Ok(seconds)
}

/// Writes `mib` MiB of pseudo-random bytes (xorshift64, seeded from the clock) to `path` and
/// flushes them to its file system: benchmark data that no layer can compress or deduplicate.
///
/// # Panics
/// When the file cannot be created or written.
pub fn write_random_file(path: &std::path::Path, mib: u64) {
    use std::io::Write;
    use std::time::{SystemTime, UNIX_EPOCH};
    let mut file = std::fs::File::create(path).expect("create the data file");
    let mut state = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
        | 1;
    let mut chunk = vec![0u8; 1 << 20];
    for _ in 0..mib {
        for word in chunk.chunks_exact_mut(8) {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            word.copy_from_slice(&state.to_le_bytes());
        }
        file.write_all(&chunk).expect("write the data file");
    }
    file.sync_all().expect("flush the data file");
}
