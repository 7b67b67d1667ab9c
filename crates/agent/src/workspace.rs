//! The clone workspace: a host directory shared read-only over virtio-fs as the lower layer of
//! an overlay file system whose upper layer is private to the sandbox, and the
//! `WorkspaceChanges` request that reports what the guest changed in it ([`crate::changes`]).
//!
//! The boot parameter (the host side is `bulkhead-sandbox`'s `workspace` module; the codec is
//! [`bulkhead_protocol::boot`]):
//!
//! ```text
//! bulkhead.workspace=TAG:GUEST_DIR:clone
//! ```
//!
//! (A *direct* workspace is a plain read-write `bulkhead.mount=`.) After
//! switching into an image root and before the other shares are mounted, the agent:
//!
//! 1. mounts the share read-only at `/run/bulkhead/workspace/lower`;
//! 2. mounts the writable layer at `/run/bulkhead/workspace/rw`: the sandbox's scratch disk
//!    when the image root has one (`bulkhead.overlay=/dev/vdX`; the same file system again,
//!    with the workspace's layers in `workspace/upper` and `workspace/work` next to the root's
//!    own), else a fresh tmpfs (guest RAM);
//! 3. mounts `overlay` at `GUEST_DIR` (`nosuid,nodev`, `redirect_dir=off,metacopy=off,
//!    index=off`, so every change is a plain copy-up or whiteout that [`crate::changes`]
//!    understands);
//! 4. keeps open directory descriptors of the lower and upper directories and detaches the
//!    lower staging mount (the overlay holds its own reference); the change set is read through
//!    `/proc/self/fd/N`. The writable layer stays mounted at `/run/bulkhead/workspace/rw`
//!    (mode 0700 on a tmpfs), where a pause can put the overlay back over it (overlayfs takes
//!    no layer on a detached mount); guest root could reach it through `/proc/1/fd` anyway.
//!
//! Nothing the guest does reaches the host directory: the VMM's file server refuses every write
//! to the read-only share (`EROFS`), and overlayfs never writes to a lower layer.
//!
//! A malformed parameter or a failed mount is fatal, as for shares: PID 1 logs the reason to the
//! debug port and reboots before announcing readiness.
//!
//! Before a snapshot ([`unmount`], for the `Shares` request of [`crate::mounts`]) the overlay
//! is unmounted and the lower layer's descriptor closed, which ends the share's FUSE session;
//! the writable layer stays mounted, so the guest's changes stay. The restore (or, when the
//! snapshot failed, [`mount_again`]) mounts the share again and the overlay over the same
//! `upper` and `work` directories.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use bulkhead_protocol::frame::encode_raw;
use bulkhead_protocol::{
    write_frame, ChangeRecord, ChangesEnd, EntryKind, ErrorCode, ErrorMessage, Frame, FrameType,
    WorkspaceChangesRequest, DATA_CHUNK, PROTOCOL_VERSION,
};

use crate::changes::{self, Change};
use crate::conn::Conn;
use crate::rootfs::{self, Step};
use bulkhead_protocol::boot::{BootParams, Overlay, Share};

/// Where the layers are mounted while the overlay is built.
pub const STAGING_DIR: &str = "/run/bulkhead/workspace";

/// Directory on the writable layer holding the workspace's `upper` and `work` directories.
const LAYER_DIR: &str = "workspace";

/// Bad parameters and failed mounts.
#[derive(Debug, thiserror::Error)]
pub enum WorkspaceError {
    /// Building the overlay failed.
    #[error(transparent)]
    Mount(#[from] rootfs::RootfsError),
    /// Opening a layer directory failed.
    #[error("opening {}: {source}", path.display())]
    Open {
        /// The directory.
        path: PathBuf,
        /// What failed.
        source: io::Error,
    },
}

/// What `bulkhead.workspace=` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloneSpec {
    /// The virtio-fs tag of the read-only share.
    pub tag: String,
    /// Where the merged workspace appears.
    pub target: PathBuf,
    /// Where the writable layer lives.
    pub upper: Overlay,
}

