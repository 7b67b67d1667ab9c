//! Serving `Restored`: the host restored this VM from a snapshot and says so, so that this
//! clone becomes a machine of its own.
//!
//! # Why
//!
//! A snapshot freezes the guest's whole memory, the kernel's random number generator included.
//! Every VM restored from one snapshot (and one snapshot may be restored many times, as clones)
//! resumes with the *same* CRNG state, so the clones would hand out the same "random" bytes from
//! `getrandom(2)` and `/dev/urandom` (random(4)): the same keys, nonces, UUIDs and ASLR offsets
//! for new processes. Linux reseeds by itself only on a VM generation ID change (`vmgenid`,
//! Linux 5.18+, an ACPI device this VMM does not provide) or periodically, at most once a
//! minute (`CRNG_RESEED_INTERVAL` in `drivers/char/random.c`). Likewise the guest's wall clock
//! is as old as the snapshot. The host therefore sends a [`RestoredRequest`] with fresh
//! randomness of its own, its `CLOCK_REALTIME` and optionally a new hostname. (User-space
//! generators seeded before the snapshot, e.g. in a process that was running then, keep their
//! state; only the kernel's is renewed here.)
//!
//! # What
//!
//! [`plan`] checks the whole request first and turns it into [`Action`]s; a bad request is
//! refused with an `Error` frame before anything changes. [`apply`] then performs them in order
//! through a [`Machine`]:
//!
//! 1. [`Action::AddEntropy`]: `ioctl(RNDADDENTROPY)` on `/dev/urandom` mixes the bytes into the
//!    input pool and credits all of them (8 bits per byte; random(4), `linux/random.h`).
//! 2. [`Action::ReseedCrng`]: `ioctl(RNDRESEEDCRNG)` (Linux 4.17+) reseeds the CRNG from that pool
//!    at once. Kernels without it answer `EINVAL` (unknown request, before Linux 4.17) or
//!    `ENOTTY`; they reseed when credited entropy arrives, which step 1 provided, so those two
//!    answers count as success.
//! 3. [`Action::SetClock`]: `clock_settime(CLOCK_REALTIME)` (clock_settime(2)).
//! 4. [`Action::SetHostname`], when the request names one: `sethostname(2)`, after the same check
//!    as the boot parameter `bulkhead.hostname=` ([`check_hostname`]). Boot sets the hostname
//!    only in the kernel (the agent writes no `/etc/hostname`), so that is all there is to update.
//! 5. [`Action::Workspace`] and [`Action::Mount`], for the shares the host attached to the
//!    snapshot's idle virtio-fs devices (`share_params`, the boot-parameter codec's
//!    `bulkhead.workspace=` and `bulkhead.mount=` words): the clone workspace's overlay, then
//!    each share, exactly as a boot with those parameters builds them ([`crate::workspace`],
//!    [`crate::mounts`]).
//! 6. [`Action::StartEgress`], when the host now runs an egress proxy for this clone
//!    (`egress`): the relay on `127.0.0.1:3128` starts, as `bulkhead.egress=on` starts it at
//!    boot ([`crate::egress::start_guest_relay`]; nothing happens when it already runs).
//!
//! The answer is `Ack` once every step succeeded; otherwise an `Error` frame naming the failed
//! step. Steps before it stay done (each is harmless alone) and later ones are skipped.
//!
//! # Where
//!
//! The kernel is changed only in the guest: the agent's PID-1 mode calls [`apply_to_kernel`].
//! In test mode and in the daemon's fake VMM the agent runs on the host, whose entropy pool,
//! clock and hostname it must not touch (tests run as root in CI): there a valid request is
//! checked, logged and acknowledged without changing anything ([`DryRun`]).

use std::fmt;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bulkhead_protocol::boot::{check_hostname, BootParamError, BootParams, Share, MAX_HOSTNAME};
use bulkhead_protocol::{
    write_frame, Ack, ErrorCode, Frame, RestoredRequest, MAX_RESTORE_ENTROPY, MIN_RESTORE_ENTROPY,
    PROTOCOL_VERSION,
};

use crate::conn::Conn;
use crate::{egress, init, log, mounts, workspace};

/// `RNDADDENTROPY` = `_IOW('R', 0x03, int[2])` (`linux/random.h`): add and credit entropy.
pub const RNDADDENTROPY: u32 = 0x4008_5203;

/// `RNDRESEEDCRNG` = `_IO('R', 0x07)` (`linux/random.h`, Linux 4.17+): reseed the CRNG now.
pub const RNDRESEEDCRNG: u32 = 0x5207;

