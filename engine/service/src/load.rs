//! The Load pipeline (paper §3.3, Eq. 4): a context's missing chunks come back before its call
//! runs, some read from kvfs on an I/O thread while the engine recomputes the others.
//!
//! 1. Plan: `policy::plan_load` splits the missing chunks that the store holds into reads and
//!    recomputes from the cost model; chunks the store does not hold are recomputed.
//!    Reads positioned before the last recomputed chunk go first ("blocking": the recompute
//!    attends to them).
//! 2. The I/O thread reads the blocking chunks and populates their slots, signals, then reads the
//!    rest; the calling thread waits for the signal and recomputes its set in the meantime.
//! 3. A read that fails its checks (missing, corrupt, other model) is recomputed after both are
//!    done, when every chunk it depends on is resident.

use parking_lot::Mutex;
use std::os::fd::AsFd;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Instant;

use kvfs::io::AlignedBuf;
use kvfs::{MountReader, RawSlot};
use policy::{CostModel, LoadPlan, MissingChunk};
use uffd_pager::{ChunkKey, Pager, ReadRing};

use crate::ServiceError;
use crate::chunk_io::ChunkIo;
use crate::chunks::StoredCopy;
use crate::failpoints::{check, injected};
use crate::lineage::Lineage;
use model::Model;
use model::kv::recompute::{RecomputeError, recompute_chunks};
use model::kv::{ChunkShape, KvCache, KvFormat};

/// How a context's missing chunks come back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LoadMode {
    /// Reads and recomputes at once, as the planner splits them (LLMS).
    #[default]
    Planned,
    /// Every chunk the store holds is read; only the others are recomputed.
    ReadOnly,
    /// Every missing chunk is recomputed from its tokens.
    RecomputeOnly,
}

/// What one Load did, in seconds from its start.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct LoadReport {
    /// Chunks missing when the call arrived.
    pub missing: usize,
    /// Chunks read from the store.
    pub read: Vec<u32>,
    /// Chunks recomputed (planned, and those whose read failed).
    pub recomputed: Vec<u32>,
    /// Reads that failed their checks and were recomputed instead.
    pub failed_reads: Vec<u32>,
    /// Bytes read.
    pub read_bytes: u64,
    /// Planning time.
    pub plan_secs: f64,
    /// The I/O threads' busy time (read and populate), the longest of them.
    pub io_secs: f64,
    /// Recompute time.
    pub recompute_secs: f64,
    /// The whole Load.
    pub total_secs: f64,
    /// What the plan predicted for the whole Load.
    pub predicted_secs: f64,
}

/// The Load's I/O threads and their read buffers, kept between Loads: the threads wait parked,
/// so a switch does not pay for starting them.
///
/// Through a mount, one thread keeps up to [`RING_DEPTH`] reads in flight on an io_uring
/// ([`ReadRing`], over a [`RING_BYTES`] buffer in transparent huge pages, into which direct
/// reads run about twice as fast as into small pages, docs/kvfs.md): the engine thread itself
/// when nothing is recomputed, an I/O thread while it recomputes. Without a mount, or where
/// the kernel refuses io_uring, the threads read one chunk each at a time into their own part of
/// one buffer (`AlignedBuf::huge`).
#[derive(Debug)]
pub struct Readers {
    pool: rayon::ThreadPool,
    buf: AlignedBuf,
    /// The io_uring: through a mount, where the kernel allows it.
    ring: Option<Box<ReadRing>>,
}

/// Entries of the Load's io_uring: at most this many reads in flight.
pub const RING_DEPTH: u32 = 32;

/// The io_uring's read buffer: about 20 compressed chunks of the default model in flight, 10 int8
/// ones, 5 f16 ones.
pub const RING_BYTES: usize = 2 << 20;

