//! The chunk store: a directory of contexts, each with its metadata, its tokens and one data file
//! that holds its chunks.
//!
//! Layout under the store root:
//! `KVFS` (marker), `contexts/<id>/{meta,tokens,data}`, `staging/` (contexts being created),
//! `trash/` (contexts being deleted) and `quarantine/` (chunks and files that failed their checks).
//! `meta` and `tokens` are replaced atomically (see [`crate::io::write_atomic`]). In `data`, chunk
//! `i` has two slots ([`slot_offset`]): a rewrite goes to the slot the chunk does not occupy, its
//! payload made durable before its header, so after a crash at any point the newest complete copy
//! is the one with the highest generation. [`Store::open`] scans the store and recovers from any
//! crash point, quarantining what fails its checks.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fmt;
use std::fs::{File, OpenOptions};
use std::ops::Range;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::format::{
    ChunkHeader, Codec, ContextMeta, Fingerprint, FormatError, HEADER_LEN, KvFormat, decode_tokens,
    encode_tokens, tokens_crc,
};
use crate::io::{
    AlignedBuf, DIRECT_ALIGN, IoError, drop_range, punch, read_file, read_slot, supports_direct,
    sync_dir, write_atomic,
};

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

/// The id of a context, unique within its store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ContextId(pub u64);

impl fmt::Display for ContextId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

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
#[derive(Clone, Debug, PartialEq)]
pub enum ChunkState {
    /// In the store, readable.
    Stored(StoredChunk),
    /// Never written, or dropped because its tokens changed: recompute.
    Missing,
    /// Its file failed a check and was moved to `quarantine/`: recompute.
    Quarantined { reason: String },
}

impl ChunkState {
    /// A short name for listings.
    pub fn name(&self) -> &'static str {
        match self {
            ChunkState::Stored(_) => "stored",
            ChunkState::Missing => "missing",
            ChunkState::Quarantined { .. } => "quarantined",
        }
    }
}

/// One chunk slot of a context.
#[derive(Clone, Debug, PartialEq)]
pub struct ChunkMeta {
    pub index: u32,
    /// The token span of the slot given the context's current tokens.
    pub span: Range<u32>,
    pub state: ChunkState,
}

/// A context's metadata and the state of each of its chunks.
#[derive(Clone, Debug)]
pub struct ContextInfo {
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
    /// Serializes every mutation of this context (tokens, chunks, delete).
    write: Mutex<()>,
    state: Mutex<CtxState>,
    deleted: AtomicBool,
}

#[derive(Default)]
struct CtxState {
    tokens: Vec<u32>,
    chunks: BTreeMap<u32, ChunkState>,
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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
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
    /// Whether `root` holds a kvfs store (its marker file), without opening or changing it.
    pub fn exists(root: &Path) -> bool {
        root.join(MARKER).is_file()
    }

