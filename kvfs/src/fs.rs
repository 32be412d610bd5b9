//! The FUSE filesystem over a [`Store`]: `/stats`,
//! `/<context>/{info,text,tokens,kv,data,chunks/<index>}`.
//!
//! Shaped like fuser's `examples/simple.rs`: helpers return `Result<T, Errno>` and each
//! `Filesystem` method only adapts to its `reply`.
//! Files belong to the uid that owns the context (mode 0600 or 0400, directories 0700) and the
//! mount uses `default_permissions`, so the kernel enforces ownership; other uids are not even
//! shown a context they do not own. `data` is passed through to the context's data file for
//! `O_DIRECT` readers (FUSE passthrough: the kernel reads the disk itself); every other open is
//! served by the daemon with `FOPEN_DIRECT_IO`, so the page cache never holds chunk bytes and the
//! kernel forwards reads in requests of up to 1 MiB.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    BackgroundSession, BackingId, Config, Errno, FileAttr, FileHandle, FileType, Filesystem,
    FopenFlags, Generation, INodeNo, InitFlags, KernelConfig, LockOwner, MountOption, OpenAccMode,
    OpenFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry,
    ReplyOpen, ReplyWrite, ReplyXattr, Request, SessionACL, TimeOrNow, WriteFlags,
};

use crate::format::{ChunkHeader, Codec, HEADER_LEN, KvFormat};
use crate::store::{
    ChunkState, ContextId, MAX_CHUNK_BYTES, SLOT_BYTES, Store, StoreError, slot_offset,
};

/// Attributes are not cached: sizes of `info`, `text`, `stats` and chunks change under writes, and a
/// fresh `getattr` is where a uid that does not own a context is turned away.
const TTL: Duration = Duration::ZERO;
/// Names are cached for a second, which saves a `lookup` per path component on every open.
/// Ids are never reused and deleted or quarantined names fail their `getattr`, so a cached name
/// never leads to wrong data; new names are not cached negatively and appear at once.
const ENTRY_TTL: Duration = Duration::from_secs(1);
/// The root directory's attributes never change.
const ROOT_TTL: Duration = Duration::from_secs(1);
/// The attribute TTL of context directories when [`MountConfig::cache_dir_attrs`] is set.
const DIR_TTL: Duration = Duration::from_secs(1);
const ROOT: u64 = 1;
const STATS: u64 = 2;
/// Inode of a context's piece: `context << 32 | slot`; chunk `i` is slot `FIRST_CHUNK + i`.
const SLOT_DIR: u64 = 1;
const SLOT_CHUNKS: u64 = 2;
const SLOT_INFO: u64 = 3;
const SLOT_TEXT: u64 = 4;
const SLOT_KV: u64 = 5;
const SLOT_DATA: u64 = 6;
const SLOT_TOKENS: u64 = 7;
const FIRST_CHUNK: u64 = 16;
/// Extended attributes of a chunk in the per-chunk view; `format` and `density` can be set before a
/// write commits, the others are read only.
const XATTRS: [&str; 9] = [
    "user.kvfs.format",
    "user.kvfs.density",
    "user.kvfs.state",
    "user.kvfs.codec",
    "user.kvfs.generation",
    "user.kvfs.raw_bytes",
    "user.kvfs.stored_bytes",
    "user.kvfs.written",
    "user.kvfs.resident",
];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Node {
    Root,
    Stats,
    Dir(ContextId),
    Chunks(ContextId),
    Info(ContextId),
    Text(ContextId),
    Tokens(ContextId),
    Kv(ContextId),
    Data(ContextId),
    Chunk(ContextId, u32),
}

impl Node {
    fn of(ino: INodeNo) -> Option<Node> {
        let ino = ino.0;
        match ino {
            ROOT => return Some(Node::Root),
            STATS => return Some(Node::Stats),
            _ => {}
        }
        let ctx = ContextId(ino >> 32);
        if ctx.0 == 0 {
            return None;
        }
        Some(match ino & 0xffff_ffff {
            SLOT_DIR => Node::Dir(ctx),
            SLOT_CHUNKS => Node::Chunks(ctx),
            SLOT_INFO => Node::Info(ctx),
            SLOT_TEXT => Node::Text(ctx),
            SLOT_TOKENS => Node::Tokens(ctx),
            SLOT_KV => Node::Kv(ctx),
            SLOT_DATA => Node::Data(ctx),
            s if s >= FIRST_CHUNK => Node::Chunk(ctx, (s - FIRST_CHUNK) as u32),
            _ => return None,
        })
    }

    fn ino(self) -> INodeNo {
        let base = |c: ContextId| c.0 << 32;
        INodeNo(match self {
            Node::Root => ROOT,
            Node::Stats => STATS,
            Node::Dir(c) => base(c) | SLOT_DIR,
            Node::Chunks(c) => base(c) | SLOT_CHUNKS,
            Node::Info(c) => base(c) | SLOT_INFO,
            Node::Text(c) => base(c) | SLOT_TEXT,
            Node::Tokens(c) => base(c) | SLOT_TOKENS,
            Node::Kv(c) => base(c) | SLOT_KV,
            Node::Data(c) => base(c) | SLOT_DATA,
            Node::Chunk(c, i) => base(c) | (FIRST_CHUNK + i as u64),
        })
    }

    fn context(self) -> Option<ContextId> {
        match self {
            Node::Root | Node::Stats => None,
            Node::Dir(c)
            | Node::Chunks(c)
            | Node::Info(c)
            | Node::Text(c)
            | Node::Tokens(c)
            | Node::Kv(c)
            | Node::Data(c)
            | Node::Chunk(c, _) => Some(c),
        }
    }
}

/// Where a write of chunk `index`'s image goes in its context's `kv` file: the offset of the
/// chunk's first slot ([`slot_offset`]). Reads of the `kv` file show the data file offset for
/// offset, so a reader finds the chunk at whichever slot [`Store::locate`] names.
pub fn kv_offset(index: u32) -> u64 {
    slot_offset(index, 0)
}

