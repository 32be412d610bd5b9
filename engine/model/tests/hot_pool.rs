//! `forward::on_pool` keeps the pool's other workers polling for a pass's work while the pass
//! runs, and lets them go when it ends, also when it fails or waits alone (a worker left
//! polling would burn a core in an idle daemon). Its own test binary, one test: the count of
//! polling workers is process-wide.

use model::forward::{hot_workers, on_pool};
use rayon::prelude::*;
use std::time::{Duration, Instant};

/// One loop as a decode step's product runs it: two tasks, one per thread.
fn product() -> u64 {
    let mut v = vec![0u64; 2 * 2048];
    v.par_chunks_mut(2048).for_each(|c| {
        for (j, x) in c.iter_mut().enumerate() {
            *x = (j as u64).wrapping_mul(2_654_435_761);
        }
    });
    v.iter().fold(0, |a, &x| a ^ x)
}

/// Runs products until `hot_workers() == n` (at most a second); returns the count.
fn products_until(n: usize) -> usize {
    let t = Instant::now();
    while hot_workers() != n && t.elapsed() < Duration::from_secs(1) {
        product();
    }
    hot_workers()
}

/// Waits up to five seconds, without work, for `hot_workers() == 0`; returns the count.
fn idle_until_none() -> usize {
    let t = Instant::now();
    while hot_workers() != 0 && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_micros(50));
    }
    hot_workers()
}

/// Runs passes on `pool` until one sees the other worker poll, at most ten, and `then` inside
/// the one that did; returns what `then` returned there (`None`: no pass saw a poll). A single pass can miss the poll
/// without anything being wrong: on two cores the pass's own thread can be preempted for longer
/// than the poll's idle limit, and the idle worker then stops polling, as it should (one pass
/// in 20-40 did so on a 2-core VM).
fn until_seen<R: Send>(pool: &rayon::ThreadPool, then: impl Fn() -> R + Sync) -> Option<R> {
    (0..10).find_map(|_| pool.install(|| on_pool(|| (products_until(1) == 1).then(&then))))
}

#[test]
fn a_pass_keeps_the_other_workers_polling_until_it_ends_or_idles() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    assert_eq!(hot_workers(), 0);
    // Started from outside the pool, as the daemon's engine thread does.
    let during = until_seen(&pool, || ());
    assert!(during.is_some(), "the other worker polls during the pass");
    assert_eq!(idle_until_none(), 0, "the poll ends with the pass");

    // A pass that fails lets its workers go too.
    let failed = (0..10).any(|_| {
        let seen = std::sync::atomic::AtomicBool::new(false);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.install(|| {
                on_pool(|| {
                    let polled = products_until(1) == 1;
                    seen.store(polled, std::sync::atomic::Ordering::Release);
                    panic!("a pass fails");
                })
            })
        }));
        assert!(r.is_err());
        assert_eq!(idle_until_none(), 0, "the poll ends with a failed pass");
        seen.load(std::sync::atomic::Ordering::Acquire)
    });
    assert!(failed, "the other worker polls during a pass that fails");
    // And the thread it failed on starts polls again (each pass lands on either thread).
    for _ in 0..6 {
        assert!(
            until_seen(&pool, || ()).is_some(),
            "a pass after a failed one keeps the other worker polling"
        );
    }

    // A long serial stretch inside a pass: the poll gives up after its idle limit.
    let ended = until_seen(&pool, idle_until_none);
    assert_eq!(ended, Some(0), "an idle poll ends within the pass");
}
