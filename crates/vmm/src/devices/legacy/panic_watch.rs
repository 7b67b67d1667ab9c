//! Noticing what looks like a guest kernel panic on the serial console.
//!
//! With `panic=1` (the default command line) a panicking Linux guest resets itself a second
//! later through the same path as `reboot`: the i8042 reset line on x86_64, PSCI SYSTEM_RESET on
//! aarch64. KVM and the VMM see the two identically. What differs is the console: before it
//! resets, a panicking kernel prints its banner `Kernel panic - not syncing: <reason>` at
//! KERN_EMERG, which reaches the console even under `quiet` (Linux `kernel/panic.c`). The UART's
//! output passes through a [`PanicWatch`], which remembers the reason after the first banner.
//!
//! The console is the guest's: any guest process that can write to it can print the banner
//! without a panic. So the reason is only ever reported as what it is, text the guest wrote
//! (`guest_console_panic` in the exit report, [`crate::exit_report`]); how the VM ended is what
//! the VMM observed (a reset), never what the console says.

use std::io::{self, Write};
use std::sync::{Arc, OnceLock};

/// What a panicking Linux kernel prints before the reason.
pub const PANIC_BANNER: &[u8] = b"Kernel panic - not syncing: ";

/// Longest reason kept (bytes); the rest of the line is dropped.
pub const MAX_REASON_BYTES: usize = 200;

/// The reason of the first panic a [`PanicWatch`] saw, shared with the VMM.
pub type GuestPanic = Arc<OnceLock<String>>;

/// Where the watcher is in the console's byte stream.
#[derive(Debug)]
enum Scan {
    /// This many leading bytes of [`PANIC_BANNER`] match the latest output.
    Banner(usize),
    /// The banner was seen; the reason so far.
    Reason(Vec<u8>),
    /// The reason has been recorded; nothing more to look for.
    Done,
}

/// A console sink that passes every byte on to `inner` and records the first kernel panic.
#[derive(Debug)]
pub struct PanicWatch<W> {
    inner: W,
    scan: Scan,
    seen: GuestPanic,
}

impl<W: Write> PanicWatch<W> {
    /// Wraps `inner`; the returned handle holds the panic's reason once the guest printed it.
    ///
    /// ```
    /// use std::io::Write;
    /// use bulkhead_vmm::devices::legacy::panic_watch::PanicWatch;
    ///
    /// let (mut console, panic) = PanicWatch::new(Vec::new());
    /// console.write_all(b"Kernel panic - not syncing: Attempted to kill init!\n").unwrap();
    /// assert_eq!(panic.get().map(String::as_str), Some("Attempted to kill init!"));
    /// ```
    pub fn new(inner: W) -> (Self, GuestPanic) {
        let seen = GuestPanic::default();
        let watch = PanicWatch {
            inner,
            scan: Scan::Banner(0),
            seen: seen.clone(),
        };
        (watch, seen)
    }

    /// Advances the scan over `bytes`.
    fn scan(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.scan = match std::mem::replace(&mut self.scan, Scan::Done) {
                Scan::Banner(matched) => banner_step(matched, b),
                Scan::Reason(reason) => self.reason_step(reason, b),
                Scan::Done => return,
            };
        }
    }

    /// One more byte of the reason: a line end (or the length cap) records it.
    fn reason_step(&self, mut reason: Vec<u8>, b: u8) -> Scan {
        if b != b'\n' && b != b'\r' && reason.len() < MAX_REASON_BYTES {
            reason.push(b);
            return Scan::Reason(reason);
        }
        let text: String = String::from_utf8_lossy(&reason)
            .chars()
            .filter(|c| !c.is_control())
            .collect();
        let _ = self.seen.set(text.trim_end().to_owned());
        Scan::Done
    }
}

/// One more console byte while looking for the banner, `matched` bytes of it matching so far.
/// The banner's first byte (`K`) occurs nowhere else in it, so after a mismatch a match can only
/// restart at the current byte.
fn banner_step(matched: usize, b: u8) -> Scan {
    if b == PANIC_BANNER[matched] {
        if matched + 1 == PANIC_BANNER.len() {
            return Scan::Reason(Vec::new());
        }
        return Scan::Banner(matched + 1);
    }
    Scan::Banner(usize::from(b == PANIC_BANNER[0]))
}

impl<W: Write> Write for PanicWatch<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self.inner.write(buf) {
            Ok(n) => {
                self.scan(&buf[..n]);
                Ok(n)
            }
            Err(e) => {
                // The caller drops these bytes (a console that fails must not stop the guest),
                // but the guest did print them.
                self.scan(buf);
                Err(e)
            }
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watch_bytes_one_at_a_time(output: &[u8]) -> (Vec<u8>, Option<String>) {
        let (mut console, panic) = PanicWatch::new(Vec::new());
        for b in output {
            console.write_all(&[*b]).unwrap();
        }
        (console.inner, panic.get().cloned())
    }

    #[test]
    fn a_panic_banner_records_its_reason_and_every_byte_passes_through() {
        let output = b"[ 1.0] Oops\nKernel panic - not syncing: Fatal exception in interrupt\r\n\
                       Kernel panic - not syncing: a second one\n";

        let (passed, reason) = watch_bytes_one_at_a_time(output);

        assert_eq!(passed, output);
        assert_eq!(reason.as_deref(), Some("Fatal exception in interrupt"));
    }

    #[test]
    fn a_banner_after_a_false_start_is_still_found() {
        let (_, reason) = watch_bytes_one_at_a_time(b"KKernel pKernel panic - not syncing: x\n");

        assert_eq!(reason.as_deref(), Some("x"));
    }

    #[test]
    fn ordinary_output_and_an_unfinished_banner_record_nothing() {
        let (_, reason) =
            watch_bytes_one_at_a_time(b"reboot: Restarting system\nKernel panic - not sync");

        assert_eq!(reason, None);
    }

    #[test]
    fn a_long_reason_is_cut_and_control_bytes_are_dropped() {
        let mut output = PANIC_BANNER.to_vec();
        output.extend(b"\x1b[1m");
        output.extend(vec![b'a'; 500]);

        let (_, reason) = watch_bytes_one_at_a_time(&output);

        let reason = reason.unwrap();
        assert!(reason.starts_with("[1maaa"), "{reason}");
        assert_eq!(reason.len(), MAX_REASON_BYTES - 1);
    }

    struct Broken;

    impl Write for Broken {
        fn write(&mut self, _: &[u8]) -> io::Result<usize> {
            Err(io::Error::from(io::ErrorKind::BrokenPipe))
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_panic_is_seen_even_when_the_console_output_fails() {
        let (mut console, panic) = PanicWatch::new(Broken);

        let written = console.write(b"Kernel panic - not syncing: VFS: unable to mount root\n");

        assert!(written.is_err());
        assert_eq!(
            panic.get().map(String::as_str),
            Some("VFS: unable to mount root")
        );
    }
}
