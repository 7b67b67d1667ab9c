//! The VMM's control socket (`bulkhead-vmm --api-sock PATH`): pause, resume and snapshot a running
//! VM from the host.
//!
//! Protocol: a client connects, writes one JSON request on one line and reads one JSON answer
//! line, `{"ok":true}` or `{"ok":false,"error":"..."}`; then the VMM closes the connection.
//! Requests:
//!
//! ```text
//! "pause"                                          vCPUs leave the guest; devices keep working
//! "resume"
//! {"snapshot":{"dir":"/path","resume":false}}      see `crate::snapshot`; without "resume":true
//!                                                  the VM stops once the snapshot is written
//! {"attach_share":{"tag":"mount0","read_only":true,"owner":null}}
//!                                                  the directory whose descriptor comes with the
//!                                                  request (SCM_RIGHTS) is served from now on by
//!                                                  the idle virtio-fs device `tag`
//! ```
//!
//! `attach_share` takes a descriptor, not a path: a jailed VMM sees only its private root, and
//! the host hands it exactly one directory (bulkhead sends a detached copy of the directory's
//! mount, `open_tree(2)` with `OPEN_TREE_CLONE`, where it may, so even the directory's parent is
//! out of reach). The guest sees nothing until its agent mounts the tag.
//!
//! The socket file is created mode 0600 (by umask-independent chmod) and removed when the VMM
//! ends. The event-loop thread reads a request with a 1 s timeout, so a client that connects and
//! says nothing delays the devices by at most that; the answer is written after the operation.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};
use serde::{Deserialize, Serialize};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use crate::snapshot::SnapshotRequest;

/// Longest request line accepted, bytes.
const MAX_REQUEST_BYTES: u64 = 64 * 1024;

/// How long the VMM waits for a connected client's request line.
const READ_TIMEOUT: Duration = Duration::from_secs(1);

/// Errors setting up the control socket.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Something already exists at the socket path.
    #[error("control socket {0}: the path exists; remove it first")]
    Exists(PathBuf),
    /// The socket could not be bound or configured.
    #[error("control socket {path}: {source}")]
    Bind {
        /// The path.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
}

/// A control request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Pause every vCPU.
    Pause,
    /// Resume every vCPU.
    Resume,
    /// Snapshot the VM (see [`crate::snapshot`]).
    Snapshot(SnapshotRequest),
    /// Serve the directory sent with the request from an idle virtio-fs device.
    AttachShare(AttachShare),
}

/// An [`Request::AttachShare`]: which device, and how the directory is served (as a boot's
/// `--share` would: see [`crate::config::ShareConfig`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttachShare {
    /// The virtio-fs device's mount tag; the guest must not have it mounted.
    pub tag: String,
    /// Refuse every write-type operation with `EROFS`.
    pub read_only: bool,
    /// `uid:gid` the share is served as; `None`: the directory's owner (as root), else the
    /// VMM's own identity.
    #[serde(default)]
    pub owner: Option<(u32, u32)>,
}

/// The answer to a [`Request`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Answer {
    /// Whether the request was carried out.
    pub ok: bool,
    /// Why not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Answer {
    /// The answer for `result`.
    pub fn of(result: Result<(), String>) -> Answer {
        match result {
            Ok(()) => Answer {
                ok: true,
                error: None,
            },
            Err(e) => Answer {
                ok: false,
                error: Some(e),
            },
        }
    }
}

/// A parsed request and the connection its answer goes to.
#[derive(Debug)]
pub struct Pending {
    /// The request.
    pub request: Request,
    /// The descriptor that came with it (SCM_RIGHTS), if any.
    pub file: Option<File>,
    stream: UnixStream,
}

impl Pending {
    /// Writes `answer` as one line and closes the connection. A client that went away is only
    /// logged.
    pub fn answer(mut self, answer: &Answer) {
        let mut line = serde_json::to_vec(answer).unwrap_or_else(|_| b"{\"ok\":false}".to_vec());
        line.push(b'\n');
        if let Err(e) = self.stream.write_all(&line) {
            tracing::debug!("control socket: cannot answer: {e}");
        }
    }
}

/// Requests received and not yet carried out (the VMM's event loop takes them).
pub type Inbox = Arc<Mutex<Vec<Pending>>>;

