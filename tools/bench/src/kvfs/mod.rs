//! `llms bench kvfs`: read and write latency and throughput through the mount and directly, page-cache
//! residency after I/O, and zstd ratio and speed on KV-shaped chunks (synthetic, or real files).
//!
//! The figures are measured here and returned as rows; the `tools` binary prints them.

use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvfs::client::MountReader;
use kvfs::format::{ChunkHeader, Codec, Fingerprint, HEADER_LEN, KvFormat};
use kvfs::fs::{Mount, MountConfig, MountError, mount};
use kvfs::io::{AlignedBuf, IoError, read_slot};
use kvfs::store::{
    ContextId, HEADER_PAGE, NewContext, Store, StoreError, StoreOptions, slot_offset,
};
use strum::VariantArray;

pub mod synth;

/// What went wrong running the benchmark.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Mount(#[from] MountError),
    #[error(transparent)]
    Io(#[from] IoError),
    #[error("{path} must be a new or empty directory on the filesystem to measure")]
    DirNotEmpty { path: PathBuf },
    #[error("no chunk files in {path}")]
    NoChunks { path: PathBuf },
}

/// What to measure.
#[derive(Clone, Debug)]
pub struct BenchConfig {
    /// Scratch directory (new or empty) on the filesystem to measure; removed afterwards.
    pub dir: PathBuf,
    /// Chunk sizes for the read and write measurements, in KiB.
    pub sizes_kib: Vec<usize>,
    /// Bytes written and read per chunk size (chunk count is this over the size, 32 to 512).
    pub bytes_per_size: usize,
    /// Real chunk files for the zstd measurement (kvfs chunk files or plain chunk bytes).
    pub chunks_dir: Option<PathBuf>,
    /// zstd levels to measure.
    pub zstd_levels: Vec<i32>,
    /// Chunk sets for the load measurement (real chunk sizes; empty skips it).
    pub load_sets: Vec<LoadSet>,
    /// Chunks per load set.
    pub load_chunks: usize,
    /// Parallel reader counts for the load measurement.
    pub readers: Vec<usize>,
    /// Passes of each load measurement (the rows pool their latencies and take the median
    /// pass's throughput).
    pub rounds: usize,
    /// Chunks written per path and load set for the write-out measurement.
    pub write_chunks: usize,
}

impl Default for BenchConfig {
    fn default() -> Self {
        BenchConfig {
            dir: PathBuf::from("kvfs-bench"),
            sizes_kib: vec![16, 64, 192, 1024],
            bytes_per_size: 64 << 20,
            chunks_dir: None,
            zstd_levels: vec![1, 3],
            load_sets: LoadSet::defaults(),
            load_chunks: 256,
            readers: vec![1, 2, 3, 4],
            rounds: 3,
            write_chunks: 48,
        }
    }
}

/// Latency and throughput of one way of moving chunks of one size.
#[derive(Clone, Debug)]
pub struct IoRow {
    pub size_kib: usize,
    pub path: &'static str,
    pub chunks: usize,
    pub p50_us: f64,
    pub p99_us: f64,
    pub mb_per_s: f64,
}

/// How many bytes of the store's files the page cache held after a phase.
#[derive(Clone, Debug)]
pub struct CacheRow {
    pub after: String,
    pub resident_bytes: u64,
    pub file_bytes: u64,
}

/// zstd on one group of chunks at one level.
#[derive(Clone, Debug)]
pub struct ZstdRow {
    pub source: String,
    pub format: String,
    pub chunks: usize,
    pub chunk_bytes: usize,
    pub level: i32,
    pub ratio: f64,
    pub compress_mb_per_s: f64,
    pub decompress_mb_per_s: f64,
}

/// Everything `llms bench kvfs` measured.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub direct_io: bool,
    pub reads: Vec<IoRow>,
    pub writes: Vec<IoRow>,
    pub cache: Vec<CacheRow>,
    pub zstd: Vec<ZstdRow>,
    /// Chunk loads at real sizes, by path and number of parallel readers.
    pub loads: Vec<LoadRow>,
    /// Chunk write-out at real sizes, by path.
    pub load_writes: Vec<LoadRow>,
    /// What zstd made of each load set's chunks (the `mount kv zstd` rows read them).
    pub load_zstd: Vec<LoadZstd>,
    /// `READ` requests the passthrough daemon saw, and its passthrough opens: the reads of the
    /// `passthrough` rows never reach a daemon when the first is 0.
    pub passthrough_daemon_reads: u64,
    pub passthrough_opens: u64,
}

/// A load set stored with zstd: chunk bytes and what the store holds for them.
#[derive(Clone, Debug)]
pub struct LoadZstd {
    pub set: String,
    pub chunks: usize,
    /// Chunks the store kept compressed (zstd shrank them at all).
    pub zstd_chunks: usize,
    pub raw_bytes: u64,
    pub stored_bytes: u64,
}

const FP: Fingerprint = Fingerprint(*b"kvfs-bench-fingerprint-000000000");

