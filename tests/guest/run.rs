//! `bulkhead run` end to end: the run issue's acceptance, through the CLI binary.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use bulkhead_tests::procs::{ends_within, pidfd};
use bulkhead_tests::{
    artifacts, describe, guest_test, kernel_without_vsock, sha256_hex, socket_dir,
};

/// Runs `bulkhead run ARGS...` with the test kernel and agent image, feeding `stdin`.
fn bulkhead_run(args: &[&str], stdin: &[u8]) -> Output {
    let a = artifacts();
    let mut child = a
        .cli_command()
        .arg("run")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn bulkhead");
    let mut pipe = child.stdin.take().expect("stdin pipe");
    let data = stdin.to_vec();
    let feeder = std::thread::spawn(move || {
        // The command may exit without reading everything; a broken pipe is fine.
        let _ = pipe.write_all(&data);
    });
    let out = child.wait_with_output().expect("wait for bulkhead");
    feeder.join().expect("stdin feeder");
    out
}

guest_test!(
    fn uname_reports_the_guest_kernel_not_the_host() {
        let host_release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();

        let out = bulkhead_run(&["--", "uname", "-r"], b"");

        assert!(out.status.success(), "{}", describe(&out));
        let guest_release = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        assert!(guest_release.starts_with("6.1."), "{}", describe(&out));
        assert_ne!(guest_release, host_release.trim());
    }
);

guest_test!(
    fn exit_codes_and_streams_come_back() {
        let out = bulkhead_run(
            &["--", "sh", "-c", "echo to-out; echo to-err >&2; exit 7"],
            b"",
        );

        assert_eq!(out.status.code(), Some(7), "{}", describe(&out));
        assert_eq!(out.stdout, b"to-out\n");
        assert_eq!(out.stderr, b"to-err\n");
    }
);

guest_test!(
    fn a_command_killed_by_a_signal_exits_128_plus_n() {
        let out = bulkhead_run(&["--", "sh", "-c", "kill -9 $$"], b"");

        assert_eq!(out.status.code(), Some(137), "{}", describe(&out));
    }
);

guest_test!(
    fn ten_mib_of_random_output_arrive_byte_identical() {
        let script = "head -c 10485760 /dev/urandom > /tmp/r && sha256sum /tmp/r >&2 && cat /tmp/r";

        let out = bulkhead_run(&["--memory", "256", "--", "sh", "-c", script], b"");

        assert!(out.status.success(), "{}", describe(&out));
        assert_eq!(out.stdout.len(), 10 << 20);
        let guest_sum = String::from_utf8_lossy(&out.stderr);
        assert!(
            guest_sum.starts_with(&sha256_hex(&out.stdout)),
            "{}",
            guest_sum
        );
    }
);

guest_test!(
    fn many_small_writes_arrive_complete_and_in_order() {
        // Arrange: `seq` writes its 2 MB one line per write(2), so the agent sends many small
        // frames (a reviewer saw this output arrive altered once).
        let expected: String = (1..=300_000).map(|i| format!("{i}\n")).collect();

        // Act
        let out = bulkhead_run(&["--", "seq", "1", "300000"], b"");

        // Assert
        assert!(out.status.success(), "{}", describe(&out));
        assert_eq!(out.stdout.len(), expected.len());
        assert!(out.stdout == expected.as_bytes(), "output altered");
    }
);

guest_test!(
    fn ten_mib_piped_into_stdin_arrive_byte_identical() {
        let data: Vec<u8> = (0..10u32 << 20)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();

        let out = bulkhead_run(&["--", "sha256sum"], &data);

        assert!(out.status.success(), "{}", describe(&out));
        assert!(
            String::from_utf8_lossy(&out.stdout).starts_with(&sha256_hex(&data)),
            "{}",
            describe(&out)
        );
    }
);