impl Readers {
    /// `threads` I/O threads (at least one), and with `ring` (chunks read through a mount) the
    /// io_uring. The read buffer is mapped now, not at the first Load: faulting in huge pages can
    /// take milliseconds (the kernel may compact memory to find them), which the first switch
    /// that reads would otherwise pay (5-10 ms, once in three or four replays of docs/bench.md's).
    pub fn new(threads: usize, ring: bool) -> Result<Readers, ServiceError> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .thread_name(|i| format!("llms-load-{i}"))
            .build()
            .map_err(|e| ServiceError::Start {
                what: "starting the Load's I/O threads".into(),
                source: std::io::Error::other(e),
            })?;
        let ring = ring
            .then(|| match ReadRing::new(RING_DEPTH, RING_BYTES) {
                Ok(r) => Some(Box::new(r)),
                Err(e) => {
                    tracing::warn!(
                        error = %e,
                        "no io_uring: the Load reads with one thread per read in flight"
                    );
                    None
                }
            })
            .flatten();
        // The threads' buffer, where there is no ring: eight int8 parts fit this.
        let buf = AlignedBuf::huge(if ring.is_none() { RING_BYTES } else { 0 });
        Ok(Readers { pool, buf, ring })
    }

    /// The read buffers' bytes (whole huge pages: the io_uring's, and the threads', sized to the
    /// largest Load's chunks so far).
    pub fn buffer_bytes(&self) -> usize {
        self.buf.capacity() + self.ring.as_deref().map_or(0, ReadRing::buffer_bytes)
    }

    /// Of those, the bytes the kernel backs with huge pages.
    pub fn huge_bytes(&self) -> usize {
        self.buf.huge_bytes() + self.ring.as_deref().map_or(0, ReadRing::huge_bytes)
    }

    /// Whether Loads read through an io_uring (through a mount, where the kernel allows it).
    pub fn uses_io_uring(&self) -> bool {
        self.ring.is_some()
    }
}

/// Brings every missing chunk of `cache` back. `stored[i]` is what the store holds of chunk `i`.
/// The cache must be pinned. The reads run on `readers` (all its threads when nothing is
/// recomputed, one otherwise), each into its own part of their buffer. `during` is the caller's
/// own work (encoding the prompt): it runs on the calling thread once the reads are under way and
/// before any recompute, and has run when the Load returns `Ok`.
///
/// The steps, one function each: [`plan`], [`read_and_recompute`], [`gather`] and
/// [`recompute_failed`]. An error at any step leaves the chunks already populated resident and
/// the rest missing: the caller reloads the context from the store (`Manager::call`), which
/// forgets both, so a failed Load leaves the context as loadable as before.
/// Failpoints (the `failpoints` feature; docs/service.md, "Failpoints"): `service::load::planned`
/// once the plan is made; `service::load::chunk_read` when a chunk's bytes are read and checked,
/// before its slot is populated, and `service::load::chunk_populated` right after (before it is
/// marked persisted), both on the thread that reads; `service::load::recompute` before the planned
/// recompute, while reads may be in flight; `service::load::reads_done` once every read has
/// ended; `service::load::done` with every chunk resident.
#[allow(clippy::too_many_arguments)]
pub fn load(
    model: &Model,
    io: &ChunkIo,
    pager: &Pager,
    lineage: &Lineage,
    cache: &mut KvCache,
    stored: &[Option<StoredCopy>],
    mode: LoadMode,
    cost: &CostModel,
    readers: &mut Readers,
    during: impl FnOnce(),
) -> Result<LoadReport, ServiceError> {
    let t0 = Instant::now();
    let missing = cache.missing_chunks();
    if missing.is_empty() {
        during();
        return Ok(LoadReport::default());
    }
    let ctx = lineage.ctx().0;
    let _span = tracing::debug_span!("load", ctx, missing = missing.len()).entered();
    let plan = plan(&missing, stored, mode, cost, cache)?;
    let mut report = LoadReport {
        missing: missing.len(),
        predicted_secs: plan.predicted.total,
        plan_secs: t0.elapsed().as_secs_f64(),
        ..LoadReport::default()
    };
    check("service::load::planned", injected)?;
    let shape = *cache.shape();
    let formats = cache.chunk_formats().to_vec();
    let (first_done, wait_first) = mpsc::channel();
    let cut: Vec<bool> = (0..formats.len()).map(|i| cache.is_cut(i)).collect();
    let reads = Reads::new(io, pager, lineage, &shape, &formats, cut, &plan, first_done);
    let recompute: Vec<usize> = plan.recompute.iter().map(|&i| i as usize).collect();
    let (threads, recomputed) = read_and_recompute(
        model,
        cache,
        &reads,
        &recompute,
        readers,
        &wait_first,
        during,
    );
    let io_out = gather(threads, &mut readers.ring)?;
    check("service::load::reads_done", injected)?;
    report.recompute_secs = recompute_failed(model, cache, &io_out.failed, &recompute, recomputed)?;
    check("service::load::done", injected)?;
    report.read_bytes = io_out.bytes;
    report.io_secs = io_out.secs;
    report.recomputed = plan.recompute;
    report.recomputed.extend(&io_out.failed);
    report.recomputed.sort_unstable();
    report.read = io_out.ok;
    report.failed_reads = io_out.failed;
    report.total_secs = t0.elapsed().as_secs_f64();
    Ok(report)
}

