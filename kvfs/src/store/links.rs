//! Shared prefixes: a context may borrow its first chunks from a shared-prefix context (its `link`
//! file), so contexts with equal first tokens keep one stored copy of those chunks
//! (docs/kvfs.md, "Shared prefixes").
//!
//! A shared prefix is a context marked `shared`: its chunks never change once borrowed, and it
//! lives while a context links to it. The number of links to it is never stored: it is counted
//! from the links themselves, at open and whenever a link goes, so it cannot drift from them
//! after a crash. Recovery drops a link that no longer checks (its prefix gone, its tokens
//! changed) and removes a shared prefix that nothing links to.
//!
//! Callers change links from one thread at a time (the service's engine thread).

use super::{ContextId, Ctx, SLOT_BYTES, Store, StoreError, io, slot_offset};
use crate::format::Link;
use crate::io::{IoError, punch, sync_dir, write_atomic};

impl Store {
    /// The prefix context `id` borrows, if any.
    pub fn link(&self, id: ContextId) -> Result<Option<Link>, StoreError> {
        Ok(self.ctx(id)?.state.lock().link)
    }

    /// Whether context `id` is a shared prefix (never an app's context).
    pub fn is_shared(&self, id: ContextId) -> Result<bool, StoreError> {
        Ok(self.ctx(id)?.shared)
    }

    /// How many contexts link to context `id` (shared prefixes among them).
    pub fn referrers(&self, id: ContextId) -> usize {
        let map = self.contexts.read();
        map.values()
            .filter(|c| c.state.lock().link.is_some_and(|l| l.base == id.0))
            .count()
    }

    /// Why context `ctx`, with `tokens`, cannot borrow `link`; `None` when it can: the base is a
    /// shared prefix of the same owner, model and chunk size, holding at least the chunks
    /// borrowed, whose tokens are this context's first ones.
    pub(super) fn link_problem(&self, ctx: &Ctx, tokens: &[u32], link: Link) -> Option<String> {
        let Ok(base) = self.ctx(ContextId(link.base)) else {
            return Some(format!(
                "its shared prefix {} is not in the store",
                link.base
            ));
        };
        let (m, b) = (&ctx.meta, &base.meta);
        if !base.shared {
            return Some(format!("context {} is not a shared prefix", link.base));
        }
        if m.owner_uid != b.owner_uid || m.fingerprint != b.fingerprint {
            return Some(format!(
                "shared prefix {} has another owner or model",
                link.base
            ));
        }
        if m.chunk_tokens != b.chunk_tokens || link.chunks == 0 {
            return Some(format!(
                "{} chunks of {} tokens borrowed from a prefix of {}-token chunks",
                link.chunks, m.chunk_tokens, b.chunk_tokens
            ));
        }
        let n = link.chunks as usize * m.chunk_tokens as usize;
        let st = base.state.lock();
        if st.tokens.len() < n || tokens.len() < n || st.tokens[..n] != tokens[..n] {
            return Some(format!(
                "the first {n} tokens are not those of shared prefix {}",
                link.base
            ));
        }
        None
    }

    /// Links context `id` to `link` (or unlinks it with `None`), durably: its `link` file
    /// replaced atomically, then its own copies of the chunks it now borrows freed. A shared
    /// prefix that loses its last referrer is removed. The base must be whole in the store
    /// before the link is made: after a crash the link is there only if the base is.
    pub fn set_link(&self, id: ContextId, link: Option<Link>) -> Result<(), StoreError> {
        self.writable()?;
        let ctx = self.ctx(id)?;
        let old = {
            let _w = self.write_lock(&ctx)?;
            if let Some(l) = link {
                let tokens = ctx.state.lock().tokens.clone();
                if let Some(why) = self.link_problem(&ctx, &tokens, l) {
                    return Err(StoreError::Invalid { what: "link", why });
                }
            }
            write_link(&ctx, link)?;
            if let Some(l) = link {
                free_borrowed(&ctx, l.chunks)?;
            }
            std::mem::replace(&mut ctx.state.lock().link, link)
        };
        if let Some(o) = old
            && link.is_none_or(|l| l.base != o.base)
        {
            self.drop_if_unused(ContextId(o.base))?;
        }
        Ok(())
    }

