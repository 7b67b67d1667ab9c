//! A pod's network from its annotations: the egress policy model of `docs/network.md` (no
//! NIC; every connection leaves through the host's egress proxy, which decides it against the
//! pod's rules and logs it), configured by pod annotations as `bulkhead run`'s flags configure
//! it:
//!
//! | annotation | value | as |
//! |---|---|---|
//! | [`NETWORK_ANNOTATION`] | `none`, `allowlist` or `allow-all` | `--network` |
//! | [`ALLOW_ANNOTATION`] | comma-separated `HOST[:PORT]` or `@PRESET` | `--allow` |
//! | [`DENY_ANNOTATION`] | comma-separated `HOST[:PORT]` or CIDR | `--deny` |
//! | [`ALLOW_CIDR_ANNOTATION`] | comma-separated `CIDR[:PORT]` | `--allow-cidr` |
//!
//! Without any of them a pod has no network, as before. An allow rule without a mode means
//! `allowlist`; rules that contradict the mode, and malformed ones, fail the pod's create with
//! the policy's reason. The annotations are the pod's first container's (under Kubernetes the
//! pod sandbox's, passed on when the runtime's `pod_annotations` lists `bulkhead.io/*`).
//!
//! Containers get the proxy variables (`HTTP_PROXY`, `HTTPS_PROXY`, their lower-case forms,
//! `NO_PROXY`, `NODE_USE_ENV_PROXY`; [`proxy_env`]) unless their spec sets them. Not through
//! annotations: secrets (their values would have to come from the pod spec, which the guest's
//! owner writes) and method or path rules; without those the proxy never intercepts TLS, so
//! the containers need no CA of the proxy's in their own roots.

use std::collections::BTreeMap;

use bulkhead_egress::policy::{NetworkMode, NetworkSpec, PolicyError, SecretValues};
use bulkhead_protocol::ByteString;
use bulkhead_sandbox::egress::EgressSettings;
use oci_spec::runtime::Spec;

/// The pod's network mode (`none`, `allowlist`, `allow-all`).
pub const NETWORK_ANNOTATION: &str = "bulkhead.io/network";
/// Hosts the pod may reach: `HOST[:PORT]` (default ports 80 and 443) or `@PRESET`.
pub const ALLOW_ANNOTATION: &str = "bulkhead.io/allow";
/// Hosts or CIDRs the pod may not reach; deny rules beat allow rules.
pub const DENY_ANNOTATION: &str = "bulkhead.io/deny";
/// Raw IP ranges the pod may reach: `CIDR[:PORT]`.
pub const ALLOW_CIDR_ANNOTATION: &str = "bulkhead.io/allow-cidr";

/// A pod's network annotations that cannot be honoured.
#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    /// The rules or the mode are malformed or contradict each other.
    #[error("the pod's network annotations ({NETWORK_ANNOTATION}, {ALLOW_ANNOTATION}, {DENY_ANNOTATION}, {ALLOW_CIDR_ANNOTATION}): {0}")]
    Policy(#[from] PolicyError),
}

/// The egress proxy's settings for the network `spec`'s annotations ask for; `None` when they
/// ask for none (no annotation, or `none`).
///
/// # Errors
/// [`NetworkError::Policy`] for an unknown mode, a malformed rule or preset, rules under
/// `none`, allow rules under `allow-all`, or deny rules alone.
pub fn settings(spec: &Spec) -> Result<Option<EgressSettings>, NetworkError> {
    let annotations = spec.annotations().clone().unwrap_or_default();
    let Some(network) = network_spec(&annotations)? else {
        return Ok(None);
    };
    Ok(Some(EgressSettings {
        policy: network.compile(&SecretValues::new())?,
        hosts: BTreeMap::new(),
        log: None,
    }))
}

