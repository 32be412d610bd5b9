//! The engine's numeric kernels on plain slices: f32 matrix products, RMSNorm, RoPE, SwiGLU, softmax.
//!
//! Matrix products go to the `gemm` crate (the one candle-core uses on CPU), called directly so
//! that no tensor is allocated per call; everything else is simple loops the compiler vectorises.

pub mod coded;
mod rows;

pub use rows::*;

use crate::qmatrix::{Isa, f16_bytes_to_f32_with};
use crate::simd;
use gemm::Parallelism;

/// Threads the engine's parallel kernels use (the rayon pool's size).
pub fn threads() -> usize {
    rayon::current_num_threads()
}

fn parallelism(m: usize, n: usize, k: usize) -> Parallelism {
    let t = threads();
    // Small products are not worth waking a second thread for.
    if t > 1 && m * n * k >= 1 << 18 {
        Parallelism::Rayon(t)
    } else {
        Parallelism::None
    }
}

/// `dst[m][n] = a[m][k] · b[n][k]ᵀ`, all row-major (b holds one output's weights per row).
pub fn matmul_nt(dst: &mut [f32], a: &[f32], b: &[f32], m: usize, n: usize, k: usize) {
    // bᵀ is k×n read from b[n][k]: column stride k, row stride 1.
    matmul(dst, a, b, (m, n, k), (k as isize, 1));
}

/// Depth of one GEMM call in a batched product: the inner dimension is cut in slices of at most
/// this many, each slice's product added to the last. The `gemm` crate picks its own blocking
/// along the inner dimension, hence its rounding, from the product's shape (512 for up to 64
/// rows, `k / ceil(k / 512)` beyond); at this depth it never splits, so a row's rounding is the
/// same whatever the number of rows it is batched with. Prefill in steps of any size and
/// recompute of any set of chunks thus compute every row bit for bit alike.
pub const GEMM_DEPTH: usize = 512;

/// Fewest rows a batched product runs with (zero-padded): with weight tiles of at least 16
/// columns, the `gemm` crate's other kernels for tiny products (at most 256 outputs per call,
/// or a single row) never see a batch, and they round differently.
pub const GEMM_MIN_BATCH: usize = 32;

/// `dst[m][n] = a[m][k] · b[n][k]ᵀ` where `b` is never whole in memory: `tile(r0, r1, buf)`
/// writes its rows `r0..r1` (f32, `k` each) into `buf`, a thread's reusable buffer of
/// `tile_rows * k` values, and each tile's product runs on its own thread, in slices of
/// [`GEMM_DEPTH`] along `k`, with at least [`GEMM_MIN_BATCH`] rows.
pub fn matmul_nt_tiled<F>(
    dst: &mut [f32],
    a: &[f32],
    m: usize,
    n: usize,
    k: usize,
    tile_rows: usize,
    tile: F,
) where
    F: Fn(usize, usize, &mut [f32]) + Sync,
{
    use rayon::prelude::*;
    use std::cell::RefCell;
    thread_local! {
        static TILE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    }
    assert!(
        dst.len() >= m * n && a.len() >= m * k && tile_rows > 0,
        "matmul_nt_tiled: bad sizes"
    );
    if m == 0 || n == 0 {
        return;
    }
    // A small batch runs on padded copies.
    let rows = m.max(GEMM_MIN_BATCH);
    let (mut pa, mut pd) = (Vec::new(), Vec::new());
    let (a, dst_all): (&[f32], &mut [f32]) = if rows == m {
        (&a[..m * k], &mut dst[..m * n])
    } else {
        pa.resize(rows * k, 0.0);
        pa[..m * k].copy_from_slice(&a[..m * k]);
        pd.resize(rows * n, 0.0);
        (&pa, &mut pd)
    };
    // The address, not the pointer, crosses threads; each task writes only its own columns.
    let addr = dst_all.as_mut_ptr() as usize;
    (0..n.div_ceil(tile_rows)).into_par_iter().for_each(|t| {
        let (r0, r1) = (t * tile_rows, ((t + 1) * tile_rows).min(n));
        TILE.with_borrow_mut(|buf| {
            if buf.len() < tile_rows * k {
                buf.resize(tile_rows * k, 0.0);
            }
            let b = &mut buf[..(r1 - r0) * k];
            tile(r0, r1, b);
            for k0 in (0..k).step_by(GEMM_DEPTH) {
                let k1 = (k0 + GEMM_DEPTH).min(k);
                // SAFETY: dst_all is borrowed mutably for this whole call and holds `rows` rows
                // of n values (asserted above, or padded to that); tasks cover disjoint column
                // ranges r0..r1 of it, so no two threads touch the same element, and nothing
                // else reads dst_all meanwhile.
                unsafe { matmul_nt_cols(addr as *mut f32, n, r0, a, b, (rows, r1 - r0, k), k0..k1) }
            }
        });
    });
    if rows != m {
        dst[..m * n].copy_from_slice(&pd[..m * n]);
    }
}

/// Columns `c0..c0 + n` of `dst[m][ld]` `= a[m][k] · b[n][k]ᵀ` over the inner slice `ks` only,
/// added to what `dst` holds unless the slice starts at 0; single-threaded: one tile of a
/// product whose weight rows are dequantized a tile at a time (see `Linear::forward`).
///
/// # Safety
/// `dst` must be valid for writes of `m` rows of `ld` values, `c0 + n <= ld`, and no other
/// thread may read or write those columns of those rows while this runs.
unsafe fn matmul_nt_cols(
    dst: *mut f32,
    ld: usize,
    c0: usize,
    a: &[f32],
    b: &[f32],
    (m, n, k): (usize, usize, usize),
    ks: std::ops::Range<usize>,
) {
    assert!(
        a.len() >= m * k && b.len() >= n * k && c0 + n <= ld && ks.start < ks.end && ks.end <= k,
        "matmul_nt_cols: bad sizes"
    );
    if m == 0 || n == 0 {
        return;
    }
    let accumulate = ks.start > 0;
    // SAFETY: the caller guarantees dst rows of ld values with columns c0..c0+n its own; a is
    // m×k with row stride k and b is n×k read as k×n (column stride k, row stride 1); both are
    // read from column ks.start for ks.len() columns, inside their slices by the assert above.
    unsafe {
        gemm::gemm(
            m,
            n,
            ks.len(),
            dst.add(c0),
            1,
            ld as isize,
            accumulate,
            a.as_ptr().add(ks.start),
            1,
            k as isize,
            b.as_ptr().add(ks.start),
            k as isize,
            1,
            if accumulate { 1.0 } else { 0.0 },
            1.0,
            false,
            false,
            false,
            Parallelism::None,
        )
    }
}

/// `dst[m][n] = a[m][k] · b[k][n]`, all row-major.
pub fn matmul_nn(dst: &mut [f32], a: &[f32], b: &[f32], m: usize, n: usize, k: usize) {
    // b is k×n row-major: column stride 1, row stride n.
    matmul(dst, a, b, (m, n, k), (1, n as isize));
}