/// The latest time Linux lets `CLOCK_REALTIME` be set to, in seconds since the epoch
/// (`TIME_SETTOD_SEC_MAX` in `include/linux/time64.h`: `KTIME_SEC_MAX` less 30 years of uptime,
/// early 2232); `clock_settime` refuses later times with `EINVAL`.
pub const MAX_CLOCK_SECS: u64 = (i64::MAX as u64) / 1_000_000_000 - 30 * 365 * 24 * 3600;

/// Longest bad hostname quoted back in an error message, in characters.
const QUOTED_HOSTNAME: usize = MAX_HOSTNAME + 8;

/// Whether `Restored` changes this machine's kernel ([`apply_to_kernel`]) or is a dry run.
static APPLY_TO_KERNEL: AtomicBool = AtomicBool::new(false);

/// Makes later `Restored` requests change this machine's kernel (entropy pool, clock,
/// hostname). Only the guest's PID 1 calls this; without it a valid request is acknowledged and
/// nothing changes ([`DryRun`]), since the agent then runs on the host.
pub fn apply_to_kernel() {
    APPLY_TO_KERNEL.store(true, Ordering::Relaxed);
}

/// Why a `Restored` request was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    /// The request's protocol version is not ours.
    #[error("unsupported protocol version {0} (this agent speaks {PROTOCOL_VERSION})")]
    Version(u32),
    /// `entropy` is shorter or longer than allowed.
    #[error(
        "entropy of {0} bytes: a restore needs {MIN_RESTORE_ENTROPY} to {MAX_RESTORE_ENTROPY} \
         bytes of host randomness"
    )]
    EntropyLength(usize),
    /// `realtime_ns` is 0, which no host clock reads.
    #[error("realtime_ns is 0: the host must send its CLOCK_REALTIME")]
    NoTime,
    /// `realtime_ns` is later than Linux lets the clock be set to.
    #[error("realtime_ns {0} is later than the latest settable time ({MAX_CLOCK_SECS} s)")]
    TimeTooLate(u64),
    /// The hostname is not 1-64 characters of `[A-Za-z0-9.-]` (quoted, cut to 72 characters).
    #[error("hostname {0:?}: a hostname is 1-64 characters of [A-Za-z0-9.-]")]
    Hostname(String),
    /// A share parameter is not a valid `bulkhead.workspace=` or `bulkhead.mount=` word.
    #[error("share_params: {0}")]
    Shares(#[from] BootParamError),
    /// A step failed; the steps before it were done, the later ones were not.
    #[error("restore step \"{step}\" failed: {source}")]
    Step {
        /// What was attempted ([`Action::describe`]).
        step: &'static str,
        /// What the kernel said.
        source: io::Error,
    },
}

impl RestoreError {
    /// The class of the failure, for the `Error` frame.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Version(_) => ErrorCode::UnsupportedVersion,
            Self::Step { source, .. } => ErrorCode::of_io(source),
            _ => ErrorCode::InvalidRequest,
        }
    }
}

/// One step of a restore. `Debug` shows the entropy's length, never its bytes.
#[derive(Clone, PartialEq, Eq)]
pub enum Action {
    /// Mix these bytes into the kernel's input pool, crediting 8 bits per byte.
    AddEntropy(Vec<u8>),
    /// Reseed the CRNG from the input pool now.
    ReseedCrng,
    /// Set `CLOCK_REALTIME` to this time since the Unix epoch.
    SetClock(Duration),
    /// Set the hostname.
    SetHostname(String),
    /// Build the clone workspace over this share (`bulkhead.workspace=`).
    Workspace(Share),
    /// Mount this share (`bulkhead.mount=`).
    Mount(Share),
    /// Start the egress relay on `127.0.0.1:3128` unless it runs.
    StartEgress,
}

impl Action {
    /// The step's name and the kernel interface it uses, for error messages.
    pub fn describe(&self) -> &'static str {
        match self {
            Self::AddEntropy(_) => "add entropy (ioctl RNDADDENTROPY on /dev/urandom)",
            Self::ReseedCrng => "reseed the CRNG (ioctl RNDRESEEDCRNG on /dev/urandom)",
            Self::SetClock(_) => "set the clock (clock_settime CLOCK_REALTIME)",
            Self::SetHostname(_) => "set the hostname (sethostname)",
            Self::Workspace(_) => "build the clone workspace (virtio-fs under an overlay)",
            Self::Mount(_) => "mount a shared directory (mount -t virtiofs)",
            Self::StartEgress => "start the egress relay (listen on 127.0.0.1:3128)",
        }
    }
}

