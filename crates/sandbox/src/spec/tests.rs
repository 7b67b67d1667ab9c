//! Tests of the sandbox spec: validation, resolution on a host, command defaults, limits.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use bulkhead_protocol::ByteString;

use super::*;
use crate::workspace::WorkspaceMode;
use crate::HostSettings;

/// A host whose files live in `dir`: kernel, initramfs, a stand-in VMM, and an image store with
/// the fake images `images`.
fn host_in(dir: &Path, images: &[&str]) -> HostSettings {
    for file in ["vmlinux", "initrd", "vmm"] {
        std::fs::write(dir.join(file), b"x").unwrap();
    }
    let kernels = dir.join("kernels");
    std::fs::create_dir_all(&kernels).unwrap();
    std::fs::write(kernels.join("6.1-debug"), b"k").unwrap();
    HostSettings {
        kernel: dir.join("vmlinux"),
        kernels_dir: Some(kernels),
        initrd: dir.join("initrd"),
        images: bulkhead_image::testing::store_with(&dir.join("images"), images),
        vmm_binary: dir.join("vmm"),
        runtime_dir: dir.join("run"),
        ready_timeout: Duration::from_secs(7),
        ..HostSettings::local()
    }
}

fn invalid_field(result: Result<(), SpecError>) -> String {
    match result {
        Err(SpecError::Invalid { field, .. }) => field,
        other => panic!("expected an invalid field, got {other:?}"),
    }
}

#[test]
fn the_default_spec_is_valid() {
    // Arrange
    let spec = SandboxSpec::default();

    // Act
    let result = spec.validate();

    // Assert
    assert!(result.is_ok(), "{result:?}");
    assert_eq!((spec.vcpus, spec.memory_mib), (1, 256));
}

#[test]
fn out_of_range_and_malformed_values_name_their_field() {
    // Arrange
    let cases: Vec<(SandboxSpec, &str)> = vec![
        (
            SandboxSpec {
                vcpus: 0,
                ..Default::default()
            },
            "vcpus",
        ),
        (
            SandboxSpec {
                memory_mib: 1,
                ..Default::default()
            },
            "memory_mib",
        ),
        (
            SandboxSpec {
                disk_mib: Some(64),
                ..Default::default()
            },
            "disk_mib",
        ),
        (
            SandboxSpec {
                image: Some(FileRef::Name("debian".into())),
                disk_mib: Some(1),
                ..Default::default()
            },
            "disk_mib",
        ),
        (
            SandboxSpec {
                env: BTreeMap::from([("A=B".into(), "x".into())]),
                ..Default::default()
            },
            "env",
        ),
        (
            SandboxSpec {
                workdir: Some("rel".into()),
                ..Default::default()
            },
            "workdir",
        ),
        (
            SandboxSpec {
                user: Some("a b".into()),
                ..Default::default()
            },
            "user",
        ),
        (
            SandboxSpec {
                limits: ResourceLimits {
                    cpu_quota: Some(f64::NAN),
                    pids_max: None,
                },
                ..Default::default()
            },
            "cpu_quota",
        ),
        (
            SandboxSpec {
                limits: ResourceLimits {
                    cpu_quota: None,
                    pids_max: Some(3),
                },
                ..Default::default()
            },
            "pids_max",
        ),
        (
            SandboxSpec {
                hostname: Some("no/slash".into()),
                ..Default::default()
            },
            "hostname",
        ),
        (
            SandboxSpec {
                labels: BTreeMap::from([("".into(), "x".into())]),
                ..Default::default()
            },
            "labels",
        ),
        (
            SandboxSpec {
                kernel_args: vec!["two words".into()],
                ..Default::default()
            },
            "kernel_args",
        ),
        (
            SandboxSpec {
                kernel_args: vec!["bulkhead.root=/dev/vdz".into()],
                ..Default::default()
            },
            "kernel_args",
        ),
        (
            SandboxSpec {
                kernel: Some(FileRef::Name("../etc".into())),
                ..Default::default()
            },
            "kernel",
        ),
        (
            SandboxSpec {
                network: Some(bulkhead_egress::policy::NetworkSpec {
                    mode: bulkhead_egress::policy::NetworkMode::None,
                    deny: vec!["10.0.0.0/33".into()],
                    ..Default::default()
                }),
                ..Default::default()
            },
            "network",
        ),
    ];

    // Act
    let fields: Vec<String> = cases
        .iter()
        .map(|(s, _)| invalid_field(s.validate()))
        .collect();

    // Assert
    let expected: Vec<&str> = cases.iter().map(|(_, f)| *f).collect();
    assert_eq!(fields, expected);
}

