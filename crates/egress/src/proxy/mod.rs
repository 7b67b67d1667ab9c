//! The proxy: [`EgressProxy::start`] runs it on a thread of its own with its own tokio runtime,
//! so synchronous callers (`bulkhead run`) and async ones (the daemon) start it the same way.
//!
//! Task model: every task (guest connections, tunnels, upstream connections, hyper's HTTP/2
//! stream tasks) is spawned through one tracker and ends on shutdown; a guest connection's
//! tasks also end after the idle timeout; at most `max_connections` guest connections are
//! served at once (more wait in the listen backlog). [`EgressProxy::shutdown`] (or dropping the
//! proxy) cancels them all, waits until every one has ended, drops the runtime, and removes the
//! listening socket file: no task or socket is left behind.

mod connect;
mod forward;
mod intercept;
mod io;
mod plain;
mod server;
mod shared;
mod zerocopy;

use std::net::SocketAddr;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use rustls::RootCertStore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::log::{EgressLog, LogError};
use crate::policy::Policy;
use crate::resolve::{Resolve, ResolveError, SystemResolver};
use crate::secrets::{Injector, SecretError};
use crate::tls::{native_roots, Authority, TlsError, UpstreamTls};
use crate::{GUEST_CA_BUNDLE_PATH, GUEST_CA_CERT_PATH, GUEST_PROXY_ADDR};
use server::Listener;
use shared::{Shared, Tasks};

/// Default most concurrent guest connections per proxy.
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;
/// Default idle timeout of a guest connection: no byte either way for this long closes it.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(300);
/// Default bound on one TCP connect or TLS handshake to an upstream.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Worker threads of the proxy's runtime.
const WORKER_THREADS: usize = 2;

/// Errors starting the proxy.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The listening socket cannot be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The socket path or address.
        addr: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A configuration value is out of range.
    #[error("bad proxy configuration: {0}")]
    Config(&'static str),
    /// The runtime or its thread cannot be started.
    #[error("cannot start the proxy thread: {0}")]
    Thread(std::io::Error),
    /// The CA, the leaf key or the upstream TLS configuration cannot be made.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// The egress log cannot be opened.
    #[error(transparent)]
    Log(#[from] LogError),
    /// The host resolver cannot be set up.
    #[error(transparent)]
    Resolve(#[from] ResolveError),
    /// A placeholder cannot be made.
    #[error(transparent)]
    Secret(#[from] SecretError),
}

/// Where the proxy listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Listen {
    /// A Unix stream socket at this path (for a sandbox: `<vm.sock>_1026`). A stale socket
    /// file there is replaced; any other file is an error. The file is removed on shutdown.
    Unix(PathBuf),
    /// A TCP address (tests and benchmarks; port 0 picks a free port, see
    /// [`EgressProxy::listen_addr`]).
    Tcp(SocketAddr),
}

impl std::fmt::Display for Listen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Listen::Unix(path) => write!(f, "{}", path.display()),
            Listen::Tcp(addr) => write!(f, "{addr}"),
        }
    }
}

/// Everything the proxy needs.
#[derive(Debug)]
pub struct ProxyConfig {
    /// The validated policy, with secret values.
    pub policy: Policy,
    /// Where to listen.
    pub listen: Listen,
    /// The egress log file (JSON lines; created mode 0600, appended to).
    pub log_path: PathBuf,
    /// Host-side resolver; `None`: the system's (hickory-resolver, `/etc/resolv.conf`).
    pub resolver: Option<Arc<dyn Resolve>>,
    /// Trust roots for upstream TLS on intercepted hosts; `None`: the host's native roots.
    pub upstream_roots: Option<RootCertStore>,
    /// Most concurrent guest connections ([`DEFAULT_MAX_CONNECTIONS`]).
    pub max_connections: usize,
    /// Idle timeout of a guest connection ([`DEFAULT_IDLE_TIMEOUT`]).
    pub idle_timeout: Duration,
    /// Bound on each upstream TCP connect and TLS handshake ([`DEFAULT_CONNECT_TIMEOUT`]).
    pub connect_timeout: Duration,
}

impl ProxyConfig {
    /// A configuration with the defaults: system resolver, native roots, 256 connections,
    /// 300 s idle timeout, 10 s connect timeout.
    pub fn new(policy: Policy, listen: Listen, log_path: PathBuf) -> ProxyConfig {
        ProxyConfig {
            policy,
            listen,
            log_path,
            resolver: None,
            upstream_roots: None,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
        }
    }
}

/// A running egress proxy (see the module docs). Dropping it shuts it down like
/// [`EgressProxy::shutdown`].
#[derive(Debug)]
pub struct EgressProxy {
    cancel: CancellationToken,
    tracker: TaskTracker,
    thread: Option<JoinHandle<()>>,
    listen: Listen,
    ca_pem: String,
    placeholders: Vec<(String, String)>,
}

