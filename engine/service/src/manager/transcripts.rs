//! The manager's transcripts: contexts created with their turns recorded (from a system prompt,
//! or rebuilt from a whole transcript and prefilled), a context's turns for `export`, and a
//! context of another model rebuilt from its transcript on its first use instead of loaded.

use kvfs::{ContextId, NewContext};

use super::Manager;
use crate::ServiceError;
use crate::call::Owner;
use crate::transcript::{self, Turn};

impl Manager {
    /// The turns the store's transcript of context `id` gives for its `tokens`, if it has one
    /// that reads (one that does not is logged and left alone: the context records no more).
    pub(super) fn recorded_turns(&self, id: u64, tokens: &[u32]) -> Option<Vec<Turn>> {
        let bytes = match self.store.transcript(ContextId(id)) {
            Ok(b) => b?,
            Err(e) => {
                tracing::warn!(context = id, error = %e, "transcript not read");
                return None;
            }
        };
        transcript::resolve(&bytes, tokens)
            .inspect_err(|e| tracing::warn!(context = id, error = %e, "transcript not read"))
            .ok()
    }

    /// Creates a context for `owner` holding `tokens`, the rendering of `turns`, with its
    /// transcript recorded: every call that gives its turn then records it and its answer.
    /// With `prefill` the tokens' sealed chunks are computed now, by a Load that recomputes them
    /// (as `prewarm` does); without, they stay open and the first call prefills them with its
    /// prompt (a system prompt). Durable when it returns; on an error nothing is left.
    pub fn create_recorded(
        &mut self,
        owner: &Owner,
        tokens: &[u32],
        turns: Vec<Turn>,
        prefill: bool,
    ) -> Result<u64, ServiceError> {
        if tokens.len() > self.cfg.max_tokens && !prefill {
            return Err(ServiceError::BadRequest {
                what: format!(
                    "a system prompt of {} tokens exceeds the context length of {}",
                    tokens.len(),
                    self.cfg.max_tokens
                ),
            });
        }
        if tokens.len() > self.cfg.max_tokens {
            return Err(ServiceError::Kv(model::kv::KvError::Full {
                len: 0,
                adding: tokens.len(),
                max: self.cfg.max_tokens,
            }));
        }
        let id = self.store.create_context(NewContext {
            owner_uid: owner.uid,
            app: owner.app.clone(),
            fingerprint: self.fingerprint,
            chunk_tokens: self.cfg.chunk_tokens as u32,
        })?;
        let made = self.fill_recorded(owner, id.0, tokens, turns, prefill);
        if made.is_err() {
            let _ = self.forget(id.0);
            if let Err(e) = self.store.delete_context(id) {
                tracing::error!(context = id.0, error = %e, "removing a context half made");
            }
        }
        made.map(|()| id.0)
    }

    fn fill_recorded(
        &mut self,
        owner: &Owner,
        id: u64,
        tokens: &[u32],
        turns: Vec<Turn>,
        prefill: bool,
    ) -> Result<(), ServiceError> {
        let kid = ContextId(id);
        self.store
            .write_transcript(kid, &transcript::encode(&[], &turns, tokens))?;
        if !tokens.is_empty() {
            self.store.append_tokens(kid, tokens)?;
        }
        let mut ctx = if prefill {
            self.new_context(id, owner.clone(), tokens.to_vec())?
        } else {
            let mut c = self.new_context(id, owner.clone(), Vec::new())?;
            c.pending = tokens.to_vec();
            c
        };
        ctx.turns = Some(turns);
        self.contexts.insert(id, ctx);
        // The first chunks another context of the owner computed for the same tokens (a branch
        // of a conversation, the same system prompt) are borrowed, not computed again.
        self.adopt_prefix(id)?;
        if prefill {
            self.prewarm(owner, id)?;
        }
        Ok(())
    }

    /// Context `id`'s turns as recorded, without a copy (`None`: it records none); a context of
    /// another model is `not_found` until [`Manager::adopt`] rebuilt it.
    pub fn turns(&self, owner: &Owner, id: u64) -> Result<Option<&[Turn]>, ServiceError> {
        match self.contexts.get(&id) {
            Some(c) if c.owner.uid == owner.uid => Ok(c.turns.as_deref()),
            _ => Err(ServiceError::NotFound { id }),
        }
    }

    /// Context `id`'s turns (`export`): as recorded, for a context of this model or of another.
    pub fn transcript(&self, owner: &Owner, id: u64) -> Result<Vec<Turn>, ServiceError> {
        match self.contexts.get(&id) {
            Some(c) if c.owner.uid == owner.uid => {
                c.turns.clone().ok_or(ServiceError::NoTranscript { id })
            }
            None if self.other_model.get(&id) == Some(&owner.uid) => {
                let tokens = self.store.tokens(ContextId(id))?;
                self.recorded_turns(id, &tokens)
                    .ok_or(ServiceError::NoTranscript { id })
            }
            _ => Err(ServiceError::NotFound { id }),
        }
    }

    /// Rebuilds context `id` of `owner` from its transcript if another model made it: its turns
    /// rendered with this model's tokenizer (the leading system turn and the most recent turns
    /// that fit the window), the store's context replaced whole (the same id, this model's
    /// fingerprint, no chunk: `Store::rebuild_context`), and its chunks left missing, so its next
    /// Load recomputes them; the other model's K/V is never loaded. A context of this model, or
    /// one without a transcript (it keeps answering `other_model`), is left as it is. Returns
    /// whether it rebuilt.
    pub fn adopt(&mut self, owner: &Owner, id: u64) -> Result<bool, ServiceError> {
        if self.other_model.get(&id) != Some(&owner.uid) {
            return Ok(false);
        }
        let Some(tok) = self.tokenizer.clone() else {
            return Ok(false);
        };
        let kid = ContextId(id);
        let Some(turns) = self.recorded_turns(id, &self.store.tokens(kid)?) else {
            return Ok(false);
        };
        let max = self.cfg.max_tokens;
        let (turns, tokens) =
            transcript::fit(&tok, &turns, max).map_err(|e| ServiceError::InvalidTranscript {
                what: format!("context {id}'s transcript cannot be rendered: {e}"),
            })?;
        if tokens.len() >= max {
            return Err(ServiceError::InvalidTranscript {
                what: format!(
                    "context {id}'s transcript does not fit in {max} tokens with this model, even \
                     its system turn alone"
                ),
            });
        }
        let meta = self.store.meta(kid)?;
        let file = transcript::encode(&turns, &turns, &tokens);
        let new = NewContext {
            owner_uid: meta.owner_uid,
            app: meta.app.clone(),
            fingerprint: self.fingerprint,
            chunk_tokens: self.cfg.chunk_tokens as u32,
        };
        self.store.rebuild_context(kid, new, &tokens, Some(&file))?;
        self.other_model.remove(&id);
        let owner = Owner {
            uid: meta.owner_uid,
            app: meta.app,
        };
        let mut ctx = self.new_context(id, owner, tokens)?;
        ctx.turns = Some(turns);
        self.contexts.insert(id, ctx);
        tracing::info!(
            context = id,
            "context of another model rebuilt from its transcript"
        );
        Ok(true)
    }
}