/// Runs every measurement.
pub fn run(config: &BenchConfig) -> Result<Report, BenchError> {
    if let Ok(mut d) = std::fs::read_dir(&config.dir)
        && d.next().is_some()
    {
        return Err(BenchError::DirNotEmpty {
            path: config.dir.clone(),
        });
    }
    let mut report = Report {
        zstd: zstd_report(config)?,
        ..Report::default()
    };
    let result = io_report(config, &mut report).and_then(|()| {
        if config.load_sets.is_empty() {
            Ok(())
        } else {
            load_report(config, &mut report)
        }
    });
    let _ = std::fs::remove_dir_all(&config.dir);
    result?;
    Ok(report)
}

fn io_report(config: &BenchConfig, report: &mut Report) -> Result<(), BenchError> {
    let store_dir = config.dir.join("store");
    let mnt = config.dir.join("mnt");
    // Raw chunks (compression off) so the read figures are about I/O, not zstd.
    let options = StoreOptions {
        min_ratio: f64::INFINITY,
        ..StoreOptions::default()
    };
    let store = Arc::new(Store::open(&store_dir, options)?);
    report.direct_io = store.direct_io();
    std::fs::create_dir_all(&mnt).map_err(|e| IoError::new("mkdir", &mnt, e))?;
    let m = mount(store.clone(), &mnt, &MountConfig::default())?;
    // The same store mounted again with directory attributes cached.
    let mnt2 = config.dir.join("mnt-cached");
    std::fs::create_dir_all(&mnt2).map_err(|e| IoError::new("mkdir", &mnt2, e))?;
    let cached = MountConfig {
        cache_dir_attrs: true,
        ..MountConfig::default()
    };
    let m2 = mount(store.clone(), &mnt2, &cached)?;
    for &kib in &config.sizes_kib {
        let size = kib << 10;
        let n = (config.bytes_per_size / size).clamp(32, 512);
        let id = store.create_context(NewContext {
            owner_uid: 0,
            app: "bench".into(),
            fingerprint: FP,
            chunk_tokens: 16,
        })?;
        store.append_tokens(id, &vec![1; 16 * n])?;
        let data = synth::noise(size, kib as u64);
        let mut lat = Vec::with_capacity(n);
        for i in 0..n as u32 {
            let t = Instant::now();
            store.write_chunk(id, i, &FP, KvFormat::Int8, 0.0, &data)?;
            lat.push(t.elapsed());
        }
        report.writes.push(row(kib, "store api, fsync", &lat));
        let mut lat = Vec::with_capacity(n);
        for i in 0..n as u32 {
            let p = mnt.join(id.to_string()).join("chunks").join(i.to_string());
            let t = Instant::now();
            std::fs::write(&p, &data).map_err(|e| IoError::new("write", &p, e))?;
            lat.push(t.elapsed());
        }
        report.writes.push(row(kib, "mount, fsync", &lat));
        // Three rounds of every path, one after the other, so load from elsewhere on the machine
        // spreads over all of them; each row pools the rounds' latencies.
        let mut lat: [Vec<Duration>; 4] = Default::default();
        let data_path = store.data_path(id);
        let data_file = open_data_file(&store, &data_path)?;
        let mut scratch = AlignedBuf::default();
        for _round in 0..3 {
            drop_caches();
            lat[0].extend(read_pass(n, |i| {
                let at = store.locate(id, i, &FP)?;
                let len = HEADER_PAGE + at.stored_len as usize;
                let r = read_slot(
                    &data_file,
                    store.direct_io(),
                    slot_offset(i, at.copy),
                    len,
                    &mut scratch,
                )
                .map_err(|e| IoError::new("read", &data_path, e))?;
                Ok(r.len())
            })?);
            drop_caches();
            lat[1].extend(read_pass(n, |i| Ok(store.read_chunk(id, i, &FP)?.len()))?);
            for (k, root) in [(2, &mnt), (3, &mnt2)] {
                drop_caches();
                lat[k].extend(read_pass(n, |i| {
                    let p = root.join(id.to_string()).join("chunks").join(i.to_string());
                    let mut f = std::fs::File::open(&p).map_err(|e| IoError::new("open", &p, e))?;
                    // The reader knows the chunk's size (from its metadata), as the service does.
                    let mut buf = vec![0u8; size];
                    f.read_exact(&mut buf)
                        .map_err(|e| IoError::new("read", &p, e))?;
                    Ok(buf.len())
                })?);
            }
        }
        let paths = [
            "raw file O_DIRECT",
            "store api",
            "mount, direct_io",
            "mount, dirs cached",
        ];
        for (path, lat) in paths.into_iter().zip(&lat) {
            report.reads.push(row(kib, path, lat));
        }
        report.cache.push(cache_row(&store, id, n, kib)?);
        store.delete_context(id)?;
    }
    m2.unmount()?;
    m.unmount()?;
    Ok(())
}

