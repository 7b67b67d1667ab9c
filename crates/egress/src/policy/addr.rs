//! IP addresses: the blocked ranges and CIDR rules.
//!
//! A connection never goes to a blocked address unless a CIDR rule lifts the block for it (see
//! [`blocked_range`] and [`super::Policy::vet_addresses`]). IPv6 forms that carry an IPv4 address
//! (IPv4-mapped `::ffff:a.b.c.d` and IPv4-compatible `::a.b.c.d`, RFC 4291 §2.5.5; NAT64
//! `64:ff9b::/96`, RFC 6052; 6to4 `2002::/16`, RFC 3056) are judged by the IPv4 address inside.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net};

use super::host::shorten;
use super::PolicyError;

/// The IPv4 ranges that are blocked unless a CIDR rule names the address, with why.
const BLOCKED_V4: &[(&str, &str)] = &[
    ("0.0.0.0/8", "'this network' (RFC 791)"),
    ("10.0.0.0/8", "private network (RFC 1918)"),
    ("100.64.0.0/10", "carrier-grade NAT (RFC 6598)"),
    ("127.0.0.0/8", "loopback (RFC 1122)"),
    ("169.254.0.0/16", "link-local, cloud metadata (RFC 3927)"),
    ("172.16.0.0/12", "private network (RFC 1918)"),
    ("192.0.0.0/24", "IETF protocol assignments (RFC 6890)"),
    ("192.0.2.0/24", "documentation (RFC 5737)"),
    ("192.88.99.0/24", "6to4 relay anycast (RFC 7526)"),
    ("192.168.0.0/16", "private network (RFC 1918)"),
    ("198.18.0.0/15", "benchmarking (RFC 2544)"),
    ("198.51.100.0/24", "documentation (RFC 5737)"),
    ("203.0.113.0/24", "documentation (RFC 5737)"),
    ("224.0.0.0/4", "multicast (RFC 5771)"),
    ("240.0.0.0/4", "reserved, broadcast (RFC 1112, RFC 919)"),
];

/// The IPv6 ranges that are blocked unless a CIDR rule names the address, with why.
const BLOCKED_V6: &[(&str, &str)] = &[
    ("::/128", "unspecified (RFC 4291)"),
    ("::1/128", "loopback (RFC 4291)"),
    ("100::/64", "discard-only (RFC 6666)"),
    ("2001:db8::/32", "documentation (RFC 3849)"),
    ("fc00::/7", "unique local (RFC 4193)"),
    ("fe80::/10", "link-local (RFC 4291)"),
    ("fec0::/10", "site-local, deprecated (RFC 3879)"),
    ("ff00::/8", "multicast (RFC 4291)"),
];

/// A blocked range an address falls in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockedRange {
    /// The range.
    pub net: IpNet,
    /// What it is, with its RFC.
    pub why: &'static str,
}

/// The blocked range that contains `addr` (judged by [`canonical`] form), if any.
pub fn blocked_range(addr: IpAddr) -> Option<BlockedRange> {
    let addr = canonical(addr);
    let table = match addr {
        IpAddr::V4(_) => BLOCKED_V4,
        IpAddr::V6(_) => BLOCKED_V6,
    };
    table.iter().find_map(|(net, why)| {
        let net: IpNet = net.parse().ok()?;
        net.contains(&addr).then_some(BlockedRange { net, why })
    })
}

/// The address a connection is judged by: the IPv4 address inside an IPv4-mapped or
/// IPv4-compatible IPv6 address (except `::` and `::1`), a NAT64 (`64:ff9b::/96`) or a 6to4
/// (`2002::/16`) address; any other address as it is.
pub fn canonical(addr: IpAddr) -> IpAddr {
    match addr {
        IpAddr::V4(_) => addr,
        IpAddr::V6(v6) => embedded_v4(v6).map_or(addr, IpAddr::V4),
    }
}

