//! `llms eval ppl --kv-mix`: perplexity with the context's KV chunks compressed to a mix of
//! levels chosen by density rank (paper Fig. 6 and 12), through `engine::kv::eval`.

use std::time::Instant;

use anyhow::{Context, bail};
use engine::kv::KvFormat;
use engine::kv::eval::{Compression, evaluate};

use crate::engine_cmd::Loaded;
use crate::report::table;

/// Parses `8:4:2=PCT:PCT:PCT` (shares of chunks at int8, int4, int2, in percent),
/// `ratio=R` (the policy's assignment under global ratio R to int8) or a format name.
pub fn parse_mix(s: &str) -> anyhow::Result<Compression> {
    if let Some(r) = s.strip_prefix("ratio=") {
        let r: f64 = r
            .parse()
            .with_context(|| format!("bad ratio in --kv-mix {s:?}"))?;
        return Ok(Compression::Ratio(r));
    }
    if let Some(p) = s.strip_prefix("8:4:2=") {
        let parts: Vec<f64> = p
            .split(':')
            .map(str::parse)
            .collect::<Result<_, _>>()
            .with_context(|| format!("bad percentages in --kv-mix {s:?}"))?;
        let [a, b, c] = parts[..] else {
            bail!("--kv-mix {s:?} needs three percentages, as in 8:4:2=50:25:25");
        };
        return Ok(Compression::Fractions([a / 100.0, b / 100.0, c / 100.0]));
    }
    match s.parse::<KvFormat>() {
        Ok(f) => Ok(Compression::Uniform(f)),
        Err(_) => bail!("--kv-mix {s:?}: expected 8:4:2=PCT:PCT:PCT, ratio=R or a format name"),
    }
}

/// What every mix of one `llms eval ppl --kv-mix` run is scored on.
pub struct MixRun<'a> {
    pub text: &'a str,
    pub tokens: &'a [u32],
    pub ctx: usize,
    pub max_windows: usize,
    pub kl: bool,
}

/// One mix's scores.
#[derive(serde::Serialize)]
struct MixResult {
    kv_mix: String,
    ppl: f64,
    /// Nominal bits per value (payload only).
    bits_per_value: f64,
    /// All-in stored bits per value: payload, parameters, kvfs header amortized.
    stored_bits: f64,
    kl: Option<f64>,
    top1: Option<f64>,
}

#[derive(serde::Serialize)]
struct MixReport<'a> {
    text: &'a str,
    ctx: usize,
    windows: usize,
    scored_tokens: usize,
    seconds: f64,
    runs: Vec<MixResult>,
}

/// Scores the text in windows of `ctx` whose first halves are compressed as each of `mixes`
/// says, all on the same windows (and, with `kl`, against one f16 run per window).
pub fn run(
    l: &Loaded,
    r: &MixRun<'_>,
    mixes: &[String],
    report: &crate::report::ReportArgs,
) -> anyhow::Result<()> {
    let compressions: Vec<Compression> = mixes
        .iter()
        .map(|m| parse_mix(m))
        .collect::<anyhow::Result<_>>()?;
    let ctx = r.ctx;
    let mut windows = r.tokens.len() / ctx.max(1);
    if r.max_windows > 0 {
        windows = windows.min(r.max_windows);
    }
    let t = Instant::now();
    let scores = evaluate(
        &l.model,
        &r.tokens[..windows * ctx],
        &compressions,
        ctx,
        r.kl,
    )
    .with_context(|| format!("perplexity under --kv-mix {}", mixes.join(",")))?;
    let runs: Vec<MixResult> = mixes
        .iter()
        .zip(&scores)
        .map(|(m, s)| MixResult {
            kv_mix: m.clone(),
            ppl: s.ppl,
            bits_per_value: s.bits_per_value,
            stored_bits: s.stored_bits,
            kl: s.kl,
            top1: s.top1,
        })
        .collect();
    let out = MixReport {
        text: r.text,
        ctx,
        windows,
        scored_tokens: scores.first().map_or(0, |s| s.tokens),
        seconds: t.elapsed().as_secs_f64(),
        runs,
    };
    table!(
        "{} at ctx {ctx}: {windows} windows, {} scored tokens",
        out.text,
        out.scored_tokens
    );
    table!(
        "{:<24} {:>9} {:>12} {:>10} {:>10}",
        "kv",
        "ppl",
        "stored b/v",
        "KL",
        "top-1"
    );
    let opt = |x: Option<f64>, digits: usize| x.map_or("-".into(), |x| format!("{x:.digits$}"));
    for m in &out.runs {
        table!(
            "{:<24} {:>9.4} {:>12.3} {:>10} {:>10}",
            m.kv_mix,
            m.ppl,
            m.stored_bits,
            opt(m.kl, 5),
            opt(m.top1.map(|t| t * 100.0), 2)
        );
    }
    report.write("ppl", &out)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mixes_parse() {
        let ok = |s: &str, want: Compression| assert_eq!(parse_mix(s).unwrap(), want, "{s}");
        ok("8:4:2=50:25:25", Compression::Fractions([0.5, 0.25, 0.25]));
        ok("ratio=0.5", Compression::Ratio(0.5));
        ok("int4", Compression::Uniform(KvFormat::Int4));
        for bad in ["8:4:2=50:50", "ratio=half", "int3", "8:4:2=a:b:c"] {
            assert!(parse_mix(bad).is_err(), "{bad}");
        }
    }
}
