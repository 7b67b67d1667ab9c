//! The daemon with real VMs (`bulkhead-vmm`, the guest kernel, the agent image), in the nested
//! test host when this machine's KVM cannot boot guests (see the `bulkhead-tests` harness). The
//! test host has no cgroup mounts of its own; these tests mount the unified hierarchy (cgroup v2)
//! at `/sys/fs/cgroup`, so they exercise the daemon's v2 path (the host-level tests exercise v1
//! on the build machines).
//!
//! Snapshot tests (pause, the warm pool) are in `snapshots.rs`, directory copies in `cp.rs`.

use std::time::{Duration, Instant};

use crate::common::real::{
    create, debian_image_daemon, http_server, multi_rt, real_daemon, small, vm_logs,
};
use crate::common::{cgroup_file, rt, wait_until, TestDaemon};
use crate::vm_test;
use bulkhead_client::{Client, ExecEvent, ExecSpec, SandboxInfo, SandboxState};
use bulkhead_tests::test_path;

/// Sandboxes booted at once by the concurrency test (the acceptance number).
const CONCURRENT_VMS: usize = 20;
/// Guest RAM of each of them, MiB: 20 × (64 MiB + the VMM) fit the 2 GiB test host.
const CONCURRENT_VM_MIB: u32 = 64;

fn read(info: &SandboxInfo, file: &str) -> String {
    let path = cgroup_file(info, "", file);
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .trim()
        .to_owned()
}

