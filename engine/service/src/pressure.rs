//! Memory pressure: a thread that samples the kernel's memory pressure (PSI,
//! `/proc/pressure/memory`) and the memory cgroup the process runs in (its limit and usage, cgroup
//! v1 or v2), and moves the KV budget with `policy::BudgetController` (shrink under pressure or
//! when the cgroup limit leaves no room, grow back after calm readings: hysteresis).
//! A lower budget is met at once through the pager's normal reclaim path (written chunks first);
//! the contexts whose chunks go are loaded back by their next call.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;
use policy::{BudgetChange, BudgetConfig, BudgetController, PressureSignals};
use uffd_pager::Pager;

/// What went wrong reading the pressure signals.
#[derive(Debug, thiserror::Error)]
pub enum PressureReadError {
    #[error("reading {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not in the PSI format (`some avg10=... ` / `full avg10=...`)")]
    BadPsi { path: PathBuf },
    #[error("{path}: {what}")]
    BadCgroup { path: PathBuf, what: String },
}

/// Where the signals are read from: the kernel's files, or others with the same formats.
#[derive(Clone, Debug)]
pub struct PressureFiles {
    /// PSI of memory (`/proc/pressure/memory`).
    pub psi: PathBuf,
    /// The process's cgroup list (`/proc/self/cgroup`).
    pub cgroups: PathBuf,
    /// Where the cgroup hierarchies are mounted (`/sys/fs/cgroup`).
    pub cgroup_root: PathBuf,
}

impl Default for PressureFiles {
    fn default() -> Self {
        Self {
            psi: "/proc/pressure/memory".into(),
            cgroups: "/proc/self/cgroup".into(),
            cgroup_root: "/sys/fs/cgroup".into(),
        }
    }
}

fn read(path: &Path) -> Result<String, PressureReadError> {
    std::fs::read_to_string(path).map_err(|source| PressureReadError::Io {
        path: path.to_owned(),
        source,
    })
}

/// `some avg10` and `full avg10` (percent) of a PSI file.
pub fn parse_psi(text: &str) -> Option<(f64, f64)> {
    let avg10 = |kind: &str| {
        text.lines()
            .find(|l| l.starts_with(kind))?
            .split_whitespace()
            .find_map(|w| w.strip_prefix("avg10="))?
            .parse::<f64>()
            .ok()
    };
    Some((avg10("some ")?, avg10("full ")?))
}

/// The memory cgroup's limit (`None`: unlimited) and usage, from the process's cgroup list: the
/// v1 `memory` hierarchy when there is one, else the v2 unified one. `None` when neither has the
/// files (no memory controller).
pub fn cgroup_memory(
    files: &PressureFiles,
) -> Result<Option<(Option<u64>, u64)>, PressureReadError> {
    let list = read(&files.cgroups)?;
    let v1 = list.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (_, ctrl, path) = (f.next()?, f.next()?, f.next()?);
        ctrl.split(',').any(|c| c == "memory").then_some(path)
    });
    let (dir, limit_file, usage_file) = match v1 {
        Some(p) => (
            files
                .cgroup_root
                .join("memory")
                .join(p.trim_start_matches('/')),
            "memory.limit_in_bytes",
            "memory.usage_in_bytes",
        ),
        None => match list.lines().find_map(|l| l.strip_prefix("0::")) {
            Some(p) => (
                files.cgroup_root.join(p.trim_start_matches('/')),
                "memory.max",
                "memory.current",
            ),
            None => return Ok(None),
        },
    };
    let (limit_path, usage_path) = (dir.join(limit_file), dir.join(usage_file));
    if !usage_path.exists() {
        return Ok(None);
    }
    let num = |path: &Path, text: &str| {
        text.trim()
            .parse::<u64>()
            .map_err(|e| PressureReadError::BadCgroup {
                path: path.to_owned(),
                what: e.to_string(),
            })
    };
    let limit_text = read(&limit_path)?;
    // v2 writes `max`; v1 writes a page-rounded i64::MAX.
    let limit = match limit_text.trim() {
        "max" => None,
        _ => Some(num(&limit_path, &limit_text)?).filter(|&l| l < (1 << 62)),
    };
    let usage = num(&usage_path, &read(&usage_path)?)?;
    Ok(Some((limit, usage)))
}

/// One reading, with `kv_resident` the KV bytes resident now.
pub fn sample(
    files: &PressureFiles,
    kv_resident: u64,
) -> Result<PressureSignals, PressureReadError> {
    let psi = read(&files.psi)?;
    let (some_avg10, full_avg10) = parse_psi(&psi).ok_or_else(|| PressureReadError::BadPsi {
        path: files.psi.clone(),
    })?;
    let (limit_bytes, usage_bytes) = cgroup_memory(files)?.unwrap_or((None, 0));
    Ok(PressureSignals {
        some_avg10,
        full_avg10,
        limit_bytes,
        usage_bytes,
        kv_resident_bytes: kv_resident,
    })
}

/// The last reading and what the budget is, for `stats`.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct PressureState {
    pub some_avg10: f64,
    pub full_avg10: f64,
    pub cgroup_limit_bytes: Option<u64>,
    pub cgroup_usage_bytes: u64,
    /// Times the budget went down and up.
    pub shrinks: u64,
    pub grows: u64,
}

