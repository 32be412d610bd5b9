//! Decode attention: a few query rows read chunk memory in place, the chunks cut into tasks
//! across the engine's threads and the tasks' pieces merged as in flash-decoding (see the
//! parent module's comment).

use super::{AttnShape, seen_counts};
use crate::kernels::coded::ValueGroups;
use crate::kernels::{
    Codes, axpy, axpy_rows, axpy_rows_codes, coded, dot_rows, dot_rows_codes, fold_params,
    softmax_exp,
};
use crate::kv::codec::{
    coded_pairs, decode_v, f16_keys, f16_values, head_codes, int8_keys, int8_values, le_pairs,
    packed_keys, packed_values,
};
use crate::kv::{ChunkShape, KvCache, KvError, KvFormat, LayerView};
use crate::simd::prefetch_l2;
use rayon::prelude::*;

/// How many chunks ahead of the one in work decode attention asks for a chunk's layer.
const PREFETCH_CHUNKS: usize = 2;

/// Chunks per decode task below which a KV head's chunks are not split further.
const DECODE_TASK_CHUNKS: usize = 8;

/// Chunks per thread from which a decode task takes every KV head of its chunks (see
/// [`DecodeSplit::of`]).
const DECODE_WIDE_CHUNKS: usize = 32;

/// How the chunks of one decode step are cut into tasks: each task takes `heads` KV heads
/// (1, or all of them) of one of `ranges` ranges of chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct DecodeSplit {
    pub(super) heads: usize,
    pub(super) ranges: usize,
}

impl DecodeSplit {
    /// The split of `chunks` on `threads`. Long contexts ([`DECODE_WIDE_CHUNKS`] chunks a
    /// thread or more) are cut by chunks alone, each task reading every KV head of its chunks:
    /// a chunk's layer is then one run of memory read once, with one prefetch, one look-up
    /// and one page walk, where a task per head touched the same pages once per head. Shorter
    /// ones keep a task per KV head, each head's chunks cut by [`decode_splits`], so every
    /// thread still has work.
    pub(super) fn of(n_kv_heads: usize, chunks: usize, threads: usize) -> DecodeSplit {
        let threads = threads.max(1);
        if n_kv_heads > 1 && chunks >= threads * DECODE_WIDE_CHUNKS {
            DecodeSplit {
                heads: n_kv_heads,
                ranges: threads,
            }
        } else {
            DecodeSplit {
                heads: 1,
                ranges: decode_splits(n_kv_heads, chunks, threads),
            }
        }
    }
}

/// How many ranges to cut each KV head's `chunks` into, so the `n_kv_heads × splits` tasks of
/// a decode step fall evenly on `threads` (3 KV heads on 2 threads would leave one thread
/// doing two heads while the other waits): the fewest splits that make the tasks a multiple of
/// the threads, with at least [`DECODE_TASK_CHUNKS`] chunks a task, else as many as that allows.
pub(super) fn decode_splits(n_kv_heads: usize, chunks: usize, threads: usize) -> usize {
    let most = (chunks / DECODE_TASK_CHUNKS).max(1);
    (1..=most)
        .find(|s| (n_kv_heads * s).is_multiple_of(threads.max(1)))
        .unwrap_or(most)
}

/// One KV head's share of a task of [`attend_packed`]: head `g`'s chunks of the task, for
/// every query row of the head, softmax not yet normalized (pieces of one head are put together
/// at the end).
struct Piece {
    g: usize,
    /// The first position of the piece.
    start: usize,
    /// Positions in the piece.
    width: usize,
    /// `[rows][width]`: `e^(scale · s - max)` per row and position; 0 where masked.
    e: Vec<f32>,
    /// Per row, `scale` times its largest score in the piece (−∞ if it sees none of it).
    max: Vec<f32>,
    /// Per row, Σ e.
    sum: Vec<f32>,
    /// `[rows][head_dim]`: Σ e v.
    o: Vec<f32>,
}

