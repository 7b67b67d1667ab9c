//! Test kit shared by the integration tests and the benchmark: a test CA, an HTTPS/HTTP test
//! server with a few routes, a raw TCP sink, a proxy started on a temporary Unix socket with an
//! injected resolver and trust roots, and clients that speak to the proxy as a guest would.

#![allow(dead_code, missing_docs)]

use std::convert::Infallible;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bulkhead_egress::policy::{NetworkSpec, SecretValues};
use bulkhead_egress::resolve::StaticResolver;
use bulkhead_egress::{EgressProxy, Listen, ProxyConfig};
use bytes::Bytes;
use futures_util::stream::{self, StreamExt};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::header::{HeaderMap, HeaderValue, CONNECTION, HOST, LOCATION, UPGRADE};
use hyper::{Method, Request, Response, StatusCode, Version};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, UnixStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};

pub type Body = BoxBody<Bytes, Infallible>;
pub const LOCALHOST: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// A CA of the tests' own that signs the test server's certificate.
pub struct TestCa {
    cert: rcgen::Certificate,
    key: KeyPair,
}

impl TestCa {
    pub fn new() -> TestCa {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let cert = params.self_signed(&key).unwrap();
        TestCa { cert, key }
    }

    pub fn roots(&self) -> RootCertStore {
        let mut roots = RootCertStore::empty();
        roots.add(self.cert.der().clone()).unwrap();
        roots
    }

    /// A server configuration for `names`, offering HTTP/2 and HTTP/1.1.
    pub fn server_config(&self, names: &[&str]) -> Arc<ServerConfig> {
        let leaf_key = KeyPair::generate().unwrap();
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let leaf = CertificateParams::new(names)
            .unwrap()
            .signed_by(&leaf_key, &self.cert, &self.key)
            .unwrap();
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf_key.serialize_der()));
        let mut config =
            ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_no_client_auth()
                .with_single_cert(vec![leaf.der().clone()], key)
                .unwrap();
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Arc::new(config)
    }
}

/// One request as the test server saw it.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: Method,
    pub path: String,
    pub version: Version,
    pub host: String,
    pub headers: HeaderMap,
}

#[derive(Default)]
pub struct ServerState {
    pub seen: Mutex<Vec<Seen>>,
    pub open_connections: AtomicUsize,
    pub port: AtomicUsize,
    pub big: Mutex<Bytes>,
}

impl ServerState {
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// Every header value the server received, as text.
    pub fn all_header_text(&self) -> String {
        let mut text = String::new();
        for seen in self.seen() {
            for (name, value) in &seen.headers {
                text.push_str(&format!(
                    "{name}: {}\n",
                    String::from_utf8_lossy(value.as_bytes())
                ));
            }
        }
        text
    }
}

/// The test server: HTTPS on one port (certificate for api.test and other.test), plain HTTP
/// on another, same routes.
pub struct TestServer {
    pub tls_port: u16,
    pub http_port: u16,
    pub state: Arc<ServerState>,
}

impl TestServer {
    pub async fn start(ca: &TestCa) -> TestServer {
        let state = Arc::new(ServerState::default());
        *state.big.lock().unwrap() = Bytes::from(vec![7u8; 1 << 20]);
        let tls_listener = TcpListener::bind((LOCALHOST, 0)).await.unwrap();
        let http_listener = TcpListener::bind((LOCALHOST, 0)).await.unwrap();
        let tls_port = tls_listener.local_addr().unwrap().port();
        let http_port = http_listener.local_addr().unwrap().port();
        state.port.store(tls_port as usize, Ordering::SeqCst);
        let acceptor = TlsAcceptor::from(ca.server_config(&["api.test", "other.test"]));
        let for_tls = state.clone();
        tokio::spawn(async move {
            loop {
                let (tcp, _) = tls_listener.accept().await.unwrap();
                tcp.set_nodelay(true).unwrap();
                let (acceptor, state) = (acceptor.clone(), for_tls.clone());
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
                    serve_http(tls, state, h2).await;
                });
            }
        });
        let for_http = state.clone();
        tokio::spawn(async move {
            loop {
                let (tcp, _) = http_listener.accept().await.unwrap();
                tcp.set_nodelay(true).unwrap();
                tokio::spawn(serve_http(tcp, for_http.clone(), false));
            }
        });
        TestServer {
            tls_port,
            http_port,
            state,
        }
    }

    /// Replaces the body of `/big` (the benchmark's download).
    pub fn set_big(&self, bytes: Bytes) {
        *self.state.big.lock().unwrap() = bytes;
    }
}

async fn serve_http<S>(io: S, state: Arc<ServerState>, h2: bool)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    state.open_connections.fetch_add(1, Ordering::SeqCst);
    let for_service = state.clone();
    let service = hyper::service::service_fn(move |req| route(req, for_service.clone()));
    if h2 {
        let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            .serve_connection(TokioIo::new(io), service)
            .await;
    } else {
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(TokioIo::new(io), service)
            .with_upgrades()
            .await;
    }
    state.open_connections.fetch_sub(1, Ordering::SeqCst);
}

fn full(text: impl Into<Bytes>) -> Body {
    Full::new(text.into()).boxed()
}

async fn route(
    mut req: Request<Incoming>,
    state: Arc<ServerState>,
) -> Result<Response<Body>, Infallible> {
    let host = req
        .uri()
        .authority()
        .map(|a| a.to_string())
        .or_else(|| {
            req.headers()
                .get(HOST)
                .map(|h| h.to_str().unwrap_or_default().to_owned())
        })
        .unwrap_or_default();
    let path = req.uri().path().to_owned();
    state.seen.lock().unwrap().push(Seen {
        method: req.method().clone(),
        path: path.clone(),
        version: req.version(),
        host,
        headers: req.headers().clone(),
    });
    let port = state.port.load(Ordering::SeqCst);
    let response = match path.as_str() {
        "/redirect" => Response::builder()
            .status(StatusCode::FOUND)
            .header(LOCATION, format!("https://other.test:{port}/landing"))
            .body(full("moved")),
        "/echo-auth" => {
            let auth = req
                .headers()
                .get("authorization")
                .cloned()
                .unwrap_or(HeaderValue::from_static(""));
            Response::builder()
                .header("x-echo", auth)
                .body(full("echoed"))
        }
        "/big" => {
            let big = state.big.lock().unwrap().clone();
            Response::builder().body(full(big))
        }
        "/slow" => {
            let first = stream::iter([Ok::<_, Infallible>(Frame::data(Bytes::from_static(
                b"first chunk\n",
            )))]);
            let body = StreamBody::new(first.chain(stream::pending()));
            Response::builder().body(BodyExt::boxed(body))
        }
        "/ws" => {
            let upgrade = hyper::upgrade::on(&mut req);
            tokio::spawn(async move {
                let Ok(upgraded) = upgrade.await else { return };
                let mut io = TokioIo::new(upgraded);
                let mut buf = [0u8; 1024];
                while let Ok(n) = io.read(&mut buf).await {
                    if n == 0 || io.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            });
            Response::builder()
                .status(StatusCode::SWITCHING_PROTOCOLS)
                .header(CONNECTION, "upgrade")
                .header(UPGRADE, "websocket")
                .body(full(""))
        }
        _ => Response::builder().body(full("hello from the test server")),
    };
    Ok(response.unwrap())
}

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