guest_test!(
    fn split_utf8_and_nul_bytes_arrive_unchanged() {
        // The two halves of "é" and a NUL, written by separate printf calls (separate frames).
        let script = r"printf '\303'; sleep 0.2; printf '\251\000x'; printf '\000\303' >&2; sleep 0.2; printf '\251' >&2";

        let out = bulkhead_run(&["--", "sh", "-c", script], b"");

        assert!(out.status.success(), "{}", describe(&out));
        assert_eq!(out.stdout, [0xc3, 0xa9, 0x00, b'x']);
        assert_eq!(out.stderr, [0x00, 0xc3, 0xa9]);
    }
);

guest_test!(
    fn timeout_kills_the_command_and_reports_124() {
        let started = std::time::Instant::now();

        let out = bulkhead_run(
            &["--timeout", "2", "--", "sh", "-c", "sleep 100 & sleep 100"],
            b"",
        );

        assert_eq!(out.status.code(), Some(124), "{}", describe(&out));
        assert!(String::from_utf8_lossy(&out.stderr).contains("timed out"));
        // Far below the 100 s the command would take: the group was killed, not waited for.
        assert!(
            started.elapsed().as_secs() < 90,
            "took {:?}",
            started.elapsed()
        );
    }
);

guest_test!(
    fn the_run_ends_with_the_command_not_with_its_background_processes() {
        // Like `docker run`: the background sleep holds stdout but dies with the command.
        let out = bulkhead_run(
            &[
                "--timeout",
                "20",
                "--",
                "sh",
                "-c",
                "sleep 1000 & echo done",
            ],
            b"",
        );

        assert_eq!(out.status.code(), Some(0), "{}", describe(&out));
        assert_eq!(out.stdout, b"done\n", "{}", describe(&out));
    }
);

guest_test!(
    fn env_workdir_and_user_reach_the_command() {
        let out = bulkhead_run(
            &[
                "-e",
                "GREETING=hi there",
                "--workdir",
                "/tmp",
                "--user",
                "65534",
                "--",
                "sh",
                "-c",
                "echo \"$GREETING\"; pwd; id -u",
            ],
            b"",
        );

        assert!(out.status.success(), "{}", describe(&out));
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "hi there\n/tmp\n65534\n"
        );
    }
);

guest_test!(
    fn sigterm_to_bulkhead_run_reaches_the_command_and_the_vm_is_torn_down() {
        let runtime = socket_dir();
        let mut child = spawn_run(
            &["--", "sh", "-c", "echo started; sleep 100"],
            runtime.path(),
        );
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line, "started\n");

        let (status, stderr) = sigterm_and_wait(&mut child);

        assert_eq!(
            status.code(),
            Some(128 + libc::SIGTERM),
            "{status}: {stderr}"
        );
        let left: Vec<_> = std::fs::read_dir(runtime.path()).unwrap().collect();
        assert!(left.is_empty(), "runtime files left: {left:?}");
    }
);

guest_test!(
    fn sigterm_while_the_vm_boots_stops_everything_and_leaves_no_runtime_files() {
        // Arrange: start a run and wait until its VMM has been given its config.
        let runtime = socket_dir();
        let mut child = spawn_run(&["--", "true"], runtime.path());
        let vm_json = wait_for_vm_json(runtime.path());

        // Act
        let (status, stderr) = sigterm_and_wait(&mut child);

        // Assert
        assert_eq!(
            status.code(),
            Some(128 + libc::SIGTERM),
            "{status}: {stderr}"
        );
        let left: Vec<_> = std::fs::read_dir(runtime.path()).unwrap().collect();
        assert!(left.is_empty(), "runtime files left: {left:?}");
        assert!(!vm_json.exists());
    }
);

/// Starts `bulkhead run ARGS...` (flags, `--`, the command) with the test kernel and image, its
/// runtime files in `runtime`, stdout and stderr piped.
fn spawn_run(args: &[&str], runtime: &std::path::Path) -> std::process::Child {
    let a = artifacts();
    a.cli_command()
        .arg("run")
        .args(args)
        .env("BULKHEAD_RUNTIME_DIR", runtime)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn bulkhead")
}

