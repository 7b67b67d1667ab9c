//! Test fixtures for other crates' tests (feature `testing`): a CA of the tests' own and an
//! HTTPS/HTTP test server with a few routes, recording every request it sees. Not for
//! production use.
//!
//! Routes: `/redirect` (302 to `https://other.test:PORT/landing`), `/echo-auth` (answers with
//! the request's `Authorization` in `x-echo`), `/big` (a large body), `/slow` (one chunk, then
//! nothing), `/ws` (a WebSocket-style upgrade that echoes), anything else: a greeting.

#![allow(missing_docs, clippy::missing_panics_doc)]

use std::convert::Infallible;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures_util::stream::{self, StreamExt};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::header::{HeaderMap, HeaderValue, CONNECTION, HOST, LOCATION, UPGRADE};
use hyper::{Method, Request, Response, StatusCode, Version};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::{BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, KeyPair};
use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::{RootCertStore, ServerConfig};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

pub type Body = BoxBody<Bytes, Infallible>;
pub const LOCALHOST: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// A CA of the tests' own that signs the test server's certificate.
pub struct TestCa {
    cert: rcgen::Certificate,
    key: KeyPair,
}

impl Default for TestCa {
    fn default() -> Self {
        TestCa::new()
    }
}

impl std::fmt::Debug for TestCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCa").finish_non_exhaustive()
    }
}

impl TestCa {
    pub fn new() -> TestCa {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        // Names of their own for the CA and each leaf: OpenSSL (curl in a guest) takes a leaf
        // whose subject equals its issuer for a self-signed certificate and refuses it.
        params.distinguished_name = distinguished("bulkhead test CA");
        let cert = params.self_signed(&key).unwrap();
        TestCa { cert, key }
    }

    /// The CA certificate, PEM (e.g. for `SSL_CERT_FILE`).
    pub fn cert_pem(&self) -> String {
        self.cert.pem()
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
        let mut params = CertificateParams::new(names.clone()).unwrap();
        params.distinguished_name = distinguished(names.first().map_or("test server", |n| n));
        let leaf = params.signed_by(&leaf_key, &self.cert, &self.key).unwrap();
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

/// A distinguished name of one common name.
fn distinguished(common_name: &str) -> DistinguishedName {
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, common_name);
    name
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

#[derive(Debug, Default)]
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
#[derive(Debug)]
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
