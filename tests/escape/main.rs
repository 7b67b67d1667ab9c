//! The escape suite (issue 7): root inside a guest tries to get out, and each attempt must fail
//! or stay inside the sandbox's limits while the host stays unchanged.
//!
//! One test, [`escape_suite`], runs every case in sequence on two sandboxes booted once (in the
//! nested test host when this machine's KVM cannot boot Linux, like every guest test):
//!
//! - **A**, the attacker: the Debian image with a 64 MiB scratch disk, a read-write and a
//!   read-only virtio-fs share, a read-only and a read-write data disk, and a clone workspace;
//! - **B**, the neighbour: the Debian image, the target of A's vsock attempts, then the victim of
//!   its own memory, pids and fork-bomb exhaustion (last, as they may wreck it).
//!
//! The cases are in [`files`] (reads outside the shares, writes to read-only shares and disks,
//! the clone workspace's implicitly executed paths), [`fill`] (disks and tmpfs), [`reach`]
//! (network, vsock, `/dev/kvm`) and [`load`] (memory, pids, fork bomb); the host inventory
//! before and after (trees by hash, processes, cgroup directories) is the last case. A panic in
//! one case fails that case only. At the end a table `case | expected | observed | result` goes
//! to stderr (also when the cases ran in the test host: the delegating run copies it from the
//! inner run's output), and the test fails when any case failed.

mod files;
mod fill;
mod fixture;
mod guest;
mod load;
mod reach;
mod report;

use std::panic::AssertUnwindSafe;

use bulkhead_tests::{artifacts, run_here_or_delegate};

use fixture::{Fixture, HostInventory, Sandboxes};
use report::Outcome;

/// This test's name as libtest knows it (for the re-run inside the test host).
const TEST_NAME: &str = "escape_suite";

#[test]
fn escape_suite() {
    // Prepared outside the test host before delegating: the Debian image (the test host has its
    // own mkfs.ext4 for the scratch disk).
    let a = artifacts();
    a.debian_image();
    let args = ["--exact", TEST_NAME, "--nocapture", "--test-threads=1"];

    let stdout = run_here_or_delegate(&args, || {
        let outcomes = run_suite();
        report::print(&outcomes);
        let failed: Vec<&str> = outcomes
            .iter()
            .filter(|o| !o.passed)
            .map(|o| o.case)
            .collect();
        assert!(failed.is_empty(), "escape cases failed: {failed:?}");
    });

    if let Some(stdout) = stdout {
        assert!(
            stdout.contains("1 passed"),
            "{TEST_NAME} did not run in the test host:\n{stdout}"
        );
        report::forward(&stdout);
    }
}

/// Boots the two sandboxes, runs every case, destroys them and checks the host.
fn run_suite() -> Vec<Outcome> {
    let before = HostInventory::take();
    let fx = Fixture::new();
    let boxes = Sandboxes::start(&fx);
    let during = HostInventory::take();
    let mut out = Vec::new();
    out.push(case("read outside shares", files::EXPECT_READ, || {
        files::read_outside_shares(&fx, &boxes.a)
    }));
    out.push(case(
        "write read-only share",
        files::EXPECT_RO_SHARE,
        || files::write_read_only_share(&fx, &boxes.a),
    ));
    out.push(case("write read-only disk", files::EXPECT_RO_DISK, || {
        files::write_read_only_disk(&fx, &boxes.a)
    }));
    out.push(case("clone workspace hooks", files::EXPECT_CLONE, || {
        files::clone_workspace_hooks(&fx, &boxes.a)
    }));
    out.push(case("overfill data disk", fill::EXPECT_DATA_DISK, || {
        fill::overfill_data_disk(&fx, &boxes.a)
    }));
    out.push(case("fill scratch disk", fill::EXPECT_SCRATCH, || {
        fill::fill_scratch_disk(&boxes.a)
    }));
    out.push(case("fill tmpfs", fill::EXPECT_TMPFS, || {
        fill::fill_tmpfs(&boxes.a)
    }));
    out.push(case("network", reach::EXPECT_NETWORK, || {
        reach::network(&boxes.a)
    }));
    out.push(case("vsock to sandbox B", reach::EXPECT_VSOCK, || {
        reach::vsock(&boxes.a, &boxes.b)
    }));
    out.push(case("open /dev/kvm", reach::EXPECT_KVM, || {
        reach::kvm(&boxes.a)
    }));
    out.push(case("exhaust pids", load::EXPECT_PIDS, || {
        load::pids(&boxes.b)
    }));
    out.push(case("exhaust memory", load::EXPECT_MEMORY, || {
        load::memory(&boxes.b)
    }));
    out.push(case("fork bomb", load::EXPECT_BOMB, || {
        load::fork_bomb(&boxes.b)
    }));
    let destroyed = boxes.destroy();
    out.push(case("host unchanged", fixture::EXPECT_HOST, || {
        fx.host_unchanged(&before, &during, &destroyed)
    }));
    out
}

/// Runs one case; a panic inside it is that case's failure, with the panic message observed.
fn case(
    name: &'static str,
    expected: &'static str,
    body: impl FnOnce() -> (bool, String),
) -> Outcome {
    eprintln!("escape case: {name}");
    let (passed, observed) = match std::panic::catch_unwind(AssertUnwindSafe(body)) {
        Ok(result) => result,
        Err(panic) => {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_else(|| "panicked".to_owned());
            (false, format!("panicked: {}", shorten(&message, 60, 160)))
        }
    };
    Outcome {
        case: name,
        expected,
        observed,
        passed,
    }
}

/// `text` with its middle left out when it is longer than `head` + `tail` characters (an exec's
/// panic message quotes the whole script before the reason).
fn shorten(text: &str, head: usize, tail: usize) -> String {
    let chars: Vec<char> = text.chars().collect();
    if chars.len() <= head + tail {
        return text.to_owned();
    }
    let start: String = chars[..head].iter().collect();
    let end: String = chars[chars.len() - tail..].iter().collect();
    format!("{start} ... {end}")
}
