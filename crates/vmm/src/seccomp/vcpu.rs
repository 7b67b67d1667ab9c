//! The vCPU threads' allowlist.
//!
//! A vCPU thread loops on `KVM_RUN`; the exits it handles in user space are port I/O and MMIO,
//! which reach the legacy devices (UART, i8042, debug port) and the virtio-mmio transports. Queue
//! notifications and interrupts bypass it (ioeventfds and irqfds), so what the devices do on
//! this thread is small: write an eventfd (an interrupt, the i8042 reset line, a device's
//! activation event), write console output, and at a driver's DRIVER_OK clone the queue
//! eventfds for the device (`fcntl(F_DUPFD_CLOEXEC)`), or at a virtio-fs reset close every file
//! the guest had open.

use kvm_bindings::{kvm_regs, kvm_sregs, KVMIO};
use vmm_sys_util::ioctl::{ioctl_expr, _IOC_NONE, _IOC_READ};

use super::rules::{common, Allowlist};

/// `KVM_RUN`: enter the guest.
pub(crate) const KVM_RUN: u64 = ioctl_expr(_IOC_NONE, KVMIO, 0x80, 0);
/// `KVM_GET_REGS`: read the registers, only to log where a triple fault happened.
pub(crate) const KVM_GET_REGS: u64 = ioctl_expr(_IOC_READ, KVMIO, 0x81, size_of_u32::<kvm_regs>());
/// `KVM_GET_SREGS`: read the system registers, for the same log line.
pub(crate) const KVM_GET_SREGS: u64 =
    ioctl_expr(_IOC_READ, KVMIO, 0x83, size_of_u32::<kvm_sregs>());

const fn size_of_u32<T>() -> u32 {
    std::mem::size_of::<T>() as u32
}

/// [`common`] plus what a vCPU's run loop and the devices on its exits need.
pub(super) fn allowlist() -> Allowlist {
    let mut list = common();
    // The run loop itself; KVM's other ioctls (creating vCPUs, memory slots, setting registers)
    // all happened before the thread started.
    list.allow_values(libc::SYS_ioctl, 1, &[KVM_RUN, KVM_GET_REGS, KVM_GET_SREGS]);
    // Activating a virtio device clones its queue notification eventfds for the device.
    list.allow_values(libc::SYS_fcntl, 1, &[libc::F_DUPFD_CLOEXEC as u64]);
    // A virtio-fs reset drops the guest's open files; the thread's end closes the vCPU fd.
    list.allow(&[libc::SYS_close]);
    list
}