/// `dst[m][n] = a[m][k] · b[k][n]` (or `+=` when `accumulate`) on the calling thread, with row
/// strides `dst_rs` and `a_rs` and `b` given by its (column, row) strides: attention's products
/// over a window of a wider score matrix. The shapes alone decide the rounding (see
/// [`GEMM_DEPTH`]).
#[allow(clippy::too_many_arguments)]
pub fn matmul_serial(
    dst: &mut [f32],
    dst_rs: usize,
    a: &[f32],
    a_rs: usize,
    b: &[f32],
    (b_cs, b_rs): (usize, usize),
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        dst_rs >= n
            && a_rs >= k
            && dst.len() >= (m - 1) * dst_rs + n
            && (k == 0 || a.len() >= (m - 1) * a_rs + k)
            && (k == 0 || b.len() > (n - 1) * b_cs + (k - 1) * b_rs),
        "matmul_serial: bad sizes"
    );
    let alpha = if accumulate { 1.0 } else { 0.0 };
    // SAFETY: the assert above keeps every access inside the slices: dst rows i < m of n values
    // at i * dst_rs, a rows of k values at i * a_rs, and b element (kk, j) at
    // j * b_cs + kk * b_rs for kk < k, j < n. dst does not alias a or b (a &mut borrow).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            accumulate,
            a.as_ptr(),
            1,
            a_rs as isize,
            b.as_ptr(),
            b_cs as isize,
            b_rs as isize,
            alpha,
            1.0,
            false,
            false,
            false,
            Parallelism::None,
        )
    }
}

/// `dst = a · b` with dst m×n and a m×k row-major, and b k×n with the given (column, row)
/// strides, both positive and addressing at most n·k elements.
fn matmul(
    dst: &mut [f32],
    a: &[f32],
    b: &[f32],
    (m, n, k): (usize, usize, usize),
    (b_cs, b_rs): (isize, isize),
) {
    assert!(
        dst.len() >= m * n && a.len() >= m * k && b.len() >= n * k,
        "matmul: bad sizes"
    );
    if m == 0 || n == 0 {
        return;
    }
    // SAFETY: the assert above keeps every access of gemm inside the three slices: dst is m×n
    // with row stride n, lhs a is m×k with row stride k, and both callers' rhs strides address
    // exactly the n·k elements of b. dst does not alias a or b (it is a &mut borrow).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            1,
            k as isize,
            b.as_ptr(),
            b_cs,
            b_rs,
            0.0,
            1.0,
            false,
            false,
            false,
            parallelism(m, n, k),
        )
    }
}

/// `Σ a b` over two rows of equal length (the AVX2 path sums in another order).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    dot_with(Isa::best(), a, b)
}

/// [`dot`] on a given path (which must be [`Isa::available`]).
fn dot_with(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: callers pass a path this CPU has.
        Isa::Avx2 | Isa::Avx512 => unsafe { simd::avx2::dot_f32(a, b) },
        _ => {
            // Eight accumulators let the compiler keep independent vector FMAs in flight.
            let mut acc = [0.0f32; 8];
            let (ac, ar) = a.split_at(a.len() / 8 * 8);
            let (bc, br) = b.split_at(ac.len());
            for (x, y) in ac.chunks_exact(8).zip(bc.chunks_exact(8)) {
                for i in 0..8 {
                    acc[i] += x[i] * y[i];
                }
            }
            let mut s: f32 = acc.iter().sum();
            for (x, y) in ar.iter().zip(br) {
                s += x * y;
            }
            s
        }
    }
}

/// `y += a x` over rows of equal length.
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    axpy_with(Isa::best(), y, a, x)
}

/// [`axpy`] on a given path (which must be [`Isa::available`]).
fn axpy_with(isa: Isa, y: &mut [f32], a: f32, x: &[f32]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: callers pass a path this CPU has.
        Isa::Avx2 | Isa::Avx512 => unsafe { simd::avx2::axpy_f32(y, a, x) },
        _ => {
            for (y, x) in y.iter_mut().zip(x) {
                *y += a * x;
            }
        }
    }
}

/// `row = softmax(scale · row)` in place (`scale > 0`): the row then sums to 1.
pub fn softmax(row: &mut [f32], scale: f32) {
    softmax_with(Isa::best(), row, scale);
}

/// [`softmax`] on a given path.
pub fn softmax_with(isa: Isa, row: &mut [f32], scale: f32) {
    assert!(isa.available(), "{isa:?} path on a CPU without it");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX2, FMA and F16C (asserted above).
        Isa::Avx2 => unsafe { simd::avx2::softmax(row, scale) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX-512 F, BW and VL, FMA and F16C (asserted above).
        Isa::Avx512 => unsafe { simd::avx512::softmax(row, scale) },
        _ => {
            let (_, sum) = softmax_exp_with(isa, row, scale);
            let inv = 1.0 / sum;
            for v in row.iter_mut() {
                *v *= inv;
            }
        }
    }
}

/// `row = e^(scale · row - max)` in place, `max` being `scale` times the row's largest value
/// (`scale > 0`); returns `(max, Σ row)`. A softmax before its normalization: pieces of one row
/// done apart are put together by scaling each by `e^(max_piece - max_row)`. An empty row gives
/// `(-∞, 0)`.
pub fn softmax_exp(row: &mut [f32], scale: f32) -> (f32, f32) {
    softmax_exp_with(Isa::best(), row, scale)
}

/// [`softmax_exp`] on a given path.
pub fn softmax_exp_with(isa: Isa, row: &mut [f32], scale: f32) -> (f32, f32) {
    assert!(isa.available(), "{isa:?} path on a CPU without it");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX2, FMA and F16C (asserted above).
        Isa::Avx2 => unsafe { simd::avx2::softmax_exp(row, scale) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX-512 F, BW and VL, FMA and F16C (asserted above).
        Isa::Avx512 => unsafe { simd::avx512::softmax_exp(row, scale) },
        _ => {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) * scale;
            let mut sum = 0.0;
            for v in row.iter_mut() {
                *v = (*v * scale - max).exp();
                sum += *v;
            }
            (max, sum)
        }
    }
}

/// `out[i] = q · keys[i q.len()..(i + 1) q.len()]`: one query row against consecutive keys.
pub fn dot_rows(q: &[f32], keys: &[f32], out: &mut [f32]) {
    dot_rows_with(Isa::best(), q, keys, out);
}

