//! Contexts created, rebuilt and deleted, and their `meta`, `tokens` and `transcript` files
//! replaced crash-safely (chunks whose tokens changed dropped); the data file's creation and
//! opening.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

use super::links::write_link;
use super::{
    ContextId, Ctx, CtxState, MAX_APP_LEN, NewContext, SLOT_BYTES, Store, StoreError, StoreState,
    covers, io, mkdir, now_nanos, slot_offset,
};
use crate::format::{ContextMeta, Link, encode_tokens};

/// What a new context starts with besides its metadata ([`Store::create_context_with`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct Seed<'a> {
    /// Its token ids.
    pub tokens: &'a [u32],
    /// Its transcript (opaque bytes to kvfs).
    pub transcript: Option<&'a [u8]>,
    /// The prefix it borrows: a shared prefix of the same owner and model whose tokens are its
    /// first ones (checked).
    pub link: Option<Link>,
    /// Whether it is a shared prefix itself (`shared` marker): never an app's context, it lives
    /// while a context links to it.
    pub shared: bool,
}
use crate::io::{IoError, punch, sync_dir, write_atomic};

impl Store {
    /// Creates an empty context, durably: it exists after a crash only if it exists whole.
    pub fn create_context(&self, new: NewContext) -> Result<ContextId, StoreError> {
        self.create_context_with(new, Seed::default())
    }

    /// Creates a context with its tokens, transcript and link from the start, durably: it exists
    /// after a crash only if it exists whole (a shared prefix made this way has no chunk yet;
    /// one that no context links to is removed at the next open).
    pub fn create_context_with(
        &self,
        new: NewContext,
        seed: Seed<'_>,
    ) -> Result<ContextId, StoreError> {
        self.writable()?;
        if new.chunk_tokens == 0 {
            return Err(StoreError::Invalid {
                what: "chunk size",
                why: "must be at least 1 token".into(),
            });
        }
        if new.app.len() > MAX_APP_LEN {
            return Err(StoreError::Invalid {
                what: "app name",
                why: format!("{} bytes, at most {MAX_APP_LEN}", new.app.len()),
            });
        }
        let id = ContextId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let meta = new_meta(new);
        let tmp = self.stage(&id.to_string(), &meta, seed.tokens, seed.transcript)?;
        let mut ctx = self.open_fresh(id, meta, tmp.clone(), seed.tokens.to_vec())?;
        ctx.shared = seed.shared;
        if let Some(l) = seed.link {
            if let Some(why) = self.link_problem(&ctx, seed.tokens, l) {
                let _ = std::fs::remove_dir_all(&tmp);
                return Err(StoreError::Invalid { what: "link", why });
            }
            write_link(&ctx, Some(l))?;
            ctx.state.get_mut().link = Some(l);
        }
        if seed.shared {
            write_atomic(&tmp, "shared", ".tmp-shared", &[b"shared prefix\n"])?;
        }
        let staging = self.root.join("staging");
        let contexts = self.root.join("contexts");
        let dir = contexts.join(id.to_string());
        std::fs::rename(&tmp, &dir).map_err(io("rename", &tmp))?;
        sync_dir(&contexts)?;
        sync_dir(&staging)?;
        ctx.dir = dir;
        self.contexts.write().insert(id, Arc::new(ctx));
        tracing::debug!(context = %id, "context created");
        Ok(id)
    }

    /// A context directory in `staging/<name>` holding `meta`, `tokens`, an empty data file and,
    /// if given, `transcript`, all durable.
    fn stage(
        &self,
        name: &str,
        meta: &ContextMeta,
        tokens: &[u32],
        transcript: Option<&[u8]>,
    ) -> Result<std::path::PathBuf, StoreError> {
        let staging = self.root.join("staging");
        let tmp = staging.join(name);
        mkdir(&tmp)?;
        write_atomic(&tmp, "meta", ".tmp-meta", &[&meta.encode()])?;
        write_atomic(&tmp, "tokens", ".tmp-tokens", &[&encode_tokens(tokens)])?;
        if let Some(t) = transcript {
            write_atomic(&tmp, "transcript", ".tmp-transcript", &[t])?;
        }
        create_data(&tmp)?;
        sync_dir(&staging)?;
        Ok(tmp)
    }

    /// The open state of a context directory just made, with no chunk.
    fn open_fresh(
        &self,
        id: ContextId,
        meta: ContextMeta,
        dir: std::path::PathBuf,
        tokens: Vec<u32>,
    ) -> Result<Ctx, StoreError> {
        let (data, direct) = open_data(&dir.join("data"), false, self.direct)?;
        Ok(Ctx {
            id,
            meta,
            dir,
            data,
            direct,
            shared: false,
            write: Mutex::new(()),
            state: Mutex::new(CtxState {
                tokens,
                ..CtxState::default()
            }),
            deleted: AtomicBool::new(false),
        })
    }