/// Attention of a few query rows straight from chunk memory (see the module comment).
///
/// The chunks are cut into tasks ([`DecodeSplit::of`]); a task reads its chunks' keys (scores
/// of each query row against 16 keys at a time), takes its rows' exponentials against its own
/// largest score and sums its values weighted by them; the pieces of a head are then scaled to
/// the head's largest score and normalized (as in flash-decoding), which equals one softmax
/// over the whole row up to f32 rounding.
pub fn attend_packed(
    cache: &mut KvCache,
    layer: usize,
    shape: AttnShape,
    q: &[f32],
    p0: usize,
    n: usize,
    out: &mut [f32],
) -> Result<(), KvError> {
    let chunks = cache.chunks_upto(p0 + n) - shape.first_key(p0) / cache.shape().tokens;
    let threads = rayon::current_num_threads();
    let split = DecodeSplit::of(shape.n_kv_heads, chunks, threads);
    attend_packed_split(cache, layer, shape, q, p0, n, split, out)
}

/// [`attend_packed`] with its chunks cut as `split` says.
#[allow(clippy::too_many_arguments)]
pub(super) fn attend_packed_split(
    cache: &mut KvCache,
    layer: usize,
    shape: AttnShape,
    q: &[f32],
    p0: usize,
    n: usize,
    split: DecodeSplit,
    out: &mut [f32],
) -> Result<(), KvError> {
    let total = p0 + n;
    let chunks = cache.chunks_upto(total);
    // The first chunk the first query's window reaches (0 on a global layer).
    let first = shape.first_key(p0) / cache.shape().tokens;
    let per = (chunks - first).div_ceil(split.ranges).max(1);
    let heads = split.heads.clamp(1, shape.n_kv_heads);
    let tasks: Vec<Task> = (0..shape.n_kv_heads)
        .step_by(heads)
        .flat_map(|g0| {
            (first..chunks).step_by(per).map(move |c0| Task {
                heads: g0..(g0 + heads).min(shape.n_kv_heads),
                c0,
                c1: (c0 + per).min(chunks),
            })
        })
        .collect();
    let work = PieceWork {
        view: cache,
        cs: *cache.shape(),
        layer,
        shape,
        q,
        p0,
        total,
        group: shape.n_heads / shape.n_kv_heads,
        rows: n * (shape.n_heads / shape.n_kv_heads),
        int8: cache.arith() == coded::KvArith::Int8,
    };
    let pieces: Vec<Piece> = if tasks.len() > 1 {
        tasks
            .par_iter()
            .map(|t| work.run(t))
            .collect::<Result<Vec<_>, _>>()?
    } else {
        tasks
            .iter()
            .map(|t| work.run(t))
            .collect::<Result<Vec<_>, _>>()?
    }
    .into_iter()
    .flatten()
    .collect();
    let col = merge_pieces(&pieces, &work, out);
    keep_rows(pieces);
    cache.add_attention(layer, &col);
    if cache.recording() {
        let seen = seen_counts(shape, p0..p0 + n, total);
        cache.add_rows(layer, &seen);
    }
    Ok(())
}

/// The score rows of earlier decode steps, kept for the next ones (at most
/// [`KEPT_ROWS_BYTES`]): a long context's rows are tens of KiB a KV head, and zeroing fresh
/// ones every step took 1-7% of decode at depth 8k. A kept row's old values never reach a
/// result: [`PieceWork::run`] writes every position of its rows (scored, or zeroed where
/// masked) before reading any.
static KEPT_ROWS: std::sync::Mutex<Vec<Vec<f32>>> = std::sync::Mutex::new(Vec::new());

/// Bytes of rows [`KEPT_ROWS`] holds at most.
const KEPT_ROWS_BYTES: usize = 4 << 20;

/// A row buffer of `len` values, a kept one where there is one (its values unspecified up to
/// its old length, zeros past it).
fn reused_rows(len: usize) -> Vec<f32> {
    let kept = KEPT_ROWS.lock().ok().and_then(|mut k| k.pop());
    let mut v = kept.unwrap_or_default();
    v.resize(len, 0.0);
    v
}

