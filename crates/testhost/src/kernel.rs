//! The test host's kernel: Debian's current `linux-image-6.1.0-N-amd64`, fetched with apt and cached.
//!
//! `linux-image-amd64` is a metapackage; `apt-cache depends` names the real kernel package. That package is
//! fetched with `apt-get download` (no root, no install) and unpacked with `dpkg -x`. From it the cache keeps,
//! in `<cache root>/<package>_<version>/`:
//!
//! ```text
//! vmlinuz            the bzImage as shipped
//! vmlinux            the same kernel decompressed (ELF with a PVH entry note), when its payload is XZ
//! config             boot/config-*
//! modules/<name>.ko  the modules the test host loads (see `modules`)
//! modules.order      their names in insmod order, one per line
//! wanted             the driver list (`modules::WANTED_DRIVERS`) the entry was built for
//! package.deb        the downloaded package, so a changed module set re-extracts without re-downloading
//! ```
//!
//! QEMU boots `vmlinux` through its PVH entry point when it exists: under TCG that skips the kernel's own XZ
//! decompressor, which was measured at ~3 s of a ~8 s boot.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::cache::{self, CacheError};
use crate::modules::{self, ModuleError};

/// The metapackage whose dependency names the current kernel package.
pub const KERNEL_METAPACKAGE: &str = "linux-image-amd64";

/// Errors from resolving, downloading or unpacking the kernel package.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// A required host tool is missing.
    #[error("{tool} not found in PATH: install the {package} package (apt-get install {package})")]
    ToolMissing {
        /// The program.
        tool: &'static str,
        /// The Debian package that provides it.
        package: &'static str,
    },
    /// A host tool ran but failed.
    #[error("`{command}` failed ({status}): {stderr}{hint}")]
    ToolFailed {
        /// The command line.
        command: String,
        /// Its exit status.
        status: String,
        /// The end of its stderr.
        stderr: String,
        /// What to do about it.
        hint: &'static str,
    },
    /// apt knows no kernel package for the metapackage.
    #[error("`apt-cache show {KERNEL_METAPACKAGE}` names no linux-image package{hint}", hint = APT_UPDATE_HINT)]
    NoKernelPackage,
    /// apt knows the kernel package but not its version.
    #[error("`apt-cache show {0}` gives no Version{hint}", hint = APT_UPDATE_HINT)]
    NoVersion(String),
    /// The unpacked package lacks an expected file.
    #[error("kernel package {package} has no {what}")]
    MissingFile {
        /// The package.
        package: String,
        /// What was looked for.
        what: &'static str,
    },
    /// Choosing the modules failed.
    #[error(transparent)]
    Modules(#[from] ModuleError),
    /// A cache operation failed.
    #[error(transparent)]
    Cache(#[from] CacheError),
}

/// Appended to errors that an `apt-get update` usually fixes.
const APT_UPDATE_HINT: &str = " (run `apt-get update` first, as root)";

/// A Debian kernel binary package at one version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelPackage {
    /// Package name, e.g. `linux-image-6.1.0-57-amd64`.
    pub name: String,
    /// Debian version, e.g. `6.1.192-3`.
    pub version: String,
}

impl KernelPackage {
    /// The cache directory name, `<name>_<version>` (a `:` epoch separator becomes `%3a`, as in .deb names).
    pub fn dir_name(&self) -> String {
        format!("{}_{}", self.name, self.version.replace(':', "%3a"))
    }
}

/// The cached, unpacked kernel of the test host.
#[derive(Debug, Clone)]
pub struct KernelArtifacts {
    /// The package these came from.
    pub package: KernelPackage,
    /// The image QEMU boots: `vmlinux` (PVH) when available, else `vmlinuz`.
    pub boot_image: PathBuf,
    /// `(module name, .ko path)` in insmod order.
    pub modules: Vec<(String, PathBuf)>,
}

