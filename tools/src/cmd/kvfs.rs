//! `llms kvfs mount|inspect` and `llms bench kvfs`: the kvfs chunk store from the command line.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, bail};
use bench::kvfs::{BenchConfig, IoRow, LoadRow, LoadSet};
use clap::{Args, Subcommand};
use kvfs::{ContextId, Store, StoreOptions, StoreState};

use crate::report::table;

/// Mount or inspect a kvfs chunk store.
#[derive(Subcommand)]
pub enum KvfsCommand {
    /// Mount a store with FUSE, read-only unless --rw, and serve it until SIGINT or SIGTERM,
    /// then unmount
    Mount {
        /// The store directory (an existing kvfs store: mounting never creates one)
        #[arg(long, value_name = "DIR")]
        store: PathBuf,
        /// Where to mount it (an existing directory; a stale mount there is cleaned up)
        mountpoint: PathBuf,
        /// Read-write: recover the store at open and accept writes through the mount (never on a
        /// store a running `llms serve` holds) [default: read-only, nothing in the store changes]
        #[arg(long)]
        rw: bool,
        /// FUSE worker threads (as many as the parallel chunk readers to serve)
        #[arg(long, default_value_t = 4, value_parser = crate::report::positive)]
        threads: usize,
        /// Cache context directories' attributes for 1 s: faster opens, but another uid may then
        /// stat (not list or read) a context directory whose id it guesses
        #[arg(long)]
        cache_dir_attrs: bool,
        /// Show each context's `text` as this model's tokenizer decodes it: a cached model's name
        /// (as `llms model ls` lists it, with or without .gguf) or a GGUF file; contexts of
        /// another model are not decoded (their `info` says so) [default: no tokenizer, `text`
        /// points at `tokens`]
        #[arg(long, value_name = "NAME|FILE")]
        model: Option<String>,
        #[command(flatten)]
        dir: crate::args::ModelsDirArg,
    },
    /// Print a store's contexts and chunks without mounting it (changes nothing)
    Inspect {
        /// The store directory (an existing kvfs store)
        #[arg(long, value_name = "DIR")]
        store: PathBuf,
        /// Only this context, with its chunk table
        #[arg(long)]
        context: Option<u64>,
        /// Read and check every chunk's payload
        #[arg(long)]
        verify: bool,
        /// JSON on stdout instead of text: the store, what recovery found, each context with its
        /// chunk table, and with --verify the chunks that failed
        #[arg(long)]
        json: bool,
    },
    /// (internal) The guard `llms serve` starts beside its mount: aborts the mount's FUSE
    /// connection if the daemon dies, so a kill -9 during chunk I/O cannot hang it
    #[command(hide = true)]
    Guard {
        #[arg(long)]
        parent: u32,
        #[arg(long)]
        mountpoint: PathBuf,
        #[arg(long)]
        connection: u32,
    },
}

/// Arguments of `llms bench kvfs`.
#[derive(Args)]
pub struct BenchArgs {
    #[command(flatten)]
    report: crate::report::ReportArgs,
    /// Scratch directory (new or empty) on the filesystem to measure; removed afterwards
    /// [default: <out>/kvfs-scratch]
    #[arg(long, value_name = "DIR")]
    scratch: Option<PathBuf>,
    /// Chunk sizes in KiB
    #[arg(long, value_delimiter = ',', default_value = "16,64,192,1024", value_parser = crate::report::positive)]
    sizes: Vec<usize>,
    /// MiB written and read per chunk size
    #[arg(long, default_value_t = 64, value_parser = crate::report::positive)]
    mib: usize,
    /// A directory of real chunk files (kvfs chunk files or plain bytes) for the zstd figures
    #[arg(long)]
    chunks: Option<PathBuf>,
    /// zstd levels
    #[arg(long, value_delimiter = ',', default_value = "1,3")]
    levels: Vec<i32>,
    /// Chunks per set in the load measurement (int8 212 KiB, int4 120 KiB, int2 76 KiB and a
    /// 25:50:25 mix); 0 skips it
    #[arg(long, default_value_t = 256)]
    load_chunks: usize,
    /// Parallel reader counts for the load measurement
    #[arg(long, value_delimiter = ',', default_value = "1,2,3,4", value_parser = crate::report::positive)]
    readers: Vec<usize>,
    /// Passes of each load measurement
    #[arg(long, default_value_t = 3, value_parser = crate::report::positive)]
    rounds: usize,
    /// Chunks written per path and set for the write-out measurement
    #[arg(long, default_value_t = 48, value_parser = crate::report::positive)]
    write_chunks: usize,
}