/// The network spec of `annotations`, `None` for no network.
fn network_spec(
    annotations: &std::collections::HashMap<String, String>,
) -> Result<Option<NetworkSpec>, PolicyError> {
    let list = |name: &str| -> Vec<String> {
        annotations
            .get(name)
            .map(|value| {
                value
                    .split(',')
                    .map(str::trim)
                    .filter(|entry| !entry.is_empty())
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut spec = NetworkSpec {
        allow: list(ALLOW_ANNOTATION),
        deny: list(DENY_ANNOTATION),
        allow_cidr: list(ALLOW_CIDR_ANNOTATION),
        ..NetworkSpec::default()
    };
    let allows = !spec.allow.is_empty() || !spec.allow_cidr.is_empty();
    spec.mode = match annotations.get(NETWORK_ANNOTATION) {
        Some(mode) => mode.trim().parse()?,
        None if allows => NetworkMode::Allowlist,
        None if !spec.deny.is_empty() => {
            return Err(PolicyError::Mode(
                "deny rules narrow a network, and there is none: add allow rules or \
                 bulkhead.io/network: allow-all"
                    .into(),
            ))
        }
        None => NetworkMode::None,
    };
    if spec.mode == NetworkMode::None && (allows || !spec.deny.is_empty()) {
        return Err(PolicyError::Mode(
            "bulkhead.io/network is none, which takes no rules".into(),
        ));
    }
    Ok((spec.mode != NetworkMode::None).then_some(spec))
}

/// The proxy variables of a pod's sandbox environment `egress_env`
/// (`bulkhead_sandbox::Sandbox::egress_env`): the `*_PROXY` names only, not the CA bundle's
/// (they name files of the VM's root, not of a container's).
pub fn proxy_env(egress_env: Vec<(String, String)>) -> Vec<(String, String)> {
    egress_env
        .into_iter()
        .filter(|(name, _)| name.to_ascii_uppercase().ends_with("_PROXY"))
        .collect()
}

/// Adds the `proxy` variables to a container process's environment `env` (`NAME=VALUE`
/// entries), except those it sets itself.
pub fn add_proxy_env(env: &mut Vec<ByteString>, proxy: &[(String, String)]) {
    for (name, value) in proxy {
        let prefix = format!("{name}=");
        if !env
            .iter()
            .any(|e| e.as_bytes().starts_with(prefix.as_bytes()))
        {
            env.push(format!("{prefix}{value}").into());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn annotations(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn no_annotation_or_none_means_no_network() {
        // Arrange
        let bare = annotations(&[("other", "x")]);
        let none = annotations(&[(NETWORK_ANNOTATION, "none")]);

        // Act / Assert
        assert!(network_spec(&bare).unwrap().is_none());
        assert!(network_spec(&none).unwrap().is_none());
    }

    #[test]
    fn allow_rules_without_a_mode_are_an_allowlist_with_every_entry() {
        // Arrange
        let pod = annotations(&[
            (ALLOW_ANNOTATION, "pypi.org, files.pythonhosted.org:443,"),
            (ALLOW_CIDR_ANNOTATION, "10.0.0.0/8:5432"),
            (DENY_ANNOTATION, "evil.pypi.org"),
        ]);

        // Act
        let spec = network_spec(&pod).unwrap().unwrap();

        // Assert
        assert_eq!(spec.mode, NetworkMode::Allowlist);
        assert_eq!(spec.allow, ["pypi.org", "files.pythonhosted.org:443"]);
        assert_eq!(spec.allow_cidr, ["10.0.0.0/8:5432"]);
        assert_eq!(spec.deny, ["evil.pypi.org"]);
        assert!(spec.compile(&SecretValues::new()).is_ok());
    }

    #[test]
    fn contradictions_and_malformed_rules_are_refused_with_a_reason() {
        // Arrange
        let cases = [
            (
                annotations(&[(NETWORK_ANNOTATION, "none"), (ALLOW_ANNOTATION, "a.test")]),
                "takes no rules",
            ),
            (annotations(&[(DENY_ANNOTATION, "a.test")]), "there is none"),
            (
                annotations(&[(NETWORK_ANNOTATION, "open")]),
                "unknown network mode",
            ),
        ];

        for (pod, reason) in cases {
            // Act
            let err = network_spec(&pod).expect_err(reason).to_string();

            // Assert
            assert!(err.contains(reason), "{err}");
        }
        let wildcard = annotations(&[(ALLOW_ANNOTATION, "*.com")]);
        let spec = network_spec(&wildcard).unwrap().unwrap();
        assert!(spec.compile(&SecretValues::new()).is_err());
    }

    #[test]
    fn containers_get_the_proxy_variables_but_not_the_ca_files_of_the_vm() {
        // Arrange
        let env = vec![
            ("HTTP_PROXY".to_owned(), "http://127.0.0.1:3128".to_owned()),
            ("no_proxy".to_owned(), "localhost".to_owned()),
            ("NODE_USE_ENV_PROXY".to_owned(), "1".to_owned()),
            ("SSL_CERT_FILE".to_owned(), "/etc/ssl/x.pem".to_owned()),
        ];

        // Act
        let kept = proxy_env(env);

        // Assert
        let names: Vec<&str> = kept.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["HTTP_PROXY", "no_proxy", "NODE_USE_ENV_PROXY"]);
    }

    #[test]
    fn a_containers_own_proxy_variable_wins() {
        // Arrange
        let mut env: Vec<ByteString> = vec!["PATH=/bin".into(), "HTTP_PROXY=http://mine".into()];
        let proxy = [
            ("HTTP_PROXY".to_owned(), "http://127.0.0.1:3128".to_owned()),
            ("HTTPS_PROXY".to_owned(), "http://127.0.0.1:3128".to_owned()),
        ];

        // Act
        add_proxy_env(&mut env, &proxy);

        // Assert
        let env: Vec<String> = env.iter().map(ToString::to_string).collect();
        assert_eq!(
            env,
            [
                "PATH=/bin",
                "HTTP_PROXY=http://mine",
                "HTTPS_PROXY=http://127.0.0.1:3128"
            ]
        );
    }
}
