//! [`build`]: a [`SandboxSpec`] on a host ([`HostSettings`]) becomes a [`Recipe`]: the VM's
//! configuration and disks, the defaults of every command, and the VMM's host limits.

use std::collections::BTreeMap;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::time::Duration;

use bulkhead_egress::policy::SecretValues;
use bulkhead_image::{ImageStore, StoreError};
use bulkhead_protocol::{ByteString, ExecRequest};
use bulkhead_vmm::config::SerialOutput;
use serde::{Deserialize, Serialize};

use super::{invalid, min_pids, FileRef, ResourceLimits, SandboxSpec, SpecError};
use crate::cgroup::VmLimits;
use crate::egress::EgressSettings;
use crate::mounts::{self, Mount};
use crate::sandbox::SandboxConfig;
use crate::storage::{self, Storage};
use crate::workspace::{self, Workspace, GUEST_DIR};
use crate::{jail, paths};

/// Length of a sandbox ID, hex digits (48 random bits).
pub const ID_LEN: usize = 12;

/// `PATH` of every command unless its environment sets one.
pub const BASE_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// `TERM` of every command unless its environment sets one: the commands have no terminal.
pub const BASE_TERM: &str = "dumb";

/// `HOME` of commands that run as root unless their environment sets one (for another user the
/// agent takes it from the guest's `/etc/passwd`).
pub const ROOT_HOME: &str = "/root";

/// A fresh sandbox ID: [`ID_LEN`] lower-case hex digits from `/dev/urandom`.
///
/// # Errors
/// When `/dev/urandom` cannot be read.
pub fn new_id() -> io::Result<String> {
    let mut bytes = [0u8; ID_LEN / 2];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// How this host runs sandboxes: everything a spec does not say.
#[derive(Debug, Clone)]
pub struct HostSettings {
    /// The kernel when a spec names none.
    pub kernel: PathBuf,
    /// Where kernel names ([`FileRef::Name`]) resolve: `<kernels_dir>/<name>`. `None`: this host
    /// takes no kernel names.
    pub kernels_dir: Option<PathBuf>,
    /// The initramfs every VM boots (the agent as `/init`).
    pub initrd: PathBuf,
    /// Where image names resolve.
    pub images: ImageStore,
    /// Whether a spec may name host paths: kernel and image paths, data disks; and a mount or
    /// workspace anywhere (else only inside `mount_roots`). `bulkhead run` and the library:
    /// yes; the daemon: no (its clients are not the host's users).
    pub allow_host_paths: bool,
    /// Without `allow_host_paths`: the only directories (and their descendants) a mount or
    /// workspace may share.
    pub mount_roots: Vec<PathBuf>,
    /// The `bulkhead-vmm` binary.
    pub vmm_binary: PathBuf,
    /// Parent of the sandboxes' runtime directories.
    pub runtime_dir: PathBuf,
    /// How long to wait for the agent to announce itself.
    pub ready_timeout: Duration,
    /// Where the guest's serial console goes.
    pub console: SerialOutput,
    /// Stop the VMM when the starting process exits (`bulkhead run`), or let it outlive it (the
    /// daemon, whose restarts adopt running VMs).
    pub kill_on_parent_exit: bool,
    /// Jail the VMM when running as root.
    pub jail: bool,
    /// Memory the VMM process itself may use besides guest RAM, MiB (its cgroup limit is guest
    /// RAM plus this).
    pub vmm_memory_overhead_mib: u32,
    /// The runtime directory is in RAM (tmpfs): a scratch disk there counts toward the VMM's
    /// memory limit.
    pub scratch_in_ram: bool,
    /// `pids_max` when a spec names none (raised to what the vCPUs need).
    pub default_pids_max: u32,
    /// The values of the secrets a network policy may name (`bulkhead run`: from its
    /// environment or `--secret-file`; the daemon: its `[secrets]`). They stay on the host: the
    /// guest sees only placeholders.
    pub secrets: SecretValues,
    /// Where a sandbox's egress log goes; `egress.jsonl` in its runtime directory when `None`.
    pub egress_log: Option<PathBuf>,
}

impl HostSettings {
    /// This machine's defaults for a process that starts its own sandboxes (`bulkhead run`,
    /// the library): the data directory's kernel, initramfs and images, `$BULKHEAD_*`
    /// overrides, host paths allowed, the VMM stopped with its starter.
    pub fn local() -> HostSettings {
        HostSettings {
            kernel: paths::default_kernel(),
            kernels_dir: None,
            initrd: paths::default_initrd(),
            images: ImageStore::new(paths::data_dir()),
            allow_host_paths: true,
            mount_roots: Vec::new(),
            vmm_binary: paths::vmm_binary(),
            runtime_dir: paths::runtime_dir(),
            ready_timeout: Duration::from_secs(60),
            console: SerialOutput::Off,
            kill_on_parent_exit: true,
            jail: jail::wanted_by_default(),
            vmm_memory_overhead_mib: super::DEFAULT_VMM_MEMORY_OVERHEAD_MIB,
            scratch_in_ram: false,
            default_pids_max: super::DEFAULT_PIDS_MAX,
            secrets: SecretValues::new(),
            egress_log: None,
        }
    }
}

/// Everything needed to start one sandbox and run its commands.
#[derive(Debug, Clone)]
pub struct Recipe {
    /// The sandbox's ID.
    pub id: String,
    /// The VM.
    pub config: SandboxConfig,
    /// Its disks.
    pub storage: Storage,
    /// The defaults of every command.
    pub exec: ExecDefaults,
    /// The VMM's host limits (applied where cgroups are used): the spec's, with defaults.
    pub limits: VmLimits,
    /// The limits the spec asked for (a front end may apply limits only when asked).
    pub requested_limits: ResourceLimits,
}

/// What every command in a sandbox starts with, unless the command says otherwise.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecDefaults {
    /// The network's variables (proxy, CA bundle, secret placeholders), once the sandbox runs
    /// ([`ExecDefaults::with_network`]); between the base and the sandbox's environment.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub network: BTreeMap<String, String>,
    /// The sandbox's environment (over the base `PATH`, `TERM` and, for root, `HOME`).
    pub env: BTreeMap<String, String>,
    /// Working directory.
    pub cwd: Option<String>,
    /// User.
    pub user: Option<String>,
}

