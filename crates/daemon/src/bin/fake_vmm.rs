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
//! Snapshots, as far as a host process can fake them: with `--api-sock PATH` it serves the VMM's
//! control socket (`bulkhead_vmm::control`), where `{"snapshot":{"dir":...}}` writes a `state`
//! file (this fake's own JSON: vCPUs and memory) and a sparse `memory` file of the guest's size
//! into the directory and, unless `"resume": true`, ends the process as a stopped VM ends
//! `bulkhead-vmm`. `--restore DIR --vsock-uds PATH` starts from such a directory instead of a
//! configuration: it serves the agent on PATH without a readiness announcement, as a restored
//! guest's agent does. The "guest" is this host either way, so its files (and any processes
//! left running) are the host's, not saved ones; a real snapshot test needs `bulkhead-vmm`.
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
use bulkhead_vmm::control::{Answer, Request};
use bulkhead_vmm::exit_report::{ExitFile, ExitReport};
use bulkhead_vmm::ExitReason;
use serde::{Deserialize, Serialize};

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
    end_vm(&ExitReason::Reset)
}

/// Writes the exit report of `reason` (once) and exits 0.
fn end_vm(reason: &ExitReason) -> ! {
    let file = EXIT_FILE.get().and_then(|f| f.lock().ok()?.take());
    if let Some(file) = file {
        let _ = file.write(&ExitReport::of_run(reason, None));
    }
    std::process::exit(0)
}

/// The body of this fake's snapshot `state` files (in the real file format's header, so that
/// `bulkhead_vmm::snapshot::share_tags` reads the configuration as from a real one).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FakeState {
    /// Always true: marks the fake's format.
    fake_vmm: bool,
    vcpus: u8,
    memory_mib: u32,
    /// The configuration the fake "booted" with.
    config: VmConfig,
}

fn run(started: bulkhead_protocol::BootTimestamps) -> Result<(), String> {
    let args = parse_args()?;
    if let Some(path) = &args.exit_file {
        let file = ExitFile::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let _ = EXIT_FILE.set(std::sync::Mutex::new(Some(file)));
    }
    match (&args.config, &args.restore) {
        (Some(config), None) => boot(config, &args, started),
        (None, Some(dir)) => restore(dir, &args),
        _ => Err(USAGE.into()),
    }
}

/// `--restore DIR`: the "guest" of a snapshot, its agent on `--vsock-uds`, announcing nothing.
fn restore(dir: &std::path::Path, args: &Args) -> Result<(), String> {
    let path = dir.join("state");
    let state: FakeState = bulkhead_vmm::snapshot::format::read_file(&path)
        .map_err(|e| format!("{}: not a fake VMM snapshot: {e}", path.display()))?;
    let uds = args.vsock_uds.as_ref().ok_or(USAGE)?;
    start_guest()?;
    println!(
        "fake-vmm: restoring {} vCPU(s), {} MiB from {} (pid {})",
        state.vcpus,
        state.memory_mib,
        dir.display(),
        std::process::id()
    );
    let listener = UnixListener::bind(uds).map_err(|e| format!("bind {}: {e}", uds.display()))?;
    serve_control(args.api_sock.as_deref(), state)?;
    println!("fake-vmm: restored");
    accept(listener)
}

/// The process-wide part of a "guest": the agent's commands are our children; reap them (and
/// their orphans) as PID 1 would.
fn start_guest() -> Result<(), String> {
    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER, 1) takes no pointers.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    reaper::start(false).map_err(|e| e.to_string())
}

/// `--config vm.json`: a booted "guest".
fn boot(
    config: &std::path::Path,
    args: &Args,
    started: bulkhead_protocol::BootTimestamps,
) -> Result<(), String> {
    let vm = VmConfig::from_file(config).map_err(|e| e.to_string())?;
    // Its "guest" is this host: a network would install the proxy's CA into the host's trust.
    if vm
        .cmdline
        .as_deref()
        .unwrap_or_default()
        .contains("bulkhead.egress=")
    {
        return Err("the fake VMM has no network (its commands run on the host)".into());
    }
    let vsock = vm.vsock.clone().ok_or("the VM has no vsock device")?;
    if let Some(share) = vm.shares.iter().find(|s| s.tag == "workspace") {
        let upper = config.with_file_name("workspace-upper");
        std::fs::create_dir_all(&upper).map_err(|e| format!("{}: {e}", upper.display()))?;
        workspace::use_layers(upper, share.path.clone());
    }
    start_guest()?;
    println!(
        "fake-vmm: booting {} vCPU(s), {} MiB (pid {})",
        vm.vcpus,
        vm.memory_mib,
        std::process::id()
    );
    let _ = io::stdout().flush();
    let listener = UnixListener::bind(&vsock.uds_path)
        .map_err(|e| format!("bind {}: {e}", vsock.uds_path.display()))?;
    // The control socket before the readiness announcement, as the real VMM's: a client may
    // pause the sandbox as soon as it is ready.
    let sizes = FakeState {
        fake_vmm: true,
        vcpus: vm.vcpus,
        memory_mib: vm.memory_mib,
        config: vm.clone(),
    };
    serve_control(args.api_sock.as_deref(), sizes)?;
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
    accept(listener)
}

