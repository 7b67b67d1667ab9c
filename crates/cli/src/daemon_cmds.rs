//! The verbs that talk to `bulkheadd` over its socket (`--socket`, `$BULKHEAD_SOCKET`, default
//! `/run/bulkhead/bulkheadd.sock`): `create`, `ls`, `exec`, `cp`, `rm`, `logs` (and `diff`,
//! `export` in `workspace_cmds`). `bulkhead run` needs no daemon.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use bulkhead_client::{
    ByteString, Client, CreateSandbox, ExecSpec, NetworkRequest, NetworkRule, SandboxInfo,
    SecretRef,
};
use bulkhead_sandbox::{Mount, Workspace};

use crate::run::closed_stdio::{check_stdout, print_stdout};
use crate::workspace_cmds::{mount_spec, workspace_spec};

/// How to reach the daemon.
#[derive(Debug, Clone, clap::Args)]
pub struct DaemonOpts {
    /// The daemon's socket.
    #[arg(long, env = "BULKHEAD_SOCKET", default_value = bulkhead_client::DEFAULT_SOCKET, value_name = "PATH")]
    socket: PathBuf,
}

impl DaemonOpts {
    pub(crate) fn client(&self) -> Client {
        Client::new(&self.socket)
    }

    /// The daemon's socket.
    pub(crate) fn socket(&self) -> &Path {
        &self.socket
    }
}

/// `bulkhead create`: boot a sandbox in the daemon and print its ID.
#[derive(Debug, clap::Args)]
pub struct CreateArgs {
    #[command(flatten)]
    daemon: DaemonOpts,
    /// Number of vCPUs [default: 1; with --template: the template's, which any other value
    /// must equal].
    #[arg(long)]
    vcpus: Option<u8>,
    /// Guest memory, MiB [default: 256; with --template: the template's, which any other value
    /// must equal].
    #[arg(long, value_name = "MIB")]
    memory: Option<u32>,
    /// Restore the sandbox from template NAME of the daemon's state directory
    /// (`<state_dir>/templates/NAME`) instead of booting it: it continues where the template's
    /// preparation left it.
    #[arg(long, value_name = "NAME", conflicts_with_all = ["kernel", "image", "disk_mib"])]
    template: Option<String>,
    /// Host CPU quota as a fraction of one CPU (e.g. 0.5).
    #[arg(long, value_name = "FRACTION", value_parser = crate::run::parse_cpu_quota)]
    cpu_quota: Option<f64>,
    /// Most host tasks (threads) of the VMM process.
    #[arg(long, value_name = "N")]
    pids_max: Option<u32>,
    /// Kernel name from the daemon's kernels directory.
    #[arg(long, value_name = "NAME")]
    kernel: Option<String>,
    /// Root filesystem image: a name from the daemon's image store (`bulkhead image ls` run
    /// with the daemon's data directory). Shared read-only; the sandbox writes to a private
    /// layer that vanishes with it.
    #[arg(long, value_name = "NAME")]
    image: Option<String>,
    /// Keep the writable layer of --image on a scratch disk of this many MiB (sparse, deleted
    /// with the sandbox) instead of in guest RAM.
    #[arg(long = "disk", value_name = "MIB", requires = "image")]
    disk_mib: Option<u64>,
    /// Environment for every command in the sandbox (repeatable).
    #[arg(short = 'e', long = "env", value_name = "K=V", value_parser = key_value)]
    env: Vec<(String, String)>,
    /// Share a project directory at /workspace: `direct` (default) read-write, or `clone`:
    /// read-only under a private writable layer (see `bulkhead diff` and `bulkhead export`).
    /// DIR must be inside one of the daemon's mount_roots.
    #[arg(long, value_name = "DIR[:direct|:clone]")]
    workspace: Option<Workspace>,
    /// Share a host directory at GUEST_DIR, read-only with `:ro` (repeatable; inside the
    /// daemon's mount_roots).
    #[arg(long = "mount", value_name = "HOST_DIR:GUEST_DIR[:ro]")]
    mounts: Vec<Mount>,
    /// The guest's hostname [default: bh-<id>].
    #[arg(long, value_name = "NAME")]
    hostname: Option<String>,
    /// Working directory of every exec that names none [default: /workspace with
    /// --workspace, else /].
    #[arg(long, value_name = "DIR")]
    workdir: Option<String>,
    /// Guest user of every exec that names none (name, uid or uid:gid) [default: root].
    #[arg(long, short = 'u', value_name = "USER")]
    user: Option<String>,
    #[command(flatten)]
    network: crate::network::NetworkArgs,
    /// Destroy the sandbox after this many seconds.
    #[arg(long, value_name = "SECS", value_parser = whole_seconds)]
    ttl: Option<u64>,
    /// Label (repeatable).
    #[arg(short = 'l', long = "label", value_name = "K=V", value_parser = key_value)]
    labels: Vec<(String, String)>,
    /// Print the sandbox as JSON instead of its ID.
    #[arg(long)]
    json: bool,
}

