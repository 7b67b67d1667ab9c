//! Root filesystem images and disks (issue 5's acceptance): a Debian userland on a shared
//! read-only image, private writable layers, read-only and writable data disks, and clear
//! errors for bad input.
//!
//! The Debian image is built once (`bulkhead image build`, about a minute with cached packages)
//! and cached under bulkhead's data directory, keyed by its inputs (see
//! [`bulkhead_tests::Artifacts::debian_image`]).

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use bulkhead_sandbox::{Sandbox, SandboxConfig, Storage};
use bulkhead_tests::{
    artifacts, copy_for_any_user, describe, in_vm_host, run_sh, sandbox_config, sha256_hex,
    socket_dir,
};
use bulkhead_vmm::config::DiskConfig;

/// A guest test that needs the Debian image: it is prepared here before the body is delegated
/// (the test host has its own `mkfs.ext4` for scratch disks).
macro_rules! image_test {
    (fn $name:ident() $body:block) => {
        #[test]
        fn $name() {
            artifacts().debian_image();
            let path = concat!(module_path!(), "::", stringify!($name));
            let name = path.split_once("::").map(|(_, rest)| rest).unwrap_or(path);
            in_vm_host(name, || $body);
        }
    };
}

fn config() -> SandboxConfig {
    SandboxConfig {
        memory_mib: 256,
        ..sandbox_config()
    }
}

