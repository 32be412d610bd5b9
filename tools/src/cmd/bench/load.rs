//! `llms bench load`: a context swapped out completely and brought back by reading, by
//! recomputing, and by the planned pipeline, against the plan's prediction, inside a cgroup v1
//! memory group whose peak it reports; a table and JSON.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use bench::cgroup::Joined;
use bench::load::{LoadBenchOptions, run};
use model::kv::KvFormat;

use crate::cmd::bench::kv::ModelInput;

/// Options of `llms bench load`.
#[derive(clap::Args, Debug)]
pub struct BenchLoadArgs {
    #[command(flatten)]
    pub input: ModelInput,
    #[command(flatten)]
    pub report: crate::report::ReportArgs,
    /// Context lengths in tokens (at least 16 each).
    #[arg(long, value_delimiter = ',', default_values_t = [512usize, 1024, 2048])]
    pub lengths: Vec<usize>,
    /// Swap-out and load rounds per mode; each figure is the median.
    #[arg(long, default_value_t = 5, value_parser = crate::report::positive)]
    pub runs: usize,
    /// Base format of the context's chunks (f16, int8, int4, int2).
    #[arg(long, default_value = "int8")]
    pub kv_format: String,
    /// Tokens per KV chunk (1 to 256) [default: the model's: 16, and 32 for Gemma 3]
    #[arg(long, value_name = "N",
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=256))]
    pub chunk_tokens: Option<usize>,
    /// Compress chunks to the tolerance-aware mix at call end (the service's default levels and bit budget).
    #[arg(long)]
    pub compress: bool,
    /// Also measure with reads throttled to these MiB/s (cgroup v1 blkio; needs root).
    #[arg(long, value_delimiter = ',')]
    pub throttle_mib: Vec<u64>,
    /// Directory for the benchmark's store, on the disk to measure (a fresh store is made
    /// inside and removed) [default: <out>]
    #[arg(long, value_name = "DIR")]
    pub scratch: Option<PathBuf>,
    /// Engine threads [default: all cores].
    #[arg(long, value_parser = crate::report::positive)]
    pub threads: Option<usize>,
    /// Move chunks through the store's API instead of a kvfs mount of it (the service's path).
    #[arg(long)]
    pub no_mount: bool,
    /// With --no-mount (or where the kernel refuses io_uring): threads reading chunks when the
    /// Load recomputes nothing, each with one read in flight (through the mount one thread keeps
    /// the reads in flight on an io_uring)
    #[arg(long, default_value_t = 8, value_parser = crate::report::positive)]
    pub io_threads: usize,
    /// Start the planner from this cost profile (`llms profile`'s profile.json), as
    /// `llms serve --profile` does [default: the built-in starting costs]
    #[arg(long, env = "LLMS_PROFILE", value_name = "FILE")]
    pub profile: Option<PathBuf>,
    /// Do not run inside a cgroup v1 memory group (no peak memory is reported); without the
    /// controller or the right to use it the benchmark runs outside one and says so
    #[arg(long)]
    pub no_memory_cgroup: bool,
}

/// Runs the benchmark, prints the table, writes the JSON.
pub fn run_cmd(args: &BenchLoadArgs) -> anyhow::Result<()> {
    crate::args::init_threads(args.threads)?;
    anyhow::ensure!(
        !args.lengths.is_empty() && args.lengths.iter().all(|&n| n >= 16),
        "--lengths must list context lengths of at least 16 tokens"
    );
    let format: KvFormat = args.kv_format.parse().map_err(|e| anyhow::anyhow!("{e}"))?;
    anyhow::ensure!(
        args.throttle_mib.iter().all(|&m| (1..1 << 40).contains(&m)),
        "--throttle-mib takes MiB/s from 1 to 2^40"
    );
    let cost = args
        .profile
        .as_deref()
        .map(crate::cmd::serve::read_profile)
        .transpose()?;
    args.report.begin();
    // Entered before the model loads, so the peak counts everything the benchmark holds.
    let memory = if args.no_memory_cgroup {
        None
    } else {
        match Joined::enter("memory", &format!("llms-bench-load-{}", std::process::id())) {
            Ok(j) => Some(j),
            Err(e) => {
                eprintln!("bench load: running outside a memory cgroup, no peak reported: {e}");
                None
            }
        }
    };
    let model = Arc::new(args.input.load()?);
    // The context's first call generates one token after its prompt.
    if let Some(n) = args.lengths.iter().find(|&&n| n >= model.cfg.max_ctx) {
        anyhow::bail!(
            "--lengths {n}: the context and the token its first call generates do not fit the \
             model's context of {} tokens; at most {}",
            model.cfg.max_ctx,
            model.cfg.max_ctx - 1
        );
    }
    let dir = args.report.scratch_dir(args.scratch.as_deref())?;
    let mut throttles = vec![None];
    throttles.extend(args.throttle_mib.iter().map(|&m| Some(m << 20)));
    let opts = LoadBenchOptions {
        lengths: args.lengths.clone(),
        runs: args.runs,
        format,
        compress: args.compress,
        dir,
        throttles,
        mount: !args.no_mount,
        mount_guard: Some(crate::args::guard_command()?),
        io_threads: args.io_threads,
        cost,
        chunk_tokens: args.chunk_tokens,
    };
    #[allow(clippy::print_stderr)]
    let report = run(model, &opts, memory.as_ref().map(Joined::group), |what| {
        eprintln!("bench load: {what}")
    })
    .context("running the load benchmark (needs root and /dev/userfaultfd)")?;
    crate::report::table_str!("{}", report.table());
    args.report.write("load", &report)?;
    Ok(())
}
