//! Seeds of the device targets: `virtio_blk`, `vsock` and `virtio_mmio`.

use bulkhead_vmm::devices::virtio::block::{
    Block, BlockConfig, RequestHeader, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN,
    VIRTIO_BLK_T_OUT,
};
use bulkhead_vmm::devices::virtio::vsock::packet::{Header, Op, SHUTDOWN_BOTH, TYPE_STREAM};
use bulkhead_vmm::devices::virtio::vsock::{Vsock, FIRST_LOCAL_PORT, HOST_CID};
use bulkhead_vmm::devices::virtio::VirtioDevice;
use vm_memory::{GuestAddress, GuestMemoryMmap};

use super::Seed;
use crate::input::Encoder;
use crate::queue::{encode_chain, Part, DESC_F_INDIRECT, DESC_F_NEXT, DESC_F_WRITE};
use crate::targets::blk::{disk_pattern, MemImage, SCRATCH};
use crate::targets::mmio::{self, REGISTERS};
use crate::targets::vsock::{GUEST_CID, HOST_PORT};

/// Config byte of an 8-sector disk (bits 1–6 = sectors − 1).
const DISK_8: u8 = 7 << 1;
/// The same disk, copy-on-write over the pattern (bit 7).
const COW: u8 = DISK_8 | 0x80;

fn blk_header(request_type: u32, sector: u64) -> Vec<u8> {
    RequestHeader {
        request_type,
        reserved: 0,
        sector,
    }
    .to_bytes()
    .to_vec()
}

/// op 0 (submit) with `parts`.
fn submit(enc: &mut Encoder, parts: &[Part]) {
    enc.u8(0);
    encode_chain(enc, parts);
}

fn blk_seed(config: u8, chains: &[Vec<Part>]) -> Vec<u8> {
    let mut enc = Encoder::new();
    enc.u8(config);
    for parts in chains {
        submit(&mut enc, parts);
    }
    enc.finish()
}

/// Seeds of `virtio_blk`.
pub fn blk() -> Vec<Seed> {
    let read = |sector| {
        vec![
            Part::Bytes(blk_header(VIRTIO_BLK_T_IN, sector)),
            Part::Write(512),
            Part::Write(1),
        ]
    };
    let write = |sector, byte| {
        vec![
            Part::Bytes(blk_header(VIRTIO_BLK_T_OUT, sector)),
            Part::Fill { len: 512, byte },
            Part::Write(1),
        ]
    };
    let mut batch = Encoder::new();
    batch.u8(DISK_8);
    for sector in 0..3 {
        batch.u8(1);
        encode_chain(&mut batch, &read(sector));
    }
    batch.u8(2);

    // An indirect table in the scratch area: header, 512-byte read buffer, status byte.
    let mut table = Vec::new();
    for (addr, len, flags, next) in [
        (SCRATCH + 0x100, 16u32, DESC_F_NEXT, 1u16),
        (SCRATCH + 0x1000, 512, DESC_F_NEXT | DESC_F_WRITE, 2),
        (SCRATCH + 0x2000, 1, DESC_F_WRITE, 0),
    ] {
        table.extend_from_slice(&addr.to_le_bytes());
        table.extend_from_slice(&len.to_le_bytes());
        table.extend_from_slice(&flags.to_le_bytes());
        table.extend_from_slice(&next.to_le_bytes());
    }
    let mut indirect = Encoder::new();
    indirect.u8(DISK_8);
    indirect.u8(3).u16(0).u8(table.len() as u8).bytes(&table);
    indirect
        .u8(3)
        .u16(0x100)
        .u8(16)
        .bytes(&blk_header(VIRTIO_BLK_T_IN, 2));
    submit(
        &mut indirect,
        &[Part::Raw {
            addr: SCRATCH,
            len: table.len() as u32,
            flags: DESC_F_INDIRECT,
            next: 0,
        }],
    );

    let mut reset = Encoder::new();
    reset.u8(DISK_8);
    submit(&mut reset, &write(3, 0x5a));
    reset.u8(5);
    submit(&mut reset, &read(3));

    let framed = vec![
        Part::Bytes([blk_header(VIRTIO_BLK_T_OUT, 4), vec![0xc3; 256]].concat()),
        Part::Fill {
            len: 256,
            byte: 0x3c,
        },
        Part::Write(1),
    ];
    vec![
        ("virtio_blk", "read-sector", blk_seed(DISK_8, &[read(0)])),
        (
            "virtio_blk",
            "write-then-read",
            blk_seed(DISK_8, &[write(1, 0xab), read(1)]),
        ),
        (
            "virtio_blk",
            "copy-on-write",
            blk_seed(COW, &[read(1), write(1, 0xab), read(1), read(0)]),
        ),
        (
            "virtio_blk",
            "flush",
            blk_seed(
                DISK_8,
                &[vec![
                    Part::Bytes(blk_header(VIRTIO_BLK_T_FLUSH, 0)),
                    Part::Write(1),
                ]],
            ),
        ),
        (
            "virtio_blk",
            "get-id",
            blk_seed(
                DISK_8,
                &[vec![
                    Part::Bytes(blk_header(VIRTIO_BLK_T_GET_ID, 0)),
                    Part::Write(20),
                    Part::Write(1),
                ]],
            ),
        ),
        (
            "virtio_blk",
            "read-only-write",
            blk_seed(DISK_8 | 1, &[write(0, 0xff), read(0)]),
        ),
        (
            "virtio_blk",
            "header-with-data",
            blk_seed(DISK_8, &[framed]),
        ),
        (
            "virtio_blk",
            "beyond-capacity-and-unsupported",
            blk_seed(
                DISK_8,
                &[
                    read(8),
                    vec![Part::Bytes(blk_header(11, 0)), Part::Write(1)],
                ],
            ),
        ),
        ("virtio_blk", "batch", batch.finish()),
        ("virtio_blk", "indirect", indirect.finish()),
        ("virtio_blk", "reset", reset.finish()),
    ]
}

