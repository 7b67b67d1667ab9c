//! Plain-HTTP absolute-form requests (`GET http://host/path`, RFC 9112 §3.2.2): checked like
//! intercepted ones, never given secrets (a placeholder refuses the request), forwarded over a
//! fresh connection to a vetted address.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};

use super::forward::{
    authority, connect_tcp, http1_client, splice_upgrade, strip_hop_by_hop, to_guest, to_upstream,
    upgrade_protocol,
};
use super::server::{admit, entry, fail, refuse, Seen};
use super::shared::{counted, failed, Body, Conn, LogGuard};
use crate::log::Via;
use crate::policy::{Decision, NormalPath, Target};

/// Handles a non-CONNECT request on the guest-facing server.
pub(crate) async fn handle(req: Request<Incoming>, conn: Conn) -> Response<Body> {
    let uri = req.uri().clone();
    match uri.scheme_str() {
        Some("http") => {}
        Some(_) => {
            return failed(
                StatusCode::BAD_REQUEST,
                "only http:// URLs are sent in absolute form; use CONNECT for https",
            )
        }
        None => {
            return failed(
                StatusCode::BAD_REQUEST,
                "this is a proxy: send absolute-form requests (RFC 9112 §3.2.2) or CONNECT",
            )
        }
    }
    let authority_text = uri.authority().map_or("", |a| a.as_str());
    let target = match Target::parse(authority_text, Some(80)) {
        Ok(target) => target,
        Err(e) => return failed(StatusCode::BAD_REQUEST, &format!("bad target: {e}")),
    };
    let method = req.method().as_str().to_owned();
    let path_and_query = uri.path_and_query().map_or("/", |p| p.as_str()).to_owned();
    let seen = Some((method.as_str(), path_and_query.as_str()));
    let decision = match NormalPath::parse(&path_and_query) {
        Ok(path) => conn.shared.policy.check_request(&target, &method, &path),
        Err(e) => Decision::deny(None, e.to_string()),
    };
    let addrs = match admit(&conn.shared, &target, Via::Http, &decision, seen).await {
        Ok(addrs) => addrs,
        Err(refusal) => return refusal,
    };
    if let Some(misplaced) = conn
        .shared
        .injector
        .find_any(&uri.to_string(), req.headers())
    {
        let why = format!(
            "the placeholder of secret {} was sent {}",
            misplaced.name, misplaced.why
        );
        return refuse(
            &conn.shared,
            &target,
            Via::Http,
            &Decision::deny(None, why),
            seen,
        );
    }
    let forward = Forward {
        conn: &conn,
        target: &target,
        seen,
    };
    forward.send(req, &decision, &addrs).await
}

/// An admitted plain-HTTP request on its way upstream.
struct Forward<'a> {
    conn: &'a Conn,
    target: &'a Target,
    seen: Seen<'a>,
}

impl Forward<'_> {
    async fn send(
        &self,
        mut req: Request<Incoming>,
        decision: &Decision,
        addrs: &[crate::policy::VettedAddr],
    ) -> Response<Body> {
        let shared = &self.conn.shared;
        let upgrade = upgrade_protocol(&req);
        let guest_upgrade = upgrade.is_some().then(|| hyper::upgrade::on(&mut req));
        strip_hop_by_hop(req.headers_mut(), upgrade);
        let up = Arc::new(AtomicU64::new(0));
        let mut req = req.map(|body| counted(body, up.clone(), ()));
        let host = self.target.host.to_string();
        if let Err(e) = to_upstream(
            &mut req,
            "http",
            &authority(&host, self.target.port, 80),
            false,
        ) {
            return self.fail(StatusCode::BAD_REQUEST, &e.to_string());
        }
        let stream = match connect_tcp(shared, addrs).await {
            Ok(stream) => stream,
            Err(e) => return self.fail(e.status(), &e.to_string()),
        };
        let sent = match http1_client(shared, stream).await {
            Ok(mut sender) => sender.send_request(req).await.map_err(Into::into),
            Err(e) => Err(e),
        };
        let mut response = match sent {
            Ok(response) => response,
            Err(e) => return self.fail(e.status(), &e.to_string()),
        };
        let mut line = entry(self.target, Via::Http, decision, self.seen);
        line.status = Some(response.status().as_u16());
        let mut guard = LogGuard::new(shared.clone(), line);
        guard.up = up;
        if let (Some(guest), StatusCode::SWITCHING_PROTOCOLS) = (guest_upgrade, response.status()) {
            splice_upgrade(self.conn, guest, &mut response, guard.take());
        }
        to_guest(shared, response, guard, false)
    }

    fn fail(&self, status: StatusCode, why: &str) -> Response<Body> {
        fail(
            &self.conn.shared,
            self.target,
            Via::Http,
            status,
            why,
            self.seen,
        )
    }
}
