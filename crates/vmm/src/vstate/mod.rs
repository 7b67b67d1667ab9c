//! KVM state: the KVM context, the VM, guest memory and vCPUs.

pub mod kvm;
pub mod memory;
pub mod vcpu;
pub mod vm;

/// Stack size of the VMM's own threads (vCPUs, signal handling), bytes: 1 MiB.
///
/// Smaller than a huge page on purpose. A thread's stack is an anonymous mapping of this size
/// plus a guard page, and glibc writes the thread's descriptor at its top when the thread is
/// created. Rust's default (2 MiB) makes a mapping that can hold a whole 2 MiB-aligned range —
/// it does whenever it lands right below the 2 MiB-aligned guest RAM — and on hosts with
/// transparent huge pages `always` that first write then commits and zeroes a full 2 MiB huge
/// page: 2 MiB of VMM RSS overhead (in the nested test host 4.1 MiB of overhead with 2 MiB
/// stacks against 2.1 MiB with smaller ones; `benches/results/README.md`). A mapping smaller
/// than 2 MiB can never be backed by a huge page. The threads need far less than 1 MiB: they
/// handle vCPU exits and signals, not device queues.
pub const THREAD_STACK_BYTES: usize = 1 << 20;

// A stack mapping (the stack plus glibc's guard page) must stay below one huge page.
const _: () = assert!(THREAD_STACK_BYTES + (4 << 10) < memory::HUGE_PAGE_BYTES);
