//! The `/dev/kvm` context: opening it, checking the capabilities bulkhead needs, and telling whether
//! this host's KVM can boot a stock Linux guest at all.

use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::{FromRawFd, IntoRawFd};
use std::path::{Path, PathBuf};

use kvm_ioctls::{Cap, Kvm};

/// The KVM device node.
pub const KVM_PATH: &str = "/dev/kvm";

/// The only stable KVM API version (KVM_GET_API_VERSION).
const KVM_API_VERSION: i32 = 12;

/// Errors from opening and checking KVM.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The device node could not be opened.
    #[error("cannot open {path}: {source}{hint}")]
    Open {
        /// The node tried.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
        /// What the user can do about it.
        hint: &'static str,
    },
    /// KVM_GET_API_VERSION returned something other than 12.
    #[error("KVM API version {0} is not supported (expected 12)")]
    ApiVersion(i32),
    /// A capability bulkhead relies on is missing.
    #[error("the host's KVM lacks a required capability: {0:?}")]
    MissingCap(Cap),
}

/// Which KVM implementation the host kernel provides, read from `/sys/module`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostKvm {
    /// Hardware-assisted KVM with Intel VT-x (`kvm_intel`).
    Intel,
    /// Hardware-assisted KVM with AMD SVM (`kvm_amd`).
    Amd,
    /// KVM on arm64 (built into the kernel; `/sys/module/kvm` only).
    Arm64,
    /// PVM (`kvm_pvm`), a paravirtual KVM that only runs guests built with PVM guest support: a stock
    /// Linux kernel cannot boot on it.
    Pvm,
    /// No KVM module is loaded.
    Absent,
}

impl HostKvm {
    /// Whether a stock Linux guest kernel can boot on this KVM.
    pub fn can_boot_stock_kernel(self) -> bool {
        matches!(self, HostKvm::Intel | HostKvm::Amd | HostKvm::Arm64)
    }

    /// A one-line explanation for users when [`Self::can_boot_stock_kernel`] is false.
    pub fn explain(self) -> &'static str {
        match self {
            HostKvm::Pvm => {
                "this host's /dev/kvm is kvm_pvm (paravirtual KVM), which cannot boot a stock Linux guest kernel"
            }
            HostKvm::Absent => "KVM is not available on this host (no kvm module loaded)",
            _ => "this host's KVM can boot Linux guests",
        }
    }
}

/// Detects the host's KVM implementation from the modules under `sys_module` (normally
/// `/sys/module`). Detection looks at what is loaded; it does not guess from the CPU model.
///
/// # Example
/// ```
/// use bulkhead_vmm::vstate::kvm::{detect_host_kvm, HostKvm};
/// let dir = tempfile::tempdir().unwrap();
/// std::fs::create_dir_all(dir.path().join("kvm_pvm")).unwrap();
/// assert_eq!(detect_host_kvm(dir.path()), HostKvm::Pvm);
/// ```
pub fn detect_host_kvm(sys_module: &Path) -> HostKvm {
    let has = |name: &str| sys_module.join(name).exists();
    if has("kvm_intel") {
        HostKvm::Intel
    } else if has("kvm_amd") {
        HostKvm::Amd
    } else if has("kvm_pvm") {
        HostKvm::Pvm
    } else if cfg!(target_arch = "aarch64") && has("kvm") {
        HostKvm::Arm64
    } else {
        HostKvm::Absent
    }
}

/// The host's KVM implementation, from `/sys/module`.
pub fn host_kvm() -> HostKvm {
    detect_host_kvm(Path::new("/sys/module"))
}

/// An open, checked `/dev/kvm`.
#[derive(Debug)]
pub struct KvmContext {
    kvm: Kvm,
    max_vcpus: usize,
}

impl KvmContext {
    /// Opens the KVM device at `path` (close-on-exec) and checks the API version and the capabilities
    /// bulkhead needs: user memory, in-kernel irqchip, irqfd, ioeventfd.
    ///
    /// # Errors
    /// [`Error::Open`] with a hint when the node is missing or not accessible, [`Error::ApiVersion`],
    /// [`Error::MissingCap`].
    pub fn open(path: &Path) -> Result<Self, Error> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(|source| Error::Open {
                path: path.to_owned(),
                hint: open_hint(&source),
                source,
            })?;
        // SAFETY: `file` is an open KVM device node that we own; ownership of the descriptor moves
        // into `Kvm`, which closes it on drop.
        let kvm = unsafe { Kvm::from_raw_fd(file.into_raw_fd()) };
        let version = kvm.get_api_version();
        if version != KVM_API_VERSION {
            return Err(Error::ApiVersion(version));
        }
        for cap in required_caps() {
            if !kvm.check_extension(cap) {
                return Err(Error::MissingCap(cap));
            }
        }
        let max_vcpus = kvm.get_max_vcpus();
        Ok(KvmContext { kvm, max_vcpus })
    }

    /// The KVM system handle.
    pub fn kvm(&self) -> &Kvm {
        &self.kvm
    }

    /// The most vCPUs one VM may have on this host (KVM_CAP_MAX_VCPUS).
    pub fn max_vcpus(&self) -> usize {
        self.max_vcpus
    }
}

/// Capabilities bulkhead cannot run without. On x86_64 that includes the in-kernel LAPIC's
/// TSC-deadline mode, which the vCPUs' CPUID advertises (see `arch::x86_64::cpuid`).
fn required_caps() -> Vec<Cap> {
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
    let mut caps = vec![Cap::UserMemory, Cap::Irqchip, Cap::Irqfd, Cap::Ioeventfd];
    #[cfg(target_arch = "x86_64")]
    caps.push(Cap::TscDeadlineTimer);
    caps
}

fn open_hint(err: &io::Error) -> &'static str {
    match err.kind() {
        io::ErrorKind::NotFound => {
            " (KVM is not available: load kvm_intel or kvm_amd, or enable virtualization in the firmware)"
        }
        io::ErrorKind::PermissionDenied => {
            " (add your user to the group owning /dev/kvm, usually `kvm`, and log in again)"
        }
        _ => "",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sys_with(modules: &[&str]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for m in modules {
            std::fs::create_dir_all(dir.path().join(m)).unwrap();
        }
        dir
    }

    #[test]
    fn pvm_without_hardware_kvm_cannot_boot_stock_kernels() {
        let sys = sys_with(&["kvm", "kvm_pvm"]);

        let kind = detect_host_kvm(sys.path());

        assert_eq!(kind, HostKvm::Pvm);
        assert!(!kind.can_boot_stock_kernel());
        assert!(kind.explain().contains("kvm_pvm"));
    }

    #[test]
    fn hardware_kvm_wins_over_pvm() {
        let sys = sys_with(&["kvm", "kvm_pvm", "kvm_amd"]);

        assert_eq!(detect_host_kvm(sys.path()), HostKvm::Amd);
        assert!(HostKvm::Amd.can_boot_stock_kernel());
    }

    #[test]
    fn no_modules_means_absent() {
        let sys = sys_with(&[]);

        assert_eq!(detect_host_kvm(sys.path()), HostKvm::Absent);
    }

    #[test]
    fn missing_node_gives_a_hint() {
        let err = KvmContext::open(Path::new("/nonexistent/kvm")).unwrap_err();

        let msg = err.to_string();
        assert!(msg.contains("/nonexistent/kvm"), "{msg}");
        assert!(msg.contains("KVM is not available"), "{msg}");
    }
}