/// Step 1: which of the `missing` chunks are read and which recomputed. Of those the store holds,
/// `policy::plan_load` splits them (paper Eq. 4), or `mode` reads or recomputes them all; the
/// others must be recomputed.
fn plan(
    missing: &[usize],
    stored: &[Option<StoredCopy>],
    mode: LoadMode,
    cost: &CostModel,
    cache: &KvCache,
) -> Result<LoadPlan, ServiceError> {
    // Chunks past a sliding window are read: recomputing one needs its whole lookback.
    let first = cache.first_recomputable() as u32;
    let readable: Vec<MissingChunk> = missing
        .iter()
        .filter_map(|&i| {
            stored.get(i).copied().flatten().map(|s| MissingChunk {
                index: i as u32,
                bytes: s.bytes,
            })
        })
        .collect();
    let unreadable: Vec<u32> = missing
        .iter()
        .map(|&i| i as u32)
        .filter(|i| !readable.iter().any(|r| r.index == *i))
        .collect();
    let mut plan = match mode {
        LoadMode::Planned => policy::plan_load_from(&readable, cost, first)?,
        LoadMode::ReadOnly => policy::planner::evaluate(&readable, &[], cost)?,
        LoadMode::RecomputeOnly => {
            let all: Vec<u32> = readable
                .iter()
                .map(|r| r.index)
                .filter(|&i| i >= first)
                .collect();
            policy::planner::evaluate(&readable, &all, cost)?
        }
    };
    // A chunk the store lacks comes back only by recompute, past the window with its lookback
    // (the missing chunks in it are not read then).
    let mut forced: Vec<u32> = Vec::new();
    for &u in &unreadable {
        forced.extend(
            cache
                .recompute_closure(u as usize)
                .map(|c| c as u32)
                .filter(|c| missing.contains(&(*c as usize))),
        );
    }
    forced.sort_unstable();
    forced.dedup();
    force_recompute(&mut plan, &forced);
    Ok(plan)
}

/// Adds chunks that cannot be read to the plan's recompute set, and moves the reads they now
/// depend on to the blocking group.
fn force_recompute(plan: &mut LoadPlan, unreadable: &[u32]) {
    if unreadable.is_empty() {
        return;
    }
    plan.read_first.retain(|i| !unreadable.contains(i));
    plan.read_after.retain(|i| !unreadable.contains(i));
    plan.recompute.extend_from_slice(unreadable);
    plan.recompute.sort_unstable();
    plan.recompute.dedup();
    let last = *plan.recompute.last().expect("not empty");
    let (before, after): (Vec<u32>, Vec<u32>) = plan.read_after.iter().partition(|&&i| i < last);
    plan.read_first.extend(before);
    plan.read_first.sort_unstable();
    plan.read_after = after;
}

