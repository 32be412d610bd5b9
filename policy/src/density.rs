//! Information density (paper Eq. 1): per-token attention received, folded into one density per chunk.

/// What one key token has received so far: attention summed over layers, heads and queries.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TokenAttention {
    /// Sum of the softmaxed attention scores this token received, over every layer, head and query.
    pub received: f64,
    /// How many query tokens have attended to it (each counted once, not once per layer and head).
    pub queries: u64,
}

impl TokenAttention {
    /// The token's density: its column average in the attention matrix, averaged over layers and
    /// heads (the inner three sums of Eq. 1), or `None` when no query has seen it yet.
    pub fn density(&self, heads_layers: u32) -> Option<f64> {
        if self.queries == 0 || heads_layers == 0 {
            return None;
        }
        Some(self.received / (self.queries as f64 * f64::from(heads_layers)))
    }
}

/// Why densities could not be computed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DensityError {
    #[error("chunks must hold at least one token")]
    ZeroChunkTokens,
    #[error("the model must have at least one layer and head (got layers x heads = 0)")]
    ZeroHeadsLayers,
    #[error("token {token} received a non-finite or negative attention sum {received}")]
    BadReceived { token: usize, received: f64 },
}

/// Accumulates per-token attention over a context's life and turns it into chunk densities.
///
/// Each call's attention is merged in, so a token's density averages over every query that ever
/// saw it, and a context that grew since the last call simply has more tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct DensityTracker {
    tokens: Vec<TokenAttention>,
    heads_layers: u32,
    chunk_tokens: usize,
}

impl DensityTracker {
    /// A tracker for a model with `layers * heads` attention maps and chunks of `chunk_tokens`.
    pub fn new(heads_layers: u32, chunk_tokens: usize) -> Result<Self, DensityError> {
        if heads_layers == 0 {
            return Err(DensityError::ZeroHeadsLayers);
        }
        if chunk_tokens == 0 {
            return Err(DensityError::ZeroChunkTokens);
        }
        Ok(Self {
            tokens: Vec::new(),
            heads_layers,
            chunk_tokens,
        })
    }

    /// How many tokens the tracker knows.
    pub fn tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Merges one call's accumulators, token `i` of `call` being token `i` of the context.
    ///
    /// `call` may be longer than what the tracker holds (the context grew); it may be shorter (the
    /// call's queries saw only a prefix), in which case the other tokens are left as they were.
    pub fn merge(&mut self, call: &[TokenAttention]) -> Result<(), DensityError> {
        if let Some((token, t)) = call
            .iter()
            .enumerate()
            .find(|(_, t)| !t.received.is_finite() || t.received < 0.0)
        {
            return Err(DensityError::BadReceived {
                token,
                received: t.received,
            });
        }
        if call.len() > self.tokens.len() {
            self.tokens.resize(call.len(), TokenAttention::default());
        }
        for (acc, t) in self.tokens.iter_mut().zip(call) {
            acc.received += t.received;
            acc.queries += t.queries;
        }
        Ok(())
    }

    /// Forgets the first `tokens` tokens (a sliding window moved), rounded to whole chunks by the
    /// caller.
    pub fn drop_front(&mut self, tokens: usize) {
        let n = tokens.min(self.tokens.len());
        self.tokens.drain(..n);
    }

    /// One density per chunk (Eq. 1); see [`chunk_densities`].
    pub fn chunk_densities(&self) -> Vec<f64> {
        densities_of(&self.tokens, self.chunk_tokens, self.heads_layers)
    }
}

/// A context's densities per layer group.
///
/// On a model whose layers all see every key there is one group, and this is a
/// [`DensityTracker`]. On a model with sliding-window layers (Gemma 3) a chunk past the window
/// keeps only its global layers, so the attention those layers gave it is what its compression
/// should follow: the global layers are tracked a second time on their own, and such a chunk's
/// density is theirs ([`GroupDensity::chunk_densities`]). A chunk still within the window keeps
/// every layer and takes every layer's density.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupDensity {
    all: DensityTracker,
    global: Option<DensityTracker>,
}

impl GroupDensity {
    /// Trackers for `heads_layers` attention maps over every layer and, on a model with
    /// sliding-window layers, `global_heads_layers` over its global layers alone.
    pub fn new(
        heads_layers: u32,
        global_heads_layers: Option<u32>,
        chunk_tokens: usize,
    ) -> Result<Self, DensityError> {
        Ok(Self {
            all: DensityTracker::new(heads_layers, chunk_tokens)?,
            global: global_heads_layers
                .map(|hl| DensityTracker::new(hl, chunk_tokens))
                .transpose()?,
        })
    }

