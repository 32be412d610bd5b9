//! Each sealed chunk's facts as the service keeps them, in one book: its version, the format the
//! engine's cache holds it in, its density and what the store holds of it.
//!
//! One home per fact. A chunk's facts are spread over three layers, each the only keeper of its
//! own, and the others ask it rather than copy it:
//!
//! | fact | home | read by |
//! |---|---|---|
//! | its bytes in memory, resident or not, and whether those bytes are also in the store | the pager's slot (`uffd_pager`, `ChunkInfo::persisted`) | the chooser, the writer, the Load |
//! | its stored copies, their format, generation and checks | the store (`kvfs::Store::chunk_state`) | the source on a fault, the Load's reads |
//! | its version, its format in the cache, its density, what the store holds or will hold once the queued write lands | this book ([`ChunkBook`]) | the call's steps, the writer, the pager's source |
//!
//! The book is written by the engine thread (a call's steps), the AoT writer (a write done or
//! failed) and the pager's source (a victim written back on reclaim); it is one lock held for a
//! few loads and stores. Lock order: the book before the pager's state (the writer marks a chunk
//! persisted with the book held, [`ChunkBook::if_current`]); nothing takes the book with the
//! pager's state held.

use std::collections::HashMap;

use model::kv::KvFormat;
use uffd_pager::{ChunkKey, ContextId};

use crate::sync::{Primitives, Std};

/// What the store holds of a chunk: its format there and its bytes (stored, after compression
/// when the store knows them; the chunk's raw bytes while its write is queued).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoredCopy {
    pub format: KvFormat,
    pub bytes: u64,
    /// The chunk's bytes before the store's compression: all its layers, or its global ones
    /// alone when it was written past the sliding window.
    pub raw: u64,
}

impl From<&kvfs::StoredChunk> for StoredCopy {
    /// The copy a chunk header describes.
    fn from(s: &kvfs::StoredChunk) -> Self {
        StoredCopy {
            format: s.format,
            bytes: u64::from(s.stored_len),
            raw: u64::from(s.raw_len),
        }
    }
}

/// One chunk's facts in the book.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ChunkFacts {
    /// Bumped whenever the chunk's bytes change in memory ([`ChunkBook::change`]).
    pub version: u64,
    /// The format the engine's cache holds the chunk in (`None` until the end of the call that
    /// sealed it).
    pub format: Option<KvFormat>,
    /// Its information density (Eq. 1), for the header of a copy written back on reclaim.
    pub density: f32,
    /// What the store holds of it, or will once the write queued for it lands.
    pub stored: Option<StoredCopy>,
    /// Past the sliding window: the cache keeps its global layers alone.
    pub trimmed: bool,
}

/// Every context's chunks' [`ChunkFacts`].
///
/// The version protocol: a change of a chunk's bytes goes through [`ChunkBook::change`], which
/// bumps the version *before* the bytes change and leaves the chunk unpersisted (the pager's
/// `write`, `shrink` and `populate` all do); the writer marks a chunk persisted only inside
/// [`ChunkBook::if_current`], under the same lock. So a write-out of the old bytes that completes
/// while the chunk changes either marks it before the bump (and the change then unmarks it) or
/// finds the version moved and marks nothing: the new bytes are never taken as persisted.
/// Generic over its [`Primitives`] for the shuttle model of this (`engine/service/tests/models.rs`).
pub struct ChunkBook<S: Primitives = Std> {
    map: S::Mutex<HashMap<ContextId, Vec<ChunkFacts>>>,
}

impl<S: Primitives> Default for ChunkBook<S> {
    fn default() -> Self {
        Self {
            map: S::mutex(HashMap::new()),
        }
    }
}

impl<S: Primitives> std::fmt::Debug for ChunkBook<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkBook").finish_non_exhaustive()
    }
}

/// The facts of chunk `index` in `chunks`, grown to hold it.
fn entry(chunks: &mut Vec<ChunkFacts>, index: u32) -> &mut ChunkFacts {
    let i = index as usize;
    if chunks.len() <= i {
        chunks.resize(i + 1, ChunkFacts::default());
    }
    &mut chunks[i]
}

impl<S: Primitives> ChunkBook<S> {
    /// Chunk `key`'s facts (all defaults for a chunk the book has not seen).
    pub fn get(&self, key: ChunkKey) -> ChunkFacts {
        S::lock(&self.map)
            .get(&key.ctx)
            .and_then(|c| c.get(key.index as usize).copied())
            .unwrap_or_default()
    }

    /// The chunk's current version.
    pub fn version(&self, key: ChunkKey) -> u64 {
        self.get(key).version
    }

    /// Changes the chunk's bytes: bumps its version, then runs `change`, which must leave the
    /// chunk unpersisted.
    pub fn change<R>(&self, key: ChunkKey, change: impl FnOnce() -> R) -> R {
        {
            let mut map = S::lock(&self.map);
            entry(map.entry(key.ctx).or_default(), key.index).version += 1;
        }
        change()
    }

    /// Runs `f` if the chunk is still at `version`, with the book held so no change can begin
    /// meanwhile.
    pub fn if_current(&self, key: ChunkKey, version: u64, f: impl FnOnce()) -> bool {
        let map = S::lock(&self.map);
        let current = map
            .get(&key.ctx)
            .and_then(|c| c.get(key.index as usize))
            .map_or(0, |c| c.version)
            == version;
        if current {
            f();
        }
        current
    }

