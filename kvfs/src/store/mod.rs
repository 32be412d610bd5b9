//! The chunk store: a directory of contexts, each with its metadata, its tokens and one data file
//! that holds its chunks.
//!
//! Layout under the store root:
//! `KVFS` (marker), `contexts/<id>/{meta,tokens,data,transcript,link,shared}` (`transcript` only
//! once the service wrote one: opaque bytes to kvfs; `link` when the context borrows its first
//! chunks from a shared prefix, `shared` marking a shared prefix), `staging/` (contexts being created or rebuilt),
//! `trash/` (contexts being deleted) and `quarantine/` (chunks and files that failed their checks).
//! `meta`, `tokens` and `transcript` are replaced atomically (see [`crate::io::write_atomic`]). In `data`, chunk
//! `i` has two slots ([`slot_offset`]): a rewrite goes to the slot the chunk does not occupy, its
//! payload made durable before its header, so after a crash at any point the newest complete copy
//! is the one with the highest generation. [`Store::open`] scans the store and recovers from any
//! crash point, quarantining what fails its checks.
//!
//! This file holds the store's vocabulary (constants, errors, chunk and context metadata), the
//! [`Store`] and its per-context state, and the lookups every operation shares. The operations are
//! `impl Store` blocks in the files beside it, each using only this one (and `open.rs` the data
//! file helpers of `contexts.rs`): `open.rs` (open and recovery), `contexts.rs` (contexts created,
//! rebuilt and deleted, the `meta`, `tokens` and `transcript` files), `links.rs` (shared prefixes:
//! links made, checked and dropped, a prefix no context uses removed), `write.rs` (chunk writes), `read.rs` (checked chunk
//! reads, and quarantine at read time) and `render.rs` (what people inspecting see).

mod contexts;
mod links;
mod open;
pub(crate) mod read;
mod render;
mod write;

use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::{Mutex, MutexGuard, RwLock};

use crate::format::{ChunkHeader, Codec, ContextMeta, Fingerprint, KvFormat, Link, tokens_crc};
use crate::io::{IoError, punch, write_atomic};

const MARKER: &str = "KVFS";
const MARKER_TEXT: &[u8] = b"kvfs store, format version 2\n";
/// The marker of a store made before the data file (one file per chunk); [`Store::open`] upgrades it.
const MARKER_TEXT_V1: &[u8] = b"kvfs store, format version 1\n";
/// Bytes of one slot of a context's data file: a header page, then room for the largest payload.
pub const SLOT_BYTES: u64 = 1 << 24;
/// Where a slot's payload starts: the 104-byte header has a page of its own, so payloads sit at
/// 4 KiB-aligned offsets and O_DIRECT reads land them straight in a caller's aligned buffer.
pub const HEADER_PAGE: usize = 4096;
/// The largest chunk the store accepts: a slot less its header page (16 MiB; a 16-token chunk of a
/// 70B model in f16 is 5 MiB).
pub const MAX_CHUNK_BYTES: usize = SLOT_BYTES as usize - HEADER_PAGE;
/// Chunk indices a context can hold: its data file then spans at most 8 TiB (ext4 allows 16).
pub const MAX_CHUNKS: u32 = 1 << 18;

/// Where slot `copy` (0 or 1) of chunk `index` starts in a context's data file (and in the mount's
/// `kv` file, which shows the data file offset for offset).
pub fn slot_offset(index: u32, copy: u8) -> u64 {
    (2 * index as u64 + (copy & 1) as u64) * SLOT_BYTES
}
/// The longest app name.
pub const MAX_APP_LEN: usize = 255;

/// The id of a context, unique within its store (the one id type the pager and the service use).
pub use ids::ContextId;

pub use contexts::Seed;

/// Turns a context's token ids into its text for the context's `text` file: registered by the
/// service (or `llms kvfs mount --model`) for one model, with [`Store::set_decoder`].
pub type Decoder = Arc<dyn Fn(&[u32]) -> String + Send + Sync>;

