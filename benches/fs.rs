//! virtio-fs benchmark (issue 6; not a test): reading a large file and walking a large tree
//! through a `--mount` share in a guest, against the same operations on the host.
//!
//! `cargo bench -p bulkhead-tests --bench fs` — on hosts whose KVM cannot boot a stock kernel it
//! re-runs itself inside the nested test host (absolute numbers there are far from bare metal;
//! compare the rows of one run with each other). Measured, in one initramfs sandbox with one
//! read-only share of the data directory at `/mnt/data`:
//!
//! - **read**: a 256 MiB file of pseudo-random bytes, read with `dd bs=1M of=/dev/null` in the
//!   guest (through the share) and with the same `dd` command on the host (the machine running
//!   the benchmark: inside the test host when delegated). Each read must report 256 full 1 MiB
//!   records. MiB/s.
//! - **walk**: `find DIR | wc -l` over a tree of 100 directories of 200 empty files each
//!   (20,000 files), in the guest and on the host; each walk must count every entry (20,101:
//!   the root, the directories, the files). ms.
//!
//! Host and guest runs alternate (host first), `BULKHEAD_BENCH_RUNS` times each (default 5).
//! Each run is timed in the shell around the command with `/proc/uptime` (10 ms resolution;
//! busybox, the userland of the guest and of the test host, has no finer clock in the shell), so
//! one run must take at least 10 ms. The table is printed with the guest/host ratios of the
//! medians under it (read: below 1 means the guest is slower; walk: above 1 means the guest is
//! slower), and written as JSON to `target/bulkhead-bench/fs.json`.
//!
//! Where the data lives: in the system temp dir of the machine running the benchmark, *not* in
//! `target/`. Inside the test host that is its own RAM file system (its `/tmp`, on the initramfs
//! root), so neither side goes through the test host's 9p share of the build machine's
//! `target/`: both read the same RAM-backed files, and the rows compare the virtio-fs path
//! (guest kernel → virtqueue → `bulkhead-vmm`'s FUSE server → the host file system) with a local
//! read. The file system type of the data directory is printed with the results.
//!
//! Caches: before every guest run the guest's page, dentry and inode caches are dropped (the
//! guest runs as root), so the guest's data and lookups go to the VMM every time; before every
//! run on either side the host's clean page cache is dropped (root only; a note is printed when
//! that fails). On a RAM file system (tmpfs/ramfs) that drop cannot evict anything: the host's
//! reads and walks are always served from RAM, and so are the VMM's. On a disk-backed temp dir
//! both sides start cold from the disk.
//!
//! Open files: `bulkhead-vmm`'s FUSE server (fuse-backend-rs's passthrough) keeps one `O_PATH`
//! descriptor open for every inode the guest has looked up and not yet forgotten. The first run of
//! this benchmark found that under the test host's default soft `RLIMIT_NOFILE` (1024) the
//! guest's walk failed with `EMFILE` ("Too many open files") after 988 entries; since then the VMM
//! raises its own limit at start (`bulkhead_vmm::limits`), and the recorded results were taken
//! with the same limit set by this benchmark for the VMM.

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::Command;

use bulkhead_sandbox::{Mount, Sandbox, SandboxConfig};
use bulkhead_tests::bench::{
    env_count, print_table, uptime_elapsed, write_json, write_random_file, Row, Unit,
};
use bulkhead_tests::{run_sh, sandbox_config};

/// Size of the file read, MiB (`dd bs=1M` reads it in this many records).
const FILE_MIB: u64 = 256;

/// Directories in the walked tree, and empty files in each.
const DIRS: usize = 100;
const FILES_PER_DIR: usize = 200;

/// Entries `find` prints for the tree: its root, the directories and the files.
const TREE_ENTRIES: usize = 1 + DIRS + DIRS * FILES_PER_DIR;

/// Where the guest sees the data directory.
const GUEST_SHARE: &str = "/mnt/data";

/// Names of the file and the tree in the data directory.
const FILE_NAME: &str = "data.bin";
const TREE_NAME: &str = "tree";

/// Guest RAM, MiB.
const GUEST_MIB: u32 = 256;

fn main() {
    bulkhead_tests::bench::run(bench);
}

fn bench() {
    let runs = env_count("BULKHEAD_BENCH_RUNS", 5);
    let data = tempfile::Builder::new()
        .prefix("bulkhead-fs-bench-")
        .tempdir()
        .expect("create the data directory");
    write_random_file(&data.path().join(FILE_NAME), FILE_MIB);
    file_tree(&data.path().join(TREE_NAME));
    let share = Mount {
        host: data.path().to_owned(),
        guest: PathBuf::from(GUEST_SHARE),
        read_only: true,
    };
    let sandbox = Sandbox::start(&config(share)).expect("sandbox start");
    let mut note = None;
    let (mut read, mut walk) = (Sides::default(), Sides::default());
    for i in 1..=runs {
        read.run(&sandbox, data.path(), Op::Read, &mut note);
        walk.run(&sandbox, data.path(), Op::Walk, &mut note);
        eprintln!("run {i}/{runs} done");
    }
    sandbox.destroy().expect("destroy");
    let rows = [
        Row::with_unit("read 256 MiB: guest virtio-fs", read.guest, Unit::MibPerS),
        Row::with_unit("read 256 MiB: host", read.host, Unit::MibPerS),
        Row::new("walk 20,000 files: guest virtio-fs", walk.guest),
        Row::new("walk 20,000 files: host", walk.host),
    ];
    println!(
        "data directory: {} (file system: {})",
        data.path().display(),
        fs_type(data.path())
    );
    print_table(&rows);
    let ratio = |guest: &Row, host: &Row| guest.pct(0.5) / host.pct(0.5);
    println!(
        "read guest/host ratio (p50/p50, MiB/s): {:.2}",
        ratio(&rows[0], &rows[1])
    );
    println!(
        "walk guest/host ratio (p50/p50, ms): {:.2}",
        ratio(&rows[2], &rows[3])
    );
    if let Some(e) = note {
        println!(
            "note: the host's page cache could not be dropped ({e}); \
             the host side may have read from RAM"
        );
    }
    write_json(&rows, "fs.json");
}

