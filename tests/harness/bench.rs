//! Percentile tables for bulkhead's benchmarks (`benches/boot.rs`, `crates/daemon/benches`):
//! one [`Row`] per phase, printed as a table and written as JSON under
//! `target/bulkhead-bench/`.

use std::path::PathBuf;

use crate::target_dir;

/// The samples of one measured phase, in milliseconds, sorted ascending.
#[derive(Debug, Clone)]
pub struct Row {
    /// Phase name, e.g. `run: spawn → agent ready`.
    pub name: String,
    /// Samples in ms, sorted.
    pub samples: Vec<f64>,
}

impl Row {
    /// A row of `samples` (ms, any order).
    pub fn new(name: impl Into<String>, mut samples: Vec<f64>) -> Self {
        samples.sort_by(f64::total_cmp);
        Row {
            name: name.into(),
            samples,
        }
    }

    /// The `p` quantile (0.0..=1.0) by nearest rank, in ms; `NaN` without samples.
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

/// Prints `rows` as a table: phase, n, p50, p90, min, max (ms).
pub fn print_table(rows: &[Row]) {
    let width = rows
        .iter()
        .map(|r| r.name.chars().count())
        .max()
        .unwrap_or(5);
    println!(
        "{:<width$} {:>5} {:>10} {:>10} {:>10} {:>10}",
        "phase", "n", "p50 ms", "p90 ms", "min ms", "max ms"
    );
    for r in rows {
        println!(
            "{:<width$} {:>5} {:>10.1} {:>10.1} {:>10.1} {:>10.1}",
            r.name,
            r.samples.len(),
            r.pct(0.5),
            r.pct(0.9),
            r.pct(0.0),
            r.pct(1.0)
        );
    }
}

/// Writes `rows` as JSON (`phase`, `samples_ms`, `p50_ms`, `p90_ms` per row) to
/// `target/bulkhead-bench/<file>` and returns the path; failures are reported on stderr (a
/// benchmark's table is its main output).
pub fn write_json(rows: &[Row], file: &str) -> PathBuf {
    let dir = target_dir().join("bulkhead-bench");
    let path = dir.join(file);
    let json: Vec<_> = rows
        .iter()
        .map(|r| {
            serde_json::json!({
                "phase": r.name,
                "samples_ms": r.samples,
                "p50_ms": r.pct(0.5),
                "p90_ms": r.pct(0.9),
            })
        })
        .collect();
    let text = serde_json::to_string_pretty(&json).unwrap_or_default();
    if let Err(e) = std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, text)) {
        eprintln!("cannot write {}: {e}", path.display());
    }
    path
}
