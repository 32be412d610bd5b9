//! The victim chooser: which resident chunks to reclaim when a populate needs room.

use std::collections::{BTreeMap, HashMap};

use crate::{ChunkKey, ContextId};

/// A chunk that may be reclaimed now: resident, not being populated, its context unlocked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    /// The chunk.
    pub key: ChunkKey,
    /// Its resident bytes (page-rounded).
    pub bytes: u64,
    /// Whether the engine marked it written out (reclaiming it costs no I/O later).
    pub persisted: bool,
}

/// What a chooser may ask about the resident set while it chooses.
pub trait ResidentView {
    /// `Some(candidate)` if `key` may be reclaimed now.
    fn candidate(&self, key: ChunkKey) -> Option<Candidate>;
    /// Whether `ctx` is locked against reclaim (a call is running on it).
    fn is_locked(&self, ctx: ContextId) -> bool;
    /// Every chunk that may be reclaimed now, in no particular order.
    fn for_each_candidate(&self, f: &mut dyn FnMut(Candidate));
}

/// Picks victims. The pager calls it with its state lock held: it must be quick and must not call
/// back into the pager.
pub trait VictimChooser: Send {
    /// Chunks to reclaim, in order, to free at least `need_bytes`; the pager skips any that are not
    /// candidates. An empty answer means nothing can be freed.
    fn choose_victims(&mut self, need_bytes: u64, view: &dyn ResidentView) -> Vec<ChunkKey>;
    /// A chunk became resident.
    fn on_populate(&mut self, key: ChunkKey, bytes: u64) {
        let _ = (key, bytes);
    }
    /// The engine used a chunk.
    fn on_access(&mut self, key: ChunkKey) {
        let _ = key;
    }
    /// A chunk stopped being resident.
    fn on_reclaim(&mut self, key: ChunkKey) {
        let _ = key;
    }
    /// A resident chunk shrank in place to `bytes` (it moved to a lighter format).
    fn on_resize(&mut self, key: ChunkKey, bytes: u64) {
        let _ = (key, bytes);
    }
}

/// Least recently populated or accessed first, persisted chunks before unpersisted ones.
/// The default chooser, and the baseline the policy crate's LCTRU queue replaces.
#[derive(Debug, Default)]
pub struct LruChooser {
    tick: u64,
    order: BTreeMap<u64, ChunkKey>,
    when: HashMap<ChunkKey, u64>,
}

impl LruChooser {
    /// An empty chooser.
    pub fn new() -> LruChooser {
        LruChooser::default()
    }

    fn touch(&mut self, key: ChunkKey) {
        self.tick += 1;
        if let Some(old) = self.when.insert(key, self.tick) {
            self.order.remove(&old);
        }
        self.order.insert(self.tick, key);
    }
}

impl VictimChooser for LruChooser {
    fn choose_victims(&mut self, need_bytes: u64, view: &dyn ResidentView) -> Vec<ChunkKey> {
        let mut out = Vec::new();
        for persisted_pass in [true, false] {
            let mut freed: u64 = 0;
            out.clear();
            for key in self.order.values() {
                if freed >= need_bytes {
                    break;
                }
                if let Some(c) = view.candidate(*key)
                    && (c.persisted || !persisted_pass)
                {
                    freed += c.bytes;
                    out.push(*key);
                }
            }
            if freed >= need_bytes {
                return out;
            }
        }
        out
    }

    fn on_populate(&mut self, key: ChunkKey, _bytes: u64) {
        self.touch(key);
    }

    fn on_access(&mut self, key: ChunkKey) {
        if self.when.contains_key(&key) {
            self.touch(key);
        }
    }

    fn on_reclaim(&mut self, key: ChunkKey) {
        if let Some(t) = self.when.remove(&key) {
            self.order.remove(&t);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A resident set written out by hand: key -> (bytes, persisted, context locked).
    struct View(HashMap<ChunkKey, (u64, bool, bool)>);

    impl ResidentView for View {
        fn candidate(&self, key: ChunkKey) -> Option<Candidate> {
            let (bytes, persisted, locked) = *self.0.get(&key)?;
            (!locked).then_some(Candidate {
                key,
                bytes,
                persisted,
            })
        }
        fn is_locked(&self, ctx: ContextId) -> bool {
            self.0.iter().any(|(k, v)| k.ctx == ctx && v.2)
        }
        fn for_each_candidate(&self, f: &mut dyn FnMut(Candidate)) {
            for k in self.0.keys() {
                if let Some(c) = self.candidate(*k) {
                    f(c);
                }
            }
        }
    }

    fn k(ctx: u64, i: u32) -> ChunkKey {
        ChunkKey::new(ctx, i)
    }

    fn check(
        order: &[ChunkKey],
        accessed: &[ChunkKey],
        view: &[(ChunkKey, u64, bool, bool)],
        need: u64,
        expected: &[ChunkKey],
    ) {
        let mut lru = LruChooser::new();
        for key in order {
            lru.on_populate(*key, 4096);
        }
        for key in accessed {
            lru.on_access(*key);
        }
        let view = View(view.iter().map(|(k, b, p, l)| (*k, (*b, *p, *l))).collect());
        assert_eq!(lru.choose_victims(need, &view), expected);
    }

    #[test]
    fn chooses_least_recent_persisted_first_and_skips_locked() {
        let (a, b, c) = (k(1, 0), k(1, 1), k(2, 0));
        let all = [a, b, c];
        let view = |pa: bool, pb: bool, pc: bool, lock1: bool| {
            [
                (a, 4096, pa, lock1),
                (b, 4096, pb, lock1),
                (c, 4096, pc, false),
            ]
        };
        check(&all, &[], &view(true, true, true, false), 4096, &[a]);
        check(&all, &[a], &view(true, true, true, false), 4096, &[b]);
        check(&all, &[], &view(true, true, true, false), 8192, &[a, b]);
        check(&all, &[], &view(false, true, true, false), 4096, &[b]);
        check(&all, &[], &view(false, false, false, false), 4096, &[a]);
        check(&all, &[], &view(true, true, true, true), 4096, &[c]);
        check(&all, &[], &view(true, true, true, true), 8192, &[c]);
        check(&all, &[], &[], 4096, &[]);
    }
}
