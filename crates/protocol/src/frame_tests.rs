use std::io::Cursor;

use super::*;
use crate::messages::BootTimestamps;
use crate::{MAX_FRAME, PROTOCOL_VERSION};

fn round_trip(frame: &Frame) -> Frame {
    let mut wire = Vec::new();
    write_frame(&mut wire, frame).unwrap();
    let mut cursor = Cursor::new(wire);
    let back = read_frame(&mut cursor).unwrap().unwrap();
    assert_eq!(read_frame(&mut cursor).unwrap(), None, "trailing bytes");
    back
}

fn header(len: u32, kind: u8) -> Vec<u8> {
    let mut h = len.to_le_bytes().to_vec();
    h.push(kind);
    h
}

fn every_kind_of_frame() -> Vec<Frame> {
    let mut exec = ExecRequest::new(["/bin/sh", "-c", "echo hi"]);
    exec.env = vec!["A=b".into()];
    exec.cwd = Some("/tmp".into());
    exec.user = Some("1000:1000".into());
    exec.stdin = true;
    exec.timeout_ms = Some(1500);
    vec![
        Frame::Ready(Ready {
            version: PROTOCOL_VERSION,
            agent_version: "0.1.0".into(),
            init_started: BootTimestamps {
                boottime_ns: 1,
                realtime_ns: 2,
            },
            listening: BootTimestamps {
                boottime_ns: 3,
                realtime_ns: u64::MAX,
            },
        }),
        Frame::Exec(exec),
        Frame::FileWrite(FileWriteRequest {
            version: 1,
            path: "/a".into(),
            mode: 0o755,
        }),
        Frame::FileRead(FileReadRequest {
            version: 1,
            path: "/a".into(),
        }),
        Frame::Shutdown(ShutdownRequest { version: 1 }),
        Frame::Restored(RestoredRequest {
            version: 1,
            entropy: (0..=255).collect(),
            realtime_ns: 1_700_000_000_123_456_789,
            hostname: Some("clone-2".into()),
            share_params: vec![
                "bulkhead.workspace=workspace:/workspace:clone".into(),
                "bulkhead.mount=mount0:/data:ro".into(),
            ],
            egress: true,
        }),
        Frame::Restored(RestoredRequest::new(vec![0; 32], u64::MAX)),
        Frame::Shares(SharesRequest {
            version: 1,
            mounted: false,
        }),
        Frame::Started(Started { pid: 42 }),
        Frame::Stdin(b"in".to_vec()),
        Frame::StdinEof,
        Frame::Signal(SignalRequest { signo: 15 }),
        Frame::Stdout(b"out".to_vec()),
        Frame::Stderr(b"err".to_vec()),
        Frame::Exit(ExitStatus {
            code: None,
            signal: Some(9),
            timed_out: true,
            oom_killed: true,
        }),
        Frame::Data(vec![]),
        Frame::End,
        Frame::Ack(Ack { bytes: 7 }),
        Frame::error(crate::ErrorCode::NotFound, "nope"),
    ]
}

#[test]
fn every_frame_type_round_trips() {
    // Arrange
    let frames = every_kind_of_frame();

    // Act
    let back: Vec<Frame> = frames.iter().map(round_trip).collect();

    // Assert
    assert_eq!(back, frames);
}

#[test]
fn restored_is_frame_type_0x07_with_a_json_payload() {
    // Arrange
    let frame = Frame::Restored(RestoredRequest::new(vec![0xab; 32], 42));

    // Act
    let wire = frame.encode().unwrap();
    let payload: serde_json::Value = serde_json::from_slice(&wire[HEADER_LEN..]).unwrap();

    // Assert
    assert_eq!(wire[4], 0x07);
    assert_eq!(FrameType::from_byte(0x07), Some(FrameType::Restored));
    assert_eq!(payload["entropy"], "ab".repeat(32));
    assert_eq!(payload["realtime_ns"], 42);
    assert_eq!(payload["version"], PROTOCOL_VERSION);
}

