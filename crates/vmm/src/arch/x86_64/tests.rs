//! Tests of the public x86_64 entry points, including one against `/dev/kvm`.

use kvm_bindings::{kvm_msr_entry, kvm_userspace_memory_region, Msrs, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::Kvm;
use linux_loader::loader::bootparam::boot_params;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemory, GuestMemoryMmap, GuestMemoryRegion};

use super::layout::{CMDLINE_START, LAPIC_START, MMIO_GAP_START, MPTABLE_START, ZERO_PAGE_START};
use super::*;

fn boot_info(initrd: Option<(GuestAddress, usize)>) -> BootInfo {
    BootInfo {
        cmdline_addr: GuestAddress(CMDLINE_START),
        cmdline_size: 32,
        initrd,
        setup_header: None,
    }
}

fn memory(size: u64) -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&arch_memory_regions(size)).unwrap()
}

#[test]
fn configure_system_writes_zero_page_and_mp_table_for_5_gib() {
    let mem = memory(5 << 30);
    let initrd = (GuestAddress(MMIO_GAP_START - 0x10_0000), 0x10_0000);

    configure_system(&mem, &boot_info(Some(initrd)), 4).unwrap();

    let params: boot_params = mem.read_obj(GuestAddress(ZERO_PAGE_START)).unwrap();
    let table = params.e820_table;
    let entries: Vec<(u64, u64)> = table[..params.e820_entries as usize]
        .iter()
        .map(|e| (e.addr, e.size))
        .collect();
    assert_eq!(entries.len(), 4);
    assert!(entries
        .iter()
        .all(|&(addr, size)| addr + size <= MMIO_GAP_START || addr >= 1 << 32));
    assert_eq!({ params.hdr.ramdisk_image }, 0xcff0_0000);
    let signature: [u8; 4] = mem.read_obj(GuestAddress(MPTABLE_START)).unwrap();
    assert_eq!(&signature, b"_MP_");
}

#[test]
fn configure_system_rejects_zero_vcpus() {
    let mem = memory(128 << 20);

    let err = configure_system(&mem, &boot_info(None), 0).unwrap_err();

    assert!(
        matches!(err, Error::MpTable(mptable::Error::VcpuCount(0))),
        "{err}"
    );
}

#[test]
fn configure_system_needs_memory_below_1_mib() {
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x8000)]).unwrap();

    assert!(configure_system(&mem, &boot_info(None), 1).is_err());
}

/// Opens `/dev/kvm`. These tests need it (read-write), as every guest-level test does; any KVM
/// works, kvm_pvm included, since no guest runs.
fn kvm() -> Kvm {
    Kvm::new().unwrap_or_else(|e| panic!("cannot open /dev/kvm read-write: {e}"))
}

#[test]
fn configure_vcpu_sets_boot_state_in_kvm() {
    let kvm = kvm();
    let vm = kvm.create_vm().unwrap();
    vm.create_irq_chip().unwrap();
    let mem = memory(128 << 20);
    for (slot, region) in mem.iter().enumerate() {
        let host = mem.get_host_address(region.start_addr()).unwrap();
        let kvm_region = kvm_userspace_memory_region {
            slot: slot as u32,
            guest_phys_addr: region.start_addr().raw_value(),
            memory_size: region.len(),
            userspace_addr: host as u64,
            flags: 0,
        };
        // SAFETY: the region is a live mapping owned by `mem`, which outlives `vm`.
        unsafe { vm.set_user_memory_region(kvm_region).unwrap() };
    }
    let vcpu = vm.create_vcpu(0).unwrap();
    let supported = kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES).unwrap();

    configure_vcpu(&vcpu, &supported, 0, 1, GuestAddress(0x100_0200), &mem).unwrap();

    let regs = vcpu.get_regs().unwrap();
    let sregs = vcpu.get_sregs().unwrap();
    assert_eq!(
        (regs.rip, regs.rsi, regs.rsp),
        (0x100_0200, ZERO_PAGE_START, 0x8ff0)
    );
    assert_eq!(
        sregs.cr0 & 0x8000_0011,
        0x8000_0011,
        "CR0 PE|ET|PG: {:#x}",
        sregs.cr0
    );
    assert_eq!(sregs.cr3, layout::PML4_START);
    assert_eq!(sregs.efer & 0x500, 0x500, "EFER LME|LMA: {:#x}", sregs.efer);
    assert_eq!((sregs.cs.selector, sregs.cs.l), (0x8, 1));
    let lapic = vcpu.get_lapic().unwrap();
    let lint0 = regs::lapic_reg(&lapic, regs::APIC_LVT_LINT0);
    let lint1 = regs::lapic_reg(&lapic, regs::APIC_LVT_LINT1);
    assert_eq!(((lint0 >> 8) & 0x7, (lint1 >> 8) & 0x7), (0b111, 0b100));
    let mut msrs = Msrs::from_entries(&[kvm_msr_entry {
        index: msr::MSR_MTRR_DEF_TYPE,
        ..Default::default()
    }])
    .unwrap();
    assert_eq!(vcpu.get_msrs(&mut msrs).unwrap(), 1);
    assert_eq!(msrs.as_slice()[0].data, 0x806);
    let cpuid = vcpu.get_cpuid2(KVM_MAX_CPUID_ENTRIES).unwrap();
    let leaf1 = cpuid.as_slice().iter().find(|e| e.function == 1).unwrap();
    assert_ne!(leaf1.ecx & cpuid::ECX_HYPERVISOR, 0);
    assert_ne!(leaf1.ecx & cpuid::ECX_TSC_DEADLINE, 0);
    assert_eq!(sregs.apic_base & !0xfff, LAPIC_START);
}

#[test]
fn configure_vcpu_rejects_a_vcpu_outside_the_vm() {
    let kvm = kvm();
    let vm = kvm.create_vm().unwrap();
    vm.create_irq_chip().unwrap();
    let vcpu = vm.create_vcpu(0).unwrap();
    let supported = kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES).unwrap();
    let mem = memory(16 << 20);

    let err = configure_vcpu(&vcpu, &supported, 1, 1, GuestAddress(0x100_0000), &mem).unwrap_err();

    assert!(err.to_string().contains("vCPU 1 of 1"), "{err}");
}
