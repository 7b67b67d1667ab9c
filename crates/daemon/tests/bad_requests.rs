//! Bad requests get a 4xx with a clear `{"error": {"code", "message"}}` and leave the daemon
//! serving.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use bulkhead_client::{Client, ExecSpec};
use bytes::Bytes;
use common::{rt, spec_with_labels, wait_until, TestDaemon};
use hyper::Method;

/// Sends a raw request; returns (status, error code, message).
fn send(client: &Client, method: Method, path: &str, body: &str) -> (u16, String, String) {
    let rt = rt();
    let body = (!body.is_empty()).then(|| Bytes::from(body.to_owned()));
    let (status, bytes) = rt.block_on(client.raw(method, path, body, &[])).unwrap();
    let doc: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
    let code = doc["error"]["code"].as_str().unwrap_or_default().to_owned();
    let message = doc["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    (status.as_u16(), code, message)
}

#[test]
fn invalid_create_requests_are_refused_with_4xx() {
    // Arrange
    let daemon = TestDaemon::start();
    let client = daemon.client();
    let cases = [
        ("{not json", 400, "invalid_json", "invalid JSON"),
        ("[2,64]", 400, "invalid_json", "expected a JSON object"),
        (
            r#"{"vcpus":1,"colour":"red"}"#,
            400,
            "invalid_json",
            "unknown field `colour`",
        ),
        (
            r#"{"memory_mib":"lots"}"#,
            400,
            "invalid_json",
            "invalid type",
        ),
        (r#"{"memory_mib":0}"#, 400, "invalid_request", "memory_mib"),
        (
            r#"{"memory_mib":60000}"#,
            422,
            "insufficient_memory",
            "available memory",
        ),
        (r#"{"vcpus":0}"#, 400, "invalid_request", "vcpus"),
        (r#"{"cpu_quota":0}"#, 400, "invalid_request", "cpu_quota"),
        (r#"{"pids_max":2}"#, 400, "invalid_request", "pids_max"),
        (
            r#"{"image":"../../etc"}"#,
            400,
            "invalid_request",
            "invalid image name",
        ),
        (
            r#"{"disk_mib":64}"#,
            400,
            "invalid_request",
            "disk_mib needs an image",
        ),
        (r#"{"ttl_s":0}"#, 400, "invalid_request", "ttl_s"),
        (
            r#"{"network":{"allow":["*"]}}"#,
            400,
            "invalid_request",
            "network:",
        ),
        (
            r#"{"network":{"mode":"sideways"}}"#,
            400,
            "invalid_request",
            "network.mode",
        ),
        (
            r#"{"network":{"secrets":[{"name":"NOPE","hosts":["api.test"]}]}}"#,
            400,
            "invalid_request",
            "unknown secret \"NOPE\"",
        ),
        (
            r#"{"network":{"allow":["api.test"],"hosts":{"api.test":["not-an-ip"]}}}"#,
            400,
            "invalid_request",
            "network.hosts.api.test",
        ),
    ];

    // Act
    let results: Vec<_> = cases
        .iter()
        .map(|(body, ..)| send(&client, Method::POST, "/v1/sandboxes", body))
        .collect();

    // Assert
    for ((body, status, code, needle), (got_status, got_code, message)) in
        cases.iter().zip(&results)
    {
        assert_eq!(
            (got_status, got_code.as_str()),
            (status, *code),
            "{body}: {message}"
        );
        assert!(message.contains(needle), "{body}: {message}");
    }
    assert!(rt()
        .block_on(client.list(&Default::default()))
        .unwrap()
        .is_empty());
}

#[test]
fn the_egress_log_of_a_sandbox_without_a_network_is_a_409() {
    // Arrange
    let daemon = TestDaemon::start();
    let client = daemon.client();
    let sb = rt()
        .block_on(client.create(&spec_with_labels(&[])))
        .unwrap();

    // Act
    let (status, code, message) = send(
        &client,
        Method::GET,
        &format!("/v1/sandboxes/{}/egress", sb.id),
        "",
    );

    // Assert
    assert_eq!((status, code.as_str()), (409, "conflict"), "{message}");
    assert!(message.contains("without a network"), "{message}");
}

#[test]
fn unknown_ids_routes_and_methods_are_json_404_and_405() {
    // Arrange
    let daemon = TestDaemon::start();
    let client = daemon.client();

    // Act
    let get = send(&client, Method::GET, "/v1/sandboxes/0123456789ab", "");
    let exec = send(
        &client,
        Method::POST,
        "/v1/sandboxes/nope/exec",
        r#"{"argv":["true"]}"#,
    );
    let file = send(
        &client,
        Method::GET,
        "/v1/sandboxes/nope/files?path=/etc/hostname",
        "",
    );
    let delete = send(&client, Method::DELETE, "/v1/sandboxes/0123456789ab", "");
    let route = send(&client, Method::GET, "/v2/nothing", "");
    let method = send(&client, Method::PATCH, "/v1/sandboxes", "");

    // Assert
    assert_eq!((get.0, get.1.as_str()), (404, "not_found"));
    assert!(get.2.contains("0123456789ab"));
    assert_eq!(exec.0, 404);
    assert_eq!(file.0, 404);
    assert_eq!(delete.0, 204, "delete is idempotent");
    assert_eq!((route.0, route.1.as_str()), (404, "not_found"));
    assert_eq!((method.0, method.1.as_str()), (405, "method_not_allowed"));
}

#[test]
fn bad_paths_bad_exec_requests_and_destroyed_sandboxes_are_refused() {
    // Arrange
    let daemon = TestDaemon::start();
    let client = daemon.client();
    let rt = rt();
    let live = rt.block_on(client.create(&spec_with_labels(&[]))).unwrap();
    let dead = rt.block_on(client.create(&spec_with_labels(&[]))).unwrap();
    rt.block_on(client.delete(&dead.id)).unwrap();
    let files = |q: &str| format!("/v1/sandboxes/{}/files?{q}", live.id);
    let exec = format!("/v1/sandboxes/{}/exec", live.id);

    // Act
    let traversal = send(&client, Method::GET, &files("path=../../etc/passwd"), "");
    let dotdot = send(
        &client,
        Method::PUT,
        &files("path=/tmp/../../etc/x"),
        "data",
    );
    let no_path = send(&client, Method::GET, &files(""), "");
    let empty_argv = send(&client, Method::POST, &exec, r#"{"argv":[]}"#);
    let bad_stdin = send(
        &client,
        Method::POST,
        &exec,
        r#"{"argv":["cat"],"stdin":"%%%"}"#,
    );
    let relative_cwd = send(
        &client,
        Method::POST,
        &exec,
        r#"{"argv":["pwd"],"cwd":"tmp"}"#,
    );
    let on_destroyed = send(
        &client,
        Method::POST,
        &format!("/v1/sandboxes/{}/exec", dead.id),
        r#"{"argv":["true"]}"#,
    );

    // Assert
    assert_eq!(
        (traversal.0, traversal.1.as_str()),
        (400, "invalid_request"),
        "{traversal:?}"
    );
    assert!(traversal.2.contains("'..'"), "{}", traversal.2);
    assert_eq!(dotdot.0, 400);
    assert_eq!(no_path.0, 400);
    assert_eq!(empty_argv.0, 400);
    assert_eq!(bad_stdin.0, 400);
    assert_eq!(relative_cwd.0, 400);
    assert_eq!(on_destroyed.0, 404);
    assert!(rt
        .block_on(client.exec_collect(&live.id, &ExecSpec::new(["true"])))
        .is_ok());
}

#[test]
fn a_one_gib_body_is_refused_with_413_without_reading_it_all() {
    // Arrange
    let daemon = TestDaemon::start();
    let mut stream = UnixStream::connect(&daemon.socket).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    stream
        .set_write_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let head = "POST /v1/sandboxes HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1073741824\r\n\r\n";

    // Act: send at most 8 MiB of the announced 1 GiB, then read the answer.
    stream.write_all(head.as_bytes()).unwrap();
    let chunk = vec![b' '; 64 * 1024];
    for _ in 0..128 {
        if stream.write_all(&chunk).is_err() {
            break;
        }
    }
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    let text = String::from_utf8_lossy(&answer);

    // Assert
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    assert!(text.contains("payload_too_large"), "{text}");
    assert!(rt().block_on(daemon.client().health()).is_ok());
}

#[test]
fn a_client_that_disconnects_mid_stream_gets_its_command_killed() {
    // Arrange: the fake VMM runs guest commands on the host, so the command is visible here.
    let daemon = TestDaemon::start();
    let client = daemon.client();
    let rt = rt();
    let sb = rt.block_on(client.create(&spec_with_labels(&[]))).unwrap();
    let marker = format!("{}.5", 4000 + std::process::id() % 1000);
    let script = format!("echo go; exec sleep {marker}");
    // The stream's connection lives on its own runtime, so dropping that runtime closes it.
    let stream_rt = common::rt();
    let mut stream = stream_rt
        .block_on(client.exec(&sb.id, &ExecSpec::new(["sh", "-c", &script])))
        .unwrap();
    stream_rt.block_on(stream.next_event()).unwrap();
    // "go" arrives before the shell has exec'd `sleep`: wait for the sleep itself.
    let running = wait_until(Duration::from_secs(10), || {
        common::processes_with_arg(&marker).len() == 1
    });

    // Act
    drop(stream);
    drop(stream_rt);
    let killed = wait_until(Duration::from_secs(10), || {
        common::processes_with_arg(&marker).is_empty()
    });

    // Assert
    assert!(running, "the command was running");
    assert!(killed, "the command survived the client's disconnect");
    assert!(rt
        .block_on(client.exec_collect(&sb.id, &ExecSpec::new(["true"])))
        .is_ok());
}
