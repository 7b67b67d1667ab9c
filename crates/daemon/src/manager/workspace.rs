//! Workspace diff and export of a running sandbox (`bulkhead-sandbox`'s `workspace` module),
//! run on the blocking pool.

use std::fs::File;
use std::io::{Seek, SeekFrom};
use std::path::PathBuf;

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
        let entry = self
            .entry(id)
            .ok_or_else(|| ManagerError::NotFound(id.to_owned()))?;
        let inner = entry.lock();
        match (&inner.state, &inner.sandbox) {
            (SandboxState::Running, Some(sandbox)) => match sandbox.runtime_path() {
                Some(dir) => Ok((sandbox.client(), dir.to_owned())),
                None => Err(ManagerError::Internal(format!(
                    "sandbox {id} has no runtime directory"
                ))),
            },
            (state, _) => Err(ManagerError::Conflict {
                id: id.to_owned(),
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
        let result = tokio::task::spawn_blocking(move || {
            let io = |op, source| WorkspaceError::Io {
                op,
                path: dir.clone(),
                source,
            };
            let mut file = tempfile::tempfile_in(&dir).map_err(|e| io("create a file in", e))?;
            let diff = workspace::export(&client, &dir, format, &mut file)?;
            file.seek(SeekFrom::Start(0))
                .map_err(|e| io("rewind the export in", e))?;
            Ok::<_, WorkspaceError>((file, diff))
        })
        .await
        .map_err(|e| ManagerError::Internal(format!("the export task failed: {e}")))??;
        Ok(result)
    }
}
