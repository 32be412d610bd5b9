//! Direct reads kept in flight at once on one io_uring, each into a part of the ring's own buffer.
//!
//! A Load brings many chunks back at once; one thread per read in flight costs a thread per
//! request and a wake-up per completion, and on a 2-core machine the disk's queue stays shallow.
//! [`ReadRing`] lets one thread keep as many reads in flight as its buffer holds: it starts a read
//! into a free part of the buffer, waits for whichever read ends first, hands out that part's
//! bytes until they are released, and never lets the caller see a part the kernel may still write.
//!
//! The buffer is one anonymous mapping, advised into transparent huge pages and faulted in when
//! made (a direct read into huge pages runs about twice as fast as into small ones here,
//! docs/kvfs.md), carved into 4 KiB pages handed out first-fit.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use io_uring::{IoUring, opcode, types};

use crate::sys::SysError;

const PAGE: usize = 4096;
const HUGE: usize = 2 << 20;
/// Fault a range in writable (5.14+); not in every libc release.
const MADV_POPULATE_WRITE: i32 = 23;

/// One read that has ended ([`ReadRing::wait`]): its tag, what the kernel said, and (through
/// [`ReadRing::bytes`]) its part of the buffer until [`ReadRing::release`].
#[derive(Debug)]
pub struct Read {
    /// The tag given to [`ReadRing::start`].
    pub tag: u64,
    /// Bytes read, or the read's error.
    pub result: io::Result<usize>,
    part: usize,
    generation: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PartState {
    Free,
    InFlight,
    Ended,
}

#[derive(Debug, Clone, Copy)]
struct Part {
    first_page: usize,
    pages: usize,
    tag: u64,
    state: PartState,
    generation: u64,
}

/// Reads in flight on one io_uring, into parts of a buffer the ring owns. See the module's doc.
pub struct ReadRing {
    ring: IoUring,
    mem: HugeMem,
    /// One bit per 4 KiB page of the buffer: set while a part holds it.
    used: Vec<u64>,
    parts: Vec<Part>,
    in_flight: usize,
}

/// Numbers every read started in the process.
static GENERATION: AtomicU64 = AtomicU64::new(0);

impl std::fmt::Debug for ReadRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadRing")
            .field("buffer_bytes", &self.mem.len)
            .field("in_flight", &self.in_flight)
            .finish()
    }
}

impl ReadRing {
    /// A ring of `depth` entries over a buffer of `bytes` (rounded up to whole huge pages).
    /// Fails where the kernel refuses io_uring (`kernel.io_uring_disabled`, a seccomp filter).
    pub fn new(depth: u32, bytes: usize) -> Result<ReadRing, SysError> {
        let ring = IoUring::new(depth.max(1)).map_err(|source| SysError::Call {
            op: "io_uring_setup",
            source,
        })?;
        let mem = HugeMem::new(bytes.max(1).next_multiple_of(HUGE))?;
        let pages = mem.len / PAGE;
        Ok(ReadRing {
            ring,
            used: vec![0; pages.div_ceil(64)],
            mem,
            parts: Vec::new(),
            in_flight: 0,
        })
    }

    /// The buffer's bytes.
    pub fn buffer_bytes(&self) -> usize {
        self.mem.len
    }

    /// Of those, the bytes the kernel backs with huge pages.
    pub fn huge_bytes(&self) -> usize {
        crate::sys::smaps_anon_huge(self.mem.ptr.as_ptr() as usize, self.mem.len).unwrap_or(0)
            as usize
    }

