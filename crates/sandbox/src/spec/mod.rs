//! One sandbox recipe: what a user can ask of a sandbox ([`SandboxSpec`]), checked in one place
//! ([`SandboxSpec::validate`]) and turned into the VM's configuration, its disks, the defaults of
//! every command and its host limits by one function ([`build`]).
//!
//! Every front end goes through here: `bulkhead run` and `bulkhead bench` map their flags to a
//! spec, the daemon maps `POST /v1/sandboxes` to one (and stores it, versioned, in its records),
//! and the library takes one directly. What differs between front ends is not the recipe but
//! the host they run on ([`HostSettings`]: where kernels and images come from, whether host
//! paths may be named, where runtime files go, whether the VMM outlives its starter).
//!
//! ```text
//! flags / API request ──▶ SandboxSpec ──validate──▶ build(spec, host, id) ──▶ Recipe
//!                                                     │ resolves kernel, image, shares
//!                                                     ▼
//!                          SandboxConfig + Storage (the VM)  ExecDefaults (every command)
//!                          VmLimits (its cgroup)
//! ```

pub(crate) mod build;

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;
use std::path::PathBuf;

use bulkhead_egress::policy::{NetworkMode, NetworkSpec, PolicyError};
use bulkhead_protocol::boot::{check_hostname, is_bulkhead_param};
use bulkhead_vmm::config::{DiskConfig, MAX_VCPUS};
use bulkhead_vmm::vstate::memory::{MAX_MEMORY_MIB, MIN_MEMORY_MIB};
use serde::{Deserialize, Serialize};

use crate::mounts::{Mount, MountError, MAX_MOUNTS};
use crate::storage::{StorageError, MIN_SCRATCH_MIB};
use crate::workspace::{Workspace, WorkspaceError};

pub use build::{
    build, egress_settings, hostname_of, limits_of, new_id, resolve_shares, ExecDefaults,
    HostSettings, Recipe, BASE_PATH, BASE_TERM, ID_LEN, ROOT_HOME,
};

/// Version of the [`SandboxSpec`] format, for stored specs (the daemon's records).
pub const SPEC_VERSION: u32 = 1;
/// vCPUs when a spec names none.
pub const DEFAULT_VCPUS: u8 = 1;
/// Guest RAM when a spec names none, MiB.
pub const DEFAULT_MEMORY_MIB: u32 = 256;
/// Smallest CPU quota, as a fraction of one host CPU (the kernel's 1 ms per 100 ms period).
pub const MIN_CPU_QUOTA: f64 = 0.01;
/// Tasks the VMM needs besides one thread per vCPU (main, signal and event threads, margin).
pub const VMM_BASE_TASKS: u32 = 8;
/// Largest `pids_max`, the kernel's `PID_MAX_LIMIT` (2^22).
pub const MAX_PIDS: u32 = 1 << 22;
/// Memory the VMM process may use besides guest RAM by default, MiB (its cgroup memory limit is
/// guest RAM plus this).
pub const DEFAULT_VMM_MEMORY_OVERHEAD_MIB: u32 = 64;
/// `pids.max` of a VMM by default (raised to what its vCPUs need).
pub const DEFAULT_PIDS_MAX: u32 = 64;
/// Most labels per sandbox.
pub const MAX_LABELS: usize = 64;
/// Longest label key or value, bytes.
pub const MAX_LABEL_LEN: usize = 256;
/// Longest kernel name, bytes.
pub const MAX_KERNEL_NAME: usize = 128;