fn on_image(scratch_mib: Option<u64>, data_disks: Vec<DiskConfig>) -> Storage {
    Storage {
        root_image: Some(artifacts().debian_image()),
        scratch_mib,
        data_disks,
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Runs `bulkhead run ARGS...` against the cached test image store (so `--image debian` works).
fn bulkhead_run(args: &[&str]) -> Output {
    let a = artifacts();
    a.cli_command()
        .arg("run")
        .args(args)
        .env("BULKHEAD_DATA_DIR", a.test_image_data_dir())
        .output()
        .expect("run bulkhead")
}

/// A `len`-byte disk file in a fresh local directory, filled with a repeating pattern.
fn pattern_disk(dir: &Path, len: usize) -> PathBuf {
    let path = dir.join("data.img");
    let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    fs::write(&path, bytes).expect("write disk file");
    path
}

fn disk(path: &Path, read_only: bool) -> DiskConfig {
    DiskConfig {
        path: path.to_owned(),
        read_only,
        id: None,
        backing: None,
    }
}

image_test!(
    fn python3_git_and_bash_run_from_the_debian_image() {
        // Arrange
        let script = "python3 -c 'print(6*7)'; git --version; bash -c 'echo $BASH_VERSION'";

        // Act
        let out = bulkhead_run(&["--image", "debian", "--", "sh", "-c", script]);

        // Assert
        assert!(out.status.success(), "{}", describe(&out));
        let stdout = text(&out.stdout);
        let lines: Vec<&str> = stdout.lines().collect();
        assert_eq!(lines.first(), Some(&"42"), "{}", describe(&out));
        assert!(lines[1].starts_with("git version 2."), "{stdout}");
        assert!(lines[2].starts_with("5."), "{stdout}");
    }
);

image_test!(
    fn a_template_on_the_image_gives_each_clone_its_files_and_python() {
        // Arrange: a template booted from the Debian image (templates in a directory of their
        // own) with a scratch disk, whose preparation wrote a file with python3 and 4 MiB of
        // random bytes (with their MD5) into the writable layer on that disk, saved with the
        // template.
        let a = artifacts();
        let data = tempfile::tempdir().unwrap();
        let image = a.debian_image().display().to_string();
        let bulkhead = |args: &[&str]| {
            a.cli_command()
                .args(args)
                .env("BULKHEAD_DATA_DIR", data.path())
                .output()
                .expect("run bulkhead")
        };
        let prepare = "python3 -c \"open('/root/answer', 'w').write('42\\n')\" && \
                       head -c 4194304 /dev/urandom > /root/blob && md5sum /root/blob > /root/blob.md5";
        let created = bulkhead(&[
            "template",
            "create",
            "deb",
            "--image",
            &image,
            "--disk",
            "64",
            "--boot-timeout",
            "300",
            "--",
            "sh",
            "-c",
            prepare,
        ]);
        assert!(created.status.success(), "{}", describe(&created));
        let saved_disk = data.path().join("templates/deb/disk-1.img");
        let saved_before = sha256_hex(&fs::read(&saved_disk).expect("the template's saved disk"));
        // Each clone checks the blob as read from its disk (the page cache it inherited from the
        // template dropped first); the first also rewrites 300,000 bytes of it at an offset
        // that is no multiple of a block and reads them back from its disk.
        let first_script = "cat /root/answer; python3 -c 'print(6*7)'; echo mine > /root/own; \
            echo 3 > /proc/sys/vm/drop_caches; md5sum -c --quiet /root/blob.md5 && echo blob-ok; \
            dd if=/dev/urandom of=/root/blob bs=1000 seek=65 count=300 conv=notrunc 2>/dev/null; \
            sync; a=$(md5sum < /root/blob); echo 3 > /proc/sys/vm/drop_caches; \
            [ \"$a\" = \"$(md5sum < /root/blob)\" ] && echo reread-ok; sync";
        let second_script = "cat /root/answer; cat /root/own 2>/dev/null || echo none; \
            echo 3 > /proc/sys/vm/drop_caches; md5sum -c --quiet /root/blob.md5 && echo blob-ok";

        // Act
        let first = bulkhead(&["run", "--template", "deb", "--", "sh", "-c", first_script]);
        let second = bulkhead(&["run", "--template", "deb", "--", "sh", "-c", second_script]);
        let saved_after = sha256_hex(&fs::read(&saved_disk).expect("the template's saved disk"));

        // Assert: both clones read the template's files, python3 runs from the image, the
        // first clone's writes are its own (on its own copy-on-write disk) and read back the
        // same from that disk, and the second clone sees the template's blob unchanged.
        assert!(first.status.success(), "{}", describe(&first));
        assert_eq!(
            text(&first.stdout),
            "42\n42\nblob-ok\nreread-ok\n",
            "{}",
            describe(&first)
        );
        assert!(second.status.success(), "{}", describe(&second));
        assert_eq!(
            text(&second.stdout),
            "42\nnone\nblob-ok\n",
            "{}",
            describe(&second)
        );
        assert_eq!(
            saved_before, saved_after,
            "a clone wrote to the template's disk"
        );
    }
);

image_test!(
    fn two_sandboxes_on_one_image_keep_their_own_files_and_leave_it_unchanged() {
        // Arrange
        let image = artifacts().debian_image();
        let before = sha256_hex(&fs::read(&image).expect("read image"));
        let storage = on_image(Some(64), Vec::new());
        let (a, b) = std::thread::scope(|s| {
            let a = s.spawn(|| Sandbox::start_with(&config(), &storage).expect("start a"));
            let b = s.spawn(|| Sandbox::start_with(&config(), &storage).expect("start b"));
            (a.join().expect("a"), b.join().expect("b"))
        });
        let scratch: Vec<PathBuf> = [&a, &b]
            .iter()
            .map(|s| s.runtime_path().expect("runtime dir").join("scratch.ext4"))
            .collect();

        // Act
        run_sh(&a, "echo from-a > /etc/note && sync");
        run_sh(&b, "echo from-b > /etc/note && sync");
        let read_a = run_sh(&a, "cat /etc/note");
        let read_b = run_sh(&b, "cat /etc/note");
        let scratch_existed = scratch.iter().all(|p| p.is_file());
        a.destroy().expect("destroy a");
        b.destroy().expect("destroy b");

        // Assert
        assert_eq!(text(&read_a.stdout), "from-a\n", "{read_a:?}");
        assert_eq!(text(&read_b.stdout), "from-b\n", "{read_b:?}");
        assert!(scratch_existed, "no scratch disk in {scratch:?}");
        assert!(
            scratch.iter().all(|p| !p.exists()),
            "scratch left: {scratch:?}"
        );
        let after = sha256_hex(&fs::read(&image).expect("read image"));
        assert_eq!(before, after, "the shared image changed");
    }
);

image_test!(
    fn a_guest_write_to_a_read_only_disk_fails_and_the_host_file_is_untouched() {
        // Arrange
        let dir = socket_dir();
        let path = pattern_disk(dir.path(), 4 << 20);
        let before = fs::read(&path).unwrap();
        let mtime_before = fs::metadata(&path).unwrap().mtime_nsec();
        let sandbox =
            Sandbox::start_with(&config(), &on_image(None, vec![disk(&path, true)])).unwrap();

        // Act: /dev/vda is the image, /dev/vdb the data disk.
        let out = run_sh(
            &sandbox,
            "dd if=/dev/zero of=/dev/vdb bs=4096 count=16 oflag=direct conv=notrunc",
        );
        sandbox.destroy().unwrap();

        // Assert
        assert_ne!(out.status.code, Some(0), "{out:?}");
        let err = text(&out.stderr);
        // The guest kernel refuses writes to a read-only block device with EPERM (measured:
        // "dd: error writing '/dev/vdb': Operation not permitted"); EROFS/EIO are fine too.
        assert!(
            [
                "Operation not permitted",
                "Read-only file system",
                "Input/output error"
            ]
            .iter()
            .any(|e| err.contains(e)),
            "{err}"
        );
        assert!(fs::read(&path).unwrap() == before, "the host file changed");
        assert_eq!(fs::metadata(&path).unwrap().mtime_nsec(), mtime_before);
    }
);

image_test!(
    fn synced_data_survives_a_hard_kill_of_the_vmm() {
        // Arrange
        let dir = socket_dir();
        let path = dir.path().join("data.img");
        fs::write(&path, vec![0u8; 4 << 20]).unwrap();
        let mut sandbox =
            Sandbox::start_with(&config(), &on_image(None, vec![disk(&path, false)])).unwrap();
        let marker = "bulkhead-flush-marker";

        // Act
        let out = run_sh(
            &sandbox,
            &format!("printf {marker} | dd of=/dev/vdb conv=fsync 2>&1 && sync"),
        );
        let pid = sandbox.vmm_pid().expect("vmm pid");
        // SAFETY: kill(2) with the pid of our own child process, which has not been reaped.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        let status = sandbox.wait_exit(Duration::from_secs(30)).unwrap();
        sandbox.destroy().unwrap();

        // Assert
        assert_eq!(out.status.code, Some(0), "{out:?}");
        assert!(status.is_some(), "the VMM survived SIGKILL");
        let bytes = fs::read(&path).unwrap();
        assert_eq!(&bytes[..marker.len()], marker.as_bytes());
    }
);

image_test!(
    fn sixty_four_mib_written_in_the_guest_match_on_the_host() {
        // Arrange
        let dir = socket_dir();
        let path = dir.path().join("data.img");
        fs::File::create(&path)
            .and_then(|f| f.set_len(64 << 20))
            .unwrap();
        let sandbox =
            Sandbox::start_with(&config(), &on_image(None, vec![disk(&path, false)])).unwrap();

        // Act
        let out = run_sh(
            &sandbox,
            "head -c 67108864 /dev/urandom | tee /dev/vdb | sha256sum && sync",
        );
        sandbox.destroy().unwrap();

        // Assert
        assert_eq!(out.status.code, Some(0), "{out:?}");
        let guest_sum = text(&out.stdout);
        let host_sum = sha256_hex(&fs::read(&path).unwrap());
        assert!(
            guest_sum.starts_with(&host_sum),
            "guest {guest_sum} host {host_sum}"
        );
    }
);

/// `bulkhead run ARGS -- true` as it fails before any VM starts (input checks come first).
fn run_expecting_error(args: &[&str], uid: Option<u32>) -> String {
    let a = artifacts();
    // Another user runs a copy it can reach (target/ may be under root's home).
    let copy = uid.map(|_| copy_for_any_user(&a.cli));
    let cli = copy.as_ref().map_or(&a.cli, |(_, cli)| cli);
    let mut cmd = Command::new(cli);
    cmd.arg("run")
        .args(args)
        .args(["--", "true"])
        .env("BULKHEAD_DATA_DIR", a.test_image_data_dir());
    if let Some(uid) = uid {
        cmd.uid(uid).gid(uid);
    }
    let out = cmd.output().expect("run bulkhead");
    assert_eq!(out.status.code(), Some(125), "{}", describe(&out));
    text(&out.stderr)
}

#[test]
fn an_unknown_image_name_is_a_clear_error() {
    // Arrange / Act
    let err = run_expecting_error(&["--image", "no-such-image"], None);

    // Assert
    assert!(err.contains("unknown image \"no-such-image\""), "{err}");
    assert!(err.contains("--name no-such-image` builds one"), "{err}");
}

#[test]
fn a_truncated_or_foreign_image_file_is_a_clear_error() {
    // Arrange
    let dir = socket_dir();
    let truncated = dir.path().join("cut.ext4");
    let image = fs::read(artifacts().debian_image()).unwrap();
    fs::write(&truncated, &image[..image.len() / 2]).unwrap();
    let foreign = dir.path().join("foreign.img");
    fs::write(&foreign, vec![0u8; 1 << 20]).unwrap();

    // Act
    let cut_err = run_expecting_error(&["--image", truncated.to_str().unwrap()], None);
    let foreign_err = run_expecting_error(&["--image", foreign.to_str().unwrap()], None);

    // Assert
    assert!(cut_err.contains("is truncated"), "{cut_err}");
    assert!(
        foreign_err.contains("not an ext4 file system"),
        "{foreign_err}"
    );
}

#[test]
fn a_read_write_disk_the_user_cannot_write_is_a_clear_error() {
    // Arrange: a world-readable, read-only file, used by an unprivileged user.
    let dir = socket_dir();
    fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let path = pattern_disk(dir.path(), 1 << 20);
    fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o444)).unwrap();
    let nobody = 65534;

    // Act
    let err = run_expecting_error(&["--disk-file", path.to_str().unwrap()], Some(nobody));

    // Assert
    assert!(err.contains("is not writable"), "{err}");
}

#[test]
fn a_scratch_disk_larger_than_the_free_space_is_a_clear_error() {
    // Arrange
    let image = artifacts().debian_image();

    // Act
    let err = run_expecting_error(
        &["--image", image.to_str().unwrap(), "--disk", "1000000000"],
        None,
    );

    // Assert
    assert!(err.contains("is larger than the"), "{err}");
}
