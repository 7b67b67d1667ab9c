//! Unit tests of `bulkhead run`'s argument handling, messages and helpers.

use super::*;
use bulkhead_vmm::vstate::memory::{MAX_MEMORY_MIB, MIN_MEMORY_MIB};

#[test]
fn signals_map_to_128_plus_n_and_timeouts_to_124() {
    let killed = ExitStatus {
        code: None,
        signal: Some(9),
        timed_out: false,
        oom_killed: false,
    };
    let timed_out = ExitStatus {
        code: None,
        signal: Some(9),
        timed_out: true,
        oom_killed: false,
    };
    let seven = ExitStatus {
        code: Some(7),
        signal: None,
        timed_out: false,
        oom_killed: false,
    };

    assert_eq!(exit_code(&killed), 137);
    assert_eq!(exit_code(&timed_out), 124);
    assert_eq!(exit_code(&seven), 7);
}

#[test]
fn a_run_the_watchdog_abandoned_exits_124_and_a_reported_end_keeps_its_status() {
    let seven = ExitStatus {
        code: Some(7),
        signal: None,
        timed_out: false,
        oom_killed: false,
    };

    assert_eq!(outcome_code(&Outcome::Abandoned), EXIT_TIMEOUT);
    assert_eq!(outcome_code(&Outcome::Exited(seven)), 7);
    assert_eq!(outcome_code(&Outcome::GaveUpAfterSignal(15)), 143);
}

#[test]
fn only_output_events_keep_the_run_going() {
    let exit = ExecEvent::Exit(ExitStatus {
        code: Some(0),
        signal: None,
        timed_out: false,
        oom_killed: false,
    });

    assert!(!ends_run::<()>(&Ok(Some(ExecEvent::Stdout(b"x".to_vec())))));
    assert!(!ends_run::<()>(&Ok(Some(ExecEvent::Stderr(b"x".to_vec())))));
    assert!(ends_run::<()>(&Ok(Some(exit))));
    assert!(ends_run::<()>(&Ok(None)));
    assert!(ends_run::<()>(&Err(())));
}

#[test]
fn the_watchdog_waits_the_timeout_plus_the_grace_and_only_with_a_timeout() {
    let defaults = ExecDefaults::default();
    let timed = exec_request(
        &run_args(&["--timeout", "3", "--", "sleep", "9"]),
        &defaults,
    );
    let untimed = exec_request(&run_args(&["--", "sleep", "9"]), &defaults);

    let limit = watched_timeout(&timed).map(watchdog::limit);

    assert_eq!(limit, Some(Duration::from_secs(8)));
    assert_eq!(watched_timeout(&untimed), None);
}

#[test]
fn env_flags_override_the_defaults_and_another_user_gets_no_default_home() {
    // Arrange
    let args = run_args(&["-e", "PATH=/x", "-e", "A=b=c", "true"]);
    let as_user = run_args(&["--user", "1000", "true"]);

    // Act
    let spec = sandbox_spec(&args).unwrap();
    let request = exec_request(&args, &ExecDefaults::of(&spec));
    let user_spec = sandbox_spec(&as_user).unwrap();
    let user_request = exec_request(&as_user, &ExecDefaults::of(&user_spec));

    // Assert
    assert!(request.env.contains(&"PATH=/x".into()));
    assert!(!request
        .env
        .iter()
        .any(|e| e.as_bytes().starts_with(b"PATH=/usr")));
    assert!(request.env.contains(&"A=b=c".into()));
    assert!(request.env.contains(&"HOME=/root".into()));
    assert!(request.env.contains(&"TERM=dumb".into()));
    assert!(request.kill_group_on_exit && request.stdin);
    assert!(
        !user_request
            .env
            .iter()
            .any(|e| e.as_bytes().starts_with(b"HOME=")),
        "{:?}",
        user_request.env
    );
    assert_eq!(user_request.user.as_deref(), Some("1000"));
}

#[test]
fn vcpus_and_memory_outside_the_vmm_limits_are_refused() {
    let max = MAX_VCPUS.to_string();
    let above = (u32::from(MAX_VCPUS) + 1).to_string();
    let too_little = (MIN_MEMORY_MIB - 1).to_string();
    let too_much = (u64::from(MAX_MEMORY_MIB) + 1).to_string();

    assert_eq!(parse_vcpus("1"), Ok(1));
    assert_eq!(parse_vcpus(&max), Ok(MAX_VCPUS));
    assert!(parse_vcpus("0")
        .unwrap_err()
        .contains(&format!("between 1 and {max}")));
    assert!(parse_vcpus(&above).is_err());
    assert!(parse_vcpus("-1").is_err());
    assert_eq!(
        parse_memory(&MIN_MEMORY_MIB.to_string()),
        Ok(MIN_MEMORY_MIB)
    );
    assert!(parse_memory("0")
        .unwrap_err()
        .contains("guest memory must be between"));
    assert!(parse_memory(&too_little).is_err());
    assert!(parse_memory(&too_much).is_err());
}

