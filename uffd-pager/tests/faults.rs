//! Real userfaultfd faults: populate, reclaim, touch, concurrent faults, a faulty source, the budget, shutdown.

use std::sync::{Arc, Barrier, mpsc};
use std::time::Duration;

use uffd_pager::testing::{FaultySource, GatedSource, Misbehavior, PatternSource, fill_pattern};
use uffd_pager::{
    ChunkKey, ChunkSource, ContextId, ContextSpec, MemoryState, Pager, PagerConfig, PagerError,
    PopulateVia, RecomputeReason, ResidentView, SourceError, Staging, VictimChooser,
};

const PAGE: usize = 4096;
const SLOT: usize = 3 * PAGE;

fn pager(budget_pages: u64, source: Arc<dyn ChunkSource>) -> Pager {
    pager_with(PagerConfig::new(budget_pages * PAGE as u64, SLOT), source)
}

/// A pager with `config` and contexts 1 and 2.
fn pager_with(config: PagerConfig, source: Arc<dyn ChunkSource>) -> Pager {
    let p = Pager::new(config, source).expect("open the pager (needs root and /dev/userfaultfd)");
    for ctx in 1..=2 {
        p.add_context(
            ContextId(ctx),
            ContextSpec {
                max_chunks: 16,
                max_slot_bytes: SLOT,
            },
        )
        .expect("add a context");
    }
    p
}

fn pattern(key: ChunkKey, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill_pattern(key, &mut v);
    v
}

/// Read a chunk the way engine code does: plain loads through the slot pointer.
fn touch_read(p: &Pager, key: ChunkKey, len: usize) -> Vec<u8> {
    let (ptr, stride) = p.slot_ptr(key).expect("slot pointer");
    assert!(len <= stride);
    let mut out = vec![0u8; len];
    for (i, b) in out.iter_mut().enumerate() {
        // SAFETY: the slot lies inside the context's mapping, which lives as long as the pager;
        // a non-resident page faults and the fault thread fills it.
        *b = unsafe { std::ptr::read_volatile(ptr.as_ptr().add(i)) };
    }
    out
}

/// This thread's id, as the kernel and /proc/self/task name it.
fn thread_id() -> u32 {
    // /proc/thread-self links to `<pid>/task/<tid>`.
    let link = std::fs::read_link("/proc/thread-self").unwrap();
    link.file_name().unwrap().to_str().unwrap().parse().unwrap()
}

/// Wait until thread `tid` sleeps in the kernel's userfaultfd handler: it touched a page that is
/// not there and waits for the fault thread (or for the range to be unregistered).
fn wait_blocked_in_fault(tid: u32) {
    let wchan = format!("/proc/self/task/{tid}/wchan");
    while std::fs::read_to_string(&wchan).unwrap() != "handle_userfault" {
        std::thread::yield_now();
    }
}

#[test]
fn populate_copies_the_bytes_and_rss_matches() {
    let p = pager(64, Arc::new(PatternSource::new()));
    let k = ChunkKey::new(1, 2);
    let data = pattern(k, 10_000);
    p.populate(k, 10_000, &data).unwrap();
    assert_eq!(p.resident_bytes(), SLOT as u64);
    assert_eq!(p.region_rss(ContextId(1)).unwrap(), SLOT as u64);
    p.lock_context(ContextId(1)).unwrap();
    let mut out = vec![0u8; SLOT];
    p.read(k, 0, &mut out).unwrap();
    assert_eq!(&out[..10_000], &data[..]);
    assert!(
        out[10_000..].iter().all(|b| *b == 0),
        "the tail is zero-padded"
    );
    let info = p.chunk_info(k).unwrap();
    assert_eq!(info.state, MemoryState::Resident);
    assert!(!info.persisted);
    p.check(k).unwrap();
}

/// A chunk's bytes rewritten in place are no longer those written out: `write` clears the mark,
/// so the engine's change after a write-out marked the old bytes persisted is written again
/// (docs/service.md, "Concurrency models", the versions).
#[test]
fn a_write_in_place_unmarks_a_persisted_chunk() {
    let p = pager(64, Arc::new(PatternSource::new()));
    let k = ChunkKey::new(1, 3);
    p.populate(k, SLOT, &pattern(k, SLOT)).unwrap();
    p.mark_persisted(k).unwrap();
    assert!(p.chunk_info(k).unwrap().persisted);
    p.lock_context(ContextId(1)).unwrap();
    p.write(k, 0, &[7; 16]).unwrap();
    assert!(!p.chunk_info(k).unwrap().persisted);
    p.unlock_context(ContextId(1)).unwrap();
}

