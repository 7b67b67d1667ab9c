//! Secrets: values kept on the host, placeholders in the guest.
//!
//! The guest's environment holds `NAME=bulkhead-placeholder-NAME-<32 hex>` (random per proxy,
//! from the OS's random source). On an intercepted TLS connection to one of the secret's hosts,
//! the proxy replaces the placeholder with the value in request header values (also inside an
//! `Authorization: Basic` credential, RFC 7617 §2, which git and pip build from a URL's
//! user:password). A placeholder in a request to any other host, or over plain HTTP, makes the
//! proxy refuse that request. The value is replaced by the placeholder in the response headers
//! passed back. Bodies are neither rewritten nor scanned.

use std::fmt;
use std::sync::Arc;

use base64::Engine as _;
use hyper::header::{HeaderMap, HeaderValue, AUTHORIZATION};
use zeroize::Zeroizing;

use crate::policy::{HostName, HostRule, Policy};

/// Longest secret value, in bytes (it travels in one header).
pub const MAX_SECRET_LEN: usize = 8192;

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// The value is empty, too long, or has bytes a header value cannot hold.
    #[error("bad secret value: {0}")]
    BadValue(&'static str),
    /// The OS's random source failed.
    #[error("cannot make a placeholder: the OS random source failed: {0}")]
    Random(String),
}

/// A secret's value: zeroed in memory when the last copy is dropped, never printed.
#[derive(Clone)]
pub struct SecretValue(Arc<Zeroizing<String>>);

impl SecretValue {
    /// Wraps a value: 1 to 8192 bytes, visible ASCII, space and tab only (RFC 9110 §5.5 field
    /// values, without obsolete text), no leading or trailing whitespace.
    ///
    /// # Errors
    /// [`SecretError::BadValue`].
    pub fn new(value: impl Into<String>) -> Result<SecretValue, SecretError> {
        let value = Zeroizing::new(value.into());
        if value.is_empty() || value.len() > MAX_SECRET_LEN {
            return Err(SecretError::BadValue("must be 1 to 8192 bytes"));
        }
        let ok = |b: u8| (0x20..0x7f).contains(&b) || b == b'\t';
        if !value.bytes().all(ok) {
            return Err(SecretError::BadValue(
                "only visible ASCII, space and tab (no newline: it goes into a header)",
            ));
        }
        if value.trim() != value.as_str() {
            return Err(SecretError::BadValue("leading or trailing whitespace"));
        }
        Ok(SecretValue(Arc::new(value)))
    }

    /// The value itself.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for SecretValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SecretValue(<redacted>)")
    }
}

/// One secret as the proxy holds it.
#[derive(Debug)]
struct Entry {
    name: String,
    placeholder: String,
    value: SecretValue,
    hosts: Vec<HostRule>,
}

/// What [`Injector::inject`] found wrong.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Misplaced {
    /// The secret whose placeholder was seen.
    pub name: String,
    /// Where it was seen.
    pub why: &'static str,
}

/// The proxy's secrets and their placeholders.
#[derive(Debug)]
pub(crate) struct Injector {
    entries: Vec<Entry>,
}

impl Injector {
    /// Makes a random placeholder for each of the policy's secrets.
    pub fn new(policy: &Policy) -> Result<Injector, SecretError> {
        let mut entries = Vec::new();
        for secret in policy.secrets() {
            let mut bytes = [0u8; 16];
            getrandom::fill(&mut bytes).map_err(|e| SecretError::Random(e.to_string()))?;
            let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
            entries.push(Entry {
                name: secret.name.clone(),
                placeholder: format!("bulkhead-placeholder-{}-{hex}", secret.name),
                value: secret.value.clone(),
                hosts: secret.hosts.clone(),
            });
        }
        Ok(Injector { entries })
    }

    /// `(NAME, placeholder)` for each secret.
    pub fn placeholders(&self) -> Vec<(String, String)> {
        self.entries
            .iter()
            .map(|e| (e.name.clone(), e.placeholder.clone()))
            .collect()
    }