fn usage_usec(info: &SandboxInfo) -> u64 {
    read(info, "cpu.stat")
        .lines()
        .find_map(|l| l.strip_prefix("usage_usec "))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// What one of the concurrent sandboxes reported.
struct Outcome {
    info: SandboxInfo,
    nproc: String,
    meminfo: String,
    cgroup_procs: String,
}

/// Creates a sandbox, runs `nproc` and `cat /proc/meminfo` in it, and destroys it.
async fn create_use_destroy(client: Client, daemon: &TestDaemon) -> Outcome {
    let fail = |what: &str, e: bulkhead_client::Error| -> ! {
        panic!(
            "{what}: {e}\n{}\n--- daemon\n{}",
            vm_logs(&daemon.vms_dir()),
            daemon.log()
        )
    };
    let info = client
        .create(&small(CONCURRENT_VM_MIB))
        .await
        .unwrap_or_else(|e| fail("create", e));
    let nproc = client
        .exec_collect(&info.id, &ExecSpec::new(["nproc"]))
        .await
        .unwrap_or_else(|e| fail("nproc", e));
    let meminfo = client
        .exec_collect(&info.id, &ExecSpec::new(["cat", "/proc/meminfo"]))
        .await
        .unwrap_or_else(|e| fail("meminfo", e));
    let cgroup_procs = read(&info, "cgroup.procs");
    client
        .delete(&info.id)
        .await
        .unwrap_or_else(|e| fail("delete", e));
    Outcome {
        info,
        nproc: String::from_utf8_lossy(&nproc.stdout).into_owned(),
        meminfo: String::from_utf8_lossy(&meminfo.stdout).into_owned(),
        cgroup_procs,
    }
}

vm_test!(
    exclusive fn twenty_real_vms_at_once_run_nproc_and_meminfo_and_leave_nothing() {
        // Arrange
        let daemon = real_daemon("", &[]);
        let client = daemon.client();
        let rt = multi_rt();

        // Act
        let outcomes: Vec<Outcome> = rt.block_on(async {
            let runs = (0..CONCURRENT_VMS).map(|_| create_use_destroy(client.clone(), &daemon));
            futures_util::future::join_all(runs).await
        });

        // Assert
        let pids: Vec<u32> = outcomes.iter().map(|o| o.info.vmm_pid.unwrap()).collect();
        for o in &outcomes {
            assert_eq!(o.nproc, "1\n");
            let total_kib: u64 = o
                .meminfo
                .lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                .unwrap_or_else(|| panic!("no MemTotal in {}", o.meminfo));
            assert!(
                total_kib <= u64::from(CONCURRENT_VM_MIB) * 1024,
                "MemTotal {total_kib} kB"
            );
            let vmm = o.info.vmm_pid.unwrap().to_string();
            assert!(
                o.cgroup_procs.lines().any(|p| p == vmm),
                "VMM not in its cgroup"
            );
        }
        assert_eq!(daemon.leftovers(&pids), Vec::<String>::new());
        assert_eq!(
            crate::common::processes_with_arg(daemon.vms_dir().to_str().unwrap()),
            Vec::<u32>::new()
        );
    }
);

vm_test!(
    exclusive fn a_guest_allocating_past_its_ram_is_oom_killed_inside_and_the_vmm_stays_under_its_limit() {
        // Arrange
        let daemon = real_daemon("", &[]);
        let client = daemon.client();
        let rt = rt();
        let sb = rt.block_on(client.create(&small(96))).unwrap();
        // sort keeps every line (a small allocation each) until its input ends, which it never
        // does: memory grows in small steps until the guest kernel's OOM killer ends sort.
        let script = "yes $(printf %01000d 0) | sort >/dev/null; echo sort=$?";
        let mut hog = ExecSpec::new(["sh", "-c", script]);
        hog.timeout_s = Some(600.0);

        // Act
        let out = rt.block_on(client.exec_collect(&sb.id, &hog));
        let out = out.unwrap_or_else(|e| {
            panic!(
                "the hog's exec failed: {e}\n{}\n--- daemon\n{}",
                vm_logs(&daemon.vms_dir()),
                daemon.log()
            )
        });
        let after = rt
            .block_on(client.exec_collect(&sb.id, &ExecSpec::new(["echo", "alive"])))
            .unwrap();
        let peak: u64 = read(&sb, "memory.peak").parse().unwrap();
        let events = read(&sb, "memory.events");
        let max: u64 = read(&sb, "memory.max").parse().unwrap();
        rt.block_on(client.delete(&sb.id)).unwrap();

        // Assert
        let said = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            said, "sort=137\n",
            "sort was not SIGKILLed by the OOM killer: {out:?}"
        );
        assert_eq!(after.stdout, b"alive\n");
        assert_eq!(max, (96 + 64) << 20);
        assert!(peak <= max, "peak {peak} > max {max}");
        assert!(
            events.contains("oom_kill 0"),
            "the host OOM-killed in the VMM's cgroup: {events}"
        );
    }
);

vm_test!(
    exclusive fn two_spinning_vcpus_with_quota_half_use_at_most_0_6_cpu() {
        // Arrange
        let daemon = real_daemon("", &[]);
        let client = daemon.client();
        let rt = rt();
        let spec = bulkhead_client::CreateSandbox {
            vcpus: 2,
            cpu_quota: Some(0.5),
            memory_mib: 64,
            ..bulkhead_client::CreateSandbox::default()
        };
        let sb = rt.block_on(client.create(&spec)).unwrap();
        let spin =
            "timeout 5 sh -c 'while :; do :; done' & timeout 5 sh -c 'while :; do :; done'; wait";
        let mut spin = ExecSpec::new(["sh", "-c", spin]);
        spin.timeout_s = Some(120.0);
        let before = usage_usec(&sb);
        let started = Instant::now();

        // Act
        rt.block_on(client.exec_collect(&sb.id, &spin))
            .unwrap_or_else(|e| panic!("spin: {e}\n{}", vm_logs(&daemon.vms_dir())));
        let used = Duration::from_micros(usage_usec(&sb) - before);
        let elapsed = started.elapsed();
        let cpu_max = read(&sb, "cpu.max");
        rt.block_on(client.delete(&sb.id)).unwrap();

        // Assert
        let share = used.as_secs_f64() / elapsed.as_secs_f64();
        println!("2 spinning vCPUs, quota 0.5: {used:?} CPU in {elapsed:?} = {share:.2} CPUs");
        assert_eq!(cpu_max, "50000 100000");
        assert!(elapsed >= Duration::from_secs(5));
        assert!(share <= 0.6, "{share:.2} CPUs");
        assert!(share >= 0.1, "the spinners barely ran: {share:.2} CPUs");
    }
);

