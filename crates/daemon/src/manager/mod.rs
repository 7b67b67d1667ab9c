//! The sandbox manager: the registry of sandboxes and their lifecycle.
//!
//! ```text
//!   create ──▶ creating ──agent ready──▶ running ──VMM exits by itself──▶ failed
//!                 │ boot fails: nothing kept        │ DELETE / TTL / shutdown      │ DELETE / TTL
//!                 ▼                                 ▼                              ▼
//!              (error)                          destroying ──▶ gone (VMM, cgroup, files, record)
//! ```
//!
//! A create that names a template restores the template's VM instead of booting one
//! ([`templates`]); a running sandbox can be paused (its VM saved in the state directory) and
//! resumed ([`pause`]). With `[pool]`, idle clones of one template wait restored, and a create
//! that names it takes one ([`pool`]).
//!
//! Each sandbox's record is written before any of its resources exist and removed after they
//! are all gone, so a daemon killed at any moment leaves a record that names everything to adopt
//! or clean up ([`recover`]). Creation and destruction of one sandbox are serialized by its
//! lifecycle lock; blocking work (booting, stopping, file and cgroup operations) runs on tokio's
//! blocking pool.

mod images;
mod lifecycle;
pub mod pause;
pub mod plan;
mod pool;
pub mod procs;
mod recover;
pub mod templates;
mod workspace;

pub use workspace::WorkspaceFailure;

use std::collections::HashMap;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use bulkhead_client::{
    CreateSandbox, Failure, MountSpec, SandboxInfo, SandboxState, WorkspaceMode as ApiMode,
    WorkspaceSpec,
};
use bulkhead_protocol::client::AgentClient;
use bulkhead_sandbox::{ExecDefaults, Sandbox, WorkspaceMode};

use crate::cgroup::CgroupManager;
use crate::config::Config;
use crate::metrics::Metrics;
use crate::store::{Record, Store};
use crate::util;

/// Errors of sandbox management, each with an HTTP status in the API.
#[derive(Debug, thiserror::Error)]
pub enum ManagerError {
    /// No such sandbox (404).
    #[error("no sandbox {0}")]
    NotFound(String),
    /// The request is invalid (400).
    #[error("{0}")]
    Invalid(String),
    /// A short ID that several sandboxes' IDs start with (400).
    #[error("sandbox ID prefix {prefix} is ambiguous: it matches {}", matches.join(", "))]
    Ambiguous {
        /// The prefix given.
        prefix: String,
        /// The IDs it matches, sorted.
        matches: Vec<String>,
    },
    /// A kernel, image or template the daemon does not have (404, code `kernel_not_found`,
    /// `image_not_found` or `template_not_found`).
    #[error("{message}")]
    UnknownName {
        /// `kernel`, `image` or `template`.
        what: &'static str,
        /// The explanation, with the names there are.
        message: String,
    },
    /// The host lacks the memory asked for (422).
    #[error("{0}")]
    InsufficientMemory(String),
    /// The sandbox limit is reached (429).
    #[error("the daemon already holds its maximum of {0} sandboxes")]
    TooMany(usize),
    /// The sandbox is not in a state that allows this (409).
    #[error("sandbox {id} is {state}")]
    Conflict {
        /// The sandbox.
        id: String,
        /// Its state.
        state: &'static str,
    },
    /// The sandbox cannot do this (yet), whatever its state (409, code `not_supported`).
    #[error("{0}")]
    Unsupported(String),
    /// The sandbox cannot do this now because of what runs in it, e.g. a pause while guest
    /// processes use its shared directories (409, code `busy`); it runs on unchanged.
    #[error("{0}")]
    Busy(String),
    /// The daemon is stopping (503).
    #[error("the daemon is shutting down")]
    ShuttingDown,
    /// The guest agent did not come up within the boot timeout (504); the VM was destroyed.
    #[error("the sandbox could not start: {0}")]
    BootTimeout(String),
    /// The VM ended, or its VMM died, before the agent was ready (502); nothing was kept.
    #[error("the sandbox could not start: {0}")]
    VmExited(String),
    /// The VM could not be started for another reason (500); nothing was kept.
    #[error("the sandbox could not start: {0}")]
    StartFailed(String),
    /// Anything else (500).
    #[error("{0}")]
    Internal(String),
}

