//! Weights under a memory budget (FlexInfer): the matrices `policy::plan_weights` keeps are held
//! in the engine's own memory, the others are read from the GGUF file for every pass into a
//! bounded ring of buffers by an I/O thread that runs ahead of the compute.
//!
//! The flow of one pass (a decode token or a prefill step; docs/bench-weights.md numbers it):
//! 1. The forward pass starts a [`Pass`] with the ids of the streamed matrices it will use, in
//!    order; the I/O thread gets the list at once.
//! 2. For each id the I/O thread takes a free buffer (it waits while all `slots` are full), reads
//!    the matrix's pieces of the file with `O_DIRECT` into an aligned staging buffer (the page
//!    cache never holds them), and repacks them into the buffer's split layout
//!    ([`QMatrix::refill`]); the full buffer goes to the compute.
//! 3. The compute takes each matrix when it reaches it ([`Pass::fetch`]), waits only if its read
//!    is not done, and gives the buffer back when the product is done.
//! 4. A pass that ends early (an error) drains what was asked for, so the next pass starts clean.
//!
//! [`WeightSource::Mmap`] is the baseline: the file mapped and every matrix repacked from the
//! mapping when it is used, in the compute thread, with no prefetch; page faults read it through
//! the page cache, which a memory cgroup charges to the process.

use crate::qmatrix::{Kind, QMatrix};
use std::collections::VecDeque;
use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, SyncSender, channel, sync_channel};
use std::time::Instant;

use kvfs::io::{AlignedBuf, HUGE_PAGE};
use parking_lot::{Mutex, MutexGuard};

pub use policy::Residency;

/// `O_DIRECT` transfers are aligned to this (offsets, lengths and memory).
pub const DIRECT_ALIGN: usize = 4096;

/// Where streamed weights come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightSource {
    /// `O_DIRECT` reads into a ring of buffers, ahead of the compute (FlexInfer).
    Direct,
    /// The file mapped, every matrix repacked from the mapping when it is used (the baseline).
    Mmap,
}

/// How to hold the weights.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WeightOptions {
    /// Bytes of weights the engine may hold (resident matrices, stream buffers, norms and
    /// RoPE tables); `None`: everything resident.
    pub budget: Option<u64>,
    /// Which matrices stay resident under the budget.
    pub residency: Residency,
    /// Where the others come from.
    pub source: WeightSource,
    /// Buffers the I/O thread may fill ahead of the compute.
    pub slots: usize,
    /// Read bandwidth for the plan, bytes/s; `None`: measured at load.
    pub read_bps: Option<f64>,
}

impl Default for WeightOptions {
    fn default() -> Self {
        Self {
            budget: None,
            residency: Residency::Preserve,
            source: WeightSource::Direct,
            slots: 4,
            read_bps: None,
        }
    }
}

/// Most pieces of the file one streamed matrix is made of (Q, K and V stacked: 3).
pub const MAX_PIECES: usize = 4;

/// Where one streamable matrix lies in the file: its rows are the pieces' blocks, in order.
#[derive(Clone, Debug)]
pub struct StreamUnit {
    pub kind: Kind,
    pub rows: usize,
    pub cols: usize,
    /// (offset in the file, bytes).
    pub pieces: Vec<(u64, usize)>,
}

impl StreamUnit {
    /// Bytes the matrix holds (the file's bytes: same size split or not).
    pub fn bytes(&self) -> usize {
        self.pieces.iter().map(|p| p.1).sum()
    }
}

/// What went wrong streaming a weight.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error("cannot read weights from {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the weight stream's I/O thread is gone")]
    Gone,
    #[error("weight {got} arrived where {expected} was due (a pass used its weights out of order)")]
    Order { expected: usize, got: usize },
}

/// Counters of a stream, since load.
#[derive(Debug, Default)]
pub struct StreamCounters {
    /// Bytes read from the file for streamed matrices.
    pub bytes_read: AtomicU64,
    /// Matrices read.
    pub reads: AtomicU64,
    /// Nanoseconds the compute waited for a matrix.
    pub wait_nanos: AtomicU64,
    /// Nanoseconds the I/O thread spent reading and repacking.
    pub io_nanos: AtomicU64,
}

