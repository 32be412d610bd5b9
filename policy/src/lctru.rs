//! The LCTRU queue (paper §3.4): victims by heaviest level first, least recently used first; and plain LRU over chunks.

use std::collections::BTreeMap;

use crate::hash::{IdMap, IdSet};

use crate::level::Level;
use crate::victim::{ChunkId, Victim, VictimChooser, VictimError, Victims};

#[derive(Debug, Clone, Copy)]
struct Entry {
    level: Level,
    bytes: u64,
    stamp: u64,
}

#[derive(Debug, Default)]
struct ContextState {
    chunks: IdSet<u32>,
    locks: u32,
}

/// Resident chunks ordered by (class, recency); the class is the level for LCTRU, nothing for LRU.
///
/// The ordered map holds only evictable chunks: locking a context takes its chunks out, unlocking
/// puts them back, so popping never scans past locked chunks.
/// Every operation is O(log n), except lock, unlock and context removal, which are O(c log n) for
/// the context's c chunks.
#[derive(Debug)]
struct ChunkQueue {
    by_level: bool,
    order: BTreeMap<(u8, u64), ChunkId>,
    entries: IdMap<ChunkId, Entry>,
    contexts: IdMap<u64, ContextState>,
    clock: u64,
    bytes: u64,
}

impl ChunkQueue {
    fn new(by_level: bool) -> Self {
        Self {
            by_level,
            order: BTreeMap::new(),
            entries: IdMap::default(),
            contexts: IdMap::default(),
            clock: 0,
            bytes: 0,
        }
    }

    fn key(&self, e: &Entry) -> (u8, u64) {
        (if self.by_level { e.level.0 } else { 0 }, e.stamp)
    }

