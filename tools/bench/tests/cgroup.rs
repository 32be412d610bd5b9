//! A cgroup v1 memory group this process joins for a while (`cgroup::Joined`, what `llms bench
//! load` runs in): it counts what the process allocates inside, and dropping it moves the process
//! home and removes the group. Alone in its test binary, since it moves the whole process.

use bench::cgroup::{Joined, own_group};

#[test]
fn a_joined_memory_group_counts_what_this_process_allocates_and_goes_when_dropped() {
    let home = own_group("memory").unwrap();
    let name = format!("llms-test-joined-{}", std::process::id());
    let joined = Joined::enter("memory", &name).unwrap();
    let dir = joined.group().path().to_owned();
    assert_eq!(own_group("memory").unwrap(), dir);
    joined.group().reset_peak().unwrap();
    let before = joined.group().peak_memory().unwrap();
    // 64 MiB written page by page: charged to the group while this process is in it.
    let v = std::hint::black_box(vec![1u8; 64 << 20]);
    let peak = joined.group().peak_memory().unwrap();
    drop(v);
    assert!(peak >= before + (48 << 20), "peak {peak}, before {before}");
    drop(joined);
    assert_eq!(own_group("memory").unwrap(), home);
    assert!(!dir.exists(), "{} is left", dir.display());
}
