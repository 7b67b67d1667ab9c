//! `bulkhead run --workspace DIR:clone --export-patch FILE | --export-tar FILE`: the changes the
//! command made to its clone workspace, written after it ends and before the VM is destroyed.
//! Nothing reaches DIR; the review section (paths that run code on the host implicitly, entries
//! that cannot be exported) goes to stderr.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use bulkhead_sandbox::{ExportFormat, Sandbox, Workspace, WorkspaceMode};

/// Where and how to export, from the `run` flags.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportTarget {
    /// Patch or tar.
    pub format: ExportFormat,
    /// The file to write (created or truncated; removed again when the export fails).
    pub path: PathBuf,
}

/// The export `run` was asked for, checked against the workspace before anything boots.
///
/// # Errors
/// An export without a clone workspace (a direct workspace's changes are already in DIR).
pub fn target(
    patch: Option<&Path>,
    tar: Option<&Path>,
    workspace: Option<&Workspace>,
) -> Result<Option<ExportTarget>, String> {
    let (format, path) = match (patch, tar) {
        (Some(p), _) => (ExportFormat::Patch, p),
        (None, Some(t)) => (ExportFormat::Tar, t),
        (None, None) => return Ok(None),
    };
    match workspace {
        Some(ws) if ws.mode == WorkspaceMode::Clone => {
            check_output_file("the export", path)?;
            Ok(Some(ExportTarget {
                format,
                path: path.to_owned(),
            }))
        }
        Some(ws) => Err(format!(
            "--export-{} needs a clone workspace (--workspace {}:clone): a direct workspace's \
             changes are already in the directory",
            format_name(format),
            ws.host.display()
        )),
        None => Err(format!(
            "--export-{} needs --workspace DIR:clone",
            format_name(format)
        )),
    }
}

/// Fails unless `path` can be created or replaced as a file: its directory exists and it is
/// not a directory itself. `what` names the output in the message ("the export"). Used for
/// files written after the command ran, so a typo is reported before the sandbox boots rather
/// than when the output would be lost.
pub(crate) fn check_output_file(what: &str, path: &Path) -> Result<(), String> {
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if !parent.is_dir() {
        return Err(format!(
            "cannot write {what} to {}: {} is not a directory",
            path.display(),
            parent.display()
        ));
    }
    if path.is_dir() {
        return Err(format!(
            "cannot write {what} to {}: it is a directory",
            path.display()
        ));
    }
    Ok(())
}

/// `patch` or `tar`, as in the flag names.
fn format_name(format: ExportFormat) -> &'static str {
    match format {
        ExportFormat::Patch => "patch",
        ExportFormat::Tar => "tar",
    }
}

/// Writes the sandbox's workspace changes to `target` and prints what needs review.
///
/// # Errors
/// The file cannot be created or written, or the guest's change set cannot be read; the
/// partial file is removed.
pub fn export(sandbox: &Sandbox, target: &ExportTarget) -> Result<(), String> {
    let path = &target.path;
    let file = File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut out = BufWriter::new(file);
    let written = sandbox
        .export_workspace(target.format, &mut out)
        .map_err(|e| e.to_string())
        .and_then(|diff| {
            out.flush()
                .map_err(|e| format!("{}: {e}", path.display()))?;
            Ok(diff)
        });
    let diff = match written {
        Ok(diff) => diff,
        Err(e) => {
            let _ = std::fs::remove_file(path);
            return Err(format!("exporting the workspace: {e}"));
        }
    };
    eprintln!(
        "bulkhead: wrote the {} of the workspace's {} change(s) to {}",
        format_name(target.format),
        diff.changes.len(),
        path.display()
    );
    let review = diff.review("  ");
    if !review.is_empty() {
        eprint!("bulkhead: flagged for review:\n{review}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ws(mode: WorkspaceMode) -> Workspace {
        Workspace {
            host: PathBuf::from("/src/app"),
            mode,
        }
    }

    #[test]
    fn an_export_needs_a_clone_workspace() {
        // Arrange
        let file = Path::new("/tmp/changes.patch");

        // Act
        let clone = target(Some(file), None, Some(&ws(WorkspaceMode::Clone)));
        let direct = target(Some(file), None, Some(&ws(WorkspaceMode::Direct)));
        let none = target(None, Some(file), None);
        let not_asked = target(None, None, Some(&ws(WorkspaceMode::Direct)));

        // Assert
        assert_eq!(
            clone.unwrap(),
            Some(ExportTarget {
                format: ExportFormat::Patch,
                path: file.to_owned()
            })
        );
        assert!(direct.unwrap_err().contains("/src/app:clone"));
        assert!(none
            .unwrap_err()
            .contains("--export-tar needs --workspace DIR:clone"));
        assert_eq!(not_asked.unwrap(), None);
    }

    #[test]
    fn an_export_into_a_missing_directory_is_refused_before_the_boot() {
        // Arrange
        let clone = ws(WorkspaceMode::Clone);

        // Act
        let missing = target(
            Some(Path::new("/nonexistent-dir/p.patch")),
            None,
            Some(&clone),
        );
        let here = target(Some(Path::new("p.patch")), None, Some(&clone));

        // Assert
        assert!(missing
            .unwrap_err()
            .contains("/nonexistent-dir is not a directory"));
        assert!(here.unwrap().is_some());
    }
}
