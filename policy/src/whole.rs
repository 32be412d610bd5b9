//! Whole-context victim choosers: the Swapping baseline (swap out the least recent context) and LMK (kill it).

use std::collections::BTreeMap;

use crate::hash::IdMap;

use crate::level::Level;
use crate::victim::{ChunkId, Victim, VictimChooser, VictimError, Victims};

/// What a [`WholeContextLru`] does with the contexts it picks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WholeContextKind {
    /// Swapping: the whole context goes to the store and is read back whole.
    Swap,
    /// LMK: the whole context is killed and re-prefilled from its text on the next call.
    Kill,
}

#[derive(Debug, Default)]
struct ContextEntry {
    chunks: BTreeMap<u32, u64>,
    bytes: u64,
    stamp: u64,
    locks: u32,
}

/// Evicts whole contexts, least recently used first; a context's recency is its last chunk use.
///
/// Popping frees whole contexts even when that overshoots the bytes asked for: these baselines
/// know no finer unit.
#[derive(Debug)]
pub struct WholeContextLru {
    kind: WholeContextKind,
    contexts: IdMap<u64, ContextEntry>,
    /// Unlocked contexts that hold chunks, by recency.
    order: BTreeMap<u64, u64>,
    clock: u64,
    bytes: u64,
    chunks: usize,
}

impl WholeContextLru {
    pub fn new(kind: WholeContextKind) -> Self {
        Self {
            kind,
            contexts: IdMap::default(),
            order: BTreeMap::new(),
            clock: 0,
            bytes: 0,
            chunks: 0,
        }
    }

    /// The Swapping baseline.
    pub fn swapping() -> Self {
        Self::new(WholeContextKind::Swap)
    }

    /// The LMK baseline.
    pub fn lmk() -> Self {
        Self::new(WholeContextKind::Kill)
    }

    pub fn kind(&self) -> WholeContextKind {
        self.kind
    }

    /// Moves `context` to the most recent end.
    fn touch(&mut self, context: u64) {
        self.clock += 1;
        let now = self.clock;
        if let Some(c) = self.contexts.get_mut(&context) {
            if c.locks == 0 && !c.chunks.is_empty() {
                self.order.remove(&c.stamp);
                self.order.insert(now, context);
            }
            c.stamp = now;
        }
    }

    /// Drops `context`'s entry when it holds nothing and is not locked.
    fn tidy(&mut self, context: u64) {
        if let Some(c) = self.contexts.get(&context)
            && c.chunks.is_empty()
        {
            self.order.remove(&c.stamp);
            if c.locks == 0 {
                self.contexts.remove(&context);
            }
        }
    }
}

impl VictimChooser for WholeContextLru {
    fn on_insert(&mut self, id: ChunkId, _level: Level, bytes: u64) -> Result<(), VictimError> {
        let c = self.contexts.entry(id.context).or_default();
        if c.chunks.contains_key(&id.index) {
            return Err(VictimError::AlreadyTracked { id });
        }
        c.chunks.insert(id.index, bytes);
        c.bytes += bytes;
        self.bytes += bytes;
        self.chunks += 1;
        self.touch(id.context);
        Ok(())
    }

    fn on_access(&mut self, id: ChunkId) -> Result<(), VictimError> {
        if !self
            .contexts
            .get(&id.context)
            .is_some_and(|c| c.chunks.contains_key(&id.index))
        {
            return Err(VictimError::NotTracked { id });
        }
        self.touch(id.context);
        Ok(())
    }

    fn on_level_change(
        &mut self,
        id: ChunkId,
        _level: Level,
        bytes: u64,
    ) -> Result<(), VictimError> {
        let Some(c) = self.contexts.get_mut(&id.context) else {
            return Err(VictimError::NotTracked { id });
        };
        let Some(b) = c.chunks.get_mut(&id.index) else {
            return Err(VictimError::NotTracked { id });
        };
        let old = std::mem::replace(b, bytes);
        c.bytes = c.bytes - old + bytes;
        self.bytes = self.bytes - old + bytes;
        Ok(())
    }

    fn on_remove(&mut self, id: ChunkId) -> Result<(), VictimError> {
        let Some(c) = self.contexts.get_mut(&id.context) else {
            return Err(VictimError::NotTracked { id });
        };
        let Some(b) = c.chunks.remove(&id.index) else {
            return Err(VictimError::NotTracked { id });
        };
        c.bytes -= b;
        self.bytes -= b;
        self.chunks -= 1;
        self.tidy(id.context);
        Ok(())
    }

    fn remove_context(&mut self, context: u64) -> u64 {
        let Some(c) = self.contexts.get_mut(&context) else {
            return 0;
        };
        let freed = std::mem::take(&mut c.bytes);
        self.chunks -= c.chunks.len();
        c.chunks.clear();
        self.bytes -= freed;
        self.tidy(context);
        freed
    }

    fn lock(&mut self, context: u64) {
        let c = self.contexts.entry(context).or_default();
        c.locks += 1;
        if c.locks == 1 {
            self.order.remove(&c.stamp);
        }
    }

