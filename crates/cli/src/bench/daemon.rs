//! `bulkhead bench --daemon`: each run creates a sandbox through `bulkheadd`'s API (a cold boot,
//! or with `--template` a restore, or a hand-out of an idle clone when the daemon's warm pool
//! keeps that template), runs the command with one exec and deletes the sandbox: the times an
//! API client that keeps its process (the Rust client, the Python SDK) pays, without the CLI
//! processes `bulkhead create` + `bulkhead exec` would add.
//!
//! SIGINT, SIGTERM, SIGHUP or SIGQUIT stops the bench ([`Stop`]): no new run starts, a run's
//! command is abandoned, and every sandbox a run created is deleted before `bench` exits with
//! 128+N (a second signal exits at once).
//!
//! The daemon's own VMMs have no phases or memory sample here: a record has the create's
//! duration (its answer comes once the guest's agent is ready: `create_to_ready_ms`) and the
//! time to the command's first output or exit status (`create_to_first_output_ms`), both from
//! the moment the create request was sent.

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bulkhead_client::{Client, CreateSandbox, ExecEvent, ExecSpec, Health};
use signal_hook::consts::{SIGHUP, SIGINT, SIGQUIT, SIGTERM};
use tokio::sync::Notify;

use super::report::RunRecord;

/// Pause between two looks at the warm pool while it refills.
const POOL_POLL: Duration = Duration::from_millis(50);

/// Whether a stop signal arrived, shared by every run and the signal thread.
#[derive(Debug, Default)]
pub struct Stop {
    stopped: AtomicBool,
    signal: AtomicI32,
    notify: Notify,
}

impl Stop {
    /// Installs the handlers of SIGINT, SIGTERM, SIGHUP and SIGQUIT: the first stops the
    /// bench, a second exits at once with 128+N.
    ///
    /// # Errors
    /// A message when the handlers cannot be installed.
    pub fn install() -> Result<Arc<Stop>, String> {
        let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP, SIGQUIT])
            .map_err(|e| format!("cannot install signal handlers: {e}"))?;
        let stop = Arc::new(Stop::default());
        let shared = stop.clone();
        std::thread::spawn(move || {
            for signal in signals.forever() {
                if shared.stopped.swap(true, Ordering::SeqCst) {
                    std::process::exit(128 + signal);
                }
                shared.signal.store(signal, Ordering::SeqCst);
                eprintln!(
                    "bulkhead: stopping the bench (signal {signal}): deleting its sandboxes; \
                     another signal exits at once"
                );
                shared.notify.notify_waiters();
            }
        });
        Ok(stop)
    }

    /// The signal that stopped the bench, if one did.
    pub fn signal(&self) -> Option<i32> {
        self.stopped
            .load(Ordering::SeqCst)
            .then(|| self.signal.load(Ordering::SeqCst))
    }

    /// Returns once the bench is stopped.
    async fn stopped(&self) {
        let notified = self.notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if !self.stopped.load(Ordering::SeqCst) {
            notified.await;
        }
    }
}

/// What a run that a stop signal cut short reports.
const INTERRUPTED: &str = "interrupted by a signal";

/// One run through the daemon.
#[derive(Debug)]
pub struct DaemonRun<'a> {
    /// The daemon.
    pub client: &'a Client,
    /// The create request of every run.
    pub create: &'a CreateSandbox,
    /// The command.
    pub exec: &'a ExecSpec,
    /// How long the create, the pool's refill and each wait for an event of the command may
    /// take.
    pub patience: Duration,
    /// Set by a stop signal.
    pub stop: &'a Stop,
}

