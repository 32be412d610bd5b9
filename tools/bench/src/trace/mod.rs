//! Context-switching traces (paper §4): the JSON-lines file `llms trace gen` writes and
//! `llms bench switch` replays, its generator and its summary. The format is in `docs/trace.md`.
//!
//! A trace is a header line ([`TraceHeader`]: the generator's parameters, seed and contexts)
//! followed by one [`TraceRow`] per call, in time order. [`generate`] makes one from a
//! [`TraceSpec`] and the model's tokenizer, [`write`] and [`read`] move it to and from a file,
//! [`Summary::of`] counts what it holds.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

mod generate;
mod pattern;
mod rng;
mod summary;
mod text;

pub use generate::{GenerateError, TraceSpec, generate};
pub use pattern::{
    DEFAULT_NEIGHBOUR, DEFAULT_SIGMA, DEFAULT_STAY, Pattern, gaussian_weights, markov_matrix,
};
pub use summary::{ContextSummary, Histogram, SourceSummary, Stats, Summary};
pub use text::DEFAULT_TEXT;

/// The `format` of a trace's header.
pub const FORMAT: &str = "llms-trace";
/// The version of the format this code writes and reads.
pub const VERSION: u32 = 1;

/// A source of calls: one of the paper's Table 3 datasets ([`Source::TABLE3`]) or a long-context
/// workload (a pasted document, a growing chat), which fixes each call's prompt growth (delta
/// tokens), the app that makes such calls and the instruction its prompts start with.
/// Every source is in `<Source as strum::VariantArray>::VARIANTS`, Table 3's first; its name
/// in traces and on the command line ([`Source::name`], `Display`, `FromStr`, serde) is the
/// variant's in snake case.
#[derive(
    Serialize,
    Deserialize,
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    strum::Display,
    strum::EnumString,
    strum::IntoStaticStr,
    strum::VariantArray,
)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum Source {
    /// AG News, news classification: 200–500 tokens per call.
    AgNews,
    /// XSum, document summary: 1000–2000.
    Xsum,
    /// SAMSum, chat history summary: 100–300.
    Samsum,
    /// CNN/DailyMail, text comprehension: 500–1000.
    CnnDailymail,
    /// WMT17 de-en, translation: 100–500.
    Wmt,
    /// SST-2, sentiment classification: 10–100.
    Sst2,
    /// A long document pasted into a new conversation (4,096–16,384 tokens, at most three
    /// quarters of the context), then short questions on it: 10–60 tokens per call.
    Document,
    /// A chat that grows to the context's limit and slides: 100–400 tokens per call.
    Chat,
}

impl Source {
    /// The name in traces and on the command line.
    pub fn name(self) -> &'static str {
        self.into()
    }

    /// Prompt tokens per call, inclusive (paper Table 3, "delta length").
    pub fn delta(self) -> (u32, u32) {
        match self {
            Source::AgNews => (200, 500),
            Source::Xsum => (1000, 2000),
            Source::Samsum => (100, 300),
            Source::CnnDailymail => (500, 1000),
            Source::Wmt => (100, 500),
            Source::Sst2 => (10, 100),
            Source::Document => (10, 60),
            Source::Chat => (100, 400),
        }
    }

    /// Prompt tokens of the first call of a conversation, inclusive, in a context of
    /// `max_context` tokens, when it differs from [`Source::delta`]: the pasted document, at
    /// most three quarters of the context.
    pub fn opening(self, max_context: u32) -> Option<(u32, u32)> {
        match self {
            Source::Document => {
                let hi = (max_context / 4 * 3).min(16_384);
                Some((4_096.min(hi), hi))
            }
            _ => None,
        }
    }

    /// The longest prompt of this source in a context of `max_context` tokens.
    pub fn longest(self, max_context: u32) -> u32 {
        self.opening(max_context)
            .map_or(0, |o| o.1)
            .max(self.delta().1)
    }

    /// The mean prompt growth per call: the workload the Gaussian pattern ranks contexts by.
    pub fn mean_delta(self) -> f64 {
        let (lo, hi) = self.delta();
        f64::from(lo + hi) / 2.0
    }

    /// The app whose contexts take calls of this source.
    pub fn app(self) -> &'static str {
        match self {
            Source::AgNews => "news",
            Source::Xsum => "reader",
            Source::Samsum => "messages",
            Source::CnnDailymail => "browser",
            Source::Wmt => "translate",
            Source::Sst2 => "reviews",
            Source::Document => "docs",
            Source::Chat => "assistant",
        }
    }

    /// The instruction a prompt of this source starts with (the text follows after a blank
    /// line); short enough for the smallest delta.
    pub fn instruction(self) -> &'static str {
        match self {
            Source::AgNews => "Classify the topic of this news text.",
            Source::Xsum => "Summarize this document in one sentence.",
            Source::Samsum => "Summarize this conversation.",
            Source::CnnDailymail => "Read the article and list its main points.",
            Source::Wmt => "Translate into German:",
            Source::Sst2 => "Sentiment?",
            Source::Document => "Answer from the document above:",
            Source::Chat => "Reply to this message.",
        }
    }

    /// The instruction of a conversation's first call, when it differs from
    /// [`Source::instruction`].
    pub fn opening_instruction(self) -> &'static str {
        match self {
            Source::Document => "Read this document; questions about it follow.",
            s => s.instruction(),
        }
    }

    /// The paper's Table 3 sources: `llms trace gen`'s default.
    pub const TABLE3: [Source; 6] = [
        Source::AgNews,
        Source::Xsum,
        Source::Samsum,
        Source::CnnDailymail,
        Source::Wmt,
        Source::Sst2,
    ];
}

