//! `bulkhead bench`: N cold starts of a command, each timed phase by phase (see
//! `bulkhead_sandbox::phases`), reported as a percentile table, JSON ([`report`]) and an SVG
//! plot ([`plot`]); `--compare A.json B.json` sets two results side by side ([`compare`]).
//!
//! Every run boots a fresh sandbox (with `--template NAME`: restores a clone of the template
//! instead, timed by the restore's phases), runs the command, waits for its first output (or exit
//! status) and its exit, samples the VMM's memory ([`rss`]) and destroys the sandbox.
//! With `--daemon` every run goes through `bulkheadd`'s API instead ([`daemon`]): create (cold,
//! from a template, or handed out by its warm pool), one exec, delete.
//!
//! Failures are counted and listed, never fatal: `bench` exits 0 when at least one run
//! succeeded, 1 when none did, and 125 when it could not run at all (bad arguments, a host
//! whose KVM cannot boot the guest kernel).

mod compare;
mod daemon;
mod plot;
mod report;
mod rss;
mod runner;
mod stats;
mod table;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bulkhead_client::{CreateSandbox, ExecSpec};
use bulkhead_sandbox::spec::{new_id, DEFAULT_MEMORY_MIB, DEFAULT_VCPUS};
use bulkhead_sandbox::{HostSettings, SandboxSpec, PHASE_NAMES};
use bulkhead_vmm::config::SerialOutput;
use indicatif::{ProgressBar, ProgressStyle};

use crate::template::restore::{restore_recipe, sizes};
use crate::template::store::TemplateStore;
use report::{BenchConfig, BenchReport, HostInfo, RunRecord, SCHEMA};
use runner::{ColdStart, Mode, Plan};

/// Arguments of `bulkhead bench`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Number of cold starts.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    runs: u32,
    /// Most sandboxes alive at once.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    concurrency: u32,
    /// When runs start: `sequential` (each worker starts its next run when the last one is
    /// destroyed), `burst` (waves of --concurrency runs released at once) or `staggered:MS`
    /// (run i starts i×MS ms after the first, at most --concurrency at a time).
    #[arg(
        long,
        default_value = "sequential",
        value_name = "sequential|burst|staggered:MS"
    )]
    mode: Mode,
    /// Root filesystem image: a name from `bulkhead image ls` or the path of an ext4 file.
    #[arg(long, value_name = "NAME|PATH")]
    image: Option<String>,
    /// Restore each sandbox from template NAME (`bulkhead template create`) instead of booting
    /// it; the JSON has the same fields, so `--compare` sets a template against cold starts.
    #[arg(
        long,
        value_name = "NAME",
        value_parser = crate::template::parse_name,
        conflicts_with_all = ["image", "kernel_args"]
    )]
    template: Option<String>,
    /// vCPUs per sandbox [default: 1; with --template: the template's].
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..))]
    vcpus: Option<u8>,
    /// Guest memory per sandbox, MiB [default: 256; with --template: the template's].
    #[arg(long, value_name = "MIB")]
    memory: Option<u32>,
    /// Seconds each sandbox may take to boot, and to send each next output or exit of the
    /// command.
    #[arg(long, value_name = "SECS", default_value_t = 120.0)]
    boot_timeout: f64,
    /// Keep each guest's serial console in its VMM output, so that a failed run's
    /// `vmm_log_tail` also shows the guest kernel's last messages (with the default `quiet`
    /// command line: errors, oopses, panics, soft-lockup reports). Off by default, as in
    /// `bulkhead run`.
    #[arg(long)]
    console: bool,
    /// Extra guest kernel command-line parameter, appended to the defaults (repeatable), to
    /// measure its effect, e.g. `--kernel-arg mitigations=off`.
    #[arg(long = "kernel-arg", value_name = "ARG", value_parser = crate::run::parse_kernel_arg)]
    kernel_args: Vec<String>,
    /// Write every run's phases as JSON (schema `bulkhead-bench/1`, see docs/cli.md).
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Draw the per-phase distributions as an SVG picture.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// Compare two results written with --json (p50s and their ratio B/A); runs nothing.
    #[arg(
        long,
        num_args = 2,
        value_names = ["A.json", "B.json"],
        conflicts_with_all = ["runs", "concurrency", "mode", "image", "template", "vcpus", "memory", "boot_timeout", "console", "kernel_args", "json", "plot", "command", "daemon"]
    )]
    compare: Option<Vec<PathBuf>>,
    /// Create each sandbox through `bulkheadd` (its API on --socket) and run the command with
    /// one exec: the times an API client pays. --template then names a template of the
    /// daemon's; when its warm pool keeps that template, each run first waits (untimed) for
    /// the pool to be full, so that every create is a hand-out. No phases or memory samples.
    #[arg(long, conflicts_with_all = ["console", "kernel_args"])]
    daemon: bool,
    #[command(flatten)]
    daemon_opts: crate::daemon_cmds::DaemonOpts,
    /// The command each sandbox runs [default: true].
    #[arg(trailing_var_arg = true, value_name = "CMD")]
    command: Vec<String>,
}

