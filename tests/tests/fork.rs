//! `fork` and shared prefixes through a real daemon on a real socket with the real default model
//! (SmolLM2-135M): eight forks of one context with a 1,000-token prefix hold its chunks once in
//! memory and in the store, answer as their parent does, and a switch among them reads only
//! their own chunks; a kill -9 at any moment of a fork loses nothing and leaks nothing (the
//! store's links checked at open); bad forks get their codes.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use kvfs::{ContextId, Store, StoreOptions, StoreState};
use model::fetch::{self, FetchOptions};
use protocol::PromptFormat;
use protocol::client::{CallParams, Client};

fn real_world() -> tests::World {
    let path = fetch::default_model_path(&FetchOptions::default())
        .unwrap_or_else(|e| panic!("cannot fetch the default model: {e}"));
    tests::World::with_model(env!("CARGO_BIN_EXE_llms-e2e"), &path)
}

/// A system prompt of about a thousand tokens.
fn manual() -> String {
    let mut s = String::from("You are the help desk of a library. Rules:\n");
    for i in 1..=60 {
        s.push_str(&format!(
            "{i}. A book borrowed on day {i} comes back within {} days, or the reader pays.\n",
            i + 13
        ));
    }
    s
}

fn greedy(max_tokens: usize) -> CallParams {
    CallParams {
        max_tokens,
        ..CallParams::default()
    }
}

fn ask(c: &mut Client, ctx: u64, q: &str) -> protocol::client::Answer {
    c.call(ctx, q, &greedy(8))
        .unwrap()
        .collect_answer()
        .unwrap()
}

/// Bytes a context's data file takes on disk (its sparse slots' blocks).
fn stored_bytes(store: &Path, id: u64) -> u64 {
    let data = store.join("contexts").join(id.to_string()).join("data");
    std::fs::metadata(data).map_or(0, |m| m.blocks() * 512)
}

#[test]
#[allow(clippy::print_stderr)] // the bytes held, for people reading the log
fn eight_forks_of_one_prefix_hold_its_chunks_once() {
    let w = real_world();
    let _d = w.serve(&[]);
    let mut c = w.connect("desk");
    let parent = c.new_context(Some(&manual()), PromptFormat::Chat).unwrap();
    let first = ask(
        &mut c,
        parent,
        "How long may I keep a book borrowed on day 3?",
    );
    assert!(
        first.done.context_tokens > 1000,
        "{}",
        first.done.context_tokens
    );
    let chunks = c.info(parent).unwrap().chunks;
    let mut ms = Vec::new();
    let forks: Vec<u64> = (0..8)
        .map(|_| {
            let t = std::time::Instant::now();
            let f = c.fork(parent).unwrap();
            ms.push(format!("{:.1}", t.elapsed().as_secs_f64() * 1e3));
            f
        })
        .collect();
    eprintln!("forks of {chunks} chunks took {} ms", ms.join(", "));
    for &f in forks.iter().chain([&parent]) {
        let i = c.info(f).unwrap();
        assert_eq!(i.shared_chunks, Some(chunks), "{i:?}");
        assert_eq!(i.tokens, first.done.context_tokens, "{i:?}");
    }
    let s = c.stats().unwrap();
    assert_eq!(s.service.shared_prefixes, 1);
    // Memory: the prefix once; no context holds a chunk of its own yet.
    assert_eq!(s.service.resident_bytes, s.service.shared_resident_bytes);
    let prefix = s.service.shared_resident_bytes;
    // The store: one copy, in the prefix; the forks' data files hold nothing.
    let store = w.store();
    let held: Vec<u64> = forks.iter().map(|&f| stored_bytes(&store, f)).collect();
    assert!(held.iter().all(|&b| b == 0), "{held:?}");
    let prefixes: Vec<u64> = std::fs::read_dir(store.join("contexts"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("shared").exists())
        .map(|p| p.file_name().unwrap().to_str().unwrap().parse().unwrap())
        .collect();
    assert_eq!(prefixes.len(), 1, "{prefixes:?}");
    let on_disk = stored_bytes(&store, prefixes[0]);
    assert!(on_disk > 0);
    eprintln!(
        "{chunks} chunks shared by 9 contexts: {:.2} MiB resident once (not {:.2}), {:.2} MiB \
         on disk once, in the prefix; 0 in each fork",
        prefix as f64 / (1 << 20) as f64,
        9.0 * prefix as f64 / (1 << 20) as f64,
        on_disk as f64 / (1 << 20) as f64
    );
    // Every fork answers the next question as its parent does.
    let q = "And one borrowed on day 7?";
    let expected = ask(&mut c, parent, q).tokens;
    for &f in &forks {
        let a = ask(&mut c, f, q);
        assert_eq!(a.tokens, expected, "fork {f}");
        // A switch to a fork reads none of the shared chunks: they are resident.
        let u = a.done.usage.unwrap();
        assert_eq!(u.read, 0, "{u:?}");
    }
    // Another uid cannot fork ours.
    let out = {
        use std::os::unix::process::CommandExt;
        w.llms()
            .args(["ctx", "fork", &parent.to_string(), "--socket"])
            .arg(w.socket())
            .uid(65534)
            .gid(65534)
            .output()
            .unwrap()
    };
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not_found"),
        "{out:?}"
    );
    // Nor can anyone fork a context that is not there.
    let err = c.fork(999_999).unwrap_err();
    assert_eq!(err.code(), Some("not_found"), "{err}");
    // The CLI forks and prints the new id.
    let out = w
        .llms()
        .args(["ctx", "fork", &parent.to_string(), "--socket"])
        .arg(w.socket())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let child: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    let now = c.info(parent).unwrap().chunks;
    assert!(now > chunks);
    assert_eq!(c.info(child).unwrap().shared_chunks, Some(now));
}

