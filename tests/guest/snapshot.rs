//! Snapshots at the sandbox level (`bulkhead_sandbox::snapshot`): a sandbox saved after it ran
//! something, restored as several clones that continue from there, each a distinct machine.

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use bulkhead_protocol::client::ExecOutput;
use bulkhead_protocol::ExecRequest;
use bulkhead_sandbox::snapshot::MANIFEST_FILE;
use bulkhead_sandbox::{Sandbox, SandboxConfig};
use bulkhead_tests::{guest_test, sandbox_config};

/// Guest RAM of every sandbox here, MiB.
const MEMORY_MIB: u32 = 256;

fn config() -> SandboxConfig {
    SandboxConfig {
        memory_mib: MEMORY_MIB,
        // The tests run as root: the VMMs are jailed, as for every sandbox of a root process.
        ..sandbox_config()
    }
}

fn run_sh(sandbox: &Sandbox, script: &str) -> ExecOutput {
    sandbox
        .exec(&ExecRequest::new(["sh", "-c", script]))
        .expect("exec")
        .wait_with_output()
        .expect("output")
}

fn stdout(out: &ExecOutput) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Boots a sandbox, runs `prepare` in it and snapshots it into `dir`; returns `prepare`'s
/// output.
fn make_snapshot(dir: &Path, prepare: &str) -> String {
    make_snapshot_with(&config(), dir, prepare)
}

fn make_snapshot_with(cfg: &SandboxConfig, dir: &Path, prepare: &str) -> String {
    let mut sandbox = Sandbox::start(cfg).expect("boot");
    let out = run_sh(&sandbox, prepare);
    assert_eq!(out.status.code, Some(0), "prepare: {out:?}");
    sandbox.snapshot_into(dir, cfg).expect("snapshot");
    stdout(&out)
}

fn host_unix_s() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

guest_test!(
    fn clones_see_the_snapshots_files_and_only_their_own_writes() {
        // Arrange: a snapshot taken after `echo 42 > /tmp/x`, and a process left running.
        let dir = tempfile::tempdir().unwrap();
        let running = make_snapshot(
            dir.path(),
            "echo 42 > /tmp/x; sleep 1000 >/dev/null 2>&1 & echo $! > /tmp/sleeper; \
             kill -0 $(cat /tmp/sleeper) && echo alive",
        );
        assert_eq!(running, "alive\n", "the sleeper runs before the snapshot");

        // Act: five clones alive at once, each reading the file and then writing its own value.
        let clones: Vec<Sandbox> = (0..5)
            .map(|_| Sandbox::restore(&config(), dir.path()).expect("restore"))
            .collect();
        let before: Vec<String> = clones
            .iter()
            .map(|c| stdout(&run_sh(c, "cat /tmp/x")))
            .collect();
        for (i, clone) in clones.iter().enumerate() {
            run_sh(clone, &format!("echo clone-{i} > /tmp/x"));
        }
        let after: Vec<String> = clones
            .iter()
            .map(|c| stdout(&run_sh(c, "cat /tmp/x")))
            .collect();
        let sleeper = stdout(&run_sh(
            &clones[0],
            "kill -0 $(cat /tmp/sleeper) && echo alive",
        ));
        for clone in clones {
            clone.destroy().unwrap();
        }
        let late = Sandbox::restore(&config(), dir.path()).expect("restore after the clones");
        let template_after = stdout(&run_sh(&late, "cat /tmp/x"));

        // Assert
        assert!(before.iter().all(|s| s == "42\n"), "{before:?}");
        for (i, seen) in after.iter().enumerate() {
            assert_eq!(seen, &format!("clone-{i}\n"));
        }
        assert_eq!(
            sleeper, "alive\n",
            "the process started before the snapshot"
        );
        assert_eq!(template_after, "42\n", "the clones changed the snapshot");
        late.destroy().unwrap();
    }
);