/// Which chunks of a context are resident in the memory of the process that serves it: chunk `i`
/// is iff the answer's element `i` is `true`; `None` when that process does not know (the context
/// is not loaded, or it cannot tell now). Registered by the service, whose pager knows, with
/// [`Store::set_residency`]; kvfs itself never does. It is asked from the mount's threads, so it
/// must answer promptly.
pub type Residency = Arc<dyn Fn(ContextId) -> Option<Vec<bool>> + Send + Sync>;

/// How a context's `text` is shown, given the decoder registered and the context's model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TextView {
    /// Decoded by the decoder registered for the context's model.
    Decoded,
    /// No decoder is registered: `text` says so and points at `tokens`.
    NoDecoder,
    /// The decoder registered is another model's (`loaded`): never used on this context.
    OtherModel { loaded: Fingerprint },
}

/// What went wrong in a store operation.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    Io(#[from] IoError),
    #[error(
        "{path} is not a kvfs store (it has no {MARKER} marker file); a new store needs a new or empty directory"
    )]
    NotAStore { path: PathBuf },
    #[error("no context {context} in the store")]
    NoSuchContext { context: ContextId },
    #[error("chunk {index} of context {context} is not in the store; recompute it")]
    ChunkMissing { context: ContextId, index: u32 },
    #[error(
        "chunk {index} of context {context} is corrupt ({reason}); it was quarantined, recompute it"
    )]
    Corrupt {
        context: ContextId,
        index: u32,
        reason: String,
    },
    #[error("context {context} belongs to model {found}, not to model {expected}")]
    ForeignModel {
        context: ContextId,
        expected: Fingerprint,
        found: Fingerprint,
    },
    #[error(
        "chunk {index} of context {context} starts at token {start} but the context has {tokens} tokens; \
         store the tokens first"
    )]
    BeyondTokens {
        context: ContextId,
        index: u32,
        start: u64,
        tokens: usize,
    },
    #[error(
        "chunk {index} of context {context} is {need} bytes, the buffer given for it only {have}"
    )]
    BufferTooSmall {
        context: ContextId,
        index: u32,
        need: usize,
        have: usize,
    },
    #[error("chunk of {len} bytes is larger than the {MAX_CHUNK_BYTES}-byte limit")]
    TooLarge { len: usize },
    #[error("the store at {path} is in use by another process; open it read-only to inspect it")]
    Locked { path: PathBuf },
    #[error("the store at {path} is open read-only")]
    ReadOnly { path: PathBuf },
    #[error("invalid {what}: {why}")]
    Invalid { what: &'static str, why: String },
    #[error("context {context} is a shared prefix that {referrers} context(s) still use")]
    Referenced {
        context: ContextId,
        referrers: usize,
    },
}

impl StoreError {
    /// Whether the caller should recompute the chunk from its tokens (the data is not available).
    pub fn needs_recompute(&self) -> bool {
        matches!(
            self,
            StoreError::ChunkMissing { .. }
                | StoreError::Corrupt { .. }
                | StoreError::ForeignModel { .. }
        )
    }
}

/// How the store compresses and checks.
#[derive(Clone, Debug)]
pub struct StoreOptions {
    /// zstd level for payloads (1 is the fastest).
    pub zstd_level: i32,
    /// Keep the zstd payload only when raw/stored is at least this (else store raw).
    /// `f64::INFINITY` disables compression.
    pub min_ratio: f64,
    /// Check every chunk's payload checksum at open, not only its header and length.
    pub verify_on_open: bool,
    /// Open for inspection only: never create, repair, quarantine or write anything, so a store in
    /// use by a running service can be looked at safely (files failing checks are reported and
    /// not served, but left in place).
    pub read_only: bool,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            zstd_level: 1,
            min_ratio: 1.25,
            verify_on_open: false,
            read_only: false,
        }
    }
}

/// The parameters of a new context.
#[derive(Clone, Debug)]
pub struct NewContext {
    pub owner_uid: u32,
    pub app: String,
    pub fingerprint: Fingerprint,
    /// Tokens per chunk (16 by default in the service).
    pub chunk_tokens: u32,
}

