//! The warm pool (`[pool]` in the configuration): clones of one template kept restored and
//! idle, each in its own cgroup from the start, so that a create naming that template is a
//! hand-out instead of a restore.
//!
//! ```text
//!   refiller ──restore (one at a time)──▶ ready clones ──create that matches──▶ sandbox
//!      ▲  backoff on failure                  │ a create at max_sandboxes: one is destroyed
//!      └──── woken by hand-outs and by sandboxes that go away ◀──────────────────┘
//! ```
//!
//! A clone has a record (`pool: true`) like a sandbox's, written before its resources exist,
//! but it is no sandbox: it is not listed, and a restarted daemon destroys it (whatever
//! `on_restart` says) and refills the pool. Handing one out assigns the request's settings
//! (labels, TTL, environment, exec defaults), sets the request's limits on the clone's cgroup,
//! tells the guest its hostname with fresh entropy and the host's clock, and then records it as
//! a sandbox. Clones count against `max_sandboxes`: the refiller never restores beyond it, and a
//! create that finds the limit reached takes the room of an idle clone (which is destroyed).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bulkhead_client::{CreateSandbox, PoolStatus, SandboxInfo, SandboxState};
use bulkhead_sandbox::cgroup::{CgroupSpec, VmLimits};
use bulkhead_sandbox::egress::EgressSettings;
use bulkhead_sandbox::jail;
use bulkhead_sandbox::snapshot::{check_attachable, clone_identity, ShareSlots};
use bulkhead_sandbox::spec::hostname_of;
use bulkhead_sandbox::{Sandbox, SandboxConfig, SandboxSpec};

use super::lifecycle::{api_limits, process_exit, teardown};
use super::templates::{self, Template};
use super::{plan, Entry, EntryInner, Manager, ManagerError};
use crate::cgroup::VmCgroup;
use crate::config::{Config, PoolConfig};
use crate::store::{Phase, Record, RECORD_SCHEMA};
use crate::util;

/// The first pause after a failed refill; it doubles with each failure in a row.
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
/// The longest pause between refill attempts after failures.
const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// How long the agent of a handed-out clone may take to acknowledge its new identity.
const HAND_OUT_TIMEOUT: Duration = Duration::from_secs(10);
/// After a hand-out from a full pool, how long the refiller leaves the host to the new
/// sandbox's first commands while other clones are still ready: in the test host a restore
/// beside them made the first output of a hand-out come ~5 ms later at the median (37.3 vs
/// 32.2 ms, `benches/results/README.md`). A pool that is not full when a clone is taken is
/// refilled at once, so that a steady stream of creates does not drain it.
const REFILL_SETTLE: Duration = Duration::from_millis(250);

/// The warm pool's settings and idle clones.
#[derive(Debug)]
pub(super) struct Pool {
    template: Template,
    size: usize,
    /// `pool.share_owner`: the uid/gid of the clones' jailed VMMs.
    share_owner: Option<(u32, u32)>,
    state: Mutex<PoolState>,
    /// Wakes the refiller: a clone was taken, a sandbox went away, the daemon stops.
    wake: tokio::sync::Notify,
    refiller: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

#[derive(Debug, Default)]
struct PoolState {
    /// Idle clones, oldest first.
    ready: VecDeque<Member>,
    /// Clones being restored (0 or 1).
    restoring: usize,
    /// Until when the refiller waits after a hand-out from a full pool ([`REFILL_SETTLE`]).
    settle_until: Option<Instant>,
}

/// When a clone is taken at `now` from a pool holding `held` clones (ready or being restored)
/// of `size`: until when the refiller should wait ([`REFILL_SETTLE`] for a full pool).
fn settle_until(held: usize, size: usize, now: Instant) -> Option<Instant> {
    (held >= size).then(|| now + REFILL_SETTLE)
}

/// How long the refiller should still wait at `now` with `ready` clones ready: the rest of the
/// settle time, while a clone is ready; nothing otherwise.
fn settle_left(until: Option<Instant>, ready: usize, now: Instant) -> Option<Duration> {
    let left = until?.checked_duration_since(now)?;
    (ready > 0 && !left.is_zero()).then_some(left)
}

/// One idle clone.
#[derive(Debug)]
struct Member {
    /// Its record (`pool: true`, phase running), as saved.
    record: Record,
    sandbox: Sandbox,
}

impl Pool {
    /// The pool `config` asks for, its template found and checked against the daemon's limits;
    /// None without `[pool]`.
    ///
    /// # Errors
    /// A message naming the template when it does not exist, cannot be read, or is larger than
    /// the daemon allows.
    pub(super) fn new(config: &Config) -> Result<Option<Pool>, String> {
        let Some(PoolConfig {
            template,
            size,
            share_owner,
        }) = &config.pool
        else {
            return Ok(None);
        };
        let invalid = |e: ManagerError| format!("pool.template {template:?}: {e}");
        let found = templates::resolve(config, template).map_err(invalid)?;
        // The daemon's own limits only: the host's free memory is checked at each restore.
        let request = templates::fit(&clone_request(template), &found).map_err(invalid)?;
        plan::plan(config, &request, plan::HostFacts::default(), "000000000000")
            .map_err(invalid)?;
        Ok(Some(Pool {
            template: found,
            size: *size,
            share_owner: *share_owner,
            state: Mutex::new(PoolState::default()),
            wake: tokio::sync::Notify::new(),
            refiller: Mutex::new(None),
        }))
    }

    fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Clones held, ready or being restored: they count against `max_sandboxes`.
    pub(super) fn held(&self) -> usize {
        let state = self.lock();
        state.ready.len() + state.restoring
    }

    /// Whether a pooled clone may serve `request` (already fitted to its template): it names
    /// the pool's template and asks for nothing a restore must set up (kernel, image, disks);
    /// such requests take the normal path. A network, mounts and a workspace are given at the
    /// hand-out (the latter when the clone's VMM can serve them: see [`Manager::hand_out`]).
    pub(super) fn serves(&self, request: &CreateSandbox) -> bool {
        request.template.as_deref() == Some(self.template.name.as_str())
            && request.kernel.is_none()
            && request.image.is_none()
            && request.disk_mib.is_none()
    }

    /// Wakes the refiller.
    pub(super) fn wake(&self) {
        self.wake.notify_one();
    }
}

/// How long a new clone's warm-up exec may take (`warm_up`).
const WARM_UP_TIMEOUT: Duration = Duration::from_secs(60);

/// The create request a clone is restored for: the template with its own sizes.
fn clone_request(template: &str) -> CreateSandbox {
    CreateSandbox {
        template: Some(template.to_owned()),
        ..CreateSandbox::default()
    }
}

impl Manager {
    /// The warm pool's state, when there is one.
    pub fn pool_status(&self) -> Option<PoolStatus> {
        let pool = self.inner.pool.as_ref()?;
        let state = pool.lock();
        Some(PoolStatus {
            template: pool.template.name.clone(),
            size: pool.size,
            ready: state.ready.len(),
            restoring: state.restoring,
        })
    }

    /// Starts the refiller (with a pool).
    pub(super) fn start_pool(&self) {
        let Some(pool) = &self.inner.pool else {
            return;
        };
        let this = self.clone();
        let task = tokio::spawn(async move { this.refill().await });
        *pool.refiller.lock().unwrap_or_else(|p| p.into_inner()) = Some(task);
    }

