//! Control messages: the JSON payloads of the non-data frames.
//!
//! Every struct here is encoded with `serde_json` as one JSON object. Unknown fields are
//! ignored (so a newer peer may add fields); fields marked optional below may be left out.
//! Requests from the host carry `version` ([`crate::PROTOCOL_VERSION`]).

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::{ByteString, PROTOCOL_VERSION};

/// A pair of guest clock readings, in nanoseconds since the clock's epoch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BootTimestamps {
    /// `CLOCK_BOOTTIME` in ns: time since the guest kernel booted, suspend included.
    pub boottime_ns: u64,
    /// `CLOCK_REALTIME` in ns since the Unix epoch (as the guest sees it).
    pub realtime_ns: u64,
}

/// Sent by the agent once at boot on a guest-initiated connection to [`crate::READY_PORT`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ready {
    /// The agent's [`crate::PROTOCOL_VERSION`].
    pub version: u32,
    /// The agent's crate version (`CARGO_PKG_VERSION`), for logs.
    #[serde(default)]
    pub agent_version: String,
    /// Clock readings taken when the agent's `main` started.
    pub init_started: BootTimestamps,
    /// Clock readings taken when the agent's listener was bound and listening.
    pub listening: BootTimestamps,
}

/// Runs one command. First frame of an exec connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecRequest {
    /// Must be [`crate::PROTOCOL_VERSION`].
    pub version: u32,
    /// Program and arguments (byte strings: Linux argv is not UTF-8); `argv[0]` is looked up in
    /// the request's `PATH` when it has no `/`.
    pub argv: Vec<ByteString>,
    /// The whole environment as `KEY=VALUE` byte strings (nothing is inherited from the agent).
    /// When no `PATH=` entry is given the agent adds
    /// `PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin`.
    #[serde(default)]
    pub env: Vec<ByteString>,
    /// Working directory (absolute); `/` when absent.
    #[serde(default)]
    pub cwd: Option<ByteString>,
    /// `name` (looked up in the guest's `/etc/passwd`), `uid` or `uid:gid`; the agent's own
    /// user (root) when absent.
    #[serde(default)]
    pub user: Option<String>,
    /// When true the host sends `Stdin` frames and a final `StdinEof`; when false the command's
    /// stdin is `/dev/null` (or, with `tty`, the terminal gets no input).
    #[serde(default)]
    pub stdin: bool,
    /// Wall-clock limit in ms from the start of the process; when it passes, the whole process
    /// group is killed with `SIGKILL` and `Exit.timed_out` is true. No limit when absent.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// `docker run` semantics for the end of the command (default false: `docker exec` / shell
    /// semantics). When true, as soon as the command itself (the process-group leader) has
    /// exited, the agent sends `SIGKILL` to the rest of its process group, forwards the output
    /// already in the pipes (without waiting for end of file) and sends `Exit`. When false,
    /// `Exit` waits until every process holding the output pipes has closed them, so a
    /// background process delays it. Processes that left the group (`setsid`) are not killed
    /// either way. Agents older than this field ignore it (unknown fields are ignored).
    #[serde(default)]
    pub kill_group_on_exit: bool,
    /// Run the command on a new pseudo-terminal (`docker exec -t`): the terminal is its
    /// controlling terminal and stdin, stdout and stderr (it is a session leader, its process
    /// group in the foreground). Its output arrives as `Stdout` frames only (a terminal has one
    /// output stream); `Stdin` bytes are what a user types, so `0x03` sends `SIGINT` to the
    /// foreground process group through the line discipline; `StdinEof` types the terminal's
    /// end-of-file character (`VEOF`, `^D`). `Resize` frames change its size.
    /// `TERM=xterm` is added when the request's environment has no `TERM=`.
    #[serde(default)]
    pub tty: bool,
    /// The terminal's size at start (only with `tty`); 24 rows × 80 columns when absent.
    #[serde(default)]
    pub window: Option<WindowSize>,
    /// Run the command as a container's process: in its own root, mount and PID namespaces
    /// ([`crate::container`]). An ordinary guest command when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<crate::ContainerExec>,
}

