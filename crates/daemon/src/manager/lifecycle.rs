//! Creating (booting, or restoring from a template), watching, expiring, destroying and
//! letting go of one sandbox.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bulkhead_client::{Limits, SandboxInfo, SandboxState};
use bulkhead_sandbox::cgroup::VmLimits;
use bulkhead_sandbox::{Recipe, Sandbox, SandboxSpec};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use super::images::remove_scratch;
use super::templates::Template;
use super::{failure, info_of, procs, Entry, EntryInner, Manager, ManagerError};
use crate::cgroup::{CgroupManager, CgroupSpec, VmCgroup};
use crate::store::{Phase, Record, Store, RECORD_SCHEMA};
use crate::util;

impl Manager {
    /// Registers a new sandbox (record first), boots it (or restores it from `template`) and
    /// reports it running.
    pub(super) async fn create_vm(
        &self,
        spec: SandboxSpec,
        ttl_s: Option<u64>,
        recipe: Recipe,
        template: Option<Template>,
    ) -> Result<SandboxInfo, ManagerError> {
        let started = Instant::now();
        let name = template.as_ref().map(|t| t.name.clone());
        let entry = self.register(spec, ttl_s, &recipe, name)?;
        let _lifecycle = entry.lifecycle.lock().await;
        let record = entry.lock().record.clone();
        let from = template.map(|t| t.dir);
        let booted = self.start_blocking(record, recipe, from).await;
        let sandbox = match booted {
            Ok(sandbox) => sandbox,
            Err(error) => {
                if let Err(e) = self.inner.store.remove(&entry.id) {
                    tracing::error!(id = %entry.id, "{e}");
                }
                self.forget(&entry);
                self.inner.metrics.create_failed();
                return Err(error);
            }
        };
        let info = self.mark_running(&entry, sandbox)?;
        self.watch_ttl(&entry);
        self.inner.metrics.created(started.elapsed().as_secs_f64());
        tracing::info!(id = %entry.id, "sandbox running after {:?}", started.elapsed());
        Ok(info)
    }

    /// Boots `recipe`'s VM for `record` (or restores the snapshot in `from`) on the blocking
    /// pool, once a boot slot is free.
    pub(super) async fn start_blocking(
        &self,
        record: Record,
        recipe: Recipe,
        from: Option<std::path::PathBuf>,
    ) -> Result<Sandbox, ManagerError> {
        let cgroups = self.inner.cgroups.clone();
        // Wait for a boot slot (the semaphore is never closed); the boot timeout starts after.
        let _slot = self.inner.boot_slots.acquire().await;
        tokio::task::spawn_blocking(move || {
            boot(&record, recipe, cgroups.as_ref(), from.as_deref())
        })
        .await
        .unwrap_or_else(|e| {
            Err(ManagerError::StartFailed(format!(
                "the boot task failed: {e}"
            )))
        })
    }

    /// Adds the entry in state `creating` and writes its record, before any resource exists.
    fn register(
        &self,
        spec: SandboxSpec,
        ttl_s: Option<u64>,
        recipe: &Recipe,
        template: Option<String>,
    ) -> Result<Arc<Entry>, ManagerError> {
        let id = recipe.id.clone();
        let now = util::now_ms();
        let cgroup = self.inner.cgroups.as_ref().map(|c| c.spec_for(&id));
        let record = Record {
            schema: RECORD_SCHEMA,
            id: id.clone(),
            created_at_ms: now,
            expires_at_ms: ttl_s.map(|s| now.saturating_add(s.saturating_mul(1000))),
            phase: Phase::Creating,
            runtime_parent: recipe.config.runtime_dir.clone(),
            limits: api_limits(&recipe.limits, cgroup.as_ref()),
            cgroup,
            spec,
            sandbox: None,
            failure: None,
            template,
            pool: false,
        };
        let mut entries = self.entries();
        // Idle pool clones count too; at the limit one of them makes room.
        let pooled = self.inner.pool.as_ref().map_or(0, |p| p.held());
        if entries.len() + pooled >= self.inner.config.max_sandboxes && !self.evict_clone() {
            return Err(ManagerError::TooMany(self.inner.config.max_sandboxes));
        }
        self.inner
            .store
            .save(&record)
            .map_err(|e| ManagerError::Internal(e.to_string()))?;
        let entry = Arc::new(Entry {
            id: id.clone(),
            lifecycle: tokio::sync::Mutex::new(()),
            inner: std::sync::Mutex::new(EntryInner {
                state: SandboxState::Creating,
                record,
                sandbox: None,
                removed: false,
            }),
        });
        entries.insert(id, entry.clone());
        Ok(entry)
    }

