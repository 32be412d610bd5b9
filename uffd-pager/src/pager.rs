//! The pager: context regions, chunk slots, the resident-byte budget, and the populate / reclaim / load / lock primitives.

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ops::{Deref, DerefMut};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr::NonNull;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use thiserror::Error;
use tracing::{debug, warn};

use crate::stats::{Stats, StatsSnapshot};
use crate::sys::{self, EventFd, Mapping, PAGE_SIZE, SysError, Uffd, page_round};
use crate::victim::{Candidate, LruChooser, ResidentView, VictimChooser};
use crate::{ChunkKey, ChunkSource, ContextId, SourceError};

/// Errors of the pager's primitives, each with the chunk or context it concerns.
#[derive(Debug, Error)]
pub enum PagerError {
    #[error("the pager is shut down")]
    ShutDown,
    #[error("setting up the pager failed: {source}")]
    Setup { source: SysError },
    #[error("context {ctx} already exists", ctx = .ctx.0)]
    ContextExists { ctx: ContextId },
    #[error("context {ctx} does not exist", ctx = .ctx.0)]
    NoContext { ctx: ContextId },
    #[error("{key} is beyond its context's {max_chunks} chunks")]
    NoChunk { key: ChunkKey, max_chunks: u32 },
    #[error("{key}: slot of {bytes} bytes exceeds the context's slot size {slot_max}")]
    SlotTooLarge {
        key: ChunkKey,
        bytes: usize,
        slot_max: usize,
    },
    #[error("{key}: a {bytes}-byte chunk can never fit the budget of {budget} bytes")]
    LargerThanBudget {
        key: ChunkKey,
        bytes: u64,
        budget: u64,
    },
    #[error(
        "{key}: needs {need} bytes but {resident} of {budget} are resident and nothing can be \
         reclaimed (every resident chunk is locked or busy); unlock a context or raise the budget"
    )]
    BudgetExhausted {
        key: ChunkKey,
        need: u64,
        resident: u64,
        budget: u64,
    },
    #[error("context {ctx} is locked by a running call", ctx = .ctx.0)]
    Locked { ctx: ContextId },
    #[error("context {ctx} must be locked for this access", ctx = .ctx.0)]
    NotLocked { ctx: ContextId },
    #[error("context {ctx} is not locked", ctx = .ctx.0)]
    NotLockedUnlock { ctx: ContextId },
    #[error("{key} is being populated by another thread")]
    Busy { key: ChunkKey },
    #[error("{key} is already resident; write it in place")]
    AlreadyResident { key: ChunkKey },
    #[error("{key} is not resident")]
    NotResident { key: ChunkKey },
    #[error("{key} holds zeros and must be recomputed before use")]
    NeedsRecompute { key: ChunkKey },
    #[error("{key}: the chunk source failed: {source}")]
    Source { key: ChunkKey, source: SourceError },
    #[error("{key}: populating failed: {source}")]
    Populate { key: ChunkKey, source: SysError },
    #[error("{key}: reclaiming failed: {source}")]
    Reclaim { key: ChunkKey, source: SysError },
    #[error("{key}: {len} bytes at offset {offset} fall outside the {bytes}-byte chunk")]
    OutOfRange {
        key: ChunkKey,
        offset: usize,
        len: usize,
        bytes: usize,
    },
    #[error("{key}: UFFDIO_MOVE needs a staging buffer of whole pages, got {len} bytes")]
    StagingTooSmall { key: ChunkKey, len: usize },
}

/// How `populate` puts bytes into a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum PopulateVia {
    /// UFFDIO_COPY: the kernel copies from the buffer into fresh pages.
    Copy,
    /// UFFDIO_MOVE (Linux 6.8+): the staging buffer's pages are remapped into the slot, no copy;
    /// the staging buffer is left empty and refaults on its next write.
    Move,
}

/// The pager's settings.
#[derive(Debug, Clone)]
pub struct PagerConfig {
    /// Hard limit on resident chunk bytes (page-rounded), across all contexts.
    pub budget_bytes: u64,
    /// The largest slot any context may ask for (sizes the fault thread's buffers).
    pub max_slot_bytes: usize,
    /// How the fault thread populates: `Copy` (the default: UFFDIO_COPY from a warm buffer, the
    /// best throughput), or `Move` (UFFDIO_MOVE from a buffer it warms up again while idle: lower
    /// latency for isolated faults, more CPU in bursts). `Move` falls back to `Copy` on kernels
    /// without UFFDIO_MOVE.
    pub fault_via: PopulateVia,
    /// Fail-stop for a source that never returns: if one fill on the fault thread, or one
    /// victim's write-back on any thread, takes longer, a watchdog stops the pager, which
    /// releases every faulting thread (`check` then reports `ShutDown`). `None` trusts the
    /// source to bound its own reads and writes.
    pub source_deadline: Option<Duration>,
}

impl PagerConfig {
    /// A budget and a largest slot, faults resolved by copy.
    pub fn new(budget_bytes: u64, max_slot_bytes: usize) -> PagerConfig {
        PagerConfig {
            budget_bytes,
            max_slot_bytes,
            fault_via: PopulateVia::Copy,
            source_deadline: Some(Duration::from_secs(10)),
        }
    }
}

/// The shape of one context's region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextSpec {
    /// The most chunks the context can hold (its maximum length in chunks).
    pub max_chunks: u32,
    /// The largest slot of any format (bytes; page-rounded by the pager).
    pub max_slot_bytes: usize,
}

/// Where a chunk is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum ChunkState {
    /// Never populated.
    Absent,
    /// Being populated right now (by the fault thread or an API call).
    Populating,
    /// Its bytes are in memory and counted against the budget.
    Resident,
    /// Mapped to the shared zero page because the budget was exhausted at fault time; costs nothing
    /// and needs recompute.
    ZeroMapped,
    /// Dropped; a touch faults it back in from the source.
    Reclaimed,
}

/// What the pager knows of one chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkInfo {
    /// Where it is.
    pub state: ChunkState,
    /// Its slot size in bytes (page-rounded); meaningful once populated.
    pub bytes: usize,
    /// Whether the engine marked it written out, or it was loaded from the source.
    pub persisted: bool,
    /// Whether it holds zeros that must be recomputed before use.
    pub needs_recompute: bool,
}

/// Why a chunk needs recompute.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecomputeReason {
    /// The source could not supply it (the chunk holds zeros).
    Source(SourceError),
    /// A fault found the budget exhausted; the chunk maps the zero page.
    BudgetExhausted,
}

/// A chunk the engine must recompute before it uses the chunk's data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecomputeRequest {
    /// The chunk.
    pub key: ChunkKey,
    /// Why.
    pub reason: RecomputeReason,
}

/// A page-aligned anonymous buffer for populating by UFFDIO_MOVE (or by copy).
#[derive(Debug)]
pub struct Staging {
    map: Mapping,
}

impl Staging {
    /// A staging buffer of at least `len` bytes (page-rounded).
    pub fn new(len: usize) -> Result<Staging, PagerError> {
        let map = Mapping::reserve(len).map_err(|source| PagerError::Setup { source })?;
        Ok(Staging { map })
    }

    /// Fault the whole buffer in, writable, ahead of use (MADV_POPULATE_WRITE): after a
    /// `populate_move` took its pages, a background thread can pay the page allocation here
    /// instead of the next writer.
    pub fn prefault(&mut self) -> Result<(), PagerError> {
        self.map
            .populate_write(0, self.map.len())
            .map_err(|source| PagerError::Setup { source })
    }

    /// Fault `[off, off+len)` of the buffer in (page-rounded), as `prefault` does for all of it.
    pub fn prefault_range(&mut self, off: usize, len: usize) -> Result<(), PagerError> {
        if !off.is_multiple_of(PAGE_SIZE) || off.saturating_add(len) > self.map.len() {
            return Err(PagerError::Setup {
                source: SysError::Unsupported {
                    what: "a page-aligned range inside the staging buffer",
                },
            });
        }
        self.map
            .populate_write(off, len)
            .map_err(|source| PagerError::Setup { source })
    }

