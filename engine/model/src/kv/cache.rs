//! The chunked KV cache: the raw chunk memory interface, and a context's cache of sealed
//! (encoded) chunks plus the open chunk still being filled, with the token ids it was built from.
//!
//! A chunk holds `tokens` consecutive tokens of one context, all layers, in one of the formats of
//! [`crate::kv::codec`]. The last, partly filled chunk stays open in f32 until it is full: a chunk is
//! encoded once, with all its tokens, so per-channel key scales never change after the fact.
//! A sealed chunk may later move down a format ([`KvCache::recompress`]), be dropped from memory
//! ([`KvCache::reclaim`]) and be rebuilt from its tokens ([`crate::kv::recompute`]).

use crate::kernels::coded::KvArith;
pub use crate::kv::codec::{
    ChunkShape, CodecError, KvFormat, PAGE, decode_k, decode_v, encode_layer,
};
use crate::kv::received::{Attention, TakenAttention};
use crate::kv::staging::Staging;

/// What went wrong in the KV cache.
#[derive(Debug, thiserror::Error)]
pub enum KvError {
    /// The chunk memory refused to store a chunk (budget, I/O).
    #[error("cannot store chunk {index}: {reason}")]
    Store { index: usize, reason: String },
    /// The chunk memory's budget has no room for the chunk (everything else is in use).
    #[error("no memory for chunk {index}: {reason}")]
    OverBudget { index: usize, reason: String },
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
    /// A chunk could not be encoded.
    #[error("cannot encode chunk {index}: {source}")]
    Codec { index: usize, source: CodecError },
    /// A chunk index that is not a sealed chunk of this context.
    #[error("chunk {index} is not sealed: the context has {sealed} sealed chunks")]
    NotSealed { index: usize, sealed: usize },
    /// Committed tokens disagree with the reserved count.
    #[error("{given} token ids given for {expected} written tokens")]
    TokenCount { given: usize, expected: usize },
    /// A sliding-window layer of a chunk past the window: the chunk keeps its global layers only.
    #[error("chunk {index} is past the sliding window: it keeps no K/V of layer {layer}")]
    Trimmed { index: usize, layer: usize },
    /// A chunk borrowed from a shared prefix: other contexts read the same bytes, so it is never
    /// recompressed, trimmed or replaced by this cache.
    #[error("chunk {index} is borrowed from a shared prefix and cannot change")]
    Shared { index: usize },
    /// Recompute of a chunk whose exact rebuild needs the sliding-window layers of chunks that
    /// no longer keep them.
    #[error(
        "chunk {index} cannot be recomputed exactly: its window reaches chunk {needs}, which is past the sliding window (the first {trimmed} chunks keep their global layers only)"
    )]
    PastWindow {
        index: usize,
        needs: usize,
        trimmed: usize,
    },
    /// A chunk to seal or read whose f32 staging holds no K/V of a layer (never written, or
    /// released by a pass that failed before sealing it).
    #[error("chunk {index} has no K/V of layer {layer} in its f32 staging")]
    Unwritten { index: usize, layer: usize },
}

/// Raw memory for a context's sealed chunks: where the engine puts encoded chunk bytes and reads
/// them back. The heap implementation is [`HeapChunks`]; the service's `PagerChunks` puts them in
/// userfaultfd-managed slots under a budget.
///
/// Managed memory must be pinned ([`ChunkMemory::pin`]) while the engine uses it: between pins,
/// chunks may be reclaimed behind the cache's back, and `get` answers `None`.
pub trait ChunkMemory: Send + Sync {
    /// The bytes of chunk `index` (at least its encoded length), or `None` when it is not
    /// resident or not usable now (unpinned, awaiting recompute).
    fn get(&self, index: usize) -> Option<&[u8]>;
    /// Stores chunk `index`: claims memory for it, or rewrites it in place when it is resident
    /// (a recompress to a lighter format gives back the pages it no longer needs).
    fn put(&mut self, index: usize, bytes: &[u8]) -> Result<(), KvError>;
    /// Drops chunk `index`'s bytes (reclaim); it is no longer resident.
    fn reclaim(&mut self, index: usize) -> Result<(), KvError>;
    /// Drops chunk `index` and everything after it.
    fn truncate(&mut self, chunks: usize) -> Result<(), KvError>;
    /// Bytes resident now.
    fn resident_bytes(&self) -> usize;
    /// Holds the memory for use: no chunk is reclaimed until [`ChunkMemory::unpin`].
    fn pin(&mut self) -> Result<(), KvError> {
        Ok(())
    }
    /// Lets chunks be reclaimed again.
    fn unpin(&mut self) {}
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

    fn reclaim(&mut self, index: usize) -> Result<(), KvError> {
        if let Some(old) = self.slots.get_mut(index).and_then(Option::take) {
            self.resident -= old.len();
        }
        Ok(())
    }

    fn truncate(&mut self, chunks: usize) -> Result<(), KvError> {
        for s in self.slots.drain(chunks.min(self.slots.len())..) {
            self.resident -= s.map_or(0, |b| b.len());
        }
        Ok(())
    }

    fn resident_bytes(&self) -> usize {
        self.resident
    }
}