impl CloneSpec {
    /// The clone workspace of `params`, if any. The writable layer goes on the image root's
    /// scratch disk when there is one, else on a tmpfs.
    pub fn of(params: &BootParams) -> Option<CloneSpec> {
        let share = params.workspace.as_ref()?;
        let upper = match &params.root {
            Some(root) => root.overlay.clone(),
            None => Overlay::Tmpfs,
        };
        Some(CloneSpec {
            tag: share.tag.clone(),
            target: share.guest_dir.clone(),
            upper,
        })
    }
}

impl CloneSpec {
    /// The clone workspace of a restore that attached `share` (see [`crate::restore`]): its
    /// writable layer where a boot with `share` would have put it, on the scratch disk of the
    /// image root this guest booted with (`/proc/cmdline`), else on a tmpfs.
    pub fn restored(share: &Share) -> CloneSpec {
        let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
        let root = BootParams::parse(&cmdline).ok().and_then(|p| p.root);
        let params = BootParams {
            root,
            workspace: Some(share.clone()),
            ..BootParams::default()
        };
        // `workspace` is set, so there is a spec.
        CloneSpec::of(&params).unwrap_or(CloneSpec {
            tag: share.tag.clone(),
            target: share.guest_dir.clone(),
            upper: Overlay::Tmpfs,
        })
    }
}

/// The steps that build the workspace overlay for `spec` under `staging`. Pure.
pub fn mount_plan(spec: &CloneSpec, staging: &Path) -> Vec<Step> {
    let lower = staging.join("lower");
    let rw = staging.join("rw");
    let layers = rw.join(LAYER_DIR);
    vec![
        Step::Mkdir(lower.clone()),
        Step::Mkdir(rw.clone()),
        share_mount(spec, &lower),
        match &spec.upper {
            Overlay::Tmpfs => Step::Mount {
                source: "tmpfs".to_owned(),
                target: rw.clone(),
                fstype: "tmpfs",
                flags: libc::MS_NOSUID | libc::MS_NODEV,
                data: "mode=0700".to_owned(),
            },
            // The scratch disk is mounted already (the root's writable layer): this is a
            // second mount of the same file system.
            Overlay::Device(dev) => Step::Mount {
                source: dev.clone(),
                target: rw.clone(),
                fstype: rootfs::DISK_FSTYPE,
                flags: libc::MS_NOSUID | libc::MS_NODEV,
                data: String::new(),
            },
        },
        Step::Mkdir(layers.join("upper")),
        Step::Mkdir(layers.join("work")),
        Step::Mkdir(spec.target.clone()),
        overlay_mount(spec, &lower, &layers),
    ]
}

/// The read-only virtiofs mount of `spec`'s share at `lower`.
fn share_mount(spec: &CloneSpec, lower: &Path) -> Step {
    Step::Mount {
        source: spec.tag.clone(),
        target: lower.to_owned(),
        fstype: "virtiofs",
        flags: libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV,
        data: String::new(),
    }
}

/// The overlay at `spec`'s target over `lower`, with `upper` and `work` in `layers`: no
/// redirects, metacopy or index (see the module docs).
fn overlay_mount(spec: &CloneSpec, lower: &Path, layers: &Path) -> Step {
    Step::Mount {
        source: "overlay".to_owned(),
        target: spec.target.clone(),
        fstype: "overlay",
        flags: libc::MS_NOSUID | libc::MS_NODEV,
        data: format!(
            "lowerdir={},upperdir={},workdir={},redirect_dir=off,metacopy=off,index=off",
            lower.display(),
            layers.join("upper").display(),
            layers.join("work").display()
        ),
    }
}

/// Where the change set is computed from.
#[derive(Debug)]
enum Layers {
    /// Stand-in directories ([`use_layers`]).
    Given {
        /// The upper directory.
        upper: PathBuf,
        /// The lower directory.
        lower: PathBuf,
    },
    /// The mounted clone workspace's open directories.
    Mounted(Held),
}

