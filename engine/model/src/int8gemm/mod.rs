//! Batched products with int8 activations (prefill and recompute): `out = x · Wᵀ` where `x` is
//! quantized per row and 32-value block to int8 and `W` stays in its own blocks (every format
//! but f32).
//!
//! The recipe is mllm-NPU's low-bit prefill on a CPU with 8-bit dot products: the weights' own
//! 4- or 8-bit codes are multiplied with the activations' 8-bit codes in integers (AVX-512
//! VNNI `vpdpbusd`, 64 multiply-adds per instruction, four times the f32 FMA's per-instruction
//! work at the same vector width), and only each block's sum is scaled in f32.
//! Two things keep the activations' rounding small. Scales are per 32-value block, so a channel
//! hundreds of times larger than its neighbours coarsens only its own block, not the row. And
//! each row's largest value is mllm-NPU's *shadow outlier*: it is taken out of its block before
//! the block is quantized (the block's scale then follows its other 31 values) and multiplied
//! in f32 on the side, `out[t][r] += x[t][c] · w[r][c]`, with the matrix's column `c` read once
//! per task from the task's panels for every token that shares it (a transformer's massive
//! activations sit in a few fixed channels). On the default model this one value per row takes
//! int8 prefill's perplexity cost from +0.65% to +0.2-0.4% over f32 activations
//! (docs/bench-engine.md).
//!
//! Layout: a weight tile is repacked, per thread and per product, into panels of 16 rows in
//! which one 64-byte vector holds four consecutive codes of each of the 16 rows, the shape
//! `vpdpbusd` consumes (sixteen 32-bit lanes, each the dot product of four byte pairs). The
//! activations' four codes are broadcast to every lane, so one instruction advances sixteen
//! outputs. Every format the engine holds maps exactly onto one of a few panel forms
//! ([`form`], repacked by [`pack`]): unsigned codes, nibbles (Q4_0, Q4_1, Q4_K) or bytes (Q5_0,
//! Q5_1, Q5_K, Q6_K, Q8_0), with per 32 values an f32 scale and either a minimum (Q4_1, Q5_1,
//! Q4_K, Q5_K: `w = d q + m`) or an integer offset (`w = d (q - o)`: Q4_0 8, Q5_0 16, Q6_K 32,
//! Q8_0 128, whose signed codes are stored `+ 128`). The offset's `o Σ x_q` is taken off the
//! integer sum, which stays exact. Q6_K's scale changes every 16 values: its panel holds a
//! second scale, and each half of a block keeps its own integer sum (the activations' codes are
//! summed per 16 too, for its offset).
//!
//! Every output is the same sequence of f32 operations whatever the batch, the tile or the
//! path: per block `f = fma(Σ (q - o)·x_q, d_w·d_x, f)`, then for the forms with a minimum
//! `f = fma(m_w, d_x Σ x_q, f)`, for Q6_K `f = fma(Σ_hi (q - o)·x_q, d_w'·d_x, f)` after its first
//! half's. So the portable path (the oracle in tests) and the SIMD paths agree bit for bit, and a
//! row's result never depends on which rows it is batched with (prefill in steps of any size and
//! recompute of any set of chunks stay exact).

#[cfg(target_arch = "x86_64")]
pub mod avx2;
mod pack;
#[cfg(target_arch = "x86_64")]
pub mod vnni;

use crate::qmatrix::{BLOCK, IsaCap, Kind, QMatrix};
use rayon::prelude::*;
use std::cell::RefCell;
use std::sync::OnceLock;

/// Rows of one panel: the lanes of a 512-bit vector of i32.
pub const PANEL: usize = 16;

/// Tokens of one register tile of the VNNI kernel.
const TOKENS: usize = 8;

/// Panels one task repacks and multiplies (rows per task `PANEL * TILE_PANELS`).
const TILE_PANELS: usize = 2;

/// The panel forms: how a format's 32-value blocks sit in a panel and what the kernels do with
/// them. A form is a `u8` so the kernels can take it as a const parameter.
pub mod form {
    use super::PANEL;
    use crate::qmatrix::Kind;

    /// Nibbles 0..=15 with a scale and a minimum: Q4_1, Q4_K.
    pub const NIB_MIN: u8 = 0;
    /// Nibbles 0..=15 offset by 8: Q4_0.
    pub const NIB_OFF: u8 = 1;
    /// Bytes 0..=31 with a scale and a minimum: Q5_1, Q5_K.
    pub const BYTE_MIN: u8 = 2;
    /// Bytes 0..=31 offset by 16: Q5_0.
    pub const BYTE_OFF: u8 = 3;
    /// Bytes 0..=255 offset by 128 (signed codes stored `+ 128`): Q8_0.
    pub const SIGNED: u8 = 4;
    /// Bytes 0..=63 offset by 32, with a scale per 16 values: Q6_K.
    pub const HALVES: u8 = 5;

    /// The form of a matrix of `kind` (not f32).
    pub fn of(kind: Kind) -> u8 {
        match kind {
            Kind::Q4_1 | Kind::Q4_K => NIB_MIN,
            Kind::Q4_0 => NIB_OFF,
            Kind::Q5_1 | Kind::Q5_K => BYTE_MIN,
            Kind::Q5_0 => BYTE_OFF,
            Kind::Q8_0 => SIGNED,
            Kind::Q6_K => HALVES,
            Kind::F32 => unreachable!("f32 matrices take the f32 GEMM"),
        }
    }

    /// Whether the codes are nibbles (value `j` low, `j + 16` high in byte `j`).
    pub const fn nibbles(f: u8) -> bool {
        f == NIB_MIN || f == NIB_OFF
    }

    /// The offset `o` of `w = d (q - o)`, 0 for the forms with a minimum.
    pub const fn offset(f: u8) -> i32 {
        match f {
            NIB_OFF => 8,
            BYTE_OFF => 16,
            SIGNED => 128,
            HALVES => 32,
            _ => 0,
        }
    }