    fn locked(&self, context: u64) -> bool {
        self.contexts.get(&context).is_some_and(|c| c.locks > 0)
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn insert(&mut self, id: ChunkId, level: Level, bytes: u64) -> Result<(), VictimError> {
        if self.entries.contains_key(&id) {
            return Err(VictimError::AlreadyTracked { id });
        }
        let e = Entry {
            level,
            bytes,
            stamp: self.tick(),
        };
        if !self.locked(id.context) {
            self.order.insert(self.key(&e), id);
        }
        self.entries.insert(id, e);
        self.contexts
            .entry(id.context)
            .or_default()
            .chunks
            .insert(id.index);
        self.bytes += bytes;
        Ok(())
    }

    /// Replaces `id`'s entry by `update(entry)`, keeping the order map in step.
    fn update(
        &mut self,
        id: ChunkId,
        update: impl FnOnce(&mut Entry, u64),
    ) -> Result<(), VictimError> {
        let stamp = self.clock + 1;
        let Some(old) = self.entries.get(&id).copied() else {
            return Err(VictimError::NotTracked { id });
        };
        let mut new = old;
        update(&mut new, stamp);
        if new.stamp == stamp {
            self.clock = stamp;
        }
        if !self.locked(id.context) {
            self.order.remove(&self.key(&old));
            self.order.insert(self.key(&new), id);
        }
        self.bytes = self.bytes - old.bytes + new.bytes;
        self.entries.insert(id, new);
        Ok(())
    }

    fn remove(&mut self, id: ChunkId) -> Result<u64, VictimError> {
        let Some(e) = self.entries.remove(&id) else {
            return Err(VictimError::NotTracked { id });
        };
        if !self.locked(id.context) {
            self.order.remove(&self.key(&e));
        }
        if let Some(c) = self.contexts.get_mut(&id.context) {
            c.chunks.remove(&id.index);
            if c.chunks.is_empty() && c.locks == 0 {
                self.contexts.remove(&id.context);
            }
        }
        self.bytes -= e.bytes;
        Ok(e.bytes)
    }

    fn remove_context(&mut self, context: u64) -> u64 {
        let Some(state) = self.contexts.get(&context) else {
            return 0;
        };
        let ids: Vec<ChunkId> = state
            .chunks
            .iter()
            .map(|&index| ChunkId { context, index })
            .collect();
        ids.into_iter().filter_map(|id| self.remove(id).ok()).sum()
    }

    fn lock(&mut self, context: u64) {
        let state = self.contexts.entry(context).or_default();
        state.locks += 1;
        if state.locks > 1 {
            return;
        }
        let ids: Vec<u32> = state.chunks.iter().copied().collect();
        for index in ids {
            let id = ChunkId { context, index };
            if let Some(e) = self.entries.get(&id) {
                let key = self.key(e);
                self.order.remove(&key);
            }
        }
    }

    fn unlock(&mut self, context: u64) -> Result<(), VictimError> {
        let Some(state) = self.contexts.get_mut(&context).filter(|s| s.locks > 0) else {
            return Err(VictimError::NotLocked { context });
        };
        state.locks -= 1;
        if state.locks > 0 {
            return Ok(());
        }
        if state.chunks.is_empty() {
            self.contexts.remove(&context);
            return Ok(());
        }
        let ids: Vec<u32> = state.chunks.iter().copied().collect();
        for index in ids {
            let id = ChunkId { context, index };
            if let Some(e) = self.entries.get(&id) {
                let key = self.key(e);
                self.order.insert(key, id);
            }
        }
        Ok(())
    }

    fn pop(&mut self, need: u64) -> Victims {
        let mut out = Victims::default();
        while out.freed < need {
            let Some((_, id)) = self.order.pop_first() else {
                break;
            };
            // The order map holds only unlocked, tracked chunks, so removal succeeds.
            let bytes = self.remove_unordered(id);
            out.freed += bytes;
            out.chunks.push(Victim { id, bytes });
        }
        out
    }

    fn peek(&self, need: u64, eligible: &mut dyn FnMut(ChunkId) -> Option<u64>) -> Victims {
        let mut out = Victims::default();
        for &id in self.order.values() {
            if out.freed >= need {
                break;
            }
            if let Some(bytes) = eligible(id) {
                out.freed += bytes;
                out.chunks.push(Victim { id, bytes });
            }
        }
        out
    }

    /// Removes a chunk already taken out of the order map.
    fn remove_unordered(&mut self, id: ChunkId) -> u64 {
        let Some(e) = self.entries.remove(&id) else {
            return 0;
        };
        if let Some(c) = self.contexts.get_mut(&id.context) {
            c.chunks.remove(&id.index);
            if c.chunks.is_empty() && c.locks == 0 {
                self.contexts.remove(&id.context);
            }
        }
        self.bytes -= e.bytes;
        e.bytes
    }
}

macro_rules! chooser {
    ($name:ident) => {
        impl VictimChooser for $name {
            fn on_insert(
                &mut self,
                id: ChunkId,
                level: Level,
                bytes: u64,
            ) -> Result<(), VictimError> {
                self.0.insert(id, level, bytes)
            }
            fn on_access(&mut self, id: ChunkId) -> Result<(), VictimError> {
                self.0.update(id, |e, now| e.stamp = now)
            }
            fn on_level_change(
                &mut self,
                id: ChunkId,
                level: Level,
                bytes: u64,
            ) -> Result<(), VictimError> {
                self.0.update(id, |e, _| {
                    e.level = level;
                    e.bytes = bytes;
                })
            }
            fn on_remove(&mut self, id: ChunkId) -> Result<(), VictimError> {
                self.0.remove(id).map(|_| ())
            }
            fn remove_context(&mut self, context: u64) -> u64 {
                self.0.remove_context(context)
            }
            fn lock(&mut self, context: u64) {
                self.0.lock(context)
            }
            fn unlock(&mut self, context: u64) -> Result<(), VictimError> {
                self.0.unlock(context)
            }
            fn pop_victims(&mut self, need_bytes: u64) -> Victims {
                self.0.pop(need_bytes)
            }
            fn peek_victims(
                &self,
                need_bytes: u64,
                eligible: &mut dyn FnMut(ChunkId) -> Option<u64>,
            ) -> Victims {
                self.0.peek(need_bytes, eligible)
            }
            fn resident_bytes(&self) -> u64 {
                self.0.bytes
            }
            fn len(&self) -> usize {
                self.0.entries.len()
            }
        }
    };
}

/// The LCTRU queue: one sub-queue per level, each by recency; victims come from the heaviest
/// level's sub-queue first, least recently used first.
#[derive(Debug)]
pub struct LctruQueue(ChunkQueue);

impl LctruQueue {
    pub fn new() -> Self {
        Self(ChunkQueue::new(true))
    }
}

impl Default for LctruQueue {
    fn default() -> Self {
        Self::new()
    }
}

chooser!(LctruQueue);

/// The vLLM-style baseline: least recently used chunk first, whatever its level.
#[derive(Debug)]
pub struct ChunkLru(ChunkQueue);

impl ChunkLru {
    pub fn new() -> Self {
        Self(ChunkQueue::new(false))
    }
}

impl Default for ChunkLru {
    fn default() -> Self {
        Self::new()
    }
}

chooser!(ChunkLru);

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn id(context: u64, index: u32) -> ChunkId {
        ChunkId { context, index }
    }

