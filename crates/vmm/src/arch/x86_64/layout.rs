//! Guest physical memory layout of an x86_64 microVM.
//!
//! Everything the VMM places in guest memory before the first instruction runs lives below
//! 1 MiB, where a PC's firmware would keep its data; the kernel goes to 1 MiB and up. All
//! addresses here are guest physical addresses (GPAs) in bytes.
//!
//! ```text
//! 0x0000_0500  GDT (4 descriptors)            0x0000_9000  PML4
//! 0x0000_0520  IDT (one null gate)            0x0000_a000  PDPT
//! 0x0000_7000  boot_params ("zero page")      0x0000_b000  PD (512 x 2 MiB = first 1 GiB)
//! 0x0000_8ff0  boot stack pointer (grows down) 0x0002_0000  kernel command line (<= 2 KiB)
//! 0x0009_fc00  EBDA: MP table ... 1 MiB reserved (not RAM in the e820 map)
//! 0x0010_0000  kernel (HIMEM_START) ... RAM ... initramfs at the top of low RAM
//! 0xd000_0000  32-bit MMIO gap (768 MiB): virtio-mmio devices, then IOAPIC, LAPIC
//! 0x1_0000_0000  RAM continues above 4 GiB when the guest has more than 3.25 GiB
//! ```

/// GPA of the Global Descriptor Table (bytes). Holds [`GDT_ENTRIES`] 8-byte descriptors.
pub const GDT_START: u64 = 0x500;

/// Number of descriptors in the boot GDT: null, 64-bit code, data, TSS.
pub const GDT_ENTRIES: usize = 4;

/// GPA of the boot Interrupt Descriptor Table (bytes), right after the GDT.
///
/// It holds a single zeroed 16-byte gate: any exception before the kernel installs its own
/// IDT ends in a triple fault (a clean vCPU shutdown) rather than running garbage.
pub const IDT_START: u64 = 0x520;

/// Size of the boot IDT in bytes (one 64-bit mode gate).
pub const IDT_SIZE: u64 = 16;

/// GPA of `struct boot_params`, the "zero page" of the Linux boot protocol (4 KiB).
///
/// Its address is handed to the kernel in RSI (Documentation/x86/boot.rst, protocol 2.15,
/// "64-bit Boot Protocol").
pub const ZERO_PAGE_START: u64 = 0x7000;

/// Initial stack pointer (RSP and RBP) of every vCPU, a GPA in bytes.
///
/// The stack grows down from just below the PML4 page into otherwise unused low memory.
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;

/// GPA of the level-4 page map (PML4), the value loaded into CR3 (4 KiB page).
pub const PML4_START: u64 = 0x9000;

/// GPA of the page-directory-pointer table (PDPT) referenced by PML4 entry 0 (4 KiB page).
pub const PDPT_START: u64 = 0xa000;

/// GPA of the page directory (PD) referenced by PDPT entry 0 (4 KiB page).
///
/// Its 512 entries map the first 1 GiB of guest memory 1:1 with 2 MiB pages, which covers the
/// zero page, the command line and the kernel as the 64-bit boot protocol requires.
pub const PD_START: u64 = 0xb000;

/// Bytes of guest memory identity-mapped by the boot page tables (1 GiB).
pub const IDENTITY_MAP_SIZE: u64 = 1 << 30;

/// GPA of the kernel command line (bytes), referenced by `boot_params.hdr.cmd_line_ptr`.
pub const CMDLINE_START: u64 = 0x20000;

/// Maximum size of the kernel command line in bytes, including its terminating NUL.
///
/// This is Linux's x86 `COMMAND_LINE_SIZE` (2048); the kernel truncates anything longer.
pub const CMDLINE_MAX_SIZE: usize = 2048;

/// Command line used when the user gives none: serial console on the first UART, reboot via
/// the keyboard controller's reset line (the VMM turns it into a VM exit), reboot 1 s after a
/// panic, no module loading, and an i8042 probe that does not wait for devices that are not
/// there.
pub const DEFAULT_CMDLINE: &str =
    "console=ttyS0 reboot=k panic=1 nomodule i8042.noaux i8042.nomux i8042.nopnp i8042.dumbkbd";

/// GPA of the Extended BIOS Data Area (bytes): 1 KiB below 640 KiB, where the MP floating
/// pointer is searched for (MultiProcessor Specification 1.4, section 4).
///
/// From here up to [`HIMEM_START`] the e820 map reports memory as reserved, not RAM.
pub const EBDA_START: u64 = 0x9fc00;

