//! Egress proxy benchmark (no criterion: `cargo bench -p bulkhead-egress --bench egress`).
//!
//! 1. Throughput: a 100 MiB HTTPS download from a local server, directly and through the proxy
//!    (spliced tunnel, and intercepted TLS), the paths taking turns download by download; the
//!    ratio of the median throughputs, and the CPU time this process (client, server and proxy
//!    alike) spent per download (`getrusage(2)`): the proxy's own cost per 100 MiB is a path's
//!    CPU time less the direct path's, a figure that does not depend on how the few cores of
//!    a small machine were shared out.
//!    The same for the proxy alone: 1 GiB of raw bytes from a server that answers a
//!    ClientHello with them (no TLS work on either end), directly and through a spliced
//!    tunnel: how fast the proxy itself moves a tunnel's bytes.
//! 2. Added latency per HTTPS request on a new connection (TCP/Unix connect, CONNECT, TLS
//!    handshake, `GET /`): direct, spliced, intercepted; p50/p90 and the difference to direct.
//!
//! Everything runs on this machine over loopback and a Unix socket; numbers are printed as a
//! Markdown table for `benches/results/`.

#[path = "../tests/support/mod.rs"]
mod support;

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bulkhead_egress::policy::{NetworkMode, NetworkSpec, RuleSpec};
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::Method;
use hyper_util::rt::TokioIo;
use rustls::RootCertStore;
use support::*;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const DOWNLOAD: usize = 100 << 20;
/// Bytes of a raw download (the proxy alone).
const RAW_DOWNLOAD: usize = 1 << 30;
const DOWNLOAD_RUNS: usize = 9;
const LATENCY_RUNS: usize = 200;

#[derive(Clone, Copy, Debug)]
enum Path {
    Direct,
    Spliced,
    Intercepted,
    RawDirect,
    RawSpliced,
}

struct Setup {
    ca: TestCa,
    server: TestServer,
    raw_port: u16,
    hello: Vec<u8>,
    spliced: TestProxy,
    intercepted: TestProxy,
}

impl Setup {
    async fn new() -> Setup {
        let ca = TestCa::new();
        let server = TestServer::start(&ca).await;
        server.set_big(Bytes::from(vec![0x5a; DOWNLOAD]));
        let hello = client_hello();
        let raw_port = raw_source(hello.len()).await;
        let host = format!("api.test:{}", server.tls_port);
        let base = NetworkSpec {
            mode: NetworkMode::Allowlist,
            allow: vec![host.clone(), format!("api.test:{raw_port}")],
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
            raw_port,
            hello,
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
            Path::RawDirect => {
                let tcp = TcpStream::connect(loopback(self.raw_port)).await.unwrap();
                tcp.set_nodelay(true).unwrap();
                drain(tcp, &self.hello).await
            }
            Path::RawSpliced => {
                let authority = format!("api.test:{}", self.raw_port);
                let tunnel = connect_tunnel(&self.spliced, &authority).await.unwrap();
                drain(tunnel, &self.hello).await
            }
        }
    }
}

/// A TLS 1.3 ClientHello for api.test (what the proxy checks before it splices).
fn client_hello() -> Vec<u8> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(RootCertStore::empty())
        .with_no_client_auth();
    let name = rustls::pki_types::ServerName::try_from("api.test").unwrap();
    let mut conn = rustls::ClientConnection::new(Arc::new(config), name).unwrap();
    let mut hello = Vec::new();
    conn.write_tls(&mut hello).unwrap();
    hello
}

/// A server on 127.0.0.1 that reads a ClientHello of `hello_len` bytes from each connection,
/// then sends `RAW_DOWNLOAD` bytes and closes; its port.
async fn raw_source(hello_len: usize) -> u16 {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let chunk = Bytes::from(vec![0x5a_u8; 1 << 20]);
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let chunk = chunk.clone();
            tokio::spawn(async move {
                stream.set_nodelay(true).unwrap();
                let mut hello = vec![0; hello_len];
                stream.read_exact(&mut hello).await.unwrap();
                for _ in 0..RAW_DOWNLOAD / chunk.len() {
                    stream.write_all(&chunk).await.unwrap();
                }
                stream.shutdown().await.unwrap();
            });
        }
    });
    port
}

