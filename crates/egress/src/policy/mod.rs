//! The egress policy: which hosts, ports, addresses and requests a sandbox may reach.
//!
//! Pure logic, no I/O: [`spec::NetworkSpec`] (what users write, as flags, TOML or JSON) is
//! validated once into a [`Policy`], which the proxy asks three questions:
//! - [`Policy::check_target`]: may a connection to `host:port` be opened at all (the `CONNECT`
//!   of RFC 9110 §9.3.6, or the authority of an absolute-form request)?
//! - [`Policy::vet_addresses`]: are the addresses the name resolved to reachable (the blocked
//!   ranges of [`addr`], deny CIDR rules)? Only the [`VettedAddr`]s it returns are connected to.
//! - [`Policy::check_request`]: for requests the proxy sees (plain HTTP, intercepted TLS), do the
//!   method and path rules admit this one?
//!
//! Deny rules beat allow rules. A deny rule without a port covers every port; an allow rule
//! without a port covers 80 and 443.

pub mod addr;
pub mod host;
pub mod presets;
pub mod rule;
pub mod spec;

use std::fmt;
use std::net::{IpAddr, SocketAddr};

use serde::{Deserialize, Serialize};

use crate::secrets::SecretValue;
pub use addr::{blocked_range, canonical, BlockedRange, CidrRule, Ports};
pub use host::{HostName, HostPattern, Target, TargetHost};
pub use presets::{preset, presets, Preset};
pub use rule::{HostRule, NormalPath};
pub use spec::{NetworkSpec, RuleAction, RuleSpec, SecretSpec, SecretValues};

/// Errors in rules, policy files and secret definitions. Each message names the bad input.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// A host name or pattern is malformed.
    #[error("bad host {host:?}: {why}")]
    BadHost {
        /// The text, shortened.
        host: String,
        /// What is wrong.
        why: String,
    },
    /// A port is malformed or missing.
    #[error("bad port in {rule:?}: {why}")]
    BadPort {
        /// The rule text, shortened.
        rule: String,
        /// What is wrong.
        why: String,
    },
    /// `*.SUFFIX` or `**.SUFFIX` where SUFFIX is a public suffix.
    #[error(
        "rule {rule:?} is refused: {suffix:?} is a public suffix, so the wildcard would cover \
         sites of unrelated owners; name the domains instead"
    )]
    WildcardOverPublicSuffix {
        /// The rule text.
        rule: String,
        /// The public suffix under the wildcard.
        suffix: String,
    },
    /// A CIDR rule is malformed.
    #[error("bad CIDR rule {rule:?}: {why}")]
    BadCidr {
        /// The rule text, shortened.
        rule: String,
        /// What is wrong.
        why: String,
    },
    /// A method in a rule is not an HTTP method token.
    #[error("rule {rule:?}: {method:?} is not an HTTP method")]
    BadMethod {
        /// The rule.
        rule: String,
        /// The method text, shortened.
        method: String,
    },
    /// A path prefix in a rule (or a request path) is refused.
    #[error("{rule}: bad path {path:?}: {why}")]
    BadPath {
        /// The rule (or `request`).
        rule: String,
        /// The path, shortened.
        path: String,
        /// What is wrong.
        why: String,
    },
    /// A policy file says `mode = "none"` and still lists rules or secrets.
    #[error(
        "{path}: mode = \"none\" takes no allow, deny, allow_cidr, rules or secrets (drop them, \
         or say mode = \"allowlist\" or \"allow-all\")"
    )]
    RulesUnderNone {
        /// The policy file.
        path: String,
    },
    /// A rule lists too many methods or paths, or a policy has too many rules.
    #[error("{rule}: too many entries (at most 16 methods and 64 paths a rule, 4096 rules)")]
    TooMany {
        /// The rule, or `policy`.
        rule: String,
    },
    /// `@name` is not a preset.
    #[error("unknown preset {name:?}; the presets are: {known}")]
    UnknownPreset {
        /// The name, shortened.
        name: String,
        /// The known names, comma-separated.
        known: String,
    },
    /// A secret is named in the policy but no value was supplied for it.
    #[error("secret {name:?}: no value supplied for it")]
    UnknownSecret {
        /// The secret's name.
        name: String,
    },
    /// A secret's name or value is unusable.
    #[error("secret {name:?}: {why}")]
    BadSecret {
        /// The secret's name, shortened.
        name: String,
        /// What is wrong.
        why: String,
    },
    /// The mode and the rules do not fit together.
    #[error("{0}")]
    Mode(String),
    /// A policy file is not valid TOML or has unknown keys.
    #[error("policy file {path}: {source}")]
    File {
        /// The file.
        path: String,
        /// The parser's message, which names the key and line.
        #[source]
        source: Box<toml::de::Error>,
    },
    /// A policy file cannot be read.
    #[error("cannot read policy file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

