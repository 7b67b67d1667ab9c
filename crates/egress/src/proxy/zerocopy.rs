//! Zero-copy splicing of a tunnel's bytes: `splice(2)` from one socket into a pipe and from the
//! pipe into the other socket, each way, so that a spliced tunnel's payload is never copied
//! into the proxy's memory (the kernel moves page references; AF_UNIX and TCP both splice).
//!
//! Used for CONNECT tunnels that are not intercepted, when the guest's stream is a Unix or TCP
//! socket (the VMM's vsock backend, or a test's TCP listener) and the two pipes could be made;
//! otherwise (another stream, or no descriptors left for pipes) the tunnel falls back to
//! tokio's buffered copy. `splice(2)` into a socket whose peer has gone raises `SIGPIPE` (it
//! takes no `MSG_NOSIGNAL`): a Rust program ignores that signal from its start, as bulkhead's
//! binaries do; a process that embeds the proxy must ignore it too.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use bytes::Bytes;
use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use tokio::io::unix::AsyncFd;
use tokio::net::{TcpStream, UnixStream};

use super::io::{Meter, Metered};

/// Pipe capacity asked for with `F_SETPIPE_SZ` (bytes): moved per `splice(2)` call at most.
/// The kernel's default (16 pages) is kept when it refuses (`/proc/sys/fs/pipe-max-size`).
const PIPE_BYTES: usize = 256 * 1024;

/// The guest's end of a tunnel as a raw socket: its descriptor and the bytes hyper had read
/// past the `CONNECT` head, which go upstream first.
pub(crate) struct RawGuest {
    fd: OwnedFd,
    buffered: Bytes,
}

/// Takes the socket out of `upgraded` when it is a metered Unix or TCP stream (the proxy's
/// listeners make nothing else); gives `upgraded` back otherwise. The inner result fails when
/// the runtime would not release the socket (the tunnel is then lost).
pub(crate) fn take_socket(upgraded: Upgraded) -> Result<io::Result<RawGuest>, Upgraded> {
    take(upgraded, UnixStream::into_std).or_else(|upgraded| take(upgraded, TcpStream::into_std))
}

/// [`take_socket`] for one stream type `S`, released from the runtime by `into_std`.
fn take<S, Std>(
    upgraded: Upgraded,
    into_std: fn(S) -> io::Result<Std>,
) -> Result<io::Result<RawGuest>, Upgraded>
where
    TokioIo<Metered<S>>: hyper::rt::Read + hyper::rt::Write + Unpin + 'static,
    Std: Into<OwnedFd>,
{
    let parts = upgraded.downcast::<TokioIo<Metered<S>>>()?;
    let buffered = parts.read_buf;
    let stream = into_std(parts.io.into_inner().into_inner());
    Ok(stream.map(|s| RawGuest {
        fd: s.into(),
        buffered,
    }))
}

/// The two pipes of a spliced tunnel, one each way.
pub(crate) struct Pipes {
    up: Pipe,
    down: Pipe,
}

impl Pipes {
    /// Two new pipes (four descriptors).
    ///
    /// # Errors
    /// `pipe2(2)`'s, e.g. `EMFILE` when the process has no descriptors left.
    pub fn new() -> io::Result<Pipes> {
        Ok(Pipes {
            up: Pipe::new()?,
            down: Pipe::new()?,
        })
    }
}

/// One direction's pipe.
struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
}

impl Pipe {
    fn new() -> io::Result<Pipe> {
        let mut fds = [0 as RawFd; 2];
        // SAFETY: pipe2 writes two descriptors into the array we pass; O_CLOEXEC|O_NONBLOCK are
        // valid flags.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: both descriptors were just created by pipe2 and are owned by nothing else.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // SAFETY: F_SETPIPE_SZ on a pipe we own; a refusal leaves the default size.
        unsafe {
            libc::fcntl(
                write.as_raw_fd(),
                libc::F_SETPIPE_SZ,
                PIPE_BYTES as libc::c_int,
            )
        };
        Ok(Pipe { read, write })
    }
}

