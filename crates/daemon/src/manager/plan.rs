//! A create request becomes a sandbox's spec and recipe: the request is mapped to
//! `bulkhead_sandbox`'s [`SandboxSpec`] (the one recipe every front end uses), checked against
//! the daemon's own limits, and built on the daemon's host settings (names only, shares inside
//! `mount_roots`, VMs that outlive the daemon) by the same builder as `bulkhead run`'s.

use bulkhead_client::{CreateSandbox, WorkspaceMode as ApiMode};
use bulkhead_egress::policy::{
    NetworkMode, NetworkSpec, PolicyError, RuleAction, RuleSpec, SecretSpec, SecretValues,
};
use bulkhead_egress::secrets::SecretValue;
use bulkhead_sandbox::egress::EgressSettings;
use bulkhead_sandbox::spec::{self, SpecError};
use bulkhead_sandbox::storage::{StorageError, MIN_SCRATCH_MIB};
use bulkhead_sandbox::{
    FileRef, HostSettings, Mount, Recipe, ResourceLimits, SandboxSpec, Workspace, WorkspaceMode,
};
use bulkhead_vmm::config::SerialOutput;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::{images, ManagerError};
use crate::config::Config;
use crate::store;
use crate::util;

/// Least guest RAM, MiB (a kernel and the agent need a few MiB; below this nothing boots).
pub const MIN_MEMORY_MIB: u32 = 16;
/// Longest time to live a sandbox may ask for, whatever `max_ttl_s` says: 100 years in seconds.
/// Beyond it the deadline would not be a date `expires_at` (RFC 3339, years 0000-9999) can show.
pub const MAX_TTL_S: u64 = 100 * 365 * 24 * 3600;

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

/// The sandbox a request asks for, as the spec every front end shares. Pure: names stay names
/// and host paths are resolved by the builder.
pub fn spec_of(request: &CreateSandbox) -> SandboxSpec {
    SandboxSpec {
        vcpus: request.vcpus,
        memory_mib: request.memory_mib,
        kernel: request.kernel.clone().map(FileRef::Name),
        image: request.image.clone().map(FileRef::Name),
        disk_mib: request.disk_mib,
        disk_files: Vec::new(),
        env: request.env.clone(),
        workdir: request.workdir.clone(),
        user: request.user.clone(),
        mounts: request
            .mounts
            .iter()
            .map(|m| Mount {
                host: PathBuf::from(&m.host),
                guest: PathBuf::from(&m.guest),
                read_only: m.ro,
            })
            .collect(),
        workspace: request.workspace.as_ref().map(|w| Workspace {
            host: PathBuf::from(&w.path),
            mode: match w.mode {
                ApiMode::Direct => WorkspaceMode::Direct,
                ApiMode::Clone => WorkspaceMode::Clone,
            },
        }),
        limits: ResourceLimits {
            cpu_quota: request.cpu_quota,
            pids_max: request.pids_max,
        },
        hostname: request.hostname.clone(),
        labels: request.labels.clone(),
        kernel_args: Vec::new(),
        network: None,
        extra_hosts: Default::default(),
    }
}

/// The network of `request` as the spec's (its rules checked when the spec is built); the
/// pinned names' addresses parsed.
///
/// # Errors
/// [`ManagerError::Invalid`] for a bad mode, rule action or address.
pub fn network_of(
    request: &CreateSandbox,
) -> Result<(Option<NetworkSpec>, PinnedHosts), ManagerError> {
    let Some(net) = &request.network else {
        return Ok((None, PinnedHosts::new()));
    };
    let mode = match net.mode.as_deref() {
        None => NetworkMode::Allowlist,
        Some(text) => text
            .parse()
            .map_err(|e: PolicyError| ManagerError::Invalid(format!("network.mode: {e}")))?,
    };
    let rules = net
        .rules
        .iter()
        .map(|r| {
            let action = match r.action.as_deref() {
                None | Some("allow") => RuleAction::Allow,
                Some("deny") => RuleAction::Deny,
                Some(other) => {
                    return Err(ManagerError::Invalid(format!(
                        "network.rules: action {other:?} is not allow or deny"
                    )))
                }
            };
            Ok(RuleSpec {
                host: r.host.clone(),
                action,
                methods: r.methods.clone(),
                paths: r.paths.clone(),
            })
        })
        .collect::<Result<_, _>>()?;
    let mut hosts = PinnedHosts::new();
    for (name, addrs) in &net.hosts {
        let parsed = addrs
            .iter()
            .map(|a| a.parse::<IpAddr>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| {
                ManagerError::Invalid(format!("network.hosts.{name}: not IP addresses"))
            })?;
        hosts.insert(name.to_ascii_lowercase(), parsed);
    }
    let spec = NetworkSpec {
        mode,
        allow: net.allow.clone(),
        deny: net.deny.clone(),
        allow_cidr: net.allow_cidr.clone(),
        rules,
        secrets: net
            .secrets
            .iter()
            .map(|s| SecretSpec {
                name: s.name.clone(),
                hosts: s.hosts.clone(),
            })
            .collect(),
    };
    Ok((Some(spec), hosts))
}

