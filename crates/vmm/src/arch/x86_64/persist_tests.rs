//! Tests of x86_64 VM and vCPU state save/restore against `/dev/kvm`. Any KVM works, kvm_pvm
//! included, since no guest runs.

use kvm_bindings::{
    kvm_msr_entry, kvm_pit_config, kvm_userspace_memory_region, Msrs, KVM_MAX_CPUID_ENTRIES,
    KVM_PIT_SPEAKER_DUMMY, KVM_VCPUEVENT_VALID_NMI_PENDING,
};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use vm_memory::{Address, GuestAddress, GuestMemory, GuestMemoryMmap, GuestMemoryRegion};

use super::*;
use crate::arch::x86_64::{arch_memory_regions, configure_vcpu, cpuid, msr};

/// GPA the configured vCPU starts at.
const ENTRY: u64 = 0x100_0200;

/// A VM built like the VMM builds one (irqchip, PIT2, RAM in memory slots) and its vCPU 0.
/// Fields drop in order: the vCPU and VM before the memory they map.
struct Guest {
    vcpu: VcpuFd,
    vm: VmFd,
    _mem: GuestMemoryMmap,
}

fn kvm() -> Kvm {
    Kvm::new().unwrap_or_else(|e| panic!("cannot open /dev/kvm read-write: {e}"))
}

/// A new VM with its vCPU created but not configured: what a restore starts from.
fn fresh_guest(kvm: &Kvm) -> Guest {
    let vm = kvm.create_vm().unwrap();
    vm.create_irq_chip().unwrap();
    let pit = kvm_pit_config {
        flags: KVM_PIT_SPEAKER_DUMMY,
        ..Default::default()
    };
    vm.create_pit2(pit).unwrap();
    let mem = GuestMemoryMmap::from_ranges(&arch_memory_regions(64 << 20)).unwrap();
    for (slot, region) in mem.iter().enumerate() {
        let region = kvm_userspace_memory_region {
            slot: slot as u32,
            guest_phys_addr: region.start_addr().raw_value(),
            memory_size: region.len(),
            userspace_addr: mem.get_host_address(region.start_addr()).unwrap() as u64,
            flags: 0,
        };
        // SAFETY: the region is a live mapping owned by `mem`, which outlives `vm` (`Guest`).
        unsafe { vm.set_user_memory_region(region).unwrap() };
    }
    let vcpu = vm.create_vcpu(0).unwrap();
    Guest {
        vcpu,
        vm,
        _mem: mem,
    }
}

/// A new VM whose vCPU is configured for the 64-bit boot entry, as at boot.
fn booted_guest(kvm: &Kvm) -> Guest {
    let guest = fresh_guest(kvm);
    let supported = kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES).unwrap();
    configure_vcpu(
        &guest.vcpu,
        &supported,
        0,
        1,
        GuestAddress(ENTRY),
        &guest._mem,
    )
    .unwrap();
    guest
}

fn set_msr(vcpu: &VcpuFd, index: u32, data: u64) {
    let msrs = Msrs::from_entries(&[kvm_msr_entry {
        index,
        data,
        ..Default::default()
    }])
    .unwrap();
    assert_eq!(vcpu.set_msrs(&msrs).unwrap(), 1, "MSR {index:#x}");
}

fn get_msr(vcpu: &VcpuFd, index: u32) -> u64 {
    let mut msrs = Msrs::from_entries(&[kvm_msr_entry {
        index,
        ..Default::default()
    }])
    .unwrap();
    assert_eq!(vcpu.get_msrs(&mut msrs).unwrap(), 1, "MSR {index:#x}");
    msrs.as_slice()[0].data
}

/// A booted guest with distinctive registers, KERNEL_GS_BASE and a pending NMI, saved.
fn saved_guest(kvm: &Kvm) -> (Guest, VmState, VcpuState) {
    let guest = booted_guest(kvm);
    let mut regs = guest.vcpu.get_regs().unwrap();
    (regs.rip, regs.rax, regs.r15) = (ENTRY + 0x34, 0x0bad_cafe_dead_beef, 0x1515);
    guest.vcpu.set_regs(&regs).unwrap();
    set_msr(&guest.vcpu, msr::MSR_KERNEL_GS_BASE, KERNEL_GS_BASE);
    let mut events = guest.vcpu.get_vcpu_events().unwrap();
    events.flags |= KVM_VCPUEVENT_VALID_NMI_PENDING;
    events.nmi.pending = 1;
    guest.vcpu.set_vcpu_events(&events).unwrap();
    let msr_list = saveable_msrs(kvm).unwrap();
    let vm_state = save_vm(&guest.vm).unwrap();
    let vcpu_state = save_vcpu(&guest.vcpu, &msr_list).unwrap();
    (guest, vm_state, vcpu_state)
}

