//! Writing the root tree into an ext4 image with `mkfs.ext4 -d` (e2fsprogs ≥ 1.43; no loop
//! mount, no privileges needed for this step), sizing it, and recognising ext4 images.
//!
//! The image is read-only for its whole life (every sandbox mounts it `ro`, writes go to an
//! overlay), so it is made without a journal (`-O ^has_journal`: nothing to replay, and a
//! clean file system cannot be marked for recovery), without reserved blocks (`-m 0`) and
//! with only a small headroom over the content.

use std::collections::HashSet;
use std::fs::{self, File};
use std::io::{self, Read, Seek, SeekFrom};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Bytes in a MiB.
pub const MIB: u64 = 1 << 20;

/// File-system block size used for images, in bytes.
pub const BLOCK_SIZE: u64 = 4096;

/// On-disk inode size used for images, in bytes (256: room for nanosecond times past 2038).
pub const INODE_SIZE: u64 = 256;

/// Fixed allowance for superblocks, group descriptors, bitmaps and directories growing while
/// being copied, in MiB.
const FIXED_OVERHEAD_MIB: u64 = 16;

/// Offset of the ext2/3/4 superblock's `s_magic` field in the image, in bytes (superblock at
/// 1024 + field offset 0x38).
pub const MAGIC_OFFSET: u64 = 1024 + 0x38;

/// `s_magic` of ext2/3/4 (little endian on disk).
pub const EXT4_MAGIC: u16 = 0xEF53;

/// Offset of the superblock in the image, in bytes.
const SUPERBLOCK_OFFSET: u64 = 1024;

/// Bytes of the superblock read by [`inspect`] (the whole 1024-byte superblock).
const SUPERBLOCK_LEN: usize = 1024;

/// `s_feature_incompat` bit saying block counts have a high 32-bit half (`INCOMPAT_64BIT`).
const INCOMPAT_64BIT: u32 = 0x80;

/// What an ext2/3/4 superblock says about the file system's extent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ext4Info {
    /// Block size in bytes (`1024 << s_log_block_size`).
    pub block_size: u64,
    /// Number of blocks (`s_blocks_count_lo`, plus `s_blocks_count_hi` with the 64-bit
    /// feature).
    pub blocks: u64,
}

impl Ext4Info {
    /// Bytes the file system spans: a file shorter than this is truncated.
    pub fn fs_bytes(&self) -> u64 {
        self.block_size.saturating_mul(self.blocks)
    }
}

/// Why a file is not a usable ext4 image.
#[derive(Debug, thiserror::Error)]
pub enum InspectError {
    /// The file could not be opened or read.
    #[error("reading {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What failed.
        source: io::Error,
    },
    /// No ext2/3/4 superblock (wrong magic, or the file is shorter than a superblock).
    #[error("{} is not an ext4 file system image", path.display())]
    NotExt4 {
        /// The file.
        path: PathBuf,
    },
    /// The superblock describes a file system larger than the file.
    #[error("{} is truncated: it is {file_bytes} bytes but its ext4 file system spans {fs_bytes} bytes", path.display())]
    Truncated {
        /// The file.
        path: PathBuf,
        /// The file's length.
        file_bytes: u64,
        /// What the superblock says the file system needs.
        fs_bytes: u64,
    },
}

/// Checks that `path` holds a whole ext2/3/4 file system: a superblock with the right magic
/// and a plausible block size, and a file at least as long as the block count says. Reads
/// only the superblock.
pub fn inspect(path: &Path) -> Result<Ext4Info, InspectError> {
    let io_err = |source| InspectError::Io {
        path: path.to_path_buf(),
        source,
    };
    let not_ext4 = || InspectError::NotExt4 {
        path: path.to_path_buf(),
    };
    let mut file = File::open(path).map_err(io_err)?;
    let file_bytes = file.metadata().map_err(io_err)?.len();
    if file_bytes < SUPERBLOCK_OFFSET + SUPERBLOCK_LEN as u64 {
        return Err(not_ext4());
    }
    let mut sb = [0u8; SUPERBLOCK_LEN];
    file.seek(SeekFrom::Start(SUPERBLOCK_OFFSET))
        .and_then(|_| file.read_exact(&mut sb))
        .map_err(io_err)?;
    let info = parse_superblock(&sb).ok_or_else(not_ext4)?;
    if info.fs_bytes() > file_bytes {
        return Err(InspectError::Truncated {
            path: path.to_path_buf(),
            file_bytes,
            fs_bytes: info.fs_bytes(),
        });
    }
    Ok(info)
}

/// The extent an ext2/3/4 superblock (`sb`, its first 1024 bytes) describes; `None` when the
/// magic is wrong or the block size is not 1–64 KiB.
pub fn parse_superblock(sb: &[u8; SUPERBLOCK_LEN]) -> Option<Ext4Info> {
    let u32_at = |off: usize| u32::from_le_bytes([sb[off], sb[off + 1], sb[off + 2], sb[off + 3]]);
    if u16::from_le_bytes([sb[0x38], sb[0x39]]) != EXT4_MAGIC {
        return None;
    }
    let log_block_size = u32_at(0x18);
    if log_block_size > 6 {
        return None;
    }
    let mut blocks = u64::from(u32_at(0x4));
    if u32_at(0x60) & INCOMPAT_64BIT != 0 {
        blocks |= u64::from(u32_at(0x150)) << 32;
    }
    Some(Ext4Info {
        block_size: 1024 << log_block_size,
        blocks,
    })
}

