//! Protocol version 2 as apps use it, against a real daemon process on a real socket with the
//! tiny random-weight model: structured output (every answer, even from random weights and
//! sampled, parses and validates, or matches its regex), bad formats refused with their codes
//! and nothing changed, token accounting (`count` is what a call adds, `info` and `done` give
//! the window, `usage` adds up, `context_full` and `over_budget` carry the numbers), and a version 1
//! connection served exactly as before.

use std::io::Write;

use guide::examples::{REGEXES, SCHEMAS};
use protocol::client::{CallParams, Client};
use protocol::{PromptFormat, ResponseFormat};
use serde_json::Value;

fn world() -> tests::World {
    tests::World::chat(env!("CARGO_BIN_EXE_llms-e2e"))
}

fn schema_call(schema: &Value, seed: u64) -> CallParams {
    CallParams {
        max_tokens: 120,
        temperature: 1.0,
        seed,
        response_format: Some(ResponseFormat::JsonSchema {
            schema: schema.clone(),
        }),
        ..CallParams::default()
    }
}

#[test]
fn every_structured_answer_of_the_tiny_model_parses_and_validates() {
    let w = world();
    let _d = w.serve(&[]);
    let mut c = w.connect("forms");
    assert_eq!(c.hello().version, 2);
    for (i, (name, task, schema)) in SCHEMAS.iter().enumerate() {
        let schema: Value = serde_json::from_str(schema).unwrap();
        for seed in 0..2 {
            let ctx = c.new_context(None, PromptFormat::Chat).unwrap();
            let a = c
                .call(ctx, task, &schema_call(&schema, seed + i as u64))
                .unwrap()
                .collect_answer()
                .unwrap();
            let value: Value = serde_json::from_str(&a.text)
                .unwrap_or_else(|e| panic!("{name}: {e}: {:?} {:?}", a.text, a.done.stop));
            guide::oracle::validate(&schema, &value).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(a.done.timings.guide_ms.is_some(), "{:?}", a.done.timings);
            let end = a.done.timings.end_ms.expect("v2 gives the call's end");
            assert!(
                end >= 0.0 && end <= a.done.timings.total_ms,
                "{:?}",
                a.done.timings
            );
            c.delete(ctx).unwrap();
        }
    }
    for (name, task, pattern) in REGEXES {
        let re = regex_full(pattern);
        let ctx = c.new_context(None, PromptFormat::Chat).unwrap();
        let p = CallParams {
            max_tokens: 40,
            temperature: 1.0,
            response_format: Some(ResponseFormat::Regex {
                pattern: (*pattern).into(),
            }),
            ..CallParams::default()
        };
        let a = c.call(ctx, task, &p).unwrap().collect_answer().unwrap();
        assert!(re(&a.text), "{name}: {:?}", a.text);
        c.delete(ctx).unwrap();
    }
}

/// Whether a whole text matches `pattern`, by the guide's own automaton built without a
/// vocabulary (the regex crate is not a dependency of these tests).
fn regex_full(pattern: &str) -> impl Fn(&str) -> bool {
    let v = std::sync::Arc::new(guide::Vocab::new(0, []));
    let g = guide::Grammar::from_regex(pattern, v).unwrap();
    move |t: &str| g.matches(t.as_bytes())
}

fn error_of(c: &mut Client, ctx: u64, p: &CallParams) -> (String, String) {
    let e = c.call(ctx, "x", p).unwrap().next().unwrap().unwrap_err();
    let protocol::client::ClientError::Server { error } = e else {
        panic!("{e}")
    };
    (error.code, error.message)
}

