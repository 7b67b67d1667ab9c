//! Bad input to `bulkhead-vmm`: a clear error, a non-zero exit, no panic, and no files left
//! behind. These never boot a guest, so they run directly on any host with a usable /dev/kvm for
//! VM set-up (`--allow-pvm` lets them get past the kvm_pvm refusal on this project's machines).

use std::path::Path;
use std::process::Output;

use bulkhead_tests::{artifacts, copy_for_any_user, describe, run, scratch_dir};

/// Runs bulkhead-vmm with `args` plus serial/debug-port files in `dir`; asserts the common
/// failure contract and returns stderr.
fn expect_failure(dir: &Path, args: &[&str]) -> String {
    let serial = dir.join("serial.txt");
    let debugcon = dir.join("debugcon.txt");
    let mut all: Vec<&str> = args.to_vec();
    all.extend([
        "--serial",
        serial.to_str().unwrap(),
        "--debugcon",
        debugcon.to_str().unwrap(),
        "--allow-pvm",
    ]);
    let out = run(&artifacts().vmm, &all);
    assert_failed_cleanly(&out);
    assert!(!serial.exists(), "serial output file left behind");
    assert!(!debugcon.exists(), "debug port output file left behind");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn assert_failed_cleanly(out: &Output) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{}", describe(out));
    assert!(stderr.contains("bulkhead-vmm: error:"), "{}", describe(out));
    assert!(!stderr.contains("panicked"), "{}", describe(out));
}

fn kernel() -> &'static str {
    artifacts().vmlinux.to_str().unwrap()
}

#[test]
fn missing_kernel_is_a_clear_error() {
    let dir = scratch_dir();

    let err = expect_failure(dir.path(), &["--kernel", "/nonexistent/vmlinux"]);

    assert!(
        err.contains("cannot read kernel /nonexistent/vmlinux"),
        "{err}"
    );
}

#[test]
fn a_kernel_that_is_neither_elf_nor_bzimage_is_refused() {
    let dir = scratch_dir();
    let bogus = dir.path().join("not-a-kernel");
    std::fs::write(&bogus, vec![0x5au8; 64 * 1024]).unwrap();

    let err = expect_failure(dir.path(), &["--kernel", bogus.to_str().unwrap()]);

    assert!(err.contains("not an ELF vmlinux or bzImage"), "{err}");
}

#[test]
fn an_initramfs_larger_than_guest_memory_is_refused() {
    let dir = scratch_dir();
    let big = dir.path().join("big.cpio");
    let file = std::fs::File::create(&big).unwrap();
    file.set_len(200 << 20).unwrap();

    let err = expect_failure(
        dir.path(),
        &[
            "--kernel",
            kernel(),
            "--initrd",
            big.to_str().unwrap(),
            "--memory",
            "128",
        ],
    );

    assert!(err.contains("does not fit"), "{err}");
}

#[test]
fn zero_memory_is_refused() {
    let dir = scratch_dir();

    let err = expect_failure(dir.path(), &["--kernel", kernel(), "--memory", "0"]);

    assert!(err.contains("memory must be between"), "{err}");
}

#[test]
fn zero_vcpus_are_refused() {
    let dir = scratch_dir();

    let err = expect_failure(dir.path(), &["--kernel", kernel(), "--vcpus", "0"]);

    assert!(err.contains("vcpus must be between 1 and"), "{err}");
}

#[test]
fn more_vcpus_than_allowed_are_refused() {
    let dir = scratch_dir();

    let too_many = (u32::from(bulkhead_vmm::config::MAX_VCPUS) + 1).to_string();

    let err = expect_failure(dir.path(), &["--kernel", kernel(), "--vcpus", &too_many]);

    assert!(err.contains("vcpus must be between 1 and"), "{err}");
}

#[test]
fn an_unreadable_kvm_device_is_a_clear_error() {
    use std::os::unix::fs::PermissionsExt;
    // Everything but the device node is accessible to an unprivileged user: the files and a copy
    // of the VMM in the system temp dir (target/ may be under root's home).
    let (dir, vmm_copy) = copy_for_any_user(&artifacts().vmm);
    std::fs::set_permissions(dir.path(), PermissionsExt::from_mode(0o777)).unwrap();
    let fake_kernel = dir.path().join("vmlinux");
    std::fs::write(
        &fake_kernel,
        b"only checked for readability before KVM is opened",
    )
    .unwrap();
    std::fs::set_permissions(&fake_kernel, PermissionsExt::from_mode(0o644)).unwrap();
    let node = dir.path().join("kvm");
    std::fs::write(&node, b"").unwrap();
    std::fs::set_permissions(&node, PermissionsExt::from_mode(0o000)).unwrap();
    let serial = dir.path().join("serial.txt");
    let vmm = vmm_copy.to_str().unwrap();
    let args = [
        "--kernel",
        fake_kernel.to_str().unwrap(),
        "--kvm-device",
        node.to_str().unwrap(),
        "--serial",
        serial.to_str().unwrap(),
        "--allow-pvm",
    ];
    // Root ignores file modes: drop to nobody, as an unprivileged user would be.
    // SAFETY: geteuid has no preconditions.
    let out = if unsafe { libc::geteuid() } == 0 {
        let mut all = vec!["--reuid=65534", "--regid=65534", "--clear-groups", vmm];
        all.extend(args);
        run(Path::new("setpriv"), &all)
    } else {
        run(&artifacts().vmm, &args)
    };

    assert_failed_cleanly(&out);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot open") && err.contains("Permission denied"),
        "{err}"
    );
    assert!(!serial.exists());
}

#[test]
fn a_config_file_with_unknown_fields_is_refused() {
    let dir = scratch_dir();
    let config = dir.path().join("vm.json");
    std::fs::write(
        &config,
        format!(r#"{{"kernel": "{}", "cpus": 2}}"#, kernel()),
    )
    .unwrap();

    let out = run(&artifacts().vmm, &["--config", config.to_str().unwrap()]);

    assert_failed_cleanly(&out);
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown field `cpus`"));
}

#[test]
fn an_unknown_flag_is_a_usage_error() {
    let out = run(&artifacts().vmm, &["--kernel", kernel(), "--bogus"]);

    assert_eq!(out.status.code(), Some(2), "{}", describe(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--bogus"));
}