/// One sandbox.
#[derive(Debug)]
struct Entry {
    id: String,
    /// Held by create and destroy, so they never interleave.
    lifecycle: tokio::sync::Mutex<()>,
    inner: Mutex<EntryInner>,
}

#[derive(Debug)]
struct EntryInner {
    state: SandboxState,
    record: Record,
    /// The VM while running; kept after a failure until destroyed.
    sandbox: Option<Sandbox>,
    /// Destroyed and out of the registry.
    removed: bool,
}

impl Entry {
    fn lock(&self) -> MutexGuard<'_, EntryInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[derive(Debug)]
struct Inner {
    config: Arc<Config>,
    cgroups: Option<CgroupManager>,
    store: Store,
    metrics: Metrics,
    entries: Mutex<HashMap<String, Arc<Entry>>>,
    shutting_down: AtomicBool,
    /// One permit per VM allowed to boot at once ([`Config::boot_slots`]).
    boot_slots: tokio::sync::Semaphore,
    /// The warm pool, with `[pool]`.
    pool: Option<pool::Pool>,
    /// Templates read by earlier creates.
    templates: templates::TemplateCache,
}

/// The sandbox manager. Cheap to clone (shared state).
#[derive(Debug, Clone)]
pub struct Manager {
    inner: Arc<Inner>,
}

/// What exec and file requests need from a running sandbox.
#[derive(Debug, Clone)]
pub struct AgentHandle {
    /// A client for its guest agent.
    pub client: AgentClient,
    /// The defaults of its commands (environment, working directory, user), from its spec.
    pub exec: ExecDefaults,
}

impl Manager {
    /// Opens the state dir, sets up cgroups and adopts or cleans up the sandboxes of an earlier
    /// run (per [`Config::on_restart`]).
    ///
    /// With `[pool]`, then starts filling the warm pool.
    ///
    /// # Errors
    /// A message when the state dir is locked or unusable, cgroups explicitly asked for
    /// cannot be set up, or the pool's template is missing, unreadable or too large.
    pub async fn start(config: Arc<Config>, metrics: Metrics) -> Result<Manager, String> {
        let store = Store::open(&config.state_dir).map_err(|e| e.to_string())?;
        let pool = pool::Pool::new(&config)?;
        let cgroups = CgroupManager::init(config.cgroups, config.cgroup_parent.as_deref())
            .map_err(|e| e.to_string())?;
        if let Some(hint) = bulkhead_sandbox::host_tuning::slow_vm_creation_hint() {
            tracing::warn!("{hint}");
        }
        std::fs::create_dir_all(config.vm_runtime_root())
            .map_err(|e| format!("cannot create {}: {e}", config.vm_runtime_root().display()))?;
        let manager = Manager {
            inner: Arc::new(Inner {
                boot_slots: tokio::sync::Semaphore::new(config.boot_slots()),
                config,
                cgroups,
                store,
                metrics,
                entries: Mutex::new(HashMap::new()),
                shutting_down: AtomicBool::new(false),
                pool,
                templates: templates::TemplateCache::default(),
            }),
        };
        manager.recover().await;
        manager.start_pool();
        Ok(manager)
    }

