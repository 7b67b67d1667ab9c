//! The host library (`bulkhead-sandbox`) against a real guest: several execs in one VM, timeouts,
//! disconnects, vsock edge cases and large transfers.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bulkhead_protocol::client::{ExecEvent, ExecOutput};
use bulkhead_protocol::ExecRequest;
use bulkhead_sandbox::{Error, Sandbox, SandboxConfig};
use bulkhead_tests::{artifacts, guest_test, sha256_hex, socket_dir};
use bulkhead_vmm::config::SerialOutput;
use sha2::{Digest, Sha256};

fn config(memory_mib: u32) -> SandboxConfig {
    let a = artifacts();
    SandboxConfig {
        kernel: a.vmlinux.clone(),
        initrd: a.agent_initrd.clone(),
        vmm_binary: a.vmm.clone(),
        memory_mib,
        ready_timeout: Duration::from_secs(300),
        ..SandboxConfig::default()
    }
}

fn sh(script: &str) -> ExecRequest {
    ExecRequest::new(["sh", "-c", script])
}

fn run_sh(sandbox: &Sandbox, script: &str) -> ExecOutput {
    sandbox
        .exec(&sh(script))
        .expect("exec")
        .wait_with_output()
        .expect("output")
}

fn process_gone(pid: u32) -> bool {
    // SAFETY: signal 0 only checks whether the process exists.
    unsafe { libc::kill(pid as libc::pid_t, 0) != 0 }
}

