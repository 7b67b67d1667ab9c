//! Seeds of `virtio_fs`: short FUSE sessions, each starting with FUSE_INIT. Node IDs follow the
//! passthrough file system's numbering (the root is 1, each new node gets the next number from
//! 2 on) and file handles start at 1.

use fuse_backend_rs::abi::fuse_abi::{
    AccessIn, BatchForgetIn, CopyFileRangeIn, CreateIn, FallocateIn, ForgetIn, ForgetOne,
    GetattrIn, GetxattrIn, InitIn, LinkIn, LseekIn, MkdirIn, MknodIn, Opcode, OpenIn, ReadIn,
    ReleaseIn, RenameIn, SetattrIn, WriteIn,
};
use vm_memory::ByteValued;

use super::Seed;
use crate::input::Encoder;
use crate::queue::{encode_chain, Part};
use crate::targets::fs::{Request, FUSE_INIT};

/// Builds one `virtio_fs` input.
struct Session(Encoder);

impl Session {
    fn new(read_only: bool) -> Session {
        let mut enc = Encoder::new();
        enc.u8(u8::from(read_only));
        let init = InitIn {
            major: 7,
            minor: 33,
            max_readahead: 128 << 10,
            flags: 0,
        };
        enc.u8(0);
        Request::new(FUSE_INIT, 0, init.as_slice()).encode(&mut enc);
        Session(enc)
    }

    fn req(&mut self, request: Request) -> &mut Self {
        self.0.u8(0);
        request.encode(&mut self.0);
        self
    }

    fn call(&mut self, opcode: Opcode, nodeid: u64, args: &[u8]) -> &mut Self {
        self.req(Request::new(opcode as u32, nodeid, args))
    }

    fn finish(&self) -> Vec<u8> {
        self.0.finish()
    }
}

/// `name` and its NUL.
fn name(name: &str) -> Vec<u8> {
    [name.as_bytes(), b"\0"].concat()
}

fn with_name<T: ByteValued>(args: T, n: &str) -> Vec<u8> {
    [args.as_slice(), &name(n)].concat()
}

fn read_in(fh: u64, size: u32) -> Vec<u8> {
    ReadIn {
        fh,
        size,
        ..ReadIn::default()
    }
    .as_slice()
    .to_vec()
}

fn release_in(fh: u64) -> Vec<u8> {
    ReleaseIn {
        fh,
        ..ReleaseIn::default()
    }
    .as_slice()
    .to_vec()
}

