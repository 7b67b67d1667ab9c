//! The VM configuration: what `bulkhead-vmm --config FILE` reads as JSON and what its flags build.
//!
//! ```json
//! {
//!   "kernel": "/path/to/vmlinux",
//!   "initrd": "/path/to/initramfs.cpio.gz",
//!   "cmdline": "console=ttyS0 reboot=k panic=1",
//!   "vcpus": 2,
//!   "memory_mib": 256,
//!   "serial": "stdout",
//!   "debugcon": "/tmp/debug.log",
//!   "vsock": { "guest_cid": 3, "uds_path": "/tmp/vm.sock" },
//!   "disks": [ { "path": "/images/root.ext4", "read_only": true } ],
//!   "shares": [ { "tag": "work", "path": "/home/me/project", "read_only": false } ]
//! }
//! ```
//!
//! Only `kernel` is required. `serial` is `"stdout"`, `"off"` or a file path.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::vstate::memory::{MAX_MEMORY_MIB, MIN_MEMORY_MIB};

/// Default number of vCPUs.
pub const DEFAULT_VCPUS: u8 = 1;
/// Default guest RAM, MiB.
pub const DEFAULT_MEMORY_MIB: u32 = 128;
/// Most vCPUs a bulkhead VM may have: what this architecture's boot tables describe (x86_64:
/// 128, the MP table and CPUID topology; aarch64: 123, the GICv3 redistributors that fit the
/// layout). KVM's own limit (KVM_CAP_MAX_VCPUS) may be lower and is checked when the VM is built.
pub const MAX_VCPUS: u8 = crate::arch::MAX_VCPUS;

/// Largest configuration file [`VmConfig::from_file`] reads (1 MiB): a real one is a few hundred
/// bytes, and `--config /dev/zero` must be an error, not an unbounded read.
pub const MAX_CONFIG_FILE_BYTES: u64 = 1 << 20;

/// Reads `path` as UTF-8, failing with `InvalidData` when it holds more than `max` bytes.
fn read_bounded(path: &Path, max: u64) -> std::io::Result<String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(path)?
        .take(max + 1)
        .read_to_string(&mut text)?;
    if text.len() as u64 > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("larger than {max} bytes"),
        ));
    }
    Ok(text)
}

/// Errors from reading or validating a configuration.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The configuration file is not valid JSON for a [`VmConfig`].
    #[error("invalid config file {path}: {source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What serde reported, with line and column.
        source: serde_json::Error,
    },
    /// `vcpus` is 0 or above [`MAX_VCPUS`].
    #[error("vcpus must be between 1 and {MAX_VCPUS}, got {0}")]
    Vcpus(u32),
    /// `memory_mib` is out of range.
    #[error("memory must be between {MIN_MEMORY_MIB} and {MAX_MEMORY_MIB} MiB, got {0} MiB")]
    Memory(u32),
    /// The vsock guest CID is reserved or out of range.
    #[error("vsock guest CID must be between 3 and 4294967294, got {0}")]
    GuestCid(u64),
    /// A `--share` value is not `TAG=DIR[:ro]`.
    #[error("share `{0}` is not TAG=HOST_DIR[:ro]")]
    ShareSyntax(String),
    /// An empty path was given.
    #[error("the {0} path is empty")]
    EmptyPath(&'static str),
    /// A read-only `--disk` was given a backing image (only a writable disk is copy-on-write).
    #[error("disk `{0}` is read-only and has a backing image: only a writable disk can")]
    ReadOnlyBacking(String),
    /// Two shares have the same mount tag (the guest could mount only one of them).
    #[error("the virtio-fs tag `{0}` is given to two shares")]
    DuplicateShareTag(String),
    /// A writable share asked to follow the host's mounts (only read-only shares may).
    #[error("share `{0}` follows the host's mounts but is writable: only a read-only share may")]
    WritableFollowingShare(String),
}

/// Where the guest's serial console (COM1) goes.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum SerialOutput {
    /// The VMM's standard output.
    #[default]
    Stdout,
    /// Nowhere: the UART exists but its output is discarded.
    Off,
    /// A file, created or truncated when the VM starts.
    File(PathBuf),
}

impl FromStr for SerialOutput {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "stdout" => Ok(SerialOutput::Stdout),
            "off" => Ok(SerialOutput::Off),
            "" => Err(Error::EmptyPath("serial output")),
            path => Ok(SerialOutput::File(PathBuf::from(path))),
        }
    }
}

impl TryFrom<String> for SerialOutput {
    type Error = Error;

    fn try_from(s: String) -> Result<Self, Error> {
        s.parse()
    }
}

impl From<SerialOutput> for String {
    fn from(s: SerialOutput) -> String {
        s.to_string()
    }
}

