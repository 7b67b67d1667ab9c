//! Unix-socket primitives for the hybrid backend: the host listener that owns its socket file, a
//! connect that never blocks the event loop, and a send that never raises SIGPIPE.

use std::ffi::OsString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use super::Error;

/// The listening socket at `uds_path` that host clients connect to. Creating it creates the socket
/// file; dropping it removes the file.
#[derive(Debug)]
pub struct HostListener {
    listener: UnixListener,
    path: PathBuf,
}

impl HostListener {
    /// Binds a non-blocking listener at `path`.
    ///
    /// # Errors
    /// [`Error::UdsPathExists`] if anything (even a stale socket) is at `path` — the caller must
    /// remove it, as with Firecracker; [`Error::Bind`] for other bind failures.
    pub fn bind(path: &Path) -> Result<Self, Error> {
        if path.symlink_metadata().is_ok() {
            return Err(Error::UdsPathExists(path.to_owned()));
        }
        let listener = UnixListener::bind(path).map_err(|source| Error::Bind {
            path: path.to_owned(),
            source,
        })?;
        let listener = HostListener {
            listener,
            path: path.to_owned(),
        };
        listener
            .listener
            .set_nonblocking(true)
            .map_err(|source| Error::Bind {
                path: path.to_owned(),
                source,
            })?;
        Ok(listener)
    }

    /// The socket file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Accepts one pending client as a non-blocking stream; `Ok(None)` when none is waiting.
    ///
    /// # Errors
    /// The accept(2) error.
    pub fn accept(&self) -> io::Result<Option<UnixStream>> {
        match self.listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(true)?;
                Ok(Some(stream))
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e),
        }
    }
}

impl AsRawFd for HostListener {
    fn as_raw_fd(&self) -> RawFd {
        self.listener.as_raw_fd()
    }
}

impl Drop for HostListener {
    fn drop(&mut self) {
        match std::fs::remove_file(&self.path) {
            Ok(()) => {}
            // A jailed VMM has no write permission on the runtime directory once it dropped its
            // capabilities; the spawner removes the directory with the socket in it.
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
                tracing::debug!(
                    "vsock socket {} left to the spawner: {e}",
                    self.path.display()
                );
            }
            Err(e) => tracing::warn!("cannot remove vsock socket {}: {e}", self.path.display()),
        }
    }
}

/// The path host software listens on for guest connections to host port `port`: `<uds_path>_<port>`.
pub fn port_path(uds_path: &Path, port: u32) -> PathBuf {
    let mut name = OsString::from(uds_path.as_os_str());
    name.push(format!("_{port}"));
    PathBuf::from(name)
}

/// Connects a non-blocking stream socket to `path`. Fails (instead of blocking) when the listener's
/// backlog is full.
///
/// # Errors
/// `InvalidInput` for paths longer than `sun_path`; otherwise the socket(2)/connect(2) error
/// (`ENOENT`, `ECONNREFUSED`, `EAGAIN`, ...).
pub fn connect_nonblocking(path: &Path) -> io::Result<UnixStream> {
    let bytes = path.as_os_str().as_bytes();
    // SAFETY: sockaddr_un is plain old data; all-zero is a valid (empty) value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if bytes.is_empty() || bytes.len() >= addr.sun_path.len() {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (dst, src) in addr.sun_path.iter_mut().zip(bytes) {
        *dst = *src as libc::c_char;
    }
    let addr_len = std::mem::offset_of!(libc::sockaddr_un, sun_path) + bytes.len() + 1;

    let flags = libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC;
    // SAFETY: socket(2) takes no pointers; the result is checked.
    let fd = unsafe { libc::socket(libc::AF_UNIX, flags, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by socket(2) and nothing else owns it.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: `addr` is a valid sockaddr_un whose first `addr_len` bytes are initialised
    // (addr_len <= size_of::<sockaddr_un>() by the length check above); the fd is open.
    let ret = unsafe {
        libc::connect(
            socket.as_raw_fd(),
            std::ptr::from_ref(&addr).cast::<libc::sockaddr>(),
            addr_len as libc::socklen_t,
        )
    };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(UnixStream::from(socket))
}

/// Sends from `buf` without blocking and without SIGPIPE when the peer has gone (EPIPE instead).
///
/// # Errors
/// The send(2) error (`WouldBlock` when the socket buffer is full).
pub fn send_nosignal(stream: &UnixStream, buf: &[u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for reads of `buf.len()` bytes and the fd is open for the lifetime of
    // `stream`; send(2) does not retain the pointer.
    let ret = unsafe {
        libc::send(
            stream.as_raw_fd(),
            buf.as_ptr().cast(),
            buf.len(),
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret as usize)
    }
}

/// Puts `fd` in non-blocking mode.
///
/// # Errors
/// The fcntl(2) error.
pub fn set_nonblocking(fd: &impl AsRawFd) -> io::Result<()> {
    // SAFETY: F_GETFL on an fd the caller keeps open; no pointers involved.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: F_SETFL with an integer argument on the same open fd.
    let ret = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether the other end of `stream` has closed both directions (POLLHUP), as opposed to having
/// only shut down its write side.
pub fn peer_hung_up(stream: &UnixStream) -> bool {
    let mut pfd = libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: `pfd` is one valid pollfd; a zero timeout never blocks.
    let ret = unsafe { libc::poll(&mut pfd, 1, 0) };
    ret > 0 && pfd.revents & (libc::POLLHUP | libc::POLLERR) != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_path_appends_underscore_and_port() {
        assert_eq!(
            port_path(Path::new("/run/vm/v.sock"), 52),
            PathBuf::from("/run/vm/v.sock_52")
        );
    }

    #[test]
    fn bind_refuses_an_existing_path_and_drop_removes_the_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v.sock");
        std::fs::write(&path, b"").unwrap();

        let err = HostListener::bind(&path).unwrap_err();
        assert!(matches!(err, Error::UdsPathExists(_)), "{err}");

        std::fs::remove_file(&path).unwrap();
        let listener = HostListener::bind(&path).unwrap();
        assert!(path.exists());
        drop(listener);
        assert!(!path.exists());
    }

    #[test]
    fn connect_to_missing_listener_fails_without_blocking() {
        let dir = tempfile::tempdir().unwrap();

        let err = connect_nonblocking(&dir.path().join("nobody")).unwrap_err();

        assert_eq!(err.kind(), io::ErrorKind::NotFound);
    }

    #[test]
    fn send_to_closed_peer_is_epipe_not_a_signal() {
        let (a, b) = UnixStream::pair().unwrap();
        drop(b);

        let err = send_nosignal(&a, b"x").unwrap_err();

        assert_eq!(err.kind(), io::ErrorKind::BrokenPipe);
    }

    #[test]
    fn hang_up_is_distinguished_from_half_close() {
        let (a, b) = UnixStream::pair().unwrap();
        b.shutdown(std::net::Shutdown::Write).unwrap();
        assert!(!peer_hung_up(&a));

        drop(b);

        assert!(peer_hung_up(&a));
    }
}
