//! Where bulkhead keeps its files on the host, after the XDG Base Directory Specification:
//! data (the image store) under `${XDG_DATA_HOME:-~/.local/share}/bulkhead`, caches (downloaded
//! `.deb` files) under `${XDG_CACHE_HOME:-~/.cache}/bulkhead`.

use std::ffi::OsString;
use std::path::PathBuf;

/// Name of bulkhead's subdirectory in the XDG data and cache directories.
pub const APP_DIR: &str = "bulkhead";

/// Errors locating bulkhead's directories.
#[derive(Debug, thiserror::Error)]
pub enum PathsError {
    /// Neither the XDG variable nor `HOME` gives an absolute directory.
    #[error("neither {var} nor HOME is set to an absolute path: cannot locate bulkhead's {what} directory")]
    NoHome {
        /// The XDG variable consulted first (`XDG_DATA_HOME` or `XDG_CACHE_HOME`).
        var: &'static str,
        /// "data" or "cache".
        what: &'static str,
    },
}

/// bulkhead's data directory: `${XDG_DATA_HOME:-~/.local/share}/bulkhead`.
pub fn default_data_dir() -> Result<PathBuf, PathsError> {
    resolve("XDG_DATA_HOME", ".local/share", "data")
}

/// bulkhead's cache directory: `${XDG_CACHE_HOME:-~/.cache}/bulkhead`.
pub fn default_cache_dir() -> Result<PathBuf, PathsError> {
    resolve("XDG_CACHE_HOME", ".cache", "cache")
}

fn resolve(var: &'static str, fallback: &str, what: &'static str) -> Result<PathBuf, PathsError> {
    xdg_dir(std::env::var_os(var), std::env::var_os("HOME"), fallback)
        .map(|base| base.join(APP_DIR))
        .ok_or(PathsError::NoHome { var, what })
}

/// The XDG base directory: `xdg` when it is an absolute path (the specification says relative
/// values are to be ignored), else `home/fallback` when `home` is absolute, else `None`.
pub fn xdg_dir(xdg: Option<OsString>, home: Option<OsString>, fallback: &str) -> Option<PathBuf> {
    let absolute = |v: OsString| Some(PathBuf::from(v)).filter(|p| p.is_absolute());
    xdg.and_then(absolute)
        .or_else(|| home.and_then(absolute).map(|h| h.join(fallback)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xdg_variable_wins_when_absolute() {
        // Arrange
        let xdg = Some(OsString::from("/data"));
        let home = Some(OsString::from("/home/u"));

        // Act
        let dir = xdg_dir(xdg, home, ".local/share");

        // Assert
        assert_eq!(dir, Some(PathBuf::from("/data")));
    }

    #[test]
    fn relative_or_empty_xdg_variable_falls_back_to_home() {
        // Arrange
        let home = || Some(OsString::from("/home/u"));

        // Act
        let relative = xdg_dir(Some("rel/dir".into()), home(), ".cache");
        let empty = xdg_dir(Some("".into()), home(), ".cache");

        // Assert
        assert_eq!(relative, Some(PathBuf::from("/home/u/.cache")));
        assert_eq!(empty, Some(PathBuf::from("/home/u/.cache")));
    }

    #[test]
    fn no_usable_home_gives_none() {
        // Arrange / Act
        let dir = xdg_dir(None, Some("relative".into()), ".cache");

        // Assert
        assert_eq!(dir, None);
    }
}
