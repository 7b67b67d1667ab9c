//! Boots one test host (QEMU, ~6-10 s) and runs commands through it. Needs qemu-system-x86, busybox-static
//! and apt access to Debian's kernel package (cached after the first run).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use bulkhead_testhost::{Error, TestHost, TestHostConfig};

const T: Duration = Duration::from_secs(60);

struct Fixture {
    host: TestHost,
    shared: tempfile::TempDir,
    bin_dir: PathBuf,
}

/// The one test host of this test binary, shared by all tests (commands are serialized inside).
fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        // A static is never dropped, so the directory outlives the run: keep it under
        // target/tmp (removed by `cargo clean`), not in the system temp directory.
        let shared = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let bin = PathBuf::from(env!("CARGO_BIN_EXE_bulkhead-testhost"));
        let bin_dir = bin.parent().unwrap().to_path_buf();
        let cfg = TestHostConfig {
            shares: vec![shared.path().to_path_buf(), bin_dir.clone()],
            extra_libs_for: vec![bin],
            ..TestHostConfig::default()
        };
        let host = TestHost::start(cfg).unwrap_or_else(|e| panic!("test host: {e}"));
        eprintln!(
            "boot-to-ready (incl. cached prepare): {:?}",
            host.boot_time()
        );
        Fixture {
            host,
            shared,
            bin_dir,
        }
    })
}

fn shared_path(name: &str) -> PathBuf {
    fixture().shared.path().join(name)
}

fn quoted(p: &Path) -> String {
    bulkhead_testhost::protocol::shell_quote_path(p)
}

#[test]
fn echo_prints_to_stdout() {
    // Act
    let out = fixture().host.run("echo hello", T).unwrap();

    // Assert
    assert_eq!(out.stdout, b"hello\n");
    assert_eq!(out.stderr, b"");
    assert_eq!(out.status, 0);
}

#[test]
fn processes_start_at_the_same_addresses_by_default() {
    // Arrange: the test host boots with `norandmaps` (TestHostConfig::host_aslr), so two runs of
    // one program map its stack at the same address.
    let script = "grep stack /proc/self/maps; grep stack /proc/self/maps";

    // Act
    let out = fixture().host.run(script, T).unwrap();

    // Assert
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{text}");
    assert_eq!(lines[0], lines[1]);
}

#[test]
fn cgroup2_is_mounted_with_favordynmods() {
    // Act
    let out = fixture()
        .host
        .run("grep ' /sys/fs/cgroup cgroup2 ' /proc/mounts", T)
        .unwrap();

    // Assert
    let line = String::from_utf8(out.stdout).unwrap();
    assert!(line.contains("favordynmods"), "{line:?}");
}

#[test]
fn non_zero_exit_status_is_returned() {
    // Act
    let out = fixture().host.run("echo partial; exit 42", T).unwrap();

    // Assert
    assert_eq!(out.status, 42);
    assert_eq!(out.stdout, b"partial\n");
}

#[test]
fn binary_output_with_nul_bytes_is_exact() {
    // Act
    let out = fixture()
        .host
        .run(r"printf 'a\000b\377\n\r\000'", T)
        .unwrap();

    // Assert
    assert_eq!(out.stdout, b"a\0b\xff\n\r\0");
}

#[test]
fn stderr_is_kept_apart_from_stdout() {
    // Act
    let out = fixture()
        .host
        .run("echo out; echo err >&2; echo out2", T)
        .unwrap();

    // Assert
    assert_eq!(out.stdout, b"out\nout2\n");
    assert_eq!(out.stderr, b"err\n");
}

#[test]
fn file_written_inside_a_share_is_on_the_host() {
    // Arrange
    let path = shared_path("written-inside");

    // Act
    let out = fixture()
        .host
        .run(
            &format!("printf 'from the test host' > {}", quoted(&path)),
            T,
        )
        .unwrap();

    // Assert
    assert_eq!(out.status, 0);
    assert_eq!(std::fs::read(&path).unwrap(), b"from the test host");
}

