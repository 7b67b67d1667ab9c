//! AF_VSOCK stream sockets (`man 7 vsock`): the agent's listener on
//! [`bulkhead_protocol::AGENT_PORT`] and its boot-time connection to the host (CID 2).

use std::io;
use std::mem;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// CID of the host as seen from a guest (`VMADDR_CID_HOST`).
pub const HOST_CID: u32 = 2;

/// Connections waiting to be accepted.
const BACKLOG: libc::c_int = 128;

fn socket() -> io::Result<OwnedFd> {
    // SAFETY: socket(2) takes no pointers; the result is checked before use.
    let fd = unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn address(cid: u32, port: u32) -> libc::sockaddr_vm {
    // SAFETY: sockaddr_vm is plain old data; all-zero is a valid value (also for its padding).
    let mut addr: libc::sockaddr_vm = unsafe { mem::zeroed() };
    addr.svm_family = libc::AF_VSOCK as libc::sa_family_t;
    addr.svm_cid = cid;
    addr.svm_port = port;
    addr
}

const ADDR_LEN: libc::socklen_t = mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t;

/// A vsock stream socket listening on `port` for any CID (`VMADDR_CID_ANY`).
pub fn listen(port: u32) -> io::Result<OwnedFd> {
    let fd = socket()?;
    let addr = address(libc::VMADDR_CID_ANY, port);
    // SAFETY: `addr` is a valid sockaddr_vm of ADDR_LEN bytes, alive during the call.
    let rc = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&addr as *const libc::sockaddr_vm).cast(),
            ADDR_LEN,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: listen(2) takes no pointers.
    if unsafe { libc::listen(fd.as_raw_fd(), BACKLOG) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// Accepts one connection (close-on-exec), retrying on `EINTR`.
pub fn accept(listener: &OwnedFd) -> io::Result<OwnedFd> {
    loop {
        // SAFETY: null address pointers are allowed by accept4(2) when the peer address is
        // not wanted.
        let fd = unsafe {
            libc::accept4(
                listener.as_raw_fd(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                libc::SOCK_CLOEXEC,
            )
        };
        if fd >= 0 {
            // SAFETY: `fd` is a fresh descriptor that nothing else owns.
            return Ok(unsafe { OwnedFd::from_raw_fd(fd) });
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// Connects to `port` on `cid` (e.g. [`HOST_CID`]).
pub fn connect(cid: u32, port: u32) -> io::Result<OwnedFd> {
    let fd = socket()?;
    let addr = address(cid, port);
    // SAFETY: `addr` is a valid sockaddr_vm of ADDR_LEN bytes, alive during the call.
    let rc = unsafe {
        libc::connect(
            fd.as_raw_fd(),
            (&addr as *const libc::sockaddr_vm).cast(),
            ADDR_LEN,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}
