//! Container execs: a command run as an OCI container's process inside the VM
//! ([`ContainerExec`], the `container` field of [`crate::ExecRequest`]).
//!
//! The containerd shim shares a container's root file system into the guest (virtio-fs) and
//! asks the agent to run the OCI spec's `process` in it. The agent gives the container's first
//! process its own mount and PID namespaces (it is PID 1 there, and `/proc` shows only the
//! container), moves the root onto `/` and `chroot`s into it (as `switch_root` does: the guest's
//! own root may be the initramfs, where `pivot_root(2)` is refused), mounts `/proc`, binds the
//! guest's `/dev` and mounts `/sys` read-only where the root has those directories, then sets the
//! limits, groups and ids the spec names. Later execs into the same container
//! ([`ContainerExec::join_pid`]) enter the namespaces of its first process instead.
//!
//! The VM is the security boundary; these namespaces give a container the view an OCI runtime
//! gives it (its own root, its own process tree), not a second wall.

use serde::{Deserialize, Serialize};

use crate::ByteString;

/// Most supplementary groups a container exec may name (`NGROUPS_MAX` is 65536; OCI specs name
/// a handful).
pub const MAX_CONTAINER_GROUPS: usize = 256;

/// Most resource limits a container exec may name (Linux has 16 `RLIMIT_*` resources).
pub const MAX_CONTAINER_RLIMITS: usize = 16;

/// How an exec runs as a container process (OCI runtime spec, `process` and `root`).
///
/// With it, the request's `cwd` is a path inside `root`, and its `user` (`uid`, `uid:gid`, or
/// a name) is looked up in `root`'s `/etc/passwd`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContainerExec {
    /// The container's root file system: an absolute guest directory (usually a virtio-fs
    /// share of the OCI bundle's `rootfs`).
    pub root: ByteString,
    /// Enter the mount and PID namespaces of this running process (the `pid` of the `Started`
    /// frame of the container's first process) instead of making new ones: `exec` into a
    /// running container. `root` must be the one that process was started with.
    #[serde(default)]
    pub join_pid: Option<u32>,
    /// Supplementary group IDs (OCI `process.user.additionalGids`), at most
    /// [`MAX_CONTAINER_GROUPS`]; none when empty.
    #[serde(default)]
    pub groups: Vec<u32>,
    /// Resource limits set before the program starts (OCI `process.rlimits`), at most
    /// [`MAX_CONTAINER_RLIMITS`].
    #[serde(default)]
    pub rlimits: Vec<Rlimit>,
    /// Set `PR_SET_NO_NEW_PRIVS` (OCI `process.noNewPrivileges`): set-user-ID programs and file
    /// capabilities grant nothing.
    #[serde(default)]
    pub no_new_privileges: bool,
    /// Give a new container `root` read-only (OCI `root.readonly`: writes fail with `EROFS`;
    /// `/proc`, `/dev` and `/sys` are mounted as usual). By default (false) the container sees `root` under an overlay whose upper
    /// layer is guest RAM private to the container: it can write anywhere, `root` is never
    /// changed, and the writes go with the container.
    #[serde(default)]
    pub read_only_root: bool,
}

/// One resource limit (`setrlimit(2)`; OCI `process.rlimits[]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rlimit {
    /// The resource as OCI names it: `RLIMIT_NOFILE`, `RLIMIT_NPROC`, ... (`RLIMIT_` and the
    /// names of `getrlimit(2)`).
    #[serde(rename = "type")]
    pub kind: String,
    /// Soft limit; `u64::MAX` is `RLIM_INFINITY`.
    pub soft: u64,
    /// Hard limit; `u64::MAX` is `RLIM_INFINITY`.
    pub hard: u64,
}

impl ContainerExec {
    /// A new container rooted at `root`, with no groups, limits or flags.
    pub fn new(root: impl Into<ByteString>) -> Self {
        ContainerExec {
            root: root.into(),
            join_pid: None,
            groups: Vec::new(),
            rlimits: Vec::new(),
            no_new_privileges: false,
            read_only_root: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_container_exec_round_trips_with_oci_names_for_limits() {
        // Arrange
        let mut spec = ContainerExec::new("/run/c1/rootfs");
        spec.join_pid = Some(42);
        spec.groups = vec![10, 20];
        spec.rlimits.push(Rlimit {
            kind: "RLIMIT_NOFILE".into(),
            soft: 1024,
            hard: 4096,
        });

        // Act
        let json = serde_json::to_string(&spec).unwrap();
        let back: ContainerExec = serde_json::from_str(&json).unwrap();

        // Assert
        assert!(json.contains(r#""type":"RLIMIT_NOFILE""#), "{json}");
        assert_eq!(back, spec);
    }

    #[test]
    fn only_the_root_is_required_and_unknown_fields_are_refused() {
        // Act
        let minimal: ContainerExec = serde_json::from_str(r#"{"root":"/r"}"#).unwrap();
        let unknown = serde_json::from_str::<ContainerExec>(r#"{"root":"/r","cgroup":"x"}"#);

        // Assert
        assert_eq!(minimal, ContainerExec::new("/r"));
        assert!(unknown.is_err());
    }
}
