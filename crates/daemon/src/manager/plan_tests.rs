//! Tests of `plan`: the daemon's limits, names resolved on its host, shares inside its roots.

use std::path::Path;

use bulkhead_client::{MountSpec, WorkspaceSpec};
use bulkhead_sandbox::storage::Storage;

use super::*;

const ID: &str = "0123456789ab";

fn host(available_mib: u64) -> HostFacts {
    HostFacts {
        available_mib: Some(available_mib),
        runtime_in_ram: false,
    }
}

/// A configuration whose kernel, initramfs and VMM are files in `dir`, whose image store
/// (`<dir>/images`) holds fake images `names` and whose runtime root is in `dir`.
fn config_in(dir: &Path, names: &[&str]) -> Config {
    for file in ["vmlinux", "initramfs", "bulkhead-vmm"] {
        std::fs::write(dir.join(file), b"x").unwrap();
    }
    bulkhead_image::testing::store_with(&dir.join("images"), names);
    Config {
        kernel: dir.join("vmlinux"),
        image: dir.join("initramfs"),
        vmm_binary: dir.join("bulkhead-vmm"),
        images_dir: Some(dir.join("images")),
        runtime_dir: Some(dir.join("vms")),
        ..Config::default()
    }
}

fn with_image(image: &str, disk_mib: Option<u64>) -> CreateSandbox {
    CreateSandbox {
        image: Some(image.to_owned()),
        disk_mib,
        ..CreateSandbox::default()
    }
}

fn message<T: std::fmt::Debug>(result: Result<T, ManagerError>) -> String {
    match result {
        Err(ManagerError::Invalid(m)) => m,
        other => panic!("expected a 400, got {other:?}"),
    }
}

#[test]
fn memory_limit_is_guest_ram_plus_the_vmm_allowance() {
    // Arrange
    let dir = tempfile::tempdir().unwrap();
    let request = CreateSandbox {
        memory_mib: 512,
        ..CreateSandbox::default()
    };

    // Act
    let (_, recipe) = plan(&config_in(dir.path(), &[]), &request, host(4096), ID).unwrap();

    // Assert
    assert_eq!(recipe.limits.memory_bytes, (512 + 64) << 20);
}

#[test]
fn zero_vcpus_zero_memory_and_too_much_memory_are_refused() {
    // Arrange
    let dir = tempfile::tempdir().unwrap();
    let config = config_in(dir.path(), &[]);
    let ask = |vcpus, memory_mib| CreateSandbox {
        vcpus,
        memory_mib,
        ..CreateSandbox::default()
    };

    // Act
    let results = [
        plan(&config, &ask(0, 256), host(4096), ID),
        plan(&config, &ask(1, 0), host(4096), ID),
        plan(&config, &ask(1, 8000), host(4096), ID),
    ];

    // Assert
    assert!(matches!(&results[0], Err(ManagerError::Invalid(m)) if m.contains("vcpus")));
    assert!(matches!(&results[1], Err(ManagerError::Invalid(m)) if m.contains("memory_mib")));
    assert!(matches!(
        &results[2],
        Err(ManagerError::InsufficientMemory(_))
    ));
}

#[test]
fn a_ttl_beyond_a_century_is_refused_even_without_a_configured_maximum() {
    // Arrange
    let dir = tempfile::tempdir().unwrap();
    let config = config_in(dir.path(), &[]);
    let ttl = |secs| CreateSandbox {
        ttl_s: Some(secs),
        ..CreateSandbox::default()
    };

    // Act
    let results = [
        plan(&config, &ttl(u64::MAX), host(4096), ID),
        plan(&config, &ttl(0), host(4096), ID),
        plan(&config, &ttl(MAX_TTL_S), host(4096), ID),
    ];

    // Assert
    for refused in &results[..2] {
        assert!(
            matches!(refused, Err(ManagerError::Invalid(m)) if m.contains("ttl_s must be between 1 and 3153600000")),
            "{refused:?}"
        );
    }
    assert!(results[2].is_ok(), "{:?}", results[2]);
}

#[test]
fn image_names_cannot_escape_the_image_store() {
    // Arrange
    let dir = tempfile::tempdir().unwrap();
    let config = config_in(dir.path(), &["debian"]);
    std::fs::create_dir_all(dir.path().join("etc")).unwrap();
    let names = [
        "../../etc",
        "../etc",
        "debian/../debian",
        "/etc",
        ".hidden",
        "Debian",
        "",
    ];

    // Act
    let results: Vec<_> = names
        .iter()
        .map(|n| plan(&config, &with_image(n, None), host(4096), ID))
        .collect();

    // Assert
    for (name, result) in names.iter().zip(results) {
        let m = message(result);
        assert!(m.contains("invalid image name"), "{name:?}: {m}");
    }
}

