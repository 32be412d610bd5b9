//! Conversations as the model reads them: messages and the chat templates that render them,
//! recognised from the GGUF's `tokenizer.chat_template` (ChatML, Gemma's), else the
//! architecture's (a Gemma file without a template, whose vocabulary has Gemma's turn tokens).
//!
//! The Jinja source is not executed: both formats are one turn per message,
//! `{start}{role}\n{content}{end}\n`, and differ in their tokens, the assistant's role name, and
//! where a system message goes.
//!
//! Tools are declared, called and answered in text both templates render the same way, the
//! convention of ChatML models trained for tools (Hermes 2 Pro, Qwen 2.5): the declarations in
//! `<tools></tools>` at the end of the system turn (or at the top of a user turn), a call as the
//! whole answer, `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`, and a result as a
//! user turn, `<tool_response>\n...\n</tool_response>`. Gemma 3 has no tool tokens; it reads the
//! same text.

use super::{Result, Tokenizer, TokenizerError};

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// `system`, `user`, `assistant`, or any role the model knows.
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }
    pub fn system(content: impl Into<String>) -> Message {
        Message::new("system", content)
    }
    pub fn user(content: impl Into<String>) -> Message {
        Message::new("user", content)
    }
    pub fn assistant(content: impl Into<String>) -> Message {
        Message::new("assistant", content)
    }
}

/// A tool the model may call: its name, what it does, and the JSON Schema of its arguments.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tool {
    pub name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub description: String,
    pub parameters: serde_json::Value,
}

/// The text before a tool call's JSON in an answer.
pub const TOOL_CALL_OPEN: &str = "<tool_call>\n";
/// The text after it: the answer ends there.
pub const TOOL_CALL_CLOSE: &str = "\n</tool_call>";

/// The declaration of `tools`, as the system turn ends with it (after a blank line) or a user
/// turn starts with it (before one).
pub fn tools_text(tools: &[Tool]) -> String {
    let mut out = String::from(
        "# Tools\n\nYou may call one of these functions to answer. Their signatures are within \
         <tools></tools> XML tags:\n<tools>",
    );
    for t in tools {
        let mut function = serde_json::Map::new();
        function.insert("name".into(), t.name.clone().into());
        if !t.description.is_empty() {
            function.insert("description".into(), t.description.clone().into());
        }
        function.insert("parameters".into(), t.parameters.clone());
        let decl = serde_json::json!({"type": "function", "function": function});
        out.push('\n');
        out.push_str(&decl.to_string());
    }
    out.push_str(
        "\n</tools>\n\nTo call a function, answer with only a JSON object with its name and \
         arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": \
         <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
    );
    out
}

/// A tool call's answer text, from the call's JSON.
pub fn tool_call_text(json: &str) -> String {
    format!("{TOOL_CALL_OPEN}{json}{TOOL_CALL_CLOSE}")
}

/// The JSON of the tool call an answer is, if it is one.
pub fn tool_call_json(answer: &str) -> Option<&str> {
    answer
        .strip_prefix(TOOL_CALL_OPEN)?
        .strip_suffix(TOOL_CALL_CLOSE)
}

/// A tool's result as the text of a user turn.
pub fn tool_response_text(content: &str) -> String {
    format!("<tool_response>\n{content}\n</tool_response>")
}

/// The chat format of the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChatTemplate {
    /// `<|im_start|>{role}\n{content}<|im_end|>\n` per message, with the template's system prompt (if it
    /// has one) put first when the conversation does not start with a system message.
    ChatMl { default_system: Option<String> },
    /// `<start_of_turn>{role}\n{content}<end_of_turn>\n` per message, content trimmed, the
    /// assistant's role called `model`. Gemma has no system role: a system message is put at the
    /// top of the first user turn, followed by a blank line; a system message with no user
    /// message after it (a context's system prompt) is a user turn of its own.
    Gemma,
    /// The model has no template, or one this crate does not render; the text is kept for the error.
    Unsupported { template: Option<String> },
}

impl ChatTemplate {
    /// Recognises the template from its Jinja source (which this crate does not execute); without
    /// one, the architecture's: Gemma's for a `gemma*` file whose vocabulary (`has_token`) holds
    /// `<start_of_turn>` and `<end_of_turn>`.
    pub fn recognise(
        template: Option<&str>,
        architecture: Option<&str>,
        has_token: impl Fn(&str) -> bool,
    ) -> ChatTemplate {
        let Some(t) = template else {
            let gemma = architecture.is_some_and(|a| a.starts_with("gemma"))
                && has_token("<start_of_turn>")
                && has_token("<end_of_turn>");
            return if gemma {
                ChatTemplate::Gemma
            } else {
                ChatTemplate::Unsupported { template: None }
            };
        };
        if t.contains("<start_of_turn>") && t.contains("<end_of_turn>") {
            return ChatTemplate::Gemma;
        }
        if !t.contains("<|im_start|>") || !t.contains("<|im_end|>") {
            return ChatTemplate::Unsupported {
                template: Some(t.to_owned()),
            };
        }
        ChatTemplate::ChatMl {
            default_system: chatml_default_system(t),
        }
    }

    /// Recognises a template from its Jinja source alone (no architecture to fall back on).
    pub fn from_jinja(template: Option<&str>) -> ChatTemplate {
        ChatTemplate::recognise(template, None, |_| false)
    }

    /// The spellings of the turn tokens and the assistant's role, `None` when unsupported.
    fn markers(&self) -> Option<(&'static str, &'static str, &'static str)> {
        match self {
            ChatTemplate::ChatMl { .. } => Some(("<|im_start|>", "<|im_end|>", "assistant")),
            ChatTemplate::Gemma => Some(("<start_of_turn>", "<end_of_turn>", "model")),
            ChatTemplate::Unsupported { .. } => None,
        }
    }
}

