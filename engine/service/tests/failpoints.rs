//! Failure tests by failpoint, not by chance (as kvfs/tests/failpoints.rs does for the store):
//! each step of the Load and of the AoT writer, and the store's own steps under them, made to
//! fail (`return`) or to crash (`panic`) at exactly that point, then checked against a model of
//! what must survive. The failpoints are listed in docs/service.md ("Failpoints").
//!
//! The model, from a reference run of the same conversation with no failpoint (the answers, the
//! store's tokens and the bytes of every chunk it serves, after each call):
//! - a context's acknowledged tokens (those of its completed calls) survive, in the store and in
//!   the manager, whatever fails after them; a call that failed or crashed adds all its tokens or
//!   none;
//! - a failed Load returns a typed error (`internal`, naming the failpoint or the panic) and
//!   leaves the context loadable: the same call again answers as the reference does;
//! - a read that fails is recomputed, and the call answers the same;
//! - a write-out that fails or panics leaves its chunk resident and not persisted (never counted
//!   as persisted), the writer goes on, a flush returns, and the pager writes the chunk when it
//!   reclaims it;
//! - after a crash (the manager dropped and opened again on its store, which is how a restart
//!   recovers) every chunk the store serves is a whole version of that chunk, the reference's
//!   after this call or after the one before, never a torn one, and the calls go on answering
//!   as the reference does.
#![cfg(feature = "failpoints")]

mod common;
use common::{owner, prompt};
use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use model::Model;
use model::kv::KvFormat;
use model::tiny::{TinySpec, write_tiny_gguf};
use policy::{CostModel, LinearCost};
use service::{CallOptions, CallReport, LoadMode, Manager, ManagerConfig, ServiceError};
use uffd_pager::{ChunkKey, MemoryState};

/// Calls in the conversation; each after the first finds its context swapped out.
const CALLS: u32 = 3;

/// The tiny random-weight model, written once per test process (the same file for every test,
/// so every run's chunk bytes are comparable).
fn model() -> Arc<Model> {
    static MODEL: OnceLock<Arc<Model>> = OnceLock::new();
    Arc::clone(MODEL.get_or_init(|| {
        let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("service-failpoints-tiny.gguf");
        let spec = TinySpec {
            max_ctx: 1024,
            ..TinySpec::default()
        };
        write_tiny_gguf(&path, &spec).unwrap();
        Arc::new(Model::load(&path).unwrap())
    }))
}

/// How a Load brings chunks back.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Setup {
    /// Every stored chunk read, by the I/O threads (no mount).
    Read,
    /// Every stored chunk read through the kvfs mount, kept in flight on an io_uring by the
    /// engine thread itself.
    Ring,
    /// Every chunk recomputed.
    Recompute,
    /// Some read by an I/O thread while the engine thread recomputes the others (a cost model
    /// that makes a read of a chunk cost about what its recompute does).
    Mixed,
}

fn config(store: &Path, mnt: &Path, setup: Setup) -> ManagerConfig {
    let mut c = ManagerConfig::new(store, 64 << 20);
    c.kv_format = KvFormat::Int8;
    // Chunks stay int8: a chunk lost in a crash is recomputed in the format it had, so every
    // run's answers and chunk bytes are the reference's exactly.
    c.compress_bits = None;
    c.max_tokens = 1024;
    c.load = match setup {
        Setup::Read | Setup::Ring => LoadMode::ReadOnly,
        Setup::Recompute => LoadMode::RecomputeOnly,
        Setup::Mixed => LoadMode::Planned,
    };
    c.mount = (setup == Setup::Ring).then(|| mnt.join("kv"));
    if setup == Setup::Mixed {
        c.cost = CostModel::new(
            LinearCost::new(0.0, 1e-3).unwrap(),
            LinearCost::new(0.0, 1e-3 / 4096.0).unwrap(),
        );
    }
    c
}

