//! Unit tests of `sandbox.rs` (a separate file to keep that one short).

use super::*;

fn config_in(dir: &Path) -> SandboxConfig {
    let kernel = dir.join("vmlinux");
    let initrd = dir.join("initrd");
    fs::write(&kernel, b"k").unwrap();
    fs::write(&initrd, b"i").unwrap();
    SandboxConfig {
        kernel,
        initrd,
        runtime_dir: dir.join("run"),
        ready_timeout: Duration::from_secs(30),
        ..SandboxConfig::default()
    }
}

#[test]
fn missing_kernel_is_reported_with_a_hint() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config_in(dir.path());
    config.kernel = dir.path().join("nope");

    let err = Sandbox::start(&config).unwrap_err();

    assert!(matches!(err, Error::Missing { what: "kernel", .. }));
    assert!(err.to_string().contains("scripts/setup.sh"), "{err}");
}

#[test]
fn a_vm_that_rebooted_by_itself_without_a_log_is_explained() {
    let explained = log_or_explanation(String::new(), true);
    let failed = log_or_explanation(String::new(), false);
    let logged = log_or_explanation("error: x".to_owned(), true);

    assert!(explained.contains("/init"), "{explained}");
    assert_eq!(failed, "");
    assert_eq!(logged, "error: x");
}

#[test]
fn a_directory_given_as_the_kernel_is_not_reported_as_missing() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config_in(dir.path());
    config.kernel = dir.path().to_owned();

    let err = Sandbox::start(&config).unwrap_err();

    assert!(
        matches!(err, Error::NotAFile { what: "kernel", .. }),
        "{err:?}"
    );
    assert!(err.to_string().ends_with("is not a regular file"), "{err}");
}

#[test]
fn a_kernel_file_named_with_a_trailing_slash_is_not_reported_as_missing() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config_in(dir.path());
    let kernel = dir.path().join("vmlinux");
    std::fs::write(&kernel, b"x").unwrap();
    config.kernel = PathBuf::from(format!("{}/", kernel.display()));

    let err = config.check_files().unwrap_err();

    assert!(
        matches!(err, Error::Unreadable { what: "kernel", .. }),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(
        text.contains("vmlinux/") && text.contains("Not a directory"),
        "{text}"
    );
}

#[test]
fn a_vmm_that_exits_early_is_reported_with_its_log_and_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let vmm = dir.path().join("fake-vmm");
    fs::write(
        &vmm,
        "#!/bin/sh\necho 'bulkhead-vmm: error: boom' >&2\nexit 1\n",
    )
    .unwrap();
    fs::set_permissions(&vmm, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let mut config = config_in(dir.path());
    config.vmm_binary = vmm;

    let err = Sandbox::start(&config).unwrap_err();

    assert!(matches!(err, Error::VmExited { .. }), "{err}");
    assert!(err.to_string().contains("boom"), "{err}");
    let left: Vec<_> = fs::read_dir(dir.path().join("run")).unwrap().collect();
    assert!(left.is_empty(), "runtime dir not cleaned: {left:?}");
}

#[test]
fn an_agent_that_never_comes_up_times_out_and_the_vmm_is_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let vmm = dir.path().join("fake-vmm");
    let pidfile = dir.path().join("pid");
    fs::write(
        &vmm,
        format!(
            "#!/bin/sh\necho $$ > {}\necho 'virtio_mmio: still probing'\nexec sleep 60\n",
            pidfile.display()
        ),
    )
    .unwrap();
    fs::set_permissions(&vmm, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let mut config = config_in(dir.path());
    config.vmm_binary = vmm;
    config.ready_timeout = Duration::from_millis(300);

    let err = Sandbox::start(&config).unwrap_err();

    let Error::ReadyTimeout { log, .. } = &err else {
        panic!("not a ready time-out: {err}");
    };
    assert_eq!(log.trim(), "virtio_mmio: still probing");
    let message = err.to_string();
    assert!(message.contains("raise `bulkhead run --boot-timeout`"));
    assert!(
        message.ends_with("VMM log:\nvirtio_mmio: still probing"),
        "{message}"
    );
    let pid: i32 = fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // SAFETY: signal 0 only checks for existence.
    let alive = unsafe { libc::kill(pid, 0) } == 0;
    assert!(!alive, "the VMM process {pid} is still running");
}

