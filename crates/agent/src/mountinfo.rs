//! The guest's mount table (`/proc/self/mountinfo`, proc(5)) as the `Shares` unmount before a
//! snapshot reads it: a share can be unmounted, and so saved, only while nothing the guest
//! mounted itself holds it: a bind mount of it elsewhere, or a mount over or inside it. Those
//! keep the share's FUSE session alive (or would be taken away with it), so the agent refuses
//! and names them instead ([`foreign`]).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// One mount of the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    /// The file system's device, `major:minor` (every bind mount of it has the same).
    pub device: String,
    /// Where it is mounted.
    pub point: PathBuf,
    /// Its type (`virtiofs`, `overlay`, ...).
    pub fstype: String,
    /// Its source (a virtiofs share's tag).
    pub source: String,
}

/// The entries of a `mountinfo` text, in its order (parents before children); lines that do not
/// parse are skipped.
pub fn parse(text: &str) -> Vec<MountEntry> {
    text.lines().filter_map(parse_line).collect()
}

/// `ID PARENT MAJOR:MINOR ROOT POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS`.
fn parse_line(line: &str) -> Option<MountEntry> {
    let (before, after) = line.split_once(" - ")?;
    let fields: Vec<&str> = before.split(' ').collect();
    let mut rest = after.split(' ');
    Some(MountEntry {
        device: fields.get(2)?.to_string(),
        point: PathBuf::from(unescape(fields.get(4)?)),
        fstype: rest.next()?.to_owned(),
        source: unescape(rest.next()?),
    })
}

/// Undoes the kernel's octal escapes (`\040` for a space, `\011`, `\012`, `\134`).
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|b| (b'0'..=b'7').contains(b)));
        match (bytes[i], octal) {
            (b'\\', Some(d)) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The agent's own share mount: `fstype` at `point`.
#[derive(Debug, Clone, Copy)]
pub struct Ours<'a> {
    /// Where the agent mounted it.
    pub point: &'a Path,
    /// `virtiofs` for a share, `overlay` for a clone workspace.
    pub fstype: &'a str,
}

/// The mounts of `entries` that hold one of the agent's share mounts `ours` from outside the
/// agent: another mount of the same device (a bind mount of the share elsewhere), or a mount at
/// or under one of them that is not itself one of `ours`. Each described for an error message.
pub fn foreign(entries: &[MountEntry], ours: &[Ours]) -> Vec<String> {
    let is_ours = |e: &MountEntry| {
        ours.iter()
            .any(|o| e.point == o.point && e.fstype == o.fstype)
    };
    let devices: BTreeSet<&str> = entries
        .iter()
        .filter(|e| is_ours(e))
        .map(|e| e.device.as_str())
        .collect();
    entries
        .iter()
        .filter(|e| !is_ours(e))
        .filter_map(|e| {
            let point = e.point.display();
            if devices.contains(e.device.as_str()) {
                return Some(format!("{point} (a bind mount of a shared directory)"));
            }
            let covered = ours.iter().find(|o| e.point.starts_with(o.point))?;
            Some(format!(
                "{point} ({}, mounted on the shared directory {})",
                e.fstype,
                covered.point.display()
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str = "\
22 1 0:20 / / rw,relatime - overlay overlay rw,lowerdir=/.bulkhead/lower
23 22 0:21 / /proc rw,nosuid - proc proc rw
30 22 0:30 / /mnt/m1 rw,nosuid,nodev - virtiofs mount0 rw
31 30 0:31 / /mnt/m1/sub rw,nosuid,nodev - virtiofs mount1 rw
32 22 0:32 / /workspace rw,nosuid,nodev - overlay overlay rw,lowerdir=/run/bulkhead/workspace/lower
33 22 0:33 / /run/bulkhead/workspace/rw rw - tmpfs tmpfs rw,mode=700
40 22 0:30 /data /opt/x rw,nosuid,nodev - virtiofs mount0 rw
41 22 0:32 / /opt/w rw,nosuid,nodev - overlay overlay rw
42 30 0:42 / /mnt/m1 rw - tmpfs t rw
43 32 0:43 / /workspace/build\\040dir rw - tmpfs t rw
";

    fn ours() -> Vec<Ours<'static>> {
        vec![
            Ours {
                point: Path::new("/mnt/m1"),
                fstype: "virtiofs",
            },
            Ours {
                point: Path::new("/mnt/m1/sub"),
                fstype: "virtiofs",
            },
            Ours {
                point: Path::new("/workspace"),
                fstype: "overlay",
            },
        ]
    }

    #[test]
    fn a_mountinfo_line_gives_device_point_type_and_source_with_escapes_undone() {
        // Act
        let entries = parse(TABLE);

        // Assert
        assert_eq!(entries.len(), 10);
        assert_eq!(
            entries[2],
            MountEntry {
                device: "0:30".into(),
                point: "/mnt/m1".into(),
                fstype: "virtiofs".into(),
                source: "mount0".into(),
            }
        );
        assert_eq!(entries[9].point, Path::new("/workspace/build dir"));
        assert!(parse("garbage\n\n").is_empty());
    }

    #[test]
    fn bind_mounts_of_shares_and_mounts_over_or_inside_them_are_foreign_and_the_rest_not() {
        // Arrange
        let entries = parse(TABLE);

        // Act
        let found = foreign(&entries, &ours());
        let clean = foreign(&entries[..6], &ours());

        // Assert
        assert_eq!(
            found,
            [
                "/opt/x (a bind mount of a shared directory)",
                "/opt/w (a bind mount of a shared directory)",
                "/mnt/m1 (tmpfs, mounted on the shared directory /mnt/m1)",
                "/workspace/build dir (tmpfs, mounted on the shared directory /workspace)",
            ]
        );
        assert!(clean.is_empty(), "{clean:?}");
    }
}