/// A stored chunk's metadata (from its header).
#[derive(Clone, Debug, PartialEq)]
pub struct StoredChunk {
    pub format: KvFormat,
    pub codec: Codec,
    pub density: f32,
    pub raw_len: u32,
    pub stored_len: u32,
    pub generation: u64,
    /// Which of the chunk's two slots in the data file holds it ([`slot_offset`]).
    pub copy: u8,
    /// The tokens the chunk was computed from (shorter than the chunk's span while it is the last,
    /// partial chunk).
    pub tokens: Range<u32>,
    /// crc32c of those tokens' ids.
    pub tokens_crc: u32,
    /// When the store wrote this copy, in seconds since the Unix epoch (`None` for a chunk written
    /// before headers recorded it).
    pub written: Option<u64>,
}

/// The state of one chunk slot of a context.
#[derive(Clone, Debug, PartialEq, strum::IntoStaticStr)]
#[strum(serialize_all = "lowercase")]
pub enum StoreState {
    /// In the store, readable.
    Stored(StoredChunk),
    /// Never written, or dropped because its tokens changed: recompute.
    Missing,
    /// Its file failed a check and was moved to `quarantine/`: recompute.
    Quarantined { reason: String },
}

impl StoreState {
    /// A short name for listings.
    pub fn name(&self) -> &'static str {
        self.into()
    }
}

/// One chunk slot of a context.
#[derive(Clone, Debug, PartialEq)]
pub struct ChunkMeta {
    pub index: u32,
    /// The token span of the slot given the context's current tokens.
    pub span: Range<u32>,
    pub state: StoreState,
}

/// A context's metadata and the state of each of its chunks.
#[derive(Clone, Debug)]
pub struct StoredContext {
    pub id: ContextId,
    pub meta: ContextMeta,
    pub tokens: usize,
    pub chunks: Vec<ChunkMeta>,
}

/// A file recovery moved aside or removed, and why.
#[derive(Clone, Debug)]
pub struct Recovered {
    pub path: PathBuf,
    pub action: &'static str,
    pub reason: String,
}

/// Store-wide counters since open.
#[derive(Debug, Default)]
pub struct Counters {
    pub chunk_reads: AtomicU64,
    pub chunk_read_bytes: AtomicU64,
    pub chunk_writes: AtomicU64,
    pub chunk_write_raw_bytes: AtomicU64,
    pub chunk_write_stored_bytes: AtomicU64,
    pub corrupt_detected: AtomicU64,
}

struct Ctx {
    id: ContextId,
    meta: ContextMeta,
    dir: PathBuf,
    /// The data file, open for writing (read-only in a read-only store) and for buffered reads.
    data: File,
    /// The same file opened with O_DIRECT for reads, where the filesystem allows it.
    direct: Option<File>,
    /// A shared prefix (its `shared` marker): chunks other contexts borrow through their links;
    /// it lives while one does, and is never an app's context.
    shared: bool,
    /// Serializes every mutation of this context (tokens, chunks, link, delete).
    write: Mutex<()>,
    state: Mutex<CtxState>,
    deleted: AtomicBool,
}

#[derive(Default)]
struct CtxState {
    tokens: Vec<u32>,
    chunks: BTreeMap<u32, StoreState>,
    /// The prefix this context borrows from a shared-prefix context (its `link` file).
    link: Option<Link>,
}

/// The chunk store. Share it as `Arc<Store>`: every method takes `&self`.
pub struct Store {
    root: PathBuf,
    options: StoreOptions,
    direct: bool,
    contexts: RwLock<BTreeMap<ContextId, Arc<Ctx>>>,
    next_id: AtomicU64,
    next_generation: AtomicU64,
    decoder: RwLock<Option<(Fingerprint, Decoder)>>,
    residency: RwLock<Option<Residency>>,
    recovered: Vec<Recovered>,
    quarantined: AtomicU64,
    counters: Counters,
    /// An exclusive `flock` on the marker while open for writing: one writer per store, since
    /// recovery removes what another writer has in flight.
    _lock: Option<nix::fcntl::Flock<std::fs::File>>,
}

