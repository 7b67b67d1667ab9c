//! Directory transfers as tar streams (`ArchiveWrite`, `ArchiveRead`) and file-system requests
//! (`Fs`: list, stat, mkdir, remove).

use std::fs::{self, Metadata};
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use bulkhead_protocol::archive::{self, ArchiveError, PackOptions, UnpackOptions};
use bulkhead_protocol::frame::encode_raw;
use bulkhead_protocol::{
    read_frame, write_frame, Ack, ArchiveReadRequest, ArchiveWriteRequest, ByteString, ErrorCode,
    ErrorMessage, FileEntry, FileType, Frame, FrameType, FsOp, FsRequest, DATA_CHUNK,
    PROTOCOL_VERSION,
};

use crate::conn::Conn;

/// Errors of archive and file-system requests (reported to the host as `Error` frames).
#[derive(Debug, thiserror::Error)]
pub enum FsError {
    /// The request's protocol version is not ours.
    #[error("unsupported protocol version {0} (this agent speaks {PROTOCOL_VERSION})")]
    Version(u32),
    /// The path is not absolute.
    #[error("path {0:?} is not absolute")]
    NotAbsolute(String),
    /// The request is refused as asked (removing `/`, a non-empty directory without
    /// `recursive`, ...).
    #[error("{0}")]
    Refused(String),
    /// A filesystem operation failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was attempted.
        op: &'static str,
        /// The guest path.
        path: String,
        /// What the kernel said.
        source: io::Error,
    },
    /// Packing or extracting failed.
    #[error(transparent)]
    Archive(#[from] ArchiveError),
    /// The host sent something other than `Data` or `End`, or the stream broke.
    #[error("archive contents: {0}")]
    Stream(String),
}

impl FsError {
    fn into_message(self) -> ErrorMessage {
        let code = match &self {
            FsError::Version(_) => ErrorCode::UnsupportedVersion,
            FsError::NotAbsolute(_) | FsError::Refused(_) => ErrorCode::InvalidRequest,
            FsError::Io { source, .. } => ErrorCode::of_io(source),
            FsError::Archive(ArchiveError::Io { source, .. }) => ErrorCode::of_io(source),
            FsError::Archive(_) => ErrorCode::InvalidRequest,
            FsError::Stream(_) => ErrorCode::Protocol,
        };
        ErrorMessage::new(code, self.to_string())
    }
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> FsError + 'a {
    move |source| FsError::Io {
        op,
        path: path.display().to_string(),
        source,
    }
}

