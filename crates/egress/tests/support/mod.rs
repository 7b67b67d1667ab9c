//! Test kit shared by the integration tests and the benchmark: a test CA, an HTTPS/HTTP test
//! server with a few routes, a raw TCP sink, a proxy started on a temporary Unix socket with an
//! injected resolver and trust roots, and clients that speak to the proxy as a guest would.

#![allow(dead_code, missing_docs)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bulkhead_egress::policy::{NetworkSpec, SecretValues};
use bulkhead_egress::resolve::StaticResolver;
pub use bulkhead_egress::testing::*;
use bulkhead_egress::{EgressProxy, Listen, ProxyConfig};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper::header::{HeaderMap, HOST};
use hyper::{Method, Request, Response, StatusCode, Version};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::ServerName;
use rustls::{ClientConfig, RootCertStore};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
use tokio::net::{TcpListener, UnixStream};
use tokio_rustls::TlsConnector;

/// A raw TCP server that records the bytes it receives.
pub struct TcpSink {
    pub port: u16,
    pub received: Arc<Mutex<Vec<u8>>>,
    pub accepted: Arc<AtomicUsize>,
}

impl TcpSink {
    pub async fn start() -> TcpSink {
        let listener = TcpListener::bind((LOCALHOST, 0)).await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let received = Arc::new(Mutex::new(Vec::new()));
        let accepted = Arc::new(AtomicUsize::new(0));
        let (r, a) = (received.clone(), accepted.clone());
        tokio::spawn(async move {
            loop {
                let (mut tcp, _) = listener.accept().await.unwrap();
                a.fetch_add(1, Ordering::SeqCst);
                let r = r.clone();
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = tcp.read(&mut buf).await {
                        if n == 0 {
                            break;
                        }
                        r.lock().unwrap().extend_from_slice(&buf[..n]);
                    }
                });
            }
        });
        TcpSink {
            port,
            received,
            accepted,
        }
    }
}

/// A proxy on a temporary Unix socket, with its log beside it.
pub struct TestProxy {
    pub proxy: Option<EgressProxy>,
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub log: PathBuf,
}

/// The resolver of the tests: api.test, other.test and evil.test are the loopback test server.
pub fn test_resolver() -> StaticResolver {
    StaticResolver::new()
        .with("api.test", &[LOCALHOST])
        .with("other.test", &[LOCALHOST])
        .with("evil.test", &[LOCALHOST])
}

pub struct ProxyOptions {
    pub resolver: StaticResolver,
    pub values: SecretValues,
    pub max_connections: usize,
    pub idle_timeout: Duration,
    /// Upstream trust roots; `None`: the test CA's.
    pub upstream_roots: Option<RootCertStore>,
}

impl Default for ProxyOptions {
    fn default() -> Self {
        ProxyOptions {
            resolver: test_resolver(),
            values: SecretValues::new(),
            max_connections: bulkhead_egress::proxy::DEFAULT_MAX_CONNECTIONS,
            idle_timeout: bulkhead_egress::proxy::DEFAULT_IDLE_TIMEOUT,
            upstream_roots: None,
        }
    }
}

impl TestProxy {
    pub fn start(spec: &NetworkSpec, ca: &TestCa, options: ProxyOptions) -> TestProxy {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("vm.sock_1026");
        let log = dir.path().join("egress.jsonl");
        let policy = spec.compile(&options.values).unwrap();
        let mut config = ProxyConfig::new(policy, Listen::Unix(socket.clone()), log.clone());
        config.resolver = Some(Arc::new(options.resolver));
        config.upstream_roots = Some(options.upstream_roots.unwrap_or_else(|| ca.roots()));
        config.max_connections = options.max_connections;
        config.idle_timeout = options.idle_timeout;
        let proxy = EgressProxy::start(config).unwrap();
        TestProxy {
            proxy: Some(proxy),
            dir,
            socket,
            log,
        }
    }

    pub fn proxy(&self) -> &EgressProxy {
        self.proxy.as_ref().unwrap()
    }

    /// Shuts the proxy down (every log line written) and reads the log.
    pub fn stop_and_read_log(&mut self) -> Vec<bulkhead_egress::LogEntry> {
        if let Some(proxy) = self.proxy.take() {
            proxy.shutdown();
        }
        bulkhead_egress::read_log(&self.log).unwrap()
    }