#[test]
fn a_kill_during_a_fork_loses_nothing_and_leaks_nothing() {
    let w = real_world();
    let seed = tests::seed("a_kill_during_a_fork_loses_nothing_and_leaks_nothing");
    let d = w.serve(&[]);
    let mut c = w.connect("desk");
    let parent = c.new_context(Some(&manual()), PromptFormat::Chat).unwrap();
    let said = ask(
        &mut c,
        parent,
        "How long may I keep a book borrowed on day 3?",
    );
    let mut tokens = said.done.context_tokens;
    // A second call makes new chunks of the parent's own after its first fork.
    let mut d = Some(d);
    for round in 0..4u64 {
        let socket = w.socket();
        let forker = std::thread::spawn(move || {
            let Ok(mut c) = Client::connect(&socket, "forker") else {
                return;
            };
            for _ in 0..3 {
                if c.fork(parent).is_err() {
                    break;
                }
            }
        });
        // Somewhere inside a fork: the first of a prefix takes some hundreds of milliseconds
        // (the parent's write-out it waits for, its chunks written), the others some tens.
        // Round r kills at a random point of its own 300 ms band, 30 ms to 1.23 s in all, so
        // the later rounds leave a fork time to finish whatever the seed (a seed whose four
        // points all fell before the first fork once left nothing to check).
        let jitter =
            (seed ^ round.wrapping_mul(0x9E37_79B9_7F4A_7C15)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        let ms = round * 300 + (jitter >> 33) % 300;
        std::thread::sleep(std::time::Duration::from_millis(30 + ms));
        d.take().unwrap().kill9();
        forker.join().unwrap();
        d = Some(w.serve(&[]));
        let mut c = w.connect("desk");
        assert_eq!(c.info(parent).unwrap().tokens, tokens, "round {round}");
        if round == 1 {
            tokens = ask(&mut c, parent, "And on day 7?").done.context_tokens;
        }
    }
    // Every context the daemon answered `created` for, or took back, answers; those with the
    // same history answer alike.
    let mut c = w.connect("desk");
    let mut contexts = c.list().unwrap();
    assert!(contexts.len() > 1, "no fork made it: {contexts:?}");
    contexts.sort_by_key(|x| x.tokens);
    let q = "And one borrowed on day 9?";
    let mut reference: std::collections::BTreeMap<usize, Vec<u32>> = Default::default();
    for x in &contexts {
        let a = ask(&mut c, x.id, q).tokens;
        let first = reference.entry(x.tokens).or_insert_with(|| a.clone());
        assert_eq!(&a, first, "context {} of {} tokens", x.id, x.tokens);
    }
    drop(c);
    assert!(d.take().unwrap().term().success());
    // The store, opened as the daemon opens it: nothing quarantined, every link whole, no
    // prefix without a context that borrows from it.
    let store = Store::open(&w.store(), StoreOptions::default()).unwrap();
    let bad: Vec<_> = (store.recovered().iter())
        .filter(|r| r.action != "removed")
        .collect();
    assert!(bad.is_empty(), "{bad:?}");
    for id in store.list_contexts() {
        if store.is_shared(id).unwrap() {
            assert!(store.referrers(id) > 0, "prefix {id} leaked");
        }
        let Some(link) = store.link(id).unwrap() else {
            continue;
        };
        for i in 0..link.chunks {
            let owner = lender(&store, id, i);
            let state = store.chunk_state(owner, i).unwrap();
            assert!(
                matches!(state, StoreState::Stored(_)),
                "chunk {i} of context {id} (held by {owner}): {state:?}"
            );
        }
    }
}

/// The context that holds chunk `i` of context `id`, following links down.
fn lender(store: &Store, id: ContextId, i: u32) -> ContextId {
    match store.link(id).unwrap() {
        Some(l) if i < l.chunks => lender(store, ContextId(l.base), i),
        _ => id,
    }
}
