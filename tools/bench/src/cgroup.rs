//! cgroup v1 groups for the benchmarks: a fresh group under this process's own group of a
//! controller (`memory`, `blkio`), processes moved into it (or this process, for as long as a
//! [`Joined`] lives), blkio throttles on the disk that holds a path, and the group's counters
//! (peak memory, bytes read and written). The group is removed when dropped. docs/bench.md shows
//! how `llms bench switch` uses them, docs/service.md `llms bench load`; the service's own reading
//! of its memory cgroup is `pressure`.

use std::path::{Path, PathBuf};

/// Where cgroup v1 controllers are mounted.
pub const ROOT: &str = "/sys/fs/cgroup";

/// What went wrong with a cgroup.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error(
        "creating the cgroup {path} (needs root and the cgroup v1 {controller} controller): {source}"
    )]
    Create {
        path: PathBuf,
        controller: String,
        source: std::io::Error,
    },
    #[error("this process is in no cgroup v1 {controller} group (/proc/self/cgroup)")]
    NoGroup { controller: String },
    #[error("writing {value:?} to {path}: {source}")]
    Write {
        path: PathBuf,
        value: String,
        source: std::io::Error,
    },
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {what}")]
    Parse { path: PathBuf, what: String },
}

/// A block device, `major:minor`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Device {
    pub major: u64,
    pub minor: u64,
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.major, self.minor)
    }
}

impl Device {
    /// The disk that holds `path`: the device of its filesystem, or the whole disk when that is
    /// a partition (blkio throttles only whole disks; `/sys/dev/block/M:m/partition` tells).
    pub fn of(path: &Path) -> Result<Device, CgroupError> {
        use std::os::unix::fs::MetadataExt;
        let dev = std::fs::metadata(path)
            .map_err(|source| CgroupError::Read {
                path: path.to_owned(),
                source,
            })?
            .dev();
        let d = Device {
            major: nix::sys::stat::major(dev),
            minor: nix::sys::stat::minor(dev),
        };
        let sys = PathBuf::from(format!("/sys/dev/block/{d}"));
        if sys.join("partition").exists()
            && let Ok(parent) = std::fs::read_to_string(sys.join("../dev"))
            && let Some((ma, mi)) = parent.trim().split_once(':')
            && let (Ok(major), Ok(minor)) = (ma.parse(), mi.parse())
        {
            return Ok(Device { major, minor });
        }
        Ok(d)
    }
}

/// The group of `controller` this process is in, as a path under [`ROOT`].
pub fn own_group(controller: &str) -> Result<PathBuf, CgroupError> {
    let path = Path::new("/proc/self/cgroup");
    let text = std::fs::read_to_string(path).map_err(|source| CgroupError::Read {
        path: path.to_owned(),
        source,
    })?;
    // Lines are `id:controllers:path`, controllers comma-separated (`cpu,cpuacct`).
    text.lines()
        .filter_map(|l| {
            let mut parts = l.splitn(3, ':');
            let (_, ctrls, p) = (parts.next()?, parts.next()?, parts.next()?);
            ctrls.split(',').any(|c| c == controller).then(|| {
                Path::new(ROOT)
                    .join(controller)
                    .join(p.trim_start_matches('/'))
            })
        })
        .next()
        .ok_or_else(|| CgroupError::NoGroup {
            controller: controller.to_owned(),
        })
}

/// Moves process `pid` (all its threads) into the group at `dir`.
pub fn move_to(dir: &Path, pid: u32) -> Result<(), CgroupError> {
    write(&dir.join("cgroup.procs"), &pid.to_string())
}

fn write(path: &Path, value: &str) -> Result<(), CgroupError> {
    std::fs::write(path, value).map_err(|source| CgroupError::Write {
        path: path.to_owned(),
        value: value.to_owned(),
        source,
    })
}

/// A cgroup v1 group this process made; removed (it must be empty by then) when dropped.
#[derive(Debug)]
pub struct Group {
    dir: PathBuf,
}

impl Group {
    /// Makes the group `name` under this process's own group of `controller` (so the limits
    /// above it still hold); a group of that name left by an earlier run is reused.
    pub fn create(controller: &str, name: &str) -> Result<Group, CgroupError> {
        let dir = own_group(controller)?.join(name);
        std::fs::create_dir_all(&dir).map_err(|source| CgroupError::Create {
            path: dir.clone(),
            controller: controller.to_owned(),
            source,
        })?;
        Ok(Group { dir })
    }

    /// The group's directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Moves process `pid` into the group.
    pub fn add(&self, pid: u32) -> Result<(), CgroupError> {
        move_to(&self.dir, pid)
    }

