//! The mount's guard: a small child process that aborts the mount's FUSE connection when the
//! process serving the mount dies.
//!
//! Why it exists: a process that serves a FUSE mount and also reads and writes through it (the
//! service does: its chunks move through the mount) cannot die while one of its own requests is in
//! flight. The kernel waits, uninterruptibly, for the answer; the threads that would answer are
//! gone; and the `/dev/fuse` descriptor whose close would abort the connection stays open until
//! that waiting thread exits. A `kill -9` at that moment would leave an unkillable process behind.
//! The guard breaks the cycle: the kernel signals it when its parent thread dies
//! (`PR_SET_PDEATHSIG`), and it aborts the connection through the fuse control filesystem
//! (`/sys/fs/fuse/connections/<n>/abort`), which fails the waiting request so the process can
//! finish dying; then it detaches the dead mount. On a clean unmount the guard is killed first.
//!
//! The guard runs a program the caller names (`llms` runs itself as `llms kvfs guard`), because a
//! library cannot fork safely inside a threaded process.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use std::os::fd::AsFd;

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};

/// Where the fuse control filesystem lives.
pub const FUSECTL: &str = "/sys/fs/fuse/connections";

/// The signal the kernel sends the guard when its parent dies: one that a terminal's Ctrl-C or a
/// service manager's stop (SIGINT, SIGTERM to the whole group) does not send, so a draining
/// service keeps its mount.
const PARENT_DIED: Signal = Signal::SIGUSR1;

/// How often (milliseconds) the guard looks at its parent's state besides waiting for the signal.
const PARENT_POLL_MS: u16 = 200;

/// How to start a guard: a program and the arguments that make it call [`run`] with the arguments
/// kvfs appends (`--parent PID --mountpoint DIR --connection N`).
#[derive(Clone, Debug)]
pub struct GuardCommand {
    pub program: PathBuf,
    pub args: Vec<OsString>,
}

/// A running guard; killed (without aborting anything) when dropped.
#[derive(Debug)]
pub struct Guard {
    child: Child,
}

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What went wrong starting or running a guard.
#[derive(Debug, thiserror::Error)]
pub enum GuardError {
    #[error("{path} is not a FUSE mount point")]
    NotMounted { path: PathBuf },
    #[error("starting the mount guard {program}: {source}")]
    Spawn {
        program: PathBuf,
        source: std::io::Error,
    },
    #[error("the mount guard: {what}: {source}")]
    Sys {
        what: &'static str,
        source: nix::errno::Errno,
    },
}

/// The FUSE connection number of the mount at `mountpoint` (the minor of its device), read from
/// /proc/self/mountinfo.
pub fn connection_of(mountpoint: &Path) -> Option<u32> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let want = mountpoint.to_string_lossy();
    info.lines().rev().find_map(|l| {
        let mut f = l.split(' ');
        let dev = f.nth(2)?;
        let mp = f.nth(1)?;
        if unescape(mp) != want || !l.contains(" - fuse") {
            return None;
        }
        dev.strip_prefix("0:")?.parse().ok()
    })
}

