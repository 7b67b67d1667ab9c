//! The Debian builder: `mmdebstrap` bootstraps the root, we install the agent and strip
//! host-specific files, `mkfs.ext4 -d` writes the image.
//!
//! Measured on Debian 12 as root (mmdebstrap 1.3.5): `--mode=root --variant=apt` with the
//! default packages takes about 30 s with a warm `.deb` cache; debootstrap was not needed.
//! Root mode is required (see [`BuildError::NeedsRoot`]); mmdebstrap's unshare mode would
//! leave sub-uid owned files that `mkfs.ext4 -d` would copy as they are.
//!
//! Downloaded packages are kept in `<cache>/apt/<suite>-<arch>-<mirror key>/` and handed in and
//! out of the chroot's `/var/cache/apt/archives` by a setup hook and a customize hook (hard
//! links when the cache and the store share a file system, copies otherwise), so a rebuild
//! does not download again; apt checks every cached file against the archive's hashes.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use sha2::{Digest, Sha256};

use crate::builder::{BuildError, RootfsBuilder};
use crate::ext4::{self, tool_path};
use crate::spec::{BuildSpec, Phase, Progress};

/// The bootstrap tool.
pub const MMDEBSTRAP: &str = "mmdebstrap";

/// mmdebstrap variant: Debian's essential packages plus apt; the spec's packages come on top.
pub const VARIANT: &str = "apt";

/// File name of the agent inside the image's `sbin` directory (`/sbin/bulkhead-agent`, which
/// is `/usr/sbin/bulkhead-agent` on merged-/usr systems such as bookworm).
pub const AGENT_NAME: &str = "bulkhead-agent";

/// Environment variable through which the cache hooks learn the host's `.deb` cache path
/// (hooks run under `sh`; passing the path in the environment needs no shell quoting).
pub const CACHE_ENV: &str = "BULKHEAD_APT_CACHE";

/// dpkg path filters: no manual pages, info pages, translations or documentation except the
/// copyright files (about 70 MB less for the default packages). Stays in the image's
/// `/etc/dpkg/dpkg.cfg.d/99mmdebstrap`, so packages installed later are filtered too.
pub const DPKG_EXCLUDES: [&str; 6] = [
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/locale/*",
    "path-include=/usr/share/locale/locale.alias",
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
];

/// Setup hook: put the cached `.deb` files into the chroot's archive directory.
const CACHE_IN_HOOK: &str = r#"mkdir -p "$1/var/cache/apt/archives" && for f in "$BULKHEAD_APT_CACHE"/*.deb; do [ -e "$f" ] || continue; ln -f "$f" "$1/var/cache/apt/archives/" 2>/dev/null || cp -a "$f" "$1/var/cache/apt/archives/" || exit 1; done"#;

/// Customize hook: keep the `.deb` files apt downloaded (a copy lands under a temporary name
/// first, so an interrupted build never leaves a truncated file under a package's name).
const CACHE_OUT_HOOK: &str = r#"for f in "$1"/var/cache/apt/archives/*.deb; do [ -e "$f" ] || continue; d="$BULKHEAD_APT_CACHE/${f##*/}"; [ -e "$d" ] && continue; ln "$f" "$d" 2>/dev/null || { cp -a "$f" "$d.part" && mv -f "$d.part" "$d"; } || exit 1; done"#;

/// Lines of tool output kept for an error message.
const OUTPUT_TAIL_LINES: usize = 40;

/// Share of the whole build's progress that bootstrapping takes.
const BOOTSTRAP_SHARE: f32 = 0.8;

/// `/etc/hosts` written when the packages brought none (the guest has no network; only
/// loopback names matter).
const HOSTS: &str = "127.0.0.1\tlocalhost\n::1\t\tlocalhost ip6-localhost ip6-loopback\n";

/// Builds Debian images with mmdebstrap; see the module documentation.
#[derive(Debug, Clone)]
pub struct DebianBuilder {
    cache_dir: PathBuf,
}

impl DebianBuilder {
    /// A builder keeping downloaded packages under `cache_dir/apt/` (`cache_dir` is bulkhead's
    /// cache directory, normally [`crate::paths::default_cache_dir`]).
    pub fn new(cache_dir: impl Into<PathBuf>) -> Self {
        Self {
            cache_dir: cache_dir.into(),
        }
    }

