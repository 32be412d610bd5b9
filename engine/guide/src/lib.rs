//! guide: structured output. A JSON Schema or a regular expression becomes a byte automaton
//! ([`Grammar`]), and a [`Matcher`] puts it on the logits token by token, so an answer always
//! matches: every token that would leave the language is masked, the end of the answer (a stop
//! token) is allowed only where the text may end, and the answer ends by itself where the
//! automaton accepts and no byte leads on.
//!
//! The steps: a schema becomes a regular expression ([`schema`], bounded: see its doc), the
//! expression a DFA over bytes (regex-automata, copied into [`automaton`]'s flat table), and the
//! vocabulary a byte trie ([`Vocab`]); the tokens a DFA state allows are found by one walk of
//! the trie from that state, computed the first time a state is reached and cached with the
//! grammar, so a decode step costs one lookup and one pass over the logits.
//!
//! An answer also fits its token budget: a state's distance to an end (in bytes, each at most a
//! token) is known, and when the budget gets close, only tokens that keep an end within reach
//! are allowed, so an answer cut by `max_tokens` or a full context still parses.
//!
//! This crate knows nothing of the model: a vocabulary is token ids and their bytes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

pub mod automaton;
pub mod examples;
mod numbers;
pub mod oracle;
mod pattern;
mod schema;
mod tools;
mod vocab;

pub use tools::{Besides, ToolCalls, ToolSchema};
pub use vocab::{MAX_TOKEN_BYTES, Vocab};

use automaton::{BuildError, DEAD, Table};

/// Bytes of token masks one grammar keeps; past them masks are computed each time they are
/// needed (correct, slower).
pub const MASK_CACHE_BYTES: usize = 16 << 20;

/// Why a response format cannot be used. [`GuideError::code`] is the protocol's error code.
#[derive(Debug, thiserror::Error)]
pub enum GuideError {
    /// A schema keyword this crate does not implement (never ignored).
    #[error("schema keyword {keyword:?} at {at} is not supported: {why}")]
    Unsupported {
        keyword: String,
        at: String,
        why: String,
    },
    /// The schema is not a valid JSON Schema, or no value satisfies it.
    #[error("invalid JSON Schema at {at}: {what}")]
    InvalidSchema { at: String, what: String },
    /// The regex does not compile, or matches no text.
    #[error("the regex cannot be used: {what}")]
    InvalidRegex { what: String },
    /// The automaton would be larger than the limits.
    #[error(
        "the {what} is too large an automaton for structured output ({detail}); use shorter \
         bounds or fewer alternatives"
    )]
    TooComplex { what: &'static str, detail: String },
}

impl GuideError {
    /// The stable error code of the protocol.
    pub fn code(&self) -> &'static str {
        match self {
            GuideError::Unsupported { .. } => "bad_request",
            GuideError::InvalidSchema { .. } => "invalid_schema",
            GuideError::InvalidRegex { .. } => "invalid_regex",
            GuideError::TooComplex { .. } => "too_complex",
        }
    }
}

/// The tokens one automaton state allows.
#[derive(Debug)]
struct Mask {
    /// One bit per token id.
    bits: Vec<u64>,
    /// The allowed ids when they are few (applying then writes them into a cleared row).
    sparse: Option<Vec<u32>>,
    count: usize,
}

impl Mask {
    fn new(size: usize, mut ids: Vec<u32>) -> Mask {
        ids.sort_unstable();
        ids.dedup();
        let mut bits = vec![0u64; size.div_ceil(64)];
        for &t in &ids {
            bits[t as usize / 64] |= 1 << (t % 64);
        }
        let count = ids.len();
        Mask {
            bits,
            sparse: (count < size / 8).then_some(ids),
            count,
        }
    }

    fn bytes(&self) -> usize {
        self.bits.len() * 8 + self.sparse.as_ref().map_or(0, |s| s.len() * 4)
    }

