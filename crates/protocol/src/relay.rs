//! Carrying a byte stream both ways between two connected sockets, as the guest's egress relay
//! (a guest TCP connection ↔ vsock to the host's proxy) and ingress (a host TCP connection ↔ an
//! agent `Connect` stream) do. Nothing is interpreted: the bytes pass unchanged.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::thread;

/// Bytes copied per read.
const CHUNK: usize = 64 * 1024;

/// Stack of the thread that copies one direction (it copies through a heap buffer).
const THREAD_STACK: usize = 64 * 1024;

/// Copies `a` → `b` (on a thread of its own) and `b` → `a` until both directions reached end of
/// file; when a direction's source ends, its destination's write side is shut down
/// (`shutdown(SHUT_WR)`), so each peer sees the other's end. A peer that went away (reset, broken
/// pipe) ends its direction quietly.
///
/// # Errors
/// Another read or write error, or no thread for the second direction.
pub fn pump(a: OwnedFd, b: OwnedFd) -> io::Result<()> {
    let (a, b) = (File::from(a), File::from(b));
    let (a_in, b_out) = (a.try_clone()?, b.try_clone()?);
    let forward = thread::Builder::new()
        .name("relay".into())
        .stack_size(THREAD_STACK)
        .spawn(move || {
            let mut b_out = b_out;
            let copied = copy(a_in, &mut b_out);
            shutdown_write(&b_out);
            copied
        })?;
    let mut a_out = a;
    let back = copy(b, &mut a_out);
    shutdown_write(&a_out);
    let forward = forward
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("relay thread panicked")));
    back.and(forward).map(drop)
}

/// Copies `from` into `to` until end of file; a peer that went away ends the copy quietly.
fn copy(mut from: impl Read, to: &mut impl Write) -> io::Result<u64> {
    let mut buf = vec![0u8; CHUNK];
    let mut total = 0u64;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => return Ok(total),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) if gone(&e) => return Ok(total),
            Err(e) => return Err(e),
        };
        match to.write_all(&buf[..n]) {
            Ok(()) => total += n as u64,
            Err(e) if gone(&e) => return Ok(total),
            Err(e) => return Err(e),
        }
    }
}

/// Whether `e` means the other side closed its end.
fn gone(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset | io::ErrorKind::NotConnected
    )
}

/// `shutdown(SHUT_WR)` on a socket held as a file.
fn shutdown_write(socket: &File) {
    // SAFETY: shutdown(2) on a descriptor we own; a failure only means it is closed already.
    unsafe { libc::shutdown(socket.as_raw_fd(), libc::SHUT_WR) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    #[test]
    fn both_directions_arrive_whole_and_each_end_of_file_reaches_the_other_side() {
        // Arrange: client ↔ (a | b) ↔ server, a reversing server.
        let (mut client, a) = UnixStream::pair().unwrap();
        let (b, mut server) = UnixStream::pair().unwrap();
        let relay = thread::spawn(move || pump(a.into(), b.into()));
        let serving = thread::spawn(move || {
            let mut request = Vec::new();
            server.read_to_end(&mut request).unwrap();
            request.reverse();
            server.write_all(&request).unwrap();
        });
        let payload: Vec<u8> = (0..300_000u32).map(|i| (i % 253) as u8).collect();

        // Act
        client.write_all(&payload).unwrap();
        client.shutdown(std::net::Shutdown::Write).unwrap();
        let mut answer = Vec::new();
        client.read_to_end(&mut answer).unwrap();
        serving.join().unwrap();
        let relayed = relay.join().unwrap();

        // Assert
        let mut expected = payload;
        expected.reverse();
        assert!(answer == expected, "the bytes came back changed");
        assert!(relayed.is_ok(), "{relayed:?}");
    }
}