#[test]
fn bad_formats_get_their_codes_and_change_nothing() {
    let w = world();
    let _d = w.serve(&[]);
    let mut c = w.connect("bad");
    let ctx = c.new_context(None, PromptFormat::Chat).unwrap();
    c.call(
        ctx,
        "hi",
        &CallParams {
            max_tokens: 3,
            ..CallParams::default()
        },
    )
    .unwrap()
    .collect_answer()
    .unwrap();
    let before = c.info(ctx).unwrap();
    let schema = |s: &str| CallParams {
        max_tokens: 50,
        response_format: Some(ResponseFormat::JsonSchema {
            schema: serde_json::from_str(s).unwrap(),
        }),
        ..CallParams::default()
    };
    let regex = |s: &str| CallParams {
        max_tokens: 50,
        response_format: Some(ResponseFormat::Regex { pattern: s.into() }),
        ..CallParams::default()
    };
    for (p, code, names) in [
        (
            schema(r#"{"type":"string","format":"date"}"#),
            "bad_request",
            "format",
        ),
        (
            schema(r#"{"oneOf":[{"type":"null"}]}"#),
            "bad_request",
            "oneOf",
        ),
        (schema(r#"{"type":"strng"}"#), "invalid_schema", "strng"),
        (
            schema(r#"{"type":"string","pattern":"(("}"#),
            "invalid_schema",
            "pattern",
        ),
        (schema(r#"{"enum":[]}"#), "invalid_schema", "no JSON value"),
        (
            schema(r#"{"type":"array","items":{"type":"string","maxLength":500},"minItems":400}"#),
            "too_complex",
            "too large",
        ),
        (regex("a("), "invalid_regex", "regex"),
        (regex("[a&&b]"), "invalid_regex", "no text"),
        (
            CallParams {
                max_tokens: 2,
                ..regex("[0-9]{10}")
            },
            "bad_request",
            "max_tokens",
        ),
        (
            CallParams {
                stop: vec!["}".into()],
                ..regex("x")
            },
            "bad_request",
            "stop",
        ),
    ] {
        let (got, message) = error_of(&mut c, ctx, &p);
        assert_eq!(got, code, "{message}");
        assert!(message.contains(names), "{message}");
    }
    assert_eq!(c.info(ctx).unwrap(), before);
    // The connection goes on.
    let a = c
        .call(ctx, "yes?", &regex("(yes|no)"))
        .unwrap()
        .collect_answer()
        .unwrap();
    assert!(a.text == "yes" || a.text == "no", "{:?}", a.text);
}

#[test]
fn count_is_what_a_call_adds_and_done_and_info_give_the_window() {
    let w = world();
    let _d = w.serve(&[]);
    let mut c = w.connect("accounts");
    let window = c.hello().max_context_tokens;
    let fresh = c.count(None, "Hello there", PromptFormat::Chat).unwrap();
    assert_eq!(
        (fresh.used, fresh.remaining, fresh.context_window),
        (0, window, window)
    );
    let ctx = c.new_context(None, PromptFormat::Chat).unwrap();
    let mut used = 0;
    for (i, (text, format)) in [
        ("Hello there", PromptFormat::Chat),
        (
            "And a second question, longer than the first.",
            PromptFormat::Chat,
        ),
        (" some raw text", PromptFormat::Raw),
        ("Back to chat.", PromptFormat::Chat),
    ]
    .into_iter()
    .enumerate()
    {
        let n = c.count(Some(ctx), text, format).unwrap();
        if i == 0 {
            assert_eq!(n, fresh);
        }
        assert_eq!((n.used, n.remaining), (used, window - used));
        let p = CallParams {
            format,
            max_tokens: 5,
            ..CallParams::default()
        };
        let d = c
            .call(ctx, text, &p)
            .unwrap()
            .collect_answer()
            .unwrap()
            .done;
        let u = d.usage.unwrap();
        assert_eq!(u.prompt, n.tokens, "{text}");
        assert_eq!(u.generated, d.tokens);
        assert_eq!(u.reused + u.recomputed, used, "{u:?}");
        assert_eq!(u.read, 0);
        assert_eq!(d.used, Some(d.context_tokens));
        assert_eq!(d.context_window, Some(window));
        assert_eq!(d.remaining, Some(window - d.context_tokens));
        let info = c.info(ctx).unwrap();
        assert_eq!(info.used, Some(info.tokens));
        assert_eq!(info.tokens, d.context_tokens);
        assert_eq!(info.remaining, Some(window - info.tokens));
        used = d.context_tokens;
    }
    assert_eq!(
        c.count(Some(999), "x", PromptFormat::Raw)
            .unwrap_err()
            .code(),
        Some("not_found")
    );
}

#[test]
fn context_full_carries_the_numbers() {
    let w = world();
    let _d = w.serve(&["--no-window"]);
    let mut c = w.connect("full");
    let ctx = c.new_context(None, PromptFormat::Raw).unwrap();
    let text = "many words ".repeat(400);
    let n = c.count(Some(ctx), &text, PromptFormat::Raw).unwrap();
    assert!(n.tokens >= n.remaining, "{n:?}");
    let p = CallParams {
        format: PromptFormat::Raw,
        max_tokens: 4,
        ..CallParams::default()
    };
    let e = c.call(ctx, &text, &p).unwrap().next().unwrap().unwrap_err();
    let protocol::client::ClientError::Server { error } = e else {
        panic!("{e}")
    };
    assert_eq!(error.code, "context_full", "{}", error.message);
    let t = error.tokens.expect("the numbers");
    assert_eq!(t.context_window, n.context_window);
    assert_eq!((t.used, t.remaining), (0, n.context_window));
    assert_eq!(t.needed, n.tokens + 1);
}

#[test]
fn a_call_past_the_kv_budget_is_refused_with_the_numbers_and_changes_nothing() {
    let w = world();
    // The tiny model's int8 chunk takes one 4 KiB page: 64 KiB hold 16 chunks (256 tokens).
    let _d = w.serve(&["--kv-budget", "64K", "--no-pressure"]);
    let mut c = w.connect("big");
    let ctx = c.new_context(None, PromptFormat::Raw).unwrap();
    let p = CallParams {
        format: PromptFormat::Raw,
        max_tokens: 4,
        ..CallParams::default()
    };
    let fits = c
        .call(ctx, &"word ".repeat(10), &p)
        .unwrap()
        .collect_answer();
    assert!(fits.is_ok(), "{fits:?}");
    let before = c.info(ctx).unwrap();
    let e = c
        .call(ctx, &"word ".repeat(60), &p)
        .unwrap()
        .next()
        .unwrap()
        .unwrap_err();
    let protocol::client::ClientError::Server { error } = e else {
        panic!("{e}")
    };
    assert_eq!(error.code, "over_budget", "{}", error.message);
    let m = error.memory.expect("the numbers");
    assert_eq!(m.budget, 64 << 10);
    assert!(m.needed > m.budget, "{m:?}");
    assert!(
        error.message.contains(&m.needed.to_string()),
        "{}",
        error.message
    );
    assert_eq!(
        c.info(ctx).unwrap().tokens,
        before.tokens,
        "nothing changed"
    );
    let again = c
        .call(ctx, &"word ".repeat(5), &p)
        .unwrap()
        .collect_answer();
    assert!(again.is_ok(), "the context still answers: {again:?}");
}

#[test]
fn a_version_1_connection_is_served_as_before() {
    let w = world();
    let _d = w.serve(&[]);
    let (mut r, mut out, ctx) = tests::v1_connection(&w);
    let mut send = |l: &str| out.write_all(format!("{l}\n").as_bytes()).unwrap();
    send(&format!(
        r#"{{"op":"call","id":3,"context":{ctx},"prompt":"hi","max_tokens":2}}"#
    ));
    let done = loop {
        let v = tests::reply_line(&mut r);
        if v["event"] == "done" {
            break v;
        }
    };
    for v2 in ["usage", "context_window", "used", "remaining"] {
        assert!(done.get(v2).is_none(), "{done}");
    }
    assert!(done["timings"].get("guide_ms").is_none(), "{done}");
    assert!(done["timings"].get("end_ms").is_none(), "{done}");
    send(&format!(r#"{{"op":"info","id":4,"context":{ctx}}}"#));
    let info = tests::reply_line(&mut r);
    assert!(info["context"].get("context_window").is_none(), "{info}");
    send(r#"{"op":"count","id":5,"text":"x"}"#);
    let e = tests::reply_line(&mut r);
    assert_eq!(e["error"]["code"], "bad_request", "{e}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("version 2")
    );
    send(&format!(
        r#"{{"op":"call","id":6,"context":{ctx},"prompt":"x","response_format":{{"type":"regex","pattern":"x"}}}}"#
    ));
    assert_eq!(tests::reply_line(&mut r)["error"]["code"], "bad_request");
    send(&format!(r#"{{"op":"prewarm","id":7,"context":{ctx}}}"#));
    let e = tests::reply_line(&mut r);
    assert_eq!(e["error"]["code"], "bad_request", "{e}");
    // And the typed client of this crate speaks version 2 on the same daemon.
    let mut c = w.connect("new");
    assert_eq!(c.hello().version, 2);
    let n = c.count(None, "x", PromptFormat::Raw).unwrap();
    assert_eq!(n.tokens, 1);
}
