//! `bulkhead-testhost`: prepare the nested test host, or boot it and run one command inside.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use bulkhead_testhost::protocol::{shell_quote, shell_quote_path};
use bulkhead_testhost::{prepare, Error, TcgThreads, TestHost, TestHostConfig, DEFAULT_CPU_MODEL};
use clap::{Args, Parser, Subcommand};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

/// Nested QEMU test host with real KVM (kvm-amd) for bulkhead's boot-level tests.
#[derive(Debug, Parser)]
#[command(version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Fetch the kernel and build the initramfs (cached), then print their paths.
    Prepare {
        /// Also include the shared libraries this binary needs (repeatable).
        #[arg(long = "libs-for", value_name = "BINARY")]
        libs_for: Vec<PathBuf>,
    },
    /// Boot the test host, run CMD in the current directory (shared at the same path), exit with its status.
    Run(RunArgs),
}

#[derive(Debug, Args)]
struct RunArgs {
    /// Host directory to mount inside at the same path (repeatable; the current directory always is).
    #[arg(long = "share", value_name = "DIR")]
    shares: Vec<PathBuf>,
    /// Test host RAM in MiB.
    #[arg(long, default_value_t = 2048)]
    memory: u32,
    /// Test host vCPUs.
    #[arg(long, default_value_t = 2)]
    cpus: u8,
    /// Kill CMD after this many seconds (exit status 124).
    #[arg(long, value_name = "SECS")]
    timeout: Option<u64>,
    /// Also include the shared libraries this binary needs (repeatable; CMD itself is added when it is a
    /// path to a file).
    #[arg(long = "libs-for", value_name = "BINARY")]
    libs_for: Vec<PathBuf>,
    /// Environment variable for CMD; a bare KEY passes on this environment's value of KEY, which
    /// stays off the command line (repeatable).
    #[arg(short = 'e', long = "env", value_name = "KEY=VALUE|KEY")]
    env: Vec<String>,
    /// Multi-threaded TCG, the default now (kept for old command lines).
    #[arg(long, hide = true, conflicts_with = "single_tcg")]
    mttcg: bool,
    /// Run the vCPUs in one host thread (single-threaded TCG) instead of one thread each: nested
    /// guests under stress stall far more often there (docs/testhost.md).
    #[arg(long = "single-tcg")]
    single_tcg: bool,
    /// QEMU CPU model with optional feature flags (`-cpu` value), e.g. `EPYC-Rome` or `max,-vgif`.
    #[arg(long = "cpu", value_name = "MODEL", default_value = DEFAULT_CPU_MODEL)]
    cpu_model: String,
    /// Extra kernel command line argument for the test host (repeatable), e.g. `loglevel=7`;
    /// `MODULE.PARAM=VALUE` also reaches that module when it is loaded, e.g. `kvm_amd.npt=0`.
    #[arg(long = "kernel-arg", value_name = "ARG")]
    kernel_args: Vec<String>,
    /// Debian kernel package to boot the test host with (e.g. `linux-image-6.12.95+deb12-amd64`
    /// from bookworm-backports, once apt knows it) [default: what `linux-image-amd64` depends on].
    #[arg(long = "kernel-package", value_name = "PACKAGE")]
    kernel_package: Option<String>,
    /// Keep the test host's address-space randomization (ASLR) for its processes. It is off by
    /// default because the emulator translates the code of a randomized process again at every
    /// exec, which makes process start-up ~5x slower than the rest of the emulation.
    #[arg(long)]
    aslr: bool,
    /// Print QEMU's pid, the run directory and timings to stderr.
    #[arg(short, long)]
    verbose: bool,
    /// The command and its arguments.
    #[arg(last = true, required = true, value_name = "CMD")]
    cmd: Vec<String>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Prepare { libs_for } => run_prepare(libs_for).map(|()| 0),
        Command::Run(args) => run_command(args),
    };
    match result {
        Ok(status) => ExitCode::from(status),
        Err(e) => {
            eprintln!("bulkhead-testhost: {e:#}");
            ExitCode::from(125)
        }
    }
}

fn run_prepare(libs_for: Vec<PathBuf>) -> Result<()> {
    let started = Instant::now();
    let cfg = TestHostConfig {
        extra_libs_for: libs_for,
        ..TestHostConfig::default()
    };
    let p = prepare(&cfg.prepare_options()).context("preparing the test host")?;
    println!("cache:     {}", p.cache_root.display());
    println!("package:   {} {}", p.package.name, p.package.version);
    println!("kernel:    {}", p.kernel.display());
    println!("initramfs: {}", p.initramfs.display());
    eprintln!("prepared in {} ms", started.elapsed().as_millis());
    Ok(())
}

