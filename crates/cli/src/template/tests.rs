//! Unit tests of `bulkhead template` and `run --template`: names, parsing, the store, the
//! `ls` table, `rm`, and the configuration of a restore.

use std::path::{Path, PathBuf};

use clap::Parser;

use super::restore::{restore_recipe, sizes};
use super::store::{format_size, size_on_disk, Template, TemplateManifest, TemplateStore};
use super::*;

/// The `bulkhead` command line, parsed.
fn parse(words: &[&str]) -> Result<crate::Cli, clap::Error> {
    crate::Cli::try_parse_from(std::iter::once("bulkhead").chain(words.iter().copied()))
}

fn manifest(name: &str) -> TemplateManifest {
    TemplateManifest {
        name: name.to_owned(),
        kernel: PathBuf::from("/k/vmlinux"),
        initrd: PathBuf::from("/k/initramfs.cpio.lz4"),
        image: None,
        disk_mib: None,
        disk_files: Vec::new(),
        memory_mib: 512,
        vcpus: 2,
        created: "2026-01-31T12:00:00Z".to_owned(),
        bulkhead_version: "0.1.0".to_owned(),
        prepare: vec!["sh".into(), "-c".into(), "pip install requests".into()],
    }
}

/// A store in `root` holding a template for each of `names` (manifest only).
fn store_with(root: &Path, names: &[&str]) -> TemplateStore {
    let store = TemplateStore::new(root.to_owned());
    for name in names {
        std::fs::create_dir_all(store.path(name)).unwrap();
        manifest(name).write(&store.path(name)).unwrap();
    }
    store
}

fn rm_args(words: &[&str]) -> RmArgs {
    match parse(&[&["template", "rm"], words].concat())
        .unwrap()
        .command
    {
        crate::Command::Template(TemplateArgs {
            command: TemplateCommand::Rm(args),
        }) => args,
        other => panic!("not template rm: {other:?}"),
    }
}

#[test]
fn names_are_lower_case_letters_digits_dots_dashes_and_underscores() {
    // Arrange
    let good = ["py", "0", "python3.12-slim_v2", &"a".repeat(64)];
    let bad = [
        "",
        "Py",
        ".hidden",
        "-x",
        "_x",
        "a/b",
        "..",
        "a b",
        "é",
        &"a".repeat(65),
    ];

    // Act / Assert
    for name in good {
        assert_eq!(parse_name(name).as_deref(), Ok(name), "{name}");
    }
    for name in bad {
        let err = parse_name(name).unwrap_err();
        assert!(err.contains("not a template name"), "{name}: {err}");
    }
}

#[test]
fn create_takes_its_preparation_command_after_the_double_dash_only() {
    // Arrange / Act
    let with_command = parse(&[
        "template", "create", "py", "--memory", "512", "--", "sh", "-c", "echo hi",
    ]);
    let without_dashes = parse(&["template", "create", "py", "sh"]);
    let bad_name = parse(&["template", "create", "Py"]);

    // Assert
    let cli = with_command.unwrap();
    let crate::Command::Template(TemplateArgs {
        command: TemplateCommand::Create(args),
    }) = cli.command
    else {
        panic!("not template create");
    };
    let debug = format!("{args:?}");
    assert!(debug.contains("memory: Some(512)"), "{debug}");
    assert!(
        debug.contains(r#"prepare: ["sh", "-c", "echo hi"]"#),
        "{debug}"
    );
    assert!(without_dashes.is_err());
    let err = bad_name.unwrap_err().to_string();
    assert!(err.contains("not a template name"), "{err}");
}

#[test]
fn run_template_refuses_every_flag_a_restore_cannot_honour() {
    // Arrange
    let refused: [&[&str]; 5] = [
        &["--image", "debian"],
        &["--kernel", "/k"],
        &["--initrd", "/i"],
        &["--kernel-arg", "quiet"],
        &["--disk-file", "/d.img"],
    ];

    for flags in refused {
        // Act
        let words = [&["run", "--template", "py"], flags, &["--", "true"]].concat();
        let result = parse(&words);

        // Assert
        let err = result.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("cannot be used with"), "{flags:?}: {err}");
    }
}

