//! `bulkhead run`: boot, wait for the agent, run the command with our stdin forwarded and its
//! output streamed, destroy the VM, exit with the command's status.

use std::ffi::OsString;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use bulkhead_protocol::client::{ExecEvent, ExecWriter, DEFAULT_TIMEOUT};
use bulkhead_protocol::{ByteString, ExecRequest, ExitStatus};
use bulkhead_sandbox::spec::new_id;
use bulkhead_sandbox::{
    ExecDefaults, FileRef, HostSettings, Mount, Recipe, ResourceLimits, Sandbox, SandboxSpec,
    Workspace,
};
use bulkhead_vmm::config::{DiskConfig, SerialOutput};
use bulkhead_vmm::vstate::kvm::host_kvm;

use crate::machine::MachineArgs;
use crate::network::{self, NetworkArgs};
use crate::{run_export, rundir};
use closed_stdio::Output;
use output::{forward_stdin, write_out};
use parse::parse_hostname;
pub(crate) use parse::{
    parse_cpu_quota, parse_env, parse_kernel_arg, parse_memory, parse_positive_seconds,
    parse_scratch_mib, parse_vcpus,
};

pub(crate) mod closed_stdio;
pub(crate) mod limits;
pub(crate) mod output;
pub(crate) mod parse;
pub(crate) mod publish;
pub(crate) mod watchdog;

/// How long a failed run waits for the VMM to end before reporting (1 s).
const VM_END_WAIT: Duration = Duration::from_secs(1);
use crate::signals::SignalRouter;

/// Exit status reported when `--timeout` expired (as coreutils `timeout` does).
pub const EXIT_TIMEOUT: u8 = 124;

/// Most vCPUs `--vcpus` accepts: the VMM's limit for this architecture (this host's
/// KVM_CAP_MAX_VCPUS, known only once /dev/kvm is open, is the VMM's check).
pub const MAX_VCPUS: u8 = bulkhead_vmm::config::MAX_VCPUS;

/// The flags of `bulkhead run` that a restore from a template cannot honour yet
/// (`--template` conflicts with each).
const TEMPLATE_CONFLICTS: [&str; 6] = [
    "kernel",
    "initrd",
    "kernel_args",
    "image",
    "scratch_mib",
    "disk_files",
];