    /// The largest code.
    pub const fn max_code(f: u8) -> i32 {
        match f {
            NIB_MIN | NIB_OFF => 15,
            BYTE_MIN | BYTE_OFF => 31,
            HALVES => 63,
            _ => 255,
        }
    }

    /// Whether a value carries a minimum, `w = d q + m`.
    pub const fn mins(f: u8) -> bool {
        f == NIB_MIN || f == BYTE_MIN
    }

    /// Whether the panel holds a second parameter per row and block (a minimum, or the scale
    /// of values 16..32).
    pub const fn has_second(f: u8) -> bool {
        mins(f) || f == HALVES
    }

    /// Code bytes of one row of one block.
    pub const fn code_bytes(f: u8) -> usize {
        if nibbles(f) { 16 } else { 32 }
    }

    /// Bytes of one panel block: the 16 rows' codes, their 16 f32 scales and, if the form has
    /// one, their 16 second parameters.
    pub const fn block_bytes(f: u8) -> usize {
        PANEL * code_bytes(f) + 4 * PANEL * if has_second(f) { 2 } else { 1 }
    }
}

/// How batched products take their activations.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PrefillActs {
    /// The fastest this CPU does: int8 on every vector path (AVX-512 VNNI, AVX-VNNI, AVX2),
    /// f32 on the portable one.
    Auto,
    /// f32 GEMM over dequantized weight tiles: the reference, and the default (int8 is within
    /// 0.5% of its perplexity but flips near-tied first tokens; docs/bench-engine.md).
    #[default]
    F32,
    /// int8 codes per 32-value block, multiplied in integers.
    Int8,
}

impl PrefillActs {
    /// What `Auto` means on this CPU.
    pub fn resolve(self) -> PrefillActs {
        match self {
            // Every vector path beats the f32 GEMM (docs/bench-engine.md: 1.5-1.7x on AVX2 alone)
            // and gives the portable path's bits, hence its perplexity.
            PrefillActs::Auto if Path::best() != Path::Portable => PrefillActs::Int8,
            PrefillActs::Auto => PrefillActs::F32,
            p => p,
        }
    }
}

/// The instruction path of the int8 kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// Plain Rust, any CPU (slow: the tests' oracle and the fallback).
    Portable,
    /// AVX2 alone: `vpmaddubsw` and `vpmaddwd` on 256 bits (AMD Zen 3).
    Avx2,
    /// AVX2 and AVX-VNNI: `vpdpbusd` on 256 bits (Intel Alder Lake and later).
    AvxVnni,
    /// AVX-512 F/BW with VNNI.
    Vnni,
}

impl Path {
    /// The best path this CPU supports within [`IsaCap::get`], detected once at run time.
    pub fn best() -> Path {
        static BEST: OnceLock<Path> = OnceLock::new();
        *BEST.get_or_init(|| {
            let cap = IsaCap::get();
            if cap >= IsaCap::Avx512 && Path::Vnni.available() {
                Path::Vnni
            } else if cap >= IsaCap::Avx2Vnni && Path::AvxVnni.available() {
                Path::AvxVnni
            } else if cap >= IsaCap::Avx2 && Path::Avx2.available() {
                Path::Avx2
            } else {
                Path::Portable
            }
        })
    }

    /// Whether this CPU can run the path.
    pub fn available(self) -> bool {
        match self {
            Path::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Path::Avx2 => crate::qmatrix::Isa::Avx2.available(),
            #[cfg(target_arch = "x86_64")]
            Path::AvxVnni => {
                Path::Avx2.available() && std::arch::is_x86_feature_detected!("avxvnni")
            }
            #[cfg(target_arch = "x86_64")]
            Path::Vnni => {
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            Path::Avx2 | Path::AvxVnni | Path::Vnni => false,
        }
    }

    /// Every path this CPU can run, portable first.
    pub fn all_available() -> Vec<Path> {
        [Path::Portable, Path::Avx2, Path::AvxVnni, Path::Vnni]
            .into_iter()
            .filter(|p| p.available())
            .collect()
    }
}

/// Activations quantized per row and 32-value block: `x ≈ d · q`.
#[derive(Debug, Default)]
pub struct QuantRows {
    rows: usize,
    cols: usize,
    /// Codes, `rows × cols`, in -127..=127.
    q: Vec<i8>,
    /// Scale per block, `rows × cols / 32`.
    d: Vec<f32>,
    /// The block's sum as quantized, `d · Σ q` (Q4_1's minimum term).
    sum: Vec<f32>,
    /// Sum of the block's codes (the offsets' correction).
    qsum: Vec<i32>,
    /// Sum of the block's first 16 codes (Q6_K's first half's offset correction).
    qlo: Vec<i32>,
    /// Each row's shadow outlier: its largest-magnitude value's column and value, left out of
    /// the codes (its code is 0) and multiplied in f32.
    shadow: Vec<(u32, f32)>,
    /// The shadows' distinct columns, ascending.
    shadow_cols: Vec<u32>,
    /// Each row's shadow column as an index into `shadow_cols`.
    shadow_idx: Vec<u32>,
}

impl QuantRows {
    /// Quantizes `x[rows][cols]` (cols a multiple of 32), reusing this value's buffers, rows
    /// split across the engine's threads, on the best path this CPU has.
    pub fn quantize(&mut self, x: &[f32], rows: usize, cols: usize) {
        self.quantize_with(Path::best(), x, rows, cols);
    }

