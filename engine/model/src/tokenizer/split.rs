//! Pre-tokenization: the split patterns `tokenizer.ggml.pre` names, as llama.cpp maps them, each run
//! by the fastest regex engine that gives the same pieces.

use super::*;

/// The split patterns of a pre-tokenizer, applied in sequence; each splits the pieces of the previous one,
/// and text between matches stays a piece of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PreTokenizer {
    /// GPT-2's pattern.
    Gpt2,
    /// Every digit on its own, then GPT-2's pattern (SmolLM, StarCoder and friends).
    DigitsThenGpt2,
    /// Llama 3's pattern (numbers in groups of up to three).
    Llama3,
    /// Qwen 2's pattern (single digits).
    Qwen2,
}

pub(crate) const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
pub(crate) const LLAMA3_PATTERN: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
pub(crate) const QWEN2_PATTERN: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

impl PreTokenizer {
    /// The pre-tokenizer for a `tokenizer.ggml.pre` name, following llama.cpp's table.
    pub(crate) fn from_name(pre: &str) -> Option<PreTokenizer> {
        Some(match pre {
            "gpt-2" | "gpt2" | "mpt" | "olmo" | "jais" | "trillion" | "exaone4" => {
                PreTokenizer::Gpt2
            }
            "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone"
            | "minerva-7b" => PreTokenizer::DigitsThenGpt2,
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "pixtral" | "dbrx" | "smaug-bpe" => {
                PreTokenizer::Llama3
            }
            "qwen2" | "stablelm2" | "deepseek-r1-qwen" | "hunyuan" => PreTokenizer::Qwen2,
            _ => return None,
        })
    }

    pub(crate) fn patterns(self) -> &'static [&'static str] {
        match self {
            PreTokenizer::Gpt2 => &[GPT2_PATTERN],
            PreTokenizer::DigitsThenGpt2 => &[r"\p{N}", GPT2_PATTERN],
            PreTokenizer::Llama3 => &[LLAMA3_PATTERN],
            PreTokenizer::Qwen2 => &[QWEN2_PATTERN],
        }
    }
}

/// The alternatives that end every GPT-2-like pattern; the lookahead needs a backtracking engine.
pub(crate) const LOOKAHEAD_TAIL: &str = r"|\s+(?!\S)|\s+";

/// One split pattern of a pre-tokenizer, run by the fastest engine that gives the same pieces.
pub(crate) enum Splitter {
    /// A pattern the `regex` crate runs as it is.
    Plain(regex::Regex),
    /// A pattern ending in `\s+(?!\S)|\s+`, run as `...|\s+` by the `regex` crate with the lookahead done
    /// by hand: a run of several whitespace characters followed by a non-space leaves its last character
    /// to the next piece. `newline_alt` says the pattern has a `\s*[\r\n]+` alternative before the tail.
    WhitespaceLookahead { re: regex::Regex, newline_alt: bool },
    /// Anything else, by backtracking.
    Fancy(fancy_regex::Regex),
}

impl Splitter {
    pub(crate) fn new(pattern: &str) -> Result<Splitter> {
        let err = |reason: String| TokenizerError::Regex {
            pattern: pattern.to_owned(),
            reason,
        };
        if let Some(head) = pattern.strip_suffix(LOOKAHEAD_TAIL) {
            let re = regex::Regex::new(&format!(r"{head}|\s+")).map_err(|e| err(e.to_string()))?;
            return Ok(Splitter::WhitespaceLookahead {
                re,
                newline_alt: head.contains(r"\s*[\r\n]+"),
            });
        }
        if let Ok(re) = regex::Regex::new(pattern) {
            return Ok(Splitter::Plain(re));
        }
        fancy_regex::Regex::new(pattern)
            .map(Splitter::Fancy)
            .map_err(|e| err(e.to_string()))
    }

    /// Splits `text` by the matches, keeping both the matches and the text between them as pieces.
    pub(crate) fn split<'t>(&self, text: &'t str, out: &mut Vec<&'t str>) {
        let mut last = 0;
        let mut piece = |out: &mut Vec<&'t str>, start: usize, end: usize| {
            if start > last {
                out.push(&text[last..start]);
            }
            if end > start {
                out.push(&text[start..end]);
            }
            last = end;
        };
        match self {
            Splitter::Plain(re) => {
                for m in re.find_iter(text) {
                    piece(out, m.start(), m.end());
                }
            }
            Splitter::WhitespaceLookahead { re, newline_alt } => {
                let mut pos = 0;
                while pos < text.len() {
                    let Some(m) = re.find_at(text, pos) else {
                        break;
                    };
                    let s = m.as_str();
                    let mut end = m.end();
                    // Only the final `\s+` yields all-whitespace matches, except `\s*[\r\n]+`, whose
                    // matches end in a line break (and `\s+` cannot match a run holding one after it).
                    let from_tail = s.chars().all(char::is_whitespace)
                        && !(*newline_alt && s.ends_with(['\r', '\n']));
                    if from_tail && end < text.len() && s.chars().nth(1).is_some() {
                        // `\s+` stopped at a non-space: `\s+(?!\S)` would leave that run's last character.
                        end -= s.chars().next_back().map_or(0, char::len_utf8);
                    }
                    piece(out, m.start(), end);
                    // No alternative matches empty text; advance anyway rather than loop.
                    pos = if end > m.start() {
                        end
                    } else {
                        end + text[end..].chars().next().map_or(1, char::len_utf8)
                    };
                }
            }
            Splitter::Fancy(re) => {
                for m in re.find_iter(text) {
                    match m {
                        Ok(m) => piece(out, m.start(), m.end()),
                        Err(e) => {
                            // Only a backtracking limit on pathological input gets here.
                            tracing::warn!(error = %e, "pre-tokenizer gave up on a piece; it is kept whole");
                            break;
                        }
                    }
                }
            }
        }
        if last < text.len() {
            out.push(&text[last..]);
        }
    }
}
