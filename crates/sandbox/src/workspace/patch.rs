//! Writing git-style patches that `git apply` accepts, without git: `diff --git` headers with
//! file modes and full blob ids (`index <sha1>..<sha1>`, as `git diff --full-index` writes),
//! unified hunks with three lines of context for text, and `GIT binary patch` literals
//! (zlib-deflated, in git's base-85 alphabet; forward and reverse) for binary files.
//!
//! Why not a crate: `git2` (libgit2) can print patches of two buffers but pulls in a C library
//! and still leaves file creation, deletion and modes to the caller; the pure-Rust crates that
//! write git binary patches (`grit-lib`, `girt`) are young, single-maintainer projects. The
//! format is small and stable (git's `Documentation/gitformat-*`, `diff.c`, `apply.c`), the
//! line diff comes from the well-kept `similar` crate, and the tests check every shape of
//! change against the real `git apply`.
//!
//! A file is binary, as for git, when either side has a NUL byte in its first 8000 bytes.
//! Paths with bytes outside printable ASCII, `"` or `\` are written C-quoted (`"a/\303\251"`),
//! as git does with `core.quotePath`; unquoted names with a space get git's trailing tab on the
//! `---`/`+++` lines.

use std::io::{self, Write};
use std::time::{Duration, Instant};

use bulkhead_protocol::EntryKind;
use flate2::write::ZlibEncoder;
use flate2::Compression;
use sha1::{Digest, Sha1};
use similar::{Algorithm, DiffTag};

/// git mode of a regular file.
pub(crate) const MODE_FILE: u32 = 0o100_644;
/// git mode of an executable file.
pub(crate) const MODE_EXEC: u32 = 0o100_755;
/// git mode of a symbolic link.
pub(crate) const MODE_LINK: u32 = 0o120_000;

/// Lines of context around each change.
const CONTEXT: usize = 3;
/// How many leading bytes git inspects to call a file binary.
const BINARY_PROBE: usize = 8000;
/// Bytes per line of a base-85 binary literal.
const LITERAL_LINE: usize = 52;
/// Longest time spent on one file's line diff before settling for a coarser one (2 s).
const DIFF_DEADLINE: Duration = Duration::from_secs(2);
/// The all-zero blob id of a missing side.
const NO_BLOB: &str = "0000000000000000000000000000000000000000";
/// git's base-85 alphabet (`base85.c`).
const BASE85: &[u8; 85] =
    b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz!#$%&()*+-;<=>?@^_`{|}~";

/// One side of a file change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Blob<'a> {
    /// git mode ([`MODE_FILE`], [`MODE_EXEC`] or [`MODE_LINK`]).
    pub mode: u32,
    /// Contents, or a link's target.
    pub data: &'a [u8],
}

/// The git mode of an entry of `kind` with permission bits `perm` (git keeps only the owner's
/// executable bit).
pub(crate) fn git_mode(kind: EntryKind, perm: u32) -> u32 {
    match (kind, perm & 0o100 != 0) {
        (EntryKind::Symlink, _) => MODE_LINK,
        (_, true) => MODE_EXEC,
        (_, false) => MODE_FILE,
    }
}

/// Writes the diff of `path` from `old` to `new` (`None`: absent). Nothing for two absent or
/// identical sides; a file replaced by a link (or back) is a deletion and a creation.
pub(crate) fn write_diff(
    out: &mut dyn Write,
    path: &str,
    old: Option<Blob<'_>>,
    new: Option<Blob<'_>>,
) -> io::Result<()> {
    match (old, new) {
        (Some(o), Some(n)) if (o.mode == MODE_LINK) != (n.mode == MODE_LINK) => {
            write_one(out, path, Some(o), None)?;
            write_one(out, path, None, Some(n))
        }
        (Some(o), Some(n)) if o == n => Ok(()),
        (None, None) => Ok(()),
        (old, new) => write_one(out, path, old, new),
    }
}

fn write_one(
    out: &mut dyn Write,
    path: &str,
    old: Option<Blob<'_>>,
    new: Option<Blob<'_>>,
) -> io::Result<()> {
    let (a, b) = (quote("a/", path), quote("b/", path));
    writeln!(out, "diff --git {a} {b}")?;
    let id = |blob: Option<Blob<'_>>| blob.map_or(NO_BLOB.to_owned(), |b| blob_id(b.data));
    match (old, new) {
        (None, Some(n)) => writeln!(out, "new file mode {:o}", n.mode)?,
        (Some(o), None) => writeln!(out, "deleted file mode {:o}", o.mode)?,
        (Some(o), Some(n)) if o.mode != n.mode => {
            writeln!(out, "old mode {:o}\nnew mode {:o}", o.mode, n.mode)?;
        }
        _ => {}
    }
    let old_data = old.map_or(&[][..], |b| b.data);
    let new_data = new.map_or(&[][..], |b| b.data);
    if old.is_some() && new.is_some() && old_data == new_data {
        return Ok(()); // a mode change only
    }
    write!(out, "index {}..{}", id(old), id(new))?;
    match (old, new) {
        (Some(o), Some(n)) if o.mode == n.mode => writeln!(out, " {:o}", o.mode)?,
        _ => writeln!(out)?,
    }
    if old_data.is_empty() && new_data.is_empty() {
        return Ok(()); // an empty file created or deleted: the header says it all
    }
    if is_binary(old_data) || is_binary(new_data) {
        writeln!(out, "GIT binary patch")?;
        literal(out, new_data)?;
        return literal(out, old_data);
    }
    let side = |present: bool, name: &str| match present {
        false => "/dev/null".to_owned(),
        true if name.contains(' ') && !name.starts_with('"') => format!("{name}\t"),
        true => name.to_owned(),
    };
    writeln!(out, "--- {}", side(old.is_some(), &a))?;
    writeln!(out, "+++ {}", side(new.is_some(), &b))?;
    hunks(out, old_data, new_data)
}

