//! `llms bench pager`: measures the userfaultfd pager (populate by COPY and MOVE, fault-to-resolved, reclaim) and prints a table and JSON.

use anyhow::Context;
use uffd_pager::bench::{BenchOptions, run};

/// Options of `llms bench pager`.
#[derive(clap::Args, Debug)]
pub struct BenchPagerArgs {
    #[command(flatten)]
    pub report: crate::report::ReportArgs,
    /// Chunk sizes in KiB (1 to 1048576).
    #[arg(long, value_delimiter = ',', default_values_t = [16usize, 64, 192], value_parser = crate::report::positive)]
    pub sizes_kib: Vec<usize>,
    /// Operations per run.
    #[arg(long, default_value_t = 200, value_parser = crate::report::positive)]
    pub iterations: usize,
    /// Runs (each figure is the median of the runs' medians).
    #[arg(long, default_value_t = 5, value_parser = crate::report::positive)]
    pub runs: usize,
}

/// Run the benchmark, print the table, write the JSON.
pub fn bench_pager(args: &BenchPagerArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.sizes_kib.iter().all(|&k| k <= 1 << 20),
        "--sizes-kib takes sizes from 1 to 1048576 KiB"
    );
    args.report.begin();
    let report = run(&BenchOptions {
        sizes: args.sizes_kib.iter().map(|k| k << 10).collect(),
        iterations: args.iterations,
        runs: args.runs,
    })
    .context("running the pager benchmark (needs root and /dev/userfaultfd)")?;
    crate::report::table_str!("{}", report.table());
    args.report.write("pager", &report)?;
    Ok(())
}