    /// Merges one call's accumulators: over every layer, and over the global layers when they
    /// are tracked apart (`global` is ignored otherwise).
    pub fn merge(
        &mut self,
        all: &[TokenAttention],
        global: Option<&[TokenAttention]>,
    ) -> Result<(), DensityError> {
        self.all.merge(all)?;
        if let (Some(tracker), Some(g)) = (self.global.as_mut(), global) {
            tracker.merge(g)?;
        }
        Ok(())
    }

    /// Seeds the first `chunks` chunks as if one query had seen each of their tokens with the
    /// density `seeds` gives the chunk (chunk index, density); the others stay unseen. Densities
    /// kept in a store come back this way: the ranking of chunks is kept, the weight of their
    /// history is not.
    pub fn seed(&mut self, chunks: usize, seeds: &[(usize, f32)]) -> Result<(), DensityError> {
        for tracker in std::iter::once(&mut self.all).chain(self.global.as_mut()) {
            let (t, hl) = (tracker.chunk_tokens, f64::from(tracker.heads_layers));
            let mut seeded = vec![TokenAttention::default(); chunks * t];
            for &(i, d) in seeds.iter().filter(|(i, _)| *i < chunks) {
                for a in &mut seeded[i * t..(i + 1) * t] {
                    *a = TokenAttention {
                        received: f64::from(d.max(0.0)) * hl,
                        queries: 1,
                    };
                }
            }
            tracker.merge(&seeded)?;
        }
        Ok(())
    }

    /// One density per chunk (Eq. 1): the global layers' for the first `past_window` chunks
    /// (those past the sliding window, which keep only those layers), every layer's for the
    /// others. Without a window it is every layer's for all.
    ///
    /// The two groups' densities are on different scales (a sliding-window layer's softmax runs
    /// over a window's keys, a global one's over the whole context), so the chunks of each
    /// group are ranked among themselves ([`crate::assign::assign_levels_grouped`]).
    pub fn chunk_densities(&self, past_window: usize) -> Vec<f64> {
        let mut d = self.all.chunk_densities();
        if let Some(g) = &self.global {
            let n = past_window.min(d.len());
            // Chunks past the window that no global query saw yet keep the highest density of
            // their group (never compressed on no evidence), as in `chunk_densities`.
            let global = densities_of(
                &g.tokens[..(n * g.chunk_tokens).min(g.tokens.len())],
                g.chunk_tokens,
                g.heads_layers,
            );
            let highest = global.iter().copied().fold(0.0, f64::max);
            for (i, slot) in d[..n].iter_mut().enumerate() {
                *slot = global.get(i).copied().unwrap_or(highest);
            }
        }
        d
    }
}

/// Chunk densities (Eq. 1) of a context whose tokens hold `tokens`' accumulators.
///
/// A chunk's density is the mean of its tokens' densities; the last chunk may be partial and
/// averages over the tokens it has (the paper's `1/(q-p)`).
/// Tokens no query has seen yet are left out of the mean; a chunk none of whose tokens has been
/// seen gets the context's highest density, so it is never compressed on no evidence.
pub fn chunk_densities(
    tokens: &[TokenAttention],
    chunk_tokens: usize,
    heads_layers: u32,
) -> Result<Vec<f64>, DensityError> {
    if chunk_tokens == 0 {
        return Err(DensityError::ZeroChunkTokens);
    }
    if heads_layers == 0 {
        return Err(DensityError::ZeroHeadsLayers);
    }
    if let Some((token, t)) = tokens
        .iter()
        .enumerate()
        .find(|(_, t)| !t.received.is_finite() || t.received < 0.0)
    {
        return Err(DensityError::BadReceived {
            token,
            received: t.received,
        });
    }
    Ok(densities_of(tokens, chunk_tokens, heads_layers))
}

