//! Inventories of the host taken before and after guests misbehave, to show the host is
//! unchanged: file trees by content, processes, cgroup directories, and one process's memory and
//! thread counts from `/proc`.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// What [`tree_snapshot`] records of one entry: the kind and content (`dir`, `link -> TARGET`,
/// or `file SHA256`), the mode bits, the size in bytes and the mtime in ns since the epoch.
pub type EntryState = (String, u32, u64, i128);

/// Every entry under `dir` (not following symbolic links), by path relative to `dir`: a file's
/// sha256, a link's target, plus mode, size and mtime, so any write, rename, chmod or touch
/// shows as a difference. `dir` itself is recorded under the empty path.
///
/// # Panics
/// When `dir` or an entry under it cannot be read.
pub fn tree_snapshot(dir: &Path) -> BTreeMap<PathBuf, EntryState> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(path) = stack.pop() {
        let meta = std::fs::symlink_metadata(&path)
            .unwrap_or_else(|e| panic!("stat {}: {e}", path.display()));
        let content = if meta.is_dir() {
            let entries = std::fs::read_dir(&path)
                .unwrap_or_else(|e| panic!("read dir {}: {e}", path.display()));
            stack.extend(entries.map(|e| e.expect("directory entry").path()));
            String::from("dir")
        } else if meta.is_symlink() {
            let target = std::fs::read_link(&path).expect("read link");
            format!("link -> {}", target.display())
        } else {
            let bytes =
                std::fs::read(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
            format!("file {}", crate::sha256_hex(&bytes))
        };
        let mtime = i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec());
        let key = path.strip_prefix(dir).expect("under dir").to_owned();
        out.insert(key, (content, meta.mode(), meta.size(), mtime));
    }
    out
}

/// Process ids of every process on this host (or test host) whose name (`/proc/PID/comm`) is
/// `comm`, e.g. `bulkhead-vmm`.
pub fn processes_named(comm: &str) -> Vec<u32> {
    proc_pids()
        .into_iter()
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|name| name.trim_end() == comm)
        })
        .collect()
}

/// Number of user-space processes on this host (those with a command line; kernel threads,
/// which come and go on their own, have none).
pub fn user_process_count() -> usize {
    proc_pids()
        .into_iter()
        .filter(|pid| std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| !c.is_empty()))
        .count()
}

fn proc_pids() -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect()
}

/// A numeric field of `/proc/PID/status` (e.g. `VmHWM`, `VmRSS` in KiB, `Threads`); `None`
/// when the process is gone or has no such field.
pub fn proc_status_field(pid: u32, field: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
}

/// Every directory (= cgroup) under `/sys/fs/cgroup`, at most `depth` levels down; empty when
/// no cgroup file system is mounted there.
pub fn cgroup_dirs(depth: usize) -> BTreeSet<PathBuf> {
    let root = Path::new("/sys/fs/cgroup");
    let mut out = BTreeSet::new();
    let mut stack = vec![(root.to_owned(), 0)];
    while let Some((dir, level)) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
            if is_dir {
                out.insert(entry.path());
                if level + 1 < depth {
                    stack.push((entry.path(), level + 1));
                }
            }
        }
    }
    out
}

/// Whether process `pid` exists and is not a zombie (an exited child not yet reaped).
pub fn process_running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|text| {
        text.lines()
            .find_map(|l| l.strip_prefix("State:"))
            .is_some_and(|state| !state.trim_start().starts_with(['Z', 'X']))
    })
}

/// `pid` and all its descendants (children found by the parent pid in `/proc/*/stat`), e.g. a
/// VMM and the jailed process it forked.
pub fn process_tree(pid: u32) -> Vec<u32> {
    let parents: Vec<(u32, u32)> = proc_pids()
        .into_iter()
        .filter_map(|p| Some((p, parent_of(p)?)))
        .collect();
    let mut tree = vec![pid];
    let mut i = 0;
    while i < tree.len() {
        let parent = tree[i];
        tree.extend(
            parents
                .iter()
                .filter(|(_, pp)| *pp == parent)
                .map(|(p, _)| *p),
        );
        i += 1;
    }
    tree
}

/// The parent pid of `pid` (field 4 of `/proc/PID/stat`, after the parenthesised name, which
/// may itself contain spaces or parentheses).
fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_name = &stat[stat.rfind(')')? + 1..];
    after_name.split_whitespace().nth(1)?.parse().ok()
}

/// The sum of a numeric `/proc/PID/status` field over `pid`'s [`process_tree`] (`None` when
/// `pid` itself is gone).
pub fn tree_status_sum(pid: u32, field: &str) -> Option<u64> {
    proc_status_field(pid, field)?;
    Some(
        process_tree(pid)
            .into_iter()
            .filter_map(|p| proc_status_field(p, field))
            .sum(),
    )
}
