//! The control protocol between [`crate::TestHost`] and the test host's init, and the scripts it runs there.
//!
//! See the crate documentation for the framing. This module holds the pure parts: formatting and parsing the
//! control lines, shell quoting, and generating `/init` and the share-mounting script.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// Errors from parsing control lines.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProtocolError {
    /// A control line that is none of the known messages.
    #[error("unexpected control line from the test host: {0:?}")]
    Garbled(String),
}

/// The 9p mount tag of the per-host scratch share.
pub const SCRATCH_TAG: &str = "bhscratch";

/// Where the scratch share is mounted inside the test host.
pub const SCRATCH_MOUNT: &str = "/run/bulkhead";

/// Name of the virtio-serial port that carries the control channel (QEMU `virtserialport,name=`).
pub const CONTROL_PORT: &str = "bulkhead.ctl";

/// Where kernel modules live inside the test host's initramfs.
pub const MODULES_DIR: &str = "/lib/bulkhead-modules";

/// 9p `msize` in bytes: the largest message. Linux's 9pnet_virtio caps it near 512 KiB (its virtqueue has 128
/// descriptors of one page); measured: a 20 MB `cat` takes ~0.2-0.35 s at this size.
pub const MSIZE: u32 = 512_000;

/// Seconds between the test host's `alive ID` lines while a command runs ([`GuestMsg::Alive`]).
pub const HEARTBEAT_SECS: u64 = 10;

/// A message from the host to the test host's init.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostMsg {
    /// Run `<scratch>/cmd/<id>/script.sh`; kill its process group after `timeout` (None: never).
    Run {
        /// Command number, unique per test host.
        id: u64,
        /// Guest-side time limit.
        timeout: Option<Duration>,
    },
    /// Sync filesystems and power off.
    Exit,
}

impl HostMsg {
    /// Formats the message as one control line, newline included.
    pub fn to_line(&self) -> String {
        match self {
            HostMsg::Run { id, timeout } => {
                // "0" means no limit, so a zero timeout is sent as the smallest non-zero one.
                let secs = timeout.map_or_else(
                    || "0".to_string(),
                    |t| {
                        let ms = t.as_millis().max(1);
                        format!("{}.{:03}", ms / 1000, ms % 1000)
                    },
                );
                format!("run {id} {secs}\n")
            }
            HostMsg::Exit => "exit\n".to_string(),
        }
    }
}

/// A message from the test host's init to the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GuestMsg {
    /// Modules loaded, `/dev/kvm` present, shares mounted: commands may be sent.
    Ready,
    /// Start-up failed; the text says why.
    Fail(String),
    /// Command `id` is still running: sent every [`HEARTBEAT_SECS`] seconds while it runs, so
    /// the host can tell a busy test host from a frozen one long before the command's timeout.
    Alive {
        /// The command number from [`HostMsg::Run`].
        id: u64,
    },
    /// Command `id` finished with shell exit status `status` (128+N when killed by signal N).
    Done {
        /// The command number from [`HostMsg::Run`].
        id: u64,
        /// Exit status.
        status: i32,
    },
}

impl GuestMsg {
    /// Parses one control line (without its newline; a trailing `\r` is ignored).
    pub fn parse(line: &str) -> Result<GuestMsg, ProtocolError> {
        let line = line.trim_end_matches('\r');
        let garbled = || ProtocolError::Garbled(line.to_string());
        let mut words = line.splitn(2, ' ');
        match (words.next(), words.next()) {
            (Some("ready"), None) => Ok(GuestMsg::Ready),
            (Some("fail"), rest) => Ok(GuestMsg::Fail(rest.unwrap_or("").to_string())),
            (Some("alive"), Some(id)) => Ok(GuestMsg::Alive {
                id: id.parse().map_err(|_| garbled())?,
            }),
            (Some("done"), Some(rest)) => {
                let (id, status) = rest.split_once(' ').ok_or_else(garbled)?;
                Ok(GuestMsg::Done {
                    id: id.parse().map_err(|_| garbled())?,
                    status: status.parse().map_err(|_| garbled())?,
                })
            }
            _ => Err(garbled()),
        }
    }
}

