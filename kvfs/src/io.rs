//! Durable, cache-bypassing file operations: atomic replace (temp, fsync, rename, fsync dir) and O_DIRECT reads.
//!
//! Swapped-out chunks must really leave RAM, so writes drop their pages from the page cache after
//! `fdatasync`, and reads use `O_DIRECT` where the filesystem supports it (ext4, xfs, btrfs; not tmpfs).

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::fcntl::{PosixFadviseAdvice, posix_fadvise};

/// Alignment of O_DIRECT buffers, offsets and lengths (covers 512-byte and 4 KiB devices).
pub(crate) const DIRECT_ALIGN: usize = 4096;

/// A file operation that failed, with the path it was about.
#[derive(Debug, thiserror::Error)]
#[error("{op} {path}: {source}")]
pub struct IoError {
    pub op: &'static str,
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

impl IoError {
    /// An error of `op` (a verb: "open", "read" ...) on `path`.
    pub fn new(op: &'static str, path: &Path, source: io::Error) -> Self {
        IoError {
            op,
            path: path.to_owned(),
            source,
        }
    }
}

/// A step's result, passed through the named failpoint `$name` (the `fail` crate) when kvfs is
/// built with its `failpoints` feature: there a test can make the step fail (`return`: an error
/// for `$op` on `$path`, after the step itself ran) or the process crash right after it (`panic`).
/// Without the feature the name is not even evaluated and the result is passed on as it is.
/// The failpoints are listed in docs/kvfs.md ("Failpoints").
macro_rules! failpoint {
    ($name:expr, $op:expr, $path:expr, $result:expr) => {{
        let result = $result;
        #[cfg(feature = "failpoints")]
        let result = $crate::io::inject(&$name, $op, $path, result);
        #[cfg(not(feature = "failpoints"))]
        let _ = || ($name, $op, $path);
        result
    }};
}
pub(crate) use failpoint;

/// The `failpoint!` of a step: `result`, or the error the failpoint `name` is told to return.
#[cfg(feature = "failpoints")]
pub(crate) fn inject<T>(
    name: &str,
    op: &'static str,
    path: &Path,
    result: Result<T, IoError>,
) -> Result<T, IoError> {
    match fail::eval(name, |_| ()) {
        Some(()) => Err(IoError::new(
            op,
            path,
            io::Error::other(format!("failpoint {name}")),
        )),
        None => result,
    }
}

/// Writes `parts` as the whole content of `dir/name`, crash-safely.
///
/// The bytes go to `dir/tmp_name` first, which is fsynced and dropped from the page cache,
/// then renamed over `dir/name`, then `dir` is fsynced so the rename itself is durable.
/// After a crash at any point `dir/name` is either the old file or the new one, never a mix.
/// An error before the rename leaves the old file; from the directory's fsync, the new one.
/// Each step has a failpoint, `kvfs::replace::<name>::{written,synced,renamed,dir_synced}`.
pub fn write_atomic(
    dir: &Path,
    name: &str,
    tmp_name: &str,
    parts: &[&[u8]],
) -> Result<(), IoError> {
    let tmp = dir.join(tmp_name);
    let dst = dir.join(name);
    let point = |step: &str| format!("kvfs::replace::{name}::{step}");
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| IoError::new("create", &tmp, e))?;
    let written = parts
        .iter()
        .try_for_each(|part| f.write_all(part))
        .map_err(|e| IoError::new("write", &tmp, e));
    failpoint!(point("written"), "write", &tmp, written)?;
    let synced = nix::unistd::fdatasync(&f).map_err(|e| IoError::new("fdatasync", &tmp, e.into()));
    failpoint!(point("synced"), "fdatasync", &tmp, synced)?;
    drop_cache(&f);
    drop(f);
    let renamed = std::fs::rename(&tmp, &dst).map_err(|e| IoError::new("rename", &tmp, e));
    failpoint!(point("renamed"), "rename", &tmp, renamed)?;
    failpoint!(point("dir_synced"), "fsync dir", dir, sync_dir(dir))
}

