//! Guest physical memory layout of an aarch64 microVM.
//!
//! Devices live in the first 2 GiB of the physical address space and RAM starts at 2 GiB, as on
//! QEMU's `virt` machine and most arm64 boards; the kernel finds both in the device tree. All
//! addresses are guest physical addresses (GPAs) in bytes.
//!
//! ```text
//! 0x0800_0000  GICv3 distributor (64 KiB)
//! 0x080a_0000  GICv3 redistributors, 128 KiB per vCPU, up to 0x0900_0000
//! 0x0900_0000  16550 UART (ns16550a, 4 KiB window)
//! 0x0a00_0000  virtio-mmio devices, 4 KiB each
//! 0x8000_0000  RAM: kernel Image (2 MiB aligned) ... initramfs, device tree (top 2 MiB)
//! ```

/// GPA of the GICv3 distributor (GICD) registers.
pub const GIC_DIST_BASE: u64 = 0x0800_0000;

/// Size in bytes of the GICv3 distributor register frame (64 KiB, GICv3 architecture
/// specification, section 12.1).
pub const GIC_DIST_SIZE: u64 = 0x1_0000;

/// GPA of the first GICv3 redistributor; vCPU `n`'s is at `GIC_REDIST_BASE + n * GIC_REDIST_SIZE`.
pub const GIC_REDIST_BASE: u64 = 0x080a_0000;

/// Size in bytes of one vCPU's redistributor: the RD_base and SGI_base frames, 64 KiB each.
pub const GIC_REDIST_SIZE: u64 = 0x2_0000;

/// End (exclusive GPA) of the space reserved for redistributors.
pub const GIC_REDIST_END: u64 = SERIAL_BASE;

/// GPA of the 16550-compatible UART (the `ttyS0` console), on the MMIO bus.
pub const SERIAL_BASE: u64 = 0x0900_0000;

/// Size in bytes of the UART's MMIO window (one page; the device decodes 8 registers).
pub const SERIAL_SIZE: u64 = 0x1000;

/// Shared peripheral interrupt (SPI) number of the UART; also its KVM GSI (with KVM's default
/// routing, GSI `n` is SPI `n`, interrupt ID `32 + n`).
pub const SERIAL_IRQ: u32 = 4;

/// GPA of the first virtio-mmio device window; device `n` sits at
/// `MMIO_BASE + n * MMIO_DEVICE_SIZE`.
pub const MMIO_BASE: u64 = 0x0a00_0000;

/// Whether virtio-mmio devices are announced on the kernel command line: no, the device tree
/// lists them with their GIC SPIs (a command-line IRQ would be read as a Linux IRQ number).
pub const VIRTIO_MMIO_ON_CMDLINE: bool = false;

/// Size in bytes of the MMIO window of one virtio-mmio device (one 4 KiB page).
pub const MMIO_DEVICE_SIZE: u64 = 0x1000;

/// First SPI (and KVM GSI) free for virtio-mmio devices; the ones below belong to the UART.
pub const IRQ_BASE: u32 = 5;

/// Interrupt IDs the in-kernel GIC implements: 32 private (SGIs and PPIs) plus the SPIs. A
/// multiple of 32, as `KVM_DEV_ARM_VGIC_GRP_NR_IRQS` requires.
pub const GIC_NR_IRQS: u32 = 128;

/// Number of private interrupt IDs (16 SGIs + 16 PPIs) before the first SPI.
pub const GIC_NR_PRIVATE_IRQS: u32 = 32;

/// Last SPI (and KVM GSI) usable by devices.
pub const IRQ_MAX: u32 = GIC_NR_IRQS - GIC_NR_PRIVATE_IRQS - 1;

/// GPA where guest RAM starts (2 GiB), above every device window.
pub const DRAM_BASE: u64 = 0x8000_0000;

/// Alignment in bytes of the base the kernel `Image` is loaded at, `text_offset` below it
/// (Documentation/arch/arm64/booting.rst, "Call the kernel image").
pub const KERNEL_ALIGN: u64 = 2 << 20;

/// Most bytes the flattened device tree may take (booting.rst: "must not exceed 2 megabytes").
pub const FDT_MAX_SIZE: u64 = 2 << 20;

/// Maximum size of the kernel command line in bytes including its NUL (arm64
/// `COMMAND_LINE_SIZE`).
pub const CMDLINE_MAX_SIZE: usize = 2048;

/// Command line used when the user gives none: console on the 16550 UART (`ttyS0`, found
/// through the device tree) and a reboot 1 s after a panic; reboot and power-off go through
/// PSCI.
pub const DEFAULT_CMDLINE: &str = "console=ttyS0 panic=1";

/// Size of one page in bytes (4 KiB), the alignment of the initramfs.
pub const PAGE_SIZE: u64 = 0x1000;

/// Most vCPUs a guest may have: as many redistributors as fit below [`GIC_REDIST_END`].
pub const MAX_VCPUS: u8 = ((GIC_REDIST_END - GIC_REDIST_BASE) / GIC_REDIST_SIZE) as u8;

// Layout invariants, checked at compile time.
const _: () = assert!(GIC_DIST_BASE + GIC_DIST_SIZE <= GIC_REDIST_BASE);
const _: () = assert!(SERIAL_BASE + SERIAL_SIZE <= MMIO_BASE);
const _: () = assert!(SERIAL_IRQ < IRQ_BASE);
const _: () = assert!(GIC_NR_IRQS % 32 == 0);
const _: () = assert!(MMIO_BASE + (IRQ_MAX - IRQ_BASE + 1) as u64 * MMIO_DEVICE_SIZE <= DRAM_BASE);
const _: () = assert!(DRAM_BASE % KERNEL_ALIGN == 0);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redistributor_space_holds_max_vcpus() {
        let end = GIC_REDIST_BASE + u64::from(MAX_VCPUS) * GIC_REDIST_SIZE;

        assert!(end <= GIC_REDIST_END);
        assert_eq!(MAX_VCPUS, 123);
    }

    #[test]
    fn virtio_interrupts_are_spis_the_gic_implements() {
        let highest_intid = GIC_NR_PRIVATE_IRQS + IRQ_MAX;

        assert_eq!(highest_intid, GIC_NR_IRQS - 1);
    }
}