/// Sends SIGTERM to `child` and returns its exit status and stderr.
fn sigterm_and_wait(child: &mut std::process::Child) -> (std::process::ExitStatus, String) {
    // SAFETY: SIGTERM to our own child process, not yet reaped.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let status = child.wait().unwrap();
    (status, take_stderr(child))
}

/// All of `child`'s (piped) stderr, read to its end.
fn take_stderr(child: &mut std::process::Child) -> String {
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    stderr
}

/// Waits (up to 120 s) until a sandbox config `*/sb-*/vm.json` appears below `dir`.
fn wait_for_vm_json(dir: &std::path::Path) -> std::path::PathBuf {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        let found = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .flat_map(|run| {
                std::fs::read_dir(run.path())
                    .into_iter()
                    .flatten()
                    .flatten()
            })
            .map(|sb| sb.path().join("vm.json"))
            .find(|p| p.is_file());
        if let Some(path) = found {
            return path;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no vm.json under {dir:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// A `bulkhead run ARGS...` whose VM is stopped (SIGSTOP) once its command, which must print
/// `started`, runs: the agent can never report anything again.
struct StalledRun {
    child: std::process::Child,
    runtime: tempfile::TempDir,
    /// The run's bulkhead-vmm processes (deepest first) and a pidfd of each.
    vmms: Vec<(u32, std::os::fd::OwnedFd)>,
}

impl StalledRun {
    fn start(args: &[&str]) -> StalledRun {
        let runtime = socket_dir();
        let mut child = spawn_run(args, runtime.path());
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        if line != "started\n" {
            // With the run's stderr in the message (a nested guest crash there makes the harness
            // retry the test).
            let err = take_stderr(&mut child);
            panic!("the command did not start: stdout {line:?}, stderr: {err}");
        }
        let pids = vmm_processes_below(child.id());
        assert!(!pids.is_empty(), "no bulkhead-vmm below {}", child.id());
        let vmms: Vec<_> = pids.into_iter().map(|pid| (pid, pidfd(pid))).collect();
        // The deepest process runs the VM (under the jail, the supervisor's child).
        stop(&vmms[0].1);
        StalledRun {
            child,
            runtime,
            vmms,
        }
    }

    /// Asserts that every bulkhead-vmm of the run ended and no runtime file is left.
    fn assert_nothing_left(&self) {
        for (pid, end) in &self.vmms {
            // SIGKILL reaches a stopped process; it ends at once, or when its supervisor's
            // death (PR_SET_PDEATHSIG) reaches it.
            assert!(
                ends_within(end, Duration::from_secs(60)),
                "bulkhead-vmm {pid} survived"
            );
        }
        let left: Vec<_> = std::fs::read_dir(self.runtime.path()).unwrap().collect();
        assert!(left.is_empty(), "runtime files left: {left:?}");
    }
}

guest_test!(
    fn a_guest_that_stops_answering_is_given_up_after_the_timeout_and_its_vm_destroyed() {
        // Arrange: --timeout 10 leaves a loaded host ample time to stop the VM before the
        // agent's own timeout would end the command.
        let mut run = StalledRun::start(&[
            "--timeout",
            "10",
            "--",
            "sh",
            "-c",
            "echo started; exec sleep 1000",
        ]);

        // Act
        let status = wait_at_most(&mut run.child, Duration::from_secs(180));

        // Assert
        let stderr = take_stderr(&mut run.child);
        assert_eq!(status.code(), Some(124), "{status}: {stderr}");
        assert!(
            stderr.contains(
                "bulkhead: the guest did not report the command's end within --timeout 10 s \
                 (+5 s grace); destroying the VM"
            ),
            "{stderr}"
        );
        run.assert_nothing_left();
    }
);

guest_test!(
    fn sigterm_to_a_run_whose_guest_stopped_answering_ends_it_after_the_grace() {
        // Arrange: no --timeout, so only the signal can end this run.
        let mut run = StalledRun::start(&["--", "sh", "-c", "echo started; exec sleep 1000"]);

        // Act
        // SAFETY: SIGTERM to our own child process, not yet reaped.
        unsafe { libc::kill(run.child.id() as libc::pid_t, libc::SIGTERM) };
        let status = wait_at_most(&mut run.child, Duration::from_secs(180));

        // Assert
        let stderr = take_stderr(&mut run.child);
        assert_eq!(status.code(), Some(143), "{status}: {stderr}");
        assert!(
            stderr.contains(
                "bulkhead: the command did not end within 10 s of signal 15; destroying the VM"
            ),
            "{stderr}"
        );
        run.assert_nothing_left();
    }
);

guest_test!(
    fn a_command_whose_output_reader_went_away_gets_sigpipe_as_on_a_local_pipe() {
        // Arrange: `yes` never ends by itself.
        let runtime = socket_dir();
        let mut child = spawn_run(&["--", "yes"], runtime.path());
        let mut first = [0u8; 10];
        child.stdout.take().unwrap().read_exact(&mut first).unwrap();

        // Act: the reader is gone (our end of the pipe was dropped above).
        let status = wait_at_most(&mut child, Duration::from_secs(180));

        // Assert: killed by SIGPIPE in the guest (128 + 13).
        let stderr = take_stderr(&mut child);
        assert_eq!(&first, b"y\ny\ny\ny\ny\n");
        assert_eq!(status.code(), Some(141), "{status}: {stderr}");
    }
);

guest_test!(
    fn a_closed_stdout_fails_the_run_as_a_local_write_would() {
        // Arrange: fd 1 closed at exec (`bulkhead run ... >&-`).
        let a = artifacts();
        let mut cmd = a.cli_command();
        cmd.args(["run", "--", "sh", "-c", "echo lost; echo seen >&2"])
            .stdin(Stdio::null())
            .stderr(Stdio::piped());
        // SAFETY: close(2) is async-signal-safe; the closure touches no memory of the parent.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                libc::close(libc::STDOUT_FILENO);
                Ok(())
            });
        }

        // Act
        let out = cmd.output().expect("run bulkhead");

        // Assert: the lost stdout fails the run (125); stderr still arrives.
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(125), "{stderr}");
        assert!(stderr.starts_with("seen\n"), "{stderr}");
        assert!(stderr.contains("stdout was closed"), "{stderr}");
    }
);

