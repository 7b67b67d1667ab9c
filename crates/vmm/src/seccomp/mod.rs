//! seccomp-BPF allowlists, one per kind of VMM thread.
//!
//! A guest that escapes into the VMM (a bug in a device model, say) runs with the VMM's host
//! privileges. The filters shrink what it can then ask of the host kernel to what each thread
//! needs for its job once the VM runs:
//!
//! - [`ThreadKind::Vcpu`]: `KVM_RUN` and a few KVM reads, the device accesses its exits are
//!   routed to (eventfd and console writes), and what the runtime needs (`vcpu.rs`).
//! - [`ThreadKind::EventLoop`]: the main thread's event loop, which serves virtio-vsock (Unix
//!   sockets), virtio-blk (positioned reads and writes on the disk images) and virtio-fs (the
//!   passthrough file system's `*at` calls, owner-identity switching), then tears the VM down
//!   (`event_loop.rs`).
//! - [`ThreadKind::Signal`]: the thread that turns SIGTERM/SIGINT/SIGHUP into a VM stop
//!   (`signal.rs`).
//!
//! Every filter also allows a shared core (`rules::common`): memory management, futexes, the
//! signal handlers' own calls (including the SIGSYS handler's `write` and `exit_group`). None
//! allows `execve`, `clone`, `ptrace`, `mount`, `bpf`, `open_by_handle_at`, or a socket other than
//! a Unix one; `ioctl` is limited to the request numbers each thread needs; nothing may map or
//! re-protect memory as executable.
//!
//! A filter is installed by the thread itself right before its loop starts, after everything
//! that needs `open`, `mmap` of device regions or `KVM_CREATE_*` is done: filters are
//! per-thread (no `TSYNC`), and threads started later would inherit the starting thread's
//! filter. What happens to a call outside the list depends on [`SeccompMode`]: with
//! [`SeccompMode::On`] the kernel sends SIGSYS, whose handler writes
//! `bulkhead-vmm: seccomp: blocked syscall N (<thread kind>)` to stderr and exits the process
//! with [`EXIT_BLOCKED_SYSCALL`]; with [`SeccompMode::Log`] the call proceeds and the kernel
//! records it in its audit log (`type=1326`, see `dmesg`), which is how new call sites are found.
//!
//! The lists use the build target's system call numbers (`libc::SYS_*`) and were checked on
//! x86_64 only.

mod event_loop;
pub(crate) mod rules;
mod signal;
mod sigsys;
mod vcpu;

use std::fmt;
use std::str::FromStr;

use seccompiler::{BpfProgram, SeccompAction, SeccompFilter, TargetArch};

pub use sigsys::EXIT_BLOCKED_SYSCALL;

/// Makes the SIGSYS handler also write an exit report (see [`crate::exit_report`]) to the open
/// descriptor `fd`, which must stay open for the life of the process.
pub fn report_blocked_calls_to(fd: std::os::fd::RawFd) {
    sigsys::set_report_fd(fd);
}

use rules::Allowlist;

/// Errors from building or installing filters.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A `--seccomp` value other than `on`, `off` or `log`.
    #[error("seccomp mode must be on, off or log, got `{0}`")]
    Mode(String),
    /// The build target is an architecture seccompiler cannot emit filters for.
    #[error("no seccomp filters for the {0} architecture")]
    Arch(&'static str),
    /// seccompiler rejected a filter (a bug in the lists).
    #[error("cannot compile the {kind} seccomp filter: {source}")]
    Compile {
        /// The thread kind whose filter failed.
        kind: ThreadKind,
        /// What seccompiler reported.
        source: seccompiler::BackendError,
    },
    /// The SIGSYS handler could not be installed.
    #[error("cannot install the SIGSYS handler: {0}")]
    SigsysHandler(std::io::Error),
    /// `prctl(PR_SET_NO_NEW_PRIVS)` or `seccomp(SECCOMP_SET_MODE_FILTER)` failed.
    #[error("cannot install the {kind} seccomp filter: {source}")]
    Install {
        /// The thread kind whose filter failed.
        kind: ThreadKind,
        /// What seccompiler reported (with the OS error).
        source: seccompiler::Error,
    },
}

/// What the filters do with a system call outside their allowlist.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SeccompMode {
    /// Kill the VMM: SIGSYS, a log line naming the call, exit status [`EXIT_BLOCKED_SYSCALL`].
    #[default]
    On,
    /// Install no filters.
    Off,
    /// Allow the call and have the kernel log it to its audit log (for finding missing calls).
    Log,
}

impl FromStr for SeccompMode {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "on" => Ok(SeccompMode::On),
            "off" => Ok(SeccompMode::Off),
            "log" => Ok(SeccompMode::Log),
            other => Err(Error::Mode(other.to_owned())),
        }
    }
}

impl fmt::Display for SeccompMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SeccompMode::On => "on",
            SeccompMode::Off => "off",
            SeccompMode::Log => "log",
        })
    }
}