#[test]
fn timeouts_must_be_at_least_a_millisecond() {
    assert_eq!(
        parse_positive_seconds("1.5"),
        Ok(Duration::from_millis(1500))
    );
    assert_eq!(
        parse_positive_seconds("0.001"),
        Ok(Duration::from_millis(1))
    );
    assert!(parse_positive_seconds("0").is_err());
    assert!(parse_positive_seconds("0.0001").is_err());
    assert!(parse_positive_seconds("-1").is_err());
    assert!(parse_positive_seconds("inf").is_err());
    assert!(parse_positive_seconds("NaN").is_err());
    assert!(parse_positive_seconds("soon").is_err());
    let huge = parse_positive_seconds("18446744073709551615").unwrap_err();
    assert!(huge.contains("too large"), "{huge}");
}

#[test]
fn shell_quoting_leaves_plain_words_bare_and_survives_a_real_shell() {
    let words = [
        "--timeout",
        "20",
        "sh",
        "-c",
        "sleep 30 & echo 'done'",
        "",
        "$HOME",
    ];

    let quoted: Vec<String> = words.iter().map(|w| shell_quote(w)).collect();
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("printf '%s|' {}", quoted.join(" ")))
        .output()
        .unwrap();

    assert_eq!(&quoted[..4], ["--timeout", "20", "sh", "-c"]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "--timeout|20|sh|-c|sleep 30 & echo 'done'||$HOME|"
    );
}

#[test]
fn the_testhost_hint_carries_the_arguments_and_extra_shares() {
    let hint = testhost_hint(
        "run --memory 512 -- 'a b'",
        &[PathBuf::from("/src/my proj")],
        &[],
    );

    assert!(hint.starts_with("bulkhead-testhost run --share "), "{hint}");
    assert!(
        hint.contains(" --share '/src/my proj' -e BULKHEAD_DATA_DIR="),
        "{hint}"
    );
    assert!(hint.ends_with(" run --memory 512 -- 'a b'"), "{hint}");
}

#[test]
fn the_testhost_hint_passes_overrides_on_with_their_dirs_and_secrets_by_name() {
    let env = [
        ("BULKHEAD_KERNEL", PathBuf::from("/k/vmlinux")),
        ("BULKHEAD_VMM", PathBuf::from("/opt/vmm dir/bulkhead-vmm")),
    ];

    let hint = testhost_hint_with("run -- true", &[PathBuf::from("/k")], &env, &["TOKEN"]);

    assert!(
        hint.contains(" --share /k --share '/opt/vmm dir' -e "),
        "{hint}"
    );
    assert!(hint.contains(" -e 'BULKHEAD_KERNEL=/k/vmlinux' "), "{hint}");
    assert!(
        hint.contains(" -e 'BULKHEAD_VMM=/opt/vmm dir/bulkhead-vmm' -e TOKEN -- "),
        "{hint}"
    );
    assert_eq!(hint.matches("--share /k ").count(), 1, "{hint}");
}

#[test]
fn a_hint_that_shares_tmp_moves_the_runtime_directory_off_the_share() {
    // Arrange / Act
    let tmp = testhost_hint_with("run -- true", &[PathBuf::from("/tmp")], &[], &[]);
    let other = testhost_hint_with("run -- true", &[PathBuf::from("/srv/out")], &[], &[]);

    // Assert
    assert!(
        tmp.contains(" --share /tmp ") && tmp.contains(" -e BULKHEAD_RUNTIME_DIR=/var/lib/"),
        "{tmp}"
    );
    assert!(!other.contains("BULKHEAD_RUNTIME_DIR"), "{other}");
}

/// `bulkhead run` parsed from `words` (after `run`).
pub(crate) fn run_args(words: &[&str]) -> RunArgs {
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        run: RunArgs,
    }
    let argv = std::iter::once("run").chain(words.iter().copied());
    <Cli as clap::Parser>::try_parse_from(argv).unwrap().run
}

#[test]
fn the_testhost_shares_the_dirs_of_absolute_mounts_and_output_files_once_each() {
    let args = run_args(&[
        "--workspace=/src/app:clone",
        "--mount=/data:/data:ro",
        "--mount=rel:/rel",
        "--export-tar=/out/changes.tar",
        "--console=/data/console.log",
        "--",
        "true",
    ]);
    let patch = run_args(&["--export-patch=/out/x.patch", "--console=c.log", "true"]);
    let at_root = run_args(&["--console=/console.log", "true"]);

    let shares = extra_shares(&args);

    assert_eq!(
        shares,
        [Path::new("/src/app"), Path::new("/data"), Path::new("/out")]
    );
    assert_eq!(extra_shares(&patch), [Path::new("/out")]);
    assert!(extra_shares(&at_root).is_empty());
}