    /// The buffer, to fill.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is ours, read-write, `len` bytes long, and `&mut self` makes this the
        // only reference to it; pages the kernel took by UFFDIO_MOVE read back as zeros.
        unsafe { std::slice::from_raw_parts_mut(self.map.ptr().as_ptr(), self.map.len()) }
    }

    /// The buffer, to read.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: as in `as_mut_slice`; `&self` excludes writers.
        unsafe { std::slice::from_raw_parts(self.map.ptr().as_ptr(), self.map.len()) }
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether it is empty (never).
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Slot {
    pub(crate) state: ChunkState,
    pub(crate) bytes: usize,
    pub(crate) persisted: bool,
    pub(crate) needs_recompute: bool,
    /// A resident victim being written back with the state lock released: still counted, no
    /// longer a candidate, and its context cannot be locked until the write ends.
    pub(crate) writing: bool,
}

pub(crate) struct Ctx {
    pub(crate) map: Arc<Mapping>,
    pub(crate) epoch: u64,
    pub(crate) stride: usize,
    pub(crate) slots: Vec<Slot>,
    pub(crate) locks: u32,
    /// How many of its chunks are being written back; while any are, `lock_context` waits (so
    /// nothing writes a chunk while `write_back` reads it) and so does `remove_context`.
    pub(crate) writing: u32,
}

/// Everything but the chooser, so the chooser can borrow a view of it.
pub(crate) struct Book {
    pub(crate) ctxs: HashMap<ContextId, Ctx>,
    pub(crate) by_addr: BTreeMap<usize, ContextId>,
    pub(crate) resident: u64,
    pub(crate) recompute: VecDeque<RecomputeRequest>,
    pub(crate) dead: bool,
    pub(crate) next_epoch: u64,
    /// Faults the fault thread deferred behind a populate or a write-back in flight; a finishing
    /// one wakes the fault thread only when there are some (an eventfd write costs a context
    /// switch).
    pub(crate) deferred: usize,
    /// The write-backs in flight and when each started, for the watchdog.
    pub(crate) writes: HashMap<ChunkKey, Instant>,
}

pub(crate) struct State {
    pub(crate) book: Book,
    pub(crate) chooser: Box<dyn VictimChooser>,
}

pub(crate) struct Shared {
    pub(crate) state: Mutex<State>,
    /// Signalled whenever a populate finishes (waiters on a `Populating` slot).
    pub(crate) populated: Condvar,
    pub(crate) uffd: Uffd,
    pub(crate) source: Arc<dyn ChunkSource>,
    /// The budget in bytes; `Pager::set_budget` changes it while running.
    pub(crate) budget: AtomicU64,
    pub(crate) max_slot: usize,
    /// Whether the fault thread populates by UFFDIO_MOVE.
    pub(crate) fault_move: bool,
    /// Never written: a source of zeros for UFFDIO_COPY that costs no memory.
    pub(crate) zeros: Mapping,
    pub(crate) stats: Stats,
    /// Wakes the fault thread: to stop, or to look again at the faults it deferred.
    pub(crate) wake: EventFd,
    pub(crate) exited: Mutex<bool>,
    pub(crate) exited_cv: Condvar,
    /// When the pager started: the origin of `fill_since`.
    pub(crate) born: Instant,
    /// Nanoseconds after `born` at which the fault thread's current fill started; 0 when idle.
    pub(crate) fill_since: AtomicU64,
    /// Set by `kill`; wakes the watchdog.
    pub(crate) watch_stop: Mutex<bool>,
    pub(crate) watch_cv: Condvar,
}

thread_local! {
    /// How many guards of a pager's state lock this thread holds: debug builds check it is none
    /// whenever the pager calls its source (a `fill` or a `write_back` is I/O, and a source may
    /// take locks of its own), so the lock order "the pager's state lock last" holds.
    static STATE_HELD: Cell<u32> = const { Cell::new(0) };
}

/// Panics in debug builds if this thread holds a pager's state lock.
fn assert_state_unlocked(what: &str) {
    debug_assert_eq!(
        STATE_HELD.with(Cell::get),
        0,
        "{what} called with the pager's state lock held"
    );
}

/// The state lock's guard, counted per thread while held (`STATE_HELD`).
pub(crate) struct StateGuard<'a> {
    inner: Option<MutexGuard<'a, State>>,
}

impl Deref for StateGuard<'_> {
    type Target = State;

    fn deref(&self) -> &State {
        self.inner
            .as_deref()
            .expect("a guard holds its lock until dropped")
    }
}

impl DerefMut for StateGuard<'_> {
    fn deref_mut(&mut self) -> &mut State {
        self.inner
            .as_deref_mut()
            .expect("a guard holds its lock until dropped")
    }
}

impl Drop for StateGuard<'_> {
    fn drop(&mut self) {
        if self.inner.take().is_some() {
            STATE_HELD.with(|h| h.set(h.get() - 1));
        }
    }
}

/// A reserved, not yet filled populate: the slot is `Populating` and its bytes are counted.
pub(crate) struct Reservation {
    pub(crate) key: ChunkKey,
    pub(crate) map: Arc<Mapping>,
    pub(crate) epoch: u64,
    pub(crate) offset: usize,
    pub(crate) bytes: usize,
    pub(crate) stride: usize,
    pub(crate) prev: Slot,
}

impl ResidentView for Book {
    fn candidate(&self, key: ChunkKey) -> Option<Candidate> {
        let c = self.ctxs.get(&key.ctx)?;
        if c.locks > 0 {
            return None;
        }
        let s = c.slots.get(key.index as usize)?;
        (s.state == ChunkState::Resident && !s.writing).then_some(Candidate {
            key,
            bytes: s.bytes as u64,
            persisted: s.persisted,
        })
    }

    fn is_locked(&self, ctx: ContextId) -> bool {
        self.ctxs.get(&ctx).is_some_and(|c| c.locks > 0)
    }

    fn for_each_candidate(&self, f: &mut dyn FnMut(Candidate)) {
        for (id, c) in &self.ctxs {
            if c.locks > 0 {
                continue;
            }
            for (i, s) in c.slots.iter().enumerate() {
                if s.state == ChunkState::Resident && !s.writing {
                    f(Candidate {
                        key: ChunkKey {
                            ctx: *id,
                            index: i as u32,
                        },
                        bytes: s.bytes as u64,
                        persisted: s.persisted,
                    });
                }
            }
        }
    }
}

impl Book {
    fn slot(&self, key: ChunkKey) -> Result<(&Ctx, &Slot), PagerError> {
        let c = self
            .ctxs
            .get(&key.ctx)
            .ok_or(PagerError::NoContext { ctx: key.ctx })?;
        let s = c.slots.get(key.index as usize).ok_or(PagerError::NoChunk {
            key,
            max_chunks: c.slots.len() as u32,
        })?;
        Ok((c, s))
    }

    /// The slot, its context's mapping, the slot's offset in it and the stride.
    fn slot_mut(
        &mut self,
        key: ChunkKey,
    ) -> Result<(&mut Slot, &Mapping, usize, usize), PagerError> {
        let c = self
            .ctxs
            .get_mut(&key.ctx)
            .ok_or(PagerError::NoContext { ctx: key.ctx })?;
        let max_chunks = c.slots.len() as u32;
        let stride = c.stride;
        let s = c
            .slots
            .get_mut(key.index as usize)
            .ok_or(PagerError::NoChunk { key, max_chunks })?;
        Ok((s, &c.map, key.index as usize * stride, stride))
    }
}

impl State {
    /// Drop one resident chunk's pages (state lock held). The slot's whole stride is dropped, so
    /// zero pages mapped past its end go too.
    pub(crate) fn drop_chunk(&mut self, stats: &Stats, key: ChunkKey) -> Result<u64, PagerError> {
        let t = Instant::now();
        let (slot, map, offset, stride) = self.book.slot_mut(key)?;
        let bytes = slot.bytes;
        map.dontneed(offset, stride)
            .map_err(|source| PagerError::Reclaim { key, source })?;
        let freed = if slot.state == ChunkState::Resident {
            bytes as u64
        } else {
            0
        };
        if slot.state == ChunkState::Resident && !slot.persisted {
            stats.unpersisted_reclaims.fetch_add(1, Relaxed);
        }
        slot.state = ChunkState::Reclaimed;
        self.book.resident -= freed;
        self.chooser.on_reclaim(key);
        stats.reclaims.fetch_add(1, Relaxed);
        stats.bytes_out.fetch_add(freed, Relaxed);
        stats.reclaim_latency.record(t.elapsed());
        Ok(freed)
    }