/// A header from guest port `src` to host port `dst`.
fn vsock_header(op: Op, src: u32, dst: u32, len: u32) -> Header {
    Header {
        src_cid: GUEST_CID,
        dst_cid: HOST_CID,
        src_port: src,
        dst_port: dst,
        len,
        type_: TYPE_STREAM,
        op: op as u16,
        flags: 0,
        buf_alloc: 256 << 10,
        fwd_cnt: 0,
    }
}

/// op 0 (tx) with `hdr` and `payload`.
fn tx(enc: &mut Encoder, hdr: Header, payload: &[u8]) {
    let mut parts = vec![Part::Bytes(hdr.to_bytes().to_vec())];
    if !payload.is_empty() {
        parts.push(Part::Bytes(payload.to_vec()));
    }
    enc.u8(0);
    encode_chain(enc, &parts);
}

/// op 2: `n` RX buffers.
fn rx_buffers(enc: &mut Encoder, n: u8) {
    enc.u8(2).u8(n);
}

/// Seeds of `vsock`.
pub fn vsock() -> Vec<Seed> {
    let guest = 5000;
    let mut echo = Encoder::new();
    echo.u8(0);
    rx_buffers(&mut echo, 8);
    tx(
        &mut echo,
        vsock_header(Op::Request, guest, HOST_PORT, 0),
        &[],
    );
    tx(
        &mut echo,
        vsock_header(Op::Rw, guest, HOST_PORT, 5),
        b"hello",
    );
    echo.u8(7);
    echo.u8(5).u8(0).u16(16).u8(b'x');
    rx_buffers(&mut echo, 4);
    tx(
        &mut echo,
        vsock_header(Op::CreditRequest, guest, HOST_PORT, 0),
        &[],
    );
    let mut shutdown = vsock_header(Op::Shutdown, guest, HOST_PORT, 0);
    shutdown.flags = SHUTDOWN_BOTH;
    tx(&mut echo, shutdown, &[]);
    tx(&mut echo, vsock_header(Op::Rst, guest, HOST_PORT, 0), &[]);

    let mut refused = Encoder::new();
    refused.u8(1);
    rx_buffers(&mut refused, 2);
    tx(&mut refused, vsock_header(Op::Request, guest, 999, 0), &[]);

    // Host client → guest port 5000: the device asks the guest, the guest accepts from the
    // first local port, data flows both ways, the host hangs up.
    let host = FIRST_LOCAL_PORT;
    let mut host_initiated = Encoder::new();
    host_initiated.u8(0);
    rx_buffers(&mut host_initiated, 8);
    host_initiated.u8(3).u32(guest);
    tx(
        &mut host_initiated,
        vsock_header(Op::Response, guest, host, 0),
        &[],
    );
    host_initiated.u8(7);
    host_initiated.u8(5).u8(0).u16(100).u8(b'y');
    tx(
        &mut host_initiated,
        vsock_header(Op::Rw, guest, host, 3),
        b"abc",
    );
    let mut update = vsock_header(Op::CreditUpdate, guest, host, 0);
    update.fwd_cnt = 100;
    tx(&mut host_initiated, update, &[]);
    host_initiated.u8(6).u8(0);
    rx_buffers(&mut host_initiated, 4);

    let mut timeout = Encoder::new();
    timeout.u8(0);
    rx_buffers(&mut timeout, 4);
    timeout.u8(3).u32(guest);
    timeout.u8(8).u8(30);

    let mut garbage_line = Encoder::new();
    garbage_line.u8(0);
    rx_buffers(&mut garbage_line, 2);
    let line = b"CONNECT abc\n";
    garbage_line.u8(4).u8(line.len() as u8).bytes(line);
    garbage_line.u8(7);

    vec![
        ("vsock", "guest-connects-and-talks", echo.finish()),
        ("vsock", "guest-connect-refused", refused.finish()),
        ("vsock", "host-connects", host_initiated.finish()),
        ("vsock", "host-connect-times-out", timeout.finish()),
        ("vsock", "bad-connect-line", garbage_line.finish()),
    ]
}