/// What the store serves of a context: its tokens and the bytes of each chunk it serves.
#[derive(Clone, Debug, PartialEq)]
struct Stored {
    tokens: Vec<u32>,
    chunks: BTreeMap<u32, Vec<u8>>,
}

/// The reference: the conversation with no failpoint, after each call.
struct Reference {
    answers: Vec<Vec<u32>>,
    stored: Vec<Stored>,
}

/// One conversation on a store of its own.
struct Run {
    store: tempfile::TempDir,
    mnt: tempfile::TempDir,
    setup: Setup,
    m: Option<Manager>,
    id: u64,
}

impl Run {
    fn new(setup: Setup) -> Run {
        let store = tempfile::tempdir().unwrap();
        let mnt = tempfile::tempdir().unwrap();
        let mut m = Manager::open(model(), config(store.path(), mnt.path(), setup)).unwrap();
        let id = m.create(&owner(), &prompt(1, 21)).unwrap();
        Run {
            store,
            mnt,
            setup,
            m: Some(m),
            id,
        }
    }

    fn m(&mut self) -> &mut Manager {
        self.m.as_mut().expect("open")
    }

    /// Call `n` of the conversation, after swapping the context out (its chunks written first).
    fn call(&mut self, n: u32) -> Result<CallReport, ServiceError> {
        self.swap();
        let (o, id) = (owner(), self.id);
        let opts = CallOptions {
            max_tokens: 12,
            ..CallOptions::default()
        };
        self.m()
            .call(&o, id, &prompt(n + 2, 40), &opts, Instant::now(), |_| true)
    }

    /// Call `n`, which must answer as the reference does.
    fn call_ok(&mut self, n: u32, reference: &Reference) -> CallReport {
        let r = self
            .call(n)
            .unwrap_or_else(|e| panic!("call {n} of {:?}: {e}", self.setup));
        assert_eq!(r.tokens, reference.answers[n as usize], "call {n}");
        r
    }

    /// Every write done, then every chunk of the context dropped from memory.
    fn swap(&mut self) {
        let id = self.id;
        let m = self.m();
        m.flush();
        m.swap_out(&owner(), id).unwrap();
    }

    /// A crash's recovery: the manager dropped (its writer writes what it had queued) and opened
    /// again on the store.
    fn restart(&mut self) {
        drop(self.m.take());
        let cfg = config(self.store.path(), self.mnt.path(), self.setup);
        self.m = Some(Manager::open(model(), cfg).unwrap());
    }

    /// What the store serves of the context, every chunk read through the checked path.
    fn stored(&mut self) -> Stored {
        let id = kvfs::ContextId(self.id);
        let store = self.m().store();
        let mut chunks = BTreeMap::new();
        for c in store.context(id).unwrap().chunks {
            if let Ok(bytes) = store.read_chunk(id, c.index, &store.meta(id).unwrap().fingerprint) {
                chunks.insert(c.index, bytes);
            }
        }
        Stored {
            tokens: store.tokens(id).unwrap(),
            chunks,
        }
    }

    /// The manager holds the context with exactly `tokens`.
    fn holds(&mut self, tokens: &[u32]) {
        let id = self.id;
        let info = self.m().info(&owner(), id).unwrap();
        assert_eq!(info.tokens, tokens.len(), "the manager's context");
        assert_eq!(self.stored().tokens, tokens, "the store's tokens");
    }

    /// The bytes of the context's resident chunks (as long as their slots), for
    /// [`Run::serves_whole_versions`]: what the writer and the pager's write-backs copy from.
    fn resident(&mut self) -> BTreeMap<u32, Vec<u8>> {
        let ctx = uffd_pager::ContextId(self.id);
        let pager = self.m().pager();
        let lock = pager.lock(ctx).unwrap();
        (0..pager.context_chunks(ctx).unwrap())
            .filter_map(|i| Some((i, lock.chunk(i).ok()?.to_vec())))
            .collect()
    }

