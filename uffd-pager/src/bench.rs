//! `llms bench pager`: populate by COPY and MOVE, fault-to-resolved latency, reclaim cost, against memcpy and the raw ioctls.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use crate::sys::{EventFd, Fault, Mapping, PAGE_SIZE, SysError, Uffd, poll2};
use crate::{
    ChunkKey, ChunkSource, ContextId, ContextSpec, Pager, PagerConfig, PagerError, PopulateVia,
    SourceError, Staging, median,
};

/// What to measure.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Chunk sizes in bytes (each page-rounded).
    pub sizes: Vec<usize>,
    /// Operations per run.
    pub iterations: usize,
    /// Runs; each figure is the median over runs of each run's median.
    pub runs: usize,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            sizes: vec![16 << 10, 64 << 10, 192 << 10],
            iterations: 200,
            runs: 5,
        }
    }
}

/// The figures for one chunk size; times are medians in nanoseconds per chunk.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SizeReport {
    /// Chunk size in bytes.
    pub bytes: usize,
    /// memcpy into memory that is already populated.
    pub memcpy_ns: u64,
    /// A bare UFFDIO_COPY of the chunk into a registered, empty range.
    pub raw_copy_ns: u64,
    /// A bare UFFDIO_MOVE of the chunk from a written staging buffer.
    pub raw_move_ns: u64,
    /// `Pager::populate` (UFFDIO_COPY, with budget and bookkeeping).
    pub populate_copy_ns: u64,
    /// `Pager::populate_move` (UFFDIO_MOVE, with budget and bookkeeping), staging already written
    /// (prefaulted, then written).
    pub populate_move_ns: u64,
    /// Writing the chunk into a staging buffer whose pages a move took away (the refault cost
    /// the MOVE path pays before each populate).
    pub staging_refill_ns: u64,
    /// MADV_POPULATE_WRITE of an emptied staging buffer (can run off the critical path).
    pub staging_prefault_ns: u64,
    /// Writing the chunk into a prefaulted staging buffer.
    pub staging_write_warm_ns: u64,
    /// A bare MADV_DONTNEED of the chunk.
    pub raw_dontneed_ns: u64,
    /// `Pager::reclaim`.
    pub reclaim_ns: u64,
    /// First touch of a reclaimed chunk until the load returns, the whole chunk populated by the
    /// fault thread (COPY mode, the default) from a source that memcpys from RAM; back to back.
    pub fault_ns: u64,
    /// The same after 1 ms of quiet: an isolated fault, the common case of a safety net.
    pub fault_isolated_ns: u64,
    /// Back-to-back faults with the fault thread in MOVE mode (`PagerConfig::fault_via`).
    pub fault_move_ns: u64,
    /// Isolated faults in MOVE mode (the move buffer had time to warm up again).
    pub fault_move_isolated_ns: u64,
    /// The source's memcpy alone, the fault path's unavoidable copy besides the ioctl.
    pub source_fill_ns: u64,
    /// First touch until resolved with a minimal handler thread (poll, read, one UFFDIO_COPY of
    /// the chunk, no bookkeeping, no source): the kernel's and the scheduler's share of a fault.
    pub raw_fault_ns: u64,
}

impl SizeReport {
    fn gibs(&self, ns: u64) -> f64 {
        if ns == 0 {
            return 0.0;
        }
        self.bytes as f64 / ns as f64 * 1e9 / (1u64 << 30) as f64
    }
}

/// The whole report.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchReport {
    /// Operations per run.
    pub iterations: usize,
    /// Runs.
    pub runs: usize,
    /// Whether UFFDIO_MOVE was available.
    pub move_supported: bool,
    /// One entry per chunk size.
    pub sizes: Vec<SizeReport>,
}

