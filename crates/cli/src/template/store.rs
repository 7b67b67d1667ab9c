//! The template store: `<data dir>/templates/<name>/`, each a sandbox snapshot (the VMM's
//! `state` and `memory`, the sandbox's `sandbox.json`; see `bulkhead_sandbox::snapshot`) with
//! [`TEMPLATE_FILE`] next to them.
//!
//! A template being created is written into a hidden sibling directory,
//! `.partial-<pid>-<name>-<random>`, and renamed to its name only once complete, so a failed
//! or interrupted create leaves no template behind; the partial directories of creates whose
//! process is gone are removed by the next create.

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use bulkhead_vmm::config::DiskConfig;
use serde::{Deserialize, Serialize};

/// The template's own manifest, next to the snapshot's `sandbox.json`.
pub const TEMPLATE_FILE: &str = "template.json";

/// Name prefix of a template directory still being written.
const PARTIAL_PREFIX: &str = ".partial-";

/// What a template is: how it was made, read by `template ls` and `run --template`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateManifest {
    /// The template's name (its directory's name).
    pub name: String,
    /// The guest kernel the template's sandbox booted.
    pub kernel: PathBuf,
    /// The initramfs it booted.
    pub initrd: PathBuf,
    /// The root filesystem image it booted (`--image`), which every clone opens again; absent
    /// without one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<PathBuf>,
    /// The scratch disk's size, MiB (`--disk`), saved with the template; absent without one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_mib: Option<u64>,
    /// The data disks it booted with (`--disk-file`), in order: a read-only one every clone
    /// opens again, a writable one saved with the template (a copy: clones never write to it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disk_files: Vec<DiskConfig>,
    /// Guest RAM, MiB (every clone has the same).
    pub memory_mib: u32,
    /// vCPUs (every clone has the same).
    pub vcpus: u8,
    /// When it was created, RFC 3339 in UTC (`2026-01-31T12:00:00Z`).
    pub created: String,
    /// The bulkhead version that created it.
    pub bulkhead_version: String,
    /// The preparation command that ran before the snapshot (empty: none).
    pub prepare: Vec<String>,
}

impl TemplateManifest {
    /// Reads the manifest of the template in `dir`.
    ///
    /// # Errors
    /// A one-line message naming the file when it is missing or not a template manifest.
    pub fn read(dir: &Path) -> Result<TemplateManifest, String> {
        let path = dir.join(TEMPLATE_FILE);
        let bytes = fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        serde_json::from_slice(&bytes).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Writes the manifest into `dir`.
    ///
    /// # Errors
    /// A one-line message naming the file.
    pub fn write(&self, dir: &Path) -> Result<(), String> {
        let path = dir.join(TEMPLATE_FILE);
        let json = serde_json::to_vec_pretty(self).map_err(|e| e.to_string())?;
        fs::write(&path, json).map_err(|e| format!("cannot write {}: {e}", path.display()))
    }
}

/// A template found in the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    /// Its directory, the snapshot directory a restore reads (absolute, symbolic links
    /// resolved: the path the VMM maps the memory file from).
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: TemplateManifest,
}

/// A template as `template ls` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Listed {
    /// Its manifest.
    #[serde(flatten)]
    pub manifest: TemplateManifest,
    /// Bytes its files take on disk (allocated blocks: the memory file is sparse).
    pub size_on_disk: u64,
}

/// The templates under one directory.
#[derive(Debug, Clone)]
pub struct TemplateStore {
    root: PathBuf,
}

impl TemplateStore {
    /// The store in `root` (nothing is created until a template is).
    pub fn new(root: PathBuf) -> TemplateStore {
        TemplateStore { root }
    }

    /// The store in bulkhead's data directory: `<data dir>/templates/`.
    pub fn local() -> TemplateStore {
        TemplateStore::new(bulkhead_sandbox::paths::data_dir().join("templates"))
    }

