//! Tests of `restore`: planning, applying and answering `Restored` requests.

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
fn a_request_with_egress_starts_the_relay_last_and_one_without_never_does() {
    // Arrange
    let mut with = request(32, None);
    with.egress = true;
    let without = request(32, None);

    // Act
    let with = plan(&with).unwrap();
    let without = plan(&without).unwrap();

    // Assert
    assert_eq!(with.last(), Some(&Action::StartEgress));
    assert!(!without.contains(&Action::StartEgress));
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
