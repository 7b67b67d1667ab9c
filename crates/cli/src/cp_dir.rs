//! `bulkhead cp -r`: directory trees into and out of a daemon sandbox as tar streams (the
//! daemon's archive API), packed and unpacked here with `bulkhead_protocol::archive`.

use std::ffi::OsStr;
use std::fs;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path};

use bulkhead_client::{Client, FileKind};
use bulkhead_protocol::archive::{self, ArchiveError, PackOptions, UnpackOptions};
use tokio::io::AsyncWriteExt;
use tokio_util::io::SyncIoBridge;

/// Exit status when the host destination is refused (it is or passes through a symlink).
pub const EXIT_REFUSED: u8 = 1;

/// Errors of `cp -r`.
#[derive(Debug, thiserror::Error)]
pub enum CpError {
    /// The host destination is refused before anything is written.
    #[error("{0}")]
    Refused(String),
    /// Anything else.
    #[error("{0}")]
    Failed(String),
}

impl CpError {
    /// The exit status and message for `block_on`.
    pub fn into_exit(self) -> Result<u8, String> {
        match self {
            CpError::Refused(message) => {
                eprintln!("bulkhead: error: {message}");
                Ok(EXIT_REFUSED)
            }
            CpError::Failed(message) => Err(message),
        }
    }
}

fn failed(e: impl std::fmt::Display) -> CpError {
    CpError::Failed(e.to_string())
}

/// Last component of a path, for naming the copy.
fn base_name(path: &[u8]) -> Option<Vec<u8>> {
    let name = Path::new(OsStr::from_bytes(path)).file_name()?;
    Some(name.as_bytes().to_vec())
}

/// True when a source path asks for a directory's contents rather than the directory: `.` or
/// ending in `/.` (as `docker cp SRC/. DST`).
pub fn contents_of(arg: &[u8]) -> bool {
    arg == b"." || arg.ends_with(b"/.")
}

/// `cp -r LOCAL ID:/dst`: into an existing guest directory `dst` (the copy keeps the source's
/// name; with `contents`, the source's entries go straight into `dst`), or as `dst` itself when
/// it does not exist (its parent must).
pub async fn copy_in(
    client: &Client,
    src: &Path,
    contents: bool,
    id: &str,
    dst_bytes: &[u8],
) -> Result<u8, CpError> {
    let dst = String::from_utf8_lossy(dst_bytes);
    let src_meta =
        fs::symlink_metadata(src).map_err(|e| failed(format!("{}: {e}", src.display())))?;
    let target = client.stat(id, dst_bytes).await.map_err(failed)?;
    let (dir, root) = match target {
        Some(info) if info.kind == FileKind::Dir && !contents => (dst_bytes.to_vec(), None),
        Some(info) if info.kind != FileKind::Dir && src_meta.is_dir() => {
            return Err(failed(format!(
                "cannot overwrite non-directory {id}:{dst} with directory {}",
                src.display()
            )))
        }
        _ => {
            let parent = Path::new(OsStr::from_bytes(dst_bytes))
                .parent()
                .unwrap_or(Path::new("/"));
            let name = base_name(dst_bytes)
                .ok_or_else(|| failed(format!("{id}:{dst}: cannot copy onto /")))?;
            (parent.as_os_str().as_bytes().to_vec(), Some(name))
        }
    };
    // The guest must have the directory the copy lands in before anything is read or sent (a
    // destination that is a directory itself was just seen).
    if root.is_some() && !is_guest_dir(client, id, &dir).await? {
        return Err(failed(format!(
            "{id}:{}: no such directory in the sandbox (the copy's destination must be in an \
             existing directory)",
            String::from_utf8_lossy(&dir)
        )));
    }
    let (reader, writer) = tokio::io::duplex(256 * 1024);
    let src = src.to_path_buf();
    let packer = tokio::task::spawn_blocking(move || {
        let mut sink = SyncIoBridge::new(writer);
        let options = PackOptions { root_name: root };
        let done = archive::pack(&src, &options, &mut sink);
        let _ = io::Write::flush(&mut sink);
        done
    });
    let sent = client.put_archive(id, &dir, reader).await;
    let packed = packer.await.map_err(failed)?;
    let packed = packed.map_err(failed)?;
    sent.map_err(failed)?;
    for skipped in &packed.skipped {
        eprintln!("bulkhead: skipped {}: {}", skipped.path, skipped.reason);
    }
    Ok(0)
}

