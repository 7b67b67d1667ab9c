//! TLS: reading a ClientHello without terminating it, the per-proxy CA that signs intercepted
//! hosts' certificates, and the proxy's own TLS client to upstreams.
//!
//! All TLS work is rustls's (ring provider); nothing here parses TLS by hand. The CA's private
//! key is made in memory when the proxy starts and is dropped with it: it is never written to
//! disk and never sent to the guest (only the certificate is, for the guest's trust store).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::server::Acceptor;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::io::{AsyncRead, AsyncReadExt};

use crate::policy::HostName;

/// Most bytes of a ClientHello the proxy reads before giving up (the record layer carries at
/// most 16 KiB a record, RFC 8446 §5.1; a hello may span records; real ones are under 2 KiB).
pub const MAX_CLIENT_HELLO: usize = 32 * 1024;
/// Most leaf certificate configurations kept (the cache is cleared when full).
const MAX_CACHED_LEAVES: usize = 1024;
/// Validity of the CA and leaf certificates, in days (under the 398-day ceiling clients enforce
/// on server certificates).
const VALIDITY_DAYS: i64 = 397;
/// ALPN identifiers (RFC 7301), most preferred first.
const ALPN_H2: &[u8] = b"h2";
const ALPN_HTTP1: &[u8] = b"http/1.1";

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The guest closed the connection or an I/O error happened before a whole ClientHello.
    #[error("reading the ClientHello: {0}")]
    Io(#[from] std::io::Error),
    /// More than [`MAX_CLIENT_HELLO`] bytes (or more than rustls buffers) without a whole
    /// ClientHello.
    #[error("the ClientHello is too large")]
    TooLarge,
    /// The bytes are not a TLS ClientHello rustls accepts.
    #[error("not a TLS ClientHello: {0}")]
    NotTls(rustls::Error),
    /// Making a certificate failed.
    #[error("certificate generation failed: {0}")]
    Cert(#[from] rcgen::Error),
    /// Building a rustls configuration failed.
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
    /// The host has no usable trust roots.
    #[error("no trust roots for upstream TLS: {0}")]
    NoRoots(String),
}

/// What the proxy needs from a ClientHello (RFC 8446 §4.1.2).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct HelloInfo {
    /// The server_name extension's host name (RFC 6066 §3), if any.
    pub sni: Option<String>,
    /// The ALPN protocols offered (RFC 7301 §3.1).
    pub alpn: Vec<Vec<u8>>,
}

/// Reads from `stream` until rustls's [`Acceptor`] has a whole ClientHello; returns every byte
/// read (to replay upstream or into the terminating TLS server) and what the hello says.
pub(crate) async fn read_client_hello<S: AsyncRead + Unpin>(
    stream: &mut S,
) -> Result<(Vec<u8>, HelloInfo), TlsError> {
    let mut acceptor = Acceptor::default();
    let mut buffered = Vec::with_capacity(2048);
    let mut chunk = [0u8; 4096];
    loop {
        let room = MAX_CLIENT_HELLO
            .saturating_sub(buffered.len())
            .min(chunk.len());
        if room == 0 {
            return Err(TlsError::TooLarge);
        }
        let n = stream.read(&mut chunk[..room]).await?;
        if n == 0 {
            return Err(TlsError::Io(std::io::ErrorKind::UnexpectedEof.into()));
        }
        buffered.extend_from_slice(&chunk[..n]);
        let mut rest = &chunk[..n];
        while !rest.is_empty() {
            // Reading from a slice fails only when rustls's own buffer is full.
            if acceptor
                .read_tls(&mut rest)
                .map_err(|_| TlsError::TooLarge)?
                == 0
            {
                break;
            }
        }
        match acceptor.accept() {
            Ok(None) => continue,
            Ok(Some(accepted)) => {
                let hello = accepted.client_hello();
                let info = HelloInfo {
                    sni: hello.server_name().map(str::to_owned),
                    alpn: hello
                        .alpn()
                        .map(|a| a.map(<[u8]>::to_vec).collect())
                        .unwrap_or_default(),
                };
                return Ok((buffered, info));
            }
            Err((e, _alert)) => return Err(TlsError::NotTls(e)),
        }
    }
}

/// The crypto provider every configuration uses (ring).
pub(crate) fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The per-proxy certificate authority and its cache of per-host server configurations.
pub(crate) struct Authority {
    ca: rcgen::Certificate,
    ca_key: KeyPair,
    leaf_key: KeyPair,
    ca_pem: String,
    cache: Mutex<HashMap<HostName, Arc<ServerConfig>>>,
    provider: Arc<CryptoProvider>,
}

impl std::fmt::Debug for Authority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authority").finish_non_exhaustive()
    }
}

/// Validity bounds: an hour ago (clock skew with the guest) to [`VALIDITY_DAYS`] from now.
fn validity(params: &mut CertificateParams) {
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::hours(1);
    params.not_after = now + time::Duration::days(VALIDITY_DAYS);
}

/// A random positive 16-byte serial number (RFC 5280 §4.1.2.2: at most 20 bytes).
fn serial() -> Result<rcgen::SerialNumber, TlsError> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(|e| TlsError::NoRoots(format!("random source: {e}")))?;
    bytes[0] &= 0x7f;
    Ok(rcgen::SerialNumber::from_slice(&bytes))
}

