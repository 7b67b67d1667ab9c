//! Preparing everything a boot needs: the cached kernel and the cached initramfs.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::cache::{self, CacheError, CacheLock};
use crate::initramfs::{self, InitramfsError, InitramfsSpec, Source, SpecFile};
use crate::kernel::{self, KernelError, KernelPackage};
use crate::libs::{self, LibsError};
use crate::protocol::{self, MODULES_DIR};

/// Errors from preparing the artifacts.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    /// busybox is not installed where the test host expects it.
    #[error("{0} not found: install the busybox-static package (apt-get install busybox-static)")]
    NoBusybox(PathBuf),
    /// The cache could not be located or locked.
    #[error(transparent)]
    Cache(#[from] CacheError),
    /// The kernel could not be resolved, downloaded or unpacked.
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// Libraries could not be found.
    #[error(transparent)]
    Libs(#[from] LibsError),
    /// The initramfs could not be built.
    #[error(transparent)]
    Initramfs(#[from] InitramfsError),
}

/// The busybox binary copied into the test host (Debian's busybox-static installs it here).
pub const BUSYBOX: &str = "/bin/busybox";

/// Inputs of [`prepare`].
#[derive(Debug, Clone, Default)]
pub struct PrepareOptions {
    /// Cache root; `None` means [`cache::default_cache_root`].
    pub cache_dir: Option<PathBuf>,
    /// Kernel package name (e.g. `linux-image-6.1.0-57-amd64`); `None` asks apt what `linux-image-amd64`
    /// depends on.
    pub kernel_package: Option<String>,
    /// Binaries whose shared libraries (per `ldd`) must be in the test host.
    pub extra_libs_for: Vec<PathBuf>,
}

/// Paths of the prepared, cached artifacts.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// The cache root used.
    pub cache_root: PathBuf,
    /// The kernel package used.
    pub package: KernelPackage,
    /// The image QEMU boots (`vmlinux` via PVH when available, else `vmlinuz`).
    pub kernel: PathBuf,
    /// The gzip cpio initramfs.
    pub initramfs: PathBuf,
}

/// Resolves, downloads and builds whatever is not cached yet, and returns the artifact paths.
///
/// Concurrent callers (threads or processes) serialize on the cache lock; with unchanged inputs this only
/// checks that apt's lists are unchanged and hashes the initramfs inputs (no apt run, no download, no
/// build).
pub fn prepare(opts: &PrepareOptions) -> Result<Prepared, PrepareError> {
    let root = match &opts.cache_dir {
        Some(d) => d.clone(),
        None => cache::default_cache_root()?,
    };
    let busybox = PathBuf::from(BUSYBOX);
    if !busybox.is_file() {
        return Err(PrepareError::NoBusybox(busybox));
    }
    let package = kernel::resolve_cached(&root, opts.kernel_package.as_deref())?;
    let mut binaries = opts.extra_libs_for.clone();
    binaries.push(busybox.clone());
    let mke2fs = host_mke2fs();
    binaries.extend(mke2fs.iter().map(|(bin, _)| bin.clone()));
    let libs = libs::collect(&binaries)?;
    let _lock = CacheLock::acquire(&root)?;
    let kernel = kernel::ensure(&root, &package)?;
    let mut spec = initramfs_spec(&busybox, &kernel.modules, libs.keys().map(PathBuf::as_path));
    if let Some((bin, conf)) = &mke2fs {
        spec.files.push(host_file("/sbin/mkfs.ext4", bin, 0o755));
        spec.files.push(host_file("/etc/mke2fs.conf", conf, 0o644));
    }
    let initramfs = initramfs::ensure(&root, &spec.load()?)?;
    Ok(Prepared {
        cache_root: root,
        package,
        kernel: kernel.boot_image,
        initramfs,
    })
}

/// This host's `mke2fs` and its `/etc/mke2fs.conf` (which defines ext4 for it), when
/// e2fsprogs is installed: the test host gets them as `/sbin/mkfs.ext4`, with which bulkhead
/// formats scratch disks (`--disk`, `disk_mib`). Without them a scratch disk fails there with an
/// error that says to install e2fsprogs.
fn host_mke2fs() -> Option<(PathBuf, PathBuf)> {
    let conf = PathBuf::from("/etc/mke2fs.conf");
    let bin = ["/usr/sbin/mke2fs", "/sbin/mke2fs"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())?;
    conf.is_file().then_some((bin, conf))
}

/// Minimal account files, so that `getpwuid(0)` and friends work in the test host.
const PASSWD: &str = "root:x:0:0:root:/root:/bin/sh\n";
const GROUP: &str = "root:x:0:\n";

/// The initramfs inputs: `/init`, busybox, the modules and the libraries (each at its host path).
fn initramfs_spec<'a>(
    busybox: &Path,
    modules: &[(String, PathBuf)],
    libs: impl Iterator<Item = &'a Path>,
) -> InitramfsSpec {
    let libs: Vec<&Path> = libs.collect();
    let lib_dirs: BTreeSet<PathBuf> = libs
        .iter()
        .filter_map(|l| l.parent().map(Path::to_path_buf))
        .collect();
    let names: Vec<String> = modules.iter().map(|(n, _)| n.clone()).collect();
    let init = protocol::init_script(&names, &lib_dirs.into_iter().collect::<Vec<_>>());
    let mut files = vec![
        inline("/init", init.into_bytes(), 0o755),
        inline("/etc/passwd", PASSWD.into(), 0o644),
        inline("/etc/group", GROUP.into(), 0o644),
        host_file("/bin/busybox", busybox, 0o755),
    ];
    for (name, path) in modules {
        let guest = format!("{MODULES_DIR}/{name}.ko");
        files.push(host_file(&guest, path, 0o644));
    }
    for lib in libs {
        files.push(SpecFile {
            guest: lib.to_path_buf(),
            source: Source::Host(lib.to_path_buf()),
            mode: 0o755,
        });
    }
    InitramfsSpec { files }
}

fn inline(guest: &str, data: Vec<u8>, mode: u32) -> SpecFile {
    SpecFile {
        guest: guest.into(),
        source: Source::Inline(data),
        mode,
    }
}

fn host_file(guest: &str, host: &Path, mode: u32) -> SpecFile {
    SpecFile {
        guest: guest.into(),
        source: Source::Host(host.to_path_buf()),
        mode,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_places_modules_libs_and_init() {
        // Arrange
        let modules = vec![("kvm".to_string(), PathBuf::from("/c/modules/kvm.ko"))];
        let libs = [PathBuf::from("/lib/x86_64-linux-gnu/libc.so.6")];

        // Act
        let spec = initramfs_spec(
            Path::new("/bin/busybox"),
            &modules,
            libs.iter().map(PathBuf::as_path),
        );

        // Assert
        let guests: Vec<&Path> = spec.files.iter().map(|f| f.guest.as_path()).collect();
        assert!(guests.contains(&Path::new("/init")));
        assert!(guests.contains(&Path::new("/lib/bulkhead-modules/kvm.ko")));
        assert!(guests.contains(&Path::new("/lib/x86_64-linux-gnu/libc.so.6")));
        let init = match &spec.files[0].source {
            Source::Inline(d) => String::from_utf8(d.clone()).unwrap(),
            Source::Host(_) => unreachable!(),
        };
        assert!(init.contains("LD_LIBRARY_PATH='/lib/x86_64-linux-gnu'"));
    }
}
