//! The host's glibc runtime, copied into the test host so that dynamically linked binaries run there.
//!
//! A base set (the loader, libc, libm, libgcc_s and glibc's compatibility stubs that Rust binaries may
//! name) is always included; `ldd` on each binary the caller names adds whatever else it needs. Each library
//! keeps its host path inside the test host, so the loader path baked into binaries
//! (`/lib64/ld-linux-x86-64.so.2`, the x86-64 psABI's PT_INTERP) and the loader's default search
//! directories work unchanged.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Errors from finding libraries.
#[derive(Debug, thiserror::Error)]
pub enum LibsError {
    /// A base library is not in any standard directory.
    #[error("{name} not found in {dirs}: install {package}")]
    BaseMissing {
        /// Library file name.
        name: &'static str,
        /// Directories searched.
        dirs: String,
        /// Debian package that provides it.
        package: &'static str,
    },
    /// A binary named in `extra_libs_for` does not exist.
    #[error("binary {0} (named for library collection) does not exist")]
    NoSuchBinary(PathBuf),
    /// `ldd` could not be run.
    #[error("running ldd on {path}: {source} (ldd comes with libc-bin)")]
    Ldd {
        /// The binary.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// `ldd` reports a library it cannot find.
    #[error("{binary} needs {library}, which ldd cannot find on this host")]
    Unresolved {
        /// The binary.
        binary: PathBuf,
        /// The missing library's soname.
        library: String,
    },
}

/// The path of the x86-64 dynamic loader (x86-64 psABI, PT_INTERP of every dynamically linked binary).
pub const LOADER: &str = "/lib64/ld-linux-x86-64.so.2";

/// Base libraries: `(soname, Debian package, required)`. The loader is handled apart at [`LOADER`]. The
/// optional ones are glibc's compatibility stubs, which layouts other than glibc >= 2.34 may lack.
const BASE_LIBS: &[(&str, &str, bool)] = &[
    ("libc.so.6", "libc6", true),
    ("libm.so.6", "libc6", true),
    ("libgcc_s.so.1", "libgcc-s1", true),
    ("libpthread.so.0", "libc6", false),
    ("libdl.so.2", "libc6", false),
    ("librt.so.1", "libc6", false),
];

/// Directories searched for base libraries, in order.
const LIB_DIRS: &[&str] = &[
    "/lib/x86_64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu",
    "/lib64",
    "/usr/lib64",
    "/lib",
    "/usr/lib",
];

/// One line of `ldd` output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LddEntry {
    /// A library found at a path (`libc.so.6 => /lib/.../libc.so.6 (0x...)`, or the loader's own line).
    Found(PathBuf),
    /// A library ldd could not find (`libfoo.so.1 => not found`).
    NotFound(String),
}

/// Parses `ldd` output. The vDSO and other path-less lines are skipped; "not a dynamic executable" yields
/// nothing.
pub fn parse_ldd(output: &str) -> Vec<LddEntry> {
    output
        .lines()
        .filter_map(|line| {
            let line = line.trim();
            if let Some((name, target)) = line.split_once("=>") {
                let target = target.trim();
                if target.starts_with("not found") {
                    return Some(LddEntry::NotFound(name.trim().to_string()));
                }
                let path = target.split(" (").next()?.trim();
                return path
                    .starts_with('/')
                    .then(|| LddEntry::Found(PathBuf::from(path)));
            }
            let path = line.split(" (").next()?.trim();
            path.starts_with('/')
                .then(|| LddEntry::Found(PathBuf::from(path)))
        })
        .collect()
}

/// Finds the base libraries; returns their host paths (the loader first).
pub fn base_libraries() -> Result<Vec<PathBuf>, LibsError> {
    let mut libs = Vec::new();
    if !Path::new(LOADER).exists() {
        return Err(LibsError::BaseMissing {
            name: "ld-linux-x86-64.so.2",
            dirs: "/lib64".into(),
            package: "libc6",
        });
    }
    libs.push(PathBuf::from(LOADER));
    for (name, package, required) in BASE_LIBS {
        let found = LIB_DIRS
            .iter()
            .map(|d| Path::new(d).join(name))
            .find(|p| p.exists());
        match found {
            Some(p) => libs.push(p),
            None if !required => {}
            None => {
                return Err(LibsError::BaseMissing {
                    name,
                    dirs: LIB_DIRS.join(", "),
                    package,
                })
            }
        }
    }
    Ok(libs)
}

/// Runs `ldd` on `binary` and returns the library paths it needs (none for a static binary).
pub fn ldd(binary: &Path) -> Result<Vec<PathBuf>, LibsError> {
    if !binary.exists() {
        return Err(LibsError::NoSuchBinary(binary.to_path_buf()));
    }
    let out = Command::new("ldd")
        .arg(binary)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .map_err(|source| LibsError::Ldd {
            path: binary.to_path_buf(),
            source,
        })?;
    // ldd exits 1 for static binaries ("not a dynamic executable"); parsing yields nothing then.
    let text = String::from_utf8_lossy(&out.stdout);
    parse_ldd(&text)
        .into_iter()
        .map(|e| match e {
            LddEntry::Found(p) => Ok(p),
            LddEntry::NotFound(library) => Err(LibsError::Unresolved {
                binary: binary.to_path_buf(),
                library,
            }),
        })
        .collect()
}

/// Collects base libraries plus those `binaries` need: returns a map from path in the test host (the path
/// as ldd prints it) to the host file to read, deduplicated and sorted.
pub fn collect(binaries: &[PathBuf]) -> Result<BTreeMap<PathBuf, PathBuf>, LibsError> {
    let mut all = base_libraries()?;
    for b in binaries {
        all.extend(ldd(b)?);
    }
    Ok(all.into_iter().map(|p| (p.clone(), p)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ldd_output_yields_paths_and_skips_vdso() {
        // Arrange
        let out = "\tlinux-vdso.so.1 (0x00007ffd)\n\
                   \tlibgcc_s.so.1 => /lib/x86_64-linux-gnu/libgcc_s.so.1 (0x00007f2c)\n\
                   \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f2c)\n\
                   \t/lib64/ld-linux-x86-64.so.2 (0x00007f2c)\n";

        // Act
        let entries = parse_ldd(out);

        // Assert
        assert_eq!(
            entries,
            vec![
                LddEntry::Found("/lib/x86_64-linux-gnu/libgcc_s.so.1".into()),
                LddEntry::Found("/lib/x86_64-linux-gnu/libc.so.6".into()),
                LddEntry::Found("/lib64/ld-linux-x86-64.so.2".into()),
            ]
        );
    }

    #[test]
    fn static_binary_needs_nothing() {
        // Act
        let entries = parse_ldd("\tnot a dynamic executable\n");

        // Assert
        assert!(entries.is_empty());
    }

    #[test]
    fn missing_library_is_reported_by_name() {
        // Act
        let entries = parse_ldd("\tlibfoo.so.1 => not found\n");

        // Assert
        assert_eq!(entries, vec![LddEntry::NotFound("libfoo.so.1".into())]);
    }

    #[test]
    fn nonexistent_binary_is_a_clear_error() {
        // Act
        let result = ldd(Path::new("/nonexistent/bulkhead-binary"));

        // Assert
        assert!(matches!(result, Err(LibsError::NoSuchBinary(_))));
    }
}
