//! `llms bench switch`: the paper's evaluation (§4–5, Fig. 9–11) against the real service. A
//! trace (`llms trace gen`) is replayed against a real `llms serve` started for each context
//! manager, KV budget and number of contexts, inside a cgroup v1 memory group (its peak is
//! reported) and a blkio group (the store's disk throttled to emulate slower storage, and the
//! bytes it moved counted). Each call's switch latency is the daemon's own measure (`done`'s
//! `switch_ms`). Reports a table, CSV and JSON under `--out`, and three PNG plots. docs/bench.md
//! shows a run and says how to read it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail, ensure};
use bench::cgroup::Device;
use bench::trace::{PastCap, Trace, TraceRow};
use model::config::ModelConfig;
use model::kv::KvFormat;
use service::ManagerKind;
use strum::VariantArray;

use crate::args::ModelsDirArg;
use crate::args::parse_bytes;
use crate::report::table;
use bench::switch::*;

/// Options of `llms bench switch`.
#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:\n  \
    llms trace gen --past-cap restart --calls 60 trace.jsonl\n  \
    llms bench switch trace.jsonl                                  # every manager, 2 contexts' worth\n  \
    llms bench switch --managers llms,vllm-sq,lmk --budget-contexts 1,2,3 trace.jsonl\n  \
    llms bench switch --contexts 2,4,6,8 --read-bps 200M trace.jsonl\n  \
    llms bench switch --managers llms --llama-server LLAMA/build/bin/llama-server trace.jsonl\n\
    Writes <out>/switch.json, switch.csv, switch-cdf.png, switch-vs-budget.png and \
    active-vs-budget.png (docs/bench.md).")]
