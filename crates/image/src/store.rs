//! The image store: one directory per image under `<data dir>/images/`, holding
//! `rootfs.ext4` and `manifest.json`.
//!
//! Builds happen in a hidden staging directory next to the images
//! (`.build-<name>-<pid>-<n>`), which becomes `<name>` with one `rename(2)` when everything in
//! it is complete (`renameat2(RENAME_EXCHANGE)` when an older image of that name exists, so
//! the name never points at a half-built image). A failed build deletes its staging
//! directory; one that was killed leaves it behind, and the next build removes it once its
//! process is gone. Directories without a manifest (such as `default/`, which holds the
//! initramfs) are not images: they are never listed, removed or replaced.

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::SystemTime;

use crate::builder::{BuildError, RootfsBuilder};
use crate::debian::DebianBuilder;
use crate::ext4;
use crate::fsutil::{pid_alive, remove_tree, sha256_file};
use crate::manifest::{
    rfc3339_utc, Manifest, ManifestError, BUILDER_VERSION, MANIFEST_FILE, ROOTFS_FILE,
};
use crate::paths::{self, PathsError};
use crate::spec::{validate_name, BuildSpec, Phase, Progress, SpecError};

/// Subdirectory of the data directory holding the images.
pub const IMAGES_DIR: &str = "images";

/// Prefixes of the store's hidden working directories, each followed by `<name>-<pid>-<n>`.
const STAGING_PREFIXES: [&str; 2] = [".build-", ".trash-"];

/// Distinguishes staging directories of concurrent builds in one process.
static STAGING_COUNTER: AtomicU32 = AtomicU32::new(0);

/// Errors of the image store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The spec or name is invalid.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// No image of that name.
    #[error("image {name:?} not found in {} (`bulkhead image ls` lists the images; `bulkhead image build debian --name {name}` builds one)", dir.display())]
    NotFound {
        /// The name asked for.
        name: String,
        /// The store's images directory.
        dir: PathBuf,
    },
    /// A directory of that name exists but is not an image (it has no manifest).
    #[error("{} exists but is not an image (no manifest.json); refusing to touch it", path.display())]
    NotAnImage {
        /// The directory.
        path: PathBuf,
    },
    /// The manifest could not be read or written.
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    /// The image file does not match its manifest or is not ext4.
    #[error("image {name:?} is damaged: {reason}; rebuild it")]
    Damaged {
        /// The image name.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// The build step failed.
    #[error("building image {name:?}: {source}")]
    Build {
        /// The image name.
        name: String,
        /// What failed.
        source: BuildError,
    },
    /// A file operation failed.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What was being done.
        what: &'static str,
        /// On which path.
        path: PathBuf,
        /// What failed.
        source: io::Error,
    },
    /// The default directories could not be located.
    #[error(transparent)]
    Paths(#[from] PathsError),
}

fn io_err(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> StoreError {
    let path = path.to_path_buf();
    move |source| StoreError::Io { what, path, source }
}

/// An image found in the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Image {
    /// Its manifest.
    pub manifest: Manifest,
    /// Its directory, `<data dir>/images/<name>`.
    pub dir: PathBuf,
    /// Its root filesystem, `<dir>/rootfs.ext4`: attach it read-only (`--disk PATH:ro`).
    pub rootfs: PathBuf,
}

/// The image store; see the module documentation.
#[derive(Debug, Clone)]
pub struct ImageStore {
    images_dir: PathBuf,
    cache_dir: Option<PathBuf>,
}

impl ImageStore {
    /// The store under `data_dir` (bulkhead's data directory; images live in
    /// `data_dir/images/`). Nothing is created until a build.
    pub fn new(data_dir: impl AsRef<Path>) -> Self {
        Self {
            images_dir: data_dir.as_ref().join(IMAGES_DIR),
            cache_dir: None,
        }
    }

