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
use crate::{init, log, mounts, workspace};

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
/// when given, then the shares. Nothing is done yet.
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
mod tests {
    use std::os::fd::OwnedFd;
    use std::os::unix::net::UnixStream;

    use bulkhead_protocol::read_frame;

    use super::*;

    /// 2023-11-14T22:13:20.123456789Z.
    const NOW_NS: u64 = 1_700_000_000_123_456_789;

    fn request(entropy_len: usize, hostname: Option<&str>) -> RestoredRequest {
        let mut req = RestoredRequest::new((0..entropy_len).map(|i| i as u8).collect(), NOW_NS);
        req.hostname = hostname.map(str::to_owned);
        req
    }

    /// A stand-in machine that records what it is asked to do and refuses one step.
    #[derive(Debug, Default)]
    struct Recorder {
        asked: Vec<Action>,
        refuse: Option<(&'static str, i32)>,
    }

    impl Recorder {
        fn refusing(action: &Action, errno: i32) -> Self {
            Self {
                asked: Vec::new(),
                refuse: Some((action.describe(), errno)),
            }
        }
    }

    impl Machine for Recorder {
        fn perform(&mut self, action: &Action) -> io::Result<()> {
            self.asked.push(action.clone());
            match self.refuse {
                Some((step, errno)) if step == action.describe() => {
                    Err(io::Error::from_raw_os_error(errno))
                }
                _ => Ok(()),
            }
        }
    }

    fn error_of(frame: Frame) -> bulkhead_protocol::ErrorMessage {
        match frame {
            Frame::Error(e) => e,
            other => panic!("expected an Error frame, got {other:?}"),
        }
    }

    #[test]
    fn a_valid_request_adds_entropy_reseeds_sets_the_clock_then_the_hostname_and_acks() {
        // Arrange
        let req = request(32, Some("clone-3.example"));
        let mut machine = Recorder::default();

        // Act
        let reply = respond(&req, &mut machine);

        // Assert
        assert_eq!(reply, Frame::Ack(Ack { bytes: 0 }));
        assert_eq!(
            machine.asked,
            [
                Action::AddEntropy(req.entropy.clone()),
                Action::ReseedCrng,
                Action::SetClock(Duration::new(1_700_000_000, 123_456_789)),
                Action::SetHostname("clone-3.example".into()),
            ]
        );
    }

    #[test]
    fn without_a_hostname_the_hostname_is_left_alone() {
        // Arrange
        let req = request(MAX_RESTORE_ENTROPY, None);

        // Act
        let actions = plan(&req).unwrap();

        // Assert
        assert_eq!(actions.len(), 3);
        assert!(!actions.iter().any(|a| matches!(a, Action::SetHostname(_))));
    }

    #[test]
    fn entropy_outside_32_to_512_bytes_is_refused_and_nothing_is_done() {
        // Arrange
        let (short, long) = (request(31, None), request(513, None));
        let mut machine = Recorder::default();

        // Act
        let short = error_of(respond(&short, &mut machine));
        let long = error_of(respond(&long, &mut machine));

        // Assert
        assert_eq!(short.code, ErrorCode::InvalidRequest);
        assert!(
            short.message.contains("entropy of 31 bytes"),
            "{}",
            short.message
        );
        assert!(short.message.contains("32 to 512"), "{}", short.message);
        assert!(
            long.message.contains("entropy of 513 bytes"),
            "{}",
            long.message
        );
        assert!(machine.asked.is_empty(), "{:?}", machine.asked);
    }

    #[test]
    fn a_bad_hostname_is_refused_and_nothing_is_done() {
        // Arrange
        let too_long = "h".repeat(MAX_HOSTNAME + 1);
        let names = [
            "",
            "two words",
            "under_score",
            "caf\u{e9}",
            too_long.as_str(),
        ];
        let mut machine = Recorder::default();

        // Act
        let replies = names.map(|name| error_of(respond(&request(32, Some(name)), &mut machine)));

        // Assert
        for reply in replies {
            assert_eq!(reply.code, ErrorCode::InvalidRequest);
            assert!(
                reply.message.contains("1-64 characters"),
                "{}",
                reply.message
            );
        }
        assert!(machine.asked.is_empty(), "{:?}", machine.asked);
    }

    #[test]
    fn a_huge_bad_hostname_is_quoted_only_in_part() {
        // Arrange
        let req = request(32, Some(&"_".repeat(100_000)));

        // Act
        let reply = error_of(respond(&req, &mut Recorder::default()));

        // Assert
        assert!(reply.message.len() < 200, "{}", reply.message);
    }

