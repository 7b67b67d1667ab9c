//! Ingress: the host reaches a TCP server in the guest. A `Connect` request
//! ([`ConnectRequest`]) names a port on the guest's `127.0.0.1`; the agent connects to it,
//! answers `Ack`, and from then on the host connection (vsock, or Unix in test mode) carries the
//! TCP connection's bytes both ways ([`egress::pump`]), with no framing.
//!
//! Only the host can open such a connection (a guest program cannot connect to its own agent's
//! vsock port through the host), and the agent never connects anywhere but the guest's own
//! loopback interface, which it brings up first (a guest without `bulkhead.egress=on` starts with
//! it down).

use std::fs::File;
use std::io;
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use bulkhead_protocol::{write_frame, Ack, ConnectRequest, ErrorCode, Frame};

use crate::conn::Conn;
use crate::{egress, log};

/// How long a connect to the guest's loopback may take before it is reported as failed.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves one `Connect` request on `conn` (see the module documentation). Errors go to the host
/// as an `Error` frame: `InvalidRequest` for port 0, `NotFound` when nothing listens on the port,
/// `Other` for anything else.
pub fn serve(mut conn: Conn, req: ConnectRequest) {
    if req.port == 0 {
        let _ = write_frame(
            &mut conn,
            &Frame::error(ErrorCode::InvalidRequest, "connect: port 0"),
        );
        return;
    }
    if let Err(e) = egress::loopback_up() {
        log!("ingress: bringing lo up: {e}");
    }
    let address = SocketAddr::from(([127, 0, 0, 1], req.port));
    let tcp = match TcpStream::connect_timeout(&address, CONNECT_TIMEOUT) {
        Ok(tcp) => tcp,
        Err(e) => {
            let code = match e.kind() {
                io::ErrorKind::ConnectionRefused => ErrorCode::NotFound,
                _ => ErrorCode::Other,
            };
            let message = format!("connect to {address} in the guest: {e}");
            let _ = write_frame(&mut conn, &Frame::error(code, message));
            return;
        }
    };
    if write_frame(&mut conn, &Frame::Ack(Ack { bytes: 0 })).is_err() {
        return;
    }
    if let Err(e) = egress::pump(tcp, File::from(conn.into_fd())) {
        log!("ingress: {address}: {e}");
    }
}
