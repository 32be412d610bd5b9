//! Transcripts through a real daemon on a real socket (a tiny random-weight model with a ChatML
//! template): every call's turns are recorded and `export` gives them, after a restart and after
//! `kill -9` too; `new` with a transcript rebuilds a context, prefilled; a context of another model
//! is rebuilt from its transcript on its first use; bad transcripts get their codes and change
//! nothing.

use model::tiny::{TINY_CHATML, TinySpec, write_tiny_gguf};
use protocol::client::{CallParams, Client};
use protocol::{PromptFormat, Transcript, Turn};

fn world() -> tests::World {
    tests::World::chat(env!("CARGO_BIN_EXE_llms-e2e"))
}

fn chat(max_tokens: usize) -> CallParams {
    CallParams {
        max_tokens,
        ..CallParams::default()
    }
}

fn turn(role: &str, text: &str) -> Turn {
    Turn {
        role: role.into(),
        text: text.into(),
    }
}

/// A chat context with a system prompt and two calls; returns it and the turns it must hold.
fn conversation(c: &mut Client) -> (u64, Vec<Turn>) {
    let ctx = c
        .new_context(Some("You are brief."), PromptFormat::Chat)
        .unwrap();
    let mut turns = vec![turn("system", "You are brief.")];
    for prompt in ["Name a colour.", "And a fruit?"] {
        let a = c
            .call(ctx, prompt, &chat(6))
            .unwrap()
            .collect_answer()
            .unwrap();
        turns.push(turn("user", prompt));
        turns.push(turn("assistant", &a.text));
    }
    (ctx, turns)
}

#[test]
fn every_call_is_recorded_and_export_gives_it_after_a_restart() {
    let w = world();
    let d = w.serve(&[]);
    let mut c = w.connect("notes");
    let (ctx, turns) = conversation(&mut c);
    assert_eq!(c.export(ctx).unwrap().turns, turns);
    // Raw text: the prompt and the continuation, each a raw turn.
    let raw = c.new_context(None, PromptFormat::Raw).unwrap();
    let a = tests::ask(&mut c, raw, "Once upon a time", 5);
    let mut raw_turns = vec![turn("raw", "Once upon a time")];
    if !a.text.is_empty() {
        raw_turns.push(turn("raw", &a.text));
    }
    assert_eq!(c.export(raw).unwrap().turns, raw_turns);
    // An empty context has an empty transcript.
    let empty = c.new_context(None, PromptFormat::Chat).unwrap();
    assert_eq!(c.export(empty).unwrap(), Transcript::default());
    drop(c);
    assert!(d.term().success());
    let _d = w.serve(&[]);
    let mut c = w.connect("notes");
    assert_eq!(c.export(ctx).unwrap().turns, turns);
    assert_eq!(c.export(raw).unwrap().turns, raw_turns);
    let e = c.export(ctx + 100).unwrap_err();
    assert_eq!(e.code(), Some("not_found"), "{e}");
}

#[test]
fn a_context_rebuilt_from_a_transcript_holds_its_turns_prefilled() {
    let w = world();
    let _d = w.serve(&[]);
    let mut c = w.connect("mover");
    let (ctx, turns) = conversation(&mut c);
    let t = c.export(ctx).unwrap();
    let copy = c.new_from_transcript(&t).unwrap();
    assert_ne!(copy, ctx);
    assert_eq!(c.export(copy).unwrap().turns, turns);
    let info = c.info(copy).unwrap();
    let original = c.info(ctx).unwrap();
    // The same conversation in the same template: about as many tokens (the answers' text may
    // tokenize a little differently from the tokens the model chose).
    assert!(
        info.tokens.abs_diff(original.tokens) <= 8,
        "{info:?} {original:?}"
    );
    // Prefilled: its sealed chunks are resident before any call.
    assert!(info.chunks > 0, "{info:?}");
    assert_eq!(info.resident_chunks, info.chunks, "{info:?}");
    // It goes on like any context, and records on.
    let a = c
        .call(copy, "And a tree?", &chat(4))
        .unwrap()
        .collect_answer()
        .unwrap();
    assert_eq!(a.done.chunks.missing, 0, "{:?}", a.done.chunks);
    let mut more = turns.clone();
    more.push(turn("user", "And a tree?"));
    more.push(turn("assistant", &a.text));
    assert_eq!(c.export(copy).unwrap().turns, more);
}