/// How much network a sandbox has.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NetworkMode {
    /// No network: no proxy is started (the default).
    #[default]
    None,
    /// Any host and port, except deny rules and the blocked address ranges.
    AllowAll,
    /// Only what an allow rule names.
    Allowlist,
}

impl std::str::FromStr for NetworkMode {
    type Err = PolicyError;

    /// Parses `none`, `allow-all` or `allowlist` (the `--network` values).
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "none" => Ok(NetworkMode::None),
            "allow-all" => Ok(NetworkMode::AllowAll),
            "allowlist" => Ok(NetworkMode::Allowlist),
            other => Err(PolicyError::Mode(format!(
                "unknown network mode {:?}: use none, allow-all or allowlist",
                host::shorten(other)
            ))),
        }
    }
}

impl fmt::Display for NetworkMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            NetworkMode::None => "none",
            NetworkMode::AllowAll => "allow-all",
            NetworkMode::Allowlist => "allowlist",
        })
    }
}

/// Allowed or denied.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// Let through.
    Allow,
    /// Refused.
    Deny,
}

/// What the policy decided, which rule decided it, and why (for the 403 body and the log).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    /// Allowed or denied.
    pub verdict: Verdict,
    /// The rule that decided, as text, if one did.
    pub rule: Option<String>,
    /// Why, in words (`no allow rule matches`).
    pub reason: String,
}

impl Decision {
    /// An allow decision.
    pub fn allow(rule: Option<String>, reason: impl Into<String>) -> Decision {
        Decision {
            verdict: Verdict::Allow,
            rule,
            reason: reason.into(),
        }
    }

    /// A deny decision.
    pub fn deny(rule: Option<String>, reason: impl Into<String>) -> Decision {
        Decision {
            verdict: Verdict::Deny,
            rule,
            reason: reason.into(),
        }
    }

    /// True for [`Verdict::Allow`].
    pub fn is_allowed(&self) -> bool {
        self.verdict == Verdict::Allow
    }
}

/// A secret the proxy injects: its name, the hosts it is for, and its value.
#[derive(Clone, Debug)]
pub struct SecretRule {
    /// The name (an environment variable name).
    pub name: String,
    /// The hosts whose requests get the value (over intercepted TLS only).
    pub hosts: Vec<HostRule>,
    /// The value.
    pub value: SecretValue,
}

/// An address the policy let through: the only kind of address the proxy connects to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VettedAddr(SocketAddr);

impl VettedAddr {
    /// The socket address to connect to.
    pub fn socket_addr(self) -> SocketAddr {
        self.0
    }
}

/// A validated policy (see the module docs). Built by [`NetworkSpec::compile`].
#[derive(Clone, Debug, Default)]
pub struct Policy {
    mode: NetworkMode,
    allow: Vec<HostRule>,
    deny: Vec<HostRule>,
    allow_cidr: Vec<CidrRule>,
    deny_cidr: Vec<CidrRule>,
    secrets: Vec<SecretRule>,
}

