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
