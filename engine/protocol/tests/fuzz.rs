//! The request parser fuzzed: the corpus in `tests/corpus/` (one request line each, valid and
//! not), byte-level mutations of it, arbitrary bytes, and generated requests, through
//! `parse_request`. It never panics; whatever it accepts validates and survives a round trip to
//! a line and back; whatever it refuses gets a parse or validation code, with the line's id
//! when it has one.

use proptest::prelude::*;
use protocol::{Request, codes, parse_request};

/// The corpus: one request line per line of `tests/corpus/requests.jsonl`.
fn corpus() -> Vec<Vec<u8>> {
    let text = include_str!("corpus/requests.jsonl");
    text.split('\n').map(|l| l.as_bytes().to_vec()).collect()
}

/// What the parser must guarantee for any line.
fn check(line: &[u8]) {
    match parse_request(line) {
        Ok(r) => {
            r.validate().expect("an accepted request validates");
            let again = serde_json::to_string(&r).expect("a request serializes");
            let back = parse_request(again.as_bytes()).expect("a request's own line parses");
            assert_eq!(back, r, "round trip of {:?}", String::from_utf8_lossy(line));
        }
        Err((id, e)) => {
            // A line that is no request is `bad_request`; a request that fails validation gets
            // validation's own code.
            let refusals = [codes::BAD_REQUEST, codes::VERSION, codes::TOO_LONG];
            assert!(refusals.contains(&e.code.as_str()), "{e:?}");
            assert!(!e.message.is_empty());
            if let Some(id) = id {
                // The id reported is one the line really holds.
                let text = String::from_utf8_lossy(line);
                assert!(text.contains(&id.to_string()), "id {id} not in {text:?}");
            }
        }
    }
}

#[test]
fn the_corpus_parses_as_documented() {
    let lines = corpus();
    let accepted: Vec<Request> = lines.iter().filter_map(|l| parse_request(l).ok()).collect();
    for l in &lines {
        check(l);
    }
    // The corpus's first eleven lines are the documented requests of version 1, every op once
    // or more, and one more is a prompt of a NUL and an astral character (any text is a
    // prompt); the last four are version 2's (hello, count, calls with a response format); the
    // rest are each refused.
    assert_eq!(accepted.len(), 16, "{accepted:?}");
    let ops: std::collections::BTreeSet<&str> = accepted.iter().map(Request::op).collect();
    assert_eq!(ops.len(), 9, "every op: {ops:?}");
}

/// One byte-level mutation of a line.
#[derive(Clone, Debug)]
enum Mutation {
    Flip { at: usize, bit: u8 },
    Cut { at: usize },
    Insert { at: usize, byte: u8 },
    Splice { at: usize, from: usize, len: usize },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 0u8..8).prop_map(|(at, bit)| Mutation::Flip { at, bit }),
        any::<usize>().prop_map(|at| Mutation::Cut { at }),
        (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Mutation::Insert { at, byte }),
        (any::<usize>(), any::<usize>(), 0usize..32).prop_map(|(at, from, len)| Mutation::Splice {
            at,
            from,
            len
        }),
    ]
}

fn apply(line: &mut Vec<u8>, m: &Mutation) {
    let n = line.len().max(1);
    match *m {
        Mutation::Flip { at, bit } => {
            if !line.is_empty() {
                line[at % n] ^= 1 << bit;
            }
        }
        Mutation::Cut { at } => line.truncate(at % n),
        Mutation::Insert { at, byte } => line.insert(at % (line.len() + 1), byte),
        Mutation::Splice { at, from, len } => {
            let from = from % n;
            let piece: Vec<u8> = line.iter().skip(from).take(len).copied().collect();
            let at = at % (line.len() + 1);
            line.splice(at..at, piece);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn mutated_corpus_lines_never_break_the_parser(
        pick in any::<usize>(),
        mutations in prop::collection::vec(mutation(), 1..6),
    ) {
        let lines = corpus();
        let mut line = lines[pick % lines.len()].clone();
        for m in &mutations {
            apply(&mut line, m);
        }
        check(&line);
    }

    #[test]
    fn arbitrary_bytes_never_break_the_parser(line in prop::collection::vec(any::<u8>(), 0..512)) {
        check(&line);
    }

    #[test]
    fn generated_requests_parse_back_or_are_refused_by_validation(
        id in any::<u64>(),
        context in any::<u64>(),
        prompt in ".{0,64}",
        app in ".{0,80}",
        max_tokens in 0usize..200_000,
        temperature in -1.0f32..3.0,
        stop in prop::collection::vec(".{0,8}", 0..20),
    ) {
        for r in [
            Request::Hello { id, version: 1, app: app.clone() },
            Request::Call {
                id,
                context,
                prompt: prompt.clone(),
                format: Default::default(),
                max_tokens,
                temperature,
                top_p: 1.0,
                top_k: 0,
                seed: 0,
                stop: stop.clone(),
                response_format: None,
                tools: Vec::new(),
                tool_choice: None,
            },
            Request::Call {
                id,
                context,
                prompt: prompt.clone(),
                format: Default::default(),
                max_tokens,
                temperature,
                top_p: 1.0,
                top_k: 0,
                seed: 0,
                stop: Vec::new(),
                response_format: Some(protocol::ResponseFormat::Regex { pattern: prompt.clone() }),
                tools: Vec::new(),
                tool_choice: None,
            },
            Request::ToolResult {
                id,
                context,
                content: prompt.clone(),
                max_tokens,
                temperature,
                top_p: 1.0,
                top_k: 0,
                seed: 0,
                stop: stop.clone(),
                response_format: None,
                tool_choice: Some(protocol::ToolChoice::Tool(app.clone())),
            },
            Request::Count { id, context: Some(context), text: prompt.clone(), format: Default::default() },
        ] {
            let line = serde_json::to_string(&r).unwrap();
            match parse_request(line.as_bytes()) {
                Ok(back) => prop_assert_eq!(back, r),
                Err((got, e)) => {
                    // Refused only by validation, which names the request.
                    prop_assert_eq!(got, Some(id));
                    prop_assert!(r.validate().is_err(), "{:?}", e);
                }
            }
        }
    }
}
