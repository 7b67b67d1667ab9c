//! The flattened device tree (FDT) an arm64 guest kernel discovers its hardware from.
//!
//! Built with `vm-fdt`; the bindings followed are the kernel's
//! Documentation/devicetree/bindings: `arm/cpus.yaml` (MPIDR as `reg`), `arm/psci.yaml`,
//! `interrupt-controller/arm,gic-v3.yaml`, `timer/arm,arch_timer.yaml`,
//! `serial/8250.yaml` and `virtio/mmio.yaml`; `chosen` per `chosen.yaml`.
//!
//! Interrupt specifiers have three cells: type (0 = SPI, 1 = PPI), number within that type,
//! trigger flags.

use vm_fdt::{FdtWriter, FdtWriterResult};

use super::gic::{self, GicRegions};
use super::layout::{FDT_MAX_SIZE, SERIAL_BASE, SERIAL_IRQ, SERIAL_SIZE};

/// phandle of the GIC node, the interrupt parent of every device.
const GIC_PHANDLE: u32 = 1;
/// Interrupt specifier type of a shared peripheral interrupt.
const IRQ_TYPE_SPI: u32 = 0;
/// Interrupt specifier type of a private peripheral interrupt.
const IRQ_TYPE_PPI: u32 = 1;
/// Trigger flag: rising edge (irqfd injections are edges).
const IRQ_EDGE_RISING: u32 = 1;
/// Trigger flag: active-high level.
const IRQ_LEVEL_HIGH: u32 = 4;
/// PPI of the GIC's virtual CPU interface maintenance interrupt.
const GIC_MAINTENANCE_PPI: u32 = 9;
/// PPIs of the architected timer, in the binding's order: secure physical, non-secure physical,
/// virtual, hypervisor.
const TIMER_PPIS: [u32; 4] = [13, 14, 11, 10];
/// Input clock of the 16550 UART in Hz (the PC standard 1.8432 MHz); the divisor the kernel
/// computes from it is ignored by the emulated device.
const UART_CLOCK_HZ: u32 = 1_843_200;

/// Errors building the device tree.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The GIC cannot be laid out for this many vCPUs.
    #[error(transparent)]
    Gic(#[from] gic::Error),
    /// vm-fdt refused a node or property.
    #[error("cannot build the device tree: {0}")]
    Write(#[from] vm_fdt::Error),
    /// The tree is larger than the boot protocol allows.
    #[error("the device tree is {0} bytes, more than the 2 MiB the arm64 boot protocol allows")]
    TooBig(usize),
}

/// One virtio-mmio device as the guest sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VirtioMmioNode {
    /// GPA of its register window.
    pub base: u64,
    /// Size of the window in bytes.
    pub size: u64,
    /// Its SPI number (= KVM GSI).
    pub irq: u32,
}

/// What the device tree describes.
#[derive(Debug, Clone, Copy)]
pub struct FdtConfig<'a> {
    /// Number of vCPUs.
    pub vcpus: u8,
    /// Guest RAM: start GPA and size in bytes.
    pub memory: (u64, u64),
    /// The kernel command line, without NUL.
    pub cmdline: &'a str,
    /// The initramfs: start GPA and size in bytes.
    pub initrd: Option<(u64, u64)>,
    /// The virtio-mmio devices, in the order the guest should probe them.
    pub devices: &'a [VirtioMmioNode],
}

/// The MPIDR_EL1 affinity KVM gives vCPU `id` (Aff0 = bits 0-3 of the index, Aff1 = bits 4-11),
/// which is the `reg` of its `cpu` node.
pub fn vcpu_mpidr(id: u8) -> u64 {
    let id = u64::from(id);
    (id & 0xf) | ((id >> 4) << 8)
}

/// Builds the device tree blob for `config`.
///
/// # Errors
/// [`Error::Gic`] for a vCPU count the GIC cannot serve, [`Error::Write`], [`Error::TooBig`].
pub fn build_fdt(config: &FdtConfig<'_>) -> Result<Vec<u8>, Error> {
    let gic = gic::gic_regions(config.vcpus)?;
    let mut fdt = FdtWriter::new()?;
    let root = fdt.begin_node("")?;
    fdt.property_string("compatible", "linux,dummy-virt")?;
    fdt.property_u32("#address-cells", 2)?;
    fdt.property_u32("#size-cells", 2)?;
    fdt.property_u32("interrupt-parent", GIC_PHANDLE)?;
    write_cpus(&mut fdt, config.vcpus)?;
    write_memory(&mut fdt, config.memory)?;
    write_psci(&mut fdt)?;
    write_gic(&mut fdt, &gic)?;
    write_timer(&mut fdt)?;
    write_serial(&mut fdt)?;
    for device in config.devices {
        write_virtio_mmio(&mut fdt, device)?;
    }
    write_chosen(&mut fdt, config.cmdline, config.initrd)?;
    fdt.end_node(root)?;
    let blob = fdt.finish()?;
    if blob.len() as u64 > FDT_MAX_SIZE {
        return Err(Error::TooBig(blob.len()));
    }
    Ok(blob)
}