impl ExecDefaults {
    /// The defaults of `spec`: its environment and user; its working directory, else
    /// `/workspace` when it has a workspace.
    pub fn of(spec: &SandboxSpec) -> ExecDefaults {
        let cwd = match (&spec.workdir, &spec.workspace) {
            (Some(dir), _) => Some(dir.clone()),
            (None, Some(_)) => Some(GUEST_DIR.to_owned()),
            (None, None) => None,
        };
        ExecDefaults {
            network: BTreeMap::new(),
            env: spec.env.clone(),
            cwd,
            user: spec.user.clone(),
        }
    }

    /// These defaults with the running sandbox's network variables
    /// ([`crate::Sandbox::egress_env`]).
    pub fn with_network(mut self, env: Vec<(String, String)>) -> ExecDefaults {
        self.network = env.into_iter().collect();
        self
    }

    /// The agent's request for `argv`: environment `PATH`, `TERM=dumb` and, when it runs as
    /// root, `HOME=/root`, then the network's variables, then the sandbox's environment, then
    /// `env`; `cwd` and `user` when
    /// given, else the defaults. No stdin, no timeout, `docker exec` semantics for the end
    /// (`kill_group_on_exit: false`): callers change those fields.
    pub fn request<A: Into<ByteString>>(
        &self,
        argv: impl IntoIterator<Item = A>,
        env: &BTreeMap<String, ByteString>,
        cwd: Option<&ByteString>,
        user: Option<&str>,
    ) -> ExecRequest {
        let user = user.map(str::to_owned).or_else(|| self.user.clone());
        let text = |(k, v): (&String, &String)| (k.clone(), ByteString::from(v));
        let mut all = BTreeMap::from([
            ("PATH".to_owned(), ByteString::from(BASE_PATH)),
            ("TERM".to_owned(), ByteString::from(BASE_TERM)),
        ]);
        if user.is_none() {
            all.insert("HOME".to_owned(), ByteString::from(ROOT_HOME));
        }
        all.extend(self.network.iter().map(text));
        all.extend(self.env.iter().map(text));
        all.extend(env.iter().map(|(k, v)| (k.clone(), v.clone())));
        let mut request = ExecRequest::new(argv);
        request.env = all
            .into_iter()
            .map(|(k, v)| {
                let mut entry = k.into_bytes();
                entry.push(b'=');
                entry.extend_from_slice(v.as_bytes());
                ByteString::from(entry)
            })
            .collect();
        request.cwd = cwd
            .cloned()
            .or_else(|| self.cwd.as_deref().map(ByteString::from));
        request.user = user;
        request
    }
}

