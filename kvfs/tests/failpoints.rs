//! Failure tests by failpoint, not by chance (after sled's `tests/test_tree_failpoints.rs`): every
//! step of a chunk write and of a `tokens` or `meta` replace made to fail (`return`) or to crash
//! the writer right after it (`panic`, caught, the store dropped and reopened from disk as after a
//! kill), then checked against a model of what must survive. The failpoints are listed in
//! docs/kvfs.md ("Failpoints").
#![cfg(feature = "failpoints")]

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;

use kvfs::format::HEADER_LEN;
use kvfs::{
    ContextId, Fingerprint, KvFormat, NewContext, Store, StoreError, StoreOptions, StoreState,
    slot_offset,
};

const FP: Fingerprint = Fingerprint([7; 32]);
const CHUNK_TOKENS: u32 = 16;

/// What a store holds, as its API shows it: per context, its tokens and the bytes of each chunk
/// it serves (a chunk it does not serve, missing or set aside, is for the caller to recompute).
type Model = BTreeMap<ContextId, (Vec<u32>, BTreeMap<u32, Vec<u8>>)>;

/// One recovery action at open: (action, a word of its reason, the end of its path).
type Action = (&'static str, &'static str, String);

fn options() -> StoreOptions {
    StoreOptions {
        verify_on_open: true,
        ..StoreOptions::default()
    }
}

fn open(dir: &Path) -> Store {
    Store::open(dir, options()).unwrap()
}

fn new_ctx(store: &Store, tokens: &[u32]) -> ContextId {
    let id = store
        .create_context(NewContext {
            owner_uid: 1000,
            app: "chat".into(),
            fingerprint: FP,
            chunk_tokens: CHUNK_TOKENS,
        })
        .unwrap();
    store.append_tokens(id, tokens).unwrap();
    id
}

/// `len` bytes from `seed`; `skew` makes them compressible (stored zstd), else they are noise
/// (stored raw).
fn bytes(seed: u32, len: usize, skew: bool) -> Vec<u8> {
    let mut x = seed.wrapping_mul(2654435761).wrapping_add(1);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            if skew { (x % 5) as u8 } else { x as u8 }
        })
        .collect()
}

/// Everything the store serves, every chunk read back through the checked path.
fn model_of(store: &Store) -> Model {
    let mut model = Model::new();
    for id in store.list_contexts() {
        let info = store.context(id).unwrap();
        let mut chunks = BTreeMap::new();
        for c in &info.chunks {
            let read = store.read_chunk(id, c.index, &FP);
            match (&c.state, read) {
                (StoreState::Stored(_), Ok(b)) => {
                    chunks.insert(c.index, b);
                }
                (StoreState::Missing | StoreState::Quarantined { .. }, Err(e))
                    if e.needs_recompute() => {}
                (state, read) => panic!("chunk {} is {state:?} but reads {read:?}", c.index),
            }
        }
        model.insert(id, (store.tokens(id).unwrap(), chunks));
    }
    model
}

/// What recovery did at open, in a comparable form.
fn actions(store: &Store) -> Vec<(String, String, String)> {
    store
        .recovered()
        .iter()
        .map(|r| {
            (
                r.action.to_owned(),
                r.reason.clone(),
                r.path.display().to_string(),
            )
        })
        .collect()
}

/// Reopens the store at `dir` as after a kill and checks it against `expected`: recovery did
/// exactly `recovery` (nothing else removed, nothing else quarantined), and a second reopen finds
/// the same state with nothing left to recover. Returns the store, open.
fn reopen_and_check(dir: &Path, expected: &Model, recovery: &[Action]) -> Store {
    let store = open(dir);
    let did = actions(&store);
    assert_eq!(did.len(), recovery.len(), "recovery did {did:?}");
    for (action, why, path) in recovery {
        assert!(
            did.iter()
                .any(|(a, r, p)| a == action && r.contains(why) && p.ends_with(path.as_str())),
            "recovery did {did:?}, not {action} {why} {path}"
        );
    }
    let quarantined = did.iter().filter(|(a, ..)| a == "quarantined").count();
    let kept = std::fs::read_dir(dir.join("quarantine")).unwrap().count();
    assert_eq!(
        kept, quarantined,
        "quarantine/ holds more than recovery set aside"
    );
    assert_eq!(&model_of(&store), expected);
    drop(store);
    let again = open(dir);
    assert_eq!(
        actions(&again),
        Vec::new(),
        "a second reopen recovered more"
    );
    assert_eq!(&model_of(&again), expected, "a second reopen differs");
    again
}

