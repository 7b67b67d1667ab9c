//! Pausing and resuming a sandbox.
//!
//! ```text
//!   running ──pause──▶ pausing ──VM saved──▶ paused ──resume──▶ resuming ──agent told──▶ running
//!                         │ save failed                            │ restore failed
//!                         ▼                                        ▼
//!                      failed                                   paused (the saved VM is kept)
//! ```
//!
//! A pause saves the VM into `<state_dir>/paused/<id>/` (`bulkhead_sandbox::Sandbox::
//! snapshot_into`; with its scratch disk, if it has one), which stops its VMM; the sandbox's cgroup and runtime directory go with it,
//! so a paused sandbox holds nothing but its record and those files, and it survives daemon
//! restarts. A resume restores the VM (`Sandbox::restore`) in the sandbox's cgroup, re-made with
//! the limits recorded at create, under the same ID; the guest's processes and files are as they
//! were. Only then is the saved VM deleted (the new VMM keeps its memory file mapped until it
//! ends), so a resume that fails can be retried.

use std::path::Path;
use std::sync::Arc;

use bulkhead_client::{SandboxInfo, SandboxState};
use bulkhead_sandbox::{Error as SandboxError, Sandbox, SandboxConfig, SandboxSpec};

use super::lifecycle::cleanup_files_and_cgroup;
use super::{failure, info_of, plan, Entry, Manager, ManagerError};
use crate::store::{Phase, Record};

/// The VMM's control socket in a sandbox's runtime directory (`bulkhead-vmm --api-sock`, as
/// `bulkhead_sandbox` starts every VMM). A VMM started by an older bulkhead has none, and so
/// cannot save its VM.
const CONTROL_SOCKET: &str = "vmm/api.sock";

impl Manager {
    /// Pauses sandbox `id`: saves its VM into the state directory and stops the VMM, freeing
    /// its memory. Pausing a paused sandbox changes nothing.
    ///
    /// # Errors
    /// [`ManagerError::NotFound`], [`ManagerError::Ambiguous`]; [`ManagerError::Conflict`] when
    /// it is neither running nor paused; [`ManagerError::Unsupported`] for a sandbox whose VM
    /// has data disks or whose VMM
    /// cannot save it; [`ManagerError::Internal`] when saving failed (the VM is lost and the
    /// sandbox `failed`).
    pub async fn pause(&self, id: &str) -> Result<SandboxInfo, ManagerError> {
        let entry = self.existing(id)?;
        let this = self.clone();
        // Run to the end even when the client goes away, so no sandbox stays `pausing`.
        tokio::spawn(async move { this.pause_entry(entry).await })
            .await
            .map_err(|e| ManagerError::Internal(format!("the pause task failed: {e}")))?
    }

    /// Resumes paused sandbox `id` from its saved VM. Resuming a running sandbox changes
    /// nothing.
    ///
    /// # Errors
    /// [`ManagerError::NotFound`], [`ManagerError::Ambiguous`], [`ManagerError::ShuttingDown`];
    /// [`ManagerError::Conflict`] when it is neither paused nor running; what a create reports
    /// when the VM cannot start ([`ManagerError::InsufficientMemory`],
    /// [`ManagerError::VmExited`], [`ManagerError::BootTimeout`], [`ManagerError::StartFailed`]),
    /// whose message then says that the sandbox stays paused.
    pub async fn resume(&self, id: &str) -> Result<SandboxInfo, ManagerError> {
        if self.is_shutting_down() {
            return Err(ManagerError::ShuttingDown);
        }
        let entry = self.existing(id)?;
        let this = self.clone();
        tokio::spawn(async move { this.resume_entry(entry).await })
            .await
            .map_err(|e| ManagerError::Internal(format!("the resume task failed: {e}")))?
    }

