//! What the chat completions and responses endpoints share of the OpenAI request shapes: the
//! check that names every field this server does not implement, text content, tools and
//! `tool_choice` in both spellings, the sampling settings, structured output, and a
//! conversation's turns as the daemon's transcripts write them.

use protocol::{ResponseFormat, Tool, ToolChoice, Turn};
use serde_json::{Map, Value};

use crate::http::error::ApiError;

pub type Object = Map<String, Value>;

/// Fields a request may carry with any value, and fields it may carry only with the value
/// that changes nothing (`n: 1`).
pub struct Allowed<'a> {
    pub fields: &'a [&'a str],
    pub neutral: &'a [(&'a str, Value)],
}

/// Checks that `o` has only `allowed` fields (a field set to null counts as absent); a 400
/// names every other one, prefixed by `at` (`messages[2].`).
pub fn check_fields(o: &Object, allowed: &Allowed, at: &str) -> Result<(), ApiError> {
    let unsupported: Vec<String> = o
        .iter()
        .filter(|(k, v)| {
            !v.is_null()
                && !allowed.fields.contains(&k.as_str())
                && !allowed.neutral.iter().any(|(n, want)| n == k && *v == want)
        })
        .map(|(k, v)| match allowed.neutral.iter().any(|(n, _)| n == k) {
            true => format!("{at}{k}={v}"),
            false => format!("{at}{k}"),
        })
        .collect();
    match unsupported.is_empty() {
        true => Ok(()),
        false => Err(ApiError::unsupported(&unsupported)),
    }
}

/// `o[key]` unless absent or null.
pub fn get<'a>(o: &'a Object, key: &str) -> Option<&'a Value> {
    o.get(key).filter(|v| !v.is_null())
}

pub fn string(o: &Object, key: &str) -> Result<Option<String>, ApiError> {
    match get(o, key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(ApiError::param(key, format!("{key} must be a string"))),
    }
}

pub fn object<'a>(v: &'a Value, at: &str) -> Result<&'a Object, ApiError> {
    v.as_object()
        .ok_or_else(|| ApiError::param(at, format!("{at} must be an object")))
}

fn number(o: &Object, key: &str) -> Result<Option<f64>, ApiError> {
    match get(o, key) {
        None => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| ApiError::param(key, format!("{key} must be a number"))),
    }
}

fn integer(o: &Object, key: &str) -> Result<Option<u64>, ApiError> {
    match get(o, key) {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| ApiError::param(key, format!("{key} must be a non-negative integer"))),
    }
}

pub fn boolean(o: &Object, key: &str) -> Result<Option<bool>, ApiError> {
    match get(o, key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(ApiError::param(key, format!("{key} must be true or false"))),
    }
}

/// A message's text: a string, or a list of text parts (`text`, `input_text`, `output_text`)
/// joined; any other part (an image, a file, audio) is a 400.
pub fn text(v: &Value, at: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut out = String::new();
            for (i, p) in parts.iter().enumerate() {
                let at = format!("{at}[{i}]");
                let p = object(p, &at)?;
                let kind = p.get("type").and_then(Value::as_str).unwrap_or("");
                if !matches!(kind, "text" | "input_text" | "output_text") {
                    return Err(ApiError::unsupported(&[format!("{at}.type={kind:?}")]));
                }
                let allowed = Allowed {
                    fields: &["type", "text", "annotations", "logprobs"],
                    neutral: &[],
                };
                check_fields(p, &allowed, &format!("{at}."))?;
                match p.get("text") {
                    Some(Value::String(t)) => out.push_str(t),
                    _ => return Err(ApiError::param(&at, format!("{at}.text must be a string"))),
                }
            }
            Ok(out)
        }
        _ => Err(ApiError::param(
            at,
            format!("{at} must be a string or a list of text parts"),
        )),
    }
}