/// [`dot_rows`] on a given path (each path sums in its own order).
pub fn dot_rows_with(isa: Isa, q: &[f32], keys: &[f32], out: &mut [f32]) {
    assert!(isa.available(), "{isa:?} path on a CPU without it");
    let hd = q.len();
    assert!(keys.len() >= out.len() * hd, "dot_rows: short keys");
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 && hd.is_multiple_of(16) {
        // SAFETY: the CPU has AVX-512 F, BW and VL, FMA and F16C (asserted above), and q's
        // length is a multiple of 16.
        return unsafe { simd::avx512::kv::dot_rows(q, keys, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() && hd.is_multiple_of(8) {
        // SAFETY: the CPU has AVX2, FMA and F16C (asserted above), and q's length is a
        // multiple of 8.
        return unsafe { simd::avx2::kv::dot_rows(q, keys, out) };
    }
    for (o, k) in out.iter_mut().zip(keys.chunks_exact(hd.max(1))) {
        *o = dot_with(isa, q, k);
    }
}

/// `o += Σ_i w[i] vals[i o.len()..(i + 1) o.len()]`: a weighted sum of consecutive value rows.
pub fn axpy_rows(o: &mut [f32], w: &[f32], vals: &[f32]) {
    axpy_rows_with(Isa::best(), o, w, vals);
}

/// [`axpy_rows`] on a given path (each path sums in its own order).
pub fn axpy_rows_with(isa: Isa, o: &mut [f32], w: &[f32], vals: &[f32]) {
    assert!(isa.available(), "{isa:?} path on a CPU without it");
    let hd = o.len();
    assert!(vals.len() >= w.len() * hd, "axpy_rows: short values");
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 && hd.is_multiple_of(16) {
        // SAFETY: the CPU has AVX-512 F, BW and VL, FMA and F16C (asserted above), and o's
        // length is a multiple of 16.
        return unsafe { simd::avx512::kv::axpy_rows(o, w, vals) };
    }
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() && hd.is_multiple_of(8) {
        // SAFETY: the CPU has AVX2, FMA and F16C (asserted above), and o's length is a
        // multiple of 8.
        return unsafe { simd::avx2::kv::axpy_rows(o, w, vals) };
    }
    for (&a, v) in w.iter().zip(vals.chunks_exact(hd.max(1))) {
        axpy_with(isa, o, a, v);
    }
}

/// Decodes rows of packed unsigned codes: `out[r][c] = mins[i] + code(r, c) · scales[i]` for
/// every row `r` of `out` (`hd` values a row), where row r's codes start at packed value
/// `first + r · hd` of `codes` (`bits` = 2, 3, 4 or 8 bits each, little end first; rows start
/// on a byte) and `i` is `c` (parameters per channel, the keys of a chunk) or `r` (per row, its
/// values).
#[allow(clippy::too_many_arguments)]
pub fn decode_codes(
    codes: &[u8],
    first: usize,
    bits: usize,
    hd: usize,
    mins: &[f32],
    scales: &[f32],
    per_row: bool,
    out: &mut [f32],
) {
    decode_codes_with(
        Isa::best(),
        codes,
        first,
        bits,
        hd,
        mins,
        scales,
        per_row,
        out,
    );
}

/// [`decode_codes`] on a given path (every path gives the same bits).
#[allow(clippy::too_many_arguments)]
pub fn decode_codes_with(
    isa: Isa,
    codes: &[u8],
    first: usize,
    bits: usize,
    hd: usize,
    mins: &[f32],
    scales: &[f32],
    per_row: bool,
    out: &mut [f32],
) {
    assert!(isa.available(), "{isa:?} path on a CPU without it");
    assert!(
        matches!(bits, 2 | 3 | 4 | 8),
        "decode_codes: {bits}-bit codes"
    );
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 && hd.is_multiple_of(16) {
        // SAFETY: the CPU has AVX-512 F, BW and VL, FMA and F16C (asserted above); the kernel
        // checks the sizes itself.
        unsafe {
            let f = match bits {
                2 => simd::avx512::kv::decode_codes::<2>,
                3 => simd::avx512::kv::decode_codes::<3>,
                4 => simd::avx512::kv::decode_codes::<4>,
                _ => simd::avx512::kv::decode_codes::<8>,
            };
            return f(codes, first, hd, mins, scales, per_row, out);
        }
    }
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() && hd.is_multiple_of(8) {
        // SAFETY: the CPU has AVX2, FMA and F16C (asserted above); the kernel checks the sizes
        // itself.
        unsafe {
            let f = match bits {
                2 => simd::avx2::kv::decode_codes::<2>,
                3 => simd::avx2::kv::decode_codes::<3>,
                4 => simd::avx2::kv::decode_codes::<4>,
                _ => simd::avx2::kv::decode_codes::<8>,
            };
            return f(codes, first, hd, mins, scales, per_row, out);
        }
    }
    for (r, o) in out.chunks_exact_mut(hd).enumerate() {
        unpack_codes(codes, first + r * hd, bits, o);
        if per_row {
            for o in o.iter_mut() {
                *o = mins[r] + *o * scales[r];
            }
        } else {
            for ((o, m), s) in o.iter_mut().zip(mins).zip(scales) {
                *o = m + *o * s;
            }
        }
    }
}

/// Decodes the coded parameters of KV groups: for each `(m, j)` byte pair of `pairs`,
/// `mins[i] = m as i8 · step` and `scales[i] = (amax · steps[j & 7]) · 2^-(j >> 3)`, the
/// products in that order on every path (so every path gives the same bits as the codec's
/// `coded_scale`).
pub fn decode_coded_params(
    pairs: &[u8],
    amax: f32,
    step: f32,
    steps: &[f32; 8],
    mins: &mut [f32],
    scales: &mut [f32],
) {
    decode_coded_params_with(Isa::best(), pairs, amax, step, steps, mins, scales);
}

/// [`decode_coded_params`] on a given path.
pub fn decode_coded_params_with(
    isa: Isa,
    pairs: &[u8],
    amax: f32,
    step: f32,
    steps: &[f32; 8],
    mins: &mut [f32],
    scales: &mut [f32],
) {
    assert!(isa.available(), "{isa:?} path on a CPU without it");
    let n = mins.len();
    assert!(
        scales.len() == n && pairs.len() >= 2 * n,
        "decode_coded_params: bad sizes"
    );
    // The AVX-512 path decodes whole vectors of sixteen pairs; the rest is decoded here.
    #[allow(unused_mut)]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        // SAFETY: the CPU has AVX-512 F, BW and VL, FMA and F16C (asserted above); the kernel
        // checks the sizes itself.
        done = unsafe {
            simd::avx512::kv::decode_coded_params(pairs, amax, step, steps, mins, scales)
        };
    } else if isa.has_avx2() {
        // SAFETY: the CPU has AVX2, FMA and F16C (asserted above); the kernel checks the sizes
        // itself.
        done =
            unsafe { simd::avx2::kv::decode_coded_params(pairs, amax, step, steps, mins, scales) };
    }
    let (mins, scales, pairs) = (&mut mins[done..], &mut scales[done..], &pairs[2 * done..]);
    for (i, (m, s)) in mins.iter_mut().zip(scales.iter_mut()).enumerate() {
        *m = f32::from(pairs[2 * i] as i8) * step;
        let j = pairs[2 * i + 1];
        *s = amax * steps[usize::from(j & 7)] * f32::from_bits((127 - u32::from(j >> 3)) << 23);
    }
}

/// Folds a KV chunk's group parameters into one query row (or row of attention weights) `x`:
/// writes `x · scales` to `out` and returns `x · mins`, the row's bias, in one pass over the
/// row (sixteen lanes at a time on the AVX-512 path, eight elsewhere).
#[inline]
pub fn fold_params(x: &[f32], mins: &[f32], scales: &[f32], out: &mut [f32]) -> f32 {
    fold_params_with(Isa::best(), x, mins, scales, out)
}

/// [`fold_params`] on a given path (each sums the bias in its own order).
// One index runs over four arrays at once.
#[allow(clippy::needless_range_loop)]
#[inline]
pub fn fold_params_with(isa: Isa, x: &[f32], mins: &[f32], scales: &[f32], out: &mut [f32]) -> f32 {
    let n = x.len();
    assert!(
        mins.len() == n && scales.len() == n && out.len() == n,
        "fold_params: bad sizes"
    );
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        assert!(isa.available(), "{isa:?} path on a CPU without it");
        // SAFETY: the CPU has AVX-512 F, BW and VL, FMA and F16C (asserted); the sizes are
        // asserted above.
        return unsafe { simd::avx512::kv::fold_params(x, mins, scales, out) };
    }
    let mut acc = [0.0f32; 8];
    let whole = n / 8 * 8;
    for (((o, x), m), s) in out[..whole]
        .chunks_exact_mut(8)
        .zip(x.chunks_exact(8))
        .zip(mins.chunks_exact(8))
        .zip(scales.chunks_exact(8))
    {
        for i in 0..8 {
            o[i] = x[i] * s[i];
            acc[i] += x[i] * m[i];
        }
    }
    let mut bias = acc.iter().sum::<f32>();
    for i in whole..n {
        out[i] = x[i] * scales[i];
        bias += x[i] * mins[i];
    }
    bias
}

/// How KV values are stored: packed unsigned codes of 2, 3, 4 or 8 bits (int4, int2 and the
/// coded formats), signed bytes (int8), or little-endian f16.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Codes {
    Unsigned(usize),
    Signed8,
    F16,
}

