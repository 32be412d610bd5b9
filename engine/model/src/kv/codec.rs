//! KV chunk formats and their codecs: f16, int8, the bit-packed int4 and int2, and the formats
//! with 8-bit coded parameters k8v8, k4v4 and k4v3, with the byte size of every part of a chunk
//! as a pure function of its shape.
//!
//! One layer of a chunk is its K section then its V section. Each section is the quantized
//! values `[kv_head][token][dim]` (sub-byte values packed low bits first, as one bit stream along
//! `dim`) followed by the section's parameters:
//! - f16: no parameters.
//! - int8: symmetric; keys one f32 scale per (head, channel) over the chunk's tokens, values one
//!   f32 scale per (head, token) over the head's channels.
//! - int4, int2: asymmetric (KIVI); keys one (min, scale) f16 pair per (head, channel), values
//!   one pair per (head, token). `min` is rounded down and `scale` up to f16, so every input lies
//!   in `[min, min + (2^bits - 1) scale]` and the error is at most `scale / 2`.
//! - k8v8, k4v4, k4v3 (key bits, value bits): asymmetric, grouped as int4, but each group's
//!   parameters are two bytes against one f16 `amax` per (head, section), the head's largest
//!   magnitude rounded up: the minimum an i8 multiple of `step = amax / 127` (rounded down, so
//!   `min <= lo`), the scale a u8 code `j` for `amax 2^(-j/8)` (the smallest code not below
//!   `(hi - min) / (2^bits - 1)`). A section's parameters are the `[head][group]` (min, code)
//!   pairs, then the heads' f16 `amax`.
//!
//! Error bounds, for a value `x` of a group (channel or token) with extremes `lo..=hi`:
//! f16 `|x| / 1024`; int8 `max(|lo|, |hi|) / 254`; int4/int2 `scale / 2` with
//! `scale <= (hi - lo) / (2^bits - 1) * (1 + 2^-10) + ulp_f16(lo)`; coded formats `scale / 2`
//! with `scale <= max((hi - lo + step) / (2^bits - 1) * 2^(1/8), amax 2^(-31.875))`.
//! docs/kv-formats.md has the measured errors on the real model.

use half::f16;

use super::bits::{group_extremes, max_abs, pack, pack_run, unpack};
use crate::kernels::{decode_coded_params, decode_codes};
use crate::qmatrix::f16_bytes_to_f32;

/// What went wrong encoding a chunk.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CodecError {
    /// An unknown format name.
    #[error("unknown KV format {name:?}: expected one of f16, int8, int4, int2, k8v8, k4v4, k4v3")]
    UnknownFormat { name: String },
    /// A value is NaN or infinite.
    #[error("{section} value {index} of the layer is not finite ({value})")]
    NonFinite {
        section: &'static str,
        index: usize,
        value: f32,
    },
    /// A value (or a group's range) does not fit the format's f16 parameters.
    #[error("{section} group {group} spans {lo}..{hi}, beyond what {format} can represent")]
    OutOfRange {
        section: &'static str,
        group: usize,
        lo: f32,
        hi: f32,
        format: KvFormat,
    },
    /// The head dimension cannot be bit-packed in the format.
    #[error("head dimension {head_dim} is not a multiple of {multiple}, which {format} needs")]
    HeadDim {
        head_dim: usize,
        multiple: usize,
        format: KvFormat,
    },
    /// The value group does not divide the head, or its rows cannot start on a byte.
    #[error(
        "value groups of {group} channels must divide the head's {head_dim} and be a multiple of {multiple}, which {format} needs"
    )]
    ValueGroup {
        group: usize,
        head_dim: usize,
        multiple: usize,
        format: KvFormat,
    },
    /// A chunk cannot move to a format of equal or more bits.
    #[error("a chunk in {from} cannot move to {to}: formats only move down")]
    NotDown { from: KvFormat, to: KvFormat },
}

/// How a sealed chunk's K and V values are stored: kvfs's format label, the one type every crate
/// names formats by; its byte layouts are this module's.
pub use kvfs::KvFormat;

/// Bytes of parameters per group (a channel of keys or a token of values).
#[inline]
fn param_bytes(f: KvFormat) -> usize {
    match f {
        KvFormat::F16 => 0,
        KvFormat::Int8 | KvFormat::Int4 | KvFormat::Int2 => 4,
        KvFormat::K8v8 | KvFormat::K4v4 | KvFormat::K4v3 => 2,
    }
}

/// Bytes of parameters per head and section besides its groups' (the coded `amax`).
#[inline]
fn head_param_bytes(f: KvFormat) -> usize {
    if f.coded() { 2 } else { 0 }
}

/// What the head dimension must be a multiple of, for packed rows to start on a byte.
fn head_dim_multiple(f: KvFormat) -> usize {
    if f.value_bits() == 3 { 8 } else { 4 }
}

/// A format's name parsed, with the codec's error.
pub fn parse_format(name: &str) -> Result<KvFormat, CodecError> {
    name.parse()
        .map_err(|_| CodecError::UnknownFormat { name: name.into() })
}

/// Page size chunk slots are rounded to.
pub const PAGE: usize = 4096;

/// The dimensions of one chunk; every size in this module is a pure function of them.
///
/// A model with sliding-window layers (Gemma 3: five of every six) needs their K/V only for
/// the last tokens of a context. A chunk stores its layers global ones first, then the others
/// ([`ChunkShape::slot`]), so once a chunk is past the window its bytes can be cut to their
/// prefix, a chunk of the [`ChunkShape::trimmed`] shape; [`ChunkShape::trimmed_chunks`] says
/// which chunks of a context are past it.
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
    /// The global layers (bit `l`: layer `l`), whose K/V every chunk keeps; all bits set for a
    /// model without a sliding window.
    pub global: u128,
    /// The sliding window of the other layers, in tokens (0: none).
    pub window: usize,
    /// Channels per value group of the coded formats: each token's values of a head are
    /// quantized in groups of this many channels, each with its own minimum and scale (a
    /// divisor of `head_dim`, a multiple of 8; 0: the whole head). Wide heads need narrower
    /// groups: Gemma 3's 256 channels under one scale cost its mix 2% of perplexity.
    pub value_group: usize,
}

impl ChunkShape {
    /// A shape whose layers are all global, for struct updates:
    /// `ChunkShape { n_layers: 2, n_kv_heads: 1, head_dim: 8, tokens: 16, ..ChunkShape::DENSE }`.
    pub const DENSE: ChunkShape = ChunkShape {
        n_layers: 0,
        n_kv_heads: 0,
        head_dim: 0,
        tokens: 0,
        global: u128::MAX,
        window: 0,
        value_group: 0,
    };

    /// Whether layer `l` is global (kept past the window).
    pub fn is_global(&self, l: usize) -> bool {
        self.global >> l & 1 == 1
    }

    /// How many of the layers before `l` are global (a popcount: attention asks for a layer's
    /// place in a chunk on every read).
    fn globals_before(&self, l: usize) -> usize {
        let below = if l >= 128 {
            u128::MAX
        } else {
            (1u128 << l) - 1
        };
        (self.global & below).count_ones() as usize
    }

    /// Global layers.
    pub fn n_global(&self) -> usize {
        self.globals_before(self.n_layers)
    }

    /// Whether some layers have a sliding window (chunks past it can be trimmed).
    pub fn has_window(&self) -> bool {
        self.window > 0 && self.n_global() < self.n_layers
    }

    /// Where layer `l` sits among a chunk's layers: the global layers first, in order, then
    /// the others, in order.
    pub fn slot(&self, l: usize) -> usize {
        let before = self.globals_before(l);
        if self.is_global(l) {
            before
        } else {
            self.n_global() + (l - before)
        }
    }

    /// The shape of a chunk past the window: its global layers alone, a prefix of its bytes.
    pub fn trimmed(&self) -> ChunkShape {
        ChunkShape {
            n_layers: self.n_global(),
            global: u128::MAX,
            window: 0,
            ..*self
        }
    }

    /// Tokens at the end of a context whose chunks keep every layer: two windows, one for the
    /// next query and one for recomputing a chunk of the last window exactly (its own queries
    /// look a window back).
    pub fn kept_tokens(&self) -> usize {
        2 * self.window
    }

    /// How many chunks of a context of `len` tokens are past the window: they keep only their
    /// global layers. A prefix of the chunks; none without a window.
    pub fn trimmed_chunks(&self, len: usize) -> usize {
        if self.has_window() {
            len.saturating_sub(self.kept_tokens()) / self.tokens
        } else {
            0
        }
    }

