//! The chunked KV cache: chunk formats and their codecs, the raw chunk memory interface, and a
//! context's cache of sealed (encoded) chunks plus the open chunk still being filled.
//!
//! A chunk holds `tokens` consecutive tokens of one context, all layers. Its bytes are laid out
//! layer by layer; within a layer, the K section then the V section, each `[kv_head][token][dim]`
//! followed by its scales. So attention at layer l reads one contiguous piece of every chunk.
//! The last, partly filled chunk stays open in f32 until it is full: a chunk is encoded once,
//! with all its tokens, so per-channel key scales never change after the fact.

use half::f16;
use std::fmt;
use std::str::FromStr;

/// What went wrong in the KV cache.
#[derive(Debug, thiserror::Error)]
pub enum KvError {
    /// A format name that is not known.
    #[error("unknown KV format {name:?}: expected one of f16, int8")]
    UnknownFormat { name: String },
    /// The chunk memory refused to store a chunk (budget, I/O).
    #[error("cannot store chunk {index}: {reason}")]
    Store { index: usize, reason: String },
    /// A sealed chunk is not resident and the memory could not bring it back.
    #[error("chunk {index} is not resident")]
    NotResident { index: usize },
    /// The context is full.
    #[error("context is full: {len} tokens + {adding} new exceed the maximum of {max}")]
    Full {
        len: usize,
        adding: usize,
        max: usize,
    },
}

/// How a sealed chunk's K and V values are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvFormat {
    /// IEEE half precision: the reference and the uncompressed baseline.
    F16,
    /// 8-bit: keys quantized per channel, values per token, symmetric, f32 scales.
    Int8,
}

impl KvFormat {
    /// Every format, best fidelity first.
    pub const ALL: [KvFormat; 2] = [KvFormat::F16, KvFormat::Int8];

    /// The name used on the command line and in files.
    pub fn name(self) -> &'static str {
        match self {
            KvFormat::F16 => "f16",
            KvFormat::Int8 => "int8",
        }
    }

    /// Bits per stored value, not counting scales.
    pub fn bits(self) -> u32 {
        match self {
            KvFormat::F16 => 16,
            KvFormat::Int8 => 8,
        }
    }
}

impl fmt::Display for KvFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for KvFormat {
    type Err = KvError;
    fn from_str(s: &str) -> Result<Self, KvError> {
        KvFormat::ALL
            .into_iter()
            .find(|f| f.name() == s)
            .ok_or_else(|| KvError::UnknownFormat { name: s.into() })
    }
}

/// Page size chunk slots are rounded to.
pub const PAGE: usize = 4096;

/// The dimensions of one chunk; every size in this module is a pure function of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkShape {
    /// Transformer blocks.
    pub n_layers: usize,
    /// KV heads.
    pub n_kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// Tokens per chunk.
    pub tokens: usize,
}

impl ChunkShape {
    /// Values in one head's block of K (or V) of one layer: `tokens * head_dim`.
    pub fn block(&self) -> usize {
        self.tokens * self.head_dim
    }

    /// Values of K (or V) of one layer: `n_kv_heads * tokens * head_dim`.
    pub fn section(&self) -> usize {
        self.n_kv_heads * self.block()
    }

    /// f32 values of an open chunk: `n_layers * 2 * section`.
    pub fn open_len(&self) -> usize {
        self.n_layers * 2 * self.section()
    }

    /// Bytes of the K section of one layer in `f` (values then scales).
    pub fn k_bytes(&self, f: KvFormat) -> usize {
        match f {
            KvFormat::F16 => self.section() * 2,
            KvFormat::Int8 => self.section() + self.n_kv_heads * self.head_dim * 4,
        }
    }

    /// Bytes of the V section of one layer in `f`.
    pub fn v_bytes(&self, f: KvFormat) -> usize {
        match f {
            KvFormat::F16 => self.section() * 2,
            KvFormat::Int8 => self.section() + self.n_kv_heads * self.tokens * 4,
        }
    }

    /// Bytes of one layer of a chunk in `f`.
    pub fn layer_bytes(&self, f: KvFormat) -> usize {
        self.k_bytes(f) + self.v_bytes(f)
    }