/// A terminal's size in character cells (`struct winsize` of `TIOCSWINSZ`, without pixels).
/// Host → guest as the payload of a `Resize` frame and in [`ExecRequest::window`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct WindowSize {
    /// Rows (lines), 1..=65535.
    pub rows: u16,
    /// Columns, 1..=65535.
    pub cols: u16,
}

impl Default for WindowSize {
    /// 24 rows × 80 columns, the VT100's size, which programs assume when nothing is known.
    fn default() -> Self {
        WindowSize { rows: 24, cols: 80 }
    }
}

impl ExecRequest {
    /// A request for `argv` with an empty environment, cwd `/`, no stdin, no timeout, and
    /// `Exit` after end of file on the output pipes (`kill_group_on_exit: false`).
    pub fn new<I, S>(argv: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<ByteString>,
    {
        Self {
            version: PROTOCOL_VERSION,
            argv: argv.into_iter().map(Into::into).collect(),
            env: Vec::new(),
            cwd: None,
            user: None,
            stdin: false,
            timeout_ms: None,
            kill_group_on_exit: false,
            tty: false,
            window: None,
            container: None,
        }
    }
}

/// Sent by the agent once the command's process exists. `pid` is also its process group and
/// session id (the agent runs every command in a new session).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Started {
    /// Guest pid of the command (equal to its pgid and sid).
    pub pid: u32,
}

/// Delivers a signal to the command's whole process group (`kill(-pgid, signo)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SignalRequest {
    /// Signal number as on Linux (1..=64), e.g. 15 for `SIGTERM`.
    pub signo: i32,
}

/// How a command ended. Exactly one of `code` and `signal` is set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitStatus {
    /// Exit code (0..=255) when the process exited normally.
    #[serde(default)]
    pub code: Option<i32>,
    /// Number of the signal that terminated the process.
    #[serde(default)]
    pub signal: Option<i32>,
    /// True when the agent killed the process group because `timeout_ms` passed.
    #[serde(default)]
    pub timed_out: bool,
    /// True when the guest kernel's OOM killer killed the command itself (the process the agent
    /// started: for a container exec the container's PID 1 or the exec's process), as the
    /// guest's kernel log says. Left off the wire when false; agents that predate the field
    /// never send it, and hosts that predate it ignore it. A claim of the guest's: the host
    /// reports it (containerd's `TaskOOM`) and trusts it for nothing else.
    #[serde(default, skip_serializing_if = "is_false")]
    pub oom_killed: bool,
}

impl ExitStatus {
    /// True for a normal exit with code 0 (and no timeout).
    pub fn success(&self) -> bool {
        self.code == Some(0) && !self.timed_out
    }

    /// The status as a shell reports it (`$?`): the exit code, or 128 + the signal's number;
    /// `None` when neither is known.
    pub fn shell_code(&self) -> Option<i32> {
        match (self.code, self.signal) {
            (Some(code), _) => Some(code),
            (None, Some(sig)) => Some(128 + sig),
            (None, None) => None,
        }
    }
}

/// A request failed; the sender closes the connection after this frame.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorMessage {
    /// Human-readable reason, e.g. `open /etc/x: No such file or directory (os error 2)`.
    pub message: String,
    /// Machine-readable class of the failure; [`ErrorCode::Other`] when absent (agents older
    /// than the field send none) or unknown to the reader (a newer peer's code).
    #[serde(default)]
    pub code: ErrorCode,
}

impl ErrorMessage {
    /// An error of class `code` with `message`.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ErrorMessage {
            message: message.into(),
            code,
        }
    }
}

