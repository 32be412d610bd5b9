//! A real `llms serve` process for the benchmarks that drive the daemon from outside (`bench
//! crash`, `bench switch`): started from this very executable on a scratch directory (store,
//! socket, kvfs mount), with extra flags, optionally inside cgroups from its first instruction;
//! stopped by SIGTERM (drained) or SIGKILL (a crash).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use anyhow::{Context, bail, ensure};

/// How to start the daemon.
#[derive(Debug, Clone, Default)]
pub struct DaemonSpec {
    /// The GGUF model.
    pub model: PathBuf,
    /// The scratch directory: `store/`, `run/llms.sock`, `run/kv` (the mount).
    pub dir: PathBuf,
    /// Flags after the socket, store and model ones (`--kv-budget 64M`, `--manager lmk`).
    pub args: Vec<String>,
    /// cgroup v1 groups (directories) the daemon runs in from its start, so what it loads and
    /// reads is charged and throttled there.
    pub cgroups: Vec<PathBuf>,
    /// The daemon's `RUST_LOG` (its log goes to this process's stderr).
    pub log: String,
}

impl DaemonSpec {
    /// The daemon on `dir` with `model`, no extra flags, logging errors only.
    pub fn new(model: &Path, dir: &Path) -> DaemonSpec {
        DaemonSpec {
            model: model.to_owned(),
            dir: dir.to_owned(),
            args: Vec::new(),
            cgroups: Vec::new(),
            log: "error".into(),
        }
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.join("run/llms.sock")
    }

    pub fn store(&self) -> PathBuf {
        self.dir.join("store")
    }

    /// Where the daemon mounts kvfs: `kv` beside the socket.
    pub fn mountpoint(&self) -> PathBuf {
        self.dir.join("run/kv")
    }
}

/// A running daemon; killed (SIGKILL) when dropped.
pub struct Daemon {
    child: Option<Child>,
    pid: u32,
}

impl Daemon {
    /// Starts the daemon and waits until it listens; returns it and the milliseconds from spawn
    /// to listening (store recovered, mount up).
    pub fn start(spec: &DaemonSpec) -> anyhow::Result<(Daemon, f64)> {
        let t = Instant::now();
        let exe =
            std::env::current_exe().context("cannot find this program to start its daemon")?;
        let mut cmd = Command::new(exe);
        cmd.arg("serve")
            .arg("--socket")
            .arg(spec.socket())
            .arg("--store")
            .arg(spec.store())
            .arg("--create")
            .arg("--model")
            .arg(&spec.model)
            .arg("--no-pressure")
            // A bench killed (Ctrl-C, SIGKILL) takes its daemon and mount with it.
            .arg("--exit-with-parent")
            .args(&spec.args)
            .env_remove("LLMS_CONFIG")
            .env("RUST_LOG", &spec.log)
            .stdin(Stdio::null())
            .stdout(Stdio::piped());
        let mut child = spawn_in(&mut cmd, &spec.cgroups)?;
        let mut line = String::new();
        BufReader::new(child.stdout.take().context("no stdout")?).read_line(&mut line)?;
        if !line.starts_with("llms serve: listening") {
            let status = child.wait()?;
            bail!("the daemon did not start ({status}): {line:?}");
        }
        let pid = child.id();
        Ok((
            Daemon {
                child: Some(child),
                pid,
            },
            t.elapsed().as_secs_f64() * 1e3,
        ))
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// SIGKILL: a crash at this very moment.
    pub fn kill9(&mut self) -> anyhow::Result<()> {
        if let Some(mut c) = self.child.take() {
            c.kill()?;
            c.wait()?;
        }
        Ok(())
    }

    /// SIGTERM, and a check that the daemon drained and exited cleanly.
    pub fn term(&mut self) -> anyhow::Result<()> {
        if let Some(mut c) = self.child.take() {
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(c.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            )?;
            let status = c.wait()?;
            ensure!(
                status.success(),
                "the daemon did not drain cleanly: {status}"
            );
        }
        Ok(())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.kill9();
    }
}

/// Spawns `cmd` as a member of `cgroups` from its first instruction: this process joins them,
/// forks the child (which inherits them) and goes back to its own groups at once. Only the
/// moment of the fork is charged to the groups, and no `pre_exec` (unsafe) is needed.
pub fn spawn_in(cmd: &mut Command, cgroups: &[PathBuf]) -> anyhow::Result<Child> {
    let me = std::process::id();
    let mut homes = Vec::new();
    for g in cgroups {
        // The controller is the first component under the cgroup root (`.../memory/...`).
        let controller = g
            .strip_prefix(crate::cgroup::ROOT)
            .ok()
            .and_then(|p| p.components().next())
            .and_then(|c| c.as_os_str().to_str())
            .with_context(|| format!("{} is not a cgroup v1 group", g.display()))?;
        homes.push(crate::cgroup::own_group(controller)?);
    }
    let joined: anyhow::Result<()> = cgroups
        .iter()
        .try_for_each(|g| Ok(crate::cgroup::move_to(g, me)?));
    let child = joined.and_then(|()| cmd.spawn().context("cannot start the process"));
    for h in &homes {
        crate::cgroup::move_to(h, me)?;
    }
    child
}
