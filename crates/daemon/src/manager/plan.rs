//! Checks a create request against the daemon's limits and the host, and resolves it into what
//! the VM is started with.

use std::path::{Path, PathBuf};

use bulkhead_client::CreateSandbox;

use super::ManagerError;
use crate::cgroup::VmLimits;
use crate::config::Config;
use crate::util;

/// Least guest RAM, MiB (a kernel and the agent need a few MiB; below this nothing boots).
pub const MIN_MEMORY_MIB: u32 = 16;
/// Tasks the VMM needs besides one thread per vCPU (main, signal and event threads, margin).
pub const VMM_BASE_TASKS: u32 = 8;
/// Largest `pids_max`, matching the kernel's `PID_MAX_LIMIT` (2^22).
pub const MAX_PIDS: u32 = 1 << 22;
/// Smallest CPU quota, as a fraction of a CPU (the kernel's 1 ms minimum per 100 ms period).
pub const MIN_CPU_QUOTA: f64 = 0.01;
/// Most labels per sandbox.
pub const MAX_LABELS: usize = 64;
/// Longest label key or value, bytes.
pub const MAX_LABEL_LEN: usize = 256;

/// A validated create request.
#[derive(Debug, Clone)]
pub struct VmPlan {
    /// Kernel file.
    pub kernel: PathBuf,
    /// Initramfs file.
    pub initrd: PathBuf,
    /// Host limits.
    pub limits: VmLimits,
}

/// Validates `spec`; `available_mib` is the host's available memory (None: unknown).
///
/// # Errors
/// [`ManagerError::Invalid`] with the offending field, [`ManagerError::InsufficientMemory`].
pub fn plan(
    config: &Config,
    spec: &CreateSandbox,
    available_mib: Option<u64>,
) -> Result<VmPlan, ManagerError> {
    check_cpu(config, spec)?;
    check_memory(config, spec, available_mib)?;
    check_env_and_labels(spec)?;
    if let Some(ttl) = spec.ttl_s {
        if ttl == 0 || config.max_ttl_s.is_some_and(|max| ttl > max) {
            return invalid(format!(
                "ttl_s must be between 1 and {}",
                config
                    .max_ttl_s
                    .map_or("unlimited".into(), |m| m.to_string())
            ));
        }
    }
    let pids_max = spec
        .pids_max
        .unwrap_or(config.default_pids_max.max(min_pids(spec.vcpus)));
    if !(min_pids(spec.vcpus)..=MAX_PIDS).contains(&pids_max) {
        return invalid(format!(
            "pids_max must be between {} (vCPUs + {VMM_BASE_TASKS}) and {MAX_PIDS}",
            min_pids(spec.vcpus)
        ));
    }
    let kernel = resolve(
        spec.kernel.as_deref(),
        &config.kernel,
        config.kernels_dir.as_deref(),
        "kernel",
        "",
    )?;
    let initrd = resolve(
        spec.image.as_deref(),
        &config.image,
        config.images_dir.as_deref(),
        "image",
        "initramfs.cpio.gz",
    )?;
    let memory_bytes =
        (u64::from(spec.memory_mib) + u64::from(config.vmm_memory_overhead_mib)) << 20;
    Ok(VmPlan {
        kernel,
        initrd,
        limits: VmLimits {
            memory_bytes,
            cpu_quota: spec.cpu_quota,
            pids_max,
        },
    })
}

fn min_pids(vcpus: u8) -> u32 {
    u32::from(vcpus) + VMM_BASE_TASKS
}

fn invalid<T>(message: String) -> Result<T, ManagerError> {
    Err(ManagerError::Invalid(message))
}

fn check_cpu(config: &Config, spec: &CreateSandbox) -> Result<(), ManagerError> {
    if spec.vcpus == 0 || spec.vcpus > config.max_vcpus {
        return invalid(format!("vcpus must be between 1 and {}", config.max_vcpus));
    }
    if let Some(q) = spec.cpu_quota {
        let max = f64::from(config.max_vcpus);
        if !q.is_finite() || !(MIN_CPU_QUOTA..=max).contains(&q) {
            return invalid(format!(
                "cpu_quota must be between {MIN_CPU_QUOTA} and {max} (fraction of one host CPU)"
            ));
        }
    }
    Ok(())
}

fn check_memory(
    config: &Config,
    spec: &CreateSandbox,
    available_mib: Option<u64>,
) -> Result<(), ManagerError> {
    if spec.memory_mib < MIN_MEMORY_MIB || spec.memory_mib > config.max_memory_mib {
        return invalid(format!(
            "memory_mib must be between {MIN_MEMORY_MIB} and {}",
            config.max_memory_mib
        ));
    }
    let needed = u64::from(spec.memory_mib) + u64::from(config.vmm_memory_overhead_mib);
    if let Some(available) = available_mib {
        if needed > available {
            return Err(ManagerError::InsufficientMemory(format!(
                "memory_mib {} plus the VMM allowance of {} MiB exceeds the host's available memory ({available} MiB)",
                spec.memory_mib, config.vmm_memory_overhead_mib
            )));
        }
    }
    Ok(())
}