/// True when `path` is a directory in sandbox `id`.
async fn is_guest_dir(client: &Client, id: &str, path: &[u8]) -> Result<bool, CpError> {
    let info = client.stat(id, path).await.map_err(failed)?;
    Ok(info.is_some_and(|info| info.kind == FileKind::Dir))
}

/// Where a copy out lands: the directory to extract into and the name for the archive's top
/// entry (`None`: keep the guest's name).
#[derive(Debug)]
struct Landing {
    dir: OwnedFd,
    root: Option<Vec<u8>>,
}

/// Checks the host destination before anything is written: neither it nor any directory on
/// the way may be a symlink. An existing directory receives the copy under the source's name;
/// otherwise (and for the `contents` of a directory) the copy is created, merged or replaces a
/// file as `dst`, whose parent must exist.
fn landing(dst: &Path, contents: bool) -> Result<Landing, CpError> {
    let absolute = if dst.is_absolute() {
        dst.to_path_buf()
    } else {
        std::env::current_dir().map_err(failed)?.join(dst)
    };
    if absolute.components().any(|c| c == Component::ParentDir) {
        return Err(CpError::Refused(format!(
            "{}: a destination with '..' components is refused",
            dst.display()
        )));
    }
    let refuse = |e: ArchiveError| match e {
        ArchiveError::Symlink { path } => CpError::Refused(format!(
            "{}: refusing to copy into a destination that is or passes through a symlink ({path})",
            dst.display()
        )),
        other => failed(format!("{}: {other}", dst.display())),
    };
    match fs::symlink_metadata(&absolute) {
        Ok(meta) if meta.is_dir() && !contents => Ok(Landing {
            dir: archive::open_dir_nofollow(&absolute).map_err(refuse)?,
            root: None,
        }),
        Ok(meta) if meta.file_type().is_symlink() => Err(refuse(ArchiveError::Symlink {
            path: absolute.display().to_string(),
        })),
        Ok(_) | Err(_) => {
            let parent = absolute.parent().unwrap_or(Path::new("/")).to_path_buf();
            let name = absolute
                .file_name()
                .map(|n| n.as_bytes().to_vec())
                .ok_or_else(|| failed(format!("{}: cannot copy onto /", dst.display())))?;
            Ok(Landing {
                dir: archive::open_dir_nofollow(&parent).map_err(refuse)?,
                root: Some(name),
            })
        }
    }
}

/// `cp -r ID:/src LOCAL`: the guest's tar stream, extracted as untrusted input (no absolute
/// names, no `..`, nothing through a symlink, set-ID bits dropped, limits). A `src` ending in
/// `/.` copies the directory's contents into `LOCAL`.
pub async fn copy_out(client: &Client, id: &str, src: &[u8], dst: &Path) -> Result<u8, CpError> {
    let landing = landing(dst, contents_of(src))?;
    let (reader, mut writer) = tokio::io::duplex(256 * 1024);
    let unpacker = tokio::task::spawn_blocking(move || {
        let options = UnpackOptions {
            rename_root: landing.root,
            keep_special_bits: false,
            limits: archive::Limits::default(),
        };
        archive::unpack(SyncIoBridge::new(reader), &landing.dir, &options)
    });
    let fetched = client.get_archive(id, src, &mut writer).await;
    let _ = writer.shutdown().await;
    drop(writer);
    let unpacked = unpacker.await.map_err(failed)?;
    // The extractor's error explains a broken transfer better than the broken pipe.
    let done = unpacked.map_err(|e| failed(format!("{}: {e}", dst.display())))?;
    fetched.map_err(failed)?;
    for skipped in &done.skipped {
        eprintln!("bulkhead: skipped {}: {}", skipped.path, skipped.reason);
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_destination_through_a_symlink_is_refused_before_anything_is_written() {
        // Arrange
        let tmp = tempfile::tempdir().unwrap();
        fs::create_dir(tmp.path().join("real")).unwrap();
        std::os::unix::fs::symlink("real", tmp.path().join("link")).unwrap();

        // Act
        let through = landing(&tmp.path().join("link/new"), false);
        let is_link = landing(&tmp.path().join("link"), true);
        let fine = landing(&tmp.path().join("real/new"), false);

        // Assert
        assert!(matches!(through, Err(CpError::Refused(_))), "{through:?}");
        assert!(matches!(is_link, Err(CpError::Refused(_))), "{is_link:?}");
        assert_eq!(fine.unwrap().root.as_deref(), Some(&b"new"[..]));
        assert_eq!(fs::read_dir(tmp.path().join("real")).unwrap().count(), 0);
    }
}