#[test]
fn reclaim_returns_memory_and_a_touch_faults_the_chunk_back() {
    let src = Arc::new(PatternSource::new());
    let p = pager(64, src.clone());
    let k = ChunkKey::new(1, 5);
    p.populate(k, SLOT, &pattern(k, SLOT)).unwrap();
    p.mark_persisted(k).unwrap();
    assert_eq!(p.region_rss(ContextId(1)).unwrap(), SLOT as u64);
    assert_eq!(p.reclaim(k).unwrap(), SLOT as u64);
    assert_eq!(
        p.region_rss(ContextId(1)).unwrap(),
        0,
        "MADV_DONTNEED gave the pages back"
    );
    assert_eq!(p.resident_bytes(), 0);
    assert_eq!(p.chunk_info(k).unwrap().state, MemoryState::Reclaimed);

    // Touch one byte in the middle page: the fault thread brings the whole chunk back.
    let got = touch_read(&p, k, SLOT);
    assert_eq!(got, pattern(k, SLOT));
    p.check(k).unwrap();
    assert_eq!(src.reads(), 1, "one fault populated the whole chunk");
    assert_eq!(p.region_rss(ContextId(1)).unwrap(), SLOT as u64);
    assert_eq!(p.resident_bytes(), SLOT as u64);
    let s = p.stats();
    assert_eq!(s.populates, 2);
    assert_eq!(s.reclaims, 1);
    assert!(s.faults >= 1);
    assert_eq!(s.fault_latency.count, 1);
    p.check(k).unwrap();
}

#[test]
fn reclaim_refuses_locked_contexts_and_absent_chunks() {
    let p = pager(64, Arc::new(PatternSource::new()));
    let k = ChunkKey::new(2, 0);
    assert!(matches!(p.reclaim(k), Err(PagerError::NotResident { .. })));
    p.populate(k, PAGE, &[1u8; 100]).unwrap();
    p.lock_context(ContextId(2)).unwrap();
    assert!(matches!(p.reclaim(k), Err(PagerError::Locked { .. })));
    assert!(matches!(
        p.remove_context(ContextId(2)),
        Err(PagerError::Locked { .. })
    ));
    p.unlock_context(ContextId(2)).unwrap();
    assert!(matches!(
        p.unlock_context(ContextId(2)),
        Err(PagerError::NotLockedUnlock { .. })
    ));
    p.reclaim(k).unwrap();
    assert!(matches!(
        p.populate(ChunkKey::new(9, 0), PAGE, &[]),
        Err(PagerError::NoContext { .. })
    ));
    assert!(matches!(
        p.populate(ChunkKey::new(1, 16), PAGE, &[]),
        Err(PagerError::NoChunk { .. })
    ));
    assert!(matches!(
        p.populate(ChunkKey::new(1, 0), SLOT + 1, &[]),
        Err(PagerError::SlotTooLarge { .. })
    ));
}

#[test]
fn shrink_in_place_returns_the_tail() {
    let p = pager(64, Arc::new(PatternSource::new()));
    let k = ChunkKey::new(1, 1);
    let data = pattern(k, SLOT);
    p.populate(k, SLOT, &data).unwrap();
    assert_eq!(p.shrink(k, 5000).unwrap(), PAGE as u64);
    assert_eq!(p.resident_bytes(), 2 * PAGE as u64);
    assert_eq!(p.region_rss(ContextId(1)).unwrap(), 2 * PAGE as u64);
    p.lock_context(ContextId(1)).unwrap();
    let mut out = vec![0u8; 2 * PAGE];
    p.read(k, 0, &mut out).unwrap();
    assert_eq!(out, data[..2 * PAGE]);
    // A stray touch past the shrunk end maps the zero page: no memory, no fault loop.
    let mut past = vec![7u8; 16];
    p.read(k, 2 * PAGE + 8, &mut past).unwrap();
    assert_eq!(past, vec![0u8; 16]);
    assert_eq!(p.region_rss(ContextId(1)).unwrap(), 2 * PAGE as u64);
    assert!(matches!(
        p.write(k, 2 * PAGE, &[1]),
        Err(PagerError::OutOfRange { .. })
    ));
    // Reclaim and fault back at the shrunk size.
    p.unlock_context(ContextId(1)).unwrap();
    p.reclaim(k).unwrap();
    p.lock_context(ContextId(1)).unwrap();
    let mut back = vec![0u8; 2 * PAGE];
    p.read(k, 0, &mut back).unwrap();
    assert_eq!(back, data[..2 * PAGE]);
    assert_eq!(p.resident_bytes(), 2 * PAGE as u64);
}

#[test]
fn populate_by_move_hands_the_pages_over() {
    let p = pager(64, Arc::new(PatternSource::new()));
    assert!(p.move_supported(), "kernel 6.8+ has UFFDIO_MOVE");
    let k = ChunkKey::new(1, 3);
    let data = pattern(k, SLOT);
    let mut staging = Staging::new(SLOT).unwrap();
    staging.as_mut_slice()[..SLOT].copy_from_slice(&data);
    p.populate_move(k, SLOT, &mut staging).unwrap();
    assert!(
        staging.as_slice().iter().all(|b| *b == 0),
        "moved pages left the staging buffer"
    );
    assert_eq!(p.region_rss(ContextId(1)).unwrap(), SLOT as u64);
    p.lock_context(ContextId(1)).unwrap();
    let mut out = vec![0u8; SLOT];
    p.read(k, 0, &mut out).unwrap();
    assert_eq!(out, data);
    // A staging buffer with holes (pages never written) falls back to copying them.
    let k2 = ChunkKey::new(1, 4);
    let mut holes = Staging::new(SLOT).unwrap();
    holes.as_mut_slice()[..10].copy_from_slice(&[9u8; 10]);
    p.populate_move(k2, SLOT, &mut holes).unwrap();
    let mut out2 = vec![1u8; SLOT];
    p.read(k2, 0, &mut out2).unwrap();
    assert_eq!(&out2[..10], &[9u8; 10]);
    assert!(out2[10..].iter().all(|b| *b == 0));
    assert_eq!(p.region_rss(ContextId(1)).unwrap(), 2 * SLOT as u64);
}