/// What a context does when its next call would take it past `max_context` tokens.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, strum::IntoStaticStr)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum PastCap {
    /// The calls go on; the service keeps the last `max_context` tokens (a sliding window).
    /// Rows past the cap have `context_tokens > max_context`.
    Slide,
    /// The conversation ends and a new one starts in the same context: the row has
    /// `start: true` and the replay deletes and recreates the context before it.
    Restart,
}

impl PastCap {
    /// The name in traces and on the command line.
    pub fn name(self) -> &'static str {
        self.into()
    }
}

/// One context of a trace: which app owns it and which source its calls come from.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TraceContext {
    /// The context's number in the trace's rows (0-based).
    pub context: u32,
    /// The app that owns it.
    pub app: String,
    /// The source of its calls.
    pub source: Source,
}

/// A trace's first line: what generated it, so a trace describes itself and can be made again.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TraceHeader {
    /// Always [`FORMAT`].
    pub format: String,
    /// The format's version, [`VERSION`].
    pub version: u32,
    /// The generator's seed.
    pub seed: u64,
    /// Calls in the trace (the rows that follow).
    pub calls: u64,
    /// Mean arrival rate of the Poisson process, calls per second.
    pub rate: f64,
    /// The switching pattern and its parameters.
    pub pattern: Pattern,
    /// Most tokens a context holds (see `past_cap`).
    pub max_context: u32,
    /// What a context does past `max_context`.
    pub past_cap: PastCap,
    /// Most tokens of each answer (every row's `max_tokens`).
    pub max_tokens: u32,
    /// The request format the token counts are exact for: `raw` (the prompt's text alone,
    /// encoded by the model's tokenizer without control tokens).
    pub prompt_format: String,
    /// The GGUF whose tokenizer counted the tokens (file name).
    pub model: String,
    /// That tokenizer's vocabulary size.
    pub vocab_size: u32,
    /// The text files the prompts were cut from, in order.
    pub text: Vec<String>,
    /// SHA-256 of those files' bytes, concatenated in order (hex).
    pub text_sha256: String,
    /// Every context, in order: `contexts[i].context == i`.
    pub contexts: Vec<TraceContext>,
}

/// One call of a trace.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TraceRow {
    /// When the call arrives, in seconds from the trace's start (microsecond resolution).
    pub time: f64,
    /// The app that calls (the context's owner).
    pub app: String,
    /// The context called (an index into the header's `contexts`).
    pub context: u32,
    /// The source of this call's prompt.
    pub source: Source,
    /// This call starts the context's conversation: its first call, or the first after a
    /// restart (`past_cap: restart`). The replay creates (or recreates) the context first.
    pub start: bool,
    /// The prompt's length in the model's tokens (raw format), exactly.
    pub tokens: u32,
    /// Most tokens to generate in answer.
    pub max_tokens: u32,
    /// The context's length after this call if every answer so far used its `max_tokens` (an
    /// upper bound), counted from the conversation's start, past the cap too.
    pub context_tokens: u64,
    /// The prompt's text.
    pub prompt: String,
}

/// A whole trace: its header and its calls in time order.
#[derive(Debug, Clone, PartialEq)]
pub struct Trace {
    pub header: TraceHeader,
    pub rows: Vec<TraceRow>,
}

/// Reading or writing a trace file failed.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is empty, not a trace (make one with `llms trace gen`)")]
    Empty { path: PathBuf },
    #[error("{path}: the header says {expected} calls but the file has {found} (cut short?)")]
    Truncated {
        path: PathBuf,
        expected: u64,
        found: u64,
    },
    #[error("{path}:{line}: {message}")]
    Malformed {
        path: PathBuf,
        line: usize,
        message: String,
    },
}

/// Reads the trace in `path`, checking every line: the header first, then rows whose contexts,
/// apps and sources agree with it, in time order, as many as the header says.
pub fn read(path: &Path) -> Result<Trace, TraceError> {
    let file = std::fs::File::open(path).map_err(|source| TraceError::Read {
        path: path.to_owned(),
        source,
    })?;
    read_from(BufReader::new(file), path)
}

