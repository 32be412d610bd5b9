//! End-to-end tests of llms live in `tests/tests/`; this library holds their shared helpers:
//! a tiny random-weight model, a real `llms serve` process on a real socket, and the same
//! calls run on a local context manager to compare with.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::Instant;

use model::Model;
use model::tiny::{TinySpec, write_tiny_gguf};
use model::tokenizer::Tokenizer;
use protocol::PromptFormat;
use protocol::client::{Answer, CallParams, Client};
use service::{CallOptions, Manager, ManagerConfig, Owner};

/// The most tokens a context holds in these tests: the tiny model's context length, which the
/// daemon takes as its limit.
pub const MAX_CONTEXT: usize = 1024;

/// A temporary directory (readable by every uid, for the ownership test) with a tiny model.
pub struct World {
    pub dir: tempfile::TempDir,
    pub model: PathBuf,
    /// The `llms` binary (an integration test passes `env!("CARGO_BIN_EXE_llms-e2e")`).
    pub bin: PathBuf,
}

impl World {
    pub fn new(bin: &str) -> World {
        World::with_spec(bin, TinySpec::default())
    }

    /// A world whose tiny model has a ChatML template.
    pub fn chat(bin: &str) -> World {
        let spec = TinySpec {
            chat_template: Some(model::tiny::TINY_CHATML.into()),
            ..TinySpec::default()
        };
        World::with_spec(bin, spec)
    }

    /// A world that serves the model file `model` (the real model, fetched by the caller).
    pub fn with_model(bin: &str, model: &Path) -> World {
        let dir = tempfile::tempdir().unwrap();
        World {
            dir,
            model: model.to_owned(),
            bin: bin.into(),
        }
    }

    fn with_spec(bin: &str, spec: TinySpec) -> World {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        let model = dir.path().join("tiny.gguf");
        let spec = TinySpec {
            max_ctx: MAX_CONTEXT,
            ..spec
        };
        write_tiny_gguf(&model, &spec).unwrap();
        World {
            dir,
            model,
            bin: bin.into(),
        }
    }

    /// The `llms` command.
    pub fn llms(&self) -> Command {
        Command::new(&self.bin)
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("run/llms.sock")
    }

    pub fn store(&self) -> PathBuf {
        self.dir.path().join("store")
    }

    /// Where the daemon mounts kvfs by default: `kv` beside the socket.
    pub fn mountpoint(&self) -> PathBuf {
        self.dir.path().join("run/kv")
    }

    /// `llms serve` on this world's socket and store, with `extra` flags.
    pub fn serve(&self, extra: &[&str]) -> Serve {
        Serve::start(self, extra)
    }

    pub fn connect(&self, app: &str) -> Client {
        Client::connect(&self.socket(), app).unwrap()
    }

    /// The tokenizer of the tiny model.
    pub fn tokenizer(&self) -> Tokenizer {
        Tokenizer::from_gguf_file(&self.model).unwrap()
    }
}

impl Drop for World {
    /// A daemon killed last leaves its dead mount behind (the next daemon would clean it): detach
    /// it, so the directory can go.
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.mountpoint(), nix::mount::MntFlags::MNT_DETACH);
    }
}

/// Whether `path` is a mount point now (from /proc/self/mountinfo).
pub fn is_mount_point(path: &Path) -> bool {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let want = path.to_string_lossy();
    info.lines().any(|l| l.split(' ').nth(4) == Some(&*want))
}

/// What moved through a mount, from its `/stats`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MountCounts {
    /// Chunk reads the store served itself: the direct path, the `kv` file or a chunk file.
    pub store_reads: u64,
    /// Chunk slots the daemon served through `kv` and `data` files.
    pub daemon_reads: u64,
    /// `data` opens passed through to the data file (their reads never reach the daemon).
    pub passthrough_opens: u64,
    /// Chunk images committed through `kv` files.
    pub kv_writes: u64,
}

/// A mount's counters, from its `/stats`.
pub fn mount_counts(mountpoint: &Path) -> MountCounts {
    let stats = std::fs::read_to_string(mountpoint.join("stats")).unwrap();
    let numbers = |prefix: &str| -> Vec<u64> {
        let line = stats
            .lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix} line in {stats}"));
        line.split(|c: char| !c.is_ascii_digit())
            .filter_map(|w| w.parse().ok())
            .collect()
    };
    let kv = numbers("kv file");
    MountCounts {
        store_reads: numbers("reads")[0],
        daemon_reads: kv[0],
        passthrough_opens: kv[1],
        kv_writes: kv[2],
    }
}

/// A running `llms serve`; killed (SIGKILL) when dropped.
pub struct Serve {
    child: Option<Child>,
    pub ready_line: String,
}