/// A buffer on its way from the I/O thread to the compute: its id, or why it could not be read.
type Filled = (usize, Result<Box<QMatrix>, StreamError>);

struct Ring {
    requests: Sender<Vec<usize>>,
    filled: Receiver<Filled>,
    free: Sender<Box<QMatrix>>,
    /// The aligned window single rows are read into (a page or two, kept: a row is read per
    /// token).
    row: AlignedBuf,
}

enum Backend {
    Direct(Ring),
    Mmap {
        map: memmap2::Mmap,
        scratch: Receiver<Box<QMatrix>>,
        back: Sender<Box<QMatrix>>,
    },
}

/// The streamed matrices of a model and the machinery that brings them in.
pub struct WeightStream {
    units: Arc<Vec<StreamUnit>>,
    path: PathBuf,
    /// One pass at a time.
    backend: Mutex<Backend>,
    counters: Arc<StreamCounters>,
    /// A direct-I/O handle for single rows (embedding lookups).
    rows_file: File,
    /// Bytes of buffers the stream holds (ring and staging).
    buffer_bytes: usize,
}

/// Opens `path` for `O_DIRECT` reads.
fn open_direct(path: &Path) -> std::io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::fcntl::OFlag::O_DIRECT.bits())
        .open(path)
}

/// Reads `len` bytes at `offset` of `file` (opened `O_DIRECT`) into `window`, which starts
/// aligned and is at least [`window`]`(len)` long; returns where the bytes start in it.
fn read_direct(file: &File, window: &mut [u8], offset: u64, len: usize) -> std::io::Result<usize> {
    let a = DIRECT_ALIGN as u64;
    let start = offset / a * a;
    let end = (offset + len as u64).div_ceil(a) * a;
    let window = &mut window[..(end - start) as usize];
    let mut done = 0;
    while done < window.len() {
        let n = file.read_at(&mut window[done..], start + done as u64)?;
        if n == 0 {
            // End of file: the last page is short, which O_DIRECT allows there.
            if start + (done as u64) >= offset + len as u64 {
                break;
            }
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        done += n;
    }
    Ok((offset - start) as usize)
}

/// Staging bytes for the unit with the most: each piece in its own aligned window.
fn staging_bytes(units: &[StreamUnit]) -> usize {
    units
        .iter()
        .map(|u| u.pieces.iter().map(|p| window(p.1)).sum::<usize>())
        .max()
        .unwrap_or(0)
}

/// The staging buffer for `bytes`: with `huge`, in transparent huge pages from half of one up
/// (direct reads run about twice as fast into them on this project's disk,
/// docs/bench-weights.md), else and below in small pages, where rounding up to a huge page would
/// waste more than it holds. The weight planner counts it the same way
/// ([`policy::StreamModel::huge_page`]).
fn staging_buf(bytes: usize, huge: bool) -> AlignedBuf {
    if huge && 2 * bytes >= HUGE_PAGE {
        AlignedBuf::huge(bytes)
    } else {
        AlignedBuf::new(bytes)
    }
}

/// Bytes of an aligned window that covers `len` bytes at any offset.
fn window(len: usize) -> usize {
    len.div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN + DIRECT_ALIGN
}

/// The buffer capacity (scales, minimums, quants) that holds any of `units`.
fn slot_capacity(units: &[StreamUnit]) -> (usize, usize, usize) {
    let mut cap = (0, 0, 0);
    for u in units {
        let values = u.rows * u.cols;
        let blocks = values / crate::qmatrix::BLOCK;
        let (scales, mins, quants) = match u.kind {
            Kind::Q4_1 => (blocks, blocks, blocks * 16),
            Kind::Q8_0 => (blocks, 0, blocks * 32),
            // The file's blocks byte for byte.
            k => (0, 0, k.bytes_of(values)),
        };
        cap = (cap.0.max(scales), cap.1.max(mins), cap.2.max(quants));
    }
    cap
}

/// Reads one unit into `slot` through `staging`: each piece into its own aligned window, then
/// one repack.
fn read_unit(
    file: &File,
    staging: &mut [u8],
    unit: &StreamUnit,
    slot: &mut QMatrix,
) -> std::io::Result<()> {
    assert!(
        unit.pieces.len() <= MAX_PIECES,
        "a streamed matrix has at most {MAX_PIECES} pieces"
    );
    let mut spans = [(0usize, 0usize); MAX_PIECES];
    let mut base = 0;
    for (i, &(off, len)) in unit.pieces.iter().enumerate() {
        let w = window(len);
        let sub = &mut staging[base..base + w];
        let at = read_direct(file, sub, off, len)?;
        if let Some(s) = spans.get_mut(i) {
            *s = (base + at, len);
        }
        base += w;
    }
    let raw = &staging[..];
    let parts: [&[u8]; MAX_PIECES] = spans.map(|(a, l)| &raw[a..a + l]);
    slot.refill(unit.rows, unit.cols, unit.kind, &parts[..unit.pieces.len()]);
    Ok(())
}

impl WeightStream {
    /// Starts streaming `units` of the file at `path` from `source`, with `slots` buffers and a
    /// staging buffer in huge pages if `huge_staging` (and it is large enough to be worth one).
    pub fn start(
        path: &Path,
        units: Vec<StreamUnit>,
        source: WeightSource,
        slots: usize,
        huge_staging: bool,
    ) -> Result<Self, StreamError> {
        let io = |source| StreamError::Io {
            path: path.into(),
            source,
        };
        let units = Arc::new(units);
        let counters = Arc::new(StreamCounters::default());
        let cap = slot_capacity(&units);
        let slot = || {
            let mut q = Box::new(QMatrix::with_capacity(0, 0, Kind::Q8_0));
            q.reserve_parts(cap.0, cap.1, cap.2);
            q
        };
        let slot_bytes = slot().capacity_bytes();
        let rows_file = open_direct(path).map_err(io)?;
        let (backend, buffer_bytes) = match source {
            WeightSource::Direct => {
                let file = open_direct(path).map_err(io)?;
                let (requests, req_rx) = channel::<Vec<usize>>();
                let (filled_tx, filled) = sync_channel::<Filled>(slots.max(1));
                let (free, free_rx) = channel::<Box<QMatrix>>();
                for _ in 0..slots.max(1) {
                    let _ = free.send(slot());
                }
                let staging = staging_buf(staging_bytes(&units), huge_staging);
                let staging_bytes = staging.capacity();
                let (u, c, p) = (units.clone(), counters.clone(), path.to_path_buf());
                std::thread::Builder::new()
                    .name("llms-weights-io".into())
                    .spawn(move || {
                        io_thread(&file, &p, &u, &c, staging, &req_rx, &free_rx, &filled_tx)
                    })
                    .map_err(io)?;
                (
                    Backend::Direct(Ring {
                        requests,
                        filled,
                        free,
                        row: AlignedBuf::default(),
                    }),
                    slots.max(1) * slot_bytes + staging_bytes,
                )
            }
            WeightSource::Mmap => {
                let f = File::open(path).map_err(io)?;
                // SAFETY: the mapping is read-only and private; the model file is not modified
                // while the engine runs (the same assumption every mmap-based runtime makes), and
                // the bytes are only copied out of it, never referenced past a repack.
                let map = unsafe { memmap2::Mmap::map(&f) }.map_err(io)?;
                let (back, scratch) = channel();
                let _ = back.send(slot());
                (Backend::Mmap { map, scratch, back }, slot_bytes)
            }
        };
        Ok(Self {
            units,
            path: path.into(),
            backend: Mutex::new(backend),
            counters,
            rows_file,
            buffer_bytes,
        })
    }

    /// The streamed matrices, by id.
    pub fn units(&self) -> &[StreamUnit] {
        &self.units
    }

    /// Bytes of the stream's buffers.
    pub fn buffer_bytes(&self) -> usize {
        self.buffer_bytes
    }

    /// The stream's counters.
    pub fn counters(&self) -> &StreamCounters {
        &self.counters
    }

    /// Starts a pass that will use the streamed matrices `ids`, in that order.
    pub fn begin(&self, ids: Vec<usize>) -> Result<Pass<'_>, StreamError> {
        let backend = self.backend.lock();
        if let Backend::Direct(r) = &*backend
            && !ids.is_empty()
        {
            r.requests
                .send(ids.clone())
                .map_err(|_| StreamError::Gone)?;
        }
        Ok(Pass {
            stream: self,
            backend,
            due: ids.into(),
        })
    }

    /// Reads the raw bytes `len` at `offset` of the file (an embedding row), without the page
    /// cache, into `out`.
    pub fn read_raw(&self, offset: u64, len: usize, out: &mut Vec<u8>) -> Result<(), StreamError> {
        let mut backend = self.backend.lock();
        out.clear();
        let buf = match &mut *backend {
            Backend::Mmap { map, .. } => {
                out.extend_from_slice(&map[offset as usize..offset as usize + len]);
                return Ok(());
            }
            Backend::Direct(r) => r.row.get(window(len)),
        };
        let at =
            read_direct(&self.rows_file, buf, offset, len).map_err(|source| StreamError::Io {
                path: self.path.clone(),
                source,
            })?;
        out.extend_from_slice(&buf[at..at + len]);
        Ok(())
    }
}