/// Seeds of `virtio_fs`.
pub fn seeds() -> Vec<Seed> {
    let open_ro = OpenIn {
        flags: libc::O_RDONLY as u32,
        fuse_flags: 0,
    };
    let mut read_file = Session::new(false);
    read_file
        .call(Opcode::Lookup, 1, &name("file"))
        .call(Opcode::Getattr, 2, GetattrIn::default().as_slice())
        .call(Opcode::Open, 2, open_ro.as_slice())
        .call(Opcode::Read, 2, &read_in(1, 1024))
        .call(Opcode::Release, 2, &release_in(1));

    let mut list_root = Session::new(false);
    list_root
        .call(Opcode::Opendir, 1, open_ro.as_slice())
        .call(Opcode::Readdir, 1, &read_in(1, 4096))
        .call(Opcode::Readdirplus, 1, &read_in(1, 4096))
        .call(Opcode::Releasedir, 1, &release_in(1));

    let create = CreateIn {
        flags: libc::O_RDWR as u32,
        mode: libc::S_IFREG | 0o644,
        umask: 0o022,
        fuse_flags: 0,
    };
    let write = WriteIn {
        fh: 1,
        size: 4,
        ..WriteIn::default()
    };
    let truncate = SetattrIn {
        valid: 1 << 3, // FATTR_SIZE
        fh: 1,
        size: 2,
        ..SetattrIn::default()
    };
    let mut create_write = Session::new(false);
    create_write
        .call(Opcode::Create, 1, &with_name(create, "new"))
        .call(Opcode::Write, 2, &[write.as_slice(), b"data"].concat())
        .call(Opcode::Flush, 2, release_in(1).as_slice())
        .call(Opcode::Setattr, 2, truncate.as_slice())
        .call(Opcode::Release, 2, &release_in(1))
        .call(Opcode::Unlink, 1, &name("new"));

    let mkdir = MkdirIn {
        mode: 0o755,
        umask: 0,
    };
    let rename = RenameIn { newdir: 1 };
    let mut dirs = Session::new(false);
    dirs.call(Opcode::Mkdir, 1, &with_name(mkdir, "d"))
        .call(
            Opcode::Rename,
            1,
            &[rename.as_slice(), &name("d"), &name("e")].concat(),
        )
        .call(Opcode::Symlink, 1, &[name("ln"), name("file")].concat())
        .call(Opcode::Lookup, 1, &name("file"))
        .call(Opcode::Link, 1, &with_name(LinkIn { oldnodeid: 4 }, "hard"))
        .call(
            Opcode::Mknod,
            1,
            &with_name(
                MknodIn {
                    mode: libc::S_IFIFO | 0o644,
                    ..MknodIn::default()
                },
                "p",
            ),
        )
        .call(Opcode::Rmdir, 1, &name("e"));

    let mut escape = Session::new(false);
    escape
        .call(Opcode::Lookup, 1, &name("escape"))
        .call(Opcode::Readlink, 2, &[])
        .call(Opcode::Open, 2, open_ro.as_slice())
        .call(Opcode::Lookup, 1, &name(".."))
        .call(Opcode::Lookup, 1, &name("escape/secret"))
        .call(Opcode::Lookup, 1, &name("fifo"))
        .call(Opcode::Open, 3, open_ro.as_slice());

    let forget = ForgetIn { nlookup: 1 };
    let batch = BatchForgetIn { count: 2, dummy: 0 };
    let one = ForgetOne {
        nodeid: 2,
        nlookup: 1,
    };
    let mut forget_seed = Session::new(false);
    forget_seed
        .call(Opcode::Lookup, 1, &name("file"))
        .call(Opcode::Lookup, 1, &name("dir"))
        .req(Request {
            hiprio: true,
            reply_room: 0,
            ..Request::new(Opcode::Forget as u32, 2, forget.as_slice())
        })
        .req(Request {
            hiprio: true,
            reply_room: 0,
            ..Request::new(
                Opcode::BatchForget as u32,
                0,
                &[batch.as_slice(), one.as_slice(), one.as_slice()].concat(),
            )
        })
        .call(Opcode::Getattr, 3, GetattrIn::default().as_slice());

    let mut metadata = Session::new(false);
    metadata
        .call(Opcode::Statfs, 1, &[])
        .call(
            Opcode::Getxattr,
            1,
            &with_name(
                GetxattrIn {
                    size: 64,
                    padding: 0,
                },
                "user.x",
            ),
        )
        .call(Opcode::Listxattr, 1, GetxattrIn::default().as_slice())
        .call(
            Opcode::Access,
            1,
            AccessIn {
                mask: libc::W_OK as u32,
                padding: 0,
            }
            .as_slice(),
        );

    let open_rw = OpenIn {
        flags: libc::O_RDWR as u32,
        fuse_flags: 0,
    };
    let mut ranges = Session::new(false);
    ranges
        .call(Opcode::Lookup, 1, &name("file"))
        .call(Opcode::Open, 2, open_rw.as_slice())
        .call(
            Opcode::Fallocate,
            2,
            FallocateIn {
                fh: 1,
                offset: 0,
                length: 8192,
                mode: 0,
                padding: 0,
            }
            .as_slice(),
        )
        .call(
            Opcode::Lseek,
            2,
            LseekIn {
                fh: 1,
                offset: 0,
                whence: libc::SEEK_DATA as u32,
                padding: 0,
            }
            .as_slice(),
        )
        .call(
            Opcode::CopyFileRange,
            2,
            CopyFileRangeIn {
                fh_in: 1,
                offset_in: 0,
                nodeid_out: 2,
                fh_out: 1,
                offset_out: 100,
                len: 10,
                flags: 0,
            }
            .as_slice(),
        );

    let mut read_only = Session::new(true);
    read_only
        .call(Opcode::Create, 1, &with_name(create, "new"))
        .call(Opcode::Lookup, 1, &name("file"))
        .call(Opcode::Open, 2, open_rw.as_slice())
        .call(Opcode::Unlink, 1, &name("file"));

    let mut framing = Session::new(false);
    framing
        .req(Request {
            split: true,
            ..Request::new(Opcode::Lookup as u32, 1, &name("dir"))
        })
        .req(Request {
            len: Some(1000),
            ..Request::new(Opcode::Lookup as u32, 1, &name("file"))
        })
        .req(Request {
            reply_room: 8,
            ..Request::new(Opcode::Getattr as u32, 1, GetattrIn::default().as_slice())
        });
    framing.0.u8(1).u8(1);
    encode_chain(&mut framing.0, &[Part::Bytes(vec![0; 20]), Part::Write(64)]);

    vec![
        ("virtio_fs", "read-file", read_file.finish()),
        ("virtio_fs", "list-root", list_root.finish()),
        ("virtio_fs", "create-write-unlink", create_write.finish()),
        ("virtio_fs", "dirs-and-links", dirs.finish()),
        ("virtio_fs", "escape-attempts", escape.finish()),
        ("virtio_fs", "forget", forget_seed.finish()),
        ("virtio_fs", "metadata", metadata.finish()),
        ("virtio_fs", "ranges", ranges.finish()),
        ("virtio_fs", "read-only-share", read_only.finish()),
        ("virtio_fs", "framing", framing.finish()),
    ]
}
