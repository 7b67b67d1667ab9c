//! The jailed VMM (issue 7, "Jail each VMM process"), seen from the host: every property of the
//! jail read from `/proc/<pid>/` of the jailed process — the child of the process the sandbox
//! spawned — while its guest answers commands. The tests run as root in the test host, so
//! `Sandbox::start` jails by default.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bulkhead_sandbox::{jail, Mount, Sandbox};
use bulkhead_tests::procs::{ends_within, pidfd};
use bulkhead_tests::{artifacts, guest_test, run_sh, sandbox_config};

/// uid:gid of the writable share (the VMM then runs as its owner).
const OWNER: (u32, u32) = (1000, 1000);

/// The one child of `parent`: the jailed VMM, PID 1 of its own PID namespace.
fn jailed_child(parent: u32) -> u32 {
    let children: Vec<u32> = fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| status(*pid).get("PPid").map(String::as_str) == Some(&parent.to_string()))
        .collect();
    assert_eq!(children.len(), 1, "children of {parent}: {children:?}");
    children[0]
}

/// `/proc/<pid>/status` (or a task's) as field → value; empty when the process is gone.
fn status_of(path: &Path) -> BTreeMap<String, String> {
    fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.to_owned(), v.trim().to_owned()))
        .collect()
}

fn status(pid: u32) -> BTreeMap<String, String> {
    status_of(&PathBuf::from(format!("/proc/{pid}/status")))
}

/// Mount point → its per-mount options, from `/proc/<pid>/mountinfo` (proc(5)).
fn mounts(pid: u32) -> BTreeMap<String, BTreeSet<String>> {
    fs::read_to_string(format!("/proc/{pid}/mountinfo"))
        .unwrap()
        .lines()
        .map(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            let options = fields[5].split(',').map(str::to_owned).collect();
            (fields[4].to_owned(), options)
        })
        .collect()
}

fn has(options: &BTreeSet<String>, wanted: &[&str]) -> bool {
    wanted.iter().all(|w| options.contains(*w))
}

fn namespace(pid: &str, kind: &str) -> PathBuf {
    fs::read_link(format!("/proc/{pid}/ns/{kind}")).unwrap()
}

fn resolved(path: &Path) -> String {
    fs::canonicalize(path).unwrap().display().to_string()
}

/// Asserts the credential, namespace and seccomp properties of the jailed process `pid`.
fn assert_unprivileged(pid: u32, ids: (u32, u32)) {
    let status = status(pid);
    let uid = ids.0.to_string();
    let gid = ids.1.to_string();
    assert_eq!(
        status["Uid"].split_whitespace().collect::<Vec<_>>(),
        vec![uid.as_str(); 4]
    );
    assert_eq!(
        status["Gid"].split_whitespace().collect::<Vec<_>>(),
        vec![gid.as_str(); 4]
    );
    assert_eq!(status["Groups"], "");
    for set in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert_eq!(status[set], "0000000000000000", "{set}");
    }
    assert_eq!(status["NoNewPrivs"], "1");
    for kind in ["mnt", "pid", "net", "ipc", "uts"] {
        assert_ne!(
            namespace(&pid.to_string(), kind),
            namespace("self", kind),
            "{kind}"
        );
    }
    // seccomp is on unless BULKHEAD_SECCOMP turns it off (`log` installs filters too).
    if std::env::var("BULKHEAD_SECCOMP").as_deref() != Ok("off") {
        for task in fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
            let task = status_of(&task.unwrap().path().join("status"));
            assert_eq!(task["Seccomp"], "2", "thread {}", task["Name"]);
        }
    }
}

/// Asserts that `pid` sees exactly `binds` (path → writable) besides its root, `/dev` and
/// `/proc`, each with the least rights, and only four device nodes.
fn assert_mounts(pid: u32, binds: &[(String, bool)]) {
    let seen = mounts(pid);
    let mut expected: BTreeSet<String> = binds.iter().map(|(p, _)| p.clone()).collect();
    expected.extend(["/", "/dev", "/proc"].map(String::from));
    assert_eq!(seen.keys().cloned().collect::<BTreeSet<_>>(), expected);
    assert!(
        has(&seen["/"], &["ro", "nosuid", "nodev", "noexec"]),
        "{:?}",
        seen["/"]
    );
    assert!(
        has(&seen["/dev"], &["ro", "nosuid", "noexec"]),
        "{:?}",
        seen["/dev"]
    );
    assert!(has(&seen["/proc"], &["nosuid", "nodev", "noexec"]));
    for (path, writable) in binds {
        let mode = if *writable { "rw" } else { "ro" };
        assert!(
            has(&seen[path], &[mode, "nosuid", "nodev", "noexec"]),
            "{path}: {:?}",
            seen[path]
        );
    }
    let dev: BTreeSet<String> = fs::read_dir(format!("/proc/{pid}/root/dev"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        dev,
        ["kvm", "null", "urandom", "zero"].map(String::from).into()
    );
}

/// Destroys `sandbox` and asserts that neither its processes nor its files nor a mount remain.
fn assert_destroy_leaves_nothing(sandbox: Sandbox, pids: [u32; 2]) {
    let dir = sandbox.runtime_path().unwrap().to_owned();
    sandbox.destroy().unwrap();
    for pid in pids {
        assert!(status(pid).is_empty(), "process {pid} survived");
    }
    assert!(!dir.exists(), "{} left behind", dir.display());
    let host_mounts = fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !host_mounts.contains(&dir.display().to_string()),
        "{host_mounts}"
    );
}

