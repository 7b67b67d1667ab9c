//! The containerd shim's microVM backend in a real guest, driven as the shim's task service
//! drives it (create, start, exec, exit, delete), with stdio through FIFOs as containerd makes
//! them. containerd itself is not involved: the bundle is made here (`config.json` and a
//! busybox `rootfs`).

use std::ffi::CString;
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::symlink;
use std::path::Path;
use std::sync::Arc;
use std::thread::JoinHandle;

use bulkhead_shim::backend::{Backend, ContainerSpec, ExecProcess, StartSpec};
use bulkhead_shim::service::{CreateTask, TaskService};
use bulkhead_shim::state::{ProcessKey, Stdio};
use bulkhead_shim::vm::{SharedVmBackend, VmBackend};
use bulkhead_shim::{EventSink, TaskEvent};
use bulkhead_tests::containerd::demo;
use bulkhead_tests::pty::{collect, lflag, terminal};
use bulkhead_tests::{describe, guest_test, sandbox_config};

/// A bundle: `config.json` running `script` with a 128 MiB memory limit, and a busybox rootfs.
fn bundle(dir: &Path, script: &str) {
    let rootfs = dir.join("rootfs");
    for sub in ["bin", "proc", "dev", "sys"] {
        std::fs::create_dir_all(rootfs.join(sub)).unwrap();
    }
    std::fs::copy("/bin/busybox", rootfs.join("bin/busybox")).unwrap();
    for applet in ["sh", "cat", "echo", "uname", "grep", "ls"] {
        symlink("busybox", rootfs.join("bin").join(applet)).unwrap();
    }
    std::fs::write(rootfs.join("marker"), "from the bundle\n").unwrap();
    let config = serde_json::json!({
        "ociVersion": "1.1.0",
        "process": {
            "user": { "uid": 0, "gid": 0 },
            "args": ["sh", "-c", script],
            "env": ["PATH=/bin"],
            "cwd": "/"
        },
        "root": { "path": "rootfs" },
        "linux": { "resources": { "memory": { "limit": 128 * 1024 * 1024 } } }
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
}

fn fifo(dir: &Path, name: &str) -> String {
    let path = dir.join(name);
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: mkfifo(3) with a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    path.to_str().unwrap().to_owned()
}

/// Reads a FIFO to its end on a thread (opening it blocks until the backend opens the other end).
fn drain(path: String) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut text = String::new();
        std::fs::File::open(path)
            .unwrap()
            .read_to_string(&mut text)
            .unwrap();
        text
    })
}

fn stdio(dir: &Path, prefix: &str, stdin: bool) -> Stdio {
    Stdio {
        stdin: match stdin {
            true => fifo(dir, &format!("{prefix}-in")),
            false => String::new(),
        },
        stdout: fifo(dir, &format!("{prefix}-out")),
        stderr: fifo(dir, &format!("{prefix}-err")),
        terminal: false,
    }
}