/// The Unix socket file a proxy made (path and inode), removed on shutdown.
type SocketFile = Option<(PathBuf, u64)>;

/// Counts a proxy's live tasks; see [`EgressProxy::task_monitor`].
#[derive(Clone, Debug)]
pub struct TaskMonitor {
    tracker: TaskTracker,
}

impl TaskMonitor {
    /// Tasks still running.
    pub fn live(&self) -> usize {
        self.tracker.len()
    }
}

/// What the proxy thread needs, moved into it.
struct Startup {
    shared: Shared,
    listen: Listen,
    resolver: Option<Arc<dyn Resolve>>,
    max_connections: usize,
}

impl EgressProxy {
    /// Makes the CA, opens the log, binds the socket and starts serving on a new thread.
    /// Returns once the socket is listening. Callable from sync code and from inside a tokio
    /// runtime alike.
    ///
    /// # Errors
    /// [`Error`] for a bad configuration, no trust roots, an unreadable resolver configuration,
    /// a log that cannot be opened or a socket that cannot be bound; nothing is left running.
    pub fn start(config: ProxyConfig) -> Result<EgressProxy, Error> {
        if config.max_connections == 0
            || config.idle_timeout.is_zero()
            || config.connect_timeout.is_zero()
        {
            return Err(Error::Config(
                "max_connections and the timeouts must be above zero",
            ));
        }
        let authority = Authority::new()?;
        let ca_pem = authority.ca_pem().to_owned();
        let roots = match config.upstream_roots {
            Some(roots) => roots,
            // A host without trust roots can still splice and forward plain HTTP; only
            // intercepted hosts need them, and fail (502, logged) without. A policy that
            // intercepts nothing is not warned about.
            None => native_roots().unwrap_or_else(|e| {
                if config.policy.intercepts_some_host() {
                    tracing::warn!("{e}: intercepted hosts will fail to verify (502)");
                } else {
                    tracing::debug!("{e} (no host of this policy is intercepted)");
                }
                rustls::RootCertStore::empty()
            }),
        };
        let injector = Injector::new(&config.policy)?;
        let placeholders = injector.placeholders();
        let tasks = Tasks {
            cancel: CancellationToken::new(),
            tracker: TaskTracker::new(),
        };
        let shared = Shared {
            resolver: Arc::new(crate::resolve::StaticResolver::new()),
            policy: config.policy,
            authority,
            upstream_tls: UpstreamTls::new(roots)?,
            injector,
            log: EgressLog::open(&config.log_path)?,
            idle_timeout: config.idle_timeout,
            connect_timeout: config.connect_timeout,
            tasks: tasks.clone(),
        };
        let startup = Startup {
            shared,
            listen: config.listen,
            resolver: config.resolver,
            max_connections: config.max_connections,
        };
        let (tx, rx) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("bulkhead-egress".to_owned())
            .spawn(move || run_thread(startup, tx))
            .map_err(Error::Thread)?;
        match rx.recv() {
            Ok(Ok(listen)) => Ok(EgressProxy {
                cancel: tasks.cancel,
                tracker: tasks.tracker,
                thread: Some(thread),
                listen,
                ca_pem,
                placeholders,
            }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => {
                let _ = thread.join();
                Err(Error::Thread(std::io::Error::other(
                    "the proxy thread ended at start",
                )))
            }
        }
    }

    /// The proxy's CA certificate (PEM), for the guest's trust store. Its private key never
    /// leaves this process and is gone with the proxy.
    pub fn ca_cert_pem(&self) -> &str {
        &self.ca_pem
    }

    /// Where the proxy listens (with the actual port when TCP port 0 was asked for).
    pub fn listen_addr(&self) -> &Listen {
        &self.listen
    }

    /// `(NAME, placeholder)` for each secret: what the guest's environment holds instead of the
    /// value.
    pub fn placeholders(&self) -> &[(String, String)] {
        &self.placeholders
    }

    /// The guest environment for every command: `HTTP_PROXY`, `HTTPS_PROXY` and their lower-case
    /// forms (`http://127.0.0.1:3128`), `NO_PROXY`/`no_proxy` (`localhost,127.0.0.1`),
    /// `NODE_USE_ENV_PROXY=1`; `SSL_CERT_FILE`, `REQUESTS_CA_BUNDLE`, `CURL_CA_BUNDLE`,
    /// `PIP_CERT`, `GIT_SSL_CAINFO` = [`GUEST_CA_BUNDLE_PATH`] (the system bundle with the CA
    /// appended); `NODE_EXTRA_CA_CERTS` = [`GUEST_CA_CERT_PATH`]; and `NAME=placeholder` for
    /// each secret.
    pub fn guest_env(&self) -> Vec<(String, String)> {
        let proxy = format!("http://{GUEST_PROXY_ADDR}");
        let mut env: Vec<(String, String)> = Vec::new();
        for name in ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"] {
            env.push((name.to_owned(), proxy.clone()));
        }
        for name in ["NO_PROXY", "no_proxy"] {
            env.push((name.to_owned(), "localhost,127.0.0.1".to_owned()));
        }
        env.push(("NODE_USE_ENV_PROXY".to_owned(), "1".to_owned()));
        for name in [
            "SSL_CERT_FILE",
            "REQUESTS_CA_BUNDLE",
            "CURL_CA_BUNDLE",
            "PIP_CERT",
            "GIT_SSL_CAINFO",
        ] {
            env.push((name.to_owned(), GUEST_CA_BUNDLE_PATH.to_owned()));
        }
        env.push((
            "NODE_EXTRA_CA_CERTS".to_owned(),
            GUEST_CA_CERT_PATH.to_owned(),
        ));
        env.extend(self.placeholders.iter().cloned());
        env
    }

