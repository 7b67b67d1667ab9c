//! Sandbox records in the state directory: `<state_dir>/sandboxes/<id>.json`, one per sandbox,
//! written atomically (a temporary file renamed over the old one) before the resources they name
//! exist, and removed only after those resources are gone. A restarted daemon reads them to
//! adopt or clean up every VM of the previous run.
//!
//! A record holds the sandbox's [`SandboxSpec`] (the domain type every front end builds VMs
//! from), not the HTTP request, and carries its format version, `schema`
//! ([`RECORD_SCHEMA`]). Version 1 records (before the field existed, with the create request
//! as `spec`) are migrated when read ([`Record::parse`]); version 2 records (before `paused`
//! and `template`) read as they are.
//!
//! A paused sandbox's saved VM lives beside the records, in `<state_dir>/paused/<id>/`
//! ([`Store::paused_dir`]): its record (phase `paused`) and those files are all it has, so it
//! survives daemon restarts.

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use bulkhead_client::{CreateSandbox, Failure, Limits};
use bulkhead_sandbox::{SandboxSpec, SandboxState};
use serde::{Deserialize, Serialize};

use crate::cgroup::CgroupSpec;
use crate::util;

/// Errors of the record store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A file operation failed.
    #[error("state dir {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// Another daemon holds the state directory.
    #[error("another bulkheadd is using the state dir {0} (its lock is held)")]
    Locked(PathBuf),
}

/// The persisted phase of a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Resources may be half made; a restart destroys it.
    Creating,
    /// `sandbox` holds what adoption needs.
    Running,
    /// The VM ended; kept (with its logs) until deleted.
    Failed,
    /// The VM was saved into [`Store::paused_dir`] and stopped; `sandbox` is None.
    Paused,
}

/// The record format this daemon writes.
pub const RECORD_SCHEMA: u32 = 3;

/// The oldest record format read as it is (version 2 lacks only `template`, which defaults).
const SAME_LAYOUT_SINCE: u64 = 2;

/// Everything the daemon needs to adopt or clean up one sandbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Record {
    /// Format version: [`RECORD_SCHEMA`].
    pub schema: u32,
    /// Sandbox ID.
    pub id: String,
    /// The sandbox as asked for (host paths of its shares resolved).
    pub spec: SandboxSpec,
    /// Creation time, ms since the Unix epoch.
    pub created_at_ms: u64,
    /// TTL deadline, ms since the Unix epoch.
    pub expires_at_ms: Option<u64>,
    /// Persisted phase.
    pub phase: Phase,
    /// Parent of the sandbox's runtime directory (`<runtime root>/<id>`), removed on destroy.
    pub runtime_parent: PathBuf,
    /// The VM's cgroup, when cgroups are on.
    pub cgroup: Option<CgroupSpec>,
    /// Applied limits.
    pub limits: Limits,
    /// Set once running: what `Sandbox::adopt` needs.
    pub sandbox: Option<SandboxState>,
    /// Set when failed.
    pub failure: Option<Failure>,
    /// The template it was restored from, when it was.
    #[serde(default)]
    pub template: Option<String>,
    /// An idle clone of the warm pool, not a sandbox yet: never listed, never adopted (a
    /// restarted daemon destroys it and refills the pool). Left out of the file when false, so
    /// other records keep schema 3's layout.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pool: bool,
}

/// A version 1 record: the same fields without `schema`, with the create request as `spec`.
#[derive(Debug, Deserialize)]
struct RecordV1 {
    id: String,
    spec: CreateSandbox,
    created_at_ms: u64,
    expires_at_ms: Option<u64>,
    phase: Phase,
    runtime_parent: PathBuf,
    cgroup: Option<CgroupSpec>,
    limits: Limits,
    sandbox: Option<SandboxState>,
    failure: Option<Failure>,
}

/// Errors reading a record.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// The file is not JSON, or not a record of a known version.
    #[error("not a sandbox record: {0}")]
    Malformed(String),
    /// A version this daemon does not know (a newer daemon wrote it).
    #[error("record schema {0} is newer than this daemon's ({RECORD_SCHEMA})")]
    Newer(u32),
}

