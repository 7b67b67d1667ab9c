//! The harness behind bulkhead's guest-level integration tests.
//!
//! A guest test is an ordinary `#[test]` whose body boots real guests. [`in_vm_host`] decides where
//! the body runs:
//!
//! - on a host whose KVM can boot a stock Linux kernel (hardware-assisted KVM, detected from
//!   `/sys/module`, or inside the test host itself), the body runs right here;
//! - otherwise (e.g. this project's build machines, whose `/dev/kvm` is kvm_pvm) the test binary
//!   re-runs *this one test* inside the nested test host ([`bulkhead_testhost`]) and reports its
//!   result. A test process boots up to two test hosts (one per CPU, [`hosts`]) and shares them
//!   among its tests.
//!
//! The test host mounts the workspace's `target/` directory and bulkhead's data directory at the
//! same paths, so the test binary, the binaries under test, kernels and scratch files have the same
//! absolute paths in both places.
#![deny(missing_docs)]

use std::env;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use bulkhead_testhost::{CommandOutput, Error as TestHostError};
use bulkhead_vmm::vstate::kvm::host_kvm;

mod artifacts;
pub mod bench;
pub mod containerd;
pub mod hostcheck;
mod hosts;
pub mod procs;
pub mod pty;
pub mod python;
pub mod readonly;
pub mod tree;

pub use artifacts::{artifacts, kernel_without_vsock, Artifacts};
pub use hosts::count as test_host_count;

/// Set in the environment of a test re-run inside the test host.
const INNER_ENV: &str = "BULKHEAD_IN_TESTHOST";
/// Longest a single delegated test may take inside the test host.
/// (The slowest test takes ~4 min in a loaded test host.)
const INNER_TIMEOUT: Duration = Duration::from_secs(600);

/// Runs `body` where guests can boot: here, or inside one of the shared test hosts, beside
/// other tests.
///
/// `test_name` is the test's path as libtest names it (`module::test`); use the [`guest_test!`]
/// macro rather than calling this directly.
///
/// # Panics
/// When the body panics (here or in the test host), or when the test host cannot be started.
pub fn in_vm_host(test_name: &str, body: impl FnOnce()) {
    in_vm_host_as(test_name, false, body);
}

/// [`in_vm_host`] for a test that needs a whole test host (many guests at once, a CPU or memory
/// measurement): delegated, it runs in a test host that runs nothing else meanwhile.
///
/// # Panics
/// As [`in_vm_host`].
pub fn in_vm_host_alone(test_name: &str, body: impl FnOnce()) {
    in_vm_host_as(test_name, true, body);
}

fn in_vm_host_as(test_name: &str, alone: bool, body: impl FnOnce()) {
    let args = ["--exact", test_name, "--nocapture", "--test-threads=1"];
    let Some(stdout) = here_or_delegated(&args, alone, body) else {
        return;
    };
    assert!(
        stdout.contains("1 passed"),
        "{test_name} did not run in the test host:\n{stdout}"
    );
}

/// Runs `body` here when guests can boot here; otherwise re-runs the current executable with
/// `args` inside the shared test host and returns its stdout.
///
/// # Panics
/// When the re-run fails (non-zero status), with its output.
pub fn run_here_or_delegate(args: &[&str], body: impl FnOnce()) -> Option<String> {
    here_or_delegated(args, false, body)
}