    fn unlock(&mut self, context: u64) -> Result<(), VictimError> {
        let Some(c) = self.contexts.get_mut(&context).filter(|c| c.locks > 0) else {
            return Err(VictimError::NotLocked { context });
        };
        c.locks -= 1;
        if c.locks == 0 && !c.chunks.is_empty() {
            self.order.insert(c.stamp, context);
        }
        self.tidy(context);
        Ok(())
    }

    fn pop_victims(&mut self, need_bytes: u64) -> Victims {
        let mut out = Victims::default();
        while out.freed < need_bytes {
            let Some((_, context)) = self.order.pop_first() else {
                break;
            };
            let Some(c) = self.contexts.remove(&context) else {
                continue;
            };
            for (index, bytes) in c.chunks {
                out.chunks.push(Victim {
                    id: ChunkId { context, index },
                    bytes,
                });
                self.chunks -= 1;
            }
            out.freed += c.bytes;
            self.bytes -= c.bytes;
        }
        out
    }

    fn peek_victims(
        &self,
        need_bytes: u64,
        eligible: &mut dyn FnMut(ChunkId) -> Option<u64>,
    ) -> Victims {
        let mut out = Victims::default();
        for &context in self.order.values() {
            if out.freed >= need_bytes {
                break;
            }
            let Some(c) = self.contexts.get(&context) else {
                continue;
            };
            for &index in c.chunks.keys() {
                let id = ChunkId { context, index };
                if let Some(bytes) = eligible(id) {
                    out.freed += bytes;
                    out.chunks.push(Victim { id, bytes });
                }
            }
        }
        out
    }

    fn resident_bytes(&self) -> u64 {
        self.bytes
    }

    fn len(&self) -> usize {
        self.chunks
    }

