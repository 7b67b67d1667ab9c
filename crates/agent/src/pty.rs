//! Pseudo-terminals for `tty` execs (pty(7)): a master the agent keeps and a slave that becomes
//! the command's controlling terminal and stdio.
//!
//! The kernel's line discipline does the terminal's work: `0x03` written to the master sends
//! `SIGINT` to the foreground process group, `TIOCSWINSZ` on the master sends it `SIGWINCH`,
//! and once every slave descriptor is closed a read of the master fails with `EIO` (the
//! output's end of file).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};

use bulkhead_protocol::WindowSize;

/// The terminal's end-of-file character when the master's settings cannot be read (`^D`).
const DEFAULT_VEOF: u8 = 0x04;

/// A master/slave pair, both close-on-exec.
#[derive(Debug)]
pub struct Pty {
    /// The agent's end: reads are the terminal's output, writes are typed input.
    pub master: OwnedFd,
    /// The command's end, `/dev/pts/N`.
    slave: OwnedFd,
}

impl Pty {
    /// Opens a new pseudo-terminal of `size` (`openpty(3)`, the devpts mounted on `/dev/pts`).
    pub fn open(size: WindowSize) -> io::Result<Pty> {
        let mut master: libc::c_int = -1;
        let mut slave: libc::c_int = -1;
        let winsize = winsize(size);
        // SAFETY: openpty writes two descriptors into the given ints; the name and termios
        // pointers may be null; `winsize` is a valid struct borrowed for the call.
        let rc = unsafe {
            libc::openpty(
                &mut master,
                &mut slave,
                std::ptr::null_mut(),
                std::ptr::null(),
                &winsize,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: on success both descriptors are open and owned by nobody else.
        let pty = unsafe {
            Pty {
                master: OwnedFd::from_raw_fd(master),
                slave: OwnedFd::from_raw_fd(slave),
            }
        };
        set_cloexec(&pty.master)?;
        set_cloexec(&pty.slave)?;
        Ok(pty)
    }

    /// Makes the slave `cmd`'s stdin, stdout and stderr and, in the child, its controlling
    /// terminal (`TIOCSCTTY`). Must be called after the `pre_exec` hook that calls `setsid`:
    /// hooks run in order, and only a session leader without a terminal can acquire one.
    pub fn attach(&self, cmd: &mut Command) -> io::Result<()> {
        cmd.stdin(Stdio::from(self.slave.try_clone()?));
        cmd.stdout(Stdio::from(self.slave.try_clone()?));
        cmd.stderr(Stdio::from(self.slave.try_clone()?));
        // SAFETY: the hook makes one ioctl on descriptor 0 (the slave after std's dup2), which is
        // async-signal-safe, as required between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                if libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Ok(())
    }
}

/// Sets the terminal behind `master` to `size`; the kernel signals `SIGWINCH` to its
/// foreground process group when the size changed.
pub fn resize(master: &impl AsRawFd, size: WindowSize) -> io::Result<()> {
    let winsize = winsize(size);
    // SAFETY: TIOCSWINSZ reads one `struct winsize`, borrowed for the call.
    if unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSWINSZ, &winsize) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The terminal's end-of-file character (`c_cc[VEOF]`, normally `^D`), which a `StdinEof`
/// "types".
pub fn eof_char(master: &impl AsRawFd) -> u8 {
    let mut termios = std::mem::MaybeUninit::<libc::termios>::uninit();
    // SAFETY: tcgetattr fills the termios struct on success; it is read only then.
    if unsafe { libc::tcgetattr(master.as_raw_fd(), termios.as_mut_ptr()) } == 0 {
        // SAFETY: initialised by the successful tcgetattr above.
        let termios = unsafe { termios.assume_init() };
        return termios.c_cc[libc::VEOF];
    }
    DEFAULT_VEOF
}

fn winsize(size: WindowSize) -> libc::winsize {
    libc::winsize {
        ws_row: size.rows.max(1),
        ws_col: size.cols.max(1),
        ws_xpixel: 0,
        ws_ypixel: 0,
    }
}

fn set_cloexec(fd: &OwnedFd) -> io::Result<()> {
    // SAFETY: fcntl(2) F_SETFD on a descriptor we own; no pointers.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use super::*;

    /// Reads the master until the slave side is gone (`EIO`) or end of file.
    fn read_all(master: OwnedFd) -> String {
        let mut file = std::fs::File::from(master);
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match file.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
        String::from_utf8_lossy(&out).into_owned()
    }

    #[test]
    fn a_command_on_the_pty_sees_a_terminal_of_the_requested_size() {
        // Arrange
        let pty = Pty::open(WindowSize {
            rows: 33,
            cols: 101,
        })
        .unwrap();
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "test -t 0 && test -t 1 && stty size"]);
        // SAFETY: setsid is async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                libc::setsid();
                Ok(())
            });
        }
        pty.attach(&mut cmd).unwrap();

        // Act
        let mut child = cmd.spawn().unwrap();
        drop(cmd);
        let Pty { master, slave } = pty;
        drop(slave);
        let status = child.wait().unwrap();
        let output = read_all(master);

        // Assert
        assert!(status.success(), "{status:?}: {output:?}");
        assert_eq!(output.trim(), "33 101");
    }

    #[test]
    fn the_eof_character_is_ctrl_d_by_default() {
        let pty = Pty::open(WindowSize::default()).unwrap();

        assert_eq!(eof_char(&pty.master), 0x04);
    }
}
