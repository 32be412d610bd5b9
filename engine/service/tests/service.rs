//! The context manager on real parts: userfaultfd slots under a budget, a kvfs store on disk,
//! the AoT writer, the Load pipeline. A context swapped out and brought back answers exactly as
//! one never swapped.

mod common;
use common::{owner, prompt};
use std::sync::Arc;
use std::time::Instant;

use model::Model;
use model::kv::KvFormat;
use model::tiny::{TinySpec, write_tiny_gguf};
use service::{
    CallOptions, CallReport, LoadMode, Manager, ManagerConfig, Owner, Prompt, ServiceError,
};
use strum::VariantArray;
use uffd_pager::{ChunkKey, ContextId};

struct Tiny {
    _dir: tempfile::TempDir,
    model: Arc<Model>,
}

fn tiny() -> Tiny {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    let spec = TinySpec {
        max_ctx: 1024,
        ..TinySpec::default()
    };
    write_tiny_gguf(&path, &spec).unwrap();
    let model = Arc::new(Model::load(&path).unwrap());
    Tiny { _dir: dir, model }
}

fn opts(n: usize) -> CallOptions {
    CallOptions {
        max_tokens: n,
        ..CallOptions::default()
    }
}

fn config(store: &std::path::Path, budget: u64, format: KvFormat, load: LoadMode) -> ManagerConfig {
    let mut c = ManagerConfig::new(store, budget);
    c.kv_format = format;
    c.max_tokens = 1024;
    c.load = load;
    if format == KvFormat::F16 {
        c.compress_bits = None;
    }
    c
}

/// One call of `p`: given as tokens, or (`deferred`) encoded during the Load, as the daemon's
/// text prompts are.
fn call_as(
    m: &mut Manager,
    o: &Owner,
    id: u64,
    p: &[u32],
    n: usize,
    deferred: bool,
) -> Result<CallReport, ServiceError> {
    if deferred {
        let encode = || p.to_vec();
        m.call_with(
            o,
            id,
            Prompt::later(encode),
            &opts(n),
            Instant::now(),
            |_| true,
        )
    } else {
        m.call(o, id, p, &opts(n), Instant::now(), |_| true)
    }
}

/// Three calls on one context, with the context swapped out completely before each call when
/// `swap`; returns every answer.
fn conversation(t: &Tiny, format: KvFormat, load: LoadMode, swap: bool) -> Vec<Vec<u32>> {
    conversation_as(t, format, load, swap, false)
}

fn conversation_as(
    t: &Tiny,
    format: KvFormat,
    load: LoadMode,
    swap: bool,
    deferred: bool,
) -> Vec<Vec<u32>> {
    let store = tempfile::tempdir().unwrap();
    let mut m = Manager::open(
        Arc::clone(&t.model),
        config(store.path(), 64 << 20, format, load),
    )
    .unwrap();
    let o = owner();
    let id = m.create(&o, &prompt(1, 21)).unwrap();
    let mut answers = Vec::new();
    for call in 0..3u32 {
        if swap && call > 0 {
            m.flush();
            m.swap_out(&o, id).unwrap();
            assert_eq!(m.pager().context_resident(ContextId(id)).unwrap(), 0);
            assert_eq!(
                m.pager().region_rss(ContextId(id)).unwrap(),
                0,
                "region RSS"
            );
        }
        let r = call_as(&mut m, &o, id, &prompt(call + 2, 40), 12, deferred).unwrap();
        if swap && call > 0 {
            assert!(r.load.missing > 0, "nothing was missing after a swap-out");
            match load {
                LoadMode::ReadOnly => assert!(r.load.recomputed.is_empty(), "{:?}", r.load),
                // Only chunks past a sliding window are read: they cannot be recomputed alone.
                LoadMode::RecomputeOnly if t.model.chunk_shape(16).has_window() => {
                    let first = r.load.recomputed.first().copied().unwrap_or(u32::MAX);
                    assert!(r.load.read.iter().all(|&i| i < first), "{:?}", r.load)
                }
                LoadMode::RecomputeOnly => assert!(r.load.read.is_empty(), "{:?}", r.load),
                LoadMode::Planned => {}
            }
        }
        answers.push(r.tokens);
    }
    answers
}

#[test]
fn a_context_swapped_out_and_read_back_answers_as_one_never_swapped() {
    let t = tiny();
    for format in [KvFormat::Int8, KvFormat::F16] {
        let kept = conversation(&t, format, LoadMode::ReadOnly, false);
        let swapped = conversation(&t, format, LoadMode::ReadOnly, true);
        assert_eq!(kept, swapped, "{format:?}");
        // A prompt encoded while the chunks are read gives the same answers.
        let deferred = conversation_as(&t, format, LoadMode::ReadOnly, true, true);
        assert_eq!(kept, deferred, "{format:?}, encoded during the Load");
    }
}