/// The length of the chunk image a `kv` write header announces, after checking that it names
/// context `c` and chunk `index` and holds plain bytes.
fn image_len(h: &ChunkHeader, c: ContextId, index: u32) -> Result<usize, Errno> {
    if h.context != c.0 || h.index != index || h.codec != Codec::Raw || h.stored_len != h.raw_len {
        return Err(Errno::EINVAL);
    }
    if h.raw_len as usize > MAX_CHUNK_BYTES {
        return Err(Errno::EFBIG);
    }
    Ok(HEADER_LEN + h.raw_len as usize)
}

/// The largest chunk index with an inode (the slot must fit in 32 bits).
const MAX_INDEX: u32 = u32::MAX - FIRST_CHUNK as u32;

enum Handle {
    /// A snapshot taken at open: a checked chunk or a generated text file.
    Read(Arc<Vec<u8>>),
    /// A `data` file the kernel reads itself from the context's data file (FUSE passthrough).
    Passthrough(ContextId),
    /// A `data` file whose reads the daemon serves from the data file (no passthrough).
    Data,
    /// The per-context `kv` file; reads need nothing from the handle, a write of a chunk image
    /// split over several requests is gathered here until it is whole.
    Kv { partial: Option<Partial> },
    /// A chunk being written: committed to the store on flush (by the opener), fsync or release.
    Write {
        ctx: ContextId,
        index: u32,
        buf: Vec<u8>,
        dirty: bool,
        /// The thread that opened the file. Only its `close` commits at `flush`: a child forked
        /// while the file is open closes its copy of the descriptor at `exec`, which sends a
        /// `flush` too, and must not commit a half-written chunk.
        opener: u32,
    },
}

/// A chunk image written to the `kv` file in more than one request, gathered until it is whole.
struct Partial {
    index: u32,
    image: Vec<u8>,
    filled: usize,
}

/// A chunk's format and density set through xattrs, not yet committed.
type Label = (Option<KvFormat>, Option<f32>);

/// The filesystem; mount it with [`mount`].
pub struct KvFs {
    store: Arc<Store>,
    read_only: bool,
    cache_dir_attrs: bool,
    /// Whether `data` files are passed through to the contexts' data files: asked for in the
    /// config, and granted by the kernel at `init`.
    passthrough: bool,
    /// The kernel's registration of each data file with open passthrough handles, and how many
    /// hold it: every passthrough open of one inode must name the same backing file.
    backing: Mutex<HashMap<ContextId, (Arc<BackingId>, usize)>>,
    handles: Mutex<HashMap<u64, Handle>>,
    next_fh: AtomicU64,
    /// `user.kvfs.format` / `user.kvfs.density` set on a chunk, applied at its next commit.
    pending: Mutex<HashMap<(ContextId, u32), Label>>,
    counters: Arc<MountCounters>,
}

/// What moved through a mount's `kv` files (shown in `/stats`; [`Mount::counters`]).
#[derive(Debug, Default)]
pub struct MountCounters {
    /// Chunk slots the daemon served through `kv` and `data` files (reads it saw at a slot's start).
    pub kv_reads: AtomicU64,
    /// Chunk images committed through `kv` files.
    pub kv_writes: AtomicU64,
    /// `data` opens passed through to the data file: their reads never reach the daemon.
    pub passthrough_opens: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The errno a store error becomes at the filesystem boundary.
fn errno(e: &StoreError) -> Errno {
    match e {
        StoreError::NoSuchContext { .. } | StoreError::ChunkMissing { .. } => Errno::ENOENT,
        StoreError::Corrupt { .. } | StoreError::ForeignModel { .. } => Errno::EIO,
        StoreError::BeyondTokens { .. } | StoreError::Invalid { .. } => Errno::EINVAL,
        StoreError::TooLarge { .. } => Errno::EFBIG,
        StoreError::BufferTooSmall { .. } => Errno::ERANGE,
        StoreError::NotAStore { .. } => Errno::EIO,
        StoreError::Locked { .. } => Errno::EBUSY,
        StoreError::ReadOnly { .. } => Errno::EROFS,
        StoreError::Io(io) => io.source.raw_os_error().map_or(Errno::EIO, Errno::from_i32),
    }
}

fn store_err(e: StoreError) -> Errno {
    tracing::debug!(error = %e, "kvfs request failed");
    errno(&e)
}

impl KvFs {
    /// A filesystem over `store`; with `read_only` every write is refused with EROFS; see
    /// [`MountConfig::cache_dir_attrs`].
    pub fn new(store: Arc<Store>, read_only: bool, cache_dir_attrs: bool) -> KvFs {
        KvFs {
            store,
            read_only,
            cache_dir_attrs,
            passthrough: false,
            backing: Mutex::new(HashMap::new()),
            handles: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            pending: Mutex::new(HashMap::new()),
            counters: Arc::default(),
        }
    }

    fn attr_ttl(&self, a: &FileAttr) -> &'static Duration {
        if a.ino.0 == ROOT {
            &ROOT_TTL
        } else if self.cache_dir_attrs && a.kind == FileType::Directory {
            &DIR_TTL
        } else {
            &TTL
        }
    }

    /// The owner of a context if `uid` may see it (its owner, or root), else ENOENT.
    fn owner(&self, uid: u32, ctx: ContextId) -> Result<(u32, SystemTime), Errno> {
        let (owner, created) = self.store.owner(ctx).map_err(store_err)?;
        if uid != 0 && uid != owner {
            return Err(Errno::ENOENT);
        }
        Ok((owner, UNIX_EPOCH + Duration::from_secs(created)))
    }

    fn pending_write_len(&self, ctx: ContextId, index: u32) -> Option<usize> {
        lock(&self.handles).values().find_map(|h| match h {
            Handle::Write {
                ctx: c,
                index: i,
                buf,
                ..
            } if *c == ctx && *i == index => Some(buf.len()),
            _ => None,
        })
    }

