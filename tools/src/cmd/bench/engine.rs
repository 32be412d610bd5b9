//! `llms bench engine`: prefill and decode speed of the engine and the memory it holds.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use model::Logits;
use model::generate::argmax;
use uffd_pager::median;

use crate::args::{EngineOpts, Loaded, load};
use crate::report::table;

/// `llms bench engine`.
#[derive(Args, Debug)]
pub struct BenchEngineArgs {
    #[command(flatten)]
    pub engine: EngineOpts,
    /// Real text the prompts are cut from
    #[arg(
        long,
        default_value = "/usr/share/common-licenses/GPL-3",
        value_name = "FILE"
    )]
    pub text: PathBuf,
    #[command(flatten)]
    pub report: crate::report::ReportArgs,
    /// Prompt lengths to prefill (1 to the model's context length)
    #[arg(long, value_delimiter = ',', default_values_t = [128usize, 512, 2048], value_parser = crate::report::positive)]
    pub prefill: Vec<usize>,
    /// Context depths (prompt lengths) to decode after
    #[arg(long, value_delimiter = ',', default_values_t = [0usize, 512, 2048])]
    pub decode_at: Vec<usize>,
    /// Tokens to decode at each depth (depth + tokens at most the model's context length)
    #[arg(long, default_value_t = 128, value_parser = crate::report::positive)]
    pub decode: usize,
    /// Tokens per measured step of each prefill: the prompt goes in as forward passes of this
    /// many tokens, each timed, so a long prompt shows its speed falling with depth (0: one pass)
    #[arg(long, default_value_t = 0, value_name = "TOKENS")]
    pub prefill_step: usize,
    /// Tokens of a short prompt prefilled after each decode (at depth --decode-at plus
    /// --decode), as a call on a long context does (0: none)
    #[arg(long, default_value_t = 0, value_name = "TOKENS")]
    pub append: usize,
    /// Runs of each measurement; the median is reported
    #[arg(long, default_value_t = 3, value_parser = crate::report::positive)]
    pub runs: usize,
}

#[derive(serde::Serialize)]
struct Report {
    model: String,
    threads: usize,
    kv_format: String,
    prefill_chunk: usize,
    runs: usize,
    kernels: String,
    /// The kernel each product ran on (`model::chosen`, within `LLMS_ISA`).
    chosen_kernels: Vec<model::chosen::Chosen>,
    prefill: Vec<Row>,
    decode: Vec<DecodeRow>,
    weight_bytes: usize,
    file_tensor_bytes: usize,
    decode_weight_bytes: usize,
    read_bandwidth_bytes_per_sec: f64,
    rss_bytes: usize,
    peak_rss_bytes: usize,
}

#[derive(serde::Serialize)]
struct DecodeRow {
    depth: usize,
    #[serde(flatten)]
    row: Row,
    /// KV bytes resident after the decode (read once per token, more or less).
    kv_bytes: usize,
    /// Weights + KV at the middle of the decode, bytes read per token.
    bytes_per_token: f64,
    /// Tokens/s if every token only had to read its bytes at the measured bandwidth.
    bandwidth_bound_tokens_per_sec: f64,
    /// Measured over bound.
    bandwidth_ratio: f64,
    /// --append tokens prefilled after the decode, at depth `depth + tokens`.
    #[serde(skip_serializing_if = "Option::is_none")]
    append: Option<Row>,
}

#[derive(serde::Serialize)]
struct Row {
    tokens: usize,
    median_secs: f64,
    tokens_per_sec: f64,
    all_secs: Vec<f64>,
    /// With --prefill-step: each step's tokens/s (the median over the runs), in order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    steps_tokens_per_sec: Vec<f64>,
}

impl Row {
    fn of(tokens: usize, all_secs: Vec<f64>) -> Row {
        let m = median(all_secs.iter().copied());
        Row {
            tokens,
            median_secs: m,
            tokens_per_sec: tokens as f64 / m,
            all_secs,
            steps_tokens_per_sec: Vec::new(),
        }
    }
}

/// Resident set size of this process, from /proc/self/status.
pub fn rss_bytes() -> usize {
    status_kb("VmRSS:")
}

/// Peak resident set size of this process (the kernel's high-water mark).
pub fn peak_rss_bytes() -> usize {
    status_kb("VmHWM:")
}

fn status_kb(key: &str) -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<usize>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// Read bandwidth of the decode weights: the fastest of `runs` (at least five) passes over
/// them. A bound is what the memory can deliver; on a shared machine a median pass can fall
/// in a slow moment and put the bound below the decode measured next (117% of it in one run).
fn read_bandwidth(model: &model::Model, runs: usize) -> f64 {
    let bytes = model.decode_weight_bytes() as f64;
    let fastest = (0..runs.max(5))
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(model.stream_weights());
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min);
    bytes / fastest
}

