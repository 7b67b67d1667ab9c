//! Per-VM cgroups, through the `cgroups-rs` crate: one cgroup per VMM process with a memory
//! limit (guest RAM + the VMM allowance), a CPU quota and a task limit.
//!
//! - **cgroup v2** (unified hierarchy at `/sys/fs/cgroup`; systemd hosts with `Delegate=yes`):
//!   controllers `memory`, `cpu`, `pids` (`memory.max`, `cpu.max`, `pids.max`). Because of v2's
//!   "no internal processes" rule, a daemon that is not in the root cgroup first moves itself into
//!   the leaf `<own cgroup>/daemon` and creates the VMs' cgroups beside it.
//! - **cgroup v1** (one hierarchy per controller, e.g. `/sys/fs/cgroup/memory`): controllers
//!   `memory`, `cpu`, `cpuacct` (accounting only) and `pids` (`memory.limit_in_bytes`,
//!   `cpu.cfs_quota_us`/`cpu.cfs_period_us`, `pids.max`).
//!
//! The VMM enters its cgroup between fork and exec ([`VmCgroup::procs_files`], used by
//! [`crate::SandboxConfig::cgroup_procs`]), so its guest memory is charged from the first page.
//! Moving it after spawning would leave a window in which it allocates outside its limit.
//!
//! The daemon keeps one [`CgroupManager`] for all its VMs; `bulkhead run` as root makes one
//! under `bulkhead-run` when the run asks for limits. The limits themselves come from the
//! sandbox's spec ([`crate::spec::limits_of`]).

use std::fmt;
use std::fs;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::{Duration, Instant};

use cgroups_rs::fs::cgroup::Cgroup;
use cgroups_rs::fs::cpu::CpuController;
use cgroups_rs::fs::cpuacct::CpuAcctController;
use cgroups_rs::fs::hierarchies::{self, V1, V2};
use cgroups_rs::fs::memory::MemController;
use cgroups_rs::fs::pid::PidController;
use cgroups_rs::fs::{Hierarchy, MaxValue};
use cgroups_rs::CgroupPid;
use serde::{Deserialize, Serialize};

/// CFS period used for CPU quotas, µs (100 ms, the kernel's default).
pub const CPU_PERIOD_US: u64 = 100_000;

/// How long [`VmCgroup::remove`] waits for killed processes to leave the cgroup.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Errors of cgroup management.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// No usable cgroup hierarchy.
    #[error("cgroups: {0}")]
    Unavailable(String),
    /// Creating, configuring or removing a cgroup failed.
    #[error("cgroup {path}: {message}")]
    Op {
        /// The cgroup (hierarchy-relative path).
        path: String,
        /// What failed.
        message: String,
    },
}

/// Which cgroup support the daemon uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CgroupMode {
    /// v2 when `/sys/fs/cgroup` is cgroup2, else v1 when its memory controller is mounted, else
    /// off (with a warning). Failing to set up cgroups also turns them off with a warning.
    Auto,
    /// cgroup v1; failure to set up is fatal.
    V1,
    /// cgroup v2; failure to set up is fatal.
    V2,
    /// No cgroups: only the guest's RAM and vCPU count bound a VM.
    Off,
}

impl FromStr for CgroupMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(CgroupMode::Auto),
            "v1" => Ok(CgroupMode::V1),
            "v2" => Ok(CgroupMode::V2),
            "off" => Ok(CgroupMode::Off),
            _ => Err(format!("`{s}`: expected auto, v1, v2 or off")),
        }
    }
}

/// A cgroup hierarchy version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Version {
    /// One hierarchy per controller.
    V1,
    /// The unified hierarchy.
    V2,
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Version::V1 => "v1",
            Version::V2 => "v2",
        })
    }
}

/// Where a VM's cgroup is; kept in the sandbox's record so a restarted daemon can find it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CgroupSpec {
    /// Hierarchy version.
    pub version: Version,
    /// Path relative to the hierarchy root (each controller's root in v1).
    pub path: String,
}

/// A VM's host limits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VmLimits {
    /// `memory.max` / `memory.limit_in_bytes`, bytes.
    pub memory_bytes: u64,
    /// CPU time as a fraction of one CPU; None: no quota.
    pub cpu_quota: Option<f64>,
    /// `pids.max`.
    pub pids_max: u32,
}

/// Creates the VMs' cgroups under one parent.
#[derive(Debug, Clone)]
pub struct CgroupManager {
    version: Version,
    parent: String,
}