    /// Whether the daemon is stopping (new sandboxes and resumes are refused).
    fn is_shutting_down(&self) -> bool {
        self.inner.shutting_down.load(Ordering::SeqCst)
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// The metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    /// cgroup manager, when cgroups are on.
    pub fn cgroups(&self) -> Option<&CgroupManager> {
        self.inner.cgroups.as_ref()
    }

    fn entries(&self) -> MutexGuard<'_, HashMap<String, Arc<Entry>>> {
        self.inner.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The sandbox that `id` names: its full ID or a prefix only its ID starts with
    /// ([`util::resolve_id`]); `Ok(None)` when there is none.
    fn entry(&self, id: &str) -> Result<Option<Arc<Entry>>, ManagerError> {
        let entries = self.entries();
        match util::resolve_id(entries.keys().map(String::as_str), id) {
            Ok(found) => Ok(found.and_then(|full| entries.get(full).cloned())),
            Err(matches) => Err(ManagerError::Ambiguous {
                prefix: id.to_owned(),
                matches,
            }),
        }
    }

    /// [`Self::entry`], with [`ManagerError::NotFound`] when there is none.
    fn existing(&self, id: &str) -> Result<Arc<Entry>, ManagerError> {
        self.entry(id)?
            .ok_or_else(|| ManagerError::NotFound(id.to_owned()))
    }

    fn all_entries(&self) -> Vec<Arc<Entry>> {
        self.entries().values().cloned().collect()
    }

    /// The sandbox `id` (its full ID or a prefix that only its ID starts with, as everywhere
    /// a sandbox is named).
    ///
    /// # Errors
    /// [`ManagerError::NotFound`], [`ManagerError::Ambiguous`] for a short ID that names several.
    pub fn info(&self, id: &str) -> Result<SandboxInfo, ManagerError> {
        let entry = self.existing(id)?;
        let inner = entry.lock();
        Ok(info_of(&inner))
    }

    /// Every sandbox carrying all `labels`, oldest first.
    pub fn list(&self, labels: &[(String, String)]) -> Vec<SandboxInfo> {
        let mut out: Vec<SandboxInfo> = self
            .all_entries()
            .iter()
            .map(|e| info_of(&e.lock()))
            .filter(|info| labels.iter().all(|(k, v)| info.labels.get(k) == Some(v)))
            .collect();
        out.sort_by(|a, b| a.created_at.cmp(&b.created_at).then(a.id.cmp(&b.id)));
        out
    }

    /// How many sandboxes are in each state.
    pub fn counts(&self) -> Vec<(SandboxState, usize)> {
        let mut counts: Vec<(SandboxState, usize)> =
            SandboxState::ALL.iter().map(|s| (*s, 0)).collect();
        for entry in self.all_entries() {
            let state = entry.lock().state;
            if let Some(slot) = counts.iter_mut().find(|(s, _)| *s == state) {
                slot.1 += 1;
            }
        }
        counts
    }

    /// A client for the agent of running sandbox `id`, with the sandbox's environment.
    ///
    /// # Errors
    /// [`ManagerError::NotFound`], [`ManagerError::Ambiguous`], [`ManagerError::Conflict`] when
    /// it is not running.
    pub fn agent(&self, id: &str) -> Result<AgentHandle, ManagerError> {
        self.agent_with(id, |_| ()).map(|(handle, ())| handle)
    }

    /// Like [`Manager::agent`], for a command: with the agent connection the sandbox opened
    /// ahead of need ([`Sandbox::take_preconnected`]: a pool clone's, for its first command),
    /// when there is one and it is still usable. It is taken whether or not the command is
    /// then started (a request found invalid afterwards costs the next command the handshake).
    ///
    /// # Errors
    /// As [`Manager::agent`].
    pub fn agent_for_exec(
        &self,
        id: &str,
    ) -> Result<(AgentHandle, Option<UnixStream>), ManagerError> {
        self.agent_with(id, Sandbox::take_preconnected)
    }

    /// The handle of running sandbox `id`, with what `take` gets from its sandbox (under the
    /// entry's lock).
    fn agent_with<T>(
        &self,
        id: &str,
        take: impl FnOnce(&mut Sandbox) -> T,
    ) -> Result<(AgentHandle, T), ManagerError> {
        let entry = self.existing(id)?;
        let mut inner = entry.lock();
        let EntryInner {
            state,
            record,
            sandbox,
            ..
        } = &mut *inner;
        match (state, sandbox) {
            (SandboxState::Running, Some(sandbox)) => Ok((
                AgentHandle {
                    client: sandbox.client(),
                    exec: ExecDefaults::of(&record.spec).with_network(sandbox.egress_env()),
                },
                take(sandbox),
            )),
            (SandboxState::Paused, _) => Err(ManagerError::Conflict {
                id: entry.id.clone(),
                state: "paused (resume it first)",
            }),
            (state, _) => Err(ManagerError::Conflict {
                id: entry.id.clone(),
                state: state.as_str(),
            }),
        }
    }

    /// The last `lines` lines of sandbox `id`'s VMM output and serial console.
    ///
    /// # Errors
    /// [`ManagerError::NotFound`], [`ManagerError::Ambiguous`].
    pub fn logs(&self, id: &str, lines: usize) -> Result<String, ManagerError> {
        let entry = self.existing(id)?;
        let runtime_dir = entry
            .lock()
            .record
            .sandbox
            .as_ref()
            .map(|s| s.runtime_dir.clone());
        Ok(runtime_dir
            .map(|dir| util::tail_lines(&dir.join("vmm.log"), lines))
            .unwrap_or_default())
    }

    /// The egress log of sandbox `id` (JSON lines), also after its VM ended and while it is
    /// paused (until it is destroyed): `<state_dir>/sandboxes/<id>.egress.jsonl`, or for a
    /// sandbox started by a daemon before 2026-12-05, the log in its runtime directory.
    ///
    /// # Errors
    /// [`ManagerError::NotFound`], [`ManagerError::Ambiguous`], [`ManagerError::Conflict`] when
    /// the sandbox has no network.
    pub fn egress_log(&self, id: &str) -> Result<String, ManagerError> {
        let entry = self.existing(id)?;
        let (has_network, runtime_dir) = {
            let inner = entry.lock();
            let dir = inner.record.sandbox.as_ref().map(|s| s.runtime_dir.clone());
            (inner.record.spec.has_network(), dir)
        };
        if !has_network {
            return Err(ManagerError::Conflict {
                id: entry.id.clone(),
                state: "without a network",
            });
        }
        let older = runtime_dir.map(|dir| dir.join(bulkhead_sandbox::egress::EGRESS_LOG));
        let paths = [Some(self.inner.store.egress_log_of(&entry.id)), older];
        for path in paths.iter().flatten() {
            match std::fs::read_to_string(path) {
                Ok(text) => return Ok(text),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(ManagerError::Internal(format!("egress log of {id}: {e}"))),
            }
        }
        Ok(String::new())
    }

    /// Boots a sandbox, or restores it from the template the request names; returns once its
    /// agent is ready.
    ///
    /// # Errors
    /// [`ManagerError::Invalid`], [`ManagerError::UnknownName`],
    /// [`ManagerError::InsufficientMemory`], [`ManagerError::TooMany`],
    /// [`ManagerError::ShuttingDown`], [`ManagerError::StartFailed`].
    pub async fn create(&self, request: CreateSandbox) -> Result<SandboxInfo, ManagerError> {
        if self.is_shutting_down() {
            return Err(ManagerError::ShuttingDown);
        }
        let id =
            util::new_id().map_err(|e| ManagerError::Internal(format!("no sandbox id: {e}")))?;
        let config = &self.inner.config;
        let template = match &request.template {
            Some(name) => Some(self.inner.templates.resolve(config, name)?),
            None => None,
        };
        let request = match &template {
            Some(t) => templates::fit(&request, t)?,
            None => request,
        };
        let (spec, recipe) = plan::plan(config, &request, plan::host_facts(config), &id)?;
        let pooled = self.inner.pool.as_ref().is_some_and(|p| p.serves(&request));
        let this = self.clone();
        let ttl_s = request.ttl_s;
        // Run to the end even when the client goes away, so nothing is left half made.
        tokio::spawn(async move {
            if pooled {
                if let Some(result) = this
                    .hand_out(&spec, &recipe.config, recipe.limits, ttl_s)
                    .await
                {
                    return result;
                }
            }
            this.create_vm(spec, ttl_s, recipe, template).await
        })
        .await
        .map_err(|e| ManagerError::Internal(format!("the create task failed: {e}")))?
    }

    /// Destroys sandbox `id` (VMM, cgroup, runtime files, record). Idempotent: an unknown or
    /// already destroyed sandbox is not an error.
    ///
    /// # Errors
    /// [`ManagerError::Ambiguous`] for a short ID that names several sandboxes (none is
    /// destroyed); [`ManagerError::Internal`] when clean-up failed (the sandbox is then kept as
    /// failed, and its record stays for a later retry).
    pub async fn destroy(&self, id: &str) -> Result<(), ManagerError> {
        let Some(entry) = self.entry(id)? else {
            return Ok(());
        };
        let this = self.clone();
        tokio::spawn(async move { this.destroy_entry(entry, false).await })
            .await
            .map_err(|e| ManagerError::Internal(format!("the destroy task failed: {e}")))?
    }

    /// Stops taking new sandboxes, destroys the warm pool's idle clones and, per
    /// [`Config::on_shutdown`], destroys every sandbox or
    /// lets go of them (they keep running, recorded for the next start). Paused sandboxes stay
    /// either way, saved in the state directory.
    pub async fn shutdown(&self) {
        self.inner.shutting_down.store(true, Ordering::SeqCst);
        self.shutdown_pool().await;
        let entries = self.all_entries();
        match self.inner.config.on_shutdown {
            crate::config::ShutdownPolicy::Destroy => {
                let tasks: Vec<_> = entries
                    .into_iter()
                    .map(|e| {
                        let this = self.clone();
                        tokio::spawn(async move { this.destroy_entry(e, true).await })
                    })
                    .collect();
                for task in tasks {
                    if let Ok(Err(e)) = task.await {
                        tracing::error!("shutdown: {e}");
                    }
                }
                // The runtime root the daemon created, once no VM is left in it (a sandbox
                // whose clean-up failed keeps its directory, and so the root).
                let _ = std::fs::remove_dir(self.inner.config.vm_runtime_root());
            }
            crate::config::ShutdownPolicy::Leave => {
                for entry in entries {
                    self.leave(&entry).await;
                }
            }
        }
    }
}

/// The API view of a sandbox.
fn info_of(inner: &EntryInner) -> SandboxInfo {
    let r = &inner.record;
    let vmm_pid = match inner.state {
        SandboxState::Running => r.sandbox.as_ref().map(|s| s.vmm_pid),
        _ => None,
    };
    let s = &r.spec;
    SandboxInfo {
        id: r.id.clone(),
        state: inner.state,
        created_at: util::rfc3339(r.created_at_ms),
        expires_at: r.expires_at_ms.map(util::rfc3339),
        vcpus: s.vcpus,
        memory_mib: s.memory_mib,
        kernel: s.kernel.as_ref().map(ToString::to_string),
        image: s.image.as_ref().map(ToString::to_string),
        disk_mib: s.disk_mib,
        labels: s.labels.clone(),
        workspace: s.workspace.as_ref().map(|w| WorkspaceSpec {
            path: w.host.display().to_string(),
            mode: match w.mode {
                WorkspaceMode::Direct => ApiMode::Direct,
                WorkspaceMode::Clone => ApiMode::Clone,
            },
        }),
        mounts: s
            .mounts
            .iter()
            .map(|m| MountSpec {
                host: m.host.display().to_string(),
                guest: m.guest.display().to_string(),
                ro: m.read_only,
            })
            .collect(),
        hostname: Some(bulkhead_sandbox::spec::hostname_of(s, &r.id)),
        network: plan::network_view(s),
        template: r.template.clone(),
        limits: r.limits.clone(),
        vmm_pid,
        failure: r.failure.clone(),
    }
}

/// Lines of VMM output kept in a failure.
const FAILURE_LOG_LINES: usize = 30;

fn failure(reason: &str, message: String, runtime_dir: Option<&std::path::Path>) -> Failure {
    Failure {
        reason: reason.to_owned(),
        message,
        log_tail: runtime_dir
            .map(|d| util::tail_lines(&d.join("vmm.log"), FAILURE_LOG_LINES))
            .unwrap_or_default(),
    }
}