/// Errors making an image.
#[derive(Debug, thiserror::Error)]
pub enum Ext4Error {
    /// Walking the source tree failed.
    #[error("measuring {}: {source}", path.display())]
    Walk {
        /// Where.
        path: PathBuf,
        /// What failed.
        source: io::Error,
    },
    /// `mkfs.ext4` could not be started.
    #[error("running mkfs.ext4: {0} (install e2fsprogs)")]
    Spawn(io::Error),
    /// `mkfs.ext4` failed; `stderr` is its output.
    #[error("mkfs.ext4 failed ({status}): {stderr}")]
    Failed {
        /// Its exit status.
        status: std::process::ExitStatus,
        /// Its standard error, trimmed.
        stderr: String,
    },
}

impl Ext4Error {
    /// Whether `mkfs.ext4` ran out of blocks or inodes (the image size was too small).
    pub fn is_out_of_space(&self) -> bool {
        match self {
            Self::Failed { stderr, .. } => {
                let s = stderr.to_ascii_lowercase();
                s.contains("no space") || s.contains("could not allocate")
            }
            _ => false,
        }
    }
}

/// What a tree occupies.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Data bytes, every file rounded up to whole [`BLOCK_SIZE`] blocks, hard links once.
    pub bytes: u64,
    /// Number of inodes (files, directories, links, devices; hard links once).
    pub inodes: u64,
}

/// Measures the tree at `root` without following symbolic links or crossing mounts.
pub fn usage(root: &Path) -> Result<Usage, Ext4Error> {
    let walk_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| Ext4Error::Walk { path, source }
    };
    let root_meta = fs::symlink_metadata(root).map_err(walk_err(root))?;
    let mut usage = Usage::default();
    let mut seen = HashSet::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        usage.inodes += 1;
        usage.bytes += BLOCK_SIZE;
        for entry in fs::read_dir(&dir).map_err(walk_err(&dir))? {
            let path = entry.map_err(walk_err(&dir))?.path();
            let meta = fs::symlink_metadata(&path).map_err(walk_err(&path))?;
            if meta.dev() != root_meta.dev() {
                continue;
            }
            if meta.is_dir() {
                stack.push(path);
            } else if meta.nlink() == 1 || seen.insert(meta.ino()) {
                usage.inodes += 1;
                usage.bytes += meta.len().div_ceil(BLOCK_SIZE) * BLOCK_SIZE;
            }
        }
    }
    Ok(usage)
}

/// Inodes to create for content with `inodes` inodes: a quarter more plus 1024, so packages
/// installed by hand into a writable copy still find some.
pub fn inode_count(content: Usage) -> u64 {
    content.inodes + content.inodes / 4 + 1024
}

/// Image size in MiB for `content`: data + 10 %, inode tables, and a fixed 16 MiB for
/// metadata; at least 32 MiB.
pub fn auto_size_mib(content: Usage) -> u64 {
    let data = content.bytes + content.bytes / 10;
    let tables = inode_count(content) * INODE_SIZE;
    let total = data + tables + FIXED_OVERHEAD_MIB * MIB;
    total.div_ceil(MIB).max(32)
}

/// The `mkfs.ext4` arguments that write `source` into a new `size_mib` MiB image at `image`
/// with `inodes` inodes.
pub fn mkfs_args(source: &Path, image: &Path, size_mib: u64, inodes: u64) -> Vec<String> {
    let mut args: Vec<String> = [
        "-q",
        "-F",
        "-t",
        "ext4",
        "-O",
        "^has_journal",
        "-m",
        "0",
        "-L",
        "bulkhead-root",
    ]
    .map(String::from)
    .into();
    args.extend([
        "-b".into(),
        BLOCK_SIZE.to_string(),
        "-I".into(),
        INODE_SIZE.to_string(),
        "-N".into(),
        inodes.to_string(),
        "-d".into(),
        source.display().to_string(),
        image.display().to_string(),
        format!("{size_mib}M"),
    ]);
    args
}

/// Runs `mkfs.ext4` (the `mkfs_args`), creating or truncating `image` as a sparse file.
pub fn mkfs(source: &Path, image: &Path, size_mib: u64, inodes: u64) -> Result<(), Ext4Error> {
    let output = Command::new("mkfs.ext4")
        .args(mkfs_args(source, image, size_mib, inodes))
        .env("PATH", tool_path())
        .output()
        .map_err(Ext4Error::Spawn)?;
    if output.status.success() {
        return Ok(());
    }
    Err(Ext4Error::Failed {
        status: output.status,
        stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
    })
}