    /// Where `.deb` files for `spec` on Debian architecture `arch` are cached.
    pub fn apt_cache_dir(&self, spec: &BuildSpec, arch: &str) -> PathBuf {
        self.cache_dir
            .join("apt")
            .join(apt_cache_key(&spec.suite, arch, spec.mirror.as_deref()))
    }
}

impl RootfsBuilder for DebianBuilder {
    fn build(
        &self,
        spec: &BuildSpec,
        work_dir: &Path,
        image: &Path,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<(), BuildError> {
        let arch = debian_arch()?;
        preflight(spec)?;
        let cache = self.apt_cache_dir(spec, arch);
        fs::create_dir_all(&cache).map_err(BuildError::io("creating", &cache))?;
        let root = work_dir.join("root");
        progress(Progress::new(
            Phase::Bootstrap,
            format!("bootstrapping Debian {} ({arch})", spec.suite),
            Some(0.02),
        ));
        run_mmdebstrap(&mmdebstrap_args(spec, &root), &cache, progress)?;
        progress(Progress::new(
            Phase::Customize,
            format!("installing the agent as /sbin/{AGENT_NAME}"),
            Some(0.82),
        ));
        customize(&root, &spec.agent_binary)?;
        progress(Progress::new(
            Phase::Filesystem,
            "writing the ext4 image",
            Some(0.85),
        ));
        make_image(&root, image, spec.size_mib)
    }
}

/// Debian's name for this host's architecture.
pub fn debian_arch() -> Result<&'static str, BuildError> {
    match std::env::consts::ARCH {
        "x86_64" => Ok("amd64"),
        "aarch64" => Ok("arm64"),
        other => Err(BuildError::Arch(other)),
    }
}

/// Cache key for `.deb` files: suite, architecture and the mirror (`default` for Debian's
/// default mirrors, else the first 12 hex digits of the URL's SHA-256).
pub fn apt_cache_key(suite: &str, arch: &str, mirror: Option<&str>) -> String {
    let mirror = match mirror {
        None => "default".to_owned(),
        Some(url) => Sha256::digest(url.as_bytes())[..6]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect(),
    };
    format!("{suite}-{arch}-{mirror}")
}

/// The mmdebstrap command line (without the program name) that bootstraps `spec` into the
/// directory `root` (which must not exist or be empty).
pub fn mmdebstrap_args(spec: &BuildSpec, root: &Path) -> Vec<OsString> {
    let mut args: Vec<OsString> = vec![
        "--mode=root".into(),
        format!("--variant={VARIANT}").into(),
        "--format=directory".into(),
        "--skip=essential/unlink".into(),
    ];
    if !spec.packages.is_empty() {
        args.push(format!("--include={}", spec.packages.join(",")).into());
    }
    args.extend(
        DPKG_EXCLUDES
            .iter()
            .map(|o| format!("--dpkgopt={o}").into()),
    );
    args.push(format!("--setup-hook={CACHE_IN_HOOK}").into());
    args.push(format!("--customize-hook={CACHE_OUT_HOOK}").into());
    args.push("--".into());
    args.push(spec.suite.clone().into());
    args.push(root.as_os_str().to_owned());
    if let Some(mirror) = &spec.mirror {
        args.push(mirror.into());
    }
    args
}

/// How far into bootstrapping (0.0–1.0) an mmdebstrap status line shows it to be.
pub fn bootstrap_fraction(line: &str) -> Option<f32> {
    const STAGES: [(&str, f32); 8] = [
        ("I: running apt-get update", 0.05),
        ("I: downloading packages", 0.15),
        ("I: extracting archives", 0.35),
        ("I: installing essential packages", 0.45),
        ("I: installing remaining packages", 0.6),
        ("I: saving downloaded packages", 0.9),
        ("I: cleaning package lists", 0.95),
        ("I: success in", 1.0),
    ];
    STAGES
        .iter()
        .find(|(prefix, _)| line.starts_with(prefix))
        .map(|(_, fraction)| *fraction)
}

fn preflight(spec: &BuildSpec) -> Result<(), BuildError> {
    // SAFETY: geteuid takes no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Err(BuildError::NeedsRoot);
    }
    for (tool, package) in [(MMDEBSTRAP, "mmdebstrap"), ("mkfs.ext4", "e2fsprogs")] {
        if !in_path(tool) {
            return Err(BuildError::ToolMissing { tool, package });
        }
    }
    check_agent(&spec.agent_binary)
}

