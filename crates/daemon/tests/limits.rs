//! Host limits of the VMM's cgroup, on this host's cgroup hierarchy (v1 on the build machines,
//! v2 elsewhere; needs root). The fake VMM runs guest commands as its own children, so they are
//! in the VMM's cgroup and its CPU, pids and memory limits bound them directly.

mod common;

use std::fs;
use std::time::{Duration, Instant};

use bulkhead_client::{CreateSandbox, ExecSpec, SandboxInfo};
use common::{cgroup_file, rt, TestDaemon};

fn read(info: &SandboxInfo, controller: &str, file: &str) -> String {
    let path = cgroup_file(info, controller, file);
    fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .trim()
        .to_owned()
}

/// CPU time used by the cgroup so far, µs, by the cgroup's own accounting (v2 `cpu.stat`
/// `usage_usec`, v1 `cpuacct.usage` in ns).
fn cpu_usage_us(info: &SandboxInfo) -> u64 {
    if common::cgroup_roots() == [std::path::PathBuf::from("/sys/fs/cgroup")] {
        let stat = read(info, "cpu", "cpu.stat");
        return stat
            .lines()
            .find_map(|l| l.strip_prefix("usage_usec "))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
    }
    read(info, "cpuacct", "cpuacct.usage")
        .parse::<u64>()
        .unwrap_or(0)
        / 1000
}

#[test]
fn the_vmm_runs_in_its_cgroup_with_memory_cpu_and_pids_limits() {
    // Arrange
    let daemon = TestDaemon::start();
    let client = daemon.client();
    let rt = rt();
    let spec = CreateSandbox {
        memory_mib: 128,
        cpu_quota: Some(0.5),
        pids_max: Some(24),
        ..CreateSandbox::default()
    };

    // Act
    let info = rt.block_on(client.create(&spec)).unwrap();

    // Assert
    let procs = read(&info, "memory", "cgroup.procs");
    assert!(
        procs
            .lines()
            .any(|p| p == info.vmm_pid.unwrap().to_string()),
        "{procs}"
    );
    assert_eq!(info.limits.memory_bytes, (128 + 64) << 20);
    let v2 = cgroup_file(&info, "memory", "memory.max").exists();
    let (memory, cpu) = match v2 {
        true => (
            read(&info, "memory", "memory.max"),
            read(&info, "cpu", "cpu.max"),
        ),
        false => (
            read(&info, "memory", "memory.limit_in_bytes"),
            format!(
                "{} {}",
                read(&info, "cpu", "cpu.cfs_quota_us"),
                read(&info, "cpu", "cpu.cfs_period_us")
            ),
        ),
    };
    assert_eq!(memory, ((128u64 + 64) << 20).to_string());
    assert_eq!(cpu, "50000 100000");
    assert_eq!(read(&info, "pids", "pids.max"), "24");
    rt.block_on(client.delete(&info.id)).unwrap();
}

#[test]
fn the_pids_limit_stops_the_vmm_from_forking_past_it() {
    // Arrange
    let daemon = TestDaemon::start();
    let client = daemon.client();
    let rt = rt();
    let spec = CreateSandbox {
        pids_max: Some(24),
        ..CreateSandbox::default()
    };
    let info = rt.block_on(client.create(&spec)).unwrap();
    let script = "for i in $(seq 60); do sleep 2 & done; wait";

    // Act
    let out = rt
        .block_on(client.exec_collect(&info.id, &ExecSpec::new(["sh", "-c", script])))
        .unwrap();

    // Assert
    let stderr = String::from_utf8_lossy(&out.stderr).to_lowercase();
    assert!(
        stderr.contains("fork"),
        "60 children fit under pids.max 24: {stderr}"
    );
    rt.block_on(client.delete(&info.id)).unwrap();
}

#[test]
fn a_half_cpu_quota_holds_two_spinning_threads_to_about_half_a_cpu() {
    // Arrange
    let daemon = TestDaemon::start();
    let client = daemon.client();
    let rt = rt();
    let spec = CreateSandbox {
        vcpus: 2,
        cpu_quota: Some(0.5),
        ..CreateSandbox::default()
    };
    let info = rt.block_on(client.create(&spec)).unwrap();
    let spin =
        "timeout 3 sh -c 'while :; do :; done' & timeout 3 sh -c 'while :; do :; done'; wait";
    let before = cpu_usage_us(&info);
    let started = Instant::now();

    // Act
    rt.block_on(client.exec_collect(&info.id, &ExecSpec::new(["sh", "-c", spin])))
        .unwrap();
    let used = Duration::from_micros(cpu_usage_us(&info) - before);
    let elapsed = started.elapsed();

    // Assert
    let share = used.as_secs_f64() / elapsed.as_secs_f64();
    assert!(
        share <= 0.6,
        "used {used:?} of CPU in {elapsed:?} ({share:.2} CPUs)"
    );
    assert!(share >= 0.1, "the spinners barely ran: {share:.2} CPUs");
    rt.block_on(client.delete(&info.id)).unwrap();
}
