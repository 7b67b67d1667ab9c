//! Signals to `bulkhead run` (SIGINT, SIGTERM, SIGHUP, SIGQUIT).
//!
//! While the VM boots, a signal ends the run at once: the run's own runtime directory (holding
//! the sandbox's sockets, config and log) is removed and `bulkhead` exits 128+N; the VMM, forked
//! with PR_SET_PDEATHSIG, gets SIGTERM as the process exits. Once the command runs, signals are
//! forwarded to its process group in the guest (as `docker run` does), and the run ends
//! normally with the command's status.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::thread;

use bulkhead_protocol::client::ExecWriter;
use signal_hook::consts::{SIGHUP, SIGINT, SIGQUIT, SIGTERM};

/// Where a signal goes.
enum Target {
    /// Still booting: remove this directory and exit.
    Booting(PathBuf),
    /// The command runs: forward to it.
    Running(ExecWriter),
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
            for sig in signals.forever() {
                let target = routed.lock().unwrap_or_else(|p| p.into_inner());
                match &*target {
                    Target::Booting(dir) => {
                        let _ = std::fs::remove_dir_all(dir);
                        eprintln!("bulkhead: signal {sig} while the VM was starting; stopped");
                        std::process::exit(128 + sig);
                    }
                    // An error means the command has just ended; its status is on its way.
                    Target::Running(writer) => {
                        let _ = writer.signal(sig);
                    }
                }
            }
        });
        Ok(SignalRouter { target })
    }

    /// From now on, signals go to the command behind `writer`.
    pub fn command_started(&self, writer: ExecWriter) {
        *self.target.lock().unwrap_or_else(|p| p.into_inner()) = Target::Running(writer);
    }
}