/// Configures failpoint `name` to `action` (`return` or `panic`).
fn arm(name: &str, action: &str) {
    fail::cfg(name, action).unwrap();
}

/// Runs `f` as a writer that the failpoint armed with `panic` kills: the panic is caught, and the
/// failpoint disarmed so that nothing after the crash trips on it.
fn crash<R: std::fmt::Debug>(name: &str, f: impl FnOnce() -> R) {
    let res = catch_unwind(AssertUnwindSafe(f));
    fail::remove(name);
    let e = res.expect_err("the failpoint did not crash the writer");
    let msg = e
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default();
    assert!(msg.contains(name), "crashed elsewhere: {msg}");
}

/// The error a failpoint armed with `return` injects.
fn assert_injected<T: std::fmt::Debug>(res: Result<T, StoreError>, name: &str) {
    match res {
        Err(StoreError::Io(e)) => assert!(e.to_string().contains(name), "{e}"),
        other => panic!("expected the error of {name}, got {other:?}"),
    }
}

// ---- chunk writes ----------------------------------------------------------------------------

/// A step of a chunk write, in the order `Store::write_chunk` takes them.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Step {
    PayloadWritten,
    PayloadSynced,
    HeaderWritten,
    HeaderSynced,
    OldPunched,
}

impl Step {
    fn name(self) -> &'static str {
        match self {
            Step::PayloadWritten => "kvfs::chunk::payload_written",
            Step::PayloadSynced => "kvfs::chunk::payload_synced",
            Step::HeaderWritten => "kvfs::chunk::header_written",
            Step::HeaderSynced => "kvfs::chunk::header_synced",
            Step::OldPunched => "kvfs::chunk::old_punched",
        }
    }
}

/// A chunk write to cut: which chunk, the versions it had (its current copy is in slot
/// `versions.len() % 2` when it has one) and the new one.
struct Case {
    index: u32,
    versions: Vec<Vec<u8>>,
    new: Vec<u8>,
}

/// The three cases every chunk failpoint is cut in: a first write (raw), a rewrite from copy 0
/// into copy 1 (zstd), and one from copy 1 into copy 0 (raw to zstd).
fn cases(seed: u32) -> Vec<Case> {
    vec![
        Case {
            index: 0,
            versions: vec![],
            new: bytes(seed, 9000, false),
        },
        Case {
            index: 1,
            versions: vec![bytes(seed + 1, 12000, true)],
            new: bytes(seed + 2, 20000, true),
        },
        Case {
            index: 2,
            versions: vec![bytes(seed + 3, 5000, true), bytes(seed + 4, 7000, false)],
            new: bytes(seed + 5, 6000, true),
        },
    ]
}

/// A store with one context of 64 tokens, chunk 3 stored (never touched by the cases) and each
/// case's previous versions written. Returns the context and the model before the cut write.
fn chunk_store(store: &Store, cases: &[Case], seed: u32) -> (ContextId, Model) {
    let tokens: Vec<u32> = (0..64).map(|t| t * 3 + seed).collect();
    let id = new_ctx(store, &tokens);
    let bystander = bytes(seed + 9, 3000, true);
    store
        .write_chunk(id, 3, &FP, KvFormat::Int4, 0.5, &bystander)
        .unwrap();
    for c in cases {
        for v in &c.versions {
            store
                .write_chunk(id, c.index, &FP, KvFormat::Int8, 0.25, v)
                .unwrap();
        }
    }
    let model = model_of(store);
    assert_eq!(
        model[&id].1.len(),
        1 + cases.iter().filter(|c| !c.versions.is_empty()).count()
    );
    (id, model)
}