/// `PATH` for tools in `sbin` directories, which a non-root user's `PATH` often lacks.
pub fn tool_path() -> String {
    let inherited = std::env::var("PATH").unwrap_or_default();
    format!("{inherited}:/usr/local/sbin:/usr/sbin:/sbin:/usr/local/bin:/usr/bin:/bin")
}

/// Whether the file at `path` starts with an ext2/3/4 superblock (magic 0xEF53).
pub fn has_ext4_magic(path: &Path) -> io::Result<bool> {
    let mut file = File::open(path)?;
    if file.metadata()?.len() < MAGIC_OFFSET + 2 {
        return Ok(false);
    }
    file.seek(SeekFrom::Start(MAGIC_OFFSET))?;
    let mut magic = [0u8; 2];
    file.read_exact(&mut magic)?;
    Ok(u16::from_le_bytes(magic) == EXT4_MAGIC)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file of `len` bytes whose superblock claims `blocks` blocks of 4 KiB.
    fn fake_image(dir: &Path, name: &str, len: usize, blocks: u32) -> PathBuf {
        let mut bytes = vec![0u8; len];
        let sb = SUPERBLOCK_OFFSET as usize;
        bytes[sb + 0x4..sb + 0x8].copy_from_slice(&blocks.to_le_bytes());
        bytes[sb + 0x18..sb + 0x1c].copy_from_slice(&2u32.to_le_bytes());
        bytes[sb + 0x38..sb + 0x3a].copy_from_slice(&EXT4_MAGIC.to_le_bytes());
        let path = dir.join(name);
        fs::write(&path, bytes).unwrap();
        path
    }

    #[test]
    fn inspect_accepts_a_whole_image_and_reports_its_extent() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let path = fake_image(dir.path(), "whole", 4 * 4096, 4);

        // Act
        let info = inspect(&path).unwrap();

        // Assert
        assert_eq!(
            info,
            Ext4Info {
                block_size: 4096,
                blocks: 4
            }
        );
    }

    #[test]
    fn inspect_reports_truncated_and_foreign_files() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let truncated = fake_image(dir.path(), "cut", 3 * 4096, 4);
        let zeros = dir.path().join("zeros");
        fs::write(&zeros, vec![0u8; 8192]).unwrap();

        // Act
        let cut = inspect(&truncated).unwrap_err();
        let foreign = inspect(&zeros).unwrap_err();

        // Assert
        assert!(
            matches!(
                cut,
                InspectError::Truncated {
                    file_bytes: 12288,
                    fs_bytes: 16384,
                    ..
                }
            ),
            "{cut}"
        );
        assert!(matches!(foreign, InspectError::NotExt4 { .. }), "{foreign}");
    }

    #[test]
    fn usage_counts_blocks_and_hard_links_once() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("small"), b"x").unwrap();
        fs::write(dir.path().join("big"), vec![0u8; 5000]).unwrap();
        fs::hard_link(dir.path().join("big"), dir.path().join("big2")).unwrap();
        fs::create_dir(dir.path().join("sub")).unwrap();

        // Act
        let usage = usage(dir.path()).unwrap();

        // Assert: 2 dirs (4 KiB each) + small (4 KiB) + big (8 KiB, counted once)
        assert_eq!(usage.inodes, 4);
        assert_eq!(usage.bytes, 2 * 4096 + 4096 + 8192);
    }

    #[test]
    fn auto_size_leaves_headroom_over_the_content() {
        // Arrange
        let content = Usage {
            bytes: 250 * MIB,
            inodes: 11_000,
        };

        // Act
        let size = auto_size_mib(content);

        // Assert
        assert!(size > 250 + 25, "{size} MiB leaves no headroom");
        assert!(size < 320, "{size} MiB is wasteful");
        assert_eq!(
            auto_size_mib(Usage::default()),
            32,
            "tiny trees get the minimum"
        );
    }

    #[test]
    fn mkfs_arguments_make_a_journal_less_image_of_the_requested_size() {
        // Arrange / Act
        let args = mkfs_args(Path::new("/src"), Path::new("/img"), 300, 5000);

        // Assert
        let joined = args.join(" ");
        assert!(joined.contains("-O ^has_journal"));
        assert!(joined.contains("-N 5000"));
        assert!(joined.ends_with("-d /src /img 300M"));
    }

    #[test]
    fn ext4_magic_is_recognised_and_other_files_are_not() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let mut image = vec![0u8; 2048];
        image[MAGIC_OFFSET as usize..MAGIC_OFFSET as usize + 2]
            .copy_from_slice(&EXT4_MAGIC.to_le_bytes());
        fs::write(dir.path().join("good"), &image).unwrap();
        fs::write(dir.path().join("zeros"), vec![0u8; 2048]).unwrap();
        fs::write(dir.path().join("short"), b"tiny").unwrap();

        // Act / Assert
        assert!(has_ext4_magic(&dir.path().join("good")).unwrap());
        assert!(!has_ext4_magic(&dir.path().join("zeros")).unwrap());
        assert!(!has_ext4_magic(&dir.path().join("short")).unwrap());
    }
}
