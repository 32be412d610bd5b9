//! Structured output on the socket side: a call's `response_format` is compiled into a
//! [`Grammar`] by the connection's reader thread (so a large schema never holds the engine),
//! checked against the call's token budget, and shared with later calls of the same format
//! through a small cache, whose grammars keep the token masks they computed.

use std::sync::Arc;

use guide::{Grammar, Vocab};
use model::tokenizer::{TokenType, Tokenizer};
use parking_lot::Mutex;
use protocol::{ErrorBody, ResponseFormat, codes};

/// Formats whose grammars (and their masks) are kept.
const CACHED_FORMATS: usize = 8;

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
        let cached = {
            let mut c = self.cache.lock();
            c.iter().position(|(k, _)| *k == key).map(|i| {
                let e = c.remove(i);
                let g = Arc::clone(&e.1);
                c.push(e);
                g
            })
        };
        let g = match cached {
            Some(g) => g,
            None => {
                let started = std::time::Instant::now();
                let g = match format {
                    ResponseFormat::JsonSchema { schema } => {
                        Grammar::from_schema(schema, Arc::clone(&self.vocab))
                    }
                    ResponseFormat::Regex { pattern } => {
                        Grammar::from_regex(pattern, Arc::clone(&self.vocab))
                    }
                }
                .map_err(|e| ErrorBody::new(e.code(), format!("response_format: {e}")))?;
                tracing::info!(
                    states = g.states(),
                    ms = started.elapsed().as_secs_f64() * 1e3,
                    "response format compiled"
                );
                let g = Arc::new(g);
                let mut c = self.cache.lock();
                if c.len() >= CACHED_FORMATS {
                    c.remove(0);
                }
                c.push((key, Arc::clone(&g)));
                g
            }
        };
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
}