#[test]
fn a_spec_round_trips_through_json_and_unknown_fields_are_refused() {
    // Arrange
    let spec = SandboxSpec {
        image: Some(FileRef::Name("debian".into())),
        kernel: Some(FileRef::Path("/k/vmlinux".into())),
        mounts: vec![Mount {
            host: "/src".into(),
            guest: "/work".into(),
            read_only: true,
        }],
        workspace: Some(Workspace {
            host: "/proj".into(),
            mode: WorkspaceMode::Clone,
        }),
        limits: ResourceLimits {
            cpu_quota: Some(0.5),
            pids_max: Some(64),
        },
        ..Default::default()
    };

    // Act
    let json = serde_json::to_string(&spec).unwrap();
    let back: SandboxSpec = serde_json::from_str(&json).unwrap();
    let unknown = serde_json::from_str::<SandboxSpec>(r#"{"vcpus":1,"gpus":2}"#);

    // Assert
    assert_eq!(back, spec);
    assert!(json.contains(r#""image":{"name":"debian"}"#), "{json}");
    assert!(unknown.is_err());
}

#[test]
fn build_resolves_names_and_defaults_on_the_host() {
    // Arrange
    let dir = tempfile::tempdir().unwrap();
    let host = host_in(dir.path(), &["debian"]);
    let spec = SandboxSpec {
        vcpus: 2,
        kernel: Some(FileRef::Name("6.1-debug".into())),
        image: Some(FileRef::Name("debian".into())),
        disk_mib: Some(64),
        kernel_args: vec!["loglevel=7".into()],
        ..Default::default()
    };

    // Act
    let recipe = build(&spec, &host, "0123456789ab").unwrap();

    // Assert
    let c = &recipe.config;
    assert_eq!(c.kernel, dir.path().join("kernels/6.1-debug"));
    assert_eq!(c.initrd, host.initrd);
    assert_eq!((c.vcpus, c.memory_mib), (2, 256));
    assert_eq!(c.hostname.as_deref(), Some("bh-0123456789ab"));
    assert_eq!(c.extra_cmdline, ["loglevel=7"]);
    assert_eq!(c.ready_timeout, Duration::from_secs(7));
    assert_eq!(
        recipe.storage.root_image.as_deref(),
        Some(&*dir.path().join("images/debian/rootfs.ext4"))
    );
    assert_eq!(recipe.storage.scratch_mib, Some(64));
}

#[test]
fn unknown_names_list_what_the_host_has() {
    // Arrange
    let dir = tempfile::tempdir().unwrap();
    let host = host_in(dir.path(), &["debian", "tools"]);
    let image = SandboxSpec {
        image: Some(FileRef::Name("ubuntu".into())),
        ..Default::default()
    };
    let kernel = SandboxSpec {
        kernel: Some(FileRef::Name("7.0".into())),
        ..Default::default()
    };

    // Act
    let image_err = build(&image, &host, "a").unwrap_err();
    let kernel_err = build(&kernel, &host, "a").unwrap_err();

    // Assert
    assert!(
        matches!(&image_err, SpecError::UnknownName { what: "image", known, .. } if known == &["debian", "tools"]),
        "{image_err}"
    );
    assert!(
        image_err.to_string().contains("has debian, tools"),
        "{image_err}"
    );
    assert!(
        image_err.to_string().contains("--name ubuntu` builds one"),
        "{image_err}"
    );
    assert!(
        matches!(&kernel_err, SpecError::UnknownName { what: "kernel", known, .. } if known == &["6.1-debug"]),
        "{kernel_err}"
    );
}

#[test]
fn a_host_that_takes_names_refuses_paths_and_shares_outside_its_roots() {
    // Arrange
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("shared");
    let outside = dir.path().join("private");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    let host = HostSettings {
        allow_host_paths: false,
        mount_roots: vec![root.clone()],
        ..host_in(dir.path(), &[])
    };
    let kernel_path = SandboxSpec {
        kernel: Some(FileRef::Path(dir.path().join("vmlinux"))),
        ..Default::default()
    };
    let outside_mount = SandboxSpec {
        mounts: vec![Mount {
            host: outside,
            guest: "/data".into(),
            read_only: true,
        }],
        ..Default::default()
    };

    // Act
    let path_err = build(&kernel_path, &host, "a").unwrap_err();
    let share_err = build(&outside_mount, &host, "a").unwrap_err();

    // Assert
    assert!(
        matches!(path_err, SpecError::NotAllowed { what: "kernel", .. }),
        "{path_err}"
    );
    assert!(share_err.to_string().contains("mount_roots"), "{share_err}");
}

#[test]
fn commands_get_path_term_and_root_home_then_the_sandbox_env_then_their_own() {
    // Arrange
    let spec = SandboxSpec {
        env: BTreeMap::from([("A".into(), "1".into()), ("TERM".into(), "xterm".into())]),
        workspace: Some(Workspace {
            host: "/proj".into(),
            mode: WorkspaceMode::Direct,
        }),
        ..Default::default()
    };
    let defaults = ExecDefaults::of(&spec);
    let own = BTreeMap::from([("A".into(), "2".into())]);

    // Act
    let as_root = defaults.request(["env"], &own, None, None);
    let as_user = defaults.request(
        ["env"],
        &BTreeMap::new(),
        Some(&"/tmp".into()),
        Some("1000"),
    );

    // Assert
    assert_eq!(
        as_root.env,
        [
            "A=2".into(),
            "HOME=/root".into(),
            ByteString::from(format!("PATH={BASE_PATH}")),
            "TERM=xterm".into()
        ]
    );
    assert_eq!(as_root.cwd, Some("/workspace".into()));
    assert!(
        !as_user
            .env
            .iter()
            .any(|e| e.as_bytes().starts_with(b"HOME=")),
        "{:?}",
        as_user.env
    );
    assert_eq!(as_user.cwd, Some("/tmp".into()));
    assert_eq!(as_user.user.as_deref(), Some("1000"));
}

#[test]
fn limits_are_guest_ram_plus_the_allowance_and_a_scratch_disk_in_ram() {
    // Arrange
    let spec = SandboxSpec {
        memory_mib: 512,
        vcpus: 4,
        image: Some(FileRef::Name("debian".into())),
        disk_mib: Some(100),
        ..Default::default()
    };
    let on_disk = HostSettings {
        vmm_memory_overhead_mib: 64,
        default_pids_max: 4,
        ..HostSettings::local()
    };
    let in_ram = HostSettings {
        scratch_in_ram: true,
        ..on_disk.clone()
    };

    // Act
    let a = limits_of(&spec, &on_disk);
    let b = limits_of(&spec, &in_ram);

    // Assert
    assert_eq!(a.memory_bytes, (512 + 64) << 20);
    assert_eq!(b.memory_bytes, (512 + 64 + 100) << 20);
    assert_eq!(
        a.pids_max,
        4 + VMM_BASE_TASKS,
        "raised to what 4 vCPUs need"
    );
    assert_eq!(a.cpu_quota, None);
}
