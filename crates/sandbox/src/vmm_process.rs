//! The VMM process behind a sandbox: a child this process spawned, or one adopted from an earlier
//! owner (e.g. a daemon that restarted). Only a child can be reaped and has a known exit status;
//! an adopted process is watched and signalled through a pidfd (pidfd_open(2), Linux ≥ 5.3), which
//! stays bound to that one process even if its pid is later reused.

use std::fmt;
use std::fs;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Child, ExitStatus};
use std::time::Duration;

use bulkhead_vmm::exit_report::{EndReason, ExitReport};

use crate::process;

/// How long an adopted VMM gets to disappear after SIGKILL.
const KILL_WAIT: Duration = Duration::from_secs(5);

/// How a VMM process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmmExit {
    /// It exited with this code (`bulkhead-vmm`: 0 clean end, 1 error, 3 guest crash, 4
    /// seccomp).
    Code(i32),
    /// A signal ended it.
    Signal(i32),
    /// It ended, but its status went to its parent: an adopted VMM's exit status is unknown.
    Unknown,
}

impl From<ExitStatus> for VmmExit {
    fn from(status: ExitStatus) -> Self {
        match (status.code(), status.signal()) {
            (Some(code), _) => VmmExit::Code(code),
            (None, Some(sig)) => VmmExit::Signal(sig),
            (None, None) => VmmExit::Unknown,
        }
    }
}

impl fmt::Display for VmmExit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VmmExit::Code(code) => write!(f, "exit code {code}"),
            VmmExit::Signal(sig) => write!(f, "killed by signal {sig}"),
            VmmExit::Unknown => f.write_str("exit status unknown (adopted process)"),
        }
    }
}

/// How a VM ended: the VMM process's exit status and the report the VMM wrote about it
/// (`bulkhead-vmm --exit-file`, see [`bulkhead_vmm::exit_report`]). The guest can reach
/// neither: the reason a host reports comes only from these, never from the VMM's log, which
/// holds the guest's console.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmEnd {
    /// The process's exit status ([`VmmExit::Unknown`] for an adopted VMM).
    pub status: VmmExit,
    /// The VMM's exit report, when it wrote one (a VMM killed by a signal writes none).
    pub report: Option<ExitReport>,
}

impl VmEnd {
    /// The end of a VMM that exited with `status`, with the report in `exit_file` (an unreadable
    /// or malformed report is logged and left out).
    pub fn read(status: VmmExit, exit_file: &Path) -> VmEnd {
        let report = match ExitReport::read(exit_file) {
            Ok(report) => report,
            Err(e) => {
                tracing::warn!("{e}");
                None
            }
        };
        VmEnd { status, report }
    }

    /// Whether the VM ended without a fault: the guest reset or powered itself off, or the VMM
    /// was stopped.
    pub fn is_clean(&self) -> bool {
        match &self.report {
            Some(report) => report.is_clean(),
            None => self.status == VmmExit::Code(0),
        }
    }

    /// A machine-readable reason: `guest_shutdown` (the guest reset or powered itself off),
    /// `stopped` (the VMM was told to stop), `guest_crash` (KVM reported a crash, or the VM
    /// failed), `seccomp_violation`, `vmm_error` (the VMM could not run the VM, or ended without
    /// a report), `killed` (a signal ended the VMM), `vanished` (an adopted VMM ended without a
    /// report).
    pub fn reason(&self) -> &'static str {
        match (&self.report, self.status) {
            (Some(report), _) => match report.reason {
                EndReason::Reset | EndReason::PowerOff => "guest_shutdown",
                EndReason::Stopped => "stopped",
                EndReason::GuestCrash | EndReason::Fatal => "guest_crash",
                EndReason::Seccomp => "seccomp_violation",
                EndReason::Error => "vmm_error",
            },
            (None, VmmExit::Signal(_)) => "killed",
            (None, VmmExit::Unknown) => "vanished",
            (None, VmmExit::Code(_)) => "vmm_error",
        }
    }
}

impl fmt::Display for VmEnd {
    /// What the VMM observed, e.g. `the guest reset itself (exit code 0)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.report, self.status) {
            (Some(report), VmmExit::Unknown) => f.write_str(&report.describe()),
            (Some(report), status) => write!(f, "{} ({status})", report.describe()),
            (None, VmmExit::Signal(sig)) => write!(f, "the VMM was killed by signal {sig}"),
            (None, status) => write!(f, "the VMM ended ({status}) without an exit report"),
        }
    }
}

/// A VMM process we did not spawn, held through a pidfd.
#[derive(Debug)]
pub(crate) struct Adopted {
    pid: u32,
    pidfd: OwnedFd,
}

/// The VMM process of a sandbox.
#[derive(Debug)]
pub(crate) enum VmmProcess {
    /// Spawned by this process.
    Child(Child),
    /// Taken over from an earlier owner.
    Adopted(Adopted),
}

impl VmmProcess {
    /// The process ID.
    pub(crate) fn pid(&self) -> u32 {
        match self {
            VmmProcess::Child(child) => child.id(),
            VmmProcess::Adopted(a) => a.pid,
        }
    }

    /// A new pidfd for the process: readable once it exits.
    pub(crate) fn pidfd(&self) -> io::Result<OwnedFd> {
        match self {
            VmmProcess::Child(child) => process::pidfd(child),
            VmmProcess::Adopted(a) => a.pidfd.try_clone(),
        }
    }

