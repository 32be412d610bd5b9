//! `llms eval ppl --kv-mix`: perplexity with the context's KV chunks compressed to a mix of
//! levels chosen by density rank (paper Fig. 6 and 12), through `model::kv::eval`.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};
use model::kv::KvFormat;
use model::kv::eval::{Compression, MAX_MIX_LEVELS, PplReport, Scoring, Stored, evaluate};
use model::kv::sim::SimFormat;

use crate::args::Loaded;
use crate::report::table;

/// One level of a budget mix: a format name or a simulated candidate (`k4+v4+kc8`, ...).
fn parse_level(s: &str) -> anyhow::Result<Stored> {
    match s.parse::<KvFormat>() {
        Ok(f) => Ok(Stored::Real(f)),
        Err(_) => Ok(Stored::Sim(s.parse::<SimFormat>()?)),
    }
}

/// Parses `8:4:2=PCT:PCT:PCT` (shares of chunks at int8, int4, int2, in percent),
/// `ratio=R` (the policy's assignment under global ratio R to int8), `sim:SPEC` (a simulated
/// candidate format, `model::kv::sim`), `mix:L/L/L@BITS` (levels, heaviest first, assigned by
/// density under a budget of all-in stored bits per value), `llms` (the service's default mix:
/// `mix:k8v8/k4v4/k4v3@4.5`) or a format name.
pub fn parse_mix(s: &str) -> anyhow::Result<Compression> {
    if s == "llms" {
        let [a, b, c] = KvFormat::CODED.map(|f| Some(Stored::Real(f)));
        return Ok(Compression::Budget {
            levels: [a, b, c, None],
            bits: service::DEFAULT_KV_BITS,
        });
    }
    if let Some(spec) = s.strip_prefix("sim:") {
        return Ok(Compression::Sim(spec.parse()?));
    }
    if let Some(m) = s.strip_prefix("mix:") {
        let Some((levels, bits)) = m.split_once('@') else {
            bail!("--kv-mix {s:?} needs a budget, as in mix:int8/int4/int2@4.5");
        };
        let bits: f64 = bits
            .parse()
            .with_context(|| format!("bad budget in --kv-mix {s:?}"))?;
        let parsed: Vec<Stored> = levels
            .split('/')
            .map(parse_level)
            .collect::<anyhow::Result<_>>()?;
        if parsed.len() > MAX_MIX_LEVELS {
            bail!("--kv-mix {s:?} has more than {MAX_MIX_LEVELS} levels");
        }
        let mut levels = [None; MAX_MIX_LEVELS];
        for (l, p) in levels.iter_mut().zip(parsed) {
            *l = Some(p);
        }
        return Ok(Compression::Budget { levels, bits });
    }
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
        Err(_) => bail!(
            "--kv-mix {s:?}: expected 8:4:2=PCT:PCT:PCT, ratio=R, sim:SPEC, mix:L/L/L@BITS, llms or a format name"
        ),
    }
}

/// What every mix of one `llms eval ppl --kv-mix` run is scored on.
pub struct MixRun<'a> {
    pub text: &'a str,
    pub tokens: &'a [u32],
    pub ctx: usize,
    pub max_windows: usize,
    /// Score KL and top-1 against this model's f16 run (the evaluated model, or the same
    /// weights with other prefill activations).
    pub kl: Option<&'a model::Model>,
    /// How the scored halves are run: batched, or token by token through decode attention.
    pub scoring: Scoring,
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
    /// How the scored halves ran: `batched` or `decode` (token by token).
    scoring: &'static str,
    ctx: usize,
    windows: usize,
    scored_tokens: usize,
    seconds: f64,
    runs: Vec<MixResult>,
}