    /// [`QuantRows::quantize`] on a given path (every path gives the same bits).
    pub fn quantize_with(&mut self, path: Path, x: &[f32], rows: usize, cols: usize) {
        assert!(path.available(), "{path:?} path on a CPU without it");
        assert!(
            cols.is_multiple_of(BLOCK) && x.len() >= rows * cols,
            "quantize: bad sizes"
        );
        let nb = cols / BLOCK;
        (self.rows, self.cols) = (rows, cols);
        self.q.resize(rows * cols, 0);
        self.d.resize(rows * nb, 0.0);
        self.sum.resize(rows * nb, 0.0);
        self.qsum.resize(rows * nb, 0);
        self.qlo.resize(rows * nb, 0);
        self.shadow.resize(rows, (NO_SHADOW, 0.0));
        // Rows per task: a few thousand values each, so small batches stay on one thread.
        let per = (16384 / cols).max(1);
        x[..rows * cols]
            .par_chunks(per * cols)
            .zip(self.q.par_chunks_mut(per * cols))
            .zip(self.d.par_chunks_mut(per * nb))
            .zip(self.sum.par_chunks_mut(per * nb))
            .zip(self.qsum.par_chunks_mut(per * nb))
            .zip(self.qlo.par_chunks_mut(per * nb))
            .zip(self.shadow.par_chunks_mut(per))
            .for_each(|((((((x, q), d), sum), qsum), qlo), shadow)| {
                let sums = Sums {
                    d: &mut *d,
                    sum: &mut *sum,
                    qsum: &mut *qsum,
                    qlo: &mut *qlo,
                };
                quantize_blocks(path, x, q, sums);
                // Each row's shadow leaves its block, which is quantized again without it.
                for (i, sh) in shadow.iter_mut().enumerate() {
                    *sh = shadow_of(&x[i * cols..(i + 1) * cols], &d[i * nb..(i + 1) * nb]);
                    if sh.0 == NO_SHADOW {
                        continue;
                    }
                    let b = i * nb + sh.0 as usize / BLOCK;
                    let mut blk = [0.0f32; BLOCK];
                    blk.copy_from_slice(&x[b * BLOCK..(b + 1) * BLOCK]);
                    blk[sh.0 as usize % BLOCK] = 0.0;
                    let one = Sums {
                        d: &mut d[b..b + 1],
                        sum: &mut sum[b..b + 1],
                        qsum: &mut qsum[b..b + 1],
                        qlo: &mut qlo[b..b + 1],
                    };
                    quantize_blocks(path, &blk, &mut q[b * BLOCK..(b + 1) * BLOCK], one);
                }
            });
        self.shadow_cols.clear();
        self.shadow_cols
            .extend(self.shadow.iter().map(|s| s.0).filter(|&c| c != NO_SHADOW));
        self.shadow_cols.sort_unstable();
        self.shadow_cols.dedup();
        self.shadow_idx.clear();
        let cols_of = &self.shadow_cols;
        self.shadow_idx
            .extend(self.shadow.iter().map(|s| match s.0 {
                NO_SHADOW => NO_SHADOW,
                c => cols_of.partition_point(|&k| k < c) as u32,
            }));
    }

    pub fn rows(&self) -> usize {
        self.rows
    }
}

/// A row without a shadow outlier (its `shadow` column and `shadow_idx`).
const NO_SHADOW: u32 = u32::MAX;

/// A row's shadow outlier, `(column, value)`, from its values and its blocks' scales: the
/// largest value (the first of equals) of the block with the largest scale (the first of
/// equals), so the row's largest up to rounding; `(NO_SHADOW, 0)` for a row of zeros.
///
/// Measured against taking a shadow only where it is at least 2× or 4× the rest of its block
/// (perplexity +0.31% and +0.26% over f32 on seeds/002 instead of +0.19%), always taking one
/// costs no measurable speed: most of a transformer's rows share their largest channel.
fn shadow_of(row: &[f32], d: &[f32]) -> (u32, f32) {
    let mut b = 0;
    for (i, &v) in d.iter().enumerate() {
        if v > d[b] {
            b = i;
        }
    }
    let blk = &row[b * BLOCK..(b + 1) * BLOCK];
    let mut j = 0;
    for (k, &v) in blk.iter().enumerate() {
        if v.abs() > blk[j].abs() {
            j = k;
        }
    }
    if blk[j] != 0.0 {
        ((b * BLOCK + j) as u32, blk[j])
    } else {
        (NO_SHADOW, 0.0)
    }
}

/// What quantizing blocks gives besides their codes, one of each per block.
pub struct Sums<'a> {
    /// The scale, `amax / 127`.
    pub d: &'a mut [f32],
    /// The block's sum as quantized, `d · Σ q`.
    pub sum: &'a mut [f32],
    /// The codes' sum.
    pub qsum: &'a mut [i32],
    /// The sum of the first 16 codes.
    pub qlo: &'a mut [i32],
}