fn read_pass(
    n: usize,
    mut read: impl FnMut(u32) -> Result<usize, BenchError>,
) -> Result<Vec<Duration>, BenchError> {
    let mut lat = Vec::with_capacity(n);
    for i in 0..n as u32 {
        let t = Instant::now();
        read(i)?;
        lat.push(t.elapsed());
    }
    Ok(lat)
}

fn row(kib: usize, path: &'static str, lat: &[Duration]) -> IoRow {
    let mut us: Vec<f64> = lat.iter().map(|d| d.as_secs_f64() * 1e6).collect();
    us.sort_by(f64::total_cmp);
    let total: f64 = us.iter().sum::<f64>() / 1e6;
    let pct = |p: f64| us[((us.len() - 1) as f64 * p).round() as usize];
    IoRow {
        size_kib: kib,
        path,
        chunks: us.len(),
        p50_us: pct(0.5),
        p99_us: pct(0.99),
        mb_per_s: (kib << 10) as f64 * us.len() as f64 / total / 1e6,
    }
}

/// A set of chunks to load: a name and each chunk's length and KV format (chunk `i` has
/// `lens[i % lens.len()]` bytes of KV-shaped data in `formats[i % lens.len()]`, for zstd).
#[derive(Clone, Debug)]
pub struct LoadSet {
    pub name: String,
    pub lens: Vec<usize>,
    pub formats: Vec<KvFormat>,
}

impl LoadSet {
    /// SmolLM2-135M's chunk sizes (16 tokens, page-rounded) and the 25:50:25 mix of them.
    pub fn defaults() -> Vec<LoadSet> {
        use KvFormat::{Int2, Int4, Int8};
        let set = |name: &str, chunks: &[(usize, KvFormat)]| LoadSet {
            name: name.to_owned(),
            lens: chunks.iter().map(|c| c.0).collect(),
            formats: chunks.iter().map(|c| c.1).collect(),
        };
        vec![
            set("int8 212 KiB", &[(212 << 10, Int8)]),
            set("int4 120 KiB", &[(120 << 10, Int4)]),
            set("int2 76 KiB", &[(76 << 10, Int2)]),
            set(
                "mix 25:50:25",
                &[
                    (212 << 10, Int8),
                    (120 << 10, Int4),
                    (120 << 10, Int4),
                    (76 << 10, Int2),
                ],
            ),
        ]
    }

    fn len(&self, i: u32) -> usize {
        self.lens[i as usize % self.lens.len()]
    }

    /// KV-shaped bytes for each position of the pattern (chunk `i` is `data[i % len]`).
    fn data(&self) -> Vec<Vec<u8>> {
        self.lens
            .iter()
            .enumerate()
            .map(|(k, &len)| {
                let f = self.formats.get(k).copied().unwrap_or(KvFormat::Int8);
                synth::kv_bytes(f, len, 100 * k as u64)
            })
            .collect()
    }
}

/// Chunk loads (or writes) of one set by one path with some parallel readers.
#[derive(Clone, Debug)]
pub struct LoadRow {
    pub set: String,
    pub path: &'static str,
    pub readers: usize,
    pub chunks: usize,
    pub p50_us: f64,
    pub p99_us: f64,
    /// Aggregate: bytes moved over the wall time of the pass.
    pub mb_per_s: f64,
}

/// The ways of loading a chunk that `llms bench kvfs` compares: a bare O_DIRECT read of the
/// chunk's slot in the data file, into huge pages (as every caller's buffer below) and, last, into
/// small pages; the store API; the mount's `kv` file (`MountReader`), passed
/// through to the data file by the kernel, over raw and over zstd payloads; the same file served by
/// the daemon (a mount without passthrough); the per-chunk view.
pub const LOAD_PATHS: [&str; 7] = [
    "disk O_DIRECT",
    "store read_chunk_into",
    "mount kv passthrough",
    "mount kv zstd",
    "mount kv daemon",
    "mount chunks/ open+read",
    "disk O_DIRECT 4K pages",
];

/// Page alignment of O_DIRECT reads.
const ALIGN: usize = 4096;

/// The ways of writing a chunk that `llms bench kvfs` compares.
pub const WRITE_PATHS: [&str; 3] = [
    "store write_chunk",
    "mount kv pwrite",
    "mount chunks/ write",
];

/// Runs `per_chunk` over chunks `0..n` split across `threads` threads (thread `t` takes chunks
/// `t, t + threads, ...`), each with its own state from `make`; returns every chunk's latency,
/// the bytes moved and the wall time.
fn parallel_pass<S>(
    n: u32,
    threads: usize,
    make: impl Fn() -> S + Sync,
    per_chunk: impl Fn(&mut S, u32) -> Result<usize, BenchError> + Sync,
) -> Result<Pass, BenchError> {
    let start = Instant::now();
    let results: Vec<Result<(Vec<Duration>, usize), BenchError>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (make, per_chunk) = (&make, &per_chunk);
                s.spawn(move || {
                    let mut state = make();
                    let mut lat = Vec::new();
                    let mut bytes = 0;
                    for i in (t as u32..n).step_by(threads) {
                        let t0 = Instant::now();
                        bytes += per_chunk(&mut state, i)?;
                        lat.push(t0.elapsed());
                    }
                    Ok((lat, bytes))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Ok((Vec::new(), 0))))
            .collect()
    });
    let wall = start.elapsed();
    let mut lat = Vec::new();
    let mut bytes = 0;
    for r in results {
        let (l, b) = r?;
        lat.extend(l);
        bytes += b;
    }
    Ok((lat, bytes, wall))
}

