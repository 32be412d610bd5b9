//! Checked chunk reads: every read path of the store (into a caller's buffer, a vector, or a slot's
//! bytes for the mount), the per-thread read buffers `MountReader` shares, and the quarantine of a
//! chunk found bad at read time.

use std::cell::RefCell;
use std::fs::File;
use std::sync::atomic::Ordering;

use super::{
    ContextId, Ctx, HEADER_PAGE, MAX_CHUNK_BYTES, Store, StoreError, StoreState, StoredChunk,
    check_identity, covers, slot_offset, stored_of,
};
use crate::format::{ChunkHeader, Codec, Fingerprint, FormatError};
use crate::io::{AlignedBuf, DIRECT_ALIGN, IoError, read_slot};

impl Store {
    /// Reads chunk `index` of a context, checked end to end (header crc, identity, model fingerprint,
    /// tokens, payload crc, decompressed length). A chunk that fails a check is quarantined and the
    /// error says to recompute it ([`StoreError::needs_recompute`]).
    ///
    /// This allocates the returned vector; the service's load and fault paths use
    /// [`Store::read_chunk_into`], which does not.
    pub fn read_chunk(
        &self,
        id: ContextId,
        index: u32,
        fingerprint: &Fingerprint,
    ) -> Result<Vec<u8>, StoreError> {
        let mut out = Vec::new();
        self.read_chunk_into_vec(id, index, fingerprint, &mut out)?;
        Ok(out)
    }

    /// Reads chunk `index` of a context into the front of `buf`, with every check of
    /// [`Store::read_chunk`], and returns the chunk's metadata: its bytes are
    /// `buf[..meta.raw_len as usize]`.
    ///
    /// Nothing is allocated per read in steady state. A raw payload read with O_DIRECT into a
    /// page-aligned `buf` at least the payload rounded up to 4 KiB long is read straight into it
    /// (one `preadv`: the header page into a page on the stack, the payload into `buf`, whose
    /// bytes past the chunk up to that length are overwritten), as `MountReader` does. Otherwise
    /// the slot is read with O_DIRECT into a buffer kept per thread (grown once to the largest
    /// slot seen), a raw payload is copied into `buf` and a zstd payload is decompressed straight
    /// into it with a decompression context kept per thread.
    /// A `buf` shorter than the chunk is [`StoreError::BufferTooSmall`] (the chunk is fine; nothing
    /// is quarantined); a chunk that fails a check is quarantined and never copied out whole:
    /// `buf` may then hold garbage, and the error says to recompute the chunk.
    pub fn read_chunk_into(
        &self,
        id: ContextId,
        index: u32,
        fingerprint: &Fingerprint,
        buf: &mut [u8],
    ) -> Result<StoredChunk, StoreError> {
        if let Some(chunk) = self.read_raw_into(id, index, fingerprint, buf) {
            return Ok(chunk);
        }
        self.read_checked(id, index, fingerprint, |h, copy, slot, dctx| {
            let raw = h.raw_len as usize;
            let have = buf.len();
            let out = buf
                .get_mut(..raw)
                .ok_or(Check::TooSmall { need: raw, have })?;
            decode_payload(h, &slot[HEADER_PAGE..], out, dctx)?;
            Ok(stored_of(h, copy))
        })
    }

    /// The direct case of [`Store::read_chunk_into`]: a raw payload read by the kernel straight
    /// into `buf`, checked as every read is. `None` when it does not apply (no O_DIRECT, a zstd
    /// payload, a `buf` unaligned or short) and when anything is amiss (not stored, a read error,
    /// a failed check, a concurrent rewrite): the per-thread path then reads the slot again and
    /// decides, quarantining what is really bad.
    fn read_raw_into(
        &self,
        id: ContextId,
        index: u32,
        fingerprint: &Fingerprint,
        buf: &mut [u8],
    ) -> Option<StoredChunk> {
        let ctx = self.ctx_of_model(id, fingerprint).ok()?;
        let file = ctx.direct.as_ref()?;
        let at = match ctx.state.lock().chunks.get(&index) {
            Some(StoreState::Stored(s)) => s.clone(),
            _ => return None,
        };
        let page = read_raw_slot(file, index, &at, buf)?.ok()?;
        let payload = &buf[..at.stored_len as usize];
        let h = self
            .check_parts(&ctx, index, at.generation, &page.0, payload)
            .ok()?;
        self.counters.chunk_reads.fetch_add(1, Ordering::Relaxed);
        self.counters
            .chunk_read_bytes
            .fetch_add(u64::from(h.raw_len), Ordering::Relaxed);
        Some(stored_of(&h, at.copy))
    }