/// Runs `llms kvfs ...`.
pub fn run(cmd: KvfsCommand) -> anyhow::Result<()> {
    match cmd {
        KvfsCommand::Mount {
            store,
            mountpoint,
            rw,
            threads,
            cache_dir_attrs,
            model,
            dir,
        } => {
            let model = model.map(|m| model_file(&m, &dir)).transpose()?;
            mount(
                store,
                mountpoint,
                !rw,
                threads,
                cache_dir_attrs,
                model.as_deref(),
            )
        }
        KvfsCommand::Inspect {
            store,
            context,
            verify,
            json,
        } => {
            if json {
                inspect_json(store, context, verify)
            } else {
                inspect(store, context, verify)
            }
        }
        KvfsCommand::Guard {
            parent,
            mountpoint,
            connection,
        } => Ok(kvfs::guard::run(parent, &mountpoint, connection)?),
    }
}

/// Opens an existing store; `llms kvfs` never creates one (a mistyped --store is an error).
fn open(path: &std::path::Path, read_only: bool) -> anyhow::Result<Store> {
    if !Store::exists(path) {
        bail!(
            "{} is not a kvfs store (no such store; `llms serve --store DIR --create` makes one)",
            path.display()
        );
    }
    let options = StoreOptions {
        read_only,
        ..StoreOptions::default()
    };
    Store::open(path, options)
        .with_context(|| format!("cannot open the kvfs store {}", path.display()))
}

/// The GGUF file `--model` names: a file, else a model of that name in the models cache.
fn model_file(name: &str, dir: &crate::args::ModelsDirArg) -> anyhow::Result<PathBuf> {
    let path = Path::new(name);
    if path.is_file() {
        return Ok(path.to_owned());
    }
    let opts = dir.fetch_options();
    let cache = model::fetch::models_dir(&opts).context("cannot choose the models directory")?;
    let models = model::fetch::list(&opts)
        .with_context(|| format!("cannot list the models in {}", cache.display()))?;
    models
        .into_iter()
        .find(|m| {
            m.name == name || m.name.strip_suffix(".gguf") == Some(name) || m.model == Some(name)
        })
        .map(|m| m.path)
        .with_context(|| {
            format!(
                "no model {name}: no such file, and the models cache {} holds no model of that \
                 name (`llms model ls` lists them)",
                cache.display()
            )
        })
}

/// Registers `model`'s tokenizer as the store's decoder for that model's contexts, and says on
/// stderr how many contexts it decodes.
fn decode_with(store: &Store, model: &Path) -> anyhow::Result<()> {
    let tokenizer = model::tokenizer::Tokenizer::from_gguf_file(model)
        .with_context(|| format!("cannot read the tokenizer of {}", model.display()))?;
    let fingerprint = service::source::model_fingerprint(model)
        .with_context(|| format!("cannot read {} to fingerprint it", model.display()))?;
    store.set_decoder(fingerprint, service::inspect::decoder(Arc::new(tokenizer)));
    let ids = store.list_contexts();
    let other = ids
        .iter()
        .filter(|&&id| store.fingerprint(id).is_ok_and(|fp| fp != fingerprint))
        .count();
    eprintln!(
        "kvfs: text decoded with the tokenizer of {} (model {fingerprint}){}",
        model.display(),
        if other == 0 {
            String::new()
        } else {
            format!(
                "; {other} of {} contexts belong to another model and are not decoded (see their info)",
                ids.len()
            )
        }
    );
    Ok(())
}