    #[test]
    fn the_longest_hostname_is_accepted() {
        // Arrange
        let name = "a".repeat(MAX_HOSTNAME);

        // Act
        let actions = plan(&request(32, Some(&name))).unwrap();

        // Assert
        assert_eq!(actions.last(), Some(&Action::SetHostname(name)));
    }

    #[test]
    fn another_protocol_version_is_refused() {
        // Arrange
        let mut req = request(32, None);
        req.version = PROTOCOL_VERSION + 1;
        let mut machine = Recorder::default();

        // Act
        let reply = error_of(respond(&req, &mut machine));

        // Assert
        assert_eq!(reply.code, ErrorCode::UnsupportedVersion);
        assert!(reply.message.contains("version 2"), "{}", reply.message);
        assert!(machine.asked.is_empty());
    }

    #[test]
    fn a_time_of_zero_or_beyond_what_linux_can_set_is_refused() {
        // Arrange
        let mut zero = request(32, None);
        zero.realtime_ns = 0;
        let mut late = request(32, None);
        late.realtime_ns = MAX_CLOCK_SECS * 1_000_000_000;
        let mut latest = request(32, None);
        latest.realtime_ns = MAX_CLOCK_SECS * 1_000_000_000 - 1;

        // Act
        let zero = error_of(respond(&zero, &mut Recorder::default()));
        let late = error_of(respond(&late, &mut Recorder::default()));
        let latest = plan(&latest);

        // Assert
        assert!(
            zero.message.contains("realtime_ns is 0"),
            "{}",
            zero.message
        );
        assert!(late.message.contains("latest settable"), "{}", late.message);
        assert_eq!(late.code, ErrorCode::InvalidRequest);
        assert!(latest.is_ok(), "{latest:?}");
    }

    #[test]
    fn a_failing_step_is_named_and_the_later_steps_are_skipped() {
        // Arrange
        let req = request(32, Some("clone"));
        let clock = Action::SetClock(Duration::ZERO);
        let mut machine = Recorder::refusing(&clock, libc::EPERM);

        // Act
        let reply = error_of(respond(&req, &mut machine));

        // Assert
        assert_eq!(reply.code, ErrorCode::PermissionDenied);
        assert!(reply.message.contains("set the clock"), "{}", reply.message);
        assert!(reply.message.contains("clock_settime"), "{}", reply.message);
        assert_eq!(machine.asked.len(), 3, "{:?}", machine.asked);
    }

    #[test]
    fn a_kernel_without_rndreseedcrng_still_gets_the_whole_restore() {
        // Arrange
        let req = request(32, Some("clone"));
        let mut before_4_17 = Recorder::refusing(&Action::ReseedCrng, libc::EINVAL);
        let mut no_ioctl = Recorder::refusing(&Action::ReseedCrng, libc::ENOTTY);

        // Act
        let a = respond(&req, &mut before_4_17);
        let b = respond(&req, &mut no_ioctl);

        // Assert
        assert_eq!(a, Frame::Ack(Ack { bytes: 0 }));
        assert_eq!(b, Frame::Ack(Ack { bytes: 0 }));
        assert_eq!(before_4_17.asked.len(), 4);
        assert_eq!(no_ioctl.asked.len(), 4);
    }

    #[test]
    fn a_reseed_refused_for_another_reason_is_an_error() {
        // Arrange
        let req = request(32, None);
        let mut machine = Recorder::refusing(&Action::ReseedCrng, libc::EPERM);

        // Act
        let reply = error_of(respond(&req, &mut machine));

        // Assert
        assert!(
            reply.message.contains("reseed the CRNG"),
            "{}",
            reply.message
        );
        assert!(reply.message.contains("RNDRESEEDCRNG"), "{}", reply.message);
        assert_eq!(machine.asked.len(), 2);
    }

    #[test]
    fn the_entropy_never_appears_in_debug_output() {
        // Arrange
        let action = Action::AddEntropy(vec![0xee; 32]);

        // Act
        let shown = format!("{action:?}");

        // Assert
        assert_eq!(shown, "AddEntropy(<32 bytes>)");
    }

    #[test]
    fn rand_pool_info_is_laid_out_as_in_linux_random_h() {
        // Arrange
        let bytes = [1, 2, 3, 4, 5];

        // Act
        let words = rand_pool_info(&bytes);

        // Assert: entropy_count in bits, buf_size in bytes, then the bytes in memory order.
        assert_eq!(
            words,
            [
                40,
                5,
                u32::from_ne_bytes([1, 2, 3, 4]),
                u32::from_ne_bytes([5, 0, 0, 0])
            ]
        );
    }

