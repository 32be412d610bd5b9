//! The engine's SIMD kernels over quantized blocks, one module per instruction set; callers check
//! the CPU at run time ([`crate::qmatrix::Isa`]) before calling into them.

/// `e^x`'s constants for the vector kernels (Cephes' single-precision method, `simd::avx2::exp8`
/// and `simd::avx512::exp16`): `x` is clamped to `[EXP_MIN, EXP_MAX]`, split as `n ln 2 + r`
/// with ln 2 = `LN2_HI` + `LN2_LO` (the first part exact, 710 / 1024, so `r` is exact), and
/// `e^r` is `1 + r + r² P(r)`, `P`'s coefficients highest first.
pub(crate) const EXP_MIN: f32 = -87.3;
/// See [`EXP_MIN`].
pub(crate) const EXP_MAX: f32 = 88.7;
/// See [`EXP_MIN`].
pub(crate) const LN2_HI: f32 = 0.693_359_4;
/// See [`EXP_MIN`].
pub(crate) const LN2_LO: f32 = -2.121_944_4e-4;
/// See [`EXP_MIN`].
pub(crate) const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];

/// Asks for every cache line `bytes` touches into L2 (a hint: no effect on results, and none
/// on CPUs other than x86-64). From the line of its first byte: stepping 64 bytes from an
/// unaligned start missed the line of the last bytes, where a KV chunk's section keeps its
/// heads' `amax`, the first thing decode reads of it.
pub fn prefetch_l2(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        let skew = bytes.as_ptr() as usize % 64;
        let line = bytes.as_ptr().wrapping_sub(skew);
        for o in (0..bytes.len() + skew).step_by(64) {
            use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
            // SAFETY: SSE is part of every x86-64 CPU; a prefetch reads nothing
            // architecturally and never faults, whatever the address (computed with wrapping
            // arithmetic, never dereferenced).
            unsafe { _mm_prefetch::<_MM_HINT_T1>(line.wrapping_add(o) as *const i8) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// Asks for the cache lines of the `len` bytes of weights from `p` into L2, for the
/// matrix-vector kernels, which ask [`WEIGHTS_AHEAD`] bytes ahead of the rows in work. A
/// prefetch never faults, so `p` may point past the data (near the end of a matrix it does);
/// the address is computed with wrapping arithmetic and never dereferenced.
///
/// L2, not L1: on an AMD EPYC (Zen 4, 32 KiB of L1 data) asking for the lines into L1 made
/// decode a third slower than into L2 (docs/bench-engine.md, "Prefetch into L2"), the lines
/// 16 KiB ahead evicting the activations and the rows in work; the core's own L1 prefetcher
/// takes them from L2 in time.
#[inline]
pub fn prefetch_weights(p: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    for o in (0..len).step_by(64) {
        use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
        // SAFETY: SSE is part of every x86-64 CPU; a prefetch reads nothing architecturally
        // and never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(o) as *const i8) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, len);
}

/// How far ahead of the rows in work the matrix-vector kernels ask for the weights' cache
/// lines ([`prefetch_weights`]), in bytes of quants (their scales and minimums follow at the
/// same pace). Without it one core read a Q4_1 matrix at 14-16 GB/s, as if the reads and the
/// arithmetic took turns; 8 to 32 KiB ahead, 24-27 GB/s, near a plain streaming read's 28-35
/// (docs/bench-engine.md).
pub const WEIGHTS_AHEAD: usize = 16 << 10;

/// Rows per pass of the several-rows int8 matrix-vector kernels ([`vnni`], and
/// `avx2::blocks_int8`).
pub const ROWS: usize = 4;

/// Runs `pass(r, n)` over `rows` rows, [`ROWS`] at a time and then one at a time, first
/// asking for the quants' lines [`WEIGHTS_AHEAD`] ahead of each pass (`row_bytes` a row from
/// `qs`).
#[inline]
pub(crate) fn passes(
    rows: usize,
    row_bytes: usize,
    qs: *const u8,
    mut pass: impl FnMut(usize, usize),
) {
    prefetch_weights(qs, WEIGHTS_AHEAD);
    let mut r = 0;
    while r < rows {
        let n = if r + ROWS <= rows { ROWS } else { 1 };
        prefetch_weights(
            qs.wrapping_add(r * row_bytes + WEIGHTS_AHEAD),
            n * row_bytes,
        );
        pass(r, n);
        r += n;
    }
}

/// Kinds of stored KV values for the `dot_rows_stored` and `axpy_rows_stored` kernels: 2, 3,
/// 4 and 8 are packed unsigned codes of that many bits, [`SIGNED8`] signed bytes, [`HALF`]
/// little-endian f16.
pub const SIGNED8: usize = 9;
/// See [`SIGNED8`].
pub const HALF: usize = 16;

/// How the integer value kernels' minimums and scales are grouped over a value row's channels
/// (`kernels::coded::axpy_rows_coded`): `width` channels share a minimum and a scale per token
/// (the whole head, a multiple of 64 channels that divides it, or 32 channels: Gemma 3's
/// groups), group `g`'s parameter of token `i` at index `g · stride + i` of each slice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ValueGroups {
    /// Channels a group spans.
    pub width: usize,
    /// Index distance between groups' parameters (unused for one group a head).
    pub stride: usize,
}

impl ValueGroups {
    /// One group a token: a minimum and a scale per value row of `hd` channels.
    pub fn whole(hd: usize) -> ValueGroups {
        ValueGroups {
            width: hd,
            stride: 0,
        }
    }

    /// Whether the kernels take these groups over heads of `hd` channels.
    pub fn fits(&self, hd: usize) -> bool {
        self.width > 0
            && hd.is_multiple_of(self.width)
            && (self.width == 32 || self.width.is_multiple_of(64))
    }

    /// The groups of channels `64 u..64 u + 32` and `64 u + 32..64 u + 64`.
    #[inline]
    pub fn of_piece(&self, u: usize) -> [usize; 2] {
        [64 * u / self.width, (64 * u + 32) / self.width]
    }

    /// Parameters each slice must hold for `n` tokens of heads of `hd` channels.
    pub fn params_len(&self, hd: usize, n: usize) -> usize {
        (hd / self.width - 1) * self.stride + n
    }
}

/// The integer value kernels' folded weights per row for the groups of piece `u`'s two halves
/// of 32 channels (`folded[r][h]`), refolded only where a half's group differs from the one
/// `held` says was folded last: `fold(r, at)` folds row `r` against the parameters from index
/// `at` (the group's first).
#[inline]
pub(crate) fn fold_piece_groups<T: Copy, const R: usize>(
    groups: ValueGroups,
    u: usize,
    held: &mut [usize; 2],
    folded: &mut [[T; 2]; R],
    mut fold: impl FnMut(usize, usize) -> T,
) {
    let gs = groups.of_piece(u);
    for h in 0..2 {
        if gs[h] == held[h] {
            continue;
        }
        for (r, f) in folded.iter_mut().enumerate() {
            f[h] = if h == 1 && gs[1] == gs[0] {
                f[0]
            } else {
                fold(r, gs[h] * groups.stride)
            };
        }
        held[h] = gs[h];
    }
}

/// `levels` over a row's largest magnitude, or 0 for a row of zeros: what the integer
/// attention kernels multiply a folded row by before rounding it.
#[inline]
pub(crate) fn inverse_step(top: f32, levels: f32) -> f32 {
    if top > 0.0 { levels / top } else { 0.0 }
}

/// Whether a kernel call's block fits what the kernels take: 1 to 4 rows, heads of whole
/// groups of 64 channels, at most 16 tokens of `bits`-bit codes from packed value `first` (on
/// a byte) inside `len` bytes.
pub(crate) fn coded_block_fits(
    bits: usize,
    rows: usize,
    hd: usize,
    n: usize,
    len: usize,
    first: usize,
) -> bool {
    (1..=4).contains(&rows)
        && hd.is_multiple_of(64)
        && n <= 16
        && (first * bits).is_multiple_of(8)
        && len * 8 >= (first + n * hd) * bits
}

/// The first of sixteen rows of `row_bytes` from byte `at` of `codes`: in place when all
/// sixteen are there (`n` of them), else a copy of the `n` in `tail` padded with zero rows, so
/// the kernels read whole blocks without a test.
pub(crate) fn sixteen_rows(
    codes: &[u8],
    at: usize,
    n: usize,
    row_bytes: usize,
    tail: &mut Vec<u8>,
) -> *const u8 {
    if n == 16 {
        codes[at..at + 16 * row_bytes].as_ptr()
    } else {
        tail.resize(16 * row_bytes, 0u8);
        tail[..n * row_bytes].copy_from_slice(&codes[at..at + n * row_bytes]);
        tail.as_ptr()
    }
}

/// AVX-512 VNNI matrix-vector products over int8 activations.
#[cfg(target_arch = "x86_64")]
pub mod vnni;

/// AVX2 + FMA + F16C kernels (every x86-64 CPU since Haswell and Zen 1).
#[cfg(target_arch = "x86_64")]
pub mod avx2;

/// AVX2 and AVX-512 kernels for the block formats held as the file's bytes (Q4_0, Q5_0, Q5_1,
/// Q4_K, Q5_K, Q6_K).
#[cfg(target_arch = "x86_64")]
pub mod blocks;

/// AVX-512 (F, BW, VL) + FMA + F16C kernels: single-token products several rows per pass, and
/// decode attention's kernels in [`avx512::kv`].
#[cfg(target_arch = "x86_64")]
pub mod avx512;

use kvfs::io::HUGE_PAGE;

/// Asks the kernel to back the memory of `ranges` (address, length) with transparent huge
/// pages now (`MADV_COLLAPSE`, Linux 6.1 and later): every huge-page-aligned 2 MiB region that
/// one of the ranges touches, once. Returns how many regions were collapsed; a region the
/// kernel refuses (partly unmapped, THP disabled, an older kernel) stays in small pages.
///
/// The weights are many heap buffers of a few hundred KiB each, read from end to end on every
/// token. In 4 KiB pages each page costs a TLB miss, and the hardware prefetchers stop at every
/// page boundary; in 2 MiB pages neither happens. The collapse copies the bytes once (about
/// 0.3 s for the default model's 92 MiB on a Zen 4) and keeps their contents.
pub fn collapse_to_huge_pages(ranges: impl IntoIterator<Item = (usize, usize)>) -> usize {
    let mut regions: Vec<usize> = ranges
        .into_iter()
        .filter(|&(_, len)| len > 0)
        .flat_map(|(at, len)| (at / HUGE_PAGE..=(at + len - 1) / HUGE_PAGE).map(|r| r * HUGE_PAGE))
        .collect();
    regions.sort_unstable();
    regions.dedup();
    regions
        .into_iter()
        .filter(|&r| {
            // SAFETY: MADV_COLLAPSE changes how memory is backed, never what it holds: on
            // success the region reads the same bytes from a huge page, on failure nothing
            // changes; an address outside any mapping gives ENOMEM, not a fault.
            unsafe { libc::madvise(r as *mut libc::c_void, HUGE_PAGE, libc::MADV_COLLAPSE) == 0 }
        })
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes of `/proc/self/smaps`'s mapping around `at` that sit in huge pages.
    fn anon_huge_bytes(at: usize) -> usize {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            let range = line.split_once(' ').and_then(|(r, _)| r.split_once('-'));
            if let Some((lo, hi)) = range
                && let (Ok(lo), Ok(hi)) =
                    (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
            {
                inside = (lo..hi).contains(&at);
            } else if inside && let Some(kb) = line.strip_prefix("AnonHugePages:") {
                return kb
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<usize>()
                    .unwrap()
                    << 10;
            }
        }
        0
    }

    /// A heap buffer of weights collapsed into huge pages keeps every byte, and where the
    /// kernel has transparent huge pages (not `never`) its whole 2 MiB regions are huge pages
    /// afterwards.
    #[test]
    fn collapsed_weights_keep_their_bytes_in_huge_pages() {
        let len = 3 * HUGE_PAGE;
        let w: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4093) as u8).collect();
        let (at, want) = (w.as_ptr() as usize, w.clone());
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .is_ok_and(|s| !s.contains("[never]"));
        let before = anon_huge_bytes(at);
        let regions = collapse_to_huge_pages([(at, len)]);
        assert!(w == want, "the collapse changed the buffer's bytes");
        if thp {
            // Three buffers' worth touches three or four regions; at least the two wholly
            // inside it belong to its mapping and collapse.
            assert!(regions >= 2, "{regions} regions collapsed");
            assert!(anon_huge_bytes(at) >= before + 2 * HUGE_PAGE);
        }
        // Nothing to do for empty ranges.
        assert_eq!(collapse_to_huge_pages([(at, 0)]), 0);
    }
}
