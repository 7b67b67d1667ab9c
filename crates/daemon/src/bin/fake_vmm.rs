//! `bulkhead-fake-vmm`: a stand-in for `bulkhead-vmm` for host-level tests of the daemon on
//! machines whose KVM cannot boot a guest.
//!
//! `bulkhead-fake-vmm --config vm.json` reads the same VM configuration as `bulkhead-vmm`, prints
//! a line as the guest's serial console would, binds the VM's vsock Unix socket, announces the
//! agent's readiness on `<socket>_1025`, and serves Firecracker's hybrid handshake
//! (`CONNECT 1024\n` → `OK <port>\n`) by handing each connection to the guest agent's own server,
//! run in this process. Commands therefore run on the host, as the agent's test mode runs them.
//! SIGTERM ends it, as it ends `bulkhead-vmm`. With `--exit-file FILE` it empties FILE at start
//! and, when a `Shutdown` request ends the "guest", writes the exit report of a guest reset there,
//! as `bulkhead-vmm` would (`--timings-json` and the jail's flags are accepted and ignored).
//!
//! A clone workspace (a read-only share tagged `workspace`) has no overlay here: the agent
//! reports the changes of `workspace-upper/` next to the VM configuration (which tests fill as
//! an overlay's upper directory) against the shared directory.

use std::io::{self, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::OnceLock;
use std::thread;

use bulkhead_agent::conn::Conn;
use bulkhead_agent::server::{self, ReadyTarget, ShutdownAction};
use bulkhead_agent::{clock, reaper, workspace};
use bulkhead_protocol::{Ready, AGENT_PORT, PROTOCOL_VERSION, READY_PORT};
use bulkhead_vmm::config::VmConfig;
use bulkhead_vmm::exit_report::{ExitFile, ExitReport};
use bulkhead_vmm::ExitReason;

/// Longest handshake line accepted, bytes.
const MAX_LINE: usize = 64;

fn main() -> ExitCode {
    let started = clock::now();
    match run(started) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("bulkhead-fake-vmm: error: {message}");
            ExitCode::from(1)
        }
    }
}

/// The exit file (`--exit-file`), written when the guest "resets".
static EXIT_FILE: OnceLock<std::sync::Mutex<Option<ExitFile>>> = OnceLock::new();

/// Ends the process as a guest reset ends `bulkhead-vmm`: the report first, then exit 0.
fn guest_reset() -> ! {
    let file = EXIT_FILE.get().and_then(|f| f.lock().ok()?.take());
    if let Some(file) = file {
        let _ = file.write(&ExitReport::of_run(&ExitReason::Reset, None));
    }
    std::process::exit(0)
}

fn run(started: bulkhead_protocol::BootTimestamps) -> Result<(), String> {
    let Args { config, exit_file } = parse_args()?;
    if let Some(path) = exit_file {
        let file = ExitFile::create(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let _ = EXIT_FILE.set(std::sync::Mutex::new(Some(file)));
    }
    let vm = VmConfig::from_file(&config).map_err(|e| e.to_string())?;
    // Its "guest" is this host: a network would install the proxy's CA into the host's trust.
    if vm
        .cmdline
        .as_deref()
        .unwrap_or_default()
        .contains("bulkhead.egress=")
    {
        return Err("the fake VMM has no network (its commands run on the host)".into());
    }
    let vsock = vm.vsock.ok_or("the VM has no vsock device")?;
    if let Some(share) = vm.shares.iter().find(|s| s.tag == "workspace") {
        let upper = config.with_file_name("workspace-upper");
        std::fs::create_dir_all(&upper).map_err(|e| format!("{}: {e}", upper.display()))?;
        workspace::use_layers(upper, share.path.clone());
    }
    // Commands the agent runs are our children; reap them (and their orphans) as PID 1 would.
    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER, 1) takes no pointers.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    reaper::start(false).map_err(|e| e.to_string())?;
    println!(
        "fake-vmm: booting {} vCPU(s), {} MiB (pid {})",
        vm.vcpus,
        vm.memory_mib,
        std::process::id()
    );
    let _ = io::stdout().flush();
    let listener = UnixListener::bind(&vsock.uds_path)
        .map_err(|e| format!("bind {}: {e}", vsock.uds_path.display()))?;
    let ready_path = PathBuf::from(format!("{}_{READY_PORT}", vsock.uds_path.display()));
    let ready = Ready {
        version: PROTOCOL_VERSION,
        agent_version: env!("CARGO_PKG_VERSION").to_owned(),
        init_started: started,
        listening: clock::now(),
    };
    if !server::announce_ready(&ReadyTarget::Unix(ready_path), &ready) {
        return Err("cannot announce readiness".into());
    }
    println!("fake-vmm: agent ready");
    let _ = io::stdout().flush();
    for stream in listener.incoming() {
        match stream {
            Ok(stream) => {
                thread::spawn(move || serve(stream));
            }
            Err(e) => eprintln!("bulkhead-fake-vmm: accept: {e}"),
        }
    }
    Ok(())
}

/// The arguments used.
struct Args {
    config: PathBuf,
    exit_file: Option<PathBuf>,
}

fn parse_args() -> Result<Args, String> {
    const USAGE: &str =
        "usage: bulkhead-fake-vmm --config vm.json [--exit-file FILE] [--timings-json FILE] \
         [--jail-uid U --jail-gid G --jail-root DIR]";
    let mut args = std::env::args_os().skip(1);
    let (mut config, mut exit_file) = (None, None);
    while let Some(flag) = args.next() {
        let value = args.next().map(PathBuf::from).ok_or(USAGE)?;
        match flag.to_str() {
            Some("--config") => config = Some(value),
            Some("--exit-file") => exit_file = Some(value),
            // Accepted as bulkhead-vmm accepts them; the fake neither times nor jails itself.
            Some("--timings-json" | "--jail-uid" | "--jail-gid" | "--jail-root") => {}
            _ => return Err(USAGE.into()),
        }
    }
    Ok(Args {
        config: config.ok_or(USAGE)?,
        exit_file,
    })
}

/// Answers the hybrid handshake and hands the stream to the agent's request handler.
fn serve(mut stream: UnixStream) {
    let port = match read_connect(&mut stream) {
        Ok(port) => port,
        Err(e) => return eprintln!("bulkhead-fake-vmm: handshake: {e}"),
    };
    if port != AGENT_PORT {
        return; // nothing listens there: close, as the real VMM does
    }
    if stream.write_all(b"OK 1073741824\n").is_err() {
        return;
    }
    server::handle_connection(
        Conn::new(OwnedFd::from(stream)),
        ShutdownAction::Call(guest_reset),
    );
}

/// Reads `CONNECT <port>\n` one byte at a time (so no byte of the request is consumed).
fn read_connect(stream: &mut UnixStream) -> io::Result<u32> {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while line.len() < MAX_LINE {
        if stream.read(&mut byte)? == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        if byte[0] == b'\n' {
            let text = String::from_utf8_lossy(&line);
            return text
                .strip_prefix("CONNECT ")
                .and_then(|p| p.trim().parse().ok())
                .ok_or_else(|| io::Error::other(format!("bad handshake {text:?}")));
        }
        line.push(byte[0]);
    }
    Err(io::Error::other("handshake line too long"))
}