fn config(share: Mount) -> SandboxConfig {
    SandboxConfig {
        memory_mib: GUEST_MIB,
        mounts: vec![share],
        ..sandbox_config()
    }
}

/// What one run does.
#[derive(Clone, Copy)]
enum Op {
    /// `dd` the file.
    Read,
    /// `find | wc -l` the tree.
    Walk,
}

impl Op {
    /// The timed shell script for the data directory at `dir`: the command's output, then
    /// `uptime <before> <after>` (seconds, from `/proc/uptime`); exits non-zero when the command
    /// (`dd`) fails.
    fn script(self, dir: &str) -> String {
        let command = match self {
            Op::Read => format!("dd if='{dir}/{FILE_NAME}' of=/dev/null bs=1M 2>&1; s=$?"),
            Op::Walk => format!("echo \"count $(find '{dir}/{TREE_NAME}' | wc -l)\"; s=0"),
        };
        format!(
            "read t0 rest < /proc/uptime\n\
             {command}\n\
             read t1 rest < /proc/uptime\n\
             echo \"uptime $t0 $t1\"\n\
             exit $s\n"
        )
    }

    /// The sample of one run from its script's output: MiB/s for a read, ms for a walk, after
    /// checking that the read had every record and the walk counted every entry.
    fn sample(self, out: &str) -> Result<f64, String> {
        let seconds = uptime_elapsed(out)?;
        match self {
            Op::Read => {
                let records = out
                    .lines()
                    .find(|l| l.ends_with("records in"))
                    .and_then(|l| l.split_whitespace().next())
                    .ok_or_else(|| format!("no `records in` line in {out:?}"))?;
                if records != format!("{FILE_MIB}+0") {
                    return Err(format!("read {records} records, not {FILE_MIB}+0: {out:?}"));
                }
                Ok(FILE_MIB as f64 / seconds)
            }
            Op::Walk => {
                let count = out.lines().find_map(|l| l.strip_prefix("count "));
                if count.map(str::trim) != Some(&TREE_ENTRIES.to_string()) {
                    return Err(format!(
                        "the walk did not list {TREE_ENTRIES} entries: {out:?}"
                    ));
                }
                Ok(seconds * 1e3)
            }
        }
    }
}

/// The samples of one operation on each side.
#[derive(Default)]
struct Sides {
    guest: Vec<f64>,
    host: Vec<f64>,
}

impl Sides {
    /// One host run of `op` on `dir`, then one guest run on the share; caches dropped before
    /// each (see the module docs).
    fn run(&mut self, sandbox: &Sandbox, dir: &Path, op: Op, note: &mut Option<String>) {
        drop_page_cache(note);
        let dir = dir.to_str().expect("UTF-8 temp dir");
        let out = Command::new("sh")
            .args(["-c", &op.script(dir)])
            .output()
            .expect("run sh");
        let text = output_text(&out.stdout, &out.stderr);
        assert!(out.status.success(), "host run failed: {text}");
        self.host.push(op.sample(&text).expect("host run"));

        drop_page_cache(note);
        let drop_guest = "sync; echo 3 > /proc/sys/vm/drop_caches || exit 1\n";
        let out = run_sh(sandbox, &format!("{drop_guest}{}", op.script(GUEST_SHARE)));
        let text = output_text(&out.stdout, &out.stderr);
        assert!(out.status.success(), "guest run failed: {text}");
        self.guest.push(op.sample(&text).expect("guest run"));
    }
}

/// stdout, then stderr under a marker (a walk's errors go to stderr).
fn output_text(stdout: &[u8], stderr: &[u8]) -> String {
    format!(
        "{}--- stderr\n{}",
        String::from_utf8_lossy(stdout),
        String::from_utf8_lossy(stderr)
    )
}

/// Creates the walked tree at `root`: `DIRS` directories of `FILES_PER_DIR` empty files.
fn file_tree(root: &Path) {
    for d in 0..DIRS {
        let dir = root.join(format!("d{d:03}"));
        fs::create_dir_all(&dir).expect("create a tree directory");
        for f in 0..FILES_PER_DIR {
            File::create(dir.join(format!("f{f:03}"))).expect("create a tree file");
        }
    }
}

/// The file system type of `dir` as `stat -f` names it, or `unknown`.
fn fs_type(dir: &Path) -> String {
    Command::new("stat")
        .args(["-f", "-c", "%T"])
        .arg(dir)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|| "unknown".into())
}

/// Drops the clean page cache of the machine running the benchmark (root only); keeps the first
/// failure in `note`.
fn drop_page_cache(note: &mut Option<String>) {
    if let Err(e) = fs::write("/proc/sys/vm/drop_caches", "3") {
        note.get_or_insert(e.to_string());
    }
}
