//! The JSON documents of the bulkheadd API, shared by the daemon (which also generates its OpenAPI
//! document from them, with the `openapi` feature) and this client.
//!
//! Request bodies reject unknown fields, so a typo is an error rather than a silently ignored
//! setting. Byte strings (command output, stdin) are base64 (RFC 4648, standard alphabet, padded).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use bulkhead_protocol::{ByteString, WindowSize};

use crate::workspace::{MountSpec, WorkspaceSpec};

/// Largest JSON request body bulkheadd accepts, bytes (1 MiB); a larger one is refused with
/// 413 `payload_too_large`.
pub const MAX_JSON_BYTES: usize = 1 << 20;

/// Room kept in an exec request body for everything but [`ExecSpec::stdin`] (argv, env, ...),
/// bytes (16 KiB).
const EXEC_SPEC_ROOM: usize = 16 << 10;

/// Most raw bytes [`ExecSpec::stdin`] may carry: 774 144 (756 KiB). Base64 turns every 3
/// bytes into 4, and the body ([`MAX_JSON_BYTES`]) keeps 16 KiB for the rest of the spec.
/// Larger inputs go in as a file (`PUT .../files`, `bulkhead cp`).
pub const MAX_EXEC_STDIN_BYTES: usize = (MAX_JSON_BYTES - EXEC_SPEC_ROOM) / 4 * 3;

/// Default vCPU count of a sandbox.
pub const DEFAULT_VCPUS: u8 = 1;
/// Default guest RAM of a sandbox, MiB.
pub const DEFAULT_MEMORY_MIB: u32 = 256;

fn default_vcpus() -> u8 {
    DEFAULT_VCPUS
}

fn default_memory_mib() -> u32 {
    DEFAULT_MEMORY_MIB
}

/// Body of `POST /v1/sandboxes`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateSandbox {
    /// Number of vCPUs (1..=the daemon's `max_vcpus`). With `template`: the default (1) means
    /// the template's; any other value must be the template's.
    #[serde(default = "default_vcpus")]
    #[cfg_attr(feature = "openapi", schema(default = 1, minimum = 1))]
    pub vcpus: u8,
    /// Guest RAM in MiB (at least 16, at most the host's available memory). The VMM's cgroup
    /// memory limit is this plus the daemon's VMM allowance. With `template`: the default (256)
    /// means the template's; any other value must be the template's.
    #[serde(default = "default_memory_mib")]
    #[cfg_attr(feature = "openapi", schema(default = 256, minimum = 16))]
    pub memory_mib: u32,
    /// CPU time the VMM may use, as a fraction of one host CPU (0.5 = half a CPU; 2.0 = two
    /// CPUs), enforced by the cgroup CPU quota over a 100 ms period. None: no quota.
    #[serde(default)]
    pub cpu_quota: Option<f64>,
    /// Most tasks (processes and threads) the VMM process may have on the host (`pids.max`).
    /// None: the daemon's default.
    #[serde(default)]
    pub pids_max: Option<u32>,
    /// Name of a kernel in the daemon's kernels directory. None: the daemon's default kernel.
    #[serde(default)]
    pub kernel: Option<String>,
    /// Name of a root filesystem image in the daemon's image store (`bulkhead image ls` with the
    /// daemon's data directory; 1-64 characters of `a-z 0-9 . _ -`), attached read-only and
    /// shared; the sandbox writes to a private layer that vanishes with it. None: no image, the
    /// guest runs from the daemon's initramfs (busybox).
    #[serde(default)]
    pub image: Option<String>,
    /// Size of the sandbox's writable scratch disk in MiB (at least 8; sparse, so only what the
    /// guest writes takes host space; deleted with the sandbox), holding the writable layer of
    /// `image`. Needs `image`. None: the writable layer is a tmpfs in guest RAM.
    #[serde(default)]
    pub disk_mib: Option<u64>,
    /// Environment every command in the sandbox starts with (an exec's own `env` overrides it).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Seconds after creation when the daemon destroys the sandbox. None: no limit.
    #[serde(default)]
    pub ttl_s: Option<u64>,
    /// Free-form labels, for filtering `GET /v1/sandboxes?label=k=v`.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// A host project directory shared at `/workspace`, `direct` (read-write) or `clone`
    /// (read-only under a private overlay; see `GET .../workspace/diff` and `.../export`).
    /// Its path must be inside one of the daemon's `mount_roots`. None: no workspace.
    #[serde(default)]
    pub workspace: Option<WorkspaceSpec>,
    /// Host directories shared at guest paths, as `bulkhead run --mount` (at most 8; each
    /// inside one of the daemon's `mount_roots`).
    #[serde(default)]
    pub mounts: Vec<MountSpec>,
    /// The guest's hostname (1-64 of `[A-Za-z0-9.-]`). None: `bh-<id>`.
    #[serde(default)]
    pub hostname: Option<String>,
    /// Working directory of every exec that names none (absolute). None: `/workspace` with a
    /// workspace, else `/`.
    #[serde(default)]
    pub workdir: Option<String>,
    /// Guest user of every exec that names none: name, uid or uid:gid. None: root.
    #[serde(default)]
    pub user: Option<String>,
    /// The sandbox's network. None: no network at all (no device, no proxy, no way out).
    #[serde(default)]
    pub network: Option<NetworkRequest>,
    /// Name of a template in the daemon's `<state_dir>/templates/` (a snapshot of a booted,
    /// prepared sandbox, as `bulkhead template create` makes): the sandbox is restored from it
    /// instead of booted, and continues where the template's preparation left it. Its kernel,
    /// guest memory and vCPUs are the template's; `workspace` and `mounts` go to its share slots,
    /// `network` gets the clone a proxy of its own; `kernel`, `image` and `disk_mib` are not
    /// supported with a template yet. None: boot.
    #[serde(default)]
    pub template: Option<String>,
}

