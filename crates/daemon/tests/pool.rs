//! The warm pool (`[pool]`) against the real daemon process with the fake VMM: the pool fills,
//! a matching create takes a clone that was already running, other creates take the normal
//! path, clones count against `max_sandboxes`, bad settings stop the daemon, and a daemon
//! killed with SIGKILL while it refills leaves nothing behind once restarted.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bulkhead_client::{Client, CreateSandbox, ExecSpec, PoolStatus};
use common::{alive, api_error, cgroup_file, list, rt, spec_with_labels, wait_until, TestDaemon};

/// How long a pool of a few fake clones may take to fill.
const FILL_TIMEOUT: Duration = Duration::from_secs(30);

/// A daemon whose state dir has template `base` (the saved VM of a paused 64 MiB sandbox),
/// restarted with `config` (TOML) as its configuration file.
fn daemon_with_pool(config: &str) -> TestDaemon {
    daemon_with_pool_and(config, |_| {})
}

/// [`daemon_with_pool`], with `change` done to the template's directory before the restart.
fn daemon_with_pool_and(config: &str, change: impl FnOnce(&Path)) -> TestDaemon {
    daemon_with_pool_from(TestDaemon::start(), &spec_with_labels(&[]), config, change)
}

/// `daemon`, with template `base` made of its sandbox `request` (paused), restarted with
/// `config`; `change` is done to the template's directory before the restart.
fn daemon_with_pool_from(
    mut daemon: TestDaemon,
    request: &CreateSandbox,
    config: &str,
    change: impl FnOnce(&Path),
) -> TestDaemon {
    let client = daemon.client();
    let rt = rt();
    let sb = rt.block_on(client.create(request)).unwrap();
    rt.block_on(client.pause(&sb.id)).unwrap();
    let template = daemon.state_dir.join("templates/base");
    std::fs::create_dir_all(&template).unwrap();
    for file in list(&daemon.state_dir.join("paused").join(&sb.id)) {
        std::fs::copy(&file, template.join(file.file_name().unwrap())).unwrap();
    }
    rt.block_on(client.delete(&sb.id)).unwrap();
    assert!(daemon.terminate(), "{}", daemon.log());
    change(&template);
    let file = write_config(&daemon, config);
    daemon.spawn(&["--config", file.to_str().unwrap()]);
    daemon
}

fn write_config(daemon: &TestDaemon, config: &str) -> PathBuf {
    let file = daemon.dir.path().join("bulkheadd.toml");
    std::fs::write(&file, config).unwrap();
    file
}

/// The pool as `/healthz` shows it.
fn pool(rt: &tokio::runtime::Runtime, client: &Client) -> PoolStatus {
    rt.block_on(client.health())
        .unwrap()
        .pool
        .expect("the daemon reports its pool")
}

/// Waits until `ready` clones are ready and none is being restored; panics with the daemon's
/// log otherwise.
fn wait_for_ready(daemon: &TestDaemon, ready: usize) {
    let client = daemon.client();
    let rt = rt();
    let filled = wait_until(FILL_TIMEOUT, || {
        let p = pool(&rt, &client);
        p.ready == ready && p.restoring == 0
    });
    assert!(
        filled,
        "the pool did not reach {ready} ready clones: {:?}\n{}",
        pool(&rt, &client),
        daemon.log()
    );
}

/// Live processes with an argument inside `dir` (the VMMs of the VMs there).
fn processes_under(dir: &Path) -> Vec<u32> {
    list(Path::new("/proc"))
        .iter()
        .filter_map(|p| p.file_name()?.to_str()?.parse::<u32>().ok())
        .filter(|pid| alive(*pid))
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| {
                    c.split(|b| *b == 0)
                        .filter_map(|a| std::str::from_utf8(a).ok())
                        .any(|a| Path::new(a).starts_with(dir))
                })
                .unwrap_or(false)
        })
        .collect()
}

fn from_template() -> CreateSandbox {
    CreateSandbox {
        template: Some("base".into()),
        ..CreateSandbox::default()
    }
}

