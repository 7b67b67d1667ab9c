//! Workspace diff and export of a running sandbox (`bulkhead-sandbox`'s `workspace` module),
//! run on the blocking pool.

use std::fs::File;
use std::io::{self, Seek, SeekFrom, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bulkhead_client::SandboxState;
use bulkhead_protocol::client::AgentClient;
use bulkhead_sandbox::workspace::{self, ExportFormat, WorkspaceDiff, WorkspaceError};

use super::{Manager, ManagerError};

/// Why a workspace request failed: the sandbox (not found, not running) or the workspace.
#[derive(Debug, thiserror::Error)]
pub enum WorkspaceFailure {
    /// The sandbox cannot serve it.
    #[error(transparent)]
    Manager(#[from] ManagerError),
    /// The diff or export failed.
    #[error(transparent)]
    Workspace(#[from] WorkspaceError),
}

impl Manager {
    /// The agent client and runtime directory of running sandbox `id`.
    fn workspace_target(&self, id: &str) -> Result<(AgentClient, PathBuf), ManagerError> {
        let entry = self.existing(id)?;
        let inner = entry.lock();
        match (&inner.state, &inner.sandbox) {
            (SandboxState::Running, Some(sandbox)) => match sandbox.runtime_path() {
                Some(dir) => Ok((sandbox.client(), dir.to_owned())),
                None => Err(ManagerError::Internal(format!(
                    "sandbox {} has no runtime directory",
                    entry.id
                ))),
            },
            (state, _) => Err(ManagerError::Conflict {
                id: entry.id.clone(),
                state: state.as_str(),
            }),
        }
    }

    /// What changed in sandbox `id`'s workspace.
    ///
    /// # Errors
    /// [`WorkspaceFailure`].
    pub async fn workspace_diff(&self, id: &str) -> Result<WorkspaceDiff, WorkspaceFailure> {
        let (client, dir) = self.workspace_target(id)?;
        let diff = tokio::task::spawn_blocking(move || workspace::diff(&client, &dir))
            .await
            .map_err(|e| ManagerError::Internal(format!("the diff task failed: {e}")))??;
        Ok(diff)
    }

    /// The export of sandbox `id`'s clone workspace in an unnamed temporary file (in its
    /// runtime directory, gone when closed), positioned at its start, and the diff it holds.
    ///
    /// # Errors
    /// [`WorkspaceFailure`].
    pub async fn workspace_export(
        &self,
        id: &str,
        format: ExportFormat,
    ) -> Result<(File, WorkspaceDiff), WorkspaceFailure> {
        let (client, dir) = self.workspace_target(id)?;
        // When the request goes away (the client disconnected), this future is dropped with
        // the guard, and the export stops at its next write instead of finishing for nobody.
        let guard = CancelOnDrop::default();
        let cancelled = guard.flag();
        let result = tokio::task::spawn_blocking(move || {
            let io = |op, source| WorkspaceError::Io {
                op,
                path: dir.clone(),
                source,
            };
            let file = tempfile::tempfile_in(&dir).map_err(|e| io("create a file in", e))?;
            let mut out = Cancellable {
                inner: file,
                cancelled,
            };
            let diff = workspace::export(&client, &dir, format, &mut out)?;
            let mut file = out.inner;
            file.seek(SeekFrom::Start(0))
                .map_err(|e| io("rewind the export in", e))?;
            Ok::<_, WorkspaceError>((file, diff))
        })
        .await
        .map_err(|e| ManagerError::Internal(format!("the export task failed: {e}")))??;
        drop(guard);
        Ok(result)
    }
}

/// Sets its flag when dropped: the request that owns it is gone.
#[derive(Debug, Default)]
struct CancelOnDrop(Arc<AtomicBool>);

impl CancelOnDrop {
    fn flag(&self) -> Arc<AtomicBool> {
        self.0.clone()
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// A writer that fails every write once `cancelled` is set (error kind `Interrupted` is not
/// used: callers would retry it), so a long export ends early.
struct Cancellable<W> {
    inner: W,
    cancelled: Arc<AtomicBool>,
}

impl<W: Write> Write for Cancellable<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.cancelled.load(Ordering::Relaxed) {
            return Err(io::Error::other("the client went away"));
        }
        self.inner.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_fail_once_the_request_is_dropped() {
        // Arrange
        let guard = CancelOnDrop::default();
        let mut out = Cancellable {
            inner: Vec::new(),
            cancelled: guard.flag(),
        };
        out.write_all(b"before").unwrap();

        // Act
        drop(guard);
        let after = out.write_all(b"after");

        // Assert
        assert_eq!(out.inner, b"before");
        assert!(after.unwrap_err().to_string().contains("went away"));
    }
}