fn check_env_and_labels(spec: &CreateSandbox) -> Result<(), ManagerError> {
    check_env(&spec.env)?;
    if spec.labels.len() > MAX_LABELS {
        return invalid(format!("at most {MAX_LABELS} labels"));
    }
    for (k, v) in &spec.labels {
        if k.is_empty() || k.len() > MAX_LABEL_LEN || v.len() > MAX_LABEL_LEN || k.contains('=') {
            return invalid(format!(
                "label keys must be 1..={MAX_LABEL_LEN} bytes without '=', values at most {MAX_LABEL_LEN} bytes"
            ));
        }
    }
    Ok(())
}

/// Environment names must be non-empty without `=` or NUL; values without NUL.
///
/// # Errors
/// [`ManagerError::Invalid`] naming the bad variable.
pub fn check_env(env: &std::collections::BTreeMap<String, String>) -> Result<(), ManagerError> {
    for (k, v) in env {
        if k.is_empty() || k.contains(['=', '\0']) || v.contains('\0') {
            return invalid(format!("invalid environment variable {k:?}"));
        }
    }
    Ok(())
}

/// The file for an optional `name` in `dir` (`<dir>/<name>[/<inner>]`), or `default`.
fn resolve(
    name: Option<&str>,
    default: &Path,
    dir: Option<&Path>,
    what: &str,
    inner: &str,
) -> Result<PathBuf, ManagerError> {
    let Some(name) = name else {
        return Ok(default.to_owned());
    };
    let safe = !name.is_empty()
        && !name.starts_with('.')
        && name.len() <= 128
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if !safe {
        return invalid(format!(
            "{what} names are 1-128 characters of [A-Za-z0-9._-], not starting with '.'"
        ));
    }
    let Some(dir) = dir else {
        return invalid(format!(
            "this daemon has no {what}s directory; leave {what} out for the default"
        ));
    };
    let mut path = dir.join(name);
    if !inner.is_empty() {
        path.push(inner);
    }
    if !path.is_file() {
        return invalid(format!("unknown {what} {name:?}"));
    }
    Ok(path)
}

/// The environment (`KEY=VALUE`) of a command: `base`, overridden by `overrides`.
pub fn merged_env(
    base: &std::collections::BTreeMap<String, String>,
    overrides: &std::collections::BTreeMap<String, String>,
) -> Vec<String> {
    let mut all = base.clone();
    all.extend(overrides.iter().map(|(k, v)| (k.clone(), v.clone())));
    all.iter().map(|(k, v)| format!("{k}={v}")).collect()
}

/// The host's available memory, if known.
pub fn host_available_mib() -> Option<u64> {
    util::available_memory_mib().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> CreateSandbox {
        CreateSandbox::default()
    }

    fn plan_of(spec: &CreateSandbox) -> Result<VmPlan, ManagerError> {
        plan(&Config::default(), spec, Some(4096))
    }

    #[test]
    fn memory_limit_is_guest_ram_plus_the_vmm_allowance() {
        // Arrange
        let mut s = spec();
        s.memory_mib = 512;

        // Act
        let plan = plan_of(&s).unwrap();

        // Assert
        assert_eq!(plan.limits.memory_bytes, (512 + 64) << 20);
    }

    #[test]
    fn zero_vcpus_zero_memory_and_too_much_memory_are_refused() {
        // Arrange
        let mut no_cpu = spec();
        no_cpu.vcpus = 0;
        let mut no_mem = spec();
        no_mem.memory_mib = 0;
        let mut huge = spec();
        huge.memory_mib = 8000;

        // Act
        let results = [plan_of(&no_cpu), plan_of(&no_mem), plan_of(&huge)];

        // Assert
        assert!(matches!(&results[0], Err(ManagerError::Invalid(m)) if m.contains("vcpus")));
        assert!(matches!(&results[1], Err(ManagerError::Invalid(m)) if m.contains("memory_mib")));
        assert!(matches!(
            &results[2],
            Err(ManagerError::InsufficientMemory(_))
        ));
    }

    #[test]
    fn image_names_cannot_escape_the_images_dir() {
        // Arrange
        let mut s = spec();
        s.image = Some("../../etc".into());

        // Act
        let result = plan_of(&s);

        // Assert
        assert!(matches!(result, Err(ManagerError::Invalid(m)) if m.contains("image names")));
    }

    #[test]
    fn exec_env_overrides_the_sandbox_env() {
        // Arrange
        let base = [
            ("A".to_owned(), "1".to_owned()),
            ("B".to_owned(), "2".to_owned()),
        ]
        .into();
        let over = [("B".to_owned(), "3".to_owned())].into();

        // Act
        let env = merged_env(&base, &over);

        // Assert
        assert_eq!(env, vec!["A=1".to_owned(), "B=3".to_owned()]);
    }
}