pub struct BenchSwitchArgs {
    /// The trace to replay, made by `llms trace gen --past-cap restart` (the service refuses a
    /// call past its --max-context, so a trace whose contexts slide past the cap is refused)
    #[arg(value_name = "TRACE", required_unless_present = "replot")]
    pub trace: Option<PathBuf>,
    /// Replay nothing: redraw the table, CSV and plots of an earlier run from its switch.json
    /// into --out (to restyle the plots of a long run)
    #[arg(long, value_name = "JSON", conflicts_with = "trace")]
    pub replot: Option<PathBuf>,
    /// A known model's name (fetched if missing) or a GGUF file; the trace's token counts are
    /// this model's [default: smollm2-135m]
    #[arg(long, env = "LLMS_MODEL", value_name = "NAME|FILE")]
    pub model: Option<PathBuf>,
    #[command(flatten)]
    pub dir: ModelsDirArg,
    #[command(flatten)]
    pub report: crate::report::ReportArgs,
    /// Context managers to compare, each run as `llms serve --manager NAME`: llms,
    /// llms-no-compression, llms-no-pipeline, llms-no-lifecycle, vllm-sq, vllm-s, swapping, lmk
    /// [default: all of them]
    #[arg(long, value_delimiter = ',', value_name = "NAMES", value_parser = parse_manager)]
    pub managers: Vec<String>,
    /// KV budgets in contexts' worth: N times the int8 slots of a context at the trace's cap
    /// (its --max-context tokens in 16-token chunks); a list gives latency against budget. A
    /// call needs its whole context resident, so under 1 a long context fails with over_budget
    /// [default: 2]
    #[arg(long, value_delimiter = ',', value_name = "N,...", value_parser = parse_contexts_worth,
          conflicts_with = "kv_budget")]
    pub budget_contexts: Vec<f64>,
    /// KV budgets in bytes instead (suffixes K, M, G: powers of 1024), a list as
    /// --budget-contexts
    #[arg(long, value_delimiter = ',', value_name = "BYTES,...", value_parser = parse_budget)]
    pub kv_budget: Vec<u64>,
    /// Replay the trace cut to its first n contexts, for each n listed: the most active
    /// contexts whose average switch latency stays under 10 ms (and 25 ms) is the largest such
    /// n (paper Fig. 10) [default: all the trace's contexts, one replay]
    #[arg(long, value_delimiter = ',', value_name = "N,...", value_parser = crate::report::positive)]
    pub contexts: Vec<usize>,
    /// Replay only the first N calls (of the contexts kept) [default: every call]
    #[arg(long, value_name = "N", value_parser = crate::report::positive)]
    pub calls: Option<usize>,
    /// Emulate slower storage: the daemon's reads of the store's disk limited to BYTES per
    /// second (cgroup v1 blkio; suffixes K, M, G) [default: the disk's full speed]
    #[arg(long, value_name = "BYTES", value_parser = parse_rate)]
    pub read_bps: Option<u64>,
    /// The daemon's writes to the store's disk limited to BYTES per second (cgroup v1 blkio
    /// throttles direct and synced writes, not the page cache's writeback) [default: full
    /// speed]
    #[arg(long, value_name = "BYTES", value_parser = parse_rate)]
    pub write_bps: Option<u64>,
    /// Send each call as soon as the previous one is answered; by default the replay waits,
    /// between calls, until the daemon's ahead-of-time writes are done, as they would be in
    /// the trace's minutes between calls (time between calls is otherwise not replayed)
    #[arg(long)]
    pub no_drain: bool,
    /// Engine threads of the daemon [default: the number of CPUs]
    #[arg(long, value_name = "N", value_parser = crate::report::positive)]
    pub threads: Option<usize>,
    /// Tokens per KV chunk of every daemon (`llms serve --chunk-tokens`), to compare chunk
    /// sizes as the paper's §5.4 does; the budget in contexts' worth stays the same bytes
    /// [default: the model's]
    #[arg(long, value_name = "TOKENS",
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=256))]
    pub chunk_tokens: Option<usize>,
    /// Where each run's store, socket and mount go (a fresh directory inside, removed after
    /// the run), on the disk to measure [default: <out>]
    #[arg(long, value_name = "DIR")]
    pub scratch: Option<PathBuf>,
    /// Add the llama.cpp peer row: this llama-server (`build/bin/llama-server` of a llama.cpp
    /// build, e.g. by ../shared/tools/build-llamacpp.sh) replays the same trace with
    /// as many slots of the trace's cap as fit the budget, each context saved to
    /// --slot-save-path at its call's end and restored, from a cold page cache, when called
    /// [default: no llama.cpp row]
    #[arg(long, value_name = "PATH", value_parser = bench::peer::parse_exe)]
    pub llama_server: Option<PathBuf>,
    /// llama.cpp's KV cache types, one row each: q8_0 (row llama.cpp), f16 (row llama.cpp-f16)
    #[arg(long, value_delimiter = ',', value_name = "TYPES", default_value = "q8_0",
          value_parser = bench::peer::parse_kv_type, requires = "llama_server")]
    pub llama_kv: Vec<bench::peer::KvType>,
}

fn parse_manager(s: &str) -> Result<String, String> {
    s.parse::<ManagerKind>()
        .map(|k| k.name().to_owned())
        .map_err(|e| e.to_string())
}

fn parse_contexts_worth(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v <= 1e6 => Ok(v),
        Ok(v) => Err(format!("{v} contexts' worth: must be above 0")),
        Err(e) => Err(format!("'{s}': {e}")),
    }
}

fn parse_budget(s: &str) -> Result<u64, String> {
    match parse_bytes(s) {
        Ok(0) => Err("a KV budget must be at least 1 byte".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("{e:#}")),
    }
}

fn parse_rate(s: &str) -> Result<u64, String> {
    match parse_bytes(s) {
        Ok(n) if n >= 4096 => Ok(n),
        Ok(n) => Err(format!("{n} bytes/s: a disk limit must be at least 4K")),
        Err(e) => Err(format!("{e:#}")),
    }
}