    /// Make room for `need` more resident bytes (state lock held), from the victims the chooser
    /// names (all of them: a whole-context chooser names a whole context, which goes whole).
    /// Victims that are persisted, await recompute, or that the source would not keep are dropped
    /// at once; the others are marked `writing` and returned, to be written back with the lock
    /// released ([`Shared::write_back`]) before they go.
    pub(crate) fn make_room(
        &mut self,
        stats: &Stats,
        writes_back: bool,
        budget: u64,
        need: u64,
    ) -> Result<Room, PagerError> {
        let mut jobs = Vec::new();
        // Bytes the marked victims will free once written.
        let mut pending = 0u64;
        while self.book.resident + need > budget + pending {
            let short = self.book.resident + need - budget - pending;
            let victims = self.chooser.choose_victims(short, &self.book);
            let mut progress = 0;
            for v in victims {
                let Some(c) = self.book.candidate(v) else {
                    continue;
                };
                let needs_write = writes_back
                    && !c.persisted
                    && self.book.slot(v).is_ok_and(|(_, s)| !s.needs_recompute);
                if needs_write {
                    jobs.push(self.mark_writing(v));
                    pending += c.bytes;
                    progress += c.bytes;
                    continue;
                }
                match self.drop_chunk(stats, v) {
                    Ok(freed) => progress += freed,
                    Err(e) => {
                        for job in &jobs {
                            self.unmark_writing(job);
                        }
                        return Err(e);
                    }
                }
            }
            if progress == 0 {
                break;
            }
        }
        if !jobs.is_empty() {
            return Ok(Room::Write(jobs));
        }
        if self.book.resident + need <= budget {
            return Ok(Room::Ready);
        }
        if !self.book.writes.is_empty() {
            return Ok(Room::Wait);
        }
        stats.budget_refusals.fetch_add(1, Relaxed);
        Ok(Room::Full)
    }

    /// Mark a resident victim as being written back (state lock held).
    pub(crate) fn mark_writing(&mut self, key: ChunkKey) -> WriteBack {
        let c = self
            .book
            .ctxs
            .get_mut(&key.ctx)
            .expect("a candidate's context exists");
        let slot = &mut c.slots[key.index as usize];
        slot.writing = true;
        c.writing += 1;
        self.book.writes.insert(key, Instant::now());
        WriteBack {
            key,
            map: Arc::clone(&c.map),
            epoch: c.epoch,
            offset: key.index as usize * c.stride,
            bytes: slot.bytes,
        }
    }

    /// Clear a write-back's marks (state lock held); whether its slot is still the one marked.
    fn unmark_writing(&mut self, job: &WriteBack) -> bool {
        self.book.writes.remove(&job.key);
        let Some(c) = self.book.ctxs.get_mut(&job.key.ctx) else {
            return false;
        };
        if c.epoch != job.epoch {
            return false;
        }
        let slot = &mut c.slots[job.key.index as usize];
        if !slot.writing {
            return false;
        }
        slot.writing = false;
        c.writing -= 1;
        true
    }

    /// End a write-back (state lock held): a victim written is persisted; written or given up,
    /// it is dropped (its context cannot have been locked meanwhile). Returns the bytes freed.
    pub(crate) fn finish_write(
        &mut self,
        stats: &Stats,
        job: &WriteBack,
        written: std::thread::Result<Result<bool, SourceError>>,
        secs: f64,
    ) -> u64 {
        if !self.unmark_writing(job) {
            // The context was removed meanwhile; its bytes went with it.
            return 0;
        }
        let key = job.key;
        match written {
            Ok(Ok(true)) => {
                if let Ok((slot, ..)) = self.book.slot_mut(key) {
                    slot.persisted = true;
                }
                stats.sync_reclaims.fetch_add(1, Relaxed);
                debug!(chunk = %key, secs, "written back before reclaim");
            }
            Ok(Ok(false)) => {}
            Ok(Err(e)) => {
                stats.source_errors.fetch_add(1, Relaxed);
                warn!(chunk = %key, error = %e, "writing a victim back failed; it is given up");
            }
            Err(_) => {
                stats.source_errors.fetch_add(1, Relaxed);
                warn!(chunk = %key, "the source panicked writing a victim back; it is given up");
            }
        }
        let droppable = self
            .book
            .slot(key)
            .is_ok_and(|(c, s)| c.locks == 0 && s.state == ChunkState::Resident);
        if !droppable {
            return 0;
        }
        match self.drop_chunk(stats, key) {
            Ok(freed) => freed,
            Err(e) => {
                warn!(chunk = %key, error = %e, "dropping a written-back victim failed");
                0
            }
        }
    }
}

/// What making room found (`State::make_room`).
pub(crate) enum Room {
    /// The budget has room now.
    Ready,
    /// Victims to write back first, their slots marked: write them with the lock released
    /// ([`Shared::write_back`]), then ask again.
    Write(Vec<WriteBack>),
    /// Only write-backs already in flight can free room: wait for one to end, then ask again.
    Wait,
    /// Nothing can be freed: everything resident is locked or being populated.
    Full,
}

/// A victim marked as being written back: what the writer needs once the lock is released.
pub(crate) struct WriteBack {
    pub(crate) key: ChunkKey,
    /// Its context's mapping, kept mapped for the write even if the context goes meanwhile.
    pub(crate) map: Arc<Mapping>,
    pub(crate) epoch: u64,
    pub(crate) offset: usize,
    pub(crate) bytes: usize,
}

/// What `Shared::reserve` found.
pub(crate) enum Reserved {
    /// The slot is `Populating` and its bytes are counted: fill it and `finish`.
    Slot(Reservation),
    /// As [`Room::Write`].
    Write(Vec<WriteBack>),
    /// As [`Room::Wait`].
    Wait,
}

