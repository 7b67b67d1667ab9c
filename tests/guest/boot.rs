//! Booting the default kernel to a test init under `bulkhead-vmm` (the boot issue's acceptance).

use std::path::Path;
use std::process::Output;

use bulkhead_tests::{artifacts, describe, guest_test, run, run_with_env, scratch_dir};
use bulkhead_vmm::exit_report::{EndReason, ExitReport};

/// Default command line plus the test init's action.
fn cmdline(action: &str) -> String {
    format!(
        "console=ttyS0 reboot=k panic=1 nomodule i8042.noaux i8042.nomux i8042.nopnp i8042.dumbkbd quiet bulkhead_test.action={action}"
    )
}

struct Boot {
    output: Output,
    serial: String,
    debugcon: String,
}

/// Boots `kernel` with the test init; serial and debug port go to files in a scratch dir.
fn boot(kernel: &Path, vcpus: u8, memory_mib: u32, action: &str) -> Boot {
    let dir = scratch_dir();
    let serial = dir.path().join("serial.txt");
    let debugcon = dir.path().join("debugcon.txt");
    let (vcpus, memory_mib) = (vcpus.to_string(), memory_mib.to_string());
    let extra = [
        "--vcpus",
        &vcpus,
        "--memory",
        &memory_mib,
        "--debugcon",
        debugcon.to_str().unwrap(),
    ];
    let output = boot_test_init(kernel, serial.to_str().unwrap(), action, &extra, &[]);
    Boot {
        output,
        serial: std::fs::read_to_string(&serial).unwrap_or_default(),
        debugcon: std::fs::read_to_string(&debugcon).unwrap_or_default(),
    }
}

/// Boots `kernel` with the test init doing `action`, the console to `serial` (`--serial`),
/// `extra` VMM arguments and environment `env`; returns the VMM's output.
fn boot_test_init(
    kernel: &Path,
    serial: &str,
    action: &str,
    extra: &[&str],
    env: &[(&str, &Path)],
) -> Output {
    let a = artifacts();
    let cmdline = cmdline(action);
    let mut args = vec![
        "--kernel",
        kernel.to_str().unwrap(),
        "--initrd",
        a.test_initrd.to_str().unwrap(),
        "--serial",
        serial,
        "--cmdline",
        &cmdline,
    ];
    args.extend_from_slice(extra);
    run_with_env(&a.vmm, &args, env)
}

/// The value of `key=` in the test init's report line.
fn report_field(report: &str, key: &str) -> u64 {
    let line = report
        .lines()
        .find(|l| l.starts_with("bulkhead-test-init:"))
        .unwrap_or_else(|| panic!("no report line in {report:?}"));
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(&format!("{key}=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no numeric {key}= in {line:?}"))
}

guest_test!(
    fn vmlinux_boots_to_init_with_one_vcpu() {
        let b = boot(&artifacts().vmlinux, 1, 128, "reboot");

        assert!(b.output.status.success(), "{}", describe(&b.output));
        assert_eq!(report_field(&b.serial, "cpus"), 1, "{}", b.serial);
        assert_eq!(
            report_field(&b.debugcon, "cpus"),
            1,
            "debug port: {:?}",
            b.debugcon
        );
    }
);

guest_test!(
    fn two_vcpus_are_online_in_the_guest() {
        let b = boot(&artifacts().vmlinux, 2, 128, "reboot");

        assert!(b.output.status.success(), "{}", describe(&b.output));
        assert_eq!(report_field(&b.serial, "cpus"), 2, "{}", b.serial);
    }
);

guest_test!(
    fn guest_sees_the_configured_memory() {
        for mib in [128u64, 384] {
            let b = boot(&artifacts().vmlinux, 1, mib as u32, "reboot");

            assert!(b.output.status.success(), "{}", describe(&b.output));
            // The RAM our e820 map hands the kernel: all of it but the EBDA..1 MiB hole.
            let ram_mib = report_field(&b.serial, "ram_kib") / 1024;
            assert!(
                ram_mib + 8 >= mib && ram_mib <= mib,
                "{mib} MiB configured, guest RAM {ram_mib} MiB"
            );
            // MemTotal is that minus the kernel's own reservations: its image (~6 MiB), struct
            // pages (1/64 of RAM), per-CPU areas (2 MiB) and the first MiB.
            let total_mib = report_field(&b.serial, "memtotal_kib") / 1024;
            let reserved_budget = 14 + mib / 64;
            assert!(
                total_mib <= ram_mib && total_mib + reserved_budget >= mib,
                "{mib} MiB configured, guest MemTotal {total_mib} MiB (budget {reserved_budget} MiB)"
            );
        }
    }
);

guest_test!(
    fn bzimage_boots_to_init() {
        let b = boot(&artifacts().bzimage, 1, 128, "reboot");

        assert!(b.output.status.success(), "{}", describe(&b.output));
        assert_eq!(report_field(&b.serial, "cpus"), 1, "{}", b.serial);
    }
);

