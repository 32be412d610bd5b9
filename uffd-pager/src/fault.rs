//! The fault thread: a runtime that owns the userfaultfd poll loop and resolves every touch of a non-resident page.
//!
//! Shaped like firecracker's on-demand handler: addresses are page-aligned once, the whole chunk
//! around a faulting page is populated in one go, EEXIST means "already there, just wake", EAGAIN
//! means "try again".
//!
//! By default (`PopulateVia::Copy`) the source fills a warm buffer and one UFFDIO_COPY maps the
//! chunk. In `PopulateVia::Move` mode there are two buffers, each sized for the largest slot:
//! the source fills the *move* buffer when it is warm (every page faulted in) and one UFFDIO_MOVE hands its pages to the slot without a copy;
//! the buffer is then faulted in again (MADV_POPULATE_WRITE) in slices while no fault is pending.
//! A fault that finds it cold (a burst) is filled into the *copy* buffer and UFFDIO_COPY'd, which
//! leaves that buffer warm. Isolated faults get the move's latency, bursts the copy's throughput. A fault on a chunk another thread is populating is deferred
//! until that populate finishes (its UFFDIO_COPY wakes the waiter; the deferral only makes sure).

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{error, warn};

use crate::ChunkKey;
use crate::shared::{Reservation, Reserved, Shared, StateGuard, WriteBack};
use crate::staging::Staging;
use crate::sys::{Fault, PAGE_SIZE, SysError, poll2};
use crate::types::{MemoryState, PagerError, RecomputeReason, RecomputeRequest};

/// Start the fault thread; `bufs` are its copy and move buffers, sized for the largest slot.
/// With it starts its write-back thread, which writes the victims a fault needs written before
/// it has room (the fault thread never waits on that I/O), and ends when the fault thread does.
/// Returns both threads: the fault thread's, then the write-back thread's.
pub(crate) fn spawn(
    shared: Arc<Shared>,
    bufs: (Staging, Staging),
) -> Result<(JoinHandle<()>, JoinHandle<()>), SysError> {
    let (writer, jobs) = channel();
    let for_writer = Arc::clone(&shared);
    let write_back = std::thread::Builder::new()
        .name("uffd-pager-writeback".into())
        .spawn(move || write_victims(&for_writer, &jobs))
        .map_err(|source| SysError::Call {
            op: "spawning the write-back thread",
            source,
        })?;
    let fault = std::thread::Builder::new()
        .name("uffd-pager-fault".into())
        .spawn(move || run(shared, bufs, writer))
        .map_err(|source| SysError::Call {
            op: "spawning the fault thread",
            source,
        })?;
    Ok((fault, write_back))
}

/// The write-back thread: writes each batch of victims the fault thread hands it, with the
/// pager's lock released; finishing each drops it and wakes the fault thread if it deferred
/// faults for the room. Ends when the fault thread (the only sender) ends.
fn write_victims(shared: &Shared, jobs: &Receiver<Vec<WriteBack>>) {
    while let Ok(batch) = jobs.recv() {
        shared.write_back(batch);
    }
}

/// On any exit of the fault thread, a panic included, mark the pager dead and release every
/// thread blocked on a fault: nothing waits forever on a pager that is gone.
struct ExitGuard(Arc<Shared>);

impl Drop for ExitGuard {
    fn drop(&mut self) {
        if std::thread::panicking() {
            error!("the fault thread panicked; releasing every faulting thread");
        }
        self.0.kill();
        let mut exited = self.0.exited.lock();
        *exited = true;
        self.0.exited_cv.notify_all();
    }
}

/// At most `burst` messages per second; the rest are counted and reported with the next one.
struct RateLimit {
    window: Instant,
    used: u32,
    dropped: u64,
}

impl RateLimit {
    const BURST: u32 = 10;

    fn new() -> RateLimit {
        RateLimit {
            window: Instant::now(),
            used: 0,
            dropped: 0,
        }
    }

