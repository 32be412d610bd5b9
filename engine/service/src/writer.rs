//! The AoT writer (paper §3.4): at the end of a call, the chunks `policy::plan_writeout` lists
//! are written to kvfs by this background thread, off the caller's critical path; once written,
//! a chunk is marked persisted in the pager and can be reclaimed without I/O.
//!
//! The queue is bounded (a call that outruns the disk waits for room), and a chunk is marked
//! persisted only if its bytes did not change while it was being written (its version).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

use kvfs::StoreError;
use parking_lot::{Condvar, Mutex};
use uffd_pager::{ChunkKey, Pager};

use crate::chunk_io::ChunkIo;
use crate::memory::Versions;
use model::kv::KvFormat;

/// One chunk to write.
#[derive(Debug)]
pub struct WriteJob {
    pub key: ChunkKey,
    pub format: KvFormat,
    pub density: f32,
    pub bytes: Vec<u8>,
    /// The chunk's version when its bytes were copied.
    pub version: u64,
}

/// What the writer has done since it started.
#[derive(Debug, Default)]
pub struct WriterStats {
    pub written: AtomicU64,
    pub bytes: AtomicU64,
    pub failed: AtomicU64,
    /// Written, but changed in memory meanwhile: not marked persisted.
    pub stale: AtomicU64,
}

#[derive(Default)]
struct Pending {
    queued: Mutex<u64>,
    done: Condvar,
}

/// The background writer.
pub struct Writer {
    tx: Option<SyncSender<WriteJob>>,
    thread: Option<JoinHandle<()>>,
    pending: Arc<Pending>,
    stats: Arc<WriterStats>,
}

impl std::fmt::Debug for Writer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Writer").finish_non_exhaustive()
    }
}

struct Ctx {
    io: Arc<ChunkIo>,
    pager: Arc<Pager>,
    versions: Arc<Versions>,
    pending: Arc<Pending>,
    stats: Arc<WriterStats>,
}

impl Writer {
    /// Starts the writer thread with a queue of `capacity` chunks.
    pub fn spawn(
        io: Arc<ChunkIo>,
        pager: Arc<Pager>,
        versions: Arc<Versions>,
        capacity: usize,
    ) -> std::io::Result<Writer> {
        let (tx, rx) = sync_channel(capacity.max(1));
        let pending = Arc::new(Pending::default());
        let stats = Arc::new(WriterStats::default());
        let ctx = Ctx {
            io,
            pager,
            versions,
            pending: Arc::clone(&pending),
            stats: Arc::clone(&stats),
        };
        let thread = std::thread::Builder::new()
            .name("llms-aot-writer".into())
            .spawn(move || run(&ctx, &rx))?;
        Ok(Writer {
            tx: Some(tx),
            thread: Some(thread),
            pending,
            stats,
        })
    }

    /// Queues a chunk; waits for room when the queue is full.
    pub fn submit(&self, job: WriteJob) {
        *self.pending.queued.lock() += 1;
        if let Some(tx) = &self.tx
            && tx.send(job).is_err()
        {
            tracing::error!("the AoT writer thread is gone; chunk not written");
            self.finish_one();
        }
    }

    fn finish_one(&self) {
        let mut q = self.pending.queued.lock();
        *q -= 1;
        self.pending.done.notify_all();
    }

    /// Waits until every queued chunk is written.
    pub fn flush(&self) {
        let mut q = self.pending.queued.lock();
        self.pending.done.wait_while(&mut q, |q| *q > 0);
    }

    /// Chunks queued and not yet written.
    pub fn queued(&self) -> u64 {
        *self.pending.queued.lock()
    }

    /// The counters.
    pub fn stats(&self) -> &WriterStats {
        &self.stats
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(ctx: &Ctx, rx: &Receiver<WriteJob>) {
    while let Ok(job) = rx.recv() {
        write_one(ctx, &job);
        let mut q = ctx.pending.queued.lock();
        *q -= 1;
        ctx.pending.done.notify_all();
    }
}

fn write_one(ctx: &Ctx, job: &WriteJob) {
    let key = job.key;
    let _span = tracing::debug_span!("aot_write", chunk = %key).entered();
    let r = ctx
        .io
        .write(key.ctx.0, key.index, job.format, job.density, &job.bytes);
    match r {
        Ok(_) => {
            ctx.stats.written.fetch_add(1, Relaxed);
            ctx.stats.bytes.fetch_add(job.bytes.len() as u64, Relaxed);
            let current = ctx.versions.if_current(key, job.version, || {
                if let Err(e) = ctx.pager.mark_persisted(key) {
                    tracing::debug!(error = %e, "chunk written, not marked persisted");
                }
            });
            if !current {
                ctx.stats.stale.fetch_add(1, Relaxed);
            }
        }
        // The context was deleted while its chunks waited in the queue: nothing to write. (Through
        // the mount that shows as a failed write of a file that is gone, not as this error.)
        Err(StoreError::NoSuchContext { .. }) => {}
        Err(_) if ctx.io.store().meta(kvfs::ContextId(key.ctx.0)).is_err() => {}
        Err(e) => {
            ctx.stats.failed.fetch_add(1, Relaxed);
            tracing::warn!(error = %e, chunk = %key, "AoT write failed; the chunk stays in memory");
        }
    }
}
