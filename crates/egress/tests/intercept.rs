//! Intercepted TLS: secrets, redirects, Host checks, method/path rules, HTTP/2, WebSocket.

mod support;

use bulkhead_egress::log::Via;
use bulkhead_egress::policy::{
    NetworkMode, NetworkSpec, RuleSpec, SecretSpec, SecretValues, Verdict,
};
use bulkhead_egress::secrets::SecretValue;
use hyper::{Method, StatusCode, Version};
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const VALUE: &str = "real-secret-value-42";

/// api.test holds the secret TOKEN; other.test is allowed and intercepted (it has a method rule)
/// but is not the secret's host; both on the test server's ports.
fn secret_setup(server: &TestServer, ca: &TestCa) -> TestProxy {
    let (tls, http) = (server.tls_port, server.http_port);
    let spec = NetworkSpec {
        mode: NetworkMode::Allowlist,
        allow: vec![
            format!("api.test:{tls}"),
            format!("api.test:{http}"),
            format!("other.test:{http}"),
        ],
        allow_cidr: vec!["127.0.0.1/32".into()],
        rules: vec![RuleSpec {
            host: format!("other.test:{tls}"),
            methods: vec!["GET".into(), "HEAD".into()],
            ..RuleSpec::default()
        }],
        secrets: vec![SecretSpec {
            name: "TOKEN".into(),
            hosts: vec![format!("api.test:{tls}"), format!("api.test:{http}")],
        }],
        ..NetworkSpec::default()
    };
    let mut values = SecretValues::new();
    values.insert("TOKEN".into(), SecretValue::new(VALUE).unwrap());
    let options = ProxyOptions {
        values,
        ..ProxyOptions::default()
    };
    TestProxy::start(&spec, ca, options)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_secret_reaches_its_host_and_only_the_placeholder_comes_back() {
    let ca = TestCa::new();
    let server = TestServer::start(&ca).await;
    let mut proxy = secret_setup(&server, &ca);
    let bearer = format!("Bearer {}", proxy.placeholder("TOKEN"));

    let got = https_get(
        &proxy,
        "api.test",
        server.tls_port,
        "/echo-auth",
        &[("authorization", &bearer)],
        proxy.ca_roots(),
    )
    .await;
    let log = proxy.stop_and_read_log();

    assert_eq!(got.status, StatusCode::OK);
    assert_eq!(
        server.state.seen()[0].headers["authorization"],
        format!("Bearer {VALUE}").as_str()
    );
    assert_eq!(got.headers["x-echo"], bearer.as_str());
    let line = log
        .iter()
        .find(|e| e.path.as_deref() == Some("/echo-auth"))
        .unwrap();
    assert_eq!(
        (line.via, line.decision, line.status),
        (Via::Intercepted, Verdict::Allow, Some(200))
    );
    assert_eq!(line.secrets, vec!["TOKEN".to_owned()]);
    assert_eq!(line.bytes_down, "echoed".len() as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_placeholder_sent_to_another_allowed_host_is_blocked_and_logged() {
    let ca = TestCa::new();
    let server = TestServer::start(&ca).await;
    let mut proxy = secret_setup(&server, &ca);
    let bearer = format!("Bearer {}", proxy.placeholder("TOKEN"));

    let got = https_get(
        &proxy,
        "other.test",
        server.tls_port,
        "/",
        &[("authorization", &bearer)],
        proxy.ca_roots(),
    )
    .await;
    let log = proxy.stop_and_read_log();

    assert_eq!(got.status, StatusCode::FORBIDDEN);
    assert!(
        got.body.contains("placeholder of secret TOKEN"),
        "{}",
        got.body
    );
    assert!(server.state.seen().is_empty());
    let line = log.iter().find(|e| e.host == "other.test").unwrap();
    assert_eq!((line.decision, line.status), (Verdict::Deny, Some(403)));
    assert!(line.reason.contains("not for"), "{}", line.reason);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirect_is_returned_unfollowed_and_the_next_request_carries_no_secret() {
    let ca = TestCa::new();
    let server = TestServer::start(&ca).await;
    let proxy = secret_setup(&server, &ca);
    let bearer = format!("Bearer {}", proxy.placeholder("TOKEN"));

    let redirect = https_get(
        &proxy,
        "api.test",
        server.tls_port,
        "/redirect",
        &[("authorization", &bearer)],
        proxy.ca_roots(),
    )
    .await;
    let location = redirect.headers["location"].to_str().unwrap().to_owned();
    let followed = https_get(
        &proxy,
        "other.test",
        server.tls_port,
        "/landing",
        &[],
        proxy.ca_roots(),
    )
    .await;

    assert_eq!(redirect.status, StatusCode::FOUND);
    assert_eq!(
        location,
        format!("https://other.test:{}/landing", server.tls_port)
    );
    assert_eq!(followed.status, StatusCode::OK);
    let seen = server.state.seen();
    assert_eq!(
        seen.iter().map(|s| s.path.as_str()).collect::<Vec<_>>(),
        ["/redirect", "/landing"]
    );
    assert!(seen[1].headers.get("authorization").is_none());
    assert_eq!(
        server.state.all_header_text().matches(VALUE).count(),
        1,
        "only the request to api.test"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_http_gets_no_injection_and_a_placeholder_over_it_is_refused() {
    let ca = TestCa::new();
    let server = TestServer::start(&ca).await;
    let mut proxy = secret_setup(&server, &ca);
    let bearer = format!("Bearer {}", proxy.placeholder("TOKEN"));
    let url = format!("http://api.test:{}/echo-auth", server.http_port);

    let with_placeholder = plain(&proxy, &url, &[("authorization", &bearer)]).await;
    let without = plain(&proxy, &url, &[]).await;
    let log = proxy.stop_and_read_log();

    assert_eq!(with_placeholder.status, StatusCode::FORBIDDEN);
    assert!(
        with_placeholder.body.contains("over plain HTTP"),
        "{}",
        with_placeholder.body
    );
    assert_eq!(without.status, StatusCode::OK);
    assert_eq!(server.state.seen().len(), 1);
    assert!(!server.state.all_header_text().contains(VALUE));
    assert!(log
        .iter()
        .any(|e| e.via == Via::Http && e.decision == Verdict::Deny));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_header_other_than_the_sni_gets_421() {
    let ca = TestCa::new();
    let server = TestServer::start(&ca).await;
    let proxy = secret_setup(&server, &ca);
    let port = server.tls_port;

    let tunnel = connect_tunnel(&proxy, &format!("api.test:{port}"))
        .await
        .unwrap();
    let stream = tls(tunnel, "api.test", proxy.ca_roots(), &[b"http/1.1"])
        .await
        .unwrap();
    let other_host = format!("other.test:{port}");
    let got = http1(stream, request(Method::GET, "/", &[("host", &other_host)])).await;

    assert_eq!(got.status, StatusCode::MISDIRECTED_REQUEST);
    assert!(
        got.body.contains("is not the host of this TLS connection"),
        "{}",
        got.body
    );
    assert!(server.state.seen().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn method_rules_admit_only_the_methods_they_name() {
    let ca = TestCa::new();
    let server = TestServer::start(&ca).await;
    let proxy = secret_setup(&server, &ca);
    let port = server.tls_port;
    let host = format!("other.test:{port}");

    let tunnel = connect_tunnel(&proxy, &host).await.unwrap();
    let stream = tls(tunnel, "other.test", proxy.ca_roots(), &[b"http/1.1"])
        .await
        .unwrap();
    let posted = http1(stream, request(Method::POST, "/upload", &[("host", &host)])).await;
    let got = https_get(&proxy, "other.test", port, "/", &[], proxy.ca_roots()).await;

    assert_eq!(posted.status, StatusCode::FORBIDDEN);
    assert!(
        posted.body.contains("POST /upload is not allowed"),
        "{}",
        posted.body
    );
    assert_eq!(got.status, StatusCode::OK);
    assert_eq!(server.state.seen().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_works_through_interception_with_the_secret_injected() {
    let ca = TestCa::new();
    let server = TestServer::start(&ca).await;
    let proxy = secret_setup(&server, &ca);
    let port = server.tls_port;
    let bearer = format!("Bearer {}", proxy.placeholder("TOKEN"));
    let uri = format!("https://api.test:{port}/echo-auth");

    let tunnel = connect_tunnel(&proxy, &format!("api.test:{port}"))
        .await
        .unwrap();
    let stream = tls(tunnel, "api.test", proxy.ca_roots(), &[b"h2", b"http/1.1"])
        .await
        .unwrap();
    let negotiated = stream.get_ref().1.alpn_protocol().map(<[u8]>::to_vec);
    let got = http2(
        stream,
        request(Method::GET, &uri, &[("authorization", &bearer)]),
    )
    .await;

    assert_eq!(negotiated.as_deref(), Some(&b"h2"[..]));
    assert_eq!((got.status, got.version), (StatusCode::OK, Version::HTTP_2));
    assert_eq!(got.headers["x-echo"], bearer.as_str());
    let seen = &server.state.seen()[0];
    assert_eq!(seen.version, Version::HTTP_2);
    assert_eq!(
        seen.headers["authorization"],
        format!("Bearer {VALUE}").as_str()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_websocket_upgrade_passes_through_interception() {
    let ca = TestCa::new();
    let server = TestServer::start(&ca).await;
    let proxy = secret_setup(&server, &ca);
    let port = server.tls_port;
    let host = format!("api.test:{port}");

    let tunnel = connect_tunnel(&proxy, &host).await.unwrap();
    let stream = tls(tunnel, "api.test", proxy.ca_roots(), &[b"http/1.1"])
        .await
        .unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn.with_upgrades());
    let headers = [
        ("host", host.as_str()),
        ("connection", "Upgrade"),
        ("upgrade", "websocket"),
    ];
    let response = sender
        .send_request(request(Method::GET, "/ws", &headers))
        .await
        .unwrap();
    let status = response.status();
    let mut upgraded = hyper_util::rt::TokioIo::new(hyper::upgrade::on(response).await.unwrap());
    upgraded.write_all(b"ping").await.unwrap();
    let mut echo = [0u8; 4];
    upgraded.read_exact(&mut echo).await.unwrap();

    assert_eq!(status, StatusCode::SWITCHING_PROTOCOLS);
    assert_eq!(&echo, b"ping");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spliced_host_keeps_the_servers_own_certificate() {
    let ca = TestCa::new();
    let server = TestServer::start(&ca).await;
    let intercepting = secret_setup(&server, &ca);
    let spec = NetworkSpec {
        mode: NetworkMode::Allowlist,
        allow: vec![format!("other.test:{}", server.tls_port)],
        allow_cidr: vec!["127.0.0.1/32".into()],
        ..NetworkSpec::default()
    };
    let spliced = TestProxy::start(&spec, &ca, ProxyOptions::default());

    let trusted_by_test_ca = https_get(
        &spliced,
        "other.test",
        server.tls_port,
        "/",
        &[],
        ca.roots(),
    )
    .await;
    let tunnel = connect_tunnel(&spliced, &format!("other.test:{}", server.tls_port))
        .await
        .unwrap();
    let with_proxy_ca = tls(
        tunnel,
        "other.test",
        intercepting.ca_roots(),
        &[b"http/1.1"],
    )
    .await;

    assert_eq!(trusted_by_test_ca.status, StatusCode::OK);
    assert!(with_proxy_ca.is_err(), "no proxy CA signs spliced hosts");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_certificate_the_proxy_does_not_trust_gets_502() {
    let ca = TestCa::new();
    let server = TestServer::start(&ca).await;
    let port = server.tls_port;
    let spec = NetworkSpec {
        mode: NetworkMode::Allowlist,
        allow_cidr: vec!["127.0.0.1/32".into()],
        rules: vec![RuleSpec {
            host: format!("api.test:{port}"),
            methods: vec!["GET".into()],
            ..RuleSpec::default()
        }],
        ..NetworkSpec::default()
    };
    let options = ProxyOptions {
        upstream_roots: Some(TestCa::new().roots()),
        ..ProxyOptions::default()
    };
    let proxy = TestProxy::start(&spec, &ca, options);

    let got = https_get(&proxy, "api.test", port, "/", &[], proxy.ca_roots()).await;

    assert_eq!(got.status, StatusCode::BAD_GATEWAY);
    assert!(
        got.body.contains("TLS with the upstream failed"),
        "{}",
        got.body
    );
    assert!(server.state.seen().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connect_inside_an_intercepted_tunnel_is_refused() {
    let ca = TestCa::new();
    let server = TestServer::start(&ca).await;
    let proxy = secret_setup(&server, &ca);
    let host = format!("api.test:{}", server.tls_port);

    let tunnel = connect_tunnel(&proxy, &host).await.unwrap();
    let stream = tls(tunnel, "api.test", proxy.ca_roots(), &[b"http/1.1"])
        .await
        .unwrap();
    let got = http1(stream, request(Method::CONNECT, &host, &[("host", &host)])).await;

    assert_eq!(got.status, StatusCode::FORBIDDEN);
    assert!(server.state.seen().is_empty());
}
