//! Batched products with int8 activations (prefill and recompute): `out = x · Wᵀ` where `x` is
//! quantized per row and 32-value block to int8 and `W` stays in its Q4_1 / Q8_0 blocks.
//!
//! The recipe is mllm-NPU's low-bit prefill on a CPU with 8-bit dot products: the weights' own
//! 4- or 8-bit codes are multiplied with the activations' 8-bit codes in integers (AVX-512
//! VNNI `vpdpbusd`, 64 multiply-adds per instruction, four times the f32 FMA's per-instruction
//! work at the same vector width), and only each block's sum is scaled in f32.
//! Two things keep the activations' rounding small. Scales are per 32-value block, so a channel
//! hundreds of times larger than its neighbours coarsens only its own block, not the row. And
//! each row's largest value is mllm-NPU's *shadow outlier*: it is taken out of its block before
//! the block is quantized (the block's scale then follows its other 31 values) and multiplied
//! in f32 on the side, `out[t][r] += x[t][c] · w[r][c]`, with the matrix's column `c` decoded
//! once per task for every token that shares it (a transformer's massive activations sit in a
//! few fixed channels). On the default model this one value per row takes int8 prefill's
//! perplexity cost from +0.65% to +0.2-0.4% over f32 activations (docs/bench-engine.md).
//!
//! Layout: a weight tile is repacked, per thread and per product, into panels of 16 rows in
//! which one 64-byte vector holds four consecutive codes of each of the 16 rows, the shape
//! `vpdpbusd` consumes (sixteen 32-bit lanes, each the dot product of four byte pairs). The
//! activations' four codes are broadcast to every lane, so one instruction advances sixteen
//! outputs. Q4_1's nibbles need no shuffle: byte `j` of a block holds value `j` in its low
//! nibble and value `j + 16` in its high one, so the panel keeps the file's bytes and a mask or
//! a shift yields the two groups. Q8_0's signed codes are offset by 128 to the unsigned operand
//! `vpdpbusd` wants, and `128 Σ x_q` is taken off the integer sum, which stays exact.
//!
//! Every output is the same sequence of f32 operations whatever the batch, the tile or the
//! path: `f = fma(Σ q·x_q, d_w·d_x, f)` then, for Q4_1, `f = fma(m_w, d_x Σ x_q, f)`, block after block.
//! So the portable path (the oracle in tests) and the VNNI path agree bit for bit, and a row's
//! result never depends on which rows it is batched with (prefill in steps of any size and
//! recompute of any set of chunks stay exact).

#[cfg(target_arch = "x86_64")]
pub mod avx2;
#[cfg(target_arch = "x86_64")]
pub mod vnni;

use crate::qmatrix::{BLOCK, IsaCap, Kind, QMatrix};
use half::f16;
use rayon::prelude::*;
use std::cell::RefCell;
use std::sync::OnceLock;

/// Rows of one panel: the lanes of a 512-bit vector of i32.
pub const PANEL: usize = 16;

/// Tokens of one register tile of the VNNI kernel.
const TOKENS: usize = 8;