#[allow(clippy::too_many_arguments)]
fn io_thread(
    file: &File,
    path: &Path,
    units: &[StreamUnit],
    counters: &StreamCounters,
    mut staging: AlignedBuf,
    requests: &Receiver<Vec<usize>>,
    free: &Receiver<Box<QMatrix>>,
    filled: &SyncSender<Filled>,
) {
    // Ends when the stream is dropped (its senders close).
    while let Ok(ids) = requests.recv() {
        for id in ids {
            let Ok(mut slot) = free.recv() else { return };
            let t = Instant::now();
            let unit = &units[id];
            let r = read_unit(file, &mut staging, unit, &mut slot);
            counters
                .io_nanos
                .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
            let msg = match r {
                Ok(()) => {
                    counters
                        .bytes_read
                        .fetch_add(unit.bytes() as u64, Ordering::Relaxed);
                    counters.reads.fetch_add(1, Ordering::Relaxed);
                    Ok(slot)
                }
                Err(source) => Err(StreamError::Io {
                    path: path.into(),
                    source,
                }),
            };
            if filled.send((id, msg)).is_err() {
                return;
            }
        }
    }
}

/// One pass's use of the stream: the matrices it asked for, in order.
pub struct Pass<'a> {
    stream: &'a WeightStream,
    backend: MutexGuard<'a, Backend>,
    due: VecDeque<usize>,
}