    /// The shape of chunk `index` of a context of `len` tokens: trimmed past the window, whole
    /// otherwise.
    pub fn of_chunk(&self, index: usize, len: usize) -> ChunkShape {
        if index < self.trimmed_chunks(len) {
            self.trimmed()
        } else {
            *self
        }
    }

    /// Byte offset of layer `l` in a chunk in `f` (see [`ChunkShape::slot`]).
    #[inline]
    pub fn layer_offset(&self, l: usize, f: KvFormat) -> usize {
        self.slot(l) * self.layer_bytes(f)
    }
    /// Values in one head's block of K (or V) of one layer: `tokens * head_dim`.
    #[inline]
    pub fn block(&self) -> usize {
        self.tokens * self.head_dim
    }

    /// Values of K (or V) of one layer: `n_kv_heads * tokens * head_dim`.
    #[inline]
    pub fn section(&self) -> usize {
        self.n_kv_heads * self.block()
    }

    /// Bytes of the packed keys of one section in `f`.
    #[inline]
    pub fn k_values_bytes(&self, f: KvFormat) -> usize {
        self.section() * f.key_bits() as usize / 8
    }

    /// Bytes of the packed values of one V section in `f`.
    #[inline]
    pub fn v_values_bytes(&self, f: KvFormat) -> usize {
        self.section() * f.value_bits() as usize / 8
    }

    /// Bytes of the K section of one layer in `f` (values then parameters).
    #[inline]
    pub fn k_bytes(&self, f: KvFormat) -> usize {
        self.k_values_bytes(f)
            + self.n_kv_heads * (self.head_dim * param_bytes(f) + head_param_bytes(f))
    }

    /// Bytes of the V section of one layer in `f`.
    #[inline]
    pub fn v_bytes(&self, f: KvFormat) -> usize {
        self.v_values_bytes(f)
            + self.n_kv_heads * (self.value_groups(f) * param_bytes(f) + head_param_bytes(f))
    }

    /// Channels of one group of values in `f` (one minimum and scale each): the
    /// [`ChunkShape::value_group`] in the coded formats, else the whole head.
    #[inline]
    pub fn value_width(&self, f: KvFormat) -> usize {
        if f.coded() && self.value_group > 0 {
            self.value_group
        } else {
            self.head_dim
        }
    }

    /// Groups of values of one head in one layer of a chunk in `f`: its tokens times the
    /// groups of each token.
    #[inline]
    pub fn value_groups(&self, f: KvFormat) -> usize {
        self.block() / self.value_width(f)
    }

    /// Bytes of one layer of a chunk in `f`.
    #[inline]
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

    /// K and V values of one chunk, all layers: `n_layers * 2 * section`.
    pub fn chunk_values(&self) -> usize {
        self.n_layers * 2 * self.section()
    }

    /// Bytes of a chunk's file in kvfs when its payload is stored raw: the header and the
    /// chunk's bytes. A zstd payload is kept only when it is smaller, so this is the most a
    /// chunk's file takes.
    pub fn stored_bytes(&self, f: KvFormat) -> usize {
        kvfs::format::HEADER_LEN + self.chunk_bytes(f)
    }

    /// All-in stored bits per K/V value of a chunk in `f`: payload, scales, minimums and the
    /// kvfs header amortized over the chunk ([`ChunkShape::stored_bytes`]).
    pub fn stored_bits(&self, f: KvFormat) -> f64 {
        self.stored_bytes(f) as f64 * 8.0 / self.chunk_values() as f64
    }
}

fn check_finite(section: &'static str, xs: &[f32]) -> Result<(), CodecError> {
    match xs.iter().position(|x| !x.is_finite()) {
        Some(index) => Err(CodecError::NonFinite {
            section,
            index,
            value: xs[index],
        }),
        None => Ok(()),
    }
}

/// The largest f16 not above `x`.
fn f16_floor(x: f32) -> f16 {
    let h = f16::from_f32(x);
    if h.to_f32() <= x {
        h
    } else if h.to_bits() & 0x7fff == 0 {
        f16::from_bits(0x8001)
    } else if h.to_bits() & 0x8000 == 0 {
        f16::from_bits(h.to_bits() - 1)
    } else {
        f16::from_bits(h.to_bits() + 1)
    }
}

/// The smallest f16 not below `x >= 0`.
fn f16_ceil(x: f32) -> f16 {
    let h = f16::from_f32(x);
    if h.to_f32() >= x {
        h
    } else {
        f16::from_bits(h.to_bits() + 1)
    }
}

/// The asymmetric parameters of a group with extremes `lo..=hi` at `levels` steps.
fn asym_params(lo: f32, hi: f32, levels: f32) -> Option<(f16, f16)> {
    let min = f16_floor(lo);
    let scale = f16_ceil((hi - min.to_f32()) / levels);
    (min.is_finite() && scale.is_finite()).then_some((min, scale))
}

fn quant_asym(x: f32, min: f32, inv: f32, levels: f32) -> u8 {
    // `round().clamp(0, levels)` without `round`, which x86-64's baseline (no SSE4.1 `roundss`)
    // calls into libm for: half-way cases round up, as `round` rounds them away from zero, and
    // adding 0.5 is exact for every value below 2^22.
    ((x - min) * inv + 0.5).clamp(0.0, levels) as u8
}

/// `y.round() as i32` for `|y| < 2^22` (half-way cases away from zero) without libm's `roundf`
/// (see [`quant_asym`]): the sum is exact, and the cast truncates toward zero.
fn round_away(y: f32) -> i32 {
    (y + 0.5f32.copysign(y)) as i32
}

/// `2^(-k/8)` for `k` in `0..8`, the fractional steps of the coded scales.
const SCALE_STEPS: [f32; 8] = [
    1.0,
    0.917_004_04,
    0.840_896_4,
    0.771_105_4,
    0.707_106_77,
    0.648_419_8,
    0.594_603_56,
    0.545_253_9,
];

/// `2^(-j/8)` for every scale code `j`: a step of [`SCALE_STEPS`] times an exact power of two.
const CODED_SCALES: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut j = 0;
    while j < 256 {
        t[j] = SCALE_STEPS[j & 7] * f32::from_bits((127 - (j as u32 >> 3)) << 23);
        j += 1;
    }
    t
};

/// The scale of code `j` against `amax`: `amax 2^(-j/8)`, computed the same way by the encoder
/// and the decoder. One product: `amax` times the table's exact `step · 2^-k` rounds as
/// `(amax · step) · 2^-k` did, since a power of two scales without rounding in f32's normal
/// range, where every scale of an f16 `amax` lies.
fn coded_scale(amax: f32, j: u8) -> f32 {
    amax * CODED_SCALES[usize::from(j)]
}

/// The step of the coded minimums against `amax`.
fn coded_step(amax: f32) -> f32 {
    amax / 127.0
}

/// The coded parameters of a group with extremes `lo..=hi` at `levels` steps under `amax`
/// (`|lo|, |hi| <= amax`): the minimum code (`min = code * step <= lo`) and the scale code (the
/// smallest scale not below `(hi - min) / levels`).
fn coded_params(lo: f32, hi: f32, amax: f32, levels: f32) -> Option<(i8, u8)> {
    if amax == 0.0 {
        return Some((0, 255));
    }
    let step = coded_step(amax);
    let mut m = (lo / step).floor().clamp(-128.0, 127.0) as i32;
    while m > -128 && m as f32 * step > lo {
        m -= 1;
    }
    let need = (hi - m as f32 * step) / levels;
    if coded_scale(amax, 0) < need {
        return None;
    }
    let mut j: u8 = if need > 0.0 {
        (-8.0 * (need / amax).log2()).floor().clamp(0.0, 255.0) as u8
    } else {
        255
    };
    while j > 0 && coded_scale(amax, j) < need {
        j -= 1;
    }
    while j < 255 && coded_scale(amax, j + 1) >= need {
        j += 1;
    }
    Some((m as i8, j))
}

