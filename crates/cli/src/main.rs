//! `bulkhead`: run commands in throwaway KVM microVMs.
//!
//! Exit status of `bulkhead run`: the command's own exit code; 128+N when a signal N killed it;
//! 124 when `--timeout` expired; 125 when bulkhead itself failed (no VM, bad input).

mod bench;
#[cfg(test)]
mod cli_docs_tests;
mod daemon_cmds;
mod exec_attach;
mod image_cmds;
mod machine;
mod network;
mod run;
mod run_export;
mod rundir;
mod signals;
mod template;
mod terminal;
mod workspace_cmds;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Run untrusted commands in KVM microVMs.
#[derive(Debug, Parser)]
#[command(name = "bulkhead", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once per process: the size of its largest variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// Boot a microVM, run one command in it, stream its output, destroy the VM.
    #[command(after_help = EXIT_STATUS_HELP, allow_negative_numbers = true)]
    Run(run::RunArgs),
    /// Time N cold starts phase by phase: percentile table, JSON, SVG plot, comparisons.
    #[command(allow_negative_numbers = true, override_usage = BENCH_USAGE)]
    Bench(bench::BenchArgs),
    /// Create a sandbox in the daemon (bulkheadd) and print its ID.
    #[command(allow_negative_numbers = true)]
    Create(daemon_cmds::CreateArgs),
    /// List the daemon's sandboxes.
    Ls(daemon_cmds::LsArgs),
    /// Run a command in a daemon sandbox, streaming its output.
    #[command(after_help = EXIT_STATUS_HELP, allow_negative_numbers = true)]
    Exec(daemon_cmds::ExecArgs),
    /// Copy a file into (FILE ID:/path) or out of (ID:/path FILE) a daemon sandbox.
    Cp(daemon_cmds::CpArgs),
    /// Destroy daemon sandboxes.
    Rm(daemon_cmds::RmArgs),
    /// Pause daemon sandboxes: save their VMs in the daemon's state directory and stop them.
    Pause(daemon_cmds::PauseArgs),
    /// Resume paused daemon sandboxes where they were.
    Resume(daemon_cmds::ResumeArgs),
    /// Show a daemon sandbox's VMM output and serial console.
    #[command(allow_negative_numbers = true)]
    Logs(daemon_cmds::LogsArgs),
    /// List what changed in a daemon sandbox's workspace (A/M/D), flagging paths that run code
    /// on the host implicitly.
    Diff(workspace_cmds::DiffArgs),
    /// Write a daemon sandbox's clone-workspace changes as a git patch or a tar archive.
    Export(workspace_cmds::ExportArgs),
    /// Build, list and delete root filesystem images (`bulkhead run --image NAME`).
    Image(image_cmds::ImageArgs),
    /// Create, list and delete sandbox templates: snapshots of a booted, prepared sandbox that
    /// `bulkhead run --template NAME` restores instead of booting.
    Template(template::TemplateArgs),
    /// The sandboxes' network: the presets of `--allow @NAME` (docs/network.md).
    Network(NetworkCmd),
}

/// `bulkhead network`.
#[derive(Debug, clap::Args)]
struct NetworkCmd {
    #[command(subcommand)]
    verb: NetworkVerb,
}

#[derive(Debug, Subcommand)]
enum NetworkVerb {
    /// List the presets `--allow @NAME` takes, with their hosts.
    Presets,
}

impl Command {
    /// Whether the verb only prints a listing or a log, and so should end silently, like any
    /// Unix tool, when its reader goes away (`bulkhead ls | head -1`). Verbs that stream a
    /// command's output or files handle a closed stdout themselves.
    fn dies_of_sigpipe(&self) -> bool {
        matches!(
            self,
            Command::Create(_)
                | Command::Ls(_)
                | Command::Logs(_)
                | Command::Diff(_)
                | Command::Image(_)
                | Command::Network(_)
        ) || matches!(self, Command::Template(t) if t.dies_of_sigpipe())
    }
}

/// Gives SIGPIPE its default action back (the Rust runtime ignores it, which turns every
/// `println!` to a closed pipe into a panic).
fn restore_default_sigpipe() {
    // SAFETY: signal(2) with SIG_DFL installs no handler code; called once, before any thread
    // that writes to stdout is started.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
}

/// Exit status when bulkhead itself fails (as `docker run` does).
pub const EXIT_BULKHEAD_ERROR: u8 = 125;

/// The exit statuses of `run` and `exec`, shown at the end of their `--help`.
const EXIT_STATUS_HELP: &str = "Exit status:
  N      the command exited with status N
  128+N  a signal N killed the command (141: its output's reader went away, SIGPIPE)
  124    --timeout expired and the command's process group was killed
  125    bulkhead itself failed: bad input, no VM, the command's output could not be written";

/// The usage line of `bench`, whose two forms take different arguments (a command is refused
/// with `--compare`).
const BENCH_USAGE: &str = "bulkhead bench [OPTIONS] [CMD]...
       bulkhead bench --compare <A.json> <B.json>";

/// Prints clap's `--help` or `--version` text (`e`) to stdout like any Unix tool: killed by
/// SIGPIPE when the reader went away, and 125 with an error on stderr when stdout was closed
/// at start or the write failed (e.g. ENOSPC), instead of a silent 0.
fn print_help(e: &clap::Error) -> ExitCode {
    restore_default_sigpipe();
    let printed = run::closed_stdio::check_stdout()
        .and_then(|()| e.print().map_err(run::closed_stdio::stdout_failed));
    match printed {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("bulkhead: error: {err}");
            ExitCode::from(EXIT_BULKHEAD_ERROR)
        }
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Log files (a sandbox's vmm.log, CI output) get no colour codes.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BULKHEAD_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => return print_help(&e),
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(EXIT_BULKHEAD_ERROR);
        }
    };
    if cli.command.dies_of_sigpipe() {
        restore_default_sigpipe();
    }
    match cli.command {
        Command::Run(args) => match run::run(args) {
            Ok(code) => ExitCode::from(code),
            Err(e) => {
                eprintln!("bulkhead: error: {e}");
                ExitCode::from(EXIT_BULKHEAD_ERROR)
            }
        },
        Command::Bench(args) => bench::bench(args),
        Command::Create(args) => daemon_cmds::create(args),
        Command::Ls(args) => daemon_cmds::ls(args),
        Command::Exec(args) => daemon_cmds::exec(args),
        Command::Cp(args) => daemon_cmds::cp(args),
        Command::Rm(args) => daemon_cmds::rm(args),
        Command::Pause(args) => daemon_cmds::pause(args),
        Command::Resume(args) => daemon_cmds::resume(args),
        Command::Logs(args) => daemon_cmds::logs(args),
        Command::Diff(args) => workspace_cmds::diff(args),
        Command::Export(args) => workspace_cmds::export(args),
        Command::Image(args) => image_cmds::image(args),
        Command::Template(args) => template::template(args),
        Command::Network(NetworkCmd {
            verb: NetworkVerb::Presets,
        }) => network::print_presets(),
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn bench_usage_shows_compare_without_a_command() {
        let mut cli = Cli::command();
        let bench = cli.find_subcommand_mut("bench").unwrap();

        let usage = bench.render_usage().to_string();

        assert!(
            usage.contains("bulkhead bench [OPTIONS] [CMD]..."),
            "{usage}"
        );
        assert!(
            usage.contains("bulkhead bench --compare <A.json> <B.json>"),
            "{usage}"
        );
    }
}