    fn attr(&self, uid: u32, node: Node) -> Result<FileAttr, Errno> {
        let dir = |perm: u16, owner: u32, time: SystemTime| {
            attr(node, FileType::Directory, perm, owner, 0, time)
        };
        let file = |perm: u16, owner: u32, size: usize, time: SystemTime| {
            attr(node, FileType::RegularFile, perm, owner, size as u64, time)
        };
        match node {
            Node::Root => Ok(dir(0o755, 0, UNIX_EPOCH)),
            Node::Stats => Ok(file(0o444, 0, self.stats_text().len(), SystemTime::now())),
            Node::Dir(c) | Node::Chunks(c) => {
                let (owner, t) = self.owner(uid, c)?;
                Ok(dir(0o700, owner, t))
            }
            Node::Info(c) => {
                let (owner, t) = self.owner(uid, c)?;
                Ok(file(
                    0o400,
                    owner,
                    self.store.render_info(c).map_err(store_err)?.len(),
                    t,
                ))
            }
            Node::Text(c) => {
                let (owner, t) = self.owner(uid, c)?;
                Ok(file(
                    0o400,
                    owner,
                    self.store.render_text(c).map_err(store_err)?.len(),
                    t,
                ))
            }
            Node::Tokens(c) => {
                let (owner, t) = self.owner(uid, c)?;
                Ok(file(
                    0o400,
                    owner,
                    self.store.render_tokens(c).map_err(store_err)?.len(),
                    t,
                ))
            }
            Node::Kv(c) => {
                let (owner, t) = self.owner(uid, c)?;
                Ok(file(0o600, owner, self.kv_len(c)? as usize, t))
            }
            Node::Data(c) => {
                let (owner, t) = self.owner(uid, c)?;
                Ok(file(0o400, owner, self.kv_len(c)? as usize, t))
            }
            Node::Chunk(c, i) => {
                let (owner, t) = self.owner(uid, c)?;
                let size = match self.pending_write_len(c, i) {
                    Some(len) => len,
                    None => match self.store.chunk_state(c, i).map_err(store_err)? {
                        ChunkState::Stored(s) => s.raw_len as usize,
                        _ => return Err(Errno::ENOENT),
                    },
                };
                Ok(file(0o600, owner, size, t))
            }
        }
    }

    fn lookup_node(&self, parent: Node, name: &OsStr) -> Result<Node, Errno> {
        let name = name.to_str().ok_or(Errno::ENOENT)?;
        let node = match parent {
            Node::Root if name == "stats" => Node::Stats,
            Node::Root => Node::Dir(ContextId(name.parse().map_err(|_| Errno::ENOENT)?)),
            Node::Dir(c) => match name {
                "chunks" => Node::Chunks(c),
                "info" => Node::Info(c),
                "text" => Node::Text(c),
                "tokens" => Node::Tokens(c),
                "kv" => Node::Kv(c),
                "data" => Node::Data(c),
                _ => return Err(Errno::ENOENT),
            },
            Node::Chunks(c) => Node::Chunk(c, parse_index(name)?),
            _ => return Err(Errno::ENOTDIR),
        };
        if node.context().is_some_and(|c| c.0 == 0 || c.0 >= 1 << 32) {
            return Err(Errno::ENOENT);
        }
        Ok(node)
    }

    fn entries(&self, uid: u32, node: Node) -> Result<Vec<(INodeNo, FileType, String)>, Errno> {
        let mut out = vec![
            (node.ino(), FileType::Directory, ".".to_owned()),
            (INodeNo(ROOT), FileType::Directory, "..".to_owned()),
        ];
        match node {
            Node::Root => {
                out.push((INodeNo(STATS), FileType::RegularFile, "stats".to_owned()));
                for c in self.store.list_contexts() {
                    if c.0 < 1 << 32 && self.owner(uid, c).is_ok() {
                        out.push((Node::Dir(c).ino(), FileType::Directory, c.to_string()));
                    }
                }
            }
            Node::Dir(c) => {
                self.owner(uid, c)?;
                out.push((
                    Node::Chunks(c).ino(),
                    FileType::Directory,
                    "chunks".to_owned(),
                ));
                out.push((
                    Node::Info(c).ino(),
                    FileType::RegularFile,
                    "info".to_owned(),
                ));
                out.push((
                    Node::Text(c).ino(),
                    FileType::RegularFile,
                    "text".to_owned(),
                ));
                out.push((
                    Node::Tokens(c).ino(),
                    FileType::RegularFile,
                    "tokens".to_owned(),
                ));
                out.push((Node::Kv(c).ino(), FileType::RegularFile, "kv".to_owned()));
                out.push((
                    Node::Data(c).ino(),
                    FileType::RegularFile,
                    "data".to_owned(),
                ));
            }
            Node::Chunks(c) => {
                self.owner(uid, c)?;
                out[1].0 = Node::Dir(c).ino();
                let info = self.store.context(c).map_err(store_err)?;
                for m in info.chunks {
                    if matches!(m.state, ChunkState::Stored(_)) && m.index <= MAX_INDEX {
                        out.push((
                            Node::Chunk(c, m.index).ino(),
                            FileType::RegularFile,
                            m.index.to_string(),
                        ));
                    }
                }
            }
            _ => return Err(Errno::ENOTDIR),
        }
        Ok(out)
    }

    fn add_handle(&self, h: Handle) -> FileHandle {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        lock(&self.handles).insert(fh, h);
        FileHandle(fh)
    }