/// Step 2: the reads and the recompute at once. Through a mount one thread keeps the reads in
/// flight on the io_uring: the engine thread itself when nothing is recomputed (it runs `during`
/// once they are under way), else an I/O thread. Without the ring the I/O threads pull the reads
/// from one shared cursor: all of them when nothing is recomputed (the engine thread is idle),
/// one otherwise. The engine thread runs `during`, waits for the blocking reads and recomputes.
/// Returns what each reading thread did (a panic caught) and the recompute's time.
fn read_and_recompute(
    model: &Model,
    cache: &mut KvCache,
    reads: &Reads<'_>,
    recompute: &[usize],
    readers: &mut Readers,
    wait_first: &mpsc::Receiver<()>,
    during: impl FnOnce(),
) -> (Vec<std::thread::Result<IoOut>>, Result<f64, ServiceError>) {
    let Readers { pool, buf, ring } = readers;
    let ring = if reads.io.mountpoint().is_some() {
        ring.as_deref_mut()
    } else {
        None
    };
    let threads = if ring.is_some() || !recompute.is_empty() {
        1
    } else {
        pool.current_num_threads().max(1)
    }
    .min(reads.order.len().max(1));
    let done = Mutex::new(Vec::with_capacity(threads));
    let finish = |r: std::thread::Result<IoOut>| {
        if r.is_err() {
            reads.abandon();
        }
        done.lock().push(r);
    };
    let finish = &finish;
    let recomputed = match ring {
        Some(ring) if recompute.is_empty() => {
            // Nothing to recompute: the engine thread keeps the reads in flight itself, with no
            // hand-off to an I/O thread, and encodes the prompt once they are under way.
            finish(catch_unwind(AssertUnwindSafe(|| {
                reads.ring(ring, Some(during))
            })));
            Ok(0.0)
        }
        ring => pool.in_place_scope(|s| {
            if let Some(ring) = ring {
                s.spawn(move |_| {
                    finish(catch_unwind(AssertUnwindSafe(|| {
                        reads.ring(ring, None::<fn()>)
                    })))
                });
            } else {
                for part in buf.parts(threads, reads.part) {
                    s.spawn(move |_| finish(catch_unwind(AssertUnwindSafe(|| reads.pull(part)))));
                }
            }
            during();
            let _ = wait_first.recv();
            recompute_planned(model, cache, recompute)
        }),
    };
    (done.into_inner(), recomputed)
}

/// The planned recompute, on the engine thread once the blocking reads are resident; its time.
fn recompute_planned(
    model: &Model,
    cache: &mut KvCache,
    recompute: &[usize],
) -> Result<f64, ServiceError> {
    if recompute.is_empty() {
        return Ok(0.0);
    }
    check("service::load::recompute", injected)?;
    let t = Instant::now();
    recompute_chunks(model, cache, recompute)?;
    Ok(t.elapsed().as_secs_f64())
}

/// Joins what the reading threads did. A thread that panicked fails the Load. The ring is given
/// up when a panic, or a failure of the ring itself, may have left reads of this Load in flight
/// on it: they must never be reaped into another Load.
fn gather(
    threads: Vec<std::thread::Result<IoOut>>,
    ring: &mut Option<Box<ReadRing>>,
) -> Result<IoOut, ServiceError> {
    let mut all = IoOut::default();
    for r in threads {
        let Ok(out) = r else {
            *ring = None;
            return Err(ServiceError::Internal {
                what: "a load I/O thread panicked".into(),
            });
        };
        all.ok.extend(out.ok);
        all.failed.extend(out.failed);
        all.bytes += out.bytes;
        all.secs = f64::max(all.secs, out.secs);
        all.ring_failed |= out.ring_failed;
    }
    all.ok.sort_unstable();
    all.failed.sort_unstable();
    if all.ring_failed {
        *ring = None;
    }
    Ok(all)
}

/// Step 3: the chunks whose read failed (missing, corrupt: kvfs quarantined them, other model),
/// recomputed now that every other chunk is resident. A blocking read that failed leaves the
/// planned recompute short of a chunk it attends to (`recomputed` is a dependency error): then
/// the planned set is recomputed with them. Returns the whole recompute time.
fn recompute_failed(
    model: &Model,
    cache: &mut KvCache,
    failed: &[u32],
    planned: &[usize],
    recomputed: Result<f64, ServiceError>,
) -> Result<f64, ServiceError> {
    let mut again: Vec<usize> = failed.iter().map(|&i| i as usize).collect();
    let mut secs = 0.0;
    match recomputed {
        Ok(s) => secs = s,
        Err(ServiceError::Recompute(RecomputeError::Dependency { .. })) if !failed.is_empty() => {
            again.extend(planned);
        }
        Err(e) => return Err(e),
    }
    if !again.is_empty() {
        // Past a sliding window, with each chunk's lookback.
        let mut all: Vec<usize> = again
            .iter()
            .flat_map(|&c| cache.recompute_closure(c))
            .collect();
        all.sort_unstable();
        all.dedup();
        let again = all;
        let t = Instant::now();
        recompute_chunks(model, cache, &again)?;
        secs += t.elapsed().as_secs_f64();
    }
    Ok(secs)
}

