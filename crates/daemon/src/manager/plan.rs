//! Checks a create request against the daemon's limits and the host, and resolves it into what
//! the VM is started with.

use std::path::{Path, PathBuf};

use bulkhead_client::CreateSandbox;
use bulkhead_sandbox::{Mount, Storage, Workspace};

use super::{images, shares, ManagerError};
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
/// Longest time to live a sandbox may ask for, whatever `max_ttl_s` says: 100 years in seconds.
/// Beyond it the deadline would not be a date `expires_at` (RFC 3339, years 0000-9999) can show.
pub const MAX_TTL_S: u64 = 100 * 365 * 24 * 3600;
/// Longest label key or value, bytes.
pub const MAX_LABEL_LEN: usize = 256;

/// A validated create request.
#[derive(Debug, Clone)]
pub struct VmPlan {
    /// Kernel file.
    pub kernel: PathBuf,
    /// Initramfs file.
    pub initrd: PathBuf,
    /// Root image and scratch disk (none without `image`).
    pub storage: Storage,
    /// Host limits.
    pub limits: VmLimits,
    /// Host directories shared into the guest (resolved inside the `mount_roots`).
    pub mounts: Vec<Mount>,
    /// The workspace at `/workspace` (resolved inside the `mount_roots`).
    pub workspace: Option<Workspace>,
}

/// What a plan needs to know about the host.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostFacts {
    /// The host's available memory, MiB (None: unknown).
    pub available_mib: Option<u64>,
    /// The VMs' runtime root is on a RAM-backed file system (tmpfs): scratch disks there are
    /// host memory, charged to the memory cgroup of the VMM that writes them.
    pub runtime_in_ram: bool,
}

/// The [`HostFacts`] of this host for `config`.
pub fn host_facts(config: &Config) -> HostFacts {
    HostFacts {
        available_mib: util::available_memory_mib().ok(),
        runtime_in_ram: images::is_ram_backed(&config.vm_runtime_root()),
    }
}

