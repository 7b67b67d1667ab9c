//! bulkhead's virtual machine monitor.
//!
//! This crate boots a Linux guest on KVM: it creates guest memory, loads a kernel (ELF `vmlinux` or
//! `bzImage`) and an initramfs, configures vCPUs for the 64-bit Linux boot protocol and runs them,
//! with a small set of emulated devices (8250 UART, i8042 reset line, debug port, virtio-mmio).
//!
//! Layout:
//! - [`vstate`]: KVM handles — the `/dev/kvm` context, the VM, guest memory and vCPU threads.
//! - [`arch`]: architecture-specific boot set-up (page tables, GDT, `boot_params`, MP table, CPUID).
//! - [`boot`]: kernel/initramfs loading and kernel command-line building.
//! - [`devices`]: emulated devices and the port-I/O / MMIO buses they sit on.
//! - [`config`]: the VM configuration (JSON or command-line flags) and its validation.
//! - [`timings`]: the boot-timeline report (`bulkhead-vmm --timings-json`).
//! - [`exit_report`]: how the VM ended, in the VMM's words (`bulkhead-vmm --exit-file`).
//! - [`seccomp`]: the seccomp-BPF allowlist of each kind of VMM thread.
//! - [`jail`]: namespaces, a private root and dropped privileges for the VMM process.
//! - [`snapshot`]: pausing a VM, saving it to a directory and restoring it (many times: clones
//!   share the saved memory copy-on-write); [`control`]: the socket that asks for it.
#![deny(missing_docs)]

pub mod arch;
pub mod boot;
pub mod builder;
pub mod config;
pub mod control;
pub mod device_manager;
pub mod devices;
pub mod exit_report;
pub mod holes;
pub mod jail;
pub mod limits;
pub mod seccomp;
pub mod snapshot;
pub mod timings;
pub mod vmm;
pub mod vstate;

pub use builder::build;
pub use config::VmConfig;
pub use vmm::{BootTimeline, RunOutcome, StopHandle, TimelineMs, Vmm};
pub use vstate::vcpu::ExitReason;
