//! Seeds of `archive_unpack`: tar streams as the agent packs them (a tree with a symlink, a hard
//! link and a sparse file) and two hostile ones.

use tar::{Builder, EntryType, Header};

use super::Seed;

/// A GNU header of `kind` with fixed metadata (so the seeds are reproducible).
fn header(kind: EntryType, size: u64, mode: u32) -> Header {
    let mut h = Header::new_gnu();
    h.set_entry_type(kind);
    h.set_size(size);
    h.set_mode(mode);
    h.set_mtime(1_700_000_000);
    h
}

fn tree() -> Vec<u8> {
    let mut b = Builder::new(Vec::new());
    let mut dir = header(EntryType::Directory, 0, 0o755);
    b.append_data(&mut dir, "src/", std::io::empty())
        .expect("dir");
    let mut file = header(EntryType::Regular, 5, 0o640);
    b.append_data(&mut file, "src/a", &b"hello"[..])
        .expect("file");
    let mut link = header(EntryType::Symlink, 0, 0o777);
    b.append_link(&mut link, "src/shadow", "/etc/shadow")
        .expect("symlink");
    let mut hard = header(EntryType::Link, 0, 0o640);
    b.append_link(&mut hard, "src/h", "src/a")
        .expect("hard link");
    // A sparse file: 512 bytes of data at 0, a hole up to 8 KiB.
    let mut sparse = header(EntryType::GNUSparse, 512, 0o644);
    if let Some(gnu) = sparse.as_gnu_mut() {
        gnu.set_real_size(8192);
        gnu.sparse[0].set_offset(0);
        gnu.sparse[0].set_length(512);
        gnu.sparse[1].set_offset(8192);
        gnu.sparse[1].set_length(0);
    }
    b.append_data(&mut sparse, "src/sparse", &[b'x'; 512][..])
        .expect("sparse");
    b.into_inner().expect("finish")
}

/// Raw entries whose names `tar::Builder` would refuse.
fn hostile(entries: &[(&[u8], EntryType, &[u8])]) -> Vec<u8> {
    let mut b = Builder::new(Vec::new());
    for (name, kind, target) in entries {
        let mut h = header(*kind, 1, 0o644);
        h.as_old_mut().name[..name.len()].copy_from_slice(name);
        h.as_old_mut().linkname[..target.len()].copy_from_slice(target);
        if *kind != EntryType::Regular {
            h.set_size(0);
        }
        h.set_cksum();
        let data: &[u8] = if *kind == EntryType::Regular {
            b"x"
        } else {
            b""
        };
        b.append(&h, data).expect("entry");
    }
    b.into_inner().expect("finish")
}

/// Seeds of `archive_unpack`.
pub fn seeds() -> Vec<Seed> {
    vec![
        ("archive_unpack", "tree", tree()),
        (
            "archive_unpack",
            "escapes",
            hostile(&[
                (b"../x", EntryType::Regular, b""),
                (b"planted/x", EntryType::Regular, b""),
                (b"h", EntryType::Link, b"../outside"),
            ]),
        ),
        (
            "archive_unpack",
            "own-symlink",
            hostile(&[
                (b"d", EntryType::Symlink, b"../outside"),
                (b"d/x", EntryType::Regular, b""),
            ]),
        ),
    ]
}
