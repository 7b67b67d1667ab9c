//! One virtqueue's configuration as the driver writes it through the Queue* registers, and its
//! validation into a [`virtio_queue::Queue`] when the driver sets DRIVER_OK.
//!
//! The values are kept exactly as written (a 32-bit QueueNum, 64-bit GPAs assembled from two
//! 32-bit halves) and checked only at DRIVER_OK, so a bad value makes activation fail visibly
//! instead of being silently replaced by a default.

use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddress, GuestMemory, GuestMemoryMmap};

use super::Error;

/// Size in bytes of one split-virtqueue descriptor (virtio 1.2 §2.7.5).
const DESC_SIZE: u64 = 16;
/// Size in bytes of the available ring without its entries: flags, idx, used_event (§2.7.6).
const AVAIL_FIXED: u64 = 6;
/// Size in bytes of one available ring entry.
const AVAIL_ENTRY: u64 = 2;
/// Size in bytes of the used ring without its entries: flags, idx, avail_event (§2.7.8).
const USED_FIXED: u64 = 6;
/// Size in bytes of one used ring element (id, len).
const USED_ENTRY: u64 = 8;

/// The driver-written configuration of one virtqueue (virtio 1.2 §4.2.3.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct QueueConfig {
    /// QueueNum as written (number of entries); starts at the queue's maximum, as on PCI.
    pub(super) size: u32,
    /// QueueReady.
    pub(super) ready: bool,
    /// QueueDescLow/High: GPA of the descriptor table.
    pub(super) desc: u64,
    /// QueueDriverLow/High: GPA of the available ring.
    pub(super) driver: u64,
    /// QueueDeviceLow/High: GPA of the used ring.
    pub(super) device: u64,
}

impl QueueConfig {
    /// A queue as it is after reset: not ready, size = `max_size`, addresses 0.
    pub(super) fn new(max_size: u16) -> Self {
        QueueConfig {
            size: u32::from(max_size),
            ready: false,
            desc: 0,
            driver: 0,
            device: 0,
        }
    }

    /// Checks the configuration against virtio 1.2 §2.7 and guest memory and builds the queue
    /// handed to the device. `index` is only used in errors.
    ///
    /// # Errors
    /// [`Error::QueueNotReady`], [`Error::QueueSize`], [`Error::QueueLayout`] (misaligned ring)
    /// or [`Error::QueueOutsideMemory`].
    pub(super) fn build(
        &self,
        index: usize,
        max_size: u16,
        mem: &GuestMemoryMmap,
    ) -> Result<Queue, Error> {
        if !self.ready {
            return Err(Error::QueueNotReady { index });
        }
        let size = self.checked_size(index, max_size)?;
        let layout = |source| Error::QueueLayout { index, source };
        let mut queue = Queue::new(max_size).map_err(layout)?;
        queue.try_set_size(size).map_err(layout)?;
        queue
            .try_set_desc_table_address(GuestAddress(self.desc))
            .map_err(layout)?;
        queue
            .try_set_avail_ring_address(GuestAddress(self.driver))
            .map_err(layout)?;
        queue
            .try_set_used_ring_address(GuestAddress(self.device))
            .map_err(layout)?;
        let n = u64::from(size);
        check_area(mem, index, "descriptor table", self.desc, DESC_SIZE * n)?;
        check_area(
            mem,
            index,
            "available ring",
            self.driver,
            AVAIL_FIXED + AVAIL_ENTRY * n,
        )?;
        check_area(
            mem,
            index,
            "used ring",
            self.device,
            USED_FIXED + USED_ENTRY * n,
        )?;
        queue.set_ready(true);
        Ok(queue)
    }

    /// QueueNum if it is a power of two in `1..=max_size` (virtio 1.2 §2.7: split queue sizes are
    /// powers of two; §4.2.2.2: at most QueueNumMax).
    fn checked_size(&self, index: usize, max_size: u16) -> Result<u16, Error> {
        u16::try_from(self.size)
            .ok()
            .filter(|&s| s.is_power_of_two() && s <= max_size)
            .ok_or(Error::QueueSize {
                index,
                size: self.size,
                max: max_size,
            })
    }
}

