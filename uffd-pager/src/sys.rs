//! Thin, checked wrappers over the kernel interfaces the pager uses: userfaultfd ioctls, anonymous mappings, eventfd.
//!
//! Every `unsafe` block of the crate that talks to the kernel lives here, each with its `// SAFETY:` note.
//! The userfaultfd ABI is written out by hand (from `include/uapi/linux/userfaultfd.h`) because the
//! `userfaultfd` crate predates `UFFDIO_MOVE` (Linux 6.8) and cannot request `UFFD_FEATURE_MOVE`.

use std::fs::OpenOptions;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;

use thiserror::Error;

/// Errors of the raw kernel interfaces, each naming the call and the errno.
#[derive(Debug, Error)]
pub enum SysError {
    #[error("cannot open /dev/userfaultfd (needs root or the userfaultfd group): {source}")]
    OpenDevice { source: io::Error },
    #[error("{op} failed: {source}")]
    Call { op: &'static str, source: io::Error },
    #[error("the kernel's userfaultfd lacks {what}")]
    Unsupported { what: &'static str },
    #[error("{op} of {len} bytes at {addr:#x} copied only {done} bytes: {source}")]
    Partial {
        op: &'static str,
        addr: usize,
        len: usize,
        done: usize,
        source: io::Error,
    },
}

const PAGE: usize = 4096;

/// The page size the pager works in (4 KiB; checked against the kernel when the pager starts).
pub const PAGE_SIZE: usize = PAGE;

/// Round `n` up to a whole number of pages.
pub const fn page_round(n: usize) -> usize {
    n.div_ceil(PAGE) * PAGE
}

// ---- the userfaultfd ABI ----------------------------------------------------------------------

const fn ioc(dir: u64, nr: u64, size: usize) -> u64 {
    (dir << 30) | ((size as u64) << 16) | (0xAA << 8) | nr
}
const IOC_WRITE: u64 = 1;
const IOC_READ: u64 = 2;

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}
#[repr(C)]
struct UffdioRange {
    start: u64,
    len: u64,
}
#[repr(C)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}
#[repr(C)]
struct UffdioCopy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}
#[repr(C)]
struct UffdioZeropage {
    range: UffdioRange,
    mode: u64,
    zeropage: i64,
}
#[repr(C)]
struct UffdioMove {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    moved: i64,
}
/// `struct uffd_msg`: 32 bytes; for a page fault, `arg0` is the flags and `arg1` the address.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct UffdMsg {
    event: u8,
    reserved1: u8,
    reserved2: u16,
    reserved3: u32,
    arg0: u64,
    arg1: u64,
    arg2: u64,
}

const USERFAULTFD_IOC_NEW: u64 = 0xAA00;
const UFFD_API: u64 = 0xAA;
const UFFDIO_API: u64 = ioc(IOC_READ | IOC_WRITE, 0x3F, size_of::<UffdioApi>());
const UFFDIO_REGISTER: u64 = ioc(IOC_READ | IOC_WRITE, 0x00, size_of::<UffdioRegister>());
const UFFDIO_UNREGISTER: u64 = ioc(IOC_READ, 0x01, size_of::<UffdioRange>());
const UFFDIO_WAKE: u64 = ioc(IOC_READ, 0x02, size_of::<UffdioRange>());
const UFFDIO_COPY: u64 = ioc(IOC_READ | IOC_WRITE, 0x03, size_of::<UffdioCopy>());
const UFFDIO_ZEROPAGE: u64 = ioc(IOC_READ | IOC_WRITE, 0x04, size_of::<UffdioZeropage>());
const UFFDIO_MOVE: u64 = ioc(IOC_READ | IOC_WRITE, 0x05, size_of::<UffdioMove>());
const UFFD_FEATURE_MOVE: u64 = 1 << 16;
const UFFDIO_REGISTER_MODE_MISSING: u64 = 1;
/// `UFFDIO_COPY_MODE_DONTWAKE` and `UFFDIO_MOVE_MODE_DONTWAKE`: map the pages, wake no one.
const MODE_DONTWAKE: u64 = 1;
const UFFD_EVENT_PAGEFAULT: u8 = 0x12;
const UFFD_PAGEFAULT_FLAG_WRITE: u64 = 1;

/// A page fault read from the userfaultfd.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// The faulting address (not page-aligned).
    pub addr: usize,
    /// Whether the access was a write.
    pub write: bool,
}

/// One userfaultfd, opened through /dev/userfaultfd, non-blocking, close-on-exec.
#[derive(Debug)]
pub struct Uffd {
    fd: OwnedFd,
    move_supported: bool,
}