    fn discards_victims(&self) -> bool {
        self.kind == WholeContextKind::Kill
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn id(context: u64, index: u32) -> ChunkId {
        ChunkId { context, index }
    }

    #[test]
    fn least_recent_context_goes_whole() {
        let mut s = WholeContextLru::swapping();
        s.on_insert(id(1, 0), Level(0), 10).unwrap();
        s.on_insert(id(1, 1), Level(0), 10).unwrap();
        s.on_insert(id(2, 0), Level(0), 10).unwrap();
        s.on_insert(id(3, 0), Level(0), 10).unwrap();
        s.on_access(id(1, 1)).unwrap();
        // Context 2 is least recent; one byte still takes all of it.
        let v = s.pop_victims(1);
        assert_eq!(
            v.chunks,
            vec![Victim {
                id: id(2, 0),
                bytes: 10
            }]
        );
        // Context 3 next, then context 1 with both its chunks, in index order.
        let v = s.pop_victims(11);
        assert_eq!(
            v.chunks.iter().map(|v| v.id).collect::<Vec<_>>(),
            vec![id(3, 0), id(1, 0), id(1, 1)]
        );
        assert_eq!(v.freed, 30);
        assert!(s.is_empty());
        assert_eq!(s.resident_bytes(), 0);
        assert!(!s.discards_victims());
        assert!(WholeContextLru::lmk().discards_victims());
    }

    #[test]
    fn locked_context_is_skipped() {
        let mut s = WholeContextLru::lmk();
        s.on_insert(id(1, 0), Level(0), 10).unwrap();
        s.on_insert(id(2, 0), Level(0), 10).unwrap();
        s.lock(1);
        let v = s.pop_victims(100);
        assert_eq!(v.freed, 10);
        assert_eq!(v.chunks[0].id, id(2, 0));
        s.unlock(1).unwrap();
        assert_eq!(s.unlock(1), Err(VictimError::NotLocked { context: 1 }));
        s.on_level_change(id(1, 0), Level(2), 3).unwrap();
        assert_eq!(s.pop_victims(1).freed, 3);
    }

    #[test]
    fn peek_takes_whole_contexts_and_removes_nothing() {
        let mut s = WholeContextLru::swapping();
        s.on_insert(id(1, 0), Level(0), 10).unwrap();
        s.on_insert(id(1, 1), Level(0), 10).unwrap();
        s.on_insert(id(2, 0), Level(0), 10).unwrap();
        // Chunk (1, 1) is being written out: passed over, the rest of its context still goes.
        let mut eligible = |c: ChunkId| (c != id(1, 1)).then_some(10);
        let v = s.peek_victims(5, &mut eligible);
        assert_eq!(
            v.chunks,
            vec![Victim {
                id: id(1, 0),
                bytes: 10
            }]
        );
        let v = s.peek_victims(15, &mut eligible);
        assert_eq!(v.freed, 20);
        assert_eq!(s.len(), 3);
        assert_eq!(s.pop_victims(15).freed, 20);
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn removal_and_errors() {
        let mut s = WholeContextLru::swapping();
        s.on_insert(id(1, 0), Level(0), 10).unwrap();
        assert_eq!(
            s.on_insert(id(1, 0), Level(0), 10),
            Err(VictimError::AlreadyTracked { id: id(1, 0) })
        );
        assert_eq!(
            s.on_access(id(1, 5)),
            Err(VictimError::NotTracked { id: id(1, 5) })
        );
        s.on_insert(id(1, 1), Level(0), 5).unwrap();
        s.on_remove(id(1, 0)).unwrap();
        assert_eq!(s.remove_context(1), 5);
        assert_eq!(s.len(), 0);
        assert_eq!(s.pop_victims(1), Victims::default());
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u64, u32, u64),
        Access(u64, u32),
        Resize(u64, u32, u64),
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
        let i = 0u32..5;
        prop_oneof![
            3 => (c.clone(), i.clone(), 1u64..100).prop_map(|(c, i, b)| Op::Insert(c, i, b)),
            2 => (c.clone(), i.clone()).prop_map(|(c, i)| Op::Access(c, i)),
            1 => (c.clone(), i.clone(), 1u64..100).prop_map(|(c, i, b)| Op::Resize(c, i, b)),
            1 => (c.clone(), i.clone()).prop_map(|(c, i)| Op::Remove(c, i)),
            1 => c.clone().prop_map(Op::RemoveContext),
            1 => c.clone().prop_map(Op::Lock),
            1 => c.prop_map(Op::Unlock),
            2 => (0u64..300).prop_map(Op::Pop),
            1 => (0u64..300, 2u32..4).prop_map(|(n, d)| Op::Peek(n, d)),
        ]
    }

    /// The naive model: a list of chunks, a last-use time per context, scanned on every pop.
    #[derive(Default)]
    struct Model {
        chunks: Vec<(ChunkId, u64)>,
        used: HashMap<u64, u64>,
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

        /// Unlocked contexts holding chunks, least recently used first.
        fn order(&self) -> Vec<u64> {
            let mut ctxs: Vec<u64> = self.chunks.iter().map(|c| c.0.context).collect();
            ctxs.sort_unstable();
            ctxs.dedup();
            ctxs.retain(|c| self.locks.get(c).copied().unwrap_or(0) == 0);
            ctxs.sort_by_key(|c| self.used[c]);
            ctxs
        }

        fn of(&self, context: u64) -> Vec<(ChunkId, u64)> {
            let mut v: Vec<_> = self
                .chunks
                .iter()
                .filter(|c| c.0.context == context)
                .copied()
                .collect();
            v.sort_by_key(|c| c.0.index);
            v
        }

        fn apply(&mut self, op: &Op) -> Result<Victims, VictimError> {
            match *op {
                Op::Insert(c, i, b) => {
                    if self.find(id(c, i)).is_ok() {
                        return Err(VictimError::AlreadyTracked { id: id(c, i) });
                    }
                    self.chunks.push((id(c, i), b));
                    self.clock += 1;
                    self.used.insert(c, self.clock);
                }
                Op::Access(c, i) => {
                    self.find(id(c, i))?;
                    self.clock += 1;
                    self.used.insert(c, self.clock);
                }
                Op::Resize(c, i, b) => {
                    let k = self.find(id(c, i))?;
                    self.chunks[k].1 = b;
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
                Op::Pop(need) => {
                    let mut out = Victims::default();
                    for c in self.order() {
                        if out.freed >= need {
                            break;
                        }
                        for (id, bytes) in self.of(c) {
                            out.freed += bytes;
                            out.chunks.push(Victim { id, bytes });
                        }
                        self.chunks.retain(|x| x.0.context != c);
                    }
                    return Ok(out);
                }
                Op::Peek(need, d) => {
                    let mut out = Victims::default();
                    for c in self.order() {
                        if out.freed >= need {
                            break;
                        }
                        for (id, bytes) in self.of(c) {
                            if !id.index.is_multiple_of(d) {
                                out.freed += bytes;
                                out.chunks.push(Victim { id, bytes });
                            }
                        }
                    }
                    return Ok(out);
                }
            }
            Ok(Victims::default())
        }
    }

    fn run(
        q: &mut WholeContextLru,
        op: &Op,
        known: &[(ChunkId, u64)],
    ) -> Result<Victims, VictimError> {
        match *op {
            Op::Insert(c, i, b) => q.on_insert(id(c, i), Level(0), b),
            Op::Access(c, i) => q.on_access(id(c, i)),
            Op::Resize(c, i, b) => q.on_level_change(id(c, i), Level(1), b),
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
                let mut eligible = |id: ChunkId| {
                    (!id.index.is_multiple_of(d))
                        .then(|| known.iter().find(|x| x.0 == id).map(|x| x.1))
                        .flatten()
                };
                return Ok(q.peek_victims(need, &mut eligible));
            }
        }
        .map(|()| Victims::default())
    }

    proptest! {
        #[test]
        fn matches_model(ops in prop::collection::vec(op(), 0..120)) {
            let mut model = Model::default();
            let mut q = WholeContextLru::swapping();
            for op in &ops {
                let got = run(&mut q, op, &model.chunks);
                prop_assert_eq!(got, model.apply(op), "{:?}", op);
                prop_assert_eq!(q.len(), model.chunks.len());
                prop_assert_eq!(q.resident_bytes(), model.chunks.iter().map(|x| x.1).sum::<u64>());
            }
        }
    }
}