/// One layer of one chunk as attention reads it.
#[derive(Clone, Copy, Debug)]
pub enum LayerView<'a> {
    /// A sealed chunk: the layer's encoded bytes in its format.
    Sealed(KvFormat, &'a [u8]),
    /// An open (or recomputing) chunk: the layer's f32 `[k|v][kv_head][token][dim]`.
    Open(&'a [f32]),
}

/// A chunk encoded layer by layer during a batched pass.
struct Fresh {
    index: usize,
    format: KvFormat,
    bytes: Vec<u8>,
    /// Which layers are encoded in `bytes`.
    layers: Vec<bool>,
}

impl Fresh {
    fn complete(&self) -> bool {
        self.layers.iter().all(|&l| l)
    }
}

/// One context's KV cache: sealed chunks in a [`ChunkMemory`], and the open chunk in f32.
pub struct KvCache {
    shape: ChunkShape,
    format: KvFormat,
    max_tokens: usize,
    formats: Vec<KvFormat>,
    mem: Box<dyn ChunkMemory>,
    /// Open chunks (f32 per layer, [`Staging`]), the first at index `formats.len()`.
    open: Vec<Staging>,
    len: usize,
    /// Token ids of positions `0..len`: the source of truth for recompute.
    tokens: Vec<u32>,
    /// Sealed chunks being recomputed, each with its f32 staging laid out as an open chunk.
    staged: Vec<(usize, Staging)>,
    /// Chunks sealed layer by layer during the current batched pass, before they reach chunk
    /// memory: later chunks of the pass read them in this form ([`KvCache::sealed_layer`]).
    fresh: Vec<Fresh>,
    /// Chunks whose memory has been cut to their global layers (a prefix of the chunks past the
    /// window, [`ChunkShape::trimmed_chunks`]).
    cut: usize,
    /// Chunks past the window that a recompute in progress rebuilt whole: later passes of the
    /// same recompute read their sliding-window layers; [`KvCache::end_recompute_run`] cuts them.
    whole: Vec<usize>,
    /// The first chunks, borrowed from shared prefixes ([`KvCache::set_shared`]): for each,
    /// whether its prefix keeps it cut to its global layers.
    shared: Vec<bool>,
    /// Attention each token received, summed over heads, layers and queries, and how many rows
    /// saw it: over every layer, and over the global layers alone on a model with a window.
    attn: Attention,
    scratch: Vec<u8>,
    /// How decode attention multiplies the chunks of codes ([`KvArith::get`] at creation).
    arith: KvArith,
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
            tokens: Vec::new(),
            staged: Vec::new(),
            fresh: Vec::new(),
            cut: 0,
            whole: Vec::new(),
            shared: Vec::new(),
            attn: Attention::new(&shape),
            scratch: Vec::new(),
            arith: KvArith::get(),
        }
    }

    /// How decode attention over this cache multiplies chunks of codes.
    pub fn arith(&self) -> KvArith {
        self.arith
    }

    /// Sets how decode attention over this cache multiplies chunks of codes (for tests that
    /// compare the two in one process).
    pub fn set_arith(&mut self, arith: KvArith) {
        self.arith = arith;
    }

    /// How many chunks are past the sliding window: they keep only their global layers
    /// ([`ChunkShape::trimmed_chunks`]; 0 for a model without a window). Counted from the sealed
    /// tokens, which only grow (the open chunk's tokens come and go between calls), so a chunk
    /// once past the window stays past it, and a cache rebuilt from the store agrees.
    pub fn trimmed_chunks(&self) -> usize {
        let sealed = self.formats.len();
        self.shape.trimmed_chunks(sealed * self.shape.tokens)
    }

    /// Makes the first `cut.len()` sealed chunks borrowed from shared prefixes: from now on they
    /// are read, never changed (not recompressed, trimmed or rewritten but by a recompute of a
    /// lost one, which makes the same bytes). `cut[i]` says whether chunk `i`'s prefix keeps it
    /// cut to its global layers (a prefix of `n` chunks cuts the first
    /// `shape.trimmed_chunks(n * tokens)`, as a context of its length would).
    pub fn set_shared(&mut self, cut: Vec<bool>) -> Result<(), KvError> {
        if cut.len() > self.formats.len() {
            return Err(KvError::NotSealed {
                index: cut.len() - 1,
                sealed: self.formats.len(),
            });
        }
        self.shared = cut;
        Ok(())
    }

    /// How many of the first chunks are borrowed from shared prefixes.
    pub fn shared(&self) -> usize {
        self.shared.len()
    }

    /// Whether chunk `index` is kept cut to its global layers: past the window, or as its shared
    /// prefix keeps it.
    pub fn is_cut(&self, index: usize) -> bool {
        match self.shared.get(index) {
            Some(&cut) => cut,
            None => index < self.trimmed_chunks(),
        }
    }

    /// The shape of sealed chunk `index` as the cache keeps it: trimmed past the window (a
    /// borrowed chunk: as its prefix keeps it).
    pub fn shape_of(&self, index: usize) -> ChunkShape {
        if self.is_cut(index) {
            self.shape.trimmed()
        } else {
            self.shape
        }
    }

    /// The memory the sealed chunks take once `more` tokens are added after the cache's (its open
    /// chunk's included): each sealed chunk's slot at its format and shape, and each chunk the
    /// new tokens seal at the cache's format, untrimmed (an upper bound: a chunk that moves past
    /// the window shrinks). What a call must find room for in a memory budget.
    pub fn slot_bytes_with(&self, more: usize) -> u64 {
        self.slot_bytes_sealing(more, self.format)
    }

    /// [`KvCache::slot_bytes_with`] were the new chunks sealed in `format`.
    pub fn slot_bytes_sealing(&self, more: usize, format: KvFormat) -> u64 {
        let held: u64 = (self.formats.iter().enumerate())
            .map(|(i, &f)| self.shape_of(i).slot_bytes(f) as u64)
            .sum();
        let sealed = (self.len + more) / self.shape.tokens;
        let new = sealed.saturating_sub(self.formats.len()) as u64;
        held + new * self.shape.slot_bytes(format) as u64
    }

    /// Seals the chunks filled from now on in `format` (the chunks sealed already keep theirs):
    /// a call whose context would not fit its memory budget in the cache's format seals its new
    /// chunks lighter. Call it between passes, not during one.
    pub fn set_format(&mut self, format: KvFormat) {
        self.format = format;
    }

    /// The first chunk that [`KvCache::recomputable`] allows on its own (0 without a window).
    pub fn first_recomputable(&self) -> usize {
        let s = &self.shape;
        if !s.has_window() {
            return 0;
        }
        // The smallest c with (c t + 1 - window) / t >= trimmed.
        (self.trimmed_chunks() * s.tokens + s.window - 1).div_ceil(s.tokens)
    }

    /// The chunks to recompute with chunk `index` for its rebuild to be exact: itself alone when
    /// [`KvCache::recomputable`]; past the window, every chunk from the first. (Each local layer
    /// looks a window further back, so `local layers × window` tokens would do for the chunk's
    /// own K/V, about 7,700 on Gemma 3; but the earliest chunk of such a pass would itself need
    /// the window before it, which no chunk past the window keeps: a pass that stops short of
    /// the start cannot run. A chunk past the window is read, never recomputed, unless the
    /// store lost it.)
    pub fn recompute_closure(&self, index: usize) -> std::ops::Range<usize> {
        if self.recomputable(index).is_ok() {
            return index..index + 1;
        }
        0..index + 1
    }

    /// Whether chunk `index` can be recomputed exactly: every chunk its queries look back to
    /// on a sliding-window layer still keeps that layer.
    pub fn recomputable(&self, index: usize) -> Result<(), KvError> {
        let s = &self.shape;
        if !s.has_window() {
            return Ok(());
        }
        let needs = (index * s.tokens + 1).saturating_sub(s.window) / s.tokens;
        let trimmed = self.trimmed_chunks();
        if needs < trimmed {
            return Err(KvError::PastWindow {
                index,
                needs,
                trimmed,
            });
        }
        Ok(())
    }

    /// Cuts the resident chunks that are past the window to their global layers, giving their
    /// sliding-window layers' memory back; returns the chunks cut. [`KvCache::commit`] calls it.
    pub fn trim(&mut self) -> Result<Vec<usize>, KvError> {
        self.end_recompute_run()?;
        let upto = self.trimmed_chunks();
        let mut cut = Vec::new();
        // Borrowed chunks stay as their prefix keeps them.
        for index in self.cut.max(self.shared.len())..upto {
            let f = self.formats[index];
            let keep = self.shape.trimmed().chunk_bytes(f);
            if let Some(bytes) = self.mem.get(index) {
                self.scratch.clear();
                self.scratch.extend_from_slice(&bytes[..keep]);
                self.mem.put(index, &self.scratch)?;
                cut.push(index);
            }
        }
        self.cut = self.cut.max(upto);
        Ok(cut)
    }

    /// Cuts the chunks past the window that a recompute rebuilt whole (see
    /// [`KvCache::recompute_closure`]) to their global layers, once the recompute is over.
    pub fn end_recompute_run(&mut self) -> Result<(), KvError> {
        for index in std::mem::take(&mut self.whole) {
            let f = self.formats[index];
            let keep = self.shape.trimmed().chunk_bytes(f);
            if let Some(bytes) = self.mem.get(index) {
                self.scratch.clear();
                self.scratch.extend_from_slice(&bytes[..keep]);
                self.mem.put(index, &self.scratch)?;
            }
        }
        Ok(())
    }

    /// Refuses a layer of chunk `c` that the chunk no longer keeps.
    fn check_kept(&self, layer: usize, c: usize) -> Result<(), KvError> {
        if !self.shape.is_global(layer) && c < self.trimmed_chunks() && !self.whole.contains(&c) {
            return Err(KvError::Trimmed { index: c, layer });
        }
        Ok(())
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

    /// Token ids of every position held.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Whether sealed chunk `index` has its bytes in memory.
    pub fn is_resident(&self, index: usize) -> bool {
        self.mem.get(index).is_some()
    }

    /// Sealed chunks whose bytes are not in memory, ascending.
    pub fn missing_chunks(&self) -> Vec<usize> {
        (0..self.formats.len())
            .filter(|&c| !self.is_resident(c))
            .collect()
    }

    /// The encoded bytes of sealed chunk `index`, when resident: its global layers alone when it
    /// is past the window.
    pub fn chunk_bytes(&self, index: usize) -> Option<&[u8]> {
        let f = *self.formats.get(index)?;
        Some(&self.mem.get(index)?[..self.shape_of(index).chunk_bytes(f)])
    }

    /// Resident bytes of sealed chunks plus the open chunk's f32 staging.
    pub fn resident_bytes(&self) -> usize {
        self.mem.resident_bytes() + self.open.iter().map(Staging::bytes).sum::<usize>()
    }

    /// Per-token attention received (sum) and the number of rows that saw each token.
    pub fn attention_received(&self) -> (&[f32], &[u32]) {
        (&self.attn.all.sum, &self.attn.all.rows)
    }

    /// Every token's attention received as the policy crate counts it: `heads_layers` is the
    /// model's query heads times layers, so `queries` counts each query token once.
    pub fn token_attention(&self, heads_layers: u32) -> Vec<policy::TokenAttention> {
        self.attn.all.token_attention(heads_layers)
    }

    /// Every token's attention received in the global layers alone, on a model with
    /// sliding-window layers (`None` otherwise); `n_heads` is the model's query heads.
    pub fn global_token_attention(&self, n_heads: u32) -> Option<Vec<policy::TokenAttention>> {
        let hl = n_heads * self.shape.n_global() as u32;
        self.attn.global.as_ref().map(|g| g.token_attention(hl))
    }

    /// A cache rebuilt from what a store keeps of a context: the token ids of its sealed chunks
    /// and each chunk's format. No chunk is resident until it is loaded or recomputed; attention
    /// received starts again from zero.
    pub fn resume(
        shape: ChunkShape,
        format: KvFormat,
        max_tokens: usize,
        mem: Box<dyn ChunkMemory>,
        tokens: Vec<u32>,
        formats: Vec<KvFormat>,
    ) -> Result<Self, KvError> {
        if tokens.len() != formats.len() * shape.tokens || tokens.len() > max_tokens {
            return Err(KvError::TokenCount {
                given: tokens.len(),
                expected: formats.len() * shape.tokens,
            });
        }
        let mut c = Self::new(shape, format, max_tokens, mem);
        c.len = tokens.len();
        c.attn.resize(tokens.len());
        c.tokens = tokens;
        c.formats = formats;
        c.cut = c.trimmed_chunks();
        Ok(c)
    }

    /// Drops the open chunk (its f32 K/V, the one part of a context not kept in chunk memory)
    /// and returns its token ids: the caller runs them through the model again before the next
    /// tokens, which costs less than keeping an f32 chunk per idle context.
    pub fn drop_open(&mut self) -> Vec<u32> {
        let sealed = self.formats.len() * self.shape.tokens;
        let tail = self.tokens.split_off(sealed.min(self.tokens.len()));
        self.open.clear();
        self.fresh.clear();
        self.len = self.tokens.len();
        self.attn.truncate(self.len);
        tail
    }

    /// Holds the chunk memory for use (see [`ChunkMemory::pin`]).
    pub fn pin(&mut self) -> Result<(), KvError> {
        self.mem.pin()
    }

    /// Lets chunks be reclaimed again.
    pub fn unpin(&mut self) {
        self.mem.unpin();
    }

    /// Attention received per token so far, as the policy crate counts it (over every layer,
    /// and over the global layers alone on a model with a window), and resets the sums (the
    /// caller merges them into its density trackers once per call). `n_heads` is the model's
    /// query heads.
    pub fn take_attention(&mut self, n_heads: u32) -> TakenAttention {
        let out = self.attention(n_heads);
        self.attn.reset();
        out
    }

    /// [`KvCache::take_attention`] without the reset.
    pub fn attention(&self, n_heads: u32) -> TakenAttention {
        TakenAttention {
            all: self.token_attention(n_heads * self.shape.n_layers as u32),
            global: self.global_token_attention(n_heads),
        }
    }

    /// Empties the cache.
    pub fn clear(&mut self) {
        let _ = self.mem.truncate(0);
        self.formats.clear();
        self.open.clear();
        self.len = 0;
        self.cut = 0;
        self.shared.clear();
        self.tokens.clear();
        self.staged.clear();
        self.fresh.clear();
        self.attn.truncate(0);
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
        self.fresh.clear();
        let t = self.shape.tokens;
        let need_chunks = (self.len + n).div_ceil(t);
        while self.formats.len() + self.open.len() < need_chunks {
            self.open.push(Staging::empty(&self.shape));
        }
        self.attn.resize(self.len + n);
        Ok(())
    }

    /// The offset of position `pos`'s row in a layer of its chunk's f32 staging.
    fn row_offset(&self, kv: usize, head: usize, pos: usize) -> usize {
        let s = &self.shape;
        (kv * s.n_kv_heads + head) * s.block() + (pos % s.tokens) * s.head_dim
    }

    fn staging_mut(&mut self, chunk: usize) -> Option<&mut Staging> {
        match self.staged.iter_mut().find(|(c, _)| *c == chunk) {
            Some((_, buf)) => Some(buf),
            None => self.open.get_mut(chunk.checked_sub(self.formats.len())?),
        }
    }

    fn staging(&self, chunk: usize) -> Option<&Staging> {
        match self.staged.iter().find(|(c, _)| *c == chunk) {
            Some((_, buf)) => Some(buf),
            None => self.open.get(chunk.checked_sub(self.formats.len())?),
        }
    }

    /// Writes the K and V rows (`[kv_head][dim]`) of the token at `pos` for `layer`.
    /// `pos` must be in the reserved, open range, or in a chunk being recomputed.
    pub fn write(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]) {
        let hd = self.shape.head_dim;
        let chunk = pos / self.shape.tokens;
        for h in 0..self.shape.n_kv_heads {
            let ko = self.row_offset(0, h, pos);
            let vo = self.row_offset(1, h, pos);
            let buf = self
                .staging_mut(chunk)
                .expect("a write to a reserved or recomputing position")
                .layer_mut(layer);
            buf[ko..ko + hd].copy_from_slice(&k[h * hd..(h + 1) * hd]);
            buf[vo..vo + hd].copy_from_slice(&v[h * hd..(h + 1) * hd]);
        }
    }

    /// Marks the reserved tokens `tokens` (their K/V written) as held, and seals every open
    /// chunk that is now full.
    pub fn commit(&mut self, tokens: &[u32]) -> Result<(), KvError> {
        let n = tokens.len();
        if self.len + n > self.attn.len() {
            return Err(KvError::TokenCount {
                given: n,
                expected: self.attn.len() - self.len,
            });
        }
        self.len += n;
        self.tokens.extend_from_slice(tokens);
        let t = self.shape.tokens;
        while self.len >= (self.formats.len() + 1) * t && !self.open.is_empty() {
            let buf = self.open.remove(0);
            let index = self.formats.len();
            // A chunk the pass already encoded layer by layer goes in as it is: the same bytes
            // a seal would make.
            match self.take_fresh(index) {
                Some(f) if f.complete() && f.format == self.format => {
                    self.mem.put(index, &f.bytes)?
                }
                _ => self.seal(index, &buf, self.format, false)?,
            }
            self.formats.push(self.format);
        }
        self.fresh.clear();
        self.trim()?;
        Ok(())
    }

    fn take_fresh(&mut self, index: usize) -> Option<Fresh> {
        let i = self.fresh.iter().position(|f| f.index == index)?;
        Some(self.fresh.swap_remove(i))
    }

    /// Encodes layer `layer` of chunk `index` from its f32 staging (a chunk being recomputed, in
    /// its recorded format, or an open chunk, in the cache's format) while a batched pass runs,
    /// so that the pass's later chunks read it sealed ([`KvCache::sealed_layer`]) before it
    /// reaches chunk memory. The chunk's rows for the layer must all be written. A chunk that is
    /// sealed already and not being recomputed is left alone.
    pub fn seal_layer(&mut self, layer: usize, index: usize) -> Result<(), KvError> {
        let s = self.shape;
        let (format, buf): (KvFormat, &Staging) =
            match self.staged.iter().find(|(c, _)| *c == index) {
                Some((_, buf)) => (self.formats[index], buf),
                None if index >= self.formats.len() => {
                    match self.open.get(index - self.formats.len()) {
                        Some(buf) => (self.format, buf),
                        None => {
                            return Err(KvError::NotSealed {
                                index,
                                sealed: self.formats.len(),
                            });
                        }
                    }
                }
                None => return Ok(()),
            };
        let i = match self.fresh.iter().position(|f| f.index == index) {
            Some(i) => i,
            None => {
                self.fresh.push(Fresh {
                    index,
                    format,
                    bytes: vec![0; s.chunk_bytes(format)],
                    layers: vec![false; s.n_layers],
                });
                self.fresh.len() - 1
            }
        };
        let fresh = &mut self.fresh[i];
        let (lb, sec) = (s.layer_bytes(format), s.section());
        let at = s.layer_offset(layer, format);
        let kv = buf
            .layer(layer)
            .ok_or(KvError::Unwritten { index, layer })?;
        let (k, v) = kv.split_at(sec);
        encode_layer(&s, format, k, v, &mut fresh.bytes[at..at + lb])
            .map_err(|source| KvError::Codec { index, source })?;
        fresh.layers[layer] = true;
        Ok(())
    }

    /// Frees the f32 of layer `layer` of chunk `index` once a batched pass has sealed it
    /// ([`KvCache::seal_layer`]) and attended to it: the pass reads it sealed from then on, and
    /// the chunk goes into memory from its sealed layers. The staging of an open chunk that
    /// holds tokens of earlier calls is kept whole, so a pass that fails loses nothing.
    pub fn release_layer(&mut self, layer: usize, index: usize) {
        let sealed = self
            .fresh
            .iter()
            .any(|f| f.index == index && f.layers.get(layer) == Some(&true));
        let holds_earlier = index * self.shape.tokens < self.len;
        let recomputing = self.staged.iter().any(|(c, _)| *c == index);
        if !sealed || (holds_earlier && !recomputing) {
            return;
        }
        if let Some(buf) = self.staging_mut(index) {
            buf.release(layer);
        }
    }

    /// Layer `layer` of chunk `c` in its sealed form, as later chunks attend to it: encoded by
    /// the running pass ([`KvCache::seal_layer`]) or read from chunk memory. `None` for a chunk
    /// that has no sealed form yet (open, or being recomputed and not yet sealed at this layer).
    pub fn sealed_layer(
        &self,
        layer: usize,
        c: usize,
    ) -> Result<Option<(KvFormat, &[u8])>, KvError> {
        let s = &self.shape;
        if let Some(f) = self.fresh.iter().find(|f| f.index == c && f.layers[layer]) {
            let (lb, at) = (s.layer_bytes(f.format), s.layer_offset(layer, f.format));
            return Ok(Some((f.format, &f.bytes[at..at + lb])));
        }
        if c >= self.formats.len() || self.staged.iter().any(|(i, _)| *i == c) {
            return Ok(None);
        }
        self.check_kept(layer, c)?;
        let f = self.formats[c];
        let bytes = self.mem.get(c).ok_or(KvError::NotResident { index: c })?;
        let (lb, at) = (s.layer_bytes(f), s.layer_offset(layer, f));
        Ok(Some((f, &bytes[at..at + lb])))
    }

    /// Layer `layer` of chunk `c` in f32 (`[k|v][kv_head][token][dim]`) when it has an f32
    /// staging: an open chunk or one being recomputed.
    pub fn f32_layer(&self, layer: usize, c: usize) -> Option<&[f32]> {
        self.staging(c)?.layer(layer)
    }

    fn seal(
        &mut self,
        index: usize,
        buf: &Staging,
        f: KvFormat,
        whole: bool,
    ) -> Result<(), KvError> {
        let s = self.shape;
        let lb = s.layer_bytes(f);
        self.scratch.resize(s.chunk_bytes(f), 0);
        let sec = s.section();
        for l in 0..s.n_layers {
            let kv = buf.layer(l).ok_or(KvError::Unwritten { index, layer: l })?;
            let (k, v) = kv.split_at(sec);
            let at = s.layer_offset(l, f);
            encode_layer(&s, f, k, v, &mut self.scratch[at..at + lb])
                .map_err(|source| KvError::Codec { index, source })?;
        }
        // A chunk sealed past the window keeps its global layers alone, unless a recompute
        // still needs the others (`whole`).
        let keep = if whole && self.is_cut(index) {
            self.whole.push(index);
            s.chunk_bytes(f)
        } else {
            self.shape_of(index).chunk_bytes(f)
        };
        self.mem.put(index, &self.scratch[..keep])
    }

    fn check_sealed(&self, index: usize) -> Result<KvFormat, KvError> {
        self.formats.get(index).copied().ok_or(KvError::NotSealed {
            index,
            sealed: self.formats.len(),
        })
    }

    /// Moves sealed chunk `index` down to format `to` (int8 to int4 or int2, say), in place.
    /// Moving up is refused: the lost bits can only come back by recompute.
    pub fn recompress(&mut self, index: usize, to: KvFormat) -> Result<(), KvError> {
        self.recompress_many(&[(index, to)])
    }

    /// Moves each `(chunk, format)` of `moves` down to its format, as [`KvCache::recompress`]
    /// does one, encoding the chunks in parallel on the thread pool, a batch at a time (the new
    /// bytes of one batch held at once, 32 chunks at most), then storing them in order.
    /// On an error the chunks before the failing one have moved, the others not.
    pub fn recompress_many(&mut self, moves: &[(usize, KvFormat)]) -> Result<(), KvError> {
        use rayon::prelude::*;
        const BATCH: usize = 32;
        for batch in moves.chunks(BATCH) {
            let encoded: Vec<Result<Vec<u8>, KvError>> = batch
                .par_iter()
                .map(|&(index, to)| {
                    let from = self.check_sealed(index)?;
                    if index < self.shared.len() {
                        return Err(KvError::Shared { index });
                    }
                    let codec = |source| KvError::Codec { index, source };
                    if !crate::kv::codec::moves_down(&self.shape, from, to) {
                        return Err(codec(CodecError::NotDown { from, to }));
                    }
                    let bytes = self.mem.get(index).ok_or(KvError::NotResident { index })?;
                    let mut out = Vec::new();
                    let shape = self.shape_of(index);
                    crate::kv::codec::recompress(&shape, from, to, bytes, &mut out)
                        .map_err(codec)?;
                    Ok(out)
                })
                .collect();
            for (&(index, to), bytes) in batch.iter().zip(encoded) {
                self.mem.put(index, &bytes?)?;
                self.formats[index] = to;
            }
        }
        Ok(())
    }

    /// Drops sealed chunk `index` from memory; its format and tokens are kept for recompute.
    pub fn reclaim(&mut self, index: usize) -> Result<(), KvError> {
        self.check_sealed(index)?;
        self.mem.reclaim(index)
    }

    /// Puts back sealed chunk `index`'s encoded bytes (read from storage), in format `f`: all its
    /// layers, or its global layers alone when it is past the window (a whole copy of such a
    /// chunk is cut to them).
    pub fn restore(&mut self, index: usize, f: KvFormat, bytes: &[u8]) -> Result<(), KvError> {
        self.check_sealed(index)?;
        let keep = self.shape_of(index).chunk_bytes(f);
        let Some(bytes) = bytes.get(..keep) else {
            return Err(KvError::Store {
                index,
                reason: format!("{} bytes for a {keep}-byte {f} chunk", bytes.len()),
            });
        };
        self.mem.put(index, bytes)?;
        self.formats[index] = f;
        Ok(())
    }

    /// Starts recomputing sealed chunks `chunks` in one pass: until
    /// [`KvCache::finish_recompute`], writes to their positions go to f32 stagings that
    /// attention reads as open chunks, and attention received is not recorded (the original
    /// pass recorded it).
    pub fn begin_recompute(&mut self, chunks: &[usize]) -> Result<(), KvError> {
        // Chunks this pass rebuilds, or an earlier pass of the same recompute rebuilt whole.
        let mut covered = vec![false; self.formats.len()];
        for &c in chunks.iter().chain(&self.whole) {
            if let Some(x) = covered.get_mut(c) {
                *x = true;
            }
        }
        for &index in chunks {
            self.check_sealed(index)?;
            // Past the window, a chunk comes back exactly only with its whole lookback.
            if let Err(e) = self.recomputable(index)
                && !self.recompute_closure(index).all(|c| covered[c])
            {
                return Err(e);
            }
        }
        self.fresh.clear();
        self.staged = chunks
            .iter()
            .map(|&index| (index, Staging::empty(&self.shape)))
            .collect();
        Ok(())
    }

    /// Seals every chunk being recomputed into its slot, in its recorded format (the bytes the
    /// pass encoded layer by layer, or encoded now).
    pub fn finish_recompute(&mut self) -> Result<(), KvError> {
        let staged = std::mem::take(&mut self.staged);
        let mut result = Ok(());
        for (index, buf) in &staged {
            let f = self.formats[*index];
            let put = match self.take_fresh(*index) {
                Some(fr) if fr.complete() && fr.format == f => {
                    // A chunk past the window stays whole until the whole recompute is over.
                    if self.is_cut(*index) {
                        self.whole.push(*index);
                    }
                    self.mem.put(*index, &fr.bytes)
                }
                _ => self.seal(*index, buf, f, true),
            };
            if let Err(e) = put {
                result = Err(e);
                break;
            }
        }
        self.fresh.clear();
        result
    }

    /// Abandons a recompute in progress; its chunks stay missing.
    pub fn abort_recompute(&mut self) {
        self.staged.clear();
        self.fresh.clear();
    }

    /// Number of chunks touched by keys `0..upto` (sealed or open).
    pub fn chunks_upto(&self, upto: usize) -> usize {
        upto.div_ceil(self.shape.tokens)
    }

    /// Layer `layer` of chunk `c`: encoded bytes of a sealed chunk, or the f32 staging of an
    /// open or recomputing one.
    pub fn layer_view<'a>(&'a self, layer: usize, c: usize) -> Result<LayerView<'a>, KvError> {
        let s = &self.shape;
        let open = |buf: &'a Staging| -> Result<LayerView<'a>, KvError> {
            buf.layer(layer)
                .map(LayerView::Open)
                .ok_or(KvError::Unwritten { index: c, layer })
        };
        if let Some((_, buf)) = self.staged.iter().find(|(i, _)| *i == c) {
            return open(buf);
        }
        if c < self.formats.len() {
            self.check_kept(layer, c)?;
            let f = self.formats[c];
            let bytes = self.mem.get(c).ok_or(KvError::NotResident { index: c })?;
            let (lb, at) = (s.layer_bytes(f), s.layer_offset(layer, f));
            Ok(LayerView::Sealed(f, &bytes[at..at + lb]))
        } else {
            open(&self.open[c - self.formats.len()])
        }
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
        match self.layer_view(layer, c)? {
            LayerView::Sealed(f, bytes) => {
                decode_k(s, f, bytes, h, k);
                decode_v(s, f, bytes, h, v);
                Ok((k, v))
            }
            LayerView::Open(buf) => {
                let (ko, vo) = (h * s.block(), (s.n_kv_heads + h) * s.block());
                Ok((&buf[ko..ko + s.block()], &buf[vo..vo + s.block()]))
            }
        }
    }

    /// Whether attention received is being recorded (not during a recompute).
    pub fn recording(&self) -> bool {
        self.staged.is_empty()
    }

    /// Adds attention received at `layer` by keys `0..col.len()`.
    pub fn add_attention(&mut self, layer: usize, col: &[f32]) {
        self.add_attention_from(layer, 0, col);
    }

    /// Adds attention received at `layer` by keys `from..from + col.len()`.
    pub fn add_attention_from(&mut self, layer: usize, from: usize, col: &[f32]) {
        if self.recording() {
            self.attn.add(layer, from, col);
        }
    }

    /// Adds to the number of query rows of `layer` that saw each key `0..seen.len()`.
    pub fn add_rows(&mut self, layer: usize, seen: &[u32]) {
        if self.recording() {
            self.attn.add_rows(layer, seen);
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
            ..ChunkShape::DENSE
        }
    }

    /// A cache of `n` tokens whose K/V rows are a simple function of (layer, position).
    fn filled(format: KvFormat, n: usize) -> KvCache {
        let s = shape();
        let mut c = KvCache::new(s, format, 64, Box::new(HeapChunks::default()));
        c.reserve(n).unwrap();
        for p in 0..n {
            for l in 0..s.n_layers {
                c.write(l, p, &row(l, p), &row(l, p));
            }
        }
        let tokens: Vec<u32> = (0..n as u32).map(|t| t * 10).collect();
        c.commit(&tokens).unwrap();
        c
    }

    /// The K (and V) row of layer `l` at position `p` in the test caches.
    fn row(l: usize, p: usize) -> Vec<f32> {
        let s = shape();
        (0..s.n_kv_heads * s.head_dim)
            .map(|i| ((i * 7 + p * 3 + l) % 11) as f32 - 5.0)
            .collect()
    }

    /// A batched pass's chunks give up their f32 layer by layer once sealed, and are sealed
    /// into the same bytes; an open chunk holding earlier tokens keeps its f32 whole.
    #[test]
    fn a_batched_pass_frees_each_sealed_layer_and_seals_the_same_bytes() {
        let s = shape();
        let whole = filled(KvFormat::Int8, 14);
        let mut c = KvCache::new(s, KvFormat::Int8, 64, Box::new(HeapChunks::default()));
        // Tokens 0..2 from an earlier call: chunk 0 holds them.
        c.reserve(2).unwrap();
        for p in 0..2 {
            for l in 0..s.n_layers {
                c.write(l, p, &row(l, p), &row(l, p));
            }
        }
        c.commit(&[0, 10]).unwrap();
        // A pass over 2..14 completes chunks 0, 1 and 2 and leaves chunk 3 open.
        c.reserve(12).unwrap();
        let layer_bytes = 2 * s.section() * 4;
        for l in 0..s.n_layers {
            for p in 2..14 {
                c.write(l, p, &row(l, p), &row(l, p));
            }
            for chunk in 0..3 {
                c.seal_layer(l, chunk).unwrap();
                c.release_layer(l, chunk);
            }
            // Chunk 0 keeps every layer, chunks 1 and 2 none (each layer is allocated when
            // written and freed once sealed), the open chunk 3 the layers written so far.
            let held = s.n_layers + (l + 1);
            assert_eq!(c.resident_bytes(), held * layer_bytes, "after layer {l}");
            assert!(c.f32_layer(l, 1).is_none() && c.f32_layer(l, 0).is_some());
        }
        let tokens: Vec<u32> = (2..14u32).map(|t| t * 10).collect();
        c.commit(&tokens).unwrap();
        assert_eq!(c.chunk_formats().len(), 3);
        for i in 0..3 {
            assert_eq!(c.chunk_bytes(i), whole.chunk_bytes(i), "chunk {i}");
        }
        // The open chunk 3 reads as it was written.
        assert_eq!(c.f32_layer(1, 3), whole.f32_layer(1, 3));
    }

    #[test]
    fn open_chunks_seal_when_full_and_tokens_are_kept() {
        let s = shape();
        let c = filled(KvFormat::F16, 6);
        assert_eq!(c.chunk_formats().len(), 1);
        assert_eq!(c.len(), 6);
        assert_eq!(c.tokens(), &[0, 10, 20, 30, 40, 50]);
        let (mut k, mut v) = (vec![0.0; s.block()], vec![0.0; s.block()]);
        let (kb, _) = c.block(1, 2, 0, &mut k, &mut v).unwrap();
        let want: Vec<f32> = (16..24).map(|i| ((i * 7 + 1) % 11) as f32 - 5.0).collect();
        assert_eq!(&kb[..s.head_dim], &want[..]);
        let mut c = c;
        assert!(matches!(c.reserve(59), Err(KvError::Full { .. })));
        assert!(matches!(
            c.commit(&[1, 2]),
            Err(KvError::TokenCount { given: 2, .. })
        ));
    }

    #[test]
    fn chunks_move_down_never_up() {
        let mut c = filled(KvFormat::Int8, 12);
        let before = c.resident_bytes();
        c.recompress(1, KvFormat::Int4).unwrap();
        c.recompress(2, KvFormat::Int2).unwrap();
        c.recompress(1, KvFormat::Int2).unwrap();
        assert_eq!(
            c.chunk_formats(),
            &[KvFormat::Int8, KvFormat::Int2, KvFormat::Int2]
        );
        assert!(c.resident_bytes() <= before);
        let err = c.recompress(1, KvFormat::Int8).unwrap_err();
        assert!(matches!(
            err,
            KvError::Codec {
                index: 1,
                source: CodecError::NotDown { .. }
            }
        ));
        assert!(matches!(
            c.recompress(3, KvFormat::Int2),
            Err(KvError::NotSealed {
                index: 3,
                sealed: 3
            })
        ));
    }

    #[test]
    fn reclaimed_chunks_are_missing_until_restored() {
        let s = shape();
        let mut c = filled(KvFormat::Int8, 12);
        let saved = c.chunk_bytes(1).unwrap().to_vec();
        c.reclaim(1).unwrap();
        assert_eq!(c.missing_chunks(), vec![1]);
        let (mut k, mut v) = (vec![0.0; s.block()], vec![0.0; s.block()]);
        assert!(matches!(
            c.block(0, 0, 1, &mut k, &mut v),
            Err(KvError::NotResident { index: 1 })
        ));
        c.restore(1, KvFormat::Int8, &saved).unwrap();
        assert!(c.missing_chunks().is_empty());
        assert_eq!(c.chunk_bytes(1).unwrap(), &saved[..]);
    }

    #[test]
    fn a_recomputing_chunk_is_read_from_its_staging_and_sealed_in_its_format() {
        let s = shape();
        let mut c = filled(KvFormat::F16, 8);
        let original = c.chunk_bytes(1).unwrap().to_vec();
        c.reclaim(1).unwrap();
        c.begin_recompute(&[1]).unwrap();
        assert!(!c.recording());
        for p in 4..8 {
            for l in 0..s.n_layers {
                let row: Vec<f32> = (0..s.n_kv_heads * s.head_dim)
                    .map(|i| ((i * 7 + p * 3 + l) % 11) as f32 - 5.0)
                    .collect();
                c.write(l, p, &row, &row);
            }
        }
        assert!(matches!(c.layer_view(0, 1).unwrap(), LayerView::Open(_)));
        c.add_attention(0, &[1.0; 8]);
        c.finish_recompute().unwrap();
        assert_eq!(c.chunk_bytes(1).unwrap(), &original[..]);
        assert!(c.attention_received().0.iter().all(|&a| a == 0.0));
    }
}
