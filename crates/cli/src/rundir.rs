//! Per-run runtime directories of `bulkhead run`: `run-<pid>-<random>` under the runtime dir, so
//! a signal during the boot can remove this run's files, and a later run can sweep the
//! directories of runs that were killed outright (SIGKILL leaves no chance to clean up).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// Prefix of every run directory's name.
const PREFIX: &str = "run-";

/// Creates this run's directory under `parent` (created if missing), first removing the
/// directories of earlier runs whose process no longer exists.
///
/// # Errors
/// A one-line message when `parent` or the directory cannot be created.
pub fn create(parent: &Path) -> Result<tempfile::TempDir, String> {
    let fail = |e: io::Error| {
        format!(
            "cannot create a runtime directory in {}: {e}",
            parent.display()
        )
    };
    fs::create_dir_all(parent).map_err(fail)?;
    for stale in stale_dirs(parent) {
        // Best effort: another run may be sweeping the same directory right now.
        let _ = fs::remove_dir_all(stale);
    }
    tempfile::Builder::new()
        .prefix(&format!("{PREFIX}{}-", std::process::id()))
        .tempdir_in(parent)
        .map_err(fail)
}

/// How often [`remove`] deletes a run directory's tree again when entries appeared in it while
/// it was being deleted.
const REMOVE_ATTEMPTS: usize = 20;

/// Removes the run directory `dir` while this run's boot (on another thread) and its VMM may
/// still be creating files in it. `remove_dir_all` alone then fails with ENOTEMPTY whenever an
/// entry appears in a directory after it was listed, so `dir` is first renamed to
/// `<dir>.stopping` (new lookups of paths under `dir` then fail with ENOENT, and the new name
/// still carries this run's pid, so a later run sweeps it should this fail), and the renamed
/// tree is deleted until it is gone, up to [`REMOVE_ATTEMPTS`] times. A `dir` created again in
/// the meantime (the boot makes its parent with `create_dir_all`) is deleted too.
/// Best effort: errors are not reported (the caller is about to exit on a signal).
pub fn remove(dir: &Path) {
    let mut aside = dir.as_os_str().to_owned();
    aside.push(".stopping");
    let aside = PathBuf::from(aside);
    let _ = fs::rename(dir, &aside);
    for _ in 0..REMOVE_ATTEMPTS {
        let gone = [&aside, dir].into_iter().all(|path| {
            matches!(fs::remove_dir_all(path), Err(e) if e.kind() == io::ErrorKind::NotFound)
        });
        if gone {
            return;
        }
    }
}

/// Run directories under `parent` whose owning process has exited. Directories whose owner
/// cannot be told (other names, a pid that exists again) are left alone.
fn stale_dirs(parent: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(parent) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter(|e| {
            owner_pid(&e.file_name().to_string_lossy()).is_some_and(|pid| !process_exists(pid))
        })
        .map(|e| e.path())
        .collect()
}

/// The pid in a run directory's name `run-<pid>-<random>`.
fn owner_pid(name: &str) -> Option<i32> {
    let (pid, _) = name.strip_prefix(PREFIX)?.split_once('-')?;
    pid.parse().ok().filter(|pid| *pid > 0)
}

fn process_exists(pid: i32) -> bool {
    // SAFETY: kill(2) with signal 0 only checks whether the process exists; no pointers.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_pid_is_read_from_the_name() {
        assert_eq!(owner_pid("run-1234-abcDEF"), Some(1234));
        assert_eq!(owner_pid("run-x-abc"), None);
        assert_eq!(owner_pid("run-0-abc"), None);
        assert_eq!(owner_pid("sandbox-12-abc"), None);
        assert_eq!(owner_pid("run-12"), None);
    }

    #[test]
    fn a_run_dir_still_being_filled_is_removed_completely() {
        // Arrange: a run directory and a thread that keeps creating files and directories in
        // it (as the boot and the VMM do) until it no longer can.
        let parent = tempfile::tempdir().unwrap();
        let dir = parent
            .path()
            .join(format!("run-{}-busy", std::process::id()));
        fs::create_dir_all(dir.join("sb-1")).unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let filler = {
            let (dir, stop) = (dir.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut made = 0usize;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let sub = dir.join("sb-1").join(format!("d{made}"));
                    if fs::create_dir(&sub).is_err() || fs::write(sub.join("f"), b"x").is_err() {
                        break;
                    }
                    made += 1;
                }
                made
            })
        };
        while !dir.join("sb-1").join("d100").exists() {
            std::thread::yield_now();
        }

        // Act
        remove(&dir);
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let made = filler.join().unwrap();

        // Assert: nothing is left, under either name.
        assert!(made >= 100);
        let left: Vec<_> = fs::read_dir(parent.path()).unwrap().flatten().collect();
        assert!(left.is_empty(), "left: {left:?}");
    }

    #[test]
    fn removing_a_run_dir_that_is_already_gone_does_nothing() {
        let parent = tempfile::tempdir().unwrap();

        remove(&parent.path().join("run-1-gone"));

        assert_eq!(fs::read_dir(parent.path()).unwrap().count(), 0);
    }

    #[test]
    fn a_dead_run_is_swept_and_live_or_foreign_dirs_are_kept() {
        // Arrange: a pid that has exited (a reaped child), our own pid, and a foreign directory.
        let parent = tempfile::tempdir().unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let dead_dir = parent.path().join(format!("run-{dead}-old"));
        let live_dir = parent
            .path()
            .join(format!("run-{}-live", std::process::id()));
        let foreign = parent.path().join("sandbox-1");
        for dir in [&dead_dir, &live_dir, &foreign] {
            fs::create_dir(dir).unwrap();
            fs::write(dir.join("vm.json"), b"{}").unwrap();
        }

        // Act
        let created = create(parent.path()).unwrap();

        // Assert
        assert!(!dead_dir.exists());
        assert!(live_dir.exists() && foreign.exists());
        let name = created
            .path()
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        assert_eq!(owner_pid(&name), Some(std::process::id() as i32));
    }
}