/// Makes the entries of `dir` (creations, renames, removals) durable.
pub fn sync_dir(dir: &Path) -> Result<(), IoError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| IoError::new("fsync dir", dir, e))
}

/// Drops a file's clean pages from the page cache (advisory: failure only costs memory).
pub fn drop_cache(f: &File) {
    if let Err(e) = posix_fadvise(f, 0, 0, PosixFadviseAdvice::POSIX_FADV_DONTNEED) {
        tracing::debug!(error = %e, "fadvise DONTNEED failed");
    }
}

/// Drops the pages holding `len` bytes of a file from `offset` on from the page cache
/// (advisory). The range is widened to whole pages: the kernel keeps a partly covered page.
pub fn drop_range(f: &File, offset: u64, len: usize) {
    let start = offset / DIRECT_ALIGN as u64 * DIRECT_ALIGN as u64;
    let end = (offset + len as u64).next_multiple_of(DIRECT_ALIGN as u64);
    if let Err(e) = posix_fadvise(
        f,
        start as libc::off_t,
        (end - start) as libc::off_t,
        PosixFadviseAdvice::POSIX_FADV_DONTNEED,
    ) {
        tracing::debug!(error = %e, "fadvise DONTNEED failed");
    }
}

/// Deallocates `len` bytes from `offset` on (they read as zeros), keeping the file's size.
pub fn punch(f: &File, offset: u64, len: u64) -> io::Result<()> {
    nix::fcntl::fallocate(
        f,
        nix::fcntl::FallocateFlags::FALLOC_FL_PUNCH_HOLE
            | nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE,
        offset as libc::off_t,
        len as libc::off_t,
    )
    .map_err(io::Error::from)
}

/// Reads up to `len` bytes at `offset` of `f` into the front of `buf`, growing it if it is
/// shorter, and returns where they are: `buf[range]`, shorter than `len` only at the end of the
/// file. With `direct` (`f` opened with O_DIRECT, `offset` 4 KiB-aligned) the read asks for whole
/// blocks; without it the read is buffered and the range's pages are dropped afterwards.
pub fn read_slot(
    f: &File,
    direct: bool,
    offset: u64,
    len: usize,
    buf: &mut AlignedBuf,
) -> io::Result<std::ops::Range<usize>> {
    let cap = len.div_ceil(DIRECT_ALIGN).max(1) * DIRECT_ALIGN;
    let b = buf.get(cap);
    let end = if direct { cap } else { len };
    let mut done = 0;
    while done < len {
        let n = f.read_at(&mut b[done..end], offset + done as u64)?;
        if n == 0 {
            break;
        }
        done += n;
    }
    if !direct {
        drop_range(f, offset, len);
    }
    Ok(0..done.min(len))
}

/// Whether files under `dir` can be opened with O_DIRECT (probed with the file `probe`).
pub fn supports_direct(probe: &Path) -> bool {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(probe)
        .is_ok()
}

/// Size of a transparent huge page (x86-64, and arm64 with 4 KiB pages).
pub const HUGE_PAGE: usize = 2 << 20;

/// A buffer whose bytes start on a 4 KiB boundary, for O_DIRECT reads: [`AlignedBuf::get`] hands
/// out its first `len` bytes, growing it (to the largest length asked) when it is shorter; its
/// memory is an anonymous mapping, zeroed by the kernel and returned to it on drop.
///
/// [`AlignedBuf::huge`] asks for transparent huge pages (`MADV_HUGEPAGE` over whole, aligned
/// 2 MiB pages, so it rounds its length up to them) and faults the whole buffer in at once. A
/// direct read pins and maps the buffer's pages for the device, one per 4 KiB or one per 2 MiB:
/// on this project's virtio disk four readers of int8 chunk slots (212 KiB) read 2958 MB/s into
/// huge pages against 1354 MB/s into small ones (docs/kvfs.md, "Read buffers in huge pages").
/// Where the kernel has no huge page to give (THP off, memory fragmented) the buffer is small
/// pages, only slower; [`AlignedBuf::huge_bytes`] says which it got.
#[derive(Debug, Default)]
pub struct AlignedBuf {
    map: Option<memmap2::MmapMut>,
    start: usize,
    cap: usize,
    huge: bool,
}

