//! Token generation: greedy and sampled decoding (temperature, top-k, top-p, seed), stop
//! tokens, a token budget, and streaming of every token as it is produced; under a
//! [`Guide`] (structured output) or not, one loop.

use crate::guided::{Guide, Next};
use crate::kv::KvCache;
use crate::{Logits, Model, ModelError};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::time::Instant;

/// How the next token is chosen from the logits.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep only the k most likely tokens (0: no limit).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p (1.0: no limit).
    pub top_p: f32,
    /// Seed of the sampler's random generator.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

/// Chooses tokens from logits.
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

impl Sampler {
    /// A sampler seeded from `params.seed`.
    pub fn new(params: SamplingParams) -> Self {
        let rng = StdRng::seed_from_u64(params.seed);
        Self { params, rng }
    }

    /// The next token for `logits`.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.temperature <= 0.0 {
            return argmax(logits);
        }
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l / self.params.temperature))
            .collect();
        cand.sort_unstable_by(|a, b| b.1.total_cmp(&a.1));
        if self.params.top_k > 0 {
            cand.truncate(self.params.top_k);
        }
        let max = cand[0].1;
        let mut sum = 0.0;
        for c in cand.iter_mut() {
            c.1 = (c.1 - max).exp();
            sum += c.1;
        }
        let mut keep = cand.len();
        if self.params.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, c) in cand.iter().enumerate() {
                acc += c.1 / sum;
                if acc >= self.params.top_p {
                    keep = i + 1;
                    break;
                }
            }
        }
        cand.truncate(keep);
        let total: f32 = cand.iter().map(|c| c.1).sum();
        let mut r = self.rng.random::<f32>() * total;
        for c in &cand {
            r -= c.1;
            if r <= 0.0 {
                return c.0;
            }
        }
        cand[cand.len() - 1].0
    }
}

/// The index of the largest logit (the first on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Why generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// A stop token was produced (it is not part of the output).
    Stop,
    /// The token budget ran out.
    MaxTokens,
    /// The callback asked to stop.
    Cancelled,
    /// The context is full.
    ContextFull,
}

/// The outcome of [`generate`].
#[derive(Clone, Debug)]
pub struct Generation {
    /// Generated tokens (without the stop token).
    pub tokens: Vec<u32>,
    /// Why it stopped.
    pub stop: StopReason,
    /// Prompt tokens prefilled.
    pub prompt_tokens: usize,
    /// Seconds spent on the prompt (to the first token's logits).
    pub prefill_secs: f64,
    /// Seconds spent generating after the first token.
    pub decode_secs: f64,
}

/// Prefills `prompt` after what `cache` holds, then generates up to `max_tokens` tokens, calling
/// `on_token` with each one as soon as it is chosen (return false to stop): the one generation
/// loop, [`generate_guided`], with no guide.
pub fn generate(
    model: &Model,
    cache: &mut KvCache,
    prompt: &[u32],
    max_tokens: usize,
    stop: &[u32],
    sampler: &mut Sampler,
    on_token: impl FnMut(u32) -> bool,
) -> Result<Generation, ModelError> {
    generate_guided(
        model, cache, prompt, max_tokens, stop, sampler, None, on_token,
    )
    .map(|g| g.generation)
}

/// A generation and the time its guide (structured output) took.
#[derive(Clone, Debug)]
pub struct GuidedGeneration {
    pub generation: Generation,
    /// Seconds in the guide's `constrain` and `advance`, over every token.
    pub guide_secs: f64,
}

/// Prefills `prompt` after what `cache` holds, then generates up to `max_tokens` tokens, each
/// chosen from logits `guide` masked first ([`crate::generate::generate`] is this with no
/// guide). A token budget counts what the context still holds too, so a guide can end its
/// answer within it.
#[allow(clippy::too_many_arguments)]
pub fn generate_guided(
    model: &Model,
    cache: &mut KvCache,
    prompt: &[u32],
    max_tokens: usize,
    stop: &[u32],
    sampler: &mut Sampler,
    mut guide: Option<&mut dyn Guide>,
    mut on_token: impl FnMut(u32) -> bool,
) -> Result<GuidedGeneration, ModelError> {
    let t0 = Instant::now();
    let mut logits = model.forward(cache, prompt, Logits::Last)?;
    let prefill_secs = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut guide_secs = 0.0;
    let mut tokens = Vec::new();
    let reason = loop {
        if tokens.len() >= max_tokens {
            break StopReason::MaxTokens;
        }
        if let Some(g) = guide.as_deref_mut() {
            let t = Instant::now();
            // This token, and one more for each token the context still has room for.
            let room = 1 + cache.max_tokens().saturating_sub(cache.len());
            let next = g.constrain(&mut logits, (max_tokens - tokens.len()).min(room));
            guide_secs += t.elapsed().as_secs_f64();
            if next == Next::End {
                break StopReason::Stop;
            }
        }
        let next = sampler.sample(&logits);
        if let Some(g) = guide.as_deref_mut() {
            let t = Instant::now();
            g.advance(next);
            guide_secs += t.elapsed().as_secs_f64();
        }
        if stop.contains(&next) {
            break StopReason::Stop;
        }
        tokens.push(next);
        if !on_token(next) {
            break StopReason::Cancelled;
        }
        if tokens.len() >= max_tokens {
            break StopReason::MaxTokens;
        }
        if cache.len() + 1 > cache.max_tokens() {
            break StopReason::ContextFull;
        }
        logits = model.forward(cache, &[next], Logits::Last)?;
    };
    Ok(GuidedGeneration {
        generation: Generation {
            tokens,
            stop: reason,
            prompt_tokens: prompt.len(),
            prefill_secs,
            decode_secs: t1.elapsed().as_secs_f64(),
        },
        guide_secs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_is_argmax_and_sampling_is_seeded() {
        let logits = [0.1, 3.0, 2.9, -1.0];
        assert_eq!(Sampler::new(SamplingParams::default()).sample(&logits), 1);
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 7,
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(p.clone());
            (0..50).map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(p.clone());
            (0..50).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b);
        assert!(a.contains(&1) && a.contains(&2), "{a:?}");
    }

    #[test]
    fn top_k_and_top_p_cut_the_tail() {
        let logits = [5.0, 4.9, 0.0, -3.0];
        let mut k1 = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 1,
            top_p: 1.0,
            seed: 1,
        });
        assert!((0..100).all(|_| k1.sample(&logits) == 0));
        let mut p = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.9,
            seed: 1,
        });
        assert!((0..200).all(|_| p.sample(&logits) < 2));
    }
}