impl Codes {
    /// Bits per value.
    pub fn bits(self) -> usize {
        match self {
            Codes::Unsigned(b) => b,
            Codes::Signed8 => 8,
            Codes::F16 => 16,
        }
    }
}

/// Calls the kernel `$m::$f::<K, R>` (`$m` the module of `simd::avx512` or `simd::avx2::kv`)
/// for `$kind` (its `K`, see `simd::SIGNED8`) on `$k` rows (`R`, 1 to 3), with the arguments
/// `$pre`, the rows' biases from `$b`, then `$post`.
#[cfg(target_arch = "x86_64")]
macro_rules! rows_kernel {
    ($m:path, $kind:expr, $k:expr, $b:expr, $f:ident, [$($pre:expr),*], [$($post:expr),*]) => {
        match $kind {
            Codes::Unsigned(2) => rows_kernel!(@k $m, $k, $b, $f, 2, [$($pre),*], [$($post),*]),
            Codes::Unsigned(3) => rows_kernel!(@k $m, $k, $b, $f, 3, [$($pre),*], [$($post),*]),
            Codes::Unsigned(4) => rows_kernel!(@k $m, $k, $b, $f, 4, [$($pre),*], [$($post),*]),
            Codes::Unsigned(_) => rows_kernel!(@k $m, $k, $b, $f, 8, [$($pre),*], [$($post),*]),
            Codes::Signed8 => {
                rows_kernel!(@k $m, $k, $b, $f, { simd::SIGNED8 }, [$($pre),*], [$($post),*])
            }
            Codes::F16 => {
                rows_kernel!(@k $m, $k, $b, $f, { simd::HALF }, [$($pre),*], [$($post),*])
            }
        }
    };
    (@k $m:path, $k:expr, $b:expr, $f:ident, $kind:tt, [$($pre:expr),*], [$($post:expr),*]) => {{
        use $m as m;
        match $k {
            3 => m::$f::<$kind, 3>($($pre,)* [$b[0], $b[1], $b[2]], $($post),*),
            2 => m::$f::<$kind, 2>($($pre,)* [$b[0], $b[1]], $($post),*),
            _ => m::$f::<$kind, 1>($($pre,)* [$b[0]], $($post),*),
        }
    }};
}

/// Scores of `rows` query rows against `n` keys stored as codes, without decoding the keys:
/// `out[r · stride + j] = bias[r] + Σ_d q[r · hd + d] · code(j, d)` for every row r of `bias`,
/// where key j's codes start at packed value `first + j · hd` of `codes`. With keys
/// `min_c + code · scale_c`, `q` holds the query rows times the scales and `bias` their dot
/// products with the minimums. Each key is converted once for all the rows (three at a time on
/// the AVX-512 path).
#[allow(clippy::too_many_arguments)]
pub fn dot_rows_codes(
    q: &[f32],
    bias: &[f32],
    codes: &[u8],
    first: usize,
    kind: Codes,
    hd: usize,
    out: &mut [f32],
    stride: usize,
    n: usize,
) {
    dot_rows_codes_with(Isa::best(), q, bias, codes, first, kind, hd, out, stride, n);
}

/// [`dot_rows_codes`] on a given path (each path sums in its own order).
#[allow(clippy::too_many_arguments)]
pub fn dot_rows_codes_with(
    isa: Isa,
    q: &[f32],
    bias: &[f32],
    codes: &[u8],
    first: usize,
    kind: Codes,
    hd: usize,
    out: &mut [f32],
    stride: usize,
    n: usize,
) {
    assert!(isa.available(), "{isa:?} path on a CPU without it");
    assert!(
        matches!(
            kind,
            Codes::Unsigned(2 | 3 | 4 | 8) | Codes::Signed8 | Codes::F16
        ),
        "dot_rows_codes: {kind:?}"
    );
    let rows = bias.len();
    assert!(
        hd > 0 && hd <= 256 && q.len() >= rows * hd,
        "dot_rows_codes: bad sizes"
    );
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() && hd.is_multiple_of(8) {
        let wide = isa == Isa::Avx512 && hd.is_multiple_of(16);
        let mut r = 0;
        while r < rows {
            let k = (rows - r).min(3);
            let (q, out) = (&q[r * hd..], &mut out[r * stride..]);
            let b = &bias[r..r + k];
            // SAFETY: the CPU has AVX2, FMA and F16C, and AVX-512 F, BW and VL if `wide`
            // (asserted above); the kernels check the sizes themselves.
            unsafe {
                if wide {
                    rows_kernel!(
                        simd::avx512::kv,
                        kind,
                        k,
                        b,
                        dot_rows_stored,
                        [q, hd],
                        [codes, first, out, stride, n]
                    )
                } else {
                    rows_kernel!(
                        simd::avx2::kv,
                        kind,
                        k,
                        b,
                        dot_rows_stored,
                        [q, hd],
                        [codes, first, out, stride, n]
                    )
                }
            };
            r += k;
        }
        return;
    }
    let mut key = [0f32; 256];
    for j in 0..n {
        let key = &mut key[..hd];
        unpack_kind(codes, first + j * hd, kind, key);
        for (r, b) in bias.iter().enumerate() {
            out[r * stride + j] = b + dot_with(isa, &q[r * hd..(r + 1) * hd], key);
        }
    }
}

/// Output rows summed from `n` value rows stored as codes, without decoding them:
/// `o[r · hd + d] += bias[r] + Σ_i w[r · wstride + i] · code(i, d)` for every row r of `bias`,
/// where value row i's codes start at packed value `first + i · hd`. With values
/// `min_i + code · scale_i`, `w` holds the attention weights times the scales and `bias` their
/// dot products with the minimums. Each value row is converted once for all the rows.
#[allow(clippy::too_many_arguments)]
pub fn axpy_rows_codes(
    o: &mut [f32],
    bias: &[f32],
    w: &[f32],
    wstride: usize,
    n: usize,
    codes: &[u8],
    first: usize,
    kind: Codes,
    hd: usize,
) {
    axpy_rows_codes_with(Isa::best(), o, bias, w, wstride, n, codes, first, kind, hd);
}

