//! `llms bench pager`: measures the userfaultfd pager (populate by COPY and MOVE, fault-to-resolved, reclaim) and prints a table and JSON.

use std::path::PathBuf;

use anyhow::Context;
use uffd_pager::bench::{BenchOptions, run};

/// Options of `llms bench pager`.
#[derive(clap::Args, Debug)]
pub struct BenchPagerArgs {
    /// Chunk sizes in KiB.
    #[arg(long, value_delimiter = ',', default_values_t = [16usize, 64, 192])]
    pub sizes_kib: Vec<usize>,
    /// Operations per run.
    #[arg(long, default_value_t = 200)]
    pub iterations: usize,
    /// Runs (each figure is the median of the runs' medians).
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// Where to write the JSON report.
    #[arg(long, default_value = "bench-pager.json")]
    pub json: PathBuf,
}

/// Run the benchmark, print the table, write the JSON.
pub fn bench_pager(args: &BenchPagerArgs) -> anyhow::Result<()> {
    let report = run(&BenchOptions {
        sizes: args.sizes_kib.iter().map(|k| k << 10).collect(),
        iterations: args.iterations.max(1),
        runs: args.runs.max(1),
    })
    .context("running the pager benchmark (needs root and /dev/userfaultfd)")?;
    print!("{}", report.table());
    let json = serde_json::to_string_pretty(&report).context("serialising the report")?;
    std::fs::write(&args.json, json).with_context(|| format!("writing {}", args.json.display()))?;
    println!("wrote {}", args.json.display());
    Ok(())
}
