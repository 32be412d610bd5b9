//! Weight matrices as the GGUF stores them: the legacy 32-value blocks (Q4_0, Q4_1, Q5_0, Q5_1,
//! Q8_0), the K-quant 256-value super-blocks (Q4_K, Q5_K, Q6_K), or f32.
//!
//! A matrix is held once, in its file's own blocks, never as an f32 copy: Q4_1 and Q8_0 split
//! into scales, minimums and quants (the same bytes as the file; their portable kernels in
//! [`legacy`]), the other formats byte for byte as the file has them ([`blocks`]: layouts,
//! decode and portable kernels). Three operations read a matrix: a row dequantized on lookup
//! (token embeddings), a matrix-vector product with f32 activations dequantized in registers
//! (decode), and a run of rows dequantized into a small f32 tile for a GEMM (batched products,
//! [`crate::forward::Linear`]). Each has a portable path and AVX2+FMA+F16C and AVX-512 paths
//! chosen at run time ([`Isa::best`]); tests force every path the CPU has and check each against
//! the f64 oracle ([`oracle`]). [`quantize`] holds the test quantizer of each format.

pub(crate) mod acts;
pub mod blocks;
mod legacy;
pub mod oracle;
pub mod quantize;

use crate::simd;
use acts::*;
use half::f16;
use legacy::*;
use rayon::prelude::*;
use std::sync::OnceLock;

/// Values per quantization block.
pub const BLOCK: usize = 32;

/// The instruction-set path a kernel runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Plain Rust, any CPU.
    Portable,
    /// x86-64 AVX2, FMA and F16C.
    Avx2,
    /// x86-64 AVX-512 F, BW and VL on top of [`Isa::Avx2`]: the single-token products run
    /// several rows per pass in 512-bit registers; every other kernel takes the AVX2 path.
    Avx512,
}

/// The environment variable that caps the kernels' instruction set at run time, for measuring a
/// smaller CPU's path on a larger one: `portable`, `avx2` (AVX2, FMA and F16C: AMD Zen 3),
/// `avx2-vnni` (that and AVX-VNNI for the int8 products: Intel Alder Lake and later) or
/// `avx512` (no cap). Read once, where [`Isa::best`] and [`crate::int8gemm::Path::best`] are
/// decided; a cap above the CPU's own paths changes nothing.
pub const ISA_ENV: &str = "LLMS_ISA";

/// How far [`ISA_ENV`] lets the kernels go, in increasing order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum IsaCap {
    /// Portable code only.
    Portable,
    /// AVX2, FMA and F16C; int8 products with `vpmaddubsw`/`vpmaddwd`.
    Avx2,
    /// [`IsaCap::Avx2`], and AVX-VNNI (`vpdpbusd` on 256 bits) for the int8 products.
    Avx2Vnni,
    /// Everything the CPU has.
    Avx512,
}

impl IsaCap {
    /// The cap [`ISA_ENV`] sets, read once (no cap when unset; an unknown value is logged and
    /// ignored).
    pub fn get() -> IsaCap {
        static CAP: OnceLock<IsaCap> = OnceLock::new();
        *CAP.get_or_init(|| {
            let v = std::env::var(ISA_ENV).unwrap_or_default();
            IsaCap::parse(&v).unwrap_or_else(|| {
                tracing::warn!(
                    "{ISA_ENV}={v:?} is none of portable, avx2, avx2-vnni, avx512: ignored"
                );
                IsaCap::Avx512
            })
        })
    }

    /// The cap a value of [`ISA_ENV`] names (the empty string: none).
    pub fn parse(v: &str) -> Option<IsaCap> {
        match v.trim().to_ascii_lowercase().as_str() {
            "portable" => Some(IsaCap::Portable),
            "avx2" => Some(IsaCap::Avx2),
            "avx2-vnni" | "avxvnni" | "avx-vnni" => Some(IsaCap::Avx2Vnni),
            "" | "avx512" | "native" => Some(IsaCap::Avx512),
            _ => None,
        }
    }
}

impl Isa {
    /// The best path this CPU supports within [`IsaCap::get`], detected once at run time.
    pub fn best() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| {
            let cap = IsaCap::get();
            if cap >= IsaCap::Avx512 && Isa::Avx512.available() {
                Isa::Avx512
            } else if cap >= IsaCap::Avx2 && Isa::Avx2.available() {
                Isa::Avx2
            } else {
                Isa::Portable
            }
        })
    }

    /// Whether this CPU can run the path: detected once (every kernel call asks).
    pub fn available(self) -> bool {
        static AVAILABLE: OnceLock<[bool; 3]> = OnceLock::new();
        let all = AVAILABLE
            .get_or_init(|| [Isa::Portable, Isa::Avx2, Isa::Avx512].map(|isa| isa.detect()));
        all[self as usize]
    }

    /// Whether this CPU has the path's features, asked of the CPU.
    fn detect(self) -> bool {
        match self {
            Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                    && std::arch::is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                Isa::Avx2.detect()
                    && std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512vl")
            }
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 | Isa::Avx512 => false,
        }
    }

    /// Whether the path may run the AVX2 kernels (every path but the portable one).
    pub fn has_avx2(self) -> bool {
        self != Isa::Portable
    }

    /// Every path this CPU can run, portable first.
    pub fn all_available() -> Vec<Isa> {
        [Isa::Portable, Isa::Avx2, Isa::Avx512]
            .into_iter()
            .filter(|i| i.available())
            .collect()
    }
}

/// How activations enter a matrix-vector product.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Activations {
    /// As f32: the weights are dequantized in registers and multiplied in f32 (the reference).
    #[default]
    F32,
    /// Quantized to 8 bits per 32-value block (f32 scale) and multiplied with the weight blocks
    /// in integers, as llama.cpp does; the minimum terms (Q4_1, the K-quants) take the sums of
    /// the codes, so the product is exactly the one with the dequantized activations.
    Int8,
    /// Quantized to 16 bits per 32-value block, the 8-bit codes and each value's remainder in
    /// 256ths of a step, `x ≈ d (q + lo / 256)`, and multiplied in integers twice over the same
    /// weight bytes (Q4_1 and Q8_0, with AVX-512 VNNI's `vpdpbusd` or AVX2's `vpmaddubsw`): an
    /// error per value at most 1/256 of int8's. f32 for the other formats and on the portable
    /// path.
    Int16,
    /// The fastest activations that keep the default model's answers: int16 for Q4_1 and Q8_0
    /// where the CPU has AVX2 (their f32 kernels are held back by their arithmetic, at about
    /// 0.6-0.7 of the read bandwidth); int8 for the formats read as the file's blocks (K-quants,
    /// Q4_0, Q5_0, Q5_1) where the CPU has AVX2; f32 for the rest.
    Auto,
}

/// How a matrix's values are stored: the GGUF block formats the kernels read as they are, and
/// f32. The names are ggml's.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// 32-value blocks of 4-bit unsigned quants with an f16 scale and an f16 minimum.
    Q4_1,
    /// 32-value blocks of signed bytes with an f16 scale.
    Q8_0,
    /// 32-value blocks of 4-bit quants offset by 8, with an f16 scale ([`blocks`]).
    Q4_0,
    /// 32-value blocks of 5-bit quants offset by 16, with an f16 scale ([`blocks`]).
    Q5_0,
    /// 32-value blocks of 5-bit unsigned quants with an f16 scale and minimum ([`blocks`]).
    Q5_1,
    /// 256-value super-blocks of 4-bit quants, 6-bit scales and mins per 32 ([`blocks`]).
    Q4_K,
    /// 256-value super-blocks of 5-bit quants, 6-bit scales and mins per 32 ([`blocks`]).
    Q5_K,
    /// 256-value super-blocks of 6-bit signed quants, 8-bit scales per 16 ([`blocks`]).
    Q6_K,
    /// Plain f32 (norm vectors, small or oddly shaped matrices).
    F32,
}