impl Authority {
    /// Makes a fresh CA (ECDSA P-256) and the one key all leaf certificates share.
    pub fn new() -> Result<Authority, TlsError> {
        let ca_key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name = rcgen::DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::OrganizationName, "bulkhead");
        params
            .distinguished_name
            .push(DnType::CommonName, "bulkhead sandbox egress CA");
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        params.serial_number = Some(serial()?);
        validity(&mut params);
        let ca = params.self_signed(&ca_key)?;
        let ca_pem = ca.pem();
        Ok(Authority {
            ca,
            ca_key,
            leaf_key: KeyPair::generate()?,
            ca_pem,
            cache: Mutex::new(HashMap::new()),
            provider: provider(),
        })
    }

    /// The CA certificate, PEM.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// A TLS server configuration presenting a certificate for `host` signed by the CA,
    /// offering HTTP/2 and HTTP/1.1 by ALPN. Cached per host.
    pub fn server_config(&self, host: &HostName) -> Result<Arc<ServerConfig>, TlsError> {
        if let Some(found) = self.lock_cache().get(host) {
            return Ok(found.clone());
        }
        let config = Arc::new(self.mint(host)?);
        let mut cache = self.lock_cache();
        if cache.len() >= MAX_CACHED_LEAVES {
            cache.clear();
        }
        cache.insert(host.clone(), config.clone());
        Ok(config)
    }

    fn lock_cache(&self) -> std::sync::MutexGuard<'_, HashMap<HostName, Arc<ServerConfig>>> {
        self.cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn mint(&self, host: &HostName) -> Result<ServerConfig, TlsError> {
        let mut params = CertificateParams::new(vec![host.to_string()])?;
        params.distinguished_name = rcgen::DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::CommonName, host.as_str());
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        params.serial_number = Some(serial()?);
        validity(&mut params);
        let leaf = params.signed_by(&self.leaf_key, &self.ca, &self.ca_key)?;
        let chain = vec![leaf.der().clone(), self.ca.der().clone()];
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.leaf_key.serialize_der()));
        let mut config = ServerConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(chain, key)?;
        config.alpn_protocols = vec![ALPN_H2.to_vec(), ALPN_HTTP1.to_vec()];
        Ok(config)
    }
}

/// The proxy's TLS client configurations to upstreams: one offering HTTP/2 and HTTP/1.1, one
/// offering HTTP/1.1 only (used when the guest speaks HTTP/1.1, so upgrades keep working).
#[derive(Clone, Debug)]
pub(crate) struct UpstreamTls {
    /// `h2`, `http/1.1`.
    pub h2: Arc<ClientConfig>,
    /// `http/1.1`.
    pub http1: Arc<ClientConfig>,
}

impl UpstreamTls {
    /// Client configurations verifying upstream certificates against `roots`.
    pub fn new(roots: RootCertStore) -> Result<UpstreamTls, TlsError> {
        let roots = Arc::new(roots);
        let build = |alpn: Vec<Vec<u8>>| -> Result<Arc<ClientConfig>, TlsError> {
            let mut config = ClientConfig::builder_with_provider(provider())
                .with_safe_default_protocol_versions()?
                .with_root_certificates(roots.clone())
                .with_no_client_auth();
            config.alpn_protocols = alpn;
            Ok(Arc::new(config))
        };
        Ok(UpstreamTls {
            h2: build(vec![ALPN_H2.to_vec(), ALPN_HTTP1.to_vec()])?,
            http1: build(vec![ALPN_HTTP1.to_vec()])?,
        })
    }
}

/// True when ALPN negotiated HTTP/2.
pub(crate) fn is_h2(alpn: Option<&[u8]>) -> bool {
    alpn == Some(ALPN_H2)
}

/// The host's trust roots (rustls-native-certs: the system store, `SSL_CERT_FILE`, ...).
///
/// # Errors
/// [`TlsError::NoRoots`] when none can be loaded.
pub fn native_roots() -> Result<RootCertStore, TlsError> {
    let found = rustls_native_certs::load_native_certs();
    let mut roots = RootCertStore::empty();
    let (added, _ignored) = roots.add_parsable_certificates(found.certs);
    if added == 0 {
        let why = found
            .errors
            .first()
            .map_or_else(|| "none found".to_owned(), ToString::to_string);
        return Err(TlsError::NoRoots(why));
    }
    Ok(roots)
}

/// Parses PEM certificates into a root store (for tests and callers with their own CA).
///
/// # Errors
/// [`TlsError::NoRoots`] when the text has no usable certificate.
pub fn roots_from_pem(pem: &str) -> Result<RootCertStore, TlsError> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
        let cert = cert.map_err(|e| TlsError::NoRoots(e.to_string()))?;
        roots.add(cert)?;
    }
    if roots.is_empty() {
        return Err(TlsError::NoRoots(
            "no certificate in the PEM text".to_owned(),
        ));
    }
    Ok(roots)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn bytes_that_are_not_tls_are_refused() {
        let mut input: &[u8] = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";

        let err = read_client_hello(&mut input).await.unwrap_err();

        assert!(matches!(err, TlsError::NotTls(_)), "{err}");
    }

    #[tokio::test]
    async fn a_hello_larger_than_the_limit_is_cut() {
        let mut input = Vec::new();
        for index in 0..4 {
            input.extend_from_slice(&[0x16, 0x03, 0x01, 0x40, 0x00]);
            let mut payload = vec![0u8; 0x4000];
            if index == 0 {
                payload[..4].copy_from_slice(&[0x01, 0x00, 0xff, 0xf0]);
            }
            input.extend_from_slice(&payload);
        }
        let mut reader: &[u8] = &input;

        let err = read_client_hello(&mut reader).await.unwrap_err();

        assert!(matches!(err, TlsError::TooLarge), "{err}");
    }

    #[test]
    fn leaf_certificates_are_cached_per_host() {
        let authority = Authority::new().unwrap();
        let host = HostName::parse("api.test").unwrap();

        let first = authority.server_config(&host).unwrap();
        let second = authority.server_config(&host).unwrap();

        assert!(Arc::ptr_eq(&first, &second));
        assert!(authority.ca_pem().contains("BEGIN CERTIFICATE"));
    }
}
