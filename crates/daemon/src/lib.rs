//! `bulkheadd`, the bulkhead host daemon: a local HTTP/1.1 + JSON API on a Unix socket through
//! which clients create sandboxes (one `bulkhead-vmm` process per microVM, each in its own
//! cgroup with memory, CPU and task limits), run commands and move files in them, and destroy
//! them. Sandboxes are recorded in a state directory so that a restarted daemon — even after
//! `kill -9` — adopts or cleans up every VM of its previous run.
//!
//! Modules: [`config`] (TOML + flags), [`api`] (routes, OpenAPI), [`manager`] (registry and
//! lifecycle), [`cgroup`] (per-VM limits), [`store`] (records), [`metrics`], [`listener`]
//! (socket, activation, sd_notify). `docs/daemon.md` is the operator's guide.
#![deny(missing_docs)]

pub mod api;
pub use bulkhead_sandbox::cgroup;
pub mod config;
pub mod listener;
pub mod manager;
pub mod metrics;
pub mod store;
pub mod util;

use std::sync::Arc;
use std::time::Duration;

use tokio::signal::unix::{signal, SignalKind};

use crate::config::Config;
use crate::manager::Manager;
use crate::metrics::Metrics;

/// How long in-flight requests may take to finish once the sandboxes are dealt with at shutdown.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// Errors that stop the daemon.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// Start-up failed (state dir, cgroups, runtime dir).
    #[error("{0}")]
    Startup(String),
    /// The API socket could not be set up.
    #[error(transparent)]
    Listen(#[from] listener::ListenError),
    /// Serving failed.
    #[error("serving the API: {0}")]
    Serve(std::io::Error),
}

/// Runs the daemon until SIGTERM or SIGINT: recovers the previous run's sandboxes, serves the
/// API, then applies the shutdown policy.
///
/// # Errors
/// [`DaemonError`].
pub async fn run(config: Config) -> Result<(), DaemonError> {
    let config = Arc::new(config);
    let mut sigterm = signal(SignalKind::terminate()).map_err(DaemonError::Serve)?;
    let mut sigint = signal(SignalKind::interrupt()).map_err(DaemonError::Serve)?;
    let manager = Manager::start(config.clone(), Metrics::new())
        .await
        .map_err(DaemonError::Startup)?;
    let socket = listener::listen(&config)?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let app = api::router(manager.clone());
    let server = tokio::spawn(async move {
        let mut stop_rx = stop_rx;
        axum::serve(socket.listener, app)
            .with_graceful_shutdown(async move {
                let _ = stop_rx.wait_for(|stop| *stop).await;
            })
            .await
    });
    tracing::info!(
        "bulkheadd {} listening on {}",
        env!("CARGO_PKG_VERSION"),
        config.socket.display()
    );
    listener::notify_ready();
    tokio::select! {
        _ = sigterm.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = sigint.recv() => tracing::info!("SIGINT: shutting down"),
    }
    listener::notify_stopping();
    let _ = stop_tx.send(true);
    manager.shutdown().await;
    match tokio::time::timeout(DRAIN_TIMEOUT, server).await {
        Ok(Ok(Err(e))) => tracing::error!("server: {e}"),
        Err(_) => tracing::warn!("requests still running after {DRAIN_TIMEOUT:?}; exiting anyway"),
        _ => {}
    }
    if let Some(path) = socket.owned_path {
        let _ = std::fs::remove_file(path);
    }
    tracing::info!("stopped");
    Ok(())
}
