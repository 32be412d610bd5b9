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