/// Scores the text in windows of `ctx` whose first halves are compressed as each of `mixes`
/// says, all on the same windows (and, with `kl`, against one f16 run per window of that model).
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
        l.chunk_tokens,
        r.kl,
        r.scoring,
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
        scoring: r.scoring.name(),
        ctx,
        windows,
        scored_tokens: scores.first().map_or(0, |s| s.tokens),
        seconds: t.elapsed().as_secs_f64(),
        runs,
    };
    table!(
        "{} at ctx {ctx}: {windows} windows, {} scored tokens ({})",
        out.text,
        out.scored_tokens,
        out.scoring
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

/// `llms eval sweep`.
#[derive(clap::Args, Debug)]
pub struct SweepArgs {
    #[command(flatten)]
    pub engine: crate::args::EngineOpts,
    /// The text to score (UTF-8)
    #[arg(long, value_name = "FILE")]
    pub text: PathBuf,
    /// Window lengths; each window's first half is compressed, its second scored
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "512,2048",
        value_name = "N"
    )]
    pub ctx: Vec<usize>,
    /// Score at most this many windows per length (0: all)
    #[arg(long, default_value_t = 4, value_name = "N")]
    pub max_windows: usize,
    /// The formats and mixes (as `llms eval ppl --kv-mix`)
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "MIX",
        default_value = "f16,int8,int4,int2,8:4:2=25:50:25,ratio=0.5"
    )]
    pub kv_mix: Vec<String>,
    #[command(flatten)]
    pub report: crate::report::ReportArgs,
}

#[derive(serde::Serialize)]
struct SweepRow {
    ctx: usize,
    kv_mix: String,
    stored_bits: f64,
    ppl: f64,
    /// ppl over the f16 run's on the same windows.
    ppl_vs_f16: f64,
    /// ppl over the int8 run's on the same windows.
    ppl_vs_int8: f64,
    kl: f64,
    top1: f64,
}

#[derive(serde::Serialize)]
struct SweepReport<'a> {
    text: &'a str,
    windows: usize,
    rows: Vec<SweepRow>,
    plot: String,
}

/// Runs `llms eval sweep`: every mix with KL at every window length, a table, its JSON and a
/// PNG of perplexity (relative to f16) against all-in stored bits per value.
pub fn sweep(a: SweepArgs) -> anyhow::Result<()> {
    a.report.begin();
    let l = crate::args::load(&a.engine)?;
    let body = std::fs::read_to_string(&a.text)
        .with_context(|| format!("cannot read {} as UTF-8 text", a.text.display()))?;
    let tokens = l.tokenizer.encode(&body);
    let mut mixes = a.kv_mix.clone();
    for need in ["int8", "f16"] {
        if !mixes.iter().any(|m| m == need) {
            mixes.insert(0, need.into());
        }
    }
    let compressions: Vec<Compression> = mixes
        .iter()
        .map(|m| parse_mix(m))
        .collect::<anyhow::Result<_>>()?;
    let text = a.text.display().to_string();
    let mut rows = Vec::new();
    for &ctx in &a.ctx {
        let mut n = tokens.len() / ctx.max(1);
        if a.max_windows > 0 {
            n = n.min(a.max_windows);
        }
        anyhow::ensure!(n > 0, "{text} has fewer than {ctx} tokens");
        let t = Instant::now();
        let r: Vec<PplReport> = evaluate(
            &l.model,
            &tokens[..n * ctx],
            &compressions,
            ctx,
            l.chunk_tokens,
            Some(&l.model),
            Scoring::Batched,
        )
        .with_context(|| format!("sweep at ctx {ctx}"))?;
        let at = |name: &str| r[mixes.iter().position(|m| m == name).unwrap_or(0)].ppl;
        let (f16, int8) = (at("f16"), at("int8"));
        eprintln!(
            "ctx {ctx}: {n} windows, {} scored tokens each, {:.0} s",
            r[0].tokens,
            t.elapsed().as_secs_f64()
        );
        for (m, s) in mixes.iter().zip(&r) {
            rows.push(SweepRow {
                ctx,
                kv_mix: m.clone(),
                stored_bits: s.stored_bits,
                ppl: s.ppl,
                ppl_vs_f16: s.ppl / f16,
                ppl_vs_int8: s.ppl / int8,
                kl: s.kl.unwrap_or(0.0),
                top1: s.top1.unwrap_or(1.0),
            });
        }
    }
    table!("| ctx | KV | stored bits/value | ppl | vs f16 | vs int8 | KL | top-1 |");
    table!("|---|---|---|---|---|---|---|---|");
    for r in &rows {
        table!(
            "| {} | `{}` | {:.3} | {:.4} | {:+.2}% | {:+.2}% | {:.5} | {:.2}% |",
            r.ctx,
            r.kv_mix,
            r.stored_bits,
            r.ppl,
            (r.ppl_vs_f16 - 1.0) * 100.0,
            (r.ppl_vs_int8 - 1.0) * 100.0,
            r.kl,
            r.top1 * 100.0
        );
    }
    std::fs::create_dir_all(&a.report.out)
        .with_context(|| format!("cannot create {}", a.report.out.display()))?;
    let plot = a.report.out.join("sweep.png");
    plot_sweep(&plot, &rows, &a.ctx)?;
    let out = SweepReport {
        text: &text,
        windows: a.max_windows,
        rows,
        plot: plot.display().to_string(),
    };
    a.report.write("sweep", &out)?;
    eprintln!("wrote {}", plot.display());
    Ok(())
}