    fn open_node(
        &self,
        uid: u32,
        pid: u32,
        node: Node,
        flags: OpenFlags,
    ) -> Result<FileHandle, Errno> {
        let writing = flags.acc_mode() != OpenAccMode::O_RDONLY;
        let text = |s: String| Ok(self.add_handle(Handle::Read(Arc::new(s.into_bytes()))));
        match node {
            Node::Root | Node::Dir(_) | Node::Chunks(_) => Err(Errno::EISDIR),
            _ if writing && self.read_only => Err(Errno::EROFS),
            Node::Stats | Node::Info(_) | Node::Text(_) | Node::Tokens(_) | Node::Data(_)
                if writing =>
            {
                Err(Errno::EACCES)
            }
            Node::Data(c) => {
                // Reached only without passthrough: the daemon reads the data file for it.
                self.owner(uid, c)?;
                Ok(self.add_handle(Handle::Data))
            }
            Node::Stats => text(self.stats_text()),
            Node::Info(c) => {
                self.owner(uid, c)?;
                text(self.store.render_info(c).map_err(store_err)?)
            }
            Node::Text(c) => {
                self.owner(uid, c)?;
                text(self.store.render_text(c).map_err(store_err)?)
            }
            Node::Tokens(c) => {
                self.owner(uid, c)?;
                text(self.store.render_tokens(c).map_err(store_err)?)
            }
            Node::Kv(c) => {
                self.owner(uid, c)?;
                Ok(self.add_handle(Handle::Kv { partial: None }))
            }
            Node::Chunk(c, i) => {
                self.owner(uid, c)?;
                let truncate = flags.0 & libc::O_TRUNC != 0;
                if writing {
                    let buf = if truncate {
                        Vec::new()
                    } else {
                        self.read_chunk(c, i)?
                    };
                    return Ok(self.add_handle(Handle::Write {
                        ctx: c,
                        index: i,
                        buf,
                        dirty: truncate,
                        opener: pid,
                    }));
                }
                let data = self.read_chunk(c, i)?;
                Ok(self.add_handle(Handle::Read(Arc::new(data))))
            }
        }
    }

    /// `/stats`: the store's counters, then the chunks that moved through `kv` files.
    fn stats_text(&self) -> String {
        let c = &self.counters;
        format!(
            "{}kv file      {} chunk reads by the daemon, {} passthrough opens, {} chunk writes\n",
            self.store.render_stats(),
            c.kv_reads.load(Ordering::Relaxed),
            c.passthrough_opens.load(Ordering::Relaxed),
            c.kv_writes.load(Ordering::Relaxed)
        )
    }

    fn read_chunk(&self, c: ContextId, i: u32) -> Result<Vec<u8>, Errno> {
        let fp = self.store.fingerprint(c).map_err(store_err)?;
        self.store.read_chunk(c, i, &fp).map_err(|e| {
            if matches!(e, StoreError::Corrupt { .. }) {
                tracing::warn!(error = %e, "kvfs refused a corrupt chunk");
            }
            store_err(e)
        })
    }

    fn create_node(
        &self,
        uid: u32,
        pid: u32,
        parent: Node,
        name: &OsStr,
    ) -> Result<(FileHandle, FileAttr), Errno> {
        let Node::Chunks(c) = parent else {
            return Err(Errno::EPERM);
        };
        if self.read_only {
            return Err(Errno::EROFS);
        }
        let (owner, t) = self.owner(uid, c)?;
        let index = parse_index(name.to_str().ok_or(Errno::EINVAL)?).map_err(|_| Errno::EINVAL)?;
        let fh = self.add_handle(Handle::Write {
            ctx: c,
            index,
            buf: Vec::new(),
            dirty: true,
            opener: pid,
        });
        Ok((
            fh,
            attr(
                Node::Chunk(c, index),
                FileType::RegularFile,
                0o600,
                owner,
                0,
                t,
            ),
        ))
    }

    /// The bytes of a handle: shared for read handles (no copy), copied for write handles.
    fn handle_bytes(&self, fh: FileHandle) -> Result<Arc<Vec<u8>>, Errno> {
        match lock(&self.handles).get(&fh.0).ok_or(Errno::EBADF)? {
            Handle::Read(b) => Ok(b.clone()),
            Handle::Write { buf, .. } => Ok(Arc::new(buf.clone())),
            Handle::Kv { .. } | Handle::Passthrough(_) | Handle::Data => Err(Errno::EBADF),
        }
    }

    /// The `kv` file's length: the data file's.
    fn kv_len(&self, c: ContextId) -> Result<u64, Errno> {
        self.store.fingerprint(c).map_err(store_err)?;
        std::fs::metadata(self.store.data_path(c))
            .map(|m| m.len())
            .map_err(|e| Errno::from_i32(e.raw_os_error().unwrap_or(libc::EIO)))
    }

    /// Serves `size` bytes at `offset` of context `c`'s `kv` file, as the data file holds them:
    /// the bytes of a chunk's current slot (header page, then stored payload) once the chunk has
    /// passed every check, zeros anywhere else up to the file's end, never crossing into the next
    /// slot; EIO within the slots of a chunk that fails its checks (it is quarantined) or was
    /// quarantined before.
    fn read_kv(&self, c: ContextId, offset: u64, size: u32, reply: ReplyData) {
        let len = match self.kv_len(c) {
            Ok(l) => l,
            Err(e) => return reply.error(e),
        };
        let within = (offset % SLOT_BYTES) as usize;
        let want = (size as u64)
            .min(SLOT_BYTES - within as u64)
            .min(len.saturating_sub(offset)) as usize;
        let slot = offset / SLOT_BYTES;
        let (index, copy) = (slot / 2, (slot % 2) as u8);
        let stored = match u32::try_from(index) {
            Ok(i) => match self.store.chunk_state(c, i) {
                Ok(ChunkState::Stored(s)) if s.copy == copy => Some(i),
                // Refused again, as the store refuses it, until it is rewritten.
                Ok(ChunkState::Quarantined { .. }) => return reply.error(Errno::EIO),
                Ok(_) => None,
                Err(e) => return reply.error(store_err(e)),
            },
            Err(_) => None,
        };
        let Some(i) = stored else {
            return reply.data(&vec![0; want]);
        };
        let fp = match self.store.fingerprint(c) {
            Ok(fp) => fp,
            Err(e) => return reply.error(store_err(e)),
        };
        let mut reply = Some(reply);
        let res = self.store.with_slot(c, i, &fp, |_, bytes| {
            let start = within.min(bytes.len());
            let end = (within + want).min(bytes.len());
            if let Some(r) = reply.take() {
                if end - start == want {
                    r.data(&bytes[start..end]);
                } else {
                    // Past the payload, within the slot: the zeros the data file holds there.
                    let mut out = Vec::with_capacity(want);
                    out.extend_from_slice(&bytes[start..end]);
                    out.resize(want, 0);
                    r.data(&out);
                }
            }
        });
        if res.is_ok() && within == 0 {
            self.counters.kv_reads.fetch_add(1, Ordering::Relaxed);
        }
        if let (Err(e), Some(r)) = (res, reply.take()) {
            if matches!(e, StoreError::Corrupt { .. }) {
                tracing::warn!(error = %e, "kvfs refused a corrupt chunk");
            }
            r.error(store_err(e));
        }
    }