/// A sandbox's network (see docs/network.md): every connection leaves through the host's egress
/// proxy, which decides it against these rules and logs it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct NetworkRequest {
    /// `none`, `allowlist` (only what the rules name) or `allow-all` (any public address).
    /// Default: `allowlist`.
    #[serde(default)]
    pub mode: Option<String>,
    /// Allow rules: `HOST[:PORT]` (`example.com`, `*.example.com`, `**.example.com`; ports 80
    /// and 443 by default) or a preset `@NAME`.
    #[serde(default)]
    pub allow: Vec<String>,
    /// Deny rules: `HOST[:PORT]` (every port when none is given) or a CIDR; they beat allow
    /// rules.
    #[serde(default)]
    pub deny: Vec<String>,
    /// Allow rules for raw IP addresses, `CIDR[:PORT]`.
    #[serde(default)]
    pub allow_cidr: Vec<String>,
    /// Rules with methods and path prefixes (TLS to their hosts is intercepted).
    #[serde(default)]
    pub rules: Vec<NetworkRule>,
    /// Secrets of the daemon's configuration (`[secrets]`) to inject for some hosts.
    #[serde(default)]
    pub secrets: Vec<SecretRef>,
    /// Names the proxy resolves to these IP addresses (like `docker run --add-host`).
    #[serde(default)]
    pub hosts: BTreeMap<String, Vec<String>>,
}

/// A rule with methods and path prefixes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct NetworkRule {
    /// `HOST[:PORT]`.
    pub host: String,
    /// `allow` (default) or `deny`.
    #[serde(default)]
    pub action: Option<String>,
    /// Methods it covers (all when empty).
    #[serde(default)]
    pub methods: Vec<String>,
    /// Path prefixes it covers (all when empty).
    #[serde(default)]
    pub paths: Vec<String>,
}

/// A configured secret and the hosts its value may go to.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SecretRef {
    /// Its name in the daemon's `[secrets]`; commands see `$NAME` holding a placeholder.
    pub name: String,
    /// Host patterns whose requests get the value.
    pub hosts: Vec<String>,
}

impl Default for CreateSandbox {
    fn default() -> Self {
        CreateSandbox {
            vcpus: DEFAULT_VCPUS,
            memory_mib: DEFAULT_MEMORY_MIB,
            cpu_quota: None,
            pids_max: None,
            kernel: None,
            image: None,
            disk_mib: None,
            env: BTreeMap::new(),
            ttl_s: None,
            labels: BTreeMap::new(),
            workspace: None,
            mounts: Vec::new(),
            hostname: None,
            workdir: None,
            user: None,
            network: None,
            template: None,
        }
    }
}

/// Where a sandbox is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum SandboxState {
    /// The VM is booting; the agent is not ready yet.
    Creating,
    /// The agent is ready: exec and files work.
    Running,
    /// The VM ended by itself or could not start; see `failure`. Delete it to free it.
    Failed,
    /// Being destroyed.
    Destroying,
    /// Being paused: its VM is being saved to the daemon's state directory.
    Pausing,
    /// Paused: its VM was saved to the daemon's state directory and stopped (no VMM, no guest
    /// memory in use); `POST .../resume` continues it where it was.
    Paused,
    /// Being resumed from its saved VM.
    Resuming,
}

impl SandboxState {
    /// Every state, in lifecycle order.
    pub const ALL: [SandboxState; 7] = [
        SandboxState::Creating,
        SandboxState::Running,
        SandboxState::Pausing,
        SandboxState::Paused,
        SandboxState::Resuming,
        SandboxState::Failed,
        SandboxState::Destroying,
    ];