/// One tool, from a chat completion's `{"type": "function", "function": {...}}` or a response's
/// `{"type": "function", "name": ...}`.
pub fn tool(v: &Value, at: &str, nested: bool) -> Result<Tool, ApiError> {
    let o = object(v, at)?;
    if o.get("type").and_then(Value::as_str) != Some("function") {
        return Err(ApiError::unsupported(&[format!(
            "{at}.type (only function tools)"
        )]));
    }
    let (f, fat) = match nested {
        true => {
            check_fields(
                o,
                &Allowed {
                    fields: &["type", "function"],
                    neutral: &[],
                },
                &format!("{at}."),
            )?;
            let fat = format!("{at}.function");
            (
                object(o.get("function").unwrap_or(&Value::Null), &fat)?,
                fat,
            )
        }
        false => (o, at.to_owned()),
    };
    let fields: &[&str] = match nested {
        true => &["name", "description", "parameters", "strict"],
        false => &["type", "name", "description", "parameters", "strict"],
    };
    check_fields(
        f,
        &Allowed {
            fields,
            neutral: &[],
        },
        &format!("{fat}."),
    )?;
    let name = string(f, "name")?
        .ok_or_else(|| ApiError::param(&fat, format!("{fat}.name is missing")))?;
    Ok(Tool {
        name,
        description: string(f, "description")?.unwrap_or_default(),
        parameters: get(f, "parameters")
            .cloned()
            .unwrap_or_else(|| serde_json::json!({"type": "object", "properties": {}})),
    })
}

/// A list of tools (see [`tool`]).
pub fn tools(o: &Object, nested: bool) -> Result<Vec<Tool>, ApiError> {
    let Some(v) = get(o, "tools") else {
        return Ok(Vec::new());
    };
    let list = v
        .as_array()
        .ok_or_else(|| ApiError::param("tools", "tools must be a list"))?;
    let tools = list
        .iter()
        .enumerate()
        .map(|(i, t)| tool(t, &format!("tools[{i}]"), nested))
        .collect::<Result<Vec<_>, _>>()?;
    if !tools.is_empty() {
        protocol::tools::validate_tools(&tools).map_err(|e| ApiError::param("tools", e.message))?;
    }
    Ok(tools)
}

/// `tool_choice`: `"auto"`, `"none"`, `"required"`, or a named function in either spelling
/// (`{"type":"function","function":{"name":..}}` or `{"type":"function","name":..}`).
pub fn tool_choice(o: &Object) -> Result<Option<ToolChoice>, ApiError> {
    let bad = || {
        ApiError::param(
            "tool_choice",
            "tool_choice is \"auto\", \"none\", \"required\" or a named function",
        )
    };
    Ok(Some(match get(o, "tool_choice") {
        None => return Ok(None),
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            _ => return Err(bad()),
        },
        Some(Value::Object(c)) if c.get("type").and_then(Value::as_str) == Some("function") => {
            let name = c
                .get("function")
                .and_then(|f| f.get("name"))
                .or_else(|| c.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(bad)?;
            ToolChoice::Tool(name.to_owned())
        }
        Some(_) => return Err(bad()),
    }))
}

/// A call's generation settings, as the daemon takes them.
#[derive(Clone, Debug, Default)]
pub struct Generation {
    pub max_tokens: usize,
    pub temperature: f32,
    pub top_p: f32,
    pub seed: u64,
    pub stop: Vec<String>,
    pub response_format: Option<ResponseFormat>,
    pub tools: Vec<Tool>,
    pub tool_choice: Option<ToolChoice>,
}

