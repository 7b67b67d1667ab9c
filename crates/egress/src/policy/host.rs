//! Host names, host patterns and request targets.
//!
//! Names are normalised once, on the way in, by [`HostName::parse`]: IDNA (UTS #46, the WHATWG URL
//! "domain to ASCII" algorithm) maps Unicode and upper case to lower-case A-labels (punycode), one
//! trailing dot (the DNS root, RFC 1034 §3.1) is dropped, and every label is checked. Patterns are
//! then compared label by label, never by string suffix: `**.example.com` does not match
//! `badexample.com`.

use std::fmt;
use std::net::{IpAddr, Ipv6Addr};

use super::PolicyError;

/// Longest DNS name in text form, without the trailing dot (RFC 1035 §2.3.4: 255 octets on the
/// wire, which is 253 characters of text).
pub const MAX_NAME_LEN: usize = 253;
/// Longest DNS label (RFC 1035 §2.3.4), in octets.
pub const MAX_LABEL_LEN: usize = 63;
/// Longest host text accepted at all (before normalisation), in bytes: guest text is bounded
/// before any work is done on it.
const MAX_INPUT_LEN: usize = 1024;

/// A normalised DNS host name: lower-case ASCII (A-labels), no trailing dot, labels of 1 to 63
/// characters from `a-z`, `0-9`, `-` and `_`, at most 253 characters, and not numeric in its
/// last label (so `127.1` or `0x7f000001`, which URL parsers read as IPv4 addresses, are never
/// taken for names).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HostName(String);

impl HostName {
    /// Normalises `text` (IDNA, lower case, one trailing dot dropped) and checks it.
    ///
    /// # Errors
    /// [`PolicyError::BadHost`] naming the text and what is wrong with it.
    ///
    /// ```
    /// use bulkhead_egress::policy::HostName;
    /// let name = HostName::parse("BÜCHER.Example.").unwrap();
    /// assert_eq!(name.as_str(), "xn--bcher-kva.example");
    /// ```
    pub fn parse(text: &str) -> Result<HostName, PolicyError> {
        let bad = |why: &str| PolicyError::BadHost {
            host: shorten(text),
            why: why.to_owned(),
        };
        if text.len() > MAX_INPUT_LEN {
            return Err(bad("too long"));
        }
        let trimmed = text.strip_suffix('.').unwrap_or(text);
        if trimmed.is_empty() {
            return Err(bad("empty name"));
        }
        let ascii = idna::domain_to_ascii_cow(trimmed.as_bytes(), idna::AsciiDenyList::URL)
            .map_err(|_| bad("not a valid international domain name (IDNA)"))?;
        check_labels(&ascii).map_err(bad)?;
        Ok(HostName(ascii.into_owned()))
    }

    /// The normalised name, e.g. `xn--bcher-kva.example`.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The labels from the most significant (the top-level domain) down.
    fn labels_rev(&self) -> impl Iterator<Item = &str> {
        self.0.rsplit('.')
    }

    /// Number of labels.
    fn label_count(&self) -> usize {
        self.0.split('.').count()
    }
}

impl fmt::Display for HostName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for HostName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostName({})", self.0)
    }
}

/// Checks the labels of an IDNA-normalised name.
fn check_labels(ascii: &str) -> Result<(), &'static str> {
    if ascii.is_empty() {
        return Err("empty name");
    }
    if ascii.len() > MAX_NAME_LEN {
        return Err("longer than 253 characters");
    }
    for label in ascii.split('.') {
        if label.is_empty() {
            return Err("empty label");
        }
        if label.len() > MAX_LABEL_LEN {
            return Err("a label is longer than 63 characters");
        }
        let ok = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_';
        if !label.chars().all(ok) {
            return Err("a label has a character other than a-z, 0-9, '-' and '_'");
        }
    }
    let last = ascii.rsplit('.').next().unwrap_or_default();
    if looks_numeric(last) {
        return Err("numeric last label: write an IP address in dotted form instead");
    }
    Ok(())
}

