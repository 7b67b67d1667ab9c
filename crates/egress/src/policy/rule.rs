//! Host rules (`HOST[:PORT]` with optional methods and path prefixes) and request paths.

use std::fmt;

use super::addr::Ports;
use super::host::{shorten, split_port, HostName, HostPattern};
use super::PolicyError;

/// Most methods one rule may list.
const MAX_METHODS: usize = 16;
/// Most path prefixes one rule may list.
const MAX_PATHS: usize = 64;
/// Longest path prefix in a rule, in bytes.
const MAX_PATH_LEN: usize = 1024;

/// One host rule: a pattern, its ports, and optional request restrictions.
///
/// A rule with methods or path prefixes can only be applied to requests the proxy sees, so it
/// makes the proxy intercept TLS for the hosts it covers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostRule {
    /// Which names.
    pub pattern: HostPattern,
    /// Which ports.
    pub ports: Ports,
    /// Allowed (or, in a deny rule, denied) request methods, upper case (RFC 9110 §9: methods
    /// are case-sensitive); empty means any.
    pub methods: Vec<String>,
    /// Path prefixes, each matched on a segment boundary (`/repos` covers `/repos` and
    /// `/repos/x`, not `/repository`); empty means any.
    pub paths: Vec<String>,
}

impl HostRule {
    /// Parses `HOST[:PORT]` with no request restrictions.
    ///
    /// # Errors
    /// [`PolicyError`] naming the rule.
    pub fn parse(text: &str) -> Result<HostRule, PolicyError> {
        let (host, port) = split_port(text)?;
        if host.starts_with('[') || host.parse::<std::net::IpAddr>().is_ok() {
            return Err(PolicyError::BadHost {
                host: shorten(text),
                why: "an IP address is not a host rule: use a CIDR rule (allow_cidr)".to_owned(),
            });
        }
        Ok(HostRule {
            pattern: HostPattern::parse(host)?,
            ports: port.map_or(Ports::Web, Ports::One),
            methods: Vec::new(),
            paths: Vec::new(),
        })
    }

    /// Adds request restrictions to a parsed rule.
    ///
    /// # Errors
    /// [`PolicyError::BadMethod`] or [`PolicyError::BadPath`].
    pub fn restrict(mut self, methods: &[String], paths: &[String]) -> Result<Self, PolicyError> {
        let rule = self.to_string();
        if methods.len() > MAX_METHODS || paths.len() > MAX_PATHS {
            return Err(PolicyError::TooMany { rule });
        }
        for method in methods {
            self.methods.push(check_method(&rule, method)?);
        }
        for path in paths {
            self.paths.push(check_path_prefix(&rule, path)?);
        }
        Ok(self)
    }

    /// True when the rule restricts methods or paths.
    pub fn restricts_requests(&self) -> bool {
        !self.methods.is_empty() || !self.paths.is_empty()
    }

    /// True when the rule covers `name` on `port`, whatever the request.
    pub fn covers_host(&self, name: &HostName, port: u16) -> bool {
        self.ports.covers(port) && self.pattern.matches(name)
    }

    /// True when the rule's request restrictions admit `method` and the normalised `path`.
    pub fn covers_request(&self, method: &str, path: &NormalPath) -> bool {
        let method_ok = self.methods.is_empty() || self.methods.iter().any(|m| m == method);
        let path_ok = self.paths.is_empty() || self.paths.iter().any(|p| path.under(p));
        method_ok && path_ok
    }
}

impl fmt::Display for HostRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.pattern, self.ports)?;
        if !self.methods.is_empty() {
            write!(f, " methods={}", self.methods.join(","))?;
        }
        if !self.paths.is_empty() {
            write!(f, " paths={}", self.paths.join(","))?;
        }
        Ok(())
    }
}