    /// Replaces context `id` whole, keeping its id: new metadata (another model's fingerprint,
    /// or another chunk size, say), `tokens`, `transcript` (`None`: none), and no chunk. The new
    /// directory is made in `staging/` and swapped with the old one in one
    /// `renameat2(RENAME_EXCHANGE)`, so after a crash at any point the context is either the old
    /// one or the new one; the old one is then removed (by the next open's recovery, if the
    /// process dies first).
    pub fn rebuild_context(
        &self,
        id: ContextId,
        new: NewContext,
        tokens: &[u32],
        transcript: Option<&[u8]>,
    ) -> Result<(), StoreError> {
        self.writable()?;
        let old = self.ctx(id)?;
        let _w = self.write_lock(&old)?;
        let meta = new_meta(new);
        let tmp = self.stage(&format!("{id}.{}", now_nanos()), &meta, tokens, transcript)?;
        let staging = self.root.join("staging");
        let contexts = self.root.join("contexts");
        nix::fcntl::renameat2(
            nix::fcntl::AT_FDCWD,
            &tmp,
            nix::fcntl::AT_FDCWD,
            &old.dir,
            nix::fcntl::RenameFlags::RENAME_EXCHANGE,
        )
        .map_err(|e| IoError::new("exchange", &tmp, e.into()))?;
        sync_dir(&contexts)?;
        sync_dir(&staging)?;
        old.deleted.store(true, Ordering::SeqCst);
        let ctx = self.open_fresh(id, meta, old.dir.clone(), tokens.to_vec())?;
        self.contexts.write().insert(id, Arc::new(ctx));
        if let Err(e) = std::fs::remove_dir_all(&tmp) {
            tracing::warn!(path = %tmp.display(), error = %e, "could not remove a replaced context; it is removed at next open");
        }
        let link = old.state.lock().link;
        if let Some(l) = link {
            self.drop_if_unused(ContextId(l.base))?;
        }
        tracing::debug!(context = %id, "context rebuilt");
        Ok(())
    }

    /// Replaces a context's transcript, durably (write, fsync, rename, fsync of the directory):
    /// after a crash it is the old one or the new one. To kvfs a transcript is opaque bytes the
    /// service keeps beside the tokens.
    pub fn write_transcript(&self, id: ContextId, bytes: &[u8]) -> Result<(), StoreError> {
        self.writable()?;
        let ctx = self.ctx(id)?;
        let _w = self.write_lock(&ctx)?;
        write_atomic(&ctx.dir, "transcript", ".tmp-transcript", &[bytes])?;
        Ok(())
    }