fn last_err() -> io::Error {
    io::Error::last_os_error()
}

impl Uffd {
    /// Open a userfaultfd that handles kernel-mode faults too (a `read(2)` into a region must
    /// fault in like a user access), asking for `UFFD_FEATURE_MOVE` when the kernel has it.
    pub fn open() -> Result<Uffd, SysError> {
        let dev = OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/userfaultfd")
            .map_err(|source| SysError::OpenDevice { source })?;
        let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
        // SAFETY: USERFAULTFD_IOC_NEW takes its flags by value and returns a new fd or -1.
        let raw = unsafe { libc::ioctl(dev.as_raw_fd(), USERFAULTFD_IOC_NEW as _, flags) };
        if raw < 0 {
            return Err(SysError::Call {
                op: "USERFAULTFD_IOC_NEW",
                source: last_err(),
            });
        }
        // SAFETY: `raw` is a fresh fd that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // A handshake that asks for an unknown feature fails before it initialises the fd, so
        // asking again without MOVE is allowed (kernels older than 6.8).
        let move_supported = Self::handshake(fd.as_raw_fd(), UFFD_FEATURE_MOVE).is_ok();
        if !move_supported {
            Self::handshake(fd.as_raw_fd(), 0)?;
        }
        Ok(Uffd { fd, move_supported })
    }

