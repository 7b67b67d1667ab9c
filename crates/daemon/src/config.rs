//! The daemon's configuration: a TOML file (every key optional, unknown keys rejected) overridden
//! by command-line flags. Defaults are documented on each field and in `docs/daemon.md`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::cgroup::CgroupMode;

/// Default API socket.
pub const DEFAULT_SOCKET: &str = "/run/bulkhead/bulkheadd.sock";
/// Default state directory.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/bulkhead";

/// Errors of loading the configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read the configuration file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file is not valid TOML for this configuration.
    #[error("invalid configuration file {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What is wrong, with its position.
        message: String,
    },
    /// A value is out of range.
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

/// What happens to running sandboxes when the daemon stops (SIGTERM/SIGINT).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShutdownPolicy {
    /// Destroy every sandbox (VMM, cgroup, files, state).
    Destroy,
    /// Leave them running, recorded in the state dir, for the next start to adopt.
    Leave,
}

/// What a starting daemon does with sandboxes recorded by an earlier run whose VMM still runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RestartPolicy {
    /// Take them over: they keep running and serving.
    Adopt,
    /// Destroy them.
    Destroy,
}

/// The daemon's settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// API socket. Default `/run/bulkhead/bulkheadd.sock`. Ignored under socket activation.
    pub socket: PathBuf,
    /// Permission bits of the socket. Default `0o660`.
    pub socket_mode: u32,
    /// Group owning the socket (name or numeric gid); members may use the API. Default: the
    /// daemon's group.
    pub socket_group: Option<String>,
    /// Where sandbox records live (`sandboxes/<id>.json`). Default `/var/lib/bulkhead`.
    pub state_dir: PathBuf,
    /// Parent of the VMs' runtime directories (`vms/<id>/`: vsock sockets, VM config, VMM log).
    /// Default: the socket's directory.
    pub runtime_dir: Option<PathBuf>,
    /// The `bulkhead-vmm` binary. Default: `$BULKHEAD_VMM`, else next to `bulkheadd`, else `PATH`.
    pub vmm_binary: PathBuf,
    /// Default guest kernel. Default `$BULKHEAD_KERNEL` or `<data dir>/kernel/<arch>/vmlinux`
    /// (`Image` on aarch64).
    pub kernel: PathBuf,
    /// The initramfs every VM boots (the agent as `/init`; with a root filesystem image it
    /// mounts the image and moves into it). Default `$BULKHEAD_INITRD` or
    /// `<data dir>/images/default/initramfs.cpio.lz4`.
    pub image: PathBuf,
    /// Directory of named kernels (`kernel: "NAME"` → `<kernels_dir>/NAME`). Default: none.
    pub kernels_dir: Option<PathBuf>,
    /// The image store's directory: `image: "NAME"` in a create request boots the root
    /// filesystem image `<images_dir>/NAME/rootfs.ext4` built by `bulkhead image build`.
    /// Default: `<data dir>/images`, the store `bulkhead image ls` shows with the daemon's
    /// environment (`$BULKHEAD_DATA_DIR`, else `${XDG_DATA_HOME:-~/.local/share}/bulkhead`).
    pub images_dir: Option<PathBuf>,
    /// Largest per-sandbox scratch disk (`disk_mib`), MiB. Default 65536.
    pub max_disk_mib: u64,
    /// On SIGTERM: `destroy` (default) or `leave` the sandboxes.
    pub on_shutdown: ShutdownPolicy,
    /// On start, for sandboxes of an earlier run that still run: `adopt` (default) or `destroy`.
    pub on_restart: RestartPolicy,
    /// cgroup support: `auto` (default), `v1`, `v2` or `off`.
    pub cgroups: CgroupMode,
    /// Parent cgroup of the VMs' cgroups (`<parent>/vm-<id>`), relative to the hierarchy root.
    /// Default: v2 — the daemon's own cgroup (it moves itself into `<own>/daemon`, as systemd's
    /// `Delegate=yes` requires), or `bulkhead` when the daemon is in the root cgroup; v1 —
    /// `bulkhead`.
    pub cgroup_parent: Option<String>,
    /// Memory the VMM process may use beyond guest RAM, MiB (its own heap, thread stacks,
    /// vCPU and device state, KVM's accounted kernel memory, page cache of the files it reads).
    /// Default 64.
    pub vmm_memory_overhead_mib: u32,
    /// `pids.max` of a VMM whose request sets none. Default 64.
    pub default_pids_max: u32,
    /// Most vCPUs per sandbox. Default 32.
    pub max_vcpus: u8,
    /// Most guest RAM per sandbox, MiB; the host's available memory also caps it. Default 65536.
    pub max_memory_mib: u32,
    /// Most sandboxes at once. Default 256.
    pub max_sandboxes: usize,
    /// Longest TTL a request may ask for, seconds; None: unlimited. Default: none.
    pub max_ttl_s: Option<u64>,
    /// How long a VM may take to boot until its agent is ready, seconds (counted from the start
    /// of its boot, after any wait for a boot slot). Default 60.
    pub boot_timeout_s: u64,
    /// Most VMs booting at once; further creates wait (in state `creating`) for a slot. Boots
    /// are CPU-bound: booting far more guests than the host has CPUs makes every one of them
    /// slower (in the nested test host, with its costly VM exits, 6+ simultaneous boots on 2 CPUs
    /// made no progress for minutes). Default: the host's CPU count.
    pub max_concurrent_boots: Option<usize>,
    /// Largest file accepted by `PUT .../files`, bytes. Default 1 GiB.
    pub max_file_bytes: u64,
    /// Largest output (stdout + stderr) of `POST .../exec/collect`, bytes. Default 16 MiB.
    pub max_collect_bytes: u64,
    /// Host directories under which create requests may share directories into sandboxes
    /// (`workspace`, `mounts`; symbolic links resolved before the check). Anyone who may use
    /// the API can read (and, for read-write shares, change) what is below them, with the
    /// daemon's rights. Default: none, so requests cannot share host directories.
    pub mount_roots: Vec<PathBuf>,
    /// Secrets a sandbox's network policy may name (`"secrets": [{"name", "hosts"}]` in a
    /// create request): `NAME = { env = "VAR" }` (the daemon's environment variable VAR) or
    /// `NAME = { file = "/path" }` (one trailing newline dropped), read at each create. The
    /// egress proxy injects a value into the request headers of the hosts the request names,
    /// in place of a placeholder; the value never enters a VM and no API call returns it.
    pub secrets: BTreeMap<String, SecretSource>,
    /// The warm pool (`[pool]`): clones of one template kept restored and idle, handed out to
    /// creates that name it. Default: none.
    pub pool: Option<PoolConfig>,
}