    /// The store whose images live directly in `images_dir` (`images_dir/<name>/`), for
    /// callers configured with the images directory itself rather than a data directory
    /// (e.g. bulkheadd's `images_dir`). `ImageStore::new(d)` is `ImageStore::at_images_dir(d/images)`.
    pub fn at_images_dir(images_dir: impl Into<PathBuf>) -> Self {
        Self {
            images_dir: images_dir.into(),
            cache_dir: None,
        }
    }

    /// The store under the default data directory, `${XDG_DATA_HOME:-~/.local/share}/bulkhead`.
    pub fn open_default() -> Result<Self, StoreError> {
        Ok(Self::new(paths::default_data_dir()?))
    }

    /// Uses `cache_dir` as bulkhead's cache directory for builds (downloaded packages go to
    /// `cache_dir/apt/`) instead of `${XDG_CACHE_HOME:-~/.cache}/bulkhead`.
    pub fn with_cache_dir(mut self, cache_dir: impl Into<PathBuf>) -> Self {
        self.cache_dir = Some(cache_dir.into());
        self
    }

    /// The directory holding one subdirectory per image.
    pub fn images_dir(&self) -> &Path {
        &self.images_dir
    }

    /// Every image's manifest, sorted by name. Directories without a manifest are skipped;
    /// a missing store is empty.
    pub fn list(&self) -> Result<Vec<Manifest>, StoreError> {
        let entries = match fs::read_dir(&self.images_dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io_err("reading", &self.images_dir)(e)),
        };
        let mut manifests = Vec::new();
        for entry in entries {
            let entry = entry.map_err(io_err("reading", &self.images_dir))?;
            let name = entry.file_name();
            if name.to_str().is_none_or(|n| validate_name(n).is_err()) {
                continue; // hidden staging directories and foreign names
            }
            let dir = entry.path();
            if dir.join(MANIFEST_FILE).is_file() {
                manifests.push(Manifest::read(&dir)?);
            }
        }
        manifests.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(manifests)
    }

    /// The image `name`, after cheap checks that its `rootfs.ext4` exists, has the
    /// manifest's length and holds a whole ext4 file system ([`ext4::inspect`] reads the
    /// superblock only; the full sha256 is checked by
    /// [`ImageStore::verify`]).
    pub fn get(&self, name: &str) -> Result<Image, StoreError> {
        let dir = self.image_dir(name)?;
        let manifest = self.read_manifest(name, &dir)?;
        let rootfs = dir.join(ROOTFS_FILE);
        let damaged = |reason: String| StoreError::Damaged {
            name: name.to_owned(),
            reason,
        };
        let len = fs::metadata(&rootfs)
            .map_err(|e| damaged(format!("{}: {e}", rootfs.display())))?
            .len();
        if len != manifest.size_bytes {
            return Err(damaged(format!(
                "{} is {len} bytes, the manifest says {}",
                rootfs.display(),
                manifest.size_bytes
            )));
        }
        ext4::inspect(&rootfs).map_err(|e| damaged(e.to_string()))?;
        Ok(Image {
            manifest,
            dir,
            rootfs,
        })
    }

    /// [`ImageStore::get`] plus a full SHA-256 comparison with the manifest (reads the
    /// whole image).
    pub fn verify(&self, name: &str) -> Result<Image, StoreError> {
        let image = self.get(name)?;
        let digest = sha256_file(&image.rootfs).map_err(io_err("hashing", &image.rootfs))?;
        if digest != image.manifest.sha256 {
            return Err(StoreError::Damaged {
                name: name.to_owned(),
                reason: format!(
                    "sha256 is {digest}, the manifest says {}",
                    image.manifest.sha256
                ),
            });
        }
        Ok(image)
    }

    /// Deletes the image `name` and returns its manifest. The directory is first renamed
    /// out of the way, so the name disappears at once. Sandboxes still running on the image
    /// keep their open file.
    pub fn remove(&self, name: &str) -> Result<Manifest, StoreError> {
        let dir = self.image_dir(name)?;
        let manifest = self.read_manifest(name, &dir)?;
        let trash = self.staging_path(".trash-", name);
        fs::rename(&dir, &trash).map_err(io_err("moving away", &dir))?;
        remove_tree(&trash).map_err(io_err("removing", &trash))?;
        Ok(manifest)
    }

    /// Builds `spec` with the Debian builder (mmdebstrap) and adds it to the store, replacing
    /// an older image of the same name. See [`ImageStore::build_with`].
    pub fn build(
        &self,
        spec: &BuildSpec,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<Manifest, StoreError> {
        let cache_dir = match &self.cache_dir {
            Some(dir) => dir.clone(),
            None => paths::default_cache_dir()?,
        };
        self.build_with(&DebianBuilder::new(cache_dir), spec, progress)
    }

    /// Builds `spec` with `builder` in a staging directory, hashes the image, writes the
    /// manifest and publishes the directory as `<name>`. On any error the staging directory
    /// is deleted and the store is as before.
    pub fn build_with(
        &self,
        builder: &dyn RootfsBuilder,
        spec: &BuildSpec,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<Manifest, StoreError> {
        spec.validate()?;
        let target = self.images_dir.join(&spec.name);
        if target.exists() && !target.join(MANIFEST_FILE).is_file() {
            return Err(StoreError::NotAnImage { path: target });
        }
        progress(Progress::new(Phase::Prepare, "preparing", Some(0.0)));
        fs::create_dir_all(&self.images_dir).map_err(io_err("creating", &self.images_dir))?;
        self.remove_stale_staging();
        let staging = Staging::create(self.staging_path(".build-", &spec.name))?;
        let manifest = assemble(builder, spec, staging.path(), progress)?;
        publish(staging.path(), &target)?;
        staging.disarm();
        progress(Progress::new(
            Phase::Done,
            format!("image {} is ready", spec.name),
            Some(1.0),
        ));
        Ok(manifest)
    }

    fn image_dir(&self, name: &str) -> Result<PathBuf, StoreError> {
        validate_name(name)?;
        let dir = self.images_dir.join(name);
        if !dir.is_dir() {
            return Err(StoreError::NotFound {
                name: name.to_owned(),
                dir: self.images_dir.clone(),
            });
        }
        Ok(dir)
    }

    fn read_manifest(&self, name: &str, dir: &Path) -> Result<Manifest, StoreError> {
        if !dir.join(MANIFEST_FILE).is_file() {
            return Err(StoreError::NotAnImage {
                path: dir.to_path_buf(),
            });
        }
        let manifest = Manifest::read(dir)?;
        if manifest.name != name {
            return Err(StoreError::Damaged {
                name: name.to_owned(),
                reason: format!("its manifest names it {:?}", manifest.name),
            });
        }
        Ok(manifest)
    }

    fn staging_path(&self, prefix: &str, name: &str) -> PathBuf {
        let n = STAGING_COUNTER.fetch_add(1, Ordering::Relaxed);
        self.images_dir
            .join(format!("{prefix}{name}-{}-{n}", std::process::id()))
    }

    /// Deletes staging and trash directories whose process no longer exists.
    fn remove_stale_staging(&self) {
        let Ok(entries) = fs::read_dir(&self.images_dir) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(pid) = name.to_str().and_then(staging_owner) else {
                continue;
            };
            if !pid_alive(pid) {
                let _ = remove_tree(&entry.path());
            }
        }
    }
}