/// Arguments of `bulkhead run`.
#[derive(Debug, clap::Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub(crate) machine: MachineArgs,
    /// Restore a clone of template NAME (`bulkhead template create`) instead of booting: the
    /// guest continues where the template's preparation left it. Its memory and vCPUs are the
    /// template's; --mount and --workspace are attached to the template's share slots (see
    /// `template create --share-slots`); the network flags give the clone a proxy of its own;
    /// what a restore cannot give yet (disks, images, another kernel) is refused.
    #[arg(
        long,
        value_name = "NAME",
        value_parser = crate::template::parse_name,
        conflicts_with_all = TEMPLATE_CONFLICTS
    )]
    pub(crate) template: Option<String>,
    /// Environment variable for the command (repeatable; the value may be any bytes).
    #[arg(short = 'e', long = "env", value_name = "K=V",
        value_parser = clap::builder::TypedValueParser::try_map(clap::builder::OsStringValueParser::new(), parse_env))]
    env: Vec<(String, ByteString)>,
    /// Working directory in the guest [default: /workspace with --workspace, else /].
    #[arg(long, value_name = "DIR")]
    workdir: Option<String>,
    /// Kill the command's whole process group after this many seconds (exit status 124). The
    /// guest agent enforces it; should the guest not report the command's end within
    /// SECS + max(5, SECS/10) seconds of its start (it stalled), bulkhead says so on stderr,
    /// destroys the VM and exits 124 as well. Without --timeout bulkhead waits as long as the
    /// command runs.
    #[arg(long, value_name = "SECS", value_parser = parse_positive_seconds)]
    timeout: Option<Duration>,
    /// User to run as in the guest (name, uid or uid:gid).
    #[arg(long, short = 'u')]
    user: Option<String>,
    /// The guest's hostname [default: bh-<sandbox id>].
    #[arg(long, value_name = "NAME", value_parser = parse_hostname)]
    hostname: Option<String>,
    /// Limit the VMM process to this fraction of one host CPU (0.5 = half a CPU; a cgroup CPU
    /// quota over a 100 ms period). Needs root: it is a cgroup limit.
    #[arg(long, value_name = "FRACTION", value_parser = parse_cpu_quota)]
    cpu_quota: Option<f64>,
    /// Limit the VMM process to this many tasks (cgroup `pids.max`). Needs root.
    #[arg(long, value_name = "N")]
    pids_max: Option<u32>,
    /// Keep the guest's serial console in this file (off by default). The default command line
    /// has `quiet`, so a good boot writes little or nothing; add `--kernel-arg loglevel=7` for
    /// the whole boot log.
    #[arg(long, value_name = "FILE")]
    pub(crate) console: Option<PathBuf>,
    /// Extra guest kernel command-line parameter, appended to the defaults (repeatable), e.g.
    /// `--kernel-arg loglevel=7` with --console to see the whole boot.
    #[arg(long = "kernel-arg", value_name = "ARG", value_parser = parse_kernel_arg)]
    kernel_args: Vec<String>,
    /// Print the cold-start phases (ms since the VMM process started) to stderr when the run
    /// ends, one line each.
    #[arg(long)]
    pub(crate) timings: bool,
    /// Root filesystem image: a name from `bulkhead image ls` or the path of an ext4 file.
    /// Shared read-only; the sandbox writes to a private layer that vanishes with it.
    #[arg(long, value_name = "NAME|PATH")]
    image: Option<String>,
    /// Keep the writable layer of --image on a scratch disk of this many MiB (sparse, deleted
    /// with the sandbox) instead of in guest RAM.
    #[arg(long = "disk", value_name = "MIB", requires = "image", value_parser = parse_scratch_mib)]
    scratch_mib: Option<u64>,
    /// Attach a raw disk image as an extra virtio-blk disk, read-only with `:ro` (repeatable;
    /// /dev/vda, /dev/vdb, ... after the image's disks).
    #[arg(long = "disk-file", value_name = "PATH[:ro]")]
    disk_files: Vec<DiskConfig>,
    /// Share a host directory with the guest at GUEST_DIR over virtio-fs, read-only with `:ro`
    /// (enforced on the host) (repeatable).
    #[arg(long = "mount", value_name = "HOST_DIR:GUEST_DIR[:ro]")]
    mounts: Vec<Mount>,
    /// Share a project directory at /workspace: `direct` (default) read-write, or `clone`:
    /// read-only under a private writable layer, so nothing the command does reaches DIR.
    #[arg(long, value_name = "DIR[:direct|:clone]")]
    workspace: Option<Workspace>,
    /// With `--workspace DIR:clone`: when the command has ended, write its changes to the
    /// workspace as a git-style patch to FILE (apply with `git apply FILE` in DIR or a copy).
    /// Paths that run code on the host implicitly are listed on stderr for review.
    #[arg(long, value_name = "FILE", conflicts_with = "export_tar")]
    pub(crate) export_patch: Option<PathBuf>,
    /// With `--workspace DIR:clone`: like --export-patch, as a tar archive of the changed files
    /// with `.bulkhead-export/deleted` and `.bulkhead-export/manifest.json`.
    #[arg(long, value_name = "FILE")]
    pub(crate) export_tar: Option<PathBuf>,
    #[command(flatten)]
    network: NetworkArgs,
    /// The value of secret NAME (`--secret NAME=HOSTS`) from file PATH instead of the environment
    /// variable NAME (one trailing newline is dropped) (repeatable).
    #[arg(long = "secret-file", value_name = "NAME=PATH")]
    secret_files: Vec<String>,
    /// Keep the egress proxy's log (JSON lines: time, host, port, method, path, decision, rule,
    /// bytes) in FILE; without it the log goes with the sandbox.
    #[arg(long = "egress-log", value_name = "FILE")]
    egress_log: Option<PathBuf>,
    /// Run the command on a pseudo-terminal (`run -it -- bash`): our terminal goes into raw
    /// mode until the command ends (Ctrl-C reaches the guest's foreground job) and its size
    /// changes are forwarded. Needs a terminal on stdin.
    #[arg(short = 't', long)]
    pub(crate) tty: bool,
    /// Publish a guest TCP port on the host, as `docker run -p` does:
    /// `[ADDR:]HOST_PORT:GUEST_PORT`, or `PORT` for the same port on both (repeatable). Each
    /// connection to the host port reaches the server on the guest's port (listening on
    /// 0.0.0.0 or 127.0.0.1) over vsock; the guest has no network device. The host side
    /// listens on 127.0.0.1 unless ADDR says otherwise (e.g. `0.0.0.0:8080:80`).
    #[arg(short = 'p', long = "publish", value_name = "[ADDR:]HOST_PORT:GUEST_PORT",
        value_parser = publish::parse)]
    pub(crate) publish: Vec<bulkhead_sandbox::ingress::PortMapping>,
    /// Accepted as `docker run -i` is: `bulkhead run` always streams stdin to the command.
    #[arg(short = 'i', long)]
    interactive: bool,
    /// The command and its arguments (any bytes: Linux argv is not UTF-8).
    #[arg(required = true, trailing_var_arg = true, value_name = "CMD",
        value_parser = clap::value_parser!(OsString))]
    command: Vec<OsString>,
}

