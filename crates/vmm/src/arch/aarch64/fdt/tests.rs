//! The device tree, parsed back with the `fdt` crate (an independent reader).

use ::fdt::node::FdtNode;
use ::fdt::Fdt;

use super::*;
use crate::arch::aarch64::layout::{GIC_DIST_BASE, GIC_REDIST_BASE};

const DEVICES: [VirtioMmioNode; 2] = [
    VirtioMmioNode {
        base: 0x0a00_0000,
        size: 0x1000,
        irq: 5,
    },
    VirtioMmioNode {
        base: 0x0a00_1000,
        size: 0x1000,
        irq: 6,
    },
];

fn config(vcpus: u8) -> FdtConfig<'static> {
    FdtConfig {
        vcpus,
        memory: (0x8000_0000, 256 << 20),
        cmdline: "console=ttyS0 reboot=k panic=1",
        initrd: Some((0x8f00_0000, 0x10_0000)),
        devices: &DEVICES,
    }
}

/// Big-endian u32 cells of a property.
fn cells(node: FdtNode<'_, '_>, name: &str) -> Vec<u32> {
    let value = node.property(name).unwrap().value;
    value
        .chunks_exact(4)
        .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Big-endian u64 values of a property.
fn u64s(node: FdtNode<'_, '_>, name: &str) -> Vec<u64> {
    cells(node, name)
        .chunks_exact(2)
        .map(|c| (u64::from(c[0]) << 32) | u64::from(c[1]))
        .collect()
}

fn text<'a>(node: FdtNode<'_, 'a>, name: &str) -> &'a str {
    node.property(name).unwrap().as_str().unwrap()
}

#[test]
fn blob_is_a_valid_device_tree() {
    let blob = build_fdt(&config(1)).unwrap();

    let fdt = Fdt::new(&blob).unwrap();

    assert_eq!(fdt.total_size(), blob.len());
    assert_eq!(fdt.root().compatible().first(), "linux,dummy-virt");
}

#[test]
fn memory_node_has_the_ram_range() {
    let blob = build_fdt(&config(1)).unwrap();
    let fdt = Fdt::new(&blob).unwrap();

    let memory = fdt.find_node("/memory@80000000").unwrap();

    assert_eq!(text(memory, "device_type"), "memory");
    assert_eq!(u64s(memory, "reg"), [0x8000_0000, 256 << 20]);
}

#[test]
fn one_psci_cpu_node_per_vcpu_with_its_mpidr() {
    let blob = build_fdt(&config(18)).unwrap();
    let fdt = Fdt::new(&blob).unwrap();

    let cpus: Vec<_> = fdt.find_node("/cpus").unwrap().children().collect();

    assert_eq!(cpus.len(), 18);
    assert!(cpus.iter().all(|cpu| text(*cpu, "enable-method") == "psci"));
    assert_eq!(u64s(cpus[1], "reg"), [1]);
    assert_eq!(u64s(cpus[17], "reg"), [0x101]);
    assert_eq!(cpus[17].name, "cpu@101");
}

#[test]
fn psci_is_version_0_2_over_hvc() {
    let blob = build_fdt(&config(2)).unwrap();
    let fdt = Fdt::new(&blob).unwrap();

    let psci = fdt.find_node("/psci").unwrap();

    assert_eq!(text(psci, "compatible"), "arm,psci-0.2");
    assert_eq!(text(psci, "method"), "hvc");
}

#[test]
fn gic_node_has_distributor_and_redistributors_for_each_vcpu() {
    let blob = build_fdt(&config(4)).unwrap();
    let fdt = Fdt::new(&blob).unwrap();

    let gic = fdt.find_compatible(&["arm,gic-v3"]).unwrap();

    assert_eq!(
        u64s(gic, "reg"),
        [GIC_DIST_BASE, 0x1_0000, GIC_REDIST_BASE, 4 * 0x2_0000]
    );
    assert!(gic.property("interrupt-controller").is_some());
    assert_eq!(gic.interrupt_cells(), Some(3));
    assert_eq!(cells(gic, "phandle"), [GIC_PHANDLE]);
    assert_eq!(
        cells(fdt.find_node("/").unwrap(), "interrupt-parent"),
        [GIC_PHANDLE]
    );
}

#[test]
fn timer_has_the_four_architected_ppis() {
    let blob = build_fdt(&config(1)).unwrap();
    let fdt = Fdt::new(&blob).unwrap();

    let timer = fdt.find_compatible(&["arm,armv8-timer"]).unwrap();

    let ppis: Vec<u32> = cells(timer, "interrupts").chunks(3).map(|c| c[1]).collect();
    assert_eq!(ppis, [13, 14, 11, 10]);
}

#[test]
fn serial_node_matches_the_emulated_uart() {
    let blob = build_fdt(&config(1)).unwrap();
    let fdt = Fdt::new(&blob).unwrap();

    let uart = fdt.find_compatible(&["ns16550a"]).unwrap();

    assert_eq!(u64s(uart, "reg"), [SERIAL_BASE, SERIAL_SIZE]);
    assert_eq!(
        cells(uart, "interrupts"),
        [IRQ_TYPE_SPI, SERIAL_IRQ, IRQ_EDGE_RISING]
    );
    assert_eq!(fdt.chosen().stdout().unwrap().name, uart.name);
}

#[test]
fn each_virtio_device_has_a_node_with_its_spi() {
    let blob = build_fdt(&config(1)).unwrap();
    let fdt = Fdt::new(&blob).unwrap();

    let second = fdt.find_node("/virtio_mmio@a001000").unwrap();

    assert_eq!(text(second, "compatible"), "virtio,mmio");
    assert_eq!(u64s(second, "reg"), [0x0a00_1000, 0x1000]);
    assert_eq!(
        cells(second, "interrupts"),
        [IRQ_TYPE_SPI, 6, IRQ_EDGE_RISING]
    );
    assert_eq!(fdt.find_all_nodes("/virtio_mmio").count(), 2);
}

#[test]
fn chosen_has_bootargs_and_the_initrd_range() {
    let blob = build_fdt(&config(1)).unwrap();
    let fdt = Fdt::new(&blob).unwrap();

    let chosen = fdt.find_node("/chosen").unwrap();

    assert_eq!(
        fdt.chosen().bootargs(),
        Some("console=ttyS0 reboot=k panic=1")
    );
    assert_eq!(u64s(chosen, "linux,initrd-start"), [0x8f00_0000]);
    assert_eq!(u64s(chosen, "linux,initrd-end"), [0x8f10_0000]);
}

#[test]
fn no_initrd_means_no_initrd_properties() {
    let without = FdtConfig {
        initrd: None,
        ..config(1)
    };
    let blob = build_fdt(&without).unwrap();
    let fdt = Fdt::new(&blob).unwrap();

    let chosen = fdt.find_node("/chosen").unwrap();

    assert!(chosen.property("linux,initrd-start").is_none());
}

#[test]
fn zero_vcpus_is_an_error() {
    let err = build_fdt(&config(0)).unwrap_err();

    assert!(matches!(err, Error::Gic(gic::Error::VcpuCount(0))));
}

#[test]
fn mpidr_splits_the_index_into_affinity_levels() {
    assert_eq!(vcpu_mpidr(0), 0);
    assert_eq!(vcpu_mpidr(15), 0xf);
    assert_eq!(vcpu_mpidr(16), 0x100);
    assert_eq!(vcpu_mpidr(122), 0x70a);
}
