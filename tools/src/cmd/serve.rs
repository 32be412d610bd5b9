//! `llms serve`: the system service. Resolves its settings (flags, then `LLMS_*` variables, then
//! an optional TOML file, then defaults), takes the store's lock, cleans a stale socket, loads
//! the model, opens the context manager and runs the daemon until SIGTERM or SIGINT drain it.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Args;
use daemon::{Daemon, DaemonConfig};
use merge::Merge;
use model::Model;
use model::kv::KvFormat;
use model::tokenizer::Tokenizer;
use policy::{BudgetConfig, CostModel};
use protocol::DEFAULT_MAX_LINE;
use service::chunk_io::default_mountpoint;
use service::pressure::{PressureFiles, PressureWatch};
use service::{Manager, ManagerConfig, ManagerKind};

use crate::args::{
    Bytes, ModelsDirArg, clear_stale_socket, default_socket, env_dir, is_root, mkdir_for,
};

/// The store when none is given: `/var/lib/llms/store` as root, else
/// `$XDG_DATA_HOME/llms/store`, else `~/.local/share/llms/store`.
pub fn default_store() -> anyhow::Result<PathBuf> {
    if is_root() {
        return Ok(PathBuf::from("/var/lib/llms/store"));
    }
    if let Some(d) = env_dir("XDG_DATA_HOME") {
        return Ok(d.join("llms/store"));
    }
    match env_dir("HOME") {
        Some(h) => Ok(h.join(".local/share/llms/store")),
        None => bail!("no place for the store: set XDG_DATA_HOME or HOME, or pass --store"),
    }
}