#[test]
fn restored_without_a_hostname_decodes_with_none() {
    // Arrange: what a host that leaves the hostname alone may send.
    let mut wire = Vec::new();
    let json = br#"{"version":1,"entropy":"00ff","realtime_ns":7}"#;
    encode_raw(FrameType::Restored, json, &mut wire).unwrap();

    // Act
    let frame = read_frame(&mut Cursor::new(wire)).unwrap().unwrap();

    // Assert
    assert_eq!(
        frame,
        Frame::Restored(RestoredRequest {
            version: 1,
            entropy: vec![0x00, 0xff],
            realtime_ns: 7,
            hostname: None,
            share_params: Vec::new(),
            egress: false,
        })
    );
}

#[test]
fn restored_with_entropy_that_is_not_hex_is_rejected() {
    // Arrange
    let mut wire = Vec::new();
    let json = br#"{"version":1,"entropy":"0g","realtime_ns":7}"#;
    encode_raw(FrameType::Restored, json, &mut wire).unwrap();

    // Act
    let err = read_frame(&mut Cursor::new(wire)).unwrap_err();

    // Assert
    assert!(
        matches!(
            err,
            FrameError::BadJson {
                kind: FrameType::Restored,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn header_is_little_endian_length_of_type_plus_payload() {
    // Arrange
    let frame = Frame::Stdout(b"abc".to_vec());

    // Act
    let wire = frame.encode().unwrap();

    // Assert
    assert_eq!(
        wire,
        [4, 0, 0, 0, FrameType::Stdout as u8, b'a', b'b', b'c']
    );
}

#[test]
fn nul_bytes_and_split_utf8_pass_through_unchanged() {
    // Arrange: "é" is C3 A9; cut it in half across two frames, with NULs and invalid UTF-8.
    let first = vec![0u8, b'a', 0xC3];
    let second = vec![0xA9, 0, 0xFF, 0xFE, 0];

    // Act
    let a = round_trip(&Frame::Stdout(first.clone()));
    let b = round_trip(&Frame::Stdin(second.clone()));

    // Assert
    assert_eq!(a, Frame::Stdout(first));
    assert_eq!(b, Frame::Stdin(second));
}

#[test]
fn payload_of_exactly_max_frame_is_accepted() {
    // Arrange
    let frame = Frame::Data(vec![0xAB; MAX_FRAME as usize]);

    // Act
    let back = round_trip(&frame);

    // Assert
    assert_eq!(back, frame);
}

#[test]
fn writing_a_payload_over_max_frame_fails_without_writing() {
    // Arrange
    let frame = Frame::Data(vec![0; MAX_FRAME as usize + 1]);
    let mut wire = Vec::new();

    // Act
    let err = write_frame(&mut wire, &frame).unwrap_err();

    // Assert
    assert!(matches!(err, FrameError::TooLarge { .. }), "{err}");
    assert!(wire.is_empty());
}

#[test]
fn reading_an_oversized_length_fails_before_the_payload() {
    // Arrange: a header announcing 4 GiB, and no payload at all.
    let mut cursor = Cursor::new(header(u32::MAX, FrameType::Data as u8));

    // Act
    let err = read_frame(&mut cursor).unwrap_err();

    // Assert
    assert!(matches!(err, FrameError::TooLarge { .. }), "{err}");
}

#[test]
fn zero_length_frame_is_rejected() {
    // Arrange
    let mut cursor = Cursor::new(header(0, FrameType::End as u8));

    // Act
    let err = read_frame(&mut cursor).unwrap_err();

    // Assert
    assert!(matches!(err, FrameError::Empty), "{err}");
}

#[test]
fn unknown_frame_type_is_rejected() {
    // Arrange
    let mut cursor = Cursor::new(header(1, 0xEE));

    // Act
    let err = read_frame(&mut cursor).unwrap_err();

    // Assert
    assert!(matches!(err, FrameError::UnknownType(0xEE)), "{err}");
    assert!(err.to_string().contains("0xee"));
}

#[test]
fn truncated_header_and_truncated_payload_are_errors() {
    // Arrange
    let mut short_header = Cursor::new(vec![3, 0]);
    let mut wire = Frame::Stdout(b"hello".to_vec()).encode().unwrap();
    wire.truncate(wire.len() - 2);
    let mut short_payload = Cursor::new(wire);

    // Act
    let e1 = read_frame(&mut short_header).unwrap_err();
    let e2 = read_frame(&mut short_payload).unwrap_err();

    // Assert
    assert!(
        matches!(
            e1,
            FrameError::Truncated {
                expected: 5,
                got: 2
            }
        ),
        "{e1}"
    );
    assert!(
        matches!(
            e2,
            FrameError::Truncated {
                expected: 10,
                got: 8
            }
        ),
        "{e2}"
    );
}

#[test]
fn garbage_json_in_a_control_frame_is_rejected() {
    // Arrange
    let mut wire = Vec::new();
    encode_raw(FrameType::Exit, b"\xff{not json", &mut wire).unwrap();

    // Act
    let err = read_frame(&mut Cursor::new(wire)).unwrap_err();

    // Assert
    assert!(
        matches!(
            err,
            FrameError::BadJson {
                kind: FrameType::Exit,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn json_of_the_wrong_shape_is_rejected() {
    // Arrange: valid JSON, but an ExecRequest without argv.
    let mut wire = Vec::new();
    encode_raw(FrameType::Exec, br#"{"version":1}"#, &mut wire).unwrap();

    // Act
    let err = read_frame(&mut Cursor::new(wire)).unwrap_err();

    // Assert
    assert!(
        matches!(
            err,
            FrameError::BadJson {
                kind: FrameType::Exec,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn empty_frame_types_with_a_payload_are_rejected() {
    // Arrange
    let mut wire = Vec::new();
    encode_raw(FrameType::End, b"x", &mut wire).unwrap();

    // Act
    let err = read_frame(&mut Cursor::new(wire)).unwrap_err();

    // Assert
    assert!(
        matches!(err, FrameError::UnexpectedPayload { len: 1, .. }),
        "{err}"
    );
}

#[test]
fn optional_fields_may_be_omitted_and_unknown_fields_are_ignored() {
    // Arrange
    let mut wire = Vec::new();
    let json = br#"{"version":1,"argv":["true"],"future_field":{"x":1}}"#;
    encode_raw(FrameType::Exec, json, &mut wire).unwrap();

    // Act
    let frame = read_frame(&mut Cursor::new(wire)).unwrap().unwrap();

    // Assert
    assert_eq!(frame, Frame::Exec(ExecRequest::new(["true"])));
}

#[test]
fn decoder_yields_frames_fed_one_byte_at_a_time() {
    // Arrange
    let frames = every_kind_of_frame();
    let mut wire = Vec::new();
    for f in &frames {
        f.encode_into(&mut wire).unwrap();
    }
    let mut decoder = FrameDecoder::new();
    let mut out = Vec::new();

    // Act
    for byte in wire {
        decoder.push(&[byte]);
        while let Some(f) = decoder.next_frame().unwrap() {
            out.push(f);
        }
    }

    // Assert
    assert_eq!(out, frames);
    assert!(decoder.finish().is_ok());
}

#[test]
fn decoder_rejects_an_oversized_header_without_its_payload() {
    // Arrange
    let mut decoder = FrameDecoder::new();

    // Act
    decoder.push(&header(MAX_FRAME + 2, FrameType::Stdin as u8));
    let err = decoder.next_frame().unwrap_err();

    // Assert
    assert!(matches!(err, FrameError::TooLarge { .. }), "{err}");
}

#[test]
fn decoder_reports_a_partial_frame_at_end_of_stream() {
    // Arrange
    let mut decoder = FrameDecoder::new();
    let wire = Frame::Stdout(b"hello".to_vec()).encode().unwrap();

    // Act
    decoder.push(&wire[..7]);
    let pending = decoder.next_frame().unwrap();
    let err = decoder.finish().unwrap_err();

    // Assert
    assert_eq!(pending, None);
    assert!(
        matches!(
            err,
            FrameError::Truncated {
                expected: 10,
                got: 7
            }
        ),
        "{err}"
    );
}

#[test]
fn random_garbage_never_panics_the_reader() {
    // Arrange: a deterministic pseudo-random byte stream (xorshift).
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let garbage: Vec<u8> = (0..64 * 1024)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    let mut cursor = Cursor::new(garbage);

    // Act: read until the first error or the end.
    let mut frames = 0;
    let end = loop {
        match read_frame(&mut cursor) {
            Ok(Some(_)) => frames += 1,
            other => break other,
        }
    };

    // Assert: it stops with an error, not a panic or an endless loop.
    assert!(
        end.is_err(),
        "garbage decoded as {frames} frames and a clean end"
    );
}
