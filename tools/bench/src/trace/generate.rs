//! The trace generator: Poisson arrivals, a switching pattern, and per call a prompt of real
//! text whose token count is drawn from its source's Table 3 range.

use std::path::PathBuf;

use super::pattern::Switcher;
use super::rng::TraceRng;
use super::text::{Corpus, TextError};
use super::{
    FORMAT, PastCap, Pattern, Source, Trace, TraceContext, TraceHeader, TraceRow, VERSION,
};
use model::tokenizer::Tokenizer;

/// What to generate. Equal specs (and the same text files and tokenizer) give equal traces.
#[derive(Debug, Clone)]
pub struct TraceSpec {
    /// Seeds every random draw.
    pub seed: u64,
    /// Calls to generate.
    pub calls: u64,
    /// Contexts called.
    pub contexts: u32,
    /// Mean arrival rate (calls per second) of the Poisson process.
    pub rate: f64,
    /// Which context each call goes to.
    pub pattern: Pattern,
    /// The sources, given to contexts in turn: context `i` takes `sources[i % len]`.
    pub sources: Vec<Source>,
    /// Most tokens a context holds.
    pub max_context: u32,
    /// What a context does past `max_context`.
    pub past_cap: PastCap,
    /// Most tokens of each answer.
    pub max_tokens: u32,
    /// The text files prompts are cut from ([`super::DEFAULT_TEXT`] by default).
    pub text: Vec<PathBuf>,
    /// The model file's name, recorded in the header (the tokenizer is the model's).
    pub model: String,
}

impl TraceSpec {
    /// The spec with the defaults of `llms trace gen`, the paper's standard run: 8 contexts of
    /// every source, 200 calls, Markov, one call per five minutes on average, 2048-token
    /// contexts that slide.
    pub fn new(model: impl Into<String>) -> TraceSpec {
        TraceSpec {
            seed: 0,
            calls: 200,
            contexts: 8,
            rate: 1.0 / 300.0,
            pattern: Pattern::Markov {
                stay: super::DEFAULT_STAY,
                neighbour: super::DEFAULT_NEIGHBOUR,
            },
            sources: Source::TABLE3.to_vec(),
            max_context: 2048,
            past_cap: PastCap::Slide,
            max_tokens: 32,
            text: super::DEFAULT_TEXT.iter().map(PathBuf::from).collect(),
            model: model.into(),
        }
    }

    /// Why this spec makes no trace, if it does not.
    pub fn check(&self) -> Result<(), GenerateError> {
        let bad = |m: String| Err(GenerateError::Spec(m));
        if self.calls == 0 || self.calls > MAX_CALLS {
            return bad(format!("calls must be from 1 to {MAX_CALLS}"));
        }
        if self.contexts == 0 || self.contexts > MAX_CONTEXTS {
            return bad(format!("contexts must be from 1 to {MAX_CONTEXTS}"));
        }
        if !(self.rate.is_finite() && self.rate > 0.0) {
            return bad(format!(
                "the rate must be a positive number of calls per second, not {}",
                self.rate
            ));
        }
        self.pattern.check().map_err(GenerateError::Spec)?;
        if self.sources.is_empty() {
            return bad("no sources given".into());
        }
        if self.max_tokens == 0 {
            return bad("max_tokens must be at least 1".into());
        }
        for s in &self.sources {
            let longest = s.longest(self.max_context);
            let need = longest + self.max_tokens;
            if self.max_context < need {
                return bad(format!(
                    "a context of {} tokens cannot hold one call of {s} ({longest} prompt tokens \
                     and {} answer tokens): raise the maximum context to at least {need} or \
                     leave {s} out of the sources",
                    self.max_context, self.max_tokens
                ));
            }
            if let Some((lo, _)) = s.opening(self.max_context)
                && lo < MIN_DOCUMENT
            {
                return bad(format!(
                    "a context of {} tokens is too short for {s}: its documents take at most \
                     three quarters of it and at least {MIN_DOCUMENT} tokens; raise the maximum \
                     context to at least {}",
                    self.max_context,
                    MIN_DOCUMENT.div_ceil(3) * 4
                ));
            }
        }
        Ok(())
    }
}

/// The shortest pasted document of [`Source::Document`].
pub const MIN_DOCUMENT: u32 = 4_096;