#[test]
fn load_brings_a_chunk_back_in_the_calling_thread() {
    let src = Arc::new(FaultySource::new());
    let p = pager(64, src.clone());
    let k = ChunkKey::new(1, 7);
    let mut staging = Staging::new(SLOT).unwrap();
    p.populate(k, SLOT, &pattern(k, SLOT)).unwrap();
    p.reclaim(k).unwrap();
    p.load(k, &mut staging).unwrap();
    assert_eq!(p.chunk_info(k).unwrap().state, MemoryState::Resident);
    assert!(p.chunk_info(k).unwrap().persisted);
    p.load(k, &mut staging).unwrap();
    assert_eq!(src.reads(), 1, "a resident chunk is not read again");
    p.reclaim(k).unwrap();
    src.break_chunk(k, Misbehavior::Corrupt);
    let err = p.load(k, &mut staging).unwrap_err();
    assert!(matches!(
        err,
        PagerError::Source {
            source: SourceError::Corrupt { .. },
            ..
        }
    ));
    assert_eq!(p.chunk_info(k).unwrap().state, MemoryState::Reclaimed);
    assert_eq!(p.resident_bytes(), 0, "a failed load spends no budget");
}

#[test]
fn four_threads_fault_the_same_and_different_chunks() {
    let src = Arc::new(FaultySource::new());
    let p = Arc::new(pager(64, src.clone()));
    let shared = ChunkKey::new(1, 0);
    for i in 0..5 {
        src.break_chunk(
            ChunkKey::new(1, i),
            Misbehavior::Slow(Duration::from_millis(20)),
        );
    }
    p.lock_context(ContextId(1)).unwrap();
    let barrier = Arc::new(Barrier::new(4));
    let threads: Vec<_> = (0..4u32)
        .map(|t| {
            let p = Arc::clone(&p);
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                barrier.wait();
                let own = ChunkKey::new(1, 1 + t);
                let a = touch_read(&p, shared, SLOT);
                let b = touch_read(&p, own, SLOT);
                (a == pattern(shared, SLOT), b == pattern(own, SLOT))
            })
        })
        .collect();
    for t in threads {
        assert_eq!(t.join().unwrap(), (true, true));
    }
    assert_eq!(src.reads(), 5, "each chunk was populated exactly once");
    assert_eq!(p.resident_bytes(), 5 * SLOT as u64);
    assert_eq!(p.region_rss(ContextId(1)).unwrap(), 5 * SLOT as u64);
}

fn check_faulty(how: Misbehavior, expect: fn(&SourceError) -> bool) {
    let src = Arc::new(FaultySource::new());
    let p = pager(64, src.clone());
    let k = ChunkKey::new(1, 9);
    p.populate(k, SLOT, &pattern(k, SLOT)).unwrap();
    p.reclaim(k).unwrap();
    src.break_chunk(k, how.clone());
    let got = touch_read(&p, k, SLOT);
    assert!(
        got.iter().all(|b| *b == 0),
        "{how:?}: no wrong data, only zeros"
    );
    let checked = p.check(k);
    assert!(
        matches!(checked, Err(PagerError::NeedsRecompute { .. })),
        "{how:?}: {checked:?}"
    );
    let queue = p.drain_recompute();
    assert_eq!(queue.len(), 1, "{how:?}");
    assert_eq!(queue[0].key, k);
    match &queue[0].reason {
        RecomputeReason::Source(e) => assert!(expect(e), "{how:?}: {e}"),
        other => panic!("{how:?}: unexpected reason {other:?}"),
    }
    assert!(p.drain_recompute().is_empty());
    assert_eq!(p.stats().source_errors, 1);
    // The engine recomputes in place, then the chunk is usable.
    p.lock_context(ContextId(1)).unwrap();
    p.write(k, 0, &pattern(k, SLOT)).unwrap();
    p.mark_recomputed(k).unwrap();
    p.check(k).unwrap();
    // The pager still serves other chunks.
    let other = ChunkKey::new(2, 1);
    assert_eq!(touch_read(&p, other, PAGE), pattern(other, PAGE));
}

#[test]
fn a_faulty_source_never_hangs_nor_hands_out_wrong_bytes() {
    check_faulty(Misbehavior::Missing, |e| {
        matches!(e, SourceError::Missing { .. })
    });
    check_faulty(Misbehavior::Corrupt, |e| {
        matches!(e, SourceError::Corrupt { .. })
    });
    check_faulty(Misbehavior::IoErrorAfterGarbage, |e| {
        matches!(e, SourceError::Io { .. })
    });
    check_faulty(Misbehavior::Timeout(Duration::from_millis(30)), |e| {
        matches!(e, SourceError::Timeout { .. })
    });
    check_faulty(Misbehavior::Panic, |e| {
        matches!(e, SourceError::Panicked { .. })
    });
}

