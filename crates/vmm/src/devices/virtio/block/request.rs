//! Turning one descriptor chain into a validated [`Request`] (virtio 1.2 §5.2.6).
//!
//! Nothing here touches the disk: [`parse_chain`] only reads the chain's descriptors and the
//! 16-byte header from guest memory. Its result says where the status byte is (or why there is
//! no usable one) and either a [`Request`] that is safe to execute — every guest range inside
//! guest memory, every sector on the disk — or the [`RequestError`] that makes it an IOERR.
//!
//! The chain is read as a stream of device-readable bytes followed by a stream of device-writable
//! bytes (virtio 1.2 §2.6.4: devices must not assume a particular framing). The status byte is
//! the last byte of the last descriptor; the header is the first 16 readable bytes.

use virtio_queue::desc::split::Descriptor;
use vm_memory::{Bytes, GuestAddress, GuestMemory};

use super::{
    MAX_DATA_BYTES, MAX_DESCRIPTORS, SECTOR_SHIFT, SECTOR_SIZE, VIRTIO_BLK_T_FLUSH,
    VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
};

/// A guest buffer: `len` bytes at guest-physical address `addr`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Guest-physical address of the first byte.
    pub addr: GuestAddress,
    /// Length in bytes.
    pub len: u32,
}

impl Segment {
    fn of(desc: &Descriptor) -> Segment {
        Segment {
            addr: desc.addr(),
            len: desc.len(),
        }
    }
}

/// The request header, the first 16 device-readable bytes of a chain (virtio 1.2 §5.2.6,
/// `struct virtio_blk_req`): all fields little-endian.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestHeader {
    /// `VIRTIO_BLK_T_*`.
    pub request_type: u32,
    /// Reserved (the I/O priority in legacy drivers); ignored.
    pub reserved: u32,
    /// First sector of the transfer (byte offset ÷ 512); ignored by FLUSH and GET_ID.
    pub sector: u64,
}

impl RequestHeader {
    /// Size of the header in bytes.
    pub const SIZE: usize = 16;

    /// Decodes the little-endian wire form.
    pub fn from_bytes(raw: &[u8; Self::SIZE]) -> RequestHeader {
        let [t0, t1, t2, t3, r0, r1, r2, r3, s @ ..] = *raw;
        RequestHeader {
            request_type: u32::from_le_bytes([t0, t1, t2, t3]),
            reserved: u32::from_le_bytes([r0, r1, r2, r3]),
            sector: u64::from_le_bytes(s),
        }
    }

    /// Encodes the little-endian wire form.
    pub fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut raw = [0u8; Self::SIZE];
        raw[0..4].copy_from_slice(&self.request_type.to_le_bytes());
        raw[4..8].copy_from_slice(&self.reserved.to_le_bytes());
        raw[8..16].copy_from_slice(&self.sector.to_le_bytes());
        raw
    }
}

/// What the disk permits, for validation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DiskLimits {
    /// Disk size in 512-byte sectors.
    pub capacity: u64,
    /// Writes are refused.
    pub read_only: bool,
}

/// A validated request, ready to execute.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    /// Read `data`'s total length from the disk at `sector` into `data` (whole sectors, on the
    /// disk).
    In {
        /// First sector.
        sector: u64,
        /// Device-writable guest buffers, in order.
        data: Vec<Segment>,
    },
    /// Write `data` to the disk at `sector` (whole sectors, on the disk; never on a read-only
    /// disk).
    Out {
        /// First sector.
        sector: u64,
        /// Device-readable guest buffers, in order.
        data: Vec<Segment>,
    },
    /// Make completed writes durable (`fdatasync`).
    Flush,
    /// Write the device ID (up to 20 bytes) into `data`.
    GetId {
        /// Device-writable guest buffers, in order.
        data: Vec<Segment>,
    },
    /// A request type this device does not implement; answered with `VIRTIO_BLK_S_UNSUPP`.
    Unsupported {
        /// The header's `type`.
        request_type: u32,
    },
}

/// A chain with a usable status byte, and the request it carries (or why it is malformed).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Parsed {
    /// Guest-physical address of the status byte (inside guest memory).
    pub status: GuestAddress,
    /// The request, or the error that makes it a `VIRTIO_BLK_S_IOERR`.
    pub request: Result<Request, RequestError>,
}

