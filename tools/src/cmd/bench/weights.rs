//! `llms bench weights`: prefill and decode speed against the weight budget, for FlexInfer's
//! methods (prefetch only, + balanced locking, + tensor preservation) and plain mmap, each run in
//! a child process inside a cgroup v1 memory limit of the budget (the page cache counts against
//! it), optionally under a blkio read throttle.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Args;
use model::generate::argmax;
use model::kv::{HeapChunks, KvCache};
use model::stream::Residency;
use model::{Logits, Model, WeightHolding, WeightOptions, WeightSource};

use crate::args::{EngineOpts, init_threads, model_path};
use crate::report::table;

/// `llms bench weights`.
#[derive(Args, Debug)]
pub struct BenchWeightsArgs {
    #[command(flatten)]
    pub engine: EngineOpts,
    /// Real text the prompt is cut from
    #[arg(
        long,
        default_value = "/usr/share/common-licenses/GPL-3",
        value_name = "FILE"
    )]
    pub text: PathBuf,
    #[command(flatten)]
    pub report: crate::report::ReportArgs,
    /// Weight budgets, in percent of the model's weight bytes (1 to 100)
    #[arg(long, value_delimiter = ',', default_values_t = [100u32, 75, 50, 25, 10])]
    pub budgets: Vec<u32>,
    /// Methods: mmap (the file mapped, in a memory cgroup of the budget), stream (prefetch
    /// only), inorder (+ locking of the first layers), balanced (+ balanced locking), preserve
    /// (+ tensor preservation: the planner's choice)
    #[arg(long, value_delimiter = ',', default_values_t = ["mmap".to_string(), "stream".into(), "balanced".into(), "preserve".into()])]
    pub methods: Vec<String>,
    /// Throttle reads from the model's disk to this many bytes/s (cgroup v1 blkio; suffixes K,
    /// M, G)
    #[arg(long, value_name = "BYTES")]
    pub read_bps: Option<String>,
    /// Prompt tokens to prefill (one prefill step of --prefill-chunk tokens each)
    #[arg(long, default_value_t = 256, value_parser = crate::report::positive)]
    pub prefill: usize,
    /// Tokens to decode after the prompt
    #[arg(long, default_value_t = 32, value_parser = crate::report::positive)]
    pub decode: usize,
    /// Tokens decoded before measuring (after a first prefill), to reach the steady state
    #[arg(long, default_value_t = 4)]
    pub warmup: usize,
    /// Buffers the I/O thread may fill ahead of the compute
    #[arg(long, default_value_t = 4, value_parser = crate::report::positive)]
    pub slots: usize,
    /// Run one measurement as a child process (internal)
    #[arg(long, hide = true, value_name = "JSON")]
    pub child: Option<String>,
}

/// One measurement, as the parent asks a child for it.
#[derive(serde::Serialize, serde::Deserialize, Debug, Clone)]
struct Spec {
    model: PathBuf,
    threads: Option<usize>,
    kv_format: String,
    chunk_tokens: Option<usize>,
    prefill_chunk: Option<usize>,
    method: String,
    budget: Option<u64>,
    prompt: Vec<u32>,
    decode: usize,
    warmup: usize,
    slots: usize,
    memory_cgroup: Option<PathBuf>,
    blkio_cgroup: Option<PathBuf>,
}

/// What a child measured.
#[derive(serde::Serialize, serde::Deserialize, Debug, Clone)]
struct Measured {
    method: String,
    budget: Option<u64>,
    load_secs: f64,
    prefill_tokens_per_sec: f64,
    decode_tokens_per_sec: f64,
    tokens: Vec<u32>,
    /// Bytes the stream read per decoded token (mmap: the bytes repacked from the mapping).
    streamed_bytes_per_token: f64,
    /// Seconds per decoded token the compute waited for streamed weights.
    wait_secs_per_token: f64,
    holding: WeightHolding,
    /// Memory other than weights and page cache (heap, KV cache, kernel memory) when the
    /// decode's limit was set.
    base_bytes: u64,
    /// The decode's memory limit: base + budget + 4 MiB.
    limit_bytes: Option<u64>,
    /// The cgroup's peak usage during the decode (anonymous memory and page cache).
    peak_bytes: u64,
    /// Bytes read from the disk during the decode (the cgroup's blkio counters), per token.
    disk_bytes_per_token: Option<f64>,
}

