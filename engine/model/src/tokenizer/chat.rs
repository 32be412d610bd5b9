//! Conversations as the model reads them: messages and the chat templates that render them (ChatML,
//! recognised from the GGUF's `tokenizer.chat_template`).

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

/// The chat format the model's `tokenizer.chat_template` describes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChatTemplate {
    /// `<|im_start|>{role}\n{content}<|im_end|>\n` per message, with the template's system prompt (if it
    /// has one) put first when the conversation does not start with a system message.
    ChatMl { default_system: Option<String> },
    /// The model has no template, or one this crate does not render; the text is kept for the error.
    Unsupported { template: Option<String> },
}

impl ChatTemplate {
    /// Recognises the template from its Jinja source (which this crate does not execute).
    pub fn from_jinja(template: Option<&str>) -> ChatTemplate {
        let Some(t) = template else {
            return ChatTemplate::Unsupported { template: None };
        };
        if !t.contains("<|im_start|>") || !t.contains("<|im_end|>") {
            return ChatTemplate::Unsupported {
                template: Some(t.to_owned()),
            };
        }
        // A default system prompt appears as a literal `<|im_start|>system\n...<|im_end|>` in the template;
        // the newline may be written raw or as a `\n` escape in the Jinja string literal.
        let marker = "<|im_start|>system";
        let default_system = t.find(marker).and_then(|at| {
            let rest = &t[at + marker.len()..];
            let rest = rest
                .strip_prefix('\n')
                .or_else(|| rest.strip_prefix("\\n"))?;
            let end = rest.find("<|im_end|>")?;
            let text = rest[..end].replace("\\n", "\n");
            // A template that writes the system message from a variable has no literal default.
            (!text.contains("{{") && !text.contains('\'')).then_some(text)
        });
        ChatTemplate::ChatMl { default_system }
    }
}
