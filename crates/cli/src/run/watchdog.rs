//! The host-side watchdog of `bulkhead run --timeout S`.
//!
//! The agent in the guest enforces `--timeout`: it kills the command's process group and reports
//! the end (exit status 124). When the guest or its vsock path stalls, that report never comes
//! and reading the command's output would block forever. So the run also arms this watchdog
//! when the command has started: if the end has not been reported [`limit`] after that
//! (`S` plus a [`grace`] for the agent to kill the group and report), it prints [`message`] on
//! stderr and cuts the connection ([`cut_off`]), so that the blocked reader returns; the run
//! then destroys the VM and exits 124. [`Watchdog`] itself also bounds the wait after a signal
//! forwarded to the command (`crate::signals`).

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::Duration;

use bulkhead_protocol::client::ExecWriter;

/// Least time the agent gets beyond `--timeout` to kill the group and report (5 s).
const MIN_GRACE: Duration = Duration::from_secs(5);

/// How long the agent gets beyond a `--timeout` of `timeout` to report the command's end:
/// a tenth of `timeout`, at least [`MIN_GRACE`] (5 s).
pub(super) fn grace(timeout: Duration) -> Duration {
    (timeout / 10).max(MIN_GRACE)
}

/// Time from the command's start after which the watchdog gives up on the guest: `timeout`
/// plus its [`grace`] (saturating at the longest `Duration`).
pub(super) fn limit(timeout: Duration) -> Duration {
    timeout.saturating_add(grace(timeout))
}

/// The line printed on stderr when the watchdog fires for a `--timeout` of `timeout`.
pub(super) fn message(timeout: Duration) -> String {
    format!(
        "bulkhead: the guest did not report the command's end within --timeout {} s \
         (+{} s grace); destroying the VM",
        timeout.as_secs_f64(),
        grace(timeout).as_secs_f64()
    )
}

/// Where the watchdog stands; once not `Armed`, it never changes again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Waiting for the limit.
    Armed,
    /// The run saw the command's end (or gave up itself) first.
    Disarmed,
    /// The limit passed first; the watchdog's action ran or is running.
    Fired,
}

/// A running watchdog: after its limit it runs its action unless disarmed first. Dropping it
/// disarms it.
#[derive(Debug)]
pub(crate) struct Watchdog {
    shared: Arc<(Mutex<State>, Condvar)>,
}

impl Watchdog {
    /// Starts a thread that runs `on_fire` once `limit` has passed, unless
    /// [`Watchdog::disarm`] is called first.
    pub(crate) fn arm(limit: Duration, on_fire: impl FnOnce() + Send + 'static) -> Watchdog {
        let shared = Arc::new((Mutex::new(State::Armed), Condvar::new()));
        let watched = Arc::clone(&shared);
        thread::spawn(move || {
            if fire_after(&watched, limit) {
                on_fire();
            }
        });
        Watchdog { shared }
    }

    /// Stops the watchdog; true when it had not fired (the run's own outcome stands), false
    /// when it fired first (the run was abandoned and must end as timed out).
    pub(crate) fn disarm(&self) -> bool {
        let (state, wake) = &*self.shared;
        let mut state = state.lock().unwrap_or_else(|p| p.into_inner());
        if *state == State::Armed {
            *state = State::Disarmed;
            wake.notify_all();
        }
        *state == State::Disarmed
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.disarm();
    }
}

/// Waits until `limit` has passed or the watchdog was disarmed; true (and now `Fired`) when the
/// limit passed while it was still armed.
fn fire_after(shared: &(Mutex<State>, Condvar), limit: Duration) -> bool {
    let (state, wake) = shared;
    let state = state.lock().unwrap_or_else(|p| p.into_inner());
    let (mut state, _) = wake
        .wait_timeout_while(state, limit, |s| *s == State::Armed)
        .unwrap_or_else(|p| p.into_inner());
    if *state != State::Armed {
        return false;
    }
    *state = State::Fired;
    true
}

/// Cuts the run off from a guest that stopped answering: shuts the command's connection down
/// (never blocking, see [`ExecWriter::disconnect`]; the reader blocked on it returns), and
/// should that fail, SIGKILLs the VMM through `vmm` (its pidfd), which closes the connection
/// from the other end.
pub(super) fn cut_off(writer: ExecWriter, vmm: Option<OwnedFd>) {
    let Err(e) = writer.disconnect() else {
        return;
    };
    tracing::warn!("cutting the connection to the guest failed ({e}); killing the VMM");
    if let Some(fd) = vmm {
        kill_by_pidfd(&fd);
    }
}

/// SIGKILLs the process behind the pidfd `fd` (pidfd_send_signal(2); the pidfd cannot name
/// another process, even once this one has been reaped).
fn kill_by_pidfd(fd: &OwnedFd) {
    // SAFETY: pidfd_send_signal takes a pidfd we own, a signal number, no siginfo (null) and
    // no flags; it reads no memory of ours.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd.as_raw_fd(),
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if rc != 0 {
        tracing::warn!("killing the VMM: {}", std::io::Error::last_os_error());
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use super::*;

    #[test]
    fn the_grace_is_a_tenth_of_the_timeout_but_at_least_five_seconds() {
        assert_eq!(grace(Duration::from_millis(1)), Duration::from_secs(5));
        assert_eq!(grace(Duration::from_secs(3)), Duration::from_secs(5));
        assert_eq!(grace(Duration::from_secs(50)), Duration::from_secs(5));
        assert_eq!(grace(Duration::from_secs(120)), Duration::from_secs(12));
        assert_eq!(grace(Duration::from_secs(3600)), Duration::from_secs(360));
    }

    #[test]
    fn the_limit_is_the_timeout_plus_its_grace_and_never_overflows() {
        assert_eq!(limit(Duration::from_secs(3)), Duration::from_secs(8));
        assert_eq!(limit(Duration::from_secs(200)), Duration::from_secs(220));
        assert_eq!(limit(Duration::MAX), Duration::MAX);
    }

    #[test]
    fn the_message_names_the_timeout_the_grace_and_what_happens() {
        assert_eq!(
            message(Duration::from_millis(2500)),
            "bulkhead: the guest did not report the command's end within --timeout 2.5 s \
             (+5 s grace); destroying the VM"
        );
    }

    #[test]
    fn a_watchdog_past_its_limit_fires_once_and_then_cannot_be_disarmed() {
        let (fired, fires) = mpsc::channel();

        let watchdog = Watchdog::arm(Duration::ZERO, move || fired.send(()).unwrap());

        fires.recv().unwrap();
        assert!(!watchdog.disarm());
        assert!(!watchdog.disarm());
    }

    #[test]
    fn a_disarmed_watchdog_never_fires() {
        let (fired, fires) = mpsc::channel::<()>();

        let watchdog = Watchdog::arm(Duration::from_secs(3600), move || {
            fired.send(()).unwrap();
        });

        assert!(watchdog.disarm());
        assert!(watchdog.disarm());
        // The watchdog's thread ends on disarming and drops the action unrun.
        assert!(fires.recv().is_err());
    }
}