impl BenchReport {
    /// The report as a plain-text table.
    pub fn table(&self) -> String {
        let mut s = String::new();
        s.push_str(&format!(
            "pager benchmark: median of {} runs x {} ops (ns per chunk, GiB/s in brackets; \
             fault ratios: back to back, isolated)\n",
            self.runs, self.iterations
        ));
        s.push_str(&format!(
            "{:<26}{}\n",
            "",
            self.sizes
                .iter()
                .map(|r| format!("{:>22}", format!("{} KiB", r.bytes >> 10)))
                .collect::<String>()
        ));
        type Pick = fn(&SizeReport) -> u64;
        let rows: [(&str, Pick); 16] = [
            ("memcpy (populated dst)", |r| r.memcpy_ns),
            ("raw UFFDIO_COPY", |r| r.raw_copy_ns),
            ("raw UFFDIO_MOVE", |r| r.raw_move_ns),
            ("populate COPY", |r| r.populate_copy_ns),
            ("populate MOVE", |r| r.populate_move_ns),
            ("  staging write (cold)", |r| r.staging_refill_ns),
            ("  staging prefault", |r| r.staging_prefault_ns),
            ("  staging write (warm)", |r| r.staging_write_warm_ns),
            ("raw MADV_DONTNEED", |r| r.raw_dontneed_ns),
            ("reclaim", |r| r.reclaim_ns),
            ("source fill (memcpy)", |r| r.source_fill_ns),
            ("raw fault (bare handler)", |r| r.raw_fault_ns),
            ("fault COPY, back to back", |r| r.fault_ns),
            ("fault COPY, isolated", |r| r.fault_isolated_ns),
            ("fault MOVE, back to back", |r| r.fault_move_ns),
            ("fault MOVE, isolated", |r| r.fault_move_isolated_ns),
        ];
        for (name, pick) in rows {
            s.push_str(&format!("{name:<26}"));
            for r in &self.sizes {
                let ns = pick(r);
                s.push_str(&format!("{:>22}", format!("{ns} ({:.2})", r.gibs(ns))));
            }
            s.push('\n');
        }
        s.push_str(&format!("{:<26}", "fault / raw COPY"));
        for r in &self.sizes {
            s.push_str(&format!(
                "{:>22}",
                format!(
                    "{:.2}x, {:.2}x",
                    r.fault_ns as f64 / r.raw_copy_ns.max(1) as f64,
                    r.fault_isolated_ns as f64 / r.raw_copy_ns.max(1) as f64
                )
            ));
        }
        s.push('\n');
        s.push_str(&format!("{:<26}", "fault / raw fault"));
        for r in &self.sizes {
            s.push_str(&format!(
                "{:>22}",
                format!(
                    "{:.2}x, {:.2}x",
                    r.fault_ns as f64 / r.raw_fault_ns.max(1) as f64,
                    r.fault_isolated_ns as f64 / r.raw_fault_ns.max(1) as f64
                )
            ));
        }
        s.push('\n');
        s.push_str(&format!("{:<26}", "fault / (COPY + fill)"));
        for r in &self.sizes {
            s.push_str(&format!(
                "{:>22}",
                format!(
                    "{:.2}x, {:.2}x",
                    r.fault_ns as f64 / (r.raw_copy_ns + r.source_fill_ns).max(1) as f64,
                    r.fault_isolated_ns as f64 / (r.raw_copy_ns + r.source_fill_ns).max(1) as f64
                )
            ));
        }
        s.push('\n');
        s
    }
}

/// A source that copies a chunk from RAM: the fault path's cost without storage.
struct RamSource {
    bytes: Vec<u8>,
}

impl ChunkSource for RamSource {
    fn fill(&self, _key: ChunkKey, dst: &mut [u8]) -> Result<(), SourceError> {
        dst.copy_from_slice(&self.bytes[..dst.len()]);
        Ok(())
    }
}