impl AlignedBuf {
    /// A buffer of `len` aligned bytes, in small pages.
    pub fn new(len: usize) -> AlignedBuf {
        let mut b = AlignedBuf::default();
        b.get(len);
        b
    }

    /// A buffer of at least `len` aligned bytes (whole huge pages), in transparent huge pages
    /// where the kernel has them.
    pub fn huge(len: usize) -> AlignedBuf {
        let mut b = AlignedBuf {
            huge: true,
            ..AlignedBuf::default()
        };
        b.get(len);
        b
    }

    /// The bytes the buffer holds without growing.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// The first `len` bytes, aligned (grown first if the buffer is shorter; a grown buffer is a
    /// new mapping and starts zeroed).
    pub fn get(&mut self, len: usize) -> &mut [u8] {
        if len > self.cap {
            self.grow(len);
        }
        let start = self.start;
        match &mut self.map {
            Some(m) => &mut m[start..start + len],
            None => &mut [],
        }
    }

    /// `parts` disjoint buffers of `len` bytes each, rounded up to 4 KiB so that each is aligned,
    /// carved from the front of this one (grown first if it is shorter).
    pub fn parts(&mut self, parts: usize, len: usize) -> std::slice::ChunksExactMut<'_, u8> {
        let stride = len.next_multiple_of(DIRECT_ALIGN).max(DIRECT_ALIGN);
        self.get(stride * parts).chunks_exact_mut(stride)
    }

    /// Bytes of the buffer the kernel backs with huge pages now (`AnonHugePages` of its mapping
    /// in `/proc/self/smaps`, at most its capacity); 0 when it has none or smaps cannot be read.
    pub fn huge_bytes(&self) -> usize {
        let Some(m) = &self.map else { return 0 };
        let at = m.as_ptr() as usize + self.start;
        let Ok(smaps) = std::fs::read_to_string("/proc/self/smaps") else {
            return 0;
        };
        let mut inside = false;
        for line in smaps.lines() {
            let range = line
                .split_once(' ')
                .and_then(|(r, _)| r.split_once('-'))
                .and_then(|(a, b)| {
                    Some((
                        usize::from_str_radix(a, 16).ok()?,
                        usize::from_str_radix(b, 16).ok()?,
                    ))
                });
            if let Some((lo, hi)) = range {
                inside = (lo..hi).contains(&at);
            } else if inside && let Some(kb) = line.strip_prefix("AnonHugePages:") {
                let kb: usize = kb.trim().trim_end_matches("kB").trim().parse().unwrap_or(0);
                return (kb << 10).min(self.cap);
            }
        }
        0
    }

    fn grow(&mut self, len: usize) {
        let (align, cap) = if self.huge {
            (HUGE_PAGE, len.next_multiple_of(HUGE_PAGE))
        } else {
            (DIRECT_ALIGN, len.next_multiple_of(DIRECT_ALIGN))
        };
        // An anonymous mapping starts on a page; room for one more huge page lets the buffer
        // start on one (the pages skipped are never touched, so they take no memory).
        let mapped = cap + align - DIRECT_ALIGN;
        self.map = None;
        let mut map = memmap2::MmapOptions::new()
            .len(mapped)
            .map_anon()
            .unwrap_or_else(|e| panic!("cannot map a {mapped}-byte read buffer: {e}"));
        let start = map.as_ptr().align_offset(align);
        if self.huge {
            // Advice only: without huge pages the buffer is small pages, correct and slower.
            let _ = map.advise_range(memmap2::Advice::HugePage, start, cap);
            // Faulted in now, whole: the memory it holds is its capacity from the start (budgets
            // count it so), not less until a read touches the rest or more when the kernel
            // later collapses small pages into a huge one beside them.
            for page in map[start..start + cap].chunks_mut(DIRECT_ALIGN) {
                page[0] = 0;
            }
        }
        self.map = Some(map);
        self.start = start;
        self.cap = cap;
    }
}