/// Why a chain is malformed. The first group leaves no usable status byte (the chain goes back
/// with used length 0); the others are answered with `VIRTIO_BLK_S_IOERR`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The chain has no descriptor that could be read.
    #[error("the chain has no readable descriptor")]
    Empty,
    /// The chain stops at a descriptor that says more follow: a loop, a `next` index beyond the
    /// table, a descriptor outside guest memory, a bad indirect table, or more than 2^32 bytes.
    #[error("the chain is cut short (loop, bad next index or unreadable descriptor)")]
    Truncated,
    /// The last descriptor is device-readable, so it cannot hold the status byte.
    #[error("the last descriptor is not device-writable")]
    StatusNotWritable,
    /// The last descriptor has length 0.
    #[error("the last descriptor is empty")]
    StatusEmpty,
    /// The status byte's address is not in guest memory.
    #[error("the status byte is outside guest memory")]
    StatusOutsideMemory,

    /// More descriptors than [`MAX_DESCRIPTORS`].
    #[error("the chain has {0} descriptors; at most 256 are allowed")]
    TooManyDescriptors(usize),
    /// A device-readable descriptor follows a device-writable one (virtio 1.2 §2.7.4.2).
    #[error("a device-readable descriptor follows a device-writable one")]
    ReadableAfterWritable,
    /// A buffer lies (partly) outside guest memory.
    #[error("the {len}-byte buffer at {addr:#x} is outside guest memory")]
    OutsideMemory {
        /// Guest-physical address.
        addr: u64,
        /// Length in bytes.
        len: u32,
    },
    /// Fewer than 16 device-readable bytes.
    #[error("the header needs 16 device-readable bytes; the chain has {0}")]
    HeaderTooShort(u64),
    /// Data in the wrong direction for the request type: device-readable data after the header
    /// of an IN or GET_ID, device-writable data before the status byte of an OUT.
    #[error("data descriptors in the wrong direction for request type {0}")]
    WrongDirection(u32),
    /// A FLUSH with data.
    #[error("a FLUSH request carries data")]
    UnexpectedData,
    /// Data length not a multiple of 512.
    #[error("data length {0} is not a whole number of sectors")]
    NotWholeSectors(u64),
    /// More than [`MAX_DATA_BYTES`] of data.
    #[error("data length {0} exceeds the 16 MiB request limit")]
    TooLarge(u64),
    /// `sector + sectors` does not fit in 64 bits.
    #[error("sector {sector} + {sectors} sectors overflows")]
    SectorOverflow {
        /// First sector.
        sector: u64,
        /// Sectors transferred.
        sectors: u64,
    },
    /// The transfer ends beyond the disk.
    #[error("sectors {sector}..{sector}+{sectors} are beyond the disk's {capacity} sectors")]
    BeyondCapacity {
        /// First sector.
        sector: u64,
        /// Sectors transferred.
        sectors: u64,
        /// Disk size in sectors.
        capacity: u64,
    },
    /// A write to a read-only disk.
    #[error("write to a read-only disk")]
    ReadOnly,
    /// The header could not be read from guest memory.
    #[error("cannot read the request header: {0}")]
    HeaderUnreadable(String),
}

/// Parses one chain's descriptors (in chain order) against `mem` and `limits`.
///
/// # Errors
/// A [`RequestError`] of the first group (see its docs) when the chain has no usable status
/// byte. All other problems are reported in [`Parsed::request`].
pub fn parse_chain<M: GuestMemory>(
    descs: impl IntoIterator<Item = Descriptor>,
    mem: &M,
    limits: DiskLimits,
) -> Result<Parsed, RequestError> {
    let chain = BoundedChain::collect(descs);
    let status_desc = chain.status_descriptor()?;
    let status = status_address(&status_desc, mem)?;
    let request = chain
        .body()
        .and_then(|body| Streams::split(body, &status_desc))
        .and_then(|streams| streams.check_in(mem))
        .and_then(|streams| parse_streams(streams, mem, limits));
    Ok(Parsed { status, request })
}

/// The first [`MAX_DESCRIPTORS`] descriptors of a chain, its last one and its length: memory
/// stays bounded however long an indirect table makes the chain.
struct BoundedChain {
    head: Vec<Descriptor>,
    last: Option<Descriptor>,
    count: usize,
}