/// Runs a host tool and returns its stdout; a missing tool or a failure becomes a clear error.
fn run_tool(
    mut cmd: Command,
    tool: &'static str,
    package: &'static str,
    hint: &'static str,
) -> Result<String, KernelError> {
    let command = format!("{cmd:?}").replace('"', "");
    let out = cmd.stdin(Stdio::null()).output().map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            KernelError::ToolMissing { tool, package }
        } else {
            KernelError::ToolFailed {
                command: command.clone(),
                status: "not started".into(),
                stderr: e.to_string(),
                hint,
            }
        }
    })?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(5).collect();
        return Err(KernelError::ToolFailed {
            command,
            status: out.status.to_string(),
            stderr: tail.into_iter().rev().collect::<Vec<_>>().join(" | "),
            hint,
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Picks the kernel package, and its version if pinned with `(= version)`, from the `Depends:` field of
/// `apt-cache show linux-image-amd64` (or a `Depends:` line of `apt-cache depends`).
pub fn parse_depends(output: &str) -> Option<(String, Option<String>)> {
    output.lines().find_map(|line| {
        let deps = line.trim().strip_prefix("Depends:")?;
        deps.split(',').find_map(|dep| {
            let dep = dep.trim();
            let (name, rest) = dep.split_once(' ').unwrap_or((dep, ""));
            let name = name.trim_start_matches('<').trim_end_matches('>');
            let version = rest
                .trim()
                .strip_prefix("(=")
                .and_then(|v| v.strip_suffix(')'))
                .map(|v| v.trim().to_string());
            name.starts_with("linux-image-")
                .then(|| (name.to_string(), version))
        })
    })
}

/// Picks the first `Version:` field from `apt-cache show` output.
pub fn parse_version(output: &str) -> Option<String> {
    output
        .lines()
        .find_map(|l| l.strip_prefix("Version:").map(|v| v.trim().to_string()))
        .filter(|v| !v.is_empty())
}

/// Asks apt which kernel package `linux-image-amd64` currently depends on, and that package's version.
pub fn resolve_package() -> Result<KernelPackage, KernelError> {
    let out = apt_show(KERNEL_METAPACKAGE)?;
    match parse_depends(&out).ok_or(KernelError::NoKernelPackage)? {
        (name, Some(version)) => Ok(KernelPackage { name, version }),
        (name, None) => resolve_version(name),
    }
}

/// Asks apt for the candidate version of kernel package `name`.
pub fn resolve_version(name: String) -> Result<KernelPackage, KernelError> {
    let out = apt_show(&name)?;
    let version = parse_version(&out).ok_or_else(|| KernelError::NoVersion(name.clone()))?;
    Ok(KernelPackage { name, version })
}

/// Runs `apt-cache show --no-all-versions <package>`.
fn apt_show(package: &str) -> Result<String, KernelError> {
    let mut show = Command::new("apt-cache");
    show.args(["show", "--no-all-versions", package]);
    run_tool(show, "apt-cache", "apt", APT_UPDATE_HINT)
}

/// Files whose modification times change when apt's view of available packages can change.
const APT_STATE: &[&str] = &["/var/lib/apt/lists", "/etc/apt", "/etc/apt/sources.list.d"];

/// A stamp of apt's state (the modification times of `paths`); `None` if one is missing.
fn apt_stamp(paths: &[&str]) -> Option<String> {
    let mut stamp = String::new();
    for path in paths {
        let modified = fs::metadata(path).ok()?.modified().ok()?;
        let since = modified.duration_since(std::time::UNIX_EPOCH).ok()?;
        stamp.push_str(&format!("{}.{:09} ", since.as_secs(), since.subsec_nanos()));
    }
    Some(stamp)
}

/// Like [`resolve_package`] / [`resolve_version`] (for `explicit`), but remembers the answer in
/// `<root>/apt-resolution` until apt's lists change: each `apt-cache` run costs ~1.3 s on hosts without
/// apt's binary package cache (Debian container images disable it).
pub fn resolve_cached(root: &Path, explicit: Option<&str>) -> Result<KernelPackage, KernelError> {
    resolve_cached_with(root, explicit, APT_STATE)
}

/// [`resolve_cached`] with the apt state paths as a parameter.
fn resolve_cached_with(
    root: &Path,
    explicit: Option<&str>,
    apt_state: &[&str],
) -> Result<KernelPackage, KernelError> {
    let query = explicit.unwrap_or(KERNEL_METAPACKAGE);
    let memo = root.join("apt-resolution");
    let stamp = apt_stamp(apt_state).map(|s| format!("{s}{query}"));
    if let (Some(stamp), Ok(text)) = (&stamp, fs::read_to_string(&memo)) {
        let mut lines = text.lines();
        if lines.next() == Some(stamp.as_str()) {
            if let (Some(name), Some(version)) = (lines.next(), lines.next()) {
                return Ok(KernelPackage {
                    name: name.into(),
                    version: version.into(),
                });
            }
        }
    }
    let package = match explicit {
        Some(name) => resolve_version(name.to_string())?,
        None => resolve_package()?,
    };
    if let Some(stamp) = stamp {
        cache::create_dir_all(root)?;
        let tmp = root.join(format!(".tmp-apt-resolution-{}", std::process::id()));
        write(
            &tmp,
            &format!("{stamp}\n{}\n{}\n", package.name, package.version),
        )?;
        cache::publish(&tmp, &memo)?;
    }
    Ok(package)
}

/// Returns the cached kernel for `package`, downloading and unpacking it first if needed.
///
/// The caller holds the [`cache::CacheLock`]. An existing complete entry is used as is: no apt call, no
/// download, no extraction.
pub fn ensure(root: &Path, package: &KernelPackage) -> Result<KernelArtifacts, KernelError> {
    let dir = root.join(package.dir_name());
    if let Some(artifacts) = load(&dir, package)? {
        return Ok(artifacts);
    }
    let work = cache::fresh_work_dir(root, "kernel")?;
    let deb = fetch_deb(root, &dir, package, &work)?;
    build_entry(&work, &deb, package)?;
    cache::publish(&work, &dir)?;
    load(&dir, package)?.ok_or(KernelError::MissingFile {
        package: package.name.clone(),
        what: "modules.order after unpacking",
    })
}

/// Reads a complete cache entry, or returns `None` when `dir` does not hold one.
fn load(dir: &Path, package: &KernelPackage) -> Result<Option<KernelArtifacts>, KernelError> {
    let Ok(order) = fs::read_to_string(dir.join("modules.order")) else {
        return Ok(None);
    };
    if fs::read_to_string(dir.join("wanted")).ok() != Some(wanted_signature()) {
        return Ok(None);
    }
    let vmlinux = dir.join("vmlinux");
    let boot_image = if vmlinux.is_file() {
        vmlinux
    } else {
        dir.join("vmlinuz")
    };
    let modules = order
        .lines()
        .filter(|l| !l.is_empty())
        .map(|name| {
            (
                name.to_string(),
                dir.join("modules").join(format!("{name}.ko")),
            )
        })
        .collect::<Vec<_>>();
    let complete = boot_image.is_file() && modules.iter().all(|(_, p)| p.is_file());
    Ok(complete.then(|| KernelArtifacts {
        package: package.clone(),
        boot_image,
        modules,
    }))
}

/// Returns a path to the package's .deb: the one kept in an old entry, or a fresh `apt-get download`.
fn fetch_deb(
    root: &Path,
    old_entry: &Path,
    package: &KernelPackage,
    work: &Path,
) -> Result<PathBuf, KernelError> {
    let target = work.join("package.deb");
    let kept = old_entry.join("package.deb");
    if fs::rename(&kept, &target).is_ok() {
        return Ok(target);
    }
    let download = cache::fresh_work_dir(root, "download")?;
    let mut cmd = Command::new("apt-get");
    cmd.current_dir(&download)
        .arg("download")
        .arg(format!("{}={}", package.name, package.version));
    run_tool(
        cmd,
        "apt-get",
        "apt",
        " (apt-get download needs network access to a Debian mirror; try `apt-get update`)",
    )?;
    let deb = first_with_extension(&download, "deb")?.ok_or(KernelError::MissingFile {
        package: package.name.clone(),
        what: ".deb file after apt-get download",
    })?;
    fs::rename(&deb, &target).map_err(|e| CacheError::io("move", &deb, e))?;
    cache::remove_tree(&download)?;
    Ok(target)
}

/// Returns the first file in `dir` whose name ends with `.ext`.
fn first_with_extension(dir: &Path, ext: &str) -> Result<Option<PathBuf>, KernelError> {
    let entries = fs::read_dir(dir).map_err(|e| CacheError::io("list", dir, e))?;
    Ok(entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == ext)))
}