impl fmt::Debug for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::AddEntropy(bytes) => write!(f, "AddEntropy(<{} bytes>)", bytes.len()),
            Self::ReseedCrng => f.write_str("ReseedCrng"),
            Self::SetClock(t) => f.debug_tuple("SetClock").field(t).finish(),
            Self::SetHostname(name) => f.debug_tuple("SetHostname").field(name).finish(),
            Self::Workspace(share) => f.debug_tuple("Workspace").field(share).finish(),
            Self::Mount(share) => f.debug_tuple("Mount").field(share).finish(),
            Self::StartEgress => f.write_str("StartEgress"),
        }
    }
}

/// Where [`apply`] performs its actions: [`Kernel`] in the guest, [`DryRun`] on a host, a
/// recording stand-in in tests.
pub trait Machine {
    /// Performs one action; the kernel's error when it refuses.
    fn perform(&mut self, action: &Action) -> io::Result<()>;
}

/// The running kernel: the system calls behind each [`Action`].
#[derive(Debug, Default)]
pub struct Kernel;

impl Machine for Kernel {
    fn perform(&mut self, action: &Action) -> io::Result<()> {
        match action {
            Action::AddEntropy(bytes) => add_entropy(bytes),
            Action::ReseedCrng => reseed_crng(),
            Action::SetClock(since_epoch) => set_realtime(*since_epoch),
            Action::SetHostname(name) => init::set_hostname(name),
            Action::Workspace(share) => workspace::mount(&workspace::CloneSpec::restored(share))
                .map_err(|e| io::Error::other(e.to_string())),
            Action::Mount(share) => mounts::mount_all(std::slice::from_ref(share))
                .map_err(|e| io::Error::other(e.to_string())),
            Action::StartEgress => egress::start_guest_relay(),
        }
    }
}

/// Changes nothing: for an agent that runs on the host (test mode, the daemon's fake VMM).
#[derive(Debug, Default)]
pub struct DryRun;

impl Machine for DryRun {
    fn perform(&mut self, _action: &Action) -> io::Result<()> {
        Ok(())
    }
}

/// Checks `req` and lists what restoring means for it: entropy, reseed, clock, the hostname
/// when given, the shares, then the egress relay when asked for. Nothing is done yet.
///
/// # Errors
/// The first problem found: version, entropy length, time, hostname, share parameters.
pub fn plan(req: &RestoredRequest) -> Result<Vec<Action>, RestoreError> {
    if req.version != PROTOCOL_VERSION {
        return Err(RestoreError::Version(req.version));
    }
    if !(MIN_RESTORE_ENTROPY..=MAX_RESTORE_ENTROPY).contains(&req.entropy.len()) {
        return Err(RestoreError::EntropyLength(req.entropy.len()));
    }
    let realtime = clock_time(req.realtime_ns)?;
    let mut actions = vec![
        Action::AddEntropy(req.entropy.clone()),
        Action::ReseedCrng,
        Action::SetClock(realtime),
    ];
    if let Some(name) = &req.hostname {
        if check_hostname(name).is_err() {
            let quoted = name.chars().take(QUOTED_HOSTNAME).collect();
            return Err(RestoreError::Hostname(quoted));
        }
        actions.push(Action::SetHostname(name.clone()));
    }
    let shares = BootParams::parse_shares(&req.share_params)?;
    actions.extend(shares.workspace.map(Action::Workspace));
    actions.extend(shares.mounts.into_iter().map(Action::Mount));
    if req.egress {
        actions.push(Action::StartEgress);
    }
    Ok(actions)
}

/// `realtime_ns` as a time since the epoch that `clock_settime` accepts.
fn clock_time(realtime_ns: u64) -> Result<Duration, RestoreError> {
    let time = Duration::from_nanos(realtime_ns);
    match realtime_ns {
        0 => Err(RestoreError::NoTime),
        _ if time.as_secs() >= MAX_CLOCK_SECS => Err(RestoreError::TimeTooLate(realtime_ns)),
        _ => Ok(time),
    }
}