/// The guest hostname of sandbox `id` under `spec`: the spec's, or `bh-<id>`.
pub fn hostname_of(spec: &SandboxSpec, id: &str) -> String {
    spec.hostname.clone().unwrap_or_else(|| format!("bh-{id}"))
}

/// Validates `spec`, resolves what it names on `host` (kernel, image, disks, shares), checks the
/// files the VM needs, and returns the sandbox `id`'s recipe. Nothing is started or created.
///
/// # Errors
/// [`SpecError`] naming the first problem.
pub fn build(spec: &SandboxSpec, host: &HostSettings, id: &str) -> Result<Recipe, SpecError> {
    spec.validate()?;
    let kernel = resolve_kernel(spec.kernel.as_ref(), host)?;
    let storage = Storage {
        root_image: spec
            .image
            .as_ref()
            .map(|image| resolve_image(image, host))
            .transpose()?,
        scratch_mib: spec.disk_mib,
        data_disks: data_disks(spec, host)?,
    };
    storage::check(&storage, &host.runtime_dir)?;
    let (mounts, workspace) = resolve_shares(spec, host)?;
    let hostname = hostname_of(spec, id);
    let mut config = config_of(spec, host, kernel, Some(hostname));
    config.mounts = mounts;
    config.workspace = workspace;
    config.egress = egress_settings(spec, host)?;
    config
        .check_files()
        .map_err(|e| SpecError::File(Box::new(e)))?;
    Ok(Recipe {
        id: id.to_owned(),
        config,
        storage,
        exec: ExecDefaults::of(spec),
        limits: limits_of(spec, host),
        requested_limits: spec.limits,
    })
}

/// The VM configuration of `spec` on `host` with `kernel` and `hostname`, before its shares are
/// checked: the one place a [`SandboxConfig`] is made.
pub(crate) fn config_of(
    spec: &SandboxSpec,
    host: &HostSettings,
    kernel: PathBuf,
    hostname: Option<String>,
) -> SandboxConfig {
    SandboxConfig {
        kernel,
        initrd: host.initrd.clone(),
        vcpus: spec.vcpus,
        memory_mib: spec.memory_mib,
        extra_cmdline: spec.kernel_args.clone(),
        hostname,
        console: host.console.clone(),
        vmm_binary: host.vmm_binary.clone(),
        runtime_dir: host.runtime_dir.clone(),
        ready_timeout: host.ready_timeout,
        kill_on_parent_exit: host.kill_on_parent_exit,
        cgroup_procs: Vec::new(),
        mounts: spec.mounts.clone(),
        workspace: spec.workspace.clone(),
        jail: host.jail,
        egress: None,
        share_slots: 0,
        jail_owner: None,
        follow_host_mounts: false,
    }
}

