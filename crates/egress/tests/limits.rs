//! Limits and lifecycle: parallel requests, the connection limit, the idle timeout, shutdown
//! mid-transfer, bad configurations, TCP listening, the guest environment.

mod support;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bulkhead_egress::policy::{NetworkMode, NetworkSpec, SecretSpec, SecretValues};
use bulkhead_egress::secrets::SecretValue;
use bulkhead_egress::{EgressProxy, Error, Listen, ProxyConfig};
use hyper::{Method, StatusCode};
use support::*;
use tokio::io::AsyncReadExt;

fn allow_test_server(server: &TestServer) -> NetworkSpec {
    NetworkSpec {
        mode: NetworkMode::Allowlist,
        allow: vec![format!("api.test:{}", server.tls_port)],
        allow_cidr: vec!["127.0.0.1/32".into()],
        ..NetworkSpec::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_parallel_requests_through_one_proxy_all_succeed() {
    let ca = TestCa::new();
    let server = TestServer::start(&ca).await;
    let proxy = Arc::new(TestProxy::start(
        &allow_test_server(&server),
        &ca,
        ProxyOptions::default(),
    ));
    let roots = ca.roots();

    let mut tasks = Vec::new();
    for i in 0..100 {
        let (proxy, roots, port) = (proxy.clone(), roots.clone(), server.tls_port);
        tasks.push(tokio::spawn(async move {
            https_get(&proxy, "api.test", port, &format!("/n/{i}"), &[], roots)
                .await
                .status
        }));
    }
    let mut statuses = Vec::new();
    for task in tasks {
        statuses.push(task.await.unwrap());
    }

    assert!(
        statuses.iter().all(|s| *s == StatusCode::OK),
        "{statuses:?}"
    );
    assert_eq!(server.state.seen().len(), 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_mid_transfer_leaves_no_task_socket_or_connection() {
    let ca = TestCa::new();
    let server = TestServer::start(&ca).await;
    let mut proxy = TestProxy::start(&allow_test_server(&server), &ca, ProxyOptions::default());
    let monitor = proxy.proxy().task_monitor();
    let host = format!("api.test:{}", server.tls_port);
    let tunnel = connect_tunnel(&proxy, &host).await.unwrap();
    let stream = tls(tunnel, "api.test", ca.roots(), &[b"http/1.1"])
        .await
        .unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    let client_conn = tokio::spawn(conn);
    let response = sender
        .send_request(request(Method::GET, "/slow", &[("host", &host)]))
        .await
        .unwrap();
    let mut body = response.into_body();
    let first = http_body_util::BodyExt::frame(&mut body)
        .await
        .unwrap()
        .unwrap();
    let live_before = monitor.live();

    let running = proxy.proxy.take().unwrap();
    tokio::task::spawn_blocking(move || running.shutdown())
        .await
        .unwrap();
    let rest = http_body_util::BodyExt::frame(&mut body).await;

    assert_eq!(first.data_ref().unwrap().as_ref(), b"first chunk\n");
    assert!(live_before > 0);
    assert_eq!(monitor.live(), 0);
    assert!(!proxy.socket.exists(), "the socket file is removed");
    assert!(
        !matches!(rest, Some(Ok(_))),
        "the transfer is cut: {rest:?}"
    );
    assert!(client_conn.await.is_ok());
    eventually("the upstream connection to close", || {
        server.state.open_connections.load(Ordering::SeqCst) == 0
    })
    .await;
    assert!(tokio::net::UnixStream::connect(&proxy.socket)
        .await
        .is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_limit_wait_until_one_closes() {
    let ca = TestCa::new();
    let server = TestServer::start(&ca).await;
    let options = ProxyOptions {
        max_connections: 1,
        ..ProxyOptions::default()
    };
    let proxy = TestProxy::start(&allow_test_server(&server), &ca, options);
    let host = format!("api.test:{}", server.tls_port);

    let first = connect_tunnel(&proxy, &host).await.unwrap();
    let mut waiting = tokio::spawn({
        let url = format!("http://api.test:{}/", server.http_port);
        let stream = proxy.connect().await;
        async move { http1(stream, request(Method::GET, &url, &[])).await.status }
    });
    let still_waiting = tokio::time::timeout(Duration::from_millis(300), &mut waiting).await;
    drop(first);
    let answered = waiting.await.unwrap();

    assert!(
        still_waiting.is_err(),
        "the second connection is not served while the first is open"
    );
    assert_eq!(
        answered,
        StatusCode::FORBIDDEN,
        "served (and refused: no rule for the http port) once the first closed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_tunnel_is_closed_after_the_idle_timeout() {
    let ca = TestCa::new();
    let server = TestServer::start(&ca).await;
    let options = ProxyOptions {
        idle_timeout: Duration::from_millis(200),
        ..ProxyOptions::default()
    };
    let proxy = TestProxy::start(&allow_test_server(&server), &ca, options);
    let monitor = proxy.proxy().task_monitor();
    let mut tunnel = connect_tunnel(&proxy, &format!("api.test:{}", server.tls_port))
        .await
        .unwrap();

    let mut buf = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), tunnel.read_to_end(&mut buf)).await;

    assert!(closed.is_ok(), "the proxy closed the idle tunnel");
    eventually("the tunnel's tasks to end", || monitor.live() == 0).await;
}

#[test]
fn bad_configurations_fail_at_start_with_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let in_the_way = dir.path().join("regular-file");
    std::fs::write(&in_the_way, "x").unwrap();
    let log = dir.path().join("egress.jsonl");
    let config = |listen: Listen, log: std::path::PathBuf| {
        let mut config = ProxyConfig::new(bulkhead_egress::policy::Policy::default(), listen, log);
        config.upstream_roots = Some(TestCa::new().roots());
        config.resolver = Some(Arc::new(test_resolver()));
        config
    };

    let bind =
        EgressProxy::start(config(Listen::Unix(in_the_way.clone()), log.clone())).unwrap_err();
    let no_log_dir = EgressProxy::start(config(
        Listen::Unix(dir.path().join("s")),
        dir.path().join("missing/egress.jsonl"),
    ))
    .unwrap_err();
    let mut zero = config(Listen::Unix(dir.path().join("s2")), log);
    zero.max_connections = 0;
    let zero = EgressProxy::start(zero).unwrap_err();

    assert!(matches!(bind, Error::Bind { .. }), "{bind}");
    assert!(bind.to_string().contains("not a socket"), "{bind}");
    assert!(
        std::fs::read_to_string(&in_the_way).unwrap() == "x",
        "the file in the way is kept"
    );
    assert!(
        no_log_dir.to_string().contains("egress log"),
        "{no_log_dir}"
    );
    assert!(
        !dir.path().join("s").exists(),
        "nothing listens after a failed start"
    );
    assert!(zero.to_string().contains("above zero"), "{zero}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_also_listens_on_tcp_and_replaces_a_stale_socket_file() {
    let ca = TestCa::new();
    let server = TestServer::start(&ca).await;
    let dir = tempfile::tempdir().unwrap();
    let stale = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    let policy = allow_test_server(&server)
        .compile(&SecretValues::new())
        .unwrap();
    let mut tcp_config = ProxyConfig::new(
        policy.clone(),
        Listen::Tcp(loopback(0)),
        dir.path().join("a.jsonl"),
    );
    tcp_config.resolver = Some(Arc::new(test_resolver()));
    tcp_config.upstream_roots = Some(ca.roots());
    let mut unix_config = ProxyConfig::new(
        policy,
        Listen::Unix(stale.clone()),
        dir.path().join("b.jsonl"),
    );
    unix_config.resolver = Some(Arc::new(test_resolver()));
    unix_config.upstream_roots = Some(ca.roots());

    let tcp_proxy = EgressProxy::start(tcp_config).unwrap();
    let unix_proxy = EgressProxy::start(unix_config).unwrap();
    let Listen::Tcp(addr) = tcp_proxy.listen_addr().clone() else {
        panic!("not TCP")
    };
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let url = format!("http://evil.test:{}/", server.http_port);
    let got = http1(stream, request(Method::GET, &url, &[])).await;
    let unix_stream = tokio::net::UnixStream::connect(&stale).await;

    assert_ne!(addr.port(), 0);
    assert_eq!(got.status, StatusCode::FORBIDDEN);
    assert!(
        unix_stream.is_ok(),
        "the stale socket file was replaced by a listening one"
    );
    drop(unix_proxy);
    assert!(!stale.exists());
}

#[test]
fn the_guest_environment_points_at_the_proxy_the_ca_and_holds_placeholders() {
    let dir = tempfile::tempdir().unwrap();
    let spec = NetworkSpec {
        mode: NetworkMode::Allowlist,
        allow: vec!["api.test".into()],
        secrets: vec![SecretSpec {
            name: "TOKEN".into(),
            hosts: vec!["api.test".into()],
        }],
        ..NetworkSpec::default()
    };
    let mut values = SecretValues::new();
    values.insert("TOKEN".into(), SecretValue::new("real-value").unwrap());
    let mut config = ProxyConfig::new(
        spec.compile(&values).unwrap(),
        Listen::Unix(dir.path().join("s")),
        dir.path().join("l"),
    );
    config.upstream_roots = Some(TestCa::new().roots());
    config.resolver = Some(Arc::new(test_resolver()));

    let proxy = EgressProxy::start(config).unwrap();
    let env: std::collections::HashMap<String, String> = proxy.guest_env().into_iter().collect();

    assert_eq!(env["HTTPS_PROXY"], "http://127.0.0.1:3128");
    assert_eq!(env["http_proxy"], "http://127.0.0.1:3128");
    assert_eq!(env["NO_PROXY"], "localhost,127.0.0.1");
    assert_eq!(env["NODE_USE_ENV_PROXY"], "1");
    assert_eq!(env["SSL_CERT_FILE"], bulkhead_egress::GUEST_CA_BUNDLE_PATH);
    assert_eq!(
        env["NODE_EXTRA_CA_CERTS"],
        bulkhead_egress::GUEST_CA_CERT_PATH
    );
    assert!(env["TOKEN"].starts_with("bulkhead-placeholder-TOKEN-"));
    assert!(!env.values().any(|v| v.contains("real-value")));
    assert!(proxy
        .ca_cert_pem()
        .starts_with("-----BEGIN CERTIFICATE-----"));
}