impl Shared {
    pub(crate) fn lock(&self) -> StateGuard<'_> {
        // The chooser is the only foreign code run under the lock, and it runs before any change
        // to the book, so a poisoned lock still guards a consistent book.
        let inner = self.state.lock().unwrap_or_else(|e| e.into_inner());
        STATE_HELD.with(|h| h.set(h.get() + 1));
        StateGuard { inner: Some(inner) }
    }

    /// Wait on `populated` (a populate, a write-back or a shutdown ended), the lock released
    /// meanwhile.
    pub(crate) fn wait<'a>(&'a self, mut guard: StateGuard<'a>) -> StateGuard<'a> {
        let inner = guard
            .inner
            .take()
            .expect("a guard holds its lock until dropped");
        STATE_HELD.with(|h| h.set(h.get() - 1));
        let inner = self
            .populated
            .wait(inner)
            .unwrap_or_else(|e| e.into_inner());
        STATE_HELD.with(|h| h.set(h.get() + 1));
        StateGuard { inner: Some(inner) }
    }

    /// Turn a non-resident slot into `Populating` with its bytes reserved (state lock held).
    /// `bytes` is the slot size, `None` for "as it was" (a reclaimed chunk coming back).
    /// Making room may first need victims written back ([`Reserved::Write`]) or write-backs in
    /// flight to end ([`Reserved::Wait`]); the slot is then left as it was.
    pub(crate) fn reserve(
        &self,
        st: &mut State,
        key: ChunkKey,
        bytes: Option<usize>,
    ) -> Result<Reserved, PagerError> {
        let (c, s) = st.book.slot(key)?;
        let stride = c.stride;
        let bytes = match bytes {
            Some(b) => page_round(b.max(1)),
            None if s.state == ChunkState::Reclaimed => s.bytes,
            None => stride,
        };
        if bytes > stride {
            return Err(PagerError::SlotTooLarge {
                key,
                bytes,
                slot_max: stride,
            });
        }
        match s.state {
            ChunkState::Resident => return Err(PagerError::AlreadyResident { key }),
            ChunkState::Populating => return Err(PagerError::Busy { key }),
            ChunkState::Absent | ChunkState::Reclaimed | ChunkState::ZeroMapped => {}
        }
        let budget = self.budget.load(Relaxed);
        let need = bytes as u64;
        if need > budget {
            return Err(PagerError::LargerThanBudget {
                key,
                bytes: need,
                budget,
            });
        }
        match st.make_room(&self.stats, self.source.writes_back(), budget, need)? {
            Room::Ready => {}
            Room::Write(jobs) => return Ok(Reserved::Write(jobs)),
            Room::Wait => return Ok(Reserved::Wait),
            Room::Full => {
                return Err(PagerError::BudgetExhausted {
                    key,
                    need,
                    resident: st.book.resident,
                    budget,
                });
            }
        }
        let c = st
            .book
            .ctxs
            .get_mut(&key.ctx)
            .ok_or(PagerError::NoContext { ctx: key.ctx })?;
        let offset = key.index as usize * c.stride;
        let slot = &mut c.slots[key.index as usize];
        let prev = *slot;
        if prev.state == ChunkState::ZeroMapped {
            c.map
                .dontneed(offset, c.stride)
                .map_err(|source| PagerError::Populate { key, source })?;
        }
        slot.state = ChunkState::Populating;
        st.book.resident += bytes as u64;
        Ok(Reserved::Slot(Reservation {
            key,
            map: Arc::clone(&c.map),
            epoch: c.epoch,
            offset,
            bytes,
            stride: c.stride,
            prev,
        }))
    }

    /// Write victims back through the source, with the state lock released (this is disk I/O:
    /// no fault, populate or lock waits behind it unless it needs this very room), then finish
    /// each under the lock, waking whoever waits for room. Returns the bytes freed.
    pub(crate) fn write_back(&self, jobs: Vec<WriteBack>) -> u64 {
        let mut freed = 0;
        for job in jobs {
            assert_state_unlocked("a chunk source's write_back");
            // SAFETY: `job.map` keeps the context's mapping alive, and `offset + bytes` lies
            // inside it (the slot's page-rounded bytes at its index's offset, checked when the
            // slot was populated). The slot is resident and marked `writing`, which keeps it from
            // being reclaimed (it is no candidate) and its context from being locked (so no one
            // writes it: only a lock holder writes a slot) until `finish_write` below; a resident
            // slot was populated whole, so reading it faults on nothing.
            let data = unsafe {
                std::slice::from_raw_parts(job.map.ptr().add(job.offset).as_ptr(), job.bytes)
            };
            let t = Instant::now();
            let written = catch_unwind(AssertUnwindSafe(|| self.source.write_back(job.key, data)));
            self.stats.write_back_latency.record(t.elapsed());
            let secs = t.elapsed().as_secs_f64();
            let mut st = self.lock();
            freed += st.finish_write(&self.stats, &job, written, secs);
            self.populated.notify_all();
            if st.book.deferred > 0 {
                self.wake.signal();
            }
        }
        freed
    }

    /// Finish a populate (taking the state lock's guard, released before the waiting threads are
    /// woken): the slot becomes resident, or goes back on failure.
    pub(crate) fn finish(
        &self,
        mut guard: StateGuard<'_>,
        r: &Reservation,
        ok: bool,
        persisted: bool,
        recompute: Option<RecomputeReason>,
    ) {
        let st = &mut *guard;
        let alive = st
            .book
            .ctxs
            .get(&r.key.ctx)
            .is_some_and(|c| c.epoch == r.epoch);
        if !alive {
            // The context was removed while we populated; its bytes went with it.
            st.book.resident -= r.bytes as u64;
            self.populated.notify_all();
            if st.book.deferred > 0 {
                self.wake.signal();
            }
            return;
        }
        let c = st
            .book
            .ctxs
            .get_mut(&r.key.ctx)
            .expect("checked alive above");
        let slot = &mut c.slots[r.key.index as usize];
        if ok {
            *slot = Slot {
                state: ChunkState::Resident,
                bytes: r.bytes,
                persisted,
                needs_recompute: recompute.is_some(),
                writing: false,
            };
            st.chooser.on_populate(r.key, r.bytes as u64);
            st.book.recompute.retain(|q| q.key != r.key);
            self.stats.populates.fetch_add(1, Relaxed);
            self.stats.bytes_in.fetch_add(r.bytes as u64, Relaxed);
            if let Some(reason) = recompute {
                st.book
                    .recompute
                    .push_back(RecomputeRequest { key: r.key, reason });
                self.stats.recompute_requests.fetch_add(1, Relaxed);
            }
        } else {
            *slot = r.prev;
            if slot.state == ChunkState::ZeroMapped {
                slot.state = ChunkState::Reclaimed;
            }
            st.book.resident -= r.bytes as u64;
            // Pages copied before the failure must not linger uncounted.
            let _ = c.map.dontneed(r.offset, r.stride);
        }
        self.populated.notify_all();
        if st.book.deferred > 0 {
            self.wake.signal();
        }
        drop(guard);
        // The copy or move woke no one: threads that faulted on the slot resume only now, once
        // the books say what their bytes are (a failed fill, for instance, is marked for
        // recompute before anyone reads its zeros), and outside the lock. Where nothing is
        // mapped (a failure, or a reclaim since), they fault again and are served afresh.
        if let Err(e) = self.uffd.wake(r.map.addr() + r.offset, r.stride) {
            warn!(chunk = %r.key, error = %e, "waking faulting threads failed");
        }
    }

    /// Copy `src` (exactly `r.bytes`, whole pages) into the reserved slot, retrying EAGAIN and
    /// clearing stray pages on EEXIST once. Wakes no one: [`Shared::finish`] does.
    pub(crate) fn copy_in(&self, r: &Reservation, src: &[u8]) -> Result<(), SysError> {
        let base = r.map.addr() + r.offset;
        let mut done = 0;
        let mut cleared = false;
        let mut retries = 0;
        while done < src.len() {
            match self.uffd.copy(base + done, &src[done..], false) {
                Ok(()) => done = src.len(),
                Err(SysError::Partial {
                    done: d, source, ..
                }) if source.raw_os_error() == Some(libc::EAGAIN) && retries < 1000 => {
                    // The address space is changing (mremap, fork...): the kernel copied `d`
                    // bytes and asks us to try the rest again.
                    done += d;
                    retries += 1;
                    self.stats.eagain_retries.fetch_add(1, Relaxed);
                    std::thread::yield_now();
                }
                Err(SysError::Partial { source, .. })
                    if source.raw_os_error() == Some(libc::EEXIST) && !cleared =>
                {
                    // A page is already mapped: a zero page from a stray touch past a shrunk
                    // chunk, or a write that raced us. Our slot is `Populating`, so clear it all
                    // and copy again from the start.
                    r.map.dontneed(r.offset, r.stride)?;
                    cleared = true;
                    done = 0;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Move whole pages from `staging` into the reserved slot; falls back to copying what the
    /// kernel would not move (holes in the staging buffer, or no MOVE support). Wakes no one:
    /// [`Shared::finish`] does.
    pub(crate) fn move_in(&self, r: &Reservation, staging: &mut Staging) -> Result<(), SysError> {
        let base = r.map.addr() + r.offset;
        let src = staging.map.addr();
        // SAFETY: the staging mapping is private anonymous and ours; `&mut Staging` keeps every
        // other user away during the call, and its owner gives up the moved contents.
        match unsafe { self.uffd.move_pages(base, src, r.bytes, false) } {
            Ok(()) => Ok(()),
            Err(SysError::Partial { done, .. }) => {
                let rest = Reservation {
                    key: r.key,
                    map: Arc::clone(&r.map),
                    epoch: r.epoch,
                    offset: r.offset + done,
                    bytes: r.bytes - done,
                    stride: r.stride - done,
                    prev: r.prev,
                };
                self.copy_in(&rest, &staging.as_slice()[done..r.bytes])
            }
            Err(SysError::Unsupported { .. }) => self.copy_in(r, &staging.as_slice()[..r.bytes]),
            Err(e) => Err(e),
        }
    }

    /// Ask the source for a chunk, turning a panic into an error.
    pub(crate) fn fill(&self, key: ChunkKey, dst: &mut [u8]) -> Result<(), SourceError> {
        assert_state_unlocked("a chunk source's fill");
        let r = catch_unwind(AssertUnwindSafe(|| self.source.fill(key, dst)))
            .unwrap_or(Err(SourceError::Panicked { key }));
        if r.is_err() {
            self.stats.source_errors.fetch_add(1, Relaxed);
            dst.fill(0);
        }
        r
    }

    /// Wait while a slot is being populated or written back by someone else (state lock held).
    pub(crate) fn wait_populated<'a>(
        &'a self,
        mut st: StateGuard<'a>,
        key: ChunkKey,
    ) -> Result<StateGuard<'a>, PagerError> {
        loop {
            if st.book.dead {
                return Err(PagerError::ShutDown);
            }
            let (_, s) = st.book.slot(key)?;
            if s.state != ChunkState::Populating && !s.writing {
                return Ok(st);
            }
            st = self.wait(st);
        }
    }

    /// Wait while any chunk of a context is being written back (state lock held): locking or
    /// removing the context waits for those writes, so nothing changes a slot under them.
    pub(crate) fn wait_written<'a>(
        &'a self,
        mut st: StateGuard<'a>,
        ctx: ContextId,
    ) -> Result<StateGuard<'a>, PagerError> {
        loop {
            if st.book.dead {
                return Err(PagerError::ShutDown);
            }
            let c = st
                .book
                .ctxs
                .get(&ctx)
                .ok_or(PagerError::NoContext { ctx })?;
            if c.writing == 0 {
                return Ok(st);
            }
            self.stats.lock_waits.fetch_add(1, Relaxed);
            st = self.wait(st);
        }
    }

    /// Reserve `key`'s slot for a call on this thread: victims not yet written are written back
    /// by this thread with the lock released, and write-backs in flight on other threads waited
    /// for, until there is room. `None` when `skip_resident` and the chunk is resident already.
    pub(crate) fn reserve_here(
        &self,
        key: ChunkKey,
        bytes: Option<usize>,
        skip_resident: bool,
    ) -> Result<Option<Reservation>, PagerError> {
        let mut st = self.lock();
        loop {
            st = self.wait_populated(st, key)?;
            if skip_resident && st.book.slot(key)?.1.state == ChunkState::Resident {
                return Ok(None);
            }
            match self.reserve(&mut st, key, bytes)? {
                Reserved::Slot(r) => return Ok(Some(r)),
                Reserved::Write(jobs) => {
                    drop(st);
                    self.write_back(jobs);
                    st = self.lock();
                }
                Reserved::Wait => {
                    st = self.wait(st);
                }
            }
        }
    }

    /// Mark the pager dead and unregister every region, which wakes every thread blocked on a
    /// fault in them (they then read zeros, and `check` tells them the pager is gone).
    pub(crate) fn kill(&self) {
        let mut st = self.lock();
        if st.book.dead {
            return;
        }
        st.book.dead = true;
        for c in st.book.ctxs.values() {
            if let Err(e) = self.uffd.unregister(c.map.addr(), c.map.len()) {
                warn!(error = %e, "unregistering a region at shutdown failed");
            }
        }
        self.populated.notify_all();
        drop(st);
        self.wake.signal();
        *self.watch_stop.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.watch_cv.notify_all();
    }

    /// Mark the start (`true`) or end of a fill on the fault thread, for the watchdog.
    pub(crate) fn fill_mark(&self, start: bool) {
        let now = if start {
            u64::try_from(self.born.elapsed().as_nanos())
                .unwrap_or(u64::MAX)
                .max(1)
        } else {
            0
        };
        self.fill_since.store(now, Relaxed);
    }
}