/// Keeps the pieces' score rows for the next steps, within [`KEPT_ROWS_BYTES`].
fn keep_rows(pieces: Vec<Piece>) {
    if let Ok(mut k) = KEPT_ROWS.lock() {
        let mut bytes: usize = k.iter().map(|v| v.capacity() * 4).sum();
        for p in pieces {
            if bytes + p.e.capacity() * 4 <= KEPT_ROWS_BYTES {
                bytes += p.e.capacity() * 4;
                k.push(p.e);
            }
        }
    }
}

/// One task of a decode step: KV heads `heads` of chunks `c0..c1`.
struct Task {
    heads: std::ops::Range<usize>,
    c0: usize,
    c1: usize,
}

/// What every piece of one [`attend_packed_split`] shares.
struct PieceWork<'a> {
    view: &'a KvCache,
    cs: ChunkShape,
    layer: usize,
    shape: AttnShape,
    /// `[n][n_heads * head_dim]`, after RoPE.
    q: &'a [f32],
    /// The first query's position.
    p0: usize,
    /// Positions attended to: `p0 + n`.
    total: usize,
    /// Query heads per KV head.
    group: usize,
    /// Query rows per KV head: `n * group`.
    rows: usize,
    /// Whether chunks of codes are multiplied in integers ([`coded`]).
    int8: bool,
}

/// A task's scratch rows: the chunk's minimums and scales, each row's query (or weights)
/// times the scales, and each row's bias (its dot product with the minimums).
struct Scratch {
    mins: Vec<f32>,
    scales: Vec<f32>,
    qsr: Vec<f32>,
    wsr: Vec<f32>,
    bias: Vec<f32>,
    /// A chunk's values of the head decoded to f32, for formats with several value groups a
    /// token (`[token][head_dim]`).
    vals: Vec<f32>,
    /// Those formats' minimums and scales group by group, for the integer kernels.
    gmins: Vec<f32>,
    /// See `gmins`.
    gscales: Vec<f32>,
}

