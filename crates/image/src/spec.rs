//! What to build ([`BuildSpec`]) and how a build reports progress ([`Progress`]).

use std::path::PathBuf;

/// Debian suite built when none is given.
pub const DEFAULT_SUITE: &str = "bookworm";

/// Packages installed when none are given, on top of the `apt` variant's base set (Debian's
/// essential packages and apt): the tools an AI coding agent's commands expect (python3, git,
/// bash, coreutils, TLS roots) plus `procps` (`ps`, `kill`, `top`) and `mount`.
pub const DEFAULT_PACKAGES: [&str; 8] = [
    "python3",
    "git",
    "bash",
    "coreutils",
    "ca-certificates",
    "curl",
    "procps",
    "mount",
];

/// Longest image name accepted, in bytes.
pub const MAX_NAME_LEN: usize = 64;

/// Smallest explicit image size accepted, in MiB.
pub const MIN_SIZE_MIB: u32 = 16;

/// Invalid build specifications.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SpecError {
    /// The image name is not 1–64 of `[a-z0-9._-]` starting with a letter or digit.
    #[error("invalid image name {0:?}: use 1-64 characters of a-z, 0-9, '.', '_', '-', starting with a letter or digit")]
    Name(String),
    /// The suite name has characters a Debian suite name cannot have.
    #[error("invalid suite {0:?}: expected a Debian suite or codename such as bookworm")]
    Suite(String),
    /// A package name has characters Debian package names cannot have.
    #[error("invalid package name {0:?}")]
    Package(String),
    /// The mirror is not an http(s):// or file:// URL without spaces or commas.
    #[error("invalid mirror {0:?}: expected an http://, https:// or file:// URL")]
    Mirror(String),
    /// The explicit size is below [`MIN_SIZE_MIB`].
    #[error("image size {0} MiB is too small (at least {MIN_SIZE_MIB} MiB)")]
    Size(u32),
}

/// What to build.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildSpec {
    /// Image name; the image lands in `<data dir>/images/<name>/`.
    pub name: String,
    /// Debian suite (default [`DEFAULT_SUITE`]).
    pub suite: String,
    /// Packages to install on top of the base set (default [`DEFAULT_PACKAGES`]).
    pub packages: Vec<String>,
    /// Size of `rootfs.ext4` in MiB; `None` sizes it to the content plus a small headroom.
    pub size_mib: Option<u32>,
    /// The guest agent to install as `/sbin/bulkhead-agent`: a static x86_64 ELF executable,
    /// normally `target/x86_64-unknown-linux-musl/release/bulkhead-agent`.
    pub agent_binary: PathBuf,
    /// Debian mirror URL; `None` uses Debian's default mirrors (including security updates).
    pub mirror: Option<String>,
}

impl BuildSpec {
    /// A spec for image `name` with the default suite and packages, automatic size and the
    /// default mirrors.
    pub fn new(name: impl Into<String>, agent_binary: impl Into<PathBuf>) -> Self {
        Self {
            name: name.into(),
            suite: DEFAULT_SUITE.to_owned(),
            packages: DEFAULT_PACKAGES.iter().map(|p| (*p).to_owned()).collect(),
            size_mib: None,
            agent_binary: agent_binary.into(),
            mirror: None,
        }
    }

    /// Checks every field's syntax (not whether packages exist: the build finds that out).
    pub fn validate(&self) -> Result<(), SpecError> {
        validate_name(&self.name)?;
        if self.suite.is_empty()
            || !self
                .suite
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-.".contains(&b))
        {
            return Err(SpecError::Suite(self.suite.clone()));
        }
        if let Some(bad) = self.packages.iter().find(|p| !is_package_name(p)) {
            return Err(SpecError::Package(bad.clone()));
        }
        if let Some(mirror) = self.mirror.as_ref().filter(|m| !is_mirror_url(m)) {
            return Err(SpecError::Mirror(mirror.clone()));
        }
        match self.size_mib {
            Some(size) if size < MIN_SIZE_MIB => Err(SpecError::Size(size)),
            _ => Ok(()),
        }
    }
}