// One struct for the flags and `LLMS_*` variables (clap) and the keys of the TOML file (serde,
// keys as the long flags), so a setting is declared once; the file's values fill what the flags
// and variables left unset (`Merge`, in `resolve`).
/// `llms serve`.
#[derive(Args, Debug, Default, serde::Deserialize, Merge)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
#[merge(strategy = merge::option::overwrite_none)]
pub struct ServeArgs {
    /// Unix socket to listen on (mode 0666: any local user connects; contexts are per uid)
    /// [default: $XDG_RUNTIME_DIR/llms/llms.sock, /run/llms/llms.sock as root]
    #[arg(long, env = "LLMS_SOCKET", value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// The kvfs store of the contexts (`<store>.lock` keeps a second daemon off it); the default
    /// store is created when missing, a store named here must exist unless --create
    /// [default: $XDG_DATA_HOME/llms/store, /var/lib/llms/store as root]
    #[arg(long, env = "LLMS_STORE", value_name = "DIR")]
    pub store: Option<PathBuf>,
    /// Create the store named by --store (or LLMS_STORE, or the config file) if it does not
    /// exist yet; without it a mistyped path is an error, not a new empty store
    #[arg(long)]
    #[merge(strategy = merge::bool::overwrite_false)]
    pub create: bool,
    /// Where the store is mounted as the kvfs filesystem: every chunk the daemon swaps in or out
    /// goes through it, and `ls`, `cat` and `getfattr` show the contexts (each uid sees its own);
    /// a stale mount of a killed daemon is cleaned at start [default: `kv` beside the socket]
    #[arg(
        long,
        env = "LLMS_MOUNT",
        value_name = "DIR",
        conflicts_with = "no_mount"
    )]
    pub mount: Option<PathBuf>,
    /// Serve without the kvfs mount (chunks move through the store's API directly): for machines
    /// without FUSE (/dev/fuse) or the right to mount
    #[arg(long, env = "LLMS_NO_MOUNT")]
    #[merge(strategy = merge::bool::overwrite_false)]
    pub no_mount: bool,
    /// Stop as on SIGTERM (drain, unmount) when the process that started this one dies, even
    /// killed: for a tool that runs a daemon of its own (`llms bench switch` and `bench crash`)
    #[arg(long)]
    #[serde(skip)]
    #[merge(strategy = merge::bool::overwrite_false)]
    pub exit_with_parent: bool,
    /// A known model's name (smollm2-135m, gemma3-270m: fetched into the cache if missing) or a
    /// GGUF file [default: smollm2-135m]
    #[arg(long, env = "LLMS_MODEL", value_name = "NAME|FILE")]
    pub model: Option<PathBuf>,
    /// The models cache [default: $LLMS_MODELS_DIR, else $XDG_CACHE_HOME/llms/models,
    /// else ~/.cache/llms/models]
    #[arg(long, global = true, value_name = "DIR")]
    pub models_dir: Option<PathBuf>,
    /// Bytes of KV chunks resident at once, across contexts (suffixes K, M, G: powers of 1024)
    /// [default: 256M]
    #[arg(long, env = "LLMS_KV_BUDGET", value_name = "BYTES")]
    pub kv_budget: Option<Bytes>,
    /// The context manager: `llms` (every technique of the paper), its ablations
    /// `llms-no-compression`, `llms-no-pipeline`, `llms-no-lifecycle`, or a baseline: `vllm-sq`
    /// (int8 chunks written and read on demand), `vllm-s` (the same in f16), `swapping` (whole
    /// f16 contexts swapped), `lmk` (whole contexts killed and re-prefilled). docs/service.md
    /// describes each [default: llms]
    #[arg(long, env = "LLMS_MANAGER", value_name = "NAME")]
    pub manager: Option<String>,
    /// Bytes of weights held in memory (suffixes K, M, G): the matrices that do not fit are read
    /// from the model file for every token, ahead of the compute [default: all resident]
    #[arg(long, env = "LLMS_WEIGHT_BUDGET", value_name = "BYTES")]
    pub weight_budget: Option<Bytes>,
    /// Format new KV chunks are sealed in: f16, int8 (then compressed by attention to k8v8,
    /// k4v4 and k4v3 at 4.5 stored bits per value on average), or any other format; the
    /// baselines fix their own [default: int8]
    #[arg(long, env = "LLMS_KV_FORMAT", value_name = "FORMAT")]
    pub kv_format: Option<String>,
    /// Most tokens one context holds, at most the model's context length (8192 for the default
    /// model, 32768 for gemma3-270m) [default: the model's context length]
    #[arg(long, env = "LLMS_MAX_CONTEXT", value_name = "TOKENS")]
    pub max_context: Option<usize>,
    /// Tokens per KV chunk, the unit that is compressed, written, read and recomputed (1 to
    /// 256). A context stored in chunks of another size keeps its tokens and has its chunks
    /// recomputed in the new size at its next call [default: the model's: 16, and 32 for
    /// Gemma 3]
    #[arg(long, env = "LLMS_CHUNK_TOKENS", value_name = "TOKENS")]
    pub chunk_tokens: Option<usize>,
    /// Refuse a call that does not fit in its context (`context_full`) instead of sliding the
    /// window: by default a full context keeps its first 16 tokens (the attention sink) and its
    /// most recent ones, at most half its length, and prefills them again with the prompt
    #[arg(long, env = "LLMS_NO_WINDOW")]
    #[merge(strategy = merge::bool::overwrite_false)]
    pub no_window: bool,
    /// Contexts one app may hold; the next `new` gets `too_many_contexts` [default: 8]
    #[arg(long, env = "LLMS_MAX_CONTEXTS_PER_APP", value_name = "N")]
    pub max_contexts_per_app: Option<usize>,
    /// Calls that may wait; more get `busy` [default: 64]
    #[arg(long, env = "LLMS_QUEUE", value_name = "N")]
    pub queue: Option<usize>,
    /// Longest request line in bytes [default: 1048576]
    #[arg(long, env = "LLMS_MAX_LINE", value_name = "BYTES")]
    pub max_line: Option<usize>,
    /// Connections at once; more are refused with `busy` [default: 256]
    #[arg(long, env = "LLMS_MAX_CONNECTIONS", value_name = "N")]
    pub max_connections: Option<usize>,
    /// Lowest KV budget memory pressure may push it to (suffixes K, M, G) [default: a quarter of
    /// --kv-budget]
    #[arg(long, env = "LLMS_MIN_KV_BUDGET", value_name = "BYTES")]
    pub min_kv_budget: Option<Bytes>,
    /// Seconds between two readings of memory pressure (PSI, /proc/pressure/memory, and the
    /// memory cgroup's limit and usage): under pressure the KV budget shrinks by a quarter, and
    /// grows back by a sixteenth after three calm readings [default: 2]
    #[arg(long, env = "LLMS_PRESSURE_INTERVAL", value_name = "SECS")]
    pub pressure_interval: Option<f64>,
    /// Keep the KV budget fixed: do not watch memory pressure
    #[arg(long, env = "LLMS_NO_PRESSURE")]
    #[merge(strategy = merge::bool::overwrite_false)]
    pub no_pressure: bool,
    /// Threads for the engine's kernels [default: the number of CPUs]
    #[arg(long, env = "LLMS_THREADS", value_name = "N")]
    pub threads: Option<usize>,
    /// A cost profile of this machine written by `llms profile` (its profile.json): the Load
    /// planner starts from its recompute and read costs instead of built-in guesses, and refines
    /// them with every Load as before
    #[arg(long, env = "LLMS_PROFILE", value_name = "FILE")]
    pub profile: Option<PathBuf>,
    /// Serve the OpenAI-compatible HTTP API too (docs/http.md): on `unix:PATH`, where the
    /// peer's uid is who calls (as on --socket), and/or on `HOST:PORT` over TCP, where every
    /// request needs `Authorization: Bearer KEY` with a key of --http-keys (`llms keys add
    /// --uid UID`); repeat or separate with commas for both. Same queue, engine and contexts as
    /// the socket [default: off]
    #[arg(
        long,
        env = "LLMS_HTTP",
        value_name = "unix:PATH|HOST:PORT",
        value_delimiter = ','
    )]
    pub http: Option<Vec<String>>,
    /// The key file of the HTTP API over TCP: `UID APP SHA256` lines, written by `llms keys add`
    /// and read again when it changes [default: /etc/llms/http-keys as root, else
    /// $XDG_CONFIG_HOME/llms/http-keys]
    #[arg(long, env = "LLMS_HTTP_KEYS", value_name = "FILE")]
    pub http_keys: Option<PathBuf>,
    /// A TOML file with any of the settings above, keys as the long flags (`kv-budget = "1G"`);
    /// flags and variables win over it [default: $XDG_CONFIG_HOME/llms/serve.toml, or
    /// /etc/llms/serve.toml as root, when the file exists]
    #[arg(long, env = "LLMS_CONFIG", value_name = "FILE")]
    #[serde(skip)]
    #[merge(skip)]
    pub config: Option<PathBuf>,
}