vm_test!(
    fn the_pids_limit_applies_to_the_vmm_process() {
        // Arrange
        let daemon = real_daemon("", &[]);
        let client = daemon.client();
        let rt = rt();
        let spec = bulkhead_client::CreateSandbox {
            pids_max: Some(10),
            memory_mib: 64,
            ..bulkhead_client::CreateSandbox::default()
        };

        // Act
        let sb = rt.block_on(client.create(&spec)).unwrap();
        let current: u32 = read(&sb, "pids.current").parse().unwrap();
        let max = read(&sb, "pids.max");
        // The VMM, and when jailed its supervisor too: every process of the sandbox's cgroup.
        let threads: u32 = read(&sb, "cgroup.procs")
            .lines()
            .map(|pid| {
                std::fs::read_dir(format!("/proc/{pid}/task"))
                    .unwrap()
                    .count() as u32
            })
            .sum();
        rt.block_on(client.delete(&sb.id)).unwrap();

        // Assert
        assert_eq!(max, "10");
        assert!(
            threads >= 3,
            "main, signal and vCPU threads (at least): {threads}"
        );
        assert!(
            (threads..=10).contains(&current),
            "pids.current {current} must count the VMM's {threads} threads and stay under 10"
        );
    }
);

vm_test!(
    fn kill_9_of_the_daemon_during_an_exec_then_restart_adopts_the_real_vm() {
        // Arrange
        let mut daemon = real_daemon("", &[]);
        let client = daemon.client();
        let rt = rt();
        let sb = rt.block_on(client.create(&small(64))).unwrap();
        let stream_rt = crate::common::rt();
        let mut stream = stream_rt
            .block_on(client.exec(
                &sb.id,
                &ExecSpec::new(["sh", "-c", "echo started; sleep 600"]),
            ))
            .unwrap();
        let first = stream_rt.block_on(stream.next_event()).unwrap();

        // Act
        daemon.kill9();
        let broken = stream_rt.block_on(stream.next_event());
        daemon.spawn(&[]);
        let adopted = rt.block_on(client.get(&sb.id)).unwrap();
        let out = rt
            .block_on(client.exec_collect(
                &sb.id,
                &ExecSpec::new([
                    "sh",
                    "-c",
                    "ps -o pid,args | grep '[s]leep 600' || echo none",
                ]),
            ))
            .unwrap();
        rt.block_on(client.delete(&sb.id)).unwrap();

        // Assert
        assert_eq!(first, Some(ExecEvent::Stdout(b"started\n".to_vec())));
        let broken = broken.expect_err("the stream of the dead daemon must fail");
        assert!(
            matches!(broken, bulkhead_client::Error::Interrupted(_)),
            "{broken}"
        );
        assert!(
            broken.to_string().contains("did bulkheadd stop?"),
            "{broken}"
        );
        assert_eq!(adopted.state, SandboxState::Running);
        assert_eq!(
            out.stdout, b"none\n",
            "the command of the dead client was killed in the guest"
        );
        assert_eq!(
            daemon.leftovers(&[sb.vmm_pid.unwrap()]),
            Vec::<String>::new()
        );
    }
);

