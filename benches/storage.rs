//! Storage benchmark (issue 5; not a test): sequential disk reads in a guest against the same
//! reads on the host, and boot → agent ready from a root filesystem image against the initramfs.
//!
//! `cargo bench -p bulkhead-tests --bench storage` — on hosts whose KVM cannot boot a stock
//! kernel it re-runs itself inside the nested test host (absolute numbers there are far from bare
//! metal; compare the rows of one run with each other). Measured:
//!
//! - **seq read**: a 256 MiB file of pseudo-random bytes, attached to an initramfs sandbox as a
//!   read-only data disk (`/dev/vda`), read with `dd bs=1M iflag=direct` in the guest, and the
//!   same file read with the same `dd` command on the host (the machine running the benchmark:
//!   inside the test host when delegated), alternating host and guest runs in one sandbox.
//!   Each read is timed in the shell around `dd` with `/proc/uptime` (10 ms resolution; busybox
//!   `dd`, the one in the guest and the test host, prints no time) and must report 256 full
//!   1 MiB records. The table gives MiB/s, and the guest/host ratio of the medians is printed
//!   under it.
//! - **boot→ready**: `Sandbox::start_with` → the agent's readiness (`timings().ready`), for the
//!   agent initramfs as root and for the cached Debian test image (`--image debian`, writable
//!   layer in tmpfs), alternating the two; each boot is checked to have the root it claims.
//!
//! What the read rows mean: `O_DIRECT` keeps each side's *own* page cache out (the guest's, and
//! the host's for the host-side `dd`), but `bulkhead-vmm` reads the backing file with ordinary
//! buffered `pread`s, so the guest's reads go through the host's page cache. To keep that cache
//! from serving either side from RAM, the host's page cache is dropped (`/proc/sys/vm/drop_caches`,
//! root only; a note is printed when that fails) before every read, host or guest. The backing
//! file lives in the scratch directory (`target/bulkhead-tests/tmp`), so outside the test host
//! it is on the workspace's file system, and inside the test host it is on the 9p share of the
//! build machine's `target/` (`cache=loose`): there both sides fetch the bytes from QEMU's 9p
//! server, which reads the build machine's file (most likely from the build machine's page
//! cache, as the file was just written). The rows then compare two paths to the same 9p-backed
//! file — virtio-blk through the VMM against a direct read — not a disk's speed.
//!
//! `BULKHEAD_BENCH_RUNS` (default 5) sets the number of reads per side and of boots per root.
//! Results are also written as JSON to `target/bulkhead-bench/storage.json`.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use bulkhead_sandbox::{Sandbox, SandboxConfig, Storage};
use bulkhead_tests::bench::{
    env_count, print_table, uptime_elapsed, write_json, write_random_file, Row, Unit,
};
use bulkhead_tests::{artifacts, run_sh, sandbox_config, scratch_dir};
use bulkhead_vmm::config::DiskConfig;

/// Size of the data disk, MiB (`dd bs=1M` reads it in this many records).
const DISK_MIB: u64 = 256;

/// The data disk in the guest: the first virtio-blk disk when there is no root image.
const GUEST_DISK: &str = "/dev/vda";

/// Guest RAM, MiB.
const GUEST_MIB: u32 = 256;

fn main() {
    // Built or found in its cache here: inside the test host only its path is computed.
    artifacts().debian_image();
    bulkhead_tests::bench::run(bench);
}

fn bench() {
    let runs = env_count("BULKHEAD_BENCH_RUNS", 5);
    let (initramfs, image) = boot_runs(runs);
    let (guest, host) = read_runs(runs);
    let rows = [
        Row::new("boot→ready: initramfs", initramfs),
        Row::new("boot→ready: --image debian", image),
        Row::with_unit("seq read MiB/s: guest O_DIRECT", guest, Unit::MibPerS),
        Row::with_unit("seq read MiB/s: host O_DIRECT", host, Unit::MibPerS),
    ];
    print_table(&rows);
    println!(
        "seq read guest/host ratio (p50/p50): {:.2}",
        rows[2].pct(0.5) / rows[3].pct(0.5)
    );
    write_json(&rows, "storage.json");
}

fn config() -> SandboxConfig {
    SandboxConfig {
        memory_mib: GUEST_MIB,
        ..sandbox_config()
    }
}