#[test]
fn a_slow_source_still_serves_the_right_bytes() {
    let src = Arc::new(FaultySource::new());
    let p = pager(64, src.clone());
    let k = ChunkKey::new(2, 3);
    src.break_chunk(k, Misbehavior::Slow(Duration::from_millis(50)));
    assert_eq!(touch_read(&p, k, SLOT), pattern(k, SLOT));
    p.check(k).unwrap();
    assert!(p.drain_recompute().is_empty());
}

#[test]
fn the_budget_reclaims_victims_and_refuses_when_everything_is_locked() {
    let p = pager(6, Arc::new(PatternSource::new()));
    let a = ChunkKey::new(1, 0);
    let b = ChunkKey::new(1, 1);
    let c = ChunkKey::new(2, 0);
    p.populate(a, SLOT, &pattern(a, SLOT)).unwrap();
    p.populate(b, SLOT, &pattern(b, SLOT)).unwrap();
    assert_eq!(p.resident_bytes(), 6 * PAGE as u64);
    // Full: the least recently used chunk (a) goes.
    p.populate(c, SLOT, &pattern(c, SLOT)).unwrap();
    assert_eq!(p.chunk_info(a).unwrap().state, MemoryState::Reclaimed);
    assert_eq!(p.resident_bytes(), 6 * PAGE as u64);
    assert_eq!(
        p.region_rss(ContextId(1)).unwrap() + p.region_rss(ContextId(2)).unwrap(),
        6 * PAGE as u64
    );
    // Everything resident is locked: a populate is refused with a clear error.
    p.lock_context(ContextId(1)).unwrap();
    p.lock_context(ContextId(2)).unwrap();
    let err = p.populate(a, SLOT, &pattern(a, SLOT)).unwrap_err();
    assert!(
        matches!(err, PagerError::BudgetExhausted { need, budget, .. } if need == SLOT as u64 && budget == 6 * PAGE as u64)
    );
    assert!(
        err.to_string()
            .contains("unlock a context or raise the budget")
    );
    // A fault with no room maps the zero page (no memory) and asks for recompute.
    let got = touch_read(&p, a, SLOT);
    assert!(got.iter().all(|x| *x == 0));
    assert_eq!(p.chunk_info(a).unwrap().state, MemoryState::ZeroMapped);
    assert!(matches!(p.check(a), Err(PagerError::NeedsRecompute { .. })));
    let q = p.drain_recompute();
    assert_eq!(q.len(), 1);
    assert_eq!(q[0].reason, RecomputeReason::BudgetExhausted);
    assert_eq!(p.resident_bytes(), 6 * PAGE as u64);
    assert_eq!(
        p.region_rss(ContextId(1)).unwrap(),
        2 * SLOT as u64 - SLOT as u64
    );
    // Once room is made, the chunk is populated for real.
    p.unlock_context(ContextId(2)).unwrap();
    p.populate(a, SLOT, &pattern(a, SLOT)).unwrap();
    assert_eq!(p.chunk_info(c).unwrap().state, MemoryState::Reclaimed);
    p.check(a).unwrap();
    let mut out = vec![0u8; SLOT];
    p.read(a, 0, &mut out).unwrap();
    assert_eq!(out, pattern(a, SLOT));
    assert_eq!(p.stats().budget_refusals, 2);
    // A chunk larger than the whole budget is refused outright.
    let small = pager(2, Arc::new(PatternSource::new()));
    assert!(matches!(
        small.populate(a, SLOT, &[]),
        Err(PagerError::LargerThanBudget { .. })
    ));
}

#[test]
fn shutdown_releases_threads_blocked_on_faults() {
    // The source holds its fills: the fault thread stays inside the first fault's fill, and the
    // other threads' faults wait in the kernel behind it, until the test says otherwise.
    let src = Arc::new(GatedSource::new());
    src.hold();
    let p = Arc::new(pager(64, src.clone()));
    let (tids, tid) = mpsc::channel();
    let threads: Vec<_> = (0..4u32)
        .map(|t| {
            let p = Arc::clone(&p);
            let tids = tids.clone();
            std::thread::spawn(move || {
                let k = ChunkKey::new(1, t);
                let (ptr, _) = p.slot_ptr(k).unwrap();
                tids.send(thread_id()).unwrap();
                // SAFETY: the slot lies inside the context's mapping, which lives as long as the
                // pager; the read faults and waits for the fault thread.
                let got = unsafe { std::ptr::read_volatile(ptr.as_ptr()) };
                // Engine-like code checks before it uses the bytes.
                (got, p.check(k))
            })
        })
        .collect();
    let held = src.wait_for_held_fill();
    assert_eq!(held.ctx, ContextId(1));
    for _ in 0..4 {
        wait_blocked_in_fault(tid.recv().unwrap());
    }
    // Every thread sleeps in a fault now: one whose chunk is being filled, three queued.
    let stopper = {
        let p = Arc::clone(&p);
        std::thread::spawn(move || p.shutdown())
    };
    // Unregistering the regions wakes them all before the fill ends: the retried read finds an
    // ordinary mapping and gets a zero page, and `check` says why those zeros are no data.
    for t in threads {
        let (got, check) = t.join().unwrap();
        assert_eq!(got, 0);
        assert!(matches!(check, Err(PagerError::ShutDown)), "{check:?}");
    }
    // Only now does the held fill return: its copy finds no registered range, the chunk goes
    // back to non-resident, and the fault thread stops; the queued faults were never served.
    src.release();
    stopper.join().unwrap();
    assert_eq!(src.reads(), 1);
    assert_eq!(p.resident_bytes(), 0);
    assert!(matches!(
        p.populate(ChunkKey::new(1, 5), PAGE, &[]),
        Err(PagerError::ShutDown)
    ));
    assert!(matches!(p.check(held), Err(PagerError::ShutDown)));
}