/// [`read`] from any reader; `path` names it in errors.
pub fn read_from(reader: impl BufRead, path: &Path) -> Result<Trace, TraceError> {
    let bad = |line: usize, message: String| TraceError::Malformed {
        path: path.to_owned(),
        line,
        message,
    };
    let mut header: Option<TraceHeader> = None;
    let mut rows = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let n = i + 1;
        let line = line.map_err(|source| match source.kind() {
            std::io::ErrorKind::InvalidData => bad(n, "not UTF-8 text".into()),
            _ => TraceError::Read {
                path: path.to_owned(),
                source,
            },
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let Some(h) = &header else {
            header = Some(parse_header(&line).map_err(|m| bad(n, m))?);
            continue;
        };
        let row: TraceRow =
            serde_json::from_str(&line).map_err(|e| bad(n, format!("not a trace row: {e}")))?;
        check_row(h, rows.last(), &row).map_err(|m| bad(n, m))?;
        rows.push(row);
    }
    let Some(header) = header else {
        return Err(TraceError::Empty {
            path: path.to_owned(),
        });
    };
    if rows.len() as u64 != header.calls {
        return Err(TraceError::Truncated {
            path: path.to_owned(),
            expected: header.calls,
            found: rows.len() as u64,
        });
    }
    Ok(Trace { header, rows })
}

fn parse_header(line: &str) -> Result<TraceHeader, String> {
    let v: serde_json::Value = serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
    if v.get("format").and_then(|f| f.as_str()) != Some(FORMAT) {
        return Err(format!(
            "not an llms trace: the first line must be a header with \"format\":\"{FORMAT}\""
        ));
    }
    match v.get("version").and_then(|f| f.as_u64()) {
        Some(ver) if ver == u64::from(VERSION) => {}
        Some(ver) => {
            return Err(format!(
                "trace format version {ver}; this llms reads version {VERSION}"
            ));
        }
        None => return Err("the header has no version".into()),
    }
    let h: TraceHeader =
        serde_json::from_value(v).map_err(|e| format!("not a trace header: {e}"))?;
    h.pattern.check().map_err(|e| format!("bad pattern: {e}"))?;
    if !(h.rate.is_finite() && h.rate > 0.0) {
        return Err(format!("rate must be positive, not {}", h.rate));
    }
    for (i, c) in h.contexts.iter().enumerate() {
        if c.context as usize != i {
            return Err(format!("contexts[{i}] has number {}", c.context));
        }
    }
    Ok(h)
}

fn check_row(h: &TraceHeader, prev: Option<&TraceRow>, row: &TraceRow) -> Result<(), String> {
    let Some(ctx) = h.contexts.get(row.context as usize) else {
        return Err(format!(
            "context {} is not in the header's {} contexts",
            row.context,
            h.contexts.len()
        ));
    };
    if ctx.app != row.app || ctx.source != row.source {
        return Err(format!(
            "context {} is {}/{} in the header but {}/{} here",
            row.context, ctx.app, ctx.source, row.app, row.source
        ));
    }
    if !(row.time.is_finite() && row.time >= 0.0) {
        return Err(format!("time {} is not a time in seconds", row.time));
    }
    if let Some(p) = prev
        && row.time < p.time
    {
        return Err(format!(
            "time {} is before the previous row's {}: rows must be in time order",
            row.time, p.time
        ));
    }
    if row.tokens == 0 || row.prompt.is_empty() {
        return Err("empty prompt".into());
    }
    Ok(())
}

/// Writes `trace` to `path` (replacing it): the header line, then one line per row.
pub fn write(trace: &Trace, path: &Path) -> Result<(), TraceError> {
    let err = |source| TraceError::Write {
        path: path.to_owned(),
        source,
    };
    let file = std::fs::File::create(path).map_err(err)?;
    let mut w = std::io::BufWriter::new(file);
    write_to(trace, &mut w).map_err(err)?;
    w.into_inner()
        .map_err(|e| err(e.into_error()))?
        .sync_all()
        .map_err(err)
}

/// [`write`] to any writer.
pub fn write_to(trace: &Trace, w: &mut impl Write) -> std::io::Result<()> {
    serde_json::to_writer(&mut *w, &trace.header)?;
    w.write_all(b"\n")?;
    for row in &trace.rows {
        serde_json::to_writer(&mut *w, row)?;
        w.write_all(b"\n")?;
    }
    w.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use strum::VariantArray;

    fn json(v: &impl Serialize) -> String {
        serde_json::to_string(v).unwrap()
    }

    #[test]
    fn names_are_the_serde_names_and_parse_back() {
        for &s in Source::VARIANTS {
            assert_eq!(json(&s), format!("\"{}\"", s.name()));
            assert_eq!(s.name().parse::<Source>().unwrap(), s);
            assert_eq!(s.to_string(), s.name());
        }
        assert!("imdb".parse::<Source>().is_err());
        for p in [PastCap::Slide, PastCap::Restart] {
            assert_eq!(json(&p), format!("\"{}\"", p.name()));
        }
        let patterns = [
            Pattern::Random,
            Pattern::Markov {
                stay: DEFAULT_STAY,
                neighbour: DEFAULT_NEIGHBOUR,
            },
            Pattern::Gaussian {
                sigma: DEFAULT_SIGMA,
            },
        ];
        for p in patterns {
            assert!(
                json(&p).contains(&format!("\"kind\":\"{}\"", p.name())),
                "{p:?}"
            );
        }
    }
}
