//! The report convention every benchmark and `llms profile` share: `--out DIR` (default
//! `bench-out/`) receives `DIR/<name>.json`, and `--json` prints that same JSON on stdout, the
//! human table then going to stderr.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context;
use clap::Args;

/// The default folder of every report.
pub const DEFAULT_OUT: &str = "bench-out";

/// `--out` and `--json`.
#[derive(Args, Debug, Clone)]
pub struct ReportArgs {
    /// Folder the JSON report is written to, one file per command (bench engine:
    /// <DIR>/engine.json, bench kv: kv.json, profile: profile.json, ...; created if missing)
    #[arg(long, value_name = "DIR", default_value = DEFAULT_OUT)]
    pub out: PathBuf,
    /// Print the JSON report on stdout (the table goes to stderr)
    #[arg(long)]
    pub json: bool,
}

/// Whether tables go to stderr because stdout carries the JSON report.
static TABLE_TO_STDERR: AtomicBool = AtomicBool::new(false);

/// Whether [`table!`] prints to stderr.
pub fn table_to_stderr() -> bool {
    TABLE_TO_STDERR.load(Ordering::Relaxed)
}

impl ReportArgs {
    /// Routes the tables ([`table!`]) to stderr when `--json` is on; call before printing.
    pub fn begin(&self) {
        TABLE_TO_STDERR.store(self.json, Ordering::Relaxed);
    }

    /// `<out>/<name>`: a scratch path beside the report, for benchmarks that measure a disk.
    pub fn scratch(&self, name: &str) -> PathBuf {
        self.out.join(name)
    }

    /// The scratch directory of a command that measures a disk: `--scratch DIR` if given, else
    /// `--out`; created, and absolute (a kvfs mount inside it is checked against
    /// /proc/self/mountinfo, which holds absolute paths).
    pub fn scratch_dir(&self, scratch: Option<&Path>) -> anyhow::Result<PathBuf> {
        let dir = scratch.unwrap_or(&self.out);
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        std::path::absolute(dir).with_context(|| format!("cannot make {} absolute", dir.display()))
    }

    /// Writes `report` to `<out>/<name>.json`, prints it on stdout with `--json`, and says where
    /// it went on stderr.
    pub fn write<T: serde::Serialize>(&self, name: &str, report: &T) -> anyhow::Result<PathBuf> {
        std::fs::create_dir_all(&self.out)
            .with_context(|| format!("cannot create {}", self.out.display()))?;
        let path = self.out.join(format!("{name}.json"));
        let body = serde_json::to_string_pretty(report).context("cannot serialise the report")?;
        std::fs::write(&path, &body).with_context(|| format!("cannot write {}", path.display()))?;
        if self.json {
            println!("{body}");
        }
        eprintln!("wrote {}", path.display());
        Ok(path)
    }
}

/// `println!` for a report's human table: on stderr when `--json` puts the JSON on stdout.
macro_rules! table {
    () => {
        if $crate::report::table_to_stderr() { eprintln!() } else { println!() }
    };
    ($($arg:tt)*) => {
        if $crate::report::table_to_stderr() { eprintln!($($arg)*) } else { println!($($arg)*) }
    };
}

/// `print!` for a report's human table (see [`table!`]).
macro_rules! table_str {
    ($($arg:tt)*) => {
        if $crate::report::table_to_stderr() { eprint!($($arg)*) } else { print!($($arg)*) }
    };
}

pub(crate) use {table, table_str};

/// A clap value parser for counts that must be at least 1 (threads, runs, sizes).
pub fn positive(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("{e}")),
    }
}