/// [`quantize_portable`] on `path` (every path gives the same bits).
fn quantize_blocks(path: Path, x: &[f32], q: &mut [i8], sums: Sums<'_>) {
    assert!(path.available(), "{path:?} path on a CPU without it");
    match path {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has the path's features (asserted above); the vector forms check
        // that the slices hold as many blocks as `x` (32 codes, one of each parameter).
        Path::Vnni => unsafe { vnni::quantize(x, q, sums) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above; every AVX2 path has AVX2.
        Path::Avx2 | Path::AvxVnni => unsafe { avx2::quantize(x, q, sums) },
        _ => quantize_portable(x, q, sums),
    }
}

/// Quantizes 32-value blocks: `d = amax / 127`, codes `round_ties_even(x · 127 / amax)`, the
/// codes' sums (all, and the first 16's) and the block's sum as quantized, `d · Σ q`.
///
/// The minimum term of a product takes the quantized sum, not the exact one: then the
/// whole product is exactly `Σ w x̂` for the dequantized activations `x̂`, whose errors
/// multiply the centred weights `d q + m`. With the exact sum they would multiply `d q` alone,
/// all of one sign, and add up instead of cancelling (measured on the real model: the last
/// token's logits 3× further from the f32 oracle).
fn quantize_portable(x: &[f32], q: &mut [i8], s: Sums<'_>) {
    for (((((xb, qb), d), sum), qsum), qlo) in x
        .chunks_exact(BLOCK)
        .zip(q.chunks_exact_mut(BLOCK))
        .zip(s.d)
        .zip(s.sum)
        .zip(s.qsum)
        .zip(s.qlo)
    {
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        *d = amax / 127.0;
        let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        let mut t = 0;
        for (j, (q, &v)) in qb.iter_mut().zip(xb).enumerate() {
            *q = (v * inv).round_ties_even() as i8;
            t += i32::from(*q);
            if j == 15 {
                *qlo = t;
            }
        }
        *qsum = t;
        *sum = *d * t as f32;
    }
}

/// `out[t][c0 + i] = Σ_b …` for the panel's 16 rows (`lanes` of them written) and tokens
/// `t0..t1`, in plain Rust: the reference the SIMD kernels match bit for bit.
#[allow(clippy::too_many_arguments)]
fn panel_portable(
    f: u8,
    panel: &[u8],
    x: &QuantRows,
    (t0, t1): (usize, usize),
    out: &mut [f32],
    ld: usize,
    c0: usize,
    lanes: usize,
) {
    let nb = x.cols / BLOCK;
    let (pb, qb) = (form::block_bytes(f), form::code_bytes(f));
    let param = |o: &[u8], at: usize| f32::from_le_bytes([o[at], o[at + 1], o[at + 2], o[at + 3]]);
    for t in t0..t1 {
        let xq = &x.q[t * x.cols..(t + 1) * x.cols];
        for i in 0..lanes {
            let mut acc = 0.0f32;
            for b in 0..nb {
                let o = &panel[b * pb..(b + 1) * pb];
                let xb = &xq[b * BLOCK..(b + 1) * BLOCK];
                let p = t * nb + b;
                // Σ (q - o) x_q over values 0..16 and 16..32, exact.
                let mut half = [0i32; 2];
                for g in 0..qb / 4 {
                    for c in 0..4 {
                        let byte = i32::from(o[(g * PANEL + i) * 4 + c]);
                        if form::nibbles(f) {
                            half[0] += (byte & 0xF) * i32::from(xb[g * 4 + c]);
                            half[1] += (byte >> 4) * i32::from(xb[16 + g * 4 + c]);
                        } else {
                            half[g / 4] += byte * i32::from(xb[g * 4 + c]);
                        }
                    }
                }
                let off = form::offset(f);
                half[0] -= off * x.qlo[p];
                half[1] -= off * (x.qsum[p] - x.qlo[p]);
                let dw = param(o, PANEL * qb + 4 * i);
                let second = if form::has_second(f) {
                    param(o, PANEL * qb + 4 * PANEL + 4 * i)
                } else {
                    0.0
                };
                if f == form::HALVES {
                    acc = (half[0] as f32).mul_add(dw * x.d[p], acc);
                    acc = (half[1] as f32).mul_add(second * x.d[p], acc);
                } else {
                    acc = ((half[0] + half[1]) as f32).mul_add(dw * x.d[p], acc);
                    if form::mins(f) {
                        acc = second.mul_add(x.sum[p], acc);
                    }
                }
            }
            out[t * ld + c0 + i] = acc;
        }
    }
}

/// `out[t][r] = x[t] · w[r]` for every token of `x` and every row of `w` (any block format),
/// on `path`, rows split across the engine's threads.
pub fn product(path: Path, w: &QMatrix, x: &QuantRows, out: &mut [f32]) {
    product_parts(path, std::slice::from_ref(w), x, out)
}

/// [`product`] for a matrix held as row ranges `parts` (the fused query, key and value
/// products, or gate and up): `out` has rows of `Σ rows` values, each part's products in its
/// own columns, in one parallel loop over every part's tasks with the activations quantized
/// once. Each output is the one [`product`] of its part alone gives.
pub fn product_parts(path: Path, parts: &[QMatrix], x: &QuantRows, out: &mut [f32]) {
    thread_local! {
        static PANELS: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    }
    assert!(path.available(), "{path:?} path on a CPU without it");
    assert!(
        parts
            .iter()
            .all(|w| w.kind() != Kind::F32 && x.cols == w.cols()),
        "int8 product: needs block-format matrices of the activations' width"
    );
    let (ld, m) = (parts.iter().map(QMatrix::rows).sum::<usize>(), x.rows);
    assert!(out.len() >= m * ld, "int8 product: output too small");
    if m == 0 || ld == 0 {
        return;
    }
    let rows_per_task = PANEL * TILE_PANELS;
    // (part, its rows r0..r1, the column of out the part's row 0 goes to).
    let mut tasks = Vec::with_capacity(ld.div_ceil(rows_per_task) + parts.len());
    let mut col = 0;
    for (p, w) in parts.iter().enumerate() {
        for r0 in (0..w.rows()).step_by(rows_per_task) {
            tasks.push((p, r0, (r0 + rows_per_task).min(w.rows()), col));
        }
        col += w.rows();
    }
    // The address, not the pointer, crosses threads; each task writes only its own columns.
    let addr = out.as_mut_ptr() as usize;
    tasks.into_par_iter().for_each(|(p, r0, r1, col)| {
        let w = &parts[p];
        let f = form::of(w.kind());
        let panel_bytes = form::block_bytes(f) * (w.cols() / BLOCK);
        let panels = (r1 - r0).div_ceil(PANEL);
        PANELS.with_borrow_mut(|buf| {
            if buf.len() < panels * panel_bytes {
                buf.resize(panels * panel_bytes, 0);
            }
            w.prefetch_rows(r0, r1);
            for p in 0..panels {
                let pr0 = r0 + p * PANEL;
                pack::pack_panel(
                    w,
                    pr0,
                    (pr0 + PANEL).min(r1),
                    &mut buf[p * panel_bytes..(p + 1) * panel_bytes],
                );
            }
            // The next task's rows (the same thread mostly takes them: the tasks are split
            // in contiguous halves) start their way from memory while this one multiplies.
            w.prefetch_rows(r1, r1 + rows_per_task);
            let tile = Tile {
                f,
                panels: &buf[..panels * panel_bytes],
                panel_bytes,
                rows: r1 - r0,
            };
            // SAFETY: the checks above: out holds m rows of ld values, and columns
            // col + r0..col + r1 of them are this task's alone (tasks cover disjoint rows of
            // disjoint parts).
            unsafe { tile_on(path, &tile, x, (addr, ld), col + r0) };
            add_shadows(path, &tile, x, addr, ld, col + r0);
        });
    });
}

/// One task's repacked rows: `panels` holds `rows.div_ceil(16)` panels of form `f`,
/// `panel_bytes` each.
struct Tile<'a> {
    f: u8,
    panels: &'a [u8],
    panel_bytes: usize,
    rows: usize,
}

