//! Table and property tests of the policy: names, patterns, ports, addresses, requests, specs.

use std::net::IpAddr;

use proptest::prelude::*;

use super::*;

fn name(text: &str) -> HostName {
    HostName::parse(text).unwrap()
}

fn target(text: &str) -> Target {
    Target::parse(text, None).unwrap()
}

fn allowlist(allow: &[&str]) -> NetworkSpec {
    NetworkSpec {
        mode: NetworkMode::Allowlist,
        allow: allow.iter().map(|s| (*s).to_owned()).collect(),
        ..NetworkSpec::default()
    }
}

fn compile(spec: &NetworkSpec) -> Policy {
    spec.compile(&SecretValues::new()).unwrap()
}

fn compile_err(spec: &NetworkSpec) -> String {
    spec.compile(&SecretValues::new()).unwrap_err().to_string()
}

fn ip(text: &str) -> IpAddr {
    text.parse().unwrap()
}

#[test]
fn names_are_normalised_case_trailing_dot_and_idna() {
    let table = [
        ("API.Example.COM", "api.example.com"),
        ("api.example.com.", "api.example.com"),
        ("bücher.example", "xn--bcher-kva.example"),
        ("BÜCHER.example.", "xn--bcher-kva.example"),
        ("xn--bcher-kva.example", "xn--bcher-kva.example"),
        ("r3---sn-abc.googlevideo.com", "r3---sn-abc.googlevideo.com"),
        ("_acme.example.com", "_acme.example.com"),
    ];
    for (input, expected) in table {
        assert_eq!(name(input).as_str(), expected, "input {input:?}");
    }
}

#[test]
fn malformed_names_are_refused_with_the_reason() {
    let table = [
        ("", "empty"),
        (".", "empty"),
        ("a..example.com", "empty label"),
        ("exa mple.com", "IDNA"),
        ("127.1", "numeric"),
        ("0x7f.0x1", "numeric"),
        ("example.123", "numeric"),
        ("api.example.com..", "empty"),
    ];
    for (input, why) in table {
        let err = HostName::parse(input).unwrap_err().to_string();
        assert!(err.contains(why), "input {input:?}: {err}");
    }
    let long_label = format!("{}.com", "a".repeat(64));
    assert!(HostName::parse(&long_label)
        .unwrap_err()
        .to_string()
        .contains("63"));
    let long_name = format!("{}com", "abcdefghi.".repeat(26));
    assert!(HostName::parse(&long_name)
        .unwrap_err()
        .to_string()
        .contains("253"));
}

#[test]
fn patterns_match_apex_one_label_and_any_depth() {
    let table = [
        ("example.com", "example.com", true),
        ("example.com", "a.example.com", false),
        ("*.example.com", "example.com", false),
        ("*.example.com", "a.example.com", true),
        ("*.example.com", "a.b.example.com", false),
        ("**.example.com", "example.com", false),
        ("**.example.com", "a.example.com", true),
        ("**.example.com", "a.b.c.example.com", true),
        ("**.example.com", "badexample.com", false),
        ("*.example.com", "a.badexample.com", false),
        ("example.com", "example.com.evil.net", false),
        ("*.example.com", "A.EXAMPLE.COM.", true),
        ("**.bücher.example", "shop.xn--bcher-kva.example", true),
        ("*.xn--bcher-kva.example", "shop.BÜCHER.example", true),
        ("api.example.co.uk", "api.example.co.uk", true),
        ("*.example.co.uk", "api.example.co.uk", true),
        ("*.example.co.uk", "co.uk", false),
    ];
    for (pattern, host, expected) in table {
        let parsed = HostPattern::parse(pattern).unwrap();
        assert_eq!(parsed.matches(&name(host)), expected, "{pattern} vs {host}");
    }
}

