//! `Update`: new resources for a running container, applied to its pod VM's host cgroup
//! ([`crate::pod_cgroup`]), the one boundary the host has around the pod.
//!
//! containerd sends the OCI `LinuxResources` as JSON (runtime-spec `config-linux.md`,
//! "Control groups"); under Kubernetes the CRI plugin sends the container's whole resources
//! again, not only what changed. What is applied, to the cgroup v2 files of the pod VM's cgroup:
//!
//! - `cpu.quota` / `cpu.period` → `cpu.max` (`"QUOTA PERIOD"`, `max` for a quota of -1 or none;
//!   a missing period is 100000 µs), as runc writes them;
//! - `cpu.shares` → `cpu.weight` by runc's conversion ([`weight_of_shares`]);
//! - `memory.limit` → `memory.max`, as the cgroup was made: the limit in MiB rounded up plus the
//!   VMM's allowance ([`crate::pod_cgroup::limits`]); -1 is `max`. A limit below the guest's RAM
//!   is refused ([`UpdateError::BelowGuestRam`]): the guest's RAM was fixed at boot and cannot
//!   shrink (there is no balloon), and a host limit below it would only get the VMM OOM-killed;
//! - `pids.limit` → `pids.max`, at least what the VMM's vCPU and I/O threads need
//!   ([`bulkhead_sandbox::spec::min_pids`]), as at create; -1 (or 0) is `max`.
//!
//! The guest's vCPU count and RAM do not change: a quota above the vCPUs' worth buys nothing, a
//! limit above the guest's RAM only gives the VMM more room. Every other field (`memory.swap`,
//! `reservation`, `cpu.cpus`, `hugepageLimits`, `devices`, `blockIO`, `unified`, ...) is
//! ignored and named in the shim's log: those describe the container as runc would confine it
//! on the host, the pod VM's cgroup has none of those controllers, and refusing them would fail
//! every update the CRI plugin sends (it resends its device rules and hugepage limits each
//! time). The update is checked whole before any file is written.

use std::path::Path;

use bulkhead_sandbox::spec::{min_pids, DEFAULT_VMM_MEMORY_OVERHEAD_MIB};
use serde::Deserialize;
use serde_json::Value;

use crate::backend::{BackendError, Resources};

/// The `Any` type URL of the OCI `LinuxResources` (containerd's typeurl registration).
pub const LINUX_RESOURCES: &str =
    "types.containerd.io/opencontainers/runtime-spec/1/LinuxResources";

/// The CFS period when an update gives a quota without one, µs (runc's default).
pub const DEFAULT_CPU_PERIOD_US: u64 = 100_000;

/// The kernel's bounds on `cpu.max`'s period, µs; a quota is at least the lower one.
pub const CPU_PERIOD_RANGE_US: std::ops::RangeInclusive<u64> = 1_000..=1_000_000;

/// What an update can fail with.
#[derive(Debug, thiserror::Error)]
pub enum UpdateError {
    /// The resources are not `LinuxResources` JSON.
    #[error("update: not OCI LinuxResources: {0}")]
    Parse(String),
    /// A memory limit below the guest's RAM.
    #[error(
        "update: memory limit {limit} bytes is below the pod VM's RAM ({guest_mib} MiB), which \
         cannot shrink after the boot"
    )]
    BelowGuestRam {
        /// The limit asked for, bytes.
        limit: i64,
        /// The guest's RAM, MiB.
        guest_mib: u32,
    },
    /// A CPU quota or period the kernel does not accept.
    #[error("update: cpu quota {quota} / period {period} µs: the period must be 1000..=1000000 µs and a quota at least 1000 µs")]
    BadCpu {
        /// The quota, µs.
        quota: i64,
        /// The period, µs.
        period: u64,
    },
    /// Writing a cgroup file failed.
    #[error("update: {file}: {source}")]
    Write {
        /// The file.
        file: String,
        /// Why.
        source: std::io::Error,
    },
}

/// The pod VM an update applies to.
#[derive(Debug, Clone, Copy)]
pub struct PodVm<'a> {
    /// Its host cgroup's directory (cgroup v2).
    pub cgroup_dir: &'a Path,
    /// The guest's RAM, MiB.
    pub memory_mib: u32,
    /// The guest's vCPUs.
    pub vcpus: u8,
}

/// The part of `LinuxResources` the shim applies; the rest is ignored (module documentation).
#[derive(Debug, Default, Deserialize)]
struct Wanted {
    #[serde(default)]
    memory: Option<WantedMemory>,
    #[serde(default)]
    cpu: Option<WantedCpu>,
    #[serde(default)]
    pids: Option<WantedPids>,
}