/// The API view of a spec's network (the inverse of [`network_of`]).
pub fn network_view(spec: &SandboxSpec) -> Option<bulkhead_client::NetworkRequest> {
    let net = spec.network.as_ref()?;
    Some(bulkhead_client::NetworkRequest {
        mode: serde_json::to_value(net.mode)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned)),
        allow: net.allow.clone(),
        deny: net.deny.clone(),
        allow_cidr: net.allow_cidr.clone(),
        rules: net
            .rules
            .iter()
            .map(|r| bulkhead_client::NetworkRule {
                host: r.host.clone(),
                action: Some(match r.action {
                    RuleAction::Allow => "allow".to_owned(),
                    RuleAction::Deny => "deny".to_owned(),
                }),
                methods: r.methods.clone(),
                paths: r.paths.clone(),
            })
            .collect(),
        secrets: net
            .secrets
            .iter()
            .map(|s| bulkhead_client::SecretRef {
                name: s.name.clone(),
                hosts: s.hosts.clone(),
            })
            .collect(),
        hosts: spec
            .extra_hosts
            .iter()
            .map(|(n, a)| (n.clone(), a.iter().map(ToString::to_string).collect()))
            .collect(),
    })
}

/// Pinned names of a network (`extra_hosts`).
pub type PinnedHosts = std::collections::BTreeMap<String, Vec<IpAddr>>;

/// The values of the secrets `spec`'s network names, from the daemon's `[secrets]`.
///
/// # Errors
/// [`ManagerError::Invalid`] for a name the configuration lacks; [`ManagerError::Internal`] for
/// a value that cannot be read.
fn secret_values(config: &Config, spec: &SandboxSpec) -> Result<SecretValues, ManagerError> {
    let mut values = SecretValues::new();
    for name in spec.network.iter().flat_map(NetworkSpec::secret_names) {
        let source = config.secrets.get(name).ok_or_else(|| {
            ManagerError::Invalid(format!(
                "network.secrets: unknown secret {name:?} (the daemon's configuration has \
                 no [secrets] entry of that name)"
            ))
        })?;
        let value = source
            .read()
            .and_then(|v| SecretValue::new(v).map_err(|e| e.to_string()))
            .map_err(|e| ManagerError::Internal(format!("secret {name}: {e}")))?;
        values.insert(name.to_owned(), value);
    }
    Ok(values)
}

/// How the daemon runs sandboxes: its kernels, initramfs and image store, names only, shares
/// inside `mount_roots`, the console in `vmm.log`, VMs that outlive the daemon (restarts adopt
/// them), always jailed when root.
pub fn host_settings(config: &Config, facts: HostFacts) -> HostSettings {
    HostSettings {
        kernel: config.kernel.clone(),
        kernels_dir: config.kernels_dir.clone(),
        initrd: config.image.clone(),
        images: config.image_store(),
        allow_host_paths: false,
        mount_roots: config.mount_roots.clone(),
        vmm_binary: config.vmm_binary.clone(),
        runtime_dir: config.vm_runtime_root(),
        ready_timeout: Duration::from_secs(config.boot_timeout_s),
        // The serial console goes to the VMM's stdout, i.e. into vmm.log with its messages.
        console: SerialOutput::Stdout,
        kill_on_parent_exit: false,
        jail: true,
        vmm_memory_overhead_mib: config.vmm_memory_overhead_mib,
        scratch_in_ram: facts.runtime_in_ram,
        default_pids_max: config.default_pids_max,
        secrets: SecretValues::new(),
        egress_log: None,
    }
}

/// Checks `request` against the daemon's limits and builds sandbox `id`'s recipe; returns it
/// with the spec the daemon records.
///
/// # Errors
/// [`ManagerError::Invalid`] with the offending field, [`ManagerError::UnknownName`] for a
/// kernel or image the daemon does not have, [`ManagerError::InsufficientMemory`],
/// [`ManagerError::Internal`] when the image store is damaged.
pub fn plan(
    config: &Config,
    request: &CreateSandbox,
    facts: HostFacts,
    id: &str,
) -> Result<(SandboxSpec, Recipe), ManagerError> {
    let mut spec = spec_of(request);
    (spec.network, spec.extra_hosts) = network_of(request)?;
    admit(config, &spec, request.ttl_s)?;
    let recipe = recipe_of(config, &spec, facts, id)?;
    Ok((spec, recipe))
}

/// Sandbox `id`'s recipe for an admitted (or recorded) `spec` on this daemon's host, with the
/// host's memory checked; [`plan`] uses it, and so does a resume, for the spec in the record.
///
/// # Errors
/// As [`plan`], but for the daemon's own limits.
pub fn recipe_of(
    config: &Config,
    spec: &SandboxSpec,
    facts: HostFacts,
    id: &str,
) -> Result<Recipe, ManagerError> {
    // The VMs' runtime directories are `<runtime root>/<id>/sb-*`.
    let mut host = host_settings(config, facts);
    host.runtime_dir = host.runtime_dir.join(id);
    host.secrets = secret_values(config, spec)?;
    host.egress_log = Some(store::egress_log_path(&config.state_dir, id));
    let recipe = spec::build(spec, &host, id).map_err(spec_error)?;
    check_memory_available(spec, &recipe, facts, config)?;
    Ok(recipe)
}