#[test]
fn a_context_recomputed_or_planned_back_answers_as_one_never_swapped() {
    let t = tiny();
    let kept = conversation(&t, KvFormat::Int8, LoadMode::RecomputeOnly, false);
    for load in [LoadMode::RecomputeOnly, LoadMode::Planned] {
        let swapped = conversation(&t, KvFormat::Int8, load, true);
        assert_eq!(kept, swapped, "{load:?}");
    }
}

/// Damages chunk `index`'s slot in context `id`'s data file: its header page zeroed
/// (`delete`: the chunk gone), or one payload byte flipped (`corrupt`).
fn damage_chunk(m: &Manager, id: u64, index: u32, damage: &str) {
    use std::os::unix::fs::FileExt;
    let cid = kvfs::ContextId(id);
    let at = m.store().chunk_offset(cid, index).expect("stored");
    let data = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.store().data_path(cid))
        .unwrap();
    match damage {
        "delete" => data.write_all_at(&[0; kvfs::HEADER_PAGE], at).unwrap(),
        _ => {
            let at = at + kvfs::HEADER_PAGE as u64 + 7;
            let mut b = [0u8];
            data.read_exact_at(&mut b, at).unwrap();
            data.write_all_at(&[b[0] ^ 0x5a], at).unwrap();
        }
    }
}

#[test]
fn a_deleted_or_corrupt_chunk_file_is_recomputed_and_the_answer_is_the_same() {
    let t = tiny();
    let kept = conversation(&t, KvFormat::Int8, LoadMode::ReadOnly, false);
    // Through the store's API and through a kvfs mount (the service's data path).
    for (damage, mount) in [
        ("delete", false),
        ("corrupt", false),
        ("delete", true),
        ("corrupt", true),
    ] {
        let store = tempfile::tempdir().unwrap();
        let mnt = tempfile::tempdir().unwrap();
        let mut cfg = config(store.path(), 64 << 20, KvFormat::Int8, LoadMode::ReadOnly);
        cfg.mount = mount.then(|| mnt.path().join("kv"));
        let mut m = Manager::open(Arc::clone(&t.model), cfg).unwrap();
        let o = owner();
        let id = m.create(&o, &prompt(1, 21)).unwrap();
        let mut answers = Vec::new();
        for call in 0..3u32 {
            if call > 0 {
                m.flush();
                m.swap_out(&o, id).unwrap();
                damage_chunk(&m, id, call - 1, damage);
            }
            let r = m
                .call(
                    &o,
                    id,
                    &prompt(call + 2, 40),
                    &opts(12),
                    Instant::now(),
                    |_| true,
                )
                .unwrap();
            if call > 0 {
                assert_eq!(
                    r.load.failed_reads,
                    vec![call - 1],
                    "{damage}: {:?}",
                    r.load
                );
                assert!(r.load.recomputed.contains(&(call - 1)));
            }
            answers.push(r.tokens);
        }
        assert_eq!(kept, answers, "{damage}");
        if damage == "corrupt" {
            let q = store.path().join("quarantine");
            assert!(
                std::fs::read_dir(&q).is_ok_and(|d| d.count() > 0),
                "nothing quarantined in {}",
                q.display()
            );
        }
    }
}

