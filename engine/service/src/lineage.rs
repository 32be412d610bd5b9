//! Which context holds each of a context's chunks: its first chunks may be borrowed from shared
//! prefixes (kvfs links; docs/service.md, "Forks and shared prefixes"), the rest are its own.
//!
//! A shared prefix is a context of the pager and the store like any other (its region, its
//! stored chunks, its entries in the chunk book), so reads, faults, write-backs and victims need
//! no special case: only the key a chunk index maps to changes.

use kvfs::{Link, Store};
use uffd_pager::{ChunkKey, ContextId};

/// A context's chunk owners: the borrowed ranges, each ending where the next begins, then its own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lineage {
    own: ContextId,
    /// `(end, prefix)`, ascending by `end`: chunks below `end` and at or past the previous end
    /// are `prefix`'s.
    borrowed: Vec<(u32, ContextId)>,
}

impl Lineage {
    /// Context `ctx`'s owners as the store's links say (a link to a prefix that itself borrows
    /// is followed down to the first chunk).
    pub fn of(store: &Store, ctx: ContextId) -> Self {
        let mut borrowed = Vec::new();
        let mut at = store.link(ctx).ok().flatten();
        while let Some(Link { base, chunks }) = at {
            // A prefix's own link never covers more than the link to it (the store checks it).
            let end = borrowed
                .last()
                .map_or(chunks, |&(e, _): &(u32, _)| e.min(chunks));
            borrowed.push((end, ContextId(base)));
            at = store.link(ContextId(base)).ok().flatten();
        }
        borrowed.reverse();
        Lineage { own: ctx, borrowed }
    }

    /// The context itself.
    pub fn ctx(&self) -> ContextId {
        self.own
    }

    /// How many of its first chunks it borrows.
    pub fn shared(&self) -> u32 {
        self.borrowed.last().map_or(0, |&(end, _)| end)
    }

    /// The prefix that lends the most chunks (the one a new borrower of all of them links to).
    pub fn top(&self) -> Option<ContextId> {
        self.borrowed.last().map(|&(_, p)| p)
    }

    /// The context that holds chunk `index`.
    pub fn owner(&self, index: u32) -> ContextId {
        self.borrowed
            .iter()
            .find(|&&(end, _)| index < end)
            .map_or(self.own, |&(_, p)| p)
    }

    /// The pager's and the chunk book's key of chunk `index`.
    pub fn key(&self, index: u32) -> ChunkKey {
        ChunkKey {
            ctx: self.owner(index),
            index,
        }
    }

    /// The shared prefixes it borrows from, the first chunks' first.
    pub fn prefixes(&self) -> impl Iterator<Item = ContextId> + '_ {
        self.borrowed.iter().map(|&(_, p)| p)
    }

    /// Each prefix with the chunks it lends (`start..end`), the first chunks' first.
    pub fn ranges(&self) -> impl Iterator<Item = (std::ops::Range<u32>, ContextId)> + '_ {
        let starts = std::iter::once(0).chain(self.borrowed.iter().map(|&(end, _)| end));
        starts
            .zip(&self.borrowed)
            .map(|(start, &(end, p))| (start..end, p))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_map_to_the_prefix_that_lends_them() {
        let l = Lineage {
            own: ContextId(9),
            borrowed: vec![(3, ContextId(4)), (7, ContextId(5))],
        };
        let owners: Vec<u64> = (0..9).map(|i| l.owner(i).0).collect();
        assert_eq!(owners, [4, 4, 4, 5, 5, 5, 5, 9, 9]);
        assert_eq!(l.shared(), 7);
        assert_eq!(l.top(), Some(ContextId(5)));
        let ranges: Vec<_> = l.ranges().collect();
        assert_eq!(ranges, [(0..3, ContextId(4)), (3..7, ContextId(5))]);
    }
}