/// [`run_here_or_delegate`], delegated to a test host of its own with `alone`.
fn here_or_delegated(args: &[&str], alone: bool, body: impl FnOnce()) -> Option<String> {
    if env::var_os(INNER_ENV).is_some() || host_kvm().can_boot_stock_kernel() {
        body();
        return None;
    }
    let started = std::time::Instant::now();
    let run = || {
        run_in_test_host(&inner_script(args), args, alone)
            .unwrap_or_else(|e| panic!("running {args:?} in the test host failed: {e}"))
    };
    let (mut out, mut host) = run();
    if let Some(how) = nested_guest_failed(&out) {
        log_uncaptured(&format!(
            "RETRY: a nested guest {how} under {args:?} (known test-host problem, see \
             docs/testhost.md, \"Known problems\"); running it once more:\n{}\n",
            String::from_utf8_lossy(&out.stdout)
        ));
        (out, host) = run();
    }
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    report_guest_boots(args, &stdout, host, started.elapsed());
    assert!(
        out.status == 0,
        "{args:?} failed in the test host (status {}):\n--- stdout\n{stdout}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Some(stdout)
}

/// How a failed delegated test's nested guest failed, when it reports one of the test host's
/// known guest failures (docs/testhost.md, "Known problems"): a guest crash (the VMM's "the
/// guest crashed", its triple-fault warning, a reset after a kernel panic message on the
/// console, or a [`CRASH_MARKER`] line: a VMM of the test logged a crash or a console panic to
/// the boot log), or a guest whose agent never became ready within the boot timeout (under
/// load, such as twenty guests booting at once, a nested guest sometimes stalls in the emulator
/// for good). Such a test is run once more; one that fails twice still fails, and a test that
/// expects a timeout passes and is never retried. (The tests' guests are ours: their console is
/// evidence here, as it never is for a host's report.)
fn nested_guest_failed(out: &CommandOutput) -> Option<&'static str> {
    if out.status == 0 {
        return None;
    }
    let text: String = [&out.stdout, &out.stderr]
        .iter()
        .map(|bytes| String::from_utf8_lossy(bytes))
        .collect();
    let crashed = text.contains("the guest crashed")
        || text.contains("KVM_EXIT_SHUTDOWN")
        || text.contains("showed a kernel panic message");
    if crashed {
        Some("crashed")
    } else if text.contains("the guest agent was not ready within") {
        Some("never became ready")
    } else {
        None
    }
}

/// File inside the test host (its own tmpfs, so it lives as long as that test host) to which every
/// `bulkhead-vmm` appends a line per boot (`BULKHEAD_BOOT_LOG`).
const BOOT_LOG: &str = "/tmp/bulkhead-harness-boots.log";
/// Prefix of the lines the inner script prints after the test for each guest that crashed or
/// showed a kernel panic on its console during it: `<prefix> pid=<vmm pid> crashed: <how>` or
/// `<prefix> pid=<vmm pid> console-panic: <text>` (the VMM's boot-log lines).
const CRASH_MARKER: &str = "bulkhead-harness: the guest crashed:";
/// Prefix of the line the inner script prints after the test: `<prefix> <this run> <total>`.
const BOOTS_MARKER: &str = "bulkhead-harness: guest boots:";

/// Prints, straight to the process's stderr (libtest does not capture it, so it shows in CI
/// logs), how many guests the delegated run booted (and how many of them crashed or showed a
/// kernel panic, from the boot log's lines) and how many the current test host has booted in all:
/// the evidence that one test-host boot serves many guest boots, and the counts
/// `scripts/test.sh` sums up. `host` is the number of the test host that ran it, `elapsed` the
/// delegated run's wall time (with a retry and, for a host's first test, its boot), which the
/// summary ranks.
fn report_guest_boots(args: &[&str], stdout: &str, host: usize, elapsed: Duration) {
    let Some(counts) = stdout
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix(BOOTS_MARKER))
    else {
        return;
    };
    let mut counts = counts.split_whitespace();
    let (this_run, total) = (counts.next().unwrap_or("?"), counts.next().unwrap_or("?"));
    let name = args.get(1).copied().unwrap_or("?");
    let crashed = stdout
        .lines()
        .filter(|l| l.starts_with(CRASH_MARKER))
        .count();
    let crashes = match crashed {
        0 => String::new(),
        n => format!(" ({n} crashed)"),
    };
    let silence_ms = LONGEST_SILENCE_MS.load(std::sync::atomic::Ordering::Relaxed);
    let line = format!(
        "guest boots: {this_run} in {name} ({:.1} s){crashes}; {total} so far in test host #{}; \
         longest heartbeat gap {:.1} s\n",
        elapsed.as_secs_f64(),
        host,
        silence_ms as f64 / 1000.0
    );
    log_uncaptured(&line);
}