#[test]
fn many_contexts_under_a_budget_of_two_never_exceed_it_and_answer_as_unmanaged() {
    let t = tiny();
    let shape = t.model.chunk_shape(16);
    // Each context holds 61 tokens + 3 calls of 24 + 8 answer tokens: about 10 chunks.
    let per_ctx = 10 * shape.slot_bytes(KvFormat::Int8) as u64;
    let run = |budget: u64| -> (Vec<Vec<u32>>, u64, u64) {
        let store = tempfile::tempdir().unwrap();
        let mut cfg = config(store.path(), budget, KvFormat::Int8, LoadMode::Planned);
        cfg.compress_bits = None;
        let mut m = Manager::open(Arc::clone(&t.model), cfg).unwrap();
        let o = owner();
        let ids: Vec<u64> = (0..5)
            .map(|i| m.create(&o, &prompt(i, 61)).unwrap())
            .collect();
        let mut answers = Vec::new();
        let mut faults_after_warmup = 0;
        for round in 0..3u32 {
            for (n, &id) in ids.iter().enumerate() {
                let before = m.stats().faults;
                let r = m
                    .call(
                        &o,
                        id,
                        &prompt(round * 10 + n as u32, 24),
                        &opts(8),
                        Instant::now(),
                        |_| true,
                    )
                    .unwrap();
                if round > 0 {
                    faults_after_warmup += m.stats().faults - before;
                }
                assert!(
                    m.pager().resident_bytes() <= budget,
                    "{} resident over a budget of {budget}",
                    m.pager().resident_bytes()
                );
                answers.push(r.tokens);
                m.flush();
            }
        }
        let s = m.stats();
        (
            answers,
            faults_after_warmup,
            s.reclaims.min(s.chunks_read + s.chunks_recomputed),
        )
    };
    let (unmanaged, _, swapped) = run(1 << 30);
    assert_eq!(swapped, 0, "nothing should be swapped with room for all");
    let (managed, faults, swapped) = run(2 * per_ctx);
    assert!(
        swapped > 10,
        "the budget of two contexts swapped only {swapped} chunks"
    );
    assert_eq!(unmanaged, managed);
    assert_eq!(faults, 0, "calls took faults in steady state");
}

#[test]
fn contexts_survive_a_restart_and_answer_as_if_it_never_happened() {
    let t = tiny();
    let kept = conversation(&t, KvFormat::Int8, LoadMode::ReadOnly, false);
    let store = tempfile::tempdir().unwrap();
    let o = owner();
    let mut answers = Vec::new();
    let mut id = 0;
    for call in 0..3u32 {
        let cfg = config(store.path(), 64 << 20, KvFormat::Int8, LoadMode::ReadOnly);
        let mut m = Manager::open(Arc::clone(&t.model), cfg).unwrap();
        if call == 0 {
            id = m.create(&o, &prompt(1, 21)).unwrap();
        }
        let r = m
            .call(
                &o,
                id,
                &prompt(call + 2, 40),
                &opts(12),
                Instant::now(),
                |_| true,
            )
            .unwrap();
        answers.push(r.tokens);
        m.flush();
    }
    assert_eq!(kept, answers);
}

/// A store written in chunks of 16 tokens (the size every model took before Gemma 3 took 32),
/// opened with chunks of 32: the context keeps its tokens, its chunks are recomputed in the new
/// size at the next Load, and it answers exactly as a context made in that size.
#[test]
fn a_context_stored_in_chunks_of_another_size_keeps_its_tokens_and_is_recomputed() {
    let t = tiny();
    let cfg = |store: &std::path::Path, chunk: usize| {
        let mut c = config(store, 64 << 20, KvFormat::F16, LoadMode::Planned);
        c.chunk_tokens = chunk;
        c
    };
    let o = owner();
    let history = |m: &mut Manager| {
        let id = m.create(&o, &prompt(1, 21)).unwrap();
        call_as(m, &o, id, &prompt(2, 40), 6, false).unwrap();
        m.flush();
        id
    };
    let reference = tempfile::tempdir().unwrap();
    let mut m = Manager::open(Arc::clone(&t.model), cfg(reference.path(), 32)).unwrap();
    let id = history(&mut m);
    let want = call_as(&mut m, &o, id, &prompt(3, 40), 12, false).unwrap();
    drop(m);

    let store = tempfile::tempdir().unwrap();
    let mut m = Manager::open(Arc::clone(&t.model), cfg(store.path(), 16)).unwrap();
    let id = history(&mut m);
    let tokens = m.info(&o, id).unwrap().tokens;
    assert!(m.store().context(ContextId(id)).unwrap().chunks.len() > 2);
    drop(m);
    let mut m = Manager::open(Arc::clone(&t.model), cfg(store.path(), 32)).unwrap();
    assert_eq!(
        m.info(&o, id).unwrap().tokens,
        tokens,
        "its tokens are kept"
    );
    assert_eq!(m.store().meta(ContextId(id)).unwrap().chunk_tokens, 32);
    let got = call_as(&mut m, &o, id, &prompt(3, 40), 12, false).unwrap();
    assert_eq!(
        got.load.recomputed.len(),
        tokens / 32,
        "every sealed chunk is recomputed: {:?}",
        got.load
    );
    assert!(got.load.read.is_empty(), "{:?}", got.load);
    assert_eq!(got.tokens, want.tokens);
}

