//! Sandbox snapshots: save a running sandbox's VM to a directory ([`Sandbox::snapshot_into`])
//! and start new sandboxes from it ([`Sandbox::restore`]), each a distinct machine.
//!
//! A snapshot directory holds the VMM's files (`state`, `memory`; see `bulkhead_vmm::snapshot`)
//! and [`MANIFEST_FILE`], the sandbox-level facts a restore checks first ([`Manifest`]).
//!
//! A restored sandbox continues where the snapshot paused the guest: its processes, files in
//! guest RAM (`/tmp`, the initramfs root) and kernel state are as they were. The host then
//! tells the agent it was restored (`RestoredRequest`): the agent mixes host entropy into the
//! guest's random pool and reseeds its CRNG (every clone starts with the snapshot's pool), sets
//! the wall clock (frozen at the snapshot's time otherwise) and the hostname. What stays
//! identical in every clone, and why that is acceptable: the kernel's boot ID
//! (`/proc/sys/kernel/random/boot_id`: one boot, many resumes), its KASLR offset and the
//! addresses of kernel and user mappings made before the snapshot (an attacker inside one clone
//! learns them about the others, which share nothing else with it), and PIDs.
//!
//! As root the VMM is jailed as for a boot (`crate::jail`): a jailed VMM writes its snapshot into
//! its runtime directory, whence it is moved to the destination, and a restoring one sees the
//! snapshot's two files read-only.
//!
//! A restore can attach host directories (mounts, a workspace) to the idle virtio-fs devices
//! that a sandbox started with [`SandboxConfig::share_slots`] keeps for them (the private `slots` module), and
//! give the clone a network: its own egress proxy (a new per-sandbox CA, new placeholders),
//! started before the VMM as for a boot; the agent starts its relay when told so in the
//! `RestoredRequest` and the new CA is added to the guest's trust ([`crate::egress`]). A
//! snapshot's read-only disks (a root filesystem image, with the writable layer in guest RAM)
//! are opened again by path; the manifest records each file's identity and a restore refuses
//! one that changed. Writable disks (the sandbox's scratch disk, the caller's data disks) are
//! saved with the snapshot, and every restore writes to its own copy-on-write disk over the
//! saved one (the private `disks` module). A restore cannot add disks.

use std::fs;
use std::io::{self, Read};
use std::path::Path;
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bulkhead_protocol::client::{AgentClient, ClientError};
use bulkhead_protocol::{ErrorCode, Ready, RestoredRequest, PROTOCOL_VERSION};
use bulkhead_vmm::config::VmConfig;
use bulkhead_vmm::control::{self, Request};
use bulkhead_vmm::snapshot::SnapshotRequest;
use serde::{Deserialize, Serialize};

use crate::egress::{self, install_egress_ca, start_egress};
use crate::jail::{self, Jail};
use crate::phases::{self, Timings, REPORT_FILE};
use crate::process::{self, SpawnOptions};
use crate::sandbox::{
    api_sock_args, log_or_explanation, make_runtime_dir, tail_lines, Error, Sandbox, SandboxConfig,
    API_SOCKET, EXIT_FILE,
};
use crate::vmm_process::{VmEnd, VmmProcess};
use crate::workspace;

mod attach;
mod disks;
mod files;
mod slots;

pub use attach::{check_attachable, clone_identity};
pub use disks::DiskIdentity;
pub use slots::ShareSlots;
pub(crate) use slots::{check_boot as check_share_slots, idle_shares};

/// The sandbox-level manifest in a snapshot directory.
pub const MANIFEST_FILE: &str = "sandbox.json";

/// Bytes of host entropy sent to a restored guest.
const ENTROPY_BYTES: usize = 64;

/// How long a snapshotted VMM gets to exit after writing the snapshot.
const EXIT_AFTER_SNAPSHOT: Duration = Duration::from_secs(10);

/// Pause between attempts to reach a restored guest's agent.
const RETRY_PAUSE: Duration = Duration::from_millis(5);