/// `/cpus`, one `cpu@<mpidr>` per vCPU, brought up through PSCI.
fn write_cpus(fdt: &mut FdtWriter, vcpus: u8) -> FdtWriterResult<()> {
    let cpus = fdt.begin_node("cpus")?;
    fdt.property_u32("#address-cells", 2)?;
    fdt.property_u32("#size-cells", 0)?;
    for id in 0..vcpus {
        let mpidr = vcpu_mpidr(id);
        let cpu = fdt.begin_node(&format!("cpu@{mpidr:x}"))?;
        fdt.property_string("device_type", "cpu")?;
        fdt.property_string("compatible", "arm,arm-v8")?;
        fdt.property_string("enable-method", "psci")?;
        fdt.property_u64("reg", mpidr)?;
        fdt.end_node(cpu)?;
    }
    fdt.end_node(cpus)
}

/// `/memory@<base>` with the one RAM range.
fn write_memory(fdt: &mut FdtWriter, (base, size): (u64, u64)) -> FdtWriterResult<()> {
    let memory = fdt.begin_node(&format!("memory@{base:x}"))?;
    fdt.property_string("device_type", "memory")?;
    fdt.property_array_u64("reg", &[base, size])?;
    fdt.end_node(memory)
}

/// `/psci`: PSCI 0.2 through HVC (KVM implements it for `KVM_ARM_VCPU_PSCI_0_2` vCPUs).
fn write_psci(fdt: &mut FdtWriter) -> FdtWriterResult<()> {
    let psci = fdt.begin_node("psci")?;
    fdt.property_string("compatible", "arm,psci-0.2")?;
    fdt.property_string("method", "hvc")?;
    fdt.end_node(psci)
}

/// `/intc@<dist>`: the GICv3, distributor then redistributor region.
fn write_gic(fdt: &mut FdtWriter, gic: &GicRegions) -> FdtWriterResult<()> {
    let intc = fdt.begin_node(&format!("intc@{:x}", gic.dist.base))?;
    fdt.property_string("compatible", "arm,gic-v3")?;
    fdt.property_null("interrupt-controller")?;
    fdt.property_u32("#interrupt-cells", 3)?;
    fdt.property_array_u64(
        "reg",
        &[
            gic.dist.base,
            gic.dist.size,
            gic.redist.base,
            gic.redist.size,
        ],
    )?;
    fdt.property_u32("#address-cells", 2)?;
    fdt.property_u32("#size-cells", 2)?;
    fdt.property_null("ranges")?;
    fdt.property_array_u32(
        "interrupts",
        &[IRQ_TYPE_PPI, GIC_MAINTENANCE_PPI, IRQ_LEVEL_HIGH],
    )?;
    fdt.property_phandle(GIC_PHANDLE)?;
    fdt.end_node(intc)
}

/// `/timer`: the architected timer's four PPIs.
fn write_timer(fdt: &mut FdtWriter) -> FdtWriterResult<()> {
    let timer = fdt.begin_node("timer")?;
    fdt.property_string("compatible", "arm,armv8-timer")?;
    fdt.property_null("always-on")?;
    let cells: Vec<u32> = TIMER_PPIS
        .iter()
        .flat_map(|&ppi| [IRQ_TYPE_PPI, ppi, IRQ_LEVEL_HIGH])
        .collect();
    fdt.property_array_u32("interrupts", &cells)?;
    fdt.end_node(timer)
}

/// The path of the UART node, `chosen/stdout-path`.
fn serial_path() -> String {
    format!("/uart@{SERIAL_BASE:x}")
}

/// `/uart@<base>`: the 16550 the VMM emulates on the MMIO bus, byte-wide registers.
fn write_serial(fdt: &mut FdtWriter) -> FdtWriterResult<()> {
    let uart = fdt.begin_node(&serial_path()[1..])?;
    fdt.property_string("compatible", "ns16550a")?;
    fdt.property_array_u64("reg", &[SERIAL_BASE, SERIAL_SIZE])?;
    fdt.property_u32("clock-frequency", UART_CLOCK_HZ)?;
    fdt.property_array_u32("interrupts", &[IRQ_TYPE_SPI, SERIAL_IRQ, IRQ_EDGE_RISING])?;
    fdt.end_node(uart)
}

/// `/virtio_mmio@<base>` for one device.
fn write_virtio_mmio(fdt: &mut FdtWriter, device: &VirtioMmioNode) -> FdtWriterResult<()> {
    let node = fdt.begin_node(&format!("virtio_mmio@{:x}", device.base))?;
    fdt.property_string("compatible", "virtio,mmio")?;
    fdt.property_array_u64("reg", &[device.base, device.size])?;
    fdt.property_array_u32("interrupts", &[IRQ_TYPE_SPI, device.irq, IRQ_EDGE_RISING])?;
    fdt.property_null("dma-coherent")?;
    fdt.end_node(node)
}

/// `/chosen`: command line, initramfs range (end exclusive) and console.
fn write_chosen(
    fdt: &mut FdtWriter,
    cmdline: &str,
    initrd: Option<(u64, u64)>,
) -> FdtWriterResult<()> {
    let chosen = fdt.begin_node("chosen")?;
    fdt.property_string("bootargs", cmdline)?;
    if let Some((start, size)) = initrd {
        fdt.property_u64("linux,initrd-start", start)?;
        fdt.property_u64("linux,initrd-end", start + size)?;
    }
    fdt.property_string("stdout-path", &serial_path())?;
    fdt.end_node(chosen)
}

#[cfg(test)]
mod tests;
