//! Finding and killing VMM processes by the runtime directory in their command line, for clean-up
//! when no handle on them is left (a daemon that died between spawning a VMM and recording it).
//! Each VMM runs as `bulkhead-vmm --config <runtime_parent>/sb-*/vm.json`.

use std::fs;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

/// How long to wait for a killed process to go away, ms.
const KILL_WAIT_MS: i32 = 5000;

/// Processes with an argument inside `dir`.
pub fn processes_under(dir: &Path) -> Vec<u32> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| *pid != std::process::id() && mentions(*pid, dir))
        .collect()
}

fn mentions(pid: u32, dir: &Path) -> bool {
    let Ok(cmdline) = fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    cmdline
        .split(|b| *b == 0)
        .filter_map(|arg| std::str::from_utf8(arg).ok())
        .any(|arg| Path::new(arg).starts_with(dir))
}

/// SIGKILLs every process with an argument inside `dir` and waits (up to 5 s each) until it is
/// gone. Returns how many it killed.
pub fn kill_processes_under(dir: &Path) -> usize {
    let mut killed = 0;
    for pid in processes_under(dir) {
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        if fd < 0 {
            continue; // already gone
        }
        // SAFETY: `fd` is a fresh descriptor nothing else owns.
        let pidfd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        // Checked again now that the pidfd pins the process: the pid may have been reused.
        if !mentions(pid, dir) {
            continue;
        }
        tracing::warn!("killing stray process {pid} of {}", dir.display());
        // SAFETY: pidfd_send_signal with a pidfd we own, SIGKILL, no siginfo, no flags.
        unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                pidfd.as_raw_fd(),
                libc::SIGKILL,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        let mut pfd = libc::pollfd {
            fd: pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `pfd` is a valid pollfd for the duration of the call.
        unsafe { libc::poll(&mut pfd, 1, KILL_WAIT_MS) };
        killed += 1;
    }
    killed
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;

    #[test]
    fn a_process_naming_the_dir_is_found_and_killed() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let marker = dir.path().join("sb-1/vm.json");
        let mut child = Command::new("sh")
            .arg("-c")
            // A builtin that blocks on the open stdin pipe: sh neither forks (a forked copy would
            // name the marker too until it exec'd) nor execs something in its place (losing
            // the marker argument).
            .arg("read line")
            .arg(&marker)
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // Until the child has exec'd, its command line is still this test's.
        let cmdline = format!("/proc/{}/cmdline", child.id());
        let started = std::time::Instant::now();
        while !std::fs::read(&cmdline)
            .unwrap_or_default()
            .starts_with(b"sh\0")
        {
            assert!(started.elapsed().as_secs() < 10, "the child never exec'd");
            std::thread::yield_now();
        }

        // Act
        let found = processes_under(dir.path());
        let killed = kill_processes_under(dir.path());

        // Assert
        assert_eq!(found, vec![child.id()]);
        assert_eq!(killed, 1);
        assert!(child.wait().unwrap().code().is_none(), "killed by a signal");
    }
}