/// Hands every connection of the vsock socket to the agent.
fn accept(listener: UnixListener) -> Result<(), String> {
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

/// Serves the control socket at `path` (when given) on a thread of its own.
fn serve_control(path: Option<&std::path::Path>, state: FakeState) -> Result<(), String> {
    let Some(path) = path else {
        return Ok(());
    };
    let listener = UnixListener::bind(path).map_err(|e| format!("bind {}: {e}", path.display()))?;
    let path = path.to_owned();
    thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            control(stream, &path, state.clone());
        }
    });
    Ok(())
}

/// Answers one control request; a snapshot without `resume` ends the process afterwards.
fn control(stream: UnixStream, socket: &std::path::Path, state: FakeState) {
    let mut line = String::new();
    if io::BufRead::read_line(&mut io::BufReader::new(&stream), &mut line).is_err() {
        return;
    }
    let (result, stop) = match serde_json::from_str::<Request>(line.trim()) {
        Ok(Request::Pause | Request::Resume) => (Ok(()), false),
        Ok(Request::Snapshot(req)) => (write_snapshot(&req.dir, state), !req.resume),
        // The "guest" is the host: the directory is there already (its descriptor, read past
        // here, is dropped).
        Ok(Request::AttachShare(attach)) => {
            println!("fake-vmm: attached a directory to {}", attach.tag);
            let _ = io::stdout().flush();
            (Ok(()), false)
        }
        Err(e) => (Err(format!("bad request: {e}")), false),
    };
    let stop = stop && result.is_ok();
    let mut answer = serde_json::to_vec(&Answer::of(result)).unwrap_or_default();
    answer.push(b'\n');
    let _ = (&stream).write_all(&answer);
    drop(stream);
    if stop {
        let _ = std::fs::remove_file(socket);
        println!("fake-vmm: stopped after the snapshot");
        let _ = io::stdout().flush();
        end_vm(&ExitReason::Stopped);
    }
}

/// Writes this fake's `state` and a sparse `memory` file of the guest's size into `dir`.
fn write_snapshot(dir: &std::path::Path, state: FakeState) -> Result<(), String> {
    let failed = |e: io::Error| format!("{}: {e}", dir.display());
    std::fs::create_dir_all(dir).map_err(failed)?;
    bulkhead_vmm::snapshot::format::write_file(&dir.join("state"), &state)
        .map_err(|e| e.to_string())?;
    let memory = std::fs::File::create(dir.join("memory")).map_err(failed)?;
    memory
        .set_len(u64::from(state.memory_mib) << 20)
        .map_err(failed)
}

/// The arguments used.
struct Args {
    config: Option<PathBuf>,
    restore: Option<PathBuf>,
    vsock_uds: Option<PathBuf>,
    api_sock: Option<PathBuf>,
    exit_file: Option<PathBuf>,
}

const USAGE: &str = "usage: bulkhead-fake-vmm (--config vm.json | --restore DIR --vsock-uds PATH) \
     [--api-sock PATH] [--exit-file FILE] [--serial OUT] [--timings-json FILE] \
     [--jail-uid U --jail-gid G --jail-root DIR] [--share TAG=DIR]... [--disk PATH]...";

fn parse_args() -> Result<Args, String> {
    let mut args = std::env::args_os().skip(1);
    let mut parsed = Args {
        config: None,
        restore: None,
        vsock_uds: None,
        api_sock: None,
        exit_file: None,
    };
    while let Some(flag) = args.next() {
        let value = args.next().map(PathBuf::from).ok_or(USAGE)?;
        match flag.to_str() {
            Some("--config") => parsed.config = Some(value),
            Some("--restore") => parsed.restore = Some(value),
            Some("--vsock-uds") => parsed.vsock_uds = Some(value),
            Some("--api-sock") => parsed.api_sock = Some(value),
            Some("--exit-file") => parsed.exit_file = Some(value),
            // Accepted as bulkhead-vmm accepts them; the fake neither times nor jails itself,
            // its serial console is its stdout, and a restore's shares and disks are what the
            // host's agent sees anyway.
            Some(
                "--timings-json" | "--jail-uid" | "--jail-gid" | "--jail-root" | "--serial"
                | "--share" | "--disk",
            ) => {}
            _ => return Err(USAGE.into()),
        }
    }
    Ok(parsed)
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
    // Tests count these to tell a new connection from one opened ahead of need.
    println!("fake-vmm: agent connection");
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