/// The whole buffer, [`AlignedBuf::capacity`] bytes from its aligned start.
impl std::ops::Deref for AlignedBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match &self.map {
            Some(m) => &m[self.start..self.start + self.cap],
            None => &[],
        }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        let cap = self.cap;
        self.get(cap)
    }
}

/// Bytes read into an aligned buffer: `buf[start..start + len]`.
#[derive(Debug)]
pub struct Aligned {
    buf: Vec<u8>,
    start: usize,
    len: usize,
}

impl Aligned {
    /// The bytes read.
    pub fn bytes(&self) -> &[u8] {
        &self.buf[self.start..self.start + self.len]
    }

    /// The bytes read after the first `skip`, as a vector, moving them once (no second copy).
    pub fn into_vec_from(mut self, skip: usize) -> Vec<u8> {
        let skip = skip.min(self.len);
        self.buf.truncate(self.start + self.len);
        self.buf.drain(..self.start + skip);
        self.buf
    }
}

/// Reads the first `limit` bytes of a file (or all of it when `limit` is `None`), bypassing the page
/// cache: with O_DIRECT when `direct`, else a buffered read followed by fadvise DONTNEED.
pub fn read_file(path: &Path, direct: bool, limit: Option<usize>) -> Result<Vec<u8>, IoError> {
    Ok(read_aligned(path, direct, limit)?.into_vec_from(0))
}

