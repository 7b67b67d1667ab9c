//! The FUSE `FileSystem` the server calls: [`ShareFs`]'s policy in front of `PassthroughFs`.
//!
//! Every method is written out (none falls back to the trait's defaults), and each does, in
//! order:
//! 1. on a read-only share, refuse write-type operations with `EROFS`;
//! 2. check every name the guest sends is a single path component (`EINVAL` otherwise) and that
//!    `mknod` creates no device node (`EPERM`);
//! 3. switch to the owner's credentials ([`identity`](super::identity)), and clear the umask around
//!    calls that create files (the passthrough applies the guest's umask itself);
//! 4. delegate with a context of uid/gid 0 (meaning "do not switch" to the passthrough), never
//!    the guest's uid/gid.
//!
//! DAX mappings and ioctls are not served. `FUSE_INIT` additionally offers big writes
//! (128 KiB with the guest's default `max_pages`), asynchronous reads and automatic invalidation
//! of cached data when the host changes a file.

use std::ffi::CStr;
use std::io;
use std::time::Duration;

use fuse_backend_rs::abi::fuse_abi::{
    stat64, statvfs64, CreateIn, FsOptions, OpenOptions, SetattrValid,
};
use fuse_backend_rs::abi::virtio_fs::RemovemappingOne;
use fuse_backend_rs::api::filesystem::{
    Context, DirEntry, Entry, FileLock, FileSystem, GetxattrReply, IoctlData, ListxattrReply,
    ZeroCopyReader, ZeroCopyWriter,
};
use fuse_backend_rs::passthrough::PassthroughFs;
use fuse_backend_rs::transport::FsCacheReqHandler;

use super::identity::UmaskCleared;
use super::share::{
    check_name, errno, is_special_node, opens_for_writing, without_set_id, ShareFs, HOST_CONTEXT,
};

/// FUSE_INIT options offered on top of the passthrough file system's own.
const EXTRA_OPTIONS: FsOptions = FsOptions::BIG_WRITES
    .union(FsOptions::ASYNC_READ)
    .union(FsOptions::AUTO_INVAL_DATA);

type Passthrough = PassthroughFs<()>;

impl ShareFs {
    /// Runs `op` on the passthrough file system as the share owner.
    fn run<T>(&self, op: impl FnOnce(&Passthrough, &Context) -> io::Result<T>) -> io::Result<T> {
        let _creds = self.act()?;
        op(self.inner(), &HOST_CONTEXT)
    }

    /// Runs `op` as the share owner with the process umask cleared.
    fn run_creating<T>(
        &self,
        op: impl FnOnce(&Passthrough, &Context) -> io::Result<T>,
    ) -> io::Result<T> {
        let _creds = self.act()?;
        let _umask = UmaskCleared::new();
        op(self.inner(), &HOST_CONTEXT)
    }

    /// Drops every node ID and file handle the guest holds and re-imports the root, as FUSE_DESTROY
    /// does; used when the driver resets the device. Ends the FUSE session.
    pub fn forget_all(&self) {
        self.set_session(false);
        self.forget_handle(None);
        let destroyed = self.run_creating(|fs, _| {
            fs.destroy();
            Ok(())
        });
        if let Err(e) = destroyed {
            tracing::error!("virtio-fs: cannot reset the file server: {e}");
        }
    }
}

impl FileSystem for ShareFs {
    type Inode = u64;
    type Handle = u64;

    fn init(&self, capable: FsOptions) -> io::Result<FsOptions> {
        // Importing the root clears the process umask for good: the guard restores it.
        let want = self.run_creating(|fs, _| fs.init(capable))?;
        self.set_session(true);
        Ok(want | EXTRA_OPTIONS)
    }

    fn destroy(&self) {
        self.forget_all();
    }

    fn lookup(&self, _ctx: &Context, parent: u64, name: &CStr) -> io::Result<Entry> {
        check_name(name)?;
        self.run(|fs, ctx| fs.lookup(ctx, parent, name))
    }

    fn forget(&self, _ctx: &Context, inode: u64, count: u64) {
        // Only drops references and closes descriptors: no credentials involved.
        self.inner().forget(&HOST_CONTEXT, inode, count);
    }

    fn batch_forget(&self, _ctx: &Context, requests: Vec<(u64, u64)>) {
        self.inner().batch_forget(&HOST_CONTEXT, requests);
    }

    fn getattr(
        &self,
        _ctx: &Context,
        inode: u64,
        handle: Option<u64>,
    ) -> io::Result<(stat64, Duration)> {
        self.run(|fs, ctx| fs.getattr(ctx, inode, handle))
    }

