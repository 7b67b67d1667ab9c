//! The egress log: one JSON object a line (JSON Lines), one file per proxy.
//!
//! Written by the proxy for every decision (denied connections and requests; each spliced
//! tunnel when it ends; each plain-HTTP or intercepted request when its response ends), read
//! back by [`read_log`] for `bulkhead logs --egress` and `GET /v1/sandboxes/{id}/egress`.
//! The file stops growing at [`MAX_LOG_BYTES`]: a hostile guest cannot fill the host's disk
//! through it (one last line says the log was cut).

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::policy::{Decision, Verdict};

/// Size at which the log stops growing, in bytes (64 MiB).
pub const MAX_LOG_BYTES: u64 = 64 << 20;
/// Longest path kept in a log line, in characters.
const MAX_LOGGED_PATH: usize = 512;

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// The log file cannot be created or read.
    #[error("egress log {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A line is not a log entry.
    #[error("egress log {path}, line {line}: {source}")]
    Parse {
        /// The file.
        path: String,
        /// The line number, from 1.
        line: usize,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
}

/// How the guest's traffic went through the proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Via {
    /// A `CONNECT` tunnel whose bytes were spliced (TLS not intercepted).
    Tunnel,
    /// A request inside an intercepted TLS connection.
    Intercepted,
    /// A plain-HTTP absolute-form request.
    Http,
}

/// One line of the egress log.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogEntry {
    /// When the line was written, RFC 3339 in UTC.
    pub time: String,
    /// The host as requested (normalised name or IP address).
    pub host: String,
    /// The TCP port.
    pub port: u16,
    /// How the traffic went.
    pub via: Via,
    /// The request method, when the proxy saw the request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    /// The request path (query dropped, cut at 512 characters), when the proxy saw it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Allowed or denied.
    pub decision: Verdict,
    /// The rule that decided, if one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
    /// Why.
    pub reason: String,
    /// The HTTP status returned to the guest, when there was one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// Names of the secrets injected into the request.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<String>,
    /// Bytes from the guest to the upstream (request bodies, or tunnel bytes).
    pub bytes_up: u64,
    /// Bytes from the upstream to the guest (response bodies, or tunnel bytes).
    pub bytes_down: u64,
}

impl LogEntry {
    /// A line for `host:port` with `decision`, no request, no bytes, stamped now.
    pub fn new(host: &str, port: u16, via: Via, decision: &Decision) -> LogEntry {
        LogEntry {
            time: now_rfc3339(),
            host: host.to_owned(),
            port,
            via,
            method: None,
            path: None,
            decision: decision.verdict,
            rule: decision.rule.clone(),
            reason: decision.reason.clone(),
            status: None,
            secrets: Vec::new(),
            bytes_up: 0,
            bytes_down: 0,
        }
    }

    /// Adds the request's method and path (query dropped, cut).
    pub fn with_request(mut self, method: &str, path: &str) -> LogEntry {
        let path = path.split('?').next().unwrap_or_default();
        self.method = Some(method.chars().take(32).collect());
        self.path = Some(path.chars().take(MAX_LOGGED_PATH).collect());
        self
    }
}

/// The current time as RFC 3339 UTC (`2026-12-03T15:04:05.123Z`).
fn now_rfc3339() -> String {
    let now = time::OffsetDateTime::now_utc();
    now.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|_| now.unix_timestamp().to_string())
}

/// The writer: one line a call, serialised by a mutex, capped at [`MAX_LOG_BYTES`].
#[derive(Debug)]
pub(crate) struct EgressLog {
    state: Mutex<WriterState>,
}

#[derive(Debug)]
struct WriterState {
    file: File,
    written: u64,
    full: bool,
}

