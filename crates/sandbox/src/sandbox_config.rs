//! [`SandboxConfig`]: what a sandbox boots and with which resources, as the host's processes
//! need it (the spec's recipe, [`crate::spec`], builds it).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bulkhead_vmm::config::SerialOutput;

use crate::egress::EgressSettings;
use crate::mounts::Mount;
use crate::sandbox::Error;
use crate::spec::build::config_of;
use crate::spec::{HostSettings, SandboxSpec};
use crate::workspace::Workspace;

/// What a sandbox boots and with which resources.
#[derive(Debug, Clone)]
pub struct SandboxConfig {
    /// Guest kernel (ELF vmlinux or bzImage).
    pub kernel: PathBuf,
    /// Initramfs whose `/init` is the bulkhead agent.
    pub initrd: PathBuf,
    /// Number of vCPUs.
    pub vcpus: u8,
    /// Guest RAM, MiB.
    pub memory_mib: u32,
    /// Extra kernel command-line parameters, appended to the defaults. The `bulkhead.` keys
    /// are the agent's boot parameters, which only this crate writes: such an entry is refused.
    pub extra_cmdline: Vec<String>,
    /// The guest's hostname (`bulkhead.hostname=`; 1-64 of `[A-Za-z0-9.-]`); the agent's
    /// default `bulkhead` when `None`.
    pub hostname: Option<String>,
    /// Guest serial console: off by default; a file to keep it.
    pub console: SerialOutput,
    /// The `bulkhead-vmm` binary.
    pub vmm_binary: PathBuf,
    /// Parent of the sandbox's runtime directory.
    pub runtime_dir: PathBuf,
    /// How long to wait for the agent to announce itself.
    pub ready_timeout: Duration,
    /// Stop the VMM (SIGTERM) when this process exits, even by SIGKILL (PR_SET_PDEATHSIG, set
    /// from a process-wide spawner thread, so the thread that called `start` may end first).
    pub kill_on_parent_exit: bool,
    /// `cgroup.procs` files of the cgroups the VMM must run in (one per hierarchy: cgroup v2 has
    /// one, v1 one per controller). The files are opened before the fork and the child writes
    /// `0` into each (moving itself) before it execs, so the VMM is charged from its first
    /// allocation. Empty (the default): the VMM stays in the caller's cgroups.
    pub cgroup_procs: Vec<PathBuf>,
    /// Host directories shared into the guest over virtio-fs and mounted by the agent (see
    /// [`mounts`](crate::mounts)). Checked when the sandbox starts.
    pub mounts: Vec<Mount>,
    /// A host project directory at `/workspace`, direct or clone (see
    /// [`workspace`](crate::workspace)). Checked when the sandbox starts.
    pub workspace: Option<Workspace>,
    /// Jail the VMM when this process runs as root (effective uid 0): own namespaces, a private
    /// root, an unprivileged uid/gid, no capabilities (see [`jail`](crate::jail)). On by
    /// default (`BULKHEAD_JAIL=off` turns the default off, for debugging). Without root the VMM
    /// is never jailed.
    pub jail: bool,
    /// The uid/gid a jailed VMM runs as when its shares leave the choice open (none, or only
    /// root-owned read-only ones), instead of a fresh id: a warm-pool clone's, so that the
    /// mounts of the owner it is handed out to can be attached to it later (see
    /// [`jail`](crate::jail)). Must not be root. `None` (the default): a fresh id.
    pub jail_owner: Option<(u32, u32)>,
    /// The sandbox's network: its egress proxy's settings (see [`crate::egress`]); no network
    /// (no proxy, no way out of the guest) when `None`.
    pub egress: Option<EgressSettings>,
    /// Idle virtio-fs devices for a sandbox that will be snapshotted, so that its restores can
    /// have mounts and a workspace: this many for mounts, plus one for a clone workspace (see
    /// [`crate::snapshot`]); 0 (the default): none. At most [`crate::mounts::MAX_MOUNTS`]; a
    /// sandbox with slots has no mounts or workspace of its own.
    pub share_slots: u8,
    /// Read-only mounts also serve the host's mounts under their directories, those there at
    /// start and those mounted later (the jailed VMM gets a recursive slave bind; see
    /// [`ShareConfig::follow_host_mounts`](bulkhead_vmm::config::ShareConfig::follow_host_mounts)).
    /// The containerd shim shares a pod's container roots this way, each mounted after the VM
    /// is up. Default `false`: a mount is its directory's own file system as it was at boot.
    /// Not kept across a snapshot: a restore's mounts never follow.
    pub follow_host_mounts: bool,
}

impl Default for SandboxConfig {
    /// The default spec on this machine's defaults ([`HostSettings::local`]), without a
    /// hostname (the agent's `bulkhead`).
    fn default() -> Self {
        let host = HostSettings::local();
        config_of(&SandboxSpec::default(), &host, host.kernel.clone(), None)
    }
}

impl SandboxConfig {
    /// Checks that the kernel and initramfs are regular files and that an explicitly located
    /// VMM binary exists, without starting anything; [`Sandbox::start_with`](crate::Sandbox::start_with) runs the same
    /// check. Callers that do host-specific checks (e.g. whether KVM can boot a stock kernel)
    /// call it first, so the user's own mistakes are reported on any host.
    ///
    /// # Errors
    /// [`Error::NotAFile`] for a kernel or initramfs path that is a directory or device,
    /// [`Error::Missing`] (with a hint) for an absent kernel, initramfs or VMM binary,
    /// [`Error::Unreadable`] for a kernel or initramfs path that `stat(2)` refuses otherwise
    /// (e.g. `vmlinux/`).
    pub fn check_files(&self) -> Result<(), Error> {
        for (what, path) in [("kernel", &self.kernel), ("initramfs", &self.initrd)] {
            check_boot_file(what, path)?;
        }
        let vmm = &self.vmm_binary;
        if vmm.components().count() > 1 && !vmm.is_file() {
            return Err(Error::Missing {
                what: "bulkhead-vmm",
                path: vmm.clone(),
                hint: "; build it with `cargo build -p bulkhead-vmm` or set BULKHEAD_VMM",
            });
        }
        Ok(())
    }
}

/// `path` (the `what` of the guest's boot files) is a regular file, following symbolic links.
fn check_boot_file(what: &'static str, path: &Path) -> Result<(), Error> {
    let path_buf = || path.to_owned();
    match fs::metadata(path) {
        Ok(meta) if meta.is_file() => Ok(()),
        Ok(_) => Err(Error::NotAFile {
            what,
            path: path_buf(),
        }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Err(Error::Missing {
            what,
            path: path_buf(),
            hint: "; give the path of an existing file, or run scripts/setup.sh to install the default one",
        }),
        Err(source) => Err(Error::Unreadable {
            what,
            path: path_buf(),
            source,
        }),
    }
}