impl Tile<'_> {
    /// Panel `p` and how many of its rows are real.
    fn panel(&self, p: usize) -> (&[u8], usize) {
        (
            &self.panels[p * self.panel_bytes..(p + 1) * self.panel_bytes],
            (self.rows - p * PANEL).min(PANEL),
        )
    }
}

/// Runs the task's panels on `path` for every token of `x` into columns `c0..c0 + rows` of
/// `out` (at `addr`, rows of `ld`).
///
/// # Safety
/// The panels must hold `x.cols / 32` blocks each; `out` must hold `x.rows` rows of `ld`
/// values with `c0 + tile.rows <= ld`, and no other thread may access those columns meanwhile.
unsafe fn tile_on(
    path: Path,
    tile: &Tile<'_>,
    x: &QuantRows,
    (addr, ld): (usize, usize),
    c0: usize,
) {
    let all = x.parts(0, x.rows);
    let npanels = tile.rows.div_ceil(PANEL);
    match path {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the contract: every panel holds k / 32 blocks, x holds its tokens' codes and
        // block parameters, out + c0 starts x.rows rows of ld values of which these columns
        // are ours alone.
        Path::Vnni => unsafe {
            vnni::panels(
                tile.f,
                tile.panels,
                tile.panel_bytes,
                tile.rows,
                all,
                (addr as *mut f32).add(c0),
                ld,
            )
        },
        _ => {
            for t0 in (0..x.rows).step_by(TOKENS) {
                let t1 = (t0 + TOKENS).min(x.rows);
                for p in 0..npanels {
                    let (panel, lanes) = tile.panel(p);
                    let c = c0 + p * PANEL;
                    let at = (addr as *mut f32).wrapping_add(t0 * ld + c);
                    match path {
                        #[cfg(target_arch = "x86_64")]
                        // SAFETY: as above; the CPU has AVX-VNNI on that path.
                        Path::AvxVnni => unsafe {
                            avx2::panel::<true>(tile.f, panel, all.slice(t0, t1), at, ld, lanes)
                        },
                        #[cfg(target_arch = "x86_64")]
                        // SAFETY: as above.
                        Path::Avx2 => unsafe {
                            avx2::panel::<false>(tile.f, panel, all.slice(t0, t1), at, ld, lanes)
                        },
                        _ => {
                            // SAFETY: as above: these columns of these rows are ours alone,
                            // `out` holds x.rows rows of ld.
                            let out = unsafe {
                                std::slice::from_raw_parts_mut(addr as *mut f32, x.rows * ld)
                            };
                            panel_portable(tile.f, panel, x, (t0, t1), out, ld, c, lanes)
                        }
                    }
                }
            }
        }
    }
}

/// Adds the shadow columns' products to the task's columns `c0..c0 + tile.rows` of `out` (at
/// `addr`, rows of `ld`): the task's rows of each shadow column, read once from its panels,
/// then one f32 multiply-add per token and row.
fn add_shadows(path: Path, tile: &Tile<'_>, x: &QuantRows, addr: usize, ld: usize, c0: usize) {
    thread_local! {
        static COLUMNS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    }
    COLUMNS.with_borrow_mut(|cols| {
        let width = tile.rows;
        cols.clear();
        cols.resize(x.shadow_cols.len() * width, 0.0);
        for (&c, col) in x.shadow_cols.iter().zip(cols.chunks_exact_mut(width)) {
            for (p, rows) in col.chunks_mut(PANEL).enumerate() {
                panel_column(tile.f, tile.panel(p).0, c as usize, rows);
            }
        }
        for t in 0..x.rows {
            let (_, v) = x.shadow[t];
            let u = x.shadow_idx[t];
            if u == NO_SHADOW {
                continue;
            }
            let u = u as usize;
            let col = &cols[u * width..(u + 1) * width];
            // SAFETY: row t's columns c0..c0 + width are the calling task's alone (tasks cover
            // disjoint columns), inside `out`'s x.rows rows of ld values; nothing else reads
            // them meanwhile.
            let o = unsafe {
                std::slice::from_raw_parts_mut((addr as *mut f32).add(t * ld + c0), width)
            };
            add_scaled(path, o, v, col);
        }
    });
}

/// `o[i] += v · w[i]`, multiplied then added (two roundings, the same on every path).
fn add_scaled(path: Path, o: &mut [f32], v: f32, w: &[f32]) {
    match path {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has the path's features (`product_parts` asserted it), and every
        // vector path has AVX2.
        Path::Vnni | Path::Avx2 | Path::AvxVnni => unsafe { avx2::add_scaled(o, v, w) },
        _ => o.iter_mut().zip(w).for_each(|(o, &wv)| *o += v * wv),
    }
}