/// The kinds of VMM threads, each with its own allowlist.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThreadKind {
    /// A vCPU thread (`KVM_RUN` loop).
    Vcpu,
    /// The main thread's event loop (virtio device back-ends, VM teardown).
    EventLoop,
    /// The signal-handling thread.
    Signal,
}

impl ThreadKind {
    /// Every kind, in a fixed order.
    pub const ALL: [ThreadKind; 3] = [ThreadKind::Vcpu, ThreadKind::EventLoop, ThreadKind::Signal];

    /// The name used in log lines (`vcpu`, `event loop`, `signal`).
    pub fn label(self) -> &'static str {
        match self {
            ThreadKind::Vcpu => "vcpu",
            ThreadKind::EventLoop => "event loop",
            ThreadKind::Signal => "signal",
        }
    }

    /// The allowlist of this kind of thread.
    pub(crate) fn allowlist(self) -> Allowlist {
        match self {
            ThreadKind::Vcpu => vcpu::allowlist(),
            ThreadKind::EventLoop => event_loop::allowlist(),
            ThreadKind::Signal => signal::allowlist(),
        }
    }

    /// How many distinct system calls this kind's filter allows.
    pub fn allowed_syscall_count(self) -> usize {
        self.allowlist().len()
    }

    /// Whether this kind's filter allows system call `nr` (under some argument condition).
    pub fn allows(self, nr: i64) -> bool {
        self.allowlist().contains(nr)
    }
}

impl fmt::Display for ThreadKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// The architecture of this build, as seccompiler names it.
///
/// # Errors
/// [`Error::Arch`] on an architecture seccompiler does not support.
pub fn host_arch() -> Result<TargetArch, Error> {
    TargetArch::try_from(std::env::consts::ARCH).map_err(|_| Error::Arch(std::env::consts::ARCH))
}

/// Compiles `kind`'s allowlist into a BPF program for `arch`, with `mismatch` as the action for
/// calls outside it.
///
/// # Errors
/// [`Error::Compile`].
pub fn compile(
    kind: ThreadKind,
    arch: TargetArch,
    mismatch: SeccompAction,
) -> Result<BpfProgram, Error> {
    let compile_err = |source| Error::Compile { kind, source };
    let rules = kind.allowlist().into_rules().map_err(compile_err)?;
    let filter =
        SeccompFilter::new(rules, mismatch, SeccompAction::Allow, arch).map_err(compile_err)?;
    BpfProgram::try_from(filter).map_err(compile_err)
}

/// The compiled filters of every thread kind for one [`SeccompMode`], shared by the threads
/// that install them.
#[derive(Debug)]
pub struct ThreadFilters {
    mode: SeccompMode,
    /// Indexed like [`ThreadKind::ALL`]; empty when the mode is [`SeccompMode::Off`].
    programs: Vec<BpfProgram>,
}

impl ThreadFilters {
    /// Filters that install nothing ([`SeccompMode::Off`]).
    pub fn disabled() -> ThreadFilters {
        ThreadFilters {
            mode: SeccompMode::Off,
            programs: Vec::new(),
        }
    }

    /// Compiles every kind's filter for this host. With [`SeccompMode::On`] this also installs
    /// the process's SIGSYS handler (before any filter can trap).
    ///
    /// # Errors
    /// [`Error::Arch`], [`Error::Compile`], [`Error::SigsysHandler`].
    pub fn new(mode: SeccompMode) -> Result<ThreadFilters, Error> {
        let mismatch = match mode {
            SeccompMode::Off => return Ok(ThreadFilters::disabled()),
            SeccompMode::On => SeccompAction::Trap,
            SeccompMode::Log => SeccompAction::Log,
        };
        let arch = host_arch()?;
        let programs = ThreadKind::ALL
            .iter()
            .map(|&kind| compile(kind, arch, mismatch.clone()))
            .collect::<Result<Vec<_>, _>>()?;
        if mode == SeccompMode::On {
            sigsys::install_handler().map_err(Error::SigsysHandler)?;
        }
        Ok(ThreadFilters { mode, programs })
    }

    /// The mode these filters were built for.
    pub fn mode(&self) -> SeccompMode {
        self.mode
    }

    /// Installs `kind`'s filter on the calling thread (nothing when disabled). It stays for the
    /// thread's life and is inherited by threads it starts afterwards.
    ///
    /// # Errors
    /// [`Error::Install`].
    pub fn install(&self, kind: ThreadKind) -> Result<(), Error> {
        let Some(index) = ThreadKind::ALL.iter().position(|&k| k == kind) else {
            return Ok(());
        };
        let Some(program) = self.programs.get(index) else {
            return Ok(());
        };
        sigsys::set_thread_kind(kind);
        seccompiler::apply_filter(program).map_err(|source| Error::Install { kind, source })?;
        tracing::debug!(
            mode = %self.mode,
            allowed = kind.allowed_syscall_count(),
            "seccomp: {kind} filter installed"
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests;
