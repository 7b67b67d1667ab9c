//! How the VM ended, in the VMM's own words: `bulkhead-vmm --exit-file FILE`.
//!
//! The serial console belongs to the guest: a hostile guest can print any line there, including
//! lines that look like the VMM's messages or a kernel panic. So the host never reads how a VM
//! ended from the console or from a log that holds it. Instead the VMM opens the exit file before
//! the VM exists (and before it enters its jail), and when it ends writes one JSON document into
//! it ([`ExitReport`]): the reason it observed itself (a reset the guest asked for, a triple
//! fault KVM reported, a blocked system call, its own error). The guest has no way to reach the
//! file.
//!
//! One field carries text the guest wrote, and says so: [`ExitReport::guest_console_panic`], the
//! reason after a Linux panic banner its console showed (see
//! [`crate::devices::legacy::panic_watch`]). A panicking kernel with `panic=1` resets exactly as
//! `reboot` does, so the VMM cannot tell the two apart; the report keeps the reason of the reset
//! and quotes the console's claim beside it, never in its place.
//!
//! The file is written once, with a single `write(2)`: at the end of a run, after a failure to
//! build or run the VM, or by the SIGSYS handler when a seccomp filter killed the VMM (a
//! preformatted document, see [`crate::seccomp`]). A VMM killed by a signal writes nothing; the
//! reader then has only the exit status.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::vstate::vcpu::ExitReason;

/// Version of the report's format, in [`ExitReport::version`].
pub const REPORT_VERSION: u32 = 1;

/// Most bytes of an exit file a reader looks at (64 KiB): a larger file is not a report.
pub const MAX_REPORT_BYTES: u64 = 64 * 1024;

/// Longest [`ExitReport::detail`] and [`ExitReport::guest_console_panic`] written, bytes.
pub const MAX_TEXT_BYTES: usize = 1024;

/// `bulkhead-vmm`'s exit status for a clean end: the guest reset or powered off, or the VMM was
/// told to stop.
pub const EXIT_CLEAN: i32 = 0;
/// Exit status when the VM could not be built or run.
pub const EXIT_ERROR: i32 = 1;
/// Exit status when KVM reported a guest crash or the VM failed.
pub const EXIT_CRASH: i32 = 3;
/// Exit status when a seccomp filter blocked a system call (the SIGSYS handler's).
pub const EXIT_SECCOMP: i32 = crate::seccomp::EXIT_BLOCKED_SYSCALL;

/// How the VM ended, as the VMM observed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EndReason {
    /// The guest asked for a reset (i8042 reset line, PSCI `SYSTEM_RESET`): how `reboot` ends a
    /// guest, and how a panicking kernel with `panic=1` ends too.
    Reset,
    /// The guest powered itself off (PSCI `SYSTEM_OFF`, `KVM_SYSTEM_EVENT_SHUTDOWN`).
    PowerOff,
    /// The VMM stopped the VM (SIGTERM, SIGINT or SIGHUP).
    Stopped,
    /// KVM reported a crash: a triple fault (`KVM_EXIT_SHUTDOWN`) or `KVM_SYSTEM_EVENT_CRASH`.
    GuestCrash,
    /// KVM or a vCPU failed; the VM could not go on.
    Fatal,
    /// A seccomp filter blocked a system call of the VMM ([`ExitReport::blocked_syscall`]).
    Seccomp,
    /// The VMM could not build or start the VM ([`ExitReport::detail`]).
    Error,
}

/// The system call a seccomp filter blocked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockedSyscall {
    /// Its number on this architecture.
    pub nr: i64,
    /// The kind of VMM thread that made it (`vcpu`, `event loop`, `signal`, ...).
    pub thread: String,
}

/// The exit file's contents.
///
/// ```
/// use bulkhead_vmm::exit_report::{EndReason, ExitReport};
///
/// let json = br#"{"version":1,"reason":"reset","exit_code":0,"guest_console_panic":"Oops"}"#;
/// let report = ExitReport::parse(json).unwrap();
/// assert_eq!(report.reason, EndReason::Reset);
/// assert!(report.is_clean());
/// assert_eq!(
///     report.describe(),
///     "the guest reset itself; its console showed a kernel panic message \
///      (guest-written text, not verified by the host): Oops"
/// );
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitReport {
    /// [`REPORT_VERSION`].
    pub version: u32,
    /// How the VM ended.
    pub reason: EndReason,
    /// The exit status the VMM ended with.
    pub exit_code: i32,
    /// The VMM's own explanation (its error, the fatal vCPU failure, the crash KVM reported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// With [`EndReason::Seccomp`]: the blocked call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocked_syscall: Option<BlockedSyscall>,
    /// Text the **guest** wrote: the reason after a Linux panic banner
    /// (`Kernel panic - not syncing: `) on its console, if one appeared. Not verified: any guest
    /// process that can write to the console can print it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_console_panic: Option<String>,
}