/// Why a request failed, for the host to act on without reading the message's text (e.g. the
/// daemon's HTTP status). Encoded as a `snake_case` string; a reader maps every string it does
/// not know to [`ErrorCode::Other`], so codes can be added without breaking older hosts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// A path or object the request names does not exist (`ENOENT`).
    NotFound,
    /// The guest refused access (`EACCES`, `EPERM`, `EROFS`).
    PermissionDenied,
    /// The request is malformed or names something unusable: a relative path, a directory
    /// where a file is needed, an empty `argv`, an unknown user, a missing `cwd`, no clone
    /// workspace for a change set.
    InvalidRequest,
    /// The request's protocol version is not the agent's.
    UnsupportedVersion,
    /// The peer broke the frame sequence of the request.
    Protocol,
    /// The guest ran out of something: disk space, memory, descriptors, processes.
    ResourceExhausted,
    /// Anything else, and every code this side does not know.
    #[default]
    #[serde(other)]
    Other,
}

impl ErrorCode {
    /// The class of an OS error (by its errno when it has one, else by its kind).
    pub fn of_io(err: &std::io::Error) -> ErrorCode {
        match err.raw_os_error() {
            Some(libc::ENOENT) => ErrorCode::NotFound,
            Some(libc::EACCES | libc::EPERM | libc::EROFS) => ErrorCode::PermissionDenied,
            Some(
                libc::ENOTDIR | libc::EISDIR | libc::EINVAL | libc::ENAMETOOLONG | libc::ELOOP,
            ) => ErrorCode::InvalidRequest,
            Some(
                libc::ENOSPC
                | libc::EDQUOT
                | libc::ENOMEM
                | libc::EFBIG
                | libc::EMFILE
                | libc::ENFILE
                | libc::EAGAIN,
            ) => ErrorCode::ResourceExhausted,
            Some(_) => ErrorCode::Other,
            None => match err.kind() {
                std::io::ErrorKind::NotFound => ErrorCode::NotFound,
                std::io::ErrorKind::PermissionDenied => ErrorCode::PermissionDenied,
                std::io::ErrorKind::InvalidInput => ErrorCode::InvalidRequest,
                _ => ErrorCode::Other,
            },
        }
    }
}

/// Writes a whole file. Followed by `Data` frames with the contents and one `End`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileWriteRequest {
    /// Must be [`crate::PROTOCOL_VERSION`].
    pub version: u32,
    /// Absolute guest path. Missing parent directories are created (mode 0755).
    pub path: String,
    /// Permission bits of the file (e.g. 420 = 0o644), applied exactly (umask ignored).
    pub mode: u32,
}

/// Reads a whole regular file. The agent answers with `Data` frames and one `End`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileReadRequest {
    /// Must be [`crate::PROTOCOL_VERSION`].
    pub version: u32,
    /// Absolute guest path of a regular file.
    pub path: String,
}

/// Asks the agent to sync the guest's filesystems and reboot (which ends the VM).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShutdownRequest {
    /// Must be [`crate::PROTOCOL_VERSION`].
    pub version: u32,
}

/// Asks the agent to unmount the host directories it mounted over virtio-fs (`mounted: false`,
/// before a snapshot: a virtio-fs share with a live FUSE session cannot be saved), or to mount
/// again those the last such request unmounted (`mounted: true`, when the snapshot then failed
/// and the sandbox goes on). Answered with `Ack` once done. An unmount is refused, with nothing
/// unmounted, while a guest process uses a file under one of them (its working or root
/// directory, an open file, a mapping): the `Error` names the processes. A clone workspace's
/// overlay is not a plain share and stays mounted. An agent older than this request answers
/// with an `Error` of class [`ErrorCode::Protocol`] (unknown frame type).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharesRequest {
    /// Must be [`crate::PROTOCOL_VERSION`].
    pub version: u32,
    /// `false`: unmount the shares; `true`: mount again what the last unmount took.
    pub mounted: bool,
}

/// Fewest bytes of host randomness a [`RestoredRequest`] carries: 32 bytes = 256 bits, a full
/// seed of the kernel's ChaCha20 CRNG (`drivers/char/random.c`).
pub const MIN_RESTORE_ENTROPY: usize = 32;

