//! Packing a file, symlink or directory tree into a tar stream.

use std::fs::{self, File, Metadata};
use std::io::{self, Read, Seek, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use tar::{Builder, EntryType, Header, HeaderMode};

use super::sparse::{data_segments, sparse_header, SegmentReader};
use super::{lossy, ArchiveError};
use crate::fsops::ArchiveDone;
use crate::workspace::SkippedEntry;

/// How to pack.
#[derive(Debug, Clone, Default)]
pub struct PackOptions {
    /// Top-level entry name; default: the last component of the source path.
    pub root_name: Option<Vec<u8>>,
}

/// Packs `source` (not followed when it is a symlink) into a tar stream written to `out`,
/// entries named `ROOT`, `ROOT/child`, ... in name order. Returns the totals and the entries
/// left out (device nodes, FIFOs, sockets); `out` gets the end-of-archive blocks too.
pub fn pack(
    source: &Path,
    options: &PackOptions,
    out: impl Write,
) -> Result<ArchiveDone, ArchiveError> {
    let shown = source.display().to_string();
    let root = match &options.root_name {
        Some(name) => name.clone(),
        None => source
            .file_name()
            .map(|n| n.as_bytes().to_vec())
            .ok_or(ArchiveError::Source {
                path: shown.clone(),
                reason: "has no last component to name the archive's top entry (is it / or ..?)",
            })?,
    };
    let meta = fs::symlink_metadata(source).map_err(io_at("stat", &shown))?;
    let mut builder = Builder::new(out);
    let mut done = ArchiveDone::default();
    // A stack instead of recursion: deep trees cannot overflow the agent's stack.
    let mut stack: Vec<(PathBuf, Vec<u8>, Metadata)> = vec![(source.to_path_buf(), root, meta)];
    while let Some((path, name, meta)) = stack.pop() {
        if meta.is_dir() {
            let mut children = read_children(&path)?;
            children.sort_by(|a, b| b.0.cmp(&a.0)); // popped in name order
            for (child, child_meta) in children {
                let mut child_name = name.clone();
                child_name.push(b'/');
                child_name.extend_from_slice(&child);
                stack.push((path.join(super::path::os(&child)), child_name, child_meta));
            }
        }
        append(&mut builder, &path, &name, &meta, &mut done)?;
    }
    builder.into_inner().map_err(ArchiveError::Stream)?;
    Ok(done)
}

fn io_at<'a>(op: &'static str, path: &'a str) -> impl FnOnce(io::Error) -> ArchiveError + 'a {
    move |source| ArchiveError::Io {
        op,
        path: path.to_owned(),
        source,
    }
}

fn read_children(dir: &Path) -> Result<Vec<(Vec<u8>, Metadata)>, ArchiveError> {
    let shown = dir.display().to_string();
    let mut out = Vec::new();
    for entry in fs::read_dir(dir).map_err(io_at("list", &shown))? {
        let entry = entry.map_err(io_at("list", &shown))?;
        let meta = entry.metadata().map_err(io_at("stat", &shown))?;
        out.push((entry.file_name().as_bytes().to_vec(), meta));
    }
    Ok(out)
}

fn append<W: Write>(
    builder: &mut Builder<W>,
    path: &Path,
    name: &[u8],
    meta: &Metadata,
    done: &mut ArchiveDone,
) -> Result<(), ArchiveError> {
    let shown = lossy(name);
    let kind = meta.file_type();
    let mut header = Header::new_gnu();
    header.set_metadata_in_mode(meta, HeaderMode::Complete);
    let name_path = Path::new(super::path::os(name));
    let stream = ArchiveError::Stream;
    if kind.is_dir() {
        header.set_entry_type(EntryType::Directory);
        header.set_size(0);
        let mut dir_name = name.to_vec();
        dir_name.push(b'/');
        builder
            .append_data(&mut header, super::path::os(&dir_name), io::empty())
            .map_err(stream)?;
    } else if kind.is_symlink() {
        let target = fs::read_link(path).map_err(io_at("read link", &shown))?;
        header.set_size(0);
        builder
            .append_link(&mut header, name_path, &target)
            .map_err(stream)?;
    } else if kind.is_file() {
        done.bytes += append_file(builder, path, name_path, &mut header, meta)?;
    } else {
        let what = if kind.is_fifo() {
            "a FIFO"
        } else if kind.is_socket() {
            "a socket"
        } else {
            "a device node"
        };
        done.skipped.push(SkippedEntry {
            path: shown,
            reason: format!("{what}: not archived"),
        });
        return Ok(());
    }
    done.entries += 1;
    Ok(())
}

/// Appends a regular file (a sparse entry when it has holes); returns the data bytes stored.
fn append_file<W: Write>(
    builder: &mut Builder<W>,
    path: &Path,
    name: &Path,
    header: &mut Header,
    meta: &Metadata,
) -> Result<u64, ArchiveError> {
    let shown = path.display().to_string();
    let file = File::options()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(io_at("open", &shown))?;
    let size = meta.size();
    if let Some(segments) = data_segments(&file, size) {
        let ext = sparse_header(header, &segments, size);
        let data: u64 = segments.iter().map(|s| s.1).sum();
        let reader = io::Cursor::new(ext).chain(SegmentReader::new(&file, segments));
        builder
            .append_data(header, name, reader)
            .map_err(ArchiveError::Stream)?;
        return Ok(data);
    }
    // Exactly `size` bytes, whatever happens to the file meanwhile (zeros if it shrank).
    (&file)
        .seek(io::SeekFrom::Start(0))
        .map_err(io_at("seek", &shown))?;
    let reader = (&file).take(size).chain(io::repeat(0)).take(size);
    builder
        .append_data(header, name, reader)
        .map_err(ArchiveError::Stream)?;
    Ok(size)
}