/// Checks the version and normalises an absolute guest path lexically: `.` components and
/// repeated `/` dropped, `..` removes the previous component (`/..` is `/`).
pub fn normalise(version: u32, path: &ByteString) -> Result<PathBuf, FsError> {
    if version != PROTOCOL_VERSION {
        return Err(FsError::Version(version));
    }
    if path.as_bytes().first() != Some(&b'/') {
        return Err(FsError::NotAbsolute(path.to_string_lossy().into_owned()));
    }
    let mut out = PathBuf::from("/");
    for comp in Path::new(path.as_os_str()).components() {
        match comp {
            Component::ParentDir => {
                out.pop();
            }
            Component::Normal(name) => out.push(name),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    Ok(out)
}

/// Serves an `ArchiveWrite`: extracts the tar stream of the `Data` frames into the existing
/// directory `path` (symlinks in `path` itself are followed; nothing inside the archive is),
/// then answers `ArchiveDone` or `Error`. After a failure it still reads up to `End`, so the
/// host gets the `Error` instead of a broken pipe.
pub fn serve_archive_write(mut conn: Conn, req: &ArchiveWriteRequest) {
    let mut body = DataFrames::new(&mut conn);
    let result = extract(&mut body, req);
    let stream = body.drain();
    let reply = match (stream, result) {
        (Err(reason), _) => Frame::Error(FsError::Stream(reason).into_message()),
        (Ok(()), Err(e)) => Frame::Error(e.into_message()),
        (Ok(()), Ok(done)) => Frame::ArchiveDone(done),
    };
    let _ = write_frame(&mut conn, &reply);
}

fn extract(
    body: &mut DataFrames<'_>,
    req: &ArchiveWriteRequest,
) -> Result<bulkhead_protocol::ArchiveDone, FsError> {
    let dir = normalise(req.version, &req.path)?;
    let fd = archive::open_dir(&dir).map_err(io_err("open directory", &dir))?;
    let options = UnpackOptions {
        keep_special_bits: true,
        ..UnpackOptions::default()
    };
    Ok(archive::unpack(body, &fd, &options)?)
}

/// The payloads of `Data` frames as one byte stream, ending at `End`.
struct DataFrames<'a> {
    conn: &'a mut Conn,
    buf: Vec<u8>,
    pos: usize,
    /// `Some(Ok)` after `End`, `Some(Err)` after a broken sequence.
    end: Option<Result<(), String>>,
}

impl<'a> DataFrames<'a> {
    fn new(conn: &'a mut Conn) -> Self {
        Self {
            conn,
            buf: Vec::new(),
            pos: 0,
            end: None,
        }
    }

    /// Reads (and drops) the rest up to `End`; the sequence's outcome.
    fn drain(mut self) -> Result<(), String> {
        let mut sink = [0u8; DATA_CHUNK];
        while self.end.is_none() {
            let _ = self.read(&mut sink);
        }
        self.end.unwrap_or(Ok(()))
    }
}

impl Read for DataFrames<'_> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        while self.pos == self.buf.len() {
            if let Some(end) = &self.end {
                return match end {
                    Ok(()) => Ok(0),
                    Err(e) => Err(io::Error::other(e.clone())),
                };
            }
            match read_frame(self.conn) {
                Ok(Some(Frame::Data(bytes))) => {
                    self.buf = bytes;
                    self.pos = 0;
                }
                Ok(Some(Frame::End)) => self.end = Some(Ok(())),
                Ok(Some(other)) => {
                    self.end = Some(Err(format!("unexpected {} frame", other.kind())))
                }
                Ok(None) => self.end = Some(Err("connection closed before End".to_owned())),
                Err(e) => self.end = Some(Err(e.to_string())),
            }
        }
        let n = out.len().min(self.buf.len() - self.pos);
        out[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

/// Serves an `ArchiveRead`: the tar stream of `path` as `Data` frames, then `ArchiveDone`, or
/// `Error` (possibly after some `Data`).
pub fn serve_archive_read(mut conn: Conn, req: &ArchiveReadRequest) {
    let mut sink = FrameSink {
        conn: &mut conn,
        buf: Vec::with_capacity(DATA_CHUNK),
        host_gone: false,
    };
    let result = normalise(req.version, &req.path).and_then(|path| {
        let done = archive::pack(&path, &PackOptions::default(), &mut sink)?;
        sink.flush()
            .map_err(|e| FsError::Stream(format!("send: {e}")))?;
        Ok(done)
    });
    if sink.host_gone {
        return;
    }
    let last = match result {
        Ok(done) => Frame::ArchiveDone(done),
        Err(e) => Frame::Error(e.into_message()),
    };
    let _ = write_frame(&mut conn, &last);
}

/// Cuts a byte stream into `Data` frames of [`DATA_CHUNK`] bytes.
struct FrameSink<'a> {
    conn: &'a mut Conn,
    buf: Vec<u8>,
    host_gone: bool,
}

impl Write for FrameSink<'_> {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        let n = bytes.len().min(DATA_CHUNK - self.buf.len());
        self.buf.extend_from_slice(&bytes[..n]);
        if self.buf.len() == DATA_CHUNK {
            self.flush()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let mut frame = Vec::with_capacity(self.buf.len() + 8);
        encode_raw(FrameType::Data, &self.buf, &mut frame).map_err(io::Error::other)?;
        self.buf.clear();
        self.conn
            .write_all(&frame)
            .inspect_err(|_| self.host_gone = true)
    }
}

