//! `llms profile`: measures the recompute time of x chunks at several context lengths on this
//! machine and fits the linear model T_re(x) of paper §3.3, saved as a JSON profile file.
//!
//! The I/O model T_IO(m) joins the profile once kvfs exists; until then the file says so.

use anyhow::Context;
use clap::Args;
use engine::kv::KvFormat;
use engine::kv::recompute::recompute_chunks;
use policy::LinearCost;
use serde::Serialize;

use crate::bench_kv::{ModelInput, median_secs, prefilled};
use crate::report::table;

#[derive(Args, Debug)]
pub struct ProfileArgs {
    #[command(flatten)]
    pub input: ModelInput,
    #[command(flatten)]
    pub report: crate::report::ReportArgs,
    /// Context lengths in tokens (multiples of 16, at most the model's context) at which
    /// recompute is timed.
    #[arg(long, value_delimiter = ',', default_value = "256,512,1024", value_parser = crate::report::positive)]
    pub contexts: Vec<usize>,
    /// Chunk counts to recompute at each length (capped at the context's chunks; at least two
    /// different counts, to fit a line).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16", value_parser = crate::report::positive)]
    pub chunks: Vec<usize>,
    /// Repetitions per point (the median is kept).
    #[arg(long, default_value_t = 3, value_parser = crate::report::positive)]
    pub reps: usize,
}

#[derive(Serialize)]
struct Point {
    context: usize,
    chunks: usize,
    seconds: f64,
}

#[derive(Serialize)]
struct Linear {
    fixed_secs: f64,
    per_unit_secs: f64,
    r_squared: f64,
}

#[derive(Serialize)]
struct Profile {
    model: String,
    chunk_tokens: usize,
    threads: usize,
    /// T_re(x): seconds to recompute x chunks, over every context length measured.
    recompute: Linear,
    /// The same fit at each context length (later chunks attend to more keys).
    recompute_by_context: Vec<(usize, Linear)>,
    /// T_IO(m): not measured yet (it needs the kvfs store).
    io: Option<Linear>,
    points: Vec<Point>,
}

fn fit(points: &[(f64, f64)]) -> anyhow::Result<Linear> {
    let f = LinearCost::fit(points).context("the recompute timings do not fit a line")?;
    Ok(Linear {
        fixed_secs: f.cost.fixed(),
        per_unit_secs: f.cost.per_unit(),
        r_squared: f.r_squared,
    })
}

pub fn run(args: ProfileArgs) -> anyhow::Result<()> {
    let mut counts = args.chunks.clone();
    counts.sort_unstable();
    counts.dedup();
    anyhow::ensure!(
        counts.len() >= 2,
        "--chunks needs at least two different chunk counts to fit a line (e.g. 1,4)"
    );
    if let Some(len) = args.contexts.iter().find(|&&n| !n.is_multiple_of(16)) {
        anyhow::bail!("context length {len} is not a positive multiple of 16");
    }
    args.report.begin();
    let model = args.input.load()?;
    if let Some(len) = args.contexts.iter().find(|&&n| n > model.cfg.max_ctx) {
        anyhow::bail!(
            "context length {len} is longer than the model's context of {} tokens",
            model.cfg.max_ctx
        );
    }
    let mut points = Vec::new();
    let mut by_context = Vec::new();
    for &len in &args.contexts {
        anyhow::ensure!(
            len >= 16 && len.is_multiple_of(16),
            "context length {len} is not a positive multiple of 16"
        );
        let tokens = args.input.tokens(&model, len)?;
        let mut cache = prefilled(&model, &tokens, KvFormat::Int8)?;
        let sealed = cache.chunk_formats().len();
        let mut here = Vec::new();
        for &x in &args.chunks {
            let x = x.clamp(1, sealed);
            // The last x chunks: the ones whose recompute attends to the most keys.
            let set: Vec<usize> = (sealed - x..sealed).collect();
            let secs = median_secs(args.reps, || {
                for &i in &set {
                    cache.evict(i)?;
                }
                recompute_chunks(&model, &mut cache, &set)?;
                Ok(())
            })?;
            eprintln!("context {len}: {x} chunks in {secs:.4} s");
            here.push((x as f64, secs));
            points.push(Point {
                context: len,
                chunks: x,
                seconds: secs,
            });
        }
        by_context.push((len, fit(&here)?));
    }
    let all: Vec<(f64, f64)> = points
        .iter()
        .map(|p| (p.chunks as f64, p.seconds))
        .collect();
    let profile = Profile {
        model: model.path().display().to_string(),
        chunk_tokens: 16,
        threads: engine::model::kernels::threads(),
        recompute: fit(&all)?,
        recompute_by_context: by_context,
        io: None,
        points,
    };
    table!(
        "T_re(x) = {:.5} s + {:.5} s * x (r^2 {:.3})",
        profile.recompute.fixed_secs,
        profile.recompute.per_unit_secs,
        profile.recompute.r_squared
    );
    args.report.write("profile", &profile)?;
    Ok(())
}