vm_test!(
    fn kill_9_then_restart_with_on_restart_destroy_removes_the_real_vm() {
        // Arrange
        let mut daemon = real_daemon("", &["--on-restart", "destroy"]);
        let client = daemon.client();
        let rt = rt();
        let sb = rt.block_on(client.create(&small(64))).unwrap();
        let vmm = sb.vmm_pid.unwrap();

        // Act
        daemon.kill9();
        let running_meanwhile = crate::common::alive(vmm);
        daemon.spawn(&[]);
        let after = rt.block_on(client.get(&sb.id));

        // Assert
        assert!(running_meanwhile, "the VM outlives the daemon");
        assert_eq!(after.unwrap_err().status(), Some(404));
        assert_eq!(daemon.leftovers(&[vmm]), Vec::<String>::new());
    }
);

vm_test!(
    /// The TTL counts from the create request, and a nested guest's boot takes seconds of it, so
    /// this checks from the create answer (an upper bound); `tests/lifecycle.rs` checks the exact
    /// 3–5 s window with instantly booting fake VMs.
    fn a_real_vm_with_ttl_3_is_gone_within_5_seconds() {
        // Arrange
        let daemon = real_daemon("", &[]);
        let client = daemon.client();
        let rt = rt();
        let mut spec = small(64);
        spec.ttl_s = Some(3);
        let created = rt.block_on(client.create(&spec)).unwrap();
        let answered = Instant::now();

        // Act
        let gone = wait_until(Duration::from_secs(5), || {
            rt.block_on(client.get(&created.id))
                .is_err_and(|e| e.status() == Some(404))
        });

        // Assert
        assert_eq!(created.state, SandboxState::Running);
        assert!(
            gone,
            "still there {:?} after the create answer",
            answered.elapsed()
        );
        assert_eq!(
            daemon.leftovers(&[created.vmm_pid.unwrap()]),
            Vec::<String>::new()
        );
    }
);

/// Every scratch disk under the daemon's VM runtime root.
fn scratch_disks(vms: &std::path::Path) -> Vec<std::path::PathBuf> {
    crate::common::list(vms)
        .iter()
        .flat_map(|sandbox| crate::common::list(sandbox))
        .map(|runtime| runtime.join("scratch.ext4"))
        .filter(|path| path.exists())
        .collect()
}

