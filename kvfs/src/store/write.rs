//! Chunk writes: a new copy to the slot the chunk does not occupy, payload durable before header,
//! then the old slot freed (docs/kvfs.md, "Crash safety").

use std::borrow::Cow;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::Ordering;

use super::{
    ContextId, Ctx, HEADER_PAGE, MAX_CHUNK_BYTES, MAX_CHUNKS, SLOT_BYTES, Store, StoreError,
    StoreState, StoredChunk, slot_offset, span, stored_of, unix_seconds,
};
use crate::format::{ChunkHeader, Codec, Fingerprint, KvFormat, tokens_crc};
use crate::io::{IoError, drop_range, failpoint, punch};

impl Store {
    /// Writes chunk `index` of a context crash-safely, replacing any previous version: the payload
    /// goes to the chunk's free slot of the data file and is made durable, then its header, then
    /// the old copy's slot is freed; the pages written are dropped from the page cache.
    /// The tokens the chunk covers must already be stored ([`Store::append_tokens`]).
    /// A write that fails leaves the chunk as it was: the slot it was writing is freed. Each step
    /// has a failpoint, `kvfs::chunk::{payload_written,payload_synced,header_written,header_synced,
    /// old_punched}` (docs/kvfs.md, "Failpoints").
    pub fn write_chunk(
        &self,
        id: ContextId,
        index: u32,
        fingerprint: &Fingerprint,
        format: KvFormat,
        density: f32,
        data: &[u8],
    ) -> Result<StoredChunk, StoreError> {
        let _span = tracing::debug_span!("kvfs_write_chunk", context = %id, index).entered();
        self.writable()?;
        check_chunk(index, data)?;
        let ctx = self.ctx_of_model(id, fingerprint)?;
        let _w = self.write_lock(&ctx)?;
        if let Some(l) = ctx.state.lock().link
            && index < l.chunks
        {
            return Err(StoreError::Invalid {
                what: "chunk write",
                why: format!(
                    "chunk {index} of context {id} is borrowed from shared prefix {}",
                    l.base
                ),
            });
        }
        let (range, tcrc) = chunk_tokens(&ctx, id, index)?;
        let compressed = self.compress(data);
        let (codec, payload) = match &compressed {
            Some(c) => (Codec::Zstd, c.as_slice()),
            None => (Codec::Raw, data),
        };
        // The new copy goes to the slot the chunk does not occupy: the current one stays whole
        // (and readable) until the new one is durable.
        let previous = match ctx.state.lock().chunks.get(&index) {
            Some(StoreState::Stored(s)) => Some(s.copy),
            _ => None,
        };
        let copy = previous.map_or(0, |c| 1 - c);
        let header = self.header(
            &ctx,
            index,
            (range, tcrc),
            (format, codec),
            density,
            data,
            payload,
        );
        let path = ctx.dir.join("data");
        let at = slot_offset(index, copy);
        put_copy(&ctx, &path, at, index, &header, payload)?;
        drop_range(&ctx.data, at, HEADER_PAGE + payload.len());
        let stored = stored_of(&header, copy);
        ctx.state
            .lock()
            .chunks
            .insert(index, StoreState::Stored(stored.clone()));
        // 3. The old copy's slot is freed (not synced: after a crash the open frees it again, as
        //    the older of two copies); a failure only costs the space until then.
        if let Some(old) = previous {
            let freed = punch(&ctx.data, slot_offset(index, old), SLOT_BYTES)
                .map_err(|e| IoError::new("punch", &path, e));
            if let Err(e) = failpoint!("kvfs::chunk::old_punched", "punch", &path, freed) {
                tracing::warn!(path = %path.display(), index, error = %e, "could not free a replaced copy");
            }
        }
        let c = &self.counters;
        c.chunk_writes.fetch_add(1, Ordering::Relaxed);
        c.chunk_write_raw_bytes
            .fetch_add(data.len() as u64, Ordering::Relaxed);
        c.chunk_write_stored_bytes
            .fetch_add(payload.len() as u64, Ordering::Relaxed);
        Ok(stored)
    }