/// Boots `runs` sandboxes on each root, alternating; returns (initramfs, image) ready times in
/// ms.
fn boot_runs(runs: usize) -> (Vec<f64>, Vec<f64>) {
    let image = Storage {
        root_image: Some(artifacts().debian_image()),
        ..Storage::default()
    };
    let (mut initramfs, mut debian) = (Vec::new(), Vec::new());
    for i in 1..=runs {
        initramfs.push(ready_ms(
            &Storage::default(),
            "test ! -e /etc/debian_version",
        ));
        debian.push(ready_ms(&image, "test -f /etc/debian_version"));
        eprintln!("boot {i}/{runs} done");
    }
    (initramfs, debian)
}

/// Starts a sandbox with `storage`, checks its root with the shell test `check` (not timed) and
/// destroys it; returns its boot → agent-ready time in ms.
fn ready_ms(storage: &Storage, check: &str) -> f64 {
    let sandbox = Sandbox::start_with(&config(), storage).expect("sandbox start");
    let ready = sandbox.timings().ready.as_secs_f64() * 1e3;
    let out = run_sh(&sandbox, check);
    assert!(out.status.success(), "root check `{check}` failed: {out:?}");
    sandbox.destroy().expect("destroy");
    ready
}

/// Reads the data disk `runs` times in a guest and on the host, alternating; returns (guest,
/// host) MiB/s.
fn read_runs(runs: usize) -> (Vec<f64>, Vec<f64>) {
    let dir = scratch_dir();
    let path = random_disk(dir.path());
    let storage = Storage {
        data_disks: vec![DiskConfig {
            path: path.clone(),
            read_only: true,
            id: None,
            backing: None,
        }],
        ..Storage::default()
    };
    let sandbox = Sandbox::start_with(&config(), &storage).expect("sandbox start");
    let (mut guest, mut host) = (Vec::new(), Vec::new());
    let mut note = None;
    for i in 1..=runs {
        drop_page_cache(&mut note);
        host.push(parse_read(&host_read(&path)).expect("host read"));
        drop_page_cache(&mut note);
        let out = run_sh(&sandbox, &read_script(GUEST_DISK));
        assert!(out.status.success(), "guest read failed: {out:?}");
        guest.push(parse_read(&String::from_utf8_lossy(&out.stdout)).expect("guest read"));
        eprintln!("read {i}/{runs} done");
    }
    sandbox.destroy().expect("destroy");
    if let Some(e) = note {
        println!(
            "note: the host's page cache could not be dropped ({e}); \
             the guest's reads may have come from the host's RAM"
        );
    }
    (guest, host)
}

/// Writes the `DISK_MIB` MiB data disk, pseudo-random bytes, into `dir`.
fn random_disk(dir: &Path) -> PathBuf {
    let path = dir.join("data.img");
    write_random_file(&path, DISK_MIB);
    path
}

/// Drops the clean page cache of the machine running the benchmark (root only); keeps the first
/// failure in `note`.
fn drop_page_cache(note: &mut Option<String>) {
    if let Err(e) = fs::write("/proc/sys/vm/drop_caches", "3") {
        note.get_or_insert(e.to_string());
    }
}

/// The shell script of one timed read of `source`: `dd`'s report (stderr) and then
/// `uptime <before> <after>` (seconds, from `/proc/uptime`) on stdout; exits with `dd`'s status.
fn read_script(source: &str) -> String {
    format!(
        "read t0 rest < /proc/uptime\n\
         dd if='{source}' of=/dev/null bs=1M iflag=direct 2>&1\n\
         s=$?\n\
         read t1 rest < /proc/uptime\n\
         echo \"uptime $t0 $t1\"\n\
         exit $s\n"
    )
}

/// Runs the read script on the host; returns its stdout.
fn host_read(path: &Path) -> String {
    let source = path.to_str().expect("UTF-8 scratch path");
    let out = Command::new("sh")
        .args(["-c", &read_script(source)])
        .output()
        .expect("run sh");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "host read failed: {stdout}");
    stdout
}

/// MiB/s of one read from the read script's output, after checking that `dd` read exactly
/// `DISK_MIB` full 1 MiB records.
fn parse_read(out: &str) -> Result<f64, String> {
    let records = out
        .lines()
        .find(|l| l.ends_with("records in"))
        .and_then(|l| l.split_whitespace().next())
        .ok_or_else(|| format!("no `records in` line in {out:?}"))?;
    if records != format!("{DISK_MIB}+0") {
        return Err(format!("read {records} records, not {DISK_MIB}+0: {out:?}"));
    }
    let seconds = uptime_elapsed(out)?;
    Ok(DISK_MIB as f64 / seconds)
}
