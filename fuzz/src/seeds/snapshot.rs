//! Seeds of `snapshot_state`: the state of a VM with an active virtio-blk disk and one with a
//! device the driver never set up, as a body behind a valid header and as a whole file.

use bulkhead_vmm::arch::arch_memory_regions;
use bulkhead_vmm::arch::x86_64::persist::VmState;
use bulkhead_vmm::config::{VmConfig, VsockConfig};
use bulkhead_vmm::devices::bus::BusDevice;
use bulkhead_vmm::devices::legacy::i8042::{DataTarget, I8042State};
use bulkhead_vmm::devices::legacy::serial::SerialDeviceState;
use bulkhead_vmm::devices::virtio::mmio::persist::MmioTransportState;
use bulkhead_vmm::devices::virtio::mmio::MmioTransport;
use bulkhead_vmm::snapshot::memory::RegionState;
use bulkhead_vmm::snapshot::{format, LegacyState, VmSnapshot};

use super::Seed;
use crate::targets::mmio::QUEUE_SIZE;
use crate::targets::snapshot::BlockTransport;

/// Seeds of `snapshot_state`.
pub fn seeds() -> Vec<Seed> {
    let snapshot = vm_snapshot();
    let body = serde_json::to_vec(&snapshot).expect("serialize the seed");
    let file = format::encode(&snapshot).expect("encode the seed");
    vec![
        (
            "snapshot_state",
            "body-active-disk",
            [&[0u8][..], &body].concat(),
        ),
        (
            "snapshot_state",
            "file-active-disk",
            [&[1u8][..], &file].concat(),
        ),
    ]
}

/// A 256 MiB, vCPU-less VM with a vsock socket path, an active disk and an idle one.
fn vm_snapshot() -> VmSnapshot {
    let mut config = VmConfig::new("/data/vmlinux");
    config.vsock = Some(VsockConfig {
        guest_cid: 3,
        uds_path: "/run/bh/vm.sock".into(),
    });
    let mut offset = 0;
    let memory = arch_memory_regions(256 << 20)
        .into_iter()
        .map(|(gpa, size)| {
            let region = RegionState {
                gpa: gpa.0,
                size: size as u64,
                offset,
            };
            offset += size as u64;
            region
        })
        .collect();
    VmSnapshot {
        config,
        vcpus: Vec::new(),
        vm: VmState {
            pic_master: Default::default(),
            pic_slave: Default::default(),
            ioapic: Default::default(),
            pit2: Default::default(),
            clock: Default::default(),
        },
        devices: vec![block_state(true), block_state(false)],
        legacy: legacy(),
        memory,
    }
}

/// A virtio-blk transport's state, brought up by a driver when `active`.
fn block_state(active: bool) -> MmioTransportState {
    let mut blk = BlockTransport::new();
    if active {
        bring_up(&mut blk.transport, blk.rings);
    }
    blk.transport.save().expect("save the transport")
}

/// The driver's side of virtio 1.2 §3.1.1 on queue 0 with the rings at `(desc, avail, used)`.
fn bring_up(transport: &mut MmioTransport, (desc, avail, used): (u64, u64, u64)) {
    let mut write = |offset: u64, value: u32| transport.write(offset, &value.to_le_bytes());
    write(0x070, 1); // ACKNOWLEDGE
    write(0x070, 3); // DRIVER
    write(0x024, 1); // DriverFeaturesSel: bits 32..63
    write(0x020, 1); // VIRTIO_F_VERSION_1
    write(0x070, 0xb); // FEATURES_OK
    write(0x030, 0); // QueueSel
    write(0x038, u32::from(QUEUE_SIZE));
    for (low, gpa) in [(0x080, desc), (0x090, avail), (0x0a0, used)] {
        write(low, gpa as u32);
        write(low + 4, (gpa >> 32) as u32);
    }
    write(0x044, 1); // QueueReady
    write(0x070, 0xf); // DRIVER_OK
}

/// A serial console and an i8042 as Linux leaves them after boot.
fn legacy() -> LegacyState {
    LegacyState {
        serial: SerialDeviceState {
            baud_divisor_low: 1,
            baud_divisor_high: 0,
            interrupt_enable: 0,
            interrupt_identification: 1,
            line_control: 3,
            line_status: 0x60,
            modem_control: 0x0b,
            modem_status: 0xb0,
            scratch: 0,
            in_buffer: Vec::new(),
        },
        i8042: Some(I8042State {
            status: 0x04,
            ctr: 0x47,
            outport: 0x03,
            output: Vec::new(),
            data_target: DataTarget::Keyboard,
        }),
    }
}