fn load_row(set: &str, path: &'static str, readers: usize, runs: &[Pass]) -> LoadRow {
    let mut us: Vec<f64> = runs
        .iter()
        .flat_map(|r| r.0.iter().map(|d| d.as_secs_f64() * 1e6))
        .collect();
    us.sort_by(f64::total_cmp);
    let pct = |p: f64| {
        us.get(((us.len().max(1) - 1) as f64 * p).round() as usize)
            .copied()
            .unwrap_or(0.0)
    };
    // The median run's throughput, so one disturbed run does not decide the figure.
    let mut mbs: Vec<f64> = runs
        .iter()
        .map(|(_, b, w)| *b as f64 / w.as_secs_f64().max(1e-9) / 1e6)
        .collect();
    mbs.sort_by(f64::total_cmp);
    LoadRow {
        set: set.to_owned(),
        path,
        readers,
        chunks: us.len(),
        p50_us: pct(0.5),
        p99_us: pct(0.99),
        mb_per_s: mbs.get(mbs.len() / 2).copied().unwrap_or(0.0),
    }
}

/// Chunk loads and writes at real chunk sizes through every path, with 1 to 4 readers.
fn load_report(config: &BenchConfig, report: &mut Report) -> Result<(), BenchError> {
    let mounts = LoadMounts::open(config)?;
    for set in &config.load_sets {
        load_set(config, &mounts, set, report)?;
    }
    mounts.unmount()
}

/// One pass of [`parallel_pass`]: every chunk's latency, the bytes moved and the wall time.
type Pass = (Vec<Duration>, usize, Duration);

/// The stores and mounts the load measurement goes through: a store of raw payloads mounted
/// with passthrough, and again served by the daemon alone (for the cost of a FUSE round trip
/// per chunk), and a store of zstd payloads (whenever zstd shrinks a chunk at all) mounted with
/// passthrough. Fields in the order they are dropped, the daemon's mount first.
struct LoadMounts {
    daemon: Mount,
    zstd: Mount,
    zstore: Arc<Store>,
    raw: Mount,
    store: Arc<Store>,
}

impl LoadMounts {
    /// Opens and mounts the stores under the scratch directory, each mount with a FUSE thread
    /// per reader at least.
    fn open(config: &BenchConfig) -> Result<LoadMounts, BenchError> {
        let max_readers = config.readers.iter().copied().max().unwrap_or(1).max(1);
        let mcfg = MountConfig {
            threads: max_readers.max(MountConfig::default().threads),
            ..MountConfig::default()
        };
        let (store, raw) = open_mounted(config, "load", f64::INFINITY, &mcfg)?;
        let (zstore, zstd) = open_mounted(config, "load-zstd", 1.0, &mcfg)?;
        let dmnt = config.dir.join("load-daemon-mnt");
        std::fs::create_dir_all(&dmnt).map_err(|e| IoError::new("mkdir", &dmnt, e))?;
        let daemon = mount(
            store.clone(),
            &dmnt,
            &MountConfig {
                passthrough: false,
                ..mcfg.clone()
            },
        )?;
        Ok(LoadMounts {
            daemon,
            zstd,
            zstore,
            raw,
            store,
        })
    }

    /// Passthrough opens of the two passthrough mounts so far.
    fn passthrough_opens(&self) -> u64 {
        self.raw
            .counters()
            .passthrough_opens
            .load(Ordering::Relaxed)
            + self
                .zstd
                .counters()
                .passthrough_opens
                .load(Ordering::Relaxed)
    }

    /// `READ` requests the two passthrough mounts' daemon saw so far.
    fn daemon_reads(&self) -> u64 {
        self.raw.counters().kv_reads.load(Ordering::Relaxed)
            + self.zstd.counters().kv_reads.load(Ordering::Relaxed)
    }

    /// Unmounts the daemon's mount, then the zstd and the raw ones.
    fn unmount(self) -> Result<(), BenchError> {
        self.daemon.unmount()?;
        self.zstd.unmount()?;
        self.raw.unmount()?;
        Ok(())
    }
}

/// Opens the store `<dir>/<name>-store` (payloads kept compressed when zstd reaches
/// `min_ratio`) and mounts it at `<dir>/<name>-mnt`.
fn open_mounted(
    config: &BenchConfig,
    name: &str,
    min_ratio: f64,
    mcfg: &MountConfig,
) -> Result<(Arc<Store>, Mount), BenchError> {
    let store = Arc::new(Store::open(
        &config.dir.join(format!("{name}-store")),
        StoreOptions {
            min_ratio,
            ..StoreOptions::default()
        },
    )?);
    let mnt = config.dir.join(format!("{name}-mnt"));
    std::fs::create_dir_all(&mnt).map_err(|e| IoError::new("mkdir", &mnt, e))?;
    let m = mount(store.clone(), &mnt, mcfg)?;
    Ok((store, m))
}

