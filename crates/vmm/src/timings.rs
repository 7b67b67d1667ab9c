//! The `--timings-json` report: the VMM's boot timeline as milliseconds since its process
//! started, with that origin on the host's `CLOCK_MONOTONIC` so another process (the sandbox
//! library) can place its own moments on the same timeline.
//!
//! `bulkhead-vmm` writes the report twice, each time atomically (a temporary file renamed over
//! the target, so a reader sees either nothing or a whole report):
//!
//! 1. as soon as the vCPU threads have started ([`TimingsReport::running`] is true, `exited`
//!    absent). This happens before the event loop first runs, so before any virtio device —
//!    the vsock device that carries the agent's readiness message included — is serviced: a
//!    host that has received the agent's `Ready` can read the report without waiting or polling;
//! 2. when the VM has ended (`exited` set).
//!
//! The file is one JSON object: the [`TimelineMs`] fields at top level (so readers of the older
//! format still parse it), plus `origin_monotonic_ns`, `running` and `guest_memory`.

use std::io::{self, Write};
use std::path::Path;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use vm_memory::{GuestMemory, GuestMemoryMmap, GuestMemoryRegion};

use crate::vmm::{BootTimeline, TimelineMs};

/// Errors reading or writing a timings report.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file could not be written, renamed or read.
    #[error("timings file {path}: {source}")]
    Io {
        /// The report's path.
        path: std::path::PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// The file is not a timings report.
    #[error("timings file {path} is not valid: {source}")]
    Parse {
        /// The report's path.
        path: std::path::PathBuf,
        /// The JSON error.
        source: serde_json::Error,
    },
}

/// The moment a process took as its origin, on two clocks at once: an [`Instant`] for offsets
/// inside the process and `CLOCK_MONOTONIC` nanoseconds to share with other processes.
#[derive(Debug, Clone, Copy)]
pub struct ProcessClock {
    /// The origin as an [`Instant`].
    pub instant: Instant,
    /// The origin as `CLOCK_MONOTONIC`, ns (the clock `Instant` uses on Linux, readable by any
    /// process on the host).
    pub monotonic_ns: u64,
}

impl ProcessClock {
    /// The current moment.
    pub fn now() -> Self {
        ProcessClock {
            instant: Instant::now(),
            monotonic_ns: monotonic_ns(),
        }
    }
}

/// `CLOCK_MONOTONIC` now, in ns (0 if the clock cannot be read, which Linux never does).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
    if unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) } != 0 {
        return 0;
    }
    let secs = u64::try_from(ts.tv_sec).unwrap_or(0);
    let nanos = u64::try_from(ts.tv_nsec).unwrap_or(0);
    secs.saturating_mul(1_000_000_000).saturating_add(nanos)
}

/// One guest RAM region as the VMM maps it: its host virtual address range. With these, a tool
/// reading `/proc/<pid>/smaps` can tell guest pages from the VMM's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostRange {
    /// Host virtual address of the mapping's start.
    pub host_addr: u64,
    /// Length, bytes.
    pub len: u64,
}

/// The host ranges of every guest RAM region of `mem`.
pub fn guest_ranges(mem: &GuestMemoryMmap) -> Vec<HostRange> {
    mem.iter()
        .map(|region| HostRange {
            host_addr: region.as_ptr() as u64,
            len: region.len(),
        })
        .collect()
}

/// The `--timings-json` file (see the module docs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TimingsReport {
    /// Moments of the boot, ms since the VMM process started.
    #[serde(flatten)]
    pub timeline: TimelineMs,
    /// The VMM process's start (the origin of every `*_ms` value) as host `CLOCK_MONOTONIC`, ns.
    pub origin_monotonic_ns: u64,
    /// True in the report written while the VM runs, false in the one written at exit.
    pub running: bool,
    /// Host virtual address ranges of guest RAM.
    #[serde(default)]
    pub guest_memory: Vec<HostRange>,
}

impl TimingsReport {
    /// The report for `timeline` with `origin` as the process start.
    pub fn new(
        timeline: &BootTimeline,
        origin: ProcessClock,
        running: bool,
        guest_memory: Vec<HostRange>,
    ) -> Self {
        TimingsReport {
            timeline: timeline.offsets_ms(origin.instant),
            origin_monotonic_ns: origin.monotonic_ns,
            running,
            guest_memory,
        }
    }

    /// Writes the report to `path` atomically: to `path` + `.tmp`, then renamed over `path`.
    ///
    /// # Errors
    /// [`Error::Io`] when writing or renaming fails (the temporary file is removed).
    pub fn write_atomic(&self, path: &Path) -> Result<(), Error> {
        let tmp = path.with_extension("json.tmp");
        let io_err = |source| Error::Io {
            path: path.to_owned(),
            source,
        };
        let json = serde_json::to_vec(self).map_err(|e| io_err(io::Error::other(e)))?;
        let written = std::fs::File::create(&tmp)
            .and_then(|mut f| f.write_all(&json))
            .and_then(|()| std::fs::rename(&tmp, path));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(io_err(e));
        }
        Ok(())
    }

    /// Reads a report written by [`TimingsReport::write_atomic`].
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be read, [`Error::Parse`] when it is not a report.
    pub fn read(path: &Path) -> Result<Self, Error> {
        let text = std::fs::read(path).map_err(|source| Error::Io {
            path: path.to_owned(),
            source,
        })?;
        serde_json::from_slice(&text).map_err(|source| Error::Parse {
            path: path.to_owned(),
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_report_round_trips_and_keeps_the_old_top_level_fields() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("timings.json");
        let origin = ProcessClock::now();
        let timeline = BootTimeline {
            build_started: Some(origin.instant + Duration::from_millis(1)),
            vm_created: Some(origin.instant + Duration::from_millis(5)),
            ..BootTimeline::default()
        };
        let ranges = vec![HostRange {
            host_addr: 0x7f00_0000_0000,
            len: 128 << 20,
        }];
        let report = TimingsReport::new(&timeline, origin, true, ranges);

        // Act
        report.write_atomic(&path).unwrap();
        let back = TimingsReport::read(&path).unwrap();
        let old: TimelineMs = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();

        // Assert
        assert_eq!(back, report);
        assert!(old.vm_created.is_some_and(|ms| (ms - 5.0).abs() < 1e-6));
        assert!(!dir.path().join("timings.json.tmp").exists());
    }

    #[test]
    fn the_monotonic_clock_advances() {
        let a = monotonic_ns();
        let b = monotonic_ns();

        assert!(a > 0 && b >= a);
    }

    #[test]
    fn a_missing_report_is_an_io_error_naming_the_file() {
        let err = TimingsReport::read(Path::new("/nonexistent/t.json")).unwrap_err();

        assert!(matches!(err, Error::Io { .. }));
        assert!(err.to_string().contains("/nonexistent/t.json"));
    }
}
