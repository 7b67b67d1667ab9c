//! The OCI runtime spec (a bundle's `config.json`) in bulkhead's terms: the process becomes the
//! agent's container exec (`bulkhead_protocol::ContainerExec`), and the resources and the CRI
//! plugin's pod annotations size the pod's microVM.
//!
//! Sources: OCI runtime-spec 1.x `config.md` (process, user, rlimits) and `config-linux.md`
//! (`linux.resources`); containerd's CRI annotations (`io.kubernetes.cri.sandbox-memory`,
//! `...sandbox-cpu-quota`, `...sandbox-cpu-period`), which Kata sizes its VMs by as well.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use bulkhead_protocol::{ContainerExec, ExecRequest, Rlimit, WindowSize};
use oci_spec::runtime::{Process, Spec};

/// CRI annotation: the pod's memory limit, bytes.
pub const SANDBOX_MEMORY: &str = "io.kubernetes.cri.sandbox-memory";
/// CRI annotation: the pod's CPU quota, µs per period.
pub const SANDBOX_CPU_QUOTA: &str = "io.kubernetes.cri.sandbox-cpu-quota";
/// CRI annotation: the pod's CPU period, µs.
pub const SANDBOX_CPU_PERIOD: &str = "io.kubernetes.cri.sandbox-cpu-period";

/// Guest memory when neither the spec nor the pod sets a limit, MiB.
pub const DEFAULT_MEMORY_MIB: u32 = 512;
/// The smallest guest a limit can ask for, MiB: the guest kernel and agent need about 40.
pub const MIN_MEMORY_MIB: u32 = 64;
/// The largest guest a limit can ask for, MiB (1 TiB, `bulkhead-vmm`'s bound).
pub const MAX_MEMORY_MIB: u32 = 1 << 20;
/// The most vCPUs a CPU quota can ask for.
pub const MAX_VCPUS: u8 = 64;

/// What is wrong with a bundle's spec.
#[derive(Debug, thiserror::Error)]
pub enum OciError {
    /// `config.json` cannot be read or parsed.
    #[error("{path}: {reason}")]
    Load {
        /// The file.
        path: PathBuf,
        /// What failed.
        reason: String,
    },
    /// The spec has no `process`.
    #[error("the OCI spec has no process to run")]
    NoProcess,
    /// The process has no `args`.
    #[error("the OCI process has no args")]
    NoArgs,
    /// A resource limit whose type has no name.
    #[error("rlimit type {0:?} cannot be named")]
    Rlimit(String),
}

/// The pod microVM's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmSize {
    /// Guest memory, MiB.
    pub memory_mib: u32,
    /// vCPUs.
    pub vcpus: u8,
}

/// Reads `bundle/config.json`.
///
/// # Errors
/// [`OciError::Load`].
pub fn load(bundle: &Path) -> Result<Spec, OciError> {
    let path = bundle.join("config.json");
    Spec::load(&path).map_err(|e| OciError::Load {
        path,
        reason: e.to_string(),
    })
}

/// Where and how a process runs: the container's root in the guest, the first process to join
/// (for an exec), and whether the root is read-only (OCI `root.readonly`).
#[derive(Debug, Clone, Copy)]
pub struct Placement<'a> {
    /// The container's root file system, a guest directory.
    pub root: &'a str,
    /// The container's first process, for an exec into it.
    pub join_pid: Option<u32>,
    /// OCI `root.readonly`; else the container writes to a layer of its own.
    pub read_only_root: bool,
}

/// The agent request that runs `process` at `placement`, with a stdin stream when `stdin`.
///
/// # Errors
/// [`OciError::NoArgs`], [`OciError::Rlimit`].
pub fn exec_request(
    process: &Process,
    placement: Placement<'_>,
    stdin: bool,
) -> Result<ExecRequest, OciError> {
    let args = process.args().as_ref().filter(|a| !a.is_empty());
    let mut req = ExecRequest::new(args.ok_or(OciError::NoArgs)?.iter().map(String::as_str));
    req.env = process
        .env()
        .iter()
        .flatten()
        .map(|e| e.as_str().into())
        .collect();
    req.cwd = Some(process.cwd().as_os_str().into());
    let user = process.user();
    req.user = Some(format!("{}:{}", user.uid(), user.gid()));
    req.stdin = stdin;
    req.tty = process.terminal().unwrap_or(false);
    req.window = process.console_size().map(|b| WindowSize {
        rows: u16::try_from(b.height()).unwrap_or(u16::MAX),
        cols: u16::try_from(b.width()).unwrap_or(u16::MAX),
    });
    // containerd waits for the process, not for its output's end of file.
    req.kill_group_on_exit = true;
    let mut container = ContainerExec::new(placement.root);
    container.join_pid = placement.join_pid;
    container.read_only_root = placement.read_only_root;
    container.groups = user.additional_gids().clone().unwrap_or_default();
    container.rlimits = rlimits(process)?;
    container.no_new_privileges = process.no_new_privileges().unwrap_or(false);
    req.container = Some(container);
    Ok(req)
}

