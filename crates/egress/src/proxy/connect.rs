//! `CONNECT host:port` (RFC 9110 §9.3.6): admission, then a tunnel that must carry TLS whose
//! SNI (RFC 6066 §3) names the CONNECT host; spliced as it is, or intercepted.

use std::time::Duration;

use hyper::body::Incoming;
use hyper::upgrade::Upgraded;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use super::forward::connect_tcp;
use super::intercept;
use super::io::{Meter, Metered, Side};
use super::server::{admit, entry, fail};
use super::shared::{empty, failed, Body, Conn, LogGuard};
use super::zerocopy;
use crate::log::Via;
use crate::policy::host::shorten as host_text;
use crate::policy::{Decision, HostName, Target, TargetHost, VettedAddr};
use crate::tls::{read_client_hello, HelloInfo};

/// Bytes buffered each way by a splice (fewer system calls than tokio's 8 KiB default).
pub(crate) const SPLICE_BUFFER: usize = 64 * 1024;
/// How long the guest may take to send its ClientHello after the `200`.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// Handles a `CONNECT`: `403` when refused, `502` when the upstream cannot be reached (for
/// tunnels that are spliced), else `200` and the tunnel in a task.
pub(crate) async fn handle(req: Request<Incoming>, conn: Conn) -> Response<Body> {
    let shared = conn.shared.clone();
    let Some(authority) = req.uri().authority().map(|a| a.as_str().to_owned()) else {
        return failed(
            StatusCode::BAD_REQUEST,
            "CONNECT needs host:port (RFC 9110 §9.3.6)",
        );
    };
    let target = match Target::parse(&authority, None) {
        Ok(target) => target,
        Err(e) => return bad_target(&conn, &authority, &e.to_string()),
    };
    let decision = shared.policy.check_target(&target);
    let addrs = match admit(&shared, &target, Via::Tunnel, &decision, None).await {
        Ok(addrs) => addrs,
        Err(refusal) => return refusal,
    };
    let intercept = match &target.host {
        TargetHost::Name(name) => shared.policy.intercepts(name, target.port),
        TargetHost::Ip(_) => false,
    };
    let upstream = match intercept {
        true => None,
        false => match connect_tcp(&shared, &addrs).await {
            Ok(stream) => Some(stream),
            Err(e) => {
                return fail(
                    &shared,
                    &target,
                    Via::Tunnel,
                    e.status(),
                    &e.to_string(),
                    None,
                )
            }
        },
    };
    let tunnel = Tunnel {
        conn: conn.clone(),
        target,
        addrs,
        decision,
    };
    let on_upgrade = hyper::upgrade::on(req);
    conn.spawn(async move {
        if let Ok(upgraded) = on_upgrade.await {
            tunnel.run(TokioIo::new(upgraded), upstream).await;
        }
    });
    Response::new(empty())
}

/// Logs and answers a CONNECT whose target cannot be parsed.
fn bad_target(conn: &Conn, authority: &str, why: &str) -> Response<Body> {
    let decision = Decision::deny(None, why);
    let mut line = crate::log::LogEntry::new(&host_text(authority), 0, Via::Tunnel, &decision);
    line.status = Some(StatusCode::BAD_REQUEST.as_u16());
    conn.shared.log.record(&line);
    failed(
        StatusCode::BAD_REQUEST,
        &format!("bad CONNECT target: {why}"),
    )
}

/// An admitted tunnel, after the `200`.
struct Tunnel {
    conn: Conn,
    target: Target,
    addrs: Vec<VettedAddr>,
    decision: Decision,
}

impl Tunnel {
    async fn run(self, mut guest: TokioIo<Upgraded>, upstream: Option<TcpStream>) {
        let read = tokio::time::timeout(HELLO_TIMEOUT, read_client_hello(&mut guest)).await;
        let (hello, info) = match read {
            Ok(Ok(found)) => found,
            Ok(Err(e)) => return self.deny(format!("the tunnel must carry TLS: {e}")),
            Err(_) => return self.deny("no TLS ClientHello within 10 s".to_owned()),
        };
        if let Err(why) = check_sni(&self.target, &info) {
            return self.deny(why);
        }
        match (upstream, self.target.host.clone()) {
            (Some(upstream), _) => self.splice(guest, hello, upstream).await,
            (None, TargetHost::Name(name)) => {
                let parts = intercept::Parts {
                    conn: self.conn,
                    target: self.target,
                    name,
                    addrs: self.addrs,
                };
                intercept::serve(parts, guest, hello).await;
            }
            (None, TargetHost::Ip(_)) => {}
        }
    }

    /// Logs a refused tunnel; dropping the guest's stream closes it.
    fn deny(&self, why: String) {
        let line = entry(&self.target, Via::Tunnel, &Decision::deny(None, why), None);
        self.conn.shared.log.record(&line);
    }

    /// Replays the ClientHello upstream and moves bytes both ways until either side closes
    /// (or the connection's idle timeout or shutdown drops the task); logs the bytes. The
    /// guest's socket and the upstream's are spliced without a copy through the proxy
    /// ([`zerocopy`]) when hyper hands the guest's socket back.
    async fn splice(self, guest: TokioIo<Upgraded>, hello: Vec<u8>, upstream: TcpStream) {
        let meter = Meter::new();
        let mut guard = LogGuard::new(
            self.conn.shared.clone(),
            entry(&self.target, Via::Tunnel, &self.decision, None),
        );
        guard.meter = Some(meter.clone());
        let mut upstream = Metered::new(upstream, meter.clone(), Side::Upstream);
        if upstream.write_all(&hello).await.is_err() {
            return;
        }
        let taken = match zerocopy::Pipes::new() {
            Ok(pipes) => zerocopy::take_socket(guest.into_inner()).map(|raw| (raw, pipes)),
            Err(_) => Err(guest.into_inner()),
        };
        match taken {
            Ok((Ok(raw), pipes)) => {
                let _ = zerocopy::splice_both(raw, upstream.into_inner(), pipes, meter).await;
            }
            Ok((Err(e), _)) => tracing::warn!("egress proxy: a tunnel's socket was lost: {e}"),
            Err(upgraded) => {
                let _ = tokio::io::copy_bidirectional_with_sizes(
                    &mut TokioIo::new(upgraded),
                    &mut upstream,
                    SPLICE_BUFFER,
                    SPLICE_BUFFER,
                )
                .await;
            }
        }
        drop(guard);
    }
}

/// The SNI must name the CONNECT host (compared after normalisation); a tunnel to an IP
/// address must have no SNI (RFC 6066 §3 forbids address literals in it).
fn check_sni(target: &Target, info: &HelloInfo) -> Result<(), String> {
    match (&target.host, info.sni.as_deref()) {
        (TargetHost::Name(name), Some(sni)) => match HostName::parse(sni) {
            Ok(parsed) if parsed == *name => Ok(()),
            _ => Err(format!(
                "the TLS server name (SNI) {:?} is not the CONNECT host {name}",
                host_text(sni)
            )),
        },
        (TargetHost::Name(name), None) => Err(format!(
            "the TLS ClientHello names no server (SNI); it must name the CONNECT host {name}"
        )),
        (TargetHost::Ip(_), None) => Ok(()),
        (TargetHost::Ip(addr), Some(sni)) => Err(format!(
            "the TLS server name (SNI) {:?} names a host but the CONNECT target is the address {addr}",
            host_text(sni)
        )),
    }
}