    /// Whether the existing file `path` lies in this store (a template's own file), symbolic
    /// links resolved.
    pub fn holds(&self, path: &Path) -> bool {
        let (Ok(root), Ok(file)) = (fs::canonicalize(&self.root), fs::canonicalize(path)) else {
            return false;
        };
        file.starts_with(root)
    }

    /// The directory of template `name`.
    pub fn path(&self, name: &str) -> PathBuf {
        self.root.join(name)
    }

    /// Template `name`.
    ///
    /// # Errors
    /// No template of that name, or one whose manifest is unreadable.
    pub fn open(&self, name: &str) -> Result<Template, String> {
        let dir = self.path(name);
        if !dir.is_dir() {
            return Err(no_such(name));
        }
        let manifest = TemplateManifest::read(&dir).map_err(|e| {
            format!(
                "template {name} is damaged ({e}); remove it with `bulkhead template rm {name}`"
            )
        })?;
        let dir = fs::canonicalize(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        Ok(Template { dir, manifest })
    }

    /// Every template, by name, and a message for each directory that is no template.
    ///
    /// # Errors
    /// The store exists but cannot be read.
    pub fn list(&self) -> Result<(Vec<Listed>, Vec<String>), String> {
        let entries = match fs::read_dir(&self.root) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok((Vec::new(), Vec::new())),
            Err(e) => return Err(format!("{}: {e}", self.root.display())),
        };
        let mut names: Vec<String> = entries
            .filter_map(Result::ok)
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .filter_map(|e| e.file_name().to_str().map(str::to_owned))
            .filter(|name| !name.starts_with('.'))
            .collect();
        names.sort();
        let (mut listed, mut broken) = (Vec::new(), Vec::new());
        for name in names {
            let dir = self.path(&name);
            match TemplateManifest::read(&dir) {
                Ok(manifest) => listed.push(Listed {
                    manifest,
                    size_on_disk: size_on_disk(&dir),
                }),
                Err(e) => broken.push(format!("{name} is not a template ({e})")),
            }
        }
        Ok((listed, broken))
    }