/// Most bytes of host randomness a [`RestoredRequest`] carries: 512 bytes = 4096 bits, the size
/// of the kernel's input pool before Linux 5.18 (`drivers/char/random.c`), so every bit can be
/// credited.
pub const MAX_RESTORE_ENTROPY: usize = 512;

/// Tells the agent that its VM was just restored from a snapshot (possibly one of many clones
/// of it), so that the guest becomes a distinct machine: the agent mixes `entropy` into the
/// kernel's random pool and reseeds its CRNG (every clone of a snapshot resumes with the same
/// CRNG state), sets `CLOCK_REALTIME` to `realtime_ns` (the guest's wall clock is as old as the
/// snapshot otherwise) and, when given, the hostname. Answered with `Ack` once all of it is
/// done, or with an `Error` naming the step that failed. An agent older than this request
/// answers with an `Error` of class [`ErrorCode::Protocol`] (unknown frame type).
///
/// On the wire `entropy` is a string of lower-case hex digits, two per byte (upper-case digits
/// are accepted too). `Debug` shows its length, never its bytes.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestoredRequest {
    /// Must be [`crate::PROTOCOL_VERSION`].
    pub version: u32,
    /// [`MIN_RESTORE_ENTROPY`]`..=`[`MAX_RESTORE_ENTROPY`] bytes of host randomness (e.g. from
    /// `getrandom(2)`), fresh for each restore; the agent credits all of it as entropy.
    #[serde(with = "hex_bytes")]
    pub entropy: Vec<u8>,
    /// The host's `CLOCK_REALTIME` when it sent the request, in ns since the Unix epoch
    /// (`clock_gettime(2)`); not 0.
    pub realtime_ns: u64,
    /// New hostname (1-64 characters of `[A-Za-z0-9.-]`, as for `bulkhead.hostname=`); the
    /// hostname stays as it was when absent.
    #[serde(default)]
    pub hostname: Option<String>,
    /// Shares to mount now, as the boot parameters of the [`crate::boot`] codec that a boot with
    /// them would have had: only `bulkhead.workspace=TAG:DIR:clone` and
    /// `bulkhead.mount=TAG:DIR[:ro]`, in the order to mount them. Each TAG names a virtio-fs
    /// device the snapshot has, idle until now (the host attached a directory to it when it
    /// restored the VM). Empty (and absent on the wire) when the restore mounts nothing.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub share_params: Vec<String>,
    /// Start the egress relay (`127.0.0.1:3128` → CID 2, port [`crate::EGRESS_PORT`]) now, as
    /// the boot parameter `bulkhead.egress=on` would have: the host runs an egress proxy for
    /// this restored sandbox. Nothing changes when the relay already runs (the snapshot's
    /// guest booted with it). `false` (and absent on the wire) otherwise.
    #[serde(default, skip_serializing_if = "is_false")]
    pub egress: bool,
}

/// `skip_serializing_if` helper: leaves a `false` flag off the wire.
fn is_false(flag: &bool) -> bool {
    !*flag
}

impl RestoredRequest {
    /// A request with this protocol's version that keeps the hostname.
    pub fn new(entropy: Vec<u8>, realtime_ns: u64) -> Self {
        Self {
            version: PROTOCOL_VERSION,
            entropy,
            realtime_ns,
            hostname: None,
            share_params: Vec::new(),
            egress: false,
        }
    }
}

impl fmt::Debug for RestoredRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RestoredRequest")
            .field("version", &self.version)
            .field("entropy", &format_args!("<{} bytes>", self.entropy.len()))
            .field("realtime_ns", &self.realtime_ns)
            .field("hostname", &self.hostname)
            .field("share_params", &self.share_params)
            .field("egress", &self.egress)
            .finish()
    }
}

/// Bytes as a JSON string of hex digits (`serde(with)` helper for [`RestoredRequest::entropy`]).
mod hex_bytes {
    use serde::de::Error as _;
    use serde::{Deserialize, Deserializer, Serializer};

    const DIGITS: &[u8; 16] = b"0123456789abcdef";