    /// Running: keep the VM, persist what adoption needs, watch the VMM.
    pub(super) fn mark_running(
        &self,
        entry: &Arc<Entry>,
        sandbox: Sandbox,
    ) -> Result<SandboxInfo, ManagerError> {
        let state = sandbox
            .state()
            .map_err(|e| ManagerError::Internal(e.to_string()))?;
        let pidfd = sandbox
            .vmm_pidfd()
            .map_err(|e| ManagerError::Internal(e.to_string()))?;
        let (info, record) = {
            let mut inner = entry.lock();
            inner.record.phase = Phase::Running;
            inner.record.sandbox = Some(state);
            inner.state = SandboxState::Running;
            inner.sandbox = Some(sandbox);
            (info_of(&inner), inner.record.clone())
        };
        if let Err(e) = self.inner.store.save(&record) {
            tracing::error!(id = %entry.id, "cannot record the running sandbox: {e}");
        }
        self.watch_vmm(entry.clone(), pidfd);
        Ok(info)
    }

    /// With a TTL, starts the expiry timer (once per sandbox: a resume keeps the first).
    pub(super) fn watch_ttl(&self, entry: &Arc<Entry>) {
        let Some(deadline) = entry.lock().record.expires_at_ms else {
            return;
        };
        let this = self.clone();
        let id = entry.id.clone();
        tokio::spawn(async move {
            let wait = deadline.saturating_sub(util::now_ms());
            tokio::time::sleep(Duration::from_millis(wait)).await;
            tracing::info!(id = %id, "TTL expired: destroying the sandbox");
            if let Err(e) = this.destroy(&id).await {
                tracing::error!(id = %id, "TTL destroy: {e}");
            }
        });
    }

    /// Starts the VMM-exit watcher on the VMM's `pidfd`.
    pub(super) fn watch_vmm(&self, entry: Arc<Entry>, pidfd: std::os::fd::OwnedFd) {
        let this = self.clone();
        tokio::spawn(async move {
            match process_exit(pidfd).await {
                Ok(()) => this.vm_ended(&entry).await,
                Err(e) => tracing::error!(id = %entry.id, "cannot watch the VMM: {e}"),
            }
        });
    }

    /// The VMM exited: unless that was a destroy, the sandbox becomes `failed`.
    async fn vm_ended(&self, entry: &Arc<Entry>) {
        let _lifecycle = entry.lifecycle.lock().await;
        let record = {
            let mut inner = entry.lock();
            if inner.removed || inner.state != SandboxState::Running {
                return;
            }
            let end = match inner.sandbox.as_mut().map(Sandbox::try_wait_exit) {
                Some(Ok(Some(end))) => end,
                _ => return,
            };
            // From the VMM's exit status and report, never from vmm.log (the guest's console).
            let reason = end.reason();
            let runtime_dir = inner.record.sandbox.as_ref().map(|s| s.runtime_dir.clone());
            let message = format!("the VM ended: {end}");
            let fail = failure(reason, message, runtime_dir.as_deref());
            tracing::warn!(id = %entry.id, "VM ended ({reason}): {}", fail.message);
            self.inner.metrics.vm_exit(reason);
            // The runtime dir (with vmm.log) stays until DELETE, which removes it by path.
            let _ = inner.sandbox.take().map(Sandbox::release);
            inner.state = SandboxState::Failed;
            inner.record.phase = Phase::Failed;
            inner.record.failure = Some(fail);
            inner.record.clone()
        };
        if let Err(e) = self.inner.store.save(&record) {
            tracing::error!(id = %entry.id, "cannot record the failure: {e}");
        }
        // The scratch disk is of no use without its VM: free its space now, not at DELETE.
        // The lifecycle lock is still held, so no destroy runs meanwhile.
        if let Some(dir) = record.sandbox.map(|s| s.runtime_dir) {
            let _ = tokio::task::spawn_blocking(move || remove_scratch(&dir)).await;
        }
    }

    /// Destroys one entry (see [`Manager::destroy`]); with `keep_paused` (a shutdown), a
    /// paused one is left alone, saved in the state directory.
    pub(super) async fn destroy_entry(
        &self,
        entry: Arc<Entry>,
        keep_paused: bool,
    ) -> Result<(), ManagerError> {
        let _lifecycle = entry.lifecycle.lock().await;
        let (sandbox, record, was) = {
            let mut inner = entry.lock();
            if inner.removed || (keep_paused && inner.state == SandboxState::Paused) {
                return Ok(());
            }
            let was = inner.state;
            inner.state = SandboxState::Destroying;
            (inner.sandbox.take(), inner.record.clone(), was)
        };
        let this = self.clone();
        let result =
            tokio::task::spawn_blocking(move || teardown(sandbox, &record, &this.inner.store))
                .await
                .unwrap_or_else(|e| Err(format!("the teardown task failed: {e}")));
        match result {
            Ok(()) => {
                if was == SandboxState::Running {
                    self.inner.metrics.vm_exit("destroyed");
                }
                self.forget(&entry);
                tracing::info!(id = %entry.id, "sandbox destroyed");
                Ok(())
            }
            Err(message) => {
                let mut inner = entry.lock();
                inner.state = SandboxState::Failed;
                inner.record.failure = Some(failure("destroy_failed", message.clone(), None));
                Err(ManagerError::Internal(format!(
                    "destroying {}: {message}",
                    entry.id
                )))
            }
        }
    }

