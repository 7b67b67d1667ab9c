//! Allow and deny at the connection level: CONNECT tunnels, plain HTTP, address vetting, SNI.

mod support;

use std::net::IpAddr;

use bulkhead_egress::log::Via;
use bulkhead_egress::policy::{NetworkMode, NetworkSpec, Verdict};
use bulkhead_egress::resolve::StaticResolver;
use hyper::StatusCode;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn allowlist(allow: &[String]) -> NetworkSpec {
    NetworkSpec {
        mode: NetworkMode::Allowlist,
        allow: allow.to_vec(),
        allow_cidr: vec!["127.0.0.1/32".into()],
        ..NetworkSpec::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allowed_host_is_reached_and_another_gets_403_with_both_logged() {
    let ca = TestCa::new();
    let server = TestServer::start(&ca).await;
    let port = server.tls_port;
    let mut proxy = TestProxy::start(
        &allowlist(&[format!("api.test:{port}")]),
        &ca,
        ProxyOptions::default(),
    );

    let allowed = https_get(&proxy, "api.test", port, "/", &[], ca.roots()).await;
    let refused = connect_tunnel(&proxy, "evil.test:443").await.unwrap_err();
    let log = proxy.stop_and_read_log();

    assert_eq!(allowed.status, StatusCode::OK);
    assert_eq!(allowed.body, "hello from the test server");
    assert_eq!(refused.status, StatusCode::FORBIDDEN);
    assert_eq!(
        refused.body,
        "bulkhead: egress to evil.test:443 denied: no allow rule matches\n"
    );
    let ok = log
        .iter()
        .find(|e| e.host == "api.test")
        .expect("a line for api.test");
    assert_eq!(
        (ok.port, ok.via, ok.decision),
        (port, Via::Tunnel, Verdict::Allow)
    );
    assert!(ok.bytes_up > 0 && ok.bytes_down > 0, "{ok:?}");
    let denied = log
        .iter()
        .find(|e| e.host == "evil.test")
        .expect("a line for evil.test");
    assert_eq!((denied.decision, denied.status), (Verdict::Deny, Some(403)));
    assert_eq!(denied.reason, "no allow rule matches");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_http_is_forwarded_for_allowed_hosts_and_refused_for_others() {
    let ca = TestCa::new();
    let server = TestServer::start(&ca).await;
    let port = server.http_port;
    let mut proxy = TestProxy::start(
        &allowlist(&[format!("api.test:{port}")]),
        &ca,
        ProxyOptions::default(),
    );

    let allowed = plain(
        &proxy,
        &format!("http://api.test:{port}/path?q=1"),
        &[("proxy-authorization", "Basic eDp5")],
    )
    .await;
    let refused = plain(&proxy, "http://evil.test/", &[]).await;
    let log = proxy.stop_and_read_log();

    assert_eq!(allowed.status, StatusCode::OK);
    let seen = server.state.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].host, format!("api.test:{port}"));
    assert!(seen[0].headers.get("proxy-authorization").is_none());
    assert_eq!(refused.status, StatusCode::FORBIDDEN);
    assert_eq!(
        refused.body,
        "bulkhead: egress to evil.test:80 denied: no allow rule matches\n"
    );
    let line = log.iter().find(|e| e.host == "api.test").unwrap();
    assert_eq!(
        (line.via, line.method.as_deref(), line.path.as_deref()),
        (Via::Http, Some("GET"), Some("/path"))
    );
    assert_eq!(line.status, Some(200));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_ip_connect_matched_only_by_a_domain_rule_is_refused() {
    let ca = TestCa::new();
    let server = TestServer::start(&ca).await;
    let port = server.tls_port;
    let spec = NetworkSpec {
        allow_cidr: Vec::new(),
        ..allowlist(&[format!("api.test:{port}")])
    };
    let proxy = TestProxy::start(&spec, &ca, ProxyOptions::default());

    let refused = connect_tunnel(&proxy, &format!("127.0.0.1:{port}"))
        .await
        .unwrap_err();

    assert_eq!(refused.status, StatusCode::FORBIDDEN);
    assert!(
        refused.body.contains("allowed only by a CIDR rule"),
        "{}",
        refused.body
    );
    assert!(server.state.seen().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn internal_answers_for_an_allowed_name_are_refused_also_under_allow_all() {
    let ca = TestCa::new();
    let answers: [(&str, IpAddr); 4] = [
        ("loop.test", "127.0.0.1".parse().unwrap()),
        ("private.test", "10.1.2.3".parse().unwrap()),
        ("metadata.test", "169.254.169.254".parse().unwrap()),
        ("mapped.test", "::ffff:169.254.169.254".parse().unwrap()),
    ];
    let resolver = answers
        .iter()
        .fold(StaticResolver::new(), |r, (n, a)| r.with(n, &[*a]));
    let listed = NetworkSpec {
        mode: NetworkMode::Allowlist,
        allow: answers.iter().map(|(n, _)| (*n).to_owned()).collect(),
        ..NetworkSpec::default()
    };
    let all = NetworkSpec {
        mode: NetworkMode::AllowAll,
        ..NetworkSpec::default()
    };

    for spec in [&listed, &all] {
        let options = ProxyOptions {
            resolver: resolver.clone(),
            ..ProxyOptions::default()
        };
        let proxy = TestProxy::start(spec, &ca, options);
        for (name, addr) in &answers {
            let refused = connect_tunnel(&proxy, &format!("{name}:443"))
                .await
                .unwrap_err();
            let plain_refused = plain(&proxy, &format!("http://{name}/"), &[]).await;

            assert_eq!(
                refused.status,
                StatusCode::FORBIDDEN,
                "{name} ({:?})",
                spec.mode
            );
            assert!(refused.body.contains("blocked address"), "{}", refused.body);
            assert!(refused
                .body
                .contains(&bulkhead_egress::policy::canonical(*addr).to_string()));
            assert_eq!(plain_refused.status, StatusCode::FORBIDDEN);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_tcp_to_a_port_without_a_port_rule_is_refused() {
    let ca = TestCa::new();
    let sink = TcpSink::start().await;
    let proxy = TestProxy::start(
        &allowlist(&["api.test".to_owned()]),
        &ca,
        ProxyOptions::default(),
    );

    let refused = connect_tunnel(&proxy, &format!("api.test:{}", sink.port))
        .await
        .unwrap_err();

    assert_eq!(refused.status, StatusCode::FORBIDDEN);
    assert!(
        refused
            .body
            .contains(&format!("no rule for api.test allows port {}", sink.port)),
        "{}",
        refused.body
    );
    assert_eq!(sink.accepted.load(std::sync::atomic::Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_that_does_not_carry_tls_is_closed_before_any_byte_leaves() {
    let ca = TestCa::new();
    let sink = TcpSink::start().await;
    let mut proxy = TestProxy::start(
        &allowlist(&[format!("api.test:{}", sink.port)]),
        &ca,
        ProxyOptions::default(),
    );

    let mut tunnel = connect_tunnel(&proxy, &format!("api.test:{}", sink.port))
        .await
        .unwrap();
    tunnel.write_all(b"SSH-2.0-OpenSSH_9.2\r\n").await.unwrap();
    let mut rest = Vec::new();
    let read = tunnel.read_to_end(&mut rest).await;
    let log = proxy.stop_and_read_log();

    assert!(
        read.is_err() || rest.is_empty(),
        "the proxy closed the tunnel"
    );
    assert!(sink.received.lock().unwrap().is_empty());
    let line = log.iter().find(|e| e.decision == Verdict::Deny).unwrap();
    assert!(line.reason.contains("must carry TLS"), "{}", line.reason);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sni_other_than_the_connect_host_is_refused() {
    let ca = TestCa::new();
    let server = TestServer::start(&ca).await;
    let port = server.tls_port;
    let spec = allowlist(&[format!("api.test:{port}"), format!("other.test:{port}")]);
    let mut proxy = TestProxy::start(&spec, &ca, ProxyOptions::default());

    let tunnel = connect_tunnel(&proxy, &format!("api.test:{port}"))
        .await
        .unwrap();
    let fronted = tls(tunnel, "other.test", ca.roots(), &[b"http/1.1"]).await;
    let log = proxy.stop_and_read_log();

    assert!(fronted.is_err(), "the TLS handshake must fail");
    assert!(server.state.seen().is_empty());
    let line = log.iter().find(|e| e.decision == Verdict::Deny).unwrap();
    assert!(
        line.reason
            .contains("\"other.test\" is not the CONNECT host api.test"),
        "{}",
        line.reason
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connect_to_a_closed_port_fails_with_502() {
    let ca = TestCa::new();
    let closed_port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let proxy = TestProxy::start(
        &allowlist(&[format!("api.test:{closed_port}")]),
        &ca,
        ProxyOptions::default(),
    );

    let failed = connect_tunnel(&proxy, &format!("api.test:{closed_port}"))
        .await
        .unwrap_err();

    assert_eq!(failed.status, StatusCode::BAD_GATEWAY);
    assert!(
        failed.body.starts_with("bulkhead: egress to api.test:"),
        "{}",
        failed.body
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn origin_form_and_malformed_connect_requests_get_400() {
    let ca = TestCa::new();
    let proxy = TestProxy::start(
        &allowlist(&["api.test".to_owned()]),
        &ca,
        ProxyOptions::default(),
    );

    let origin = plain(&proxy, "/not-a-proxy-request", &[("host", "api.test")]).await;
    let https_absolute = plain(&proxy, "https://api.test/", &[]).await;
    let bad_host = connect_tunnel(&proxy, "exa_mple..test:443")
        .await
        .unwrap_err();

    assert_eq!(origin.status, StatusCode::BAD_REQUEST);
    assert!(origin.body.contains("absolute-form"));
    assert_eq!(https_absolute.status, StatusCode::BAD_REQUEST);
    assert_eq!(bad_host.status, StatusCode::BAD_REQUEST);
    assert!(bad_host.body.contains("empty label"), "{}", bad_host.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_half_closes_after_its_request_still_gets_the_answer_and_a_log_line() {
    // Arrange: requests written whole and then the write side shut (`printf ... | nc`).
    let ca = TestCa::new();
    let server = TestServer::start(&ca).await;
    let port = server.http_port;
    let mut proxy = TestProxy::start(
        &allowlist(&[format!("api.test:{port}")]),
        &ca,
        ProxyOptions::default(),
    );
    let half_closed = |request: String| {
        let proxy = &proxy;
        async move {
            let mut stream = proxy.connect().await;
            stream.write_all(request.as_bytes()).await.unwrap();
            stream.shutdown().await.unwrap();
            let mut answer = String::new();
            stream.read_to_string(&mut answer).await.unwrap();
            answer
        }
    };

    // Act
    let allowed = half_closed(format!(
        "GET http://api.test:{port}/x HTTP/1.1\r\nHost: api.test:{port}\r\n\r\n"
    ))
    .await;
    let denied =
        half_closed("GET http://evil.test/ HTTP/1.1\r\nHost: evil.test\r\n\r\n".into()).await;
    let log = proxy.stop_and_read_log();

    // Assert
    assert!(allowed.starts_with("HTTP/1.1 200"), "{allowed}");
    assert!(denied.starts_with("HTTP/1.1 403"), "{denied}");
    assert!(denied.contains("no allow rule matches"), "{denied}");
    assert!(log.iter().any(|e| e.host == "api.test"), "{log:?}");
    assert!(log.iter().any(|e| e.host == "evil.test"), "{log:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_download_through_a_spliced_tunnel_arrives_whole_and_is_counted() {
    // Arrange: 8 MiB of a known pattern behind an allowed host (no rule that intercepts it).
    let ca = TestCa::new();
    let server = TestServer::start(&ca).await;
    let big: Vec<u8> = (0..8usize << 20).map(|i| b'a' + (i % 26) as u8).collect();
    server.set_big(bytes::Bytes::from(big.clone()));
    let port = server.tls_port;
    let mut proxy = TestProxy::start(
        &allowlist(&[format!("api.test:{port}")]),
        &ca,
        ProxyOptions::default(),
    );

    // Act
    let got = https_get(&proxy, "api.test", port, "/big", &[], ca.roots()).await;
    let log = proxy.stop_and_read_log();

    // Assert
    assert_eq!(got.status, StatusCode::OK);
    assert!(
        got.body.as_bytes() == big,
        "{} bytes arrived",
        got.body.len()
    );
    let line = log.iter().find(|e| e.host == "api.test").expect("a line");
    assert_eq!(line.via, Via::Tunnel);
    assert!(line.bytes_down >= big.len() as u64, "{line:?}");
    assert!(line.bytes_up > 0, "{line:?}");
}