/// A replay's line above the progress bar.
fn report_line(progress: &indicatif::ProgressBar, r: &Run) {
    let slots = r.slots.map_or(String::new(), |n| format!(" ({n} slots)"));
    print_line(
        progress,
        format!(
            "{}{slots}, {}, {} contexts: {} switches, avg {:.2} ms, p99 {:.2} ms, {} errors",
            r.manager,
            r.budget.label(),
            r.contexts,
            r.switches,
            r.switch_avg_ms,
            r.switch_p99_ms,
            r.errors
        ),
    );
}

fn print_line(progress: &indicatif::ProgressBar, line: String) {
    // A hidden bar (stderr is not a terminal) prints nothing, not even its lines.
    if progress.is_hidden() {
        eprintln!("{line}");
    } else {
        progress.println(line);
    }
}

/// Runs the benchmark: reads the trace and the model, plans the replays, measures the scratch
/// disk, replays, and writes the tables, CSV, plots and JSON.
pub fn run(args: &BenchSwitchArgs) -> anyhow::Result<()> {
    args.report.begin();
    if let Some(json) = &args.replot {
        return replot(args, json);
    }
    let input = read_input(args)?;
    let plan = plan(args, &input)?;
    let disk = scratch_disk(args, &input.model)?;
    let h = &input.trace.header;
    let setup = Setup {
        model: &input.model,
        scratch: &disk.scratch,
        device: disk.device,
        read_bps: args.read_bps,
        write_bps: args.write_bps,
        disk_bps: disk.bps,
        max_context: h.max_context,
        apps_contexts: most_contexts_per_app(&input.trace),
        threads: args.threads,
        chunk_tokens: args.chunk_tokens,
        drain: !args.no_drain,
    };
    let runs = replay_all(args, &input, &plan, &setup)?;
    let names = plan.row_names();
    let active = active_rows(&runs, &plan.budgets, &names);
    let mut report = SwitchReport {
        trace: input.trace_path.display().to_string(),
        model: input.model_name,
        context_bytes: plan.context_bytes,
        max_context: h.max_context,
        chunk_tokens: args.chunk_tokens,
        read_bps: args.read_bps,
        write_bps: args.write_bps,
        disk_mib_s: disk.bps / f64::from(1 << 20),
        device: disk.device.to_string(),
        drained: !args.no_drain,
        runs,
        active,
        plots: Vec::new(),
        colours: names
            .iter()
            .map(|m| (m.clone(), bench::plot::colour_name(m).to_owned()))
            .collect(),
    };
    write_outputs(args, &mut report, &names, plan.ns.len() > 1)?;
    print_failures(&report.runs);
    Ok(())
}

/// What a run replays: the trace, and the model its token counts are for.
struct Input {
    trace_path: PathBuf,
    trace: Trace,
    /// The model file, absolute.
    model: PathBuf,
    /// Its file name, which the trace's header names.
    model_name: String,
    cfg: ModelConfig,
}

/// Reads the trace and the model's shape, and checks that the service can replay the trace:
/// its contexts fit the model's context, and none slides past its cap.
fn read_input(args: &BenchSwitchArgs) -> anyhow::Result<Input> {
    let trace_path = args.trace.as_deref().context("no trace to replay")?;
    let trace = bench::trace::read(trace_path)?;
    let h = &trace.header;
    let model = crate::args::resolve_model(args.model.as_deref(), &args.dir)?;
    let model = std::path::absolute(&model)?;
    let cfg = ModelConfig::from_gguf_file(&model)?;
    let model_name = model
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    if model_name != h.model {
        tracing::warn!(
            trace = h.model,
            model = model_name,
            "the trace's token counts are another model's"
        );
    }
    ensure!(
        h.max_context as usize <= cfg.max_ctx,
        "the trace's contexts reach {} tokens, more than the model's context of {}",
        h.max_context,
        cfg.max_ctx
    );
    let past = trace
        .rows
        .iter()
        .filter(|r| r.context_tokens > u64::from(h.max_context))
        .count();
    if h.past_cap == PastCap::Slide && past > 0 {
        bail!(
            "{} slides contexts past its cap of {} tokens ({past} calls): the service refuses a \
             call past its --max-context (context_full), so replay a trace made with `llms trace \
             gen --past-cap restart` (docs/bench.md)",
            trace_path.display(),
            h.max_context
        );
    }
    Ok(Input {
        trace_path: trace_path.to_owned(),
        trace,
        model,
        model_name,
        cfg,
    })
}

