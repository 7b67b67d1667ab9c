//! Child reaping without losing any exit status.
//!
//! As PID 1 (and as a child subreaper in test mode) the agent inherits every orphan in the
//! guest and must `wait` for them, so one thread reaps with `waitpid(-1, WNOHANG)` whenever
//! `SIGCHLD` arrives. Commands the agent started itself are registered in a table
//! (pid → write end of a pipe); when the reaper collects one of those it writes the raw wait
//! status (4 bytes, native endian) into that pipe, where the exec loop polls for it.
//! Everything else is reaped and forgotten.
//!
//! No status is lost because the table's lock is held both across `fork`+register
//! ([`spawn`]) and across each reaping pass: the reaper can never collect a pid that is
//! forked but not yet registered. (Holding it across `spawn` also keeps the reaper from
//! stealing the child that `std` itself waits for when `exec` fails.)
//!
//! `SIGCHLD` is blocked in every thread ([`start`] must run before any other thread exists)
//! and taken synchronously with `sigwait`; `std::process` clears the signal mask in children.

use std::collections::HashMap;
use std::io::{self, Read};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::process::{Child, Command};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::{fs::File, io::Write, thread};

/// Errors of the reaper.
#[derive(Debug, thiserror::Error)]
pub enum ReaperError {
    /// [`start`] was not called.
    #[error("the child reaper is not running")]
    NotStarted,
    /// Blocking SIGCHLD or starting the reaper thread failed.
    #[error("starting the child reaper: {0}")]
    Start(io::Error),
    /// Creating the status pipe or spawning the child failed.
    #[error(transparent)]
    Spawn(#[from] io::Error),
}

/// pid → write end of the pipe that receives its wait status.
type Waiters = HashMap<libc::pid_t, File>;

static WAITERS: OnceLock<Mutex<Waiters>> = OnceLock::new();

fn waiters() -> Result<MutexGuard<'static, Waiters>, ReaperError> {
    let table = WAITERS.get().ok_or(ReaperError::NotStarted)?;
    Ok(table.lock().unwrap_or_else(|p| p.into_inner()))
}

/// Signals that ask PID 1 to end the system: busybox `halt` (SIGUSR1), `poweroff` (SIGUSR2),
/// `reboot` (SIGTERM), and SIGINT (ctrl-alt-del) and SIGPWR. bulkhead ends the VM on all of
/// them, since an x86 guest without ACPI cannot power off by itself (its CPUs would just halt).
const SHUTDOWN_SIGNALS: [libc::c_int; 5] = [
    libc::SIGTERM,
    libc::SIGINT,
    libc::SIGUSR1,
    libc::SIGUSR2,
    libc::SIGPWR,
];

fn signal_set(shutdown_signals: bool) -> libc::sigset_t {
    let mut set = MaybeUninit::<libc::sigset_t>::uninit();
    // SAFETY: sigemptyset initialises the set it is given; sigaddset then modifies that
    // initialised set; all signal numbers are valid.
    unsafe {
        libc::sigemptyset(set.as_mut_ptr());
        libc::sigaddset(set.as_mut_ptr(), libc::SIGCHLD);
        if shutdown_signals {
            for sig in SHUTDOWN_SIGNALS {
                libc::sigaddset(set.as_mut_ptr(), sig);
            }
        }
        set.assume_init()
    }
}

/// Blocks SIGCHLD (and, with `shutdown_signals`, the signals busybox's halt/poweroff/reboot send
/// to PID 1) in the calling thread, and so in every thread it creates later, and starts the
/// reaper thread, which reaps children on SIGCHLD and reboots the guest (ending the VM) on a
/// shutdown signal. Call once, from `main`, before creating any other thread.
pub fn start(shutdown_signals: bool) -> Result<(), ReaperError> {
    let set = signal_set(shutdown_signals);
    // SAFETY: `set` is an initialised sigset_t; the old mask is not wanted (null).
    let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if rc != 0 {
        return Err(ReaperError::Start(io::Error::from_raw_os_error(rc)));
    }
    if WAITERS.set(Mutex::new(HashMap::new())).is_err() {
        return Ok(()); // already running
    }
    thread::Builder::new()
        .name("reaper".into())
        .spawn(move || loop {
            let signo = wait_for_signal(&set);
            if signo == libc::SIGCHLD {
                reap_all();
            } else {
                crate::log!("signal {signo}: shutting the guest down");
                crate::init::reboot();
            }
        })
        .map_err(ReaperError::Start)?;
    Ok(())
}

fn wait_for_signal(set: &libc::sigset_t) -> libc::c_int {
    let mut signo: libc::c_int = 0;
    // SAFETY: `set` and `signo` are valid for the duration of the call.
    unsafe { libc::sigwait(set, &mut signo) };
    signo
}

/// Collects every child that has exited and hands registered pids their status.
fn reap_all() {
    let Ok(mut table) = waiters() else { return };
    loop {
        let mut status: libc::c_int = 0;
        // SAFETY: `status` is a valid c_int to write to; WNOHANG makes this non-blocking.
        let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if pid > 0 {
            if let Some(mut pipe) = table.remove(&pid) {
                // 4 bytes into an empty pipe: atomic and never blocks.
                let _ = pipe.write_all(&status.to_ne_bytes());
            }
            continue;
        }
        if pid < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
            continue;
        }
        return; // 0: children left but none exited; -1/ECHILD: no children at all
    }
}

/// Where a spawned child's wait status arrives: readable once the child has been reaped.
#[derive(Debug)]
pub struct ExitWatch {
    pipe: File,
}

impl ExitWatch {
    /// Reads the raw wait status (blocks until the child is reaped; poll the fd first to
    /// avoid blocking). `None` if the reaper dropped the pipe without a status.
    pub fn read_status(&mut self) -> Option<libc::c_int> {
        let mut buf = [0u8; 4];
        self.pipe.read_exact(&mut buf).ok()?;
        Some(libc::c_int::from_ne_bytes(buf))
    }
}

impl AsFd for ExitWatch {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.pipe.as_fd()
    }
}

impl AsRawFd for ExitWatch {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.pipe.as_raw_fd()
    }
}

fn status_pipe() -> io::Result<(File, File)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both descriptors are fresh and owned by nobody else.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    Ok((File::from(r), File::from(w)))
}

/// Spawns `cmd` and registers the child with the reaper in one step. Never call
/// `Child::wait` on the result: the status arrives through the [`ExitWatch`].
pub fn spawn(cmd: &mut Command) -> Result<(Child, ExitWatch), ReaperError> {
    let (read_end, write_end) = status_pipe()?;
    let mut table = waiters()?;
    let child = cmd.spawn()?;
    let pid = child.id() as libc::pid_t;
    table.insert(pid, write_end);
    drop(table);
    Ok((child, ExitWatch { pipe: read_end }))
}
