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

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Instant;

use kvfs::io::AlignedBuf;
use policy::{CostModel, LoadPlan, MissingChunk};
use uffd_pager::{ChunkKey, ContextId, Pager};

use crate::kv::recompute::{RecomputeError, recompute_chunks};
use crate::kv::{ChunkShape, KvCache, KvFormat};
use crate::model::Model;
use crate::service::ServiceError;
use crate::service::chunk_io::ChunkIo;
use crate::service::source::from_store;

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

/// What the store holds of a context's chunk: its format there and its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoredChunk {
    pub format: KvFormat,
    pub bytes: u64,
}

/// The Load's I/O threads and their read buffers, kept between Loads: the threads wait parked,
/// so a switch does not pay for starting them, and the buffers are one mapping in transparent
/// huge pages (`AlignedBuf::huge`), into which direct reads run about twice as fast as into
/// small pages (docs/kvfs.md), carved into one part per thread.
#[derive(Debug)]
pub struct Readers {
    pool: rayon::ThreadPool,
    buf: AlignedBuf,
}

impl Readers {
    /// `threads` I/O threads (at least one); their buffers are mapped at the first Load.
    pub fn new(threads: usize) -> Result<Readers, ServiceError> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .thread_name(|i| format!("llms-load-{i}"))
            .build()
            .map_err(|e| ServiceError::Internal {
                what: format!("starting the Load's I/O threads: {e}"),
            })?;
        Ok(Readers {
            pool,
            buf: AlignedBuf::huge(0),
        })
    }

    /// The read buffers' bytes (whole huge pages, sized to the largest Load's chunks so far).
    pub fn buffer_bytes(&self) -> usize {
        self.buf.capacity()
    }

    /// Of those, the bytes the kernel backs with huge pages.
    pub fn huge_bytes(&self) -> usize {
        self.buf.huge_bytes()
    }
}

/// Brings every missing chunk of `cache` back. `stored[i]` is what the store holds of chunk `i`.
/// The cache must be pinned. The reads run on `readers` (all its threads when nothing is
/// recomputed, one otherwise), each into its own part of their buffer. `during` is the caller's
/// own work (encoding the prompt): it runs on the calling thread once the reads are under way and
/// before any recompute, and has run when the Load returns `Ok`.
#[allow(clippy::too_many_arguments)]
pub fn load(
    model: &Model,
    io: &ChunkIo,
    pager: &Pager,
    ctx: u64,
    cache: &mut KvCache,
    stored: &[Option<StoredChunk>],
    mode: LoadMode,
    cost: &CostModel,
    readers: &mut Readers,
    during: impl FnOnce(),
) -> Result<LoadReport, ServiceError> {
    let t0 = Instant::now();
    let missing = cache.missing_chunks();
    let mut report = LoadReport {
        missing: missing.len(),
        ..LoadReport::default()
    };
    if missing.is_empty() {
        during();
        return Ok(report);
    }
    let _span = tracing::debug_span!("load", ctx, missing = missing.len()).entered();
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
        LoadMode::Planned => policy::plan_load(&readable, cost)?,
        LoadMode::ReadOnly => policy::planner::evaluate(&readable, &[], cost)?,
        LoadMode::RecomputeOnly => {
            let all: Vec<u32> = readable.iter().map(|r| r.index).collect();
            policy::planner::evaluate(&readable, &all, cost)?
        }
    };
    force_recompute(&mut plan, &unreadable);
    report.predicted_secs = plan.predicted.total;
    report.plan_secs = t0.elapsed().as_secs_f64();

    let shape = *cache.shape();
    let formats = cache.chunk_formats().to_vec();
    let (first_done, wait_first) = mpsc::channel::<()>();
    // The reads, blocking ones first, pulled by the I/O threads from one shared cursor; the
    // thread that finishes the last blocking read lets the recompute start.
    let order: Vec<u32> = plan
        .read_first
        .iter()
        .chain(&plan.read_after)
        .copied()
        .collect();
    let blocking = plan.read_first.len();
    let cursor = AtomicUsize::new(0);
    let first_left = AtomicUsize::new(blocking);
    if blocking == 0 {
        let _ = first_done.send(());
    }
    let io = |buf: &mut [u8]| -> (Vec<u32>, Vec<u32>, u64, f64) {
        let t = Instant::now();
        let (mut ok, mut failed, mut bytes) = (Vec::new(), Vec::new(), 0);
        let mut spare = Spare::default();
        loop {
            let n = cursor.fetch_add(1, Ordering::Relaxed);
            let Some(&i) = order.get(n) else { break };
            let key = ChunkKey {
                ctx: ContextId(ctx),
                index: i,
            };
            let r = read_one(
                io,
                pager,
                &shape,
                formats[i as usize],
                key,
                &mut *buf,
                &mut spare,
            );
            match r {
                Ok(b) => {
                    ok.push(i);
                    bytes += b;
                }
                Err(e) => {
                    tracing::debug!(chunk = %key, error = %e, "read failed; recomputing it");
                    failed.push(i);
                }
            }
            if n < blocking && first_left.fetch_sub(1, Ordering::AcqRel) == 1 {
                let _ = first_done.send(());
            }
        }
        (ok, failed, bytes, t.elapsed().as_secs_f64())
    };
    let recompute = plan
        .recompute
        .iter()
        .map(|&i| i as usize)
        .collect::<Vec<_>>();
    // With nothing to recompute the engine thread is idle: every core reads.
    let threads = if recompute.is_empty() {
        readers.pool.current_num_threads().max(1)
    } else {
        1
    }
    .min(order.len().max(1));
    // Each thread reads into its own part of the readers' buffer, sized for the largest chunk
    // of this Load in the formats the cache records (a heavier stored copy, rare, goes through
    // the thread's spare buffer).
    let part = order
        .iter()
        .map(|&i| shape.chunk_bytes(formats[i as usize]))
        .max()
        .unwrap_or(0);
    let Readers { pool, buf } = readers;
    let parts = buf.parts(threads, part);
    // A thread started late finds the chunks taken by the first one, and the reads run one after
    // another.
    let done = std::sync::Mutex::new(Vec::with_capacity(threads));
    let io = &io;
    let (io_out, re_out) = pool.in_place_scope(|s| {
        for part in parts {
            s.spawn(|_| {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| io(part)));
                if r.is_err() {
                    // Never leave the recompute waiting for a signal that will not come.
                    let _ = first_done.send(());
                }
                done.lock().unwrap_or_else(|e| e.into_inner()).push(r);
            });
        }
        during();
        let _ = wait_first.recv();
        let t_re = Instant::now();
        let re = if recompute.is_empty() {
            Ok(0.0)
        } else {
            recompute_chunks(model, cache, &recompute).map(|_| t_re.elapsed().as_secs_f64())
        };
        (Ok::<_, ServiceError>(()), re)
    });
    let io_out = io_out.and_then(|()| {
        let mut out = (Vec::new(), Vec::new(), 0, 0.0);
        for r in done.into_inner().unwrap_or_else(|e| e.into_inner()) {
            let (ok, failed, bytes, secs) = r.map_err(|_| ServiceError::Internal {
                what: "a load I/O thread panicked".into(),
            })?;
            out.0.extend(ok);
            out.1.extend(failed);
            out.2 += bytes;
            out.3 = f64::max(out.3, secs);
        }
        out.0.sort_unstable();
        out.1.sort_unstable();
        Ok(out)
    });
    let (read, failed, read_bytes, io_secs) = io_out?;
    // A blocking read that failed leaves the planned recompute short of a chunk it attends to:
    // then the planned set is recomputed with the failed reads, now that the rest is resident.
    let mut again: Vec<usize> = failed.iter().map(|&i| i as usize).collect();
    match re_out {
        Ok(secs) => report.recompute_secs = secs,
        Err(RecomputeError::Dependency { .. }) if !failed.is_empty() => again.extend(&recompute),
        Err(e) => return Err(e.into()),
    }
    if !again.is_empty() {
        let t = Instant::now();
        recompute_chunks(model, cache, &again)?;
        report.recompute_secs += t.elapsed().as_secs_f64();
    }
    report.read = read;
    report.read_bytes = read_bytes;
    report.io_secs = io_secs;
    report.recomputed = plan.recompute.clone();
    report.recomputed.extend(&failed);
    report.recomputed.sort_unstable();
    report.failed_reads = failed;
    report.total_secs = t0.elapsed().as_secs_f64();
    Ok(report)
}