/// Runs `llms bench engine`: prefill at each length, the read bandwidth over the decode
/// weights, decode at each depth against its bandwidth bound; a table and JSON.
pub fn run(a: BenchEngineArgs) -> anyhow::Result<()> {
    a.report.begin();
    let l = load(&a.engine)?;
    // No timed run shares the cores with the copy of the weights into huge pages.
    l.model.settle_huge_pages();
    check_lengths(&a, l.model.cfg.max_ctx)?;
    let tokens = bench_tokens(&a, &l)?;
    let threads = rayon::current_num_threads();
    let kernels = kernels(&l.model);
    eprintln!(
        "bench engine: {} threads, kernels {kernels}, kv {}, prefill chunk {}, {} runs each",
        threads, l.format, l.model.prefill_chunk, a.runs
    );
    let chosen_kernels =
        model::chosen::engine(l.model.activations(), l.model.prefill_activations());
    for c in &chosen_kernels {
        eprintln!("  kernel: {}: {}", c.product, c.kernel);
    }
    let prefill = measure_prefill(&a, &l, &tokens)?;
    let bandwidth = read_bandwidth(&l.model, a.runs);
    eprintln!(
        "  read bandwidth over the decode weights ({:.1} MiB): {:.2} GB/s",
        l.model.decode_weight_bytes() as f64 / 1048576.0,
        bandwidth / 1e9
    );
    let decode = a
        .decode_at
        .iter()
        .map(|&depth| measure_decode(&a, &l, &tokens, depth, bandwidth))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let report = Report {
        model: l.model.path().display().to_string(),
        threads,
        kv_format: l.format.to_string(),
        prefill_chunk: l.model.prefill_chunk,
        runs: a.runs,
        kernels,
        chosen_kernels,
        prefill,
        decode,
        weight_bytes: l.model.weight_bytes(),
        file_tensor_bytes: l.model.file_tensor_bytes(),
        decode_weight_bytes: l.model.decode_weight_bytes(),
        read_bandwidth_bytes_per_sec: bandwidth,
        rss_bytes: rss_bytes(),
        peak_rss_bytes: peak_rss_bytes(),
    };
    print_table(&report);
    a.report.write("engine", &report)?;
    Ok(())
}

/// Every prefill length, and every decode depth with its tokens, must fit the model's context.
fn check_lengths(a: &BenchEngineArgs, max_ctx: usize) -> anyhow::Result<()> {
    if let Some(n) = a.prefill.iter().find(|&&n| n > max_ctx) {
        anyhow::bail!("--prefill {n} is longer than the model's context of {max_ctx} tokens");
    }
    if let Some(d) = a
        .decode_at
        .iter()
        .find(|&&d| start_depth(d) + a.decode + a.append > max_ctx)
    {
        anyhow::bail!(
            "--decode-at {d} plus --decode {} and --append {} is longer than the model's context of {max_ctx} tokens",
            a.decode,
            a.append
        );
    }
    Ok(())
}

/// The text's tokens, repeated to one more than the longest prefill or depth.
fn bench_tokens(a: &BenchEngineArgs, l: &Loaded) -> anyhow::Result<Vec<u32>> {
    let text = std::fs::read_to_string(&a.text)
        .with_context(|| format!("cannot read {}", a.text.display()))?;
    let base = l.tokenizer.encode(&text);
    anyhow::ensure!(!base.is_empty(), "{} has no tokens", a.text.display());
    let need = a
        .prefill
        .iter()
        .chain(&a.decode_at)
        .copied()
        .max()
        .unwrap_or(0)
        + 1;
    Ok(base.iter().copied().cycle().take(need).collect())
}

/// The kernels in use: the decode's instruction set and activations, and the prefill's
/// activations (with the int8 path's kernels).
fn kernels(model: &model::Model) -> String {
    let decode = format!("{:?}", model.activations()).to_lowercase();
    format!(
        "{:?}, decode {decode}, prefill {}",
        model::qmatrix::Isa::best(),
        match model.prefill_activations() {
            model::int8gemm::PrefillActs::Int8 => {
                format!("int8 ({:?})", model::int8gemm::Path::best())
            }
            _ => "f32".to_owned(),
        }
    )
}

/// Each --prefill length into a fresh cache, --runs times, in steps of --prefill-step tokens
/// (each step timed); the medians.
fn measure_prefill(a: &BenchEngineArgs, l: &Loaded, tokens: &[u32]) -> anyhow::Result<Vec<Row>> {
    let mut prefill = Vec::new();
    for &n in &a.prefill {
        let step = if a.prefill_step == 0 {
            n
        } else {
            a.prefill_step
        };
        let mut secs = Vec::new();
        let mut steps: Vec<Vec<f64>> = Vec::new();
        for _ in 0..a.runs {
            let mut cache = l.new_cache();
            let mut each = Vec::new();
            for piece in tokens[..n].chunks(step) {
                let t = Instant::now();
                l.model.forward(&mut cache, piece, Logits::Last)?;
                each.push(t.elapsed().as_secs_f64());
            }
            secs.push(each.iter().sum());
            steps.push(each);
        }
        let mut row = Row::of(n, secs);
        eprintln!("  prefill {n:>5} tokens: {:>8.1} t/s", row.tokens_per_sec);
        if step < n {
            for (i, piece) in tokens[..n].chunks(step).enumerate() {
                let tps = piece.len() as f64 / median(steps.iter().map(|e| e[i]));
                eprintln!(
                    "    tokens {:>5}..{:<5} {tps:>8.1} t/s",
                    i * step,
                    i * step + piece.len()
                );
                row.steps_tokens_per_sec.push(tps);
            }
        }
        prefill.push(row);
    }
    Ok(prefill)
}

