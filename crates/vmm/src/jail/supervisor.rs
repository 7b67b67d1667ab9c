//! The supervisor: the jailed VMM's parent, outside its PID namespace.
//!
//! After `unshare(CLONE_NEWPID)` only the next child enters the new PID namespace, so the VMM
//! forks once. The parent keeps the pid the spawner knows and does nothing but wait:
//!
//! - SIGTERM, SIGINT and SIGHUP are blocked and taken with `sigwaitinfo(2)`, then sent on to
//!   the child (the VMM stops its VM cleanly on each, as without the jail);
//! - when the child ends, the supervisor exits with its exit code, or kills itself with the
//!   signal that killed the child (exit status 128 + N only if that signal does not end it), so
//!   the spawner sees the same status as from an unjailed VMM;
//! - the child gets SIGKILL when the supervisor dies (`PR_SET_PDEATHSIG`; a pipe closes the race
//!   with a supervisor that dies before that is set): a SIGKILLed supervisor leaves no VM behind.

use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use super::{check, Error};

/// Signals that stop the VM.
const STOP_SIGNALS: [libc::c_int; 3] = [libc::SIGTERM, libc::SIGINT, libc::SIGHUP];

/// How the child ended, as the supervisor must end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    /// `exit(code)`.
    Code(i32),
    /// Killed by this signal.
    Signal(i32),
}

/// What a `waitpid` status means for the supervisor; `None` while the child lives (stopped or
/// continued).
fn ending(status: libc::c_int) -> Option<Ending> {
    if libc::WIFEXITED(status) {
        return Some(Ending::Code(libc::WEXITSTATUS(status)));
    }
    if libc::WIFSIGNALED(status) {
        return Some(Ending::Signal(libc::WTERMSIG(status)));
    }
    None
}

fn signal_set(signals: &[libc::c_int]) -> libc::sigset_t {
    let mut set = MaybeUninit::<libc::sigset_t>::uninit();
    // SAFETY: sigemptyset initialises the set behind the valid pointer; sigaddset then only
    // changes that initialised set (the signal numbers are valid).
    unsafe {
        libc::sigemptyset(set.as_mut_ptr());
        for &sig in signals {
            libc::sigaddset(set.as_mut_ptr(), sig);
        }
        set.assume_init()
    }
}

fn mask(how: libc::c_int, signals: &[libc::c_int]) -> Result<(), Error> {
    let set = signal_set(signals);
    // SAFETY: pthread_sigmask reads the valid set; the old mask is not asked for.
    let rc = unsafe { libc::pthread_sigmask(how, &set, std::ptr::null_mut()) };
    if rc != 0 {
        return Err(Error::Sys {
            what: "pthread_sigmask".into(),
            source: std::io::Error::from_raw_os_error(rc),
        });
    }
    Ok(())
}

/// Unblocks SIGTERM, SIGINT and SIGHUP in the calling thread. The jailed VMM calls it once its
/// handlers are installed (a stop request that arrived earlier is delivered then); without the
/// jail the signals were never blocked and this changes nothing.
///
/// # Errors
/// [`Error::Sys`] when `pthread_sigmask` fails.
pub fn unblock_stop_signals() -> Result<(), Error> {
    mask(libc::SIG_UNBLOCK, &STOP_SIGNALS)
}

/// The jailed child's tie to its supervisor.
#[derive(Debug)]
pub(super) struct Supervisor {
    /// Read end of a pipe whose write end only the supervisor holds: it hangs up when the
    /// supervisor is gone.
    alive: OwnedFd,
}

impl Supervisor {
    /// Arms `PR_SET_PDEATHSIG` with SIGKILL, then exits if the supervisor is already gone. The
    /// kernel clears the setting at every change of the effective uid or gid, so this is called
    /// again after each credential step.
    pub(super) fn die_with_it(&self) -> Result<(), Error> {
        let sigkill = libc::SIGKILL as libc::c_ulong;
        // SAFETY: PR_SET_PDEATHSIG takes a signal number and reads no memory.
        let rc = unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, sigkill) };
        check(rc.into(), || "PR_SET_PDEATHSIG".into())?;
        let mut pfd = libc::pollfd {
            fd: self.alive.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll reads and writes the one valid pollfd; a zero timeout never blocks.
        let rc = unsafe { libc::poll(&mut pfd, 1, 0) };
        if rc != 0 {
            // The write end closed: the supervisor died before the signal was armed.
            std::process::exit(1);
        }
        Ok(())
    }
}