fn default_config_file() -> Option<PathBuf> {
    let p = if is_root() {
        PathBuf::from("/etc/llms/serve.toml")
    } else {
        env_dir("XDG_CONFIG_HOME")
            .or_else(|| env_dir("HOME").map(|h| h.join(".config")))?
            .join("llms/serve.toml")
    };
    p.exists().then_some(p)
}

/// Settings after flags, variables, the file and defaults.
#[derive(Debug)]
struct Settings {
    socket: PathBuf,
    store: PathBuf,
    /// Whether a missing store may be created: the default store, or --create.
    create_store: bool,
    /// `None`: no mount.
    mount: Option<PathBuf>,
    model: Option<PathBuf>,
    dir: ModelsDirArg,
    kv_budget: u64,
    /// `None`: every weight resident.
    weight_budget: Option<u64>,
    /// `None`: no pressure watch.
    pressure: Option<(u64, std::time::Duration)>,
    kv_format: KvFormat,
    manager: ManagerKind,
    window: bool,
    max_context: Option<usize>,
    /// `None`: the model's.
    chunk_tokens: Option<usize>,
    daemon: DaemonConfig,
    threads: Option<usize>,
    /// The planner's starting costs from `--profile`; `None`: the built-in ones.
    cost: Option<CostModel>,
    /// The HTTP API's listeners (`--http`), and its key file.
    http: Vec<String>,
    /// `None`: the default key file, if a TCP listener needs one.
    http_keys: Option<PathBuf>,
}