/// Runs the command; returns the exit status for the process.
///
/// # Errors
/// A message for everything that is bulkhead's failure rather than the command's.
pub fn run(args: RunArgs) -> Result<u8, String> {
    if args.tty {
        crate::terminal::require_stdin_tty()?;
    }
    if let Some(name) = &args.template {
        return crate::template::restore::run(&args, name);
    }
    let id = new_id().map_err(|e| format!("cannot make a sandbox ID: {e}"))?;
    // Bad images, disks, shares and boot files are the user's to fix on any host: `build`
    // reports them before anything host-specific.
    let mut recipe = recipe(&args, &id)?;
    let export_to = run_export::target(
        args.export_patch.as_deref(),
        args.export_tar.as_deref(),
        recipe.config.workspace.as_ref(),
    )?;
    if let Some(console) = &args.console {
        run_export::check_output_file("the console", console)?;
    }
    limits::check_allowed(&recipe)?;
    require_bootable_kvm_for(&user_words(), &args)?;
    // This run's own directory for the sandbox's runtime files, so a signal during the boot
    // can remove them (see `signals`); removed at the end of a normal run too.
    let run_dir = rundir::create(&recipe.config.runtime_dir)?;
    recipe.config.runtime_dir = run_dir.path().to_owned();
    // The VMM's cgroup with the run's limits, if it asked for any; removed when the run ends.
    let _cgroup = limits::apply(&mut recipe)?;
    let ports = publish::bind(&args.publish)?;
    let router = SignalRouter::install(run_dir.path().to_owned())?;
    let mut sandbox = match Sandbox::start_with(&recipe.config, &recipe.storage) {
        Ok(sandbox) => sandbox,
        Err(e) => {
            router.boot_failed();
            return Err(e.to_string());
        }
    };
    let _published = match publish::serve(&sandbox, ports) {
        Ok(published) => published,
        Err(e) => {
            let _ = sandbox.destroy_timed();
            return Err(e);
        }
    };
    // With a network, the proxy's variables and the secrets' placeholders exist only now.
    let defaults = recipe.exec.clone().with_network(sandbox.egress_env());
    let request = exec_request(&args, &defaults);
    let patience = agent_patience(args.machine.boot_timeout);
    let outcome = execute(&mut sandbox, &request, &router, patience);
    let exported = match (&outcome, &export_to) {
        (Ok(Outcome::Exited(_)), Some(target)) => run_export::export(&sandbox, target),
        _ => Ok(()),
    };
    let destroyed = sandbox.destroy_timed();
    let status = outcome?;
    exported?;
    match destroyed {
        Ok(timings) if args.timings => print_timings(&timings, None),
        Ok(_) => {}
        Err(e) => eprintln!("bulkhead: warning: {e}"),
    }
    Ok(outcome_code(&status))
}