#[derive(Debug, Default, Deserialize)]
struct WantedMemory {
    #[serde(default)]
    limit: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
struct WantedCpu {
    #[serde(default)]
    shares: Option<u64>,
    #[serde(default)]
    quota: Option<i64>,
    #[serde(default)]
    period: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
struct WantedPids {
    #[serde(default)]
    limit: Option<i64>,
}

/// The cgroup files an update writes, in order, with their contents.
pub type Writes = Vec<(&'static str, String)>;

/// runc's conversion of cgroup v1 `cpu.shares` (2..=262144) to v2 `cpu.weight` (1..=10000):
/// `1 + (shares - 2) * 9999 / 262142`, shares clamped to their range first.
pub fn weight_of_shares(shares: u64) -> u64 {
    let shares = shares.clamp(2, 262_144);
    1 + (shares - 2) * 9_999 / 262_142
}

/// What `resources` asks of the pod VM `vm`: the files to write, checked whole.
///
/// # Errors
/// [`UpdateError::Parse`], [`UpdateError::BelowGuestRam`], [`UpdateError::BadCpu`].
pub fn plan(vm: &PodVm<'_>, resources: &Resources) -> Result<Writes, UpdateError> {
    let known = resources.type_url.is_empty() || resources.type_url.ends_with("/LinuxResources");
    if !known {
        return Err(UpdateError::Parse(format!(
            "resources of type {:?}",
            resources.type_url
        )));
    }
    let value: Value =
        serde_json::from_slice(&resources.value).map_err(|e| UpdateError::Parse(e.to_string()))?;
    let ignored = ignored_fields(&value);
    if !ignored.is_empty() {
        tracing::info!("update: not applied to the pod VM: {}", ignored.join(", "));
    }
    let wanted: Wanted =
        serde_json::from_value(value).map_err(|e| UpdateError::Parse(e.to_string()))?;
    let mut writes = Writes::new();
    if let Some(memory) = wanted.memory.as_ref().and_then(|m| m.limit) {
        writes.extend(memory_max(vm, memory)?.map(|v| ("memory.max", v)));
    }
    if let Some(cpu) = &wanted.cpu {
        writes.extend(cpu_max(cpu)?.map(|v| ("cpu.max", v)));
        writes.extend(
            cpu.shares
                .map(|s| ("cpu.weight", weight_of_shares(s).to_string())),
        );
    }
    if let Some(limit) = wanted.pids.as_ref().and_then(|p| p.limit) {
        writes.push(("pids.max", pids_max(vm, limit)));
    }
    Ok(writes)
}

/// Applies `resources` to the pod VM `vm` ([`plan`], then each file written).
///
/// # Errors
/// Those of [`plan`], before anything is written; [`UpdateError::Write`].
pub fn apply(vm: &PodVm<'_>, resources: &Resources) -> Result<(), UpdateError> {
    for (file, value) in plan(vm, resources)? {
        std::fs::write(vm.cgroup_dir.join(file), &value).map_err(|source| UpdateError::Write {
            file: vm.cgroup_dir.join(file).display().to_string(),
            source,
        })?;
    }
    Ok(())
}

/// `memory.max` for a limit of `limit` bytes: `None` for 0 (no change).
fn memory_max(vm: &PodVm<'_>, limit: i64) -> Result<Option<String>, UpdateError> {
    if limit == 0 {
        return Ok(None);
    }
    if limit < 0 {
        return Ok(Some("max".into()));
    }
    let guest = u64::from(vm.memory_mib) << 20;
    if (limit as u64) < guest {
        return Err(UpdateError::BelowGuestRam {
            limit,
            guest_mib: vm.memory_mib,
        });
    }
    let mib = (limit as u64).div_ceil(1 << 20) + u64::from(DEFAULT_VMM_MEMORY_OVERHEAD_MIB);
    Ok(Some(mib.saturating_mul(1 << 20).to_string()))
}

/// `cpu.max` for `cpu`'s quota and period (runc's rules): `None` when neither is given.
fn cpu_max(cpu: &WantedCpu) -> Result<Option<String>, UpdateError> {
    let (quota, period) = (cpu.quota.unwrap_or(0), cpu.period.unwrap_or(0));
    if quota == 0 && period == 0 {
        return Ok(None);
    }
    let period = match period {
        0 => DEFAULT_CPU_PERIOD_US,
        p => p,
    };
    let lowest = *CPU_PERIOD_RANGE_US.start() as i64;
    if !CPU_PERIOD_RANGE_US.contains(&period) || (quota > 0 && quota < lowest) {
        return Err(UpdateError::BadCpu { quota, period });
    }
    Ok(Some(match quota > 0 {
        true => format!("{quota} {period}"),
        false => format!("max {period}"),
    }))
}

/// `pids.max` for a limit of `limit`: `max` when not positive, else at least what the VMM needs.
fn pids_max(vm: &PodVm<'_>, limit: i64) -> String {
    match u32::try_from(limit) {
        Ok(n) if n > 0 => n.max(min_pids(vm.vcpus)).to_string(),
        Ok(_) => "max".into(),
        Err(_) if limit > 0 => limit.to_string(),
        Err(_) => "max".into(),
    }
}

/// The fields of a `LinuxResources` document that are set and not applied.
fn ignored_fields(value: &Value) -> Vec<String> {
    let applied: &[(&str, &[&str])] = &[
        ("memory", &["limit"]),
        ("cpu", &["shares", "quota", "period"]),
        ("pids", &["limit"]),
    ];
    let Some(top) = value.as_object() else {
        return Vec::new();
    };
    let mut ignored = Vec::new();
    for (key, inner) in top.iter().filter(|(_, v)| !v.is_null()) {
        let Some((_, keep)) = applied.iter().find(|(k, _)| k == key) else {
            ignored.push(key.clone());
            continue;
        };
        let set = inner.as_object().into_iter().flatten();
        for (sub, _) in set.filter(|(s, v)| !v.is_null() && !keep.contains(&s.as_str())) {
            ignored.push(format!("{key}.{sub}"));
        }
    }
    ignored.sort();
    ignored
}

impl From<UpdateError> for BackendError {
    fn from(e: UpdateError) -> BackendError {
        match e {
            UpdateError::Write { .. } => BackendError::Failed(e.to_string()),
            _ => BackendError::InvalidArgument(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resources(json: &str) -> Resources {
        Resources {
            type_url: LINUX_RESOURCES.into(),
            value: json.as_bytes().to_vec(),
            annotations: Default::default(),
        }
    }

    fn vm(dir: &Path) -> PodVm<'_> {
        PodVm {
            cgroup_dir: dir,
            memory_mib: 256,
            vcpus: 2,
        }
    }

    #[test]
    fn shares_become_a_weight_as_runc_converts_them() {
        // Act
        let weights = [2, 1024, 262_144, 0, 1 << 40].map(weight_of_shares);

        // Assert
        assert_eq!(weights, [1, 39, 10_000, 1, 10_000]);
    }

    #[test]
    fn a_quota_without_a_period_gets_the_default_period_and_no_quota_is_max() {
        // Arrange
        let dir = Path::new("/nonexistent");

        // Act
        let quota = plan(&vm(dir), &resources(r#"{"cpu":{"quota":50000}}"#)).unwrap();
        let unlimited = plan(
            &vm(dir),
            &resources(r#"{"cpu":{"quota":-1,"period":20000}}"#),
        )
        .unwrap();

        // Assert
        assert_eq!(quota, [("cpu.max", "50000 100000".to_string())]);
        assert_eq!(unlimited, [("cpu.max", "max 20000".to_string())]);
    }

    #[test]
    fn cpu_values_the_kernel_refuses_are_refused_before_anything_is_written() {
        for json in [
            r#"{"cpu":{"quota":500,"period":100000}}"#,
            r#"{"cpu":{"quota":50000,"period":10}}"#,
            r#"{"cpu":{"quota":50000,"period":2000000}}"#,
        ] {
            // Act
            let planned = plan(&vm(Path::new("/x")), &resources(json));

            // Assert
            assert!(matches!(planned, Err(UpdateError::BadCpu { .. })), "{json}");
        }
    }

    #[test]
    fn a_pids_limit_keeps_what_the_vmm_needs_and_a_negative_one_is_max() {
        // Act
        let small = plan(&vm(Path::new("/x")), &resources(r#"{"pids":{"limit":1}}"#)).unwrap();
        let none = plan(&vm(Path::new("/x")), &resources(r#"{"pids":{"limit":-1}}"#)).unwrap();

        // Assert
        assert_eq!(small, [("pids.max", min_pids(2).to_string())]);
        assert_eq!(none, [("pids.max", "max".to_string())]);
    }

    #[test]
    fn fields_the_pod_vm_has_no_control_for_are_ignored_and_named() {
        // Arrange
        let json = r#"{"devices":[{"allow":false,"access":"rwm"}],"memory":{"limit":-1,
            "swap":5},"cpu":{"cpus":"0-1","shares":2},"hugepageLimits":[],"unified":null}"#;

        // Act
        let value: Value = serde_json::from_str(json).unwrap();
        let ignored = ignored_fields(&value);
        let planned = plan(&vm(Path::new("/x")), &resources(json)).unwrap();

        // Assert
        assert_eq!(
            ignored,
            ["cpu.cpus", "devices", "hugepageLimits", "memory.swap"]
        );
        assert_eq!(
            planned,
            [
                ("memory.max", "max".to_string()),
                ("cpu.weight", "1".to_string())
            ]
        );
    }

    #[test]
    fn resources_that_are_not_linux_resources_are_refused() {
        // Arrange
        let windows = Resources {
            type_url: "types.containerd.io/opencontainers/runtime-spec/1/WindowsResources".into(),
            ..resources("{}")
        };

        // Act
        let results = [
            plan(&vm(Path::new("/x")), &windows),
            plan(&vm(Path::new("/x")), &resources("not json")),
            plan(
                &vm(Path::new("/x")),
                &resources(r#"{"memory":{"limit":"x"}}"#),
            ),
        ];

        // Assert
        for r in results {
            assert!(matches!(r, Err(UpdateError::Parse(_))), "{r:?}");
        }
    }
}