    /// The first secret whose placeholder appears in the target or the headers (for plain HTTP
    /// requests, where nothing is injected and any placeholder refuses the request).
    pub fn find_any(&self, uri: &str, headers: &HeaderMap) -> Option<Misplaced> {
        self.entries
            .iter()
            .find(|e| uri.contains(&e.placeholder) || headers_contain(headers, &e.placeholder))
            .map(|e| Misplaced {
                name: e.name.clone(),
                why: "over plain HTTP (secrets go over intercepted TLS only)",
            })
    }

    /// For an intercepted request to `host:port`: refuses it if it carries the placeholder of
    /// a secret that is not for this host (in the target or a header), then replaces the
    /// placeholders of this host's secrets in header values. Returns the names injected.
    pub fn inject(
        &self,
        host: &HostName,
        port: u16,
        uri: &str,
        headers: &mut HeaderMap,
    ) -> Result<Vec<String>, Misplaced> {
        let (mine, others): (Vec<&Entry>, Vec<&Entry>) = self
            .entries
            .iter()
            .partition(|e| e.hosts.iter().any(|h| h.covers_host(host, port)));
        let foreign = others
            .iter()
            .find(|e| uri.contains(&e.placeholder) || headers_contain(headers, &e.placeholder));
        if let Some(e) = foreign {
            return Err(Misplaced {
                name: e.name.clone(),
                why: "in a request to a host the secret is not for",
            });
        }
        if let Some(e) = mine.iter().find(|e| uri.contains(&e.placeholder)) {
            return Err(Misplaced {
                name: e.name.clone(),
                why: "in the request target (it is replaced in headers only)",
            });
        }
        let mut injected = Vec::new();
        for entry in mine {
            if replace_in_headers(headers, &entry.placeholder, entry.value.expose()) {
                injected.push(entry.name.clone());
            }
        }
        Ok(injected)
    }

    /// Replaces every secret value in response header values by its placeholder.
    pub fn scrub_response(&self, headers: &mut HeaderMap) {
        for entry in &self.entries {
            replace_in_headers(headers, entry.value.expose(), &entry.placeholder);
        }
    }
}

/// True when a header value (or a decoded Basic credential) contains `needle`.
fn headers_contain(headers: &HeaderMap, needle: &str) -> bool {
    headers.iter().any(|(name, value)| {
        let raw = contains(value.as_bytes(), needle.as_bytes());
        raw || (name == AUTHORIZATION
            && basic_credential(value).is_some_and(|c| c.contains(needle)))
    })
}

/// Replaces `from` by `to` in every header value (and inside Basic credentials); true when
/// something was replaced. Values that would become invalid are dropped.
fn replace_in_headers(headers: &mut HeaderMap, from: &str, to: &str) -> bool {
    let mut changed = false;
    for (name, value) in headers.iter_mut() {
        let replaced =
            if name == AUTHORIZATION && basic_credential(value).is_some_and(|c| c.contains(from)) {
                let credential = Zeroizing::new(
                    basic_credential(value)
                        .unwrap_or_default()
                        .replace(from, to),
                );
                let encoded = Zeroizing::new(
                    base64::engine::general_purpose::STANDARD.encode(credential.as_bytes()),
                );
                Some(Zeroizing::new(format!("Basic {}", encoded.as_str())))
            } else if contains(value.as_bytes(), from.as_bytes()) {
                let text = Zeroizing::new(String::from_utf8_lossy(value.as_bytes()).into_owned());
                Some(Zeroizing::new(text.replace(from, to)))
            } else {
                None
            };
        if let Some(new) = replaced {
            let mut header =
                HeaderValue::from_str(&new).unwrap_or_else(|_| HeaderValue::from_static(""));
            header.set_sensitive(true);
            *value = header;
            changed = true;
        }
    }
    changed
}

/// The decoded `user:password` of an `Authorization: Basic ...` value (RFC 7617 §2).
fn basic_credential(value: &HeaderValue) -> Option<Zeroizing<String>> {
    let text = value.to_str().ok()?;
    let (scheme, token) = text.trim().split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let bytes = Zeroizing::new(
        base64::engine::general_purpose::STANDARD
            .decode(token.trim())
            .ok()?,
    );
    Some(Zeroizing::new(String::from_utf8(bytes.to_vec()).ok()?))
}

/// Byte-substring search (header values are short: at most the proxy's header limit).
fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && haystack.windows(needle.len()).any(|w| w == needle)
}

#[cfg(test)]
mod tests;
