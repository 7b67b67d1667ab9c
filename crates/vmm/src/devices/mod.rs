//! Emulated devices.