    /// Opens the store at `root`, creating it if `root` is missing or empty, and recovers from any
    /// crash: leftovers of unfinished writes are removed, files that fail their checks are moved to
    /// `quarantine/` (see [`Store::recovered`]) and their chunks marked for recompute.
    pub fn open(root: &Path, options: StoreOptions) -> Result<Store, StoreError> {
        let marker = root.join(MARKER);
        if options.read_only && !marker.exists() {
            return Err(StoreError::NotAStore {
                path: root.to_owned(),
            });
        }
        if !marker.exists() {
            // Empty, or only what an interrupted creation leaves: the empty skeleton folders
            // and the marker's temp file (creation writes the marker last).
            let empty = match std::fs::read_dir(root) {
                Ok(d) => {
                    let mut only_skeleton = true;
                    for e in d {
                        let e = e.map_err(io("list", root))?;
                        let name = e.file_name();
                        let name = name.to_string_lossy();
                        let skeleton = ["contexts", "staging", "trash", "quarantine"]
                            .contains(&name.as_ref())
                            && std::fs::read_dir(e.path())
                                .map(|mut d| d.next().is_none())
                                .unwrap_or(false);
                        if !(skeleton || name.starts_with(".tmp-KVFS")) {
                            only_skeleton = false;
                            break;
                        }
                        if !skeleton {
                            std::fs::remove_file(e.path()).map_err(io("remove", &e.path()))?;
                        }
                    }
                    only_skeleton
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    std::fs::create_dir_all(root).map_err(io("mkdir", root))?;
                    true
                }
                Err(e) => return Err(IoError::new("list", root, e).into()),
            };
            if !empty {
                return Err(StoreError::NotAStore {
                    path: root.to_owned(),
                });
            }
            for sub in ["contexts", "staging", "trash", "quarantine"] {
                mkdir(&root.join(sub))?;
            }
            write_atomic(root, MARKER, ".tmp-KVFS", &[MARKER_TEXT])?;
        }
        for sub in ["contexts", "staging", "trash", "quarantine"] {
            if !options.read_only {
                mkdir(&root.join(sub))?;
            }
        }
        let lock = if options.read_only {
            None
        } else {
            let f = std::fs::File::open(&marker).map_err(io("open", &marker))?;
            match nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock) {
                Ok(l) => Some(l),
                Err((_, nix::errno::Errno::EWOULDBLOCK)) => {
                    return Err(StoreError::Locked {
                        path: root.to_owned(),
                    });
                }
                Err((_, e)) => return Err(IoError::new("flock", &marker, e.into()).into()),
            }
        };
        let mut store = Store {
            _lock: lock,
            root: root.to_owned(),
            direct: supports_direct(&marker),
            options,
            contexts: RwLock::new(BTreeMap::new()),
            next_id: AtomicU64::new(1),
            next_generation: AtomicU64::new(1),
            decoder: RwLock::new(None),
            residency: RwLock::new(None),
            recovered: Vec::new(),
            quarantined: AtomicU64::new(0),
            counters: Counters::default(),
        };
        let text = read_file(&marker, false, None)?;
        if text == MARKER_TEXT_V1 {
            store.upgrade_v1()?;
        } else if text != MARKER_TEXT {
            return Err(StoreError::Invalid {
                what: "store marker",
                why: format!(
                    "{} says {:?}, not {:?}; made by another kvfs version",
                    marker.display(),
                    String::from_utf8_lossy(&text).trim(),
                    String::from_utf8_lossy(MARKER_TEXT).trim()
                ),
            });
        }
        store.recover()?;
        Ok(store)
    }

    /// Upgrades a format-1 store (one file per chunk) in place: every context keeps its metadata
    /// and tokens, its chunk files are removed (chunks are recomputed from the tokens, as after
    /// any loss) and it gets an empty data file; the marker is rewritten last, so an upgrade cut
    /// short runs again at the next open.
    fn upgrade_v1(&mut self) -> Result<(), StoreError> {
        if self.options.read_only {
            return Err(StoreError::Invalid {
                what: "store",
                why: format!(
                    "{} is a format-1 store; open it for writing once to upgrade it",
                    self.root.display()
                ),
            });
        }
        let contexts = self.root.join("contexts");
        for entry in std::fs::read_dir(&contexts).map_err(io("list", &contexts))? {
            let dir = entry.map_err(io("list", &contexts))?.path();
            let chunks = dir.join("chunks");
            if chunks.is_dir() {
                std::fs::remove_dir_all(&chunks).map_err(io("remove", &chunks))?;
                self.note(&chunks, "removed", "format-1 chunk files (upgrade)".into());
            }
            if dir.is_dir() && !dir.join("data").exists() {
                create_data(&dir)?;
            }
        }
        write_atomic(&self.root, MARKER, ".tmp-KVFS", &[MARKER_TEXT])?;
        Ok(())
    }

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

    /// Registers the function that turns token ids into a context's `text`, for the contexts of
    /// model `model`: a context of another model is never decoded by it (its `text` and `info`
    /// say so), since another model's ids mean other words.
    pub fn set_decoder(&self, model: Fingerprint, decoder: Decoder) {
        *self.decoder.write().unwrap_or_else(|p| p.into_inner()) = Some((model, decoder));
    }

    /// The model whose decoder is registered, if one is.
    pub fn decoder_model(&self) -> Option<Fingerprint> {
        self.decoder
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|(fp, _)| *fp)
    }

    /// Registers the function that says whether a chunk is resident in memory (shown in `info`
    /// and the chunk's `user.kvfs.resident`).
    pub fn set_residency(&self, residency: Residency) {
        *self.residency.write().unwrap_or_else(|p| p.into_inner()) = Some(residency);
    }

    /// Which chunks of `id` are resident, as the registered [`Residency`] says; `None` without
    /// one, or when it does not know.
    pub fn residency(&self, id: ContextId) -> Option<Vec<bool>> {
        let r = self
            .residency
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()?;
        r(id)
    }

    /// Whether chunk `index` of `id` is resident ([`Store::residency`]).
    pub fn resident(&self, id: ContextId, index: u32) -> Option<bool> {
        self.residency(id)
            .map(|r| r.get(index as usize).copied().unwrap_or(false))
    }

    /// How context `id`'s `text` is shown.
    pub fn text_view(&self, id: ContextId) -> Result<TextView, StoreError> {
        let model = self.fingerprint(id)?;
        Ok(match self.decoder_model() {
            None => TextView::NoDecoder,
            Some(loaded) if loaded == model => TextView::Decoded,
            Some(loaded) => TextView::OtherModel { loaded },
        })
    }

    fn recover(&mut self) -> Result<(), StoreError> {
        for sub in ["staging", "trash"] {
            if self.options.read_only {
                break;
            }
            let dir = self.root.join(sub);
            for entry in std::fs::read_dir(&dir).map_err(io("list", &dir))? {
                let path = entry.map_err(io("list", &dir))?.path();
                let res = if path.is_dir() {
                    std::fs::remove_dir_all(&path)
                } else {
                    std::fs::remove_file(&path)
                };
                res.map_err(io("remove", &path))?;
                self.note(&path, "removed", format!("unfinished {sub} entry"));
            }
        }
        let mut max_id = 0;
        let mut max_gen = 0;
        let contexts_dir = self.root.join("contexts");
        let mut names: Vec<_> = std::fs::read_dir(&contexts_dir)
            .map_err(io("list", &contexts_dir))?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<Result<_, _>>()
            .map_err(io("list", &contexts_dir))?;
        names.sort();
        let mut loaded = BTreeMap::new();
        for name in names {
            let path = contexts_dir.join(&name);
            let Some(id) = name.to_str().and_then(|s| s.parse::<u64>().ok()) else {
                self.quarantine(&path, "not a context id".into())?;
                continue;
            };
            max_id = max_id.max(id);
            match self.load_context(ContextId(id), &path, &mut max_gen) {
                Ok(ctx) => {
                    loaded.insert(ctx.id, Arc::new(ctx));
                }
                Err(reason) => self.quarantine(&path, reason)?,
            }
        }
        if !self.options.read_only {
            sync_dir(&contexts_dir)?;
        }
        *self.contexts.get_mut().unwrap_or_else(|p| p.into_inner()) = loaded;
        self.next_id = AtomicU64::new(max_id + 1);
        self.next_generation = AtomicU64::new(max_gen + 1);
        for r in &self.recovered {
            tracing::warn!(path = %r.path.display(), action = r.action, reason = %r.reason, "kvfs recovery");
        }
        Ok(())
    }

    /// Loads one context directory; an `Err` is the reason to quarantine it whole.
    fn load_context(
        &mut self,
        id: ContextId,
        dir: &Path,
        max_gen: &mut u64,
    ) -> Result<Ctx, String> {
        let meta_bytes = read_file(&dir.join("meta"), false, None).map_err(|e| e.to_string())?;
        let meta = ContextMeta::decode(&meta_bytes).map_err(|e| e.to_string())?;
        let token_bytes = read_file(&dir.join("tokens"), false, None).map_err(|e| e.to_string())?;
        let tokens = decode_tokens(&token_bytes).map_err(|e| e.to_string())?;
        if meta.chunk_tokens == 0 {
            return Err("chunk size of 0 tokens".into());
        }
        let data_path = dir.join("data");
        if !self.options.read_only && !data_path.exists() {
            // A context of a format-1 store: its chunk files were removed by the upgrade.
            create_data(dir).map_err(|e| e.to_string())?;
        }
        let (data, direct) = open_data(&data_path, self.options.read_only, self.direct)
            .map_err(|e| e.to_string())?;
        let mut chunks = BTreeMap::new();
        let mut touched = false;
        // The copies found, per chunk: (copy, header) for every slot whose header passed.
        let mut found: BTreeMap<u32, Vec<(u8, ChunkHeader)>> = BTreeMap::new();
        let mut scratch = AlignedBuf::default();
        for slot in occupied_slots(&data).map_err(|e| format!("scan data: {e}"))? {
            let (index, copy) = ((slot / 2) as u32, (slot % 2) as u8);
            let at = slot * SLOT_BYTES;
            let what = format!("{} chunk {index} slot {copy}", data_path.display());
            let file = direct.as_ref().unwrap_or(&data);
            let mut r = read_slot(file, direct.is_some(), at, HEADER_PAGE, &mut scratch)
                .map_err(|e| format!("read {what}: {e}"))?;
            if self.options.verify_on_open
                && let Ok(h) = ChunkHeader::decode(&scratch[r.clone()])
                && (h.stored_len as usize) <= MAX_CHUNK_BYTES
            {
                let len = HEADER_PAGE + h.stored_len as usize;
                r = read_slot(file, direct.is_some(), at, len, &mut scratch)
                    .map_err(|e| format!("read {what}: {e}"))?;
            }
            let bytes = &scratch[r];
            let head = &bytes[..bytes.len().min(HEADER_LEN)];
            if head.iter().all(|&b| b == 0) {
                // A payload without its header: a first write cut short.
                self.free_slot(&data, &data_path, index, copy, "unfinished write")?;
                touched = true;
                continue;
            }
            let checked = ChunkHeader::decode(head)
                .map_err(|e| e.to_string())
                .and_then(|h| check_identity(&h, id, index, &meta).map(|()| h))
                .and_then(|h| {
                    if h.stored_len as usize > MAX_CHUNK_BYTES {
                        return Err(format!("header says {} stored bytes", h.stored_len));
                    }
                    if self.options.verify_on_open {
                        let payload = bytes
                            .get(HEADER_PAGE..HEADER_PAGE + h.stored_len as usize)
                            .ok_or("payload cut short")?;
                        h.check_payload(payload).map_err(|e| e.to_string())?;
                    }
                    Ok(h)
                });
            match checked {
                Ok(h) => found.entry(index).or_default().push((copy, h)),
                Err(reason) => {
                    self.quarantine_slot(
                        &data,
                        &data_path,
                        id,
                        index,
                        copy,
                        bytes,
                        reason.clone(),
                    )?;
                    chunks.insert(index, ChunkState::Quarantined { reason });
                    touched = true;
                }
            }
        }
        for (index, mut copies) in found {
            // The newest copy wins; an older one is what a crash between a rewrite and the
            // freeing of the slot it replaced leaves behind.
            copies.sort_by_key(|(_, h)| std::cmp::Reverse(h.generation));
            for (copy, _) in copies.iter().skip(1) {
                self.free_slot(&data, &data_path, index, *copy, "older copy")?;
                touched = true;
            }
            let (copy, h) = &copies[0];
            if !covers(&tokens, &(h.token_start..h.token_end), h.tokens_crc) {
                self.free_slot(
                    &data,
                    &data_path,
                    index,
                    *copy,
                    "stale: its tokens were replaced",
                )?;
                touched = true;
                continue;
            }
            *max_gen = (*max_gen).max(h.generation);
            chunks.insert(index, ChunkState::Stored(stored_of(h, *copy)));
        }
        if touched && !self.options.read_only {
            nix::unistd::fdatasync(&data).map_err(|e| format!("fdatasync data: {e}"))?;
        }
        Ok(Ctx {
            id,
            meta,
            dir: dir.to_owned(),
            data,
            direct,
            write: Mutex::new(()),
            state: Mutex::new(CtxState { tokens, chunks }),
            deleted: AtomicBool::new(false),
        })
    }

    /// Frees a slot at open (a leftover of an interrupted write, or a stale chunk) and notes why.
    fn free_slot(
        &mut self,
        data: &File,
        path: &Path,
        index: u32,
        copy: u8,
        reason: &str,
    ) -> Result<(), String> {
        if self.options.read_only {
            return Ok(());
        }
        punch(data, slot_offset(index, copy), SLOT_BYTES)
            .map_err(|e| format!("free chunk {index} slot {copy}: {e}"))?;
        self.note(
            &path.join(format!("{index}.{copy}")),
            "removed",
            reason.to_owned(),
        );
        Ok(())
    }

    /// Moves a slot that failed its checks at open into `quarantine/` and notes why.
    #[allow(clippy::too_many_arguments)]
    fn quarantine_slot(
        &mut self,
        data: &File,
        path: &Path,
        id: ContextId,
        index: u32,
        copy: u8,
        bytes: &[u8],
        reason: String,
    ) -> Result<(), String> {
        let shown = path.join(format!("{index}.{copy}"));
        if self.options.read_only {
            self.quarantined.fetch_add(1, Ordering::Relaxed);
            self.note(&shown, "not served (read-only: left in place)", reason);
            return Ok(());
        }
        self.keep_aside(data, id, index, copy, bytes)
            .map_err(|e| e.to_string())?;
        self.quarantined.fetch_add(1, Ordering::Relaxed);
        self.note(&shown, "quarantined", reason);
        Ok(())
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

    fn note(&mut self, path: &Path, action: &'static str, reason: String) {
        self.recovered.push(Recovered {
            path: path.to_owned(),
            action,
            reason,
        });
    }

    /// Moves `path` into `quarantine/` so it is never served again, and records why.
    fn quarantine(&mut self, path: &Path, reason: String) -> Result<(), StoreError> {
        if self.options.read_only {
            self.quarantined.fetch_add(1, Ordering::Relaxed);
            self.note(path, "not served (read-only: left in place)", reason);
            return Ok(());
        }
        let dest = self.quarantine_path(path);
        std::fs::rename(path, &dest).map_err(io("quarantine", path))?;
        self.quarantined.fetch_add(1, Ordering::Relaxed);
        self.note(path, "quarantined", reason);
        Ok(())
    }

    fn quarantine_path(&self, path: &Path) -> PathBuf {
        let rel = path
            .strip_prefix(self.root.join("contexts"))
            .unwrap_or(path);
        let flat = rel.to_string_lossy().replace('/', "-");
        self.root
            .join("quarantine")
            .join(format!("{flat}.{}", now_nanos()))
    }

    fn ctx(&self, id: ContextId) -> Result<Arc<Ctx>, StoreError> {
        let map = self.contexts.read().unwrap_or_else(|p| p.into_inner());
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

    /// Creates an empty context, durably: it exists after a crash only if it exists whole.
    pub fn create_context(&self, new: NewContext) -> Result<ContextId, StoreError> {
        self.writable()?;
        if new.chunk_tokens == 0 {
            return Err(StoreError::Invalid {
                what: "chunk size",
                why: "must be at least 1 token".into(),
            });
        }
        if new.app.len() > MAX_APP_LEN {
            return Err(StoreError::Invalid {
                what: "app name",
                why: format!("{} bytes, at most {MAX_APP_LEN}", new.app.len()),
            });
        }
        let id = ContextId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let meta = ContextMeta {
            owner_uid: new.owner_uid,
            app: new.app,
            fingerprint: new.fingerprint,
            chunk_tokens: new.chunk_tokens,
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
        };
        let staging = self.root.join("staging");
        let tmp = staging.join(id.to_string());
        mkdir(&tmp)?;
        write_atomic(&tmp, "meta", ".tmp-meta", &[&meta.encode()])?;
        write_atomic(&tmp, "tokens", ".tmp-tokens", &[&encode_tokens(&[])])?;
        create_data(&tmp)?;
        sync_dir(&staging)?;
        let contexts = self.root.join("contexts");
        let dir = contexts.join(id.to_string());
        std::fs::rename(&tmp, &dir).map_err(io("rename", &tmp))?;
        sync_dir(&contexts)?;
        sync_dir(&staging)?;
        let (data, direct) = open_data(&dir.join("data"), false, self.direct)?;
        let ctx = Ctx {
            id,
            meta,
            dir,
            data,
            direct,
            write: Mutex::new(()),
            state: Mutex::new(CtxState::default()),
            deleted: AtomicBool::new(false),
        };
        self.contexts
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, Arc::new(ctx));
        tracing::debug!(context = %id, "context created");
        Ok(id)
    }

    /// Deletes a context and all its chunks, durably.
    pub fn delete_context(&self, id: ContextId) -> Result<(), StoreError> {
        self.writable()?;
        let ctx = self.ctx(id)?;
        let _w = lock(&ctx.write);
        if ctx.deleted.swap(true, Ordering::SeqCst) {
            return Err(StoreError::NoSuchContext { context: id });
        }
        let trash = self
            .root
            .join("trash")
            .join(format!("{id}.{}", now_nanos()));
        let res = std::fs::rename(&ctx.dir, &trash).map_err(io("rename", &ctx.dir));
        if let Err(e) = res {
            ctx.deleted.store(false, Ordering::SeqCst);
            return Err(e.into());
        }
        self.contexts
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id);
        sync_dir(&self.root.join("contexts"))?;
        sync_dir(&self.root.join("trash"))?;
        if let Err(e) = std::fs::remove_dir_all(&trash) {
            tracing::warn!(path = %trash.display(), error = %e, "could not empty trash; it is removed at next open");
        }
        Ok(())
    }

    /// Every context's id, in id order.
    pub fn list_contexts(&self) -> Vec<ContextId> {
        self.contexts
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .copied()
            .collect()
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
        Ok(lock(&self.ctx(id)?.state).tokens.clone())
    }

    /// A context's metadata, token count and chunk states.
    pub fn context(&self, id: ContextId) -> Result<ContextInfo, StoreError> {
        let ctx = self.ctx(id)?;
        let st = lock(&ctx.state);
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
                    .unwrap_or(ChunkState::Missing),
            })
            .collect();
        Ok(ContextInfo {
            id,
            meta: ctx.meta.clone(),
            tokens: st.tokens.len(),
            chunks,
        })
    }

    /// The state of one chunk slot.
    pub fn chunk_state(&self, id: ContextId, index: u32) -> Result<ChunkState, StoreError> {
        let ctx = self.ctx(id)?;
        let st = lock(&ctx.state);
        Ok(st
            .chunks
            .get(&index)
            .cloned()
            .unwrap_or(ChunkState::Missing))
    }

    /// Appends token ids, durably, before any chunk that depends on them is written.
    /// Returns the new token count.
    pub fn append_tokens(&self, id: ContextId, more: &[u32]) -> Result<usize, StoreError> {
        self.writable()?;
        let ctx = self.ctx(id)?;
        let _w = self.write_lock(&ctx)?;
        let mut tokens = lock(&ctx.state).tokens.clone();
        tokens.extend_from_slice(more);
        write_atomic(
            &ctx.dir,
            "tokens",
            ".tmp-tokens",
            &[&encode_tokens(&tokens)],
        )?;
        let n = tokens.len();
        lock(&ctx.state).tokens = tokens;
        Ok(n)
    }

    /// Replaces the token ids, durably; chunks computed from tokens that changed are dropped.
    pub fn replace_tokens(&self, id: ContextId, tokens: Vec<u32>) -> Result<(), StoreError> {
        self.writable()?;
        let ctx = self.ctx(id)?;
        let _w = self.write_lock(&ctx)?;
        write_atomic(
            &ctx.dir,
            "tokens",
            ".tmp-tokens",
            &[&encode_tokens(&tokens)],
        )?;
        let ct = ctx.meta.chunk_tokens;
        let slots = tokens.len().div_ceil(ct as usize) as u32;
        let stale: Vec<u32> = {
            let mut st = lock(&ctx.state);
            st.tokens = tokens;
            let st = &mut *st;
            let stale = st
                .chunks
                .iter()
                .filter(|(i, s)| match s {
                    ChunkState::Stored(c) => {
                        **i >= slots || !covers(&st.tokens, &c.tokens, c.tokens_crc)
                    }
                    _ => **i >= slots,
                })
                .map(|(i, _)| *i)
                .collect::<Vec<_>>();
            for i in &stale {
                st.chunks.remove(i);
            }
            stale
        };
        let path = ctx.dir.join("data");
        for &i in &stale {
            punch(&ctx.data, slot_offset(i, 0), 2 * SLOT_BYTES)
                .map_err(|e| IoError::new("punch", &path, e))?;
        }
        if !stale.is_empty() {
            nix::unistd::fdatasync(&ctx.data)
                .map_err(|e| IoError::new("fdatasync", &path, e.into()))?;
        }
        Ok(())
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
        let w = lock(&ctx.write);
        if ctx.deleted.load(Ordering::SeqCst) {
            return Err(StoreError::NoSuchContext { context: ctx.id });
        }
        Ok(w)
    }

    /// Writes chunk `index` of a context crash-safely, replacing any previous version: the payload
    /// goes to the chunk's free slot of the data file and is made durable, then its header, then
    /// the old copy's slot is freed; the pages written are dropped from the page cache.
    /// The tokens the chunk covers must already be stored ([`Store::append_tokens`]).
    pub fn write_chunk(
        &self,
        id: ContextId,
        index: u32,
        fingerprint: &Fingerprint,
        format: KvFormat,
        density: f32,
        data: &[u8],
    ) -> Result<StoredChunk, StoreError> {
        let _span = tracing::debug_span!("kvfs_write_chunk", context = %id, index).entered();
        self.writable()?;
        if data.len() > MAX_CHUNK_BYTES {
            return Err(StoreError::TooLarge { len: data.len() });
        }
        if index >= MAX_CHUNKS {
            return Err(StoreError::Invalid {
                what: "chunk index",
                why: format!("{index}, a context holds at most {MAX_CHUNKS} chunks"),
            });
        }
        let ctx = self.ctx_of_model(id, fingerprint)?;
        let _w = self.write_lock(&ctx)?;
        let (range, tcrc) = {
            let st = lock(&ctx.state);
            let range = span(index, ctx.meta.chunk_tokens, st.tokens.len());
            if range.is_empty() {
                return Err(StoreError::BeyondTokens {
                    context: id,
                    index,
                    start: index as u64 * ctx.meta.chunk_tokens as u64,
                    tokens: st.tokens.len(),
                });
            }
            let crc = tokens_crc(&st.tokens[range.start as usize..range.end as usize]);
            (range, crc)
        };
        let compressed = self.compress(data);
        let (codec, payload) = match &compressed {
            Some(c) => (Codec::Zstd, c.as_slice()),
            None => (Codec::Raw, data),
        };
        // The new copy goes to the slot the chunk does not occupy: the current one stays whole
        // (and readable) until the new one is durable.
        let previous = match lock(&ctx.state).chunks.get(&index) {
            Some(ChunkState::Stored(s)) => Some(s.copy),
            _ => None,
        };
        let copy = previous.map_or(0, |c| 1 - c);
        let generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
        let header = ChunkHeader {
            format,
            codec,
            context: id.0,
            index,
            token_start: range.start,
            token_end: range.end,
            tokens_crc: tcrc,
            density,
            raw_len: data.len() as u32,
            stored_len: payload.len() as u32,
            payload_crc: crc32c::crc32c(payload),
            generation,
            fingerprint: ctx.meta.fingerprint,
            written: unix_seconds(),
        };
        let path = ctx.dir.join("data");
        let at = slot_offset(index, copy);
        let sync = |what| {
            nix::unistd::fdatasync(&ctx.data).map_err(|e| IoError::new(what, &path, e.into()))
        };
        // 1. The payload, durable before any header names it.
        ctx.data
            .write_all_at(payload, at + HEADER_PAGE as u64)
            .map_err(|e| IoError::new("write", &path, e))?;
        sync("fdatasync")?;
        // 2. The header: from here on this copy is the newest complete one.
        ctx.data
            .write_all_at(&header.encode(), at)
            .map_err(|e| IoError::new("write", &path, e))?;
        sync("fdatasync")?;
        drop_range(&ctx.data, at, HEADER_PAGE + payload.len());
        let stored = stored_of(&header, copy);
        lock(&ctx.state)
            .chunks
            .insert(index, ChunkState::Stored(stored.clone()));
        // 3. The old copy's slot is freed (not synced: after a crash the open frees it again, as
        //    the older of two copies).
        if let Some(old) = previous
            && let Err(e) = punch(&ctx.data, slot_offset(index, old), SLOT_BYTES)
        {
            tracing::warn!(path = %path.display(), index, error = %e, "could not free a replaced copy");
        }
        let c = &self.counters;
        c.chunk_writes.fetch_add(1, Ordering::Relaxed);
        c.chunk_write_raw_bytes
            .fetch_add(data.len() as u64, Ordering::Relaxed);
        c.chunk_write_stored_bytes
            .fetch_add(payload.len() as u64, Ordering::Relaxed);
        Ok(stored)
    }

    fn compress(&self, data: &[u8]) -> Option<Vec<u8>> {
        if !self.options.min_ratio.is_finite() || data.is_empty() {
            return None;
        }
        let c = zstd::bulk::compress(data, self.options.zstd_level).ok()?;
        (data.len() as f64 >= self.options.min_ratio * c.len() as f64).then_some(c)
    }

    /// Reads chunk `index` of a context, checked end to end (header crc, identity, model fingerprint,
    /// tokens, payload crc, decompressed length). A chunk that fails a check is quarantined and the
    /// error says to recompute it ([`StoreError::needs_recompute`]).
    ///
    /// This allocates the returned vector; the service's load and fault paths use
    /// [`Store::read_chunk_into`], which does not.
    pub fn read_chunk(
        &self,
        id: ContextId,
        index: u32,
        fingerprint: &Fingerprint,
    ) -> Result<Vec<u8>, StoreError> {
        let mut out = Vec::new();
        self.read_chunk_into_vec(id, index, fingerprint, &mut out)?;
        Ok(out)
    }

    /// Reads chunk `index` of a context into the front of `buf`, with every check of
    /// [`Store::read_chunk`], and returns the chunk's metadata: its bytes are
    /// `buf[..meta.raw_len as usize]`.
    ///
    /// Nothing is allocated per read in steady state. A raw payload read with O_DIRECT into a
    /// page-aligned `buf` at least the payload rounded up to 4 KiB long is read straight into it
    /// (one `preadv`: the header page into a page on the stack, the payload into `buf`, whose
    /// bytes past the chunk up to that length are overwritten), as `MountReader` does. Otherwise
    /// the slot is read with O_DIRECT into a buffer kept per thread (grown once to the largest
    /// slot seen), a raw payload is copied into `buf` and a zstd payload is decompressed straight
    /// into it with a decompression context kept per thread.
    /// A `buf` shorter than the chunk is [`StoreError::BufferTooSmall`] (the chunk is fine; nothing
    /// is quarantined); a chunk that fails a check is quarantined and never copied out whole:
    /// `buf` may then hold garbage, and the error says to recompute the chunk.
    pub fn read_chunk_into(
        &self,
        id: ContextId,
        index: u32,
        fingerprint: &Fingerprint,
        buf: &mut [u8],
    ) -> Result<StoredChunk, StoreError> {
        if let Some(chunk) = self.read_raw_into(id, index, fingerprint, buf) {
            return Ok(chunk);
        }
        self.read_checked(id, index, fingerprint, |h, copy, slot, dctx| {
            let raw = h.raw_len as usize;
            let have = buf.len();
            let out = buf
                .get_mut(..raw)
                .ok_or(Check::TooSmall { need: raw, have })?;
            decode_payload(h, &slot[HEADER_PAGE..], out, dctx)?;
            Ok(stored_of(h, copy))
        })
    }

    /// The direct case of [`Store::read_chunk_into`]: a raw payload read by the kernel straight
    /// into `buf`, checked as every read is. `None` when it does not apply (no O_DIRECT, a zstd
    /// payload, a `buf` unaligned or short) and when anything is amiss (not stored, a read error,
    /// a failed check, a concurrent rewrite): the per-thread path then reads the slot again and
    /// decides, quarantining what is really bad.
    fn read_raw_into(
        &self,
        id: ContextId,
        index: u32,
        fingerprint: &Fingerprint,
        buf: &mut [u8],
    ) -> Option<StoredChunk> {
        let ctx = self.ctx_of_model(id, fingerprint).ok()?;
        let file = ctx.direct.as_ref()?;
        let at = match lock(&ctx.state).chunks.get(&index) {
            Some(ChunkState::Stored(s)) => s.clone(),
            _ => return None,
        };
        let page = read_raw_slot(file, index, &at, buf)?.ok()?;
        let payload = &buf[..at.stored_len as usize];
        let h = self
            .check_parts(&ctx, index, at.generation, &page.0, payload)
            .ok()?;
        self.counters.chunk_reads.fetch_add(1, Ordering::Relaxed);
        self.counters
            .chunk_read_bytes
            .fetch_add(u64::from(h.raw_len), Ordering::Relaxed);
        Some(stored_of(&h, at.copy))
    }

    /// [`Store::read_chunk_into`] into a vector resized to the chunk's length (its capacity is
    /// reused, so a vector kept by the caller stops allocating once it has held the largest chunk).
    pub fn read_chunk_into_vec(
        &self,
        id: ContextId,
        index: u32,
        fingerprint: &Fingerprint,
        buf: &mut Vec<u8>,
    ) -> Result<StoredChunk, StoreError> {
        self.read_checked(id, index, fingerprint, |h, copy, slot, dctx| {
            let raw = h.raw_len as usize;
            let payload = &slot[HEADER_PAGE..];
            buf.clear();
            // Copy or decompress into the vector's spare capacity: no zero-filling first.
            match h.codec {
                Codec::Raw if payload.len() == raw => buf.extend_from_slice(payload),
                Codec::Raw => {
                    return Err(Check::Bad(format!(
                        "raw payload of {} bytes, header says {raw} raw",
                        payload.len()
                    )));
                }
                Codec::Zstd => {
                    buf.reserve(raw);
                    let n = dctx
                        .decompress_to_buffer(payload, buf)
                        .map_err(|e| Check::Bad(format!("zstd: {e}")))?;
                    if n != raw {
                        return Err(Check::Bad(format!(
                            "decompressed to {n} bytes, header says {raw}"
                        )));
                    }
                }
            }
            Ok(stored_of(h, copy))
        })
    }

    /// Reads and checks chunk `index` as [`Store::read_chunk`] does and calls `f` with its slot's
    /// bytes as they are in the data file: the header page (the 104-byte header, then zeros) and
    /// the stored payload (raw or zstd). This is what the mount's `kv` file serves where the
    /// kernel does not pass it through; `f` runs only for a chunk that passed every check.
    pub fn with_slot<R>(
        &self,
        id: ContextId,
        index: u32,
        fingerprint: &Fingerprint,
        f: impl FnOnce(&StoredChunk, &[u8]) -> R,
    ) -> Result<R, StoreError> {
        let mut f = Some(f);
        self.read_checked(id, index, fingerprint, |h, copy, slot, _| match f.take() {
            Some(f) => Ok(f(&stored_of(h, copy), slot)),
            None => Err(Check::Bad("slot consumed twice".into())),
        })
    }

    /// Where chunk `index` of a context is, for a reader of the data file (through the mount's
    /// passed-through `kv` file): its metadata, whose `copy` names the slot ([`slot_offset`]) and
    /// whose `generation` the slot's header must carry. A reader that finds anything else there
    /// asks again (a rewrite moved the chunk) and reports a slot that fails its checks twice at
    /// the same place with [`Store::report_corrupt`].
    pub fn locate(
        &self,
        id: ContextId,
        index: u32,
        fingerprint: &Fingerprint,
    ) -> Result<StoredChunk, StoreError> {
        let ctx = self.ctx_of_model(id, fingerprint)?;
        let st = lock(&ctx.state);
        match st.chunks.get(&index) {
            Some(ChunkState::Stored(s)) => Ok(s.clone()),
            Some(ChunkState::Quarantined { reason }) => Err(StoreError::Corrupt {
                context: id,
                index,
                reason: reason.clone(),
            }),
            _ => Err(StoreError::ChunkMissing { context: id, index }),
        }
    }

    /// A reader outside the store found chunk `index`'s slot at `generation` failing its checks:
    /// unless a write has replaced it since, the slot is quarantined (its bytes as they are on
    /// disk kept in `quarantine/`) and the chunk marked for recompute. Returns the error to give
    /// the reader's caller ([`StoreError::Corrupt`]).
    pub fn report_corrupt(
        &self,
        id: ContextId,
        index: u32,
        generation: u64,
        reason: String,
    ) -> StoreError {
        let Ok(ctx) = self.ctx(id) else {
            return StoreError::NoSuchContext { context: id };
        };
        let _w = lock(&ctx.write);
        let (copy, stored_len) = match lock(&ctx.state).chunks.get(&index) {
            Some(ChunkState::Stored(s)) if s.generation == generation => (s.copy, s.stored_len),
            _ => {
                // Replaced or already quarantined: nothing of this generation is served.
                return StoreError::Corrupt {
                    context: id,
                    index,
                    reason,
                };
            }
        };
        let mut bytes = AlignedBuf::default();
        let file = ctx.direct.as_ref().unwrap_or(&ctx.data);
        let kept = read_slot(
            file,
            ctx.direct.is_some(),
            slot_offset(index, copy),
            HEADER_PAGE + stored_len as usize,
            &mut bytes,
        );
        // The slot as it is on disk, header page and payload, is what quarantine keeps.
        let bytes = kept.map(|r| bytes[r].to_vec()).unwrap_or_default();
        self.set_aside(&ctx, index, copy, &bytes, &reason);
        StoreError::Corrupt {
            context: id,
            index,
            reason,
        }
    }

    /// Quarantines a chunk's slot found bad at read time (the caller holds the context's write
    /// lock and has checked the slot is still the current one) and marks the chunk.
    fn set_aside(&self, ctx: &Ctx, index: u32, copy: u8, bytes: &[u8], reason: &str) {
        if !self.options.read_only
            && let Err(e) = self.keep_aside(&ctx.data, ctx.id, index, copy, bytes)
        {
            tracing::warn!(context = %ctx.id, index, error = %e, "could not quarantine");
        }
        self.quarantined.fetch_add(1, Ordering::Relaxed);
        self.counters
            .corrupt_detected
            .fetch_add(1, Ordering::Relaxed);
        tracing::warn!(context = %ctx.id, index, reason = %reason, "corrupt chunk quarantined");
        lock(&ctx.state).chunks.insert(
            index,
            ChunkState::Quarantined {
                reason: reason.to_owned(),
            },
        );
    }

    /// The one read path: reads chunk `index`'s slot (header page and payload) into this thread's
    /// scratch buffer with one read, checks it, and hands it to `finish` (which copies or
    /// decompresses it out). A chunk that fails a check, in the slot or in `finish`, is
    /// quarantined unless a concurrent write replaced it (then the read is retried).
    fn read_checked<R>(
        &self,
        id: ContextId,
        index: u32,
        fingerprint: &Fingerprint,
        mut finish: impl FnMut(
            &ChunkHeader,
            u8,
            &[u8],
            &mut zstd::bulk::Decompressor<'static>,
        ) -> Result<R, Check>,
    ) -> Result<R, StoreError> {
        let _span = tracing::debug_span!("kvfs_read_chunk", context = %id, index).entered();
        let ctx = self.ctx_of_model(id, fingerprint)?;
        let file = ctx.direct.as_ref().unwrap_or(&ctx.data);
        with_scratch(|s| {
            let (buf, dctx) = s
                .parts()
                .map_err(|e| IoError::new("zstd context for", &self.root, e))?;
            // A concurrent write may replace the chunk while we read it; retry if it moved.
            for _ in 0..3 {
                let (generation, copy, stored_len) = match lock(&ctx.state).chunks.get(&index) {
                    Some(ChunkState::Stored(s)) => (s.generation, s.copy, s.stored_len),
                    Some(ChunkState::Quarantined { reason }) => {
                        return Err(StoreError::Corrupt {
                            context: id,
                            index,
                            reason: reason.clone(),
                        });
                    }
                    _ => return Err(StoreError::ChunkMissing { context: id, index }),
                };
                let at = slot_offset(index, copy);
                let len = HEADER_PAGE + stored_len as usize;
                let r = read_slot(file, ctx.direct.is_some(), at, len, buf)
                    .map_err(|e| IoError::new("read", &ctx.dir.join("data"), e))?;
                let slot = &buf[r];
                let checked = self
                    .check_slot(&ctx, index, generation, slot)
                    .and_then(|h| finish(&h, copy, slot, dctx).map(|r| (h.raw_len, r)));
                let check = match checked {
                    Ok((raw_len, r)) => {
                        self.counters.chunk_reads.fetch_add(1, Ordering::Relaxed);
                        self.counters
                            .chunk_read_bytes
                            .fetch_add(raw_len as u64, Ordering::Relaxed);
                        return Ok(r);
                    }
                    Err(Check::TooSmall { need, have }) => {
                        return Err(StoreError::BufferTooSmall {
                            context: id,
                            index,
                            need,
                            have,
                        });
                    }
                    Err(Check::Bad(reason)) => reason,
                };
                let _w = lock(&ctx.write);
                let current = match lock(&ctx.state).chunks.get(&index) {
                    Some(ChunkState::Stored(s)) => Some(s.generation),
                    _ => None,
                };
                if current != Some(generation) {
                    continue;
                }
                self.set_aside(&ctx, index, copy, slot, &check);
                return Err(StoreError::Corrupt {
                    context: id,
                    index,
                    reason: check,
                });
            }
            Err(StoreError::ChunkMissing { context: id, index })
        })
    }

    /// Checks a chunk's slot read whole: header, identity, generation, model, payload length and
    /// crc, tokens.
    fn check_slot(
        &self,
        ctx: &Ctx,
        index: u32,
        generation: u64,
        slot: &[u8],
    ) -> Result<ChunkHeader, Check> {
        let (page, payload) = slot.split_at(HEADER_PAGE.min(slot.len()));
        self.check_parts(ctx, index, generation, page, payload)
    }

    /// [`Store::check_slot`] on a slot read in two parts: its header page and its payload (which
    /// may run past the header's stored length).
    fn check_parts(
        &self,
        ctx: &Ctx,
        index: u32,
        generation: u64,
        page: &[u8],
        payload: &[u8],
    ) -> Result<ChunkHeader, Check> {
        let bad = |e: FormatError| Check::Bad(e.to_string());
        let header = ChunkHeader::decode(page).map_err(bad)?;
        check_identity(&header, ctx.id, index, &ctx.meta).map_err(Check::Bad)?;
        if header.generation != generation {
            return Err(Check::Bad(format!(
                "slot holds generation {}, expected {generation}",
                header.generation
            )));
        }
        let payload = payload.get(..header.stored_len as usize).ok_or_else(|| {
            Check::Bad(format!(
                "slot cut short: {} bytes for a {}-byte payload",
                payload.len(),
                header.stored_len
            ))
        })?;
        header.check_payload(payload).map_err(bad)?;
        if header.raw_len as usize > MAX_CHUNK_BYTES {
            return Err(Check::Bad(format!(
                "header says {} raw bytes, more than the limit",
                header.raw_len
            )));
        }
        let st = lock(&ctx.state);
        if !covers(
            &st.tokens,
            &(header.token_start..header.token_end),
            header.tokens_crc,
        ) {
            return Err(Check::Bad(
                "computed from tokens the context no longer has".into(),
            ));
        }
        Ok(header)
    }

    /// Reads every stored chunk and checks it; returns the chunks that failed (now quarantined).
    pub fn verify(&self) -> Vec<(ContextId, u32, StoreError)> {
        let mut bad = Vec::new();
        for id in self.list_contexts() {
            let Ok(info) = self.context(id) else { continue };
            for c in info.chunks {
                if matches!(c.state, ChunkState::Stored(_))
                    && let Err(e) = self.read_chunk(id, c.index, &info.meta.fingerprint)
                {
                    bad.push((id, c.index, e));
                }
            }
        }
        bad
    }

    /// A context's data file (for tools and tests that inspect the store itself).
    pub fn data_path(&self, id: ContextId) -> PathBuf {
        self.root.join("contexts").join(id.to_string()).join("data")
    }

    /// Where a stored chunk's header starts in its context's data file (its payload follows at
    /// `+ HEADER_PAGE`), for tools and tests that inspect the store itself.
    pub fn chunk_offset(&self, id: ContextId, index: u32) -> Option<u64> {
        match self.chunk_state(id, index).ok()? {
            ChunkState::Stored(s) => Some(slot_offset(index, s.copy)),
            _ => None,
        }
    }

    /// A context's human-readable `info`.
    pub fn render_info(&self, id: ContextId) -> Result<String, StoreError> {
        use std::fmt::Write;
        let info = self.context(id)?;
        let mut s = String::new();
        let m = &info.meta;
        let _ = writeln!(s, "context      {}", info.id);
        let _ = writeln!(s, "owner uid    {}", m.owner_uid);
        let _ = writeln!(s, "app          {}", m.app);
        let _ = writeln!(s, "model        {}", m.fingerprint);
        match self.text_view(id)? {
            TextView::Decoded => {
                let _ = writeln!(s, "text         decoded by this model's tokenizer");
            }
            TextView::NoDecoder => {
                let _ = writeln!(
                    s,
                    "text         not decoded: no tokenizer is loaded (the ids are in tokens)"
                );
            }
            TextView::OtherModel { loaded } => {
                let _ = writeln!(
                    s,
                    "note         the tokenizer loaded is model {loaded}'s, not this context's: \
                     text is not decoded (the ids are in tokens)"
                );
            }
        }
        let _ = writeln!(
            s,
            "created      {} ({} unix seconds)",
            utc(m.created),
            m.created
        );
        let _ = writeln!(s, "tokens       {}", info.tokens);
        let _ = writeln!(s, "chunk tokens {}", m.chunk_tokens);
        let t = Totals::of(std::slice::from_ref(&info));
        t.write(&mut s);
        let _ = writeln!(
            s,
            "\nindex  tokens         state        format  density  codec   raw      stored   resident  written"
        );
        let residency = self.residency(id);
        for c in &info.chunks {
            let span = format!("{}..{}", c.span.start, c.span.end);
            let resident = match &residency {
                Some(r) if r.get(c.index as usize) == Some(&true) => "yes",
                Some(_) => "no",
                None => "-",
            };
            match &c.state {
                ChunkState::Stored(sc) => {
                    let _ = writeln!(
                        s,
                        "{:<6} {:<14} {:<12} {:<7} {:<8.4} {:<7} {:<8} {:<8} {:<9} {}",
                        c.index,
                        span,
                        "stored",
                        sc.format.name(),
                        sc.density,
                        sc.codec.name(),
                        sc.raw_len,
                        sc.stored_len,
                        resident,
                        sc.written.map_or_else(|| "-".to_owned(), utc)
                    );
                }
                other => {
                    let _ = writeln!(
                        s,
                        "{:<6} {:<14} {:<12} {:<7} {:<8} {:<7} {:<8} {:<8} {}",
                        c.index,
                        span,
                        other.name(),
                        "-",
                        "-",
                        "-",
                        "-",
                        "-",
                        resident
                    );
                }
            }
        }
        Ok(s)
    }

    /// A context's `text`: its tokens decoded by the decoder registered for its model; without
    /// one, or with another model's, a line that says why there is no text and where the ids are.
    pub fn render_text(&self, id: ContextId) -> Result<String, StoreError> {
        let tokens = self.tokens(id)?;
        let decoder = self
            .decoder
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let n = tokens.len();
        Ok(match (self.text_view(id)?, decoder) {
            (TextView::Decoded, Some((_, d))) => d(&tokens),
            (TextView::OtherModel { loaded }, _) => format!(
                "kvfs: context {id} was computed by model {}, but the tokenizer loaded is model \
                 {loaded}'s, so its {n} tokens are not decoded; their ids are in `tokens` beside \
                 this file\n",
                self.fingerprint(id)?
            ),
            _ => format!(
                "kvfs: no tokenizer is loaded, so the {n} tokens of context {id} are not decoded \
                 (mount the store with its model to read them); their ids are in `tokens` beside \
                 this file\n"
            ),
        })
    }

    /// A context's `tokens`: its token ids in decimal, separated by spaces, and a newline.
    pub fn render_tokens(&self, id: ContextId) -> Result<String, StoreError> {
        use std::fmt::Write;
        let tokens = self.tokens(id)?;
        let mut s = String::with_capacity(tokens.len() * 6 + 1);
        for (i, t) in tokens.iter().enumerate() {
            let _ = write!(s, "{}{t}", if i == 0 { "" } else { " " });
        }
        s.push('\n');
        Ok(s)
    }

    /// The store-wide `stats`.
    pub fn render_stats(&self) -> String {
        use std::fmt::Write;
        let infos: Vec<ContextInfo> = self
            .list_contexts()
            .into_iter()
            .filter_map(|id| self.context(id).ok())
            .collect();
        let mut s = String::new();
        let _ = writeln!(s, "store        {}", self.root.display());
        let _ = writeln!(
            s,
            "direct io    {}",
            if self.direct { "O_DIRECT" } else { "fadvise" }
        );
        let _ = writeln!(s, "contexts     {}", infos.len());
        let _ = writeln!(
            s,
            "tokens       {}",
            infos.iter().map(|i| i.tokens).sum::<usize>()
        );
        Totals::of(&infos).write(&mut s);
        let c = &self.counters;
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let _ = writeln!(
            s,
            "quarantined  {}",
            self.quarantined.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            s,
            "reads        {} ({} bytes)",
            r(&c.chunk_reads),
            r(&c.chunk_read_bytes)
        );
        let _ = writeln!(
            s,
            "writes       {} ({} raw bytes, {} stored)",
            r(&c.chunk_writes),
            r(&c.chunk_write_raw_bytes),
            r(&c.chunk_write_stored_bytes)
        );
        let _ = writeln!(
            s,
            "corrupt      {} detected on read",
            r(&c.corrupt_detected)
        );
        s
    }
}

