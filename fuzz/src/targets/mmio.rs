//! `virtio_mmio`: sequences of register reads and writes on the virtio-mmio transport, with a
//! real device behind it whose event loop runs after every access.
//!
//! The transport is bulkhead's [`MmioTransport`] in front of a virtio-blk device (on a memfd
//! image; it can be reset) or a vsock device (which cannot). Guest memory starts with rings the
//! mock driver laid out and filled with a valid request ([`prepared_rings`]), so an input that
//! brings the device up with those addresses and notifies gets the request served; the input can
//! also write guest memory itself.
//!
//! # Input
//! - byte 0: bit 0 = vsock device (else virtio-blk);
//! - then operations, each an op byte (`% 4`) and its fields:
//!   - 0 *read*: `u16` offset (`% 0x1000`), `u8` width selector (`% 4`: 1, 2, 4 or 8 bytes);
//!   - 1 *write*: `u16` offset, `u8` width selector, `u64` value (its low `width` bytes);
//!   - 2 *register*: `u8` index into [`REGISTERS`], `u32` value: a 32-bit write there;
//!   - 3 *memory*: `u32` GPA (`% MEM_SIZE`), `u8` length, the bytes: the driver writes guest
//!     memory.
//!
//! After every operation the device's event loop runs until idle.
//!
//! # Checks
//! No panic, no busy event loop; for virtio-blk, the device is active exactly when the
//! transport says it activated it.

use std::sync::{Arc, Mutex};

use bulkhead_vmm::devices::bus::BusDevice;
use bulkhead_vmm::devices::virtio::block::{Block, BlockConfig, VIRTIO_BLK_T_IN};
use bulkhead_vmm::devices::virtio::mmio::{MmioTransport, MMIO_DEVICE_SIZE};
use bulkhead_vmm::devices::virtio::vsock::packet::{Header, Op, HEADER_SIZE, TYPE_STREAM};
use bulkhead_vmm::devices::virtio::vsock::{Vsock, HOST_CID};
use bulkhead_vmm::devices::virtio::{IrqTrigger, VirtioDevice};
use event_manager::{EventManager, MutEventSubscriber, SubscriberOps};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use super::blk::{disk_pattern, MemImage};
use crate::input::Input;
use crate::queue::{Driver, Layout, Part};
use crate::{ignore_sigpipe, settle};

/// Guest memory size (1 MiB).
pub const MEM_SIZE: u64 = 0x10_0000;
/// Entries of each prepared queue.
pub const QUEUE_SIZE: u16 = 16;
/// Disk size of the virtio-blk device, in sectors.
pub const DISK_SECTORS: u64 = 8;
/// Guest CID of the vsock device.
pub const GUEST_CID: u64 = 3;

/// Offsets of the control registers (virtio 1.2 §4.2.2) and the start of the configuration
/// space, for *register* operations.
pub const REGISTERS: [u16; 25] = [
    0x000, 0x004, 0x008, 0x00c, 0x010, 0x014, 0x020, 0x024, 0x030, 0x034, 0x038, 0x044, 0x050,
    0x060, 0x064, 0x070, 0x080, 0x084, 0x090, 0x094, 0x0a0, 0x0a4, 0x0fc, 0x100, 0x108,
];

/// Layouts of the prepared queues: queue `i` has its rings at `0x1000 * (i + 1)`.
pub fn layout(index: usize) -> Layout {
    let index = index as u64;
    Layout {
        size: QUEUE_SIZE,
        rings: 0x1000 * (index + 1),
        bufs: 0x1_0000 * (index + 1),
        bufs_end: 0x1_0000 * (index + 2),
    }
}