/// The Debian test image of the tests crate (built once and cached, outside the test host) in
/// the daemon's image store, with a scratch disk: the image's userland runs, writes land on the
/// scratch disk, a pause saves the disk with the VM (no scratch disk in the runtime root while
/// paused) and the resumed guest reads its files back, and DELETE removes the disk.
#[test]
fn a_sandbox_on_the_debian_image_writes_to_its_scratch_disk_keeps_it_across_a_pause_and_delete_removes_it(
) {
    // Prepared here: inside the test host only the paths are computed.
    let rootfs = bulkhead_tests::artifacts().debian_image();
    bulkhead_tests::in_vm_host(
        test_path!(
            a_sandbox_on_the_debian_image_writes_to_its_scratch_disk_keeps_it_across_a_pause_and_delete_removes_it
        ),
        || {
            // Arrange (the daemon formats scratch disks with the test host's `mkfs.ext4`)
            let (daemon, name) = debian_image_daemon(&rootfs);
            let client = daemon.client();
            let rt = rt();
            let spec = bulkhead_client::CreateSandbox {
                image: Some(name.clone()),
                disk_mib: Some(64),
                ..small(256)
            };
            let fail = |what: &str, e: bulkhead_client::Error| -> ! {
                panic!(
                    "{what}: {e}\n{}\n--- daemon\n{}",
                    vm_logs(&daemon.vms_dir()),
                    daemon.log()
                )
            };
            let sb = rt
                .block_on(client.create(&spec))
                .unwrap_or_else(|e| fail("create", e));
            let scratch = scratch_disks(&daemon.vms_dir());
            let collect = |argv: &[&str]| {
                let mut exec = ExecSpec::new(argv.iter().copied());
                exec.timeout_s = Some(300.0);
                rt.block_on(client.exec_collect(&sb.id, &exec))
                    .unwrap_or_else(|e| fail(argv[0], e))
            };

            // Act
            let python = collect(&["python3", "-c", "print(6*7)"]);
            rt.block_on(client.write_file(&sb.id, "/root/note.txt", 0o644, b"kept".to_vec()))
                .unwrap_or_else(|e| fail("write_file", e));
            let written = collect(&[
                "sh",
                "-c",
                "cat /root/note.txt && dd if=/dev/urandom of=/root/blob bs=1M count=16 2>/dev/null && sync && md5sum /root/blob",
            ]);
            let allocated = |disk: &std::path::Path| {
                std::fs::metadata(disk)
                    .map(|m| std::os::unix::fs::MetadataExt::blocks(&m) * 512)
                    .unwrap_or(0)
            };
            let allocated_before_pause = allocated(&scratch[0]);
            rt.block_on(client.pause(&sb.id))
                .unwrap_or_else(|e| fail("pause", e));
            let scratch_while_paused = scratch_disks(&daemon.vms_dir());
            let saved_disk = daemon.state_dir.join("paused").join(&sb.id).join("disk-1.img");
            let saved_while_paused = saved_disk.exists();
            let resumed = rt
                .block_on(client.resume(&sb.id))
                .unwrap_or_else(|e| fail("resume", e));
            let read_back = collect(&["sh", "-c", "cat /root/note.txt && md5sum /root/blob"]);
            let scratch_after_resume = scratch_disks(&daemon.vms_dir());
            // The resumed VM's disk is copy-on-write over the saved one: it holds what the VM
            // wrote since, not the 16 MiB from before; a second pause makes it whole.
            let allocated_after_resume = allocated(&scratch_after_resume[0]);
            collect(&["sh", "-c", "echo second > /root/second && sync"]);
            rt.block_on(client.pause(&sb.id))
                .unwrap_or_else(|e| fail("second pause", e));
            let resumed_again = rt
                .block_on(client.resume(&sb.id))
                .unwrap_or_else(|e| fail("second resume", e));
            let script = "cat /root/note.txt /root/second && md5sum /root/blob";
            let read_after_two = collect(&["sh", "-c", script]);
            let scratch_after_two = scratch_disks(&daemon.vms_dir());
            rt.block_on(client.delete(&sb.id))
                .unwrap_or_else(|e| fail("delete", e));

            // Assert
            assert_eq!(sb.image.as_deref(), Some(name.as_str()));
            assert_eq!(sb.disk_mib, Some(64));
            assert_eq!(scratch.len(), 1, "one scratch disk while it runs");
            assert_eq!(String::from_utf8_lossy(&python.stdout), "42\n", "{python:?}");
            let written = String::from_utf8_lossy(&written.stdout).into_owned();
            assert!(written.starts_with("kept") && written.contains("/root/blob"), "{written}");
            assert!(
                allocated_before_pause >= 16 << 20,
                "the guest's 16 MiB did not land on the scratch disk \
                 ({allocated_before_pause} bytes allocated)"
            );
            assert_eq!(scratch_while_paused, Vec::<std::path::PathBuf>::new());
            assert!(saved_while_paused, "no {} while paused", saved_disk.display());
            assert_eq!(String::from_utf8_lossy(&read_back.stdout), written);
            assert_eq!(scratch_after_resume.len(), 1, "the resumed VM's scratch disk");
            assert!(
                allocated_after_resume < 8 << 20,
                "the resumed VM's disk was copied ({allocated_after_resume} bytes allocated)"
            );
            // note.txt has no newline: "kept", then md5sum's line.
            let md5_line = written.strip_prefix("kept").unwrap_or_default();
            assert_eq!(
                String::from_utf8_lossy(&read_after_two.stdout),
                format!("keptsecond\n{md5_line}"),
                "after a second pause and resume"
            );
            for disk in scratch.iter().chain(&scratch_after_resume).chain(&scratch_after_two) {
                assert!(!disk.exists(), "DELETE left {}", disk.display());
            }
            assert_eq!(
                daemon.leftovers(&[
                    sb.vmm_pid.unwrap(),
                    resumed.vmm_pid.unwrap(),
                    resumed_again.vmm_pid.unwrap()
                ]),
                Vec::<String>::new()
            );
        },
    );
}

