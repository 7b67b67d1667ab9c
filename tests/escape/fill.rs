//! Disks and tmpfs filled from the guest: the guest gets `ENOSPC`, the host's files stay their
//! size and the VMM's memory stays bounded by the guest's RAM.

use std::os::unix::fs::MetadataExt;
use std::time::Duration;

use bulkhead_sandbox::storage::SCRATCH_FILE;
use bulkhead_sandbox::Sandbox;

use crate::fixture::{Fixture, DISK_BYTES, MEMORY_MIB, RW_DISK, SCRATCH_MIB};
use crate::guest::sh;
use crate::load::vmm_peak_rss;

/// Longest a fill may take (64 MiB through virtio-blk in the nested test host).
const TIMEOUT: Duration = Duration::from_secs(300);

/// What [`overfill_data_disk`] expects.
pub const EXPECT_DATA_DISK: &str =
    "writing 16 MiB to a 4 MiB disk: ENOSPC at its end; host file stays 4 MiB";
/// What [`fill_scratch_disk`] expects.
pub const EXPECT_SCRATCH: &str = "ENOSPC in the guest; scratch.ext4 never larger than its 64 MiB";
/// What [`fill_tmpfs`] expects.
pub const EXPECT_TMPFS: &str =
    "ENOSPC at the tmpfs size (half the guest RAM); VMM RSS <= guest RAM + allowance";

const MIB: u64 = 1 << 20;

/// The guest writes four times the read-write data disk's size to it.
pub fn overfill_data_disk(fx: &Fixture, a: &Sandbox) -> (bool, String) {
    let script =
        format!("dd if=/dev/zero of={RW_DISK} bs=1M count=16 oflag=direct 2>&1; echo \"exit $?\"");

    let run = sh(a, &script, TIMEOUT);

    let enospc = run.stdout.contains("No space left on device");
    let (size, _) = fx.size_and_mtime("disks/rw.img");
    let blocks = std::fs::metadata(fx.path("disks/rw.img")).map_or(0, |m| m.blocks() * 512);
    let observed = format!(
        "guest: {}; host file {size} bytes, {blocks} allocated",
        if enospc { "ENOSPC" } else { "no ENOSPC" }
    );
    let passed = enospc
        && !run.stdout.contains("exit 0")
        && size == DISK_BYTES as u64
        && blocks <= DISK_BYTES as u64;
    (passed, observed)
}

/// The guest fills its root file system, whose writable layer is the scratch disk, until the
/// disk is full; the host checks the scratch file while the guest's data is still on it.
pub fn fill_scratch_disk(a: &Sandbox) -> (bool, String) {
    let Some(scratch) = a.runtime_path().map(|d| d.join(SCRATCH_FILE)) else {
        return (false, "sandbox A has no runtime directory".to_owned());
    };
    let script = "dd if=/dev/zero of=/var/tmp/fill bs=1M 2>&1; echo \"exit $?\"; sync; \
                  echo \"filled $(stat -c %s /var/tmp/fill)\"";

    let run = sh(a, script, TIMEOUT);
    let meta = std::fs::metadata(&scratch);
    let cleanup = sh(a, "rm -f /var/tmp/fill; sync", TIMEOUT);

    let Ok(meta) = meta else {
        return (false, format!("no scratch file at {}", scratch.display()));
    };
    let enospc = run.stdout.contains("No space left on device");
    let filled = number_after(&run.stdout, "filled ");
    let limit = SCRATCH_MIB * MIB;
    let observed = format!(
        "guest: {} after {:.1} MiB; host scratch.ext4 {:.1} MiB long, {:.1} MiB allocated (limit {SCRATCH_MIB} MiB)",
        if enospc { "ENOSPC" } else { "no ENOSPC" },
        filled as f64 / MIB as f64,
        meta.size() as f64 / MIB as f64,
        (meta.blocks() * 512) as f64 / MIB as f64,
    );
    let passed = enospc
        && filled > 0
        && meta.size() == limit
        && meta.blocks() * 512 <= limit
        && cleanup.code == Some(0);
    (passed, observed)
}

/// The guest mounts a tmpfs (default size: half its RAM) and fills it.
pub fn fill_tmpfs(a: &Sandbox) -> (bool, String) {
    let script = "mkdir -p /tmp/t && mount -t tmpfs tmpfs /tmp/t && \
                  dd if=/dev/zero of=/tmp/t/fill bs=1M 2>&1; echo \"exit $?\"; \
                  echo \"filled $(stat -c %s /tmp/t/fill)\"; umount /tmp/t";

    let run = sh(a, script, TIMEOUT);

    let enospc = run.stdout.contains("No space left on device");
    let filled = number_after(&run.stdout, "filled ");
    let peak = a.vmm_pid().and_then(vmm_peak_rss);
    let (rss_ok, rss) = crate::load::judge_rss(peak);
    let observed = format!(
        "guest: {} after {} MiB of {MEMORY_MIB} MiB RAM; {rss}",
        if enospc { "ENOSPC" } else { "no ENOSPC" },
        filled / MIB,
    );
    (enospc && filled > 0 && rss_ok, observed)
}

/// The number following the first occurrence of `prefix` in `text` (0 when absent).
pub fn number_after(text: &str, prefix: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(prefix))
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}