    /// Whether to log now, and how many messages were suppressed before this one.
    fn allow(&mut self) -> Option<u64> {
        if self.window.elapsed() >= Duration::from_secs(1) {
            self.window = Instant::now();
            self.used = 0;
        }
        if self.used < Self::BURST {
            self.used += 1;
            Some(std::mem::take(&mut self.dropped))
        } else {
            self.dropped += 1;
            None
        }
    }
}

struct Runtime {
    shared: Arc<Shared>,
    copy_buf: Staging,
    move_buf: Staging,
    /// How much of `move_buf` is faulted in; all of it means a fault may move from it.
    move_warm: usize,
    deferred: Vec<Fault>,
    log: RateLimit,
    /// Hands victims to the write-back thread.
    writer: Sender<Vec<WriteBack>>,
}

/// Prefault the move buffer this much at a time between checks for pending faults.
const PREFAULT_SLICE: usize = 64 << 10;

fn run(
    shared: Arc<Shared>,
    (copy_buf, move_buf): (Staging, Staging),
    writer: Sender<Vec<WriteBack>>,
) {
    let _guard = ExitGuard(Arc::clone(&shared));
    let mut rt = Runtime {
        shared,
        copy_buf,
        move_buf,
        move_warm: 0,
        deferred: Vec::with_capacity(64),
        log: RateLimit::new(),
        writer,
    };
    if let Err(e) = rt.copy_buf.prefault() {
        rt.warn(None, "prefaulting the copy buffer failed", &e);
    }
    let mut batch = [Fault {
        addr: 0,
        write: false,
    }; 16];
    let mut again: Vec<Fault> = Vec::with_capacity(64);
    loop {
        if rt.shared.lock().book.dead {
            return;
        }
        let uffd_fd = rt.shared.uffd.raw_fd();
        let wake_fd = rt.shared.wake.raw_fd();
        match poll2(uffd_fd, wake_fd, -1) {
            Ok((_, woken)) => {
                if woken {
                    rt.shared.wake.drain();
                }
            }
            Err(e) => {
                error!(error = %e, "polling the userfaultfd failed; stopping the pager");
                return;
            }
        }
        // Faults deferred behind another populate: look again.
        if !rt.deferred.is_empty() {
            rt.shared.lock().book.deferred = 0;
        }
        std::mem::swap(&mut again, &mut rt.deferred);
        for f in again.drain(..) {
            rt.handle(f);
        }
        loop {
            let n = match rt.shared.uffd.read_faults(&mut batch) {
                Ok(n) => n,
                Err(e) => {
                    error!(error = %e, "reading the userfaultfd failed; stopping the pager");
                    return;
                }
            };
            if n == 0 {
                // Idle: warm the move buffer up, a slice at a time, while no fault waits.
                if rt.warm_move_buffer() {
                    continue;
                }
                break;
            }
            for f in &batch[..n] {
                rt.shared.stats.faults.fetch_add(1, Relaxed);
                rt.handle(*f);
            }
        }
    }
}

impl Runtime {
    fn warn(&mut self, key: Option<ChunkKey>, what: &str, err: &dyn std::fmt::Display) {
        if let Some(dropped) = self.log.allow() {
            match key {
                Some(k) => warn!(chunk = %k, error = %err, dropped, "{what}"),
                None => warn!(error = %err, dropped, "{what}"),
            }
        }
    }

