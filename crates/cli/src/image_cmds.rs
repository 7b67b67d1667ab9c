//! `bulkhead image build | ls | rm`: root filesystem images in the image store
//! (`<data dir>/images/<name>/`, see `bulkhead-image`).

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use bulkhead_image::{BuildSpec, ImageStore, Manifest, Phase, Progress};
use indicatif::{ProgressBar, ProgressStyle};

use crate::run::closed_stdio::print_stdout;

/// Ticks of the progress bar for a whole build (fractions are reported in 0.0–1.0).
const BAR_TICKS: u64 = 1000;

/// Longest progress message shown next to the bar, in characters.
const MESSAGE_WIDTH: usize = 60;

/// Arguments of `bulkhead image`.
#[derive(Debug, clap::Args)]
pub struct ImageArgs {
    #[command(subcommand)]
    command: ImageCommand,
}

#[derive(Debug, clap::Subcommand)]
enum ImageCommand {
    /// Build a root filesystem image (needs root, network, and a few minutes).
    #[command(allow_negative_numbers = true)]
    Build(BuildArgs),
    /// List the images in the store.
    Ls(LsArgs),
    /// Delete an image from the store.
    Rm(RmArgs),
}

/// The distributions `image build` knows.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Distro {
    /// Debian bookworm, bootstrapped with mmdebstrap.
    Debian,
}

#[derive(Debug, clap::Args)]
struct BuildArgs {
    /// What to build.
    #[arg(value_enum)]
    distro: Distro,
    /// Image name in the store [default: the distribution's name].
    #[arg(long)]
    name: Option<String>,
    /// Packages to install on top of the defaults (python3, git, bash, coreutils,
    /// ca-certificates, curl, procps, mount), comma-separated; repeatable.
    #[arg(long, value_name = "P1,P2", value_delimiter = ',')]
    packages: Vec<String>,
    /// Install only the packages given with --packages (plus Debian's essential set and apt).
    #[arg(long)]
    no_default_packages: bool,
    /// Image size in MiB [default: the content plus a small headroom].
    #[arg(long, value_name = "MIB")]
    size: Option<u32>,
    /// Debian suite.
    #[arg(long, default_value = bulkhead_image::DEFAULT_SUITE)]
    suite: String,
    /// Debian mirror URL [default: Debian's own mirrors, with security updates].
    #[arg(long, value_name = "URL")]
    mirror: Option<String>,
    /// Guest agent binary to install [default: $BULKHEAD_AGENT, else the musl release build
    /// next to this bulkhead binary, else bulkhead-agent next to it].
    #[arg(long, value_name = "PATH")]
    agent: Option<PathBuf>,
    /// Do not install missing build tools (mmdebstrap, e2fsprogs) with apt-get.
    #[arg(long)]
    no_install_tools: bool,
}