/// One load set: its chunks written to both stores, loaded by every path with each number of
/// readers, written out by every path with one writer; then what the page cache holds of its
/// data files, and its contexts deleted.
fn load_set(
    config: &BenchConfig,
    mounts: &LoadMounts,
    set: &LoadSet,
    report: &mut Report,
) -> Result<(), BenchError> {
    let n = config.load_chunks.max(8) as u32;
    let datas = set.data();
    let (id, zid) = store_set(mounts, set, &datas, n, report)?;
    let opens = mounts.passthrough_opens();
    let readers = SetReaders::open(mounts, set, &datas, (id, zid), n)?;
    let daemon_reads = mounts.daemon_reads();
    for &r in &config.readers {
        let mut runs: [Vec<Pass>; 7] = Default::default();
        for _round in 0..config.rounds.max(1) {
            readers.read_round(r, &mut runs)?;
        }
        for (path, runs) in LOAD_PATHS.into_iter().zip(&runs) {
            report.loads.push(load_row(&set.name, path, r, runs));
        }
    }
    // The passthrough rows' reads never reached a daemon: only the per-chunk view's did.
    report.passthrough_opens += mounts.passthrough_opens() - opens;
    report.passthrough_daemon_reads += mounts.daemon_reads() - daemon_reads;
    // Write-out: one writer, each chunk durable before the next.
    let runs = readers.write_runs((config.write_chunks as u32).clamp(1, n))?;
    for (path, runs) in WRITE_PATHS.into_iter().zip(&runs) {
        report.load_writes.push(load_row(&set.name, path, 1, runs));
    }
    drop(readers);
    report.cache.push(cache_row_named(
        &mounts.store,
        id,
        n as usize,
        format!("{} written and loaded", set.name),
    )?);
    report.cache.push(cache_row_named(
        &mounts.zstore,
        zid,
        n as usize,
        format!("{} zstd, loaded", set.name),
    )?);
    mounts.store.delete_context(id)?;
    mounts.zstore.delete_context(zid)?;
    Ok(())
}

/// A context of `n` chunks in each store, its chunks `datas` written through the store API;
/// what zstd made of them goes in the report. Returns the raw and the zstd store's context.
fn store_set(
    mounts: &LoadMounts,
    set: &LoadSet,
    datas: &[Vec<u8>],
    n: u32,
    report: &mut Report,
) -> Result<(ContextId, ContextId), BenchError> {
    let new_context = |store: &Store| -> Result<ContextId, BenchError> {
        let id = store.create_context(NewContext {
            owner_uid: 0,
            app: "bench".into(),
            fingerprint: FP,
            chunk_tokens: 16,
        })?;
        store.append_tokens(id, &vec![1; 16 * n as usize])?;
        Ok(id)
    };
    let id = new_context(&mounts.store)?;
    let zid = new_context(&mounts.zstore)?;
    let mut z = LoadZstd {
        set: set.name.clone(),
        chunks: n as usize,
        zstd_chunks: 0,
        raw_bytes: 0,
        stored_bytes: 0,
    };
    for i in 0..n {
        let data = &datas[i as usize % datas.len()][..];
        mounts
            .store
            .write_chunk(id, i, &FP, KvFormat::Int8, 0.0, data)?;
        let s = mounts
            .zstore
            .write_chunk(zid, i, &FP, KvFormat::Int8, 0.0, data)?;
        z.zstd_chunks += usize::from(s.codec == Codec::Zstd);
        z.raw_bytes += u64::from(s.raw_len);
        z.stored_bytes += u64::from(s.stored_len);
    }
    report.load_zstd.push(z);
    Ok((id, zid))
}

/// One set's chunks in both stores and what reads and writes them: the mounts' `kv` files
/// (raw, zstd, and raw served by the daemon) and the raw store's data file.
struct SetReaders<'a> {
    mounts: &'a LoadMounts,
    set: &'a LoadSet,
    datas: &'a [Vec<u8>],
    id: ContextId,
    n: u32,
    /// Bytes of a read buffer: the longest chunk, page-aligned.
    slot: usize,
    max_len: usize,
    kv: MountReader,
    zkv: MountReader,
    dkv: MountReader,
    data_path: PathBuf,
    data_file: std::fs::File,
}