    /// Limits reads and writes of the group's processes on `dev` to so many bytes/s (`None`: no
    /// limit; blkio groups only).
    pub fn throttle(
        &self,
        dev: Device,
        read_bps: Option<u64>,
        write_bps: Option<u64>,
    ) -> Result<(), CgroupError> {
        for (file, bps) in [
            ("blkio.throttle.read_bps_device", read_bps),
            ("blkio.throttle.write_bps_device", write_bps),
        ] {
            // 0 removes a device's limit.
            write(&self.dir.join(file), &format!("{dev} {}", bps.unwrap_or(0)))?;
        }
        Ok(())
    }

    /// The most memory the group's processes used at once since it was made or
    /// [`reset_peak`](Self::reset_peak) (`memory.max_usage_in_bytes`: resident memory and the page
    /// cache they charged; memory groups only).
    pub fn peak_memory(&self) -> Result<u64, CgroupError> {
        self.read_u64("memory.max_usage_in_bytes")
    }

    /// Starts the peak over from the group's present usage (memory groups only).
    pub fn reset_peak(&self) -> Result<(), CgroupError> {
        write(&self.dir.join("memory.max_usage_in_bytes"), "0")
    }

    /// One number in a file of the group (`memory.max_usage_in_bytes`).
    pub fn read_u64(&self, file: &str) -> Result<u64, CgroupError> {
        let path = self.dir.join(file);
        let text = std::fs::read_to_string(&path).map_err(|source| CgroupError::Read {
            path: path.clone(),
            source,
        })?;
        text.trim().parse().map_err(|e| CgroupError::Parse {
            path,
            what: format!("{text:?} is not a number: {e}"),
        })
    }

    /// Bytes the group's processes read and wrote on `dev`, from
    /// `blkio.throttle.io_service_bytes` (lines `M:m Read N`, `M:m Write N`).
    pub fn io_bytes(&self, dev: Device) -> Result<(u64, u64), CgroupError> {
        let path = self.dir.join("blkio.throttle.io_service_bytes");
        let text = std::fs::read_to_string(&path).map_err(|source| CgroupError::Read {
            path: path.clone(),
            source,
        })?;
        Ok(parse_io_bytes(&text, dev))
    }
}

/// `(read, written)` bytes of `dev` in a `blkio.throttle.io_service_bytes` file (0 when absent:
/// the device saw no I/O from the group).
pub fn parse_io_bytes(text: &str, dev: Device) -> (u64, u64) {
    let want = dev.to_string();
    let (mut read, mut written) = (0, 0);
    for l in text.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        if let [d, op, n] = f[..]
            && d == want
            && let Ok(n) = n.parse::<u64>()
        {
            match op {
                "Read" => read += n,
                "Write" => written += n,
                _ => {}
            }
        }
    }
    (read, written)
}

impl Drop for Group {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// This process in a group of its own while the value lives: dropping it moves the process back
/// to the group it came from and removes the group. Memory charged inside stays charged to the
/// group (cgroup v1 moves no charges), so enter a memory group before what it should count.
#[derive(Debug)]
pub struct Joined {
    // Dropped after `drop` moved the process home, so the group is empty when removed.
    group: Group,
    home: PathBuf,
}

impl Joined {
    /// Makes the group `name` under this process's own group of `controller` and moves this
    /// process (all its threads, and the children it starts from now on) into it.
    pub fn enter(controller: &str, name: &str) -> Result<Joined, CgroupError> {
        let home = own_group(controller)?;
        let group = Group::create(controller, name)?;
        group.add(std::process::id())?;
        Ok(Joined { group, home })
    }

    /// The group this process is in.
    pub fn group(&self) -> &Group {
        &self.group
    }
}

impl Drop for Joined {
    fn drop(&mut self) {
        let _ = move_to(&self.home, std::process::id());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_service_bytes_parse() {
        let text = "254:0 Read 4096\n254:0 Write 8192\n254:0 Sync 0\n254:0 Async 12288\n\
                    254:0 Discard 0\n254:0 Total 12288\n8:0 Read 7\nTotal 12288\n";
        let vda = Device {
            major: 254,
            minor: 0,
        };
        assert_eq!(parse_io_bytes(text, vda), (4096, 8192));
        assert_eq!(parse_io_bytes(text, Device { major: 8, minor: 0 }), (7, 0));
        assert_eq!(parse_io_bytes("", vda), (0, 0));
        assert_eq!(parse_io_bytes("Total 0\n", vda), (0, 0));
    }

    #[test]
    fn own_groups_are_under_the_root() {
        // Every Linux process is in some group of each mounted v1 controller; on a machine
        // without v1 the error names the controller.
        match own_group("memory") {
            Ok(p) => assert!(p.starts_with("/sys/fs/cgroup/memory"), "{}", p.display()),
            Err(e) => assert!(e.to_string().contains("memory"), "{e}"),
        }
    }
}
