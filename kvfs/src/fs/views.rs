//! The per-file views: opening `stats`, `info`, `text`, `tokens` (snapshots taken at open) and the
//! per-chunk view `chunks/<i>` (read checked; written whole and committed at close), and its
//! extended attributes.

use std::ffi::OsStr;
use std::sync::Arc;

use fuser::{Errno, FileAttr, FileHandle, FileType, OpenAccMode, OpenFlags};

use super::nodes::{Node, attr, parse_index};
use super::state::{Handle, KvFs, errno, store_err};
use crate::format::KvFormat;
use crate::store::{ContextId, MAX_CHUNK_BYTES, StoreError, StoreState};

impl KvFs {
    pub(super) fn open_node(
        &self,
        uid: u32,
        pid: u32,
        node: Node,
        flags: OpenFlags,
    ) -> Result<FileHandle, Errno> {
        let writing = flags.acc_mode() != OpenAccMode::O_RDONLY;
        let text = |s: String| Ok(self.add_handle(Handle::Read(Arc::new(s.into_bytes()))));
        match node {
            Node::Root | Node::Dir(_) | Node::Chunks(_) => Err(Errno::EISDIR),
            _ if writing && self.read_only => Err(Errno::EROFS),
            Node::Stats | Node::Info(_) | Node::Text(_) | Node::Tokens(_) | Node::Data(_)
                if writing =>
            {
                Err(Errno::EACCES)
            }
            Node::Data(c) => {
                // Reached only without passthrough: the daemon reads the data file for it.
                self.owner(uid, c)?;
                Ok(self.add_handle(Handle::Data))
            }
            Node::Stats => text(self.stats_text()),
            Node::Info(c) => {
                self.owner(uid, c)?;
                text(self.store.render_info(c).map_err(store_err)?)
            }
            Node::Text(c) => {
                self.owner(uid, c)?;
                text(self.store.render_text(c).map_err(store_err)?)
            }
            Node::Tokens(c) => {
                self.owner(uid, c)?;
                text(self.store.render_tokens(c).map_err(store_err)?)
            }
            Node::Kv(c) => {
                self.owner(uid, c)?;
                Ok(self.add_handle(Handle::Kv { partial: None }))
            }
            Node::Chunk(c, i) => {
                self.owner(uid, c)?;
                let truncate = flags.0 & libc::O_TRUNC != 0;
                if writing {
                    let buf = if truncate {
                        Vec::new()
                    } else {
                        self.read_chunk(c, i)?
                    };
                    return Ok(self.add_handle(Handle::Write {
                        ctx: c,
                        index: i,
                        buf,
                        dirty: truncate,
                        opener: pid,
                    }));
                }
                let data = self.read_chunk(c, i)?;
                Ok(self.add_handle(Handle::Read(Arc::new(data))))
            }
        }
    }

    pub(super) fn read_chunk(&self, c: ContextId, i: u32) -> Result<Vec<u8>, Errno> {
        let fp = self.store.fingerprint(c).map_err(store_err)?;
        self.store.read_chunk(c, i, &fp).map_err(|e| {
            if matches!(e, StoreError::Corrupt { .. }) {
                tracing::warn!(error = %e, "kvfs refused a corrupt chunk");
            }
            store_err(e)
        })
    }

    pub(super) fn create_node(
        &self,
        uid: u32,
        pid: u32,
        parent: Node,
        name: &OsStr,
    ) -> Result<(FileHandle, FileAttr), Errno> {
        let Node::Chunks(c) = parent else {
            return Err(Errno::EPERM);
        };
        if self.read_only {
            return Err(Errno::EROFS);
        }
        let (owner, t) = self.owner(uid, c)?;
        let index = parse_index(name.to_str().ok_or(Errno::EINVAL)?).map_err(|_| Errno::EINVAL)?;
        let fh = self.add_handle(Handle::Write {
            ctx: c,
            index,
            buf: Vec::new(),
            dirty: true,
            opener: pid,
        });
        Ok((
            fh,
            attr(
                Node::Chunk(c, index),
                FileType::RegularFile,
                0o600,
                owner,
                0,
                t,
            ),
        ))
    }

    pub(super) fn write_handle(
        &self,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
    ) -> Result<u32, Errno> {
        let mut handles = self.handles.lock();
        let Some(Handle::Write { buf, dirty, .. }) = handles.get_mut(&fh.0) else {
            return Err(Errno::EBADF);
        };
        let end = (offset as usize)
            .checked_add(data.len())
            .ok_or(Errno::EFBIG)?;
        if end > MAX_CHUNK_BYTES {
            return Err(Errno::EFBIG);
        }
        if buf.len() < end {
            buf.resize(end, 0);
        }
        buf[offset as usize..end].copy_from_slice(data);
        *dirty = true;
        Ok(data.len() as u32)
    }

    pub(super) fn truncate(
        &self,
        node: Node,
        fh: Option<FileHandle>,
        size: u64,
    ) -> Result<(), Errno> {
        let Node::Chunk(c, i) = node else {
            return Err(Errno::EPERM);
        };
        if self.read_only {
            return Err(Errno::EROFS);
        }
        if size as usize > MAX_CHUNK_BYTES {
            return Err(Errno::EFBIG);
        }
        let mut handles = self.handles.lock();
        let target = handles.iter_mut().find(|(k, h)| {
            matches!(h, Handle::Write { ctx, index, .. } if *ctx == c && *index == i)
                && fh.is_none_or(|f| f.0 == **k)
        });
        match target {
            Some((_, Handle::Write { buf, dirty, .. })) => {
                buf.resize(size as usize, 0);
                *dirty = true;
                Ok(())
            }
            // Chunks change only through an open file, committed whole.
            _ => Err(Errno::EPERM),
        }
    }