    /// Bytes of a whole chunk in `f`.
    pub fn chunk_bytes(&self, f: KvFormat) -> usize {
        self.n_layers * self.layer_bytes(f)
    }

    /// A chunk's slot in memory: its bytes rounded up to whole pages.
    pub fn slot_bytes(&self, f: KvFormat) -> usize {
        self.chunk_bytes(f).div_ceil(PAGE) * PAGE
    }
}

/// Encodes one layer of an open chunk (`k`, `v`: `[kv_head][token][dim]` f32) into `out`.
pub fn encode_layer(shape: &ChunkShape, f: KvFormat, k: &[f32], v: &[f32], out: &mut [u8]) {
    let (ko, vo) = out[..shape.layer_bytes(f)].split_at_mut(shape.k_bytes(f));
    match f {
        KvFormat::F16 => {
            for (o, x) in ko.chunks_exact_mut(2).zip(k) {
                o.copy_from_slice(&f16::from_f32(*x).to_le_bytes());
            }
            for (o, x) in vo.chunks_exact_mut(2).zip(v) {
                o.copy_from_slice(&f16::from_f32(*x).to_le_bytes());
            }
        }
        KvFormat::Int8 => {
            let (d, hd, t) = (shape.section(), shape.head_dim, shape.tokens);
            // Keys: one scale per (head, channel) over the chunk's tokens.
            let (kq, ks) = ko.split_at_mut(d);
            for h in 0..shape.n_kv_heads {
                let blk = &k[h * t * hd..(h + 1) * t * hd];
                for c in 0..hd {
                    let amax = (0..t).map(|i| blk[i * hd + c].abs()).fold(0.0f32, f32::max);
                    let scale = amax / 127.0;
                    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
                    for i in 0..t {
                        kq[h * t * hd + i * hd + c] = (blk[i * hd + c] * inv).round() as i8 as u8;
                    }
                    let s = (h * hd + c) * 4;
                    ks[s..s + 4].copy_from_slice(&scale.to_le_bytes());
                }
            }
            // Values: one scale per (head, token) over the head's channels.
            let (vq, vs) = vo.split_at_mut(d);
            for (row, (q, x)) in vq.chunks_exact_mut(hd).zip(v.chunks_exact(hd)).enumerate() {
                let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let scale = amax / 127.0;
                let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
                for (q, x) in q.iter_mut().zip(x) {
                    *q = (x * inv).round() as i8 as u8;
                }
                vs[row * 4..row * 4 + 4].copy_from_slice(&scale.to_le_bytes());
            }
        }
    }
}

fn le_f32(b: &[u8], i: usize) -> f32 {
    f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
}