    /// The store serves only whole versions of the context's chunks: each chunk it serves is the
    /// reference's after call `n` or after the call before, or the bytes the chunk held in memory
    /// before the crash (`resident`). (A chunk recomputed is not always the reference's to the
    /// bit: the tokens a single-token pass computed round differently in a batch. Its bytes are
    /// still whole and checked, and they answer the same.)
    fn serves_whole_versions(
        &mut self,
        n: usize,
        reference: &Reference,
        resident: &BTreeMap<u32, Vec<u8>>,
    ) {
        let stored = self.stored();
        for (i, bytes) in &stored.chunks {
            let new = reference.stored[n].chunks.get(i);
            let old = n
                .checked_sub(1)
                .and_then(|p| reference.stored[p].chunks.get(i));
            let held = resident.get(i).and_then(|r| r.get(..bytes.len()));
            assert!(
                Some(bytes) == new || Some(bytes) == old || held == Some(&bytes[..]),
                "chunk {i} is neither its version after call {n}, nor the one before, nor the \
                 one in memory"
            );
        }
    }

    /// The state of chunk `index` in the pager.
    fn chunk(&mut self, index: u32) -> uffd_pager::ChunkInfo {
        let key = ChunkKey::new(self.id, index);
        self.m().pager().chunk_info(key).unwrap()
    }
}

/// The conversation with no failpoint: its answers and what the store serves after each call.
/// Computed once per process (the model is deterministic, so every run must match it).
fn reference() -> &'static Reference {
    static REFERENCE: OnceLock<Reference> = OnceLock::new();
    REFERENCE.get_or_init(|| {
        let mut run = Run::new(Setup::Read);
        let (mut answers, mut stored) = (Vec::new(), Vec::new());
        for n in 0..CALLS {
            answers.push(run.call(n).unwrap().tokens);
            run.m().flush();
            stored.push(run.stored());
        }
        Reference { answers, stored }
    })
}

// ---- failpoints ------------------------------------------------------------------------------

/// Configures failpoint `name` to `action` (`return` or `panic`).
fn arm(name: &str, action: &str) {
    fail::cfg(name, action).unwrap();
}

/// The message of a caught panic.
fn panic_message(e: &(dyn std::any::Any + Send)) -> String {
    e.downcast_ref::<String>()
        .cloned()
        .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

/// The error a failpoint armed with `return` injects, or a reading thread's panic, as the
/// service reports it.
fn assert_internal(e: &ServiceError, says: &str) {
    assert_eq!(e.code(), "internal", "{e}");
    assert!(e.to_string().contains(says), "{e} does not say {says}");
}

// ---- the Load --------------------------------------------------------------------------------

/// A step of the Load and the setups in which the Load reaches it.
fn load_setups(point: &str) -> &'static [Setup] {
    match point {
        "planned" | "done" => &[Setup::Read, Setup::Recompute],
        "chunk_read" | "chunk_populated" | "reads_done" => {
            &[Setup::Read, Setup::Ring, Setup::Mixed]
        }
        "recompute" => &[Setup::Recompute, Setup::Mixed],
        _ => panic!("no Load step {point}"),
    }
}

/// Whether a failure at `point` is a read's: the Load goes on and recomputes the chunk.
fn is_read(point: &str) -> bool {
    point == "chunk_read" || point == "chunk_populated"
}