/// The egress proxy's settings for `spec`'s network: its policy compiled with the host's secret
/// values (unknown secrets, malformed rules and presets are errors here, before anything
/// starts); `None` without a network. [`build`] uses it, and so does a process that adopts a
/// running sandbox and restarts its proxy ([`crate::Sandbox::start_network`]).
///
/// # Errors
/// [`SpecError`] for an unknown secret or a malformed rule or preset.
pub fn egress_settings(
    spec: &SandboxSpec,
    host: &HostSettings,
) -> Result<Option<EgressSettings>, SpecError> {
    let Some(network) = spec.network.as_ref().filter(|_| spec.has_network()) else {
        return Ok(None);
    };
    Ok(Some(EgressSettings {
        policy: network.compile(&host.secrets)?,
        hosts: spec.extra_hosts.clone(),
        log: host.egress_log.clone(),
    }))
}

/// The VMM's cgroup limits: guest RAM plus the VMM's allowance (plus a scratch disk that lives
/// in host RAM), the CPU quota, and the task limit (the host's default, at least what the vCPUs
/// need).
pub fn limits_of(spec: &SandboxSpec, host: &HostSettings) -> VmLimits {
    let scratch_in_ram = match (host.scratch_in_ram, spec.image.is_some()) {
        (true, true) => spec.disk_mib.unwrap_or(0),
        _ => 0,
    };
    let memory_mib = u64::from(spec.memory_mib)
        .saturating_add(u64::from(host.vmm_memory_overhead_mib))
        .saturating_add(scratch_in_ram);
    VmLimits {
        memory_bytes: memory_mib.saturating_mul(1 << 20),
        cpu_quota: spec.limits.cpu_quota,
        pids_max: spec
            .limits
            .pids_max
            .unwrap_or(host.default_pids_max.max(min_pids(spec.vcpus))),
    }
}

fn resolve_kernel(kernel: Option<&FileRef>, host: &HostSettings) -> Result<PathBuf, SpecError> {
    match kernel {
        None => Ok(host.kernel.clone()),
        Some(FileRef::Path(path)) => {
            require_host_paths(host, "kernel")?;
            Ok(path.clone())
        }
        Some(FileRef::Name(name)) => {
            let Some(dir) = &host.kernels_dir else {
                return Err(SpecError::NotAllowed {
                    what: "kernel",
                    reason: "this host has no kernels directory; leave kernel out for the default"
                        .to_owned(),
                });
            };
            let path = dir.join(name);
            if !path.is_file() {
                return Err(SpecError::UnknownName {
                    what: "kernel",
                    name: name.clone(),
                    known: file_names(dir),
                    where_: format!("the kernels directory {}", dir.display()),
                    hint: "a kernel is a file there".to_owned(),
                });
            }
            Ok(path)
        }
    }
}

/// The names of the regular files in `dir`, sorted.
fn file_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().is_file())
        .filter_map(|e| e.file_name().to_str().map(str::to_owned))
        .collect();
    names.sort();
    names
}

/// The ext4 file of an image: a path (where allowed), or an image of the store; a name the
/// store does not have may, where host paths are allowed, be a file of that name in the
/// working directory.
fn resolve_image(image: &FileRef, host: &HostSettings) -> Result<PathBuf, SpecError> {
    let name = match image {
        FileRef::Path(path) => {
            require_host_paths(host, "image")?;
            return Ok(path.clone());
        }
        FileRef::Name(name) => name,
    };
    let store = &host.images;
    match store.get(name) {
        Ok(image) => Ok(image.rootfs),
        Err(StoreError::NotFound { .. } | StoreError::Spec(_))
            if host.allow_host_paths && Path::new(name).is_file() =>
        {
            Ok(PathBuf::from(name))
        }
        Err(StoreError::Spec(e)) => Err(invalid("image", e.to_string())),
        Err(StoreError::NotFound { .. }) => Err(SpecError::UnknownName {
            what: "image",
            name: name.clone(),
            known: store
                .list()
                .unwrap_or_default()
                .into_iter()
                .map(|m| m.name)
                .collect(),
            where_: format!("the image store at {}", store.images_dir().display()),
            hint: format!("`bulkhead image build debian --name {name}` builds one"),
        }),
        Err(StoreError::NotAnImage { .. }) => Err(invalid(
            "image",
            format!(
                "{name:?} is not an image of the image store (its directory has no \
                 manifest.json)"
            ),
        )),
        Err(other) => Err(SpecError::Store(other.to_string())),
    }
}