/// Most clones a warm pool may keep.
pub const MAX_POOL_SIZE: usize = 64;

/// `[pool]`: keep `size` clones of template `template` restored and idle.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// The template's name (`<state_dir>/templates/NAME`); it must exist when the daemon starts.
    pub template: String,
    /// How many idle clones to keep: 1 to [`MAX_POOL_SIZE`], at most `max_sandboxes`.
    pub size: usize,
    /// `[uid, gid]` the clones' jailed VMMs run as (instead of fresh ids), so that creates
    /// with mounts or a workspace of that owner can be handed a clone (a jailed VMM serves
    /// shares as one user, chosen when it starts); not root. Without it, a create with shares
    /// that a fresh id cannot serve as a boot would (anything but root-owned read-only
    /// directories) takes the normal restore path. No effect without the jail.
    #[serde(default)]
    pub share_owner: Option<(u32, u32)>,
}

/// Where the value of a configured secret comes from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum SecretSource {
    /// The daemon's environment variable of this name.
    Env(String),
    /// A file's contents (one trailing newline dropped).
    File(PathBuf),
}

impl SecretSource {
    /// The value now.
    ///
    /// # Errors
    /// A message naming the variable or file.
    pub fn read(&self) -> Result<String, String> {
        match self {
            SecretSource::Env(var) => std::env::var(var)
                .map_err(|_| format!("the daemon has no environment variable {var}")),
            SecretSource::File(path) => std::fs::read_to_string(path)
                .map(|text| text.strip_suffix('\n').unwrap_or(&text).to_owned())
                .map_err(|e| format!("{}: {e}", path.display())),
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            socket: PathBuf::from(DEFAULT_SOCKET),
            socket_mode: 0o660,
            socket_group: None,
            state_dir: PathBuf::from(DEFAULT_STATE_DIR),
            runtime_dir: None,
            vmm_binary: bulkhead_sandbox::paths::vmm_binary(),
            kernel: bulkhead_sandbox::paths::default_kernel(),
            image: bulkhead_sandbox::paths::default_initrd(),
            kernels_dir: None,
            images_dir: None,
            secrets: BTreeMap::new(),
            max_disk_mib: 65536,
            on_shutdown: ShutdownPolicy::Destroy,
            on_restart: RestartPolicy::Adopt,
            cgroups: CgroupMode::Auto,
            cgroup_parent: None,
            vmm_memory_overhead_mib: bulkhead_sandbox::spec::DEFAULT_VMM_MEMORY_OVERHEAD_MIB,
            default_pids_max: bulkhead_sandbox::spec::DEFAULT_PIDS_MAX,
            max_vcpus: 32,
            max_memory_mib: 65536,
            max_sandboxes: 256,
            max_ttl_s: None,
            boot_timeout_s: 60,
            max_concurrent_boots: None,
            max_file_bytes: 1 << 30,
            max_collect_bytes: 16 << 20,
            mount_roots: Vec::new(),
            pool: None,
        }
    }
}