/// Writes `text` to stderr past libtest's output capture (which `eprintln!` goes through, and
/// which drops a passing test's output), so the test log keeps it for `scripts/test.sh`'s counts.
fn log_uncaptured(text: &str) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(text.as_bytes());
}

/// The longest heartbeat gap of any live test host of this process so far, ms
/// ([`TestHost::longest_silence`]): how close a healthy test host came to being declared frozen.
static LONGEST_SILENCE_MS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The path of test function `name` as libtest lists it in the calling test binary
/// (`module::test`, the crate's name left out): what [`in_vm_host`] re-runs with `--exact`
/// inside the test host.
#[macro_export]
macro_rules! test_path {
    ($name:ident) => {{
        let path = concat!(module_path!(), "::", stringify!($name));
        path.split_once("::").map_or(path, |(_, rest)| rest)
    }};
}

/// Declares a guest-level test: `guest_test!(fn name() { ... })` runs the body through
/// [`in_vm_host`].
#[macro_export]
macro_rules! guest_test {
    ($(#[$meta:meta])* fn $name:ident() $body:block) => {
        $(#[$meta])*
        #[test]
        fn $name() {
            $crate::in_vm_host($crate::test_path!($name), || $body);
        }
    };
}

/// The shell script that re-runs this executable with `args` inside the test host.
fn inner_script(args: &[&str]) -> String {
    let exe = env::current_exe().expect("current test executable");
    let home = env::var("HOME").unwrap_or_else(|_| "/root".into());
    let data = artifacts::data_home();
    // Settings for the inner run (bench counts, log filters) pass through.
    let passthrough: String = env::vars()
        .filter(|(k, v)| {
            k.starts_with("BULKHEAD_") && k != "BULKHEAD_BOOT_LOG" && !v.contains('\'')
        })
        .map(|(k, v)| format!(" {k}='{v}'"))
        .collect();
    // The test's status is the script's. The guests that crashed during the test (the boot log's
    // `crashed:` and `console-panic:` lines since it started) are printed for
    // `nested_guest_failed`, and the boot
    // counts (its `kernel=` lines: this test's, all) on the last line for `report_guest_boots`.
    format!(
        "export {INNER_ENV}=1 HOME='{home}' XDG_DATA_HOME='{}' RUST_BACKTRACE=1 PATH=/usr/sbin:/usr/bin:/sbin:/bin BULKHEAD_BOOT_LOG={BOOT_LOG}{passthrough}\n\
         {}\
         cd '{}'\n\
         before=$(cat {BOOT_LOG} 2>/dev/null | wc -l)\n\
         '{}' {}\n\
         rc=$?\n\
         tail -n +$((before + 1)) {BOOT_LOG} 2>/dev/null | grep -E ' (crashed|console-panic): ' | sed 's/^/{CRASH_MARKER} /'\n\
         boots=$(tail -n +$((before + 1)) {BOOT_LOG} 2>/dev/null | grep -c ' kernel=')\n\
         total=$(cat {BOOT_LOG} 2>/dev/null | grep -c ' kernel=')\n\
         echo \"{BOOTS_MARKER} $boots $total\"\n\
         exit $rc\n",
        data.display(),
        target_link_line(),
        workspace_root().display(),
        exe.display(),
        args.iter().map(|a| format!("'{a}'")).collect::<Vec<_>>().join(" "),
    )
}

/// Runs `script` in one of the shared test hosts ([`hosts::lease`], one of its own with
/// `alone`); returns its output and the
/// number of the host that ran it. When the test host itself dies under the command (its
/// kernel panicked, QEMU exited, the control channel broke), or the command hangs past
/// [`INNER_TIMEOUT`] (seen rarely: a nested guest stalled inside the emulated test host, under
/// multi-threaded TCG), the command runs once more in a freshly booted test host and the first
/// failure is printed. A test that fails, or hangs twice, still fails.
fn run_in_test_host(
    script: &str,
    args: &[&str],
    alone: bool,
) -> Result<(CommandOutput, usize), TestHostError> {
    let mut lease = hosts::lease(alone);
    let mut retries = 0;
    loop {
        let result = lease.host().run(script, INNER_TIMEOUT);
        let silence = u64::try_from(lease.host().longest_silence().as_millis()).unwrap_or(u64::MAX);
        LONGEST_SILENCE_MS.fetch_max(silence, std::sync::atomic::Ordering::Relaxed);
        match result {
            Err(e) if retry_allowed(&e, retries) => {
                retries += 1;
                log_uncaptured(&format!(
                    "RETRY: the test host failed under {args:?} ({e}); retrying in a new one\n"
                ));
                lease.replace();
            }
            result => return result.map(|out| (out, lease.number())),
        }
    }
}

/// How many new test hosts a test whose test host died or hung gets. Freezes of the emulator
/// come in runs now and then (two test hosts in a row on 2026-12-05, the second right after its
/// boot), and the heartbeat makes each cost about 2 minutes instead of 11.
const HOST_RETRIES: u32 = 2;

/// Whether a run that failed with `e` after `retries` retries gets another test host: up to
/// [`HOST_RETRIES`] when the test host died or froze, one when the command ran out of time (a
/// test that hangs by itself must not cost three times the limit).
fn retry_allowed(e: &TestHostError, retries: u32) -> bool {
    match e {
        TestHostError::CommandTimedOut { .. } => retries == 0,
        e => host_died(e) && retries < HOST_RETRIES,
    }
}

/// Whether `e` means the test host is gone (rather than the command failing).
fn host_died(e: &TestHostError) -> bool {
    matches!(
        e,
        TestHostError::QemuExited { .. }
            | TestHostError::Channel { .. }
            | TestHostError::Unresponsive { .. }
            | TestHostError::Broken
    )
}

/// The workspace root (parent of `tests/`).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_owned()
}

/// The cargo target directory this test binary was built into, with links resolved:
/// `scripts/test.sh` may make `target/` a link into a persistent cache, and the test host must
/// share the directory itself.
pub fn target_dir() -> PathBuf {
    let dir = match env::var_os("CARGO_TARGET_DIR") {
        Some(dir) if Path::new(&dir).is_absolute() => PathBuf::from(dir),
        Some(dir) => workspace_root().join(dir),
        None => workspace_root().join("target"),
    };
    std::fs::canonicalize(&dir).unwrap_or(dir)
}

/// The line of the inner script that recreates `<workspace>/target` inside the test host when it
/// is a link here (see [`target_dir`]): paths that cargo compiled into the tests
/// (`CARGO_BIN_EXE_*`) go through it. Empty when `target/` is a plain directory.
fn target_link_line() -> String {
    let link = workspace_root().join("target");
    if !link.is_symlink() {
        return String::new();
    }
    format!(
        "[ -e '{0}' ] || {{ mkdir -p '{1}' && ln -s '{2}' '{0}'; }}\n",
        link.display(),
        workspace_root().display(),
        target_dir().display()
    )
}

/// Directory holding the binaries built with the same profile as this test
/// (`target/debug` or `target/release`).
pub fn profile_dir() -> PathBuf {
    let exe = env::current_exe().expect("current test executable");
    // target/<profile>/deps/<test binary>
    exe.parent()
        .and_then(Path::parent)
        .expect("test binary lives in target/<profile>/deps")
        .to_owned()
}

/// A fresh scratch directory under `target/bulkhead-tests/tmp`, visible at the same path inside
/// the test host.
pub fn scratch_dir() -> tempfile::TempDir {
    let parent = target_dir().join("bulkhead-tests/tmp");
    std::fs::create_dir_all(&parent).expect("create scratch parent");
    tempfile::Builder::new()
        .prefix("t-")
        .tempdir_in(parent)
        .expect("create scratch dir")
}

/// A fresh directory on a local file system (the system temp dir) for Unix sockets, which cannot
/// live on the test host's 9p shares. Inside the test host it is local to the test host.
pub fn socket_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("bulkhead-sock-")
        .tempdir()
        .expect("create socket dir")
}