/// Encodes one section of a coded format: `xs` is `[head][token][dim]`, quantized in groups of
/// one channel over the tokens (keys) or one token over the channels (values), into `q` (the
/// packed values, zeroed here) and `params` (pairs, then the heads' `amax`).
///
/// Each head in three passes over contiguous rows, which the compiler vectorizes: the groups'
/// extremes, the codes (into a buffer), then the codes packed. (One group at a time, reading a
/// key channel at a stride of the head's width and packing code by code, took 2.1 ms for a
/// chunk of SmolLM2-135M: the end of a call that sealed a pasted document took a second.)
fn encode_coded(
    shape: &ChunkShape,
    f: KvFormat,
    keys: bool,
    xs: &[f32],
    q: &mut [u8],
    params: &mut [u8],
) -> Result<(), CodecError> {
    let (hd, t) = (shape.head_dim, shape.tokens);
    let section = if keys { "key" } else { "value" };
    let bits = if keys { f.key_bits() } else { f.value_bits() } as usize;
    let levels = ((1u32 << bits) - 1) as f32;
    // Keys: a group per channel over the chunk's rows of `hd`; values: a group per row of
    // `vw` channels, a token's values being `hd / vw` rows.
    let vw = shape.value_width(f);
    let (groups, row) = if keys { (hd, hd) } else { (t * hd / vw, vw) };
    let (pairs, amaxes) = params.split_at_mut(shape.n_kv_heads * groups * 2);
    q.fill(0);
    let (mut lo, mut hi) = (vec![0f32; groups], vec![0f32; groups]);
    let (mut mins, mut invs) = (vec![0f32; groups], vec![0f32; groups]);
    let mut codes = vec![0u8; t * hd];
    for (h, blk) in xs.chunks_exact(t * hd).enumerate() {
        let top = max_abs(blk);
        let amax = f16_ceil(top);
        if !amax.is_finite() {
            return Err(CodecError::OutOfRange {
                section,
                group: h * groups,
                lo: -top,
                hi: top,
                format: f,
            });
        }
        amaxes[2 * h..2 * h + 2].copy_from_slice(&amax.to_le_bytes());
        let amax = amax.to_f32();
        let step = coded_step(amax);
        group_extremes(blk, row, keys, &mut lo, &mut hi);
        for g in 0..groups {
            let group = h * groups + g;
            let (m, j) =
                coded_params(lo[g], hi[g], amax, levels).ok_or(CodecError::OutOfRange {
                    section,
                    group,
                    lo: lo[g],
                    hi: hi[g],
                    format: f,
                })?;
            pairs[2 * group] = m as u8;
            pairs[2 * group + 1] = j;
            let scale = coded_scale(amax, j);
            mins[g] = f32::from(m) * step;
            invs[g] = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        }
        for (i, (xs, out)) in blk
            .chunks_exact(row)
            .zip(codes.chunks_exact_mut(row))
            .enumerate()
        {
            if keys {
                for (((o, &x), &min), &inv) in out.iter_mut().zip(xs).zip(&mins).zip(&invs) {
                    *o = quant_asym(x, min, inv, levels);
                }
            } else {
                let (min, inv) = (mins[i], invs[i]);
                for (o, &x) in out.iter_mut().zip(xs) {
                    *o = quant_asym(x, min, inv, levels);
                }
            }
        }
        pack_run(q, h * t * hd, bits, &codes);
    }
    Ok(())
}

fn le_f32(b: &[u8], i: usize) -> f32 {
    f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
}

fn put_pair(b: &mut [u8], i: usize, min: f16, scale: f16) {
    b[4 * i..4 * i + 2].copy_from_slice(&min.to_le_bytes());
    b[4 * i + 2..4 * i + 4].copy_from_slice(&scale.to_le_bytes());
}

/// Encodes one layer of an open chunk (`k`, `v`: `[kv_head][token][dim]` f32) into `out`
/// (at least [`ChunkShape::layer_bytes`] long). NaN, infinities and values out of the format's
/// range are refused with an error.
pub fn encode_layer(
    shape: &ChunkShape,
    f: KvFormat,
    k: &[f32],
    v: &[f32],
    out: &mut [u8],
) -> Result<(), CodecError> {
    if !shape.head_dim.is_multiple_of(head_dim_multiple(f)) {
        return Err(CodecError::HeadDim {
            head_dim: shape.head_dim,
            multiple: head_dim_multiple(f),
            format: f,
        });
    }
    let vw = shape.value_width(f);
    if !shape.head_dim.is_multiple_of(vw) || !vw.is_multiple_of(head_dim_multiple(f)) {
        return Err(CodecError::ValueGroup {
            group: vw,
            head_dim: shape.head_dim,
            multiple: head_dim_multiple(f),
            format: f,
        });
    }
    let (k, v) = (&k[..shape.section()], &v[..shape.section()]);
    check_finite("key", k)?;
    check_finite("value", v)?;
    let (ko, vo) = out[..shape.layer_bytes(f)].split_at_mut(shape.k_bytes(f));
    let (kvals, vvals) = (shape.k_values_bytes(f), shape.v_values_bytes(f));
    match f {
        KvFormat::F16 => {
            encode_f16(f, "key", k, ko)?;
            encode_f16(f, "value", v, vo)?;
        }
        KvFormat::Int8 => encode_int8(shape, k, v, ko, vo),
        KvFormat::Int4 | KvFormat::Int2 => {
            let (kq, kp) = ko.split_at_mut(kvals);
            encode_asym_keys(shape, f, k, kq, kp)?;
            let (vq, vp) = vo.split_at_mut(vvals);
            encode_asym_values(shape, f, v, vq, vp)?;
        }
        KvFormat::K8v8 | KvFormat::K4v4 | KvFormat::K4v3 => {
            let (kq, kp) = ko.split_at_mut(kvals);
            encode_coded(shape, f, true, k, kq, kp)?;
            let (vq, vp) = vo.split_at_mut(vvals);
            encode_coded(shape, f, false, v, vq, vp)?;
        }
    }
    Ok(())
}

/// A section as f16; a value f16 cannot hold is refused.
fn encode_f16(
    f: KvFormat,
    section: &'static str,
    xs: &[f32],
    o: &mut [u8],
) -> Result<(), CodecError> {
    for (i, (o, x)) in o.chunks_exact_mut(2).zip(xs).enumerate() {
        let h = f16::from_f32(*x);
        if !h.is_finite() {
            return Err(CodecError::OutOfRange {
                section,
                group: i,
                lo: *x,
                hi: *x,
                format: f,
            });
        }
        o.copy_from_slice(&h.to_le_bytes());
    }
    Ok(())
}

/// int8: keys with one scale per (head, channel) over the chunk's tokens, values with one per
/// (head, token) over the head's channels.
fn encode_int8(shape: &ChunkShape, k: &[f32], v: &[f32], ko: &mut [u8], vo: &mut [u8]) {
    let (d, hd, t) = (shape.section(), shape.head_dim, shape.tokens);
    let (kq, ks) = ko.split_at_mut(d);
    for h in 0..shape.n_kv_heads {
        let blk = &k[h * t * hd..(h + 1) * t * hd];
        for c in 0..hd {
            let amax = (0..t).map(|i| blk[i * hd + c].abs()).fold(0.0f32, f32::max);
            let scale = amax / 127.0;
            let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
            for i in 0..t {
                kq[h * t * hd + i * hd + c] = round_away(blk[i * hd + c] * inv) as i8 as u8;
            }
            let s = (h * hd + c) * 4;
            ks[s..s + 4].copy_from_slice(&scale.to_le_bytes());
        }
    }
    let (vq, vs) = vo.split_at_mut(d);
    for (row, (q, x)) in vq.chunks_exact_mut(hd).zip(v.chunks_exact(hd)).enumerate() {
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let scale = amax / 127.0;
        let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        for (q, x) in q.iter_mut().zip(x) {
            *q = round_away(x * inv) as i8 as u8;
        }
        vs[row * 4..row * 4 + 4].copy_from_slice(&scale.to_le_bytes());
    }
}

/// Int4/Int2 keys: unsigned codes with an f16 minimum and scale per (head, channel).
fn encode_asym_keys(
    shape: &ChunkShape,
    f: KvFormat,
    k: &[f32],
    kq: &mut [u8],
    kp: &mut [u8],
) -> Result<(), CodecError> {
    let (hd, t) = (shape.head_dim, shape.tokens);
    let bits = f.key_bits() as usize;
    let levels = ((1u32 << bits) - 1) as f32;
    kq.fill(0);
    for h in 0..shape.n_kv_heads {
        let blk = &k[h * t * hd..(h + 1) * t * hd];
        for c in 0..hd {
            let col = (0..t).map(|i| blk[i * hd + c]);
            let lo = col.clone().fold(f32::INFINITY, f32::min);
            let hi = col.fold(f32::NEG_INFINITY, f32::max);
            let group = h * hd + c;
            let (min, scale) = asym_params(lo, hi, levels).ok_or(CodecError::OutOfRange {
                section: "key",
                group,
                lo,
                hi,
                format: f,
            })?;
            let (m, s) = (min.to_f32(), scale.to_f32());
            let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
            for i in 0..t {
                let q = quant_asym(blk[i * hd + c], m, inv, levels);
                pack(kq, h * t * hd + i * hd + c, bits, q);
            }
            put_pair(kp, group, min, scale);
        }
    }
    Ok(())
}

