//! The grammar and the matcher on a synthetic vocabulary (every byte, and multi-byte pieces of
//! JSON and English): random logits decoded under every example format always give an answer
//! that parses and validates (the naive oracle), within any budget the grammar accepts; bad
//! formats give their error codes.

use std::sync::Arc;

use serde_json::Value;

use super::*;

/// The stop token's id: past the text tokens.
const STOP: u32 = 1000;

fn vocab() -> (Arc<Vocab>, Vec<Vec<u8>>) {
    let mut tokens: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    for piece in [
        "{\"",
        "\":",
        "\": ",
        "\", \"",
        "\",\"",
        "\"}",
        "}",
        "{",
        "[",
        "]",
        "[\"",
        "\"]",
        ", ",
        "true",
        "false",
        "null",
        "name",
        "age",
        " the",
        "the",
        " a",
        "12",
        "123",
        "0",
        "00",
        "1.5",
        "-",
        "e",
        "hello",
        " world",
        "\\n",
        "\\u00",
        "\\\"",
        "é",
        "\u{e9}t\u{e9}",
        "\u{1F600}",
        "yes",
        "no",
        "com",
        "org",
        "@",
        "2024-",
        "01-",
        "  ",
        "\n",
        "red",
        "blue",
        "value",
        "children",
        "item",
        "qty",
        "ok",
        "monday",
        "\"\"",
        "\":{\"",
        "}}",
        "},{\"",
    ] {
        tokens.push(piece.as_bytes().to_vec());
    }
    // Bytes that are not UTF-8 on their own, and the two halves of an emoji.
    tokens.push(vec![0xf0, 0x9f]);
    tokens.push(vec![0x98, 0x80]);
    let v = Vocab::new(
        STOP as usize + 1,
        tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (i as u32, t.as_slice())),
    );
    (Arc::new(v), tokens)
}

/// A small deterministic generator (xorshift) for the logits.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn logit(&mut self) -> f32 {
        (self.next() % 10_000) as f32 / 1000.0
    }
}

/// Decodes one answer with random logits under `g`, at most `budget` tokens.
fn decode(g: &Arc<Grammar>, tokens: &[Vec<u8>], seed: u64, budget: usize) -> Vec<u8> {
    let mut m = Matcher::new(Arc::clone(g), vec![STOP]);
    let mut rng = Rng(seed | 1);
    let mut text = Vec::new();
    let mut logits = vec![0f32; STOP as usize + 1];
    for n in 0..budget {
        logits.iter_mut().for_each(|l| *l = rng.logit());
        // A stop token the model likes: it may come only where the text may end.
        logits[STOP as usize] = 5.0 + rng.logit();
        if m.constrain(&mut logits, budget - n) == Step::End {
            return text;
        }
        let best = (0..logits.len())
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
            .unwrap() as u32;
        assert!(
            logits[best as usize].is_finite(),
            "nothing allowed after {text:?}"
        );
        if best == STOP {
            assert!(m.is_accepting());
            return text;
        }
        let bytes = &tokens[best as usize];
        assert!(m.advance(best), "token {best} left the language");
        text.extend_from_slice(bytes);
    }
    text
}

#[test]
fn every_answer_under_every_example_schema_parses_and_validates() {
    let (v, tokens) = vocab();
    for (name, _, schema) in examples::SCHEMAS {
        let schema: Value = serde_json::from_str(schema).unwrap();
        let g = Arc::new(Grammar::from_schema(&schema, Arc::clone(&v)).unwrap());
        for seed in 0..20u64 {
            for budget in [g.min_tokens(), g.min_tokens() + 7, 60, 400] {
                if budget < g.min_tokens() {
                    continue;
                }
                let text = decode(&g, &tokens, seed * 7919 + budget as u64, budget);
                let value: Value = serde_json::from_slice(&text).unwrap_or_else(|e| {
                    panic!("{name}: {e}: {:?}", String::from_utf8_lossy(&text))
                });
                oracle::validate(&schema, &value).unwrap_or_else(|e| panic!("{name}: {e}"));
                assert!(g.matches(&text));
            }
        }
    }
}

#[test]
fn every_answer_under_every_example_regex_matches_it() {
    let (v, tokens) = vocab();
    for (name, _, pattern) in examples::REGEXES {
        let g = Arc::new(Grammar::from_regex(pattern, Arc::clone(&v)).unwrap());
        let re = regex::Regex::new(&format!("^(?:{pattern})$")).unwrap();
        for seed in 0..20u64 {
            let text = decode(&g, &tokens, seed + 1, 64);
            let text = String::from_utf8(text).unwrap();
            assert!(re.is_match(&text), "{name}: {text:?}");
        }
    }
}

