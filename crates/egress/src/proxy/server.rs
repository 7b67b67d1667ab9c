//! The guest-facing side: the accept loop under the connection limit, the HTTP/1.1 server on
//! each guest connection, and the admission steps every request goes through (policy, host-side
//! resolution, address vetting).

use std::convert::Infallible;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::forward::MAX_HEAD_BYTES;
use super::io::{Meter, Metered, Side};
use super::shared::{denied, failed, Body, Conn, Shared};
use super::{connect, plain};
use crate::log::{LogEntry, Via};
use crate::policy::{Decision, Target, TargetHost, VettedAddr};

/// How long a guest may take to send a request head (slowloris bound).
pub(crate) const HEADER_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a host-side lookup may take.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause after a failed accept (e.g. out of file descriptors) before the next one.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// The socket the proxy listens on.
#[derive(Debug)]
pub(crate) enum Listener {
    /// A Unix stream socket (the VMM's hybrid vsock backend connects here).
    Unix(UnixListener),
    /// A TCP socket (tests, benchmarks).
    Tcp(TcpListener),
}

/// Accepts guest connections until shutdown, at most `max` at a time (a connection waits in
/// the listen backlog while the limit is reached).
pub(crate) async fn accept_loop(listener: Listener, shared: Arc<Shared>, max: usize) {
    let limit = Arc::new(Semaphore::new(max));
    let cancel = shared.tasks.cancel.clone();
    loop {
        let permit = tokio::select! {
            permit = limit.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => return,
            },
            () = cancel.cancelled() => return,
        };
        let accepted = tokio::select! {
            accepted = accept(&listener, &shared, permit) => accepted,
            () = cancel.cancelled() => return,
        };
        if let Err(e) = accepted {
            tracing::warn!("egress proxy: accept failed: {e}");
            tokio::time::sleep(ACCEPT_BACKOFF).await;
        }
    }
}

async fn accept(
    listener: &Listener,
    shared: &Arc<Shared>,
    permit: OwnedSemaphorePermit,
) -> std::io::Result<()> {
    match listener {
        Listener::Unix(l) => serve_guest(l.accept().await?.0, shared, permit),
        Listener::Tcp(l) => serve_guest(l.accept().await?.0, shared, permit),
    }
    Ok(())
}

/// Serves one guest connection (HTTP/1.1 proxy requests) in a task of its own.
fn serve_guest<S>(stream: S, shared: &Arc<Shared>, permit: OwnedSemaphorePermit)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let conn = Conn {
        shared: shared.clone(),
        meter: Meter::new(),
        permit: Arc::new(permit),
    };
    let io = Metered::new(stream, conn.meter.clone(), Side::Guest);
    let for_service = conn.clone();
    conn.spawn(async move {
        let service = service_fn(move |req| dispatch(req, for_service.clone()));
        // A client may shut its write side once its request is out (`printf ... | nc`); it
        // still gets the answer (hyper's default drops the connection at that EOF).
        let served = http1::Builder::new()
            .half_close(true)
            .timer(TokioTimer::new())
            .header_read_timeout(HEADER_TIMEOUT)
            .max_buf_size(MAX_HEAD_BYTES)
            .serve_connection(TokioIo::new(io), service)
            .with_upgrades();
        let _ = served.await;
    });
}

async fn dispatch(req: Request<Incoming>, conn: Conn) -> Result<Response<Body>, Infallible> {
    Ok(match *req.method() == Method::CONNECT {
        true => connect::handle(req, conn).await,
        false => plain::handle(req, conn).await,
    })
}

/// A request the proxy has seen: method and path, for log lines.
pub(crate) type Seen<'a> = Option<(&'a str, &'a str)>;

/// A log line for `target`.
pub(crate) fn entry(target: &Target, via: Via, decision: &Decision, seen: Seen<'_>) -> LogEntry {
    let line = LogEntry::new(&target.host.to_string(), target.port, via, decision);
    match seen {
        Some((method, path)) => line.with_request(method, path),
        None => line,
    }
}

/// Logs a refusal and builds its `403`.
pub(crate) fn refuse(
    shared: &Shared,
    target: &Target,
    via: Via,
    decision: &Decision,
    seen: Seen<'_>,
) -> Response<Body> {
    let mut line = entry(target, via, decision, seen);
    line.status = Some(StatusCode::FORBIDDEN.as_u16());
    shared.log.record(&line);
    denied(&target.host.to_string(), target.port, decision)
}

/// Logs a failure (the policy allowed the request but it could not be carried out: the log
/// line says `allow` with the failure as reason and the error status) and builds its response.
pub(crate) fn fail(
    shared: &Shared,
    target: &Target,
    via: Via,
    status: StatusCode,
    why: &str,
    seen: Seen<'_>,
) -> Response<Body> {
    let decision = Decision::allow(None, why);
    let mut line = entry(target, via, &decision, seen);
    line.status = Some(status.as_u16());
    shared.log.record(&line);
    failed(status, &format!("egress to {target} failed: {why}"))
}

/// Applies `decision`, resolves the target's name on the host and vets every address: the
/// addresses to connect to, or the response refusing the request (already logged).
pub(crate) async fn admit(
    shared: &Shared,
    target: &Target,
    via: Via,
    decision: &Decision,
    seen: Seen<'_>,
) -> Result<Vec<VettedAddr>, Response<Body>> {
    if !decision.is_allowed() {
        return Err(refuse(shared, target, via, decision, seen));
    }
    let addrs: Vec<IpAddr> = match &target.host {
        TargetHost::Ip(addr) => vec![*addr],
        TargetHost::Name(name) => {
            let lookup = tokio::time::timeout(RESOLVE_TIMEOUT, shared.resolver.resolve(name));
            match lookup.await {
                Ok(Ok(addrs)) => addrs,
                Ok(Err(e)) => {
                    return Err(fail(
                        shared,
                        target,
                        via,
                        StatusCode::BAD_GATEWAY,
                        &e.to_string(),
                        seen,
                    ))
                }
                Err(_) => {
                    let why = format!("resolving {name} timed out");
                    return Err(fail(
                        shared,
                        target,
                        via,
                        StatusCode::GATEWAY_TIMEOUT,
                        &why,
                        seen,
                    ));
                }
            }
        }
    };
    shared
        .policy
        .vet_addresses(target, &addrs)
        .map_err(|refused| refuse(shared, target, via, &refused, seen))
}
