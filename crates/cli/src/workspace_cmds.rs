//! `bulkhead diff` and `bulkhead export`: the workspace changes of a daemon sandbox, and the
//! `--workspace`/`--mount` values of `bulkhead create` as API documents.
//!
//! Both verbs print what needs review (paths that run code on the host implicitly, entries that
//! could not be exported) to stderr, after the output proper (stdout or the export file).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use bulkhead_client::{
    ChangeKind, ExportFormat, MountSpec, SkippedPath, WorkspaceChange, WorkspaceDiffInfo,
    WorkspaceMode, WorkspaceSpec,
};
use bulkhead_sandbox::workspace::quote_path;
use bulkhead_sandbox::{Mount, Workspace};

use crate::daemon_cmds::{block_on, DaemonOpts};
use crate::run::closed_stdio::{check_stdout, print_stdout};

/// `bulkhead diff`: what changed in a sandbox's workspace.
#[derive(Debug, clap::Args)]
pub struct DiffArgs {
    #[command(flatten)]
    daemon: DaemonOpts,
    /// Print the diff as JSON (flagged changes have `"flagged": true` and a `reason`).
    #[arg(long)]
    json: bool,
    /// The sandbox.
    id: String,
}

/// `bulkhead export`: the changes of a sandbox's clone workspace as a patch or a tar archive.
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("format").required(true).args(["patch", "tar"])))]
pub struct ExportArgs {
    #[command(flatten)]
    daemon: DaemonOpts,
    /// Write a git-style binary patch (`git apply FILE` in the directory or a copy); `-` for
    /// stdout. Paths inside .git/ are left out (git apply refuses them): use --tar for those.
    #[arg(long, value_name = "FILE")]
    patch: Option<PathBuf>,
    /// Write a tar archive of the changed files with `.bulkhead-export/deleted` (NUL-separated
    /// deleted paths) and `.bulkhead-export/manifest.json`; `-` for stdout.
    #[arg(long, value_name = "FILE")]
    tar: Option<PathBuf>,
    /// The sandbox.
    id: String,
}

/// `--workspace DIR[:direct|:clone]` of `bulkhead create`, with DIR made absolute here (the
/// daemon has another working directory).
pub fn workspace_spec(workspace: &Workspace) -> Result<WorkspaceSpec, String> {
    Ok(WorkspaceSpec {
        path: absolute(&workspace.host)?,
        mode: match workspace.mode {
            bulkhead_sandbox::WorkspaceMode::Direct => WorkspaceMode::Direct,
            bulkhead_sandbox::WorkspaceMode::Clone => WorkspaceMode::Clone,
        },
    })
}

/// `--mount HOST:GUEST[:ro]` of `bulkhead create`, with HOST made absolute.
pub fn mount_spec(mount: &Mount) -> Result<MountSpec, String> {
    Ok(MountSpec {
        host: absolute(&mount.host)?,
        guest: mount.guest.display().to_string(),
        ro: mount.read_only,
    })
}

fn absolute(path: &Path) -> Result<String, String> {
    let path = std::path::absolute(path).map_err(|e| format!("{}: {e}", path.display()))?;
    path.to_str()
        .map(str::to_owned)
        .ok_or_else(|| format!("{} is not UTF-8", path.display()))
}

/// `bulkhead diff`.
pub fn diff(args: DiffArgs) -> ExitCode {
    block_on(async move {
        let diff = args
            .daemon
            .client()
            .workspace_diff(&args.id)
            .await
            .map_err(|e| e.to_string())?;
        let text = match args.json {
            true => serde_json::to_string_pretty(&diff).unwrap_or_default() + "\n",
            false => name_status(&diff),
        };
        print_stdout(&text)?;
        eprint!("{}", notes(&diff));
        let flagged: Vec<&WorkspaceChange> = diff.changes.iter().filter(|c| c.flagged).collect();
        eprint!(
            "{}",
            review(&flagged, flagged.len(), &diff.skipped, diff.skipped.len())
        );
        Ok(0)
    })
}

/// `git diff --name-status`-style lines.
fn name_status(diff: &WorkspaceDiffInfo) -> String {
    diff.changes
        .iter()
        .map(|c| format!("{}\t{}\n", letter(c), shown(c)))
        .collect()
}

fn letter(change: &WorkspaceChange) -> &'static str {
    match change.status {
        bulkhead_client::ChangeStatus::Added => "A",
        bulkhead_client::ChangeStatus::Modified => "M",
        bulkhead_client::ChangeStatus::Deleted => "D",
    }
}

/// The path, quoted when odd, with a `/` after directories.
fn shown(change: &WorkspaceChange) -> String {
    match change.kind {
        ChangeKind::Dir => quote_path(&format!("{}/", change.path)),
        _ => quote_path(&change.path),
    }
}

/// What the diff does not cover.
fn notes(diff: &WorkspaceDiffInfo) -> String {
    let mut out = String::new();
    if diff.flagged_only {
        out.push_str(&format!(
            "bulkhead: direct workspace: only the paths that run code on the host implicitly are \
             tracked (since the sandbox started); every other change is already in {}\n",
            quote_path(&diff.path)
        ));
    }
    if !diff.complete {
        out.push_str(
            "bulkhead: warning: the directory has more entries than the snapshot covers; \
             flagged paths may be missing\n",
        );
    }
    out
}

