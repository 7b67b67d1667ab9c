//! The microVM backend: one bulkhead sandbox per pod, containers run in it by the agent's
//! container execs.
//!
//! `create` reads the bundle's `config.json` and mounts containerd's rootfs mounts in the pod's
//! roots directory ([`crate::pod_roots`]); the pod's first container boots the pod's VM
//! ([`bulkhead_sandbox::Sandbox`]) sized by its spec ([`oci::vm_size`]), with that directory
//! shared into the guest read-only at [`GUEST_ROOTS`], following the host's mounts under it: each
//! container's root is [`GUEST_ROOTS`]`/<container id>`, and a later container of the pod joins
//! the running VM by a mount on the host. `start` runs the OCI process there as a container exec
//! ([`oci::exec_request`]) and carries its stdio between containerd's FIFOs and the exec's
//! stream on two threads; the exec's `Exit` becomes the process's exit. Execs join the init
//! process's namespaces. `delete` of the pod's last container destroys the VM and unmounts.
//!
//! The share is read-only: the container writes to a layer of its own in guest RAM (the agent's
//! overlay; OCI `root.readonly` gives it the root read-only instead), so containerd's snapshot
//! never changes.
//!
//! The VMM runs in the cgroup the first container's spec names ([`crate::pod_cgroup`]); the ports
//! its `bulkhead.io/ports` annotation declares are forwarded into the VM ([`crate::ports`]); its
//! `bulkhead.io/network`, `allow`, `deny` and `allow-cidr` annotations give the pod a network
//! through an egress proxy of its own ([`crate::network`]), whose proxy variables every process of
//! the pod's containers gets.
//!
//! The VM's size is the first container's (under Kubernetes, the pod sandbox's, whose spec has
//! the pod's annotations). `Stats` reports the pod VM's usage as its host cgroup counts it (memory
//! charged, CPU time, threads; the same for every container of the pod) and the guest's RAM as
//! the memory limit. `Update` sets the pod VM's cgroup v2 limits ([`crate::update`]); the
//! guest's RAM and vCPUs stay as booted. A process the guest's OOM killer killed (the agent's
//! `oom_killed`), and a container's first process lost with a VMM the host's OOM killer killed
//! ([`pod_cgroup::HostOom`]), end OOM-killed, which the task service publishes as `TaskOOM`. Not
//! yet: per-container usage inside the guest.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use bulkhead_protocol::client::{AgentClient, ExecEvent, ExecReader, ExecWriter};
use bulkhead_protocol::{ExecRequest, ExitStatus, WindowSize};
use bulkhead_sandbox::cgroup::{Version, VmCgroup};
use bulkhead_sandbox::ingress::Published;
use bulkhead_sandbox::{Mount as Share, Sandbox, SandboxConfig};
use oci_spec::runtime::{Process, Spec};
use tokio::sync::oneshot;

use crate::backend::{
    Backend, BackendError, ContainerSpec, Ended, ExecProcess, Resources, StartSpec, Started, Stats,
};
use crate::network;
use crate::oci;
use crate::pod_cgroup::{self, HostOom};
use crate::pod_roots::{PodRoots, PODS_DIR};
use crate::ports;
use crate::state::{Exit, ProcessKey, Stdio};
use crate::update;

/// Where each container's root is shared in the guest: `<GUEST_ROOTS>/<container id>`.
pub const GUEST_ROOTS: &str = "/run/bulkhead/containers";

/// Exit status of a process whose exec stream broke without an exit (the VM is gone).
const LOST: u32 = 255;

/// One pod's VM.
struct Pod {
    sandbox: Sandbox,
    roots: PodRoots,
    /// The pod's cgroup, which the VMM runs in ([`crate::pod_cgroup`]).
    cgroup: Option<VmCgroup>,
    /// The pod's forwarded ports ([`crate::ports`]); dropped with the pod.
    _published: Option<Published>,
    memory_mib: u32,
    vcpus: u8,
    /// The host OOM killer's count in the pod's cgroup since the boot.
    host_oom: Option<HostOom>,
    /// How long a request to the pod's agent may wait for an answer: the boot timeout.
    patience: Duration,
    /// The proxy variables of the pod's network for its containers ([`crate::network`]).
    proxy_env: Vec<(String, String)>,
}

/// How long a pod's VM may take to boot when the backend is given no base configuration: longer
/// than the library's default (60 s), since a pod start on a loaded node is no reason to fail
/// (the kubelet's own patience is minutes).
pub const DEFAULT_BOOT_TIMEOUT: Duration = Duration::from_secs(180);