/// Command-line overrides of the configuration file.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct Overrides {
    /// API socket [default: /run/bulkhead/bulkheadd.sock].
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// State directory [default: /var/lib/bulkhead].
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// Parent of the VMs' runtime directories [default: the socket's directory].
    #[arg(long, value_name = "DIR")]
    pub runtime_dir: Option<PathBuf>,
    /// The bulkhead-vmm binary.
    #[arg(long, value_name = "PATH")]
    pub vmm: Option<PathBuf>,
    /// Default guest kernel.
    #[arg(long, value_name = "PATH")]
    pub kernel: Option<PathBuf>,
    /// The initramfs every VM boots (the agent as /init).
    #[arg(long, value_name = "PATH")]
    pub image: Option<PathBuf>,
    /// cgroup support: auto, v1, v2 or off.
    #[arg(long, value_name = "MODE")]
    pub cgroups: Option<CgroupMode>,
    /// Parent cgroup of the VMs' cgroups.
    #[arg(long, value_name = "PATH")]
    pub cgroup_parent: Option<String>,
    /// On SIGTERM: destroy or leave the sandboxes.
    #[arg(long, value_name = "POLICY", value_parser = parse_shutdown)]
    pub on_shutdown: Option<ShutdownPolicy>,
    /// On start: adopt or destroy sandboxes of an earlier run.
    #[arg(long, value_name = "POLICY", value_parser = parse_restart)]
    pub on_restart: Option<RestartPolicy>,
    /// A host directory below which requests may share directories (repeatable; replaces the
    /// file's `mount_roots`).
    #[arg(long = "mount-root", value_name = "DIR")]
    pub mount_roots: Vec<PathBuf>,
}

fn parse_shutdown(s: &str) -> Result<ShutdownPolicy, String> {
    match s {
        "destroy" => Ok(ShutdownPolicy::Destroy),
        "leave" => Ok(ShutdownPolicy::Leave),
        _ => Err(format!("`{s}`: expected destroy or leave")),
    }
}

fn parse_restart(s: &str) -> Result<RestartPolicy, String> {
    match s {
        "adopt" => Ok(RestartPolicy::Adopt),
        "destroy" => Ok(RestartPolicy::Destroy),
        _ => Err(format!("`{s}`: expected adopt or destroy")),
    }
}