impl PieceWork<'_> {
    /// Query row `r` of KV head `g`: query token `r / group`, head `g * group + r % group`.
    fn qrow(&self, g: usize, r: usize) -> &[f32] {
        let hd = self.shape.head_dim;
        let src =
            (r / self.group) * self.shape.n_heads * hd + (g * self.group + r % self.group) * hd;
        &self.q[src..src + hd]
    }

    /// The task's KV heads over its chunks against their query rows: scores, exponentials
    /// against each head's largest in the task, and the values weighted by them; one piece a
    /// head.
    fn run(&self, task: &Task) -> Result<Vec<Piece>, KvError> {
        let (hd, t) = (self.shape.head_dim, self.cs.tokens);
        let rows = self.rows;
        let (start, end) = (task.c0 * t, (task.c1 * t).min(self.total));
        let width = end - start;
        let mut s = Scratch {
            mins: vec![0.0; hd.max(t)],
            scales: vec![0.0; hd.max(t)],
            qsr: vec![0.0; rows * hd],
            wsr: vec![0.0; rows * t],
            bias: vec![0.0; rows],
            vals: Vec::new(),
            gmins: Vec::new(),
            gscales: Vec::new(),
        };
        // Each chunk's layer, looked up once for the prefetches and both passes.
        let views = (task.c0..task.c1)
            .map(|c| self.view.layer_view(self.layer, c))
            .collect::<Result<Vec<_>, _>>()?;
        let mut es: Vec<Vec<f32>> = task
            .heads
            .clone()
            .map(|_| reused_rows(rows * width))
            .collect();
        self.scores(task, &views, start, width, &mut es, &mut s);
        let scale = 1.0 / (hd as f32).sqrt();
        let mut pieces: Vec<Piece> = task
            .heads
            .clone()
            .zip(es)
            .map(|(g, mut e)| {
                let mut max = vec![f32::NEG_INFINITY; rows];
                let mut sum = vec![0.0f32; rows];
                for (r, srow) in e.chunks_exact_mut(width).enumerate() {
                    let pos = self.p0 + r / self.group;
                    let visible = (pos + 1).min(end).saturating_sub(start);
                    let hidden = self.shape.first_key(pos).saturating_sub(start).min(visible);
                    let (live, masked) = srow.split_at_mut(visible);
                    let (before, live) = live.split_at_mut(hidden);
                    masked.fill(0.0);
                    before.fill(0.0);
                    (max[r], sum[r]) = softmax_exp(live, scale);
                }
                Piece {
                    g,
                    start,
                    width,
                    e,
                    max,
                    sum,
                    o: vec![0.0f32; rows * hd],
                }
            })
            .collect();
        self.weighted_values(task, &views, start, width, &mut pieces, &mut s);
        Ok(pieces)
    }

    /// Asks for the key codes (`part` 0) or value codes (1) of KV heads `heads` of a chunk's
    /// layer (`view`: none past the task's chunks), when it is sealed, and their parameters.
    /// Chunks are separate slots of memory, each read in pieces of a few KiB, so the hardware's
    /// prefetchers start late on each: a task asks a few chunks before it reads them, and only
    /// for its heads' own bytes. Asking for the whole layer in each head's task made decode at
    /// depth 8,160 over f16 chunks 19% slower (25 against 31 tokens/s).
    fn prefetch(&self, heads: &std::ops::Range<usize>, view: Option<&LayerView<'_>>, part: usize) {
        if let Some(&LayerView::Sealed(f, bytes)) = view {
            let cs = &self.cs;
            // The section's parameters (scales, minimums) are small and follow its codes.
            let params = match part {
                0 => cs.k_values_bytes(f)..cs.k_bytes(f),
                _ => cs.k_bytes(f) + cs.v_values_bytes(f)..cs.layer_bytes(f),
            };
            let codes = head_codes(cs, f, heads.start)[part].start
                ..head_codes(cs, f, heads.end - 1)[part].end;
            for range in [codes, params] {
                if let Some(b) = bytes.get(range) {
                    prefetch_l2(b);
                }
            }
        }
    }

    /// Each query row's scores against the keys of the chunks `views` (chunk `task.c0` first)
    /// into `es` (one `[rows][width]` per KV head of the task), chunk by chunk, every head of
    /// a chunk before the next chunk.
    ///
    /// Chunks of codes (int8, and the formats of unsigned codes with a minimum and a scale per
    /// group: per channel for keys) are read for every row of the head at once, never decoded
    /// to f32: each row's query times the keys' scales, and its dot product with their minimums
    /// as a bias.
    fn scores(
        &self,
        task: &Task,
        views: &[LayerView<'_>],
        start: usize,
        width: usize,
        es: &mut [Vec<f32>],
        s: &mut Scratch,
    ) {
        let (hd, t, cs) = (self.shape.head_dim, self.cs.tokens, &self.cs);
        let ahead = |i: usize| self.prefetch(&task.heads, views.get(i), 0);
        for i in 0..PREFETCH_CHUNKS {
            ahead(i);
        }
        for (i, &view) in views.iter().enumerate() {
            ahead(i + PREFETCH_CHUNKS);
            let c = task.c0 + i;
            let live = t.min(self.total - c * t);
            let off = c * t - start;
            for (g, e) in task.heads.clone().zip(es.iter_mut()) {
                let out = &mut e[off..];
                let (codes, first, kind) = match view {
                    // f16 keys are read as stored, converted in registers where the CPU can.
                    LayerView::Sealed(KvFormat::F16, bytes) => {
                        for (r, qr) in s.qsr.chunks_exact_mut(hd).enumerate() {
                            qr.copy_from_slice(self.qrow(g, r));
                        }
                        s.bias.fill(0.0);
                        (&f16_keys(cs, bytes, g)[..live * hd * 2], 0, Codes::F16)
                    }
                    // int8 keys too, each row's query scaled by the channels' scales instead.
                    LayerView::Sealed(KvFormat::Int8, bytes) => {
                        let k = &int8_keys(cs, bytes, g, &mut s.scales)[..live * hd];
                        for (r, qr) in s.qsr.chunks_exact_mut(hd).enumerate() {
                            for ((x, &q), &sc) in qr.iter_mut().zip(self.qrow(g, r)).zip(&s.scales)
                            {
                                *x = q * sc;
                            }
                        }
                        s.bias.fill(0.0);
                        (k, 0, Codes::Signed8)
                    }
                    // Every other format: unsigned codes with a minimum and a scale per channel.
                    LayerView::Sealed(f, bytes) => {
                        let (codes, first) =
                            packed_keys(cs, f, bytes, g, &mut s.mins, &mut s.scales);
                        let bits = f.key_bits() as usize;
                        if self.int8_scores(g, out, width, live, (codes, first, bits), s) {
                            continue;
                        }
                        for (r, (qr, b)) in s.qsr.chunks_exact_mut(hd).zip(&mut s.bias).enumerate()
                        {
                            *b = fold_params(self.qrow(g, r), &s.mins[..hd], &s.scales[..hd], qr);
                        }
                        (codes, first, Codes::Unsigned(f.key_bits() as usize))
                    }
                    LayerView::Open(b) => {
                        let keys = &b[g * t * hd..(g + 1) * t * hd];
                        for (r, srow) in e.chunks_exact_mut(width).enumerate() {
                            dot_rows(
                                self.qrow(g, r),
                                &keys[..live * hd],
                                &mut srow[off..off + live],
                            );
                        }
                        continue;
                    }
                };
                dot_rows_codes(&s.qsr, &s.bias, codes, first, kind, hd, out, width, live);
            }
        }
    }

    /// Head `g`'s scores against a chunk's keys of codes (`codes`, the first key's packed
    /// value, bits) in integers ([`coded::dot_rows_coded`]), token by token (a token's rows of
    /// the head are one run of `q`), into `out` (`[rows][width]` from the chunk's first
    /// column); false, writing nothing, where those kernels do not run.
    fn int8_scores(
        &self,
        g: usize,
        out: &mut [f32],
        width: usize,
        live: usize,
        (codes, first, bits): (&[u8], usize, usize),
        s: &Scratch,
    ) -> bool {
        let (hd, group) = (self.shape.head_dim, self.group);
        let (mins, scales) = (&s.mins[..hd], &s.scales[..hd]);
        self.int8
            && (0..self.rows / group).all(|t| {
                let q = &self.q[(t * self.shape.n_heads + g * group) * hd..][..group * hd];
                let out = &mut out[t * group * width..];
                coded::dot_rows_coded(q, hd, mins, scales, codes, first, bits, out, width, live)
            })
    }

    /// Σ e v over the values of the chunks `views` (chunk `task.c0` first), per query row, into
    /// each piece's `o` (`[rows][head_dim]`), chunk by chunk as [`PieceWork::scores`]. Codes are
    /// read as for keys, with each row's weights times the values' scales (per token) and their
    /// dot product with the minimums as the bias; values in groups narrower than the head are
    /// decoded to f32 first.
    fn weighted_values(
        &self,
        task: &Task,
        views: &[LayerView<'_>],
        start: usize,
        width: usize,
        pieces: &mut [Piece],
        s: &mut Scratch,
    ) {
        let (hd, t, cs) = (self.shape.head_dim, self.cs.tokens, &self.cs);
        for i in 0..PREFETCH_CHUNKS {
            self.prefetch(&task.heads, views.get(i), 1);
        }
        for (i, &view) in views.iter().enumerate() {
            self.prefetch(&task.heads, views.get(i + PREFETCH_CHUNKS), 1);
            let c = task.c0 + i;
            let live = t.min(self.total - c * t);
            let off = c * t - start;
            for p in pieces.iter_mut() {
                let (g, e, o) = (p.g, &p.e, &mut p.o);
                match view {
                    LayerView::Sealed(KvFormat::F16, bytes) => {
                        let v = &f16_values(cs, bytes, g)[..live * hd * 2];
                        s.bias.fill(0.0);
                        let w = &e[off..];
                        axpy_rows_codes(o, &s.bias, w, width, live, v, 0, Codes::F16, hd);
                    }
                    // int8 values, each weight scaled by its token's scale instead.
                    LayerView::Sealed(KvFormat::Int8, bytes) => {
                        let v = &int8_values(cs, bytes, g, &mut s.scales)[..live * hd];
                        for (erow, wr) in e.chunks_exact(width).zip(s.wsr.chunks_exact_mut(t)) {
                            let w = &erow[off..off + live];
                            for ((x, &w), &sc) in wr.iter_mut().zip(w).zip(&s.scales) {
                                *x = w * sc;
                            }
                        }
                        s.bias.fill(0.0);
                        axpy_rows_codes(o, &s.bias, &s.wsr, t, live, v, 0, Codes::Signed8, hd);
                    }
                    // Values in groups narrower than the head (Gemma 3): in integers per group,
                    // else decoded, then summed in f32.
                    LayerView::Sealed(f, bytes) if cs.value_width(f) != hd => {
                        let weights = (&e[off..], width, live);
                        if self.int8 && grouped_values_int8(cs, (f, bytes, g), o, weights, s) {
                            continue;
                        }
                        s.vals.resize(t * hd, 0.0);
                        decode_v(cs, f, bytes, g, &mut s.vals);
                        for (orow, erow) in o.chunks_exact_mut(hd).zip(e.chunks_exact(width)) {
                            axpy_rows(orow, &erow[off..off + live], &s.vals[..live * hd]);
                        }
                    }
                    // Every other format: unsigned codes with a minimum and a scale per token.
                    LayerView::Sealed(f, bytes) => {
                        let (codes, first) =
                            packed_values(cs, f, bytes, g, &mut s.mins, &mut s.scales);
                        let (m, sc, bits) = (&s.mins[..live], &s.scales[..live], f.value_bits());
                        let w = &e[off..];
                        if self.int8
                            && coded::axpy_rows_coded(
                                o,
                                hd,
                                w,
                                width,
                                live,
                                m,
                                sc,
                                ValueGroups::whole(hd),
                                codes,
                                first,
                                bits as usize,
                            )
                        {
                            continue;
                        }
                        let weights = e.chunks_exact(width).zip(s.wsr.chunks_exact_mut(t));
                        for ((erow, wr), b) in weights.zip(&mut s.bias) {
                            let w = &erow[off..off + live];
                            *b =
                                fold_params(w, &s.mins[..live], &s.scales[..live], &mut wr[..live]);
                        }
                        let kind = Codes::Unsigned(f.value_bits() as usize);
                        axpy_rows_codes(o, &s.bias, &s.wsr, t, live, codes, first, kind, hd);
                    }
                    LayerView::Open(b) => {
                        let values = &b[(self.shape.n_kv_heads + g) * t * hd..][..t * hd];
                        for (orow, erow) in o.chunks_exact_mut(hd).zip(e.chunks_exact(width)) {
                            axpy_rows(orow, &erow[off..off + live], &values[..live * hd]);
                        }
                    }
                }
            }
        }
    }
}

/// Head `h`'s values in one layer of an affine-codes format whose value groups are narrower
/// than the head (Gemma 3's 32 channels), as `codec::packed_values` with the parameters laid out
/// group by group: value `[i][c]` is `mins[j] + code[i][c] · scales[j]`, `j = (c / width) ·
/// tokens + i` (what [`coded::axpy_rows_coded`] takes as its [`ValueGroups`]).
/// `mins` and `scales` must hold the head's groups in the layer (`tokens · head_dim / width`).
pub(super) fn packed_grouped_values<'a>(
    shape: &ChunkShape,
    f: KvFormat,
    layer: &'a [u8],
    h: usize,
    mins: &mut [f32],
    scales: &mut [f32],
) -> (&'a [u8], usize, ValueGroups) {
    let (vw, t) = (shape.value_width(f), shape.tokens);
    let groups = shape.value_groups(f);
    let per_token = shape.head_dim / vw;
    let section = &layer[shape.k_bytes(f)..shape.layer_bytes(f)];
    let params = &section[shape.v_values_bytes(f)..];
    // The parameters in the order they are stored (token by token), 256 at a time (a chunk of
    // 64 tokens holds 512 of Gemma 3's), then regrouped.
    let (mut m, mut s) = ([0f32; 256], [0f32; 256]);
    for r0 in (0..groups).step_by(256) {
        let n = (groups - r0).min(256);
        let (m, s) = (&mut m[..n], &mut s[..n]);
        if f.coded() {
            coded_pairs(params, groups, shape.n_kv_heads, h, r0, m, s);
        } else {
            le_pairs(params, h * groups + r0, m, s);
        }
        for (j, (&mr, &sr)) in m.iter().zip(s.iter()).enumerate() {
            let (i, g) = ((r0 + j) / per_token, (r0 + j) % per_token);
            (mins[g * t + i], scales[g * t + i]) = (mr, sr);
        }
    }
    let layout = ValueGroups {
        width: vw,
        stride: t,
    };
    (section, h * shape.block(), layout)
}