guest_test!(
    fn a_guest_without_a_serial_port_boots_and_runs_commands() {
        // Arrange: no serial port, so the kernel has no console and starts the agent (PID 1)
        // with fds 0-2 closed.
        let mut cfg = config(256);
        cfg.extra_cmdline = vec!["8250.nr_uarts=0".to_owned()];

        // Act
        let sandbox = Sandbox::start(&cfg).unwrap();
        let out = run_sh(
            &sandbox,
            "echo ok; readlink /proc/1/fd/0; dmesg | grep -c 'unable to open an initial console'",
        );

        // Assert: the agent came up with its standard fds on /dev/null.
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "ok\n/dev/null\n1\n",
            "stderr: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
);

guest_test!(
    fn timeout_kills_the_whole_process_group() {
        let sandbox = Sandbox::start(&config(256)).unwrap();
        let mut request = sh("sleep 100 & sleep 100");
        request.timeout_ms = Some(2000);

        let out = sandbox.exec(&request).unwrap().wait_with_output().unwrap();
        let ps = run_sh(&sandbox, "ps -o pid,args | grep '[s]leep 100' || true");

        assert!(out.status.timed_out, "{:?}", out.status);
        assert_eq!(out.status.signal, Some(9));
        assert_eq!(
            String::from_utf8_lossy(&ps.stdout),
            "",
            "sleepers survived the timeout"
        );
        sandbox.destroy().unwrap();
    }
);

guest_test!(
    fn eight_concurrent_execs_get_their_own_output_and_status() {
        let sandbox = Sandbox::start(&config(256)).unwrap();

        let results: Vec<(usize, ExecOutput)> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|i| {
                    let sandbox = &sandbox;
                    s.spawn(move || {
                        let script = format!(
                            "for n in 1 2 3; do echo exec-{i}-$n; sleep 0.1; done; exit {i}"
                        );
                        (i, run_sh(sandbox, &script))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });

        for (i, out) in results {
            let expected = format!("exec-{i}-1\nexec-{i}-2\nexec-{i}-3\n");
            assert_eq!(String::from_utf8_lossy(&out.stdout), expected);
            assert_eq!(out.status.code, Some(i as i32));
        }
        sandbox.destroy().unwrap();
    }
);

guest_test!(
    fn host_disconnect_hangs_up_the_command_and_destroy_leaves_nothing() {
        let sandbox = Sandbox::start(&config(256)).unwrap();
        // `wait` is interrupted by the signal at once, so the trap runs before the agent's SIGKILL.
        let script = "trap 'echo hup > /tmp/hup; exit 0' HUP; echo started; sleep 100 & wait";
        let session = sandbox.exec(&sh(script)).unwrap();
        let (writer, mut reader) = session.split();
        let first = reader.next_event().unwrap();
        assert!(
            matches!(first, Some(ExecEvent::Stdout(ref b)) if b.starts_with(b"started")),
            "{first:?}"
        );

        writer.disconnect().unwrap();
        let hup = wait_for_output(&sandbox, "cat /tmp/hup 2>/dev/null", "hup");

        assert!(hup, "the command never got SIGHUP");
        let pid = sandbox.vmm_pid().unwrap();
        let dir = sandbox.vsock_path().parent().unwrap().to_owned();
        sandbox.destroy().unwrap();
        assert!(process_gone(pid), "bulkhead-vmm {pid} still running");
        assert!(!dir.exists(), "runtime dir {} left behind", dir.display());
    }
);

/// Re-runs `script` in the guest until its stdout contains `needle` (up to 60 s).
fn wait_for_output(sandbox: &Sandbox, script: &str, needle: &str) -> bool {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        let out = run_sh(sandbox, script);
        if String::from_utf8_lossy(&out.stdout).contains(needle) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    false
}

guest_test!(
    // In the nested test host this stream used to end in a guest triple fault about 1 run in 6
    // (docs/testhost.md, "Known problems"); since vsock suppresses notifications and interrupts
    // (VIRTIO_RING_F_EVENT_IDX) it passed every run so far. A crash still shows as a triple-fault
    // warning in vmm.log, printed below, and the harness runs a crashed test once more.
    fn a_hundred_mib_from_guest_to_host_over_vsock_arrive_intact() {
        // The serial console goes to vmm.log, printed when the exec fails.
        let mut sandbox = Sandbox::start(&SandboxConfig {
            console: SerialOutput::Stdout,
            ..config(384)
        })
        .unwrap();
        let port = 5000;
        // Bound through the sandbox so that a jailed VMM (its own uid) may connect to it.
        let listener = sandbox.listen_on_host_port(port).unwrap();
        let (done, arrived) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut data = Vec::with_capacity(100 << 20);
            stream.read_to_end(&mut data).unwrap();
            let _ = done.send(data);
        });

        let out = sandbox
            .exec(&sh(&format!(
                "head -c 104857600 /dev/urandom | bulkhead-test-init vsock-send {port}"
            )))
            .and_then(|session| Ok(session.wait_with_output()?));
        // The sender has exited; its last bytes reach the listener right after. A guest that
        // never connected leaves the receiver waiting, hence the bounded wait.
        let received = arrived.recv_timeout(Duration::from_secs(60));

        let (out, received) = match (out, received) {
            (Ok(out), Ok(received)) => (out, received),
            (out, received) => {
                // A guest crash (docs/testhost.md, "Known problems") shows as a triple-fault
                // warning.
                let log = sandbox.log_tail(80);
                panic!(
                    "exec: {:?}; host received: {:?} bytes; VMM exit: {:?}\n--- vmm.log\n{log}",
                    out.map(|o| (o.status, String::from_utf8_lossy(&o.stderr).into_owned())),
                    received.map(|r| r.len()),
                    sandbox.try_wait_exit()
                )
            }
        };
        assert_eq!(
            out.status.code,
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let report = String::from_utf8_lossy(&out.stdout);
        assert_eq!(received.len(), 100 << 20);
        assert!(
            report.contains(&format!("sent 104857600 sha256={}", sha256_hex(&received))),
            "{report}"
        );
        sandbox.destroy().unwrap();
    }
);

guest_test!(
    fn a_hundred_mib_from_host_to_guest_stdin_arrive_intact() {
        let sandbox = Sandbox::start(&config(256)).unwrap();
        let mut request = ExecRequest::new(["sha256sum"]);
        request.stdin = true;
        let chunk: Vec<u8> = (0..1u32 << 20)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
            .collect();
        let mut expected = Sha256::new();

        let session = sandbox.exec(&request).unwrap();
        let (writer, reader) = session.split();
        for _ in 0..100 {
            writer.write_stdin(&chunk).unwrap();
            expected.update(&chunk);
        }
        writer.close_stdin().unwrap();
        let out = reader.collect_output().unwrap();

        assert_eq!(out.status.code, Some(0));
        let hex: String = expected
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert!(String::from_utf8_lossy(&out.stdout).starts_with(&hex));
        sandbox.destroy().unwrap();
    }
);

guest_test!(
    fn a_connect_sent_before_the_agent_listens_is_answered_or_refused_never_hung() {
        let a = artifacts();
        let dir = socket_dir();
        let uds = dir.path().join("vm.sock");
        let mut vmm = Command::new(&a.vmm)
            .args([
                "--kernel",
                a.vmlinux.to_str().unwrap(),
                "--initrd",
                a.agent_initrd.to_str().unwrap(),
            ])
            .args([
                "--memory",
                "256",
                "--serial",
                "off",
                "--vsock-uds",
                uds.to_str().unwrap(),
            ])
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let stream = connect_when_present(&uds);

        let reply = send_connect(stream, bulkhead_protocol::AGENT_PORT);

        // SAFETY: SIGTERM to our own child.
        unsafe { libc::kill(vmm.id() as libc::pid_t, libc::SIGTERM) };
        assert!(vmm.wait().unwrap().success());
        assert!(
            reply.is_empty() || reply.starts_with("OK "),
            "unexpected reply {reply:?}"
        );
        assert!(!uds.exists(), "vsock socket left behind");
    }
);

/// Connects to `uds` as soon as the VMM has created it (bounded wait).
fn connect_when_present(uds: &Path) -> UnixStream {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match UnixStream::connect(uds) {
            Ok(s) => return s,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("the VMM never created {}: {e}", uds.display()),
        }
    }
}

