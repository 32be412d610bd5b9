//! Shuttle models of the service's hand-made synchronisation (as tokio checks its own with loom):
//! the code under test is the production code, generic over its primitives
//! (`service::sync::Primitives`) and run here with shuttle's, whose scheduler interleaves the
//! threads at every lock, wait and notification, differently in each iteration. A run where every
//! thread waits is a deadlock, which shuttle fails. docs/service.md ("Models") lists the models.
//!
//! - `the_writers_flush_waits_for_every_earlier_write_and_never_deadlocks`: the AoT writer's
//!   queue (`WriteQueue`, the core of `writer::Writer`), capacity 1, its worker writing into a
//!   list; one thread submits three jobs and flushes, another submits three, a third shuts the
//!   queue down (close, then flush) meanwhile. Checks: a flush returns only once every job its
//!   thread had queued is written; every job the queue accepted is written exactly once and each
//!   thread's in the order it queued them; a job refused because the queue closed is never
//!   written; the worker ends; nothing deadlocks.
//! - `a_write_out_of_an_old_version_never_marks_the_new_bytes_persisted`: the chunks' versions in
//!   their book (`chunks::ChunkBook`) between the writer, which writes the copy it took at version v and marks
//!   the chunk persisted through `if_current(v)`, and the engine, which changes the chunk meanwhile
//!   through `change` (new bytes, left unpersisted, as `Pager::write` and `Pager::populate` leave
//!   them), with stand-ins for the pager's slot and the store. Checks: once both are done, a chunk
//!   marked persisted holds exactly the bytes the store holds. A control runs the same model with
//!   the version bumped after the bytes change instead of before, and the model must catch it.

use std::sync::Arc;

use service::chunks::ChunkBook;
use service::sync::Shuttle;
use service::write_queue::WriteQueue;
use shuttle::scheduler::RandomScheduler;
use shuttle::sync::Mutex;
use shuttle::{Config, Runner, thread};
use uffd_pager::ChunkKey;

/// Interleavings tried per model: each takes well under a second in a debug build.
const ITERATIONS: usize = 2000;

#[test]
fn the_writers_flush_waits_for_every_earlier_write_and_never_deadlocks() {
    shuttle::check_random(
        || {
            let queue = Arc::new(WriteQueue::<(u8, u32), Shuttle>::new(1));
            let written = Arc::new(Mutex::new(Vec::new()));
            let worker = {
                let (queue, written) = (Arc::clone(&queue), Arc::clone(&written));
                thread::spawn(move || {
                    queue.serve(
                        |job| written.lock().unwrap().push(job),
                        || panic!("no write panics in this model"),
                    )
                })
            };
            let submitter = |who: u8, flush: bool| {
                let (queue, written) = (Arc::clone(&queue), Arc::clone(&written));
                thread::spawn(move || {
                    let accepted: Vec<u32> =
                        (0..3).filter(|&n| queue.submit((who, n)).is_ok()).collect();
                    if flush {
                        queue.flush();
                        let w = written.lock().unwrap();
                        for n in &accepted {
                            assert!(w.contains(&(who, *n)), "flush returned before job {n}");
                        }
                    }
                    accepted
                })
            };
            let first = submitter(0, true);
            let second = submitter(1, false);
            let shutdown = {
                let (queue, written) = (Arc::clone(&queue), Arc::clone(&written));
                thread::spawn(move || {
                    queue.close();
                    queue.flush();
                    written.lock().unwrap().len()
                })
            };
            let accepted = [first.join().unwrap(), second.join().unwrap()];
            let flushed = shutdown.join().unwrap();
            worker.join().unwrap();
            let written = written.lock().unwrap();
            assert!(flushed <= written.len());
            for (who, accepted) in accepted.iter().enumerate() {
                let theirs: Vec<u32> = written
                    .iter()
                    .filter(|(w, _)| usize::from(*w) == who)
                    .map(|&(_, n)| n)
                    .collect();
                assert_eq!(&theirs, accepted, "thread {who}'s jobs as written");
            }
            assert_eq!(queue.pending(), 0);
        },
        ITERATIONS,
    );
}

/// A stand-in for a chunk's slot in the pager: its bytes (a number) and whether it is marked
/// persisted.
#[derive(Default)]
struct Slot {
    bytes: u32,
    persisted: bool,
}

/// One run of the versions model; `bump_first` is the protocol of `ChunkBook::change` (the
/// version bumped before the bytes change), false the broken one the control checks.
fn versions_model(bump_first: bool) {
    let versions = Arc::new(ChunkBook::<Shuttle>::default());
    let key = ChunkKey::new(1, 0);
    let slot = Arc::new(Mutex::new(Slot::default()));
    let store = Arc::new(Mutex::new(None::<u32>));
    // A call stored the chunk (version 1), and its write-out took a copy at the call's end.
    versions.change(key, || slot.lock().unwrap().bytes = 1);
    let (copy, version) = (slot.lock().unwrap().bytes, versions.version(key));
    let writer = {
        let (versions, slot, store) =
            (Arc::clone(&versions), Arc::clone(&slot), Arc::clone(&store));
        thread::spawn(move || {
            *store.lock().unwrap() = Some(copy);
            versions.if_current(key, version, || slot.lock().unwrap().persisted = true);
        })
    };
    let engine = {
        let (versions, slot) = (Arc::clone(&versions), Arc::clone(&slot));
        thread::spawn(move || {
            // The next call changes the chunk (a recompute or a recompress in place).
            let write = || {
                let mut s = slot.lock().unwrap();
                s.bytes = 2;
                s.persisted = false;
            };
            if bump_first {
                versions.change(key, write);
            } else {
                write();
                versions.change(key, || ());
            }
        })
    };
    writer.join().unwrap();
    engine.join().unwrap();
    let s = slot.lock().unwrap();
    if s.persisted {
        assert_eq!(
            *store.lock().unwrap(),
            Some(s.bytes),
            "marked persisted with bytes the store does not hold"
        );
    }
}

#[test]
fn a_write_out_of_an_old_version_never_marks_the_new_bytes_persisted() {
    shuttle::check_random(|| versions_model(true), ITERATIONS);
    // The control, with a fixed seed so that it is the same every run: the version bumped after
    // the bytes change lets the writer mark the new bytes persisted, and the model finds it.
    let broken = std::panic::catch_unwind(|| {
        let scheduler = RandomScheduler::new_from_seed(7, ITERATIONS);
        Runner::new(scheduler, Config::new()).run(|| versions_model(false));
    });
    assert!(
        broken.is_err(),
        "the model did not catch a bump after the change"
    );
}