/// The sampling settings of `o`, OpenAI's defaults where absent (temperature 1, top_p 1), and
/// the answer's longest length from the first of `max_keys` present.
pub fn generation(o: &Object, max_keys: &[&str]) -> Result<Generation, ApiError> {
    let mut max_tokens = protocol::DEFAULT_MAX_TOKENS;
    for k in max_keys {
        if let Some(n) = integer(o, k)? {
            if n == 0 || n > protocol::MAX_CALL_TOKENS as u64 {
                return Err(ApiError::param(
                    k,
                    format!("{k} must be 1 to {}", protocol::MAX_CALL_TOKENS),
                ));
            }
            max_tokens = n as usize;
            break;
        }
    }
    let temperature = number(o, "temperature")?.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::param("temperature", "temperature must be 0 to 2"));
    }
    let top_p = number(o, "top_p")?.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::param("top_p", "top_p must be in (0, 1]"));
    }
    let stop = match get(o, "stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| s.as_str().map(str::to_owned))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| ApiError::param("stop", "stop must be a string or a list of strings"))?,
        Some(_) => {
            return Err(ApiError::param(
                "stop",
                "stop must be a string or a list of strings",
            ));
        }
    };
    Ok(Generation {
        max_tokens,
        temperature: temperature as f32,
        top_p: top_p as f32,
        seed: integer(o, "seed")?.unwrap_or(0),
        stop,
        response_format: None,
        tools: Vec::new(),
        tool_choice: tool_choice(o)?,
    })
}

/// A JSON Schema format (`{"name", "schema", "strict", "description"}`) as the daemon's.
pub fn json_schema(o: &Object, at: &str) -> Result<ResponseFormat, ApiError> {
    let allowed = Allowed {
        fields: &["name", "schema", "strict", "description", "type"],
        neutral: &[],
    };
    check_fields(o, &allowed, &format!("{at}."))?;
    let schema = get(o, "schema")
        .cloned()
        .ok_or_else(|| ApiError::param(at, format!("{at}.schema is missing")))?;
    Ok(ResponseFormat::JsonSchema { schema })
}

/// The text format `{"type": "text" | "json_object" | "json_schema", ...}`: `None` for text.
/// `json_object` is any JSON object. `inline`: the schema's fields are beside `type` (the
/// responses API) rather than under `json_schema` (chat completions).
pub fn format(v: &Value, at: &str, inline: bool) -> Result<Option<ResponseFormat>, ApiError> {
    let o = object(v, at)?;
    match o.get("type").and_then(Value::as_str) {
        Some(kind @ ("text" | "json_object")) => {
            check_fields(
                o,
                &Allowed {
                    fields: &["type"],
                    neutral: &[],
                },
                &format!("{at}."),
            )?;
            Ok((kind == "json_object").then(|| ResponseFormat::JsonSchema {
                schema: serde_json::json!({"type": "object"}),
            }))
        }
        Some("json_schema") if inline => json_schema(o, at).map(Some),
        Some("json_schema") => {
            check_fields(
                o,
                &Allowed {
                    fields: &["type", "json_schema"],
                    neutral: &[],
                },
                &format!("{at}."),
            )?;
            let inner = object(
                o.get("json_schema").unwrap_or(&Value::Null),
                &format!("{at}.json_schema"),
            )?;
            json_schema(inner, &format!("{at}.json_schema")).map(Some)
        }
        _ => Err(ApiError::param(
            at,
            format!("{at}.type is \"text\", \"json_object\" or \"json_schema\""),
        )),
    }
}

/// A transcript turn.
pub fn turn(role: &str, text: impl Into<String>) -> Turn {
    Turn {
        role: role.to_owned(),
        text: text.into(),
    }
}

/// A tool call as a `tool_call` turn's text: `{"name": ..., "arguments": ...}`, the arguments
/// given as a JSON string (OpenAI's spelling) parsed.
pub fn tool_call_turn(name: &str, arguments: &str, at: &str) -> Result<Turn, ApiError> {
    let arguments: Value = serde_json::from_str(arguments)
        .map_err(|e| ApiError::param(at, format!("{at}: the arguments are not JSON: {e}")))?;
    let text = serde_json::json!({"name": name, "arguments": arguments}).to_string();
    Ok(turn("tool_call", text))
}

/// Whether two turns say the same: the same role and text, or, for tool calls, the same call
/// (its JSON compared as values, so spacing does not matter).
pub fn same_turn(a: &Turn, b: &Turn) -> bool {
    if a.role != b.role {
        return false;
    }
    if a.role == "tool_call" {
        let parse = |t: &str| serde_json::from_str::<Value>(t).ok();
        return parse(&a.text).is_some_and(|x| Some(x) == parse(&b.text));
    }
    a.text == b.text
}

