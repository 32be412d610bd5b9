//! Attention each token of a context received, the input of its chunks' information density
//! (paper Eq. 1), counted per layer group.
//!
//! A model whose layers all see every key has one group. A model with sliding-window layers
//! (Gemma 3) counts its global layers a second time on their own: a chunk past the window keeps
//! only those layers, and their attention is what its compression should follow
//! (docs/service.md, "Compression by density per layer group").

use crate::kv::codec::ChunkShape;

/// The density trackers of a context whose chunks have `shape`, on a model of `n_heads` query
/// heads: every layer's, and the global layers' apart when some layers see only a window (what
/// [`crate::kv::KvCache::take_attention`] hands over).
pub fn group_density(
    shape: &ChunkShape,
    n_heads: u32,
) -> Result<policy::GroupDensity, policy::DensityError> {
    policy::GroupDensity::new(
        n_heads * shape.n_layers as u32,
        shape
            .has_window()
            .then_some(n_heads * shape.n_global() as u32),
        shape.tokens,
    )
}

/// Sums of attention received and how many rows saw each token, for one group of layers.
#[derive(Clone, Debug, Default)]
pub(crate) struct Received {
    /// Attention each token received, summed over the group's heads, layers and queries.
    pub(crate) sum: Vec<f32>,
    /// How many (query, head, layer) rows of the group saw each token.
    pub(crate) rows: Vec<u32>,
}

impl Received {
    fn resize(&mut self, n: usize) {
        self.sum.resize(n, 0.0);
        self.rows.resize(n, 0);
    }

    fn reset(&mut self) {
        self.sum.iter_mut().for_each(|a| *a = 0.0);
        self.rows.iter_mut().for_each(|r| *r = 0);
    }

    /// The tokens as the policy crate counts them: `heads_layers` is the group's query heads
    /// times layers, so `queries` counts each query token once.
    pub(crate) fn token_attention(&self, heads_layers: u32) -> Vec<policy::TokenAttention> {
        let hl = u64::from(heads_layers.max(1));
        self.sum
            .iter()
            .zip(&self.rows)
            .map(|(&received, &rows)| policy::TokenAttention {
                received: f64::from(received),
                queries: u64::from(rows) / hl,
            })
            .collect()
    }
}

/// What a cache records of attention: every layer, and the global layers alone when some layers
/// see only a window.
#[derive(Clone, Debug)]
pub(crate) struct Attention {
    /// Every layer.
    pub(crate) all: Received,
    /// The global layers, on a model with sliding-window layers.
    pub(crate) global: Option<Received>,
    /// Which layers are global (bit `l`: layer `l`).
    global_layers: u128,
}

impl Attention {
    pub(crate) fn new(shape: &ChunkShape) -> Self {
        Self {
            all: Received::default(),
            global: shape.has_window().then(Received::default),
            global_layers: shape.global,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.all.sum.len()
    }

    fn groups(&mut self) -> impl Iterator<Item = &mut Received> {
        std::iter::once(&mut self.all).chain(self.global.as_mut())
    }

    pub(crate) fn resize(&mut self, n: usize) {
        self.groups().for_each(|g| g.resize(n));
    }

    pub(crate) fn truncate(&mut self, n: usize) {
        self.groups().for_each(|g| {
            g.sum.truncate(n);
            g.rows.truncate(n);
        });
    }

    pub(crate) fn reset(&mut self) {
        self.groups().for_each(Received::reset);
    }

    /// The groups layer `layer` counts in.
    fn of(&mut self, layer: usize) -> impl Iterator<Item = &mut Received> {
        let global = self.global_layers >> layer & 1 == 1;
        std::iter::once(&mut self.all).chain(self.global.as_mut().filter(|_| global))
    }

    /// Adds attention received at `layer` by keys `from..from + col.len()`.
    pub(crate) fn add(&mut self, layer: usize, from: usize, col: &[f32]) {
        for g in self.of(layer) {
            for (a, c) in g.sum.iter_mut().skip(from).zip(col) {
                *a += c;
            }
        }
    }

    /// Adds to the rows of `layer` that saw each key `0..seen.len()`.
    pub(crate) fn add_rows(&mut self, layer: usize, seen: &[u32]) {
        for g in self.of(layer) {
            for (r, s) in g.rows.iter_mut().zip(seen) {
                *r += s;
            }
        }
    }
}

/// One call's attention as the policy crate counts it ([`crate::kv::KvCache::take_attention`]).
#[derive(Clone, Debug, PartialEq)]
pub struct TakenAttention {
    /// Over every layer.
    pub all: Vec<policy::TokenAttention>,
    /// Over the global layers alone, on a model with sliding-window layers.
    pub global: Option<Vec<policy::TokenAttention>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_without_a_window_has_one_group() {
        let dense = ChunkShape {
            n_layers: 2,
            n_kv_heads: 1,
            head_dim: 8,
            tokens: 16,
            ..ChunkShape::DENSE
        };
        let mut a = Attention::new(&dense);
        assert!(a.global.is_none());
        a.resize(2);
        a.add(1, 0, &[0.5, 0.25]);
        a.add_rows(1, &[2, 1]);
        assert_eq!(
            (a.all.sum.clone(), a.all.rows.clone()),
            (vec![0.5, 0.25], vec![2, 1])
        );
        // Layer 1 sees a window: only layer 0 counts in the global group.
        let windowed = ChunkShape {
            global: 0b01,
            window: 16,
            ..dense
        };
        let mut a = Attention::new(&windowed);
        a.resize(2);
        a.add(0, 1, &[1.0]);
        a.add(1, 0, &[0.5, 0.5]);
        a.add_rows(0, &[1, 1]);
        a.add_rows(1, &[1, 1]);
        let g = a.global.as_ref().unwrap();
        assert_eq!(
            (g.sum.clone(), g.rows.clone()),
            (vec![0.0, 1.0], vec![1, 1])
        );
        assert_eq!(
            (a.all.sum.clone(), a.all.rows.clone()),
            (vec![0.5, 1.5], vec![2, 2])
        );
        a.reset();
        assert!(
            a.all
                .sum
                .iter()
                .chain(&a.global.as_ref().unwrap().sum)
                .all(|&x| x == 0.0)
        );
    }
}
