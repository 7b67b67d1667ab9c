//! `bulkhead-vmm`: boots one microVM and exits when the guest does.
//!
//! Exit status: 0 when the guest reset (`reboot`, and a kernel panic with `panic=1`) or powered
//! off, or a signal stopped the VM; 1 when the VM could not be built or run (the reason is
//! printed); 2 for usage errors; 3 when KVM reported a guest crash (a triple fault, a crash
//! event) or a vCPU failed; 4 when a seccomp filter (`--seccomp on`) blocked a system call:
//! stderr then has `bulkhead-vmm: seccomp: blocked syscall N (<thread kind>)` with the call's
//! number. With `--exit-file FILE` the same is written to FILE as JSON
//! (`bulkhead_vmm::exit_report`), out of the guest's reach: programs read that, never the log,
//! which holds the guest's console.
//!
//! Environment: `BULKHEAD_LOG` (tracing filter, default `warn`); `BULKHEAD_BOOT_LOG=FILE`
//! appends one line per booted VM, and one per guest crash, to FILE (see `BootLog`);
//! `BULKHEAD_SECCOMP` (`on`, `off`,
//! `log`) stands for `--seccomp` when the flag is not given.
//!
//! With `--jail-uid U --jail-gid G --jail-root DIR` (as root) the VMM jails itself before it
//! builds the VM (see `bulkhead_vmm::jail`): the process the caller started becomes a small
//! supervisor that forwards SIGTERM/SIGINT/SIGHUP and exits as the jailed VMM did.
//!
//! Snapshots: `--api-sock PATH` serves the control socket (`bulkhead_vmm::control`: pause,
//! resume, snapshot to a directory); `--restore DIR` starts the VM saved in DIR instead of booting
//! a kernel, with this invocation's `--vsock-uds`, `--serial`, `--debugcon` and `--share`
//! directories (same tags as saved).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use bulkhead_vmm::builder::build_with_kvm;
use bulkhead_vmm::config::{
    DiskConfig, SerialOutput, ShareConfig, VmConfig, VsockConfig, DEFAULT_GUEST_CID,
    DEFAULT_MEMORY_MIB, DEFAULT_VCPUS,
};
use bulkhead_vmm::control::ControlSocket;
use bulkhead_vmm::exit_report::{ExitFile, ExitReport, EXIT_ERROR};
use bulkhead_vmm::jail::{self, JailConfig, MountPlan};
use bulkhead_vmm::seccomp::{SeccompMode, ThreadFilters, ThreadKind};
use bulkhead_vmm::snapshot::{self, RestoreConfig};
use bulkhead_vmm::timings::{guest_ranges, ProcessClock, TimingsReport};
use bulkhead_vmm::vstate::kvm::{host_kvm, KVM_PATH};
use bulkhead_vmm::{ExitReason, StopHandle};
use clap::Parser;