/// [`read_file`] without the final move: the bytes stay where O_DIRECT put them.
pub fn read_aligned(path: &Path, direct: bool, limit: Option<usize>) -> Result<Aligned, IoError> {
    let flags = if direct { libc::O_DIRECT } else { 0 };
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(flags)
        .open(path)
        .map_err(|e| IoError::new("open", path, e))?;
    let file_len = f
        .metadata()
        .map_err(|e| IoError::new("stat", path, e))?
        .len() as usize;
    let len = limit.map_or(file_len, |l| l.min(file_len));
    if !direct {
        let mut buf = vec![0u8; len];
        f.read_exact_at(&mut buf, 0)
            .map_err(|e| IoError::new("read", path, e))?;
        drop_cache(&f);
        return Ok(Aligned { buf, start: 0, len });
    }
    let cap = len.div_ceil(DIRECT_ALIGN).max(1) * DIRECT_ALIGN;
    let mut buf = vec![0u8; cap + DIRECT_ALIGN];
    let start = buf.as_ptr().align_offset(DIRECT_ALIGN);
    let mut done = 0;
    while done < len {
        let n = f
            .read_at(&mut buf[start + done..start + cap], done as u64)
            .map_err(|e| IoError::new("read", path, e))?;
        if n == 0 {
            return Err(IoError::new(
                "read",
                path,
                io::Error::new(io::ErrorKind::UnexpectedEof, "file shrank while being read"),
            ));
        }
        done += n;
    }
    Ok(Aligned { buf, start, len })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_write_replaces_and_leaves_no_temp() {
        let dir = tempfile::tempdir().unwrap();
        write_atomic(dir.path(), "a", ".tmp-a", &[b"hello ", b"world"]).unwrap();
        write_atomic(dir.path(), "a", ".tmp-a", &[b"bye"]).unwrap();
        assert_eq!(std::fs::read(dir.path().join("a")).unwrap(), b"bye");
        assert!(!dir.path().join(".tmp-a").exists());
    }

    #[test]
    fn aligned_buffers_grow_aligned_and_split_into_disjoint_aligned_parts() {
        for mut b in [AlignedBuf::default(), AlignedBuf::huge(1)] {
            assert!(b.get(0).is_empty());
            for len in [1, 4095, 4097, 300_000, HUGE_PAGE + 1] {
                let s = b.get(len);
                assert_eq!(s.len(), len);
                assert_eq!(s.as_ptr().align_offset(DIRECT_ALIGN), 0);
                s[len - 1] = 7;
            }
            let cap = b.capacity();
            assert!(cap > HUGE_PAGE && cap % DIRECT_ALIGN == 0, "{cap}");
            let parts: Vec<&mut [u8]> = b.parts(3, 5000).collect();
            assert_eq!(parts.len(), 3);
            let mut ends = Vec::new();
            for p in parts {
                assert_eq!(p.len(), 8192);
                assert_eq!(p.as_ptr().align_offset(DIRECT_ALIGN), 0);
                p.fill(1);
                ends.push((p.as_ptr() as usize, p.as_ptr() as usize + p.len()));
            }
            assert!(ends.windows(2).all(|w| w[0].1 <= w[1].0), "{ends:?}");
            assert!(b.huge_bytes() <= b.capacity());
        }
        let h = AlignedBuf::huge(HUGE_PAGE + 1);
        assert_eq!(h.capacity(), 2 * HUGE_PAGE);
        let mut h = h;
        assert_eq!(h.get(1).as_ptr().align_offset(HUGE_PAGE), 0);
    }

    #[test]
    fn direct_and_buffered_reads_agree_at_every_awkward_length() {
        let dir = tempfile::tempdir().unwrap();
        let direct = {
            std::fs::write(dir.path().join("probe"), b"x").unwrap();
            supports_direct(&dir.path().join("probe"))
        };
        for len in [0usize, 1, 104, 4095, 4096, 4097, 65536 + 13] {
            let data: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            let p = dir.path().join(format!("f{len}"));
            std::fs::write(&p, &data).unwrap();
            assert_eq!(read_file(&p, direct, None).unwrap(), data, "len {len}");
            assert_eq!(read_file(&p, false, None).unwrap(), data, "len {len}");
            let cut = len.min(7);
            let a = read_aligned(&p, direct, None).unwrap();
            assert_eq!(a.bytes(), &data[..]);
            assert_eq!(a.into_vec_from(7), &data[cut..], "len {len}");
            let cut = len.min(104);
            assert_eq!(
                read_file(&p, direct, Some(104)).unwrap(),
                &data[..cut],
                "len {len}"
            );
        }
    }

    #[test]
    fn slot_reads_agree_and_reuse_the_buffer() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("probe"), b"x").unwrap();
        let direct = supports_direct(&dir.path().join("probe"));
        let data: Vec<u8> = (0..3 * 65536 + 13).map(|i| (i * 7 % 253) as u8).collect();
        let p = dir.path().join("f");
        std::fs::write(&p, &data).unwrap();
        let open = |d: bool| {
            OpenOptions::new()
                .read(true)
                .custom_flags(if d { libc::O_DIRECT } else { 0 })
                .open(&p)
                .unwrap()
        };
        let mut scratch = AlignedBuf::default();
        let mut first_cap = None;
        // The first (largest) read sizes the buffer; the rest fit in it without a reallocation.
        for (offset, len) in [
            (0, 65536 + 13),
            (4096, 0),
            (8192, 1),
            (0, 104),
            (65536, 4097),
        ] {
            for d in [direct, false] {
                let r = read_slot(&open(d), d, offset, len, &mut scratch).unwrap();
                let off = offset as usize;
                assert_eq!(
                    &scratch[r],
                    &data[off..off + len],
                    "{offset}+{len} direct {d}"
                );
            }
            let cap = *first_cap.get_or_insert(scratch.capacity());
            assert_eq!(scratch.capacity(), cap, "{offset}+{len}");
        }
        // Past the end of the file: what there is.
        let r = read_slot(&open(direct), direct, 3 * 65536, 8192, &mut scratch).unwrap();
        assert_eq!(&scratch[r], &data[3 * 65536..]);
    }

    #[test]
    fn missing_file_names_its_path() {
        let err = read_file(Path::new("/nonexistent/kvfs-x"), false, None).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/kvfs-x"), "{err}");
    }
}
