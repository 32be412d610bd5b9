//! Random claim / populate / reclaim / lock / touch / shrink sequences against a simple model, with the budget and /proc Rss checked after each step.

use std::collections::HashMap;
use std::sync::Arc;

use proptest::prelude::*;
use uffd_pager::testing::{PatternSource, fill_pattern, pattern_byte};
use uffd_pager::{
    ChunkKey, ContextId, ContextSpec, MemoryState, Pager, PagerConfig, PagerError, Staging,
};

const PAGE: u64 = 4096;
const CTXS: u64 = 3;
const CHUNKS: u32 = 8;
const MAX_PAGES: u64 = 3;
const BUDGET_PAGES: u64 = 20;

#[derive(Debug, Clone)]
enum Op {
    Populate {
        ctx: u64,
        idx: u32,
        pages: u64,
        by_move: bool,
    },
    Reclaim {
        ctx: u64,
        idx: u32,
    },
    Lock {
        ctx: u64,
    },
    Unlock {
        ctx: u64,
    },
    Touch {
        ctx: u64,
        idx: u32,
    },
    Shrink {
        ctx: u64,
        idx: u32,
        pages: u64,
    },
    Persist {
        ctx: u64,
        idx: u32,
    },
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let ctx = 1..=CTXS;
    let idx = 0..CHUNKS;
    prop_oneof![
        4 => (ctx.clone(), idx.clone(), 1..=MAX_PAGES, any::<bool>())
            .prop_map(|(ctx, idx, pages, by_move)| Op::Populate { ctx, idx, pages, by_move }),
        2 => (ctx.clone(), idx.clone()).prop_map(|(ctx, idx)| Op::Reclaim { ctx, idx }),
        1 => ctx.clone().prop_map(|ctx| Op::Lock { ctx }),
        1 => ctx.clone().prop_map(|ctx| Op::Unlock { ctx }),
        3 => (ctx.clone(), idx.clone()).prop_map(|(ctx, idx)| Op::Touch { ctx, idx }),
        1 => (ctx.clone(), idx.clone(), 1..=MAX_PAGES)
            .prop_map(|(ctx, idx, pages)| Op::Shrink { ctx, idx, pages }),
        1 => (ctx, idx).prop_map(|(ctx, idx)| Op::Persist { ctx, idx }),
    ]
}

/// The model: what each chunk should be, and each context's lock count.
struct Model {
    chunks: HashMap<ChunkKey, (MemoryState, u64)>,
    locks: HashMap<u64, u32>,
}

impl Model {
    fn resident(&self) -> u64 {
        self.chunks
            .values()
            .filter(|(s, _)| *s == MemoryState::Resident)
            .map(|(_, b)| b)
            .sum()
    }

    fn resident_in(&self, ctx: u64) -> u64 {
        self.chunks
            .iter()
            .filter(|(k, (s, _))| k.ctx.0 == ctx && *s == MemoryState::Resident)
            .map(|(_, (_, b))| b)
            .sum()
    }

    fn evictable(&self) -> u64 {
        self.chunks
            .iter()
            .filter(|(k, (s, _))| *s == MemoryState::Resident && self.locks[&k.ctx.0] == 0)
            .map(|(_, (_, b))| b)
            .sum()
    }

    fn state(&self, k: ChunkKey) -> (MemoryState, u64) {
        self.chunks[&k]
    }

    fn set(&mut self, k: ChunkKey, s: MemoryState, bytes: u64) {
        self.chunks.insert(k, (s, bytes));
    }
}

struct Harness {
    pager: Pager,
    model: Model,
    staging: Staging,
}

impl Harness {
    fn new() -> Harness {
        let pager = Pager::new(
            PagerConfig::new(BUDGET_PAGES * PAGE, (MAX_PAGES * PAGE) as usize),
            Arc::new(PatternSource::new()),
        )
        .expect("open the pager");
        let mut model = Model {
            chunks: HashMap::new(),
            locks: HashMap::new(),
        };
        for ctx in 1..=CTXS {
            pager
                .add_context(
                    ContextId(ctx),
                    ContextSpec {
                        max_chunks: CHUNKS,
                        max_slot_bytes: (MAX_PAGES * PAGE) as usize,
                    },
                )
                .expect("add a context");
            model.locks.insert(ctx, 0);
            for idx in 0..CHUNKS {
                model.set(ChunkKey::new(ctx, idx), MemoryState::Absent, 0);
            }
        }
        Harness {
            pager,
            model,
            staging: Staging::new((MAX_PAGES * PAGE) as usize).expect("staging"),
        }
    }