/// `bulkhead ls`: list the daemon's sandboxes.
#[derive(Debug, clap::Args)]
pub struct LsArgs {
    #[command(flatten)]
    daemon: DaemonOpts,
    /// Only sandboxes with this label (repeatable).
    #[arg(short = 'l', long = "label", value_name = "K=V", value_parser = key_value)]
    labels: Vec<(String, String)>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// `bulkhead exec`: run a command in a sandbox, streaming its output.
#[derive(Debug, clap::Args)]
pub struct ExecArgs {
    #[command(flatten)]
    daemon: DaemonOpts,
    /// Environment variable (repeatable; the value may be any bytes).
    #[arg(short = 'e', long = "env", value_name = "K=V",
        value_parser = clap::builder::TypedValueParser::try_map(clap::builder::OsStringValueParser::new(), crate::run::parse_env))]
    env: Vec<(String, ByteString)>,
    /// Working directory in the guest.
    #[arg(long, value_name = "DIR")]
    workdir: Option<String>,
    /// Guest user (name, uid or uid:gid).
    #[arg(long, short = 'u')]
    user: Option<String>,
    /// Kill the command after this many seconds (exit status 124).
    #[arg(long, value_name = "SECS", value_parser = timeout_secs)]
    timeout: Option<f64>,
    /// Keep stdin open: stream ours to the command for as long as it is open (no size limit).
    /// The exec still ends when the command does.
    #[arg(long = "interactive", short = 'i')]
    stdin: bool,
    /// Run the command on a pseudo-terminal (with -i: an interactive session, e.g.
    /// `exec -it ID -- bash`); our terminal goes into raw mode until it ends and its size
    /// changes are forwarded. Needs a terminal on stdin.
    #[arg(long, short = 't')]
    tty: bool,
    /// The sandbox: its ID, or a prefix of it that no other sandbox's ID starts with.
    #[arg(value_parser = clap::builder::NonEmptyStringValueParser::new())]
    id: String,
    /// The command and its arguments (any bytes: Linux argv is not UTF-8).
    #[arg(required = true, trailing_var_arg = true, value_name = "CMD",
        value_parser = clap::value_parser!(std::ffi::OsString))]
    command: Vec<std::ffi::OsString>,
}

/// `exec --timeout`: seconds as `bulkhead run --timeout` takes them (at least 0.001).
fn timeout_secs(s: &str) -> Result<f64, String> {
    crate::run::parse_positive_seconds(s).map(|d| d.as_secs_f64())
}

/// `bulkhead cp`: copy a file into (`cp FILE ID:/path`) or out of (`cp ID:/path FILE`) a
/// sandbox; with `-r`, a directory tree too.
#[derive(Debug, clap::Args)]
pub struct CpArgs {
    #[command(flatten)]
    daemon: DaemonOpts,
    /// Permission bits of the guest file when copying in (octal; not with -r, which keeps the
    /// source's modes).
    #[arg(long, value_name = "OCTAL", default_value = "644", value_parser = octal)]
    mode: u32,
    /// Copy directories recursively (as a tar stream): modes, symlinks (as links), empty
    /// directories and holes of sparse files are kept.
    #[arg(short = 'r', short_alias = 'R', long)]
    recursive: bool,
    /// Source: a local file or directory (`-` for stdin) or `ID:/path`.
    src: std::ffi::OsString,
    /// Destination: a local file or directory (`-` for stdout) or `ID:/path`.
    dst: std::ffi::OsString,
}

/// `bulkhead rm`: destroy sandboxes.
#[derive(Debug, clap::Args)]
pub struct RmArgs {
    #[command(flatten)]
    daemon: DaemonOpts,
    /// Say nothing about IDs that name no sandbox (they are gone already).
    #[arg(short, long)]
    force: bool,
    /// Sandbox IDs, or prefixes of them that no other sandbox's ID starts with.
    #[arg(required = true, value_parser = clap::builder::NonEmptyStringValueParser::new())]
    ids: Vec<String>,
}

