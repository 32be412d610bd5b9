//! KV chunk formats and their codecs: f16, int8, and the bit-packed int4 and int2, with the byte
//! size of every part of a chunk as a pure function of its shape.
//!
//! One layer of a chunk is its K section then its V section. Each section is the quantized
//! values `[kv_head][token][dim]` (sub-byte values packed low bits first along `dim`) followed
//! by the section's parameters:
//! - f16: no parameters.
//! - int8: symmetric; keys one f32 scale per (head, channel) over the chunk's tokens, values one
//!   f32 scale per (head, token) over the head's channels.
//! - int4, int2: asymmetric (KIVI); keys one (min, scale) f16 pair per (head, channel), values
//!   one pair per (head, token). `min` is rounded down and `scale` up to f16, so every input lies
//!   in `[min, min + (2^bits - 1) scale]` and the error is at most `scale / 2`.
//!
//! Error bounds, for a value `x` of a group (channel or token) with extremes `lo..=hi`:
//! f16 `|x| / 1024`; int8 `max(|lo|, |hi|) / 254`; int4/int2 `scale / 2` with
//! `scale <= (hi - lo) / (2^bits - 1) * (1 + 2^-10) + ulp_f16(lo)`. docs/kv-formats.md has the
//! measured errors on the real model.

use half::f16;
use std::fmt;
use std::str::FromStr;

use crate::model::qmatrix::f16_bytes_to_f32;

/// What went wrong encoding a chunk.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CodecError {
    /// An unknown format name.
    #[error("unknown KV format {name:?}: expected one of f16, int8, int4, int2")]
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
    /// The head dimension cannot be bit-packed.
    #[error("head dimension {head_dim} is not a multiple of 4, which bit-packing needs")]
    HeadDim { head_dim: usize },
    /// A chunk cannot move to a format of equal or more bits.
    #[error("a chunk in {from} cannot move to {to}: formats only move down")]
    NotDown { from: KvFormat, to: KvFormat },
}

/// How a sealed chunk's K and V values are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvFormat {
    /// IEEE half precision: the reference and the uncompressed baseline.
    F16,
    /// 8-bit: the base format; keys per channel, values per token, symmetric, f32 scales.
    Int8,
    /// 4-bit packed: asymmetric, keys per channel, values per token, f16 min and scale.
    Int4,
    /// 2-bit packed: as int4 with four levels.
    Int2,
}

impl KvFormat {
    /// Every format, best fidelity first.
    pub const ALL: [KvFormat; 4] = [
        KvFormat::F16,
        KvFormat::Int8,
        KvFormat::Int4,
        KvFormat::Int2,
    ];

    /// The name used on the command line and in files.
    pub fn name(self) -> &'static str {
        match self {
            KvFormat::F16 => "f16",
            KvFormat::Int8 => "int8",
            KvFormat::Int4 => "int4",
            KvFormat::Int2 => "int2",
        }
    }

    /// Bits per stored value, not counting parameters.
    pub fn bits(self) -> u32 {
        match self {
            KvFormat::F16 => 16,
            KvFormat::Int8 => 8,
            KvFormat::Int4 => 4,
            KvFormat::Int2 => 2,
        }
    }

    /// The format of a policy level's bit width (16, 8, 4 or 2).
    pub fn from_bits(bits: u32) -> Option<KvFormat> {
        KvFormat::ALL.into_iter().find(|f| f.bits() == bits)
    }

    /// Bytes of parameters per group (a channel of keys or a token of values).
    fn param_bytes(self) -> usize {
        match self {
            KvFormat::F16 => 0,
            KvFormat::Int8 | KvFormat::Int4 | KvFormat::Int2 => 4,
        }
    }
}