/// The `bulkhead-vmm` processes below `ancestor` (children, grandchildren, ...), deepest first:
/// under the jail the VM runs in the child of the supervisor that the run spawned.
fn vmm_processes_below(ancestor: u32) -> Vec<u32> {
    let mut found: Vec<(usize, u32)> = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| proc_field(*pid, "Name").as_deref() == Some("bulkhead-vmm"))
        .filter_map(|pid| Some((depth_below(pid, ancestor)?, pid)))
        .collect();
    found.sort_unstable_by(|a, b| b.cmp(a));
    found.into_iter().map(|(_, pid)| pid).collect()
}

/// How many generations `pid` is below `ancestor` (1 for a child); `None` when it is not.
fn depth_below(pid: u32, ancestor: u32) -> Option<usize> {
    let mut current = pid;
    for depth in 1..64 {
        let parent: u32 = proc_field(current, "PPid")?.parse().ok()?;
        if parent == ancestor {
            return Some(depth);
        }
        if parent <= 1 {
            return None;
        }
        current = parent;
    }
    None
}

/// The value of `field` in `/proc/<pid>/status`; `None` when the process is gone.
fn proc_field(pid: u32, field: &str) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|l| {
        let (key, value) = l.split_once(':')?;
        (key == field).then(|| value.trim().to_owned())
    })
}

/// Sends SIGSTOP to the process behind the pidfd `fd` (pidfd_send_signal(2): the pidfd names
/// that process and no other, even if its pid was reused).
fn stop(fd: &std::os::fd::OwnedFd) {
    use std::os::fd::AsRawFd;
    // SAFETY: pidfd_send_signal takes a pidfd we own, a signal number, no siginfo (null) and no
    // flags; it reads no memory of ours.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd.as_raw_fd(),
            libc::SIGSTOP,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    assert_eq!(rc, 0, "SIGSTOP: {}", std::io::Error::last_os_error());
}