#[test]
fn another_models_contexts_are_refused_kept_and_usable_again_under_their_model() {
    let t = tiny();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("other.gguf");
    let spec = TinySpec {
        max_ctx: 1024,
        seed: 99,
        ..TinySpec::default()
    };
    write_tiny_gguf(&path, &spec).unwrap();
    let other = Arc::new(Model::load(&path).unwrap());
    let store = tempfile::tempdir().unwrap();
    let cfg = || config(store.path(), 64 << 20, KvFormat::Int8, LoadMode::ReadOnly);
    let o = owner();
    let (id, tokens) = {
        let mut m = Manager::open(Arc::clone(&t.model), cfg()).unwrap();
        let id = m.create(&o, &prompt(1, 21)).unwrap();
        call_as(&mut m, &o, id, &prompt(2, 40), 6, false).unwrap();
        m.flush();
        (id, m.info(&o, id).unwrap().tokens)
    };
    assert!(tokens > 61);
    // The service restarts with another model: the context, made from tokens, has no transcript
    // to be rebuilt from (tests/tests/transcript.rs rebuilds one that has), so it is refused by
    // name, not lost.
    let mut m = Manager::open(Arc::clone(&other), cfg()).unwrap();
    let e = call_as(&mut m, &o, id, &prompt(3, 40), 6, false).unwrap_err();
    assert_eq!(e.code(), "other_model", "{e}");
    assert!(e.to_string().contains("another model"), "{e}");
    assert_eq!(m.info(&o, id).unwrap_err().code(), "other_model");
    assert!(
        m.list(&o).is_empty(),
        "only the loaded model's contexts are listed"
    );
    let stranger = Owner {
        uid: o.uid + 1,
        app: o.app.clone(),
    };
    assert_eq!(m.info(&stranger, id).unwrap_err().code(), "not_found");
    drop(m);
    // Back under its own model, it holds what it held.
    let m = Manager::open(Arc::clone(&t.model), cfg()).unwrap();
    assert_eq!(m.info(&o, id).unwrap().tokens, tokens);
    drop(m);
    // Its owner may delete it under another model.
    let mut m = Manager::open(Arc::clone(&other), cfg()).unwrap();
    m.delete(&o, id).unwrap();
    assert_eq!(m.info(&o, id).unwrap_err().code(), "not_found");
}

#[test]
fn another_owner_sees_no_context() {
    let t = tiny();
    let store = tempfile::tempdir().unwrap();
    let cfg = config(store.path(), 64 << 20, KvFormat::Int8, LoadMode::Planned);
    let mut m = Manager::open(Arc::clone(&t.model), cfg).unwrap();
    let id = m.create(&owner(), &prompt(1, 5)).unwrap();
    let other = Owner {
        uid: 1001,
        app: "test".into(),
    };
    let err = m
        .call(&other, id, &prompt(2, 5), &opts(2), Instant::now(), |_| {
            true
        })
        .unwrap_err();
    assert!(matches!(err, ServiceError::NotFound { .. }), "{err}");
    assert_eq!(err.code(), "not_found");
    assert!(m.list(&other).is_empty());
    assert_eq!(m.list(&owner()).len(), 1);
    assert_eq!(m.delete(&other, id).unwrap_err().code(), "not_found");
    m.delete(&owner(), id).unwrap();
    assert!(m.list(&owner()).is_empty());
    let _ = ChunkKey::new(id, 0);
}

#[test]
fn a_lower_budget_reclaims_at_once_and_calls_still_answer() {
    let t = tiny();
    let store = tempfile::tempdir().unwrap();
    let cfg = config(store.path(), 64 << 20, KvFormat::Int8, LoadMode::Planned);
    let mut m = Manager::open(Arc::clone(&t.model), cfg).unwrap();
    let o = owner();
    let a = m.create(&o, &prompt(1, 70)).unwrap();
    let b = m.create(&o, &prompt(2, 70)).unwrap();
    for id in [a, b] {
        m.call(&o, id, &prompt(3, 30), &opts(4), Instant::now(), |_| true)
            .unwrap();
    }
    m.flush();
    let before = m.pager().resident_bytes();
    let slot = t.model.chunk_shape(16).slot_bytes(KvFormat::Int8) as u64;
    let freed = m.set_budget(2 * slot).unwrap();
    assert!(
        freed > 0 && m.pager().resident_bytes() <= 2 * slot,
        "{before} -> freed {freed}"
    );
    assert_eq!(m.stats().unwritten_reclaims, 0, "written chunks go first");
    let tokens = m.info(&o, a).unwrap().tokens;
    let r = m
        .call(&o, a, &prompt(4, 8), &opts(4), Instant::now(), |_| true)
        .unwrap_err();
    // Context a alone needs more than two chunks: the call cannot run, and says so before it
    // changes anything, with the bytes it needs and the budget.
    assert_eq!(r.code(), "over_budget", "{r}");
    let service::ServiceError::OverBudget { needed, budget, .. } = r else {
        panic!("refused before the Load with the numbers: {r:?}");
    };
    assert_eq!(budget, 2 * slot);
    assert!(needed > budget, "{needed}");
    assert_eq!(m.info(&o, a).unwrap().tokens, tokens, "nothing changed");
    assert_eq!(m.stats().chunks_read, 0, "refused before the Load");
    m.set_budget(64 << 20).unwrap();
    let r = m
        .call(&o, a, &prompt(4, 8), &opts(4), Instant::now(), |_| true)
        .unwrap();
    assert!(r.load.missing > 0);
}

