//! The pod's VMM in the pod's cgroup: the cgroup the OCI spec of the pod's first container names
//! (`linux.cgroupsPath`; under Kubernetes the pod sandbox's, inside the kubelet's pod cgroup), so
//! the node's accounting and the kubelet's pod limits cover the VM.
//!
//! The cgroup is made with the VM's limits ([`limits`]: guest RAM plus the VMM's allowance, a
//! task limit) and the VMM enters it between fork and exec
//! ([`bulkhead_sandbox::SandboxConfig::cgroup_procs`]), so every page of guest RAM is charged to
//! it. It is removed when the pod's VM is gone, and by `delete` after a shim was killed
//! ([`remove_stale`]).
//!
//! `cgroupsPath` comes in two forms (OCI runtime spec, "Linux Container Configuration",
//! cgroupsPath; runc's cgroup drivers): a path (`/default/ID` from `ctr`, `/kubepods/.../ID`
//! from the kubelet's cgroupfs driver), taken relative to the hierarchy's root, or the systemd
//! driver's `slice:prefix:name`, which is the directory `<slice path>/<prefix>-<name>.scope`
//! (a slice `a-b.slice` lives at `a.slice/a-b.slice`). The directory is made directly, not as a
//! systemd unit.

use std::path::{Path, PathBuf};

use bulkhead_sandbox::cgroup::{CgroupError, CgroupSpec, Version, VmCgroup, VmLimits};
use bulkhead_sandbox::spec::{min_pids, DEFAULT_PIDS_MAX, DEFAULT_VMM_MEMORY_OVERHEAD_MIB};
use oci_spec::runtime::Spec;

use crate::oci::VmSize;

/// Errors of the pod's cgroup.
#[derive(Debug, thiserror::Error)]
pub enum PodCgroupError {
    /// `linux.cgroupsPath` is neither a plain path nor `slice:prefix:name`.
    #[error("linux.cgroupsPath {0:?}: not a cgroup path nor slice:prefix:name")]
    BadPath(String),
    /// Creating or removing the cgroup failed.
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
}

/// The hierarchy-relative cgroup directory `linux.cgroupsPath` of `spec` names; `Ok(None)` when
/// the spec names none.
///
/// # Errors
/// [`PodCgroupError::BadPath`] for an empty component, `.` or `..`, or a systemd form that is
/// not three fields with a `.slice` first.
pub fn path_of(spec: &Spec) -> Result<Option<String>, PodCgroupError> {
    let path = spec.linux().as_ref().and_then(|l| l.cgroups_path().clone());
    let Some(path) = path else {
        return Ok(None);
    };
    let text = path.to_string_lossy().into_owned();
    let bad = || PodCgroupError::BadPath(text.clone());
    let relative = match text.split(':').collect::<Vec<_>>()[..] {
        [plain] => plain.trim_matches('/').to_owned(),
        [slice, prefix, name] => systemd_path(slice, prefix, name).ok_or_else(bad)?,
        _ => return Err(bad()),
    };
    let plain = relative
        .split('/')
        .all(|c| !c.is_empty() && c != "." && c != "..");
    match plain {
        true => Ok(Some(relative)),
        false => Err(bad()),
    }
}

/// `a-b.slice` → `a.slice/a-b.slice`; `-.slice` and an empty slice are the root (systemd's
/// escaping of slice names, as runc's systemd driver expands them).
fn systemd_path(slice: &str, prefix: &str, name: &str) -> Option<String> {
    if name.is_empty() || name.contains('/') || prefix.contains('/') || slice.contains('/') {
        return None;
    }
    let mut dirs = Vec::new();
    if !slice.is_empty() && slice != "-.slice" {
        let stem = slice.strip_suffix(".slice")?;
        let mut so_far = String::new();
        for part in stem.split('-') {
            if part.is_empty() {
                return None;
            }
            if !so_far.is_empty() {
                so_far.push('-');
            }
            so_far.push_str(part);
            dirs.push(format!("{so_far}.slice"));
        }
    }
    let unit = match prefix {
        "" => format!("{name}.scope"),
        p => format!("{p}-{name}.scope"),
    };
    dirs.push(unit);
    Some(dirs.join("/"))
}

/// The pod cgroup's limits for a VM of `size`: guest RAM plus the VMM's allowance
/// ([`DEFAULT_VMM_MEMORY_OVERHEAD_MIB`]), the default task limit (at least what the vCPUs need),
/// no CPU quota (the vCPU count bounds the guest; under Kubernetes the pod's cgroup has the
/// quota).
pub fn limits(size: VmSize) -> VmLimits {
    let mib = u64::from(size.memory_mib) + u64::from(DEFAULT_VMM_MEMORY_OVERHEAD_MIB);
    VmLimits {
        memory_bytes: mib << 20,
        cpu_quota: None,
        pids_max: DEFAULT_PIDS_MAX.max(min_pids(size.vcpus)),
    }
}

/// Creates the cgroup `path` with the limits of a VM of `size`. `Ok(None)`: this host has no
/// usable cgroup hierarchy (the VMM then stays in the shim's cgroup).
///
/// # Errors
/// [`PodCgroupError::Cgroup`].
pub fn create(path: &str, size: VmSize) -> Result<Option<VmCgroup>, PodCgroupError> {
    let Some(version) = Version::detect() else {
        tracing::warn!("no usable cgroup hierarchy: the pod's VMM stays in the shim's cgroup");
        return Ok(None);
    };
    let spec = CgroupSpec {
        version,
        path: path.to_owned(),
    };
    Ok(Some(VmCgroup::create(&spec, &limits(size))?))
}

