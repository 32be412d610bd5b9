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

/// Runs products until `hot_workers() == n` (at most five seconds); returns the count.
fn products_until(n: usize) -> usize {
    let t = Instant::now();
    while hot_workers() != n && t.elapsed() < Duration::from_secs(5) {
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

#[test]
fn a_pass_keeps_the_other_workers_polling_until_it_ends_or_idles() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    assert_eq!(hot_workers(), 0);
    // Started from outside the pool, as the daemon's engine thread does.
    let during = pool.install(|| on_pool(|| products_until(1)));
    assert_eq!(during, 1, "the other worker polls during the pass");
    assert_eq!(idle_until_none(), 0, "the poll ends with the pass");

    // A pass that fails lets its workers go too.
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        pool.install(|| {
            on_pool(|| {
                assert_eq!(products_until(1), 1);
                panic!("a pass fails");
            })
        })
    }));
    assert!(r.is_err());
    assert_eq!(idle_until_none(), 0, "the poll ends with a failed pass");
    // And the thread it failed on starts polls again (each pass lands on either thread).
    for _ in 0..6 {
        let during = pool.install(|| on_pool(|| products_until(1)));
        assert_eq!(
            during, 1,
            "a pass after a failed one keeps the other worker polling"
        );
    }

    // A long serial stretch inside a pass: the poll gives up after its idle limit.
    pool.install(|| {
        on_pool(|| {
            assert_eq!(products_until(1), 1, "the other worker polls");
            assert_eq!(idle_until_none(), 0, "an idle poll ends within the pass");
        })
    });
}