/// Five contexts called in turn under a budget of two contexts' worth, for every manager: each
/// answers as the same manager does with room for everything (swapping never changes content),
/// and each moves chunks its own way (the counters say how).
#[test]
fn every_manager_answers_under_pressure_as_without_and_moves_chunks_its_own_way() {
    use service::{ManagerKind, ServiceStats};
    let t = tiny();
    let shape = t.model.chunk_shape(16);
    let per_ctx = 10 * shape.slot_bytes(KvFormat::F16) as u64;
    // Every manager's answers and counters, and whether each idle context was whole or absent.
    let run = |kind: ManagerKind, budget: u64| -> (Vec<Vec<u32>>, ServiceStats, bool) {
        let store = tempfile::tempdir().unwrap();
        let mut cfg = config(store.path(), budget, KvFormat::Int8, LoadMode::Planned);
        kind.apply(&mut cfg);
        let mut m = Manager::open(Arc::clone(&t.model), cfg).unwrap();
        let o = owner();
        let ids: Vec<u64> = (0..5)
            .map(|i| m.create(&o, &prompt(i, 61)).unwrap())
            .collect();
        let (mut answers, mut whole) = (Vec::new(), true);
        for round in 0..3u32 {
            for (n, &id) in ids.iter().enumerate() {
                let r = m
                    .call(
                        &o,
                        id,
                        &prompt(round * 10 + n as u32, 24),
                        &opts(8),
                        Instant::now(),
                        |_| true,
                    )
                    .unwrap_or_else(|e| panic!("{kind}: {e}"));
                assert!(m.pager().resident_bytes() <= budget, "{kind} over budget");
                answers.push(r.tokens);
                m.flush();
                for c in m.list(&o).into_iter().filter(|c| c.id != id) {
                    whole &= c.resident_chunks == 0 || c.resident_chunks == c.chunks;
                }
            }
        }
        let s = m.stats();
        assert_eq!(s.manager, kind.name());
        (answers, s, whole)
    };
    let mut f16_answers = None;
    for &kind in ManagerKind::VARIANTS {
        let (free, _, _) = run(kind, 1 << 30);
        let (pressed, s, whole) = run(kind, 2 * per_ctx);
        assert_eq!(free, pressed, "{kind}: pressure changed the answers");
        assert!(s.reclaims > 10, "{kind}: only {} reclaims", s.reclaims);
        match kind {
            ManagerKind::Llms | ManagerKind::LlmsNoCompression | ManagerKind::LlmsNoPipeline => {
                assert!(s.writes > 0, "{kind}: AoT wrote nothing: {s:?}");
            }
            ManagerKind::LlmsNoLifecycle
            | ManagerKind::VllmSq
            | ManagerKind::VllmS
            | ManagerKind::Swapping => {
                assert_eq!(s.writes, 0, "{kind} writes ahead of time: {s:?}");
                assert!(s.sync_reclaims > 0, "{kind} never wrote a victim: {s:?}");
                assert_eq!(s.unwritten_reclaims, 0, "{kind} gave chunks up: {s:?}");
            }
            ManagerKind::Lmk => {
                assert_eq!(
                    (s.writes, s.sync_reclaims, s.chunks_read),
                    (0, 0, 0),
                    "{s:?}"
                );
                assert!(s.chunks_recomputed > 0, "{s:?}");
            }
        }
        if matches!(
            kind,
            ManagerKind::LlmsNoPipeline
                | ManagerKind::VllmSq
                | ManagerKind::VllmS
                | ManagerKind::Swapping
        ) {
            assert_eq!(s.chunks_recomputed, 0, "{kind} recomputed: {s:?}");
            assert!(s.chunks_read > 0, "{kind} read nothing: {s:?}");
        }
        if matches!(kind, ManagerKind::Swapping | ManagerKind::Lmk) {
            assert!(whole, "{kind} left a context partly resident");
        }
        // The f16 baselines differ in how chunks move, never in what the model sees.
        if kind.fixed_format() == Some(KvFormat::F16) {
            match &f16_answers {
                None => f16_answers = Some(pressed),
                Some(a) => assert_eq!(a, &pressed, "{kind} differs from the other f16 managers"),
            }
        }
    }
}