#[test]
fn the_pool_fills_hands_out_a_running_clone_with_the_requests_settings_and_refills() {
    // Arrange
    let mut daemon = daemon_with_pool("[pool]\ntemplate = \"base\"\nsize = 2\n");
    let client = daemon.client();
    let rt = rt();
    wait_for_ready(&daemon, 2);
    let clones = processes_under(&daemon.vms_dir());
    let (_, metrics) = rt
        .block_on(client.raw(hyper::Method::GET, "/metrics", None, &[]))
        .unwrap();
    let mut request = from_template();
    request.labels.insert("team".into(), "a".into());
    request.env.insert("GREETING".into(), "hello".into());
    request.pids_max = Some(40);
    request.ttl_s = Some(3600);

    // Act
    let sb = rt.block_on(client.create(&request)).unwrap();
    let out = rt
        .block_on(client.exec_collect(&sb.id, &ExecSpec::new(["sh", "-c", "echo $GREETING"])))
        .unwrap();
    let pids_max = std::fs::read_to_string(cgroup_file(&sb, "pids", "pids.max")).unwrap();
    let listed = rt.block_on(client.list(&Default::default())).unwrap();
    let health = rt.block_on(client.health()).unwrap();
    wait_for_ready(&daemon, 2);
    let after_refill = processes_under(&daemon.vms_dir());

    // Assert
    assert_eq!(clones.len(), 2, "two idle clones run: {clones:?}");
    let metrics = String::from_utf8_lossy(&metrics);
    assert!(
        metrics.contains("bulkhead_pool_clones{state=\"ready\"} 2"),
        "{metrics}"
    );
    let vmm = sb.vmm_pid.unwrap();
    assert!(
        clones.contains(&vmm),
        "the sandbox's VMM ({vmm}) ran before the create: {clones:?}"
    );
    assert_eq!(sb.template.as_deref(), Some("base"));
    assert_eq!(sb.labels.get("team").map(String::as_str), Some("a"));
    assert!(sb.expires_at.is_some());
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hello\n");
    assert_eq!((sb.limits.pids_max, pids_max.trim()), (40, "40"));
    assert_eq!(
        listed.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(),
        [sb.id.as_str()],
        "idle clones are not sandboxes"
    );
    assert_eq!(health.sandboxes, 1);
    assert_eq!(after_refill.len(), 3, "two clones and the sandbox");
    let warmed = daemon
        .log()
        .matches("pool: clone restored, warmed up")
        .count();
    assert_eq!(
        warmed,
        3,
        "each clone ran its warm-up exec\n{}",
        daemon.log()
    );

    // Shutdown destroys the sandbox and the idle clones.
    assert!(daemon.terminate(), "{}", daemon.log());
    assert_eq!(daemon.leftovers(&after_refill), Vec::<String>::new());
}

#[test]
fn creates_the_pool_cannot_serve_boot_or_restore_as_usual() {
    // Arrange
    let daemon = daemon_with_pool("[pool]\ntemplate = \"base\"\nsize = 1\n");
    let client = daemon.client();
    let rt = rt();
    wait_for_ready(&daemon, 1);
    let clones = processes_under(&daemon.vms_dir());

    // Act
    let booted = rt.block_on(client.create(&spec_with_labels(&[]))).unwrap();
    let pool_after_boot = pool(&rt, &client);
    let shared = tempfile::tempdir().unwrap();
    let mut with_mount = from_template();
    with_mount.mounts = vec![bulkhead_client::MountSpec {
        host: shared.path().display().to_string(),
        guest: "/data".into(),
        ro: true,
    }];
    let refused = api_error(rt.block_on(client.create(&with_mount)));
    let pool_after_mount = pool(&rt, &client);

    // Assert
    assert!(booted.template.is_none());
    assert!(!clones.contains(&booted.vmm_pid.unwrap()), "a new VMM");
    assert_eq!((pool_after_boot.ready, pool_after_boot.size), (1, 1));
    // A template create with mounts takes the normal path, which (this daemon has no
    // mount_roots) refuses it; the idle clone stays in the pool.
    assert_eq!(refused.0, 400, "{refused:?}");
    assert_eq!(pool_after_mount.ready, 1);
}