    async fn pause_entry(&self, entry: Arc<Entry>) -> Result<SandboxInfo, ManagerError> {
        let _lifecycle = entry.lifecycle.lock().await;
        let (sandbox, record) = {
            let mut inner = entry.lock();
            match inner.state {
                SandboxState::Paused => return Ok(info_of(&inner)),
                SandboxState::Running if !inner.removed => {}
                state => return Err(conflict(&entry, state)),
            }
            let runtime = inner.sandbox.as_ref().and_then(Sandbox::runtime_path);
            pausable(&entry.id, &inner.record.spec, runtime)?;
            let Some(sandbox) = inner.sandbox.take() else {
                return Err(conflict(&entry, inner.state));
            };
            inner.state = SandboxState::Pausing;
            (sandbox, inner.record.clone())
        };
        let dir = self.inner.store.paused_dir(&entry.id);
        let saved = tokio::task::spawn_blocking(move || save_vm(sandbox, &record, &dir))
            .await
            .unwrap_or_else(|e| Err(Unsaved::Lost(format!("the pause task failed: {e}"))));
        let saved = match saved {
            Err(Unsaved::Refused(sandbox, message)) => {
                let mut inner = entry.lock();
                inner.sandbox = Some(*sandbox);
                inner.state = SandboxState::Running;
                tracing::info!(id = %entry.id, "pause refused: {message}");
                return Err(ManagerError::Busy(format!(
                    "sandbox {} cannot be paused now (it keeps running): {message}",
                    entry.id
                )));
            }
            Err(Unsaved::Lost(message)) => Err(message),
            Ok(()) => Ok(()),
        };
        let reason = match &saved {
            Ok(()) => "paused",
            Err(_) => "pause_failed",
        };
        self.inner.metrics.vm_exit(reason);
        let (info, record) = {
            let mut inner = entry.lock();
            inner.record.sandbox = None;
            match &saved {
                Ok(()) => {
                    inner.state = SandboxState::Paused;
                    inner.record.phase = Phase::Paused;
                }
                Err(message) => {
                    inner.state = SandboxState::Failed;
                    inner.record.phase = Phase::Failed;
                    let message = format!("pausing failed, and the VM is lost: {message}");
                    inner.record.failure = Some(failure("pause_failed", message, None));
                }
            }
            (info_of(&inner), inner.record.clone())
        };
        if let Err(e) = self.inner.store.save(&record) {
            tracing::error!(id = %entry.id, "cannot record the pause: {e}");
        }
        match saved {
            Ok(()) => {
                tracing::info!(id = %entry.id, "sandbox paused");
                Ok(info)
            }
            Err(message) => Err(ManagerError::Internal(format!(
                "pausing {} failed, and its VM is lost (the sandbox is now failed): {message}",
                entry.id
            ))),
        }
    }

    async fn resume_entry(&self, entry: Arc<Entry>) -> Result<SandboxInfo, ManagerError> {
        let _lifecycle = entry.lifecycle.lock().await;
        let record = {
            let mut inner = entry.lock();
            match inner.state {
                SandboxState::Running => return Ok(info_of(&inner)),
                SandboxState::Paused if !inner.removed => {}
                state => return Err(conflict(&entry, state)),
            }
            inner.state = SandboxState::Resuming;
            inner.record.clone()
        };
        let dir = self.inner.store.paused_dir(&entry.id);
        let resumed = match self.restore_vm(record, &dir).await {
            Ok(sandbox) => self.mark_running(&entry, sandbox),
            Err(e) => Err(e),
        };
        match resumed {
            Ok(info) => {
                // The new VMM maps the memory file: deleting it frees its space when the VM ends.
                if let Err(e) = self.inner.store.remove_paused(&entry.id) {
                    tracing::error!(id = %entry.id, "cannot remove the saved VM: {e}");
                }
                tracing::info!(id = %entry.id, "sandbox resumed");
                Ok(info)
            }
            Err(error) => {
                entry.lock().state = SandboxState::Paused;
                tracing::warn!(id = %entry.id, "resume failed: {error}");
                Err(still_paused(error))
            }
        }
    }

    /// Restores the VM saved in `dir` for `record`, in its cgroup with the recorded limits.
    async fn restore_vm(&self, record: Record, dir: &Path) -> Result<Sandbox, ManagerError> {
        let config = &self.inner.config;
        let mut recipe =
            plan::recipe_of(config, &record.spec, plan::host_facts(config), &record.id)?;
        recipe.limits.memory_bytes = record.limits.memory_bytes;
        recipe.limits.cpu_quota = record.limits.cpu_quota;
        recipe.limits.pids_max = record.limits.pids_max;
        self.start_blocking(record, recipe, Some(dir.to_owned()))
            .await
    }
}

