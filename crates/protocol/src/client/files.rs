//! Archive transfers and file-system requests of [`AgentClient`].

use std::io::{BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use super::{agent_reason, classify, send_file_body, AgentClient, ClientError};
use crate::frame::{read_frame, write_frame, Frame};
use crate::fsops::{
    ArchiveDone, ArchiveReadRequest, ArchiveWriteRequest, FileEntry, FsOp, FsRequest,
};
use crate::{ByteString, PROTOCOL_VERSION};

/// Bound on each blocking read or write of an archive transfer (10 minutes): the other side
/// may spend long on one large file (the zeros of a big hole, for one) without reading or
/// writing the connection.
pub const ARCHIVE_TIMEOUT: Duration = Duration::from_secs(600);

/// Most entries a `list` answer may have (1,000,000), against a hostile guest.
pub const MAX_LIST_ENTRIES: usize = 1_000_000;

impl AgentClient {
    /// Sends the tar stream read from `source` to be extracted into the guest directory
    /// `path` (absolute, existing). Returns the agent's totals.
    pub fn write_archive_from(
        &self,
        path: impl Into<ByteString>,
        source: &mut impl Read,
    ) -> Result<ArchiveDone, ClientError> {
        let mut stream = self.archive_connect()?;
        let request = Frame::ArchiveWrite(ArchiveWriteRequest {
            version: PROTOCOL_VERSION,
            path: path.into(),
        });
        if let Err(e) = send_file_body(&mut stream, &request, source) {
            return Err(agent_reason(&mut stream).unwrap_or(e));
        }
        match read_frame(&mut stream).map_err(classify)? {
            Some(Frame::ArchiveDone(done)) => Ok(done),
            Some(Frame::Error(e)) => Err(ClientError::Agent(e)),
            Some(other) => Err(ClientError::Unexpected {
                expected: "ArchiveDone or Error",
                got: other.kind(),
            }),
            None => Err(ClientError::Closed("acknowledging the archive")),
        }
    }

    /// Streams a tar archive of the guest path `path` (file, symlink or directory tree) into
    /// `sink`. Returns the agent's totals; on error `sink` may hold part of the archive. The
    /// bytes are the guest's: extract them only with [`crate::archive::unpack`].
    pub fn read_archive_into(
        &self,
        path: impl Into<ByteString>,
        sink: &mut impl Write,
    ) -> Result<ArchiveDone, ClientError> {
        let stream = self.archive_connect()?;
        let request = Frame::ArchiveRead(ArchiveReadRequest {
            version: PROTOCOL_VERSION,
            path: path.into(),
        });
        write_frame(&mut &stream, &request).map_err(classify)?;
        let mut reader = BufReader::with_capacity(64 * 1024, stream);
        loop {
            match read_frame(&mut reader).map_err(classify)? {
                Some(Frame::Data(bytes)) => sink.write_all(&bytes)?,
                Some(Frame::ArchiveDone(done)) => return Ok(done),
                Some(Frame::Error(e)) => return Err(ClientError::Agent(e)),
                Some(other) => {
                    return Err(ClientError::Unexpected {
                        expected: "Data, ArchiveDone or Error",
                        got: other.kind(),
                    })
                }
                None => return Err(ClientError::Closed("the end of the archive")),
            }
        }
    }

    /// The entries of the guest directory `path`, sorted by name.
    pub fn list(&self, path: impl Into<ByteString>) -> Result<Vec<FileEntry>, ClientError> {
        let mut reader = BufReader::new(self.fs_request(FsOp::List, path, false)?);
        let mut entries = Vec::new();
        loop {
            match read_frame(&mut reader).map_err(classify)? {
                Some(Frame::FileEntry(entry)) if entries.len() < MAX_LIST_ENTRIES => {
                    entries.push(entry)
                }
                Some(Frame::End) => return Ok(entries),
                Some(Frame::Error(e)) => return Err(ClientError::Agent(e)),
                Some(other) => {
                    return Err(ClientError::Unexpected {
                        expected: "FileEntry (at most 1,000,000), End or Error",
                        got: other.kind(),
                    })
                }
                None => return Err(ClientError::Closed("the end of the listing")),
            }
        }
    }

    /// The guest path `path` itself (a symlink is not followed); a missing path is
    /// [`ClientError::Agent`] with [`crate::ErrorCode::NotFound`].
    pub fn stat(&self, path: impl Into<ByteString>) -> Result<FileEntry, ClientError> {
        let mut stream = self.fs_request(FsOp::Stat, path, false)?;
        match read_frame(&mut stream).map_err(classify)? {
            Some(Frame::FileEntry(entry)) => Ok(entry),
            Some(Frame::Error(e)) => Err(ClientError::Agent(e)),
            Some(other) => Err(ClientError::Unexpected {
                expected: "FileEntry or Error",
                got: other.kind(),
            }),
            None => Err(ClientError::Closed("answering the stat")),
        }
    }

    /// Creates the guest directory `path`; with `parents`, missing parents too, and an
    /// existing directory is no error.
    pub fn mkdir(&self, path: impl Into<ByteString>, parents: bool) -> Result<(), ClientError> {
        let stream = self.fs_request(FsOp::Mkdir, path, parents)?;
        ack(stream, "acknowledging the mkdir")
    }

    /// Removes the guest path `path` (a symlink itself, not its target); a non-empty
    /// directory needs `recursive`.
    pub fn remove(&self, path: impl Into<ByteString>, recursive: bool) -> Result<(), ClientError> {
        let stream = self.fs_request(FsOp::Remove, path, recursive)?;
        ack(stream, "acknowledging the removal")
    }

    /// Sends an `Fs` request; `flag` is `parents` for mkdir and `recursive` for remove.
    fn fs_request(
        &self,
        op: FsOp,
        path: impl Into<ByteString>,
        flag: bool,
    ) -> Result<UnixStream, ClientError> {
        let mut stream = self.connect()?;
        if op == FsOp::Remove && flag {
            // A large tree takes a while to remove.
            stream.set_read_timeout(Some(ARCHIVE_TIMEOUT))?;
        }
        let request = Frame::Fs(FsRequest {
            version: PROTOCOL_VERSION,
            op,
            path: path.into(),
            parents: op == FsOp::Mkdir && flag,
            recursive: op == FsOp::Remove && flag,
        });
        write_frame(&mut stream, &request).map_err(classify)?;
        Ok(stream)
    }

    fn archive_connect(&self) -> Result<UnixStream, ClientError> {
        let stream = self.connect()?;
        stream.set_read_timeout(Some(ARCHIVE_TIMEOUT))?;
        stream.set_write_timeout(Some(ARCHIVE_TIMEOUT))?;
        Ok(stream)
    }
}

/// Reads the agent's answer to a request that ends with `Ack`: `Error` is
/// [`ClientError::Agent`], a closed connection [`ClientError::Closed`] (`what` was going on).
pub(super) fn ack(mut stream: UnixStream, what: &'static str) -> Result<(), ClientError> {
    match read_frame(&mut stream).map_err(classify)? {
        Some(Frame::Ack(_)) => Ok(()),
        Some(Frame::Error(e)) => Err(ClientError::Agent(e)),
        Some(other) => Err(ClientError::Unexpected {
            expected: "Ack or Error",
            got: other.kind(),
        }),
        None => Err(ClientError::Closed(what)),
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::fake_agent;
    use super::*;
    use crate::fsops::FileType;
    use crate::ErrorCode;

    fn entry(name: &str) -> FileEntry {
        FileEntry {
            name: name.into(),
            path: format!("/w/{name}").into(),
            kind: FileType::File,
            size: 3,
            mode: 0o644,
            mtime: 1,
            link_target: None,
        }
    }

    #[test]
    fn list_collects_entries_until_end() {
        // Arrange
        let frames = vec![
            Frame::FileEntry(entry("a")),
            Frame::FileEntry(entry("b")),
            Frame::End,
        ];
        let (_dir, client, agent) = fake_agent(frames);

        // Act
        let entries = client.list("/w").unwrap();

        // Assert
        assert_eq!(entries, vec![entry("a"), entry("b")]);
        assert!(
            matches!(agent.join().unwrap(), Frame::Fs(r) if r.op == FsOp::List && r.path == "/w")
        );
    }

    #[test]
    fn read_archive_passes_the_bytes_and_returns_the_totals() {
        // Arrange
        let done = ArchiveDone {
            entries: 2,
            bytes: 5,
            skipped: Vec::new(),
        };
        let frames = vec![
            Frame::Data(b"tar".to_vec()),
            Frame::ArchiveDone(done.clone()),
        ];
        let (_dir, client, _agent) = fake_agent(frames);
        let mut sink = Vec::new();

        // Act
        let got = client.read_archive_into("/w", &mut sink).unwrap();

        // Assert
        assert_eq!((got, sink), (done, b"tar".to_vec()));
    }

    #[test]
    fn stat_of_a_missing_path_is_the_agents_not_found() {
        // Arrange
        let (_dir, client, _agent) =
            fake_agent(vec![Frame::error(ErrorCode::NotFound, "no such file")]);

        // Act
        let result = client.stat("/nope");

        // Assert
        assert!(
            matches!(&result, Err(ClientError::Agent(e)) if e.code == ErrorCode::NotFound),
            "{result:?}"
        );
    }
}
