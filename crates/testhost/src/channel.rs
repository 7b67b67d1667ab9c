//! The host end of the control channel: line I/O on the Unix socket behind the test host's virtio-serial
//! control port, and the tailing of command output files in the scratch share.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::protocol::{GuestMsg, HostMsg, ProtocolError};

/// Errors on the control channel.
#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    /// Socket I/O failed.
    #[error("control channel I/O: {0}")]
    Io(#[from] io::Error),
    /// QEMU closed the socket.
    #[error("control channel closed by QEMU")]
    Closed,
    /// A line could not be parsed.
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// A control line grew beyond [`MAX_LINE`] bytes without a newline.
    #[error("control line longer than {MAX_LINE} bytes")]
    LineTooLong,
}

/// Longest control line accepted, in bytes.
pub const MAX_LINE: usize = 4096;

/// The connected control socket.
#[derive(Debug)]
pub struct ControlChannel {
    stream: UnixStream,
    buf: Vec<u8>,
}

impl ControlChannel {
    /// Wraps a connected stream.
    pub fn new(stream: UnixStream) -> Self {
        ControlChannel {
            stream,
            buf: Vec::new(),
        }
    }

    /// Waits until QEMU connects to `listener` or `give_up` returns true (polled every 20 ms).
    pub fn accept(
        listener: &UnixListener,
        mut give_up: impl FnMut() -> bool,
    ) -> Result<Option<ControlChannel>, ChannelError> {
        listener.set_nonblocking(true)?;
        loop {
            match listener.accept() {
                Ok((stream, _)) => {
                    stream.set_nonblocking(false)?;
                    return Ok(Some(ControlChannel::new(stream)));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if give_up() {
                        return Ok(None);
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Sends one message.
    pub fn send(&mut self, msg: HostMsg) -> Result<(), ChannelError> {
        self.stream.write_all(msg.to_line().as_bytes())?;
        Ok(())
    }

    /// Returns the next message, or `None` if none is complete by `deadline`.
    pub fn recv(&mut self, deadline: Instant) -> Result<Option<GuestMsg>, ChannelError> {
        loop {
            if let Some(line) = take_line(&mut self.buf)? {
                if line.trim().is_empty() {
                    continue;
                }
                return Ok(Some(GuestMsg::parse(&line)?));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            self.stream.set_read_timeout(Some(left))?;
            let mut chunk = [0u8; 512];
            match self.stream.read(&mut chunk) {
                Ok(0) => return Err(ChannelError::Closed),
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock
                            | io::ErrorKind::TimedOut
                            | io::ErrorKind::Interrupted
                    ) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
}

/// Removes and returns the first complete line (without `\n`) from `buf`.
fn take_line(buf: &mut Vec<u8>) -> Result<Option<String>, ChannelError> {
    match buf.iter().position(|b| *b == b'\n') {
        Some(pos) => {
            let line: Vec<u8> = buf.drain(..=pos).take(pos).collect();
            Ok(Some(String::from_utf8_lossy(&line).into_owned()))
        }
        None if buf.len() > MAX_LINE => Err(ChannelError::LineTooLong),
        None => Ok(None),
    }
}

/// Follows a file that another party appends to, handing new bytes to a sink.
#[derive(Debug)]
pub struct Tailer {
    path: PathBuf,
    file: Option<File>,
}

impl Tailer {
    /// Follows `path`, which need not exist yet.
    pub fn new(path: &Path) -> Self {
        Tailer {
            path: path.to_path_buf(),
            file: None,
        }
    }

    /// Passes everything appended since the last call to `sink`.
    pub fn pump(&mut self, sink: &mut dyn Write) -> io::Result<()> {
        if self.file.is_none() {
            match File::open(&self.path) {
                Ok(f) => self.file = Some(f),
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
                Err(e) => return Err(e),
            }
        }
        let Some(file) = self.file.as_mut() else {
            return Ok(());
        };
        let mut chunk = vec![0u8; 64 * 1024];
        loop {
            let n = file.read(&mut chunk)?;
            if n == 0 {
                return Ok(());
            }
            sink.write_all(&chunk[..n])?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_split_across_reads_are_reassembled() {
        // Arrange
        let (a, mut b) = UnixStream::pair().unwrap();
        let mut channel = ControlChannel::new(a);
        b.write_all(b"do").unwrap();
        b.write_all(b"ne 3 0\nready\n").unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);

        // Act
        let first = channel.recv(deadline).unwrap();
        let second = channel.recv(deadline).unwrap();

        // Assert
        assert_eq!(first, Some(GuestMsg::Done { id: 3, status: 0 }));
        assert_eq!(second, Some(GuestMsg::Ready));
    }

    #[test]
    fn recv_times_out_without_a_complete_line() {
        // Arrange
        let (a, mut b) = UnixStream::pair().unwrap();
        let mut channel = ControlChannel::new(a);
        b.write_all(b"rea").unwrap();

        // Act
        let msg = channel
            .recv(Instant::now() + Duration::from_millis(50))
            .unwrap();

        // Assert
        assert_eq!(msg, None);
    }

    #[test]
    fn closed_socket_is_reported() {
        // Arrange
        let (a, b) = UnixStream::pair().unwrap();
        let mut channel = ControlChannel::new(a);
        drop(b);

        // Act
        let result = channel.recv(Instant::now() + Duration::from_secs(5));

        // Assert
        assert!(matches!(result, Err(ChannelError::Closed)));
    }

    #[test]
    fn tailer_returns_only_new_bytes() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stdout");
        let mut tailer = Tailer::new(&path);
        let mut seen = Vec::new();
        tailer.pump(&mut seen).unwrap();
        std::fs::write(&path, b"ab\0").unwrap();
        tailer.pump(&mut seen).unwrap();
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        f.write_all(b"cd").unwrap();

        // Act
        tailer.pump(&mut seen).unwrap();

        // Assert
        assert_eq!(seen, b"ab\0cd");
    }
}