/// The controllers a VM cgroup uses.
fn controllers(version: Version) -> Vec<String> {
    let names: &[&str] = match version {
        Version::V1 => &["memory", "cpu", "cpuacct", "pids"],
        Version::V2 => &["memory", "cpu", "pids"],
    };
    names.iter().map(|s| (*s).to_owned()).collect()
}

/// The `usage_usec` line of a v2 `cpu.stat` (cgroup-v2.rst, "cpu.stat"); 0 without one.
fn usage_usec(stat: &str) -> u64 {
    stat.lines()
        .find_map(|line| line.strip_prefix("usage_usec "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

fn hierarchy(version: Version) -> Box<dyn Hierarchy> {
    match version {
        Version::V1 => Box::new(V1::new()),
        Version::V2 => Box::new(V2::new()),
    }
}

impl CgroupManager {
    /// Sets up cgroup support per `mode`; `parent` overrides the default parent (see
    /// the daemon's `cgroup_parent` setting). Returns None when cgroups are off.
    ///
    /// # Errors
    /// [`CgroupError`] for an explicit `v1`/`v2` mode that cannot be set up.
    pub fn init(
        mode: CgroupMode,
        parent: Option<&str>,
    ) -> Result<Option<CgroupManager>, CgroupError> {
        let version = match mode {
            CgroupMode::Off => return Ok(None),
            CgroupMode::V1 => Version::V1,
            CgroupMode::V2 => Version::V2,
            CgroupMode::Auto => match detect() {
                Some(v) => v,
                None => {
                    tracing::warn!(
                        "no usable cgroup hierarchy: VMs run without host cgroup limits"
                    );
                    return Ok(None);
                }
            },
        };
        match Self::setup(version, parent) {
            Ok(manager) => Ok(Some(manager)),
            Err(e) if mode == CgroupMode::Auto => {
                tracing::warn!("{e}; VMs run without host cgroup limits");
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    fn setup(version: Version, parent: Option<&str>) -> Result<CgroupManager, CgroupError> {
        let parent = match (parent, version) {
            (Some(p), _) => p.trim_matches('/').to_owned(),
            (None, Version::V1) => "bulkhead".to_owned(),
            (None, Version::V2) => v2_default_parent()?,
        };
        let manager = CgroupManager { version, parent };
        let probe = Cgroup::new_with_specified_controllers(
            hierarchy(version),
            &manager.parent,
            Some(controllers(version)),
        )
        .map_err(|e| op_error(&manager.parent, "create", e))?;
        if !probe.exists() {
            return Err(CgroupError::Unavailable(format!(
                "cannot create the parent cgroup {} ({version})",
                manager.parent
            )));
        }
        tracing::info!("cgroup {version}: VM cgroups under {}", manager.parent);
        Ok(manager)
    }

    /// The hierarchy version in use.
    pub fn version(&self) -> Version {
        self.version
    }

    /// The parent cgroup path (hierarchy-relative).
    pub fn parent(&self) -> &str {
        &self.parent
    }

    /// Where the cgroup of sandbox `id` goes (nothing is created).
    pub fn spec_for(&self, id: &str) -> CgroupSpec {
        CgroupSpec {
            version: self.version,
            path: format!("{}/vm-{id}", self.parent),
        }
    }

    /// Creates the cgroup `spec` with `limits`.
    ///
    /// # Errors
    /// [`CgroupError::Op`]; a half-made cgroup is removed.
    pub fn create(&self, spec: &CgroupSpec, limits: &VmLimits) -> Result<VmCgroup, CgroupError> {
        VmCgroup::create(spec, limits)
    }

    /// Names (`vm-<id>` → `<id>`) of the VM cgroups under the parent, to find strays.
    pub fn list_ids(&self) -> Vec<String> {
        let parent = VmCgroup::load(&CgroupSpec {
            version: self.version,
            path: self.parent.clone(),
        });
        let Some(dir) = parent.dirs().into_iter().next() else {
            return Vec::new();
        };
        let Ok(entries) = fs::read_dir(dir) else {
            return Vec::new();
        };
        entries
            .flatten()
            .filter(|e| e.path().is_dir())
            .filter_map(|e| {
                e.file_name()
                    .to_str()?
                    .strip_prefix("vm-")
                    .map(str::to_owned)
            })
            .collect()
    }
}

/// What a VM's cgroup has used, as the kernel counts it (`VmCgroup::usage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CgroupUsage {
    /// Memory charged now, bytes (`memory.current`; v1 `memory.usage_in_bytes`): the guest RAM
    /// the guest has touched, the VMM's own memory and page cache charged to it.
    pub memory_bytes: u64,
    /// CPU time used, ns (`cpu.stat` `usage_usec` × 1000; v1 `cpuacct.usage`).
    pub cpu_ns: u64,
    /// Tasks (threads) in it now (`pids.current`).
    pub pids: u64,
}

/// The cgroup of one VM.
#[derive(Debug)]
pub struct VmCgroup {
    cg: Cgroup,
    spec: CgroupSpec,
}

impl VmCgroup {
    /// Creates the cgroup `spec` (with the memory, CPU and pids controllers; v2 enables them in
    /// its ancestors' `cgroup.subtree_control`) and applies `limits`. Used by
    /// [`CgroupManager::create`] and by callers that are given a cgroup path (the containerd
    /// shim: the OCI spec's `linux.cgroupsPath`).
    ///
    /// # Errors
    /// [`CgroupError::Op`]; a half-made cgroup is removed.
    pub fn create(spec: &CgroupSpec, limits: &VmLimits) -> Result<VmCgroup, CgroupError> {
        let cg = Cgroup::new_with_specified_controllers(
            hierarchy(spec.version),
            &spec.path,
            Some(controllers(spec.version)),
        )
        .map_err(|e| op_error(&spec.path, "create", e))?;
        let vm = VmCgroup {
            cg,
            spec: spec.clone(),
        };
        if let Err(e) = vm.apply(limits) {
            let _ = vm.remove();
            return Err(e);
        }
        Ok(vm)
    }

    /// A handle on an existing (or already removed) cgroup.
    pub fn load(spec: &CgroupSpec) -> VmCgroup {
        VmCgroup {
            cg: Cgroup::load_with_specified_controllers(
                hierarchy(spec.version),
                &spec.path,
                controllers(spec.version),
            ),
            spec: spec.clone(),
        }
    }

    /// Where it is.
    pub fn spec(&self) -> &CgroupSpec {
        &self.spec
    }

    /// Its directory in each hierarchy (one in v2), without duplicates.
    pub fn dirs(&self) -> Vec<PathBuf> {
        let mut dirs: Vec<PathBuf> = self
            .cg
            .subsystems()
            .iter()
            .map(|s| s.to_controller().path().to_owned())
            .collect();
        dirs.sort();
        dirs.dedup();
        dirs
    }

    /// The `cgroup.procs` files a process writes itself into to join (one per hierarchy).
    pub fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs()
            .into_iter()
            .map(|d| d.join("cgroup.procs"))
            .collect()
    }

    /// Processes in the cgroup.
    pub fn pids(&self) -> Vec<u32> {
        self.cg.procs().into_iter().map(|p| p.pid as u32).collect()
    }

    /// What the cgroup has used (zeros for a counter the kernel does not offer or that cannot
    /// be read, e.g. a cgroup that is gone).
    pub fn usage(&self) -> CgroupUsage {
        let memory_bytes = self
            .cg
            .controller_of::<MemController>()
            .map_or(0, |m| m.memory_stat().usage_in_bytes);
        let cpu_ns = match self.spec.version {
            Version::V2 => self
                .cg
                .controller_of::<CpuController>()
                .map_or(0, |c| usage_usec(&c.cpu().stat).saturating_mul(1000)),
            Version::V1 => self
                .cg
                .controller_of::<CpuAcctController>()
                .map_or(0, |c| c.cpuacct().usage),
        };
        let pids = self
            .cg
            .controller_of::<PidController>()
            .and_then(|p| p.get_pid_current().ok())
            .unwrap_or(0);
        CgroupUsage {
            memory_bytes,
            cpu_ns,
            pids,
        }
    }

    /// Sets the limits of an existing cgroup (a warm-pool VM handed out with a request's
    /// limits). A `cpu_quota` of None leaves the CPU quota as it is.
    ///
    /// # Errors
    /// [`CgroupError::Op`], or a controller missing from the cgroup.
    pub fn set_limits(&self, limits: &VmLimits) -> Result<(), CgroupError> {
        self.apply(limits)
    }

    fn apply(&self, limits: &VmLimits) -> Result<(), CgroupError> {
        let path = &self.spec.path;
        let memory = self
            .cg
            .controller_of::<MemController>()
            .ok_or_else(|| missing(path, "memory"))?;
        let bytes = i64::try_from(limits.memory_bytes).unwrap_or(i64::MAX);
        memory
            .set_limit(bytes)
            .map_err(|e| op_error(path, "set the memory limit", e))?;
        let pids = self
            .cg
            .controller_of::<PidController>()
            .ok_or_else(|| missing(path, "pids"))?;
        pids.set_pid_max(MaxValue::Value(i64::from(limits.pids_max)))
            .map_err(|e| op_error(path, "set pids.max", e))?;
        if let Some(fraction) = limits.cpu_quota {
            let cpu = self
                .cg
                .controller_of::<CpuController>()
                .ok_or_else(|| missing(path, "cpu"))?;
            let quota = (fraction * CPU_PERIOD_US as f64).round() as i64;
            cpu.set_cfs_quota_and_period(Some(quota), Some(CPU_PERIOD_US))
                .map_err(|e| op_error(path, "set the CPU quota", e))?;
        }
        Ok(())
    }

    /// SIGKILLs every process in the cgroup, waits until it is empty and removes it. Succeeds
    /// when it does not exist.
    ///
    /// # Errors
    /// [`CgroupError::Op`] when processes remain after 10 s or removal fails.
    pub fn remove(&self) -> Result<(), CgroupError> {
        if !self.cg.exists() {
            return Ok(());
        }
        let deadline = Instant::now() + DRAIN_TIMEOUT;
        loop {
            let pids = self.pids();
            if pids.is_empty() {
                break;
            }
            if Instant::now() > deadline {
                return Err(CgroupError::Op {
                    path: self.spec.path.clone(),
                    message: format!("processes {pids:?} survived SIGKILL"),
                });
            }
            for pid in pids {
                tracing::warn!("killing process {pid} left in cgroup {}", self.spec.path);
                // SAFETY: kill(2) with a pid read from the cgroup and a valid signal.
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.cg
            .delete()
            .map_err(|e| op_error(&self.spec.path, "remove", e))
    }
}

/// The unified hierarchy when `/sys/fs/cgroup` is cgroup2; v1 when a memory controller
/// hierarchy is mounted; None otherwise.
impl Version {
    /// The hierarchy this host mounts at `/sys/fs/cgroup`: v2 when it is the unified hierarchy,
    /// v1 when a memory controller hierarchy is mounted, else None.
    pub fn detect() -> Option<Version> {
        detect()
    }
}

fn detect() -> Option<Version> {
    if hierarchies::is_cgroup2_unified_mode() {
        return Some(Version::V2);
    }
    V1::new()
        .get_mount_point(cgroups_rs::fs::Controllers::Mem)
        .map(|_| Version::V1)
}

/// The daemon's own v2 cgroup (from `/proc/self/cgroup`, line `0::<path>`), relative.
fn own_v2_cgroup() -> Result<String, CgroupError> {
    let text = fs::read_to_string("/proc/self/cgroup")
        .map_err(|e| CgroupError::Unavailable(format!("/proc/self/cgroup: {e}")))?;
    text.lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(|p| p.trim_matches('/').to_owned())
        .ok_or_else(|| CgroupError::Unavailable("no cgroup v2 entry in /proc/self/cgroup".into()))
}

/// v2 default parent: `bulkhead` in the root cgroup; else the daemon's own cgroup, after moving
/// the daemon into its leaf `daemon` (already there when systemd's `DelegateSubgroup=daemon`
/// put it there).
fn v2_default_parent() -> Result<String, CgroupError> {
    let own = own_v2_cgroup()?;
    if own.is_empty() {
        return Ok("bulkhead".to_owned());
    }
    if let Some(parent) = own.strip_suffix("/daemon") {
        return Ok(parent.to_owned());
    }
    let leaf = format!("{own}/daemon");
    let cg =
        Cgroup::new(hierarchy(Version::V2), &leaf).map_err(|e| op_error(&leaf, "create", e))?;
    cg.add_task_by_tgid(CgroupPid::from(u64::from(std::process::id())))
        .map_err(|e| op_error(&leaf, "move the daemon into", e))?;
    tracing::info!("moved the daemon into cgroup {leaf}");
    Ok(own)
}

fn op_error(path: &str, what: &str, e: cgroups_rs::fs::error::Error) -> CgroupError {
    let cause = std::error::Error::source(&e)
        .map(|c| format!(": {c}"))
        .unwrap_or_default();
    CgroupError::Op {
        path: path.to_owned(),
        message: format!("cannot {what}: {e}{cause}"),
    }
}

fn missing(path: &str, controller: &str) -> CgroupError {
    CgroupError::Op {
        path: path.to_owned(),
        message: format!("the {controller} controller is not available"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_time_is_the_usage_usec_line_of_cpu_stat() {
        // Arrange
        let stat = "usage_usec 1234\nuser_usec 1000\nsystem_usec 234\nnr_periods 7\n";

        // Act / Assert
        assert_eq!(usage_usec(stat), 1234);
        assert_eq!(usage_usec("nr_periods 0\nnr_throttled 0\n"), 0);
        assert_eq!(usage_usec("usage_usec x\n"), 0);
    }
}
