//! The event loop's allowlist (the VMM's main thread once the VM runs).
//!
//! The event loop waits on epoll and runs the virtio back-ends: the vsock muxer (Unix sockets),
//! virtio-blk (positioned reads and writes on disk images) and virtio-fs (fuse-backend-rs's
//! passthrough file system, every operation relative to a descriptor under the share's root,
//! under the share owner's identity). When the VM ends, the same thread stops and joins the vCPU
//! threads, writes the timings report and tears everything down.

use super::rules::{common, Allowlist, Arg, UNCHANGED_ID};

/// `ioctl(FIONBIO)`: std's `set_nonblocking` on a socket.
const FIONBIO: u64 = 0x5421;

/// [`common`] plus the event loop's calls.
pub(super) fn allowlist() -> Allowlist {
    let mut list = common();
    event_dispatch(&mut list);
    descriptors(&mut list);
    file_io(&mut list);
    file_system(&mut list);
    identity(&mut list);
    unix_sockets(&mut list);
    teardown(&mut list);
    list
}

/// epoll, eventfds and timerfds.
fn event_dispatch(list: &mut Allowlist) {
    // Waiting and (un)registering descriptors as devices activate and vsock connections come
    // and go.
    list.allow(&[libc::SYS_epoll_pwait, libc::SYS_epoll_ctl]);
    #[cfg(target_arch = "x86_64")]
    list.allow(&[libc::SYS_epoll_wait]);
    // Queue notifications and activation events are eventfds (`read`); the vsock connection
    // timeout is a timerfd, re-armed after every event.
    list.allow(&[
        libc::SYS_read,
        libc::SYS_timerfd_settime,
        libc::SYS_timerfd_gettime,
    ]);
}

/// Generic descriptor handling.
fn descriptors(list: &mut Allowlist) {
    // Closing files, sockets and handles; `dup` and `fcntl` by the passthrough file system and
    // std (`try_clone`, `O_NONBLOCK` on vsock sockets and the timer, `O_APPEND` on open files).
    list.allow(&[libc::SYS_close, libc::SYS_dup]);
    list.allow_values(
        libc::SYS_fcntl,
        1,
        &[
            libc::F_GETFD as u64,
            libc::F_SETFD as u64,
            libc::F_GETFL as u64,
            libc::F_SETFL as u64,
            libc::F_DUPFD_CLOEXEC as u64,
        ],
    );
}

/// Reading and writing files: disk images (virtio-blk) and shared files (virtio-fs).
fn file_io(list: &mut Allowlist) {
    list.allow(&[
        libc::SYS_pread64,
        libc::SYS_pwrite64,
        libc::SYS_preadv,
        libc::SYS_pwritev,
        libc::SYS_readv,
        libc::SYS_writev,
        libc::SYS_lseek,
        libc::SYS_fsync,
        libc::SYS_fdatasync,
        libc::SYS_ftruncate,
        libc::SYS_fallocate,
    ]);
}

/// The passthrough file system's `*at` operations (virtio-fs), plus the timings report
/// (`openat`, `rename`, `unlink`).
fn file_system(list: &mut Allowlist) {
    list.allow(&[
        libc::SYS_openat,
        libc::SYS_newfstatat,
        libc::SYS_fstat,
        libc::SYS_statx,
        libc::SYS_statfs,
        libc::SYS_fstatfs,
        libc::SYS_getdents64,
        libc::SYS_readlinkat,
        libc::SYS_mkdirat,
        libc::SYS_mknodat,
        libc::SYS_symlinkat,
        libc::SYS_linkat,
        libc::SYS_unlinkat,
        libc::SYS_renameat2,
        libc::SYS_fchmod,
        libc::SYS_fchmodat,
        libc::SYS_fchownat,
        libc::SYS_utimensat,
        // The passthrough applies the guest's umask itself around creations.
        libc::SYS_umask,
    ]);
    // The timings report's `rename` of its temporary file, the removal of that file on error and
    // of the vsock socket at teardown (glibc's `rename`/`unlink`); a snapshot's directory
    // (`mkdir`) and the rename of its state file.
    #[cfg(target_arch = "x86_64")]
    list.allow(&[libc::SYS_rename, libc::SYS_unlink, libc::SYS_mkdir]);
    #[cfg(not(target_arch = "x86_64"))]
    list.allow(&[libc::SYS_renameat]);
}

/// Acting as a share's owner (`virtio::fs::identity`): per-thread credential switches by raw
/// system calls. `setresuid`/`setresgid` may change only the effective ID, never the real or
/// saved one.
fn identity(list: &mut Allowlist) {
    for nr in [libc::SYS_setresuid, libc::SYS_setresgid] {
        list.allow_if(nr, &[Arg::Eq(0, UNCHANGED_ID), Arg::Eq(2, UNCHANGED_ID)]);
    }
    list.allow(&[
        libc::SYS_setgroups,
        libc::SYS_getgroups,
        libc::SYS_capget,
        libc::SYS_capset,
        libc::SYS_geteuid,
        libc::SYS_getegid,
        libc::SYS_getuid,
        libc::SYS_getgid,
    ]);
}

/// The vsock device's hybrid Unix-socket back-end.
fn unix_sockets(list: &mut Allowlist) {
    // Host clients connecting to the VM's socket; guest connections to host ports, made with
    // a new Unix socket (no other family).
    list.allow(&[libc::SYS_accept4, libc::SYS_connect]);
    list.allow_values(libc::SYS_socket, 0, &[libc::AF_UNIX as u64]);
    // Data both ways on connected sockets, never to a new address (`MSG_NOSIGNAL` alone: std's
    // blocking write, the control socket's answer).
    for flags in [
        0,
        libc::MSG_DONTWAIT,
        libc::MSG_NOSIGNAL,
        libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
    ] {
        list.allow_if(libc::SYS_sendto, &[Arg::Eq(3, flags as u64), Arg::Null(4)]);
    }
    list.allow(&[libc::SYS_recvfrom]);
    // The control socket's request, with the directory of an `attach_share` (SCM_RIGHTS;
    // vmm-sys-util's `recv_with_fd` passes no flags).
    list.allow_values(libc::SYS_recvmsg, 2, &[0]);
    // Half-closing a connection's Unix socket when the guest or the host stops sending.
    list.allow_values(
        libc::SYS_shutdown,
        1,
        &[libc::SHUT_RD as u64, libc::SHUT_WR as u64],
    );
    // `peer_hung_up`: a zero-timeout poll for POLLRDHUP; std's `set_nonblocking` on accepted
    // sockets.
    list.allow(&[libc::SYS_ppoll]);
    #[cfg(target_arch = "x86_64")]
    list.allow(&[libc::SYS_poll]);
    list.allow_values(libc::SYS_ioctl, 1, &[FIONBIO]);
    // A snapshot reads the VM's interrupt controllers, PIT and clock (aarch64: the vGIC).
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    list.allow_values(libc::SYS_ioctl, 1, &super::vcpu::snapshot::VM_IOCTLS);
    // The control socket's read timeout (SO_RCVTIMEO).
    list.allow_values(libc::SYS_setsockopt, 2, &[libc::SO_RCVTIMEO as u64]);
}

/// Stopping the VM: kicking every vCPU thread out of `KVM_RUN` (`pthread_kill` with the kick
/// signal: `getpid` + `tgkill`) and joining them.
fn teardown(list: &mut Allowlist) {
    list.allow(&[libc::SYS_getpid, libc::SYS_gettid]);
    list.allow_values(
        libc::SYS_tgkill,
        2,
        &[crate::vstate::vcpu::kick_signal() as u64],
    );
}