#[test]
fn wildcards_over_public_suffixes_and_bare_wildcards_are_refused() {
    let table = [
        ("*", "first label"),
        ("**", "first label"),
        ("*.com", "public suffix"),
        ("**.com", "public suffix"),
        ("*.co.uk", "public suffix"),
        ("**.co.uk", "public suffix"),
        ("*.github.io", "public suffix"),
        ("*.test", "public suffix"),
        ("a.*.example.com", "first label"),
        ("*example.com", "first label"),
        ("ex*ample.com", "first label"),
        ("***.example.com", "first label"),
    ];
    for (rule, why) in table {
        let err = HostPattern::parse(rule).unwrap_err().to_string();
        assert!(err.contains(why), "rule {rule:?}: {err}");
        assert!(err.contains(rule), "the message names the rule: {err}");
    }
}

#[test]
fn rules_cover_80_and_443_unless_a_port_is_written() {
    let table = [
        ("example.com", 80, true),
        ("example.com", 443, true),
        ("example.com", 8080, false),
        ("example.com:8080", 8080, true),
        ("example.com:8080", 443, false),
        ("*.example.com:8443", 8443, true),
    ];
    for (rule, port, expected) in table {
        let parsed = HostRule::parse(rule).unwrap();
        let host = name(if rule.starts_with('*') {
            "a.example.com"
        } else {
            "example.com"
        });
        assert_eq!(
            parsed.covers_host(&host, port),
            expected,
            "{rule} on {port}"
        );
    }
}

#[test]
fn malformed_ports_and_ip_host_rules_are_refused() {
    let table = [
        ("example.com:0", "port"),
        ("example.com:65536", "port"),
        ("example.com:abc", "port"),
        ("example.com:", "port"),
        ("example.com:+80", "port"),
        ("10.0.0.1", "CIDR"),
        ("[::1]:443", "CIDR"),
    ];
    for (rule, why) in table {
        let err = HostRule::parse(rule).unwrap_err().to_string();
        assert!(err.contains(why), "rule {rule:?}: {err}");
    }
}

#[test]
fn allowlist_allows_named_hosts_and_explains_denials() {
    let policy = compile(&allowlist(&["api.test", "*.cdn.example.com:8443"]));

    let allowed = policy.check_target(&target("api.test:443"));
    let other = policy.check_target(&target("evil.example:443"));
    let port = policy.check_target(&target("api.test:8443"));
    let wildcard = policy.check_target(&target("a.cdn.example.com:8443"));

    assert!(allowed.is_allowed());
    assert_eq!(allowed.rule.as_deref(), Some("api.test"));
    assert_eq!(other.reason, "no allow rule matches");
    assert!(!port.is_allowed());
    assert!(
        port.reason
            .contains("no rule for api.test allows port 8443: add api.test:8443"),
        "{}",
        port.reason
    );
    assert!(wildcard.is_allowed());
}

#[test]
fn deny_beats_allow_on_every_port() {
    let spec = NetworkSpec {
        deny: vec!["uploads.example.com".into()],
        ..allowlist(&["**.example.com", "uploads.example.com:8443"])
    };
    let policy = compile(&spec);

    let denied = policy.check_target(&target("uploads.example.com:443"));
    let denied_port = policy.check_target(&target("uploads.example.com:8443"));
    let sibling = policy.check_target(&target("api.example.com:443"));

    assert!(!denied.is_allowed());
    assert_eq!(denied.rule.as_deref(), Some("uploads.example.com"));
    assert!(!denied_port.is_allowed());
    assert!(sibling.is_allowed());
}

#[test]
fn raw_ip_targets_need_a_cidr_rule() {
    let spec = NetworkSpec {
        allow_cidr: vec!["203.0.113.0/24:8443".into(), "198.51.100.7".into()],
        ..allowlist(&["example.com"])
    };
    let policy = compile(&spec);

    let by_domain_rule = policy.check_target(&target("93.184.216.34:443"));
    let by_cidr = policy.check_target(&target("203.0.113.9:8443"));
    let bare_address = policy.check_target(&target("198.51.100.7:443"));
    let wrong_port = policy.check_target(&target("203.0.113.9:443"));

    assert!(!by_domain_rule.is_allowed());
    assert!(by_domain_rule.reason.contains("only by a CIDR rule"));
    assert!(by_cidr.is_allowed());
    assert!(bare_address.is_allowed());
    assert!(!wrong_port.is_allowed());
}