/// Int4/Int2 values: unsigned codes with an f16 minimum and scale per (head, token).
fn encode_asym_values(
    shape: &ChunkShape,
    f: KvFormat,
    v: &[f32],
    vq: &mut [u8],
    vp: &mut [u8],
) -> Result<(), CodecError> {
    let hd = shape.head_dim;
    let bits = f.value_bits() as usize;
    let levels = ((1u32 << bits) - 1) as f32;
    vq.fill(0);
    for (row, x) in v.chunks_exact(hd).enumerate() {
        let lo = x.iter().copied().fold(f32::INFINITY, f32::min);
        let hi = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let (min, scale) = asym_params(lo, hi, levels).ok_or(CodecError::OutOfRange {
            section: "value",
            group: row,
            lo,
            hi,
            format: f,
        })?;
        let (m, s) = (min.to_f32(), scale.to_f32());
        let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
        for (c, x) in x.iter().enumerate() {
            pack(vq, row * hd + c, bits, quant_asym(*x, m, inv, levels));
        }
        put_pair(vp, row, min, scale);
    }
    Ok(())
}

/// f16 to f32 with F16C when the CPU has it (chosen at run time); exact either way.
fn decode_f16(src: &[u8], out: &mut [f32]) {
    f16_bytes_to_f32(src, out);
}

/// The `(min, scale)` f16 pairs `first..first + mins.len()` of `params` to f32, converted in bulk.
pub(crate) fn le_pairs(params: &[u8], first: usize, mins: &mut [f32], scales: &mut [f32]) {
    let mut buf = [0f32; 512];
    for (i, (m, s)) in mins.chunks_mut(256).zip(scales.chunks_mut(256)).enumerate() {
        let p0 = first + i * 256;
        let buf = &mut buf[..2 * m.len()];
        decode_f16(&params[4 * p0..4 * (p0 + m.len())], buf);
        for (j, (m, s)) in m.iter_mut().zip(s.iter_mut()).enumerate() {
            (*m, *s) = (buf[2 * j], buf[2 * j + 1]);
        }
    }
}

/// Head `h`'s coded parameters `first..first + mins.len()` of a section (`groups` per head) as
/// f32 minimums and scales.
#[inline]
pub(crate) fn coded_pairs(
    params: &[u8],
    groups: usize,
    n_heads: usize,
    h: usize,
    first: usize,
    mins: &mut [f32],
    scales: &mut [f32],
) {
    let at = n_heads * groups * 2 + 2 * h;
    let amax = f16::from_le_bytes([params[at], params[at + 1]]).to_f32();
    let step = coded_step(amax);
    let pairs = &params[2 * (h * groups + first)..];
    decode_coded_params(pairs, amax, step, &SCALE_STEPS, mins, scales);
}

/// The bytes of head `h`'s key codes and of its value codes in one layer of format `f` (their
/// parameters, at the end of each section, not included): what decode attention reads of a head,
/// a third of the layer on the default model.
#[inline]
pub fn head_codes(shape: &ChunkShape, f: KvFormat, h: usize) -> [std::ops::Range<usize>; 2] {
    let blk = shape.block();
    let bytes = |bits: u32, i: usize| (i * blk * bits as usize).div_ceil(8);
    let (kb, vb) = (f.key_bits(), f.value_bits());
    let v = shape.k_bytes(f);
    [
        bytes(kb, h)..bytes(kb, h + 1),
        v + bytes(vb, h)..v + bytes(vb, h + 1),
    ]
}

/// Head `h`'s keys in one f16 layer as stored (`[token][dim]`, two little-endian bytes per
/// value), for kernels that convert them in registers.
pub fn f16_keys<'a>(shape: &ChunkShape, layer: &'a [u8], h: usize) -> &'a [u8] {
    let blk = shape.block();
    &layer[h * blk * 2..(h + 1) * blk * 2]
}

/// Head `h`'s values in one f16 layer as stored, as [`f16_keys`].
pub fn f16_values<'a>(shape: &ChunkShape, layer: &'a [u8], h: usize) -> &'a [u8] {
    let blk = shape.block();
    &layer[shape.k_bytes(KvFormat::F16)..][h * blk * 2..(h + 1) * blk * 2]
}

/// Head `h`'s keys in one int8 layer as stored (`[token][dim]` signed bytes), with their
/// per-channel scales written to `scales` (`head_dim` values): key `[i][c]` is
/// `codes[i][c] · scales[c]`, as [`decode_k`] computes it.
pub fn int8_keys<'a>(
    shape: &ChunkShape,
    layer: &'a [u8],
    h: usize,
    scales: &mut [f32],
) -> &'a [u8] {
    let (blk, hd) = (shape.block(), shape.head_dim);
    let vals = shape.k_values_bytes(KvFormat::Int8);
    let sb = &layer[vals + h * hd * 4..vals + (h + 1) * hd * 4];
    for (c, s) in scales[..hd].iter_mut().enumerate() {
        *s = le_f32(sb, c);
    }
    &layer[h * blk..(h + 1) * blk]
}

/// Head `h`'s values in one int8 layer as stored, with their per-token scales written to
/// `scales` (`tokens` values): value `[i][c]` is `codes[i][c] · scales[i]`, as [`decode_v`].
pub fn int8_values<'a>(
    shape: &ChunkShape,
    layer: &'a [u8],
    h: usize,
    scales: &mut [f32],
) -> &'a [u8] {
    let (blk, t) = (shape.block(), shape.tokens);
    let vb = &layer[shape.k_bytes(KvFormat::Int8)..shape.layer_bytes(KvFormat::Int8)];
    let sb = &vb[shape.v_values_bytes(KvFormat::Int8)..];
    for (i, s) in scales[..t].iter_mut().enumerate() {
        *s = le_f32(sb, h * t + i);
    }
    &vb[h * blk..(h + 1) * blk]
}

/// Whether a format stores unsigned codes with a minimum and a scale per group (int4, int2 and
/// the coded formats): the ones [`packed_keys`] and [`packed_values`] read.
fn affine_codes(f: KvFormat) -> bool {
    !matches!(f, KvFormat::F16 | KvFormat::Int8)
}

/// Head `h`'s keys in one layer of an [`affine_codes`] format, as stored: returns the layer's
/// key codes and the packed index of head `h`'s first (`[token][dim]`, `key_bits` each), with
/// the per-channel minimums and scales written to `mins` and `scales` (`head_dim` each): key
/// `[i][c]` is `mins[c] + code[i][c] · scales[c]`, as [`decode_k`] computes it.
#[inline]
pub fn packed_keys<'a>(
    shape: &ChunkShape,
    f: KvFormat,
    layer: &'a [u8],
    h: usize,
    mins: &mut [f32],
    scales: &mut [f32],
) -> (&'a [u8], usize) {
    packed_section(shape, f, layer, h, true, mins, scales)
}

/// Head `h`'s values in one layer of an [`affine_codes`] format whose value groups are whole
/// heads ([`ChunkShape::value_width`] is `head_dim`), as [`packed_keys`]; the parameters are
/// per token (`tokens` each, at most 256): value `[i][c]` is `mins[i] + code[i][c] · scales[i]`.
#[inline]
pub fn packed_values<'a>(
    shape: &ChunkShape,
    f: KvFormat,
    layer: &'a [u8],
    h: usize,
    mins: &mut [f32],
    scales: &mut [f32],
) -> (&'a [u8], usize) {
    packed_section(shape, f, layer, h, false, mins, scales)
}

/// [`packed_keys`] (`keys`, a group per channel) or [`packed_values`] (a group per token).
#[inline]
fn packed_section<'a>(
    shape: &ChunkShape,
    f: KvFormat,
    layer: &'a [u8],
    h: usize,
    keys: bool,
    mins: &mut [f32],
    scales: &mut [f32],
) -> (&'a [u8], usize) {
    debug_assert!(affine_codes(f) && shape.tokens <= 256);
    debug_assert!(
        keys || shape.value_width(f) == shape.head_dim,
        "values in groups"
    );
    let (section, codes, groups) = if keys {
        let k = shape.k_bytes(f);
        (&layer[..k], shape.k_values_bytes(f), shape.head_dim)
    } else {
        let v = shape.k_bytes(f)..shape.layer_bytes(f);
        (&layer[v], shape.v_values_bytes(f), shape.value_groups(f))
    };
    let params = &section[codes..];
    let (m, s) = (&mut mins[..groups], &mut scales[..groups]);
    if f.coded() {
        coded_pairs(params, groups, shape.n_kv_heads, h, 0, m, s);
    } else {
        le_pairs(params, h * groups, m, s);
    }
    (section, h * shape.block())
}