    /// The state's name as in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Creating => "creating",
            SandboxState::Running => "running",
            SandboxState::Failed => "failed",
            SandboxState::Destroying => "destroying",
            SandboxState::Pausing => "pausing",
            SandboxState::Paused => "paused",
            SandboxState::Resuming => "resuming",
        }
    }
}

/// Why a sandbox failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Failure {
    /// Short machine-readable reason: `guest_shutdown`, `stopped`, `guest_crash`,
    /// `seccomp_violation`, `vmm_error`, `killed`, `vanished` (see docs/daemon.md),
    /// `destroy_failed`, `pause_failed` (saving the VM failed, and the VM is lost) or
    /// `snapshot_missing` (a paused sandbox's saved VM was gone at a daemon start).
    pub reason: String,
    /// Human-readable detail (the VMM's exit status or the start error; for
    /// `seccomp_violation`, the blocked system call's number and thread kind).
    pub message: String,
    /// The last lines of the VMM's output (its messages and the guest's serial console).
    pub log_tail: String,
}

/// The host-side limits applied to a sandbox's VMM process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Limits {
    /// cgroup memory limit, bytes: guest RAM plus the VMM allowance (plus `disk_mib` when the
    /// daemon's runtime directory, holding the scratch disks, is in host RAM: tmpfs).
    pub memory_bytes: u64,
    /// CPU quota as a fraction of one host CPU; None: none.
    pub cpu_quota: Option<f64>,
    /// cgroup `pids.max`.
    pub pids_max: u32,
    /// The VMM's cgroup (path inside the cgroup hierarchy); None when cgroups are off.
    pub cgroup: Option<String>,
}

/// A sandbox as the daemon reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SandboxInfo {
    /// Identifier (12 lowercase hex digits).
    pub id: String,
    /// Current state.
    pub state: SandboxState,
    /// Creation time, RFC 3339 UTC.
    pub created_at: String,
    /// When the TTL destroys it, RFC 3339 UTC; None: no TTL.
    pub expires_at: Option<String>,
    /// vCPUs.
    pub vcpus: u8,
    /// Guest RAM, MiB.
    pub memory_mib: u32,
    /// Kernel name, or None for the default.
    pub kernel: Option<String>,
    /// Root filesystem image name, or None for none (the initramfs).
    pub image: Option<String>,
    /// Scratch disk size, MiB, or None when the writable layer is in guest RAM.
    #[serde(default)]
    pub disk_mib: Option<u64>,
    /// Labels given at creation.
    pub labels: BTreeMap<String, String>,
    /// The workspace given at creation.
    #[serde(default)]
    pub workspace: Option<WorkspaceSpec>,
    /// The host directories given at creation (host paths resolved).
    #[serde(default)]
    pub mounts: Vec<MountSpec>,
    /// The guest's hostname.
    #[serde(default)]
    pub hostname: Option<String>,
    /// The network as asked for; None: no network.
    #[serde(default)]
    pub network: Option<NetworkRequest>,
    /// The template it was restored from; None: it booted.
    #[serde(default)]
    pub template: Option<String>,
    /// Host limits of the VMM process.
    pub limits: Limits,
    /// Host process ID of the VMM while it runs: with the jail (a daemon running as root), the
    /// jail's supervisor, whose only child runs the VM; signals to it reach the VM's process.
    pub vmm_pid: Option<u32>,
    /// Set in state `failed`.
    pub failure: Option<Failure>,
}

/// Body of `POST /v1/sandboxes/{id}/exec` and `.../exec/collect`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ExecSpec {
    /// Program and arguments; `argv[0]` is looked up in `PATH` when it has no `/`. Each is a
    /// JSON string, or `{"base64": "..."}` for bytes that are not UTF-8 (Linux argv is bytes).
    pub argv: Vec<ByteString>,
    /// Environment added to (and overriding) the sandbox's; values as `argv`'s entries.
    #[serde(default)]
    pub env: BTreeMap<String, ByteString>,
    /// Absolute working directory in the guest (a string or `{"base64": ...}`); `/` when absent.
    #[serde(default)]
    pub cwd: Option<ByteString>,
    /// Guest user: name, uid or uid:gid; root when absent.
    #[serde(default)]
    pub user: Option<String>,
    /// Base64 bytes fed to the command's stdin, followed by end of file, at most
    /// [`MAX_EXEC_STDIN_BYTES`] before encoding. Absent: stdin is `/dev/null`.
    #[serde(default)]
    pub stdin: Option<String>,
    /// Seconds after which the command's whole process group is killed (`exit.timed_out`).
    #[serde(default)]
    pub timeout_s: Option<f64>,
    /// Run the command on a pseudo-terminal (`docker exec -t`): one output stream (`stdout`),
    /// Ctrl-C as `0x03` on stdin, `TERM=xterm` unless `env` names one.
    #[serde(default)]
    pub tty: bool,
    /// The terminal's size at start (with `tty`); 24 × 80 when absent.
    #[serde(default)]
    pub window: Option<WindowSize>,
}