#[test]
fn mode_none_denies_and_allow_all_allows_any_port() {
    let none = Policy::default();
    let all = compile(&NetworkSpec {
        mode: NetworkMode::AllowAll,
        deny: vec!["evil.example".into()],
        ..NetworkSpec::default()
    });

    assert!(!none.check_target(&target("example.com:443")).is_allowed());
    assert!(all.check_target(&target("example.com:22")).is_allowed());
    assert!(!all.check_target(&target("evil.example:443")).is_allowed());
}

const BLOCKED: &[&str] = &[
    "127.0.0.1",
    "10.1.2.3",
    "172.16.5.4",
    "192.168.1.1",
    "100.64.0.1",
    "169.254.169.254",
    "0.0.0.0",
    "255.255.255.255",
    "224.0.0.251",
    "::1",
    "::",
    "fe80::1",
    "fd00::1",
    "ff02::1",
    "::ffff:169.254.169.254",
    "::ffff:127.0.0.1",
    "::ffff:10.0.0.1",
    "::10.0.0.1",
    "64:ff9b::a9fe:a9fe",
    "2002:a9fe:a9fe::1",
];

#[test]
fn internal_answers_are_refused_under_allowlist_and_allow_all() {
    let listed = compile(&allowlist(&["api.test"]));
    let all = compile(&NetworkSpec {
        mode: NetworkMode::AllowAll,
        ..NetworkSpec::default()
    });
    let t = target("api.test:443");

    for addr in BLOCKED {
        for policy in [&listed, &all] {
            let refused = policy.vet_addresses(&t, &[ip(addr)]).unwrap_err();
            assert!(
                refused.reason.contains("blocked address"),
                "{addr}: {}",
                refused.reason
            );
        }
    }
}

#[test]
fn one_internal_answer_refuses_the_whole_name() {
    let policy = compile(&allowlist(&["api.test"]));

    let mixed = policy.vet_addresses(
        &target("api.test:443"),
        &[ip("93.184.216.34"), ip("10.0.0.1")],
    );
    let public = policy.vet_addresses(
        &target("api.test:443"),
        &[ip("93.184.216.34"), ip("2606:4700::1")],
    );

    assert!(mixed.is_err());
    assert_eq!(public.unwrap().len(), 2);
}

#[test]
fn a_narrow_cidr_rule_lifts_the_block_and_a_wide_one_does_not() {
    let narrow = compile(&NetworkSpec {
        allow_cidr: vec!["127.0.0.1/32".into()],
        ..allowlist(&["api.test:8080"])
    });
    let wide = compile(&NetworkSpec {
        allow_cidr: vec!["0.0.0.0/0".into()],
        ..allowlist(&["api.test:8080"])
    });
    let t = target("api.test:8080");

    let lifted = narrow.vet_addresses(&t, &[ip("127.0.0.1")]).unwrap();
    let mapped = narrow.vet_addresses(&t, &[ip("::ffff:127.0.0.1")]).unwrap();
    let other_loopback = narrow.vet_addresses(&t, &[ip("127.0.0.2")]);
    let not_lifted = wide.vet_addresses(&t, &[ip("127.0.0.1")]);

    assert_eq!(lifted[0].socket_addr(), "127.0.0.1:8080".parse().unwrap());
    assert_eq!(mapped[0].socket_addr(), "127.0.0.1:8080".parse().unwrap());
    assert!(other_loopback.is_err());
    assert!(not_lifted.is_err());
}

#[test]
fn deny_cidr_rules_refuse_resolved_addresses() {
    let policy = compile(&NetworkSpec {
        deny: vec!["93.184.216.0/24".into()],
        ..allowlist(&["api.test"])
    });

    let refused = policy
        .vet_addresses(&target("api.test:443"), &[ip("93.184.216.34")])
        .unwrap_err();

    assert_eq!(refused.rule.as_deref(), Some("93.184.216.0/24"));
}

fn path(text: &str) -> NormalPath {
    NormalPath::parse(text).unwrap()
}

