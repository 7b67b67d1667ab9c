//! Which processes the guest kernel's OOM killer killed, read from the kernel log.
//!
//! The guest kernel has no memory cgroups and no VM event counters (`/proc/vmstat` has no
//! `oom_kill`), so the one place an OOM kill shows is the record the OOM killer prints:
//! `Out of memory: Killed process PID (COMM) total-vm:...` (`mm/oom_kill.c`,
//! `__oom_kill_process`; `Memory cgroup out of memory: ...` on kernels with memory cgroups), with
//! the victim's pid as the guest's init PID namespace numbers it, which is the pid the agent
//! spawned and reaps. Only records of the kernel facility count: a record user space writes to
//! `/dev/kmsg` is given the user facility by the kernel whatever it claims, so a process in the
//! guest cannot forge one.
//!
//! As PID 1 the agent opens `/dev/kmsg` once ([`watch`]), positioned at its end, and reads it only
//! when asked: [`forget`] when a command starts (an older kill of a reused pid is not the new
//! process's), [`was_killed`] when one has died of `SIGKILL`. Records the ring buffer overwrote
//! before they were read are skipped. In test mode on a host nothing is opened and no process is
//! ever reported killed.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom};
use std::os::unix::fs::OpenOptionsExt;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

/// The kernel log device.
pub const KMSG: &str = "/dev/kmsg";

/// How many killed pids are remembered until asked about; the oldest go first.
pub const REMEMBERED: usize = 1024;

/// How long [`was_killed`] waits, at most, for the kernel's record of a kill whose `SIGKILL`
/// arrived first (the OOM killer sends the signal, then prints).
pub const RECORD_GRACE: Duration = Duration::from_millis(100);

/// The largest record `/dev/kmsg` hands out (the kernel's `CONSOLE_EXT_LOG_MAX`, 8 KiB).
const RECORD_MAX: usize = 8192;

/// What watching the kernel log can fail with.
#[derive(Debug, thiserror::Error)]
pub enum OomError {
    /// `/dev/kmsg` cannot be opened or positioned at its end.
    #[error("{KMSG}: {0}")]
    Open(io::Error),
}

/// The pid an OOM killer's record names, from one `/dev/kmsg` record
/// (`PRI,SEQ,TIME,FLAGS;MESSAGE`, Documentation/ABI/testing/dev-kmsg); `None` for any other
/// record, and for a record whose facility is not the kernel's.
pub fn killed_pid(record: &[u8]) -> Option<u32> {
    let text = std::str::from_utf8(record).ok()?;
    let (prefix, message) = text.split_once(';')?;
    let priority: u32 = prefix.split(',').next()?.trim().parse().ok()?;
    if priority >> 3 != 0 {
        return None;
    }
    let first_line = message.lines().next()?;
    let (_, after) = first_line.split_once(": Killed process ")?;
    let digits: String = after.chars().take_while(char::is_ascii_digit).collect();
    let rest = &after[digits.len()..];
    if !rest.starts_with(" (") {
        return None;
    }
    digits.parse().ok()
}

/// The pids the OOM killer killed that nobody has asked about yet, at most [`REMEMBERED`].
#[derive(Debug, Default)]
pub struct KillLog {
    killed: VecDeque<u32>,
}

impl KillLog {
    /// Takes note of the records in `records` that name an OOM kill.
    pub fn note<'a>(&mut self, records: impl IntoIterator<Item = &'a [u8]>) {
        for pid in records.into_iter().filter_map(killed_pid) {
            if self.killed.len() == REMEMBERED {
                self.killed.pop_front();
            }
            self.killed.push_back(pid);
        }
    }

    /// Whether `pid` was OOM-killed; forgets it either way.
    pub fn take(&mut self, pid: u32) -> bool {
        let before = self.killed.len();
        self.killed.retain(|&p| p != pid);
        self.killed.len() != before
    }
}

/// The open kernel log and what was read from it.
struct Watch {
    kmsg: Option<File>,
    log: KillLog,
}

static WATCH: Mutex<Watch> = Mutex::new(Watch {
    kmsg: None,
    log: KillLog {
        killed: VecDeque::new(),
    },
});

fn watch_state() -> MutexGuard<'static, Watch> {
    // The state is a list of pids: a panic elsewhere cannot leave it inconsistent.
    WATCH.lock().unwrap_or_else(|p| p.into_inner())
}

