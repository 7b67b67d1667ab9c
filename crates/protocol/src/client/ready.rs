//! The boot-time ready handshake: the agent connects to the host's `<uds>_1025` listener and
//! sends one `Ready` frame.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::time::{Duration, Instant};

use super::hybrid::remaining;
use super::{classify, ClientError};
use crate::frame::{read_frame, Frame};
use crate::messages::Ready;
use crate::PROTOCOL_VERSION;

/// Accepts one connection on `listener` (bound at `<vm vsock socket>_1025`, see
/// [`crate::READY_PORT`]) and reads the agent's [`Ready`], all within `timeout`.
/// Fails on timeout, on any other first frame, and on a protocol version other than
/// [`PROTOCOL_VERSION`].
pub fn accept_ready(listener: &UnixListener, timeout: Duration) -> Result<Ready, ClientError> {
    let deadline = Instant::now() + timeout;
    wait_readable(listener, deadline)?;
    let (stream, _) = listener.accept()?;
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(remaining(deadline)?))?;
    match read_frame(&mut &stream).map_err(classify)? {
        Some(Frame::Ready(ready)) if ready.version == PROTOCOL_VERSION => Ok(ready),
        Some(Frame::Ready(ready)) => Err(ClientError::VersionMismatch {
            agent: ready.version,
            host: PROTOCOL_VERSION,
        }),
        Some(Frame::Error(e)) => Err(ClientError::Agent(e)),
        Some(other) => Err(ClientError::Unexpected {
            expected: "Ready",
            got: other.kind(),
        }),
        None => Err(ClientError::Closed("sending Ready")),
    }
}

/// Waits until `listener` has a connection to accept, or `deadline` passes.
fn wait_readable(listener: &UnixListener, deadline: Instant) -> Result<(), ClientError> {
    loop {
        let left = remaining(deadline)?;
        let mut pfd = libc::pollfd {
            fd: listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = left.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
        // SAFETY: `pfd` is a valid pollfd array of length 1 that lives across the call.
        let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
        if rc > 0 {
            return Ok(());
        }
        if rc < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(ClientError::Io(e));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixStream;

    use super::*;
    use crate::frame::write_frame;
    use crate::messages::BootTimestamps;

    fn ready(version: u32) -> Frame {
        Frame::Ready(Ready {
            version,
            agent_version: "test".into(),
            init_started: BootTimestamps::default(),
            listening: BootTimestamps {
                boottime_ns: 5,
                realtime_ns: 6,
            },
        })
    }

    fn listener() -> (tempfile::TempDir, UnixListener, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vsock.sock_1025");
        let listener = UnixListener::bind(&path).unwrap();
        (dir, listener, path)
    }

    #[test]
    fn ready_frame_is_accepted_and_parsed() {
        // Arrange
        let (_dir, listener, path) = listener();
        let mut guest = UnixStream::connect(&path).unwrap();
        write_frame(&mut guest, &ready(PROTOCOL_VERSION)).unwrap();

        // Act
        let got = accept_ready(&listener, Duration::from_secs(10)).unwrap();

        // Assert
        assert_eq!(got.listening.boottime_ns, 5);
    }

    #[test]
    fn other_protocol_version_is_refused() {
        // Arrange
        let (_dir, listener, path) = listener();
        let mut guest = UnixStream::connect(&path).unwrap();
        write_frame(&mut guest, &ready(99)).unwrap();

        // Act
        let err = accept_ready(&listener, Duration::from_secs(10)).unwrap_err();

        // Assert
        assert!(
            matches!(err, ClientError::VersionMismatch { agent: 99, host: 1 }),
            "{err}"
        );
    }

    #[test]
    fn no_guest_means_timeout() {
        // Arrange
        let (_dir, listener, _path) = listener();
        let started = Instant::now();

        // Act
        let err = accept_ready(&listener, Duration::from_millis(100)).unwrap_err();

        // Assert
        assert!(matches!(err, ClientError::Timeout), "{err}");
        assert!(started.elapsed() >= Duration::from_millis(100));
    }

    #[test]
    fn guest_that_connects_but_stays_silent_times_out() {
        // Arrange
        let (_dir, listener, path) = listener();
        let _guest = UnixStream::connect(&path).unwrap();

        // Act
        let err = accept_ready(&listener, Duration::from_millis(100)).unwrap_err();

        // Assert
        assert!(matches!(err, ClientError::Timeout), "{err}");
    }
}
