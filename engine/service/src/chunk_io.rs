//! How chunk bytes move between the service and kvfs: through the service's kvfs mount, the data
//! path people can inspect (DESIGN.md, kvfs), or straight through the store's API where there is no
//! mount (the store works alone; tests that run without FUSE say why).
//!
//! Through the mount, each context's `data` and `kv` files are opened once and kept: a chunk read
//! is one `O_DIRECT` `preadv` of `data` into the caller's buffer, which the kernel passes through
//! to the context's data file (FUSE passthrough; the daemon serves it where the kernel cannot),
//! and a chunk write one `pwritev` of `kv` that the mount commits crash-safely before it returns. The open files are bounded
//! ([`MAX_OPEN_FILES`]); the least recently used is closed first. Both paths run every check of the
//! store (crc, identity, model, the generation the store names) and neither allocates per read.

use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvfs::guard::GuardCommand;
use kvfs::{
    ContextId, Fingerprint, KvFormat, Mount, MountConfig, MountReader, RawSlot, Store, StoreError,
    StoredChunk,
};
use lru::LruCache;
use parking_lot::Mutex;

use crate::ServiceError;
use crate::chunks::StoredCopy;
use uffd_pager::ChunkKey;

/// Contexts whose mount files are kept open at most; a daemon holds them for its recently used contexts.
pub const MAX_OPEN_FILES: usize = 256;

/// Each context's open mount files, the least recently used closed first past [`MAX_OPEN_FILES`].
type OpenFiles = LruCache<u64, Arc<MountReader>>;

fn open_files() -> Mutex<OpenFiles> {
    Mutex::new(LruCache::new(
        NonZeroUsize::new(MAX_OPEN_FILES).expect("MAX_OPEN_FILES is not zero"),
    ))
}

/// Reads and writes chunks of one store for one model.
pub struct ChunkIo {
    // Declared before `route`: open files close before the mount goes.
    files: Mutex<OpenFiles>,
    store: Arc<Store>,
    fingerprint: Fingerprint,
    route: Route,
}

/// Where chunk bytes go.
enum Route {
    Direct,
    Mount(Mount),
}

impl std::fmt::Debug for ChunkIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkIo")
            .field("mountpoint", &self.mountpoint())
            .finish_non_exhaustive()
    }
}

impl ChunkIo {
    /// Chunk I/O straight through the store's API.
    pub fn direct(store: Arc<Store>, fingerprint: Fingerprint) -> ChunkIo {
        ChunkIo {
            files: open_files(),
            store,
            fingerprint,
            route: Route::Direct,
        }
    }

    /// Mounts `store` at `mountpoint` (created if missing; a stale mount of a killed daemon is
    /// cleaned first) and moves every chunk through it. With `guard`, a guard process
    /// ([`kvfs::guard`]) keeps a `kill -9` of this process from hanging on its own mount: call
    /// this from a thread that lives as long as the process.
    pub fn mounted(
        store: Arc<Store>,
        fingerprint: Fingerprint,
        mountpoint: &Path,
        guard: Option<&GuardCommand>,
    ) -> Result<ChunkIo, ServiceError> {
        let failed = |what: String| ServiceError::Internal {
            what: format!("{what} (serve without a mount with --no-mount)"),
        };
        // A dead mount of a killed daemon answers ENOTCONN, not NotFound: kvfs::mount cleans it.
        if matches!(std::fs::metadata(mountpoint), Err(e) if e.kind() == std::io::ErrorKind::NotFound)
        {
            std::fs::create_dir_all(mountpoint).map_err(|e| {
                failed(format!(
                    "creating the mount point {}: {e}",
                    mountpoint.display()
                ))
            })?;
        }
        let mut mount = kvfs::mount(Arc::clone(&store), mountpoint, &MountConfig::default())
            .map_err(|e| failed(format!("mounting kvfs at {}: {e}", mountpoint.display())))?;
        if let Some(g) = guard {
            mount.guard(g).map_err(|e| failed(e.to_string()))?;
        }
        tracing::info!(mountpoint = %mountpoint.display(), "kvfs mounted");
        Ok(ChunkIo {
            files: open_files(),
            store,
            fingerprint,
            route: Route::Mount(mount),
        })
    }