    fn handshake(fd: RawFd, features: u64) -> Result<(), SysError> {
        let mut api = UffdioApi {
            api: UFFD_API,
            features,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_API reads and writes one `uffdio_api`, which `api` is.
        let rc = unsafe { libc::ioctl(fd, UFFDIO_API as _, &mut api as *mut UffdioApi) };
        if rc < 0 {
            return Err(SysError::Call {
                op: "UFFDIO_API",
                source: last_err(),
            });
        }
        Ok(())
    }

    /// Whether `UFFDIO_MOVE` is available on this fd.
    pub fn move_supported(&self) -> bool {
        self.move_supported
    }

    /// The raw fd, for poll(2).
    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Register `[addr, addr+len)` for MISSING faults.
    pub fn register(&self, addr: usize, len: usize) -> Result<(), SysError> {
        let mut reg = UffdioRegister {
            range: UffdioRange {
                start: addr as u64,
                len: len as u64,
            },
            mode: UFFDIO_REGISTER_MODE_MISSING,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_REGISTER reads and writes one `uffdio_register`; the kernel checks the range.
        let rc = unsafe { libc::ioctl(self.raw_fd(), UFFDIO_REGISTER as _, &mut reg as *mut _) };
        if rc < 0 {
            return Err(SysError::Call {
                op: "UFFDIO_REGISTER",
                source: last_err(),
            });
        }
        if reg.ioctls & (1 << 0x03) == 0 {
            return Err(SysError::Unsupported {
                what: "UFFDIO_COPY",
            });
        }
        Ok(())
    }

    /// Unregister a range; the kernel wakes every thread waiting on a fault in it, and those
    /// threads then fault in ordinary zero-filled anonymous memory.
    pub fn unregister(&self, addr: usize, len: usize) -> Result<(), SysError> {
        let mut range = UffdioRange {
            start: addr as u64,
            len: len as u64,
        };
        // SAFETY: UFFDIO_UNREGISTER reads one `uffdio_range`.
        let rc =
            unsafe { libc::ioctl(self.raw_fd(), UFFDIO_UNREGISTER as _, &mut range as *mut _) };
        if rc < 0 {
            return Err(SysError::Call {
                op: "UFFDIO_UNREGISTER",
                source: last_err(),
            });
        }
        Ok(())
    }

    /// Wake the threads waiting on faults in a range (used when another path already populated it).
    pub fn wake(&self, addr: usize, len: usize) -> Result<(), SysError> {
        let mut range = UffdioRange {
            start: addr as u64,
            len: len as u64,
        };
        // SAFETY: UFFDIO_WAKE reads one `uffdio_range`.
        let rc = unsafe { libc::ioctl(self.raw_fd(), UFFDIO_WAKE as _, &mut range as *mut _) };
        if rc < 0 {
            return Err(SysError::Call {
                op: "UFFDIO_WAKE",
                source: last_err(),
            });
        }
        Ok(())
    }

    /// Atomically copy `src` into the missing pages at `dst`, and wake the waiters if `wake`
    /// (otherwise they sleep until [`Uffd::wake`]: the pager wakes them once its books say the
    /// chunk is there).
    /// Returns the errno classification: `EEXIST` (a page is already mapped) and `EAGAIN`
    /// (the address space is changing; retry) come back as `Partial` with `done` bytes copied.
    pub fn copy(&self, dst: usize, src: &[u8], wake: bool) -> Result<(), SysError> {
        let mut copy = UffdioCopy {
            dst: dst as u64,
            src: src.as_ptr() as u64,
            len: src.len() as u64,
            mode: if wake { 0 } else { MODE_DONTWAKE },
            copy: 0,
        };
        // SAFETY: UFFDIO_COPY reads `len` bytes from `src`, a live slice, and writes them only into
        // missing pages of our registered range; it never touches memory the kernel did not map.
        let rc = unsafe { libc::ioctl(self.raw_fd(), UFFDIO_COPY as _, &mut copy as *mut _) };
        if rc < 0 {
            return Err(SysError::Partial {
                op: "UFFDIO_COPY",
                addr: dst,
                len: src.len(),
                done: copy.copy.max(0) as usize,
                source: last_err(),
            });
        }
        Ok(())
    }

    /// Map the shared zero page over missing pages (costs no memory; a later write copies on write).
    pub fn zeropage(&self, addr: usize, len: usize) -> Result<(), SysError> {
        let mut zp = UffdioZeropage {
            range: UffdioRange {
                start: addr as u64,
                len: len as u64,
            },
            mode: 0,
            zeropage: 0,
        };
        // SAFETY: UFFDIO_ZEROPAGE reads and writes one `uffdio_zeropage`.
        let rc = unsafe { libc::ioctl(self.raw_fd(), UFFDIO_ZEROPAGE as _, &mut zp as *mut _) };
        if rc < 0 {
            return Err(SysError::Partial {
                op: "UFFDIO_ZEROPAGE",
                addr,
                len,
                done: zp.zeropage.max(0) as usize,
                source: last_err(),
            });
        }
        Ok(())
    }

    /// Move the pages of `[src, src+len)` (present, private anonymous, exclusive) to the missing
    /// pages at `dst` without copying, and wake the waiters if `wake`; the source range is left
    /// unmapped.
    ///
    /// # Safety
    /// `src..src+len` must be a private anonymous mapping that nothing reads or writes during the
    /// call, and whose contents the caller gives up (it reads as zeros afterwards).
    pub unsafe fn move_pages(
        &self,
        dst: usize,
        src: usize,
        len: usize,
        wake: bool,
    ) -> Result<(), SysError> {
        if !self.move_supported {
            return Err(SysError::Unsupported {
                what: "UFFDIO_MOVE",
            });
        }
        let mut mv = UffdioMove {
            dst: dst as u64,
            src: src as u64,
            len: len as u64,
            mode: if wake { 0 } else { MODE_DONTWAKE },
            moved: 0,
        };
        // SAFETY: UFFDIO_MOVE reads and writes one `uffdio_move`; the caller guarantees the source
        // pages are ours to give away, and the kernel only fills missing pages of our range.
        let rc = unsafe { libc::ioctl(self.raw_fd(), UFFDIO_MOVE as _, &mut mv as *mut _) };
        if rc < 0 {
            return Err(SysError::Partial {
                op: "UFFDIO_MOVE",
                addr: dst,
                len,
                done: mv.moved.max(0) as usize,
                source: last_err(),
            });
        }
        Ok(())
    }

    /// Read up to `out.len()` page faults without blocking; returns how many were read.
    /// Events other than page faults (none are requested) are skipped.
    pub fn read_faults(&self, out: &mut [Fault]) -> Result<usize, SysError> {
        let mut msgs = [UffdMsg::default(); 16];
        let want = out.len().min(msgs.len());
        // SAFETY: `msgs` is a live array of `want` or more plain-old-data messages that `read`
        // fills with at most `want * 32` bytes.
        let n = unsafe {
            libc::read(
                self.raw_fd(),
                msgs.as_mut_ptr().cast(),
                want * size_of::<UffdMsg>(),
            )
        };
        if n < 0 {
            let err = last_err();
            if err.raw_os_error() == Some(libc::EAGAIN) {
                return Ok(0);
            }
            return Err(SysError::Call {
                op: "read(userfaultfd)",
                source: err,
            });
        }
        let count = n as usize / size_of::<UffdMsg>();
        let mut k = 0;
        for m in &msgs[..count] {
            if m.event == UFFD_EVENT_PAGEFAULT {
                out[k] = Fault {
                    addr: m.arg1 as usize,
                    write: m.arg0 & UFFD_PAGEFAULT_FLAG_WRITE != 0,
                };
                k += 1;
            }
        }
        Ok(k)
    }
}

// ---- anonymous mappings -------------------------------------------------------------------------

/// A private anonymous mapping, reserved without backing (`MAP_NORESERVE`) and unmapped on drop.
#[derive(Debug)]
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a `Mapping` is an address range; it owns no thread-bound state, and every access to its
// contents goes through raw pointers whose users synchronise among themselves.
unsafe impl Send for Mapping {}
// SAFETY: see `Send`; `&Mapping` only hands out the base address and length.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Reserve `len` bytes (page-rounded) of read-write virtual space; no memory is spent until
    /// touched. A `PROT_NONE` guard page on each side keeps the kernel from merging the range with
    /// a neighbour, so its `Rss:` in /proc/self/smaps is its own.
    pub fn reserve(len: usize) -> Result<Mapping, SysError> {
        let len = page_round(len.max(1));
        let outer = len + 2 * PAGE;
        // SAFETY: an anonymous mapping at an address of the kernel's choice aliases nothing.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                outer,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(SysError::Call {
                op: "mmap",
                source: last_err(),
            });
        }
        // SAFETY: `p + PAGE .. p + PAGE + len` lies inside the mapping just made, which only we know.
        let inner = unsafe { p.cast::<u8>().add(PAGE) };
        let m = Mapping {
            ptr: NonNull::new(inner).ok_or(SysError::Unsupported {
                what: "a non-null mapping",
            })?,
            len,
        };
        // SAFETY: the inner range is part of our fresh mapping; making it read-write aliases nothing.
        let rc = unsafe { libc::mprotect(inner.cast(), len, libc::PROT_READ | libc::PROT_WRITE) };
        if rc < 0 {
            return Err(SysError::Call {
                op: "mprotect",
                source: last_err(),
            });
        }
        // Transparent huge pages would make a 4 KiB fault populate 2 MiB behind our back.
        m.madvise(0, len, libc::MADV_NOHUGEPAGE)?;
        Ok(m)
    }

    /// The first byte.
    pub fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    /// The base pointer.
    pub fn ptr(&self) -> NonNull<u8> {
        self.ptr
    }

    /// The length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the mapping is empty (never: `reserve` rounds up to a page).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn madvise(&self, off: usize, len: usize, advice: i32) -> Result<(), SysError> {
        debug_assert!(off + len <= self.len && off.is_multiple_of(PAGE));
        // SAFETY: the range lies inside our own mapping; madvise changes no Rust-visible object.
        let rc = unsafe { libc::madvise(self.ptr.as_ptr().add(off).cast(), len, advice) };
        if rc < 0 {
            return Err(SysError::Call {
                op: "madvise",
                source: last_err(),
            });
        }
        Ok(())
    }

    /// Fault in writable pages over `[off, off+len)` ahead of use (MADV_POPULATE_WRITE, 5.14+).
    pub fn populate_write(&self, off: usize, len: usize) -> Result<(), SysError> {
        const MADV_POPULATE_WRITE: i32 = 23;
        if len == 0 {
            return Ok(());
        }
        self.madvise(off, page_round(len), MADV_POPULATE_WRITE)
    }

    /// Drop the pages of `[off, off+len)`: they return to the kernel, and the next touch faults.
    pub fn dontneed(&self, off: usize, len: usize) -> Result<(), SysError> {
        if len == 0 {
            return Ok(());
        }
        self.madvise(off, page_round(len), libc::MADV_DONTNEED)
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: we own the mapping, guard pages included, and nothing borrows from it past the
        // owner's lifetime.
        unsafe {
            libc::munmap(self.ptr.as_ptr().sub(PAGE).cast(), self.len + 2 * PAGE);
        }
    }
}

