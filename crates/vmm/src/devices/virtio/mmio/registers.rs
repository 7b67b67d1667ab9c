//! The control registers of a virtio-mmio device (virtio 1.2 §4.2.2, table "MMIO Device Register
//! Layout"): decoding a byte offset in the device window into the register it names.

use virtio_bindings::virtio_mmio as off;

/// Byte offset of the QueueReset register (virtio 1.2 §4.2.2; only meaningful with
/// VIRTIO_F_RING_RESET, which this transport does not offer). Not in virtio-bindings 0.2.
const QUEUE_RESET: u64 = 0x0c0;

/// A control register of the modern (Version 2) interface.
///
/// The legacy-only registers (GuestPageSize, QueueAlign, QueuePFN) are deliberately absent: they
/// decode as unknown offsets, which read as 0 and ignore writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Register {
    /// 0x000 R: "virt" in little-endian ASCII.
    MagicValue,
    /// 0x004 R: interface version (2 = modern).
    Version,
    /// 0x008 R: virtio device ID.
    DeviceId,
    /// 0x00c R: subsystem vendor ID.
    VendorId,
    /// 0x010 R: 32 bits of the device's features, selected by DeviceFeaturesSel.
    DeviceFeatures,
    /// 0x014 W: which 32-bit half of the device features DeviceFeatures shows.
    DeviceFeaturesSel,
    /// 0x020 W: 32 bits of the features the driver accepts, selected by DriverFeaturesSel.
    DriverFeatures,
    /// 0x024 W: which 32-bit half DriverFeatures writes.
    DriverFeaturesSel,
    /// 0x030 W: the queue the Queue* registers refer to.
    QueueSel,
    /// 0x034 R: maximum size of the selected queue (0: no such queue).
    QueueNumMax,
    /// 0x038 W: size of the selected queue.
    QueueNum,
    /// 0x044 RW: the selected queue is configured and may be used.
    QueueReady,
    /// 0x050 W: the driver made buffers available in the queue whose index is written.
    QueueNotify,
    /// 0x060 R: pending interrupt causes.
    InterruptStatus,
    /// 0x064 W: interrupt causes the driver handled.
    InterruptAck,
    /// 0x070 RW: device status (virtio 1.2 §2.1).
    Status,
    /// 0x080 W: descriptor table GPA, low 32 bits.
    QueueDescLow,
    /// 0x084 W: descriptor table GPA, high 32 bits.
    QueueDescHigh,
    /// 0x090 W: driver area (available ring) GPA, low 32 bits.
    QueueDriverLow,
    /// 0x094 W: driver area (available ring) GPA, high 32 bits.
    QueueDriverHigh,
    /// 0x0a0 W: device area (used ring) GPA, low 32 bits.
    QueueDeviceLow,
    /// 0x0a4 W: device area (used ring) GPA, high 32 bits.
    QueueDeviceHigh,
    /// 0x0ac W: shared memory region ID.
    ShmSel,
    /// 0x0b0 R: selected shared memory region length, low 32 bits.
    ShmLenLow,
    /// 0x0b4 R: selected shared memory region length, high 32 bits.
    ShmLenHigh,
    /// 0x0b8 R: selected shared memory region GPA, low 32 bits.
    ShmBaseLow,
    /// 0x0bc R: selected shared memory region GPA, high 32 bits.
    ShmBaseHigh,
    /// 0x0c0 RW: reset the selected queue (VIRTIO_F_RING_RESET).
    QueueReset,
    /// 0x0fc R: configuration space generation counter.
    ConfigGeneration,
}

impl Register {
    /// The register at byte `offset` of the device window, or `None` for offsets that name no
    /// register (including unaligned offsets and the legacy-only registers).
    pub(super) fn decode(offset: u64) -> Option<Self> {
        let reg = match u32::try_from(offset).ok()? {
            off::VIRTIO_MMIO_MAGIC_VALUE => Self::MagicValue,
            off::VIRTIO_MMIO_VERSION => Self::Version,
            off::VIRTIO_MMIO_DEVICE_ID => Self::DeviceId,
            off::VIRTIO_MMIO_VENDOR_ID => Self::VendorId,
            off::VIRTIO_MMIO_DEVICE_FEATURES => Self::DeviceFeatures,
            off::VIRTIO_MMIO_DEVICE_FEATURES_SEL => Self::DeviceFeaturesSel,
            off::VIRTIO_MMIO_DRIVER_FEATURES => Self::DriverFeatures,
            off::VIRTIO_MMIO_DRIVER_FEATURES_SEL => Self::DriverFeaturesSel,
            off::VIRTIO_MMIO_QUEUE_SEL => Self::QueueSel,
            off::VIRTIO_MMIO_QUEUE_NUM_MAX => Self::QueueNumMax,
            off::VIRTIO_MMIO_QUEUE_NUM => Self::QueueNum,
            off::VIRTIO_MMIO_QUEUE_READY => Self::QueueReady,
            off::VIRTIO_MMIO_QUEUE_NOTIFY => Self::QueueNotify,
            off::VIRTIO_MMIO_INTERRUPT_STATUS => Self::InterruptStatus,
            off::VIRTIO_MMIO_INTERRUPT_ACK => Self::InterruptAck,
            off::VIRTIO_MMIO_STATUS => Self::Status,
            off::VIRTIO_MMIO_QUEUE_DESC_LOW => Self::QueueDescLow,
            off::VIRTIO_MMIO_QUEUE_DESC_HIGH => Self::QueueDescHigh,
            off::VIRTIO_MMIO_QUEUE_AVAIL_LOW => Self::QueueDriverLow,
            off::VIRTIO_MMIO_QUEUE_AVAIL_HIGH => Self::QueueDriverHigh,
            off::VIRTIO_MMIO_QUEUE_USED_LOW => Self::QueueDeviceLow,
            off::VIRTIO_MMIO_QUEUE_USED_HIGH => Self::QueueDeviceHigh,
            off::VIRTIO_MMIO_SHM_SEL => Self::ShmSel,
            off::VIRTIO_MMIO_SHM_LEN_LOW => Self::ShmLenLow,
            off::VIRTIO_MMIO_SHM_LEN_HIGH => Self::ShmLenHigh,
            off::VIRTIO_MMIO_SHM_BASE_LOW => Self::ShmBaseLow,
            off::VIRTIO_MMIO_SHM_BASE_HIGH => Self::ShmBaseHigh,
            off::VIRTIO_MMIO_CONFIG_GENERATION => Self::ConfigGeneration,
            o if u64::from(o) == QUEUE_RESET => Self::QueueReset,
            _ => return None,
        };
        Some(reg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_offsets_decode_to_their_registers() {
        let status = Register::decode(0x70);
        let used_high = Register::decode(0xa4);
        let generation = Register::decode(0xfc);

        assert_eq!(status, Some(Register::Status));
        assert_eq!(used_high, Some(Register::QueueDeviceHigh));
        assert_eq!(generation, Some(Register::ConfigGeneration));
    }

    #[test]
    fn unaligned_legacy_and_huge_offsets_decode_to_nothing() {
        let unaligned = Register::decode(0x71);
        let queue_pfn = Register::decode(0x40);
        let huge = Register::decode(u64::from(u32::MAX) + 0x70);

        assert_eq!(unaligned, None);
        assert_eq!(queue_pfn, None);
        assert_eq!(huge, None);
    }
}
