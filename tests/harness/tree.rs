//! Directory trees as a user compares them (`cp -r` tests): every entry's name, type, mode, size,
//! link target and, for small files, contents.

use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// `(name relative to the root, file type, permission bits (0 for links), size (0 for
/// directories), link target, contents of regular files smaller than the limit)`.
pub type Entry = (Vec<u8>, String, u32, u64, Vec<u8>, Vec<u8>);

/// Every entry below `root`, sorted by name; regular files under `small` bytes with their
/// contents (larger ones, e.g. a sparse file, are compared by size only).
///
/// # Panics
/// When the tree cannot be read.
pub fn listing(root: &Path, small: u64) -> Vec<Entry> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let meta = fs::symlink_metadata(&path).unwrap();
            if meta.is_dir() {
                stack.push(path.clone());
            }
            let target = fs::read_link(&path).map(|t| t.as_os_str().as_bytes().to_vec());
            let contents = match meta.is_file() && meta.len() < small {
                true => fs::read(&path).unwrap(),
                false => Vec::new(),
            };
            let rel = path.strip_prefix(root).unwrap().as_os_str().as_bytes();
            let mode = match meta.is_symlink() {
                true => 0,
                false => meta.mode() & 0o7777,
            };
            let size = if meta.is_dir() { 0 } else { meta.len() };
            let kind = format!("{:?}", meta.file_type());
            out.push((
                rel.to_vec(),
                kind,
                mode,
                size,
                target.unwrap_or_default(),
                contents,
            ));
        }
    }
    out.sort();
    out
}
