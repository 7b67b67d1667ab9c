//! vCPU register state for the 64-bit Linux boot protocol entry.
//!
//! Documentation/x86/boot.rst (protocol 2.15, "64-bit Boot Protocol") asks for: long mode with
//! paging on and an identity mapping of the kernel, zero page and command line; a GDT with flat
//! code and data segments loaded; interrupts disabled; RSI = GPA of `boot_params`. On top of
//! that this module gives each vCPU a stack, a clean FPU and a local APIC wired for legacy
//! interrupts (LINT0 = ExtINT from the PIC, LINT1 = NMI), as a PC's firmware would leave it.

use kvm_bindings::{kvm_dtable, kvm_fpu, kvm_lapic_state, kvm_regs, kvm_sregs};
use kvm_ioctls::VcpuFd;

use super::gdt::{self, boot_gdt, kvm_segment_from_descriptor, CODE_INDEX, DATA_INDEX, TSS_INDEX};
use super::layout::{
    BOOT_STACK_POINTER, GDT_ENTRIES, GDT_START, IDT_SIZE, IDT_START, ZERO_PAGE_START,
};

/// Errors setting vCPU registers.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A KVM register ioctl failed.
    #[error("{ioctl} failed: {source}")]
    Ioctl {
        /// The ioctl name.
        ioctl: &'static str,
        /// The KVM error.
        source: kvm_ioctls::Error,
    },
    /// Writing the GDT/IDT to guest memory failed.
    #[error(transparent)]
    Gdt(#[from] gdt::Error),
}

/// CR0.PE: protected mode.
pub const CR0_PE: u64 = 1 << 0;
/// CR0.ET: extension type (always 1 on modern CPUs).
pub const CR0_ET: u64 = 1 << 4;
/// CR0.PG: paging.
pub const CR0_PG: u64 = 1 << 31;
/// CR4.PAE: physical address extension, required for long mode.
pub const CR4_PAE: u64 = 1 << 5;
/// EFER.LME: long mode enable.
pub const EFER_LME: u64 = 1 << 8;
/// EFER.LMA: long mode active.
pub const EFER_LMA: u64 = 1 << 10;
/// RFLAGS with only the always-one bit 1 set (interrupts disabled).
pub const RFLAGS_BOOT: u64 = 0x2;
/// x87 control word after FNINIT: all exceptions masked, 64-bit precision, round to nearest.
pub const FPU_CONTROL_WORD: u16 = 0x37f;
/// MXCSR reset value: all SSE exceptions masked, round to nearest.
pub const MXCSR_DEFAULT: u32 = 0x1f80;

/// Byte offset of the LAPIC LVT LINT0 register in `kvm_lapic_state.regs`.
pub const APIC_LVT_LINT0: usize = 0x350;
/// Byte offset of the LAPIC LVT LINT1 register in `kvm_lapic_state.regs`.
pub const APIC_LVT_LINT1: usize = 0x360;
/// LVT delivery mode NMI (bits 8-10).
pub const APIC_MODE_NMI: u32 = 0b100;
/// LVT delivery mode ExtINT (bits 8-10).
pub const APIC_MODE_EXTINT: u32 = 0b111;

/// General registers at the 64-bit entry point `entry` (a GPA).
pub fn boot_regs(entry: u64) -> kvm_regs {
    kvm_regs {
        rip: entry,
        rsi: ZERO_PAGE_START,
        rsp: BOOT_STACK_POINTER,
        rbp: BOOT_STACK_POINTER,
        rflags: RFLAGS_BOOT,
        ..Default::default()
    }
}

/// Fills `sregs` (as read from KVM, so reset-state fields such as `apic_base` survive) for
/// long mode: boot GDT segments, empty IDT, paging with page tables at `cr3`.
pub fn set_long_mode_sregs(sregs: &mut kvm_sregs, cr3: u64) {
    let gdt = boot_gdt();
    let code = kvm_segment_from_descriptor(gdt[CODE_INDEX as usize], CODE_INDEX);
    let data = kvm_segment_from_descriptor(gdt[DATA_INDEX as usize], DATA_INDEX);
    sregs.gdt = kvm_dtable {
        base: GDT_START,
        limit: (GDT_ENTRIES * 8 - 1) as u16,
        ..Default::default()
    };
    sregs.idt = kvm_dtable {
        base: IDT_START,
        limit: (IDT_SIZE - 1) as u16,
        ..Default::default()
    };
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = kvm_segment_from_descriptor(gdt[TSS_INDEX as usize], TSS_INDEX);
    sregs.cr0 = CR0_PE | CR0_ET | CR0_PG;
    sregs.cr3 = cr3;
    sregs.cr4 = CR4_PAE;
    sregs.efer = EFER_LME | EFER_LMA;
}

/// FPU state: x87 and SSE in their reset configuration.
pub fn boot_fpu() -> kvm_fpu {
    kvm_fpu {
        fcw: FPU_CONTROL_WORD,
        mxcsr: MXCSR_DEFAULT,
        ..Default::default()
    }
}