/// Panels one task repacks and multiplies (rows per task `PANEL * TILE_PANELS`).
const TILE_PANELS: usize = 2;

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
    /// Sum of the block's codes (Q8_0's offset correction).
    qsum: Vec<i32>,
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
        self.shadow.resize(rows, (NO_SHADOW, 0.0));
        // Rows per task: a few thousand values each, so small batches stay on one thread.
        let per = (16384 / cols).max(1);
        x[..rows * cols]
            .par_chunks(per * cols)
            .zip(self.q.par_chunks_mut(per * cols))
            .zip(self.d.par_chunks_mut(per * nb))
            .zip(self.sum.par_chunks_mut(per * nb))
            .zip(self.qsum.par_chunks_mut(per * nb))
            .zip(self.shadow.par_chunks_mut(per))
            .for_each(|(((((x, q), d), sum), qsum), shadow)| {
                quantize_blocks(path, x, q, d, sum, qsum);
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
                    quantize_blocks(
                        path,
                        &blk,
                        &mut q[b * BLOCK..(b + 1) * BLOCK],
                        &mut d[b..b + 1],
                        &mut sum[b..b + 1],
                        &mut qsum[b..b + 1],
                    );
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

/// [`quantize_portable`] on `path` (every path gives the same bits).
fn quantize_blocks(
    path: Path,
    x: &[f32],
    q: &mut [i8],
    d: &mut [f32],
    sum: &mut [f32],
    qsum: &mut [i32],
) {
    assert!(path.available(), "{path:?} path on a CPU without it");
    match path {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has the path's features (asserted above); the vector forms check
        // that the slices hold as many blocks as `x` (32 codes, one of each parameter).
        Path::Vnni => unsafe { vnni::quantize(x, q, d, sum, qsum) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above; every AVX2 path has AVX2.
        Path::Avx2 | Path::AvxVnni => unsafe { avx2::quantize(x, q, d, sum, qsum) },
        _ => quantize_portable(x, q, d, sum, qsum),
    }
}

/// Quantizes 32-value blocks: `d = amax / 127`, codes `round_ties_even(x · 127 / amax)`, the
/// codes' sum and the block's sum as quantized, `d · Σ q`.
///
/// The minimum term of a Q4_1 product takes the quantized sum, not the exact one: then the
/// whole product is exactly `Σ w x̂` for the dequantized activations `x̂`, whose errors
/// multiply the centred weights `d q + m`. With the exact sum they would multiply `d q` alone,
/// all of one sign, and add up instead of cancelling (measured on the real model: the last
/// token's logits 3× further from the f32 oracle).
fn quantize_portable(x: &[f32], q: &mut [i8], d: &mut [f32], sum: &mut [f32], qsum: &mut [i32]) {
    for ((((xb, qb), d), sum), qsum) in x
        .chunks_exact(BLOCK)
        .zip(q.chunks_exact_mut(BLOCK))
        .zip(d)
        .zip(sum)
        .zip(qsum)
    {
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        *d = amax / 127.0;
        let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        let mut t = 0;
        for (q, &v) in qb.iter_mut().zip(xb) {
            *q = (v * inv).round_ties_even() as i8;
            t += i32::from(*q);
        }
        *qsum = t;
        *sum = *d * t as f32;
    }
}

/// Bytes of one panel block: the 16 rows' codes of one 32-value block, then their 16 f16
/// scales and (Q4_1) 16 f16 minimums.
fn panel_block_bytes(kind: Kind) -> usize {
    match kind {
        Kind::Q4_1 => PANEL * 16 + 64,
        Kind::Q8_0 => PANEL * 32 + 32,
        _ => unreachable!("only Q4_1 and Q8_0 matrices are packed in panels"),
    }
}

/// Repacks rows `r0..r1` (at most [`PANEL`]) of `w` into one panel at `out` (rows past `r1` are
/// zero): for each block, the codes as 4-byte groups across the rows (`[group][row][4]`), Q8_0's
/// offset by 128, then the rows' scales and minimums.
fn pack_panel(w: &QMatrix, r0: usize, r1: usize, out: &mut [u8]) {
    let nb = w.cols() / BLOCK;
    let pb = panel_block_bytes(w.kind());
    let (d, m, qs) = w.raw_parts();
    let q4 = w.kind() == Kind::Q4_1;
    let qb = if q4 { 16 } else { 32 };
    let flip = if q4 { 0 } else { 0x8080_8080u32 };
    if r1 - r0 < PANEL {
        out[..nb * pb].fill(0);
    }
    for (i, r) in (r0..r1).enumerate() {
        let row = &qs[r * nb * qb..(r + 1) * nb * qb];
        for (b, src) in row.chunks_exact(qb).enumerate() {
            let o = &mut out[b * pb..(b + 1) * pb];
            for (g, word) in src.chunks_exact(4).enumerate() {
                let v = u32::from_le_bytes([word[0], word[1], word[2], word[3]]) ^ flip;
                o[(g * PANEL + i) * 4..(g * PANEL + i) * 4 + 4].copy_from_slice(&v.to_le_bytes());
            }
            let blk = r * nb + b;
            let p = PANEL * qb;
            o[p + i * 2..p + i * 2 + 2].copy_from_slice(&d[blk].to_le_bytes());
            if q4 {
                o[p + 32 + i * 2..p + 32 + i * 2 + 2].copy_from_slice(&m[blk].to_le_bytes());
            }
        }
    }
}

/// `out[t][c0 + i] = Σ_b …` for the panel's 16 rows (`lanes` of them written) and tokens
/// `t0..t1`, in plain Rust: the reference the VNNI kernel matches bit for bit.
#[allow(clippy::too_many_arguments)]
fn panel_portable(
    kind: Kind,
    panel: &[u8],
    x: &QuantRows,
    (t0, t1): (usize, usize),
    out: &mut [f32],
    ld: usize,
    c0: usize,
    lanes: usize,
) {
    let nb = x.cols / BLOCK;
    let pb = panel_block_bytes(kind);
    let qb = if kind == Kind::Q4_1 { 16 } else { 32 };
    for t in t0..t1 {
        let xq = &x.q[t * x.cols..(t + 1) * x.cols];
        for i in 0..lanes {
            let mut f = 0.0f32;
            for b in 0..nb {
                let o = &panel[b * pb..(b + 1) * pb];
                let xb = &xq[b * BLOCK..(b + 1) * BLOCK];
                let mut acc: i32 = match kind {
                    Kind::Q8_0 => -128 * x.qsum[t * nb + b],
                    _ => 0,
                };
                for g in 0..qb / 4 {
                    for c in 0..4 {
                        let byte = o[(g * PANEL + i) * 4 + c];
                        match kind {
                            Kind::Q4_1 => {
                                acc += i32::from(byte & 0xF) * i32::from(xb[g * 4 + c]);
                                acc += i32::from(byte >> 4) * i32::from(xb[16 + g * 4 + c]);
                            }
                            _ => acc += i32::from(byte) * i32::from(xb[g * 4 + c]),
                        }
                    }
                }
                let p = PANEL * qb;
                let dw = f16::from_le_bytes([o[p + i * 2], o[p + i * 2 + 1]]).to_f32();
                f = (acc as f32).mul_add(dw * x.d[t * nb + b], f);
                if kind == Kind::Q4_1 {
                    let mw = f16::from_le_bytes([o[p + 32 + i * 2], o[p + 33 + i * 2]]).to_f32();
                    f = mw.mul_add(x.sum[t * nb + b], f);
                }
            }
            out[t * ld + c0 + i] = f;
        }
    }
}

/// `out[t][r] = x[t] · w[r]` for every token of `x` and every row of `w` (Q4_1 or Q8_0), on
/// `path`, rows split across the engine's threads.
pub fn product(path: Path, w: &QMatrix, x: &QuantRows, out: &mut [f32]) {
    thread_local! {
        static PANELS: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    }
    assert!(path.available(), "{path:?} path on a CPU without it");
    assert!(
        matches!(w.kind(), Kind::Q4_1 | Kind::Q8_0) && x.cols == w.cols(),
        "int8 product: needs a Q4_1 or Q8_0 matrix of the activations' width"
    );
    let (n, m, k) = (w.rows(), x.rows, w.cols());
    assert!(out.len() >= m * n, "int8 product: output too small");
    if m == 0 || n == 0 {
        return;
    }
    let pb = panel_block_bytes(w.kind());
    let panel_bytes = pb * (k / BLOCK);
    let rows_per_task = PANEL * TILE_PANELS;
    // The address, not the pointer, crosses threads; each task writes only its own columns.
    let addr = out.as_mut_ptr() as usize;
    (0..n.div_ceil(rows_per_task))
        .into_par_iter()
        .for_each(|task| {
            let (r0, r1) = (task * rows_per_task, ((task + 1) * rows_per_task).min(n));
            let panels = (r1 - r0).div_ceil(PANEL);
            PANELS.with_borrow_mut(|buf| {
                if buf.len() < panels * panel_bytes {
                    buf.resize(panels * panel_bytes, 0);
                }
                for p in 0..panels {
                    let pr0 = r0 + p * PANEL;
                    pack_panel(
                        w,
                        pr0,
                        (pr0 + PANEL).min(r1),
                        &mut buf[p * panel_bytes..(p + 1) * panel_bytes],
                    );
                }
                for t0 in (0..m).step_by(TOKENS) {
                    let t1 = (t0 + TOKENS).min(m);
                    for p in 0..panels {
                        let c0 = r0 + p * PANEL;
                        let lanes = (r1 - c0).min(PANEL);
                        let panel = &buf[p * panel_bytes..(p + 1) * panel_bytes];
                        // SAFETY: `product`'s checks and split: the task's own columns.
                        unsafe {
                            panel_on(path, w.kind(), panel, x, (t0, t1), (addr, n), c0, lanes)
                        };
                    }
                }
            });
            add_shadows(w, x, (r0, r1), addr, n);
        });
}

/// Runs one panel's kernel on `path` for tokens `t0..t1` into columns `c0..c0 + lanes` of
/// `out` (at `addr`, rows of `n`).
///
/// # Safety
/// The CPU must have the path's features; the panel must hold `x.cols / 32` blocks of `kind`,
/// `t1 - t0 <= TOKENS` with `t1 <= x.rows`; `out` must hold `x.rows` rows of `n` values with
/// `c0 + lanes <= n`, and no other thread may access those columns of those rows meanwhile.
#[allow(clippy::too_many_arguments)]
unsafe fn panel_on(
    path: Path,
    kind: Kind,
    panel: &[u8],
    x: &QuantRows,
    (t0, t1): (usize, usize),
    (addr, n): (usize, usize),
    c0: usize,
    lanes: usize,
) {
    let q4 = kind == Kind::Q4_1;
    let at = (addr as *mut f32).wrapping_add(t0 * n + c0);
    match path {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the contract: the panel holds k / 32 blocks, x holds its tokens' codes and
        // block parameters, `at` starts t1 - t0 rows of n values of which these columns are
        // ours alone.
        Path::Vnni => unsafe { vnni::panel(q4, panel, x.parts(t0, t1), at, n, lanes) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above; the CPU has AVX-VNNI on that path.
        Path::AvxVnni => unsafe { avx2::panel::<true>(q4, panel, x.parts(t0, t1), at, n, lanes) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Path::Avx2 => unsafe { avx2::panel::<false>(q4, panel, x.parts(t0, t1), at, n, lanes) },
        _ => {
            // SAFETY: as above: these columns of these rows are ours alone, `out` holds x.rows
            // rows of n.
            let out = unsafe { std::slice::from_raw_parts_mut(addr as *mut f32, x.rows * n) };
            panel_portable(kind, panel, x, (t0, t1), out, n, c0, lanes)
        }
    }
}

/// Adds the shadow columns' products to rows `r0..r1` of `out` (at `addr`, rows of `n`): this
/// task's rows of each shadow column, decoded once, then one f32 multiply-add per token and row.
fn add_shadows(w: &QMatrix, x: &QuantRows, (r0, r1): (usize, usize), addr: usize, n: usize) {
    thread_local! {
        static COLUMNS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    }
    COLUMNS.with_borrow_mut(|cols| {
        let width = r1 - r0;
        cols.clear();
        for &c in &x.shadow_cols {
            cols.extend((r0..r1).map(|r| w.value(r, c as usize)));
        }
        for t in 0..x.rows {
            let (_, v) = x.shadow[t];
            let u = x.shadow_idx[t];
            if u == NO_SHADOW {
                continue;
            }
            let u = u as usize;
            let col = &cols[u * width..(u + 1) * width];
            // SAFETY: row t's columns r0..r1 are the calling task's alone (tasks cover disjoint
            // row ranges of w), inside `out`'s x.rows rows of n values; nothing else reads them
            // meanwhile.
            let o = unsafe {
                std::slice::from_raw_parts_mut((addr as *mut f32).add(t * n + r0), width)
            };
            for (o, &wv) in o.iter_mut().zip(col) {
                *o += v * wv;
            }
        }
    });
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
        }
        .slice(t0, t1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(s: &mut u32) -> u32 {
        *s = s.wrapping_mul(1664525).wrapping_add(1013904223);
        *s >> 8
    }

    fn matrix(kind: Kind, rows: usize, cols: usize, seed: u32) -> QMatrix {
        let mut s = seed;
        let mut raw = Vec::new();
        for _ in 0..rows * cols / BLOCK {
            let d = f16::from_f32((lcg(&mut s) % 100) as f32 / 2000.0 + 0.001);
            raw.extend_from_slice(&d.to_le_bytes());
            if kind == Kind::Q4_1 {
                let m = f16::from_f32(-((lcg(&mut s) % 50) as f32) / 200.0);
                raw.extend_from_slice(&m.to_le_bytes());
            }
            for _ in 0..if kind == Kind::Q4_1 { 16 } else { 32 } {
                raw.push(lcg(&mut s) as u8);
            }
        }
        QMatrix::from_raw(rows, cols, kind, &raw)
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

    fn dense(w: &QMatrix) -> Vec<f32> {
        let mut f = vec![0.0; w.rows() * w.cols()];
        w.dequant_rows(0, w.rows(), &mut f);
        f
    }

    /// Every path equals the portable one bit for bit, and all are within the int8 activation
    /// error of the exact f32 product.
    fn check(kind: Kind, rows: usize, cols: usize, tokens: usize) {
        let w = matrix(kind, rows, cols, rows as u32 * 7 + cols as u32);
        let x = acts(tokens, cols, tokens as u32 + 3);
        let mut q = QuantRows::default();
        q.quantize_with(Path::Portable, &x, tokens, cols);
        let mut reference = vec![f32::NAN; tokens * rows];
        product(Path::Portable, &w, &q, &mut reference);
        for path in Path::all_available() {
            let mut out = vec![f32::NAN; tokens * rows];
            product(path, &w, &q, &mut out);
            let same = out
                .iter()
                .zip(&reference)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{path:?} {kind:?} {rows}x{cols} at {tokens} tokens");
        }
        let f = dense(&w);
        let nb = cols / BLOCK;
        for t in 0..tokens {
            for r in 0..rows {
                let xt = &x[t * cols..(t + 1) * cols];
                let exact: f64 = (0..cols)
                    .map(|c| f64::from(f[r * cols + c]) * f64::from(xt[c]))
                    .sum();
                // Each activation is off by at most half its block's step, d_x / 2.
                let bound: f64 = (0..nb)
                    .map(|b| {
                        let wabs: f64 = (0..BLOCK)
                            .map(|j| f64::from(f[r * cols + b * BLOCK + j].abs()))
                            .sum();
                        wabs * f64::from(q.d[t * nb + b]) / 2.0
                    })
                    .sum::<f64>()
                    * 1.01
                    + 1e-4;
                let got = f64::from(reference[t * rows + r]);
                assert!(
                    (got - exact).abs() <= bound,
                    "{kind:?} t{t} r{r}: {got} vs {exact} (bound {bound})"
                );
            }
        }
    }

    #[test]
    fn every_path_matches_the_reference_and_the_exact_product() {
        for kind in [Kind::Q4_1, Kind::Q8_0] {
            check(kind, 16, 32, 1);
            check(kind, 48, 96, 8);
            check(kind, 37, 64, 19);
            check(kind, 80, 576, 11);
            check(kind, 5, 160, 3);
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
        let w = matrix(Kind::Q4_1, 64, 128, 5);
        let x = acts(13, 128, 9);
        let mut all = QuantRows::default();
        all.quantize(&x, 13, 128);
        let mut full = vec![0.0; 13 * 64];
        product(Path::best(), &w, &all, &mut full);
        for t in [0, 6, 12] {
            let mut one = QuantRows::default();
            one.quantize(&x[t * 128..(t + 1) * 128], 1, 128);
            let mut out = vec![0.0; 64];
            product(Path::best(), &w, &one, &mut out);
            assert_eq!(
                out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                full[t * 64..(t + 1) * 64]
                    .iter()
                    .map(|v| v.to_bits())
                    .collect::<Vec<_>>()
            );
        }
    }
}