fn with_chunk(model: &Model, id: ContextId, index: u32, chunk: Option<Vec<u8>>) -> Model {
    let mut m = model.clone();
    let chunks = &mut m.get_mut(&id).unwrap().1;
    match chunk {
        Some(c) => chunks.insert(index, c),
        None => chunks.remove(&index),
    };
    m
}

/// Where a case's new copy goes: the slot its current copy does not occupy.
fn new_copy(c: &Case) -> u8 {
    if c.versions.is_empty() {
        0
    } else {
        (c.versions.len() % 2) as u8
    }
}

fn slot_name(index: u32, copy: u8) -> String {
    format!("data/{index}.{copy}")
}

/// `return` at `step`: the write fails there (with its bytes already written), leaves the chunk
/// as it was, and the store goes on; only a failure to free the old copy does not fail the write.
fn chunk_write_fails(step: Step, seed: u32) {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let cases = cases(seed);
    let (id, before) = chunk_store(&store, &cases, seed);
    let mut expected = before.clone();
    for c in &cases {
        arm(step.name(), "return");
        let res = store.write_chunk(id, c.index, &FP, KvFormat::Int8, 0.75, &c.new);
        fail::remove(step.name());
        // A failure to free the old copy only costs its space until the next open (and a first
        // write never gets there).
        if step == Step::OldPunched {
            res.unwrap();
            expected = with_chunk(&expected, id, c.index, Some(c.new.clone()));
        } else {
            assert_injected(res, step.name());
        }
        assert_eq!(model_of(&store), expected, "{step:?}, chunk {}", c.index);
    }
    drop(store);
    // Nothing of a failed write is left for recovery, and a replaced copy was freed.
    let store = reopen_and_check(dir.path(), &expected, &[]);
    // The store goes on: the chunks are written again, and read back after another reopen.
    for c in &cases {
        store
            .write_chunk(id, c.index, &FP, KvFormat::Int8, 0.75, &c.new)
            .unwrap();
        expected = with_chunk(&expected, id, c.index, Some(c.new.clone()));
    }
    drop(store);
    reopen_and_check(dir.path(), &expected, &[]);
}

