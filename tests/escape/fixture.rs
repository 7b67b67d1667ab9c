//! The host side of the suite: the shared trees and disk files, the two sandboxes, and the
//! inventory that shows the host unchanged at the end.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use bulkhead_sandbox::{Mount, Sandbox, SandboxConfig, Storage, Workspace, WorkspaceMode};
use bulkhead_tests::hostcheck::{cgroup_dirs, processes_named, tree_snapshot, EntryState};
use bulkhead_tests::{artifacts, sandbox_config, sha256_hex};
use bulkhead_vmm::config::DiskConfig;

/// uid:gid owning the read-write share on the host (root may not share a root-owned directory
/// read-write).
pub const OWNER: (u32, u32) = (1000, 1000);
/// Guest mount point of the read-write share.
pub const RW: &str = "/mnt/rw";
/// Guest mount point of the read-only share.
pub const RO: &str = "/mnt/ro";
/// Guest RAM of each sandbox, MiB.
pub const MEMORY_MIB: u32 = 256;
/// Size of A's scratch disk, MiB.
pub const SCRATCH_MIB: u64 = 64;
/// Size of each data disk file, bytes.
pub const DISK_BYTES: usize = 4 << 20;
/// A's read-only data disk in the guest (after the image `vda` and the scratch disk `vdb`).
pub const RO_DISK: &str = "/dev/vdc";
/// A's read-write data disk in the guest.
pub const RW_DISK: &str = "/dev/vdd";

/// What the last case expects.
pub const EXPECT_HOST: &str =
    "shared trees, disk files and cgroups as before; no VMM ended uncleanly; no VMM or runtime dir left";

/// The host files the sandboxes get, in a fresh local directory:
/// `rw/` (shared read-write, with symbolic links planted to `outside/`), `ro/` (shared
/// read-only), `outside/secret` (shared by nobody, holding [`Fixture::canary`]), `project/`
/// (A's clone workspace) and `disks/{ro,rw}.img`.
pub struct Fixture {
    base: tempfile::TempDir,
    canary: String,
    /// Snapshots of everything that must not change, taken before any guest ran.
    pub before: BTreeMap<&'static str, BTreeMap<PathBuf, EntryState>>,
}

/// Trees and files compared at the end (all but the read-write share and disk).
const KEPT: [&str; 4] = ["ro", "outside", "project", "disks/ro.img"];

impl Fixture {
    /// Creates the tree.
    ///
    /// # Panics
    /// When the files cannot be created.
    pub fn new() -> Fixture {
        let base = tempfile::Builder::new()
            .prefix("bulkhead-escape-")
            .tempdir()
            .expect("temp dir");
        let canary = format!(
            "bulkhead-escape-canary-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
        );
        let mut fx = Fixture {
            base,
            canary,
            before: BTreeMap::new(),
        };
        fx.populate();
        for rel in KEPT {
            fx.before.insert(rel, tree_snapshot(&fx.path(rel)));
        }
        fx
    }

    fn populate(&self) {
        for dir in ["rw", "ro/sub", "outside", "project/.git", "disks"] {
            std::fs::create_dir_all(self.path(dir)).expect("create dir");
        }
        std::os::unix::fs::chown(self.path("rw"), Some(OWNER.0), Some(OWNER.1)).expect("chown");
        let secret = format!("{}\n", self.canary);
        let files: [(&str, &[u8]); 8] = [
            ("ro/a.txt", b"read-only a\n"),
            ("ro/sub/b.txt", b"read-only b\n"),
            ("outside/secret", secret.as_bytes()),
            ("project/README.md", b"# demo\n"),
            ("project/Makefile", b"all:\n\techo ok\n"),
            (
                "project/package.json",
                b"{\"scripts\": {\"test\": \"true\"}}\n",
            ),
            ("project/.git/HEAD", b"ref: refs/heads/main\n"),
            ("project/.git/config", b"[core]\n\tbare = false\n"),
        ];
        for (rel, data) in files {
            std::fs::write(self.path(rel), data).expect("write file");
        }
        let pattern: Vec<u8> = (0..DISK_BYTES).map(|i| (i % 251) as u8).collect();
        std::fs::write(self.path("disks/ro.img"), &pattern).expect("write disk");
        std::fs::write(self.path("disks/rw.img"), &pattern).expect("write disk");
        let outside = self.path("outside");
        let links = [
            ("rw/to_secret", outside.join("secret")),
            ("rw/to_outside", outside),
            ("rw/rel_escape", PathBuf::from("../outside/secret")),
            ("rw/to_root", PathBuf::from("/")),
        ];
        for (link, target) in links {
            std::os::unix::fs::symlink(target, self.path(link)).expect("plant link");
        }
    }