    /// [`Store::read_chunk_into`] into a vector resized to the chunk's length (its capacity is
    /// reused, so a vector kept by the caller stops allocating once it has held the largest chunk).
    pub fn read_chunk_into_vec(
        &self,
        id: ContextId,
        index: u32,
        fingerprint: &Fingerprint,
        buf: &mut Vec<u8>,
    ) -> Result<StoredChunk, StoreError> {
        self.read_checked(id, index, fingerprint, |h, copy, slot, dctx| {
            let raw = h.raw_len as usize;
            let payload = &slot[HEADER_PAGE..];
            buf.clear();
            // Copy or decompress into the vector's spare capacity: no zero-filling first.
            match h.codec {
                Codec::Raw if payload.len() == raw => buf.extend_from_slice(payload),
                Codec::Raw => {
                    return Err(Check::Bad(format!(
                        "raw payload of {} bytes, header says {raw} raw",
                        payload.len()
                    )));
                }
                Codec::Zstd => {
                    buf.reserve(raw);
                    let n = dctx
                        .decompress_to_buffer(payload, buf)
                        .map_err(|e| Check::Bad(format!("zstd: {e}")))?;
                    if n != raw {
                        return Err(Check::Bad(format!(
                            "decompressed to {n} bytes, header says {raw}"
                        )));
                    }
                }
            }
            Ok(stored_of(h, copy))
        })
    }

    /// Reads and checks chunk `index` as [`Store::read_chunk`] does and calls `f` with its slot's
    /// bytes as they are in the data file: the header page (the 104-byte header, then zeros) and
    /// the stored payload (raw or zstd). This is what the mount's `kv` file serves where the
    /// kernel does not pass it through; `f` runs only for a chunk that passed every check.
    pub fn with_slot<R>(
        &self,
        id: ContextId,
        index: u32,
        fingerprint: &Fingerprint,
        f: impl FnOnce(&StoredChunk, &[u8]) -> R,
    ) -> Result<R, StoreError> {
        let mut f = Some(f);
        self.read_checked(id, index, fingerprint, |h, copy, slot, _| match f.take() {
            Some(f) => Ok(f(&stored_of(h, copy), slot)),
            None => Err(Check::Bad("slot consumed twice".into())),
        })
    }

    /// Where chunk `index` of a context is, for a reader of the data file (through the mount's
    /// passed-through `kv` file): its metadata, whose `copy` names the slot ([`slot_offset`]) and
    /// whose `generation` the slot's header must carry. A reader that finds anything else there
    /// asks again (a rewrite moved the chunk) and reports a slot that fails its checks twice at
    /// the same place with [`Store::report_corrupt`].
    pub fn locate(
        &self,
        id: ContextId,
        index: u32,
        fingerprint: &Fingerprint,
    ) -> Result<StoredChunk, StoreError> {
        let ctx = self.ctx_of_model(id, fingerprint)?;
        let st = ctx.state.lock();
        match st.chunks.get(&index) {
            Some(StoreState::Stored(s)) => Ok(s.clone()),
            Some(StoreState::Quarantined { reason }) => Err(StoreError::Corrupt {
                context: id,
                index,
                reason: reason.clone(),
            }),
            _ => Err(StoreError::ChunkMissing { context: id, index }),
        }
    }