/// What a snapshot directory holds besides the VM (`sandbox.json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// The bulkhead version that wrote it.
    pub bulkhead_version: String,
    /// When the snapshot was taken, ms since the Unix epoch.
    pub created_unix_ms: u64,
    /// Guest RAM, MiB.
    pub memory_mib: u32,
    /// vCPUs.
    pub vcpus: u8,
    /// The agent's readiness announcement from the sandbox's boot.
    pub ready: Ready,
    /// The VM's disks as they were at the snapshot: a read-only one (a root filesystem image) a
    /// restore opens again and refuses once changed; a writable one (a scratch or data disk) is
    /// saved with the snapshot. Absent when it had none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disks: Vec<DiskIdentity>,
}

impl Manifest {
    /// Reads the manifest of the snapshot in `dir`.
    ///
    /// # Errors
    /// [`Error::Snapshot`] when it is missing or unreadable (not a snapshot directory).
    pub fn read(dir: &Path) -> Result<Manifest, Error> {
        let path = dir.join(MANIFEST_FILE);
        let bytes = fs::read(&path).map_err(|e| {
            Error::Snapshot(format!(
                "{} is not a sandbox snapshot ({}: {e})",
                dir.display(),
                path.display()
            ))
        })?;
        serde_json::from_slice(&bytes)
            .map_err(|e| Error::Snapshot(format!("{}: {e}", path.display())))
    }

    fn write(&self, dir: &Path) -> Result<(), Error> {
        let path = dir.join(MANIFEST_FILE);
        let json = serde_json::to_vec_pretty(self).map_err(|e| Error::Snapshot(e.to_string()))?;
        fs::write(&path, json).map_err(|e| Error::Snapshot(format!("{}: {e}", path.display())))
    }
}

impl Sandbox {
    /// Snapshots the sandbox's VM into `dir` (created if missing) and ends the sandbox, as
    /// `destroy` does (what is left of `self` is an ended sandbox, for its caller to drop).
    /// Take it when nothing runs that needs the host: connections to the sandbox are reset in
    /// every restored copy.
    ///
    /// The agent first unmounts the guest's shared directories (mounts, a workspace; a clone
    /// workspace's changes stay in the guest): a share in use by the guest cannot be saved. A
    /// restore with the same mounts and workspace mounts them again; the workspace's records
    /// (for `diff`) are kept with the snapshot.
    ///
    /// A jailed VMM writes the snapshot into its runtime directory's `vmm/snapshot` (the only
    /// place it may write), from where it is moved into `dir`.
    ///
    /// Writable disks are saved into `dir` as they were: the scratch disk moved, a data disk of
    /// the caller's copied (holes kept; restores never use the caller's file, which the sandbox
    /// left as its guest wrote it).
    ///
    /// # Errors
    /// [`Error::SnapshotRefused`] while a guest process uses a file under a shared directory or
    /// the guest mounted something over, inside or from one, and when the VMM refused (e.g. an
    /// older agent left a share mounted) and the guest still answers: the sandbox runs on, its
    /// shares mounted again. [`Error::Snapshot`] when the VMM has no control socket (a sandbox
    /// adopted from an older bulkhead), cannot be reached, or the guest no longer answers after
    /// a refusal, or the files cannot be written (a writable data disk that is no regular file
    /// included: the sandbox has ended then).
    pub fn snapshot_into(&mut self, dir: &Path, config: &SandboxConfig) -> Result<Manifest, Error> {
        let runtime = self.dir.clone().unwrap_or_default();
        let socket = runtime.join(API_SOCKET);
        if !socket.exists() {
            return Err(Error::Snapshot(
                "this sandbox's VMM has no control socket (it was started by an older bulkhead)"
                    .into(),
            ));
        }
        let jailed = runtime.join(jail::ROOT_DIR).exists();
        let target = match jailed {
            true => runtime.join(JAILED_SNAPSHOT_DIR),
            false => dir.to_owned(),
        };
        let request = Request::Snapshot(SnapshotRequest {
            dir: target.clone(),
            resume: false,
        });
        // A connection left idle for a command would be reset by the restore anyway.
        self.spare = None;
        let refused = |reason: String| {
            let log = self.log_tail(20);
            match log.trim().is_empty() {
                true => Error::Snapshot(reason),
                false => Error::Snapshot(format!("{reason}; VMM log:\n{log}")),
            }
        };
        self.unmount_shares()?;
        let answer = control::send(&socket, &request).map_err(refused)?;
        if !answer.ok {
            // The VMM saved nothing and resumed the guest: its directories come back (with
            // nothing unmounted the request changes nothing), and an agent that answers shows
            // that the sandbox runs on.
            let reason = answer.error.unwrap_or_default();
            if jailed {
                let _ = fs::remove_dir_all(&target);
            }
            return Err(match self.client().set_shares_mounted(true) {
                Ok(()) | Err(ClientError::Agent(_)) => Error::SnapshotRefused(reason),
                Err(e) => {
                    tracing::error!("the guest does not answer after a refused snapshot: {e}");
                    refused(reason)
                }
            });
        }
        if jailed {
            files::move_snapshot(&target, dir)?;
        }
        workspace::keep(&runtime, dir)?;
        let mut disks = disks::identities(dir)?;
        disks::save(dir, &runtime, &mut disks)?;
        let manifest = Manifest {
            bulkhead_version: env!("CARGO_PKG_VERSION").into(),
            created_unix_ms: unix_ms(SystemTime::now()),
            memory_mib: config.memory_mib,
            vcpus: config.vcpus,
            ready: self.ready.clone(),
            disks,
        };
        manifest.write(dir)?;
        files::restrict(dir)?;
        if self.wait_exit(EXIT_AFTER_SNAPSHOT)?.is_none() {
            tracing::warn!("the VMM did not exit after its snapshot; stopping it");
        }
        self.teardown()?;
        Ok(manifest)
    }

