//! Address buses that route vCPU exits to devices.
//!
//! A vCPU exit for port I/O (`KVM_EXIT_IO`) or MMIO (`KVM_EXIT_MMIO`) carries an address and a data
//! buffer. A [`Bus`] maps non-overlapping address ranges to devices and dispatches the access to the
//! device that owns the address, with the offset from the start of its range.
//!
//! Accesses to addresses no device owns are answered like an unpopulated ISA bus: reads return all
//! ones, writes are dropped. A guest probing for hardware it does not have is normal, not an error.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};

/// Errors from building a bus.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    /// The range is empty or wraps past the end of the address space.
    #[error("invalid bus range: base {base:#x}, length {len:#x} bytes")]
    InvalidRange {
        /// First address of the range.
        base: u64,
        /// Length of the range, bytes.
        len: u64,
    },
    /// The range overlaps a range already on the bus.
    #[error("bus range {base:#x}+{len:#x} overlaps an existing device at {other_base:#x}+{other_len:#x}")]
    Overlap {
        /// First address of the new range.
        base: u64,
        /// Length of the new range, bytes.
        len: u64,
        /// First address of the existing range.
        other_base: u64,
        /// Length of the existing range, bytes.
        other_len: u64,
    },
}

/// A device that sits on a [`Bus`].
///
/// `offset` is the distance in bytes from the start of the device's range; `data` is the access
/// (1, 2, 4 or 8 bytes for port I/O and MMIO, little-endian as the guest wrote it).
pub trait BusDevice: Send {
    /// Handles a guest read; the device fills `data`.
    fn read(&mut self, offset: u64, data: &mut [u8]);
    /// Handles a guest write of `data`.
    fn write(&mut self, offset: u64, data: &[u8]);
}

/// A device shared between the bus (vCPU threads) and its owner.
pub type SharedDevice = Arc<Mutex<dyn BusDevice>>;

#[derive(Clone)]
struct Entry {
    len: u64,
    device: SharedDevice,
}

/// A set of devices, each owning a non-overlapping address range.
///
/// # Example
/// ```
/// use std::sync::{Arc, Mutex};
/// use bulkhead_vmm::devices::bus::{Bus, BusDevice};
///
/// struct Scratch(u8);
/// impl BusDevice for Scratch {
///     fn read(&mut self, _offset: u64, data: &mut [u8]) { data.fill(self.0) }
///     fn write(&mut self, _offset: u64, data: &[u8]) { self.0 = data[0] }
/// }
///
/// let mut bus = Bus::default();
/// bus.insert(0x80, 1, Arc::new(Mutex::new(Scratch(0)))).unwrap();
/// bus.write(0x80, &[7]);
/// let mut out = [0u8];
/// bus.read(0x80, &mut out);
/// assert_eq!(out, [7]);
/// ```
#[derive(Clone, Default)]
pub struct Bus {
    entries: BTreeMap<u64, Entry>,
}

impl fmt::Debug for Bus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ranges: Vec<_> = self
            .entries
            .iter()
            .map(|(base, e)| format!("{base:#x}+{:#x}", e.len))
            .collect();
        f.debug_struct("Bus").field("ranges", &ranges).finish()
    }
}

impl Bus {
    /// Adds `device` at `[base, base + len)`.
    ///
    /// # Errors
    /// [`Error::InvalidRange`] for an empty or wrapping range, [`Error::Overlap`] when the range
    /// intersects one already on the bus.
    pub fn insert(&mut self, base: u64, len: u64, device: SharedDevice) -> Result<(), Error> {
        let end = base
            .checked_add(len)
            .filter(|_| len > 0)
            .ok_or(Error::InvalidRange { base, len })?;
        if let Some((&other_base, other)) = self.entries.range(..end).next_back() {
            if other_base + other.len > base {
                return Err(Error::Overlap {
                    base,
                    len,
                    other_base,
                    other_len: other.len,
                });
            }
        }
        self.entries.insert(base, Entry { len, device });
        Ok(())
    }

    /// Finds the device owning `addr` and the offset of `addr` in its range.
    fn resolve(&self, addr: u64) -> Option<(u64, &SharedDevice)> {
        let (&base, entry) = self.entries.range(..=addr).next_back()?;
        let offset = addr - base;
        (offset < entry.len).then_some((offset, &entry.device))
    }

    /// Dispatches a guest read; returns `false` (and fills `data` with `0xff`) when no device owns
    /// `addr`.
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.resolve(addr) {
            Some((offset, dev)) => {
                lock(dev).read(offset, data);
                true
            }
            None => {
                data.fill(0xff);
                false
            }
        }
    }

    /// Dispatches a guest write; returns `false` (dropping it) when no device owns `addr`.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.resolve(addr) {
            Some((offset, dev)) => {
                lock(dev).write(offset, data);
                true
            }
            None => false,
        }
    }
}

/// Locks a device, recovering from a poisoned lock: a panic on another vCPU thread must not turn
/// every later access into a second panic.
fn lock(dev: &SharedDevice) -> std::sync::MutexGuard<'_, dyn BusDevice + 'static> {
    dev.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Recorder {
        last_write: Option<(u64, Vec<u8>)>,
    }

    impl BusDevice for Recorder {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data.fill(offset as u8);
        }
        fn write(&mut self, offset: u64, data: &[u8]) {
            self.last_write = Some((offset, data.to_vec()));
        }
    }

    fn recorder() -> Arc<Mutex<Recorder>> {
        Arc::new(Mutex::new(Recorder::default()))
    }

    #[test]
    fn overlapping_ranges_are_rejected() {
        let mut bus = Bus::default();
        bus.insert(0x3f8, 8, recorder()).unwrap();

        let below = bus.insert(0x3f0, 9, recorder());
        let inside = bus.insert(0x3fc, 1, recorder());

        assert!(matches!(
            below,
            Err(Error::Overlap {
                other_base: 0x3f8,
                ..
            })
        ));
        assert!(matches!(inside, Err(Error::Overlap { .. })));
    }

    #[test]
    fn adjacent_ranges_are_accepted() {
        let mut bus = Bus::default();
        bus.insert(0x3f8, 8, recorder()).unwrap();

        assert!(bus.insert(0x3f0, 8, recorder()).is_ok());
        assert!(bus.insert(0x400, 8, recorder()).is_ok());
    }

    #[test]
    fn empty_and_wrapping_ranges_are_rejected() {
        let mut bus = Bus::default();

        assert_eq!(
            bus.insert(0x10, 0, recorder()),
            Err(Error::InvalidRange { base: 0x10, len: 0 })
        );
        assert!(bus.insert(u64::MAX, 2, recorder()).is_err());
    }

    #[test]
    fn access_is_routed_with_offset() {
        let mut bus = Bus::default();
        let dev = recorder();
        bus.insert(0x60, 5, dev.clone()).unwrap();

        let routed = bus.write(0x64, &[0xfe]);
        let mut data = [0u8; 2];
        bus.read(0x62, &mut data);

        assert!(routed);
        assert_eq!(dev.lock().unwrap().last_write, Some((4, vec![0xfe])));
        assert_eq!(data, [2, 2]);
    }

    #[test]
    fn unowned_addresses_read_all_ones() {
        let mut bus = Bus::default();
        bus.insert(0x60, 5, recorder()).unwrap();
        let mut data = [0u8; 4];

        let found = bus.read(0x65, &mut data);

        assert!(!found);
        assert_eq!(data, [0xff; 4]);
        assert!(!bus.write(0x5f, &[1]));
    }
}