/// One row of the report.
#[derive(serde::Serialize)]
struct Row {
    budget_percent: u32,
    #[serde(flatten)]
    m: Measured,
    /// Decode speed over mmap's at the same budget.
    vs_mmap: Option<f64>,
    /// Tokens/s if a token took only its streamed bytes at the read bandwidth.
    bound_tokens_per_sec: Option<f64>,
    /// Measured over the bound.
    of_bound: Option<f64>,
    same_tokens: bool,
}

#[derive(serde::Serialize)]
struct Report {
    model: String,
    threads: usize,
    weight_bytes: u64,
    read_bps_throttle: Option<u64>,
    disk_read_bps: f64,
    prefill: usize,
    decode: usize,
    reference: Measured,
    rows: Vec<Row>,
    plot: String,
}

const MEMORY: &str = "/sys/fs/cgroup/memory";
const BLKIO: &str = "/sys/fs/cgroup/blkio";
/// Room in the memory limit beyond the measured base while prefilling: a prefill step's
/// activations (about 10 MiB for 256 tokens of the default model) and the KV cache it fills
/// (about 6 MiB of f16 for them), which the base does not hold; the same for every method.
/// 16 MiB was exactly that: 5 of 18 children were killed by the OOM killer in their prefill,
/// none of 30 with 32 MiB (docs/bench-weights.md).
const PREFILL_SLACK: u64 = 32 << 20;
/// Room beyond the base measured after the prefill (which then holds the KV cache), for the
/// decode's small and growing allocations (new KV chunks, logits): the same for every method.
/// 1 MiB was too little: an all-resident engine at a 100% budget was killed by the OOM killer.
const DECODE_SLACK: u64 = 4 << 20;

/// Runs `llms bench weights`: as a child, one measurement; as the parent, the arguments
/// checked, the model's weight bytes and the prompt, the all-resident reference, every method
/// at every budget, each in a child, then the table, plot and JSON.
pub fn run(a: BenchWeightsArgs) -> anyhow::Result<()> {
    if let Some(spec) = &a.child {
        let spec: Spec = serde_json::from_str(spec).context("bad child spec")?;
        let m = child(&spec)?;
        println!("{}", serde_json::to_string(&m)?);
        return Ok(());
    }
    a.report.begin();
    let throttle = check_args(&a)?;
    let path = model_path(&a.engine)?;
    init_threads(a.engine.threads)?;
    let (weight_bytes, prompt) = weights_and_prompt(&a, &path)?;
    // The model's disk: 64 MiB of the file in 1 MiB `O_DIRECT` reads, one at a time (as the
    // stream reads).
    let disk_read_bps = bench::disk::direct_read_bps(&path, 64 << 20, 1)?;
    let threads = rayon::current_num_threads();
    eprintln!(
        "bench weights: {:.1} MiB of weights, {threads} threads, disk {:.2} GB/s with O_DIRECT{}",
        weight_bytes as f64 / 1048576.0,
        disk_read_bps / 1e9,
        throttle.map_or(String::new(), |b| format!(
            ", throttled to {:.0} MiB/s",
            b as f64 / 1048576.0
        ))
    );
    let mut children = Children {
        args: &a,
        model: &path,
        prompt,
        throttle,
        weight_bytes,
        n: 0,
    };
    let reference = children.measure("resident", None)?;
    // The stream's bound: the disk's bandwidth, or the throttle when it is slower.
    let bps = throttle.map_or(disk_read_bps, |t| (t as f64).min(disk_read_bps));
    let rows = budget_rows(&mut children, &reference, bps);
    print_table(&reference, &rows);
    std::fs::create_dir_all(&a.report.out)
        .with_context(|| format!("cannot create {}", a.report.out.display()))?;
    let name = if throttle.is_some() {
        "weights-throttled"
    } else {
        "weights"
    };
    let plot = a.report.out.join(format!("{name}.png"));
    plot_weights(&plot, &rows, &a.methods)?;
    let report = Report {
        model: path.display().to_string(),
        threads,
        weight_bytes,
        read_bps_throttle: throttle,
        disk_read_bps,
        prefill: a.prefill,
        decode: a.decode,
        reference,
        rows,
        plot: plot.display().to_string(),
    };
    a.report.write(name, &report)?;
    eprintln!("wrote {}", plot.display());
    Ok(())
}

