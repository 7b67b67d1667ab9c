//! `snapshot_state`: the snapshot state file a restore reads (`bulkhead_vmm::snapshot`), and what
//! a restore does with its device states before any vCPU runs.
//!
//! A snapshot file is untrusted input to the VMM that restores it (it may have been altered on
//! disk, or crafted). The header's digest only catches accidents, so the fuzzer mostly feeds
//! bodies behind a valid header.
//!
//! # Input
//! - byte 0: bit 0 set = the rest is a whole state file (header line and body); clear = the rest
//!   is the body, put behind a valid header ([`format::frame`]).
//!
//! # Checks
//! No panic: decoding, the memory layout check of [`memory::map_private`] (against a file that
//! does not exist, so only the checks before it is opened run), and restoring every device
//! state into a fresh virtio-blk transport, whose event loop then runs until idle.

use std::path::Path;
use std::sync::{Arc, Mutex};

use bulkhead_vmm::arch::arch_memory_regions;
use bulkhead_vmm::devices::virtio::block::{Block, BlockConfig};
use bulkhead_vmm::devices::virtio::mmio::persist::MmioTransportState;
use bulkhead_vmm::devices::virtio::mmio::MmioTransport;
use bulkhead_vmm::devices::virtio::IrqTrigger;
use bulkhead_vmm::snapshot::{format, memory, VmSnapshot};
use event_manager::{EventManager, SubscriberOps};
use vm_memory::{GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use super::blk::{disk_pattern, MemImage};
use super::mmio::{prepared_rings, DISK_SECTORS, MEM_SIZE};
use crate::settle;

/// Runs one input.
pub fn run(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let file = match mode & 1 {
        0 => format::frame(rest).expect("a header for any body"),
        _ => rest.to_vec(),
    };
    let Ok(snapshot) = format::decode::<VmSnapshot>(&file) else {
        return;
    };
    let absent = Path::new("/nonexistent/bulkhead-fuzz/memory");
    assert!(
        memory::map_private(absent, &snapshot.memory, arch_memory_regions).is_err(),
        "a memory file that does not exist was mapped"
    );
    for state in &snapshot.devices {
        restore_block(state);
    }
}

/// Restores `state` into a fresh virtio-blk transport and runs its event loop.
fn restore_block(state: &MmioTransportState) {
    let mut blk = BlockTransport::new();
    let _ = blk.transport.restore(state);
    settle(&mut blk.event_loop);
}

/// A virtio-blk device on a memfd image behind a fresh transport, on guest memory holding the
/// rings [`prepared_rings`] lays out (their addresses in `rings`), with its event loop.
pub struct BlockTransport {
    /// The transport.
    pub transport: MmioTransport,
    /// The device's event loop.
    pub event_loop: EventManager<Arc<Mutex<Block>>>,
    /// (descriptor table, avail ring, used ring) GPAs of the prepared queue.
    pub rings: (u64, u64, u64),
    /// The disk image (kept alive with the device).
    _image: MemImage,
}

impl BlockTransport {
    /// A new one.
    pub fn new() -> BlockTransport {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE as usize)])
            .expect("guest memory");
        let rings = prepared_rings(&mem, false)[0];
        let image = MemImage::new(&disk_pattern(DISK_SECTORS));
        let config = BlockConfig {
            path: image.path.clone(),
            read_only: false,
            id: None,
            backing: None,
        };
        let dev = Arc::new(Mutex::new(Block::new(config).expect("block device")));
        let mut event_loop = EventManager::new().expect("event manager");
        event_loop.add_subscriber(dev.clone());
        let irq = Arc::new(IrqTrigger::new(
            EventFd::new(libc::EFD_NONBLOCK).expect("eventfd"),
        ));
        let transport = MmioTransport::new(mem, dev, irq).expect("transport");
        BlockTransport {
            transport,
            event_loop,
            rings,
            _image: image,
        }
    }
}

impl std::fmt::Debug for BlockTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockTransport")
            .field("transport", &self.transport)
            .field("rings", &self.rings)
            .finish_non_exhaustive()
    }
}

impl Default for BlockTransport {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_seed_restores_an_active_disk() {
        // Arrange: the committed seed's state (a body behind a valid header).
        let seed = crate::seeds::all()
            .into_iter()
            .find(|(target, name, _)| *target == "snapshot_state" && *name == "body-active-disk")
            .expect("the seed")
            .2;
        let file = format::frame(&seed[1..]).unwrap();
        let snapshot: VmSnapshot = format::decode(&file).unwrap();
        let mut blk = BlockTransport::new();

        // Act
        blk.transport.restore(&snapshot.devices[0]).unwrap();

        // Assert: the fuzzer starts from a device the restore brought back up.
        assert!(blk.transport.is_activated());
    }
}