/// Refuses to pause a sandbox with data disks, or whose VMM (`runtime`: its
/// runtime directory) has no control socket.
fn pausable(id: &str, spec: &SandboxSpec, runtime: Option<&Path>) -> Result<(), ManagerError> {
    // Mounts and a workspace are unmounted in the guest before the VM is saved and mounted
    // again by the resume (a clone workspace's changes stay in the guest meanwhile). An image
    // is read-only and is opened again by path (the restore checks that it is unchanged); the
    // scratch disk is saved with the VM. A snapshot saves a copy of a data disk, and the
    // resumed VM would write to that copy, no longer to the caller's file: refused (the daemon
    // takes no host paths, so none of its sandboxes has one).
    if !spec.disk_files.is_empty() {
        return Err(ManagerError::Unsupported(format!(
            "sandbox {id} cannot be paused: its resumed VM would write to a copy of its data \
             disks, not to their files"
        )));
    }
    if !runtime.is_some_and(|dir| dir.join(CONTROL_SOCKET).exists()) {
        return Err(ManagerError::Unsupported(format!(
            "sandbox {id} cannot be paused: its VMM has no control socket (it was started by an \
             older bulkhead)"
        )));
    }
    Ok(())
}

/// Why a VM was not saved.
enum Unsaved {
    /// Nothing changed: the sandbox runs on (given back) and the message says why.
    Refused(Box<Sandbox>, String),
    /// The VMM is gone.
    Lost(String),
}

/// Blocking: saves `sandbox`'s VM into `dir` (replacing what an earlier attempt left there),
/// which stops its VMM, then removes its cgroup and runtime directory. Unless the guest
/// refused before anything changed, the VMM is gone either way; on failure `dir` is removed
/// too.
fn save_vm(mut sandbox: Sandbox, record: &Record, dir: &Path) -> Result<(), Unsaved> {
    remove_all(dir).map_err(Unsaved::Lost)?;
    // The snapshot checks nothing else of the configuration: it records these two sizes.
    let sizes = SandboxConfig {
        vcpus: record.spec.vcpus,
        memory_mib: record.spec.memory_mib,
        ..SandboxConfig::default()
    };
    let saved = match sandbox.snapshot_into(dir, &sizes) {
        Ok(_) => Ok(()),
        Err(SandboxError::SnapshotRefused(message)) => {
            let _ = remove_all(dir);
            return Err(Unsaved::Refused(Box::new(sandbox), message));
        }
        Err(e) => Err(Unsaved::Lost(e.to_string())),
    };
    cleanup_files_and_cgroup(&record.runtime_parent, record.cgroup.as_ref());
    if saved.is_err() {
        let _ = remove_all(dir);
    }
    saved
}

fn remove_all(dir: &Path) -> Result<(), String> {
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(format!("cannot remove {}: {e}", dir.display()))
        }
        _ => Ok(()),
    }
}

fn conflict(entry: &Entry, state: SandboxState) -> ManagerError {
    ManagerError::Conflict {
        id: entry.id.clone(),
        state: state.as_str(),
    }
}

/// `error` of a failed resume, its message saying that the sandbox is still paused.
fn still_paused(error: ManagerError) -> ManagerError {
    const KEPT: &str =
        "; the sandbox stays paused with its saved VM: resume it again, or delete it";
    match error {
        ManagerError::InsufficientMemory(m) => ManagerError::InsufficientMemory(m + KEPT),
        ManagerError::BootTimeout(m) => ManagerError::BootTimeout(m + KEPT),
        ManagerError::VmExited(m) => ManagerError::VmExited(m + KEPT),
        ManagerError::StartFailed(m) => ManagerError::StartFailed(m + KEPT),
        ManagerError::Invalid(m) => ManagerError::Invalid(m + KEPT),
        ManagerError::UnknownName { what, message } => ManagerError::UnknownName {
            what,
            message: message + KEPT,
        },
        other => ManagerError::Internal(format!("{other}{KEPT}")),
    }
}