impl fmt::Display for SerialOutput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SerialOutput::Stdout => f.write_str("stdout"),
            SerialOutput::Off => f.write_str("off"),
            SerialOutput::File(p) => write!(f, "{}", p.display()),
        }
    }
}

fn default_vcpus() -> u8 {
    DEFAULT_VCPUS
}

fn default_memory() -> u32 {
    DEFAULT_MEMORY_MIB
}

/// A complete VM description.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmConfig {
    /// Guest kernel: an uncompressed ELF `vmlinux` or a `bzImage`.
    pub kernel: PathBuf,
    /// Optional initramfs (newc cpio, optionally compressed as the kernel supports).
    #[serde(default)]
    pub initrd: Option<PathBuf>,
    /// Kernel command line; `None` uses [`crate::boot::cmdline::DEFAULT_CMDLINE`].
    #[serde(default)]
    pub cmdline: Option<String>,
    /// Number of vCPUs, 1..=[`MAX_VCPUS`].
    #[serde(default = "default_vcpus")]
    pub vcpus: u8,
    /// Guest RAM, MiB.
    #[serde(default = "default_memory")]
    pub memory_mib: u32,
    /// Serial console output.
    #[serde(default)]
    pub serial: SerialOutput,
    /// File receiving what the guest writes to the debug port (0xe9), if any.
    #[serde(default)]
    pub debugcon: Option<PathBuf>,
    /// A virtio-vsock device with its host side on a Unix socket (Firecracker's hybrid protocol).
    #[serde(default)]
    pub vsock: Option<VsockConfig>,
    /// virtio-blk disks, in order: the first is the guest's `/dev/vda`.
    #[serde(default)]
    pub disks: Vec<DiskConfig>,
    /// virtio-fs shares of host directories (guest: `mount -t virtiofs TAG DIR`).
    #[serde(default)]
    pub shares: Vec<ShareConfig>,
}

/// A host directory shared into the guest with virtio-fs, served in-process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShareConfig {
    /// Mount tag the guest uses (1..=36 bytes).
    pub tag: String,
    /// The host directory.
    pub path: PathBuf,
    /// Refuse every write-type request on the host side (EROFS), whatever the guest mounts.
    #[serde(default)]
    pub read_only: bool,
    /// uid and gid that files the guest creates get; default: the owner of `path`.
    #[serde(default)]
    pub owner: Option<(u32, u32)>,
    /// Serve the host's mounts under `path` too, those there at start and those mounted later
    /// (a jailed VMM gets the directory as a recursive slave bind: host mounts propagate in, none
    /// propagate out). Only for a read-only share. Default: only `path`'s own file system, as it
    /// was when the VM started (a private, non-recursive bind).
    #[serde(default)]
    pub follow_host_mounts: bool,
}

impl FromStr for ShareConfig {
    type Err = Error;

    /// Parses `TAG=HOST_DIR` or `TAG=HOST_DIR:ro` (the `--share` flag).
    fn from_str(s: &str) -> Result<Self, Error> {
        let (tag, rest) = s.split_once('=').ok_or(Error::ShareSyntax(s.to_owned()))?;
        let (path, read_only) = match rest.strip_suffix(":ro") {
            Some(path) => (path, true),
            None => (rest.strip_suffix(":rw").unwrap_or(rest), false),
        };
        if tag.is_empty() || path.is_empty() {
            return Err(Error::ShareSyntax(s.to_owned()));
        }
        Ok(ShareConfig {
            tag: tag.to_owned(),
            path: PathBuf::from(path),
            read_only,
            owner: None,
            follow_host_mounts: false,
        })
    }
}

/// A virtio-blk disk backed by a raw image file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskConfig {
    /// The raw image (regular file or block device); its size sets the capacity.
    pub path: PathBuf,
    /// Refuse guest writes (enforced by the VMM, not only advertised).
    #[serde(default)]
    pub read_only: bool,
    /// Serial number the guest reads with GET_ID (at most 20 bytes).
    #[serde(default)]
    pub id: Option<String>,
    /// A copy-on-write disk: `path` is a new, empty sparse file of this image's size, and what
    /// the guest has not written is read from this read-only image (shared by many VMs). A
    /// snapshot copies the rest into `path` and names no backing image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backing: Option<PathBuf>,
}

impl FromStr for DiskConfig {
    type Err = Error;