/// A canonical kernel address, distinct from anything KVM or the boot set-up writes.
const KERNEL_GS_BASE: u64 = 0xffff_8880_1234_5000;

#[test]
fn restored_vcpu_has_the_saved_registers_msrs_and_events() {
    let kvm = kvm();
    let (_source, vm_state, vcpu_state) = saved_guest(&kvm);
    let target = fresh_guest(&kvm);

    restore_vm(&target.vm, &vm_state).unwrap();
    restore_vcpu(&target.vcpu, &vcpu_state).unwrap();

    let regs = target.vcpu.get_regs().unwrap();
    assert_eq!(
        (regs.rip, regs.rax, regs.r15),
        (ENTRY + 0x34, 0x0bad_cafe_dead_beef, 0x1515)
    );
    assert_eq!(regs, vcpu_state.regs);
    assert_eq!(target.vcpu.get_sregs().unwrap(), vcpu_state.sregs);
    assert_eq!(
        get_msr(&target.vcpu, msr::MSR_KERNEL_GS_BASE),
        KERNEL_GS_BASE
    );
    assert_eq!(get_msr(&target.vcpu, msr::MSR_MTRR_DEF_TYPE), 0x806);
    assert_eq!(target.vcpu.get_lapic().unwrap().regs, vcpu_state.lapic.regs);
    assert_eq!(target.vcpu.get_vcpu_events().unwrap().nmi.pending, 1);
    let cpuid = target.vcpu.get_cpuid2(KVM_MAX_CPUID_ENTRIES).unwrap();
    assert_eq!(cpuid.as_slice(), vcpu_state.cpuid.as_slice());
}

/// Puts MXCSR `mxcsr` and XMM0 bits 31:0 `xmm0` in `xsave` (the XSAVE legacy area: MXCSR at
/// bytes 24..28, XMM0 at 160; Intel SDM vol. 1 §10.5.1) and marks x87/SSE state present in
/// XSTATE_BV (byte 512), without which KVM_SET_XSAVE leaves them in their initial state.
fn set_sse_state(xsave: &mut [u32], mxcsr: u32, xmm0: u32) {
    (xsave[6], xsave[40]) = (mxcsr, xmm0);
    xsave[128] |= 0b11;
}

#[test]
fn restored_vcpu_has_the_saved_fpu_state() {
    let kvm = kvm();
    let (_source, vm_state, mut vcpu_state) = saved_guest(&kvm);
    set_sse_state(&mut vcpu_state.xsave, 0xff80, 0x1234_5678);
    let target = fresh_guest(&kvm);

    restore_vm(&target.vm, &vm_state).unwrap();
    restore_vcpu(&target.vcpu, &vcpu_state).unwrap();

    let resaved = save_vcpu(&target.vcpu, &[]).unwrap();
    assert_eq!((resaved.xsave[6], resaved.xsave[40]), (0xff80, 0x1234_5678));
    assert_eq!(resaved.xsave, vcpu_state.xsave);
    assert_eq!(resaved.xcrs.xcrs, vcpu_state.xcrs.xcrs);
}

#[test]
fn restore_vcpu_takes_an_xsave_area_larger_than_4096_bytes() {
    let kvm = kvm();
    let (_source, _, mut vcpu_state) = saved_guest(&kvm);
    set_sse_state(&mut vcpu_state.xsave, 0x9f80, 0xabcd);
    vcpu_state.xsave.resize(KVM_XSAVE_WORDS + 64, 0);
    let target = fresh_guest(&kvm);

    restore_vcpu(&target.vcpu, &vcpu_state).unwrap();

    let resaved = save_vcpu(&target.vcpu, &[]).unwrap();
    assert_eq!((resaved.xsave[6], resaved.xsave[40]), (0x9f80, 0xabcd));
}