impl Kind {
    /// Every block format, with f32 last.
    pub const ALL: [Kind; 9] = [
        Kind::Q4_1,
        Kind::Q8_0,
        Kind::Q4_0,
        Kind::Q5_0,
        Kind::Q5_1,
        Kind::Q4_K,
        Kind::Q5_K,
        Kind::Q6_K,
        Kind::F32,
    ];

    /// Values of one stored unit (a block; 1 for f32).
    pub fn block_values(self) -> usize {
        match self {
            Kind::F32 => 1,
            Kind::Q4_K | Kind::Q5_K | Kind::Q6_K => blocks::SUPER,
            _ => BLOCK,
        }
    }

    /// Bytes of one stored unit in the file (and in memory).
    pub fn block_bytes(self) -> usize {
        match self {
            Kind::Q4_1 => 20,
            Kind::Q8_0 => 34,
            Kind::Q4_0 => 18,
            Kind::Q5_0 => 22,
            Kind::Q5_1 => 24,
            Kind::Q4_K => 144,
            Kind::Q5_K => 176,
            Kind::Q6_K => 210,
            Kind::F32 => 4,
        }
    }

    /// Bytes of `values` values (a multiple of the block).
    pub fn bytes_of(self, values: usize) -> usize {
        values / self.block_values() * self.block_bytes()
    }

    /// The kind of a GGUF tensor type the kernels read as it is, if any.
    pub fn from_ggml(t: candle_core::quantized::GgmlDType) -> Option<Kind> {
        use candle_core::quantized::GgmlDType as G;
        Some(match t {
            G::Q4_1 => Kind::Q4_1,
            G::Q8_0 => Kind::Q8_0,
            G::Q4_0 => Kind::Q4_0,
            G::Q5_0 => Kind::Q5_0,
            G::Q5_1 => Kind::Q5_1,
            G::Q4K => Kind::Q4_K,
            G::Q5K => Kind::Q5_K,
            G::Q6K => Kind::Q6_K,
            G::F32 => Kind::F32,
            _ => return None,
        })
    }

    /// The GGUF tensor type of this kind.
    pub fn ggml(self) -> candle_core::quantized::GgmlDType {
        use candle_core::quantized::GgmlDType as G;
        match self {
            Kind::Q4_1 => G::Q4_1,
            Kind::Q8_0 => G::Q8_0,
            Kind::Q4_0 => G::Q4_0,
            Kind::Q5_0 => G::Q5_0,
            Kind::Q5_1 => G::Q5_1,
            Kind::Q4_K => G::Q4K,
            Kind::Q5_K => G::Q5K,
            Kind::Q6_K => G::Q6K,
            Kind::F32 => G::F32,
        }
    }

    /// Whether the matrix is held as the file's blocks byte for byte ([`blocks`]), rather
    /// than split into scales, minimums and quants (Q4_1, Q8_0) or as f32.
    pub fn is_raw(self) -> bool {
        !matches!(self, Kind::Q4_1 | Kind::Q8_0 | Kind::F32)
    }

    /// Whether a value carries an offset besides its scaled code (`d q + m`).
    pub fn has_mins(self) -> bool {
        matches!(self, Kind::Q4_1 | Kind::Q5_1 | Kind::Q4_K | Kind::Q5_K)
    }
}

/// A weight matrix `[rows][cols]`, structure-of-arrays.
#[derive(Debug, Clone)]
pub struct QMatrix {
    rows: usize,
    cols: usize,
    kind: Kind,
    /// Per block scale.
    d: Vec<f16>,
    /// Per block minimum (Q4_1 only).
    m: Vec<f16>,
    /// Q4_1: 16 bytes per block (low nibbles are values 0..16, high nibbles 16..32).
    /// Q8_0: 32 signed bytes per block. The [`Kind::is_raw`] formats: the file's blocks.
    qs: Vec<u8>,
    /// F32 values.
    f: Vec<f32>,
}

impl QMatrix {
    fn empty(rows: usize, cols: usize, kind: Kind) -> Self {
        Self {
            rows,
            cols,
            kind,
            d: Vec::new(),
            m: Vec::new(),
            qs: Vec::new(),
            f: Vec::new(),
        }
    }

    /// An empty matrix of `rows × cols` in `kind` blocks, to be filled by
    /// [`QMatrix::push_raw`] with the file's bytes.
    pub fn with_capacity(rows: usize, cols: usize, kind: Kind) -> Self {
        assert!(
            cols.is_multiple_of(kind.block_values()),
            "{kind:?} rows of {cols} values are not whole blocks"
        );
        let nb = rows * cols / BLOCK;
        let mut q = Self::empty(rows, cols, kind);
        match kind {
            Kind::Q4_1 => {
                q.d.reserve_exact(nb);
                q.m.reserve_exact(nb);
                q.qs.reserve_exact(nb * 16);
            }
            Kind::Q8_0 => {
                q.d.reserve_exact(nb);
                q.qs.reserve_exact(nb * 32);
            }
            Kind::F32 => q.f.reserve_exact(rows * cols),
            _ => q.qs.reserve_exact(kind.bytes_of(rows * cols)),
        }
        q
    }

    /// Bytes of one stored unit in the file: a block (Q4_1: f16 d, f16 m, 16 bytes of nibbles;
    /// Q8_0: f16 d, 32 signed bytes; the others [`blocks`]) or an f32 value.
    pub fn raw_unit(kind: Kind) -> usize {
        kind.block_bytes()
    }

    /// Appends whole units in the file's layout ([`QMatrix::raw_unit`] bytes each).
    pub fn push_raw(&mut self, raw: &[u8]) {
        let unit = Self::raw_unit(self.kind);
        assert!(raw.len().is_multiple_of(unit), "partial block");
        match self.kind {
            Kind::Q4_1 => {
                for b in raw.chunks_exact(20) {
                    self.d.push(f16::from_le_bytes([b[0], b[1]]));
                    self.m.push(f16::from_le_bytes([b[2], b[3]]));
                    self.qs.extend_from_slice(&b[4..20]);
                }
            }
            Kind::Q8_0 => {
                for b in raw.chunks_exact(34) {
                    self.d.push(f16::from_le_bytes([b[0], b[1]]));
                    self.qs.extend_from_slice(&b[2..34]);
                }
            }
            Kind::F32 => self.f.extend(
                raw.chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            ),
            _ => self.qs.extend_from_slice(raw),
        }
    }

