//! The tokenizer of a GGUF model, built from the file's own metadata: one type, [`Tokenizer`], of
//! two kinds chosen by `tokenizer.ggml.model`, with the special tokens, decoding and the chat
//! template they share.
//!
//! - `gpt2`: GPT-2 style byte-level BPE with merges in the file, pre-tokenized with the patterns
//!   `tokenizer.ggml.pre` names ([`bpe`]).
//! - `llama`: SentencePiece pieces with scores, merged by highest score, bytes outside the
//!   vocabulary as `<0xNN>` tokens ([`spm`]).
//!
//! Encoding is: split the text at special tokens (user-defined ones always, control ones only when
//! asked, [`special`]), then encode each piece of plain text with the kind's algorithm.
//! Decoding is per token: each token stands for bytes, fixed when the tokenizer is built.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file;

mod bpe;
mod chat;
mod special;
mod split;
mod spm;
mod stream;

use bpe::Bpe;
pub use chat::{
    ChatTemplate, ChatTurns, Message, TOOL_CALL_CLOSE, TOOL_CALL_OPEN, Tool, tool_call_json,
    tool_call_text, tool_response_text, tools_text,
};
use special::Specials;
use spm::Spm;
pub use stream::StreamDecoder;

/// What can go wrong while building a tokenizer or using its chat template.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("cannot read the GGUF file {path:?}: {source}")]
    Gguf {
        path: PathBuf,
        source: candle_core::Error,
    },
    #[error("the GGUF metadata has no {key}")]
    MissingKey { key: &'static str },
    #[error("the GGUF metadata key {key} is not {expected}")]
    WrongType {
        key: &'static str,
        expected: &'static str,
    },
    #[error(
        "unsupported tokenizer model {model:?} (supported: \"gpt2\", byte-level BPE, and \"llama\", SentencePiece)"
    )]
    UnsupportedModel { model: String },
    #[error("unsupported pre-tokenizer {pre:?} in tokenizer.ggml.pre")]
    UnsupportedPreTokenizer { pre: String },
    #[error("{key} has {len} entries but the vocabulary has {vocab_size} tokens")]
    LengthMismatch {
        key: &'static str,
        len: usize,
        vocab_size: usize,
    },
    #[error("{key} = {id} is outside the vocabulary of {vocab_size} tokens")]
    IdOutOfRange {
        key: &'static str,
        id: u64,
        vocab_size: usize,
    },
    #[error("merge #{index} {merge:?} is not two tokens separated by one space")]
    BadMerge { index: usize, merge: String },
    #[error("the vocabulary has no token for byte {byte:#04x} and no unknown token")]
    MissingByteToken { byte: u8 },
    #[error("the vocabulary has no special token {token}, which the chat template needs")]
    MissingSpecialToken { token: &'static str },
    #[error(
        "unsupported chat template (ChatML and Gemma's are supported, and the model's vocabulary has neither's turn tokens): {head:?}"
    )]
    UnsupportedChatTemplate { head: String },
    #[error("token {id} is {token:?} of type byte, which is not a byte written <0xNN>")]
    BadByteToken { id: usize, token: String },
    #[error("invalid pre-tokenizer pattern {pattern:?}: {reason}")]
    Regex { pattern: String, reason: String },
}

type Result<T, E = TokenizerError> = std::result::Result<T, E>;

/// Token types as GGUF stores them in `tokenizer.ggml.token_type` (llama.cpp's `llama_token_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenType {
    Normal,
    Unknown,
    /// A special token such as `<|im_start|>`: only recognised in text when asked, never produced by BPE.
    Control,
    /// A token added by the user: always recognised in text as a whole.
    UserDefined,
    Unused,
    Byte,
}

impl TokenType {
    fn from_gguf(v: i64) -> TokenType {
        match v {
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => TokenType::Normal,
        }
    }
}

/// Which algorithm turns plain text into tokens (`tokenizer.ggml.model`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerKind {
    /// `gpt2`: byte-level BPE with ranked merges (SmolLM2, Llama 3, Qwen 2).
    Bpe,
    /// `llama`: SentencePiece pieces with scores and byte fallback (Gemma, Llama 2).
    SentencePiece,
}

/// The kind's own data: the only place the two algorithms differ.
enum Kind {
    Bpe(Bpe),
    Spm(Spm),
}