#[test]
fn bad_transcripts_get_their_codes_and_change_nothing() {
    let w = world();
    let _d = w.serve(&[]);
    let mut c = w.connect("bad");
    let (ctx, turns) = conversation(&mut c);
    let before = c.list().unwrap();
    let unknown = Transcript {
        turns: vec![turn("user", "hi"), turn("robot", "beep")],
    };
    let e = c.new_from_transcript(&unknown).unwrap_err();
    assert_eq!(e.code(), Some("invalid_transcript"), "{e}");
    assert!(e.to_string().contains("robot"), "{e}");
    // More tokens than a context holds.
    let long = Transcript {
        turns: vec![turn("user", &"many words of text ".repeat(400))],
    };
    let e = c.new_from_transcript(&long).unwrap_err();
    assert_eq!(e.code(), Some("context_full"), "{e}");
    let protocol::client::ClientError::Server { error } = &e else {
        panic!("{e}")
    };
    let n = error.tokens.expect("the numbers");
    assert_eq!(n.context_window, tests::MAX_CONTEXT);
    assert!(n.needed > tests::MAX_CONTEXT, "{n:?}");
    assert_eq!(c.list().unwrap(), before);
    assert_eq!(c.export(ctx).unwrap().turns, turns);
}

#[test]
fn a_kill_9_during_exports_loses_nothing() {
    let w = world();
    let d = w.serve(&[]);
    let mut c = w.connect("crash");
    let (ctx, turns) = conversation(&mut c);
    // Exports in flight on another connection when the daemon is killed.
    let socket = w.socket();
    let exporter = std::thread::spawn(move || {
        let mut c = Client::connect(&socket, "crash").unwrap();
        let mut n = 0;
        while c.export(ctx).is_ok() {
            n += 1;
        }
        n
    });
    std::thread::sleep(std::time::Duration::from_millis(50));
    d.kill9();
    assert!(
        exporter.join().unwrap() > 0,
        "no export ran before the kill"
    );
    let _d = w.serve(&[]);
    let mut c = w.connect("crash");
    assert_eq!(c.export(ctx).unwrap().turns, turns);
    // Every completed call is in the transcript, the one answered just before a kill too.
    let a = c
        .call(ctx, "One more?", &chat(3))
        .unwrap()
        .collect_answer()
        .unwrap();
    drop(c);
    drop(_d);
    let _d = w.serve(&[]);
    let mut c = w.connect("crash");
    let mut more = turns;
    more.push(turn("user", "One more?"));
    more.push(turn("assistant", &a.text));
    assert_eq!(c.export(ctx).unwrap().turns, more);
}

#[test]
fn a_context_of_another_model_is_rebuilt_from_its_transcript_on_first_use() {
    let w = world();
    let d = w.serve(&[]);
    let mut c = w.connect("upgrade");
    let (ctx, turns) = conversation(&mut c);
    drop(c);
    assert!(d.term().success());
    // The model file changes (an update): another fingerprint, another tokenizer's weights.
    let spec = TinySpec {
        max_ctx: tests::MAX_CONTEXT,
        seed: 99,
        chat_template: Some(TINY_CHATML.into()),
        ..TinySpec::default()
    };
    write_tiny_gguf(&w.model, &spec).unwrap();
    let _d = w.serve(&[]);
    let mut c = w.connect("upgrade");
    // Export reads it as it is, without rebuilding it.
    assert_eq!(c.export(ctx).unwrap().turns, turns);
    // First use: rebuilt from the transcript, never loaded.
    let info = c.info(ctx).unwrap();
    assert!(info.tokens > 0 && info.resident_chunks == 0, "{info:?}");
    let a = c
        .call(ctx, "And now?", &chat(3))
        .unwrap()
        .collect_answer()
        .unwrap();
    assert_eq!(a.done.chunks.read, 0, "{:?}", a.done.chunks);
    assert_eq!(a.done.chunks.recomputed, info.chunks, "{:?}", a.done.chunks);
    let mut more = turns;
    more.push(turn("user", "And now?"));
    more.push(turn("assistant", &a.text));
    assert_eq!(c.export(ctx).unwrap().turns, more);
    assert_eq!(c.list().unwrap().len(), 1);
}