    /// Makes this matrix `rows × cols` of `kind` from the file's units in `parts` (in order),
    /// reusing its buffers: a streamed weight is repacked into a ring buffer this way, with no
    /// allocation once the buffer has held its largest matrix.
    pub fn refill(&mut self, rows: usize, cols: usize, kind: Kind, parts: &[&[u8]]) {
        assert!(kind != Kind::F32, "f32 matrices are never streamed");
        let unit = Self::raw_unit(kind);
        let nb: usize = parts.iter().map(|p| p.len() / unit).sum();
        assert_eq!(
            nb * kind.block_values(),
            rows * cols,
            "refill: {kind:?} data of the wrong size"
        );
        (self.rows, self.cols, self.kind) = (rows, cols, kind);
        self.f.clear();
        if kind.is_raw() {
            // The file's blocks as they are: within the buffer's capacity, no allocation.
            self.d.clear();
            self.m.clear();
            self.qs.clear();
            for p in parts {
                assert!(p.len().is_multiple_of(unit), "partial block");
                self.qs.extend_from_slice(p);
            }
            return;
        }
        let qb = if kind == Kind::Q4_1 { 16 } else { 32 };
        self.d.resize(nb, f16::ZERO);
        self.m
            .resize(if kind == Kind::Q4_1 { nb } else { 0 }, f16::ZERO);
        self.qs.resize(nb * qb, 0);
        // Zipped slices, no indexing: the loop runs at memory speed (it repacks every streamed
        // byte on the I/O thread, in series with the reads).
        let (mut d, mut m, mut qs) = (&mut self.d[..], &mut self.m[..], &mut self.qs[..]);
        for p in parts {
            assert!(p.len().is_multiple_of(unit), "partial block");
            let n = p.len() / unit;
            let (pd, rd) = std::mem::take(&mut d).split_at_mut(n);
            let (pq, rq) = std::mem::take(&mut qs).split_at_mut(n * qb);
            if kind == Kind::Q4_1 {
                let (pm, rm) = std::mem::take(&mut m).split_at_mut(n);
                for (((raw, d), m), q) in p
                    .chunks_exact(20)
                    .zip(pd.iter_mut())
                    .zip(pm.iter_mut())
                    .zip(pq.chunks_exact_mut(16))
                {
                    *d = f16::from_le_bytes([raw[0], raw[1]]);
                    *m = f16::from_le_bytes([raw[2], raw[3]]);
                    q.copy_from_slice(&raw[4..20]);
                }
                m = rm;
            } else {
                for ((raw, d), q) in p
                    .chunks_exact(34)
                    .zip(pd.iter_mut())
                    .zip(pq.chunks_exact_mut(32))
                {
                    *d = f16::from_le_bytes([raw[0], raw[1]]);
                    q.copy_from_slice(&raw[2..34]);
                }
            }
            d = rd;
            qs = rq;
        }
    }

    /// Reserves room for `blocks` scales, `mins` minimums and `quants` quant bytes, so
    /// [`QMatrix::refill`] never allocates for matrices within them.
    pub fn reserve_parts(&mut self, blocks: usize, mins: usize, quants: usize) {
        self.d.reserve_exact(blocks.saturating_sub(self.d.len()));
        self.m.reserve_exact(mins.saturating_sub(self.m.len()));
        self.qs.reserve_exact(quants.saturating_sub(self.qs.len()));
    }

    /// Bytes allocated, whether used or not.
    pub fn capacity_bytes(&self) -> usize {
        self.d.capacity() * 2 + self.m.capacity() * 2 + self.qs.capacity() + self.f.capacity() * 4
    }

    /// Whether every unit has been pushed.
    pub fn is_complete(&self) -> bool {
        match self.kind {
            Kind::F32 => self.f.len() == self.rows * self.cols,
            k if k.is_raw() => self.qs.len() == k.bytes_of(self.rows * self.cols),
            _ => self.d.len() * BLOCK == self.rows * self.cols,
        }
    }

    /// From raw GGUF blocks or f32 values.
    pub fn from_raw(rows: usize, cols: usize, kind: Kind, raw: &[u8]) -> Self {
        let mut q = Self::with_capacity(rows, cols, kind);
        q.push_raw(raw);
        assert!(q.is_complete(), "{kind:?} data of the wrong size");
        q
    }

    /// Plain f32 values.
    pub fn from_f32(rows: usize, cols: usize, w: Vec<f32>) -> Self {
        assert_eq!(w.len(), rows * cols, "f32 data of the wrong size");
        let mut q = Self::empty(rows, cols, Kind::F32);
        q.f = w;
        q
    }

    /// Quantizes f32 weights to `kind` ([`quantize::quantize`]: the simplest correct quantizer
    /// of each format, for tests).
    pub fn quantize(rows: usize, cols: usize, kind: Kind, w: &[f32]) -> Self {
        Self::from_raw(
            rows,
            cols,
            kind,
            &quantize::quantize(kind, &w[..rows * cols]),
        )
    }

    /// The bytes of row `r` of a [`Kind::is_raw`] matrix.
    fn raw_row(&self, r: usize) -> &[u8] {
        let rb = self.kind.bytes_of(self.cols);
        &self.qs[r * rb..(r + 1) * rb]
    }

    /// Quantizes f32 weights to Q8_0 (symmetric, f16 scale per block, as llama.cpp does).
    pub fn quantize_q8_0(rows: usize, cols: usize, w: &[f32]) -> Self {
        let w = &w[..rows * cols];
        let mut q = Self::with_capacity(rows, cols, Kind::Q8_0);
        for b in w.chunks_exact(BLOCK) {
            let amax = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let d = f16::from_f32(amax / 127.0);
            let inv = if d.to_f32() > 0.0 {
                1.0 / d.to_f32()
            } else {
                0.0
            };
            q.d.push(d);
            q.qs.extend(
                b.iter()
                    .map(|v| (v * inv).round().clamp(-127.0, 127.0) as i8 as u8),
            );
        }
        q
    }

    /// Stacks matrices with the same number of columns and kind, rows after rows.
    pub fn stack(parts: Vec<QMatrix>) -> Self {
        let mut it = parts.into_iter();
        let mut out = it.next().expect("stack of no matrices");
        for p in it {
            assert!(
                p.cols == out.cols && p.kind == out.kind,
                "stacking unlike matrices"
            );
            out.rows += p.rows;
            out.d.extend(p.d);
            out.m.extend(p.m);
            out.qs.extend(p.qs);
            out.f.extend(p.f);
        }
        // Growing by extension leaves spare capacity: the memory held is what `bytes` says.
        out.d.shrink_to_fit();
        out.m.shrink_to_fit();
        out.qs.shrink_to_fit();
        out.f.shrink_to_fit();
        out
    }

    /// The blocks' scales, minimums (Q4_1) and codes, in the file's order (for kernels that
    /// repack them, [`crate::int8gemm`]).
    pub(crate) fn raw_parts(&self) -> (&[f16], &[f16], &[u8]) {
        (&self.d, &self.m, &self.qs)
    }

    /// Asks for the bytes of rows `r0..r1` (clamped to the matrix) to be brought into L2
    /// ahead of use ([`simd::prefetch_weights`]): every array the matrix holds is row-major
    /// with the same bytes per row.
    pub(crate) fn prefetch_rows(&self, r0: usize, r1: usize) {
        let (r0, r1) = (r0.min(self.rows), r1.min(self.rows));
        fn ask<T>(v: &[T], rows: usize, (r0, r1): (usize, usize)) {
            let per = std::mem::size_of_val(v) / rows.max(1);
            let p = (v.as_ptr() as *const u8).wrapping_add(r0 * per);
            simd::prefetch_weights(p, (r1 - r0) * per);
        }
        ask(&self.qs, self.rows, (r0, r1));
        ask(&self.d, self.rows, (r0, r1));
        ask(&self.m, self.rows, (r0, r1));
        ask(&self.f, self.rows, (r0, r1));
    }