impl fmt::Debug for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Store")
            .field("root", &self.root)
            .finish_non_exhaustive()
    }
}

fn now_nanos() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

/// Now in whole seconds since the Unix epoch, as a chunk header records it (until 2106).
fn unix_seconds() -> u32 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u32::try_from(d.as_secs()).unwrap_or(u32::MAX))
}

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> IoError + 'a {
    move |e| IoError::new(op, path, e)
}

fn mkdir(path: &Path) -> Result<(), IoError> {
    match std::fs::create_dir(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(IoError::new("mkdir", path, e)),
    }
}

fn span(index: u32, chunk_tokens: u32, tokens: usize) -> Range<u32> {
    let start = (index as u64 * chunk_tokens as u64).min(u32::MAX as u64) as u32;
    let end = (start as u64 + chunk_tokens as u64).min(tokens as u64) as u32;
    start..end.max(start)
}

/// Whether a chunk computed from `range` of tokens (with crc `crc`) still matches `tokens`.
fn covers(tokens: &[u32], range: &Range<u32>, crc: u32) -> bool {
    range.start < range.end
        && (range.end as usize) <= tokens.len()
        && tokens_crc(&tokens[range.start as usize..range.end as usize]) == crc
}

impl Store {
    /// The store's root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Whether chunk reads bypass the page cache with O_DIRECT (else with fadvise).
    pub fn direct_io(&self) -> bool {
        self.direct
    }

    /// What recovery at open removed or quarantined.
    pub fn recovered(&self) -> &[Recovered] {
        &self.recovered
    }

