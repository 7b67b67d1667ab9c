//! [`NetworkSpec`]: the user-facing description of a sandbox's network (CLI flags, TOML policy
//! files, the daemon's JSON), and its validation into a [`Policy`].

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::addr::CidrRule;
use super::host::shorten;
use super::presets::{preset, presets};
use super::rule::HostRule;
use super::{NetworkMode, Policy, PolicyError, SecretRule};
use crate::secrets::SecretValue;

/// Most rules of all kinds one policy may have (a bound on what a user or API client sends).
const MAX_RULES: usize = 4096;
/// Longest secret name, in bytes.
const MAX_SECRET_NAME: usize = 128;

/// Secret values by secret name, supplied by the caller (from the host's environment, a file,
/// or the daemon's configuration); never part of a [`NetworkSpec`].
pub type SecretValues = BTreeMap<String, SecretValue>;

/// A sandbox's network, as users write it. TOML policy file example:
///
/// ```toml
/// mode = "allowlist"
/// allow = ["@package-registries", "api.example.com", "*.cdn.example.com:8443"]
/// deny = ["uploads.example.com", "203.0.113.0/24"]
/// allow_cidr = ["127.0.0.1/32"]
///
/// [[rules]]
/// host = "api.github.com"
/// methods = ["GET", "HEAD"]
/// paths = ["/repos/"]
///
/// [[secrets]]
/// name = "GITHUB_TOKEN"
/// hosts = ["api.github.com"]
/// ```
///
/// Unknown keys are refused, here and in every nested table.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkSpec {
    /// The mode (`none`, `allow-all`, `allowlist`).
    #[serde(default)]
    pub mode: NetworkMode,
    /// Allow rules: `HOST[:PORT]` (`example.com`, `*.example.com`, `**.example.com`) or a
    /// preset `@name`.
    #[serde(default)]
    pub allow: Vec<String>,
    /// Deny rules: `HOST[:PORT]` or a CIDR rule; without a port they cover every port.
    #[serde(default)]
    pub deny: Vec<String>,
    /// Allow CIDR rules for raw IP addresses and for lifting the address block.
    #[serde(default)]
    pub allow_cidr: Vec<String>,
    /// Rules with methods and paths.
    #[serde(default)]
    pub rules: Vec<RuleSpec>,
    /// Secrets the proxy injects (values supplied apart).
    #[serde(default)]
    pub secrets: Vec<SecretSpec>,
}

/// Whether a [`RuleSpec`] allows or denies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RuleAction {
    /// Allow (the default).
    #[default]
    Allow,
    /// Deny.
    Deny,
}

/// A host rule with optional methods and path prefixes (which make the proxy intercept TLS for
/// the host).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleSpec {
    /// `HOST[:PORT]`.
    pub host: String,
    /// Allow or deny.
    #[serde(default)]
    pub action: RuleAction,
    /// Methods (`GET`, ...); empty means any.
    #[serde(default)]
    pub methods: Vec<String>,
    /// Path prefixes, each starting with `/`; empty means any.
    #[serde(default)]
    pub paths: Vec<String>,
}

/// A secret: its name (the guest environment variable that holds the placeholder) and the hosts
/// whose requests get the real value.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecretSpec {
    /// The name: `[A-Za-z_][A-Za-z0-9_]*`.
    pub name: String,
    /// `HOST[:PORT]` patterns.
    pub hosts: Vec<String>,
}

impl NetworkSpec {
    /// Parses a TOML policy file's text.
    ///
    /// # Errors
    /// [`PolicyError::File`] (with the parser's message naming the key and line) for bad TOML
    /// and unknown keys.
    pub fn from_toml_str(text: &str, path: &str) -> Result<NetworkSpec, PolicyError> {
        let spec: NetworkSpec = toml::from_str(text).map_err(|e| PolicyError::File {
            path: path.to_owned(),
            source: Box::new(e),
        })?;
        // `none` is also the default: only a file that says it and lists rules is contradictory.
        let says_none = toml::from_str::<toml::Table>(text)
            .ok()
            .and_then(|table| table.get("mode").cloned())
            .is_some_and(|mode| mode.as_str() == Some("none"));
        let has_rules = !spec.allow.is_empty()
            || !spec.deny.is_empty()
            || !spec.allow_cidr.is_empty()
            || !spec.rules.is_empty()
            || !spec.secrets.is_empty();
        if says_none && has_rules {
            return Err(PolicyError::RulesUnderNone {
                path: path.to_owned(),
            });
        }
        Ok(spec)
    }

