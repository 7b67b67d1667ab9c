//! Daemon benchmark (not a test): create → first exec output through `bulkheadd`, with real VMs.
//!
//! `cargo bench -p bulkhead-daemon --bench daemon` — on hosts whose KVM cannot boot a stock
//! kernel it re-runs itself inside the nested test host (absolute times there are ~10× bare
//! metal). Each sample is one client doing `POST /v1/sandboxes` (which answers once the guest
//! agent is ready) and then `POST /v1/sandboxes/{id}/exec` of `echo hi`, timed from the create
//! request to the first output line of the NDJSON stream; the sandbox is deleted afterwards
//! (not timed). Two series:
//!
//! - **sequential**: one sample after the other (`BULKHEAD_BENCH_RUNS`, default 20);
//! - **burst**: that many clients at once (`BULKHEAD_BENCH_BURST`, default 10), repeated
//!   `BULKHEAD_BENCH_BURSTS` times (default 2), all samples pooled.
//!
//! Results are printed as a p50/p90 table and written as JSON to
//! `target/bulkhead-bench/daemon.json`.

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::Instant;

use bulkhead_client::{Client, ExecEvent, ExecSpec};
use bulkhead_tests::bench::{env_count, print_table, write_json, Row};
use common::real::{real_daemon, small, vm_logs};

/// Guest RAM of each benchmarked sandbox, MiB.
const GUEST_MIB: u32 = 64;

fn main() {
    bulkhead_tests::bench::run(bench);
}

fn bench() {
    let runs = env_count("BULKHEAD_BENCH_RUNS", 20);
    let burst = env_count("BULKHEAD_BENCH_BURST", 10);
    let bursts = env_count("BULKHEAD_BENCH_BURSTS", 2);
    let daemon = real_daemon("", &[]);
    let client = daemon.client();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let vms = daemon.vms_dir();
    let sample = |client: Client| {
        let vms = vms.clone();
        async move {
            create_to_first_output(&client)
                .await
                .unwrap_or_else(|e| panic!("{e}\n{}", vm_logs(&vms)))
        }
    };

    let sequential: Vec<f64> = (0..runs)
        .map(|_| rt.block_on(sample(client.clone())))
        .collect();
    let mut pooled = Vec::new();
    for _ in 0..bursts {
        let samples = rt.block_on(futures_util::future::join_all(
            (0..burst).map(|_| sample(client.clone())),
        ));
        pooled.extend(samples);
    }
    assert_eq!(daemon.leftovers(&[]), Vec::<String>::new());

    let rows = [
        Row::new("create → first exec output, sequential", sequential),
        Row::new(
            format!("create → first exec output, burst of {burst} (x{bursts})"),
            pooled,
        ),
    ];
    print_table(&rows);
    write_json(&rows, "daemon.json");
}

/// One sample: create, exec `echo hi` until its first output, delete. Returns the ms from the
/// create request to that output.
async fn create_to_first_output(client: &Client) -> Result<f64, String> {
    let started = Instant::now();
    let sb = client
        .create(&small(GUEST_MIB))
        .await
        .map_err(|e| format!("create: {e}"))?;
    let first = async {
        let mut stream = client
            .exec(&sb.id, &ExecSpec::new(["echo", "hi"]))
            .await
            .map_err(|e| format!("exec: {e}"))?;
        let first = stream
            .next_event()
            .await
            .map_err(|e| format!("exec: {e}"))?;
        let ms = started.elapsed().as_secs_f64() * 1e3;
        match first {
            Some(ExecEvent::Stdout(b)) if b == b"hi\n" => Ok(ms),
            other => Err(format!("unexpected first event {other:?}")),
        }
    }
    .await;
    client
        .delete(&sb.id)
        .await
        .map_err(|e| format!("delete: {e}"))?;
    first
}