// ---- eventfd, poll -----------------------------------------------------------------------------

/// An eventfd the pager uses to wake its fault thread.
#[derive(Debug)]
pub struct EventFd(OwnedFd);

impl EventFd {
    /// A non-blocking, close-on-exec eventfd.
    pub fn new() -> Result<EventFd, SysError> {
        // SAFETY: eventfd takes flags by value and returns a new fd or -1.
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if raw < 0 {
            return Err(SysError::Call {
                op: "eventfd",
                source: last_err(),
            });
        }
        // SAFETY: `raw` is a fresh fd that nothing else owns.
        Ok(EventFd(unsafe { OwnedFd::from_raw_fd(raw) }))
    }

    /// Add one to the counter (wakes a poller).
    pub fn signal(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64; a full counter (EAGAIN) already means "signalled".
        unsafe {
            libc::write(self.0.as_raw_fd(), (&one as *const u64).cast(), 8);
        }
    }

    /// Reset the counter.
    pub fn drain(&self) {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64; EAGAIN (nothing signalled) is fine.
        unsafe {
            libc::read(self.0.as_raw_fd(), (&mut v as *mut u64).cast(), 8);
        }
    }

    /// The raw fd, for poll(2).
    pub fn raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// Wait until `a` or `b` is readable, or `timeout_ms` passes; returns (a readable, b readable).
pub fn poll2(a: RawFd, b: RawFd, timeout_ms: i32) -> Result<(bool, bool), SysError> {
    let mut fds = [
        libc::pollfd {
            fd: a,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: b,
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    // SAFETY: `fds` is a live array of two pollfd structs.
    let rc = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout_ms) };
    if rc < 0 {
        let err = last_err();
        if err.raw_os_error() == Some(libc::EINTR) {
            return Ok((false, false));
        }
        return Err(SysError::Call {
            op: "poll",
            source: err,
        });
    }
    Ok((fds[0].revents != 0, fds[1].revents != 0))
}

/// Gives the C allocator's free memory back to the kernel: the pages of every arena's free
/// chunks, not only the top of each heap (glibc's `malloc_trim(0)`). glibc keeps what a thread
/// frees in that thread's arena for its next allocation, so the engine's transient buffers of a
/// long call (megabytes per layer at depth, on several threads) stay resident after it, counted
/// against the daemon's memory until the same threads allocate as much again. Called between
/// calls; returns whether anything was released. A no-op on other C libraries.
pub fn release_free_heap() -> bool {
    #[cfg(target_env = "gnu")]
    {
        // SAFETY: malloc_trim has no preconditions; it only takes the arenas' locks.
        unsafe { libc::malloc_trim(0) == 1 }
    }
    #[cfg(not(target_env = "gnu"))]
    {
        false
    }
}

/// The page size of the running kernel.
pub fn kernel_page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let v = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    v.max(0) as usize
}