impl ExecSpec {
    /// A spec that runs `argv` with no extra environment, stdin or timeout.
    pub fn new<I, S>(argv: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<ByteString>,
    {
        ExecSpec {
            argv: argv.into_iter().map(Into::into).collect(),
            ..ExecSpec::default()
        }
    }
}

/// How a command ended. Exactly one of `code` and `signal` is set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ExitInfo {
    /// Exit code (0..=255) of a normal exit.
    pub code: Option<i32>,
    /// Number of the signal that ended it.
    pub signal: Option<i32>,
    /// The `timeout_s` passed and the process group was killed.
    pub timed_out: bool,
}

impl ExitInfo {
    /// True for exit code 0 without a timeout.
    pub fn success(&self) -> bool {
        self.code == Some(0) && !self.timed_out
    }
}

/// One line of the NDJSON stream of `POST /v1/sandboxes/{id}/exec`: exactly one key. The last
/// line is `exit`, or `error` when the stream broke after it started.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ExecLine {
    /// Base64 bytes the command wrote to stdout.
    Stdout(String),
    /// Base64 bytes the command wrote to stderr.
    Stderr(String),
    /// The command ended.
    Exit(ExitInfo),
    /// The stream failed (e.g. the VM died).
    Error(ErrorDetail),
}

/// Answer of `POST /v1/sandboxes/{id}/exec/collect`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ExecResult {
    /// Base64 of everything written to stdout.
    pub stdout: String,
    /// Base64 of everything written to stderr.
    pub stderr: String,
    /// How it ended.
    pub exit: ExitInfo,
}

/// Answer of `PUT /v1/sandboxes/{id}/files`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FileWritten {
    /// Bytes written.
    pub bytes: u64,
}

/// Answer of `GET /healthz`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Health {
    /// `ok`.
    pub status: String,
    /// The daemon's version.
    pub version: String,
    /// Sandboxes it holds, in any state (idle clones of the warm pool are not sandboxes).
    pub sandboxes: usize,
    /// The warm pool, when the daemon keeps one (`[pool]` in its configuration).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<PoolStatus>,
}

/// The daemon's warm pool: idle clones of one template, handed out to creates that name it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PoolStatus {
    /// The template the clones are restored from.
    pub template: String,
    /// How many idle clones the daemon keeps (`pool.size`).
    pub size: usize,
    /// Idle clones ready to be handed out now.
    pub ready: usize,
    /// Clones being restored now (0 or 1: the pool refills one at a time).
    pub restoring: usize,
}

/// Error details.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorDetail {
    /// Machine-readable code, e.g. `not_found`, `invalid_request`, `conflict`.
    pub code: String,
    /// Human-readable explanation.
    pub message: String,
}

/// Body of every 4xx/5xx answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorBody {
    /// What went wrong.
    pub error: ErrorDetail,
}

/// Type of a guest file in a [`FileInfo`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// A symbolic link (never followed).
    Symlink,
    /// A device node, FIFO or socket.
    Other,
}

/// One guest file as `lstat(2)` sees it: an entry of `GET .../files/list`, the answer of
/// `GET .../files/stat`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FileInfo {
    /// Last path component: a JSON string, or `{"base64": ...}` for a name that is not UTF-8.
    pub name: ByteString,
    /// Whole guest path, as `name`.
    pub path: ByteString,
    /// Type of the file.
    #[serde(rename = "type")]
    pub kind: FileKind,
    /// Size in bytes (a symlink's is the length of its target).
    pub size: u64,
    /// Permission bits, e.g. 420 = 0o644.
    pub mode: u32,
    /// Last modification, seconds since the Unix epoch.
    pub mtime: i64,
    /// A symlink's target, as `name`; absent for other types.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_target: Option<ByteString>,
}

/// Answer of `GET /v1/sandboxes/{id}/files/list`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FileList {
    /// The directory's entries, sorted by name.
    pub entries: Vec<FileInfo>,
}

/// An entry an archive transfer left out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SkippedFile {
    /// The entry (invalid UTF-8 replaced by U+FFFD).
    pub path: String,
    /// Why it was left out.
    pub reason: String,
}

/// Answer of `PUT /v1/sandboxes/{id}/archive`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ArchiveWritten {
    /// Entries extracted (directories, files, links).
    pub entries: u64,
    /// Bytes of file contents written, holes not counted.
    pub bytes: u64,
    /// Entries left out (device nodes, FIFOs).
    #[serde(default)]
    pub skipped: Vec<SkippedFile>,
}