    /// Parses `PATH`, `PATH:ro`, or `PATH[:rw]:backing=IMAGE` (the `--disk` flag).
    fn from_str(s: &str) -> Result<Self, Error> {
        if let Some((disk, backing)) = s.split_once(":backing=") {
            let mut config: DiskConfig = disk.parse()?;
            if config.read_only {
                return Err(Error::ReadOnlyBacking(s.to_owned()));
            }
            if backing.is_empty() {
                return Err(Error::EmptyPath("backing image"));
            }
            config.backing = Some(PathBuf::from(backing));
            return Ok(config);
        }
        let (path, read_only) = match s.strip_suffix(":ro") {
            Some(path) => (path, true),
            None => (s.strip_suffix(":rw").unwrap_or(s), false),
        };
        if path.is_empty() {
            return Err(Error::EmptyPath("disk"));
        }
        Ok(DiskConfig {
            path: PathBuf::from(path),
            read_only,
            id: None,
            backing: None,
        })
    }
}

/// Default guest CID (the first CID available to guests; 0-2 are reserved, virtio 1.2 §5.10.4).
pub const DEFAULT_GUEST_CID: u64 = 3;

fn default_guest_cid() -> u64 {
    DEFAULT_GUEST_CID
}

/// The virtio-vsock device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VsockConfig {
    /// The guest's context ID, ≥ 3.
    #[serde(default = "default_guest_cid")]
    pub guest_cid: u64,
    /// Host Unix socket: host clients connect here and send `CONNECT <port>\n`; guest connections to
    /// CID 2 port P go to `<uds_path>_P`. Must not exist; created when the VM is built and removed
    /// when it is destroyed.
    pub uds_path: PathBuf,
}

impl VmConfig {
    /// A configuration with defaults for everything but the kernel.
    pub fn new(kernel: impl Into<PathBuf>) -> Self {
        VmConfig {
            kernel: kernel.into(),
            initrd: None,
            cmdline: None,
            vcpus: DEFAULT_VCPUS,
            memory_mib: DEFAULT_MEMORY_MIB,
            serial: SerialOutput::default(),
            debugcon: None,
            vsock: None,
            disks: Vec::new(),
            shares: Vec::new(),
        }
    }

    /// Reads and validates a JSON configuration file (at most [`MAX_CONFIG_FILE_BYTES`]).
    ///
    /// # Errors
    /// [`Error::Read`], [`Error::Parse`] (unknown fields are rejected), and what [`Self::validate`]
    /// reports.
    pub fn from_file(path: &Path) -> Result<Self, Error> {
        let text = read_bounded(path, MAX_CONFIG_FILE_BYTES).map_err(|source| Error::Read {
            path: path.to_owned(),
            source,
        })?;
        let config: VmConfig = serde_json::from_str(&text).map_err(|source| Error::Parse {
            path: path.to_owned(),
            source,
        })?;
        config.validate()?;
        Ok(config)
    }