/// The thread that watches pressure; stops when dropped.
pub struct PressureWatch {
    stop: Option<Sender<()>>,
    thread: Option<JoinHandle<()>>,
    state: Arc<Mutex<PressureState>>,
}

impl std::fmt::Debug for PressureWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PressureWatch").finish_non_exhaustive()
    }
}

impl PressureWatch {
    /// Checks that the signals can be read, then samples them every `interval` and sets `pager`'s
    /// budget between `config.min_bytes` and `config.max_bytes`.
    pub fn start(
        pager: Arc<Pager>,
        config: BudgetConfig,
        files: PressureFiles,
        interval: Duration,
    ) -> Result<PressureWatch, crate::ServiceError> {
        let bad = |what: String| crate::ServiceError::BadRequest { what };
        let controller = BudgetController::new(config).map_err(|e| bad(e.to_string()))?;
        sample(&files, pager.resident_bytes()).map_err(|e| {
            bad(format!(
                "{e} (serve without the pressure watch: --no-pressure)"
            ))
        })?;
        let state = Arc::new(Mutex::new(PressureState::default()));
        let (tx, rx) = channel();
        let st = Arc::clone(&state);
        let thread = std::thread::Builder::new()
            .name("llms-pressure".into())
            .spawn(move || watch(&pager, controller, &files, interval, &rx, &st))
            .map_err(|source| crate::ServiceError::Start {
                what: "starting the pressure thread".into(),
                source,
            })?;
        Ok(PressureWatch {
            stop: Some(tx),
            thread: Some(thread),
            state,
        })
    }

    /// The last reading and the budget's moves.
    pub fn state(&self) -> PressureState {
        self.state.lock().clone()
    }
}

impl Drop for PressureWatch {
    fn drop(&mut self) {
        self.stop = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn watch(
    pager: &Pager,
    mut controller: BudgetController,
    files: &PressureFiles,
    interval: Duration,
    stop: &Receiver<()>,
    state: &Mutex<PressureState>,
) {
    loop {
        match stop.recv_timeout(interval) {
            Err(RecvTimeoutError::Timeout) => {}
            _ => return,
        }
        let s = match sample(files, pager.resident_bytes()) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read memory pressure; the budget holds");
                continue;
            }
        };
        let change = controller.update(&s);
        let mut st = state.lock();
        st.some_avg10 = s.some_avg10;
        st.full_avg10 = s.full_avg10;
        st.cgroup_limit_bytes = s.limit_bytes;
        st.cgroup_usage_bytes = s.usage_bytes;
        let to = match change {
            Ok(BudgetChange::Hold) => continue,
            Ok(BudgetChange::Shrink { to, reason }) => {
                st.shrinks += 1;
                tracing::info!(to, ?reason, some_avg10 = s.some_avg10, "KV budget lowered");
                to
            }
            Ok(BudgetChange::Grow { to }) => {
                st.grows += 1;
                tracing::info!(to, "KV budget raised");
                to
            }
            Err(e) => {
                tracing::warn!(error = %e, "a pressure reading was refused; the budget holds");
                continue;
            }
        };
        drop(st);
        if let Err(e) = pager.set_budget(to) {
            tracing::warn!(error = %e, "setting the KV budget failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psi_is_parsed() {
        let t = "some avg10=12.50 avg60=0.00 avg300=0.00 total=400727\n\
                 full avg10=3.25 avg60=0.00 avg300=0.00 total=311369\n";
        assert_eq!(parse_psi(t), Some((12.5, 3.25)));
        assert_eq!(parse_psi("some avg10=1.0\n"), None);
        assert_eq!(parse_psi(""), None);
    }

    #[test]
    fn cgroup_v1_and_v2_are_found() {
        let dir = tempfile::tempdir().unwrap();
        let files = PressureFiles {
            psi: dir.path().join("psi"),
            cgroups: dir.path().join("cgroup"),
            cgroup_root: dir.path().join("fs"),
        };
        let v1 = dir.path().join("fs/memory/a/b");
        std::fs::create_dir_all(&v1).unwrap();
        std::fs::write(v1.join("memory.limit_in_bytes"), "1073741824\n").unwrap();
        std::fs::write(v1.join("memory.usage_in_bytes"), "5000\n").unwrap();
        std::fs::write(&files.cgroups, "5:devices:/\n4:memory:/a/b\n0::/\n").unwrap();
        assert_eq!(cgroup_memory(&files).unwrap(), Some((Some(1 << 30), 5000)));
        std::fs::write(v1.join("memory.limit_in_bytes"), "9223372036854771712\n").unwrap();
        assert_eq!(cgroup_memory(&files).unwrap(), Some((None, 5000)));
        let v2 = dir.path().join("fs/c");
        std::fs::create_dir_all(&v2).unwrap();
        std::fs::write(v2.join("memory.max"), "max\n").unwrap();
        std::fs::write(v2.join("memory.current"), "77\n").unwrap();
        std::fs::write(&files.cgroups, "0::/c\n").unwrap();
        assert_eq!(cgroup_memory(&files).unwrap(), Some((None, 77)));
        std::fs::write(&files.cgroups, "0::/nowhere\n").unwrap();
        assert_eq!(cgroup_memory(&files).unwrap(), None);
    }
}
