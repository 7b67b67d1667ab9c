//! Boot parameters: what the host tells the guest agent on the kernel command line, before any
//! vsock connection exists.
//!
//! The host encodes one [`BootParams`] with [`BootParams::to_params`] and appends the result to
//! the guest kernel's command line; the agent reads `/proc/cmdline` with [`BootParams::parse`].
//! Both sides use this one codec, so a key or an encoding is written exactly once.
//!
//! ```text
//! bulkhead.hostname=NAME                 the guest's hostname (1-64 of [A-Za-z0-9.-])
//! bulkhead.root=/dev/vdX                 read-only ext4 root image (lower layer of an overlay)
//! bulkhead.overlay=tmpfs|/dev/vdY        its writable layer (default tmpfs; needs bulkhead.root)
//! bulkhead.workspace=TAG:DIR:clone       a clone workspace: virtio-fs TAG under an overlay at DIR
//! bulkhead.mount=TAG:DIR[:ro]            a virtio-fs share mounted at DIR (repeatable, in order)
//! bulkhead.egress=on                     relay 127.0.0.1:3128 to the host's egress proxy
//! ```
//!
//! `TAG` is a virtio-fs mount tag (1-36 of `[A-Za-z0-9_-]`, virtio 1.2 §5.11.4 allows 36 bytes);
//! `DIR` is an absolute guest path other than `/` without `.` or `..` components,
//! percent-encoded: every byte outside `[A-Za-z0-9/._+,@~-]` is written `%XX` (two upper-case hex
//! digits), so spaces, colons and `%` survive the command line, which the kernel splits at white
//! space. Device paths are `/dev/` followed by names of `[A-Za-z0-9._-]`.
//!
//! Parsing is strict: a malformed value, a single-valued key given twice, or `bulkhead.overlay`
//! without `bulkhead.root` is an error (the agent then refuses to start, so no command runs
//! without what the host promised it). Keys outside `bulkhead.` are ignored (they are the
//! kernel's); unknown `bulkhead.` keys are ignored too, so a newer host can add keys that an older
//! agent does not know.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Component, Path, PathBuf};

/// Prefix of every bulkhead boot parameter; the kernel and init ignore such keys.
pub const KEY_PREFIX: &str = "bulkhead.";
/// Key of the guest's hostname.
pub const HOSTNAME_KEY: &str = "bulkhead.hostname";
/// Key of the read-only root image's device.
pub const ROOT_KEY: &str = "bulkhead.root";
/// Key of the root image's writable layer.
pub const OVERLAY_KEY: &str = "bulkhead.overlay";
/// [`OVERLAY_KEY`] value for a RAM-backed writable layer.
pub const OVERLAY_TMPFS: &str = "tmpfs";
/// Key of a virtio-fs share (repeatable).
pub const MOUNT_KEY: &str = "bulkhead.mount";
/// Key of the clone workspace.
pub const WORKSPACE_KEY: &str = "bulkhead.workspace";
/// Key of the egress relay ([`EGRESS_ON`] is its only value).
pub const EGRESS_KEY: &str = "bulkhead.egress";
/// The value of [`EGRESS_KEY`] that turns the relay on.
pub const EGRESS_ON: &str = "on";
/// Suffix of a [`WORKSPACE_KEY`] value: the only mode the agent sets up itself (a direct
/// workspace is a plain read-write [`MOUNT_KEY`] share).
pub const CLONE_SUFFIX: &str = ":clone";
/// Suffix of a read-only [`MOUNT_KEY`] value.
pub const READ_ONLY_SUFFIX: &str = ":ro";
/// Longest virtio-fs tag, bytes (virtio 1.2 §5.11.4: `tag` is 36 bytes).
pub const MAX_TAG: usize = 36;
/// Longest hostname, bytes (`HOST_NAME_MAX` on Linux).
pub const MAX_HOSTNAME: usize = 64;

/// Everything the host tells the agent at boot.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BootParams {
    /// The guest's hostname; the agent's default (`bulkhead`) when absent.
    pub hostname: Option<String>,
    /// A root filesystem image to switch into; the initramfs stays the root when absent.
    pub root: Option<RootParam>,
    /// A clone workspace (the agent builds an overlay over the read-only share).
    pub workspace: Option<Share>,
    /// Shares to mount, in this order (the host lists parents first).
    pub mounts: Vec<Share>,
    /// Bring the loopback interface up and relay `127.0.0.1:3128` to the host's egress proxy
    /// (`crate::EGRESS_PORT`). Without it the guest has no way out at all.
    pub egress: bool,
}

