//! Chunks past the sliding window keep only their global layers (`ChunkShape::trimmed_chunks`),
//! on a tiny Gemma-3-shaped file: two of every three layers see a window of 16 tokens, chunks
//! hold 16 tokens, so a context keeps every layer of its last 32 tokens' chunks and the global
//! layer alone before them.

use model::config::Family;
use model::kv::{ChunkShape, HeapChunks, KvCache, KvError, KvFormat};
use model::tiny::{TinySpec, write_tiny_gguf};
use model::{Logits, Model};

const WINDOW: usize = 16;

fn model() -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("g.gguf");
    let spec = TinySpec {
        family: Family::GEMMA3,
        n_layers: 3,
        head_dim: Some(32),
        n_kv_heads: 1,
        window: Some((WINDOW, 3)),
        rope_base: 1_000_000.0,
        ..TinySpec::default()
    };
    write_tiny_gguf(&path, &spec).unwrap();
    let mut m = Model::load(&path).unwrap();
    m.prefill_chunk = 40;
    (dir, m)
}

fn cache(m: &Model, shape: ChunkShape, f: KvFormat) -> KvCache {
    KvCache::new(shape, f, m.cfg.max_ctx, Box::new(HeapChunks::default()))
}

/// A prompt of 120 tokens and 6 greedy steps, logits of every step.
fn run(m: &Model, c: &mut KvCache) -> Vec<Vec<f32>> {
    let prompt: Vec<u32> = (0..120u32).map(|t| (t * 53 + 7) % 260).collect();
    let mut out = vec![m.forward(c, &prompt, Logits::Last).unwrap()];
    for _ in 0..6 {
        let next = model::generate::argmax(out.last().unwrap()) as u32;
        out.push(m.forward(c, &[next], Logits::Last).unwrap());
    }
    out
}

#[test]
fn the_shape_puts_global_layers_first_and_trims_to_them() {
    let (_d, m) = model();
    let s = m.chunk_shape(16);
    assert_eq!((s.window, s.n_global()), (WINDOW, 1));
    assert!(s.has_window());
    // Layer 2 is the global one: it comes first.
    assert_eq!([s.slot(0), s.slot(1), s.slot(2)], [1, 2, 0]);
    let t = s.trimmed();
    assert_eq!(t.n_layers, 1);
    assert_eq!(
        t.chunk_bytes(KvFormat::Int8),
        s.chunk_bytes(KvFormat::Int8) / 3
    );
    // Two windows (32 tokens) keep every layer.
    assert_eq!(s.trimmed_chunks(32), 0);
    assert_eq!(s.trimmed_chunks(47), 0);
    assert_eq!(s.trimmed_chunks(48), 1);
    assert_eq!(s.trimmed_chunks(112), 5);
    let dense = ChunkShape {
        global: u128::MAX,
        window: 0,
        ..s
    };
    assert_eq!(dense.trimmed_chunks(10_000), 0);
}

/// Trimming drops only what no query reads: the same logits, bit for bit, as a cache that
/// keeps every layer, in a third of the memory for the chunks past the window.
#[test]
fn trimmed_chunks_change_no_logit_and_hold_their_global_layers_only() {
    let (_d, m) = model();
    let s = m.chunk_shape(16);
    for f in [KvFormat::F16, KvFormat::Int8, KvFormat::K4v4] {
        let mut trimmed = cache(&m, s, f);
        let dense_shape = ChunkShape {
            global: u128::MAX,
            window: 0,
            ..s
        };
        let mut whole = cache(&m, dense_shape, f);
        assert_eq!(run(&m, &mut trimmed), run(&m, &mut whole), "{f}");
        // 126 tokens: 7 sealed chunks, the first (112 - 32) / 16 = 5 past the window.
        assert_eq!(trimmed.trimmed_chunks(), 5);
        for i in 0..7 {
            let want = if i < 5 {
                s.trimmed().chunk_bytes(f)
            } else {
                s.chunk_bytes(f)
            };
            assert_eq!(trimmed.chunk_bytes(i).unwrap().len(), want, "{f} chunk {i}");
        }
        // Slots are whole pages: an f16 chunk here is two pages, trimmed one.
        if f == KvFormat::F16 {
            assert_eq!(
                whole.resident_bytes() - trimmed.resident_bytes(),
                5 * model::kv::PAGE
            );
        }
        // A sliding-window layer of a trimmed chunk is refused, its global layer read.
        assert!(matches!(
            trimmed.layer_view(0, 2),
            Err(KvError::Trimmed { index: 2, layer: 0 })
        ));
        assert!(trimmed.layer_view(2, 2).is_ok());
        assert!(trimmed.layer_view(0, 5).is_ok());
    }
}