    /// Serves `size` bytes at `offset` of context `c`'s `data` file where the kernel does not pass
    /// it through: the data file's bytes as they are, unchecked (the reader checks them), read
    /// without filling the page cache.
    fn read_data(&self, c: ContextId, offset: u64, size: u32, reply: ReplyData) {
        let path = self.store.data_path(c);
        let res = std::fs::File::open(&path).and_then(|f| {
            let mut buf = vec![0u8; size as usize];
            let mut done = 0;
            while done < buf.len() {
                match f.read_at(&mut buf[done..], offset + done as u64)? {
                    0 => break,
                    n => done += n,
                }
            }
            crate::io::drop_range(&f, offset, done);
            buf.truncate(done);
            if offset.is_multiple_of(SLOT_BYTES) && done > 0 {
                self.counters.kv_reads.fetch_add(1, Ordering::Relaxed);
            }
            Ok(buf)
        });
        match res {
            Ok(b) => reply.data(&b),
            Err(e) => reply.error(Errno::from_i32(e.raw_os_error().unwrap_or(libc::EIO))),
        }
    }

    /// Registers context `c`'s data file with the kernel for a passthrough open (or takes another
    /// reference to its registration).
    fn backing_for(&self, c: ContextId, reply: &ReplyOpen) -> std::io::Result<Arc<BackingId>> {
        let mut backing = lock(&self.backing);
        if let Some((id, users)) = backing.get_mut(&c) {
            *users += 1;
            return Ok(Arc::clone(id));
        }
        let file = std::fs::File::open(self.store.data_path(c))?;
        let id = Arc::new(reply.open_backing(&file)?);
        backing.insert(c, (Arc::clone(&id), 1));
        Ok(id)
    }

    /// Drops a passthrough handle's reference to its context's registration.
    fn release_backing(&self, c: ContextId) {
        let mut backing = lock(&self.backing);
        if let Some((_, users)) = backing.get_mut(&c) {
            *users -= 1;
            if *users == 0 {
                backing.remove(&c);
            }
        }
    }

    /// Opens a `data` file for an `O_DIRECT` reader with `FOPEN_PASSTHROUGH`: from here on the
    /// kernel serves its reads from the data file and the reader checks what it gets
    /// ([`crate::MountReader`]). `Err` hands the open back to be served by the daemon.
    fn open_passthrough(
        &self,
        uid: u32,
        c: ContextId,
        reply: ReplyOpen,
    ) -> Result<(), (ReplyOpen, Errno)> {
        if let Err(e) = self.owner(uid, c) {
            return Err((reply, e));
        }
        match self.backing_for(c, &reply) {
            Ok(id) => {
                let fh = self.add_handle(Handle::Passthrough(c));
                self.counters
                    .passthrough_opens
                    .fetch_add(1, Ordering::Relaxed);
                reply.opened_passthrough(fh, FopenFlags::FOPEN_NOFLUSH, &id);
                Ok(())
            }
            Err(e) => {
                tracing::warn!(context = %c, error = %e, "FUSE passthrough refused; the daemon serves this kv file");
                Err((reply, Errno::EAGAIN))
            }
        }
    }

    /// Takes `data` written at `offset` of context `c`'s `kv` file: a chunk image (a raw chunk
    /// header and the plain bytes) at its slot, whole or in pieces; a whole image is checked (its
    /// crcs, that it names this context, this slot and the context's model) and committed with
    /// [`Store::write_chunk`] before the write returns, so a returned `pwrite` is durable.
    fn write_kv(
        &self,
        fh: FileHandle,
        c: ContextId,
        offset: u64,
        data: &[u8],
    ) -> Result<u32, Errno> {
        if self.read_only {
            return Err(Errno::EROFS);
        }
        let slot = offset / SLOT_BYTES;
        if !slot.is_multiple_of(2) {
            // Chunk images are written at their chunk's first slot only.
            return Err(Errno::EINVAL);
        }
        let index = u32::try_from(slot / 2).map_err(|_| Errno::EINVAL)?;
        let within = (offset % SLOT_BYTES) as usize;
        if within == 0 {
            let header = ChunkHeader::decode(data).map_err(|_| Errno::EINVAL)?;
            let total = image_len(&header, c, index)?;
            if data.len() > total {
                return Err(Errno::EINVAL);
            }
            if data.len() < total {
                let mut image = Vec::with_capacity(total);
                image.extend_from_slice(data);
                let mut handles = lock(&self.handles);
                let Some(Handle::Kv { partial }) = handles.get_mut(&fh.0) else {
                    return Err(Errno::EBADF);
                };
                *partial = Some(Partial {
                    index,
                    image,
                    filled: data.len(),
                });
                return Ok(data.len() as u32);
            }
            self.commit_image(c, index, &header, data)?;
            return Ok(data.len() as u32);
        }
        // A later piece of a split image: gather it, commit when whole.
        let done = {
            let mut handles = lock(&self.handles);
            let Some(Handle::Kv { partial }) = handles.get_mut(&fh.0) else {
                return Err(Errno::EBADF);
            };
            let Some(p) = partial.as_mut().filter(|p| p.index == index) else {
                return Err(Errno::EINVAL);
            };
            let end = within.checked_add(data.len()).ok_or(Errno::EINVAL)?;
            if within != p.image.len() || end > p.image.capacity() {
                return Err(Errno::EINVAL);
            }
            p.image.extend_from_slice(data);
            p.filled = end;
            if end == p.image.capacity() {
                partial.take()
            } else {
                None
            }
        };
        if let Some(p) = done {
            let header = ChunkHeader::decode(&p.image).map_err(|_| Errno::EINVAL)?;
            self.commit_image(c, p.index, &header, &p.image)?;
        }
        Ok(data.len() as u32)
    }