fn densities_of(tokens: &[TokenAttention], chunk_tokens: usize, heads_layers: u32) -> Vec<f64> {
    let observed: Vec<Option<f64>> = tokens
        .chunks(chunk_tokens)
        .map(|chunk| {
            let (sum, n) = chunk
                .iter()
                .filter_map(|t| t.density(heads_layers))
                .fold((0.0, 0usize), |(s, n), d| (s + d, n + 1));
            (n > 0).then(|| sum / n as f64)
        })
        .collect();
    let highest = observed.iter().flatten().copied().fold(0.0, f64::max);
    observed.into_iter().map(|d| d.unwrap_or(highest)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(received: f64, queries: u64) -> TokenAttention {
        TokenAttention { received, queries }
    }

    fn check(tokens: &[TokenAttention], chunk: usize, hl: u32, expected: &[f64]) {
        let got = chunk_densities(tokens, chunk, hl).unwrap();
        assert_eq!(got.len(), expected.len(), "{got:?} vs {expected:?}");
        for (g, e) in got.iter().zip(expected) {
            assert!((g - e).abs() < 1e-12, "{got:?} vs {expected:?}");
        }
    }

    #[test]
    fn paper_figure_6_token() {
        // Token "a" received 0.3 + 0.5 + 0.1 from three queries, one layer, one head: 0.3.
        check(&[t(0.9, 3)], 16, 1, &[0.3]);
    }

    #[test]
    fn chunks_and_partial_last_chunk() {
        check(&[t(2.0, 1), t(4.0, 1), t(6.0, 2)], 2, 2, &[1.5, 1.5]);
        check(&[t(1.0, 1), t(1.0, 1), t(1.0, 1)], 2, 1, &[1.0, 1.0]);
        check(&[], 16, 1, &[]);
    }

    #[test]
    fn unseen_tokens_and_chunks() {
        // The unseen token is left out of its chunk's mean.
        check(&[t(1.0, 1), t(0.0, 0)], 2, 1, &[1.0]);
        // An unseen chunk takes the highest observed density.
        check(&[t(0.5, 1), t(0.2, 1), t(0.0, 0)], 1, 1, &[0.5, 0.2, 0.5]);
        // Nothing observed: every chunk is equal.
        check(&[t(0.0, 0), t(0.0, 0)], 1, 1, &[0.0, 0.0]);
    }

    #[test]
    fn errors() {
        assert_eq!(
            chunk_densities(&[], 0, 1),
            Err(DensityError::ZeroChunkTokens)
        );
        assert_eq!(
            chunk_densities(&[], 1, 0),
            Err(DensityError::ZeroHeadsLayers)
        );
        assert_eq!(
            chunk_densities(&[t(1.0, 1), t(-1.0, 1)], 1, 1),
            Err(DensityError::BadReceived {
                token: 1,
                received: -1.0
            })
        );
        let mut tracker = DensityTracker::new(1, 1).unwrap();
        assert!(matches!(
            tracker.merge(&[t(f64::NAN, 1)]),
            Err(DensityError::BadReceived { token: 0, .. })
        ));
        assert_eq!(tracker.tokens(), 0);
    }

    #[test]
    fn chunks_past_the_window_take_the_global_layers_density() {
        // Two chunks of two tokens; 4 maps over every layer, 2 over the global ones.
        let mut d = GroupDensity::new(4, Some(2), 2).unwrap();
        let all = [t(4.0, 1), t(4.0, 1), t(2.0, 1), t(2.0, 1)];
        let global = [t(0.2, 1), t(0.2, 1), t(1.0, 1), t(1.0, 1)];
        d.merge(&all, Some(&global)).unwrap();
        // Within the window every chunk takes every layer's density.
        assert_eq!(d.chunk_densities(0), vec![1.0, 0.5]);
        // Chunk 0 is past the window: its global layers' density.
        assert_eq!(d.chunk_densities(1), vec![0.1, 0.5]);
        assert_eq!(d.chunk_densities(2), vec![0.1, 0.5]);
        // A model without a window has one group whatever is passed.
        let mut one = GroupDensity::new(4, None, 2).unwrap();
        one.merge(&all, Some(&global)).unwrap();
        assert_eq!(one.chunk_densities(2), vec![1.0, 0.5]);
    }

    #[test]
    fn seeded_densities_come_back_in_both_groups() {
        let mut d = GroupDensity::new(18, Some(3), 2).unwrap();
        d.seed(3, &[(0, 0.25), (2, 0.5), (7, 1.0)]).unwrap();
        // Chunk 1 was not seeded: the highest density of its group; chunk 7 is past `chunks`.
        assert_eq!(d.chunk_densities(0), vec![0.25, 0.5, 0.5]);
        assert_eq!(d.chunk_densities(3), vec![0.25, 0.5, 0.5]);
    }

    #[test]
    fn tracker_merges_growing_context() {
        let mut tracker = DensityTracker::new(2, 2).unwrap();
        tracker.merge(&[t(2.0, 1), t(2.0, 1)]).unwrap();
        assert_eq!(tracker.chunk_densities(), vec![1.0]);
        // The context grew by two tokens; old tokens got more queries.
        tracker
            .merge(&[t(2.0, 2), t(0.0, 2), t(8.0, 2), t(4.0, 1)])
            .unwrap();
        // token 0: 4/(3*2), token 1: 2/(3*2), token 2: 8/(2*2), token 3: 4/(1*2)
        let d = tracker.chunk_densities();
        assert!((d[0] - 0.5).abs() < 1e-12, "{d:?}");
        assert!((d[1] - 2.0).abs() < 1e-12, "{d:?}");
        tracker.drop_front(2);
        assert_eq!(tracker.tokens(), 2);
        assert_eq!(tracker.chunk_densities(), vec![2.0]);
    }
}