guest_test!(
    fn a_vm_without_shares_runs_as_a_fresh_uid_with_nothing_but_its_files() {
        // Arrange
        let sandbox = Sandbox::start(&sandbox_config()).unwrap();
        let supervisor = sandbox.vmm_pid().unwrap();
        let dir = sandbox.runtime_path().unwrap().to_owned();
        let fresh = jail::fresh_id(fs::metadata(&dir).unwrap().ino());

        // Act
        let vmm = jailed_child(supervisor);
        let out = run_sh(&sandbox, "echo jailed; id -u");

        // Assert
        assert_eq!(String::from_utf8_lossy(&out.stdout), "jailed\n0\n");
        assert_unprivileged(vmm, (fresh, fresh));
        let a = artifacts();
        assert_mounts(
            vmm,
            &[
                (resolved(&a.vmlinux), false),
                (resolved(&a.agent_initrd), false),
                (dir.display().to_string(), true),
            ],
        );
        assert_destroy_leaves_nothing(sandbox, [supervisor, vmm]);
    }
);

guest_test!(
    fn a_vm_with_shares_runs_as_their_owner_and_the_shares_keep_working() {
        // Arrange
        let base = tempfile::Builder::new()
            .prefix("bulkhead-jail-")
            .tempdir()
            .unwrap();
        let (rw, ro) = (base.path().join("rw"), base.path().join("ro"));
        fs::create_dir(&rw).unwrap();
        fs::create_dir(&ro).unwrap();
        std::os::unix::fs::chown(&rw, Some(OWNER.0), Some(OWNER.1)).unwrap();
        fs::write(ro.join("a.txt"), b"read-only a\n").unwrap();
        let config = bulkhead_sandbox::SandboxConfig {
            mounts: vec![
                Mount {
                    host: rw.clone(),
                    guest: "/mnt/rw".into(),
                    read_only: false,
                },
                Mount {
                    host: ro.clone(),
                    guest: "/mnt/ro".into(),
                    read_only: true,
                },
            ],
            ..sandbox_config()
        };
        let sandbox = Sandbox::start(&config).unwrap();
        let supervisor = sandbox.vmm_pid().unwrap();
        let dir = sandbox.runtime_path().unwrap().to_owned();

        // Act
        let vmm = jailed_child(supervisor);
        let out = run_sh(
            &sandbox,
            "cat /mnt/ro/a.txt; echo new > /mnt/rw/new.txt && echo written",
        );

        // Assert
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "read-only a\nwritten\n"
        );
        let created = fs::metadata(rw.join("new.txt")).unwrap();
        assert_eq!((created.uid(), created.gid()), OWNER);
        assert_unprivileged(vmm, OWNER);
        let a = artifacts();
        assert_mounts(
            vmm,
            &[
                (resolved(&a.vmlinux), false),
                (resolved(&a.agent_initrd), false),
                (dir.display().to_string(), true),
                (resolved(&rw), true),
                (resolved(&ro), false),
            ],
        );
        assert_destroy_leaves_nothing(sandbox, [supervisor, vmm]);
    }
);

guest_test!(
    fn a_sigkilled_supervisor_takes_the_jailed_vmm_with_it() {
        // Arrange
        let mut sandbox = Sandbox::start(&sandbox_config()).unwrap();
        let supervisor = sandbox.vmm_pid().unwrap();
        let vmm = pidfd(jailed_child(supervisor));

        // Act
        // SAFETY: kill(2) of the sandbox's own VMM process, which this test started.
        unsafe { libc::kill(supervisor as libc::pid_t, libc::SIGKILL) };
        let exit = sandbox
            .wait_exit(std::time::Duration::from_secs(30))
            .unwrap();

        // Assert
        assert_eq!(
            exit.map(|e| e.status),
            Some(bulkhead_sandbox::VmmExit::Signal(libc::SIGKILL))
        );
        assert!(
            ends_within(&vmm, Duration::from_secs(30)),
            "the jailed VMM outlived its supervisor"
        );
    }
);

guest_test!(
    fn sigterm_to_the_supervisor_stops_the_vm_cleanly() {
        // Arrange
        let mut sandbox = Sandbox::start(&sandbox_config()).unwrap();
        let supervisor = sandbox.vmm_pid().unwrap();

        // Act
        // SAFETY: kill(2) of the sandbox's own VMM process, which this test started.
        unsafe { libc::kill(supervisor as libc::pid_t, libc::SIGTERM) };
        let exit = sandbox
            .wait_exit(std::time::Duration::from_secs(60))
            .unwrap();

        // Assert: the jailed VMM (PID 1 of its namespace) handled the signal, exited 0 and
        // wrote its exit report through the descriptor it opened before entering the jail.
        let end = exit.expect("the VM is still running after SIGTERM");
        assert_eq!(end.status, bulkhead_sandbox::VmmExit::Code(0), "{end}");
        assert_eq!(
            end.report.map(|r| r.reason),
            Some(bulkhead_vmm::exit_report::EndReason::Stopped)
        );
    }
);

guest_test!(
    fn a_guest_reaches_a_host_listener_bound_with_listen_on_host_port() {
        // Arrange: the jailed VMM connects to `<vm.sock>_PORT` as its own uid.
        let sandbox = Sandbox::start(&sandbox_config()).unwrap();
        let listener = sandbox.listen_on_host_port(5001).unwrap();
        let (done, received) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::Read;
            let (mut stream, _) = listener.accept().unwrap();
            let mut text = String::new();
            stream.read_to_string(&mut text).unwrap();
            let _ = done.send(text);
        });

        // Act
        let out = run_sh(
            &sandbox,
            "echo to-the-host | bulkhead-test-init vsock-send 5001",
        );

        // Assert
        assert_eq!(
            out.status.code,
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // Bounded: a connection that never came would leave the receiver waiting.
        let text = received.recv_timeout(std::time::Duration::from_secs(60));
        assert_eq!(text.as_deref(), Ok("to-the-host\n"));
        sandbox.destroy().unwrap();
    }
);
