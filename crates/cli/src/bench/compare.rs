//! `bulkhead bench --compare A.json B.json`: the p50 of every phase, step, the end-to-end time
//! and the memory overhead in both results, and their ratio B / A (below 1: B is faster or
//! smaller).

use std::fmt::Write;

use super::report::{BenchReport, Series};
use super::stats::summarize;

/// One compared quantity.
#[derive(Debug, Clone, PartialEq)]
pub struct Ratio {
    /// What is compared, e.g. `kernel_entry` or `kernel_entry → guest_init`.
    pub label: String,
    /// Its median in A.
    pub a_p50: Option<f64>,
    /// Its median in B.
    pub b_p50: Option<f64>,
    /// `b_p50 / a_p50`; `None` when either is missing or A's is zero.
    pub ratio: Option<f64>,
}

/// Every compared quantity of `a` and `b`, matched by name: the phases (ms since VMM start;
/// `vmm_start`, zero by definition, is left out), the steps, create → agent ready, the
/// end-to-end time and the memory overhead; `a`'s in its order, then those only `b` has. What
/// one side lacks is `-`: a restore has no `guest_init` (so neither step to or from it, but
/// `kernel_entry → agent_ready`), a result of creates through the daemon no phases or steps,
/// and a restore file of an older bulkhead none either. What neither side has is left out.
pub fn ratios(a: &BenchReport, b: &BenchReport) -> Vec<Ratio> {
    let (a, b) = (compared(a), compared(b));
    let only_b = b
        .iter()
        .filter(|sb| !a.iter().any(|sa| sa.label == sb.label));
    let labels: Vec<&str> = a.iter().chain(only_b).map(|s| s.label.as_str()).collect();
    let p50 = |side: &[Series], label: &str| {
        let series = side.iter().find(|s| s.label == label)?;
        summarize(&series.values).map(|s| s.p50)
    };
    labels
        .into_iter()
        .map(|label| {
            let (a_p50, b_p50) = (p50(&a, label), p50(&b, label));
            let ratio = match (a_p50, b_p50) {
                (Some(a), Some(b)) if a > 0.0 => Some(b / a),
                _ => None,
            };
            Ratio {
                label: label.to_owned(),
                a_p50,
                b_p50,
                ratio,
            }
        })
        .filter(|r| r.a_p50.is_some() || r.b_p50.is_some())
        .collect()
}

/// The series of `r` that [`ratios`] compares, in order.
fn compared(r: &BenchReport) -> Vec<Series> {
    let mut phases = r.phase_series();
    // The end-to-end series closes both lists; keep it once, at the end.
    phases.pop();
    let mut steps = r.step_series();
    steps.pop();
    let memory = Series {
        label: "VMM RSS overhead (KiB)".into(),
        values: r.overhead_kib(),
    };
    let mut all: Vec<Series> = phases.into_iter().skip(1).chain(steps).collect();
    all.extend([r.ready_series(), r.end_to_end(), memory]);
    all
}

/// The comparison as a table; `a_name` and `b_name` head the columns.
pub fn render(a_name: &str, b_name: &str, ratios: &[Ratio]) -> String {
    let cell = |v: Option<f64>, precision: usize| match v {
        Some(v) => format!("{v:.precision$}"),
        None => "-".to_owned(),
    };
    let mut out = format!("p50: A = {a_name}, B = {b_name}\n");
    let _ = writeln!(out, "{:<36} {:>10} {:>10} {:>7}", "", "A", "B", "B/A");
    for r in ratios {
        let label: String = r.label.chars().take(36).collect();
        let _ = writeln!(
            out,
            "{label:<36} {:>10} {:>10} {:>7}",
            cell(r.a_p50, 1),
            cell(r.b_p50, 1),
            cell(r.ratio, 2)
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::report::tests::{report, run};
    use super::*;

    #[test]
    fn b_twice_as_slow_as_a_gives_ratios_of_two() {
        // Arrange
        let a = report(vec![run(0, 10.0), run(1, 10.0), run(2, 30.0)]);
        let b = report(vec![run(0, 20.0), run(1, 20.0), run(2, 60.0)]);

        // Act
        let ratios = ratios(&a, &b);

        // Assert
        let guest_init = ratios.iter().find(|r| r.label == "guest_init").unwrap();
        assert_eq!(
            (guest_init.a_p50, guest_init.b_p50, guest_init.ratio),
            (Some(40.0), Some(80.0), Some(2.0))
        );
        let step = ratios
            .iter()
            .find(|r| r.label == "kernel_entry → guest_init")
            .unwrap();
        assert_eq!(step.ratio, Some(2.0));
        let e2e: Vec<_> = ratios
            .iter()
            .filter(|r| r.label.starts_with("end to end"))
            .collect();
        assert_eq!(e2e.len(), 1);
        assert_eq!(e2e[0].ratio, Some(2.0));
        let memory = ratios.last().unwrap();
        assert_eq!(memory.ratio, Some(1.0));
        assert!(!ratios.iter().any(|r| r.label == "vmm_start"));
        let ready = ratios
            .iter()
            .find(|r| r.label == "create → agent ready")
            .unwrap();
        assert_eq!(ready.ratio, Some(2.0));
    }

    #[test]
    fn cold_starts_and_restores_compare_by_ready_end_to_end_and_memory() {
        // Arrange: B restored from a template: no phases, half the end-to-end time.
        let a = report(vec![run(0, 10.0)]);
        let mut restored = run(0, 5.0);
        restored.phases_ms = Default::default();
        restored.create_to_vmm_start_ms = None;
        let mut b = report(vec![restored]);
        b.config.template = Some("py".into());

        // Act
        let ratios = ratios(&a, &b);
        let text = render("cold.json", "tpl.json", &ratios);

        // Assert
        let ratio_of = |label: &str| ratios.iter().find(|r| r.label == label).unwrap().ratio;
        assert_eq!(ratio_of("end to end: create → first_output"), Some(0.5));
        assert_eq!(ratio_of("create → agent ready"), Some(0.5));
        assert_eq!(ratio_of("guest_init"), None);
        let guest_init = text.lines().find(|l| l.starts_with("guest_init")).unwrap();
        assert!(guest_init.ends_with('-'), "{text}");
    }

    #[test]
    fn results_through_the_daemon_compare_only_what_they_measured() {
        // Arrange: runs through the daemon have no phases and no memory sample.
        let through_daemon = |scale: f64| {
            let mut r = run(0, scale);
            r.phases_ms = Default::default();
            r.create_to_vmm_start_ms = None;
            r.memory = None;
            let mut report = report(vec![r]);
            report.config.daemon = Some("/run/d.sock".into());
            report
        };

        // Act
        let ratios = ratios(&through_daemon(10.0), &through_daemon(1.0));

        // Assert
        let labels: Vec<&str> = ratios.iter().map(|r| r.label.as_str()).collect();
        assert_eq!(
            labels,
            ["create → agent ready", "end to end: create → first_output"]
        );
        assert_eq!(ratios[1].ratio, Some(0.1));
    }

    #[test]
    fn a_side_without_successful_runs_has_no_ratio() {
        let a = report(vec![run(0, 10.0)]);
        let mut failed = run(0, 10.0);
        failed.ok = false;
        let b = report(vec![failed]);

        let ratios = ratios(&a, &b);
        let text = render("a.json", "b.json", &ratios);

        assert!(ratios.iter().all(|r| r.ratio.is_none()));
        assert!(text.contains("A = a.json, B = b.json"), "{text}");
        assert!(text.lines().nth(2).unwrap().ends_with('-'), "{text}");
    }
}