/// A read-only root image and where its writable layer lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RootParam {
    /// The image's block device, e.g. `/dev/vda`.
    pub device: String,
    /// The writable layer.
    pub overlay: Overlay,
}

/// Where a writable overlay layer lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Overlay {
    /// A tmpfs in guest RAM.
    Tmpfs,
    /// A scratch block device (ext4, formatted by the host), e.g. `/dev/vdb`.
    Device(String),
}

/// A virtio-fs share and where the guest mounts it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Share {
    /// The device's mount tag.
    pub tag: String,
    /// The guest directory (absolute, not `/`, no `.` or `..` components).
    pub guest_dir: PathBuf,
    /// Mount it read-only (the VMM's file server enforces it in any case).
    pub read_only: bool,
}

/// A boot parameter that cannot be encoded or parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BootParamError {
    /// A value is malformed.
    #[error("bad {key}={value}: {reason}")]
    Invalid {
        /// The parameter's key.
        key: &'static str,
        /// The value as given (decoded paths are shown lossily).
        value: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A key that may appear once appears again.
    #[error("{0} is given more than once")]
    Repeated(&'static str),
    /// `bulkhead.overlay` without `bulkhead.root`.
    #[error("{OVERLAY_KEY} needs {ROOT_KEY}")]
    OverlayWithoutRoot,
    /// A restore's share parameter that is not one `bulkhead.workspace=` or `bulkhead.mount=`
    /// word (shown cut to 80 characters).
    #[error("{0:?} is not a {WORKSPACE_KEY}= or {MOUNT_KEY}= parameter")]
    NotAShare(String),
}

impl BootParams {
    /// The kernel command-line parameters for these values, each `KEY=VALUE` without white
    /// space, in a fixed order (hostname, root, overlay, workspace, mounts, egress).
    ///
    /// ```
    /// use bulkhead_protocol::boot::{BootParams, Share};
    ///
    /// let params = BootParams {
    ///     hostname: Some("bh-1".into()),
    ///     mounts: vec![Share { tag: "mount0".into(), guest_dir: "/a b".into(), read_only: true }],
    ///     ..BootParams::default()
    /// };
    /// let encoded = params.to_params().unwrap();
    /// assert_eq!(encoded, ["bulkhead.hostname=bh-1", "bulkhead.mount=mount0:/a%20b:ro"]);
    /// assert_eq!(BootParams::parse(&encoded.join(" ")).unwrap(), params);
    /// ```
    ///
    /// # Errors
    /// [`BootParamError::Invalid`] for a value the agent would refuse, so the host finds out
    /// before it boots anything.
    pub fn to_params(&self) -> Result<Vec<String>, BootParamError> {
        let mut out = Vec::new();
        if let Some(name) = &self.hostname {
            check_hostname(name)?;
            out.push(format!("{HOSTNAME_KEY}={name}"));
        }
        if let Some(root) = &self.root {
            check_device(ROOT_KEY, &root.device)?;
            out.push(format!("{ROOT_KEY}={}", root.device));
            if let Overlay::Device(dev) = &root.overlay {
                check_overlay_device(dev, &root.device)?;
                out.push(format!("{OVERLAY_KEY}={dev}"));
            }
        }
        if let Some(ws) = &self.workspace {
            if ws.read_only {
                return Err(invalid(
                    WORKSPACE_KEY,
                    &ws.tag,
                    "a clone workspace is read-write",
                ));
            }
            out.push(format!(
                "{WORKSPACE_KEY}={}{CLONE_SUFFIX}",
                encode_share(WORKSPACE_KEY, ws)?
            ));
        }
        for share in &self.mounts {
            let mut value = encode_share(MOUNT_KEY, share)?;
            if share.read_only {
                value.push_str(READ_ONLY_SUFFIX);
            }
            out.push(format!("{MOUNT_KEY}={value}"));
        }
        if self.egress {
            out.push(format!("{EGRESS_KEY}={EGRESS_ON}"));
        }
        Ok(out)
    }

    /// The shares of `self` (workspace, then mounts) encoded as [`BootParams::to_params`]
    /// encodes them, for a restore that attaches them
    /// ([`crate::RestoredRequest::share_params`]); the other values are not shares and are left
    /// out.
    ///
    /// # Errors
    /// As [`BootParams::to_params`].
    pub fn share_params(&self) -> Result<Vec<String>, BootParamError> {
        BootParams {
            workspace: self.workspace.clone(),
            mounts: self.mounts.clone(),
            ..BootParams::default()
        }
        .to_params()
    }

    /// Reads a restore's share parameters ([`BootParams::share_params`]): each entry must be one
    /// `bulkhead.workspace=` or `bulkhead.mount=` word. The result has only `workspace` and
    /// `mounts` set.
    ///
    /// # Errors
    /// [`BootParamError::NotAShare`] for any other entry, then the first error of
    /// [`BootParams::parse`].
    pub fn parse_shares(params: &[String]) -> Result<BootParams, BootParamError> {
        let share_key = |p: &str| {
            [WORKSPACE_KEY, MOUNT_KEY].iter().any(|key| {
                p.strip_prefix(key)
                    .is_some_and(|rest| rest.starts_with('='))
            })
        };
        if let Some(bad) = params
            .iter()
            .find(|p| !share_key(p) || p.contains(char::is_whitespace))
        {
            return Err(BootParamError::NotAShare(bad.chars().take(80).collect()));
        }
        Self::parse(&params.join(" "))
    }

    /// Reads the bulkhead parameters of a kernel command line (`/proc/cmdline`).
    ///
    /// # Errors
    /// The first [`BootParamError`] found.
    pub fn parse(cmdline: &str) -> Result<BootParams, BootParamError> {
        let mut params = BootParams::default();
        let mut root_device: Option<String> = None;
        let mut overlay: Option<Overlay> = None;
        for (key, value) in cmdline.split_whitespace().filter_map(|p| p.split_once('=')) {
            match key {
                HOSTNAME_KEY => {
                    check_hostname(value)?;
                    set_once(&mut params.hostname, HOSTNAME_KEY, value.to_owned())?;
                }
                ROOT_KEY => {
                    check_device(ROOT_KEY, value)?;
                    set_once(&mut root_device, ROOT_KEY, value.to_owned())?;
                }
                OVERLAY_KEY => set_once(&mut overlay, OVERLAY_KEY, parse_overlay(value)?)?,
                WORKSPACE_KEY => set_once(
                    &mut params.workspace,
                    WORKSPACE_KEY,
                    parse_workspace(value)?,
                )?,
                MOUNT_KEY => params.mounts.push(parse_mount(value)?),
                EGRESS_KEY => {
                    if value != EGRESS_ON {
                        return Err(invalid(EGRESS_KEY, value, "the only value is on"));
                    }
                    if params.egress {
                        return Err(BootParamError::Repeated(EGRESS_KEY));
                    }
                    params.egress = true;
                }
                _ => {}
            }
        }
        params.root = match (root_device, overlay) {
            (None, None) => None,
            (None, Some(_)) => return Err(BootParamError::OverlayWithoutRoot),
            (Some(device), overlay) => {
                let overlay = overlay.unwrap_or(Overlay::Tmpfs);
                if let Overlay::Device(dev) = &overlay {
                    check_overlay_device(dev, &device)?;
                }
                Some(RootParam { device, overlay })
            }
        };
        Ok(params)
    }
}

/// Whether `param` (one kernel command-line word) is a bulkhead boot parameter, which only
/// [`BootParams`] may produce.
pub fn is_bulkhead_param(param: &str) -> bool {
    param.starts_with(KEY_PREFIX)
}

fn invalid(key: &'static str, value: &str, reason: &'static str) -> BootParamError {
    BootParamError::Invalid {
        key,
        value: value.to_owned(),
        reason,
    }
}

fn set_once<T>(slot: &mut Option<T>, key: &'static str, value: T) -> Result<(), BootParamError> {
    if slot.is_some() {
        return Err(BootParamError::Repeated(key));
    }
    *slot = Some(value);
    Ok(())
}

/// A hostname: 1 to [`MAX_HOSTNAME`] bytes of `[A-Za-z0-9.-]`.
///
/// # Errors
/// [`BootParamError::Invalid`].
pub fn check_hostname(name: &str) -> Result<(), BootParamError> {
    let ok = (1..=MAX_HOSTNAME).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
    match ok {
        true => Ok(()),
        false => Err(invalid(
            HOSTNAME_KEY,
            name,
            "a hostname is 1-64 characters of [A-Za-z0-9.-]",
        )),
    }
}

/// A virtio-fs tag: 1 to [`MAX_TAG`] bytes of `[A-Za-z0-9_-]`.
fn tag_ok(tag: &str) -> bool {
    (1..=MAX_TAG).contains(&tag.len())
        && tag
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// `/dev/` followed by `[A-Za-z0-9._-]` names separated by single slashes, no `.` or `..`.
fn check_device(key: &'static str, value: &str) -> Result<(), BootParamError> {
    let ok = value.strip_prefix("/dev/").is_some_and(|rest| {
        !rest.is_empty()
            && rest.split('/').all(|c| {
                !c.is_empty()
                    && c != "."
                    && c != ".."
                    && c.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
            })
    });
    match ok {
        true => Ok(()),
        false => Err(invalid(
            key,
            value,
            "expected a device path such as /dev/vda",
        )),
    }
}

fn check_overlay_device(dev: &str, root: &str) -> Result<(), BootParamError> {
    check_device(OVERLAY_KEY, dev)?;
    if dev == root {
        return Err(invalid(OVERLAY_KEY, dev, "must differ from bulkhead.root"));
    }
    Ok(())
}

fn parse_overlay(value: &str) -> Result<Overlay, BootParamError> {
    if value == OVERLAY_TMPFS {
        return Ok(Overlay::Tmpfs);
    }
    check_device(OVERLAY_KEY, value)
        .map_err(|_| {
            invalid(
                OVERLAY_KEY,
                value,
                "expected tmpfs or a device path such as /dev/vdb",
            )
        })
        .map(|()| Overlay::Device(value.to_owned()))
}

fn parse_workspace(value: &str) -> Result<Share, BootParamError> {
    let share = value
        .strip_suffix(CLONE_SUFFIX)
        .ok_or_else(|| invalid(WORKSPACE_KEY, value, "expected TAG:DIR:clone"))?;
    let (tag, dir) = share
        .split_once(':')
        .ok_or_else(|| invalid(WORKSPACE_KEY, value, "expected TAG:DIR:clone"))?;
    decode_share(WORKSPACE_KEY, value, tag, dir, false)
}

fn parse_mount(value: &str) -> Result<Share, BootParamError> {
    let (rest, read_only) = match value.strip_suffix(READ_ONLY_SUFFIX) {
        Some(rest) => (rest, true),
        None => (value, false),
    };
    let (tag, dir) = rest
        .split_once(':')
        .ok_or_else(|| invalid(MOUNT_KEY, value, "expected TAG:DIR[:ro]"))?;
    decode_share(MOUNT_KEY, value, tag, dir, read_only)
}

fn decode_share(
    key: &'static str,
    value: &str,
    tag: &str,
    encoded_dir: &str,
    read_only: bool,
) -> Result<Share, BootParamError> {
    if !tag_ok(tag) {
        return Err(invalid(key, value, "the tag must be 1-36 of [A-Za-z0-9_-]"));
    }
    let bytes = percent_decode(encoded_dir).ok_or_else(|| {
        invalid(
            key,
            value,
            "DIR must be percent-encoded (a bad %XX escape or an unescaped byte)",
        )
    })?;
    let guest_dir = PathBuf::from(OsString::from_vec(bytes));
    check_guest_dir(key, &guest_dir)?;
    Ok(Share {
        tag: tag.to_owned(),
        guest_dir,
        read_only,
    })
}

/// An absolute path other than `/`, without `.` or `..` components or NUL bytes.
fn check_guest_dir(key: &'static str, dir: &Path) -> Result<(), BootParamError> {
    let plain = dir
        .components()
        .all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
    let text = dir.to_string_lossy();
    // `components()` hides `.` in the middle of a path (`/a/./b`); look at the bytes too.
    let dotted = dir
        .as_os_str()
        .as_bytes()
        .split(|&b| b == b'/')
        .any(|c| c == b"." || c == b"..");
    if !dir.is_absolute() || !plain || dotted || dir == Path::new("/") || text.contains('\0') {
        return Err(invalid(
            key,
            &text,
            "DIR must be an absolute path other than / without . or ..",
        ));
    }
    Ok(())
}

/// `TAG:ENCODED_DIR` of a share, checked.
fn encode_share(key: &'static str, share: &Share) -> Result<String, BootParamError> {
    if !tag_ok(&share.tag) {
        return Err(invalid(
            key,
            &share.tag,
            "the tag must be 1-36 of [A-Za-z0-9_-]",
        ));
    }
    check_guest_dir(key, &share.guest_dir)?;
    let mut out = format!("{}:", share.tag);
    for &b in share.guest_dir.as_os_str().as_bytes() {
        if unescaped(b) {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    Ok(out)
}

/// Whether `b` stands for itself in an encoded directory (`[A-Za-z0-9/._+,@~-]`).
fn unescaped(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"/._+,@~-".contains(&b)
}

/// Decodes `%XX` escapes; `None` for a truncated or non-hex escape, or a byte that the encoder
/// would have escaped (so decoding is the exact inverse of encoding).
fn percent_decode(s: &str) -> Option<Vec<u8>> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            if !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                return None;
            }
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else if unescaped(bytes[i]) {
            out.push(bytes[i]);
            i += 1;
        } else {
            return None;
        }
    }
    Some(out)
}

#[cfg(test)]
#[path = "boot_tests.rs"]
mod tests;
