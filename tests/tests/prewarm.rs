//! `prewarm` through a real daemon on a real socket with the real default model (SmolLM2-135M,
//! fetched as `llms model fetch` does): a context swapped out (the daemon restarted, so none of
//! its chunks is resident) and prewarmed is called with nothing left to load; a prewarm waits
//! behind the calls queued with it; bad prewarms get their codes and change nothing.

use std::io::{BufReader, Write};
use std::os::unix::net::UnixStream;

use model::fetch::{self, FetchOptions};
use protocol::PromptFormat;
use protocol::client::{CallParams, Client};

fn real_world() -> tests::World {
    let path = fetch::default_model_path(&FetchOptions::default())
        .unwrap_or_else(|e| panic!("cannot fetch the default model: {e}"));
    tests::World::with_model(env!("CARGO_BIN_EXE_llms-e2e"), &path)
}

/// A prompt of a few hundred tokens: enough chunks that a switch has something to load.
fn long_prompt(topic: &str) -> String {
    let line = format!(
        "Here is a note about {topic}: it matters to the people who read it, and every line \
         of it is kept for later. "
    );
    line.repeat(12)
}

fn greedy(max_tokens: usize) -> CallParams {
    CallParams {
        max_tokens,
        ..CallParams::default()
    }
}

/// A context with a system prompt and one call of a long prompt.
fn context_of(c: &mut Client, topic: &str) -> u64 {
    let ctx = c
        .new_context(Some("You answer in one sentence."), PromptFormat::Chat)
        .unwrap();
    let a = c
        .call(ctx, &long_prompt(topic), &greedy(8))
        .unwrap()
        .collect_answer()
        .unwrap();
    assert!(a.done.context_tokens > 200, "{}", a.done.context_tokens);
    ctx
}

#[test]
#[allow(clippy::print_stderr)] // the switch latencies, for people reading the log
fn a_prewarmed_context_is_called_with_every_chunk_resident() {
    let w = real_world();
    let d = w.serve(&[]);
    let mut c = w.connect("notes");
    let (warm, cold) = (
        context_of(&mut c, "rivers"),
        context_of(&mut c, "mountains"),
    );
    drop(c);
    assert!(d.term().success());
    // Restarted: every context is in the store, none of its chunks in memory.
    let _d = w.serve(&[]);
    let mut c = w.connect("notes");
    let before = c.info(warm).unwrap();
    assert!(
        before.chunks > 10 && before.resident_chunks == 0,
        "{before:?}"
    );
    let p = c.prewarm(warm).unwrap();
    assert_eq!(
        (p.chunks, p.missing),
        (before.chunks, before.chunks),
        "{p:?}"
    );
    assert_eq!(p.read + p.recomputed, p.missing, "{p:?}");
    assert!(
        p.read > 0 && p.read_bytes > 0,
        "the stored chunks are read: {p:?}"
    );
    let after = c.info(warm).unwrap();
    assert_eq!(after.resident_chunks, after.chunks, "{after:?}");
    // Prewarming again has nothing to do.
    let again = c.prewarm(warm).unwrap();
    assert_eq!((again.missing, again.read, again.recomputed), (0, 0, 0));
    let w_done = c
        .call(warm, "And in one word?", &greedy(4))
        .unwrap()
        .collect_answer()
        .unwrap()
        .done;
    assert_eq!(w_done.chunks.missing, 0, "{:?}", w_done.chunks);
    assert_eq!(w_done.chunks.read + w_done.chunks.recomputed, 0);
    // The context not prewarmed loads its chunks in its call's switch.
    let c_done = c
        .call(cold, "And in one word?", &greedy(4))
        .unwrap()
        .collect_answer()
        .unwrap()
        .done;
    assert_eq!(c_done.chunks.missing, before.chunks, "{:?}", c_done.chunks);
    eprintln!(
        "switch after prewarm {:.3} ms (prewarm's Load {:.3} ms, {} chunks); without {:.3} ms \
         ({} chunks loaded)",
        w_done.timings.switch_ms,
        p.load_ms,
        p.missing,
        c_done.timings.switch_ms,
        c_done.chunks.missing
    );
}

#[test]
fn a_prewarm_waits_behind_the_calls_queued_with_it() {
    let w = real_world();
    let _d = w.serve(&[]);
    let mut c = w.connect("queue");
    let (busy, idle, next) = (
        c.new_context(None, PromptFormat::Chat).unwrap(),
        context_of(&mut c, "lakes"),
        c.new_context(None, PromptFormat::Chat).unwrap(),
    );
    let s = UnixStream::connect(w.socket()).unwrap();
    let mut out = s.try_clone().unwrap();
    let mut r = BufReader::new(s);
    out.write_all(b"{\"op\":\"hello\",\"id\":1,\"version\":2,\"app\":\"queue\"}\n")
        .unwrap();
    assert_eq!(tests::reply_line(&mut r)["event"], "hello");
    // One write: a long call, then a prewarm, then a call; the prewarm is queued before the
    // second call, and runs after it.
    let lines = format!(
        "{{\"op\":\"call\",\"id\":2,\"context\":{busy},\"prompt\":\"Count from one to one \
         hundred in words.\",\"max_tokens\":48}}\n\
         {{\"op\":\"prewarm\",\"id\":3,\"context\":{idle}}}\n\
         {{\"op\":\"call\",\"id\":4,\"context\":{next},\"prompt\":\"Hi\",\"max_tokens\":1}}\n"
    );
    out.write_all(lines.as_bytes()).unwrap();
    let mut ended = Vec::new();
    while ended.len() < 3 {
        let v = tests::reply_line(&mut r);
        assert!(v.get("error").is_none(), "{v}");
        if v["event"] != "token" {
            ended.push((
                v["id"].as_u64().unwrap(),
                v["event"].as_str().unwrap().to_owned(),
            ));
        }
    }
    let order: Vec<(u64, &str)> = ended.iter().map(|(i, e)| (*i, e.as_str())).collect();
    assert_eq!(order, [(2, "done"), (4, "done"), (3, "prewarmed")]);
}

#[test]
fn bad_prewarms_get_their_codes_and_change_nothing() {
    let w = tests::World::new(env!("CARGO_BIN_EXE_llms-e2e"));
    let _d = w.serve(&[]);
    let mut c = w.connect("bad");
    let ctx = c.new_context(None, PromptFormat::Raw).unwrap();
    tests::ask(&mut c, ctx, "a few words of text", 4);
    let before = c.info(ctx).unwrap();
    let e = c.prewarm(ctx + 100).unwrap_err();
    assert_eq!(e.code(), Some("not_found"), "{e}");
    assert_eq!(c.info(ctx).unwrap(), before);
    // Another app of the same uid may prewarm it (contexts belong to the uid).
    let mut other = w.connect("other");
    let p = other.prewarm(ctx).unwrap();
    assert_eq!(p.missing, 0, "{p:?}");
    c.delete(ctx).unwrap();
    let e = c.prewarm(ctx).unwrap_err();
    assert_eq!(e.code(), Some("not_found"), "{e}");
}
