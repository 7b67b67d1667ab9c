//! Signals to `bulkhead run` (SIGINT, SIGTERM, SIGHUP, SIGQUIT).
//!
//! While the VM boots, a signal ends the run at once: the run's own runtime directory (holding
//! the sandbox's sockets, config and log) is removed and `bulkhead` exits 128+N; the VMM, forked
//! with PR_SET_PDEATHSIG, gets SIGTERM as the process exits. Once the command runs, signals are
//! forwarded to its process group in the guest (as `docker run` does), and the run ends
//! normally with the command's status. Should the command still not have ended [`STOP_GRACE`]
//! after the first forwarded signal (a stalled guest, or a command that ignores it), the run
//! gives up on the guest: it says so, cuts the connection, destroys the VM and exits 128+N
//! ([`gave_up_after_signal`]).

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use bulkhead_protocol::client::ExecWriter;
use signal_hook::consts::{SIGHUP, SIGINT, SIGQUIT, SIGTERM};

/// How long the command gets to end after the first forwarded signal before the run gives up
/// on the guest (10 s, like `docker stop`'s default).
pub const STOP_GRACE: Duration = Duration::from_secs(10);

/// The signal after which the run gave up on the guest; 0 while it has not.
static GAVE_UP_AFTER: AtomicI32 = AtomicI32::new(0);

/// The signal N after which the run gave up on a guest whose command did not end within
/// [`STOP_GRACE`] (the run then exits 128+N), if it did.
pub fn gave_up_after_signal() -> Option<i32> {
    match GAVE_UP_AFTER.load(Ordering::SeqCst) {
        0 => None,
        sig => Some(sig),
    }
}

/// Where a signal goes.
enum Target {
    /// Still booting: remove this directory and exit.
    Booting(PathBuf),
    /// The command runs: forward to it.
    Running(ExecWriter),
    /// The command has ended (the run is tearing down): nothing to forward.
    Ended,
}

/// Routes the signals `bulkhead run` receives (see the module docs).
pub struct SignalRouter {
    target: Arc<Mutex<Target>>,
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
        let target = Arc::new(Mutex::new(Target::Booting(run_dir)));
        let routed = Arc::clone(&target);
        thread::spawn(move || {
            let mut grace_armed = false;
            for sig in signals.forever() {
                let target = routed.lock().unwrap_or_else(|p| p.into_inner());
                match &*target {
                    Target::Booting(dir) => {
                        let _ = std::fs::remove_dir_all(dir);
                        // Not eprintln!: with stderr a closed pipe it would panic this thread.
                        let _ = writeln!(
                            std::io::stderr(),
                            "bulkhead: signal {sig} while the VM was starting; stopped"
                        );
                        std::process::exit(128 + sig);
                    }
                    Target::Running(writer) => {
                        let writer = writer.clone();
                        drop(target);
                        if !grace_armed {
                            grace_armed = true;
                            give_up_after_grace(Arc::clone(&routed), sig);
                        }
                        // An error means the command has just ended; its status is on its way.
                        let _ = writer.signal(sig);
                    }
                    Target::Ended => {}
                }
            }
        });
        Ok(SignalRouter { target })
    }

    /// From now on, signals go to the command behind `writer`.
    pub fn command_started(&self, writer: ExecWriter) {
        *self.target.lock().unwrap_or_else(|p| p.into_inner()) = Target::Running(writer);
    }

    /// The command's run is over (ended, failed or given up on): signals are no longer
    /// forwarded, and a pending [`STOP_GRACE`] does nothing.
    pub fn command_ended(&self) {
        *self.target.lock().unwrap_or_else(|p| p.into_inner()) = Target::Ended;
    }
}

/// After [`STOP_GRACE`], when the command still runs, records `sig` for
/// [`gave_up_after_signal`], says so on stderr and cuts the command's connection (the run's
/// reader then returns and the VM is destroyed).
fn give_up_after_grace(target: Arc<Mutex<Target>>, sig: i32) {
    thread::spawn(move || {
        thread::sleep(STOP_GRACE);
        let target = target.lock().unwrap_or_else(|p| p.into_inner());
        let Target::Running(writer) = &*target else {
            return;
        };
        GAVE_UP_AFTER.store(sig, Ordering::SeqCst);
        let _ = writeln!(
            std::io::stderr(),
            "bulkhead: the command did not end within {} s of signal {sig}; destroying the VM",
            STOP_GRACE.as_secs()
        );
        let _ = writer.disconnect();
    });
}