fn in_path(tool: &str) -> bool {
    tool_path().split(':').any(|dir| {
        fs::metadata(Path::new(dir).join(tool))
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    })
}

/// ELF `e_machine` of this host's architecture.
fn host_elf_machine() -> u16 {
    match std::env::consts::ARCH {
        "aarch64" => 183, // EM_AARCH64
        _ => 62,          // EM_X86_64
    }
}

const NOT_ELF: &str = "not a 64-bit little-endian ELF file";

/// Checks that `path` is a 64-bit little-endian ELF executable for this architecture.
pub fn check_agent(path: &Path) -> Result<(), BuildError> {
    let fail = |reason: &str| BuildError::Agent {
        path: path.to_path_buf(),
        reason: reason.to_owned(),
    };
    let mut header = [0u8; 20];
    File::open(path)
        .and_then(|mut f| f.read_exact(&mut header))
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => fail(NOT_ELF),
            _ => fail(&e.to_string()),
        })?;
    if &header[..4] != b"\x7fELF" || header[4] != 2 || header[5] != 1 {
        return Err(fail(NOT_ELF));
    }
    if !matches!(u16::from_le_bytes([header[16], header[17]]), 2 | 3) {
        return Err(fail("not an executable (ELF type is neither EXEC nor DYN)"));
    }
    if u16::from_le_bytes([header[18], header[19]]) != host_elf_machine() {
        return Err(fail("built for another CPU architecture"));
    }
    Ok(())
}

/// A pipe whose write end serves as both stdout and stderr of the child, so output arrives
/// in the order it was written.
fn output_pipe() -> Result<(OwnedFd, OwnedFd), BuildError> {
    let mut fds = [0; 2];
    // SAFETY: `fds` is a writable array of two ints, as pipe2 requires.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(BuildError::Spawn {
            tool: MMDEBSTRAP,
            source: std::io::Error::last_os_error(),
        });
    }
    // SAFETY: pipe2 succeeded, so both descriptors are open and owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

fn run_mmdebstrap(
    args: &[OsString],
    cache: &Path,
    progress: &mut dyn FnMut(Progress),
) -> Result<(), BuildError> {
    let spawn_err = |source| BuildError::Spawn {
        tool: MMDEBSTRAP,
        source,
    };
    let (read_end, write_end) = output_pipe()?;
    let stderr = write_end.try_clone().map_err(spawn_err)?;
    let mut child = Command::new(MMDEBSTRAP)
        .args(args)
        .env(CACHE_ENV, cache)
        .env("PATH", tool_path())
        .stdin(Stdio::null())
        .stdout(Stdio::from(write_end))
        .stderr(Stdio::from(stderr))
        .spawn()
        .map_err(spawn_err)?;
    let tail = forward_output(File::from(read_end), progress);
    let status = child.wait().map_err(spawn_err)?;
    if status.success() {
        return Ok(());
    }
    Err(BuildError::Bootstrap {
        tool: MMDEBSTRAP,
        status,
        output: tail.into_iter().collect::<Vec<_>>().join("\n"),
    })
}

/// Reports every output line as progress until end of file; returns the last lines.
fn forward_output(output: File, progress: &mut dyn FnMut(Progress)) -> VecDeque<String> {
    let mut tail = VecDeque::with_capacity(OUTPUT_TAIL_LINES);
    let mut reader = BufReader::new(output);
    let mut raw = Vec::new();
    while matches!(reader.read_until(b'\n', &mut raw), Ok(n) if n > 0) {
        let line = describe_line(String::from_utf8_lossy(&raw).trim_end());
        raw.clear();
        let fraction = bootstrap_fraction(&line).map(|f| 0.02 + BOOTSTRAP_SHARE * f);
        progress(Progress::new(Phase::Bootstrap, line.clone(), fraction));
        if tail.len() == OUTPUT_TAIL_LINES {
            tail.pop_front();
        }
        tail.push_back(line);
    }
    tail
}

/// An output line as shown to the user: the cache hooks' long shell commands are replaced
/// by what they do.
fn describe_line(line: &str) -> String {
    match line {
        l if l.starts_with("I: running --setup-hook") && l.contains(CACHE_ENV) => {
            "I: restoring cached packages".to_owned()
        }
        l if l.starts_with("I: running --customize-hook") && l.contains(CACHE_ENV) => {
            "I: saving downloaded packages to the cache".to_owned()
        }
        l => l.to_owned(),
    }
}