impl Config {
    /// Reads `path` (TOML).
    ///
    /// # Errors
    /// [`ConfigError::Read`], [`ConfigError::Parse`] (including unknown keys).
    pub fn from_file(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.to_owned(),
            message: e.to_string(),
        })
    }

    /// The file at `path` (or the defaults) with `overrides` applied, validated.
    ///
    /// # Errors
    /// As [`Config::from_file`], and [`ConfigError::Invalid`].
    pub fn load(path: Option<&Path>, overrides: &Overrides) -> Result<Config, ConfigError> {
        let mut config = match path {
            Some(path) => Config::from_file(path)?,
            None => Config::default(),
        };
        check_override_files(overrides)?;
        config.apply(overrides);
        config.validate()?;
        Ok(config)
    }

    fn apply(&mut self, o: &Overrides) {
        let set = |slot: &mut PathBuf, value: &Option<PathBuf>| {
            if let Some(v) = value {
                slot.clone_from(v);
            }
        };
        set(&mut self.socket, &o.socket);
        set(&mut self.state_dir, &o.state_dir);
        set(&mut self.vmm_binary, &o.vmm);
        set(&mut self.kernel, &o.kernel);
        set(&mut self.image, &o.image);
        if o.runtime_dir.is_some() {
            self.runtime_dir.clone_from(&o.runtime_dir);
        }
        if let Some(mode) = o.cgroups {
            self.cgroups = mode;
        }
        if o.cgroup_parent.is_some() {
            self.cgroup_parent.clone_from(&o.cgroup_parent);
        }
        if let Some(p) = o.on_shutdown {
            self.on_shutdown = p;
        }
        if let Some(p) = o.on_restart {
            self.on_restart = p;
        }
        if !o.mount_roots.is_empty() {
            self.mount_roots.clone_from(&o.mount_roots);
        }
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |m: &str| Err(ConfigError::Invalid(m.to_owned()));
        if self.socket_mode > 0o777 {
            return invalid("socket_mode must be at most 0o777");
        }
        if self.max_vcpus == 0 || self.max_memory_mib < 16 || self.max_sandboxes == 0 {
            return invalid("max_vcpus, max_memory_mib (≥ 16) and max_sandboxes must be positive");
        }
        if self.default_pids_max < 8 {
            return invalid("default_pids_max must be at least 8 (the VMM needs a few threads)");
        }
        if self.boot_timeout_s == 0 {
            return invalid("boot_timeout_s must be positive");
        }
        if self.max_disk_mib < bulkhead_sandbox::storage::MIN_SCRATCH_MIB {
            return invalid("max_disk_mib must be at least 8 (the smallest scratch disk)");
        }
        if self.max_concurrent_boots == Some(0) {
            return invalid("max_concurrent_boots must be positive");
        }
        if self.mount_roots.iter().any(|r| !r.is_absolute()) {
            return invalid("mount_roots must be absolute paths");
        }
        if let Some(pool) = &self.pool {
            self.validate_pool(pool)?;
        }
        Ok(())
    }

    /// The pool's size and template name (that the template exists and is readable is
    /// checked when the daemon starts, in its state directory).
    fn validate_pool(&self, pool: &PoolConfig) -> Result<(), ConfigError> {
        if !(1..=MAX_POOL_SIZE).contains(&pool.size) {
            return Err(ConfigError::Invalid(format!(
                "pool.size must be between 1 and {MAX_POOL_SIZE}, not {}",
                pool.size
            )));
        }
        if pool.size > self.max_sandboxes {
            return Err(ConfigError::Invalid(format!(
                "pool.size {} exceeds max_sandboxes {} (pool clones count against it)",
                pool.size, self.max_sandboxes
            )));
        }
        if let Some((uid, gid)) = pool.share_owner {
            if uid == 0 || gid == 0 {
                return Err(ConfigError::Invalid(format!(
                    "pool.share_owner must not be root, not [{uid}, {gid}]"
                )));
            }
        }
        if !crate::manager::templates::is_valid_name(&pool.template) {
            return Err(ConfigError::Invalid(format!(
                "pool.template: invalid template name {:?}",
                pool.template
            )));
        }
        Ok(())
    }

    /// How many VMs may boot at once: `max_concurrent_boots`, else the host's CPU count.
    pub fn boot_slots(&self) -> usize {
        self.max_concurrent_boots.unwrap_or_else(|| {
            std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
        })
    }

    /// The image store that `image` names in create requests resolve in (see
    /// [`Config::images_dir`]).
    pub fn image_store(&self) -> bulkhead_image::ImageStore {
        match &self.images_dir {
            Some(dir) => bulkhead_image::ImageStore::at_images_dir(dir),
            None => bulkhead_image::ImageStore::new(bulkhead_sandbox::paths::data_dir()),
        }
    }

    /// Where `template` in create requests resolves: `<state_dir>/templates/NAME/`, a snapshot
    /// directory as `bulkhead template create` makes (`state`, `memory`, `sandbox.json`),
    /// copied or created there by an operator.
    pub fn templates_dir(&self) -> PathBuf {
        self.state_dir.join("templates")
    }

    /// Parent of the VMs' runtime directories: `runtime_dir`, else the socket's directory.
    pub fn vm_runtime_root(&self) -> PathBuf {
        let base = match &self.runtime_dir {
            Some(dir) => dir.clone(),
            None => self
                .socket
                .parent()
                .map(Path::to_owned)
                .unwrap_or_else(|| PathBuf::from("/run/bulkhead")),
        };
        base.join("vms")
    }
}