    fn setattr(
        &self,
        _ctx: &Context,
        inode: u64,
        attr: stat64,
        handle: Option<u64>,
        valid: SetattrValid,
    ) -> io::Result<(stat64, Duration)> {
        self.writable()?;
        let mut attr = attr;
        // A chmod's mode carries the file's type (the kernel keeps it from the inode).
        attr.st_mode = without_set_id(attr.st_mode, attr.st_mode & libc::S_IFMT == libc::S_IFDIR);
        self.run(|fs, ctx| fs.setattr(ctx, inode, attr, handle, valid))
    }

    fn readlink(&self, _ctx: &Context, inode: u64) -> io::Result<Vec<u8>> {
        self.run(|fs, ctx| fs.readlink(ctx, inode))
    }

    /// The link's target is stored as given: the server never follows symlinks, the guest
    /// resolves them in its own namespace.
    fn symlink(
        &self,
        _ctx: &Context,
        linkname: &CStr,
        parent: u64,
        name: &CStr,
    ) -> io::Result<Entry> {
        self.writable()?;
        check_name(name)?;
        self.run_creating(|fs, ctx| fs.symlink(ctx, linkname, parent, name))
    }

    fn mknod(
        &self,
        _ctx: &Context,
        parent: u64,
        name: &CStr,
        mode: u32,
        rdev: u32,
        umask: u32,
    ) -> io::Result<Entry> {
        self.writable()?;
        check_name(name)?;
        if is_special_node(mode) {
            return Err(errno(libc::EPERM));
        }
        let mode = without_set_id(mode, false);
        self.run_creating(|fs, ctx| fs.mknod(ctx, parent, name, mode, rdev, umask))
    }

    fn mkdir(
        &self,
        _ctx: &Context,
        parent: u64,
        name: &CStr,
        mode: u32,
        umask: u32,
    ) -> io::Result<Entry> {
        self.writable()?;
        check_name(name)?;
        let mode = without_set_id(mode, true);
        self.run_creating(|fs, ctx| fs.mkdir(ctx, parent, name, mode, umask))
    }

    fn unlink(&self, _ctx: &Context, parent: u64, name: &CStr) -> io::Result<()> {
        self.writable()?;
        check_name(name)?;
        self.run(|fs, ctx| fs.unlink(ctx, parent, name))
    }

    fn rmdir(&self, _ctx: &Context, parent: u64, name: &CStr) -> io::Result<()> {
        self.writable()?;
        check_name(name)?;
        self.run(|fs, ctx| fs.rmdir(ctx, parent, name))
    }

    fn rename(
        &self,
        _ctx: &Context,
        olddir: u64,
        oldname: &CStr,
        newdir: u64,
        newname: &CStr,
        flags: u32,
    ) -> io::Result<()> {
        self.writable()?;
        check_name(oldname)?;
        check_name(newname)?;
        self.run(|fs, ctx| fs.rename(ctx, olddir, oldname, newdir, newname, flags))
    }

    fn link(
        &self,
        _ctx: &Context,
        inode: u64,
        newparent: u64,
        newname: &CStr,
    ) -> io::Result<Entry> {
        self.writable()?;
        check_name(newname)?;
        let creds = self.act()?;
        creds.allow_link_by_fd()?;
        self.inner().link(&HOST_CONTEXT, inode, newparent, newname)
    }

    fn open(
        &self,
        _ctx: &Context,
        inode: u64,
        flags: u32,
        fuse_flags: u32,
    ) -> io::Result<(Option<u64>, OpenOptions, Option<u32>)> {
        if opens_for_writing(flags) {
            self.writable()?;
        }
        // A kernel never sends O_PATH in FUSE_OPEN (it opens O_PATH files itself).
        if flags & libc::O_PATH as u32 != 0 {
            return Err(errno(libc::EINVAL));
        }
        let flags = without_noatime(flags);
        let opened = self.run(|fs, ctx| fs.open(ctx, inode, flags, fuse_flags))?;
        self.record_handle(opened.0, flags);
        Ok(opened)
    }

    fn create(
        &self,
        _ctx: &Context,
        parent: u64,
        name: &CStr,
        args: CreateIn,
    ) -> io::Result<(Entry, Option<u64>, OpenOptions, Option<u32>)> {
        self.writable()?;
        check_name(name)?;
        if args.flags & libc::O_PATH as u32 != 0 {
            return Err(errno(libc::EINVAL));
        }
        let flags = args.flags;
        let args = CreateIn {
            mode: without_set_id(args.mode, false),
            ..args
        };
        let created = self.run_creating(|fs, ctx| fs.create(ctx, parent, name, args))?;
        self.record_handle(created.1, flags);
        Ok(created)
    }

