//! The tokenizer of a GGUF model, built from the file's own metadata: byte-level BPE, special tokens, chat template.
//!
//! Supported: `tokenizer.ggml.model = "gpt2"` (GPT-2 style byte-level BPE with merges in the file), with the
//! pre-tokenizer that `tokenizer.ggml.pre` names, as llama.cpp maps those names to split patterns.
//! Encoding is: split the text at special tokens (only when asked), split each piece with the pre-tokenizer
//! patterns in sequence, map every byte to its printable GPT-2 stand-in character, merge by BPE rank.
//! Results per pre-tokenized word are cached, so long texts cost one regex pass and a hash lookup per word.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file;
use parking_lot::Mutex;

mod chat;
mod split;
mod stream;

pub use chat::{ChatTemplate, Message};
use split::{PreTokenizer, Splitter};
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
    #[error("unsupported tokenizer model {model:?} (supported: \"gpt2\", byte-level BPE)")]
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
    #[error("unsupported chat template (only ChatML is supported): {head:?}")]
    UnsupportedChatTemplate { head: String },
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

/// A byte-level BPE tokenizer built from GGUF metadata. Cheap to share between threads (`Sync`).
pub struct Tokenizer {
    /// The vocabulary as stored in the GGUF (byte-level encoded text).
    tokens: Vec<String>,
    types: Vec<TokenType>,
    /// The bytes each token stands for.
    token_bytes: Vec<Vec<u8>>,
    token_to_id: HashMap<String, u32>,
    /// (left, right) -> (rank, merged token).
    merges: foldhash::HashMap<(u32, u32), (u32, u32)>,
    /// The token of each single byte, the starting point of BPE.
    byte_tokens: [u32; 256],
    pre_name: String,
    splitters: Vec<Splitter>,
    /// Control tokens (recognised on request) and user-defined tokens (always), longest first.
    control: Vec<(String, u32)>,
    user_defined: Vec<(String, u32)>,
    bos: Option<u32>,
    eos: Option<u32>,
    unknown: Option<u32>,
    padding: Option<u32>,
    add_bos: bool,
    chat_template: ChatTemplate,
    cache: Mutex<foldhash::HashMap<Box<str>, Box<[u32]>>>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.tokens.len())
            .field("merges", &self.merges.len())
            .field("pre", &self.pre_name)
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
        if model != "gpt2" {
            return Err(TokenizerError::UnsupportedModel {
                model: model.to_owned(),
            });
        }
        let (pre, pre_name) = pre_tokenizer(md)?;
        let (tokens, mut types) = vocabulary(md)?;
        let n = tokens.len();
        let bos = optional_id(md, "tokenizer.ggml.bos_token_id", n)?;
        let eos = optional_id(md, "tokenizer.ggml.eos_token_id", n)?;
        let unknown = optional_id(md, "tokenizer.ggml.unknown_token_id", n)?;
        let padding = optional_id(md, "tokenizer.ggml.padding_token_id", n)?;
        let add_bos = match md.get("tokenizer.ggml.add_bos_token") {
            Some(gguf_file::Value::Bool(b)) => *b,
            Some(_) => {
                return Err(TokenizerError::WrongType {
                    key: "tokenizer.ggml.add_bos_token",
                    expected: "a bool",
                });
            }
            None => false,
        };
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
        let table = byte_to_char_table();
        let token_bytes = token_bytes(&tokens, &types, &table);
        let mut token_to_id = HashMap::with_capacity(n);
        for (id, t) in tokens.iter().enumerate() {
            // The first of duplicate spellings wins, as in llama.cpp.
            token_to_id.entry(t.clone()).or_insert(id as u32);
        }
        let merges = merges(md, &token_to_id)?;
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
        let control = specials_of(&tokens, &types, TokenType::Control);
        let user_defined = specials_of(&tokens, &types, TokenType::UserDefined);
        Ok(Tokenizer {
            tokens,
            types,
            token_bytes,
            token_to_id,
            merges,
            byte_tokens,
            pre_name,
            splitters,
            control,
            user_defined,
            bos,
            eos,
            unknown,
            padding,
            add_bos,
            chat_template: ChatTemplate::from_jinja(template),
            cache: Mutex::new(foldhash::HashMap::default()),
        })
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
    /// The `tokenizer.ggml.pre` name in use.
    pub fn pre_tokenizer(&self) -> &str {
        &self.pre_name
    }
    pub fn chat_template(&self) -> &ChatTemplate {
        &self.chat_template
    }
    /// The id of a token by its exact vocabulary spelling (e.g. `<|im_end|>`).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.token_to_id.get(token).copied()
    }
    /// The vocabulary spelling of a token (byte-level encoded for normal tokens).
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
    /// Whether the token is a control token (BOS, EOS, `<|im_start|>`...).
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

    /// Drops the per-word BPE cache (it refills as text is encoded; for benchmarks and memory pressure).
    pub fn clear_cache(&self) {
        self.cache.lock().clear();
    }

    /// Encodes plain text: control tokens written in the text are encoded as the characters they are
    /// made of, never as the control token. BOS is not added.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        self.encode_segments(text, false, &mut out);
        out
    }

    /// Encodes text in which control tokens (`<|im_start|>`, `<|endoftext|>`...) are recognised as such.
    /// BOS is not added.
    pub fn encode_with_special(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        self.encode_segments(text, true, &mut out);
        out
    }

    /// Splits at special tokens (user-defined always, control ones if `control`), BPE-encodes the rest.
    fn encode_segments(&self, text: &str, control: bool, out: &mut Vec<u32>) {
        let mut rest = text;
        loop {
            let found = self.find_special(rest, control);
            let Some((at, len, id)) = found else {
                self.encode_plain(rest, out);
                return;
            };
            self.encode_plain(&rest[..at], out);
            out.push(id);
            rest = &rest[at + len..];
        }
    }

    /// The earliest special token in `text` (the longest one where several start at the same place).
    fn find_special(&self, text: &str, control: bool) -> Option<(usize, usize, u32)> {
        let mut best: Option<(usize, usize, u32)> = None;
        let lists: &[&[(String, u32)]] = if control {
            &[&self.user_defined, &self.control]
        } else {
            &[&self.user_defined]
        };
        for list in lists {
            for (s, id) in list.iter() {
                if let Some(at) = text.find(s.as_str()) {
                    let better = match best {
                        None => true,
                        Some((b_at, b_len, _)) => at < b_at || (at == b_at && s.len() > b_len),
                    };
                    if better {
                        best = Some((at, s.len(), *id));
                    }
                }
            }
        }
        best
    }

    /// Pre-tokenizes and BPE-encodes text that holds no special token.
    fn encode_plain(&self, text: &str, out: &mut Vec<u32>) {
        if text.is_empty() {
            return;
        }
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

    /// Decodes tokens to text, control tokens included as their text; invalid UTF-8 becomes U+FFFD
    /// and ids outside the vocabulary are skipped.
    pub fn decode(&self, ids: &[u32]) -> String {
        String::from_utf8_lossy(&self.decode_bytes(ids, false)).into_owned()
    }

    /// Decodes tokens to text without the control tokens.
    pub fn decode_skip_special(&self, ids: &[u32]) -> String {
        String::from_utf8_lossy(&self.decode_bytes(ids, true)).into_owned()
    }

    /// The bytes the tokens stand for (not necessarily UTF-8 at token boundaries).
    pub fn decode_bytes(&self, ids: &[u32], skip_control: bool) -> Vec<u8> {
        let mut out = Vec::new();
        for &id in ids {
            if skip_control && self.is_control(id) {
                continue;
            }
            if let Some(b) = self.token_bytes(id) {
                out.extend_from_slice(b);
            }
        }
        out
    }

    /// The conversation rendered as the model's chat template would, as text with control tokens.
    pub fn apply_chat_template(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let mut text = String::new();
        for seg in self.chat_segments(messages, add_generation_prompt)? {
            match seg {
                Segment::Special(id) => text.push_str(&self.tokens[id as usize]),
                Segment::Text(t) => text.push_str(&t),
            }
        }
        Ok(text)
    }

    /// The tokens of the conversation in the chat template. Control tokens come only from the template:
    /// a message that contains `<|im_end|>` gets it as plain characters, so content cannot forge a turn.
    pub fn encode_chat(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        if self.add_bos {
            out.extend(self.bos);
        }
        for seg in self.chat_segments(messages, add_generation_prompt)? {
            match seg {
                Segment::Special(id) => out.push(id),
                Segment::Text(t) => self.encode_segments(&t, false, &mut out),
            }
        }
        Ok(out)
    }

    fn chat_segments(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<Vec<Segment>> {
        let default_system = match &self.chat_template {
            ChatTemplate::ChatMl { default_system } => default_system.as_deref(),
            ChatTemplate::Unsupported { template } => {
                let head = template
                    .as_deref()
                    .map_or_else(|| "(none)".to_owned(), |t| t.chars().take(80).collect());
                return Err(TokenizerError::UnsupportedChatTemplate { head });
            }
        };
        let special = |token: &'static str| {
            self.token_id(token)
                .ok_or(TokenizerError::MissingSpecialToken { token })
        };
        let (start, end) = (special("<|im_start|>")?, special("<|im_end|>")?);
        let mut segs = Vec::with_capacity(messages.len() * 4 + 3);
        let turn = |segs: &mut Vec<Segment>, role: &str, content: &str| {
            segs.push(Segment::Special(start));
            segs.push(Segment::Text(format!("{role}\n{content}")));
            segs.push(Segment::Special(end));
            segs.push(Segment::Text("\n".to_owned()));
        };
        if let Some(system) = default_system
            && messages.first().is_none_or(|m| m.role != "system")
        {
            turn(&mut segs, "system", system);
        }
        for m in messages {
            turn(&mut segs, &m.role, &m.content);
        }
        if add_generation_prompt {
            segs.push(Segment::Special(start));
            segs.push(Segment::Text("assistant\n".to_owned()));
        }
        Ok(segs)
    }
}

enum Segment {
    Special(u32),
    Text(String),
}

/// A possible merge in [`Tokenizer::bpe`]: (rank, left position, left id, right id, merged id),
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

/// Each token's bytes: special tokens as spelled, the others through GPT-2's byte-to-char table
/// (`table`) in reverse.
fn token_bytes(tokens: &[String], types: &[TokenType], table: &[char; 256]) -> Vec<Vec<u8>> {
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

/// The non-empty tokens of type `ty` with their ids, longest first (so matching them in text
/// prefers the longest), ties by id.
fn specials_of(tokens: &[String], types: &[TokenType], ty: TokenType) -> Vec<(String, u32)> {
    let mut v: Vec<(String, u32)> = tokens
        .iter()
        .enumerate()
        .filter(|&(id, t)| types[id] == ty && !t.is_empty())
        .map(|(id, t)| (t.clone(), id as u32))
        .collect();
    v.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
    v
}

#[cfg(test)]
mod tests {
    use super::split::*;
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
            Value::String("llama".into()),
            "unsupported tokenizer model \"llama\" (supported: \"gpt2\", byte-level BPE)",
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
}