/// `bulkhead pause`: save sandboxes' VMs in the daemon's state directory and stop them.
#[derive(Debug, clap::Args)]
pub struct PauseArgs {
    #[command(flatten)]
    daemon: DaemonOpts,
    /// Sandbox IDs, or prefixes of them that no other sandbox's ID starts with.
    #[arg(required = true, value_parser = clap::builder::NonEmptyStringValueParser::new())]
    ids: Vec<String>,
}

/// `bulkhead resume`: restore paused sandboxes.
#[derive(Debug, clap::Args)]
pub struct ResumeArgs {
    #[command(flatten)]
    daemon: DaemonOpts,
    /// Sandbox IDs, or prefixes of them that no other sandbox's ID starts with.
    #[arg(required = true, value_parser = clap::builder::NonEmptyStringValueParser::new())]
    ids: Vec<String>,
}

/// `bulkhead logs`: the VMM's output and serial console of a sandbox.
#[derive(Debug, clap::Args)]
pub struct LogsArgs {
    #[command(flatten)]
    daemon: DaemonOpts,
    /// How many lines (at most 10000).
    #[arg(long, short = 'n', default_value_t = 200)]
    lines: usize,
    /// Print the sandbox's egress log instead: one line per decision of its egress proxy.
    #[arg(long, conflicts_with = "lines")]
    egress: bool,
    /// The sandbox: its ID, or a prefix of it that no other sandbox's ID starts with.
    #[arg(value_parser = clap::builder::NonEmptyStringValueParser::new())]
    id: String,
}

fn key_value(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("`{s}` is not KEY=VALUE")),
    }
}

fn octal(s: &str) -> Result<u32, String> {
    u32::from_str_radix(s, 8).map_err(|_| format!("`{s}` is not an octal mode"))
}

/// Runs `future` on a small runtime; maps its result to the process exit status.
pub(crate) fn block_on(future: impl std::future::Future<Output = Result<u8, String>>) -> ExitCode {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build();
    let result = match runtime {
        Ok(rt) => rt.block_on(future),
        Err(e) => Err(format!("cannot start the async runtime: {e}")),
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("bulkhead: error: {e}");
            ExitCode::from(crate::EXIT_BULKHEAD_ERROR)
        }
    }
}

/// The create request of `bulkhead create`'s arguments (host paths made absolute).
fn create_spec(args: &CreateArgs) -> Result<CreateSandbox, String> {
    Ok(CreateSandbox {
        // The defaults ask for the template's sizes when there is one.
        vcpus: args.vcpus.unwrap_or(bulkhead_client::types::DEFAULT_VCPUS),
        memory_mib: args
            .memory
            .unwrap_or(bulkhead_client::types::DEFAULT_MEMORY_MIB),
        cpu_quota: args.cpu_quota,
        pids_max: args.pids_max,
        kernel: args.kernel.clone(),
        image: args.image.clone(),
        disk_mib: args.disk_mib,
        env: args.env.iter().cloned().collect(),
        ttl_s: args.ttl,
        labels: args.labels.iter().cloned().collect(),
        workspace: args.workspace.as_ref().map(workspace_spec).transpose()?,
        mounts: args
            .mounts
            .iter()
            .map(mount_spec)
            .collect::<Result<_, _>>()?,
        hostname: args.hostname.clone(),
        workdir: args.workdir.clone(),
        user: args.user.clone(),
        network: network_request(&args.network)?,
        template: args.template.clone(),
    })
}

/// The `network` of a create request for the network flags (a `--policy` file is read here,
/// by the client). Secret values are the daemon's (`[secrets]`): only names travel.
fn network_request(args: &crate::network::NetworkArgs) -> Result<Option<NetworkRequest>, String> {
    let (spec, hosts) = args.spec()?;
    let Some(spec) = spec else {
        return Ok(None);
    };
    Ok(Some(NetworkRequest {
        mode: serde_json::to_value(spec.mode)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned)),
        allow: spec.allow,
        deny: spec.deny,
        allow_cidr: spec.allow_cidr,
        rules: spec
            .rules
            .into_iter()
            .map(|r| NetworkRule {
                host: r.host,
                action: serde_json::to_value(r.action)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned)),
                methods: r.methods,
                paths: r.paths,
            })
            .collect(),
        secrets: spec
            .secrets
            .into_iter()
            .map(|s| SecretRef {
                name: s.name,
                hosts: s.hosts,
            })
            .collect(),
        hosts: hosts
            .into_iter()
            .map(|(n, a)| (n, a.iter().map(ToString::to_string).collect()))
            .collect(),
    }))
}

