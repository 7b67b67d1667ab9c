//! Tests of placeholders, injection, refusal and response scrubbing.

use base64::Engine as _;
use hyper::header::{HeaderMap, HeaderValue, AUTHORIZATION};

use super::*;
use crate::policy::{NetworkMode, NetworkSpec, SecretSpec, SecretValues};

fn injector() -> Injector {
    let mut values = SecretValues::new();
    values.insert(
        "TOKEN".into(),
        SecretValue::new("real-token-value").unwrap(),
    );
    let spec = NetworkSpec {
        mode: NetworkMode::Allowlist,
        allow: vec!["api.test".into(), "other.test".into()],
        secrets: vec![SecretSpec {
            name: "TOKEN".into(),
            hosts: vec!["api.test".into()],
        }],
        ..NetworkSpec::default()
    };
    Injector::new(&spec.compile(&values).unwrap()).unwrap()
}

fn placeholder(injector: &Injector) -> String {
    injector.placeholders()[0].1.clone()
}

fn host(text: &str) -> HostName {
    HostName::parse(text).unwrap()
}

fn bearer(value: &str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(
        AUTHORIZATION,
        HeaderValue::from_str(&format!("Bearer {value}")).unwrap(),
    );
    headers
}

#[test]
fn placeholders_are_random_named_and_not_the_value() {
    let first = placeholder(&injector());
    let second = placeholder(&injector());

    assert!(first.starts_with("bulkhead-placeholder-TOKEN-"));
    assert_eq!(first.len(), "bulkhead-placeholder-TOKEN-".len() + 32);
    assert_ne!(first, second);
    assert!(!first.contains("real-token-value"));
}

#[test]
fn the_value_replaces_the_placeholder_for_the_secrets_host() {
    let injector = injector();
    let mut headers = bearer(&placeholder(&injector));

    let injected = injector
        .inject(&host("api.test"), 443, "/v1", &mut headers)
        .unwrap();

    assert_eq!(injected, vec!["TOKEN".to_owned()]);
    assert_eq!(headers[AUTHORIZATION], "Bearer real-token-value");
    assert!(headers[AUTHORIZATION].is_sensitive());
}

#[test]
fn basic_credentials_are_decoded_replaced_and_encoded_again() {
    let injector = injector();
    let engine = base64::engine::general_purpose::STANDARD;
    let credential = engine.encode(format!("x-access-token:{}", placeholder(&injector)));
    let mut headers = HeaderMap::new();
    headers.insert(
        AUTHORIZATION,
        HeaderValue::from_str(&format!("Basic {credential}")).unwrap(),
    );

    injector
        .inject(&host("api.test"), 443, "/", &mut headers)
        .unwrap();

    let sent = headers[AUTHORIZATION]
        .to_str()
        .unwrap()
        .strip_prefix("Basic ")
        .unwrap()
        .to_owned();
    assert_eq!(
        engine.decode(sent).unwrap(),
        b"x-access-token:real-token-value"
    );
}

#[test]
fn a_placeholder_to_another_host_or_in_the_target_is_refused() {
    let injector = injector();
    let token = placeholder(&injector);

    let other = injector
        .inject(&host("other.test"), 443, "/", &mut bearer(&token))
        .unwrap_err();
    let in_query = injector
        .inject(
            &host("api.test"),
            443,
            &format!("/?t={token}"),
            &mut HeaderMap::new(),
        )
        .unwrap_err();
    let plain = injector
        .find_any("http://api.test/", &bearer(&token))
        .unwrap();

    assert_eq!(other.name, "TOKEN");
    assert!(other.why.contains("not for"));
    assert!(in_query.why.contains("request target"));
    assert!(plain.why.contains("plain HTTP"));
}

#[test]
fn requests_without_placeholders_pass_untouched() {
    let injector = injector();
    let mut headers = bearer("something-else");

    let injected = injector
        .inject(&host("other.test"), 443, "/", &mut headers)
        .unwrap();

    assert!(injected.is_empty());
    assert_eq!(headers[AUTHORIZATION], "Bearer something-else");
}

#[test]
fn the_value_is_replaced_by_the_placeholder_in_response_headers() {
    let injector = injector();
    let mut headers = HeaderMap::new();
    headers.insert(
        "x-echo",
        HeaderValue::from_static("token=real-token-value; ok"),
    );

    injector.scrub_response(&mut headers);

    assert_eq!(
        headers["x-echo"],
        format!("token={}; ok", placeholder(&injector)).as_str()
    );
}

#[test]
fn bad_values_are_refused_and_never_printed() {
    assert!(SecretValue::new("").is_err());
    assert!(SecretValue::new("a\r\nX-Injected: 1").is_err());
    assert!(SecretValue::new(" padded").is_err());
    assert!(SecretValue::new("x".repeat(MAX_SECRET_LEN + 1)).is_err());
    assert_eq!(
        format!("{:?}", SecretValue::new("hunter2").unwrap()),
        "SecretValue(<redacted>)"
    );
}