/// What starting a process needs: the agent request, the client of the container's VM and,
/// for a container's first process, the pod's host OOM watch.
type Request = (ExecRequest, AgentClient, Option<HostOom>);

/// One container.
struct Container {
    pod: String,
    guest_root: String,
    read_only_root: bool,
    process: Process,
    client: AgentClient,
    init_pid: Option<u32>,
    /// The pod network's proxy variables, added to each process's environment.
    proxy_env: Vec<(String, String)>,
    /// The pod's host OOM watch ([`Pod::host_oom`]).
    host_oom: Option<HostOom>,
}

/// The microVM backend (see the module documentation).
#[derive(Default)]
pub struct VmBackend {
    base: Option<SandboxConfig>,
    /// Held through a create: a pod's second container waits for its first one's VM.
    creating: Mutex<()>,
    pods: Mutex<HashMap<String, Pod>>,
    containers: Mutex<HashMap<String, Container>>,
    running: Mutex<HashMap<ProcessKey, ExecWriter>>,
}

impl std::fmt::Debug for VmBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmBackend").finish_non_exhaustive()
    }
}

fn failed(e: impl std::fmt::Display) -> BackendError {
    BackendError::Failed(e.to_string())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl VmBackend {
    /// A backend whose VMs start from `base` (kernel, initramfs, VMM binary, runtime directory);
    /// memory, vCPUs and shares come from each pod's spec. `None`: this machine's defaults
    /// (`SandboxConfig::default`, which honours `BULKHEAD_KERNEL`, `BULKHEAD_INITRD`,
    /// `BULKHEAD_VMM`).
    pub fn new(base: Option<SandboxConfig>) -> VmBackend {
        VmBackend {
            base,
            ..VmBackend::default()
        }
    }

    /// The configuration VMs start from (see [`VmBackend::new`]).
    fn base_config(&self) -> SandboxConfig {
        self.base.clone().unwrap_or_else(|| SandboxConfig {
            ready_timeout: DEFAULT_BOOT_TIMEOUT,
            ..SandboxConfig::default()
        })
    }

    /// Where pods' roots directories are made: `<runtime dir>/pods`.
    pub fn pods_dir(&self) -> PathBuf {
        self.base_config().runtime_dir.join(PODS_DIR)
    }

    /// Boots the VM of a pod whose roots directory is `roots`, sized by its first container's
    /// `spec`, in the pod's cgroup, with its ports forwarded and its network. On failure
    /// everything made so far is undone (the VM stopped, the cgroup removed, the roots closed).
    fn boot(&self, spec: &Spec, roots: PodRoots) -> Result<Pod, BackendError> {
        let mut made = Undo {
            roots: Some(roots),
            cgroup: None,
        };
        let invalid = |e: &dyn std::fmt::Display| BackendError::InvalidArgument(e.to_string());
        let size = oci::vm_size(spec);
        let egress = network::settings(spec).map_err(|e| invalid(&e))?;
        made.cgroup = match pod_cgroup::path_of(spec).map_err(failed)? {
            Some(path) => pod_cgroup::create(&path, size).map_err(failed)?,
            None => None,
        };
        // The pod's ports are bound before the boot: a port in use fails the create at once.
        let listeners = ports::mappings(spec)
            .and_then(|m| ports::bind(spec, &m))
            .map_err(|e| invalid(&e))?;
        let config = SandboxConfig {
            memory_mib: size.memory_mib,
            vcpus: size.vcpus,
            mounts: vec![Share {
                host: made.roots_path(),
                guest: PathBuf::from(GUEST_ROOTS),
                read_only: true,
            }],
            follow_host_mounts: true,
            kill_on_parent_exit: true,
            cgroup_procs: made
                .cgroup
                .as_ref()
                .map(VmCgroup::procs_files)
                .unwrap_or_default(),
            egress,
            ..self.base_config()
        };
        // Dropped (the VM stopped) before `made` undoes the rest, should anything below fail.
        let sandbox = Sandbox::start(&config).map_err(failed)?;
        let published = match listeners.is_empty() {
            true => None,
            false => Some(Published::serve(&sandbox.client(), listeners).map_err(failed)?),
        };
        let proxy_env = network::proxy_env(sandbox.egress_env());
        let Some((roots, cgroup)) = made.keep() else {
            return Err(failed("the pod's roots were closed during its boot"));
        };
        Ok(Pod {
            sandbox,
            roots,
            host_oom: cgroup.as_ref().and_then(HostOom::of),
            cgroup,
            _published: published,
            memory_mib: size.memory_mib,
            vcpus: size.vcpus,
            // The first exec of a guest that has just come up on a loaded host can take far
            // longer than the client's default 10 s to start, as for `bulkhead run`.
            patience: config.ready_timeout.max(Duration::from_secs(10)),
            proxy_env,
        })
    }

    fn create_blocking(&self, spec: &ContainerSpec) -> Result<u32, BackendError> {
        let _one_at_a_time = lock(&self.creating);
        let bundle = Path::new(&spec.bundle);
        let oci_spec =
            oci::load(bundle).map_err(|e| BackendError::InvalidArgument(e.to_string()))?;
        let process = oci_spec
            .process()
            .clone()
            .ok_or_else(|| BackendError::InvalidArgument(oci::OciError::NoProcess.to_string()))?;
        let root = oci_spec
            .root()
            .as_ref()
            .map_or(PathBuf::from("rootfs"), |r| r.path().clone());
        let bundle_rootfs = bundle.join(root);
        let running = lock(&self.pods).contains_key(&spec.pod);
        if !running {
            // The first container's root is mounted before the VM boots; later ones join it.
            let roots = PodRoots::open(&self.pods_dir(), &spec.pod).map_err(failed)?;
            if let Err(e) = roots.add(&spec.id, &spec.rootfs, &bundle_rootfs) {
                let _ = roots.close();
                return Err(failed(e));
            }
            let pod = self.boot(&oci_spec, roots)?;
            lock(&self.pods).insert(spec.pod.clone(), pod);
        }
        let (pid, client, proxy_env, host_oom) = {
            let pods = lock(&self.pods);
            let pod = pods
                .get(&spec.pod)
                .ok_or_else(|| BackendError::NotFound(spec.pod.clone()))?;
            if running {
                pod.roots
                    .add(&spec.id, &spec.rootfs, &bundle_rootfs)
                    .map_err(failed)?;
            }
            let client = pod.sandbox.client().with_timeout(pod.patience);
            (
                pod.sandbox.vmm_pid().unwrap_or(0),
                client,
                pod.proxy_env.clone(),
                pod.host_oom.clone(),
            )
        };
        let container = Container {
            pod: spec.pod.clone(),
            guest_root: format!("{GUEST_ROOTS}/{}", spec.id),
            read_only_root: oci_spec
                .root()
                .as_ref()
                .and_then(|r| r.readonly())
                .unwrap_or(false),
            process,
            client,
            init_pid: None,
            proxy_env,
            host_oom,
        };
        lock(&self.containers).insert(spec.id.clone(), container);
        Ok(pid)
    }

    /// The agent request for `spec`, the client of its container's VM and, for a container's
    /// first process, the pod's host OOM watch.
    fn request_for(&self, spec: &StartSpec) -> Result<Request, BackendError> {
        let containers = lock(&self.containers);
        let c = containers
            .get(&spec.key.container)
            .ok_or_else(|| BackendError::NotFound(spec.key.container.clone()))?;
        let stdin = !spec.stdio.stdin.is_empty() && !spec.stdin_closed;
        let mut place = oci::Placement {
            root: &c.guest_root,
            join_pid: None,
            read_only_root: c.read_only_root,
        };
        let req = match &spec.exec {
            None => oci::exec_request(&c.process, place, stdin),
            Some(exec) => {
                place.join_pid = Some(c.init_pid.ok_or_else(|| {
                    BackendError::InvalidArgument(
                        "the container's first process is not running".into(),
                    )
                })?);
                oci::exec_request(&exec_process(&c.process, exec), place, stdin)
            }
        }
        .map_err(|e| BackendError::InvalidArgument(e.to_string()))?;
        let mut req = req;
        network::add_proxy_env(&mut req.env, &c.proxy_env);
        // A VMM the host killed takes every process along; its first process tells of it.
        let host_oom = spec.exec.is_none().then(|| c.host_oom.clone()).flatten();
        Ok((req, c.client.clone(), host_oom))
    }

    fn start_blocking(&self, spec: &StartSpec) -> Result<Started, BackendError> {
        let (req, client, host_oom) = self.request_for(spec)?;
        let session = client.exec(&req).map_err(failed)?;
        let pid = session.pid().ok_or_else(|| {
            BackendError::InvalidArgument(format!("{:?} could not be run", req.argv))
        })?;
        let (writer, reader) = session.split();
        if spec.exec.is_none() {
            if let Some(c) = lock(&self.containers).get_mut(&spec.key.container) {
                c.init_pid = Some(pid);
            }
        }
        lock(&self.running).insert(spec.key.clone(), writer.clone());
        let (tx, rx) = oneshot::channel();
        pump_output(reader, spec.stdio.clone(), host_oom, tx);
        if req.stdin {
            pump_input(spec.stdio.stdin.clone(), writer);
        }
        Ok(Started { pid, exit: rx })
    }

    fn writer(&self, key: &ProcessKey) -> Result<ExecWriter, BackendError> {
        lock(&self.running)
            .get(key)
            .cloned()
            .ok_or_else(|| BackendError::NotFound(format!("{key:?}")))
    }

    /// Applies `resources` to the cgroup v2 of `container_id`'s pod VM ([`crate::update`]).
    fn update_blocking(
        &self,
        container_id: &str,
        resources: &Resources,
    ) -> Result<(), BackendError> {
        let pod_id = lock(&self.containers)
            .get(container_id)
            .map(|c| c.pod.clone())
            .ok_or_else(|| BackendError::NotFound(container_id.into()))?;
        let pods = lock(&self.pods);
        let pod = pods
            .get(&pod_id)
            .ok_or_else(|| BackendError::NotFound(pod_id.clone()))?;
        let unsupported =
            |why: &str| BackendError::Unimplemented(format!("update of pod {pod_id}: {why}"));
        let cgroup = pod.cgroup.as_ref().ok_or_else(|| {
            unsupported("its VM has no host cgroup (no linux.cgroupsPath, or no cgroup hierarchy)")
        })?;
        if cgroup.spec().version != Version::V2 {
            return Err(unsupported("resource updates need a cgroup v2 host"));
        }
        let dir = cgroup
            .dirs()
            .into_iter()
            .next()
            .ok_or_else(|| unsupported("no cgroup directory"))?;
        let vm = update::PodVm {
            cgroup_dir: &dir,
            memory_mib: pod.memory_mib,
            vcpus: pod.vcpus,
        };
        Ok(update::apply(&vm, resources)?)
    }

    fn delete_blocking(&self, container_id: &str, pod: &str) -> Result<(), BackendError> {
        lock(&self.running).retain(|k, _| k.container != container_id);
        let (c, pod_left) = {
            let mut containers = lock(&self.containers);
            let Some(c) = containers.remove(container_id) else {
                return Ok(());
            };
            (c, containers.values().any(|other| other.pod == pod))
        };
        drop(c);
        if pod_left {
            let pods = lock(&self.pods);
            return match pods.get(pod) {
                Some(p) => p.roots.remove(container_id).map_err(failed),
                None => Ok(()),
            };
        }
        let Some(last) = lock(&self.pods).remove(pod) else {
            return Ok(());
        };
        // The VM goes first: its VMM holds the roots open.
        let destroyed = last.sandbox.destroy();
        let unmounted = last
            .roots
            .remove(container_id)
            .and_then(|()| last.roots.close());
        remove_cgroup(last.cgroup.as_ref());
        destroyed.map_err(failed)?;
        unmounted.map_err(failed)
    }
}

/// What a pod's boot made before its VM ran, undone when dropped unless kept.
struct Undo {
    roots: Option<PodRoots>,
    cgroup: Option<VmCgroup>,
}

impl Undo {
    /// The roots directory's path.
    fn roots_path(&self) -> PathBuf {
        self.roots
            .as_ref()
            .map(|r| r.path().to_owned())
            .unwrap_or_default()
    }

    /// Keeps what was made: the roots (present until kept) and the cgroup.
    fn keep(mut self) -> Option<(PodRoots, Option<VmCgroup>)> {
        let roots = self.roots.take()?;
        Some((roots, self.cgroup.take()))
    }
}

impl Drop for Undo {
    fn drop(&mut self) {
        if let Some(Err(e)) = self.roots.take().map(PodRoots::close) {
            tracing::warn!("{e}");
        }
        remove_cgroup(self.cgroup.take().as_ref());
    }
}

/// Removes a pod's cgroup (logging a failure: the container's delete goes on).
fn remove_cgroup(cgroup: Option<&VmCgroup>) {
    if let Some(Err(e)) = cgroup.map(VmCgroup::remove) {
        tracing::warn!("{e}");
    }
}

/// The init process's spec with an exec's args, env, cwd and terminal.
fn exec_process(init: &Process, exec: &ExecProcess) -> Process {
    let mut p = init.clone();
    p.set_args(Some(exec.args.clone()));
    p.set_env(Some(exec.env.clone()));
    if !exec.cwd.is_empty() {
        p.set_cwd(PathBuf::from(&exec.cwd));
    }
    p.set_terminal(Some(exec.terminal));
    p
}

/// containerd's status for an exec's end: the code, or 128 + the signal.
pub fn status_of(exit: &ExitStatus) -> u32 {
    exit.shell_code().map_or(LOST, |c| c.clamp(0, 255) as u32)
}

/// Opens containerd's output FIFO `path` for writing; nothing when containerd gave no path or
/// the FIFO has no reader left.
///
/// `open(2)` of a FIFO for writing waits for a reader, and the reader of a detached `ctr run
/// -d` may be gone by the time its process starts: a blocking open would stall the thread that
/// also reads the process's exit, and the task would never stop in containerd's eyes. So the
/// FIFO is opened non-blocking (`ENXIO` without a reader: the output is dropped, as it would
/// be unread), then set back to blocking writes, which pace the copy to a reader that exists.
fn open_out(path: &str) -> Option<File> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    if path.is_empty() {
        return None;
    }
    let file = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    let fd = file.as_raw_fd();
    // SAFETY: F_GETFL/F_SETFL on a descriptor we own; only O_NONBLOCK changes.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags >= 0 {
            libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK);
        }
    }
    Some(file)
}