    /// The proxy CA as trust roots (what the guest trusts for intercepted hosts).
    pub fn ca_roots(&self) -> RootCertStore {
        bulkhead_egress::tls::roots_from_pem(self.proxy().ca_cert_pem()).unwrap()
    }

    pub fn placeholder(&self, name: &str) -> String {
        let found = self.proxy().placeholders().iter().find(|(n, _)| n == name);
        found.unwrap().1.clone()
    }

    pub async fn connect(&self) -> UnixStream {
        UnixStream::connect(&self.socket).await.unwrap()
    }
}

/// A response as the client got it.
#[derive(Debug)]
pub struct Got {
    pub status: StatusCode,
    pub version: Version,
    pub headers: HeaderMap,
    pub body: String,
}

async fn collect(response: Response<Incoming>) -> Got {
    let status = response.status();
    let version = response.version();
    let headers = response.headers().clone();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    Got {
        status,
        version,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

/// Sends `CONNECT authority` on a fresh proxy connection: the tunnel, or the refusal.
pub async fn connect_tunnel(
    proxy: &TestProxy,
    authority: &str,
) -> Result<TokioIo<hyper::upgrade::Upgraded>, Got> {
    let stream = proxy.connect().await;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn.with_upgrades());
    let request = Request::builder()
        .method(Method::CONNECT)
        .uri(authority)
        .header(HOST, authority)
        .body(Empty::<Bytes>::new())
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    if response.status() != StatusCode::OK {
        return Err(collect(response).await);
    }
    Ok(TokioIo::new(hyper::upgrade::on(response).await.unwrap()))
}

/// TLS over `io` to `server_name` trusting `roots`, offering `alpn`.
pub async fn tls<S>(
    io: S,
    server_name: &str,
    roots: RootCertStore,
    alpn: &[&[u8]],
) -> std::io::Result<tokio_rustls::client::TlsStream<S>>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut config =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|a| a.to_vec()).collect();
    let name = ServerName::try_from(server_name.to_owned()).unwrap();
    TlsConnector::from(Arc::new(config)).connect(name, io).await
}

/// A request with `headers` (name, value).
pub fn request(method: Method, uri: &str, headers: &[(&str, &str)]) -> Request<Empty<Bytes>> {
    let mut builder = Request::builder().method(method).uri(uri);
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    builder.body(Empty::new()).unwrap()
}

/// One HTTP/1.1 request over `io`.
pub async fn http1<S>(io: S, req: Request<Empty<Bytes>>) -> Got
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
        .await
        .unwrap();
    tokio::spawn(conn);
    collect(sender.send_request(req).await.unwrap()).await
}

/// One HTTP/2 request over `io`.
pub async fn http2<S>(io: S, req: Request<Empty<Bytes>>) -> Got
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(io))
            .await
            .unwrap();
    tokio::spawn(conn);
    collect(sender.send_request(req).await.unwrap()).await
}

/// `GET https://host:port/path` through a tunnel, TLS trusting `roots`, HTTP/1.1.
pub async fn https_get(
    proxy: &TestProxy,
    host: &str,
    port: u16,
    path: &str,
    headers: &[(&str, &str)],
    roots: RootCertStore,
) -> Got {
    let authority = format!("{host}:{port}");
    let tunnel = connect_tunnel(proxy, &authority)
        .await
        .expect("CONNECT refused");
    let stream = tls(tunnel, host, roots, &[b"http/1.1"]).await.unwrap();
    let mut all = vec![("host", authority.as_str())];
    all.extend_from_slice(headers);
    http1(stream, request(Method::GET, path, &all)).await
}

/// An absolute-form plain-HTTP request through the proxy.
pub async fn plain(proxy: &TestProxy, url: &str, headers: &[(&str, &str)]) -> Got {
    let stream = proxy.connect().await;
    http1(stream, request(Method::GET, url, headers)).await
}

/// Waits (bounded) until `check` holds; panics with `what` if it never does.
pub async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    for _ in 0..500 {
        if check() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for: {what}");
}

/// The server's address as an `allow_cidr`-friendly loopback.
pub fn loopback(port: u16) -> SocketAddr {
    SocketAddr::new(LOCALHOST, port)
}