/// The summed `Rss:` of the mappings that make up `[addr, addr+len)`, in bytes, read from
/// /proc/self/smaps. Fails if a mapping straddles either end (its Rss would not be ours alone).
pub fn smaps_rss(addr: usize, len: usize) -> io::Result<u64> {
    let end = addr + len;
    let mut covered = 0;
    let total = smaps_sum(addr, len, "Rss:", |a, b| {
        if a < addr || b > end {
            return Err(io::Error::other(format!(
                "mapping {a:#x}-{b:#x} straddles {addr:#x}-{end:#x}"
            )));
        }
        covered += b - a;
        Ok(())
    })?;
    if covered != len {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("/proc/self/smaps covers {covered} of the {len} bytes at {addr:#x}"),
        ));
    }
    Ok(total)
}

/// The `AnonHugePages:` of the mappings that overlap `[addr, addr+len)`, in bytes, capped at
/// `len`, read from /proc/self/smaps (a mapping that straddles the range counts whole).
pub fn smaps_anon_huge(addr: usize, len: usize) -> io::Result<u64> {
    Ok(smaps_sum(addr, len, "AnonHugePages:", |_, _| Ok(()))?.min(len as u64))
}

/// Sums the size field `field` (in bytes) over the mappings of /proc/self/smaps that overlap
/// `[addr, addr+len)`, calling `each(start, end)` on each such mapping first.
fn smaps_sum(
    addr: usize,
    len: usize,
    field: &str,
    mut each: impl FnMut(usize, usize) -> io::Result<()>,
) -> io::Result<u64> {
    let text = std::fs::read_to_string("/proc/self/smaps")?;
    let end = addr + len;
    let mut inside = false;
    let mut total = 0;
    for line in text.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((a, b)) = first.split_once('-')
            && let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
        {
            inside = a < end && b > addr;
            if inside {
                each(a, b)?;
            }
            continue;
        }
        if inside && let Some(rest) = line.strip_prefix(field) {
            total += smaps_bytes(line, rest)?;
        }
    }
    Ok(total)
}

/// The bytes of a /proc/self/smaps size field (`rest`: what follows its name, in kB).
fn smaps_bytes(line: &str, rest: &str) -> io::Result<u64> {
    let kb: u64 = rest
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .map_err(|_| io::Error::other(format!("bad smaps line {line:?}")))?;
    Ok(kb * 1024)
}