    /// Tasks still running (guest connections, tunnels, upstream connections).
    pub fn live_tasks(&self) -> usize {
        self.tracker.len()
    }

    /// A handle that counts this proxy's live tasks and outlives it (to check that shutdown
    /// left none).
    pub fn task_monitor(&self) -> TaskMonitor {
        TaskMonitor {
            tracker: self.tracker.clone(),
        }
    }

    /// Stops the proxy and returns once every task has ended, every socket is closed and the
    /// socket file is removed. Blocks the calling thread (from async code, call it through
    /// `spawn_blocking`).
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.cancel.cancel();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for EgressProxy {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The proxy thread: runtime, listener, accept loop; on shutdown waits for every task, drops
/// the runtime and removes the socket file.
fn run_thread(startup: Startup, ready: std::sync::mpsc::Sender<Result<Listen, Error>>) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(WORKER_THREADS)
        .thread_name("bulkhead-egress-worker")
        .enable_all()
        .build();
    let runtime = match runtime {
        Ok(runtime) => runtime,
        Err(e) => {
            let _ = ready.send(Err(Error::Thread(e)));
            return;
        }
    };
    let socket_file = runtime.block_on(serve(startup, ready));
    runtime.shutdown_timeout(Duration::from_secs(5));
    if let Some((path, ino)) = socket_file {
        remove_socket_file(&path, ino);
    }
}

/// Binds and serves until shutdown; returns the socket file to remove, if one was made.
async fn serve(
    startup: Startup,
    ready: std::sync::mpsc::Sender<Result<Listen, Error>>,
) -> SocketFile {
    let Startup {
        mut shared,
        listen,
        resolver,
        max_connections,
    } = startup;
    shared.resolver = match resolver {
        Some(resolver) => resolver,
        None => match SystemResolver::new() {
            Ok(system) => Arc::new(system),
            Err(e) => {
                let _ = ready.send(Err(e.into()));
                return None;
            }
        },
    };
    let (listener, bound, socket_file) = match bind(&listen) {
        Ok(found) => found,
        Err(e) => {
            let _ = ready.send(Err(e));
            return None;
        }
    };
    let tasks = shared.tasks.clone();
    let _ = ready.send(Ok(bound));
    server::accept_loop(listener, Arc::new(shared), max_connections).await;
    tasks.tracker.close();
    tasks.tracker.wait().await;
    socket_file
}

/// Binds the listener; for a Unix socket also returns its path and inode (so shutdown removes
/// only the file it made).
fn bind(listen: &Listen) -> Result<(Listener, Listen, SocketFile), Error> {
    let fail = |source| Error::Bind {
        addr: listen.to_string(),
        source,
    };
    match listen {
        Listen::Unix(path) => {
            replace_stale_socket(path).map_err(fail)?;
            let listener = tokio::net::UnixListener::bind(path).map_err(fail)?;
            let ino = std::fs::metadata(path).map_err(fail)?.ino();
            Ok((
                Listener::Unix(listener),
                listen.clone(),
                Some((path.clone(), ino)),
            ))
        }
        Listen::Tcp(addr) => {
            let std_listener = std::net::TcpListener::bind(addr).map_err(fail)?;
            std_listener.set_nonblocking(true).map_err(fail)?;
            let local = std_listener.local_addr().map_err(fail)?;
            let listener = tokio::net::TcpListener::from_std(std_listener).map_err(fail)?;
            Ok((Listener::Tcp(listener), Listen::Tcp(local), None))
        }
    }
}

/// Removes a socket file left at `path` by an earlier run; refuses any other kind of file.
fn replace_stale_socket(path: &Path) -> std::io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => std::fs::remove_file(path),
        Ok(_) => Err(std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            "a file that is not a socket is in the way",
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Removes the socket file if it is still the one this proxy made.
fn remove_socket_file(path: &Path, ino: u64) {
    if std::fs::symlink_metadata(path).is_ok_and(|m| m.ino() == ino) {
        let _ = std::fs::remove_file(path);
    }
}
