//! The flags that say which VM a sandbox boots (`--vcpus`, `--memory`, `--kernel`, `--initrd`,
//! `--boot-timeout`), shared by `bulkhead run` and `bulkhead template create`, and the spec and
//! host settings they make: `template create` boots exactly the sandbox that `bulkhead run`
//! boots with the same flags.

use std::path::PathBuf;
use std::time::Duration;

use bulkhead_sandbox::spec::{DEFAULT_MEMORY_MIB, DEFAULT_VCPUS};
use bulkhead_sandbox::{FileRef, HostSettings, SandboxSpec};

use crate::run::{parse_memory, parse_positive_seconds, parse_vcpus};

/// The VM a sandbox boots.
#[derive(Debug, Clone, clap::Args)]
pub struct MachineArgs {
    /// Number of vCPUs (1 to the VMM's limit) [default: 1] (`run --template`: the template's).
    #[arg(long, value_parser = parse_vcpus)]
    pub vcpus: Option<u8>,
    /// Guest memory, MiB (within the VMM's limits) [default: 256] (`run --template`: the
    /// template's).
    #[arg(long, value_name = "MIB", value_parser = parse_memory)]
    pub memory: Option<u32>,
    /// Guest kernel [default: $BULKHEAD_KERNEL or <data dir>/kernel/<arch>/vmlinux, Image on
    /// aarch64].
    #[arg(long, value_name = "PATH")]
    pub kernel: Option<PathBuf>,
    /// Initramfs with the bulkhead agent as /init [default: $BULKHEAD_INITRD or
    /// <data dir>/images/default/initramfs.cpio.lz4].
    #[arg(long, value_name = "PATH")]
    pub initrd: Option<PathBuf>,
    /// Seconds to wait for the guest agent to come up.
    #[arg(long, value_name = "SECS", default_value = "60", value_parser = parse_positive_seconds)]
    pub boot_timeout: Duration,
}

impl MachineArgs {
    /// `--vcpus`, else the default (1).
    pub fn vcpus_or_default(&self) -> u8 {
        self.vcpus.unwrap_or(DEFAULT_VCPUS)
    }

    /// `--memory`, else the default (256 MiB).
    pub fn memory_or_default(&self) -> u32 {
        self.memory.unwrap_or(DEFAULT_MEMORY_MIB)
    }

    /// The spec of a sandbox with only these flags: vCPUs, memory and kernel; every other
    /// field the default (`bulkhead run` fills in its other flags).
    pub fn spec(&self) -> SandboxSpec {
        SandboxSpec {
            vcpus: self.vcpus_or_default(),
            memory_mib: self.memory_or_default(),
            kernel: self.kernel.clone().map(FileRef::Path),
            ..SandboxSpec::default()
        }
    }

    /// This machine's defaults ([`HostSettings::local`]) with `--initrd` and the boot timeout.
    pub fn host(&self) -> HostSettings {
        let mut host = HostSettings::local();
        host.ready_timeout = self.boot_timeout;
        if let Some(initrd) = &self.initrd {
            host.initrd = initrd.clone();
        }
        host
    }

    /// The directories of the files these flags name (`--kernel`, `--initrd`), as absolute
    /// paths: the nested test host must share them.
    pub fn file_dirs(&self) -> Vec<PathBuf> {
        let files = self.kernel.iter().chain(&self.initrd);
        let mut dirs: Vec<PathBuf> = Vec::new();
        for file in files {
            let Ok(abs) = std::path::absolute(file) else {
                continue;
            };
            if let Some(dir) = abs.parent().filter(|d| !dirs.iter().any(|x| x == d)) {
                dirs.push(dir.to_owned());
            }
        }
        dirs
    }
}
