//! `sys::release_free_heap` against the real C allocator: memory freed in the middle of a heap
//! (a live block above it, so `free` itself cannot give it back) stays resident until the call,
//! and leaves after it.

/// This process's resident anonymous memory, in bytes (`RssAnon` of /proc/self/status).
fn rss_anon() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kib << 10
}

#[test]
fn freed_heap_memory_leaves_only_when_released() {
    const BLOCK: usize = 16 << 10;
    const BLOCKS: usize = 4096; // 64 MiB, in blocks below any mmap threshold
    let mut blocks: Vec<Vec<u8>> = (0..BLOCKS).map(|i| vec![i as u8 | 1; BLOCK]).collect();
    // A live block above the others keeps the heap's top in use.
    let top = vec![7u8; BLOCK];
    let before = rss_anon();
    blocks.clear();
    blocks.shrink_to_fit();
    let freed = rss_anon();
    uffd_pager::sys::release_free_heap();
    let released = rss_anon();
    assert_eq!(top[BLOCK - 1], 7);
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    assert!(
        before.saturating_sub(freed) < 16 << 20,
        "free alone gave back {:.1} MiB: the test no longer holds the memory in the heap",
        mib(before.saturating_sub(freed))
    );
    assert!(
        freed.saturating_sub(released) >= 48 << 20,
        "release gave back only {:.1} MiB of the 64 freed ({:.1} MiB resident before, {:.1} after)",
        mib(freed.saturating_sub(released)),
        mib(freed),
        mib(released)
    );
}