/// `bulkhead create`.
pub fn create(args: CreateArgs) -> ExitCode {
    block_on(async move {
        let spec = create_spec(&args)?;
        // Nobody could learn the new sandbox's ID: refuse before creating it.
        check_stdout()?;
        let client = args.daemon.client();
        let info = client.create(&spec).await.map_err(|e| e.to_string())?;
        let text = match args.json {
            true => format!("{}\n", to_json(&info)),
            false => format!("{}\n", info.id),
        };
        if let Err(e) = print_stdout(&text) {
            // The ID is lost with the output: destroy the sandbox rather than leave it behind.
            let destroyed = match client.delete(&info.id).await {
                Ok(()) => "destroyed".to_owned(),
                Err(d) => format!("not destroyed: {d}"),
            };
            return Err(format!("{e}; sandbox {} {destroyed}", info.id));
        }
        Ok(0)
    })
}

/// `bulkhead ls`.
pub fn ls(args: LsArgs) -> ExitCode {
    block_on(async move {
        let labels: BTreeMap<String, String> = args.labels.into_iter().collect();
        let list = args
            .daemon
            .client()
            .list(&labels)
            .await
            .map_err(|e| e.to_string())?;
        if args.json {
            print_stdout(&format!("{}\n", to_json(&list)))?;
            return Ok(0);
        }
        let mut text = format!(
            "{:<12}  {:<10}  {:>5}  {:>8}  {:<24}  LABELS\n",
            "ID", "STATE", "VCPUS", "MEM(MiB)", "CREATED"
        );
        for sb in &list {
            text.push_str(&row(sb));
            text.push('\n');
        }
        print_stdout(&text)?;
        Ok(0)
    })
}

fn row(sb: &SandboxInfo) -> String {
    let labels: Vec<String> = sb.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    format!(
        "{:<12}  {:<10}  {:>5}  {:>8}  {:<24}  {}",
        sb.id,
        sb.state.as_str(),
        sb.vcpus,
        sb.memory_mib,
        sb.created_at,
        labels.join(",")
    )
}

fn to_json(value: &impl serde::Serialize) -> String {
    serde_json::to_string_pretty(value).unwrap_or_default()
}

/// `bulkhead exec`: exit status as `bulkhead run` (the command's code, 128+N for signal N, 124
/// for a timeout, 125 for bulkhead's own failures).
pub fn exec(args: ExecArgs) -> ExitCode {
    block_on(async move {
        let mut spec = ExecSpec::new(args.command);
        spec.env = args.env.into_iter().collect();
        spec.cwd = args.workdir.map(ByteString::from);
        spec.user = args.user;
        spec.timeout_s = args.timeout;
        if args.stdin || args.tty {
            let attach = crate::exec_attach::Attach {
                client: args.daemon.client(),
                id: &args.id,
                stdin: args.stdin,
                tty: args.tty,
            };
            return crate::exec_attach::run(attach, spec).await;
        }
        let mut stream = args
            .daemon
            .client()
            .exec(&args.id, &spec)
            .await
            .map_err(|e| e.to_string())?;
        let mut sink = crate::exec_attach::OutputSink::new();
        loop {
            let event = stream.next_event().await.map_err(|e| e.to_string())?;
            if let Some(end) = sink.take(event) {
                return end;
            }
        }
    })
}

/// `bulkhead exec`'s exit status for how the command ended.
pub(crate) fn exit_code(exit: &bulkhead_client::ExitInfo) -> u8 {
    if exit.timed_out {
        eprintln!("bulkhead: the command timed out and was killed");
        return crate::run::EXIT_TIMEOUT;
    }
    match (exit.code, exit.signal) {
        (Some(code), _) => code.clamp(0, 255) as u8,
        (None, Some(sig)) => (128 + sig).clamp(0, 255) as u8,
        (None, None) => crate::EXIT_BULKHEAD_ERROR,
    }
}

