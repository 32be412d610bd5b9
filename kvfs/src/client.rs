//! The client side of a mounted store's data path: [`MountReader`] keeps a context's `kv` file open
//! and moves whole chunks through it with one `preadv` or `pwritev` each.
//!
//! Chunk `i` of a context is the *image* at offset `i * KV_SLOT_BYTES` of `/<mount>/<ctx>/kv`: a
//! 104-byte chunk header (codec raw) followed by the chunk's plain bytes, as a raw chunk file is on
//! disk. A read scatters the header into a buffer on the stack and the bytes straight into the
//! caller's buffer, then checks the header (its crc, the context, the index, the model, the length)
//! the way the store checks a file; the daemon has already checked the stored file end to end.

use std::fs::{File, OpenOptions};
use std::io::{IoSlice, IoSliceMut};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::format::{ChunkHeader, Codec, Fingerprint, HEADER_LEN, KvFormat};
use crate::fs::kv_offset;
use crate::io::IoError;
use crate::store::{ContextId, MAX_CHUNK_BYTES, StoreError, StoredChunk, stored_of};

/// One FUSE request carries at most this many bytes here (256 pages: the kernel's default
/// `max_pages_limit`), less a page for the header's buffer and one for an unaligned start.
/// A chunk image longer than this may arrive in several requests, each served from the store on
/// its own, so for those the reader checks the payload crc too: a rewrite between two requests is
/// then caught and the read retried.
const ONE_REQUEST: usize = (256 - 2) * 4096;

/// How many times a read torn by a concurrent rewrite is retried before it is reported.
const TORN_RETRIES: usize = 8;

/// A context's `kv` file in a kvfs mount, kept open; share it between threads (`&self` methods,
/// positioned I/O only).
#[derive(Debug)]
pub struct MountReader {
    file: File,
    path: PathBuf,
    context: ContextId,
    fingerprint: Fingerprint,
    verify_payload: bool,
}

impl MountReader {
    /// Opens `<mountpoint>/<context>/kv` for reading chunks of model `fingerprint`.
    pub fn open(
        mountpoint: &Path,
        context: ContextId,
        fingerprint: Fingerprint,
    ) -> Result<MountReader, StoreError> {
        Self::open_with(mountpoint, context, fingerprint, false)
    }

    /// Opens `<mountpoint>/<context>/kv` for reading and writing chunks (see
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
        let path = mountpoint.join(context.to_string()).join("kv");
        let file = OpenOptions::new()
            .read(true)
            .write(write)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::NotFound => StoreError::NoSuchContext { context },
                _ => IoError::new("open", &path, e).into(),
            })?;
        Ok(MountReader {
            file,
            path,
            context,
            fingerprint,
            verify_payload: false,
        })
    }

    /// Also check every chunk's payload crc on the client side (always done for chunks larger
    /// than one FUSE request); costs one crc32c pass over the bytes.
    pub fn verify_payload(mut self, on: bool) -> MountReader {
        self.verify_payload = on;
        self
    }

    /// The context this file belongs to.
    pub fn context(&self) -> ContextId {
        self.context
    }

    /// Reads chunk `index` into the front of `buf` with one `preadv` (no allocation) and returns
    /// its metadata: the bytes are `buf[..meta.raw_len as usize]`.
    ///
    /// Errors as [`crate::Store::read_chunk_into`]: a chunk that is not stored is
    /// [`StoreError::ChunkMissing`]; one that fails the daemon's checks comes back as EIO, has been
    /// quarantined, and is [`StoreError::Corrupt`]; both say to recompute it.
    /// A `buf` shorter than the chunk is [`StoreError::BufferTooSmall`].
    pub fn read_chunk_into(&self, index: u32, buf: &mut [u8]) -> Result<StoredChunk, StoreError> {
        let mut torn = None;
        for _ in 0..TORN_RETRIES {
            let mut head = [0u8; HEADER_LEN];
            let n = {
                let mut iov = [IoSliceMut::new(&mut head), IoSliceMut::new(buf)];
                self.preadv(&mut iov, kv_offset(index))
                    .map_err(|e| self.read_error(index, e))?
            };
            if n == 0 {
                return Err(StoreError::ChunkMissing {
                    context: self.context,
                    index,
                });
            }
            let h = ChunkHeader::decode(&head[..n.min(HEADER_LEN)])
                .map_err(|e| self.corrupt(index, e.to_string()))?;
            if h.context != self.context.0 || h.index != index {
                return Err(self.corrupt(
                    index,
                    format!("the kv file served context {} chunk {}", h.context, h.index),
                ));
            }
            if h.fingerprint != self.fingerprint {
                return Err(StoreError::ForeignModel {
                    context: self.context,
                    expected: self.fingerprint,
                    found: h.fingerprint,
                });
            }
            if h.codec != Codec::Raw || h.stored_len != h.raw_len {
                return Err(self.corrupt(index, "the kv file served a packed payload".into()));
            }
            let raw = h.raw_len as usize;
            if raw > buf.len() {
                return Err(StoreError::BufferTooSmall {
                    context: self.context,
                    index,
                    need: raw,
                    have: buf.len(),
                });
            }
            if n != HEADER_LEN + raw {
                // Shorter: the chunk was rewritten smaller between two requests of a split read.
                torn = Some(format!(
                    "read {n} bytes of a {}-byte image",
                    HEADER_LEN + raw
                ));
                continue;
            }
            if (self.verify_payload || HEADER_LEN + raw > ONE_REQUEST)
                && let Err(e) = h.check_payload(&buf[..raw])
            {
                torn = Some(e.to_string());
                continue;
            }
            return Ok(stored_of(&h));
        }
        Err(self.corrupt(index, torn.unwrap_or_else(|| "torn reads".to_owned())))
    }

    /// Writes chunk `index` through the mount with one `pwritev` (one FUSE request for chunks up to
    /// about 1 MiB; larger ones are gathered by the daemon): the daemon checks the image and
    /// commits it with the store's crash-safe write (temp file, fsync, rename, fsync of the
    /// directory) before the write returns, so a chunk is durable once this returns.
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
        }
        .encode();
        let total = HEADER_LEN + data.len();
        let mut done = 0;
        let at = kv_offset(index);
        while done < total {
            let res = if done < HEADER_LEN {
                let iov = [IoSlice::new(&header[done..]), IoSlice::new(data)];
                nix::sys::uio::pwritev(&self.file, &iov, (at + done as u64) as libc::off_t)
            } else {
                let iov = [IoSlice::new(&data[done - HEADER_LEN..])];
                nix::sys::uio::pwritev(&self.file, &iov, (at + done as u64) as libc::off_t)
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

    fn preadv(&self, iov: &mut [IoSliceMut<'_>], offset: u64) -> Result<usize, nix::errno::Errno> {
        loop {
            match nix::sys::uio::preadv(&self.file, iov, offset as libc::off_t) {
                Err(nix::errno::Errno::EINTR) => continue,
                other => return other,
            }
        }
    }

    fn read_error(&self, index: u32, e: nix::errno::Errno) -> StoreError {
        match e {
            nix::errno::Errno::EIO => StoreError::Corrupt {
                context: self.context,
                index,
                reason: "the mount refused it (EIO): it failed a check and was quarantined".into(),
            },
            nix::errno::Errno::ENOENT => StoreError::NoSuchContext {
                context: self.context,
            },
            e => IoError::new("read", &self.path, e.into()).into(),
        }
    }

    fn corrupt(&self, index: u32, reason: String) -> StoreError {
        StoreError::Corrupt {
            context: self.context,
            index,
            reason: format!("through {}: {reason}", self.path.display()),
        }
    }
}
