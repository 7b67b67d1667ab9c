//! A misbehaving host cannot take the agent down.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;

use bulkhead_protocol::{read_frame, write_frame, ExecRequest, Frame};
use common::{Agent, PATIENCE};

#[test]
fn garbage_first_frame_gets_an_error_and_the_agent_keeps_serving() {
    // Arrange
    let agent = Agent::start();
    let mut stream = UnixStream::connect(&agent.socket).unwrap();
    stream.set_read_timeout(Some(PATIENCE)).unwrap();

    // Act
    stream
        .write_all(&[0xff, 0xff, 0xff, 0x7f, 0x02, b'{'])
        .unwrap();
    let reply = read_frame(&mut stream).unwrap();
    let next = agent
        .client()
        .exec(&ExecRequest::new(["/bin/sh", "-c", "echo still here"]))
        .unwrap()
        .wait_with_output()
        .unwrap();

    // Assert
    match reply {
        Some(Frame::Error(e)) => assert!(e.message.contains("exceeds"), "{}", e.message),
        other => panic!("expected Error, got {other:?}"),
    }
    assert_eq!(next.stdout, b"still here\n");
}

#[test]
fn non_request_first_frame_is_refused() {
    // Arrange
    let agent = Agent::start();
    let mut stream = UnixStream::connect(&agent.socket).unwrap();
    stream.set_read_timeout(Some(PATIENCE)).unwrap();

    // Act
    write_frame(&mut stream, &Frame::Stdout(b"hi".to_vec())).unwrap();
    let reply = read_frame(&mut stream).unwrap();

    // Assert
    assert!(
        matches!(reply, Some(Frame::Error(ref e)) if e.message.contains("Stdout")),
        "{reply:?}"
    );
}

#[test]
fn unknown_frame_during_an_exec_ends_it_with_an_error_and_kills_the_command() {
    // Arrange
    let agent = Agent::start();
    let mut stream = UnixStream::connect(&agent.socket).unwrap();
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    let req = ExecRequest::new(["/bin/sh", "-c", "sleep 100"]);
    write_frame(&mut stream, &Frame::Exec(req)).unwrap();
    let Some(Frame::Started(started)) = read_frame(&mut stream).unwrap() else {
        panic!("expected Started");
    };

    // Act
    stream.write_all(&[1, 0, 0, 0, 0xEE]).unwrap();
    let reply = read_frame(&mut stream).unwrap();
    let mut rest = Vec::new();
    let _ = stream.read_to_end(&mut rest);

    // Assert
    assert!(
        matches!(reply, Some(Frame::Error(ref e)) if e.message.contains("0xee")),
        "{reply:?}"
    );
    assert!(common::wait_until(|| common::group_is_gone(started.pid)));
}
