//! The filesystem's state: the store it serves, its open handles (snapshots, chunks being written,
//! `kv` images being gathered), passthrough registrations, xattr labels not yet committed, and
//! the counters `/stats` shows.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{BackingId, Errno, FileHandle};
use parking_lot::Mutex;

use crate::format::KvFormat;
use crate::store::{ContextId, Store, StoreError};

pub(super) enum Handle {
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
pub(super) struct Partial {
    pub(super) index: u32,
    pub(super) image: Vec<u8>,
    pub(super) filled: usize,
}

/// A chunk's format and density set through xattrs, not yet committed.
pub(super) type Label = (Option<KvFormat>, Option<f32>);

/// The filesystem; mount it with [`mount`](crate::fs::mount).
pub struct KvFs {
    pub(super) store: Arc<Store>,
    pub(super) read_only: bool,
    pub(super) cache_dir_attrs: bool,
    /// Whether `data` files are passed through to the contexts' data files: asked for in the
    /// config, and granted by the kernel at `init`.
    pub(super) passthrough: bool,
    /// The kernel's registration of each data file with open passthrough handles, and how many
    /// hold it: every passthrough open of one inode must name the same backing file.
    pub(super) backing: Mutex<HashMap<ContextId, (Arc<BackingId>, usize)>>,
    pub(super) handles: Mutex<HashMap<u64, Handle>>,
    pub(super) next_fh: AtomicU64,
    /// `user.kvfs.format` / `user.kvfs.density` set on a chunk, applied at its next commit.
    pub(super) pending: Mutex<HashMap<(ContextId, u32), Label>>,
    pub(super) counters: Arc<MountCounters>,
}

/// What moved through a mount's `kv` files (shown in `/stats`; [`Mount::counters`](crate::fs::Mount::counters)).
#[derive(Debug, Default)]
pub struct MountCounters {
    /// Chunk slots the daemon served through `kv` and `data` files (reads it saw at a slot's start).
    pub kv_reads: AtomicU64,
    /// Chunk images committed through `kv` files.
    pub kv_writes: AtomicU64,
    /// `data` opens passed through to the data file: their reads never reach the daemon.
    pub passthrough_opens: AtomicU64,
}

/// The errno a store error becomes at the filesystem boundary.
pub(super) fn errno(e: &StoreError) -> Errno {
    match e {
        StoreError::NoSuchContext { .. } | StoreError::ChunkMissing { .. } => Errno::ENOENT,
        StoreError::Corrupt { .. } | StoreError::ForeignModel { .. } => Errno::EIO,
        StoreError::BeyondTokens { .. } | StoreError::Invalid { .. } => Errno::EINVAL,
        StoreError::TooLarge { .. } => Errno::EFBIG,
        StoreError::BufferTooSmall { .. } => Errno::ERANGE,
        StoreError::NotAStore { .. } => Errno::EIO,
        StoreError::Locked { .. } | StoreError::Referenced { .. } => Errno::EBUSY,
        StoreError::ReadOnly { .. } => Errno::EROFS,
        StoreError::Io(io) => io.source.raw_os_error().map_or(Errno::EIO, Errno::from_i32),
    }
}

pub(super) fn store_err(e: StoreError) -> Errno {
    tracing::debug!(error = %e, "kvfs request failed");
    errno(&e)
}

impl KvFs {
    /// A filesystem over `store`; with `read_only` every write is refused with EROFS; see
    /// [`MountConfig::cache_dir_attrs`](crate::fs::MountConfig::cache_dir_attrs).
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

    /// The owner of a context if `uid` may see it (its owner, or root), else ENOENT.
    pub(super) fn owner(&self, uid: u32, ctx: ContextId) -> Result<(u32, SystemTime), Errno> {
        let (owner, created) = self.store.owner(ctx).map_err(store_err)?;
        if uid != 0 && uid != owner {
            return Err(Errno::ENOENT);
        }
        Ok((owner, UNIX_EPOCH + Duration::from_secs(created)))
    }

    pub(super) fn add_handle(&self, h: Handle) -> FileHandle {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.handles.lock().insert(fh, h);
        FileHandle(fh)
    }

    pub(super) fn pending_write_len(&self, ctx: ContextId, index: u32) -> Option<usize> {
        self.handles.lock().values().find_map(|h| match h {
            Handle::Write {
                ctx: c,
                index: i,
                buf,
                ..
            } if *c == ctx && *i == index => Some(buf.len()),
            _ => None,
        })
    }

    /// The bytes of a handle: shared for read handles (no copy), copied for write handles.
    pub(super) fn handle_bytes(&self, fh: FileHandle) -> Result<Arc<Vec<u8>>, Errno> {
        match self.handles.lock().get(&fh.0).ok_or(Errno::EBADF)? {
            Handle::Read(b) => Ok(b.clone()),
            Handle::Write { buf, .. } => Ok(Arc::new(buf.clone())),
            Handle::Kv { .. } | Handle::Passthrough(_) | Handle::Data => Err(Errno::EBADF),
        }
    }

    /// The `kv` file's length: the data file's.
    pub(super) fn kv_len(&self, c: ContextId) -> Result<u64, Errno> {
        self.store.fingerprint(c).map_err(store_err)?;
        std::fs::metadata(self.store.data_path(c))
            .map(|m| m.len())
            .map_err(|e| Errno::from_i32(e.raw_os_error().unwrap_or(libc::EIO)))
    }

    /// `/stats`: the store's counters, then the chunks that moved through `kv` files.
    pub(super) fn stats_text(&self) -> String {
        let c = &self.counters;
        format!(
            "{}kv file      {} chunk reads by the daemon, {} passthrough opens, {} chunk writes\n",
            self.store.render_stats(),
            c.kv_reads.load(Ordering::Relaxed),
            c.passthrough_opens.load(Ordering::Relaxed),
            c.kv_writes.load(Ordering::Relaxed)
        )
    }
}