    pub fn serialize<S: Serializer>(bytes: &[u8], serializer: S) -> Result<S::Ok, S::Error> {
        let mut text = String::with_capacity(bytes.len() * 2);
        for b in bytes {
            text.push(char::from(DIGITS[usize::from(b >> 4)]));
            text.push(char::from(DIGITS[usize::from(b & 0x0f)]));
        }
        serializer.serialize_str(&text)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(deserializer)?;
        decode(&text).ok_or_else(|| D::Error::custom("expected a string of hex digit pairs"))
    }

    fn decode(text: &str) -> Option<Vec<u8>> {
        if text.len() % 2 != 0 {
            return None;
        }
        text.as_bytes()
            .chunks_exact(2)
            .map(|pair| Some(nibble(pair[0])? << 4 | nibble(pair[1])?))
            .collect()
    }

    fn nibble(digit: u8) -> Option<u8> {
        char::from(digit).to_digit(16).map(|d| d as u8)
    }
}

/// Host → guest: connect to TCP `port` on the guest's `127.0.0.1` and carry the connection
/// (ingress: a host-side listener forwarding to a server in the guest). The agent answers
/// [`Ack`] once connected, or an error (`NotFound` when nothing listens on the port); after the
/// `Ack` the vsock connection is no longer framed: its bytes are the TCP connection's, both ways,
/// each direction ending with a shutdown of its write side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectRequest {
    /// TCP port on the guest's loopback interface, 1-65535.
    pub port: u16,
}