/// Boot a Linux guest under KVM.
#[derive(Debug, Parser)]
#[command(name = "bulkhead-vmm", version, about)]
struct Args {
    /// VM configuration as a JSON file (instead of the flags below).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["kernel", "initrd", "cmdline", "vcpus", "memory", "serial", "debugcon", "vsock_uds", "disks", "shares", "restore"])]
    config: Option<PathBuf>,
    /// Restore the VM snapshotted into DIR (its `state` and `memory` files) instead of booting.
    /// With `--disk`, the files of its disks instead of the saved paths (one per saved disk, in
    /// order, read-only where the saved one was: e.g. a copy of a writable disk saved with it).
    #[arg(long, value_name = "DIR", conflicts_with_all = ["kernel", "initrd", "cmdline"])]
    restore: Option<PathBuf>,
    /// Serve the control socket at PATH: pause, resume, snapshot (JSON lines; see
    /// `bulkhead_vmm::control`).
    #[arg(long, value_name = "PATH")]
    api_sock: Option<PathBuf>,
    /// Guest kernel: ELF vmlinux or bzImage.
    #[arg(long, value_name = "PATH", required_unless_present_any = ["config", "restore"])]
    kernel: Option<PathBuf>,
    /// Initramfs: a cpio archive, uncompressed or compressed in a format the guest kernel unpacks
    /// (the default guest kernel: LZ4, gzip).
    #[arg(long, value_name = "PATH")]
    initrd: Option<PathBuf>,
    /// Kernel command line (default: console=ttyS0 reboot=k panic=1 ...).
    #[arg(long, value_name = "STR")]
    cmdline: Option<String>,
    /// Number of vCPUs.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_VCPUS)]
    vcpus: u8,
    /// Guest memory in MiB.
    #[arg(long, value_name = "MIB", default_value_t = DEFAULT_MEMORY_MIB)]
    memory: u32,
    /// Serial console: stdout, off, or a file path.
    #[arg(long, value_name = "stdout|off|FILE", default_value = "stdout")]
    serial: SerialOutput,
    /// File receiving the guest's writes to the debug port (0xe9).
    #[arg(long, value_name = "FILE")]
    debugcon: Option<PathBuf>,
    /// Add a virtio-vsock device whose host side is this Unix socket (Firecracker's hybrid
    /// protocol: connect and send `CONNECT <port>\n`; guest connections to CID 2 port P reach
    /// `<PATH>_P`).
    #[arg(long, value_name = "PATH")]
    vsock_uds: Option<PathBuf>,
    /// A virtio-blk disk backed by a raw image, `PATH` or `PATH:ro` (repeatable; the first is
    /// /dev/vda). `PATH:backing=IMAGE`: a copy-on-write disk, PATH a new empty sparse file of
    /// IMAGE's size that takes the guest's writes, IMAGE (read-only, shareable) the rest.
    #[arg(long = "disk", value_name = "PATH[:ro|:backing=IMAGE]")]
    disks: Vec<DiskConfig>,
    /// Share a host directory with virtio-fs, `TAG=HOST_DIR[:ro]` (repeatable); the guest mounts
    /// it with `mount -t virtiofs TAG DIR`. Read-only is enforced by the VMM.
    #[arg(long = "share", value_name = "TAG=DIR[:ro]")]
    shares: Vec<ShareConfig>,
    /// The guest's vsock context ID (a restore keeps the saved one).
    #[arg(long, value_name = "CID", default_value_t = DEFAULT_GUEST_CID, requires = "vsock_uds")]
    vsock_cid: u64,
    /// Write how the VM ended (the reason the VMM observed, its exit status, a blocked system
    /// call, and, marked as guest-written, a panic message the console showed) as JSON to
    /// FILE, created or emptied at start. Also with `--config`.
    #[arg(long, value_name = "FILE")]
    exit_file: Option<PathBuf>,
    /// Write the boot phase timestamps (ms since this process started) as JSON to FILE, once as
    /// soon as the vCPUs run and again at exit (each time atomically; see `timings` in the
    /// library docs).
    #[arg(long, value_name = "FILE")]
    timings_json: Option<PathBuf>,
    /// KVM device node (for tests and jails).
    #[arg(long, value_name = "PATH", default_value = KVM_PATH, hide = true)]
    kvm_device: PathBuf,
    /// Boot even though this host's KVM is kvm_pvm (only PVM-enabled guest kernels work there).
    #[arg(long)]
    allow_pvm: bool,
    /// seccomp filters on the VMM's threads once the VM runs: `on` (a system call outside a
    /// thread's allowlist ends the VMM with exit status 4), `log` (it is allowed and logged to
    /// the kernel's audit log) or `off`. Also with `--config`. On by default.
    #[arg(long, value_name = "on|off|log", env = "BULKHEAD_SECCOMP", default_value_t = SeccompMode::On)]
    seccomp: SeccompMode,
    /// Jail the VMM (needs root): it runs as this uid, without capabilities, in its own mount,
    /// PID, IPC, UTS and network namespaces, under a private root holding only the VM's files.
    #[arg(long, value_name = "UID", requires_all = ["jail_gid", "jail_root"])]
    jail_uid: Option<u32>,
    /// The jailed VMM's gid (its only group).
    #[arg(long, value_name = "GID", requires_all = ["jail_uid", "jail_root"])]
    jail_gid: Option<u32>,
    /// An existing empty directory the jail's root is mounted on (in the VMM's own mount
    /// namespace: it stays empty for everyone else).
    #[arg(long, value_name = "DIR", requires_all = ["jail_uid", "jail_gid"])]
    jail_root: Option<PathBuf>,
}

/// How to start the VM, besides its configuration.
struct Launch {
    allow_pvm: bool,
    kvm_device: PathBuf,
    timings: Option<(PathBuf, ProcessClock)>,
    seccomp: SeccompMode,
    jail: Option<JailConfig>,
}

impl Launch {
    fn new(args: &Args, process_start: ProcessClock) -> Launch {
        let jail = match (args.jail_uid, args.jail_gid, &args.jail_root) {
            (Some(uid), Some(gid), Some(root)) => Some(JailConfig {
                uid,
                gid,
                root: root.clone(),
            }),
            _ => None,
        };
        Launch {
            allow_pvm: args.allow_pvm,
            kvm_device: args.kvm_device.clone(),
            timings: args.timings_json.clone().map(|path| (path, process_start)),
            seccomp: args.seccomp,
            jail,
        }
    }
}

impl Args {
    /// What `--restore` takes from the command line.
    fn restore_config(&self, dir: &Path) -> RestoreConfig {
        RestoreConfig {
            dir: dir.to_owned(),
            vsock_uds: self.vsock_uds.clone(),
            serial: self.serial.clone(),
            debugcon: self.debugcon.clone(),
            shares: self.shares.clone(),
            disks: self.disks.clone(),
            memory_mib: None,
            vcpus: None,
        }
    }