/// Lays out the rings a driver would for the device (virtio-blk: 1 queue; vsock: 3) and queues
/// one valid request on them: a one-sector read for virtio-blk, a connection request to host
/// port 1234 on the vsock TX queue (plus RX buffers). Returns each queue's
/// (descriptor table, avail ring, used ring) GPAs.
pub fn prepared_rings(mem: &GuestMemoryMmap, vsock: bool) -> Vec<(u64, u64, u64)> {
    if !vsock {
        let mut q = Driver::new(mem, layout(0));
        let mut header = [0u8; 16];
        header[..4].copy_from_slice(&VIRTIO_BLK_T_IN.to_le_bytes());
        q.push(&[
            Part::Bytes(header.to_vec()),
            Part::Write(512),
            Part::Write(1),
        ]);
        return vec![q.addresses()];
    }
    let mut queues: Vec<Driver<'_>> = (0..3).map(|i| Driver::new(mem, layout(i))).collect();
    for _ in 0..4 {
        queues[0].push(&[Part::Write(HEADER_SIZE as u32), Part::Write(4096)]);
    }
    queues[1].push(&[Part::Bytes(vsock_request().to_vec())]);
    queues.iter().map(Driver::addresses).collect()
}

/// A guest REQUEST from port 5000 to host port 1234.
fn vsock_request() -> [u8; HEADER_SIZE] {
    Header {
        src_cid: GUEST_CID,
        dst_cid: HOST_CID,
        src_port: 5000,
        dst_port: 1234,
        type_: TYPE_STREAM,
        op: Op::Request as u16,
        buf_alloc: 256 << 10,
        ..Header::default()
    }
    .to_bytes()
}

/// Runs one input.
pub fn run(data: &[u8]) {
    let mut input = Input::new(data);
    let vsock = input.u8() & 1 != 0;
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE as usize)])
        .expect("guest memory");
    prepared_rings(&mem, vsock);
    if vsock {
        ignore_sigpipe();
        let dir = tempfile::tempdir().expect("temporary directory");
        let dev = Vsock::new(GUEST_CID, dir.path().join("v.sock")).expect("vsock device");
        drive(dev, &mem, &mut input, |_, _| {});
    } else {
        let image = MemImage::new(&disk_pattern(DISK_SECTORS));
        let config = BlockConfig {
            path: image.path.clone(),
            read_only: false,
            id: None,
            backing: None,
        };
        let dev = Block::new(config).expect("block device");
        drive(dev, &mem, &mut input, |transport, block| {
            assert_eq!(
                transport.is_activated(),
                block.is_activated(),
                "transport and virtio-blk disagree on whether the device is active"
            );
        });
    }
}

/// Runs the operations against `device` behind a transport, calling `check` after each.
fn drive<D>(
    device: D,
    mem: &GuestMemoryMmap,
    input: &mut Input<'_>,
    check: impl Fn(&MmioTransport, &D),
) where
    D: VirtioDevice + MutEventSubscriber + 'static,
{
    let dev = Arc::new(Mutex::new(device));
    let mut em = EventManager::new().expect("event manager");
    em.add_subscriber(dev.clone());
    let irq = Arc::new(IrqTrigger::new(
        EventFd::new(libc::EFD_NONBLOCK).expect("eventfd"),
    ));
    let mut transport =
        MmioTransport::new(mem.clone(), dev.clone(), irq).expect("transport for the device");
    while !input.is_empty() {
        match input.u8() % 4 {
            0 => {
                let offset = u64::from(input.u16()) % MMIO_DEVICE_SIZE;
                let mut data = [0u8; 8];
                transport.read(offset, &mut data[..width(input.u8())]);
            }
            1 => {
                let offset = u64::from(input.u16()) % MMIO_DEVICE_SIZE;
                let width = width(input.u8());
                let value = input.u64().to_le_bytes();
                transport.write(offset, &value[..width]);
            }
            2 => {
                let offset = REGISTERS[usize::from(input.u8()) % REGISTERS.len()];
                transport.write(u64::from(offset), &input.u32().to_le_bytes());
            }
            _ => {
                let addr = u64::from(input.u32()) % MEM_SIZE;
                let len = usize::from(input.u8());
                let bytes = input.bytes(len);
                // Bytes past the end of guest memory are dropped, as a real bus would.
                let room = (MEM_SIZE - addr) as usize;
                mem.write_slice(&bytes[..bytes.len().min(room)], GuestAddress(addr))
                    .expect("inside guest memory");
            }
        }
        settle(&mut em);
        check(&transport, &dev.lock().expect("device lock"));
    }
}

/// Access width for a selector byte: 1, 2, 4 or 8 bytes.
pub fn width(selector: u8) -> usize {
    1 << (selector % 4)
}