/// A tool call's name and arguments (as OpenAI's JSON string) from a `tool_call` turn's text.
pub fn call_of(text: &str) -> (String, String) {
    let v: Value = serde_json::from_str(text).unwrap_or(Value::Null);
    let name = v["name"].as_str().unwrap_or_default().to_owned();
    (name, v["arguments"].to_string())
}

/// A number no other answer of this daemon's run has, for ids (`chatcmpl-...`, `call_...`).
pub fn unique() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    format!(
        "{:x}{:04x}",
        now_secs(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// Seconds since the epoch, for `created`.
pub fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Object {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn every_unsupported_field_is_named_and_neutral_values_pass() {
        let allowed = Allowed {
            fields: &["model", "messages"],
            neutral: &[("n", json!(1))],
        };
        assert!(
            check_fields(
                &obj(json!({"model": "m", "n": 1, "logprobs": null})),
                &allowed,
                ""
            )
            .is_ok()
        );
        let e = check_fields(
            &obj(json!({"model": "m", "n": 2, "logit_bias": {}})),
            &allowed,
            "",
        )
        .unwrap_err();
        assert!(
            e.message.contains("logit_bias") && e.message.contains("n=2"),
            "{}",
            e.message
        );
    }

    #[test]
    fn text_parts_join_and_images_are_refused() {
        assert_eq!(text(&json!("hi"), "c").unwrap(), "hi");
        let parts = json!([{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}]);
        assert_eq!(text(&parts, "c").unwrap(), "ab");
        let e = text(&json!([{"type": "image_url", "image_url": {}}]), "c").unwrap_err();
        assert!(e.message.contains("image_url"), "{}", e.message);
    }

    #[test]
    fn tools_and_choices_in_both_spellings() {
        let chat = obj(
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}}}),
        );
        assert_eq!(tools(&chat, true).unwrap()[0].name, "f");
        assert_eq!(
            tool_choice(&chat).unwrap(),
            Some(ToolChoice::Tool("f".into()))
        );
        let resp = obj(
            json!({"tools": [{"type": "function", "name": "g", "strict": true}],
            "tool_choice": {"type": "function", "name": "g"}}),
        );
        assert_eq!(tools(&resp, false).unwrap()[0].name, "g");
        assert_eq!(
            tool_choice(&resp).unwrap(),
            Some(ToolChoice::Tool("g".into()))
        );
        let web = obj(json!({"tools": [{"type": "web_search"}]}));
        assert!(
            tools(&web, false)
                .unwrap_err()
                .message
                .contains("only function tools")
        );
    }

    #[test]
    fn generation_defaults_and_ranges() {
        let g = generation(&obj(json!({})), &["max_tokens"]).unwrap();
        assert_eq!(
            (g.temperature, g.top_p, g.max_tokens),
            (1.0, 1.0, protocol::DEFAULT_MAX_TOKENS)
        );
        let g = generation(
            &obj(json!({"max_completion_tokens": 5, "max_tokens": 9, "stop": "x"})),
            &["max_completion_tokens", "max_tokens"],
        )
        .unwrap();
        assert_eq!((g.max_tokens, g.stop), (5, vec!["x".to_owned()]));
        assert!(generation(&obj(json!({"temperature": 3})), &[]).is_err());
        assert!(generation(&obj(json!({"max_tokens": 0})), &["max_tokens"]).is_err());
    }

    #[test]
    fn tool_calls_compare_as_values() {
        let a = tool_call_turn("f", "{\"x\": 1}", "m").unwrap();
        let b = turn("tool_call", "{\"name\":\"f\",\"arguments\":{\"x\":1}}");
        assert!(same_turn(&a, &b));
        assert!(!same_turn(
            &a,
            &turn("tool_call", "{\"name\":\"f\",\"arguments\":{}}")
        ));
        assert_eq!(call_of(&b.text), ("f".into(), "{\"x\":1}".into()));
    }
}