#[test]
fn request_paths_are_normalised_before_matching() {
    let table = [
        ("/a/b?x=1", "/a/b"),
        ("//admin", "/admin"),
        ("/%61dmin", "/admin"),
        ("/a/b/", "/a/b/"),
        ("", "/"),
        ("/a%20b", "/a%20b"),
    ];
    for (input, expected) in table {
        assert_eq!(path(input).as_str(), expected, "input {input:?}");
    }
    for refused in [
        "/a/../b",
        "/./a",
        "/%2e%2e/admin",
        "/a%2fb",
        "/a%5cb",
        "/%zz",
        "relative",
    ] {
        assert!(NormalPath::parse(refused).is_err(), "{refused:?}");
    }
}

#[test]
fn path_prefixes_match_on_segment_boundaries() {
    let table = [
        ("/repos", "/repos", true),
        ("/repos", "/repos/x", true),
        ("/repos", "/repository", false),
        ("/repos/", "/repos/x", true),
        ("/", "/anything", true),
    ];
    for (prefix, request, expected) in table {
        assert_eq!(
            path(request).under(prefix),
            expected,
            "{prefix} vs {request}"
        );
    }
}

fn rules_spec() -> NetworkSpec {
    NetworkSpec {
        rules: vec![
            RuleSpec {
                host: "api.github.com".into(),
                methods: vec!["GET".into(), "HEAD".into()],
                paths: vec!["/repos/".into()],
                ..RuleSpec::default()
            },
            RuleSpec {
                host: "api.example.com".into(),
                action: RuleAction::Deny,
                methods: vec!["DELETE".into()],
                ..RuleSpec::default()
            },
        ],
        ..allowlist(&["api.example.com"])
    }
}

#[test]
fn method_and_path_rules_admit_only_what_they_name() {
    let policy = compile(&rules_spec());
    let github = target("api.github.com:443");
    let example = target("api.example.com:443");

    assert!(policy
        .check_request(&github, "GET", &path("/repos/a/b"))
        .is_allowed());
    assert!(!policy
        .check_request(&github, "POST", &path("/repos/a/b"))
        .is_allowed());
    assert!(!policy
        .check_request(&github, "GET", &path("/user"))
        .is_allowed());
    assert!(policy
        .check_request(&example, "GET", &path("/x"))
        .is_allowed());
    let deleted = policy.check_request(&example, "DELETE", &path("/x"));
    assert_eq!(deleted.reason, "a deny rule matches the request");
}

#[test]
fn method_path_rules_and_secrets_force_interception() {
    let mut values = SecretValues::new();
    values.insert(
        "TOKEN".into(),
        crate::secrets::SecretValue::new("s3cret").unwrap(),
    );
    let spec = NetworkSpec {
        secrets: vec![SecretSpec {
            name: "TOKEN".into(),
            hosts: vec!["api.test".into()],
        }],
        allow: vec![
            "api.test".into(),
            "plain.test".into(),
            "api.example.com".into(),
        ],
        ..rules_spec()
    };
    let policy = spec.compile(&values).unwrap();

    assert!(policy.intercepts(&name("api.test"), 443));
    assert!(policy.intercepts(&name("api.github.com"), 443));
    assert!(policy.intercepts(&name("api.example.com"), 443));
    assert!(!policy.intercepts(&name("plain.test"), 443));
    assert_eq!(policy.secrets_for(&name("api.test"), 443).count(), 1);
    assert_eq!(policy.secrets_for(&name("plain.test"), 443).count(), 0);
    assert!(policy.intercepts_some_host());
    assert!(!compile(&allowlist(&["plain.test"])).intercepts_some_host());
}