/// A call that would overflow its context slides the window: the first chunk and the most
/// recent tokens stay (durably, in the store too), the answer is the one a fresh context holding
/// just those tokens gives, and calls go on; with the window off the call is refused.
#[test]
fn a_full_context_slides_its_window_and_answers_as_a_fresh_one_with_the_kept_tokens() {
    let t = tiny();
    let given = slide_conversation(&t, false);
    // A prompt encoded during the Load is fitted after it, on its real length: the same slides,
    // the same answers.
    assert_eq!(slide_conversation(&t, true), given);
}

/// Eight calls of 60 tokens in a 256-token context, checking each slide; returns every answer.
fn slide_conversation(t: &Tiny, deferred: bool) -> Vec<Vec<u32>> {
    let store = tempfile::tempdir().unwrap();
    let mut cfg = config(store.path(), 64 << 20, KvFormat::Int8, LoadMode::Planned);
    cfg.compress_bits = None;
    cfg.max_tokens = 256;
    let mut m = Manager::open(Arc::clone(&t.model), cfg.clone()).unwrap();
    let o = owner();
    let id = m.create(&o, &prompt(1, 21)).unwrap();
    let mut said = prompt(1, 21);
    let mut slid = None;
    let mut answers = Vec::new();
    for call in 0..8u32 {
        let p = prompt(call + 2, 60);
        let before = said.clone();
        let r =
            call_as(&mut m, &o, id, &p, 8, deferred).unwrap_or_else(|e| panic!("call {call}: {e}"));
        if before.len() + p.len() + 1 > 256 {
            assert!(r.window_dropped > 0, "call {call} did not slide");
            let kept_len = before.len() - r.window_dropped;
            assert!(kept_len <= 128, "kept {kept_len} tokens");
            let mut kept = before[..16].to_vec();
            kept.extend_from_slice(&before[before.len() - (kept_len - 16)..]);
            said = kept.clone();
            if slid.is_none() {
                slid = Some((kept, p.clone(), r.tokens.clone()));
            }
        } else {
            assert_eq!(r.window_dropped, 0, "call {call}");
        }
        said.extend_from_slice(&p);
        said.extend_from_slice(&r.tokens);
        assert!(said.len() <= 256);
        m.flush();
        assert_eq!(
            m.store().tokens(kvfs::ContextId(id)).unwrap(),
            said,
            "call {call}"
        );
        answers.push(r.tokens);
    }
    assert!(m.stats().window_slides >= 1);
    // The first slide's answer is what a context of just the kept tokens answers.
    let (kept, p, answer) = slid.expect("the context never filled");
    let fresh = m.create(&o, &kept).unwrap();
    let r = m
        .call(&o, fresh, &p, &opts(8), Instant::now(), |_| true)
        .unwrap();
    assert_eq!(r.tokens, answer);
    // Without the window a full context refuses a call the window would have made room for.
    drop(m);
    cfg.window = false;
    let mut m = Manager::open(Arc::clone(&t.model), cfg).unwrap();
    let e = call_as(&mut m, &o, id, &prompt(99, 200), 8, deferred).unwrap_err();
    assert_eq!(e.code(), "context_full", "{e}");
    answers
}

/// A context of `calls` calls (after a 21-token start) under LLMS's levels at a budget of 6.5
/// stored bits per value, its chunks written out.
fn mixed_context(t: &Tiny, store: &std::path::Path, calls: u32) -> (Manager, u64) {
    let mut cfg = config(store, 64 << 20, KvFormat::Int8, LoadMode::Planned);
    cfg.compress_bits = Some(6.5);
    let mut m = Manager::open(Arc::clone(&t.model), cfg).unwrap();
    let o = owner();
    let id = m.create(&o, &prompt(1, 21)).unwrap();
    for call in 0..calls {
        m.call(
            &o,
            id,
            &prompt(call + 2, 40),
            &opts(12),
            Instant::now(),
            |_| true,
        )
        .unwrap();
    }
    m.flush();
    (m, id)
}