impl Record {
    /// Reads a record of any known version, migrating older ones to [`RECORD_SCHEMA`].
    ///
    /// # Errors
    /// [`RecordError`].
    pub fn parse(bytes: &[u8]) -> Result<Record, RecordError> {
        let malformed = |e: serde_json::Error| RecordError::Malformed(e.to_string());
        let value: serde_json::Value = serde_json::from_slice(bytes).map_err(malformed)?;
        match value.get("schema").map(serde_json::Value::as_u64) {
            None => Ok(serde_json::from_value::<RecordV1>(value)
                .map_err(malformed)?
                .migrate()),
            Some(Some(v)) if (SAME_LAYOUT_SINCE..=u64::from(RECORD_SCHEMA)).contains(&v) => {
                let mut record: Record = serde_json::from_value(value).map_err(malformed)?;
                record.schema = RECORD_SCHEMA;
                Ok(record)
            }
            Some(Some(v)) if v > u64::from(RECORD_SCHEMA) => {
                Err(RecordError::Newer(u32::try_from(v).unwrap_or(u32::MAX)))
            }
            Some(_) => Err(RecordError::Malformed("bad schema field".to_owned())),
        }
    }
}

impl RecordV1 {
    fn migrate(self) -> Record {
        Record {
            schema: RECORD_SCHEMA,
            spec: crate::manager::plan::spec_of(&self.spec),
            id: self.id,
            created_at_ms: self.created_at_ms,
            expires_at_ms: self.expires_at_ms,
            phase: self.phase,
            runtime_parent: self.runtime_parent,
            cgroup: self.cgroup,
            limits: self.limits,
            sandbox: self.sandbox,
            failure: self.failure,
            template: None,
            pool: false,
        }
    }
}

/// Directory of the paused sandboxes' saved VMs in the state directory.
pub const PAUSED_DIR: &str = "paused";

/// The records' directory in the state dir.
const SANDBOXES_DIR: &str = "sandboxes";

/// How long [`Store::open`] retries a held state-dir lock before reporting
/// [`StoreError::Locked`].
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The record directory, locked for this daemon's lifetime.
#[derive(Debug)]
pub struct Store {
    dir: PathBuf,
    paused: PathBuf,
    _lock: fs::File,
}

/// Where the daemon keeps the egress log of sandbox `id` (JSON lines, written by its proxy):
/// `<state_dir>/sandboxes/<id>.egress.jsonl`, beside its record, so that it outlives the VM's
/// runtime directory (a pause, a failed VM) and is removed with the record.
pub fn egress_log_path(state_dir: &Path, id: &str) -> PathBuf {
    state_dir.join(SANDBOXES_DIR).join(egress_log_name(id))
}

fn egress_log_name(id: &str) -> String {
    format!("{id}.egress.jsonl")
}

