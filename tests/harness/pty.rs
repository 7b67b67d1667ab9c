//! A terminal of the test's own for `-t` sessions: a pseudo-terminal pair whose slave stands in
//! for a user's terminal (the CLI's stdio) and whose master the test reads.

use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex};

/// A pseudo-terminal pair `(master, slave)` of `rows` × `cols` (`openpty(3)`).
///
/// # Panics
/// When no pseudo-terminal can be opened.
pub fn terminal(rows: u16, cols: u16) -> (OwnedFd, OwnedFd) {
    let (mut master, mut slave) = (-1, -1);
    let ws = libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: openpty fills two descriptors; null name and termios are allowed.
    let rc = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            &ws,
        )
    };
    assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
    // SAFETY: both descriptors are new and owned by nobody else.
    unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) }
}

/// The `c_lflag` of the terminal behind `fd` (ECHO, ICANON, ISIG: what raw mode clears).
///
/// # Panics
/// When `fd` is not a terminal.
pub fn lflag(fd: &OwnedFd) -> libc::tcflag_t {
    let mut t = std::mem::MaybeUninit::<libc::termios>::uninit();
    // SAFETY: tcgetattr fills the struct; asserted to succeed before it is read.
    unsafe {
        assert_eq!(libc::tcgetattr(fd.as_raw_fd(), t.as_mut_ptr()), 0);
        t.assume_init().c_lflag
    }
}

/// Reads the terminal's output from `master` on a thread; the text so far (lossy UTF-8) is in
/// the returned buffer.
///
/// # Panics
/// When `master` cannot be duplicated.
pub fn collect(master: &OwnedFd) -> Arc<Mutex<String>> {
    let text = Arc::new(Mutex::new(String::new()));
    let mut file = std::fs::File::from(master.try_clone().unwrap());
    let sink = text.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = file.read(&mut buf) {
            if n == 0 {
                break;
            }
            let chunk = String::from_utf8_lossy(&buf[..n]).into_owned();
            sink.lock()
                .unwrap_or_else(|p| p.into_inner())
                .push_str(&chunk);
        }
    });
    text
}