/// Builds the script: exports, `cd` into `cwd`, then the quoted command.
fn build_script(cwd: &Path, env: &[String], cmd: &[String]) -> Result<String> {
    let mut script = String::new();
    for kv in env {
        let (k, v) = match kv.split_once('=') {
            Some((k, v)) => (k, v.to_owned()),
            None => {
                let v = std::env::var(kv)
                    .with_context(|| format!("--env {kv}: no environment variable {kv} here"))?;
                (kv.as_str(), v)
            }
        };
        let valid = !k.is_empty()
            && !k.starts_with(|c: char| c.is_ascii_digit())
            && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        anyhow::ensure!(valid, "--env {kv:?}: {k:?} is not a variable name");
        script.push_str(&format!("export {k}={}\n", shell_quote(&v)));
    }
    script.push_str(&format!("cd {} || exit 125\n", shell_quote_path(cwd)));
    let words: Vec<String> = cmd.iter().map(|w| shell_quote(w)).collect();
    script.push_str(&words.join(" "));
    script.push('\n');
    Ok(script)
}

fn run_command(args: RunArgs) -> Result<u8> {
    let cwd = std::env::current_dir().context("reading the current directory")?;
    let mut shares = vec![cwd.clone()];
    shares.extend(args.shares);
    let mut libs_for = args.libs_for;
    if let Some(first) = args.cmd.first().map(Path::new) {
        if first.components().count() > 1 && cwd.join(first).is_file() {
            libs_for.push(cwd.join(first));
        }
    }
    let script = build_script(&cwd, &args.env, &args.cmd)?;
    let run_dir_slot = remove_run_dir_on_signals()?;
    let cfg = TestHostConfig {
        memory_mib: args.memory,
        cpus: args.cpus,
        shares,
        extra_libs_for: libs_for,
        kernel_args: args.kernel_args,
        host_aslr: args.aslr,
        kernel_package: args.kernel_package,
        cpu_model: args.cpu_model,
        tcg_threads: if args.single_tcg {
            TcgThreads::Single
        } else {
            TcgThreads::Multi
        },
        ..TestHostConfig::default()
    };
    let host = TestHost::start(cfg).context("starting the test host")?;
    *lock(&run_dir_slot) = Some(host.run_dir().to_path_buf());
    if args.verbose {
        for failed in host.failed_boots() {
            eprintln!("bulkhead-testhost: a boot attempt failed: {failed}");
        }
        eprintln!(
            "bulkhead-testhost: qemu pid {}, run dir {}, ready after {} ms",
            host.qemu_pid(),
            host.run_dir().display(),
            host.boot_time().as_millis()
        );
    }
    let timeout = args.timeout.map_or(Duration::MAX, Duration::from_secs);
    let started = Instant::now();
    let result = host.run_streaming(
        &script,
        timeout,
        &mut std::io::stdout(),
        &mut std::io::stderr(),
    );
    let _ = std::io::stdout().flush();
    if args.verbose {
        eprintln!(
            "bulkhead-testhost: command took {} ms",
            started.elapsed().as_millis()
        );
    }
    let status = match result {
        Ok(status) => u8::try_from(status).unwrap_or(255),
        Err(Error::CommandTimedOut { timeout, .. }) => {
            eprintln!("bulkhead-testhost: command timed out after {timeout:?}");
            124
        }
        Err(e) => return Err(e).context("running the command"),
    };
    // From here on the host's own shutdown removes the run directory.
    lock(&run_dir_slot).take();
    host.shutdown().context("shutting down the test host")?;
    Ok(status)
}

/// The run directory to remove if a signal stops this process, once the test host has one.
type RunDirSlot = Arc<Mutex<Option<PathBuf>>>;

fn lock(slot: &RunDirSlot) -> std::sync::MutexGuard<'_, Option<PathBuf>> {
    slot.lock().unwrap_or_else(|p| p.into_inner())
}

/// Makes SIGTERM, SIGINT and SIGHUP end this process with status 128+N after removing the test
/// host's run directory (console log, QEMU log, control socket, scratch files) from the slot.
/// QEMU itself dies with this process (it was started with a parent-death signal, see the crate's
/// `qemu` module), so nothing of the test host outlives a stopped `bulkhead-testhost run`.
fn remove_run_dir_on_signals() -> Result<RunDirSlot> {
    let slot = RunDirSlot::default();
    let mut signals =
        Signals::new([SIGTERM, SIGINT, SIGHUP]).context("installing signal handlers")?;
    let for_thread = Arc::clone(&slot);
    std::thread::spawn(move || {
        if let Some(signo) = signals.forever().next() {
            if let Some(dir) = lock(&for_thread).take() {
                let _ = std::fs::remove_dir_all(&dir);
            }
            // Not eprintln!: with stderr gone (a closed pipe) it would panic this thread and the
            // process would never exit.
            let _ = writeln!(
                std::io::stderr(),
                "bulkhead-testhost: stopped by signal {signo}; test host run directory removed"
            );
            std::process::exit(128 + signo);
        }
    });
    Ok(slot)
}