    /// Sets every logit the mask does not allow to -inf (ids past the vocabulary too).
    fn apply(&self, logits: &mut [f32], kept: &mut Vec<f32>) {
        if let Some(ids) = &self.sparse {
            kept.clear();
            kept.extend(
                ids.iter()
                    .map(|&t| logits.get(t as usize).copied().unwrap_or(0.0)),
            );
            logits.fill(f32::NEG_INFINITY);
            for (&t, &l) in ids.iter().zip(kept.iter()) {
                if let Some(x) = logits.get_mut(t as usize) {
                    *x = l;
                }
            }
            return;
        }
        for (w, chunk) in logits.chunks_mut(64).enumerate() {
            let word = self.bits.get(w).copied().unwrap_or(0);
            if word == u64::MAX {
                continue;
            }
            for (i, x) in chunk.iter_mut().enumerate() {
                if word & (1 << i) == 0 {
                    *x = f32::NEG_INFINITY;
                }
            }
        }
    }
}

#[derive(Default)]
struct MaskCache {
    masks: HashMap<u32, Arc<Mask>>,
    bytes: usize,
}

/// A response format compiled for one vocabulary: the automaton and its cached token masks.
/// Shared by the calls that use the same format (`Arc`), read and filled from any thread.
pub struct Grammar {
    table: Table,
    vocab: Arc<Vocab>,
    regex: String,
    cache: Mutex<MaskCache>,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar")
            .field("states", &self.table.states())
            .field("min_tokens", &self.min_tokens())
            .finish_non_exhaustive()
    }
}

impl Grammar {
    /// Compiles a JSON Schema: every answer is JSON text that validates.
    pub fn from_schema(
        schema: &serde_json::Value,
        vocab: Arc<Vocab>,
    ) -> Result<Grammar, GuideError> {
        let regex = schema::schema_regex(schema)?;
        Grammar::from_built(&regex, vocab, "schema")
    }

    /// Compiles the expression a schema (or tools, `what`) became: an expression that does not
    /// compile, or matches nothing, is the schema's fault.
    fn from_built(
        regex: &str,
        vocab: Arc<Vocab>,
        what: &'static str,
    ) -> Result<Grammar, GuideError> {
        let table = Table::build(regex).map_err(|e| match e {
            BuildError::TooLarge(detail) => GuideError::TooComplex { what, detail },
            BuildError::Empty => GuideError::InvalidSchema {
                at: "#".into(),
                what: "no JSON value satisfies this schema".into(),
            },
            BuildError::Regex(what) => GuideError::InvalidSchema {
                at: "#".into(),
                what: format!("its expression does not compile: {what}"),
            },
        })?;
        Ok(Grammar::new(table, vocab, regex.to_owned()))
    }

    /// Compiles a regular expression (Rust `regex` syntax): every answer matches it as a whole.
    pub fn from_regex(pattern: &str, vocab: Arc<Vocab>) -> Result<Grammar, GuideError> {
        let table = Table::build(pattern).map_err(|e| match e {
            BuildError::TooLarge(detail) => GuideError::TooComplex {
                what: "regex",
                detail,
            },
            BuildError::Empty => GuideError::InvalidRegex {
                what: "it matches no text".into(),
            },
            BuildError::Regex(what) => GuideError::InvalidRegex { what },
        })?;
        Ok(Grammar::new(table, vocab, pattern.to_owned()))
    }

    fn new(table: Table, vocab: Arc<Vocab>, regex: String) -> Grammar {
        Grammar {
            table,
            vocab,
            regex,
            cache: Mutex::new(MaskCache::default()),
        }
    }

    /// The regular expression the answers match.
    pub fn regex(&self) -> &str {
        &self.regex
    }

    /// The automaton's states.
    pub fn states(&self) -> usize {
        self.table.states()
    }

    /// Bytes the automaton's table holds.
    pub fn table_bytes(&self) -> usize {
        self.table.bytes()
    }

    /// Tokens enough for the shortest answer, one byte a token: a call needs at least this
    /// `max_tokens`.
    pub fn min_tokens(&self) -> usize {
        self.table.dist[self.table.start as usize] as usize
    }

    /// Whether `text` as a whole is an answer.
    pub fn matches(&self, text: &[u8]) -> bool {
        self.table.matches(text)
    }

    /// Masks cached so far, and their bytes.
    pub fn cached_masks(&self) -> (usize, usize) {
        let c = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        (c.masks.len(), c.bytes)
    }

