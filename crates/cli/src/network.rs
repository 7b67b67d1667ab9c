//! The network flags of `bulkhead run` and `bulkhead create` (`docs/network.md`), and
//! `bulkhead network presets`.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use bulkhead_egress::policy::{presets, NetworkMode, NetworkSpec, SecretSpec, SecretValues};
use bulkhead_egress::secrets::SecretValue;

/// Names pinned to addresses (`--add-host`), as the spec's `extra_hosts`.
pub type PinnedHosts = BTreeMap<String, Vec<IpAddr>>;

/// Network flags shared by `run` and `create`.
#[derive(Debug, Default, clap::Args)]
pub struct NetworkArgs {
    /// The sandbox's network: `none` (no way out at all), `allowlist` (only what --allow and
    /// --allow-cidr name) or `allow-all` (any public address); every connection leaves through
    /// the host's egress proxy [default: allowlist when a rule, secret or policy is given, else
    /// none].
    #[arg(long, value_name = "MODE")]
    network: Option<NetworkMode>,
    /// Allow HOST (`example.com`, `*.example.com` for one more label, `**.example.com` for any
    /// depth) on PORT (default 80 and 443), or a preset `@NAME` (`bulkhead network presets`)
    /// (repeatable).
    #[arg(long, value_name = "HOST[:PORT]")]
    allow: Vec<String>,
    /// Deny HOST (any port unless one is given) or a CIDR; deny rules beat allow rules
    /// (repeatable).
    #[arg(long, value_name = "HOST[:PORT]")]
    deny: Vec<String>,
    /// Allow raw IP addresses in CIDR (also lifts the block on private, loopback and
    /// link-local addresses inside it) (repeatable).
    #[arg(long = "allow-cidr", value_name = "CIDR[:PORT]")]
    allow_cidr: Vec<String>,
    /// A secret the proxy injects into request headers for HOSTs only, in place of a
    /// placeholder the guest sees as $NAME; the value stays on the host (repeatable).
    #[arg(long, value_name = "NAME=HOST[,HOST...]")]
    secret: Vec<String>,
    /// A TOML policy file: the same rules, plus per-rule methods and paths.
    #[arg(long, value_name = "FILE")]
    policy: Option<PathBuf>,
    /// Resolve NAME to IP in the egress proxy instead of asking the host's resolver (like
    /// `docker run --add-host`; the address is still checked against the blocked ranges)
    /// (repeatable).
    #[arg(long = "add-host", value_name = "NAME:IP")]
    add_host: Vec<String>,
}

impl NetworkArgs {
    /// The network these flags ask for (`None`: no network) and the pinned names.
    ///
    /// # Errors
    /// A malformed flag, an unreadable policy file, rules with `--network none`.
    pub fn spec(&self) -> Result<(Option<NetworkSpec>, PinnedHosts), String> {
        let mut spec = match &self.policy {
            Some(path) => NetworkSpec::load(path).map_err(|e| e.to_string())?,
            None => NetworkSpec::default(),
        };
        spec.allow.extend(self.allow.iter().cloned());
        spec.deny.extend(self.deny.iter().cloned());
        spec.allow_cidr.extend(self.allow_cidr.iter().cloned());
        for secret in &self.secret {
            spec.secrets.push(parse_secret(secret)?);
        }
        let has_rules = !spec.allow.is_empty()
            || !spec.allow_cidr.is_empty()
            || !spec.rules.is_empty()
            || !spec.secrets.is_empty();
        let denies = !spec.deny.is_empty();
        spec.mode = match (self.network, spec.mode) {
            (Some(NetworkMode::None), _) if has_rules || denies || self.policy.is_some() => {
                return Err(
                    "--network none takes no --allow, --deny, --allow-cidr, --secret or \
                            --policy (drop them, or pick allowlist or allow-all)"
                        .to_owned(),
                )
            }
            (Some(mode), _) => mode,
            (None, NetworkMode::None) if has_rules => NetworkMode::Allowlist,
            // Deny rules narrow a network; alone they would silently change nothing.
            (None, NetworkMode::None) if denies => {
                return Err(
                    "deny rules (--deny, or deny in --policy) narrow a network, and there is \
                     none: add --allow or \
                            --allow-cidr (allowlist), or --network allow-all"
                        .to_owned(),
                )
            }
            (None, file_mode) => file_mode,
        };
        let hosts = self
            .add_host
            .iter()
            .map(|h| parse_add_host(h))
            .collect::<Result<_, _>>()?;
        let network = (spec.mode != NetworkMode::None).then_some(spec);
        Ok((network, group_hosts(hosts)))
    }
}