    /// Asks the agent to unmount the guest's virtio-fs shares before a snapshot (a share with a
    /// live FUSE session cannot be saved); the restore mounts them again. An agent older than
    /// the request unmounts nothing, and the VMM's own check refuses the snapshot if a share is
    /// still mounted.
    ///
    /// # Errors
    /// [`Error::SnapshotRefused`] when the agent refuses (a guest process uses a file under a
    /// share: its message names them); [`Error::Snapshot`] when it cannot be reached. Nothing
    /// was unmounted then.
    fn unmount_shares(&self) -> Result<(), Error> {
        match self.client().set_shares_mounted(false) {
            Ok(()) => Ok(()),
            Err(ClientError::Agent(e)) if e.code == ErrorCode::Protocol => Ok(()),
            Err(ClientError::Agent(e)) => Err(Error::SnapshotRefused(e.message)),
            Err(e) => Err(Error::Snapshot(format!(
                "the guest's shared directories cannot be unmounted for the snapshot: {e}"
            ))),
        }
    }

    /// Starts a sandbox from the snapshot in `dir`: a new VMM restores the VM (its memory
    /// shared copy-on-write with every other restore of `dir`), then the agent is told it was
    /// restored and made distinct (entropy, clock, hostname; see the module docs) and mounts
    /// `config`'s mounts and workspace, attached to the snapshot's share slots. `config` gives
    /// the VMM binary, runtime directory, console, timeout and cgroups; its memory and vCPUs
    /// must be the snapshot's. With `config.egress` the clone gets a network of its own (see the
    /// module docs).
    ///
    /// # Errors
    /// [`Error::Snapshot`] for a directory that is no snapshot, a size mismatch or too few share
    /// slots; [`Error::Egress`] when the proxy cannot start or its CA cannot be installed;
    /// [`Error::Mount`] and
    /// [`Error::Workspace`] for unusable directories; [`Error::VmExited`] with
    /// the VMM's log when the restore fails (a corrupt or truncated snapshot, another CPU);
    /// [`Error::ReadyTimeout`]. Nothing is left running or on disk when this fails.
    pub fn restore(config: &SandboxConfig, dir: &Path) -> Result<Sandbox, Error> {
        let started = Instant::now();
        let manifest = Manifest::read(dir)?;
        check_restorable(config, &manifest, dir)?;
        let ws = workspace::prepare(config.workspace.as_ref(), &config.mounts)?;
        let runtime = make_runtime_dir(&config.runtime_dir)?;
        let saved = bulkhead_vmm::snapshot::share_tags(dir)
            .map_err(|e| Error::Snapshot(format!("{}: {e}", dir.display())))?;
        let attached = slots::attach(config, &ws, &saved, runtime.path())?;
        workspace::record(runtime.path(), &ws, Some(dir))?;
        let uds_path = runtime.path().join("vm.sock");
        let log_path = runtime.path().join("vmm.log");
        let exit_path = runtime.path().join(EXIT_FILE);
        let report_path = runtime.path().join(REPORT_FILE);
        jail::make_vmm_dir(runtime.path())?;
        let jail_args = match jail::active(config.jail) {
            true => {
                let vm = VmConfig {
                    shares: attached.shares.clone(),
                    ..VmConfig::new(dir.join("state"))
                };
                Jail::prepare(runtime.path(), &vm, None, config.jail_owner)?.args()
            }
            false => Vec::new(),
        };
        // Listening before the guest resumes; stopped (dropped) if anything below fails.
        let egress = start_egress(config, runtime.path(), &uds_path)?;
        let egress_log = egress::log_path(config.egress.as_ref(), runtime.path());
        let mut launch = restore_args(config, dir, runtime.path(), &uds_path);
        launch.extend(attached.args());
        launch.extend(disks::restore_args(dir, runtime.path(), &manifest.disks)?);
        let launch: Vec<&std::ffi::OsStr> = launch.iter().map(|a| a.as_os_str()).collect();
        let options = SpawnOptions {
            kill_on_parent_exit: config.kill_on_parent_exit,
            cgroup_procs: &config.cgroup_procs,
            timings_json: Some(&report_path),
            exit_file: Some(&exit_path),
            extra_args: &jail_args,
        };
        let child = process::spawn_vmm(&config.vmm_binary, &launch, &log_path, options).map_err(
            |source| Error::Spawn {
                vmm: config.vmm_binary.clone(),
                source,
            },
        )?;
        let spawn = started.elapsed();
        let mut sandbox = Sandbox {
            dir: Some(runtime.keep()),
            child: Some(VmmProcess::Child(child)),
            uds_path,
            ready: manifest.ready,
            timings: Timings {
                spawn,
                ready: Duration::ZERO,
                vmm_start: None,
                phases: None,
            },
            clock: None,
            first_output: OnceLock::new(),
            egress,
            egress_log,
            spare: None,
        };
        // Dropping the sandbox on an error stops the VMM and the proxy and removes the runtime
        // directory.
        sandbox.tell_restored(config, &attached.params)?;
        let client = AgentClient::hybrid(&sandbox.uds_path).with_timeout(config.ready_timeout);
        install_egress_ca(&client, sandbox.egress.as_ref())?;
        let ready_at = Instant::now();
        let (clock, phases) = phases::read_restored(&report_path, ready_at);
        sandbox.timings.ready = ready_at - started;
        sandbox.timings.vmm_start = clock.map(|c| c.origin().saturating_duration_since(started));
        sandbox.timings.phases = phases;
        sandbox.clock = clock;
        Ok(sandbox)
    }