/// The replays asked for: each budget with each number of contexts, for each manager and
/// llama.cpp row.
struct Plan {
    /// Numbers of contexts, ascending.
    ns: Vec<usize>,
    managers: Vec<String>,
    /// The llama.cpp rows' KV types (none without --llama-server).
    peers: Vec<bench::peer::KvType>,
    /// Bytes of one context's worth.
    context_bytes: u64,
    budgets: Vec<Budget>,
}

impl Plan {
    /// Every row's name: the managers, then the llama.cpp rows.
    fn row_names(&self) -> Vec<String> {
        self.managers
            .iter()
            .cloned()
            .chain(self.peers.iter().map(|k| k.row().to_owned()))
            .collect()
    }
}

/// The plan of `args` for `input`'s trace; a number of contexts larger than the trace's is an
/// error.
fn plan(args: &BenchSwitchArgs, input: &Input) -> anyhow::Result<Plan> {
    let h = &input.trace.header;
    let all = h.contexts.len();
    let mut ns = if args.contexts.is_empty() {
        vec![all]
    } else {
        args.contexts.clone()
    };
    ns.sort_unstable();
    ns.dedup();
    if let Some(&n) = ns.iter().find(|&&n| n > all) {
        bail!("--contexts {n}: the trace has {all} contexts");
    }
    let managers: Vec<String> = if args.managers.is_empty() {
        ManagerKind::VARIANTS
            .iter()
            .map(|m| m.name().to_owned())
            .collect()
    } else {
        args.managers.clone()
    };
    let shape = input.cfg.chunk_shape(CHUNK_TOKENS);
    let context_bytes = (h.max_context as usize).div_ceil(CHUNK_TOKENS) as u64
        * shape.slot_bytes(KvFormat::Int8) as u64;
    let peers: Vec<bench::peer::KvType> = if args.llama_server.is_some() {
        let mut v = args.llama_kv.clone();
        v.dedup();
        v
    } else {
        Vec::new()
    };
    Ok(Plan {
        ns,
        managers,
        peers,
        context_bytes,
        budgets: budgets(args, context_bytes),
    })
}

/// The KV budgets: --kv-budget's bytes, else --budget-contexts (2 by default) times a context's
/// worth.
fn budgets(args: &BenchSwitchArgs, context_bytes: u64) -> Vec<Budget> {
    if !args.kv_budget.is_empty() {
        return args
            .kv_budget
            .iter()
            .map(|&bytes| Budget {
                bytes,
                contexts: None,
            })
            .collect();
    }
    let worth = if args.budget_contexts.is_empty() {
        vec![2.0]
    } else {
        args.budget_contexts.clone()
    };
    worth
        .iter()
        .map(|&c| Budget {
            bytes: ((c * context_bytes as f64) as u64).max(1),
            contexts: Some(c),
        })
        .collect()
}

/// The most contexts one app of the trace keeps (the daemon's --max-contexts-per-app).
fn most_contexts_per_app(trace: &Trace) -> usize {
    trace
        .header
        .contexts
        .iter()
        .fold(BTreeMap::<&str, usize>::new(), |mut m, c| {
            *m.entry(&c.app).or_default() += 1;
            m
        })
        .into_values()
        .max()
        .unwrap_or(1)
}

/// Where the replays' stores go, and what its disk reads.
struct ScratchDisk {
    scratch: PathBuf,
    device: Device,
    /// `O_DIRECT` read bandwidth, bytes/s.
    bps: f64,
}