/// LLMS's default levels (k8v8, k4v4, k4v3) under a bit budget: every chunk the writer stores is
/// in one of them, and the files kvfs holds average at most the budget's bits per value, header
/// included (the tiny model's k4v3 stores 4.97 bits, its k8v8 9.47, so 6.5 takes a mix).
#[test]
fn the_llms_mix_stores_at_most_its_bit_budget_in_kvfs() {
    let t = tiny();
    let store = tempfile::tempdir().unwrap();
    let (m, id) = mixed_context(&t, store.path(), 3);
    let shape = m.model().chunk_shape(16);
    let info = m.store().context(kvfs::ContextId(id)).unwrap();
    let (mut bytes, mut chunks) = (0u64, 0u64);
    let mut seen = std::collections::BTreeSet::new();
    for c in &info.chunks {
        if let kvfs::StoreState::Stored(s) = &c.state
            && s.tokens.len() == 16
        {
            assert!(
                KvFormat::CODED.iter().any(|f| f.name() == s.format.name()),
                "chunk {} stored as {}",
                c.index,
                s.format
            );
            seen.insert(s.format.name());
            // What kvfs keeps of the chunk: its header and its stored payload.
            bytes += (kvfs::format::HEADER_LEN + s.stored_len as usize) as u64;
            chunks += 1;
        }
    }
    assert!(chunks >= 8, "{chunks} chunks stored");
    assert!(seen.len() >= 2, "one level only: {seen:?}");
    let bits = bytes as f64 * 8.0 / (chunks as f64 * shape.chunk_values() as f64);
    assert!(bits <= 6.5, "{bits} stored bits per value");
}

/// A tiny Gemma-3-shaped model: two layers of every three see a window of 16 tokens, so a
/// context keeps every layer of its last 32 tokens and the global layer alone before them.
fn tiny_window() -> Tiny {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny-window.gguf");
    let spec = TinySpec {
        max_ctx: 1024,
        family: model::config::Family::GEMMA3,
        n_layers: 3,
        head_dim: Some(32),
        n_kv_heads: 1,
        window: Some((16, 3)),
        ..TinySpec::default()
    };
    write_tiny_gguf(&path, &spec).unwrap();
    let model = Arc::new(Model::load(&path).unwrap());
    Tiny { _dir: dir, model }
}

/// Chunks past the sliding window are stored, read and recomputed with their global layers
/// alone, and a context swapped out and brought back (read, recomputed or planned) answers as
/// one never swapped; a lost chunk past the window comes back by recompute of its closure.
#[test]
fn chunks_past_the_sliding_window_swap_with_their_global_layers_alone() {
    let t = tiny_window();
    let kept = conversation(&t, KvFormat::Int8, LoadMode::ReadOnly, false);
    for load in [
        LoadMode::ReadOnly,
        LoadMode::RecomputeOnly,
        LoadMode::Planned,
    ] {
        let swapped = conversation(&t, KvFormat::Int8, load, true);
        assert_eq!(kept, swapped, "{load:?}");
    }
    // What the store holds: after three calls (about 180 tokens), the chunks before the last
    // 32 tokens are stored trimmed.
    let store = tempfile::tempdir().unwrap();
    let cfg = config(store.path(), 64 << 20, KvFormat::Int8, LoadMode::ReadOnly);
    let mut m = Manager::open(Arc::clone(&t.model), cfg).unwrap();
    let o = owner();
    let id = m.create(&o, &prompt(1, 21)).unwrap();
    let mut answers = Vec::new();
    for call in 0..3u32 {
        if call == 2 {
            // Lose chunk 1's stored copy (past the window by now) and swap everything out.
            m.flush();
            m.swap_out(&o, id).unwrap();
            damage_chunk(&m, id, 1, "delete");
        }
        let r = m
            .call(
                &o,
                id,
                &prompt(call + 2, 40),
                &opts(12),
                Instant::now(),
                |_| true,
            )
            .unwrap();
        if call == 2 {
            // Chunk 1's read fails its checks; it is rebuilt with its closure, every chunk
            // from the first.
            assert_eq!(r.load.failed_reads, vec![1], "{:?}", r.load);
            assert!(r.load.recomputed.contains(&1), "{:?}", r.load);
        }
        answers.push(r.tokens);
    }
    assert_eq!(kept, answers, "after a lost chunk past the window");
    m.flush();
    let shape = t.model.chunk_shape(16);
    let info = m.store().context(kvfs::ContextId(id)).unwrap();
    let sealed = info.tokens / 16;
    let trimmed = shape.trimmed_chunks(sealed * 16);
    assert!(trimmed >= 8, "{trimmed} chunks past the window");
    for c in &info.chunks {
        if let kvfs::StoreState::Stored(s) = &c.state {
            let i = c.index as usize;
            let want = if i < trimmed {
                shape.trimmed().chunk_bytes(s.format)
            } else {
                shape.chunk_bytes(s.format)
            };
            assert_eq!(s.raw_len as usize, want, "chunk {i} in {}", s.format);
        }
    }
}

