//! Generation under a constraint on the next token (structured output): [`generate_guided`] is
//! [`crate::generate::generate`] with a [`Guide`] that masks the logits before each token is
//! sampled, is told each token chosen, and may end the answer. The guide's own time is measured
//! apart, so its cost per token can be reported beside the decode step's.

use std::time::Instant;

use crate::generate::{Generation, Sampler, StopReason};
use crate::kv::KvCache;
use crate::{Logits, Model, ModelError};

/// What the guide says before a token is sampled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// Sample from the masked logits.
    Sample,
    /// The answer is complete: stop here (reported as a stop token would be).
    End,
}

/// A constraint on the tokens of an answer.
pub trait Guide {
    /// Masks (sets to -inf) the logits of every token that may not come next; `remaining`
    /// tokens may still be generated, this one included.
    fn constrain(&mut self, logits: &mut [f32], remaining: usize) -> Next;
    /// The token chosen (a stop token included).
    fn advance(&mut self, token: u32);
}

/// A generation and the time its guide took.
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