guest_test!(
    fn clones_get_their_own_randomness_and_the_hosts_clock() {
        // Arrange: the snapshot's last random bytes, and a guest clock set a day back before the
        // snapshot (as a day-old template would have); VMMs without a jail this time.
        let cfg = SandboxConfig {
            jail: false,
            ..config()
        };
        let dir = tempfile::tempdir().unwrap();
        let template_random = make_snapshot_with(
            &cfg,
            dir.path(),
            "date -s @$(( $(date +%s) - 86400 )) >/dev/null; head -c 32 /dev/urandom | od -An -tx1",
        );

        // Act
        let clones: Vec<Sandbox> = (0..3)
            .map(|_| Sandbox::restore(&cfg, dir.path()).expect("restore"))
            .collect();
        let random: Vec<String> = clones
            .iter()
            .map(|c| stdout(&run_sh(c, "head -c 32 /dev/urandom | od -An -tx1")))
            .collect();
        let skew: Vec<i64> = clones
            .iter()
            .map(|c| {
                stdout(&run_sh(c, "date +%s"))
                    .trim()
                    .parse::<i64>()
                    .unwrap()
                    - host_unix_s()
            })
            .collect();

        // Assert
        let mut all = random.clone();
        all.push(template_random);
        all.sort();
        all.dedup();
        assert_eq!(
            all.len(),
            4,
            "random bytes repeat across clones: {random:?}"
        );
        assert!(
            skew.iter().all(|s| s.abs() <= 2),
            "guest clock minus host clock, s: {skew:?}"
        );
        for clone in clones {
            clone.destroy().unwrap();
        }
    }
);

guest_test!(
    fn a_broken_or_mismatched_snapshot_is_refused_and_leaves_nothing_running() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        make_snapshot(dir.path(), "true");
        let truncated = tempfile::tempdir().unwrap();
        for name in ["state", "memory", MANIFEST_FILE] {
            std::fs::copy(dir.path().join(name), truncated.path().join(name)).unwrap();
        }
        let state = truncated.path().join("state");
        let len = std::fs::metadata(&state).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&state)
            .unwrap()
            .set_len(len - 100)
            .unwrap();
        // A snapshot written by a bulkhead with another state format: its header says so.
        let newer = tempfile::tempdir().unwrap();
        for name in ["state", "memory", MANIFEST_FILE] {
            std::fs::copy(dir.path().join(name), newer.path().join(name)).unwrap();
        }
        let newer_state = newer.path().join("state");
        let text = std::fs::read(&newer_state).unwrap();
        let header_end = text.iter().position(|&b| b == b'\n').unwrap();
        let header =
            String::from_utf8_lossy(&text[..header_end]).replace("\"format\":1,", "\"format\":2,");
        let mut rewritten = header.into_bytes();
        rewritten.extend_from_slice(&text[header_end..]);
        std::fs::write(&newer_state, rewritten).unwrap();
        let runtime = tempfile::tempdir().unwrap();
        let mut cfg = config();
        cfg.runtime_dir = runtime.path().to_owned();
        let mut bigger = cfg.clone();
        bigger.memory_mib = MEMORY_MIB * 2;

        // Act
        let other_version = Sandbox::restore(&cfg, newer.path()).unwrap_err();
        let cut = Sandbox::restore(&cfg, truncated.path()).unwrap_err();
        let more_memory = Sandbox::restore(&bigger, dir.path()).unwrap_err();
        let missing = Sandbox::restore(&cfg, &dir.path().join("nope")).unwrap_err();

        // Assert: each names its cause, and no runtime directory (so no VMM) is left.
        assert!(
            other_version
                .to_string()
                .contains("snapshot format version 2"),
            "{other_version}"
        );
        assert!(cut.to_string().contains("truncated"), "{cut}");
        assert!(
            more_memory
                .to_string()
                .contains("a restore cannot change it"),
            "{more_memory}"
        );
        assert!(
            missing.to_string().contains("is not a sandbox snapshot"),
            "{missing}"
        );
        assert_eq!(std::fs::read_dir(runtime.path()).unwrap().count(), 0);
    }
);