/// `panic` at `step`: the writer dies right after it (the kernel keeps every write it made, synced
/// or not, as after a kill); reopened, the chunk is its previous complete version until its header
/// was written, its new one after, never torn, and recovery only removes leftovers.
fn chunk_write_crashes(step: Step, seed: u32) {
    for (n, c) in cases(seed).into_iter().enumerate() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path());
        let (id, before) = chunk_store(&store, std::slice::from_ref(&c), seed + n as u32);
        let previous = c.versions.last().cloned();
        let copy = new_copy(&c);
        arm(step.name(), "panic");
        let reaches = !(step == Step::OldPunched && c.versions.is_empty());
        if reaches {
            crash(step.name(), || {
                store.write_chunk(id, c.index, &FP, KvFormat::Int8, 0.75, &c.new)
            });
        } else {
            store
                .write_chunk(id, c.index, &FP, KvFormat::Int8, 0.75, &c.new)
                .unwrap();
            fail::remove(step.name());
        }
        drop(store);
        let new = with_chunk(&before, id, c.index, Some(c.new.clone()));
        let old = with_chunk(&before, id, c.index, previous.clone());
        let unfinished = ("removed", "unfinished", slot_name(c.index, copy));
        let older = ("removed", "older", slot_name(c.index, 1 - copy));
        match step {
            Step::PayloadWritten | Step::PayloadSynced => {
                reopen_and_check(dir.path(), &old, &[unfinished]);
            }
            Step::HeaderWritten => {
                // The header is written, not synced: a kill keeps it (the new version), and a
                // power loss may lose it (the previous one) or tear it (the previous one, the torn
                // slot set aside). All three are checked, from copies of the store.
                let lost = copy_store(dir.path());
                let torn = copy_store(dir.path());
                let header = slot_offset(c.index, copy);
                let rewrite = |root: &Path, at: u64, len: usize| {
                    let f = std::fs::OpenOptions::new()
                        .write(true)
                        .open(root.join(format!("contexts/{id}/data")))
                        .unwrap();
                    f.write_all_at(&vec![0; len], at).unwrap();
                };
                rewrite(lost.path(), header, HEADER_LEN);
                rewrite(torn.path(), header + HEADER_LEN as u64 / 2, HEADER_LEN / 2);
                let recovery: Vec<Action> = if c.versions.is_empty() {
                    vec![]
                } else {
                    vec![older.clone()]
                };
                reopen_and_check(dir.path(), &new, &recovery);
                reopen_and_check(lost.path(), &old, std::slice::from_ref(&unfinished));
                // Torn, the new copy is set aside: the chunk is its previous version, or
                // (a first write) not served.
                let quarantined = ("quarantined", "", slot_name(c.index, copy));
                reopen_and_check(torn.path(), &old, &[quarantined]);
            }
            Step::HeaderSynced => {
                let recovery: Vec<Action> = if c.versions.is_empty() {
                    vec![]
                } else {
                    vec![older]
                };
                reopen_and_check(dir.path(), &new, &recovery);
            }
            Step::OldPunched => {
                reopen_and_check(dir.path(), &new, &[]);
            }
        }
        // After the crash the store goes on: the chunk is written again and survives a reopen.
        let store = open(dir.path());
        let again = bytes(seed + 77, 4000, true);
        store
            .write_chunk(id, c.index, &FP, KvFormat::Int2, 0.1, &again)
            .unwrap();
        drop(store);
        let after = with_chunk(&before, id, c.index, Some(again));
        reopen_and_check(dir.path(), &after, &[]);
    }
}

/// A copy of the store at `root`, holes kept (as the kernel has it after a kill).
fn copy_store(root: &Path) -> tempfile::TempDir {
    let copy = tempfile::tempdir().unwrap();
    let status = std::process::Command::new("cp")
        .args(["-a", "--sparse=always"])
        .arg(format!("{}/.", root.display()))
        .arg(copy.path())
        .status()
        .unwrap();
    assert!(status.success());
    copy
}

// ---- tokens and meta -------------------------------------------------------------------------

const REPLACE_STEPS: [&str; 4] = ["written", "synced", "renamed", "dir_synced"];

/// A `tokens` replace cut at `step` by `action`: `append_tokens` (chunks stay valid) and
/// `replace_tokens` (chunk 1's tokens change). The file is the old content until its rename and
/// the new one from then on, never a mix (a mix would fail its crc and quarantine the context);
/// a chunk survives exactly when the surviving tokens still cover it.
fn tokens_replace(step: &str, action: &str, seed: u32) {
    let name = format!("kvfs::replace::tokens::{step}");
    let renamed = step == "renamed" || step == "dir_synced";
    for replace in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path());
        let old: Vec<u32> = (0..40).map(|t| t + seed).collect();
        let id = new_ctx(&store, &old);
        for i in 0..2 {
            store
                .write_chunk(
                    id,
                    i,
                    &FP,
                    KvFormat::Int8,
                    0.5,
                    &bytes(seed + i, 4000, true),
                )
                .unwrap();
        }
        let before = model_of(&store);
        let new: Vec<u32> = if replace {
            let mut t = old.clone();
            t[20] += 1000;
            t
        } else {
            old.iter().copied().chain(40..50).collect()
        };
        arm(&name, action);
        let op = || {
            if replace {
                store.replace_tokens(id, new.clone())
            } else {
                store.append_tokens(id, &new[old.len()..]).map(|_| ())
            }
        };
        if action == "panic" {
            crash(&name, op);
        } else {
            let res = op();
            fail::remove(&name);
            assert_injected(res, &name);
            // Until the next replace or open the store keeps the tokens it had.
            assert_eq!(model_of(&store), before);
        }
        drop(store);
        let mut expected = before.clone();
        let mut recovery = vec![];
        if renamed {
            let entry = expected.get_mut(&id).unwrap();
            entry.0 = new.clone();
            if replace {
                entry.1.remove(&1);
                recovery.push(("removed", "stale", slot_name(1, 0)));
            }
        }
        let store = reopen_and_check(dir.path(), &expected, &recovery);
        // The store goes on from whichever content survived.
        store.append_tokens(id, &[7, 8, 9]).unwrap();
        expected.get_mut(&id).unwrap().0.extend([7, 8, 9]);
        drop(store);
        reopen_and_check(dir.path(), &expected, &[]);
    }
}