/// Open directories of a mounted clone workspace, named through `/proc/self/fd`.
#[derive(Debug)]
struct Held {
    /// What was mounted (for a mount again after a failed snapshot).
    spec: CloneSpec,
    /// The writable layer's `upper` directory.
    upper: File,
    /// The lower layer (the share); `None` while unmounted for a snapshot.
    lower: Option<File>,
}

impl Layers {
    /// The upper and lower directories; `None` while the workspace is unmounted for a snapshot.
    fn paths(&self) -> Option<(PathBuf, PathBuf)> {
        match self {
            Layers::Given { upper, lower } => Some((upper.clone(), lower.clone())),
            Layers::Mounted(held) => {
                (held.lower.as_ref()).map(|lower| (fd_path(&held.upper), fd_path(lower)))
            }
        }
    }
}

static LAYERS: Mutex<Option<Layers>> = Mutex::new(None);

fn layers() -> MutexGuard<'static, Option<Layers>> {
    LAYERS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn fd_path(file: &File) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()))
}

fn open(path: PathBuf) -> Result<File, WorkspaceError> {
    File::open(&path).map_err(|source| WorkspaceError::Open { path, source })
}

/// Sets up the clone workspace `spec`. Call as PID 1 after the root switch. When the workspace
/// was unmounted for a snapshot ([`unmount`]), mounts it again over the layers it had.
///
/// # Errors
/// The first failed mount.
pub fn mount(spec: &CloneSpec) -> Result<(), WorkspaceError> {
    let mut layers = layers();
    if let Some(Layers::Mounted(held)) = layers.as_mut() {
        if held.lower.is_none() {
            held.lower = Some(remount(spec)?);
            held.spec = spec.clone();
            return Ok(());
        }
    }
    let staging = Path::new(STAGING_DIR);
    for step in mount_plan(spec, staging) {
        rootfs::apply(&step)?;
    }
    let upper = open(staging.join("rw").join(LAYER_DIR).join("upper"))?;
    let lower = open(staging.join("lower"))?;
    *layers = Some(Layers::Mounted(Held {
        spec: spec.clone(),
        upper,
        lower: Some(lower),
    }));
    hide_lower(staging);
    Ok(())
}

/// Hiding the lower staging mount is tidiness, not safety (guest root could reach the layers
/// through /proc/1/fd anyway): failures are ignored.
fn hide_lower(staging: &Path) {
    let lower = staging.join("lower");
    detach(&lower);
    let _ = fs::remove_dir(lower);
}

/// Mounts the share of `spec` again and the overlay over the kept `upper` and `work` of the
/// writable layer (still mounted at the staging directory); returns the new lower layer's
/// descriptor.
fn remount(spec: &CloneSpec) -> Result<File, WorkspaceError> {
    let staging = Path::new(STAGING_DIR);
    let lower = staging.join("lower");
    let kept = staging.join("rw").join(LAYER_DIR);
    let steps = [
        Step::Mkdir(lower.clone()),
        share_mount(spec, &lower),
        Step::Mkdir(spec.target.clone()),
        overlay_mount(spec, &lower, &kept),
    ];
    for step in &steps {
        rootfs::apply(step)?;
    }
    let file = open(lower)?;
    hide_lower(staging);
    Ok(file)
}

/// Where the mounted clone workspace is, if there is one (none while it is unmounted).
pub fn mounted_target() -> Option<PathBuf> {
    match layers().as_ref()? {
        Layers::Mounted(held) if held.lower.is_some() => Some(held.spec.target.clone()),
        _ => None,
    }
}