impl NetworkArgs {
    /// The names of the `--secret` flags (whatever follows them unchecked here).
    pub fn secret_names(&self) -> impl Iterator<Item = &str> {
        self.secret
            .iter()
            .filter_map(|s| s.split_once('=').map(|(name, _)| name))
            .filter(|name| !name.is_empty())
    }
}

/// `NAME=HOST[,HOST...]`.
fn parse_secret(text: &str) -> Result<SecretSpec, String> {
    let bad = || format!("--secret {text:?} is not NAME=HOST[,HOST...]");
    let (name, hosts) = text.split_once('=').ok_or_else(bad)?;
    let hosts: Vec<String> = hosts
        .split(',')
        .filter(|h| !h.is_empty())
        .map(str::to_owned)
        .collect();
    if name.is_empty() || hosts.is_empty() {
        return Err(bad());
    }
    Ok(SecretSpec {
        name: name.to_owned(),
        hosts,
    })
}

/// `NAME:IP` (an IPv6 address may be bracketed).
fn parse_add_host(text: &str) -> Result<(String, IpAddr), String> {
    let bad = || format!("--add-host {text:?} is not NAME:IP");
    let (name, ip) = text.split_once(':').ok_or_else(bad)?;
    let ip = ip.trim_start_matches('[').trim_end_matches(']');
    let ip: IpAddr = ip.parse().map_err(|_| bad())?;
    if name.is_empty() {
        return Err(bad());
    }
    Ok((name.to_ascii_lowercase(), ip))
}

fn group_hosts(pairs: Vec<(String, IpAddr)>) -> PinnedHosts {
    let mut hosts = PinnedHosts::new();
    for (name, ip) in pairs {
        hosts.entry(name).or_default().push(ip);
    }
    hosts
}

/// The values of `network`'s secrets for `bulkhead run`: from `--secret-file NAME=PATH` when
/// given (one trailing newline dropped), else from this process's environment variable NAME.
///
/// # Errors
/// A secret with neither, an unreadable file, an empty value.
pub fn secret_values(
    network: Option<&NetworkSpec>,
    files: &[String],
) -> Result<SecretValues, String> {
    let mut from_files = BTreeMap::new();
    for entry in files {
        let (name, path) = secret_file(entry)?;
        from_files.insert(name.to_owned(), path.to_owned());
    }
    let mut values = SecretValues::new();
    for name in network.into_iter().flat_map(NetworkSpec::secret_names) {
        let value = match from_files.get(name) {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| format!("--secret-file {name}={}: {e}", path.display()))?;
                text.strip_suffix('\n').unwrap_or(&text).to_owned()
            }
            None => std::env::var(name).map_err(|_| {
                format!(
                    "--secret {name}: no environment variable {name} (export it, or give \
                     --secret-file {name}=PATH)"
                )
            })?,
        };
        let value = SecretValue::new(value).map_err(|e| format!("--secret {name}: {e}"))?;
        values.insert(name.to_owned(), value);
    }
    if let Some(unused) = from_files.keys().find(|n| !values.contains_key(*n)) {
        return Err(format!(
            "--secret-file {unused}=...: no --secret {unused}=HOSTS names where it may go"
        ));
    }
    Ok(values)
}

/// A `--secret-file NAME=PATH` entry as its name and path.
///
/// # Errors
/// An entry that is not `NAME=PATH`.
pub fn secret_file(entry: &str) -> Result<(&str, &Path), String> {
    entry
        .split_once('=')
        .filter(|(n, p)| !n.is_empty() && !p.is_empty())
        .map(|(n, p)| (n, Path::new(p)))
        .ok_or_else(|| format!("--secret-file {entry:?} is not NAME=PATH"))
}