/// The listening control socket, an event-loop subscriber.
#[derive(Debug)]
pub struct ControlSocket {
    listener: UnixListener,
    path: PathBuf,
    inbox: Inbox,
}

impl ControlSocket {
    /// Binds the socket at `path` (mode 0600).
    ///
    /// # Errors
    /// [`Error::Exists`], [`Error::Bind`].
    pub fn bind(path: &Path) -> Result<ControlSocket, Error> {
        if path.symlink_metadata().is_ok() {
            return Err(Error::Exists(path.to_owned()));
        }
        let bind = |source| Error::Bind {
            path: path.to_owned(),
            source,
        };
        let listener = UnixListener::bind(path).map_err(bind)?;
        let socket = ControlSocket {
            listener,
            path: path.to_owned(),
            inbox: Inbox::default(),
        };
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(bind)?;
        socket.listener.set_nonblocking(true).map_err(bind)?;
        Ok(socket)
    }

    /// Where received requests are put.
    pub fn inbox(&self) -> Inbox {
        Arc::clone(&self.inbox)
    }

    /// Accepts every waiting client and reads its request; bad requests are answered at once.
    fn accept_all(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => self.read_request(stream),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    tracing::warn!("control socket: accept failed: {e}");
                    return;
                }
            }
        }
    }

    fn read_request(&mut self, stream: UnixStream) {
        match parse_request(&stream) {
            Ok((request, file)) => {
                self.inbox
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(Pending {
                        request,
                        file,
                        stream,
                    })
            }
            Err(e) => Pending {
                request: Request::Resume,
                file: None,
                stream,
            }
            .answer(&Answer::of(Err(e))),
        }
    }
}

/// Reads and parses one request line from `stream`, with the descriptor sent with its first
/// bytes, if any (a descriptor sent later is closed).
fn parse_request(stream: &UnixStream) -> Result<(Request, Option<File>), String> {
    stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_read_timeout(Some(READ_TIMEOUT)))
        .map_err(|e| format!("cannot configure the connection: {e}"))?;
    let mut first = [0u8; 4096];
    let (len, file) = stream
        .recv_with_fd(&mut first)
        .map_err(|e| format!("cannot read the request: {e}"))?;
    let mut line = first[..len].to_vec();
    if len > 0 && !line.contains(&b'\n') {
        let rest = MAX_REQUEST_BYTES.saturating_sub(len as u64);
        BufReader::new(stream.take(rest))
            .read_until(b'\n', &mut line)
            .map_err(|e| format!("cannot read the request: {e}"))?;
    }
    let line = String::from_utf8_lossy(&line);
    let request = serde_json::from_str(line.trim()).map_err(|e| {
        format!(
            "bad request {:?}: {e}; expected \"pause\", \"resume\", {{\"snapshot\":{{\"dir\":\"...\"}}}} or {{\"attach_share\":{{...}}}}",
            line.trim()
        )
    })?;
    Ok((request, file))
}

impl Drop for ControlSocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl MutEventSubscriber for ControlSocket {
    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        if events.fd() == self.listener.as_raw_fd() {
            self.accept_all();
        }
    }

    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::new(&self.listener, EventSet::IN)) {
            tracing::error!("cannot watch the control socket: {e}");
        }
    }
}

/// Sends `request` to the control socket at `path` and returns the answer (for clients and
/// tests).
///
/// # Errors
/// The connection or parse error, as text.
pub fn send(path: &Path, request: &Request) -> Result<Answer, String> {
    send_with(path, request, None)
}

/// Like [`send`], with `fd` passed along (SCM_RIGHTS): the directory of a
/// [`Request::AttachShare`]; a VMM that takes longer than `timeout` to read the request or to
/// answer is an error.
///
/// # Errors
/// The connection, timeout or parse error, as text.
pub fn send_with_fd(
    path: &Path,
    request: &Request,
    fd: BorrowedFd<'_>,
    timeout: Duration,
) -> Result<Answer, String> {
    send_with(path, request, Some((fd, timeout)))
}