    /// Take in the pager's evictions: a chunk the model holds resident may only have been
    /// reclaimed if its context is unlocked. Anything else must match the model exactly.
    fn sync(&mut self, op: &Op) {
        for ctx in 1..=CTXS {
            for idx in 0..CHUNKS {
                let k = ChunkKey::new(ctx, idx);
                let info = self.pager.chunk_info(k).expect("chunk info");
                let (want, bytes) = self.model.state(k);
                if want == MemoryState::Resident && info.state == MemoryState::Reclaimed {
                    assert_eq!(
                        self.model.locks[&ctx], 0,
                        "{op:?}: evicted {k} of a locked context"
                    );
                    self.model.set(k, MemoryState::Reclaimed, bytes);
                } else {
                    assert_eq!(info.state, want, "{op:?}: {k}");
                    if want == MemoryState::Resident {
                        assert_eq!(info.bytes as u64, bytes, "{op:?}: {k} bytes");
                    }
                }
            }
        }
    }

    fn check_budget(&self, op: &Op, rss: bool) {
        let resident = self.pager.resident_bytes();
        assert!(resident <= BUDGET_PAGES * PAGE, "{op:?}: over budget");
        assert_eq!(resident, self.model.resident(), "{op:?}: accounting");
        if rss {
            for ctx in 1..=CTXS {
                assert_eq!(
                    self.pager.region_rss(ContextId(ctx)).expect("smaps"),
                    self.model.resident_in(ctx),
                    "{op:?}: Rss of context {ctx}"
                );
            }
        }
    }

    fn room_for(&self, need: u64) -> bool {
        BUDGET_PAGES * PAGE - self.model.resident() + self.model.evictable() >= need
    }