/// What an I/O thread did: the chunks it brought back, those whose read failed (to recompute),
/// the bytes it read and its busy time.
#[derive(Default)]
struct IoOut {
    ok: Vec<u32>,
    failed: Vec<u32>,
    bytes: u64,
    secs: f64,
    /// The io_uring failed: it is given up for good.
    ring_failed: bool,
}

impl IoOut {
    fn record(&mut self, key: ChunkKey, r: Result<u64, ServiceError>) {
        match r {
            Ok(b) => {
                self.ok.push(key.index);
                self.bytes += b;
            }
            Err(e) => {
                tracing::debug!(chunk = %key, error = %e, "read failed; recomputing it");
                self.failed.push(key.index);
            }
        }
    }
}

/// What an I/O thread keeps besides its part of the readers' buffer: a buffer for a stored copy
/// larger than the part, and room to recompress one.
#[derive(Default)]
struct Spare {
    read: AlignedBuf,
    recompressed: Vec<u8>,
}

/// One Load's reads, and what the threads that make them share.
struct Reads<'a> {
    io: &'a ChunkIo,
    pager: &'a Pager,
    shape: &'a ChunkShape,
    /// Per chunk, whether it is kept cut to its global layers (past the sliding window).
    cut: Vec<bool>,
    formats: &'a [KvFormat],
    /// Which context holds each chunk (a borrowed one is read from, and put into, its prefix).
    lineage: &'a Lineage,
    /// The chunks to read, blocking ones (those the recompute attends to) first.
    order: Vec<u32>,
    /// How many of `order` are blocking.
    blocking: usize,
    /// The largest chunk of the Load in the formats the cache records: each thread reads into a
    /// part of the readers' buffer that size (a heavier stored copy, rare, goes through the
    /// thread's spare buffer), and so does a read that does not go through the ring.
    part: usize,
    /// The next read of `order`, for the threads that pull them.
    cursor: AtomicUsize,
    /// Blocking reads not done yet.
    first_left: AtomicUsize,
    /// Told when the last blocking read is done, or a reading thread died: the recompute starts.
    first_done: mpsc::Sender<()>,
}

impl<'a> Reads<'a> {
    #[allow(clippy::too_many_arguments)]
    fn new(
        io: &'a ChunkIo,
        pager: &'a Pager,
        lineage: &'a Lineage,
        shape: &'a ChunkShape,
        formats: &'a [KvFormat],
        cut: Vec<bool>,
        plan: &LoadPlan,
        first_done: mpsc::Sender<()>,
    ) -> Self {
        let order: Vec<u32> = plan
            .read_first
            .iter()
            .chain(&plan.read_after)
            .copied()
            .collect();
        let blocking = plan.read_first.len();
        if blocking == 0 {
            let _ = first_done.send(());
        }
        let part = order
            .iter()
            .map(|&i| shape.chunk_bytes(formats[i as usize]))
            .max()
            .unwrap_or(0);
        Reads {
            io,
            pager,
            shape,
            formats,
            cut,
            lineage,
            order,
            blocking,
            part,
            cursor: AtomicUsize::new(0),
            first_left: AtomicUsize::new(blocking),
            first_done,
        }
    }

    /// Chunk `i`'s shape: trimmed past the sliding window.
    fn shape_of(&self, i: u32) -> ChunkShape {
        if self.cut.get(i as usize).copied().unwrap_or(false) {
            self.shape.trimmed()
        } else {
            *self.shape
        }
    }

    /// Counts the `n`th read of `order` done (resident, or failed); the last blocking one lets
    /// the recompute start.
    fn done(&self, n: usize) {
        if n < self.blocking && self.first_left.fetch_sub(1, Ordering::AcqRel) == 1 {
            let _ = self.first_done.send(());
        }
    }