/// A page-aligned buffer for a slot's header page (on the stack: an O_DIRECT read into it needs
/// no allocation).
#[repr(C, align(4096))]
pub(crate) struct HeaderPage(pub(crate) [u8; HEADER_PAGE]);

/// Reads a raw chunk's slot with one `preadv` of `file` (opened O_DIRECT): the header page into
/// the returned page, the payload straight into `buf`, up to the payload rounded up to 4 KiB.
/// `None` when that does not apply (a zstd payload, `buf` unaligned or shorter than that); an
/// error names a failed or short read. The caller checks what it read.
pub(crate) fn read_raw_slot(
    file: &File,
    index: u32,
    at: &StoredChunk,
    buf: &mut [u8],
) -> Option<Result<HeaderPage, String>> {
    let stored = at.stored_len as usize;
    let rounded = stored.next_multiple_of(DIRECT_ALIGN);
    if at.codec != Codec::Raw
        || at.stored_len != at.raw_len
        || buf.as_ptr().align_offset(DIRECT_ALIGN) != 0
        || buf.len() < rounded
    {
        return None;
    }
    let mut page = HeaderPage([0; HEADER_PAGE]);
    let mut iov = [
        std::io::IoSliceMut::new(&mut page.0),
        std::io::IoSliceMut::new(&mut buf[..rounded]),
    ];
    Some(
        match preadv_all(file, &mut iov, slot_offset(index, at.copy)) {
            Err(e) => Err(format!("read: {e}")),
            Ok(n) if n < HEADER_PAGE + stored => Err(format!(
                "read {n} bytes of a {}-byte slot",
                HEADER_PAGE + stored
            )),
            Ok(_) => Ok(page),
        },
    )
}