/// Runs `request` in `sandbox` as `bulkhead run` runs its command ([`run_command`]), then ends
/// the routing of signals: the command's outcome, [`Outcome::GaveUpAfterSignal`] when the run
/// gave up on the guest after a forwarded signal, or the error with how the VM ended. The
/// arrival of the first output (or exit status) is the sandbox's `first_output` phase
/// ([`Sandbox::mark_first_output`]).
pub(crate) fn execute(
    sandbox: &mut Sandbox,
    request: &ExecRequest,
    router: &SignalRouter,
    patience: Duration,
) -> Result<Outcome, String> {
    let outcome = run_command(sandbox, request, router, patience);
    match (outcome, router.command_ended()) {
        (Err(_), Some(sig)) => Ok(Outcome::GaveUpAfterSignal(sig)),
        (outcome, _) => outcome.map_err(|e| explain_vm_end(sandbox, e)),
    }
}

/// Adds to a failed run's message how the VM ended, when it ended by itself (waiting up to
/// [`VM_END_WAIT`] for the VMM), as the VMM reported it: a crashed guest explains a connection
/// that closed early.
fn explain_vm_end(sandbox: &mut Sandbox, message: String) -> String {
    match sandbox.wait_exit(VM_END_WAIT) {
        Ok(Some(end)) => format!("{message}: {end}"),
        _ => message,
    }
}

/// `--timings`: one line per phase on stderr, ms since the VMM process started; for a sandbox
/// restored from `template`, its restore's phases (`bulkhead_sandbox::phases`: no `guest_init`).
pub(crate) fn print_timings(t: &bulkhead_sandbox::Timings, template: Option<&str>) {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let what = match template {
        Some(name) => format!("restored from template {name}: "),
        None => String::new(),
    };
    eprintln!(
        "bulkhead: timings: {what}spawn {:.1} ms, agent ready {:.1} ms (since the sandbox was created)",
        ms(t.spawn),
        ms(t.ready)
    );
    let Some(phases) = t.phases else {
        eprintln!("bulkhead: timings: no phase timings (the VMM's report was unreadable)");
        return;
    };
    for (name, at) in phases.named() {
        if template.is_some() && name == "guest_init" {
            continue;
        }
        match at {
            Some(at) => eprintln!("bulkhead: phase {name:<13} {:>9.1} ms", ms(at)),
            None => eprintln!("bulkhead: phase {name:<13}         - (not reached)"),
        }
    }
    if let Some(e2e) = t.create_to_first_output() {
        eprintln!("bulkhead: create → first output {:.1} ms", ms(e2e));
    }
}

/// Fails with a one-line explanation and the test-host command line when this host's KVM cannot
/// boot a stock Linux kernel (e.g. kvm_pvm). The suggested command repeats this process's own
/// arguments (shell-quoted) and also shares the directories `shares` (besides the current one).
///
/// # Errors
/// That explanation.
pub(crate) fn require_bootable_kvm(shares: &[PathBuf]) -> Result<(), String> {
    require_kvm_or_hint(|| testhost_hint(&quoted_words(&user_words()), shares, &[]))
}

/// Like [`require_bootable_kvm`] for `bulkhead run`: the suggested command repeats `words` (the
/// user's own arguments after `bulkhead`) and also shares the directories it reads and writes
/// ([`extra_shares`]) and passes on the secrets taken from the environment ([`secrets_from_env`]).
pub(crate) fn require_bootable_kvm_for(words: &[String], args: &RunArgs) -> Result<(), String> {
    require_kvm_or_hint(|| {
        let pass = secrets_from_env(args);
        testhost_hint(&quoted_words(words), &extra_shares(args), &pass)
    })
}

/// The `--secret` names whose value comes from this process's environment (no `--secret-file`).
fn secrets_from_env(args: &RunArgs) -> Vec<&str> {
    let from_files: Vec<&str> = args
        .secret_files
        .iter()
        .filter_map(|f| network::secret_file(f).ok().map(|(name, _)| name))
        .collect();
    args.network
        .secret_names()
        .filter(|name| !from_files.contains(name))
        .collect()
}

/// `words` shell-quoted and joined by spaces.
fn quoted_words(words: &[String]) -> String {
    let quoted: Vec<String> = words.iter().map(|w| shell_quote(w)).collect();
    quoted.join(" ")
}

