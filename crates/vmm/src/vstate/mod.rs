//! KVM state: the KVM context, the VM, guest memory and vCPUs.

pub mod kvm;
pub mod memory;
pub mod vcpu;
pub mod vm;