fn ns(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// Run the benchmark.
pub fn run(opts: &BenchOptions) -> Result<BenchReport, PagerError> {
    let max = opts
        .sizes
        .iter()
        .map(|s| crate::sys::page_round(*s))
        .max()
        .unwrap_or(PAGE_SIZE);
    let data: Vec<u8> = (0..max).map(|i| (i * 31 % 251) as u8).collect();
    let source = Arc::new(RamSource {
        bytes: data.clone(),
    });
    let config = |fault_via| PagerConfig {
        fault_via,
        ..PagerConfig::new(1 << 30, max)
    };
    let pager = Pager::new(config(PopulateVia::Copy), source.clone())?;
    let move_pager = Pager::new(config(PopulateVia::Move), source)?;
    let move_supported = pager.move_supported();
    let mut sizes = Vec::new();
    let mut next_ctx = 1;
    for &size in &opts.sizes {
        let size = crate::sys::page_round(size);
        let mut runs: Vec<[u64; 16]> = Vec::new();
        for _ in 0..opts.runs.max(1) {
            let ctx = ContextId(next_ctx);
            next_ctx += 1;
            let spec = ContextSpec {
                max_chunks: 1,
                max_slot_bytes: size,
            };
            pager.add_context(ctx, spec)?;
            move_pager.add_context(ctx, spec)?;
            runs.push(one_run(
                (&pager, &move_pager),
                ctx,
                size,
                &data[..size],
                opts.iterations,
            )?);
            pager.remove_context(ctx)?;
            move_pager.remove_context(ctx)?;
        }
        let pick = |i: usize| median(runs.iter().map(|r| r[i]));
        sizes.push(SizeReport {
            bytes: size,
            memcpy_ns: pick(0),
            raw_copy_ns: pick(1),
            raw_move_ns: pick(2),
            populate_copy_ns: pick(3),
            populate_move_ns: pick(4),
            staging_refill_ns: pick(5),
            raw_dontneed_ns: pick(6),
            reclaim_ns: pick(7),
            fault_ns: pick(8),
            source_fill_ns: pick(9),
            raw_fault_ns: pick(10),
            staging_prefault_ns: pick(11),
            staging_write_warm_ns: pick(12),
            fault_isolated_ns: pick(13),
            fault_move_ns: pick(14),
            fault_move_isolated_ns: pick(15),
        });
    }
    Ok(BenchReport {
        iterations: opts.iterations,
        runs: opts.runs,
        move_supported,
        sizes,
    })
}

fn setup(e: crate::sys::SysError) -> PagerError {
    PagerError::Setup { source: e }
}

/// One run at one size: the per-op median of each measurement.
fn one_run(
    (pager, move_pager): (&Pager, &Pager),
    ctx: ContextId,
    size: usize,
    data: &[u8],
    iters: usize,
) -> Result<[u64; 16], PagerError> {
    let key = ChunkKey { ctx, index: 0 };
    let mut out = [0u64; 16];

    // memcpy into populated memory.
    let mut dst = vec![1u8; size];
    let mut v = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        dst.copy_from_slice(black_box(data));
        black_box(&mut dst);
        v.push(ns(t));
    }
    out[0] = median(v);

    // The bare ioctls on a range of our own.
    let mut staging = Staging::new(size)?;
    [out[1], out[2], out[6]] = raw_ioctls(size, data, iters, &mut staging)?;

    // The pager's populate (COPY, MOVE) and reclaim.
    let (mut pc, mut pm, mut refill, mut rc) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut prefault, mut warm) = (Vec::new(), Vec::new());
    for _ in 0..iters {
        let t = Instant::now();
        pager.populate(key, size, data)?;
        pc.push(ns(t));
        let t = Instant::now();
        pager.reclaim(key)?;
        rc.push(ns(t));
        // The staging buffer is empty (a move took its pages): writing it faults page by page.
        let t = Instant::now();
        staging.as_mut_slice()[..size].copy_from_slice(data);
        refill.push(ns(t));
        pager.populate_move(key, size, &mut staging)?;
        pager.reclaim(key)?;
        // The same, with the pages faulted in ahead (as a background thread would).
        let t = Instant::now();
        staging.prefault()?;
        prefault.push(ns(t));
        let t = Instant::now();
        staging.as_mut_slice()[..size].copy_from_slice(data);
        warm.push(ns(t));
        let t = Instant::now();
        pager.populate_move(key, size, &mut staging)?;
        pm.push(ns(t));
        pager.reclaim(key)?;
    }
    out[3] = median(pc);
    out[4] = median(pm);
    out[5] = median(refill);
    out[7] = median(rc);
    out[11] = median(prefault);
    out[12] = median(warm);

    // Fault to resolved: touch one byte of a reclaimed chunk.
    out[8] = fault_time(pager, key, size, data, iters, false)?;
    out[13] = fault_time(pager, key, size, data, iters, true)?;
    out[14] = fault_time(move_pager, key, size, data, iters, false)?;
    out[15] = fault_time(move_pager, key, size, data, iters, true)?;
    let mut scratch = vec![0u8; size];
    let mut fill = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        scratch.copy_from_slice(black_box(data));
        black_box(&mut scratch);
        fill.push(ns(t));
    }
    out[9] = median(fill);
    out[10] = raw_fault(size, data, iters)?;
    Ok(out)
}

/// The medians of the bare ioctls on a registered range of our own: UFFDIO_COPY, UFFDIO_MOVE
/// (0 where the kernel lacks it, moving from `staging`) and MADV_DONTNEED.
fn raw_ioctls(
    size: usize,
    data: &[u8],
    iters: usize,
    staging: &mut Staging,
) -> Result<[u64; 3], PagerError> {
    let uffd = Uffd::open().map_err(setup)?;
    let region = Mapping::reserve(size).map_err(setup)?;
    uffd.register(region.addr(), region.len()).map_err(setup)?;
    let (mut copy, mut mv, mut dn) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..iters {
        let t = Instant::now();
        uffd.copy(region.addr(), data, true).map_err(setup)?;
        copy.push(ns(t));
        let t = Instant::now();
        region.dontneed(0, size).map_err(setup)?;
        dn.push(ns(t));
        if uffd.move_supported() {
            staging.as_mut_slice()[..size].copy_from_slice(data);
            let t = Instant::now();
            // SAFETY: the staging buffer is private anonymous, ours, fully written, and its
            // contents are given up.
            unsafe {
                uffd.move_pages(
                    region.addr(),
                    staging.as_slice().as_ptr() as usize,
                    size,
                    true,
                )
            }
            .map_err(setup)?;
            mv.push(ns(t));
            region.dontneed(0, size).map_err(setup)?;
        }
    }
    Ok([median(copy), median(mv), median(dn)])
}

