//! The arguments and start-up steps that several `llms` commands share: which model and how to
//! load it, where models are cached, the daemon's socket, byte sizes, and the mount guard.
//! One home for each, so every command parses and explains an option the same way.

use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Args;
use model::fetch::{self, FetchOptions, Progress};
use model::int8gemm::PrefillActs;
use model::kv::{HeapChunks, KvCache, KvFormat};
use model::qmatrix::Activations;
use model::tokenizer::Tokenizer;
use model::{Model, WeightOptions};

/// Where models are cached, for every command that needs one.
#[derive(Args, Debug, Clone)]
pub struct ModelsDirArg {
    /// The models cache [default: $LLMS_MODELS_DIR, else $XDG_CACHE_HOME/llms/models,
    /// else ~/.cache/llms/models]
    #[arg(long, global = true, value_name = "DIR")]
    pub models_dir: Option<PathBuf>,
}

impl ModelsDirArg {
    /// Fetch options for this directory, with progress on stderr.
    pub fn fetch_options(&self) -> FetchOptions {
        FetchOptions {
            models_dir: self.models_dir.clone(),
            progress: Progress::Stderr,
            ..FetchOptions::default()
        }
    }
}

/// Which model to run and how.
#[derive(Args, Debug, Clone)]
pub struct EngineOpts {
    /// A known model's name (smollm2-135m, gemma3-270m: fetched into the cache if missing) or a
    /// GGUF file [default: smollm2-135m]
    #[arg(long, env = "LLMS_MODEL", value_name = "NAME|FILE")]
    pub model: Option<PathBuf>,
    #[command(flatten)]
    pub dir: ModelsDirArg,
    /// Threads for the engine's kernels [default: the number of CPUs]
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
    /// Format of sealed KV chunks
    #[arg(long, default_value = "f16", value_name = "FORMAT", value_parser = ["f16", "int8", "int4", "int2", "k8v8", "k4v4", "k4v3"])]
    pub kv_format: String,
    /// Tokens per KV chunk (1 to 256) [default: the model's: 16, and 32 for Gemma 3]
    #[arg(long, value_name = "N",
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=256))]
    pub chunk_tokens: Option<usize>,
    /// Tokens per prefill step (one set of shapes serves every prompt length) [default: the
    /// model's: 16 of its chunks, 256 tokens, and 512 for Gemma 3]
    #[arg(long, value_name = "N")]
    pub prefill_chunk: Option<usize>,
    /// Activations of single-token products: f32 (exact); int8 (8 bits per 32 values,
    /// multiplied in integers as llama.cpp does, four rows a pass with AVX-512 VNNI or AVX2;
    /// perplexity +0.4% on the default model, +0.2-0.6% on Gemma 3, and near-tied tokens flip,
    /// which the 135M default model does not survive); int16 (the int8 codes and each value's
    /// remainder in 256ths of a step, multiplied twice in integers, Q4_1 and Q8_0 only, with
    /// AVX-512 VNNI or AVX2: the default model's perplexity and answers as f32's, decode
    /// 1.1-1.3x faster; f32 for the other formats); auto is int16 for Q4_1 and Q8_0 and int8
    /// for the K-quant and Q4_0/Q5_0/Q5_1 matrices where the CPU has AVX2 (their f32 kernels
    /// are slower than memory), f32 elsewhere
    #[arg(long, default_value = "auto", value_name = "KIND", value_parser = ["auto", "f32", "int8", "int16"])]
    pub activations: String,
    /// Activations of batched products (prefill, recompute): f32 GEMM over dequantized weight
    /// tiles (the reference), or int8 codes per 32 values multiplied in integers (about 2x faster
    /// prefill with AVX-512 VNNI, 1.5-1.7x with AVX2 or AVX-VNNI, portable and slow without;
    /// perplexity +0.1-0.4%, but a near-tied first token can flip); auto is int8 where the CPU
    /// has AVX2, f32 elsewhere
    #[arg(long, default_value = "f32", value_name = "KIND", value_parser = ["auto", "f32", "int8"])]
    pub prefill_activations: String,
    /// Bytes of weights held in memory (suffixes K, M, G): the matrices that do not fit are read
    /// from the model file for every token, ahead of the compute [default: all resident]
    #[arg(long, env = "LLMS_WEIGHT_BUDGET", value_name = "BYTES")]
    pub weight_budget: Option<String>,
}