/// Fills what the flags and variables (`a`) left unset from the config file's settings.
fn layer(a: &mut ServeArgs, mut file: ServeArgs) {
    // A mount named by a flag or a variable wins over the file's `no-mount`.
    file.no_mount &= a.mount.is_none();
    a.merge(file);
}

fn resolve(mut a: ServeArgs) -> anyhow::Result<Settings> {
    if let Some(p) = a.config.clone().or_else(default_config_file) {
        let text = std::fs::read_to_string(&p)
            .with_context(|| format!("cannot read the config file {}", p.display()))?;
        let file: ServeArgs = toml::from_str(&text)
            .with_context(|| format!("the config file {} is not valid", p.display()))?;
        layer(&mut a, file);
    }
    let budget = a.kv_budget.map_or(256 << 20, |b| b.0);
    let weight_budget = a.weight_budget.map(|b| b.0);
    let pressure = if a.no_pressure {
        None
    } else {
        let min = a.min_kv_budget.map_or(budget / 4, |b| b.0);
        if min > budget {
            bail!("--min-kv-budget ({min} bytes) is above --kv-budget ({budget} bytes)");
        }
        let secs = a.pressure_interval.unwrap_or(2.0);
        if !(secs.is_finite() && (0.01..=3600.0).contains(&secs)) {
            bail!("--pressure-interval must be between 0.01 and 3600 seconds, not {secs}");
        }
        Some((min, std::time::Duration::from_secs_f64(secs)))
    };
    let manager: ManagerKind = match a.manager {
        Some(m) => m.parse()?,
        None => ManagerKind::Llms,
    };
    let kv_format: KvFormat = match (a.kv_format, manager.fixed_format()) {
        (Some(k), Some(fixed)) => {
            let k: KvFormat = k.parse()?;
            if k != fixed {
                bail!(
                    "the {manager} manager keeps its chunks in {}; drop --kv-format {}",
                    fixed.name(),
                    k.name()
                );
            }
            k
        }
        (Some(k), None) => k.parse()?,
        (None, Some(fixed)) => fixed,
        (None, None) => KvFormat::Int8,
    };
    let d = DaemonConfig::default();
    let positive = |name: &str, v: Option<usize>, default: usize| match v.unwrap_or(default) {
        0 => bail!("--{name} must be at least 1"),
        v => Ok(v),
    };
    let daemon = DaemonConfig {
        max_line: positive("max-line", a.max_line, DEFAULT_MAX_LINE)?,
        queue: positive("queue", a.queue, d.queue)?,
        max_connections: positive("max-connections", a.max_connections, d.max_connections)?,
        max_contexts_per_app: positive(
            "max-contexts-per-app",
            a.max_contexts_per_app,
            d.max_contexts_per_app,
        )?,
        ..d
    };
    if let Some(c) = a.chunk_tokens
        && !(1..=256).contains(&c)
    {
        bail!("--chunk-tokens must be between 1 and 256, not {c}");
    }
    let cost = a.profile.map(|p| read_profile(&p)).transpose()?;
    let socket = a.socket.unwrap_or_else(default_socket);
    let mount = match (a.no_mount, a.mount) {
        (true, _) => None,
        (false, Some(m)) => Some(m),
        (false, None) => Some(default_mountpoint(&socket)),
    };
    Ok(Settings {
        socket,
        create_store: a.create || a.store.is_none(),
        store: match a.store {
            Some(s) => s,
            None => default_store()?,
        },
        mount,
        model: a.model,
        dir: ModelsDirArg {
            models_dir: a.models_dir,
        },
        kv_budget: budget,
        weight_budget,
        pressure,
        kv_format,
        manager,
        window: !a.no_window,
        max_context: a.max_context,
        chunk_tokens: a.chunk_tokens,
        daemon,
        threads: a.threads,
        cost,
        http: a.http.unwrap_or_default(),
        http_keys: a.http_keys,
    })
}

/// The cost model in the profile file `path` (`--profile`), with an error that says what to do.
pub fn read_profile(path: &Path) -> anyhow::Result<CostModel> {
    let cost = service::profile::read_cost_model(path).context("--profile")?;
    tracing::info!(profile = %path.display(), ?cost, "the Load planner starts from the profile");
    Ok(cost)
}