    /// A reading thread died: never leave the recompute waiting for a signal that will not come.
    fn abandon(&self) {
        let _ = self.first_done.send(());
    }

    /// One thread's reads without the ring: it pulls the next read from the shared cursor, reads
    /// it into `buf` (its part of the readers' buffer) and populates the slot, until none is left.
    fn pull(&self, buf: &mut [u8]) -> IoOut {
        let t = Instant::now();
        let mut out = IoOut::default();
        let mut spare = Spare::default();
        loop {
            let n = self.cursor.fetch_add(1, Ordering::Relaxed);
            let Some(&i) = self.order.get(n) else { break };
            let key = self.lineage.key(i);
            let want = self.formats[i as usize];
            let r = read_one(
                self.io,
                self.pager,
                &self.shape_of(i),
                want,
                key,
                &mut *buf,
                &mut spare,
            );
            out.record(key, r);
            self.done(n);
        }
        out.secs = t.elapsed().as_secs_f64();
        out
    }

    /// The reads on the io_uring: keeps as many in flight as the ring's buffer holds, populates
    /// each chunk as its read ends, and counts it done once it is resident or has failed.
    /// A chunk the ring cannot read (not stored raw, larger than the ring's buffer, a read or a
    /// check that fails) is read the usual way ([`read_one`]), which retries a chunk a rewrite
    /// moved and quarantines a bad one. `during` runs once the first reads are under way.
    fn ring(&self, ring: &mut ReadRing, mut during: Option<impl FnOnce()>) -> IoOut {
        let t = Instant::now();
        let mut out = IoOut::default();
        let mut spare = Spare::default();
        let mut fallback = AlignedBuf::default();
        let mut slots: Vec<Option<(Arc<MountReader>, RawSlot)>> = vec![None; self.order.len()];
        let mut next = 0;
        let mut aside = 0.0;
        loop {
            while next < self.order.len() {
                let n = next;
                let i = self.order[n];
                let started = match self.io.raw_slot(self.lineage.owner(i).0, i) {
                    Some((file, slot)) => {
                        match ring.start(n as u64, file.as_fd(), slot.offset(), slot.read_len()) {
                            Ok(true) => {
                                slots[n] = Some((file, slot));
                                true
                            }
                            // No room now: wait for a read to end.
                            Ok(false) if ring.in_flight() > 0 => break,
                            Ok(false) => false,
                            Err(e) => {
                                tracing::debug!(error = %e, "io_uring read not started");
                                false
                            }
                        }
                    }
                    _ => false,
                };
                if !started {
                    self.read_alone(n, &mut out, &mut fallback, &mut spare);
                }
                next += 1;
            }
            if let Some(f) = during.take() {
                let t = Instant::now();
                f();
                // Not the reads' time: the cost model fits its read costs on `secs`.
                aside = t.elapsed().as_secs_f64();
            }
            let read = match ring.wait() {
                Ok(Some(read)) => read,
                Ok(None) => break,
                Err(e) => {
                    // The ring failed: read what it had in flight the usual way, and the rest;
                    // the Load then gives the ring up.
                    tracing::warn!(error = %e, "io_uring failed; reading the Load's chunks one by one");
                    out.ring_failed = true;
                    let left = slots
                        .iter_mut()
                        .enumerate()
                        .filter_map(|(n, s)| s.take().map(|_| n));
                    for n in left.chain(next..self.order.len()).collect::<Vec<_>>() {
                        self.read_alone(n, &mut out, &mut fallback, &mut spare);
                    }
                    break;
                }
            };
            let n = read.tag as usize;
            let i = self.order[n];
            let key = self.lineage.key(i);
            let (file, slot) = slots[n].take().expect("a started read has its slot");
            let bytes = ring.bytes(&read);
            let got = read.result.as_ref().map_or(0, |&got| got.min(bytes.len()));
            let r = match file.check_raw(&slot, &bytes[..got]) {
                Some(meta) => install(
                    self.pager,
                    &self.shape_of(i),
                    self.formats[i as usize],
                    key,
                    meta.format,
                    &bytes[slot.payload()],
                    &mut spare.recompressed,
                ),
                None => self.read_one(i, &mut fallback, &mut spare),
            };
            ring.release(read);
            out.record(key, r);
            self.done(n);
        }
        out.secs = t.elapsed().as_secs_f64() - aside;
        out
    }