#[test]
fn run_template_keeps_the_flags_of_the_command() {
    // Arrange / Act
    let result = parse(&[
        "run",
        "--template",
        "py",
        "-e",
        "A=1",
        "--workdir",
        "/tmp",
        "--user",
        "1000",
        "--timeout",
        "5",
        "--hostname",
        "clone",
        "--memory",
        "512",
        "--timings",
        "--",
        "true",
    ]);

    // Assert
    assert!(result.is_ok(), "{}", result.unwrap_err());
}

#[test]
fn a_restore_has_the_templates_sizes_and_refuses_others() {
    // Arrange
    let m = manifest("py");

    // Act
    let implied = sizes(None, None, &m);
    let same = sizes(Some(2), Some(512), &m);
    let more_memory = sizes(None, Some(1024), &m);
    let fewer_vcpus = sizes(Some(1), None, &m);

    // Assert
    assert_eq!(implied, Ok((2, 512)));
    assert_eq!(same, Ok((2, 512)));
    let err = more_memory.unwrap_err();
    assert!(
        err.contains("template py has 512 MiB") && err.contains("--memory 1024"),
        "{err}"
    );
    let err = fewer_vcpus.unwrap_err();
    assert!(
        err.contains("template py has 2 vCPUs") && err.contains("--vcpus 1"),
        "{err}"
    );
}

#[test]
fn a_template_manifest_round_trips_through_the_store() {
    // Arrange
    let dir = tempfile::tempdir().unwrap();
    let store = store_with(dir.path(), &["py"]);

    // Act
    let opened = store.open("py").unwrap();
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(opened.dir.join("template.json")).unwrap()).unwrap();

    // Assert
    assert_eq!(opened.manifest, manifest("py"));
    assert!(opened.dir.is_absolute());
    for key in [
        "name",
        "kernel",
        "initrd",
        "memory_mib",
        "vcpus",
        "created",
        "bulkhead_version",
        "prepare",
    ] {
        assert!(json.get(key).is_some(), "{key} missing: {json}");
    }
}

#[test]
fn opening_a_missing_or_damaged_template_says_what_to_do() {
    // Arrange: `broken` lost its manifest
    let dir = tempfile::tempdir().unwrap();
    let store = store_with(dir.path(), &[]);
    std::fs::create_dir_all(store.path("broken")).unwrap();

    // Act
    let missing = store.open("nope").unwrap_err();
    let broken = store.open("broken").unwrap_err();

    // Assert
    assert!(
        missing.contains("no template named nope") && missing.contains("template ls"),
        "{missing}"
    );
    assert!(broken.contains("bulkhead template rm broken"), "{broken}");
}

#[test]
fn sizes_on_disk_read_as_people_write_them() {
    // Arrange / Act / Assert
    assert_eq!(format_size(0), "0 B");
    assert_eq!(format_size(1), "1 KiB");
    assert_eq!(format_size(812 << 10), "812 KiB");
    assert_eq!(format_size(9_961_472), "9.5 MiB");
    assert_eq!(format_size(310 << 20), "310 MiB");
    assert_eq!(format_size((21 << 30) / 10), "2.1 GiB");
    assert_eq!(format_size(40 << 30), "40 GiB");
}

#[test]
fn a_sparse_memory_file_counts_only_its_allocated_blocks() {
    // Arrange: a 256 MiB memory file with 64 KiB written, and a small state file
    let dir = tempfile::tempdir().unwrap();
    let memory = std::fs::File::create(dir.path().join("memory")).unwrap();
    memory.set_len(256 << 20).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&memory, &[7u8; 64 << 10], 1 << 20).unwrap();
    memory.sync_all().unwrap();
    std::fs::write(dir.path().join("state"), [1u8; 100]).unwrap();

    // Act
    let size = size_on_disk(dir.path());

    // Assert
    assert!(size >= (64 << 10) + 100, "{size}");
    assert!(size < 4 << 20, "the holes were counted: {size}");
}

