//! VMM memory overhead: how much of a `bulkhead-vmm` process's resident memory is not guest RAM.
//!
//! What is measured, per run, once the command's exit status has arrived (the guest has booted
//! and run the command; nothing is torn down yet):
//!
//! - `vmm_rss_kib`: `VmRSS` from `/proc/PID/status` — every resident page of the VMM process:
//!   its heap, stacks, binary and libraries (shared file pages included) and the guest pages
//!   it has touched;
//! - `guest_rss_kib`: the sum of `Rss` in `/proc/PID/smaps` over the mappings that overlap the
//!   guest RAM's host address ranges, which the VMM publishes in its timings report
//!   (`guest_memory`). The kernel may split a guest mapping (e.g. after `madvise`) or, rarely,
//!   merge it with an identical neighbour; a merged neighbour's pages then count as guest
//!   pages, so the overhead errs low rather than counting guest RAM as the VMM's;
//! - `overhead_kib`: the difference, the memory the VMM itself costs per sandbox.
//!
//! A VM restored from a template maps its guest RAM from the snapshot's memory file
//! (copy-on-write) and publishes no timings report: its guest mappings are the ones of that
//! file ([`sample_restored`]); their `Rss` counts the file's pages it reads, shared with every
//! other clone, and the pages it wrote.
//!
//! Memory the host kernel keeps for the VM (KVM's page tables, the vCPU structures) is not part
//! of any process's RSS and is not counted.

use std::path::Path;

use bulkhead_vmm::timings::{HostRange, TimingsReport};

use super::report::MemorySample;

/// Samples the memory of VMM process `pid`, whose timings report is in `runtime_dir`.
///
/// # Errors
/// A message when `/proc` or the report cannot be read.
pub fn sample(pid: u32, runtime_dir: &Path) -> Result<MemorySample, String> {
    let report = TimingsReport::read(&runtime_dir.join(bulkhead_sandbox::phases::REPORT_FILE))
        .map_err(|e| e.to_string())?;
    sample_with(pid, |smaps| guest_rss_kib(smaps, &report.guest_memory))
}

/// Samples the memory of VMM process `pid`, restored from a snapshot whose guest RAM it maps
/// from `memory_file` (an absolute path without symbolic links).
///
/// # Errors
/// A message when `/proc` cannot be read.
pub fn sample_restored(pid: u32, memory_file: &Path) -> Result<MemorySample, String> {
    sample_with(pid, |smaps| file_rss_kib(smaps, memory_file))
}

/// `VmRSS` of process `pid`, and its guest RSS as `guest` finds it in its smaps.
fn sample_with(pid: u32, guest: impl FnOnce(&str) -> u64) -> Result<MemorySample, String> {
    let read = |file: &str| {
        std::fs::read_to_string(format!("/proc/{pid}/{file}"))
            .map_err(|e| format!("cannot read /proc/{pid}/{file}: {e}"))
    };
    let vmm_rss_kib =
        vm_rss_kib(&read("status")?).ok_or_else(|| format!("no VmRSS in /proc/{pid}/status"))?;
    let guest_rss_kib = guest(&read("smaps")?);
    Ok(MemorySample {
        vmm_rss_kib,
        guest_rss_kib,
        overhead_kib: vmm_rss_kib.saturating_sub(guest_rss_kib),
    })
}

/// Sum of `Rss` of the `/proc/PID/smaps` mappings of `file` (also once it was deleted), KiB.
fn file_rss_kib(smaps: &str, file: &Path) -> u64 {
    let file = file.to_string_lossy();
    let deleted = format!("{file} (deleted)");
    let mut total = 0;
    let mut in_file = false;
    for line in smaps.lines() {
        if mapping_range(line).is_some() {
            in_file = mapping_path(line).is_some_and(|p| p == file || p == deleted);
        } else if let Some(rss) = line.strip_prefix("Rss:") {
            if in_file {
                total += kib_value(rss).unwrap_or(0);
            }
        }
    }
    total
}

/// The path of a mapping header line, `start-end perms offset dev inode   path` (`None` for an
/// anonymous mapping). The path is the rest of the line, spaces included.
fn mapping_path(line: &str) -> Option<&str> {
    let mut rest = line;
    for _ in 0..5 {
        let field_end = rest.trim_start().find(' ')?;
        let skipped = rest.len() - rest.trim_start().len();
        rest = &rest[skipped + field_end..];
    }
    let path = rest.trim_start();
    (!path.is_empty()).then_some(path)
}