/// Everything a user can ask of one sandbox. Serialized (JSON) by the daemon in its records;
/// unknown fields are refused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxSpec {
    /// Number of vCPUs (1 to the VMM's limit for the architecture).
    #[serde(default = "default_vcpus")]
    pub vcpus: u8,
    /// Guest RAM, MiB (within the VMM's limits).
    #[serde(default = "default_memory_mib")]
    pub memory_mib: u32,
    /// The guest kernel; the host's default when `None`.
    #[serde(default)]
    pub kernel: Option<FileRef>,
    /// A root filesystem image, shared read-only under a private writable layer; the agent's
    /// initramfs stays the root when `None`.
    #[serde(default)]
    pub image: Option<FileRef>,
    /// Keep the image's writable layer on a sparse scratch disk of this many MiB (deleted with
    /// the sandbox) instead of in guest RAM. Needs `image`.
    #[serde(default)]
    pub disk_mib: Option<u64>,
    /// Extra raw disks (virtio-blk), after the image's.
    #[serde(default)]
    pub disk_files: Vec<DiskConfig>,
    /// Environment every command starts with (a command's own environment overrides it).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory of commands; `/workspace` with a workspace, else `/`.
    #[serde(default)]
    pub workdir: Option<String>,
    /// User commands run as (name, uid or uid:gid); root when `None`.
    #[serde(default)]
    pub user: Option<String>,
    /// Host directories shared into the guest.
    #[serde(default)]
    pub mounts: Vec<Mount>,
    /// A host project directory at `/workspace`.
    #[serde(default)]
    pub workspace: Option<Workspace>,
    /// Host resource limits of the VMM process (its cgroup).
    #[serde(default)]
    pub limits: ResourceLimits,
    /// The guest's hostname; `bh-<sandbox id>` when `None`.
    #[serde(default)]
    pub hostname: Option<String>,
    /// Free-form labels, for finding sandboxes.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Extra guest kernel command-line parameters (not `bulkhead.` keys, which the boot
    /// parameters own).
    #[serde(default)]
    pub kernel_args: Vec<String>,
    /// The sandbox's network (`docs/network.md`): none when `None` or mode `none` (no proxy,
    /// no way out); else every connection leaves through the host's egress proxy under this
    /// policy.
    #[serde(default)]
    pub network: Option<NetworkSpec>,
    /// Names the egress proxy resolves to these addresses instead of asking the host's
    /// resolver (like `docker run --add-host`); the addresses are still vetted. Needs a
    /// network.
    #[serde(default)]
    pub extra_hosts: BTreeMap<String, Vec<IpAddr>>,
}

fn default_vcpus() -> u8 {
    DEFAULT_VCPUS
}

fn default_memory_mib() -> u32 {
    DEFAULT_MEMORY_MIB
}

impl Default for SandboxSpec {
    fn default() -> Self {
        SandboxSpec {
            vcpus: DEFAULT_VCPUS,
            memory_mib: DEFAULT_MEMORY_MIB,
            kernel: None,
            image: None,
            disk_mib: None,
            disk_files: Vec::new(),
            env: BTreeMap::new(),
            workdir: None,
            user: None,
            mounts: Vec::new(),
            workspace: None,
            limits: ResourceLimits::default(),
            hostname: None,
            labels: BTreeMap::new(),
            kernel_args: Vec::new(),
            network: None,
            extra_hosts: BTreeMap::new(),
        }
    }
}

/// A file the host provides: a name it resolves (a kernel in its kernels directory, an image in
/// its image store) or, where the host allows it, a path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileRef {
    /// A name the host resolves.
    Name(String),
    /// A host path.
    Path(PathBuf),
}

impl fmt::Display for FileRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FileRef::Name(name) => f.write_str(name),
            FileRef::Path(path) => write!(f, "{}", path.display()),
        }
    }
}

/// Host limits of the VMM process, applied through its cgroup.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResourceLimits {
    /// CPU time as a fraction of one host CPU (0.5 = half a CPU), over a 100 ms period;
    /// unlimited when `None`.
    #[serde(default)]
    pub cpu_quota: Option<f64>,
    /// Most tasks (processes and threads) of the VMM process (`pids.max`); the host's default
    /// when `None`.
    #[serde(default)]
    pub pids_max: Option<u32>,
}

impl ResourceLimits {
    /// Whether any limit is asked for.
    pub fn any(&self) -> bool {
        self.cpu_quota.is_some() || self.pids_max.is_some()
    }
}