    /// Restores clones, one at a time, while the pool is short and `max_sandboxes` leaves room;
    /// after a failure waits (1 s, doubling up to 60 s) before the next attempt.
    async fn refill(self) {
        let Some(pool) = self.inner.pool.as_ref() else {
            return;
        };
        let mut backoff = FIRST_BACKOFF;
        loop {
            if self.is_shutting_down() {
                return;
            }
            let settle = {
                let state = pool.lock();
                settle_left(state.settle_until, state.ready.len(), Instant::now())
            };
            if let Some(left) = settle {
                self.refill_pause(pool, left).await;
                continue;
            }
            if !self.reserve_restore(pool) {
                pool.wake.notified().await;
                continue;
            }
            match self.restore_clone(pool).await {
                Ok(member) => {
                    backoff = FIRST_BACKOFF;
                    tracing::info!(id = %member.record.id, "pool: a clone of {} is ready",
                        pool.template.name);
                    let pidfd = member.sandbox.vmm_pidfd();
                    let id = member.record.id.clone();
                    {
                        let mut state = pool.lock();
                        state.restoring -= 1;
                        state.ready.push_back(member);
                    }
                    match pidfd {
                        Ok(pidfd) => self.watch_clone(id, pidfd),
                        Err(e) => tracing::warn!(id = %id, "pool: cannot watch the clone: {e}"),
                    }
                }
                Err(e) => {
                    pool.lock().restoring -= 1;
                    self.inner.metrics.pool_restore_failed();
                    tracing::error!(
                        "pool: restoring a clone of {} failed (next attempt in {backoff:?}): {e}",
                        pool.template.name
                    );
                    // Hand-outs and deletes do not cut the pause short, or a busy daemon would
                    // retry a broken template at its request rate.
                    self.refill_pause(pool, backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }

    /// Waits `length`; only a shutdown cuts the pause short.
    async fn refill_pause(&self, pool: &Pool, length: Duration) {
        let until = tokio::time::Instant::now() + length;
        while !self.is_shutting_down() && tokio::time::Instant::now() < until {
            tokio::select! {
                () = tokio::time::sleep_until(until) => {}
                () = pool.wake.notified() => {}
            }
        }
    }

    /// Watches an idle clone's VMM: when it ends while the clone is still in the pool, the
    /// clone is destroyed and the pool refilled. (Once handed out, the sandbox's own watcher
    /// takes over and this one finds nothing to do.)
    fn watch_clone(&self, id: String, pidfd: std::os::fd::OwnedFd) {
        let this = self.clone();
        tokio::spawn(async move {
            if let Err(e) = process_exit(pidfd).await {
                tracing::warn!(id = %id, "pool: cannot watch the clone: {e}");
                return;
            }
            let Some(pool) = &this.inner.pool else {
                return;
            };
            let member = {
                let mut state = pool.lock();
                let at = state.ready.iter().position(|m| m.record.id == id);
                at.and_then(|i| state.ready.remove(i))
            };
            if let Some(member) = member {
                tracing::warn!(id = %id, "pool: an idle clone's VM ended; replacing it");
                this.destroy_clone(member).await;
                pool.wake();
            }
        });
    }

    /// Counts one more clone being restored when the pool is short and the sandbox limit
    /// leaves room (under the registry's lock, as creates count).
    fn reserve_restore(&self, pool: &Pool) -> bool {
        let entries = self.entries();
        let mut state = pool.lock();
        let held = state.ready.len() + state.restoring;
        if held >= pool.size || entries.len() + held >= self.inner.config.max_sandboxes {
            return false;
        }
        state.restoring += 1;
        state.settle_until = None;
        true
    }

    /// Restores one clone: its record (`pool: true`) first, then its cgroup and VMM.
    async fn restore_clone(&self, pool: &Pool) -> Result<Member, ManagerError> {
        let config = &self.inner.config;
        let id =
            util::new_id().map_err(|e| ManagerError::Internal(format!("no sandbox id: {e}")))?;
        let request = templates::fit(&clone_request(&pool.template.name), &pool.template)?;
        let (spec, mut recipe) = plan::plan(config, &request, plan::host_facts(config), &id)?;
        recipe.config.jail_owner = pool.share_owner;
        let cgroup = self.inner.cgroups.as_ref().map(|c| c.spec_for(&id));
        let mut record = Record {
            schema: RECORD_SCHEMA,
            id: id.clone(),
            spec,
            created_at_ms: util::now_ms(),
            expires_at_ms: None,
            phase: Phase::Creating,
            runtime_parent: recipe.config.runtime_dir.clone(),
            limits: api_limits(&recipe.limits, cgroup.as_ref()),
            cgroup,
            sandbox: None,
            failure: None,
            template: Some(pool.template.name.clone()),
            pool: true,
        };
        let store = &self.inner.store;
        store
            .save(&record)
            .map_err(|e| ManagerError::Internal(e.to_string()))?;
        let dir = Some(pool.template.dir.clone());
        let sandbox = match self.start_blocking(record.clone(), recipe, dir).await {
            Ok(sandbox) => sandbox,
            Err(e) => {
                // The failed start removed its cgroup and files; the record goes last.
                if let Err(e) = store.remove(&id) {
                    tracing::error!(id = %id, "{e}");
                }
                return Err(e);
            }
        };
        let started = Instant::now();
        let warmed = tokio::task::spawn_blocking(move || {
            let mut sandbox = sandbox;
            let warmed = warm_up(&mut sandbox);
            (sandbox, warmed)
        })
        .await;
        let sandbox = match warmed {
            Ok((sandbox, Ok(()))) => sandbox,
            Ok((sandbox, Err(e))) => {
                self.destroy_clone(Member { record, sandbox }).await;
                return Err(ManagerError::Internal(e));
            }
            Err(e) => {
                return Err(ManagerError::Internal(format!(
                    "the warm-up task failed: {e}"
                )))
            }
        };
        tracing::info!(id = %id, "pool: clone restored, warmed up in {:?}", started.elapsed());
        record.phase = Phase::Running;
        match sandbox.state() {
            Ok(state) => record.sandbox = Some(state),
            Err(e) => {
                self.destroy_clone(Member { record, sandbox }).await;
                return Err(ManagerError::Internal(e.to_string()));
            }
        }
        if let Err(e) = store.save(&record) {
            // The record still names the clone's resources (phase creating): a restart removes
            // them; this run keeps the clone.
            tracing::error!(id = %id, "cannot record the pool clone: {e}");
        }
        Ok(Member { record, sandbox })
    }

    /// Destroys one clone (VMM, cgroup, files, record) on the blocking pool; logs failures.
    async fn destroy_clone(&self, member: Member) {
        let this = self.clone();
        let id = member.record.id.clone();
        let result = tokio::task::spawn_blocking(move || {
            teardown(Some(member.sandbox), &member.record, &this.inner.store)
        })
        .await
        .unwrap_or_else(|e| Err(format!("the teardown task failed: {e}")));
        match result {
            Ok(()) => tracing::info!(id = %id, "pool: clone destroyed"),
            Err(e) => tracing::error!(id = %id, "pool: destroying the clone: {e}"),
        }
    }

    /// A create at `max_sandboxes`: takes an idle clone out of the pool (the caller holds the
    /// registry's lock) and destroys it in the background; false when there is none.
    pub(super) fn evict_clone(&self) -> bool {
        let Some(pool) = &self.inner.pool else {
            return false;
        };
        let Some(member) = pool.lock().ready.pop_back() else {
            return false;
        };
        tracing::info!(id = %member.record.id, "pool: destroying an idle clone to make room");
        let this = self.clone();
        tokio::spawn(async move { this.destroy_clone(member).await });
        true
    }

    /// Hands an idle clone out as the sandbox `spec` asks for (a request the pool
    /// [serves](Pool::serves), planned as `config`), with `limits` on its cgroup and a TTL of
    /// `ttl_s`; `config`'s mounts and workspace are attached to the clone's share slots
    /// ([`Sandbox::attach_shares`]). None when the pool has no clone ready, when its clones
    /// cannot serve those shares ([`check_attachable`]: too few slots, shares that need a VMM
    /// of another user; no clone is taken), or when the one taken turned out unusable (it is
    /// destroyed): the caller then restores as usual.
    pub(super) async fn hand_out(
        &self,
        spec: &SandboxSpec,
        config: &SandboxConfig,
        limits: VmLimits,
        ttl_s: Option<u64>,
    ) -> Option<Result<SandboxInfo, ManagerError>> {
        let started = Instant::now();
        let pool = self.inner.pool.as_ref()?;
        let vmm = jail::active(config.jail).then(|| clone_identity(pool.share_owner));
        if let Err(e) = check_attachable(config, pool.template.slots, vmm) {
            tracing::info!("pool: its clones cannot take this create ({e}); restoring");
            return None;
        }
        let (entry, member) = {
            // Under the registry's lock: the clone leaves the pool's count as the sandbox
            // enters the registry's, so the total never exceeds max_sandboxes.
            let mut entries = self.entries();
            let member = {
                let mut state = pool.lock();
                let held = state.ready.len() + state.restoring;
                let member = state.ready.pop_front()?;
                state.settle_until = settle_until(held, pool.size, Instant::now());
                member
            };
            let record = handed_out(&member.record, spec, &limits, ttl_s);
            let entry = Arc::new(Entry {
                id: record.id.clone(),
                lifecycle: tokio::sync::Mutex::new(()),
                inner: Mutex::new(EntryInner {
                    state: SandboxState::Creating,
                    record,
                    sandbox: None,
                    removed: false,
                }),
            });
            entries.insert(entry.id.clone(), entry.clone());
            (entry, member)
        };
        pool.wake();
        let _lifecycle = entry.lifecycle.lock().await;
        // The guest has the hostname its clone was restored with (its ID is now the sandbox's).
        let restored_as = hostname_of(&member.record.spec, &entry.id);
        let hostname = Some(hostname_of(spec, &entry.id)).filter(|name| *name != restored_as);
        let cgroup = member.record.cgroup.clone();
        // Planned already (the secrets were found then); read again for the proxy.
        let network = match plan::network_settings(&self.inner.config, spec, &entry.id) {
            Ok(network) => network,
            Err(e) => {
                self.destroy_clone(member).await;
                self.forget(&entry);
                return Some(Err(e));
            }
        };
        let identity = Identity {
            hostname,
            network,
            shares: config.clone(),
            slots: pool.template.slots,
        };
        let Member { record, sandbox } = member;
        let prepared = tokio::task::spawn_blocking(move || {
            let mut sandbox = sandbox;
            let result = prepare(&mut sandbox, cgroup.as_ref(), &limits, identity);
            (sandbox, result)
        })
        .await;
        let sandbox = match prepared {
            Ok((sandbox, Ok(()))) => sandbox,
            Ok((sandbox, Err(e))) => {
                tracing::warn!(id = %entry.id, "pool: the idle clone is unusable ({e}); restoring");
                self.destroy_clone(Member { record, sandbox }).await;
                self.forget(&entry);
                return None;
            }
            Err(e) => {
                tracing::error!(id = %entry.id, "pool: the hand-out task failed: {e}");
                self.forget(&entry);
                return None;
            }
        };
        let info = match self.mark_running(&entry, sandbox) {
            Ok(info) => info,
            Err(e) => {
                self.forget(&entry);
                return Some(Err(e));
            }
        };
        self.watch_ttl(&entry);
        self.inner.metrics.created(started.elapsed().as_secs_f64());
        tracing::info!(id = %entry.id, "sandbox running (from the pool) after {:?}",
            started.elapsed());
        Some(Ok(info))
    }

    /// Shutdown: stops the refiller (waiting for a restore in progress) and destroys every
    /// idle clone.
    pub(super) async fn shutdown_pool(&self) {
        let Some(pool) = &self.inner.pool else {
            return;
        };
        pool.wake();
        let task = pool
            .refiller
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(task) = task {
            let _ = task.await;
        }
        let members: Vec<Member> = pool.lock().ready.drain(..).collect();
        for member in members {
            self.destroy_clone(member).await;
        }
    }
}

/// The record of a clone handed out as the sandbox `spec` asks for: the request's spec, limits
/// and TTL, created now, no longer a pool clone (the VM, runtime directory and cgroup stay).
/// Runs `true` in a newly restored clone before it joins the pool, so that the first command a
/// user runs in it does not pay for what any first exec after a restore pays: the guest's
/// first touches of the pages of its exec path (each a page fault on the template's
/// memory file; in the test host, measured: the first exec after a hand-out 61 → 31 ms p50,
/// `benches/results/README.md`). Then opens the agent connection that first command is
/// started on ([`Sandbox::preconnect`]), sparing it the vsock handshake.
///
/// # Errors
/// The exec's failure, or its unsuccessful end, or no connection: the clone is unusable.
fn warm_up(sandbox: &mut Sandbox) -> Result<(), String> {
    let request = bulkhead_protocol::ExecRequest::new(["true"]);
    let out = sandbox
        .client()
        .with_timeout(WARM_UP_TIMEOUT)
        .exec(&request)
        .and_then(|s| s.wait_with_output())
        .map_err(|e| format!("warm-up exec: {e}"))?;
    if !out.status.success() {
        return Err(format!("warm-up exec ended {:?}", out.status));
    }
    sandbox
        .preconnect()
        .map_err(|e| format!("connecting to the agent after the warm-up: {e}"))
}

fn handed_out(clone: &Record, spec: &SandboxSpec, limits: &VmLimits, ttl_s: Option<u64>) -> Record {
    let now = util::now_ms();
    Record {
        spec: spec.clone(),
        created_at_ms: now,
        expires_at_ms: ttl_s.map(|s| now.saturating_add(s.saturating_mul(1000))),
        limits: api_limits(limits, clone.cgroup.as_ref()),
        pool: false,
        ..clone.clone()
    }
}

/// What a handed-out clone becomes: its hostname when its request names another one than the
/// clone's `bh-<id>`, its network when its request has one, and the mounts and workspace of
/// `shares` on its share slots `slots`.
struct Identity {
    hostname: Option<String>,
    network: Option<EgressSettings>,
    shares: SandboxConfig,
    slots: ShareSlots,
}

/// Blocking: readies an idle clone for its sandbox: its VM must still run, its cgroup gets
/// `limits`, its VMM the shared directories. Its guest has had fresh entropy, the host's clock
/// and the hostname `bh-<id>` since its restore; only when `identity` changes something (a
/// hostname, shares to mount, a network: an egress proxy of its own, whose relay the agent
/// starts) is its agent told, with fresh entropy and the clock again. A hand-out without them
/// makes no round trip to the guest.
fn prepare(
    sandbox: &mut Sandbox,
    cgroup: Option<&CgroupSpec>,
    limits: &VmLimits,
    identity: Identity,
) -> Result<(), String> {
    if let Ok(Some(end)) = sandbox.try_wait_exit() {
        return Err(format!("its VM ended: {end}"));
    }
    if let Some(spec) = cgroup {
        VmCgroup::load(spec)
            .set_limits(limits)
            .map_err(|e| e.to_string())?;
    }
    let share_params = sandbox
        .attach_shares(&identity.shares, identity.slots)
        .map_err(|e| e.to_string())?;
    if let Some(settings) = &identity.network {
        sandbox
            .start_network(settings, HAND_OUT_TIMEOUT)
            .map_err(|e| e.to_string())?;
    }
    let egress = identity.network.is_some();
    if identity.hostname.is_none() && share_params.is_empty() && !egress {
        return Ok(());
    }
    let mut request = bulkhead_sandbox::snapshot::restored_request(identity.hostname)
        .map_err(|e| e.to_string())?;
    request.share_params = share_params;
    request.egress = egress;
    sandbox
        .client()
        .with_timeout(HAND_OUT_TIMEOUT)
        .restored(&request)
        .map_err(|e| format!("its agent did not take its identity: {e}"))
}

#[cfg(test)]
mod tests {
    use bulkhead_client::types::{DEFAULT_MEMORY_MIB, DEFAULT_VCPUS};
    use bulkhead_client::Limits;
    use bulkhead_sandbox::cgroup::Version;

    use super::*;

    fn clone_record() -> Record {
        Record {
            schema: RECORD_SCHEMA,
            id: "0123456789ab".into(),
            spec: plan::spec_of(&CreateSandbox::default()),
            created_at_ms: 1,
            expires_at_ms: None,
            phase: Phase::Running,
            runtime_parent: "/run/bulkhead/vms/0123456789ab".into(),
            cgroup: Some(CgroupSpec {
                version: Version::V2,
                path: "bulkhead/vm-0123456789ab".into(),
            }),
            limits: Limits {
                memory_bytes: 128 << 20,
                cpu_quota: None,
                pids_max: 64,
                cgroup: Some("bulkhead/vm-0123456789ab".into()),
            },
            sandbox: None,
            failure: None,
            template: Some("base".into()),
            pool: true,
        }
    }

    #[test]
    fn a_handed_out_clone_is_recorded_as_a_sandbox_with_the_requests_settings() {
        // Arrange
        let clone = clone_record();
        let request = CreateSandbox {
            labels: [("team".to_owned(), "a".to_owned())].into(),
            ..CreateSandbox::default()
        };
        let spec = plan::spec_of(&request);
        let limits = VmLimits {
            memory_bytes: 128 << 20,
            cpu_quota: Some(0.5),
            pids_max: 40,
        };

        // Act
        let record = handed_out(&clone, &spec, &limits, Some(60));

        // Assert
        assert!(!record.pool);
        assert_eq!(record.id, clone.id);
        assert_eq!(record.cgroup, clone.cgroup);
        assert_eq!(record.runtime_parent, clone.runtime_parent);
        assert_eq!(record.template.as_deref(), Some("base"));
        assert_eq!(
            record.spec.labels.get("team").map(String::as_str),
            Some("a")
        );
        assert_eq!(
            (record.limits.cpu_quota, record.limits.pids_max),
            (Some(0.5), 40)
        );
        assert_eq!(record.limits.cgroup, clone.limits.cgroup);
        assert_eq!(
            record.expires_at_ms,
            Some(record.created_at_ms + 60_000),
            "the TTL counts from the hand-out"
        );
    }

    #[test]
    fn the_refill_waits_after_a_hand_out_from_a_full_pool_while_a_clone_is_ready() {
        // Arrange
        let now = Instant::now();
        let from_full = settle_until(2, 2, now);
        let from_short = settle_until(1, 2, now);
        let soon = now + Duration::from_millis(100);

        // Act
        let with_one_ready = settle_left(from_full, 1, soon);
        let with_none_ready = settle_left(from_full, 0, soon);
        let after_it = settle_left(from_full, 1, now + REFILL_SETTLE);
        let not_full_before = settle_left(from_short, 1, soon);

        // Assert
        assert_eq!(
            with_one_ready,
            Some(REFILL_SETTLE - Duration::from_millis(100))
        );
        assert_eq!(with_none_ready, None, "an empty pool is refilled at once");
        assert_eq!(after_it, None);
        assert_eq!(
            not_full_before, None,
            "a pool already short is refilled at once"
        );
    }

    #[test]
    fn only_template_creates_without_images_or_disks_are_served() {
        // Arrange
        let pool = Pool {
            template: Template {
                name: "base".into(),
                dir: "/nonexistent".into(),
                manifest: bulkhead_sandbox::snapshot::Manifest {
                    bulkhead_version: "0".into(),
                    created_unix_ms: 0,
                    memory_mib: DEFAULT_MEMORY_MIB,
                    vcpus: DEFAULT_VCPUS,
                    ready: bulkhead_protocol::Ready {
                        version: bulkhead_protocol::PROTOCOL_VERSION,
                        agent_version: "0".into(),
                        init_started: Default::default(),
                        listening: Default::default(),
                    },
                    disks: Vec::new(),
                },
                slots: Default::default(),
            },
            size: 1,
            share_owner: None,
            state: Mutex::new(PoolState::default()),
            wake: tokio::sync::Notify::new(),
            refiller: Mutex::new(None),
        };
        let base = clone_request("base");

        // Act / Assert
        assert!(pool.serves(&base));
        assert!(!pool.serves(&clone_request("other")));
        assert!(!pool.serves(&CreateSandbox::default()));
        let with = |change: fn(&mut CreateSandbox)| {
            let mut request = base.clone();
            change(&mut request);
            pool.serves(&request)
        };
        assert!(with(|r| r.hostname = Some("h".into())));
        assert!(with(|r| r.pids_max = Some(40)));
        assert!(with(|r| r.network = Some(Default::default())));
        assert!(!with(|r| r.image = Some("debian".into())));
        assert!(!with(|r| r.disk_mib = Some(64)));
        // Shares are attached at the hand-out when the clone can serve them.
        assert!(with(|r| r.workspace =
            Some(bulkhead_client::WorkspaceSpec {
                path: "/w".into(),
                mode: bulkhead_client::WorkspaceMode::Clone,
            })));
        assert!(with(|r| r.mounts = vec![bulkhead_client::MountSpec {
            host: "/d".into(),
            guest: "/d".into(),
            ro: true,
        }]));
    }
}