#[test]
fn bad_specs_give_errors_that_name_the_input() {
    let table = [
        (allowlist(&["@nope"]), "unknown preset \"@nope\""),
        (allowlist(&["*.com"]), "\"*.com\""),
        (allowlist(&["exa mple.com"]), "exa mple.com"),
        (
            NetworkSpec {
                allow_cidr: vec!["10.0.0.1/8".into()],
                ..allowlist(&[])
            },
            "host bits set",
        ),
        (
            NetworkSpec {
                secrets: vec![SecretSpec {
                    name: "TOKEN".into(),
                    hosts: vec!["api.test".into()],
                }],
                ..allowlist(&["api.test"])
            },
            "secret \"TOKEN\": no value supplied",
        ),
        (
            NetworkSpec {
                secrets: vec![SecretSpec {
                    name: "1BAD".into(),
                    hosts: vec!["api.test".into()],
                }],
                ..allowlist(&[])
            },
            "not an environment variable name",
        ),
        (
            NetworkSpec {
                rules: vec![RuleSpec {
                    host: "api.test".into(),
                    methods: vec!["GE T".into()],
                    ..RuleSpec::default()
                }],
                ..allowlist(&[])
            },
            "\"GE T\" is not an HTTP method",
        ),
        (
            NetworkSpec {
                mode: NetworkMode::None,
                ..allowlist(&["api.test"])
            },
            "network mode is none",
        ),
        (
            NetworkSpec {
                mode: NetworkMode::AllowAll,
                ..allowlist(&["api.test"])
            },
            "no effect under allow-all",
        ),
    ];
    for (spec, expected) in table {
        let err = compile_err(&spec);
        assert!(err.contains(expected), "expected {expected:?} in {err:?}");
    }
}

#[test]
fn policy_files_parse_and_refuse_unknown_keys() {
    let good = r#"
        mode = "allowlist"
        allow = ["@pypi", "api.example.com:8443"]
        deny = ["uploads.example.com", "203.0.113.0/24"]
        allow_cidr = ["127.0.0.1/32"]
        [[rules]]
        host = "api.github.com"
        methods = ["GET"]
        paths = ["/repos/"]
    "#;
    let unknown_top = "mode = \"allowlist\"\nalow = [\"x.com\"]\n";
    let unknown_nested =
        "mode = \"allowlist\"\n[[rules]]\nhost = \"a.example.com\"\nmethod = [\"GET\"]\n";
    let bad_mode = "mode = \"open\"\n";

    let spec = NetworkSpec::from_toml_str(good, "policy.toml").unwrap();
    let policy = compile(&spec);
    let top = NetworkSpec::from_toml_str(unknown_top, "policy.toml")
        .unwrap_err()
        .to_string();
    let nested = NetworkSpec::from_toml_str(unknown_nested, "policy.toml")
        .unwrap_err()
        .to_string();
    let mode = NetworkSpec::from_toml_str(bad_mode, "policy.toml")
        .unwrap_err()
        .to_string();

    assert!(policy
        .check_target(&target("files.pythonhosted.org:443"))
        .is_allowed());
    assert!(
        top.contains("policy.toml") && top.contains("unknown field `alow`"),
        "{top}"
    );
    assert!(nested.contains("unknown field `method`"), "{nested}");
    assert!(mode.contains("unknown variant `open`"), "{mode}");
}

#[test]
fn a_policy_file_that_says_none_and_lists_rules_is_refused() {
    // Arrange
    let contradictory = "mode = \"none\"\nallow = [\"example.com\"]\n";
    let plain_none = "mode = \"none\"\n";
    let default_mode = "allow = [\"example.com\"]\n";

    // Act
    let refused = NetworkSpec::from_toml_str(contradictory, "p.toml");
    let none = NetworkSpec::from_toml_str(plain_none, "p.toml").unwrap();
    let rules = NetworkSpec::from_toml_str(default_mode, "p.toml").unwrap();

    // Assert
    let text = refused.unwrap_err().to_string();
    assert!(text.contains("p.toml: mode = \"none\" takes no"), "{text}");
    assert_eq!(none.mode, NetworkMode::None);
    assert_eq!(rules.allow, ["example.com"]);
}

#[test]
fn flags_merge_on_top_of_a_policy_file() {
    let mut file = NetworkSpec::from_toml_str("allow = [\"a.example.com\"]\n", "p.toml").unwrap();
    let flags = NetworkSpec {
        deny: vec!["b.example.com".into()],
        ..allowlist(&["c.example.com"])
    };

    file.merge(flags);

    assert_eq!(file.mode, NetworkMode::Allowlist);
    assert_eq!(file.allow, ["a.example.com", "c.example.com"]);
    assert_eq!(file.deny, ["b.example.com"]);
}