/// Quotes `s` for a POSIX shell: the result expands to exactly `s` as one word.
pub fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Quotes a path for a POSIX shell (non-UTF-8 bytes are replaced; callers reject such paths first).
pub fn shell_quote_path(p: &Path) -> String {
    shell_quote(&p.to_string_lossy())
}

/// 9p cache mode for the shares (Linux `Documentation/filesystems/9p.rst`, option `cache=`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ShareCache {
    /// `cache=loose`: page cache for reads. Measured on a 20 MB file: `dd bs=4k` 0.2 s (vs 2-10 s uncached),
    /// but writes go back page by page (20 MB `dd bs=1M` + sync: 3.7 s vs 0.2 s). The test host syncs and
    /// drops its caches before every command, so files changed on the host between commands are seen.
    #[default]
    Loose,
    /// `cache=none`: every read and write is a 9p request of at most [`MSIZE`] bytes; fast for large
    /// sequential I/O, slow for small reads.
    None,
}

impl ShareCache {
    fn option(self) -> &'static str {
        match self {
            ShareCache::Loose => "loose",
            ShareCache::None => "none",
        }
    }
}

/// A host directory exported to the test host under a 9p mount tag, mounted at the same absolute path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Share {
    /// 9p mount tag (`bh0`, `bh1`, ...).
    pub tag: String,
    /// Absolute path on the host and inside the test host.
    pub path: PathBuf,
}

/// Generates the script that mounts `shares` (parents before children), run by init at boot.
pub fn mounts_script(shares: &[Share], cache: ShareCache) -> String {
    let mut sorted: Vec<&Share> = shares.iter().collect();
    sorted.sort_by_key(|s| s.path.components().count());
    let mut script = String::from("set -e\n");
    for s in sorted {
        let path = shell_quote_path(&s.path);
        script.push_str(&format!(
            "mkdir -p {path}\nmount -t 9p -o trans=virtio,version=9p2000.L,msize={MSIZE},cache={} {} {path}\n",
            cache.option(),
            shell_quote(&s.tag),
        ));
    }
    script
}

/// The test host's `/init`. `{MODULES}` and `{LIBPATH}` are substituted by [`init_script`].
const INIT_TEMPLATE: &str = r#"#!/bin/busybox sh
# bulkhead test host init (generated by bulkhead-testhost; see its crate docs for the protocol)
/bin/busybox --install -s /bin
export PATH=/bin:/sbin:/usr/bin:/usr/sbin HOME=/root LD_LIBRARY_PATH={LIBPATH}
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm /tmp /root
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
# cgroup2 where systemd hosts have it, with favordynmods as docs/daemon.md recommends: without it,
# each KVM_CREATE_VM waits for an RCU grace period (~20 ms here) to move a kernel thread into the
# VMM's cgroups. Kernels before 6.0 lack the option and did not wait.
mkdir -p /sys/fs/cgroup
mount -t cgroup2 -o favordynmods cgroup2 /sys/fs/cgroup 2>/dev/null || mount -t cgroup2 cgroup2 /sys/fs/cgroup
# Loopback, as any Linux host has it (servers that tests run on 127.0.0.1; the egress proxy).
ip link set lo up
log() {
  read -r up _ </proc/uptime
  echo "bulkhead-testhost: [$up] $*"
}
log "init started"
mkfifo /run/never
fail() {
  log "$*"
  [ -n "$ctl" ] && echo "fail $*" >&3
  sleep 2
  poweroff -f
}
ctl=
# A module's parameters come from the kernel command line's MODULE.PARAM=VALUE entries, as modprobe
# reads them (insmod does not); e.g. kvm_amd.vgif=0.
read -r cmdline </proc/cmdline
params() {
  p=
  for a in $cmdline; do
    case "$a" in "$1".*=*) p="$p ${a#"$1".}" ;; esac
  done
  echo "$p"
}
for m in {MODULES}; do
  insmod {MODDIR}/$m.ko $(params $m) || fail "insmod $m.ko $(params $m) failed (see the console log)"
