//! Mounting and unmounting: the mount's options and errors, a stale mount left by a killed server
//! cleaned up, the live [`Mount`] (unmounted on drop) with its guard ([`crate::guard`]), and the
//! signals `llms kvfs mount` waits for.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use fuser::{BackgroundSession, Config, MountOption, SessionACL};

use super::state::{KvFs, MountCounters};
use crate::store::Store;

/// How to mount.
#[derive(Clone, Debug)]
pub struct MountConfig {
    /// Refuse every write (EROFS), and mount with `ro`.
    pub read_only: bool,
    /// FUSE worker threads, each reading its own cloned `/dev/fuse` descriptor: as many as the
    /// parallel requests the daemon serves (chunk writes, and reads where `data` is not passed
    /// through; each blocks on its chunk's disk I/O).
    pub threads: usize,
    /// Let the kernel cache context directories' attributes for a second. This saves two
    /// `getattr` round trips per chunk open (the kernel checks permissions on each directory of
    /// the path), but within that second a uid that does not own a context, and guesses its id,
    /// can `stat` its directory (it still cannot list or read it). Off by default.
    pub cache_dir_attrs: bool,
    /// Pass `data` files (opened with `O_DIRECT`, read-only) through to the context's data file
    /// (FUSE passthrough): the kernel then serves their reads without a request to the daemon,
    /// and the reader checks each chunk itself ([`crate::MountReader`]). Needs `CAP_SYS_ADMIN`
    /// and a kernel with `CONFIG_FUSE_PASSTHROUGH`; without either, the daemon serves them. On by
    /// default.
    pub passthrough: bool,
}

impl Default for MountConfig {
    fn default() -> Self {
        MountConfig {
            read_only: false,
            threads: 4,
            cache_dir_attrs: false,
            passthrough: true,
        }
    }
}

/// What went wrong mounting or unmounting.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error("{path} is already a live mount; unmount it first (umount {path})")]
    AlreadyMounted { path: PathBuf },
    #[error("cannot clean up the stale mount at {path}: {source}")]
    Stale { path: PathBuf, source: nix::Error },
    #[error("mount point {path}: {source}")]
    MountPoint {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("mount {path}: {source} (is /dev/fuse there and are we root?)")]
    Mount {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("unmount {path}: {source}")]
    Unmount {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// A live mount; dropping it unmounts (also while a panic unwinds, so tests never leak mounts).
pub struct Mount {
    session: Option<BackgroundSession>,
    path: PathBuf,
    guard: Option<crate::guard::Guard>,
    counters: Arc<MountCounters>,
}

impl std::fmt::Debug for Mount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mount")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl Mount {
    /// What moved through this mount's `kv` files.
    pub fn counters(&self) -> &MountCounters {
        &self.counters
    }

    /// Where the store is mounted.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Starts a guard process ([`crate::guard`]) that aborts this mount's FUSE connection if this
    /// process dies, for a process that also does I/O through its own mount. Call it from a thread
    /// that lives as long as the process.
    pub fn guard(
        &mut self,
        cmd: &crate::guard::GuardCommand,
    ) -> Result<(), crate::guard::GuardError> {
        self.guard = Some(crate::guard::spawn(cmd, &self.path)?);
        Ok(())
    }

    /// Unmounts and waits for the FUSE threads to finish.
    pub fn unmount(mut self) -> Result<(), MountError> {
        self.unmount_inner()
    }

    fn unmount_inner(&mut self) -> Result<(), MountError> {
        // The guard goes first: it must not abort a connection that is being closed cleanly.
        self.guard = None;
        let unmounted = self.session.is_some() && self.unmount_when_idle();
        match self.session.take() {
            // The FUSE threads end once the kernel drops the connection.
            Some(s) if unmounted => s.join().map_err(|source| MountError::Unmount {
                path: self.path.clone(),
                source,
            }),
            Some(s) => s.umount_and_join().map_err(|source| MountError::Unmount {
                path: self.path.clone(),
                source,
            }),
            None => Ok(()),
        }
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if let Err(e) = self.unmount_inner() {
            tracing::warn!(error = %e, "kvfs unmount failed");
        }
    }
}

impl Mount {
    /// Unmounts as soon as the mount is not busy, waiting up to `UNMOUNT_PATIENCE`.
    ///
    /// A descriptor on the mount can outlive its `close` for a moment: a process forked by another
    /// thread holds a copy until its `exec` closes it. The kernel answers EBUSY during that window,
    /// so a busy mount is retried briefly; one still busy after the wait (a shell sitting in it, a
    /// reader that never closes) is left to fuser, whose error names the mount point. Without the
    /// right to unmount (EPERM, not root), fuser goes through `fusermount` instead. Returns whether
    /// it unmounted.
    fn unmount_when_idle(&self) -> bool {
        let deadline = std::time::Instant::now() + UNMOUNT_PATIENCE;
        loop {
            match nix::mount::umount2(&self.path, nix::mount::MntFlags::empty()) {
                Err(nix::errno::Errno::EBUSY) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10));
                }
                Ok(()) => {
                    tracing::debug!(path = %self.path.display(), "kvfs unmounted");
                    return true;
                }
                Err(_) => return false,
            }
        }
    }
}

