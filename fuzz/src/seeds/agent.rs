//! Seeds of `agent_frames`: what a well-behaved agent sends in each mode.

use bulkhead_protocol::{
    Ack, BootTimestamps, ChangeRecord, ChangeStatus, ChangesEnd, EntryKind, ErrorCode,
    ErrorMessage, ExitStatus, Frame, Ready, SkippedEntry, Started, PROTOCOL_VERSION,
};

use super::Seed;

/// Mode byte, chunk byte, then the encoded frames.
fn seed(mode: u8, chunk: u8, frames: &[Frame]) -> Vec<u8> {
    let mut out = vec![mode, chunk];
    for frame in frames {
        frame.encode_into(&mut out).expect("seed frame encodes");
    }
    out
}

fn exit(code: i32) -> Frame {
    Frame::Exit(ExitStatus {
        code: Some(code),
        signal: None,
        timed_out: false,
        oom_killed: false,
    })
}

/// Seeds of `agent_frames`.
pub fn seeds() -> Vec<Seed> {
    let ready = Frame::Ready(Ready {
        version: PROTOCOL_VERSION,
        agent_version: "0.1.0".into(),
        init_started: BootTimestamps {
            boottime_ns: 1_000_000,
            realtime_ns: 1_700_000_000_000_000_000,
        },
        listening: BootTimestamps {
            boottime_ns: 2_000_000,
            realtime_ns: 1_700_000_000_001_000_000,
        },
    });
    let change = |path: &str, data: bool| {
        Frame::Change(ChangeRecord {
            path: path.into(),
            status: ChangeStatus::Modified,
            kind: EntryKind::File,
            mode: 0o644,
            size: 5,
            data,
        })
    };
    let changes_end = Frame::ChangesEnd(ChangesEnd {
        changes: 2,
        skipped: vec![SkippedEntry {
            path: "dev/null".into(),
            reason: "special file".into(),
        }],
    });
    let error = Frame::Error(ErrorMessage::new(
        ErrorCode::NotFound,
        "open /nope: No such file or directory (os error 2)",
    ));
    vec![
        (
            "agent_frames",
            "decode-mixed",
            seed(
                0,
                6,
                &[
                    ready.clone(),
                    Frame::Started(Started { pid: 42 }),
                    Frame::Stdout(b"out".to_vec()),
                    Frame::StdinEof,
                    Frame::Ack(Ack { bytes: 3 }),
                    error.clone(),
                ],
            ),
        ),
        (
            "agent_frames",
            "exec",
            seed(
                1,
                0,
                &[
                    Frame::Started(Started { pid: 42 }),
                    Frame::Stdout(b"hello\n".to_vec()),
                    Frame::Stderr(b"warn\n".to_vec()),
                    exit(3),
                ],
            ),
        ),
        (
            "agent_frames",
            "exec-error",
            seed(1, 255, std::slice::from_ref(&error)),
        ),
        (
            "agent_frames",
            "read-file",
            seed(
                2,
                16,
                &[
                    Frame::Data(b"bulkhead\n".to_vec()),
                    Frame::Data(vec![0; 100]),
                    Frame::End,
                ],
            ),
        ),
        (
            "agent_frames",
            "write-file",
            seed(3, 3, &[Frame::Ack(Ack { bytes: 8 })]),
        ),
        (
            "agent_frames",
            "shutdown",
            seed(4, 1, &[Frame::Ack(Ack { bytes: 0 })]),
        ),
        (
            "agent_frames",
            "workspace-changes",
            seed(
                5,
                31,
                &[
                    change("src/main.rs", true),
                    Frame::Data(b"hello".to_vec()),
                    Frame::End,
                    change("README.md", false),
                    changes_end,
                ],
            ),
        ),
        ("agent_frames", "ready", seed(6, 9, &[ready])),
    ]
}