impl BenchArgs {
    /// How many runs, how many at once, and when.
    fn plan(&self) -> Plan {
        Plan {
            runs: self.runs as usize,
            concurrency: self.concurrency as usize,
            mode: self.mode,
        }
    }
}

/// Runs `bulkhead bench`; see the module docs for the exit status.
pub fn bench(args: BenchArgs) -> ExitCode {
    match run(args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("bulkhead: error: {e}");
            ExitCode::from(crate::EXIT_BULKHEAD_ERROR)
        }
    }
}

fn run(args: BenchArgs) -> Result<ExitCode, String> {
    if let Some(files) = &args.compare {
        let [a, b] = files.as_slice() else {
            return Err("--compare takes two files".into());
        };
        let (report_a, report_b) = (BenchReport::load(a)?, BenchReport::load(b)?);
        let ratios = compare::ratios(&report_a, &report_b);
        let name = |path: &PathBuf, r: &BenchReport| format!("{} ({})", path.display(), r.kind());
        print!(
            "{}",
            compare::render(&name(a, &report_a), &name(b, &report_b), &ratios)
        );
        return Ok(ExitCode::SUCCESS);
    }
    let command = if args.command.is_empty() {
        vec!["true".to_owned()]
    } else {
        args.command.clone()
    };
    let patience = Duration::try_from_secs_f64(args.boot_timeout)
        .map_err(|_| "--boot-timeout must be a non-negative number of seconds")?;
    if args.daemon {
        return run_through_daemon(&args, command, patience);
    }
    let spec = SandboxSpec {
        vcpus: args.vcpus.unwrap_or(DEFAULT_VCPUS),
        memory_mib: args.memory.unwrap_or(DEFAULT_MEMORY_MIB),
        image: args.image.as_deref().map(crate::run::image_ref),
        kernel_args: args.kernel_args.clone(),
        ..SandboxSpec::default()
    };
    let mut host = HostSettings::local();
    host.ready_timeout = patience;
    if args.console {
        host.console = SerialOutput::Stdout;
    }
    let id = new_id().map_err(|e| format!("cannot make a sandbox ID: {e}"))?;
    // One recipe for every run (they share its hostname, `bh-<id>`).
    let (recipe, template) = match &args.template {
        Some(name) => {
            let template = TemplateStore::local().open(name)?;
            let (vcpus, memory_mib) = sizes(args.vcpus, args.memory, &template.manifest)?;
            let spec = SandboxSpec {
                vcpus,
                memory_mib,
                ..spec
            };
            let recipe = restore_recipe(&spec, &host, &template, &id)?;
            (recipe, Some(template))
        }
        None => {
            let recipe = bulkhead_sandbox::build(&spec, &host, &id).map_err(|e| e.to_string())?;
            (recipe, None)
        }
    };
    let (mut config, storage) = (recipe.config, recipe.storage);
    for path in args.json.iter().chain(&args.plot) {
        check_writable(path)?;
    }
    crate::run::require_bootable_kvm(&output_dirs(&args))?;
    // The runs' runtime directories live in one of this process's own, swept by a later
    // `bulkhead run` or `bench` if this one is killed.
    let bench_dir = crate::rundir::create(&config.runtime_dir)?;
    config.runtime_dir = bench_dir.path().to_owned();
    let plan = args.plan();
    let request = recipe
        .exec
        .request(command.clone(), &Default::default(), None, None);
    let cold_start = ColdStart {
        config: &config,
        storage: &storage,
        request: &request,
        restore_from: template.as_ref().map(|t| t.dir.as_path()),
    };
    let what = match template {
        Some(_) => "restores",
        None => "cold starts",
    };
    let progress = progress_bar(plan.runs as u64, what);
    let runs = runner::schedule(&plan, |i| cold_start.run(i), |r| tick(&progress, r));
    progress.finish_and_clear();
    let report = new_report(
        BenchConfig {
            runs: plan.runs,
            concurrency: plan.concurrency,
            mode: plan.mode.to_string(),
            image: args.image.clone(),
            template: args.template.clone(),
            vcpus: config.vcpus,
            memory_mib: config.memory_mib,
            console: args.console,
            kernel: config.kernel.clone(),
            initrd: config.initrd.clone(),
            kernel_args: args.kernel_args.clone(),
            command,
            daemon: None,
        },
        runs,
    );
    finish(&report, &args)
}