/// git's blob id of `data`: SHA-1 of `blob <len>\0<data>`, hex.
pub(crate) fn blob_id(data: &[u8]) -> String {
    let mut hasher = Sha1::new();
    hasher.update(format!("blob {}\0", data.len()).as_bytes());
    hasher.update(data);
    hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn is_binary(data: &[u8]) -> bool {
    data[..data.len().min(BINARY_PROBE)].contains(&0)
}

/// `prefix` + `path`, C-quoted as git quotes names when needed.
pub(crate) fn quote(prefix: &str, path: &str) -> String {
    let full = format!("{prefix}{path}");
    let plain = |b: u8| (0x20..0x7f).contains(&b) && b != b'"' && b != b'\\';
    if full.bytes().all(plain) {
        return full;
    }
    let mut quoted = String::from("\"");
    for b in full.bytes() {
        match b {
            b'"' => quoted.push_str("\\\""),
            b'\\' => quoted.push_str("\\\\"),
            b'\t' => quoted.push_str("\\t"),
            b'\n' => quoted.push_str("\\n"),
            b'\r' => quoted.push_str("\\r"),
            0x07 => quoted.push_str("\\a"),
            0x08 => quoted.push_str("\\b"),
            0x0b => quoted.push_str("\\v"),
            0x0c => quoted.push_str("\\f"),
            b if plain(b) => quoted.push(char::from(b)),
            b => quoted.push_str(&format!("\\{b:03o}")),
        }
    }
    quoted.push('"');
    quoted
}

/// The lines of `data`, each with its `\n` (the last may lack one).
fn lines(data: &[u8]) -> Vec<&[u8]> {
    data.split_inclusive(|&b| b == b'\n').collect()
}

/// A hunk range: `start,len` (1-based), `start` alone for one line, and for no lines the
/// number of the line before.
fn range(start: usize, len: usize) -> String {
    match len {
        0 => format!("{start},0"),
        1 => format!("{}", start + 1),
        _ => format!("{},{len}", start + 1),
    }
}

fn hunks(out: &mut dyn Write, old: &[u8], new: &[u8]) -> io::Result<()> {
    let (a, b) = (lines(old), lines(new));
    let deadline = Instant::now() + DIFF_DEADLINE;
    let ops = similar::capture_diff_slices_deadline(Algorithm::Myers, &a, &b, Some(deadline));
    for group in similar::group_diff_ops(ops, CONTEXT) {
        let (Some(first), Some(last)) = (group.first(), group.last()) else {
            continue;
        };
        let old_range = first.old_range().start..last.old_range().end;
        let new_range = first.new_range().start..last.new_range().end;
        writeln!(
            out,
            "@@ -{} +{} @@",
            range(old_range.start, old_range.len()),
            range(new_range.start, new_range.len())
        )?;
        for op in &group {
            let (tag, old_lines, new_lines) = op.as_tag_tuple();
            match tag {
                DiffTag::Equal => emit(out, b' ', &a[old_lines])?,
                DiffTag::Delete => emit(out, b'-', &a[old_lines])?,
                DiffTag::Insert => emit(out, b'+', &b[new_lines])?,
                DiffTag::Replace => {
                    emit(out, b'-', &a[old_lines])?;
                    emit(out, b'+', &b[new_lines])?;
                }
            }
        }
    }
    Ok(())
}

fn emit(out: &mut dyn Write, prefix: u8, lines: &[&[u8]]) -> io::Result<()> {
    for line in lines {
        out.write_all(&[prefix])?;
        out.write_all(line)?;
        if !line.ends_with(b"\n") {
            out.write_all(b"\n\\ No newline at end of file\n")?;
        }
    }
    Ok(())
}

/// One `literal <size>` block: `data` zlib-deflated, in base-85 lines of up to 52 bytes each
/// prefixed by their length (`A`-`Z` = 1-26, `a`-`z` = 27-52), then an empty line.
fn literal(out: &mut dyn Write, data: &[u8]) -> io::Result<()> {
    writeln!(out, "literal {}", data.len())?;
    let mut encoder = ZlibEncoder::new(Vec::new(), Compression::default());
    encoder.write_all(data)?;
    let deflated = encoder.finish()?;
    for chunk in deflated.chunks(LITERAL_LINE) {
        let n = chunk.len() as u8; // 1..=52
        let tag = if n <= 26 { b'A' + n - 1 } else { b'a' + n - 27 };
        out.write_all(&[tag])?;
        out.write_all(&base85(chunk))?;
        out.write_all(b"\n")?;
    }
    writeln!(out)
}

/// git's base-85: each group of 4 bytes (big-endian, the last zero-padded) as 5 digits, most
/// significant first.
fn base85(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len().div_ceil(4) * 5);
    for group in data.chunks(4) {
        let mut word = [0u8; 4];
        word[..group.len()].copy_from_slice(group);
        let mut acc = u32::from_be_bytes(word);
        let mut digits = [0u8; 5];
        for digit in digits.iter_mut().rev() {
            *digit = BASE85[(acc % 85) as usize];
            acc /= 85;
        }
        out.extend_from_slice(&digits);
    }
    out
}

#[cfg(test)]
#[path = "patch_tests.rs"]
mod tests;
