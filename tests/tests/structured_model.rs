//! Structured output with the real default model (SmolLM2-135M-Instruct, fetched as `llms model
//! fetch` does) through a real daemon on a real socket: every example schema asked five ways,
//! greedy, each answer parses as JSON and validates against its schema (the naive oracle), and
//! every example regex's answers match it.

use guide::examples::{FRAMINGS, REGEXES, SCHEMAS};
use model::fetch::{self, FetchOptions};
use protocol::client::CallParams;
use protocol::{PromptFormat, ResponseFormat};
use serde_json::Value;

#[test]
#[allow(clippy::print_stderr)] // the answers and the cost per token, for people reading the log
fn every_answer_of_the_real_model_under_every_example_schema_parses_and_validates() {
    let path = fetch::default_model_path(&FetchOptions::default())
        .unwrap_or_else(|e| panic!("cannot fetch the default model: {e}"));
    let w = tests::World::with_model(env!("CARGO_BIN_EXE_llms-e2e"), &path);
    let _d = w.serve(&[]);
    let mut c = w.connect("forms");
    assert!(SCHEMAS.len() >= 20 && FRAMINGS.len() >= 5);
    let (mut answers, mut tokens, mut guide_ms, mut decode_ms) = (0, 0, 0.0, 0.0);
    for (name, task, schema) in SCHEMAS {
        let schema: Value = serde_json::from_str(schema).unwrap();
        let p = CallParams {
            max_tokens: 160,
            response_format: Some(ResponseFormat::JsonSchema {
                schema: schema.clone(),
            }),
            ..CallParams::default()
        };
        for framing in FRAMINGS {
            let prompt = framing.replace("{task}", task);
            let ctx = c.new_context(None, PromptFormat::Chat).unwrap();
            let a = c.call(ctx, &prompt, &p).unwrap().collect_answer().unwrap();
            let value: Value = serde_json::from_str(&a.text).unwrap_or_else(|e| {
                panic!("{name}, {prompt:?}: {e}: {:?} ({})", a.text, a.done.stop)
            });
            guide::oracle::validate(&schema, &value)
                .unwrap_or_else(|e| panic!("{name}, {prompt:?}: {e}: {}", a.text));
            eprintln!("{name}: {}", a.text);
            answers += 1;
            tokens += a.done.tokens;
            guide_ms += a.done.timings.guide_ms.unwrap_or(0.0);
            decode_ms += a.done.timings.decode_ms;
            c.delete(ctx).unwrap();
        }
    }
    for (name, task, pattern) in REGEXES {
        let g = guide::Grammar::from_regex(pattern, std::sync::Arc::new(guide::Vocab::new(0, [])))
            .unwrap();
        let p = CallParams {
            max_tokens: 40,
            response_format: Some(ResponseFormat::Regex {
                pattern: (*pattern).into(),
            }),
            ..CallParams::default()
        };
        for framing in FRAMINGS {
            let prompt = framing.replace("{task}", task);
            let ctx = c.new_context(None, PromptFormat::Chat).unwrap();
            let a = c.call(ctx, &prompt, &p).unwrap().collect_answer().unwrap();
            assert!(
                g.matches(a.text.as_bytes()),
                "{name}, {prompt:?}: {:?}",
                a.text
            );
            c.delete(ctx).unwrap();
        }
    }
    eprintln!(
        "{answers} structured answers, {tokens} tokens: the format took {:.3} ms a token, \
         decoding {:.3} ms a token",
        guide_ms / tokens as f64,
        decode_ms / tokens as f64
    );
}