/// Builds `virtio_mmio` inputs.
struct Mmio(Encoder);

impl Mmio {
    fn new(vsock: bool) -> Mmio {
        let mut enc = Encoder::new();
        enc.u8(u8::from(vsock));
        Mmio(enc)
    }

    fn read32(&mut self, offset: u16) -> &mut Self {
        self.0.u8(0).u16(offset).u8(2);
        self
    }

    fn write32(&mut self, offset: u16, value: u32) -> &mut Self {
        match REGISTERS.iter().position(|&r| r == offset) {
            Some(index) => self.0.u8(2).u8(index as u8).u32(value),
            None => self.0.u8(1).u16(offset).u8(2).u64(u64::from(value)),
        };
        self
    }

    /// Linux's probe, feature negotiation and queue set-up (virtio_mmio.c), up to DRIVER_OK.
    fn bring_up(&mut self, features: u64, rings: &[(u64, u64, u64)]) -> &mut Self {
        for reg in [0x000, 0x004, 0x008, 0x00c] {
            self.read32(reg);
        }
        self.write32(0x070, 0).write32(0x070, 1).write32(0x070, 3);
        self.write32(0x014, 1)
            .read32(0x010)
            .write32(0x014, 0)
            .read32(0x010);
        self.write32(0x024, 1)
            .write32(0x020, (features >> 32) as u32);
        self.write32(0x024, 0).write32(0x020, features as u32);
        self.write32(0x070, 0xb).read32(0x070);
        for (index, &(desc, avail, used)) in rings.iter().enumerate() {
            self.write32(0x030, index as u32).read32(0x034);
            self.write32(0x038, u32::from(mmio::QUEUE_SIZE));
            for (low, addr) in [(0x080, desc), (0x090, avail), (0x0a0, used)] {
                self.write32(low, addr as u32)
                    .write32(low + 4, (addr >> 32) as u32);
            }
            self.write32(0x044, 1);
        }
        self.write32(0x070, 0xf)
    }

    fn finish(&self) -> Vec<u8> {
        self.0.finish()
    }
}

/// The features each device offers, read from real instances.
fn offered_features() -> (u64, u64) {
    let image = MemImage::new(&disk_pattern(mmio::DISK_SECTORS));
    let block = Block::new(BlockConfig {
        path: image.path.clone(),
        read_only: false,
        id: None,
        backing: None,
    })
    .expect("block device");
    let dir = tempfile::tempdir().expect("temporary directory");
    let vsock = Vsock::new(GUEST_CID, dir.path().join("v.sock")).expect("vsock device");
    (block.avail_features(), vsock.avail_features())
}

/// Seeds of `virtio_mmio`.
pub fn mmio() -> Vec<Seed> {
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), mmio::MEM_SIZE as usize)])
        .expect("guest memory");
    let blk_rings = mmio::prepared_rings(&mem, false);
    let vsock_rings = mmio::prepared_rings(&mem, true);
    let (blk_features, vsock_features) = offered_features();

    let mut blk = Mmio::new(false);
    blk.bring_up(blk_features, &blk_rings).write32(0x050, 0);
    blk.read32(0x060).write32(0x064, 1).read32(0x0fc);
    for width in 0..4 {
        blk.0.u8(0).u16(0x100).u8(width);
    }

    let mut blk_reset = Mmio::new(false);
    blk_reset
        .bring_up(blk_features, &blk_rings)
        .write32(0x070, 0)
        .read32(0x070)
        .bring_up(blk_features, &blk_rings)
        .write32(0x050, 0);

    let mut bad_queue = Mmio::new(false);
    let outside = [(mmio::MEM_SIZE - 0x10, blk_rings[0].1, blk_rings[0].2)];
    bad_queue.bring_up(blk_features, &outside).read32(0x070);

    let mut vsock = Mmio::new(true);
    vsock
        .bring_up(vsock_features, &vsock_rings)
        .write32(0x050, 0)
        .write32(0x050, 1)
        .read32(0x060)
        .write32(0x064, 1)
        .write32(0x070, 0)
        .read32(0x070);
    for offset in [0x100u16, 0x104] {
        vsock.read32(offset);
    }

    vec![
        ("virtio_mmio", "blk-bring-up-and-read", blk.finish()),
        ("virtio_mmio", "blk-reset-and-again", blk_reset.finish()),
        (
            "virtio_mmio",
            "blk-queue-outside-memory",
            bad_queue.finish(),
        ),
        (
            "virtio_mmio",
            "vsock-bring-up-connect-reset",
            vsock.finish(),
        ),
    ]
}