done
# The control channel is the virtio-serial port named {PORT}; ports appear asynchronously after the
# driver binds, so wait for it (up to ~20 s, without forking).
for i in $(seq 400); do
  for p in /sys/class/virtio-ports/*; do
    [ -e "$p/name" ] && read -r n <"$p/name" && [ "$n" = {PORT} ] && ctl=/dev/${p##*/}
  done
  [ -n "$ctl" ] && [ -c "$ctl" ] && break
  ctl=
  read -t 0.05 _ <>/run/never
done
[ -n "$ctl" ] || fail "virtio-serial port {PORT} did not appear"
exec 3<>$ctl
[ -c /dev/kvm ] || fail "/dev/kvm is missing after loading kvm-amd"
log "modules loaded, /dev/kvm present"
mkdir -p {SCRATCH}
mount -t 9p -o trans=virtio,version=9p2000.L,msize={MSIZE} {TAG} {SCRATCH} || fail "cannot mount the scratch share"
sh {SCRATCH}/mounts.sh || fail "mounting the shares failed (see the console log)"
run_one() {
  d={SCRATCH}/cmd/$1
  echo 3 > /proc/sys/vm/drop_caches
  setsid sh "$d/script.sh" </dev/null >"$d/stdout" 2>"$d/stderr" 3>&- &
  pid=$!
  dog=
  if [ "$2" != 0 ]; then
    # Watchdog without fork+exec: the builtin read on a FIFO no one writes ends only by its timeout.
    ( read -t "$2" _ <>/run/never; : >"$d/timed-out"; kill -KILL -- -"$pid" ) 2>/dev/null 3>&- &
    dog=$!
  fi
  # Heartbeat: the host takes a test host that stays silent too long for frozen.
  ( while read -t {HEARTBEAT} _ <>/run/never || :; do echo "alive $1" >&3; done ) 2>/dev/null &
  beat=$!
  wait "$pid"
  st=$?
  [ -n "$dog" ] && { kill "$dog"; wait "$dog"; } 2>/dev/null
  { kill "$beat"; wait "$beat"; } 2>/dev/null
  sync
  echo "done $1 $st" >&3
}
log "shares mounted, ready"
echo ready >&3
while read -r verb id secs <&3; do
  case "$verb" in
    run) run_one "$id" "$secs" ;;
    exit) break ;;
  esac
done
sync
poweroff -f
"#;