/// Unpacks `deb` into `work/root` with `dpkg -x`, copies out what the cache keeps, then deletes the tree.
fn build_entry(work: &Path, deb: &Path, package: &KernelPackage) -> Result<(), KernelError> {
    let tree = work.join("root");
    let mut cmd = Command::new("dpkg");
    cmd.arg("-x").arg(deb).arg(&tree);
    run_tool(cmd, "dpkg", "dpkg", "")?;
    let missing = |what| KernelError::MissingFile {
        package: package.name.clone(),
        what,
    };
    let boot = tree.join("boot");
    let vmlinuz = first_with_prefix(&boot, "vmlinuz-")?.ok_or_else(|| missing("boot/vmlinuz-*"))?;
    let config = first_with_prefix(&boot, "config-")?.ok_or_else(|| missing("boot/config-*"))?;
    let release_dir = first_with_prefix(&tree.join("lib/modules"), "")?
        .or(first_with_prefix(&tree.join("usr/lib/modules"), "")?)
        .ok_or_else(|| missing("lib/modules/<release>"))?;
    decompress_modules(&release_dir)?;
    let modules = modules::resolve(&release_dir.join("kernel"), &config)?;
    copy(&vmlinuz, &work.join("vmlinuz"))?;
    copy(&config, &work.join("config"))?;
    copy_modules(work, &modules)?;
    extract_vmlinux(&work.join("vmlinuz"), &work.join("vmlinux"));
    cache::remove_tree(&tree)?;
    Ok(())
}

