//! The pager's shared core: the books of every region and slot under one state lock, the budget's
//! room-making (victims dropped, or written back with the lock released), and the populate,
//! write-back, wait and kill mechanics that the API (`pager.rs`) and the fault thread (`fault.rs`)
//! both run.

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ops::{Deref, DerefMut};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};
use tracing::{debug, warn};

use crate::staging::Staging;
use crate::stats::Stats;
use crate::sys::{EventFd, Mapping, SysError, Uffd, page_round};
use crate::types::*;
use crate::victim::{Candidate, ResidentView, VictimChooser};
use crate::{ChunkKey, ChunkSource, ContextId, SourceError};

#[derive(Debug, Clone, Copy)]
pub(crate) struct Slot {
    pub(crate) state: MemoryState,
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
    /// Signalled whenever a populate or a write-back ends, and at shutdown (waiters on a slot
    /// being populated or written, on room, or on a context's write-backs).
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

/// Counts a state-lock guard taken (`+1`) or given up (`-1`) by this thread; debug builds only,
/// so release builds do no work per lock for a check they do not make.
fn count_held(delta: i32) {
    if cfg!(debug_assertions) {
        STATE_HELD.with(|h| h.set(h.get().wrapping_add_signed(delta)));
    }
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
    inner: MutexGuard<'a, State>,
}

impl Deref for StateGuard<'_> {
    type Target = State;

    fn deref(&self) -> &State {
        &self.inner
    }
}

impl DerefMut for StateGuard<'_> {
    fn deref_mut(&mut self) -> &mut State {
        &mut self.inner
    }
}

impl Drop for StateGuard<'_> {
    fn drop(&mut self) {
        count_held(-1);
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
        (s.state == MemoryState::Resident && !s.writing).then_some(Candidate {
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
                if s.state == MemoryState::Resident && !s.writing {
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
    /// No context, nothing resident.
    pub(crate) fn new() -> Book {
        Book {
            ctxs: HashMap::new(),
            by_addr: BTreeMap::new(),
            resident: 0,
            recompute: VecDeque::new(),
            dead: false,
            next_epoch: 1,
            deferred: 0,
            writes: HashMap::new(),
        }
    }

    pub(crate) fn slot(&self, key: ChunkKey) -> Result<(&Ctx, &Slot), PagerError> {
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
    pub(crate) fn slot_mut(
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
        let freed = if slot.state == MemoryState::Resident {
            bytes as u64
        } else {
            0
        };
        if slot.state == MemoryState::Resident && !slot.persisted {
            stats.unpersisted_reclaims.fetch_add(1, Relaxed);
        }
        slot.state = MemoryState::Reclaimed;
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
            .is_ok_and(|(c, s)| c.locks == 0 && s.state == MemoryState::Resident);
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
        // to the book, so a panic in it leaves a consistent book (and the lock does not poison).
        let inner = self.state.lock();
        count_held(1);
        StateGuard { inner }
    }

    /// Wait on `populated` (a populate, a write-back or a shutdown ended), the lock released
    /// meanwhile. The guard stays counted while its thread sleeps here: it calls no source.
    pub(crate) fn wait<'a>(&'a self, mut guard: StateGuard<'a>) -> StateGuard<'a> {
        self.populated.wait(&mut guard.inner);
        guard
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
            None if s.state == MemoryState::Reclaimed => s.bytes,
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
            MemoryState::Resident => return Err(PagerError::AlreadyResident { key }),
            MemoryState::Populating => return Err(PagerError::Busy { key }),
            MemoryState::Absent | MemoryState::Reclaimed | MemoryState::ZeroMapped => {}
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
        if prev.state == MemoryState::ZeroMapped {
            c.map
                .dontneed(offset, c.stride)
                .map_err(|source| PagerError::Populate { key, source })?;
        }
        slot.state = MemoryState::Populating;
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
                state: MemoryState::Resident,
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
            if slot.state == MemoryState::ZeroMapped {
                slot.state = MemoryState::Reclaimed;
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
            if s.state != MemoryState::Populating && !s.writing {
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
            if skip_resident && st.book.slot(key)?.1.state == MemoryState::Resident {
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
        *self.watch_stop.lock() = true;
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

/// The watchdog: stops the pager if one fill on the fault thread outlasts `deadline`.
pub(crate) fn spawn_watchdog(
    shared: Arc<Shared>,
    deadline: Duration,
) -> Result<JoinHandle<()>, PagerError> {
    let deadline_ns = u64::try_from(deadline.as_nanos()).unwrap_or(u64::MAX);
    let tick = (deadline / 4).max(Duration::from_millis(5));
    std::thread::Builder::new()
        .name("uffd-pager-watchdog".into())
        .spawn(move || {
            let mut stop = shared.watch_stop.lock();
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
                shared.watch_cv.wait_for(&mut stop, tick);
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
pub(crate) fn sub(r: &Reservation, off: usize, len: usize) -> Reservation {
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
    use crate::victim::LruChooser;

    #[test]
    fn calling_the_source_with_the_state_lock_held_is_caught_in_debug_builds() {
        let state = Mutex::new(State {
            book: Book::new(),
            chooser: Box::new(LruChooser::new()),
        });
        let guard = StateGuard {
            inner: state.lock(),
        };
        count_held(1);
        let caught = catch_unwind(|| assert_state_unlocked("a test's source call"));
        assert_eq!(caught.is_err(), cfg!(debug_assertions));
        drop(guard);
        assert_state_unlocked("a source call after the guard dropped");
    }
}
