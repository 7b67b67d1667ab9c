//! A reader that follows the tar block structure as the bytes pass, so that a hostile stream
//! is cut off before the `tar` crate buffers an oversized metadata entry (GNU long names and
//! PAX headers are read whole into memory) or an endless sparse map.

use std::io::{self, Read};

use super::Limits;

const BLOCK: usize = 512;

/// Where in the tar structure the next byte falls.
#[derive(Debug)]
enum State {
    /// Inside a header block; `filled` bytes of it are in `block`.
    Header,
    /// Inside a GNU sparse extension block (`count` of this entry so far).
    Extension { count: u64, data: u64 },
    /// Inside entry data (padded to whole blocks); `left` bytes remain.
    Data { left: u64 },
}

/// Wraps a tar byte stream; reads fail with `InvalidData` past the [`Limits`].
#[derive(Debug)]
pub(crate) struct Guard<R> {
    inner: R,
    limits: Limits,
    state: State,
    block: Vec<u8>,
}

impl<R: Read> Guard<R> {
    pub(crate) fn new(inner: R, limits: Limits) -> Self {
        Self {
            inner,
            limits,
            state: State::Header,
            block: Vec::with_capacity(BLOCK),
        }
    }

    /// Feeds passing bytes through the state machine.
    fn observe(&mut self, mut bytes: &[u8]) -> io::Result<()> {
        while !bytes.is_empty() {
            match &mut self.state {
                State::Data { left } => {
                    let n = (*left).min(bytes.len() as u64);
                    *left -= n;
                    bytes = &bytes[n as usize..];
                    if *left == 0 {
                        self.state = State::Header;
                    }
                }
                State::Header | State::Extension { .. } => {
                    let n = (BLOCK - self.block.len()).min(bytes.len());
                    self.block.extend_from_slice(&bytes[..n]);
                    bytes = &bytes[n..];
                    if self.block.len() == BLOCK {
                        self.state = self.next_state()?;
                        self.block.clear();
                    }
                }
            }
        }
        Ok(())
    }

    /// The state after a complete header or extension block in `self.block`.
    fn next_state(&self) -> io::Result<State> {
        let b = &self.block;
        let (count, data) = match self.state {
            State::Extension { count, data } => (count, data),
            _ => {
                let size = number(&b[124..136]).ok_or_else(|| bad("malformed size field"))?;
                let metadata = matches!(b[156], b'L' | b'K' | b'x' | b'g');
                if metadata && size > self.limits.metadata_bytes {
                    return Err(bad(&format!(
                        "a metadata entry of {size} bytes exceeds the limit of {} bytes",
                        self.limits.metadata_bytes
                    )));
                }
                if b[156] == b'S' && b[482] == 1 {
                    return Ok(State::Extension {
                        count: 0,
                        data: size,
                    });
                }
                return Ok(data_state(size));
            }
        };
        if count + 1 > self.limits.sparse_blocks {
            return Err(bad(&format!(
                "a sparse map longer than {} extension blocks",
                self.limits.sparse_blocks
            )));
        }
        if b[504] == 1 {
            return Ok(State::Extension {
                count: count + 1,
                data,
            });
        }
        Ok(data_state(data))
    }
}

fn data_state(size: u64) -> State {
    let padded = size.div_ceil(BLOCK as u64).saturating_mul(BLOCK as u64);
    if padded == 0 {
        State::Header
    } else {
        State::Data { left: padded }
    }
}

fn bad(message: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message.to_owned())
}

/// A tar numeric field: octal text, or base-256 when the top bit of the first byte is set.
fn number(field: &[u8]) -> Option<u64> {
    if field[0] & 0x80 != 0 {
        let mut n: u64 = u64::from(field[0] & 0x7f);
        for b in &field[1..] {
            n = n.checked_mul(256)?.checked_add(u64::from(*b))?;
        }
        return Some(n);
    }
    field
        .iter()
        .skip_while(|b| **b == b' ')
        .take_while(|b| (b'0'..=b'7').contains(*b))
        .try_fold(0u64, |n, b| {
            n.checked_mul(8)?.checked_add(u64::from(b - b'0'))
        })
}

impl<R: Read> Read for Guard<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.observe(&buf[..n])?;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_oversized_long_name_is_cut_off_before_it_is_read() {
        // Arrange: a GNU long-name header announcing 1 GiB of name.
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::GNULongName);
        header.set_size(1 << 30);
        header.set_cksum();
        let mut guard = Guard::new(
            io::Cursor::new(header.as_bytes().to_vec()),
            Limits::default(),
        );

        // Act
        let err = io::copy(&mut guard, &mut io::sink()).unwrap_err();

        // Assert
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(err.to_string().contains("metadata entry"), "{err}");
    }
}