#[test]
fn remove_context_frees_everything() {
    let p = pager(64, Arc::new(PatternSource::new()));
    for i in 0..4 {
        let k = ChunkKey::new(1, i);
        p.populate(k, SLOT, &pattern(k, SLOT)).unwrap();
    }
    assert_eq!(p.resident_bytes(), 4 * SLOT as u64);
    p.remove_context(ContextId(1)).unwrap();
    assert_eq!(p.resident_bytes(), 0);
    assert!(matches!(
        p.region_rss(ContextId(1)),
        Err(PagerError::NoContext { .. })
    ));
    assert!(matches!(
        p.add_context(
            ContextId(2),
            ContextSpec {
                max_chunks: 1,
                max_slot_bytes: PAGE
            }
        ),
        Err(PagerError::ContextExists { .. })
    ));
    p.add_context(
        ContextId(1),
        ContextSpec {
            max_chunks: 2,
            max_slot_bytes: PAGE,
        },
    )
    .unwrap();
    assert_eq!(
        p.chunk_info(ChunkKey::new(1, 0)).unwrap().state,
        MemoryState::Absent
    );
}

#[test]
fn a_fault_on_a_chunk_being_loaded_waits_for_that_load() {
    let src = Arc::new(FaultySource::new());
    let p = Arc::new(pager(64, src.clone()));
    let k = ChunkKey::new(1, 6);
    src.break_chunk(k, Misbehavior::Slow(Duration::from_millis(200)));
    let loader = {
        let p = Arc::clone(&p);
        std::thread::spawn(move || {
            let mut staging = Staging::new(SLOT).unwrap();
            p.load(k, &mut staging)
        })
    };
    // Wait until the load has claimed the chunk, then touch it.
    while p.chunk_info(k).unwrap().state != MemoryState::Populating {
        std::thread::yield_now();
    }
    assert_eq!(touch_read(&p, k, SLOT), pattern(k, SLOT));
    loader.join().unwrap().unwrap();
    p.check(k).unwrap();
    assert_eq!(
        src.reads(),
        1,
        "the fault did not read the chunk a second time"
    );
    assert_eq!(p.stats().populates, 1);
}

#[test]
fn faults_in_move_mode_serve_the_right_bytes() {
    let src = Arc::new(GatedSource::new());
    let p = Pager::new(
        PagerConfig {
            fault_via: PopulateVia::Move,
            ..PagerConfig::new(64 * PAGE as u64, SLOT)
        },
        src.clone(),
    )
    .unwrap();
    p.add_context(
        ContextId(1),
        ContextSpec {
            max_chunks: 4,
            max_slot_bytes: SLOT,
        },
    )
    .unwrap();
    assert!(p.move_supported(), "the kernel here has UFFDIO_MOVE");
    let k = |i| ChunkKey::new(1, i);
    let touch = |i| {
        assert_eq!(touch_read(&p, k(i), SLOT), pattern(k(i), SLOT), "chunk {i}");
        p.check(k(i)).unwrap();
    };
    // The fault thread warms its move buffer only once idle after a fault: the first fault
    // finds it cold and copies.
    touch(0);
    assert_eq!(p.stats().faults_moved, 0);
    // Idle, the buffer warms; the next fault moves its pages, and leaves it cold.
    wait_for_move_warmups(&p, 1);
    touch(1);
    assert_eq!(p.stats().faults_moved, 1);
    // A burst: a fault arrives while the fault thread is busy with a move; it finds the buffer
    // cold (no idle moment to warm it between the two) and falls back to copy.
    wait_for_move_warmups(&p, 2);
    src.hold();
    std::thread::scope(|s| {
        let first = s.spawn(|| touch(2));
        assert_eq!(src.wait_for_held_fill(), k(2));
        let (tid_tx, tid_rx) = mpsc::channel();
        let second = s.spawn(move || {
            tid_tx.send(thread_id()).unwrap();
            touch(3)
        });
        wait_blocked_in_fault(tid_rx.recv().unwrap());
        src.release();
        first.join().unwrap();
        second.join().unwrap();
    });
    let s = p.stats();
    assert_eq!((s.populates, s.faults_moved), (4, 2), "{s:?}");
    for i in 0..4 {
        p.reclaim(k(i)).unwrap();
    }
    assert_eq!(p.region_rss(ContextId(1)).unwrap(), 0);
}