    /// Checks a whole chunk image written to the `kv` file and writes it to the store.
    fn commit_image(
        &self,
        c: ContextId,
        index: u32,
        header: &ChunkHeader,
        image: &[u8],
    ) -> Result<(), Errno> {
        let payload = &image[HEADER_LEN..];
        header.check_payload(payload).map_err(|e| {
            tracing::warn!(context = %c, index, error = %e, "kvfs refused a damaged chunk image");
            Errno::EIO
        })?;
        self.store
            .write_chunk(
                c,
                index,
                &header.fingerprint,
                header.format,
                header.density,
                payload,
            )
            .map(|_| {
                self.counters.kv_writes.fetch_add(1, Ordering::Relaxed);
            })
            .map_err(|e| {
                if matches!(e, StoreError::NoSuchContext { .. }) {
                    // The context was deleted with this write in flight: expected, not a fault.
                    tracing::debug!(error = %e, "kvfs write of a deleted context refused");
                } else {
                    tracing::warn!(error = %e, "kvfs write through the kv file failed");
                }
                errno(&e)
            })
    }

    fn write_handle(&self, fh: FileHandle, offset: u64, data: &[u8]) -> Result<u32, Errno> {
        let mut handles = lock(&self.handles);
        let Some(Handle::Write { buf, dirty, .. }) = handles.get_mut(&fh.0) else {
            return Err(Errno::EBADF);
        };
        let end = (offset as usize)
            .checked_add(data.len())
            .ok_or(Errno::EFBIG)?;
        if end > MAX_CHUNK_BYTES {
            return Err(Errno::EFBIG);
        }
        if buf.len() < end {
            buf.resize(end, 0);
        }
        buf[offset as usize..end].copy_from_slice(data);
        *dirty = true;
        Ok(data.len() as u32)
    }

    fn truncate(&self, node: Node, fh: Option<FileHandle>, size: u64) -> Result<(), Errno> {
        let Node::Chunk(c, i) = node else {
            return Err(Errno::EPERM);
        };
        if self.read_only {
            return Err(Errno::EROFS);
        }
        if size as usize > MAX_CHUNK_BYTES {
            return Err(Errno::EFBIG);
        }
        let mut handles = lock(&self.handles);
        let target = handles.iter_mut().find(|(k, h)| {
            matches!(h, Handle::Write { ctx, index, .. } if *ctx == c && *index == i)
                && fh.is_none_or(|f| f.0 == **k)
        });
        match target {
            Some((_, Handle::Write { buf, dirty, .. })) => {
                buf.resize(size as usize, 0);
                *dirty = true;
                Ok(())
            }
            // Chunks change only through an open file, committed whole.
            _ => Err(Errno::EPERM),
        }
    }

    /// Writes a dirty handle's bytes to the store as the chunk's new version.
    fn commit(&self, fh: FileHandle) -> Result<(), Errno> {
        let (ctx, index, buf) = {
            let mut handles = lock(&self.handles);
            match handles.get_mut(&fh.0) {
                Some(Handle::Write {
                    ctx,
                    index,
                    buf,
                    dirty: dirty @ true,
                    ..
                }) => {
                    *dirty = false;
                    (*ctx, *index, std::mem::take(buf))
                }
                // `kv` writes commit as each image completes; nothing waits for a close.
                Some(_) => return Ok(()),
                None => return Err(Errno::EBADF),
            }
        };
        let (pf, pd) = lock(&self.pending)
            .get(&(ctx, index))
            .copied()
            .unwrap_or((None, None));
        let (old_f, old_d) = match self.store.chunk_state(ctx, index) {
            Ok(ChunkState::Stored(s)) => (Some(s.format), Some(s.density)),
            _ => (None, None),
        };
        let format = pf.or(old_f).unwrap_or(KvFormat::Int8);
        let density = pd.or(old_d).unwrap_or(0.0);
        let result = self.store.meta(ctx).and_then(|m| {
            self.store
                .write_chunk(ctx, index, &m.fingerprint, format, density, &buf)
        });
        let mut handles = lock(&self.handles);
        if let Some(Handle::Write { buf: b, dirty, .. }) = handles.get_mut(&fh.0) {
            *b = buf;
            if result.is_err() {
                *dirty = true;
            }
        }
        drop(handles);
        match result {
            Ok(_) => {
                lock(&self.pending).remove(&(ctx, index));
                Ok(())
            }
            Err(e) => {
                tracing::warn!(error = %e, "kvfs write through the mount failed");
                Err(errno(&e))
            }
        }
    }

    fn xattr_value(&self, uid: u32, node: Node, name: &OsStr) -> Result<Vec<u8>, Errno> {
        let Node::Chunk(c, i) = node else {
            return Err(Errno::from_i32(libc::ENODATA));
        };
        self.owner(uid, c)?;
        let pending = lock(&self.pending).get(&(c, i)).copied();
        let state = self.store.chunk_state(c, i).map_err(store_err)?;
        let stored = match &state {
            ChunkState::Stored(s) => Some(s.clone()),
            _ => None,
        };
        let v = match name.to_str().unwrap_or("") {
            "user.kvfs.format" => pending
                .and_then(|p| p.0)
                .or(stored.as_ref().map(|s| s.format))
                .map(|f| f.name().to_owned()),
            "user.kvfs.density" => pending
                .and_then(|p| p.1)
                .or(stored.as_ref().map(|s| s.density))
                .map(|d| d.to_string()),
            "user.kvfs.state" => Some(state.name().to_owned()),
            "user.kvfs.codec" => stored.as_ref().map(|s| s.codec.name().to_owned()),
            "user.kvfs.generation" => stored.as_ref().map(|s| s.generation.to_string()),
            "user.kvfs.raw_bytes" => stored.as_ref().map(|s| s.raw_len.to_string()),
            "user.kvfs.stored_bytes" => stored.as_ref().map(|s| s.stored_len.to_string()),
            "user.kvfs.written" => stored.as_ref().and_then(|s| s.written).map(crate::utc),
            "user.kvfs.resident" => self
                .store
                .resident(c, i)
                .map(|r| if r { "yes" } else { "no" }.to_owned()),
            _ => None,
        };
        v.map(String::into_bytes)
            .ok_or(Errno::from_i32(libc::ENODATA))
    }