impl BoundedChain {
    fn collect(descs: impl IntoIterator<Item = Descriptor>) -> BoundedChain {
        let mut chain = BoundedChain {
            head: Vec::new(),
            last: None,
            count: 0,
        };
        for desc in descs {
            if chain.head.len() < MAX_DESCRIPTORS {
                chain.head.push(desc);
            }
            chain.last = Some(desc);
            chain.count += 1;
        }
        chain
    }

    /// The descriptor holding the status byte: the last one, which must end the chain, be
    /// device-writable and hold at least one byte.
    fn status_descriptor(&self) -> Result<Descriptor, RequestError> {
        let last = self.last.ok_or(RequestError::Empty)?;
        if last.has_next() {
            return Err(RequestError::Truncated);
        }
        if !last.is_write_only() {
            return Err(RequestError::StatusNotWritable);
        }
        if last.len() == 0 {
            return Err(RequestError::StatusEmpty);
        }
        Ok(last)
    }

    /// Every descriptor before the status descriptor.
    fn body(&self) -> Result<&[Descriptor], RequestError> {
        if self.count > MAX_DESCRIPTORS {
            return Err(RequestError::TooManyDescriptors(self.count));
        }
        Ok(&self.head[..self.head.len().saturating_sub(1)])
    }
}

/// The address of the status byte (the last byte of `desc`), if it is in guest memory.
fn status_address<M: GuestMemory>(
    desc: &Descriptor,
    mem: &M,
) -> Result<GuestAddress, RequestError> {
    desc.addr()
        .0
        .checked_add(u64::from(desc.len()) - 1)
        .and_then(|addr| mem.check_address(GuestAddress(addr)))
        .ok_or(RequestError::StatusOutsideMemory)
}

/// The chain's bytes as a device-readable stream followed by a device-writable one (the status
/// byte excluded), with empty descriptors left out.
struct Streams {
    readable: Vec<Segment>,
    writable: Vec<Segment>,
}

impl Streams {
    fn split(body: &[Descriptor], status_desc: &Descriptor) -> Result<Streams, RequestError> {
        let mut streams = Streams {
            readable: Vec::new(),
            writable: Vec::new(),
        };
        for desc in body {
            if desc.is_write_only() {
                streams.writable.push(Segment::of(desc));
            } else if streams.writable.is_empty() {
                streams.readable.push(Segment::of(desc));
            } else {
                return Err(RequestError::ReadableAfterWritable);
            }
        }
        // The status descriptor's bytes before the status byte are writable data.
        streams.writable.push(Segment {
            addr: status_desc.addr(),
            len: status_desc.len() - 1,
        });
        streams.readable.retain(|s| s.len > 0);
        streams.writable.retain(|s| s.len > 0);
        Ok(streams)
    }

    /// Checks that every segment lies inside guest memory.
    fn check_in<M: GuestMemory>(self, mem: &M) -> Result<Streams, RequestError> {
        for seg in self.readable.iter().chain(&self.writable) {
            let fits = seg.addr.0.checked_add(u64::from(seg.len)).is_some()
                && mem.check_range(seg.addr, seg.len as usize);
            if !fits {
                return Err(RequestError::OutsideMemory {
                    addr: seg.addr.0,
                    len: seg.len,
                });
            }
        }
        Ok(self)
    }
}

/// Reads the header off the readable stream and builds the request its type asks for.
fn parse_streams<M: GuestMemory>(
    streams: Streams,
    mem: &M,
    limits: DiskLimits,
) -> Result<Request, RequestError> {
    let (header_segs, readable_data) =
        split_front(&streams.readable, RequestHeader::SIZE as u64)
            .ok_or_else(|| RequestError::HeaderTooShort(total_len(&streams.readable)))?;
    let header = read_header(&header_segs, mem)?;
    let writable_data = streams.writable;
    let wrong_direction = RequestError::WrongDirection(header.request_type);
    match header.request_type {
        VIRTIO_BLK_T_IN => {
            expect_empty(&readable_data, wrong_direction)?;
            check_transfer(header.sector, &writable_data, limits)?;
            Ok(Request::In {
                sector: header.sector,
                data: writable_data,
            })
        }
        VIRTIO_BLK_T_OUT => {
            if limits.read_only {
                return Err(RequestError::ReadOnly);
            }
            expect_empty(&writable_data, wrong_direction)?;
            check_transfer(header.sector, &readable_data, limits)?;
            Ok(Request::Out {
                sector: header.sector,
                data: readable_data,
            })
        }
        VIRTIO_BLK_T_FLUSH => {
            expect_empty(&readable_data, RequestError::UnexpectedData)?;
            expect_empty(&writable_data, RequestError::UnexpectedData)?;
            Ok(Request::Flush)
        }
        VIRTIO_BLK_T_GET_ID => {
            expect_empty(&readable_data, wrong_direction)?;
            Ok(Request::GetId {
                data: writable_data,
            })
        }
        request_type => Ok(Request::Unsupported { request_type }),
    }
}