/// Ok when this host's KVM can boot a stock kernel; else the explanation with the test-host
/// command `hint` builds.
fn require_kvm_or_hint(hint: impl FnOnce() -> String) -> Result<(), String> {
    let kvm = host_kvm();
    if kvm.can_boot_stock_kernel() {
        return Ok(());
    }
    Err(format!(
        "{}; run bulkhead inside the nested test host instead: `{}` (see docs/testhost.md)",
        kvm.explain(),
        hint()
    ))
}

/// This process's arguments after the program name, as typed (non-UTF-8 bytes replaced).
pub(crate) fn user_words() -> Vec<String> {
    std::env::args_os()
        .skip(1)
        .map(|w: OsString| w.to_string_lossy().into_owned())
        .collect()
}

/// Host directories the test host must share too (the current directory always is, and paths
/// relative to it stay valid inside; relative paths that lead out of it are shared by their
/// absolute directory): the directories of `--workspace` and `--mount`; the
/// directories of the files it reads (`--kernel`, `--initrd`, `--disk-file`, `--image` given
/// as a path) and of those it writes (`--export-patch`, `--export-tar`, `--console`; else they
/// would be written inside the test host and lost). Each directory once, in that order; those
/// that are not [`shareable`] are left out.
fn extra_shares(args: &RunArgs) -> Vec<PathBuf> {
    let dirs = args.workspace.iter().map(|w| w.host.as_path());
    let dirs = dirs.chain(args.mounts.iter().map(|m| m.host.as_path()));
    let image_path = args
        .image
        .as_deref()
        .filter(|i| i.contains('/'))
        .map(Path::new);
    let read = [
        args.machine.kernel.as_deref(),
        args.machine.initrd.as_deref(),
        image_path,
    ];
    let read = read.into_iter().flatten();
    let read = read.chain(args.disk_files.iter().map(|d| d.path.as_path()));
    let secret_files = args
        .secret_files
        .iter()
        .filter_map(|f| network::secret_file(f).ok().map(|(_, path)| path));
    let read = read.chain(secret_files);
    let written = [&args.export_patch, &args.export_tar, &args.console];
    let written = written.into_iter().flatten().map(PathBuf::as_path);
    let file_dirs = read.chain(written).filter_map(Path::parent);
    let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("/"));
    let mut shares: Vec<PathBuf> = Vec::new();
    for dir in dirs.chain(file_dirs) {
        let dir = absolute_outside(dir, &cwd);
        if let Some(dir) = dir.filter(|d| shareable(d) && !shares.contains(d)) {
            shares.push(dir);
        }
    }
    shares
}

/// `dir` as an absolute path (a relative one resolved against `cwd`, `..` removed lexically),
/// or `None` when it lies inside `cwd`, which the test host always shares.
fn absolute_outside(dir: &Path, cwd: &Path) -> Option<PathBuf> {
    if dir.is_absolute() {
        return Some(dir.to_owned());
    }
    let mut abs = cwd.to_owned();
    for part in dir.components() {
        match part {
            std::path::Component::ParentDir => {
                abs.pop();
            }
            std::path::Component::Normal(name) => abs.push(name),
            _ => {}
        }
    }
    (!abs.starts_with(cwd)).then_some(abs)
}

/// Whether the test host can share the host directory `dir` at the same path: an absolute path
/// that is not `/` and not in the kernel's own file systems (`/dev`, `/proc`, `/sys`), which the
/// test host has itself and which must not be replaced by the host's.
fn shareable(dir: &Path) -> bool {
    let system = ["/dev", "/proc", "/sys"].iter().any(|s| dir.starts_with(s));
    dir.is_absolute() && dir != Path::new("/") && !system
}

/// Quotes `word` for a POSIX shell (`shlex`), leaving words of only safe characters bare. A
/// word with a NUL byte, which no shell word or argument can hold, is replaced by `''`.
fn shell_quote(word: &str) -> String {
    shlex::try_quote(word).map_or_else(|_| "''".to_owned(), |q| q.into_owned())
}