/// Serves an `Fs` request (list, stat, mkdir, remove).
pub fn serve_fs(mut conn: Conn, req: &FsRequest) {
    let result = normalise(req.version, &req.path).and_then(|path| match req.op {
        FsOp::List => list(&mut conn, &path),
        FsOp::Stat => {
            let meta = fs::symlink_metadata(&path).map_err(io_err("stat", &path))?;
            Ok(Frame::FileEntry(entry_of(&path, &meta)))
        }
        FsOp::Mkdir => mkdir(&path, req.parents).map(|()| Frame::Ack(Ack { bytes: 0 })),
        FsOp::Remove => remove(&path, req.recursive).map(|()| Frame::Ack(Ack { bytes: 0 })),
    });
    let last = result.unwrap_or_else(|e| Frame::Error(e.into_message()));
    let _ = write_frame(&mut conn, &last);
}

/// Sends one `FileEntry` per directory entry, sorted by name; returns the closing `End`.
/// Entries that vanish while listing are left out.
fn list(conn: &mut Conn, dir: &Path) -> Result<Frame, FsError> {
    let mut names: Vec<_> = fs::read_dir(dir)
        .map_err(io_err("list", dir))?
        .filter_map(|e| e.ok().map(|e| e.file_name()))
        .collect();
    names.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
    for name in names {
        let path = dir.join(&name);
        if let Ok(meta) = fs::symlink_metadata(&path) {
            write_frame(conn, &Frame::FileEntry(entry_of(&path, &meta)))
                .map_err(|e| FsError::Stream(e.to_string()))?;
        }
    }
    Ok(Frame::End)
}

/// A [`FileEntry`] for `path` and its `lstat` metadata.
pub fn entry_of(path: &Path, meta: &Metadata) -> FileEntry {
    let kind = meta.file_type();
    let kind_of = if kind.is_file() {
        FileType::File
    } else if kind.is_dir() {
        FileType::Dir
    } else if kind.is_symlink() {
        FileType::Symlink
    } else {
        FileType::Other
    };
    FileEntry {
        name: path.file_name().unwrap_or(path.as_os_str()).into(),
        path: path.as_os_str().into(),
        kind: kind_of,
        size: meta.len(),
        mode: meta.permissions().mode() & 0o7777,
        mtime: meta.mtime(),
        link_target: fs::read_link(path)
            .ok()
            .map(|t| ByteString::from(t.into_os_string())),
    }
}

fn mkdir(path: &Path, parents: bool) -> Result<(), FsError> {
    if parents {
        fs::create_dir_all(path).map_err(io_err("create directory", path))
    } else {
        fs::create_dir(path).map_err(io_err("create directory", path))
    }
}

fn remove(path: &Path, recursive: bool) -> Result<(), FsError> {
    if path == Path::new("/") {
        return Err(FsError::Refused("refusing to remove /".to_owned()));
    }
    let meta = fs::symlink_metadata(path).map_err(io_err("stat", path))?;
    if !meta.is_dir() {
        return fs::remove_file(path).map_err(io_err("remove", path));
    }
    if recursive {
        // std's remove_dir_all does not follow symlinks below `path`.
        return fs::remove_dir_all(path).map_err(io_err("remove", path));
    }
    fs::remove_dir(path).map_err(|e| match e.raw_os_error() {
        Some(libc::ENOTEMPTY) => FsError::Refused(format!(
            "{}: directory not empty (remove it recursively)",
            path.display()
        )),
        _ => io_err("remove", path)(e),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_normalised_lexically_and_must_be_absolute() {
        // Arrange
        let cases = [
            ("/a/./b//c/", "/a/b/c"),
            ("/a/../../etc", "/etc"),
            ("/", "/"),
        ];

        // Act
        let got: Vec<_> = cases
            .iter()
            .map(|(p, _)| normalise(PROTOCOL_VERSION, &(*p).into()).unwrap())
            .collect();

        // Assert
        for ((_, want), got) in cases.iter().zip(&got) {
            assert_eq!(got, Path::new(want));
        }
        assert!(matches!(
            normalise(PROTOCOL_VERSION, &"rel/x".into()),
            Err(FsError::NotAbsolute(_))
        ));
    }
}