    /// Waits up to `timeout` (zero: just checks) for the process to end; reaps a child.
    pub(crate) fn wait_exit(&mut self, timeout: Duration) -> io::Result<Option<VmmExit>> {
        if !process::wait_pidfd(&self.pidfd()?, timeout)? {
            return Ok(None);
        }
        match self {
            VmmProcess::Child(child) => Ok(Some(child.wait()?.into())),
            VmmProcess::Adopted(_) => Ok(Some(VmmExit::Unknown)),
        }
    }

    /// SIGTERM, up to `grace` to exit, then SIGKILL.
    pub(crate) fn terminate(&mut self, grace: Duration) -> io::Result<VmmExit> {
        match self {
            VmmProcess::Child(child) => process::terminate(child, grace).map(VmmExit::from),
            VmmProcess::Adopted(a) => a.terminate(grace),
        }
    }
}

impl Adopted {
    /// Takes hold of process `pid` if it is still the process that started at `start_time`
    /// (clock ticks after boot, see [`start_time`]).
    pub(crate) fn open(pid: u32, start_time: u64) -> io::Result<Adopted> {
        let not_ours = || {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("process {pid} is gone (or its pid now belongs to another process)"),
            )
        };
        if start_time_of(pid).ok() != Some(start_time) {
            return Err(not_ours());
        }
        let pidfd = pidfd_open(pid)?;
        // Checked again with the pidfd open: the pidfd now pins the process we verified.
        if start_time_of(pid).ok() != Some(start_time) {
            return Err(not_ours());
        }
        // A VMM that died but is not reaped yet (a zombie, e.g. reparented to a slow init)
        // still has its pid and start time; its pidfd is already readable.
        if process::wait_pidfd(&pidfd, Duration::ZERO)? {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("process {pid} has exited"),
            ));
        }
        Ok(Adopted { pid, pidfd })
    }

    fn terminate(&mut self, grace: Duration) -> io::Result<VmmExit> {
        if process::wait_pidfd(&self.pidfd, Duration::ZERO)? {
            return Ok(VmmExit::Unknown);
        }
        self.signal(libc::SIGTERM)?;
        if !process::wait_pidfd(&self.pidfd, grace)? {
            tracing::warn!(
                "adopted bulkhead-vmm {} ignored SIGTERM; killing it",
                self.pid
            );
            self.signal(libc::SIGKILL)?;
            if !process::wait_pidfd(&self.pidfd, KILL_WAIT)? {
                return Err(io::Error::other(format!(
                    "process {} survived SIGKILL for {KILL_WAIT:?}",
                    self.pid
                )));
            }
        }
        Ok(VmmExit::Unknown)
    }

    fn signal(&self, signo: libc::c_int) -> io::Result<()> {
        // SAFETY: pidfd_send_signal takes a pidfd we own, a signal number, a null siginfo and no
        // flags.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.pidfd.as_raw_fd(),
                signo,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        let err = io::Error::last_os_error();
        // ESRCH: it exited in the meantime, which is what we want.
        if rc != 0 && err.raw_os_error() != Some(libc::ESRCH) {
            return Err(err);
        }
        Ok(())
    }
}

/// A pidfd for process `pid`.
fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a freshly opened descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// When process `pid` started, in clock ticks after boot (`/proc/<pid>/stat` field 22,
/// `starttime`, proc(5)). With the pid it identifies a process across pid reuse.
///
/// # Errors
/// When the process does not exist or its stat line cannot be parsed.
pub fn start_time_of(pid: u32) -> io::Result<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat"))?;
    parse_start_time(&stat)
        .ok_or_else(|| io::Error::other(format!("cannot parse /proc/{pid}/stat")))
}

/// Field 22 of a stat line. The command name (field 2) is in parentheses and may itself contain
/// spaces and parentheses, so fields are counted from the last `)`.
fn parse_start_time(stat: &str) -> Option<u64> {
    let after_comm = &stat[stat.rfind(')')? + 1..];
    // after_comm starts with field 3 (state): field 22 is the 20th there.
    after_comm.split_whitespace().nth(19)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;

    #[test]
    fn start_time_is_read_past_a_command_name_with_spaces_and_parens() {
        // Arrange
        let line = "42 (a) b (c)) S 1 42 42 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 98765 1000 10";

        // Act
        let start = parse_start_time(line);

        // Assert
        assert_eq!(start, Some(98765));
    }

    #[test]
    fn an_adopted_process_is_terminated_through_its_pidfd() {
        // Arrange
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id();
        let started = start_time_of(pid).unwrap();
        let mut adopted = VmmProcess::Adopted(Adopted::open(pid, started).unwrap());

        // Act
        let exit = adopted.terminate(Duration::from_secs(10)).unwrap();

        // Assert
        assert_eq!(exit, VmmExit::Unknown);
        assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGTERM));
    }

    #[test]
    fn a_process_with_another_start_time_is_not_adopted() {
        // Arrange
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let started = start_time_of(child.id()).unwrap();

        // Act
        let result = Adopted::open(child.id(), started + 1);

        // Assert
        assert_eq!(result.unwrap_err().kind(), io::ErrorKind::NotFound);
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn a_dead_but_unreaped_process_is_not_adopted() {
        // Arrange: a child killed but not waited for stays a zombie with its pid and start time.
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id();
        let started = start_time_of(pid).unwrap();
        // SAFETY: kill(2) of our own, not yet reaped child.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        let pidfd = pidfd_open(pid).unwrap();
        assert!(process::wait_pidfd(&pidfd, Duration::from_secs(10)).unwrap());

        // Act
        let result = Adopted::open(pid, started);

        // Assert
        assert_eq!(result.unwrap_err().kind(), io::ErrorKind::NotFound);
        child.wait().unwrap();
    }
}