/// Wait until the fault thread has warmed its move buffer `n` times.
fn wait_for_move_warmups(p: &Pager, n: u64) {
    while p.stats().move_warmups < n {
        std::thread::yield_now();
    }
}

/// A chooser that panics: it runs on the fault thread when a fault needs room.
struct PanickingChooser;

impl VictimChooser for PanickingChooser {
    fn choose_victims(&mut self, _need: u64, _view: &dyn ResidentView) -> Vec<ChunkKey> {
        panic!("chooser told to panic")
    }
}

#[test]
fn a_panic_on_the_fault_thread_releases_the_faulting_thread() {
    let p = Pager::with_chooser(
        PagerConfig::new(SLOT as u64, SLOT),
        Arc::new(PatternSource::new()),
        Box::new(PanickingChooser),
    )
    .unwrap();
    p.add_context(
        ContextId(1),
        ContextSpec {
            max_chunks: 2,
            max_slot_bytes: SLOT,
        },
    )
    .unwrap();
    let a = ChunkKey::new(1, 0);
    p.populate(a, SLOT, &pattern(a, SLOT)).unwrap();
    // The budget is full: the fault on `b` asks the chooser, which panics on the fault thread.
    let b = ChunkKey::new(1, 1);
    let got = touch_read(&p, b, PAGE);
    assert!(got.iter().all(|x| *x == 0));
    assert!(matches!(p.check(b), Err(PagerError::ShutDown)));
    assert!(matches!(
        p.populate(b, PAGE, &[]),
        Err(PagerError::ShutDown)
    ));
}

