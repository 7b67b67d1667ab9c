//! Standard descriptors for PID 1 before Rust's runtime starts.
//!
//! The kernel starts init with fds 0-2 on `/dev/console`, or with none of them open when there
//! is no console (e.g. the serial port is disabled with `8250.nr_uarts=0`, as bulkhead does
//! when nobody reads the console). Rust's runtime then re-opens them on `/dev/null` before
//! `main`, and aborts when it cannot, which as PID 1 panics the kernel: an initramfs has no
//! `/dev/null` until devtmpfs is mounted. This constructor, which the C runtime runs from
//! `.init_array` before Rust's set-up, mounts devtmpfs on `/dev` first in that case.
//! [`bulkhead_agent::init::setup`] mounts it again later and ignores the `EBUSY`.

/// Mounts devtmpfs on `/dev` when this is PID 1 and one of fds 0-2 is closed.
extern "C" fn mount_dev_for_closed_std_fds() {
    // SAFETY: getpid and fcntl(F_GETFD) only query this process; no memory is passed.
    let closed =
        unsafe { libc::getpid() == 1 && (0..3).any(|fd| libc::fcntl(fd, libc::F_GETFD) == -1) };
    if !closed {
        return;
    }
    // SAFETY: every pointer is a NUL-terminated literal; failures (e.g. `/dev` exists, or
    // devtmpfs is already mounted) leave nothing to clean up.
    unsafe {
        libc::mkdir(c"/dev".as_ptr(), 0o755);
        libc::mount(
            c"devtmpfs".as_ptr(),
            c"/dev".as_ptr(),
            c"devtmpfs".as_ptr(),
            libc::MS_NOSUID,
            c"mode=0755".as_ptr().cast(),
        );
    }
}

#[used]
#[link_section = ".init_array"]
static MOUNT_DEV_FOR_CLOSED_STD_FDS: extern "C" fn() = mount_dev_for_closed_std_fds;