/// [`axpy_rows_codes`] on a given path (each path sums in its own order).
#[allow(clippy::too_many_arguments)]
pub fn axpy_rows_codes_with(
    isa: Isa,
    o: &mut [f32],
    bias: &[f32],
    w: &[f32],
    wstride: usize,
    n: usize,
    codes: &[u8],
    first: usize,
    kind: Codes,
    hd: usize,
) {
    assert!(isa.available(), "{isa:?} path on a CPU without it");
    assert!(
        matches!(
            kind,
            Codes::Unsigned(2 | 3 | 4 | 8) | Codes::Signed8 | Codes::F16
        ),
        "axpy_rows_codes: {kind:?}"
    );
    let rows = bias.len();
    assert!(
        hd > 0 && hd <= 256 && o.len() >= rows * hd,
        "axpy_rows_codes: bad sizes"
    );
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() && hd.is_multiple_of(8) {
        let wide = isa == Isa::Avx512 && hd.is_multiple_of(16);
        let mut r = 0;
        while r < rows {
            let k = (rows - r).min(3);
            let (o, w) = (&mut o[r * hd..], &w[r * wstride..]);
            let b = &bias[r..r + k];
            // SAFETY: as in `dot_rows_codes_with`.
            unsafe {
                if wide {
                    rows_kernel!(
                        simd::avx512::kv,
                        kind,
                        k,
                        b,
                        axpy_rows_stored,
                        [o, hd],
                        [w, wstride, n, codes, first]
                    )
                } else {
                    rows_kernel!(
                        simd::avx2::kv,
                        kind,
                        k,
                        b,
                        axpy_rows_stored,
                        [o, hd],
                        [w, wstride, n, codes, first]
                    )
                }
            };
            r += k;
        }
        return;
    }
    for (r, b) in bias.iter().enumerate() {
        for x in &mut o[r * hd..(r + 1) * hd] {
            *x += b;
        }
    }
    let mut val = [0f32; 256];
    for i in 0..n {
        let val = &mut val[..hd];
        unpack_kind(codes, first + i * hd, kind, val);
        for r in 0..rows {
            axpy_with(isa, &mut o[r * hd..(r + 1) * hd], w[r * wstride + i], val);
        }
    }
}

/// Unpacks `out.len()` codes of `kind` starting at packed value `first` (on a byte).
fn unpack_kind(q: &[u8], first: usize, kind: Codes, out: &mut [f32]) {
    match kind {
        Codes::Unsigned(bits) => unpack_codes(q, first, bits, out),
        Codes::Signed8 => {
            for (o, b) in out.iter_mut().zip(&q[first..]) {
                *o = f32::from(*b as i8);
            }
        }
        Codes::F16 => {
            f16_bytes_to_f32_with(Isa::Portable, &q[2 * first..2 * (first + out.len())], out)
        }
    }
}