/// Checks a method name (an RFC 9110 §5.6.2 token) and returns it.
fn check_method(rule: &str, method: &str) -> Result<String, PolicyError> {
    let tchar = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
    if method.is_empty() || method.len() > 32 || !method.bytes().all(tchar) {
        return Err(PolicyError::BadMethod {
            rule: rule.to_owned(),
            method: shorten(method),
        });
    }
    Ok(method.to_owned())
}

/// Checks a path prefix: absolute, no dot segments, no percent-encoding, no query.
fn check_path_prefix(rule: &str, path: &str) -> Result<String, PolicyError> {
    let bad = |why: &str| PolicyError::BadPath {
        rule: rule.to_owned(),
        path: shorten(path),
        why: why.to_owned(),
    };
    if !path.starts_with('/') || path.len() > MAX_PATH_LEN {
        return Err(bad("must start with '/' and be at most 1024 bytes"));
    }
    if path.contains(['?', '#', '%', '\\']) || path.chars().any(char::is_control) {
        return Err(bad("no '?', '#', '%', '\\' or control characters"));
    }
    if path.split('/').any(|s| s == "." || s == "..") {
        return Err(bad("no '.' or '..' segments"));
    }
    Ok(path.to_owned())
}

/// A request path in the form rules are matched against: query dropped, percent-encoded
/// unreserved characters decoded (RFC 3986 §6.2.2.2), runs of `/` collapsed; refused when it
/// has dot segments or an encoded `/`, `\`, `.` sequence that servers may read differently.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NormalPath(String);

impl NormalPath {
    /// Normalises the path of a request target (origin form, `/a/b?q`).
    ///
    /// # Errors
    /// [`PolicyError::BadPath`] for a path the proxy will not judge (the request is refused).
    pub fn parse(path_and_query: &str) -> Result<NormalPath, PolicyError> {
        let bad = |why: &str| PolicyError::BadPath {
            rule: "request".to_owned(),
            path: shorten(path_and_query),
            why: why.to_owned(),
        };
        let path = path_and_query.split(['?', '#']).next().unwrap_or_default();
        if path.is_empty() {
            return Ok(NormalPath("/".to_owned()));
        }
        if !path.starts_with('/') || path.contains('\\') {
            return Err(bad("not an absolute path"));
        }
        let decoded = decode_unreserved(path).ok_or_else(|| bad("bad percent-encoding"))?;
        let mut out = String::with_capacity(decoded.len());
        for segment in decoded.split('/').filter(|s| !s.is_empty()) {
            if segment == "." || segment == ".." {
                return Err(bad("dot segments are refused"));
            }
            out.push('/');
            out.push_str(segment);
        }
        if out.is_empty() || decoded.ends_with('/') {
            out.push('/');
        }
        Ok(NormalPath(out))
    }

    /// The normalised path.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// True when this path is `prefix` or below it on a segment boundary.
    pub fn under(&self, prefix: &str) -> bool {
        let prefix_norm = prefix.trim_end_matches('/');
        match self.0.strip_prefix(prefix_norm) {
            Some(rest) => rest.is_empty() || rest.starts_with('/') || prefix_norm.is_empty(),
            None => false,
        }
    }
}

/// Decodes `%XX` escapes of unreserved characters; keeps other escapes (upper-cased); refuses
/// escapes of `/`, `\` and `.`, which servers differ on, and malformed escapes.
fn decode_unreserved(path: &str) -> Option<String> {
    let bytes = path.as_bytes();
    let mut out = String::with_capacity(path.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'%' {
            if !bytes[i].is_ascii() {
                return None;
            }
            out.push(char::from(bytes[i]));
            i += 1;
            continue;
        }
        let hex = path.get(i + 1..i + 3)?;
        let value = u8::from_str_radix(hex, 16).ok()?;
        match value {
            b'/' | b'\\' | b'.' => return None,
            v if v.is_ascii_alphanumeric() || v == b'-' || v == b'_' || v == b'~' => {
                out.push(char::from(v));
            }
            _ => {
                out.push('%');
                out.push_str(&hex.to_ascii_uppercase());
            }
        }
        i += 3;
    }
    Some(out)
}