/// Starts a guard for the mount at `mountpoint`, a child of the calling thread: call it from a
/// thread that lives as long as the process (the kernel signals the guard when that thread exits).
pub fn spawn(cmd: &GuardCommand, mountpoint: &Path) -> Result<Guard, GuardError> {
    // mountinfo names mount points by their resolved absolute path (as fuser mounted it).
    let not_mounted = || GuardError::NotMounted {
        path: mountpoint.to_owned(),
    };
    let mountpoint = &mountpoint.canonicalize().map_err(|_| not_mounted())?;
    let connection = connection_of(mountpoint).ok_or_else(not_mounted)?;
    let child = Command::new(&cmd.program)
        .args(&cmd.args)
        .arg("--parent")
        .arg(std::process::id().to_string())
        .arg("--mountpoint")
        .arg(mountpoint)
        .arg("--connection")
        .arg(connection.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .map_err(|source| GuardError::Spawn {
            program: cmd.program.clone(),
            source,
        })?;
    tracing::debug!(pid = child.id(), connection, "kvfs mount guard started");
    Ok(Guard { child })
}

/// The guard's body, run in the child process: waits until `parent` dies, then aborts FUSE
/// connection `connection` if it is still the mount at `mountpoint`, and detaches that mount.
pub fn run(parent: u32, mountpoint: &Path, connection: u32) -> Result<(), GuardError> {
    let sys = |what| move |source| GuardError::Sys { what, source };
    let mut wait = SigSet::empty();
    wait.add(PARENT_DIED);
    wait.thread_block().map_err(sys("blocking signals"))?;
    // A stop of the whole process group is the parent's to handle: the guard outlives it.
    let mut ignore = SigSet::empty();
    ignore.add(Signal::SIGINT);
    ignore.add(Signal::SIGTERM);
    ignore.add(Signal::SIGHUP);
    ignore.thread_block().map_err(sys("blocking signals"))?;
    nix::sys::prctl::set_pdeathsig(PARENT_DIED).map_err(sys("PR_SET_PDEATHSIG"))?;
    ensure_fusectl();
    let signals = SignalFd::with_flags(&wait, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC)
        .map_err(sys("signalfd"))?;
    // The signal alone is not enough. If the parent is killed before the signal was asked for,
    // the kernel hands the guard to a sibling thread of the dying parent without a signal, and
    // getppid() still names the parent's process; when that thread is the one stuck on the
    // mount, no second signal ever comes. So the guard also looks at the parent every
    // `PARENT_POLL_MS`: a process whose main thread is a zombie is dying (or dead and unreaped).
    while parent_alive(parent) {
        let mut fds = [PollFd::new(signals.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::from(PARENT_POLL_MS)) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(sys("waiting")(e)),
        }
        if matches!(signals.read_signal(), Ok(Some(s)) if s.ssi_signo == PARENT_DIED as u32) {
            break;
        }
    }
    if connection_of(mountpoint) != Some(connection) {
        return Ok(());
    }
    let abort = Path::new(FUSECTL)
        .join(connection.to_string())
        .join("abort");
    match std::fs::write(&abort, b"1") {
        Ok(()) => tracing::warn!(
            mountpoint = %mountpoint.display(),
            connection,
            "kvfs guard: the mount's server died; aborted its FUSE connection"
        ),
        Err(e) => tracing::warn!(path = %abort.display(), error = %e, "kvfs guard: cannot abort"),
    }
    let _ = nix::mount::umount2(mountpoint, nix::mount::MntFlags::MNT_DETACH);
    Ok(())
}

/// Whether process `pid` is alive: it exists and its main thread is not a zombie. A killed
/// process whose other threads are still stuck in the kernel shows its main thread as `Z`.
fn parent_alive(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // `pid (comm) state ...`: comm may hold spaces and parentheses, so split at the last ')'.
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().next());
    !matches!(state, Some("Z" | "X" | "x") | None)
}

/// Mounts the fuse control filesystem if it is not (needs root; without it the guard can only
/// detach).
fn ensure_fusectl() {
    let ctl = Path::new(FUSECTL);
    let mounted = std::fs::read_to_string("/proc/self/mountinfo")
        .map(|i| {
            i.lines()
                .any(|l| l.split(' ').nth(4) == Some(FUSECTL) && l.contains(" - fusectl "))
        })
        .unwrap_or(false);
    if !mounted
        && let Err(e) = nix::mount::mount(
            Some("fusectl"),
            ctl,
            Some("fusectl"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        )
    {
        tracing::warn!(
            error = %e,
            "kvfs guard: cannot mount the fuse control filesystem at {FUSECTL}"
        );
    }
}

/// A mountinfo path field with its octal escapes undone.
fn unescape(s: &str) -> String {
    s.replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_zombie_or_vanished_parent_counts_as_dead() {
        assert!(parent_alive(std::process::id()));
        let mut child = Command::new("true").spawn().unwrap();
        let pid = child.id();
        // Unreaped, the exited child stays a zombie until wait.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while parent_alive(pid) {
            assert!(std::time::Instant::now() < deadline, "child never exited");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        assert!(stat.contains(") Z "), "{stat}");
        child.wait().unwrap();
        assert!(!parent_alive(pid));
    }
}