#[test]
fn restore_vcpu_scales_the_tsc_or_keeps_the_hosts_rate() {
    let kvm = kvm();
    let (_source, _, mut vcpu_state) = saved_guest(&kvm);
    let host_khz = vcpu_state.tsc_khz.expect("KVM_GET_TSC_KHZ works");
    let wanted = host_khz / 2;
    let scales = fresh_guest(&kvm).vcpu.set_tsc_khz(wanted).is_ok();
    vcpu_state.tsc_khz = Some(wanted);
    let target = fresh_guest(&kvm);

    restore_vcpu(&target.vcpu, &vcpu_state).unwrap();

    let expected = if scales { wanted } else { host_khz };
    assert_eq!(target.vcpu.get_tsc_khz().unwrap(), expected);
}

#[test]
fn restore_vcpu_rejects_a_short_xsave_area() {
    let kvm = kvm();
    let (_source, _, mut vcpu_state) = saved_guest(&kvm);
    vcpu_state.xsave.truncate(100);
    let target = fresh_guest(&kvm);

    let err = restore_vcpu(&target.vcpu, &vcpu_state).unwrap_err();

    assert!(matches!(err, Error::XsaveLength(100)), "{err}");
}

#[test]
fn restored_vm_has_the_saved_pit_and_interrupt_controllers() {
    let kvm = kvm();
    let source = booted_guest(&kvm);
    let mut pit = source.vm.get_pit2().unwrap();
    pit.channels[0].count = 0x1234;
    pit.channels[0].mode = 2;
    source.vm.set_pit2(&pit).unwrap();
    source.vm.set_irq_line(4, true).unwrap();
    let saved = save_vm(&source.vm).unwrap();
    let target = fresh_guest(&kvm);
    let json = |chip| serde_json::to_value(chip).unwrap();
    let untouched = save_vm(&target.vm).unwrap();

    restore_vm(&target.vm, &saved).unwrap();

    let restored = save_vm(&target.vm).unwrap();
    assert_eq!(restored.pit2.channels[0].count, 0x1234);
    assert_eq!(restored.pit2.channels[0].mode, 2);
    assert_ne!(json(saved.ioapic), json(untouched.ioapic), "IRQ 4 raised");
    assert_eq!(json(restored.pic_master), json(saved.pic_master));
    assert_eq!(json(restored.pic_slave), json(saved.pic_slave));
    assert_eq!(json(restored.ioapic), json(saved.ioapic));
    assert!(restored.clock.clock >= saved.clock.clock);
}

#[test]
fn saved_state_survives_a_json_round_trip() {
    let kvm = kvm();
    let (_source, vm_state, vcpu_state) = saved_guest(&kvm);

    let vcpu_json = serde_json::to_string(&vcpu_state).unwrap();
    let vm_json = serde_json::to_string(&vm_state).unwrap();
    let vcpu_back: VcpuState = serde_json::from_str(&vcpu_json).unwrap();
    let vm_back: VmState = serde_json::from_str(&vm_json).unwrap();

    assert_eq!(vcpu_back.regs, vcpu_state.regs);
    assert_eq!(vcpu_back.sregs, vcpu_state.sregs);
    assert_eq!(vcpu_back.msrs.as_slice(), vcpu_state.msrs.as_slice());
    assert_eq!(vcpu_back.cpuid.as_slice(), vcpu_state.cpuid.as_slice());
    assert_eq!(vcpu_back.xsave, vcpu_state.xsave);
    assert_eq!(vcpu_back.lapic.regs, vcpu_state.lapic.regs);
    assert_eq!(vcpu_back.vcpu_events, vcpu_state.vcpu_events);
    assert_eq!(vcpu_back.tsc_khz, vcpu_state.tsc_khz);
    assert_eq!(vm_back.pit2, vm_state.pit2);
    assert_eq!(vm_back.clock, vm_state.clock);
    assert_eq!(serde_json::to_string(&vm_back).unwrap(), vm_json);
}

#[test]
fn saveable_msrs_restore_tsc_before_tsc_deadline() {
    let kvm = kvm();

    let msrs = saveable_msrs(&kvm).unwrap();

    let position = |index| msrs.iter().position(|&i| i == index);
    let tsc = position(msr::MSR_IA32_TSC).expect("IA32_TSC is saved");
    let deadline = position(MSR_IA32_TSC_DEADLINE).expect("IA32_TSC_DEADLINE is saved");
    assert!(tsc < deadline);
    assert!(msrs.contains(&msr::MSR_KERNEL_GS_BASE));
}