/// --decode tokens after a prefill of `depth` of `tokens`, --runs times; the median against
/// the bound of reading the decode weights and the KV at `bandwidth`.
fn measure_decode(
    a: &BenchEngineArgs,
    l: &Loaded,
    tokens: &[u32],
    depth: usize,
    bandwidth: f64,
) -> anyhow::Result<DecodeRow> {
    let mut secs = Vec::new();
    let mut append = Vec::new();
    let mut kv_bytes = 0;
    for _ in 0..a.runs {
        let mut cache = l.new_cache();
        let start = start_depth(depth);
        let mut logits = l
            .model
            .forward(&mut cache, &tokens[..start], Logits::Last)?;
        let t = Instant::now();
        for _ in 0..a.decode {
            let next = argmax(&logits);
            logits = l.model.forward(&mut cache, &[next], Logits::Last)?;
        }
        secs.push(t.elapsed().as_secs_f64());
        kv_bytes = cache.resident_bytes();
        if a.append > 0 {
            let t = Instant::now();
            l.model
                .forward(&mut cache, &tokens[..a.append], Logits::Last)?;
            append.push(t.elapsed().as_secs_f64());
        }
    }
    let m = median(secs.iter().copied());
    let tps = a.decode as f64 / m;
    let append = (a.append > 0).then(|| Row::of(a.append, append));
    // The KV read per token grows from the depth to the end; take its middle.
    let kv_per_token = kv_bytes as f64 / (depth.max(1) + a.decode) as f64;
    let weights_read = l.model.decode_weight_bytes() as f64;
    let per_token = weights_read + kv_per_token * (depth as f64 + a.decode as f64 / 2.0);
    let bound = bandwidth / per_token;
    eprintln!(
        "  decode  {:>5} tokens at depth {depth:>5}: {tps:>8.1} t/s ({:.0}% of the bandwidth bound {bound:.1})",
        a.decode,
        100.0 * tps / bound
    );
    if let Some(r) = &append {
        eprintln!(
            "  append  {:>5} tokens at depth {:>5}: {:>8.1} t/s ({:.1} ms)",
            r.tokens,
            start_depth(depth) + a.decode,
            r.tokens_per_sec,
            r.median_secs * 1e3
        );
    }
    Ok(DecodeRow {
        depth,
        row: Row::of(a.decode, secs),
        append,
        kv_bytes,
        bytes_per_token: per_token,
        bandwidth_bound_tokens_per_sec: bound,
        bandwidth_ratio: tps / bound,
    })
}

/// The tokens a decode at `depth` starts after: one at depth 0.
fn start_depth(depth: usize) -> usize {
    depth.max(1)
}

/// The report's table: a row per prefill and decode, then the weights and memory.
fn print_table(report: &Report) {
    table!("| phase | tokens | median s | tokens/s | bandwidth bound | ratio |");
    table!("|---|---:|---:|---:|---:|---:|");
    for r in &report.prefill {
        table!(
            "| prefill | {} | {:.3} | {:.1} | | |",
            r.tokens,
            r.median_secs,
            r.tokens_per_sec
        );
    }
    for d in &report.decode {
        table!(
            "| decode at {} | {} | {:.3} | {:.1} | {:.1} | {:.2} |",
            d.depth,
            d.row.tokens,
            d.row.median_secs,
            d.row.tokens_per_sec,
            d.bandwidth_bound_tokens_per_sec,
            d.bandwidth_ratio
        );
        if let Some(r) = &d.append {
            table!(
                "| append at {} | {} | {:.3} | {:.1} | | |",
                start_depth(d.depth) + d.row.tokens,
                r.tokens,
                r.median_secs,
                r.tokens_per_sec
            );
        }
    }
    table!(
        "\nweights {:.1} MiB ({:.3}× the file's {:.1} MiB of tensors), read bandwidth {:.2} GB/s, RSS {:.1} MiB, peak RSS {:.1} MiB",
        report.weight_bytes as f64 / 1048576.0,
        report.weight_bytes as f64 / report.file_tensor_bytes as f64,
        report.file_tensor_bytes as f64 / 1048576.0,
        report.read_bandwidth_bytes_per_sec / 1e9,
        report.rss_bytes as f64 / 1048576.0,
        report.peak_rss_bytes as f64 / 1048576.0
    );
}