/// True for a label that the WHATWG URL IPv4 parser would read as a number (decimal, `0x` hex).
fn looks_numeric(label: &str) -> bool {
    let hex = label
        .strip_prefix("0x")
        .map(|h| h.chars().all(|c| c.is_ascii_hexdigit()));
    hex.unwrap_or(false) || label.chars().all(|c| c.is_ascii_digit())
}

/// Cuts guest- or user-supplied text for an error message (at most 80 characters).
pub(crate) fn shorten(text: &str) -> String {
    const MAX: usize = 80;
    let mut out: String = text.chars().take(MAX).collect();
    if text.chars().count() > MAX {
        out.push('…');
    }
    out.escape_debug().to_string()
}

/// Which names a host pattern covers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HostPattern {
    /// `example.com`: that name only.
    Exact(HostName),
    /// `*.example.com`: names with exactly one more label (`a.example.com`, not the apex, not
    /// `a.b.example.com`).
    OneLabel(HostName),
    /// `**.example.com`: names with one or more labels more (any depth), not the apex.
    AnyDepth(HostName),
}

impl HostPattern {
    /// Parses `example.com`, `*.example.com` or `**.example.com`.
    ///
    /// Refused: `*` and `**` alone, wildcards anywhere but in the first label, and a wildcard
    /// directly over a public suffix (`*.com`, `**.co.uk`, `*.github.io`: the Public Suffix
    /// List's ICANN and private sections, and any single label, which the list's default rule
    /// makes a suffix).
    ///
    /// # Errors
    /// [`PolicyError::BadHost`] or [`PolicyError::WildcardOverPublicSuffix`].
    pub fn parse(text: &str) -> Result<HostPattern, PolicyError> {
        let (wild, base) = if let Some(rest) = text.strip_prefix("**.") {
            (Some(true), rest)
        } else if let Some(rest) = text.strip_prefix("*.") {
            (Some(false), rest)
        } else {
            (None, text)
        };
        if base.contains('*') || text == "*" || text == "**" {
            return Err(PolicyError::BadHost {
                host: shorten(text),
                why: "'*' and '**' are allowed only as the whole first label of a longer name"
                    .to_owned(),
            });
        }
        let name = HostName::parse(base)?;
        let Some(any_depth) = wild else {
            return Ok(HostPattern::Exact(name));
        };
        if is_public_suffix(&name) {
            return Err(PolicyError::WildcardOverPublicSuffix {
                rule: shorten(text),
                suffix: name.to_string(),
            });
        }
        Ok(if any_depth {
            HostPattern::AnyDepth(name)
        } else {
            HostPattern::OneLabel(name)
        })
    }

    /// True when `name` is covered, comparing labels from the top-level domain down.
    pub fn matches(&self, name: &HostName) -> bool {
        let (base, extra_ok): (&HostName, fn(usize) -> bool) = match self {
            HostPattern::Exact(base) => (base, |extra| extra == 0),
            HostPattern::OneLabel(base) => (base, |extra| extra == 1),
            HostPattern::AnyDepth(base) => (base, |extra| extra >= 1),
        };
        let (have, want) = (name.label_count(), base.label_count());
        if have < want || !extra_ok(have - want) {
            return false;
        }
        name.labels_rev()
            .zip(base.labels_rev())
            .all(|(a, b)| a == b)
    }

    /// The name under the wildcard (the whole name for an exact pattern).
    pub fn base(&self) -> &HostName {
        match self {
            HostPattern::Exact(n) | HostPattern::OneLabel(n) | HostPattern::AnyDepth(n) => n,
        }
    }
}

impl fmt::Display for HostPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HostPattern::Exact(n) => write!(f, "{n}"),
            HostPattern::OneLabel(n) => write!(f, "*.{n}"),
            HostPattern::AnyDepth(n) => write!(f, "**.{n}"),
        }
    }
}