guest_test!(
    fn the_shim_backend_runs_a_bundle_in_a_microvm_and_execs_into_it() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        bundle(
            dir.path(),
            "uname -r; cat /marker; grep MemTotal /proc/meminfo; echo w > /written && cat /written; echo oops >&2; read go; exit 3",
        );
        let init_io = stdio(dir.path(), "init", true);
        let exec_io = stdio(dir.path(), "exec", false);
        let (out, err) = (drain(init_io.stdout.clone()), drain(init_io.stderr.clone()));
        let (exec_out, _exec_err) = (drain(exec_io.stdout.clone()), drain(exec_io.stderr.clone()));
        let backend = SharedVmBackend(Arc::new(VmBackend::new(Some(sandbox_config()))));
        let rt = tokio::runtime::Runtime::new().unwrap();
        let spec = ContainerSpec {
            id: "c1".into(),
            pod: "c1".into(),
            bundle: dir.path().to_str().unwrap().into(),
            rootfs: Vec::new(),
            stdio: init_io.clone(),
            annotations: Default::default(),
        };
        let exec =
            ExecProcess::from_json(br#"{"args":["sh","-c","echo pid=$$; cat /marker"],"cwd":"/"}"#)
                .unwrap();

        // Act
        let (status, exec_status) = rt.block_on(async {
            backend.create(&spec).await.unwrap();
            let init = StartSpec {
                key: ProcessKey::init("c1"),
                stdio: init_io.clone(),
                exec: None,
                stdin_closed: false,
            };
            let started = backend.start(&init).await.unwrap();
            let key = ProcessKey {
                container: "c1".into(),
                exec: Some("e1".into()),
            };
            let e = StartSpec {
                key,
                stdio: exec_io.clone(),
                exec: Some(exec),
                stdin_closed: false,
            };
            let exec_started = backend.start(&e).await.unwrap();
            let exec_status = exec_started.exit.await.unwrap().exit.status;
            std::fs::OpenOptions::new()
                .write(true)
                .open(&init_io.stdin)
                .unwrap()
                .write_all(b"go\n")
                .unwrap();
            let status = started.exit.await.unwrap().exit.status;
            backend.delete("c1", "c1").await.unwrap();
            (status, exec_status)
        });

        // Assert
        let (out, err, exec_out) = (
            out.join().unwrap(),
            err.join().unwrap(),
            exec_out.join().unwrap(),
        );
        let lines: Vec<&str> = out.lines().collect();
        let host_release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
        assert_ne!(
            lines[0],
            host_release.trim(),
            "the guest's kernel, not the host's: {out}"
        );
        assert_eq!(lines[1], "from the bundle", "{out}");
        let mem_kib: u64 = lines[2].split_whitespace().nth(1).unwrap().parse().unwrap();
        assert!(
            (64 * 1024..=128 * 1024).contains(&mem_kib),
            "the 128 MiB limit is the guest's: {out}"
        );
        assert_eq!(
            lines[3], "w",
            "the container writes to a layer of its own: {out}"
        );
        assert!(
            !dir.path().join("rootfs/written").exists(),
            "the bundle's rootfs is unchanged"
        );
        assert_eq!(err, "oops\n");
        assert_eq!(status, 3);
        assert!(
            exec_out.starts_with("pid=") && !exec_out.starts_with("pid=1\n"),
            "{exec_out}"
        );
        assert!(exec_out.ends_with("from the bundle\n"), "{exec_out}");
        assert_eq!(exec_status, 0);
    }
);

fn container(id: &str, pod: &str, bundle: &Path, stdio: &Stdio) -> ContainerSpec {
    ContainerSpec {
        id: id.into(),
        pod: pod.into(),
        bundle: bundle.to_str().unwrap().into(),
        rootfs: Vec::new(),
        stdio: stdio.clone(),
        annotations: Default::default(),
    }
}

fn init(id: &str, stdio: &Stdio) -> StartSpec {
    StartSpec {
        key: ProcessKey::init(id),
        stdio: stdio.clone(),
        exec: None,
        stdin_closed: false,
    }
}

fn say(fifo: &str, line: &str) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(fifo)
        .unwrap()
        .write_all(line.as_bytes())
        .unwrap();
}