/// Validates `spec` and resolves its kernel, initramfs and image.
///
/// # Errors
/// [`ManagerError::Invalid`] with the offending field, [`ManagerError::InsufficientMemory`],
/// [`ManagerError::Internal`] when the image store is damaged.
pub fn plan(
    config: &Config,
    spec: &CreateSandbox,
    host: HostFacts,
) -> Result<VmPlan, ManagerError> {
    check_cpu(config, spec)?;
    images::check_disk_mib(config, spec)?; // before the memory check, which may count it
    check_memory(config, spec, host)?;
    check_env_and_labels(spec)?;
    if let Some(ttl) = spec.ttl_s {
        let max = config.max_ttl_s.unwrap_or(MAX_TTL_S).min(MAX_TTL_S);
        if !(1..=max).contains(&ttl) {
            return invalid(format!("ttl_s must be between 1 and {max}"));
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
    )?;
    let initrd = config.image.clone();
    let storage = images::storage_of(config, spec)?;
    let (mounts, workspace) = shares::shares_of(config, spec)?;
    let memory_bytes = memory_limit_mib(config, spec, host).saturating_mul(1 << 20);
    Ok(VmPlan {
        kernel,
        initrd,
        storage,
        limits: VmLimits {
            memory_bytes,
            cpu_quota: spec.cpu_quota,
            pids_max,
        },
        mounts,
        workspace,
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

/// The VMM's memory limit, MiB: guest RAM, the VMM allowance and, when scratch disks live in
/// host RAM, the scratch disk (its pages are charged to the VMM that writes them and cannot be
/// reclaimed without swap).
fn memory_limit_mib(config: &Config, spec: &CreateSandbox, host: HostFacts) -> u64 {
    u64::from(spec.memory_mib)
        .saturating_add(u64::from(config.vmm_memory_overhead_mib))
        .saturating_add(scratch_in_ram(spec, host))
}

fn scratch_in_ram(spec: &CreateSandbox, host: HostFacts) -> u64 {
    match (host.runtime_in_ram, spec.image.is_some()) {
        (true, true) => spec.disk_mib.unwrap_or(0),
        _ => 0,
    }
}

fn check_memory(
    config: &Config,
    spec: &CreateSandbox,
    host: HostFacts,
) -> Result<(), ManagerError> {
    if spec.memory_mib < MIN_MEMORY_MIB || spec.memory_mib > config.max_memory_mib {
        return invalid(format!(
            "memory_mib must be between {MIN_MEMORY_MIB} and {}",
            config.max_memory_mib
        ));
    }
    let needed = memory_limit_mib(config, spec, host);
    if let Some(available) = host.available_mib {
        if needed > available {
            let disk = match scratch_in_ram(spec, host) {
                0 => String::new(),
                mib => {
                    format!(" and the scratch disk of {mib} MiB (the runtime directory is in RAM)")
                }
            };
            return Err(ManagerError::InsufficientMemory(format!(
                "memory_mib {} plus the VMM allowance of {} MiB{disk} exceeds the host's available memory ({available} MiB)",
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

/// The file for an optional `name` in `dir` (`<dir>/<name>`), or `default`.
fn resolve(
    name: Option<&str>,
    default: &Path,
    dir: Option<&Path>,
    what: &str,
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
    let path = dir.join(name);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> CreateSandbox {
        CreateSandbox::default()
    }

    fn host(available_mib: u64) -> HostFacts {
        HostFacts {
            available_mib: Some(available_mib),
            runtime_in_ram: false,
        }
    }

    fn plan_of(spec: &CreateSandbox) -> Result<VmPlan, ManagerError> {
        plan(&Config::default(), spec, host(4096))
    }

    /// A configuration whose image store (`<dir>/images`) holds fake images `names` and whose
    /// runtime root is in `dir`.
    fn config_with_images(dir: &Path, names: &[&str]) -> Config {
        images::testing::store_with(&dir.join("images"), names);
        Config {
            images_dir: Some(dir.join("images")),
            runtime_dir: Some(dir.to_owned()),
            ..Config::default()
        }
    }

    fn with_image(image: &str, disk_mib: Option<u64>) -> CreateSandbox {
        CreateSandbox {
            image: Some(image.to_owned()),
            disk_mib,
            ..CreateSandbox::default()
        }
    }

    fn message(result: Result<VmPlan, ManagerError>) -> String {
        match result {
            Err(ManagerError::Invalid(m)) => m,
            other => panic!("expected a 400, got {other:?}"),
        }
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
    fn a_ttl_beyond_a_century_is_refused_even_without_a_configured_maximum() {
        // Arrange
        let ttl = |secs| CreateSandbox {
            ttl_s: Some(secs),
            ..spec()
        };

        // Act
        let results = [
            plan_of(&ttl(u64::MAX)),
            plan_of(&ttl(0)),
            plan_of(&ttl(MAX_TTL_S)),
        ];

        // Assert
        for refused in &results[..2] {
            assert!(
                matches!(refused, Err(ManagerError::Invalid(m)) if m.contains("ttl_s must be between 1 and 3153600000")),
                "{refused:?}"
            );
        }
        assert!(results[2].is_ok(), "{:?}", results[2]);
    }

    #[test]
    fn image_names_cannot_escape_the_image_store() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let config = config_with_images(dir.path(), &["debian"]);
        std::fs::create_dir_all(dir.path().join("etc")).unwrap();
        let names = [
            "../../etc",
            "../etc",
            "debian/../debian",
            "/etc",
            ".hidden",
            "Debian",
            "",
        ];

        // Act
        let results: Vec<_> = names
            .iter()
            .map(|n| plan(&config, &with_image(n, None), host(4096)))
            .collect();

        // Assert
        for (name, result) in names.iter().zip(results) {
            let m = message(result);
            assert!(m.contains("invalid image name"), "{name:?}: {m}");
        }
    }

    #[test]
    fn an_image_of_the_store_is_the_read_only_root_with_an_optional_scratch_disk() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let config = config_with_images(dir.path(), &["debian"]);
        let rootfs = dir.path().join("images/debian/rootfs.ext4");

        // Act
        let tmpfs_layer = plan(&config, &with_image("debian", None), host(4096)).unwrap();
        let on_disk = plan(&config, &with_image("debian", Some(64)), host(4096)).unwrap();
        let no_image = plan(&config, &spec(), host(4096)).unwrap();

        // Assert
        assert_eq!(tmpfs_layer.storage.root_image.as_deref(), Some(&*rootfs));
        assert_eq!(tmpfs_layer.storage.scratch_mib, None);
        assert_eq!(on_disk.storage.root_image.as_deref(), Some(&*rootfs));
        assert_eq!(on_disk.storage.scratch_mib, Some(64));
        assert_eq!(no_image.storage, Storage::default());
        assert_eq!(
            on_disk.initrd, config.image,
            "the agent's initramfs boots the image"
        );
    }

    #[test]
    fn an_unknown_image_is_a_400_naming_it_and_the_images_there_are() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let config = config_with_images(dir.path(), &["debian", "tools"]);

        // Act
        let m = message(plan(&config, &with_image("ubuntu", None), host(4096)));

        // Assert
        assert!(m.contains("unknown image \"ubuntu\""), "{m}");
        assert!(m.contains("debian, tools"), "{m}");
    }

    #[test]
    fn an_initramfs_directory_is_not_an_image() {
        // Arrange: the old meaning of `image`, `<images_dir>/NAME/initramfs.cpio.gz`.
        let dir = tempfile::tempdir().unwrap();
        let config = config_with_images(dir.path(), &[]);
        let old = dir.path().join("images/default");
        std::fs::create_dir_all(&old).unwrap();
        std::fs::write(old.join("initramfs.cpio.gz"), b"cpio").unwrap();

        // Act
        let m = message(plan(&config, &with_image("default", None), host(4096)));

        // Assert
        assert!(m.contains("not an image"), "{m}");
    }

    #[test]
    fn disk_mib_needs_an_image_and_a_size_within_bounds() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let config = Config {
            max_disk_mib: 1024,
            ..config_with_images(dir.path(), &["debian"])
        };
        let without_image = CreateSandbox {
            disk_mib: Some(64),
            ..CreateSandbox::default()
        };

        // Act
        let results = [
            plan(&config, &without_image, host(4096)),
            plan(&config, &with_image("debian", Some(1)), host(4096)),
            plan(&config, &with_image("debian", Some(1025)), host(4096)),
        ];

        // Assert
        let messages: Vec<String> = results.into_iter().map(message).collect();
        assert!(
            messages[0].contains("disk_mib needs an image"),
            "{}",
            messages[0]
        );
        assert!(
            messages[1].contains("between 8 and 1024"),
            "{}",
            messages[1]
        );
        assert!(
            messages[2].contains("between 8 and 1024"),
            "{}",
            messages[2]
        );
    }

    #[test]
    fn an_absurd_disk_mib_is_a_400_even_where_it_would_count_as_memory() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let config = config_with_images(dir.path(), &["debian"]);
        let in_ram = HostFacts {
            available_mib: Some(4096),
            runtime_in_ram: true,
        };

        // Act
        let result = plan(&config, &with_image("debian", Some(u64::MAX)), in_ram);

        // Assert
        assert!(message(result).contains("disk_mib must be between"));
    }

    #[test]
    fn a_scratch_disk_in_host_ram_counts_toward_the_memory_limit_and_one_on_disk_does_not() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let config = config_with_images(dir.path(), &["debian"]);
        let spec = CreateSandbox {
            memory_mib: 256,
            ..with_image("debian", Some(512))
        };
        let in_ram = HostFacts {
            available_mib: Some(4096),
            runtime_in_ram: true,
        };

        // Act
        let on_disk = plan(&config, &spec, host(4096)).unwrap();
        let on_tmpfs = plan(&config, &spec, in_ram).unwrap();
        let too_big = plan(
            &config,
            &spec,
            HostFacts {
                available_mib: Some(700),
                ..in_ram
            },
        );

        // Assert
        assert_eq!(on_disk.limits.memory_bytes, (256 + 64) << 20);
        assert_eq!(on_tmpfs.limits.memory_bytes, (256 + 64 + 512) << 20);
        assert!(
            matches!(&too_big, Err(ManagerError::InsufficientMemory(m)) if m.contains("scratch disk of 512 MiB")),
            "{too_big:?}"
        );
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