    /// A reader outside the store found chunk `index`'s slot at `generation` failing its checks:
    /// unless a write has replaced it since, the slot is quarantined (its bytes as they are on
    /// disk kept in `quarantine/`) and the chunk marked for recompute. Returns the error to give
    /// the reader's caller ([`StoreError::Corrupt`]).
    pub fn report_corrupt(
        &self,
        id: ContextId,
        index: u32,
        generation: u64,
        reason: String,
    ) -> StoreError {
        let Ok(ctx) = self.ctx(id) else {
            return StoreError::NoSuchContext { context: id };
        };
        let _w = ctx.write.lock();
        let (copy, stored_len) = match ctx.state.lock().chunks.get(&index) {
            Some(StoreState::Stored(s)) if s.generation == generation => (s.copy, s.stored_len),
            _ => {
                // Replaced or already quarantined: nothing of this generation is served.
                return StoreError::Corrupt {
                    context: id,
                    index,
                    reason,
                };
            }
        };
        let mut bytes = AlignedBuf::default();
        let file = ctx.direct.as_ref().unwrap_or(&ctx.data);
        let kept = read_slot(
            file,
            ctx.direct.is_some(),
            slot_offset(index, copy),
            HEADER_PAGE + stored_len as usize,
            &mut bytes,
        );
        // The slot as it is on disk, header page and payload, is what quarantine keeps.
        let bytes = kept.map(|r| bytes[r].to_vec()).unwrap_or_default();
        self.set_aside(&ctx, index, copy, &bytes, &reason);
        StoreError::Corrupt {
            context: id,
            index,
            reason,
        }
    }

    /// Quarantines a chunk's slot found bad at read time (the caller holds the context's write
    /// lock and has checked the slot is still the current one) and marks the chunk.
    fn set_aside(&self, ctx: &Ctx, index: u32, copy: u8, bytes: &[u8], reason: &str) {
        if !self.options.read_only
            && let Err(e) = self.keep_aside(&ctx.data, ctx.id, index, copy, bytes)
        {
            tracing::warn!(context = %ctx.id, index, error = %e, "could not quarantine");
        }
        self.quarantined.fetch_add(1, Ordering::Relaxed);
        self.counters
            .corrupt_detected
            .fetch_add(1, Ordering::Relaxed);
        tracing::warn!(context = %ctx.id, index, reason = %reason, "corrupt chunk quarantined");
        ctx.state.lock().chunks.insert(
            index,
            StoreState::Quarantined {
                reason: reason.to_owned(),
            },
        );
    }

    /// The one read path: reads chunk `index`'s slot (header page and payload) into this thread's
    /// scratch buffer with one read, checks it, and hands it to `finish` (which copies or
    /// decompresses it out). A chunk that fails a check, in the slot or in `finish`, is
    /// quarantined unless a concurrent write replaced it (then the read is retried).
    fn read_checked<R>(
        &self,
        id: ContextId,
        index: u32,
        fingerprint: &Fingerprint,
        mut finish: impl FnMut(
            &ChunkHeader,
            u8,
            &[u8],
            &mut zstd::bulk::Decompressor<'static>,
        ) -> Result<R, Check>,
    ) -> Result<R, StoreError> {
        let _span = tracing::debug_span!("kvfs_read_chunk", context = %id, index).entered();
        let ctx = self.ctx_of_model(id, fingerprint)?;
        let file = ctx.direct.as_ref().unwrap_or(&ctx.data);
        with_scratch(|s| {
            let (buf, dctx) = s
                .parts()
                .map_err(|e| IoError::new("zstd context for", &self.root, e))?;
            // A concurrent write may replace the chunk while we read it; retry if it moved.
            for _ in 0..3 {
                let (generation, copy, stored_len) = match ctx.state.lock().chunks.get(&index) {
                    Some(StoreState::Stored(s)) => (s.generation, s.copy, s.stored_len),
                    Some(StoreState::Quarantined { reason }) => {
                        return Err(StoreError::Corrupt {
                            context: id,
                            index,
                            reason: reason.clone(),
                        });
                    }
                    _ => return Err(StoreError::ChunkMissing { context: id, index }),
                };
                let at = slot_offset(index, copy);
                let len = HEADER_PAGE + stored_len as usize;
                let r = read_slot(file, ctx.direct.is_some(), at, len, buf)
                    .map_err(|e| IoError::new("read", &ctx.dir.join("data"), e))?;
                let slot = &buf[r];
                let checked = self
                    .check_slot(&ctx, index, generation, slot)
                    .and_then(|h| finish(&h, copy, slot, dctx).map(|r| (h.raw_len, r)));
                let check = match checked {
                    Ok((raw_len, r)) => {
                        self.counters.chunk_reads.fetch_add(1, Ordering::Relaxed);
                        self.counters
                            .chunk_read_bytes
                            .fetch_add(raw_len as u64, Ordering::Relaxed);
                        return Ok(r);
                    }
                    Err(Check::TooSmall { need, have }) => {
                        return Err(StoreError::BufferTooSmall {
                            context: id,
                            index,
                            need,
                            have,
                        });
                    }
                    Err(Check::Bad(reason)) => reason,
                };
                let _w = ctx.write.lock();
                let current = match ctx.state.lock().chunks.get(&index) {
                    Some(StoreState::Stored(s)) => Some(s.generation),
                    _ => None,
                };
                if current != Some(generation) {
                    continue;
                }
                self.set_aside(&ctx, index, copy, slot, &check);
                return Err(StoreError::Corrupt {
                    context: id,
                    index,
                    reason: check,
                });
            }
            Err(StoreError::ChunkMissing { context: id, index })
        })
    }