/// Compression by density per layer group: the chunks past the sliding window (their global
/// layer alone, ranked by its attention) and the chunks within it (every layer) each meet the bit
/// budget on their own. Ranked together, the chunks within the window, whose densities come
/// mostly from windowed layers' softmax over a few keys, would take the bits of those past it.
#[test]
fn chunks_past_the_window_and_within_it_each_meet_the_bit_budget() {
    let t = tiny_window();
    let store = tempfile::tempdir().unwrap();
    let (m, id) = mixed_context(&t, store.path(), 4);
    let shape = t.model.chunk_shape(16);
    let info = m.store().context(kvfs::ContextId(id)).unwrap();
    let past = shape.trimmed_chunks(info.tokens / 16 * 16);
    // Each level's cost is a whole chunk's stored bits per value, as the service counts it.
    let (mut groups, mut formats) = ([(0.0, 0usize); 2], Vec::new());
    for c in &info.chunks {
        if let kvfs::StoreState::Stored(s) = &c.state {
            let g = usize::from(c.index as usize >= past);
            groups[g].0 += shape.stored_bits(s.format);
            groups[g].1 += 1;
            formats.push((c.index, s.format.name()));
        }
    }
    assert!(groups[0].1 >= 8 && groups[1].1 >= 2, "{groups:?}");
    for (name, (bits, n)) in ["past the window", "within it"].iter().zip(groups) {
        let mean = bits / n as f64;
        assert!(
            mean <= 6.5 + 1e-9,
            "{name}: {mean} bits per value; {formats:?}"
        );
    }
}

/// A context that would not fit the budget in int8 seals its new chunks in the heaviest level
/// that fits (a pasted document longer than the budget holds at int8), never past the budget;
/// one that fits in none is refused.
#[test]
fn a_context_larger_than_the_budget_at_int8_seals_its_chunks_lighter() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("wide.gguf");
    // Chunks of several pages: 8 layers of 2 KV heads of 64.
    let spec = TinySpec {
        n_layers: 8,
        hidden: 256,
        n_heads: 4,
        n_kv_heads: 2,
        ffn: 256,
        max_ctx: 1024,
        ..TinySpec::default()
    };
    write_tiny_gguf(&path, &spec).unwrap();
    let model = Arc::new(Model::load(&path).unwrap());
    let shape = model.chunk_shape(16);
    let slot = |f: KvFormat| shape.slot_bytes(f) as u64;
    assert!(slot(KvFormat::K4v4) < slot(KvFormat::K8v8), "{shape:?}");
    // 600 tokens and a 4-token answer seal 37 chunks: room for them in k4v4, not in k8v8;
    // the next call's two chunks too.
    let budget = 40 * slot(KvFormat::K4v4);
    assert!(37 * slot(KvFormat::K8v8) > budget);
    let store = tempfile::tempdir().unwrap();
    let cfg = config(store.path(), budget, KvFormat::Int8, LoadMode::Planned);
    let mut m = Manager::open(Arc::clone(&model), cfg).unwrap();
    let o = owner();
    let id = m.create(&o, &[]).unwrap();
    let r = m
        .call(&o, id, &prompt(7, 600), &opts(4), Instant::now(), |_| true)
        .unwrap();
    assert_eq!(r.tokens.len(), 4);
    let info = m.info(&o, id).unwrap();
    assert_eq!(info.chunks, 37);
    assert!(
        !info.formats.contains_key("int8") && !info.formats.contains_key("k8v8"),
        "{:?}",
        info.formats
    );
    assert!(m.pager().resident_bytes() <= budget);
    // The next call, short, fits with its new chunk in int8, and the context still answers
    // after every chunk was given back.
    m.flush();
    m.swap_out(&o, id).unwrap();
    m.call(&o, id, &prompt(8, 20), &opts(4), Instant::now(), |_| true)
        .unwrap();
    assert!(m.pager().resident_bytes() <= budget);
    // A budget too small even for the lightest level: refused, nothing changed.
    m.set_budget(30 * slot(KvFormat::K4v3)).unwrap();
    let tokens = m.info(&o, id).unwrap().tokens;
    let e = m
        .call(&o, id, &prompt(9, 20), &opts(4), Instant::now(), |_| true)
        .unwrap_err();
    assert_eq!(e.code(), "over_budget", "{e}");
    assert_eq!(m.info(&o, id).unwrap().tokens, tokens);
}
