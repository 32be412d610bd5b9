//! The pager's victim chooser over the policy crate's choosers (LCTRU by default): one adapter,
//! so the pager reclaims what the paper's queue says.
//!
//! The pager knows chunks by key and slot size only; a chunk's compression level is read off its
//! slot size (every level of the level set has its own page-rounded size), so the queue learns of
//! a recompression when the pager shrinks the slot.

use policy::{ChunkId, Level};
use uffd_pager::{ChunkKey, ContextId, ResidentView};

/// A pager [`uffd_pager::VictimChooser`] that asks a [`policy::VictimChooser`].
pub struct PolicyChooser {
    inner: Box<dyn policy::VictimChooser + Send>,
    /// Page-rounded slot bytes of each level, heaviest first.
    sizes: Vec<(u64, Level)>,
    /// Offer chunks already written out before the others (chunk choosers); a whole-context
    /// chooser takes its context whole instead.
    persisted_first: bool,
}

impl PolicyChooser {
    /// Wraps `inner`; `sizes` gives each level's slot bytes.
    pub fn new(inner: Box<dyn policy::VictimChooser + Send>, sizes: Vec<(u64, Level)>) -> Self {
        Self {
            inner,
            sizes,
            persisted_first: true,
        }
    }

    /// Wraps a chooser of whole contexts: the victims are what it names, written out or not.
    pub fn whole_contexts(
        inner: Box<dyn policy::VictimChooser + Send>,
        sizes: Vec<(u64, Level)>,
    ) -> Self {
        Self {
            persisted_first: false,
            ..Self::new(inner, sizes)
        }
    }

    fn level_of(&self, bytes: u64) -> Level {
        self.sizes
            .iter()
            .find(|(b, _)| *b == bytes)
            .map_or(Level(0), |(_, l)| *l)
    }
}

fn id(key: ChunkKey) -> ChunkId {
    ChunkId::new(key.ctx.0, key.index)
}

fn key(id: ChunkId) -> ChunkKey {
    ChunkKey {
        ctx: ContextId(id.context),
        index: id.index,
    }
}

impl uffd_pager::VictimChooser for PolicyChooser {
    fn choose_victims(&mut self, need_bytes: u64, view: &dyn ResidentView) -> Vec<ChunkKey> {
        // Chunks already written out first: reclaiming them costs no I/O now or later. Only when
        // they do not free enough are unwritten chunks given up (they will be recomputed).
        if self.persisted_first {
            let persisted = self.inner.peek_victims(need_bytes, &mut |c| {
                view.candidate(key(c))
                    .filter(|c| c.persisted)
                    .map(|c| c.bytes)
            });
            if persisted.freed >= need_bytes {
                return persisted.chunks.iter().map(|v| key(v.id)).collect();
            }
        }
        let any = self
            .inner
            .peek_victims(need_bytes, &mut |c| view.candidate(key(c)).map(|c| c.bytes));
        any.chunks.iter().map(|v| key(v.id)).collect()
    }

    fn on_populate(&mut self, key: ChunkKey, bytes: u64) {
        let level = self.level_of(bytes);
        if let Err(e) = self.inner.on_insert(id(key), level, bytes) {
            // A chunk already tracked (a populate after a shrink): update it instead.
            tracing::trace!(error = %e, "chooser insert");
            let _ = self.inner.on_level_change(id(key), level, bytes);
        }
    }

    fn on_access(&mut self, key: ChunkKey) {
        let _ = self.inner.on_access(id(key));
    }

    fn on_reclaim(&mut self, key: ChunkKey) {
        let _ = self.inner.on_remove(id(key));
    }

    fn on_resize(&mut self, key: ChunkKey, bytes: u64) {
        let level = self.level_of(bytes);
        let _ = self.inner.on_level_change(id(key), level, bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use uffd_pager::{Candidate, VictimChooser};

    struct View(Vec<Candidate>);

    impl ResidentView for View {
        fn candidate(&self, key: ChunkKey) -> Option<Candidate> {
            self.0.iter().find(|c| c.key == key).copied()
        }
        fn is_locked(&self, _: ContextId) -> bool {
            false
        }
        fn for_each_candidate(&self, f: &mut dyn FnMut(Candidate)) {
            self.0.iter().for_each(|c| f(*c));
        }
    }

    fn cand(ctx: u64, index: u32, bytes: u64, persisted: bool) -> Candidate {
        Candidate {
            key: ChunkKey::new(ctx, index),
            bytes,
            persisted,
        }
    }

    #[test]
    fn heaviest_level_goes_first_and_written_chunks_before_unwritten() {
        let sizes = vec![(8192, Level(0)), (4096, Level(1))];
        let mut c = PolicyChooser::new(Box::new(policy::LctruQueue::new()), sizes);
        c.on_populate(ChunkKey::new(1, 0), 8192);
        c.on_populate(ChunkKey::new(1, 1), 8192);
        c.on_populate(ChunkKey::new(2, 0), 8192);
        // Chunk (1,1) was recompressed: it shrank to level 1 and leaves last.
        c.on_resize(ChunkKey::new(1, 1), 4096);
        let all = View(vec![
            cand(1, 0, 8192, true),
            cand(1, 1, 4096, true),
            cand(2, 0, 8192, true),
        ]);
        let v = c.choose_victims(3 * 4096, &all);
        assert_eq!(v, vec![ChunkKey::new(1, 0), ChunkKey::new(2, 0)]);
        // (1,0) is not written out yet: (2,0) is taken instead when it frees enough.
        let some = View(vec![
            cand(1, 0, 8192, false),
            cand(1, 1, 4096, true),
            cand(2, 0, 8192, true),
        ]);
        assert_eq!(c.choose_victims(4096, &some), vec![ChunkKey::new(2, 0)]);
        // Not enough written out: unwritten chunks are given up too.
        let v = c.choose_victims(4 * 4096, &some);
        assert!(v.contains(&ChunkKey::new(1, 0)), "{v:?}");
    }
}