/// `return` at Load step `point` of call 1: a read's failure is recomputed and the call answers
/// as the reference; any other step fails the call with the injected error, the context keeps
/// its acknowledged tokens and loads again (the same call then answers as the reference).
fn load_fails(point: &str, setup: Setup) {
    let name = format!("service::load::{point}");
    let reference = reference();
    let mut run = Run::new(setup);
    run.call_ok(0, reference);
    arm(&name, "return");
    let r = run.call(1);
    fail::remove(&name);
    if is_read(point) {
        let r = r.unwrap_or_else(|e| panic!("{setup:?}: {e}"));
        assert_eq!(r.tokens, reference.answers[1]);
        assert!(!r.load.failed_reads.is_empty(), "{setup:?}: {:?}", r.load);
        assert!(r.load.read.is_empty(), "every read failed: {:?}", r.load);
        for i in &r.load.failed_reads {
            assert!(r.load.recomputed.contains(i), "{:?}", r.load);
        }
    } else {
        assert_internal(&r.unwrap_err(), &name);
        run.holds(&reference.stored[0].tokens);
        run.call_ok(1, reference);
    }
    run.call_ok(2, reference);
    run.restart();
    run.holds(&reference.stored[2].tokens);
}

/// `panic` at Load step `point` of call 1. On a reading thread the panic is caught and the Load
/// fails with a typed error; on the engine thread it kills the call, and the manager is dropped
/// and opened again as after a crash. Either way the context keeps its acknowledged tokens and
/// its calls go on as the reference's.
fn load_crashes(point: &str, setup: Setup) {
    let name = format!("service::load::{point}");
    let reference = reference();
    let mut run = Run::new(setup);
    run.call_ok(0, reference);
    arm(&name, "panic");
    let r = catch_unwind(AssertUnwindSafe(|| run.call(1)));
    fail::remove(&name);
    match r {
        Ok(Err(e)) if is_read(point) => {
            assert_internal(&e, "panicked");
            run.holds(&reference.stored[0].tokens);
        }
        Err(panic) if !is_read(point) => {
            let msg = panic_message(&*panic);
            assert!(msg.contains(&name), "crashed elsewhere: {msg}");
        }
        Err(panic) => panic!("{setup:?}: the reading thread's panic escaped the Load: {panic:?}"),
        Ok(r) => panic!("{setup:?}: the failpoint did not crash the Load: {r:?}"),
    }
    run.restart();
    run.holds(&reference.stored[0].tokens);
    run.serves_whole_versions(0, reference, &BTreeMap::new());
    run.call_ok(1, reference);
    run.call_ok(2, reference);
}

// ---- the AoT writer --------------------------------------------------------------------------

/// The chunks call 0 leaves sealed (73 tokens: 4 chunks of 16).
const SEALED: u32 = 4;

/// `return` at writer step `point` during call 0's write-out: every write fails, the flush
/// returns, each chunk stays resident and not persisted (in the store or not, as the step says),
/// and the swap-out writes them before dropping them, so call 1 reads them all back.
fn write_fails(point: &str) {
    let name = format!("service::writer::{point}");
    let reference = reference();
    let mut run = Run::new(Setup::Read);
    arm(&name, "return");
    let r = run.call_ok(0, reference);
    run.m().flush();
    fail::remove(&name);
    let s = run.m().stats();
    assert_eq!(r.queued_writes, SEALED as usize);
    assert_eq!(
        (s.writes, s.write_failures),
        (0, u64::from(SEALED)),
        "{s:?}"
    );
    for i in 0..SEALED {
        let c = run.chunk(i);
        assert!(
            c.state == MemoryState::Resident && !c.persisted,
            "chunk {i}: {c:?}"
        );
    }
    let stored = run.stored();
    assert_eq!(stored.tokens, reference.stored[0].tokens);
    if point == "write" {
        assert!(stored.chunks.is_empty(), "a failed write stored a chunk");
    } else {
        assert_eq!(stored, reference.stored[0]);
    }
    run.swap();
    assert!(run.m().stats().sync_reclaims >= u64::from(SEALED));
    assert_eq!(run.stored(), reference.stored[0]);
    let r = run.call_ok(1, reference);
    assert_eq!(r.load.read.len(), SEALED as usize, "{:?}", r.load);
    assert!(r.load.failed_reads.is_empty(), "{:?}", r.load);
    run.call_ok(2, reference);
}

