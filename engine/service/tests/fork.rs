//! Forks and shared prefixes on real parts (userfaultfd slots, a kvfs store on disk): a fork
//! answers as its parent would, its borrowed chunks are held once in memory and in the store,
//! contexts of one owner with the same system prompt share it, other owners never do, and
//! everything survives a restart.

mod common;
use common::{owner, prompt};
use std::sync::Arc;
use std::time::Instant;

use kvfs::{ContextId, StoreState};
use model::Model;
use model::tiny::{TinySpec, write_tiny_gguf};
use service::{CallOptions, Manager, ManagerConfig, Owner};

fn tiny() -> (tempfile::TempDir, Arc<Model>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    let spec = TinySpec {
        max_ctx: 1024,
        ..TinySpec::default()
    };
    write_tiny_gguf(&path, &spec).unwrap();
    let model = Arc::new(Model::load(&path).unwrap());
    (dir, model)
}

fn open(model: &Arc<Model>, store: &std::path::Path, share: bool, compress: bool) -> Manager {
    let mut c = ManagerConfig::new(store, 64 << 20);
    c.max_tokens = 1024;
    c.share_prefixes = share;
    if !compress {
        c.compress_bits = None;
    }
    Manager::open(Arc::clone(model), c).unwrap()
}

fn call(m: &mut Manager, o: &Owner, id: u64, p: &[u32]) -> Vec<u32> {
    let opts = CallOptions {
        max_tokens: 8,
        ..CallOptions::default()
    };
    m.call(o, id, p, &opts, Instant::now(), |_| true)
        .unwrap()
        .tokens
}

/// Every chunk resident anywhere given back: a budget of nothing, then the old one again.
fn swap_everything_out(m: &mut Manager) {
    m.flush();
    let budget = m.pager().budget();
    m.set_budget(0).unwrap();
    m.set_budget(budget).unwrap();
    assert_eq!(m.pager().resident_bytes(), 0);
}

#[test]
fn forks_answer_as_their_parent_would_and_hold_its_chunks_once() {
    let (_d, model) = tiny();
    let o = owner();
    let history = [prompt(2, 200), prompt(3, 30), prompt(4, 20)];

    // The answers of one context that is never forked: what every fork must say.
    let control_dir = tempfile::tempdir().unwrap();
    let mut c = open(&model, control_dir.path(), false, true);
    let cid = c.create(&o, &prompt(1, 21)).unwrap();
    let expected: Vec<Vec<u32>> = history.iter().map(|p| call(&mut c, &o, cid, p)).collect();

    let dir = tempfile::tempdir().unwrap();
    let mut m = open(&model, dir.path(), true, true);
    let parent = m.create(&o, &prompt(1, 21)).unwrap();
    assert_eq!(call(&mut m, &o, parent, &history[0]), expected[0]);
    let sealed = m.info(&o, parent).unwrap().chunks;
    let forks: Vec<u64> = (0..4).map(|_| m.fork(&o, parent).unwrap()).collect();
    assert_eq!(m.shared_prefixes().0, 1, "one prefix for every fork");
    for &id in forks.iter().chain([&parent]) {
        assert_eq!(
            m.info(&o, id).unwrap().shared_chunks,
            sealed,
            "context {id}"
        );
    }
    // Held once: the forks' own regions hold nothing, the prefix's every chunk.
    let (_, prefix_bytes) = m.shared_prefixes();
    assert!(prefix_bytes > 0);
    for &id in forks.iter().chain([&parent]) {
        assert_eq!(m.pager().context_resident(ContextId(id)).unwrap(), 0);
    }
    assert_eq!(m.pager().resident_bytes(), prefix_bytes);
    // Stored once: the prefix holds the chunks, no context a copy of them.
    let store = m.store();
    let base = ContextId(store.link(ContextId(parent)).unwrap().unwrap().base);
    assert!(store.is_shared(base).unwrap());
    assert_eq!(store.referrers(base), 5);
    for i in 0..sealed as u32 {
        assert!(matches!(
            store.chunk_state(base, i).unwrap(),
            StoreState::Stored(_)
        ));
        for &id in forks.iter().chain([&parent]) {
            assert_eq!(
                store.chunk_state(ContextId(id), i).unwrap(),
                StoreState::Missing
            );
        }
    }
    // Each answers as the context never forked, the parent too; then again after every chunk
    // was given back, read from the prefix's store.
    for &id in forks.iter().chain([&parent]) {
        assert_eq!(
            call(&mut m, &o, id, &history[1]),
            expected[1],
            "context {id}"
        );
    }
    swap_everything_out(&mut m);
    let r = m
        .call(
            &o,
            forks[0],
            &history[2],
            &CallOptions {
                max_tokens: 8,
                ..CallOptions::default()
            },
            Instant::now(),
            |_| true,
        )
        .unwrap();
    assert_eq!(r.tokens, expected[2]);
    assert!(r.load.read.len() >= sealed, "{:?}", r.load);
    // A switch to another fork reads only its own chunks: the prefix's are resident.
    let r = m
        .call(
            &o,
            forks[1],
            &history[2],
            &CallOptions {
                max_tokens: 8,
                ..CallOptions::default()
            },
            Instant::now(),
            |_| true,
        )
        .unwrap();
    assert_eq!(r.tokens, expected[2]);
    assert!(
        r.load.read.iter().all(|&i| i as usize >= sealed),
        "{:?}",
        r.load
    );

    drop(m);
    let all: Vec<u64> = forks.iter().copied().chain([parent]).collect();
    after_a_restart(&model, dir.path(), &all, sealed, &history[2], &expected[2]);
}

