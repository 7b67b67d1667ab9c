//! The bench's text report: percentiles per phase, per step and end to end, the VMM's memory
//! overhead, and the failures.

use std::fmt::Write;

use super::report::{BenchReport, Series};
use super::stats::summarize;

/// What a restore's phases mean (`bulkhead_sandbox::phases`).
const RESTORE_PHASES: &str = "(restored from a snapshot: vm_created = state read, memory mapped, VM created; memory_ready = devices and vCPUs restored; kernel_entry = vCPUs resumed; agent_ready = the agent acknowledged the restore)\n";

/// Width of the label column.
const LABEL: usize = 36;

/// The whole text report of `report`.
pub fn render(report: &BenchReport) -> String {
    let c = &report.config;
    let ok = report.ok_runs().count();
    let failed = report.runs.len() - ok;
    let mut out = format!(
        "bulkhead bench: {} {} running `{}` ({}, concurrency {}), {} vCPU, {} MiB{}: {ok} ok, {failed} failed\n",
        report.runs.len(),
        report.kind(),
        c.command.join(" "),
        c.mode,
        c.concurrency,
        c.vcpus,
        c.memory_mib,
        c.image.as_deref().map(|i| format!(", image {i}")).unwrap_or_default(),
    );
    out.push('\n');
    if ok == 0 {
        out.push_str("no run succeeded, so the tables are empty (they count ok runs only; the JSON keeps every run's phases)\n\n");
    }
    match (&c.template, &c.daemon) {
        (_, Some(socket)) => {
            let _ = writeln!(
                out,
                "(through the daemon at {}: the create's answer, then one exec)",
                socket.display()
            );
            out.push_str(&table("create (ms)", &report.daemon_series()));
            return out + &failures(report);
        }
        (Some(_), None) => {
            out.push_str(RESTORE_PHASES);
            out.push_str(&table("phase (ms since VMM start)", &report.phase_series()));
            out.push('\n');
            let mut steps = report.step_series();
            steps.insert(steps.len() - 1, report.ready_series());
            out.push_str(&table("step (ms)", &steps));
        }
        (None, None) => {
            out.push_str(&table("phase (ms since VMM start)", &report.phase_series()));
            out.push('\n');
            out.push_str(&table("step (ms)", &report.step_series()));
        }
    }
    out.push('\n');
    let overhead = Series {
        label: "VMM RSS overhead (KiB)".into(),
        values: report.overhead_kib(),
    };
    out.push_str(&table("memory", std::slice::from_ref(&overhead)));
    out.push_str("  (VmRSS of bulkhead-vmm minus its resident guest RAM, after the command)\n");
    out + &failures(report)
}

/// The failed runs, each with its error and the last lines of its VMM log; empty when none
/// failed.
fn failures(report: &BenchReport) -> String {
    let mut out = String::new();
    let failed = report.failures().count();
    if failed > 0 {
        let _ = writeln!(out, "\nfailures ({failed}):");
        for run in report.failures() {
            let _ = writeln!(
                out,
                "  run {}: {}",
                run.index,
                run.error.as_deref().unwrap_or("unknown")
            );
            let shown = run.vmm_log_tail.len().saturating_sub(FAILURE_LOG_LINES);
            for line in &run.vmm_log_tail[shown..] {
                let _ = writeln!(out, "    | {line}");
            }
        }
    }
    out
}

/// Lines of a failed run's VMM log shown under it (the JSON keeps more).
const FAILURE_LOG_LINES: usize = 3;

/// A titled table with one row per series: n, p50, p90, p99, min, max.
pub fn table(title: &str, series: &[Series]) -> String {
    let mut out = format!(
        "{title:<LABEL$} {:>4} {:>9} {:>9} {:>9} {:>9} {:>9}\n",
        "n", "p50", "p90", "p99", "min", "max"
    );
    for s in series {
        let label = truncate(&s.label);
        match summarize(&s.values) {
            Some(v) => {
                let _ = writeln!(
                    out,
                    "{label:<LABEL$} {:>4} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1}",
                    v.n, v.p50, v.p90, v.p99, v.min, v.max
                );
            }
            None => {
                let _ = writeln!(out, "{label:<LABEL$} {:>4} {:>9}", 0, "-");
            }
        }
    }
    out
}

/// `label` cut to the label column's width (by characters: labels contain arrows).
fn truncate(label: &str) -> String {
    label.chars().take(LABEL).collect()
}

#[cfg(test)]
mod tests {
    use super::super::report::tests::{report, run};
    use super::*;

    #[test]
    fn the_report_has_every_phase_the_end_to_end_time_memory_and_failures() {
        // Arrange
        let mut failed = run(2, 1.0);
        failed.ok = false;
        failed.error = Some("the guest agent was not ready".into());
        failed.vmm_log_tail = ["a", "b", "c", "vcpu0: guest shut down"]
            .map(String::from)
            .into();
        let r = report(vec![run(0, 10.0), run(1, 20.0), failed]);

        // Act
        let text = render(&r);

        // Assert
        for phase in bulkhead_sandbox::PHASE_NAMES {
            assert!(text.contains(phase), "{phase} missing:\n{text}");
        }
        assert!(text.contains("end to end: create → first_output"), "{text}");
        assert!(text.contains("2 ok, 1 failed"), "{text}");
        assert!(
            text.contains("run 2: the guest agent was not ready\n    | b\n    | c\n    | vcpu0: guest shut down\n"),
            "{text}"
        );
        let row = text.lines().find(|l| l.starts_with("agent_ready")).unwrap();
        let cells: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(cells[1..], ["2", "50.0", "100.0", "100.0", "50.0", "100.0"]);
        assert!(text.contains("VMM RSS overhead (KiB)"), "{text}");
    }

    #[test]
    fn a_report_without_ok_runs_says_why_its_tables_are_empty() {
        // Arrange
        let mut failed = run(0, 1.0);
        failed.ok = false;
        failed.error = Some("the command exited 3".into());
        let r = report(vec![failed]);

        // Act
        let text = render(&r);

        // Assert
        assert!(text.contains("0 ok, 1 failed"), "{text}");
        assert!(text.contains("no run succeeded"), "{text}");
        let row = text.lines().find(|l| l.starts_with("agent_ready")).unwrap();
        assert!(row.ends_with('-'), "{text}");
    }

    #[test]
    fn a_report_of_restores_shows_the_restores_phases_without_guest_init() {
        // Arrange: a restore has every phase but guest_init.
        let mut restored = run(0, 10.0);
        restored.phases_ms.guest_init = None;
        let mut r = report(vec![restored]);
        r.config.template = Some("py".into());

        // Act
        let text = render(&r);

        // Assert
        assert!(
            text.contains("1 restores of template py running `true`"),
            "{text}"
        );
        assert!(text.contains("kernel_entry = vCPUs resumed"), "{text}");
        assert!(!text.contains("guest_init"), "{text}");
        let row = |label: &str| {
            let line = text.lines().find(|l| l.starts_with(label)).unwrap();
            line.split_whitespace().rev().nth(4).unwrap().to_owned()
        };
        assert_eq!(row("kernel_entry → agent_ready"), "20.0", "{text}");
        assert_eq!(row("create → agent ready"), "60.0", "{text}");
        assert_eq!(row("end to end: create → first_output"), "70.0", "{text}");
    }

    #[test]
    fn a_series_without_values_shows_a_dash() {
        let empty = Series {
            label: "x".into(),
            values: vec![],
        };

        let text = table("t", &[empty]);

        assert!(text.lines().nth(1).unwrap().ends_with('-'), "{text}");
    }
}