/// Takes `<store>.lock`; a second daemon on the same store is refused with the first one's pid.
fn lock_store(store: &Path) -> anyhow::Result<nix::fcntl::Flock<std::fs::File>> {
    let mut name = store
        .file_name()
        .context("--store must name a directory")?
        .to_owned();
    name.push(".lock");
    let path = store.with_file_name(name);
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&path)
        .with_context(|| format!("cannot open the lock file {}", path.display()))?;
    let mut lock = match nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock) {
        Ok(l) => l,
        Err((f, nix::errno::Errno::EWOULDBLOCK)) => {
            let pid = std::io::read_to_string(&f).unwrap_or_default();
            bail!(
                "another llms serve (pid {}) uses the store {}; stop it or pass another --store",
                pid.trim(),
                store.display()
            );
        }
        Err((_, e)) => return Err(e).with_context(|| format!("cannot lock {}", path.display())),
    };
    lock.set_len(0)?;
    writeln!(&mut *lock, "{}", std::process::id())?;
    Ok(lock)
}

/// Makes this process the daemon's: the descriptors it inherited closed, SIGTERM and SIGINT
/// blocked in every thread (one thread waits for them and drains; their set is returned), and,
/// with `exit_with_parent`, SIGTERM asked for when the parent dies.
fn take_process(exit_with_parent: bool) -> anyhow::Result<nix::sys::signal::SigSet> {
    let inherited = close_inherited_fds().context("cannot close inherited file descriptors")?;
    if !inherited.is_empty() {
        tracing::info!(fds = ?inherited, "closed the descriptors inherited from the parent");
    }
    // Every thread inherits this mask; one thread waits for the signals and drains.
    let mut signals = nix::sys::signal::SigSet::empty();
    signals.add(nix::sys::signal::Signal::SIGTERM);
    signals.add(nix::sys::signal::Signal::SIGINT);
    signals
        .thread_block()
        .context("cannot block SIGTERM and SIGINT")?;
    if exit_with_parent {
        // The kernel sends SIGTERM, which the signal thread turns into a drain, when the parent
        // dies; a parent gone before this line would never send it.
        let parent = nix::unistd::getppid();
        nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM)
            .context("cannot ask for a signal at the parent's death")?;
        if nix::unistd::getppid() != parent {
            bail!("the process that started this daemon has already exited");
        }
    }
    Ok(signals)
}