    #[test]
    fn heaviest_then_least_recent() {
        let mut q = LctruQueue::new();
        q.on_insert(id(1, 0), Level(1), 50).unwrap();
        q.on_insert(id(1, 1), Level(0), 100).unwrap();
        q.on_insert(id(2, 0), Level(0), 100).unwrap();
        q.on_insert(id(2, 1), Level(2), 25).unwrap();
        q.on_access(id(1, 1)).unwrap();
        let v = q.pop_victims(150);
        assert_eq!(
            v.chunks.iter().map(|v| v.id).collect::<Vec<_>>(),
            vec![id(2, 0), id(1, 1)]
        );
        assert_eq!(v.freed, 200);
        assert_eq!(q.resident_bytes(), 75);
        // LRU ignores levels.
        let mut l = ChunkLru::new();
        l.on_insert(id(1, 0), Level(2), 25).unwrap();
        l.on_insert(id(1, 1), Level(0), 100).unwrap();
        assert_eq!(l.pop_victims(1).chunks[0].id, id(1, 0));
    }

    #[test]
    fn locks_nest_and_protect() {
        let mut q = LctruQueue::new();
        q.lock(7);
        q.on_insert(id(7, 0), Level(0), 10).unwrap();
        q.lock(7);
        q.unlock(7).unwrap();
        assert_eq!(q.pop_victims(10), Victims::default());
        q.unlock(7).unwrap();
        assert_eq!(q.unlock(7), Err(VictimError::NotLocked { context: 7 }));
        assert_eq!(q.pop_victims(10).freed, 10);
        assert!(q.is_empty());
    }