    /// Sends the agent its [`RestoredRequest`], retrying while the restored guest's vsock comes
    /// back, until `config.ready_timeout`.
    fn tell_restored(&mut self, config: &SandboxConfig, shares: &[String]) -> Result<(), Error> {
        let deadline = Instant::now() + config.ready_timeout;
        let client = AgentClient::hybrid(&self.uds_path).with_timeout(config.ready_timeout);
        let started = Instant::now();
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let mut request = restored_request(config.hostname.clone())?;
            request.share_params = shares.to_vec();
            request.egress = config.egress.is_some();
            let tried = Instant::now();
            let attempt = client.restored(&request);
            match attempt {
                Ok(()) => {
                    tracing::debug!(
                        attempts,
                        waited_ms = (tried - started).as_millis() as u64,
                        answered_ms = tried.elapsed().as_millis() as u64,
                        "the restored guest's agent acknowledged the restore"
                    );
                    return Ok(());
                }
                // The agent answered: retrying would not change its mind (e.g. a share it could
                // not mount).
                Err(ClientError::Agent(refusal)) => {
                    return Err(Error::Snapshot(format!(
                        "the restored guest's agent refused the restore: {}",
                        refusal.message
                    )))
                }
                Err(e) => {
                    if let Some(end) = self.wait_exit(Duration::ZERO)? {
                        return Err(self.exited(end));
                    }
                    if Instant::now() >= deadline {
                        return Err(Error::ReadyTimeout {
                            timeout: config.ready_timeout,
                            log: format!("last attempt: {e}\n{}", self.log_tail(20)),
                        });
                    }
                    std::thread::sleep(RETRY_PAUSE);
                }
            }
        }
    }

    /// [`Error::VmExited`] for a VMM that ended during a restore.
    fn exited(&self, end: VmEnd) -> Error {
        let log = self
            .dir
            .as_deref()
            .map(|d| tail_lines(&d.join("vmm.log"), 20))
            .unwrap_or_default();
        let clean = end.is_clean();
        Error::VmExited {
            end: Box::new(end),
            log: log_or_explanation(log, clean),
        }
    }
}