fn mount(
    store: PathBuf,
    mountpoint: PathBuf,
    read_only: bool,
    threads: usize,
    cache_dir_attrs: bool,
    model: Option<&Path>,
) -> anyhow::Result<()> {
    let root = store.clone();
    let store = Arc::new(open(&store, read_only)?);
    for r in store.recovered() {
        eprintln!("recovery: {} {}: {}", r.action, r.path.display(), r.reason);
    }
    if let Some(model) = model {
        decode_with(&store, model)?;
    }
    // Block the signals before the FUSE threads exist, so only `wait_for_termination` sees them.
    let signals = kvfs::fs::block_termination_signals().context("cannot block SIGINT/SIGTERM")?;
    let config = kvfs::MountConfig {
        read_only,
        threads,
        cache_dir_attrs,
        ..kvfs::MountConfig::default()
    };
    let m = kvfs::mount(store, &mountpoint, &config)?;
    eprintln!(
        "kvfs: {} mounted at {}{}; SIGINT or SIGTERM unmounts",
        root.display(),
        m.path().display(),
        if read_only { " (read-only)" } else { "" }
    );
    let sig = kvfs::fs::wait_for_termination(&signals).context("waiting for a signal")?;
    eprintln!("kvfs: {sig}, unmounting {}", mountpoint.display());
    m.unmount()?;
    Ok(())
}

fn inspect(path: PathBuf, context: Option<u64>, verify: bool) -> anyhow::Result<()> {
    let store = open(&path, true)?;
    for r in store.recovered() {
        println!("problem: {} {}: {}", r.action, r.path.display(), r.reason);
    }
    if let Some(id) = context {
        let id = ContextId(id);
        print!(
            "{}",
            store
                .render_info(id)
                .with_context(|| format!("in {}", path.display()))?
        );
    } else {
        print!("{}", store.render_stats());
        println!("\ncontext  owner  app                  tokens  stored  missing  quarantined");
        for id in store.list_contexts() {
            let info = store.context(id)?;
            let count =
                |f: fn(&StoreState) -> bool| info.chunks.iter().filter(|c| f(&c.state)).count();
            println!(
                "{:<8} {:<6} {:<20} {:<7} {:<7} {:<8} {}",
                id,
                info.meta.owner_uid,
                info.meta.app,
                info.tokens,
                count(|s| matches!(s, StoreState::Stored(_))),
                count(|s| matches!(s, StoreState::Missing)),
                count(|s| matches!(s, StoreState::Quarantined { .. })),
            );
        }
    }
    if verify {
        let bad = store.verify();
        for (id, index, e) in &bad {
            println!("corrupt: context {id} chunk {index}: {e}");
        }
        if !bad.is_empty() {
            bail!(
                "{} chunks failed verification; they will be recomputed",
                bad.len()
            );
        }
        println!("verify: every stored chunk checks out");
    }
    Ok(())
}

