//! A share with more entries than a default open-files limit: the VMM's file server keeps a
//! descriptor per inode the guest knows, so the VMM must raise its own `RLIMIT_NOFILE`
//! (`bulkhead_vmm::limits`) or the guest's walk fails with "Too many open files".

use std::fs::{self, File};
use std::path::PathBuf;

use bulkhead_protocol::ExecRequest;
use bulkhead_sandbox::{Mount, Sandbox, SandboxConfig};
use bulkhead_tests::{guest_test, sandbox_config};

/// Directories and files per directory of the shared tree: 3,000 files, three times the
/// usual soft limit of 1,024 descriptors.
const DIRS: usize = 5;
const FILES_PER_DIR: usize = 600;

/// The soft `RLIMIT_NOFILE` a login session typically gives, set for the VMM's parent.
const LOGIN_SOFT_LIMIT: u64 = 1024;

/// Lowers this process's soft open-files limit to `soft` (the VMM inherits it).
fn lower_soft_open_files_limit(soft: u64) {
    let (_, hard) = bulkhead_vmm::limits::open_files_limit().expect("getrlimit");
    let lim = libc::rlimit {
        rlim_cur: soft.min(hard),
        rlim_max: hard,
    };
    // SAFETY: setrlimit only reads the `rlimit` behind the valid reference.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);
}

guest_test!(
    fn a_guest_walks_a_share_of_thousands_of_files_under_a_1024_open_files_limit() {
        // Arrange: the tree on the (test) host's local file system, shared read-only.
        let share = tempfile::tempdir().expect("tempdir");
        for d in 0..DIRS {
            let dir = share.path().join(format!("d{d}"));
            fs::create_dir(&dir).expect("mkdir");
            for f in 0..FILES_PER_DIR {
                File::create(dir.join(format!("f{f}"))).expect("create");
            }
        }
        lower_soft_open_files_limit(LOGIN_SOFT_LIMIT);
        let config = SandboxConfig {
            mounts: vec![Mount {
                host: share.path().to_owned(),
                guest: PathBuf::from("/mnt/many"),
                read_only: true,
            }],
            ..sandbox_config()
        };
        let sandbox = Sandbox::start(&config).expect("sandbox start");

        // Act: list every entry, twice (the second walk finds the inodes already known).
        let out = sandbox
            .exec(&ExecRequest::new([
                "sh",
                "-ec",
                "find /mnt/many | wc -l; find /mnt/many -type f | wc -l",
            ]))
            .expect("exec")
            .wait_with_output()
            .expect("exec output");
        sandbox.destroy().expect("destroy");

        // Assert: the share's root, its directories and every file, and no error.
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code, Some(0), "find failed: {stderr}");
        let counts: Vec<&str> = stdout.split_whitespace().collect();
        let all = (1 + DIRS + DIRS * FILES_PER_DIR).to_string();
        let files = (DIRS * FILES_PER_DIR).to_string();
        assert_eq!(counts, [all.as_str(), files.as_str()], "stderr: {stderr}");
        assert!(stderr.is_empty(), "find reported errors: {stderr}");
    }
);