/// `ID:/path` → (ID, /path). The path is bytes (a guest file name need not be UTF-8); the ID is
/// text without `/`.
fn remote(spec: &std::ffi::OsStr) -> Option<(&str, &[u8])> {
    let bytes = spec.as_encoded_bytes();
    let colon = bytes.iter().position(|b| *b == b':')?;
    let id = std::str::from_utf8(&bytes[..colon]).ok()?;
    let path = &bytes[colon + 1..];
    (!id.is_empty() && !id.contains('/') && path.first() == Some(&b'/')).then_some((id, path))
}

/// Why `cp SRC DST` names no single sandbox side: both do, or neither does (naming the argument
/// that looks like a sandbox path with a relative guest path).
fn sides_error(src: &std::ffi::OsStr, dst: &std::ffi::OsStr) -> String {
    if remote(src).is_some() {
        return format!(
            "SRC and DST are both sandbox paths ({} and {}): one of them must be a host path",
            src.to_string_lossy(),
            dst.to_string_lossy()
        );
    }
    let relative = |spec: &std::ffi::OsStr| {
        let text = spec.to_string_lossy();
        let looks = text.split_once(':').is_some_and(|(id, _)| {
            !id.is_empty() && !id.contains('/') && !Path::new(spec).exists()
        });
        looks.then(|| text.into_owned())
    };
    match (relative(src), relative(dst)) {
        (Some(s), _) => format!("SRC {s}: the guest path must be absolute (ID:/absolute/path)"),
        (_, Some(d)) => format!("DST {d}: the guest path must be absolute (ID:/absolute/path)"),
        _ => "exactly one of SRC and DST must be ID:/absolute/path".into(),
    }
}

/// A single-file copy's guest path as text (its API takes UTF-8 only).
fn utf8_path(path: &[u8]) -> Result<&str, String> {
    std::str::from_utf8(path).map_err(|_| {
        format!(
            "guest path {:?} is not UTF-8: copy it with bulkhead cp -r, which takes any bytes",
            String::from_utf8_lossy(path)
        )
    })
}

/// `bulkhead cp`.
pub fn cp(args: CpArgs) -> ExitCode {
    if args.recursive {
        return cp_recursive(args);
    }
    block_on(async move {
        let client = args.daemon.client();
        let (src_shown, dst_shown) = (args.src.to_string_lossy(), args.dst.to_string_lossy());
        match (remote(&args.src), remote(&args.dst)) {
            (None, Some((id, path))) => {
                let path = utf8_path(path)?;
                let data = match args.src.as_encoded_bytes() {
                    b"-" => {
                        let mut buf = Vec::new();
                        std::io::stdin().read_to_end(&mut buf).map(|_| buf)
                    }
                    _ if Path::new(&args.src).is_dir() => {
                        return Err(format!(
                            "{src_shown} is a directory (not copied): use bulkhead cp -r"
                        ))
                    }
                    _ => std::fs::read(&args.src),
                }
                .map_err(|e| format!("{src_shown}: {e}"))?;
                client
                    .write_file(id, path, args.mode, data)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(0)
            }
            (Some((id, path)), None) => {
                let path = utf8_path(path)?;
                let data = client.read_file(id, path).await.map_err(|e| {
                    let hint = if e.to_string().contains("not a regular file") {
                        " (for a directory use bulkhead cp -r)"
                    } else {
                        ""
                    };
                    format!("{e}{hint}")
                })?;
                match args.dst.as_encoded_bytes() {
                    b"-" => std::io::stdout().write_all(&data),
                    _ => std::fs::write(&args.dst, &data),
                }
                .map_err(|e| format!("{dst_shown}: {e}"))?;
                Ok(0)
            }
            _ => Err(sides_error(&args.src, &args.dst)),
        }
    })
}

/// `bulkhead cp -r`: trees as tar streams (see [`crate::cp_dir`]).
fn cp_recursive(args: CpArgs) -> ExitCode {
    block_on(async move {
        let client = args.daemon.client();
        if args.src == "-" || args.dst == "-" {
            return Err(
                "cp -r copies between paths: '-' (stdin, stdout) is for single files".into(),
            );
        }
        let result = match (remote(&args.src), remote(&args.dst)) {
            (None, Some((id, path))) => {
                let contents = crate::cp_dir::contents_of(args.src.as_encoded_bytes());
                crate::cp_dir::copy_in(&client, Path::new(&args.src), contents, id, path).await
            }
            (Some((id, path)), None) => {
                crate::cp_dir::copy_out(&client, id, path, Path::new(&args.dst)).await
            }
            _ => return Err(sides_error(&args.src, &args.dst)),
        };
        result.or_else(crate::cp_dir::CpError::into_exit)
    })
}

