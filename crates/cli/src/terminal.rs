//! The local terminal of `-t` sessions (`run -t`, `exec -t`): raw mode while the session
//! runs (restored on every exit path: normal end, error, panic, and the signals that end
//! `bulkhead`), its size, and its size changes (`SIGWINCH`).

use std::io;
use std::os::fd::RawFd;
use std::sync::Mutex;

use bulkhead_protocol::WindowSize;
use signal_hook::consts::SIGWINCH;

/// The error `-t` gets when stdin is not a terminal (Docker's wording).
pub const NOT_A_TTY: &str =
    "the input device is not a TTY: -t needs a terminal on stdin (drop -t, \
                             or run bulkhead from a terminal)";

/// The settings to put back: the descriptor and its termios before raw mode.
static SAVED: Mutex<Option<(RawFd, libc::termios)>> = Mutex::new(None);

/// True when `fd` is a terminal.
pub fn is_tty(fd: RawFd) -> bool {
    // SAFETY: isatty(3) takes a descriptor number and no pointers.
    unsafe { libc::isatty(fd) == 1 }
}

/// `Ok` when stdin is a terminal, else [`NOT_A_TTY`].
///
/// # Errors
/// [`NOT_A_TTY`].
pub fn require_stdin_tty() -> Result<(), String> {
    match is_tty(libc::STDIN_FILENO) {
        true => Ok(()),
        false => Err(NOT_A_TTY.to_owned()),
    }
}

/// The size of the terminal behind stdout, else stdin (`TIOCGWINSZ`); `None` when neither is
/// a terminal or it reports 0 × 0.
pub fn size() -> Option<WindowSize> {
    [libc::STDOUT_FILENO, libc::STDIN_FILENO]
        .into_iter()
        .find_map(size_of)
}

fn size_of(fd: RawFd) -> Option<WindowSize> {
    let mut ws = std::mem::MaybeUninit::<libc::winsize>::uninit();
    // SAFETY: TIOCGWINSZ fills one `struct winsize`; it is read only on success.
    if unsafe { libc::ioctl(fd, libc::TIOCGWINSZ, ws.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: initialised by the successful ioctl above.
    let ws = unsafe { ws.assume_init() };
    (ws.ws_row > 0 && ws.ws_col > 0).then_some(WindowSize {
        rows: ws.ws_row,
        cols: ws.ws_col,
    })
}

/// Stdin's terminal in raw mode (`cfmakeraw`: no echo, no line editing, no signals from
/// keys, so Ctrl-C travels as `0x03` to the guest's terminal) until dropped or [`restore`]d.
#[derive(Debug)]
pub struct RawMode(());

impl RawMode {
    /// Switches stdin's terminal to raw mode.
    ///
    /// # Errors
    /// stdin is not a terminal, or its settings cannot be changed.
    pub fn enter() -> io::Result<RawMode> {
        let fd = libc::STDIN_FILENO;
        let mut termios = std::mem::MaybeUninit::<libc::termios>::uninit();
        // SAFETY: tcgetattr fills the termios on success; it is read only then.
        if unsafe { libc::tcgetattr(fd, termios.as_mut_ptr()) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: initialised by the successful tcgetattr above.
        let saved = unsafe { termios.assume_init() };
        let mut raw = saved;
        // SAFETY: cfmakeraw edits the struct it is given, nothing else.
        unsafe { libc::cfmakeraw(&mut raw) };
        *SAVED.lock().unwrap_or_else(|p| p.into_inner()) = Some((fd, saved));
        // SAFETY: tcsetattr reads one valid termios.
        if unsafe { libc::tcsetattr(fd, libc::TCSANOW, &raw) } != 0 {
            let e = io::Error::last_os_error();
            restore();
            return Err(e);
        }
        Ok(RawMode(()))
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        restore();
    }
}

/// Puts the terminal's settings from before [`RawMode::enter`] back; does nothing when none
/// are saved (never entered, or already restored). Safe to call from a signal-handling thread.
pub fn restore() {
    let saved = SAVED.lock().unwrap_or_else(|p| p.into_inner()).take();
    if let Some((fd, termios)) = saved {
        // SAFETY: tcsetattr reads one valid termios saved by `enter`.
        unsafe { libc::tcsetattr(fd, libc::TCSANOW, &termios) };
    }
}

/// The local side of a `run -t` command that has started behind `writer`: our terminal in
/// raw mode and its size changes forwarded as `Resize` frames, both until dropped.
///
/// # Errors
/// The terminal's mode cannot be changed, or `SIGWINCH` cannot be watched.
pub fn session(
    writer: &bulkhead_protocol::client::ExecWriter,
) -> Result<(RawMode, ResizeWatch), String> {
    let raw = RawMode::enter().map_err(|e| format!("cannot put the terminal in raw mode: {e}"))?;
    let writer = writer.clone();
    let watch = watch_resizes(move |size| {
        let _ = writer.resize(size);
    })?;
    Ok((raw, watch))
}

/// Calls `on_resize` with the terminal's new size after each `SIGWINCH`, on its own thread,
/// until the returned handle is dropped.
///
/// # Errors
/// The handler cannot be installed.
pub fn watch_resizes(
    on_resize: impl Fn(WindowSize) + Send + 'static,
) -> Result<ResizeWatch, String> {
    let mut signals = signal_hook::iterator::Signals::new([SIGWINCH])
        .map_err(|e| format!("cannot watch the terminal's size: {e}"))?;
    let handle = signals.handle();
    std::thread::spawn(move || {
        for _ in signals.forever() {
            if let Some(size) = size() {
                on_resize(size);
            }
        }
    });
    Ok(ResizeWatch(handle))
}

/// Stops the `SIGWINCH` thread of [`watch_resizes`] when dropped.
pub struct ResizeWatch(signal_hook::iterator::Handle);

impl Drop for ResizeWatch {
    fn drop(&mut self) {
        self.0.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restore_without_raw_mode_changes_nothing() {
        restore();

        assert!(SAVED.lock().unwrap().is_none());
    }

    #[test]
    fn a_pipe_is_not_a_terminal() {
        let mut fds = [0; 2];
        // SAFETY: pipe(2) fills two descriptors, closed below.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);

        let tty = is_tty(fds[0]);
        let size = size_of(fds[0]);

        // SAFETY: both are ours.
        unsafe {
            libc::close(fds[0]);
            libc::close(fds[1]);
        }
        assert!(!tty);
        assert_eq!(size, None);
    }
}