guest_test!(
    fn a_second_container_of_a_pod_joins_the_running_microvm_with_its_own_root() {
        // Arrange: two bundles of one pod, each rootfs with its own marker.
        let (first, second) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let script = "cat /marker; cat /proc/sys/kernel/random/boot_id; read go; echo $go";
        bundle(first.path(), script);
        bundle(second.path(), script);
        std::fs::write(second.path().join("rootfs/marker"), "second\n").unwrap();
        let (io1, io2) = (
            stdio(first.path(), "c1", true),
            stdio(second.path(), "c2", true),
        );
        let (out1, out2) = (drain(io1.stdout.clone()), drain(io2.stdout.clone()));
        let _err = (drain(io1.stderr.clone()), drain(io2.stderr.clone()));
        let config = sandbox_config();
        let pod_dir = config.runtime_dir.join("pods/p1");
        let backend = SharedVmBackend(Arc::new(VmBackend::new(Some(config))));
        let rt = tokio::runtime::Runtime::new().unwrap();

        // Act
        let (vmm1, vmm2, status1, status2, pod_dir_while_one_ran) = rt.block_on(async {
            let vmm1 = backend
                .create(&container("c1", "p1", first.path(), &io1))
                .await
                .unwrap();
            let started1 = backend.start(&init("c1", &io1)).await.unwrap();
            let vmm2 = backend
                .create(&container("c2", "p1", second.path(), &io2))
                .await
                .unwrap();
            let started2 = backend.start(&init("c2", &io2)).await.unwrap();
            say(&io2.stdin, "two\n");
            let status2 = started2.exit.await.unwrap().exit.status;
            backend.delete("c2", "p1").await.unwrap();
            let left = std::fs::read_dir(&pod_dir)
                .map(|d| d.flatten().map(|e| e.file_name()).collect::<Vec<_>>());
            say(&io1.stdin, "one\n");
            let status1 = started1.exit.await.unwrap().exit.status;
            backend.delete("c1", "p1").await.unwrap();
            (vmm1, vmm2, status1, status2, left)
        });

        // Assert
        let (out1, out2) = (out1.join().unwrap(), out2.join().unwrap());
        let (lines1, lines2): (Vec<&str>, Vec<&str>) =
            (out1.lines().collect(), out2.lines().collect());
        assert_eq!(vmm1, vmm2, "one VMM for the pod");
        assert_eq!(lines1.len(), 3, "{out1}");
        assert_eq!(lines2.len(), 3, "{out2}");
        assert_eq!(
            (lines1[0], lines2[0]),
            ("from the bundle", "second"),
            "each container's own root"
        );
        assert_eq!(lines1[1], lines2[1], "one guest kernel (boot id) for both");
        assert_eq!((lines1[2], lines2[2]), ("one", "two"));
        assert_eq!((status1, status2), (0, 0));
        let left = pod_dir_while_one_ran.unwrap();
        assert_eq!(left, ["c1"], "the second container's root is gone with it");
        assert!(
            !pod_dir.exists(),
            "the pod's roots go with its last container"
        );
    }
);

/// Keeps the events the task service publishes.
#[derive(Default)]
struct Events(std::sync::Mutex<Vec<TaskEvent>>);

impl EventSink for Events {
    fn publish(&self, event: TaskEvent) {
        self.0.lock().unwrap().push(event);
    }
}

guest_test!(
    fn a_container_that_outgrows_the_guests_memory_is_oom_killed_and_reported_as_task_oom() {
        // Arrange: PID 1 of the container is awk, keeping 1 MiB more each turn, in a 128 MiB guest.
        let dir = tempfile::tempdir().unwrap();
        bundle(
            dir.path(),
            "echo hog; exec awk 'BEGIN { s = \"x\"; for (i = 0; i < 20; i++) s = s s; while (1) a[n++] = s n }'",
        );
        symlink("busybox", dir.path().join("rootfs/bin/awk")).unwrap();
        let io = stdio(dir.path(), "hog", false);
        let (out, _err) = (drain(io.stdout.clone()), drain(io.stderr.clone()));
        let backend = SharedVmBackend(Arc::new(VmBackend::new(Some(sandbox_config()))));
        let events = Arc::new(Events::default());
        let service = TaskService::new(backend, Arc::clone(&events) as Arc<dyn EventSink>);
        let rt = tokio::runtime::Runtime::new().unwrap();
        let key = ProcessKey::init("hog");

        // Act
        let exit = rt.block_on(async {
            let create = CreateTask {
                id: "hog".into(),
                bundle: dir.path().to_str().unwrap().into(),
                stdio: io.clone(),
                ..Default::default()
            };
            service.create(create).await.unwrap();
            service.start(&key).await.unwrap();
            let exit = service.wait(&key).await.unwrap();
            service.delete(&key).await.unwrap();
            exit
        });

        // Assert
        assert_eq!(out.join().unwrap(), "hog\n");
        assert_eq!(exit.status, 137, "SIGKILL");
        let events = events.0.lock().unwrap().clone();
        let topics: Vec<&str> = events.iter().map(TaskEvent::topic).collect();
        let oom = topics.iter().position(|t| *t == "/tasks/oom");
        let exited = topics.iter().position(|t| *t == "/tasks/exit");
        assert!(
            oom.is_some() && oom < exited,
            "TaskOOM before TaskExit: {topics:?}"
        );
        assert!(events.contains(&TaskEvent::Oom {
            container_id: "hog".into()
        }));
    }
);

