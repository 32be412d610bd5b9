//! The data path, one pair of files per context: `data` (the data file offset for offset, passed
//! through to `O_DIRECT` readers or served as it is) and `kv` (served checked, and where chunk
//! images are written and committed before the write returns).

use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use fuser::{BackingId, Errno, FileHandle, FopenFlags, ReplyData, ReplyOpen};

use super::state::{Handle, KvFs, Partial, errno, store_err};
use crate::format::{ChunkHeader, Codec, HEADER_LEN};
use crate::store::{ContextId, MAX_CHUNK_BYTES, SLOT_BYTES, StoreError, StoreState, slot_offset};

/// Where a write of chunk `index`'s image goes in its context's `kv` file: the offset of the
/// chunk's first slot ([`slot_offset`]). Reads of the `kv` file show the data file offset for
/// offset, so a reader finds the chunk at whichever slot [`Store::locate`](crate::Store::locate) names.
pub fn kv_offset(index: u32) -> u64 {
    slot_offset(index, 0)
}

/// The length of the chunk image a `kv` write header announces, after checking that it names
/// context `c` and chunk `index` and holds plain bytes.
pub(super) fn image_len(h: &ChunkHeader, c: ContextId, index: u32) -> Result<usize, Errno> {
    if h.context != c.0 || h.index != index || h.codec != Codec::Raw || h.stored_len != h.raw_len {
        return Err(Errno::EINVAL);
    }
    if h.raw_len as usize > MAX_CHUNK_BYTES {
        return Err(Errno::EFBIG);
    }
    Ok(HEADER_LEN + h.raw_len as usize)
}

impl KvFs {
    /// Serves `size` bytes at `offset` of context `c`'s `kv` file, as the data file holds them:
    /// the bytes of a chunk's current slot (header page, then stored payload) once the chunk has
    /// passed every check, zeros anywhere else up to the file's end, never crossing into the next
    /// slot; EIO within the slots of a chunk that fails its checks (it is quarantined) or was
    /// quarantined before.
    pub(super) fn read_kv(&self, c: ContextId, offset: u64, size: u32, reply: ReplyData) {
        let len = match self.kv_len(c) {
            Ok(l) => l,
            Err(e) => return reply.error(e),
        };
        let within = (offset % SLOT_BYTES) as usize;
        let want = (size as u64)
            .min(SLOT_BYTES - within as u64)
            .min(len.saturating_sub(offset)) as usize;
        let slot = offset / SLOT_BYTES;
        let (index, copy) = (slot / 2, (slot % 2) as u8);
        let stored = match u32::try_from(index) {
            Ok(i) => match self.store.chunk_state(c, i) {
                Ok(StoreState::Stored(s)) if s.copy == copy => Some(i),
                // Refused again, as the store refuses it, until it is rewritten.
                Ok(StoreState::Quarantined { .. }) => return reply.error(Errno::EIO),
                Ok(_) => None,
                Err(e) => return reply.error(store_err(e)),
            },
            Err(_) => None,
        };
        let Some(i) = stored else {
            return reply.data(&vec![0; want]);
        };
        let fp = match self.store.fingerprint(c) {
            Ok(fp) => fp,
            Err(e) => return reply.error(store_err(e)),
        };
        let mut reply = Some(reply);
        let res = self.store.with_slot(c, i, &fp, |_, bytes| {
            let start = within.min(bytes.len());
            let end = (within + want).min(bytes.len());
            if let Some(r) = reply.take() {
                if end - start == want {
                    r.data(&bytes[start..end]);
                } else {
                    // Past the payload, within the slot: the zeros the data file holds there.
                    let mut out = Vec::with_capacity(want);
                    out.extend_from_slice(&bytes[start..end]);
                    out.resize(want, 0);
                    r.data(&out);
                }
            }
        });
        if res.is_ok() && within == 0 {
            self.counters.kv_reads.fetch_add(1, Ordering::Relaxed);
        }
        if let (Err(e), Some(r)) = (res, reply.take()) {
            if matches!(e, StoreError::Corrupt { .. }) {
                tracing::warn!(error = %e, "kvfs refused a corrupt chunk");
            }
            r.error(store_err(e));
        }
    }

    /// Serves `size` bytes at `offset` of context `c`'s `data` file where the kernel does not pass
    /// it through: the data file's bytes as they are, unchecked (the reader checks them), read
    /// without filling the page cache.
    pub(super) fn read_data(&self, c: ContextId, offset: u64, size: u32, reply: ReplyData) {
        let path = self.store.data_path(c);
        let res = std::fs::File::open(&path).and_then(|f| {
            let mut buf = vec![0u8; size as usize];
            let mut done = 0;
            while done < buf.len() {
                match f.read_at(&mut buf[done..], offset + done as u64)? {
                    0 => break,
                    n => done += n,
                }
            }
            crate::io::drop_range(&f, offset, done);
            buf.truncate(done);
            if offset.is_multiple_of(SLOT_BYTES) && done > 0 {
                self.counters.kv_reads.fetch_add(1, Ordering::Relaxed);
            }
            Ok(buf)
        });
        match res {
            Ok(b) => reply.data(&b),
            Err(e) => reply.error(Errno::from_i32(e.raw_os_error().unwrap_or(libc::EIO))),
        }
    }

