//! Guest clock readings for the `Ready` message.

use bulkhead_protocol::BootTimestamps;

/// Reads `clock` in nanoseconds; 0 when the clock is unavailable.
fn read_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        return 0;
    }
    let secs = u64::try_from(ts.tv_sec).unwrap_or(0);
    let nanos = u64::try_from(ts.tv_nsec).unwrap_or(0);
    secs.saturating_mul(1_000_000_000).saturating_add(nanos)
}

/// `CLOCK_BOOTTIME` and `CLOCK_REALTIME` now, in ns.
pub fn now() -> BootTimestamps {
    BootTimestamps {
        boottime_ns: read_ns(libc::CLOCK_BOOTTIME),
        realtime_ns: read_ns(libc::CLOCK_REALTIME),
    }
}
