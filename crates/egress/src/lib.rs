//! The host side of a bulkhead sandbox's network: an egress proxy with an allow-list policy,
//! TLS interception with a per-sandbox CA, secrets injected on the host, and an egress log.
//!
//! A sandbox has no network device. The guest agent listens on [`GUEST_PROXY_ADDR`] and carries
//! each accepted TCP connection over virtio-vsock to the host (CID 2, port
//! [`EGRESS_VSOCK_PORT`]); the VMM's hybrid vsock backend turns it into a connection on the Unix
//! socket `<vm.sock>_1026`, where [`EgressProxy`] listens. Each connection carries plain HTTP/1.1
//! proxy requests: `CONNECT host:port` (RFC 9110 §9.3.6) or absolute-form `http://` requests
//! (RFC 9112 §3.2.2).
//!
//! For each request the proxy:
//! 1. checks the target against the [`policy::Policy`] (deny rules beat allow rules);
//! 2. resolves the name on the host ([`resolve::Resolve`]), checks **every** address against the
//!    blocked ranges ([`policy::addr`]) and connects to exactly those addresses;
//! 3. for `CONNECT`: reads the TLS ClientHello and requires its SNI (RFC 6066 §3) to be the
//!    CONNECT host; then either splices bytes (no interception) or, for hosts with a secret or a
//!    method/path rule, terminates TLS with a certificate from its own CA, checks
//!    Host/`:authority` == SNI == CONNECT host (else `421`), applies the rules, injects secrets
//!    and opens its own verified TLS connection upstream (HTTP/1.1 or HTTP/2 by ALPN);
//! 4. logs the decision ([`log`]).
//!
//! Refusals are `403 Forbidden` with a body such as
//! `bulkhead: egress to evil.example:443 denied: no allow rule matches`.
//!
//! ```no_run
//! use bulkhead_egress::{EgressProxy, ProxyConfig, Listen};
//! use bulkhead_egress::policy::{NetworkMode, NetworkSpec, SecretValues};
//!
//! let spec = NetworkSpec {
//!     mode: NetworkMode::Allowlist,
//!     allow: vec!["@package-registries".into(), "api.example.com".into()],
//!     ..NetworkSpec::default()
//! };
//! let policy = spec.compile(&SecretValues::new())?;
//! let proxy = EgressProxy::start(ProxyConfig::new(
//!     policy,
//!     Listen::Unix("/run/bulkhead/sb1/vm.sock_1026".into()),
//!     "/run/bulkhead/sb1/egress.jsonl".into(),
//! ))?;
//! let guest_env = proxy.guest_env(); // HTTP(S)_PROXY, CA paths, secret placeholders
//! let ca_pem = proxy.ca_cert_pem().to_owned(); // for the guest's trust store
//! # let _ = (guest_env, ca_pem);
//! proxy.shutdown(); // every task ended, every socket closed, the socket file removed
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![deny(missing_docs)]

pub mod log;
pub mod policy;
pub mod proxy;
pub mod resolve;
pub mod secrets;
#[cfg(feature = "testing")]
pub mod testing;
pub mod tls;

pub use log::{read_log, LogEntry};
pub use proxy::{EgressProxy, Error, Listen, ProxyConfig};

/// Where the guest agent listens for the guest's proxy clients (`HTTP_PROXY` points here).
pub const GUEST_PROXY_ADDR: &str = "127.0.0.1:3128";
/// The vsock port the guest agent connects to on the host (CID 2) for each proxied connection;
/// with the hybrid vsock backend it arrives on the Unix socket `<vm.sock>_1026`.
pub const EGRESS_VSOCK_PORT: u32 = 1026;
/// Where the guest finds the proxy's CA certificate alone (PEM); `NODE_EXTRA_CA_CERTS` points
/// here.
pub const GUEST_CA_CERT_PATH: &str = "/etc/bulkhead/egress-ca.pem";
/// The guest's system trust bundle (Debian's path), to which the CA certificate is appended at
/// boot; `SSL_CERT_FILE`, `REQUESTS_CA_BUNDLE`, `CURL_CA_BUNDLE`, `PIP_CERT` and
/// `GIT_SSL_CAINFO` point here, so hosts that are not intercepted keep verifying against the
/// public roots.
pub const GUEST_CA_BUNDLE_PATH: &str = "/etc/ssl/certs/ca-certificates.crt";
