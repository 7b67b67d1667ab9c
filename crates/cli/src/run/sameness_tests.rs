//! One sandbox, two front ends: for a table of inputs, `bulkhead run`'s flags and the daemon's
//! create request (`bulkhead_daemon::manager::plan`) must give the same VM (kernel, initramfs,
//! vCPUs, memory, kernel command line, hostname, disks, shares), the same command defaults and
//! the same host limits. What differs by design is each front end's host policy, not compared:
//! where runtime files and the console go, the boot timeout, whether the VMM outlives its
//! starter, and the end of a command (`kill_group_on_exit`: `docker run` vs `docker exec`).

use std::collections::BTreeMap;

use bulkhead_client::{CreateSandbox, MountSpec, WorkspaceMode, WorkspaceSpec};
use bulkhead_daemon::config::Config;
use bulkhead_daemon::manager::plan::{self, HostFacts};
use bulkhead_sandbox::{HostSettings, Recipe};

use super::{host_settings, sandbox_spec};

const ID: &str = "0123456789ab";

/// The same host seen by both front ends: kernel, initramfs, VMM and the image store `debian`
/// in `dir`, which is also the daemon's one mount root.
struct Host {
    dir: tempfile::TempDir,
}

impl Host {
    fn new() -> Host {
        let dir = tempfile::tempdir().unwrap();
        for file in ["vmlinux", "initramfs", "bulkhead-vmm"] {
            std::fs::write(dir.path().join(file), b"x").unwrap();
        }
        for share in ["project", "data"] {
            std::fs::create_dir_all(dir.path().join(share)).unwrap();
        }
        bulkhead_image::testing::store_with(&dir.path().join("images"), &["debian"]);
        Host { dir }
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }

    /// `bulkhead run ARGS -- true` on this host.
    fn run(&self, args: &[&str]) -> Recipe {
        let mut argv = args.to_vec();
        argv.extend(["--", "true"]);
        let args = super::tests::run_args(&argv);
        let d = self.dir.path();
        let spec = sandbox_spec(&args).unwrap();
        let host = HostSettings {
            kernel: d.join("vmlinux"),
            initrd: d.join("initramfs"),
            vmm_binary: d.join("bulkhead-vmm"),
            images: bulkhead_image::ImageStore::at_images_dir(d.join("images")),
            runtime_dir: d.join("run"),
            ..host_settings(&args, &spec).unwrap()
        };
        bulkhead_sandbox::build(&spec, &host, ID).unwrap()
    }

    /// `POST /v1/sandboxes` with `request` on a daemon of this host.
    fn daemon(&self, request: &CreateSandbox) -> Recipe {
        let d = self.dir.path();
        let config = Config {
            kernel: d.join("vmlinux"),
            image: d.join("initramfs"),
            vmm_binary: d.join("bulkhead-vmm"),
            images_dir: Some(d.join("images")),
            runtime_dir: Some(d.join("vms")),
            mount_roots: vec![d.to_owned()],
            ..Config::default()
        };
        let facts = HostFacts {
            available_mib: None,
            runtime_in_ram: false,
        };
        plan::plan(&config, request, facts, ID).unwrap().1
    }
}

/// What must be equal: the VM, its disks, the command defaults and a command's request, the
/// limits.
fn assert_same(case: &str, run: &Recipe, daemon: &Recipe) {
    let (r, d) = (&run.config, &daemon.config);
    assert_eq!(
        (&r.kernel, &r.initrd, r.vcpus, r.memory_mib),
        (&d.kernel, &d.initrd, d.vcpus, d.memory_mib),
        "{case}: boot files and resources"
    );
    assert_eq!(r.extra_cmdline, d.extra_cmdline, "{case}: kernel args");
    assert_eq!(r.hostname, d.hostname, "{case}: hostname");
    assert_eq!(r.mounts, d.mounts, "{case}: mounts");
    assert_eq!(r.workspace, d.workspace, "{case}: workspace");
    assert_eq!(run.storage, daemon.storage, "{case}: disks");
    assert_eq!(run.exec, daemon.exec, "{case}: command defaults");
    let argv = || {
        vec![
            "sh".to_owned(),
            "-c".to_owned(),
            "echo $TERM $HOME".to_owned(),
        ]
    };
    let none = BTreeMap::new();
    assert_eq!(
        run.exec.request(argv(), &none, None, None),
        daemon.exec.request(argv(), &none, None, None),
        "{case}: a command's request"
    );
    assert_eq!(run.limits, daemon.limits, "{case}: limits");
}

#[test]
fn run_flags_and_the_equivalent_create_request_give_the_same_sandbox() {
    // Arrange
    let host = Host::new();
    let (project, data) = (host.path("project"), host.path("data"));
    let clone = format!("{project}:clone");
    let ro_mount = format!("{data}:/data:ro");
    let cases: Vec<(&str, Vec<&str>, CreateSandbox)> = vec![
        ("defaults", vec![], CreateSandbox::default()),
        (
            "resources, environment, user, workdir, hostname",
            vec![
                "--vcpus",
                "2",
                "--memory",
                "512",
                "-e",
                "A=1",
                "-e",
                "B=x=y",
                "--user",
                "1000",
                "--workdir",
                "/srv",
                "--hostname",
                "agent-7",
            ],
            CreateSandbox {
                vcpus: 2,
                memory_mib: 512,
                env: BTreeMap::from([("A".into(), "1".into()), ("B".into(), "x=y".into())]),
                user: Some("1000".into()),
                workdir: Some("/srv".into()),
                hostname: Some("agent-7".into()),
                ..CreateSandbox::default()
            },
        ),
        (
            "image with a scratch disk",
            vec!["--image", "debian", "--disk", "64"],
            CreateSandbox {
                image: Some("debian".into()),
                disk_mib: Some(64),
                ..CreateSandbox::default()
            },
        ),
        (
            "clone workspace and a read-only mount",
            vec!["--workspace", &clone, "--mount", &ro_mount],
            CreateSandbox {
                workspace: Some(WorkspaceSpec {
                    path: project.clone(),
                    mode: WorkspaceMode::Clone,
                }),
                mounts: vec![MountSpec {
                    host: data.clone(),
                    guest: "/data".into(),
                    ro: true,
                }],
                ..CreateSandbox::default()
            },
        ),
        (
            "limits",
            vec!["--cpu-quota", "0.5", "--pids-max", "64"],
            CreateSandbox {
                cpu_quota: Some(0.5),
                pids_max: Some(64),
                ..CreateSandbox::default()
            },
        ),
    ];

    for (case, args, request) in &cases {
        // Act
        let run = host.run(args);
        let daemon = host.daemon(request);

        // Assert
        assert_same(case, &run, &daemon);
    }
}