#[test]
fn an_image_of_the_store_is_the_read_only_root_with_an_optional_scratch_disk() {
    // Arrange
    let dir = tempfile::tempdir().unwrap();
    let config = config_in(dir.path(), &["debian"]);
    let rootfs = dir.path().join("images/debian/rootfs.ext4");

    // Act
    let (_, tmpfs_layer) = plan(&config, &with_image("debian", None), host(4096), ID).unwrap();
    let (_, on_disk) = plan(&config, &with_image("debian", Some(64)), host(4096), ID).unwrap();
    let (_, no_image) = plan(&config, &CreateSandbox::default(), host(4096), ID).unwrap();

    // Assert
    assert_eq!(tmpfs_layer.storage.root_image.as_deref(), Some(&*rootfs));
    assert_eq!(tmpfs_layer.storage.scratch_mib, None);
    assert_eq!(on_disk.storage.root_image.as_deref(), Some(&*rootfs));
    assert_eq!(on_disk.storage.scratch_mib, Some(64));
    assert_eq!(no_image.storage, Storage::default());
    assert_eq!(
        on_disk.config.initrd, config.image,
        "the agent's initramfs boots the image"
    );
}

#[test]
fn an_unknown_image_or_kernel_is_a_404_naming_it_and_what_there_is() {
    // Arrange
    let dir = tempfile::tempdir().unwrap();
    let kernels = dir.path().join("kernels");
    std::fs::create_dir_all(&kernels).unwrap();
    std::fs::write(kernels.join("6.1"), b"k").unwrap();
    let config = Config {
        kernels_dir: Some(kernels),
        ..config_in(dir.path(), &["debian", "tools"])
    };
    let kernel = CreateSandbox {
        kernel: Some("7.0".into()),
        ..CreateSandbox::default()
    };

    // Act
    let image = plan(&config, &with_image("ubuntu", None), host(4096), ID);
    let kernel = plan(&config, &kernel, host(4096), ID);

    // Assert
    let Err(ManagerError::UnknownName { what, message }) = image else {
        panic!("expected an unknown name, got {image:?}");
    };
    assert_eq!(what, "image");
    assert!(message.contains("unknown image \"ubuntu\""), "{message}");
    assert!(message.contains("has debian, tools"), "{message}");
    assert!(
        matches!(&kernel, Err(ManagerError::UnknownName { what: "kernel", message }) if message.contains("6.1")),
        "{kernel:?}"
    );
}

#[test]
fn an_initramfs_directory_is_not_an_image() {
    // Arrange: the old meaning of `image`, `<images_dir>/NAME/initramfs.cpio.gz`.
    let dir = tempfile::tempdir().unwrap();
    let config = config_in(dir.path(), &[]);
    let old = dir.path().join("images/default");
    std::fs::create_dir_all(&old).unwrap();
    std::fs::write(old.join("initramfs.cpio.gz"), b"cpio").unwrap();

    // Act
    let m = message(plan(&config, &with_image("default", None), host(4096), ID));

    // Assert
    assert!(m.contains("not an image"), "{m}");
}

#[test]
fn disk_mib_needs_an_image_and_a_size_within_bounds() {
    // Arrange
    let dir = tempfile::tempdir().unwrap();
    let config = Config {
        max_disk_mib: 1024,
        ..config_in(dir.path(), &["debian"])
    };
    let without_image = CreateSandbox {
        disk_mib: Some(64),
        ..CreateSandbox::default()
    };

    // Act
    let results = [
        plan(&config, &without_image, host(4096), ID),
        plan(&config, &with_image("debian", Some(1)), host(4096), ID),
        plan(&config, &with_image("debian", Some(1025)), host(4096), ID),
    ];

    // Assert
    let messages: Vec<String> = results.into_iter().map(message).collect();
    assert!(
        messages[0].contains("disk_mib needs an image"),
        "{}",
        messages[0]
    );
    assert!(
        messages[1].contains("between 8 and 1024"),
        "{}",
        messages[1]
    );
    assert!(
        messages[2].contains("between 8 and 1024"),
        "{}",
        messages[2]
    );
}

#[test]
fn an_absurd_disk_mib_is_a_400_even_where_it_would_count_as_memory() {
    // Arrange
    let dir = tempfile::tempdir().unwrap();
    let config = config_in(dir.path(), &["debian"]);
    let in_ram = HostFacts {
        available_mib: Some(4096),
        runtime_in_ram: true,
    };

    // Act
    let result = plan(&config, &with_image("debian", Some(u64::MAX)), in_ram, ID);

    // Assert
    assert!(message(result).contains("disk_mib must be between"));
}

