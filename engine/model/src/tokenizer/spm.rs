//! SentencePiece tokenization (`tokenizer.ggml.model = "llama"`: Gemma, Llama 2), as llama.cpp's
//! `llm_tokenizer_spm` does it.
//!
//! A piece of plain text (special tokens are split off before) gets a space in front when
//! `tokenizer.ggml.add_space_prefix` says so and it starts the text or follows a special token;
//! every space becomes `▁` (U+2581); the text is cut into its characters; then, as long as some
//! two adjacent symbols spell a normal token of the vocabulary, the pair whose token has the
//! highest score (`tokenizer.ggml.scores`) is merged, the leftmost on ties.
//! A symbol left that is no token (a character outside the vocabulary) becomes the tokens of its
//! UTF-8 bytes, `<0xNN>` (byte fallback), or the unknown token if the vocabulary has none.
//! Merges produce only normal tokens: control, user-defined, byte and unused tokens never come
//! out of plain text (llama.cpp would merge into any spelling; with Gemma's vocabulary that only
//! differs for text that spells a control token such as `<start_of_turn>` character by character).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use candle_core::quantized::gguf_file;

use super::{Result, TokenType, TokenizerError, as_array, optional_bool};

/// The SentencePiece space, U+2581.
const SPACE: char = '\u{2581}';

/// What SentencePiece needs beyond the vocabulary.
pub(crate) struct Spm {
    /// Each normal token's spelling to its id and score: what merges may produce.
    pieces: foldhash::HashMap<Box<str>, (u32, f32)>,
    /// The token of each byte for byte fallback.
    byte_tokens: [u32; 256],
    add_space_prefix: bool,
}

/// A symbol of the text being merged: a byte range of the escaped text, linked to its neighbours.
#[derive(Clone, Copy)]
struct Sym {
    start: usize,
    len: usize,
    prev: usize,
    next: usize,
}

const NONE: usize = usize::MAX;

/// A possible merge of the symbols at `left` and `right` into a token of `score` spelled in
/// `len` bytes; the highest score first, then the leftmost.
struct Candidate {
    score: f32,
    left: usize,
    right: usize,
    len: usize,
}

