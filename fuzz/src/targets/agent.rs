//! `agent_frames`: the bytes the host reads from the guest agent, through the protocol crate's
//! framing, message decoding and host-side client sequences.
//!
//! Every input is decoded twice, by `read_frame` on a byte stream and by `FrameDecoder` fed in
//! chunks, which must agree frame for frame; every decoded frame must survive an encode/decode
//! round trip. Then, depending on the mode, a host-side client call reads the same bytes as the
//! agent's answer from a real Unix socket: a fake agent thread accepts the client's connection,
//! sends the bytes, shuts its write side down and reads whatever the client sends until it
//! closes. The call's result does not matter; it must return (no hang) without panicking.
//!
//! # Input
//! - byte 0: mode (`% 7`): 0 decoding only; 1 `exec` + `wait_with_output`; 2 `read_file`;
//!   3 `write_file`; 4 `shutdown`; 5 `workspace_changes` read to the end; 6 `accept_ready`;
//! - byte 1: chunk size − 1 for `FrameDecoder` (1–256 bytes);
//! - the rest: what the agent sends.

use std::io::{Read, Write};
use std::mem::discriminant;
use std::net::Shutdown;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use bulkhead_protocol::client::{accept_ready, AgentClient, ChangeEvent};
use bulkhead_protocol::{
    read_frame, ExecRequest, Frame, FrameDecoder, FrameError, WorkspaceChangesRequest,
    PROTOCOL_VERSION,
};

use crate::ignore_sigpipe;
use crate::input::Input;

/// Bound on each blocking client read (the fake agent always ends its stream, so this only
/// matters if the client waits for something that never comes: a hang, reported as a crash).
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(5);

/// Modes of byte 0.
pub const MODES: [&str; 7] = [
    "decode",
    "exec",
    "read_file",
    "write_file",
    "shutdown",
    "workspace_changes",
    "accept_ready",
];

/// Runs one input.
pub fn run(data: &[u8]) {
    ignore_sigpipe();
    let mut input = Input::new(data);
    let mode = input.u8() % MODES.len() as u8;
    let chunk = usize::from(input.u8()) + 1;
    let agent_bytes = input.rest();
    check_decoders_agree(agent_bytes, chunk);
    match mode {
        0 => {}
        6 => ready(agent_bytes),
        _ => with_fake_agent(agent_bytes, |client| client_call(client, mode)),
    }
}

/// The frames of `bytes` and whether decoding ended in an error (and which).
type Decoded = (Vec<Frame>, Option<std::mem::Discriminant<FrameError>>);

/// Decodes `bytes` with `read_frame` and with a `FrameDecoder` fed `chunk` bytes at a time;
/// panics if they disagree or a frame does not survive re-encoding.
pub fn check_decoders_agree(bytes: &[u8], chunk: usize) {
    let by_stream = decode_stream(bytes);
    let by_chunks = decode_chunks(bytes, chunk);
    assert_eq!(by_stream, by_chunks, "read_frame and FrameDecoder disagree");
    for frame in &by_stream.0 {
        let Ok(encoded) = frame.encode() else {
            continue;
        };
        let again = read_frame(&mut &encoded[..]).expect("re-encoded frame decodes");
        assert_eq!(
            again.as_ref(),
            Some(frame),
            "frame changed in an encode/decode round trip"
        );
    }
}

fn decode_stream(mut bytes: &[u8]) -> Decoded {
    let mut frames = Vec::new();
    loop {
        match read_frame(&mut bytes) {
            Ok(Some(frame)) => frames.push(frame),
            Ok(None) => return (frames, None),
            Err(e) => return (frames, Some(discriminant(&e))),
        }
    }
}

fn decode_chunks(bytes: &[u8], chunk: usize) -> Decoded {
    let mut decoder = FrameDecoder::new();
    let mut frames = Vec::new();
    for piece in bytes.chunks(chunk) {
        decoder.push(piece);
        loop {
            match decoder.next_frame() {
                Ok(Some(frame)) => frames.push(frame),
                Ok(None) => break,
                Err(e) => return (frames, Some(discriminant(&e))),
            }
        }
    }
    match decoder.finish() {
        Ok(()) => (frames, None),
        Err(e) => (frames, Some(discriminant(&e))),
    }
}