/// Errors reading an exit file.
#[derive(Debug, thiserror::Error)]
pub enum ExitReportError {
    /// The file cannot be read.
    #[error("cannot read the VMM's exit file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The OS error.
        source: io::Error,
    },
    /// The file holds something other than a report.
    #[error("the VMM's exit file is not a report: {0}")]
    Malformed(String),
}

impl ExitReport {
    /// The report of a run that ended with `reason`, after the console showed the panic
    /// `console_panic` (if any).
    pub fn of_run(reason: &ExitReason, console_panic: Option<&str>) -> ExitReport {
        let (end, exit_code, detail) = match reason {
            ExitReason::Reset => (EndReason::Reset, EXIT_CLEAN, None),
            ExitReason::PowerOff => (EndReason::PowerOff, EXIT_CLEAN, None),
            ExitReason::Stopped => (EndReason::Stopped, EXIT_CLEAN, None),
            ExitReason::GuestCrash => (EndReason::GuestCrash, EXIT_CRASH, None),
            ExitReason::Fatal(msg) => (EndReason::Fatal, EXIT_CRASH, Some(clip(msg))),
        };
        ExitReport {
            version: REPORT_VERSION,
            reason: end,
            exit_code,
            detail,
            blocked_syscall: None,
            guest_console_panic: console_panic.map(clip),
        }
    }

    /// The report of a VMM that could not build or run the VM.
    pub fn error(message: &str) -> ExitReport {
        ExitReport {
            version: REPORT_VERSION,
            reason: EndReason::Error,
            exit_code: EXIT_ERROR,
            detail: Some(clip(message)),
            blocked_syscall: None,
            guest_console_panic: None,
        }
    }

    /// Whether the VM ended without a fault: the guest reset or powered off, or the VMM was
    /// stopped.
    pub fn is_clean(&self) -> bool {
        matches!(
            self.reason,
            EndReason::Reset | EndReason::PowerOff | EndReason::Stopped
        )
    }

    /// One line for people: what the VMM observed, then the console's claim, labelled.
    pub fn describe(&self) -> String {
        let detail = self.detail.as_deref();
        let mut text = match self.reason {
            EndReason::Reset => "the guest reset itself".to_owned(),
            EndReason::PowerOff => "the guest powered itself off".to_owned(),
            EndReason::Stopped => "the VMM stopped the VM on a signal".to_owned(),
            EndReason::GuestCrash => {
                "the guest crashed (KVM reported a triple fault or a crash event)".to_owned()
            }
            EndReason::Fatal => format!("the VM failed: {}", detail.unwrap_or("unknown")),
            EndReason::Error => format!(
                "the VMM could not run the VM: {}",
                detail.unwrap_or("unknown")
            ),
            EndReason::Seccomp => match &self.blocked_syscall {
                Some(call) => format!(
                    "the VMM's seccomp filter blocked syscall {} ({})",
                    call.nr, call.thread
                ),
                None => format!(
                    "the VMM's seccomp filter blocked a system call{}",
                    detail.map(|d| format!(" ({d})")).unwrap_or_default()
                ),
            },
        };
        if let Some(panic) = &self.guest_console_panic {
            text.push_str(&format!(
                "; its console showed a kernel panic message (guest-written text, not verified \
                 by the host): {}",
                panic.escape_debug()
            ));
        }
        text
    }

    /// The report as one JSON line.
    pub fn to_json_line(&self) -> Vec<u8> {
        let mut bytes = serde_json::to_vec(self).unwrap_or_default();
        bytes.push(b'\n');
        bytes
    }

    /// Parses an exit file's bytes.
    ///
    /// # Errors
    /// [`ExitReportError::Malformed`] for anything but a report of a known version.
    pub fn parse(bytes: &[u8]) -> Result<ExitReport, ExitReportError> {
        let report: ExitReport =
            serde_json::from_slice(bytes).map_err(|e| ExitReportError::Malformed(e.to_string()))?;
        if report.version != REPORT_VERSION {
            return Err(ExitReportError::Malformed(format!(
                "version {} (this reader knows {REPORT_VERSION})",
                report.version
            )));
        }
        Ok(report)
    }

