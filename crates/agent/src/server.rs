//! The request server: accept connections, one thread each, dispatch on the first frame.
//! Also the boot-time `Ready` announcement.
//!
//! # Broken connections, and what a snapshot restore does to them
//!
//! Nothing that happens to one connection ends the server: a failed `accept` is logged and
//! retried after a 50 ms pause, and each connection is served on its own thread, whose
//! read and write errors (`ECONNRESET`, `EPIPE`, `ENOTCONN`) only end that request; writes use
//! `MSG_NOSIGNAL`, so no `SIGPIPE` either. This matters after a snapshot restore: the VMM's
//! vsock device then sends `VIRTIO_VSOCK_EVENT_TRANSPORT_RESET`, and the guest kernel resets
//! every *connected* vsock socket (`virtio_vsock_event_handle` in
//! `net/vmw_vsock/virtio_transport.c`), while the listening socket keeps listening. A request
//! that was in flight during the snapshot then fails like one whose host went away: a file
//! transfer or change set stops, and an exec streaming output is treated as a host disconnect
//! (its process group gets `SIGHUP`, then `SIGKILL` after [`crate::exec::HANGUP_GRACE`], as
//! today when the host drops an exec). Its thread waits only for its own command, so the other
//! connections go on.

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
use crate::{exec, files, fsops, ingress, init, log, mounts, restore, vsock, workspace};

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

/// Serves connections forever, one thread per connection (see the module docs on errors).
pub fn serve(listener: &Listener, on_shutdown: ShutdownAction) -> ! {
    loop {
        serve_next(listener, on_shutdown);
    }
}

/// Accepts one connection and serves it on a new thread. An `accept` error is logged and
/// followed by [`ACCEPT_ERROR_PAUSE`], so the loop does not spin; nothing is returned, since
/// nothing that goes wrong here may end the server.
fn serve_next(listener: &Listener, on_shutdown: ShutdownAction) {
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
        Frame::Restored(req) => restore::serve(conn, &req),
        Frame::ArchiveWrite(req) => fsops::serve_archive_write(conn, &req),
        Frame::ArchiveRead(req) => fsops::serve_archive_read(conn, &req),
        Frame::Fs(req) => fsops::serve_fs(conn, &req),
        Frame::Connect(req) => ingress::serve(conn, req),
        Frame::Shares(req) => mounts::serve(conn, &req),
        other => reply_error(
            conn,
            ErrorCode::Protocol,
            format!(
                "expected Exec, FileWrite, FileRead, ArchiveWrite, ArchiveRead, Fs, Connect, \
                 Shares, WorkspaceChanges, Shutdown or Restored as the first frame, got {}",
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

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsRawFd;

    use bulkhead_protocol::{FileReadRequest, RestoredRequest};

    use super::*;

    fn no_shutdown() -> ! {
        panic!("no request in these tests may shut the agent down")
    }

    const NO_SHUTDOWN: ShutdownAction = ShutdownAction::Call(no_shutdown);

    /// A valid `Restored` request (answered without touching this machine: tests never call
    /// `restore::apply_to_kernel`).
    fn restored() -> Frame {
        Frame::Restored(RestoredRequest::new(vec![7; 32], 1_700_000_000_000_000_000))
    }

    /// Closes `stream` with a TCP reset instead of a FIN (`SO_LINGER` on, timeout 0).
    fn reset(stream: TcpStream) {
        let linger = libc::linger {
            l_onoff: 1,
            l_linger: 0,
        };
        // SAFETY: `linger` is a valid struct linger of the size passed, alive during the call.
        let rc = unsafe {
            libc::setsockopt(
                stream.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                (&linger as *const libc::linger).cast(),
                std::mem::size_of::<libc::linger>() as libc::socklen_t,
            )
        };
        assert_eq!(rc, 0, "{}", io::Error::last_os_error());
        drop(stream);
    }

    fn unix_listener() -> (tempfile::TempDir, PathBuf, UnixListener) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        let listener = UnixListener::bind(&path).unwrap();
        (dir, path, listener)
    }

    #[test]
    fn a_connection_reset_in_the_middle_of_a_request_ends_only_that_request() {
        // Arrange: half a Restored frame, then a reset, as a snapshot restore does to a
        // connection that was open (ECONNRESET on the agent's side).
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut host = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (agent_side, _) = listener.accept().unwrap();
        let wire = restored().encode().unwrap();
        host.write_all(&wire[..wire.len() / 2]).unwrap();
        reset(host);

        // Act: returns (instead of panicking or shutting down) once the reset is seen.
        handle_connection(Conn::new(OwnedFd::from(agent_side)), NO_SHUTDOWN);

        // Assert: the same thread goes on to serve the next connection.
        let (mut host, agent_side) = UnixStream::pair().unwrap();
        write_frame(&mut host, &restored()).unwrap();
        handle_connection(Conn::new(OwnedFd::from(agent_side)), NO_SHUTDOWN);
        let reply = read_frame(&mut host).unwrap();
        assert_eq!(reply, Some(Frame::Ack(Ack { bytes: 0 })));
    }

    #[test]
    fn an_accept_error_is_survived_and_the_next_connection_served() {
        // Arrange: a non-blocking listener with nobody connecting fails accept (EAGAIN).
        let (_dir, path, listener) = unix_listener();
        listener.set_nonblocking(true).unwrap();
        let listener = Listener::Unix(listener);

        // Act
        serve_next(&listener, NO_SHUTDOWN);
        let mut host = UnixStream::connect(&path).unwrap();
        write_frame(&mut host, &restored()).unwrap();
        serve_next(&listener, NO_SHUTDOWN);
        let reply = read_frame(&mut host).unwrap();

        // Assert
        assert_eq!(reply, Some(Frame::Ack(Ack { bytes: 0 })));
    }

    #[test]
    fn the_server_keeps_serving_after_connections_break_mid_reply_and_mid_request() {
        // Arrange: a file bigger than the socket buffers, so its transfer is cut mid-stream.
        let (dir, path, listener) = unix_listener();
        let file = dir.path().join("big");
        std::fs::write(&file, vec![0x42u8; 4 << 20]).unwrap();
        thread::spawn(move || serve(&Listener::Unix(listener), NO_SHUTDOWN));

        // Act: a host that leaves after the first Data frame (EPIPE for the agent), one that
        // leaves inside its request, then a well-behaved one.
        let mut reader = UnixStream::connect(&path).unwrap();
        let request = Frame::FileRead(FileReadRequest {
            version: PROTOCOL_VERSION,
            path: file.to_str().unwrap().into(),
        });
        write_frame(&mut reader, &request).unwrap();
        let first = read_frame(&mut reader).unwrap();
        drop(reader);
        let mut quitter = UnixStream::connect(&path).unwrap();
        quitter
            .write_all(&restored().encode().unwrap()[..7])
            .unwrap();
        drop(quitter);
        let mut host = UnixStream::connect(&path).unwrap();
        write_frame(&mut host, &restored()).unwrap();
        let reply = read_frame(&mut host).unwrap();
        let mut rest = Vec::new();
        host.read_to_end(&mut rest).unwrap();

        // Assert
        assert!(matches!(first, Some(Frame::Data(_))), "{first:?}");
        assert_eq!(reply, Some(Frame::Ack(Ack { bytes: 0 })));
        assert!(rest.is_empty());
    }
}