/// Reads the 32-bit LAPIC register at byte `offset` of `lapic`.
pub fn lapic_reg(lapic: &kvm_lapic_state, offset: usize) -> u32 {
    let bytes: [u8; 4] = std::array::from_fn(|i| lapic.regs[offset + i] as u8);
    u32::from_le_bytes(bytes)
}

/// Writes the 32-bit LAPIC register at byte `offset` of `lapic`.
pub fn set_lapic_reg(lapic: &mut kvm_lapic_state, offset: usize, value: u32) {
    for (i, byte) in value.to_le_bytes().into_iter().enumerate() {
        lapic.regs[offset + i] = byte as std::os::raw::c_char;
    }
}

/// Sets the delivery mode (bits 8-10) of the LVT register at `offset`, keeping its other bits.
pub fn set_lvt_delivery_mode(lapic: &mut kvm_lapic_state, offset: usize, mode: u32) {
    let value = (lapic_reg(lapic, offset) & !(0b111 << 8)) | (mode << 8);
    set_lapic_reg(lapic, offset, value);
}

fn ioctl_error(ioctl: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> Error {
    move |source| Error::Ioctl { ioctl, source }
}

/// `KVM_SET_REGS` with [`boot_regs`].
pub fn setup_regs(vcpu: &VcpuFd, entry: u64) -> Result<(), Error> {
    vcpu.set_regs(&boot_regs(entry))
        .map_err(ioctl_error("KVM_SET_REGS"))
}

/// `KVM_GET_SREGS`, [`set_long_mode_sregs`], `KVM_SET_SREGS`.
pub fn setup_sregs(vcpu: &VcpuFd, cr3: u64) -> Result<(), Error> {
    let mut sregs = vcpu.get_sregs().map_err(ioctl_error("KVM_GET_SREGS"))?;
    set_long_mode_sregs(&mut sregs, cr3);
    vcpu.set_sregs(&sregs).map_err(ioctl_error("KVM_SET_SREGS"))
}

/// `KVM_SET_FPU` with [`boot_fpu`].
pub fn setup_fpu(vcpu: &VcpuFd) -> Result<(), Error> {
    vcpu.set_fpu(&boot_fpu())
        .map_err(ioctl_error("KVM_SET_FPU"))
}

/// LINT0 = ExtINT, LINT1 = NMI on the vCPU's in-kernel local APIC (needs
/// `KVM_CREATE_IRQCHIP` before the vCPU was created).
pub fn setup_lapic(vcpu: &VcpuFd) -> Result<(), Error> {
    let mut lapic = vcpu.get_lapic().map_err(ioctl_error("KVM_GET_LAPIC"))?;
    set_lvt_delivery_mode(&mut lapic, APIC_LVT_LINT0, APIC_MODE_EXTINT);
    set_lvt_delivery_mode(&mut lapic, APIC_LVT_LINT1, APIC_MODE_NMI);
    vcpu.set_lapic(&lapic).map_err(ioctl_error("KVM_SET_LAPIC"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regs_point_at_entry_zero_page_and_stack() {
        let regs = boot_regs(0x100_0200);

        assert_eq!((regs.rip, regs.rsi), (0x100_0200, 0x7000));
        assert_eq!((regs.rsp, regs.rbp, regs.rflags), (0x8ff0, 0x8ff0, 0x2));
    }

    #[test]
    fn sregs_enter_long_mode_with_flat_segments() {
        let mut sregs = kvm_sregs {
            apic_base: 0xfee0_0900,
            ..Default::default()
        };

        set_long_mode_sregs(&mut sregs, 0x9000);

        assert_eq!(sregs.cr0, 0x8000_0011);
        assert_eq!((sregs.cr3, sregs.cr4, sregs.efer), (0x9000, 0x20, 0x500));
        assert_eq!((sregs.cs.selector, sregs.cs.l), (0x08, 1));
        assert_eq!(
            (sregs.ss.selector, sregs.ds.selector, sregs.tr.selector),
            (0x10, 0x10, 0x18)
        );
        assert_eq!((sregs.gdt.base, sregs.gdt.limit), (0x500, 31));
        assert_eq!((sregs.idt.base, sregs.idt.limit), (0x520, 15));
        assert_eq!(sregs.apic_base, 0xfee0_0900, "reset-state field kept");
    }

    #[test]
    fn fpu_is_in_reset_configuration() {
        let fpu = boot_fpu();

        assert_eq!((fpu.fcw, fpu.mxcsr), (0x37f, 0x1f80));
    }

    #[test]
    fn lvt_delivery_mode_keeps_mask_and_vector_bits() {
        let mut lapic = kvm_lapic_state::default();
        set_lapic_reg(&mut lapic, APIC_LVT_LINT0, 0x0001_0000 | 0x0400 | 0x30);

        set_lvt_delivery_mode(&mut lapic, APIC_LVT_LINT0, APIC_MODE_EXTINT);
        set_lvt_delivery_mode(&mut lapic, APIC_LVT_LINT1, APIC_MODE_NMI);

        assert_eq!(lapic_reg(&lapic, APIC_LVT_LINT0), 0x0001_0730);
        assert_eq!(lapic_reg(&lapic, APIC_LVT_LINT1), 0x0400);
    }
}
