//! The client side of a mounted store's data path: [`MountReader`] keeps a context's `data` and
//! `kv` files open and moves whole chunks through them with one `preadv` or `pwritev` each.
//!
//! The `data` file is the context's data file, offset for offset: chunk `i` sits in one of its two
//! slots ([`crate::slot_offset`]), a header page (the 104-byte chunk header, then zeros) followed by
//! the stored payload. The reader opens it with `O_DIRECT`, so with FUSE passthrough (root, the
//! default) the kernel reads the data file itself, straight into the caller's buffer, and the
//! daemon never sees the read. Writes go to the `kv` file, which the daemon serves. Nobody checked those bytes on the way, so the reader checks them
//! as the store would: the header's crc, the context, the index, the model, the generation the
//! store named, the payload's crc. A chunk that fails is reported to the store
//! ([`Store::report_corrupt`]), which quarantines it, unless a rewrite moved it meanwhile; then
//! the read is retried at its new place.

use std::fs::{File, OpenOptions};
use std::io::IoSlice;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::format::{ChunkHeader, Codec, Fingerprint, HEADER_LEN, KvFormat};
use crate::fs::kv_offset;
use crate::io::{DIRECT_ALIGN, IoError, read_slot};
use crate::store::read::{Check, decode_payload, read_raw_slot, with_scratch};
use crate::store::{
    ContextId, HEADER_PAGE, MAX_CHUNK_BYTES, Store, StoreError, StoredChunk, slot_offset,
};

/// How many times a read that finds the chunk moved by a concurrent rewrite is retried.
const MOVED_RETRIES: usize = 8;

/// A context's `data` file (and `kv` file, to write) in a kvfs mount, kept open; share it between
/// threads (`&self` methods, positioned I/O only).
#[derive(Debug)]
pub struct MountReader {
    /// `data`, opened `O_RDONLY | O_DIRECT`: passed through to the data file where the mount can.
    read: File,
    /// `kv`, opened `O_WRONLY` (served by the daemon, which commits each chunk crash-safely).
    write: Option<File>,
    /// The `data` file's path.
    path: PathBuf,
    context: ContextId,
    fingerprint: Fingerprint,
}

impl MountReader {
    /// Opens `<mountpoint>/<context>/data` for reading chunks of model `fingerprint`.
    pub fn open(
        mountpoint: &Path,
        context: ContextId,
        fingerprint: Fingerprint,
    ) -> Result<MountReader, StoreError> {
        Self::open_with(mountpoint, context, fingerprint, false)
    }

    /// Opens `<mountpoint>/<context>/data` for reading and `kv` for writing chunks (see
    /// [`MountReader::write_chunk`]).
    pub fn open_rw(
        mountpoint: &Path,
        context: ContextId,
        fingerprint: Fingerprint,
    ) -> Result<MountReader, StoreError> {
        Self::open_with(mountpoint, context, fingerprint, true)
    }