/// A streamed matrix, borrowed for one product; its buffer goes back when dropped.
pub struct Fetched {
    q: Option<Box<QMatrix>>,
    back: Sender<Box<QMatrix>>,
}

impl std::ops::Deref for Fetched {
    type Target = QMatrix;
    fn deref(&self) -> &QMatrix {
        self.q
            .as_deref()
            .expect("a fetched matrix is present until dropped")
    }
}

impl Drop for Fetched {
    fn drop(&mut self) {
        if let Some(q) = self.q.take() {
            // The I/O thread may be gone at shutdown; the buffer is then freed here.
            let _ = self.back.send(q);
        }
    }
}

impl Pass<'_> {
    /// The streamed matrix `id`, which must be the next one this pass asked for.
    pub fn fetch(&mut self, id: usize) -> Result<Fetched, StreamError> {
        let expected = self.due.pop_front();
        if expected != Some(id) {
            return Err(StreamError::Order {
                expected: expected.unwrap_or(usize::MAX),
                got: id,
            });
        }
        let t = Instant::now();
        let s = self.stream;
        let out = match &mut *self.backend {
            Backend::Direct(r) => {
                let (got, q) = r.filled.recv().map_err(|_| StreamError::Gone)?;
                let q = q?;
                let f = Fetched {
                    q: Some(q),
                    back: r.free.clone(),
                };
                if got != id {
                    return Err(StreamError::Order { expected: id, got });
                }
                f
            }
            Backend::Mmap { map, scratch, back } => {
                let mut q = scratch.recv().map_err(|_| StreamError::Gone)?;
                let unit = &s.units[id];
                let parts: Vec<&[u8]> = unit
                    .pieces
                    .iter()
                    .map(|&(o, l)| &map[o as usize..o as usize + l])
                    .collect();
                q.refill(unit.rows, unit.cols, unit.kind, &parts);
                s.counters
                    .bytes_read
                    .fetch_add(unit.bytes() as u64, Ordering::Relaxed);
                s.counters.reads.fetch_add(1, Ordering::Relaxed);
                Fetched {
                    q: Some(q),
                    back: back.clone(),
                }
            }
        };
        s.counters
            .wait_nanos
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(out)
    }
}