/// The scratch directory and the I/O lower bound's bandwidth: what its disk gives O_DIRECT
/// reads, 4 at a time (the Load's I/O threads), measured now, before the replays, and printed.
/// The model file is read when it is on that disk and large enough: a file written just before
/// reads back faster than the disk (3.3 GB/s against 1.2 here: the virtual disk's host keeps
/// what was just written).
fn scratch_disk(args: &BenchSwitchArgs, model: &Path) -> anyhow::Result<ScratchDisk> {
    let scratch = args.report.scratch_dir(args.scratch.as_deref())?;
    let device = Device::of(&scratch)?;
    let probe_bytes = 64 << 20;
    let model_bytes = std::fs::metadata(model).map_or(0, |m| m.len());
    let bps = if Device::of(model)? == device && model_bytes >= probe_bytes as u64 {
        bench::disk::direct_read_bps(model, probe_bytes, 4)?
    } else {
        bench::disk::probe_dir(&scratch, probe_bytes, 4)?
    };
    print_line(
        &indicatif::ProgressBar::hidden(),
        format!(
            "bench switch: the scratch disk reads {:.0} MiB/s with O_DIRECT (the I/O lower bound's)",
            bps / f64::from(1 << 20)
        ),
    );
    Ok(ScratchDisk {
        scratch,
        device,
        bps,
    })
}

/// One cell of the plan: a budget and a number of contexts, with the rows replayed.
struct Cell {
    budget: Budget,
    n: usize,
    rows: Vec<TraceRow>,
}

/// Every replay of the plan, budget by budget and number of contexts by number: each manager,
/// then each llama.cpp row; a progress bar counts the calls.
fn replay_all(
    args: &BenchSwitchArgs,
    input: &Input,
    plan: &Plan,
    setup: &Setup<'_>,
) -> anyhow::Result<Vec<Run>> {
    let cells: Vec<Cell> = plan
        .budgets
        .iter()
        .flat_map(|&b| plan.ns.iter().map(move |&n| (b, n)).collect::<Vec<_>>())
        .map(|(budget, n)| Cell {
            budget,
            n,
            rows: cut(&input.trace.rows, n, args.calls),
        })
        .collect();
    let total: u64 =
        cells.iter().map(|c| c.rows.len() as u64).sum::<u64>() * plan.row_names().len() as u64;
    let progress = progress_bar(total)?;
    let mut runs = Vec::new();
    for cell in &cells {
        for m in &plan.managers {
            progress.set_prefix(format!("{m}, {}, {} contexts", cell.budget.label(), cell.n));
            let r = replay(setup, m, cell.budget, cell.n, &cell.rows, &progress)?;
            ensure!(
                &r.daemon_manager == m,
                "asked the daemon for --manager {m}; its stats say it ran {}",
                r.daemon_manager
            );
            report_line(&progress, &r);
            runs.push(r);
        }
        let Some(exe) = &args.llama_server else {
            continue;
        };
        for &kv in &plan.peers {
            let peer = bench::peer::Peer {
                exe,
                cfg: &input.cfg,
                kv,
            };
            if let Some(r) = replay_peer(setup, &peer, cell, &progress)? {
                runs.push(r);
            }
        }
    }
    progress.finish_and_clear();
    Ok(runs)
}

/// The bar the replays count their calls on.
fn progress_bar(total: u64) -> anyhow::Result<indicatif::ProgressBar> {
    Ok(indicatif::ProgressBar::new(total).with_style(
        indicatif::ProgressStyle::with_template(
            "{prefix} [{bar:30}] {pos}/{len} calls {elapsed_precise} (eta {eta})",
        )
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .progress_chars("=> "),
    ))
}

