//! The served OpenAPI document is valid and describes exactly the routes the daemon serves.

mod common;

use std::collections::BTreeSet;

use bytes::Bytes;
use common::{rt, TestDaemon};
use hyper::Method;

/// Every `$ref` in `value`.
fn refs(value: &serde_json::Value, out: &mut Vec<String>) {
    match value {
        serde_json::Value::Object(map) => {
            for (k, v) in map {
                match (k.as_str(), v.as_str()) {
                    ("$ref", Some(target)) => out.push(target.to_owned()),
                    _ => refs(v, out),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| refs(v, out)),
        _ => {}
    }
}

#[test]
fn the_openapi_document_is_valid_and_matches_the_routes() {
    // Arrange
    let daemon = TestDaemon::start();
    let client = daemon.client();
    let rt = rt();

    // Act
    let doc = rt.block_on(client.openapi()).unwrap();
    let parsed: Result<utoipa::openapi::OpenApi, _> = serde_json::from_value(doc.clone());
    let mut operations = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for method in item.as_object().unwrap().keys() {
            operations.insert((method.to_uppercase(), path.clone()));
        }
    }
    let mut unresolved = Vec::new();
    let mut all_refs = Vec::new();
    refs(&doc, &mut all_refs);
    for target in &all_refs {
        let name = target.trim_start_matches("#/components/schemas/");
        if doc["components"]["schemas"].get(name).is_none() {
            unresolved.push(target.clone());
        }
    }
    // Each documented operation is routed: the answer is never the router's "no route" 404 or 405.
    let mut unrouted = Vec::new();
    for (method, path) in &operations {
        let concrete = path.replace("{id}", "0123456789ab");
        let body = (method != "GET" && method != "DELETE").then(|| Bytes::from_static(b"{}"));
        let method = Method::from_bytes(method.as_bytes()).unwrap();
        let (status, bytes) = rt
            .block_on(client.raw(method.clone(), &concrete, body, &[]))
            .unwrap();
        let text = String::from_utf8_lossy(&bytes);
        if status == 405 || text.contains("no route for") {
            unrouted.push(format!("{method} {path}: {status} {text}"));
        }
    }

    // Assert
    let parsed = parsed.expect("the document deserializes as OpenAPI");
    assert!(matches!(
        parsed.openapi,
        utoipa::openapi::OpenApiVersion::Version31
    ));
    assert!(unresolved.is_empty(), "unresolved refs: {unresolved:?}");
    assert!(!all_refs.is_empty());
    assert!(unrouted.is_empty(), "{unrouted:?}");
    let expected: BTreeSet<(String, String)> = [
        ("GET", "/healthz"),
        ("GET", "/metrics"),
        ("GET", "/openapi.json"),
        ("POST", "/v1/sandboxes"),
        ("GET", "/v1/sandboxes"),
        ("GET", "/v1/sandboxes/{id}"),
        ("DELETE", "/v1/sandboxes/{id}"),
        ("POST", "/v1/sandboxes/{id}/pause"),
        ("POST", "/v1/sandboxes/{id}/resume"),
        ("GET", "/v1/sandboxes/{id}/logs"),
        ("GET", "/v1/sandboxes/{id}/egress"),
        ("POST", "/v1/sandboxes/{id}/exec"),
        ("POST", "/v1/sandboxes/{id}/exec/collect"),
        ("POST", "/v1/sandboxes/{id}/exec/attach"),
        ("PUT", "/v1/sandboxes/{id}/files"),
        ("GET", "/v1/sandboxes/{id}/files"),
        ("GET", "/v1/sandboxes/{id}/workspace/diff"),
        ("GET", "/v1/sandboxes/{id}/workspace/export"),
    ]
    .iter()
    .map(|(m, p)| ((*m).to_owned(), (*p).to_owned()))
    .collect();
    assert_eq!(operations, expected);
    let schemas = &doc["components"]["schemas"];
    assert!(
        schemas["Health"]["properties"].get("pool").is_some(),
        "/healthz documents the warm pool"
    );
    for field in ["template", "size", "ready", "restoring"] {
        assert!(
            schemas["PoolStatus"]["properties"].get(field).is_some(),
            "PoolStatus.{field}"
        );
    }
}

#[test]
fn methods_the_document_does_not_list_are_not_routed() {
    // Arrange
    let daemon = TestDaemon::start();
    let client = daemon.client();
    let rt = rt();
    let undocumented = [
        (Method::PUT, "/v1/sandboxes"),
        (Method::POST, "/v1/sandboxes/0123456789ab"),
        (Method::GET, "/v1/sandboxes/0123456789ab/exec"),
        (Method::DELETE, "/v1/sandboxes/0123456789ab/files"),
        (Method::POST, "/healthz"),
    ];

    // Act
    let statuses: Vec<u16> = undocumented
        .iter()
        .map(|(m, p)| {
            rt.block_on(client.raw(m.clone(), p, None, &[]))
                .unwrap()
                .0
                .as_u16()
        })
        .collect();

    // Assert
    assert_eq!(statuses, [405; 5]);
}
