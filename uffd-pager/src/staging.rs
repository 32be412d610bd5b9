//! `Staging`: a page-aligned anonymous buffer the engine fills and the pager populates from (by UFFDIO_MOVE or by copy).

use crate::sys::{Mapping, PAGE_SIZE, SysError};
use crate::types::PagerError;

/// A page-aligned anonymous buffer for populating by UFFDIO_MOVE (or by copy).
#[derive(Debug)]
pub struct Staging {
    pub(crate) map: Mapping,
}

impl Staging {
    /// A staging buffer of at least `len` bytes (page-rounded).
    pub fn new(len: usize) -> Result<Staging, PagerError> {
        let map = Mapping::reserve(len).map_err(|source| PagerError::Setup { source })?;
        Ok(Staging { map })
    }

    /// Fault the whole buffer in, writable, ahead of use (MADV_POPULATE_WRITE): after a
    /// `populate_move` took its pages, a background thread can pay the page allocation here
    /// instead of the next writer.
    pub fn prefault(&mut self) -> Result<(), PagerError> {
        self.map
            .populate_write(0, self.map.len())
            .map_err(|source| PagerError::Setup { source })
    }

    /// Fault `[off, off+len)` of the buffer in (page-rounded), as `prefault` does for all of it.
    pub fn prefault_range(&mut self, off: usize, len: usize) -> Result<(), PagerError> {
        if !off.is_multiple_of(PAGE_SIZE) || off.saturating_add(len) > self.map.len() {
            return Err(PagerError::Setup {
                source: SysError::Unsupported {
                    what: "a page-aligned range inside the staging buffer",
                },
            });
        }
        self.map
            .populate_write(off, len)
            .map_err(|source| PagerError::Setup { source })
    }

    /// The buffer, to fill.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is ours, read-write, `len` bytes long, and `&mut self` makes this the
        // only reference to it; pages the kernel took by UFFDIO_MOVE read back as zeros.
        unsafe { std::slice::from_raw_parts_mut(self.map.ptr().as_ptr(), self.map.len()) }
    }

    /// The buffer, to read.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: as in `as_mut_slice`; `&self` excludes writers.
        unsafe { std::slice::from_raw_parts(self.map.ptr().as_ptr(), self.map.len()) }
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether it is empty (never).
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}