    /// Records the formats the cache holds `ctx`'s first `formats.len()` chunks in and their
    /// densities; chunks past them have no format (the context was cut short).
    pub fn set_formats(&self, ctx: ContextId, formats: &[KvFormat], densities: &[f64]) {
        let mut map = S::lock(&self.map);
        let chunks = map.entry(ctx).or_default();
        for (i, &f) in formats.iter().enumerate() {
            let c = entry(chunks, i as u32);
            c.format = Some(f);
            c.density = densities.get(i).copied().unwrap_or(0.0) as f32;
        }
        for c in chunks.iter_mut().skip(formats.len()) {
            c.format = None;
        }
    }

    /// Records that `ctx`'s first `n` chunks are past the sliding window (a prefix that only
    /// grows).
    pub fn set_trimmed(&self, ctx: ContextId, n: usize) {
        let mut map = S::lock(&self.map);
        let chunks = map.entry(ctx).or_default();
        for i in 0..n {
            entry(chunks, i as u32).trimmed = true;
        }
    }

    /// What the store holds of each of `ctx`'s first `n` chunks.
    pub fn stored(&self, ctx: ContextId, n: usize) -> Vec<Option<StoredCopy>> {
        let map = S::lock(&self.map);
        let chunks = map.get(&ctx).map_or(&[][..], Vec::as_slice);
        (0..n)
            .map(|i| chunks.get(i).and_then(|c| c.stored))
            .collect()
    }

    /// What the store holds of each of a context's first `n` chunks, borrowed ones from the
    /// prefix that lends them.
    pub fn stored_in(
        &self,
        lineage: &crate::lineage::Lineage,
        n: usize,
    ) -> Vec<Option<StoredCopy>> {
        let map = S::lock(&self.map);
        (0..n as u32)
            .map(|i| {
                let key = lineage.key(i);
                let chunks = map.get(&key.ctx).map_or(&[][..], Vec::as_slice);
                chunks.get(i as usize).and_then(|c| c.stored)
            })
            .collect()
    }

    /// Records what the store holds of chunk `key`.
    pub fn set_stored(&self, key: ChunkKey, stored: Option<StoredCopy>) {
        let mut map = S::lock(&self.map);
        entry(map.entry(key.ctx).or_default(), key.index).stored = stored;
    }

    /// Records what the store holds of chunk `key` if the book still expects a copy in `format`
    /// there (no later write was queued in another format meanwhile).
    pub fn settle_stored(&self, key: ChunkKey, format: KvFormat, stored: Option<StoredCopy>) {
        let mut map = S::lock(&self.map);
        let c = entry(map.entry(key.ctx).or_default(), key.index);
        if c.stored.is_some_and(|s| s.format == format) {
            c.stored = stored;
        }
    }

    /// Forgets every chunk of `ctx`.
    pub fn forget(&self, ctx: ContextId) {
        S::lock(&self.map).remove(&ctx);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const K: ChunkKey = ChunkKey::new(1, 2);

    #[test]
    fn a_change_moves_the_version_and_if_current_sees_it() {
        let book = ChunkBook::<Std>::default();
        assert_eq!(book.version(K), 0);
        let v = book.version(K);
        book.change(K, || ());
        assert_eq!(book.version(K), v + 1);
        let mut ran = false;
        assert!(!book.if_current(K, v, || ran = true));
        assert!(!ran, "a stale version runs nothing");
        assert!(book.if_current(K, v + 1, || ran = true));
        assert!(ran);
    }

    #[test]
    fn formats_cut_short_clear_the_chunks_past_them_but_keep_their_versions() {
        let book = ChunkBook::<Std>::default();
        let ctx = K.ctx;
        book.set_formats(
            ctx,
            &[KvFormat::Int8, KvFormat::K4v4, KvFormat::K4v4],
            &[0.5, 0.25],
        );
        book.change(ChunkKey::new(1, 2), || ());
        book.set_formats(ctx, &[KvFormat::Int8], &[0.5]);
        let c = book.get(ChunkKey::new(1, 2));
        assert_eq!(c.format, None);
        assert_eq!(
            c.version, 1,
            "a version never goes back: a stale write stays stale"
        );
        let c = book.get(ChunkKey::new(1, 0));
        assert_eq!((c.format, c.density), (Some(KvFormat::Int8), 0.5));
    }

    #[test]
    fn a_write_settles_only_the_copy_it_was_queued_for() {
        let book = ChunkBook::<Std>::default();
        let queued = |format| {
            Some(StoredCopy {
                format,
                bytes: 100,
                raw: 100,
            })
        };
        book.set_stored(K, queued(KvFormat::Int8));
        book.set_stored(K, queued(KvFormat::K4v4));
        let landed = Some(StoredCopy {
            format: KvFormat::Int8,
            bytes: 60,
            raw: 100,
        });
        book.settle_stored(K, KvFormat::Int8, landed);
        assert_eq!(book.stored(K.ctx, 3)[2], queued(KvFormat::K4v4));
        book.settle_stored(K, KvFormat::K4v4, None);
        assert_eq!(book.stored(K.ctx, 3), vec![None, None, None]);
        book.forget(K.ctx);
        assert_eq!(book.get(K), ChunkFacts::default());
    }
}