/// A directory inside the root that is a real directory, not a symbolic link (which could
/// point anywhere on the host).
fn real_dir(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok_and(|m| m.is_dir())
}

/// Removes the host's resolver and hostname files mmdebstrap copied in, adds a loopback-only
/// `/etc/hosts` when none exists, and installs the agent.
pub fn customize(root: &Path, agent: &Path) -> Result<(), BuildError> {
    let etc = root.join("etc");
    if !real_dir(&etc) {
        return Err(BuildError::io("checking", &etc)(std::io::Error::other(
            "not a directory",
        )));
    }
    for name in ["resolv.conf", "hostname"] {
        let path = etc.join(name);
        match fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(BuildError::io("removing", &path)(e))
            }
            _ => {}
        }
    }
    write_hosts(&etc.join("hosts"))?;
    install_agent(root, agent).map(|_| ())
}

fn write_hosts(path: &Path) -> Result<(), BuildError> {
    // create_new (O_EXCL) fails on any existing entry, a symbolic link included.
    match OpenOptions::new().write(true).create_new(true).open(path) {
        Ok(mut file) => file
            .write_all(HOSTS.as_bytes())
            .map_err(BuildError::io("writing", path)),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(BuildError::io("creating", path)(e)),
    }
}

/// Copies `agent` to `<root>/sbin/bulkhead-agent` (or `<root>/usr/sbin/` when `/sbin` is the
/// merged-/usr symbolic link), mode 0755, replacing any previous one atomically.
pub fn install_agent(root: &Path, agent: &Path) -> Result<PathBuf, BuildError> {
    let sbin = [root.join("sbin"), root.join("usr/sbin")]
        .into_iter()
        .find(|dir| real_dir(dir) && real_dir(dir.parent().unwrap_or(root)))
        .ok_or_else(|| {
            BuildError::io("finding sbin in", root)(std::io::Error::other(
                "neither /sbin nor /usr/sbin is a directory",
            ))
        })?;
    let target = sbin.join(AGENT_NAME);
    let tmp = sbin.join(format!(".{AGENT_NAME}.tmp"));
    let mut src = File::open(agent).map_err(BuildError::io("opening", agent))?;
    let mut dst = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o755)
        .open(&tmp)
        .map_err(BuildError::io("creating", &tmp))?;
    std::io::copy(&mut src, &mut dst).map_err(BuildError::io("writing", &tmp))?;
    fs::set_permissions(&tmp, fs::Permissions::from_mode(0o755))
        .map_err(BuildError::io("chmod", &tmp))?;
    fs::rename(&tmp, &target).map_err(BuildError::io("installing", &target))?;
    Ok(target)
}