/// Waits for `child` to exit; past `limit` it is SIGKILLed and the test fails (a hung run must
/// fail the test, not stall the suite).
fn wait_at_most(child: &mut std::process::Child, limit: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("bulkhead run was still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

guest_test!(
    fn a_kernel_without_vsock_is_a_clear_error() {
        let kernel = kernel_without_vsock();

        let out = bulkhead_run(
            &[
                "--kernel",
                kernel.to_str().unwrap(),
                "--boot-timeout",
                "300",
                "--",
                "true",
            ],
            b"",
        );

        assert_eq!(out.status.code(), Some(125), "{}", describe(&out));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("agent") && err.contains("bulkhead: error:"),
            "{err}"
        );
    }
);

#[test]
fn missing_command_is_a_usage_error() {
    let out = Command::new(&artifacts().cli).arg("run").output().unwrap();

    assert_eq!(out.status.code(), Some(125), "{}", describe(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("CMD"),
        "{}",
        describe(&out)
    );
}

#[test]
fn unknown_flag_is_a_usage_error() {
    let out = Command::new(&artifacts().cli)
        .args(["run", "--bogus", "--", "true"])
        .output()
        .unwrap();

    assert_eq!(out.status.code(), Some(125), "{}", describe(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--bogus"));
}

/// Runs `bulkhead run ARGS -- true`, which must be refused before anything starts.
fn refused_run(args: &[&str]) -> Output {
    Command::new(&artifacts().cli)
        .arg("run")
        .args(args)
        .args(["--", "true"])
        .output()
        .unwrap()
}

/// Asserts a usage error: exit 125 and `expected` on stderr, with no VM and no KVM hint.
fn assert_refused(out: &Output, expected: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(125), "{}", describe(out));
    assert!(stderr.contains(expected), "{}", describe(out));
    assert!(!stderr.contains("test host"), "{}", describe(out));
}

#[test]
fn zero_memory_is_refused_before_any_vm_starts() {
    let out = refused_run(&["--memory", "0"]);

    assert_refused(
        &out,
        "invalid value '0' for '--memory <MIB>': guest memory must be between",
    );
}

#[test]
fn memory_outside_the_vmm_limits_is_refused() {
    use bulkhead_vmm::vstate::memory::{MAX_MEMORY_MIB, MIN_MEMORY_MIB};
    let expected =
        format!("guest memory must be between {MIN_MEMORY_MIB} and {MAX_MEMORY_MIB} MiB");

    let below = refused_run(&["--memory", &(MIN_MEMORY_MIB - 1).to_string()]);
    let above = refused_run(&["--memory", &(u64::from(MAX_MEMORY_MIB) + 1).to_string()]);

    assert_refused(&below, &expected);
    assert_refused(&above, &expected);
}

#[test]
fn zero_vcpus_and_more_than_the_vmm_takes_are_refused() {
    let max = bulkhead_vmm::config::MAX_VCPUS;
    let expected = format!("the number of vCPUs must be between 1 and {max}");

    let zero = refused_run(&["--vcpus", "0"]);
    let many = refused_run(&["--vcpus", &(u32::from(max) + 1).to_string()]);

    assert_refused(&zero, &expected);
    assert_refused(&many, &expected);
}

#[test]
fn a_zero_timeout_is_refused() {
    let run = refused_run(&["--timeout", "0"]);
    let boot = refused_run(&["--boot-timeout", "0"]);

    assert_refused(&run, "invalid value '0' for '--timeout <SECS>'");
    assert_refused(&boot, "invalid value '0' for '--boot-timeout <SECS>'");
}

#[test]
fn tty_without_a_terminal_on_stdin_is_refused_before_anything_boots() {
    // `output()` gives the run no stdin (not a terminal).
    let out = refused_run(&["-t"]);

    assert_refused(&out, "the input device is not a TTY");
}
