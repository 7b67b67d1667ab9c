//! Guest-level integration tests: real guests booted under `bulkhead-vmm`, in the nested test
//! host when this machine's KVM cannot boot them (see the harness crate).

mod bad_input;
mod bench;
mod boot;
mod container;
mod cri;
mod egress;
mod fs;
mod fs_many;
mod images;
mod jail;
mod publish;
mod run;
mod run_export;
mod sandbox_api;
mod shim;
mod snapshot;
mod template;
mod terminal;