/// Decompresses every `*.ko.xz` under `dir` in place (Debian ships modules xz-compressed since
/// its 6.x backports and trixie kernels; `insmod` in the test host's busybox wants plain `.ko`).
fn decompress_modules(dir: &Path) -> Result<(), KernelError> {
    let mut cmd = Command::new("find");
    cmd.arg(dir)
        .args(["-name", "*.ko.xz", "-exec", "xz", "-d", "{}", "+"]);
    run_tool(cmd, "xz", "xz-utils", "").map(drop)
}

/// Copies the chosen modules to `work/modules/` and writes `work/modules.order`.
fn copy_modules(work: &Path, modules: &[(String, PathBuf)]) -> Result<(), KernelError> {
    let dir = work.join("modules");
    cache::create_dir_all(&dir)?;
    let mut order = String::new();
    for (name, path) in modules {
        copy(path, &dir.join(format!("{name}.ko")))?;
        order.push_str(name);
        order.push('\n');
    }
    write(&work.join("modules.order"), &order)?;
    write(&work.join("wanted"), &wanted_signature())
}

/// The driver list an entry is built for; an entry for another list is rebuilt (from its kept .deb).
fn wanted_signature() -> String {
    modules::WANTED_DRIVERS
        .iter()
        .map(|w| format!("{}\n", w.module))
        .collect()
}

/// Writes one file, mapping the error.
fn write(path: &Path, text: &str) -> Result<(), KernelError> {
    fs::write(path, text).map_err(|e| CacheError::io("write", path, e))?;
    Ok(())
}

/// Copies one file, mapping the error.
fn copy(from: &Path, to: &Path) -> Result<(), KernelError> {
    fs::copy(from, to).map_err(|e| CacheError::io("copy", from, e))?;
    Ok(())
}

/// Returns the first entry of `dir` (sorted by name) whose name starts with `prefix`, if `dir` exists.
fn first_with_prefix(dir: &Path, prefix: &str) -> Result<Option<PathBuf>, KernelError> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Ok(None);
    };
    let mut names: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(prefix))
        })
        .collect();
    names.sort();
    Ok(names.into_iter().next())
}

/// The XZ stream magic (xz file format spec, section 2.1.1.1).
const XZ_MAGIC: &[u8] = b"\xfd7zXZ\x00";

