//! Tools (version 2): what an app declares (a name, a description, the JSON Schema of the
//! arguments), how the model chooses between a plain answer and a tool call (`tool_choice`), and
//! the checks every declaration passes before anything is queued.

use serde::{Deserialize, Serialize};

use crate::{ErrorBody, codes};

/// Most tools one `new` or `call` declares.
pub const MAX_TOOLS: usize = 64;

/// Longest tool name (bytes).
pub const MAX_TOOL_NAME: usize = 64;

/// A tool the model may call.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tool {
    /// `[A-Za-z0-9_-]{1,64}`, unique among the tools declared together.
    pub name: String,
    /// What the tool does, for the model.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub description: String,
    /// The JSON Schema of the call's arguments (the keywords structured output implements).
    pub parameters: serde_json::Value,
}

/// How the model chooses between a plain answer and a tool call.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "ChoiceWire", into = "ChoiceWire")]
pub enum ToolChoice {
    /// A plain answer or a call of any tool: the model chooses at its first tokens.
    #[default]
    Auto,
    /// A call of one of the tools.
    Required,
    /// A plain answer.
    None,
    /// A call of this tool.
    Tool(String),
}

/// `tool_choice` as the wire spells it: `"auto"`, `"required"`, `"none"` or `{"name": TOOL}`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(untagged)]
enum ChoiceWire {
    Mode(String),
    Named(Named),
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Named {
    name: String,
}

impl TryFrom<ChoiceWire> for ToolChoice {
    type Error = String;

    fn try_from(w: ChoiceWire) -> Result<ToolChoice, String> {
        match w {
            ChoiceWire::Mode(m) => match m.as_str() {
                "auto" => Ok(ToolChoice::Auto),
                "required" => Ok(ToolChoice::Required),
                "none" => Ok(ToolChoice::None),
                _ => Err(format!(
                    "tool_choice {m:?}: it is \"auto\", \"required\", \"none\" or {{\"name\": TOOL}}"
                )),
            },
            ChoiceWire::Named(n) => Ok(ToolChoice::Tool(n.name)),
        }
    }
}

impl From<ToolChoice> for ChoiceWire {
    fn from(c: ToolChoice) -> ChoiceWire {
        match c {
            ToolChoice::Auto => ChoiceWire::Mode("auto".into()),
            ToolChoice::Required => ChoiceWire::Mode("required".into()),
            ToolChoice::None => ChoiceWire::Mode("none".into()),
            ToolChoice::Tool(name) => ChoiceWire::Named(Named { name }),
        }
    }
}

/// Whether `name` is a tool's name: 1 to [`MAX_TOOL_NAME`] bytes of `A-Z a-z 0-9 _ -`.
pub fn is_tool_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_TOOL_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Checks a declaration: at least one tool and at most [`MAX_TOOLS`], each name well formed and
/// unique (a duplicate is named). The schemas are compiled by the daemon (`invalid_schema`).
pub fn validate_tools(tools: &[Tool]) -> Result<(), ErrorBody> {
    let bad = |m: String| Err(ErrorBody::new(codes::BAD_REQUEST, m));
    if tools.is_empty() || tools.len() > MAX_TOOLS {
        return bad(format!(
            "declare 1 to {MAX_TOOLS} tools (not {}); tool_choice \"none\" keeps the model from \
             calling them",
            tools.len()
        ));
    }
    for (i, t) in tools.iter().enumerate() {
        if !is_tool_name(&t.name) {
            return bad(format!(
                "tool name {:?}: names are 1 to {MAX_TOOL_NAME} characters of A-Z a-z 0-9 _ -",
                t.name
            ));
        }
        if tools[..i].iter().any(|o| o.name == t.name) {
            return bad(format!(
                "two tools are named {:?}; tool names are unique",
                t.name
            ));
        }
    }
    Ok(())
}

/// Checks a `tool_choice` against the tools declared with it (`None` when they are the
/// context's, which the daemon checks): a named tool must be one of them.
pub fn validate_choice(choice: &ToolChoice, tools: &[Tool]) -> Result<(), ErrorBody> {
    match choice {
        ToolChoice::Tool(name) if !tools.iter().any(|t| t.name == *name) => Err(ErrorBody::new(
            codes::BAD_REQUEST,
            format!(
                "tool_choice names the tool {name:?}, which is not declared; the tools are {}",
                names(tools)
            ),
        )),
        _ => Ok(()),
    }
}

/// The tools' names, for messages.
pub fn names(tools: &[Tool]) -> String {
    if tools.is_empty() {
        return "none".into();
    }
    tools
        .iter()
        .map(|t| t.name.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool(name: &str) -> Tool {
        Tool {
            name: name.into(),
            description: String::new(),
            parameters: serde_json::json!({"type": "object"}),
        }
    }

    #[test]
    fn choices_round_trip_and_bad_ones_say_what_they_may_be() {
        for (text, choice) in [
            (r#""auto""#, ToolChoice::Auto),
            (r#""required""#, ToolChoice::Required),
            (r#""none""#, ToolChoice::None),
            (r#"{"name":"f"}"#, ToolChoice::Tool("f".into())),
        ] {
            assert_eq!(serde_json::from_str::<ToolChoice>(text).unwrap(), choice);
            assert_eq!(serde_json::to_string(&choice).unwrap(), text);
        }
        let e = serde_json::from_str::<ToolChoice>(r#""always""#).unwrap_err();
        assert!(e.to_string().contains("\"required\""), "{e}");
        for bad in [r#"{"name":"f","x":1}"#, r#"{"type":"function"}"#, "3"] {
            assert!(serde_json::from_str::<ToolChoice>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn declarations_are_checked_and_the_culprit_named() {
        assert!(validate_tools(&[tool("get_weather"), tool("a-1")]).is_ok());
        for (tools, names) in [
            (vec![], "1 to"),
            (vec![tool("a"), tool("b"), tool("a")], "\"a\""),
            (vec![tool("has space")], "\"has space\""),
            (vec![tool("")], "\"\""),
            (vec![tool(&"x".repeat(65))], "names are"),
            ((0..65).map(|i| tool(&format!("t{i}"))).collect(), "not 65"),
        ] {
            let e = validate_tools(&tools).unwrap_err();
            assert_eq!(e.code, codes::BAD_REQUEST);
            assert!(e.message.contains(names), "{}", e.message);
        }
        let tools = [tool("a"), tool("b")];
        assert!(validate_choice(&ToolChoice::Tool("b".into()), &tools).is_ok());
        let e = validate_choice(&ToolChoice::Tool("c".into()), &tools).unwrap_err();
        assert!(
            e.message.contains("\"c\"") && e.message.contains("a, b"),
            "{e:?}"
        );
    }
}