impl<'a> SetReaders<'a> {
    /// Opens the `kv` files of the raw context `ids.0` (read-write, through the passthrough
    /// mount, and read-only through the daemon's) and of the zstd context `ids.1`, and the raw
    /// context's data file.
    fn open(
        mounts: &'a LoadMounts,
        set: &'a LoadSet,
        datas: &'a [Vec<u8>],
        ids: (ContextId, ContextId),
        n: u32,
    ) -> Result<SetReaders<'a>, BenchError> {
        let (id, zid) = ids;
        let max_len = set.lens.iter().copied().max().unwrap_or(0);
        let kv = MountReader::open_rw(mounts.raw.path(), id, FP)?;
        let zkv = MountReader::open(mounts.zstd.path(), zid, FP)?;
        let dkv = MountReader::open(mounts.daemon.path(), id, FP)?;
        let data_path = mounts.store.data_path(id);
        let data_file = open_data_file(&mounts.store, &data_path)?;
        Ok(SetReaders {
            mounts,
            set,
            datas,
            id,
            n,
            slot: max_len.next_multiple_of(ALIGN),
            max_len,
            kv,
            zkv,
            dkv,
            data_path,
            data_file,
        })
    }

    /// Chunk `i`'s bytes.
    fn data(&self, i: u32) -> &[u8] {
        &self.datas[i as usize % self.datas.len()][..]
    }

    /// Chunk `i`'s file in the passthrough mount's per-chunk view.
    fn chunk_file(&self, i: u32) -> PathBuf {
        self.mounts
            .raw
            .path()
            .join(self.id.to_string())
            .join("chunks")
            .join(i.to_string())
    }

    /// One round of every load path ([`LOAD_PATHS`], whose order `runs` follows) with `readers`
    /// parallel readers, each pass from a cold page cache.
    fn read_round(&self, readers: usize, runs: &mut [Vec<Pass>; 7]) -> Result<(), BenchError> {
        let (n, slot, id) = (self.n, self.slot, self.id);
        let (store, zstore) = (&*self.mounts.store, &*self.mounts.zstore);
        drop_caches();
        let bare = |buf: &mut AlignedBuf, i| {
            let at = store.locate(id, i, &FP)?;
            let len = HEADER_PAGE + at.stored_len as usize;
            let off = slot_offset(i, at.copy);
            let r = read_slot(&self.data_file, store.direct_io(), off, len, buf)
                .map_err(|e| IoError::new("read", &self.data_path, e))?;
            Ok(r.len() - HEADER_PAGE)
        };
        runs[0].push(parallel_pass(n, readers, || AlignedBuf::huge(slot), bare)?);
        drop_caches();
        runs[6].push(parallel_pass(n, readers, || AlignedBuf::new(slot), bare)?);
        drop_caches();
        runs[1].push(parallel_pass(
            n,
            readers,
            || AlignedBuf::huge(slot),
            |buf, i| Ok(store.read_chunk_into(id, i, &FP, buf.get(slot))?.raw_len as usize),
        )?);
        for (r, reader, st) in [
            (2, &self.kv, store),
            (3, &self.zkv, zstore),
            (4, &self.dkv, store),
        ] {
            drop_caches();
            runs[r].push(parallel_pass(
                n,
                readers,
                || AlignedBuf::huge(slot),
                |buf, i| Ok(reader.read_chunk_into(st, i, buf.get(slot))?.raw_len as usize),
            )?);
        }
        drop_caches();
        runs[5].push(parallel_pass(
            n,
            readers,
            || vec![0u8; self.max_len],
            |buf, i| {
                let p = self.chunk_file(i);
                let mut f = std::fs::File::open(&p).map_err(|e| IoError::new("open", &p, e))?;
                let len = self.set.len(i);
                f.read_exact(&mut buf[..len])
                    .map_err(|e| IoError::new("read", &p, e))?;
                Ok(len)
            },
        )?);
        Ok(())
    }

    /// The write-out of the first `w` chunks by every path ([`WRITE_PATHS`], in order), one
    /// writer, each chunk durable before the next.
    fn write_runs(&self, w: u32) -> Result<[Vec<Pass>; 3], BenchError> {
        let store = &*self.mounts.store;
        let mut runs: [Vec<Pass>; 3] = Default::default();
        runs[0].push(parallel_pass(
            w,
            1,
            || (),
            |_, i| {
                store.write_chunk(self.id, i, &FP, KvFormat::Int8, 0.0, self.data(i))?;
                Ok(self.set.len(i))
            },
        )?);
        runs[1].push(parallel_pass(
            w,
            1,
            || (),
            |_, i| {
                self.kv.write_chunk(i, KvFormat::Int8, 0.0, self.data(i))?;
                Ok(self.set.len(i))
            },
        )?);
        runs[2].push(parallel_pass(
            w,
            1,
            || (),
            |_, i| {
                let p = self.chunk_file(i);
                std::fs::write(&p, self.data(i)).map_err(|e| IoError::new("write", &p, e))?;
                Ok(self.set.len(i))
            },
        )?);
        Ok(runs)
    }
}

/// Opens a context's data file for bare reads of its slots: with O_DIRECT where the store uses it.
fn open_data_file(store: &Store, path: &Path) -> Result<std::fs::File, BenchError> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(if store.direct_io() { libc::O_DIRECT } else { 0 })
        .open(path)
        .map_err(|e| IoError::new("open", path, e).into())
}

/// Drops clean page-cache pages so reads start cold (root only; a no-op otherwise).
fn drop_caches() {
    let _ = std::fs::write("/proc/sys/vm/drop_caches", b"1");
}

