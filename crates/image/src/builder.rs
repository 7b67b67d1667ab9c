//! The step of a build that produces `rootfs.ext4`, behind a trait so the store's atomic
//! staging and publishing can be tested with a fake, and so other distributions can follow.

use std::io;
use std::path::{Path, PathBuf};

use crate::ext4::Ext4Error;
use crate::spec::{BuildSpec, Progress};

/// Makes the root filesystem image for a [`BuildSpec`].
pub trait RootfsBuilder {
    /// Builds the image described by `spec` and writes it to `image`. `work_dir` is an empty
    /// directory on the same file system as the store, for scratch files; the caller deletes
    /// it afterwards, whatever the outcome. Reports progress through `progress`.
    fn build(
        &self,
        spec: &BuildSpec,
        work_dir: &Path,
        image: &Path,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<(), BuildError>;
}

/// Why a build failed.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// Bootstrapping needs root (mmdebstrap's root mode creates device nodes and chroots).
    #[error("building an image needs root (mmdebstrap --mode=root); run it with sudo")]
    NeedsRoot,
    /// A required program is not installed.
    #[error("{tool} not found in PATH; install it with `apt-get install {package}`")]
    ToolMissing {
        /// The program.
        tool: &'static str,
        /// The Debian package that provides it.
        package: &'static str,
    },
    /// The agent binary is missing or not an executable for the image's architecture.
    #[error("agent binary {}: {reason} (build it with `cargo build --release --target x86_64-unknown-linux-musl -p bulkhead-agent`)", path.display())]
    Agent {
        /// The path given in the spec.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// This host's CPU architecture has no Debian equivalent known here.
    #[error("unsupported host architecture {0}")]
    Arch(&'static str),
    /// A program could not be started.
    #[error("starting {tool}: {source}")]
    Spawn {
        /// The program.
        tool: &'static str,
        /// What failed.
        source: io::Error,
    },
    /// The bootstrap tool failed; `output` holds its last lines.
    #[error("{tool} failed ({status}); its last output:\n{output}")]
    Bootstrap {
        /// The program.
        tool: &'static str,
        /// Its exit status.
        status: std::process::ExitStatus,
        /// Its last lines of output.
        output: String,
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
    /// The root tree does not fit the explicitly requested size.
    #[error("the root file system needs about {needed_mib} MiB but --size is {size_mib} MiB")]
    TooSmall {
        /// Requested size in MiB.
        size_mib: u64,
        /// Estimated need in MiB.
        needed_mib: u64,
    },
    /// Making the ext4 image failed.
    #[error(transparent)]
    Ext4(#[from] Ext4Error),
}

impl BuildError {
    /// Shorthand for [`BuildError::Io`] as a `map_err` closure.
    pub fn io(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> Self {
        let path = path.to_path_buf();
        move |source| Self::Io { what, path, source }
    }
}