#[test]
fn host_changes_between_commands_are_seen_despite_cache_loose() {
    // Arrange
    let path = shared_path("changed-on-host");
    std::fs::write(&path, b"first").unwrap();
    let first = fixture()
        .host
        .run(&format!("cat {}", quoted(&path)), T)
        .unwrap();
    std::fs::write(&path, b"again").unwrap();

    // Act
    let second = fixture()
        .host
        .run(&format!("cat {}", quoted(&path)), T)
        .unwrap();

    // Assert
    assert_eq!(first.stdout, b"first");
    assert_eq!(second.stdout, b"again");
}

#[test]
fn dev_kvm_is_a_character_device() {
    // Act
    let out = fixture().host.run("test -c /dev/kvm", T).unwrap();

    // Assert
    assert_eq!(out.status, 0);
}

#[test]
fn environment_exported_in_the_script_reaches_the_command() {
    // Act
    let out = fixture()
        .host
        .run("export GREETING='a b'; sh -c 'echo \"$GREETING\"'", T)
        .unwrap();

    // Assert
    assert_eq!(out.stdout, b"a b\n");
}

#[test]
fn dynamically_linked_rust_binary_runs_inside() {
    // Arrange
    let bin = fixture().bin_dir.join("bulkhead-testhost");

    // Act
    let out = fixture()
        .host
        .run(&format!("{} --version", quoted(&bin)), T)
        .unwrap();

    // Assert
    assert_eq!(out.status, 0, "{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.stdout.starts_with(b"bulkhead-testhost "));
}

#[test]
fn timeout_kills_the_command_and_the_host_stays_usable() {
    // Arrange
    let started = Instant::now();

    // Act
    let result = fixture()
        .host
        .run("echo before; sleep 30; echo after", Duration::from_secs(2));
    let next = fixture().host.run("echo next", T).unwrap();

    // Assert
    match result {
        Err(Error::CommandTimedOut { output, .. }) => assert_eq!(output.stdout, b"before\n"),
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(20));
    assert_eq!(next.stdout, b"next\n");
}

#[test]
fn twenty_megabyte_file_reads_intact_through_the_share() {
    // Arrange
    use sha2::{Digest, Sha256};
    let path = shared_path("big");
    let data: Vec<u8> = (0..20_000_000u32)
        .map(|i| (i * 7 + i / 251) as u8)
        .collect();
    std::fs::write(&path, &data).unwrap();
    let expected: String = Sha256::digest(&data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let host = &fixture().host;
    let timed_cat = format!(
        "read -r t0 _ </proc/uptime; cat {} >/dev/null; read -r t1 _ </proc/uptime; echo $t0 $t1",
        quoted(&path)
    );

    // Act
    let read = host.run(&timed_cat, T).unwrap();
    let sum = host
        .run(&format!("sha256sum {}", quoted(&path)), T)
        .unwrap();

    // Assert
    eprintln!(
        "20 MB `cat > /dev/null` through 9p, test host uptime before/after: {}",
        String::from_utf8_lossy(&read.stdout).trim()
    );
    assert_eq!(read.status, 0);
    assert!(String::from_utf8_lossy(&sum.stdout).starts_with(&expected));
}

#[test]
fn many_small_commands_each_return_their_own_output() {
    // Arrange
    let host = &fixture().host;
    host.run("true", T).unwrap();
    let started = Instant::now();

    // Act
    let outputs: Vec<Vec<u8>> = (0..10)
        .map(|i| host.run(&format!("echo {i}"), T).unwrap().stdout)
        .collect();

    // Assert
    eprintln!("per-command round trip: {:?}", started.elapsed() / 10);
    let expected: Vec<Vec<u8>> = (0..10).map(|i| format!("{i}\n").into_bytes()).collect();
    assert_eq!(outputs, expected);
}