/// The pager: owns the userfaultfd, the regions, the budget and the fault thread.
/// Shut it down with [`Pager::shutdown`] (or drop it); threads blocked on faults are released.
pub struct Pager {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
    watchdog: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Pager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pager")
            .field("budget", &self.shared.budget.load(Relaxed))
            .finish_non_exhaustive()
    }
}

impl Pager {
    /// Start a pager with the default LRU victim chooser.
    pub fn new(config: PagerConfig, source: Arc<dyn ChunkSource>) -> Result<Pager, PagerError> {
        Pager::with_chooser(config, source, Box::new(LruChooser::new()))
    }

    /// Start a pager: open the userfaultfd and spawn the fault thread.
    pub fn with_chooser(
        config: PagerConfig,
        source: Arc<dyn ChunkSource>,
        chooser: Box<dyn VictimChooser>,
    ) -> Result<Pager, PagerError> {
        let page = sys::kernel_page_size();
        if page != PAGE_SIZE {
            return Err(PagerError::Setup {
                source: SysError::Unsupported {
                    what: "4 KiB pages",
                },
            });
        }
        let uffd = Uffd::open().map_err(|source| PagerError::Setup { source })?;
        let uffd_move = uffd.move_supported();
        let wake = EventFd::new().map_err(|source| PagerError::Setup { source })?;
        let max_slot = page_round(config.max_slot_bytes.max(1));
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                book: Book {
                    ctxs: HashMap::new(),
                    by_addr: BTreeMap::new(),
                    resident: 0,
                    recompute: VecDeque::new(),
                    dead: false,
                    next_epoch: 1,
                    deferred: 0,
                    writes: HashMap::new(),
                },
                chooser,
            }),
            populated: Condvar::new(),
            uffd,
            source,
            budget: AtomicU64::new(config.budget_bytes),
            max_slot,
            fault_move: config.fault_via == PopulateVia::Move && uffd_move,
            zeros: Mapping::reserve(max_slot).map_err(|source| PagerError::Setup { source })?,
            stats: Stats::default(),
            wake,
            exited: Mutex::new(false),
            exited_cv: Condvar::new(),
            born: Instant::now(),
            fill_since: AtomicU64::new(0),
            watch_stop: Mutex::new(false),
            watch_cv: Condvar::new(),
        });
        let bufs = (Staging::new(max_slot)?, Staging::new(max_slot)?);
        let thread = crate::fault::spawn(Arc::clone(&shared), bufs)
            .map_err(|source| PagerError::Setup { source })?;
        let watchdog = match config.source_deadline {
            Some(deadline) => Some(spawn_watchdog(Arc::clone(&shared), deadline)?),
            None => None,
        };
        Ok(Pager {
            shared,
            thread: Mutex::new(Some(thread)),
            watchdog: Mutex::new(watchdog),
        })
    }

    /// Whether populate-by-move is available on this kernel.
    pub fn move_supported(&self) -> bool {
        self.shared.uffd.move_supported()
    }

    /// The budget in bytes.
    pub fn budget(&self) -> u64 {
        self.shared.budget.load(Relaxed)
    }

    /// Change the budget (memory pressure lowers it, relief raises it). A lower budget is met at
    /// once by reclaiming victims the chooser names; locked contexts are not touched, so the
    /// resident bytes may stay above the new budget until they unlock (the next populate then
    /// reclaims first). Returns the bytes freed now.
    pub fn set_budget(&self, budget_bytes: u64) -> Result<u64, PagerError> {
        let mut st = self.live()?;
        self.shared.budget.store(budget_bytes, Relaxed);
        let writes_back = self.shared.source.writes_back();
        let mut freed = 0;
        loop {
            let before = st.book.resident;
            let room = st.make_room(&self.shared.stats, writes_back, budget_bytes, 0)?;
            freed += before - st.book.resident;
            match room {
                Room::Write(jobs) => {
                    drop(st);
                    freed += self.shared.write_back(jobs);
                    st = self.live()?;
                }
                // Write-backs in flight elsewhere will free their part; nothing more to free.
                Room::Ready | Room::Wait | Room::Full => break,
            }
        }
        debug!(budget_bytes, freed, "budget changed");
        Ok(freed)
    }

    /// Lock a context against reclaim until the returned guard drops, and read its resident
    /// chunks through the guard.
    pub fn lock(&self, ctx: ContextId) -> Result<ContextLock, PagerError> {
        self.lock_context(ctx)?;
        Ok(ContextLock {
            shared: Arc::clone(&self.shared),
            ctx,
        })
    }

    /// Resident bytes as accounted (page-rounded slots, including populates in flight).
    pub fn resident_bytes(&self) -> u64 {
        self.shared.lock().book.resident
    }

    /// The counters.
    pub fn stats(&self) -> StatsSnapshot {
        self.shared.stats.snapshot()
    }

    /// Reserve a region for a new context and register it with userfaultfd.
    pub fn add_context(&self, ctx: ContextId, spec: ContextSpec) -> Result<(), PagerError> {
        let stride = page_round(spec.max_slot_bytes.max(1));
        if stride > self.shared.max_slot {
            return Err(PagerError::SlotTooLarge {
                key: ChunkKey { ctx, index: 0 },
                bytes: stride,
                slot_max: self.shared.max_slot,
            });
        }
        let mut st = self.shared.lock();
        if st.book.dead {
            return Err(PagerError::ShutDown);
        }
        if st.book.ctxs.contains_key(&ctx) {
            return Err(PagerError::ContextExists { ctx });
        }
        let max_chunks = spec.max_chunks.max(1) as usize;
        let len = stride * max_chunks;
        let map = Mapping::reserve(len).map_err(|source| PagerError::Setup { source })?;
        self.shared
            .uffd
            .register(map.addr(), map.len())
            .map_err(|source| PagerError::Setup { source })?;
        let epoch = st.book.next_epoch;
        st.book.next_epoch += 1;
        st.book.by_addr.insert(map.addr(), ctx);
        st.book.ctxs.insert(
            ctx,
            Ctx {
                map: Arc::new(map),
                epoch,
                stride,
                slots: vec![
                    Slot {
                        state: ChunkState::Absent,
                        bytes: 0,
                        persisted: false,
                        needs_recompute: false,
                        writing: false,
                    };
                    max_chunks
                ],
                locks: 0,
                writing: 0,
            },
        );
        debug!(ctx = ctx.0, len, "context region reserved");
        Ok(())
    }

    /// Drop a context: its pages go back to the kernel and its region is unmapped (once no
    /// populate into it is in flight). Refused while the context is locked; waits while one of
    /// its chunks is being written back.
    pub fn remove_context(&self, ctx: ContextId) -> Result<(), PagerError> {
        let st = self.shared.lock();
        let mut st = if st.book.dead {
            st
        } else {
            self.shared.wait_written(st, ctx)?
        };
        let c = st
            .book
            .ctxs
            .get(&ctx)
            .ok_or(PagerError::NoContext { ctx })?;
        if c.locks > 0 {
            return Err(PagerError::Locked { ctx });
        }
        let c = st.book.ctxs.remove(&ctx).expect("looked up above");
        st.book.by_addr.remove(&c.map.addr());
        let mut freed = 0;
        for (i, s) in c.slots.iter().enumerate() {
            if s.state == ChunkState::Resident {
                freed += s.bytes as u64;
                st.chooser.on_reclaim(ChunkKey {
                    ctx,
                    index: i as u32,
                });
            }
        }
        st.book.resident -= freed;
        st.book.recompute.retain(|r| r.key.ctx != ctx);
        if !st.book.dead {
            let _ = self.shared.uffd.unregister(c.map.addr(), c.map.len());
        }
        let _ = c.map.dontneed(0, c.map.len());
        self.shared.stats.bytes_out.fetch_add(freed, Relaxed);
        Ok(())
    }

    fn live(&self) -> Result<StateGuard<'_>, PagerError> {
        let st = self.shared.lock();
        if st.book.dead {
            return Err(PagerError::ShutDown);
        }
        Ok(st)
    }

    /// Claim: make a chunk resident with `data` (zero-padded to `slot_bytes`, page-rounded), by
    /// UFFDIO_COPY. Reclaims victims if the budget needs room; the chunk starts unpersisted.
    pub fn populate(
        &self,
        key: ChunkKey,
        slot_bytes: usize,
        data: &[u8],
    ) -> Result<(), PagerError> {
        let _span = tracing::debug_span!("populate", chunk = %key).entered();
        let t = Instant::now();
        if data.len() > slot_bytes {
            return Err(PagerError::OutOfRange {
                key,
                offset: 0,
                len: data.len(),
                bytes: slot_bytes,
            });
        }
        let r = self
            .shared
            .reserve_here(key, Some(slot_bytes), false)?
            .expect("reserved unless resident and skipped");
        let whole = data.len() / PAGE_SIZE * PAGE_SIZE;
        let mut res = self.shared.copy_in(&sub(&r, 0, whole), &data[..whole]);
        if res.is_ok() && whole < r.bytes {
            // The tail: the last partial page of `data`, then zero pages up to the slot size.
            let mut page = [0u8; PAGE_SIZE];
            let tail = &data[whole..];
            page[..tail.len()].copy_from_slice(tail);
            res = self.shared.copy_in(&sub(&r, whole, PAGE_SIZE), &page);
            let rest = whole + PAGE_SIZE;
            if res.is_ok() && rest < r.bytes {
                let len = r.bytes - rest;
                // SAFETY: `zeros` is a live, never-written mapping of `max_slot >= len` bytes;
                // reading it yields zeros (the shared zero page), and nothing writes it.
                let zeros =
                    unsafe { std::slice::from_raw_parts(self.shared.zeros.ptr().as_ptr(), len) };
                res = self.shared.copy_in(&sub(&r, rest, len), zeros);
            }
        }
        self.complete(r, res, false, t)
    }

    /// Claim by UFFDIO_MOVE: the first `slot_bytes` (page-rounded) of `staging` become the chunk's
    /// pages without a copy; `staging` reads as zeros afterwards. Falls back to copying where the
    /// kernel cannot move.
    pub fn populate_move(
        &self,
        key: ChunkKey,
        slot_bytes: usize,
        staging: &mut Staging,
    ) -> Result<(), PagerError> {
        let _span = tracing::debug_span!("populate_move", chunk = %key).entered();
        let t = Instant::now();
        if page_round(slot_bytes) > staging.len() {
            return Err(PagerError::StagingTooSmall {
                key,
                len: staging.len(),
            });
        }
        let r = self
            .shared
            .reserve_here(key, Some(slot_bytes), false)?
            .expect("reserved unless resident and skipped");
        let res = self.shared.move_in(&r, staging);
        self.complete(r, res, false, t)
    }

    /// Load: bring a non-resident chunk back from the source in the calling thread, using
    /// `staging` as the buffer. Already resident: nothing to do. If the source fails, the chunk
    /// stays non-resident (no budget spent) and the error says why: recompute it and `populate`.
    pub fn load(&self, key: ChunkKey, staging: &mut Staging) -> Result<(), PagerError> {
        let _span = tracing::debug_span!("load", chunk = %key).entered();
        let t = Instant::now();
        let st = self.live()?;
        let (c, _) = st.book.slot(key)?;
        if c.stride > staging.len() {
            return Err(PagerError::StagingTooSmall {
                key,
                len: staging.len(),
            });
        }
        drop(st);
        let Some(r) = self.shared.reserve_here(key, None, true)? else {
            return Ok(());
        };
        let buf = &mut staging.as_mut_slice()[..r.bytes];
        if let Err(source) = self.shared.fill(key, buf) {
            self.shared
                .finish(self.shared.lock(), &r, false, false, None);
            return Err(PagerError::Source { key, source });
        }
        let res = self.shared.copy_in(&r, buf);
        self.complete(r, res, true, t)
    }

    fn complete(
        &self,
        r: Reservation,
        res: Result<(), SysError>,
        persisted: bool,
        t: Instant,
    ) -> Result<(), PagerError> {
        self.shared
            .finish(self.shared.lock(), &r, res.is_ok(), persisted, None);
        self.shared.stats.populate_latency.record(t.elapsed());
        res.map_err(|source| PagerError::Populate { key: r.key, source })
    }

    /// Evict: reclaim a resident chunk as the budget does, writing it back through the source
    /// first if it was never written out (see [`ChunkSource::write_back`]). Refused while its
    /// context is locked. Returns the bytes freed.
    pub fn evict(&self, key: ChunkKey) -> Result<u64, PagerError> {
        let _span = tracing::debug_span!("evict", chunk = %key).entered();
        self.drop_one(key, true)
    }

    /// Reclaim: drop a resident chunk's pages (MADV_DONTNEED), never writing it anywhere (a chunk
    /// not written out is lost and must be recomputed). Refused while its context is locked.
    /// Returns the bytes freed.
    pub fn reclaim(&self, key: ChunkKey) -> Result<u64, PagerError> {
        let _span = tracing::debug_span!("reclaim", chunk = %key).entered();
        self.drop_one(key, false)
    }

    fn drop_one(&self, key: ChunkKey, write_back: bool) -> Result<u64, PagerError> {
        let st = self.live()?;
        let mut st = self.shared.wait_populated(st, key)?;
        let (c, s) = st.book.slot(key)?;
        if c.locks > 0 {
            return Err(PagerError::Locked { ctx: key.ctx });
        }
        let needs_write = write_back
            && self.shared.source.writes_back()
            && s.state == ChunkState::Resident
            && !s.persisted
            && !s.needs_recompute;
        match s.state {
            ChunkState::Resident if needs_write => {
                let job = st.mark_writing(key);
                drop(st);
                Ok(self.shared.write_back(vec![job]))
            }
            ChunkState::Resident | ChunkState::ZeroMapped => st.drop_chunk(&self.shared.stats, key),
            _ => Err(PagerError::NotResident { key }),
        }
    }

    /// Shrink a resident chunk in place to `new_bytes` (page-rounded), after the engine rewrote it
    /// in a smaller format at the start of its slot; the tail pages go back to the kernel.
    pub fn shrink(&self, key: ChunkKey, new_bytes: usize) -> Result<u64, PagerError> {
        let _span = tracing::debug_span!("shrink", chunk = %key).entered();
        let st = self.live()?;
        let mut st = self.shared.wait_populated(st, key)?;
        let new = page_round(new_bytes.max(1));
        let (slot, map, offset, _) = st.book.slot_mut(key)?;
        if slot.state != ChunkState::Resident {
            return Err(PagerError::NotResident { key });
        }
        if new >= slot.bytes {
            return Ok(0);
        }
        map.dontneed(offset + new, slot.bytes - new)
            .map_err(|source| PagerError::Reclaim { key, source })?;
        let freed = (slot.bytes - new) as u64;
        slot.bytes = new;
        slot.persisted = false;
        st.book.resident -= freed;
        st.chooser.on_resize(key, new as u64);
        self.shared.stats.shrinks.fetch_add(1, Relaxed);
        self.shared.stats.bytes_out.fetch_add(freed, Relaxed);
        Ok(freed)
    }

    /// How many chunks a context's region holds.
    pub fn context_chunks(&self, ctx: ContextId) -> Result<u32, PagerError> {
        let st = self.shared.lock();
        let c = st
            .book
            .ctxs
            .get(&ctx)
            .ok_or(PagerError::NoContext { ctx })?;
        Ok(c.slots.len() as u32)
    }

    /// The bytes a context's resident chunks occupy, as accounted.
    pub fn context_resident(&self, ctx: ContextId) -> Result<u64, PagerError> {
        let st = self.shared.lock();
        let c = st
            .book
            .ctxs
            .get(&ctx)
            .ok_or(PagerError::NoContext { ctx })?;
        Ok(c.slots
            .iter()
            .filter(|s| s.state == ChunkState::Resident)
            .map(|s| s.bytes as u64)
            .sum())
    }

    /// Lock a context's chunks against reclaim (nests). Waits while one of its chunks is being
    /// written back as a victim (nothing may write a slot that a write-back reads).
    pub fn lock_context(&self, ctx: ContextId) -> Result<(), PagerError> {
        let st = self.live()?;
        let mut st = self.shared.wait_written(st, ctx)?;
        let c = st
            .book
            .ctxs
            .get_mut(&ctx)
            .ok_or(PagerError::NoContext { ctx })?;
        c.locks += 1;
        Ok(())
    }

    /// Undo one `lock_context`.
    pub fn unlock_context(&self, ctx: ContextId) -> Result<(), PagerError> {
        let mut st = self.shared.lock();
        let c = st
            .book
            .ctxs
            .get_mut(&ctx)
            .ok_or(PagerError::NoContext { ctx })?;
        if c.locks == 0 {
            return Err(PagerError::NotLockedUnlock { ctx });
        }
        c.locks -= 1;
        Ok(())
    }

    /// The engine wrote the chunk out (to kvfs): reclaiming it costs no I/O from now on.
    pub fn mark_persisted(&self, key: ChunkKey) -> Result<(), PagerError> {
        let mut st = self.live()?;
        let (slot, _, _, _) = st.book.slot_mut(key)?;
        slot.persisted = true;
        Ok(())
    }

    /// The engine recomputed the chunk's bytes in place: it may be used again.
    pub fn mark_recomputed(&self, key: ChunkKey) -> Result<(), PagerError> {
        let mut st = self.live()?;
        let (slot, _, _, _) = st.book.slot_mut(key)?;
        if slot.state != ChunkState::Resident {
            return Err(PagerError::NotResident { key });
        }
        slot.needs_recompute = false;
        st.book.recompute.retain(|r| r.key != key);
        Ok(())
    }

    /// Tell the victim chooser the engine used a chunk.
    pub fn note_access(&self, key: ChunkKey) {
        self.shared.lock().chooser.on_access(key);
    }

    /// Take every pending recompute request (the engine drains this before using the data).
    pub fn drain_recompute(&self) -> Vec<RecomputeRequest> {
        self.shared.lock().book.recompute.drain(..).collect()
    }

    /// What the pager knows of a chunk.
    pub fn chunk_info(&self, key: ChunkKey) -> Result<ChunkInfo, PagerError> {
        let st = self.shared.lock();
        let (_, s) = st.book.slot(key)?;
        Ok(ChunkInfo {
            state: s.state,
            bytes: s.bytes,
            persisted: s.persisted,
            needs_recompute: s.needs_recompute,
        })
    }

    /// Whether a chunk's bytes may be used now: resident, not awaiting recompute, pager alive.
    /// A chunk being populated (a fault's thread is woken by the copy, a moment before the fault
    /// thread records the chunk as resident) is waited for.
    pub fn check(&self, key: ChunkKey) -> Result<(), PagerError> {
        let st = self.live()?;
        let st = self.shared.wait_populated(st, key)?;
        let (_, s) = st.book.slot(key)?;
        match s.state {
            ChunkState::Resident if s.needs_recompute => Err(PagerError::NeedsRecompute { key }),
            ChunkState::Resident => Ok(()),
            ChunkState::ZeroMapped => Err(PagerError::NeedsRecompute { key }),
            _ => Err(PagerError::NotResident { key }),
        }
    }

    /// The address of a chunk's slot and the slot's stride. Touching a non-resident slot faults
    /// it in through the fault thread. Lock the context (`lock_context`) while using the memory,
    /// or a reclaim can drop it under you (you then read zeros or refault, never freed memory:
    /// the region stays mapped while its context exists).
    pub fn slot_ptr(&self, key: ChunkKey) -> Result<(NonNull<u8>, usize), PagerError> {
        let st = self.live()?;
        let (c, _) = st.book.slot(key)?;
        // SAFETY: `index < max_chunks`, so the offset lies inside the context's mapping.
        let p = unsafe { c.map.ptr().add(key.index as usize * c.stride) };
        Ok((p, c.stride))
    }

    /// Copy `out.len()` bytes at `offset` of a chunk out, faulting it in if needed.
    /// The context must be locked, so no reclaim races the read.
    pub fn read(&self, key: ChunkKey, offset: usize, out: &mut [u8]) -> Result<(), PagerError> {
        let (p, stride) = self.locked_range(key, offset, out.len())?;
        // SAFETY: the range lies inside the locked context's mapping, which stays mapped while
        // the context exists, and a locked context cannot be removed or reclaimed; a
        // non-resident page faults and is filled by the fault thread before the copy proceeds.
        unsafe {
            std::ptr::copy_nonoverlapping(p.as_ptr().add(offset), out.as_mut_ptr(), out.len());
        }
        let _ = stride;
        Ok(())
    }

    /// Write bytes into a resident chunk in place (a recompute, or a shrink's repacking).
    /// The context must be locked.
    pub fn write(&self, key: ChunkKey, offset: usize, data: &[u8]) -> Result<(), PagerError> {
        let (p, _) = self.locked_range(key, offset, data.len())?;
        let st = self.shared.lock();
        let bytes = st.book.slot(key)?.1.bytes;
        if st.book.slot(key)?.1.state != ChunkState::Resident {
            return Err(PagerError::NotResident { key });
        }
        if offset + data.len() > bytes {
            return Err(PagerError::OutOfRange {
                key,
                offset,
                len: data.len(),
                bytes,
            });
        }
        drop(st);
        // SAFETY: as in `read`; the chunk is resident and the range lies within its pages, so the
        // write touches memory the budget already counts.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), p.as_ptr().add(offset), data.len());
        }
        Ok(())
    }

    fn locked_range(
        &self,
        key: ChunkKey,
        offset: usize,
        len: usize,
    ) -> Result<(NonNull<u8>, usize), PagerError> {
        let st = self.live()?;
        let (c, _) = st.book.slot(key)?;
        if c.locks == 0 {
            return Err(PagerError::NotLocked { ctx: key.ctx });
        }
        if offset.checked_add(len).is_none_or(|e| e > c.stride) {
            return Err(PagerError::OutOfRange {
                key,
                offset,
                len,
                bytes: c.stride,
            });
        }
        // SAFETY: `index < max_chunks`, so the slot lies inside the mapping.
        let p = unsafe { c.map.ptr().add(key.index as usize * c.stride) };
        Ok((p, c.stride))
    }

    /// The context region's resident set as the kernel counts it (`Rss:` in /proc/self/smaps).
    pub fn region_rss(&self, ctx: ContextId) -> Result<u64, PagerError> {
        let st = self.shared.lock();
        let c = st
            .book
            .ctxs
            .get(&ctx)
            .ok_or(PagerError::NoContext { ctx })?;
        let (addr, len) = (c.map.addr(), c.map.len());
        drop(st);
        sys::smaps_rss(addr, len).map_err(|e| PagerError::Setup {
            source: SysError::Call {
                op: "reading /proc/self/smaps",
                source: e,
            },
        })
    }

    /// Stop the pager: every later call fails with `ShutDown`, threads blocked on faults are
    /// released (they read zeros; `check` reports `ShutDown`), and the fault thread is joined,
    /// or left behind after 5 s if a chunk source never returns.
    pub fn shutdown(&self) {
        self.shared.kill();
        let watchdog = self
            .watchdog
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(w) = watchdog {
            let _ = w.join();
        }
        let handle = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(h) = handle {
            let exited = self.shared.exited.lock().unwrap_or_else(|e| e.into_inner());
            let (exited, _) = self
                .shared
                .exited_cv
                .wait_timeout_while(exited, Duration::from_secs(5), |e| !*e)
                .unwrap_or_else(|e| e.into_inner());
            if *exited {
                let _ = h.join();
            } else {
                warn!(
                    "the fault thread did not stop within 5 s (a chunk source hangs); leaving it"
                );
            }
        }
    }
}