#[test]
fn a_kernel_mode_access_faults_through_the_pager_too() {
    // write(2) from a reclaimed chunk's slot: the kernel's copy from user memory faults, and the
    // fault thread must resolve it (the fd is not user-mode-only), or the file gets zeros.
    let p = pager(64, Arc::new(PatternSource::new()));
    let k = ChunkKey::new(2, 4);
    p.populate(k, SLOT, &pattern(k, SLOT)).unwrap();
    p.mark_persisted(k).unwrap();
    p.reclaim(k).unwrap();
    p.lock_context(ContextId(2)).unwrap();
    let (ptr, _) = p.slot_ptr(k).unwrap();
    // SAFETY: the slot lies inside the locked context's mapping, which lives as long as `p`;
    // nothing writes it while the slice is alive.
    let slot = unsafe { std::slice::from_raw_parts(ptr.as_ptr(), SLOT) };
    let path = std::env::temp_dir().join(format!("uffd-pager-kernel-{}", std::process::id()));
    std::fs::write(&path, slot).unwrap();
    let back = std::fs::read(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(back, pattern(k, SLOT));
    p.check(k).unwrap();
    assert!(p.stats().faults >= 1);
}

#[test]
fn a_context_of_zero_chunks_still_has_one() {
    let p = pager(64, Arc::new(PatternSource::new()));
    p.add_context(
        ContextId(3),
        ContextSpec {
            max_chunks: 0,
            max_slot_bytes: PAGE,
        },
    )
    .unwrap();
    let k = ChunkKey::new(3, 0);
    assert_eq!(touch_read(&p, k, PAGE), pattern(k, PAGE));
    assert!(matches!(
        p.populate(ChunkKey::new(3, 1), PAGE, &[]),
        Err(PagerError::NoChunk { .. })
    ));
}

#[test]
fn a_source_that_hangs_past_its_deadline_stops_the_pager_and_releases_the_fault() {
    let src = Arc::new(FaultySource::new());
    let p = Pager::new(
        PagerConfig {
            source_deadline: Some(Duration::from_millis(100)),
            ..PagerConfig::new(64 * PAGE as u64, SLOT)
        },
        src.clone(),
    )
    .unwrap();
    p.add_context(
        ContextId(1),
        ContextSpec {
            max_chunks: 2,
            max_slot_bytes: SLOT,
        },
    )
    .unwrap();
    let k = ChunkKey::new(1, 0);
    src.break_chunk(k, Misbehavior::Slow(Duration::from_secs(2)));
    let got = touch_read(&p, k, PAGE);
    assert!(
        got.iter().all(|b| *b == 0),
        "released with zeros, not the late bytes"
    );
    assert!(matches!(p.check(k), Err(PagerError::ShutDown)));
}

/// A source that keeps what it is given to write back, and serves only that.
#[derive(Default)]
struct KeepingSource {
    kept: parking_lot::Mutex<std::collections::HashMap<ChunkKey, Vec<u8>>>,
    writes: std::sync::atomic::AtomicU64,
}

impl ChunkSource for KeepingSource {
    fn fill(&self, key: ChunkKey, dst: &mut [u8]) -> Result<(), SourceError> {
        let kept = self.kept.lock();
        let data = kept.get(&key).ok_or(SourceError::Missing { key })?;
        dst[..data.len()].copy_from_slice(data);
        dst[data.len()..].fill(0);
        Ok(())
    }

    fn write_back(&self, key: ChunkKey, data: &[u8]) -> Result<bool, SourceError> {
        self.writes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.kept.lock().insert(key, data.to_vec());
        Ok(true)
    }

    fn writes_back(&self) -> bool {
        true
    }
}

#[test]
fn a_victim_never_written_out_is_written_back_before_it_goes_and_faults_back_whole() {
    use std::sync::atomic::Ordering::Relaxed;
    let src = Arc::new(KeepingSource::default());
    // Room for two chunks of three pages.
    let p = pager(6, src.clone());
    let (a, b, c) = (
        ChunkKey::new(1, 0),
        ChunkKey::new(1, 1),
        ChunkKey::new(2, 0),
    );
    p.populate(a, SLOT, &pattern(a, SLOT)).unwrap();
    p.populate(b, SLOT, &pattern(b, SLOT)).unwrap();
    // `a`, the oldest, is the victim and was never written: it is written back, then dropped.
    p.populate(c, SLOT, &pattern(c, SLOT)).unwrap();
    assert_eq!(p.chunk_info(a).unwrap().state, MemoryState::Reclaimed);
    let s = p.stats();
    assert_eq!((s.sync_reclaims, s.unpersisted_reclaims), (1, 0), "{s:?}");
    // A touch faults it back from what was written (making room writes `b` back the same way);
    // it counts as persisted, so reclaiming it again would write nothing.
    assert_eq!(touch_read(&p, a, SLOT), pattern(a, SLOT));
    assert!(p.chunk_info(a).unwrap().persisted);
    assert_eq!(p.stats().sync_reclaims, 2);
    // Plain `reclaim` never writes: `c` is given up.
    p.reclaim(c).unwrap();
    assert_eq!(p.stats().unpersisted_reclaims, 1);
    // `evict` writes an unwritten chunk back on demand.
    let d = ChunkKey::new(2, 1);
    p.populate(d, SLOT, &pattern(d, SLOT)).unwrap();
    assert_eq!(p.evict(d).unwrap(), SLOT as u64);
    assert_eq!(p.stats().sync_reclaims, 3);
    assert_eq!(touch_read(&p, d, SLOT), pattern(d, SLOT));
    assert_eq!(src.writes.load(Relaxed), 3);
    // `c` was never written: its fault finds nothing and asks for a recompute.
    let _ = touch_read(&p, c, PAGE);
    assert!(p.chunk_info(c).unwrap().needs_recompute);
    assert_eq!(
        src.writes.load(Relaxed),
        3,
        "a persisted victim is not written again"
    );
    p.shutdown();
}

/// Wait (at most 30 s, so a regression fails instead of hanging the suite) for `rx`'s value.
fn within<T>(rx: &mpsc::Receiver<T>, what: &str) -> T {
    rx.recv_timeout(Duration::from_secs(30))
        .unwrap_or_else(|_| panic!("{what} never finished: it waits on something it must not"))
}

#[test]
fn a_fault_does_not_wait_for_another_contexts_write_back() {
    let src = Arc::new(GatedSource::writing_back());
    // Room for three chunks of three pages; contexts 1, 2 and 3.
    let p = Arc::new(pager(9, src.clone()));
    p.add_context(
        ContextId(3),
        ContextSpec {
            max_chunks: 16,
            max_slot_bytes: SLOT,
        },
    )
    .unwrap();
    // `a` is stored and reclaimed: touching it faults it back from the source.
    let a = ChunkKey::new(1, 0);
    p.populate(a, SLOT, &pattern(a, SLOT)).unwrap();
    p.mark_persisted(a).unwrap();
    p.reclaim(a).unwrap();
    // `b` (context 2) was never written out; `x` and `y` (context 3) were.
    let (b, x, y) = (
        ChunkKey::new(2, 0),
        ChunkKey::new(3, 0),
        ChunkKey::new(3, 1),
    );
    for k in [b, x, y] {
        p.populate(k, SLOT, &pattern(k, SLOT)).unwrap();
    }
    p.mark_persisted(x).unwrap();
    p.mark_persisted(y).unwrap();
    // Context 2 swaps `b` out: its write-back blocks at the gate, as a slow disk write would.
    src.hold_writes();
    let evicting = {
        let p = Arc::clone(&p);
        std::thread::spawn(move || p.evict(b))
    };
    assert_eq!(src.wait_for_held_write(), b);
    // Context 1 faults `a` in: it needs room, which a stored chunk of context 3 gives, and it
    // resolves while `b`'s write still waits (before, the write held the pager's lock and this
    // touch hung until it ended).
    let rx = touch_in_background(&p, a);
    assert_eq!(within(&rx, "the fault on context 1"), pattern(a, SLOT));
    p.check(a).unwrap();
    assert_eq!(p.chunk_info(x).unwrap().state, MemoryState::Reclaimed);
    // `b` is still resident, counted, and being written: no one has dropped it under the write.
    assert_eq!(p.chunk_info(b).unwrap().state, MemoryState::Resident);
    assert_eq!(p.resident_bytes(), 3 * SLOT as u64);
    // Locking context 2 waits for its chunk's write to end (nothing may change the slot it
    // reads); locking context 3 does not.
    p.lock_context(ContextId(3)).unwrap();
    p.unlock_context(ContextId(3)).unwrap();
    let (tx, rx) = mpsc::channel();
    {
        let p = Arc::clone(&p);
        std::thread::spawn(move || tx.send(p.lock_context(ContextId(2))).unwrap());
    }
    while p.stats().lock_waits == 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(rx.try_recv().is_err(), "the lock waits for the write-back");
    src.release_writes();
    assert_eq!(evicting.join().unwrap().unwrap(), SLOT as u64);
    within(&rx, "locking context 2").unwrap();
    p.unlock_context(ContextId(2)).unwrap();
    let info = p.chunk_info(b).unwrap();
    assert_eq!((info.state, info.persisted), (MemoryState::Reclaimed, true));
    assert_eq!(p.stats().sync_reclaims, 1);
    // It comes back whole from what was written.
    assert_eq!(touch_read(&p, b, SLOT), pattern(b, SLOT));
    p.shutdown();
}

/// In a pager with room for two chunks: `a` (context 1) stored and reclaimed, `b` and `c`
/// (context 2) resident and never written out, so room for `a` needs one of them written first.
fn stored_one_and_two_unwritten(p: &Pager) -> (ChunkKey, ChunkKey, ChunkKey) {
    let a = ChunkKey::new(1, 0);
    p.populate(a, SLOT, &pattern(a, SLOT)).unwrap();
    p.mark_persisted(a).unwrap();
    p.reclaim(a).unwrap();
    let (b, c) = (ChunkKey::new(2, 0), ChunkKey::new(2, 1));
    p.populate(b, SLOT, &pattern(b, SLOT)).unwrap();
    p.populate(c, SLOT, &pattern(c, SLOT)).unwrap();
    (a, b, c)
}

/// Touches all of `key` on a thread of its own; its bytes arrive on the channel.
fn touch_in_background(p: &Arc<Pager>, key: ChunkKey) -> mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::channel();
    let p = Arc::clone(p);
    std::thread::spawn(move || tx.send(touch_read(&p, key, SLOT)).unwrap());
    rx
}

