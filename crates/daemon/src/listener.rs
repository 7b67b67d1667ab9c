//! The API socket: systemd socket activation (`LISTEN_FDS`, sd_listen_fds(3)) or a socket the
//! daemon binds itself, with its mode and group set; and readiness notification (sd_notify(3)).

use std::ffi::CString;
use std::io;
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener as StdListener, UnixStream};
use std::path::{Path, PathBuf};

use tokio::net::UnixListener;

use crate::config::Config;

/// First descriptor passed by socket activation.
const SD_LISTEN_FDS_START: RawFd = 3;

/// Errors of setting up the socket.
#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    /// Another process already serves on the socket path.
    #[error("{0} is in use by a running daemon")]
    InUse(PathBuf),
    /// A socket operation failed.
    #[error("socket {path}: {source}")]
    Io {
        /// The socket path (or `LISTEN_FDS`).
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// The socket group does not exist.
    #[error("unknown group {0:?} (socket_group)")]
    Group(String),
}

/// The API listener, and the path to remove at exit when the daemon bound it itself.
#[derive(Debug)]
pub struct ApiSocket {
    /// The listener.
    pub listener: UnixListener,
    /// Set when the daemon created the socket file.
    pub owned_path: Option<PathBuf>,
}

/// The activated socket when systemd passed one, else `config.socket`, bound with
/// `config.socket_mode` and `config.socket_group`.
///
/// # Errors
/// [`ListenError`].
pub fn listen(config: &Config) -> Result<ApiSocket, ListenError> {
    if let Some(listener) = activated()? {
        tracing::info!("using the socket passed by systemd (socket activation)");
        return Ok(ApiSocket {
            listener,
            owned_path: None,
        });
    }
    let path = &config.socket;
    let io_err = |source| ListenError::Io {
        path: path.clone(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io_err)?;
    }
    remove_stale(path)?;
    let std_listener = StdListener::bind(path).map_err(io_err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(config.socket_mode))
        .map_err(io_err)?;
    if let Some(group) = &config.socket_group {
        chown_group(path, group)?;
    }
    std_listener.set_nonblocking(true).map_err(io_err)?;
    let listener = UnixListener::from_std(std_listener).map_err(io_err)?;
    Ok(ApiSocket {
        listener,
        owned_path: Some(path.clone()),
    })
}

/// Removes a socket file nobody listens on (left by a daemon that was killed).
fn remove_stale(path: &Path) -> Result<(), ListenError> {
    if !path.exists() {
        return Ok(());
    }
    if UnixStream::connect(path).is_ok() {
        return Err(ListenError::InUse(path.to_owned()));
    }
    std::fs::remove_file(path).map_err(|source| ListenError::Io {
        path: path.to_owned(),
        source,
    })
}

/// The first socket of `LISTEN_FDS` when `LISTEN_PID` is this process.
fn activated() -> Result<Option<UnixListener>, ListenError> {
    let pid_ok = std::env::var("LISTEN_PID")
        .ok()
        .and_then(|p| p.parse::<u32>().ok())
        .is_some_and(|p| p == std::process::id());
    let fds = std::env::var("LISTEN_FDS")
        .ok()
        .and_then(|n| n.parse::<i32>().ok())
        .unwrap_or(0);
    if !pid_ok || fds < 1 {
        return Ok(None);
    }
    let io_err = |source| ListenError::Io {
        path: PathBuf::from("LISTEN_FDS"),
        source,
    };
    // SAFETY: systemd passes descriptors from SD_LISTEN_FDS_START on and they belong to this
    // process; LISTEN_PID matched, so nobody else claims fd 3.
    let listener = unsafe { StdListener::from_raw_fd(SD_LISTEN_FDS_START) };
    listener.set_nonblocking(true).map_err(io_err)?;
    UnixListener::from_std(listener).map(Some).map_err(io_err)
}

/// Gives `path` to group `group` (a name or a numeric gid).
fn chown_group(path: &Path, group: &str) -> Result<(), ListenError> {
    let gid = match group.parse::<u32>() {
        Ok(gid) => gid,
        Err(_) => gid_of(group).ok_or_else(|| ListenError::Group(group.to_owned()))?,
    };
    std::os::unix::fs::chown(path, None, Some(gid)).map_err(|source| ListenError::Io {
        path: path.to_owned(),
        source,
    })
}

/// getgrnam_r(3).
fn gid_of(name: &str) -> Option<u32> {
    let cname = CString::new(name).ok()?;
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    // SAFETY: all-zero is a valid `struct group` (pointers null, gid 0) to be filled in.
    let mut grp: libc::group = unsafe { std::mem::zeroed() };
    let mut result: *mut libc::group = std::ptr::null_mut();
    // SAFETY: every pointer refers to live, correctly sized storage for the call's duration.
    let rc = unsafe {
        libc::getgrnam_r(
            cname.as_ptr(),
            &mut grp,
            buf.as_mut_ptr(),
            buf.len(),
            &mut result,
        )
    };
    (rc == 0 && !result.is_null()).then_some(grp.gr_gid)
}

/// Tells systemd (`Type=notify`) the daemon is ready; a no-op outside systemd.
pub fn notify_ready() {
    if let Err(e) = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]) {
        tracing::warn!("sd_notify READY: {e}");
    }
}

/// Tells systemd the daemon is stopping.
pub fn notify_stopping() {
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_socket_gets_the_configured_mode_and_a_stale_file_is_replaced() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.sock");
        drop(StdListener::bind(&path).unwrap()); // a stale socket file nobody serves
        let config = Config {
            socket: path.clone(),
            socket_mode: 0o600,
            // SAFETY: getgid has no preconditions.
            socket_group: Some(unsafe { libc::getgid() }.to_string()),
            ..Config::default()
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();

        // Act
        let socket = rt.block_on(async { listen(&config) }).unwrap();

        // Assert
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(socket.owned_path, Some(path));
    }

    #[test]
    fn group_names_resolve() {
        // Arrange / Act / Assert
        assert_eq!(gid_of("root"), Some(0));
        assert_eq!(gid_of("no-such-group-bulkhead"), None);
    }
}