    fn read(
        &self,
        _ctx: &Context,
        inode: u64,
        handle: u64,
        w: &mut dyn ZeroCopyWriter,
        size: u32,
        offset: u64,
        lock_owner: Option<u64>,
        flags: u32,
    ) -> io::Result<usize> {
        let flags = self.io_flags(handle, without_noatime(flags));
        self.run(|fs, ctx| fs.read(ctx, inode, handle, w, size, offset, lock_owner, flags))
    }

    fn write(
        &self,
        _ctx: &Context,
        inode: u64,
        handle: u64,
        r: &mut dyn ZeroCopyReader,
        size: u32,
        offset: u64,
        lock_owner: Option<u64>,
        delayed_write: bool,
        flags: u32,
        fuse_flags: u32,
    ) -> io::Result<usize> {
        self.writable()?;
        let flags = self.io_flags(handle, without_noatime(flags));
        self.run(|fs, ctx| {
            fs.write(
                ctx,
                inode,
                handle,
                r,
                size,
                offset,
                lock_owner,
                delayed_write,
                flags,
                fuse_flags,
            )
        })
    }

    fn flush(&self, _ctx: &Context, inode: u64, handle: u64, lock_owner: u64) -> io::Result<()> {
        self.run(|fs, ctx| fs.flush(ctx, inode, handle, lock_owner))
    }

    fn fsync(&self, _ctx: &Context, inode: u64, datasync: bool, handle: u64) -> io::Result<()> {
        self.run(|fs, ctx| fs.fsync(ctx, inode, datasync, handle))
    }

    fn fallocate(
        &self,
        _ctx: &Context,
        inode: u64,
        handle: u64,
        mode: u32,
        offset: u64,
        length: u64,
    ) -> io::Result<()> {
        self.writable()?;
        self.run(|fs, ctx| fs.fallocate(ctx, inode, handle, mode, offset, length))
    }

    fn release(
        &self,
        _ctx: &Context,
        inode: u64,
        flags: u32,
        handle: u64,
        flush: bool,
        flock_release: bool,
        lock_owner: Option<u64>,
    ) -> io::Result<()> {
        self.forget_handle(Some(handle));
        self.run(|fs, ctx| fs.release(ctx, inode, flags, handle, flush, flock_release, lock_owner))
    }

    fn statfs(&self, _ctx: &Context, inode: u64) -> io::Result<statvfs64> {
        self.run(|fs, ctx| fs.statfs(ctx, inode))
    }

    fn setxattr(
        &self,
        _ctx: &Context,
        inode: u64,
        name: &CStr,
        value: &[u8],
        flags: u32,
    ) -> io::Result<()> {
        self.writable()?;
        self.run(|fs, ctx| fs.setxattr(ctx, inode, name, value, flags))
    }

    fn getxattr(
        &self,
        _ctx: &Context,
        inode: u64,
        name: &CStr,
        size: u32,
    ) -> io::Result<GetxattrReply> {
        self.run(|fs, ctx| fs.getxattr(ctx, inode, name, size))
    }

    fn listxattr(&self, _ctx: &Context, inode: u64, size: u32) -> io::Result<ListxattrReply> {
        self.run(|fs, ctx| fs.listxattr(ctx, inode, size))
    }

    fn removexattr(&self, _ctx: &Context, inode: u64, name: &CStr) -> io::Result<()> {
        self.writable()?;
        self.run(|fs, ctx| fs.removexattr(ctx, inode, name))
    }

    fn opendir(
        &self,
        _ctx: &Context,
        inode: u64,
        flags: u32,
    ) -> io::Result<(Option<u64>, OpenOptions)> {
        if opens_for_writing(flags) {
            self.writable()?;
        }
        let flags = without_noatime(flags);
        self.run(|fs, ctx| fs.opendir(ctx, inode, flags))
    }

    fn readdir(
        &self,
        _ctx: &Context,
        inode: u64,
        handle: u64,
        size: u32,
        offset: u64,
        add_entry: &mut dyn FnMut(DirEntry) -> io::Result<usize>,
    ) -> io::Result<()> {
        self.run(|fs, ctx| fs.readdir(ctx, inode, handle, size, offset, add_entry))
    }

    fn readdirplus(
        &self,
        _ctx: &Context,
        inode: u64,
        handle: u64,
        size: u32,
        offset: u64,
        add_entry: &mut dyn FnMut(DirEntry, Entry) -> io::Result<usize>,
    ) -> io::Result<()> {
        self.run(|fs, ctx| fs.readdirplus(ctx, inode, handle, size, offset, add_entry))
    }