/// Checks the arguments the parser cannot (the budgets, the methods, no --weight-budget) and
/// returns the read throttle, bytes/s.
fn check_args(a: &BenchWeightsArgs) -> anyhow::Result<Option<u64>> {
    if a.engine.weight_budget.is_some() {
        bail!("bench weights sets the budget itself: use --budgets, not --weight-budget");
    }
    if let Some(b) = a.budgets.iter().find(|&&b| !(1..=100).contains(&b)) {
        bail!("--budgets takes percentages from 1 to 100, not {b}");
    }
    for m in &a.methods {
        method(m, None, 1)?;
    }
    a.read_bps
        .as_deref()
        .map(crate::args::parse_bytes)
        .transpose()
        .context("--read-bps")
}

/// The model's weight bytes (all resident) and the prompt: the first --prefill tokens of the
/// text; the prompt, warm-up and decode must fit the model's context.
fn weights_and_prompt(a: &BenchWeightsArgs, path: &Path) -> anyhow::Result<(u64, Vec<u32>)> {
    let model = Model::load(path).with_context(|| format!("cannot load {}", path.display()))?;
    let tok = model::tokenizer::Tokenizer::from_gguf_file(path)?;
    let text = std::fs::read_to_string(&a.text)
        .with_context(|| format!("cannot read {}", a.text.display()))?;
    let toks = tok.encode(&text);
    anyhow::ensure!(
        toks.len() >= a.prefill,
        "{} has fewer than {} tokens",
        a.text.display(),
        a.prefill
    );
    if a.prefill + a.warmup + a.decode + 1 > model.cfg.max_ctx {
        bail!("--prefill, --warmup and --decode exceed the model's context");
    }
    Ok((model.weight_bytes() as u64, toks[..a.prefill].to_vec()))
}

/// The parent's side of the measurements: what every child's spec shares, and how many
/// children ran (each one's cgroups are named by its number).
struct Children<'a> {
    args: &'a BenchWeightsArgs,
    model: &'a Path,
    prompt: Vec<u32>,
    throttle: Option<u64>,
    weight_bytes: u64,
    n: usize,
}

impl Children<'_> {
    /// The spec of `method` at `budget` bytes (`None`: no budget).
    fn spec(&self, method: &str, budget: Option<u64>) -> Spec {
        let a = self.args;
        Spec {
            model: self.model.to_owned(),
            threads: a.engine.threads,
            kv_format: a.engine.kv_format.clone(),
            chunk_tokens: a.engine.chunk_tokens,
            prefill_chunk: a.engine.prefill_chunk,
            method: method.into(),
            budget,
            prompt: self.prompt.clone(),
            decode: a.decode,
            warmup: a.warmup,
            slots: a.slots,
            memory_cgroup: None,
            blkio_cgroup: None,
        }
    }

    /// Runs `method` at `budget` in a child and prints its line, or its failure.
    fn measure(&mut self, method: &str, budget: Option<u64>) -> anyhow::Result<Measured> {
        self.n += 1;
        let r = spawn(self.spec(method, budget), self.n, self.model, self.throttle);
        match &r {
            Ok(m) => eprintln!(
                "  {:>9} {:>6.1} MiB: prefill {:>7.1} t/s, decode {:>7.2} t/s, {:.1} MiB streamed/token, peak {:.1} MiB",
                m.method,
                m.budget.unwrap_or(self.weight_bytes) as f64 / 1048576.0,
                m.prefill_tokens_per_sec,
                m.decode_tokens_per_sec,
                m.streamed_bytes_per_token / 1048576.0,
                m.peak_bytes as f64 / 1048576.0
            ),
            Err(e) => eprintln!("  failed: {e:#}"),
        }
        r
    }
}