/// Runs `llms serve`.
pub fn run(a: ServeArgs) -> anyhow::Result<()> {
    let signals = take_process(a.exit_with_parent)?;
    let t0 = Instant::now();
    let s = resolve(a)?;
    crate::args::init_threads(s.threads)?;
    if !kvfs::Store::exists(&s.store) {
        if !s.create_store {
            bail!(
                "{} is not a kvfs store: check --store (or LLMS_STORE, or the config file), or add \
                 --create to make a new store there",
                s.store.display()
            );
        }
        tracing::info!(store = %s.store.display(), "creating a new store");
    }
    mkdir_for(&s.store)?;
    let _lock = lock_store(&s.store)?;
    mkdir_for(&s.socket)?;
    clear_stale_socket(&s.socket)?;
    let http = crate::cmd::http::bind(
        &s.http,
        s.http_keys.as_deref(),
        s.daemon.max_line,
        s.daemon.max_connections,
    )?;

    let (path, model, tokenizer) = load_model(&s)?;
    let mc = manager_config(&s, &model)?;
    let max_tokens = mc.max_tokens;
    let manager = Manager::open(Arc::clone(&model), mc)
        .with_context(|| format!("cannot open the contexts in {}", s.store.display()))?;
    let contexts = manager.stats().contexts;
    let _pressure = match s.pressure {
        Some((min, every)) => Some(
            PressureWatch::start(
                manager.shared_pager(),
                BudgetConfig::new(min, s.kv_budget),
                PressureFiles::default(),
                every,
            )
            .context("cannot watch memory pressure")?,
        ),
        None => None,
    };

    let listener = UnixListener::bind(&s.socket)
        .with_context(|| format!("cannot listen on {}", s.socket.display()))?;
    std::fs::set_permissions(&s.socket, std::fs::Permissions::from_mode(0o666))
        .with_context(|| format!("cannot open {} to every user", s.socket.display()))?;
    let mut daemon = Daemon::start(
        listener,
        manager,
        tokenizer,
        DaemonConfig {
            max_context_tokens: max_tokens,
            ..s.daemon.clone()
        },
    )?;
    let http_paths = match http {
        Some((cfg, paths)) => {
            daemon.serve_http(cfg)?;
            paths
        }
        None => Vec::new(),
    };
    let stopper = daemon.stopper();
    std::thread::Builder::new()
        .name("llms-signals".into())
        .spawn(move || {
            if let Ok(sig) = signals.wait() {
                tracing::info!(signal = %sig, "draining");
                let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
                stopper.stop();
            }
        })
        .context("cannot start the signal thread")?;
    tracing::info!(
        socket = %s.socket.display(),
        store = %s.store.display(),
        mount = %s.mount.as_deref().map_or("none".into(), |m| m.display().to_string()),
        model = %path.display(),
        kv_budget = s.kv_budget,
        contexts,
        secs = t0.elapsed().as_secs_f64(),
        "serving"
    );
    say_listening(&s, contexts)?;
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]);
    let r = daemon.wait();
    let _ = std::fs::remove_file(&s.socket);
    for p in &http_paths {
        let _ = std::fs::remove_file(p);
    }
    r?;
    Ok(())
}

/// The line that tells whoever started the daemon it listens (tests and `llms chat` wait for it).
fn say_listening(s: &Settings, contexts: usize) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "llms serve: listening on {}{} (pid {}, {} contexts)",
        s.socket.display(),
        s.http
            .iter()
            .map(|h| format!(", http {h}"))
            .collect::<String>(),
        std::process::id(),
        contexts
    )?;
    out.flush()?;
    Ok(())
}

/// The model `s` names (the default model, fetched if missing, without one), under its weight
/// budget, and its tokenizer.
fn load_model(s: &Settings) -> anyhow::Result<(PathBuf, Arc<Model>, Arc<Tokenizer>)> {
    let path = crate::args::resolve_model(s.model.as_deref(), &s.dir)?;
    let weights = model::WeightOptions {
        budget: s.weight_budget,
        ..Default::default()
    };
    let model = Arc::new(Model::load_with(&path, &weights).context("cannot load the model")?);
    let tokenizer = Arc::new(
        Tokenizer::from_gguf_file(&path)
            .with_context(|| format!("cannot build the tokenizer of {}", path.display()))?,
    );
    Ok((path, model, tokenizer))
}

/// The context manager's configuration: the store, budget and mount of `s`, its manager's
/// settings, contexts of at most `--max-context` tokens (the model's context length by default;
/// more than the model's is an error: its positions past that were never trained).
fn manager_config(s: &Settings, model: &Model) -> anyhow::Result<ManagerConfig> {
    let mut mc = ManagerConfig::new(&s.store, s.kv_budget);
    mc.mount = s.mount.clone();
    mc.mount_guard = Some(crate::args::guard_command()?);
    mc.kv_format = s.kv_format;
    s.manager.apply(&mut mc);
    mc.window = s.window;
    tracing::info!(manager = %s.manager, "{}", s.manager.describe());
    mc.max_tokens = match s.max_context {
        None => model.cfg.max_ctx,
        Some(n) if n > model.cfg.max_ctx => bail!(
            "--max-context {n} is above the model's context length of {} tokens",
            model.cfg.max_ctx
        ),
        Some(n) => n,
    };
    if let Some(c) = s.chunk_tokens {
        mc.chunk_tokens = c;
    }
    if let Some(cost) = s.cost {
        mc.cost = cost;
    }
    Ok(mc)
}