#[test]
fn a_fault_that_needs_a_victim_written_hands_it_to_the_write_back_thread() {
    let src = Arc::new(GatedSource::writing_back());
    // Room for two chunks.
    let p = Arc::new(pager(6, src.clone()));
    let (a, b, c) = stored_one_and_two_unwritten(&p);
    src.hold_writes();
    let rx = touch_in_background(&p, a);
    let victim = src.wait_for_held_write();
    assert_eq!(victim, b, "the least recently used victim");
    // The fault waits for its room, set aside; the fault thread is free meanwhile: a fault on a
    // chunk that needs no room (`b` itself is resident) is served at once.
    assert_eq!(touch_read(&p, c, PAGE), pattern(c, PAGE));
    src.release_writes();
    assert_eq!(within(&rx, "the fault waiting for room"), pattern(a, SLOT));
    p.check(a).unwrap();
    assert_eq!(
        src.writers(),
        ["uffd-pager-writeback"],
        "the fault thread never writes a victim itself"
    );
    let s = p.stats();
    assert_eq!(
        (s.sync_reclaims, s.faults_deferred_for_room),
        (1, 1),
        "{s:?}"
    );
    p.shutdown();
}

#[test]
fn a_write_back_that_never_returns_trips_the_watchdog_instead_of_hanging_faults() {
    let src = Arc::new(GatedSource::writing_back());
    let p = Arc::new(pager_with(
        PagerConfig {
            source_deadline: Some(Duration::from_millis(300)),
            ..PagerConfig::new(2 * SLOT as u64, SLOT)
        },
        src.clone(),
    ));
    let (a, b, _) = stored_one_and_two_unwritten(&p);
    // The write the fault's room needs never returns.
    src.hold_writes();
    let rx = touch_in_background(&p, a);
    assert_eq!(src.wait_for_held_write(), b);
    // The watchdog stops the pager: the faulting thread is released with zeros, and told why.
    let got = within(&rx, "the fault behind a hung write-back");
    assert!(got.iter().all(|&x| x == 0), "released with zeros");
    assert!(matches!(p.check(a), Err(PagerError::ShutDown)));
    assert!(matches!(
        p.lock_context(ContextId(2)),
        Err(PagerError::ShutDown)
    ));
    src.release_writes();
    p.shutdown();
}

#[test]
fn shutdown_leaves_no_thread_holding_the_source() {
    // A source may hold a store and its lock: once the pager is shut down, nothing of it (the
    // fault thread, the write-back thread, the watchdog) may keep the source alive.
    let src = Arc::new(PatternSource::new());
    for _ in 0..20 {
        let p = pager(6, src.clone());
        let k = ChunkKey::new(1, 0);
        p.populate(k, SLOT, &pattern(k, SLOT)).unwrap();
        p.shutdown();
        drop(p);
        assert_eq!(
            Arc::strong_count(&src),
            1,
            "a pager thread outlived shutdown"
        );
    }
}
