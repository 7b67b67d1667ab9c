//! The agent's file service and shutdown, end to end over a Unix socket.

mod common;

use std::os::unix::fs::PermissionsExt;

use bulkhead_protocol::client::ClientError;
use common::{noise, sha256, Agent};

#[test]
fn written_file_has_the_contents_and_exact_mode() {
    // Arrange
    let agent = Agent::start();
    let path = agent.dir().join("script.sh");
    let contents = b"#!/bin/sh\necho hi\0there\n";

    // Act
    let written = agent
        .client()
        .write_file(path.to_str().unwrap(), 0o751, contents)
        .unwrap();

    // Assert
    assert_eq!(written, contents.len() as u64);
    assert_eq!(std::fs::read(&path).unwrap(), contents);
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode, 0o751);
}

#[test]
fn overwriting_a_file_truncates_it_and_resets_its_mode() {
    // Arrange
    let agent = Agent::start();
    let path = agent.dir().join("f");
    std::fs::write(&path, b"a much longer old content").unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o777)).unwrap();

    // Act
    agent
        .client()
        .write_file(path.to_str().unwrap(), 0o600, b"new")
        .unwrap();

    // Assert
    assert_eq!(std::fs::read(&path).unwrap(), b"new");
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode, 0o600);
}

#[test]
fn missing_parent_directories_are_created() {
    // Arrange
    let agent = Agent::start();
    let path = agent.dir().join("a/b/c/file");

    // Act
    agent
        .client()
        .write_file(path.to_str().unwrap(), 0o644, b"x")
        .unwrap();

    // Assert
    assert_eq!(std::fs::read(&path).unwrap(), b"x");
}

#[test]
fn large_binary_file_round_trips_through_write_and_read() {
    // Arrange
    let agent = Agent::start();
    let path = agent.dir().join("blob");
    let data = noise(3 * 1024 * 1024 + 17, 9);

    // Act
    agent
        .client()
        .write_file(path.to_str().unwrap(), 0o644, &data)
        .unwrap();
    let back = agent.client().read_file(path.to_str().unwrap()).unwrap();

    // Assert
    assert_eq!(sha256(&back), sha256(&data));
}

#[test]
fn empty_file_round_trips() {
    // Arrange
    let agent = Agent::start();
    let path = agent.dir().join("empty");

    // Act
    agent
        .client()
        .write_file(path.to_str().unwrap(), 0o644, b"")
        .unwrap();
    let back = agent.client().read_file(path.to_str().unwrap()).unwrap();

    // Assert
    assert!(back.is_empty());
    assert!(path.exists());
}

#[test]
fn read_errors_are_reported_by_the_agent() {
    // Arrange
    let agent = Agent::start();
    let missing = agent.dir().join("missing");
    let dir = agent.dir().to_str().unwrap().to_owned();

    // Act
    let e_missing = agent
        .client()
        .read_file(missing.to_str().unwrap())
        .unwrap_err();
    let e_dir = agent.client().read_file(&dir).unwrap_err();
    let e_relative = agent.client().read_file("relative/path").unwrap_err();

    // Assert
    assert!(
        matches!(e_missing, ClientError::Agent(ref m) if m.message.contains("No such file") && m.code == bulkhead_protocol::ErrorCode::NotFound),
        "{e_missing}"
    );
    assert!(
        matches!(e_dir, ClientError::Agent(ref m) if m.message.contains("not a regular file") && m.code == bulkhead_protocol::ErrorCode::InvalidRequest),
        "{e_dir}"
    );
    assert!(
        matches!(e_relative, ClientError::Agent(ref m) if m.message.contains("not absolute")),
        "{e_relative}"
    );
}

#[test]
fn write_into_an_impossible_place_is_an_agent_error() {
    // Arrange: a parent "directory" that is a regular file.
    let agent = Agent::start();
    let blocker = agent.dir().join("plain-file");
    std::fs::write(&blocker, b"").unwrap();
    let path = blocker.join("child");

    // Act
    let err = agent
        .client()
        .write_file(path.to_str().unwrap(), 0o644, &noise(100_000, 4))
        .unwrap_err();

    // Assert
    assert!(
        matches!(err, ClientError::Agent(ref m) if m.message.contains("plain-file")),
        "{err}"
    );
}

#[test]
fn shutdown_is_acknowledged_and_ends_the_agent_in_test_mode() {
    // Arrange
    let mut agent = Agent::start();

    // Act
    agent.client().shutdown().unwrap();

    // Assert
    assert!(agent.wait_exit(), "agent still running after Shutdown");
}

#[test]
fn ready_carries_the_protocol_version_and_plausible_timestamps() {
    // Arrange / Act
    let agent = Agent::start();

    // Assert
    let ready = &agent.ready;
    assert_eq!(ready.version, bulkhead_protocol::PROTOCOL_VERSION);
    assert!(ready.init_started.boottime_ns > 0);
    assert!(ready.listening.boottime_ns >= ready.init_started.boottime_ns);
    assert!(ready.listening.realtime_ns > 1_600_000_000 * 1_000_000_000);
}
