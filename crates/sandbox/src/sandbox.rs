//! [`Sandbox`]: one microVM with a guest agent, driven from the host.

use std::ffi::{OsStr, OsString};
use std::fs;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use bulkhead_protocol::boot::{is_bulkhead_param, BootParams};
use bulkhead_protocol::client::{accept_ready, AgentClient, ClientError, ExecSession};
use bulkhead_protocol::{ExecRequest, Ready, READY_PORT};
use bulkhead_vmm::boot::cmdline::DEFAULT_CMDLINE;
use bulkhead_vmm::config::{DiskConfig, SerialOutput, VmConfig, VsockConfig, DEFAULT_GUEST_CID};

use crate::egress::{
    self, install_egress_ca, start_egress, start_proxy, EgressError, EgressSettings,
};
use crate::jail::{self, Jail, JailError};
use crate::mounts::MountError;
use crate::phases::{self, PhaseClock, Timings, REPORT_FILE};
use crate::process::{self, SpawnOptions, Woken};
use crate::storage::{self, Prepared, Storage, StorageError};
pub(crate) use crate::vmm_log::{log_or_explanation, tail_lines};
use crate::vmm_log::{log_suffix, LOG_TAIL_LINES};
use crate::vmm_process::{start_time_of, Adopted, VmEnd, VmmProcess};
use crate::workspace::{self, WorkspaceError};
use bulkhead_egress::EgressProxy;

/// The VMM's exit report in the runtime directory (`bulkhead-vmm --exit-file`).
pub const EXIT_FILE: &str = "exit.json";

/// How long the VMM gets to stop after SIGTERM before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(5);

pub use crate::sandbox_config::SandboxConfig;