#[test]
fn relative_dirs_that_leave_the_current_directory_are_shared_by_absolute_path() {
    let cwd = Path::new("/home/u/proj/sub");

    let up = absolute_outside(Path::new("../../data"), cwd);
    let inside = absolute_outside(Path::new("out/../logs"), cwd);
    let here = absolute_outside(Path::new(""), cwd);

    assert_eq!(up.as_deref(), Some(Path::new("/home/u/data")));
    assert_eq!(inside, None);
    assert_eq!(here, None);
}

#[test]
fn the_testhost_never_shares_the_hosts_dev_proc_or_sys() {
    let args = run_args(&["--console=/dev/stdout", "--mount=/proc/1:/p", "true"]);

    assert!(extra_shares(&args).is_empty());
}

#[test]
fn the_testhost_shares_the_dirs_of_the_boot_files_images_and_disks_it_reads() {
    let args = run_args(&[
        "--kernel=/k/vmlinux",
        "--initrd=/k/initrd.cpio",
        "--image=/img/root.ext4",
        "--disk-file=/disks/data.raw:ro",
        "true",
    ]);
    let by_name = run_args(&["--image=alpine", "--kernel=rel/vmlinux", "true"]);

    let shares = extra_shares(&args);

    assert_eq!(
        shares,
        [Path::new("/k"), Path::new("/img"), Path::new("/disks")]
    );
    assert!(extra_shares(&by_name).is_empty());
}

#[test]
fn scratch_disk_sizes_below_the_minimum_or_not_numbers_are_refused() {
    assert_eq!(parse_scratch_mib("64"), Ok(64));
    assert!(parse_scratch_mib("7").unwrap_err().contains("at least 8"));
    assert!(parse_scratch_mib("-1")
        .unwrap_err()
        .contains("is not a whole number"));
    assert!(parse_scratch_mib("99999999999999999999")
        .unwrap_err()
        .contains("too large"));
}

#[test]
fn negative_numbers_get_the_range_message_not_a_flag_error() {
    for flag in [
        "--timeout",
        "--vcpus",
        "--memory",
        "--boot-timeout",
        "--disk",
    ] {
        let argv = ["bulkhead", "run", "--image=i", flag, "-1", "true"];

        let err = <crate::Cli as clap::Parser>::try_parse_from(argv)
            .unwrap_err()
            .to_string();

        assert!(err.contains("invalid value '-1'"), "{flag}: {err}");
        assert!(!err.contains("unexpected argument"), "{flag}: {err}");
    }
}

#[test]
fn the_agent_gets_the_boot_timeout_but_never_less_than_the_client_default() {
    let long = Duration::from_secs(100);

    assert_eq!(agent_patience(long), long);
    assert_eq!(agent_patience(Duration::from_secs(1)), DEFAULT_TIMEOUT);
}

#[test]
fn env_flags_must_be_key_value_with_any_bytes_as_the_value() {
    use std::os::unix::ffi::OsStringExt;
    let bytes = OsString::from_vec(b"A=\xff\x01".to_vec());

    assert_eq!(
        parse_env(bytes),
        Ok(("A".to_owned(), ByteString::from(vec![0xff, 0x01])))
    );
    assert!(parse_env("=1".into()).is_err());
    assert!(parse_env("novalue".into()).is_err());
    assert!(parse_env(OsString::from_vec(b"\xff=1".to_vec())).is_err());
}

#[test]
fn kernel_args_are_appended_to_the_guest_command_line_in_order() {
    let args = run_args(&[
        "--kernel-arg",
        "loglevel=7",
        "--kernel-arg=rodata=off",
        "true",
    ]);

    let spec = sandbox_spec(&args).unwrap();

    assert_eq!(spec.kernel_args, ["loglevel=7", "rodata=off"]);
}

#[test]
fn a_kernel_arg_must_be_one_parameter_and_not_a_boot_parameter() {
    assert_eq!(parse_kernel_arg("quiet"), Ok("quiet".to_owned()));
    let reserved = parse_kernel_arg("bulkhead.hostname=x").unwrap_err();
    assert!(reserved.contains("boot parameters"), "{reserved}");
    for bad in ["", "a b", "init=/x\tpanic=0", "x\0y"] {
        let err = parse_kernel_arg(bad).unwrap_err();
        assert!(
            err.contains("--kernel-arg once per parameter"),
            "{bad:?}: {err}"
        );
    }
}