/// Unpacks `out.len()` unsigned `bits`-bit codes starting at packed value `first` (on a byte).
fn unpack_codes(q: &[u8], first: usize, bits: usize, out: &mut [f32]) {
    if bits == 8 {
        let n = out.len();
        for (o, b) in out.iter_mut().zip(&q[first..first + n]) {
            *o = f32::from(*b);
        }
        return;
    }
    if bits == 3 {
        // 8 values in every 3 bytes.
        let bytes = &q[first * 3 / 8..(first + out.len()) * 3 / 8];
        for (o, b) in out.chunks_exact_mut(8).zip(bytes.chunks_exact(3)) {
            let w = u32::from(b[0]) | u32::from(b[1]) << 8 | u32::from(b[2]) << 16;
            for (j, o) in o.iter_mut().enumerate() {
                *o = ((w >> (3 * j)) & 7) as f32;
            }
        }
        return;
    }
    let per = 8 / bits;
    let bytes = &q[first / per..(first + out.len()).div_ceil(per)];
    let mask = (1u8 << bits) - 1;
    for (o, b) in out.chunks_exact_mut(per).zip(bytes) {
        for (j, o) in o.iter_mut().enumerate() {
            *o = ((b >> (j * bits)) & mask) as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `sum_squares` is within its rounding bound of the exact sum at every length around its
    /// sixteen lanes.
    #[test]
    fn sum_squares_is_within_rounding_of_the_exact_sum() {
        for len in [0, 1, 5, 15, 16, 17, 31, 33, 640, 2049] {
            let x: Vec<f32> = (0..len)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 13.0)
                .collect();
            let exact: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
            // At most len / 16 + 4 additions in a row, each within u of its running sum.
            let bound = (len / 16 + 6) as f64 * f64::from(f32::EPSILON) * exact;
            let got = f64::from(sum_squares(&x));
            assert!((got - exact).abs() <= bound, "{len}: {got} vs {exact}");
        }
    }

    /// The row-wise kernels give each row the bits it gets alone, however many rows a call
    /// holds (a batch's rows are split across the threads).
    #[test]
    fn row_kernels_give_a_row_the_same_bits_in_any_batch() {
        let (rows, d) = (300, 96);
        let x: Vec<f32> = (0..rows * 2 * d)
            .map(|i| ((i * 7919 % 2003) as f32 - 1000.0) / 300.0)
            .collect();
        let w: Vec<f32> = (0..d).map(|i| 0.5 + i as f32 / 97.0).collect();
        let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(a, b)| a.to_bits() == b.to_bits());
        let mut all = vec![0.0; rows * d];
        rms_norm(&mut all, &x[..rows * d], &w, 1e-6);
        let mut inplace = x[..rows * d].to_vec();
        rms_norm_in_place(&mut inplace, &w, 1e-6);
        let (mut sw, mut ge) = (vec![0.0; rows * d], vec![0.0; rows * d]);
        swiglu(&mut sw, &x, d);
        geglu(&mut ge, &x, d);
        let mut sum = x[..rows * d].to_vec();
        add_assign(&mut sum, &x[rows * d..]);
        for r in 0..rows {
            let (row, gu) = (&x[r * d..(r + 1) * d], &x[r * 2 * d..(r + 1) * 2 * d]);
            let mut one = vec![0.0; d];
            rms_norm(&mut one, row, &w, 1e-6);
            assert!(same(&one, &all[r * d..(r + 1) * d]), "rms_norm row {r}");
            assert!(
                same(&one, &inplace[r * d..(r + 1) * d]),
                "rms_norm_in_place row {r}"
            );
            swiglu(&mut one, gu, d);
            assert!(same(&one, &sw[r * d..(r + 1) * d]), "swiglu row {r}");
            geglu(&mut one, gu, d);
            assert!(same(&one, &ge[r * d..(r + 1) * d]), "geglu row {r}");
            for (j, v) in sum[r * d..(r + 1) * d].iter().enumerate() {
                assert_eq!(
                    *v,
                    x[r * d + j] + x[rows * d + r * d + j],
                    "add_assign row {r}"
                );
            }
        }
    }

    /// Every path's softmax is within a few ulp of an f64 softmax, whatever the row's length
    /// (tails of 1 to 7 past the vectors) and range (scores far below the row's largest give
    /// 0 or nearly), and sums to 1.
    #[test]
    fn softmax_paths_agree_with_f64() {
        let mut s = 7u32;
        let mut next = || {
            s = s.wrapping_mul(1664525).wrapping_add(1013904223);
            (s >> 8) as f32 / (1u32 << 24) as f32
        };
        for len in [1, 2, 7, 8, 9, 16, 31, 100, 513] {
            for spread in [0.1f32, 10.0, 400.0] {
                let row: Vec<f32> = (0..len).map(|_| (next() - 0.5) * spread).collect();
                let scale = 0.125;
                let m = row
                    .iter()
                    .fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v)));
                let e: Vec<f64> = row
                    .iter()
                    .map(|&v| ((f64::from(v) - m) * f64::from(scale)).exp())
                    .collect();
                let sum: f64 = e.iter().sum();
                for isa in Isa::all_available() {
                    let mut got = row.clone();
                    softmax_with(isa, &mut got, scale);
                    let total: f64 = got.iter().map(|&v| f64::from(v)).sum();
                    assert!(
                        (total - 1.0).abs() < 1e-5,
                        "{isa:?} len {len}: sums to {total}"
                    );
                    for ((g, w), &v) in got.iter().zip(&e).zip(&row) {
                        let want = w / sum;
                        // The scaled score is rounded to f32 before e^x, an error that grows
                        // with its size; e^x and the sum add a few ulp.
                        let arg = (f64::from(v) - m).abs() * f64::from(scale);
                        assert!(
                            (f64::from(*g) - want).abs() <= want * 3e-7 * (4.0 + arg) + 1e-30,
                            "{isa:?} len {len} spread {spread}: {g} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// The attention's row kernels on this CPU's path, at lengths around their vector widths.
    #[test]
    fn dot_and_axpy_match_f64() {
        for n in [0, 1, 7, 8, 9, 31, 32, 33, 64, 100] {
            let a: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
                .collect();
            let b: Vec<f32> = (0..n).map(|i| ((i * 53 % 19) as f32 - 9.0) / 5.0).collect();
            let want: f64 = a
                .iter()
                .zip(&b)
                .map(|(&x, &y)| f64::from(x) * f64::from(y))
                .sum();
            let mag: f64 = a
                .iter()
                .zip(&b)
                .map(|(&x, &y)| f64::from((x * y).abs()))
                .sum();
            assert!(
                (f64::from(dot(&a, &b)) - want).abs() <= mag * 1e-6,
                "dot at {n}"
            );
            let mut y = b.clone();
            axpy(&mut y, 0.75, &a);
            for (i, (&g, (&x, &y0))) in y.iter().zip(a.iter().zip(&b)).enumerate() {
                let w = f64::from(y0) + 0.75 * f64::from(x);
                assert!(
                    (f64::from(g) - w).abs() <= 1e-6 * (1.0 + w.abs()),
                    "axpy {n} at {i}"
                );
            }
        }
    }

    /// The attention's rows of dot products and weighted sums on every path, against f64, at
    /// key counts around the 16 keys of a pass, and head dimensions the AVX-512 path takes (16,
    /// 64, 80, 128) and ones it leaves to the AVX2 path (8, 24).
    #[test]
    fn dot_rows_and_axpy_rows_match_f64_on_every_path() {
        for hd in [8, 16, 24, 64, 80, 128] {
            for n in [0, 1, 15, 16, 17, 33] {
                let q: Vec<f32> = (0..hd)
                    .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
                    .collect();
                let keys: Vec<f32> = (0..n * hd)
                    .map(|i| ((i * 53 % 19) as f32 - 9.0) / 4.0)
                    .collect();
                let w: Vec<f32> = (0..n).map(|i| ((i * 11 % 13) as f32) / 13.0).collect();
                let o0: Vec<f32> = (0..hd).map(|i| (i % 5) as f32 - 2.0).collect();
                for isa in Isa::all_available() {
                    let mut got = vec![f32::NAN; n + 1];
                    dot_rows_with(isa, &q, &keys, &mut got[..n]);
                    assert!(got[n].is_nan(), "{isa:?} wrote past the keys");
                    for (i, g) in got[..n].iter().enumerate() {
                        let k = &keys[i * hd..(i + 1) * hd];
                        let want: f64 = q
                            .iter()
                            .zip(k)
                            .map(|(&a, &b)| f64::from(a) * f64::from(b))
                            .sum();
                        let mag: f64 = q
                            .iter()
                            .zip(k)
                            .map(|(&a, &b)| f64::from((a * b).abs()))
                            .sum();
                        // At most hd roundings in a row, each within u = 2^-24 of the sum.
                        let bound = mag * hd as f64 * f64::from(f32::EPSILON) / 2.0;
                        assert!(
                            (f64::from(*g) - want).abs() <= bound,
                            "{isa:?} hd {hd} n {n} key {i}: {g} vs {want}"
                        );
                    }
                    // Keys that are exact in f16 give the same sums read from f16 bytes.
                    let k16: Vec<u8> = keys
                        .iter()
                        .flat_map(|&k| half::f16::from_f32(k).to_le_bytes())
                        .collect();
                    let mut got16 = vec![f32::NAN; n];
                    let h = Codes::F16;
                    dot_rows_codes_with(isa, &q, &[0.0], &k16, 0, h, hd, &mut got16, n, n);
                    for (i, (a, b)) in got16.iter().zip(&got[..n]).enumerate() {
                        let mag: f32 = (0..hd).map(|d| (q[d] * keys[i * hd + d]).abs()).sum();
                        assert!(
                            (a - b).abs() <= mag * hd as f32 * f32::EPSILON,
                            "{isa:?} f16 hd {hd} n {n} key {i}: {a} vs {b}"
                        );
                    }
                    let (mut o16, mut o) = (o0.clone(), o0.clone());
                    axpy_rows_codes_with(isa, &mut o16, &[0.0], &w, n, n, &k16, 0, h, hd);
                    axpy_rows_with(isa, &mut o, &w, &keys);
                    for (d, (a, b)) in o16.iter().zip(&o).enumerate() {
                        let mag: f32 = o0[d].abs()
                            + (0..n).map(|i| (w[i] * keys[i * hd + d]).abs()).sum::<f32>();
                        assert!(
                            (a - b).abs() <= mag * (n + 1) as f32 * f32::EPSILON,
                            "{isa:?} f16 hd {hd} n {n} dim {d}: {a} vs {b}"
                        );
                    }
                    // Keys that are whole numbers give the same sums read from bytes.
                    let k8: Vec<u8> = keys.iter().map(|&k| (k * 4.0) as i8 as u8).collect();
                    let q4: Vec<f32> = q.iter().map(|&v| v / 4.0).collect();
                    let w4: Vec<f32> = w.iter().map(|&v| v / 4.0).collect();
                    let mut got8 = vec![f32::NAN; n];
                    let i8 = Codes::Signed8;
                    dot_rows_codes_with(isa, &q4, &[0.0], &k8, 0, i8, hd, &mut got8, n, n);
                    let (mut o8, mut o) = (o0.clone(), o0.clone());
                    axpy_rows_codes_with(isa, &mut o8, &[0.0], &w4, n, n, &k8, 0, i8, hd);
                    axpy_rows_with(isa, &mut o, &w, &keys);
                    for (i, (a, b)) in got8.iter().zip(&got[..n]).enumerate() {
                        let mag: f32 = (0..hd).map(|d| (q[d] * keys[i * hd + d]).abs()).sum();
                        assert!(
                            (a - b).abs() <= mag * hd as f32 * f32::EPSILON,
                            "{isa:?} i8 hd {hd} n {n} key {i}: {a} vs {b}"
                        );
                    }
                    for (d, (a, b)) in o8.iter().zip(&o).enumerate() {
                        let mag: f32 = o0[d].abs()
                            + (0..n).map(|i| (w[i] * keys[i * hd + d]).abs()).sum::<f32>();
                        assert!(
                            (a - b).abs() <= mag * (n + 1) as f32 * f32::EPSILON,
                            "{isa:?} i8 hd {hd} n {n} dim {d}: {a} vs {b}"
                        );
                    }
                    let mut o = o0.clone();
                    axpy_rows_with(isa, &mut o, &w, &keys);
                    for (d, g) in o.iter().enumerate() {
                        let terms = (0..n).map(|i| f64::from(w[i]) * f64::from(keys[i * hd + d]));
                        let want = f64::from(o0[d]) + terms.clone().sum::<f64>();
                        let mag = f64::from(o0[d].abs()) + terms.map(f64::abs).sum::<f64>();
                        let bound = mag * (n + 1) as f64 * f64::from(f32::EPSILON) / 2.0;
                        assert!(
                            (f64::from(*g) - want).abs() <= bound,
                            "{isa:?} hd {hd} n {n} dim {d}: {g} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// A softmax split in pieces and put together by `softmax_exp`'s maxima equals the softmax
    /// of the whole row within a few ulp, on every path.
    #[test]
    fn softmax_in_pieces_equals_the_whole() {
        let row: Vec<f32> = (0..100)
            .map(|i| ((i * 7919 % 211) as f32 - 105.0) / 9.0)
            .collect();
        for isa in Isa::all_available() {
            let mut whole = row.clone();
            softmax_with(isa, &mut whole, 0.125);
            let mut pieces = row.clone();
            let (a, b) = pieces.split_at_mut(37);
            let top = |v: &[f32]| v.iter().copied().fold(f32::NEG_INFINITY, f32::max) * 0.125;
            let (top_a, top_b) = (top(a), top(b));
            let (ma, sa) = softmax_exp_with(isa, a, 0.125);
            let (mb, sb) = softmax_exp_with(isa, b, 0.125);
            // The maximum returned is the piece's own largest scaled value, wherever it lies.
            assert_eq!((ma, mb), (top_a, top_b), "{isa:?}");
            let m = ma.max(mb);
            let (fa, fb) = ((ma - m).exp(), (mb - m).exp());
            let inv = 1.0 / (fa * sa + fb * sb);
            for (i, (p, w)) in pieces.iter().zip(&whole).enumerate() {
                let f = if i < 37 { fa } else { fb };
                let g = p * f * inv;
                assert!((g - w).abs() <= w * 1e-5, "{isa:?} {i}: {g} vs {w}");
            }
            assert_eq!(
                softmax_exp_with(isa, &mut [], 1.0),
                (f32::NEG_INFINITY, 0.0)
            );
        }
    }

    /// SwiGLU's paths agree within a few ulp, from large negative gates (silu → -0) to large
    /// positive ones (silu → the gate).
    #[test]
    fn swiglu_paths_agree() {
        let ffn = 37;
        let gate_up: Vec<f32> = (0..2 * ffn * 3)
            .map(|i| ((i * 7919 % 211) as f32 - 105.0) * if i % 5 == 0 { 1.5 } else { 0.05 })
            .collect();
        let want: Vec<f64> = gate_up
            .chunks_exact(2 * ffn)
            .flat_map(|gu| {
                let (g, u) = gu.split_at(ffn);
                g.iter()
                    .zip(u)
                    .map(|(&g, &u)| {
                        let g = f64::from(g);
                        g / (1.0 + (-g).exp()) * f64::from(u)
                    })
                    .collect::<Vec<_>>()
            })
            .collect();
        for isa in Isa::all_available() {
            let mut out = vec![f32::NAN; ffn * 3];
            swiglu_with(isa, &mut out, &gate_up, ffn);
            for (i, (g, w)) in out.iter().zip(&want).enumerate() {
                assert!(
                    (f64::from(*g) - w).abs() <= w.abs() * 3e-6 + 1e-30,
                    "{isa:?} {i}: {g} vs {w}"
                );
            }
        }
    }

    /// Every path decodes packed codes to the same bits as a plain reading of the packing
    /// (code j of a row in bits `bits·j..` from its first byte), for every width, rows that start
    /// past the buffer's start, and parameters per channel and per row.
    #[test]
    fn decode_codes_paths_agree_with_the_packing() {
        let mut s = 11u32;
        let mut next = || {
            s = s.wrapping_mul(1664525).wrapping_add(1013904223);
            s >> 8
        };
        let (hd, rows) = (64, 5);
        for bits in [2usize, 3, 4, 8] {
            for first in [0, 64, 128] {
                let codes: Vec<u8> = (0..(first + rows * hd) * bits / 8 + 3)
                    .map(|_| next() as u8)
                    .collect();
                for per_row in [false, true] {
                    let n = if per_row { rows } else { hd };
                    let mins: Vec<f32> = (0..n).map(|_| next() as f32 / 1e6 - 5.0).collect();
                    let scales: Vec<f32> = (0..n).map(|_| next() as f32 / 1e7).collect();
                    let code = |r: usize, c: usize| {
                        let bit = (first + r * hd + c) * bits;
                        let w = u32::from(codes[bit / 8]) | u32::from(codes[bit / 8 + 1]) << 8;
                        ((w >> (bit % 8)) & ((1 << bits) - 1)) as f32
                    };
                    let want: Vec<f32> = (0..rows * hd)
                        .map(|i| {
                            let (r, c) = (i / hd, i % hd);
                            let p = if per_row { r } else { c };
                            mins[p] + code(r, c) * scales[p]
                        })
                        .collect();
                    for isa in Isa::all_available() {
                        let mut out = vec![f32::NAN; rows * hd];
                        decode_codes_with(
                            isa, &codes, first, bits, hd, &mins, &scales, per_row, &mut out,
                        );
                        assert_eq!(
                            out, want,
                            "{isa:?}, {bits} bits from {first}, per row {per_row}"
                        );
                    }
                }
            }
        }
    }

    /// Scores and weighted sums over packed codes match f64 sums of the unpacked codes on every
    /// path, for every width, 1 to 7 rows (groups of three and what is left), 0 to 33 keys (eight
    /// per pass and the tail), rows at a stride, keys that start past the buffer's start, and
    /// heads of whole groups of 64 and not.
    #[test]
    fn dot_and_axpy_over_codes_match_f64() {
        let mut s = 5u32;
        let mut next = || {
            s = s.wrapping_mul(1664525).wrapping_add(1013904223);
            s >> 8
        };
        let kinds = [2, 3, 4, 8].map(Codes::Unsigned);
        // 64: the wide unpacking where the CPU has it; 48: sixteen codes at a time.
        let every = [64, 48].map(|hd| {
            kinds
                .into_iter()
                .chain([Codes::Signed8, Codes::F16])
                .map(move |k| (hd, k))
        });
        for (hd, kind) in every.into_iter().flatten() {
            let bits = kind.bits();
            for rows in 1..=7 {
                for n in [0usize, 1, 7, 8, 9, 16, 33] {
                    let first = 2 * hd;
                    let codes: Vec<u8> = if kind == Codes::F16 {
                        // Finite values: f16 of -4..4.
                        (0..first + n * hd)
                            .flat_map(|_| {
                                half::f16::from_f32(next() as f32 / 2e6 - 4.0).to_le_bytes()
                            })
                            .collect()
                    } else {
                        (0..(first + n * hd) * bits / 8)
                            .map(|_| next() as u8)
                            .collect()
                    };
                    let mut u = vec![0f32; n * hd];
                    for (j, row) in u.chunks_exact_mut(hd).enumerate() {
                        unpack_kind(&codes, first + j * hd, kind, row);
                    }
                    let q: Vec<f32> = (0..rows * hd).map(|_| next() as f32 / 8e6 - 1.0).collect();
                    let bias: Vec<f32> = (0..rows).map(|_| next() as f32 / 1e6).collect();
                    let stride = n + 3;
                    let w: Vec<f32> = (0..rows * stride).map(|_| next() as f32 / 1.6e7).collect();
                    let o0: Vec<f32> = (0..rows * hd).map(|_| next() as f32 / 1e7).collect();
                    for isa in Isa::all_available() {
                        let mut out = vec![f32::NAN; rows * stride];
                        dot_rows_codes_with(
                            isa, &q, &bias, &codes, first, kind, hd, &mut out, stride, n,
                        );
                        let mut o = o0.clone();
                        axpy_rows_codes_with(
                            isa, &mut o, &bias, &w, stride, n, &codes, first, kind, hd,
                        );
                        for r in 0..rows {
                            for j in 0..n {
                                let want: f64 = f64::from(bias[r])
                                    + (0..hd)
                                        .map(|d| {
                                            f64::from(q[r * hd + d]) * f64::from(u[j * hd + d])
                                        })
                                        .sum::<f64>();
                                let got = f64::from(out[r * stride + j]);
                                assert!(
                                    (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                                    "{isa:?} dot, {kind:?}, {rows} rows, {n} keys, [{r}][{j}]: {got} vs {want}"
                                );
                            }
                            for d in 0..hd {
                                let want: f64 = f64::from(o0[r * hd + d])
                                    + f64::from(bias[r])
                                    + (0..n)
                                        .map(|i| {
                                            f64::from(w[r * stride + i]) * f64::from(u[i * hd + d])
                                        })
                                        .sum::<f64>();
                                let got = f64::from(o[r * hd + d]);
                                assert!(
                                    (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                                    "{isa:?} axpy, {kind:?}, {rows} rows, {n} values, [{r}][{d}]: {got} vs {want}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    fn naive(a: &[f32], b: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
        let mut d = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                d[i * n + j] = (0..k).map(|t| a[i * k + t] * b[j * k + t]).sum();
            }
        }
        d
    }

    #[test]
    fn matmul_matches_naive() {
        for &(m, n, k) in &[(1, 7, 5), (3, 64, 576), (65, 33, 17), (128, 192, 64)] {
            let a: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7 % 13) as f32 - 6.0) / 7.0)
                .collect();
            let b: Vec<f32> = (0..n * k)
                .map(|i| ((i * 5 % 11) as f32 - 5.0) / 5.0)
                .collect();
            let mut d = vec![0.0; m * n];
            matmul_nt(&mut d, &a, &b, m, n, k);
            let want = naive(&a, &b, m, n, k);
            for (x, y) in d.iter().zip(&want) {
                assert!((x - y).abs() <= 1e-4 * (1.0 + y.abs()), "{x} vs {y}");
            }
            // b as k×n row-major is bᵀ of the above.
            let mut bt = vec![0.0; n * k];
            for j in 0..n {
                for t in 0..k {
                    bt[t * n + j] = b[j * k + t];
                }
            }
            let mut d2 = vec![0.0; m * n];
            matmul_nn(&mut d2, &a, &bt, m, n, k);
            for (x, y) in d2.iter().zip(&want) {
                assert!((x - y).abs() <= 1e-4 * (1.0 + y.abs()), "{x} vs {y}");
            }
        }
    }

    #[test]
    fn geglu_is_gelu_tanh_of_the_gate_times_up() {
        // Values of GELU(tanh) at -1, 0, 1, 2 (PyTorch's gelu(approximate="tanh")).
        let gate_up = [-1.0, 0.0, 1.0, 2.0, 1.0, 1.0, 1.0, 0.5];
        let want = [-0.158_808, 0.0, 0.841_192, 1.954_598 * 0.5];
        for isa in [Isa::Portable, Isa::Avx2]
            .into_iter()
            .filter(|i| i.available())
        {
            let mut out = [0.0; 4];
            geglu_with(isa, &mut out, &gate_up, 4);
            for (o, w) in out.iter().zip(want) {
                assert!((o - w).abs() < 1e-5, "{isa:?}: {out:?}");
            }
        }
    }

    /// Every path folds the parameters into a row as the f64 sums do, whatever the row's
    /// length (tails past the vectors, the 16 tokens of values, a head's 64 or 256 channels).
    #[test]
    fn fold_params_match_f64_on_every_path() {
        for n in [1, 7, 15, 16, 17, 33, 64, 256] {
            let x: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
                .collect();
            let mins: Vec<f32> = (0..n).map(|i| ((i * 53 % 19) as f32 - 9.0) / 4.0).collect();
            let scales: Vec<f32> = (0..n)
                .map(|i| ((i * 11 % 13) as f32 + 1.0) / 13.0)
                .collect();
            let want: f64 = x
                .iter()
                .zip(&mins)
                .map(|(&a, &m)| f64::from(a) * f64::from(m))
                .sum();
            let mag: f64 = x
                .iter()
                .zip(&mins)
                .map(|(&a, &m)| f64::from((a * m).abs()))
                .sum();
            for isa in Isa::all_available() {
                let mut out = vec![f32::NAN; n];
                let bias = fold_params_with(isa, &x, &mins, &scales, &mut out);
                let bound = mag * n as f64 * f64::from(f32::EPSILON) / 2.0;
                assert!(
                    (f64::from(bias) - want).abs() <= bound,
                    "{isa:?} n {n}: {bias} vs {want}"
                );
                for i in 0..n {
                    assert_eq!(out[i], x[i] * scales[i], "{isa:?} n {n} at {i}");
                }
            }
        }
    }
}