fn rlimits(process: &Process) -> Result<Vec<Rlimit>, OciError> {
    process
        .rlimits()
        .iter()
        .flatten()
        .map(|r| {
            let kind = serde_json::to_value(r.typ())
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .ok_or_else(|| OciError::Rlimit(format!("{:?}", r.typ())))?;
            Ok(Rlimit {
                kind,
                soft: r.soft(),
                hard: r.hard(),
            })
        })
        .collect()
}

/// The pod VM's size: memory from the pod's CRI annotation, else the container's
/// `linux.resources.memory.limit`, else [`DEFAULT_MEMORY_MIB`] (rounded up to MiB, within
/// [`MIN_MEMORY_MIB`]..=[`MAX_MEMORY_MIB`]); vCPUs from the pod's CPU quota and period, else
/// the container's, rounded up (1 without a quota, at most [`MAX_VCPUS`]).
pub fn vm_size(spec: &Spec) -> VmSize {
    let annotations = spec.annotations().clone().unwrap_or_default();
    let resources = spec.linux().as_ref().and_then(|l| l.resources().clone());
    let memory = annotation(&annotations, SANDBOX_MEMORY).or_else(|| {
        resources
            .as_ref()
            .and_then(|r| r.memory().as_ref()?.limit())
    });
    let quota = annotation(&annotations, SANDBOX_CPU_QUOTA)
        .or_else(|| resources.as_ref().and_then(|r| r.cpu().as_ref()?.quota()));
    let period = annotation(&annotations, SANDBOX_CPU_PERIOD).or_else(|| {
        let period = resources
            .as_ref()
            .and_then(|r| r.cpu().as_ref()?.period())?;
        i64::try_from(period).ok()
    });
    VmSize {
        memory_mib: memory_mib(memory),
        vcpus: vcpus(quota, period),
    }
}

/// A positive number in annotation `key`.
fn annotation(annotations: &HashMap<String, String>, key: &str) -> Option<i64> {
    annotations
        .get(key)
        .and_then(|v| v.trim().parse::<i64>().ok())
        .filter(|&v| v > 0)
}

fn memory_mib(limit_bytes: Option<i64>) -> u32 {
    let Some(bytes) = limit_bytes.filter(|&b| b > 0) else {
        return DEFAULT_MEMORY_MIB;
    };
    let mib = (bytes as u64).div_ceil(1 << 20);
    let sized = u32::try_from(mib)
        .unwrap_or(MAX_MEMORY_MIB)
        .clamp(MIN_MEMORY_MIB, MAX_MEMORY_MIB);
    if u64::from(sized) != mib {
        tracing::warn!(
            "a memory limit of {mib} MiB is outside a pod VM's {MIN_MEMORY_MIB}-{MAX_MEMORY_MIB} MiB: \
             its guest gets {sized} MiB"
        );
    }
    sized
}

fn vcpus(quota: Option<i64>, period: Option<i64>) -> u8 {
    match (quota.filter(|&q| q > 0), period.filter(|&p| p > 0)) {
        (Some(q), Some(p)) => {
            let n = (q as u64).div_ceil(p as u64);
            let sized = u8::try_from(n).unwrap_or(MAX_VCPUS).clamp(1, MAX_VCPUS);
            if u64::from(sized) != n {
                tracing::warn!(
                    "a CPU quota of {n} CPUs is more than a pod VM's {MAX_VCPUS} vCPUs: it gets \
                     {sized}"
                );
            }
            sized
        }
        _ => 1,
    }
}

#[cfg(test)]
#[path = "oci_tests.rs"]
mod tests;