impl DaemonRun<'_> {
    /// Runs number `index`. Never fails: a failure is a record with `ok: false`.
    pub fn run(&self, index: usize) -> RunRecord {
        // Multi-thread, so that the client keeps the create's connection for the exec
        // (`bulkhead_client` keeps only those), as a long-lived API client would.
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build();
        match runtime {
            Ok(runtime) => runtime.block_on(self.run_async(index)),
            Err(e) => RunRecord {
                error: Some(format!("cannot start an async runtime: {e}")),
                ..RunRecord::unmeasured(index)
            },
        }
    }

    async fn run_async(&self, index: usize) -> RunRecord {
        let mut record = RunRecord::unmeasured(index);
        let waited = tokio::select! {
            biased;
            () = self.stop.stopped() => Err(INTERRUPTED.to_owned()),
            waited = self.wait_for_full_pool() => waited,
        };
        if let Err(e) = waited {
            record.error = Some(e);
            return record;
        }
        let created = Instant::now();
        let info = match tokio::time::timeout(self.patience, self.client.create(self.create)).await
        {
            Ok(Ok(info)) => info,
            Ok(Err(e)) => {
                record.error = Some(format!("create: {e}"));
                return record;
            }
            Err(_) => {
                record.error = Some(format!("create: no answer in {:?}", self.patience));
                return record;
            }
        };
        // (A create is never abandoned: the sandbox it makes is deleted below.)
        record.create_to_ready_ms = Some(ms(created.elapsed()));
        let outcome = tokio::select! {
            biased;
            () = self.stop.stopped() => Err(INTERRUPTED.to_owned()),
            outcome = self.command(&info.id, created) => outcome,
        };
        let deleted = self.client.delete(&info.id).await;
        record.error = match (&outcome, deleted) {
            (Err(e), _) => Some(e.clone()),
            (Ok((_, code)), _) if *code != 0 => Some(format!("the command exited {code}")),
            (_, Err(e)) => Some(format!("delete: {e}")),
            (Ok(_), Ok(())) => None,
        };
        if let Ok((first_output, code)) = outcome {
            record.create_to_first_output_ms = Some(first_output);
            record.exit_code = Some(code);
        }
        record.ok = record.error.is_none();
        record
    }

    /// Runs the command in sandbox `id`; returns ms from `created` to its first output (or
    /// exit status), and its exit code (128+N for signal N).
    async fn command(&self, id: &str, created: Instant) -> Result<(f64, i32), String> {
        let patient =
            |what: &'static str| move |_| format!("exec: no {what} in {:?}", self.patience);
        let mut stream = tokio::time::timeout(self.patience, self.client.exec(id, self.exec))
            .await
            .map_err(patient("answer"))?
            .map_err(|e| format!("exec: {e}"))?;
        let mut first_output = None;
        loop {
            let event = tokio::time::timeout(self.patience, stream.next_event())
                .await
                .map_err(patient("event"))?
                .map_err(|e| format!("exec: {e}"))?;
            first_output.get_or_insert_with(|| ms(created.elapsed()));
            match event {
                Some(ExecEvent::Exit(exit)) => {
                    let code = match (exit.code, exit.signal) {
                        (Some(code), _) => code,
                        (None, Some(signal)) => 128 + signal,
                        (None, None) => -1,
                    };
                    let first = first_output.unwrap_or_default();
                    return Ok((first, code));
                }
                Some(_) => {}
                None => return Err("exec: the stream ended without an exit status".into()),
            }
        }
    }

    /// With a template that the daemon's warm pool keeps, waits (untimed) until the pool is
    /// full again, so that each create measures a hand-out rather than whatever the refill
    /// left; returns at once otherwise.
    async fn wait_for_full_pool(&self) -> Result<(), String> {
        let Some(template) = &self.create.template else {
            return Ok(());
        };
        let deadline = Instant::now() + self.patience;
        loop {
            let health = self
                .client
                .health()
                .await
                .map_err(|e| format!("health: {e}"))?;
            if !refilling(&health, template) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "the warm pool of template {template} did not refill in {:?} \
                     (--boot-timeout); the daemon's log says why",
                    self.patience
                ));
            }
            tokio::time::sleep(POOL_POLL).await;
        }
    }
}

/// Whether the daemon answering `health` keeps a warm pool of `template` that is not full.
fn refilling(health: &Health, template: &str) -> bool {
    health
        .pool
        .as_ref()
        .is_some_and(|pool| pool.template == template && pool.ready < pool.size)
}

/// `d` in ms.
fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

#[cfg(test)]
mod tests {
    use bulkhead_client::PoolStatus;

    use super::*;

    fn health(pool: Option<(&str, usize, usize)>) -> Health {
        Health {
            status: "ok".into(),
            version: "0".into(),
            sandboxes: 0,
            pool: pool.map(|(template, size, ready)| PoolStatus {
                template: template.into(),
                size,
                ready,
                restoring: size - ready,
            }),
        }
    }

    #[test]
    fn a_run_waits_only_for_a_pool_of_its_own_template_that_is_not_full() {
        // Arrange
        let cases = [
            (health(Some(("py", 2, 1))), true),
            (health(Some(("py", 2, 0))), true),
            (health(Some(("py", 2, 2))), false),
            (health(Some(("node", 2, 0))), false),
            (health(None), false),
        ];

        // Act / Assert
        for (health, waits) in cases {
            assert_eq!(refilling(&health, "py"), waits, "{health:?}");
        }
    }
}