/// Decodes head `h`'s keys from one encoded layer into `out` (`[token][dim]`).
pub fn decode_k(shape: &ChunkShape, f: KvFormat, layer: &[u8], h: usize, out: &mut [f32]) {
    let (blk, hd) = (shape.block(), shape.head_dim);
    let kb = &layer[..shape.k_bytes(f)];
    let vals = shape.k_values_bytes(f);
    let out = &mut out[..blk];
    match f {
        KvFormat::F16 => decode_f16(&kb[h * blk * 2..(h + 1) * blk * 2], out),
        KvFormat::Int8 => {
            let q = &kb[h * blk..(h + 1) * blk];
            let scales = &kb[vals + h * hd * 4..vals + (h + 1) * hd * 4];
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
        KvFormat::Int4 | KvFormat::Int2 | KvFormat::K8v8 | KvFormat::K4v4 | KvFormat::K4v3 => {
            let (mut mins, mut scales) = ([0f32; 256], [0f32; 256]);
            let (codes, first) = packed_keys(shape, f, layer, h, &mut mins, &mut scales);
            let (m, s) = (&mins[..hd], &scales[..hd]);
            decode_codes(codes, first, f.key_bits() as usize, hd, m, s, false, out);
        }
    }
}

/// Decodes head `h`'s values from one encoded layer into `out` (`[token][dim]`).
pub fn decode_v(shape: &ChunkShape, f: KvFormat, layer: &[u8], h: usize, out: &mut [f32]) {
    let (blk, hd, t) = (shape.block(), shape.head_dim, shape.tokens);
    let vb = &layer[shape.k_bytes(f)..shape.layer_bytes(f)];
    let vals = shape.v_values_bytes(f);
    let out = &mut out[..blk];
    match f {
        KvFormat::F16 => decode_f16(&vb[h * blk * 2..(h + 1) * blk * 2], out),
        KvFormat::Int8 => {
            let q = &vb[h * blk..(h + 1) * blk];
            let scales = &vb[vals..];
            for (i, (o, q)) in out.chunks_exact_mut(hd).zip(q.chunks_exact(hd)).enumerate() {
                let s = le_f32(scales, h * t + i);
                for (o, q) in o.iter_mut().zip(q) {
                    *o = *q as i8 as f32 * s;
                }
            }
        }
        KvFormat::Int4 | KvFormat::Int2 | KvFormat::K8v8 | KvFormat::K4v4 | KvFormat::K4v3 => {
            // Rows of one group each: a token's values are `hd / vw` rows of `vw` channels.
            let (bits, vw, groups) = (
                f.value_bits() as usize,
                shape.value_width(f),
                shape.value_groups(f),
            );
            let params = &vb[vals..];
            let (mut mins, mut scales) = ([0f32; 256], [0f32; 256]);
            for (r0, rows) in out.chunks_mut(256 * vw).enumerate() {
                let n = rows.len() / vw;
                let (m, s) = (&mut mins[..n], &mut scales[..n]);
                if f.coded() {
                    coded_pairs(params, groups, shape.n_kv_heads, h, r0 * 256, m, s);
                } else {
                    le_pairs(params, h * groups + r0 * 256, m, s);
                }
                let first = h * blk + r0 * 256 * vw;
                decode_codes(vb, first, bits, vw, m, s, true, rows);
            }
        }
    }
}

/// Decodes one whole layer back to f32 `k` and `v` (`[kv_head][token][dim]`).
pub fn decode_layer(shape: &ChunkShape, f: KvFormat, layer: &[u8], k: &mut [f32], v: &mut [f32]) {
    let blk = shape.block();
    for h in 0..shape.n_kv_heads {
        decode_k(shape, f, layer, h, &mut k[h * blk..(h + 1) * blk]);
        decode_v(shape, f, layer, h, &mut v[h * blk..(h + 1) * blk]);
    }
}

/// Whether a chunk may move from `from` to `to`: only to a format of fewer bytes (int8 to k8v8,
/// int4 or int2, say), never back up (lost bits come back only by recompute).
pub fn moves_down(shape: &ChunkShape, from: KvFormat, to: KvFormat) -> bool {
    shape.chunk_bytes(to) < shape.chunk_bytes(from)
}

/// Re-encodes a whole chunk from `from` into the lower format `to` (int8 to int4, say).
/// `out` receives [`ChunkShape::chunk_bytes`]`(to)` bytes.
pub fn recompress(
    shape: &ChunkShape,
    from: KvFormat,
    to: KvFormat,
    chunk: &[u8],
    out: &mut Vec<u8>,
) -> Result<(), CodecError> {
    if !moves_down(shape, from, to) {
        return Err(CodecError::NotDown { from, to });
    }
    let (lf, lt) = (shape.layer_bytes(from), shape.layer_bytes(to));
    out.clear();
    out.resize(shape.chunk_bytes(to), 0);
    let (mut k, mut v) = (vec![0.0; shape.section()], vec![0.0; shape.section()]);
    for l in 0..shape.n_layers {
        decode_layer(shape, from, &chunk[l * lf..(l + 1) * lf], &mut k, &mut v);
        encode_layer(shape, to, &k, &v, &mut out[l * lt..(l + 1) * lt])?;
    }
    Ok(())
}

/// The `i`-th packed sub-byte value of a section (tests and tools inspect packing with it).
pub fn packed_value(values: &[u8], i: usize, bits: u32) -> u8 {
    unpack(values, i, bits as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use strum::VariantArray;

    fn le_pair(b: &[u8], i: usize) -> (f32, f32) {
        let min = f16::from_le_bytes([b[4 * i], b[4 * i + 1]]).to_f32();
        let scale = f16::from_le_bytes([b[4 * i + 2], b[4 * i + 3]]).to_f32();
        (min, scale)
    }

    /// One layer of the default model's shape: 3 KV heads of 64, 16 tokens.
    fn one_layer_of_three_heads() -> ChunkShape {
        ChunkShape {
            n_layers: 1,
            n_kv_heads: 3,
            head_dim: 64,
            tokens: 16,
            ..ChunkShape::DENSE
        }
    }

    /// [`head_codes`] names the bytes the readers of a head's codes read, in every format.
    #[test]
    fn head_codes_are_the_bytes_the_readers_take() {
        let s = one_layer_of_three_heads();
        let (mut mins, mut scales) = ([0f32; 256], [0f32; 256]);
        for &f in KvFormat::VARIANTS {
            let layer = vec![0u8; s.layer_bytes(f)];
            let base = layer.as_ptr() as usize;
            let at = |b: &[u8]| b.as_ptr() as usize - base;
            for h in 0..3 {
                let [k, v] = head_codes(&s, f, h);
                let (k0, v0) = match f {
                    KvFormat::F16 => (at(f16_keys(&s, &layer, h)), at(f16_values(&s, &layer, h))),
                    KvFormat::Int8 => (
                        at(int8_keys(&s, &layer, h, &mut scales)),
                        at(int8_values(&s, &layer, h, &mut scales)),
                    ),
                    _ => {
                        let (kc, first) = packed_keys(&s, f, &layer, h, &mut mins, &mut scales);
                        let kb = f.key_bits() as usize;
                        let (vc, vfirst) = packed_values(&s, f, &layer, h, &mut mins, &mut scales);
                        let vb = f.value_bits() as usize;
                        (at(kc) + first * kb / 8, at(vc) + vfirst * vb / 8)
                    }
                };
                assert_eq!((k.start, v.start), (k0, v0), "{f} head {h}");
                assert_eq!(k.len(), s.block() * f.key_bits() as usize / 8, "{f}");
                assert_eq!(v.len(), s.block() * f.value_bits() as usize / 8, "{f}");
                assert!(
                    k.end <= s.k_values_bytes(f) && v.end <= s.layer_bytes(f),
                    "{f}"
                );
            }
        }
    }

    /// The coded encoder one group at a time, code by code: the oracle of [`encode_coded`]'s
    /// passes, which must write the same bytes.
    fn encode_coded_oracle(
        s: &ChunkShape,
        f: KvFormat,
        keys: bool,
        xs: &[f32],
        q: &mut [u8],
        params: &mut [u8],
    ) {
        let (hd, t) = (s.head_dim, s.tokens);
        let bits = if keys { f.key_bits() } else { f.value_bits() } as usize;
        let levels = ((1u32 << bits) - 1) as f32;
        let groups = if keys { hd } else { t };
        let (pairs, amaxes) = params.split_at_mut(s.n_kv_heads * groups * 2);
        q.fill(0);
        for (h, blk) in xs.chunks_exact(t * hd).enumerate() {
            let amax = f16_ceil(blk.iter().fold(0f32, |m, x| m.max(x.abs())));
            amaxes[2 * h..2 * h + 2].copy_from_slice(&amax.to_le_bytes());
            let amax = amax.to_f32();
            for g in 0..groups {
                let (n, stride, first) = if keys { (t, hd, g) } else { (hd, 1, g * hd) };
                let at = |i: usize| first + i * stride;
                let (lo, hi) = (0..n).fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), i| {
                    (lo.min(blk[at(i)]), hi.max(blk[at(i)]))
                });
                let (m, j) = coded_params(lo, hi, amax, levels).unwrap();
                pairs[2 * (h * groups + g)] = m as u8;
                pairs[2 * (h * groups + g) + 1] = j;
                let (min, scale) = (f32::from(m) * coded_step(amax), coded_scale(amax, j));
                let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
                for i in 0..n {
                    let qv = ((blk[at(i)] - min) * inv).round().clamp(0.0, levels) as u8;
                    pack(q, h * t * hd + at(i), bits, qv);
                }
            }
        }
    }

    #[test]
    fn the_coded_encoder_writes_what_one_group_at_a_time_writes() {
        let s = one_layer_of_three_heads();
        let mut x = 12345u32;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x % 20001) as f32 / 1000.0 - 10.0
        };
        for f in [KvFormat::K8v8, KvFormat::K4v4, KvFormat::K4v3] {
            for keys in [true, false] {
                for _ in 0..20 {
                    let xs: Vec<f32> = (0..s.section()).map(|_| next()).collect();
                    let bits = if keys { f.key_bits() } else { f.value_bits() } as usize;
                    let qn = s.section() * bits / 8;
                    let pn = s.n_kv_heads * (if keys { 64 } else { 16 }) * 2 + 2 * s.n_kv_heads;
                    let (mut q1, mut p1) = (vec![0u8; qn], vec![0u8; pn]);
                    let (mut q2, mut p2) = (vec![0u8; qn], vec![0u8; pn]);
                    encode_coded(&s, f, keys, &xs, &mut q1, &mut p1).unwrap();
                    encode_coded_oracle(&s, f, keys, &xs, &mut q2, &mut p2);
                    assert_eq!((q1, p1), (q2, p2), "{f:?} keys {keys}");
                }
            }
        }
    }

    fn shape() -> ChunkShape {
        ChunkShape {
            n_layers: 1,
            n_kv_heads: 2,
            head_dim: 8,
            tokens: 4,
            ..ChunkShape::DENSE
        }
    }

    /// Checks every decoded value of one layer against the format's stated bound.
    fn check_round_trip(s: &ChunkShape, f: KvFormat, k: &[f32], v: &[f32]) {
        let mut buf = vec![0u8; s.layer_bytes(f)];
        encode_layer(s, f, k, v, &mut buf).unwrap();
        let (mut dk, mut dv) = (vec![0.0; s.section()], vec![0.0; s.section()]);
        decode_layer(s, f, &buf, &mut dk, &mut dv);
        let (hd, t) = (s.head_dim, s.tokens);
        // Group extremes: keys by (head, channel), values by (head, token, group of `vw`
        // channels).
        let vw = s.value_width(f);
        let key_group = |i: usize| {
            let (h, c) = (i / (t * hd), i % hd);
            let xs: Vec<f32> = (0..t).map(|j| k[h * t * hd + j * hd + c]).collect();
            (xs, h * hd + c)
        };
        let val_group = |i: usize| (v[i / vw * vw..(i / vw + 1) * vw].to_vec(), i / vw);
        for (section, xs, got, group) in [
            (
                "key",
                k,
                &dk,
                &key_group as &dyn Fn(usize) -> (Vec<f32>, usize),
            ),
            ("value", v, &dv, &val_group),
        ] {
            let (params, bits, groups) = match section {
                "key" => (&buf[s.k_values_bytes(f)..s.k_bytes(f)], f.key_bits(), hd),
                _ => (
                    &buf[s.k_bytes(f) + s.v_values_bytes(f)..],
                    f.value_bits(),
                    s.value_groups(f),
                ),
            };
            let levels = ((1u32 << bits.min(8)) - 1) as f32;
            for (i, (&x, &y)) in xs.iter().zip(got.iter()).enumerate() {
                let (g, gi) = group(i);
                let lo = g.iter().copied().fold(f32::INFINITY, f32::min);
                let hi = g.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let amax = lo.abs().max(hi.abs());
                let head = i / (t * hd);
                let bound = match f {
                    KvFormat::K8v8 | KvFormat::K4v4 | KvFormat::K4v3 => {
                        // The head's amax, stored rounded up to f16.
                        let top = xs[head * t * hd..(head + 1) * t * hd]
                            .iter()
                            .fold(0f32, |m, x| m.max(x.abs()));
                        let at = s.n_kv_heads * groups * 2 + 2 * head;
                        let a = f16::from_le_bytes([params[at], params[at + 1]]).to_f32();
                        assert!(a >= top && a <= top * (1.0 + 1.0 / 1024.0) + 6e-8, "{f}");
                        let step = a / 127.0;
                        let (m, j) = (params[2 * gi] as i8, params[2 * gi + 1]);
                        let (min, scale) = (f32::from(m) * step, coded_scale(a, j));
                        assert!(min <= lo && min >= lo - step * (1.0 + 1e-5) - 1e-30, "{f}");
                        let max_scale = ((hi - lo + step) / levels * 1.090_51 * (1.0 + 1e-5))
                            .max(a * (-31.875f32).exp2() * (1.0 + 1e-5));
                        assert!(
                            scale <= max_scale,
                            "{f} {section}: scale {scale} > {max_scale}"
                        );
                        scale / 2.0 * (1.0 + 1e-5) + a * 1e-6
                    }
                    KvFormat::F16 => x.abs() / 1024.0 + 6e-8,
                    // Half a step, and the f32 rounding of `x / scale` (at most 127 codes times
                    // 2^-24, about amax · 6e-8: a value a hair from a half step, -56.21573 of a
                    // row whose amax is 56.887634, can round to the far code).
                    KvFormat::Int8 => amax / 254.0 * (1.0 + 1e-5) + amax * 1e-6,
                    KvFormat::Int4 | KvFormat::Int2 => {
                        let (_, scale) = le_pair(params, gi);
                        let ulp = lo.abs() / 1024.0 + 6e-8;
                        let max_scale = (hi - lo) / levels * (1.0 + 1.0 / 1024.0) + ulp;
                        assert!(
                            scale <= max_scale,
                            "{f} {section}: scale {scale} > {max_scale}"
                        );
                        scale / 2.0 * (1.0 + 1e-5) + amax * 1e-6
                    }
                };
                assert!(
                    (x - y).abs() <= bound,
                    "{f} {section} {i}: {x} decoded as {y}, bound {bound}"
                );
            }
        }
    }

    fn values(n: usize) -> impl Strategy<Value = Vec<f32>> {
        prop::collection::vec(-60.0f32..60.0, n)
    }

    proptest! {
        #[test]
        fn every_codec_round_trips_within_its_bound(k in values(64), v in values(64)) {
            for &f in KvFormat::VARIANTS {
                check_round_trip(&shape(), f, &k, &v);
            }
        }

        #[test]
        fn outlier_and_constant_channels_stay_within_bound(
            k in values(64),
            v in values(64),
            outlier in 0usize..8,
            big in prop::sample::select(vec![-3000.0f32, 900.0, 20000.0]),
            constant in -5.0f32..5.0,
        ) {
            let s = shape();
            let (mut k, mut v) = (k, v);
            for i in 0..s.tokens * s.n_kv_heads {
                // One outlier channel and one constant channel in every head's keys.
                k[i * s.head_dim + outlier] = big * (1.0 + i as f32 / 16.0);
                k[i * s.head_dim + (outlier + 1) % 8] = constant;
            }
            // One token of values is constant, another carries an outlier.
            v[..8].fill(constant);
            v[9] = big;
            for &f in KvFormat::VARIANTS {
                check_round_trip(&s, f, &k, &v);
            }
        }

        #[test]
        fn recompress_stays_within_the_sum_of_both_bounds(k in values(64), v in values(64)) {
            let s = shape();
            let mut base = vec![0u8; s.chunk_bytes(KvFormat::Int8)];
            encode_layer(&s, KvFormat::Int8, &k, &v, &mut base).unwrap();
            let (mut k8, mut v8) = (vec![0.0; 64], vec![0.0; 64]);
            decode_layer(&s, KvFormat::Int8, &base, &mut k8, &mut v8);
            for to in [KvFormat::Int4, KvFormat::Int2, KvFormat::K8v8, KvFormat::K4v4, KvFormat::K4v3] {
                let mut out = Vec::new();
                recompress(&s, KvFormat::Int8, to, &base, &mut out).unwrap();
                let mut direct = vec![0u8; s.chunk_bytes(to)];
                encode_layer(&s, to, &k8, &v8, &mut direct).unwrap();
                // Moving down is exactly encoding the int8 chunk's values.
                prop_assert_eq!(&out, &direct);
                check_round_trip(&s, to, &k8, &v8);
            }
            // Down the mix's levels: k8v8 to k4v4 or k4v3 is encoding the k8v8 chunk's values.
            let mut top = Vec::new();
            recompress(&s, KvFormat::Int8, KvFormat::K8v8, &base, &mut top).unwrap();
            let (mut kt, mut vt) = (vec![0.0; 64], vec![0.0; 64]);
            decode_layer(&s, KvFormat::K8v8, &top, &mut kt, &mut vt);
            for to in [KvFormat::K4v4, KvFormat::K4v3] {
                let mut out = Vec::new();
                recompress(&s, KvFormat::K8v8, to, &top, &mut out).unwrap();
                let mut direct = vec![0u8; s.chunk_bytes(to)];
                encode_layer(&s, to, &kt, &vt, &mut direct).unwrap();
                prop_assert_eq!(&out, &direct);
                check_round_trip(&s, to, &kt, &vt);
            }
        }

        #[test]
        fn coded_formats_round_trip_on_the_model_shape(
            k in prop::collection::vec(-8.0f32..8.0, 3 * 16 * 64),
            v in prop::collection::vec(-0.5f32..0.5, 3 * 16 * 64),
            spike in 0usize..3 * 16 * 64,
            big in prop::sample::select(vec![1.0f32, 40.0, -300.0]),
        ) {
            let s = ChunkShape { n_layers: 1, n_kv_heads: 3, head_dim: 64, tokens: 16, ..ChunkShape::DENSE };
            let (mut k, mut v) = (k, v);
            k[spike] = big;
            for f in KvFormat::CODED {
                check_round_trip(&s, f, &k, &v);
            }
            // Values in groups of 16 channels, one group of each token far wider than the rest.
            v[spike] = big;
            let grouped = ChunkShape { value_group: 16, ..s };
            for f in KvFormat::VARIANTS {
                check_round_trip(&grouped, *f, &k, &v);
            }
        }

        #[test]
        fn the_bit_stream_packs_any_width(qs in prop::collection::vec(0u8..=255, 1..64), bits in prop::sample::select(vec![2usize, 3, 4, 8])) {
            let qs: Vec<u8> = qs.iter().map(|q| q & ((1u16 << bits) - 1) as u8).collect();
            let mut out = vec![0u8; (qs.len() * bits).div_ceil(8)];
            for (i, &q) in qs.iter().enumerate() {
                pack(&mut out, i, bits, q);
            }
            for (i, &q) in qs.iter().enumerate() {
                prop_assert_eq!(packed_value(&out, i, bits as u32), q);
            }
        }
    }

    #[test]
    fn every_path_decodes_coded_parameters_as_the_encoder_scales_them() {
        use crate::kernels::decode_coded_params_with;
        use crate::qmatrix::Isa;
        // Every (minimum code, scale code) pair, 65,536 of them, plus a tail past the vectors.
        let pairs: Vec<u8> = (0..65_536 + 7)
            .flat_map(|p: u32| [p as u8, (p >> 8) as u8])
            .collect();
        let n = pairs.len() / 2;
        for bits in [0x3C00u16, 0x0001, 0x1234, 0x7BFF] {
            let amax = f16::from_bits(bits).to_f32();
            let step = coded_step(amax);
            for isa in Isa::all_available() {
                let (mut mins, mut scales) = (vec![f32::NAN; n], vec![f32::NAN; n]);
                decode_coded_params_with(
                    isa,
                    &pairs,
                    amax,
                    step,
                    &SCALE_STEPS,
                    &mut mins,
                    &mut scales,
                );
                for i in 0..n {
                    let (m, j) = (pairs[2 * i], pairs[2 * i + 1]);
                    assert_eq!(
                        mins[i].to_bits(),
                        (f32::from(m as i8) * step).to_bits(),
                        "{isa:?} {amax} min {m}"
                    );
                    assert_eq!(
                        scales[i].to_bits(),
                        coded_scale(amax, j).to_bits(),
                        "{isa:?} {amax} scale {j}"
                    );
                }
            }
        }
    }

    #[test]
    fn coded_scales_from_the_table_equal_the_two_step_product() {
        // Every positive finite f16 `amax` (some 31,000) against every code, bit for bit.
        for bits in (1u16..0x7C00).step_by(3) {
            let amax = f16::from_bits(bits).to_f32();
            for j in 0..=255u8 {
                let two_steps = amax
                    * SCALE_STEPS[usize::from(j & 7)]
                    * f32::from_bits((127 - u32::from(j >> 3)) << 23);
                assert_eq!(
                    coded_scale(amax, j).to_bits(),
                    two_steps.to_bits(),
                    "{amax} {j}"
                );
            }
        }
    }

    #[test]
    fn coded_scales_are_powers_of_two_to_the_eighth() {
        for j in 0..=255u8 {
            let want = (-(f64::from(j)) / 8.0).exp2();
            let got = f64::from(coded_scale(1.0, j));
            assert!((got / want - 1.0).abs() < 1e-6, "{j}: {got} vs {want}");
        }
        // The smallest code not below what a group needs, whatever the group.
        let check = |lo: f32, hi: f32, amax: f32, levels: f32, want: Option<(i8, u8)>| {
            assert_eq!(
                coded_params(lo, hi, amax, levels),
                want,
                "{lo}..{hi} / {amax}"
            );
        };
        check(0.0, 0.0, 0.0, 15.0, Some((0, 255)));
        // -1..1 under amax 1: min -127 steps, scale 2/15 = 2^(-2.907) -> j = 23.
        check(-1.0, 1.0, 1.0, 15.0, Some((-127, 23)));
        check(0.5, 0.5, 1.0, 15.0, Some((63, 95)));
        check(-1.0, 1.0, 1.0, 255.0, Some((-127, 55)));
    }

    /// A value group that does not divide the head, or whose 3-bit rows would not start on a
    /// byte, is refused with its numbers, never encoded.
    #[test]
    fn value_groups_that_do_not_fit_are_refused() {
        let s = ChunkShape {
            n_layers: 1,
            n_kv_heads: 1,
            head_dim: 48,
            tokens: 4,
            ..ChunkShape::DENSE
        };
        let (k, v) = (vec![0.5f32; 4 * 48], vec![0.25f32; 4 * 48]);
        for (group, f) in [(32, KvFormat::K4v4), (12, KvFormat::K4v3)] {
            let bad = ChunkShape {
                value_group: group,
                ..s
            };
            let mut out = vec![0u8; bad.layer_bytes(f)];
            let err = encode_layer(&bad, f, &k, &v, &mut out).unwrap_err();
            assert!(
                matches!(err, CodecError::ValueGroup { group: g, head_dim: 48, .. } if g == group),
                "{f} group {group}: {err}"
            );
        }
        // Groups of 16 fit both; a format without value groups ignores the setting.
        let good = ChunkShape {
            value_group: 16,
            ..s
        };
        for f in [KvFormat::K4v3, KvFormat::Int4] {
            let mut out = vec![0u8; good.layer_bytes(f)];
            encode_layer(&good, f, &k, &v, &mut out).unwrap();
        }
    }

    #[test]
    fn non_finite_values_are_refused() {
        let s = shape();
        for &f in KvFormat::VARIANTS {
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let mut k = vec![1.0; 64];
                let v = vec![1.0; 64];
                k[17] = bad;
                let mut buf = vec![0u8; s.layer_bytes(f)];
                let err = encode_layer(&s, f, &k, &v, &mut buf).unwrap_err();
                assert!(
                    matches!(
                        err,
                        CodecError::NonFinite {
                            section: "key",
                            index: 17,
                            ..
                        }
                    ),
                    "{f}: {err}"
                );
                let err = encode_layer(&s, f, &v, &k, &mut buf).unwrap_err();
                assert!(
                    matches!(
                        err,
                        CodecError::NonFinite {
                            section: "value",
                            index: 17,
                            ..
                        }
                    ),
                    "{f}: {err}"
                );
            }
        }
    }

    #[test]
    fn values_beyond_f16_are_refused_where_f16_stores_them() {
        let s = shape();
        let mut k = vec![1.0; 64];
        k[3] = 1e6;
        let v = vec![0.5; 64];
        let mut buf = vec![0u8; s.layer_bytes(KvFormat::Int8)];
        encode_layer(&s, KvFormat::Int8, &k, &v, &mut buf).unwrap();
        for f in [
            KvFormat::F16,
            KvFormat::Int4,
            KvFormat::Int2,
            KvFormat::K8v8,
            KvFormat::K4v4,
            KvFormat::K4v3,
        ] {
            let mut buf = vec![0u8; s.layer_bytes(f)];
            let err = encode_layer(&s, f, &k, &v, &mut buf).unwrap_err();
            assert!(
                matches!(err, CodecError::OutOfRange { section: "key", .. }),
                "{f}: {err}"
            );
        }
    }

    #[test]
    fn formats_only_move_down() {
        let s = shape();
        let mut out = Vec::new();
        let chunk = vec![0u8; s.chunk_bytes(KvFormat::Int4)];
        for (from, to) in [
            (KvFormat::Int4, KvFormat::Int8),
            (KvFormat::Int4, KvFormat::Int4),
            (KvFormat::K4v4, KvFormat::Int4),
            (KvFormat::K4v3, KvFormat::K4v4),
            (KvFormat::K8v8, KvFormat::Int8),
        ] {
            let err = recompress(&s, from, to, &chunk, &mut out).unwrap_err();
            assert_eq!(err, CodecError::NotDown { from, to });
        }
    }

    #[test]
    fn sizes_are_pure_functions_of_shape() {
        let s = ChunkShape {
            n_layers: 30,
            n_kv_heads: 3,
            head_dim: 64,
            tokens: 16,
            ..ChunkShape::DENSE
        };
        let check = |f: KvFormat, want: usize| assert_eq!(s.chunk_bytes(f), want, "{f}");
        check(KvFormat::F16, 30 * 2 * 3 * 16 * 64 * 2);
        check(
            KvFormat::Int8,
            30 * (2 * 3 * 16 * 64 + 3 * 64 * 4 + 3 * 16 * 4),
        );
        check(KvFormat::Int4, 30 * (3 * 16 * 64 + 3 * 64 * 4 + 3 * 16 * 4));
        check(
            KvFormat::Int2,
            30 * (3 * 16 * 64 / 2 + 3 * 64 * 4 + 3 * 16 * 4),
        );
        // Coded: a 2-byte pair per group and a 2-byte amax per head, in each section.
        check(
            KvFormat::K8v8,
            30 * (2 * 3 * 16 * 64 + 3 * 64 * 2 + 3 * 16 * 2 + 2 * 3 * 2),
        );
        check(
            KvFormat::K4v4,
            30 * (3 * 16 * 64 + 3 * 64 * 2 + 3 * 16 * 2 + 2 * 3 * 2),
        );
        check(
            KvFormat::K4v3,
            30 * (3 * 16 * 64 * 7 / 8 + 3 * 64 * 2 + 3 * 16 * 2 + 2 * 3 * 2),
        );
        // The simulation's all-in bits (docs/kv-formats.md): 8.645, 4.645 and 4.145.
        for (f, bits) in [
            (KvFormat::K8v8, 8.645),
            (KvFormat::K4v4, 4.645),
            (KvFormat::K4v3, 4.145),
        ] {
            assert!(
                (s.stored_bits(f) - bits).abs() < 5e-4,
                "{f}: {}",
                s.stored_bits(f)
            );
        }
        for &f in KvFormat::VARIANTS {
            assert_eq!(s.slot_bytes(f) % PAGE, 0);
            assert!(s.slot_bytes(f) - s.chunk_bytes(f) < PAGE);
        }
        // Values in groups of 32 channels: a pair per token and group in the coded formats
        // (Gemma 3's shape); the other formats keep one per token.
        let g = ChunkShape {
            n_layers: 18,
            n_kv_heads: 1,
            head_dim: 256,
            tokens: 16,
            value_group: 32,
            ..ChunkShape::DENSE
        };
        assert_eq!(
            g.chunk_bytes(KvFormat::K4v3),
            18 * (16 * 256 * 7 / 8 + 256 * 2 + 16 * 8 * 2 + 2 * 2)
        );
        assert_eq!(
            g.chunk_bytes(KvFormat::Int4),
            18 * (16 * 256 + 256 * 4 + 16 * 4)
        );
    }

    #[test]
    fn stored_bits_are_the_bytes_kvfs_stores() {
        use kvfs::store::{NewContext, Store, StoreOptions};
        let s = ChunkShape {
            n_layers: 3,
            n_kv_heads: 3,
            head_dim: 64,
            tokens: 16,
            ..ChunkShape::DENSE
        };
        let dir = tempfile::tempdir().unwrap();
        let mut x = 0x9e37_79b9u32;
        let mut noise = || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x % 2001) as f32 / 100.0 - 10.0
        };
        let (k, v): (Vec<f32>, Vec<f32>) = (0..s.section()).map(|_| (noise(), noise())).unzip();
        // Raw payloads (compression off) take exactly the formula; zstd ones never more.
        for (zstd, min_ratio) in [(false, f64::INFINITY), (true, 1.0)] {
            let root = dir.path().join(format!("store-{zstd}"));
            let store = Store::open(
                &root,
                StoreOptions {
                    min_ratio,
                    ..StoreOptions::default()
                },
            )
            .unwrap();
            let fp = kvfs::Fingerprint([7; kvfs::format::FINGERPRINT_LEN]);
            let id = store
                .create_context(NewContext {
                    owner_uid: 0,
                    app: "codec".into(),
                    fingerprint: fp,
                    chunk_tokens: s.tokens as u32,
                })
                .unwrap();
            store.append_tokens(id, &[1; 16]).unwrap();
            for &f in KvFormat::VARIANTS {
                let lb = s.layer_bytes(f);
                let mut chunk = vec![0u8; s.chunk_bytes(f)];
                for l in 0..s.n_layers {
                    encode_layer(&s, f, &k, &v, &mut chunk[l * lb..(l + 1) * lb]).unwrap();
                }
                let tag: kvfs::KvFormat = f.name().parse().unwrap();
                let stored = store.write_chunk(id, 0, &fp, tag, 0.5, &chunk).unwrap();
                // The chunk's header and its stored payload (in its slot, whose header page and
                // 4 KiB alignment are the layout's, not the format's).
                let on_disk = kvfs::format::HEADER_LEN + stored.stored_len as usize;
                let bits = on_disk as f64 * 8.0 / s.chunk_values() as f64;
                if zstd {
                    assert!(on_disk <= s.stored_bytes(f), "{f}: {on_disk}");
                } else {
                    assert_eq!(on_disk, s.stored_bytes(f), "{f}");
                    assert_eq!(bits, s.stored_bits(f), "{f}");
                }
            }
        }
        // The model's shape: int4 stores 5.25 bits of payload and parameters, plus the header.
        let m = ChunkShape { n_layers: 30, ..s };
        let header = kvfs::format::HEADER_LEN as f64 * 8.0 / m.chunk_values() as f64;
        assert_eq!(m.stored_bits(KvFormat::Int4), 5.25 + header);
    }

    #[test]
    fn sub_byte_values_are_packed_low_bits_first() {
        let s = ChunkShape {
            n_layers: 1,
            n_kv_heads: 1,
            head_dim: 4,
            tokens: 2,
            ..ChunkShape::DENSE
        };
        // Values row 0..3 span exactly the 2-bit levels 0..3.
        let v = [0.0, 1.0, 2.0, 3.0, 0.0, 0.0, 0.0, 0.0];
        let k = [0.0; 8];
        let mut buf = vec![0u8; s.layer_bytes(KvFormat::Int2)];
        encode_layer(&s, KvFormat::Int2, &k, &v, &mut buf).unwrap();
        let vq = &buf[s.k_bytes(KvFormat::Int2)..];
        assert_eq!(vq[0], 0b11_10_01_00);
        for i in 0..4 {
            assert_eq!(packed_value(vq, i, 2), i as u8);
        }
        assert_eq!("int2".parse::<KvFormat>().unwrap(), KvFormat::Int2);
        assert!(matches!(
            parse_format("int3"),
            Err(CodecError::UnknownFormat { .. })
        ));
    }
}