impl Drop for Pager {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A context locked against reclaim (`Pager::lock`); unlocks when dropped.
///
/// Its resident chunks can be read in place through it: while the guard lives the context cannot
/// be removed and none of its chunks reclaimed, so the bytes it hands out stay mapped and are
/// changed only by this process's own writes to the chunk (`Pager::write`, `Pager::shrink`).
pub struct ContextLock {
    shared: Arc<Shared>,
    ctx: ContextId,
}

impl std::fmt::Debug for ContextLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ContextLock")
            .field("ctx", &self.ctx)
            .finish()
    }
}

impl ContextLock {
    /// The locked context.
    pub fn context(&self) -> ContextId {
        self.ctx
    }

    /// The bytes of resident chunk `index` (its whole page-rounded slot), or why they cannot be
    /// used: not resident, holding zeros that await recompute, or the pager is gone.
    pub fn chunk(&self, index: u32) -> Result<&[u8], PagerError> {
        let key = ChunkKey {
            ctx: self.ctx,
            index,
        };
        let st = self.shared.lock();
        if st.book.dead {
            return Err(PagerError::ShutDown);
        }
        let st = self.shared.wait_populated(st, key)?;
        let (c, s) = st.book.slot(key)?;
        match s.state {
            ChunkState::Resident if s.needs_recompute => {
                return Err(PagerError::NeedsRecompute { key });
            }
            ChunkState::Resident => {}
            ChunkState::ZeroMapped => return Err(PagerError::NeedsRecompute { key }),
            _ => return Err(PagerError::NotResident { key }),
        }
        // SAFETY: `index < max_chunks` (checked by `slot`), so the slot's `s.bytes <= stride`
        // bytes lie inside the context's mapping. The guard holds a lock on the context, so it
        // cannot be removed (its mapping stays alive as long as `self`) and no chunk of it can be
        // reclaimed; the pages are resident and counted against the budget. Only this process's
        // own `write`/`shrink` calls change them, which the caller orders against its reads.
        let bytes = unsafe {
            std::slice::from_raw_parts(c.map.ptr().as_ptr().add(index as usize * c.stride), s.bytes)
        };
        Ok(bytes)
    }
}

