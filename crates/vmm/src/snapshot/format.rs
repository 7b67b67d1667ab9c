//! The snapshot state file: a one-line JSON header, then the state as JSON.
//!
//! ```text
//! {"magic":"bulkhead-snapshot","format":1,"arch":"x86_64","vmm_version":"0.1.0","body_len":N,"body_sha256":"..."}\n
//! <N bytes of JSON: the state>
//! ```
//!
//! The header is checked before the body is parsed: a file from another architecture or
//! another format version is refused by name, a truncated or altered body by its length and
//! SHA-256. The body is then parsed with serde; every value in it is still untrusted (a file
//! the right length and digest can still be crafted), so whoever restores it validates what it
//! means (queue addresses, sizes) as for a guest's own writes.

use std::io::{Read, Write};
use std::path::Path;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The header's `magic`.
pub const MAGIC: &str = "bulkhead-snapshot";

/// The state format this build writes and reads. Bumped whenever a saved structure changes in a
/// way an older or newer reader would misread.
pub const FORMAT_VERSION: u32 = 1;

/// Longest header line accepted, bytes.
const MAX_HEADER_BYTES: usize = 4096;

/// Largest state body accepted, bytes (64 MiB: a VM's state is tens of KiB).
pub const MAX_BODY_BYTES: u64 = 64 << 20;

/// Errors reading or writing a snapshot state file.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The first line is not a bulkhead snapshot header.
    #[error("not a bulkhead snapshot (no valid header line): {0}")]
    NotASnapshot(String),
    /// The snapshot was written in another format version.
    #[error(
        "snapshot format version {found}, but this bulkhead-vmm ({}) reads version {FORMAT_VERSION} only; \
         make the snapshot again with this version",
        env!("CARGO_PKG_VERSION")
    )]
    Version {
        /// The version in the header.
        found: u32,
    },
    /// The snapshot was taken on another architecture.
    #[error(
        "snapshot of an {found} VM cannot be restored on {}",
        std::env::consts::ARCH
    )]
    Arch {
        /// The architecture in the header.
        found: String,
    },
    /// The body is shorter or longer than the header says.
    #[error("snapshot state is truncated or has trailing bytes: {found} bytes, the header says {expected}")]
    Length {
        /// Bytes the header announces.
        expected: u64,
        /// Bytes present.
        found: u64,
    },
    /// The body's digest does not match the header's.
    #[error("snapshot state is corrupt: its SHA-256 does not match the header's")]
    Digest,
    /// The body is not the state this build expects.
    #[error("snapshot state cannot be parsed: {0}")]
    Parse(serde_json::Error),
    /// The state could not be serialized.
    #[error("cannot serialize the snapshot state: {0}")]
    Serialize(serde_json::Error),
}

/// The header line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Header {
    magic: String,
    format: u32,
    arch: String,
    vmm_version: String,
    body_len: u64,
    body_sha256: String,
}

/// Encodes `state` as a state file's bytes (header line and body).
///
/// # Errors
/// [`Error::Serialize`].
pub fn encode<T: Serialize>(state: &T) -> Result<Vec<u8>, Error> {
    let body = serde_json::to_vec(state).map_err(Error::Serialize)?;
    frame(&body)
}

/// A state file's bytes for an already serialized `body`: this build's header (with the
/// body's length and digest), then the body. Fuzzers use it to reach the body's parser.
///
/// # Errors
/// [`Error::Serialize`] (the header cannot fail to serialize in practice).
pub fn frame(body: &[u8]) -> Result<Vec<u8>, Error> {
    let header = Header {
        magic: MAGIC.into(),
        format: FORMAT_VERSION,
        arch: std::env::consts::ARCH.into(),
        vmm_version: env!("CARGO_PKG_VERSION").into(),
        body_len: body.len() as u64,
        body_sha256: hex(&Sha256::digest(body)),
    };
    let mut out = serde_json::to_vec(&header).map_err(Error::Serialize)?;
    out.push(b'\n');
    out.extend_from_slice(body);
    Ok(out)
}

