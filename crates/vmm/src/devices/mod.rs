//! Emulated devices and the buses that route vCPU exits to them.

pub mod bus;
pub mod legacy;
pub mod virtio;