/// `VmRSS` of a `/proc/PID/status` text, KiB.
fn vm_rss_kib(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(kib_value)
}

/// "  1234 kB" → 1234.
fn kib_value(text: &str) -> Option<u64> {
    text.trim().strip_suffix("kB")?.trim().parse().ok()
}

/// Sum of `Rss` of the `/proc/PID/smaps` mappings that overlap one of `guest`, KiB.
fn guest_rss_kib(smaps: &str, guest: &[HostRange]) -> u64 {
    let mut total = 0;
    let mut in_guest = false;
    for line in smaps.lines() {
        if let Some((start, end)) = mapping_range(line) {
            in_guest = guest.iter().any(|r| {
                let r_end = r.host_addr.saturating_add(r.len);
                start < r_end && end > r.host_addr
            });
        } else if let Some(rss) = line.strip_prefix("Rss:") {
            if in_guest {
                total += kib_value(rss).unwrap_or(0);
            }
        }
    }
    total
}

/// The address range of a mapping header line, `start-end perms offset dev inode [path]`.
fn mapping_range(line: &str) -> Option<(u64, u64)> {
    let range = line.split_whitespace().next()?;
    let (start, end) = range.split_once('-')?;
    Some((
        u64::from_str_radix(start, 16).ok()?,
        u64::from_str_radix(end, 16).ok()?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMAPS: &str = "\
55d0c0000000-55d0c0100000 r-xp 00000000 08:01 1234 /usr/bin/bulkhead-vmm
Size:               1024 kB
Rss:                 800 kB
7f0000000000-7f0004000000 rw-p 00000000 00:00 0
Size:              65536 kB
Rss:               20000 kB
7f0004000000-7f0008000000 rw-p 00000000 00:00 0
Size:              65536 kB
Rss:                5000 kB
7f0010000000-7f0010200000 rw-p 00000000 00:00 0
Size:               2048 kB
Rss:                 100 kB
";

    #[test]
    fn guest_pages_are_the_mappings_inside_the_guest_ranges() {
        // The guest's 128 MiB at 0x7f0000000000, split in two by the kernel.
        let guest = [HostRange {
            host_addr: 0x7f00_0000_0000,
            len: 128 << 20,
        }];

        assert_eq!(guest_rss_kib(SMAPS, &guest), 25_000);
    }

    #[test]
    fn a_restored_vms_guest_pages_are_the_mappings_of_its_memory_file() {
        // Arrange: two regions of the snapshot's memory file (one with a space in its path,
        // deleted while mapped), the VMM binary and an anonymous mapping.
        let smaps = "\
55d0c0000000-55d0c0100000 r-xp 00000000 08:01 1234                       /usr/bin/bulkhead-vmm
Rss:                 800 kB
7f0000000000-7f0004000000 rw-p 00000000 08:01 99                         /t/my tpl/memory
Rss:               20000 kB
7f0004000000-7f0008000000 rw-p 00000000 00:00 0
Rss:                5000 kB
7f0008000000-7f0008100000 rw-p 04000000 08:01 99                         /t/my tpl/memory (deleted)
Rss:                 300 kB
";

        // Act
        let guest = file_rss_kib(smaps, Path::new("/t/my tpl/memory"));
        let other = file_rss_kib(smaps, Path::new("/t/my"));

        // Assert
        assert_eq!(guest, 20_300);
        assert_eq!(other, 0);
    }

    #[test]
    fn no_guest_ranges_count_nothing() {
        assert_eq!(guest_rss_kib(SMAPS, &[]), 0);
    }

    #[test]
    fn vm_rss_is_read_from_the_status_text() {
        let status = "Name:\tbulkhead-vmm\nVmPeak:\t 1 kB\nVmRSS:\t   31337 kB\nThreads:\t3\n";

        assert_eq!(vm_rss_kib(status), Some(31_337));
        assert_eq!(vm_rss_kib("Name:\tx\n"), None);
    }

    #[test]
    fn the_own_process_can_be_read() {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();

        assert!(vm_rss_kib(&status).is_some_and(|kib| kib > 0));
    }
}
