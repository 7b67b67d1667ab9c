//! Kernel and initramfs loading, kernel command line.