/// A tokenizer built from GGUF metadata. Cheap to share between threads (`Sync`).
pub struct Tokenizer {
    /// The vocabulary as stored in the GGUF (byte-level encoded or `▁`-escaped text).
    tokens: Vec<String>,
    types: Vec<TokenType>,
    /// The bytes each token stands for.
    token_bytes: Vec<Vec<u8>>,
    token_to_id: HashMap<String, u32>,
    kind: Kind,
    /// Control tokens (recognised on request) and user-defined tokens (always).
    specials: Specials,
    bos: Option<u32>,
    eos: Option<u32>,
    unknown: Option<u32>,
    padding: Option<u32>,
    add_bos: bool,
    chat_template: ChatTemplate,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("kind", &self.kind())
            .field("vocab_size", &self.tokens.len())
            .field("pre", &self.pre_tokenizer())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("chat_template", &self.chat_template)
            .finish_non_exhaustive()
    }
}

fn get<'a>(
    md: &'a HashMap<String, gguf_file::Value>,
    key: &'static str,
) -> Result<&'a gguf_file::Value> {
    md.get(key).ok_or(TokenizerError::MissingKey { key })
}

fn as_str<'a>(v: &'a gguf_file::Value, key: &'static str) -> Result<&'a str> {
    match v {
        gguf_file::Value::String(s) => Ok(s),
        _ => Err(TokenizerError::WrongType {
            key,
            expected: "a string",
        }),
    }
}

fn as_array<'a>(v: &'a gguf_file::Value, key: &'static str) -> Result<&'a [gguf_file::Value]> {
    match v {
        gguf_file::Value::Array(a) => Ok(a),
        _ => Err(TokenizerError::WrongType {
            key,
            expected: "an array",
        }),
    }
}

fn as_int(v: &gguf_file::Value, key: &'static str) -> Result<i64> {
    use gguf_file::Value as V;
    Ok(match *v {
        V::U8(x) => x.into(),
        V::I8(x) => x.into(),
        V::U16(x) => x.into(),
        V::I16(x) => x.into(),
        V::U32(x) => x.into(),
        V::I32(x) => x.into(),
        V::U64(x) => i64::try_from(x).unwrap_or(i64::MAX),
        V::I64(x) => x,
        _ => {
            return Err(TokenizerError::WrongType {
                key,
                expected: "an integer",
            });
        }
    })
}

fn optional_id(
    md: &HashMap<String, gguf_file::Value>,
    key: &'static str,
    vocab_size: usize,
) -> Result<Option<u32>> {
    let Some(v) = md.get(key) else {
        return Ok(None);
    };
    let id = as_int(v, key)?;
    // llama.cpp writes -1 (or a huge unsigned value) for "none".
    if id < 0 || id == i64::from(u32::MAX) {
        return Ok(None);
    }
    match u32::try_from(id)
        .ok()
        .filter(|&id| (id as usize) < vocab_size)
    {
        Some(id) => Ok(Some(id)),
        None => Err(TokenizerError::IdOutOfRange {
            key,
            id: id as u64,
            vocab_size,
        }),
    }
}

