//! A `bulkheadd` booting real VMs (`bulkhead-vmm`, the guest kernel, the agent image), for the
//! VM-level tests and the daemon benchmark. They run where guests can boot: here, or inside the
//! nested test host (see the `bulkhead-tests` harness), which has no cgroup mounts of its own, so
//! the unified hierarchy (cgroup v2) is mounted at `/sys/fs/cgroup` first.

use std::path::{Path, PathBuf};
use std::process::Command;

use bulkhead_client::CreateSandbox;
use bulkhead_tests::artifacts;

use super::TestDaemon;

/// Mounts cgroup2 at /sys/fs/cgroup unless a hierarchy is there already.
pub fn ensure_cgroup2() {
    let base = Path::new("/sys/fs/cgroup");
    if base.join("cgroup.controllers").exists() || base.join("memory").exists() {
        return;
    }
    let status = Command::new("mount")
        .args(["-t", "cgroup2", "none", "/sys/fs/cgroup"])
        .status()
        .expect("run mount");
    assert!(status.success(), "cannot mount cgroup2");
}

/// A daemon with real VMs, a boot timeout for slow nested guests, and room for many sandboxes.
/// `config` is more TOML for its configuration file.
pub fn real_daemon(config: &str, extra: &[&str]) -> TestDaemon {
    ensure_cgroup2();
    let a = artifacts();
    let file = tempfile::NamedTempFile::new().expect("config file");
    let text = format!("boot_timeout_s = 300\nmax_sandboxes = 64\n{config}");
    std::fs::write(file.path(), text).expect("write config");
    let (_, path): (_, PathBuf) = file.keep().expect("keep config");
    let mut args = vec!["--config", path.to_str().expect("UTF-8 temp path")];
    args.extend_from_slice(extra);
    TestDaemon::start_real(&a.vmm, &a.vmlinux, &a.agent_initrd, &args)
}

/// A 1-vCPU sandbox with `memory_mib` of guest RAM.
pub fn small(memory_mib: u32) -> CreateSandbox {
    CreateSandbox {
        memory_mib,
        ..CreateSandbox::default()
    }
}

/// The last 40 lines of every VM's `vmm.log` (VMM messages and serial console) under `vms`, for
/// failure messages.
pub fn vm_logs(vms: &Path) -> String {
    let mut out = String::new();
    let mut stack = vec![vms.to_owned()];
    while let Some(dir) = stack.pop() {
        for path in super::list(&dir) {
            if path.is_dir() {
                stack.push(path);
            } else if path.file_name().is_some_and(|n| n == "vmm.log") {
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                let lines: Vec<&str> = text.lines().collect();
                let tail = lines[lines.len().saturating_sub(40)..].join("\n");
                out.push_str(&format!("--- {}\n{tail}\n", path.display()));
            }
        }
    }
    out
}
