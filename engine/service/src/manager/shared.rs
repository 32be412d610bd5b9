//! Forks and shared prefixes: contexts of one owner with the same first tokens hold those tokens'
//! chunks once (docs/service.md, "Forks and shared prefixes").
//!
//! The chunks live in a shared prefix (`kvfs`'s `shared` context, which the contexts borrowing
//! them link to): one stored copy, one pager region, so one resident copy counted once against
//! the budget. A prefix is made from a context's chunks when a fork or a new context with the
//! same first tokens needs them, and goes with the last context that borrows from it.

use kvfs::{ContextId, Link, NewContext, Seed};
use uffd_pager::{ChunkKey, ContextSpec};

use super::Manager;
use crate::ServiceError;
use crate::call::{Call, Owner, Prompt};
use crate::chunks::StoredCopy;
use crate::lineage::Lineage;

/// A shared prefix the manager has taken back: its owner and how many chunks it holds.
#[derive(Clone, Debug)]
pub(super) struct Prefix {
    uid: u32,
    chunks: usize,
}

impl Manager {
    /// Context `id`'s lineage as the store's links say, every prefix in it taken back (its
    /// pager region added, its chunks' facts in the book).
    pub(super) fn lineage_of(&mut self, id: u64) -> Result<Lineage, ServiceError> {
        let lineage = Lineage::of(&self.store, ContextId(id));
        for p in lineage.prefixes().collect::<Vec<_>>() {
            self.take_prefix(p)?;
        }
        Ok(lineage)
    }

    /// Takes back shared prefix `p` (once): a pager region for its chunks, and the book's facts
    /// of each (format, density, stored copy, and whether it is cut past the window, as a
    /// context of its length cuts it).
    fn take_prefix(&mut self, p: ContextId) -> Result<(), ServiceError> {
        if self.prefixes.contains_key(&p.0) {
            return Ok(());
        }
        let info = self.store.context(p)?;
        let t = self.cfg.chunk_tokens;
        let chunks = info.tokens / t;
        let shape = self.model.chunk_shape(t);
        self.pager.add_context(
            p,
            ContextSpec {
                max_chunks: chunks.max(1) as u32,
                max_slot_bytes: shape.slot_bytes(self.cfg.kv_format),
            },
        )?;
        let mut formats = vec![self.cfg.kv_format; chunks];
        let mut densities = vec![0.0; chunks];
        for c in &info.chunks {
            if let kvfs::StoreState::Stored(s) = &c.state
                && (c.index as usize) < chunks
            {
                formats[c.index as usize] = s.format;
                densities[c.index as usize] = f64::from(s.density);
                self.book
                    .set_stored(ChunkKey::new(p.0, c.index), Some(StoredCopy::from(s)));
            }
        }
        self.book.set_formats(p, &formats, &densities);
        self.book.set_trimmed(p, shape.trimmed_chunks(chunks * t));
        let uid = info.meta.owner_uid;
        self.prefixes.insert(p.0, Prefix { uid, chunks });
        Ok(())
    }

    /// Per borrowed chunk, whether its prefix keeps it cut to its global layers: a prefix of
    /// `n` chunks cuts them as a context of `n` chunks does.
    pub(super) fn borrowed_cut(&self, lineage: &Lineage) -> Vec<bool> {
        let shape = self.model.chunk_shape(self.cfg.chunk_tokens);
        let t = self.cfg.chunk_tokens;
        (0..lineage.shared())
            .map(|i| {
                let p = lineage.owner(i);
                let n = self.prefixes.get(&p.0).map_or(0, |x| x.chunks);
                (i as usize) < shape.trimmed_chunks(n * t)
            })
            .collect()
    }

    /// Drops the prefixes the store no longer holds (their last borrower went).
    pub(super) fn prune_prefixes(&mut self) {
        let gone: Vec<u64> = (self.prefixes.keys().copied())
            .filter(|&p| self.store.meta(ContextId(p)).is_err())
            .collect();
        for p in gone {
            self.prefixes.remove(&p);
            if let Err(e) = self.pager.remove_context(ContextId(p)) {
                tracing::warn!(prefix = p, error = %e, "a shared prefix's memory not freed");
            }
            self.book.forget(ContextId(p));
            self.io.forget(p);
        }
    }

