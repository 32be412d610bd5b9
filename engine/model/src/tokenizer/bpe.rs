//! Byte-level BPE (`tokenizer.ggml.model = "gpt2"`): split the text with the pre-tokenizer
//! patterns `tokenizer.ggml.pre` names, map every byte to its printable GPT-2 stand-in character,
//! merge by the rank of `tokenizer.ggml.merges`.
//! Results per pre-tokenized word are cached, so long texts cost one regex pass and a hash lookup
//! per word.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use candle_core::quantized::gguf_file;
use parking_lot::Mutex;

use super::split::{PreTokenizer, Splitter};
use super::{Result, TokenType, TokenizerError, as_array, as_str, get};

/// GPT-2's reversible map from bytes to printable characters: printable Latin-1 bytes stand for
/// themselves, the others map to U+0100 and up, in byte order.
fn byte_to_char_table() -> [char; 256] {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        table[b as usize] = if printable(b) {
            char::from(b)
        } else {
            let c = char::from_u32(next).unwrap_or('\u{FFFD}');
            next += 1;
            c
        };
    }
    table
}

/// Words longer than this (in bytes) are not cached: they are rare and would bloat the cache.
const CACHE_MAX_WORD: usize = 64;
/// The word cache is cleared when it grows beyond this many entries.
const CACHE_MAX_ENTRIES: usize = 1 << 17;

/// What byte-level BPE needs beyond the vocabulary.
pub(crate) struct Bpe {
    /// (left, right) -> (rank, merged token).
    merges: foldhash::HashMap<(u32, u32), (u32, u32)>,
    /// The token of each single byte, the starting point of BPE.
    byte_tokens: [u32; 256],
    pre_name: String,
    splitters: Vec<Splitter>,
    cache: Mutex<foldhash::HashMap<Box<str>, Box<[u32]>>>,
}

impl Bpe {
    /// The merges, the byte tokens and the pre-tokenizer of a `gpt2` vocabulary.
    pub(crate) fn from_metadata(
        md: &HashMap<String, gguf_file::Value>,
        token_to_id: &HashMap<String, u32>,
        unknown: Option<u32>,
    ) -> Result<Bpe> {
        let (pre, pre_name) = pre_tokenizer(md)?;
        let merges = merges(md, token_to_id)?;
        let table = byte_to_char_table();
        let mut byte_tokens = [0u32; 256];
        for (b, &c) in table.iter().enumerate() {
            byte_tokens[b] = match token_to_id.get(c.encode_utf8(&mut [0; 4]) as &str) {
                Some(&id) => id,
                None => unknown.ok_or(TokenizerError::MissingByteToken { byte: b as u8 })?,
            };
        }
        let splitters = pre
            .patterns()
            .iter()
            .map(|p| Splitter::new(p))
            .collect::<Result<Vec<_>>>()?;
        Ok(Bpe {
            merges,
            byte_tokens,
            pre_name,
            splitters,
            cache: Mutex::new(foldhash::HashMap::default()),
        })
    }

    pub(crate) fn pre_name(&self) -> &str {
        &self.pre_name
    }

    pub(crate) fn clear_cache(&self) {
        self.cache.lock().clear();
    }

    /// Pre-tokenizes and BPE-encodes text that holds no special token.
    pub(crate) fn encode_plain(&self, text: &str, out: &mut Vec<u32>) {
        let mut pieces: Vec<&str> = vec![text];
        for splitter in &self.splitters {
            let mut next = Vec::with_capacity(pieces.len() * 2);
            for piece in pieces {
                splitter.split(piece, &mut next);
            }
            pieces = next;
        }
        // The cache holds only finished entries; a panic elsewhere cannot leave one half-written.
        let mut cache = self.cache.lock();
        for word in pieces {
            if word.len() <= CACHE_MAX_WORD
                && let Some(ids) = cache.get(word)
            {
                out.extend_from_slice(ids);
                continue;
            }
            let start = out.len();
            self.bpe(word.as_bytes(), out);
            if word.len() <= CACHE_MAX_WORD {
                if cache.len() >= CACHE_MAX_ENTRIES {
                    cache.clear();
                }
                cache.insert(word.into(), out[start..].into());
            }
        }
    }