/// `bulkhead rm`: destroys each sandbox in turn; an ID that names none is an error (unless
/// `--force`) that does not stop the others, as `docker rm` does. The API's DELETE itself is
/// idempotent, so the ID is looked up first.
pub fn rm(args: RmArgs) -> ExitCode {
    block_on(async move {
        let client = args.daemon.client();
        let mut failed = false;
        for id in &args.ids {
            let removed = match client.get(id).await {
                Ok(info) => client.delete(&info.id).await,
                Err(e) => Err(e),
            };
            match removed {
                Ok(()) => {}
                Err(bulkhead_client::Error::Api { status: 404, .. }) if args.force => {}
                Err(e) => {
                    eprintln!("bulkhead: error: {id}: {e}");
                    failed = true;
                }
            }
        }
        Ok(if failed {
            crate::EXIT_BULKHEAD_ERROR
        } else {
            0
        })
    })
}

/// `bulkhead pause`: pauses each sandbox in turn; one that cannot be paused is an error (exit
/// status 125) that does not stop the others, as with `bulkhead rm`.
pub fn pause(args: PauseArgs) -> ExitCode {
    let client = args.daemon.client();
    block_on(each(args.ids, move |id| {
        let client = client.clone();
        async move { client.pause(&id).await.map(|_| ()) }
    }))
}

/// `bulkhead resume`: resumes each sandbox in turn, as `bulkhead pause` pauses them.
pub fn resume(args: ResumeArgs) -> ExitCode {
    let client = args.daemon.client();
    block_on(each(args.ids, move |id| {
        let client = client.clone();
        async move { client.resume(&id).await.map(|_| ()) }
    }))
}

/// Runs `act` on every ID in turn, reporting each failure on stderr; 125 when any failed.
async fn each<F, Fut>(ids: Vec<String>, act: F) -> Result<u8, String>
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = Result<(), bulkhead_client::Error>>,
{
    let mut failed = false;
    for id in ids {
        if let Err(e) = act(id.clone()).await {
            eprintln!("bulkhead: error: {id}: {e}");
            failed = true;
        }
    }
    Ok(if failed {
        crate::EXIT_BULKHEAD_ERROR
    } else {
        0
    })
}

/// `bulkhead logs`.
pub fn logs(args: LogsArgs) -> ExitCode {
    block_on(async move {
        let client = args.daemon.client();
        let text = match args.egress {
            true => client.egress_log(&args.id).await,
            false => client.logs(&args.id, args.lines).await,
        }
        .map_err(|e| e.to_string())?;
        print_stdout(&text)?;
        Ok(0)
    })
}

/// A whole number of seconds (`--ttl`).
fn whole_seconds(s: &str) -> Result<u64, String> {
    s.parse()
        .map_err(|_| format!("{s:?} is not a whole number of seconds"))
}

#[cfg(test)]
mod tests {
    use clap::{Args, Command, FromArgMatches};

    use super::*;

    fn parse_create(args: &[&str]) -> Result<CreateArgs, clap::Error> {
        let command = CreateArgs::augment_args(Command::new("create"));
        let matches =
            command.try_get_matches_from(std::iter::once("create").chain(args.iter().copied()))?;
        CreateArgs::from_arg_matches(&matches)
    }

    #[test]
    fn a_cpu_quota_must_be_a_finite_positive_number() {
        // Arrange
        let refused = ["nan", "inf", "-inf", "0", "-1", "half"];

        // Act
        let half = parse_create(&["--cpu-quota", "0.5"]).unwrap();
        let errors: Vec<_> = refused
            .iter()
            .map(|v| {
                parse_create(&[&format!("--cpu-quota={v}")])
                    .unwrap_err()
                    .kind()
            })
            .collect();

        // Assert
        assert_eq!(half.cpu_quota, Some(0.5));
        assert!(errors
            .iter()
            .all(|k| *k == clap::error::ErrorKind::ValueValidation));
    }