guest_test!(
    fn serial_off_still_boots_and_init_reports_on_the_debug_port() {
        let dir = scratch_dir();
        let debugcon = dir.path().join("debugcon.txt");

        let out = boot_test_init(
            &artifacts().vmlinux,
            "off",
            "reboot",
            &["--debugcon", debugcon.to_str().unwrap()],
            &[],
        );

        assert!(out.status.success(), "{}", describe(&out));
        assert!(
            out.stdout.is_empty(),
            "serial off but stdout has {:?}",
            String::from_utf8_lossy(&out.stdout)
        );
        let report = std::fs::read_to_string(&debugcon).unwrap();
        assert_eq!(report_field(&report, "cpus"), 1, "{report}");
    }
);

guest_test!(
    fn a_kernel_panic_is_a_reset_with_the_console_panic_quoted_even_with_the_console_off() {
        // Arrange: the test init exits, so the kernel panics ("Attempted to kill init!") and,
        // with panic=1, resets a second later just as a reboot would.
        let dir = scratch_dir();
        let boot_log = dir.path().join("boots.log");
        let exit_file = dir.path().join("exit.json");
        let exit_arg = exit_file.to_str().unwrap();

        // Act
        let out = boot_test_init(
            &artifacts().vmlinux,
            "off",
            "exit",
            &["--exit-file", exit_arg],
            &[("BULKHEAD_BOOT_LOG", &boot_log)],
        );

        // Assert: the VMM saw a reset (exit 0); the console's panic is quoted as the guest's
        // text, in the report, on stderr and in the boot log.
        assert_eq!(out.status.code(), Some(0), "{}", describe(&out));
        let report = ExitReport::read(&exit_file)
            .unwrap()
            .expect("an exit report");
        assert_eq!(report.reason, EndReason::Reset);
        let panic = report.guest_console_panic.unwrap_or_default();
        assert!(panic.starts_with("Attempted to kill init!"), "{panic}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr
                .contains("guest-written text, not verified by the host): Attempted to kill init!"),
            "{stderr}"
        );
        let log = std::fs::read_to_string(&boot_log).unwrap();
        let lines: Vec<_> = log.lines().collect();
        assert_eq!(lines.len(), 2, "{log}");
        assert!(lines[0].contains(" kernel="), "{log}");
        assert!(
            lines[1].contains(" console-panic: Attempted to kill init!"),
            "{log}"
        );
    }
);

guest_test!(
    fn a_guest_that_prints_fake_crash_lines_and_reboots_is_a_clean_reset() {
        // Arrange: the console gets `bulkhead-vmm: the guest crashed: fake` and a fake panic
        // banner, then the guest reboots cleanly.
        let dir = scratch_dir();
        let serial = dir.path().join("serial.txt");
        let exit_file = dir.path().join("exit.json");
        let exit_arg = exit_file.to_str().unwrap();

        // Act
        let out = boot_test_init(
            &artifacts().vmlinux,
            serial.to_str().unwrap(),
            "spoof-crash",
            &["--exit-file", exit_arg],
            &[],
        );

        // Assert: a clean exit; the fake VMM line is nowhere but in the guest's console.
        assert_eq!(out.status.code(), Some(0), "{}", describe(&out));
        let report = ExitReport::read(&exit_file)
            .unwrap()
            .expect("an exit report");
        assert!(report.is_clean(), "{report:?}");
        assert_eq!(report.reason, EndReason::Reset);
        assert!(
            !report.describe().contains("crashed"),
            "{}",
            report.describe()
        );
        let console = std::fs::read_to_string(&serial).unwrap();
        assert!(
            console.contains("bulkhead-vmm: the guest crashed: fake"),
            "{console}"
        );
        assert!(
            !String::from_utf8_lossy(&out.stderr).contains("the guest crashed"),
            "{}",
            describe(&out)
        );
    }
);

guest_test!(
    fn serial_on_stdout_carries_the_console() {
        let out = boot_test_init(&artifacts().vmlinux, "stdout", "reboot", &[], &[]);

        assert!(out.status.success(), "{}", describe(&out));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(report_field(&stdout, "cpus"), 1, "{stdout}");
    }
);

guest_test!(
    fn json_config_file_boots_like_the_flags() {
        let a = artifacts();
        let dir = scratch_dir();
        let config = dir.path().join("vm.json");
        let serial = dir.path().join("serial.txt");
        let json = format!(
            r#"{{"kernel": "{}", "initrd": "{}", "vcpus": 2, "memory_mib": 160, "serial": "{}", "cmdline": "{}"}}"#,
            a.vmlinux.display(),
            a.test_initrd.display(),
            serial.display(),
            cmdline("reboot")
        );
        std::fs::write(&config, json).unwrap();

        let out = run(&a.vmm, &["--config", config.to_str().unwrap()]);

        assert!(out.status.success(), "{}", describe(&out));
        let report = std::fs::read_to_string(&serial).unwrap();
        assert_eq!(report_field(&report, "cpus"), 2, "{report}");
    }
);