#[derive(Debug, clap::Args)]
struct LsArgs {
    /// Print the manifests as a JSON array.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
struct RmArgs {
    /// The image's name.
    name: String,
}

/// Runs `bulkhead image ...`; errors exit with 125, as everywhere in the CLI.
pub fn image(args: ImageArgs) -> ExitCode {
    let store = store();
    let result = match args.command {
        ImageCommand::Build(args) => build(&store, args),
        ImageCommand::Ls(args) => ls(&store, &args),
        ImageCommand::Rm(args) => rm(&store, &args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bulkhead: error: {e}");
            ExitCode::from(crate::EXIT_BULKHEAD_ERROR)
        }
    }
}

/// The image store in bulkhead's data directory (the same one `bulkhead run` reads).
pub fn store() -> ImageStore {
    ImageStore::new(bulkhead_sandbox::paths::data_dir())
}

fn build(store: &ImageStore, args: BuildArgs) -> Result<(), String> {
    let Distro::Debian = args.distro;
    let agent = match args.agent.clone() {
        Some(path) => path,
        None => default_agent().ok_or(
            "no guest agent binary found; build it with `cargo build --release --target \
             x86_64-unknown-linux-musl -p bulkhead-agent` or pass --agent PATH",
        )?,
    };
    let spec = build_spec(&args, agent);
    spec.validate().map_err(|e| e.to_string())?;
    if !args.no_install_tools {
        install_missing_tools()?;
    }
    eprintln!(
        "bulkhead: building image {:?} (Debian {}, agent {})",
        spec.name,
        spec.suite,
        spec.agent_binary.display()
    );
    let started = Instant::now();
    let mut reporter = Reporter::new();
    let result = store.build(&spec, &mut |p| reporter.report(&p));
    reporter.finish();
    let manifest = result.map_err(|e| e.to_string())?;
    eprintln!(
        "bulkhead: image {} built in {:.0} s: {} MiB, sha256 {}",
        manifest.name,
        started.elapsed().as_secs_f64(),
        manifest.size_bytes >> 20,
        manifest.sha256
    );
    Ok(())
}

fn build_spec(args: &BuildArgs, agent: PathBuf) -> BuildSpec {
    let name = args.name.clone().unwrap_or_else(|| "debian".to_owned());
    let mut spec = BuildSpec::new(name, agent);
    if args.no_default_packages {
        spec.packages.clear();
    }
    for package in &args.packages {
        if !package.is_empty() && !spec.packages.contains(package) {
            spec.packages.push(package.clone());
        }
    }
    spec.size_mib = args.size;
    spec.suite = args.suite.clone();
    spec.mirror = args.mirror.clone();
    spec
}

/// `$BULKHEAD_AGENT`, else the static (musl) release build of the agent in the cargo target
/// directory this bulkhead binary was built into, else `bulkhead-agent` next to it.
fn default_agent() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("BULKHEAD_AGENT").filter(|v| !v.is_empty()) {
        return Some(PathBuf::from(path));
    }
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    let musl = format!("{}-unknown-linux-musl", std::env::consts::ARCH);
    let mut candidates = Vec::new();
    if let Some(target) = dir.parent() {
        candidates.push(target.join(musl).join("release/bulkhead-agent"));
    }
    candidates.push(dir.join("bulkhead-agent"));
    candidates.into_iter().find(|p| p.is_file())
}