    /// Checks the values that do not need the host to judge: vCPU count, memory size, paths.
    /// The KVM vCPU limit and the files themselves are checked when the VM is built.
    ///
    /// # Errors
    /// [`Error::Vcpus`], [`Error::Memory`], [`Error::EmptyPath`], [`Error::DuplicateShareTag`],
    /// [`Error::WritableFollowingShare`].
    pub fn validate(&self) -> Result<(), Error> {
        if self.vcpus == 0 || self.vcpus > MAX_VCPUS {
            return Err(Error::Vcpus(u32::from(self.vcpus)));
        }
        if !(MIN_MEMORY_MIB..=MAX_MEMORY_MIB).contains(&self.memory_mib) {
            return Err(Error::Memory(self.memory_mib));
        }
        if self.kernel.as_os_str().is_empty() {
            return Err(Error::EmptyPath("kernel"));
        }
        if self
            .initrd
            .as_ref()
            .is_some_and(|p| p.as_os_str().is_empty())
        {
            return Err(Error::EmptyPath("initrd"));
        }
        let mut tags = std::collections::HashSet::new();
        if let Some(dup) = self.shares.iter().find(|s| !tags.insert(s.tag.as_str())) {
            return Err(Error::DuplicateShareTag(dup.tag.clone()));
        }
        if let Some(share) = self
            .shares
            .iter()
            .find(|s| s.follow_host_mounts && !s.read_only)
        {
            return Err(Error::WritableFollowingShare(share.tag.clone()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minimal_json_gets_defaults() {
        let cfg: VmConfig = serde_json::from_str(r#"{"kernel": "/k"}"#).unwrap();

        assert_eq!(cfg, VmConfig::new("/k"));
        assert!(cfg.validate().is_ok());
    }

    #[test]
    fn serial_accepts_stdout_off_and_paths() {
        let cfg: VmConfig =
            serde_json::from_str(r#"{"kernel": "/k", "serial": "/tmp/console.log"}"#).unwrap();

        assert_eq!(cfg.serial, SerialOutput::File("/tmp/console.log".into()));
        assert_eq!("off".parse::<SerialOutput>().unwrap(), SerialOutput::Off);
        assert_eq!(
            "stdout".parse::<SerialOutput>().unwrap(),
            SerialOutput::Stdout
        );
        assert!("".parse::<SerialOutput>().is_err());
    }

    #[test]
    fn disk_flags_parse_read_only_suffix() {
        let ro: DiskConfig = "/img/root.ext4:ro".parse().unwrap();
        let rw: DiskConfig = "/img/data.raw".parse().unwrap();

        assert_eq!(ro.path, PathBuf::from("/img/root.ext4"));
        assert!(ro.read_only);
        assert!(!rw.read_only);
        assert!(":ro".parse::<DiskConfig>().is_err());
    }

    #[test]
    fn a_disk_flag_with_a_backing_image_is_a_writable_copy_on_write_disk() {
        let cow: DiskConfig = "/run/sb/scratch.ext4:rw:backing=/tpl/disk-0.img"
            .parse()
            .unwrap();
        let short: DiskConfig = "/run/sb/s.img:backing=/tpl/d.img".parse().unwrap();
        let read_only = "/run/sb/s.img:ro:backing=/tpl/d.img".parse::<DiskConfig>();
        let empty = "/run/sb/s.img:backing=".parse::<DiskConfig>();

        assert_eq!(cow.path, PathBuf::from("/run/sb/scratch.ext4"));
        assert_eq!(cow.backing, Some(PathBuf::from("/tpl/disk-0.img")));
        assert!(!cow.read_only);
        assert_eq!(short.backing, Some(PathBuf::from("/tpl/d.img")));
        assert!(
            matches!(read_only, Err(Error::ReadOnlyBacking(_))),
            "{read_only:?}"
        );
        assert!(matches!(empty, Err(Error::EmptyPath(_))), "{empty:?}");
    }

    #[test]
    fn share_flags_parse_tag_path_and_mode() {
        let share: ShareConfig = "work=/home/me/proj:ro".parse().unwrap();

        assert_eq!(share.tag, "work");
        assert_eq!(share.path, PathBuf::from("/home/me/proj"));
        assert!(share.read_only);
        assert!("no-equals".parse::<ShareConfig>().is_err());
        assert!("=/x".parse::<ShareConfig>().is_err());
    }

    #[test]
    fn only_a_read_only_share_may_follow_the_hosts_mounts() {
        // Arrange
        let mut cfg = VmConfig::new("/k");
        cfg.shares = vec!["roots=/a:ro".parse().unwrap(), "work=/b".parse().unwrap()];
        cfg.shares[0].follow_host_mounts = true;
        let mut writable = cfg.clone();
        writable.shares[1].follow_host_mounts = true;

        // Act
        let (ok, refused) = (cfg.validate(), writable.validate());

        // Assert
        assert!(ok.is_ok(), "{ok:?}");
        assert!(matches!(refused, Err(Error::WritableFollowingShare(ref t)) if t == "work"));
    }

    #[test]
    fn the_same_share_tag_twice_is_refused() {
        let mut cfg = VmConfig::new("/k");
        cfg.shares = vec!["work=/a".parse().unwrap(), "work=/b:ro".parse().unwrap()];

        let err = cfg.validate().unwrap_err();

        assert!(
            matches!(err, Error::DuplicateShareTag(ref t) if t == "work"),
            "{err}"
        );
    }

    #[test]
    fn unknown_fields_are_rejected() {
        let err = serde_json::from_str::<VmConfig>(r#"{"kernel": "/k", "vcpu": 2}"#).unwrap_err();

        assert!(err.to_string().contains("unknown field `vcpu`"), "{err}");
    }

    #[test]
    fn zero_vcpus_and_zero_memory_are_invalid() {
        let mut cfg = VmConfig::new("/k");
        cfg.vcpus = 0;
        assert!(matches!(cfg.validate(), Err(Error::Vcpus(0))));

        cfg.vcpus = 1;
        cfg.memory_mib = 0;
        let err = cfg.validate().unwrap_err();
        assert!(err.to_string().contains("got 0 MiB"), "{err}");
    }

    #[test]
    fn an_endless_config_file_is_refused_after_a_bounded_read() {
        let err = VmConfig::from_file(Path::new("/dev/zero")).unwrap_err();

        assert!(matches!(err, Error::Read { .. }), "{err}");
        assert!(err.to_string().contains("larger than"), "{err}");
    }

    #[test]
    fn config_file_errors_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vm.json");
        std::fs::write(&path, "{ not json").unwrap();

        let err = VmConfig::from_file(&path).unwrap_err();

        assert!(err.to_string().contains("vm.json"), "{err}");
        assert!(matches!(
            VmConfig::from_file(&dir.path().join("missing.json")),
            Err(Error::Read { .. })
        ));
    }
}