/// One llama.cpp row of a cell; `None` (its calls counted, a line printed) when not one slot of
/// the trace's cap fits the budget.
fn replay_peer(
    setup: &Setup<'_>,
    peer: &bench::peer::Peer<'_>,
    cell: &Cell,
    progress: &indicatif::ProgressBar,
) -> anyhow::Result<Option<Run>> {
    let m = peer.kv.row();
    let (budget, n) = (cell.budget, cell.n);
    let slots = bench::peer::slots_for(
        budget.bytes,
        setup.max_context,
        peer.kv.token_bytes(peer.cfg),
    );
    if slots == 0 {
        progress.inc(cell.rows.len() as u64);
        print_line(
            progress,
            format!(
                "{m}, {}, {n} contexts: skipped, not one slot of {} tokens of {} KV fits \
                 the budget",
                budget.label(),
                setup.max_context,
                peer.kv.name()
            ),
        );
        return Ok(None);
    }
    progress.set_prefix(format!("{m}, {}, {n} contexts", budget.label()));
    let r = bench::peer::replay(setup, peer, budget, n, &cell.rows, progress)
        .with_context(|| format!("the {m} row"))?;
    report_line(progress, &r);
    Ok(Some(r))
}

/// The most active contexts under each latency bound, per budget and row.
fn active_rows(runs: &[Run], budgets: &[Budget], names: &[String]) -> Vec<Active> {
    let mut active = Vec::new();
    for b in budgets {
        for m in names {
            let rs: Vec<&Run> = runs
                .iter()
                .filter(|r| &r.manager == m && r.budget.bytes == b.bytes)
                .collect();
            active.push(Active {
                manager: m.clone(),
                budget: *b,
                under_10ms: max_active(&rs, BOUNDS_MS[0]),
                under_25ms: max_active(&rs, BOUNDS_MS[1]),
            });
        }
    }
    active
}