/// Adds chunks that cannot be read to the plan's recompute set, and moves the reads they now
/// depend on to the blocking group.
fn force_recompute(plan: &mut LoadPlan, unreadable: &[u32]) {
    if unreadable.is_empty() {
        return;
    }
    plan.recompute.extend_from_slice(unreadable);
    plan.recompute.sort_unstable();
    let last = *plan.recompute.last().expect("not empty");
    let (before, after): (Vec<u32>, Vec<u32>) = plan.read_after.iter().partition(|&&i| i < last);
    plan.read_first.extend(before);
    plan.read_first.sort_unstable();
    plan.read_after = after;
}

/// What an I/O thread keeps besides its part of the readers' buffer: a buffer for a stored copy
/// larger than the part, and room to recompress one.
#[derive(Default)]
struct Spare {
    read: AlignedBuf,
    recompressed: Vec<u8>,
}

/// Reads one chunk from kvfs into `buf` (page-aligned and page-sized, in huge pages: through the
/// mount, the kernel reads the chunk's payload straight into it with `O_DIRECT`), or into `spare`
/// when the stored copy is larger, and populates its slot. A stored copy heavier than the format the
/// cache records (the chunk was recompressed in memory after it was written) is recompressed on
/// the way in, which gives the same bytes.
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
    let have = from_store(meta.format);
    let bytes = &buf[..meta.raw_len as usize];
    let n = bytes.len() as u64;
    let data: &[u8] = if have == want {
        bytes
    } else if crate::kv::codec::moves_down(shape, have, want) && have != KvFormat::F16 {
        crate::kv::codec::recompress(shape, have, want, bytes, &mut spare.recompressed).map_err(
            |e| ServiceError::Internal {
                what: format!("{key}: {e}"),
            },
        )?;
        &spare.recompressed
    } else {
        return Err(ServiceError::Internal {
            what: format!(
                "{key} is stored as {} but the context holds it as {}",
                have.name(),
                want.name()
            ),
        });
    };
    if data.len() != shape.chunk_bytes(want) {
        return Err(ServiceError::Internal {
            what: format!(
                "{key}: {} bytes stored for a {}-byte chunk",
                data.len(),
                shape.chunk_bytes(want)
            ),
        });
    }
    pager.populate(key, data.len(), data)?;
    if have == want {
        // The slot holds exactly what the store does: reclaiming it again needs no write.
        pager.mark_persisted(key)?;
    }
    Ok(n)
}