/// One positioned vectored read, retried on `EINTR`.
fn preadv_all(
    f: &File,
    iov: &mut [std::io::IoSliceMut<'_>],
    offset: u64,
) -> Result<usize, nix::errno::Errno> {
    loop {
        match nix::sys::uio::preadv(f, iov, offset as libc::off_t) {
            Err(nix::errno::Errno::EINTR) => continue,
            other => return other,
        }
    }
}

/// Why a chunk read did not deliver.
pub(crate) enum Check {
    /// The slot failed a check: quarantine it.
    Bad(String),
    /// The chunk is fine but the caller's buffer is too short for it.
    TooSmall { need: usize, have: usize },
}

/// Buffers for chunk reads, one set per thread, kept between reads so that steady-state reads
/// allocate nothing: the O_DIRECT slot buffer and the zstd decompression context.
#[derive(Default)]
pub(crate) struct Scratch {
    file: AlignedBuf,
    dctx: Option<zstd::bulk::Decompressor<'static>>,
}

/// The read buffer and the decompression context of a [`Scratch`], borrowed together.
pub(crate) type ScratchParts<'a> = (
    &'a mut AlignedBuf,
    &'a mut zstd::bulk::Decompressor<'static>,
);

impl Scratch {
    /// The read buffer and the decompression context (made at first use).
    pub(crate) fn parts(&mut self) -> std::io::Result<ScratchParts<'_>> {
        let dctx = match &mut self.dctx {
            Some(d) => d,
            d => d.insert(zstd::bulk::Decompressor::new()?),
        };
        Ok((&mut self.file, dctx))
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Runs `f` with this thread's scratch buffers (or one-off buffers if they are in use, which
/// happens only when a [`Store::with_slot`] callback reads another chunk).
pub(crate) fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    SCRATCH.with(|s| match s.try_borrow_mut() {
        Ok(mut s) => f(&mut s),
        Err(_) => f(&mut Scratch::default()),
    })
}