#[test]
fn ls_shows_one_line_per_template_with_its_size_on_disk() {
    // Arrange
    let listed = [
        store::Listed {
            manifest: manifest("py"),
            size_on_disk: 9_961_472,
        },
        store::Listed {
            manifest: TemplateManifest {
                memory_mib: 4096,
                vcpus: 16,
                ..manifest("node-20")
            },
            size_on_disk: 2 << 30,
        },
    ];

    // Act
    let table = ls_table(&listed);

    // Assert
    let lines: Vec<Vec<&str>> = table
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(lines[0], ["NAME", "MEMORY", "VCPUS", "CREATED", "SIZE"]);
    assert_eq!(
        lines[1],
        [
            "py",
            "512",
            "MiB",
            "2",
            "2026-01-31T12:00:00Z",
            "9.5",
            "MiB"
        ]
    );
    assert_eq!(
        lines[2],
        [
            "node-20",
            "4096",
            "MiB",
            "16",
            "2026-01-31T12:00:00Z",
            "2.0",
            "GiB"
        ]
    );
    assert_eq!(lines.len(), 3);
}

#[test]
fn ls_lists_templates_by_name_and_reports_directories_that_are_none() {
    // Arrange: two templates, a create in progress and a directory without a manifest
    let dir = tempfile::tempdir().unwrap();
    let store = store_with(dir.path(), &["zz", "aa"]);
    let _partial = store.begin("mm").unwrap();
    std::fs::create_dir_all(store.path("junk")).unwrap();

    // Act
    let (listed, broken) = store.list().unwrap();

    // Assert
    let names: Vec<&str> = listed.iter().map(|l| l.manifest.name.as_str()).collect();
    assert_eq!(names, ["aa", "zz"]);
    assert_eq!(broken.len(), 1);
    assert!(
        broken[0].starts_with("junk is not a template"),
        "{broken:?}"
    );
}

#[test]
fn ls_of_a_store_that_does_not_exist_yet_is_empty() {
    let dir = tempfile::tempdir().unwrap();
    let store = TemplateStore::new(dir.path().join("templates"));

    let (listed, broken) = store.list().unwrap();

    assert!(listed.is_empty() && broken.is_empty());
}

#[test]
fn rm_of_an_unknown_name_fails_but_still_removes_the_others() {
    // Arrange
    let dir = tempfile::tempdir().unwrap();
    let store = store_with(dir.path(), &["a", "b", "c"]);

    // Act
    let code = rm(&store, &rm_args(&["a", "nope", "../c", "b"]));

    // Assert
    assert_eq!(code, crate::EXIT_BULKHEAD_ERROR);
    assert!(!store.path("a").exists() && !store.path("b").exists());
    assert!(store.path("c").exists(), "a path that is no name removed c");
}

#[test]
fn rm_force_says_nothing_about_unknown_names() {
    // Arrange
    let dir = tempfile::tempdir().unwrap();
    let store = store_with(dir.path(), &["a"]);

    // Act
    let code = rm(&store, &rm_args(&["-f", "nope", "a"]));
    let plain = rm(&store, &rm_args(&["a"]));

    // Assert
    assert_eq!(code, 0);
    assert!(!store.path("a").exists());
    assert_eq!(plain, crate::EXIT_BULKHEAD_ERROR, "a is gone by now");
}

#[test]
fn a_create_refuses_an_existing_name_and_a_failed_one_leaves_nothing() {
    // Arrange
    let dir = tempfile::tempdir().unwrap();
    let store = store_with(dir.path(), &["py"]);

    // Act
    let taken = store.begin("py").unwrap_err();
    let failed = store.begin("node").unwrap();
    std::fs::write(failed.path().join("memory"), b"half").unwrap();
    drop(failed);

    // Assert
    assert!(
        taken.contains("template py already exists") && taken.contains("template rm py"),
        "{taken}"
    );
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, ["py"]);
}

