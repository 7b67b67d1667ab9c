//! `bulkhead`: run commands in throwaway KVM microVMs.
//!
//! Exit status of `bulkhead run`: the command's own exit code; 128+N when a signal N killed it;
//! 124 when `--timeout` expired; 125 when bulkhead itself failed (no VM, bad input).

mod run;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Run untrusted commands in KVM microVMs.
#[derive(Debug, Parser)]
#[command(name = "bulkhead", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Boot a microVM, run one command in it, stream its output, destroy the VM.
    Run(run::RunArgs),
}

/// Exit status when bulkhead itself fails (as `docker run` does).
pub const EXIT_BULKHEAD_ERROR: u8 = 125;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BULKHEAD_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(EXIT_BULKHEAD_ERROR)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    match cli.command {
        Command::Run(args) => match run::run(args) {
            Ok(code) => ExitCode::from(code),
            Err(e) => {
                eprintln!("bulkhead: error: {e}");
                ExitCode::from(EXIT_BULKHEAD_ERROR)
            }
        },
    }
}