impl Drop for Pass<'_> {
    fn drop(&mut self) {
        // A pass cut short: take what the I/O thread still owes it, so the next pass's first
        // buffer is its own.
        if let Backend::Direct(r) = &*self.backend {
            for _ in self.due.drain(..) {
                match r.filled.recv() {
                    Ok((_, Ok(q))) => {
                        let _ = r.free.send(q);
                    }
                    Ok((_, Err(_))) => {}
                    Err(_) => break,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// A file of `n` Q8_0 blocks at an odd offset (so reads are unaligned), random but valid.
    fn blocks_file(dir: &Path, n: usize) -> (PathBuf, u64, Vec<u8>) {
        let mut rng = StdRng::seed_from_u64(7);
        let mut raw = Vec::with_capacity(n * 34);
        for _ in 0..n {
            raw.extend_from_slice(&half::f16::from_f32(rng.random::<f32>() * 0.01).to_le_bytes());
            raw.extend((0..32).map(|_| rng.random::<u8>()));
        }
        let path = dir.join("blocks.bin");
        let head = 1234u64;
        let mut file = vec![0u8; head as usize];
        file.extend_from_slice(&raw);
        std::fs::write(&path, &file).unwrap();
        (path, head, raw)
    }

    /// Units over the file: rows of 64 columns (2 blocks a row); one in two pieces.
    fn units(head: u64) -> Vec<StreamUnit> {
        let row = 68;
        vec![
            StreamUnit {
                kind: Kind::Q8_0,
                rows: 3,
                cols: 64,
                pieces: vec![(head, 3 * row)],
            },
            StreamUnit {
                kind: Kind::Q8_0,
                rows: 5,
                cols: 64,
                pieces: vec![
                    (head + 10 * row as u64, 2 * row),
                    (head + 40 * row as u64, 3 * row),
                ],
            },
            StreamUnit {
                kind: Kind::Q8_0,
                rows: 60,
                cols: 64,
                pieces: vec![(head + 100 * row as u64, 60 * row)],
            },
        ]
    }

    fn expected(raw: &[u8], head: u64, u: &StreamUnit) -> QMatrix {
        let mut bytes = Vec::new();
        for &(o, l) in &u.pieces {
            let o = (o - head) as usize;
            bytes.extend_from_slice(&raw[o..o + l]);
        }
        QMatrix::from_raw(u.rows, u.cols, u.kind, &bytes)
    }

    fn same(a: &QMatrix, b: &QMatrix) {
        assert_eq!(
            (a.rows(), a.cols(), a.kind()),
            (b.rows(), b.cols(), b.kind())
        );
        let mut fa = vec![0.0; a.rows() * a.cols()];
        let mut fb = fa.clone();
        a.dequant_rows(0, a.rows(), &mut fa);
        b.dequant_rows(0, b.rows(), &mut fb);
        assert_eq!(fa, fb);
    }

    #[test]
    fn passes_bring_the_file_bytes_in_order_from_either_source() {
        let dir = tempfile::tempdir().unwrap();
        let (path, head, raw) = blocks_file(dir.path(), 400);
        let us = units(head);
        for source in [WeightSource::Direct, WeightSource::Mmap] {
            for slots in [1, 2, 4] {
                let s = WeightStream::start(&path, us.clone(), source, slots, true).unwrap();
                for _ in 0..3 {
                    let mut p = s.begin(vec![0, 1, 2, 1]).unwrap();
                    for id in [0, 1, 2, 1] {
                        same(&p.fetch(id).unwrap(), &expected(&raw, head, &us[id]));
                    }
                }
                let c = s.counters();
                assert_eq!(c.reads.load(Ordering::Relaxed), 12);
                let bytes: usize = [0, 1, 2, 1].iter().map(|&i| us[i].bytes()).sum();
                assert_eq!(c.bytes_read.load(Ordering::Relaxed), 3 * bytes as u64);
            }
        }
    }

    #[test]
    fn a_large_staging_buffer_takes_huge_pages_and_brings_the_same_bytes() {
        let dir = tempfile::tempdir().unwrap();
        // 16000 rows of 68 bytes (1.04 MiB) in two pieces: staging of at least half a huge page.
        let (path, head, raw) = blocks_file(dir.path(), 2 * 16200);
        let row = 68usize;
        let us = vec![StreamUnit {
            kind: Kind::Q8_0,
            rows: 16000,
            cols: 64,
            pieces: vec![
                (head + 50 * row as u64, 7000 * row),
                (head + 7100 * row as u64, 9000 * row),
            ],
        }];
        assert!(2 * staging_bytes(&us) >= HUGE_PAGE);
        let mut sizes = Vec::new();
        for huge in [true, false] {
            let s = WeightStream::start(&path, us.clone(), WeightSource::Direct, 1, huge).unwrap();
            for _ in 0..2 {
                let mut p = s.begin(vec![0]).unwrap();
                same(&p.fetch(0).unwrap(), &expected(&raw, head, &us[0]));
            }
            sizes.push(s.buffer_bytes());
        }
        // The huge staging is counted as the whole huge page it takes.
        let small = staging_bytes(&us).next_multiple_of(DIRECT_ALIGN);
        assert_eq!(sizes[0] - sizes[1], HUGE_PAGE - small);
    }

    #[test]
    fn a_pass_cut_short_leaves_the_next_one_clean() {
        let dir = tempfile::tempdir().unwrap();
        let (path, head, raw) = blocks_file(dir.path(), 400);
        let us = units(head);
        let s = WeightStream::start(&path, us.clone(), WeightSource::Direct, 2, true).unwrap();
        {
            let mut p = s.begin(vec![0, 1, 2]).unwrap();
            let _ = p.fetch(0).unwrap();
        }
        let mut p = s.begin(vec![2, 0]).unwrap();
        same(&p.fetch(2).unwrap(), &expected(&raw, head, &us[2]));
        // Out of order is an error, not a wrong matrix.
        assert!(matches!(
            p.fetch(1),
            Err(StreamError::Order {
                expected: 0,
                got: 1
            })
        ));
    }

    #[test]
    fn single_rows_come_from_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let (path, head, raw) = blocks_file(dir.path(), 400);
        for source in [WeightSource::Direct, WeightSource::Mmap] {
            let s = WeightStream::start(&path, units(head), source, 1, true).unwrap();
            let mut out = Vec::new();
            s.read_raw(head + 5 * 68, 68, &mut out).unwrap();
            assert_eq!(out, raw[5 * 68..6 * 68]);
        }
    }

    #[test]
    fn a_missing_file_is_an_error() {
        let r = WeightStream::start(
            Path::new("/nonexistent/x.gguf"),
            vec![],
            WeightSource::Direct,
            1,
            true,
        );
        assert!(matches!(r, Err(StreamError::Io { .. })));
    }
}
