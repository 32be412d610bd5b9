//! Four threads run 10,000 random operations at once on contexts that share one budget, with a monitor sampling the budget;
//! once more with a source that keeps victims, so every room made writes victims back, from the threads and the fault thread at once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};

use uffd_pager::testing::{GatedSource, PatternSource, fill_pattern, pattern_byte};
use uffd_pager::{
    ChunkKey, ChunkSource, ContextId, ContextSpec, MemoryState, Pager, PagerConfig, PagerError,
    PopulateVia,
};

const PAGE: usize = 4096;
const SLOT: usize = 4 * PAGE;
const CHUNKS: u32 = 12;
const BUDGET: u64 = 24 * PAGE as u64;

fn worker(p: &Pager, ctx: u64, mut seed: u64, ops: usize) {
    let mut next = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let mut data = vec![0u8; SLOT];
    for _ in 0..ops {
        let k = ChunkKey::new(ctx, next(u64::from(CHUNKS)) as u32);
        match next(4) {
            0 => {
                let bytes = PAGE * (1 + next(4) as usize);
                fill_pattern(k, &mut data[..bytes]);
                match p.populate(k, bytes, &data[..bytes]) {
                    Ok(())
                    | Err(PagerError::AlreadyResident { .. })
                    | Err(PagerError::BudgetExhausted { .. }) => {}
                    Err(e) => panic!("populate {k}: {e}"),
                }
            }
            1 => match p.reclaim(k) {
                Ok(_) | Err(PagerError::NotResident { .. }) => {}
                Err(e) => panic!("reclaim {k}: {e}"),
            },
            2 => match p.shrink(k, PAGE * (1 + next(4) as usize)) {
                Ok(_) | Err(PagerError::NotResident { .. }) => {}
                Err(e) => panic!("shrink {k}: {e}"),
            },
            _ => {
                p.lock_context(ContextId(ctx)).unwrap();
                let mut head = [0u8; 256];
                p.read(k, 0, &mut head).unwrap();
                match p.check(k) {
                    Ok(()) => assert!(
                        head.iter()
                            .enumerate()
                            .all(|(i, b)| *b == pattern_byte(k, i)),
                        "{k}: wrong bytes after a touch"
                    ),
                    Err(PagerError::NeedsRecompute { .. }) => {
                        assert!(head.iter().all(|b| *b == 0), "{k}: not zero-filled");
                        p.unlock_context(ContextId(ctx)).unwrap();
                        // Make the chunk usable again the way the engine would: drop it and
                        // claim it afresh (it may be refused while the budget is tight).
                        let _ = p.reclaim(k);
                        continue;
                    }
                    Err(e) => panic!("check {k}: {e}"),
                }
                p.unlock_context(ContextId(ctx)).unwrap();
            }
        }
    }
}

fn run(fault_via: PopulateVia, source: Arc<dyn ChunkSource>) -> uffd_pager::StatsSnapshot {
    let p = Arc::new(
        Pager::new(
            PagerConfig {
                fault_via,
                ..PagerConfig::new(BUDGET, SLOT)
            },
            source,
        )
        .unwrap(),
    );
    for ctx in 1..=4 {
        p.add_context(
            ContextId(ctx),
            ContextSpec {
                max_chunks: CHUNKS,
                max_slot_bytes: SLOT,
            },
        )
        .unwrap();
    }
    let done = Arc::new(AtomicBool::new(false));
    let monitor = {
        let (p, done) = (Arc::clone(&p), Arc::clone(&done));
        std::thread::spawn(move || {
            let mut samples = 0u64;
            while !done.load(Ordering::Relaxed) {
                assert!(p.resident_bytes() <= BUDGET, "over budget");
                samples += 1;
                std::thread::yield_now();
            }
            samples
        })
    };
    let barrier = Arc::new(Barrier::new(4));
    let workers: Vec<_> = (1..=4u64)
        .map(|ctx| {
            let (p, barrier) = (Arc::clone(&p), Arc::clone(&barrier));
            std::thread::spawn(move || {
                barrier.wait();
                worker(&p, ctx, 0x9E37_79B9 * ctx + 1, 2_500);
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    done.store(true, Ordering::Relaxed);
    assert!(monitor.join().unwrap() > 0);

    // Quiescent: the accounting adds up, chunk by chunk and against the kernel's Rss.
    let mut total = 0;
    for ctx in 1..=4 {
        let mut in_ctx = 0;
        for i in 0..CHUNKS {
            let info = p.chunk_info(ChunkKey::new(ctx, i)).unwrap();
            assert_ne!(info.state, MemoryState::Populating);
            if info.state == MemoryState::Resident {
                in_ctx += info.bytes as u64;
            }
        }
        assert_eq!(
            p.region_rss(ContextId(ctx)).unwrap(),
            in_ctx,
            "Rss of context {ctx}"
        );
        total += in_ctx;
    }
    assert_eq!(p.resident_bytes(), total);
    assert!(total <= BUDGET);
    let s = p.stats();
    assert!(s.faults > 0 && s.reclaims > 0, "{s:?}");
    s
}

#[test]
fn four_threads_ten_thousand_operations_copy_mode() {
    run(PopulateVia::Copy, Arc::new(PatternSource::new()));
}

#[test]
fn four_threads_ten_thousand_operations_move_mode() {
    run(PopulateVia::Move, Arc::new(PatternSource::new()));
}

#[test]
fn four_threads_ten_thousand_operations_writing_victims_back() {
    // No chunk is ever marked persisted, so every victim is written back before it goes: by the
    // thread whose populate needs the room, or by the write-back thread for a fault, while the
    // other threads lock contexts (waiting for their chunks' writes) and fault.
    let s = run(PopulateVia::Copy, Arc::new(GatedSource::writing_back()));
    // Here about 1,500 write-backs a run, 600 faults set aside for room and 50-90 locks that
    // waited for a write.
    assert!(
        s.sync_reclaims > 0 && s.faults_deferred_for_room > 0,
        "{s:?}"
    );
}