    /// Reads the `n`th chunk of `order` the usual way ([`read_one`]), records it and counts it
    /// done.
    fn read_alone(&self, n: usize, out: &mut IoOut, buf: &mut AlignedBuf, spare: &mut Spare) {
        let i = self.order[n];
        let r = self.read_one(i, buf, spare);
        out.record(self.lineage.key(i), r);
        self.done(n);
    }

    fn read_one(
        &self,
        i: u32,
        buf: &mut AlignedBuf,
        spare: &mut Spare,
    ) -> Result<u64, ServiceError> {
        read_one(
            self.io,
            self.pager,
            &self.shape_of(i),
            self.formats[i as usize],
            self.lineage.key(i),
            buf.get(self.part.next_multiple_of(4096).max(4096)),
            spare,
        )
    }
}

/// Reads one chunk from kvfs into `buf` (page-aligned and page-sized, in huge pages: through the
/// mount, the kernel reads the chunk's payload straight into it with `O_DIRECT`), or into `spare`
/// when the stored copy is larger, and populates its slot ([`install`]).
fn read_one(
    io: &ChunkIo,
    pager: &Pager,
    shape: &ChunkShape,
    want: KvFormat,
    key: ChunkKey,
    buf: &mut [u8],
    spare: &mut Spare,
) -> Result<u64, ServiceError> {
    let mut buf = buf;
    let meta = loop {
        match io.read_into(key.ctx.0, key.index, &mut *buf) {
            Err(kvfs::StoreError::BufferTooSmall { need, .. }) if need > buf.len() => {
                buf = spare.read.get(need.next_multiple_of(4096));
            }
            r => break r?,
        }
    };
    let bytes = &buf[..meta.raw_len as usize];
    install(
        pager,
        shape,
        want,
        key,
        meta.format,
        bytes,
        &mut spare.recompressed,
    )
}

/// Populates chunk `key`'s slot with `bytes`, a copy the store holds in format `stored`, and
/// returns how many bytes were read. A stored copy heavier than the format the cache records (the
/// chunk was recompressed in memory after it was written) is recompressed on the way in, into
/// `recompressed`, which gives the same bytes.
fn install(
    pager: &Pager,
    shape: &ChunkShape,
    want: KvFormat,
    key: ChunkKey,
    stored: kvfs::KvFormat,
    bytes: &[u8],
    recompressed: &mut Vec<u8>,
) -> Result<u64, ServiceError> {
    check("service::load::chunk_read", injected)?;
    let have = stored;
    let n = bytes.len() as u64;
    // A whole copy of a chunk now past the sliding window (`shape` is then the trimmed one):
    // its global layers come first, so they are its prefix.
    let bytes = bytes.get(..shape.chunk_bytes(have)).unwrap_or(bytes);
    let data: &[u8] = if have == want {
        bytes
    } else if model::kv::codec::moves_down(shape, have, want) && have != KvFormat::F16 {
        model::kv::codec::recompress(shape, have, want, bytes, recompressed).map_err(|e| {
            ServiceError::ChunkMismatch {
                key,
                what: e.to_string(),
            }
        })?;
        recompressed
    } else {
        return Err(ServiceError::ChunkMismatch {
            key,
            what: format!(
                "stored as {} but the context holds it as {}",
                have.name(),
                want.name()
            ),
        });
    };
    if data.len() != shape.chunk_bytes(want) {
        return Err(ServiceError::ChunkMismatch {
            key,
            what: format!(
                "{} bytes stored for a {}-byte chunk",
                data.len(),
                shape.chunk_bytes(want)
            ),
        });
    }
    pager.populate(key, data.len(), data)?;
    check("service::load::chunk_populated", injected)?;
    if have == want {
        // The slot holds exactly what the store does: reclaiming it again needs no write.
        pager.mark_persisted(key)?;
    }
    Ok(n)
}