    /// `rel` under the fixture's directory.
    pub fn path(&self, rel: &str) -> PathBuf {
        self.base.path().join(rel)
    }

    /// The unique string in `outside/secret`: seeing it in a guest means a host file leaked.
    pub fn canary(&self) -> &str {
        &self.canary
    }

    /// Sandbox A: shares, disks, clone workspace, scratch disk.
    fn config_a(&self) -> (SandboxConfig, Storage) {
        let mount = |rel: &str, guest: &str, read_only| Mount {
            host: self.path(rel),
            guest: PathBuf::from(guest),
            read_only,
        };
        let config = SandboxConfig {
            memory_mib: MEMORY_MIB,
            mounts: vec![mount("rw", RW, false), mount("ro", RO, true)],
            workspace: Some(Workspace {
                host: self.path("project"),
                mode: WorkspaceMode::Clone,
            }),
            ..sandbox_config()
        };
        let disk = |rel: &str, read_only| DiskConfig {
            path: self.path(rel),
            read_only,
            id: None,
            backing: None,
        };
        let storage = Storage {
            root_image: Some(artifacts().debian_image()),
            scratch_mib: Some(SCRATCH_MIB),
            data_disks: vec![disk("disks/ro.img", true), disk("disks/rw.img", false)],
        };
        (config, storage)
    }

    /// The last case: everything in [`KEPT`] as before, no VMM of ours left (the scan for them
    /// found the running ones in `during`, so it can see them), no runtime directory left, the
    /// cgroup tree as before.
    pub fn host_unchanged(
        &self,
        before: &HostInventory,
        during: &HostInventory,
        destroyed: &Destroyed,
    ) -> (bool, String) {
        let changed: Vec<&str> = KEPT
            .iter()
            .copied()
            .filter(|rel| self.before.get(rel) != Some(&tree_snapshot(&self.path(rel))))
            .collect();
        let after = HostInventory::take();
        let seen_running = during.vmms.difference(&before.vmms).count();
        let left: Vec<u32> = after.vmms.difference(&before.vmms).copied().collect();
        let left_dirs = destroyed.runtime_dirs.iter().filter(|d| d.exists()).count();
        let cgroups = match (before.cgroups == after.cgroups, before.cgroups.is_empty()) {
            (true, true) => "no cgroup file system mounted".to_owned(),
            (true, false) => format!("{} cgroup dirs, same after", before.cgroups.len()),
            (false, _) => format!(
                "cgroup dirs CHANGED: {} before, {} after",
                before.cgroups.len(),
                after.cgroups.len()
            ),
        };
        let early: Vec<&str> = destroyed
            .ended_early
            .iter()
            .map(|(s, _)| s.as_str())
            .collect();
        let observed = format!(
            "trees changed: {changed:?}; destroy: {}{}; bulkhead-vmm processes: {} before, {seen_running} more \
             while running, {} left after ({left:?}); runtime dirs left: {left_dirs}; {cgroups}",
            destroyed.errors.as_deref().unwrap_or("clean"),
            if early.is_empty() { String::new() } else { format!(" ({})", early.join("; ")) },
            before.vmms.len(),
            left.len(),
        );
        let passed = changed.is_empty()
            && destroyed.errors.is_none()
            && destroyed.ended_early.iter().all(|(_, clean)| *clean)
            && seen_running >= 2
            && left.is_empty()
            && left_dirs == 0
            && before.cgroups == after.cgroups;
        (passed, observed)
    }

