//! Egress proxy benchmark (no criterion: `cargo bench -p bulkhead-egress --bench egress`).
//!
//! 1. Throughput: a 100 MiB HTTPS download from a local server, directly and through the proxy
//!    (spliced tunnel, and intercepted TLS); the ratio of throughputs.
//! 2. Added latency per HTTPS request on a new connection (TCP/Unix connect, CONNECT, TLS
//!    handshake, `GET /`): direct, spliced, intercepted; p50/p90 and the difference to direct.
//!
//! Everything runs on this machine over loopback and a Unix socket; numbers are printed as a
//! Markdown table for `benches/results/`.

#[path = "../tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use bulkhead_egress::policy::{NetworkMode, NetworkSpec, RuleSpec};
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::Method;
use hyper_util::rt::TokioIo;
use rustls::RootCertStore;
use support::*;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

const DOWNLOAD: usize = 100 << 20;
const DOWNLOAD_RUNS: usize = 5;
const LATENCY_RUNS: usize = 200;

#[derive(Clone, Copy, Debug)]
enum Path {
    Direct,
    Spliced,
    Intercepted,
}

struct Setup {
    ca: TestCa,
    server: TestServer,
    spliced: TestProxy,
    intercepted: TestProxy,
}

impl Setup {
    async fn new() -> Setup {
        let ca = TestCa::new();
        let server = TestServer::start(&ca).await;
        server.set_big(Bytes::from(vec![0x5a; DOWNLOAD]));
        let host = format!("api.test:{}", server.tls_port);
        let base = NetworkSpec {
            mode: NetworkMode::Allowlist,
            allow: vec![host.clone()],
            allow_cidr: vec!["127.0.0.1/32".into()],
            ..NetworkSpec::default()
        };
        let with_rule = NetworkSpec {
            rules: vec![RuleSpec {
                host,
                methods: vec!["GET".into()],
                ..RuleSpec::default()
            }],
            ..base.clone()
        };
        let spliced = TestProxy::start(&base, &ca, ProxyOptions::default());
        let intercepted = TestProxy::start(&with_rule, &ca, ProxyOptions::default());
        Setup {
            ca,
            server,
            spliced,
            intercepted,
        }
    }

    /// One `GET path` on a new connection by `route`; returns the body's size.
    async fn get(&self, route: Path, path: &str) -> usize {
        let authority = format!("api.test:{}", self.server.tls_port);
        match route {
            Path::Direct => {
                let tcp = TcpStream::connect(loopback(self.server.tls_port))
                    .await
                    .unwrap();
                tcp.set_nodelay(true).unwrap();
                fetch(tcp, self.ca.roots(), &authority, path).await
            }
            Path::Spliced => {
                let tunnel = connect_tunnel(&self.spliced, &authority).await.unwrap();
                fetch(tunnel, self.ca.roots(), &authority, path).await
            }
            Path::Intercepted => {
                let tunnel = connect_tunnel(&self.intercepted, &authority).await.unwrap();
                fetch(tunnel, self.intercepted.ca_roots(), &authority, path).await
            }
        }
    }
}

/// TLS to api.test over `io`, then an HTTP/1.1 GET whose body is read frame by frame.
async fn fetch<S>(io: S, roots: RootCertStore, authority: &str, path: &str) -> usize
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let stream = tls(io, "api.test", roots, &[b"http/1.1"]).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let response = sender
        .send_request(request(Method::GET, path, &[("host", authority)]))
        .await
        .unwrap();
    assert!(response.status().is_success());
    let mut body = response.into_body();
    let mut size = 0;
    while let Some(frame) = body.frame().await {
        if let Some(data) = frame.unwrap().data_ref() {
            size += data.len();
        }
    }
    size
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

async fn throughput(setup: &Setup, route: Path) -> f64 {
    let mut times = Vec::new();
    for _ in 0..DOWNLOAD_RUNS {
        let start = Instant::now();
        let size = setup.get(route, "/big").await;
        times.push(start.elapsed());
        assert_eq!(size, DOWNLOAD);
    }
    times.sort();
    let median = percentile(&times, 0.5);
    DOWNLOAD as f64 / median.as_secs_f64() / (1 << 20) as f64
}

async fn latencies(setup: &Setup, route: Path) -> Vec<Duration> {
    for _ in 0..10 {
        setup.get(route, "/").await;
    }
    let mut times = Vec::with_capacity(LATENCY_RUNS);
    for _ in 0..LATENCY_RUNS {
        let start = Instant::now();
        setup.get(route, "/").await;
        times.push(start.elapsed());
    }
    times.sort();
    times
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let setup = Setup::new().await;
    println!("## Throughput: 100 MiB HTTPS download, median of {DOWNLOAD_RUNS}\n");
    println!("| path | MiB/s | ratio to direct |\n|---|---|---|");
    let direct = throughput(&setup, Path::Direct).await;
    for route in [Path::Direct, Path::Spliced, Path::Intercepted] {
        let rate = match route {
            Path::Direct => direct,
            _ => throughput(&setup, route).await,
        };
        println!("| {route:?} | {rate:.0} | {:.2} |", rate / direct);
    }
    println!("\n## Latency: one HTTPS GET on a new connection, {LATENCY_RUNS} runs\n");
    println!("| path | p50 ms | p90 ms | added p50 ms | added p90 ms |\n|---|---|---|---|---|");
    let base = latencies(&setup, Path::Direct).await;
    let (b50, b90) = (percentile(&base, 0.5), percentile(&base, 0.9));
    for route in [Path::Direct, Path::Spliced, Path::Intercepted] {
        let times = match route {
            Path::Direct => base.clone(),
            _ => latencies(&setup, route).await,
        };
        let (p50, p90) = (percentile(&times, 0.5), percentile(&times, 0.9));
        println!(
            "| {route:?} | {:.2} | {:.2} | {:+.2} | {:+.2} |",
            ms(p50),
            ms(p90),
            ms(p50) - ms(b50),
            ms(p90) - ms(b90)
        );
    }
}
