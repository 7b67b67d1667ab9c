//! Sandbox records in the state directory: `<state_dir>/sandboxes/<id>.json`, one per sandbox,
//! written atomically (a temporary file renamed over the old one) before the resources they name
//! exist, and removed only after those resources are gone. A restarted daemon reads them to
//! adopt or clean up every VM of the previous run.

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use bulkhead_client::{CreateSandbox, Failure, Limits};
use bulkhead_sandbox::SandboxState;
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
}

/// Everything the daemon needs to adopt or clean up one sandbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// Sandbox ID.
    pub id: String,
    /// The creation request.
    pub spec: CreateSandbox,
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
}

/// The record directory, locked for this daemon's lifetime.
#[derive(Debug)]
pub struct Store {
    dir: PathBuf,
    _lock: fs::File,
}

impl Store {
    /// Creates `<state_dir>/sandboxes` (mode 0700) and takes the state dir's lock
    /// (`<state_dir>/bulkheadd.lock`, flock(2)), so two daemons never share one state dir.
    ///
    /// # Errors
    /// [`StoreError::Locked`] when another daemon holds it; [`StoreError::Io`].
    pub fn open(state_dir: &Path) -> Result<Store, StoreError> {
        let dir = state_dir.join("sandboxes");
        create_private_dir(state_dir)?;
        create_private_dir(&dir)?;
        let lock_path = state_dir.join("bulkheadd.lock");
        let lock = fs::File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io_err(&lock_path))?;
        // SAFETY: flock on a descriptor we own; LOCK_NB makes it fail instead of blocking.
        let rc = unsafe {
            libc::flock(
                std::os::fd::AsRawFd::as_raw_fd(&lock),
                libc::LOCK_EX | libc::LOCK_NB,
            )
        };
        if rc != 0 {
            return Err(StoreError::Locked(state_dir.to_owned()));
        }
        let store = Store { dir, _lock: lock };
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

    /// Removes the record of `id` (no error when absent).
    ///
    /// # Errors
    /// [`StoreError::Io`].
    pub fn remove(&self, id: &str) -> Result<(), StoreError> {
        let path = self.path_of(id);
        match fs::remove_file(&path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_err(&path)(e)),
            _ => Ok(()),
        }
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
            match fs::read(&path).map(|b| serde_json::from_slice::<Record>(&b)) {
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
            id: id.to_owned(),
            spec: CreateSandbox::default(),
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
