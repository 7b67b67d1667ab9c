//! Builds a real Debian image (minutes, network, root). Ignored by default; run with
//!
//! ```sh
//! cargo build --release --target x86_64-unknown-linux-musl -p bulkhead-agent
//! sudo -E cargo test -p bulkhead-image --test build_debian -- --ignored --nocapture
//! ```
//!
//! The agent comes from `BULKHEAD_AGENT` or the workspace's musl release build; downloaded
//! packages are cached in the normal cache directory, so a second run downloads nothing.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use bulkhead_image::{default_cache_dir, BuildSpec, ImageStore};

fn agent_binary() -> PathBuf {
    std::env::var_os("BULKHEAD_AGENT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../target/x86_64-unknown-linux-musl/release/bulkhead-agent")
        })
}

/// `debugfs -R "ls -p DIR"` of `image`: the names in DIR.
fn ls(image: &std::path::Path, dir: &str) -> Vec<String> {
    let out = Command::new("debugfs")
        .args(["-R", &format!("ls -p {dir}")])
        .arg(image)
        .env("PATH", "/usr/sbin:/sbin:/usr/bin:/bin")
        .output()
        .unwrap();
    // `ls -p` lines look like /inode/mode/uid/gid/name/size/
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split('/').nth(5).map(str::to_owned))
        .collect()
}

#[test]
#[ignore = "builds a real Debian image: needs root, network and a few minutes"]
fn default_debian_image_has_the_promised_tools_and_the_agent() {
    // Arrange
    let data = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let store = ImageStore::new(data.path()).with_cache_dir(default_cache_dir().unwrap());
    let spec = BuildSpec::new("debian", agent_binary());
    let started = Instant::now();

    // Act
    let manifest = store
        .build(&spec, &mut |p| {
            eprintln!("[{:?} {:?}] {}", p.phase, p.fraction, p.message)
        })
        .unwrap();
    let elapsed = started.elapsed();

    // Assert
    let image = store.verify("debian").unwrap();
    let allocated = {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(&image.rootfs).unwrap().blocks() * 512
    };
    eprintln!(
        "built in {:.1} s: {} bytes ({} MiB), {} MiB allocated, sha256 {}",
        elapsed.as_secs_f64(),
        manifest.size_bytes,
        manifest.size_bytes >> 20,
        allocated >> 20,
        manifest.sha256
    );
    let bin = ls(&image.rootfs, "/usr/bin");
    for tool in ["python3", "git", "bash", "ps"] {
        assert!(
            bin.iter().any(|n| n == tool),
            "{tool} missing from /usr/bin"
        );
    }
    assert!(ls(&image.rootfs, "/usr/sbin")
        .iter()
        .any(|n| n == "bulkhead-agent"));
    assert!(!ls(&image.rootfs, "/etc").iter().any(|n| n == "resolv.conf"));
}
