//! containerd benchmark (not a test): `ctr run --rm --runtime io.containerd.bulkhead.v2 IMAGE ID
//! echo hi` beside `bulkhead run -- echo hi`, each timed from its start to its first line of
//! output, alternating in one run of `scripts/containerd-demo.sh --bench N` (one private
//! containerd, an offline busybox image, the native snapshotter).
//!
//! `cargo build --release --workspace --bins && cargo bench -p bulkhead-tests --bench containerd`
//! — in the nested test host where this host's KVM cannot boot a stock kernel (absolute times
//! there are ~10× bare metal: compare the two rows). `BULKHEAD_BENCH_RUNS` (default 10) sets the
//! rounds. What `ctr run` adds over `bulkhead run`: containerd's container and task records, the
//! snapshot, the shim process and its ttRPC, the rootfs mount and the container exec's namespaces
//! and overlay in the guest. Results are also written as JSON to
//! `target/bulkhead-bench/containerd.json`.

use bulkhead_tests::bench::{env_count, print_table, write_json, Row};

fn main() {
    bulkhead_tests::bench::run(bench);
}

fn bench() {
    let runs = env_count("BULKHEAD_BENCH_RUNS", 10);
    let rounds = runs.to_string();
    let out = bulkhead_tests::containerd::demo(&["--bench", &rounds], &["echo", "hi"])
        .stderr(std::process::Stdio::inherit())
        .output()
        .expect("run scripts/containerd-demo.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "the demo failed: {stdout}");
    let samples = |what: &str| -> Vec<f64> {
        let prefix = format!("bench: {what} ");
        stdout
            .lines()
            .filter_map(|l| l.strip_prefix(&prefix))
            .map(|ms| {
                ms.parse()
                    .unwrap_or_else(|_| panic!("{what} printed nothing: {stdout}"))
            })
            .collect()
    };
    let rows = [
        Row::new("ctr run --rm → first output", samples("ctr")),
        Row::new("bulkhead run → first output", samples("run")),
    ];
    assert!(rows.iter().all(|r| r.samples.len() == runs), "{stdout}");
    print_table(&rows);
    println!(
        "ctr run / bulkhead run, p50: {:.2}",
        rows[0].pct(0.5) / rows[1].pct(0.5)
    );
    write_json(&rows, "containerd.json");
}