/// Writes the tree at `root` into the ext4 image `image`, sized automatically or to
/// `size_mib` MiB.
pub fn make_image(root: &Path, image: &Path, size_mib: Option<u32>) -> Result<(), BuildError> {
    let content = ext4::usage(root)?;
    let needed = ext4::auto_size_mib(content);
    let size = size_mib.map(u64::from).unwrap_or(needed);
    match ext4::mkfs(root, image, size, ext4::inode_count(content)) {
        Err(e) if size_mib.is_some() && e.is_out_of_space() => Err(BuildError::TooSmall {
            size_mib: size,
            needed_mib: needed,
        }),
        other => Ok(other?),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mmdebstrap_gets_the_packages_cache_hooks_and_target() {
        // Arrange
        let mut spec = BuildSpec::new("debian", "/agent");
        spec.packages = vec!["python3".into(), "git".into()];
        spec.mirror = Some("http://mirror.example/debian".into());

        // Act
        let args = mmdebstrap_args(&spec, Path::new("/store/.build/root"));

        // Assert
        let args: Vec<String> = args
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert!(args.contains(&"--mode=root".to_owned()));
        assert!(args.contains(&"--include=python3,git".to_owned()));
        assert!(args
            .iter()
            .any(|a| a.starts_with("--setup-hook=") && a.contains(CACHE_ENV)));
        assert!(args
            .iter()
            .any(|a| a.starts_with("--customize-hook=") && a.contains(CACHE_ENV)));
        assert_eq!(
            args[args.len() - 4..],
            [
                "--",
                "bookworm",
                "/store/.build/root",
                "http://mirror.example/debian"
            ]
        );
    }

    #[test]
    fn default_mirror_is_left_to_mmdebstrap_so_security_updates_are_included() {
        // Arrange
        let spec = BuildSpec::new("debian", "/agent");

        // Act
        let args = mmdebstrap_args(&spec, Path::new("/r"));

        // Assert
        assert_eq!(
            args.last().map(|a| a.to_string_lossy().into_owned()),
            Some("/r".into())
        );
    }

    #[test]
    fn cache_key_separates_suites_and_mirrors() {
        // Arrange / Act
        let default = apt_cache_key("bookworm", "amd64", None);
        let mirror = apt_cache_key("bookworm", "amd64", Some("http://m/debian"));
        let other = apt_cache_key("trixie", "amd64", None);

        // Assert
        assert_eq!(default, "bookworm-amd64-default");
        assert!(mirror.starts_with("bookworm-amd64-") && mirror != default);
        assert_eq!(mirror.len(), "bookworm-amd64-".len() + 12);
        assert_ne!(other, default);
    }

    #[test]
    fn status_lines_map_to_increasing_fractions() {
        // Arrange
        let lines = [
            "I: running apt-get update...",
            "I: downloading packages with apt...",
            "I: installing essential packages...",
            "I: success in 30.8 seconds",
        ];

        // Act
        let fractions: Vec<f32> = lines.iter().filter_map(|l| bootstrap_fraction(l)).collect();

        // Assert
        assert_eq!(fractions.len(), lines.len());
        assert!(fractions.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(bootstrap_fraction("Get:1 http://deb.debian.org ..."), None);
    }

    #[test]
    fn cache_hook_lines_are_shortened_and_keep_their_progress() {
        // Arrange
        let line =
            format!("I: running --customize-hook in shell: sh -c 'for f in \"${CACHE_ENV}\"'");

        // Act
        let shown = describe_line(&line);

        // Assert
        assert_eq!(shown, "I: saving downloaded packages to the cache");
        assert!(bootstrap_fraction(&shown).is_some());
    }

    #[test]
    fn non_elf_and_missing_agents_are_refused() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("agent.sh");
        fs::write(&script, b"#!/bin/sh\necho hi\n").unwrap();

        // Act
        let script_err = check_agent(&script).unwrap_err();
        let missing_err = check_agent(&dir.path().join("nope")).unwrap_err();

        // Assert
        assert!(script_err.to_string().contains("not a 64-bit"));
        assert!(matches!(missing_err, BuildError::Agent { .. }));
    }

    #[test]
    fn this_test_binary_passes_the_agent_check() {
        // Arrange
        let exe = std::env::current_exe().unwrap();

        // Act
        let result = check_agent(&exe);

        // Assert
        assert!(result.is_ok(), "{result:?}");
    }

    #[test]
    fn customize_installs_the_agent_and_drops_host_files() {
        // Arrange
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        fs::create_dir_all(r.join("usr/sbin")).unwrap();
        fs::create_dir_all(r.join("etc")).unwrap();
        std::os::unix::fs::symlink("usr/sbin", r.join("sbin")).unwrap();
        fs::write(r.join("etc/resolv.conf"), b"nameserver 10.0.0.1\n").unwrap();
        fs::write(r.join("etc/hostname"), b"buildhost\n").unwrap();
        let agent = r.join("agent-src");
        fs::write(&agent, b"\x7fELF agent bytes").unwrap();

        // Act
        customize(r, &agent).unwrap();

        // Assert
        let installed = r.join("sbin").join(AGENT_NAME);
        assert_eq!(fs::read(&installed).unwrap(), b"\x7fELF agent bytes");
        let mode = fs::metadata(&installed).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o755);
        assert!(!r.join("etc/resolv.conf").exists());
        assert!(!r.join("etc/hostname").exists());
        assert!(fs::read_to_string(r.join("etc/hosts"))
            .unwrap()
            .contains("localhost"));
    }

    #[test]
    fn customize_does_not_follow_an_absolute_hosts_symlink_out_of_the_root() {
        // Arrange
        let outside = tempfile::tempdir().unwrap();
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        fs::create_dir_all(r.join("usr/sbin")).unwrap();
        fs::create_dir_all(r.join("etc")).unwrap();
        let victim = outside.path().join("hosts");
        std::os::unix::fs::symlink(&victim, r.join("etc/hosts")).unwrap();
        let agent = r.join("agent-src");
        fs::write(&agent, b"x").unwrap();

        // Act
        customize(r, &agent).unwrap();

        // Assert
        assert!(!victim.exists());
    }
}