/// `panic` at writer step `point` during call 0's write-out: the writer catches it and goes on
/// (the flush returns), the chunk is persisted only if it was marked before the panic, and after
/// a restart the store serves whole chunks and the calls go on as the reference's.
fn write_crashes(point: &str) {
    let name = format!("service::writer::{point}");
    let reference = reference();
    let mut run = Run::new(Setup::Read);
    arm(&name, "panic");
    run.call_ok(0, reference);
    run.m().flush();
    fail::remove(&name);
    let s = run.m().stats();
    assert_eq!(s.write_failures, u64::from(SEALED), "{s:?}");
    let marked = point == "marked";
    for i in 0..SEALED {
        let c = run.chunk(i);
        assert_eq!(c.persisted, marked, "chunk {i}: {c:?}");
    }
    let stored = run.stored();
    assert_eq!(stored.tokens, reference.stored[0].tokens);
    if point == "write" {
        assert!(stored.chunks.is_empty());
    } else {
        assert_eq!(stored, reference.stored[0]);
    }
    let resident = run.resident();
    run.restart();
    run.holds(&reference.stored[0].tokens);
    run.serves_whole_versions(0, reference, &resident);
    run.call_ok(1, reference);
    run.call_ok(2, reference);
}

/// The writer killed (`panic`) at kvfs's chunk step `step` of every chunk write of call 1, then a
/// restart: kvfs's recovery leaves each chunk its version after call 0 or after call 1 (or none:
/// it is recomputed), never torn, and the calls go on as the reference's. Call 1's reads all
/// fail (`service::load::chunk_read`), so it writes chunks 0-3 again over their stored copies
/// (a rewrite, which alone reaches `old_punched`) besides its new chunks 4-6.
fn aot_crashes_in_the_store(step: &str) {
    let name = format!("kvfs::chunk::{step}");
    let reads = "service::load::chunk_read";
    let reference = reference();
    let mut run = Run::new(Setup::Read);
    run.call_ok(0, reference);
    run.m().flush();
    arm(&name, "panic");
    arm(reads, "return");
    let r = run.call_ok(1, reference);
    run.m().flush();
    fail::remove(&name);
    fail::remove(reads);
    assert_eq!(r.load.failed_reads, [0, 1, 2, 3], "{:?}", r.load);
    assert_eq!(r.queued_writes, 7);
    // Every write reaches each step, but a first write has no old copy to punch.
    let reached = if step == "old_punched" { 4 } else { 7 };
    assert_eq!(
        run.m().stats().write_failures,
        reached,
        "writes that reached {name}"
    );
    let resident = run.resident();
    run.restart();
    run.holds(&reference.stored[1].tokens);
    run.serves_whole_versions(1, reference, &resident);
    run.call_ok(2, reference);
    run.restart();
    run.holds(&reference.stored[2].tokens);
}

/// The call's tokens, appended to the store before its chunks are queued, cut at kvfs's replace
/// step `step` of call 1 by `action`. `return`: the call fails with the store's error and the
/// context is its last completed call, whose retry answers as the reference's. `panic`: the
/// engine thread dies, and after a restart the context is call 0's tokens or call 1's whole
/// (its tokens were durable from the rename on: the call completed, its reply was lost), never
/// a part; the conversation goes on from there.
fn tokens_replace(step: &str, action: &str) {
    let name = format!("kvfs::replace::tokens::{step}");
    let reference = reference();
    let mut run = Run::new(Setup::Read);
    run.call_ok(0, reference);
    arm(&name, action);
    let r = catch_unwind(AssertUnwindSafe(|| run.call(1)));
    fail::remove(&name);
    match (action, r) {
        ("return", Ok(Err(e))) => {
            assert_eq!(e.code(), "store", "{e}");
            assert!(e.to_string().contains(&name), "{e}");
            run.holds(&reference.stored[0].tokens);
        }
        ("panic", Err(panic)) => {
            let msg = panic_message(&*panic);
            assert!(msg.contains(&name), "crashed elsewhere: {msg}");
        }
        (_, r) => panic!("{action} at {name} gave {r:?}"),
    }
    run.restart();
    let tokens = run.stored().tokens;
    let renamed = step == "renamed" || step == "dir_synced";
    let next = if renamed {
        assert_eq!(
            tokens, reference.stored[1].tokens,
            "the rename made them durable"
        );
        2
    } else {
        assert_eq!(tokens, reference.stored[0].tokens);
        1
    };
    run.holds(&tokens);
    for n in next..CALLS {
        run.call_ok(n, reference);
    }
}

