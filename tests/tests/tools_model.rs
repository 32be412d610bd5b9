//! Tools with the real default model (SmolLM2-135M-Instruct, fetched as `llms model fetch` does)
//! through a real daemon on a real socket: asked the weather, with a call required, it calls the
//! weather tool with arguments that validate; the tool's result continues the context and the
//! model answers in text; left to choose (`auto`), what it does is printed for people reading
//! the log, and is a plain answer or a whole valid call.

use model::fetch::{self, FetchOptions};
use protocol::client::CallParams;
use protocol::{Tool, ToolChoice};

fn weather_tools() -> Vec<Tool> {
    let tool = |name: &str, description: &str, parameters: &str| Tool {
        name: name.into(),
        description: description.into(),
        parameters: serde_json::from_str(parameters).unwrap(),
    };
    vec![
        tool(
            "get_weather",
            "Get the current weather in a city",
            r#"{"type":"object","properties":{"city":{"type":"string","maxLength":40},"unit":{"type":"string","enum":["celsius","fahrenheit"]}},"required":["city"],"additionalProperties":false}"#,
        ),
        tool(
            "get_time",
            "Get the current time in a time zone",
            r#"{"type":"object","properties":{"timezone":{"type":"string","maxLength":40}},"required":["timezone"],"additionalProperties":false}"#,
        ),
    ]
}

#[test]
#[allow(clippy::print_stderr)] // the model's calls and answers, for people reading the log
fn the_real_model_calls_a_tool_and_answers_from_its_result() {
    let path = fetch::default_model_path(&FetchOptions::default())
        .unwrap_or_else(|e| panic!("cannot fetch the default model: {e}"));
    let w = tests::World::with_model(env!("CARGO_BIN_EXE_llms-e2e"), &path);
    let _d = w.serve(&[]);
    let mut c = w.connect("weather");
    let tools = weather_tools();
    let ctx = c.new_with_tools(None, &tools).unwrap();
    let required = CallParams {
        max_tokens: 120,
        tool_choice: Some(ToolChoice::Required),
        ..CallParams::default()
    };
    let a = c
        .call(
            ctx,
            "What is the weather like in Paris right now?",
            &required,
        )
        .unwrap()
        .collect_answer()
        .unwrap();
    let call = a.tool_call.expect("a required tool call");
    eprintln!(
        "required: {} {}: {} tokens, the grammar {:.3} ms a token, decoding {:.3} ms a token",
        call.name,
        call.arguments,
        a.done.tokens,
        a.done.timings.guide_ms.unwrap_or(0.0) / a.done.tokens as f64,
        a.done.timings.decode_ms / a.done.tokens as f64
    );
    let tool = tools.iter().find(|t| t.name == call.name).unwrap();
    guide::oracle::validate(&tool.parameters, &call.arguments).unwrap();
    assert_eq!(a.done.stop, "tool_call");
    assert_eq!(call.name, "get_weather", "{}", call.arguments);
    let result = c
        .tool_result(
            ctx,
            r#"{"city":"Paris","temperature":18,"unit":"celsius","sky":"sunny"}"#,
            &CallParams {
                max_tokens: 60,
                tool_choice: Some(ToolChoice::None),
                ..CallParams::default()
            },
        )
        .unwrap()
        .collect_answer()
        .unwrap();
    eprintln!("after the result: {:?}", result.text);
    assert!(result.tool_call.is_none() && !result.text.trim().is_empty());
    let roles: Vec<String> = c
        .export(ctx)
        .unwrap()
        .turns
        .into_iter()
        .map(|t| t.role)
        .collect();
    assert_eq!(roles, ["tools", "user", "tool_call", "tool", "assistant"]);
    // Left to choose.
    let auto = CallParams {
        max_tokens: 120,
        ..CallParams::default()
    };
    for prompt in [
        "What time is it in Tokyo?",
        "Write one sentence about the sea.",
    ] {
        let ctx = c.new_with_tools(None, &tools).unwrap();
        let a = c
            .call(ctx, prompt, &auto)
            .unwrap()
            .collect_answer()
            .unwrap();
        match &a.tool_call {
            Some(call) => {
                let tool = tools.iter().find(|t| t.name == call.name).unwrap();
                guide::oracle::validate(&tool.parameters, &call.arguments).unwrap();
                eprintln!("auto, {prompt:?}: calls {} {}", call.name, call.arguments);
            }
            None => eprintln!("auto, {prompt:?}: answers {:?}", a.text),
        }
        c.delete(ctx).unwrap();
    }
}