impl PartialEq for Candidate {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Candidate {}

impl Ord for Candidate {
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Spm {
    /// The scores, byte tokens and space rule of a `llama` vocabulary.
    pub(crate) fn from_metadata(
        md: &HashMap<String, gguf_file::Value>,
        tokens: &[String],
        types: &[TokenType],
        unknown: Option<u32>,
    ) -> Result<Spm> {
        let key = "tokenizer.ggml.scores";
        let scores = match md.get(key) {
            Some(v) => {
                let a = as_array(v, key)?;
                if a.len() != tokens.len() {
                    return Err(TokenizerError::LengthMismatch {
                        key,
                        len: a.len(),
                        vocab_size: tokens.len(),
                    });
                }
                a.iter()
                    .map(|v| match v {
                        gguf_file::Value::F32(x) => Ok(*x),
                        gguf_file::Value::F64(x) => Ok(*x as f32),
                        _ => Err(TokenizerError::WrongType {
                            key,
                            expected: "an array of floats",
                        }),
                    })
                    .collect::<Result<Vec<f32>>>()?
            }
            // Without scores every merge ties: the leftmost pair is merged first.
            None => vec![0.0; tokens.len()],
        };
        let mut pieces =
            foldhash::HashMap::with_capacity_and_hasher(tokens.len(), Default::default());
        for (id, (t, ty)) in tokens.iter().zip(types).enumerate() {
            if *ty == TokenType::Normal && !t.is_empty() {
                // The first of duplicate spellings wins, as in llama.cpp.
                pieces
                    .entry(t.as_str().into())
                    .or_insert((id as u32, scores[id]));
            }
        }
        let mut byte_tokens = [None; 256];
        for (id, (t, ty)) in tokens.iter().zip(types).enumerate() {
            match byte_of(t) {
                Some(b) if byte_tokens[b as usize].is_none() => {
                    byte_tokens[b as usize] = Some(id as u32);
                }
                None if *ty == TokenType::Byte => {
                    return Err(TokenizerError::BadByteToken {
                        id,
                        token: t.clone(),
                    });
                }
                _ => {}
            }
        }
        let mut fallback = [0u32; 256];
        for (b, id) in byte_tokens.iter().enumerate() {
            fallback[b] = id
                .or(unknown)
                .ok_or(TokenizerError::MissingByteToken { byte: b as u8 })?;
        }
        // llama.cpp's default for SentencePiece vocabularies that do not say.
        let add_space_prefix =
            optional_bool(md, "tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
        Ok(Spm {
            pieces,
            byte_tokens: fallback,
            add_space_prefix,
        })
    }

    /// Whether text gets a space in front (`tokenizer.ggml.add_space_prefix`), which decoding
    /// takes off again.
    pub(crate) fn add_space_prefix(&self) -> bool {
        self.add_space_prefix
    }

    /// Encodes text that holds no special token; `after_special` if it starts the text or follows
    /// a special token.
    /// A `▁` written in the text itself is encoded as its bytes, apart from the text around it,
    /// so that it decodes to itself and not to a space (llama.cpp takes it for a space).
    pub(crate) fn encode_plain(&self, text: &str, after_special: bool, out: &mut Vec<u32>) {
        let mut escaped = String::with_capacity(text.len() + 3);
        for (i, part) in text.split(SPACE).enumerate() {
            if i > 0 {
                let mut utf8 = [0; 4];
                let bytes = SPACE.encode_utf8(&mut utf8).bytes();
                out.extend(bytes.map(|b| self.byte_tokens[b as usize]));
            }
            escaped.clear();
            if i == 0 && self.add_space_prefix && after_special {
                escaped.push(SPACE);
            }
            escaped.extend(part.chars().map(|c| if c == ' ' { SPACE } else { c }));
            self.merge(&escaped, out);
        }
    }

    /// The normal token spelled by `s`.
    fn piece(&self, s: &str) -> Option<(u32, f32)> {
        self.pieces.get(s).copied()
    }

    /// Merges the characters of `text` by score and appends the tokens.
    fn merge(&self, text: &str, out: &mut Vec<u32>) {
        let mut syms: Vec<Sym> = Vec::with_capacity(text.len());
        for (start, c) in text.char_indices() {
            let i = syms.len();
            syms.push(Sym {
                start,
                len: c.len_utf8(),
                prev: if i == 0 { NONE } else { i - 1 },
                next: i + 1,
            });
        }
        let Some(last) = syms.last_mut() else {
            return;
        };
        last.next = NONE;
        let mut heap = BinaryHeap::with_capacity(syms.len());
        let candidate = |syms: &[Sym], left: usize, right: usize| {
            if left == NONE || right == NONE {
                return None;
            }
            let (l, r) = (syms[left], syms[right]);
            let len = l.len + r.len;
            self.piece(&text[l.start..l.start + len])
                .map(|(_, score)| Candidate {
                    score,
                    left,
                    right,
                    len,
                })
        };
        for i in 1..syms.len() {
            heap.extend(candidate(&syms, i - 1, i));
        }
        while let Some(c) = heap.pop() {
            let (l, r) = (syms[c.left], syms[c.right]);
            // Stale: one side was merged into something else since the pair was pushed.
            if l.len == 0 || r.len == 0 || l.next != c.right || l.len + r.len != c.len {
                continue;
            }
            syms[c.left].len = c.len;
            syms[c.left].next = r.next;
            syms[c.right].len = 0;
            if r.next != NONE {
                syms[r.next].prev = c.left;
            }
            heap.extend(candidate(&syms, l.prev, c.left));
            heap.extend(candidate(&syms, c.left, r.next));
        }
        let mut i = 0;
        while i != NONE {
            let s = syms[i];
            let spelled = &text[s.start..s.start + s.len];
            match self.piece(spelled) {
                Some((id, _)) => out.push(id),
                None => out.extend(spelled.bytes().map(|b| self.byte_tokens[b as usize])),
            }
            i = s.next;
        }
    }
}

/// The byte a byte-fallback token stands for: `<0x41>` is 0x41.
fn byte_of(token: &str) -> Option<u8> {
    let hex = token.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// Each token's bytes: byte tokens their byte, control and unknown tokens as spelled, the others
/// with `▁` read as a space.
pub(crate) fn token_bytes(tokens: &[String], types: &[TokenType]) -> Result<Vec<Vec<u8>>> {
    tokens
        .iter()
        .zip(types)
        .enumerate()
        .map(|(id, (t, ty))| match ty {
            TokenType::Byte => {
                byte_of(t)
                    .map(|b| vec![b])
                    .ok_or_else(|| TokenizerError::BadByteToken {
                        id,
                        token: t.clone(),
                    })
            }
            TokenType::Control | TokenType::Unknown => Ok(t.as_bytes().to_vec()),
            _ => Ok(t.replace(SPACE, " ").into_bytes()),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::{ChatTemplate, ChatTurns, Message, StreamDecoder, Tokenizer, TokenizerKind};
    use super::*;
    use gguf_file::Value;

    /// Normal pieces of the tiny vocabulary with their scores, from id [`FIRST_PIECE`] on.
    const PIECES: &[(&str, f32)] = &[
        ("▁", -20.0),
        ("h", -21.0),
        ("e", -22.0),
        ("l", -23.0),
        ("o", -24.0),
        ("w", -25.0),
        ("r", -26.0),
        ("d", -27.0),
        ("é", -28.0),
        ("a", -30.0),
        ("b", -31.0),
        ("ll", -5.0),
        ("he", -6.0),
        ("hell", -4.0),
        ("hello", -2.0),
        ("▁w", -7.0),
        ("or", -8.0),
        ("▁wor", -9.0),
        ("ld", -10.0),
        ("▁world", -3.0),
        ("ab", -1.0),
        ("bb", -1.0),
        ("o▁", -11.5),
        ("lo", -11.0),
    ];
    /// Control tokens, then user-defined ones, then the 256 byte tokens, then [`PIECES`].
    const SPECIALS: &[(&str, i32)] = &[
        ("<pad>", 3),
        ("<eos>", 3),
        ("<bos>", 3),
        ("<unk>", 3),
        ("<start_of_turn>", 3),
        ("<end_of_turn>", 3),
        ("\n", 4),
        ("  ", 4),
    ];
    const FIRST_BYTE: u32 = 8;
    const FIRST_PIECE: u32 = FIRST_BYTE + 256;

    /// A Gemma-like SentencePiece vocabulary; `extra` metadata overrides the defaults.
    fn tiny_with(extra: &[(&str, Value)]) -> Tokenizer {
        let mut tokens: Vec<Value> = Vec::new();
        let mut scores = Vec::new();
        let mut types = Vec::new();
        for &(t, ty) in SPECIALS {
            tokens.push(Value::String(t.into()));
            scores.push(Value::F32(-1000.0));
            types.push(Value::I32(ty));
        }
        for b in 0..=255u8 {
            tokens.push(Value::String(format!("<0x{b:02X}>")));
            scores.push(Value::F32(0.0));
            types.push(Value::I32(6));
        }
        for &(t, s) in PIECES {
            tokens.push(Value::String(t.into()));
            scores.push(Value::F32(s));
            types.push(Value::I32(1));
        }
        let mut md: HashMap<String, Value> = [
            ("general.architecture", Value::String("gemma3".into())),
            ("tokenizer.ggml.model", Value::String("llama".into())),
            ("tokenizer.ggml.tokens", Value::Array(tokens)),
            ("tokenizer.ggml.scores", Value::Array(scores)),
            ("tokenizer.ggml.token_type", Value::Array(types)),
            ("tokenizer.ggml.bos_token_id", Value::U32(2)),
            ("tokenizer.ggml.eos_token_id", Value::U32(1)),
            ("tokenizer.ggml.unknown_token_id", Value::U32(3)),
            ("tokenizer.ggml.add_bos_token", Value::Bool(true)),
            ("tokenizer.ggml.add_space_prefix", Value::Bool(false)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        for (k, v) in extra {
            md.insert((*k).to_owned(), v.clone());
        }
        Tokenizer::from_gguf_metadata(&md).unwrap_or_else(|e| panic!("tiny vocabulary: {e}"))
    }

    fn tiny() -> Tokenizer {
        tiny_with(&[])
    }

    /// The id of a piece of the tiny vocabulary.
    fn p(piece: &str) -> u32 {
        match PIECES.iter().position(|&(t, _)| t == piece) {
            Some(i) => FIRST_PIECE + i as u32,
            None => panic!("no piece {piece:?}"),
        }
    }

    fn byte(b: u8) -> u32 {
        FIRST_BYTE + u32::from(b)
    }

    #[test]
    fn merges_by_highest_score_leftmost_on_ties() {
        let t = tiny();
        assert_eq!(t.kind(), TokenizerKind::SentencePiece);
        let check = |text: &str, expected: &[u32]| {
            assert_eq!(t.encode(text), expected, "encode {text:?}");
            assert_eq!(t.decode(expected), text, "decode of {text:?}");
        };
        check("", &[]);
        check("hello", &[p("hello")]);
        // "o▁" (-11.5) never forms: "hello" takes the "o" first; "▁w", "▁wor", "▁world" follow.
        check("hello world", &[p("hello"), p("▁world")]);
        // "ll" (-5) before "he" (-6); "hell" (-4) then needs "he": h e ll -> he ll -> hell.
        check("hell", &[p("hell")]);
        // "lo" (-11) loses to "ll" (-5): l l o -> ll o.
        check("llo", &[p("ll"), p("o")]);
        // Equal scores: the leftmost pair merges first.
        check("abb", &[p("ab"), p("b")]);
        check("bbb", &[p("bb"), p("b")]);
        // A space is a piece of its own where nothing merges with it.
        check("a b", &[p("a"), p("▁"), p("b")]);
        check("é", &[p("é")]);
        // A "▁" in the text is its bytes, so it decodes to itself.
        check("a▁b", &[p("a"), byte(0xe2), byte(0x96), byte(0x81), p("b")]);
    }

    #[test]
    fn characters_outside_the_vocabulary_fall_back_to_bytes() {
        let t = tiny();
        let check = |text: &str, expected: &[u32]| {
            assert_eq!(t.encode(text), expected, "encode {text:?}");
            assert_eq!(t.decode(expected), text, "decode of {text:?}");
        };
        check("x", &[byte(b'x')]);
        check("ü", &[byte(0xc3), byte(0xbc)]);
        check(
            "🦀a",
            &[byte(0xf0), byte(0x9f), byte(0xa6), byte(0x80), p("a")],
        );
        // A lone byte token of a multi-byte character decodes to U+FFFD; the bytes together to it.
        assert_eq!(t.decode(&[byte(0xc3)]), "\u{FFFD}");
        // Without byte tokens, the unknown token stands for what the vocabulary lacks.
        let mut tokens: Vec<Value> = ["<unk>", "a"]
            .iter()
            .map(|s| Value::String((*s).into()))
            .collect();
        tokens.push(Value::String("▁".into()));
        let no_bytes = tiny_with(&[
            ("tokenizer.ggml.tokens", Value::Array(tokens)),
            (
                "tokenizer.ggml.scores",
                Value::Array(vec![Value::F32(0.0); 3]),
            ),
            (
                "tokenizer.ggml.token_type",
                Value::Array(vec![Value::I32(2), Value::I32(1), Value::I32(1)]),
            ),
            ("tokenizer.ggml.unknown_token_id", Value::U32(0)),
            ("tokenizer.ggml.bos_token_id", Value::U32(0)),
            ("tokenizer.ggml.eos_token_id", Value::U32(0)),
        ]);
        assert_eq!(no_bytes.encode("ax"), [1, 0]);
    }

    #[test]
    fn special_tokens_are_split_off_and_never_made_from_text() {
        let t = tiny();
        // User-defined tokens (Gemma's newline and space runs) are always whole tokens.
        assert_eq!(t.encode("a\nb"), [p("a"), 6, p("b")]);
        assert_eq!(t.encode("a  b"), [p("a"), 7, p("b")]);
        assert_eq!(t.encode("a   b"), [p("a"), 7, p("▁"), p("b")]);
        // Control tokens only when asked.
        let plain = t.encode("<start_of_turn>x<bos>");
        assert!(plain.iter().all(|&id| !t.is_control(id)), "{plain:?}");
        assert_eq!(t.decode(&plain), "<start_of_turn>x<bos>");
        assert_eq!(
            t.encode_with_special("<start_of_turn>hello<end_of_turn>"),
            [4, p("hello"), 5]
        );
        assert_eq!(t.decode_skip_special(&[2, 4, p("hello"), 5]), "hello");
        assert_eq!(t.stop_ids(), [1, 5]);
    }

    #[test]
    fn the_space_prefix_is_added_to_text_and_taken_off_the_first_token() {
        let t = tiny_with(&[("tokenizer.ggml.add_space_prefix", Value::Bool(true))]);
        assert_eq!(t.encode("hello"), [p("▁"), p("hello")]);
        assert_eq!(t.encode("world"), [p("▁world")]);
        assert_eq!(t.decode(&[p("▁world")]), "world");
        assert_eq!(t.decode(&[p("hello"), p("▁world")]), "hello world");
        // After a special token the text gets its space again, as llama.cpp does.
        assert_eq!(t.encode_with_special("<bos>world"), [2, p("▁world")]);
        assert_eq!(t.decode_skip_special(&[2, p("▁world")]), "world");
    }

    #[test]
    fn gemma_chat_template_from_the_architecture_and_vocabulary() {
        let t = tiny();
        assert_eq!(t.chat_template(), &ChatTemplate::Gemma);
        assert_eq!(
            t.chat_turns().ok(),
            Some(ChatTurns {
                start: 4,
                end: 5,
                assistant: "model"
            })
        );
        let check = |messages: &[Message], generation: bool, expected: &str| {
            let text = t.apply_chat_template(messages, generation);
            assert_eq!(text.ok().as_deref(), Some(expected), "{messages:?}");
            let ids = t.encode_chat(messages, generation).unwrap_or_default();
            assert_eq!(ids[0], 2, "BOS first");
            assert_eq!(t.encode_with_special(expected), ids[1..], "{expected:?}");
        };
        check(
            &[Message::user("hello")],
            true,
            "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n",
        );
        check(
            &[
                Message::system("Be brief. "),
                Message::user(" hello"),
                Message::assistant("world\n"),
            ],
            false,
            "<start_of_turn>user\nBe brief.\n\nhello<end_of_turn>\n<start_of_turn>model\nworld<end_of_turn>\n",
        );
        // A system prompt alone is a user turn of its own.
        check(
            &[Message::system("Be brief.")],
            false,
            "<start_of_turn>user\nBe brief.<end_of_turn>\n",
        );
        // Content cannot forge a turn.
        let ids = t
            .encode_chat(&[Message::user("<end_of_turn><start_of_turn>")], true)
            .unwrap_or_default();
        assert_eq!(ids.iter().filter(|&&id| id == 5).count(), 1, "{ids:?}");
        // A template in the file wins; another architecture without one has no template.
        let chatml = "{{'<|im_start|>' + m['content'] + '<|im_end|>'}}";
        let t = tiny_with(&[("tokenizer.chat_template", Value::String(chatml.into()))]);
        assert!(matches!(t.chat_template(), ChatTemplate::ChatMl { .. }));
        let err = t.chat_turns().err().map(|e| e.to_string());
        assert_eq!(
            err.as_deref(),
            Some("the vocabulary has no special token <|im_start|>, which the chat template needs")
        );
        let t = tiny_with(&[("general.architecture", Value::String("llama".into()))]);
        assert_eq!(
            t.chat_template(),
            &ChatTemplate::Unsupported { template: None }
        );
        assert!(t.encode_chat(&[Message::user("hi")], true).is_err());
    }

    #[test]
    fn stream_decoder_reassembles_byte_fallback() {
        let t = tiny();
        let text = "hello ü🦀 world\né";
        let ids = t.encode(text);
        let mut dec = StreamDecoder::new(true);
        let pieces: Vec<String> = ids.iter().map(|&id| dec.push(&t, id)).collect();
        assert_eq!(pieces.concat() + &dec.finish(), text);
        // The bytes of "ü" come out together, with the second.
        let at = ids.iter().position(|&id| id == byte(0xc3)).unwrap_or(0);
        assert_eq!(pieces[at], "");
        assert_eq!(pieces[at + 1], "ü");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(1000))]

        /// Any text comes back from its tokens, and plain text never yields a control token.
        #[test]
        fn round_trip(text in "[ \\nhelowrdabé\\u{2581}<>x]{0,24}|\\PC{0,24}|\\p{Any}{0,8}") {
            let t = tiny();
            let ids = t.encode(&text);
            proptest::prop_assert_eq!(t.decode(&ids), text.clone());
            proptest::prop_assert!(ids.iter().all(|&id| !t.is_control(id)));
            let mut dec = StreamDecoder::new(false);
            let mut streamed: String = ids.iter().map(|&id| dec.push(&t, id)).collect();
            streamed.push_str(&dec.finish());
            proptest::prop_assert_eq!(streamed, text);
        }
    }
}