    /// The value at row `r`, column `c`, dequantized as the portable path does (`d · q + m`).
    pub fn value(&self, r: usize, c: usize) -> f32 {
        assert!(r < self.rows && c < self.cols, "value: out of range");
        let (blk, j) = ((r * self.cols + c) / BLOCK, c % BLOCK);
        match self.kind {
            Kind::F32 => self.f[r * self.cols + c],
            k @ (Kind::Q4_0 | Kind::Q5_0 | Kind::Q5_1 | Kind::Q4_K | Kind::Q5_K | Kind::Q6_K) => {
                blocks::value(k, self.raw_row(r), c)
            }
            Kind::Q4_1 => {
                let byte = self.qs[blk * 16 + j % 16];
                let q = if j < 16 { byte & 0xF } else { byte >> 4 };
                self.d[blk].to_f32() * q as f32 + self.m[blk].to_f32()
            }
            Kind::Q8_0 => self.d[blk].to_f32() * self.qs[blk * 32 + j] as i8 as f32,
        }
    }

    /// How the values are stored.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.d.len() * 2 + self.m.len() * 2 + self.qs.len() + self.f.len() * 4
    }

    /// The address and length in bytes of each buffer the matrix holds (empty ones included).
    pub fn buffers(&self) -> [(usize, usize); 4] {
        [
            (self.d.as_ptr() as usize, self.d.len() * 2),
            (self.m.as_ptr() as usize, self.m.len() * 2),
            (self.qs.as_ptr() as usize, self.qs.len()),
            (self.f.as_ptr() as usize, self.f.len() * 4),
        ]
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The f32 values of an [`Kind::F32`] matrix.
    pub fn as_f32(&self) -> Option<&[f32]> {
        (self.kind == Kind::F32).then_some(&self.f[..])
    }

    /// A wrapping sum of every stored byte, as 64-bit words (reads the whole matrix once).
    pub fn sum_bytes(&self) -> u64 {
        fn words(b: &[u8]) -> u64 {
            let mut acc = [0u64; 4];
            let c = b.chunks_exact(32);
            let tail: u64 = c.remainder().iter().map(|&v| u64::from(v)).sum();
            for w in c {
                for (i, a) in acc.iter_mut().enumerate() {
                    let mut x = [0u8; 8];
                    x.copy_from_slice(&w[i * 8..i * 8 + 8]);
                    *a = a.wrapping_add(u64::from_le_bytes(x));
                }
            }
            acc.iter().fold(tail, |s, &a| s.wrapping_add(a))
        }
        words(&self.qs)
            .wrapping_add(self.d.iter().map(|h| u64::from(h.to_bits())).sum::<u64>())
            .wrapping_add(self.m.iter().map(|h| u64::from(h.to_bits())).sum::<u64>())
            .wrapping_add(self.f.iter().map(|v| u64::from(v.to_bits())).sum::<u64>())
    }

    /// Dequantizes rows `r0..r1` into `out[(r1 - r0) * cols]`.
    pub fn dequant_rows(&self, r0: usize, r1: usize, out: &mut [f32]) {
        self.dequant_rows_with(Isa::best(), r0, r1, out);
    }

    /// [`QMatrix::dequant_rows`] on a given path.
    pub fn dequant_rows_with(&self, isa: Isa, r0: usize, r1: usize, out: &mut [f32]) {
        assert!(
            r0 <= r1 && r1 <= self.rows,
            "dequant_rows: rows out of range"
        );
        let out = &mut out[..(r1 - r0) * self.cols];
        let (b0, b1) = (r0 * self.cols / BLOCK, r1 * self.cols / BLOCK);
        match self.kind {
            Kind::F32 => out.copy_from_slice(&self.f[r0 * self.cols..r1 * self.cols]),
            k @ (Kind::Q4_0 | Kind::Q5_0 | Kind::Q5_1 | Kind::Q4_K | Kind::Q5_K | Kind::Q6_K) => {
                let rb = k.bytes_of(self.cols);
                let raw = &self.qs[r0 * rb..r1 * rb];
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 | Isa::Avx512 => {
                        assert!(isa.available(), "{isa:?} path on a CPU without it");
                        // SAFETY: the CPU has AVX2, FMA and F16C (checked just above); raw
                        // holds the rows' whole blocks and `out` their values.
                        unsafe { simd::blocks::dequant(k, raw, out) }
                    }
                    _ => blocks::dequant_row(k, raw, out),
                }
            }
            Kind::Q4_1 => {
                let (d, m, qs) = (&self.d[b0..b1], &self.m[b0..b1], &self.qs[b0 * 16..b1 * 16]);
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 | Isa::Avx512 => {
                        assert!(isa.available(), "{isa:?} path on a CPU without it");
                        // SAFETY: the CPU has AVX2, FMA and F16C (checked just above); the
                        // slices hold b1 - b0 blocks and `out` their 32 values each.
                        unsafe { simd::avx2::dequant_q4_1(d, m, qs, out) }
                    }
                    _ => dequant_q4_1_portable(d, m, qs, out),
                }
            }
            Kind::Q8_0 => {
                let (d, qs) = (&self.d[b0..b1], &self.qs[b0 * 32..b1 * 32]);
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 | Isa::Avx512 => {
                        assert!(isa.available(), "{isa:?} path on a CPU without it");
                        // SAFETY: as above.
                        unsafe { simd::avx2::dequant_q8_0(d, qs, out) }
                    }
                    _ => dequant_q8_0_portable(d, qs, out),
                }
            }
        }
    }

    /// `out[rows] = self · x`, rows split across the engine's threads.
    pub fn matvec(&self, acts: Activations, x: &[f32], out: &mut [f32]) {
        self.matvec_with(Isa::best(), acts, x, out);
    }

    /// [`QMatrix::matvec`] on a given path.
    pub fn matvec_with(&self, isa: Isa, acts: Activations, x: &[f32], out: &mut [f32]) {
        Self::matvec_parts_with(isa, std::slice::from_ref(self), acts, x, out)
    }

    /// `out = W · x` for a matrix `W` held as row ranges `parts` (the fused query, key and
    /// value products, or gate and up): each part's rows in turn in `out`, split across the
    /// engine's threads as one matrix's rows are, in one parallel loop, with the activations'
    /// sums (and int8 codes) taken once. Each row's value is the one its part's own
    /// [`QMatrix::matvec`] gives.
    pub fn matvec_parts(parts: &[QMatrix], acts: Activations, x: &[f32], out: &mut [f32]) {
        Self::matvec_parts_with(Isa::best(), parts, acts, x, out)
    }

    /// [`QMatrix::matvec_parts`] on a given path.
    pub fn matvec_parts_with(
        isa: Isa,
        parts: &[QMatrix],
        acts: Activations,
        x: &[f32],
        out: &mut [f32],
    ) {
        assert!(
            parts.iter().all(|w| w.cols == x.len()),
            "matvec: activation length"
        );
        assert!(isa.available(), "{isa:?} path on a CPU without it");
        let rows: usize = parts.iter().map(|w| w.rows).sum();
        let out = &mut out[..rows];
        // The widest activations any part takes: a 16-bit quantization holds the 8-bit one.
        let widest = parts.iter().map(|w| w.taken(isa, acts)).max();
        let xq = match widest {
            Some(t @ (Taken::Int8 | Taken::Int16)) => Some(quantize_acts(x, t == Taken::Int16)),
            _ => None,
        };
        // Per block, the sum of the activations a product multiplies, for the minimum terms
        // (Q4_1, Q5_1, the K-quants: Σ (d q + m) x = d Σ q x + m Σ x): the exact sums for the
        // f32 products, the codes' for the quantized ones (`QuantizedActs::sums`); each only
        // where a part with minimums takes those activations.
        let needs = |t: Taken| {
            parts
                .iter()
                .any(|w| w.kind.has_mins() && w.taken(isa, acts) == t)
        };
        let xsum: Vec<f32> = if needs(Taken::F32) {
            x.chunks_exact(BLOCK).map(|b| b.iter().sum()).collect()
        } else {
            Vec::new()
        };
        let sums = |t: Taken| match &xq {
            Some(xq) if needs(t) => xq.sums(t),
            _ => Vec::new(),
        };
        let (xsum8, xsum16) = (sums(Taken::Int8), sums(Taken::Int16));
        // One contiguous run of rows per thread: each thread streams one piece of the matrix
        // and pays for one task. Measured on 2 threads (docs/bench-engine.md), decode at depth 0
        // ran 10-15% faster than with four tasks per thread; if the other thread has not
        // started the second task when the first is done, the calling thread runs it too.
        let per_task = rows
            .div_ceil(rayon::current_num_threads())
            .next_multiple_of(8)
            .max(8);
        out.par_chunks_mut(per_task)
            .enumerate()
            .for_each(|(t, mut o)| {
                // The task's rows of the stacked parts, a piece from each part they cross.
                let (mut g, mut base) = (t * per_task, 0);
                for w in parts {
                    if o.is_empty() {
                        break;
                    }
                    if g < base + w.rows {
                        let r0 = g - base;
                        let (piece, rest) = o.split_at_mut((w.rows - r0).min(o.len()));
                        let taken = w.taken(isa, acts);
                        let (codes, xsum) = match (&xq, taken) {
                            (Some(xq), Taken::Int8) => (Some(xq.codes(taken)), &xsum8),
                            (Some(xq), Taken::Int16) => (Some(xq.codes(taken)), &xsum16),
                            _ => (None, &xsum),
                        };
                        w.rows_into(isa, r0, x, codes, xsum, piece);
                        g += piece.len();
                        o = rest;
                    }
                    base += w.rows;
                }
            });
    }

    /// `out[i]` = row `r0 + i` · `x` for every `i`, with the activations' codes where `xq`
    /// holds them (a block-format matrix), else in f32.
    fn rows_into(
        &self,
        isa: Isa,
        r0: usize,
        x: &[f32],
        xq: Option<Codes>,
        xsum: &[f32],
        out: &mut [f32],
    ) {
        match xq {
            Some(xq) if self.kind != Kind::F32 => {
                if !self.rows_dot_q8(isa, r0, xq, xsum, out) {
                    for (i, o) in out.iter_mut().enumerate() {
                        *o = self.row_dot_q8(r0 + i, xq, xsum);
                    }
                }
            }
            _ => self.rows_dot(isa, r0, x, xsum, out),
        }
    }

    /// `out[i]` = row `r0 + i` · `x` (f32 activations) for every `i`.
    fn rows_dot(&self, isa: Isa, r0: usize, x: &[f32], xsum: &[f32], out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if isa != Isa::Portable && self.kind.is_raw() {
            let rb = self.kind.bytes_of(self.cols);
            let raw = &self.qs[r0 * rb..(r0 + out.len()) * rb];
            // SAFETY: `matvec_with` checked that the CPU has the path's features; raw holds the
            // rows' whole blocks, x is cols long and xsum holds its sums per 32.
            unsafe { simd::blocks::matvec(isa == Isa::Avx512, self.kind, raw, x, xsum, out) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if isa != Isa::Portable && matches!(self.kind, Kind::Q4_1 | Kind::Q8_0) {
            let nb = self.cols / BLOCK;
            let (b0, b1) = (r0 * nb, (r0 + out.len()) * nb);
            let (d, m) = (
                &self.d[b0..b1],
                &self.m[b0.min(self.m.len())..b1.min(self.m.len())],
            );
            match (self.kind, isa) {
                // SAFETY: `matvec_with` checked that the CPU has the path's features; the slices
                // hold nb blocks for each of the out.len() rows and x is cols = 32 nb long.
                (Kind::Q4_1, Isa::Avx512) => unsafe {
                    simd::avx512::matvec_q4_1(d, m, &self.qs[b0 * 16..b1 * 16], x, xsum, out)
                },
                // SAFETY: as above.
                (Kind::Q4_1, _) => unsafe {
                    simd::avx2::matvec::matvec_q4_1(d, m, &self.qs[b0 * 16..b1 * 16], x, xsum, out)
                },
                // SAFETY: as above.
                (Kind::Q8_0, Isa::Avx512) => unsafe {
                    simd::avx512::matvec_q8_0(d, &self.qs[b0 * 32..b1 * 32], x, out)
                },
                // SAFETY: as above.
                (_, _) => unsafe {
                    simd::avx2::matvec::matvec_q8_0(d, &self.qs[b0 * 32..b1 * 32], x, out)
                },
            }
            return;
        }
        for (i, o) in out.iter_mut().enumerate() {
            *o = self.row_dot(r0 + i, x, xsum);
        }
    }

    /// One row's product on the portable path (f32 matrices: on every path).
    fn row_dot(&self, r: usize, x: &[f32], xsum: &[f32]) -> f32 {
        let nb = self.cols / BLOCK;
        match self.kind {
            Kind::F32 => {
                let w = &self.f[r * self.cols..(r + 1) * self.cols];
                dot_f32_portable(w, x)
            }
            k @ (Kind::Q4_0 | Kind::Q5_0 | Kind::Q5_1 | Kind::Q4_K | Kind::Q5_K | Kind::Q6_K) => {
                blocks::dot_row(k, self.raw_row(r), x, xsum)
            }
            Kind::Q4_1 => {
                let (d, m) = (&self.d[r * nb..(r + 1) * nb], &self.m[r * nb..(r + 1) * nb]);
                let qs = &self.qs[r * nb * 16..(r + 1) * nb * 16];
                dot_q4_1_portable(d, m, qs, x, xsum)
            }
            Kind::Q8_0 => {
                let d = &self.d[r * nb..(r + 1) * nb];
                let qs = &self.qs[r * nb * 32..(r + 1) * nb * 32];
                dot_q8_0_portable(d, qs, x)
            }
        }
    }
}

/// Little-endian f16 bytes to f32 (`src` holds two bytes per value of `out`), with F16C when
/// the CPU has it: for readers of f16 data such as KV chunks, since `half`'s per-value
/// conversion is a call per value when the binary is not built for the CPU it runs on.
pub fn f16_bytes_to_f32(src: &[u8], out: &mut [f32]) {
    f16_bytes_to_f32_with(Isa::best(), src, out)
}

/// [`f16_bytes_to_f32`] through a given path (which must be [`Isa::available`]); every path
/// gives the same bits, NaN payloads included.
pub fn f16_bytes_to_f32_with(isa: Isa, src: &[u8], out: &mut [f32]) {
    assert!(src.len() >= out.len() * 2, "f16_bytes_to_f32: short source");
    assert!(
        isa.available(),
        "f16_bytes_to_f32: {isa:?} is not available on this CPU"
    );
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() {
        // SAFETY: the assert above checked that the CPU has AVX2, FMA and F16C (Isa::available)
        // and that the source holds two bytes per output.
        return unsafe { simd::avx2::f16_to_f32(src, out) };
    }
    for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
        *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
    }
}

