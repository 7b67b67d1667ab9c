//! `bulkhead-agent` binary.
//!
//! - As PID 1 (no arguments needed; arguments the kernel passes are ignored): prepare the
//!   guest, switch into the image root when `bulkhead.root=` asks for one, set up the clone
//!   workspace `bulkhead.workspace=` asks for, mount the shared directories `bulkhead.mount=`
//!   names, listen on vsock port 1024, announce readiness to the
//!   host, serve forever.
//! - `bulkhead-agent --listen-unix PATH [--ready-unix PATH] [--workspace-upper DIR
//!   --workspace-lower DIR] [--egress-listen ADDR --egress-unix PATH]`: serve the same protocol
//!   on a Unix socket, without PID-1 duties (test mode); the workspace flags name directories
//!   laid out like an overlay's upper and lower layers, whose change set `WorkspaceChanges` then
//!   reports; the egress flags run the egress relay from a TCP address to a Unix socket. A
//!   `Restored` request is checked and acknowledged there, but changes nothing on the host.

mod early;

use std::ffi::OsString;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::process::ExitCode;

use bulkhead_agent::server::{self, Listener, ReadyTarget, ShutdownAction};
use bulkhead_agent::{
    clock, egress, init, log, mounts, oom, reaper, restore, rootfs, vsock, workspace,
};
use bulkhead_protocol::boot::BootParams;
use bulkhead_protocol::{BootTimestamps, Ready, AGENT_PORT, PROTOCOL_VERSION};

const USAGE: &str =
    "usage: bulkhead-agent                 (as PID 1 inside a bulkhead VM)\n       \
                     bulkhead-agent --listen-unix PATH [--ready-unix PATH]\n        \
                     [--workspace-upper DIR --workspace-lower DIR]\n        \
                     [--egress-listen ADDR --egress-unix PATH]   (test mode)\n";

/// What the command line asks for (when not PID 1).
#[derive(Debug, PartialEq, Eq)]
enum Args {
    Help,
    Version,
    Test(TestMode),
}

/// What test mode serves.
#[derive(Debug, PartialEq, Eq)]
struct TestMode {
    listen: PathBuf,
    ready: Option<PathBuf>,
    /// Upper and lower directories of a stand-in workspace.
    layers: Option<(PathBuf, PathBuf)>,
    /// The egress relay's listening address and the Unix socket it relays to.
    egress: Option<(std::net::SocketAddr, PathBuf)>,
}

fn parse_args(args: impl IntoIterator<Item = OsString>) -> Result<Args, String> {
    let mut listen = None;
    let mut ready = None;
    let (mut upper, mut lower) = (None, None);
    let (mut egress_listen, mut egress_unix) = (None, None);
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let mut value = |name: &str| {
            args.next()
                .map(PathBuf::from)
                .ok_or(format!("{name} needs a PATH"))
        };
        match arg.to_str() {
            Some("--help" | "-h") => return Ok(Args::Help),
            Some("--version" | "-V") => return Ok(Args::Version),
            Some("--listen-unix") => listen = Some(value("--listen-unix")?),
            Some("--ready-unix") => ready = Some(value("--ready-unix")?),
            Some("--workspace-upper") => upper = Some(value("--workspace-upper")?),
            Some("--workspace-lower") => lower = Some(value("--workspace-lower")?),
            Some("--egress-unix") => egress_unix = Some(value("--egress-unix")?),
            Some("--egress-listen") => {
                let addr = value("--egress-listen")?;
                let addr = addr.to_str().and_then(|a| a.parse().ok()).ok_or(format!(
                    "--egress-listen {} is not an address such as 127.0.0.1:3128",
                    addr.display()
                ))?;
                egress_listen = Some(addr);
            }
            _ => return Err(format!("unknown argument {arg:?}")),
        }
    }
    let listen = listen.ok_or("not PID 1: test mode needs --listen-unix PATH")?;
    let layers = match (upper, lower) {
        (Some(upper), Some(lower)) => Some((upper, lower)),
        (None, None) => None,
        _ => return Err("--workspace-upper and --workspace-lower go together".into()),
    };
    let egress = match (egress_listen, egress_unix) {
        (Some(addr), Some(path)) => Some((addr, path)),
        (None, None) => None,
        _ => return Err("--egress-listen and --egress-unix go together".into()),
    };
    Ok(Args::Test(TestMode {
        listen,
        ready,
        layers,
        egress,
    }))
}

fn ready_message(init_started: BootTimestamps) -> Ready {
    Ready {
        version: PROTOCOL_VERSION,
        agent_version: env!("CARGO_PKG_VERSION").to_owned(),
        init_started,
        listening: clock::now(),
    }
}

/// Logs `what: error` to the console and the debug port (the VMM's log) and reboots: the
/// sandbox must not start without what the host asked for.
fn fatal(what: &str, error: &dyn std::fmt::Display) -> ! {
    log!("{what}: {error}; rebooting");
    init::debug_port_write(format!("bulkhead-agent: {what}: {error}\n").as_bytes());
    init::reboot();
}