// ---- the tests: one per failpoint ------------------------------------------------------------

/// Each failpoint's test holds the `fail` crate's scenario lock: the registry is process-wide, so
/// tests that arm failpoints run one at a time.
fn scenario(f: impl FnOnce()) {
    let s = fail::FailScenario::setup();
    f();
    s.teardown();
}

macro_rules! load_tests {
    ($($test:ident: $point:expr;)*) => {$(
        #[test]
        fn $test() {
            scenario(|| {
                for &setup in load_setups($point) {
                    load_fails($point, setup);
                    load_crashes($point, setup);
                }
            });
        }
    )*};
}

load_tests! {
    load_planned: "planned";
    load_chunk_read: "chunk_read";
    load_chunk_populated: "chunk_populated";
    load_recompute: "recompute";
    load_reads_done: "reads_done";
    load_done: "done";
}

macro_rules! writer_tests {
    ($($test:ident: $point:expr;)*) => {$(
        #[test]
        fn $test() {
            scenario(|| {
                write_fails($point);
                write_crashes($point);
            });
        }
    )*};
}

writer_tests! {
    writer_write: "write";
    writer_written: "written";
}

#[test]
fn writer_marked() {
    scenario(|| write_crashes("marked"));
}

macro_rules! store_tests {
    ($($test:ident: $step:expr;)*) => {$(
        #[test]
        fn $test() {
            scenario(|| aot_crashes_in_the_store($step));
        }
    )*};
}

store_tests! {
    aot_chunk_payload_written: "payload_written";
    aot_chunk_payload_synced: "payload_synced";
    aot_chunk_header_written: "header_written";
    aot_chunk_header_synced: "header_synced";
    aot_chunk_old_punched: "old_punched";
}

macro_rules! tokens_tests {
    ($($test:ident: $step:expr;)*) => {$(
        #[test]
        fn $test() {
            scenario(|| {
                tokens_replace($step, "return");
                tokens_replace($step, "panic");
            });
        }
    )*};
}

tokens_tests! {
    call_tokens_written: "written";
    call_tokens_synced: "synced";
    call_tokens_renamed: "renamed";
    call_tokens_dir_synced: "dir_synced";
}

/// The setups do what the tests rely on: with no failpoint, `Mixed` reads some chunks while it
/// recomputes others, `Ring` reads through the mount on an io_uring, and every setup answers as
/// the reference.
#[test]
fn the_setups_load_as_the_tests_assume() {
    scenario(|| {
        let reference = reference();
        for setup in [Setup::Read, Setup::Ring, Setup::Recompute, Setup::Mixed] {
            let mut run = Run::new(setup);
            run.call_ok(0, reference);
            let r = run.call_ok(1, reference);
            let (read, recomputed) = (r.load.read.len(), r.load.recomputed.len());
            match setup {
                Setup::Read | Setup::Ring => assert_eq!(recomputed, 0, "{:?}", r.load),
                Setup::Recompute => assert_eq!(read, 0, "{:?}", r.load),
                Setup::Mixed => assert!(read > 0 && recomputed > 0, "{:?}", r.load),
            }
            if setup == Setup::Ring {
                assert!(
                    run.m().stats().load_io_uring,
                    "the mount's Load has no io_uring"
                );
            }
            run.call_ok(2, reference);
        }
    });
}