    /// Byte-level BPE of one word: start from one token per byte, repeatedly apply the lowest-ranked
    /// merge (leftmost on ties) until none applies.
    fn bpe(&self, word: &[u8], out: &mut Vec<u32>) {
        if word.len() == 1 {
            out.push(self.byte_tokens[word[0] as usize]);
            return;
        }
        #[derive(Clone, Copy)]
        struct Sym {
            id: u32,
            prev: usize,
            next: usize,
            alive: bool,
        }
        const NONE: usize = usize::MAX;
        let n = word.len();
        let mut syms: Vec<Sym> = word
            .iter()
            .enumerate()
            .map(|(i, &b)| Sym {
                id: self.byte_tokens[b as usize],
                prev: if i == 0 { NONE } else { i - 1 },
                next: if i + 1 == n { NONE } else { i + 1 },
                alive: true,
            })
            .collect();
        let mut heap: BinaryHeap<MergeCandidate> = BinaryHeap::new();
        let push = |heap: &mut BinaryHeap<_>, syms: &[Sym], left: usize| {
            let right = syms[left].next;
            if right == NONE {
                return;
            }
            let (l, r) = (syms[left].id, syms[right].id);
            if let Some(&(rank, merged)) = self.merges.get(&(l, r)) {
                heap.push(Reverse((rank, left, l, r, merged)));
            }
        };
        for i in 0..n - 1 {
            push(&mut heap, &syms, i);
        }
        while let Some(Reverse((_, left, l, r, merged))) = heap.pop() {
            let right = syms[left].next;
            // Stale entry: one side has been merged into something else since it was pushed.
            if !syms[left].alive || right == NONE || syms[left].id != l || syms[right].id != r {
                continue;
            }
            syms[left].id = merged;
            syms[right].alive = false;
            let after = syms[right].next;
            syms[left].next = after;
            if after != NONE {
                syms[after].prev = left;
            }
            let before = syms[left].prev;
            if before != NONE {
                push(&mut heap, &syms, before);
            }
            push(&mut heap, &syms, left);
        }
        let mut i = 0;
        while i != NONE {
            out.push(syms[i].id);
            i = syms[i].next;
        }
    }
}

/// A possible merge in [`Bpe::bpe`]: (rank, left position, left id, right id, merged id),
/// lowest rank first, leftmost first among equal ranks.
type MergeCandidate = Reverse<(u32, usize, u32, u32, u32)>;

/// The pre-tokenizer the metadata names (`tokenizer.ggml.pre`), GPT-2's when it names none;
/// with the name as given.
fn pre_tokenizer(md: &HashMap<String, gguf_file::Value>) -> Result<(PreTokenizer, String)> {
    let Some(v) = md.get("tokenizer.ggml.pre") else {
        tracing::warn!("GGUF has no tokenizer.ggml.pre; using GPT-2's pre-tokenizer");
        return Ok((PreTokenizer::Gpt2, "gpt-2".to_owned()));
    };
    let name = as_str(v, "tokenizer.ggml.pre")?;
    let pre =
        PreTokenizer::from_name(name).ok_or_else(|| TokenizerError::UnsupportedPreTokenizer {
            pre: name.to_owned(),
        })?;
    Ok((pre, name.to_owned()))
}

/// Each token's bytes: special tokens as spelled, the others through GPT-2's byte-to-char table
/// in reverse.
pub(crate) fn token_bytes(tokens: &[String], types: &[TokenType]) -> Vec<Vec<u8>> {
    let table = byte_to_char_table();
    let mut char_to_byte = HashMap::with_capacity(256);
    for (b, &c) in table.iter().enumerate() {
        char_to_byte.insert(c, b as u8);
    }
    tokens
        .iter()
        .zip(types)
        .map(|(t, ty)| match ty {
            TokenType::Control | TokenType::UserDefined => t.as_bytes().to_vec(),
            _ => {
                let mut out = Vec::with_capacity(t.len());
                for c in t.chars() {
                    match char_to_byte.get(&c) {
                        Some(&b) => out.push(b),
                        None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                    }
                }
                out
            }
        })
        .collect()
}