impl EngineOpts {
    /// How to hold the weights: `--weight-budget`, else all resident.
    pub fn weight_options(&self) -> anyhow::Result<WeightOptions> {
        let budget = self
            .weight_budget
            .as_deref()
            .map(parse_bytes)
            .transpose()
            .context("--weight-budget")?;
        Ok(WeightOptions {
            budget,
            ..WeightOptions::default()
        })
    }
}

/// A loaded model with its tokenizer.
pub struct Loaded {
    pub model: Model,
    pub tokenizer: Tokenizer,
    pub format: KvFormat,
    pub chunk_tokens: usize,
}

impl Loaded {
    /// An empty KV cache for one context of up to the model's maximum length.
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(
            self.model.chunk_shape(self.chunk_tokens),
            self.format,
            self.model.cfg.max_ctx,
            Box::new(HeapChunks::default()),
        )
    }
}

/// Sets the engine's thread count once per process.
pub fn init_threads(threads: Option<usize>) -> anyhow::Result<usize> {
    let n = threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    if !(1..=1024).contains(&n) {
        bail!("--threads must be from 1 to 1024");
    }
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global()
        .context("cannot start the engine's thread pool")?;
    Ok(n)
}

/// The model file: `--model`, else the default model, fetched if missing.
pub fn model_path(opts: &EngineOpts) -> anyhow::Result<PathBuf> {
    resolve_model(opts.model.as_deref(), &opts.dir)
}

/// The model file a `--model` value names, as every command takes it ([`fetch::resolve`]): none
/// is the default model, a known model's name (`llms model ls`) is that model, both fetched into
/// the cache if missing; anything else is a GGUF file's path.
pub fn resolve_model(model: Option<&Path>, dir: &ModelsDirArg) -> anyhow::Result<PathBuf> {
    let spec = match model {
        None => Some(&fetch::DEFAULT_MODEL),
        Some(m) => m.to_str().and_then(fetch::known_model),
    };
    fetch::resolve(&dir.fetch_options(), model).with_context(|| match spec {
        Some(spec) => format!(
            "cannot get the model {} (try `llms model fetch {}`)",
            spec.name, spec.name
        ),
        None => "cannot resolve --model".to_owned(),
    })
}

/// Loads the model and its tokenizer as `opts` says.
pub fn load(opts: &EngineOpts) -> anyhow::Result<Loaded> {
    init_threads(opts.threads)?;
    if opts.chunk_tokens.is_some_and(|c| !(1..=256).contains(&c)) || opts.prefill_chunk == Some(0) {
        bail!("--chunk-tokens must be from 1 to 256 and --prefill-chunk at least 1");
    }
    opts.weight_options()?;
    let path = model_path(opts)?;
    load_path(&path, opts)
}

pub fn load_path(path: &Path, opts: &EngineOpts) -> anyhow::Result<Loaded> {
    let t = Instant::now();
    let mut model =
        Model::load_with(path, &opts.weight_options()?).context("cannot load the model")?;
    if let Some(step) = opts.prefill_chunk {
        model.prefill_chunk = step;
    }
    model.set_activations(match opts.activations.as_str() {
        "int8" => Activations::Int8,
        "int16" => Activations::Int16,
        "auto" => Activations::Auto,
        _ => Activations::F32,
    });
    model.set_prefill_activations(prefill_acts(&opts.prefill_activations));
    let tokenizer = Tokenizer::from_gguf_file(path)
        .with_context(|| format!("cannot build the tokenizer of {}", path.display()))?;
    tracing::info!(secs = t.elapsed().as_secs_f64(), "loaded");
    Ok(Loaded {
        tokenizer,
        format: opts.kv_format.parse()?,
        chunk_tokens: opts
            .chunk_tokens
            .unwrap_or_else(|| model.cfg.chunk_tokens()),
        model,
    })
}