/// A deny rule without a port covers every port.
fn deny_covers_host(rule: &HostRule, name: &HostName, port: u16) -> bool {
    rule.pattern.matches(name) && (rule.ports == Ports::Web || rule.ports.covers(port))
}

/// A deny CIDR rule without a port covers every port.
fn deny_covers_addr(rule: &CidrRule, addr: IpAddr, port: u16) -> bool {
    rule.net.contains(&canonical(addr)) && (rule.ports == Ports::Web || rule.ports.covers(port))
}

impl Policy {
    /// The network mode.
    pub fn mode(&self) -> NetworkMode {
        self.mode
    }

    /// The secrets, with their values.
    pub fn secrets(&self) -> &[SecretRule] {
        &self.secrets
    }

    /// May a connection to `target` be opened? (Before resolution; see the module docs.)
    pub fn check_target(&self, target: &Target) -> Decision {
        if self.mode == NetworkMode::None {
            return Decision::deny(None, "the sandbox has no network (mode none)");
        }
        match &target.host {
            TargetHost::Name(name) => self.check_name(name, target.port),
            TargetHost::Ip(addr) => self.check_ip(*addr, target.port),
        }
    }

    fn check_name(&self, name: &HostName, port: u16) -> Decision {
        let deny = self.deny.iter().filter(|r| !r.restricts_requests());
        if let Some(rule) = deny.into_iter().find(|r| deny_covers_host(r, name, port)) {
            return Decision::deny(Some(rule.to_string()), "a deny rule matches");
        }
        if self.mode == NetworkMode::AllowAll {
            return Decision::allow(None, "allow-all");
        }
        if let Some(rule) = self.allow.iter().find(|r| r.covers_host(name, port)) {
            return Decision::allow(Some(rule.to_string()), "an allow rule matches");
        }
        if self.allow.iter().any(|r| r.pattern.matches(name)) {
            return Decision::deny(
                None,
                format!(
                    "no rule for {name} allows port {port}: add {name}:{port} (a rule without a \
                     port allows only 80 and 443)"
                ),
            );
        }
        Decision::deny(None, "no allow rule matches")
    }

    fn check_ip(&self, addr: IpAddr, port: u16) -> Decision {
        if let Some(rule) = self
            .deny_cidr
            .iter()
            .find(|r| deny_covers_addr(r, addr, port))
        {
            return Decision::deny(Some(rule.to_string()), "a deny CIDR rule matches");
        }
        if self.mode == NetworkMode::AllowAll {
            return Decision::allow(None, "allow-all");
        }
        if let Some(rule) = self.allow_cidr.iter().find(|r| r.covers(addr, port)) {
            return Decision::allow(Some(rule.to_string()), "a CIDR rule matches");
        }
        if self
            .allow_cidr
            .iter()
            .any(|r| r.net.contains(&canonical(addr)))
        {
            return Decision::deny(
                None,
                format!("port {port} needs a CIDR rule with that port"),
            );
        }
        Decision::deny(
            None,
            "a raw IP address is allowed only by a CIDR rule (host rules match names only)",
        )
    }

    /// May this request (method and path seen by the proxy) go to `target`? Applies the
    /// host-level check first, then deny and allow rules with methods and paths.
    pub fn check_request(&self, target: &Target, method: &str, path: &NormalPath) -> Decision {
        let base = self.check_target(target);
        let TargetHost::Name(name) = &target.host else {
            return base;
        };
        if !base.is_allowed() {
            return base;
        }
        let port = target.port;
        let restricted_deny = self.deny.iter().filter(|r| r.restricts_requests());
        for rule in restricted_deny {
            if deny_covers_host(rule, name, port) && rule.covers_request(method, path) {
                return Decision::deny(Some(rule.to_string()), "a deny rule matches the request");
            }
        }
        if self.mode == NetworkMode::AllowAll {
            return base;
        }
        let mut candidates = self.allow.iter().filter(|r| r.covers_host(name, port));
        let first = candidates.clone().next();
        match candidates.find(|r| r.covers_request(method, path)) {
            Some(rule) => Decision::allow(Some(rule.to_string()), "an allow rule matches"),
            None => Decision::deny(
                first.map(ToString::to_string),
                format!(
                    "{method} {} is not allowed by the rule's methods and paths",
                    path.as_str()
                ),
            ),
        }
    }