/// Performs `actions` in order on `machine`, stopping at the first failure. A `ReseedCrng`
/// refused with `EINVAL` or `ENOTTY` (a kernel before 4.17) counts as done: such kernels
/// reseed when credited entropy arrives, and `AddEntropy` credited it.
///
/// # Errors
/// [`RestoreError::Step`] naming the failed action.
pub fn apply(actions: &[Action], machine: &mut impl Machine) -> Result<(), RestoreError> {
    for action in actions {
        match machine.perform(action) {
            Ok(()) => {}
            Err(e) if matches!(action, Action::ReseedCrng) && reseed_unsupported(&e) => {}
            Err(source) => {
                return Err(RestoreError::Step {
                    step: action.describe(),
                    source,
                })
            }
        }
    }
    Ok(())
}

/// True for the answers of a kernel that has no `RNDRESEEDCRNG`.
fn reseed_unsupported(err: &io::Error) -> bool {
    matches!(err.raw_os_error(), Some(libc::EINVAL | libc::ENOTTY))
}

/// The answer to `req`: `Ack` when it was valid and every action succeeded on `machine`, an
/// `Error` frame saying why not otherwise.
pub fn respond(req: &RestoredRequest, machine: &mut impl Machine) -> Frame {
    match plan(req).and_then(|actions| apply(&actions, machine)) {
        Ok(()) => Frame::Ack(Ack { bytes: 0 }),
        Err(e) => Frame::error(e.code(), e.to_string()),
    }
}

/// Serves a `Restored` request on `conn`: on the kernel after [`apply_to_kernel`], as a
/// [`DryRun`] otherwise; answers `Ack` or `Error` and logs the outcome.
pub fn serve(mut conn: Conn, req: &RestoredRequest) {
    let in_guest = APPLY_TO_KERNEL.load(Ordering::Relaxed);
    if in_guest {
        // What a pre-snapshot unmount took is the old machine's; the restore mounts its own.
        mounts::forget_unmounted();
    }
    let reply = match in_guest {
        true => respond(req, &mut Kernel),
        false => respond(req, &mut DryRun),
    };
    match &reply {
        Frame::Error(e) => log!("restore: {}", e.message),
        _ if in_guest => {
            log!("restored from a snapshot: entropy mixed in, CRNG reseeded, clock set")
        }
        _ => log!("restore: valid request; this machine left alone (not the guest's PID 1)"),
    }
    let _ = write_frame(&mut conn, &reply);
}

/// `struct rand_pool_info` (`linux/random.h`) for `bytes`, as the 32-bit words `RNDADDENTROPY`
/// reads: `int entropy_count` (bits credited: all of them), `int buf_size` (bytes), then
/// `__u32 buf[]` holding the bytes in memory order, the last word zero-padded.
fn rand_pool_info(bytes: &[u8]) -> Vec<u32> {
    // `plan` allows at most MAX_RESTORE_ENTROPY (512) bytes, so both counts fit an `int`.
    let mut words = vec![(bytes.len() * 8) as u32, bytes.len() as u32];
    words.extend(bytes.chunks(4).map(|chunk| {
        let mut word = [0u8; 4];
        word[..chunk.len()].copy_from_slice(chunk);
        u32::from_ne_bytes(word)
    }));
    words
}

fn add_entropy(bytes: &[u8]) -> io::Result<()> {
    let info = rand_pool_info(bytes);
    let urandom = File::open("/dev/urandom")?;
    // SAFETY: `info` is a complete rand_pool_info: its header says `bytes.len()` bytes follow,
    // and they do (plus padding); the kernel only reads it during the call.
    let rc = unsafe { libc::ioctl(urandom.as_raw_fd(), RNDADDENTROPY as _, info.as_ptr()) };
    match rc {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

fn reseed_crng() -> io::Result<()> {
    let urandom = File::open("/dev/urandom")?;
    // SAFETY: RNDRESEEDCRNG takes no argument; no pointers are involved.
    let rc = unsafe { libc::ioctl(urandom.as_raw_fd(), RNDRESEEDCRNG as _) };
    match rc {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

/// `since_epoch` as a `timespec`; `EINVAL` when its seconds do not fit a `time_t`.
fn timespec(since_epoch: Duration) -> io::Result<libc::timespec> {
    let tv_sec = (since_epoch.as_secs().try_into())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    Ok(libc::timespec {
        tv_sec,
        tv_nsec: since_epoch.subsec_nanos().into(),
    })
}

fn set_realtime(since_epoch: Duration) -> io::Result<()> {
    let ts = timespec(since_epoch)?;
    // SAFETY: `ts` is a valid timespec that outlives the call, which only reads it.
    match unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) } {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

#[cfg(test)]
#[path = "restore_tests.rs"]
mod tests;