    /// Forks context `id`: a new context of the same owner holding the same tokens and turns,
    /// which borrows every sealed chunk of it (copy on write: neither ever changes them; what
    /// each says next is its own). Durable when it returns; returns the new context's id.
    pub fn fork(&mut self, owner: &Owner, id: u64) -> Result<u64, ServiceError> {
        let _span = tracing::info_span!("fork", ctx = id).entered();
        let o = self.owned(owner, id)?.owner.clone();
        let sealed = self.contexts[&id].cache.chunk_formats().len();
        let link = match sealed {
            0 => None,
            k => Some(self.share(id, k)?),
        };
        let kid = ContextId(id);
        let tokens = self.store.tokens(kid)?;
        let transcript = self.store.transcript(kid)?;
        let child = self.store.create_context_with(
            NewContext {
                owner_uid: o.uid,
                app: o.app.clone(),
                fingerprint: self.fingerprint,
                chunk_tokens: self.cfg.chunk_tokens as u32,
            },
            Seed {
                tokens: &tokens,
                transcript: transcript.as_deref(),
                link,
                shared: false,
            },
        )?;
        crate::failpoints::check("service::fork::created", crate::failpoints::injected)?;
        if let Err(e) = self.resume(child.0) {
            let _ = self.store.delete_context(child);
            self.prune_prefixes();
            return Err(e);
        }
        tracing::info!(
            parent = id,
            child = child.0,
            chunks = sealed,
            "context forked"
        );
        Ok(child.0)
    }

    /// Makes context `id`'s first `k` sealed chunks borrowed from a shared prefix, and returns
    /// the link that borrows them: the prefix it borrows from already when it holds them, else a
    /// new one made from its chunks (its chunks brought back by a Load, written to the new
    /// prefix, the context linked to it, its own copies freed and the resident ones moved to the
    /// prefix's region).
    pub(super) fn share(&mut self, id: u64, k: usize) -> Result<Link, ServiceError> {
        let lineage = self.contexts[&id].lineage.lock().clone();
        let have = lineage.shared() as usize;
        if k <= have {
            let base = lineage
                .top()
                .expect("a context that borrows has a prefix")
                .0;
            let chunks = k as u32;
            return Ok(Link { base, chunks });
        }
        self.writer.flush();
        let chunks = match self.own_chunks(id, have..k) {
            Ok(c) => c,
            Err(e) => {
                // As after a failed prewarm: the context goes back to what the store holds.
                if let Err(e2) = self.reload(id) {
                    tracing::error!(ctx = id, error = %e2, "reloading the context failed");
                }
                return Err(e);
            }
        };
        let ctx = &self.contexts[&id];
        let t = self.cfg.chunk_tokens;
        let tokens = ctx.cache.tokens()[..k * t].to_vec();
        let (uid, app) = (ctx.owner.uid, ctx.owner.app.clone());
        let below = lineage.top().map(|p| Link {
            base: p.0,
            chunks: have as u32,
        });
        let prefix = self.store.create_context_with(
            NewContext {
                owner_uid: uid,
                app,
                fingerprint: self.fingerprint,
                chunk_tokens: t as u32,
            },
            Seed {
                tokens: &tokens,
                link: below,
                shared: true,
                transcript: None,
            },
        )?;
        let link = Link {
            base: prefix.0,
            chunks: k as u32,
        };
        if let Err(e) = self.fill_prefix(id, prefix, have, &chunks, link) {
            // Nothing links to the prefix: it goes now (or at the next open).
            if let Err(e2) = self.store.delete_context(prefix) {
                tracing::warn!(prefix = prefix.0, error = %e2, "an unused prefix left for the next open");
            }
            return Err(e);
        }
        self.move_to_prefix(id, prefix, have, &chunks)?;
        Ok(link)
    }