    /// Registers context `c`'s data file with the kernel for a passthrough open (or takes another
    /// reference to its registration).
    pub(super) fn backing_for(
        &self,
        c: ContextId,
        reply: &ReplyOpen,
    ) -> std::io::Result<Arc<BackingId>> {
        let mut backing = self.backing.lock();
        if let Some((id, users)) = backing.get_mut(&c) {
            *users += 1;
            return Ok(Arc::clone(id));
        }
        let file = std::fs::File::open(self.store.data_path(c))?;
        let id = Arc::new(reply.open_backing(&file)?);
        backing.insert(c, (Arc::clone(&id), 1));
        Ok(id)
    }

    /// Drops a passthrough handle's reference to its context's registration.
    pub(super) fn release_backing(&self, c: ContextId) {
        let mut backing = self.backing.lock();
        if let Some((_, users)) = backing.get_mut(&c) {
            *users -= 1;
            if *users == 0 {
                backing.remove(&c);
            }
        }
    }

    /// Opens a `data` file for an `O_DIRECT` reader with `FOPEN_PASSTHROUGH`: from here on the
    /// kernel serves its reads from the data file and the reader checks what it gets
    /// ([`crate::MountReader`]). `Err` hands the open back to be served by the daemon.
    pub(super) fn open_passthrough(
        &self,
        uid: u32,
        c: ContextId,
        reply: ReplyOpen,
    ) -> Result<(), (ReplyOpen, Errno)> {
        if let Err(e) = self.owner(uid, c) {
            return Err((reply, e));
        }
        match self.backing_for(c, &reply) {
            Ok(id) => {
                let fh = self.add_handle(Handle::Passthrough(c));
                self.counters
                    .passthrough_opens
                    .fetch_add(1, Ordering::Relaxed);
                reply.opened_passthrough(fh, FopenFlags::FOPEN_NOFLUSH, &id);
                Ok(())
            }
            Err(e) => {
                tracing::warn!(context = %c, error = %e, "FUSE passthrough refused; the daemon serves this kv file");
                Err((reply, Errno::EAGAIN))
            }
        }
    }

    /// Takes `data` written at `offset` of context `c`'s `kv` file: a chunk image (a raw chunk
    /// header and the plain bytes) at its slot, whole or in pieces; a whole image is checked (its
    /// crcs, that it names this context, this slot and the context's model) and committed with
    /// [`Store::write_chunk`](crate::Store::write_chunk) before the write returns, so a returned `pwrite` is durable.
    pub(super) fn write_kv(
        &self,
        fh: FileHandle,
        c: ContextId,
        offset: u64,
        data: &[u8],
    ) -> Result<u32, Errno> {
        if self.read_only {
            return Err(Errno::EROFS);
        }
        let slot = offset / SLOT_BYTES;
        if !slot.is_multiple_of(2) {
            // Chunk images are written at their chunk's first slot only.
            return Err(Errno::EINVAL);
        }
        let index = u32::try_from(slot / 2).map_err(|_| Errno::EINVAL)?;
        let within = (offset % SLOT_BYTES) as usize;
        if within == 0 {
            let header = ChunkHeader::decode(data).map_err(|_| Errno::EINVAL)?;
            let total = image_len(&header, c, index)?;
            if data.len() > total {
                return Err(Errno::EINVAL);
            }
            if data.len() < total {
                let mut image = Vec::with_capacity(total);
                image.extend_from_slice(data);
                let mut handles = self.handles.lock();
                let Some(Handle::Kv { partial }) = handles.get_mut(&fh.0) else {
                    return Err(Errno::EBADF);
                };
                *partial = Some(Partial {
                    index,
                    image,
                    filled: data.len(),
                });
                return Ok(data.len() as u32);
            }
            self.commit_image(c, index, &header, data)?;
            return Ok(data.len() as u32);
        }
        // A later piece of a split image: gather it, commit when whole.
        let done = {
            let mut handles = self.handles.lock();
            let Some(Handle::Kv { partial }) = handles.get_mut(&fh.0) else {
                return Err(Errno::EBADF);
            };
            let Some(p) = partial.as_mut().filter(|p| p.index == index) else {
                return Err(Errno::EINVAL);
            };
            let end = within.checked_add(data.len()).ok_or(Errno::EINVAL)?;
            if within != p.image.len() || end > p.image.capacity() {
                return Err(Errno::EINVAL);
            }
            p.image.extend_from_slice(data);
            p.filled = end;
            if end == p.image.capacity() {
                partial.take()
            } else {
                None
            }
        };
        if let Some(p) = done {
            let header = ChunkHeader::decode(&p.image).map_err(|_| Errno::EINVAL)?;
            self.commit_image(c, p.index, &header, &p.image)?;
        }
        Ok(data.len() as u32)
    }

    /// Checks a whole chunk image written to the `kv` file and writes it to the store.
    pub(super) fn commit_image(
        &self,
        c: ContextId,
        index: u32,
        header: &ChunkHeader,
        image: &[u8],
    ) -> Result<(), Errno> {
        let payload = &image[HEADER_LEN..];
        header.check_payload(payload).map_err(|e| {
            tracing::warn!(context = %c, index, error = %e, "kvfs refused a damaged chunk image");
            Errno::EIO
        })?;
        self.store
            .write_chunk(
                c,
                index,
                &header.fingerprint,
                header.format,
                header.density,
                payload,
            )
            .map(|_| {
                self.counters.kv_writes.fetch_add(1, Ordering::Relaxed);
            })
            .map_err(|e| {
                if matches!(e, StoreError::NoSuchContext { .. }) {
                    // The context was deleted with this write in flight: expected, not a fault.
                    tracing::debug!(error = %e, "kvfs write of a deleted context refused");
                } else {
                    tracing::warn!(error = %e, "kvfs write through the kv file failed");
                }
                errno(&e)
            })
    }
}
