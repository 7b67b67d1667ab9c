//! Prometheus metrics (text exposition at `GET /metrics`), with `prometheus-client`.
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `bulkhead_sandboxes` | gauge | `state` (creating, running, failed, destroying) |
//! | `bulkhead_sandbox_create_seconds` | histogram | — (successful creates: request to agent ready) |
//! | `bulkhead_sandbox_create_failures_total` | counter | — |
//! | `bulkhead_execs_total` | counter | `result` (started, failed) |
//! | `bulkhead_pool_clones` | gauge | `state` (ready, restoring): the warm pool's clones (with `[pool]`) |
//! | `bulkhead_pool_restore_failures_total` | counter | — (failed restores of pool clones) |
//! | `bulkhead_vm_exits_total` | counter | `reason` (destroyed, guest_shutdown, stopped, vmm_error, guest_crash, seccomp_violation, killed, vanished; see `bulkhead_sandbox::VmEnd::reason`) |
//!
//! VM exit reasons come from the VMM's exit report (`bulkhead-vmm --exit-file`, out of the
//! guest's reach) or, without one, its exit status or the signal that killed it; an adopted VMM
//! that left no report ended in a way the daemon cannot know (`vanished`).

use std::sync::Mutex;

use bulkhead_client::SandboxState;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabel {
    state: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: String,
}

/// The daemon's metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Mutex<Registry>,
    sandboxes: Family<StateLabel, Gauge>,
    create_seconds: Histogram,
    create_failures: Counter,
    execs: Family<ResultLabel, Counter>,
    vm_exits: Family<ReasonLabel, Counter>,
    pool_clones: Family<StateLabel, Gauge>,
    pool_failures: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every metric.
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("bulkhead");
        let sandboxes = Family::<StateLabel, Gauge>::default();
        // 50 ms .. ~102 s
        let create_seconds = Histogram::new(exponential_buckets(0.05, 2.0, 12));
        let create_failures = Counter::default();
        let execs = Family::<ResultLabel, Counter>::default();
        let vm_exits = Family::<ReasonLabel, Counter>::default();
        registry.register("sandboxes", "Sandboxes by state", sandboxes.clone());
        registry.register(
            "sandbox_create_seconds",
            "Time from a create request to the guest agent being ready, seconds",
            create_seconds.clone(),
        );
        registry.register(
            "sandbox_create_failures",
            "Sandbox creations that failed",
            create_failures.clone(),
        );
        registry.register("execs", "Commands run, by result", execs.clone());
        registry.register("vm_exits", "VMs that ended, by reason", vm_exits.clone());
        let pool_clones = Family::<StateLabel, Gauge>::default();
        let pool_failures = Counter::default();
        registry.register(
            "pool_clones",
            "The warm pool's clones, ready or being restored",
            pool_clones.clone(),
        );
        registry.register(
            "pool_restore_failures",
            "Restores of warm-pool clones that failed",
            pool_failures.clone(),
        );
        Metrics {
            registry: Mutex::new(registry),
            sandboxes,
            create_seconds,
            create_failures,
            execs,
            vm_exits,
            pool_clones,
            pool_failures,
        }
    }

    /// Sets the warm pool's gauge: `ready` idle clones, `restoring` being restored.
    pub fn pool(&self, ready: usize, restoring: usize) {
        for (state, n) in [("ready", ready), ("restoring", restoring)] {
            self.pool_clones
                .get_or_create(&StateLabel { state })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// Records a failed restore of a pool clone.
    pub fn pool_restore_failed(&self) {
        self.pool_failures.inc();
    }

    /// Records a successful create that took `seconds`.
    pub fn created(&self, seconds: f64) {
        self.create_seconds.observe(seconds);
    }

    /// Records a failed create.
    pub fn create_failed(&self) {
        self.create_failures.inc();
    }

    /// Records an exec: `started` true when the command started, false when it could not.
    pub fn exec(&self, started: bool) {
        let result = if started { "started" } else { "failed" };
        self.execs.get_or_create(&ResultLabel { result }).inc();
    }

    /// Records a VM that ended, by `reason`.
    pub fn vm_exit(&self, reason: &str) {
        self.vm_exits
            .get_or_create(&ReasonLabel {
                reason: reason.to_owned(),
            })
            .inc();
    }

    /// The text exposition, with the sandbox gauge set from `counts` (per state).
    pub fn render(&self, counts: &[(SandboxState, usize)]) -> String {
        for state in SandboxState::ALL {
            let n = counts
                .iter()
                .find(|(s, _)| *s == state)
                .map_or(0, |(_, n)| *n);
            self.sandboxes
                .get_or_create(&StateLabel {
                    state: state.as_str(),
                })
                .set(n as i64);
        }
        let mut out = String::new();
        let registry = self.registry.lock().unwrap_or_else(|p| p.into_inner());
        if encode(&mut out, &registry).is_err() {
            tracing::error!("cannot encode metrics");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rendered_metrics_carry_states_latency_execs_and_exits() {
        // Arrange
        let metrics = Metrics::new();
        metrics.created(0.3);
        metrics.exec(true);
        metrics.vm_exit("guest_crash");
        metrics.pool(3, 1);
        metrics.pool_restore_failed();

        // Act
        let text = metrics.render(&[(SandboxState::Running, 2)]);

        // Assert
        assert!(
            text.contains("bulkhead_sandboxes{state=\"running\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("bulkhead_sandboxes{state=\"failed\"} 0"),
            "{text}"
        );
        assert!(
            text.contains("bulkhead_sandbox_create_seconds_count 1"),
            "{text}"
        );
        assert!(
            text.contains("bulkhead_execs_total{result=\"started\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("bulkhead_vm_exits_total{reason=\"guest_crash\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("bulkhead_pool_clones{state=\"ready\"} 3"),
            "{text}"
        );
        assert!(
            text.contains("bulkhead_pool_restore_failures_total 1"),
            "{text}"
        );
    }
}
