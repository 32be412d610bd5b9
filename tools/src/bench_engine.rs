//! `llms bench engine`: prefill and decode speed of the engine and the memory it holds.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use engine::model::Logits;
use engine::model::generate::argmax;

use crate::engine_cmd::{EngineOpts, load};

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
    /// Prompt lengths to prefill
    #[arg(long, value_delimiter = ',', default_values_t = [128usize, 512, 2048])]
    pub prefill: Vec<usize>,
    /// Prompt length before decoding
    #[arg(long, default_value_t = 512)]
    pub decode_after: usize,
    /// Tokens to decode
    #[arg(long, default_value_t = 128)]
    pub decode: usize,
    /// Runs of each measurement; the median is reported
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Where the JSON report goes
    #[arg(long, default_value = "bench-out/engine.json", value_name = "FILE")]
    pub out: PathBuf,
}

#[derive(serde::Serialize)]
struct Report {
    model: String,
    threads: usize,
    kv_format: String,
    prefill_chunk: usize,
    runs: usize,
    prefill: Vec<Row>,
    decode: Row,
    weight_bytes: usize,
    kv_bytes_after_decode: usize,
    kv_bytes_per_token: f64,
    rss_bytes: usize,
}

#[derive(serde::Serialize)]
struct Row {
    tokens: usize,
    median_secs: f64,
    tokens_per_sec: f64,
    all_secs: Vec<f64>,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Resident set size of this process, from /proc/self/status.
pub fn rss_bytes() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<usize>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// Runs `llms bench engine`.
pub fn run(a: BenchEngineArgs) -> anyhow::Result<()> {
    let l = load(&a.engine)?;
    let runs = a.runs.max(1);
    let text = std::fs::read_to_string(&a.text)
        .with_context(|| format!("cannot read {}", a.text.display()))?;
    let base = l.tokenizer.encode(&text);
    anyhow::ensure!(!base.is_empty(), "{} has no tokens", a.text.display());
    let need = a
        .prefill
        .iter()
        .copied()
        .max()
        .unwrap_or(0)
        .max(a.decode_after);
    let tokens: Vec<u32> = base.iter().copied().cycle().take(need).collect();
    let threads = rayon::current_num_threads();
    eprintln!(
        "bench engine: {} threads, kv {}, prefill chunk {}, {runs} runs each",
        threads, l.format, l.model.prefill_chunk
    );
    let mut prefill = Vec::new();
    for &n in &a.prefill {
        let mut secs = Vec::new();
        for _ in 0..runs {
            let mut cache = l.new_cache();
            let t = Instant::now();
            l.model.forward(&mut cache, &tokens[..n], Logits::Last)?;
            secs.push(t.elapsed().as_secs_f64());
        }
        let m = median(&mut secs);
        eprintln!("  prefill {n:>5} tokens: {:>8.1} t/s", n as f64 / m);
        prefill.push(Row {
            tokens: n,
            median_secs: m,
            tokens_per_sec: n as f64 / m,
            all_secs: secs,
        });
    }
    let mut secs = Vec::new();
    let mut kv_bytes = 0;
    for _ in 0..runs {
        let mut cache = l.new_cache();
        let mut logits = l
            .model
            .forward(&mut cache, &tokens[..a.decode_after], Logits::Last)?;
        let t = Instant::now();
        for _ in 0..a.decode {
            let next = argmax(&logits);
            logits = l.model.forward(&mut cache, &[next], Logits::Last)?;
        }
        secs.push(t.elapsed().as_secs_f64());
        kv_bytes = cache.resident_bytes();
    }
    let m = median(&mut secs);
    eprintln!(
        "  decode  {:>5} tokens after {}: {:>8.1} t/s",
        a.decode,
        a.decode_after,
        a.decode as f64 / m
    );
    let report = Report {
        model: l.model.path().display().to_string(),
        threads,
        kv_format: l.format.to_string(),
        prefill_chunk: l.model.prefill_chunk,
        runs,
        prefill,
        decode: Row {
            tokens: a.decode,
            median_secs: m,
            tokens_per_sec: a.decode as f64 / m,
            all_secs: secs,
        },
        weight_bytes: l.model.weight_bytes(),
        kv_bytes_after_decode: kv_bytes,
        kv_bytes_per_token: kv_bytes as f64 / (a.decode_after + a.decode) as f64,
        rss_bytes: rss_bytes(),
    };
    println!("| phase | tokens | median s | tokens/s |");
    println!("|---|---:|---:|---:|");
    for r in &report.prefill {
        println!(
            "| prefill | {} | {:.3} | {:.1} |",
            r.tokens, r.median_secs, r.tokens_per_sec
        );
    }
    println!(
        "| decode after {} | {} | {:.3} | {:.1} |",
        a.decode_after,
        report.decode.tokens,
        report.decode.median_secs,
        report.decode.tokens_per_sec
    );
    println!(
        "\nweights {:.1} MiB, KV {:.2} MiB for {} tokens ({:.0} bytes/token), process RSS {:.1} MiB",
        report.weight_bytes as f64 / 1048576.0,
        kv_bytes as f64 / 1048576.0,
        a.decode_after + a.decode,
        report.kv_bytes_per_token,
        report.rss_bytes as f64 / 1048576.0
    );
    if let Some(dir) = a.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    std::fs::write(&a.out, serde_json::to_string_pretty(&report)?)
        .with_context(|| format!("cannot write {}", a.out.display()))?;
    eprintln!("wrote {}", a.out.display());
    Ok(())
}