    /// A context's transcript as last written, or `None` if none was.
    pub fn transcript(&self, id: ContextId) -> Result<Option<Vec<u8>>, StoreError> {
        let ctx = self.ctx(id)?;
        let path = ctx.dir.join("transcript");
        match std::fs::read(&path) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(IoError::new("read", &path, e).into()),
        }
    }

    /// Deletes a context and all its chunks, durably; the shared prefix it linked to goes too if
    /// no other context links to it. A shared prefix still linked to is refused.
    pub fn delete_context(&self, id: ContextId) -> Result<(), StoreError> {
        self.writable()?;
        let ctx = self.ctx(id)?;
        if ctx.shared {
            let referrers = self.referrers(id);
            if referrers > 0 {
                return Err(StoreError::Referenced {
                    context: id,
                    referrers,
                });
            }
        }
        self.delete_dir(&ctx)?;
        let link = ctx.state.lock().link;
        if let Some(l) = link {
            self.drop_if_unused(ContextId(l.base))?;
        }
        Ok(())
    }

    /// Removes a context's directory, durably (renamed into `trash/`, then removed).
    fn delete_dir(&self, ctx: &Ctx) -> Result<(), StoreError> {
        let id = ctx.id;
        let _w = ctx.write.lock();
        if ctx.deleted.swap(true, Ordering::SeqCst) {
            return Err(StoreError::NoSuchContext { context: id });
        }
        let trash = self
            .root
            .join("trash")
            .join(format!("{id}.{}", now_nanos()));
        let res = std::fs::rename(&ctx.dir, &trash).map_err(io("rename", &ctx.dir));
        if let Err(e) = res {
            ctx.deleted.store(false, Ordering::SeqCst);
            return Err(e.into());
        }
        self.contexts.write().remove(&id);
        sync_dir(&self.root.join("contexts"))?;
        sync_dir(&self.root.join("trash"))?;
        if let Err(e) = std::fs::remove_dir_all(&trash) {
            tracing::warn!(path = %trash.display(), error = %e, "could not empty trash; it is removed at next open");
        }
        Ok(())
    }

    /// Appends token ids, durably, before any chunk that depends on them is written.
    /// Returns the new token count.
    pub fn append_tokens(&self, id: ContextId, more: &[u32]) -> Result<usize, StoreError> {
        self.writable()?;
        let ctx = self.ctx(id)?;
        let _w = self.write_lock(&ctx)?;
        let mut tokens = ctx.state.lock().tokens.clone();
        tokens.extend_from_slice(more);
        write_atomic(
            &ctx.dir,
            "tokens",
            ".tmp-tokens",
            &[&encode_tokens(&tokens)],
        )?;
        let n = tokens.len();
        ctx.state.lock().tokens = tokens;
        Ok(n)
    }

    /// Replaces the token ids, durably; chunks computed from tokens that changed are dropped, and
    /// so are borrowed chunks whose tokens are no longer the shared prefix's.
    pub fn replace_tokens(&self, id: ContextId, tokens: Vec<u32>) -> Result<(), StoreError> {
        self.replace_own_tokens(id, tokens)?;
        self.relink_after_tokens(id)
    }

    fn replace_own_tokens(&self, id: ContextId, tokens: Vec<u32>) -> Result<(), StoreError> {
        self.writable()?;
        let ctx = self.ctx(id)?;
        let _w = self.write_lock(&ctx)?;
        write_atomic(
            &ctx.dir,
            "tokens",
            ".tmp-tokens",
            &[&encode_tokens(&tokens)],
        )?;
        let ct = ctx.meta.chunk_tokens;
        let slots = tokens.len().div_ceil(ct as usize) as u32;
        let stale: Vec<u32> = {
            let mut st = ctx.state.lock();
            st.tokens = tokens;
            let st = &mut *st;
            let stale = st
                .chunks
                .iter()
                .filter(|(i, s)| match s {
                    StoreState::Stored(c) => {
                        **i >= slots || !covers(&st.tokens, &c.tokens, c.tokens_crc)
                    }
                    _ => **i >= slots,
                })
                .map(|(i, _)| *i)
                .collect::<Vec<_>>();
            for i in &stale {
                st.chunks.remove(i);
            }
            stale
        };
        let path = ctx.dir.join("data");
        // One punch per run of consecutive chunks: a slid window makes every chunk but the
        // sink stale, and a punch per chunk cost 0.8 ms each (0.33 s for 427 chunks).
        for (first, n) in runs(&stale) {
            punch(
                &ctx.data,
                slot_offset(first, 0),
                2 * SLOT_BYTES * u64::from(n),
            )
            .map_err(|e| IoError::new("punch", &path, e))?;
        }
        if !stale.is_empty() {
            nix::unistd::fdatasync(&ctx.data)
                .map_err(|e| IoError::new("fdatasync", &path, e.into()))?;
        }
        Ok(())
    }
}

/// The runs of consecutive indices in the ascending list `indices`, as (first, length).
fn runs(indices: &[u32]) -> Vec<(u32, u32)> {
    let mut out: Vec<(u32, u32)> = Vec::new();
    for &i in indices {
        match out.last_mut() {
            Some((first, n)) if *first + *n == i => *n += 1,
            _ => out.push((i, 1)),
        }
    }
    out
}

/// A new context's metadata, created now.
fn new_meta(new: NewContext) -> ContextMeta {
    ContextMeta {
        owner_uid: new.owner_uid,
        app: new.app,
        fingerprint: new.fingerprint,
        chunk_tokens: new.chunk_tokens,
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
    }
}

/// Creates an empty data file in a context directory, durably.
pub(super) fn create_data(dir: &Path) -> Result<(), IoError> {
    let path = dir.join("data");
    let f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&path)
        .map_err(|e| IoError::new("create", &path, e))?;
    f.sync_all().map_err(|e| IoError::new("fsync", &path, e))?;
    sync_dir(dir)
}

/// Opens a context's data file: for writing (or read-only) and, with `direct`, a second descriptor
/// with O_DIRECT for reads.
pub(super) fn open_data(
    path: &Path,
    read_only: bool,
    direct: bool,
) -> Result<(File, Option<File>), IoError> {
    let data = OpenOptions::new()
        .read(true)
        .write(!read_only)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| IoError::new("open", path, e))?;
    let direct = if direct {
        Some(
            OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
                .open(path)
                .map_err(|e| IoError::new("open", path, e))?,
        )
    } else {
        None
    };
    Ok((data, direct))
}

#[cfg(test)]
mod tests {
    use super::runs;

    #[test]
    fn runs_join_consecutive_indices_only() {
        assert_eq!(runs(&[]), vec![]);
        assert_eq!(runs(&[3]), vec![(3, 1)]);
        assert_eq!(runs(&[1, 2, 3, 5, 6, 9]), vec![(1, 3), (5, 2), (9, 1)]);
    }
}