    fn open_with(
        mountpoint: &Path,
        context: ContextId,
        fingerprint: Fingerprint,
        write: bool,
    ) -> Result<MountReader, StoreError> {
        let dir = mountpoint.join(context.to_string());
        let open = |name: &str, o: &mut OpenOptions| {
            let path = dir.join(name);
            o.open(&path).map_err(|e| match e.kind() {
                std::io::ErrorKind::NotFound => StoreError::NoSuchContext { context },
                _ => IoError::new("open", &path, e).into(),
            })
        };
        let read = open(
            "data",
            OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC),
        )?;
        let write = if write {
            Some(open(
                "kv",
                OpenOptions::new().write(true).custom_flags(libc::O_CLOEXEC),
            )?)
        } else {
            None
        };
        let path = dir.join("data");
        Ok(MountReader {
            read,
            write,
            path,
            context,
            fingerprint,
        })
    }

    /// The context this file belongs to.
    pub fn context(&self) -> ContextId {
        self.context
    }

    /// Reads chunk `index` into the front of `buf` and returns its metadata: the bytes are
    /// `buf[..meta.raw_len as usize]`. `store` is the store the mount serves (in this process):
    /// it names the chunk's slot and generation ([`Store::locate`]) and quarantines a chunk that
    /// fails a check.
    ///
    /// A raw chunk is one `preadv` straight into `buf` when `buf` is 4 KiB-aligned and holds the
    /// chunk rounded up to 4 KiB (the pager's staging buffers are); otherwise, and for a zstd
    /// payload, the slot is read into a buffer kept per thread and copied or decompressed out.
    /// Nothing is allocated per read in steady state.
    ///
    /// Errors as [`Store::read_chunk_into`]: a chunk that is not stored is
    /// [`StoreError::ChunkMissing`]; one that fails a check has been quarantined and is
    /// [`StoreError::Corrupt`]; both say to recompute it.
    pub fn read_chunk_into(
        &self,
        store: &Store,
        index: u32,
        buf: &mut [u8],
    ) -> Result<StoredChunk, StoreError> {
        let mut at = store.locate(self.context, index, &self.fingerprint)?;
        for _ in 0..MOVED_RETRIES {
            let reason = match self.read_at(index, &at, buf) {
                Ok(()) => return Ok(at),
                Err(Check::TooSmall { need, have }) => {
                    return Err(StoreError::BufferTooSmall {
                        context: self.context,
                        index,
                        need,
                        have,
                    });
                }
                Err(Check::Bad(reason)) => reason,
            };
            let now = store.locate(self.context, index, &self.fingerprint)?;
            if now.generation == at.generation {
                let reason = format!("through {}: {reason}", self.path.display());
                return Err(store.report_corrupt(self.context, index, at.generation, reason));
            }
            at = now;
        }
        Err(StoreError::Corrupt {
            context: self.context,
            index,
            reason: format!("moved by {MOVED_RETRIES} rewrites during one read"),
        })
    }

    /// Where chunk `index`'s slot lies in the `data` file, for a caller that reads it with direct
    /// reads of its own (many in flight at once, [`MountReader::as_fd`]) and then hands the bytes
    /// to [`MountReader::check_raw`]. `None` for a payload that is not stored raw: read that one
    /// with [`MountReader::read_chunk_into`]. Errors as [`Store::locate`].
    pub fn raw_slot(&self, store: &Store, index: u32) -> Result<Option<RawSlot>, StoreError> {
        let at = store.locate(self.context, index, &self.fingerprint)?;
        if at.codec != Codec::Raw || at.stored_len != at.raw_len {
            return Ok(None);
        }
        Ok(Some(RawSlot { index, at }))
    }

    /// Checks what a direct read of `slot` gave (`bytes`: the slot's first [`RawSlot::read_len`] bytes,
    /// the header page then the payload) as [`MountReader::read_chunk_into`] does. `Some` when it
    /// is the chunk: its bytes are `bytes[RawSlot::payload()]`. `None` when anything is amiss (a
    /// short read, a failed check, a rewrite that moved the chunk meanwhile): read it again with
    /// [`MountReader::read_chunk_into`], which retries at the chunk's new place or quarantines it.
    pub fn check_raw(&self, slot: &RawSlot, bytes: &[u8]) -> Option<StoredChunk> {
        let payload = bytes.get(slot.payload())?;
        let h = self.check_header(slot.index, &slot.at, bytes).ok()?;
        h.check_payload(payload).ok()?;
        Some(slot.at.clone())
    }

    /// Reads the slot `at` names and checks it against `at`.
    fn read_at(&self, index: u32, at: &StoredChunk, buf: &mut [u8]) -> Result<(), Check> {
        let raw = at.raw_len as usize;
        if raw > buf.len() {
            return Err(Check::TooSmall {
                need: raw,
                have: buf.len(),
            });
        }
        let offset = slot_offset(index, at.copy);
        let stored = at.stored_len as usize;
        if let Some(read) = read_raw_slot(&self.read, index, at, buf) {
            let page = read.map_err(Check::Bad)?;
            let h = self.check_header(index, at, &page.0)?;
            return h
                .check_payload(&buf[..stored])
                .map_err(|e| Check::Bad(e.to_string()));
        }
        with_scratch(|s| {
            let (file, dctx) = s
                .parts()
                .map_err(|e| Check::Bad(format!("zstd context: {e}")))?;
            let r = read_slot(&self.read, true, offset, HEADER_PAGE + stored, file)
                .map_err(|e| Check::Bad(format!("read: {e}")))?;
            let slot = &file[r];
            if slot.len() < HEADER_PAGE + stored {
                return Err(Check::Bad(format!(
                    "read {} bytes of a {}-byte slot",
                    slot.len(),
                    HEADER_PAGE + stored
                )));
            }
            let h = self.check_header(index, at, &slot[..HEADER_LEN])?;
            let payload = &slot[HEADER_PAGE..HEADER_PAGE + stored];
            h.check_payload(payload)
                .map_err(|e| Check::Bad(e.to_string()))?;
            decode_payload(&h, payload, &mut buf[..raw], dctx)
        })
    }

    /// Checks a slot's header against what the store said is there.
    fn check_header(
        &self,
        index: u32,
        at: &StoredChunk,
        page: &[u8],
    ) -> Result<ChunkHeader, Check> {
        let h = ChunkHeader::decode(page).map_err(|e| Check::Bad(e.to_string()))?;
        if h.context != self.context.0 || h.index != index {
            return Err(Check::Bad(format!(
                "slot holds context {} chunk {}",
                h.context, h.index
            )));
        }
        if h.fingerprint != self.fingerprint {
            return Err(Check::Bad(format!(
                "written for model {}, read for model {}",
                h.fingerprint, self.fingerprint
            )));
        }
        if h.generation != at.generation
            || h.stored_len != at.stored_len
            || h.raw_len != at.raw_len
            || h.codec != at.codec
        {
            return Err(Check::Bad(format!(
                "slot holds generation {}, the store named {}",
                h.generation, at.generation
            )));
        }
        Ok(h)
    }

    /// Writes chunk `index` through the mount with one `pwritev` (one FUSE request for chunks up to
    /// about 1 MiB; larger ones are gathered by the daemon): the daemon checks the image and
    /// commits it with the store's crash-safe write (payload, fdatasync, header, fdatasync) before
    /// the write returns, so a chunk is durable once this returns.
    /// Needs a file opened with [`MountReader::open_rw`]; the chunk's tokens must be stored.
    pub fn write_chunk(
        &self,
        index: u32,
        format: KvFormat,
        density: f32,
        data: &[u8],
    ) -> Result<(), StoreError> {
        if data.len() > MAX_CHUNK_BYTES {
            return Err(StoreError::TooLarge { len: data.len() });
        }
        let Some(file) = &self.write else {
            return Err(StoreError::Invalid {
                what: "write",
                why: format!("{} is open for reading only", self.path.display()),
            });
        };
        let header = ChunkHeader {
            format,
            codec: Codec::Raw,
            context: self.context.0,
            index,
            // The daemon records the token span, its crc and the generation itself.
            token_start: 0,
            token_end: 0,
            tokens_crc: 0,
            density,
            raw_len: data.len() as u32,
            stored_len: data.len() as u32,
            payload_crc: crc32c::crc32c(data),
            generation: 0,
            fingerprint: self.fingerprint,
            // The daemon records the time it commits the chunk.
            written: 0,
        }
        .encode();
        let total = HEADER_LEN + data.len();
        let mut done = 0;
        let at = kv_offset(index);
        while done < total {
            let res = if done < HEADER_LEN {
                let iov = [IoSlice::new(&header[done..]), IoSlice::new(data)];
                nix::sys::uio::pwritev(file, &iov, (at + done as u64) as libc::off_t)
            } else {
                let iov = [IoSlice::new(&data[done - HEADER_LEN..])];
                nix::sys::uio::pwritev(file, &iov, (at + done as u64) as libc::off_t)
            };
            match res {
                Ok(0) => {
                    return Err(IoError::new(
                        "write",
                        &self.path,
                        std::io::Error::new(std::io::ErrorKind::WriteZero, "wrote nothing"),
                    )
                    .into());
                }
                Ok(n) => done += n,
                Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(IoError::new("write", &self.path, e.into()).into()),
            }
        }
        Ok(())
    }
}

impl AsFd for MountReader {
    /// The `data` file, opened `O_RDONLY | O_DIRECT`: read a [`RawSlot`] from it.
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.read.as_fd()
    }
}

/// Where a raw chunk lies in its context's `data` file ([`MountReader::raw_slot`]): read
/// [`RawSlot::read_len`] bytes at [`RawSlot::offset`] with `O_DIRECT` (both are multiples of
/// 4 KiB) and give them to [`MountReader::check_raw`].
#[derive(Clone, Debug)]
pub struct RawSlot {
    index: u32,
    /// What the store says the slot holds.
    at: StoredChunk,
}

impl RawSlot {
    /// The slot's offset in the `data` file.
    pub fn offset(&self) -> u64 {
        slot_offset(self.index, self.at.copy)
    }

    /// Bytes to read: the header page and the payload, rounded up to 4 KiB.
    pub fn read_len(&self) -> usize {
        (HEADER_PAGE + self.at.stored_len as usize).next_multiple_of(DIRECT_ALIGN)
    }

    /// The chunk's bytes within what was read.
    pub fn payload(&self) -> std::ops::Range<usize> {
        HEADER_PAGE..HEADER_PAGE + self.at.raw_len as usize
    }
}
