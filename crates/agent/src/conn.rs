//! A connected stream socket (vsock or Unix) as the agent uses it: blocking reads and writes
//! for simple requests, and `MSG_DONTWAIT` variants for the exec event loop, all without
//! `SIGPIPE` (`MSG_NOSIGNAL`).

use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};

/// One host connection. Closed on drop.
#[derive(Debug)]
pub struct Conn {
    fd: OwnedFd,
}

impl Conn {
    /// Wraps a connected stream socket.
    pub fn new(fd: OwnedFd) -> Self {
        Self { fd }
    }

    /// The socket itself, for a connection that stops being framed (ingress).
    pub fn into_fd(self) -> OwnedFd {
        self.fd
    }

    /// Receives up to `buf.len()` bytes without blocking; `WouldBlock` when none are there,
    /// `Ok(0)` at end of stream.
    pub fn recv_nonblocking(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.recv(buf, libc::MSG_DONTWAIT)
    }

    /// Sends a prefix of `buf` without blocking; `WouldBlock` when the socket buffer is full.
    pub fn send_nonblocking(&self, buf: &[u8]) -> io::Result<usize> {
        self.send(buf, libc::MSG_DONTWAIT)
    }

    /// Shuts down both directions (the peer sees end of stream even if the fd lives on).
    pub fn shutdown(&self) {
        // SAFETY: shutdown(2) on a descriptor we own; no pointers involved.
        unsafe { libc::shutdown(self.fd.as_raw_fd(), libc::SHUT_RDWR) };
    }

    fn recv(&self, buf: &mut [u8], flags: libc::c_int) -> io::Result<usize> {
        loop {
            // SAFETY: `buf` is valid for writes of `buf.len()` bytes during the call.
            let n = unsafe {
                libc::recv(
                    self.fd.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    flags,
                )
            };
            match usize::try_from(n) {
                Ok(n) => return Ok(n),
                Err(_) => retry_on_eintr(io::Error::last_os_error())?,
            }
        }
    }

    fn send(&self, buf: &[u8], flags: libc::c_int) -> io::Result<usize> {
        loop {
            // SAFETY: `buf` is valid for reads of `buf.len()` bytes during the call.
            let n = unsafe {
                libc::send(
                    self.fd.as_raw_fd(),
                    buf.as_ptr().cast(),
                    buf.len(),
                    flags | libc::MSG_NOSIGNAL,
                )
            };
            match usize::try_from(n) {
                Ok(n) => return Ok(n),
                Err(_) => retry_on_eintr(io::Error::last_os_error())?,
            }
        }
    }
}

/// `Ok(())` (retry) for `EINTR`, the error otherwise.
fn retry_on_eintr(err: io::Error) -> io::Result<()> {
    if err.kind() == io::ErrorKind::Interrupted {
        Ok(())
    } else {
        Err(err)
    }
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.recv(buf, 0)
    }
}

impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.send(buf, 0)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl AsRawFd for Conn {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl AsFd for Conn {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}
