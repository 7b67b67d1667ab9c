//! The daemon with real VMs (`bulkhead-vmm`, the guest kernel, the agent image), in the nested
//! test host when this machine's KVM cannot boot guests (see the `bulkhead-tests` harness): one
//! test binary, so that one test-host boot serves them all. Tests share the test host two at a
//! time (`vm_test!`), except those that need all of it (`vm_test!(exclusive fn ...)`).

#[macro_use]
#[path = "../common/mod.rs"]
mod common;

mod cp;
mod snapshots;
mod vms;
