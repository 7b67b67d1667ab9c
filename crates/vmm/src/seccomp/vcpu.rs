//! The vCPU threads' allowlist.
//!
//! A vCPU thread loops on `KVM_RUN`; the exits it handles in user space are port I/O and MMIO,
//! which reach the legacy devices (UART, i8042, debug port) and the virtio-mmio transports. Queue
//! notifications and interrupts bypass it (ioeventfds and irqfds), so what the devices do on
//! this thread is small: write an eventfd (an interrupt, the i8042 reset line, a device's
//! activation event), write console output, and at a driver's DRIVER_OK clone the queue
//! eventfds for the device (`fcntl(F_DUPFD_CLOEXEC)`), or at a virtio-fs reset close every file
//! the guest had open. A paused vCPU saves its own state for a snapshot (KVM's `GET` ioctls of
//! that state, never a `SET`) and, when resumed, tells the guest's kvmclock (`KVM_KVMCLOCK_CTRL`).

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

pub(crate) const fn size_of_u32<T>() -> u32 {
    std::mem::size_of::<T>() as u32
}

/// What a paused vCPU reads for a snapshot.
fn snapshot_ioctls() -> &'static [u64] {
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    return &snapshot::VCPU_IOCTLS;
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    return &[];
}

/// The KVM ioctls an aarch64 snapshot needs (Linux `include/uapi/linux/kvm.h`): reads only.
#[cfg(target_arch = "aarch64")]
pub(crate) mod snapshot {
    use kvm_bindings::{kvm_device_attr, kvm_mp_state, kvm_one_reg, kvm_reg_list, KVMIO};
    use vmm_sys_util::ioctl::{ioctl_expr, _IOC_READ, _IOC_WRITE};

    use super::size_of_u32;

    const RW: u32 = _IOC_READ | _IOC_WRITE;

    /// What a paused vCPU thread reads for a snapshot: its register list, each register, its MP
    /// state.
    pub(crate) const VCPU_IOCTLS: [u64; 3] = [
        ioctl_expr(RW, KVMIO, 0xb0, size_of_u32::<kvm_reg_list>()), // KVM_GET_REG_LIST
        ioctl_expr(_IOC_WRITE, KVMIO, 0xab, size_of_u32::<kvm_one_reg>()), // KVM_GET_ONE_REG
        ioctl_expr(_IOC_READ, KVMIO, 0x98, size_of_u32::<kvm_mp_state>()), // KVM_GET_MP_STATE
    ];

    /// What the event loop reads of the VM for a snapshot: the vGIC's registers.
    pub(crate) const VM_IOCTLS: [u64; 1] = [
        ioctl_expr(_IOC_WRITE, KVMIO, 0xe2, size_of_u32::<kvm_device_attr>()), // KVM_GET_DEVICE_ATTR
    ];
}

/// The KVM ioctls a snapshot needs (x86_64; Linux `include/uapi/linux/kvm.h`).
#[cfg(target_arch = "x86_64")]
pub(crate) mod snapshot {
    use kvm_bindings::{
        kvm_clock_data, kvm_cpuid2, kvm_debugregs, kvm_irqchip, kvm_lapic_state, kvm_mp_state,
        kvm_msrs, kvm_pit_state2, kvm_vcpu_events, kvm_xcrs, kvm_xsave, KVMIO,
    };
    use vmm_sys_util::ioctl::{ioctl_expr, _IOC_NONE, _IOC_READ, _IOC_WRITE};

    use super::size_of_u32;

    const RW: u32 = _IOC_READ | _IOC_WRITE;

    /// What a paused vCPU thread reads for a snapshot, and `KVM_KVMCLOCK_CTRL` on resume.
    pub(crate) const VCPU_IOCTLS: [u64; 11] = [
        ioctl_expr(RW, KVMIO, 0x88, size_of_u32::<kvm_msrs>()), // KVM_GET_MSRS
        ioctl_expr(RW, KVMIO, 0x91, size_of_u32::<kvm_cpuid2>()), // KVM_GET_CPUID2
        ioctl_expr(_IOC_READ, KVMIO, 0x98, size_of_u32::<kvm_mp_state>()), // KVM_GET_MP_STATE
        ioctl_expr(_IOC_READ, KVMIO, 0x8e, size_of_u32::<kvm_lapic_state>()), // KVM_GET_LAPIC
        ioctl_expr(_IOC_READ, KVMIO, 0xa4, size_of_u32::<kvm_xsave>()), // KVM_GET_XSAVE
        ioctl_expr(_IOC_READ, KVMIO, 0xcf, size_of_u32::<kvm_xsave>()), // KVM_GET_XSAVE2
        ioctl_expr(_IOC_READ, KVMIO, 0xa6, size_of_u32::<kvm_xcrs>()), // KVM_GET_XCRS
        ioctl_expr(_IOC_READ, KVMIO, 0xa1, size_of_u32::<kvm_debugregs>()), // KVM_GET_DEBUGREGS
        ioctl_expr(_IOC_READ, KVMIO, 0x9f, size_of_u32::<kvm_vcpu_events>()), // KVM_GET_VCPU_EVENTS
        ioctl_expr(_IOC_NONE, KVMIO, 0xa3, 0),                  // KVM_GET_TSC_KHZ
        ioctl_expr(_IOC_NONE, KVMIO, 0xad, 0),                  // KVM_KVMCLOCK_CTRL
    ];

    /// What the event loop reads of the VM for a snapshot.
    pub(crate) const VM_IOCTLS: [u64; 3] = [
        ioctl_expr(RW, KVMIO, 0x62, size_of_u32::<kvm_irqchip>()), // KVM_GET_IRQCHIP
        ioctl_expr(_IOC_READ, KVMIO, 0x9f, size_of_u32::<kvm_pit_state2>()), // KVM_GET_PIT2
        ioctl_expr(_IOC_READ, KVMIO, 0x7c, size_of_u32::<kvm_clock_data>()), // KVM_GET_CLOCK
    ];
}

/// [`common`] plus what a vCPU's run loop and the devices on its exits need.
pub(super) fn allowlist() -> Allowlist {
    let mut list = common();
    // The run loop itself; KVM's other ioctls (creating vCPUs, memory slots, setting registers)
    // all happened before the thread started.
    let ioctls: Vec<u64> = [KVM_RUN, KVM_GET_REGS, KVM_GET_SREGS]
        .into_iter()
        .chain(snapshot_ioctls().iter().copied())
        .collect();
    list.allow_values(libc::SYS_ioctl, 1, &ioctls);
    // Activating a virtio device clones its queue notification eventfds for the device.
    list.allow_values(libc::SYS_fcntl, 1, &[libc::F_DUPFD_CLOEXEC as u64]);
    // A virtio-fs reset drops the guest's open files; the thread's end closes the vCPU fd.
    list.allow(&[libc::SYS_close]);
    list
}