    fn into_config(self) -> Result<VmConfig, bulkhead_vmm::config::Error> {
        if let Some(path) = &self.config {
            return VmConfig::from_file(path);
        }
        let config = VmConfig {
            kernel: self.kernel.unwrap_or_default(),
            initrd: self.initrd,
            cmdline: self.cmdline,
            vcpus: self.vcpus,
            memory_mib: self.memory,
            serial: self.serial,
            debugcon: self.debugcon,
            vsock: self.vsock_uds.map(|uds_path| VsockConfig {
                guest_cid: self.vsock_cid,
                uds_path,
            }),
            disks: self.disks,
            shares: self.shares,
        };
        config.validate()?;
        Ok(config)
    }
}

fn main() -> ExitCode {
    let process_start = ProcessClock::now();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Log files (a sandbox's vmm.log, CI output) get no colour codes.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BULKHEAD_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    let args = Args::parse();
    let launch = Launch::new(&args, process_start);
    // Opened first, outside any jail, so every way this process ends below is reported there.
    let exit_file = match args.exit_file.as_deref().map(ExitFile::create).transpose() {
        Ok(file) => file,
        Err(e) => {
            eprintln!("bulkhead-vmm: error: cannot create the exit file: {e}");
            return ExitCode::from(EXIT_ERROR as u8);
        }
    };
    let report = run(args, launch).unwrap_or_else(|msg| {
        eprintln!("bulkhead-vmm: error: {msg}");
        ExitReport::error(&msg)
    });
    if let Some(file) = exit_file {
        if let Err(e) = file.write(&report) {
            eprintln!("bulkhead-vmm: cannot write the exit file: {e}");
        }
    }
    ExitCode::from(u8::try_from(report.exit_code).unwrap_or(EXIT_ERROR as u8))
}

/// Environment variable naming a file that gets one line per VM this binary boots
/// (`pid=<pid> kernel=<path>`) and one per guest that crashed (`pid=<pid> crashed: <how>`),
/// appended with `O_APPEND` so concurrent VMMs never interleave. The test suite counts guest
/// boots and notices nested-guest crashes with it; an operator can use it as an audit trail.
const BOOT_LOG_ENV: &str = "BULKHEAD_BOOT_LOG";

/// The [`BOOT_LOG_ENV`] file, opened before the jail (which does not hold it), with the pid the
/// VMM's spawner knows (the supervisor's, when jailed).
struct BootLog(Option<(std::fs::File, u32)>);

impl BootLog {
    /// Opens the file when the variable is set. A log that cannot be opened only gets a
    /// warning: it must not stop the VM.
    fn open() -> BootLog {
        let Some(path) = std::env::var_os(BOOT_LOG_ENV) else {
            return BootLog(None);
        };
        match std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
        {
            Ok(file) => BootLog(Some((file, std::process::id()))),
            Err(e) => {
                tracing::warn!("cannot open {BOOT_LOG_ENV} file {path:?}: {e}");
                BootLog(None)
            }
        }
    }

    /// Appends this boot (`pid=<pid> kernel=<path>`).
    fn boot(&mut self, kernel: &Path) {
        self.append(&format!("kernel={}", kernel.display()));
    }

    /// Appends this restore (`pid=<pid> restore=<snapshot dir>`).
    fn restore(&mut self, dir: &Path) {
        self.append(&format!("restore={}", dir.display()));
    }

    /// Appends that the guest crashed (`pid=<pid> crashed: <how>`).
    fn crash(&mut self, how: &str) {
        self.append(&format!("crashed: {how}"));
    }

    /// Appends the panic message the guest's console showed (`pid=<pid> console-panic: <text>`,
    /// guest-written text).
    fn console_panic(&mut self, text: &str) {
        self.append(&format!("console-panic: {}", text.escape_debug()));
    }

    /// Appends `pid=<pid> <what>` as one line (a single write, so lines never interleave).
    fn append(&mut self, what: &str) {
        use std::io::Write;
        let Some((file, pid)) = &mut self.0 else {
            return;
        };
        let line = format!("pid={pid} {what}\n");
        if let Err(e) = file.write_all(line.as_bytes()) {
            tracing::warn!("cannot append to the {BOOT_LOG_ENV} file: {e}");
        }
    }
}

/// SIGTERM, SIGINT and SIGHUP stop the VM cleanly (devices are torn down and the vsock socket
/// removed) instead of killing the process. The signal thread installs its seccomp filter before
/// it waits; this returns once it did.
fn stop_on_signals(stop: StopHandle, seccomp: Arc<ThreadFilters>) -> Result<(), String> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP])
        .map_err(|e| format!("cannot install signal handlers: {e}"))?;
    let (confined_tx, confined) = std::sync::mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name("signals".into())
        .stack_size(bulkhead_vmm::vstate::THREAD_STACK_BYTES)
        .spawn(move || {
            let installed = seccomp.install(ThreadKind::Signal);
            let ok = installed.is_ok();
            let _ = confined_tx.send(installed);
            if !ok {
                return;
            }
            if let Some(sig) = signals.forever().next() {
                tracing::info!("signal {sig}: stopping the VM");
                stop.stop();
            }
        })
        .map_err(|e| format!("cannot start the signal thread: {e}"))?;
    match confined.recv() {
        Ok(installed) => installed.map_err(|e| e.to_string()),
        Err(_) => Err("the signal thread ended before it could wait for signals".into()),
    }
}