    /// Checks every address `target`'s name resolved to and returns them all as
    /// [`VettedAddr`]s, or a deny decision if any of them is blocked or denied (a name that
    /// resolves to one internal address is refused whole).
    ///
    /// An address in a blocked range passes only when an allow CIDR rule covers it and lies
    /// inside that blocked range (so `127.0.0.1/32` lifts the loopback block for 127.0.0.1, but
    /// `0.0.0.0/0` lifts nothing). For a name, the CIDR rule's port does not matter: the name's
    /// rule decides the port.
    pub fn vet_addresses(
        &self,
        target: &Target,
        addrs: &[IpAddr],
    ) -> Result<Vec<VettedAddr>, Decision> {
        if addrs.is_empty() {
            return Err(Decision::deny(None, "the name has no addresses"));
        }
        let by_name = matches!(target.host, TargetHost::Name(_));
        addrs
            .iter()
            .map(|addr| self.vet_one(canonical(*addr), target.port, by_name))
            .collect()
    }

    fn vet_one(&self, addr: IpAddr, port: u16, by_name: bool) -> Result<VettedAddr, Decision> {
        if let Some(rule) = self
            .deny_cidr
            .iter()
            .find(|r| deny_covers_addr(r, addr, port))
        {
            return Err(Decision::deny(
                Some(rule.to_string()),
                format!("resolves to {addr}, which a deny CIDR rule matches"),
            ));
        }
        if let Some(blocked) = blocked_range(addr) {
            let lifts = |r: &&CidrRule| {
                (by_name || r.ports.covers(port))
                    && r.net.contains(&addr)
                    && r.net.prefix_len() >= blocked.net.prefix_len()
            };
            if !self.allow_cidr.iter().any(|r| lifts(&r)) {
                return Err(Decision::deny(
                    None,
                    format!(
                        "resolves to {addr}, a blocked address ({}); only a CIDR rule naming it \
                         allows it",
                        blocked.why
                    ),
                ));
            }
        }
        Ok(VettedAddr(SocketAddr::new(addr, port)))
    }

    /// True when connections to `name:port` must be intercepted: a secret is for that host, or
    /// a rule with methods or paths covers it.
    pub fn intercepts(&self, name: &HostName, port: u16) -> bool {
        let secret = self.secrets_for(name, port).next().is_some();
        let allow = self
            .allow
            .iter()
            .any(|r| r.restricts_requests() && r.covers_host(name, port));
        let deny = self
            .deny
            .iter()
            .any(|r| r.restricts_requests() && deny_covers_host(r, name, port));
        secret || allow || deny
    }

    /// True when some host may be intercepted: the policy has a secret, or a rule with methods
    /// or paths. Without either, no connection needs the host's trust roots.
    pub fn intercepts_some_host(&self) -> bool {
        !self.secrets.is_empty()
            || self
                .allow
                .iter()
                .chain(&self.deny)
                .any(HostRule::restricts_requests)
    }

    /// The secrets whose hosts cover `name:port`.
    pub fn secrets_for<'a>(
        &'a self,
        name: &'a HostName,
        port: u16,
    ) -> impl Iterator<Item = &'a SecretRule> {
        self.secrets
            .iter()
            .filter(move |s| s.hosts.iter().any(|h| h.covers_host(name, port)))
    }
}

#[cfg(test)]
mod tests;
