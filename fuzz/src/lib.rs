//! Fuzz harnesses for bulkhead's guest-facing parsers (cargo-fuzz / libFuzzer).
//!
//! Everything a guest controls reaches the host through five doors, one target each, and one
//! target covers the guest agent's first parser (the host-written boot parameters):
//!
//! | target | door | harness |
//! |---|---|---|
//! | `virtio_blk` | virtio-blk request chains, executed on a temporary disk image | [`targets::blk`] |
//! | `vsock` | vsock packets from the TX queue into the muxer and connections, with a real host side | [`targets::vsock`] |
//! | `virtio_mmio` | register reads and writes on the virtio-mmio transport, with a device behind it | [`targets::mmio`] |
//! | `virtio_fs` | FUSE requests on the virtio-fs request queues, served from a temporary share | [`targets::fs`] |
//! | `agent_frames` | what the host reads from the guest agent: framing, message decoding, the client's sequences | [`targets::agent`] |
//! | `boot_params` | the kernel command line the agent parses at boot: the codec's round trip | [`targets::boot`] |
//!
//! Each harness drives the real device code the way the VMM does: the device is activated with
//! queues the guest side laid out with virtio-queue's mock driver ([`queue::Driver`]), and a real
//! `EventManager` runs its event handler until no fd is ready ([`settle`]). Every input is a
//! sequence of operations in a small byte format described in each harness's docs; a panic,
//! an event loop that never goes idle, or a broken invariant the harness checks is a finding.
//!
//! The harnesses live in this library (not in `fuzz_targets/`) so the seed generator
//! (`examples/gen_seeds.rs`, module [`seeds`]) and the corpus replay test (`cargo test`) use the
//! same code as the fuzzer.
#![deny(missing_docs)]

pub mod input;
pub mod queue;
pub mod seeds;
pub mod targets;

use event_manager::{EventManager, MutEventSubscriber};

/// Most rounds of [`settle`] before it declares the event loop busy.
pub const SETTLE_LIMIT: usize = 10_000;

/// Runs the event loop with zero-timeout polls until no fd is ready.
///
/// # Panics
/// When the loop still has ready fds after [`SETTLE_LIMIT`] rounds: a device keeps an fd ready
/// without making progress, which in the VMM is an event thread spinning at 100 % CPU.
pub fn settle<S: MutEventSubscriber>(em: &mut EventManager<S>) {
    for _ in 0..SETTLE_LIMIT {
        if em.run_with_timeout(0).expect("epoll_wait") == 0 {
            return;
        }
    }
    panic!("the event loop never went idle: some fd stays ready");
}

/// Makes writes to a closed socket fail with `EPIPE` instead of killing the process, as in every
/// Rust binary (the standard library's `main` does the same; libFuzzer's `main` does not).
pub fn ignore_sigpipe() {
    // SAFETY: setting the disposition of SIGPIPE to SIG_IGN installs no handler code and has no
    // memory-safety preconditions.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
}