/// `scripts/containerd-demo.sh FLAGS -- CMD` in the test host: containerd, an offline image, and
/// `ctr run --runtime io.containerd.bulkhead.v2`, with this build's shim, VMM, kernel and agent.
fn ctr_run(flags: &[&str], cmd: &[&str]) -> std::process::Output {
    demo(flags, cmd).output().unwrap()
}

guest_test!(
    fn ctr_run_t_gives_the_container_a_terminal_of_the_callers_size_and_restores_it() {
        // Arrange: the demo's stdin and stdout are a terminal of ours, 37 rows × 111 columns.
        let (master, slave) = terminal(37, 111);
        let seen = collect(&master);
        let cooked = lflag(&slave);
        let mut command = demo(&["--tty"], &["sh", "-c", "tty; stty size; exit 3"]);
        command
            .stdin(slave.try_clone().unwrap())
            .stdout(slave.try_clone().unwrap())
            .stderr(std::process::Stdio::piped());

        // Act
        let run = command.spawn().unwrap().wait_with_output().unwrap();

        // Assert
        let text = || seen.lock().unwrap().clone();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !text().contains("37 111") && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let shown = format!(
            "{:?}\n--- terminal\n{}\n--- stderr\n{}",
            run.status,
            text(),
            String::from_utf8_lossy(&run.stderr)
        );
        assert_eq!(run.status.code(), Some(3), "{shown}");
        // The guest's pseudo-terminal, sized as ours (`ctr run -t` passes its console's size).
        assert!(text().contains("/dev/pts/"), "{shown}");
        assert!(text().contains("37 111"), "{shown}");
        // ctr put our terminal in raw mode and put it back.
        assert_eq!(lflag(&slave), cooked, "{shown}");
    }
);

