//! Forwarding requests upstream: header hygiene, connections to vetted addresses, the upstream
//! connections of one intercepted guest connection, and responses back to the guest.

use std::sync::{Arc, Mutex};

use hyper::body::Incoming;
use hyper::client::conn::{http1, http2};
use hyper::header::{HeaderMap, HeaderName, HeaderValue, CONNECTION, HOST, TE, UPGRADE};
use hyper::{Request, Response, StatusCode, Uri, Version};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

use super::connect::SPLICE_BUFFER;
use super::shared::{counted, Body, Conn, LogGuard, Shared};
use crate::policy::{HostName, VettedAddr};

/// Most addresses tried for one connection.
const MAX_CONNECT_TRIES: usize = 4;
/// Most idle HTTP/1.1 upstream connections kept per intercepted guest connection.
const MAX_IDLE_HTTP1: usize = 4;
/// Most bytes of response head (status line and headers) read from an upstream, in bytes.
pub(crate) const MAX_HEAD_BYTES: usize = 64 * 1024;

/// Hop-by-hop header fields (RFC 9110 §7.6.1, plus the de-facto `Keep-Alive` and
/// `Proxy-Connection`) that a proxy must not forward.
const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Errors reaching an upstream.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ForwardError {
    /// No TCP connection to any vetted address.
    #[error("cannot connect: {0}")]
    Connect(std::io::Error),
    /// The upstream's TLS handshake or certificate check failed.
    #[error("TLS with the upstream failed: {0}")]
    Tls(std::io::Error),
    /// Connecting or the TLS handshake took longer than the connect timeout.
    #[error("connecting timed out")]
    Timeout,
    /// HTTP with the upstream failed.
    #[error("upstream HTTP error: {0}")]
    Http(#[from] hyper::Error),
    /// The request cannot be rewritten for the upstream.
    #[error("cannot rewrite the request: {0}")]
    Rewrite(#[from] hyper::http::Error),
}

impl ForwardError {
    /// The status the guest gets (RFC 9110 §15.6.3 Bad Gateway, §15.6.5 Gateway Timeout).
    pub fn status(&self) -> StatusCode {
        match self {
            ForwardError::Timeout => StatusCode::GATEWAY_TIMEOUT,
            _ => StatusCode::BAD_GATEWAY,
        }
    }
}

/// The protocol an HTTP/1.1 request asks to upgrade to (RFC 9110 §7.8), if it does.
pub(crate) fn upgrade_protocol<B>(req: &Request<B>) -> Option<HeaderValue> {
    if req.version() != Version::HTTP_11 {
        return None;
    }
    let asks = connection_tokens(req.headers()).any(|t| t.eq_ignore_ascii_case("upgrade"));
    asks.then(|| req.headers().get(UPGRADE).cloned()).flatten()
}

/// The comma-separated tokens of every `Connection` field.
fn connection_tokens(headers: &HeaderMap) -> impl Iterator<Item = String> + '_ {
    headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|t| t.trim().to_owned())
}