fn failing_vmm(dir: &Path) -> PathBuf {
    let vmm = dir.join("fake-vmm");
    fs::write(&vmm, "#!/bin/sh\nexit 1\n").unwrap();
    fs::set_permissions(&vmm, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    vmm
}

#[test]
fn the_vmm_writes_itself_into_each_cgroup_procs_file_before_it_runs() {
    // Arrange: plain files stand in for cgroup.procs; the child writes "0" to each.
    let dir = tempfile::tempdir().unwrap();
    let procs = [dir.path().join("a.procs"), dir.path().join("b.procs")];
    for p in &procs {
        fs::write(p, b"").unwrap();
    }
    let mut config = config_in(dir.path());
    config.vmm_binary = failing_vmm(dir.path());
    config.cgroup_procs = procs.to_vec();

    // Act
    let err = Sandbox::start(&config).unwrap_err();

    // Assert
    assert!(matches!(err, Error::VmExited { .. }), "{err}");
    for p in &procs {
        assert_eq!(fs::read_to_string(p).unwrap(), "0");
    }
}

#[test]
fn a_missing_cgroup_is_a_spawn_error_naming_it() {
    // Arrange
    let dir = tempfile::tempdir().unwrap();
    let mut config = config_in(dir.path());
    config.vmm_binary = failing_vmm(dir.path());
    config.cgroup_procs = vec![dir.path().join("no-such-cgroup/cgroup.procs")];

    // Act
    let err = Sandbox::start(&config).unwrap_err();

    // Assert
    assert!(matches!(err, Error::Spawn { .. }), "{err}");
    assert!(err.to_string().contains("no-such-cgroup"), "{err}");
}

#[test]
fn vm_config_has_vsock_and_quiet_cmdline_with_the_boot_parameters_before_extra_ones() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config_in(dir.path());
    config.hostname = Some("x".into());
    config.extra_cmdline = vec!["loglevel=7".into()];
    let path = dir.path().join("vm.json");

    write_vm_config(
        &config,
        &Prepared::default(),
        &workspace::Prepared::default(),
        Path::new("/run/x/vm.sock"),
        &path,
    )
    .unwrap();
    let vm = VmConfig::from_file(&path).unwrap();

    assert_eq!(vm.vsock.unwrap().uds_path, PathBuf::from("/run/x/vm.sock"));
    let cmdline = vm.cmdline.unwrap();
    assert!(
        cmdline.contains("quiet") && cmdline.ends_with("bulkhead.hostname=x loglevel=7"),
        "{cmdline}"
    );
}

#[test]
fn an_extra_kernel_parameter_with_a_bulkhead_key_is_refused() {
    // Arrange
    let dir = tempfile::tempdir().unwrap();
    let mut config = config_in(dir.path());
    config.extra_cmdline = vec!["bulkhead.root=/dev/vdz".into()];

    // Act
    let err = write_vm_config(
        &config,
        &Prepared::default(),
        &workspace::Prepared::default(),
        Path::new("/run/x/vm.sock"),
        &dir.path().join("vm.json"),
    )
    .unwrap_err();

    // Assert
    assert!(matches!(err, Error::BootParams(_)), "{err}");
    assert!(err.to_string().contains("bulkhead.root=/dev/vdz"), "{err}");
}

#[test]
fn a_preconnected_stream_is_usable_only_while_open_and_silent() {
    // Arrange: three connections, one left idle, one the agent wrote on, one it closed.
    let (idle, _idle_agent) = UnixStream::pair().unwrap();
    let (spoken, mut spoken_agent) = UnixStream::pair().unwrap();
    std::io::Write::write_all(&mut spoken_agent, b"x").unwrap();
    let (closed, closed_agent) = UnixStream::pair().unwrap();
    drop(closed_agent);

    // Act
    let verdicts = [&idle, &spoken, &closed].map(idle_and_open);

    // Assert
    assert_eq!(verdicts, [true, false, false]);
    idle.set_read_timeout(Some(Duration::from_millis(20)))
        .unwrap();
    let err = std::io::Read::read(&mut &idle, &mut [0u8; 1]).unwrap_err();
    assert!(
        matches!(
            err.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        ),
        "the checked stream blocks again (its read timed out): {err:?}"
    );
}