    fn fsyncdir(&self, _ctx: &Context, inode: u64, datasync: bool, handle: u64) -> io::Result<()> {
        self.run(|fs, ctx| fs.fsyncdir(ctx, inode, datasync, handle))
    }

    fn releasedir(&self, _ctx: &Context, inode: u64, flags: u32, handle: u64) -> io::Result<()> {
        self.run(|fs, ctx| fs.releasedir(ctx, inode, flags, handle))
    }

    /// No DAX window: mappings are not served.
    fn setupmapping(
        &self,
        _ctx: &Context,
        _inode: u64,
        _handle: u64,
        _foffset: u64,
        _len: u64,
        _flags: u64,
        _moffset: u64,
        _vu_req: &mut dyn FsCacheReqHandler,
    ) -> io::Result<()> {
        Err(errno(libc::ENOSYS))
    }

    /// No DAX window: mappings are not served.
    fn removemapping(
        &self,
        _ctx: &Context,
        _inode: u64,
        _requests: Vec<RemovemappingOne>,
        _vu_req: &mut dyn FsCacheReqHandler,
    ) -> io::Result<()> {
        Err(errno(libc::ENOSYS))
    }

    /// Checks the mode bits against the owner's uid/gid; write access to a read-only share is
    /// `EROFS`.
    fn access(&self, _ctx: &Context, inode: u64, mask: u32) -> io::Result<()> {
        if mask as i32 & libc::W_OK != 0 {
            self.writable()?;
        }
        let owner = self.owner_context();
        self.run(|fs, _| fs.access(&owner, inode, mask))
    }

    fn lseek(
        &self,
        _ctx: &Context,
        inode: u64,
        handle: u64,
        offset: u64,
        whence: u32,
    ) -> io::Result<u64> {
        self.run(|fs, ctx| fs.lseek(ctx, inode, handle, offset, whence))
    }

    fn getlk(
        &self,
        _ctx: &Context,
        inode: u64,
        handle: u64,
        owner: u64,
        lock: FileLock,
        flags: u32,
    ) -> io::Result<FileLock> {
        self.run(|fs, ctx| fs.getlk(ctx, inode, handle, owner, lock, flags))
    }

    fn setlk(
        &self,
        _ctx: &Context,
        inode: u64,
        handle: u64,
        owner: u64,
        lock: FileLock,
        flags: u32,
    ) -> io::Result<()> {
        self.run(|fs, ctx| fs.setlk(ctx, inode, handle, owner, lock, flags))
    }

    fn setlkw(
        &self,
        _ctx: &Context,
        inode: u64,
        handle: u64,
        owner: u64,
        lock: FileLock,
        flags: u32,
    ) -> io::Result<()> {
        self.run(|fs, ctx| fs.setlkw(ctx, inode, handle, owner, lock, flags))
    }

    /// No ioctl is passed to the host (`FS_IOC_SETFLAGS` and friends could change the file).
    fn ioctl(
        &self,
        _ctx: &Context,
        _inode: u64,
        _handle: u64,
        _flags: u32,
        _cmd: u32,
        _data: IoctlData,
        _out_size: u32,
    ) -> io::Result<IoctlData<'_>> {
        Err(errno(libc::ENOTTY))
    }

    fn bmap(&self, _ctx: &Context, _inode: u64, _block: u64, _blocksize: u32) -> io::Result<u64> {
        Err(errno(libc::ENOSYS))
    }

    fn poll(
        &self,
        _ctx: &Context,
        inode: u64,
        handle: u64,
        khandle: u64,
        flags: u32,
        events: u32,
    ) -> io::Result<u32> {
        self.run(|fs, ctx| fs.poll(ctx, inode, handle, khandle, flags, events))
    }

    fn notify_reply(&self) -> io::Result<()> {
        self.inner().notify_reply()
    }

    /// The guest's uid/gid are not used, so there is nothing to remap.
    fn id_remap(&self, _ctx: &mut Context) -> io::Result<()> {
        Ok(())
    }
}

/// `flags` without `O_NOATIME`. The guest's overlayfs adds it when it copies a file up; it is only
/// an optimisation, and the host refuses it (`EPERM`) for a file the VMM does not own once the VMM
/// runs without `CAP_FOWNER` (jailed). Read and write requests carry the file's flags too, and
/// fuse-backend-rs re-applies differing flags with `fcntl(F_SETFL)` — whose failure there closes
/// the handle's descriptor (a double close that aborts the VMM later) — so every request that
/// carries open flags goes through this.
fn without_noatime(flags: u32) -> u32 {
    flags & !(libc::O_NOATIME as u32)
}
