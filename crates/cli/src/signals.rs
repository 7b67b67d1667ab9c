//! Signals to `bulkhead run` (SIGINT, SIGTERM, SIGHUP, SIGQUIT).
//!
//! While the VM boots, a signal ends the run at once: the run's own runtime directory (holding
//! the sandbox's sockets, config and log) is removed and `bulkhead` exits 128+N; the VMM, forked
//! with PR_SET_PDEATHSIG, gets SIGTERM as the process exits. Once the command runs, signals are
//! forwarded to its process group in the guest (as `docker run` does), and the run ends
//! normally with the command's status. Should the command still not have ended [`STOP_GRACE`]
//! after the first forwarded signal (a stalled guest, or a command that ignores it), the run
//! gives up on the guest: it says so, cuts the connection, destroys the VM and exits 128+N
//! ([`SignalRouter::command_ended`] tells).

use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use bulkhead_protocol::client::ExecWriter;
use signal_hook::consts::{SIGHUP, SIGINT, SIGQUIT, SIGTERM};

use crate::run::watchdog::Watchdog;

/// How long the command gets to end after the first forwarded signal before the run gives up
/// on the guest (10 s, like `docker stop`'s default).
pub const STOP_GRACE: Duration = Duration::from_secs(10);

/// Where a signal goes.
enum Target {
    /// Still booting: remove this directory and exit.
    Booting(PathBuf),
    /// The command runs: forward to it.
    Running(ExecWriter),
    /// The command has ended (the run is tearing down): nothing to forward.
    Ended,
}

/// Where signals go, and the [`STOP_GRACE`] watchdog armed by the first forwarded signal N
/// (with N).
struct Routing {
    target: Target,
    grace: Option<(i32, Watchdog)>,
    /// The first signal that came once the command had ended.
    late: Option<i32>,
}

/// Routes the signals `bulkhead run` receives (see the module docs).
pub struct SignalRouter {
    routing: Arc<Mutex<Routing>>,
}

impl SignalRouter {
    /// Installs the handlers; until [`SignalRouter::command_started`], a signal removes
    /// `run_dir` and exits the process with 128+N.
    ///
    /// # Errors
    /// A message when the handlers cannot be installed.
    pub fn install(run_dir: PathBuf) -> Result<Self, String> {
        let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP, SIGQUIT])
            .map_err(|e| format!("cannot install signal handlers: {e}"))?;
        let routing = Arc::new(Mutex::new(Routing {
            target: Target::Booting(run_dir),
            grace: None,
            late: None,
        }));
        let routed = Arc::clone(&routing);
        thread::spawn(move || {
            for sig in signals.forever() {
                let mut routing = routed.lock().unwrap_or_else(|p| p.into_inner());
                let writer = match &routing.target {
                    // Exits the process with the lock held (see `boot_failed`).
                    Target::Booting(dir) => stop_booting(dir, sig),
                    Target::Running(writer) => writer.clone(),
                    Target::Ended => {
                        routing.late.get_or_insert(sig);
                        continue;
                    }
                };
                if routing.grace.is_none() {
                    routing.grace = Some((sig, give_up_after_grace(writer.clone(), sig)));
                }
                // Not under the lock: the write may wait for a busy connection.
                drop(routing);
                // An error means the command has just ended; its status is on its way.
                let _ = writer.signal(sig);
            }
        });
        Ok(SignalRouter { routing })
    }

    /// From now on, signals go to the command behind `writer`.
    pub fn command_started(&self, writer: ExecWriter) {
        self.routing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .target = Target::Running(writer);
    }

    /// The boot failed, and the run is about to exit with that error: signals are no longer
    /// routed. A signal that is stopping the boot at this moment holds the routing lock until it
    /// exits the process, and its removal of the run directory is likely what made the boot
    /// fail; this then waits for that exit, so the run ends with 128+N as the signal asked and
    /// not with the boot's error halfway through the removal.
    pub fn boot_failed(&self) {
        self.routing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .target = Target::Ended;
    }

    /// The command's run is over (ended, failed or given up on): signals are no longer
    /// forwarded, and a pending [`STOP_GRACE`] does nothing. Returns the signal N when the run
    /// gave up on the guest [`STOP_GRACE`] after forwarding N (the run then exits 128+N).
    pub fn command_ended(&self) -> Option<i32> {
        let mut routing = self.routing.lock().unwrap_or_else(|p| p.into_inner());
        routing.target = Target::Ended;
        let (sig, grace) = routing.grace.take()?;
        (!grace.disarm()).then_some(sig)
    }
}

impl SignalRouter {
    /// The first signal that arrived after the command ended (which nothing forwards), for a
    /// caller with work left that such a signal should cancel (`template create`'s snapshot).
    pub fn signal_after_end(&self) -> Option<i32> {
        self.routing.lock().unwrap_or_else(|p| p.into_inner()).late
    }
}

/// Signal `sig` while the VM boots: removes the run's directory `dir` and exits 128+`sig`.
fn stop_booting(dir: &std::path::Path, sig: i32) -> ! {
    crate::rundir::remove(dir);
    // Not eprintln!: with stderr a closed pipe it would panic this thread.
    let _ = writeln!(
        std::io::stderr(),
        "bulkhead: signal {sig} while the VM was starting; stopped"
    );
    std::process::exit(128 + sig);
}

/// A watchdog that, [`STOP_GRACE`] after signal `sig` was forwarded, says so on stderr and
/// cuts the command's connection behind `writer` (the run's reader then returns and the VM is
/// destroyed), unless [`SignalRouter::command_ended`] disarms it first.
fn give_up_after_grace(writer: ExecWriter, sig: i32) -> Watchdog {
    Watchdog::arm(STOP_GRACE, move || {
        // Not eprintln!: with stderr a closed pipe it would panic this thread before the cut-off.
        let _ = writeln!(
            std::io::stderr(),
            "bulkhead: the command did not end within {} s of signal {sig}; destroying the VM",
            STOP_GRACE.as_secs()
        );
        let _ = writer.disconnect();
    })
}