    /// Writes a dirty handle's bytes to the store as the chunk's new version.
    pub(super) fn commit(&self, fh: FileHandle) -> Result<(), Errno> {
        let (ctx, index, buf) = {
            let mut handles = self.handles.lock();
            match handles.get_mut(&fh.0) {
                Some(Handle::Write {
                    ctx,
                    index,
                    buf,
                    dirty: dirty @ true,
                    ..
                }) => {
                    *dirty = false;
                    (*ctx, *index, std::mem::take(buf))
                }
                // `kv` writes commit as each image completes; nothing waits for a close.
                Some(_) => return Ok(()),
                None => return Err(Errno::EBADF),
            }
        };
        let (pf, pd) = self
            .pending
            .lock()
            .get(&(ctx, index))
            .copied()
            .unwrap_or((None, None));
        let (old_f, old_d) = match self.store.chunk_state(ctx, index) {
            Ok(StoreState::Stored(s)) => (Some(s.format), Some(s.density)),
            _ => (None, None),
        };
        let format = pf.or(old_f).unwrap_or(KvFormat::Int8);
        let density = pd.or(old_d).unwrap_or(0.0);
        let result = self.store.meta(ctx).and_then(|m| {
            self.store
                .write_chunk(ctx, index, &m.fingerprint, format, density, &buf)
        });
        let mut handles = self.handles.lock();
        if let Some(Handle::Write { buf: b, dirty, .. }) = handles.get_mut(&fh.0) {
            *b = buf;
            if result.is_err() {
                *dirty = true;
            }
        }
        drop(handles);
        match result {
            Ok(_) => {
                self.pending.lock().remove(&(ctx, index));
                Ok(())
            }
            Err(e) => {
                tracing::warn!(error = %e, "kvfs write through the mount failed");
                Err(errno(&e))
            }
        }
    }

    pub(super) fn xattr_value(&self, uid: u32, node: Node, name: &OsStr) -> Result<Vec<u8>, Errno> {
        let Node::Chunk(c, i) = node else {
            return Err(Errno::from_i32(libc::ENODATA));
        };
        self.owner(uid, c)?;
        let pending = self.pending.lock().get(&(c, i)).copied();
        let state = self.store.chunk_state(c, i).map_err(store_err)?;
        let stored = match &state {
            StoreState::Stored(s) => Some(s.clone()),
            _ => None,
        };
        let v = match name.to_str().unwrap_or("") {
            "user.kvfs.format" => pending
                .and_then(|p| p.0)
                .or(stored.as_ref().map(|s| s.format))
                .map(|f| f.name().to_owned()),
            "user.kvfs.density" => pending
                .and_then(|p| p.1)
                .or(stored.as_ref().map(|s| s.density))
                .map(|d| d.to_string()),
            "user.kvfs.state" => Some(state.name().to_owned()),
            "user.kvfs.codec" => stored.as_ref().map(|s| s.codec.name().to_owned()),
            "user.kvfs.generation" => stored.as_ref().map(|s| s.generation.to_string()),
            "user.kvfs.raw_bytes" => stored.as_ref().map(|s| s.raw_len.to_string()),
            "user.kvfs.stored_bytes" => stored.as_ref().map(|s| s.stored_len.to_string()),
            "user.kvfs.written" => stored
                .as_ref()
                .and_then(|s| s.written)
                .map(crate::store::utc),
            "user.kvfs.resident" => self
                .store
                .resident(c, i)
                .map(|r| if r { "yes" } else { "no" }.to_owned()),
            _ => None,
        };
        v.map(String::into_bytes)
            .ok_or(Errno::from_i32(libc::ENODATA))
    }

    pub(super) fn set_xattr(
        &self,
        uid: u32,
        node: Node,
        name: &OsStr,
        value: &[u8],
    ) -> Result<(), Errno> {
        let Node::Chunk(c, i) = node else {
            return Err(Errno::ENOTSUP);
        };
        if self.read_only {
            return Err(Errno::EROFS);
        }
        self.owner(uid, c)?;
        let value = std::str::from_utf8(value)
            .map_err(|_| Errno::EINVAL)?
            .trim_end_matches('\0');
        let mut pending = self.pending.lock();
        let entry = pending.entry((c, i)).or_default();
        match name.to_str().unwrap_or("") {
            "user.kvfs.format" => entry.0 = Some(value.parse().map_err(|_| Errno::EINVAL)?),
            "user.kvfs.density" => {
                let d: f32 = value.trim().parse().map_err(|_| Errno::EINVAL)?;
                entry.1 = Some(d);
            }
            _ => return Err(Errno::ENOTSUP),
        }
        drop(pending);
        // The label is part of what a write commits: open writers of the chunk commit again.
        for h in self.handles.lock().values_mut() {
            if let Handle::Write {
                ctx, index, dirty, ..
            } = h
                && (*ctx, *index) == (c, i)
            {
                *dirty = true;
            }
        }
        Ok(())
    }
}