#[test]
fn a_create_with_a_mount_gets_a_clone_with_the_directory_attached_if_its_slots_suffice() {
    // Arrange: template `base` is a paused sandbox that had one mount, so its clones have one
    // idle share slot; their jailed VMMs run as fresh ids (no `share_owner`), which can serve
    // root's read-only directories but not a user's read-write one.
    let root = tempfile::tempdir().unwrap();
    let mode = std::os::unix::fs::PermissionsExt::from_mode(0o755);
    std::fs::set_permissions(root.path(), mode).unwrap();
    let dirs: Vec<PathBuf> = ["template", "a", "b", "users"]
        .iter()
        .map(|name| root.path().join(name))
        .collect();
    for dir in &dirs {
        std::fs::create_dir(dir).unwrap();
    }
    std::os::unix::fs::chown(&dirs[3], Some(1000), Some(1000)).unwrap();
    let mount = |dir: &Path, guest: &str| bulkhead_client::MountSpec {
        host: dir.display().to_string(),
        guest: guest.into(),
        ro: true,
    };
    let mut template = spec_with_labels(&[]);
    template.mounts = vec![mount(&dirs[0], "/data")];
    let daemon = daemon_with_pool_from(
        TestDaemon::start_with(&["--mount-root", root.path().to_str().unwrap()]),
        &template,
        "[pool]\ntemplate = \"base\"\nsize = 1\n",
        |_| {},
    );
    let client = daemon.client();
    let rt = rt();
    wait_for_ready(&daemon, 1);
    let clones = processes_under(&daemon.vms_dir());
    let mut one = from_template();
    one.mounts = vec![mount(&dirs[1], "/data")];
    let mut two = from_template();
    two.mounts = vec![mount(&dirs[1], "/a"), mount(&dirs[2], "/b")];
    let mut users = from_template();
    users.mounts = vec![bulkhead_client::MountSpec {
        ro: false,
        ..mount(&dirs[3], "/data")
    }];

    // Act
    let too_many = api_error(rt.block_on(client.create(&two)));
    let pool_after_refusal = pool(&rt, &client);
    let restored = rt.block_on(client.create(&users)).unwrap();
    let pool_after_restore = pool(&rt, &client);
    let handed = rt.block_on(client.create(&one)).unwrap();

    // Assert
    assert_eq!(too_many.0, 400, "{too_many:?}");
    assert_eq!(pool_after_refusal.ready, 1, "the clone stayed in the pool");
    assert!(
        !clones.contains(&restored.vmm_pid.unwrap()),
        "a user's read-write mount needs a VMM of that user: a restore of its own"
    );
    assert_eq!(pool_after_restore.ready, 1);
    let vmm = handed.vmm_pid.unwrap();
    assert!(clones.contains(&vmm), "a hand-out: {vmm} not in {clones:?}");
    assert_eq!(handed.mounts.len(), 1);
    let attached = vmm_logs_with(
        &daemon.vms_dir(),
        "fake-vmm: attached a directory to mount0",
    );
    assert_eq!(attached, 1, "one VMM got the directory");
}

/// How many `vmm.log` files under `dir` (at any depth) contain `text`.
fn vmm_logs_with(dir: &Path, text: &str) -> usize {
    vmm_log_lines(dir, text).iter().filter(|n| **n > 0).count()
}

/// For each `vmm.log` file under `dir` (at any depth), how many times it contains `text`.
fn vmm_log_lines(dir: &Path, text: &str) -> Vec<usize> {
    list(dir)
        .iter()
        .flat_map(|path| match path.is_dir() {
            true => vmm_log_lines(path, text),
            false if path.file_name().is_some_and(|n| n == "vmm.log") => {
                let log = std::fs::read_to_string(path).unwrap_or_default();
                vec![log.matches(text).count()]
            }
            false => Vec::new(),
        })
        .collect()
}