/// Decompresses the kernel payload of a bzImage into an ELF `vmlinux`, best effort.
///
/// Finds the first XZ stream in the image (Debian builds with `CONFIG_KERNEL_XZ`) and runs `xz -dc
/// --single-stream` on it. On any failure nothing is written and QEMU boots the bzImage instead.
fn extract_vmlinux(vmlinuz: &Path, out: &Path) {
    let Ok(image) = fs::read(vmlinuz) else {
        return;
    };
    let Some(start) = image.windows(XZ_MAGIC.len()).position(|w| w == XZ_MAGIC) else {
        return;
    };
    let Ok(mut child) = Command::new("xz")
        .args(["-dc", "--single-stream"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
    else {
        return;
    };
    let Some(mut stdin) = child.stdin.take() else {
        return;
    };
    let payload = image[start..].to_vec();
    let feeder = std::thread::spawn(move || {
        use std::io::Write;
        // xz stops reading after the stream ends; a broken pipe on the trailing bytes is expected.
        let _ = stdin.write_all(&payload);
    });
    let output = child.wait_with_output();
    let _ = feeder.join();
    if let Ok(output) = output {
        if output.status.success() && output.stdout.starts_with(b"\x7fELF") {
            let _ = fs::write(out, &output.stdout);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xz_compressed_modules_are_decompressed_in_place() {
        // Arrange: a module tree as Debian's 6.12 packages ship it.
        let dir = tempfile::tempdir().unwrap();
        let kvm = dir.path().join("arch/x86/kvm");
        fs::create_dir_all(&kvm).unwrap();
        fs::write(kvm.join("kvm.ko"), b"module bytes").unwrap();
        let xz = Command::new("xz").arg(kvm.join("kvm.ko")).status().unwrap();
        assert!(xz.success() && kvm.join("kvm.ko.xz").exists());

        // Act
        decompress_modules(dir.path()).unwrap();

        // Assert
        assert_eq!(fs::read(kvm.join("kvm.ko")).unwrap(), b"module bytes");
        assert!(!kvm.join("kvm.ko.xz").exists());
    }

    #[test]
    fn metapackage_depends_names_the_kernel_package_and_version() {
        // Arrange
        let out = "Package: linux-image-amd64\nVersion: 6.1.192-3\n\
                   Depends: linux-image-6.1.0-57-amd64 (= 6.1.192-3)\n";

        // Act
        let dep = parse_depends(out);

        // Assert
        assert_eq!(
            dep,
            Some((
                "linux-image-6.1.0-57-amd64".into(),
                Some("6.1.192-3".into())
            ))
        );
    }

    #[test]
    fn apt_cache_depends_line_gives_the_name_without_version() {
        // Arrange
        let out = "linux-image-amd64\n  Depends: linux-image-6.1.0-57-amd64\n";

        // Act
        let dep = parse_depends(out);

        // Assert
        assert_eq!(dep, Some(("linux-image-6.1.0-57-amd64".into(), None)));
    }

    #[test]
    fn depends_output_without_kernel_gives_none() {
        // Arrange
        let out = "linux-image-amd64\n  Depends: <something-else>\n";

        // Act
        let name = parse_depends(out);

        // Assert
        assert_eq!(name, None);
    }

    #[test]
    fn remembered_resolution_is_used_while_apt_lists_are_unchanged() {
        // Arrange: a memo with the current stamp and a made-up package, which apt could never answer.
        let root = tempfile::tempdir().unwrap();
        let lists = root.path().join("lists");
        fs::create_dir(&lists).unwrap();
        let state = [lists.to_str().unwrap()];
        let stamp = apt_stamp(&state).unwrap();
        let memo = format!("{stamp}linux-image-amd64\nlinux-image-test\n9.9-9\n");
        fs::write(root.path().join("apt-resolution"), memo).unwrap();

        // Act
        let package = resolve_cached_with(root.path(), None, &state).unwrap();

        // Assert
        assert_eq!(package.name, "linux-image-test");
        assert_eq!(package.version, "9.9-9");
    }

    #[test]
    fn show_output_gives_the_version() {
        // Arrange
        let out = "Package: linux-image-6.1.0-57-amd64\nSource: linux-signed-amd64 (6.1.192+3)\nVersion: 6.1.192-3\n";

        // Act
        let version = parse_version(out);

        // Assert
        assert_eq!(version.as_deref(), Some("6.1.192-3"));
    }

    #[test]
    fn epoch_colon_is_escaped_in_the_cache_dir_name() {
        // Arrange
        let pkg = KernelPackage {
            name: "linux-image-x".into(),
            version: "1:6.1-3".into(),
        };

        // Act
        let dir = pkg.dir_name();

        // Assert
        assert_eq!(dir, "linux-image-x_1%3a6.1-3");
    }

    #[test]
    fn incomplete_cache_entry_is_not_loaded() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("modules.order"), "kvm\n").unwrap();
        fs::write(dir.path().join("wanted"), wanted_signature()).unwrap();
        fs::write(dir.path().join("vmlinuz"), b"x").unwrap();
        let pkg = KernelPackage {
            name: "k".into(),
            version: "1".into(),
        };

        // Act
        let loaded = load(dir.path(), &pkg).unwrap();

        // Assert
        assert!(loaded.is_none(), "modules/kvm.ko is missing");
    }
}