/// `llms kvfs inspect --json`: the same inspection as one JSON object on stdout.
fn inspect_json(path: PathBuf, context: Option<u64>, verify: bool) -> anyhow::Result<()> {
    let store = open(&path, true)?;
    let ids = match context {
        Some(id) => vec![ContextId(id)],
        None => store.list_contexts(),
    };
    let contexts = ids
        .into_iter()
        .map(|id| {
            let info = store
                .context(id)
                .with_context(|| format!("in {}", path.display()))?;
            Ok(context_json(&info))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let bad = if verify { store.verify() } else { Vec::new() };
    let report = serde_json::json!({
        "store": path,
        "problems": store.recovered().iter().map(|r| serde_json::json!({
            "action": r.action, "path": r.path, "reason": r.reason,
        })).collect::<Vec<_>>(),
        "contexts": contexts,
        "verify": verify.then(|| serde_json::json!({
            "corrupt": bad.iter().map(|(id, index, e)| serde_json::json!({
                "context": id.0, "chunk": index, "error": e.to_string(),
            })).collect::<Vec<_>>(),
        })),
    });
    println!("{}", serde_json::to_string_pretty(&report)?);
    if !bad.is_empty() {
        bail!(
            "{} chunks failed verification; they will be recomputed",
            bad.len()
        );
    }
    Ok(())
}

/// One context of `llms kvfs inspect --json`: its metadata, chunk counts and chunk table.
fn context_json(info: &kvfs::StoredContext) -> serde_json::Value {
    let count = |f: fn(&StoreState) -> bool| info.chunks.iter().filter(|c| f(&c.state)).count();
    let chunks: Vec<serde_json::Value> = info
        .chunks
        .iter()
        .map(|c| {
            let mut v = serde_json::json!({
                "index": c.index,
                "tokens": [c.span.start, c.span.end],
                "state": c.state.name(),
            });
            match &c.state {
                StoreState::Stored(s) => {
                    v["format"] = s.format.name().into();
                    v["codec"] = s.codec.name().into();
                    v["density"] = s.density.into();
                    v["raw_bytes"] = s.raw_len.into();
                    v["stored_bytes"] = s.stored_len.into();
                    v["written"] = s.written.into();
                }
                StoreState::Quarantined { reason } => v["reason"] = reason.as_str().into(),
                StoreState::Missing => {}
            }
            v
        })
        .collect();
    serde_json::json!({
        "id": info.id.0,
        "owner_uid": info.meta.owner_uid,
        "app": info.meta.app,
        "model": info.meta.fingerprint.to_string(),
        "created": info.meta.created,
        "tokens": info.tokens,
        "chunk_tokens": info.meta.chunk_tokens,
        "stored": count(|s| matches!(s, StoreState::Stored(_))),
        "missing": count(|s| matches!(s, StoreState::Missing)),
        "quarantined": count(|s| matches!(s, StoreState::Quarantined { .. })),
        "chunks": chunks,
    })
}

/// Runs `llms bench kvfs`: measures, prints the tables, writes the JSON report.
pub fn bench(args: BenchArgs) -> anyhow::Result<()> {
    args.report.begin();
    let report = args.report.clone();
    let config = bench_config(args)?;
    let r = bench::kvfs::run(&config).context("kvfs benchmark failed")?;
    io_tables(&r, &config.sizes_kib);
    if !r.loads.is_empty() {
        load_tables(&r.loads, &r.load_writes);
        passthrough_tables(&r);
    }
    table!("\npage cache after the I/O (fincore)");
    for c in &r.cache {
        table!(
            "  {:<34} {} of {} bytes resident",
            c.after,
            c.resident_bytes,
            c.file_bytes
        );
    }
    zstd_table(&r.zstd);
    zstd_verdicts(&r);
    report.write("kvfs", &report_json(&r))?;
    Ok(())
}

/// What `llms bench kvfs` measures, from its arguments.
fn bench_config(args: BenchArgs) -> anyhow::Result<BenchConfig> {
    Ok(BenchConfig {
        dir: args
            .scratch
            .unwrap_or_else(|| args.report.scratch("kvfs-scratch")),
        sizes_kib: args.sizes,
        bytes_per_size: args
            .mib
            .checked_mul(1 << 20)
            .context("--mib is too large")?,
        chunks_dir: args.chunks,
        zstd_levels: args.levels,
        load_sets: if args.load_chunks == 0 {
            Vec::new()
        } else {
            LoadSet::defaults()
        },
        load_chunks: args.load_chunks,
        readers: args.readers,
        rounds: args.rounds,
        write_chunks: args.write_chunks,
    })
}

/// The read and write tables, with each mount path's reads against the store API's at every
/// chunk size of `sizes_kib`.
fn io_tables(r: &bench::kvfs::Report, sizes_kib: &[usize]) {
    table!(
        "kvfs benchmark ({}), one thread, cold page cache",
        if r.direct_io {
            "O_DIRECT reads"
        } else {
            "fadvise"
        }
    );
    table!("\nreads");
    io_table(&r.reads);
    for kib in sizes_kib {
        let get = |p: &str| r.reads.iter().find(|x| x.size_kib == *kib && x.path == p);
        if let Some(d) = get("store api") {
            for m in ["mount, direct_io", "mount, dirs cached"]
                .into_iter()
                .filter_map(get)
            {
                table!(
                    "  {kib:>5} KiB: {} / store api: {:.0}% of the throughput, {:.0}% of the median speed",
                    m.path,
                    100.0 * m.mb_per_s / d.mb_per_s,
                    100.0 * d.p50_us / m.p50_us
                );
            }
        }
    }
    table!("\nwrites (each chunk's payload, then its header, fdatasynced)");
    io_table(&r.writes);
}

/// zstd's ratio and speed per source, format and level.
fn zstd_table(rows: &[bench::kvfs::ZstdRow]) {
    table!("\nzstd (one core)");
    table!(
        "  {:<12} {:<6} {:>6} {:>9} {:>5} {:>7} {:>11} {:>13}",
        "source",
        "format",
        "chunks",
        "bytes",
        "level",
        "ratio",
        "comp MB/s",
        "decomp MB/s"
    );
    for z in rows {
        table!(
            "  {:<12} {:<6} {:>6} {:>9} {:>5} {:>7.3} {:>11.0} {:>13.0}",
            z.source,
            z.format,
            z.chunks,
            z.chunk_bytes,
            z.level,
            z.ratio,
            z.compress_mb_per_s,
            z.decompress_mb_per_s
        );
    }
}

/// Whether zstd pays for reads, per zstd row, against the disk's O_DIRECT reads at the size
/// nearest 192 KiB (nothing without such a read row).
fn zstd_verdicts(r: &bench::kvfs::Report) {
    // Reading a chunk costs stored/disk + raw/decompression with zstd and raw/disk without, so
    // zstd pays when ratio > 1 / (1 - disk/decompression).
    let disk = r
        .reads
        .iter()
        .filter(|x| x.path == "raw file O_DIRECT")
        .min_by_key(|x| x.size_kib.abs_diff(192))
        .map(|x| (x.size_kib, x.mb_per_s));
    let Some((kib, disk)) = disk else {
        return;
    };
    table!(
        "\nzstd pays for reads when ratio > 1 / (1 - disk / decompression); disk = {disk:.0} MB/s ({kib} KiB O_DIRECT)"
    );
    for z in &r.zstd {
        let verdict = if disk >= z.decompress_mb_per_s {
            "never (decompression is slower than the disk)".to_owned()
        } else {
            let need = 1.0 / (1.0 - disk / z.decompress_mb_per_s);
            let pays = if z.ratio > need {
                "pays"
            } else {
                "does not pay"
            };
            format!("needs {need:.2}, has {:.3}: {pays}", z.ratio)
        };
        table!(
            "  {:<12} {:<6} level {}: {verdict}",
            z.source,
            z.format,
            z.level
        );
    }
}

/// The JSON report of `llms bench kvfs`: every row the benchmark measured.
fn report_json(r: &bench::kvfs::Report) -> serde_json::Value {
    let io = |rows: &[IoRow]| {
        rows.iter()
            .map(|x| {
                serde_json::json!({
                    "size_kib": x.size_kib, "path": x.path, "chunks": x.chunks,
                    "p50_us": x.p50_us, "p99_us": x.p99_us, "mb_per_s": x.mb_per_s,
                })
            })
            .collect::<Vec<_>>()
    };
    let loads = |rows: &[LoadRow]| {
        rows.iter()
            .map(|x| {
                serde_json::json!({
                    "set": x.set, "path": x.path, "readers": x.readers, "chunks": x.chunks,
                    "p50_us": x.p50_us, "p99_us": x.p99_us, "mb_per_s": x.mb_per_s,
                })
            })
            .collect::<Vec<_>>()
    };
    serde_json::json!({
        "direct_io": r.direct_io,
        "reads": io(&r.reads),
        "writes": io(&r.writes),
        "page_cache": r.cache.iter().map(|c| serde_json::json!({
            "after": c.after, "resident_bytes": c.resident_bytes, "file_bytes": c.file_bytes,
        })).collect::<Vec<_>>(),
        "loads": loads(&r.loads),
        "load_writes": loads(&r.load_writes),
        "load_zstd": r.load_zstd.iter().map(|z| serde_json::json!({
            "set": z.set, "chunks": z.chunks, "zstd_chunks": z.zstd_chunks,
            "raw_bytes": z.raw_bytes, "stored_bytes": z.stored_bytes,
        })).collect::<Vec<_>>(),
        "passthrough_daemon_reads": r.passthrough_daemon_reads,
        "passthrough_opens": r.passthrough_opens,
        "zstd": r.zstd.iter().map(|z| serde_json::json!({
            "source": z.source, "format": z.format, "chunks": z.chunks, "chunk_bytes": z.chunk_bytes,
            "level": z.level, "ratio": z.ratio, "compress_mb_per_s": z.compress_mb_per_s,
            "decompress_mb_per_s": z.decompress_mb_per_s,
        })).collect::<Vec<_>>(),
    })
}

fn io_table(rows: &[IoRow]) {
    table!(
        "  {:>8} {:<20} {:>6} {:>10} {:>10} {:>9}",
        "size KiB",
        "path",
        "chunks",
        "p50 us",
        "p99 us",
        "MB/s"
    );
    for x in rows {
        table!(
            "  {:>8} {:<20} {:>6} {:>10.0} {:>10.0} {:>9.0}",
            x.size_kib,
            x.path,
            x.chunks,
            x.p50_us,
            x.p99_us,
            x.mb_per_s
        );
    }
}

/// Prints the chunk-load and write-out tables and the targets of issue 10 against them.
fn load_tables(loads: &[LoadRow], writes: &[LoadRow]) {
    load_table(loads);
    let mut sets: Vec<&str> = loads.iter().map(|x| x.set.as_str()).collect();
    sets.dedup();
    load_targets(loads, &sets);
    write_table(writes, &sets);
}

/// The chunk loads, a row per set, path and number of readers.
fn load_table(loads: &[LoadRow]) {
    table!(
        "\nchunk loads at real sizes (cold page cache; KV-shaped payloads, raw unless the path says zstd; MB/s is chunk bytes delivered, the aggregate of all readers)"
    );
    table!(
        "  {:<13} {:<24} {:>7} {:>6} {:>8} {:>8} {:>8}",
        "set",
        "path",
        "readers",
        "chunks",
        "p50 us",
        "p99 us",
        "MB/s"
    );
    for x in loads {
        table!(
            "  {:<13} {:<24} {:>7} {:>6} {:>8.0} {:>8.0} {:>8.0}",
            x.set,
            x.path,
            x.readers,
            x.chunks,
            x.p50_us,
            x.p99_us,
            x.mb_per_s
        );
    }
}

/// Each set's loads against issue 10's targets: the mount against the store with one reader,
/// huge pages against 4K pages, and the mount against the disk's limit with 2 to 4 readers.
fn load_targets(loads: &[LoadRow], sets: &[&str]) {
    let get = |set: &str, path: &str, n: usize| {
        loads
            .iter()
            .find(|x| x.set == set && x.path == path && x.readers == n)
    };
    table!(
        "\n  targets: one reader, mount >= 80% of the store path; 2-4 readers, mount >= 70% of the disk limit"
    );
    for set in sets {
        if let (Some(m), Some(d)) = (
            get(set, "mount kv passthrough", 1),
            get(set, "store read_chunk_into", 1),
        ) {
            table!(
                "  {set:<13} 1 reader:  mount / store {:>4.0}% of the throughput, {:>4.0}% of the median speed",
                100.0 * m.mb_per_s / d.mb_per_s,
                100.0 * d.p50_us / m.p50_us
            );
        }
        // The disk's O_DIRECT limit: the best aggregate of the bare reads at any reader count.
        let limit = loads
            .iter()
            .filter(|x| x.set == *set && x.path == "disk O_DIRECT")
            .map(|x| x.mb_per_s)
            .fold(0.0, f64::max);
        for n in 1..=4 {
            if let (Some(h), Some(p)) = (
                get(set, "disk O_DIRECT", n),
                get(set, "disk O_DIRECT 4K pages", n),
            ) {
                table!(
                    "  {set:<13} {n} readers: disk O_DIRECT into huge pages {:>5.0} MB/s, into 4K pages {:>5.0} MB/s ({:.2}x)",
                    h.mb_per_s,
                    p.mb_per_s,
                    h.mb_per_s / p.mb_per_s
                );
            }
        }
        for n in 2..=4 {
            if let Some(m) = get(set, "mount kv passthrough", n) {
                table!(
                    "  {set:<13} {n} readers: mount {:>5.0} MB/s = {:>4.0}% of the disk limit {limit:.0} MB/s",
                    m.mb_per_s,
                    100.0 * m.mb_per_s / limit
                );
            }
        }
    }
}

/// The chunk write-out, a row per set and path, and each set's mount against the store.
fn write_table(writes: &[LoadRow], sets: &[&str]) {
    table!("\nchunk write-out at real sizes (one writer, each chunk durable before the next)");
    table!(
        "  {:<13} {:<24} {:>6} {:>8} {:>8} {:>8}",
        "set",
        "path",
        "chunks",
        "p50 us",
        "p99 us",
        "MB/s"
    );
    for x in writes {
        table!(
            "  {:<13} {:<24} {:>6} {:>8.0} {:>8.0} {:>8.0}",
            x.set,
            x.path,
            x.chunks,
            x.p50_us,
            x.p99_us,
            x.mb_per_s
        );
    }
    for set in sets {
        let w = |p: &str| writes.iter().find(|x| x.set == *set && x.path == p);
        if let (Some(m), Some(d)) = (w("mount kv pwrite"), w("store write_chunk")) {
            table!(
                "  {set:<13} write-out: mount kv / store {:>4.0}% of the throughput (target >= 70%)",
                100.0 * m.mb_per_s / d.mb_per_s
            );
        }
    }
}

/// The mount's data path (its `data` files passed through to the store's data files) against the
/// disk, against the same file served by the daemon, and over zstd payloads, read off the load
/// rows; and what zstd made of the chunks.
fn passthrough_tables(r: &bench::kvfs::Report) {
    table!("\nzstd payloads of the `mount kv zstd` rows (level 1, kept whenever smaller)");
    for z in &r.load_zstd {
        table!(
            "  {:<13} {}/{} chunks zstd, ratio {:.3} ({} of {} bytes)",
            z.set,
            z.zstd_chunks,
            z.chunks,
            z.raw_bytes as f64 / z.stored_bytes.max(1) as f64,
            z.stored_bytes,
            z.raw_bytes
        );
    }
    table!(
        "\nthe mount's data path against the disk and the daemon (MB/s of chunk bytes; p50 us); READs of passed-through files seen by the daemon: {} in {} opens",
        r.passthrough_daemon_reads,
        r.passthrough_opens
    );
    table!(
        "  {:<13} {:>7} {:>16} {:>16} {:>16} {:>16}",
        "set",
        "readers",
        "disk O_DIRECT",
        "kv passthrough",
        "kv daemon",
        "kv zstd"
    );
    let mut keys: Vec<(&str, usize)> = r
        .loads
        .iter()
        .map(|x| (x.set.as_str(), x.readers))
        .collect();
    keys.dedup();
    for (set, n) in keys {
        let cell = |path: &str| {
            r.loads
                .iter()
                .find(|x| x.set == set && x.readers == n && x.path == path)
                .map_or_else(
                    || "-".to_owned(),
                    |x| format!("{:.0} ({:.0})", x.mb_per_s, x.p50_us),
                )
        };
        table!(
            "  {set:<13} {n:>7} {:>16} {:>16} {:>16} {:>16}",
            cell("disk O_DIRECT"),
            cell("mount kv passthrough"),
            cell("mount kv daemon"),
            cell("mount kv zstd")
        );
    }
}