#[test]
fn a_committed_create_gets_its_name_unless_someone_took_it_meanwhile() {
    // Arrange
    let dir = tempfile::tempdir().unwrap();
    let store = store_with(dir.path(), &[]);
    let first = store.begin("py").unwrap();
    let second = store.begin("py").unwrap();
    manifest("py").write(first.path()).unwrap();
    std::fs::write(second.path().join("memory"), b"other").unwrap();

    // Act
    let committed = first.commit();
    let raced = second.commit();

    // Assert
    assert_eq!(committed, Ok(store.path("py")));
    assert_eq!(store.open("py").unwrap().manifest, manifest("py"));
    assert!(raced.unwrap_err().contains("already exists"));
    assert!(!store.path("py").join("memory").exists(), "overwritten");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn a_create_removes_what_killed_creates_left() {
    // Arrange: the partial directory of a create whose process is gone
    let dir = tempfile::tempdir().unwrap();
    let store = store_with(dir.path(), &[]);
    let stale = dir.path().join(".partial-999999999-py-abc");
    std::fs::create_dir_all(&stale).unwrap();
    std::fs::write(stale.join("memory"), b"x").unwrap();

    // Act
    let _partial = store.begin("node").unwrap();

    // Assert
    assert!(!stale.exists());
}

/// The recipe `run --template` makes of `args` for `template` (its sizes, `args`' flags).
fn recipe_of(args: &crate::run::RunArgs, template: &Template) -> bulkhead_sandbox::Recipe {
    let (vcpus, memory_mib) = sizes(None, None, &template.manifest).unwrap();
    let spec = bulkhead_sandbox::SandboxSpec {
        vcpus,
        memory_mib,
        ..crate::run::sandbox_spec(args).unwrap()
    };
    let host = crate::run::host_settings(args, &spec).unwrap();
    restore_recipe(&spec, &host, template, "0123456789ab").unwrap()
}

#[test]
fn a_restore_gets_the_runs_environment_user_and_directory_on_the_templates_machine() {
    // Arrange
    let template = Template {
        dir: PathBuf::from("/t/py"),
        manifest: manifest("py"),
    };
    let args = crate::run::tests::run_args(&[
        "--template",
        "py",
        "-e",
        "A=1",
        "--user",
        "1000",
        "--workdir",
        "/srv",
        "--",
        "true",
    ]);

    // Act
    let recipe = recipe_of(&args, &template);
    let request = crate::run::exec_request(&args, &recipe.exec);

    // Assert
    let c = &recipe.config;
    assert_eq!((c.vcpus, c.memory_mib), (2, 512));
    assert_eq!(c.hostname.as_deref(), Some("bh-0123456789ab"));
    assert_eq!(c.kernel, PathBuf::from("/k/vmlinux"));
    assert!(c.mounts.is_empty() && c.workspace.is_none() && c.egress.is_none());
    assert!(request.env.contains(&"A=1".into()), "{:?}", request.env);
    assert_eq!(request.user.as_deref(), Some("1000"));
    assert_eq!(request.cwd, Some("/srv".into()));
    assert_eq!(request.argv, ["true"]);
}

#[test]
fn a_restore_recipe_with_network_flags_gets_the_proxy_settings() {
    // Arrange
    let template = Template {
        dir: PathBuf::from("/t/py"),
        manifest: manifest("py"),
    };
    let args = crate::run::tests::run_args(&[
        "--template",
        "py",
        "--network",
        "allowlist",
        "--allow",
        "api.test:8443",
        "--allow-cidr",
        "127.0.0.1/32",
        "--",
        "true",
    ]);

    // Act
    let recipe = recipe_of(&args, &template);

    // Assert
    let egress = recipe
        .config
        .egress
        .expect("a network with --network allowlist");
    let policy = format!("{:?}", egress.policy);
    assert!(policy.contains("api.test"), "{policy}");
}

#[test]
fn a_restore_recipe_with_an_unknown_secret_is_refused_before_anything_starts() {
    // Arrange
    let args = crate::run::tests::run_args(&[
        "--template",
        "py",
        "--network",
        "allowlist",
        "--allow",
        "api.test",
        "--secret",
        "BULKHEAD_TEST_UNSET_SECRET_1=api.test",
        "--",
        "true",
    ]);
    let spec = crate::run::sandbox_spec(&args).unwrap();

    // Act
    let host = crate::run::host_settings(&args, &spec);

    // Assert
    let err = host.expect_err("an unset secret variable must be refused");
    assert!(err.contains("BULKHEAD_TEST_UNSET_SECRET_1"), "{err}");
}
