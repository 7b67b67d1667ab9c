//! Image stores with fake images, for other crates' tests (feature `testing`).

use std::path::Path;

use crate::builder::{BuildError, RootfsBuilder};
use crate::ext4::{EXT4_MAGIC, MAGIC_OFFSET};
use crate::{BuildSpec, ImageStore, Progress};

/// Writes a one-block (4 KiB) file with an ext4 superblock: enough for the store's and the
/// sandbox's checks, which read the superblock only.
#[derive(Debug)]
struct OneBlockBuilder;

impl RootfsBuilder for OneBlockBuilder {
    fn build(
        &self,
        _spec: &BuildSpec,
        _work_dir: &Path,
        image: &Path,
        _progress: &mut dyn FnMut(Progress),
    ) -> Result<(), BuildError> {
        let mut bytes = vec![0u8; 4096];
        bytes[1024 + 0x4] = 1; // s_blocks_count_lo = 1
        bytes[1024 + 0x18] = 2; // s_log_block_size = 2: 4 KiB blocks
        let magic = MAGIC_OFFSET as usize;
        bytes[magic..magic + 2].copy_from_slice(&EXT4_MAGIC.to_le_bytes());
        std::fs::write(image, bytes).expect("write the fake image");
        Ok(())
    }
}

/// The store in `images_dir` with one fake image per name.
///
/// # Panics
/// When an image cannot be written (a test's set-up failed).
pub fn store_with(images_dir: &Path, names: &[&str]) -> ImageStore {
    let store = ImageStore::at_images_dir(images_dir);
    for name in names {
        let spec = BuildSpec::new(*name, "/nonexistent/agent");
        store
            .build_with(&OneBlockBuilder, &spec, &mut |_| {})
            .expect("build a fake image");
    }
    store
}