/// Decodes head `h`'s keys from one encoded layer into `out` (`[token][dim]`).
pub fn decode_k(shape: &ChunkShape, f: KvFormat, layer: &[u8], h: usize, out: &mut [f32]) {
    let (blk, hd) = (shape.block(), shape.head_dim);
    let kb = &layer[..shape.k_bytes(f)];
    match f {
        KvFormat::F16 => {
            let src = &kb[h * blk * 2..(h + 1) * blk * 2];
            for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        KvFormat::Int8 => {
            let q = &kb[h * blk..(h + 1) * blk];
            let scales = &kb[shape.section() + h * hd * 4..shape.section() + (h + 1) * hd * 4];
            let mut s = [0f32; 256];
            for (c, s) in s.iter_mut().enumerate().take(hd) {
                *s = le_f32(scales, c);
            }
            for (o, q) in out.chunks_exact_mut(hd).zip(q.chunks_exact(hd)) {
                for c in 0..hd {
                    o[c] = q[c] as i8 as f32 * s[c];
                }
            }
        }
    }
}

/// Decodes head `h`'s values from one encoded layer into `out` (`[token][dim]`).
pub fn decode_v(shape: &ChunkShape, f: KvFormat, layer: &[u8], h: usize, out: &mut [f32]) {
    let (blk, hd, t) = (shape.block(), shape.head_dim, shape.tokens);
    let vb = &layer[shape.k_bytes(f)..shape.layer_bytes(f)];
    match f {
        KvFormat::F16 => {
            let src = &vb[h * blk * 2..(h + 1) * blk * 2];
            for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        KvFormat::Int8 => {
            let q = &vb[h * blk..(h + 1) * blk];
            let scales = &vb[shape.section()..];
            for (i, (o, q)) in out.chunks_exact_mut(hd).zip(q.chunks_exact(hd)).enumerate() {
                let s = le_f32(scales, h * t + i);
                for (o, q) in o.iter_mut().zip(q) {
                    *o = *q as i8 as f32 * s;
                }
            }
        }
    }
}

/// Raw memory for a context's sealed chunks: where the engine puts encoded chunk bytes and reads
/// them back. The heap implementation is [`HeapChunks`]; the pager provides userfaultfd-managed
/// slots behind the same interface.
pub trait ChunkMemory: Send + Sync {
    /// The bytes of chunk `index`, or `None` when it is not resident.
    fn get(&self, index: usize) -> Option<&[u8]>;
    /// Stores chunk `index` (claim and populate), replacing any previous bytes.
    fn put(&mut self, index: usize, bytes: &[u8]) -> Result<(), KvError>;
    /// Drops chunk `index` and everything after it.
    fn truncate(&mut self, chunks: usize);
    /// Bytes resident now.
    fn resident_bytes(&self) -> usize;
}

/// Chunk memory on the heap: one page-rounded allocation per chunk.
#[derive(Default)]
pub struct HeapChunks {
    slots: Vec<Option<Box<[u8]>>>,
    resident: usize,
}

impl ChunkMemory for HeapChunks {
    fn get(&self, index: usize) -> Option<&[u8]> {
        self.slots.get(index)?.as_deref()
    }

    fn put(&mut self, index: usize, bytes: &[u8]) -> Result<(), KvError> {
        if self.slots.len() <= index {
            self.slots.resize_with(index + 1, || None);
        }
        let slot = bytes.len().div_ceil(PAGE) * PAGE;
        let mut b = vec![0u8; slot].into_boxed_slice();
        b[..bytes.len()].copy_from_slice(bytes);
        if let Some(old) = self.slots[index].replace(b) {
            self.resident -= old.len();
        }
        self.resident += slot;
        Ok(())
    }

    fn truncate(&mut self, chunks: usize) {
        for s in self.slots.drain(chunks.min(self.slots.len())..) {
            self.resident -= s.map_or(0, |b| b.len());
        }
    }

    fn resident_bytes(&self) -> usize {
        self.resident
    }
}

/// One context's KV cache: sealed chunks in a [`ChunkMemory`], and the open chunk in f32.
pub struct KvCache {
    shape: ChunkShape,
    format: KvFormat,
    max_tokens: usize,
    formats: Vec<KvFormat>,
    mem: Box<dyn ChunkMemory>,
    /// Open chunks (f32, `[layer][k|v][kv_head][token][dim]`), the first at index `formats.len()`.
    open: Vec<Vec<f32>>,
    len: usize,
    /// Attention each token received, summed over heads, layers and queries.
    attn_sum: Vec<f32>,
    /// How many (query, head, layer) rows saw each token.
    attn_rows: Vec<u32>,
    scratch: Vec<u8>,
}

impl KvCache {
    /// An empty cache whose chunks are sealed in `format` into `mem`.
    pub fn new(
        shape: ChunkShape,
        format: KvFormat,
        max_tokens: usize,
        mem: Box<dyn ChunkMemory>,
    ) -> Self {
        Self {
            shape,
            format,
            max_tokens,
            formats: Vec::new(),
            mem,
            open: Vec::new(),
            len: 0,
            attn_sum: Vec::new(),
            attn_rows: Vec::new(),
            scratch: Vec::new(),
        }
    }

    /// The chunk shape.
    pub fn shape(&self) -> &ChunkShape {
        &self.shape
    }

    /// Tokens held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no token is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Maximum tokens.
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// The format new chunks are sealed in.
    pub fn format(&self) -> KvFormat {
        self.format
    }

    /// Formats of the sealed chunks.
    pub fn chunk_formats(&self) -> &[KvFormat] {
        &self.formats
    }

    /// Resident bytes of sealed chunks plus the open chunk's f32 staging.
    pub fn resident_bytes(&self) -> usize {
        self.mem.resident_bytes() + self.open.len() * self.shape.open_len() * 4
    }

    /// Per-token attention received (sum) and the number of rows that saw each token.
    pub fn attention_received(&self) -> (&[f32], &[u32]) {
        (&self.attn_sum, &self.attn_rows)
    }

    /// Empties the cache.
    pub fn clear(&mut self) {
        self.mem.truncate(0);
        self.formats.clear();
        self.open.clear();
        self.len = 0;
        self.attn_sum.clear();
        self.attn_rows.clear();
    }

    /// Makes room for `n` more tokens in open chunks (positions `len..len + n`).
    pub fn reserve(&mut self, n: usize) -> Result<(), KvError> {
        if self.len + n > self.max_tokens {
            return Err(KvError::Full {
                len: self.len,
                adding: n,
                max: self.max_tokens,
            });
        }
        let t = self.shape.tokens;
        let need_chunks = (self.len + n).div_ceil(t);
        while self.formats.len() + self.open.len() < need_chunks {
            self.open.push(vec![0.0; self.shape.open_len()]);
        }
        self.attn_sum.resize(self.len + n, 0.0);
        self.attn_rows.resize(self.len + n, 0);
        Ok(())
    }

    fn open_offset(&self, layer: usize, kv: usize, head: usize, pos: usize) -> (usize, usize) {
        let s = &self.shape;
        let chunk = pos / s.tokens - self.formats.len();
        let off =
            ((layer * 2 + kv) * s.n_kv_heads + head) * s.block() + (pos % s.tokens) * s.head_dim;
        (chunk, off)
    }

    /// Writes the K and V rows (`[kv_head][dim]`) of the token at `pos` for `layer`.
    /// `pos` must be in the reserved, open range.
    pub fn write(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]) {
        let hd = self.shape.head_dim;
        for h in 0..self.shape.n_kv_heads {
            let (c, o) = self.open_offset(layer, 0, h, pos);
            self.open[c][o..o + hd].copy_from_slice(&k[h * hd..(h + 1) * hd]);
            let (c, o) = self.open_offset(layer, 1, h, pos);
            self.open[c][o..o + hd].copy_from_slice(&v[h * hd..(h + 1) * hd]);
        }
    }

    /// Marks `n` reserved tokens as written, and seals every open chunk that is now full.
    pub fn commit(&mut self, n: usize) -> Result<(), KvError> {
        self.len += n;
        let t = self.shape.tokens;
        while self.len >= (self.formats.len() + 1) * t && !self.open.is_empty() {
            let buf = self.open.remove(0);
            let index = self.formats.len();
            self.seal(index, &buf, self.format)?;
            self.formats.push(self.format);
        }
        Ok(())
    }

    fn seal(&mut self, index: usize, buf: &[f32], f: KvFormat) -> Result<(), KvError> {
        let s = self.shape;
        let lb = s.layer_bytes(f);
        self.scratch.resize(s.chunk_bytes(f), 0);
        let sec = s.section();
        for l in 0..s.n_layers {
            let k = &buf[(l * 2) * sec..(l * 2 + 1) * sec];
            let v = &buf[(l * 2 + 1) * sec..(l * 2 + 2) * sec];
            encode_layer(&s, f, k, v, &mut self.scratch[l * lb..(l + 1) * lb]);
        }
        self.mem.put(index, &self.scratch)
    }

    /// Number of chunks touched by keys `0..upto` (sealed or open).
    pub fn chunks_upto(&self, upto: usize) -> usize {
        upto.div_ceil(self.shape.tokens)
    }

    /// Reads head `h`'s K and V block of chunk `c` at `layer` as f32 `[token][dim]`, either
    /// decoding a sealed chunk into `k`/`v` or borrowing the open chunk's staging.
    pub fn block<'a>(
        &'a self,
        layer: usize,
        h: usize,
        c: usize,
        k: &'a mut [f32],
        v: &'a mut [f32],
    ) -> Result<(&'a [f32], &'a [f32]), KvError> {
        let s = &self.shape;
        if c < self.formats.len() {
            let f = self.formats[c];
            let bytes = self.mem.get(c).ok_or(KvError::NotResident { index: c })?;
            let lb = s.layer_bytes(f);
            let layer_bytes = &bytes[layer * lb..(layer + 1) * lb];
            decode_k(s, f, layer_bytes, h, k);
            decode_v(s, f, layer_bytes, h, v);
            Ok((k, v))
        } else {
            let buf = &self.open[c - self.formats.len()];
            let ko = ((layer * 2) * s.n_kv_heads + h) * s.block();
            let vo = ((layer * 2 + 1) * s.n_kv_heads + h) * s.block();
            Ok((&buf[ko..ko + s.block()], &buf[vo..vo + s.block()]))
        }
    }

    /// Adds attention received by keys `0..col.len()`.
    pub fn add_attention(&mut self, col: &[f32]) {
        for (a, c) in self.attn_sum.iter_mut().zip(col) {
            *a += c;
        }
    }

    /// Adds to the number of query rows that saw each key `0..seen.len()`.
    pub fn add_rows(&mut self, seen: &[u32]) {
        for (r, s) in self.attn_rows.iter_mut().zip(seen) {
            *r += s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> ChunkShape {
        ChunkShape {
            n_layers: 2,
            n_kv_heads: 3,
            head_dim: 8,
            tokens: 4,
        }
    }

    #[test]
    fn sizes_are_pure_functions_of_shape() {
        let s = ChunkShape {
            n_layers: 30,
            n_kv_heads: 3,
            head_dim: 64,
            tokens: 16,
        };
        assert_eq!(s.chunk_bytes(KvFormat::F16), 30 * 2 * 3 * 16 * 64 * 2);
        assert_eq!(
            s.chunk_bytes(KvFormat::Int8),
            30 * (2 * 3 * 16 * 64 + 3 * 64 * 4 + 3 * 16 * 4)
        );
        assert_eq!(s.slot_bytes(KvFormat::F16) % PAGE, 0);
    }

    #[test]
    fn codecs_round_trip_within_bounds() {
        let s = shape();
        let n = s.section();
        let k: Vec<f32> = (0..n)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let v: Vec<f32> = (0..n)
            .map(|i| ((i * 53 % 89) as f32 - 44.0) / 3.0)
            .collect();
        for f in KvFormat::ALL {
            let mut buf = vec![0u8; s.layer_bytes(f)];
            encode_layer(&s, f, &k, &v, &mut buf);
            for h in 0..s.n_kv_heads {
                let (mut dk, mut dv) = (vec![0.0; s.block()], vec![0.0; s.block()]);
                decode_k(&s, f, &buf, h, &mut dk);
                decode_v(&s, f, &buf, h, &mut dv);
                let kb = &k[h * s.block()..(h + 1) * s.block()];
                let vb = &v[h * s.block()..(h + 1) * s.block()];
                for (got, want) in dk.iter().zip(kb).chain(dv.iter().zip(vb)) {
                    let bound = match f {
                        KvFormat::F16 => want.abs() / 1024.0,
                        // half a step of the largest value on its channel/token (<= 14.3/127/2)
                        KvFormat::Int8 => 14.3 / 127.0 / 2.0 + 1e-6,
                    };
                    assert!((got - want).abs() <= bound, "{f}: {got} vs {want}");
                }
            }
        }
    }

    #[test]
    fn open_chunks_seal_when_full() {
        let s = shape();
        let mut c = KvCache::new(s, KvFormat::F16, 64, Box::new(HeapChunks::default()));
        c.reserve(6).unwrap();
        let row: Vec<f32> = (0..s.n_kv_heads * s.head_dim).map(|i| i as f32).collect();
        for p in 0..6 {
            for l in 0..s.n_layers {
                c.write(l, p, &row, &row);
            }
        }
        c.commit(6).unwrap();
        assert_eq!(c.chunk_formats().len(), 1);
        assert_eq!(c.len(), 6);
        let (mut k, mut v) = (vec![0.0; s.block()], vec![0.0; s.block()]);
        let (kb, _) = c.block(1, 2, 0, &mut k, &mut v).unwrap();
        assert_eq!(&kb[..s.head_dim], &row[2 * s.head_dim..3 * s.head_dim]);
        assert!(matches!(c.reserve(59), Err(KvError::Full { .. })));
    }
}
