//! Tools (protocol version 2) against a real daemon process on a real socket with the tiny
//! random-weight model, the adversary of a grammar: with a call required, every answer, sampled,
//! is a call of a declared tool whose arguments validate against its schema (the naive oracle),
//! streamed as one `tool_call` event; a `tool_result` continues the same context; tool calls and
//! results are turns of the transcript, kept over a restart and rebuilt by `new`; bad input gets
//! its code and changes nothing; a version 1 connection is refused every tool field.

use std::io::Write;

use guide::examples::SCHEMAS;
use protocol::client::{Answer, CallParams, Client, ClientError};
use protocol::{PromptFormat, Tool, ToolChoice};
use serde_json::Value;

fn world() -> tests::World {
    tests::World::chat(env!("CARGO_BIN_EXE_llms-e2e"))
}

/// The `n` shortest object schemas of the examples, as tools (their declaration takes the tiny
/// model's byte tokens: a few hundred of its 1,024).
fn tools(n: usize) -> Vec<Tool> {
    let mut objects: Vec<_> = SCHEMAS
        .iter()
        .filter(|(_, _, s)| s.starts_with(r#"{"type":"object""#))
        .collect();
    objects.sort_by_key(|(_, _, s)| s.len());
    objects
        .into_iter()
        .take(n)
        .map(|(name, _, s)| Tool {
            name: (*name).into(),
            description: String::new(),
            parameters: serde_json::from_str(s).unwrap(),
        })
        .collect()
}

/// A sampled call, long enough for any call of [`tools`], or a short plain answer.
fn sampled(seed: u64, choice: Option<ToolChoice>) -> CallParams {
    let max_tokens = match choice {
        Some(ToolChoice::None) => 12,
        _ => 150,
    };
    CallParams {
        max_tokens,
        temperature: 1.0,
        seed,
        tool_choice: choice,
        ..CallParams::default()
    }
}

/// The answer's tool call, checked: a declared tool, arguments that validate, no text streamed,
/// `done` stopped by it.
fn checked_call(a: &Answer, tools: &[Tool]) -> String {
    let call = a
        .tool_call
        .as_ref()
        .unwrap_or_else(|| panic!("no tool call: {:?} ({})", a.text, a.done.stop));
    let tool = tools
        .iter()
        .find(|t| t.name == call.name)
        .unwrap_or_else(|| panic!("an undeclared tool {:?}", call.name));
    guide::oracle::validate(&tool.parameters, &call.arguments)
        .unwrap_or_else(|e| panic!("{}: {e}: {}", call.name, call.arguments));
    assert_eq!(a.done.stop, "tool_call");
    assert!(
        a.text.is_empty(),
        "a tool call's tokens are not text: {:?}",
        a.text
    );
    assert!(a.done.timings.guide_ms.is_some());
    call.name.clone()
}

fn roles(c: &mut Client, ctx: u64) -> Vec<String> {
    c.export(ctx)
        .unwrap()
        .turns
        .into_iter()
        .map(|t| t.role)
        .collect()
}

/// Kept whole: one scenario, a context's tool calls and results from declaration to restart and
/// rebuild.
#[test]
fn every_required_tool_call_validates_and_a_result_continues_the_context() {
    let w = world();
    let d = w.serve(&[]);
    let mut c = w.connect("agent");
    let tools = tools(2);
    assert_eq!(tools.len(), 2);
    let mut called = std::collections::BTreeSet::new();
    for seed in 0..12 {
        let ctx = c.new_with_tools(Some("You use tools."), &tools).unwrap();
        let a = c
            .call(ctx, "Do it.", &sampled(seed, Some(ToolChoice::Required)))
            .unwrap()
            .collect_answer()
            .unwrap();
        called.insert(checked_call(&a, &tools));
        let before = c.info(ctx).unwrap().tokens;
        // The result continues the same context: its tokens follow the call's.
        let r = c
            .tool_result(
                ctx,
                r#"{"ok":true}"#,
                &sampled(seed, Some(ToolChoice::None)),
            )
            .unwrap()
            .collect_answer()
            .unwrap();
        assert!(r.tool_call.is_none() && r.done.stop != "tool_call");
        assert!(r.done.usage.unwrap().reused + r.done.usage.unwrap().recomputed >= before);
        assert_eq!(r.done.context_tokens, c.info(ctx).unwrap().tokens);
        assert!(r.done.context_tokens > before);
        assert_eq!(
            roles(&mut c, ctx),
            ["tools", "system", "user", "tool_call", "tool", "assistant"]
        );
        c.delete(ctx).unwrap();
    }
    assert!(!called.is_empty());
    // A named tool is the one called (the tiny model, left to choose, may favour one); tools
    // declared on a call replace the context's (none here) and stay in force for the next.
    for seed in 0..3 {
        let ctx = c.new_context(None, PromptFormat::Chat).unwrap();
        let p = CallParams {
            tools: tools.clone(),
            ..sampled(seed, Some(ToolChoice::Tool(tools[1].name.clone())))
        };
        let a = c.call(ctx, "Again.", &p).unwrap().collect_answer().unwrap();
        assert_eq!(checked_call(&a, &tools), tools[1].name);
        let r = c
            .tool_result(ctx, "done", &sampled(seed, Some(ToolChoice::Required)))
            .unwrap()
            .collect_answer()
            .unwrap();
        // A result may be followed by another call: the context's tools stay in force.
        checked_call(&r, &tools);
        assert_eq!(
            roles(&mut c, ctx),
            ["tools", "user", "tool_call", "tool", "tool_call"]
        );
        c.delete(ctx).unwrap();
    }
    // With auto, every answer is a plain one or a whole valid call.
    for seed in 0..6 {
        let ctx = c.new_with_tools(None, &tools).unwrap();
        let a = c
            .call(ctx, "Maybe.", &sampled(seed, None))
            .unwrap()
            .collect_answer()
            .unwrap();
        if a.tool_call.is_some() {
            checked_call(&a, &tools);
        } else {
            assert!(!a.text.starts_with("<tool_call>\n"), "{:?}", a.text);
            assert_ne!(a.done.stop, "tool_call");
        }
        c.delete(ctx).unwrap();
    }
    // A pending call survives a restart, recorded as a turn; its result is taken after it.
    let ctx = c.new_with_tools(None, &tools[..1]).unwrap();
    let a = c
        .call(ctx, "Now.", &sampled(1, Some(ToolChoice::Required)))
        .unwrap()
        .collect_answer()
        .unwrap();
    checked_call(&a, &tools[..1]);
    let exported = c.export(ctx).unwrap();
    let json: Value = serde_json::from_str(&exported.turns[2].text).unwrap();
    assert_eq!(json["name"], tools[0].name.as_str());
    assert_eq!(json["arguments"], a.tool_call.as_ref().unwrap().arguments);
    drop(c);
    assert!(d.term().success());
    let _d = w.serve(&[]);
    let mut c = w.connect("agent");
    assert_eq!(c.export(ctx).unwrap(), exported);
    c.tool_result(ctx, "sunny", &sampled(2, Some(ToolChoice::None)))
        .unwrap()
        .collect_answer()
        .unwrap();
    // Rebuilt from its transcript, a context has its tools in force.
    let t = c.export(ctx).unwrap();
    assert_eq!(
        roles(&mut c, ctx),
        ["tools", "user", "tool_call", "tool", "assistant"]
    );
    let copy = c.new_from_transcript(&t).unwrap();
    assert_eq!(c.export(copy).unwrap(), t);
    let a = c
        .call(copy, "Once more.", &sampled(3, Some(ToolChoice::Required)))
        .unwrap()
        .collect_answer()
        .unwrap();
    checked_call(&a, &tools[..1]);
}

fn error_of(r: Result<Answer, ClientError>) -> (String, String) {
    match r {
        Err(ClientError::Server { error }) => (error.code, error.message),
        other => panic!("not an error reply: {other:?}"),
    }
}

/// Kept whole: a table of bad inputs against one daemon, then the check that nothing changed.
#[test]
fn bad_tool_input_gets_its_code_and_changes_nothing() {
    let w = world();
    let _d = w.serve(&[]);
    let mut c = w.connect("bad");
    let tools = tools(1);
    let ctx = c.new_with_tools(None, &tools).unwrap();
    let plain = c.new_context(None, PromptFormat::Chat).unwrap();
    c.call(plain, "hi", &sampled(0, None))
        .unwrap()
        .collect_answer()
        .unwrap();
    let contexts = c.list().unwrap();
    let exported = (c.export(ctx).unwrap(), c.export(plain).unwrap());
    let with = |t: Vec<Tool>, choice: Option<ToolChoice>| CallParams {
        tools: t,
        ..sampled(0, choice)
    };
    let tool = |name: &str, schema: &str| Tool {
        name: name.into(),
        description: String::new(),
        parameters: serde_json::from_str(schema).unwrap(),
    };
    let object = r#"{"type":"object"}"#;
    let cases: Vec<(u64, CallParams, &str, &str)> = vec![
        (
            plain,
            with(
                vec![tool("when", r#"{"type":"string","format":"date"}"#)],
                None,
            ),
            "bad_request",
            "\"format\" at # of tool \"when\"",
        ),
        (
            plain,
            with(
                vec![tool("a", object), tool("odd", r#"{"type":"strng"}"#)],
                None,
            ),
            "invalid_schema",
            "tool \"odd\"",
        ),
        (
            plain,
            with(vec![tool("a", object), tool("a", object)], None),
            "bad_request",
            "\"a\"",
        ),
        (
            plain,
            with(vec![tool("a", object)], Some(ToolChoice::Tool("b".into()))),
            "bad_request",
            "\"b\"",
        ),
        (
            ctx,
            sampled(0, Some(ToolChoice::Tool("nope".into()))),
            "bad_request",
            "\"nope\"",
        ),
        (
            plain,
            sampled(0, Some(ToolChoice::Required)),
            "bad_request",
            "tool_choice without tools",
        ),
        (
            ctx,
            CallParams {
                max_tokens: 10,
                ..sampled(0, Some(ToolChoice::Required))
            },
            "bad_request",
            "max_tokens",
        ),
    ];
    for (context, p, code, names) in cases {
        let (got, message) = error_of(c.call(context, "x", &p).unwrap().collect_answer());
        assert_eq!(got, code, "{message}");
        assert!(message.contains(names), "{names}: {message}");
    }
    // A result for no pending call: on a context with tools, on one without, on a new one.
    for context in [ctx, plain] {
        let (got, message) = error_of(
            c.tool_result(context, "42", &sampled(0, None))
                .unwrap()
                .collect_answer(),
        );
        assert_eq!(got, "no_tool_call", "{message}");
    }
    // `new` with a bad tool creates nothing.
    for bad in [
        vec![tool("x", r#"{"type":"strng"}"#)],
        vec![tool("x", object), tool("x", object)],
        vec![tool("bad name", object)],
    ] {
        let e = c.new_with_tools(None, &bad).unwrap_err();
        assert!(
            matches!(e.code(), Some("invalid_schema" | "bad_request")),
            "{e}"
        );
    }
    let bad_turns = protocol::Transcript {
        turns: vec![protocol::Turn {
            role: "tools".into(),
            text: "not json".into(),
        }],
    };
    let e = c.new_from_transcript(&bad_turns).unwrap_err();
    assert_eq!(e.code(), Some("invalid_transcript"), "{e}");
    assert_eq!(c.list().unwrap(), contexts);
    assert_eq!((c.export(ctx).unwrap(), c.export(plain).unwrap()), exported);
}

#[test]
fn a_version_1_connection_is_refused_every_tool_field() {
    let w = world();
    let _d = w.serve(&[]);
    let (mut r, mut out, ctx) = tests::v1_connection(&w);
    let mut send = |l: &str| out.write_all(format!("{l}\n").as_bytes()).unwrap();
    let tool = r#"{"name":"f","parameters":{"type":"object"}}"#;
    for (id, l) in [
        (3, format!(r#"{{"op":"new","id":3,"tools":[{tool}]}}"#)),
        (
            4,
            format!(r#"{{"op":"call","id":4,"context":{ctx},"prompt":"x","tools":[{tool}]}}"#),
        ),
        (
            5,
            format!(r#"{{"op":"call","id":5,"context":{ctx},"prompt":"x","tool_choice":"none"}}"#),
        ),
        (
            6,
            format!(r#"{{"op":"tool_result","id":6,"context":{ctx},"content":"x"}}"#),
        ),
    ] {
        send(&l);
        let e = tests::reply_line(&mut r);
        assert_eq!(e["id"], id, "{e}");
        assert_eq!(e["error"]["code"], "bad_request", "{e}");
        assert!(
            e["error"]["message"]
                .as_str()
                .unwrap()
                .contains("version 2")
        );
    }
    send(r#"{"op":"list","id":7}"#);
    assert_eq!(
        tests::reply_line(&mut r)["contexts"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
}