/// Removes hop-by-hop fields and the fields `Connection` names; keeps `TE: trailers` (gRPC
/// needs it) and, for an upgrade, `Connection: upgrade` with the `Upgrade` field.
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap, upgrade: Option<HeaderValue>) {
    let listed: Vec<HeaderName> = connection_tokens(headers)
        .filter_map(|t| HeaderName::from_bytes(t.as_bytes()).ok())
        .collect();
    let trailers = headers
        .get(TE)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"trailers"));
    for name in listed {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
    if trailers {
        headers.insert(TE, HeaderValue::from_static("trailers"));
    }
    if let Some(protocol) = upgrade {
        headers.insert(CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(UPGRADE, protocol);
    }
}

/// Rewrites a request for an upstream: absolute URI without `Host` for HTTP/2 (RFC 9113
/// §8.3.1), origin form with `Host` for HTTP/1.1 (RFC 9112 §3.2).
pub(crate) fn to_upstream(
    req: &mut Request<Body>,
    scheme: &str,
    authority: &str,
    h2: bool,
) -> Result<(), ForwardError> {
    let path = req
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    if h2 {
        *req.uri_mut() = Uri::builder()
            .scheme(scheme)
            .authority(authority)
            .path_and_query(path)
            .build()?;
        req.headers_mut().remove(HOST);
        *req.version_mut() = Version::HTTP_2;
    } else {
        *req.uri_mut() = Uri::builder().path_and_query(path).build()?;
        let host = HeaderValue::from_str(authority).map_err(hyper::http::Error::from)?;
        req.headers_mut().insert(HOST, host);
        *req.version_mut() = Version::HTTP_11;
    }
    Ok(())
}

/// A response for the guest: hop-by-hop fields and secret values removed, the body counted
/// into `guard`, which writes the log line when the body ends.
pub(crate) fn to_guest(
    shared: &Shared,
    response: Response<Incoming>,
    guard: LogGuard,
    guest_h2: bool,
) -> Response<Body> {
    let (mut parts, body) = response.into_parts();
    let upgrade = (parts.status == StatusCode::SWITCHING_PROTOCOLS)
        .then(|| parts.headers.get(UPGRADE).cloned())
        .flatten();
    strip_hop_by_hop(&mut parts.headers, upgrade);
    shared.injector.scrub_response(&mut parts.headers);
    parts.version = if guest_h2 {
        Version::HTTP_2
    } else {
        Version::HTTP_11
    };
    let down = guard.down.clone();
    Response::from_parts(parts, counted(body, down, guard))
}

/// A TCP connection to the first vetted address that answers, each try bounded by the
/// connect timeout.
pub(crate) async fn connect_tcp(
    shared: &Shared,
    addrs: &[VettedAddr],
) -> Result<TcpStream, ForwardError> {
    let mut last = ForwardError::Connect(std::io::ErrorKind::AddrNotAvailable.into());
    for addr in addrs.iter().take(MAX_CONNECT_TRIES) {
        let attempt = TcpStream::connect(addr.socket_addr());
        match tokio::time::timeout(shared.connect_timeout, attempt).await {
            Ok(Ok(stream)) => {
                let _ = stream.set_nodelay(true);
                return Ok(stream);
            }
            Ok(Err(e)) => last = ForwardError::Connect(e),
            Err(_) => last = ForwardError::Timeout,
        }
    }
    Err(last)
}

/// A verified TLS connection to `name` at one of `addrs`; true when ALPN chose HTTP/2.
async fn connect_tls(
    shared: &Shared,
    name: &HostName,
    addrs: &[VettedAddr],
    offer_h2: bool,
) -> Result<(TlsStream<TcpStream>, bool), ForwardError> {
    let tcp = connect_tcp(shared, addrs).await?;
    let config = match offer_h2 {
        true => shared.upstream_tls.h2.clone(),
        false => shared.upstream_tls.http1.clone(),
    };
    let server_name = rustls::pki_types::ServerName::try_from(name.to_string())
        .map_err(|e| ForwardError::Tls(std::io::Error::other(e)))?;
    let handshake = TlsConnector::from(config).connect(server_name, tcp);
    let tls = match tokio::time::timeout(shared.connect_timeout, handshake).await {
        Ok(Ok(tls)) => tls,
        Ok(Err(e)) => return Err(ForwardError::Tls(e)),
        Err(_) => return Err(ForwardError::Timeout),
    };
    let h2 = crate::tls::is_h2(tls.get_ref().1.alpn_protocol());
    Ok((tls, h2))
}

/// An HTTP/1.1 client connection over `io`, its connection task spawned.
pub(crate) async fn http1_client<I>(
    shared: &Shared,
    io: I,
) -> Result<http1::SendRequest<Body>, ForwardError>
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (sender, conn) = http1::Builder::new()
        .max_buf_size(MAX_HEAD_BYTES)
        .handshake(TokioIo::new(io))
        .await?;
    shared.tasks.spawn(async move {
        let _ = conn.with_upgrades().await;
    });
    Ok(sender)
}

/// The upstream side of one intercepted guest connection: one shared HTTP/2 connection, or
/// HTTP/1.1 connections reused one request at a time.
#[derive(Debug)]
pub(crate) struct Upstream {
    shared: Arc<Shared>,
    name: HostName,
    addrs: Vec<VettedAddr>,
    offer_h2: bool,
    h2: Mutex<Option<http2::SendRequest<Body>>>,
    idle_http1: Mutex<Vec<http1::SendRequest<Body>>>,
}

enum Sender {
    H1(http1::SendRequest<Body>),
    H2(http2::SendRequest<Body>),
}