/// Installs mmdebstrap and e2fsprogs with apt-get when their programs are missing (as root
/// only: otherwise the build's own check names the package to install).
fn install_missing_tools() -> Result<(), String> {
    let missing: Vec<&str> = [("mmdebstrap", "mmdebstrap"), ("mkfs.ext4", "e2fsprogs")]
        .into_iter()
        .filter(|(tool, _)| !in_path(tool))
        .map(|(_, package)| package)
        .collect();
    // SAFETY: geteuid takes no arguments and cannot fail.
    if missing.is_empty() || unsafe { libc::geteuid() } != 0 {
        return Ok(());
    }
    eprintln!("bulkhead: installing {} with apt-get", missing.join(" "));
    let status = Command::new("apt-get")
        .args(["install", "-y", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status()
        .map_err(|e| format!("running apt-get: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!(
            "apt-get install {} failed ({status}); run `apt-get update` and retry",
            missing.join(" ")
        ))
    }
}

fn in_path(tool: &str) -> bool {
    bulkhead_image::ext4::tool_path()
        .split(':')
        .any(|dir| Path::new(dir).join(tool).is_file())
}

/// Shows build progress: a bar on a terminal, one line per stage and per mmdebstrap status
/// line otherwise (logs, CI).
struct Reporter {
    bar: Option<ProgressBar>,
    phase: Option<Phase>,
}

impl Reporter {
    fn new() -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new(BAR_TICKS);
            let style = ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] [{bar:30}] {percent:>3}% {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ");
            bar.set_style(style);
            bar.enable_steady_tick(Duration::from_millis(200));
            bar
        });
        Self { bar, phase: None }
    }

    fn report(&mut self, p: &Progress) {
        let new_phase = self.phase != Some(p.phase);
        self.phase = Some(p.phase);
        match &self.bar {
            Some(bar) => {
                if let Some(fraction) = p.fraction {
                    bar.set_position((f64::from(fraction.clamp(0.0, 1.0)) * 1000.0) as u64);
                }
                bar.set_message(shorten(&p.message));
            }
            None if new_phase || p.message.starts_with("I: ") || p.message.starts_with("E: ") => {
                eprintln!("bulkhead: [{:?}] {}", p.phase, p.message);
            }
            None => {}
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

fn shorten(message: &str) -> String {
    let mut chars = message.chars();
    let short: String = chars.by_ref().take(MESSAGE_WIDTH).collect();
    if chars.next().is_some() {
        format!("{short}…")
    } else {
        short
    }
}

fn ls(store: &ImageStore, args: &LsArgs) -> Result<(), String> {
    let manifests = store.list().map_err(|e| e.to_string())?;
    if args.json {
        let json = serde_json::to_string_pretty(&manifests).map_err(|e| e.to_string())?;
        return print_stdout(&format!("{json}\n"));
    }
    print_stdout(&ls_table(&manifests))
}

/// The `image ls` table: name, size, creation time, short sha256 and packages.
fn ls_table(manifests: &[Manifest]) -> String {
    let mut out = format!(
        "{:<16} {:>9} {:<20} {:<12} PACKAGES\n",
        "NAME", "SIZE", "CREATED", "SHA256"
    );
    for m in manifests {
        out.push_str(&format!(
            "{:<16} {:>5} MiB {:<20} {:<12} {}\n",
            m.name,
            m.size_bytes >> 20,
            m.created,
            m.sha256.get(..12).unwrap_or(&m.sha256),
            m.packages.join(",")
        ));
    }
    out
}

fn rm(store: &ImageStore, args: &RmArgs) -> Result<(), String> {
    let manifest = store.remove(&args.name).map_err(|e| e.to_string())?;
    print_stdout(&format!("removed image {}\n", manifest.name))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        image: ImageArgs,
    }

    fn build_args(argv: &[&str]) -> BuildArgs {
        let cli = Cli::try_parse_from(std::iter::once("image").chain(argv.iter().copied()))
            .expect("parses");
        match cli.image.command {
            ImageCommand::Build(args) => args,
            other => panic!("not a build: {other:?}"),
        }
    }

    #[test]
    fn extra_packages_are_added_to_the_defaults() {
        // Arrange
        let args = build_args(&["build", "debian", "--packages", "jq,git", "--size", "900"]);

        // Act
        let spec = build_spec(&args, PathBuf::from("/agent"));

        // Assert
        assert_eq!(spec.name, "debian");
        assert_eq!(spec.size_mib, Some(900));
        for p in [
            "python3",
            "git",
            "bash",
            "coreutils",
            "ca-certificates",
            "jq",
        ] {
            assert!(spec.packages.iter().any(|q| q == p), "{p} missing");
        }
        assert_eq!(spec.packages.iter().filter(|p| *p == "git").count(), 1);
    }

    #[test]
    fn no_default_packages_keeps_only_the_given_ones() {
        // Arrange
        let args = build_args(&[
            "build",
            "debian",
            "--name",
            "tiny",
            "--no-default-packages",
            "--packages",
            "jq",
        ]);

        // Act
        let spec = build_spec(&args, PathBuf::from("/agent"));

        // Assert
        assert_eq!(spec.name, "tiny");
        assert_eq!(spec.packages, ["jq"]);
    }

    #[test]
    fn unknown_distributions_are_refused_by_the_parser() {
        // Arrange / Act
        let result = Cli::try_parse_from(["image", "build", "fedora"]);

        // Assert
        assert!(result.is_err());
    }

    #[test]
    fn ls_table_lists_each_image_on_one_line() {
        // Arrange
        let manifest = Manifest {
            name: "debian".into(),
            size_bytes: 300 << 20,
            sha256: "ab".repeat(32),
            created: "2025-01-31T12:00:00Z".into(),
            suite: "bookworm".into(),
            packages: vec!["python3".into(), "git".into()],
            builder_version: "0.1.0".into(),
            mirror: None,
        };

        // Act
        let table = ls_table(&[manifest]);

        // Assert
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 2);
        assert!(lines[1].starts_with("debian"), "{table}");
        assert!(lines[1].contains("300 MiB") && lines[1].contains("abababababab"));
        assert!(lines[1].ends_with("python3,git"), "{table}");
    }
}