fn expect_empty(segs: &[Segment], error: RequestError) -> Result<(), RequestError> {
    if segs.is_empty() {
        Ok(())
    } else {
        Err(error)
    }
}

/// Sum of the segments' lengths, in bytes.
pub fn total_len(segs: &[Segment]) -> u64 {
    segs.iter().map(|s| u64::from(s.len)).sum()
}

/// Splits `segs` after its first `n` bytes; `None` if it holds fewer.
fn split_front(segs: &[Segment], n: u64) -> Option<(Vec<Segment>, Vec<Segment>)> {
    let mut front = Vec::new();
    let mut back = Vec::new();
    let mut wanted = n;
    for seg in segs {
        let take = wanted.min(u64::from(seg.len)) as u32;
        wanted -= u64::from(take);
        if take > 0 {
            front.push(Segment {
                addr: seg.addr,
                len: take,
            });
        }
        if take < seg.len {
            back.push(Segment {
                // Inside a range already checked against guest memory: cannot overflow.
                addr: GuestAddress(seg.addr.0 + u64::from(take)),
                len: seg.len - take,
            });
        }
    }
    (wanted == 0).then_some((front, back))
}

/// Gathers the 16 header bytes from `segs` (which hold exactly that many).
fn read_header<M: GuestMemory>(segs: &[Segment], mem: &M) -> Result<RequestHeader, RequestError> {
    let mut raw = [0u8; RequestHeader::SIZE];
    let mut pos = 0;
    for seg in segs {
        let end = pos + seg.len as usize;
        let dst = raw
            .get_mut(pos..end)
            .ok_or(RequestError::HeaderTooShort(end as u64))?;
        mem.read_slice(dst, seg.addr)
            .map_err(|e| RequestError::HeaderUnreadable(e.to_string()))?;
        pos = end;
    }
    Ok(RequestHeader::from_bytes(&raw))
}