    /// Checks a chunk's slot read whole: header, identity, generation, model, payload length and
    /// crc, tokens.
    fn check_slot(
        &self,
        ctx: &Ctx,
        index: u32,
        generation: u64,
        slot: &[u8],
    ) -> Result<ChunkHeader, Check> {
        let (page, payload) = slot.split_at(HEADER_PAGE.min(slot.len()));
        self.check_parts(ctx, index, generation, page, payload)
    }

    /// [`Store::check_slot`] on a slot read in two parts: its header page and its payload (which
    /// may run past the header's stored length).
    fn check_parts(
        &self,
        ctx: &Ctx,
        index: u32,
        generation: u64,
        page: &[u8],
        payload: &[u8],
    ) -> Result<ChunkHeader, Check> {
        let bad = |e: FormatError| Check::Bad(e.to_string());
        let header = ChunkHeader::decode(page).map_err(bad)?;
        check_identity(&header, ctx.id, index, &ctx.meta).map_err(Check::Bad)?;
        if header.generation != generation {
            return Err(Check::Bad(format!(
                "slot holds generation {}, expected {generation}",
                header.generation
            )));
        }
        let payload = payload.get(..header.stored_len as usize).ok_or_else(|| {
            Check::Bad(format!(
                "slot cut short: {} bytes for a {}-byte payload",
                payload.len(),
                header.stored_len
            ))
        })?;
        header.check_payload(payload).map_err(bad)?;
        if header.raw_len as usize > MAX_CHUNK_BYTES {
            return Err(Check::Bad(format!(
                "header says {} raw bytes, more than the limit",
                header.raw_len
            )));
        }
        let st = ctx.state.lock();
        if !covers(
            &st.tokens,
            &(header.token_start..header.token_end),
            header.tokens_crc,
        ) {
            return Err(Check::Bad(
                "computed from tokens the context no longer has".into(),
            ));
        }
        Ok(header)
    }

    /// Reads every stored chunk and checks it; returns the chunks that failed (now quarantined).
    pub fn verify(&self) -> Vec<(ContextId, u32, StoreError)> {
        let mut bad = Vec::new();
        for id in self.list_contexts() {
            let Ok(info) = self.context(id) else { continue };
            for c in info.chunks {
                if matches!(c.state, StoreState::Stored(_))
                    && let Err(e) = self.read_chunk(id, c.index, &info.meta.fingerprint)
                {
                    bad.push((id, c.index, e));
                }
            }
        }
        bad
    }
}

/// A page-aligned buffer for a slot's header page (on the stack: an O_DIRECT read into it needs
/// no allocation).
#[repr(C, align(4096))]
pub(crate) struct HeaderPage(pub(crate) [u8; HEADER_PAGE]);