    /// Counters since open.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    fn ctx(&self, id: ContextId) -> Result<Arc<Ctx>, StoreError> {
        let map = self.contexts.read();
        map.get(&id)
            .cloned()
            .ok_or(StoreError::NoSuchContext { context: id })
    }

    /// A context, if it belongs to the model `fingerprint` (else [`StoreError::ForeignModel`]).
    fn ctx_of_model(
        &self,
        id: ContextId,
        fingerprint: &Fingerprint,
    ) -> Result<Arc<Ctx>, StoreError> {
        let ctx = self.ctx(id)?;
        if *fingerprint != ctx.meta.fingerprint {
            return Err(StoreError::ForeignModel {
                context: id,
                expected: *fingerprint,
                found: ctx.meta.fingerprint,
            });
        }
        Ok(ctx)
    }

    fn writable(&self) -> Result<(), StoreError> {
        if self.options.read_only {
            return Err(StoreError::ReadOnly {
                path: self.root.clone(),
            });
        }
        Ok(())
    }

    fn write_lock<'a>(&self, ctx: &'a Ctx) -> Result<MutexGuard<'a, ()>, StoreError> {
        let w = ctx.write.lock();
        if ctx.deleted.load(Ordering::SeqCst) {
            return Err(StoreError::NoSuchContext { context: ctx.id });
        }
        Ok(w)
    }

    /// Every context's id, in id order.
    pub fn list_contexts(&self) -> Vec<ContextId> {
        self.contexts.read().keys().copied().collect()
    }

    /// A context's fixed metadata.
    pub fn meta(&self, id: ContextId) -> Result<ContextMeta, StoreError> {
        Ok(self.ctx(id)?.meta.clone())
    }

    /// A context's model fingerprint (no allocation, unlike [`Store::meta`]).
    pub fn fingerprint(&self, id: ContextId) -> Result<Fingerprint, StoreError> {
        Ok(self.ctx(id)?.meta.fingerprint)
    }

    /// A context's owner uid and creation time (seconds since the Unix epoch), without allocating.
    pub fn owner(&self, id: ContextId) -> Result<(u32, u64), StoreError> {
        let ctx = self.ctx(id)?;
        Ok((ctx.meta.owner_uid, ctx.meta.created))
    }

    /// A context's token ids.
    pub fn tokens(&self, id: ContextId) -> Result<Vec<u32>, StoreError> {
        Ok(self.ctx(id)?.state.lock().tokens.clone())
    }

    /// A context's metadata, token count and chunk states.
    pub fn context(&self, id: ContextId) -> Result<StoredContext, StoreError> {
        let ctx = self.ctx(id)?;
        let st = ctx.state.lock();
        let ct = ctx.meta.chunk_tokens;
        let slots = st.tokens.len().div_ceil(ct as usize) as u32;
        let last = st.chunks.keys().next_back().map_or(0, |i| i + 1);
        let chunks = (0..slots.max(last))
            .map(|index| ChunkMeta {
                index,
                span: span(index, ct, st.tokens.len()),
                state: st
                    .chunks
                    .get(&index)
                    .cloned()
                    .unwrap_or(StoreState::Missing),
            })
            .collect();
        Ok(StoredContext {
            id,
            meta: ctx.meta.clone(),
            tokens: st.tokens.len(),
            chunks,
        })
    }

    /// The state of one chunk slot.
    pub fn chunk_state(&self, id: ContextId, index: u32) -> Result<StoreState, StoreError> {
        let ctx = self.ctx(id)?;
        let st = ctx.state.lock();
        Ok(st
            .chunks
            .get(&index)
            .cloned()
            .unwrap_or(StoreState::Missing))
    }

    /// A context's data file (for tools and tests that inspect the store itself).
    pub fn data_path(&self, id: ContextId) -> PathBuf {
        self.root.join("contexts").join(id.to_string()).join("data")
    }

    /// Where a stored chunk's header starts in its context's data file (its payload follows at
    /// `+ HEADER_PAGE`), for tools and tests that inspect the store itself.
    pub fn chunk_offset(&self, id: ContextId, index: u32) -> Option<u64> {
        match self.chunk_state(id, index).ok()? {
            StoreState::Stored(s) => Some(slot_offset(index, s.copy)),
            _ => None,
        }
    }

    /// Copies a slot's bytes (`bytes`: what was read of it, header page first) into
    /// `quarantine/<context>-<index>.<copy>.<ns>` and frees the slot, so it is never served again.
    fn keep_aside(
        &self,
        data: &File,
        id: ContextId,
        index: u32,
        copy: u8,
        bytes: &[u8],
    ) -> Result<(), IoError> {
        let qdir = self.root.join("quarantine");
        let name = format!("{id}-{index}.{copy}.{}", now_nanos());
        write_atomic(&qdir, &name, &format!(".tmp-{name}"), &[bytes])?;
        let at = slot_offset(index, copy);
        punch(data, at, SLOT_BYTES).map_err(|e| IoError::new("punch", &qdir.join(&name), e))?;
        Ok(())
    }
}

/// A time in seconds since the Unix epoch as UTC, `2026-11-25T09:30:00Z` (the proleptic
/// Gregorian calendar, days to dates by Howard Hinnant's `civil_from_days`).
pub fn utc(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rest = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rest / 3600,
        rest / 60 % 60,
        rest % 60
    )
}

/// A chunk's metadata as its header records it.
pub(crate) fn stored_of(h: &ChunkHeader, copy: u8) -> StoredChunk {
    StoredChunk {
        copy,
        format: h.format,
        codec: h.codec,
        density: h.density,
        raw_len: h.raw_len,
        stored_len: h.stored_len,
        generation: h.generation,
        tokens: h.token_start..h.token_end,
        tokens_crc: h.tokens_crc,
        written: (h.written != 0).then_some(u64::from(h.written)),
    }
}

fn check_identity(
    h: &ChunkHeader,
    id: ContextId,
    index: u32,
    meta: &ContextMeta,
) -> Result<(), String> {
    if h.context != id.0 || h.index != index {
        return Err(format!(
            "header says context {} chunk {}, file is context {id} chunk {index}",
            h.context, h.index
        ));
    }
    if h.fingerprint != meta.fingerprint {
        return Err(format!(
            "written for model {}, context is model {}",
            h.fingerprint, meta.fingerprint
        ));
    }
    Ok(())
}