impl EgressLog {
    /// Opens (creating, mode 0600, appending) the log at `path`.
    pub fn open(path: &Path) -> Result<EgressLog, LogError> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(path)
            .map_err(|source| LogError::Io {
                path: path.display().to_string(),
                source,
            })?;
        let written = file.metadata().map(|m| m.len()).unwrap_or(0);
        Ok(EgressLog {
            state: Mutex::new(WriterState {
                file,
                written,
                full: written >= MAX_LOG_BYTES,
            }),
        })
    }

    /// Appends one entry; write errors are reported through `tracing` and otherwise ignored
    /// (the proxy keeps working with a broken log).
    pub fn record(&self, entry: &LogEntry) {
        let Ok(mut line) = serde_json::to_string(entry) else {
            return;
        };
        line.push('\n');
        let mut state = match self.state.lock() {
            Ok(state) => state,
            Err(poisoned) => poisoned.into_inner(),
        };
        if state.full {
            return;
        }
        if state.written + line.len() as u64 > MAX_LOG_BYTES {
            state.full = true;
            line = "{\"truncated\":\"egress log reached its size limit\"}\n".to_owned();
        }
        match state.file.write_all(line.as_bytes()) {
            Ok(()) => state.written += line.len() as u64,
            Err(e) => tracing::warn!("egress log write failed: {e}"),
        }
    }
}

/// Reads a whole egress log. A final line cut by the size limit is skipped.
///
/// # Errors
/// [`LogError::Io`] when the file cannot be read, [`LogError::Parse`] for a line that is not an
/// entry.
pub fn read_log(path: &Path) -> Result<Vec<LogEntry>, LogError> {
    let shown = path.display().to_string();
    let file = File::open(path).map_err(|source| LogError::Io {
        path: shown.clone(),
        source,
    })?;
    read_log_from(BufReader::new(file), &shown)
}

/// Reads egress log lines from any reader (`name` is used in errors).
///
/// # Errors
/// As [`read_log`].
pub fn read_log_from(reader: impl BufRead, name: &str) -> Result<Vec<LogEntry>, LogError> {
    let mut entries = Vec::new();
    for (index, line) in reader.lines().enumerate() {
        let line = line.map_err(|source| LogError::Io {
            path: name.to_owned(),
            source,
        })?;
        if line.trim().is_empty() || line.starts_with("{\"truncated\"") {
            continue;
        }
        let entry = serde_json::from_str(&line).map_err(|source| LogError::Parse {
            path: name.to_owned(),
            line: index + 1,
            source,
        })?;
        entries.push(entry);
    }
    Ok(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(host: &str) -> LogEntry {
        LogEntry::new(
            host,
            443,
            Via::Tunnel,
            &Decision::deny(None, "no allow rule matches"),
        )
    }

    #[test]
    fn entries_written_are_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("egress.jsonl");
        let log = EgressLog::open(&path).unwrap();

        log.record(&line("a.test"));
        log.record(&line("b.test").with_request("GET", "/x?secret=1"));
        let entries = read_log(&path).unwrap();

        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0].host, "a.test");
        assert_eq!(
            entries[1].path.as_deref(),
            Some("/x"),
            "the query is not logged"
        );
        assert!(entries[0].time.ends_with('Z'));
    }

    #[test]
    fn a_line_that_is_not_an_entry_is_an_error_naming_the_line() {
        let text = format!(
            "{}\nnot json\n",
            serde_json::to_string(&line("a.test")).unwrap()
        );

        let err = read_log_from(text.as_bytes(), "egress.jsonl")
            .unwrap_err()
            .to_string();

        assert!(err.contains("egress.jsonl, line 2"), "{err}");
    }

    #[test]
    fn the_log_stops_growing_at_its_limit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("egress.jsonl");
        std::fs::File::create(&path)
            .unwrap()
            .set_len(MAX_LOG_BYTES - 10)
            .unwrap();
        let log = EgressLog::open(&path).unwrap();

        log.record(&line("a.test"));
        log.record(&line("b.test"));

        let size = std::fs::metadata(&path).unwrap().len();
        assert!(size <= MAX_LOG_BYTES + 64, "{size}");
    }
}
