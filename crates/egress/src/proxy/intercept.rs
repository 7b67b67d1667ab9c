//! Intercepted tunnels: TLS terminated with a certificate from the proxy's CA, each request
//! checked (Host/`:authority` == SNI == CONNECT host, methods and paths), secrets injected,
//! and forwarded over the proxy's own verified TLS connection to the upstream.

use std::convert::Infallible;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::header::HOST;
use hyper::server::conn::{http1, http2};
use hyper::service::service_fn;
use hyper::upgrade::Upgraded;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio_rustls::TlsAcceptor;

use super::forward::{
    authority, splice_upgrade, strip_hop_by_hop, to_guest, upgrade_protocol, Upstream,
    MAX_HEAD_BYTES,
};
use super::io::Prefixed;
use super::server::{entry, fail, refuse, HEADER_TIMEOUT};
use super::shared::{counted, text_response, Body, Conn, LogGuard};
use crate::log::Via;
use crate::policy::host::shorten;
use crate::policy::{Decision, HostName, NormalPath, Target, TargetHost, VettedAddr};

/// How long the guest may take to finish the TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Most concurrent HTTP/2 streams a guest may open on one connection (RFC 9113 §5.1.2).
const MAX_STREAMS: u32 = 128;
/// HTTP/2 flow-control windows offered to the guest, in bytes (RFC 9113 §6.9.2): what a guest
/// can make the proxy buffer per stream and per connection.
const STREAM_WINDOW: u32 = 256 * 1024;
const CONN_WINDOW: u32 = 1024 * 1024;

/// What an intercepted tunnel needs.
pub(crate) struct Parts {
    pub conn: Conn,
    pub target: Target,
    pub name: HostName,
    pub addrs: Vec<VettedAddr>,
}

/// One intercepted guest connection.
struct Intercepted {
    parts: Parts,
    upstream: Upstream,
    guest_h2: bool,
}

/// Terminates the guest's TLS (replaying the ClientHello already read) and serves its
/// requests, HTTP/2 or HTTP/1.1 as ALPN chose.
pub(crate) async fn serve(parts: Parts, guest: TokioIo<Upgraded>, hello: Vec<u8>) {
    let shared = parts.conn.shared.clone();
    let config = match shared.authority.server_config(&parts.name) {
        Ok(config) => config,
        Err(e) => return deny(&parts, format!("cannot make a certificate: {e}")),
    };
    let accept = TlsAcceptor::from(config).accept(Prefixed::new(hello, guest));
    let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, accept).await {
        Ok(Ok(tls)) => tls,
        Ok(Err(e)) => return deny(&parts, format!("TLS handshake with the guest failed: {e}")),
        Err(_) => return deny(&parts, "TLS handshake with the guest timed out".to_owned()),
    };
    let guest_h2 = crate::tls::is_h2(tls.get_ref().1.alpn_protocol());
    let upstream = Upstream::new(
        shared.clone(),
        parts.name.clone(),
        parts.addrs.clone(),
        guest_h2,
    );
    let state = Arc::new(Intercepted {
        parts,
        upstream,
        guest_h2,
    });
    let service = service_fn(move |req| {
        let state = state.clone();
        async move { Ok::<_, Infallible>(state.handle(req).await) }
    });
    let io = TokioIo::new(tls);
    if guest_h2 {
        let _ = http2::Builder::new(shared.tasks.clone())
            .timer(TokioTimer::new())
            .max_header_list_size(MAX_HEAD_BYTES as u32)
            .max_concurrent_streams(MAX_STREAMS)
            .initial_stream_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONN_WINDOW)
            .serve_connection(io, service)
            .await;
    } else {
        let _ = http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(HEADER_TIMEOUT)
            .max_buf_size(MAX_HEAD_BYTES)
            .serve_connection(io, service)
            .with_upgrades()
            .await;
    }
}

fn deny(parts: &Parts, why: String) {
    let line = entry(
        &parts.target,
        Via::Intercepted,
        &Decision::deny(None, why),
        None,
    );
    parts.conn.shared.log.record(&line);
}