    /// Writes chunks of a context that holds no copy of any of them yet (a new shared prefix
    /// filled at once), with two syncs in all rather than two each: every payload, then one
    /// `fdatasync`, then every header, then another. Crash-safe as [`Store::write_chunk`] is: a
    /// header reaches the disk only after every payload has, and a write that fails frees every
    /// slot it wrote, so none of them is found at the next open.
    pub fn write_new_chunks(
        &self,
        id: ContextId,
        fingerprint: &Fingerprint,
        chunks: &[(u32, KvFormat, f32, &[u8])],
    ) -> Result<(), StoreError> {
        self.writable()?;
        let ctx = self.ctx_of_model(id, fingerprint)?;
        let _w = self.write_lock(&ctx)?;
        let mut put = Vec::with_capacity(chunks.len());
        for &(index, format, density, data) in chunks {
            check_chunk(index, data)?;
            let taken = {
                let st = ctx.state.lock();
                st.chunks.contains_key(&index) || st.link.is_some_and(|l| index < l.chunks)
            };
            if taken {
                return Err(StoreError::Invalid {
                    what: "chunk write",
                    why: format!("chunk {index} of context {id} is not new"),
                });
            }
            let (range, tcrc) = chunk_tokens(&ctx, id, index)?;
            let compressed = self.compress(data);
            let (codec, payload) = match compressed {
                Some(c) => (Codec::Zstd, Cow::Owned(c)),
                None => (Codec::Raw, Cow::Borrowed(data)),
            };
            let header = (self).header(
                &ctx,
                index,
                (range, tcrc),
                (format, codec),
                density,
                data,
                &payload,
            );
            put.push((header, payload));
        }
        let path = ctx.dir.join("data");
        let written = put_new(&ctx, &path, &put);
        if let Err(e) = written {
            for (h, _) in &put {
                let _ = punch(&ctx.data, slot_offset(h.index, 0), SLOT_BYTES);
            }
            if let Err(undo) = nix::unistd::fdatasync(&ctx.data) {
                tracing::warn!(path = %path.display(), error = %undo, "could not free the slots of failed chunk writes; the next open may find them");
            }
            return Err(e.into());
        }
        let mut st = ctx.state.lock();
        for (h, payload) in &put {
            drop_range(
                &ctx.data,
                slot_offset(h.index, 0),
                HEADER_PAGE + payload.len(),
            );
            st.chunks
                .insert(h.index, StoreState::Stored(stored_of(h, 0)));
            let c = &self.counters;
            c.chunk_writes.fetch_add(1, Ordering::Relaxed);
            c.chunk_write_raw_bytes
                .fetch_add(u64::from(h.raw_len), Ordering::Relaxed);
            c.chunk_write_stored_bytes
                .fetch_add(payload.len() as u64, Ordering::Relaxed);
        }
        Ok(())
    }

    /// The header of a new copy of chunk `index` (`data`, stored as `payload`) computed from
    /// the tokens `tokens` (their span and crc), with the next generation.
    #[allow(clippy::too_many_arguments)]
    fn header(
        &self,
        ctx: &Ctx,
        index: u32,
        tokens: (Range<u32>, u32),
        (format, codec): (KvFormat, Codec),
        density: f32,
        data: &[u8],
        payload: &[u8],
    ) -> ChunkHeader {
        ChunkHeader {
            format,
            codec,
            context: ctx.id.0,
            index,
            token_start: tokens.0.start,
            token_end: tokens.0.end,
            tokens_crc: tokens.1,
            density,
            raw_len: data.len() as u32,
            stored_len: payload.len() as u32,
            payload_crc: crc32c::crc32c(payload),
            generation: self.next_generation.fetch_add(1, Ordering::Relaxed),
            fingerprint: ctx.meta.fingerprint,
            written: unix_seconds(),
        }
    }