/// Page-cache residency of a context's chunk files, by `fincore` (util-linux, mincore(2)).
fn cache_row(store: &Store, id: ContextId, n: usize, kib: usize) -> Result<CacheRow, BenchError> {
    cache_row_named(store, id, n, format!("{kib} KiB chunks written and read"))
}

fn cache_row_named(
    store: &Store,
    id: ContextId,
    n: usize,
    after: String,
) -> Result<CacheRow, BenchError> {
    let _ = n;
    cache_row_files(&[store.data_path(id)], after)
}

/// Page-cache residency of `paths`, by `fincore`.
fn cache_row_files(paths: &[PathBuf], after: String) -> Result<CacheRow, BenchError> {
    let mut file_bytes = 0;
    for p in paths {
        file_bytes += std::fs::metadata(p)
            .map_err(|e| IoError::new("stat", p, e))?
            .len();
    }
    let out = Command::new("fincore")
        .args(["--bytes", "--noheadings", "--output", "RES"])
        .args(paths)
        .output();
    let resident_bytes = match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter_map(|l| l.trim().parse::<u64>().ok())
            .sum(),
        _ => u64::MAX,
    };
    Ok(CacheRow {
        after,
        resident_bytes,
        file_bytes,
    })
}

/// Chunks to compress together: source, format name, the chunks.
type Group = (String, String, Vec<Vec<u8>>);

fn zstd_report(config: &BenchConfig) -> Result<Vec<ZstdRow>, BenchError> {
    // Synthetic chunks of the four formats the synthesizer lays out (the coded ones only differ
    // in their parameters' bytes); real chunks of any format come from `chunks_dir`.
    let mut groups: Vec<Group> = KvFormat::VARIANTS[..4]
        .iter()
        .map(|f| {
            let chunks = (0..24)
                .map(|s| synth::kv_chunk(*f, 16, synth::SMOLLM2_CHANNELS, s))
                .collect();
            ("synthetic".to_owned(), f.name().to_owned(), chunks)
        })
        .collect();
    if let Some(dir) = &config.chunks_dir {
        groups.extend(real_chunks(dir)?);
    }
    let mut rows = Vec::new();
    for (source, format, chunks) in &groups {
        for &level in &config.zstd_levels {
            rows.push(zstd_row(source, format, chunks, level));
        }
    }
    Ok(rows)
}

/// Reads real chunks: kvfs chunk files (grouped by their format, payload decoded) or plain files.
fn real_chunks(dir: &Path) -> Result<Vec<Group>, BenchError> {
    let mut by_format: std::collections::BTreeMap<String, Vec<Vec<u8>>> = Default::default();
    let entries = std::fs::read_dir(dir).map_err(|e| IoError::new("list", dir, e))?;
    for e in entries {
        let path = e.map_err(|e| IoError::new("list", dir, e))?.path();
        if !path.is_file() {
            continue;
        }
        let bytes = std::fs::read(&path).map_err(|e| IoError::new("read", &path, e))?;
        match ChunkHeader::decode(&bytes) {
            Ok(h) if h.check_payload(&bytes[HEADER_LEN..]).is_ok() => {
                let payload = &bytes[HEADER_LEN..];
                let data = match h.codec {
                    Codec::Raw => payload.to_vec(),
                    Codec::Zstd => match zstd::bulk::decompress(payload, h.raw_len as usize) {
                        Ok(d) => d,
                        Err(_) => continue,
                    },
                };
                by_format
                    .entry(h.format.name().to_owned())
                    .or_default()
                    .push(data);
            }
            _ => by_format.entry("file".to_owned()).or_default().push(bytes),
        }
    }
    if by_format.is_empty() {
        return Err(BenchError::NoChunks {
            path: dir.to_owned(),
        });
    }
    let source = format!("{}", dir.display());
    Ok(by_format
        .into_iter()
        .map(|(f, c)| (source.clone(), f, c))
        .collect())
}