/// Copies the exec's output to containerd's FIFOs on a thread of its own, then reports its end:
/// OOM-killed when the agent says so, or, for a stream that breaks first ([`LOST`]), when
/// `host_oom` counts a kill of the VMM.
fn pump_output(
    mut reader: ExecReader,
    stdio: Stdio,
    host_oom: Option<HostOom>,
    tx: oneshot::Sender<Ended>,
) {
    std::thread::spawn(move || {
        let mut out = open_out(&stdio.stdout);
        let mut err = match stdio.terminal {
            true => None,
            false => open_out(&stdio.stderr),
        };
        let (status, oom_killed) = loop {
            match reader.next_event() {
                Ok(Some(ExecEvent::Stdout(b))) => {
                    out.as_mut().map(|f| f.write_all(&b));
                }
                Ok(Some(ExecEvent::Stderr(b))) => {
                    err.as_mut().map(|f| f.write_all(&b));
                }
                Ok(Some(ExecEvent::Exit(s))) => break (status_of(&s), s.oom_killed),
                Ok(None) | Err(_) => break (LOST, host_oom.is_some_and(|h| h.killed())),
            }
        };
        drop((out, err));
        let exit = Exit {
            status,
            at: SystemTime::now(),
        };
        let _ = tx.send(Ended { exit, oom_killed });
    });
}