    fn handle(&mut self, fault: Fault) {
        let t = Instant::now();
        let page = fault.addr & !(PAGE_SIZE - 1);
        let shared = Arc::clone(&self.shared);
        let mut st = shared.lock();
        if st.book.dead {
            return;
        }
        let found = st
            .book
            .by_addr
            .range(..=page)
            .next_back()
            .map(|(b, c)| (*b, *c));
        let Some((base, ctx)) = found else {
            drop(st);
            self.stray(page);
            return;
        };
        let Some(c) = st.book.ctxs.get(&ctx) else {
            drop(st);
            self.stray(page);
            return;
        };
        if page >= base + c.map.len() {
            drop(st);
            self.stray(page);
            return;
        }
        let index = (page - base) / c.stride;
        let stride = c.stride;
        let key = ChunkKey {
            ctx,
            index: index as u32,
        };
        let Some(state) = c.slots.get(index).map(|s| s.state) else {
            // Past the last slot (cannot happen: the region is exactly its slots); never leave
            // the thread waiting.
            drop(st);
            self.zero_or_wake(key, page, PAGE_SIZE);
            return;
        };
        match state {
            MemoryState::Resident | MemoryState::ZeroMapped => {
                // Populated since the fault was queued (the populate's copy woke the thread
                // already), or a touch past a shrunk chunk's end: map the zero page, which costs
                // no memory, or just wake if a page is there.
                drop(st);
                shared.stats.faults_woken.fetch_add(1, Relaxed);
                self.zero_or_wake(key, page, PAGE_SIZE);
            }
            MemoryState::Populating => {
                st.book.deferred += 1;
                self.deferred.push(fault);
            }
            MemoryState::Absent | MemoryState::Reclaimed => {
                match shared.reserve(&mut st, key, None) {
                    Ok(Reserved::Write(jobs)) => {
                        // Room needs victims written back first: the write-back thread writes
                        // them while this fault waits, set aside, and other faults go on.
                        st.book.deferred += 1;
                        drop(st);
                        shared.stats.faults_deferred_for_room.fetch_add(1, Relaxed);
                        self.deferred.push(fault);
                        if self.writer.send(jobs).is_err() {
                            error!("the pager's write-back thread is gone; stopping the pager");
                            shared.kill();
                        }
                    }
                    Ok(Reserved::Wait) => {
                        // Only write-backs in flight can make room; each that ends wakes us.
                        st.book.deferred += 1;
                        drop(st);
                        shared.stats.faults_deferred_for_room.fetch_add(1, Relaxed);
                        self.deferred.push(fault);
                    }
                    Ok(Reserved::Slot(r)) => {
                        drop(st);
                        self.fill_faulting(key, page, &r, t);
                    }
                    Err(
                        e @ (PagerError::BudgetExhausted { .. }
                        | PagerError::LargerThanBudget { .. }),
                    ) => {
                        self.zero_map_for_recompute(st, key, (base + index * stride, stride), &e);
                    }
                    Err(e) => {
                        drop(st);
                        self.warn(Some(key), "cannot populate a faulting chunk", &e);
                        self.zero_or_wake(key, page, PAGE_SIZE);
                    }
                }
            }
        }
    }

    /// Fills a faulting chunk's reserved slot from the source and maps it in (by move when the
    /// move buffer is warm, else by copy); a source failure zero-fills it for recompute, a
    /// failed map releases the faulting thread with the zero page.
    fn fill_faulting(&mut self, key: ChunkKey, page: usize, r: &Reservation, t: Instant) {
        let shared = Arc::clone(&self.shared);
        let by_move = shared.uffd.move_supported() && self.move_warm >= self.move_buf.len();
        let buf = if by_move {
            &mut self.move_buf
        } else {
            &mut self.copy_buf
        };
        shared.fill_mark(true);
        let filled = shared.fill(key, &mut buf.as_mut_slice()[..r.bytes]);
        shared.fill_mark(false);
        let copied = if by_move {
            // The pages go to the slot; the buffer is cold until warmed again.
            self.move_warm = 0;
            shared.stats.faults_moved.fetch_add(1, Relaxed);
            shared.move_in(r, &mut self.move_buf)
        } else {
            shared.copy_in(r, &self.copy_buf.as_slice()[..r.bytes])
        };
        if copied.is_ok() {
            shared.stats.fault_latency.record(t.elapsed());
        }
        let reason = filled.as_ref().err().cloned().map(RecomputeReason::Source);
        let (ok, persisted) = (copied.is_ok(), filled.is_ok());
        shared.finish(shared.lock(), r, ok, persisted, reason);
        if let Err(e) = &filled {
            self.warn(
                Some(key),
                "chunk source failed; zero-filled for recompute",
                e,
            );
        }
        if let Err(e) = copied {
            self.warn(Some(key), "populating a faulting chunk failed", &e);
            // Release the faulting thread; the slot is back to non-resident.
            self.zero_or_wake(key, page, PAGE_SIZE);
        }
    }