fn zstd_row(source: &str, format: &str, chunks: &[Vec<u8>], level: i32) -> ZstdRow {
    let raw: usize = chunks.iter().map(Vec::len).sum();
    // Repeat small sets so each timing covers at least ~32 MiB.
    let reps = (32 << 20) / raw.max(1) + 1;
    let t = Instant::now();
    let mut compressed = Vec::new();
    for r in 0..reps {
        let c: Vec<Vec<u8>> = chunks
            .iter()
            .map(|c| zstd::bulk::compress(c, level).unwrap_or_default())
            .collect();
        if r == 0 {
            compressed = c;
        }
    }
    let ct = t.elapsed().as_secs_f64();
    let stored: usize = compressed.iter().map(Vec::len).sum();
    let t = Instant::now();
    for _ in 0..reps {
        for (c, orig) in compressed.iter().zip(chunks) {
            let _ = zstd::bulk::decompress(c, orig.len());
        }
    }
    let dt = t.elapsed().as_secs_f64();
    let total = (raw * reps) as f64;
    ZstdRow {
        source: source.to_owned(),
        format: format.to_owned(),
        chunks: chunks.len(),
        chunk_bytes: raw / chunks.len().max(1),
        level,
        ratio: raw as f64 / stored.max(1) as f64,
        compress_mb_per_s: total / ct / 1e6,
        decompress_mb_per_s: total / dt / 1e6,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn real_chunk_files_are_grouped_by_format_and_decoded() {
        let dir = tempfile::tempdir().unwrap();
        let chunks = dir.path().join("chunks");
        std::fs::create_dir(&chunks).unwrap();
        let skewed = synth::kv_chunk(KvFormat::Int2, 16, 512, 1);
        for (name, format, data) in [
            ("0", KvFormat::Int2, &skewed[..]),
            ("1", KvFormat::Int8, &b"plain"[..]),
        ] {
            let h = ChunkHeader {
                format,
                codec: Codec::Raw,
                context: 1,
                index: 0,
                token_start: 0,
                token_end: 16,
                tokens_crc: 0,
                density: 0.0,
                raw_len: data.len() as u32,
                stored_len: data.len() as u32,
                payload_crc: crc32c::crc32c(data),
                generation: 1,
                fingerprint: FP,
                written: 0,
            };
            std::fs::write(chunks.join(name), [&h.encode()[..], data].concat()).unwrap();
        }
        std::fs::write(chunks.join("x"), b"not a chunk file").unwrap();
        let groups = real_chunks(&chunks).unwrap();
        let found: Vec<(&str, Vec<usize>)> = groups
            .iter()
            .map(|(_, f, c)| (f.as_str(), c.iter().map(Vec::len).collect()))
            .collect();
        assert_eq!(
            found,
            vec![
                ("file", vec![16]),
                ("int2", vec![skewed.len()]),
                ("int8", vec![5])
            ]
        );
        let empty = dir.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        assert!(matches!(
            real_chunks(&empty),
            Err(BenchError::NoChunks { .. })
        ));
    }

    #[test]
    fn the_benchmark_runs_end_to_end_on_a_small_config() {
        let dir = tempfile::tempdir().unwrap();
        let config = BenchConfig {
            dir: dir.path().join("bench"),
            sizes_kib: vec![16],
            bytes_per_size: 0,
            chunks_dir: None,
            zstd_levels: vec![1],
            load_sets: vec![LoadSet {
                name: "mix".into(),
                lens: vec![8192, 100, 20000],
                formats: vec![KvFormat::Int8, KvFormat::Int2, KvFormat::Int4],
            }],
            load_chunks: 8,
            readers: vec![1, 2],
            rounds: 1,
            write_chunks: 4,
        };
        let r = run(&config).unwrap();
        let paths: Vec<&str> = r.reads.iter().map(|x| x.path).collect();
        assert_eq!(
            paths,
            [
                "raw file O_DIRECT",
                "store api",
                "mount, direct_io",
                "mount, dirs cached"
            ]
        );
        assert!(r.reads.iter().all(|x| x.chunks == 96 && x.mb_per_s > 0.0));
        assert_eq!(r.writes.len(), 2);
        assert_eq!(r.cache[0].resident_bytes, 0, "{:?}", r.cache);
        assert_eq!(r.zstd.len(), 4);
        let loads: Vec<(&str, usize, usize)> = r
            .loads
            .iter()
            .map(|x| (x.path, x.readers, x.chunks))
            .collect();
        let want: Vec<(&str, usize, usize)> = [1, 2]
            .into_iter()
            .flat_map(|n| LOAD_PATHS.map(|p| (p, n, 8)))
            .collect();
        assert_eq!(loads, want);
        assert!(
            r.loads
                .iter()
                .all(|x| x.mb_per_s > 0.0 && x.p99_us >= x.p50_us)
        );
        let writes: Vec<(&str, usize)> = r.load_writes.iter().map(|x| (x.path, x.chunks)).collect();
        assert_eq!(writes, WRITE_PATHS.map(|p| (p, 4)));
        // Every path leaves the page cache empty, the passed-through reads included.
        for c in &r.cache {
            assert_eq!(c.resident_bytes, 0, "{c:?}");
        }
        // The passthrough rows' reads never reached a daemon.
        assert_eq!(r.passthrough_daemon_reads, 0);
        assert!(r.passthrough_opens > 0);
        let z = &r.load_zstd[0];
        assert_eq!((z.chunks, z.raw_bytes), (8, 3 * 8192 + 3 * 100 + 2 * 20000));
        assert!(z.zstd_chunks > 0 && z.stored_bytes < z.raw_bytes, "{z:?}");
        assert!(!config.dir.exists(), "scratch directory left behind");
        // A directory with something in it is not taken over.
        std::fs::create_dir(&config.dir).unwrap();
        std::fs::write(config.dir.join("keep"), b"x").unwrap();
        assert!(matches!(run(&config), Err(BenchError::DirNotEmpty { .. })));
        assert!(config.dir.join("keep").exists());
    }
}
