//! `bulkhead-image`: root filesystem images for bulkhead sandboxes.
//!
//! An image is a Debian root file system in an ext4 file (`rootfs.ext4`) plus a
//! `manifest.json`, in `<data dir>/images/<name>/` ([`ImageStore`]). Sandboxes attach it
//! read-only as their first virtio-blk disk and boot with `bulkhead.root=/dev/vda`; the guest
//! agent overlays a private writable layer (see `docs/images.md`).
//!
//! Building ([`ImageStore::build`]) bootstraps Debian with `mmdebstrap` (root needed),
//! installs the guest agent as `/sbin/bulkhead-agent`, and writes the tree with
//! `mkfs.ext4 -d`: no loop mounts. Builds are staged next to the store and published with
//! one rename, so a failed or interrupted build never leaves a half image under a name.
//!
//! ```no_run
//! use bulkhead_image::{BuildSpec, ImageStore};
//!
//! let store = ImageStore::open_default()?;
//! let spec = BuildSpec::new("debian", "target/x86_64-unknown-linux-musl/release/bulkhead-agent");
//! let manifest = store.build(&spec, &mut |p| eprintln!("{:?} {}", p.phase, p.message))?;
//! println!("{} bytes, sha256 {}", manifest.size_bytes, manifest.sha256);
//! let image = store.get("debian")?; // image.rootfs: attach with `--disk PATH:ro`
//! # Ok::<(), bulkhead_image::StoreError>(())
//! ```

#![deny(missing_docs)]

pub mod builder;
pub mod debian;
pub mod ext4;
pub mod fsutil;
pub mod manifest;
pub mod paths;
pub mod spec;
pub mod store;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

pub use builder::{BuildError, RootfsBuilder};
pub use debian::DebianBuilder;
pub use manifest::{Manifest, ManifestError, MANIFEST_FILE, ROOTFS_FILE};
pub use paths::{default_cache_dir, default_data_dir, PathsError};
pub use spec::{BuildSpec, Phase, Progress, SpecError, DEFAULT_PACKAGES, DEFAULT_SUITE};
pub use store::{Image, ImageStore, StoreError};
