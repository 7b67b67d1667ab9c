//! Cold-start benchmark (not a test): boots real guests and prints p50/p90 tables.
//!
//! `cargo bench -p bulkhead-tests --bench boot` — on hosts whose KVM cannot boot a stock kernel it
//! re-runs itself inside the nested test host (absolute times there are ~10× bare metal; compare
//! configurations within one run). Phases:
//!
//! - **boot**: `bulkhead-vmm` process start → the test init's first write to the debug port
//!   (guest init reached), and → VMM exit (init rebooted the guest), from the VMM's own timeline;
//! - **run**: `Sandbox::start` → agent ready (spawn→agent-ready), and → exit status of `true`
//!   received (spawn→exit);
//! - **exec**: round trip of `true` in a running sandbox.
//!
//! `BULKHEAD_BENCH_RUNS` (default 10) sets the boot and run counts, `BULKHEAD_BENCH_EXECS`
//! (default 100) the exec count (unset, unparsable or 0: the default). Results are also written
//! as JSON to `target/bulkhead-bench/boot.json`.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use bulkhead_protocol::ExecRequest;
use bulkhead_sandbox::{Sandbox, SandboxConfig};
use bulkhead_tests::bench::{env_count, print_table, write_json, Row};
use bulkhead_tests::{artifacts, scratch_dir};
use bulkhead_vmm::TimelineMs;

fn main() {
    bulkhead_tests::bench::run(bench);
}

fn bench() {
    let runs = env_count("BULKHEAD_BENCH_RUNS", 10);
    let execs = env_count("BULKHEAD_BENCH_EXECS", 100);
    let mut rows = Vec::new();
    let (init, exit) = boot_runs(runs);
    rows.push(Row::new("boot: spawn → guest init", init));
    rows.push(Row::new("boot: spawn → VMM exit (reboot)", exit));
    let (ready, done) = sandbox_runs(runs);
    rows.push(Row::new("run: spawn → agent ready", ready));
    rows.push(Row::new("run: spawn → exit status of `true`", done));
    rows.push(Row::new("exec: round trip of `true`", exec_runs(execs)));
    print_table(&rows);
    write_json(&rows, "boot.json");
}

/// Boots the test init `runs` times; returns (init ms, exit ms) from the VMM's timeline.
fn boot_runs(runs: usize) -> (Vec<f64>, Vec<f64>) {
    let a = artifacts();
    let (mut init, mut exit) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        let dir = scratch_dir();
        let timings = dir.path().join("timings.json");
        let debugcon = dir.path().join("debugcon.txt");
        let status = Command::new(&a.vmm)
            .args(["--kernel", a.vmlinux.to_str().unwrap(), "--initrd", a.test_initrd.to_str().unwrap()])
            .args(["--serial", "off", "--debugcon", debugcon.to_str().unwrap()])
            .args(["--timings-json", timings.to_str().unwrap()])
            .args(["--cmdline", "console=ttyS0 reboot=k panic=1 nomodule i8042.noaux i8042.nomux i8042.nopnp i8042.dumbkbd quiet"])
            .status()
            .expect("run bulkhead-vmm");
        assert!(status.success(), "boot failed: {status}");
        let t = read_timeline(&timings);
        init.push(t.guest_init.expect("guest init reported on the debug port"));
        exit.push(t.exited.expect("exit time"));
    }
    (init, exit)
}

fn read_timeline(path: &Path) -> TimelineMs {
    let text = std::fs::read_to_string(path).expect("timings file");
    serde_json::from_str(&text).expect("timings JSON")
}

fn sandbox_config() -> SandboxConfig {
    let a = artifacts();
    SandboxConfig {
        kernel: a.vmlinux.clone(),
        initrd: a.agent_initrd.clone(),
        vmm_binary: a.vmm.clone(),
        ready_timeout: Duration::from_secs(300),
        ..SandboxConfig::default()
    }
}

/// Starts a sandbox and runs `true` `runs` times; returns (ready ms, exit-status ms).
fn sandbox_runs(runs: usize) -> (Vec<f64>, Vec<f64>) {
    let (mut ready, mut done) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        let started = Instant::now();
        let sandbox = Sandbox::start(&sandbox_config()).expect("sandbox start");
        ready.push(ms(sandbox.timings().ready));
        let out = sandbox
            .exec(&ExecRequest::new(["true"]))
            .expect("exec")
            .wait_with_output()
            .expect("output");
        assert!(out.status.success());
        done.push(ms(started.elapsed()));
        sandbox.destroy().expect("destroy");
    }
    (ready, done)
}

fn exec_runs(execs: usize) -> Vec<f64> {
    let sandbox = Sandbox::start(&sandbox_config()).expect("sandbox start");
    let samples = (0..execs)
        .map(|_| {
            let started = Instant::now();
            let out = sandbox
                .exec(&ExecRequest::new(["true"]))
                .expect("exec")
                .wait_with_output()
                .expect("output");
            assert!(out.status.success());
            ms(started.elapsed())
        })
        .collect();
    sandbox.destroy().expect("destroy");
    samples
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