/// Proportional set size, KiB, of process `pid`'s mappings of `file` (`/proc/PID/smaps`): the
/// pages it alone maps plus its share of the pages other processes map too.
fn mapping_pss_kib(pid: u32, file: &Path) -> u64 {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap();
    let name = file.to_str().unwrap();
    let mut inside = false;
    let mut total = 0;
    for line in smaps.lines() {
        if let Some(rest) = line.strip_prefix("Pss:") {
            if inside {
                total += rest
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<u64>()
                    .unwrap();
            }
        } else if line.contains('-') && line.split_whitespace().count() >= 5 {
            // A mapping's header line: address range, perms, offset, device, inode[, path].
            inside = line.ends_with(name);
        }
    }
    total
}

guest_test!(
    fn ten_clones_share_the_snapshots_memory() {
        // Arrange: a snapshot of a sandbox with a 64 MiB file in its RAM (the initramfs root is
        // tmpfs).
        let dir = tempfile::tempdir().unwrap();
        make_snapshot(
            dir.path(),
            "dd if=/dev/zero of=/tmp/fill bs=1M count=64 2>/dev/null; \
             dd if=/tmp/fill of=/dev/null bs=1M 2>/dev/null",
        );
        let memory = dir.path().canonicalize().unwrap().join("memory");
        let first = Sandbox::restore(&config(), dir.path()).expect("restore");
        run_sh(&first, "md5sum /tmp/fill");
        let alone = mapping_pss_kib(first.vm_pid().unwrap(), &memory);

        // Act: nine more clones, each reading the same file (md5sum reads it; `cat` to
        // /dev/null would splice without touching the pages).
        let mut clones = vec![first];
        for _ in 0..9 {
            let clone = Sandbox::restore(&config(), dir.path()).expect("restore");
            run_sh(&clone, "md5sum /tmp/fill");
            clones.push(clone);
        }
        let total: u64 = clones
            .iter()
            .map(|c| mapping_pss_kib(c.vm_pid().unwrap(), &memory))
            .sum();

        // Assert: one clone has the 64 MiB file in its guest RAM, and ten share those pages.
        assert!(alone >= 64 * 1024, "one clone's guest RAM: {alone} KiB PSS");
        assert!(
            total < 3 * alone,
            "guest RAM of 10 clones: {total} KiB PSS in all; one clone alone: {alone} KiB"
        );
        for clone in clones {
            clone.destroy().unwrap();
        }
    }
);

guest_test!(
    fn an_exec_streaming_during_the_snapshot_hangs_no_clone() {
        // Arrange: an exec printing every 100 ms while the snapshot is taken.
        let dir = tempfile::tempdir().unwrap();
        let cfg = config();
        let mut sandbox = Sandbox::start(&cfg).expect("boot");
        let mut streaming = sandbox
            .exec(&ExecRequest::new([
                "sh",
                "-c",
                "while true; do echo tick; sleep 0.1; done",
            ]))
            .unwrap();
        assert!(
            streaming.next_event().unwrap().is_some(),
            "the exec started"
        );
        sandbox.snapshot_into(dir.path(), &cfg).expect("snapshot");

        // Act: two clones, each running a command after the restore.
        let clones: Vec<Sandbox> = (0..2)
            .map(|_| Sandbox::restore(&cfg, dir.path()).expect("restore"))
            .collect();
        let outputs: Vec<String> = clones
            .iter()
            .map(|c| stdout(&run_sh(c, "echo after-restore")))
            .collect();

        // Assert: the old stream ended on the host; new execs work in every clone.
        let mut ended = false;
        for _ in 0..1000 {
            match streaming.next_event() {
                Ok(Some(_)) => continue,
                Ok(None) | Err(_) => {
                    ended = true;
                    break;
                }
            }
        }
        assert!(ended, "the host side of the old exec never ended");
        assert!(
            outputs.iter().all(|o| o == "after-restore\n"),
            "{outputs:?}"
        );
        for clone in clones {
            clone.destroy().unwrap();
        }
    }
);