#[test]
fn save_vcpu_leaves_out_msrs_kvm_refuses() {
    let kvm = kvm();
    let guest = booted_guest(&kvm);
    set_msr(&guest.vcpu, msr::MSR_KERNEL_GS_BASE, KERNEL_GS_BASE);
    let list = [
        msr::MSR_IA32_TSC,
        0x4b56_4dff,
        msr::MSR_KERNEL_GS_BASE,
        0xdead_0000,
    ];

    let state = save_vcpu(&guest.vcpu, &list).unwrap();

    let saved: Vec<u32> = state.msrs.as_slice().iter().map(|e| e.index).collect();
    assert_eq!(saved, [msr::MSR_IA32_TSC, msr::MSR_KERNEL_GS_BASE]);
    assert_eq!(state.msrs.as_slice()[1].data, KERNEL_GS_BASE);
}

#[test]
fn save_vcpu_reads_more_msrs_than_one_ioctl_takes() {
    let kvm = kvm();
    let guest = booted_guest(&kvm);
    set_msr(&guest.vcpu, msr::MSR_KERNEL_GS_BASE, KERNEL_GS_BASE);
    let mut list = vec![0xdead_0000; 300];
    list.push(msr::MSR_KERNEL_GS_BASE);

    let state = save_vcpu(&guest.vcpu, &list).unwrap();

    let saved: Vec<(u32, u64)> = state
        .msrs
        .as_slice()
        .iter()
        .map(|e| (e.index, e.data))
        .collect();
    assert_eq!(saved, [(msr::MSR_KERNEL_GS_BASE, KERNEL_GS_BASE)]);
}

#[test]
fn restore_vcpu_names_the_msr_kvm_refuses() {
    let kvm = kvm();
    let (_source, _, mut vcpu_state) = saved_guest(&kvm);
    let mut entries = vcpu_state.msrs.as_slice().to_vec();
    entries.insert(
        1,
        kvm_msr_entry {
            index: 0xdead_0000,
            data: 1,
            ..Default::default()
        },
    );
    vcpu_state.msrs = Msrs::from_entries(&entries).unwrap();
    let target = fresh_guest(&kvm);

    let err = restore_vcpu(&target.vcpu, &vcpu_state).unwrap_err();

    assert!(
        matches!(
            err,
            Error::MsrRefused {
                set: 1,
                refused: 0xdead_0000,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("0xdead0000"), "{err}");
}

#[test]
fn check_cpuid_accepts_the_hosts_and_a_booted_vcpus_cpuid() {
    let kvm = kvm();
    let supported = kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES).unwrap();
    let topology = cpuid::VcpuTopology::new(1, 2).unwrap();
    // What configure_vcpu sets: KVM's CPUID plus the hypervisor, TSC-deadline and HTT bits.
    let booted = cpuid::vcpu_cpuid(&supported, topology).unwrap();

    check_cpuid(&kvm, &supported).unwrap();
    check_cpuid(&kvm, &booted).unwrap();
}

#[test]
fn check_cpuid_rejects_a_feature_the_host_does_not_offer() {
    let kvm = kvm();
    let mut cpuid = kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES).unwrap();
    let leaf7 = cpuid
        .as_mut_slice()
        .iter_mut()
        .find(|e| e.function == 7 && e.index == 0)
        .expect("leaf 0x7.0");
    let missing = !leaf7.ebx & leaf7.ebx.wrapping_add(1); // Lowest clear bit.
    leaf7.ebx |= missing;

    let err = check_cpuid(&kvm, &cpuid).unwrap_err();

    assert!(
        matches!(err, Error::CpuidFeatures { leaf: 7, subleaf: 0, register: "EBX", bits }
            if bits == missing),
        "{err}"
    );
}

#[test]
fn check_cpuid_rejects_another_vendor() {
    let kvm = kvm();
    let mut cpuid = kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES).unwrap();
    let leaf0 = cpuid
        .as_mut_slice()
        .iter_mut()
        .find(|e| e.function == 0)
        .expect("leaf 0");
    (leaf0.ebx, leaf0.edx, leaf0.ecx) = (0x6f67_7948, 0x6e65_476e, 0x656e_6975); // "HygonGenuine"

    let err = check_cpuid(&kvm, &cpuid).unwrap_err();

    assert!(
        matches!(&err, Error::CpuidVendor { saved, .. } if saved == "HygonGenuine"),
        "{err}"
    );
}
