//! State shared by every task of one proxy, task spawning, response builders and the
//! per-request log guard.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Body as HttpBody;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Response, StatusCode};
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::io::Meter;
use crate::log::{EgressLog, LogEntry};
use crate::policy::{Decision, Policy};
use crate::resolve::Resolve;
use crate::secrets::Injector;
use crate::tls::{Authority, UpstreamTls};

/// Any error a body may carry.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// The body type of every request and response the proxy builds.
pub(crate) type Body = UnsyncBoxBody<Bytes, BoxError>;

/// Everything the proxy's tasks share.
#[derive(Debug)]
pub(crate) struct Shared {
    pub policy: Policy,
    pub resolver: Arc<dyn Resolve>,
    pub authority: Authority,
    pub upstream_tls: UpstreamTls,
    pub injector: Injector,
    pub log: EgressLog,
    pub idle_timeout: Duration,
    pub connect_timeout: Duration,
    pub tasks: Tasks,
}

/// Spawns tasks that end when the proxy shuts down, and counts them.
#[derive(Clone, Debug)]
pub(crate) struct Tasks {
    pub cancel: CancellationToken,
    pub tracker: TaskTracker,
}

impl Tasks {
    /// Runs `fut` as a task that is dropped (closing whatever it owns) on shutdown.
    pub fn spawn<F>(&self, fut: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let cancel = self.cancel.clone();
        self.tracker.spawn(async move {
            tokio::select! {
                () = cancel.cancelled() => {}
                () = fut => {}
            }
        });
    }
}

impl<F> hyper::rt::Executor<F> for Tasks
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn execute(&self, fut: F) {
        self.spawn(async move {
            fut.await;
        });
    }
}

/// One guest connection: the proxy's state, the connection's byte meter (its idle clock) and
/// its slot under the connection limit, held until every task serving the connection ends.
#[derive(Clone, Debug)]
pub(crate) struct Conn {
    pub shared: Arc<Shared>,
    pub meter: Arc<Meter>,
    pub permit: Arc<OwnedSemaphorePermit>,
}

impl Conn {
    /// Spawns `fut` as a task of this connection: it ends on shutdown, or when no byte has
    /// crossed the guest's stream for the idle timeout.
    pub fn spawn<F>(&self, fut: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let meter = self.meter.clone();
        let permit = self.permit.clone();
        let idle = self.shared.idle_timeout;
        self.shared.tasks.spawn(async move {
            let _slot = permit;
            tokio::select! {
                () = fut => {}
                () = meter.idle(idle) => {}
            }
        });
    }
}

/// A plain-text response (`text/plain; charset=utf-8`).
pub(crate) fn text_response(status: StatusCode, text: String) -> Response<Body> {
    let mut response = Response::new(full(text));
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// `403` with `bulkhead: egress to HOST:PORT denied: REASON`.
pub(crate) fn denied(host: &str, port: u16, decision: &Decision) -> Response<Body> {
    let rule = decision
        .rule
        .as_deref()
        .map(|r| format!(" (rule {r})"))
        .unwrap_or_default();
    let text = format!(
        "bulkhead: egress to {host}:{port} denied: {}{rule}\n",
        decision.reason
    );
    text_response(StatusCode::FORBIDDEN, text)
}

/// A `bulkhead:`-prefixed error response.
pub(crate) fn failed(status: StatusCode, text: &str) -> Response<Body> {
    text_response(status, format!("bulkhead: {text}\n"))
}

/// A body of fixed bytes.
pub(crate) fn full(data: impl Into<Bytes>) -> Body {
    Full::new(data.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// An empty body.
pub(crate) fn empty() -> Body {
    full(Bytes::new())
}

/// Writes its log entry, with the bytes counted, when dropped (when the response body ends,
/// fails, or the proxy shuts down).
#[derive(Debug)]
pub(crate) struct LogGuard {
    shared: Arc<Shared>,
    entry: Option<LogEntry>,
    pub up: Arc<AtomicU64>,
    pub down: Arc<AtomicU64>,
    /// A stream meter whose bytes are added too (spliced tunnels).
    pub meter: Option<Arc<Meter>>,
}

impl LogGuard {
    /// A guard that will write `entry`.
    pub fn new(shared: Arc<Shared>, entry: LogEntry) -> LogGuard {
        LogGuard {
            shared,
            entry: Some(entry),
            up: Arc::new(AtomicU64::new(0)),
            down: Arc::new(AtomicU64::new(0)),
            meter: None,
        }
    }
}

impl LogGuard {
    /// Moves the entry into a new guard sharing the counters; this one then writes nothing.
    pub fn take(&mut self) -> LogGuard {
        LogGuard {
            shared: self.shared.clone(),
            entry: self.entry.take(),
            up: self.up.clone(),
            down: self.down.clone(),
            meter: self.meter.clone(),
        }
    }
}

impl Drop for LogGuard {
    fn drop(&mut self) {
        if let Some(mut entry) = self.entry.take() {
            let (meter_up, meter_down) = self.meter.as_ref().map_or((0, 0), |m| (m.up(), m.down()));
            entry.bytes_up = self.up.load(Ordering::Relaxed) + meter_up;
            entry.bytes_down = self.down.load(Ordering::Relaxed) + meter_down;
            self.shared.log.record(&entry);
        }
    }
}

/// Wraps a body so its data bytes are added to `counter`; `keep` is dropped with the body.
pub(crate) fn counted<B, K>(body: B, counter: Arc<AtomicU64>, keep: K) -> Body
where
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    K: Send + 'static,
{
    body.map_frame(move |frame| {
        let _ = &keep;
        if let Some(data) = frame.data_ref() {
            counter.fetch_add(data.len() as u64, Ordering::Relaxed);
        }
        frame
    })
    .map_err(Into::into)
    .boxed_unsync()
}