    /// The mask of `state`, from the cache or computed (and cached while there is room); says
    /// whether it was computed.
    fn mask(&self, state: u32) -> (Arc<Mask>, bool) {
        if let Some(m) = self
            .cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .masks
            .get(&state)
        {
            return (Arc::clone(m), false);
        }
        let m = Arc::new(self.compute(state, None));
        let mut c = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if c.bytes + m.bytes() <= MASK_CACHE_BYTES && !c.masks.contains_key(&state) {
            c.bytes += m.bytes();
            c.masks.insert(state, Arc::clone(&m));
        }
        (m, true)
    }

    /// The tokens allowed from `state`; with a `budget`, only those after which an end is at
    /// most `budget` bytes away.
    fn compute(&self, state: u32, budget: Option<u32>) -> Mask {
        let t = &self.table;
        let mut ids = Vec::new();
        self.vocab.walk(
            state,
            |s, b| Some(t.step(s, b)).filter(|&n| n != DEAD),
            |tok, s| {
                if budget.is_none_or(|b| t.dist[s as usize] <= b) {
                    ids.push(tok)
                }
            },
        );
        Mask::new(self.vocab.size(), ids)
    }
}

/// What decoding does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Sample from the masked logits.
    Sample,
    /// The answer is complete (nothing may follow), or cannot go on: end the call.
    End,
}

/// One answer's walk through a grammar.
#[derive(Debug)]
pub struct Matcher {
    grammar: Arc<Grammar>,
    state: u32,
    /// The tokens that end an answer: allowed only where the text may end.
    stop: Vec<u32>,
    saved: Vec<f32>,
    kept: Vec<f32>,
    /// Masks computed for this answer (cache misses and budget-limited steps).
    pub computed: usize,
}

impl Matcher {
    pub fn new(grammar: Arc<Grammar>, stop: Vec<u32>) -> Matcher {
        let state = grammar.table.start;
        Matcher {
            grammar,
            state,
            stop,
            saved: Vec::new(),
            kept: Vec::new(),
            computed: 0,
        }
    }

    /// Whether the text so far is a whole answer.
    pub fn is_accepting(&self) -> bool {
        self.state != DEAD && self.grammar.table.accept[self.state as usize]
    }

    /// Masks `logits` for the next token, of which `remaining` (at least 1, this one
    /// included) may still be generated.
    pub fn constrain(&mut self, logits: &mut [f32], remaining: usize) -> Step {
        let t = &self.grammar.table;
        let s = self.state;
        if s == DEAD || remaining == 0 {
            return Step::End;
        }
        let accepting = t.accept[s as usize];
        if accepting && (!t.way_on[s as usize] || self.stop.is_empty() && remaining == 1) {
            return Step::End;
        }
        let after = (remaining - 1).min(u32::MAX as usize) as u32;
        let mask = if after < t.max_dist {
            // Close to the budget: only tokens that keep an end within reach.
            self.computed += 1;
            Arc::new(self.grammar.compute(s, Some(after)))
        } else {
            let (m, computed) = self.grammar.mask(s);
            self.computed += usize::from(computed);
            m
        };
        if mask.count == 0 && (!accepting || self.stop.is_empty()) {
            return Step::End;
        }
        self.saved.clear();
        self.saved.extend(
            self.stop
                .iter()
                .map(|&id| logits.get(id as usize).copied().unwrap_or(0.0)),
        );
        mask.apply(logits, &mut self.kept);
        if accepting {
            for (&id, &l) in self.stop.iter().zip(&self.saved) {
                if let Some(x) = logits.get_mut(id as usize) {
                    *x = l;
                }
            }
        }
        Step::Sample
    }

    /// Moves past `token`; a stop token changes nothing. Returns false if the token leaves the
    /// language (a caller that sampled from masked logits never sees it).
    pub fn advance(&mut self, token: u32) -> bool {
        if self.stop.contains(&token) {
            return self.is_accepting();
        }
        let bytes = self.grammar.vocab.token_bytes(token);
        if bytes.is_empty() {
            self.state = DEAD;
        }
        if self.state != DEAD {
            self.state = self.grammar.table.walk(self.state, bytes);
        }
        self.state != DEAD
    }
}

#[cfg(test)]
mod tests;