/// Replaces the low 32 bits of `addr` (a QueueXxxLow write).
pub(super) fn set_low(addr: &mut u64, value: u32) {
    *addr = (*addr & !u64::from(u32::MAX)) | u64::from(value);
}

/// Replaces the high 32 bits of `addr` (a QueueXxxHigh write).
pub(super) fn set_high(addr: &mut u64, value: u32) {
    *addr = (*addr & u64::from(u32::MAX)) | (u64::from(value) << 32);
}

/// Checks that the `len` bytes at GPA `addr` are all guest RAM.
fn check_area(
    mem: &GuestMemoryMmap,
    index: usize,
    area: &'static str,
    addr: u64,
    len: u64,
) -> Result<(), Error> {
    let fits = usize::try_from(len).is_ok_and(|len| mem.check_range(GuestAddress(addr), len));
    if fits {
        Ok(())
    } else {
        Err(Error::QueueOutsideMemory {
            index,
            area,
            addr,
            len,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MEM_SIZE: usize = 0x1_0000;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap()
    }

    fn ready_queue(size: u32) -> QueueConfig {
        QueueConfig {
            size,
            ready: true,
            desc: 0x1000,
            driver: 0x2000,
            device: 0x3000,
        }
    }

    #[test]
    fn valid_configuration_builds_the_queue_the_driver_described() {
        let config = ready_queue(8);

        let queue = config.build(0, 16, &mem()).unwrap();

        assert_eq!(queue.size(), 8);
        assert!(queue.ready());
        assert_eq!(
            (queue.desc_table(), queue.avail_ring(), queue.used_ring()),
            (0x1000, 0x2000, 0x3000)
        );
    }

    #[test]
    fn size_not_power_of_two_is_refused() {
        let result = ready_queue(6).build(0, 16, &mem());

        assert!(matches!(result, Err(Error::QueueSize { size: 6, .. })));
    }

    #[test]
    fn size_zero_and_sizes_beyond_max_are_refused() {
        let zero = ready_queue(0).build(0, 16, &mem());
        let too_big = ready_queue(32).build(0, 16, &mem());
        let huge = ready_queue(0x1_0000).build(0, 16, &mem());

        assert!(matches!(zero, Err(Error::QueueSize { .. })));
        assert!(matches!(too_big, Err(Error::QueueSize { .. })));
        assert!(matches!(huge, Err(Error::QueueSize { .. })));
    }

    #[test]
    fn misaligned_descriptor_table_is_refused() {
        let config = QueueConfig {
            desc: 0x1008,
            ..ready_queue(8)
        };

        let result = config.build(0, 16, &mem());

        assert!(matches!(result, Err(Error::QueueLayout { .. })));
    }

    #[test]
    fn used_ring_running_past_guest_memory_is_refused() {
        let config = QueueConfig {
            device: MEM_SIZE as u64 - 8,
            ..ready_queue(8)
        };

        let result = config.build(0, 16, &mem());

        assert!(matches!(
            result,
            Err(Error::QueueOutsideMemory {
                area: "used ring",
                ..
            })
        ));
    }

    #[test]
    fn ring_ending_exactly_at_the_end_of_memory_is_accepted() {
        // available ring of 8 entries: 6 + 2 * 8 = 22 bytes, 2-byte aligned.
        let config = QueueConfig {
            driver: MEM_SIZE as u64 - 22,
            ..ready_queue(8)
        };

        let result = config.build(0, 16, &mem());

        assert!(result.is_ok());
    }

    #[test]
    fn address_near_u64_max_is_refused_without_overflow() {
        let config = QueueConfig {
            driver: u64::MAX - 1,
            ..ready_queue(8)
        };

        let result = config.build(0, 16, &mem());

        assert!(matches!(result, Err(Error::QueueOutsideMemory { .. })));
    }

    #[test]
    fn queue_not_ready_is_refused() {
        let config = QueueConfig {
            ready: false,
            ..ready_queue(8)
        };

        let result = config.build(3, 16, &mem());

        assert!(matches!(result, Err(Error::QueueNotReady { index: 3 })));
    }

    #[test]
    fn address_halves_combine() {
        let mut addr = 0;

        set_high(&mut addr, 0x1);
        set_low(&mut addr, 0x2000);
        set_low(&mut addr, 0x3000);

        assert_eq!(addr, 0x1_0000_3000);
    }
}