/// Validates an IN/OUT transfer of `data` starting at `sector`: whole sectors, at most
/// [`MAX_DATA_BYTES`], and `sector + sectors ≤ capacity` without overflow.
fn check_transfer(sector: u64, data: &[Segment], limits: DiskLimits) -> Result<(), RequestError> {
    let len = total_len(data);
    if len % SECTOR_SIZE != 0 {
        return Err(RequestError::NotWholeSectors(len));
    }
    if len > u64::from(MAX_DATA_BYTES) {
        return Err(RequestError::TooLarge(len));
    }
    let sectors = len >> SECTOR_SHIFT;
    let end = sector
        .checked_add(sectors)
        .ok_or(RequestError::SectorOverflow { sector, sectors })?;
    if end > limits.capacity {
        return Err(RequestError::BeyondCapacity {
            sector,
            sectors,
            capacity: limits.capacity,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use vm_memory::GuestMemoryMmap;

    use super::*;

    const NEXT: u16 = 1;
    const WRITE: u16 = 2;
    const LIMITS: DiskLimits = DiskLimits {
        capacity: 8,
        read_only: false,
    };

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap()
    }

    /// Descriptors at the given (address, length, write) with NEXT set on all but the last.
    fn chain(parts: &[(u64, u32, bool)]) -> Vec<Descriptor> {
        parts
            .iter()
            .enumerate()
            .map(|(i, &(addr, len, write))| {
                let mut flags = if write { WRITE } else { 0 };
                if i + 1 < parts.len() {
                    flags |= NEXT;
                }
                Descriptor::new(addr, len, flags, (i + 1) as u16)
            })
            .collect()
    }

    fn put_header(mem: &GuestMemoryMmap, addr: u64, request_type: u32, sector: u64) {
        let hdr = RequestHeader {
            request_type,
            reserved: 0,
            sector,
        };
        mem.write_slice(&hdr.to_bytes(), GuestAddress(addr))
            .unwrap();
    }

    #[test]
    fn header_round_trips_through_its_wire_form() {
        let hdr = RequestHeader {
            request_type: 1,
            reserved: 7,
            sector: 0x0102_0304_0506_0708,
        };

        let raw = hdr.to_bytes();

        assert_eq!(raw[8], 0x08, "little-endian sector");
        assert_eq!(RequestHeader::from_bytes(&raw), hdr);
    }

    #[test]
    fn chain_longer_than_the_limit_through_an_indirect_table_is_an_ioerr() {
        let mem = mem();
        put_header(&mem, 0x1000, VIRTIO_BLK_T_IN, 0);
        let mut parts = vec![(0x1000, 16, false)];
        parts.extend((0..MAX_DESCRIPTORS).map(|_| (0x2000, 0, true)));
        parts.push((0x3000, 1, true));

        let parsed = parse_chain(chain(&parts), &mem, LIMITS).unwrap();

        assert_eq!(parsed.status, GuestAddress(0x3000));
        assert_eq!(
            parsed.request,
            Err(RequestError::TooManyDescriptors(MAX_DESCRIPTORS + 2))
        );
    }

    #[test]
    fn chain_that_stops_on_a_next_flag_has_no_status_byte() {
        let mem = mem();
        let mut descs = chain(&[(0x1000, 16, false), (0x3000, 1, true)]);
        descs[1] = Descriptor::new(0x3000, 1, WRITE | NEXT, 5);

        let result = parse_chain(descs, &mem, LIMITS);

        assert_eq!(result, Err(RequestError::Truncated));
    }

    #[test]
    fn empty_chain_has_no_status_byte() {
        let result = parse_chain(Vec::new(), &mem(), LIMITS);

        assert_eq!(result, Err(RequestError::Empty));
    }

    #[test]
    fn status_byte_is_the_last_byte_of_the_last_descriptor() {
        let mem = mem();
        put_header(&mem, 0x1000, VIRTIO_BLK_T_IN, 1);

        let parsed = parse_chain(
            chain(&[(0x1000, 16, false), (0x4000, 513, true)]),
            &mem,
            LIMITS,
        )
        .unwrap();

        assert_eq!(parsed.status, GuestAddress(0x4000 + 512));
        let data = vec![Segment {
            addr: GuestAddress(0x4000),
            len: 512,
        }];
        assert_eq!(parsed.request, Ok(Request::In { sector: 1, data }));
    }

    #[test]
    fn header_split_over_descriptors_is_reassembled() {
        let mem = mem();
        let hdr = RequestHeader {
            request_type: VIRTIO_BLK_T_OUT,
            reserved: 0,
            sector: 3,
        }
        .to_bytes();
        mem.write_slice(&hdr[..5], GuestAddress(0x1000)).unwrap();
        // The rest of the header, then 512 bytes of data, in one descriptor.
        mem.write_slice(&hdr[5..], GuestAddress(0x2000)).unwrap();

        let parsed = parse_chain(
            chain(&[
                (0x1000, 5, false),
                (0x2000, 11 + 512, false),
                (0x3000, 1, true),
            ]),
            &mem,
            LIMITS,
        )
        .unwrap();

        let data = vec![Segment {
            addr: GuestAddress(0x2000 + 11),
            len: 512,
        }];
        assert_eq!(parsed.request, Ok(Request::Out { sector: 3, data }));
    }

    #[test]
    fn transfer_ending_exactly_at_capacity_is_accepted_and_one_more_sector_is_not() {
        let at_end = [Segment {
            addr: GuestAddress(0),
            len: 1024,
        }];

        let ok = check_transfer(6, &at_end, LIMITS);
        let beyond = check_transfer(7, &at_end, LIMITS);

        assert_eq!(ok, Ok(()));
        assert!(matches!(beyond, Err(RequestError::BeyondCapacity { .. })));
    }
}