/// Unmounts the clone workspace for a snapshot: the overlay, then the lower layer (its last
/// descriptor closed ends the share's FUSE session); the writable layer stays. Nothing happens
/// without a mounted workspace.
///
/// # Errors
/// umount(2)'s, with the workspace still mounted.
pub fn unmount() -> io::Result<()> {
    let mut layers = layers();
    let Some(Layers::Mounted(held)) = layers.as_mut() else {
        return Ok(());
    };
    if held.lower.is_none() {
        return Ok(());
    }
    match crate::mounts::unmount(&held.spec.target) {
        // Not a mount point: the guest unmounted the overlay itself.
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
        other => other?,
    }
    held.lower = None;
    Ok(())
}

/// Mounts again a clone workspace that [`unmount`] took (the snapshot failed and the guest goes
/// on); nothing happens otherwise.
///
/// # Errors
/// The first failed mount.
pub fn mount_again() -> Result<(), WorkspaceError> {
    let spec = {
        let layers = layers();
        match layers.as_ref() {
            Some(Layers::Mounted(held)) if held.lower.is_none() => held.spec.clone(),
            _ => return Ok(()),
        }
    };
    mount(&spec)
}

fn detach(path: &Path) {
    use std::os::unix::ffi::OsStrExt;
    if let Ok(c_path) = std::ffi::CString::new(path.as_os_str().as_bytes()) {
        // SAFETY: `c_path` is NUL-terminated and outlives the call.
        unsafe { libc::umount2(c_path.as_ptr(), libc::MNT_DETACH) };
    }
}

/// Serves the change set from `upper` and `lower` instead of a mounted workspace (the agent's
/// test mode and the daemon's fake VMM, which have no overlay). Has no effect once a workspace
/// is set up.
pub fn use_layers(upper: PathBuf, lower: PathBuf) {
    let mut layers = layers();
    if layers.is_none() {
        *layers = Some(Layers::Given { upper, lower });
    }
}

/// Serves a `WorkspaceChanges` request: `Change` records (with `Data* End` where asked for) and
/// `ChangesEnd`, or `Error`.
pub fn serve_changes(mut conn: Conn, req: &WorkspaceChangesRequest) {
    if let Err(error) = stream_changes(&mut conn, req) {
        let _ = write_frame(&mut conn, &Frame::Error(error));
    }
}

/// A failure while the change set streams: of no particular class.
fn other(message: String) -> ErrorMessage {
    ErrorMessage::new(ErrorCode::Other, message)
}

fn stream_changes(conn: &mut Conn, req: &WorkspaceChangesRequest) -> Result<(), ErrorMessage> {
    if req.version != PROTOCOL_VERSION {
        return Err(ErrorMessage::new(
            ErrorCode::UnsupportedVersion,
            format!(
                "unsupported protocol version {} (this agent speaks {PROTOCOL_VERSION})",
                req.version
            ),
        ));
    }
    let paths = layers().as_ref().map(Layers::paths).ok_or_else(|| {
        ErrorMessage::new(
            ErrorCode::InvalidRequest,
            "this sandbox has no clone workspace (start it with --workspace DIR:clone)",
        )
    })?;
    let (upper, lower) = paths.ok_or_else(|| {
        other("the clone workspace is unmounted for a snapshot; ask again once it is back".into())
    })?;
    let set = changes::compute(&upper, &lower).map_err(|e| other(e.to_string()))?;
    let mut frame = Vec::with_capacity(DATA_CHUNK + 64);
    for change in &set.changes {
        let data = change.has_contents()
            && (req.contents
                || (req.link_targets && change.kind == EntryKind::Symlink)
                || req
                    .content_names
                    .iter()
                    .any(|n| *n == file_name(&change.path)));
        send(conn, &Frame::Change(record(change, data))).map_err(other)?;
        if data {
            send_contents(conn, &upper.join(&change.path), change, &mut frame).map_err(other)?;
        }
    }
    send(
        conn,
        &Frame::ChangesEnd(ChangesEnd {
            changes: set.changes.len() as u64,
            skipped: set.skipped,
        }),
    )
    .map_err(other)
}

fn file_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