    /// Deletes template `name` (sandboxes restored from it keep running: their VMMs hold its
    /// memory file).
    ///
    /// # Errors
    /// No template of that name, or it cannot be deleted.
    pub fn remove(&self, name: &str) -> Result<(), String> {
        let dir = self.path(name);
        match fs::symlink_metadata(&dir) {
            Ok(meta) if meta.is_dir() => {}
            Ok(_) => return Err(no_such(name)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(no_such(name)),
            Err(e) => return Err(format!("{}: {e}", dir.display())),
        }
        fs::remove_dir_all(&dir).map_err(|e| format!("cannot delete {}: {e}", dir.display()))
    }

    /// Refuses a name that a template (or anything else) in the store has.
    ///
    /// # Errors
    /// That the name exists, and how to free it.
    pub fn check_free(&self, name: &str) -> Result<(), String> {
        match fs::symlink_metadata(self.path(name)) {
            Ok(_) => Err(exists(name)),
            Err(_) => Ok(()),
        }
    }

    /// Starts creating template `name`: refuses a name that exists, removes the partial
    /// directories of creates whose process is gone, and makes this create's own.
    ///
    /// # Errors
    /// The name exists, or the directory cannot be made.
    pub fn begin(&self, name: &str) -> Result<Partial, String> {
        self.check_free(name)?;
        let target = self.path(name);
        fs::create_dir_all(&self.root)
            .map_err(|e| format!("cannot create {}: {e}", self.root.display()))?;
        self.sweep();
        let dir = tempfile::Builder::new()
            .prefix(&format!("{PARTIAL_PREFIX}{}-{name}-", std::process::id()))
            .tempdir_in(&self.root)
            .map_err(|e| format!("cannot create a directory in {}: {e}", self.root.display()))?;
        Ok(Partial { dir, target })
    }

    /// Removes the partial directories of creates whose process no longer exists (best effort).
    fn sweep(&self) {
        let Ok(entries) = fs::read_dir(&self.root) else {
            return;
        };
        for entry in entries.filter_map(Result::ok) {
            let name = entry.file_name();
            let Some(pid) = name.to_str().and_then(partial_pid) else {
                continue;
            };
            if !Path::new(&format!("/proc/{pid}")).exists() {
                let _ = fs::remove_dir_all(entry.path());
            }
        }
    }
}

/// The pid in a partial directory's name, `.partial-<pid>-...`.
fn partial_pid(name: &str) -> Option<u32> {
    name.strip_prefix(PARTIAL_PREFIX)?
        .split('-')
        .next()?
        .parse()
        .ok()
}

/// The message for a name that names no template.
fn no_such(name: &str) -> String {
    format!("no template named {name} (`bulkhead template ls` lists them)")
}

/// The message for a name that is taken.
fn exists(name: &str) -> String {
    format!("template {name} already exists; remove it first with `bulkhead template rm {name}`")
}

/// A template being written; deleted when dropped unless [`Partial::commit`]ted.
#[derive(Debug)]
pub struct Partial {
    dir: tempfile::TempDir,
    target: PathBuf,
}

impl Partial {
    /// The directory to write the template into.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Gives the complete template its name; returns its directory.
    ///
    /// # Errors
    /// The name was taken in the meantime, or the rename failed (the partial directory is
    /// deleted then).
    pub fn commit(self) -> Result<PathBuf, String> {
        let name = self
            .target
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        match rename_no_replace(self.dir.path(), &self.target) {
            Ok(()) => {
                // Already moved: nothing is left for the temporary directory to delete.
                let _ = self.dir.keep();
                Ok(self.target)
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Err(exists(&name)),
            Err(e) => Err(format!(
                "cannot rename {} to {}: {e}",
                self.dir.path().display(),
                self.target.display()
            )),
        }
    }
}

/// Renames `from` to `to` unless `to` exists (`renameat2(RENAME_NOREPLACE)`; a file system
/// without it gets a check, then `rename`).
fn rename_no_replace(from: &Path, to: &Path) -> io::Result<()> {
    let c_path = |p: &Path| {
        CString::new(p.as_os_str().as_bytes())
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
    };
    let (from_c, to_c) = (c_path(from)?, c_path(to)?);
    // SAFETY: both pointers are NUL-terminated strings that outlive the call, which only reads
    // them.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            from_c.as_ptr(),
            libc::AT_FDCWD,
            to_c.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() != Some(libc::EINVAL) {
        return Err(err);
    }
    if fs::symlink_metadata(to).is_ok() {
        return Err(io::Error::from(io::ErrorKind::AlreadyExists));
    }
    fs::rename(from, to)
}

/// Bytes the files under `dir` take on disk: their allocated blocks, not their lengths (the
/// snapshot's memory file is sparse). Unreadable entries count nothing.
pub fn size_on_disk(dir: &Path) -> u64 {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .map(|entry| match entry.metadata() {
            Ok(meta) if meta.is_dir() => size_on_disk(&entry.path()),
            // st_blocks counts 512-byte units whatever the file system's block size.
            Ok(meta) => meta.blocks().saturating_mul(512),
            Err(_) => 0,
        })
        .sum()
}

/// `bytes` for people: `0 B`, `812 KiB`, `9.5 MiB`, `310 MiB`, `2.1 GiB`.
pub fn format_size(bytes: u64) -> String {
    const KIB: f64 = 1024.0;
    let b = bytes as f64;
    let (value, unit) = match bytes {
        0 => return "0 B".to_owned(),
        1..=0xF_FFFF => (b / KIB, "KiB"),
        0x10_0000..=0x3FFF_FFFF => (b / (KIB * KIB), "MiB"),
        _ => (b / (KIB * KIB * KIB), "GiB"),
    };
    match unit {
        // Rounded up: a file of a few bytes takes a block, not nothing.
        "KiB" => format!("{:.0} {unit}", value.ceil()),
        _ if value < 10.0 => format!("{value:.1} {unit}"),
        _ => format!("{value:.0} {unit}"),
    }
}