/// A copy of the program `bin` in a fresh directory of the system temp dir that every user may
/// enter, for tests that run it as an unprivileged user: `target/` may live under root's own
/// home (`scripts/test.sh`'s target cache), which no other user can enter. Returns the directory
/// (removed when dropped) and the copy.
///
/// # Panics
/// When the directory or the copy cannot be made.
pub fn copy_for_any_user(bin: &Path) -> (tempfile::TempDir, PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    let dir = socket_dir();
    std::fs::set_permissions(dir.path(), PermissionsExt::from_mode(0o755)).expect("chmod 755");
    let name = bin.file_name().expect("a program's file name");
    let copy = dir.path().join(name);
    std::fs::copy(bin, &copy).unwrap_or_else(|e| panic!("copying {}: {e}", bin.display()));
    (dir, copy)
}

/// Longest a single program run by [`run`] may take before the test fails (a hung guest must fail
/// the test, not stall the suite).
const RUN_TIMEOUT: Duration = Duration::from_secs(300);

/// Runs `program args...` and returns its output (never panics on a non-zero status).
///
/// # Panics
/// When the program cannot be started or is still running after 300 s (it is killed first).
pub fn run(program: &Path, args: &[&str]) -> Output {
    run_with_env(program, args, &[])
}

/// [`run`] with extra environment variables `env` (`(name, value)` pairs).
///
/// # Panics
/// As [`run`].
pub fn run_with_env(program: &Path, args: &[&str], env: &[(&str, &Path)]) -> Output {
    let child = Command::new(program)
        .args(args)
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", program.display()));
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(RUN_TIMEOUT) {
        Ok(out) => out.unwrap_or_else(|e| panic!("waiting for {}: {e}", program.display())),
        Err(_) => {
            // SAFETY: kill with the pid of our own child, which the waiting thread has not reaped.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            panic!(
                "{} {args:?} did not finish within {RUN_TIMEOUT:?}",
                program.display()
            );
        }
    }
}