impl ContextLock {
    /// Reclaim one of the locked context's own chunks (the engine drops a chunk it is about to
    /// rebuild). `&mut self` ends every borrow of the chunk's bytes taken through this guard.
    pub fn reclaim(&mut self, index: u32) -> Result<u64, PagerError> {
        let key = ChunkKey {
            ctx: self.ctx,
            index,
        };
        let st = self.shared.lock();
        let mut st = self.shared.wait_populated(st, key)?;
        let (_, s) = st.book.slot(key)?;
        match s.state {
            ChunkState::Resident | ChunkState::ZeroMapped => st.drop_chunk(&self.shared.stats, key),
            _ => Err(PagerError::NotResident { key }),
        }
    }
}

impl Drop for ContextLock {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        if let Some(c) = st.book.ctxs.get_mut(&self.ctx) {
            c.locks = c.locks.saturating_sub(1);
        }
    }
}

/// The watchdog: stops the pager if one fill on the fault thread outlasts `deadline`.
fn spawn_watchdog(shared: Arc<Shared>, deadline: Duration) -> Result<JoinHandle<()>, PagerError> {
    let deadline_ns = u64::try_from(deadline.as_nanos()).unwrap_or(u64::MAX);
    let tick = (deadline / 4).max(Duration::from_millis(5));
    std::thread::Builder::new()
        .name("uffd-pager-watchdog".into())
        .spawn(move || {
            let mut stop = shared.watch_stop.lock().unwrap_or_else(|e| e.into_inner());
            while !*stop {
                let since = shared.fill_since.load(Relaxed);
                let now = u64::try_from(shared.born.elapsed().as_nanos()).unwrap_or(u64::MAX);
                let fill_late = since != 0 && now.saturating_sub(since) > deadline_ns;
                // A write-back that never returns would keep every fault that waits for its room
                // waiting: it is held to the same deadline.
                let write_late = shared
                    .lock()
                    .book
                    .writes
                    .values()
                    .min()
                    .is_some_and(|t| t.elapsed() > deadline);
                if fill_late || write_late {
                    drop(stop);
                    tracing::error!(
                        deadline_ms = deadline.as_millis() as u64,
                        what = if fill_late { "a fill" } else { "a write-back" },
                        "a chunk source has not returned within its deadline; stopping the \
                         pager so no thread waits forever on a fault"
                    );
                    shared.kill();
                    return;
                }
                stop = shared
                    .watch_cv
                    .wait_timeout(stop, tick)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        })
        .map_err(|source| PagerError::Setup {
            source: SysError::Call {
                op: "spawning the watchdog",
                source,
            },
        })
}

/// A view of part of a reservation, for copying a piece of the slot.
fn sub(r: &Reservation, off: usize, len: usize) -> Reservation {
    Reservation {
        key: r.key,
        map: Arc::clone(&r.map),
        epoch: r.epoch,
        offset: r.offset + off,
        bytes: len,
        stride: len,
        prev: r.prev,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calling_the_source_with_the_state_lock_held_is_caught_in_debug_builds() {
        let state = Mutex::new(State {
            book: Book {
                ctxs: HashMap::new(),
                by_addr: BTreeMap::new(),
                resident: 0,
                recompute: VecDeque::new(),
                dead: false,
                next_epoch: 1,
                deferred: 0,
                writes: HashMap::new(),
            },
            chooser: Box::new(LruChooser::new()),
        });
        let guard = StateGuard {
            inner: Some(state.lock().unwrap()),
        };
        STATE_HELD.with(|h| h.set(h.get() + 1));
        let caught = catch_unwind(|| assert_state_unlocked("a test's source call"));
        assert_eq!(caught.is_err(), cfg!(debug_assertions));
        drop(guard);
        assert_state_unlocked("a source call after the guard dropped");
    }
}