/// Every method at every budget, against the reference and against its bound (its streamed
/// bytes at `bps`), and against mmap at the same budget. A failed run (an OOM kill, say) is
/// reported as it happens and leaves a gap.
fn budget_rows(children: &mut Children<'_>, reference: &Measured, bps: f64) -> Vec<Row> {
    let a = children.args;
    let mut rows: Vec<Row> = Vec::new();
    for &pct in &a.budgets {
        let budget = children.weight_bytes * u64::from(pct) / 100;
        for m in &a.methods {
            let Ok(r) = children.measure(m, Some(budget)) else {
                continue;
            };
            let bound =
                (r.streamed_bytes_per_token > 0.0).then(|| bps / r.streamed_bytes_per_token);
            rows.push(Row {
                budget_percent: pct,
                vs_mmap: None,
                of_bound: bound.map(|b| r.decode_tokens_per_sec / b),
                bound_tokens_per_sec: bound,
                same_tokens: r.tokens == reference.tokens,
                m: r,
            });
        }
    }
    for i in 0..rows.len() {
        let mmap = rows
            .iter()
            .find(|r| r.budget_percent == rows[i].budget_percent && r.m.method == "mmap")
            .map(|r| r.m.decode_tokens_per_sec);
        rows[i].vs_mmap = mmap.map(|m| rows[i].m.decode_tokens_per_sec / m);
    }
    rows
}