    /// Writes `chunks` (from chunk `have` on) to the new `prefix`, then links context `id` to it:
    /// the link is made only once the prefix holds them durably.
    fn fill_prefix(
        &self,
        id: u64,
        prefix: ContextId,
        have: usize,
        chunks: &[(kvfs::KvFormat, f32, Vec<u8>)],
        link: Link,
    ) -> Result<(), ServiceError> {
        let writes: Vec<(u32, kvfs::KvFormat, f32, &[u8])> = (have..)
            .zip(chunks)
            .map(|(i, (f, d, b))| (i as u32, *f, *d, b.as_slice()))
            .collect();
        (self.store).write_new_chunks(prefix, &self.fingerprint, &writes)?;
        crate::failpoints::check("service::share::written", crate::failpoints::injected)?;
        self.store.set_link(ContextId(id), Some(link))?;
        Ok(())
    }

    /// Context `id`'s chunks `range` (all its own): format, density and bytes, read in memory
    /// after a Load brought back those missing.
    #[allow(clippy::type_complexity)]
    fn own_chunks(
        &mut self,
        id: u64,
        range: std::ops::Range<usize>,
    ) -> Result<Vec<(kvfs::KvFormat, f32, Vec<u8>)>, ServiceError> {
        let ctx = self.contexts.get_mut(&id).expect("the caller checked it");
        ctx.cache.pin()?;
        let call = call_parts!(self, id);
        let loaded = call.load(&mut self.readers, ctx, Prompt::Tokens(&[]));
        let densities = ctx.densities();
        let out = loaded.and_then(|_| {
            range
                .map(|i| {
                    let bytes = ctx.cache.chunk_bytes(i).ok_or(ServiceError::Kv(
                        model::kv::KvError::NotResident { index: i },
                    ))?;
                    let density = densities.get(i).copied().unwrap_or(0.0) as f32;
                    Ok((ctx.cache.chunk_formats()[i], density, bytes.to_vec()))
                })
                .collect()
        });
        ctx.cache.unpin();
        out
    }

    /// After context `id` was linked to the new `prefix` for its chunks from `have` on: its own
    /// copies leave its region and the book, the prefix is taken back with `chunks` resident
    /// (written already, so reclaimable without I/O), and the context reads them from it.
    fn move_to_prefix(
        &mut self,
        id: u64,
        prefix: ContextId,
        have: usize,
        chunks: &[(kvfs::KvFormat, f32, Vec<u8>)],
    ) -> Result<(), ServiceError> {
        for i in have..have + chunks.len() {
            let key = ChunkKey::new(id, i as u32);
            // Its bytes are the prefix's now, stored: giving them up loses nothing.
            let _ = self.pager.mark_persisted(key);
            match self.pager.reclaim(key) {
                Ok(_) | Err(uffd_pager::PagerError::NotResident { .. }) => {}
                Err(e) => return Err(e.into()),
            }
            self.book.set_stored(key, None);
        }
        self.take_prefix(prefix)?;
        for (i, (_, _, bytes)) in (have..).zip(chunks) {
            let key = ChunkKey::new(prefix.0, i as u32);
            // No room is no loss: the chunk is stored, and comes back when it is read.
            if self.pager.populate(key, bytes.len(), bytes).is_ok() {
                self.pager.mark_persisted(key)?;
            }
        }
        let lineage = self.lineage_of(id)?;
        let cut = self.borrowed_cut(&lineage);
        let ctx = self.contexts.get_mut(&id).expect("the caller checked it");
        *ctx.lineage.lock() = lineage;
        ctx.cache.set_shared(cut)?;
        Ok(())
    }