    /// Reads the exit file at `path` (at most [`MAX_REPORT_BYTES`]); `Ok(None)` when it does not
    /// exist or is empty (the VMM was killed, or has not ended).
    ///
    /// # Errors
    /// [`ExitReportError`] for an unreadable or malformed file.
    pub fn read(path: &Path) -> Result<Option<ExitReport>, ExitReportError> {
        let read_err = |source| ExitReportError::Read {
            path: path.display().to_string(),
            source,
        };
        let file = match File::open(path) {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(read_err(e)),
        };
        let mut bytes = Vec::new();
        file.take(MAX_REPORT_BYTES)
            .read_to_end(&mut bytes)
            .map_err(read_err)?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(None);
        }
        Self::parse(&bytes).map(Some)
    }
}

/// `text` cut to [`MAX_TEXT_BYTES`] at a character boundary.
fn clip(text: &str) -> String {
    let mut end = text.len().min(MAX_TEXT_BYTES);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}

/// The exit file of a running VMM: created (emptied) at start, written once at the end.
#[derive(Debug)]
pub struct ExitFile(File);

impl ExitFile {
    /// Creates or empties `path` (mode 0600) and registers its descriptor with the SIGSYS
    /// handler, so a seccomp kill is reported there too.
    ///
    /// # Errors
    /// The OS error of opening the file.
    pub fn create(path: &Path) -> io::Result<ExitFile> {
        use std::os::unix::fs::OpenOptionsExt;
        let file = File::options()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(path)?;
        crate::seccomp::report_blocked_calls_to(file.as_raw_fd());
        Ok(ExitFile(file))
    }

    /// The file's descriptor.
    pub fn raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }

    /// Writes `report` with one `write(2)`.
    ///
    /// # Errors
    /// The OS error.
    pub fn write(mut self, report: &ExitReport) -> io::Result<()> {
        self.0.write_all(&report.to_json_line())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reset_after_a_console_panic_stays_a_clean_reset_with_the_claim_quoted() {
        // Arrange
        let reason = ExitReason::Reset;

        // Act
        let report = ExitReport::of_run(&reason, Some("fake"));

        // Assert
        assert_eq!(report.reason, EndReason::Reset);
        assert_eq!(report.exit_code, EXIT_CLEAN);
        assert!(report.is_clean());
        assert_eq!(report.guest_console_panic.as_deref(), Some("fake"));
        assert!(
            !report.describe().contains("crashed"),
            "{}",
            report.describe()
        );
    }

    #[test]
    fn reports_round_trip_through_the_file_format() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("exit.json");
        let report = ExitReport::of_run(&ExitReason::Fatal("KVM_RUN: EFAULT".into()), None);

        // Act
        ExitFile::create(&path).unwrap().write(&report).unwrap();
        let back = ExitReport::read(&path).unwrap();

        // Assert
        assert_eq!(back, Some(report));
    }

    #[test]
    fn an_absent_or_empty_file_is_no_report_and_garbage_is_an_error() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty");
        let garbage = dir.path().join("garbage");
        let future = dir.path().join("future");
        std::fs::write(&empty, b"").unwrap();
        std::fs::write(&garbage, b"bulkhead-vmm: the guest crashed: fake\n").unwrap();
        std::fs::write(&future, br#"{"version":9,"reason":"reset","exit_code":0}"#).unwrap();

        // Act
        let results = [
            ExitReport::read(&dir.path().join("absent")),
            ExitReport::read(&empty),
            ExitReport::read(&garbage),
            ExitReport::read(&future),
        ];

        // Assert
        assert!(matches!(results[0], Ok(None)));
        assert!(matches!(results[1], Ok(None)));
        assert!(matches!(results[2], Err(ExitReportError::Malformed(_))));
        assert!(matches!(results[3], Err(ExitReportError::Malformed(_))));
    }

    #[test]
    fn long_text_is_clipped_at_a_character_boundary() {
        // Arrange
        let long = "é".repeat(MAX_TEXT_BYTES);

        // Act
        let report = ExitReport::error(&long);

        // Assert
        let detail = report.detail.unwrap();
        assert!(detail.len() <= MAX_TEXT_BYTES && detail.chars().all(|c| c == 'é'));
    }

    #[test]
    fn a_seccomp_report_names_the_call_and_its_thread() {
        // Arrange
        let json = br#"{"version":1,"reason":"seccomp","exit_code":4,"blocked_syscall":{"nr":41,"thread":"vcpu"}}"#;

        // Act
        let report = ExitReport::parse(json).unwrap();

        // Assert
        assert!(!report.is_clean());
        assert_eq!(
            report.describe(),
            "the VMM's seccomp filter blocked syscall 41 (vcpu)"
        );
    }
}
