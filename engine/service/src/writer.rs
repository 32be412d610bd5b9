//! The AoT writer (paper §3.4): at the end of a call, the chunks `policy::plan_writeout` lists
//! are written to kvfs by this background thread, off the caller's critical path; once written,
//! a chunk is marked persisted in the pager and can be reclaimed without I/O.
//!
//! The queue is bounded (a call that outruns the disk waits for room) and its flush waits for
//! every chunk queued before it ([`WriteQueue`]); a chunk is marked persisted only if its bytes
//! did not change while it was being written (its version, [`ChunkBook::if_current`]). A write
//! that fails, or panics, leaves its chunk resident and unpersisted: the pager writes it when it
//! reclaims it, and it is never counted as persisted.
//!
//! Failpoints (the `failpoints` feature, docs/service.md "Failpoints"): `service::writer::write`
//! before a chunk's write, `service::writer::written` after the store took it and before it is
//! marked persisted, `service::writer::marked` after.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::thread::JoinHandle;

use kvfs::StoreError;
use uffd_pager::{ChunkKey, Pager};

use crate::chunk_io::ChunkIo;
use crate::chunks::ChunkBook;
use crate::failpoints::check;
use crate::write_queue::WriteQueue;
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
    /// Writes that failed (or panicked): their chunks stay resident, not persisted.
    pub failed: AtomicU64,
    /// Written, but changed in memory meanwhile: not marked persisted.
    pub stale: AtomicU64,
}

/// The background writer.
pub struct Writer {
    queue: Arc<WriteQueue<WriteJob>>,
    thread: Option<JoinHandle<()>>,
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
    book: Arc<ChunkBook>,
    stats: Arc<WriterStats>,
}

impl Writer {
    /// Starts the writer thread with a queue of `capacity` chunks.
    pub fn spawn(
        io: Arc<ChunkIo>,
        pager: Arc<Pager>,
        book: Arc<ChunkBook>,
        capacity: usize,
    ) -> std::io::Result<Writer> {
        let queue = Arc::new(WriteQueue::new(capacity));
        let stats = Arc::new(WriterStats::default());
        let ctx = Ctx {
            io,
            pager,
            book,
            stats: Arc::clone(&stats),
        };
        let served = Arc::clone(&queue);
        let thread = std::thread::Builder::new()
            .name("llms-aot-writer".into())
            .spawn(move || {
                served.serve(
                    |job| write_one(&ctx, &job),
                    || {
                        ctx.stats.failed.fetch_add(1, Relaxed);
                        tracing::error!("an AoT write panicked; the chunk stays in memory");
                    },
                );
            })?;
        Ok(Writer {
            queue,
            thread: Some(thread),
            stats,
        })
    }

    /// Queues a chunk; waits for room when the queue is full.
    pub fn submit(&self, job: WriteJob) {
        if let Err(job) = self.queue.submit(job) {
            tracing::error!(chunk = %job.key, "the AoT writer is closed; chunk not written");
        }
    }

    /// Waits until every chunk queued before this call is written (or its write failed).
    pub fn flush(&self) {
        self.queue.flush();
    }

    /// Chunks queued and not yet written.
    pub fn queued(&self) -> u64 {
        self.queue.pending()
    }

    /// The counters.
    pub fn stats(&self) -> &WriterStats {
        &self.stats
    }
}

impl Drop for Writer {
    /// Writes what is queued, then stops the thread.
    fn drop(&mut self) {
        self.queue.close();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The error the failpoint `name` injects into a chunk's write.
fn injected(name: &'static str, job: &WriteJob) -> StoreError {
    StoreError::Io(kvfs::io::IoError::new(
        "write",
        std::path::Path::new(&format!("chunk {}", job.key)),
        std::io::Error::other(format!("failpoint {name}")),
    ))
}

fn write_one(ctx: &Ctx, job: &WriteJob) {
    let key = job.key;
    let _span = tracing::debug_span!("aot_write", chunk = %key).entered();
    let r = check("service::writer::write", |name| injected(name, job))
        .and_then(|()| {
            ctx.io
                .write(key.ctx.0, key.index, job.format, job.density, &job.bytes)
        })
        .and_then(|_| check("service::writer::written", |name| injected(name, job)));
    match r {
        Ok(()) => {
            ctx.stats.written.fetch_add(1, Relaxed);
            ctx.stats.bytes.fetch_add(job.bytes.len() as u64, Relaxed);
            ctx.book
                .settle_stored(key, job.format, ctx.io.stored_copy(key));
            let current = ctx.book.if_current(key, job.version, || {
                if let Err(e) = ctx.pager.mark_persisted(key) {
                    tracing::debug!(error = %e, "chunk written, not marked persisted");
                }
            });
            if !current {
                ctx.stats.stale.fetch_add(1, Relaxed);
            }
            let _ = check("service::writer::marked", |_| ());
        }
        // The context was deleted while its chunks waited in the queue: nothing to write. (Through
        // the mount that shows as a failed write of a file that is gone, not as this error.)
        Err(StoreError::NoSuchContext { .. }) => {}
        Err(_) if ctx.io.store().meta(key.ctx).is_err() => {}
        Err(e) => {
            // The store keeps the copy it had before a failed write, if it had one.
            ctx.book
                .settle_stored(key, job.format, ctx.io.stored_copy(key));
            ctx.stats.failed.fetch_add(1, Relaxed);
            tracing::warn!(error = %e, chunk = %key, "AoT write failed; the chunk stays in memory");
        }
    }
}