/// What `sh -c 'echo $TERM $HOME; hostname; sleep 3 & echo done'` printed, with the hostname's
/// 12 hex digits replaced by `ID`.
fn same_shape(stdout: &[u8]) -> String {
    let text = String::from_utf8_lossy(stdout).into_owned();
    text.lines()
        .map(|line| match line.strip_prefix("bh-") {
            Some(id) if id.len() == 12 && id.bytes().all(|b| b.is_ascii_hexdigit()) => {
                "bh-ID".to_owned()
            }
            _ => line.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

vm_test!(
    fn a_daemon_exec_and_bulkhead_run_give_a_command_the_same_environment_and_hostname() {
        // Arrange: the same command through `bulkhead run` and through the daemon.
        let script = "echo $TERM $HOME; hostname; sleep 3 & echo done";
        let a = bulkhead_tests::artifacts();
        let daemon = real_daemon("", &[]);
        let client = daemon.client();
        let rt = rt();
        let sb = create(&daemon, &small(128));

        // Act
        let run = std::process::Command::new(&a.cli)
            .args(["run", "--", "sh", "-c", script])
            .env("BULKHEAD_KERNEL", &a.vmlinux)
            .env("BULKHEAD_INITRD", &a.agent_initrd)
            .env("BULKHEAD_VMM", &a.vmm)
            .output()
            .expect("run bulkhead");
        let started = Instant::now();
        let exec = rt
            .block_on(client.exec_collect(&sb.id, &ExecSpec::new(["sh", "-c", script])))
            .unwrap_or_else(|e| panic!("exec: {e}"));
        let exec_took = started.elapsed();
        rt.block_on(client.delete(&sb.id)).unwrap();

        // Assert: the same environment and hostname scheme. The documented difference: the
        // daemon's exec (like `docker exec`) waits for the background sleep, which holds its
        // output, while a run (like `docker run`) ends with the command.
        assert!(run.status.success(), "{run:?}");
        assert_eq!(exec.exit.code, Some(0), "{exec:?}");
        let expected = "dumb /root\nbh-ID\ndone";
        assert_eq!(same_shape(&run.stdout), expected, "{run:?}");
        assert_eq!(same_shape(&exec.stdout), expected, "{exec:?}");
        assert!(
            exec_took >= Duration::from_secs(3),
            "the exec ended after {exec_took:?}, before the sleep that held its output"
        );
    }
);

vm_test!(
    fn a_sandbox_with_a_network_reaches_only_what_it_allows_also_after_a_daemon_restart() {
        // Arrange: a plain-HTTP test server on the test host's loopback, allowed by CIDR and
        // port; the guest's busybox wget honours http_proxy.
        let server = http_server();
        let port = server.port;
        let mut daemon = real_daemon("", &[]);
        let client = daemon.client();
        let rt = rt();
        let request = bulkhead_client::CreateSandbox {
            network: Some(server.network()),
            ..small(128)
        };
        let sb = create(&daemon, &request);
        let script = format!(
            "wget -q -O - http://127.0.0.1:{port}/; echo; wget -q -O - http://127.0.0.1:1/ 2>&1"
        );

        let fetch = ExecSpec::new(["sh", "-c", &script]);

        // Act: before and after the daemon (and the proxy in it) is killed and restarted.
        let out = rt
            .block_on(client.exec_collect(&sb.id, &fetch))
            .unwrap_or_else(|e| panic!("exec: {e}"));
        daemon.kill9();
        daemon.spawn(&[]);
        let adopted = rt
            .block_on(client.exec_collect(&sb.id, &fetch))
            .unwrap_or_else(|e| panic!("exec after the restart: {e}"));
        let log = rt.block_on(client.egress_log(&sb.id)).unwrap();
        let info = rt.block_on(client.get(&sb.id)).unwrap();
        rt.block_on(client.delete(&sb.id)).unwrap();

        // Assert
        for out in [&out, &adopted] {
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(stdout.contains("hello from the test server"), "{out:?}");
            assert!(stdout.contains("403"), "port 1 was not refused: {out:?}");
        }
        let allowed = log
            .lines()
            .filter(|l| l.contains(&format!("\"port\":{port}")) && l.contains("\"allow\""))
            .count();
        assert_eq!(allowed, 2, "one allowed request per daemon: {log}");
        let denied = log
            .lines()
            .filter(|l| l.contains("\"port\":1,") && l.contains("\"deny\""))
            .count();
        assert_eq!(denied, 2, "one denied request per daemon: {log}");
        assert_eq!(
            info.network.and_then(|n| n.mode).as_deref(),
            Some("allowlist")
        );
    }
);

vm_test!(
    fn exec_i_streams_200_mib_into_a_real_guest_and_ends_with_the_command_not_our_stdin() {
        // Arrange: 200 MiB in a file (far beyond a request body), and its digest here.
        let daemon = real_daemon("", &[]);
        let rt = rt();
        let sb = create(&daemon, &small(256));
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("input");
        let block: Vec<u8> = (0..1 << 20).map(|i: u32| (i * 13 % 251) as u8).collect();
        std::fs::write(&input, block.repeat(200)).unwrap();
        let digest = |out: &[u8]| {
            String::from_utf8_lossy(out)
                .split_whitespace()
                .next()
                .unwrap_or_default()
                .to_owned()
        };
        let expected = digest(
            &std::process::Command::new("sha256sum")
                .arg(&input)
                .output()
                .unwrap()
                .stdout,
        );
        let exec = |args: &[&str]| {
            let mut cmd = std::process::Command::new(crate::common::cli());
            cmd.args(["exec", "--socket"])
                .arg(&daemon.socket)
                .arg("-i")
                .arg(&sb.id)
                .arg("--")
                .args(args);
            cmd
        };

        // Act
        let summed = exec(&["sha256sum"])
            .stdin(std::fs::File::open(&input).unwrap())
            .output()
            .unwrap();
        let mut echo = exec(&["echo", "hi"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let _held_open = echo.stdin.take();
        let echo_ended = wait_until(Duration::from_secs(120), || {
            echo.try_wait().unwrap().is_some()
        });
        rt.block_on(daemon.client().delete(&sb.id)).unwrap();

        // Assert
        assert!(summed.status.success(), "{summed:?}");
        assert_eq!(digest(&summed.stdout), expected);
        assert!(
            echo_ended,
            "exec -i waited for our open stdin, not for the command"
        );
        assert_eq!(echo.wait_with_output().unwrap().stdout, b"hi\n");
    }
);

vm_test!(
    fn the_python_sdk_passes_its_integration_tests_against_real_vms() {
        // Arrange: a mount root the jailed (unprivileged) VMM may enter.
        let root = bulkhead_tests::socket_dir();
        let mode = std::os::unix::fs::PermissionsExt::from_mode(0o755);
        std::fs::set_permissions(root.path(), mode).unwrap();
        let daemon = real_daemon("", &["--mount-root", root.path().to_str().unwrap()]);

        // Act
        let out = crate::common::real::run_python_sdk_suite(&daemon, root.path());

        // Assert
        let stderr = String::from_utf8_lossy(&out.stderr);
        let ran = format!("Ran {} tests", crate::common::real::PYTHON_SDK_TESTS);
        assert!(
            out.status.success() && stderr.contains(&ran) && stderr.trim_end().ends_with("OK"),
            "{}\n{}\n--- daemon\n{}",
            bulkhead_tests::describe(&out),
            vm_logs(&daemon.vms_dir()),
            daemon.log()
        );
        assert_eq!(daemon.leftovers(&[]), Vec::<String>::new());
    }
);
