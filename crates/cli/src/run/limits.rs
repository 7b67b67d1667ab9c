//! Host limits of a `bulkhead run` (`--cpu-quota`, `--pids-max`): a cgroup of its own for the
//! VMM, under `bulkhead-run/` in each hierarchy, made only when the run asks for a limit. The
//! VMM joins it between fork and exec (as under the daemon) and it is removed when the run
//! ends. Cgroups need root; without a limit nothing here happens.

use bulkhead_sandbox::cgroup::{CgroupManager, CgroupMode, VmCgroup};
use bulkhead_sandbox::Recipe;

/// Parent cgroup of the runs' VMM cgroups (in every hierarchy, under its root).
pub const RUN_CGROUP_PARENT: &str = "bulkhead-run";

/// The run's cgroup; removed (with any process left in it killed) when dropped.
#[derive(Debug)]
pub(crate) struct RunCgroup(VmCgroup);

impl Drop for RunCgroup {
    fn drop(&mut self) {
        if let Err(e) = self.0.remove() {
            eprintln!("bulkhead: warning: {e}");
        }
    }
}

/// Refuses limits that this process cannot apply (it is not root), before anything starts.
///
/// # Errors
/// The explanation.
pub(crate) fn check_allowed(recipe: &Recipe) -> Result<(), String> {
    // SAFETY: geteuid only reads this process's credentials.
    if recipe.requested_limits.any() && unsafe { libc::geteuid() } != 0 {
        return Err(
            "--cpu-quota and --pids-max are cgroup limits of the VMM process and need root \
             (run bulkhead as root, or create the sandbox through bulkheadd)"
                .to_owned(),
        );
    }
    Ok(())
}

/// Creates the run's cgroup with the recipe's limits when it asked for any and points the VMM
/// at it.
///
/// # Errors
/// When cgroups cannot be set up or the cgroup cannot be made.
pub(crate) fn apply(recipe: &mut Recipe) -> Result<Option<RunCgroup>, String> {
    if !recipe.requested_limits.any() {
        return Ok(None);
    }
    let manager = CgroupManager::init(CgroupMode::Auto, Some(RUN_CGROUP_PARENT))
        .map_err(|e| e.to_string())?
        .ok_or(
            "--cpu-quota and --pids-max need a usable cgroup hierarchy, and this host has none",
        )?;
    let cgroup = manager
        .create(&manager.spec_for(&recipe.id), &recipe.limits)
        .map_err(|e| e.to_string())?;
    recipe.config.cgroup_procs = cgroup.procs_files();
    Ok(Some(RunCgroup(cgroup)))
}