/// Files named on the command line (`--kernel`, `--image`, `--vmm`) must exist: a daemon
/// started with a typo would otherwise come up and fail every `create` that uses the default.
/// Defaults and config-file values are left to `create`, so the daemon can start before
/// `scripts/setup.sh` has installed them.
fn check_override_files(o: &Overrides) -> Result<(), ConfigError> {
    let named = [
        ("--kernel", &o.kernel),
        ("--image", &o.image),
        ("--vmm", &o.vmm),
    ];
    for (flag, path) in named {
        if let Some(path) = path.as_ref().filter(|p| !p.is_file()) {
            return Err(ConfigError::Invalid(format!(
                "{flag} {}: no such file",
                path.display()
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_override_the_file() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("bulkheadd.toml");
        std::fs::write(
            &file,
            "socket = \"/a.sock\"\nsocket_mode = 0o600\non_shutdown = \"leave\"\n",
        )
        .unwrap();
        let overrides = Overrides {
            socket: Some("/b.sock".into()),
            ..Overrides::default()
        };

        // Act
        let config = Config::load(Some(&file), &overrides).unwrap();

        // Assert
        assert_eq!(config.socket, PathBuf::from("/b.sock"));
        assert_eq!(config.socket_mode, 0o600);
        assert_eq!(config.on_shutdown, ShutdownPolicy::Leave);
        assert_eq!(config.vm_runtime_root(), PathBuf::from("/vms"));
    }

    #[test]
    fn a_file_named_on_the_command_line_must_exist() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let kernel = dir.path().join("vmlinux");
        std::fs::write(&kernel, b"kernel").unwrap();
        let existing = Overrides {
            kernel: Some(kernel),
            ..Overrides::default()
        };
        let typo = Overrides {
            image: Some(dir.path().join("initramfs.cpio.lz")),
            ..Overrides::default()
        };

        // Act
        let loaded = Config::load(None, &existing);
        let refused = Config::load(None, &typo).unwrap_err().to_string();

        // Assert
        assert!(loaded.is_ok(), "{loaded:?}");
        assert!(
            refused.contains("--image") && refused.contains("initramfs.cpio.lz: no such file"),
            "{refused}"
        );
    }

    #[test]
    fn the_shipped_example_configuration_is_valid() {
        // Arrange
        let file =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../resources/systemd/bulkheadd.toml");

        // Act
        let config = Config::load(Some(&file), &Overrides::default()).unwrap();

        // Assert
        assert_eq!(config.socket_group.as_deref(), Some("bulkhead"));
        assert_eq!(
            config.vmm_memory_overhead_mib,
            Config::default().vmm_memory_overhead_mib
        );
        assert_eq!(config.on_shutdown, ShutdownPolicy::Destroy);
    }

    #[test]
    fn unknown_keys_are_rejected_with_their_name() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("bulkheadd.toml");
        std::fs::write(&file, "sokcet = \"/a.sock\"\n").unwrap();

        // Act
        let err = Config::load(Some(&file), &Overrides::default()).unwrap_err();

        // Assert
        assert!(err.to_string().contains("sokcet"), "{err}");
    }

    #[test]
    fn boot_slots_default_to_the_cpu_count_and_zero_is_rejected() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let zero = dir.path().join("zero.toml");
        let two = dir.path().join("two.toml");
        std::fs::write(&zero, "max_concurrent_boots = 0\n").unwrap();
        std::fs::write(&two, "max_concurrent_boots = 2\n").unwrap();
        let cpus = std::thread::available_parallelism().unwrap().get();

        // Act
        let default = Config::default().boot_slots();
        let err = Config::load(Some(&zero), &Overrides::default()).unwrap_err();
        let configured = Config::load(Some(&two), &Overrides::default()).unwrap();

        // Assert
        assert_eq!(default, cpus);
        assert!(err.to_string().contains("max_concurrent_boots"), "{err}");
        assert_eq!(configured.boot_slots(), 2);
    }
}
