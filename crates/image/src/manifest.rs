//! `manifest.json`: what an image is (name, size, sha256, creation time, packages), written
//! next to its `rootfs.ext4`. An image directory without a readable manifest is not an image.

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// File name of the manifest inside an image directory.
pub const MANIFEST_FILE: &str = "manifest.json";

/// File name of the ext4 root filesystem inside an image directory.
pub const ROOTFS_FILE: &str = "rootfs.ext4";

/// Version of this builder, recorded in every manifest it writes.
pub const BUILDER_VERSION: &str = env!("CARGO_PKG_VERSION");

/// The description of one image, stored as `manifest.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Image name, also its directory name in the store.
    pub name: String,
    /// Length of `rootfs.ext4` in bytes (the block device's capacity in the guest).
    pub size_bytes: u64,
    /// SHA-256 of `rootfs.ext4`, lowercase hex (64 characters).
    pub sha256: String,
    /// When the build finished, RFC 3339 in UTC (`2025-01-31T12:00:00Z`).
    pub created: String,
    /// Debian suite the root was bootstrapped from (e.g. `bookworm`).
    pub suite: String,
    /// The packages asked for, in addition to the bootstrap variant's base set.
    pub packages: Vec<String>,
    /// Version of `bulkhead-image` that built the image.
    pub builder_version: String,
    /// Debian mirror the packages came from; `None` means Debian's default mirrors.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mirror: Option<String>,
}

/// Errors reading or writing a manifest.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// The file could not be read.
    #[error("reading {}: {source}", path.display())]
    Read {
        /// The manifest's path.
        path: PathBuf,
        /// What failed.
        source: io::Error,
    },
    /// The file is not a valid manifest.
    #[error("{} is not a valid image manifest: {source}", path.display())]
    Parse {
        /// The manifest's path.
        path: PathBuf,
        /// What is wrong with it.
        source: serde_json::Error,
    },
    /// The file could not be written.
    #[error("writing {}: {source}", path.display())]
    Write {
        /// The path being written.
        path: PathBuf,
        /// What failed.
        source: io::Error,
    },
}

impl Manifest {
    /// Reads `dir/manifest.json`.
    pub fn read(dir: &Path) -> Result<Self, ManifestError> {
        let path = dir.join(MANIFEST_FILE);
        let text = fs::read(&path).map_err(|source| ManifestError::Read {
            path: path.clone(),
            source,
        })?;
        serde_json::from_slice(&text).map_err(|source| ManifestError::Parse { path, source })
    }

    /// Writes `dir/manifest.json` atomically: a temporary file in `dir`, fsync, rename.
    pub fn write_atomic(&self, dir: &Path) -> Result<(), ManifestError> {
        let path = dir.join(MANIFEST_FILE);
        let tmp = dir.join(format!(".{MANIFEST_FILE}.tmp"));
        let write_err = |path: &Path| {
            let path = path.to_path_buf();
            move |source| ManifestError::Write { path, source }
        };
        let mut json = serde_json::to_vec_pretty(self).map_err(|e| ManifestError::Write {
            path: path.clone(),
            source: io::Error::other(e),
        })?;
        json.push(b'\n');
        let mut file = fs::File::create(&tmp).map_err(write_err(&tmp))?;
        file.write_all(&json).map_err(write_err(&tmp))?;
        file.sync_all().map_err(write_err(&tmp))?;
        fs::rename(&tmp, &path).map_err(write_err(&path))
    }
}

/// Formats `time` as RFC 3339 in UTC with second precision (`YYYY-MM-DDTHH:MM:SSZ`).
/// Times before 1970 are clamped to the epoch.
pub fn rfc3339_utc(time: SystemTime) -> String {
    let secs = time
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (year, month, day) = civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Proleptic Gregorian (year, month, day) of `days` since 1970-01-01, using the 400-year era
/// decomposition (an era is 146 097 days; years in an era start on 1 March).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468; // days since 0000-03-01
    let era = z / 146_097;
    let day_of_era = z % 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153; // 0 = March
    let day = day_of_year - (153 * month_index + 2) / 5 + 1;
    let month = if month_index < 10 {
        month_index + 3
    } else {
        month_index - 9
    };
    let year = year_of_era + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn sample() -> Manifest {
        Manifest {
            name: "debian".into(),
            size_bytes: 268_435_456,
            sha256: "ab".repeat(32),
            created: "2025-01-31T12:00:00Z".into(),
            suite: "bookworm".into(),
            packages: vec!["python3".into(), "git".into()],
            builder_version: BUILDER_VERSION.into(),
            mirror: None,
        }
    }

    #[test]
    fn manifest_survives_a_write_read_round_trip() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let manifest = sample();

        // Act
        manifest.write_atomic(dir.path()).unwrap();
        let read = Manifest::read(dir.path()).unwrap();

        // Assert
        assert_eq!(read, manifest);
        assert!(!dir.path().join(".manifest.json.tmp").exists());
    }

    #[test]
    fn manifest_json_uses_the_documented_field_names() {
        // Arrange
        let manifest = sample();

        // Act
        let json: serde_json::Value = serde_json::to_value(&manifest).unwrap();

        // Assert
        for key in [
            "name",
            "size_bytes",
            "sha256",
            "created",
            "suite",
            "packages",
            "builder_version",
        ] {
            assert!(json.get(key).is_some(), "missing {key}");
        }
        assert!(json.get("mirror").is_none());
    }

    #[test]
    fn garbage_manifest_is_a_parse_error_naming_the_file() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(MANIFEST_FILE), b"{not json").unwrap();

        // Act
        let err = Manifest::read(dir.path()).unwrap_err();

        // Assert
        assert!(matches!(err, ManifestError::Parse { .. }));
        assert!(err.to_string().contains("manifest.json"));
    }

    #[test]
    fn rfc3339_formats_known_instants() {
        // Arrange
        let at = |secs| UNIX_EPOCH + Duration::from_secs(secs);

        // Act / Assert
        assert_eq!(rfc3339_utc(at(0)), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339_utc(at(951_782_400)), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339_utc(at(1_738_324_799)), "2025-01-31T11:59:59Z");
        assert_eq!(rfc3339_utc(at(4_107_542_400)), "2100-03-01T00:00:00Z");
    }
}