/// Errors from starting or using a sandbox.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file the sandbox needs does not exist.
    #[error("{what} {path} not found{hint}")]
    Missing {
        /// "kernel", "initramfs" or "bulkhead-vmm".
        what: &'static str,
        /// The path looked at.
        path: PathBuf,
        /// What to do about it.
        hint: &'static str,
    },
    /// A path given for a file the sandbox needs is a directory or another non-regular file.
    #[error("{what} {path} is not a regular file")]
    NotAFile {
        /// "kernel" or "initramfs".
        what: &'static str,
        /// The path looked at.
        path: PathBuf,
    },
    /// A path given for a file the sandbox needs cannot be looked at: a trailing `/` after a
    /// file's name (`ENOTDIR`), a directory on the way without search permission, a loop of
    /// symbolic links.
    #[error("cannot use {what} {path}: {source}")]
    Unreadable {
        /// "kernel" or "initramfs".
        what: &'static str,
        /// The path looked at.
        path: PathBuf,
        /// The OS error of `stat(2)`.
        source: io::Error,
    },
    /// The runtime directory or a file in it could not be created.
    #[error("cannot prepare the sandbox runtime directory {path}: {source}")]
    RuntimeDir {
        /// The directory.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// The VMM process could not be started.
    #[error("cannot start {vmm}: {source}")]
    Spawn {
        /// The VMM binary.
        vmm: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// The VMM exited before the guest agent was ready.
    #[error("the VM exited before its agent was ready: {end}; VMM log:\n{log}")]
    VmExited {
        /// How it ended: the VMM's exit status and report.
        end: Box<VmEnd>,
        /// The last lines of the VMM's output (its messages and, when kept there, the guest's
        /// console: text the guest may have written).
        log: String,
    },
    /// The agent did not announce itself in time; the VM was destroyed.
    #[error("the guest agent was not ready within {timeout:?}; the VM was destroyed (a loaded or nested host can take minutes to boot a guest, so raise `bulkhead run --boot-timeout`, the daemon's `boot_timeout_s` or `SandboxConfig::ready_timeout`; if it never boots, check that the kernel has virtio-vsock and that the initramfs's /init is the bulkhead agent){}", log_suffix(.log))]
    ReadyTimeout {
        /// How long the agent was waited for.
        timeout: Duration,
        /// The last lines of the VMM's output when it was stopped (with a kept console
        /// ([`SandboxConfig::console`]), the guest kernel's last messages); may be empty.
        log: String,
    },
    /// The agent's announcement was invalid.
    #[error("bad readiness announcement from the guest agent: {0}")]
    Ready(ClientError),
    /// Talking to the agent failed.
    #[error(transparent)]
    Agent(#[from] ClientError),
    /// Waiting for or stopping the VMM failed.
    #[error("cannot manage the VMM process: {0}")]
    Process(io::Error),
    /// [`Sandbox::adopt`]: the VMM process or the sandbox's files are gone;
    /// [`Sandbox::start_network`] of a sandbox that has a proxy or no runtime directory.
    #[error("cannot adopt the sandbox: {0}")]
    Adopt(io::Error),
    /// The root image, scratch disk or a data disk is unusable ([`Sandbox::start_with`]).
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// A host directory to mount is unusable ([`SandboxConfig::mounts`]).
    #[error(transparent)]
    Mount(#[from] MountError),
    /// The workspace is unusable ([`SandboxConfig::workspace`]), or its diff or export failed.
    #[error(transparent)]
    Workspace(#[from] WorkspaceError),
    /// The VMM cannot be jailed ([`SandboxConfig::jail`]).
    #[error(transparent)]
    Jail(#[from] JailError),
    /// The sandbox's network could not be set up.
    #[error(transparent)]
    Egress(#[from] EgressError),
    /// A boot parameter for the guest agent is invalid (e.g. [`SandboxConfig::hostname`]), or
    /// an extra kernel parameter uses the agent's `bulkhead.` keys.
    #[error("{0}")]
    BootParams(String),
    /// A snapshot could not be taken or restored (see [`crate::snapshot`]).
    #[error("snapshot: {0}")]
    Snapshot(String),
    /// A directory could not be attached to a running sandbox's share slot.
    #[error("cannot attach a shared directory: {0}")]
    Attach(String),
    /// A snapshot was not taken and the sandbox runs on unchanged: the guest's shared
    /// directories are in use (the message names the processes).
    #[error("no snapshot now: {0}")]
    SnapshotRefused(String),
}

/// What another process needs to take over a running sandbox with [`Sandbox::adopt`] (e.g. a
/// daemon after a restart). Serializable, so it can be kept in a state file.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SandboxState {
    /// The sandbox's private runtime directory (removed when it is destroyed).
    pub runtime_dir: PathBuf,
    /// The VM's vsock Unix socket.
    pub vsock_path: PathBuf,
    /// Process ID of its `bulkhead-vmm`.
    pub vmm_pid: u32,
    /// When that process started, in clock ticks after boot (`/proc/<pid>/stat` field 22): with
    /// the pid it identifies the process even after the pid is reused.
    pub vmm_start_time: u64,
    /// The agent's readiness announcement.
    pub ready: Ready,
}

/// A running microVM with its guest agent ready.
#[derive(Debug)]
pub struct Sandbox {
    pub(crate) dir: Option<PathBuf>,
    pub(crate) child: Option<VmmProcess>,
    pub(crate) uds_path: PathBuf,
    pub(crate) ready: Ready,
    pub(crate) timings: Timings,
    /// The VMM's timeline, for phases measured after the start.
    pub(crate) clock: Option<PhaseClock>,
    pub(crate) first_output: OnceLock<Instant>,
    /// The egress proxy, when the sandbox has a network; stopped after the VMM.
    pub(crate) egress: Option<EgressProxy>,
    pub(crate) egress_log: Option<PathBuf>,
    /// A connection to the agent opened ahead of need ([`Sandbox::preconnect`]).
    pub(crate) spare: Option<UnixStream>,
}

/// The VMM's control socket in a runtime directory (`bulkhead-vmm --api-sock`).
pub(crate) const API_SOCKET: &str = "vmm/api.sock";

/// `--api-sock <dir>/vmm/api.sock`.
pub(crate) fn api_sock_args(dir: &Path) -> Vec<OsString> {
    vec!["--api-sock".into(), dir.join(API_SOCKET).into_os_string()]
}

impl Sandbox {
    /// Boots a sandbox and waits for its agent.
    ///
    /// # Errors
    /// [`Error::Missing`] for absent kernel/initramfs/VMM, [`Error::VmExited`] with the VMM's log
    /// when the VM fails to boot, [`Error::ReadyTimeout`] (the VM is destroyed), and the rest of
    /// [`Error`]. Nothing is left running or on disk when this fails.
    pub fn start(config: &SandboxConfig) -> Result<Sandbox, Error> {
        Self::start_with(config, &Storage::default())
    }

    /// Boots a sandbox with disks: a read-only root image with a private writable layer,
    /// and data disks (see [`Storage`]). The scratch disk lives in the runtime directory and
    /// is deleted with the sandbox.
    ///
    /// # Errors
    /// [`Error::Storage`] for unusable images and disks (checked before anything starts), and
    /// everything [`Sandbox::start`] reports. Nothing is left running or on disk when this
    /// fails.
    pub fn start_with(config: &SandboxConfig, storage: &Storage) -> Result<Sandbox, Error> {
        let started = Instant::now();
        config.check_files()?;
        storage::check(storage, &config.runtime_dir)?;
        let ws = workspace::prepare(config.workspace.as_ref(), &config.mounts)?;
        let dir = make_runtime_dir(&config.runtime_dir)?;
        let disks = storage::prepare(storage, dir.path())?;
        workspace::record(dir.path(), &ws, None)?;
        let uds_path = dir.path().join("vm.sock");
        let ready_path = dir.path().join(format!("vm.sock_{READY_PORT}"));
        let listener = UnixListener::bind(&ready_path).map_err(|source| Error::RuntimeDir {
            path: ready_path.clone(),
            source,
        })?;
        let config_path = dir.path().join("vm.json");
        let vm = write_vm_config(config, &disks, &ws, &uds_path, &config_path)?;
        jail::make_vmm_dir(dir.path())?;
        let jail_args = match jail::active(config.jail) {
            true => Jail::prepare(dir.path(), &vm, Some(&ready_path), config.jail_owner)?.args(),
            false => Vec::new(),
        };
        // The control socket, for snapshots; in `vmm/`, which a jailed VMM may write.
        let jail_args = [jail_args, api_sock_args(dir.path())].concat();
        // Listening before the guest exists; stopped (dropped) if anything below fails.
        let egress = start_egress(config, dir.path(), &uds_path)?;
        let log_path = dir.path().join("vmm.log");
        let report_path = dir.path().join(REPORT_FILE);
        let exit_path = dir.path().join(EXIT_FILE);
        let options = SpawnOptions {
            kill_on_parent_exit: config.kill_on_parent_exit,
            cgroup_procs: &config.cgroup_procs,
            timings_json: Some(&report_path),
            exit_file: Some(&exit_path),
            extra_args: &jail_args,
        };
        let launch = [OsStr::new("--config"), config_path.as_os_str()];
        let mut child = process::spawn_vmm(&config.vmm_binary, &launch, &log_path, options)
            .map_err(|source| Error::Spawn {
                vmm: config.vmm_binary.clone(),
                source,
            })?;
        let spawn = started.elapsed();
        let files = RunFiles {
            log: &log_path,
            exit: &exit_path,
        };
        let ready =
            wait_ready(&listener, &mut child, files, config.ready_timeout).and_then(|ready| {
                let client = AgentClient::hybrid(&uds_path).with_timeout(config.ready_timeout);
                install_egress_ca(&client, egress.as_ref())?;
                Ok(ready)
            });
        let ready = match ready {
            Ok(ready) => ready,
            Err(e) => {
                let _ = process::terminate(&mut child, STOP_GRACE);
                return Err(e);
            }
        };
        let ready_at = Instant::now();
        let (clock, phases) = phases::read(&report_path, &ready, ready_at);
        let timings = Timings {
            spawn,
            ready: ready_at - started,
            vmm_start: clock.map(|c| c.origin().saturating_duration_since(started)),
            phases,
        };
        let egress_log = egress::log_path(config.egress.as_ref(), dir.path());
        Ok(Sandbox {
            dir: Some(dir.keep()),
            child: Some(VmmProcess::Child(child)),
            uds_path,
            ready,
            timings,
            clock,
            first_output: OnceLock::new(),
            egress,
            egress_log,
            spare: None,
        })
    }

    /// What every command of this sandbox needs for its network: the proxy variables
    /// (`HTTP_PROXY`, `HTTPS_PROXY`, their lower-case forms, `NO_PROXY`, `NODE_USE_ENV_PROXY`),
    /// the CA bundle variables, and each secret's placeholder. Empty without a network (and
    /// for an adopted sandbox until [`Sandbox::start_network`]: its proxy ended with its first
    /// owner).
    pub fn egress_env(&self) -> Vec<(String, String)> {
        self.egress
            .as_ref()
            .map(EgressProxy::guest_env)
            .unwrap_or_default()
    }

    /// The sandbox's egress log (JSON lines, `bulkhead_egress::LogEntry`), when it has a
    /// network.
    pub fn egress_log(&self) -> Option<&Path> {
        self.egress_log.as_deref()
    }

    /// Gives a running sandbox without a proxy a network: an adopted sandbox its network again
    /// (its first owner's proxy ended with it), or an idle clone handed out from a warm pool the
    /// network its request asks for. Starts an egress proxy with `settings` (from
    /// [`crate::spec::egress_settings`] of the sandbox's spec) on its egress socket, replacing a
    /// dead proxy's socket file, and installs the proxy's CA certificate in the guest (the
    /// agent answers within `timeout`). The guest's relay connects per accepted connection, so
    /// its next connection reaches the new proxy; commands started from now on get the new
    /// proxy's variables and placeholders ([`Sandbox::egress_env`]). A guest that booted
    /// without a relay (a clone) also needs a `RestoredRequest` with `egress` set.
    ///
    /// # Errors
    /// [`Error::Egress`] when the proxy cannot start or the CA cannot be installed (the new
    /// proxy is then stopped); [`Error::Adopt`] when the sandbox already has a proxy or no
    /// runtime directory.
    pub fn start_network(
        &mut self,
        settings: &EgressSettings,
        timeout: Duration,
    ) -> Result<(), Error> {
        let Some(dir) = self.dir.clone().filter(|_| self.egress.is_none()) else {
            return Err(Error::Adopt(io::Error::other(
                "only a sandbox with a runtime directory and no proxy can start a network",
            )));
        };
        let proxy = start_proxy(settings, &dir, &self.uds_path, jail::active(true))?;
        let client = AgentClient::hybrid(&self.uds_path).with_timeout(timeout);
        install_egress_ca(&client, Some(&proxy))?;
        self.egress_log = egress::log_path(Some(settings), &dir);
        self.egress = Some(proxy);
        Ok(())
    }

    /// A client for the guest agent (a new vsock connection per request).
    pub fn client(&self) -> AgentClient {
        AgentClient::hybrid(&self.uds_path)
    }

    /// Opens a connection to the guest agent now, for the next
    /// [`Sandbox::take_preconnected`], so that a command started later on it does not wait for
    /// the vsock handshake (`CONNECT`, the guest's answer: in the test host ~6 ms of a warm
    /// pool's hand-out, `benches/results/README.md`). Replaces an earlier one.
    ///
    /// # Errors
    /// [`Error::Agent`] when the agent cannot be reached.
    pub fn preconnect(&mut self) -> Result<(), Error> {
        self.spare = Some(self.client().connect()?);
        Ok(())
    }

    /// The connection [`Sandbox::preconnect`] opened, when it is still open and nothing came on
    /// it (the agent sends nothing before a request); None otherwise (a connection that fails
    /// the check is closed). Start a command on it with [`ExecSession::start`].
    pub fn take_preconnected(&mut self) -> Option<UnixStream> {
        self.spare.take().filter(idle_and_open)
    }

    /// Starts a command in the guest.
    ///
    /// # Errors
    /// [`Error::Agent`] when the request cannot be delivered.
    pub fn exec(&self, request: &ExecRequest) -> Result<ExecSession, Error> {
        Ok(self.client().exec(request)?)
    }

    /// The agent's readiness announcement (its version and guest-clock timestamps).
    pub fn ready_info(&self) -> &Ready {
        &self.ready
    }

    /// Start-up timings: host-side durations and every phase reached so far (`first_output`
    /// once [`Sandbox::mark_first_output`] was called).
    pub fn timings(&self) -> Timings {
        let mut timings = self.timings;
        if let (Some(phases), Some(at)) = (timings.phases.as_mut(), self.first_output.get()) {
            phases.first_output = self.phase_offset(*at);
        }
        timings
    }

    /// Records now as the `first_output` phase; only the first call counts. Call it when the
    /// first output (or, for a silent command, the exit status) of the first command arrives.
    pub fn mark_first_output(&self) {
        self.first_output.get_or_init(Instant::now);
    }

    /// Time from this sandbox's VMM process start to `at`, the timeline of
    /// [`Timings::phases`]; `None` without phases.
    pub fn phase_offset(&self, at: Instant) -> Option<Duration> {
        self.clock.map(|clock| clock.offset(at))
    }

    /// Like [`Sandbox::destroy`], returning the final timings, with `vm_destroyed` the moment
    /// the VMM process was reaped.
    ///
    /// # Errors
    /// As [`Sandbox::destroy`].
    pub fn destroy_timed(mut self) -> Result<Timings, Error> {
        let mut timings = self.timings();
        self.teardown()?;
        if let Some(phases) = timings.phases.as_mut() {
            phases.vm_destroyed = self.phase_offset(Instant::now());
        }
        Ok(timings)
    }

    /// The VM's vsock Unix socket (for hybrid-protocol clients).
    pub fn vsock_path(&self) -> &Path {
        &self.uds_path
    }

    /// Process ID of the sandbox's `bulkhead-vmm`: when jailed, its supervisor, whose only child
    /// runs the VM (signals to either stop the VM; see [`jail`](crate::jail)).
    pub fn vmm_pid(&self) -> Option<u32> {
        self.child.as_ref().map(VmmProcess::pid)
    }

    /// The sandbox's private runtime directory (VM configuration, vsock sockets, `vmm.log`).
    pub fn runtime_path(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// The last `lines` lines of the VMM's output (`vmm.log`: its messages, and the guest's
    /// serial console when [`SandboxConfig::console`] is `Stdout`).
    pub fn log_tail(&self, lines: usize) -> String {
        match &self.dir {
            Some(dir) => tail_lines(&dir.join("vmm.log"), lines),
            None => String::new(),
        }
    }

    /// A new pidfd of the VMM process (readable once it exits), e.g. to wait for it with an
    /// event loop; then call [`Sandbox::try_wait_exit`].
    ///
    /// # Errors
    /// [`Error::Process`] when the VMM was already reaped or pidfd_open(2) fails.
    pub fn vmm_pidfd(&self) -> Result<OwnedFd, Error> {
        let child = self.child.as_ref().ok_or_else(|| {
            Error::Process(io::Error::new(
                io::ErrorKind::NotFound,
                "the VMM was reaped",
            ))
        })?;
        child.pidfd().map_err(Error::Process)
    }

    /// Checks, without blocking, whether the VM has ended by itself; reaps the VMM if so and
    /// returns how it ended (for an adopted sandbox the process status is
    /// [`VmmExit::Unknown`](crate::VmmExit::Unknown), the VMM's report still tells).
    ///
    /// # Errors
    /// [`Error::Process`] when checking fails.
    pub fn try_wait_exit(&mut self) -> Result<Option<VmEnd>, Error> {
        self.wait_exit(Duration::ZERO)
    }

    /// What [`Sandbox::adopt`] needs to take this sandbox over from another process.
    ///
    /// # Errors
    /// [`Error::Process`] when the VMM has exited (or was reaped).
    pub fn state(&self) -> Result<SandboxState, Error> {
        let (Some(child), Some(dir)) = (&self.child, &self.dir) else {
            return Err(Error::Process(io::Error::new(
                io::ErrorKind::NotFound,
                "the VMM has exited",
            )));
        };
        let vmm_pid = child.pid();
        Ok(SandboxState {
            runtime_dir: dir.clone(),
            vsock_path: self.uds_path.clone(),
            vmm_pid,
            vmm_start_time: start_time_of(vmm_pid).map_err(Error::Process)?,
            ready: self.ready.clone(),
        })
    }

    /// Takes over a running sandbox that another process started (and [`Sandbox::detach`]ed, or
    /// that outlived its owner). The VMM is watched and stopped through a pidfd; its exit status
    /// cannot be collected ([`VmmExit::Unknown`](crate::VmmExit::Unknown)).
    ///
    /// # Errors
    /// [`Error::Adopt`] when the VMM process is gone (or the pid belongs to another process
    /// now) or the vsock socket is missing. Nothing is stopped or removed then.
    pub fn adopt(state: &SandboxState) -> Result<Sandbox, Error> {
        let adopted = Adopted::open(state.vmm_pid, state.vmm_start_time).map_err(Error::Adopt)?;
        if !state.vsock_path.exists() {
            return Err(Error::Adopt(io::Error::new(
                io::ErrorKind::NotFound,
                format!("{} is missing", state.vsock_path.display()),
            )));
        }
        Ok(Sandbox {
            dir: Some(state.runtime_dir.clone()),
            child: Some(VmmProcess::Adopted(adopted)),
            uds_path: state.vsock_path.clone(),
            ready: state.ready.clone(),
            timings: Timings {
                spawn: Duration::ZERO,
                ready: Duration::ZERO,
                vmm_start: None,
                phases: None,
            },
            clock: None,
            first_output: OnceLock::new(),
            egress: None,
            egress_log: None,
            spare: None,
        })
    }

    /// Lets go of the sandbox without stopping it: the VMM keeps running and the runtime
    /// directory stays, for a later [`Sandbox::adopt`]. (Not with
    /// [`SandboxConfig::kill_on_parent_exit`], which stops the VMM when this process exits.)
    ///
    /// # Errors
    /// [`Error::Process`] when the VMM has already exited; the sandbox is then torn down.
    pub fn detach(self) -> Result<SandboxState, Error> {
        let state = self.state()?;
        self.release();
        Ok(state)
    }

    /// Lets go of everything without stopping or removing anything (e.g. to keep the runtime
    /// directory and its `vmm.log` of a VM that has ended); returns the runtime directory.
    pub fn release(mut self) -> Option<PathBuf> {
        self.child = None;
        self.dir.take()
    }

    /// Waits up to `timeout` for the VM to end by itself (the guest rebooted or powered off,
    /// or crashed); reaps the VMM and returns how the VM ended, or `None` if it still runs.
    ///
    /// # Errors
    /// [`Error::Process`] when waiting fails.
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<Option<VmEnd>, Error> {
        let Some(child) = self.child.as_mut() else {
            return Ok(None);
        };
        let Some(status) = child.wait_exit(timeout).map_err(Error::Process)? else {
            return Ok(None);
        };
        self.child = None;
        Ok(Some(VmEnd::read(status, &self.exit_file())))
    }

    /// The VMM's exit report file in the runtime directory.
    fn exit_file(&self) -> PathBuf {
        self.dir
            .as_deref()
            .map_or_else(PathBuf::new, |dir| dir.join(EXIT_FILE))
    }

    /// Stops the VM (SIGTERM, then SIGKILL after a grace period) and removes its runtime
    /// directory.
    ///
    /// # Errors
    /// [`Error::Process`] when the VMM cannot be stopped or reaped.
    pub fn destroy(mut self) -> Result<(), Error> {
        self.teardown()
    }

    pub(crate) fn teardown(&mut self) -> Result<(), Error> {
        let result = match self.child.take() {
            Some(mut child) => child
                .terminate(STOP_GRACE)
                .map(|_| ())
                .map_err(Error::Process),
            None => Ok(()),
        };
        // Every proxy task and socket ends here (after the guest that used them).
        if let Some(proxy) = self.egress.take() {
            proxy.shutdown();
        }
        if let Some(dir) = self.dir.take() {
            if let Err(e) = fs::remove_dir_all(&dir) {
                if e.kind() != io::ErrorKind::NotFound {
                    tracing::warn!("cannot remove the sandbox runtime directory: {e}");
                }
            }
        }
        result
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        if let Err(e) = self.teardown() {
            tracing::warn!("sandbox teardown: {e}");
        }
    }
}

pub(crate) fn make_runtime_dir(parent: &Path) -> Result<tempfile::TempDir, Error> {
    let err = |source| Error::RuntimeDir {
        path: parent.to_owned(),
        source,
    };
    fs::create_dir_all(parent).map_err(err)?;
    // Resolved, so that a jailed VMM finds the directory at the path its configuration names.
    let parent = fs::canonicalize(parent).map_err(err)?;
    tempfile::Builder::new()
        .prefix("sb-")
        .tempdir_in(parent)
        .map_err(err)
}

fn write_vm_config(
    config: &SandboxConfig,
    disks: &Prepared,
    ws: &workspace::Prepared,
    uds_path: &Path,
    path: &Path,
) -> Result<VmConfig, Error> {
    let mut shared = ws.shares_with(&config.mounts)?;
    // The mounts' shares come first (then a workspace's).
    let mounts = shared.shares.iter_mut().take(config.mounts.len());
    for share in mounts.filter(|s| s.read_only) {
        share.follow_host_mounts = config.follow_host_mounts;
    }
    crate::snapshot::check_share_slots(config)?;
    let runtime = path.parent().unwrap_or(Path::new("."));
    shared
        .shares
        .extend(crate::snapshot::idle_shares(runtime, config.share_slots)?);
    let boot = BootParams {
        hostname: config.hostname.clone(),
        root: disks.root.clone(),
        workspace: ws.param.clone(),
        mounts: shared.params,
        egress: config.egress.is_some(),
    };
    let params = boot
        .to_params()
        .map_err(|e| Error::BootParams(e.to_string()))?;
    if let Some(reserved) = config.extra_cmdline.iter().find(|p| is_bulkhead_param(p)) {
        return Err(Error::BootParams(format!(
            "extra kernel parameter {reserved:?}: the `bulkhead.` keys are the guest agent's \
             boot parameters, set from the sandbox's settings"
        )));
    }
    let mut cmdline = format!("{DEFAULT_CMDLINE} quiet");
    for extra in params.iter().chain(&config.extra_cmdline) {
        cmdline.push(' ');
        cmdline.push_str(extra);
    }
    let vm = VmConfig {
        kernel: jail::resolved(&config.kernel),
        initrd: Some(jail::resolved(&config.initrd)),
        cmdline: Some(cmdline),
        vcpus: config.vcpus,
        memory_mib: config.memory_mib,
        serial: match &config.console {
            SerialOutput::File(file) => SerialOutput::File(jail::resolved(file)),
            other => other.clone(),
        },
        debugcon: None,
        vsock: Some(VsockConfig {
            guest_cid: DEFAULT_GUEST_CID,
            uds_path: uds_path.to_owned(),
        }),
        disks: disks
            .disks
            .iter()
            .map(|d| DiskConfig {
                path: jail::resolved(&d.path),
                ..d.clone()
            })
            .collect(),
        shares: shared.shares,
    };
    let json = serde_json::to_vec_pretty(&vm).map_err(|e| Error::RuntimeDir {
        path: path.to_owned(),
        source: io::Error::other(e),
    })?;
    fs::write(path, json).map_err(|source| Error::RuntimeDir {
        path: path.to_owned(),
        source,
    })?;
    Ok(vm)
}

/// The files a starting VMM writes: its log and its exit report.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RunFiles<'a> {
    pub(crate) log: &'a Path,
    pub(crate) exit: &'a Path,
}

pub(crate) fn wait_ready(
    listener: &UnixListener,
    child: &mut Child,
    files: RunFiles<'_>,
    timeout: Duration,
) -> Result<Ready, Error> {
    let pidfd = process::pidfd(child).map_err(Error::Process)?;
    match process::wait_either(listener, &pidfd, timeout).map_err(Error::Process)? {
        Woken::Ready => accept_ready(listener, Duration::from_secs(10)).map_err(Error::Ready),
        Woken::Exited => {
            let status = child.wait().map_err(Error::Process)?;
            let end = VmEnd::read(status.into(), files.exit);
            let log = log_or_explanation(tail_lines(files.log, LOG_TAIL_LINES), end.is_clean());
            Err(Error::VmExited {
                end: Box::new(end),
                log,
            })
        }
        Woken::TimedOut => Err(Error::ReadyTimeout {
            timeout,
            log: tail_lines(files.log, LOG_TAIL_LINES),
        }),
    }
}

/// Whether `stream` is still open with nothing to read: a non-blocking peek finds no byte
/// (end of file or data both mean that the connection can no longer carry a request).
fn idle_and_open(stream: &UnixStream) -> bool {
    let mut byte = 0u8;
    // SAFETY: `recv` writes at most one byte, into `byte`, which outlives the call; the fd is
    // borrowed from `stream`, open for the call. MSG_PEEK leaves the byte in the socket and
    // MSG_DONTWAIT keeps the call from blocking whatever the stream's mode.
    let n = unsafe {
        libc::recv(
            stream.as_raw_fd(),
            std::ptr::addr_of_mut!(byte).cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::WouldBlock
}

#[cfg(test)]
#[path = "sandbox_tests.rs"]
mod tests;