/// Sends `hello` over `io`, then reads until the end; the bytes read.
async fn drain<S: AsyncRead + AsyncWrite + Unpin>(mut io: S, hello: &[u8]) -> usize {
    io.write_all(hello).await.unwrap();
    let mut buf = vec![0; 256 << 10];
    let mut total = 0;
    loop {
        match io.read(&mut buf).await.unwrap() {
            0 => return total,
            n => total += n,
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

impl Path {
    /// The bytes one download by this path brings.
    fn bytes(self) -> usize {
        match self {
            Path::RawDirect | Path::RawSpliced => RAW_DOWNLOAD,
            _ => DOWNLOAD,
        }
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// CPU time (user + system) of this whole process so far.
fn process_cpu() -> Duration {
    // SAFETY: an all-zero rusage is a valid value for getrusage to fill in.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes into the struct we pass; RUSAGE_SELF is always valid.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let time = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64)
    };
    time(usage.ru_utime) + time(usage.ru_stime)
}

/// The medians of one path's downloads: wall time and this process's CPU time.
#[derive(Clone, Copy)]
struct Download {
    bytes: usize,
    wall: Duration,
    cpu: Duration,
}

impl Download {
    fn mib_per_s(&self) -> f64 {
        self.bytes as f64 / self.wall.as_secs_f64() / (1 << 20) as f64
    }
}

/// `DOWNLOAD_RUNS` downloads by each of `routes`, taking turns (so that a slower or busier
/// moment of the machine falls on every path alike); the medians per path.
async fn downloads(setup: &Setup, routes: &[Path]) -> Vec<Download> {
    let mut walls = vec![Vec::new(); routes.len()];
    let mut cpus = vec![Vec::new(); routes.len()];
    for _ in 0..DOWNLOAD_RUNS {
        for (i, &route) in routes.iter().enumerate() {
            let (start, cpu) = (Instant::now(), process_cpu());
            let size = setup.get(route, "/big").await;
            walls[i].push(start.elapsed());
            cpus[i].push(process_cpu().saturating_sub(cpu));
            assert_eq!(size, route.bytes());
        }
    }
    walls
        .iter_mut()
        .zip(cpus.iter_mut())
        .zip(routes)
        .map(|((wall, cpu), route)| {
            wall.sort();
            cpu.sort();
            Download {
                bytes: route.bytes(),
                wall: percentile(wall, 0.5),
                cpu: percentile(cpu, 0.5),
            }
        })
        .collect()
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

/// Prints a table row per route: throughput, ratio to the first route, CPU time.
async fn throughput_table(setup: &Setup, routes: &[Path]) {
    let results = downloads(setup, routes).await;
    let first = results[0];
    for (route, got) in routes.iter().zip(&results) {
        println!(
            "| {route:?} | {:.0} | {:.2} | {:.0} | {:+.0} |",
            got.mib_per_s(),
            got.mib_per_s() / first.mib_per_s(),
            ms(got.cpu),
            ms(got.cpu) - ms(first.cpu)
        );
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let setup = Setup::new().await;
    println!("## Throughput: 100 MiB HTTPS download, median of {DOWNLOAD_RUNS}, paths in turn\n");
    println!(
        "| path | MiB/s | ratio to direct | CPU ms per download | added CPU ms |\n\
         |---|---|---|---|---|"
    );
    throughput_table(&setup, &[Path::Direct, Path::Spliced, Path::Intercepted]).await;
    println!(
        "\n## The proxy alone: 1 GiB of raw bytes after a ClientHello, median of \
         {DOWNLOAD_RUNS}, paths in turn\n"
    );
    println!(
        "| path | MiB/s | ratio to direct | CPU ms per download | added CPU ms |\n\
         |---|---|---|---|---|"
    );
    throughput_table(&setup, &[Path::RawDirect, Path::RawSpliced]).await;
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