/// Forks. Returns in the child (PID 1 of the new PID namespace) with the stop signals still
/// blocked; the parent supervises it and never returns.
pub(super) fn fork_and_supervise() -> Result<Supervisor, Error> {
    let mut all = STOP_SIGNALS.to_vec();
    all.push(libc::SIGCHLD);
    mask(libc::SIG_BLOCK, &all)?;
    let mut pipe = [0; 2];
    // SAFETY: pipe2 writes two descriptors into the valid two-element array.
    let rc = unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) };
    check(rc.into(), || "pipe2".into())?;
    // SAFETY: pipe2 just opened both descriptors and nothing else owns them.
    let (alive_read, alive_write) =
        unsafe { (OwnedFd::from_raw_fd(pipe[0]), OwnedFd::from_raw_fd(pipe[1])) };
    // SAFETY: the process has one thread (a documented precondition of `jail::enter`), so the
    // child may go on running ordinary Rust code.
    let pid = unsafe { libc::fork() };
    check(pid.into(), || "fork".into())?;
    if pid == 0 {
        drop(alive_write);
        let supervisor = Supervisor { alive: alive_read };
        supervisor.die_with_it()?;
        mask(libc::SIG_UNBLOCK, &[libc::SIGCHLD])?;
        return Ok(supervisor);
    }
    drop(alive_read);
    // Held open until the supervisor exits.
    std::mem::forget(alive_write);
    supervise(pid)
}

/// The supervisor's loop: forwards stop signals, ends as the child did.
fn supervise(child: libc::pid_t) -> ! {
    let mut all = STOP_SIGNALS.to_vec();
    all.push(libc::SIGCHLD);
    let set = signal_set(&all);
    loop {
        // SAFETY: sigwaitinfo reads the valid set; no siginfo is asked for.
        let sig = unsafe { libc::sigwaitinfo(&set, std::ptr::null_mut()) };
        if STOP_SIGNALS.contains(&sig) {
            // SAFETY: kill of our own, not yet reaped child (its pid cannot be reused).
            unsafe { libc::kill(child, sig) };
            continue;
        }
        let mut status = 0;
        // SAFETY: waitpid writes the status into the valid local; WNOHANG never blocks.
        let reaped = unsafe { libc::waitpid(child, &mut status, libc::WNOHANG) };
        if reaped == child {
            if let Some(end) = ending(status) {
                end_as(end);
            }
        } else if reaped < 0 {
            // The child is gone without a status we could read; nothing left to supervise.
            std::process::exit(1);
        }
    }
}

/// Exits with `end`'s code, or dies of its signal.
fn end_as(end: Ending) -> ! {
    let sig = match end {
        Ending::Code(code) => std::process::exit(code),
        Ending::Signal(sig) => sig,
    };
    // SAFETY: restores the default action of a valid signal number, unblocks it and raises it
    // in this single-threaded process; core dumps are off (RLIMIT_CORE 0).
    unsafe {
        libc::signal(sig, libc::SIG_DFL);
        let set = signal_set(&[sig]);
        libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
        libc::raise(sig);
    }
    std::process::exit(128 + sig)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exit_code_and_a_fatal_signal_are_told_apart() {
        // Arrange: wait(2) statuses as the kernel encodes them.
        let exited_3 = 3 << 8;
        let killed_by_sigsys = libc::SIGSYS;
        let stopped = (libc::SIGSTOP << 8) | 0x7f;

        // Act / Assert
        assert_eq!(ending(exited_3), Some(Ending::Code(3)));
        assert_eq!(ending(killed_by_sigsys), Some(Ending::Signal(libc::SIGSYS)));
        assert_eq!(ending(stopped), None);
    }
}
