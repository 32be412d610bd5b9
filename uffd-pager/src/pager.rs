//! The pager: context regions, chunk slots, the resident-byte budget, and the populate / reclaim / load / lock primitives.

use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use tracing::{debug, warn};

use crate::shared::{
    Book, Ctx, Reservation, Room, Shared, Slot, State, StateGuard, spawn_watchdog, sub,
};
use crate::staging::Staging;
use crate::stats::{Stats, StatsSnapshot};
use crate::sys::{self, EventFd, Mapping, PAGE_SIZE, SysError, Uffd, page_round};
use crate::types::*;
use crate::victim::{LruChooser, VictimChooser};
use crate::{ChunkKey, ChunkSource, ContextId};

/// The pager: owns the userfaultfd, the regions, the budget and the fault thread.
/// Shut it down with [`Pager::shutdown`] (or drop it); threads blocked on faults are released.
pub struct Pager {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// The fault thread's write-back thread; it ends once the fault thread has.
    write_back: Mutex<Option<JoinHandle<()>>>,
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
                book: Book::new(),
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
        let (thread, write_back) = crate::fault::spawn(Arc::clone(&shared), bufs)
            .map_err(|source| PagerError::Setup { source })?;
        let watchdog = match config.source_deadline {
            Some(deadline) => Some(spawn_watchdog(Arc::clone(&shared), deadline)?),
            None => None,
        };
        Ok(Pager {
            shared,
            thread: Mutex::new(Some(thread)),
            write_back: Mutex::new(Some(write_back)),
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
                        state: MemoryState::Absent,
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
            if s.state == MemoryState::Resident {
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
            && s.state == MemoryState::Resident
            && !s.persisted
            && !s.needs_recompute;
        match s.state {
            MemoryState::Resident if needs_write => {
                let job = st.mark_writing(key);
                drop(st);
                Ok(self.shared.write_back(vec![job]))
            }
            MemoryState::Resident | MemoryState::ZeroMapped => {
                st.drop_chunk(&self.shared.stats, key)
            }
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
        if slot.state != MemoryState::Resident {
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
            .filter(|s| s.state == MemoryState::Resident)
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
        if slot.state != MemoryState::Resident {
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
            MemoryState::Resident if s.needs_recompute => Err(PagerError::NeedsRecompute { key }),
            MemoryState::Resident => Ok(()),
            MemoryState::ZeroMapped => Err(PagerError::NeedsRecompute { key }),
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
    /// The context must be locked. The chunk is no longer persisted: its bytes are new.
    pub fn write(&self, key: ChunkKey, offset: usize, data: &[u8]) -> Result<(), PagerError> {
        let (p, _) = self.locked_range(key, offset, data.len())?;
        let mut st = self.shared.lock();
        let (slot, _, _, _) = st.book.slot_mut(key)?;
        let bytes = slot.bytes;
        if slot.state != MemoryState::Resident {
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
        slot.persisted = false;
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
        let watchdog = self.watchdog.lock().take();
        if let Some(w) = watchdog {
            let _ = w.join();
        }
        let handle = self.thread.lock().take();
        if let Some(h) = handle {
            let mut exited = self.shared.exited.lock();
            self.shared
                .exited_cv
                .wait_while_for(&mut exited, |e| !*e, Duration::from_secs(5));
            if *exited {
                let _ = h.join();
                // The fault thread is gone, so the write-back thread's queue is closed: it ends
                // after the write in hand, if any. Joined too, so nothing the source holds (a
                // store and its lock) outlives the pager; a write that hangs is left behind.
                let write_back = self.write_back.lock().take();
                if let Some(w) = write_back {
                    let t = Instant::now();
                    while !w.is_finished() && t.elapsed() < Duration::from_secs(5) {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    if w.is_finished() {
                        let _ = w.join();
                    } else {
                        warn!(
                            "the write-back thread did not stop within 5 s (a chunk source hangs); leaving it"
                        );
                    }
                }
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
            MemoryState::Resident if s.needs_recompute => {
                return Err(PagerError::NeedsRecompute { key });
            }
            MemoryState::Resident => {}
            MemoryState::ZeroMapped => return Err(PagerError::NeedsRecompute { key }),
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
            MemoryState::Resident | MemoryState::ZeroMapped => {
                st.drop_chunk(&self.shared.stats, key)
            }
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
