//! `bulkheadd`: the bulkhead host daemon.
//!
//! ```text
//! bulkheadd [--config FILE] [--socket PATH] [--state-dir DIR] [--runtime-dir DIR] [--vmm PATH]
//!           [--kernel PATH] [--image PATH] [--cgroups auto|v1|v2|off] [--cgroup-parent PATH]
//!           [--on-shutdown destroy|leave] [--on-restart adopt|destroy]
//! ```
//!
//! Logs go to stderr (journald under systemd); `BULKHEAD_LOG` (or `RUST_LOG`) sets the filter,
//! default `info`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use bulkhead_daemon::config::{Config, Overrides};
use clap::Parser;

/// The bulkhead host daemon: KVM microVM sandboxes behind a local API.
#[derive(Debug, Parser)]
#[command(name = "bulkheadd", version, about)]
struct Cli {
    /// Configuration file (TOML); see docs/daemon.md for every key and its default.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    #[command(flatten)]
    overrides: Overrides,
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("BULKHEAD_LOG")
        .or_else(|_| tracing_subscriber::EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Under systemd, journald adds timestamps and does not render colours.
    let journald = std::env::var_os("JOURNAL_STREAM").is_some();
    let builder = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter)
        .with_ansi(!journald && std::io::IsTerminal::is_terminal(&std::io::stderr()));
    if journald {
        builder.without_time().init();
    } else {
        builder.init();
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging();
    // The daemon's log filter is not the VMMs': `bulkhead-vmm` reads the same variables, and its
    // debug logging slows a nested guest's boot past any timeout. Still single-threaded here, so
    // changing the environment is sound.
    std::env::remove_var("BULKHEAD_LOG");
    std::env::remove_var("RUST_LOG");
    let config = match Config::load(cli.config.as_deref(), &cli.overrides) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("bulkheadd: {e}");
            return ExitCode::from(2);
        }
    };
    let kvm = bulkhead_vmm::vstate::kvm::host_kvm();
    if !kvm.can_boot_stock_kernel() {
        tracing::warn!(
            "{}: sandboxes created here will fail to boot (502 vm_exited); on such a host run \
             bulkheadd and its clients inside the nested test host (docs/testhost.md)",
            kvm.explain()
        );
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("bulkheadd: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(bulkhead_daemon::run(config));
    // Blocking work still running (a boot in progress) gets a bounded time to finish.
    runtime.shutdown_timeout(Duration::from_secs(10));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bulkheadd: {e}");
            ExitCode::FAILURE
        }
    }
}
