//! Python in the test host, for the Python SDK's integration tests (`sdk/python`): the host's
//! Debian interpreter (`/usr/bin/python3`, package `python3`) runs inside the nested test host.
//!
//! The test host boots an initramfs with the host's glibc libraries and shares host directories
//! at the same paths, except its own system directories (`/usr/lib` among them). So [`prepare`]
//! copies the interpreter and its standard library (less its tests, caches and GUI modules:
//! about 20 MB, once per Python version) into the shared target directory, as a Python home
//! (`bin/python3`, `lib/python3.X/`), and the interpreter's libraries (its `ldd` list) go into
//! the initramfs like every other binary's. Extension modules that link more libraries than the
//! interpreter (`_ssl`, `_sqlite3`) cannot be imported there; the SDK needs none (`http.client`
//! works without `ssl`).

use std::env;
use std::path::PathBuf;
use std::process::Command;

use crate::{target_dir, workspace_root, INNER_ENV};

/// The interpreter the tests use: Debian's, which links libpython statically (a pyenv build
/// would put its 23 MB libpython into every test host's initramfs).
pub const SYSTEM_PYTHON: &str = "/usr/bin/python3";

/// Copies the running interpreter (argv[1]: the home directory) and its standard library into a
/// Python home, unless the stamp says that this version is there already; prints the
/// interpreter's real path.
const COPY_SCRIPT: &str = r#"
import os, shutil, sys, sysconfig
home = sys.argv[1]
exe = os.path.realpath(sys.executable)
stdlib = sysconfig.get_paths()["stdlib"]
stamp = os.path.join(home, "stamp")
want = f"{exe} {sys.version}"
if not os.path.exists(stamp) or open(stamp).read() != want:
    # Built beside the home and renamed into place, so that a concurrent run sees either
    # the old home or the complete new one.
    new = f"{home}.new-{os.getpid()}"
    os.makedirs(os.path.join(new, "bin"))
    shutil.copy(exe, os.path.join(new, "bin", "python3"))
    skip = shutil.ignore_patterns("__pycache__", "test", "tests", "idlelib", "tkinter", "turtledemo",
                                  "lib2to3", "ensurepip", "config-*", "site-packages", "dist-packages")
    shutil.copytree(stdlib, os.path.join(new, "lib", os.path.basename(stdlib)), ignore=skip)
    with open(os.path.join(new, "stamp"), "w") as f:
        f.write(want)
    shutil.rmtree(home, ignore_errors=True)
    os.rename(new, home)
print(exe)
"#;

/// What the test host needs for Python, from [`prepare`].
#[derive(Debug, Clone)]
pub struct HostPython {
    /// Directories to share: the SDK (`sdk/python`).
    pub shares: Vec<PathBuf>,
    /// The host's interpreter, whose libraries must be in the test host.
    pub interpreter: PathBuf,
}

/// The Python home copied for the test host, under the target directory.
fn home() -> PathBuf {
    target_dir().join("bulkhead-tests/python")
}

/// The SDK's directory (`sdk/python`).
pub fn sdk_dir() -> PathBuf {
    workspace_root().join("sdk/python")
}

/// Copies the host's interpreter and standard library into the shared target directory (see
/// the module docs); returns what the test host must share and which binary's libraries it
/// needs. None when [`SYSTEM_PYTHON`] is missing or fails (the tests that run Python then fail
/// with [`command`]'s message).
pub fn prepare() -> Option<HostPython> {
    let out = Command::new(SYSTEM_PYTHON)
        .args(["-c", COPY_SCRIPT])
        .arg(home())
        .output()
        .ok()?;
    if !out.status.success() {
        eprintln!(
            "copying Python for the test host failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        return None;
    }
    let interpreter = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
    Some(HostPython {
        shares: vec![sdk_dir()],
        interpreter,
    })
}

/// A command running Python: [`SYSTEM_PYTHON`] here, or inside the test host the copy that
/// [`prepare`] made, with its `PYTHONHOME`.
///
/// # Panics
/// Inside the test host, when [`prepare`] made no copy (no usable `/usr/bin/python3` on the
/// host: `apt-get install python3`, which `scripts/setup.sh` does).
pub fn command() -> Command {
    if env::var_os(INNER_ENV).is_none() {
        return Command::new(SYSTEM_PYTHON);
    }
    let home = home();
    let python = home.join("bin/python3");
    assert!(
        python.is_file(),
        "no Python in the test host ({} is missing): the host needs a working {SYSTEM_PYTHON} \
         (apt-get install python3; scripts/setup.sh installs it)",
        python.display()
    );
    let mut command = Command::new(python);
    command.env("PYTHONHOME", home);
    command
}