/// The sandbox `bulkhead run` asks for: its flags as a [`SandboxSpec`] (no labels: a run is
/// gone when it ends).
///
/// # Errors
/// A malformed network flag or policy file.
pub(crate) fn sandbox_spec(args: &RunArgs) -> Result<SandboxSpec, String> {
    let (network, extra_hosts) = args.network.spec()?;
    // Values that are not UTF-8 cannot be part of a spec (TOML/JSON text); they go into the
    // command's own environment instead (`exec_request`), which the agent applies the same way.
    let env = args
        .env
        .iter()
        .filter_map(|(k, v)| Some((k.clone(), v.to_str()?.to_owned())))
        .collect();
    Ok(SandboxSpec {
        image: args.image.as_deref().map(image_ref),
        disk_mib: args.scratch_mib,
        disk_files: args.disk_files.clone(),
        env,
        workdir: args.workdir.clone(),
        user: args.user.clone(),
        mounts: args.mounts.clone(),
        workspace: args.workspace.clone(),
        limits: ResourceLimits {
            cpu_quota: args.cpu_quota,
            pids_max: args.pids_max,
        },
        hostname: args.hostname.clone(),
        labels: Default::default(),
        kernel_args: args.kernel_args.clone(),
        network,
        extra_hosts,
        // vCPUs, memory and kernel: as every sandbox booted with these flags.
        ..args.machine.spec()
    })
}

/// `--image`: a path when it contains a slash, else a name of the image store (or, when the
/// store has none of that name, a file of that name in the working directory).
pub(crate) fn image_ref(value: &str) -> FileRef {
    match value.contains('/') {
        true => FileRef::Path(PathBuf::from(value)),
        false => FileRef::Name(value.to_owned()),
    }
}

/// This machine's settings for a run: the defaults, with `--initrd`, the boot timeout, the
/// console, the egress log and the values of `spec`'s secrets.
///
/// # Errors
/// A secret without a value.
pub(crate) fn host_settings(args: &RunArgs, spec: &SandboxSpec) -> Result<HostSettings, String> {
    let mut host = args.machine.host();
    host.secrets = network::secret_values(spec.network.as_ref(), &args.secret_files)?;
    host.egress_log.clone_from(&args.egress_log);
    if let Some(console) = &args.console {
        host.console = SerialOutput::File(console.clone());
    }
    Ok(host)
}

/// The recipe of sandbox `id` for `args` (everything checked, nothing started).
fn recipe(args: &RunArgs, id: &str) -> Result<Recipe, String> {
    let spec = sandbox_spec(args)?;
    let host = host_settings(args, &spec)?;
    bulkhead_sandbox::build(&spec, &host, id).map_err(|e| e.to_string())
}

/// The environment variables that override the default kernel, initramfs and VMM
/// ([`SandboxConfig::default`]); the command inside the test host must see them too.
const OVERRIDE_ENV: [&str; 3] = ["BULKHEAD_KERNEL", "BULKHEAD_INITRD", "BULKHEAD_VMM"];

/// The `bulkhead-testhost` command line that runs this `bulkhead` with the arguments `verb`
/// (already shell-quoted) in the nested test host: the binaries' directory, the data directory
/// and `shares` shared at the same paths, the data directory named explicitly (the test host's
/// HOME differs), the [`OVERRIDE_ENV`] variables set here passed on with their directories, and
/// the variables named in `pass` passed on by name (`-e NAME`: their values stay off the command
/// line).
fn testhost_hint(verb: &str, shares: &[PathBuf], pass: &[&str]) -> String {
    let overrides: Vec<(&str, PathBuf)> = OVERRIDE_ENV
        .iter()
        .filter_map(|key| std::env::var_os(key).map(|v| (*key, PathBuf::from(v))))
        .filter(|(_, path)| !path.as_os_str().is_empty())
        .collect();
    testhost_hint_with(verb, shares, &overrides, pass)
}

/// [`testhost_hint`] with the environment overrides `env` (name, path) given.
/// bulkhead's runtime directory inside the test host when the hint shares `/tmp`: a directory of
/// the test host's own root file system.
const TESTHOST_RUNTIME_DIR: &str = "/var/lib/bulkhead-run";

