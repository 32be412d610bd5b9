//! A FUSE filesystem whose files the kernel reads itself from backing files (FUSE passthrough,
//! `FOPEN_PASSTHROUGH`): what `llms bench kvfs` measures the `kv` file against. Not a data path.
//!
//! Each file is registered with the kernel at `open` (`FUSE_DEV_IOC_BACKING_OPEN`, root only) and
//! opened with `FOPEN_PASSTHROUGH`; from then on the kernel serves `read`s of it straight from the
//! backing file, offset for offset, without a request to this daemon. The kernel opens its own
//! backing file with the FUSE file's open flags, so a reader that opens the FUSE file with
//! `O_DIRECT` reads the backing file with `O_DIRECT`; without it, the reads go through the backing
//! file's page cache. Nothing here checks the bytes: that is the point and the problem (see
//! docs/kvfs.md, "FUSE passthrough").

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use fuser::{
    BackingId, Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation,
    INodeNo, InitFlags, KernelConfig, LockOwner, MountOption, OpenFlags, ReplyAttr, ReplyData,
    ReplyEmpty, ReplyEntry, ReplyOpen, Request,
};

use crate::fs::{Mount, MountError};

const TTL: Duration = Duration::from_secs(60);
/// Inode of file `i` (in the order given to [`mount_passthrough`]).
const FIRST_FILE: u64 = 2;

/// Counters of a passthrough mount.
#[derive(Debug, Default)]
pub struct PassthroughCounters {
    /// Opens answered with `FOPEN_PASSTHROUGH`.
    pub passthrough_opens: AtomicU64,
    /// `READ` requests that reached the daemon (0 while the kernel passes every read through).
    pub daemon_reads: AtomicU64,
}

/// An open file: its backing id (the kernel's reference goes with the last handle that holds it)
/// and the daemon's own descriptor of the backing file, for reads that reach the daemon.
type Open = (Arc<BackingId>, Arc<File>);

struct PassthroughFs {
    files: Vec<(String, PathBuf, u64)>,
    handles: Mutex<HashMap<u64, Open>>,
    next_fh: AtomicU64,
    counters: Arc<PassthroughCounters>,
}

impl PassthroughFs {
    fn file(&self, ino: INodeNo) -> Result<(usize, &(String, PathBuf, u64)), Errno> {
        let i = ino.0.checked_sub(FIRST_FILE).ok_or(Errno::ENOENT)? as usize;
        self.files.get(i).map(|f| (i, f)).ok_or(Errno::ENOENT)
    }

    fn attr(&self, ino: INodeNo) -> Result<FileAttr, Errno> {
        let (kind, perm, size) = if ino == INodeNo::ROOT {
            (FileType::Directory, 0o755, 0)
        } else {
            (FileType::RegularFile, 0o600, self.file(ino)?.1.2)
        };
        Ok(FileAttr {
            ino,
            size,
            blocks: size.div_ceil(512),
            atime: UNIX_EPOCH,
            mtime: UNIX_EPOCH,
            ctime: UNIX_EPOCH,
            crtime: UNIX_EPOCH,
            kind,
            perm,
            nlink: 1,
            uid: 0,
            gid: 0,
            rdev: 0,
            flags: 0,
            blksize: 4096,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Open>> {
        self.handles.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Filesystem for PassthroughFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        config
            .add_capabilities(InitFlags::FUSE_PASSTHROUGH)
            .map_err(|_| std::io::Error::other("the kernel does not offer FUSE passthrough"))?;
        // The backing files are on a plain filesystem: one level of stacking.
        config
            .set_max_stack_depth(1)
            .map_err(|_| std::io::Error::other("the kernel refuses a stack depth of 1"))?;
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let found = (parent == INodeNo::ROOT)
            .then(|| self.files.iter().position(|f| OsStr::new(&f.0) == name))
            .flatten();
        match found.map(|i| self.attr(INodeNo(FIRST_FILE + i as u64))) {
            Some(Ok(a)) => reply.entry(&TTL, &a, Generation(0)),
            Some(Err(e)) => reply.error(e),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.attr(ino) {
            Ok(a) => reply.attr(&TTL, &a),
            Err(e) => reply.error(e),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let path = match self.file(ino) {
            Ok((_, f)) => f.1.clone(),
            Err(e) => return reply.error(e),
        };
        let file = match File::open(&path) {
            Ok(f) => Arc::new(f),
            Err(e) => return reply.error(Errno::from_i32(e.raw_os_error().unwrap_or(libc::EIO))),
        };
        let id = match reply.open_backing(&*file) {
            Ok(id) => Arc::new(id),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "FUSE_DEV_IOC_BACKING_OPEN failed");
                return reply.error(Errno::from_i32(e.raw_os_error().unwrap_or(libc::EIO)));
            }
        };
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.lock().insert(fh, (Arc::clone(&id), file));
        self.counters
            .passthrough_opens
            .fetch_add(1, Ordering::Relaxed);
        // Read-only: nothing to flush at close.
        reply.opened_passthrough(FileHandle(fh), FopenFlags::FOPEN_NOFLUSH, &id);
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        // Only reached if the kernel did not pass the file through: served, and counted.
        self.counters.daemon_reads.fetch_add(1, Ordering::Relaxed);
        let file = self.lock().get(&fh.0).map(|h| Arc::clone(&h.1));
        let Some(file) = file else {
            return reply.error(Errno::EBADF);
        };
        let mut buf = vec![0u8; size as usize];
        match file.read_at(&mut buf, offset) {
            Ok(n) => reply.data(&buf[..n]),
            Err(e) => reply.error(Errno::from_i32(e.raw_os_error().unwrap_or(libc::EIO))),
        }
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.lock().remove(&fh.0);
        reply.ok();
    }
}

/// Mounts a read-only filesystem at `mountpoint` whose root holds one file per `(name, backing
/// path)`, each passed through to its backing file; `threads` FUSE workers. Root only.
pub fn mount_passthrough(
    files: &[(String, PathBuf)],
    mountpoint: &Path,
    threads: usize,
) -> Result<(Mount, Arc<PassthroughCounters>), MountError> {
    let mut listed = Vec::with_capacity(files.len());
    for (name, path) in files {
        let len = std::fs::metadata(path)
            .map_err(|source| MountError::MountPoint {
                path: path.clone(),
                source,
            })?
            .len();
        listed.push((name.clone(), path.clone(), len));
    }
    let counters = Arc::new(PassthroughCounters::default());
    let fs = PassthroughFs {
        files: listed,
        handles: Mutex::new(HashMap::new()),
        next_fh: AtomicU64::new(1),
        counters: Arc::clone(&counters),
    };
    let mut cfg = Config::default();
    cfg.mount_options = vec![
        MountOption::FSName("kvfs-passthrough".to_owned()),
        MountOption::Subtype("kvfs".to_owned()),
        MountOption::DefaultPermissions,
        MountOption::NoAtime,
        MountOption::RO,
    ];
    cfg.n_threads = Some(threads.max(1));
    cfg.clone_fd = true;
    let session = fuser::spawn_mount(fs, mountpoint, &cfg).map_err(|source| MountError::Mount {
        path: mountpoint.to_owned(),
        source,
    })?;
    Ok((Mount::from_session(session, mountpoint), counters))
}