/// Opens the kernel log, positioned at its end, so later OOM kills can be told (PID 1 only).
///
/// # Errors
/// [`OomError::Open`]; the agent then reports no OOM kills.
pub fn watch() -> Result<(), OomError> {
    let mut kmsg = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(KMSG)
        .map_err(OomError::Open)?;
    kmsg.seek(SeekFrom::End(0)).map_err(OomError::Open)?;
    watch_state().kmsg = Some(kmsg);
    Ok(())
}

impl Watch {
    /// Reads every record the kernel has logged since the last read.
    fn catch_up(&mut self) {
        let Some(kmsg) = self.kmsg.as_mut() else {
            return;
        };
        let mut buf = vec![0u8; RECORD_MAX];
        loop {
            match kmsg.read(&mut buf) {
                Ok(0) => return,
                Ok(n) => self.log.note([&buf[..n]]),
                // EPIPE: records were overwritten before this read; the next read goes on with
                // the oldest one left.
                Err(e) if e.raw_os_error() == Some(libc::EPIPE) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return,
            }
        }
    }
}

/// A command with `pid` has started: an OOM kill of an earlier process with that pid is not its.
pub fn forget(pid: u32) {
    let mut watch = watch_state();
    watch.catch_up();
    watch.log.take(pid);
}

/// Whether the guest's OOM killer killed process `pid` (which has died of `SIGKILL`), waiting
/// up to [`RECORD_GRACE`] for the kernel's record. Always false when the log is not watched.
pub fn was_killed(pid: u32) -> bool {
    let step = Duration::from_millis(10);
    let mut waited = Duration::ZERO;
    loop {
        let mut watch = watch_state();
        if watch.kmsg.is_none() {
            return false;
        }
        watch.catch_up();
        if watch.log.take(pid) {
            return true;
        }
        drop(watch);
        if waited >= RECORD_GRACE {
            return false;
        }
        std::thread::sleep(step);
        waited += step;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GLOBAL: &[u8] = b"3,812,5170314,-;Out of memory: Killed process 431 (hog) \
        total-vm:70000kB, anon-rss:60000kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:200kB \
        oom_score_adj:0";
    const MEMCG: &[u8] =
        b"3,90,100,-;Memory cgroup out of memory: Killed process 77 (java) total-vm:1kB";

    #[test]
    fn the_oom_killers_record_names_the_killed_pid() {
        // Act
        let pids = [killed_pid(GLOBAL), killed_pid(MEMCG)];

        // Assert
        assert_eq!(pids, [Some(431), Some(77)]);
    }

    #[test]
    fn other_records_and_records_written_from_user_space_name_no_kill() {
        // Arrange
        let records: [&[u8]; 6] = [
            // A process in the guest writing the same words: the kernel gives it facility 1.
            b"12,813,5170400,-;Out of memory: Killed process 1 (init) total-vm:1kB",
            b"6,814,5170500,-;oom_reaper: reaped process 431 (hog), now anon-rss:0kB",
            b"4,815,5170600,-;hog invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0",
            b"3,816,5170700,-;Out of memory: Killed process x (hog)",
            b"no separator",
            b"\xff\xfe;Killed process 3 (a)",
        ];

        // Act
        let pids: Vec<_> = records.iter().map(|r| killed_pid(r)).collect();

        // Assert
        assert_eq!(pids, [None; 6]);
    }

    #[test]
    fn a_kill_is_reported_once_for_its_pid_only() {
        // Arrange
        let mut log = KillLog::default();
        log.note([GLOBAL, b"6,1,1,-;unrelated".as_slice()]);

        // Act
        let other = log.take(432);
        let first = log.take(431);
        let again = log.take(431);

        // Assert
        assert_eq!((other, first, again), (false, true, false));
    }

    #[test]
    fn the_oldest_kills_are_forgotten_beyond_the_bound() {
        // Arrange
        let mut log = KillLog::default();
        let records: Vec<Vec<u8>> = (1..=REMEMBERED + 1)
            .map(|pid| format!("3,{pid},1,-;Out of memory: Killed process {pid} (x)").into_bytes())
            .collect();

        // Act
        log.note(records.iter().map(Vec::as_slice));

        // Assert
        assert!(!log.take(1));
        assert!(log.take(2));
        assert!(log.take(REMEMBERED as u32 + 1));
    }

    #[test]
    fn without_the_kernel_log_no_process_is_reported_killed() {
        // Act
        let killed = was_killed(431);

        // Assert
        assert!(!killed);
    }
}