/// Column `c` of the first `out.len()` rows of a panel of form `f`, as the format decodes it:
/// `scale · (code − offset) + min` with the panel's f32 parameters (the scale of values 16..32
/// for Q6_K), so exactly [`QMatrix::value`] (checked for every form by
/// `panel_values_are_the_matrix_values`).
fn panel_column(f: u8, panel: &[u8], c: usize, out: &mut [f32]) {
    let (qb, pb) = (form::code_bytes(f), form::block_bytes(f));
    let (b, j) = (c / BLOCK, c % BLOCK);
    let o = &panel[b * pb..(b + 1) * pb];
    // Code j of every row: byte (j / 4 · 16 + i) · 4 + j % 4, the nibble's half for nibbles.
    let (k, shift) = if form::nibbles(f) {
        (j % 16, 4 * (j / 16))
    } else {
        (j, 0)
    };
    let codes = &o[k / 4 * PANEL * 4 + k % 4..];
    let scales = &o[PANEL * qb..PANEL * qb + 4 * PANEL];
    let seconds = &o[PANEL * qb + 4 * PANEL..];
    let param = |v: &[u8], i: usize| {
        f32::from_le_bytes([v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]])
    };
    for (i, out) in out.iter_mut().enumerate() {
        let mut code = codes[4 * i] >> shift;
        if form::nibbles(f) {
            code &= 0xF;
        }
        let v = f32::from(i16::from(code) - form::offset(f) as i16);
        *out = match f {
            form::HALVES if j >= 16 => param(seconds, i) * v,
            form::HALVES => param(scales, i) * v,
            _ if form::mins(f) => param(scales, i) * v + param(seconds, i),
            _ => param(scales, i) * v,
        };
    }
}

/// The activations of tokens `t0..t1` as the kernels read them.
#[derive(Clone, Copy)]
pub struct RowsView<'a> {
    pub tokens: usize,
    pub cols: usize,
    pub q: &'a [i8],
    pub d: &'a [f32],
    pub sum: &'a [f32],
    pub qsum: &'a [i32],
    pub qlo: &'a [i32],
}

impl RowsView<'_> {
    /// Tokens `t0..t1` of this view.
    pub fn slice(&self, t0: usize, t1: usize) -> Self {
        let nb = self.cols / BLOCK;
        RowsView {
            tokens: t1 - t0,
            cols: self.cols,
            q: &self.q[t0 * self.cols..t1 * self.cols],
            d: &self.d[t0 * nb..t1 * nb],
            sum: &self.sum[t0 * nb..t1 * nb],
            qsum: &self.qsum[t0 * nb..t1 * nb],
            qlo: &self.qlo[t0 * nb..t1 * nb],
        }
    }
}

