//! The real text prompts are cut from: files read whole, joined by blank lines and tokenized
//! once by the model's tokenizer; each prompt is an instruction and an excerpt whose token count
//! is exactly the one drawn.

use std::path::PathBuf;

use sha2::{Digest, Sha256};

use model::tokenizer::Tokenizer;

/// The default text: the licences every Debian system ships in `/usr/share/common-licenses`
/// (package base-files), the same on this machine and a fresh CI one; about 60k tokens of real
/// English prose.
pub const DEFAULT_TEXT: &[&str] = &[
    "/usr/share/common-licenses/Apache-2.0",
    "/usr/share/common-licenses/Artistic",
    "/usr/share/common-licenses/BSD",
    "/usr/share/common-licenses/CC0-1.0",
    "/usr/share/common-licenses/GFDL-1.3",
    "/usr/share/common-licenses/GPL-2",
    "/usr/share/common-licenses/GPL-3",
    "/usr/share/common-licenses/LGPL-2.1",
    "/usr/share/common-licenses/MPL-2.0",
];

/// Text tokenized once, with the places a sentence starts.
pub struct Corpus {
    /// The tokens, followed by a copy of their start so an excerpt never wraps.
    ids: Vec<u32>,
    /// The length of the text proper (before the copy).
    len: usize,
    /// Token indices below `len` where a sentence (or a line) starts.
    starts: Vec<usize>,
    /// SHA-256 of the files' bytes, in order, hex.
    pub sha256: String,
}

/// The tokens of `ids` (the encoding of `text`) where a sentence starts: the first token, and
/// each token whose first visible character is an upper-case letter, a digit or an opening quote
/// or bracket, and comes after a full stop (`.`, `!`, `?`, `:`) and white space, or after a blank
/// line. Licence text is wrapped at 72 columns, so a line start alone is not a sentence start.
fn sentence_starts(ids: &[u32], tokenizer: &Tokenizer, text: &[u8]) -> Vec<usize> {
    let mut starts = Vec::new();
    let mut offset = 0usize;
    for (i, &id) in ids.iter().enumerate() {
        let tb = tokenizer.token_bytes(id).unwrap_or(&[]);
        let at = offset;
        offset += tb.len();
        if i == 0 {
            starts.push(0);
            continue;
        }
        let lead = tb.iter().take_while(|b| b.is_ascii_whitespace()).count();
        let Some(&first) = tb.get(lead) else {
            continue; // white space only: the sentence starts at the next token
        };
        if !(first.is_ascii_uppercase() || first.is_ascii_digit() || b"\"'(".contains(&first)) {
            continue;
        }
        // The white space before the visible character: the end of the text before this token,
        // and the token's own leading white space.
        let before = &text[..at.min(text.len())];
        let ws_before = before
            .iter()
            .rev()
            .take_while(|b| b.is_ascii_whitespace())
            .count();
        let ws = ws_before + lead;
        if ws == 0 {
            continue;
        }
        let newlines = before[before.len() - ws_before..]
            .iter()
            .chain(&tb[..lead])
            .filter(|&&b| b == b'\n')
            .count();
        let stop = before[..before.len() - ws_before]
            .last()
            .is_some_and(|b| b".!?:".contains(b));
        if stop || newlines >= 2 {
            starts.push(i);
        }
    }
    starts
}

/// Building the corpus failed.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    #[error("cannot read the text file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not UTF-8 text")]
    NotText { path: PathBuf },
    #[error("no text files given")]
    NoFiles,
    #[error(
        "the text has {tokens} tokens, fewer than {needed} (the longest prompt and more): add text files"
    )]
    TooShort { tokens: usize, needed: usize },
}

impl Corpus {
    /// Reads and tokenizes `files`; the text must hold at least `min_tokens` tokens.
    pub fn load(
        files: &[PathBuf],
        tokenizer: &Tokenizer,
        min_tokens: usize,
    ) -> Result<Corpus, TextError> {
        if files.is_empty() {
            return Err(TextError::NoFiles);
        }
        let mut hash = Sha256::new();
        let mut text = String::new();
        for path in files {
            let bytes = std::fs::read(path).map_err(|source| TextError::Read {
                path: path.clone(),
                source,
            })?;
            hash.update(&bytes);
            let s =
                String::from_utf8(bytes).map_err(|_| TextError::NotText { path: path.clone() })?;
            if !text.is_empty() {
                text.push_str("\n\n");
            }
            text.push_str(s.trim());
        }
        let mut ids = tokenizer.encode(&text);
        let len = ids.len();
        if len < min_tokens {
            return Err(TextError::TooShort {
                tokens: len,
                needed: min_tokens,
            });
        }
        let mut starts = sentence_starts(&ids, tokenizer, text.as_bytes());
        if starts.len() < 2 {
            starts = (0..len).collect();
        }
        let head: Vec<u32> = ids[..min_tokens.min(len)].to_vec();
        ids.extend(head);
        Ok(Corpus {
            ids,
            len,
            starts,
            sha256: hash.finalize().iter().map(|b| format!("{b:02x}")).collect(),
        })
    }

    /// The sentence starts, to draw a context's first position from.
    pub fn starts(&self) -> &[usize] {
        &self.starts
    }

    /// The first sentence start at or after `pos` (wrapping to the text's start).
    fn next_start(&self, pos: usize) -> usize {
        let pos = pos % self.len;
        let i = self.starts.partition_point(|&s| s < pos);
        self.starts.get(i).copied().unwrap_or(self.starts[0])
    }

    /// A prompt of exactly `tokens` tokens: `instruction`, a blank line and the text from the
    /// first sentence start at or after `*pos`; `*pos` moves past the text used. Returns `None`
    /// if no excerpt near `*pos` gives exactly `tokens` tokens (tokenization at the cut can make
    /// counts jump), which does not happen on ordinary prose.
    pub fn prompt(
        &self,
        tokenizer: &Tokenizer,
        pos: &mut usize,
        instruction: &str,
        tokens: usize,
    ) -> Option<String> {
        let head = format!("{instruction}\n\n");
        let head_len = tokenizer.encode(&head).len();
        // Very short prompts drop the instruction rather than the text.
        let head = if tokens >= head_len + 4 {
            head
        } else {
            String::new()
        };
        let mut start = self.next_start(*pos);
        for _ in 0..16 {
            let mut take = tokens.saturating_sub(tokenizer.encode(&head).len()).max(1);
            for _ in 0..8 {
                let take_max = self.ids.len() - start;
                take = take.clamp(1, take_max);
                let excerpt = tokenizer.decode(&self.ids[start..start + take]);
                let prompt = format!("{head}{}", excerpt.trim_start());
                let n = tokenizer.encode(&prompt).len();
                if n == tokens {
                    *pos = (start + take) % self.len;
                    return Some(prompt);
                }
                // Move the cut by the difference; counts near the cut are nearly linear.
                let next = (take as i64 + tokens as i64 - n as i64).max(1) as usize;
                if next == take {
                    break;
                }
                take = next;
            }
            start = self.next_start(start + 1);
        }
        None
    }
}