/// A chunk of the last window recomputes exactly (its window's chunks keep their layers); one
/// whose window reaches a trimmed chunk is refused, never rebuilt wrong.
#[test]
fn recompute_is_exact_inside_the_window_and_refused_past_it() {
    let (_d, m) = model();
    let mut c = cache(&m, m.chunk_shape(16), KvFormat::Int8);
    run(&m, &mut c);
    let before = c.chunk_bytes(6).unwrap().to_vec();
    c.reclaim(6).unwrap();
    m.forward_chunks(&mut c, &[6]).unwrap();
    assert_eq!(c.chunk_bytes(6).unwrap(), &before[..]);
    // Chunk 5's queries look back to chunk 4, which keeps its global layer only.
    c.reclaim(5).unwrap();
    let err = m.forward_chunks(&mut c, &[5]).unwrap_err().to_string();
    assert!(err.contains("cannot be recomputed exactly"), "{err}");
    assert!(!c.is_resident(5));
}

/// A whole stored copy of a chunk past the window is cut to its global layers on restore; a
/// copy shorter than the chunk needs is refused.
#[test]
fn restore_cuts_whole_copies_past_the_window() {
    let (_d, m) = model();
    let s = m.chunk_shape(16);
    let f = KvFormat::Int8;
    let dense = ChunkShape {
        global: u128::MAX,
        window: 0,
        ..s
    };
    let mut whole = cache(&m, dense, f);
    run(&m, &mut whole);
    let mut c = cache(&m, s, f);
    run(&m, &mut c);
    let trimmed = c.chunk_bytes(1).unwrap().to_vec();
    // The whole chunk in the trimmed cache's layout: global layer first.
    let mut full = vec![0u8; s.chunk_bytes(f)];
    let lb = s.layer_bytes(f);
    let wb = whole.chunk_bytes(1).unwrap();
    for l in 0..3 {
        full[s.layer_offset(l, f)..][..lb].copy_from_slice(&wb[l * lb..(l + 1) * lb]);
    }
    assert_eq!(&full[..trimmed.len()], &trimmed[..]);
    c.reclaim(1).unwrap();
    c.restore(1, f, &full).unwrap();
    assert_eq!(c.chunk_bytes(1).unwrap(), &trimmed[..]);
    c.reclaim(6).unwrap();
    assert!(c.restore(6, f, &trimmed).is_err());
}

/// A chunk past the window that the store lost comes back exactly by recomputing the context
/// up to it (its closure), the chunks past the window cut again afterwards.
#[test]
fn a_lost_chunk_past_the_window_comes_back_with_its_closure() {
    let (_d, m) = model();
    let mut c = cache(&m, m.chunk_shape(16), KvFormat::Int8);
    run(&m, &mut c);
    let before: Vec<Vec<u8>> = (0..7).map(|i| c.chunk_bytes(i).unwrap().to_vec()).collect();
    assert_eq!(c.recompute_closure(6), 6..7);
    assert_eq!(c.recompute_closure(3), 0..4);
    for i in 0..4 {
        c.reclaim(i).unwrap();
    }
    let set: Vec<usize> = c.recompute_closure(3).collect();
    // Two chunks a pass: the later pass reads the earlier one's sliding-window layers.
    let mut m2 = model().1;
    m2.prefill_chunk = 32;
    model::kv::recompute::recompute_chunks(&m2, &mut c, &set).unwrap();
    for (i, b) in before.iter().enumerate() {
        assert_eq!(c.chunk_bytes(i).unwrap(), &b[..], "chunk {i}");
    }
    let trimmed = m.chunk_shape(16).trimmed().chunk_bytes(KvFormat::Int8);
    assert_eq!(c.chunk_bytes(0).unwrap().len(), trimmed);
}

#[test]
fn the_global_layers_attention_is_counted_apart() {
    let (_d, m) = model();
    let shape = m.chunk_shape(16);
    let mut c = cache(&m, shape, KvFormat::Int8);
    run(&m, &mut c);
    let heads = m.cfg.n_heads as u32;
    let taken = c.take_attention(heads);
    let global = taken
        .global
        .expect("a model with a window counts its global layers apart");
    let queries = 120 + 6; // the prompt and the six steps, each attending as it is added
    assert_eq!((taken.all.len(), global.len()), (queries, queries));
    // Each query's softmax sums to one per head and layer: the global group is the one global
    // layer of three, every group all three.
    let sum = |t: &[policy::TokenAttention]| t.iter().map(|a| a.received).sum::<f64>();
    let per_layer = f64::from(heads) * queries as f64;
    assert!(
        (sum(&global) - per_layer).abs() < 1e-2 * per_layer,
        "{}",
        sum(&global)
    );
    assert!(
        (sum(&taken.all) - 3.0 * per_layer).abs() < 3e-2 * per_layer,
        "{}",
        sum(&taken.all)
    );
    for (p, (g, a)) in global.iter().zip(&taken.all).enumerate() {
        // The global layer sees every key from every later query.
        assert_eq!(g.queries, (queries - p) as u64, "key {p}");
        assert!(g.received <= a.received + 1e-4, "key {p}: {g:?} {a:?}");
    }
    // Taken means reset.
    let again = c.take_attention(heads);
    assert!(
        again
            .all
            .iter()
            .chain(again.global.as_deref().unwrap())
            .all(|a| a.received == 0.0 && a.queries == 0)
    );
}