/// A spec that cannot become a sandbox. One error type for every front end; each variant says
/// which field is wrong.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    /// A value is out of range or malformed.
    #[error("{field}: {reason}")]
    Invalid {
        /// The spec's field (`vcpus`, `env`, `mounts[1].guest`, ...).
        field: String,
        /// What is wrong.
        reason: String,
    },
    /// A kernel or image name the host does not have.
    #[error("unknown {what} {name:?}: {where_} has {} ({hint})", known_names(.what, .known))]
    UnknownName {
        /// `kernel` or `image`.
        what: &'static str,
        /// The name given.
        name: String,
        /// The names the host has (may be empty).
        known: Vec<String>,
        /// Where the names were looked up (`the image store at DIR`).
        where_: String,
        /// How to get one.
        hint: String,
    },
    /// A host path where this host only takes names (the daemon), or a name where it has no
    /// place to resolve names.
    #[error("{what}: {reason}")]
    NotAllowed {
        /// `kernel`, `image`, `disk_files`, ...
        what: &'static str,
        /// Why.
        reason: String,
    },
    /// A file the sandbox needs is missing or unusable (kernel, initramfs, VMM).
    #[error(transparent)]
    File(Box<crate::Error>),
    /// The root image, scratch disk or a data disk is unusable.
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// A host directory to share is unusable.
    #[error(transparent)]
    Mount(#[from] MountError),
    /// The workspace is unusable.
    #[error(transparent)]
    Workspace(#[from] WorkspaceError),
    /// The host's image store is damaged or unreadable (not the request's fault).
    #[error("image store: {0}")]
    Store(String),
    /// The network policy is invalid: a malformed rule, an unknown preset, a secret without a
    /// value on this host.
    #[error("network: {0}")]
    Network(#[from] PolicyError),
}

/// What a host has instead of an unknown name: `no image at all`, or the names it has.
fn known_names(what: &str, known: &[String]) -> String {
    match known.is_empty() {
        true => format!("no {what} at all"),
        false => known.join(", "),
    }
}

impl SpecError {
    /// What is wrong, without the field's name (for a front end that names the field itself,
    /// e.g. a command-line flag).
    pub fn reason(&self) -> String {
        match self {
            SpecError::Invalid { reason, .. } => reason.clone(),
            other => other.to_string(),
        }
    }
}

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> SpecError {
    SpecError::Invalid {
        field: field.into(),
        reason: reason.into(),
    }
}

impl SandboxSpec {
    /// Checks every value that can be checked without touching the host: ranges, names,
    /// syntax. [`build`] calls it first; front ends may call it early.
    ///
    /// # Errors
    /// The first [`SpecError::Invalid`] found.
    pub fn validate(&self) -> Result<(), SpecError> {
        check_vcpus(self.vcpus)?;
        check_memory_mib(self.memory_mib)?;
        self.check_disks()?;
        check_env(&self.env)?;
        self.check_commands()?;
        check_limits(&self.limits, self.vcpus)?;
        if let Some(name) = &self.hostname {
            check_hostname(name).map_err(|e| invalid("hostname", e.to_string()))?;
        }
        check_labels(&self.labels)?;
        for arg in &self.kernel_args {
            check_kernel_arg(arg)?;
        }
        if self.mounts.len() > MAX_MOUNTS {
            return Err(MountError::TooMany(self.mounts.len()).into());
        }
        if let Some(FileRef::Name(name)) = &self.kernel {
            check_kernel_name(name)?;
        }
        if let Some(net) = self.network.as_ref().filter(|_| !self.has_network()) {
            let rules = !(net.allow.is_empty()
                && net.deny.is_empty()
                && net.allow_cidr.is_empty()
                && net.rules.is_empty()
                && net.secrets.is_empty());
            if rules {
                return Err(invalid(
                    "network",
                    "mode none takes no rules or secrets (drop them, or pick allowlist or \
                     allow-all)",
                ));
            }
        }
        if !self.extra_hosts.is_empty() && !self.has_network() {
            return Err(invalid(
                "extra_hosts",
                "pinned names are for the egress proxy: they need a network",
            ));
        }
        if let Some((name, _)) = self
            .extra_hosts
            .iter()
            .find(|(n, a)| n.is_empty() || a.is_empty())
        {
            return Err(invalid(
                "extra_hosts",
                format!("{name:?} needs a non-empty name and at least one address"),
            ));
        }
        Ok(())
    }

    /// Whether the sandbox has a network (a policy whose mode is not `none`).
    pub fn has_network(&self) -> bool {
        self.network
            .as_ref()
            .is_some_and(|n| n.mode != NetworkMode::None)
    }

    fn check_disks(&self) -> Result<(), SpecError> {
        let Some(mib) = self.disk_mib else {
            return Ok(());
        };
        if self.image.is_none() {
            return Err(invalid(
                "disk_mib",
                "needs an image: the scratch disk holds the image's writable layer",
            ));
        }
        if mib < MIN_SCRATCH_MIB {
            return Err(invalid(
                "disk_mib",
                format!("the scratch disk must be at least {MIN_SCRATCH_MIB} MiB"),
            ));
        }
        Ok(())
    }

    fn check_commands(&self) -> Result<(), SpecError> {
        if let Some(dir) = &self.workdir {
            if !dir.starts_with('/') || dir.contains('\0') {
                return Err(invalid(
                    "workdir",
                    format!("{dir:?} is not an absolute path"),
                ));
            }
        }
        if let Some(user) = &self.user {
            if user.is_empty() || user.contains(['\0', ' ', '\t', '\n']) {
                return Err(invalid(
                    "user",
                    format!("{user:?} is not a name, uid or uid:gid"),
                ));
            }
        }
        Ok(())
    }
}

/// `vcpus`: 1 to the VMM's [`MAX_VCPUS`].
///
/// # Errors
/// [`SpecError::Invalid`].
pub fn check_vcpus(vcpus: u8) -> Result<(), SpecError> {
    match (1..=MAX_VCPUS).contains(&vcpus) {
        true => Ok(()),
        false => Err(invalid(
            "vcpus",
            format!("the number of vCPUs must be between 1 and {MAX_VCPUS} (the VMM's limit)"),
        )),
    }
}

/// `memory_mib`: within the VMM's [`MIN_MEMORY_MIB`]..=[`MAX_MEMORY_MIB`].
///
/// # Errors
/// [`SpecError::Invalid`].
pub fn check_memory_mib(mib: u32) -> Result<(), SpecError> {
    match (MIN_MEMORY_MIB..=MAX_MEMORY_MIB).contains(&mib) {
        true => Ok(()),
        false => Err(invalid(
            "memory_mib",
            format!("guest memory must be between {MIN_MEMORY_MIB} and {MAX_MEMORY_MIB} MiB"),
        )),
    }
}

/// Environment names are non-empty without `=` or NUL; values have no NUL.
///
/// # Errors
/// [`SpecError::Invalid`] naming the variable.
pub fn check_env<V: AsRef<[u8]>>(env: &BTreeMap<String, V>) -> Result<(), SpecError> {
    for (k, v) in env {
        if k.is_empty() || k.contains(['=', '\0']) || v.as_ref().contains(&0) {
            return Err(invalid(
                "env",
                format!("invalid environment variable {k:?}"),
            ));
        }
    }
    Ok(())
}

/// `cpu_quota` is a finite fraction of at least [`MIN_CPU_QUOTA`] and at most [`MAX_VCPUS`]
/// CPUs; `pids_max` leaves room for the VMM's own tasks (`vcpus` + [`VMM_BASE_TASKS`]) and is
/// at most [`MAX_PIDS`].
///
/// # Errors
/// [`SpecError::Invalid`].
pub fn check_limits(limits: &ResourceLimits, vcpus: u8) -> Result<(), SpecError> {
    if let Some(q) = limits.cpu_quota {
        let max = f64::from(MAX_VCPUS);
        if !q.is_finite() || !(MIN_CPU_QUOTA..=max).contains(&q) {
            return Err(invalid(
                "cpu_quota",
                format!("must be between {MIN_CPU_QUOTA} and {max} (a fraction of one host CPU)"),
            ));
        }
    }
    if let Some(pids) = limits.pids_max {
        let min = min_pids(vcpus);
        if !(min..=MAX_PIDS).contains(&pids) {
            return Err(invalid(
                "pids_max",
                format!("must be between {min} (vCPUs + {VMM_BASE_TASKS}) and {MAX_PIDS}"),
            ));
        }
    }
    Ok(())
}

/// The fewest tasks a VMM with `vcpus` vCPUs needs.
pub fn min_pids(vcpus: u8) -> u32 {
    u32::from(vcpus) + VMM_BASE_TASKS
}

fn check_labels(labels: &BTreeMap<String, String>) -> Result<(), SpecError> {
    if labels.len() > MAX_LABELS {
        return Err(invalid("labels", format!("at most {MAX_LABELS} labels")));
    }
    for (k, v) in labels {
        if k.is_empty() || k.len() > MAX_LABEL_LEN || v.len() > MAX_LABEL_LEN || k.contains('=') {
            return Err(invalid(
                "labels",
                format!(
                    "label keys must be 1..={MAX_LABEL_LEN} bytes without '=', values at most \
                     {MAX_LABEL_LEN} bytes"
                ),
            ));
        }
    }
    Ok(())
}

/// One guest kernel parameter: non-empty, no white space (which would split it) or NUL, and not
/// a `bulkhead.` key (those are the agent's boot parameters, see
/// [`bulkhead_protocol::boot`]).
///
/// # Errors
/// [`SpecError::Invalid`].
pub fn check_kernel_arg(arg: &str) -> Result<(), SpecError> {
    if arg.is_empty() || arg.chars().any(|c| c.is_whitespace() || c == '\0') {
        return Err(invalid(
            "kernel_args",
            format!(
                "{arg:?} is not one kernel parameter (it must be non-empty, without spaces); \
                 give one parameter each"
            ),
        ));
    }
    if is_bulkhead_param(arg) {
        return Err(invalid(
            "kernel_args",
            format!(
                "{arg:?}: the `bulkhead.` keys are the guest agent's boot parameters, set from \
                 the sandbox's settings"
            ),
        ));
    }
    Ok(())
}

/// A kernel name: 1 to [`MAX_KERNEL_NAME`] bytes of `[A-Za-z0-9._-]`, not starting with `.`
/// (so it names a file inside the kernels directory and nothing else).
fn check_kernel_name(name: &str) -> Result<(), SpecError> {
    let safe = !name.is_empty()
        && !name.starts_with('.')
        && name.len() <= MAX_KERNEL_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    match safe {
        true => Ok(()),
        false => Err(invalid(
            "kernel",
            "kernel names are 1-128 characters of [A-Za-z0-9._-], not starting with '.'",
        )),
    }
}

#[cfg(test)]
mod tests;
