//! One harness per fuzz target; each exposes `run(&[u8])`, which `fuzz_targets/<name>.rs` calls.

pub mod agent;
pub mod archive;
pub mod blk;
pub mod boot;
pub mod fs;
pub mod mmio;
pub mod snapshot;
pub mod vsock;

/// A harness: runs one input, panics on a finding.
pub type Harness = fn(&[u8]);

/// The targets by name, as `fuzz_targets/` and `fuzz/corpus/` name them, with their harness.
pub const ALL: [(&str, Harness); 8] = [
    ("virtio_blk", blk::run),
    ("vsock", vsock::run),
    ("virtio_mmio", mmio::run),
    ("virtio_fs", fs::run),
    ("agent_frames", agent::run),
    ("boot_params", boot::run),
    ("snapshot_state", snapshot::run),
    ("archive_unpack", archive::run),
];
