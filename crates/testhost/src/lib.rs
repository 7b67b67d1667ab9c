//! The nested test host: QEMU (TCG, `-cpu max`, which emulates AMD SVM) running Debian's 6.1 kernel with
//! kvm-amd loaded, so that bulkhead's VMM can use real KVM in boot-level tests on machines whose own
//! `/dev/kvm` cannot boot a stock Linux guest (see `shared/ENVIRONMENT.md`, "The nested test host").
//!
//! A [`TestHost`] boots once and then runs many shell commands:
//!
//! ```no_run
//! use std::time::Duration;
//! use bulkhead_testhost::{TestHost, TestHostConfig};
//!
//! let host = TestHost::start(TestHostConfig {
//!     shares: vec!["/work/main/target".into()],
//!     ..TestHostConfig::default()
//! })?;
//! let out = host.run("test -c /dev/kvm && ls /work/main/target", Duration::from_secs(30))?;
//! assert_eq!(out.status, 0);
//! host.shutdown()?;
//! # Ok::<(), bulkhead_testhost::Error>(())
//! ```
//!
//! # Artifacts and cache
//!
//! [`prepare`] (called by [`TestHost::start`]) asks apt which package `linux-image-amd64` depends on,
//! `apt-get download`s it once into `${XDG_CACHE_HOME:-~/.cache}/bulkhead/testhost/<package>_<version>/`,
//! unpacks it with `dpkg -x` and keeps the kernel and the modules needed (kvm-amd and its dependencies; 9p
//! over virtio-pci), in dependency order read from each module's `.modinfo`. It then builds the initramfs —
//! busybox, the modules, the host's glibc runtime plus the `ldd` libraries of
//! [`TestHostConfig::extra_libs_for`], and `/init` — as a gzip'd cpio "newc" archive cached under
//! `initramfs/<sha256 of the inputs>.cpio.gz`. A `flock` on `<cache>/.lock` serializes concurrent preparers
//! and every entry is renamed into place when complete.
//!
//! # Shares
//!
//! Each directory in [`TestHostConfig::shares`] is exported with virtio-9p (`-fsdev local,...,
//! security_model=none` + `virtio-9p-pci`) and mounted inside **at the same absolute path**, so command
//! lines with absolute host paths work unchanged. Mount options: `version=9p2000.L,msize=512000` and
//! `cache=loose` by default ([`ShareCache`]); before each command the test host drops its caches, so files
//! changed on the host between commands are read afresh, and after each command it runs `sync`, so files
//! written inside are on the host when [`TestHost::run`] returns.
//!
//! # Control protocol (framing)
//!
//! Control messages travel on a virtio-serial port named `bulkhead.ctl` (`virtio-serial-pci` +
//! `virtserialport`), whose QEMU `socket` chardev connects to a Unix socket that [`TestHost`] listens on
//! (`<run dir>/ctl.sock`). (A second 16550 UART was tried first: now and then the UART's receive interrupt
//! was lost under TCG while the guest was also transmitting, leaving a `run` line in the FIFO and init waiting
//! forever: 2 of 22 runs of the integration tests, 3 stalls in ~700 timeout+command pairs; none in 600
//! pairs with virtio-serial.) The serial port ttyS0 is the console and goes to
//! `<run dir>/console.log`; errors quote its last 40 lines. Control messages are ASCII lines ending in `\n`:
//!
//! | direction     | line                       | meaning                                                  |
//! |---------------|----------------------------|----------------------------------------------------------|
//! | guest → host  | `ready`                    | modules loaded, `/dev/kvm` exists, shares mounted        |
//! | guest → host  | `fail <reason>`            | start-up failed (init then powers off)                   |
//! | host → guest  | `run <id> <seconds>`       | run command `<id>`; `<seconds>` (`S.mmm`) limit, `0` none |
//! | guest → host  | `done <id> <status>`       | command `<id>` ended with shell exit status `<status>`   |
//! | host → guest  | `exit`                     | sync and power off                                       |
//!
//! Scripts and outputs never travel on the control channel, so they are binary safe: a per-host scratch
//! directory (`<run dir>/scratch`) is shared as 9p tag `bhscratch` with `cache=none` and mounted at
//! `/run/bulkhead`. For command `<id>` the host writes `cmd/<id>/script.sh`; the guest runs
//! `setsid sh cmd/<id>/script.sh </dev/null >cmd/<id>/stdout 2>cmd/<id>/stderr`, and on timeout creates
//! `cmd/<id>/timed-out` and kills the script's process group with SIGKILL. After `done` the host reads
//! `stdout` and `stderr` (while waiting too, when streaming) and deletes `cmd/<id>/`.
//!
//! # Flakiness
//!
//! Nested guests stall (RCU stalls, a vCPU that never takes its interrupt) or crash ("Fatal exception in
//! interrupt") far more often with single-threaded TCG than with multi-threaded TCG: under a guest-only
//! stress init, most boots failed with one TCG thread against few with one thread per vCPU
//! (`benches/testhost-stress.sh`, results in `benches/results/README.md`). Multi-threaded TCG
//! (`-accel tcg,thread=multi`) has its own rare failure, in the test host's boot: about 1 boot in 30
//! livelocked on this 2-core build machine under load (CPU 0 spinning in `stop_machine`, CPU 1 re-entering
//! `asm_exc_int3`: kernel text patching racing TCG's cross-vCPU code invalidation; "watchdog: BUG: soft
//! lockup"). Hence the defaults: multi-threaded TCG ([`TcgThreads::Multi`]), `softlockup_panic=1` so that a
//! livelock ends QEMU instead of hanging, and a second boot attempt ([`TestHostConfig::boot_attempts`]).
//!
//! # Performance (measured on the 2-core build machine)
//!
//! | what                                            | single-threaded TCG | multi-threaded TCG |
//! |-------------------------------------------------|---------------------|--------------------|
//! | cold prepare (download 70 MB, unpack, build)    | 13.6 s (21 s loaded)| same               |
//! | cached prepare                                  | 0.4 s (debug build) | same               |
//! | boot to ready, incl. cached prepare             | 5.7-7.3 s (26 s under 2 CPU hogs) | 5.6-9 s |
//! | command round trip (`true`)                     | 37-57 ms            | 153 ms             |
//! | read a 20 MB file (`cat`, cache=loose)          | 0.12-0.2 s          | 0.23 s             |
//! | write 20 MB + `sync` (cache=loose)              | 2.2 s               | 2.6 s              |
//! | shutdown                                        | 35 ms               | 90 ms              |
//!
//! # Lifetime
//!
//! QEMU is spawned from a dedicated thread with `PR_SET_PDEATHSIG(SIGKILL)` (see [`qemu`]), so it dies with
//! the process that started it, even on SIGKILL or when a `static` holds the [`TestHost`]; `Drop` and
//! [`TestHost::shutdown`] stop it too. Run directories of dead owners are removed by the next
//! [`TestHost::start`].

#![deny(missing_docs)]

pub mod artifacts;
pub mod cache;
pub mod channel;
pub mod host;
pub mod initramfs;
pub mod kernel;
pub mod libs;
pub mod modules;
pub mod protocol;
pub mod qemu;
pub mod rundir;

pub use artifacts::{prepare, PrepareOptions, Prepared};
pub use host::{CommandOutput, Error, TestHost, TestHostConfig};
pub use protocol::ShareCache;
pub use qemu::{TcgThreads, DEFAULT_CPU_MODEL};