/// Head `g`'s values of a chunk's layer (`f`, `bytes`) in groups narrower than the head, summed
/// in integers into `o` (`[rows][head_dim]`) with the weights `w` (`[rows][stride]`, `live`
/// of each from the chunk's first column; [`coded::axpy_rows_coded`] with the parameters
/// group by group); false, changing nothing, where those kernels do not run.
fn grouped_values_int8(
    cs: &ChunkShape,
    (f, bytes, g): (KvFormat, &[u8], usize),
    o: &mut [f32],
    (w, stride, live): (&[f32], usize, usize),
    s: &mut Scratch,
) -> bool {
    let n = cs.value_groups(f);
    s.gmins.resize(n, 0.0);
    s.gscales.resize(n, 0.0);
    let (codes, first, groups) =
        packed_grouped_values(cs, f, bytes, g, &mut s.gmins, &mut s.gscales);
    let (bits, hd) = (f.value_bits() as usize, cs.head_dim);
    let (m, sc) = (&s.gmins[..], &s.gscales[..]);
    coded::axpy_rows_coded(o, hd, w, stride, live, m, sc, groups, codes, first, bits)
}

/// Merges each KV head's pieces into `out` (one softmax over the whole row, flash-decoding's
/// rescaling) and returns the attention each position received, summed over rows.
fn merge_pieces(pieces: &[Piece], w: &PieceWork<'_>, out: &mut [f32]) -> Vec<f32> {
    let AttnShape {
        n_heads,
        n_kv_heads,
        head_dim: hd,
        ..
    } = w.shape;
    let group = w.group;
    let mut col = vec![0.0f32; w.total];
    let mut f = Vec::new();
    for g in 0..n_kv_heads {
        let head: Vec<&Piece> = pieces.iter().filter(|p| p.g == g).collect();
        for r in 0..w.rows {
            // The row's largest over its pieces; a piece it sees none of weighs 0.
            let m = head
                .iter()
                .map(|p| p.max[r])
                .fold(f32::NEG_INFINITY, f32::max);
            f.clear();
            f.extend(head.iter().map(|p| {
                if p.sum[r] > 0.0 {
                    (p.max[r] - m).exp()
                } else {
                    0.0
                }
            }));
            let l: f32 = head.iter().zip(&f).map(|(p, f)| f * p.sum[r]).sum();
            let inv = 1.0 / l;
            let dst = (r / group) * n_heads * hd + (g * group + r % group) * hd;
            let orow = &mut out[dst..dst + hd];
            orow.fill(0.0);
            for (p, &f) in head.iter().zip(&f) {
                let a = f * inv;
                axpy(orow, a, &p.o[r * hd..(r + 1) * hd]);
                let erow = &p.e[r * p.width..(r + 1) * p.width];
                for (c, e) in col[p.start..p.start + p.width].iter_mut().zip(erow) {
                    *c += e * a;
                }
            }
        }
    }
    col
}