/// Checks an image name: 1–[`MAX_NAME_LEN`] of `[a-z0-9._-]`, starting with a letter or digit
/// (so it is a plain directory name, never hidden, never `..`).
pub fn validate_name(name: &str) -> Result<(), SpecError> {
    let ok = (1..=MAX_NAME_LEN).contains(&name.len())
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(SpecError::Name(name.to_owned()))
    }
}

/// Debian policy §5.6.7 package names (`[a-z0-9][a-z0-9+.-]+`), optionally with an
/// `:arch` qualifier or an `=version` pin, as apt accepts them.
fn is_package_name(p: &str) -> bool {
    let base = p.split(['=', ':']).next().unwrap_or_default();
    base.len() >= 2
        && base.as_bytes()[0].is_ascii_alphanumeric()
        && p.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"+.-:=~".contains(&b))
}

fn is_mirror_url(m: &str) -> bool {
    ["http://", "https://", "file://"]
        .iter()
        .any(|scheme| m.len() > scheme.len() && m.starts_with(scheme))
        && !m
            .bytes()
            .any(|b| b.is_ascii_whitespace() || b == b',' || b.is_ascii_control())
}

/// The stage a build is in, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Checking tools and inputs, cleaning leftovers of interrupted builds.
    Prepare,
    /// Bootstrapping the Debian root (downloads, unpacking, package configuration).
    Bootstrap,
    /// Installing the agent and removing host-specific files from the root.
    Customize,
    /// Writing `rootfs.ext4` with `mkfs.ext4 -d`.
    Filesystem,
    /// Hashing the image.
    Checksum,
    /// The image is in the store.
    Done,
}

/// One progress report: plain data, for a CLI to drive a progress bar with.
#[derive(Debug, Clone, PartialEq)]
pub struct Progress {
    /// Current stage.
    pub phase: Phase,
    /// Human-readable line (for bootstrap, mmdebstrap's own output line).
    pub message: String,
    /// Estimated fraction of the whole build done, 0.0–1.0, when known.
    pub fraction: Option<f32>,
}

impl Progress {
    /// A report for `phase` with `message` and an optional fraction.
    pub fn new(phase: Phase, message: impl Into<String>, fraction: Option<f32>) -> Self {
        Self {
            phase,
            message: message.into(),
            fraction,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> BuildSpec {
        BuildSpec::new("debian", "/bin/agent")
    }

    #[test]
    fn default_spec_is_valid_and_lists_the_promised_tools() {
        // Arrange
        let spec = spec();

        // Act
        let result = spec.validate();

        // Assert
        assert_eq!(result, Ok(()));
        assert_eq!(spec.suite, "bookworm");
        for tool in ["python3", "git", "bash", "coreutils", "ca-certificates"] {
            assert!(spec.packages.iter().any(|p| p == tool), "{tool} missing");
        }
    }

    #[test]
    fn names_that_could_escape_the_store_are_refused() {
        // Arrange
        let bad = [
            "",
            "..",
            ".hidden",
            "a/b",
            "Debian",
            "x".repeat(65).as_str(),
            "-x",
        ]
        .map(String::from);

        // Act / Assert
        for name in bad {
            assert_eq!(validate_name(&name), Err(SpecError::Name(name.clone())));
        }
        assert_eq!(validate_name("debian-12.1_py"), Ok(()));
    }

    #[test]
    fn bad_packages_mirrors_and_sizes_are_refused() {
        // Arrange
        let with = |f: fn(&mut BuildSpec)| {
            let mut s = spec();
            f(&mut s);
            s.validate()
        };

        // Act / Assert
        assert!(matches!(
            with(|s| s.packages.push("git;rm".into())),
            Err(SpecError::Package(_))
        ));
        assert!(matches!(
            with(|s| s.mirror = Some("ftp://x".into())),
            Err(SpecError::Mirror(_))
        ));
        assert!(matches!(
            with(|s| s.mirror = Some("http://a b".into())),
            Err(SpecError::Mirror(_))
        ));
        assert_eq!(with(|s| s.size_mib = Some(8)), Err(SpecError::Size(8)));
        assert!(matches!(
            with(|s| s.suite = "book worm".into()),
            Err(SpecError::Suite(_))
        ));
        assert_eq!(
            with(|s| s.packages = vec!["libc6:amd64".into(), "g++=4:12.2.0-3".into()]),
            Ok(())
        );
    }
}