/// A `meta` replace cut at `step` by `action`, while a context is created under `staging/`: the
/// context exists after a reopen whole or not at all, and another is created after it.
fn meta_replace(step: &str, action: &str, seed: u32) {
    let name = format!("kvfs::replace::meta::{step}");
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let id = new_ctx(&store, &[seed, seed + 1]);
    let before = model_of(&store);
    arm(&name, action);
    let create = || {
        store.create_context(NewContext {
            owner_uid: 1001,
            app: "notes".into(),
            fingerprint: FP,
            chunk_tokens: CHUNK_TOKENS,
        })
    };
    if action == "panic" {
        crash(&name, create);
    } else {
        let res = create();
        fail::remove(&name);
        assert_injected(res, &name);
        assert_eq!(store.list_contexts(), vec![id]);
    }
    drop(store);
    let staged = ("removed", "staging", String::new());
    let store = reopen_and_check(dir.path(), &before, &[staged]);
    let other = new_ctx(&store, &[1, 2, 3]);
    drop(store);
    let mut expected = before;
    expected.insert(other, (vec![1, 2, 3], BTreeMap::new()));
    reopen_and_check(dir.path(), &expected, &[]);
}

// ---- the tests: one per failpoint ------------------------------------------------------------

/// Each failpoint's test holds the `fail` crate's scenario lock: the registry is process-wide, so
/// tests that arm failpoints run one at a time.
fn scenario(f: impl FnOnce()) {
    let s = fail::FailScenario::setup();
    f();
    s.teardown();
}

macro_rules! chunk_tests {
    ($($test:ident: $step:expr, $seed:expr;)*) => {$(
        #[test]
        fn $test() {
            scenario(|| {
                chunk_write_fails($step, $seed);
                chunk_write_crashes($step, $seed);
            });
        }
    )*};
}

chunk_tests! {
    chunk_payload_written: Step::PayloadWritten, 10;
    chunk_payload_synced: Step::PayloadSynced, 20;
    chunk_header_written: Step::HeaderWritten, 30;
    chunk_header_synced: Step::HeaderSynced, 40;
    chunk_old_punched: Step::OldPunched, 50;
}

macro_rules! replace_tests {
    ($($test:ident: $what:ident, $step:expr, $seed:expr;)*) => {$(
        #[test]
        fn $test() {
            assert!(REPLACE_STEPS.contains(&$step));
            scenario(|| {
                $what($step, "return", $seed);
                $what($step, "panic", $seed + 1);
            });
        }
    )*};
}

replace_tests! {
    tokens_written: tokens_replace, "written", 100;
    tokens_synced: tokens_replace, "synced", 200;
    tokens_renamed: tokens_replace, "renamed", 300;
    tokens_dir_synced: tokens_replace, "dir_synced", 400;
    meta_written: meta_replace, "written", 500;
    meta_synced: meta_replace, "synced", 600;
    meta_renamed: meta_replace, "renamed", 700;
    meta_dir_synced: meta_replace, "dir_synced", 800;
}
