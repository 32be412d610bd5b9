//! The `Filesystem` adapter: each FUSE method decodes its inode, calls the helper that does the
//! work (which returns `Result<T, Errno>`) and adapts the result to its `reply`.

use std::ffi::OsStr;
use std::time::SystemTime;

use fuser::{
    Errno, FileHandle, Filesystem, FopenFlags, Generation, INodeNo, InitFlags, KernelConfig,
    LockOwner, OpenAccMode, OpenFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory,
    ReplyEmpty, ReplyEntry, ReplyOpen, ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};

use super::nodes::{ENTRY_TTL, Node, TTL, XATTRS, node_or_enoent};
use super::state::{Handle, KvFs};

impl Filesystem for KvFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        if self.passthrough {
            // The data files are on a plain filesystem: one level of stacking.
            let granted = config.add_capabilities(InitFlags::FUSE_PASSTHROUGH).is_ok()
                && config.set_max_stack_depth(1).is_ok();
            if !granted {
                tracing::info!(
                    "the kernel offers no FUSE passthrough; the daemon serves every kv read"
                );
            }
            self.passthrough = granted;
        }
        Ok(())
    }

    fn lookup(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let res = node_or_enoent(parent)
            .and_then(|p| self.lookup_node(p, name))
            .and_then(|n| self.attr(req.uid(), n));
        match res {
            Ok(a) => reply.entry_with_ttls(self.attr_ttl(&a), &ENTRY_TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn getattr(&self, req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match node_or_enoent(ino).and_then(|n| self.attr(req.uid(), n)) {
            Ok(a) => reply.attr(self.attr_ttl(&a), &a),
            Err(e) => reply.error(e),
        }
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let res = node_or_enoent(ino).and_then(|n| {
            if mode.is_some() || uid.is_some() || gid.is_some() {
                return Err(Errno::EPERM);
            }
            if let Some(size) = size {
                self.truncate(n, fh, size)?;
            }
            self.attr(req.uid(), n)
        });
        match res {
            Ok(a) => reply.attr(&TTL, &a),
            Err(e) => reply.error(e),
        }
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let writing = flags.acc_mode() != OpenAccMode::O_RDONLY;
        // Read-only handles have nothing to commit: spare the kernel a FLUSH round trip on close.
        // A `kv` writer commits each chunk as its write completes: nothing to flush either, and
        // writes to different chunks may run in parallel.
        let kv = matches!(Node::of(ino), Some(Node::Kv(_)));
        let open_flags = if kv && writing {
            FopenFlags::FOPEN_DIRECT_IO
                | FopenFlags::FOPEN_NOFLUSH
                | FopenFlags::FOPEN_PARALLEL_DIRECT_WRITES
        } else if writing {
            FopenFlags::FOPEN_DIRECT_IO
        } else {
            FopenFlags::FOPEN_DIRECT_IO | FopenFlags::FOPEN_NOFLUSH
        };
        let mut reply = reply;
        if let Some(Node::Data(c)) = Node::of(ino)
            && self.passthrough
            && !writing
        {
            // Every open of a passed-through inode must be passed through (the kernel refuses
            // anything else while one is), and a buffered one would fill the data file's page
            // cache: `data` is for O_DIRECT readers.
            if flags.0 & libc::O_DIRECT == 0 {
                return reply.error(Errno::EINVAL);
            }
            match self.open_passthrough(req.uid(), c, reply) {
                Ok(()) => return,
                Err((r, Errno::EAGAIN)) => reply = r,
                Err((r, e)) => return r.error(e),
            }
        }
        match node_or_enoent(ino).and_then(|n| self.open_node(req.uid(), req.pid(), n, flags)) {
            Ok(fh) => reply.opened(fh, open_flags),
            Err(e) => reply.error(e),
        }
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        _mode: u32,
        _umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        match node_or_enoent(parent).and_then(|p| self.create_node(req.uid(), req.pid(), p, name)) {
            Ok((fh, a)) => reply.created(&TTL, &a, Generation(0), fh, FopenFlags::FOPEN_DIRECT_IO),
            Err(e) => reply.error(e),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        match Node::of(ino) {
            Some(Node::Kv(c)) => return self.read_kv(c, offset, size, reply),
            Some(Node::Data(c)) => return self.read_data(c, offset, size, reply),
            _ => {}
        }
        match self.handle_bytes(fh) {
            Ok(bytes) => {
                let start = (offset as usize).min(bytes.len());
                let end = start.saturating_add(size as usize).min(bytes.len());
                reply.data(&bytes[start..end]);
            }
            Err(e) => reply.error(e),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let res = match Node::of(ino) {
            Some(Node::Kv(c)) => self.write_kv(fh, c, offset, data),
            _ => self.write_handle(fh, offset, data),
        };
        match res {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(e),
        }
    }

    fn flush(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        let opener = matches!(
            self.handles.lock().get(&fh.0),
            Some(Handle::Write { opener, .. }) if *opener == req.pid()
        );
        // Another process's close (a forked child's, at exec) commits nothing; `release` will.
        let res = if opener { self.commit(fh) } else { Ok(()) };
        match res {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        match self.commit(fh) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
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
        let res = self.commit(fh);
        let handle = self.handles.lock().remove(&fh.0);
        match handle {
            Some(Handle::Kv { partial: Some(p) }) => tracing::warn!(
                index = p.index,
                bytes = p.filled,
                "kvfs dropped an unfinished chunk image at close; the stored chunk is unchanged"
            ),
            Some(Handle::Passthrough(c)) => self.release_backing(c),
            _ => {}
        }
        match res {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn readdir(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        match node_or_enoent(ino).and_then(|n| self.entries(req.uid(), n)) {
            Ok(entries) => {
                for (i, (ino, kind, name)) in entries.into_iter().enumerate().skip(offset as usize)
                {
                    if reply.add(ino, (i + 1) as u64, kind, name) {
                        break;
                    }
                }
                reply.ok();
            }
            Err(e) => reply.error(e),
        }
    }

    fn getxattr(&self, req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        match node_or_enoent(ino).and_then(|n| self.xattr_value(req.uid(), n, name)) {
            Ok(v) if size == 0 => reply.size(v.len() as u32),
            Ok(v) if v.len() > size as usize => reply.error(Errno::ERANGE),
            Ok(v) => reply.data(&v),
            Err(e) => reply.error(e),
        }
    }

    fn listxattr(&self, req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let res = node_or_enoent(ino).and_then(|n| match n {
            Node::Chunk(c, _) => {
                self.owner(req.uid(), c)?;
                Ok(XATTRS
                    .iter()
                    .flat_map(|x| x.bytes().chain([0]))
                    .collect::<Vec<u8>>())
            }
            _ => Ok(Vec::new()),
        });
        match res {
            Ok(v) if size == 0 => reply.size(v.len() as u32),
            Ok(v) if v.len() > size as usize => reply.error(Errno::ERANGE),
            Ok(v) => reply.data(&v),
            Err(e) => reply.error(e),
        }
    }

    fn setxattr(
        &self,
        req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        _flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        match node_or_enoent(ino).and_then(|n| self.set_xattr(req.uid(), n, name, value)) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }
}