/// The value on the line `key=value` of a guest script's report `stdout`, trimmed.
///
/// # Panics
/// When no line starts with `key=` (the message shows `stdout`).
pub fn field<'a>(stdout: &'a str, key: &str) -> &'a str {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("no {key}= in {stdout:?}"))
        .trim()
}

/// `output`'s stdout and stderr as text, for assertion messages.
pub fn describe(output: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}\n--- stderr\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Lowercase hex sha256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(bytes);
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// A sandbox of the test kernel, the agent test image and the `bulkhead-vmm` under test, with
/// 300 s for the agent to come up (nested boots under load are slow); other fields default.
/// Callers set memory, mounts, storage... with struct update syntax.
pub fn sandbox_config() -> bulkhead_sandbox::SandboxConfig {
    let a = artifacts();
    bulkhead_sandbox::SandboxConfig {
        kernel: a.vmlinux.clone(),
        initrd: a.agent_initrd.clone(),
        vmm_binary: a.vmm.clone(),
        ready_timeout: Duration::from_secs(300),
        ..bulkhead_sandbox::SandboxConfig::default()
    }
}

/// Runs `sh -c script` in the guest and waits for its whole output.
///
/// # Panics
/// When the exec cannot be started or its output cannot be read.
pub fn run_sh(
    sandbox: &bulkhead_sandbox::Sandbox,
    script: &str,
) -> bulkhead_protocol::client::ExecOutput {
    sandbox
        .exec(&bulkhead_protocol::ExecRequest::new(["sh", "-c", script]))
        .expect("exec")
        .wait_with_output()
        .expect("output")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed(status: i32, stderr: &str) -> CommandOutput {
        CommandOutput {
            stdout: b"running 1 test\n".to_vec(),
            stderr: stderr.as_bytes().to_vec(),
            status,
        }
    }

    #[test]
    fn only_failed_tests_with_a_known_nested_guest_failure_are_run_again() {
        let not_ready = "create: the guest agent was not ready within 300s; the VM was destroyed";

        assert_eq!(
            nested_guest_failed(&failed(101, "bulkhead-harness: the guest crashed: pid=7")),
            Some("crashed")
        );
        assert_eq!(
            nested_guest_failed(&failed(101, not_ready)),
            Some("never became ready")
        );
        assert_eq!(nested_guest_failed(&failed(0, not_ready)), None);
        assert_eq!(
            nested_guest_failed(&failed(101, "assertion `left == right` failed")),
            None
        );
    }
}