#[test]
fn a_scratch_disk_in_host_ram_counts_toward_the_memory_limit_and_one_on_disk_does_not() {
    // Arrange
    let dir = tempfile::tempdir().unwrap();
    let config = config_in(dir.path(), &["debian"]);
    // A small scratch disk: the builder checks it against the free space of the real runtime
    // directory, which a busy build host may not have much of.
    let request = CreateSandbox {
        memory_mib: 256,
        ..with_image("debian", Some(32))
    };
    let in_ram = HostFacts {
        available_mib: Some(4096),
        runtime_in_ram: true,
    };
    let small_ram = HostFacts {
        available_mib: Some(256 + 64 + 16),
        ..in_ram
    };

    // Act
    let (_, on_disk) = plan(&config, &request, host(4096), ID).unwrap();
    let (_, on_tmpfs) = plan(&config, &request, in_ram, ID).unwrap();
    let too_big = plan(&config, &request, small_ram, ID);

    // Assert
    assert_eq!(on_disk.limits.memory_bytes, (256 + 64) << 20);
    assert_eq!(on_tmpfs.limits.memory_bytes, (256 + 64 + 32) << 20);
    assert!(
        matches!(&too_big, Err(ManagerError::InsufficientMemory(m)) if m.contains("scratch disk of 32 MiB")),
        "{too_big:?}"
    );
}

#[test]
fn shares_inside_a_mount_root_are_resolved() {
    // Arrange
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let project = root.join("project");
    std::fs::create_dir_all(&project).unwrap();
    let config = Config {
        mount_roots: vec![root.clone()],
        ..config_in(dir.path(), &[])
    };
    let request = CreateSandbox {
        workspace: Some(WorkspaceSpec {
            path: project.display().to_string(),
            mode: ApiMode::Clone,
        }),
        mounts: vec![MountSpec {
            host: root.display().to_string(),
            guest: "/data".into(),
            ro: true,
        }],
        ..CreateSandbox::default()
    };

    // Act
    let (_, recipe) = plan(&config, &request, host(4096), ID).unwrap();

    // Assert
    let ws = recipe.config.workspace.unwrap();
    assert_eq!(ws.mode, WorkspaceMode::Clone);
    assert_eq!(ws.host, project.canonicalize().unwrap());
    assert_eq!(recipe.config.mounts.len(), 1);
    assert!(recipe.config.mounts[0].read_only);
}

#[test]
fn paths_outside_the_roots_relative_or_missing_and_disabled_sharing_are_400s() {
    // Arrange
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let elsewhere = dir.path().join("elsewhere");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::create_dir_all(&elsewhere).unwrap();
    std::os::unix::fs::symlink(&elsewhere, root.join("link")).unwrap();
    let config = Config {
        mount_roots: vec![root.clone()],
        ..config_in(dir.path(), &[])
    };
    let no_roots = config_in(dir.path(), &[]);
    let ws = |path: &str| CreateSandbox {
        workspace: Some(WorkspaceSpec {
            path: path.to_owned(),
            mode: ApiMode::Direct,
        }),
        ..CreateSandbox::default()
    };

    // Act
    let outside = message(plan(
        &config,
        &ws(&elsewhere.display().to_string()),
        host(4096),
        ID,
    ));
    let via_link = message(plan(
        &config,
        &ws(&root.join("link").display().to_string()),
        host(4096),
        ID,
    ));
    let relative = message(plan(&config, &ws("root"), host(4096), ID));
    let missing = message(plan(
        &config,
        &ws(&root.join("nope").display().to_string()),
        host(4096),
        ID,
    ));
    let disabled = message(plan(
        &no_roots,
        &ws(&root.display().to_string()),
        host(4096),
        ID,
    ));

    // Assert
    assert!(outside.contains("outside"), "{outside}");
    assert!(via_link.contains("outside"), "{via_link}");
    assert!(relative.contains("absolute"), "{relative}");
    assert!(missing.contains("does not exist"), "{missing}");
    assert!(disabled.contains("mount_roots"), "{disabled}");
}

#[test]
fn the_hostname_workdir_and_user_of_a_request_reach_the_vm_and_its_commands() {
    // Arrange
    let dir = tempfile::tempdir().unwrap();
    let request = CreateSandbox {
        hostname: Some("agent-7".into()),
        workdir: Some("/srv".into()),
        user: Some("1000".into()),
        ..CreateSandbox::default()
    };

    // Act
    let (spec, recipe) = plan(&config_in(dir.path(), &[]), &request, host(4096), ID).unwrap();
    let default = plan(
        &config_in(dir.path(), &[]),
        &CreateSandbox::default(),
        host(4096),
        ID,
    )
    .unwrap();

    // Assert
    assert_eq!(recipe.config.hostname.as_deref(), Some("agent-7"));
    assert_eq!(recipe.exec.cwd.as_deref(), Some("/srv"));
    assert_eq!(recipe.exec.user.as_deref(), Some("1000"));
    assert_eq!(spec.hostname.as_deref(), Some("agent-7"));
    assert_eq!(
        default.1.config.hostname.as_deref(),
        Some("bh-0123456789ab")
    );
}