/// Perplexity relative to f16 against all-in stored bits per value, one colour per window
/// length (blue the first, red the second, ...), points joined in order of bits. The plot has no
/// text (the workspace builds plotters without a font backend): x runs from 2 to 17 bits with a
/// grid line every bit, y from 0.99 to the largest ratio with a line every 1%.
fn plot_sweep(path: &std::path::Path, rows: &[SweepRow], ctxs: &[usize]) -> anyhow::Result<()> {
    use plotters::prelude::*;
    let ymax = rows
        .iter()
        .map(|r| r.ppl_vs_f16)
        .fold(1.02f64, f64::max)
        .min(1.5);
    let root = BitMapBackend::new(path, (960, 640)).into_drawing_area();
    let e = |e: DrawingAreaErrorKind<_>| anyhow::anyhow!("cannot draw {}: {e:?}", path.display());
    root.fill(&WHITE).map_err(e)?;
    let area = root.margin(20, 20, 20, 20);
    let mut chart = ChartBuilder::on(&area)
        .build_cartesian_2d(2.0f64..17.0, 0.99f64..ymax)
        .map_err(e)?;
    let grid = |x: f64| ShapeStyle::from(&BLACK.mix(x)).stroke_width(1);
    for b in 2..=17 {
        let b = f64::from(b);
        chart
            .draw_series(LineSeries::new([(b, 0.99), (b, ymax)], grid(0.15)))
            .map_err(e)?;
    }
    let mut y = 0.99;
    while y <= ymax {
        let s = if (y - 1.0f64).abs() < 1e-9 {
            grid(0.6)
        } else {
            grid(0.15)
        };
        chart
            .draw_series(LineSeries::new([(2.0, y), (17.0, y)], s))
            .map_err(e)?;
        y += 0.01;
    }
    let colours = [BLUE, RED, GREEN, MAGENTA, CYAN];
    for (i, &ctx) in ctxs.iter().enumerate() {
        let c = colours[i % colours.len()];
        let mut pts: Vec<(f64, f64)> = rows
            .iter()
            .filter(|r| r.ctx == ctx)
            .map(|r| (r.stored_bits.min(17.0), r.ppl_vs_f16.min(ymax)))
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 5, c.filled())))
            .map_err(e)?;
    }
    root.present().map_err(e)?;
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
        ok("k4v3", Compression::Uniform(KvFormat::K4v3));
        let coded = |f| Some(Stored::Real(f));
        let service = Compression::Budget {
            levels: [
                coded(KvFormat::K8v8),
                coded(KvFormat::K4v4),
                coded(KvFormat::K4v3),
                None,
            ],
            bits: 4.5,
        };
        ok("llms", service);
        ok("mix:k8v8/k4v4/k4v3@4.5", service);
        let sim: SimFormat = "k4+v3+kc8".parse().unwrap();
        ok("sim:k4+v3+kc8", Compression::Sim(sim));
        ok(
            "mix:int8/k4+v3+kc8@4.5",
            Compression::Budget {
                levels: [
                    Some(Stored::Real(KvFormat::Int8)),
                    Some(Stored::Sim(sim)),
                    None,
                    None,
                ],
                bits: 4.5,
            },
        );
        for bad in [
            "8:4:2=50:50",
            "ratio=half",
            "int3",
            "8:4:2=a:b:c",
            "sim:q9",
            "mix:int8/int4",
            "mix:int8/x@4",
            "mix:int8/int8/int8/int8/int8@4",
        ] {
            assert!(parse_mix(bad).is_err(), "{bad}");
        }
    }
}