impl Upstream {
    /// Upstream connections to `name` at `addrs`, offering HTTP/2 when the guest speaks it.
    pub fn new(
        shared: Arc<Shared>,
        name: HostName,
        addrs: Vec<VettedAddr>,
        offer_h2: bool,
    ) -> Upstream {
        Upstream {
            shared,
            name,
            addrs,
            offer_h2,
            h2: Mutex::new(None),
            idle_http1: Mutex::new(Vec::new()),
        }
    }

    /// Sends `req` (already rewritten except for its form) and returns the response head.
    pub async fn send(
        &self,
        mut req: Request<Body>,
        authority: &str,
        upgrade: bool,
    ) -> Result<Response<Incoming>, ForwardError> {
        match self.sender(upgrade).await? {
            Sender::H2(mut sender) => {
                to_upstream(&mut req, "https", authority, true)?;
                sender.ready().await?;
                Ok(sender.send_request(req).await?)
            }
            Sender::H1(mut sender) => {
                to_upstream(&mut req, "https", authority, false)?;
                sender.ready().await?;
                let response = sender.send_request(req).await?;
                if !upgrade {
                    self.put_back(sender);
                }
                Ok(response)
            }
        }
    }

    async fn sender(&self, upgrade: bool) -> Result<Sender, ForwardError> {
        if !upgrade {
            if let Some(h2) = self.reuse_h2() {
                return Ok(Sender::H2(h2));
            }
            if let Some(h1) = self.reuse_http1() {
                return Ok(Sender::H1(h1));
            }
        }
        let (tls, h2) = connect_tls(
            &self.shared,
            &self.name,
            &self.addrs,
            self.offer_h2 && !upgrade,
        )
        .await?;
        if !h2 {
            return Ok(Sender::H1(http1_client(&self.shared, tls).await?));
        }
        let (sender, conn) = http2::Builder::new(self.shared.tasks.clone())
            .timer(TokioTimer::new())
            .max_header_list_size(MAX_HEAD_BYTES as u32)
            .handshake(TokioIo::new(tls))
            .await?;
        self.shared.tasks.spawn(async move {
            let _ = conn.await;
        });
        *lock(&self.h2) = Some(sender.clone());
        Ok(Sender::H2(sender))
    }

    fn reuse_h2(&self) -> Option<http2::SendRequest<Body>> {
        lock(&self.h2).clone().filter(|s| !s.is_closed())
    }

    fn reuse_http1(&self) -> Option<http1::SendRequest<Body>> {
        let mut idle = lock(&self.idle_http1);
        idle.retain(|s| !s.is_closed());
        let ready = idle.iter().position(http1::SendRequest::is_ready)?;
        Some(idle.swap_remove(ready))
    }

    fn put_back(&self, sender: http1::SendRequest<Body>) {
        let mut idle = lock(&self.idle_http1);
        if idle.len() < MAX_IDLE_HTTP1 {
            idle.push(sender);
        }
    }
}

/// Locks a mutex, taking the data of a poisoned one.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The authority to send upstream: `host`, or `host:port` when the port is not the scheme's
/// default (RFC 9110 §4.2).
pub(crate) fn authority(host: &str, port: u16, default_port: u16) -> String {
    match port == default_port {
        true => host.to_owned(),
        false => format!("{host}:{port}"),
    }
}

/// After a `101 Switching Protocols` (RFC 9110 §15.2.2), splices the guest's and the upstream's
/// upgraded connections (WebSocket and the like) in a task of `conn`; `guard` logs the bytes.
pub(crate) fn splice_upgrade(
    conn: &Conn,
    guest: hyper::upgrade::OnUpgrade,
    response: &mut Response<Incoming>,
    guard: LogGuard,
) {
    let upstream = hyper::upgrade::on(response);
    conn.spawn(async move {
        let (Ok(guest), Ok(upstream)) = tokio::join!(guest, upstream) else {
            return;
        };
        let (mut guest, mut upstream) = (TokioIo::new(guest), TokioIo::new(upstream));
        let copied = tokio::io::copy_bidirectional_with_sizes(
            &mut guest,
            &mut upstream,
            SPLICE_BUFFER,
            SPLICE_BUFFER,
        );
        if let Ok((up, down)) = copied.await {
            guard.up.fetch_add(up, std::sync::atomic::Ordering::Relaxed);
            guard
                .down
                .fetch_add(down, std::sync::atomic::Ordering::Relaxed);
        }
    });
}