fn run_pid1(started: BootTimestamps) -> ! {
    init::setup();
    // This is the guest: a `Restored` request may change its entropy pool, clock and hostname.
    restore::apply_to_kernel();
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    let params = BootParams::parse(&cmdline).unwrap_or_else(|e| fatal("boot parameters", &e));
    init::hostname(params.hostname.as_deref());
    if let Some(root) = &params.root {
        // No root, no sandbox: end the VM before announcing readiness (see `rootfs`).
        rootfs::enter(root).unwrap_or_else(|e| fatal("root filesystem", &e));
    }
    if let Some(clone) = workspace::CloneSpec::of(&params) {
        // The clone workspace is the sandbox's view of the project: no command runs without it.
        workspace::mount(&clone).unwrap_or_else(|e| fatal("workspace", &e));
    }
    // A command must never run without the directory it was promised (see `mounts`).
    mounts::mount_all(&params.mounts).unwrap_or_else(|e| fatal("shared directory", &e));
    // Before any command runs: its OOM kill, if any, is told from the kernel log's later records.
    if let Err(e) = oom::watch() {
        log!("{e}; OOM kills are not reported");
    }
    if let Err(e) = reaper::start(true) {
        log!("{e}; rebooting");
        init::reboot();
    }
    // The loopback interface is up in every guest: its servers can bind 127.0.0.1, which is
    // where ingress (`Connect`) reaches them. No route leads anywhere else.
    let loopback = egress::loopback_up();
    if let Err(e) = &loopback {
        log!("bringing lo up: {e}");
    }
    if params.egress {
        // After the reaper: the relay's threads inherit the blocked SIGCHLD, so they never take
        // the signal the reaper waits for. No command runs without the promised network.
        loopback.unwrap_or_else(|e| fatal("egress: loopback", &e));
        egress::start_guest_relay()
            .unwrap_or_else(|e| fatal("egress: listen on 127.0.0.1:3128", &e));
    }
    let listener = match vsock::listen(AGENT_PORT) {
        Ok(fd) => Listener::Vsock(fd),
        Err(e) => {
            log!("vsock listen on port {AGENT_PORT}: {e}; rebooting");
            init::reboot();
        }
    };
    let ready = ready_message(started);
    init::debug_port_write(b"bulkhead-agent: ready\n");
    server::announce_ready(&ReadyTarget::Vsock, &ready);
    server::serve(&listener, ShutdownAction::Reboot)
}

fn run_test_mode(started: BootTimestamps, mode: TestMode) -> ExitCode {
    let TestMode {
        listen,
        ready,
        layers,
        egress,
    } = mode;
    if let Some((upper, lower)) = layers {
        workspace::use_layers(upper, lower);
    }
    // Orphans of the commands we run come to us, as they would to PID 1.
    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER, 1) takes no pointers.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    if let Err(e) = reaper::start(false) {
        log!("{e}");
        return ExitCode::FAILURE;
    }
    // After the reaper, as in PID-1 mode (see `run_pid1`).
    if let Some((addr, path)) = egress {
        if let Err(e) = egress::start(addr, egress::Upstream::Unix(path)) {
            log!("egress: listen on {addr}: {e}");
            return ExitCode::FAILURE;
        }
    }
    let listener = match UnixListener::bind(&listen) {
        Ok(l) => Listener::Unix(l),
        Err(e) => {
            log!("listen on {}: {e}", listen.display());
            return ExitCode::FAILURE;
        }
    };
    if let Some(path) = ready {
        server::announce_ready(&ReadyTarget::Unix(path), &ready_message(started));
    }
    server::serve(&listener, ShutdownAction::Exit)
}

fn main() -> ExitCode {
    let started = clock::now();
    if std::process::id() == 1 {
        run_pid1(started);
    }
    match parse_args(std::env::args_os().skip(1)) {
        Ok(Args::Help) => {
            print!("{USAGE}");
            ExitCode::SUCCESS
        }
        Ok(Args::Version) => {
            println!("bulkhead-agent {}", env!("CARGO_PKG_VERSION"));
            ExitCode::SUCCESS
        }
        Ok(Args::Test(mode)) => run_test_mode(started, mode),
        Err(message) => {
            eprint!("bulkhead-agent: {message}\n{USAGE}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Result<Args, String> {
        parse_args(list.iter().map(OsString::from))
    }

    #[test]
    fn test_mode_needs_a_listen_path() {
        // Arrange / Act
        let full = args(&["--listen-unix", "/a", "--ready-unix", "/b"]);
        let missing = args(&[]);
        let dangling = args(&["--listen-unix"]);

        // Assert
        assert_eq!(
            full,
            Ok(Args::Test(TestMode {
                listen: "/a".into(),
                ready: Some("/b".into()),
                layers: None,
                egress: None,
            }))
        );
        assert!(missing.unwrap_err().contains("--listen-unix"));
        assert!(dangling.unwrap_err().contains("needs a PATH"));
    }

    #[test]
    fn the_egress_relay_needs_an_address_and_a_socket() {
        // Arrange / Act
        let both = args(&[
            "--listen-unix",
            "/a",
            "--egress-listen",
            "127.0.0.1:4000",
            "--egress-unix",
            "/p",
        ]);
        let alone = args(&["--listen-unix", "/a", "--egress-unix", "/p"]);
        let bad = args(&["--listen-unix", "/a", "--egress-listen", "localhost"]);

        // Assert
        let Ok(Args::Test(mode)) = both else {
            panic!("{both:?}");
        };
        assert_eq!(
            mode.egress,
            Some(("127.0.0.1:4000".parse().unwrap(), "/p".into()))
        );
        assert!(alone.unwrap_err().contains("go together"));
        assert!(bad.unwrap_err().contains("not an address"));
    }

    #[test]
    fn unknown_arguments_are_refused() {
        // Arrange / Act
        let result = args(&["--listen-unix", "/a", "--frobnicate"]);

        // Assert
        assert!(result.unwrap_err().contains("--frobnicate"));
    }
}