/// Copies or decompresses a checked payload into `out`, which is exactly the chunk's raw length.
pub(crate) fn decode_payload(
    h: &ChunkHeader,
    payload: &[u8],
    out: &mut [u8],
    dctx: &mut zstd::bulk::Decompressor<'static>,
) -> Result<(), Check> {
    match h.codec {
        Codec::Raw if payload.len() == out.len() => {
            out.copy_from_slice(payload);
            Ok(())
        }
        Codec::Raw => Err(Check::Bad(format!(
            "raw payload of {} bytes, header says {} raw",
            payload.len(),
            out.len()
        ))),
        Codec::Zstd => {
            let n = dctx
                .decompress_to_buffer(payload, out)
                .map_err(|e| Check::Bad(format!("zstd: {e}")))?;
            if n != out.len() {
                return Err(Check::Bad(format!(
                    "decompressed to {n} bytes, header says {}",
                    out.len()
                )));
            }
            Ok(())
        }
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

/// Chunk counts by state and format, and byte totals.
struct Totals {
    stored: usize,
    missing: usize,
    quarantined: usize,
    by_format: [usize; KvFormat::ALL.len()],
    raw: u64,
    stored_bytes: u64,
    density_sum: f64,
}

impl Totals {
    fn of(infos: &[ContextInfo]) -> Totals {
        let mut t = Totals {
            stored: 0,
            missing: 0,
            quarantined: 0,
            by_format: [0; KvFormat::ALL.len()],
            raw: 0,
            stored_bytes: 0,
            density_sum: 0.0,
        };
        for c in infos.iter().flat_map(|i| &i.chunks) {
            match &c.state {
                ChunkState::Stored(s) => {
                    t.stored += 1;
                    t.by_format[s.format.tag() as usize] += 1;
                    t.raw += s.raw_len as u64;
                    t.stored_bytes += s.stored_len as u64;
                    t.density_sum += s.density as f64;
                }
                ChunkState::Missing => t.missing += 1,
                ChunkState::Quarantined { .. } => t.quarantined += 1,
            }
        }
        t
    }

    fn write(&self, s: &mut String) {
        use std::fmt::Write;
        let _ = writeln!(
            s,
            "chunks       {} stored, {} missing, {} quarantined",
            self.stored, self.missing, self.quarantined
        );
        let formats: Vec<String> = KvFormat::ALL
            .iter()
            .map(|f| format!("{} {}", f.name(), self.by_format[f.tag() as usize]))
            .collect();
        let _ = writeln!(s, "formats      {}", formats.join(", "));
        let ratio = if self.stored_bytes == 0 {
            1.0
        } else {
            self.raw as f64 / self.stored_bytes as f64
        };
        let _ = writeln!(
            s,
            "bytes        {} raw, {} stored (ratio {ratio:.3})",
            self.raw, self.stored_bytes
        );
        let mean = if self.stored == 0 {
            0.0
        } else {
            self.density_sum / self.stored as f64
        };
        let _ = writeln!(s, "density      {mean:.4} mean over stored chunks");
    }
}

/// Creates an empty data file in a context directory, durably.
fn create_data(dir: &Path) -> Result<(), IoError> {
    let path = dir.join("data");
    let f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&path)
        .map_err(|e| IoError::new("create", &path, e))?;
    f.sync_all().map_err(|e| IoError::new("fsync", &path, e))?;
    sync_dir(dir)
}

/// Opens a context's data file: for writing (or read-only) and, with `direct`, a second descriptor
/// with O_DIRECT for reads.
fn open_data(path: &Path, read_only: bool, direct: bool) -> Result<(File, Option<File>), IoError> {
    let data = OpenOptions::new()
        .read(true)
        .write(!read_only)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| IoError::new("open", path, e))?;
    let direct = if direct {
        Some(
            OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
                .open(path)
                .map_err(|e| IoError::new("open", path, e))?,
        )
    } else {
        None
    };
    Ok((data, direct))
}

/// The slots of a data file that hold any data (`slot` = 2 × index + copy), found with
/// `SEEK_DATA`/`SEEK_HOLE` so that the holes of a sparse file cost nothing.
fn occupied_slots(data: &File) -> std::io::Result<Vec<u64>> {
    use nix::unistd::{Whence, lseek};
    let len = data.metadata()?.len();
    let mut slots = Vec::new();
    let mut at = 0u64;
    while at < len {
        let start = match lseek(data, at as libc::off_t, Whence::SeekData) {
            Ok(o) => o as u64,
            Err(nix::errno::Errno::ENXIO) => break,
            Err(e) => return Err(e.into()),
        };
        let end = lseek(data, start as libc::off_t, Whence::SeekHole)? as u64;
        let (first, last) = (start / SLOT_BYTES, (end - 1) / SLOT_BYTES);
        for slot in first..=last {
            if slots.last() != Some(&slot) {
                slots.push(slot);
            }
        }
        at = end;
    }
    Ok(slots)
}