    /// Where the store is mounted, if it is.
    pub fn mountpoint(&self) -> Option<&Path> {
        match &self.route {
            Route::Direct => None,
            Route::Mount(m) => Some(m.path()),
        }
    }

    /// The store underneath (metadata, tokens, contexts).
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// Reads chunk `index` of context `ctx` into the front of `buf` with every check; its bytes
    /// are `buf[..meta.raw_len]`. Errors as [`Store::read_chunk_into`].
    pub fn read_into(
        &self,
        ctx: u64,
        index: u32,
        buf: &mut [u8],
    ) -> Result<StoredChunk, StoreError> {
        match &self.route {
            Route::Direct => {
                self.store
                    .read_chunk_into(ContextId(ctx), index, &self.fingerprint, buf)
            }
            Route::Mount(_) => self.file(ctx)?.read_chunk_into(&self.store, index, buf),
        }
    }

    /// Where chunk `index` of `ctx` lies, for a caller that reads it with direct reads of its
    /// own, many in flight at once (the Load's io_uring): the open `data` file of the mount and the
    /// slot in it. `None` when the chunk cannot be read that way (no mount, a payload not stored
    /// raw, not stored at all): read it with [`ChunkIo::read_into`], which also says why it fails.
    pub fn raw_slot(&self, ctx: u64, index: u32) -> Option<(Arc<MountReader>, RawSlot)> {
        if matches!(self.route, Route::Direct) {
            return None;
        }
        let file = self.file(ctx).ok()?;
        let slot = file.raw_slot(&self.store, index).ok()??;
        Some((file, slot))
    }

    /// Writes chunk `index` of `ctx` durably (its tokens must be stored already).
    pub fn write(
        &self,
        ctx: u64,
        index: u32,
        format: KvFormat,
        density: f32,
        data: &[u8],
    ) -> Result<(), StoreError> {
        match &self.route {
            Route::Direct => self
                .store
                .write_chunk(
                    ContextId(ctx),
                    index,
                    &self.fingerprint,
                    format,
                    density,
                    data,
                )
                .map(|_| ()),
            Route::Mount(_) => self.file(ctx)?.write_chunk(index, format, density, data),
        }
    }

    /// What the store holds of chunk `key` now, as the service's book records it.
    pub fn stored_copy(&self, key: ChunkKey) -> Option<StoredCopy> {
        match self.store.chunk_state(key.ctx, key.index) {
            Ok(kvfs::StoreState::Stored(s)) => Some(StoredCopy::from(&s)),
            _ => None,
        }
    }

    /// Closes `ctx`'s file (call it when the context is deleted).
    pub fn forget(&self, ctx: u64) {
        self.files.lock().pop(&ctx);
    }

    /// The open mount files of `ctx`, opened now if it is not.
    fn file(&self, ctx: u64) -> Result<Arc<MountReader>, StoreError> {
        let Route::Mount(mount) = &self.route else {
            unreachable!("only the mounted path opens files")
        };
        let mut open = self.files.lock();
        if let Some(f) = open.get(&ctx) {
            return Ok(Arc::clone(f));
        }
        // Opening is a few FUSE round trips, served by the mount's own threads: never by this
        // one, so holding the lock over it only orders opens.
        let f = Arc::new(MountReader::open_rw(
            mount.path(),
            ContextId(ctx),
            self.fingerprint,
        )?);
        open.put(ctx, Arc::clone(&f));
        Ok(f)
    }
}

/// The default mount point beside a socket: `<socket's directory>/kv`.
pub fn default_mountpoint(socket: &Path) -> PathBuf {
    socket.parent().unwrap_or_else(|| Path::new(".")).join("kv")
}