    #[test]
    fn errors() {
        let mut q = LctruQueue::new();
        q.on_insert(id(1, 0), Level(0), 10).unwrap();
        assert_eq!(
            q.on_insert(id(1, 0), Level(0), 10),
            Err(VictimError::AlreadyTracked { id: id(1, 0) })
        );
        assert_eq!(
            q.on_access(id(1, 1)),
            Err(VictimError::NotTracked { id: id(1, 1) })
        );
        assert_eq!(
            q.on_remove(id(2, 0)),
            Err(VictimError::NotTracked { id: id(2, 0) })
        );
        assert_eq!(q.remove_context(1), 10);
        assert_eq!(q.remove_context(1), 0);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u64, u32, u8, u64),
        Access(u64, u32),
        Level(u64, u32, u8, u64),
        Remove(u64, u32),
        RemoveContext(u64),
        Lock(u64),
        Unlock(u64),
        Pop(u64),
        /// Peek, passing over chunks whose index is a multiple of the divisor.
        Peek(u64, u32),
    }

    fn op() -> impl Strategy<Value = Op> {
        let c = 0u64..4;
        let i = 0u32..6;
        prop_oneof![
            3 => (c.clone(), i.clone(), 0u8..3, 1u64..100).prop_map(|(c, i, l, b)| Op::Insert(c, i, l, b)),
            2 => (c.clone(), i.clone()).prop_map(|(c, i)| Op::Access(c, i)),
            1 => (c.clone(), i.clone(), 0u8..3, 1u64..100).prop_map(|(c, i, l, b)| Op::Level(c, i, l, b)),
            1 => (c.clone(), i.clone()).prop_map(|(c, i)| Op::Remove(c, i)),
            1 => c.clone().prop_map(Op::RemoveContext),
            1 => c.clone().prop_map(Op::Lock),
            1 => c.prop_map(Op::Unlock),
            2 => (0u64..300).prop_map(Op::Pop),
            1 => (0u64..300, 2u32..4).prop_map(|(n, d)| Op::Peek(n, d)),
        ]
    }

    /// The O(n) model: a list of chunks with stamps, scanned on every pop.
    #[derive(Default)]
    struct Model {
        by_level: bool,
        chunks: Vec<(ChunkId, u8, u64, u64)>,
        locks: HashMap<u64, u32>,
        clock: u64,
    }

    impl Model {
        fn find(&self, id: ChunkId) -> Result<usize, VictimError> {
            self.chunks
                .iter()
                .position(|c| c.0 == id)
                .ok_or(VictimError::NotTracked { id })
        }

        fn apply(&mut self, op: &Op) -> Result<Victims, VictimError> {
            match *op {
                Op::Insert(c, i, l, b) => {
                    if self.find(id(c, i)).is_ok() {
                        return Err(VictimError::AlreadyTracked { id: id(c, i) });
                    }
                    self.clock += 1;
                    self.chunks.push((id(c, i), l, b, self.clock));
                }
                Op::Access(c, i) => {
                    let k = self.find(id(c, i))?;
                    self.clock += 1;
                    self.chunks[k].3 = self.clock;
                }
                Op::Level(c, i, l, b) => {
                    let k = self.find(id(c, i))?;
                    self.chunks[k].1 = l;
                    self.chunks[k].2 = b;
                }
                Op::Remove(c, i) => {
                    let k = self.find(id(c, i))?;
                    self.chunks.remove(k);
                }
                Op::RemoveContext(c) => self.chunks.retain(|x| x.0.context != c),
                Op::Lock(c) => *self.locks.entry(c).or_default() += 1,
                Op::Unlock(c) => match self.locks.get_mut(&c) {
                    Some(n) if *n > 0 => *n -= 1,
                    _ => return Err(VictimError::NotLocked { context: c }),
                },
                Op::Peek(need, d) => {
                    let mut live: Vec<_> = self
                        .chunks
                        .iter()
                        .filter(|x| self.locks.get(&x.0.context).copied().unwrap_or(0) == 0)
                        .collect();
                    live.sort_by_key(|x| (if self.by_level { x.1 } else { 0 }, x.3));
                    let mut out = Victims::default();
                    for x in live {
                        if out.freed >= need {
                            break;
                        }
                        if !x.0.index.is_multiple_of(d) {
                            out.freed += x.2;
                            out.chunks.push(Victim {
                                id: x.0,
                                bytes: x.2,
                            });
                        }
                    }
                    return Ok(out);
                }
                Op::Pop(need) => {
                    let mut out = Victims::default();
                    while out.freed < need {
                        let best = self
                            .chunks
                            .iter()
                            .enumerate()
                            .filter(|(_, x)| {
                                self.locks.get(&x.0.context).copied().unwrap_or(0) == 0
                            })
                            .min_by_key(|(_, x)| (if self.by_level { x.1 } else { 0 }, x.3))
                            .map(|(k, _)| k);
                        let Some(k) = best else { break };
                        let x = self.chunks.remove(k);
                        out.freed += x.2;
                        out.chunks.push(Victim {
                            id: x.0,
                            bytes: x.2,
                        });
                    }
                    return Ok(out);
                }
            }
            Ok(Victims::default())
        }
    }

    fn run(
        q: &mut dyn VictimChooser,
        op: &Op,
        known: &[(ChunkId, u8, u64, u64)],
    ) -> Result<Victims, VictimError> {
        match *op {
            Op::Insert(c, i, l, b) => q.on_insert(id(c, i), Level(l), b),
            Op::Access(c, i) => q.on_access(id(c, i)),
            Op::Level(c, i, l, b) => q.on_level_change(id(c, i), Level(l), b),
            Op::Remove(c, i) => q.on_remove(id(c, i)),
            Op::RemoveContext(c) => {
                q.remove_context(c);
                Ok(())
            }
            Op::Lock(c) => {
                q.lock(c);
                Ok(())
            }
            Op::Unlock(c) => q.unlock(c),
            Op::Pop(need) => return Ok(q.pop_victims(need)),
            Op::Peek(need, d) => {
                // The pager knows each chunk's bytes; here the model does.
                let mut eligible = |id: ChunkId| {
                    (!id.index.is_multiple_of(d))
                        .then(|| known.iter().find(|x| x.0 == id).map(|x| x.2))
                        .flatten()
                };
                return Ok(q.peek_victims(need, &mut eligible));
            }
        }
        .map(|()| Victims::default())
    }

    proptest! {
        #[test]
        fn matches_model(ops in prop::collection::vec(op(), 0..120), by_level in any::<bool>()) {
            let mut model = Model { by_level, ..Model::default() };
            let mut q: Box<dyn VictimChooser> = if by_level {
                Box::new(LctruQueue::new())
            } else {
                Box::new(ChunkLru::new())
            };
            for op in &ops {
                let got = run(q.as_mut(), op, &model.chunks);
                prop_assert_eq!(got, model.apply(op), "{:?}", op);
                prop_assert_eq!(q.len(), model.chunks.len());
                prop_assert_eq!(q.resident_bytes(), model.chunks.iter().map(|x| x.2).sum::<u64>());
            }
        }
    }
}