#[test]
fn a_handed_out_clones_first_command_runs_on_a_connection_opened_before_the_create() {
    // Arrange
    let daemon = daemon_with_pool("[pool]\ntemplate = \"base\"\nsize = 1\n");
    let client = daemon.client();
    let rt = rt();
    wait_for_ready(&daemon, 1);
    let sb = rt.block_on(client.create(&from_template())).unwrap();
    let vm_dir = daemon.vms_dir().join(&sb.id);
    let connections = || vmm_log_lines(&vm_dir, "fake-vmm: agent connection");
    let echo = |text: &str| {
        let out = rt
            .block_on(client.exec_collect(&sb.id, &ExecSpec::new(["echo", text])))
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let before = connections();

    // Act
    let first = echo("one");
    let after_first = connections();
    let second = echo("two");
    let after_second = connections();

    // Assert
    assert_eq!((first.as_str(), second.as_str()), ("one\n", "two\n"));
    assert_eq!(before.len(), 1, "one VMM log: {before:?}");
    assert_eq!(
        after_first,
        before,
        "the first command made no new connection\n{}",
        daemon.log()
    );
    assert_eq!(after_second[0], before[0] + 1, "the second made its own");
}

#[test]
fn clones_count_against_max_sandboxes_and_make_room_for_creates() {
    // Arrange
    let daemon = daemon_with_pool("max_sandboxes = 2\n[pool]\ntemplate = \"base\"\nsize = 2\n");
    let client = daemon.client();
    let rt = rt();
    wait_for_ready(&daemon, 2);

    // Act
    let booted = rt.block_on(client.create(&spec_with_labels(&[]))).unwrap();
    wait_for_ready(&daemon, 1); // one clone made room, and the pool cannot refill it
    let pooled = rt.block_on(client.create(&from_template())).unwrap();
    let full = pool(&rt, &client);
    let third = api_error(rt.block_on(client.create(&spec_with_labels(&[]))));
    rt.block_on(client.delete(&booted.id)).unwrap();
    wait_for_ready(&daemon, 1);

    // Assert
    assert_eq!(
        (full.ready, full.restoring),
        (0, 0),
        "no room left: {full:?}"
    );
    assert_eq!(
        (third.0, third.1.as_str()),
        (429, "too_many_sandboxes"),
        "{third:?}"
    );
    assert_eq!(pooled.template.as_deref(), Some("base"));
    assert_eq!(
        rt.block_on(client.list(&Default::default())).unwrap().len(),
        1,
        "the pooled sandbox stays"
    );
}

#[test]
fn bad_pool_settings_stop_the_daemon_with_a_clear_error() {
    // Arrange
    let daemon = TestDaemon::start();
    let run = |config: &str| {
        let file = write_config(&daemon, config);
        let state = daemon.dir.path().join("other-state");
        let mut child = Command::new(env!("CARGO_BIN_EXE_bulkheadd"))
            .arg("--config")
            .arg(&file)
            .arg("--socket")
            .arg(daemon.dir.path().join("other.sock"))
            .arg("--state-dir")
            .arg(&state)
            .args(["--cgroups", "off"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while child.try_wait().unwrap().is_none() {
            assert!(
                Instant::now() < deadline,
                "the daemon did not stop: {config}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let out = child.wait_with_output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };

    // Act
    let missing = run("[pool]\ntemplate = \"nosuch\"\nsize = 1\n");
    let too_big = run("max_sandboxes = 2\n[pool]\ntemplate = \"base\"\nsize = 3\n");
    let zero = run("[pool]\ntemplate = \"base\"\nsize = 0\n");
    let bad_name = run("[pool]\ntemplate = \"../base\"\nsize = 1\n");
    let root_owner = run("[pool]\ntemplate = \"base\"\nsize = 1\nshare_owner = [0, 0]\n");

    // Assert
    assert_ne!(missing.0, Some(0));
    assert!(
        missing.1.contains("pool.template \"nosuch\""),
        "{}",
        missing.1
    );
    assert!(missing.1.contains("unknown template"), "{}", missing.1);
    assert_eq!(too_big.0, Some(2), "{}", too_big.1);
    assert!(
        too_big.1.contains("exceeds max_sandboxes 2"),
        "{}",
        too_big.1
    );
    assert_eq!(zero.0, Some(2), "{}", zero.1);
    assert!(
        zero.1.contains("pool.size must be between 1 and"),
        "{}",
        zero.1
    );
    assert_eq!(bad_name.0, Some(2), "{}", bad_name.1);
    assert!(
        bad_name.1.contains("invalid template name"),
        "{}",
        bad_name.1
    );
    assert_eq!(root_owner.0, Some(2), "{}", root_owner.1);
    assert!(
        root_owner.1.contains("pool.share_owner must not be root"),
        "{}",
        root_owner.1
    );
}

#[test]
fn a_daemon_killed_while_the_pool_refills_leaves_no_clone_behind_and_refills_after_restart() {
    // Arrange
    let mut daemon = daemon_with_pool("[pool]\ntemplate = \"base\"\nsize = 4\n");
    let client = daemon.client();
    let rt = rt();
    let started = wait_until(FILL_TIMEOUT, || pool(&rt, &client).ready >= 1);
    assert!(started, "no clone restored\n{}", daemon.log());

    // Act
    let before = pool(&rt, &client);
    let old = processes_under(&daemon.vms_dir());
    daemon.kill9();
    let config = daemon.dir.path().join("bulkheadd.toml");
    daemon.spawn(&["--config", config.to_str().unwrap()]);
    wait_for_ready(&daemon, 4);
    let new = processes_under(&daemon.vms_dir());

    // Assert
    assert!(
        before.ready < 4,
        "killed while the pool refilled: {before:?}"
    );
    assert!(
        !old.is_empty(),
        "idle clones ran when the daemon was killed"
    );
    let orphans: Vec<u32> = old.iter().copied().filter(|p| alive(*p)).collect();
    assert_eq!(
        orphans,
        Vec::<u32>::new(),
        "VMMs of the killed daemon still run"
    );
    assert_eq!(new.len(), 4, "four new clones: {new:?}");
    assert_eq!(daemon.records().len(), 4, "one record per clone");
    let cgroups: std::collections::BTreeSet<_> = daemon
        .vm_cgroups()
        .iter()
        .filter_map(|p| p.file_name().map(ToOwned::to_owned))
        .collect();
    assert_eq!(cgroups.len(), 4, "one cgroup per clone: {cgroups:?}");
}

#[test]
fn failed_refills_are_logged_and_retried_with_a_growing_pause_not_in_a_loop() {
    // Arrange: the template's manifest and the state file's header and configuration read (the
    // daemon checks them when it starts), but its VM state does not restore.
    let started = Instant::now();
    let daemon = daemon_with_pool_and("[pool]\ntemplate = \"base\"\nsize = 2\n", |dir| {
        let config = serde_json::json!({ "config": { "kernel": "/nonexistent" } });
        bulkhead_vmm::snapshot::format::write_file(&dir.join("state"), &config).unwrap();
    });
    let client = daemon.client();
    let rt = rt();
    let failures = |log: &str| {
        log.matches("pool: restoring a clone of base failed")
            .count()
    };

    // Act
    let three = wait_until(Duration::from_secs(30), || failures(&daemon.log()) >= 3);
    let elapsed = started.elapsed();
    let status = pool(&rt, &client);
    let booted = rt.block_on(client.create(&spec_with_labels(&[])));

    // Assert
    assert!(three, "fewer than 3 attempts in 30 s\n{}", daemon.log());
    // Attempts at 0 s, after 1 s and after 2 s more: a hot loop would fail 3 times at once.
    assert!(
        elapsed >= Duration::from_secs(3),
        "3 failures after {elapsed:?}"
    );
    assert!(failures(&daemon.log()) <= 4, "{}", daemon.log());
    assert_eq!(status.ready, 0);
    assert!(booted.is_ok(), "the daemon still serves: {booted:?}");
    assert_eq!(
        processes_under(&daemon.vms_dir()),
        vec![booted.unwrap().vmm_pid.unwrap()],
        "no failed clone's VMM is left"
    );
}

#[test]
fn an_idle_clone_whose_vmm_dies_is_replaced() {
    // Arrange
    let daemon = daemon_with_pool("[pool]\ntemplate = \"base\"\nsize = 2\n");
    wait_for_ready(&daemon, 2);
    let clones = processes_under(&daemon.vms_dir());
    let victim = clones[0];

    // Act
    // SAFETY: kill(2) on a fake VMM process of this test's daemon.
    unsafe { libc::kill(victim as libc::pid_t, libc::SIGKILL) };
    let replaced = wait_until(FILL_TIMEOUT, || {
        let now = processes_under(&daemon.vms_dir());
        now.len() == 2 && !now.contains(&victim)
    });
    wait_for_ready(&daemon, 2);

    // Assert
    assert!(
        replaced,
        "the dead clone was not replaced\n{}",
        daemon.log()
    );
    assert_eq!(daemon.records().len(), 2, "the dead clone's record is gone");
}

#[test]
fn a_daemon_bench_of_the_pools_template_waits_for_each_refill_so_every_create_is_a_hand_out() {
    // Arrange: a pool of one clone, full.
    let daemon = daemon_with_pool("[pool]\ntemplate = \"base\"\nsize = 1\n");
    wait_for_ready(&daemon, 1);
    let json = daemon.dir.path().join("bench.json");

    // Act: three creates in a row, each of which takes the only clone.
    let out = Command::new(common::cli())
        .args(["bench", "--daemon", "--socket"])
        .arg(&daemon.socket)
        .args(["--template", "base", "--runs", "3", "--json"])
        .arg(&json)
        .args(["--", "echo", "hi"])
        .output()
        .unwrap();

    // Assert: every run succeeded, and every create was a hand-out.
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", daemon.log());
    assert!(
        stdout.contains("3 creates from template base through bulkheadd"),
        "{stdout}"
    );
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let ok = report["runs"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["ok"] == true);
    assert_eq!(ok.count(), 3, "{report}");
    let handed_out = daemon
        .log()
        .matches("sandbox running (from the pool)")
        .count();
    assert_eq!(handed_out, 3, "{}", daemon.log());
}