    fn set_xattr(&self, uid: u32, node: Node, name: &OsStr, value: &[u8]) -> Result<(), Errno> {
        let Node::Chunk(c, i) = node else {
            return Err(Errno::ENOTSUP);
        };
        if self.read_only {
            return Err(Errno::EROFS);
        }
        self.owner(uid, c)?;
        let value = std::str::from_utf8(value)
            .map_err(|_| Errno::EINVAL)?
            .trim_end_matches('\0');
        let mut pending = lock(&self.pending);
        let entry = pending.entry((c, i)).or_default();
        match name.to_str().unwrap_or("") {
            "user.kvfs.format" => entry.0 = Some(value.parse().map_err(|_| Errno::EINVAL)?),
            "user.kvfs.density" => {
                let d: f32 = value.trim().parse().map_err(|_| Errno::EINVAL)?;
                entry.1 = Some(d);
            }
            _ => return Err(Errno::ENOTSUP),
        }
        drop(pending);
        // The label is part of what a write commits: open writers of the chunk commit again.
        for h in lock(&self.handles).values_mut() {
            if let Handle::Write {
                ctx, index, dirty, ..
            } = h
                && (*ctx, *index) == (c, i)
            {
                *dirty = true;
            }
        }
        Ok(())
    }
}

fn parse_index(name: &str) -> Result<u32, Errno> {
    // Only the canonical decimal spelling, so each chunk has exactly one name.
    let i: u32 = name.parse().map_err(|_| Errno::ENOENT)?;
    if i.to_string() != name || i > MAX_INDEX {
        return Err(Errno::ENOENT);
    }
    Ok(i)
}

fn attr(node: Node, kind: FileType, perm: u16, uid: u32, size: u64, time: SystemTime) -> FileAttr {
    FileAttr {
        ino: node.ino(),
        size,
        blocks: size.div_ceil(512),
        atime: time,
        mtime: time,
        ctime: time,
        crtime: time,
        kind,
        perm,
        nlink: if kind == FileType::Directory { 2 } else { 1 },
        uid,
        gid: if uid == 0 { 0 } else { uid },
        rdev: 0,
        flags: 0,
        blksize: 4096,
    }
}

fn node_or_enoent(ino: INodeNo) -> Result<Node, Errno> {
    Node::of(ino).ok_or(Errno::ENOENT)
}

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
            lock(&self.handles).get(&fh.0),
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
        let handle = lock(&self.handles).remove(&fh.0);
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

/// How to mount.
#[derive(Clone, Debug)]
pub struct MountConfig {
    /// Refuse every write (EROFS), and mount with `ro`.
    pub read_only: bool,
    /// FUSE worker threads, each reading its own cloned `/dev/fuse` descriptor: as many as the
    /// parallel requests the daemon serves (chunk writes, and reads where `data` is not passed
    /// through; each blocks on its chunk's disk I/O).
    pub threads: usize,
    /// Let the kernel cache context directories' attributes for a second. This saves two
    /// `getattr` round trips per chunk open (the kernel checks permissions on each directory of
    /// the path), but within that second a uid that does not own a context, and guesses its id,
    /// can `stat` its directory (it still cannot list or read it). Off by default.
    pub cache_dir_attrs: bool,
    /// Pass `data` files (opened with `O_DIRECT`, read-only) through to the context's data file
    /// (FUSE passthrough): the kernel then serves their reads without a request to the daemon,
    /// and the reader checks each chunk itself ([`crate::MountReader`]). Needs `CAP_SYS_ADMIN`
    /// and a kernel with `CONFIG_FUSE_PASSTHROUGH`; without either, the daemon serves them. On by
    /// default.
    pub passthrough: bool,
}

impl Default for MountConfig {
    fn default() -> Self {
        MountConfig {
            read_only: false,
            threads: 4,
            cache_dir_attrs: false,
            passthrough: true,
        }
    }
}

/// What went wrong mounting or unmounting.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error("{path} is already a live mount; unmount it first (umount {path})")]
    AlreadyMounted { path: PathBuf },
    #[error("cannot clean up the stale mount at {path}: {source}")]
    Stale { path: PathBuf, source: nix::Error },
    #[error("mount point {path}: {source}")]
    MountPoint {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("mount {path}: {source} (is /dev/fuse there and are we root?)")]
    Mount {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("unmount {path}: {source}")]
    Unmount {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// A live mount; dropping it unmounts (also while a panic unwinds, so tests never leak mounts).
pub struct Mount {
    session: Option<BackgroundSession>,
    path: PathBuf,
    guard: Option<crate::guard::Guard>,
    counters: Arc<MountCounters>,
}

impl std::fmt::Debug for Mount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mount")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl Mount {
    /// What moved through this mount's `kv` files.
    pub fn counters(&self) -> &MountCounters {
        &self.counters
    }

    /// Where the store is mounted.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Starts a guard process ([`crate::guard`]) that aborts this mount's FUSE connection if this
    /// process dies, for a process that also does I/O through its own mount. Call it from a thread
    /// that lives as long as the process.
    pub fn guard(
        &mut self,
        cmd: &crate::guard::GuardCommand,
    ) -> Result<(), crate::guard::GuardError> {
        self.guard = Some(crate::guard::spawn(cmd, &self.path)?);
        Ok(())
    }

    /// Unmounts and waits for the FUSE threads to finish.
    pub fn unmount(mut self) -> Result<(), MountError> {
        self.unmount_inner()
    }

    fn unmount_inner(&mut self) -> Result<(), MountError> {
        // The guard goes first: it must not abort a connection that is being closed cleanly.
        self.guard = None;
        let unmounted = self.session.is_some() && self.unmount_when_idle();
        match self.session.take() {
            // The FUSE threads end once the kernel drops the connection.
            Some(s) if unmounted => s.join().map_err(|source| MountError::Unmount {
                path: self.path.clone(),
                source,
            }),
            Some(s) => s.umount_and_join().map_err(|source| MountError::Unmount {
                path: self.path.clone(),
                source,
            }),
            None => Ok(()),
        }
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if let Err(e) = self.unmount_inner() {
            tracing::warn!(error = %e, "kvfs unmount failed");
        }
    }
}

