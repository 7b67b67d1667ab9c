//! Host settings that make VM creation slow, found from `/proc`, for the daemon's start-up log
//! and `bulkhead bench`.
//!
//! `KVM_CREATE_VM` on x86 starts a `kvm-nx-lpage-recovery` kernel thread and moves it into the
//! creating process's cgroups (`cgroup_attach_task_all`). That move write-locks
//! `cgroup_threadgroup_rwsem`, as does every write to a `cgroup.procs` file. Since Linux 6.0 this
//! per-CPU semaphore favours its readers (fork and exit) again, so each writer waits for an RCU
//! grace period, unless the cgroup2 root is mounted with `favordynmods` (Linux commit
//! 6a010a49b63a, "cgroup: Make !percpu threadgroup_rwsem operations optional"). Firecracker's
//! production host setup guide describes the same cost on 6.1 hosts. Measured in bulkhead's
//! nested test host (Linux 6.1): `KVM_CREATE_VM` took 21–23 ms without the option and ~3 ms
//! with it, out of a template restore's ~190 ms.

use std::fs;

/// The mount point systemd and the test host give the cgroup2 hierarchy.
const CGROUP2_MOUNT: &str = "/sys/fs/cgroup";

/// A sentence for the operator when this host makes every VM creation wait for an RCU grace
/// period (see the module docs); `None` when it does not, or when `/proc` cannot tell.
pub fn slow_vm_creation_hint() -> Option<String> {
    let mounts = fs::read_to_string("/proc/mounts").ok()?;
    let release = fs::read_to_string("/proc/sys/kernel/osrelease").ok()?;
    hint_for(&mounts, release.trim())
}

/// [`slow_vm_creation_hint`] for the given `/proc/mounts` text and kernel release (`uname -r`).
fn hint_for(mounts: &str, release: &str) -> Option<String> {
    if kernel_version(release)? < (6, 0) {
        return None;
    }
    let options = mounts.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        match fields.as_slice() {
            [_, CGROUP2_MOUNT, "cgroup2", options, ..] => Some(*options),
            _ => None,
        }
    })?;
    if options.split(',').any(|o| o == "favordynmods") {
        return None;
    }
    Some(format!(
        "cgroup2 at {CGROUP2_MOUNT} is mounted without favordynmods: every VM creation and \
         cgroup move waits for an RCU grace period (~20 ms in the test host); \
         `mount -o remount,favordynmods {CGROUP2_MOUNT}` as root removes that wait \
         (docs/daemon.md, \"Host tuning\")"
    ))
}

/// `(major, minor)` of a kernel release such as `6.1.0-28-amd64`.
fn kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SYSTEMD: &str = "sysfs /sys sysfs rw,nosuid 0 0\n\
        cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime,nsdelegate,memory_recursiveprot 0 0\n";
    const TUNED: &str = "cgroup2 /sys/fs/cgroup cgroup2 rw,relatime,nsdelegate,favordynmods 0 0\n";
    const V1_HYBRID: &str = "tmpfs /sys/fs/cgroup tmpfs rw 0 0\n\
        cgroup /sys/fs/cgroup/memory cgroup rw,memory 0 0\n\
        cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0\n";

    #[test]
    fn systemd_cgroup2_on_a_6_x_kernel_gets_the_remount_hint() {
        // Act
        let hint = hint_for(SYSTEMD, "6.1.0-28-amd64");

        // Assert
        let hint = hint.expect("a hint");
        assert!(
            hint.contains("mount -o remount,favordynmods /sys/fs/cgroup"),
            "{hint}"
        );
    }

    #[test]
    fn favordynmods_older_kernels_and_v1_hosts_get_none() {
        // Act
        let tuned = hint_for(TUNED, "6.12.9");
        let old_kernel = hint_for(SYSTEMD, "5.15.0-91-generic");
        let v1 = hint_for(V1_HYBRID, "6.8.0");

        // Assert
        assert_eq!((tuned, old_kernel, v1), (None, None, None));
    }

    #[test]
    fn kernel_versions_parse_from_distribution_releases() {
        // Act
        let found = [
            kernel_version("6.1.0-28-amd64"),
            kernel_version("5.10.186"),
            kernel_version("6.12.9+bpo-arm64"),
            kernel_version("junk"),
        ];

        // Assert
        assert_eq!(found, [Some((6, 1)), Some((5, 10)), Some((6, 12)), None]);
    }
}