/// A cached mask and one computed afresh allow the same tokens, and a mask allows exactly the
/// tokens whose bytes stay in the language (checked token by token).
#[test]
fn masks_allow_exactly_the_tokens_that_stay_in_the_language() {
    let (v, tokens) = vocab();
    let schema: Value = serde_json::from_str(examples::SCHEMAS[0].2).unwrap();
    let g = Grammar::from_schema(&schema, v).unwrap();
    let t = &g.table;
    for state in 0..t.states().min(200) as u32 {
        let (m, _) = g.mask(state);
        for (id, bytes) in tokens.iter().enumerate() {
            let ok = t.walk(state, bytes) != DEAD;
            let bit = m.bits[id / 64] >> (id % 64) & 1 == 1;
            assert_eq!(bit, ok, "state {state} token {bytes:?}");
        }
    }
}

fn check(schema: &str, code: &str, names: &str) {
    let (v, _) = vocab();
    let schema: Value = serde_json::from_str(schema).unwrap();
    let e = Grammar::from_schema(&schema, v).unwrap_err();
    assert_eq!(e.code(), code, "{schema}: {e}");
    assert!(e.to_string().contains(names), "{schema}: {e}");
}

#[test]
fn bad_schemas_get_their_codes_naming_what_is_wrong() {
    check(
        r#"{"type":"string","format":"email"}"#,
        "bad_request",
        "\"format\"",
    );
    check(
        r#"{"oneOf":[{"type":"string"}]}"#,
        "bad_request",
        "\"oneOf\"",
    );
    check(
        r#"{"allOf":[{"type":"string"}]}"#,
        "bad_request",
        "\"allOf\"",
    );
    check(
        r#"{"type":"object","properties":{"a":{"not":{}}}}"#,
        "bad_request",
        "#/properties/a",
    );
    check(
        r#"{"type":"array","prefixItems":[]}"#,
        "bad_request",
        "prefixItems",
    );
    check(
        r#"{"type":"object","additionalProperties":{"type":"string"}}"#,
        "bad_request",
        "additionalProperties",
    );
    check(
        r#"{"type":"number","exclusiveMinimum":0}"#,
        "bad_request",
        "exclusiveMinimum",
    );
    check(
        r#"{"type":"number","minimum":0.5}"#,
        "bad_request",
        "minimum",
    );
    check(
        r#"{"$ref":"http://example.invalid/s"}"#,
        "bad_request",
        "$ref",
    );
    check(r#"{"type":"strin"}"#, "invalid_schema", "strin");
    check(
        r#"{"type":"string","maxLength":-1}"#,
        "invalid_schema",
        "maxLength",
    );
    check(
        r##"{"$ref":"#/$defs/nothing"}"##,
        "invalid_schema",
        "nothing",
    );
    check(
        r#"{"type":"string","pattern":"("}"#,
        "invalid_schema",
        "pattern",
    );
    check(
        r#"{"type":"string","minLength":5,"maxLength":2}"#,
        "invalid_schema",
        "no JSON value",
    );
    check(r#"{"enum":[]}"#, "invalid_schema", "no JSON value");
    check(r#"false"#, "invalid_schema", "no JSON value");
    check(r#"[1]"#, "invalid_schema", "a schema is an object");
    check(
        r#"{"type":"array","items":{"type":"string","maxLength":400},"minItems":300}"#,
        "too_complex",
        "too large",
    );
    let (v, _) = vocab();
    for (bad, code) in [
        ("a(", "invalid_regex"),
        ("[a&&b]", "invalid_regex"),
        (r"\bx", "invalid_regex"),
    ] {
        let e = Grammar::from_regex(bad, Arc::clone(&v)).unwrap_err();
        assert_eq!(e.code(), code, "{bad}: {e}");
    }
}

#[test]
fn a_recursive_schema_is_expanded_a_bounded_depth() {
    let (v, tokens) = vocab();
    let schema: Value = serde_json::from_str(
        r##"{"type":"object","properties":{"next":{"$ref":"#"}},"required":["next"]}"##,
    )
    .unwrap();
    // Every level requires the next: no finite value exists beyond the bound.
    assert_eq!(
        Grammar::from_schema(&schema, Arc::clone(&v))
            .unwrap_err()
            .code(),
        "invalid_schema"
    );
    let schema: Value = serde_json::from_str(
        r##"{"anyOf":[{"type":"null"},{"type":"array","items":{"$ref":"#"}}]}"##,
    )
    .unwrap();
    let g = Arc::new(Grammar::from_schema(&schema, v).unwrap());
    for seed in 0..20 {
        let text = decode(&g, &tokens, seed + 3, 200);
        let value: Value = serde_json::from_slice(&text).unwrap();
        oracle::validate(&schema, &value).unwrap();
    }
}

const OPEN: &str = "<tool_call>\n";
const CLOSE: &str = "\n</tool_call>";

/// The tool call in `text`, checked: a declared tool's name and arguments that validate against
/// its schema.
fn checked_call(text: &str, tools: &[(String, Value)]) {
    let json = text
        .strip_prefix(OPEN)
        .and_then(|t| t.strip_suffix(CLOSE))
        .unwrap_or_else(|| panic!("not a tool call: {text:?}"));
    let call: Value = serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {json:?}"));
    let name = call["name"].as_str().unwrap();
    let (_, schema) = tools.iter().find(|(n, _)| n == name).unwrap();
    oracle::validate(schema, &call["arguments"]).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(call.as_object().unwrap().len(), 2, "{json}");
}

/// Random logits under tools, every tool choice: with a call required, every answer is a whole
/// call of a declared tool whose arguments validate; with a plain answer allowed too, an answer
/// that starts with the marker is such a call.
#[test]
fn every_answer_under_tools_is_a_valid_call_or_a_plain_answer() {
    let (v, tokens) = vocab();
    let tools: Vec<(String, Value)> = examples::SCHEMAS
        .iter()
        .take(8)
        .map(|(name, _, s)| (name.to_string(), serde_json::from_str(s).unwrap()))
        .collect();
    let schemas: Vec<ToolSchema> = tools
        .iter()
        .map(|(name, parameters)| ToolSchema { name, parameters })
        .collect();
    let mut calls = 0;
    for besides in [Besides::Nothing, Besides::Text] {
        let g = ToolCalls {
            tools: &schemas,
            open: OPEN,
            close: CLOSE,
            besides,
        };
        let g = Arc::new(Grammar::from_tools(&g, Arc::clone(&v)).unwrap());
        for seed in 0..40u64 {
            let text = decode(&g, &tokens, seed * 31 + 1, 400);
            let text = String::from_utf8(text).unwrap();
            match besides {
                Besides::Text if !text.starts_with(OPEN) => {}
                _ => {
                    checked_call(&text, &tools);
                    calls += 1;
                }
            }
        }
        if let Besides::Nothing = besides {
            assert!(g.min_tokens() > OPEN.len() + CLOSE.len());
        } else {
            assert_eq!(g.min_tokens(), 0);
            // A plain answer may be anything but the start of a call that is not whole.
            for plain in [
                "",
                "Hello",
                "<tool",
                "<tool_call",
                "<tool_call>",
                " <tool_call>\n{",
            ] {
                assert!(g.matches(plain.as_bytes()), "{plain:?}");
            }
            for half in ["<tool_call>\n", "<tool_call>\n{}", "<tool_call>\nhello"] {
                assert!(!g.matches(half.as_bytes()), "{half:?}");
            }
        }
    }
    assert!(calls >= 40, "{calls}");
    // One tool alone (a named choice) and a response format beside the calls.
    let one = ToolCalls {
        tools: &schemas[..1],
        open: OPEN,
        close: CLOSE,
        besides: Besides::Regex("(yes|no)"),
    };
    let g = Arc::new(Grammar::from_tools(&one, Arc::clone(&v)).unwrap());
    for seed in 0..20u64 {
        let text = String::from_utf8(decode(&g, &tokens, seed + 5, 400)).unwrap();
        if text != "yes" && text != "no" {
            checked_call(&text, &tools[..1]);
        }
    }
}

#[test]
fn bad_tools_name_the_tool() {
    let (v, _) = vocab();
    let good: Value = serde_json::from_str(r#"{"type":"object"}"#).unwrap();
    let bad: Value = serde_json::from_str(r#"{"type":"string","format":"date"}"#).unwrap();
    let invalid: Value = serde_json::from_str(r#"{"type":"strng"}"#).unwrap();
    for (tools, code, names) in [
        (
            vec![("a", &good), ("b", &bad)],
            "bad_request",
            "\"format\" at # of tool \"b\"",
        ),
        (vec![("c", &invalid)], "invalid_schema", "tool \"c\""),
        (vec![("d", &good), ("d", &good)], "invalid_schema", "\"d\""),
    ] {
        let schemas: Vec<ToolSchema> = tools
            .iter()
            .map(|&(name, parameters)| ToolSchema { name, parameters })
            .collect();
        let calls = ToolCalls {
            tools: &schemas,
            open: OPEN,
            close: CLOSE,
            besides: Besides::Text,
        };
        let e = Grammar::from_tools(&calls, Arc::clone(&v)).unwrap_err();
        assert_eq!(e.code(), code, "{e}");
        assert!(e.to_string().contains(names), "{e}");
    }
}