impl Intercepted {
    async fn handle(&self, mut req: Request<Incoming>) -> Response<Body> {
        let Parts {
            conn, target, name, ..
        } = &self.parts;
        let shared = &conn.shared;
        let method = req.method().as_str().to_owned();
        let path_and_query = req
            .uri()
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_owned();
        let seen = Some((method.as_str(), path_and_query.as_str()));
        if req.method() == Method::CONNECT {
            let refused = Decision::deny(None, "CONNECT inside an intercepted tunnel");
            return refuse(shared, target, Via::Intercepted, &refused, seen);
        }
        if let Err(why) = self.check_authority(&req) {
            return misdirected(conn, target, &why, seen);
        }
        let path = match NormalPath::parse(&path_and_query) {
            Ok(path) => path,
            Err(e) => {
                return refuse(
                    shared,
                    target,
                    Via::Intercepted,
                    &Decision::deny(None, e.to_string()),
                    seen,
                )
            }
        };
        let decision = shared.policy.check_request(target, &method, &path);
        if !decision.is_allowed() {
            return refuse(shared, target, Via::Intercepted, &decision, seen);
        }
        let upgrade = upgrade_protocol(&req);
        strip_hop_by_hop(req.headers_mut(), upgrade.clone());
        let injected =
            match shared
                .injector
                .inject(name, target.port, &path_and_query, req.headers_mut())
            {
                Ok(names) => names,
                Err(misplaced) => {
                    let why = format!(
                        "the placeholder of secret {} was sent {}",
                        misplaced.name, misplaced.why
                    );
                    return refuse(
                        shared,
                        target,
                        Via::Intercepted,
                        &Decision::deny(None, why),
                        seen,
                    );
                }
            };
        let mut line = entry(target, Via::Intercepted, &decision, seen);
        line.secrets = injected;
        self.forward(req, line, upgrade.is_some()).await
    }

    /// Sends an admitted request upstream and returns the response for the guest.
    async fn forward(
        &self,
        mut req: Request<Incoming>,
        mut line: crate::log::LogEntry,
        upgrade: bool,
    ) -> Response<Body> {
        let Parts {
            conn, target, name, ..
        } = &self.parts;
        let shared = &conn.shared;
        let guest_upgrade = upgrade.then(|| hyper::upgrade::on(&mut req));
        let seen_method = line.method.clone().unwrap_or_default();
        let seen_path = line.path.clone().unwrap_or_default();
        let up = Arc::new(AtomicU64::new(0));
        let req = req.map(|body| counted(body, up.clone(), ()));
        let sent = self
            .upstream
            .send(req, &authority(name.as_str(), target.port, 443), upgrade)
            .await;
        let mut response = match sent {
            Ok(response) => response,
            Err(e) => {
                let seen = Some((seen_method.as_str(), seen_path.as_str()));
                return fail(
                    shared,
                    target,
                    Via::Intercepted,
                    e.status(),
                    &e.to_string(),
                    seen,
                );
            }
        };
        line.status = Some(response.status().as_u16());
        let mut guard = LogGuard::new(shared.clone(), line);
        guard.up = up;
        if let (Some(guest), StatusCode::SWITCHING_PROTOCOLS) = (guest_upgrade, response.status()) {
            splice_upgrade(conn, guest, &mut response, guard.take());
        }
        to_guest(shared, response, guard, self.guest_h2)
    }

    /// Host and `:authority` (RFC 9110 §7.2) must name the CONNECT host and port, which the SNI
    /// already matched.
    fn check_authority<B>(&self, req: &Request<B>) -> Result<(), String> {
        let Parts { target, name, .. } = &self.parts;
        let from_uri = req.uri().authority().map(|a| a.as_str().to_owned());
        let from_host = req
            .headers()
            .get(HOST)
            .map(|h| String::from_utf8_lossy(h.as_bytes()).into_owned());
        if from_uri.is_none() && from_host.is_none() {
            return Err("the request has no Host".to_owned());
        }
        for given in from_uri.iter().chain(from_host.iter()) {
            let parsed = Target::parse(given, Some(443));
            let same = parsed
                .is_ok_and(|t| t.host == TargetHost::Name(name.clone()) && t.port == target.port);
            if !same {
                return Err(format!(
                    "Host {:?} is not the host of this TLS connection ({name}:{}, its SNI and CONNECT)",
                    shorten(given),
                    target.port
                ));
            }
        }
        Ok(())
    }
}

/// `421 Misdirected Request` (RFC 9110 §15.5.20), logged.
fn misdirected(
    conn: &Conn,
    target: &Target,
    why: &str,
    seen: super::server::Seen<'_>,
) -> Response<Body> {
    let mut line = entry(target, Via::Intercepted, &Decision::deny(None, why), seen);
    line.status = Some(StatusCode::MISDIRECTED_REQUEST.as_u16());
    conn.shared.log.record(&line);
    text_response(
        StatusCode::MISDIRECTED_REQUEST,
        format!("bulkhead: egress to {target} refused: {why}\n"),
    )
}