/// How long an unmount waits for a busy mount to become idle.
const UNMOUNT_PATIENCE: Duration = Duration::from_secs(2);

/// Whether `path` is currently a mount point (from /proc/self/mountinfo).
fn is_mount_point(path: &Path) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let want = path.to_string_lossy();
    // Field 5 is the mount point, with spaces and such escaped as octal.
    info.lines().filter_map(|l| l.split(' ').nth(4)).any(|mp| {
        mp.replace("\\040", " ")
            .replace("\\011", "\t")
            .replace("\\134", "\\")
            == want
    })
}

/// Detects a mount left behind by a killed server (its mount point answers ENOTCONN) and detaches it;
/// refuses a mount point that is live.
///
/// The probe is `statfs`, which the kernel always asks the server: a `stat` of the mount's root can
/// be answered from the attributes the kernel cached for [`super::nodes::ROOT_TTL`], so a server
/// killed less than that ago would look alive (a restart right after a `kill -9` was refused so).
pub fn clean_stale_mount(mountpoint: &Path) -> Result<(), MountError> {
    let path = mountpoint.to_owned();
    let dead = nix::sys::statvfs::statvfs(mountpoint).err() == Some(nix::errno::Errno::ENOTCONN);
    let probe = if dead {
        Err(std::io::Error::from_raw_os_error(libc::ENOTCONN))
    } else {
        std::fs::metadata(mountpoint)
    };
    match probe {
        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => {
            nix::mount::umount2(mountpoint, nix::mount::MntFlags::MNT_DETACH).map_err(
                |source| MountError::Stale {
                    path: path.clone(),
                    source,
                },
            )?;
            tracing::warn!(path = %path.display(), "detached a stale kvfs mount left by a killed process");
            Ok(())
        }
        Err(source) => Err(MountError::MountPoint { path, source }),
        Ok(m) if !m.is_dir() => Err(MountError::MountPoint {
            path,
            source: std::io::Error::new(std::io::ErrorKind::NotADirectory, "not a directory"),
        }),
        Ok(_) if is_mount_point(&std::fs::canonicalize(mountpoint).unwrap_or(path.clone())) => {
            Err(MountError::AlreadyMounted { path })
        }
        Ok(_) => Ok(()),
    }
}

/// Mounts `store` at `mountpoint` (cleaning up a stale mount first) and serves it on background
/// threads until the returned [`Mount`] is dropped.
pub fn mount(
    store: Arc<Store>,
    mountpoint: &Path,
    config: &MountConfig,
) -> Result<Mount, MountError> {
    clean_stale_mount(mountpoint)?;
    let mut options = vec![
        MountOption::FSName(format!("kvfs:{}", store.root().display())),
        MountOption::Subtype("kvfs".to_owned()),
        MountOption::DefaultPermissions,
        MountOption::NoAtime,
        MountOption::NoDev,
        MountOption::NoSuid,
        MountOption::NoExec,
    ];
    options.push(if config.read_only {
        MountOption::RO
    } else {
        MountOption::RW
    });
    let mut cfg = Config::default();
    cfg.mount_options = options;
    // Other uids must reach the filesystem so the kernel can apply `default_permissions` to them.
    cfg.acl = SessionACL::All;
    cfg.n_threads = Some(config.threads.max(1));
    cfg.clone_fd = true;
    let mut fs = KvFs::new(store, config.read_only, config.cache_dir_attrs);
    let counters = Arc::clone(&fs.counters);
    fs.passthrough = config.passthrough && nix::unistd::geteuid().is_root();
    let session = fuser::spawn_mount(fs, mountpoint, &cfg).map_err(|source| MountError::Mount {
        path: mountpoint.to_owned(),
        source,
    })?;
    tracing::info!(path = %mountpoint.display(), read_only = config.read_only, "kvfs mounted");
    Ok(Mount {
        session: Some(session),
        path: mountpoint.to_owned(),
        guard: None,
        counters,
    })
}

/// Blocks SIGINT and SIGTERM in this thread and the threads it spawns afterwards; call before
/// [`mount`], then [`wait_for_termination`] to unmount cleanly on either signal.
pub fn block_termination_signals() -> Result<nix::sys::signal::SigSet, nix::Error> {
    use nix::sys::signal::{SigSet, Signal};
    let mut set = SigSet::empty();
    set.add(Signal::SIGINT);
    set.add(Signal::SIGTERM);
    set.thread_block()?;
    Ok(set)
}

/// Waits for one of the signals blocked by [`block_termination_signals`].
pub fn wait_for_termination(
    set: &nix::sys::signal::SigSet,
) -> Result<nix::sys::signal::Signal, nix::Error> {
    set.wait()
}