#[test]
fn network_modes_parse_from_flags() {
    assert_eq!(
        "allowlist".parse::<NetworkMode>().unwrap(),
        NetworkMode::Allowlist
    );
    assert_eq!(
        "allow-all".parse::<NetworkMode>().unwrap(),
        NetworkMode::AllowAll
    );
    assert_eq!("none".parse::<NetworkMode>().unwrap(), NetworkMode::None);
    assert!("open"
        .parse::<NetworkMode>()
        .unwrap_err()
        .to_string()
        .contains("none, allow-all or allowlist"));
}

#[test]
fn every_preset_compiles_and_package_registries_covers_the_registries() {
    for preset in presets() {
        let policy = compile(&allowlist(&[preset.name]));
        for host in preset.hosts {
            assert!(
                policy
                    .check_target(&target(&format!("{host}:443")))
                    .is_allowed(),
                "{host}"
            );
        }
    }
    let registries = compile(&allowlist(&["@package-registries"]));
    for host in [
        "pypi.org",
        "files.pythonhosted.org",
        "registry.npmjs.org",
        "static.crates.io",
        "proxy.golang.org",
        "deb.debian.org:80",
        "security.ubuntu.com:80",
    ] {
        let t = Target::parse(host, Some(443)).unwrap();
        assert!(registries.check_target(&t).is_allowed(), "{host}");
    }
}

fn label() -> impl Strategy<Value = String> {
    "[a-z0-9]([a-z0-9-]{0,6}[a-z0-9])?"
}

fn labels(range: std::ops::Range<usize>) -> impl Strategy<Value = Vec<String>> {
    prop::collection::vec(label(), range)
}

proptest! {
    /// Whatever the name, a match means the name ends with the rule's labels, label for label,
    /// with as many extra labels as the pattern allows.
    #[test]
    fn a_rule_never_matches_outside_its_suffix(
        base in labels(2..4),
        kind in 0usize..3,
        host in labels(1..7),
    ) {
        let base_text = base.join(".");
        let host_text = host.join(".");
        let pattern_text = [base_text.clone(), format!("*.{base_text}"), format!("**.{base_text}")][kind].clone();
        let Ok(pattern) = HostPattern::parse(&pattern_text) else { return Ok(()) };
        let Ok(host_name) = HostName::parse(&host_text) else { return Ok(()) };
        if pattern.matches(&host_name) {
            prop_assert!(host.len() >= base.len());
            let extra = host.len() - base.len();
            prop_assert_eq!(&host[extra..], &base[..]);
            let depth_ok = match kind {
                0 => extra == 0,
                1 => extra == 1,
                _ => extra >= 1,
            };
            prop_assert!(depth_ok);
        }
    }

    /// Gluing text onto the front of the rule's base without a dot never yields a match.
    #[test]
    fn glued_prefixes_never_match(base in labels(2..4), glue in "[a-z0-9-]{1,8}", kind in 0usize..3) {
        let base_text = base.join(".");
        let pattern_text = [base_text.clone(), format!("*.{base_text}"), format!("**.{base_text}")][kind].clone();
        let Ok(pattern) = HostPattern::parse(&pattern_text) else { return Ok(()) };
        for host in [format!("{glue}{base_text}"), format!("x.{glue}{base_text}")] {
            if let Ok(host_name) = HostName::parse(&host) {
                prop_assert!(!pattern.matches(&host_name), "{} matched {}", pattern_text, host);
            }
        }
    }

    /// A name under the rule's base at the right depth always matches.
    #[test]
    fn names_under_the_base_match(base in labels(2..4), extra in labels(1..4)) {
        let base_text = base.join(".");
        let Ok(any_depth) = HostPattern::parse(&format!("**.{base_text}")) else { return Ok(()) };
        let host = HostName::parse(&format!("{}.{base_text}", extra.join("."))).unwrap();
        prop_assert!(any_depth.matches(&host));
    }
}