    /// Applies one operation to the pager and the model, and checks they agree.
    ///
    /// Kept whole: one arm per operation, each beside the model's transition it must match.
    fn step(&mut self, op: &Op, rss: bool) {
        let p = &self.pager;
        match *op {
            Op::Populate {
                ctx,
                idx,
                pages,
                by_move,
            } => {
                let k = ChunkKey::new(ctx, idx);
                let bytes = pages * PAGE;
                let (state, _) = self.model.state(k);
                let room = self.room_for(bytes);
                let r = if by_move {
                    fill_pattern(k, &mut self.staging.as_mut_slice()[..bytes as usize]);
                    p.populate_move(k, bytes as usize, &mut self.staging)
                } else {
                    let mut data = vec![0u8; bytes as usize];
                    fill_pattern(k, &mut data);
                    p.populate(k, bytes as usize, &data)
                };
                match (state, r) {
                    (MemoryState::Resident, Err(PagerError::AlreadyResident { .. })) => {}
                    (_, Ok(())) if state != MemoryState::Resident => {
                        assert!(room, "{op:?}: populated without room");
                        self.model.set(k, MemoryState::Resident, bytes);
                    }
                    (_, Err(PagerError::BudgetExhausted { .. }))
                        if state != MemoryState::Resident =>
                    {
                        assert!(!room, "{op:?}: refused with room");
                    }
                    (s, r) => panic!("{op:?}: state {s:?} gave {r:?}"),
                }
            }
            Op::Reclaim { ctx, idx } => {
                let k = ChunkKey::new(ctx, idx);
                let (state, bytes) = self.model.state(k);
                let r = p.reclaim(k);
                let locked = self.model.locks[&ctx] > 0;
                match (state, r) {
                    (
                        MemoryState::Resident | MemoryState::ZeroMapped,
                        Err(PagerError::Locked { .. }),
                    ) if locked => {}
                    (MemoryState::Resident | MemoryState::ZeroMapped, Ok(_)) if !locked => {
                        self.model.set(k, MemoryState::Reclaimed, bytes);
                    }
                    (
                        MemoryState::Absent | MemoryState::Reclaimed,
                        Err(PagerError::Locked { .. }),
                    ) if locked => {}
                    (
                        MemoryState::Absent | MemoryState::Reclaimed,
                        Err(PagerError::NotResident { .. }),
                    ) => {}
                    (s, r) => panic!("{op:?}: state {s:?} gave {r:?}"),
                }
            }
            Op::Lock { ctx } => {
                p.lock_context(ContextId(ctx)).expect("lock");
                *self.model.locks.get_mut(&ctx).expect("ctx") += 1;
            }
            Op::Unlock { ctx } => {
                let r = p.unlock_context(ContextId(ctx));
                let n = self.model.locks.get_mut(&ctx).expect("ctx");
                if *n == 0 {
                    assert!(
                        matches!(r, Err(PagerError::NotLockedUnlock { .. })),
                        "{op:?}: {r:?}"
                    );
                } else {
                    r.expect("unlock");
                    *n -= 1;
                }
            }
            Op::Touch { ctx, idx } => {
                let k = ChunkKey::new(ctx, idx);
                let (state, bytes) = self.model.state(k);
                let stride = MAX_PAGES * PAGE;
                let bytes_back = if state == MemoryState::Absent {
                    stride
                } else {
                    bytes
                };
                p.lock_context(ContextId(ctx)).expect("lock");
                *self.model.locks.get_mut(&ctx).expect("ctx") += 1;
                let room = self.room_for(bytes_back);
                let mut first = [0u8; 64];
                p.read(k, 0, &mut first).expect("read");
                let checked = p.check(k);
                match state {
                    MemoryState::Resident => {
                        checked.expect("resident chunk usable");
                        assert!(
                            first
                                .iter()
                                .enumerate()
                                .all(|(i, b)| *b == pattern_byte(k, i))
                        );
                    }
                    MemoryState::ZeroMapped => {
                        assert!(matches!(checked, Err(PagerError::NeedsRecompute { .. })));
                    }
                    MemoryState::Absent | MemoryState::Reclaimed if room => {
                        checked.expect("faulted-in chunk usable");
                        assert!(
                            first
                                .iter()
                                .enumerate()
                                .all(|(i, b)| *b == pattern_byte(k, i)),
                            "{op:?}: wrong bytes after a fault"
                        );
                        self.model.set(k, MemoryState::Resident, bytes_back);
                    }
                    MemoryState::Absent | MemoryState::Reclaimed => {
                        assert!(
                            matches!(checked, Err(PagerError::NeedsRecompute { .. })),
                            "{op:?}: {checked:?}"
                        );
                        assert!(first.iter().all(|b| *b == 0));
                        let b = if bytes == 0 { stride } else { bytes };
                        self.model.set(k, MemoryState::ZeroMapped, b);
                    }
                    MemoryState::Populating => unreachable!("the model never holds Populating"),
                }
                self.sync(op);
                self.pager.unlock_context(ContextId(ctx)).expect("unlock");
                *self.model.locks.get_mut(&ctx).expect("ctx") -= 1;
                let _ = self.pager.drain_recompute();
            }
            Op::Shrink { ctx, idx, pages } => {
                let k = ChunkKey::new(ctx, idx);
                let (state, bytes) = self.model.state(k);
                let r = p.shrink(k, (pages * PAGE) as usize);
                match (state, r) {
                    (MemoryState::Resident, Ok(freed)) => {
                        let new = bytes.min(pages * PAGE);
                        assert_eq!(freed, bytes - new, "{op:?}");
                        self.model.set(k, MemoryState::Resident, new);
                    }
                    (MemoryState::Resident, r) => panic!("{op:?}: {r:?}"),
                    (_, Err(PagerError::NotResident { .. })) => {}
                    (s, r) => panic!("{op:?}: state {s:?} gave {r:?}"),
                }
            }
            Op::Persist { ctx, idx } => {
                p.mark_persisted(ChunkKey::new(ctx, idx)).expect("persist");
            }
        }
        self.sync(op);
        self.check_budget(op, rss);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn random_sequences_keep_the_budget_and_match_rss(ops in proptest::collection::vec(op_strategy(), 1..120)) {
        let mut h = Harness::new();
        for op in &ops {
            h.step(op, true);
        }
    }
}

#[test]
fn ten_thousand_random_operations() {
    let mut h = Harness::new();
    let mut seed: u64 = 0x2545_F491_4F6C_DD1D;
    let mut next = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    for i in 0..10_000 {
        let ctx = 1 + next(CTXS);
        let idx = next(u64::from(CHUNKS)) as u32;
        let op = match next(13) {
            0..=3 => Op::Populate {
                ctx,
                idx,
                pages: 1 + next(MAX_PAGES),
                by_move: next(2) == 0,
            },
            4..=5 => Op::Reclaim { ctx, idx },
            6 => Op::Lock { ctx },
            7 => Op::Unlock { ctx },
            8..=10 => Op::Touch { ctx, idx },
            11 => Op::Shrink {
                ctx,
                idx,
                pages: 1 + next(MAX_PAGES),
            },
            _ => Op::Persist { ctx, idx },
        };
        h.step(&op, i % 100 == 0);
    }
    let s = h.pager.stats();
    assert!(
        s.faults > 0 && s.reclaims > 0 && s.budget_refusals > 0,
        "{s:?}"
    );
}