    /// Reads started and not yet handed out by [`ReadRing::wait`].
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Starts reading `len` bytes of `fd` at `offset` into a free part of the buffer (`len` and
    /// `offset` multiples of 4 KiB, as `O_DIRECT` needs). `Ok(false)` when there is no room for it
    /// now (the buffer, or the ring's entries): wait for a read and release it first. A read
    /// longer than the whole buffer is an error. The read is submitted at once (the kernel then
    /// holds the file), or, if the kernel refuses the submission now, at the next
    /// [`ReadRing::wait`]: keep `fd` open until the read ends.
    pub fn start(
        &mut self,
        tag: u64,
        fd: BorrowedFd<'_>,
        offset: u64,
        len: usize,
    ) -> Result<bool, SysError> {
        if len == 0 || !len.is_multiple_of(PAGE) || !offset.is_multiple_of(PAGE as u64) {
            return Err(SysError::Unsupported {
                what: "a direct read of whole 4 KiB pages",
            });
        }
        if len > self.mem.len || len > u32::MAX as usize {
            return Err(SysError::Unsupported {
                what: "a read that fits the ring's buffer",
            });
        }
        let pages = len / PAGE;
        let Some(first_page) = self.find_free(pages) else {
            return Ok(false);
        };
        let part = match self.parts.iter().position(|p| p.state == PartState::Free) {
            Some(i) => i,
            None => {
                self.parts.push(Part {
                    first_page: 0,
                    pages: 0,
                    tag: 0,
                    state: PartState::Free,
                    generation: 0,
                });
                self.parts.len() - 1
            }
        };
        // SAFETY: `first_page .. first_page + pages` lies inside the buffer (find_free searched
        // only its pages) and no other part holds any of those pages, so the pointer is in bounds
        // and the kernel is the only writer of that range until the read ends.
        let ptr = unsafe { self.mem.ptr.as_ptr().add(first_page * PAGE) };
        let entry = opcode::Read::new(types::Fd(fd.as_raw_fd()), ptr, len as u32)
            .offset(offset)
            .build()
            .user_data(part as u64);
        // SAFETY: the entry's buffer is the part just taken, which stays allocated (the pages stay
        // marked used, the mapping stays mapped) until its completion has been reaped: `release`
        // refuses a part in flight and `Drop` waits for every read before unmapping.
        let pushed = unsafe { self.ring.submission().push(&entry) };
        if pushed.is_err() {
            return Ok(false);
        }
        self.mark(first_page, pages, true);
        self.parts[part] = Part {
            first_page,
            pages,
            tag,
            state: PartState::InFlight,
            // Unique in the process, so a `Read` of another ring never matches.
            generation: GENERATION.fetch_add(1, Ordering::Relaxed),
        };
        self.in_flight += 1;
        // Submitted alone, at once: a batch would reach the device only once all of it is
        // prepared, and measured slower here (docs/service.md). The read is in the ring either
        // way: if the kernel refuses it now, `wait` submits it again and reports what fails.
        if let Err(e) = self.enter(0) {
            tracing::debug!(error = %e, "io_uring_enter; the read stays queued");
        }
        Ok(true)
    }

    /// Waits for one read to end and returns it (`None` when nothing is in flight). Its bytes stay
    /// readable through [`ReadRing::bytes`] until it is released.
    pub fn wait(&mut self) -> Result<Option<Read>, SysError> {
        if self.in_flight == 0 {
            return Ok(None);
        }
        loop {
            if let Some(cqe) = self.ring.completion().next() {
                let part = cqe.user_data() as usize;
                let res = cqe.result();
                let p = &mut self.parts[part];
                debug_assert_eq!(p.state, PartState::InFlight);
                p.state = PartState::Ended;
                self.in_flight -= 1;
                return Ok(Some(Read {
                    tag: p.tag,
                    result: if res < 0 {
                        Err(io::Error::from_raw_os_error(-res))
                    } else {
                        Ok(res as usize)
                    },
                    part,
                    generation: p.generation,
                }));
            }
            self.enter(1)?;
        }
    }

    /// The bytes of an ended read: the whole length it asked for (`read.result` says how many the
    /// kernel filled).
    ///
    /// # Panics
    /// If `read` came from another ring or was released.
    pub fn bytes(&self, read: &Read) -> &[u8] {
        let p = self.ended(read);
        // SAFETY: the part is Ended: the kernel has finished writing it and nothing else writes
        // it until it is released, which needs the `Read` by value while this borrow lives.
        unsafe {
            std::slice::from_raw_parts(
                self.mem.ptr.as_ptr().add(p.first_page * PAGE),
                p.pages * PAGE,
            )
        }
    }

    /// Gives an ended read's part of the buffer back.
    ///
    /// # Panics
    /// If `read` came from another ring.
    pub fn release(&mut self, read: Read) {
        let p = *self.ended(&read);
        self.mark(p.first_page, p.pages, false);
        self.parts[read.part].state = PartState::Free;
    }

    fn ended(&self, read: &Read) -> &Part {
        let p = &self.parts[read.part];
        assert!(
            p.state == PartState::Ended && p.generation == read.generation,
            "a read this ring did not hand out"
        );
        p
    }

    /// Submits what is queued and waits for `want` completions, retrying on EINTR.
    fn enter(&mut self, want: usize) -> Result<(), SysError> {
        loop {
            match self.ring.submit_and_wait(want) {
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(source) => {
                    return Err(SysError::Call {
                        op: "io_uring_enter",
                        source,
                    });
                }
            }
        }
    }

    /// The first run of `pages` free pages.
    fn find_free(&self, pages: usize) -> Option<usize> {
        let total = self.mem.len / PAGE;
        let mut run = 0;
        let mut page = 0;
        while page < total {
            let word = self.used[page / 64];
            if page % 64 == 0 && word == u64::MAX {
                run = 0;
                page += 64;
                continue;
            }
            if page % 64 == 0 && word == 0 && pages - run > 64 {
                run += 64;
                page += 64;
                continue;
            }
            if word & (1 << (page % 64)) == 0 {
                run += 1;
                if run == pages {
                    return Some(page + 1 - pages);
                }
            } else {
                run = 0;
            }
            page += 1;
        }
        None
    }

    fn mark(&mut self, first: usize, pages: usize, used: bool) {
        for page in first..first + pages {
            if used {
                self.used[page / 64] |= 1 << (page % 64);
            } else {
                self.used[page / 64] &= !(1 << (page % 64));
            }
        }
    }
}

impl Drop for ReadRing {
    fn drop(&mut self) {
        // The kernel may still write parts in flight: reap every read before the buffer goes.
        while self.in_flight > 0 {
            match self.wait() {
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(e) => {
                    // Unmapping memory the kernel writes into is not unsound (a direct read pins
                    // its pages), but keep the mapping rather than hand its range back early.
                    tracing::error!(error = %e, "reaping reads in flight; the buffer is leaked");
                    self.mem.leak = true;
                    break;
                }
            }
        }
    }
}

/// An anonymous mapping aligned to, and advised into, transparent huge pages, faulted in whole.
struct HugeMem {
    ptr: NonNull<u8>,
    len: usize,
    /// The whole mapping as made (alignment slack included), for munmap.
    base: *mut libc::c_void,
    base_len: usize,
    leak: bool,
}

// SAFETY: `HugeMem` is an address range owned by one `ReadRing`; access to its bytes goes through
// the ring's `&self` / `&mut self` methods, which the borrow checker orders.
unsafe impl Send for HugeMem {}

impl HugeMem {
    fn new(len: usize) -> Result<HugeMem, SysError> {
        let base_len = len + HUGE;
        // SAFETY: an anonymous mapping at an address of the kernel's choice aliases nothing.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                base_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(SysError::Call {
                op: "mmap",
                source: io::Error::last_os_error(),
            });
        }
        let skip = (base as usize).next_multiple_of(HUGE) - base as usize;
        // SAFETY: `skip < HUGE`, so `base + skip .. base + skip + len` lies inside the mapping.
        let start = unsafe { base.cast::<u8>().add(skip) };
        let mem = HugeMem {
            ptr: NonNull::new(start).ok_or(SysError::Unsupported {
                what: "a non-null mapping",
            })?,
            len,
            base,
            base_len,
            leak: false,
        };
        // SAFETY: the range is our own fresh mapping; the advice changes no Rust-visible object.
        // Either may fail without harm (no THP, an old kernel): the buffer then is small pages.
        unsafe {
            libc::madvise(start.cast(), len, libc::MADV_HUGEPAGE);
            libc::madvise(start.cast(), len, MADV_POPULATE_WRITE);
        }
        Ok(mem)
    }
}

impl Drop for HugeMem {
    fn drop(&mut self) {
        if self.leak {
            return;
        }
        // SAFETY: we own the mapping, and the ring reaped every read into it before this drop.
        unsafe {
            libc::munmap(self.base, self.base_len);
        }
    }
}