    /// No room for a faulting chunk: map the zero page over its whole slot (`at`, `stride`
    /// bytes; it costs no memory), and have the engine recompute the chunk once it has made
    /// room.
    fn zero_map_for_recompute(
        &mut self,
        mut st: StateGuard<'_>,
        key: ChunkKey,
        (at, stride): (usize, usize),
        e: &PagerError,
    ) {
        let c = st
            .book
            .ctxs
            .get_mut(&key.ctx)
            .expect("looked up under this lock");
        let slot = &mut c.slots[key.index as usize];
        slot.state = MemoryState::ZeroMapped;
        if slot.bytes == 0 {
            slot.bytes = stride;
        }
        slot.needs_recompute = true;
        st.book.recompute.retain(|q| q.key != key);
        st.book.recompute.push_back(RecomputeRequest {
            key,
            reason: RecomputeReason::BudgetExhausted,
        });
        self.shared.stats.recompute_requests.fetch_add(1, Relaxed);
        drop(st);
        self.warn(
            Some(key),
            "fault with the budget exhausted; zero page mapped",
            e,
        );
        self.zero_or_wake(key, at, stride);
    }

    /// Fault one more slice of the move buffer in; returns whether a fault is pending (stop
    /// warming and serve it). A failure leaves the buffer cold, and faults use the copy buffer.
    fn warm_move_buffer(&mut self) -> bool {
        let len = self.move_buf.len();
        while self.move_warm < len && self.shared.fault_move {
            let n = PREFAULT_SLICE.min(len - self.move_warm);
            if let Err(e) = self.move_buf.prefault_range(self.move_warm, n) {
                self.warn(None, "prefaulting the move buffer failed", &e);
                return false;
            }
            self.move_warm += n;
            if self.move_warm == len {
                self.shared.stats.move_warmups.fetch_add(1, Relaxed);
            }
            match poll2(self.shared.uffd.raw_fd(), self.shared.wake.raw_fd(), 0) {
                Ok((false, false)) => {}
                Ok((fault, _)) => return fault,
                Err(_) => return false,
            }
        }
        false
    }

    /// A fault outside every region (a context removed after the fault was queued): the removal
    /// unregistered the range, which already woke the thread; wake again to be sure.
    fn stray(&mut self, page: usize) {
        if let Err(e) = self.shared.uffd.wake(page, PAGE_SIZE) {
            self.warn(None, "waking a stray fault failed", &e);
        }
    }

    /// Map zero pages over the missing pages of a range, skipping pages already there, and wake
    /// its waiters.
    fn zero_or_wake(&mut self, key: ChunkKey, addr: usize, len: usize) {
        let mut done = 0;
        while done < len {
            match self.shared.uffd.zeropage(addr + done, len - done) {
                Ok(()) => done = len,
                Err(SysError::Partial {
                    done: d, source, ..
                }) if source.raw_os_error() == Some(libc::EEXIST) => {
                    done += d + PAGE_SIZE;
                }
                Err(SysError::Partial {
                    done: d, source, ..
                }) if source.raw_os_error() == Some(libc::EAGAIN) => {
                    self.shared.stats.eagain_retries.fetch_add(1, Relaxed);
                    done += d;
                    std::thread::yield_now();
                }
                Err(e) => {
                    self.warn(Some(key), "mapping a zero page failed", &e);
                    break;
                }
            }
        }
        if let Err(e) = self.shared.uffd.wake(addr, len) {
            self.warn(Some(key), "waking faulting threads failed", &e);
        }
    }
}