/// Reads a raw chunk's slot with one `preadv` of `file` (opened O_DIRECT): the header page into
/// the returned page, the payload straight into `buf`, up to the payload rounded up to 4 KiB.
/// `None` when that does not apply (a zstd payload, `buf` unaligned or shorter than that); an
/// error names a failed or short read. The caller checks what it read.
pub(crate) fn read_raw_slot(
    file: &File,
    index: u32,
    at: &StoredChunk,
    buf: &mut [u8],
) -> Option<Result<HeaderPage, String>> {
    let stored = at.stored_len as usize;
    let rounded = stored.next_multiple_of(DIRECT_ALIGN);
    if at.codec != Codec::Raw
        || at.stored_len != at.raw_len
        || buf.as_ptr().align_offset(DIRECT_ALIGN) != 0
        || buf.len() < rounded
    {
        return None;
    }
    let mut page = HeaderPage([0; HEADER_PAGE]);
    let mut iov = [
        std::io::IoSliceMut::new(&mut page.0),
        std::io::IoSliceMut::new(&mut buf[..rounded]),
    ];
    Some(
        match preadv_all(file, &mut iov, slot_offset(index, at.copy)) {
            Err(e) => Err(format!("read: {e}")),
            Ok(n) if n < HEADER_PAGE + stored => Err(format!(
                "read {n} bytes of a {}-byte slot",
                HEADER_PAGE + stored
            )),
            Ok(_) => Ok(page),
        },
    )
}

/// One positioned vectored read, retried on `EINTR`.
fn preadv_all(
    f: &File,
    iov: &mut [std::io::IoSliceMut<'_>],
    offset: u64,
) -> Result<usize, nix::errno::Errno> {
    loop {
        match nix::sys::uio::preadv(f, iov, offset as libc::off_t) {
            Err(nix::errno::Errno::EINTR) => continue,
            other => return other,
        }
    }
}

/// Why a chunk read did not deliver.
pub(crate) enum Check {
    /// The slot failed a check: quarantine it.
    Bad(String),
    /// The chunk is fine but the caller's buffer is too short for it.
    TooSmall { need: usize, have: usize },
}

/// Buffers for chunk reads, one set per thread, kept between reads so that steady-state reads
/// allocate nothing: the O_DIRECT slot buffer and the zstd decompression context.
#[derive(Default)]
pub(crate) struct Scratch {
    file: AlignedBuf,
    dctx: Option<zstd::bulk::Decompressor<'static>>,
}

/// The read buffer and the decompression context of a [`Scratch`], borrowed together.
pub(crate) type ScratchParts<'a> = (
    &'a mut AlignedBuf,
    &'a mut zstd::bulk::Decompressor<'static>,
);

impl Scratch {
    /// The read buffer and the decompression context (made at first use).
    pub(crate) fn parts(&mut self) -> std::io::Result<ScratchParts<'_>> {
        let dctx = match &mut self.dctx {
            Some(d) => d,
            d => d.insert(zstd::bulk::Decompressor::new()?),
        };
        Ok((&mut self.file, dctx))
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Runs `f` with this thread's scratch buffers (or one-off buffers if they are in use, which
/// happens only when a [`Store::with_slot`] callback reads another chunk).
pub(crate) fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    SCRATCH.with(|s| match s.try_borrow_mut() {
        Ok(mut s) => f(&mut s),
        Err(_) => f(&mut Scratch::default()),
    })
}

/// Copies or decompresses a checked payload into `out`, which is exactly the chunk's raw length.
pub(crate) fn decode_payload(
    h: &ChunkHeader,
    payload: &[u8],
    out: &mut [u8],
    dctx: &mut zstd::bulk::Decompressor<'static>,
) -> Result<(), Check> {
    match h.codec {
        Codec::Raw if payload.len() == out.len() => {
            out.copy_from_slice(payload);
            Ok(())
        }
        Codec::Raw => Err(Check::Bad(format!(
            "raw payload of {} bytes, header says {} raw",
            payload.len(),
            out.len()
        ))),
        Codec::Zstd => {
            let n = dctx
                .decompress_to_buffer(payload, out)
                .map_err(|e| Check::Bad(format!("zstd: {e}")))?;
            if n != out.len() {
                return Err(Check::Bad(format!(
                    "decompressed to {n} bytes, header says {}",
                    out.len()
                )));
            }
            Ok(())
        }
    }
}
