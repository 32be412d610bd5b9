//! A shuttle model of the daemon's fair queue (`daemon::queue::FairQueue`, generic over its
//! primitives and run here with shuttle's, whose scheduler interleaves the threads at every lock,
//! wait and notification; a run where every thread waits is a deadlock, which shuttle fails).
//! docs/service.md ("Models") lists the models; the queue's order is checked against a naive
//! oracle by the proptest in `queue.rs`.
//!
//! `the_fair_queue_loses_nothing_keeps_each_apps_order_and_ends_on_close`: capacity 2; two
//! connections push three calls each (apps 0 and 1), a control request and an idle one (a prewarm), the engine thread
//! pops until the queue closes, and the daemon's drain closes it meanwhile. Checks: every item
//! accepted comes out exactly once, popped or handed back by `close`; a refused one (busy or
//! closed) never does; each app's calls come out in the order they went in; the engine thread's
//! `pop` ends once the queue is closed; nothing deadlocks.

use std::sync::Arc;

use daemon::queue::{FairQueue, Lane, Refused};
use service::sync::Shuttle;
use shuttle::thread;

/// Interleavings tried: well under a second in a debug build.
const ITERATIONS: usize = 2000;

#[test]
fn the_fair_queue_loses_nothing_keeps_each_apps_order_and_ends_on_close() {
    shuttle::check_random(
        || {
            let queue = Arc::new(FairQueue::<u8, (u8, u32), Shuttle>::new(2));
            let connection = |app: u8| {
                let queue = Arc::clone(&queue);
                thread::spawn(move || {
                    let mut accepted = Vec::new();
                    for n in 0..3 {
                        match queue.push(Lane::Call(app), (app, n)) {
                            Ok(()) => accepted.push((app, n)),
                            Err((item, why)) => {
                                assert_eq!(item, (app, n));
                                assert!(matches!(why, Refused::Busy | Refused::Closed));
                            }
                        }
                    }
                    if queue.push(Lane::Control, (9, u32::from(app))).is_ok() {
                        accepted.push((9, u32::from(app)));
                    }
                    if queue.push(Lane::Idle(app), (4 + app, 0)).is_ok() {
                        accepted.push((4 + app, 0));
                    }
                    accepted
                })
            };
            let (a, b) = (connection(0), connection(1));
            let engine = {
                let queue = Arc::clone(&queue);
                thread::spawn(move || std::iter::from_fn(|| queue.pop()).collect::<Vec<_>>())
            };
            let drain = {
                let queue = Arc::clone(&queue);
                thread::spawn(move || queue.close())
            };
            let mut accepted = a.join().unwrap();
            accepted.extend(b.join().unwrap());
            let left = drain.join().unwrap();
            let popped = engine.join().unwrap();
            let mut out: Vec<(u8, u32)> = popped.iter().chain(&left).copied().collect();
            for app in 0..2 {
                let order: Vec<u32> = out
                    .iter()
                    .filter(|(a, _)| *a == app)
                    .map(|&(_, n)| n)
                    .collect();
                assert!(
                    order.is_sorted(),
                    "app {app}'s calls out of order: {order:?}"
                );
            }
            out.sort_unstable();
            accepted.sort_unstable();
            assert_eq!(out, accepted, "what came out is not what went in");
            assert!(queue.is_empty());
        },
        ITERATIONS,
    );
}