/// Refuses what a restore cannot honour.
fn check_restorable(config: &SandboxConfig, manifest: &Manifest, dir: &Path) -> Result<(), Error> {
    let refuse = |what: String| Err(Error::Snapshot(what));
    if config.memory_mib != manifest.memory_mib {
        return refuse(format!(
            "the snapshot has {} MiB of guest memory, not {} MiB; a restore cannot change it",
            manifest.memory_mib, config.memory_mib
        ));
    }
    if config.vcpus != manifest.vcpus {
        return refuse(format!(
            "the snapshot has {} vCPUs, not {}; a restore cannot change them",
            manifest.vcpus, config.vcpus
        ));
    }
    disks::check(dir, &manifest.disks)
}

/// Where a jailed VMM writes a snapshot, in its runtime directory.
const JAILED_SNAPSHOT_DIR: &str = "vmm/snapshot";

/// `--restore DIR --vsock-uds ... --api-sock ... --serial ...`.
fn restore_args(
    config: &SandboxConfig,
    dir: &Path,
    runtime: &Path,
    uds_path: &Path,
) -> Vec<std::ffi::OsString> {
    let serial: std::ffi::OsString = match &config.console {
        bulkhead_vmm::config::SerialOutput::Stdout => "stdout".into(),
        bulkhead_vmm::config::SerialOutput::Off => "off".into(),
        bulkhead_vmm::config::SerialOutput::File(p) => p.clone().into_os_string(),
    };
    let mut args: Vec<std::ffi::OsString> = vec![
        "--restore".into(),
        jail::resolved(dir).into_os_string(),
        "--vsock-uds".into(),
        uds_path.as_os_str().to_owned(),
        "--serial".into(),
        serial,
    ];
    args.extend(api_sock_args(runtime));
    args
}

/// A [`RestoredRequest`] with fresh host entropy, the host's wall clock now and `hostname`: what
/// makes a restored guest a machine of its own (see the module docs), for a restore and for a
/// warm clone handed out later.
///
/// # Errors
/// [`Error::Snapshot`] when the host's `/dev/urandom` cannot be read.
pub fn restored_request(hostname: Option<String>) -> Result<RestoredRequest, Error> {
    let mut entropy = vec![0u8; ENTROPY_BYTES];
    fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut entropy))
        .map_err(|e: io::Error| Error::Snapshot(format!("cannot read host entropy: {e}")))?;
    Ok(RestoredRequest {
        version: PROTOCOL_VERSION,
        entropy,
        realtime_ns: u64::try_from(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos(),
        )
        .unwrap_or(u64::MAX),
        hostname,
        share_params: Vec::new(),
        egress: false,
    })
}

fn unix_ms(t: SystemTime) -> u64 {
    u64::try_from(t.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis()).unwrap_or(0)
}