/// True when the whole of `name` is a public suffix (Mozilla's Public Suffix List, through the
/// `psl` crate; a single label is one by the list's default `*` rule).
fn is_public_suffix(name: &HostName) -> bool {
    match psl::suffix(name.as_str().as_bytes()) {
        Some(suffix) => suffix.trim().as_bytes() == name.as_str().as_bytes(),
        None => true,
    }
}

/// The host part of a request target: a DNS name or an IP address literal.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum TargetHost {
    /// A normalised DNS name.
    Name(HostName),
    /// An IPv4 address in dotted-decimal form or an IPv6 address (written `[...]` in an
    /// authority, RFC 3986 §3.2.2).
    Ip(IpAddr),
}

impl TargetHost {
    /// Parses the host part of an authority: `[v6]`, dotted IPv4, or a name.
    ///
    /// # Errors
    /// [`PolicyError::BadHost`].
    pub fn parse(text: &str) -> Result<TargetHost, PolicyError> {
        if let Some(inner) = text.strip_prefix('[') {
            let v6 = inner
                .strip_suffix(']')
                .and_then(|s| s.parse::<Ipv6Addr>().ok());
            return v6
                .map(|a| TargetHost::Ip(IpAddr::V6(a)))
                .ok_or_else(|| PolicyError::BadHost {
                    host: shorten(text),
                    why: "not an IPv6 address literal".to_owned(),
                });
        }
        match text.parse::<std::net::Ipv4Addr>() {
            Ok(v4) => Ok(TargetHost::Ip(IpAddr::V4(v4))),
            Err(_) => HostName::parse(text).map(TargetHost::Name),
        }
    }
}

impl fmt::Display for TargetHost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TargetHost::Name(n) => write!(f, "{n}"),
            TargetHost::Ip(IpAddr::V4(a)) => write!(f, "{a}"),
            TargetHost::Ip(IpAddr::V6(a)) => write!(f, "[{a}]"),
        }
    }
}

/// Where a request goes: host and TCP port.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Target {
    /// The host.
    pub host: TargetHost,
    /// The TCP port.
    pub port: u16,
}

impl Target {
    /// Parses `host:port`, `[v6]:port`, or (with `default_port`) a bare host.
    ///
    /// # Errors
    /// [`PolicyError::BadHost`] or [`PolicyError::BadPort`].
    pub fn parse(text: &str, default_port: Option<u16>) -> Result<Target, PolicyError> {
        let (host, port) = split_port(text)?;
        let port = match (port, default_port) {
            (Some(p), _) | (None, Some(p)) => p,
            (None, None) => {
                return Err(PolicyError::BadPort {
                    rule: shorten(text),
                    why: "a port is required".to_owned(),
                })
            }
        };
        Ok(Target {
            host: TargetHost::parse(host)?,
            port,
        })
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.host, self.port)
    }
}

/// Splits `host:port` / `[v6]:port` / `host` into the host text and the port, if any.
pub(crate) fn split_port(text: &str) -> Result<(&str, Option<u16>), PolicyError> {
    let bad_port = |why: &str| PolicyError::BadPort {
        rule: shorten(text),
        why: why.to_owned(),
    };
    let (host, port) = if text.starts_with('[') {
        match text.find(']') {
            Some(end) if end + 1 == text.len() => (text, None),
            Some(end) => match text[end + 1..].strip_prefix(':') {
                Some(p) => (&text[..=end], Some(p)),
                None => return Err(bad_port("unexpected text after ']'")),
            },
            None => return Err(bad_port("'[' without ']'")),
        }
    } else {
        match text.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (text, None),
        }
    };
    let port = match port {
        None => None,
        Some(p) => Some(parse_port(p).ok_or_else(|| bad_port("not a port from 1 to 65535"))?),
    };
    Ok((host, port))
}

/// Parses a TCP port: decimal, 1 to 65535.
fn parse_port(text: &str) -> Option<u16> {
    if text.is_empty() || text.len() > 5 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse::<u16>().ok().filter(|p| *p != 0)
}