/// The BPE merges (`tokenizer.ggml.merges`): each pair of ids to its rank and merged id; merges
/// of or into tokens outside the vocabulary are skipped, the first of duplicates wins.
fn merges(
    md: &HashMap<String, gguf_file::Value>,
    token_to_id: &HashMap<String, u32>,
) -> Result<foldhash::HashMap<(u32, u32), (u32, u32)>> {
    let key = "tokenizer.ggml.merges";
    let merge_values = as_array(get(md, key)?, key)?;
    let mut merges =
        foldhash::HashMap::with_capacity_and_hasher(merge_values.len(), Default::default());
    for (index, v) in merge_values.iter().enumerate() {
        let m = as_str(v, key)?;
        let bad = || TokenizerError::BadMerge {
            index,
            merge: m.to_owned(),
        };
        let (left, right) = m.split_once(' ').ok_or_else(bad)?;
        if left.is_empty() || right.is_empty() || right.contains(' ') {
            return Err(bad());
        }
        let (Some(&l), Some(&r)) = (token_to_id.get(left), token_to_id.get(right)) else {
            tracing::debug!(
                index,
                merge = m,
                "merge of tokens outside the vocabulary, skipped"
            );
            continue;
        };
        let Some(&merged) = token_to_id.get(&format!("{left}{right}")) else {
            tracing::debug!(
                index,
                merge = m,
                "merge result outside the vocabulary, skipped"
            );
            continue;
        };
        merges.entry((l, r)).or_insert((index as u32, merged));
    }
    Ok(merges)
}

#[cfg(test)]
mod tests {
    use super::super::split::*;
    use super::super::{ChatTemplate, Message, StreamDecoder, Tokenizer};
    use super::*;
    use gguf_file::Value;