/// Positive answer to a file write, a shutdown, a restore or a connect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ack {
    /// Bytes written, for a file write; 0 otherwise.
    #[serde(default)]
    pub bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_without_a_code_or_with_an_unknown_one_is_other() {
        // Arrange: an old agent's error, and a newer agent's code.
        let old = r#"{"message":"boom"}"#;
        let newer = r#"{"message":"boom","code":"quantum_flux"}"#;

        // Act
        let old: ErrorMessage = serde_json::from_str(old).unwrap();
        let newer: ErrorMessage = serde_json::from_str(newer).unwrap();

        // Assert
        assert_eq!(old.code, ErrorCode::Other);
        assert_eq!(newer.code, ErrorCode::Other);
        assert_eq!(newer.message, "boom");
    }

    #[test]
    fn error_codes_round_trip_as_snake_case_strings() {
        // Arrange
        let err = ErrorMessage::new(ErrorCode::NotFound, "open /x: No such file");

        // Act
        let json = serde_json::to_string(&err).unwrap();
        let back: ErrorMessage = serde_json::from_str(&json).unwrap();

        // Assert
        assert!(json.contains(r#""code":"not_found""#), "{json}");
        assert_eq!(back, err);
    }

    #[test]
    fn os_errors_map_to_their_class() {
        // Arrange
        let cases = [
            (std::io::Error::from_raw_os_error(2), ErrorCode::NotFound),
            (
                std::io::Error::from_raw_os_error(13),
                ErrorCode::PermissionDenied,
            ),
            (
                std::io::Error::from_raw_os_error(30),
                ErrorCode::PermissionDenied,
            ),
            (
                std::io::Error::from_raw_os_error(21),
                ErrorCode::InvalidRequest,
            ),
            (
                std::io::Error::from_raw_os_error(28),
                ErrorCode::ResourceExhausted,
            ),
            (
                std::io::Error::from_raw_os_error(24),
                ErrorCode::ResourceExhausted,
            ),
            (std::io::Error::from_raw_os_error(5), ErrorCode::Other),
        ];

        // Act / Assert
        for (err, code) in cases {
            assert_eq!(ErrorCode::of_io(&err), code, "{err}");
        }
    }

    #[test]
    fn the_shell_code_is_the_exit_code_or_128_plus_the_signal() {
        // Arrange
        let status = |code, signal| ExitStatus {
            code,
            signal,
            timed_out: false,
            oom_killed: false,
        };

        // Act
        let codes = [
            status(Some(3), None),
            status(None, Some(9)),
            status(None, None),
        ]
        .map(|s| s.shell_code());

        // Assert
        assert_eq!(codes, [Some(3), Some(137), None]);
    }

    #[test]
    fn an_oom_kill_is_sent_only_when_true_and_older_exits_read_as_not_oom_killed() {
        // Arrange
        let old_agent = r#"{"code":null,"signal":9,"timed_out":false}"#;
        let killed = ExitStatus {
            code: None,
            signal: Some(9),
            timed_out: false,
            oom_killed: true,
        };
        let plain = ExitStatus {
            oom_killed: false,
            ..killed
        };

        // Act
        let from_old: ExitStatus = serde_json::from_str(old_agent).unwrap();
        let killed_json = serde_json::to_string(&killed).unwrap();
        let plain_json = serde_json::to_string(&plain).unwrap();

        // Assert
        assert!(!from_old.oom_killed);
        assert!(
            killed_json.contains(r#""oom_killed":true"#),
            "{killed_json}"
        );
        assert_eq!(plain_json, old_agent);
    }

    #[test]
    fn restored_entropy_travels_as_hex_and_round_trips() {
        // Arrange
        let mut req = RestoredRequest::new(vec![0x00, 0x01, 0xab, 0xff], 1_700_000_000_000_000_000);
        req.hostname = Some("clone-7".into());

        // Act
        let json = serde_json::to_string(&req).unwrap();
        let back: RestoredRequest = serde_json::from_str(&json).unwrap();

        // Assert
        assert!(json.contains(r#""entropy":"0001abff""#), "{json}");
        assert_eq!(back, req);
    }

    #[test]
    fn restored_without_hostname_keeps_it_and_upper_case_hex_is_accepted() {
        // Arrange
        let json = r#"{"version":1,"entropy":"ABcd","realtime_ns":5}"#;

        // Act
        let req: RestoredRequest = serde_json::from_str(json).unwrap();

        // Assert
        assert_eq!(req.entropy, [0xab, 0xcd]);
        assert_eq!(req.hostname, None);
    }

    #[test]
    fn restored_entropy_that_is_not_hex_pairs_is_rejected() {
        // Arrange
        let odd = r#"{"version":1,"entropy":"abc","realtime_ns":5}"#;
        let not_hex = r#"{"version":1,"entropy":"zz","realtime_ns":5}"#;
        let array = r#"{"version":1,"entropy":[1,2],"realtime_ns":5}"#;

        // Act
        let results = [odd, not_hex, array].map(serde_json::from_str::<RestoredRequest>);

        // Assert
        for result in results {
            assert!(result.is_err(), "{result:?}");
        }
    }

    #[test]
    fn restored_debug_output_hides_the_entropy() {
        // Arrange
        let req = RestoredRequest::new(vec![0x5a; 32], 1);

        // Act
        let shown = format!("{req:?}");

        // Assert
        assert!(shown.contains("<32 bytes>"), "{shown}");
        assert!(!shown.contains("90"), "{shown}");
    }

    #[test]
    fn kill_group_on_exit_round_trips_through_json() {
        // Arrange
        let mut req = ExecRequest::new(["sh", "-c", "sleep 30 & echo done"]);
        req.kill_group_on_exit = true;

        // Act
        let json = serde_json::to_string(&req).unwrap();
        let back: ExecRequest = serde_json::from_str(&json).unwrap();

        // Assert
        assert!(json.contains("\"kill_group_on_exit\":true"), "{json}");
        assert_eq!(back, req);
    }

    #[test]
    fn a_request_without_kill_group_on_exit_keeps_waiting_for_end_of_file() {
        // Arrange: what a host older than the field sends.
        let json = r#"{"version":1,"argv":["true"]}"#;

        // Act
        let req: ExecRequest = serde_json::from_str(json).unwrap();

        // Assert
        assert!(!req.kill_group_on_exit);
        assert_eq!(req, ExecRequest::new(["true"]));
    }
}
