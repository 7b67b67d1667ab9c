//! Small helpers: sandbox IDs, timestamps, host memory.

use std::fs;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

/// Length of a sandbox ID, characters (lowercase hex).
pub const ID_LEN: usize = 12;

/// A new random sandbox ID: 12 lowercase hex digits (48 bits from `/dev/urandom`).
///
/// # Errors
/// When `/dev/urandom` cannot be read.
pub fn new_id() -> io::Result<String> {
    let mut bytes = [0u8; ID_LEN / 2];
    fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// True for strings shaped like a sandbox ID (so paths built from it stay inside their dirs).
pub fn is_id(text: &str) -> bool {
    text.len() == ID_LEN && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// What an ID or ID prefix names among `ids` (Docker-style short IDs): the ID equal to `given`,
/// else the only one that starts with it. `Ok(None)` when none does (and for an empty
/// `given`, which would match everything); `Err` with every match, sorted, when several do.
/// A full ID that is gone never names another sandbox, since all IDs have [`ID_LEN`] characters.
pub fn resolve_id<'a>(
    ids: impl IntoIterator<Item = &'a str>,
    given: &str,
) -> Result<Option<&'a str>, Vec<String>> {
    if given.is_empty() {
        return Ok(None);
    }
    let mut matches: Vec<&str> = ids.into_iter().filter(|id| id.starts_with(given)).collect();
    if let Some(exact) = matches.iter().find(|id| **id == given) {
        return Ok(Some(*exact));
    }
    match matches.len() {
        0 => Ok(None),
        1 => Ok(matches.pop()),
        _ => {
            matches.sort_unstable();
            Err(matches.into_iter().map(str::to_owned).collect())
        }
    }
}

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// `ms` since the Unix epoch as RFC 3339 UTC with milliseconds, e.g. `2025-03-01T12:00:00.250Z`.
pub fn rfc3339(ms: u64) -> String {
    let secs = ms / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms % 1000
    )
}

/// The proleptic Gregorian date of day `days` after 1970-01-01 (H. Hinnant's algorithm,
/// "chrono-Compatible Low-Level Date Algorithms").
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// The host's available memory (`MemAvailable` in `/proc/meminfo`), MiB.
///
/// # Errors
/// When `/proc/meminfo` cannot be read or has no `MemAvailable` line.
pub fn available_memory_mib() -> io::Result<u64> {
    let text = fs::read_to_string("/proc/meminfo")?;
    text.lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kib| kib / 1024)
        .ok_or_else(|| io::Error::other("no MemAvailable in /proc/meminfo"))
}

/// Most bytes read from the end of a log for [`tail_lines`] (64 KiB).
const TAIL_BYTES: u64 = 64 * 1024;

/// The last `count` lines of the file at `path` (read from at most its last 64 KiB); empty when
/// it cannot be read.
pub fn tail_lines(path: &Path, count: usize) -> String {
    let Ok(mut file) = fs::File::open(path) else {
        return String::new();
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let mut bytes = Vec::new();
    let read = file
        .seek(SeekFrom::Start(len.saturating_sub(TAIL_BYTES)))
        .and_then(|_| file.read_to_end(&mut bytes));
    if read.is_err() {
        return String::new();
    }
    let text = String::from_utf8_lossy(&bytes);
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(count)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_format_as_rfc3339_utc() {
        // Arrange: 2024-02-29T23:59:58.007Z (a leap day)
        let ms = 1_709_251_198_007;

        // Act
        let text = rfc3339(ms);

        // Assert
        assert_eq!(text, "2024-02-29T23:59:58.007Z");
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
    }

    #[test]
    fn a_unique_prefix_names_its_sandbox_and_an_ambiguous_one_lists_the_candidates() {
        // Arrange
        let ids = ["ab12cd34ef56", "ab99cd34ef56", "0123456789ab"];

        // Act
        let full = resolve_id(ids, "ab12cd34ef56");
        let short = resolve_id(ids, "0");
        let ambiguous = resolve_id(ids, "ab");
        let unknown = resolve_id(ids, "ffff");
        let empty = resolve_id(ids, "");

        // Assert
        assert_eq!(full, Ok(Some("ab12cd34ef56")));
        assert_eq!(short, Ok(Some("0123456789ab")));
        assert_eq!(
            ambiguous,
            Err(vec!["ab12cd34ef56".to_owned(), "ab99cd34ef56".to_owned()])
        );
        assert_eq!(unknown, Ok(None));
        assert_eq!(empty, Ok(None));
    }

    #[test]
    fn ids_are_twelve_hex_digits() {
        // Arrange / Act
        let id = new_id().unwrap();

        // Assert
        assert!(is_id(&id), "{id}");
        assert!(!is_id("../../etc/pw"));
        assert!(!is_id("ABCDEF012345"));
    }
}