    /// Removes shared prefix `id` when no context links to it any more (and so on down its own
    /// link).
    pub(super) fn drop_if_unused(&self, id: ContextId) -> Result<(), StoreError> {
        let Ok(ctx) = self.ctx(id) else {
            return Ok(());
        };
        if ctx.shared && self.referrers(id) == 0 {
            tracing::debug!(context = %id, "shared prefix no context uses: removed");
            self.delete_context(id)?;
        }
        Ok(())
    }

    /// After a context's tokens were replaced: the link keeps only the borrowed chunks whose
    /// tokens are still the base's (none: the link goes).
    pub(super) fn relink_after_tokens(&self, id: ContextId) -> Result<(), StoreError> {
        let ctx = self.ctx(id)?;
        let Some(link) = ctx.state.lock().link else {
            return Ok(());
        };
        let tokens = ctx.state.lock().tokens.clone();
        let ct = ctx.meta.chunk_tokens as usize;
        let base_tokens = self.tokens(ContextId(link.base)).unwrap_or_default();
        let same = (0..link.chunks as usize)
            .take_while(|&c| {
                let r = c * ct..(c + 1) * ct;
                tokens
                    .get(r.clone())
                    .is_some_and(|t| Some(t) == base_tokens.get(r))
            })
            .count() as u32;
        if same < link.chunks {
            let kept = (same > 0).then_some(Link {
                base: link.base,
                chunks: same,
            });
            self.set_link(id, kept)?;
        }
        Ok(())
    }

    /// Recovery's pass over the links, once every context is loaded: a link that does not check
    /// is dropped (its chunks are recomputed), a linked context's own copies of borrowed chunks
    /// are freed, and shared prefixes nothing links to are removed.
    pub(super) fn recover_links(&mut self) -> Result<(), StoreError> {
        let all: Vec<_> = self.contexts.read().values().cloned().collect();
        for ctx in &all {
            let Some(link) = ctx.state.lock().link else {
                continue;
            };
            let tokens = ctx.state.lock().tokens.clone();
            if let Some(why) = self.link_problem(ctx, &tokens, link) {
                self.note(&ctx.dir.join("link"), "removed", why);
                ctx.state.lock().link = None;
                if !self.options.read_only {
                    write_link(ctx, None)?;
                }
                continue;
            }
            let shadowed: Vec<u32> = (ctx.state.lock().chunks.keys().copied())
                .filter(|&i| i < link.chunks)
                .collect();
            if !shadowed.is_empty() && !self.options.read_only {
                free_borrowed(ctx, link.chunks)?;
                let why = format!("chunks {shadowed:?}: shadowed by its shared prefix");
                self.note(&ctx.dir.join("data"), "removed", why);
            }
        }
        if self.options.read_only {
            return Ok(());
        }
        loop {
            let unused: Vec<ContextId> = (self.contexts.read().values())
                .filter(|c| c.shared)
                .map(|c| c.id)
                .filter(|&id| self.referrers(id) == 0)
                .collect();
            if unused.is_empty() {
                return Ok(());
            }
            for id in unused {
                let dir = self.root.join("contexts").join(id.to_string());
                self.note(&dir, "removed", "a shared prefix no context uses".into());
                self.delete_context(id)?;
            }
        }
    }
}

/// Replaces (or removes) a context's `link` file, durably.
pub(super) fn write_link(ctx: &Ctx, link: Option<Link>) -> Result<(), StoreError> {
    match link {
        Some(l) => write_atomic(&ctx.dir, "link", ".tmp-link", &[&l.encode()])?,
        None => {
            let path = ctx.dir.join("link");
            match std::fs::remove_file(&path) {
                Ok(()) => sync_dir(&ctx.dir)?,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io("remove", &path)(e).into()),
            }
        }
    }
    Ok(())
}

/// Frees a context's own copies of chunks `0..chunks` (borrowed from its base now), durably.
fn free_borrowed(ctx: &Ctx, chunks: u32) -> Result<(), StoreError> {
    let had: Vec<u32> = {
        let mut st = ctx.state.lock();
        let had: Vec<u32> = st.chunks.range(..chunks).map(|(&i, _)| i).collect();
        for i in &had {
            st.chunks.remove(i);
        }
        had
    };
    if had.is_empty() {
        return Ok(());
    }
    let path = ctx.dir.join("data");
    punch(
        &ctx.data,
        slot_offset(0, 0),
        2 * SLOT_BYTES * u64::from(chunks),
    )
    .map_err(|e| IoError::new("punch", &path, e))?;
    nix::unistd::fdatasync(&ctx.data).map_err(|e| IoError::new("fdatasync", &path, e.into()))?;
    Ok(())
}