fn testhost_hint_with(
    verb: &str,
    shares: &[PathBuf],
    env: &[(&str, PathBuf)],
    pass: &[&str],
) -> String {
    let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("bulkhead"));
    let bin_dir = exe.parent().unwrap_or(Path::new("/")).to_owned();
    let data = bulkhead_sandbox::paths::data_dir();
    let path = |p: &Path| shell_quote(&p.to_string_lossy());
    let env_dirs = env.iter().filter_map(|(_, p)| p.parent());
    let mut dirs: Vec<&Path> = Vec::new();
    for dir in env_dirs.chain(shares.iter().map(PathBuf::as_path)) {
        let covered = dir.starts_with(&bin_dir) || dir.starts_with(&data);
        if shareable(dir) && !covered && !dirs.contains(&dir) {
            dirs.push(dir);
        }
    }
    let extra: String = dirs
        .iter()
        .map(|d| format!("--share {} ", path(d)))
        .collect();
    // A share over the test host's /tmp would put bulkhead's default runtime directory there
    // (`/tmp/bulkhead-<uid>`), on a 9p share, which cannot hold the VM's Unix sockets.
    let tmp_shared = dirs.iter().any(|d| Path::new("/tmp").starts_with(d));
    let runtime = tmp_shared.then(|| format!("-e BULKHEAD_RUNTIME_DIR={TESTHOST_RUNTIME_DIR} "));
    let env_args: String = env
        .iter()
        .map(|(key, value)| format!("-e {} ", shell_quote(&format!("{key}={}", value.display()))))
        .chain(pass.iter().map(|name| format!("-e {} ", shell_quote(name))))
        .chain(runtime)
        .collect();
    format!(
        "bulkhead-testhost run --share {bin} --share {data} {extra}-e BULKHEAD_DATA_DIR={data} {env_args}-- {exe} {verb}",
        bin = path(&bin_dir),
        data = path(&data),
        exe = path(&exe)
    )
}

/// The command's request: the sandbox's command defaults ([`ExecDefaults::request`]) with our
/// stdin forwarded, `--timeout`, and the end of `docker run`.
pub(crate) fn exec_request(args: &RunArgs, defaults: &ExecDefaults) -> ExecRequest {
    let bytes_only = args
        .env
        .iter()
        .filter(|(_, v)| v.to_str().is_none())
        .cloned()
        .collect();
    let mut request = defaults.request(args.command.clone(), &bytes_only, None, None);
    request.stdin = true;
    request.tty = args.tty;
    request.window = args.tty.then(crate::terminal::size).flatten();
    request.timeout_ms = args
        .timeout
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    // Like `docker run`: the run ends with the command; its leftover background processes die
    // (with the VM, which is destroyed right after anyway) instead of holding the output open.
    // (A daemon exec is `docker exec`: it waits for every holder of the output; docs/daemon.md.)
    request.kill_group_on_exit = true;
    request
}

/// How long connecting to the agent and each blocking read or write of the exec request may
/// take (not the wait for the command's output): the boot timeout (`--boot-timeout`, seconds
/// on the command line), and never less than the client's default [`DEFAULT_TIMEOUT`] (10 s).
/// A guest that has just announced itself on a loaded or nested host can need far longer than
/// 10 s to answer, and `--boot-timeout` is how long the user agreed to wait for the guest.
pub(crate) fn agent_patience(boot_timeout: Duration) -> Duration {
    boot_timeout.max(DEFAULT_TIMEOUT)
}

/// How the command's run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// The agent reported the command's end.
    Exited(ExitStatus),
    /// The host-side watchdog gave up on the guest (see [`watchdog`]).
    Abandoned,
    /// The command did not end within [`crate::signals::STOP_GRACE`] of this forwarded signal.
    GaveUpAfterSignal(i32),
}

