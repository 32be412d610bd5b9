//! `llms bench load`: a context swapped out completely and brought back by reading, by
//! recomputing, and by the planned pipeline, against the plan's prediction; a table and JSON.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use engine::kv::KvFormat;
use engine::service::bench::{LoadBenchOptions, run};

use crate::bench_kv::ModelInput;

/// Options of `llms bench load`.
#[derive(clap::Args, Debug)]
pub struct BenchLoadArgs {
    #[command(flatten)]
    pub input: ModelInput,
    /// Context lengths in tokens.
    #[arg(long, value_delimiter = ',', default_values_t = [512usize, 1024, 2048])]
    pub lengths: Vec<usize>,
    /// Swap-out and load rounds per mode; each figure is the median.
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// Base format of the context's chunks (f16, int8, int4, int2).
    #[arg(long, default_value = "int8")]
    pub kv_format: String,
    /// Compress chunks to the tolerance-aware mix at call end (50% global ratio).
    #[arg(long)]
    pub compress: bool,
    /// Also measure with reads throttled to these MiB/s (cgroup v1 blkio; needs root).
    #[arg(long, value_delimiter = ',')]
    pub throttle_mib: Vec<u64>,
    /// Directory for the benchmark's store (on the disk to measure).
    #[arg(long, default_value = "bench-out")]
    pub dir: PathBuf,
    /// Where to write the JSON report.
    #[arg(long, default_value = "bench-out/bench-load.json")]
    pub json: PathBuf,
    /// Engine threads [default: all cores].
    #[arg(long)]
    pub threads: Option<usize>,
    /// Move chunks through the store's API instead of a kvfs mount of it (the service's path).
    #[arg(long)]
    pub no_mount: bool,
}

/// Runs the benchmark, prints the table, writes the JSON.
pub fn run_cmd(args: &BenchLoadArgs) -> anyhow::Result<()> {
    crate::engine_cmd::init_threads(args.threads)?;
    anyhow::ensure!(
        !args.lengths.is_empty() && args.lengths.iter().all(|&n| n >= 16),
        "--lengths must list context lengths of at least 16 tokens"
    );
    let format: KvFormat = args.kv_format.parse().map_err(|e| anyhow::anyhow!("{e}"))?;
    let model = Arc::new(args.input.load()?);
    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("creating {}", args.dir.display()))?;
    let mut throttles = vec![None];
    throttles.extend(args.throttle_mib.iter().map(|&m| Some(m << 20)));
    let opts = LoadBenchOptions {
        lengths: args.lengths.clone(),
        runs: args.runs.max(1),
        format,
        compress: args.compress,
        dir: args.dir.clone(),
        throttles,
        mount: !args.no_mount,
        mount_guard: Some(crate::kvfs_cmd::guard_command()?),
    };
    #[allow(clippy::print_stderr)]
    let report = run(model, &opts, |what| eprintln!("bench load: {what}"))
        .context("running the load benchmark (needs root and /dev/userfaultfd)")?;
    print!("{}", report.table());
    if let Some(parent) = args.json.parent() {
        std::fs::create_dir_all(parent).ok();
    }
    let json = serde_json::to_string_pretty(&report).context("serialising the report")?;
    std::fs::write(&args.json, json).with_context(|| format!("writing {}", args.json.display()))?;
    println!("wrote {}", args.json.display());
    Ok(())
}
