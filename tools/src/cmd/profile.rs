//! `llms profile`: measures on this machine the recompute time of x chunks at several context
//! lengths and the time to read m bytes of chunks through a kvfs mount, and fits the linear models
//! T_re(x) and T_IO(m) of paper §3.3, saved as the JSON profile file `llms serve --profile`
//! starts its planner from (`service::profile`).

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use model::kv::recompute::recompute_chunks;
use model::kv::{KvCache, KvFormat};
use policy::LinearCost;
use service::profile::{CostProfile, IoOptions, LinearFit, RecomputePoint, fit_io, measure_io};

use crate::cmd::bench::kv::{ModelInput, median_secs, prefilled};
use crate::report::table;

#[derive(Args, Debug)]
pub struct ProfileArgs {
    #[command(flatten)]
    pub input: ModelInput,
    #[command(flatten)]
    pub report: crate::report::ReportArgs,
    /// Context lengths in tokens (multiples of the model's chunk: 16 tokens, 32 for Gemma 3; at
    /// most the model's context) at which recompute is timed.
    #[arg(long, value_delimiter = ',', default_value = "256,512,1024", value_parser = crate::report::positive)]
    pub contexts: Vec<usize>,
    /// Chunk counts to recompute at each length (capped at the context's chunks; at least two
    /// different counts, to fit a line).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16", value_parser = crate::report::positive)]
    pub chunks: Vec<usize>,
    /// Repetitions per point (the median is kept).
    #[arg(long, default_value_t = 3, value_parser = crate::report::positive)]
    pub reps: usize,
    /// Chunk counts read one after another through the kvfs mount, for T_IO (capped at the
    /// longest context's chunks), in each format chunks are stored in: int8, k8v8, k4v4, k4v3.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32,64", value_parser = crate::report::positive)]
    pub io_chunks: Vec<usize>,
    /// Directory for the scratch store the reads are timed on, on the disk the service's store
    /// lives on (a fresh store is made inside, mounted, and removed) [default: <out>]
    #[arg(long, value_name = "DIR")]
    pub scratch: Option<PathBuf>,
}

fn fit(points: &[(f64, f64)]) -> anyhow::Result<LinearFit> {
    Ok(LinearCost::fit(points)
        .context("the recompute timings do not fit a line")?
        .into())
}

/// The different counts of `flag`, in order: at least two, to fit a line.
fn line_counts(counts: &[usize], flag: &str, example: &str) -> anyhow::Result<Vec<usize>> {
    let mut v = counts.to_vec();
    v.sort_unstable();
    v.dedup();
    anyhow::ensure!(
        v.len() >= 2,
        "{flag} needs at least two different chunk counts to fit a line (e.g. {example})"
    );
    Ok(v)
}

pub fn run(args: ProfileArgs) -> anyhow::Result<()> {
    line_counts(&args.chunks, "--chunks", "1,4")?;
    let io_counts = line_counts(&args.io_chunks, "--io-chunks", "1,16")?;
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
    // The longest context's cache: its chunks are the ones stored and read for T_IO.
    let mut longest: Option<KvCache> = None;
    for &len in &args.contexts {
        let chunk = model.cfg.chunk_tokens();
        anyhow::ensure!(
            len >= chunk && len.is_multiple_of(chunk),
            "context length {len} is not a positive multiple of the model's chunk of {chunk} tokens"
        );
        let tokens = args.input.tokens(&model, len)?;
        let mut cache = prefilled(&model, &tokens, KvFormat::Int8, model.cfg.chunk_tokens())?;
        let sealed = cache.chunk_formats().len();
        let mut here = Vec::new();
        for &x in &args.chunks {
            let x = x.clamp(1, sealed);
            // The last x chunks: the ones whose recompute attends to the most keys.
            let set: Vec<usize> = (sealed - x..sealed).collect();
            let secs = median_secs(args.reps, || {
                for &i in &set {
                    cache.reclaim(i)?;
                }
                recompute_chunks(&model, &mut cache, &set)?;
                Ok(())
            })?;
            eprintln!("context {len}: {x} chunks in {secs:.4} s");
            here.push((x as f64, secs));
            points.push(RecomputePoint {
                context: len,
                chunks: x,
                seconds: secs,
            });
        }
        by_context.push((len, fit(&here)?));
        if longest.as_ref().is_none_or(|c| c.len() < cache.len()) {
            longest = Some(cache);
        }
    }
    let all: Vec<(f64, f64)> = points
        .iter()
        .map(|p| (p.chunks as f64, p.seconds))
        .collect();
    let cache = longest.context("no context length to measure")?;
    let io_opts = IoOptions {
        dir: args.report.scratch_dir(args.scratch.as_deref())?,
        formats: std::iter::once(KvFormat::Int8)
            .chain(KvFormat::CODED)
            .collect(),
        counts: io_counts,
        reps: args.reps,
        mount_guard: Some(crate::args::guard_command()?),
    };
    let io_points = measure_io(&model, &cache, &io_opts, |p| {
        eprintln!(
            "read {} chunks of {} ({} bytes) in {:.5} s",
            p.chunks, p.format, p.bytes, p.seconds
        );
    })
    .context("timing chunk reads through a kvfs mount (needs root and /dev/fuse)")?;
    let io = fit_io(&io_points).context("the read timings do not fit a line")?;
    let profile = CostProfile {
        model: model.path().display().to_string(),
        chunk_tokens: model.cfg.chunk_tokens(),
        threads: model::kernels::threads(),
        recompute: fit(&all)?,
        recompute_by_context: by_context,
        io: Some(io),
        points,
        io_points,
    };
    table!(
        "T_re(x) = {:.5} s + {:.5} s * x chunks (r^2 {:.3})",
        profile.recompute.fixed_secs,
        profile.recompute.per_unit_secs,
        profile.recompute.r_squared
    );
    table!(
        "T_IO(m) = {:.6} s + m bytes / {:.0} MB/s (r^2 {:.3})",
        io.fixed_secs,
        1e-6 / io.per_unit_secs.max(f64::MIN_POSITIVE),
        io.r_squared
    );
    args.report.write("profile", &profile)?;
    Ok(())
}