impl fmt::Display for KvFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for KvFormat {
    type Err = CodecError;
    fn from_str(s: &str) -> Result<Self, CodecError> {
        KvFormat::ALL
            .into_iter()
            .find(|f| f.name() == s)
            .ok_or_else(|| CodecError::UnknownFormat { name: s.into() })
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

    /// Bytes of the packed values of one section in `f`.
    pub fn values_bytes(&self, f: KvFormat) -> usize {
        self.section() * f.bits() as usize / 8
    }

    /// Bytes of the K section of one layer in `f` (values then parameters).
    pub fn k_bytes(&self, f: KvFormat) -> usize {
        self.values_bytes(f) + self.n_kv_heads * self.head_dim * f.param_bytes()
    }

    /// Bytes of the V section of one layer in `f`.
    pub fn v_bytes(&self, f: KvFormat) -> usize {
        self.values_bytes(f) + self.n_kv_heads * self.tokens * f.param_bytes()
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
    ((x - min) * inv).round().clamp(0.0, levels) as u8
}

/// Writes value `q` (`bits` wide) as the `i`-th packed value of `out`.
fn pack(out: &mut [u8], i: usize, bits: usize, q: u8) {
    let per = 8 / bits;
    out[i / per] |= q << ((i % per) * bits);
}

fn unpack(b: &[u8], i: usize, bits: usize) -> u8 {
    let per = 8 / bits;
    (b[i / per] >> ((i % per) * bits)) & ((1u8 << bits) - 1)
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
    if !shape.head_dim.is_multiple_of(4) {
        return Err(CodecError::HeadDim {
            head_dim: shape.head_dim,
        });
    }
    let (k, v) = (&k[..shape.section()], &v[..shape.section()]);
    check_finite("key", k)?;
    check_finite("value", v)?;
    let (ko, vo) = out[..shape.layer_bytes(f)].split_at_mut(shape.k_bytes(f));
    let (d, hd, t) = (shape.section(), shape.head_dim, shape.tokens);
    let vals = shape.values_bytes(f);
    match f {
        KvFormat::F16 => {
            for (section, xs, o) in [("key", k, ko), ("value", v, vo)] {
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
            }
        }
        KvFormat::Int8 => {
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
        KvFormat::Int4 | KvFormat::Int2 => {
            let bits = f.bits() as usize;
            let levels = ((1u32 << bits) - 1) as f32;
            let (kq, kp) = ko.split_at_mut(vals);
            kq.fill(0);
            for h in 0..shape.n_kv_heads {
                let blk = &k[h * t * hd..(h + 1) * t * hd];
                for c in 0..hd {
                    let col = (0..t).map(|i| blk[i * hd + c]);
                    let lo = col.clone().fold(f32::INFINITY, f32::min);
                    let hi = col.fold(f32::NEG_INFINITY, f32::max);
                    let group = h * hd + c;
                    let (min, scale) =
                        asym_params(lo, hi, levels).ok_or(CodecError::OutOfRange {
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
            let (vq, vp) = vo.split_at_mut(vals);
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
        }
    }
    Ok(())
}

/// f16 to f32 with F16C when the CPU has it (chosen at run time); exact either way.
fn decode_f16(src: &[u8], out: &mut [f32]) {
    f16_bytes_to_f32(src, out);
}

/// The `(min, scale)` f16 pairs `first..first + mins.len()` of `params` to f32, converted in bulk.
fn le_pairs(params: &[u8], first: usize, mins: &mut [f32], scales: &mut [f32]) {
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

/// Unpacks one row of `out.len()` sub-byte values starting at packed value `first`.
fn unpack_row(q: &[u8], first: usize, bits: usize, out: &mut [f32]) {
    let per = 8 / bits;
    let bytes = &q[first / per..(first + out.len()).div_ceil(per)];
    let mask = (1u8 << bits) - 1;
    // Rows start on a byte (head_dim is a multiple of 4), so each byte fills `per` outputs.
    for (o, b) in out.chunks_exact_mut(per).zip(bytes) {
        for (j, o) in o.iter_mut().enumerate() {
            *o = ((b >> (j * bits)) & mask) as f32;
        }
    }
}

/// Decodes head `h`'s keys from one encoded layer into `out` (`[token][dim]`).
pub fn decode_k(shape: &ChunkShape, f: KvFormat, layer: &[u8], h: usize, out: &mut [f32]) {
    let (blk, hd) = (shape.block(), shape.head_dim);
    let kb = &layer[..shape.k_bytes(f)];
    let vals = shape.values_bytes(f);
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
        KvFormat::Int4 | KvFormat::Int2 => {
            let bits = f.bits() as usize;
            let params = &kb[vals..];
            let (mut mins, mut scales) = ([0f32; 256], [0f32; 256]);
            le_pairs(params, h * hd, &mut mins[..hd], &mut scales[..hd]);
            for (i, o) in out.chunks_exact_mut(hd).enumerate() {
                unpack_row(kb, h * blk + i * hd, bits, o);
                for c in 0..hd {
                    o[c] = mins[c] + o[c] * scales[c];
                }
            }
        }
    }
}

/// Decodes head `h`'s values from one encoded layer into `out` (`[token][dim]`).
pub fn decode_v(shape: &ChunkShape, f: KvFormat, layer: &[u8], h: usize, out: &mut [f32]) {
    let (blk, hd, t) = (shape.block(), shape.head_dim, shape.tokens);
    let vb = &layer[shape.k_bytes(f)..shape.layer_bytes(f)];
    let vals = shape.values_bytes(f);
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
        KvFormat::Int4 | KvFormat::Int2 => {
            let bits = f.bits() as usize;
            let params = &vb[vals..];
            let (mut mins, mut scales) = ([0f32; 256], [0f32; 256]);
            for (r0, rows) in out.chunks_mut(256 * hd).enumerate() {
                let n = rows.len() / hd;
                le_pairs(params, h * t + r0 * 256, &mut mins[..n], &mut scales[..n]);
                for (i, o) in rows.chunks_exact_mut(hd).enumerate() {
                    unpack_row(vb, h * blk + (r0 * 256 + i) * hd, bits, o);
                    for o in o.iter_mut() {
                        *o = mins[i] + *o * scales[i];
                    }
                }
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

/// Re-encodes a whole chunk from `from` into the lower format `to` (int8 to int4, say).
/// `out` receives [`ChunkShape::chunk_bytes`]`(to)` bytes.
pub fn recompress(
    shape: &ChunkShape,
    from: KvFormat,
    to: KvFormat,
    chunk: &[u8],
    out: &mut Vec<u8>,
) -> Result<(), CodecError> {
    if to.bits() >= from.bits() {
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

    fn le_pair(b: &[u8], i: usize) -> (f32, f32) {
        let min = f16::from_le_bytes([b[4 * i], b[4 * i + 1]]).to_f32();
        let scale = f16::from_le_bytes([b[4 * i + 2], b[4 * i + 3]]).to_f32();
        (min, scale)
    }

    fn shape() -> ChunkShape {
        ChunkShape {
            n_layers: 1,
            n_kv_heads: 2,
            head_dim: 8,
            tokens: 4,
        }
    }

    /// Checks every decoded value of one layer against the format's stated bound.
    fn check_round_trip(s: &ChunkShape, f: KvFormat, k: &[f32], v: &[f32]) {
        let mut buf = vec![0u8; s.layer_bytes(f)];
        encode_layer(s, f, k, v, &mut buf).unwrap();
        let (mut dk, mut dv) = (vec![0.0; s.section()], vec![0.0; s.section()]);
        decode_layer(s, f, &buf, &mut dk, &mut dv);
        let (hd, t) = (s.head_dim, s.tokens);
        // Group extremes: keys by (head, channel), values by (head, token).
        let key_group = |i: usize| {
            let (h, c) = (i / (t * hd), i % hd);
            let xs: Vec<f32> = (0..t).map(|j| k[h * t * hd + j * hd + c]).collect();
            (xs, h * hd + c)
        };
        let val_group = |i: usize| (v[i / hd * hd..(i / hd + 1) * hd].to_vec(), i / hd);
        let levels = ((1u32 << f.bits().min(8)) - 1) as f32;
        for (section, xs, got, group) in [
            (
                "key",
                k,
                &dk,
                &key_group as &dyn Fn(usize) -> (Vec<f32>, usize),
            ),
            ("value", v, &dv, &val_group),
        ] {
            let params = match section {
                "key" => &buf[s.values_bytes(f)..s.k_bytes(f)],
                _ => &buf[s.k_bytes(f) + s.values_bytes(f)..],
            };
            for (i, (&x, &y)) in xs.iter().zip(got.iter()).enumerate() {
                let (g, gi) = group(i);
                let lo = g.iter().copied().fold(f32::INFINITY, f32::min);
                let hi = g.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let amax = lo.abs().max(hi.abs());
                let bound = match f {
                    KvFormat::F16 => x.abs() / 1024.0 + 6e-8,
                    KvFormat::Int8 => amax / 254.0 * (1.0 + 1e-5) + 1e-30,
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
            for f in KvFormat::ALL {
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
            for f in KvFormat::ALL {
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
            for to in [KvFormat::Int4, KvFormat::Int2] {
                let mut out = Vec::new();
                recompress(&s, KvFormat::Int8, to, &base, &mut out).unwrap();
                let mut direct = vec![0u8; s.chunk_bytes(to)];
                encode_layer(&s, to, &k8, &v8, &mut direct).unwrap();
                // Moving down is exactly encoding the int8 chunk's values.
                prop_assert_eq!(&out, &direct);
                check_round_trip(&s, to, &k8, &v8);
            }
        }
    }

    #[test]
    fn non_finite_values_are_refused() {
        let s = shape();
        for f in KvFormat::ALL {
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
        for f in [KvFormat::F16, KvFormat::Int4, KvFormat::Int2] {
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
        for f in KvFormat::ALL {
            assert_eq!(s.slot_bytes(f) % PAGE, 0);
            assert!(s.slot_bytes(f) - s.chunk_bytes(f) < PAGE);
        }
    }

    #[test]
    fn stored_bits_are_the_bytes_kvfs_stores() {
        use kvfs::store::{NewContext, Store, StoreOptions};
        let s = ChunkShape {
            n_layers: 3,
            n_kv_heads: 3,
            head_dim: 64,
            tokens: 16,
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
            for f in KvFormat::ALL {
                let lb = s.layer_bytes(f);
                let mut chunk = vec![0u8; s.chunk_bytes(f)];
                for l in 0..s.n_layers {
                    encode_layer(&s, f, &k, &v, &mut chunk[l * lb..(l + 1) * lb]).unwrap();
                }
                let tag: kvfs::KvFormat = f.name().parse().unwrap();
                store.write_chunk(id, 0, &fp, tag, 0.5, &chunk).unwrap();
                let on_disk = std::fs::metadata(store.chunk_path(id, 0)).unwrap().len() as usize;
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
            "int3".parse::<KvFormat>(),
            Err(CodecError::UnknownFormat { .. })
        ));
    }
}
