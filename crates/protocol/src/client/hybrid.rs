//! The host side of the hybrid vsock handshake: `CONNECT <port>\n` → `OK <hostport>\n`.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use super::ClientError;

/// Longest reply line accepted from the VMM, in bytes (`OK 4294967295\n` is 14).
const MAX_REPLY: usize = 64;

/// Connects to the VM's vsock Unix socket at `uds_path` and asks for guest `port`.
///
/// Sends `CONNECT <port>\n` and expects `OK <hostport>\n` within `timeout`. The reply is read
/// one byte at a time so that no byte of the guest's stream is consumed. On success the
/// stream has no read/write timeouts set.
pub fn connect_hybrid(
    uds_path: &Path,
    port: u32,
    timeout: Duration,
) -> Result<UnixStream, ClientError> {
    let deadline = Instant::now() + timeout;
    let mut stream = UnixStream::connect(uds_path).map_err(|source| ClientError::Connect {
        path: uds_path.to_owned(),
        source,
    })?;
    stream.set_write_timeout(Some(remaining(deadline)?))?;
    stream
        .write_all(format!("CONNECT {port}\n").as_bytes())
        .map_err(|e| handshake_io_error(e, port))?;
    let line = read_reply_line(&mut stream, port, deadline)?;
    parse_ok_line(&line)?;
    stream.set_read_timeout(None)?;
    stream.set_write_timeout(None)?;
    Ok(stream)
}

/// Time left until `deadline`, or a timeout error when it has passed.
pub(crate) fn remaining(deadline: Instant) -> Result<Duration, ClientError> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(ClientError::Timeout);
    }
    Ok(left)
}

fn read_reply_line(
    stream: &mut UnixStream,
    port: u32,
    deadline: Instant,
) -> Result<Vec<u8>, ClientError> {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    loop {
        stream.set_read_timeout(Some(remaining(deadline)?))?;
        match stream.read(&mut byte) {
            Ok(0) => return Err(ClientError::HandshakeClosed { port }),
            Ok(_) if byte[0] == b'\n' => return Ok(line),
            Ok(_) if line.len() >= MAX_REPLY => {
                return Err(ClientError::HandshakeGarbage(lossy(&line)));
            }
            Ok(_) => line.push(byte[0]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(handshake_io_error(e, port)),
        }
    }
}

fn parse_ok_line(line: &[u8]) -> Result<u32, ClientError> {
    let garbage = || ClientError::HandshakeGarbage(lossy(line));
    let text = std::str::from_utf8(line).map_err(|_| garbage())?;
    let host_port = text.strip_prefix("OK ").ok_or_else(garbage)?;
    host_port
        .trim_end_matches('\r')
        .parse()
        .map_err(|_| garbage())
}

fn handshake_io_error(e: io::Error, port: u32) -> ClientError {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => ClientError::Timeout,
        io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe => {
            ClientError::HandshakeClosed { port }
        }
        _ => ClientError::Io(e),
    }
}

fn lossy(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader};
    use std::os::unix::net::UnixListener;
    use std::thread;

    use super::*;

    /// A fake VMM socket that reads the CONNECT line, answers `reply` and sends `then`.
    fn fake_vmm(reply: &'static [u8], then: &'static [u8]) -> (tempfile::TempDir, PathBufOf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vm.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let handle = thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut line = String::new();
            reader.read_line(&mut line).unwrap();
            let mut w = stream;
            let _ = w.write_all(reply);
            let _ = w.write_all(then);
            line
        });
        (dir, PathBufOf { path, handle })
    }

    struct PathBufOf {
        path: std::path::PathBuf,
        handle: thread::JoinHandle<String>,
    }

    #[test]
    fn ok_reply_gives_a_stream_positioned_at_the_guest_bytes() {
        // Arrange
        let (_dir, vmm) = fake_vmm(b"OK 1073741824\n", b"guest");

        // Act
        let mut stream = connect_hybrid(&vmm.path, 1024, Duration::from_secs(10)).unwrap();
        let mut first = [0u8; 5];
        stream.read_exact(&mut first).unwrap();

        // Assert
        assert_eq!(&first, b"guest");
        assert_eq!(vmm.handle.join().unwrap(), "CONNECT 1024\n");
    }

    #[test]
    fn closed_connection_during_handshake_is_reported_with_the_port() {
        // Arrange
        let (_dir, vmm) = fake_vmm(b"", b"");

        // Act
        let err = connect_hybrid(&vmm.path, 5000, Duration::from_secs(10)).unwrap_err();

        // Assert
        assert!(
            matches!(err, ClientError::HandshakeClosed { port: 5000 }),
            "{err}"
        );
    }

    #[test]
    fn garbage_reply_is_rejected() {
        // Arrange
        let (_dir, vmm) = fake_vmm(b"HELLO THERE\n", b"");

        // Act
        let err = connect_hybrid(&vmm.path, 1024, Duration::from_secs(10)).unwrap_err();

        // Assert
        assert!(matches!(err, ClientError::HandshakeGarbage(ref s) if s == "HELLO THERE"));
    }

    #[test]
    fn endless_reply_line_is_cut_off() {
        // Arrange
        let (_dir, vmm) = fake_vmm(&[b'O'; 4096], b"");

        // Act
        let err = connect_hybrid(&vmm.path, 1024, Duration::from_secs(10)).unwrap_err();

        // Assert
        assert!(matches!(err, ClientError::HandshakeGarbage(_)), "{err}");
    }

    #[test]
    fn missing_socket_is_a_connect_error_naming_the_path() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("absent.sock");

        // Act
        let err = connect_hybrid(&path, 1024, Duration::from_secs(1)).unwrap_err();

        // Assert
        assert!(matches!(err, ClientError::Connect { .. }), "{err}");
        assert!(err.to_string().contains("absent.sock"));
    }

    #[test]
    fn silent_vmm_times_out() {
        // Arrange: a listener that accepts (via the backlog) but never answers.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vm.sock");
        let _listener = UnixListener::bind(&path).unwrap();
        let started = Instant::now();

        // Act
        let err = connect_hybrid(&path, 1024, Duration::from_millis(200)).unwrap_err();

        // Assert
        assert!(matches!(err, ClientError::Timeout), "{err}");
        assert!(started.elapsed() < Duration::from_secs(10));
    }
}
