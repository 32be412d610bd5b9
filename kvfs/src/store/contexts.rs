//! Contexts created and deleted, and their `meta` and `tokens` files replaced crash-safely (chunks
//! whose tokens changed dropped); the data file's creation and opening.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

use super::{
    ContextId, Ctx, CtxState, MAX_APP_LEN, NewContext, SLOT_BYTES, Store, StoreError, StoreState,
    covers, io, mkdir, now_nanos, slot_offset,
};
use crate::format::{ContextMeta, encode_tokens};
use crate::io::{IoError, punch, sync_dir, write_atomic};

impl Store {
    /// Creates an empty context, durably: it exists after a crash only if it exists whole.
    pub fn create_context(&self, new: NewContext) -> Result<ContextId, StoreError> {
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
        let meta = ContextMeta {
            owner_uid: new.owner_uid,
            app: new.app,
            fingerprint: new.fingerprint,
            chunk_tokens: new.chunk_tokens,
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
        };
        let staging = self.root.join("staging");
        let tmp = staging.join(id.to_string());
        mkdir(&tmp)?;
        write_atomic(&tmp, "meta", ".tmp-meta", &[&meta.encode()])?;
        write_atomic(&tmp, "tokens", ".tmp-tokens", &[&encode_tokens(&[])])?;
        create_data(&tmp)?;
        sync_dir(&staging)?;
        let contexts = self.root.join("contexts");
        let dir = contexts.join(id.to_string());
        std::fs::rename(&tmp, &dir).map_err(io("rename", &tmp))?;
        sync_dir(&contexts)?;
        sync_dir(&staging)?;
        let (data, direct) = open_data(&dir.join("data"), false, self.direct)?;
        let ctx = Ctx {
            id,
            meta,
            dir,
            data,
            direct,
            write: Mutex::new(()),
            state: Mutex::new(CtxState::default()),
            deleted: AtomicBool::new(false),
        };
        self.contexts.write().insert(id, Arc::new(ctx));
        tracing::debug!(context = %id, "context created");
        Ok(id)
    }

    /// Deletes a context and all its chunks, durably.
    pub fn delete_context(&self, id: ContextId) -> Result<(), StoreError> {
        self.writable()?;
        let ctx = self.ctx(id)?;
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

    /// Replaces the token ids, durably; chunks computed from tokens that changed are dropped.
    pub fn replace_tokens(&self, id: ContextId, tokens: Vec<u32>) -> Result<(), StoreError> {
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