/// One host-side client call against the fake agent.
fn client_call(client: &AgentClient, mode: u8) {
    match mode {
        1 => {
            if let Ok(session) = client.exec(&ExecRequest::new(["true"])) {
                let _ = session.wait_with_output();
            }
        }
        2 => {
            let _ = client.read_file("/etc/hostname");
        }
        3 => {
            let _ = client.write_file("/tmp/x", 0o644, b"contents");
        }
        4 => {
            let _ = client.shutdown();
        }
        _ => {
            let request = WorkspaceChangesRequest {
                version: PROTOCOL_VERSION,
                contents: true,
                content_names: Vec::new(),
                link_targets: true,
            };
            if let Ok(mut changes) = client.workspace_changes(&request) {
                while let Ok(event) = changes.next_event() {
                    if matches!(event, ChangeEvent::Done(_)) {
                        break;
                    }
                }
            }
        }
    }
}

/// The boot-time handshake: the agent connects, sends `bytes` and closes its write side.
fn ready(bytes: &[u8]) {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("v.sock_1025");
    let listener = UnixListener::bind(&path).expect("ready listener");
    let mut agent = UnixStream::connect(&path).expect("connect");
    agent
        .set_write_timeout(Some(CLIENT_TIMEOUT))
        .expect("write timeout");
    // Inputs are far below a Unix socket's buffer size, so this does not block.
    let _ = agent.write_all(bytes);
    let _ = agent.shutdown(Shutdown::Write);
    let _ = accept_ready(&listener, CLIENT_TIMEOUT);
}

/// A fake agent on a Unix socket, on its own thread, kept for the whole process.
struct FakeAgent {
    client: AgentClient,
    answers: Sender<Vec<u8>>,
    done: Receiver<()>,
    _dir: tempfile::TempDir,
}

/// Runs `call` with a client whose connection the fake agent answers with `bytes`.
fn with_fake_agent(bytes: &[u8], call: impl FnOnce(&AgentClient)) {
    static AGENT: OnceLock<Mutex<FakeAgent>> = OnceLock::new();
    let agent = AGENT
        .get_or_init(|| Mutex::new(FakeAgent::start()))
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    agent
        .answers
        .send(bytes.to_vec())
        .expect("fake agent alive");
    call(&agent.client);
    agent
        .done
        .recv()
        .expect("fake agent finished the connection");
}

impl FakeAgent {
    fn start() -> FakeAgent {
        let dir = tempfile::tempdir().expect("temporary directory");
        let path: PathBuf = dir.path().join("agent.sock");
        let listener = UnixListener::bind(&path).expect("agent listener");
        let (answers, todo) = channel::<Vec<u8>>();
        let (finished, done) = channel();
        std::thread::spawn(move || {
            while let Ok(bytes) = todo.recv() {
                if let Ok((conn, _)) = listener.accept() {
                    serve(conn, &bytes);
                }
                if finished.send(()).is_err() {
                    return;
                }
            }
        });
        FakeAgent {
            client: AgentClient::unix(path).with_timeout(CLIENT_TIMEOUT),
            answers,
            done,
            _dir: dir,
        }
    }
}

/// Sends `bytes`, ends the stream, then reads what the client sends until it closes.
fn serve(mut conn: UnixStream, bytes: &[u8]) {
    let _ = conn.set_write_timeout(Some(CLIENT_TIMEOUT));
    let _ = conn.set_read_timeout(Some(CLIENT_TIMEOUT));
    let _ = conn.write_all(bytes);
    let _ = conn.shutdown(Shutdown::Write);
    let mut sink = [0u8; 16 << 10];
    while matches!(conn.read(&mut sink), Ok(n) if n > 0) {}
}
