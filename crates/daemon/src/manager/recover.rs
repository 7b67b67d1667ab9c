//! Start-up recovery: every sandbox recorded by an earlier run is adopted (its VMM still runs
//! and the policy is `adopt`), kept as `failed` (its VMM died meanwhile; the logs stay until it
//! is deleted), kept as `paused` (its saved VM is in the state directory; whatever the policy,
//! since nothing of it runs) or destroyed (half-created, or the policy is `destroy`). Then
//! runtime directories and cgroups that no record names (left by a daemon killed before it wrote
//! one), and saved VMs that no paused sandbox owns, are removed with whatever still runs there.
//! Idle clones of the warm pool (records with `pool: true`) are never adopted: they are
//! destroyed, whatever `on_restart` says, and the pool is refilled.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use bulkhead_client::SandboxState;
use bulkhead_sandbox::snapshot::Manifest;
use bulkhead_sandbox::Sandbox;

use super::images::remove_scratch;
use super::lifecycle::{cleanup_files_and_cgroup, teardown};
use super::{failure, plan, procs, Entry, EntryInner, Manager};
use crate::cgroup::VmCgroup;
use crate::config::RestartPolicy;
use crate::store::{Phase, Record};

/// Longest the agent of an adopted sandbox may take to take the new proxy's CA certificate.
const NETWORK_RESTART_TIMEOUT: Duration = Duration::from_secs(30);

/// A recovered sandbox: running (with its adopted VM) or failed.
type Recovered = (Record, Option<Sandbox>);

impl Manager {
    /// Recovers the previous run's sandboxes into the registry.
    pub(super) async fn recover(&self) {
        let this = self.clone();
        let recovered = tokio::task::spawn_blocking(move || this.recover_blocking())
            .await
            .unwrap_or_else(|e| {
                tracing::error!("recovery failed: {e}");
                Vec::new()
            });
        for (record, sandbox) in recovered {
            self.install(record, sandbox);
        }
    }

    fn recover_blocking(&self) -> Vec<Recovered> {
        let records = self.inner.store.load_all();
        let known: HashSet<String> = records.iter().map(|r| r.id.clone()).collect();
        let recovered: Vec<Recovered> = records
            .into_iter()
            .filter_map(|record| self.recover_one(record))
            .collect();
        self.sweep_strays(&known);
        let paused: HashSet<&str> = recovered
            .iter()
            .filter(|(r, _)| r.phase == Phase::Paused)
            .map(|(r, _)| r.id.as_str())
            .collect();
        self.sweep_saved_vms(&paused);
        recovered
    }

    fn recover_one(&self, mut record: Record) -> Option<Recovered> {
        let store = &self.inner.store;
        if record.pool {
            tracing::info!(id = %record.id, "destroying an idle pool clone of the previous run");
            let sandbox = record
                .sandbox
                .as_ref()
                .and_then(|state| Sandbox::adopt(state).ok());
            if let Err(e) = teardown(sandbox, &record, store) {
                tracing::error!(id = %record.id, "{e}");
            }
            return None;
        }
        match record.phase {
            Phase::Creating => {
                tracing::info!(id = %record.id, "removing a sandbox that was being created");
                cleanup_files_and_cgroup(&record.runtime_parent, record.cgroup.as_ref());
                log_err(store.remove(&record.id));
                None
            }
            Phase::Failed => {
                // Normally gone already; not if the daemon died right after recording the failure.
                if let Some(state) = &record.sandbox {
                    remove_scratch(&state.runtime_dir);
                }
                Some((record, None))
            }
            Phase::Paused => {
                self.recover_paused(&mut record);
                Some((record, None))
            }
            Phase::Running => {
                let adopted = record.sandbox.as_ref().map(Sandbox::adopt);
                match (self.inner.config.on_restart, adopted) {
                    (RestartPolicy::Adopt, Some(Ok(mut sandbox))) => {
                        tracing::info!(id = %record.id, "adopted the running sandbox");
                        self.restart_network(&record, &mut sandbox);
                        Some((record, Some(sandbox)))
                    }
                    (RestartPolicy::Adopt, adopted) => {
                        let why = match adopted {
                            Some(Err(e)) => e.to_string(),
                            _ => "no VMM recorded".to_owned(),
                        };
                        self.mark_vanished(&mut record, why);
                        Some((record, None))
                    }
                    (RestartPolicy::Destroy, adopted) => {
                        tracing::info!(id = %record.id, "destroying a sandbox of the previous run");
                        let sandbox = adopted.and_then(Result::ok);
                        if let Err(e) = teardown(sandbox, &record, &self.inner.store) {
                            tracing::error!(id = %record.id, "{e}");
                        }
                        None
                    }
                }
            }
        }
    }

    /// Starts the egress proxy of an adopted sandbox with a network again (its predecessor's
    /// ended with the old daemon) and installs the new proxy's CA in the guest. When that
    /// fails (e.g. a secret it names left the configuration) the sandbox keeps running without
    /// a network (its guest's connections are refused), and the error is logged.
    fn restart_network(&self, record: &Record, sandbox: &mut Sandbox) {
        let config = &self.inner.config;
        let result = match plan::network_settings(config, &record.spec, &record.id) {
            Ok(Some(settings)) => sandbox
                .start_network(&settings, NETWORK_RESTART_TIMEOUT)
                .map_err(|e| e.to_string()),
            Ok(None) => return,
            Err(e) => Err(e.to_string()),
        };
        match result {
            Ok(()) => tracing::info!(id = %record.id, "restarted the sandbox's egress proxy"),
            Err(e) => tracing::error!(id = %record.id, "the adopted sandbox has no network: {e}"),
        }
    }

