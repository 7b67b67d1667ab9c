//! `bulkhead-agent`: the guest's PID 1. It prepares the guest (pseudo-filesystems, hostname),
//! reaps orphans, and serves the host's requests (run a command, write or read a file, report
//! the workspace's changes, shut down) over vsock, one request per connection. The wire format is in
//! `bulkhead-protocol` and `docs/agent-protocol.md`.
//!
//! With `bulkhead.root=/dev/vdX` on the kernel command line it first moves itself into an
//! overlay root built on that read-only image ([`rootfs`]). Then it mounts the host directories
//! that `bulkhead.mount=TAG:DIR[:ro]` parameters name, over virtio-fs ([`mounts`]), after the
//! clone workspace `bulkhead.workspace=TAG:DIR:clone` asks for ([`workspace`]): a read-only
//! share under a private overlay, whose change set it reports on request ([`changes`]). With
//! `bulkhead.egress=on` it relays `127.0.0.1:3128` to the host's egress proxy ([`egress`]).
//! A `tty` exec runs on a pseudo-terminal ([`pty`]); a container exec in a container's root and
//! namespaces ([`container`]); a command the guest's OOM killer killed is told from the kernel
//! log ([`oom`]).
//! After the VM is restored from a snapshot the host says so, and the agent makes the clone a
//! machine of its own: fresh entropy, the current time, maybe a new hostname ([`restore`]).
//!
//! The same server runs on the host in test mode (`--listen-unix PATH`), without the PID-1
//! duties, so everything but the vsock transport is testable without a VM.

#![deny(missing_docs)]

pub mod changes;
pub mod clock;
pub mod conn;
pub mod container;
pub mod egress;
pub mod exec;
pub mod files;
pub mod fsops;
pub mod ingress;
pub mod init;
pub mod log;
pub mod mountinfo;
pub mod mounts;
pub mod oom;
pub mod pty;
pub mod reaper;
pub mod restore;
pub mod rootfs;
pub mod server;
pub mod spawn;
pub mod user;
pub mod vsock;
pub mod workspace;