impl Serve {
    fn start(w: &World, extra: &[&str]) -> Serve {
        let mut cmd = w.llms();
        cmd.arg("serve")
            .arg("--socket")
            .arg(w.socket())
            .arg("--store")
            .arg(w.store())
            .arg("--create")
            .arg("--model")
            .arg(&w.model)
            .args(["--threads", "1"])
            .args(extra)
            .env_remove("LLMS_CONFIG")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped());
        let mut child = cmd.spawn().unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(
            line.starts_with("llms serve: listening"),
            "the daemon did not start: {:?} {:?}",
            line,
            child.wait()
        );
        Serve {
            child: Some(child),
            ready_line: line,
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().unwrap().id() as i32
    }

    fn signal(&mut self, s: nix::sys::signal::Signal) -> ExitStatus {
        let mut c = self.child.take().unwrap();
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(c.id() as i32), s).unwrap();
        c.wait().unwrap()
    }

    /// SIGTERM, and the exit status once drained.
    pub fn term(mut self) -> ExitStatus {
        self.signal(nix::sys::signal::Signal::SIGTERM)
    }

    /// SIGKILL: a crash at this very moment.
    pub fn kill9(mut self) {
        self.signal(nix::sys::signal::Signal::SIGKILL);
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Greedy raw calls of `max_tokens`.
pub fn raw(max_tokens: usize) -> CallParams {
    CallParams {
        format: PromptFormat::Raw,
        max_tokens,
        ..CallParams::default()
    }
}

/// One answer through the daemon.
pub fn ask(c: &mut Client, ctx: u64, prompt: &str, max_tokens: usize) -> Answer {
    c.call(ctx, prompt, &raw(max_tokens))
        .unwrap()
        .collect_answer()
        .unwrap()
}

/// The answers a local context manager gives to `prompts`, one context, raw greedy calls of
/// `max_tokens`: what the daemon must answer for the same history.
pub fn local_answers(w: &World, prompts: &[&str], max_tokens: usize) -> Vec<Vec<u32>> {
    let tok = w.tokenizer();
    let calls: Vec<Vec<u32>> = prompts.iter().map(|p| tok.encode(p)).collect();
    local_token_answers(w, &calls, max_tokens)
}

/// [`local_answers`] for calls given as tokens.
pub fn local_token_answers(w: &World, calls: &[Vec<u32>], max_tokens: usize) -> Vec<Vec<u32>> {
    let model = Arc::new(Model::load(&w.model).unwrap());
    let tok = w.tokenizer();
    let store = tempfile::tempdir().unwrap();
    let mut cfg = ManagerConfig::new(store.path().join("store"), 256 << 20);
    cfg.max_tokens = MAX_CONTEXT;
    let mut m = Manager::open(model, cfg).unwrap();
    let o = Owner {
        uid: 0,
        app: "local".into(),
    };
    let id = m.create(&o, &[]).unwrap();
    let opts = CallOptions {
        max_tokens,
        stop: tok.stop_ids(),
        ..CallOptions::default()
    };
    calls
        .iter()
        .map(|t| {
            m.call(&o, id, t, &opts, Instant::now(), |_| true)
                .unwrap()
                .tokens
        })
        .collect()
}

/// A seed from the clock unless `LLMS_TEST_SEED` gives one; printed so a failure replays.
pub fn seed(test: &str) -> u64 {
    let seed = std::env::var("LLMS_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    // The test harness shows a failing test's output, so a failure names its seed.
    #[allow(clippy::print_stderr)]
    {
        eprintln!("{test}: seed {seed} (replay with LLMS_TEST_SEED={seed})");
    }
    seed
}

/// Whether `path` exists (for readable assertions).
pub fn exists(path: &Path) -> bool {
    path.exists()
}

/// One reply line of a raw connection to the daemon, as JSON.
pub fn reply_line(r: &mut BufReader<std::os::unix::net::UnixStream>) -> serde_json::Value {
    let mut l = String::new();
    r.read_line(&mut l).unwrap();
    serde_json::from_str(&l).unwrap_or_else(|e| panic!("{e}: {l:?}"))
}

/// A raw version 1 connection to `w`'s daemon, its hello said (app `old`) and one context made
/// on it: the reader, the writer and the context's id.
pub fn v1_connection(
    w: &World,
) -> (
    BufReader<std::os::unix::net::UnixStream>,
    std::os::unix::net::UnixStream,
    u64,
) {
    use std::io::Write;
    let s = std::os::unix::net::UnixStream::connect(w.socket()).unwrap();
    let mut out = s.try_clone().unwrap();
    let mut r = BufReader::new(s);
    out.write_all(b"{\"op\":\"hello\",\"id\":1,\"version\":1,\"app\":\"old\"}\n")
        .unwrap();
    assert_eq!(reply_line(&mut r)["version"], 1);
    out.write_all(b"{\"op\":\"new\",\"id\":2}\n").unwrap();
    let ctx = reply_line(&mut r)["context"].as_u64().unwrap();
    (r, out, ctx)
}