fn run(args: Args, launch: Launch) -> Result<ExitReport, String> {
    // The state file is read, digested and parsed once: for the jail's plan and the restore.
    let restore = match args.restore.as_deref() {
        Some(dir) => Some(snapshot::load(&args.restore_config(dir)).map_err(|e| e.to_string())?),
        None => None,
    };
    let api_sock = args.api_sock.clone();
    let config = match &restore {
        // What the jail's plan is made from; the restore itself uses the loaded snapshot.
        Some(r) => r.jail_config(),
        None => args.into_config().map_err(|e| e.to_string())?,
    };
    let seccomp = Arc::new(ThreadFilters::new(launch.seccomp).map_err(|e| e.to_string())?);
    let kvm = host_kvm();
    if !kvm.can_boot_stock_kernel() && !launch.allow_pvm {
        return Err(format!(
            "{}; boot guests inside the nested test host instead (`bulkhead-testhost run -- bulkhead-vmm ...`), or pass --allow-pvm for a PVM-enabled guest kernel",
            kvm.explain()
        ));
    }
    // virtio-fs holds a descriptor per guest-visible inode (see `limits`).
    match bulkhead_vmm::limits::raise_open_files_limit() {
        Ok((soft, _)) => tracing::debug!("open files limit: {soft}"),
        Err(e) => tracing::warn!("cannot raise the open files limit: {e}"),
    }
    let mut boot_log = BootLog::open();
    let confined = match &launch.jail {
        Some(jail) => {
            let timings_path = launch.timings.as_ref().map(|(path, _)| path.as_path());
            let plan = MountPlan::for_vm(&config, timings_path).map_err(|e| e.to_string())?;
            Some(jail::enter(jail, &plan, &launch.kvm_device).map_err(|e| e.to_string())?)
        }
        None => None,
    };
    let restored_from = restore.as_ref().map(|r| r.dir().to_owned());
    let mut vmm = match restore {
        Some(r) => r
            .restore_with_kvm(&launch.kvm_device)
            .map_err(|e| e.to_string())?,
        None => build_with_kvm(&config, &launch.kvm_device).map_err(|e| e.to_string())?,
    };
    if let Some(path) = &api_sock {
        vmm.serve_control(ControlSocket::bind(path).map_err(|e| e.to_string())?);
    }
    if let Some(confined) = confined {
        confined.drop_privileges().map_err(|e| e.to_string())?;
    }
    match &restored_from {
        Some(dir) => boot_log.restore(dir),
        None => boot_log.boot(&config.kernel),
    }
    stop_on_signals(vmm.stop_handle(), Arc::clone(&seccomp))?;
    // Jailed, the stop signals were blocked until now (see `jail::unblock_stop_signals`).
    jail::unblock_stop_signals().map_err(|e| e.to_string())?;
    let ranges = guest_ranges(vmm.guest_memory());
    let timings = launch.timings;
    let outcome = vmm
        .run_confined(seccomp, |timeline| {
            if let Some((path, origin)) = &timings {
                let report = TimingsReport::new(timeline, *origin, true, ranges.clone());
                // A reader simply finds no phases; the VM itself is fine.
                if let Err(e) = report.write_atomic(path) {
                    tracing::warn!("{e}");
                }
            }
        })
        .map_err(|e| e.to_string())?;
    if let Some((path, origin)) = timings {
        TimingsReport::new(&outcome.timeline, origin, false, ranges)
            .write_atomic(&path)
            .map_err(|e| format!("cannot write timings: {e}"))?;
    }
    let report = ExitReport::of_run(&outcome.reason, outcome.console_panic.as_deref());
    if outcome.reason == ExitReason::GuestCrash {
        boot_log.crash("triple fault or KVM crash event");
    }
    if let Some(text) = &outcome.console_panic {
        boot_log.console_panic(text);
    }
    if !report.is_clean() || report.guest_console_panic.is_some() {
        eprintln!("bulkhead-vmm: {}", report.describe());
    }
    Ok(report)
}