fn record(change: &Change, data: bool) -> ChangeRecord {
    ChangeRecord {
        path: change.path.clone(),
        status: change.status,
        kind: change.kind,
        mode: change.mode,
        size: change.size,
        data,
    }
}

/// A failed send means the host is gone: the message is never delivered, only returned.
fn send(conn: &mut Conn, frame: &Frame) -> Result<(), String> {
    write_frame(conn, frame).map_err(|e| format!("sending to the host: {e}"))
}

/// Sends a file's bytes or a link's target as `Data` frames and `End`.
fn send_contents(
    conn: &mut Conn,
    path: &Path,
    change: &Change,
    frame: &mut Vec<u8>,
) -> Result<(), String> {
    let changed_meanwhile = |e: io::Error| {
        format!(
            "{} changed while the change set was sent ({e}); ask again",
            change.path
        )
    };
    let mut chunk = |bytes: &[u8]| -> Result<(), String> {
        frame.clear();
        encode_raw(FrameType::Data, bytes, frame).map_err(|e| e.to_string())?;
        conn.write_all(frame)
            .map_err(|e| format!("sending to the host: {e}"))
    };
    if change.kind == EntryKind::Symlink {
        let target = fs::read_link(path).map_err(changed_meanwhile)?;
        use std::os::unix::ffi::OsStrExt;
        chunk(target.as_os_str().as_bytes())?;
    } else {
        let mut file = open_no_follow(path).map_err(changed_meanwhile)?;
        let mut buf = vec![0u8; DATA_CHUNK];
        loop {
            let n = match file.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(changed_meanwhile(e)),
            };
            chunk(&buf[..n])?;
        }
    }
    send(conn, &Frame::End)
}

fn open_no_follow(path: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_writable_layer_is_the_scratch_disk_when_the_image_root_has_one() {
        // Arrange
        let with_disk = "bulkhead.root=/dev/vda bulkhead.overlay=/dev/vdb \
                         bulkhead.workspace=workspace:/work%20space:clone";
        let without = "bulkhead.workspace=workspace:/workspace:clone";

        // Act
        let on_disk = CloneSpec::of(&BootParams::parse(with_disk).unwrap()).unwrap();
        let in_ram = CloneSpec::of(&BootParams::parse(without).unwrap()).unwrap();

        // Assert
        assert_eq!(
            on_disk,
            CloneSpec {
                tag: "workspace".into(),
                target: "/work space".into(),
                upper: Overlay::Device("/dev/vdb".into()),
            }
        );
        assert_eq!(in_ram.upper, Overlay::Tmpfs);
    }

    #[test]
    fn the_plan_mounts_the_share_read_only_under_an_overlay_without_redirects_or_metacopy() {
        // Arrange
        let spec = CloneSpec {
            tag: "workspace".into(),
            target: "/workspace".into(),
            upper: Overlay::Device("/dev/vdb".into()),
        };

        // Act
        let plan = mount_plan(&spec, Path::new("/run/bulkhead/workspace"));

        // Assert
        let mounts: Vec<(&str, &str, bool)> = plan
            .iter()
            .filter_map(|s| match s {
                Step::Mount {
                    source,
                    fstype,
                    flags,
                    ..
                } => Some((source.as_str(), *fstype, flags & libc::MS_RDONLY != 0)),
                _ => None,
            })
            .collect();
        assert_eq!(
            mounts,
            [
                ("workspace", "virtiofs", true),
                ("/dev/vdb", "ext4", false),
                ("overlay", "overlay", false)
            ]
        );
        let Some(Step::Mount { data, target, .. }) = plan.last() else {
            panic!("the overlay comes last: {plan:?}");
        };
        assert_eq!(target, Path::new("/workspace"));
        assert_eq!(
            data,
            "lowerdir=/run/bulkhead/workspace/lower,\
             upperdir=/run/bulkhead/workspace/rw/workspace/upper,\
             workdir=/run/bulkhead/workspace/rw/workspace/work,\
             redirect_dir=off,metacopy=off,index=off"
        );
    }
}