/// Generates `/init` for the given module load order and library directories.
pub fn init_script(modules: &[String], lib_dirs: &[PathBuf]) -> String {
    let libpath: Vec<String> = lib_dirs
        .iter()
        .map(|d| d.to_string_lossy().into_owned())
        .collect();
    INIT_TEMPLATE
        .replace("{MODULES}", &modules.join(" "))
        .replace("{LIBPATH}", &shell_quote(&libpath.join(":")))
        .replace("{MODDIR}", MODULES_DIR)
        .replace("{SCRATCH}", SCRATCH_MOUNT)
        .replace("{TAG}", SCRATCH_TAG)
        .replace("{MSIZE}", &MSIZE.to_string())
        .replace("{PORT}", CONTROL_PORT)
        .replace("{HEARTBEAT}", &HEARTBEAT_SECS.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    fn run_line_carries_id_and_timeout_in_seconds() {
        // Arrange
        let msg = HostMsg::Run {
            id: 7,
            timeout: Some(Duration::from_millis(2500)),
        };

        // Act
        let line = msg.to_line();

        // Assert
        assert_eq!(line, "run 7 2.500\n");
    }

    #[test]
    fn run_line_without_timeout_sends_zero() {
        // Act
        let line = HostMsg::Run {
            id: 1,
            timeout: None,
        }
        .to_line();

        // Assert
        assert_eq!(line, "run 1 0\n");
    }

    #[test]
    fn zero_timeout_is_not_sent_as_no_limit() {
        // Act
        let line = HostMsg::Run {
            id: 1,
            timeout: Some(Duration::from_secs(0)),
        }
        .to_line();

        // Assert
        assert_eq!(line, "run 1 0.001\n");
    }

    #[test]
    fn done_line_parses_id_and_status() {
        // Act
        let msg = GuestMsg::parse("done 12 137\r").unwrap();

        // Assert
        assert_eq!(
            msg,
            GuestMsg::Done {
                id: 12,
                status: 137
            }
        );
    }

    #[test]
    fn alive_line_names_the_running_command() {
        // Act
        let msg = GuestMsg::parse("alive 7").unwrap();
        let bad = GuestMsg::parse("alive seven");

        // Assert
        assert_eq!(msg, GuestMsg::Alive { id: 7 });
        assert!(bad.is_err());
    }

    #[test]
    fn the_init_script_beats_while_a_command_runs() {
        // Act
        let script = init_script(&["kvm".to_owned()], &[]);

        // Assert
        let beat = format!("read -t {HEARTBEAT_SECS} _");
        assert!(script.contains(&beat), "{script}");
        assert!(script.contains(r#"echo "alive $1" >&3"#), "{script}");
        assert!(!script.contains("{HEARTBEAT}"));
    }

    #[test]
    fn fail_line_keeps_the_reason() {
        // Act
        let msg = GuestMsg::parse("fail /dev/kvm is missing").unwrap();

        // Assert
        assert_eq!(msg, GuestMsg::Fail("/dev/kvm is missing".into()));
    }

    #[test]
    fn unknown_line_is_garbled() {
        // Act
        let result = GuestMsg::parse("done x 1");

        // Assert
        assert_eq!(result, Err(ProtocolError::Garbled("done x 1".into())));
    }

    #[test]
    fn shell_quote_survives_a_real_shell() {
        // Arrange
        let nasty = "it's a $HOME `x` \"q\" \\ \n end";

        // Act
        let out = Command::new("sh")
            .arg("-c")
            .arg(format!("printf %s {}", shell_quote(nasty)))
            .output()
            .unwrap();

        // Assert
        assert_eq!(String::from_utf8(out.stdout).unwrap(), nasty);
    }

    #[test]
    fn mounts_script_mounts_parents_first_at_the_same_path() {
        // Arrange
        let shares = vec![
            Share {
                tag: "bh0".into(),
                path: "/work/main/target".into(),
            },
            Share {
                tag: "bh1".into(),
                path: "/work/main".into(),
            },
        ];

        // Act
        let script = mounts_script(&shares, ShareCache::Loose);

        // Assert
        let parent = script.find("'bh1' '/work/main'\n").unwrap();
        let child = script.find("'bh0' '/work/main/target'\n").unwrap();
        assert!(parent < child, "{script}");
        assert!(script.contains("cache=loose"));
    }

    #[test]
    fn init_script_loads_modules_in_the_given_order() {
        // Arrange
        let modules = vec!["irqbypass".to_string(), "kvm".to_string()];

        // Act
        let init = init_script(&modules, &[PathBuf::from("/lib64")]);

        // Assert
        assert!(init.contains("for m in irqbypass kvm; do"));
        assert!(init.contains("LD_LIBRARY_PATH='/lib64'"));
        for placeholder in [
            "{MODULES}",
            "{LIBPATH}",
            "{MODDIR}",
            "{SCRATCH}",
            "{TAG}",
            "{MSIZE}",
        ] {
            assert!(!init.contains(placeholder), "{placeholder} left in /init");
        }
    }

    #[test]
    fn init_passes_a_module_its_parameters_from_the_kernel_command_line() {
        // Arrange: the init's `params` function, run by a POSIX shell on a made-up command line
        let init = init_script(&["kvm_amd".to_string()], &[]);
        let start = init.find("params() {").expect("params function in /init");
        let end = start + init[start..].find("\n}\n").expect("end of params") + 3;
        let cmdline =
            "console=ttyS0 kvm_amd.vgif=0 kvm.x=1 kvm_amd.npt=0 kvm_amdx.y=2 kvm_amd.bare";
        let script = format!(
            "cmdline='{cmdline}'\n{}\necho \"[$(params kvm_amd)]\"",
            &init[start..end]
        );

        // Act
        let out = Command::new("sh").arg("-c").arg(&script).output().unwrap();

        // Assert
        assert_eq!(String::from_utf8_lossy(&out.stdout), "[ vgif=0 npt=0]\n");
    }
}