/// An optional boolean key.
fn optional_bool(
    md: &HashMap<String, gguf_file::Value>,
    key: &'static str,
) -> Result<Option<bool>> {
    match md.get(key) {
        Some(gguf_file::Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(TokenizerError::WrongType {
            key,
            expected: "a bool",
        }),
        None => Ok(None),
    }
}

impl Tokenizer {
    /// Reads the metadata of the GGUF file at `path` and builds its tokenizer.
    pub fn from_gguf_file(path: &Path) -> Result<Tokenizer> {
        let gguf = |source| TokenizerError::Gguf {
            path: path.to_path_buf(),
            source,
        };
        let mut file = std::io::BufReader::new(
            std::fs::File::open(path).map_err(|e| gguf(candle_core::Error::from(e)))?,
        );
        let content = gguf_file::Content::read(&mut file).map_err(gguf)?;
        Tokenizer::from_gguf(&content)
    }

    /// Builds the tokenizer from a parsed GGUF file.
    pub fn from_gguf(content: &gguf_file::Content) -> Result<Tokenizer> {
        Tokenizer::from_gguf_metadata(&content.metadata)
    }

    /// Builds the tokenizer from GGUF metadata (`tokenizer.*` keys).
    pub fn from_gguf_metadata(md: &HashMap<String, gguf_file::Value>) -> Result<Tokenizer> {
        let model = as_str(get(md, "tokenizer.ggml.model")?, "tokenizer.ggml.model")?;
        if !matches!(model, "gpt2" | "llama") {
            return Err(TokenizerError::UnsupportedModel {
                model: model.to_owned(),
            });
        }
        let (tokens, mut types) = vocabulary(md)?;
        let n = tokens.len();
        let bos = optional_id(md, "tokenizer.ggml.bos_token_id", n)?;
        let eos = optional_id(md, "tokenizer.ggml.eos_token_id", n)?;
        let unknown = optional_id(md, "tokenizer.ggml.unknown_token_id", n)?;
        let padding = optional_id(md, "tokenizer.ggml.padding_token_id", n)?;
        let add_bos = optional_bool(md, "tokenizer.ggml.add_bos_token")?.unwrap_or(false);
        let template = match md.get("tokenizer.chat_template") {
            Some(v) => Some(as_str(v, "tokenizer.chat_template")?),
            None => None,
        };
        // Without explicit types, the declared special ids are still special.
        if !md.contains_key("tokenizer.ggml.token_type") {
            for id in [bos, eos, unknown, padding].into_iter().flatten() {
                if types[id as usize] == TokenType::Normal {
                    types[id as usize] = TokenType::Control;
                }
            }
        }
        let mut token_to_id = HashMap::with_capacity(n);
        for (id, t) in tokens.iter().enumerate() {
            // The first of duplicate spellings wins, as in llama.cpp.
            token_to_id.entry(t.clone()).or_insert(id as u32);
        }
        let (kind, token_bytes) = match model {
            "gpt2" => {
                let bpe = Bpe::from_metadata(md, &token_to_id, unknown)?;
                (Kind::Bpe(bpe), bpe::token_bytes(&tokens, &types))
            }
            _ => {
                let spm = Spm::from_metadata(md, &tokens, &types, unknown)?;
                (Kind::Spm(spm), spm::token_bytes(&tokens, &types)?)
            }
        };
        let specials = Specials::new(&tokens, &types);
        let architecture = match md.get("general.architecture") {
            Some(gguf_file::Value::String(a)) => Some(a.as_str()),
            _ => None,
        };
        let chat_template =
            ChatTemplate::recognise(template, architecture, |t| token_to_id.contains_key(t));
        Ok(Tokenizer {
            tokens,
            types,
            token_bytes,
            token_to_id,
            kind,
            specials,
            bos,
            eos,
            unknown,
            padding,
            add_bos,
            chat_template,
        })
    }

    /// The algorithm this vocabulary uses.
    pub fn kind(&self) -> TokenizerKind {
        match self.kind {
            Kind::Bpe(_) => TokenizerKind::Bpe,
            Kind::Spm(_) => TokenizerKind::SentencePiece,
        }
    }
    /// Number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }
    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }
    pub fn unknown_id(&self) -> Option<u32> {
        self.unknown
    }
    pub fn padding_id(&self) -> Option<u32> {
        self.padding
    }
    /// Whether the model wants BOS in front of a prompt (`tokenizer.ggml.add_bos_token`);
    /// [`Tokenizer::encode`] never adds it by itself.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }
    /// The `tokenizer.ggml.pre` name in use (BPE), `none` for SentencePiece, which splits nothing.
    pub fn pre_tokenizer(&self) -> &str {
        match &self.kind {
            Kind::Bpe(b) => b.pre_name(),
            Kind::Spm(_) => "none",
        }
    }
    pub fn chat_template(&self) -> &ChatTemplate {
        &self.chat_template
    }
    /// The id of a token by its exact vocabulary spelling (e.g. `<|im_end|>`).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.token_to_id.get(token).copied()
    }
    /// The vocabulary spelling of a token (byte-level encoded or `▁`-escaped for normal tokens).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }
    /// The bytes a token stands for.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.token_bytes.get(id as usize).map(Vec::as_slice)
    }
    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.types.get(id as usize).copied()
    }
    /// Whether the token is a control token (BOS, EOS, `<|im_start|>`, `<end_of_turn>`...).
    pub fn is_control(&self, id: u32) -> bool {
        self.token_type(id) == Some(TokenType::Control)
    }

    /// The tokens at which generation stops: EOS and the end-of-turn tokens the vocabulary has.
    pub fn stop_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self.eos.into_iter().collect();
        for t in [
            "<|im_end|>",
            "<|endoftext|>",
            "<|eot_id|>",
            "<|end_of_text|>",
            "<end_of_turn>",
            "</s>",
        ] {
            if let Some(id) = self.token_id(t).filter(|&id| self.is_control(id))
                && !ids.contains(&id)
            {
                ids.push(id);
            }
        }
        ids
    }

    /// Drops the per-word BPE cache (it refills as text is encoded; for benchmarks and memory
    /// pressure). SentencePiece keeps no cache.
    pub fn clear_cache(&self) {
        if let Kind::Bpe(b) = &self.kind {
            b.clear_cache();
        }
    }

    /// Encodes text that begins a context: BOS first when the model wants it
    /// ([`Tokenizer::add_bos`]; Gemma does, and runs off the rails without it), then the text as
    /// [`Tokenizer::encode`] encodes it.
    pub fn encode_start(&self, text: &str) -> Vec<u32> {
        let mut out: Vec<u32> = self.bos.filter(|_| self.add_bos).into_iter().collect();
        self.encode_segments(text, false, &mut out);
        out
    }

    /// `tokens` cut in windows of `ctx` (as perplexity scores them), each window's first token
    /// replaced by BOS when the model wants BOS (what `llama-perplexity` does).
    pub fn bos_windows(&self, tokens: &[u32], ctx: usize) -> Vec<u32> {
        let mut t = tokens.to_vec();
        if let Some(b) = self.bos.filter(|_| self.add_bos) {
            t.iter_mut().step_by(ctx.max(1)).for_each(|x| *x = b);
        }
        t
    }

    /// Encodes plain text: control tokens written in the text are encoded as the characters they are
    /// made of, never as the control token. BOS is not added.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        self.encode_segments(text, false, &mut out);
        out
    }

    /// Encodes text in which control tokens (`<|im_start|>`, `<end_of_turn>`...) are recognised as
    /// such. BOS is not added.
    pub fn encode_with_special(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        self.encode_segments(text, true, &mut out);
        out
    }

    /// Splits at special tokens (user-defined always, control ones if `control`), encodes the rest
    /// with the kind's algorithm. A piece of text is told whether a special token (or the start
    /// of the text) comes right before it: SentencePiece may put a space there.
    fn encode_segments(&self, text: &str, control: bool, out: &mut Vec<u32>) {
        let mut rest = text;
        let mut after_special = true;
        loop {
            let Some((at, len, id)) = self.specials.find(rest, control) else {
                self.encode_plain(rest, after_special, out);
                return;
            };
            self.encode_plain(&rest[..at], after_special, out);
            out.push(id);
            after_special = true;
            rest = &rest[at + len..];
        }
    }

    /// Encodes text that holds no special token.
    fn encode_plain(&self, text: &str, after_special: bool, out: &mut Vec<u32>) {
        if text.is_empty() {
            return;
        }
        match &self.kind {
            Kind::Bpe(b) => b.encode_plain(text, out),
            Kind::Spm(s) => s.encode_plain(text, after_special, out),
        }
    }

    /// Decodes tokens to text, control tokens included as their text; invalid UTF-8 becomes U+FFFD
    /// and ids outside the vocabulary are skipped.
    pub fn decode(&self, ids: &[u32]) -> String {
        String::from_utf8_lossy(&self.decode_bytes(ids, false)).into_owned()
    }

    /// Decodes tokens to text without the control tokens.
    pub fn decode_skip_special(&self, ids: &[u32]) -> String {
        String::from_utf8_lossy(&self.decode_bytes(ids, true)).into_owned()
    }

    /// The bytes the tokens stand for (not necessarily UTF-8 at token boundaries). A SentencePiece
    /// vocabulary that puts a space in front of text (`tokenizer.ggml.add_space_prefix`) has it
    /// taken off the first token that is not a control token, as llama.cpp's detokenizer does.
    pub fn decode_bytes(&self, ids: &[u32], skip_control: bool) -> Vec<u8> {
        let mut out = Vec::new();
        let mut strip_space = matches!(&self.kind, Kind::Spm(s) if s.add_space_prefix());
        for &id in ids {
            if self.is_control(id) {
                if skip_control {
                    continue;
                }
            } else if std::mem::take(&mut strip_space)
                && let Some(b) = self.token_bytes(id)
                && b.first() == Some(&b' ')
            {
                out.extend_from_slice(&b[1..]);
                continue;
            }
            if let Some(b) = self.token_bytes(id) {
                out.extend_from_slice(b);
            }
        }
        out
    }
}