/// A default system prompt appears as a literal `<|im_start|>system\n...<|im_end|>` in the template;
/// the newline may be written raw or as a `\n` escape in the Jinja string literal.
fn chatml_default_system(t: &str) -> Option<String> {
    let marker = "<|im_start|>system";
    let at = t.find(marker)?;
    let rest = &t[at + marker.len()..];
    let rest = rest
        .strip_prefix('\n')
        .or_else(|| rest.strip_prefix("\\n"))?;
    let end = rest.find("<|im_end|>")?;
    let text = rest[..end].replace("\\n", "\n");
    // A template that writes the system message from a variable has no literal default.
    (!text.contains("{{") && !text.contains('\'')).then_some(text)
}

/// The turn tokens of a chat template, for code that continues a conversation token by token
/// (the daemon's `chat` prompts, `llms chat`): a turn is `start`, `{role}\n{content}`, `end`, `\n`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatTurns {
    /// `<|im_start|>` or `<start_of_turn>`.
    pub start: u32,
    /// `<|im_end|>` or `<end_of_turn>`: also where an answer stops.
    pub end: u32,
    /// The role of the model's answers: `assistant` (ChatML) or `model` (Gemma).
    pub assistant: &'static str,
}

/// A piece of a rendered conversation.
enum Segment {
    Special(u32),
    Text(String),
}

impl Tokenizer {
    /// The template's default system prompt (ChatML's may have one), put first when a
    /// conversation starts without a system message.
    pub fn default_system(&self) -> Option<&str> {
        match &self.chat_template {
            ChatTemplate::ChatMl { default_system } => default_system.as_deref(),
            _ => None,
        }
    }

    /// The turn tokens of the model's chat template, or why there are none.
    pub fn chat_turns(&self) -> Result<ChatTurns> {
        let Some((start, end, assistant)) = self.chat_template.markers() else {
            return Err(self.unsupported_template());
        };
        let special = |token: &'static str| {
            self.token_id(token)
                .ok_or(TokenizerError::MissingSpecialToken { token })
        };
        Ok(ChatTurns {
            start: special(start)?,
            end: special(end)?,
            assistant,
        })
    }

    fn unsupported_template(&self) -> TokenizerError {
        let head = match &self.chat_template {
            ChatTemplate::Unsupported {
                template: Some(t), ..
            } => t.chars().take(80).collect(),
            _ => "(none)".to_owned(),
        };
        TokenizerError::UnsupportedChatTemplate { head }
    }

    /// The conversation rendered as the model's chat template would, as text with control tokens
    /// (BOS, which [`Tokenizer::encode_chat`] adds when the model wants it, left out).
    pub fn apply_chat_template(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let mut text = String::new();
        for seg in self.chat_segments(messages, add_generation_prompt)? {
            match seg {
                Segment::Special(id) => text.push_str(&self.tokens[id as usize]),
                Segment::Text(t) => text.push_str(&t),
            }
        }
        Ok(text)
    }

    /// The tokens of the conversation in the chat template, BOS first if the model wants it.
    /// Control tokens come only from the template: a message that contains `<|im_end|>` or
    /// `<end_of_turn>` gets it as plain characters, so content cannot forge a turn.
    pub fn encode_chat(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        if self.add_bos {
            out.extend(self.bos);
        }
        for seg in self.chat_segments(messages, add_generation_prompt)? {
            match seg {
                Segment::Special(id) => out.push(id),
                Segment::Text(t) => self.encode_segments(&t, false, &mut out),
            }
        }
        Ok(out)
    }

    fn chat_segments(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<Vec<Segment>> {
        let turns = self.chat_turns()?;
        let mut segs = Vec::with_capacity(messages.len() * 4 + 3);
        let turn = |segs: &mut Vec<Segment>, role: &str, content: &str| {
            segs.push(Segment::Special(turns.start));
            segs.push(Segment::Text(format!("{role}\n{content}")));
            segs.push(Segment::Special(turns.end));
            segs.push(Segment::Text("\n".to_owned()));
        };
        match &self.chat_template {
            ChatTemplate::Gemma => {
                let (system, rest) = match messages.split_first() {
                    Some((first, rest)) if first.role == "system" => (Some(first), rest),
                    _ => (None, messages),
                };
                let mut prefix = system.map(|s| format!("{}\n\n", s.content.trim()));
                if rest.is_empty()
                    && let Some(system) = system
                {
                    turn(&mut segs, "user", system.content.trim());
                }
                for m in rest {
                    let role = if m.role == "assistant" {
                        "model"
                    } else {
                        &m.role
                    };
                    let content = match prefix.take() {
                        Some(p) => format!("{p}{}", m.content.trim()),
                        None => m.content.trim().to_owned(),
                    };
                    turn(&mut segs, role, &content);
                }
            }
            ChatTemplate::ChatMl { default_system } => {
                if let Some(system) = default_system
                    && messages.first().is_none_or(|m| m.role != "system")
                {
                    turn(&mut segs, "system", system);
                }
                for m in messages {
                    turn(&mut segs, &m.role, &m.content);
                }
            }
            ChatTemplate::Unsupported { .. } => return Err(self.unsupported_template()),
        }
        if add_generation_prompt {
            segs.push(Segment::Special(turns.start));
            segs.push(Segment::Text(format!("{}\n", turns.assistant)));
        }
        Ok(segs)
    }
}