impl QuantRows {
    fn parts(&self, t0: usize, t1: usize) -> RowsView<'_> {
        RowsView {
            tokens: self.rows,
            cols: self.cols,
            q: &self.q,
            d: &self.d,
            sum: &self.sum,
            qsum: &self.qsum,
            qlo: &self.qlo,
        }
        .slice(t0, t1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qmatrix::blocks::random_blocks;
    use crate::qmatrix::oracle;

    /// Every block format.
    const KINDS: [Kind; 8] = [
        Kind::Q4_1,
        Kind::Q8_0,
        Kind::Q4_0,
        Kind::Q5_0,
        Kind::Q5_1,
        Kind::Q4_K,
        Kind::Q5_K,
        Kind::Q6_K,
    ];

    fn lcg(s: &mut u32) -> u32 {
        *s = s.wrapping_mul(1664525).wrapping_add(1013904223);
        *s >> 8
    }

    /// A matrix of random blocks (every code bit random, sane scales and minimums).
    fn matrix(kind: Kind, rows: usize, cols: usize, seed: u32) -> QMatrix {
        let raw = random_blocks(kind, rows * cols / kind.block_values(), u64::from(seed));
        QMatrix::from_raw(rows, cols, kind, &raw)
    }

    /// A panel's value of every row and column is the matrix's own (the shadow columns are
    /// read from the panels), in every format, with a short last panel.
    #[test]
    fn panel_values_are_the_matrix_values() {
        for kind in KINDS {
            let (rows, cols) = (21, 512);
            let w = matrix(kind, rows, cols, 5);
            let f = form::of(kind);
            let pb = form::block_bytes(f) * (cols / BLOCK);
            let mut buf = vec![0u8; 2 * pb];
            for p in 0..2 {
                pack::pack_panel(
                    &w,
                    p * PANEL,
                    (p * PANEL + PANEL).min(rows),
                    &mut buf[p * pb..],
                );
            }
            for c in 0..cols {
                for p in 0..2 {
                    let lanes = (rows - p * PANEL).min(PANEL);
                    let mut got = [0.0; PANEL];
                    panel_column(f, &buf[p * pb..][..pb], c, &mut got[..lanes]);
                    for (i, got) in got[..lanes].iter().enumerate() {
                        let r = p * PANEL + i;
                        assert_eq!(*got, w.value(r, c), "{kind:?} row {r} col {c}");
                    }
                }
            }
        }
    }

    fn dense(w: &QMatrix) -> Vec<f32> {
        let mut f = vec![0.0; w.rows() * w.cols()];
        w.dequant_rows(0, w.rows(), &mut f);
        f
    }

    /// Row `r` of `w` as the oracle dequantizes it, in f64.
    fn oracle_row(w: &QMatrix, raw: &[u8], r: usize) -> Vec<f64> {
        let rb = w.kind().bytes_of(w.cols());
        let mut f = vec![0.0; w.cols()];
        oracle::dequant(w.kind(), &raw[r * rb..(r + 1) * rb], &mut f);
        f
    }

    /// Activations with an outlier channel, as a transformer's hidden states have.
    fn acts(rows: usize, cols: usize, seed: u32) -> Vec<f32> {
        let mut s = seed;
        (0..rows * cols)
            .map(|i| {
                let v = (lcg(&mut s) % 2001) as f32 / 1000.0 - 1.0;
                if i % cols == 7 { v * 40.0 } else { v }
            })
            .collect()
    }

    /// Per 32-value block of row `r`, a bound on `|scale · code|` and `|min|` as the panel
    /// holds them: the magnitude the f32 roundings scale with.
    fn block_magnitudes(w: &QMatrix, r: usize) -> Vec<f64> {
        let f = form::of(w.kind());
        let mut m = Vec::new();
        pack::row_blocks(w, r, |_, blk| {
            let (s, second) = (f64::from(blk.scale.abs()), f64::from(blk.second.abs()));
            let top = f64::from(form::max_code(f));
            m.push(match f {
                form::HALVES => s.max(second) * top,
                _ if form::mins(f) => s * top + 2.0 * second,
                _ => s * top,
            });
        });
        m
    }

    /// Every path equals the portable one bit for bit, and all are within the int8 activation
    /// error of the f64 oracle's product.
    fn check(kind: Kind, rows: usize, cols: usize, tokens: usize) {
        let raw = random_blocks(
            kind,
            rows * cols / kind.block_values(),
            (rows * 7 + cols) as u64,
        );
        let w = QMatrix::from_raw(rows, cols, kind, &raw);
        let x = acts(tokens, cols, tokens as u32 + 3);
        check_with(&w, &raw, &x, tokens);
    }

    fn check_with(w: &QMatrix, raw: &[u8], x: &[f32], tokens: usize) {
        let (kind, rows, cols) = (w.kind(), w.rows(), w.cols());
        let mut q = QuantRows::default();
        q.quantize_with(Path::Portable, x, tokens, cols);
        let mut reference = vec![f32::NAN; tokens * rows];
        product(Path::Portable, w, &q, &mut reference);
        for path in Path::all_available() {
            let mut out = vec![f32::NAN; tokens * rows];
            product(path, w, &q, &mut out);
            let same = out
                .iter()
                .zip(&reference)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{path:?} {kind:?} {rows}x{cols} at {tokens} tokens");
        }
        let nb = cols / BLOCK;
        for r in 0..rows {
            let f = oracle_row(w, raw, r);
            let mag = block_magnitudes(w, r);
            for t in 0..tokens {
                let xt = &x[t * cols..(t + 1) * cols];
                let exact: f64 = (0..cols).map(|c| f[c] * f64::from(xt[c])).sum();
                // Each activation is off by at most half its block's step, d_x / 2 (the shadow,
                // exact, is left in the bound).
                let act: f64 = (0..nb)
                    .map(|b| {
                        let wabs: f64 = (0..BLOCK).map(|j| f[b * BLOCK + j].abs()).sum();
                        wabs * f64::from(q.d[t * nb + b]) / 2.0
                    })
                    .sum();
                // f32: per block a scale product and up to two fused multiply-adds, each within
                // u = EPSILON / 2 of the running sum, whose terms are bounded by the blocks'
                // magnitudes times the activations (quantized: within d_x of them).
                let terms: f64 = (0..nb)
                    .map(|b| {
                        let dx = f64::from(q.d[t * nb + b]);
                        let xs: f64 = (0..BLOCK)
                            .map(|j| f64::from(xt[b * BLOCK + j].abs()) + dx)
                            .sum();
                        mag[b] * xs
                    })
                    .sum();
                let rounding = (3 * nb + 8) as f64 * f64::from(f32::EPSILON) / 2.0 * terms;
                let got = f64::from(reference[t * rows + r]);
                assert!(
                    (got - exact).abs() <= act * 1.0001 + rounding,
                    "{kind:?} t{t} r{r}: {got} vs {exact} (bounds {act} + {rounding})"
                );
            }
        }
    }

    /// A matrix held in parts gives, in each part's columns, the bits of that part's own
    /// product, on every path: parts of different formats and of row counts that are not
    /// whole tasks or panels, with shadow outliers in the activations.
    #[test]
    fn parts_give_each_parts_own_product() {
        let cols = 256;
        let parts = [
            matrix(Kind::Q4_1, 40, cols, 1),
            matrix(Kind::Q8_0, 19, cols, 2),
            matrix(Kind::Q6_K, 33, cols, 3),
            matrix(Kind::Q4_K, 64, cols, 4),
        ];
        let tokens = 13;
        let mut x = acts(tokens, cols, 9);
        x[3 * cols + 70] = 40.0;
        let mut q = QuantRows::default();
        q.quantize(&x, tokens, cols);
        let ld: usize = parts.iter().map(QMatrix::rows).sum();
        for path in Path::all_available() {
            let mut all = vec![f32::NAN; tokens * ld];
            product_parts(path, &parts, &q, &mut all);
            let mut c0 = 0;
            for w in &parts {
                let mut one = vec![f32::NAN; tokens * w.rows()];
                product(path, w, &q, &mut one);
                for t in 0..tokens {
                    for r in 0..w.rows() {
                        let (a, b) = (all[t * ld + c0 + r], one[t * w.rows() + r]);
                        assert_eq!(
                            a.to_bits(),
                            b.to_bits(),
                            "{path:?} {:?} t{t} r{r}",
                            w.kind()
                        );
                    }
                }
                c0 += w.rows();
            }
        }
    }

    #[test]
    fn every_path_matches_the_reference_and_the_oracle_on_every_format() {
        for kind in KINDS {
            if kind.block_values() == BLOCK {
                check(kind, 16, 32, 1);
                check(kind, 48, 96, 8);
                check(kind, 37, 64, 19);
                check(kind, 80, 576, 11);
                check(kind, 5, 160, 3);
            }
            check(kind, 16, 256, 2);
            check(kind, 37, 512, 9);
            check(kind, 21, 768, 13);
        }
    }

    /// Codes at their largest (and Q8_0's at -128) times activation codes all ±127: the AVX2
    /// path's 16-bit sums at their limits stay exact, on every format.
    #[test]
    fn the_largest_codes_stay_exact() {
        for kind in KINDS {
            let (rows, cols) = (24, 512);
            let mut raw = random_blocks(kind, rows * cols / kind.block_values(), 3);
            // Every byte but the f16 scales and minimums set to all ones (Q8_0: -128).
            let params: &[usize] = match kind {
                Kind::Q4_0 | Kind::Q5_0 | Kind::Q8_0 => &[0, 1],
                Kind::Q4_1 | Kind::Q5_1 | Kind::Q4_K | Kind::Q5_K => &[0, 1, 2, 3],
                _ => &[208, 209],
            };
            for b in raw.chunks_exact_mut(kind.block_bytes()) {
                for (i, v) in b.iter_mut().enumerate() {
                    if !params.contains(&i) {
                        *v = if kind == Kind::Q8_0 { 0x80 } else { 0xFF };
                    }
                }
            }
            let w = QMatrix::from_raw(rows, cols, kind, &raw);
            // Rows of +1, of -1, and alternating signs by pairs: each row's shadow (its first
            // value) leaves the rest of its block at code ±127.
            let tokens = 3;
            let x: Vec<f32> = (0..tokens * cols)
                .map(|i| match i / cols {
                    0 => 1.0,
                    1 => -1.0,
                    _ if i % 4 < 2 => 1.0,
                    _ => -1.0,
                })
                .collect();
            check_with(&w, &raw, &x, tokens);
        }
    }

    #[test]
    fn every_path_quantizes_to_the_same_bits() {
        let mut x = acts(37, 96, 11);
        x[5] = 0.0;
        x[96..128].fill(0.0);
        x[200] = -3.5e4;
        // Ties: a block whose largest magnitude is 127 has the step 1, so these halves round
        // to even on every path (the row's shadow is elsewhere, in its first block).
        for (j, v) in x[33 * 96 + 32..33 * 96 + 64].iter_mut().enumerate() {
            *v = if j == 0 { 127.0 } else { j as f32 - 15.5 };
        }
        x[33 * 96 + 33] = -0.0;
        x[33 * 96 + 7] = 300.0;
        let mut want = QuantRows::default();
        want.quantize_with(Path::Portable, &x, 37, 96);
        for path in Path::all_available() {
            let mut got = QuantRows::default();
            got.quantize_with(path, &x, 37, 96);
            assert_eq!(got.q, want.q, "{path:?}");
            assert_eq!(got.qsum, want.qsum, "{path:?}");
            assert_eq!(got.qlo, want.qlo, "{path:?}");
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got.d), bits(&want.d), "{path:?}");
            assert_eq!(bits(&got.sum), bits(&want.sum), "{path:?}");
            assert_eq!(got.shadow, want.shadow, "{path:?}");
        }
        // Codes within ±127, each value within half a step of its code, but for each row's
        // largest, which is its shadow, exact, with code 0.
        assert_eq!(want.shadow[2], (8, -3.5e4));
        for (b, xb) in x.chunks_exact(BLOCK).enumerate() {
            let (row, nb) = (b / 3, 3);
            for (j, &v) in xb.iter().enumerate() {
                let q = want.q[b * BLOCK + j];
                assert!((-127..=127).contains(&q));
                let col = ((b % nb) * BLOCK + j) as u32;
                if want.shadow[row].0 == col {
                    assert_eq!((q, want.shadow[row].1), (0, v));
                    assert!(xb.iter().all(|o| o.abs() <= v.abs()));
                } else {
                    assert!((v - f32::from(q) * want.d[b]).abs() <= want.d[b] * 0.5001 + 1e-6);
                }
            }
        }
        assert!(want.shadow_cols.windows(2).all(|p| p[0] < p[1]));
    }

    /// A row whose largest value dwarfs its block: the shadow keeps it exact and the rest of
    /// the block keeps its resolution (without it, the 31 small values would all round to 0).
    #[test]
    fn a_shadow_outlier_keeps_its_block_fine() {
        let cols = 64;
        let w = matrix(Kind::Q8_0, 16, cols, 3);
        let mut x: Vec<f32> = (0..3 * cols)
            .map(|i| ((i * 37 % 17) as f32 - 8.0) / 8.0)
            .collect();
        x[5] = 3000.0;
        x[cols + 40] = -2500.0;
        x[2 * cols..].fill(0.0);
        let mut q = QuantRows::default();
        q.quantize(&x, 3, cols);
        assert_eq!(q.shadow, vec![(5, 3000.0), (40, -2500.0), (NO_SHADOW, 0.0)]);
        assert_eq!(q.shadow_cols, vec![5, 40]);
        let mut out = vec![f32::NAN; 3 * 16];
        product(Path::best(), &w, &q, &mut out);
        assert!(out[32..].iter().all(|&v| v == 0.0));
        let f = dense(&w);
        for t in 0..2 {
            for r in 0..16 {
                let exact: f64 = (0..cols)
                    .map(|c| f64::from(f[r * cols + c]) * f64::from(x[t * cols + c]))
                    .sum();
                let wabs: f64 = (0..cols).map(|c| f64::from(f[r * cols + c].abs())).sum();
                // Every value quantized with a step of about 1/127 (the small ones' amax is 1),
                // the outlier's product rounded once in f32.
                let bound = wabs * (1.0 / 127.0) / 2.0 * 1.01 + exact.abs() * 1e-6 + 1e-3;
                let got = f64::from(out[t * 16 + r]);
                assert!((got - exact).abs() <= bound, "t{t} r{r}: {got} vs {exact}");
            }
        }
    }

    #[test]
    fn a_row_gives_the_same_bits_in_any_batch() {
        for kind in KINDS {
            let w = matrix(kind, 64, 256, 5);
            let x = acts(13, 256, 9);
            let mut all = QuantRows::default();
            all.quantize(&x, 13, 256);
            let mut full = vec![0.0; 13 * 64];
            product(Path::best(), &w, &all, &mut full);
            for t in [0, 6, 12] {
                let mut one = QuantRows::default();
                one.quantize(&x[t * 256..(t + 1) * 256], 1, 256);
                let mut out = vec![0.0; 64];
                product(Path::best(), &w, &one, &mut out);
                assert_eq!(
                    out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    full[t * 64..(t + 1) * 64]
                        .iter()
                        .map(|v| v.to_bits())
                        .collect::<Vec<_>>(),
                    "{kind:?}"
                );
            }
        }
    }
}
