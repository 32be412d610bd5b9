//! Structured output on the socket side: a call's `response_format` is compiled into a
//! [`Grammar`] by the connection's reader thread (so a large schema never holds the engine),
//! checked against the call's token budget, and shared with later calls of the same format
//! through a small cache, whose grammars keep the token masks they computed. Tools make grammars
//! too: a call of one of them between the chat template's markers, or beside it a plain answer
//! ([`Formats::tools`]).

use std::sync::Arc;

use guide::{Besides, Grammar, ToolCalls, ToolSchema, Vocab};
use model::tokenizer::{TOOL_CALL_CLOSE, TOOL_CALL_OPEN, TokenType, Tokenizer, Tool};
use parking_lot::Mutex;
use protocol::{ErrorBody, ResponseFormat, ToolChoice, codes};

/// Formats whose grammars (and their masks) are kept.
const CACHED_FORMATS: usize = 16;

/// The tokens of `tok` a structured answer may use: its text tokens (normal and byte tokens;
/// control tokens never appear in one) with their bytes.
pub fn vocab_of(tok: &Tokenizer) -> Vocab {
    let size = tok.vocab_size();
    Vocab::new(
        size,
        (0..size as u32).filter_map(|id| {
            matches!(
                tok.token_type(id),
                Some(TokenType::Normal | TokenType::Byte)
            )
            .then(|| tok.token_bytes(id).map(|b| (id, b)))
            .flatten()
        }),
    )
}

/// The answer formats compiled so far, most recently used last.
pub struct Formats {
    vocab: Arc<Vocab>,
    cache: Mutex<Vec<(String, Arc<Grammar>)>>,
}

impl Formats {
    /// The formats of the model whose tokenizer is `tok` ([`vocab_of`]).
    pub fn new(tok: &Tokenizer) -> Formats {
        let vocab = vocab_of(tok);
        tracing::info!(
            tokens = vocab.text_tokens(),
            nodes = vocab.nodes(),
            "structured output's vocabulary"
        );
        Formats {
            vocab: Arc::new(vocab),
            cache: Mutex::new(Vec::new()),
        }
    }

    /// The vocabulary answers are made of.
    pub fn vocab(&self) -> &Arc<Vocab> {
        &self.vocab
    }

    /// The grammar of `format`, compiled or from the cache; a call of `max_tokens` must leave
    /// room for its shortest answer.
    pub fn grammar(
        &self,
        format: &ResponseFormat,
        max_tokens: usize,
    ) -> Result<Arc<Grammar>, ErrorBody> {
        let key = serde_json::to_string(format).unwrap_or_default();
        let g = self.cached(key, "response_format", || match format {
            ResponseFormat::JsonSchema { schema } => {
                Grammar::from_schema(schema, Arc::clone(&self.vocab))
            }
            ResponseFormat::Regex { pattern } => {
                Grammar::from_regex(pattern, Arc::clone(&self.vocab))
            }
        })?;
        if g.min_tokens() > max_tokens {
            return Err(ErrorBody::new(
                codes::BAD_REQUEST,
                format!(
                    "max_tokens {max_tokens} is too few for response_format: its shortest answer \
                     may take {} tokens",
                    g.min_tokens()
                ),
            ));
        }
        Ok(g)
    }

    /// The grammar of an answer under `tools` as `choice` says (not `none`: that answer is not
    /// guided by tools), beside `format`'s answers with `auto`. An error names the tool.
    pub fn tools(
        &self,
        tools: &[Tool],
        choice: &ToolChoice,
        format: Option<&Grammar>,
    ) -> Result<Arc<Grammar>, ErrorBody> {
        let callable: Vec<ToolSchema> = tools
            .iter()
            .filter(|t| !matches!(choice, ToolChoice::Tool(n) if *n != t.name))
            .map(|t| ToolSchema {
                name: &t.name,
                parameters: &t.parameters,
            })
            .collect();
        let besides = match (choice, format) {
            (ToolChoice::Auto, Some(f)) => Besides::Regex(f.regex()),
            (ToolChoice::Auto, None) => Besides::Text,
            _ => Besides::Nothing,
        };
        let calls = ToolCalls {
            tools: &callable,
            open: TOOL_CALL_OPEN,
            close: TOOL_CALL_CLOSE,
            besides,
        };
        let key = serde_json::json!({
            "tools": tools.iter().map(|t| (&t.name, &t.parameters)).collect::<Vec<_>>(),
            "choice": choice,
            "besides": format.map(|f| f.regex()),
        });
        self.cached(key.to_string(), "tools", || {
            Grammar::from_tools(&calls, Arc::clone(&self.vocab))
        })
    }

    /// The grammar cached under `key`, or compiled by `compile` (and cached); an error says it
    /// was `what` that failed.
    fn cached(
        &self,
        key: String,
        what: &str,
        compile: impl FnOnce() -> Result<Grammar, guide::GuideError>,
    ) -> Result<Arc<Grammar>, ErrorBody> {
        {
            let mut c = self.cache.lock();
            if let Some(i) = c.iter().position(|(k, _)| *k == key) {
                let e = c.remove(i);
                let g = Arc::clone(&e.1);
                c.push(e);
                return Ok(g);
            }
        }
        let started = std::time::Instant::now();
        let g = compile().map_err(|e| ErrorBody::new(e.code(), format!("{what}: {e}")))?;
        tracing::info!(
            what,
            states = g.states(),
            ms = started.elapsed().as_secs_f64() * 1e3,
            "answer format compiled"
        );
        let g = Arc::new(g);
        let mut c = self.cache.lock();
        if c.len() >= CACHED_FORMATS {
            c.remove(0);
        }
        c.push((key, Arc::clone(&g)));
        Ok(g)
    }
}

/// The wire's tools as the chat template's.
pub fn template_tools(tools: &[protocol::Tool]) -> Vec<Tool> {
    tools
        .iter()
        .map(|t| Tool {
            name: t.name.clone(),
            description: t.description.clone(),
            parameters: t.parameters.clone(),
        })
        .collect()
}