/// Decodes a state file's bytes: checks the header (magic, format version, architecture), the
/// body's length and digest, then parses the body.
///
/// # Errors
/// [`Error::NotASnapshot`], [`Error::Version`], [`Error::Arch`], [`Error::Length`],
/// [`Error::Digest`], [`Error::Parse`]. Never panics, whatever the bytes.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, Error> {
    let window = &bytes[..bytes.len().min(MAX_HEADER_BYTES)];
    let newline = window
        .iter()
        .position(|&b| b == b'\n')
        .ok_or_else(|| Error::NotASnapshot("no header line".into()))?;
    let header: Header = serde_json::from_slice(&bytes[..newline])
        .map_err(|e| Error::NotASnapshot(e.to_string()))?;
    if header.magic != MAGIC {
        return Err(Error::NotASnapshot(format!("magic {:?}", header.magic)));
    }
    if header.format != FORMAT_VERSION {
        return Err(Error::Version {
            found: header.format,
        });
    }
    if header.arch != std::env::consts::ARCH {
        return Err(Error::Arch { found: header.arch });
    }
    let body = &bytes[newline + 1..];
    if body.len() as u64 != header.body_len {
        return Err(Error::Length {
            expected: header.body_len,
            found: body.len() as u64,
        });
    }
    if hex(&Sha256::digest(body)) != header.body_sha256 {
        return Err(Error::Digest);
    }
    serde_json::from_slice(body).map_err(Error::Parse)
}

/// Writes `state` to `path` (created or replaced, mode 0600: it holds guest registers), flushed
/// to disk.
///
/// # Errors
/// [`Error::Serialize`], [`Error::Io`].
pub fn write_file<T: Serialize>(path: &Path, state: &T) -> Result<(), Error> {
    let bytes = encode(state)?;
    let io = |source| Error::Io {
        path: path.to_owned(),
        source,
    };
    let mut file = private_file(path).map_err(io)?;
    file.write_all(&bytes).map_err(io)?;
    file.sync_all().map_err(io)
}

/// Reads and decodes the state file at `path` (at most [`MAX_BODY_BYTES`] of body).
///
/// # Errors
/// [`Error::Io`] and those of [`decode`].
pub fn read_file<T: DeserializeOwned>(path: &Path) -> Result<T, Error> {
    let io = |source| Error::Io {
        path: path.to_owned(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let mut bytes = Vec::new();
    file.take(MAX_BODY_BYTES + MAX_HEADER_BYTES as u64)
        .read_to_end(&mut bytes)
        .map_err(io)?;
    decode(&bytes)
}

/// Creates (or truncates) `path` for writing, mode 0600 when created: a snapshot's files hold
/// guest memory and registers, for the snapshot's owner only.
pub(crate) fn private_file(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Sample {
        regs: Vec<u64>,
        name: String,
    }

    fn sample() -> Sample {
        Sample {
            regs: vec![1, 2, 0xdead_beef],
            name: "vcpu0".into(),
        }
    }

    #[test]
    fn round_trip_keeps_the_state() {
        let bytes = encode(&sample()).unwrap();

        let back: Sample = decode(&bytes).unwrap();

        assert_eq!(back, sample());
    }

    #[test]
    fn truncated_state_is_refused_by_length() {
        let bytes = encode(&sample()).unwrap();

        let err = decode::<Sample>(&bytes[..bytes.len() - 3]).unwrap_err();

        assert!(matches!(err, Error::Length { .. }), "{err}");
    }

    #[test]
    fn altered_state_is_refused_by_digest() {
        let mut bytes = encode(&sample()).unwrap();
        let last = bytes.len() - 2;
        bytes[last] ^= 0x01;

        let err = decode::<Sample>(&bytes).unwrap_err();

        assert!(matches!(err, Error::Digest), "{err}");
    }

    #[test]
    fn other_version_and_arch_are_refused_by_name() {
        let text = String::from_utf8(encode(&sample()).unwrap()).unwrap();
        let newer = text.replacen("\"format\":1", "\"format\":2", 1);
        let other_arch = text.replacen(std::env::consts::ARCH, "riscv64", 1);

        let version = decode::<Sample>(newer.as_bytes()).unwrap_err();
        let arch = decode::<Sample>(other_arch.as_bytes()).unwrap_err();

        assert!(matches!(version, Error::Version { found: 2 }), "{version}");
        assert!(version.to_string().contains("version 2"));
        assert!(matches!(arch, Error::Arch { .. }), "{arch}");
        assert!(arch.to_string().contains("riscv64"));
    }

    #[test]
    fn garbage_is_not_a_snapshot() {
        for bytes in [&b""[..], b"\n", b"hello\nworld", b"{\"magic\":\"x\"}\n{}"] {
            let err = decode::<Sample>(bytes).unwrap_err();

            assert!(matches!(err, Error::NotASnapshot(_)), "{err}");
        }
    }
}