    /// A vocabulary of the 256 byte tokens plus a few merges and two control tokens.
    fn tiny() -> Tokenizer {
        let table = byte_to_char_table();
        let mut tokens: Vec<String> = vec!["<|im_start|>".into(), "<|im_end|>".into()];
        tokens.extend(table.iter().map(|c| c.to_string()));
        let merges = ["a b", "Ġ ab", "Ġab c", "ab c", "Ġ Ġ", "l l", "ĠĠ Ġ"];
        for m in merges {
            tokens.push(m.replace(' ', ""));
        }
        let mut types = vec![Value::I32(3), Value::I32(3)];
        types.extend((2..tokens.len()).map(|_| Value::I32(1)));
        let template = "{% for m in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nBe brief.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n'}}{% endfor %}";
        let md: HashMap<String, Value> = [
            ("tokenizer.ggml.model", Value::String("gpt2".into())),
            ("tokenizer.ggml.pre", Value::String("smollm".into())),
            (
                "tokenizer.ggml.tokens",
                Value::Array(tokens.into_iter().map(Value::String).collect()),
            ),
            ("tokenizer.ggml.token_type", Value::Array(types)),
            (
                "tokenizer.ggml.merges",
                Value::Array(merges.iter().map(|m| Value::String((*m).into())).collect()),
            ),
            ("tokenizer.ggml.bos_token_id", Value::U32(0)),
            ("tokenizer.ggml.eos_token_id", Value::U32(1)),
            ("tokenizer.chat_template", Value::String(template.into())),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        match Tokenizer::from_gguf_metadata(&md) {
            Ok(t) => t,
            Err(e) => panic!("tiny vocabulary rejected: {e}"),
        }
    }

    /// Token of one byte in the tiny vocabulary.
    fn b(byte: u8) -> u32 {
        2 + u32::from(byte)
    }
    /// Token of merge number `i` in the tiny vocabulary.
    fn m(i: u32) -> u32 {
        258 + i
    }

    #[test]
    fn tiny_vocab_encodes_by_merge_rank() {
        let t = tiny();
        let check = |text: &str, expected: &[u32]| {
            assert_eq!(t.encode(text), expected, "encode {text:?}");
            assert_eq!(t.decode(expected), text, "decode of {text:?}");
        };
        check("", &[]);
        check("abc", &[m(3)]);
        check("ab", &[m(0)]);
        check("abd", &[m(0), b(b'd')]);
        // "Ġ ab" (rank 1) goes before "ab c" (rank 3), then "Ġab c" (rank 2) applies.
        check(" abc", &[m(2)]);
        check("ll abc", &[m(5), m(2)]);
        // Digits are split one by one before BPE.
        check("a12", &[b(b'a'), b(b'1'), b(b'2')]);
        // Whitespace runs: "\s+(?!\S)" leaves the last space to the word that follows.
        check("x   abc", &[b(b'x'), m(4), m(2)]);
        // Equal ranks merge leftmost first: ĠĠĠĠ is ĠĠ ĠĠ, and ĠĠĠ is one token.
        check("x    ", &[b(b'x'), m(4), m(4)]);
        check("x   ", &[b(b'x'), m(6)]);
        // Bytes above 0x7f go through the byte-to-character table.
        check("é", &[b(0xc3), b(0xa9)]);
        // Control tokens are plain characters unless asked for.
        assert_eq!(t.encode("<|im_end|>").len(), "<|im_end|>".len());
        assert_eq!(t.encode_with_special("ab<|im_end|>c"), [m(0), 1, b(b'c')]);
        assert_eq!(t.encode_with_special("<|im_start|><|im_end|>"), [0, 1]);
    }

    #[test]
    fn tiny_vocab_chat_template_and_stop_tokens() {
        let t = tiny();
        assert_eq!(
            t.chat_template(),
            &ChatTemplate::ChatMl {
                default_system: Some("Be brief.".into())
            }
        );
        let text = t
            .apply_chat_template(&[Message::user("hi")], true)
            .unwrap_or_default();
        assert_eq!(
            text,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
        let with_system = [Message::system("S"), Message::user("U")];
        let text = t
            .apply_chat_template(&with_system, false)
            .unwrap_or_default();
        assert_eq!(
            text,
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
        );
        // Content cannot forge a control token.
        let ids = t
            .encode_chat(&[Message::user("<|im_end|>")], false)
            .unwrap_or_default();
        assert_eq!(ids.iter().filter(|&&id| id == 1).count(), 2, "{ids:?}");
        assert_eq!(t.stop_ids(), [1]);
    }

    /// The pieces of `text` by backtracking on the pattern as written (the naive oracle).
    fn fancy_pieces(pattern: &str, text: &str) -> Vec<String> {
        let re = match fancy_regex::Regex::new(pattern) {
            Ok(re) => Splitter::Fancy(re),
            Err(e) => panic!("{pattern}: {e}"),
        };
        let mut out = Vec::new();
        re.split(text, &mut out);
        out.into_iter().map(str::to_owned).collect()
    }

    fn fast_pieces(pattern: &str, text: &str) -> Vec<String> {
        let splitter = match Splitter::new(pattern) {
            Ok(s) => s,
            Err(e) => panic!("{e}"),
        };
        assert!(
            matches!(splitter, Splitter::WhitespaceLookahead { .. }),
            "{pattern}"
        );
        let mut out = Vec::new();
        splitter.split(text, &mut out);
        out.into_iter().map(str::to_owned).collect()
    }

    #[test]
    fn fast_splitter_examples() {
        let check = |text: &str, expected: &[&str]| {
            assert_eq!(fast_pieces(GPT2_PATTERN, text), expected, "{text:?}");
            assert_eq!(fancy_pieces(GPT2_PATTERN, text), expected, "{text:?}");
        };
        check("a  b", &["a", " ", " b"]);
        check("a \n b", &["a", " \n", " b"]);
        check("a\t\tb  ", &["a", "\t", "\t", "b", "  "]);
        check(" \u{3000}x", &[" ", "\u{3000}", "x"]);
        check("it's  42!", &["it", "'s", " ", " 42", "!"]);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]

        /// The hand-made lookahead splits exactly as the backtracking engine does.
        #[test]
        fn fast_splitter_matches_backtracking(
            text in "[ \\t\\r\\n\\u{a0}\\u{3000}a-cA\\u{e9}0-2'!.<|>]{0,24}|\\PC{0,24}"
        ) {
            for pattern in [GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN] {
                proptest::prop_assert_eq!(
                    fast_pieces(pattern, &text),
                    fancy_pieces(pattern, &text),
                    "pattern {}", pattern
                );
            }
        }
    }

    #[test]
    fn stream_decoder_never_splits_a_character() {
        let t = tiny();
        let text = "aé🦀b";
        let ids = t.encode(text);
        let mut dec = StreamDecoder::new(true);
        let mut pieces = Vec::new();
        for &id in &ids {
            pieces.push(dec.push(&t, id));
        }
        pieces.push(dec.finish());
        assert_eq!(pieces.concat(), text);
        assert!(
            pieces
                .iter()
                .all(|p| std::str::from_utf8(p.as_bytes()).is_ok())
        );
        assert_eq!(pieces.iter().filter(|p| !p.is_empty()).count(), 4);
        // An invalid byte becomes one replacement character, and decoding goes on.
        let mut dec = StreamDecoder::new(true);
        let out = [
            dec.push(&t, b(0xff)),
            dec.push(&t, b(b'a')),
            dec.push(&t, 1),
        ]
        .concat();
        assert_eq!(out, "\u{FFFD}a");
        // A dangling start of a character is flushed at the end.
        let mut dec = StreamDecoder::new(false);
        assert_eq!(dec.push(&t, b(0xe2)), "");
        assert_eq!(dec.finish(), "\u{FFFD}");
    }
}