fn data_disks(
    spec: &SandboxSpec,
    host: &HostSettings,
) -> Result<Vec<bulkhead_vmm::config::DiskConfig>, SpecError> {
    if !spec.disk_files.is_empty() {
        require_host_paths(host, "disk_files")?;
    }
    Ok(spec.disk_files.clone())
}

fn require_host_paths(host: &HostSettings, what: &'static str) -> Result<(), SpecError> {
    match host.allow_host_paths {
        true => Ok(()),
        false => Err(SpecError::NotAllowed {
            what,
            reason: "this host takes names, not host paths".to_owned(),
        }),
    }
}

/// The mounts and workspace of `spec`, host paths resolved (inside the host's `mount_roots`
/// unless host paths are allowed) and checked together: what [`build`] puts in its recipe, and
/// what a restore from a snapshot attaches to the snapshot's share slots.
///
/// # Errors
/// [`SpecError`] for a path outside the mount roots or an unusable mount or workspace.
pub fn resolve_shares(
    spec: &SandboxSpec,
    host: &HostSettings,
) -> Result<(Vec<Mount>, Option<Workspace>), SpecError> {
    let shares_any = !spec.mounts.is_empty() || spec.workspace.is_some();
    if !host.allow_host_paths && shares_any {
        let roots = existing_roots(&host.mount_roots)?;
        for (i, m) in spec.mounts.iter().enumerate() {
            inside_roots(&m.host, &format!("mounts[{i}].host"), &roots)?;
        }
        if let Some(ws) = &spec.workspace {
            inside_roots(&ws.host, "workspace.path", &roots)?;
        }
    }
    let mounts = mounts::check(&spec.mounts)?;
    workspace::check(spec.workspace.as_ref(), &mounts)?;
    let workspace = spec.workspace.as_ref().map(|ws| Workspace {
        host: ws.host.canonicalize().unwrap_or_else(|_| ws.host.clone()),
        mode: ws.mode,
    });
    Ok((mounts, workspace))
}

/// The host's mount roots that exist, resolved; an error when there are none (nothing may be
/// shared).
fn existing_roots(roots: &[PathBuf]) -> Result<Vec<PathBuf>, SpecError> {
    let roots: Vec<PathBuf> = roots.iter().filter_map(|r| r.canonicalize().ok()).collect();
    if roots.is_empty() {
        return Err(SpecError::NotAllowed {
            what: "mounts",
            reason: "this host shares no host directories (no mount_roots, or none of them \
                     exists)"
                .to_owned(),
        });
    }
    Ok(roots)
}

/// `path` is absolute and resolves to a directory inside one of `roots`.
fn inside_roots(path: &Path, field: &str, roots: &[PathBuf]) -> Result<(), SpecError> {
    let shown = path.display();
    if !path.is_absolute() {
        return Err(invalid(
            field,
            format!("{shown:?} must be an absolute host path"),
        ));
    }
    let resolved = match path.canonicalize() {
        Ok(p) => p,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(invalid(field, format!("{shown:?} does not exist")))
        }
        Err(e) => return Err(invalid(field, format!("{shown:?}: {e}"))),
    };
    if !roots.iter().any(|root| resolved.starts_with(root)) {
        return Err(invalid(
            field,
            format!("{shown:?} is outside the directories this host may share (mount_roots)"),
        ));
    }
    if !resolved.is_dir() {
        return Err(invalid(field, format!("{shown:?} is not a directory")));
    }
    Ok(())
}