    #[test]
    fn ioctl_numbers_match_the_asm_generic_encoding() {
        // Arrange: _IOC(dir, type, nr, size) from include/uapi/asm-generic/ioctl.h, used by both
        // x86_64 and aarch64: dir in bits 30-31 (_IOC_WRITE = 1), size in 16-29, type in 8-15.
        let ioc = |dir: u32, ty: u8, nr: u8, size: usize| {
            dir << 30 | (size as u32) << 16 | u32::from(ty) << 8 | u32::from(nr)
        };

        // Act
        let add = ioc(1, b'R', 0x03, std::mem::size_of::<[libc::c_int; 2]>());
        let reseed = ioc(0, b'R', 0x07, 0);

        // Assert
        assert_eq!(RNDADDENTROPY, add);
        assert_eq!(RNDRESEEDCRNG, reseed);
    }

    #[test]
    fn clock_times_convert_to_a_timespec() {
        // Arrange
        let time = Duration::from_nanos(NOW_NS);

        // Act
        let ts = timespec(time).unwrap();

        // Assert
        assert_eq!((ts.tv_sec, ts.tv_nsec), (1_700_000_000, 123_456_789));
    }

    #[test]
    fn serve_answers_on_the_connection_without_touching_this_machine() {
        // Arrange: apply_to_kernel is never called in tests, so serve is a dry run.
        let (agent_side, mut host_side) = UnixStream::pair().unwrap();
        let (bad_agent_side, mut bad_host_side) = UnixStream::pair().unwrap();
        let hostname_before = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();

        // Act
        serve(
            Conn::new(OwnedFd::from(agent_side)),
            &request(32, Some("must-not-be-set")),
        );
        serve(Conn::new(OwnedFd::from(bad_agent_side)), &request(8, None));
        let reply = read_frame(&mut host_side).unwrap();
        let refusal = read_frame(&mut bad_host_side).unwrap();

        // Assert
        assert_eq!(reply, Some(Frame::Ack(Ack { bytes: 0 })));
        let refusal = error_of(refusal.unwrap());
        assert!(
            refusal.message.contains("entropy of 8 bytes"),
            "{}",
            refusal.message
        );
        assert_eq!(
            std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap(),
            hostname_before
        );
    }

    #[test]
    fn shares_are_mounted_last_workspace_first_in_the_order_given() {
        // Arrange
        let mut req = request(32, None);
        req.share_params = vec![
            "bulkhead.mount=mount0:/data:ro".into(),
            "bulkhead.workspace=workspace:/workspace:clone".into(),
            "bulkhead.mount=mount1:/data/sub".into(),
        ];
        let share = |tag: &str, dir: &str, read_only| Share {
            tag: tag.into(),
            guest_dir: dir.into(),
            read_only,
        };
        let mut machine = Recorder::default();

        // Act
        let reply = respond(&req, &mut machine);

        // Assert
        assert_eq!(reply, Frame::Ack(Ack { bytes: 0 }));
        assert_eq!(
            machine.asked[3..],
            [
                Action::Workspace(share("workspace", "/workspace", false)),
                Action::Mount(share("mount0", "/data", true)),
                Action::Mount(share("mount1", "/data/sub", false)),
            ]
        );
    }

    #[test]
    fn a_bad_share_parameter_is_refused_and_nothing_is_done() {
        // Arrange
        let mut req = request(32, None);
        req.share_params = vec![
            "bulkhead.mount=mount0:/data".into(),
            "bulkhead.egress=on".into(),
        ];
        let mut machine = Recorder::default();

        // Act
        let reply = respond(&req, &mut machine);

        // Assert
        let error = error_of(reply);
        assert_eq!(error.code, ErrorCode::InvalidRequest);
        assert!(
            error.message.contains("bulkhead.egress=on"),
            "{}",
            error.message
        );
        assert!(machine.asked.is_empty());
    }

    #[test]
    fn a_failed_mount_names_its_step_and_stops_there() {
        // Arrange
        let mut req = request(32, None);
        req.share_params = vec![
            "bulkhead.mount=mount0:/a".into(),
            "bulkhead.mount=mount1:/b".into(),
        ];
        let first = Action::Mount(Share {
            tag: "mount0".into(),
            guest_dir: "/a".into(),
            read_only: false,
        });
        let mut machine = Recorder::refusing(&first, libc::ENOENT);

        // Act
        let reply = respond(&req, &mut machine);

        // Assert
        let error = error_of(reply);
        assert!(
            error.message.contains("mount a shared directory"),
            "{}",
            error.message
        );
        assert_eq!(machine.asked.last(), Some(&first));
    }
}
