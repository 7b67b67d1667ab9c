//! KVM state: the KVM context, the VM, guest memory and vCPUs.