/// Closes every file descriptor this process inherited beyond stdin, stdout and stderr (as
/// daemon(7) asks of a daemon), and returns their numbers: a long-lived service must not keep
/// open what its parent leaked to it, such as the lock of `flock CMD` that ran `llms chat`,
/// which then started this daemon.
///
/// Inherited descriptors are those without close-on-exec: one with it does not survive the exec
/// of this program, and whatever this process opens itself (std files and sockets) has it. Run
/// first thing, so no Rust value owns a descriptor it closes. (nix's `fcntl` takes a borrowed
/// descriptor, which only `unsafe` makes from a bare number: they are closed rather than marked
/// close-on-exec in the parent.)
fn close_inherited_fds() -> anyhow::Result<Vec<i32>> {
    let cloexec = nix::fcntl::OFlag::O_CLOEXEC.bits();
    let mut inherited = Vec::new();
    for entry in std::fs::read_dir("/proc/self/fd").context("cannot list /proc/self/fd")? {
        let name = entry.context("cannot list /proc/self/fd")?.file_name();
        let Some(fd) = name.to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        if fd < 3 {
            continue;
        }
        // A descriptor closed since it was listed (this loop's own reads of fdinfo) has none.
        let Ok(info) = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")) else {
            continue;
        };
        let flags = info
            .lines()
            .find_map(|l| l.strip_prefix("flags:"))
            .and_then(|f| i32::from_str_radix(f.trim(), 8).ok())
            .with_context(|| format!("no flags in /proc/self/fdinfo/{fd}"))?;
        if flags & cloexec == 0 {
            inherited.push(fd);
        }
    }
    for &fd in &inherited {
        nix::unistd::close(fd).with_context(|| format!("cannot close descriptor {fd}"))?;
    }
    Ok(inherited)
}

/// Starts `llms serve` in the background on `socket` (with `model` if given), waits until it
/// listens, and returns its pid and log file. The daemon outlives the caller.
pub fn start_background(socket: &Path, model: Option<&Path>) -> anyhow::Result<(u32, PathBuf)> {
    mkdir_for(socket)?;
    let log = socket.with_file_name("serve.log");
    // Appended to, so the log of an earlier daemon on this socket is kept.
    let log_file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log)
        .with_context(|| format!("cannot create the daemon's log {}", log.display()))?;
    let exe = std::env::current_exe().context("cannot find the llms executable")?;
    let mut cmd = Command::new(exe);
    cmd.arg("serve").arg("--socket").arg(socket);
    if let Some(m) = model {
        cmd.arg("--model").arg(m);
    }
    let mut child = {
        use std::os::unix::process::CommandExt;
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log_file)
            // Its own process group: a Ctrl-C in this terminal does not stop the service.
            .process_group(0)
            .spawn()
            .context("cannot start llms serve")?
    };
    let pid = child.id();
    let out = child.stdout.take().context("no pipe from llms serve")?;
    let mut line = String::new();
    BufReader::new(out).read_line(&mut line)?;
    if !line.starts_with("llms serve: listening") {
        let status = child.wait()?;
        bail!(
            "llms serve exited ({status}) before it listened; see {}",
            log.display()
        );
    }
    Ok((pid, log))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_fills_what_flags_and_variables_left_unset() {
        let file = || {
            toml::from_str::<ServeArgs>(
                "kv-budget = 1024\nmin-kv-budget = \"1K\"\nqueue = 3\nno-mount = true\n\
                 no-window = true\n",
            )
            .unwrap()
        };
        let mut a = ServeArgs {
            kv_budget: Some(Bytes(1 << 30)),
            mount: Some("/m".into()),
            ..ServeArgs::default()
        };
        layer(&mut a, file());
        assert_eq!(
            (a.kv_budget, a.min_kv_budget, a.queue),
            (Some(Bytes(1 << 30)), Some(Bytes(1024)), Some(3))
        );
        // A flag's mount beats the file's no-mount; the file's no-window holds.
        assert_eq!(
            (a.mount.as_deref(), a.no_mount),
            (Some("/m".as_ref()), false)
        );
        assert!(a.no_window);
        let mut a = ServeArgs::default();
        layer(&mut a, file());
        assert!(a.no_mount && a.mount.is_none());
    }
}