impl Store {
    /// Creates `<state_dir>/sandboxes` and `<state_dir>/paused` (mode 0700) and takes the state
    /// dir's lock (`<state_dir>/bulkheadd.lock`, flock(2)), so two daemons never share one state
    /// dir. A held lock is retried for up to 2 s (a VMM that a just-killed daemon was spawning
    /// holds it until it execs).
    ///
    /// # Errors
    /// [`StoreError::Locked`] when another daemon holds it; [`StoreError::Io`].
    pub fn open(state_dir: &Path) -> Result<Store, StoreError> {
        let dir = state_dir.join(SANDBOXES_DIR);
        let paused = state_dir.join(PAUSED_DIR);
        create_private_dir(state_dir)?;
        create_private_dir(&dir)?;
        create_private_dir(&paused)?;
        let lock_path = state_dir.join("bulkheadd.lock");
        let lock = fs::File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io_err(&lock_path))?;
        // A daemon killed a moment ago may still hold the lock through a VMM it was spawning
        // (between fork and exec the child shares the descriptor): retry for a little while.
        let deadline = std::time::Instant::now() + LOCK_WAIT;
        let rc = loop {
            // SAFETY: flock on a descriptor we own; LOCK_NB makes it fail instead of blocking.
            let rc = unsafe {
                libc::flock(
                    std::os::fd::AsRawFd::as_raw_fd(&lock),
                    libc::LOCK_EX | libc::LOCK_NB,
                )
            };
            if rc == 0 || std::time::Instant::now() >= deadline {
                break rc;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        if rc != 0 {
            return Err(StoreError::Locked(state_dir.to_owned()));
        }
        let store = Store {
            dir,
            paused,
            _lock: lock,
        };
        store.remove_temporaries();
        Ok(store)
    }

    /// Writes `record` atomically.
    ///
    /// # Errors
    /// [`StoreError::Io`].
    pub fn save(&self, record: &Record) -> Result<(), StoreError> {
        let path = self.path_of(&record.id);
        let tmp = self.dir.join(format!(".{}.json.tmp", record.id));
        let json = serde_json::to_vec_pretty(record).map_err(|e| StoreError::Io {
            path: path.clone(),
            source: io::Error::other(e),
        })?;
        let mut file = fs::File::create(&tmp).map_err(io_err(&tmp))?;
        file.write_all(&json)
            .and_then(|()| file.sync_all())
            .map_err(io_err(&tmp))?;
        fs::rename(&tmp, &path).map_err(io_err(&path))
    }

    /// Removes the record of `id` and its egress log (no error when absent).
    ///
    /// # Errors
    /// [`StoreError::Io`].
    pub fn remove(&self, id: &str) -> Result<(), StoreError> {
        for path in [self.path_of(id), self.dir.join(egress_log_name(id))] {
            match fs::remove_file(&path) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(io_err(&path)(e)),
                _ => {}
            }
        }
        Ok(())
    }

    /// Every readable record. Unreadable ones are logged and left in place for an operator.
    pub fn load_all(&self) -> Vec<Record> {
        let Ok(entries) = fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut records = Vec::new();
        for path in entries.flatten().map(|e| e.path()) {
            let is_record = path.extension().is_some_and(|e| e == "json")
                && path
                    .file_stem()
                    .and_then(|s| s.to_str())
                    .is_some_and(util::is_id);
            if !is_record {
                continue;
            }
            match fs::read(&path).map(|b| Record::parse(&b)) {
                Ok(Ok(record)) => records.push(record),
                Ok(Err(e)) => tracing::error!("ignoring unreadable record {}: {e}", path.display()),
                Err(e) => tracing::error!("cannot read {}: {e}", path.display()),
            }
        }
        records
    }

    /// The record file of `id`.
    pub fn path_of(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }

    /// The egress log of sandbox `id` ([`egress_log_path`]).
    pub fn egress_log_of(&self, id: &str) -> PathBuf {
        self.dir.join(egress_log_name(id))
    }

    /// Where the VM of sandbox `id` is saved while it is paused: `<state_dir>/paused/<id>`.
    pub fn paused_dir(&self, id: &str) -> PathBuf {
        self.paused.join(id)
    }

    /// The IDs that have a directory in `<state_dir>/paused/` (to find strays).
    pub fn paused_ids(&self) -> Vec<String> {
        let Ok(entries) = fs::read_dir(&self.paused) else {
            return Vec::new();
        };
        entries
            .flatten()
            .filter_map(|e| e.file_name().to_str().map(str::to_owned))
            .collect()
    }

    /// Removes the saved VM of sandbox `id` (no error when there is none).
    ///
    /// # Errors
    /// [`StoreError::Io`].
    pub fn remove_paused(&self, id: &str) -> Result<(), StoreError> {
        let path = self.paused_dir(id);
        match fs::remove_dir_all(&path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_err(&path)(e)),
            _ => Ok(()),
        }
    }

    fn remove_temporaries(&self) {
        let Ok(entries) = fs::read_dir(&self.dir) else {
            return;
        };
        for path in entries.flatten().map(|e| e.path()) {
            if path.extension().is_some_and(|e| e == "tmp") {
                let _ = fs::remove_file(path);
            }
        }
    }
}

fn create_private_dir(dir: &Path) -> Result<(), StoreError> {
    use std::os::unix::fs::DirBuilderExt;
    match fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
    {
        Ok(()) => Ok(()),
        Err(e) => Err(io_err(dir)(e)),
    }
}