/// The process id in a staging directory name (`.build-<name>-<pid>-<n>`), if it is one.
fn staging_owner(dir_name: &str) -> Option<u32> {
    let rest = STAGING_PREFIXES
        .iter()
        .find_map(|p| dir_name.strip_prefix(p))?;
    let mut parts = rest.rsplitn(3, '-');
    let _counter: u32 = parts.next()?.parse().ok()?;
    let pid = parts.next()?.parse().ok()?;
    parts.next().filter(|name| !name.is_empty())?;
    Some(pid)
}

/// Runs the builder in `staging`, then hashes the image and writes the manifest there.
fn assemble(
    builder: &dyn RootfsBuilder,
    spec: &BuildSpec,
    staging: &Path,
    progress: &mut dyn FnMut(Progress),
) -> Result<Manifest, StoreError> {
    let work = staging.join("work");
    fs::create_dir(&work).map_err(io_err("creating", &work))?;
    let rootfs = staging.join(ROOTFS_FILE);
    let built = builder.build(spec, &work, &rootfs, progress);
    remove_tree(&work).map_err(io_err("removing", &work))?;
    built.map_err(|source| StoreError::Build {
        name: spec.name.clone(),
        source,
    })?;
    progress(Progress::new(
        Phase::Checksum,
        "computing sha256",
        Some(0.95),
    ));
    let size_bytes = fs::metadata(&rootfs)
        .map_err(io_err("reading", &rootfs))?
        .len();
    let sha256 = sha256_file(&rootfs).map_err(io_err("hashing", &rootfs))?;
    let manifest = Manifest {
        name: spec.name.clone(),
        size_bytes,
        sha256,
        created: rfc3339_utc(SystemTime::now()),
        suite: spec.suite.clone(),
        packages: spec.packages.clone(),
        builder_version: BUILDER_VERSION.to_owned(),
        mirror: spec.mirror.clone(),
    };
    manifest.write_atomic(staging)?;
    Ok(manifest)
}