impl Mount {
    /// Unmounts as soon as the mount is not busy, waiting up to `UNMOUNT_PATIENCE`.
    ///
    /// A descriptor on the mount can outlive its `close` for a moment: a process forked by another
    /// thread holds a copy until its `exec` closes it. The kernel answers EBUSY during that window,
    /// so a busy mount is retried briefly; one still busy after the wait (a shell sitting in it, a
    /// reader that never closes) is left to fuser, whose error names the mount point. Without the
    /// right to unmount (EPERM, not root), fuser goes through `fusermount` instead. Returns whether
    /// it unmounted.
    fn unmount_when_idle(&self) -> bool {
        let deadline = std::time::Instant::now() + UNMOUNT_PATIENCE;
        loop {
            match nix::mount::umount2(&self.path, nix::mount::MntFlags::empty()) {
                Err(nix::errno::Errno::EBUSY) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10));
                }
                Ok(()) => {
                    tracing::debug!(path = %self.path.display(), "kvfs unmounted");
                    return true;
                }
                Err(_) => return false,
            }
        }
    }
}

/// How long an unmount waits for a busy mount to become idle.
const UNMOUNT_PATIENCE: Duration = Duration::from_secs(2);

/// Whether `path` is currently a mount point (from /proc/self/mountinfo).
fn is_mount_point(path: &Path) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let want = path.to_string_lossy();
    // Field 5 is the mount point, with spaces and such escaped as octal.
    info.lines().filter_map(|l| l.split(' ').nth(4)).any(|mp| {
        mp.replace("\\040", " ")
            .replace("\\011", "\t")
            .replace("\\134", "\\")
            == want
    })
}

/// Detects a mount left behind by a killed server (its mount point answers ENOTCONN) and detaches it;
/// refuses a mount point that is live.
pub fn clean_stale_mount(mountpoint: &Path) -> Result<(), MountError> {
    let path = mountpoint.to_owned();
    match std::fs::metadata(mountpoint) {
        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => {
            nix::mount::umount2(mountpoint, nix::mount::MntFlags::MNT_DETACH).map_err(
                |source| MountError::Stale {
                    path: path.clone(),
                    source,
                },
            )?;
            tracing::warn!(path = %path.display(), "detached a stale kvfs mount left by a killed process");
            Ok(())
        }
        Err(source) => Err(MountError::MountPoint { path, source }),
        Ok(m) if !m.is_dir() => Err(MountError::MountPoint {
            path,
            source: std::io::Error::new(std::io::ErrorKind::NotADirectory, "not a directory"),
        }),
        Ok(_) if is_mount_point(&std::fs::canonicalize(mountpoint).unwrap_or(path.clone())) => {
            Err(MountError::AlreadyMounted { path })
        }
        Ok(_) => Ok(()),
    }
}

/// Mounts `store` at `mountpoint` (cleaning up a stale mount first) and serves it on background
/// threads until the returned [`Mount`] is dropped.
pub fn mount(
    store: Arc<Store>,
    mountpoint: &Path,
    config: &MountConfig,
) -> Result<Mount, MountError> {
    clean_stale_mount(mountpoint)?;
    let mut options = vec![
        MountOption::FSName(format!("kvfs:{}", store.root().display())),
        MountOption::Subtype("kvfs".to_owned()),
        MountOption::DefaultPermissions,
        MountOption::NoAtime,
        MountOption::NoDev,
        MountOption::NoSuid,
        MountOption::NoExec,
    ];
    options.push(if config.read_only {
        MountOption::RO
    } else {
        MountOption::RW
    });
    let mut cfg = Config::default();
    cfg.mount_options = options;
    // Other uids must reach the filesystem so the kernel can apply `default_permissions` to them.
    cfg.acl = SessionACL::All;
    cfg.n_threads = Some(config.threads.max(1));
    cfg.clone_fd = true;
    let mut fs = KvFs::new(store, config.read_only, config.cache_dir_attrs);
    let counters = Arc::clone(&fs.counters);
    fs.passthrough = config.passthrough && nix::unistd::geteuid().is_root();
    let session = fuser::spawn_mount(fs, mountpoint, &cfg).map_err(|source| MountError::Mount {
        path: mountpoint.to_owned(),
        source,
    })?;
    tracing::info!(path = %mountpoint.display(), read_only = config.read_only, "kvfs mounted");
    Ok(Mount {
        session: Some(session),
        path: mountpoint.to_owned(),
        guard: None,
        counters,
    })
}

/// Blocks SIGINT and SIGTERM in this thread and the threads it spawns afterwards; call before
/// [`mount`], then [`wait_for_termination`] to unmount cleanly on either signal.
pub fn block_termination_signals() -> Result<nix::sys::signal::SigSet, nix::Error> {
    use nix::sys::signal::{SigSet, Signal};
    let mut set = SigSet::empty();
    set.add(Signal::SIGINT);
    set.add(Signal::SIGTERM);
    set.thread_block()?;
    Ok(set)
}

/// Waits for one of the signals blocked by [`block_termination_signals`].
pub fn wait_for_termination(
    set: &nix::sys::signal::SigSet,
) -> Result<nix::sys::signal::Signal, nix::Error> {
    set.wait()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inode_numbers_round_trip() {
        let c = ContextId(7);
        for n in [
            Node::Root,
            Node::Stats,
            Node::Dir(c),
            Node::Chunks(c),
            Node::Info(c),
            Node::Text(c),
            Node::Tokens(c),
            Node::Kv(c),
            Node::Data(c),
            Node::Chunk(c, 0),
            Node::Chunk(ContextId(u32::MAX as u64), MAX_INDEX),
        ] {
            assert_eq!(Node::of(n.ino()), Some(n));
        }
        assert_eq!(Node::of(INodeNo(3)), None);
        assert_eq!(Node::of(INodeNo((5 << 32) | 9)), None);
    }

    #[test]
    fn chunk_names_are_canonical() {
        assert_eq!(parse_index("12"), Ok(12));
        for bad in ["012", "+1", "x", "", "-1", "99999999999"] {
            assert_eq!(parse_index(bad), Err(Errno::ENOENT), "{bad}");
        }
    }
}