    /// A paused sandbox stays paused when its saved VM is readable, else it becomes failed
    /// (reason `snapshot_missing`). Nothing of it may run: a VMM that a daemon killed in the
    /// midst of a resume left behind is killed, its cgroup and runtime directory removed.
    fn recover_paused(&self, record: &mut Record) {
        cleanup_files_and_cgroup(&record.runtime_parent, record.cgroup.as_ref());
        let dir = self.inner.store.paused_dir(&record.id);
        match Manifest::read(&dir) {
            Ok(_) => tracing::info!(id = %record.id, "the sandbox stays paused"),
            Err(e) => {
                tracing::error!(id = %record.id, "the paused sandbox's saved VM is unusable: {e}");
                record.phase = Phase::Failed;
                record.failure = Some(failure(
                    "snapshot_missing",
                    format!("the saved VM of the paused sandbox is missing or unreadable: {e}"),
                    None,
                ));
                log_err(self.inner.store.save(record));
            }
        }
    }

    /// Removes saved VMs in `<state_dir>/paused/` that no paused sandbox owns (a daemon killed
    /// while pausing, or between a resume and the removal of what it restored from).
    fn sweep_saved_vms(&self, paused: &HashSet<&str>) {
        let store = &self.inner.store;
        for id in store.paused_ids() {
            if crate::util::is_id(&id) && !paused.contains(id.as_str()) {
                tracing::warn!(
                    "removing the stray saved VM {}",
                    store.paused_dir(&id).display()
                );
                log_err(store.remove_paused(&id));
            }
        }
    }

    /// The VMM died while no daemon watched: keep the sandbox as failed with its logs, but
    /// nothing that runs.
    fn mark_vanished(&self, record: &mut Record, why: String) {
        tracing::warn!(id = %record.id, "the VM ended while the daemon was down: {why}");
        procs::kill_processes_under(&record.runtime_parent);
        if let Some(spec) = &record.cgroup {
            if let Err(e) = VmCgroup::load(spec).remove() {
                tracing::error!(id = %record.id, "{e}");
            }
        }
        let runtime_dir = record.sandbox.as_ref().map(|s| s.runtime_dir.clone());
        if let Some(dir) = &runtime_dir {
            remove_scratch(dir); // the logs stay, the dead VM's writable layer goes
        }
        // The VMM's exit report, if it wrote one, still says how the VM ended.
        let end = runtime_dir.as_ref().map(|dir| {
            bulkhead_sandbox::VmEnd::read(
                bulkhead_sandbox::VmmExit::Unknown,
                &dir.join(bulkhead_sandbox::EXIT_FILE),
            )
        });
        let (reason, how) = match &end {
            Some(end) if end.report.is_some() => (end.reason(), format!(": {end}")),
            _ => ("vanished", String::new()),
        };
        record.phase = Phase::Failed;
        record.failure = Some(failure(
            reason,
            format!("the VM ended while the daemon was not running ({why}){how}"),
            runtime_dir.as_deref(),
        ));
        self.inner.metrics.vm_exit(reason);
        log_err(self.inner.store.save(record));
    }

    /// Removes runtime directories and cgroups of sandboxes that have no record.
    fn sweep_strays(&self, known: &HashSet<String>) {
        let root = self.inner.config.vm_runtime_root();
        if let Ok(dirs) = std::fs::read_dir(&root) {
            for dir in dirs.flatten() {
                let name = dir.file_name().to_string_lossy().into_owned();
                if !known.contains(&name) {
                    tracing::warn!("removing stray runtime directory {}", dir.path().display());
                    cleanup_files_and_cgroup(&dir.path(), None);
                }
            }
        }
        let Some(cgroups) = &self.inner.cgroups else {
            return;
        };
        for id in cgroups.list_ids() {
            if !known.contains(&id) {
                tracing::warn!("removing stray cgroup of {id}");
                if let Err(e) = VmCgroup::load(&cgroups.spec_for(&id)).remove() {
                    tracing::error!("{e}");
                }
            }
        }
    }

    /// Puts a recovered sandbox in the registry and watches it.
    fn install(&self, record: Record, sandbox: Option<Sandbox>) {
        let pidfd = sandbox.as_ref().and_then(|s| s.vmm_pidfd().ok());
        let state = match (&pidfd, record.phase) {
            (Some(_), _) => SandboxState::Running,
            (None, Phase::Paused) => SandboxState::Paused,
            (None, _) => SandboxState::Failed,
        };
        let entry = Arc::new(Entry {
            id: record.id.clone(),
            lifecycle: tokio::sync::Mutex::new(()),
            inner: std::sync::Mutex::new(EntryInner {
                state,
                record,
                sandbox,
                removed: false,
            }),
        });
        self.entries().insert(entry.id.clone(), entry.clone());
        self.watch_ttl(&entry);
        if let Some(pidfd) = pidfd {
            self.watch_vmm(entry, pidfd);
        }
    }
}

fn log_err(result: Result<(), crate::store::StoreError>) {
    if let Err(e) = result {
        tracing::error!("{e}");
    }
}
