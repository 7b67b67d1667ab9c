//! `bulkhead run -p`: guest TCP ports published on the host ([`bulkhead_sandbox::ingress`]).
//! The host ports are bound before the boot, so a port in use fails the run before a VM exists.

use std::net::TcpListener;

use bulkhead_sandbox::ingress::{bind_all, PortMapping, Published, LOCALHOST};
use bulkhead_sandbox::Sandbox;

/// `-p [ADDR:]HOST_PORT:GUEST_PORT` or `-p PORT`; without an address the host side is
/// `127.0.0.1` (a sandbox's server is not put on the host's network unless asked).
pub(crate) fn parse(text: &str) -> Result<PortMapping, String> {
    PortMapping::parse(text, LOCALHOST).map_err(|e| e.to_string())
}

/// Binds every mapping's host side.
pub(crate) fn bind(mappings: &[PortMapping]) -> Result<Vec<(TcpListener, u16)>, String> {
    bind_all(mappings).map_err(|e| format!("-p: {e}"))
}

/// Starts carrying the bound ports' connections into `sandbox`; None without ports.
pub(crate) fn serve(
    sandbox: &Sandbox,
    listeners: Vec<(TcpListener, u16)>,
) -> Result<Option<Published>, String> {
    if listeners.is_empty() {
        return Ok(None);
    }
    Published::serve(&sandbox.client(), listeners)
        .map(Some)
        .map_err(|e| format!("-p: {e}"))
}
