//! A sandbox's network, on the host's terms: the egress proxy of `bulkhead-egress`, started
//! with the sandbox when its spec asks for a network (see `docs/network.md`).
//!
//! The VM gets no network device. Its agent (told by the boot parameter `bulkhead.egress=on`)
//! relays `127.0.0.1:3128` over vsock to CID 2, port [`EGRESS_PORT`], which the VMM's hybrid
//! vsock backend turns into a connection on `<vm.sock>_1026` in the runtime directory. The proxy
//! listens there, decides every request against the sandbox's policy, and logs it to
//! `egress.jsonl` ([`EGRESS_LOG`]). Once the agent is ready the proxy's CA certificate is written
//! into the guest (`install_ca`); commands get the proxy variables and the secrets'
//! placeholders in their environment ([`crate::Sandbox::egress_env`]).
//!
//! The proxy lives in the process that started the sandbox and ends with it (its CA key never
//! leaves that process's memory). A process that adopts the sandbox (a restarted daemon) starts
//! a proxy of its own with [`crate::Sandbox::start_network`], whose new CA it installs in the
//! guest; until then the guest's connections to port 3128 are refused.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bulkhead_egress::policy::Policy;
use bulkhead_egress::resolve::{HostsResolver, StaticResolver};
use bulkhead_egress::{EgressProxy, Listen, ProxyConfig, GUEST_CA_BUNDLE_PATH, GUEST_CA_CERT_PATH};
use bulkhead_protocol::client::{AgentClient, ClientError};
use bulkhead_protocol::{ErrorCode, EGRESS_PORT};

use crate::jail;
use crate::sandbox::SandboxConfig;

/// The egress log in the runtime directory (JSON lines, `bulkhead_egress::LogEntry`).
pub const EGRESS_LOG: &str = "egress.jsonl";

/// Errors starting a sandbox's network.
#[derive(Debug, thiserror::Error)]
pub enum EgressError {
    /// The proxy could not start.
    #[error("cannot start the egress proxy: {0}")]
    Proxy(#[from] bulkhead_egress::Error),
    /// The proxy's socket could not be handed to the jailed VMM.
    #[error("cannot hand the egress socket {path} to the VMM: {source}")]
    Socket {
        /// The socket.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The CA certificate could not be installed in the guest.
    #[error("cannot install the egress proxy's CA certificate in the guest: {0}")]
    Install(#[source] ClientError),
}

/// What a sandbox's network needs (made by the spec's builder from its `network`).
#[derive(Debug, Clone)]
pub struct EgressSettings {
    /// The compiled policy, with the secrets' values.
    pub policy: Policy,
    /// Names the proxy resolves to fixed addresses before asking the host's resolver (like
    /// `docker run --add-host`); the addresses are still checked against the blocked ranges.
    pub hosts: BTreeMap<String, Vec<IpAddr>>,
    /// Where the egress log goes; `egress.jsonl` in the runtime directory when `None`.
    pub log: Option<PathBuf>,
}

/// The path of a sandbox's egress socket: `<vm.sock>_1026`.
pub fn socket_path(vsock_path: &Path) -> PathBuf {
    PathBuf::from(format!("{}_{EGRESS_PORT}", vsock_path.display()))
}

/// Where the proxy of `settings` logs: the settings' log, else `<runtime_dir>/egress.jsonl`;
/// `None` without a network (no settings).
pub(crate) fn log_path(settings: Option<&EgressSettings>, runtime_dir: &Path) -> Option<PathBuf> {
    settings.map(|s| log_file(s, runtime_dir))
}

fn log_file(settings: &EgressSettings, runtime_dir: &Path) -> PathBuf {
    settings
        .log
        .clone()
        .unwrap_or_else(|| runtime_dir.join(EGRESS_LOG))
}

/// Starts the proxy of `settings` on the sandbox's egress socket, logging to the settings' log
/// or `<runtime_dir>/egress.jsonl`.
///
/// # Errors
/// [`EgressError::Proxy`].
pub(crate) fn start(
    settings: &EgressSettings,
    runtime_dir: &Path,
    vsock_path: &Path,
) -> Result<EgressProxy, EgressError> {
    let mut pinned = StaticResolver::new();
    for (name, addrs) in &settings.hosts {
        pinned = pinned.with(name, addrs);
    }
    let mut config = ProxyConfig::new(
        settings.policy.clone(),
        Listen::Unix(socket_path(vsock_path)),
        log_file(settings, runtime_dir),
    );
    config.resolver = Some(Arc::new(HostsResolver::new(pinned)));
    Ok(EgressProxy::start(config)?)
}

/// Writes the proxy's CA certificate (`pem`) into the guest: alone at
/// [`GUEST_CA_CERT_PATH`] and appended to the system bundle [`GUEST_CA_BUNDLE_PATH`] (created
/// when the guest has none), which the commands' `SSL_CERT_FILE` and friends point at.
///
/// # Errors
/// [`EgressError::Install`].
pub(crate) fn install_ca(client: &AgentClient, pem: &str) -> Result<(), EgressError> {
    client
        .write_file(GUEST_CA_CERT_PATH, 0o644, pem.as_bytes())
        .map_err(EgressError::Install)?;
    let mut bundle = match client.read_file(GUEST_CA_BUNDLE_PATH) {
        Ok(bundle) => bundle,
        Err(ClientError::Agent(e)) if e.code == ErrorCode::NotFound => Vec::new(),
        Err(e) => return Err(EgressError::Install(e)),
    };
    if !bundle.is_empty() && !bundle.ends_with(b"\n") {
        bundle.push(b'\n');
    }
    bundle.extend_from_slice(pem.as_bytes());
    client
        .write_file(GUEST_CA_BUNDLE_PATH, 0o644, &bundle)
        .map_err(EgressError::Install)?;
    Ok(())
}

/// Starts the egress proxy of `config` (if it has a network) on the sandbox's egress socket in
/// the runtime directory `dir`, handed to the jailed VMM's uid.
pub(crate) fn start_egress(
    config: &SandboxConfig,
    dir: &Path,
    uds_path: &Path,
) -> Result<Option<EgressProxy>, EgressError> {
    let Some(settings) = &config.egress else {
        return Ok(None);
    };
    start_proxy(settings, dir, uds_path, jail::active(config.jail)).map(Some)
}

/// Starts the proxy of `settings` on the egress socket of the VM whose vsock socket is
/// `uds_path`, in runtime directory `dir`; the socket goes to the jailed VMM's uid when `jailed`.
pub(crate) fn start_proxy(
    settings: &EgressSettings,
    dir: &Path,
    uds_path: &Path,
    jailed: bool,
) -> Result<EgressProxy, EgressError> {
    let proxy = start(settings, dir, uds_path)?;
    let socket = socket_path(uds_path);
    if jailed {
        jail::hand_to_vmm(dir, &socket).map_err(|source| EgressError::Socket {
            path: socket,
            source,
        })?;
    }
    Ok(proxy)
}

/// Writes the proxy's CA certificate into the guest, when there is a proxy.
pub(crate) fn install_egress_ca(
    client: &AgentClient,
    proxy: Option<&EgressProxy>,
) -> Result<(), EgressError> {
    match proxy {
        Some(proxy) => install_ca(client, proxy.ca_cert_pem()),
        None => Ok(()),
    }
}