/// GPA where the MP table (floating pointer followed by the configuration table) is written.
pub const MPTABLE_START: u64 = EBDA_START;

/// Start of "high memory" (1 MiB), the lowest GPA the kernel may be loaded at.
pub const HIMEM_START: u64 = 0x10_0000;

/// Start of the 32-bit MMIO gap (GPA, bytes): no guest RAM between here and 4 GiB.
pub const MMIO_GAP_START: u64 = 0xd000_0000;

/// End of the 32-bit MMIO gap (exclusive; 4 GiB): guest RAM resumes here if the guest has more
/// memory than fits below the gap.
pub const MMIO_GAP_END: u64 = 1 << 32;

/// Size of the 32-bit MMIO gap in bytes (768 MiB).
pub const MMIO_GAP_SIZE: u64 = MMIO_GAP_END - MMIO_GAP_START;

/// GPA of the first virtio-mmio device window; device `n` sits at
/// `MMIO_BASE + n * MMIO_DEVICE_SIZE`.
pub const MMIO_BASE: u64 = MMIO_GAP_START;

/// Whether virtio-mmio devices are announced on the kernel command line
/// (`virtio_mmio.device=4K@GPA:IRQ`): x86_64 guests have no device tree to find them in.
pub const VIRTIO_MMIO_ON_CMDLINE: bool = true;

/// Size in bytes of the MMIO window of one virtio-mmio device (one 4 KiB page).
pub const MMIO_DEVICE_SIZE: u64 = 0x1000;

/// GPA of the IOAPIC's MMIO registers (the in-kernel IOAPIC that `KVM_CREATE_IRQCHIP` makes).
pub const IOAPIC_START: u64 = 0xfec0_0000;

/// GPA of the local APIC's MMIO registers (the architectural default `IA32_APIC_BASE`).
pub const LAPIC_START: u64 = 0xfee0_0000;

/// First legacy IRQ (IOAPIC pin / GSI) free for virtio-mmio devices.
///
/// IRQ 0-4 are taken by the PIT, keyboard, cascade and the two serial ports.
pub const IRQ_BASE: u32 = 5;

/// Last legacy IRQ (IOAPIC pin / GSI) usable by devices: the in-kernel IOAPIC has 24 pins.
pub const IRQ_MAX: u32 = 23;

/// Number of IOAPIC input pins (IRQs 0..=23) listed in the MP table.
pub const IOAPIC_PINS: u8 = 24;

/// Most vCPUs a guest may have.
///
/// Bounded by what the CPUID topology fields can express (CPUID.1:EBX\[23:16\] holds the
/// logical processor count rounded up to a power of two in 8 bits) and by the MP table, which
/// must end below 1 MiB. APIC IDs are `0..nr_vcpus`; the IOAPIC takes ID `nr_vcpus`.
pub const MAX_VCPUS: u8 = 128;

/// Size of one page in bytes (4 KiB), the alignment of the initramfs.
pub const PAGE_SIZE: u64 = 0x1000;

// Layout invariants, checked at compile time.
const _: () = assert!(BOOT_STACK_POINTER > ZERO_PAGE_START + PAGE_SIZE);
const _: () = assert!(BOOT_STACK_POINTER < PML4_START);
const _: () = assert!(MMIO_GAP_SIZE == 768 << 20);
const _: () = assert!(IOAPIC_START >= MMIO_GAP_START && LAPIC_START < MMIO_GAP_END);
const _: () = assert!(IRQ_MAX < IOAPIC_PINS as u32);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boot_structures_do_not_overlap() {
        // Arrange: [start, end) of every structure placed below 1 MiB, in address order.
        let gdt_end = GDT_START + (GDT_ENTRIES as u64) * 8;
        let areas = [
            (GDT_START, gdt_end),
            (IDT_START, IDT_START + IDT_SIZE),
            (ZERO_PAGE_START, ZERO_PAGE_START + 0x1000),
            (PML4_START, PML4_START + 0x1000),
            (PDPT_START, PDPT_START + 0x1000),
            (PD_START, PD_START + 0x1000),
            (CMDLINE_START, CMDLINE_START + CMDLINE_MAX_SIZE as u64),
            (MPTABLE_START, HIMEM_START),
        ];

        // Act + Assert: each one ends before the next begins.
        for pair in areas.windows(2) {
            assert!(
                pair[0].1 <= pair[1].0,
                "{:#x?} overlaps {:#x?}",
                pair[0],
                pair[1]
            );
        }
    }
}