    fn compress(&self, data: &[u8]) -> Option<Vec<u8>> {
        if !self.options.min_ratio.is_finite() || data.is_empty() {
            return None;
        }
        let c = zstd::bulk::compress(data, self.options.zstd_level).ok()?;
        (data.len() as f64 >= self.options.min_ratio * c.len() as f64).then_some(c)
    }
}

/// Refuses a chunk larger than a slot holds, or an index past a context's last.
fn check_chunk(index: u32, data: &[u8]) -> Result<(), StoreError> {
    if data.len() > MAX_CHUNK_BYTES {
        return Err(StoreError::TooLarge { len: data.len() });
    }
    if index >= MAX_CHUNKS {
        return Err(StoreError::Invalid {
            what: "chunk index",
            why: format!("{index}, a context holds at most {MAX_CHUNKS} chunks"),
        });
    }
    Ok(())
}

/// The token range chunk `index` covers and its checksum; a chunk beyond the stored tokens is
/// refused.
fn chunk_tokens(ctx: &Ctx, id: ContextId, index: u32) -> Result<(Range<u32>, u32), StoreError> {
    let st = ctx.state.lock();
    let range = span(index, ctx.meta.chunk_tokens, st.tokens.len());
    if range.is_empty() {
        return Err(StoreError::BeyondTokens {
            context: id,
            index,
            start: index as u64 * ctx.meta.chunk_tokens as u64,
            tokens: st.tokens.len(),
        });
    }
    let crc = tokens_crc(&st.tokens[range.start as usize..range.end as usize]);
    Ok((range, crc))
}

/// Steps 1 and 2 of a chunk write: the payload into the slot at `at`, durable before its
/// header, then the header, durable. A write that fails leaves the chunk as it was: the slot is
/// freed, durably, so that the next open cannot find its copy there as the newest one.
fn put_copy(
    ctx: &Ctx,
    path: &Path,
    at: u64,
    index: u32,
    header: &ChunkHeader,
    payload: &[u8],
) -> Result<(), StoreError> {
    let write = |bytes: &[u8], offset| {
        ctx.data
            .write_all_at(bytes, offset)
            .map_err(|e| IoError::new("write", path, e))
    };
    let sync =
        || nix::unistd::fdatasync(&ctx.data).map_err(|e| IoError::new("fdatasync", path, e.into()));
    let put = || -> Result<(), IoError> {
        // 1. The payload, durable before any header names it.
        let written = write(payload, at + HEADER_PAGE as u64);
        failpoint!("kvfs::chunk::payload_written", "write", path, written)?;
        failpoint!("kvfs::chunk::payload_synced", "fdatasync", path, sync())?;
        // 2. The header: from here on this copy is the newest complete one.
        let written = write(&header.encode(), at);
        failpoint!("kvfs::chunk::header_written", "write", path, written)?;
        failpoint!("kvfs::chunk::header_synced", "fdatasync", path, sync())
    };
    if let Err(e) = put() {
        let undone = punch(&ctx.data, at, SLOT_BYTES)
            .and_then(|()| nix::unistd::fdatasync(&ctx.data).map_err(Into::into));
        if let Err(undo) = undone {
            tracing::warn!(path = %path.display(), index, error = %undo, "could not free the slot of a failed chunk write; the next open may find its copy");
        }
        return Err(e.into());
    }
    Ok(())
}

/// The writes of [`Store::write_new_chunks`]: every payload into copy 0 of its chunk's slot, one
/// sync, every header, another sync.
fn put_new(ctx: &Ctx, path: &Path, put: &[(ChunkHeader, Cow<[u8]>)]) -> Result<(), IoError> {
    let write = |bytes: &[u8], offset| {
        ctx.data
            .write_all_at(bytes, offset)
            .map_err(|e| IoError::new("write", path, e))
    };
    let sync =
        || nix::unistd::fdatasync(&ctx.data).map_err(|e| IoError::new("fdatasync", path, e.into()));
    for (h, payload) in put {
        write(payload, slot_offset(h.index, 0) + HEADER_PAGE as u64)?;
    }
    sync()?;
    for (h, _) in put {
        write(&h.encode(), slot_offset(h.index, 0))?;
    }
    sync()
}