    /// Makes a context that has computed nothing yet (just created, its tokens a system prompt
    /// or a transcript) borrow the longest run of first chunks that a context or prefix of the
    /// same owner already computed for the same tokens, so they are neither computed nor held
    /// twice. Candidates are found by a hash of their first chunk's tokens, then compared token
    /// by token. Never across owners.
    pub(super) fn adopt_prefix(&mut self, id: u64) -> Result<(), ServiceError> {
        let Some((uid, tokens)) = self.fresh_tokens(id) else {
            return Ok(());
        };
        let t = self.cfg.chunk_tokens;
        let head = hash(&tokens[..t]);
        let mut best: Option<(usize, u64)> = None;
        let candidates = (self.contexts.iter())
            .filter(|&(&c, x)| c != id && x.owner.uid == uid && !x.cache.chunk_formats().is_empty())
            .map(|(&c, x)| (c, x.cache.tokens(), x.cache.chunk_formats().len()));
        for (c, theirs, sealed) in candidates {
            if theirs.len() < t || hash(&theirs[..t]) != head {
                continue;
            }
            let same = common_chunks(&tokens, theirs, t).min(sealed);
            if same > best.map_or(0, |b| b.0) {
                best = Some((same, c));
            }
        }
        let Some((k, from)) = best else {
            return Ok(());
        };
        let Some(k) = self.shareable(from, k) else {
            return Ok(());
        };
        let link = self.share(from, k)?;
        tracing::info!(
            ctx = id,
            from,
            chunks = k,
            "first chunks borrowed from a shared prefix"
        );
        self.store.set_link(ContextId(id), Some(link))?;
        self.reload(id)
    }

    /// The owner and stored tokens of context `id` if it borrows nothing, has computed none of
    /// its chunks, and holds at least one whole chunk of tokens; sharing must be on.
    fn fresh_tokens(&self, id: u64) -> Option<(u32, Vec<u32>)> {
        if !self.cfg.share_prefixes {
            return None;
        }
        let ctx = self.contexts.get(&id)?;
        let sealed = ctx.cache.chunk_formats().len();
        let stored = self.book.stored(ContextId(id), sealed);
        let computed = stored.iter().any(Option::is_some)
            || ctx.cache.missing_chunks().len() != sealed
            || ctx.cache.shared() > 0;
        if computed {
            return None;
        }
        let tokens = self.store.tokens(ContextId(id)).ok()?;
        (tokens.len() >= self.cfg.chunk_tokens).then_some((ctx.owner.uid, tokens))
    }

    /// How many of context `from`'s first `k` chunks a new prefix can hold: all of them unless
    /// the model has sliding-window layers and `from` cut some of them to their global layers
    /// that a prefix of `k` chunks keeps whole (then only what it already borrows).
    fn shareable(&self, from: u64, k: usize) -> Option<usize> {
        let ctx = &self.contexts[&from];
        let shape = self.model.chunk_shape(self.cfg.chunk_tokens);
        let t = self.cfg.chunk_tokens;
        let sealed = ctx.cache.chunk_formats().len();
        let k = if shape.trimmed_chunks(sealed * t) <= shape.trimmed_chunks(k * t) {
            k
        } else {
            k.min(ctx.cache.shared())
        };
        (k > 0).then_some(k)
    }

    /// The shared prefixes taken back: how many, and the pager bytes they hold.
    pub fn shared_prefixes(&self) -> (usize, u64) {
        let bytes = (self.prefixes.keys())
            .map(|&p| self.pager.context_resident(ContextId(p)).unwrap_or(0))
            .sum();
        (self.prefixes.len(), bytes)
    }

    /// The owner uid of every prefix, for tests of the rule that prefixes never cross owners.
    pub fn prefix_owners(&self) -> Vec<u32> {
        self.prefixes.values().map(|p| p.uid).collect()
    }
}

/// How many whole chunks of `t` tokens `a` and `b` start with in common.
fn common_chunks(a: &[u32], b: &[u32], t: usize) -> usize {
    let same = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    same / t
}

/// A hash of a run of token ids (FNV-1a over their bytes).
fn hash(tokens: &[u32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in tokens.iter().flat_map(|t| t.to_le_bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn common_chunks_count_whole_chunks_alone() {
        assert_eq!(common_chunks(&[1, 2, 3, 4, 5], &[1, 2, 3, 4, 9], 2), 2);
        assert_eq!(common_chunks(&[1, 2, 3], &[1, 2, 3, 4], 2), 1);
        assert_eq!(common_chunks(&[7], &[1], 2), 0);
        assert_ne!(hash(&[1, 2]), hash(&[2, 1]));
    }
}
