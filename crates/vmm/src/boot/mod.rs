//! Kernel and initramfs loading, kernel command line.
//!
//! The architecture-neutral half of booting a guest: get the payload into guest memory.
//! The typical sequence, before [`crate::arch::configure_system`]:
//!
//! ```no_run
//! use bulkhead_vmm::arch::{arch_memory_regions, configure_system, BootInfo};
//! use bulkhead_vmm::boot::{
//!     build_cmdline, load_cmdline, load_initrd, load_kernel, DEFAULT_CMDLINE,
//! };
//! use std::path::Path;
//! use vm_memory::GuestMemoryMmap;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mem = GuestMemoryMmap::<()>::from_ranges(&arch_memory_regions(128 << 20))?;
//! let kernel = load_kernel(&mem, Path::new("vmlinux"))?;
//! let initrd = load_initrd(&mem, Path::new("initramfs.cpio"), kernel.end)?;
//! let cmdline = build_cmdline(DEFAULT_CMDLINE, &[])?;
//! let (cmdline_addr, cmdline_size) = load_cmdline(&mem, &cmdline)?;
//! let boot = BootInfo {
//!     cmdline_addr,
//!     cmdline_size,
//!     initrd: Some((initrd.addr, initrd.size)),
//!     setup_header: kernel.setup_header,
//! };
//! configure_system(&mem, &boot, 1)?;
//! // ... then configure_vcpu(.., kernel.entry, ..) on each vCPU and run.
//! # Ok(())
//! # }
//! ```

pub mod cmdline;
pub mod initrd;
// The x86_64 kernel formats (ELF vmlinux, bzImage); arm64's `Image` loader is in `arch::aarch64`.
#[cfg(target_arch = "x86_64")]
pub mod kernel;

use vm_memory::{GuestMemory, GuestMemoryMmap, GuestMemoryRegion};

#[cfg(target_arch = "x86_64")]
pub use cmdline::load_cmdline;
pub use cmdline::{build_cmdline, DEFAULT_CMDLINE};
pub use initrd::{load_initrd, LoadedInitrd};
#[cfg(target_arch = "x86_64")]
pub use kernel::{detect_format, load_kernel, KernelFormat, LoadedKernel};
pub use linux_loader::cmdline::Cmdline;

/// Errors of the boot payload loading, returned by every public function of [`boot`](self);
/// the variant says which step failed, the message is the step's own.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Loading the kernel.
    #[cfg(target_arch = "x86_64")]
    #[error(transparent)]
    Kernel(#[from] kernel::Error),
    /// Loading the initramfs.
    #[error(transparent)]
    Initrd(#[from] initrd::Error),
    /// Building or loading the command line.
    #[error(transparent)]
    Cmdline(#[from] cmdline::Error),
}

/// Total guest RAM in bytes.
pub(crate) fn mem_size(mem: &GuestMemoryMmap) -> u64 {
    mem.iter().map(|region| region.len()).sum()
}

/// `bytes` for people: "300 MiB", "1.5 MiB", "12 KiB", "100 bytes".
pub(crate) fn fmt_size(bytes: u64) -> String {
    const KIB: u64 = 1 << 10;
    const MIB: u64 = 1 << 20;
    if bytes >= MIB && bytes % MIB == 0 {
        format!("{} MiB", bytes / MIB)
    } else if bytes >= MIB {
        format!("{:.1} MiB", bytes as f64 / MIB as f64)
    } else if bytes >= KIB && bytes % KIB == 0 {
        format!("{} KiB", bytes / KIB)
    } else {
        format!("{bytes} bytes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_printed_in_the_largest_exact_unit() {
        assert_eq!(fmt_size(300 << 20), "300 MiB");
        assert_eq!(fmt_size(3 << 19), "1.5 MiB");
        assert_eq!(fmt_size(12 << 10), "12 KiB");
        assert_eq!(fmt_size(1000), "1000 bytes");
    }
}