fn send_with(
    path: &Path,
    request: &Request,
    fd: Option<(BorrowedFd<'_>, Duration)>,
) -> Result<Answer, String> {
    let mut stream = UnixStream::connect(path)
        .map_err(|e| format!("cannot connect to {}: {e}", path.display()))?;
    if let Some((_, timeout)) = fd {
        stream
            .set_read_timeout(Some(timeout))
            .and_then(|()| stream.set_write_timeout(Some(timeout)))
            .map_err(|e| e.to_string())?;
    }
    let mut line = serde_json::to_vec(request).map_err(|e| e.to_string())?;
    line.push(b'\n');
    match fd {
        // One message: the descriptor travels with the first byte, the rest follows if the
        // kernel took only part of the line.
        Some((fd, _)) => {
            let sent = stream
                .send_with_fd(&line[..], fd.as_raw_fd())
                .map_err(|e| e.to_string())?;
            stream.write_all(&line[sent..]).map_err(|e| e.to_string())?;
        }
        None => stream.write_all(&line).map_err(|e| e.to_string())?,
    }
    let mut answer = String::new();
    BufReader::new(stream)
        .read_line(&mut answer)
        .map_err(|e| e.to_string())?;
    serde_json::from_str(answer.trim()).map_err(|e| format!("bad answer {answer:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_have_a_stable_wire_form() {
        let snapshot = Request::Snapshot(SnapshotRequest {
            dir: "/s".into(),
            resume: false,
        });

        assert_eq!(serde_json::to_string(&Request::Pause).unwrap(), "\"pause\"");
        assert_eq!(
            serde_json::from_str::<Request>(r#"{"snapshot":{"dir":"/s"}}"#).unwrap(),
            snapshot
        );
        assert!(serde_json::from_str::<Request>(r#"{"snapshot":{"dir":"/s","x":1}}"#).is_err());
        assert_eq!(
            serde_json::from_str::<Request>(
                r#"{"attach_share":{"tag":"mount0","read_only":true}}"#
            )
            .unwrap(),
            Request::AttachShare(AttachShare {
                tag: "mount0".into(),
                read_only: true,
                owner: None,
            })
        );
    }

    #[test]
    fn a_descriptor_sent_with_a_request_arrives_with_it() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("api.sock");
        let mut socket = ControlSocket::bind(&path).unwrap();
        let client = UnixStream::connect(&path).unwrap();
        let shared = File::open(dir.path()).unwrap();
        let line = br#"{"attach_share":{"tag":"mount0","read_only":false,"owner":[1,2]}}"#;
        let mut message = line.to_vec();
        message.push(b'\n');

        // Act
        client
            .send_with_fd(&message[..], shared.as_raw_fd())
            .unwrap();
        socket.accept_all();

        // Assert
        let pending = socket.inbox().lock().unwrap().pop().unwrap();
        let Request::AttachShare(attach) = &pending.request else {
            panic!("{:?}", pending.request);
        };
        assert_eq!(
            (attach.tag.as_str(), attach.owner),
            ("mount0", Some((1, 2)))
        );
        let received = pending.file.as_ref().unwrap().metadata().unwrap();
        let sent = shared.metadata().unwrap();
        use std::os::unix::fs::MetadataExt;
        assert_eq!((received.dev(), received.ino()), (sent.dev(), sent.ino()));
    }

    #[test]
    fn a_bad_request_is_answered_with_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("api.sock");
        let mut socket = ControlSocket::bind(&path).unwrap();
        let mut client = UnixStream::connect(&path).unwrap();
        client.write_all(b"reboot\n").unwrap();

        socket.accept_all();

        let mut answer = String::new();
        BufReader::new(client).read_line(&mut answer).unwrap();
        let answer: Answer = serde_json::from_str(&answer).unwrap();
        assert!(!answer.ok);
        assert!(answer.error.unwrap().contains("expected \"pause\""));
        assert!(socket.inbox().lock().unwrap().is_empty());
    }

    #[test]
    fn a_good_request_waits_in_the_inbox_and_the_socket_is_private() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("api.sock");
        let mut socket = ControlSocket::bind(&path).unwrap();
        let mut client = UnixStream::connect(&path).unwrap();
        client.write_all(b"\"pause\"\n").unwrap();

        socket.accept_all();

        let pending = socket.inbox().lock().unwrap().pop().unwrap();
        assert_eq!(pending.request, Request::Pause);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        drop(socket);
        assert!(!path.exists());
    }
}