/// Moves the complete `staging` directory to `target`: a plain no-replace rename when the
/// name is free, else an atomic exchange with the old image, which is then deleted.
fn publish(staging: &Path, target: &Path) -> Result<(), StoreError> {
    match rename2(staging, target, libc::RENAME_NOREPLACE) {
        Ok(()) => return Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
        Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS)) => {
            return publish_without_renameat2(staging, target)
        }
        Err(e) => return Err(io_err("publishing", target)(e)),
    }
    rename2(staging, target, libc::RENAME_EXCHANGE).map_err(io_err("replacing", target))?;
    // `staging` now holds the previous image. Failing to delete it does not undo the
    // publication; the next build removes it once this process is gone.
    let _ = remove_tree(staging);
    Ok(())
}

/// Fallback for file systems without `renameat2` flags: move the old image aside first (the
/// name is briefly absent).
fn publish_without_renameat2(staging: &Path, target: &Path) -> Result<(), StoreError> {
    let old = staging.with_extension("old");
    let had_old = match fs::rename(target, &old) {
        Ok(()) => true,
        Err(e) if e.kind() == io::ErrorKind::NotFound => false,
        Err(e) => return Err(io_err("moving away", target)(e)),
    };
    fs::rename(staging, target).map_err(io_err("publishing", target))?;
    if had_old {
        remove_tree(&old).map_err(io_err("removing", &old))?;
    }
    Ok(())
}

fn rename2(from: &Path, to: &Path, flags: libc::c_uint) -> io::Result<()> {
    let c = |p: &Path| CString::new(p.as_os_str().as_bytes()).map_err(io::Error::other);
    let (from, to) = (c(from)?, c(to)?);
    // SAFETY: both paths are NUL-terminated strings that outlive the call; AT_FDCWD makes
    // them relative to the working directory (they are absolute here anyway).
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            flags,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A staging directory that is deleted on drop unless disarmed.
#[derive(Debug)]
struct Staging {
    path: PathBuf,
    armed: bool,
}

impl Staging {
    fn create(path: PathBuf) -> Result<Self, StoreError> {
        fs::create_dir(&path).map_err(io_err("creating", &path))?;
        Ok(Self { path, armed: true })
    }

    fn path(&self) -> &Path {
        &self.path
    }

    /// Keeps the directory (it has been published under another name).
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if self.armed {
            let _ = remove_tree(&self.path);
        }
    }
}

#[cfg(test)]
#[path = "store_tests.rs"]
mod tests;