/// What `delete` does after a shim was killed: removes the cgroup the container's `spec` names
/// if it exists (its VMM, if any, is killed first). Quiet about what is not there.
pub fn remove_stale(spec: &Spec) {
    let (Ok(Some(path)), Some(version)) = (path_of(spec), Version::detect()) else {
        return;
    };
    let cgroup = VmCgroup::load(&CgroupSpec { version, path });
    if let Err(e) = cgroup.remove() {
        tracing::warn!("{e}");
    }
}

/// The `oom_kill` count in the text of a v2 `memory.events` or a v1 `memory.oom_control` (both
/// have an `oom_kill N` line); 0 without one.
pub fn oom_kills(text: &str) -> u64 {
    text.lines()
        .find_map(|line| line.strip_prefix("oom_kill "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

/// Whether the host's OOM killer has killed in the pod's cgroup since the VM booted: what the
/// cgroup's `oom_kill` counter says now against what it said then. The cgroup holds only the
/// VMM, so a kill there is the VMM's (and with it the whole pod's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostOom {
    file: PathBuf,
    baseline: u64,
}

impl HostOom {
    /// Watches `cgroup` from now: its v2 `memory.events` or v1 `memory.oom_control`; `None` when
    /// it has neither.
    pub fn of(cgroup: &VmCgroup) -> Option<HostOom> {
        let files = ["memory.events", "memory.oom_control"];
        let file = cgroup
            .dirs()
            .into_iter()
            .flat_map(|dir| files.map(|f| dir.join(f)))
            .find(|f| f.is_file())?;
        Some(HostOom::at(file))
    }

    /// Watches the counter in `file` from now.
    pub fn at(file: PathBuf) -> HostOom {
        let baseline = read_oom_kills(&file);
        HostOom { file, baseline }
    }

    /// Whether the counter has grown since the watch began (false when it cannot be read).
    pub fn killed(&self) -> bool {
        read_oom_kills(&self.file) > self.baseline
    }
}

fn read_oom_kills(file: &Path) -> u64 {
    std::fs::read_to_string(file)
        .map(|text| oom_kills(&text))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kill_counted_after_the_watch_began_is_the_hosts_oom_kill() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let events = dir.path().join("memory.events");
        std::fs::write(&events, "low 0\nhigh 0\nmax 9\noom 2\noom_kill 1\n").unwrap();
        let watch = HostOom::at(events.clone());
        let before = watch.killed();

        // Act
        std::fs::write(&events, "low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\n").unwrap();

        // Assert
        assert!(!before);
        assert!(watch.killed());
    }

    #[test]
    fn the_oom_kill_line_is_read_from_v2_and_v1_files() {
        // Act
        let counts = [
            oom_kills("low 0\noom 1\noom_kill 4\noom_group_kill 0\n"),
            oom_kills("oom_kill_disable 0\nunder_oom 0\noom_kill 7\n"),
            oom_kills("garbage"),
        ];

        // Assert
        assert_eq!(counts, [4, 7, 0]);
    }

    fn spec_with(path: Option<&str>) -> Spec {
        let mut linux = oci_spec::runtime::Linux::default();
        linux.set_cgroups_path(path.map(Into::into));
        let mut spec = Spec::default();
        spec.set_linux(Some(linux));
        spec
    }

    #[test]
    fn a_cgroupfs_path_is_taken_relative_to_the_hierarchy_root() {
        // Act
        let ctr = path_of(&spec_with(Some("/default/demo"))).unwrap();
        let kubelet = path_of(&spec_with(Some("/kubepods/burstable/pod1/abc"))).unwrap();

        // Assert
        assert_eq!(ctr.as_deref(), Some("default/demo"));
        assert_eq!(kubelet.as_deref(), Some("kubepods/burstable/pod1/abc"));
    }

    #[test]
    fn the_systemd_form_expands_its_slice_into_nested_directories() {
        // Act
        let path = path_of(&spec_with(Some(
            "kubepods-burstable-pod1.slice:cri-containerd:abc",
        )))
        .unwrap();
        let root = path_of(&spec_with(Some(":cri:abc"))).unwrap();

        // Assert
        assert_eq!(
            path.as_deref(),
            Some(
                "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice/cri-containerd-abc.scope"
            )
        );
        assert_eq!(root.as_deref(), Some("cri-abc.scope"));
    }

    #[test]
    fn no_cgroups_path_is_no_cgroup() {
        // Act
        let none = path_of(&spec_with(None)).unwrap();
        let mut no_linux = Spec::default();
        no_linux.set_linux(None);
        let no_linux = path_of(&no_linux).unwrap();

        // Assert
        assert_eq!(none, None);
        assert_eq!(no_linux, None);
    }

    #[test]
    fn paths_that_climb_or_are_empty_are_refused() {
        for bad in [
            "/",
            "",
            "/a/../../etc",
            "/a//b",
            "a:b",
            "a:b:c:d",
            "x.notslice:p:n",
            "a--b.slice:p:n",
            "a.slice:p:",
            "a.slice:p:../n",
        ] {
            // Act
            let result = path_of(&spec_with(Some(bad)));

            // Assert
            assert!(
                matches!(result, Err(PodCgroupError::BadPath(_))),
                "{bad:?}: {result:?}"
            );
        }
    }

    #[test]
    fn the_limits_are_guest_ram_plus_the_vmm_allowance() {
        // Act
        let l = limits(VmSize {
            memory_mib: 256,
            vcpus: 2,
        });

        // Assert
        assert_eq!(
            l.memory_bytes,
            (256 + u64::from(DEFAULT_VMM_MEMORY_OVERHEAD_MIB)) << 20
        );
        assert_eq!(l.cpu_quota, None);
        assert!(l.pids_max >= min_pids(2));
    }
}