    #[test]
    fn an_empty_sandbox_id_is_refused_before_asking_the_daemon() {
        // Arrange
        let exec = ExecArgs::augment_args(Command::new("exec"));
        let logs = LogsArgs::augment_args(Command::new("logs"));

        // Act
        let exec_err = exec
            .try_get_matches_from(["exec", "", "echo", "x"])
            .unwrap_err();
        let logs_err = logs.try_get_matches_from(["logs", ""]).unwrap_err();

        // Assert
        assert_eq!(exec_err.kind(), clap::error::ErrorKind::InvalidValue);
        assert_eq!(logs_err.kind(), clap::error::ErrorKind::InvalidValue);
    }

    #[test]
    fn create_passes_image_and_disk_through_and_disk_needs_an_image() {
        // Arrange / Act
        let with_both =
            parse_create(&["--image", "debian", "--disk", "512"]).map(|a| create_spec(&a).unwrap());
        let image_only = parse_create(&["--image", "debian"]).map(|a| create_spec(&a).unwrap());
        let disk_only = parse_create(&["--disk", "512"]);

        // Assert
        let with_both = with_both.unwrap();
        assert_eq!(with_both.image.as_deref(), Some("debian"));
        assert_eq!(with_both.disk_mib, Some(512));
        assert_eq!(image_only.unwrap().disk_mib, None);
        let err = disk_only.expect_err("--disk without --image must fail");
        assert_eq!(err.kind(), clap::error::ErrorKind::MissingRequiredArgument);
    }

    #[test]
    fn create_from_a_template_sends_its_name_and_default_sizes_and_refuses_an_image() {
        // Arrange / Act
        let spec = parse_create(&["--template", "py"]).map(|a| create_spec(&a).unwrap());
        let sized = parse_create(&["--template", "py", "--memory", "512"])
            .map(|a| create_spec(&a).unwrap());
        let with_image = parse_create(&["--template", "py", "--image", "debian"]);

        // Assert
        let spec = spec.unwrap();
        assert_eq!(spec.template.as_deref(), Some("py"));
        assert_eq!((spec.vcpus, spec.memory_mib), (1, 256), "the template's");
        assert_eq!(sized.unwrap().memory_mib, 512);
        let err = with_image.expect_err("--template with --image must fail");
        assert_eq!(err.kind(), clap::error::ErrorKind::ArgumentConflict);
    }

    #[test]
    fn create_sends_the_workspace_and_mounts_with_absolute_host_paths() {
        // Arrange / Act
        let spec = parse_create(&[
            "--workspace",
            "proj:clone",
            "--mount",
            "/data:/data:ro",
            "--mount",
            "cache:/cache",
        ])
        .map(|a| create_spec(&a).unwrap())
        .unwrap();

        // Assert
        let cwd = std::env::current_dir().unwrap();
        let ws = spec.workspace.unwrap();
        assert_eq!(ws.path, cwd.join("proj").display().to_string());
        assert_eq!(ws.mode, bulkhead_client::WorkspaceMode::Clone);
        assert_eq!(spec.mounts.len(), 2);
        assert!(spec.mounts[0].ro && !spec.mounts[1].ro);
        assert_eq!(spec.mounts[1].host, cwd.join("cache").display().to_string());
    }

    #[test]
    fn remote_paths_need_an_id_and_an_absolute_path() {
        // Arrange / Act / Assert
        assert_eq!(remote("abc:/tmp/x".as_ref()), Some(("abc", &b"/tmp/x"[..])));
        let odd =
            <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(b"abc:/tmp/n\xffme");
        assert_eq!(remote(odd), Some(("abc", &b"/tmp/n\xffme"[..])));
        assert_eq!(remote("./local:file".as_ref()), None);
        assert_eq!(remote("abc:relative".as_ref()), None);
        assert_eq!(remote("/abs/path".as_ref()), None);
    }

    #[test]
    fn a_relative_guest_path_is_named_by_its_argument() {
        // Arrange / Act
        let dst = sides_error("/tmp".as_ref(), "abc:rel/x".as_ref());
        let src = sides_error("abc:rel".as_ref(), "/tmp/y".as_ref());
        let both = sides_error("a:/x".as_ref(), "b:/y".as_ref());
        let neither = sides_error("/tmp/a".as_ref(), "/tmp/b".as_ref());

        // Assert
        assert_eq!(
            dst,
            "DST abc:rel/x: the guest path must be absolute (ID:/absolute/path)"
        );
        assert!(src.starts_with("SRC abc:rel: "), "{src}");
        assert!(both.contains("both sandbox paths"), "{both}");
        assert_eq!(
            neither,
            "exactly one of SRC and DST must be ID:/absolute/path"
        );
    }
}
