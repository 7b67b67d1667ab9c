//! Host directories in create requests (`workspace`, `mounts`): each must be an absolute path
//! that resolves (symbolic links followed) to a directory inside one of the daemon's
//! `mount_roots`; then `bulkhead-sandbox`'s own checks apply (at most 8 mounts, plain guest
//! paths, no guest path twice, no read-write share of a root-owned directory by a root daemon,
//! no mount inside a clone workspace).

use std::path::{Path, PathBuf};

use bulkhead_client::{CreateSandbox, WorkspaceMode as ApiMode};
use bulkhead_sandbox::{mounts, workspace, Mount, Workspace, WorkspaceMode};

use super::ManagerError;
use crate::config::Config;

/// The mounts and workspace of `spec`, with host paths resolved and checked.
///
/// # Errors
/// [`ManagerError::Invalid`] naming the field and the problem.
pub fn shares_of(
    config: &Config,
    spec: &CreateSandbox,
) -> Result<(Vec<Mount>, Option<Workspace>), ManagerError> {
    if spec.mounts.is_empty() && spec.workspace.is_none() {
        return Ok((Vec::new(), None));
    }
    let roots: Vec<PathBuf> = config
        .mount_roots
        .iter()
        .filter_map(|r| r.canonicalize().ok())
        .collect();
    if roots.is_empty() {
        return invalid(
            "this daemon shares no host directories: its configuration has no mount_roots \
             (or none of them exists)"
                .to_owned(),
        );
    }
    let mut resolved = Vec::with_capacity(spec.mounts.len());
    for (i, m) in spec.mounts.iter().enumerate() {
        resolved.push(Mount {
            host: host_dir(&m.host, &format!("mounts[{i}].host"), &roots)?,
            guest: PathBuf::from(&m.guest),
            read_only: m.ro,
        });
    }
    let ws = match &spec.workspace {
        Some(w) => Some(Workspace {
            host: host_dir(&w.path, "workspace.path", &roots)?,
            mode: match w.mode {
                ApiMode::Direct => WorkspaceMode::Direct,
                ApiMode::Clone => WorkspaceMode::Clone,
            },
        }),
        None => None,
    };
    mounts::check(&resolved).map_err(|e| ManagerError::Invalid(format!("mounts: {e}")))?;
    workspace::check(ws.as_ref(), &resolved).map_err(|e| ManagerError::Invalid(e.to_string()))?;
    Ok((resolved, ws))
}

fn invalid<T>(message: String) -> Result<T, ManagerError> {
    Err(ManagerError::Invalid(message))
}

/// `text` as an absolute path resolved inside one of `roots`.
fn host_dir(text: &str, field: &str, roots: &[PathBuf]) -> Result<PathBuf, ManagerError> {
    let path = Path::new(text);
    if !path.is_absolute() {
        return invalid(format!("{field} {text:?} must be an absolute host path"));
    }
    let resolved = match path.canonicalize() {
        Ok(p) => p,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return invalid(format!("{field} {text:?} does not exist"))
        }
        Err(e) => return invalid(format!("{field} {text:?}: {e}")),
    };
    if !roots.iter().any(|root| resolved.starts_with(root)) {
        return invalid(format!(
            "{field} {text:?} is outside the directories this daemon may share (mount_roots)"
        ));
    }
    if !resolved.is_dir() {
        return invalid(format!("{field} {text:?} is not a directory"));
    }
    Ok(resolved)
}

#[cfg(test)]
mod tests {
    use bulkhead_client::{MountSpec, WorkspaceSpec};

    use super::*;

    fn config(roots: &[&Path]) -> Config {
        Config {
            mount_roots: roots.iter().map(|r| r.to_path_buf()).collect(),
            ..Config::default()
        }
    }

    fn with_workspace(path: &Path, mode: ApiMode) -> CreateSandbox {
        CreateSandbox {
            workspace: Some(WorkspaceSpec {
                path: path.display().to_string(),
                mode,
            }),
            ..CreateSandbox::default()
        }
    }

    fn message<T: std::fmt::Debug>(result: Result<T, ManagerError>) -> String {
        match result {
            Err(ManagerError::Invalid(m)) => m,
            other => panic!("expected a 400, got {other:?}"),
        }
    }

    #[test]
    fn shares_inside_a_mount_root_are_resolved() {
        // Arrange
        let root = tempfile::tempdir().unwrap();
        let project = root.path().join("project");
        std::fs::create_dir(&project).unwrap();
        let mut spec = with_workspace(&project, ApiMode::Clone);
        spec.mounts.push(MountSpec {
            host: root.path().display().to_string(),
            guest: "/data".into(),
            ro: true,
        });

        // Act
        let (mounts, ws) = shares_of(&config(&[root.path()]), &spec).unwrap();

        // Assert
        let ws = ws.unwrap();
        assert_eq!(ws.mode, WorkspaceMode::Clone);
        assert_eq!(ws.host, project.canonicalize().unwrap());
        assert_eq!(mounts.len(), 1);
        assert!(mounts[0].read_only);
    }

    #[test]
    fn paths_outside_the_roots_relative_or_missing_and_disabled_sharing_are_400s() {
        // Arrange
        let root = tempfile::tempdir().unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        let escape = root.path().join("escape");
        std::os::unix::fs::symlink(elsewhere.path(), &escape).unwrap();
        let cfg = config(&[root.path()]);

        // Act
        let outside = message(shares_of(
            &cfg,
            &with_workspace(elsewhere.path(), ApiMode::Clone),
        ));
        let via_link = message(shares_of(&cfg, &with_workspace(&escape, ApiMode::Clone)));
        let relative = message(shares_of(
            &cfg,
            &with_workspace(Path::new("rel"), ApiMode::Direct),
        ));
        let missing = message(shares_of(
            &cfg,
            &with_workspace(&root.path().join("nope"), ApiMode::Direct),
        ));
        let disabled = message(shares_of(
            &Config::default(),
            &with_workspace(root.path(), ApiMode::Clone),
        ));

        // Assert
        assert!(outside.contains("outside"), "{outside}");
        assert!(via_link.contains("outside"), "{via_link}");
        assert!(relative.contains("absolute"), "{relative}");
        assert!(missing.contains("does not exist"), "{missing}");
        assert!(disabled.contains("mount_roots"), "{disabled}");
    }
}