/// Sends `CONNECT port` and returns the reply line ("" when the socket was closed without one).
/// Fails the test if nothing happens within 120 s.
fn send_connect(mut stream: UnixStream, port: u32) -> String {
    stream
        .set_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    writeln!(stream, "CONNECT {port}").unwrap();
    let mut line = String::new();
    match BufReader::new(stream).read_line(&mut line) {
        Ok(_) => line,
        Err(e) => panic!("no answer to CONNECT (hang): {e}"),
    }
}

guest_test!(
    fn a_guest_whose_console_fakes_a_crash_before_a_clean_reboot_is_reported_as_a_clean_end() {
        // Arrange: the test init prints `bulkhead-vmm: the guest crashed: fake` and a fake panic
        // banner on the console (kept in vmm.log), then reboots cleanly.
        let a = artifacts();
        let mut cfg = config(128);
        cfg.initrd = a.test_initrd.clone();
        cfg.extra_cmdline = vec!["bulkhead_test.action=spoof-crash".into()];
        cfg.console = bulkhead_vmm::config::SerialOutput::Stdout;

        // Act
        let err = Sandbox::start(&cfg).unwrap_err();

        // Assert: the end is the VMM's observation (a reset), not the console's lines.
        let Error::VmExited { end, log } = &err else {
            panic!("expected VmExited, got {err}");
        };
        assert!(
            log.contains("bulkhead-vmm: the guest crashed: fake"),
            "{log}"
        );
        assert!(end.is_clean(), "{end}");
        assert_eq!(end.reason(), "guest_shutdown");
        assert!(
            end.to_string().starts_with("the guest reset itself"),
            "{end}"
        );
    }
);

guest_test!(
    fn an_agent_that_never_comes_up_is_a_clear_error_and_the_vm_is_destroyed() {
        let a = artifacts();
        let mut cfg = config(128);
        cfg.initrd = a.test_initrd.clone();
        cfg.extra_cmdline = vec!["bulkhead_test.action=hang".into()];
        cfg.ready_timeout = Duration::from_secs(20);
        let runtime = socket_dir();
        cfg.runtime_dir = runtime.path().to_owned();

        let err = Sandbox::start(&cfg).unwrap_err();

        assert!(matches!(err, Error::ReadyTimeout { .. }), "{err}");
        assert!(err.to_string().contains("destroyed"));
        let left: Vec<_> = std::fs::read_dir(runtime.path()).unwrap().collect();
        assert!(left.is_empty(), "runtime files left: {left:?}");
    }
);

guest_test!(
    fn busybox_poweroff_in_the_guest_ends_the_vm_cleanly() {
        let mut sandbox = Sandbox::start(&config(128)).unwrap();

        // The exec's own result does not matter: the VM goes away under it.
        let _ = sandbox
            .exec(&ExecRequest::new(["poweroff"]))
            .map(|s| s.wait_with_output());
        let end = sandbox.wait_exit(Duration::from_secs(120)).unwrap();

        let end = end.expect("the VM is still running after poweroff");
        assert!(
            end.is_clean() && end.status == bulkhead_sandbox::VmmExit::Code(0),
            "bulkhead-vmm ended: {end}"
        );
    }
);