/// After a restart every fork still borrows its `sealed` chunks, and `all[2]` (which has not
/// answered `question` yet) answers it with `expected`; the prefix goes with the last of `all`.
fn after_a_restart(
    model: &Arc<Model>,
    dir: &std::path::Path,
    all: &[u64],
    sealed: usize,
    question: &[u32],
    expected: &[u32],
) {
    let o = owner();
    let mut m = open(model, dir, true, true);
    assert_eq!(m.info(&o, all[2]).unwrap().shared_chunks, sealed);
    assert_eq!(call(&mut m, &o, all[2], question), expected);
    for &id in all {
        m.delete(&o, id).unwrap();
    }
    assert_eq!(m.shared_prefixes().0, 0);
    assert!(m.store().list_contexts().is_empty());
    assert_eq!(m.pager().resident_bytes(), 0);
}

#[test]
fn the_same_system_prompt_is_computed_and_held_once_per_owner() {
    let (_d, model) = tiny();
    let o = owner();
    let stranger = Owner {
        uid: 1001,
        app: "other".into(),
    };
    let system = prompt(5, 100);
    let question = prompt(2, 20);
    let dir = tempfile::tempdir().unwrap();
    // Uncompressed chunks: a context computing the prompt itself makes the same bytes.
    let mut m = open(&model, dir.path(), true, false);
    let first = m.create(&o, &system).unwrap();
    let answer = call(&mut m, &o, first, &question);
    let second = m.create(&o, &system).unwrap();
    let other = m.create(&stranger, &system).unwrap();
    let whole = system.len() / 16;
    assert_eq!(m.info(&o, second).unwrap().shared_chunks, whole);
    assert_eq!(m.info(&o, first).unwrap().shared_chunks, whole);
    assert_eq!(m.info(&stranger, other).unwrap().shared_chunks, 0);
    assert!(m.prefix_owners().iter().all(|&u| u == o.uid));
    // The second prefills only what follows the shared chunks, and answers as the first.
    let r = m
        .call(
            &o,
            second,
            &question,
            &CallOptions {
                max_tokens: 8,
                ..CallOptions::default()
            },
            Instant::now(),
            |_| true,
        )
        .unwrap();
    assert_eq!(r.tokens, answer);
    assert!(
        r.prefill_tokens < system.len(),
        "{} prefilled",
        r.prefill_tokens
    );
    assert_eq!(call(&mut m, &stranger, other, &question), answer);
    // A stranger's contexts share among themselves, never with ours.
    let late = m.create(&stranger, &system).unwrap();
    assert_eq!(m.info(&stranger, late).unwrap().shared_chunks, whole);
    let base = m.store().link(ContextId(late)).unwrap().unwrap().base;
    assert_eq!(
        m.store().meta(ContextId(base)).unwrap().owner_uid,
        stranger.uid
    );
    // A context made from turns that begin as the first's (a branch of its conversation)
    // borrows the chunks they share, then computes the rest.
    let turns = vec![service::transcript::Turn::new(
        service::transcript::Role::Raw,
        "branch",
    )];
    let tokens = [system.clone(), question.clone()].concat();
    let branch = m.create_recorded(&o, &tokens, turns, true).unwrap();
    assert_eq!(m.info(&o, branch).unwrap().shared_chunks, tokens.len() / 16);
    assert_eq!(m.info(&o, branch).unwrap().tokens, tokens.len());
    m.delete(&o, branch).unwrap();
    m.delete(&o, first).unwrap();
    assert_eq!(call(&mut m, &o, second, &prompt(6, 10)).len(), 8);
    m.delete(&o, second).unwrap();
    assert_eq!(m.shared_prefixes().0, 1, "the strangers' own prefix stays");
}