    /// Shutdown with `leave`: lets go of the VM; its record (phase `running`) stays.
    pub(super) async fn leave(&self, entry: &Arc<Entry>) {
        let _lifecycle = entry.lifecycle.lock().await;
        let sandbox = {
            let mut inner = entry.lock();
            inner.removed = true;
            inner.sandbox.take()
        };
        if let Some(sandbox) = sandbox {
            match sandbox.detach() {
                Ok(state) => {
                    tracing::info!(id = %entry.id, "left running (VMM pid {})", state.vmm_pid)
                }
                Err(e) => tracing::warn!(id = %entry.id, "{e}"),
            }
        }
    }

    /// Takes the entry out of the registry; its record is gone already (or never mattered).
    pub(super) fn forget(&self, entry: &Arc<Entry>) {
        entry.lock().removed = true;
        self.entries().remove(&entry.id);
        // Room under max_sandboxes for the pool.
        if let Some(pool) = &self.inner.pool {
            pool.wake();
        }
    }
}

/// Blocking: creates the cgroup and boots the recipe's VM in it, with its root image and scratch
/// disk (made in the runtime directory), or restores the snapshot in `from` there. On failure
/// everything made is removed (the scratch disk with the runtime directory); the snapshot stays.
fn boot(
    record: &Record,
    mut recipe: Recipe,
    cgroups: Option<&CgroupManager>,
    from: Option<&Path>,
) -> Result<Sandbox, ManagerError> {
    let result = (|| {
        if let (Some(manager), Some(spec)) = (cgroups, &record.cgroup) {
            let cgroup = manager
                .create(spec, &recipe.limits)
                .map_err(|e| ManagerError::StartFailed(e.to_string()))?;
            recipe.config.cgroup_procs = cgroup.procs_files();
        }
        match from {
            None => Sandbox::start_with(&recipe.config, &recipe.storage),
            Some(dir) => Sandbox::restore(&recipe.config, dir),
        }
        .map_err(start_error)
    })();
    if result.is_err() {
        cleanup_files_and_cgroup(&record.runtime_parent, record.cgroup.as_ref());
    }
    result
}

/// The API view of a VM's cgroup `limits` in `cgroup`.
pub(super) fn api_limits(limits: &VmLimits, cgroup: Option<&CgroupSpec>) -> Limits {
    Limits {
        memory_bytes: limits.memory_bytes,
        cpu_quota: limits.cpu_quota,
        pids_max: limits.pids_max,
        cgroup: cgroup.map(|c| c.path.clone()),
    }
}

/// Returns once the process of `pidfd` has exited (the pidfd polls readable).
///
/// # Errors
/// The pidfd cannot be registered with the runtime.
pub(super) async fn process_exit(pidfd: std::os::fd::OwnedFd) -> std::io::Result<()> {
    // SAFETY: the AsyncFd owns the OwnedFd, which stays open on the same pidfd until the
    // AsyncFd is dropped; OwnedFd::as_raw_fd always returns that descriptor.
    let fd = unsafe { AsyncFd::register_with_interest(pidfd, Interest::READABLE) }?;
    let _ = fd.readable().await;
    Ok(())
}

/// The API error of a boot that failed: a timeout (504), a VM that ended or a VMM that died
/// during the boot (502), anything else (500).
fn start_error(err: bulkhead_sandbox::Error) -> ManagerError {
    match err {
        e @ bulkhead_sandbox::Error::ReadyTimeout { .. } => {
            ManagerError::BootTimeout(e.to_string())
        }
        e @ bulkhead_sandbox::Error::VmExited { .. } => ManagerError::VmExited(e.to_string()),
        other => ManagerError::StartFailed(other.to_string()),
    }
}

/// Blocking: stops the VM and removes its cgroup, runtime files, saved VM (when paused) and
/// record, in that order.
pub(super) fn teardown(
    sandbox: Option<Sandbox>,
    record: &Record,
    store: &Store,
) -> Result<(), String> {
    if let Some(sandbox) = sandbox {
        if let Err(e) = sandbox.destroy() {
            tracing::warn!(id = %record.id, "stopping the VMM: {e}");
        }
    }
    procs::kill_processes_under(&record.runtime_parent);
    if let Some(spec) = &record.cgroup {
        VmCgroup::load(spec).remove().map_err(|e| e.to_string())?;
    }
    remove_dir(&record.runtime_parent)?;
    store.remove_paused(&record.id).map_err(|e| e.to_string())?;
    store.remove(&record.id).map_err(|e| e.to_string())
}

/// Kills what runs from `runtime_parent`, removes the cgroup and the directory; logs failures.
pub(super) fn cleanup_files_and_cgroup(runtime_parent: &Path, cgroup: Option<&CgroupSpec>) {
    procs::kill_processes_under(runtime_parent);
    if let Some(spec) = cgroup {
        if let Err(e) = VmCgroup::load(spec).remove() {
            tracing::error!("{e}");
        }
    }
    if let Err(e) = remove_dir(runtime_parent) {
        tracing::error!("{e}");
    }
}

fn remove_dir(dir: &Path) -> Result<(), String> {
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(format!("cannot remove {}: {e}", dir.display()))
        }
        _ => Ok(()),
    }
}