/// The "flagged for review" section (empty when nothing needs review).
fn review(
    flagged: &[&WorkspaceChange],
    flagged_total: usize,
    skipped: &[SkippedPath],
    skipped_total: usize,
) -> String {
    if flagged_total == 0 && skipped_total == 0 {
        return String::new();
    }
    let mut out = format!(
        "bulkhead: flagged for review: {flagged_total} change(s) to paths that run code on the \
         host implicitly{}:\n",
        match skipped_total {
            0 => String::new(),
            n => format!(", {n} entr(y/ies) that cannot be exported"),
        }
    );
    for change in flagged {
        out.push_str(&format!(
            "  {} {}  ({})\n",
            letter(change),
            shown(change),
            change.reason.as_deref().unwrap_or_default()
        ));
    }
    if flagged_total > flagged.len() {
        out.push_str(&format!(
            "  ... and {} more\n",
            flagged_total - flagged.len()
        ));
    }
    for entry in skipped {
        out.push_str(&format!(
            "  ? {}  ({})\n",
            quote_path(&entry.path),
            entry.reason
        ));
    }
    if skipped_total > skipped.len() {
        out.push_str(&format!(
            "  ... and {} more\n",
            skipped_total - skipped.len()
        ));
    }
    out
}

/// `bulkhead export`.
pub fn export(args: ExportArgs) -> ExitCode {
    block_on(async move {
        let (format, target) = match (&args.patch, &args.tar) {
            (Some(file), None) => (ExportFormat::Patch, file.clone()),
            (None, Some(file)) => (ExportFormat::Tar, file.clone()),
            _ => return Err("give exactly one of --patch FILE and --tar FILE".into()),
        };
        let client = args.daemon.client();
        let to_stdout = target.as_os_str() == "-";
        let review_doc = if to_stdout {
            use std::os::fd::AsFd as _;
            check_stdout()?;
            let fd = std::io::stdout()
                .as_fd()
                .try_clone_to_owned()
                .map_err(|e| format!("stdout: {e}"))?;
            let mut stdout = tokio::fs::File::from_std(std::fs::File::from(fd));
            client.workspace_export(&args.id, format, &mut stdout).await
        } else {
            let file = tokio::fs::File::create(&target)
                .await
                .map_err(|e| format!("{}: {e}", target.display()))?;
            let mut file = tokio::io::BufWriter::new(file);
            let result = client.workspace_export(&args.id, format, &mut file).await;
            if result.is_err() {
                let _ = tokio::fs::remove_file(&target).await;
            }
            result
        }
        .map_err(|e| e.to_string())?;
        if !to_stdout {
            eprintln!(
                "bulkhead: wrote the {} of {}'s workspace changes to {}",
                format.as_str(),
                args.id,
                target.display()
            );
        }
        let flagged: Vec<&WorkspaceChange> = review_doc.flagged.iter().collect();
        eprint!(
            "{}",
            review(
                &flagged,
                review_doc.flagged_total,
                &review_doc.skipped,
                review_doc.skipped_total
            )
        );
        Ok(0)
    })
}

#[cfg(test)]
mod tests {
    use bulkhead_client::ChangeStatus;

    use super::*;

    fn change(path: &str, kind: ChangeKind, reason: Option<&str>) -> WorkspaceChange {
        WorkspaceChange {
            path: path.into(),
            status: ChangeStatus::Added,
            kind,
            flagged: reason.is_some(),
            reason: reason.map(str::to_owned),
        }
    }

    #[test]
    fn name_status_quotes_odd_names_and_marks_directories() {
        // Arrange
        let diff = WorkspaceDiffInfo {
            mode: WorkspaceMode::Clone,
            path: "/p".into(),
            flagged_only: false,
            complete: true,
            changes: vec![
                change("a\nb", ChangeKind::File, None),
                change("empty", ChangeKind::Dir, None),
            ],
            skipped: Vec::new(),
        };

        // Act
        let text = name_status(&diff);

        // Assert
        assert_eq!(text, "A\t\"a\\nb\"\nA\tempty/\n");
    }

    #[test]
    fn the_review_lists_flagged_changes_with_reasons_and_counts_the_rest() {
        // Arrange
        let hook = change(".git/hooks/pre-commit", ChangeKind::File, Some("git hook"));

        // Act
        let text = review(
            &[&hook],
            3,
            &[SkippedPath {
                path: "bad\u{fffd}".into(),
                reason: "not UTF-8".into(),
            }],
            1,
        );

        // Assert
        assert!(text.contains("3 change(s)"), "{text}");
        assert!(
            text.contains("  A .git/hooks/pre-commit  (git hook)\n"),
            "{text}"
        );
        assert!(text.contains("... and 2 more"), "{text}");
        assert!(
            text.contains("? \"bad\\357\\277\\275\"  (not UTF-8)"),
            "{text}"
        );
        assert_eq!(review(&[], 0, &[], 0), "");
    }
}