/// `bulkhead network presets`: every preset with its description and hosts.
pub fn print_presets() -> ExitCode {
    for preset in presets() {
        println!("{}: {}", preset.name, preset.description);
        for host in preset.hosts {
            println!("  {host}");
        }
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(words: &[&str]) -> NetworkArgs {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            net: NetworkArgs,
        }
        let argv = std::iter::once("x").chain(words.iter().copied());
        <Cli as clap::Parser>::try_parse_from(argv).unwrap().net
    }

    #[test]
    fn no_flag_is_no_network_and_a_rule_alone_means_allowlist() {
        // Arrange / Act
        let (none, _) = args(&[]).spec().unwrap();
        let (allow, _) = args(&["--allow", "pypi.org"]).spec().unwrap();
        let (all, _) = args(&["--network", "allow-all"]).spec().unwrap();

        // Assert
        assert_eq!(none, None);
        assert_eq!(allow.unwrap().mode, NetworkMode::Allowlist);
        assert_eq!(all.unwrap().mode, NetworkMode::AllowAll);
    }

    #[test]
    fn rules_with_network_none_and_malformed_secrets_or_hosts_are_refused() {
        // Arrange
        let cases = [
            vec!["--network", "none", "--allow", "pypi.org"],
            vec!["--network", "none", "--deny", "pypi.org"],
            vec!["--deny", "10.0.0.0/33"],
            vec!["--secret", "TOKEN"],
            vec!["--secret", "=api.test"],
            vec!["--network", "allowlist", "--add-host", "api.test"],
            vec!["--network", "allowlist", "--add-host", "api.test:not-an-ip"],
        ];

        // Act
        let errors: Vec<String> = cases.iter().map(|c| args(c).spec().unwrap_err()).collect();

        // Assert
        assert!(
            errors[..2].iter().all(|e| e.contains("--network none")),
            "{errors:?}"
        );
        assert!(
            errors[2].contains("deny rules (--deny, or deny in --policy) narrow a network"),
            "{}",
            errors[2]
        );
        assert!(
            errors[3..5].iter().all(|e| e.contains("NAME=HOST")),
            "{errors:?}"
        );
        assert!(
            errors[5..].iter().all(|e| e.contains("NAME:IP")),
            "{errors:?}"
        );
    }

    #[test]
    fn secrets_name_their_hosts_and_add_hosts_group_by_name() {
        // Arrange
        let flags = args(&[
            "--secret",
            "TOKEN=api.test,*.api.test",
            "--add-host",
            "API.test:127.0.0.1",
            "--add-host",
            "api.test:[::1]",
        ]);

        // Act
        let (network, hosts) = flags.spec().unwrap();

        // Assert
        let network = network.unwrap();
        assert_eq!(network.secrets[0].name, "TOKEN");
        assert_eq!(network.secrets[0].hosts, ["api.test", "*.api.test"]);
        let addrs: Vec<String> = hosts["api.test"].iter().map(ToString::to_string).collect();
        assert_eq!(addrs, ["127.0.0.1", "::1"]);
    }

    #[test]
    fn a_secret_value_comes_from_its_file_or_the_environment_and_must_exist() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "from-file\n").unwrap();
        let (network, _) = args(&["--secret", "BULKHEAD_TEST_NO_SUCH_VAR=api.test"])
            .spec()
            .unwrap();
        let with_file = format!("BULKHEAD_TEST_NO_SUCH_VAR={}", file.display());

        // Act
        let missing = secret_values(network.as_ref(), &[]);
        let from_file = secret_values(network.as_ref(), &[with_file]).unwrap();
        let stray = secret_values(None, &["OTHER=/x".to_owned()]);

        // Assert
        assert!(missing.unwrap_err().contains("no environment variable"));
        assert_eq!(from_file["BULKHEAD_TEST_NO_SUCH_VAR"].expose(), "from-file");
        assert!(stray.unwrap_err().contains("no --secret OTHER"));
    }
}
