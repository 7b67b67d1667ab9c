//! The request server: accept connections, one thread each, dispatch on the first frame.
//! Also the boot-time `Ready` announcement.

use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::thread;
use std::time::Duration;

use bulkhead_protocol::{
    read_frame, write_frame, Ack, ErrorCode, Frame, Ready, ShutdownRequest, PROTOCOL_VERSION,
    READY_PORT,
};

use crate::conn::Conn;
use crate::{exec, files, init, log, vsock, workspace};

/// Delays before the retries of the `Ready` connection (4 retries, 300 ms in all).
const READY_RETRY_DELAYS: [Duration; 4] = [
    Duration::from_millis(20),
    Duration::from_millis(40),
    Duration::from_millis(80),
    Duration::from_millis(160),
];

/// Pause after a failed `accept` (e.g. out of descriptors) so the loop does not spin.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(50);

/// Where requests come from.
#[derive(Debug)]
pub enum Listener {
    /// The guest's vsock listener on [`bulkhead_protocol::AGENT_PORT`].
    Vsock(OwnedFd),
    /// A Unix socket (test mode).
    Unix(UnixListener),
}

impl Listener {
    fn accept(&self) -> io::Result<Conn> {
        match self {
            Self::Vsock(fd) => vsock::accept(fd).map(Conn::new),
            Self::Unix(l) => l.accept().map(|(s, _)| Conn::new(OwnedFd::from(s))),
        }
    }
}

/// What a `Shutdown` request does after it is acknowledged.
#[derive(Debug, Clone, Copy)]
pub enum ShutdownAction {
    /// `sync` and `reboot(RB_AUTOBOOT)`: ends the VM (PID-1 mode).
    Reboot,
    /// Exit the agent process (test mode).
    Exit,
    /// Call this function, which ends the process (a stand-in VMM reports the guest's reset).
    Call(fn() -> !),
}

/// Where the `Ready` frame goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadyTarget {
    /// vsock CID 2 (the host), port [`READY_PORT`].
    Vsock,
    /// A Unix socket path (test mode).
    Unix(PathBuf),
}

/// Serves connections forever, one thread per connection.
pub fn serve(listener: &Listener, on_shutdown: ShutdownAction) -> ! {
    loop {
        match listener.accept() {
            Ok(conn) => {
                let spawned = thread::Builder::new()
                    .name("conn".into())
                    .spawn(move || handle_connection(conn, on_shutdown));
                if let Err(e) = spawned {
                    log!("cannot start a connection thread: {e}");
                }
            }
            Err(e) => {
                log!("accept: {e}");
                thread::sleep(ACCEPT_ERROR_PAUSE);
            }
        }
    }
}

/// Reads the connection's one request and serves it.
pub fn handle_connection(mut conn: Conn, on_shutdown: ShutdownAction) {
    let request = match read_frame(&mut conn) {
        Ok(Some(frame)) => frame,
        Ok(None) => return,
        Err(e) => return reply_error(conn, ErrorCode::Protocol, format!("bad request: {e}")),
    };
    match request {
        Frame::Exec(req) => exec::serve(conn, &req),
        Frame::FileWrite(req) => files::serve_write(conn, &req),
        Frame::FileRead(req) => files::serve_read(conn, &req),
        Frame::Shutdown(req) => shutdown(conn, req, on_shutdown),
        Frame::WorkspaceChanges(req) => workspace::serve_changes(conn, &req),
        other => reply_error(
            conn,
            ErrorCode::Protocol,
            format!(
                "expected Exec, FileWrite, FileRead, WorkspaceChanges or Shutdown as the first \
                 frame, got {}",
                other.kind()
            ),
        ),
    }
}

fn reply_error(mut conn: Conn, code: ErrorCode, message: String) {
    let _ = write_frame(&mut conn, &Frame::error(code, message));
}

fn shutdown(mut conn: Conn, req: ShutdownRequest, action: ShutdownAction) {
    if req.version != PROTOCOL_VERSION {
        return reply_error(
            conn,
            ErrorCode::UnsupportedVersion,
            format!(
                "unsupported protocol version {} (this agent speaks {PROTOCOL_VERSION})",
                req.version
            ),
        );
    }
    let _ = write_frame(&mut conn, &Frame::Ack(Ack { bytes: 0 }));
    drop(conn);
    match action {
        ShutdownAction::Reboot => init::reboot(),
        ShutdownAction::Exit => std::process::exit(0),
        ShutdownAction::Call(end) => end(),
    }
}

/// Sends `ready` to `target`, retrying a failed connection a few times quickly
/// (4 retries after 20, 40, 80 and 160 ms); failures are logged. Returns whether it was
/// delivered.
pub fn announce_ready(target: &ReadyTarget, ready: &Ready) -> bool {
    let frame = Frame::Ready(ready.clone());
    let mut delays = READY_RETRY_DELAYS.iter();
    loop {
        match send_ready_once(target, &frame) {
            Ok(()) => return true,
            Err(e) => match delays.next() {
                Some(delay) => {
                    log!("ready: connecting to the host failed ({e}); retrying");
                    thread::sleep(*delay);
                }
                None => {
                    log!("ready: giving up announcing readiness: {e}");
                    return false;
                }
            },
        }
    }
}

fn send_ready_once(target: &ReadyTarget, frame: &Frame) -> io::Result<()> {
    let fd = match target {
        ReadyTarget::Vsock => vsock::connect(vsock::HOST_CID, READY_PORT)?,
        ReadyTarget::Unix(path) => OwnedFd::from(UnixStream::connect(path)?),
    };
    let mut conn = Conn::new(fd);
    write_frame(&mut conn, frame).map_err(io::Error::other)
}