/// Most calls in a trace.
pub const MAX_CALLS: u64 = 10_000_000;
/// Most contexts in a trace.
pub const MAX_CONTEXTS: u32 = 65_536;

/// Generating a trace failed.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error("{0}")]
    Spec(String),
    #[error(transparent)]
    Text(#[from] TextError),
    #[error(
        "no excerpt of the text near token {pos} encodes to exactly {tokens} tokens; try other text"
    )]
    NoExcerpt { pos: usize, tokens: u32 },
}

/// Generates the trace `spec` describes, counting tokens with `tokenizer` (the model's).
///
/// Draws, in order, from one ChaCha8 stream seeded with `spec.seed`: each context's starting
/// place in the text, then per call its inter-arrival time (exponential, mean `1/rate`), its
/// context (the pattern) and its prompt length (uniform in the source's range).
pub fn generate(spec: &TraceSpec, tokenizer: &Tokenizer) -> Result<Trace, GenerateError> {
    spec.check()?;
    let longest = (spec.sources.iter())
        .map(|s| s.longest(spec.max_context))
        .max()
        .unwrap_or(0) as usize;
    let corpus = Corpus::load(&spec.text, tokenizer, 2 * longest)?;
    let contexts: Vec<TraceContext> = (0..spec.contexts)
        .map(|i| {
            let source = spec.sources[i as usize % spec.sources.len()];
            TraceContext {
                context: i,
                app: source.app().to_string(),
                source,
            }
        })
        .collect();
    let mut rng = TraceRng::new(spec.seed);
    let mut pos: Vec<usize> = contexts
        .iter()
        .map(|_| corpus.starts()[rng.below(corpus.starts().len() as u64) as usize])
        .collect();
    let workloads: Vec<f64> = contexts.iter().map(|c| c.source.mean_delta()).collect();
    let mut switcher = Switcher::new(spec.pattern, &workloads);
    // Each context's length so far (upper bound), 0 before its first call.
    let mut length = vec![0u64; contexts.len()];
    let mut time = 0.0f64;
    let mut rows = Vec::with_capacity(spec.calls.min(1 << 20) as usize);
    for _ in 0..spec.calls {
        time += rng.exponential(spec.rate);
        let c = switcher.next(&mut rng);
        let info = &contexts[c];
        let source = info.source;
        let (lo, hi) = match source.opening(spec.max_context) {
            Some(o) if length[c] == 0 => o,
            _ => source.delta(),
        };
        let mut tokens = rng.range(lo, hi);
        let mut start = length[c] == 0;
        if spec.past_cap == PastCap::Restart
            && length[c] + u64::from(tokens + spec.max_tokens) > u64::from(spec.max_context)
        {
            start = true;
            length[c] = 0;
            // A new conversation of a document source opens with a document. (The other
            // sources draw nothing more, so their traces are as before.)
            if let Some((lo, hi)) = source.opening(spec.max_context) {
                tokens = rng.range(lo, hi);
            }
        }
        let instruction = if start {
            source.opening_instruction()
        } else {
            source.instruction()
        };
        let p = pos[c];
        let prompt = corpus
            .prompt(tokenizer, &mut pos[c], instruction, tokens as usize)
            .ok_or(GenerateError::NoExcerpt { pos: p, tokens })?;
        length[c] += u64::from(tokens + spec.max_tokens);
        rows.push(TraceRow {
            time: (time * 1e6).round() / 1e6,
            app: info.app.clone(),
            context: c as u32,
            source: info.source,
            start,
            tokens,
            max_tokens: spec.max_tokens,
            context_tokens: length[c],
            prompt,
        });
    }
    Ok(Trace {
        header: TraceHeader {
            format: FORMAT.into(),
            version: VERSION,
            seed: spec.seed,
            calls: spec.calls,
            rate: spec.rate,
            pattern: spec.pattern,
            max_context: spec.max_context,
            past_cap: spec.past_cap,
            max_tokens: spec.max_tokens,
            prompt_format: "raw".into(),
            model: spec.model.clone(),
            vocab_size: tokenizer.vocab_size() as u32,
            text: spec.text.iter().map(|p| p.display().to_string()).collect(),
            text_sha256: corpus.sha256.clone(),
            contexts,
        },
        rows,
    })
}