/// The tables, then under --out the CSV, the plots (their paths put in `report`) and the JSON
/// report; `names` are the rows in the plots' legend.
fn write_outputs(
    args: &BenchSwitchArgs,
    report: &mut SwitchReport,
    names: &[String],
    several_n: bool,
) -> anyhow::Result<()> {
    print_tables(&report.runs, &report.active, several_n);
    std::fs::create_dir_all(&args.report.out)
        .with_context(|| format!("cannot create {}", args.report.out.display()))?;
    let csv = args.report.out.join("switch.csv");
    write_csv(&csv, &report.runs)?;
    let plots = bench::plot::draw(&args.report.out, &report.runs, &report.active, names)?;
    report.plots = plots.iter().map(|p| p.display().to_string()).collect();
    args.report.write("switch", &*report)?;
    eprintln!("wrote {}", csv.display());
    for p in &plots {
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}

/// Failed calls are a result (an f16 context larger than the budget cannot run): the table
/// shows them, the JSON has their codes, and their replays count for no latency bound; this
/// prints each replay's count of each code.
fn print_failures(runs: &[Run]) {
    for r in runs.iter().filter(|r| r.errors > 0) {
        let mut codes: BTreeMap<&str, usize> = BTreeMap::new();
        for c in &r.call_log {
            if let Some(e) = &c.error {
                *codes.entry(e).or_default() += 1;
            }
        }
        eprintln!(
            "{}, {}, {} contexts: {} of {} calls failed: {codes:?}",
            r.manager,
            r.budget.label(),
            r.contexts,
            r.errors,
            r.calls
        );
    }
}

/// `--replot`: the table, CSV and plots of an earlier report, and the report again with its new
/// plots' paths.
fn replot(args: &BenchSwitchArgs, json: &Path) -> anyhow::Result<()> {
    let text =
        std::fs::read_to_string(json).with_context(|| format!("cannot read {}", json.display()))?;
    let mut report: SwitchReport = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a bench switch report", json.display()))?;
    let mut managers: Vec<String> = Vec::new();
    for r in &report.runs {
        if !managers.contains(&r.manager) {
            managers.push(r.manager.clone());
        }
    }
    let several_n = report.runs.iter().any(|r| {
        report
            .runs
            .first()
            .is_some_and(|f| f.contexts != r.contexts)
    });
    write_outputs(args, &mut report, &managers, several_n)
}

fn mib(b: u64) -> f64 {
    b as f64 / f64::from(1 << 20)
}

fn print_tables(runs: &[Run], active: &[Active], several_n: bool) {
    table!(
        "| manager | budget | contexts | calls | switches | switch avg ms | p50 | p99 | e2e avg ms | e2e p99 | read MiB | disk read MiB | disk written MiB | chunks read | recomputed | recompute share | sync reclaims | peak MiB |"
    );
    table!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in runs {
        table!(
            "| {} | {} | {} | {}{} | {} | {:.2} | {:.2} | {:.2} | {:.0} | {:.0} | {:.1} | {:.1} | {:.1} | {} | {} | {:.0}% | {} | {:.0} |",
            r.manager,
            r.budget.label(),
            r.contexts,
            r.answered,
            if r.errors > 0 {
                format!(" ({} failed)", r.errors)
            } else {
                String::new()
            },
            r.switches,
            r.switch_avg_ms,
            r.switch_p50_ms,
            r.switch_p99_ms,
            r.e2e_avg_ms,
            r.e2e_p99_ms,
            mib(r.read_bytes),
            mib(r.disk_read_bytes),
            mib(r.disk_written_bytes),
            r.chunks_read,
            r.chunks_recomputed,
            r.recompute_share * 100.0,
            r.sync_reclaims,
            mib(r.peak_memory_bytes)
        );
    }
    if several_n {
        table!();
        table!("| manager | budget | max active contexts, avg switch < 10 ms | < 25 ms |");
        table!("|---|---|---|---|");
        for a in active {
            table!(
                "| {} | {} | {} | {} |",
                a.manager,
                a.budget.label(),
                a.under_10ms,
                a.under_25ms
            );
        }
    }
    let reading: Vec<&Run> = runs.iter().filter(|r| r.io_bound_ratio > 0.0).collect();
    if !reading.is_empty() {
        table!();
        table!(
            "| manager | budget | contexts | Load reads MiB/s | switch / I/O bound at that speed | switch / I/O bound at the disk's | worst switch / its bound at the disk's | switches within {BOUND_TARGET}x of it |"
        );
        table!("|---|---|---|---|---|---|---|---|");
        for r in reading {
            table!(
                "| {} | {} | {} | {:.0} | {:.2} | {:.2} | {:.2} | {} of {} |",
                r.manager,
                r.budget.label(),
                r.contexts,
                r.read_mib_s,
                r.io_bound_ratio,
                r.disk_bound_ratio,
                r.disk_bound_ratio_max,
                r.within_bound_target,
                r.reading_switches
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_reading_switch_is_held_against_its_own_bound() {
        // The disk reads 1 MiB a millisecond.
        let disk_bps = f64::from(1 << 20) * 1e3;
        let call = |start, switched, switch_ms, mib: u64| CallRecord {
            context: 0,
            start,
            switched,
            switch_ms,
            queue_ms: 0.0,
            load_ms: switch_ms,
            io_ms: switch_ms,
            recompute_ms: 0.0,
            e2e_ms: switch_ms,
            prefill_ms: 0.0,
            decode_ms: 0.0,
            end_ms: 0.0,
            chunks_missing: 0,
            chunks_read: 0,
            chunks_recomputed: 0,
            read_bytes: mib << 20,
            tokens: 1,
            context_tokens: 1,
            error: None,
            restore_wall_ms: None,
        };
        let log = vec![
            call(false, true, 1.2, 1),
            call(false, true, 3.0, 2),
            call(false, true, 1.0, 1),
            // Not counted: a switch that read nothing, a start, a call to the same context.
            call(false, true, 0.2, 0),
            call(true, true, 9.0, 1),
            call(false, false, 9.0, 1),
        ];
        let budget = Budget {
            bytes: 1,
            contexts: None,
        };
        let r = summarize("llms", budget, 8, log, None, disk_bps);
        assert_eq!(r.reading_switches, 3);
        assert_eq!(r.within_bound_target, 2);
        assert!(
            (r.disk_bound_ratio_max - 1.5).abs() < 1e-9,
            "{}",
            r.disk_bound_ratio_max
        );
        assert!(
            (r.disk_bound_ratio - 3.7 / 3.0).abs() < 1e-9,
            "{}",
            r.disk_bound_ratio
        );
        // A throttle slower than the disk is the bound's speed.
        let log = vec![call(false, true, 1.2, 1)];
        let r = summarize("llms", budget, 8, log, Some(1 << 19), disk_bps);
        assert!((r.disk_bound_ratio_max - 1.2 / 2000.0).abs() < 1e-9);
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), 50.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&[3.0], 0.99), 3.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
    }

    fn run_of(contexts: usize, avg: f64, errors: usize) -> Run {
        Run {
            manager: "llms".into(),
            daemon_manager: "llms".into(),
            budget: Budget {
                bytes: 1,
                contexts: None,
            },
            contexts,
            calls: 1,
            answered: 1,
            errors,
            starts: 0,
            switches: 1,
            switch_avg_ms: avg,
            switch_p50_ms: avg,
            switch_p99_ms: avg,
            switch_max_ms: avg,
            e2e_avg_ms: 0.0,
            e2e_p50_ms: 0.0,
            e2e_p99_ms: 0.0,
            read_bytes: 0,
            disk_read_bytes: 0,
            disk_written_bytes: 0,
            chunks_read: 0,
            chunks_recomputed: 0,
            recompute_share: 0.0,
            read_mib_s: 0.0,
            io_bound_ratio: 0.0,
            disk_bound_ratio: 0.0,
            disk_bound_ratio_max: 0.0,
            reading_switches: 0,
            within_bound_target: 0,
            sync_reclaims: 0,
            unwritten_reclaims: 0,
            reclaims: 0,
            faults: 0,
            writes: 0,
            peak_memory_bytes: 0,
            peak_rss_bytes: 0,
            start_ms: 0.0,
            secs: 0.0,
            slots: None,
            call_log: Vec::new(),
        }
    }

    #[test]
    fn max_active_is_the_largest_n_under_the_bound() {
        let runs = [
            run_of(2, 1.0, 0),
            run_of(4, 8.0, 0),
            run_of(6, 20.0, 0),
            run_of(8, 40.0, 0),
        ];
        let rs: Vec<&Run> = runs.iter().collect();
        assert_eq!(max_active(&rs, 10.0), 4);
        assert_eq!(max_active(&rs, 25.0), 6);
        assert_eq!(max_active(&rs, 0.5), 0);
        // A run with failed calls does not count, however fast.
        let runs = [run_of(2, 1.0, 0), run_of(4, 1.0, 3)];
        let rs: Vec<&Run> = runs.iter().collect();
        assert_eq!(max_active(&rs, 10.0), 2);
    }

    #[test]
    fn cut_keeps_the_first_contexts_rows() {
        let row = |context: u32| TraceRow {
            time: 0.0,
            app: "a".into(),
            context,
            source: bench::trace::Source::Sst2,
            start: false,
            tokens: 1,
            max_tokens: 1,
            context_tokens: 1,
            prompt: "x".into(),
        };
        let rows: Vec<TraceRow> = [0, 3, 1, 2, 0, 1].into_iter().map(row).collect();
        let ctx = |v: Vec<TraceRow>| v.iter().map(|r| r.context).collect::<Vec<_>>();
        assert_eq!(ctx(cut(&rows, 2, None)), [0, 1, 0, 1]);
        assert_eq!(ctx(cut(&rows, 2, Some(3))), [0, 1, 0]);
        assert_eq!(ctx(cut(&rows, 4, None)), [0, 3, 1, 2, 0, 1]);
    }
}