/// Runs `request` in `sandbox` with our stdin forwarded (when it asks for stdin) and its
/// output streamed; connecting
/// and each blocking read or write of the request may take up to `patience`. With a timeout in
/// `request`, the host-side [`watchdog`] bounds the wait for the command's end.
fn run_command(
    sandbox: &Sandbox,
    request: &ExecRequest,
    router: &SignalRouter,
    patience: Duration,
) -> Result<Outcome, String> {
    let session = sandbox
        .client()
        .with_timeout(patience)
        .exec(request)
        .map_err(|e| e.to_string())?;
    let (writer, mut reader) = session.split();
    let watchdog = watched_timeout(request).map(|t| arm_watchdog(t, &writer, sandbox));
    router.command_started(writer.clone());
    let signaller = writer.clone();
    let _terminal = match request.tty {
        true => Some(crate::terminal::session(&writer)?),
        false => None,
    };
    if request.stdin {
        forward_stdin(writer);
    }
    let mut stdout = Output::stdout();
    let mut stderr = Output::stderr();
    let mut lost: Option<io::Error> = None;
    let mut pipe_signalled = false;
    loop {
        let event = reader.next_event();
        if ends_run(&event) && watchdog.as_ref().is_some_and(|w| !w.disarm()) {
            return Ok(Outcome::Abandoned);
        }
        let event = event.map_err(|e| e.to_string())?;
        sandbox.mark_first_output();
        match event {
            Some(ExecEvent::Stdout(bytes)) => {
                let gone = write_out(&mut stdout, &bytes, &mut lost);
                if gone && !pipe_signalled {
                    // As on a local pipe, a writer whose reader went away gets SIGPIPE.
                    pipe_signalled = true;
                    let _ = signaller.signal(libc::SIGPIPE);
                }
            }
            Some(ExecEvent::Stderr(bytes)) => {
                write_out(&mut stderr, &bytes, &mut lost);
            }
            Some(ExecEvent::Exit(status)) => {
                let _ = stdout.flush();
                return match lost {
                    Some(e) => Err(format!("writing the command's output failed: {e}")),
                    None => Ok(Outcome::Exited(status)),
                };
            }
            None => {
                return Err("the guest agent closed the connection without an exit status".into())
            }
        }
    }
}

/// Whether `event` is the last one of the run: the command's end, an error, or none.
fn ends_run<E>(event: &Result<Option<ExecEvent>, E>) -> bool {
    !matches!(event, Ok(Some(ExecEvent::Stdout(_) | ExecEvent::Stderr(_))))
}

/// The timeout the watchdog enforces from the host: the request's (`--timeout`), if any.
fn watched_timeout(request: &ExecRequest) -> Option<Duration> {
    request.timeout_ms.map(Duration::from_millis)
}

/// A [`watchdog::Watchdog`] that gives up on the guest [`watchdog::limit`] after now, for a
/// `--timeout` of `timeout`: it prints [`watchdog::message`] and cuts the connection behind
/// `writer` off ([`watchdog::cut_off`], with `sandbox`'s VMM as the last resort).
fn arm_watchdog(timeout: Duration, writer: &ExecWriter, sandbox: &Sandbox) -> watchdog::Watchdog {
    let (writer, vmm) = (writer.clone(), sandbox.vmm_pidfd().ok());
    watchdog::Watchdog::arm(watchdog::limit(timeout), move || {
        // Not eprintln!: with stderr a closed pipe it would panic this thread before the cut-off.
        let _ = writeln!(io::stderr(), "{}", watchdog::message(timeout));
        watchdog::cut_off(writer, vmm);
    })
}

/// The process exit status for how the run ended: the command's status, [`EXIT_TIMEOUT`] (124)
/// when the watchdog gave up on the guest, 128+N when the run gave up after signal N.
pub(crate) fn outcome_code(outcome: &Outcome) -> u8 {
    match outcome {
        Outcome::Exited(status) => exit_code(status),
        Outcome::Abandoned => EXIT_TIMEOUT,
        Outcome::GaveUpAfterSignal(sig) => u8::try_from(128 + sig).unwrap_or(u8::MAX),
    }
}

/// The process exit status for the command's status.
fn exit_code(status: &ExitStatus) -> u8 {
    if status.timed_out {
        eprintln!("bulkhead: the command timed out and was killed");
        return EXIT_TIMEOUT;
    }
    status
        .shell_code()
        .map_or(crate::EXIT_BULKHEAD_ERROR, |c| c.clamp(0, 255) as u8)
}

#[cfg(test)]
pub(crate) mod tests;

#[cfg(test)]
mod sameness_tests;
