//! Whole-file transfers: `FileWrite` (host → guest) and `FileRead` (guest → host).

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

use bulkhead_protocol::frame::encode_raw;
use bulkhead_protocol::{
    read_frame, write_frame, Ack, ErrorCode, FileReadRequest, FileWriteRequest, Frame, FrameType,
    DATA_CHUNK, PROTOCOL_VERSION,
};

use crate::conn::Conn;

/// Errors of file requests (reported to the host as `Error` frames).
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// The request's protocol version is not ours.
    #[error("unsupported protocol version {0} (this agent speaks {PROTOCOL_VERSION})")]
    Version(u32),
    /// The path is not absolute.
    #[error("path {0:?} is not absolute")]
    NotAbsolute(String),
    /// The path to read is not a regular file.
    #[error("{0}: not a regular file")]
    NotRegular(String),
    /// A filesystem operation failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was attempted (`open`, `write`, ...).
        op: &'static str,
        /// The guest path.
        path: String,
        /// What the kernel said.
        source: io::Error,
    },
    /// The host sent something other than `Data` or `End`, or the stream broke.
    #[error("file contents: {0}")]
    Stream(String),
}

fn io_err<'a>(op: &'static str, path: &'a str) -> impl FnOnce(io::Error) -> FileError + 'a {
    move |source| FileError::Io {
        op,
        path: path.to_owned(),
        source,
    }
}

fn check_path(version: u32, path: &str) -> Result<(), FileError> {
    if version != PROTOCOL_VERSION {
        return Err(FileError::Version(version));
    }
    if !Path::new(path).is_absolute() {
        return Err(FileError::NotAbsolute(path.to_owned()));
    }
    Ok(())
}

/// Serves a `FileWrite`: creates or truncates `path` (creating missing parent directories),
/// writes every `Data` frame until `End`, sets the mode exactly, and answers `Ack` or `Error`.
/// After a failure it still reads the contents up to `End`, so the host gets the `Error`
/// instead of a broken pipe. A transfer cut short leaves a partial file.
pub fn serve_write(mut conn: Conn, req: &FileWriteRequest) {
    let mut file = open_for_write(req);
    let mut written = 0u64;
    let ended = loop {
        match read_frame(&mut conn) {
            Ok(Some(Frame::Data(bytes))) => {
                if let Ok(f) = &mut file {
                    match f.write_all(&bytes) {
                        Ok(()) => written += bytes.len() as u64,
                        Err(e) => file = Err(io_err("write", &req.path)(e)),
                    }
                }
            }
            Ok(Some(Frame::End)) => break Ok(()),
            Ok(Some(other)) => break Err(format!("unexpected {} frame", other.kind())),
            Ok(None) => break Err("connection closed before End".to_owned()),
            Err(e) => break Err(e.to_string()),
        }
    };
    let reply = match (ended, file) {
        (Err(reason), _) => Frame::Error(FileError::Stream(reason).into_message()),
        (Ok(()), Err(e)) => Frame::Error(e.into_message()),
        (Ok(()), Ok(_)) => Frame::Ack(Ack { bytes: written }),
    };
    let _ = write_frame(&mut conn, &reply);
}

impl FileError {
    fn into_message(self) -> bulkhead_protocol::ErrorMessage {
        let code = match &self {
            FileError::Version(_) => ErrorCode::UnsupportedVersion,
            FileError::NotAbsolute(_) | FileError::NotRegular(_) => ErrorCode::InvalidRequest,
            FileError::Io { source, .. } => ErrorCode::of_io(source),
            FileError::Stream(_) => ErrorCode::Protocol,
        };
        bulkhead_protocol::ErrorMessage::new(code, self.to_string())
    }
}

fn open_for_write(req: &FileWriteRequest) -> Result<File, FileError> {
    check_path(req.version, &req.path)?;
    let path = Path::new(&req.path);
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent).map_err(io_err("create parent directories of", &req.path))?;
    }
    let mode = req.mode & 0o7777;
    let file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(path)
        .map_err(io_err("open", &req.path))?;
    // The umask shaped the mode of a new file, and an existing file kept its old mode.
    file.set_permissions(fs::Permissions::from_mode(mode))
        .map_err(io_err("chmod", &req.path))?;
    Ok(file)
}

/// Serves a `FileRead`: sends the file as `Data` frames of [`DATA_CHUNK`] bytes and `End`,
/// or `Error` (possibly after some `Data`, when reading fails midway).
pub fn serve_read(mut conn: Conn, req: &FileReadRequest) {
    let result = stream_file(&mut conn, req);
    let last = match result {
        Ok(()) => Frame::End,
        Err(StreamFailure::File(e)) => Frame::Error(e.into_message()),
        Err(StreamFailure::HostGone) => return,
    };
    let _ = write_frame(&mut conn, &last);
}

enum StreamFailure {
    File(FileError),
    HostGone,
}

fn stream_file(conn: &mut Conn, req: &FileReadRequest) -> Result<(), StreamFailure> {
    let fail = StreamFailure::File;
    check_path(req.version, &req.path).map_err(fail)?;
    let mut file = File::open(&req.path)
        .map_err(io_err("open", &req.path))
        .map_err(fail)?;
    let meta = file
        .metadata()
        .map_err(io_err("stat", &req.path))
        .map_err(fail)?;
    if !meta.is_file() {
        return Err(fail(FileError::NotRegular(req.path.clone())));
    }
    let mut buf = vec![0u8; DATA_CHUNK];
    let mut frame = Vec::with_capacity(DATA_CHUNK + 8);
    loop {
        let n = match file.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(fail(io_err("read", &req.path)(e))),
        };
        frame.clear();
        let _ = encode_raw(FrameType::Data, &buf[..n], &mut frame);
        conn.write_all(&frame)
            .map_err(|_| StreamFailure::HostGone)?;
    }
}
