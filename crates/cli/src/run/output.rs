//! Streaming a command's output to our stdout/stderr and our stdin to the command.

use std::io::{self, Read, Write};
use std::thread;

use bulkhead_protocol::client::ExecWriter;

/// Writes command output to our stdout/stderr; true when the reader went away (EPIPE, e.g.
/// `| head`). That is not an error: the caller sends the command SIGPIPE, as a local pipe
/// would (`bulkhead run -- yes | head` ends). Any other write error means output was lost; the
/// first is kept in `lost` so the run fails (exit 125) instead of silently returning truncated
/// output.
pub(crate) fn write_out(out: &mut impl Write, bytes: &[u8], lost: &mut Option<io::Error>) -> bool {
    match out.write_all(bytes).and_then(|()| out.flush()) {
        Ok(()) => false,
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => {
            tracing::debug!("local output closed");
            true
        }
        Err(e) => {
            tracing::debug!("writing output: {e}");
            lost.get_or_insert(e);
            false
        }
    }
}

/// Copies our stdin to the command until EOF, on a detached thread (it may block on a terminal
/// after the command is done; the process exits without waiting for it).
pub(super) fn forward_stdin(writer: ExecWriter) {
    thread::spawn(move || {
        let mut stdin = io::stdin().lock();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match stdin.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    if writer.write_stdin(&buf[..n]).is_err() {
                        return;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            }
        }
        let _ = writer.close_stdin();
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer that fails every write with `kind`.
    struct Failing(io::ErrorKind);

    impl Write for Failing {
        fn write(&mut self, _: &[u8]) -> io::Result<usize> {
            Err(io::Error::from(self.0))
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_reader_that_went_away_is_not_lost_output_but_a_failing_write_is() {
        let (mut gone, mut full) = (None, None);

        let reader_gone = write_out(&mut Failing(io::ErrorKind::BrokenPipe), b"x", &mut gone);
        let disk_full = write_out(&mut Failing(io::ErrorKind::StorageFull), b"x", &mut full);

        assert!(reader_gone && !disk_full);
        assert!(gone.is_none());
        assert_eq!(full.map(|e| e.kind()), Some(io::ErrorKind::StorageFull));
    }
}