/// The IPv4 address an IPv6 address carries, for the forms that carry one.
fn embedded_v4(v6: Ipv6Addr) -> Option<Ipv4Addr> {
    let s = v6.segments();
    let low = Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
    if let Some(mapped) = v6.to_ipv4_mapped() {
        return Some(mapped);
    }
    let compatible = s[..6].iter().all(|x| *x == 0) && !(s[6] == 0 && s[7] <= 1);
    let nat64 = s[0] == 0x64 && s[1] == 0xff9b && s[2..6].iter().all(|x| *x == 0);
    if compatible || nat64 {
        return Some(low);
    }
    if s[0] == 0x2002 {
        return Some(Ipv4Addr::new(
            (s[1] >> 8) as u8,
            s[1] as u8,
            (s[2] >> 8) as u8,
            s[2] as u8,
        ));
    }
    None
}

/// Which ports a rule covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ports {
    /// No port written: 80 and 443.
    Web,
    /// `:PORT`: that port only.
    One(u16),
}

impl Ports {
    /// True when `port` is covered.
    pub fn covers(self, port: u16) -> bool {
        match self {
            Ports::Web => port == 80 || port == 443,
            Ports::One(p) => p == port,
        }
    }
}

impl fmt::Display for Ports {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Ports::Web => Ok(()),
            Ports::One(p) => write!(f, ":{p}"),
        }
    }
}

/// A CIDR rule: `10.1.0.0/16`, `127.0.0.1/32:8080`, `[fd00::/8]:5432` or a bare address
/// (`127.0.0.1`, a /32 or /128). Without a port it covers 80 and 443.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CidrRule {
    /// The network, in canonical form (an IPv4-mapped IPv6 network is stored as IPv4).
    pub net: IpNet,
    /// The ports.
    pub ports: Ports,
}

impl CidrRule {
    /// Parses a CIDR rule.
    ///
    /// # Errors
    /// [`PolicyError::BadCidr`] naming the rule.
    pub fn parse(text: &str) -> Result<CidrRule, PolicyError> {
        let bad = |why: &str| PolicyError::BadCidr {
            rule: shorten(text),
            why: why.to_owned(),
        };
        let (net_text, port) = split_cidr_port(text).ok_or_else(|| bad("bad port"))?;
        let net = parse_net(net_text).ok_or_else(|| bad("not an address or address/prefix"))?;
        if net.network() != net.addr() {
            return Err(bad(
                "host bits set: write the network address, e.g. 10.0.0.0/8",
            ));
        }
        let ports = port.map_or(Ports::Web, Ports::One);
        Ok(CidrRule {
            net: canonical_net(net),
            ports,
        })
    }

    /// True when the rule covers `addr` (canonical form) on `port`.
    pub fn covers(&self, addr: IpAddr, port: u16) -> bool {
        self.ports.covers(port) && self.net.contains(&canonical(addr))
    }
}

impl fmt::Display for CidrRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.net, self.ports) {
            (IpNet::V6(n), Ports::One(p)) => write!(f, "[{n}]:{p}"),
            (n, ports) => write!(f, "{n}{ports}"),
        }
    }
}

/// Splits `net[:port]` / `[v6net]:port` into the network text and its port.
fn split_cidr_port(text: &str) -> Option<(&str, Option<u16>)> {
    if let Some(inner) = text.strip_prefix('[') {
        let (net, rest) = inner.split_once(']')?;
        let port = match rest {
            "" => None,
            p => Some(
                p.strip_prefix(':')?
                    .parse::<u16>()
                    .ok()
                    .filter(|p| *p != 0)?,
            ),
        };
        return Some((net, port));
    }
    if text.matches(':').count() == 1 {
        let (net, p) = text.split_once(':')?;
        return Some((net, Some(p.parse::<u16>().ok().filter(|p| *p != 0)?)));
    }
    Some((text, None))
}

/// Parses `addr/prefix` or a bare address.
fn parse_net(text: &str) -> Option<IpNet> {
    if text.contains('/') {
        return text.parse::<IpNet>().ok();
    }
    text.parse::<IpAddr>().ok().map(IpNet::from)
}

/// An IPv4-mapped IPv6 network (`::ffff:0:0/96` and longer) as the IPv4 network it names.
fn canonical_net(net: IpNet) -> IpNet {
    let IpNet::V6(v6) = net else { return net };
    match (v6.addr().to_ipv4_mapped(), v6.prefix_len()) {
        (Some(v4), len) if len >= 96 => Ipv4Net::new(v4, len - 96).map_or(net, IpNet::V4),
        _ => net,
    }
}