    /// sha256 of a fixture file.
    pub fn hash(&self, rel: &str) -> String {
        sha256_hex(&std::fs::read(self.path(rel)).expect("read fixture file"))
    }

    /// Size in bytes and mtime (ns) of a fixture file.
    pub fn size_and_mtime(&self, rel: &str) -> (u64, i128) {
        let meta = std::fs::metadata(self.path(rel)).expect("stat fixture file");
        (
            meta.size(),
            i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
        )
    }
}

/// The host's state that must come back unchanged.
pub struct HostInventory {
    /// Pids of running `bulkhead-vmm` processes.
    pub vmms: BTreeSet<u32>,
    /// Directories under `/sys/fs/cgroup` (three levels).
    pub cgroups: BTreeSet<PathBuf>,
}

impl HostInventory {
    /// Takes the inventory now.
    pub fn take() -> HostInventory {
        HostInventory {
            vmms: processes_named("bulkhead-vmm").into_iter().collect(),
            cgroups: cgroup_dirs(3),
        }
    }
}

/// The two sandboxes of the suite.
pub struct Sandboxes {
    /// The attacker, with every share and disk.
    pub a: Sandbox,
    /// The neighbour (vsock target), later exhausted.
    pub b: Sandbox,
}

/// What destroying the sandboxes left to check.
pub struct Destroyed {
    /// Their runtime directories (must be gone).
    pub runtime_dirs: Vec<PathBuf>,
    /// Errors destroying them, if any.
    pub errors: Option<String>,
    /// VMMs that had ended before they were destroyed, and whether cleanly (exit 0: the guest
    /// rebooted or powered off, e.g. its kernel gave up under a fork bomb).
    pub ended_early: Vec<(String, bool)>,
}

impl Sandboxes {
    /// Boots A and B at the same time.
    ///
    /// # Panics
    /// When either fails to start (the suite cannot run without them).
    pub fn start(fx: &Fixture) -> Sandboxes {
        let (config_a, storage_a) = fx.config_a();
        let config_b = SandboxConfig {
            memory_mib: MEMORY_MIB,
            ..sandbox_config()
        };
        let storage_b = Storage {
            root_image: Some(artifacts().debian_image()),
            ..Storage::default()
        };
        let (a, b) = std::thread::scope(|s| {
            let a = s.spawn(|| Sandbox::start_with(&config_a, &storage_a));
            let b = s.spawn(|| Sandbox::start_with(&config_b, &storage_b));
            (a.join().expect("start A"), b.join().expect("start B"))
        });
        Sandboxes {
            a: a.unwrap_or_else(|e| panic!("sandbox A did not start: {e}")),
            b: b.unwrap_or_else(|e| panic!("sandbox B did not start: {e}")),
        }
    }

    /// Destroys both (the VMM gets SIGTERM, then SIGKILL; runtime dirs are removed). A VMM
    /// that had already ended is reported with its status and the tail of its log.
    pub fn destroy(self) -> Destroyed {
        let mut out = Destroyed {
            runtime_dirs: Vec::new(),
            errors: None,
            ended_early: Vec::new(),
        };
        let mut errors = Vec::new();
        for (name, mut sandbox) in [("A", self.a), ("B", self.b)] {
            out.runtime_dirs
                .extend(sandbox.runtime_path().map(Path::to_owned));
            if let Ok(Some(exit)) = sandbox.try_wait_exit() {
                let log = sandbox.log_tail(6).replace('\n', " / ");
                let clean = exit.is_clean();
                out.ended_early.push((
                    format!("{name}'s VMM had ended ({exit}; log: {log})"),
                    clean,
                ));
            }
            if let Err(e) = sandbox.destroy() {
                errors.push(format!("{name}: {e}"));
            }
        }
        out.errors = (!errors.is_empty()).then(|| errors.join("; "));
        out
    }
}