/// The vocabulary's spellings and each token's type (all normal when the file gives none).
fn vocabulary(md: &HashMap<String, gguf_file::Value>) -> Result<(Vec<String>, Vec<TokenType>)> {
    let key = "tokenizer.ggml.tokens";
    let tokens = as_array(get(md, key)?, key)?
        .iter()
        .map(|v| as_str(v, key).map(str::to_owned))
        .collect::<Result<Vec<String>>>()?;
    let n = tokens.len();
    let key = "tokenizer.ggml.token_type";
    let types = match md.get(key) {
        Some(v) => {
            let a = as_array(v, key)?;
            if a.len() != n {
                return Err(TokenizerError::LengthMismatch {
                    key,
                    len: a.len(),
                    vocab_size: n,
                });
            }
            a.iter()
                .map(|v| as_int(v, key).map(TokenType::from_gguf))
                .collect::<Result<_>>()?
        }
        None => vec![TokenType::Normal; n],
    };
    Ok((tokens, types))
}

#[cfg(test)]
mod tests {
    use super::*;
    use gguf_file::Value;

    #[test]
    fn unsupported_vocabularies_are_clear_errors() {
        let check = |key: &str, value: Value, expected: &str| {
            let mut md: HashMap<String, Value> = HashMap::new();
            md.insert("tokenizer.ggml.model".into(), Value::String("gpt2".into()));
            md.insert("tokenizer.ggml.pre".into(), Value::String("smollm".into()));
            md.insert(
                "tokenizer.ggml.tokens".into(),
                Value::Array(vec![Value::String("a".into())]),
            );
            md.insert("tokenizer.ggml.merges".into(), Value::Array(vec![]));
            md.insert(key.into(), value);
            match Tokenizer::from_gguf_metadata(&md) {
                Ok(_) => panic!("{key} accepted"),
                Err(e) => assert_eq!(e.to_string(), expected),
            }
        };
        check(
            "tokenizer.ggml.model",
            Value::String("bert".into()),
            "unsupported tokenizer model \"bert\" (supported: \"gpt2\", byte-level BPE, and \"llama\", SentencePiece)",
        );
        check(
            "tokenizer.ggml.pre",
            Value::String("martian".into()),
            "unsupported pre-tokenizer \"martian\" in tokenizer.ggml.pre",
        );
        check(
            "tokenizer.ggml.eos_token_id",
            Value::U32(7),
            "tokenizer.ggml.eos_token_id = 7 is outside the vocabulary of 1 tokens",
        );
        check(
            "tokenizer.ggml.token_type",
            Value::Array(vec![]),
            "tokenizer.ggml.token_type has 0 entries but the vocabulary has 1 tokens",
        );
        check(
            "tokenizer.ggml.merges",
            Value::Array(vec![Value::String("ab".into())]),
            "merge #0 \"ab\" is not two tokens separated by one space",
        );
        check(
            "tokenizer.ggml.tokens",
            Value::U8(1),
            "the GGUF metadata key tokenizer.ggml.tokens is not an array",
        );
        check(
            "tokenizer.ggml.add_bos_token",
            Value::U8(1),
            "the GGUF metadata key tokenizer.ggml.add_bos_token is not a bool",
        );
        // A vocabulary without every byte (here: only "a") and no unknown token cannot encode all text.
        let mut md: HashMap<String, Value> = HashMap::new();
        md.insert("tokenizer.ggml.model".into(), Value::String("gpt2".into()));
        md.insert(
            "tokenizer.ggml.tokens".into(),
            Value::Array(vec![Value::String("a".into())]),
        );
        md.insert("tokenizer.ggml.merges".into(), Value::Array(vec![]));
        match Tokenizer::from_gguf_metadata(&md) {
            Ok(_) => panic!("vocabulary without byte tokens accepted"),
            Err(e) => assert_eq!(
                e.to_string(),
                "the vocabulary has no token for byte 0x00 and no unknown token"
            ),
        }
    }

    #[test]
    fn specials_are_found_leftmost_then_longest() {
        let tokens: Vec<String> = ["<a>", "<ab>", "\n", "\n\n", "x"]
            .map(String::from)
            .to_vec();
        use TokenType::*;
        let types = [Control, Control, UserDefined, UserDefined, Normal];
        let s = Specials::new(&tokens, &types);
        let check = |text: &str, control: bool, expected: Option<(usize, usize, u32)>| {
            assert_eq!(
                s.find(text, control),
                expected,
                "{text:?} control {control}"
            );
        };
        check("", true, None);
        check("x<ab>", true, Some((1, 4, 1)));
        check("x<ab>", false, None);
        check("é<a>\n", true, Some((2, 3, 0)));
        check("é<a>\n\n", false, Some((5, 2, 3)));
        check("x", true, None);
    }
}