/// `--prefill-activations` as the engine's setting.
pub fn prefill_acts(kind: &str) -> PrefillActs {
    match kind {
        "int8" => PrefillActs::Int8,
        "f32" => PrefillActs::F32,
        _ => PrefillActs::Auto,
    }
}

/// The socket option every client command shares.
#[derive(Args, Debug, Clone)]
pub struct SocketArg {
    /// The daemon's socket [default: $XDG_RUNTIME_DIR/llms/llms.sock, /run/llms/llms.sock as
    /// root]
    #[arg(long, env = "LLMS_SOCKET", value_name = "PATH")]
    pub socket: Option<PathBuf>,
}

impl SocketArg {
    pub fn path(&self) -> PathBuf {
        self.socket.clone().unwrap_or_else(default_socket)
    }
}

/// A byte size as a flag or variable gives it ([`parse_bytes`]) or a config file does: a number
/// of bytes, or a string [`parse_bytes`] reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bytes(pub u64);

impl std::str::FromStr for Bytes {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Bytes> {
        parse_bytes(s).map(Bytes)
    }
}

impl<'de> serde::Deserialize<'de> for Bytes {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Bytes, D::Error> {
        struct Size;

        impl serde::de::Visitor<'_> for Size {
            type Value = Bytes;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a size like \"512M\", or a number of bytes")
            }

            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<Bytes, E> {
                Ok(Bytes(n))
            }

            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<Bytes, E> {
                u64::try_from(n)
                    .map(Bytes)
                    .map_err(|_| E::custom(format!("a size must not be negative, not {n}")))
            }

            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Bytes, E> {
                parse_bytes(s).map(Bytes).map_err(E::custom)
            }
        }

        d.deserialize_any(Size)
    }
}

/// Parses `512M`, `1G`, `1048576`, `256MiB`.
pub fn parse_bytes(s: &str) -> anyhow::Result<u64> {
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(digits);
    let n: u64 = num
        .parse()
        .with_context(|| format!("{s:?} is not a size (try 512M or 1G)"))?;
    let mul: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => bail!("{s:?} is not a size (suffixes K, M, G)"),
    };
    n.checked_mul(mul)
        .with_context(|| format!("{s:?} is too large"))
}

/// How `llms` starts its mount guard: this same program, `kvfs guard`.
pub fn guard_command() -> anyhow::Result<kvfs::guard::GuardCommand> {
    Ok(kvfs::guard::GuardCommand {
        program: std::env::current_exe().context("cannot find this program to run its guard")?,
        args: vec!["kvfs".into(), "guard".into()],
    })
}

pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

pub fn env_dir(var: &str) -> Option<PathBuf> {
    std::env::var_os(var)
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
}

/// The socket when none is given: `/run/llms/llms.sock` as root, else
/// `$XDG_RUNTIME_DIR/llms/llms.sock`, else `/tmp/llms-UID/llms.sock`.
pub fn default_socket() -> PathBuf {
    if is_root() {
        return PathBuf::from("/run/llms/llms.sock");
    }
    match env_dir("XDG_RUNTIME_DIR") {
        Some(d) => d.join("llms/llms.sock"),
        None => PathBuf::from(format!("/tmp/llms-{}/llms.sock", nix::unistd::getuid())),
    }
}

/// Removes a socket file left by a daemon that died; refuses if a daemon answers on it.
pub fn clear_stale_socket(path: &Path) -> anyhow::Result<()> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("cannot look at {}", path.display())),
        Ok(md) if !md.file_type().is_socket() => bail!(
            "{} exists and is not a socket; remove it or pass another --socket",
            path.display()
        ),
        Ok(_) => match UnixStream::connect(path) {
            Ok(_) => bail!(
                "a daemon already listens on {}; stop it or pass another --socket",
                path.display()
            ),
            Err(_) => {
                std::fs::remove_file(path).with_context(|| {
                    format!("cannot remove the stale socket {}", path.display())
                })?;
                tracing::info!(socket = %path.display(), "removed a stale socket");
                Ok(())
            }
        },
    }
}

pub fn mkdir_for(path: &Path) -> anyhow::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    Ok(())
}
