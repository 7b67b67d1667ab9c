//! `bulkhead bench` end to end, through the CLI binary: every run's phases reach the JSON in
//! timeline order, and the plot is drawn. No timing is asserted (a slow machine is no failure).

use bulkhead_tests::{artifacts, describe, guest_test, scratch_dir};

/// The phases every run must report, in timeline order (the bench JSON's `phases_ms` keys).
const PHASES: [&str; 8] = [
    "vmm_start",
    "vm_created",
    "memory_ready",
    "kernel_entry",
    "guest_init",
    "agent_ready",
    "first_output",
    "vm_destroyed",
];

/// Asserts that the bench JSON's `run` has every one of `phases`, none before the one ahead of
/// it.
fn assert_phases_in_order(run: &serde_json::Value, phases: &[&str]) {
    let mut previous = 0.0;
    for phase in phases {
        let at = run["phases_ms"][phase]
            .as_f64()
            .unwrap_or_else(|| panic!("{phase} missing: {run}"));
        assert!(
            at >= previous,
            "{phase} at {at} ms precedes {previous}: {run}"
        );
        previous = at;
    }
}

guest_test!(
    fn three_cold_starts_report_every_phase_in_order_with_json_and_plot() {
        // Arrange
        let a = artifacts();
        let dir = scratch_dir();
        let (json, plot) = (dir.path().join("bench.json"), dir.path().join("bench.svg"));

        // Act
        let out = a
            .cli_command()
            .args(["bench", "--runs", "3", "--memory", "128", "--json"])
            .arg(&json)
            .arg("--plot")
            .arg(&plot)
            .output()
            .expect("run bulkhead bench");

        // Assert
        assert!(out.status.success(), "{}", describe(&out));
        let table = String::from_utf8_lossy(&out.stdout);
        assert!(
            table.contains("3 ok, 0 failed") && table.contains("end to end"),
            "{}",
            describe(&out)
        );
        let report: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&json).expect("bench JSON")).expect("JSON");
        assert_eq!(report["schema"], "bulkhead-bench/1");
        let runs = report["runs"].as_array().expect("runs");
        assert_eq!(runs.len(), 3);
        for run in runs {
            assert_eq!(run["ok"], true, "{run}");
            assert_phases_in_order(run, &PHASES);
            assert!(run["create_to_first_output_ms"].as_f64().is_some(), "{run}");
            assert!(run["memory"]["overhead_kib"].as_u64().is_some(), "{run}");
        }
        let svg = std::fs::read_to_string(&plot).expect("SVG plot");
        assert!(svg.trim_end().ends_with("</svg>"));
        assert!(
            svg.contains("kernel_entry → guest_init"),
            "phase names missing"
        );
    }
);

guest_test!(
    fn with_console_a_failed_run_keeps_the_guest_kernels_last_messages() {
        // Arrange: a command that logs a critical kernel message (printed even on a `quiet`
        // console) and then fails.
        let a = artifacts();
        let dir = scratch_dir();
        let json = dir.path().join("bench.json");
        let marker = "bulkhead-bench-console-check";
        let script = format!("echo '<2>{marker}' > /dev/kmsg; exit 3");

        // Act
        let out = a
            .cli_command()
            .args([
                "bench",
                "--runs",
                "1",
                "--memory",
                "128",
                "--console",
                "--json",
            ])
            .arg(&json)
            .args(["--", "sh", "-c", &script])
            .output()
            .expect("run bulkhead bench");

        // Assert: no run succeeded (exit 1), and the failed run's log tail has the message.
        assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
        let report: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&json).expect("bench JSON")).expect("JSON");
        assert_eq!(report["config"]["console"], true);
        let run = &report["runs"][0];
        assert_eq!(run["ok"], false, "{run}");
        assert_eq!(run["exit_code"], 3, "{run}");
        let tail = run["vmm_log_tail"].as_array().expect("vmm_log_tail");
        assert!(
            tail.iter()
                .any(|line| line.as_str().unwrap_or("").contains(marker)),
            "{run}"
        );
    }
);

guest_test!(
    /// Issue 29's restore phases: a bench of restores reports, per run, every phase but
    /// `guest_init` (the clone's guest did not boot) in timeline order, from the VMM's start
    /// (`create_to_vmm_start_ms`) to the VMM's end.
    fn restores_of_a_template_report_their_phases_in_order_without_guest_init() {
        // Arrange: a template in a data directory of the test's own.
        let a = artifacts();
        let data = tempfile::tempdir().unwrap();
        let json = data.path().join("bench.json");
        let created = a
            .cli_command()
            .args(["template", "create", "t", "--share-slots", "0"])
            .env("BULKHEAD_DATA_DIR", data.path())
            .output()
            .expect("run bulkhead template create");
        assert!(created.status.success(), "{}", describe(&created));

        // Act
        let out = a
            .cli_command()
            .args(["bench", "--runs", "2", "--template", "t", "--json"])
            .arg(&json)
            .env("BULKHEAD_DATA_DIR", data.path())
            .output()
            .expect("run bulkhead bench");

        // Assert
        assert!(out.status.success(), "{}", describe(&out));
        let table = String::from_utf8_lossy(&out.stdout);
        assert!(
            table.contains("2 ok, 0 failed") && table.contains("kernel_entry → agent_ready"),
            "{}",
            describe(&out)
        );
        let report: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&json).expect("bench JSON")).expect("JSON");
        for run in report["runs"].as_array().expect("runs") {
            assert_eq!(run["ok"], true, "{run}");
            assert!(run["phases_ms"]["guest_init"].is_null(), "{run}");
            assert!(run["create_to_vmm_start_ms"].as_f64().is_some(), "{run}");
            let restore_phases: Vec<&str> =
                PHASES.into_iter().filter(|p| *p != "guest_init").collect();
            assert_phases_in_order(run, &restore_phases);
        }
    }
);