    /// Reads and parses a TOML policy file.
    ///
    /// # Errors
    /// [`PolicyError::Read`] or [`PolicyError::File`].
    pub fn load(path: &Path) -> Result<NetworkSpec, PolicyError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| PolicyError::Read {
            path: shown.clone(),
            source,
        })?;
        NetworkSpec::from_toml_str(&text, &shown)
    }

    /// Adds `other`'s rules and secrets to this spec (command-line flags on top of a policy
    /// file); `other`'s mode wins unless it is `none`.
    pub fn merge(&mut self, other: NetworkSpec) {
        if other.mode != NetworkMode::None {
            self.mode = other.mode;
        }
        self.allow.extend(other.allow);
        self.deny.extend(other.deny);
        self.allow_cidr.extend(other.allow_cidr);
        self.rules.extend(other.rules);
        self.secrets.extend(other.secrets);
    }

    /// The secret names this spec refers to (for callers that look values up).
    pub fn secret_names(&self) -> impl Iterator<Item = &str> {
        self.secrets.iter().map(|s| s.name.as_str())
    }

    /// Validates the spec into a [`Policy`], taking each secret's value from `values`.
    ///
    /// # Errors
    /// The first bad rule, unknown preset, unknown secret, or a mode that does not fit the
    /// rules (rules under `none`; allow rules under `allow-all`).
    pub fn compile(&self, values: &SecretValues) -> Result<Policy, PolicyError> {
        self.check_mode()?;
        let total = self.allow.len() + self.deny.len() + self.allow_cidr.len() + self.rules.len();
        if total + self.secrets.len() > MAX_RULES {
            return Err(PolicyError::TooMany {
                rule: "policy".to_owned(),
            });
        }
        let mut policy = Policy {
            mode: self.mode,
            ..Policy::default()
        };
        for text in &self.allow {
            expand_allow(text, &mut policy.allow)?;
        }
        for text in &self.deny {
            match looks_like_cidr(text) {
                true => policy.deny_cidr.push(CidrRule::parse(text)?),
                false => policy.deny.push(HostRule::parse(text)?),
            }
        }
        for text in &self.allow_cidr {
            policy.allow_cidr.push(CidrRule::parse(text)?);
        }
        for rule in &self.rules {
            let parsed = HostRule::parse(&rule.host)?.restrict(&rule.methods, &rule.paths)?;
            match rule.action {
                RuleAction::Allow => policy.allow.push(parsed),
                RuleAction::Deny => policy.deny.push(parsed),
            }
        }
        policy.secrets = compile_secrets(&self.secrets, values)?;
        Ok(policy)
    }

    fn check_mode(&self) -> Result<(), PolicyError> {
        let has_rules = !(self.allow.is_empty()
            && self.deny.is_empty()
            && self.allow_cidr.is_empty()
            && self.rules.is_empty()
            && self.secrets.is_empty());
        let allow_rules = self.allow.len() + self.allow_cidr.len();
        let allow_rules = allow_rules
            + self
                .rules
                .iter()
                .filter(|r| {
                    r.action == RuleAction::Allow && r.methods.is_empty() && r.paths.is_empty()
                })
                .count();
        match self.mode {
            NetworkMode::None if has_rules => Err(PolicyError::Mode(
                "network rules or secrets are given but the network mode is none; \
                 choose allowlist or allow-all"
                    .to_owned(),
            )),
            NetworkMode::AllowAll if allow_rules > 0 => Err(PolicyError::Mode(
                "allow rules have no effect under allow-all (everything not denied is allowed); \
                 use allowlist, or keep only deny rules, rules with methods/paths and secrets"
                    .to_owned(),
            )),
            _ => Ok(()),
        }
    }
}

/// True when a deny entry is an address or network rather than a host pattern.
fn looks_like_cidr(text: &str) -> bool {
    text.starts_with('[')
        || text.contains('/')
        || text
            .split(':')
            .next()
            .is_some_and(|h| h.parse::<std::net::Ipv4Addr>().is_ok())
        || text.parse::<std::net::IpAddr>().is_ok()
}

/// Adds the rules of one allow entry (a rule or a `@preset`).
fn expand_allow(text: &str, out: &mut Vec<HostRule>) -> Result<(), PolicyError> {
    if !text.starts_with('@') {
        out.push(HostRule::parse(text)?);
        return Ok(());
    }
    let Some(found) = preset(text) else {
        let known: Vec<&str> = presets().iter().map(|p| p.name).collect();
        return Err(PolicyError::UnknownPreset {
            name: shorten(text),
            known: known.join(", "),
        });
    };
    for host in found.hosts {
        out.push(HostRule::parse(host)?);
    }
    Ok(())
}

/// Validates secret definitions and pairs them with their values.
fn compile_secrets(
    specs: &[SecretSpec],
    values: &SecretValues,
) -> Result<Vec<SecretRule>, PolicyError> {
    let mut seen = HashSet::new();
    let mut out = Vec::with_capacity(specs.len());
    for spec in specs {
        check_secret_name(&spec.name)?;
        if !seen.insert(spec.name.as_str()) {
            return Err(bad_secret(&spec.name, "defined twice"));
        }
        if spec.hosts.is_empty() {
            return Err(bad_secret(&spec.name, "names no host"));
        }
        let hosts = spec
            .hosts
            .iter()
            .map(|h| HostRule::parse(h))
            .collect::<Result<_, _>>()?;
        let value = values
            .get(&spec.name)
            .ok_or_else(|| PolicyError::UnknownSecret {
                name: spec.name.clone(),
            })?;
        out.push(SecretRule {
            name: spec.name.clone(),
            hosts,
            value: value.clone(),
        });
    }
    Ok(out)
}

fn bad_secret(name: &str, why: &str) -> PolicyError {
    PolicyError::BadSecret {
        name: shorten(name),
        why: why.to_owned(),
    }
}

/// Checks that a secret name is an environment variable name.
fn check_secret_name(name: &str) -> Result<(), PolicyError> {
    let first_ok = name
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    let rest_ok = name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !first_ok || !rest_ok || name.len() > MAX_SECRET_NAME {
        return Err(bad_secret(
            name,
            "not an environment variable name ([A-Za-z_][A-Za-z0-9_]*, at most 128 bytes)",
        ));
    }
    Ok(())
}
