//! `llms eval ppl --kv-mix`: perplexity with the context's KV chunks compressed to a mix of
//! levels chosen by density rank (paper Fig. 6 and 12), through `engine::kv::eval`.

use std::time::Instant;

use anyhow::{Context, bail};
use engine::kv::KvFormat;
use engine::kv::eval::{Compression, perplexity};

use crate::engine_cmd::Loaded;

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

#[derive(serde::Serialize)]
struct MixResult<'a> {
    text: &'a str,
    kv_mix: &'a str,
    ctx: usize,
    scored_tokens: usize,
    ppl: f64,
    bits_per_value: f64,
    bits_with_params: f64,
    seconds: f64,
}

/// Scores `tokens` in windows of `ctx` whose first halves are compressed as `mix` says.
pub fn run(
    l: &Loaded,
    text: &str,
    tokens: &[u32],
    mix: &str,
    ctx: usize,
    max_windows: usize,
) -> anyhow::Result<()> {
    let compression = parse_mix(mix)?;
    let mut n = tokens.len() / ctx.max(1) * ctx;
    if max_windows > 0 {
        n = n.min(max_windows * ctx);
    }
    let t = Instant::now();
    let r = perplexity(&l.model, &tokens[..n], compression, ctx)
        .with_context(|| format!("perplexity under --kv-mix {mix}"))?;
    let out = MixResult {
        text,
        kv_mix: mix,
        ctx,
        scored_tokens: r.tokens,
        ppl: r.ppl,
        bits_per_value: r.bits_per_value,
        bits_with_params: r.bits_with_params,
        seconds: t.elapsed().as_secs_f64(),
    };
    println!("{}", serde_json::to_string(&out)?);
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
