//! A disk's `O_DIRECT` read bandwidth, measured in the same run as the benchmark whose I/O bound
//! it sets (`bench weights`, `bench switch`).

use anyhow::Context;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::time::Instant;

/// Bytes of one read.
const READ: usize = 1 << 20;

/// The read bandwidth, bytes/s, of `bytes` read from `path` with `O_DIRECT` in 1 MiB reads by
/// `threads` threads at once (each taking the next MiB), wrapping around a file shorter than
/// that. Each thread reads into a buffer in transparent huge pages, as the Load and the weight
/// stream do: into small pages direct reads run at about half the rate here (docs/kvfs.md).
pub fn direct_read_bps(path: &Path, bytes: usize, threads: usize) -> anyhow::Result<f64> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::fcntl::OFlag::O_DIRECT.bits())
        .open(path)
        .with_context(|| format!("cannot open {} with O_DIRECT", path.display()))?;
    let len = f.metadata()?.len() / READ as u64 * READ as u64;
    anyhow::ensure!(len > 0, "{} is shorter than 1 MiB", path.display());
    let next = std::sync::atomic::AtomicU64::new(0);
    let reads = bytes.div_ceil(READ) as u64;
    let t = Instant::now();
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads.max(1))
            .map(|_| {
                s.spawn(|| -> std::io::Result<()> {
                    // Into huge pages, as the Load's reads are (`kvfs::io::AlignedBuf::huge`).
                    let mut raw = kvfs::io::AlignedBuf::huge(READ);
                    let buf = raw.get(READ);
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if i >= reads {
                            return Ok(());
                        }
                        f.read_exact_at(buf, i * READ as u64 % len)?;
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .try_for_each(|w| w.join().expect("a disk probe thread panicked"))
    })
    .with_context(|| format!("reading {}", path.display()))?;
    Ok((reads as usize * READ) as f64 / t.elapsed().as_secs_f64())
}

/// The read bandwidth of the disk under `dir`: a file of `bytes` written there and synced, read
/// back as [`direct_read_bps`] does, and removed.
pub fn probe_dir(dir: &Path, bytes: usize, threads: usize) -> anyhow::Result<f64> {
    let path = dir.join(format!(".disk-probe-{}", std::process::id()));
    let written = (|| -> std::io::Result<()> {
        let f = std::fs::File::create(&path)?;
        let block = vec![0x5au8; READ];
        for i in 0..bytes.div_ceil(READ) {
            f.write_all_at(&block, (i * READ) as u64)?;
        }
        f.sync_all()
    })();
    let bps = written
        .with_context(|| format!("cannot write {}", path.display()))
        .and_then(|()| direct_read_bps(&path, bytes, threads));
    let _ = std::fs::remove_file(&path);
    bps
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_probe_reads_what_it_wrote_and_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let bps = probe_dir(dir.path(), 4 << 20, 2).unwrap();
        assert!(bps.is_finite() && bps > 0.0, "{bps}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn a_file_shorter_than_one_read_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("short");
        std::fs::write(&p, [0u8; 4096]).unwrap();
        let e = direct_read_bps(&p, 1 << 20, 1).unwrap_err();
        assert!(e.to_string().contains("shorter than 1 MiB"), "{e}");
    }
}