/// The median time from the first touch of a reclaimed chunk to the touch returning; `idle`
/// leaves 1 ms of quiet before each touch.
fn fault_time(
    pager: &Pager,
    key: ChunkKey,
    size: usize,
    data: &[u8],
    iters: usize,
    idle: bool,
) -> Result<u64, PagerError> {
    let (p, _) = pager.slot_ptr(key)?;
    let mut v = Vec::with_capacity(iters);
    for i in 0..iters {
        pager.populate(key, size, data)?;
        pager.mark_persisted(key)?;
        pager.reclaim(key)?;
        if idle {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let off = (i * PAGE_SIZE) % size;
        let t = Instant::now();
        // SAFETY: the slot lies inside the context's live mapping; the read faults and the fault
        // thread populates the chunk before it returns.
        let b = unsafe { std::ptr::read_volatile(p.as_ptr().add(off)) };
        v.push(ns(t));
        black_box(b);
        pager.check(key)?;
        pager.reclaim(key)?;
    }
    Ok(median(v))
}

/// The median first-touch-to-resolved time with a bare handler thread.
fn raw_fault(size: usize, data: &[u8], iters: usize) -> Result<u64, PagerError> {
    let uffd = Arc::new(Uffd::open().map_err(setup)?);
    let region = Arc::new(Mapping::reserve(size).map_err(setup)?);
    uffd.register(region.addr(), region.len()).map_err(setup)?;
    let stop = Arc::new(EventFd::new().map_err(setup)?);
    let handler = {
        let (uffd, region, stop) = (Arc::clone(&uffd), Arc::clone(&region), Arc::clone(&stop));
        let data = data.to_vec();
        std::thread::spawn(move || -> Result<(), SysError> {
            let mut faults = [Fault {
                addr: 0,
                write: false,
            }; 16];
            loop {
                let (_, stopped) = poll2(uffd.raw_fd(), stop.raw_fd(), -1)?;
                if stopped {
                    return Ok(());
                }
                for _ in 0..uffd.read_faults(&mut faults)? {
                    match uffd.copy(region.addr(), &data, true) {
                        Ok(()) => {}
                        Err(SysError::Partial { source, .. })
                            if source.raw_os_error() == Some(libc::EEXIST) =>
                        {
                            uffd.wake(region.addr(), region.len())?;
                        }
                        Err(e) => return Err(e),
                    }
                }
            }
        })
    };
    let mut v = Vec::with_capacity(iters);
    let mut result = Ok(());
    for i in 0..iters {
        let off = (i * PAGE_SIZE) % size;
        let t = Instant::now();
        // SAFETY: the offset lies inside the live, registered mapping; the read faults and the
        // handler thread populates the range before it returns.
        let b = unsafe { std::ptr::read_volatile(region.ptr().as_ptr().add(off)) };
        v.push(ns(t));
        black_box(b);
        if let Err(e) = region.dontneed(0, size) {
            result = Err(setup(e));
            break;
        }
    }
    stop.signal();
    let joined = handler.join().unwrap_or(Err(SysError::Unsupported {
        what: "a bench handler that does not panic",
    }));
    result?;
    joined.map_err(setup)?;
    Ok(median(v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tiny_run_measures_every_row() {
        let r = run(&BenchOptions {
            sizes: vec![16 << 10, 5000],
            iterations: 3,
            runs: 1,
        })
        .expect("bench runs");
        assert_eq!(r.sizes.len(), 2);
        assert_eq!(r.sizes[1].bytes, 8192, "sizes are page-rounded");
        for s in &r.sizes {
            assert!(s.memcpy_ns > 0 && s.raw_copy_ns > 0 && s.populate_copy_ns > 0);
            assert!(s.reclaim_ns > 0 && s.fault_ns > 0 && s.populate_move_ns > 0);
            assert!(s.raw_fault_ns > 0 && s.fault_move_ns > 0 && s.fault_move_isolated_ns > 0);
        }
        let table = r.table();
        assert!(
            table.contains("fault MOVE, isolated") && table.contains("16 KiB"),
            "{table}"
        );
        let json = serde_json::to_string(&r).expect("serialise");
        assert!(json.contains("\"populate_move_ns\""));
    }
}