/// Copies containerd's stdin FIFO to the exec on a thread of its own; end of file closes the
/// command's stdin.
fn pump_input(path: String, writer: ExecWriter) {
    std::thread::spawn(move || {
        let Ok(mut fifo) = File::open(&path) else {
            let _ = writer.close_stdin();
            return;
        };
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            match fifo.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if writer.write_stdin(&buf[..n]).is_err() {
                        return;
                    }
                }
            }
        }
        let _ = writer.close_stdin();
    });
}

/// Runs `f` on the blocking pool with a clone of the backend's handle.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, BackendError> + Send + 'static,
) -> Result<T, BackendError> {
    tokio::task::spawn_blocking(f).await.map_err(failed)?
}

/// The shared backend; the task service holds it in an `Arc`.
#[derive(Debug, Clone, Default)]
pub struct SharedVmBackend(pub Arc<VmBackend>);

#[async_trait]
impl Backend for SharedVmBackend {
    async fn create(&self, spec: &ContainerSpec) -> Result<u32, BackendError> {
        let (me, spec) = (Arc::clone(&self.0), spec.clone());
        blocking(move || me.create_blocking(&spec)).await
    }
    async fn start(&self, spec: &StartSpec) -> Result<Started, BackendError> {
        let (me, spec) = (Arc::clone(&self.0), spec.clone());
        blocking(move || me.start_blocking(&spec)).await
    }
    async fn kill(&self, key: &ProcessKey, signal: u32, _all: bool) -> Result<(), BackendError> {
        let signo = i32::try_from(signal)
            .map_err(|_| BackendError::InvalidArgument(format!("signal {signal}")))?;
        self.0.writer(key)?.signal(signo).map_err(failed)
    }
    async fn resize_pty(
        &self,
        key: &ProcessKey,
        width: u32,
        height: u32,
    ) -> Result<(), BackendError> {
        let size = WindowSize {
            rows: u16::try_from(height).unwrap_or(u16::MAX).max(1),
            cols: u16::try_from(width).unwrap_or(u16::MAX).max(1),
        };
        self.0.writer(key)?.resize(size).map_err(failed)
    }
    async fn close_stdin(&self, key: &ProcessKey) -> Result<(), BackendError> {
        self.0.writer(key)?.close_stdin().map_err(failed)
    }
    async fn update(&self, id: &str, resources: &Resources) -> Result<(), BackendError> {
        let (me, id, resources) = (Arc::clone(&self.0), id.to_owned(), resources.clone());
        blocking(move || me.update_blocking(&id, &resources)).await
    }
    async fn stats(&self, container_id: &str) -> Result<Stats, BackendError> {
        let containers = lock(&self.0.containers);
        let c = containers
            .get(container_id)
            .ok_or_else(|| BackendError::NotFound(container_id.into()))?;
        let pods = lock(&self.0.pods);
        let Some(pod) = pods.get(&c.pod) else {
            return Ok(Stats::default());
        };
        let usage = pod.cgroup.as_ref().map(VmCgroup::usage).unwrap_or_default();
        Ok(Stats {
            memory_usage_bytes: usage.memory_bytes,
            memory_limit_bytes: u64::from(pod.memory_mib) << 20,
            cpu_usage_ns: usage.cpu_ns,
            pids: usage.pids,
        })
    }
    async fn delete(&self, container_id: &str, pod: &str) -> Result<(), BackendError> {
        let (me, id, pod) = (Arc::clone(&self.0), container_id.to_owned(), pod.to_owned());
        blocking(move || me.delete_blocking(&id, &pod)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::os::unix::fs::OpenOptionsExt;

    fn fifo(dir: &Path) -> PathBuf {
        let path = dir.join("stdout");
        let name = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: mkfifo(3) with a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
        path
    }

    #[test]
    fn an_output_fifo_without_a_reader_is_skipped_at_once_and_one_with_a_reader_gets_the_bytes() {
        // Arrange: one FIFO nobody reads (a detached `ctr run -d` gone), one with a reader.
        let dir = tempfile::tempdir().unwrap();
        let unread = fifo(dir.path());
        let read_dir = dir.path().join("r");
        std::fs::create_dir(&read_dir).unwrap();
        let read = fifo(&read_dir);
        let reader = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&read)
            .unwrap();

        // Act
        let skipped = open_out(unread.to_str().unwrap());
        let opened = open_out(read.to_str().unwrap());
        opened.as_ref().unwrap().write_all(b"out").unwrap();
        let mut got = [0u8; 3];
        (&reader).read_exact(&mut got).unwrap();

        // Assert
        assert!(skipped.is_none());
        assert_eq!(&got, b"out");
        assert!(open_out("").is_none());
    }

    #[test]
    fn an_exit_code_is_the_status_and_a_signal_is_128_plus_it() {
        // Arrange
        let exit = |code, signal| ExitStatus {
            code,
            signal,
            timed_out: false,
            oom_killed: false,
        };

        // Act
        let statuses =
            [exit(Some(3), None), exit(None, Some(9)), exit(None, None)].map(|e| status_of(&e));

        // Assert
        assert_eq!(statuses, [3, 137, LOST]);
    }

    #[test]
    fn an_exec_takes_the_init_processs_user_and_limits_with_its_own_command() {
        // Arrange
        let init: Process = serde_json::from_value(serde_json::json!({
            "user": { "uid": 7, "gid": 8 }, "args": ["sleep", "100"], "cwd": "/",
            "noNewPrivileges": true
        }))
        .unwrap();
        let exec = ExecProcess::from_json(
            br#"{"args":["ls","/"],"env":["A=1"],"cwd":"/tmp","terminal":true}"#,
        )
        .unwrap();

        // Act
        let p = exec_process(&init, &exec);

        // Assert
        assert_eq!(
            p.args().as_deref(),
            Some(&["ls".to_string(), "/".to_string()][..])
        );
        assert_eq!(p.env().as_deref(), Some(&["A=1".to_string()][..]));
        assert_eq!(p.cwd(), Path::new("/tmp"));
        assert_eq!(p.terminal(), Some(true));
        assert_eq!((p.user().uid(), p.user().gid()), (7, 8));
        assert_eq!(p.no_new_privileges(), Some(true));
    }
}