fn io_err(path: &Path) -> impl Fn(io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.to_owned(),
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str) -> Record {
        Record {
            schema: RECORD_SCHEMA,
            id: id.to_owned(),
            spec: SandboxSpec::default(),
            created_at_ms: 1,
            expires_at_ms: None,
            phase: Phase::Creating,
            runtime_parent: "/run/x".into(),
            cgroup: None,
            limits: Limits {
                memory_bytes: 1,
                cpu_quota: None,
                pids_max: 8,
                cgroup: None,
            },
            sandbox: None,
            failure: None,
            template: None,
            pool: false,
        }
    }

    #[test]
    fn saved_records_load_back_and_removed_ones_do_not() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        store.save(&record("0123456789ab")).unwrap();
        store.save(&record("ba9876543210")).unwrap();

        // Act
        store.remove("ba9876543210").unwrap();
        let loaded = store.load_all();

        // Assert
        assert_eq!(loaded, vec![record("0123456789ab")]);
    }

    #[test]
    fn a_version_1_record_with_the_create_request_is_migrated_to_the_spec() {
        // Arrange: a record as daemons before the spec wrote it.
        let v1 = br#"{"id":"0123456789ab","spec":{"vcpus":2,"memory_mib":512,"image":"debian",
            "disk_mib":64,"env":{"A":"1"},"ttl_s":60,"labels":{"k":"v"},
            "mounts":[{"host":"/srv/data","guest":"/data","ro":true}]},
            "created_at_ms":1,"expires_at_ms":60001,"phase":"running","runtime_parent":"/run/x",
            "cgroup":null,"limits":{"memory_bytes":1,"cpu_quota":null,"pids_max":8,"cgroup":null},
            "sandbox":null,"failure":null}"#;

        // Act
        let record = Record::parse(v1).unwrap();

        // Assert
        assert_eq!(record.schema, RECORD_SCHEMA);
        let spec = &record.spec;
        assert_eq!(
            (spec.vcpus, spec.memory_mib, spec.disk_mib),
            (2, 512, Some(64))
        );
        assert_eq!(
            spec.image,
            Some(bulkhead_sandbox::FileRef::Name("debian".into()))
        );
        assert_eq!(spec.env.get("A").map(String::as_str), Some("1"));
        assert_eq!(spec.labels.get("k").map(String::as_str), Some("v"));
        assert!(spec.mounts[0].read_only);
        assert_eq!(record.expires_at_ms, Some(60001));
    }

    #[test]
    fn a_version_2_record_reads_without_a_template_and_a_paused_one_round_trips() {
        // Arrange: a record as daemons before pause and templates wrote it.
        let mut v2 = serde_json::to_value(record("0123456789ab")).unwrap();
        v2["schema"] = serde_json::json!(2);
        v2.as_object_mut().unwrap().remove("template");
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let mut paused = record("ba9876543210");
        paused.phase = Phase::Paused;
        paused.template = Some("py".into());

        // Act
        let read = Record::parse(v2.to_string().as_bytes()).unwrap();
        store.save(&paused).unwrap();
        let loaded = store.load_all();

        // Assert
        assert_eq!(read, record("0123456789ab"));
        assert_eq!(loaded, vec![paused]);
        assert!(store
            .paused_dir("ba9876543210")
            .starts_with(dir.path().join("paused")));
    }

    #[test]
    fn a_record_of_a_newer_schema_or_garbage_is_refused() {
        // Arrange
        let mut newer = serde_json::to_value(record("0123456789ab")).unwrap();
        newer["schema"] = serde_json::json!(99);

        // Act
        let newer = Record::parse(newer.to_string().as_bytes());
        let garbage = Record::parse(b"[1,2]");

        // Assert
        assert!(matches!(newer, Err(RecordError::Newer(99))), "{newer:?}");
        assert!(
            matches!(garbage, Err(RecordError::Malformed(_))),
            "{garbage:?}"
        );
    }

    #[test]
    fn a_second_daemon_cannot_take_the_same_state_dir() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let _first = Store::open(dir.path()).unwrap();

        // Act
        let second = Store::open(dir.path());

        // Assert
        assert!(matches!(second, Err(StoreError::Locked(_))));
    }
}