/// `bulkhead bench --daemon`: the runs through the daemon's API ([`daemon`]).
fn run_through_daemon(
    args: &BenchArgs,
    command: Vec<String>,
    patience: Duration,
) -> Result<ExitCode, String> {
    for path in args.json.iter().chain(&args.plot) {
        check_writable(path)?;
    }
    let client = args.daemon_opts.client();
    let socket = args.daemon_opts.socket().to_owned();
    let reachable = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start an async runtime: {e}"))?
        .block_on(client.health());
    reachable.map_err(|e| format!("the daemon at {} does not answer: {e}", socket.display()))?;
    let create = CreateSandbox {
        vcpus: args.vcpus.unwrap_or(DEFAULT_VCPUS),
        memory_mib: args.memory.unwrap_or(DEFAULT_MEMORY_MIB),
        image: args.image.clone(),
        template: args.template.clone(),
        ..CreateSandbox::default()
    };
    let exec = ExecSpec::new(command.clone());
    let plan = args.plan();
    let stop = daemon::Stop::install()?;
    let daemon_run = daemon::DaemonRun {
        client: &client,
        create: &create,
        exec: &exec,
        patience,
        stop: &stop,
    };
    let progress = progress_bar(plan.runs as u64, "creates");
    let runs = runner::schedule(&plan, |i| daemon_run.run(i), |r| tick(&progress, r));
    progress.finish_and_clear();
    if let Some(signal) = stop.signal() {
        eprintln!(
            "bulkhead: bench stopped by signal {signal}; every sandbox it created was deleted"
        );
        return Ok(ExitCode::from(u8::try_from(128 + signal).unwrap_or(1)));
    }
    let report = new_report(
        BenchConfig {
            runs: plan.runs,
            concurrency: plan.concurrency,
            mode: plan.mode.to_string(),
            image: args.image.clone(),
            template: args.template.clone(),
            vcpus: create.vcpus,
            memory_mib: create.memory_mib,
            console: false,
            kernel: PathBuf::new(),
            initrd: PathBuf::new(),
            kernel_args: Vec::new(),
            command,
            daemon: Some(socket),
        },
        runs,
    );
    finish(&report, args)
}

/// A report of `runs` made with `config`, on this host, now.
fn new_report(config: BenchConfig, runs: Vec<RunRecord>) -> BenchReport {
    BenchReport {
        schema: SCHEMA.to_owned(),
        created_unix_s: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        host: host_info(),
        config,
        phases: PHASE_NAMES.iter().map(|p| (*p).to_owned()).collect(),
        runs,
    }
}

/// Prints `report`'s table, writes its JSON and plot as `args` ask; the exit status: 0 when a
/// run succeeded, else 1.
fn finish(report: &BenchReport, args: &BenchArgs) -> Result<ExitCode, String> {
    print!("{}", table::render(report));
    if let Some(hint) = bulkhead_sandbox::host_tuning::slow_vm_creation_hint() {
        eprintln!("bulkhead: note: {hint}");
    }
    let json_saved = args.json.as_ref().map(|path| report.save(path));
    let plot_saved = args.plot.as_ref().map(|path| {
        let title = format!(
            "bulkhead bench: {} {} running `{}` ({}), ms",
            report.runs.len(),
            report.kind(),
            report.config.command.join(" "),
            report.config.mode
        );
        let series = match report.has_phases() {
            false => report.daemon_series(),
            true => report.step_series(),
        };
        plot::write_svg(path, &title, &series)
    });
    json_saved.transpose()?;
    plot_saved.transpose()?;
    Ok(if report.ok_runs().next().is_some() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// A progress bar on a terminal; hidden otherwise (logs and pipes get only the report).
fn progress_bar(len: u64, what: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    if let Ok(style) =
        ProgressStyle::with_template(&format!("{{bar:40}} {{pos}}/{{len}} {what} {{msg}}"))
    {
        bar.set_style(style);
    }
    bar
}

fn tick(bar: &ProgressBar, run: &RunRecord) {
    if let Some(e) = &run.error {
        bar.println(format!("run {}: {e}", run.index));
    }
    bar.inc(1);
}

fn host_info() -> HostInfo {
    let kernel_release = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default();
    HostInfo {
        kernel_release,
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
    }
}

/// Fails early, before any VM boots, when an output file cannot be written, and leaves it as
/// it is: an existing file is opened for writing but not truncated, a missing one is created
/// and removed again. The results replace the file only at the end, so a refused or
/// interrupted bench loses nothing.
fn check_writable(path: &std::path::Path) -> Result<(), String> {
    use std::fs::OpenOptions;
    let fail = |e: std::io::Error| format!("cannot write {}: {e}", path.display());
    match OpenOptions::new().write(true).open(path) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(path)
                .map_err(fail)?;
            std::fs::remove_file(path).map_err(fail)
        }
        Err(e) => Err(fail(e)),
    }
}