/// The egress proxy's settings of recorded sandbox `id`'s `spec` (its secrets read again from
/// the daemon's `[secrets]`, its log where it was), for a restarted daemon that adopts it;
/// `None` without a network.
///
/// # Errors
/// As [`plan`] for the network: a secret the configuration no longer has, or one that cannot
/// be read.
pub fn network_settings(
    config: &Config,
    spec: &SandboxSpec,
    id: &str,
) -> Result<Option<EgressSettings>, ManagerError> {
    let mut host = host_settings(config, host_facts(config));
    host.secrets = secret_values(config, spec)?;
    host.egress_log = Some(store::egress_log_path(&config.state_dir, id));
    spec::egress_settings(spec, &host).map_err(spec_error)
}

/// The daemon's own limits, stricter than the spec's: `max_vcpus`, `max_memory_mib`,
/// `max_disk_mib`, `max_ttl_s`.
fn admit(config: &Config, spec: &SandboxSpec, ttl_s: Option<u64>) -> Result<(), ManagerError> {
    if spec.vcpus == 0 || spec.vcpus > config.max_vcpus {
        return invalid(format!("vcpus must be between 1 and {}", config.max_vcpus));
    }
    if let Some(q) = spec.limits.cpu_quota {
        let max = f64::from(config.max_vcpus);
        if !q.is_finite() || !(spec::MIN_CPU_QUOTA..=max).contains(&q) {
            return invalid(format!(
                "cpu_quota must be between {} and {max} (fraction of one host CPU)",
                spec::MIN_CPU_QUOTA
            ));
        }
    }
    if spec.memory_mib < MIN_MEMORY_MIB || spec.memory_mib > config.max_memory_mib {
        return invalid(format!(
            "memory_mib must be between {MIN_MEMORY_MIB} and {}",
            config.max_memory_mib
        ));
    }
    if let Some(mib) = spec.disk_mib {
        if spec.image.is_none() {
            return invalid(
                "disk_mib needs an image: the scratch disk holds the image's writable layer"
                    .to_owned(),
            );
        }
        if !(MIN_SCRATCH_MIB..=config.max_disk_mib).contains(&mib) {
            return invalid(format!(
                "disk_mib must be between {MIN_SCRATCH_MIB} and {}",
                config.max_disk_mib
            ));
        }
    }
    if let Some(ttl) = ttl_s {
        let max = config.max_ttl_s.unwrap_or(MAX_TTL_S).min(MAX_TTL_S);
        if !(1..=max).contains(&ttl) {
            return invalid(format!("ttl_s must be between 1 and {max}"));
        }
    }
    Ok(())
}

/// The API error of a spec that cannot be built: the client's mistake (400, or 404 for a name
/// the daemon does not have) unless the host itself is broken (500).
fn spec_error(err: SpecError) -> ManagerError {
    match err {
        SpecError::Invalid { field, reason } => ManagerError::Invalid(format!("{field}: {reason}")),
        SpecError::UnknownName { what, .. } => ManagerError::UnknownName {
            what,
            message: err.to_string(),
        },
        SpecError::NotAllowed { .. } | SpecError::Workspace(_) => {
            ManagerError::Invalid(err.to_string())
        }
        SpecError::Mount(e) => ManagerError::Invalid(format!("mounts: {e}")),
        SpecError::Storage(
            e @ (StorageError::ScratchTooSmall(_) | StorageError::ScratchTooLarge { .. }),
        ) => ManagerError::Invalid(format!("disk_mib: {e}")),
        SpecError::Storage(e) => ManagerError::Internal(format!("image: {e}")),
        SpecError::File(e) => ManagerError::Internal(e.to_string()),
        SpecError::Store(e) => ManagerError::Internal(e),
        e @ SpecError::Network(_) => ManagerError::Invalid(e.to_string()),
    }
}

/// The VMM's memory limit (guest RAM, the VMM allowance and a scratch disk in host RAM) must
/// fit in the host's available memory.
fn check_memory_available(
    spec: &SandboxSpec,
    recipe: &Recipe,
    facts: HostFacts,
    config: &Config,
) -> Result<(), ManagerError> {
    let needed = recipe.limits.memory_bytes >> 20;
    let Some(available) = facts.available_mib else {
        return Ok(());
    };
    if needed <= available {
        return Ok(());
    }
    let disk = match (facts.runtime_in_ram, spec.disk_mib) {
        (true, Some(mib)) => {
            format!(" and the scratch disk of {mib} MiB (the runtime directory is in RAM)")
        }
        _ => String::new(),
    };
    Err(ManagerError::InsufficientMemory(format!(
        "memory_mib {} plus the VMM allowance of {} MiB{disk} exceeds the host's available memory ({available} MiB)",
        spec.memory_mib, config.vmm_memory_overhead_mib
    )))
}

fn invalid<T>(message: String) -> Result<T, ManagerError> {
    Err(ManagerError::Invalid(message))
}

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;