/// The report's table: the reference, then a row per method and budget.
fn print_table(reference: &Measured, rows: &[Row]) {
    table!(
        "| budget | method | prefill t/s | decode t/s | × mmap | streamed MiB/token | bound t/s | of bound | wait ms/token | peak − base MiB | same tokens |"
    );
    table!("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    let f = |x: Option<f64>, p: usize| x.map_or("".to_string(), |v| format!("{v:.p$}"));
    table!(
        "| all resident | today's engine | {:.1} | {:.2} | | 0 | | | | {:.1} | |",
        reference.prefill_tokens_per_sec,
        reference.decode_tokens_per_sec,
        reference.peak_bytes as f64 / 1048576.0
    );
    for r in rows {
        table!(
            "| {}% | {} | {:.1} | {:.2} | {} | {:.1} | {} | {} | {:.1} | {:.1} | {} |",
            r.budget_percent,
            r.m.method,
            r.m.prefill_tokens_per_sec,
            r.m.decode_tokens_per_sec,
            f(r.vs_mmap, 2),
            r.m.streamed_bytes_per_token / 1048576.0,
            f(r.bound_tokens_per_sec, 1),
            f(r.of_bound, 2),
            r.m.wait_secs_per_token * 1e3,
            r.m.peak_bytes.saturating_sub(r.m.base_bytes) as f64 / 1048576.0,
            if r.same_tokens { "yes" } else { "NO" }
        );
    }
}

/// The weight options of a method (`None`: every weight resident).
fn method(name: &str, budget: Option<u64>, slots: usize) -> anyhow::Result<WeightOptions> {
    let (source, residency) = match name {
        "resident" => (WeightSource::Direct, Residency::Preserve),
        "mmap" => (WeightSource::Mmap, Residency::Stream),
        "stream" => (WeightSource::Direct, Residency::Stream),
        "inorder" => (WeightSource::Direct, Residency::InOrder),
        "balanced" => (WeightSource::Direct, Residency::Balanced),
        "preserve" => (WeightSource::Direct, Residency::Preserve),
        m => bail!("unknown method {m:?} (mmap, stream, inorder, balanced, preserve)"),
    };
    Ok(WeightOptions {
        budget: if name == "resident" { None } else { budget },
        residency,
        source,
        slots,
        read_bps: None,
    })
}

/// Creates the run's cgroups, runs the child in them, removes them.
fn spawn(mut s: Spec, n: usize, model: &Path, throttle: Option<u64>) -> anyhow::Result<Measured> {
    let tag = format!("llms-weights-{}-{n}", std::process::id());
    let mem = Path::new(MEMORY).join(&tag);
    std::fs::create_dir_all(&mem).with_context(|| {
        format!(
            "creating {} (needs root and the cgroup v1 memory controller)",
            mem.display()
        )
    })?;
    s.memory_cgroup = Some(mem.clone());
    let blk = if let Some(bps) = throttle {
        use std::os::unix::fs::MetadataExt;
        let dev = std::fs::metadata(model)?.dev();
        let (major, minor) = (nix::sys::stat::major(dev), nix::sys::stat::minor(dev));
        let dir = Path::new(BLKIO).join(&tag);
        std::fs::create_dir_all(&dir).with_context(|| {
            format!(
                "creating {} (needs the cgroup v1 blkio controller)",
                dir.display()
            )
        })?;
        std::fs::write(
            dir.join("blkio.throttle.read_bps_device"),
            format!("{major}:{minor} {bps}"),
        )
        .with_context(|| format!("throttling device {major}:{minor}"))?;
        s.blkio_cgroup = Some(dir.clone());
        Some(dir)
    } else {
        None
    };
    let method = s.method.clone();
    let out = Command::new(std::env::current_exe()?)
        .args(["bench", "weights", "--child", &serde_json::to_string(&s)?])
        .output()
        .context("cannot run the measurement's child process");
    let _ = std::fs::remove_dir(&mem);
    if let Some(d) = blk {
        let _ = std::fs::remove_dir(d);
    }
    let out = out?;
    if !out.status.success() {
        bail!(
            "{method} at {:?} bytes: the child failed ({}): {}",
            s.budget,
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let line = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(line.trim()).with_context(|| format!("bad child output {line:?}"))
}

fn cg_read(dir: &Path, file: &str) -> anyhow::Result<String> {
    std::fs::read_to_string(dir.join(file))
        .with_context(|| format!("reading {}", dir.join(file).display()))
}

fn cg_stat(dir: &Path, key: &str) -> anyhow::Result<u64> {
    cg_read(dir, "memory.stat")?
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())
        .with_context(|| format!("no {key} in memory.stat"))
}

/// Bytes read by this cgroup from any disk (blkio throttle counters).
fn blkio_read(dir: &Path) -> Option<u64> {
    let s = std::fs::read_to_string(dir.join("blkio.throttle.io_service_bytes")).ok()?;
    Some(
        s.lines()
            .filter_map(|l| {
                let mut w = l.split_whitespace();
                let (_, op, v) = (w.next()?, w.next()?, w.next()?);
                (op == "Read").then(|| v.parse::<u64>().ok()).flatten()
            })
            .sum(),
    )
}

/// One measurement, in this (child) process: it joins its cgroups, loads the model with the
/// method's options, warms up, prefills under the prefill's limit, and decodes under the
/// decode's, counting what the stream and the disk read.
fn child(s: &Spec) -> anyhow::Result<Measured> {
    let me = std::process::id().to_string();
    for dir in s.memory_cgroup.iter().chain(&s.blkio_cgroup) {
        std::fs::write(dir.join("cgroup.procs"), &me)
            .with_context(|| format!("joining {}", dir.display()))?;
    }
    init_threads(s.threads)?;
    let opts = method(&s.method, s.budget, s.slots)?;
    let t = Instant::now();
    let mut model = Model::load_with(&s.model, &opts)?;
    let load_secs = t.elapsed().as_secs_f64();
    if let Some(step) = s.prefill_chunk {
        model.prefill_chunk = step;
    }
    let format: model::kv::KvFormat = s.kv_format.parse()?;
    // Warm-up: the allocations of a run, and mmap's page cache as full as the budget lets it be.
    {
        let mut c = new_cache(&model, s, format);
        let l = model.forward(&mut c, &s.prompt, Logits::Last)?;
        decode(&model, &mut c, l, s.warmup)?;
    }
    let holding = model.holding();
    let held = model.weight_bytes() as u64 + holding.buffer_bytes;
    set_limit(s, held, PREFILL_SLACK)?;
    let mut c = new_cache(&model, s, format);
    let t = Instant::now();
    let logits = model.forward(&mut c, &s.prompt, Logits::Last)?;
    let prefill_secs = t.elapsed().as_secs_f64();
    let (base_bytes, limit_bytes) = set_limit(s, held, DECODE_SLACK)?;
    if let Some(dir) = &s.memory_cgroup {
        std::fs::write(dir.join("memory.max_usage_in_bytes"), "0")?;
    }
    let d = measure_decode(&model, s, &mut c, logits)?;
    let peak_bytes = match &s.memory_cgroup {
        Some(d) => cg_read(d, "memory.max_usage_in_bytes")?.trim().parse()?,
        None => 0,
    };
    let per = s.decode as f64;
    Ok(Measured {
        method: s.method.clone(),
        budget: s.budget,
        load_secs,
        prefill_tokens_per_sec: s.prompt.len() as f64 / prefill_secs,
        decode_tokens_per_sec: per / d.secs,
        tokens: d.tokens,
        streamed_bytes_per_token: d.streamed_bytes as f64 / per,
        wait_secs_per_token: d.wait_nanos as f64 / 1e9 / per,
        holding,
        base_bytes,
        limit_bytes,
        peak_bytes,
        disk_bytes_per_token: d.disk_bytes.map(|b| b as f64 / per),
    })
}

/// An empty KV cache of the spec's format for `model`.
fn new_cache(model: &Model, s: &Spec, format: model::kv::KvFormat) -> KvCache {
    KvCache::new(
        model.chunk_shape(s.chunk_tokens.unwrap_or_else(|| model.cfg.chunk_tokens())),
        format,
        model.cfg.max_ctx,
        Box::new(HeapChunks::default()),
    )
}

/// Decodes `n` greedy tokens from `logits` on.
fn decode(
    model: &Model,
    c: &mut KvCache,
    mut logits: Vec<f32>,
    n: usize,
) -> anyhow::Result<Vec<u32>> {
    let mut toks = Vec::with_capacity(n);
    for _ in 0..n {
        let t = argmax(&logits);
        toks.push(t);
        logits = model.forward(c, &[t], Logits::Last)?;
    }
    Ok(toks)
}

/// Sets the memory cgroup's limit: what the process holds besides weights (the cgroup's
/// anonymous memory minus the `held` weight bytes the engine holds), plus the budget, plus
/// `slack`; the page cache counts against it, so mmap's cached pages get the budget. Returns
/// that base and the limit (none without a budget; both 0 and none without a cgroup).
fn set_limit(s: &Spec, held: u64, slack: u64) -> anyhow::Result<(u64, Option<u64>)> {
    let Some(dir) = &s.memory_cgroup else {
        return Ok((0, None));
    };
    // Usage counts anonymous memory, page cache and kernel memory (page tables, slabs);
    // the page cache is what mmap's weights live in, so it is left out of the base.
    let usage: u64 = cg_read(dir, "memory.usage_in_bytes")?.trim().parse()?;
    let base = usage
        .saturating_sub(cg_stat(dir, "cache")?)
        .saturating_sub(held);
    let Some(budget) = s.budget else {
        return Ok((base, None));
    };
    let limit = base + budget + slack;
    std::fs::write(dir.join("memory.limit_in_bytes"), limit.to_string())
        .with_context(|| format!("limiting {} to {limit} bytes", dir.display()))?;
    Ok((base, Some(limit)))
}

/// What the measured decode did.
struct DecodeFigures {
    tokens: Vec<u32>,
    secs: f64,
    /// Bytes the weight stream read, and nanoseconds the compute waited for it.
    streamed_bytes: u64,
    wait_nanos: u64,
    /// Bytes the blkio cgroup read from the disk, when there is one.
    disk_bytes: Option<u64>,
}

/// The spec's decode after `logits`, timed, with the stream's and the disk's counters around it.
fn measure_decode(
    model: &Model,
    s: &Spec,
    c: &mut KvCache,
    logits: Vec<f32>,
) -> anyhow::Result<DecodeFigures> {
    let counters = model.stream_counters();
    let snap = || {
        counters.map_or((0, 0), |c| {
            (
                c.bytes_read.load(Ordering::Relaxed),
                c.wait_nanos.load(Ordering::Relaxed),
            )
        })
    };
    let disk0 = s.blkio_cgroup.as_deref().and_then(blkio_read);
    let (b0, w0) = snap();
    let t = Instant::now();
    let tokens = decode(model, c, logits, s.decode)?;
    let secs = t.elapsed().as_secs_f64();
    let (b1, w1) = snap();
    let disk1 = s.blkio_cgroup.as_deref().and_then(blkio_read);
    Ok(DecodeFigures {
        tokens,
        secs,
        streamed_bytes: b1 - b0,
        wait_nanos: w1 - w0,
        disk_bytes: disk0.zip(disk1).map(|(a, b)| b - a),
    })
}

/// Decode tokens/s against the budget (x: 0 to 100% of the weight bytes, a grid line every
/// 10%; y: 0 to the fastest, a grid line every 10 t/s), one line per method: mmap black, stream
/// blue, inorder magenta, balanced green, preserve red. The plot has no text (the workspace
/// builds plotters without a font backend).
fn plot_weights(path: &Path, rows: &[Row], methods: &[String]) -> anyhow::Result<()> {
    use plotters::prelude::*;
    let ymax = rows
        .iter()
        .map(|r| r.m.decode_tokens_per_sec)
        .fold(10.0f64, f64::max)
        * 1.05;
    let root = BitMapBackend::new(path, (960, 640)).into_drawing_area();
    let e = |e: DrawingAreaErrorKind<_>| anyhow::anyhow!("cannot draw {}: {e:?}", path.display());
    root.fill(&WHITE).map_err(e)?;
    let area = root.margin(20, 20, 20, 20);
    let mut chart = ChartBuilder::on(&area)
        .build_cartesian_2d(0.0f64..100.0, 0.0f64..ymax)
        .map_err(e)?;
    let grid = ShapeStyle::from(&BLACK.mix(0.15)).stroke_width(1);
    for x in (0..=100).step_by(10) {
        let x = f64::from(x);
        chart
            .draw_series(LineSeries::new([(x, 0.0), (x, ymax)], grid))
            .map_err(e)?;
    }
    let mut y = 0.0;
    while y <= ymax {
        chart
            .draw_series(LineSeries::new([(0.0, y), (100.0, y)], grid))
            .map_err(e)?;
        y += 10.0;
    }
    for m in methods {
        let c = match m.as_str() {
            "mmap" => BLACK,
            "stream" => BLUE,
            "inorder" => MAGENTA,
            "balanced" => GREEN,
            _ => RED,
        };
        let mut pts: Vec<(f64, f64)> = rows
            .iter()
            .filter(|r| &r.m.method == m)
            .map(|r| (f64::from(r.budget_percent), r.m.decode_tokens_per_sec))
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        chart
            .draw_series(LineSeries::new(pts.clone(), c.stroke_width(3)))
            .map_err(e)?;
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 5, c.filled())))
            .map_err(e)?;
    }
    root.present().map_err(e)?;
    Ok(())
}