/// `splice(2)` of at most `len` bytes, non-blocking on the pipe side.
fn splice(from: RawFd, to: RawFd, len: usize) -> io::Result<usize> {
    let flags = libc::SPLICE_F_MOVE | libc::SPLICE_F_NONBLOCK;
    // SAFETY: both descriptors are open for the duration of the call; null offsets are
    // required for pipes and sockets.
    let n = unsafe {
        libc::splice(
            from,
            std::ptr::null_mut(),
            to,
            std::ptr::null_mut(),
            len,
            flags,
        )
    };
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}

/// Which way a [`pump`] moves bytes, for the meter.
#[derive(Clone, Copy)]
enum Way {
    Up,
    Down,
}

/// Moves bytes from `from` to `to` until `from`'s end of file (then shuts `to`'s write side)
/// or an error, counting them into `meter`.
async fn pump(
    from: &AsyncFd<OwnedFd>,
    to: &AsyncFd<OwnedFd>,
    pipe: &Pipe,
    meter: &Meter,
    way: Way,
) -> io::Result<()> {
    loop {
        let filled = loop {
            let mut ready = from.readable().await?;
            let raw = pipe.write.as_raw_fd();
            match ready.try_io(|fd| splice(fd.as_raw_fd(), raw, PIPE_BYTES)) {
                Ok(result) => break result?,
                Err(_would_block) => continue,
            }
        };
        if filled == 0 {
            // SAFETY: shutdown(2) of the write side of a socket we own.
            unsafe { libc::shutdown(to.as_raw_fd(), libc::SHUT_WR) };
            return Ok(());
        }
        let mut left = filled;
        while left > 0 {
            let mut ready = to.writable().await?;
            let raw = pipe.read.as_raw_fd();
            match ready.try_io(|fd| splice(raw, fd.as_raw_fd(), left)) {
                Ok(result) => {
                    let moved = result?;
                    left -= moved;
                    match way {
                        Way::Up => meter.count_up(moved),
                        Way::Down => meter.count_down(moved),
                    }
                }
                Err(_would_block) => continue,
            }
        }
    }
}

/// Writes `data` to the non-blocking socket `to` (the bytes hyper had buffered).
async fn write_all(to: &AsyncFd<OwnedFd>, mut data: &[u8], meter: &Meter) -> io::Result<()> {
    while !data.is_empty() {
        let mut ready = to.writable().await?;
        let written = ready.try_io(|fd| {
            // SAFETY: send(2) from a live slice to a socket we own.
            let n = unsafe {
                libc::send(
                    fd.as_raw_fd(),
                    data.as_ptr().cast(),
                    data.len(),
                    libc::MSG_NOSIGNAL,
                )
            };
            usize::try_from(n).map_err(|_| io::Error::last_os_error())
        });
        if let Ok(result) = written {
            let n = result?;
            meter.count_up(n);
            data = &data[n..];
        }
    }
    Ok(())
}

/// Registers a socket with the runtime's reactor.
fn register(fd: OwnedFd) -> io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: an OwnedFd's descriptor is valid, open and the same for as long as it lives,
    // and the AsyncFd owns it.
    unsafe { AsyncFd::register(fd) }.map_err(io::Error::from)
}

/// Splices `guest` and `upstream` both ways through `pipes` until both have ended (a shut
/// write side follows each end of file) or either fails.
///
/// # Errors
/// Registering the sockets with the runtime, or the first failing `splice(2)`.
pub(crate) async fn splice_both(
    guest: RawGuest,
    upstream: TcpStream,
    pipes: Pipes,
    meter: Arc<Meter>,
) -> io::Result<()> {
    let Pipes {
        up: up_pipe,
        down: down_pipe,
    } = pipes;
    let upstream: OwnedFd = upstream.into_std()?.into();
    let guest_fd = register(guest.fd)?;
    let upstream = register(upstream)?;
    write_all(&upstream, &guest.buffered, &meter).await?;
    tokio::try_join!(
        pump(&guest_fd, &upstream, &up_pipe, &meter, Way::Up),
        pump(&upstream, &guest_fd, &down_pipe, &meter, Way::Down),
    )?;
    Ok(())
}