guest_test!(
    fn ctr_run_exec_kill_and_a_memory_limit_through_containerd_run_in_a_microvm() {
        // Arrange
        let host_release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();

        // Act
        let uname = ctr_run(&["--more"], &["uname", "-r"]);
        let failing = ctr_run(&[], &["sh", "-c", "echo bye; exit 7"]);

        // Assert
        let shown = describe;
        assert!(uname.status.success(), "{}", shown(&uname));
        let stdout = String::from_utf8_lossy(&uname.stdout).into_owned();
        let lines: Vec<&str> = stdout.lines().chain([""; 10]).collect();
        let release = lines[0];
        assert!(
            !release.is_empty() && release != host_release.trim(),
            "{}",
            shown(&uname)
        );
        // `ctr task exec` into a running task: its output and exit status, not PID 1.
        assert!(
            lines[1].starts_with("exec: status=4 output=in-exec pid="),
            "{}",
            shown(&uname)
        );
        assert!(!lines[1].ends_with("pid=1"), "{}", shown(&uname));
        // `ctr task kill` delivers SIGTERM: the shell's trap ends the task.
        assert_eq!(lines[2], "kill: STOPPED", "{}", shown(&uname));
        // `--memory-limit 64 MiB` is the guest's memory.
        let kib: u64 = lines[3]
            .split_whitespace()
            .nth(2)
            .and_then(|k| k.parse().ok())
            .unwrap_or_else(|| panic!("{}", shown(&uname)));
        assert!((40 * 1024..=64 * 1024).contains(&kib), "{}", shown(&uname));
        // The pod's VMM runs in the cgroup the spec names (`ctr`: /default/ID), limited to the
        // VM's RAM (no limit in the spec: the default) plus the VMM's allowance.
        let limit = (u64::from(bulkhead_shim::oci::DEFAULT_MEMORY_MIB)
            + u64::from(bulkhead_sandbox::spec::DEFAULT_VMM_MEMORY_OVERHEAD_MIB))
            << 20;
        assert_eq!(
            lines[4],
            format!("cgroup: /default/more memory={limit}"),
            "{}",
            shown(&uname)
        );
        // The task's `bulkhead.io/ports` annotation forwards host port 18080 to its server.
        assert_eq!(lines[5], "ingress: hello-ingress", "{}", shown(&uname));
        // The `bulkhead.io/allow-cidr` annotation lets the task out through its pod's proxy to
        // the allowed port only (the other gets the proxy's 403).
        assert_eq!(lines[6], "egress: hello-egress 1", "{}", shown(&uname));
        // `ctr task metrics`: the pod VM's memory, CPU time and threads from its cgroup.
        let metric = |key: &str| -> u64 {
            lines[7]
                .split_whitespace()
                .find_map(|w| w.strip_prefix(key))
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("no {key} in {:?}: {}", lines[7], shown(&uname)))
        };
        assert!(metric("memory=") > 1 << 20, "{}", shown(&uname));
        assert!(metric("cpu=") > 0, "{}", shown(&uname));
        assert!(metric("pids=") >= 2, "{}", shown(&uname));
        // A task whose PID 1 outgrows its 64 MiB guest is OOM-killed there, and containerd
        // publishes `/tasks/oom` for it (the shim's TaskOOM).
        assert_eq!(lines[9], "oom: status=137 events=1", "{}", shown(&uname));
        // Two tasks grouped into one pod VM (`io.kubernetes.cri.sandbox-id`), the first deleted:
        // containerd's clean-up for it (the shim's `delete`) leaves the pod's VM to the second.
        assert_eq!(
            lines[10],
            "pod: cleanups=1 second=RUNNING exec=0:pod-b-alive",
            "{}",
            shown(&uname)
        );
        assert_eq!(failing.status.code(), Some(7), "{}", shown(&failing));
        assert_eq!(
            String::from_utf8_lossy(&failing.stdout),
            "bye\n",
            "{}",
            shown(&failing)
        );
    }
);

guest_test!(
    fn a_killed_vmm_fails_its_task_a_killed_shim_leaves_nothing_and_a_new_containerd_reconnects() {
        // Act
        let run = ctr_run(&["--faults"], &["true"]);

        // Assert
        let stdout = String::from_utf8_lossy(&run.stdout).into_owned();
        let shown = describe(&run);
        assert!(run.status.success(), "{shown}");
        let line = |prefix: &str| {
            stdout
                .lines()
                .find(|l| l.starts_with(prefix))
                .unwrap_or_else(|| panic!("no {prefix} line: {shown}"))
                .to_owned()
        };
        // kill -9 of the VMM: the task exits with 255 (the VM is lost), its root is unmounted.
        assert_eq!(
            line("vmm-kill:"),
            "vmm-kill: status=255 mounts=0 cgroup=0",
            "{shown}"
        );
        // kill -9 of the shim: containerd's `delete` of the dead shim's task unmounts its root,
        // and the VMM stops with its shim.
        let shim = line("shim-kill:");
        assert!(
            shim.ends_with("vmm_alive=0 mounts=0 cgroup=0 clean") && !shim.contains("task=RUNNING"),
            "{shown}"
        );
        // kill -9 of containerd: the new containerd finds the running task through the same
        // shim, execs into it and kills it.
        assert_eq!(
            line("restart:"),
            "restart: task=RUNNING same_shim=1 exec=5:reconnected kill=STOPPED",
            "{shown}"
        );
    }
);