/// The directories of the absolute `--json` and `--plot` files, once each and without `/`: the
/// test host must share them for the files to reach this host (relative paths are inside the
/// current directory, which it always shares).
fn output_dirs(args: &BenchArgs) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    let files = args
        .json
        .iter()
        .chain(&args.plot)
        .filter(|p| p.is_absolute());
    for dir in files.filter_map(|p| p.parent()) {
        if dir != std::path::Path::new("/") && !dirs.iter().any(|d| d == dir) {
            dirs.push(dir.to_owned());
        }
    }
    dirs
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use std::path::Path;

    #[test]
    fn checking_an_output_file_leaves_it_as_it_was() {
        // Arrange: one existing results file, one that does not exist yet.
        let dir = tempfile::tempdir().unwrap();
        let existing = dir.path().join("old.json");
        std::fs::write(&existing, "{\"precious\":1}").unwrap();
        let missing = dir.path().join("new.svg");

        // Act
        let checked = [check_writable(&existing), check_writable(&missing)];
        let in_missing_dir = check_writable(&dir.path().join("no/such/dir/b.json"));

        // Assert
        assert_eq!(checked, [Ok(()), Ok(())]);
        assert_eq!(
            std::fs::read_to_string(&existing).unwrap(),
            "{\"precious\":1}"
        );
        assert!(!missing.exists(), "the probe file is removed again");
        let err = in_missing_dir.unwrap_err();
        assert!(
            err.starts_with("cannot write ") && err.contains("b.json"),
            "{err}"
        );
    }

    #[test]
    fn the_test_host_shares_the_directories_of_absolute_output_files_once() {
        // Arrange
        let cli = Cli::try_parse_from([
            "bench",
            "--json",
            "/tmp/out/b.json",
            "--plot",
            "/tmp/out/b.svg",
            "--runs",
            "2",
        ])
        .unwrap();
        let relative =
            Cli::try_parse_from(["bench", "--json", "b.json", "--plot", "/b.svg"]).unwrap();

        // Act / Assert
        assert_eq!(output_dirs(&cli.bench), [PathBuf::from("/tmp/out")]);
        assert!(output_dirs(&relative.bench).is_empty());
    }

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    #[test]
    fn compare_refuses_flags_that_would_be_ignored() {
        // Arrange / Act
        let with_runs =
            Cli::try_parse_from(["bench", "--compare", "a.json", "b.json", "--runs", "5"]);
        let alone = Cli::try_parse_from(["bench", "--compare", "a.json", "b.json"]);

        // Assert
        let err = with_runs.unwrap_err().to_string();
        assert!(err.contains("--runs"), "{err}");
        assert_eq!(alone.unwrap().bench.compare.unwrap().len(), 2);
    }

    #[test]
    fn a_daemon_bench_refuses_the_flags_of_a_vmm_the_bench_would_run_itself() {
        // Arrange / Act
        let console = Cli::try_parse_from(["bench", "--daemon", "--console"]);
        let kernel_arg = Cli::try_parse_from(["bench", "--daemon", "--kernel-arg", "quiet"]);
        let pooled = Cli::try_parse_from([
            "bench",
            "--daemon",
            "--socket",
            "/run/d.sock",
            "--template",
            "py",
        ]);

        // Assert
        for refused in [console, kernel_arg] {
            let err = refused.unwrap_err().to_string();
            assert!(err.contains("cannot be used with"), "{err}");
        }
        let pooled = pooled.unwrap().bench;
        assert!(pooled.daemon);
        assert_eq!(pooled.daemon_opts.socket(), Path::new("/run/d.sock"));
    }

    #[test]
    fn a_template_bench_refuses_what_a_restore_cannot_change_and_compare() {
        // Arrange / Act
        let with_image = Cli::try_parse_from(["bench", "--template", "py", "--image", "debian"]);
        let with_arg = Cli::try_parse_from(["bench", "--template", "py", "--kernel-arg", "quiet"]);
        let compare =
            Cli::try_parse_from(["bench", "--compare", "a.json", "b.json", "--template", "py"]);
        let sized = Cli::try_parse_from([
            "bench",
            "--template",
            "py",
            "--runs",
            "20",
            "--memory",
            "512",
        ]);

        // Assert
        for refused in [with_image, with_arg, compare] {
            let err = refused.unwrap_err().to_string();
            assert!(err.contains("cannot be used with"), "{err}");
        }
        let sized = sized.unwrap().bench;
        assert_eq!(sized.template.as_deref(), Some("py"));
        assert_eq!((sized.memory, sized.vcpus), (Some(512), None));
    }
}