/// Dot product in eight lanes (the compiler vectorises it on any x86-64).
pub fn dot_f32_portable(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q4_1_raw(rows: usize, cols: usize, seed: u32) -> Vec<u8> {
        let mut raw = Vec::new();
        let mut s = seed;
        for _ in 0..rows * cols / BLOCK {
            s = s.wrapping_mul(1664525).wrapping_add(1013904223);
            raw.extend_from_slice(&f16::from_f32((s % 100) as f32 / 1000.0 + 0.001).to_le_bytes());
            raw.extend_from_slice(&f16::from_f32(-((s / 100 % 50) as f32) / 100.0).to_le_bytes());
            for _ in 0..16 {
                s = s.wrapping_mul(1664525).wrapping_add(1013904223);
                raw.push((s >> 13) as u8);
            }
        }
        raw
    }

    /// The naive dequantization every path is checked against.
    fn dequant(m: &QMatrix) -> Vec<f32> {
        let mut w = vec![0.0; m.rows * m.cols];
        if m.kind == Kind::F32 {
            w.copy_from_slice(&m.f);
            return w;
        }
        for (b, wb) in w.chunks_exact_mut(BLOCK).enumerate() {
            let d = m.d[b].to_f32();
            match m.kind {
                Kind::Q4_1 => {
                    for j in 0..16 {
                        let q = m.qs[b * 16 + j];
                        wb[j] = d * (q & 0xF) as f32 + m.m[b].to_f32();
                        wb[j + 16] = d * (q >> 4) as f32 + m.m[b].to_f32();
                    }
                }
                Kind::Q8_0 => {
                    for (w, &q) in wb.iter_mut().zip(&m.qs[b * 32..(b + 1) * 32]) {
                        *w = d * q as i8 as f32;
                    }
                }
                _ => unreachable!("the Q4_1 and Q8_0 matrices of these tests"),
            }
        }
        w
    }

    fn matrices(rows: usize, cols: usize) -> (Vec<f32>, Vec<QMatrix>) {
        let wf: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7 % 23) as f32 - 11.0) / 9.0)
            .collect();
        let ms = vec![
            QMatrix::from_raw(rows, cols, Kind::Q4_1, &q4_1_raw(rows, cols, 3)),
            QMatrix::quantize_q8_0(rows, cols, &wf),
            QMatrix::from_f32(rows, cols, wf.clone()),
        ];
        (wf, ms)
    }

    #[test]
    fn every_path_matches_the_dequantized_products() {
        // 3 blocks per row (the kernels' per-block tail only), and 19 (two groups of eight
        // blocks, whose scales convert together, and a tail of three).
        for cols in [96, 19 * BLOCK] {
            products_match_dequantized(70, cols);
        }
    }

    fn products_match_dequantized(rows: usize, cols: usize) {
        let x: Vec<f32> = (0..cols)
            .map(|i| ((i * 29 % 17) as f32 - 8.0) / 3.0)
            .collect();
        let (_, ms) = matrices(rows, cols);
        for isa in Isa::all_available() {
            for m in &ms {
                let w = dequant(m);
                let mut got = vec![0.0; rows];
                m.matvec_with(isa, Activations::F32, &x, &mut got);
                for r in 0..rows {
                    let want: f32 = (0..cols).map(|c| w[r * cols + c] * x[c]).sum();
                    // Summation order differs by path: bound by the terms' magnitude.
                    let mag: f32 = (0..cols).map(|c| (w[r * cols + c] * x[c]).abs()).sum();
                    assert!(
                        (got[r] - want).abs() <= 1e-5 * (1.0 + mag),
                        "{isa:?} {:?} row {r}: {} vs {want}",
                        m.kind,
                        got[r]
                    );
                }
                // Dequantized rows are exact (one fma per value at most).
                let mut tile = vec![0.0; 5 * cols];
                m.dequant_rows_with(isa, 3, 8, &mut tile);
                for (a, b) in tile.iter().zip(&w[3 * cols..8 * cols]) {
                    assert!(
                        (a - b).abs() <= 1e-6 * (1.0 + b.abs()),
                        "{isa:?} {a} vs {b}"
                    );
                }
            }
        }
    }

    /// A matrix held in parts gives each row its part's own bits, on every path, with f32 and
    /// int8 activations: parts of every layout (Q4_1, Q8_0, f32, a file's Q6_K blocks) whose
    /// row counts cut the threads' tasks and the kernels' passes in odd places.
    #[test]
    fn parts_give_each_parts_own_rows() {
        let cols = 256;
        let (_, ms) = matrices(13, cols);
        let k6 = crate::qmatrix::blocks::random_blocks(Kind::Q6_K, 21, 5);
        let mut parts = ms;
        parts.push(QMatrix::from_raw(21, cols, Kind::Q6_K, &k6));
        parts.swap(1, 2);
        let x: Vec<f32> = (0..cols)
            .map(|i| ((i * 37 % 41) as f32 - 20.0) / 7.0)
            .collect();
        let rows: usize = parts.iter().map(|w| w.rows).sum();
        for isa in Isa::all_available() {
            let every = [
                Activations::F32,
                Activations::Int8,
                Activations::Int16,
                Activations::Auto,
            ];
            for acts in every {
                let mut all = vec![f32::NAN; rows + 1];
                QMatrix::matvec_parts_with(isa, &parts, acts, &x, &mut all);
                assert!(all[rows].is_nan(), "{isa:?} wrote past the rows");
                let mut r0 = 0;
                for w in &parts {
                    let mut one = vec![f32::NAN; w.rows];
                    w.matvec_with(isa, acts, &x, &mut one);
                    for (r, v) in one.iter().enumerate() {
                        let got = all[r0 + r];
                        assert_eq!(
                            got.to_bits(),
                            v.to_bits(),
                            "{isa:?} {acts:?} {:?} row {r}",
                            w.kind
                        );
                    }
                    r0 += w.rows;
                }
            }
        }
    }

    /// `Activations::Auto` gives a matrix the f32 product, bit for bit, unless the path has a
    /// 16-bit activations kernel for it (Q4_1 and Q8_0 with AVX2), where it gives that product,
    /// or it is held as the file's blocks and the path has AVX2 (or AVX-512 VNNI), where it
    /// gives the int8 product.
    #[test]
    fn auto_activations_are_int16_or_int8_only_where_a_kernel_takes_them() {
        let cols = 512;
        let (_, mut ms) = matrices(9, cols);
        for kind in [Kind::Q5_0, Kind::Q4_K, Kind::Q6_K] {
            let raw =
                crate::qmatrix::blocks::random_blocks(kind, 9 * cols / kind.block_values(), 3);
            ms.push(QMatrix::from_raw(9, cols, kind, &raw));
        }
        let x: Vec<f32> = (0..cols)
            .map(|i| ((i * 37 % 41) as f32 - 20.0) / 7.0)
            .collect();
        let product = |m: &QMatrix, isa, acts| {
            let mut out = vec![0.0f32; 9];
            m.matvec_with(isa, acts, &x, &mut out);
            out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        let (mut int8_seen, mut int16_seen) = (false, false);
        for isa in Isa::all_available() {
            for m in &ms {
                let int16 = m.has_int16_rows(isa);
                let int8 = !int16 && m.kind.is_raw() && isa.has_avx2();
                let want = match (int16, int8) {
                    (true, _) => Activations::Int16,
                    (_, true) => Activations::Int8,
                    _ => Activations::F32,
                };
                let got = product(m, isa, Activations::Auto);
                assert_eq!(got, product(m, isa, want), "{isa:?} {:?}", m.kind);
                if int8 || int16 {
                    // The products differ, so the check above tells them apart.
                    assert_ne!(got, product(m, isa, Activations::F32), "{:?}", m.kind);
                    int8_seen |= int8;
                    int16_seen |= int16;
                }
                if int16 {
                    assert_ne!(got, product(m, isa, Activations::Int8), "{:?}", m.kind);
                }
            }
        }
        assert_eq!(int8_seen, Isa::Avx2.available());
        #[cfg(target_arch = "x86_64")]
        assert_eq!(
            int16_seen,
            Isa::Avx512.available() && simd::vnni::available()
        );
    }

    #[test]
    fn every_path_agrees_with_the_portable_one_on_odd_shapes() {
        // Row counts around the kernels' passes of several rows and the threads' split; block
        // counts around the 16 scales converted at once (1, 15, 16, 17, 33, and the default
        // model's 18 and 48).
        for rows in [1, 3, 4, 5, 7, 13, 29] {
            for nb in [1, 15, 16, 17, 18, 33, 48] {
                let cols = nb * BLOCK;
                let x: Vec<f32> = (0..cols)
                    .map(|i| ((i * 37 % 41) as f32 - 20.0) / 7.0)
                    .collect();
                let (_, ms) = matrices(rows, cols);
                for m in &ms[..2] {
                    let mut want = vec![0.0; rows];
                    m.matvec_with(Isa::Portable, Activations::F32, &x, &mut want);
                    let w = dequant(m);
                    for isa in Isa::all_available() {
                        let mut got = vec![f32::NAN; rows + 1];
                        m.matvec_with(isa, Activations::F32, &x, &mut got);
                        assert!(got[rows].is_nan(), "{isa:?} wrote past the rows");
                        for r in 0..rows {
                            // Both sum the same products in different orders, each with at
                            // most about 16 + nb + 8 roundings in a row (within a block, across
                            // blocks, the final reduction): each is within that many units of
                            // f32 rounding (u = EPSILON / 2) of Σ |w x| from the exact sum.
                            let mag: f32 = (0..cols).map(|c| (w[r * cols + c] * x[c]).abs()).sum();
                            let bound = (24 + nb) as f32 * f32::EPSILON * mag;
                            assert!(
                                (got[r] - want[r]).abs() <= bound + 1e-6,
                                "{isa:?} {:?} {rows}x{nb} blocks, row {r}: {} vs {}",
                                m.kind,
                                got[r],
                                want[r]
                            );
                        }
                    }
                }
            }
        }
    }

    /// The vector quantizer of decode's int8 activations gives the portable one's bits: codes
    /// that fall on a tie (x = ±(k + 1/2) steps), a block of zeros and a block of one value.
    #[test]
    fn activation_quantizers_agree_bit_for_bit() {
        #[cfg(target_arch = "x86_64")]
        if simd::vnni::available() {
            let mut x: Vec<f32> = (0..256)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
                .collect();
            // Block 1: ties, the largest 127 so a step is 1.
            for (j, v) in x[32..64].iter_mut().enumerate() {
                *v = if j == 0 {
                    127.0
                } else {
                    (j as f32 - 16.0) + 0.5
                };
            }
            x[64..96].fill(0.0);
            x[96..128].fill(-3.25);
            let (mut q1, mut d1) = (vec![0i8; 256], vec![0f32; 8]);
            let (mut q2, mut d2) = (vec![0i8; 256], vec![0f32; 8]);
            quantize_acts_portable(&x, &mut q1, &mut d1);
            // SAFETY: the CPU has the kernel's features (checked above).
            unsafe { simd::vnni::quantize(&x, &mut q2, &mut d2) };
            assert_eq!(q1, q2);
            assert!(d1.iter().zip(&d2).all(|(a, b)| a.to_bits() == b.to_bits()));
            // Ties go to even: 0.5 → 0, 1.5 → 2, -0.5 → 0, -1.5 → -2.
            assert_eq!(&q1[48..50], &[0, 2]);
            assert_eq!(&q1[46..48], &[-2, 0]);
            // The remainders of 16-bit activations, the same bits on both paths; a remainder
            // of exactly half a step is clamped: 0.5 → 0 + 127/256, 1.5 → 2 - 127/256.
            let (mut l1, mut l2, mut q3) = (vec![0i8; 256], vec![0i8; 256], vec![0i8; 256]);
            remainders_portable(&x, &q1, &d1, &mut l1);
            // SAFETY: the CPU has the kernel's features (checked above).
            unsafe { simd::vnni::quantize16(&x, &mut q3, &mut l2, &mut d2) };
            assert_eq!(q1, q3);
            assert_eq!(l1, l2);
            assert_eq!(&l1[48..50], &[127, -127]);
            let xa = quantize_acts(&x, true);
            assert_eq!((xa.q, xa.lo), (q1, l1));
        }
    }

    #[test]
    fn avx2_activation_quantizer_agrees_bit_for_bit() {
        #[cfg(target_arch = "x86_64")]
        if Isa::Avx2.available() {
            let mut x: Vec<f32> = (0..256)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
                .collect();
            // Ties and half-step remainders (a step of 1), a zero block, a constant one.
            x[32] = 127.0;
            for (j, v) in x[33..64].iter_mut().enumerate() {
                *v = j as f32 - 15.5;
            }
            x[64..96].fill(0.0);
            x[96..128].fill(-3.25);
            let (mut q1, mut l1, mut d1) = (vec![0i8; 256], vec![0i8; 256], vec![0f32; 8]);
            quantize_acts_portable(&x, &mut q1, &mut d1);
            remainders_portable(&x, &q1, &d1, &mut l1);
            let (mut q2, mut l2, mut d2) = (vec![0i8; 256], vec![0i8; 256], vec![0f32; 8]);
            // SAFETY: the CPU has AVX2, FMA and F16C (`Isa::Avx2`); l2 holds 256 values.
            unsafe { simd::avx2::split_int8::quantize::<true>(&x, &mut q2, &mut l2, &mut d2) };
            assert_eq!((&q2, &l2), (&q1, &l1));
            assert!(d1.iter().zip(&d2).all(|(a, b)| a.to_bits() == b.to_bits()));
            assert!(
                l1.contains(&127) && l1.contains(&-127),
                "half steps clamped"
            );
            let mut q3 = vec![0i8; 256];
            // SAFETY: as above; without LO the empty remainders are not written.
            unsafe { simd::avx2::split_int8::quantize::<false>(&x, &mut q3, &mut [], &mut d2) };
            assert_eq!(q3, q1);
        }
    }

    #[test]
    fn int16_activations_are_within_a_256th_of_int8s_bound() {
        let (rows, cols) = (70, 96);
        let x: Vec<f32> = (0..cols)
            .map(|i| ((i * 29 % 17) as f32 - 8.0) / 3.0 + if i == 5 { 20.0 } else { 0.0 })
            .collect();
        let xa = quantize_acts(&x, true);
        // Each value within a 256th of its block's step (a 512th but where a remainder of half
        // a step saturated), apart from the rounding of x · (127 / amax).
        for (c, &v) in x.iter().enumerate() {
            let d = xa.d[c / BLOCK];
            let xh = d * (f32::from(xa.q[c]) + f32::from(xa.lo[c]) / 256.0);
            assert!(
                (xh - v).abs() <= d / 256.0 + 4.0 * f32::EPSILON * v.abs(),
                "{c}"
            );
        }
        let (_, ms) = matrices(rows, cols);
        for m in &ms[..2] {
            let w = dequant(m);
            let mut f32s = vec![0.0; rows];
            m.matvec_with(Isa::best(), Activations::F32, &x, &mut f32s);
            for isa in Isa::all_available() {
                let mut got = vec![0.0; rows];
                m.matvec_with(isa, Activations::Int16, &x, &mut got);
                if !m.has_int16_rows(isa) {
                    // No kernel for them here: the f32 product, the same bits as its own.
                    let mut want = vec![0.0; rows];
                    m.matvec_with(isa, Activations::F32, &x, &mut want);
                    assert_eq!(got, want, "{isa:?} {:?}", m.kind);
                    continue;
                }
                for r in 0..rows {
                    let (exact, mag, bound) = (0..cols).fold((0.0f64, 0.0, 0.0), |(e, a, b), c| {
                        let d = f64::from(xa.d[c / BLOCK]);
                        let xh = d * (f64::from(xa.q[c]) + f64::from(xa.lo[c]) / 256.0);
                        let wv = f64::from(w[r * cols + c]);
                        (e + wv * xh, a + (wv * xh).abs(), b + wv.abs() * d / 256.0)
                    });
                    // Σ w x̂ up to float rounding (the integer sums are exact)...
                    assert!(
                        (f64::from(got[r]) - exact).abs() <= 64.0 * f64::from(f32::EPSILON) * mag,
                        "{isa:?} {:?} row {r}: {} vs Σ w x̂ {exact}",
                        m.kind,
                        got[r]
                    );
                    // ...and so within a 256th of a step per value of the f32 product.
                    assert!(
                        (got[r] - f32s[r]).abs() as f64 <= bound * 1.01 + 1e-4,
                        "{isa:?} {:?} row {r}: {} vs f32 {} (bound {bound})",
                        m.kind,
                        got[r],
                        f32s[r]
                    );
                    // The portable row product reads the remainders the same way.
                    let portable = m.row_dot_q8(r, xa.codes(Taken::Int16), &xa.sums(Taken::Int16));
                    assert!((portable - got[r]).abs() <= 1e-4 * (1.0 + got[r].abs()));
                }
            }
        }
    }

    #[test]
    fn int8_activations_are_within_their_rounding_bound() {
        let (rows, cols) = (70, 96);
        let x: Vec<f32> = (0..cols)
            .map(|i| ((i * 29 % 17) as f32 - 8.0) / 3.0 + if i == 5 { 20.0 } else { 0.0 })
            .collect();
        let xa = quantize_acts(&x, false);
        let (_, ms) = matrices(rows, cols);
        for m in &ms[..2] {
            let w = dequant(m);
            let mut per_path = Vec::new();
            for isa in Isa::all_available() {
                let mut got = vec![0.0; rows];
                m.matvec_with(isa, Activations::Int8, &x, &mut got);
                for r in 0..rows {
                    let want: f32 = (0..cols).map(|c| w[r * cols + c] * x[c]).sum();
                    // Each activation is off by at most half its block's step.
                    let bound: f32 = (0..cols)
                        .map(|c| w[r * cols + c].abs() * xa.d[c / BLOCK] * 0.5)
                        .sum();
                    assert!(
                        (got[r] - want).abs() <= bound * 1.01 + 1e-4,
                        "{isa:?} {:?} row {r}: {} vs {want} (bound {bound})",
                        m.kind,
                        got[r]
                    );
                    // And it is the product with the dequantized activations, up to float
                    // rounding: the minimum term takes the codes' sum, not the exact one.
                    let (exact, mag) = (0..cols).fold((0.0f64, 0.0f64), |(e, a), c| {
                        let xh = f64::from(xa.d[c / BLOCK]) * f64::from(xa.q[c]);
                        let t = f64::from(w[r * cols + c]) * xh;
                        (e + t, a + t.abs())
                    });
                    assert!(
                        (f64::from(got[r]) - exact).abs() <= 64.0 * f64::from(f32::EPSILON) * mag,
                        "{isa:?} {:?} row {r}: {} vs Σ w x̂ {exact}",
                        m.kind,
                        got[r]
                    );
                }
                per_path.push(got);
            }
            // Integer sums are exact, so every path agrees up to float rounding of the scales.
            for p in &per_path[1..] {
                for (a, b) in p.iter().zip(&per_path[0]) {
                    assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{a} vs {b}");
                }
            }
        }
    }

    #[test]
    fn f16_bytes_convert_exactly() {
        let vals: Vec<f32> = (0..37).map(|i| (i as f32 - 18.0) * 0.37).collect();
        let bytes: Vec<u8> = vals
            .iter()
            .flat_map(|v| f16::from_f32(*v).to_le_bytes())
            .collect();
        let mut out = vec![0.0; vals.len()];
        f16_bytes_to_f32(&bytes, &mut out);
        for (o, v) in out.iter().zip(&vals) {
            assert_eq!(*o, f16::from_f32(*v).to_f32());
        }
    }

    #[test]
    fn every_path_converts_every_f16_to_the_same_bits() {
        let bytes: Vec<u8> = (0..=u16::MAX).flat_map(u16::to_le_bytes).collect();
        let mut want = vec![0.0; 1 << 16];
        f16_bytes_to_f32_with(Isa::Portable, &bytes, &mut want);
        for (b, w) in (0..=u16::MAX).zip(&want) {
            assert_eq!(
                w.to_bits(),
                f16::from_bits(b).to_f32().to_bits(),
                "{b:#06x}"
            );
        }
        for isa in Isa::all_available() {
            // Odd lengths and offsets exercise the vector body and the scalar tail.
            for skip in [0, 1, 7] {
                let mut got = vec![0.0; (1 << 16) - skip];
                f16_bytes_to_f32_with(isa, &bytes[2 * skip..], &mut got);
                for (i, (g, w)) in got.iter().zip(&want[skip..]).enumerate() {
                    assert_eq!(g.to_bits(), w.to_bits(), "{isa:?} {:#06x}", i + skip);
                }
            }
        }
    }

    #[test]
    fn isa_caps_parse() {
        fn check(v: &str, want: Option<IsaCap>) {
            assert_eq!(IsaCap::parse(v), want, "{v:?}");
        }
        check("", Some(IsaCap::Avx512));
        check("portable", Some(IsaCap::Portable));
        check(" AVX2 ", Some(IsaCap::Avx2));
        check("avx2-vnni", Some(IsaCap::Avx2Vnni));
        check("avx512", Some(IsaCap::Avx512));
        check("sse2", None);
        assert!(IsaCap::Portable < IsaCap::Avx2 && IsaCap::Avx2Vnni < IsaCap::Avx512);
    }

    #[test]
    fn q8_0_from_f32_is_within_half_a_step() {
        let (rows, cols) = (7, 64);
        let (wf, _) = matrices(rows, cols);
        let m = QMatrix::quantize_q8_0(rows, cols, &wf);
        for (a, b) in dequant(&m).iter().zip(&wf) {
            assert!(
                (a - b).abs() <= (11.0 / 9.0) / 127.0 * 0.51 + 1e-6,
                "{a} vs {b}"
            );
        }
    }

    #[test]
    fn stacking_keeps_rows_in_order_and_bytes_equal_the_file() {
        let cols = 64;
        let a = QMatrix::from_raw(3, cols, Kind::Q4_1, &q4_1_raw(3, cols, 1));
        let b = QMatrix::from_raw(5, cols, Kind::Q4_1, &q4_1_raw(5, cols, 2));
        assert_eq!(a.bytes(), 3 * cols / BLOCK * 20);
        let (wa, wb) = (dequant(&a), dequant(&b));
        let s = QMatrix::stack(vec![a, b]);
        assert_eq!(s.rows(), 8);
        assert_eq!(dequant(&s), [wa, wb].concat());
    }
}
