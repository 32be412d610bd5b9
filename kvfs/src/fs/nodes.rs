//! The inode table and the listing: computed inode numbers (`context << 32 | slot`), each node's
//! attributes, name lookup and directory entries, and who may see which context.

use std::ffi::OsStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{Errno, FileAttr, FileType, INodeNo};

use super::state::{KvFs, store_err};
use crate::store::{ContextId, StoreState};

/// Attributes are not cached: sizes of `info`, `text`, `stats` and chunks change under writes, and a
/// fresh `getattr` is where a uid that does not own a context is turned away.
pub(super) const TTL: Duration = Duration::ZERO;
/// Names are cached for a second, which saves a `lookup` per path component on every open.
/// Ids are never reused and deleted or quarantined names fail their `getattr`, so a cached name
/// never leads to wrong data; new names are not cached negatively and appear at once.
pub(super) const ENTRY_TTL: Duration = Duration::from_secs(1);
/// The root directory's attributes never change.
pub(super) const ROOT_TTL: Duration = Duration::from_secs(1);
/// The attribute TTL of context directories when [`MountConfig::cache_dir_attrs`] is set.
pub(super) const DIR_TTL: Duration = Duration::from_secs(1);
pub(super) const ROOT: u64 = 1;
pub(super) const STATS: u64 = 2;
/// Inode of a context's piece: `context << 32 | slot`; chunk `i` is slot `FIRST_CHUNK + i`.
pub(super) const SLOT_DIR: u64 = 1;
pub(super) const SLOT_CHUNKS: u64 = 2;
pub(super) const SLOT_INFO: u64 = 3;
pub(super) const SLOT_TEXT: u64 = 4;
pub(super) const SLOT_KV: u64 = 5;
pub(super) const SLOT_DATA: u64 = 6;
pub(super) const SLOT_TOKENS: u64 = 7;
pub(super) const FIRST_CHUNK: u64 = 16;
/// Extended attributes of a chunk in the per-chunk view; `format` and `density` can be set before a
/// write commits, the others are read only.
pub(super) const XATTRS: [&str; 9] = [
    "user.kvfs.format",
    "user.kvfs.density",
    "user.kvfs.state",
    "user.kvfs.codec",
    "user.kvfs.generation",
    "user.kvfs.raw_bytes",
    "user.kvfs.stored_bytes",
    "user.kvfs.written",
    "user.kvfs.resident",
];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Node {
    Root,
    Stats,
    Dir(ContextId),
    Chunks(ContextId),
    Info(ContextId),
    Text(ContextId),
    Tokens(ContextId),
    Kv(ContextId),
    Data(ContextId),
    Chunk(ContextId, u32),
}

impl Node {
    pub(super) fn of(ino: INodeNo) -> Option<Node> {
        let ino = ino.0;
        match ino {
            ROOT => return Some(Node::Root),
            STATS => return Some(Node::Stats),
            _ => {}
        }
        let ctx = ContextId(ino >> 32);
        if ctx.0 == 0 {
            return None;
        }
        Some(match ino & 0xffff_ffff {
            SLOT_DIR => Node::Dir(ctx),
            SLOT_CHUNKS => Node::Chunks(ctx),
            SLOT_INFO => Node::Info(ctx),
            SLOT_TEXT => Node::Text(ctx),
            SLOT_TOKENS => Node::Tokens(ctx),
            SLOT_KV => Node::Kv(ctx),
            SLOT_DATA => Node::Data(ctx),
            s if s >= FIRST_CHUNK => Node::Chunk(ctx, (s - FIRST_CHUNK) as u32),
            _ => return None,
        })
    }

    pub(super) fn ino(self) -> INodeNo {
        let base = |c: ContextId| c.0 << 32;
        INodeNo(match self {
            Node::Root => ROOT,
            Node::Stats => STATS,
            Node::Dir(c) => base(c) | SLOT_DIR,
            Node::Chunks(c) => base(c) | SLOT_CHUNKS,
            Node::Info(c) => base(c) | SLOT_INFO,
            Node::Text(c) => base(c) | SLOT_TEXT,
            Node::Tokens(c) => base(c) | SLOT_TOKENS,
            Node::Kv(c) => base(c) | SLOT_KV,
            Node::Data(c) => base(c) | SLOT_DATA,
            Node::Chunk(c, i) => base(c) | (FIRST_CHUNK + i as u64),
        })
    }

    pub(super) fn context(self) -> Option<ContextId> {
        match self {
            Node::Root | Node::Stats => None,
            Node::Dir(c)
            | Node::Chunks(c)
            | Node::Info(c)
            | Node::Text(c)
            | Node::Tokens(c)
            | Node::Kv(c)
            | Node::Data(c)
            | Node::Chunk(c, _) => Some(c),
        }
    }
}

/// The largest chunk index with an inode (the slot must fit in 32 bits).
pub(super) const MAX_INDEX: u32 = u32::MAX - FIRST_CHUNK as u32;

impl KvFs {
    pub(super) fn attr_ttl(&self, a: &FileAttr) -> &'static Duration {
        if a.ino.0 == ROOT {
            &ROOT_TTL
        } else if self.cache_dir_attrs && a.kind == FileType::Directory {
            &DIR_TTL
        } else {
            &TTL
        }
    }

    pub(super) fn attr(&self, uid: u32, node: Node) -> Result<FileAttr, Errno> {
        let dir = |perm: u16, owner: u32, time: SystemTime| {
            attr(node, FileType::Directory, perm, owner, 0, time)
        };
        let file = |perm: u16, owner: u32, size: usize, time: SystemTime| {
            attr(node, FileType::RegularFile, perm, owner, size as u64, time)
        };
        match node {
            Node::Root => Ok(dir(0o755, 0, UNIX_EPOCH)),
            Node::Stats => Ok(file(0o444, 0, self.stats_text().len(), SystemTime::now())),
            Node::Dir(c) | Node::Chunks(c) => {
                let (owner, t) = self.owner(uid, c)?;
                Ok(dir(0o700, owner, t))
            }
            Node::Info(c) => {
                let (owner, t) = self.owner(uid, c)?;
                Ok(file(
                    0o400,
                    owner,
                    self.store.render_info(c).map_err(store_err)?.len(),
                    t,
                ))
            }
            Node::Text(c) => {
                let (owner, t) = self.owner(uid, c)?;
                Ok(file(
                    0o400,
                    owner,
                    self.store.render_text(c).map_err(store_err)?.len(),
                    t,
                ))
            }
            Node::Tokens(c) => {
                let (owner, t) = self.owner(uid, c)?;
                Ok(file(
                    0o400,
                    owner,
                    self.store.render_tokens(c).map_err(store_err)?.len(),
                    t,
                ))
            }
            Node::Kv(c) => {
                let (owner, t) = self.owner(uid, c)?;
                Ok(file(0o600, owner, self.kv_len(c)? as usize, t))
            }
            Node::Data(c) => {
                let (owner, t) = self.owner(uid, c)?;
                Ok(file(0o400, owner, self.kv_len(c)? as usize, t))
            }
            Node::Chunk(c, i) => {
                let (owner, t) = self.owner(uid, c)?;
                let size = match self.pending_write_len(c, i) {
                    Some(len) => len,
                    None => match self.store.chunk_state(c, i).map_err(store_err)? {
                        StoreState::Stored(s) => s.raw_len as usize,
                        _ => return Err(Errno::ENOENT),
                    },
                };
                Ok(file(0o600, owner, size, t))
            }
        }
    }

    pub(super) fn lookup_node(&self, parent: Node, name: &OsStr) -> Result<Node, Errno> {
        let name = name.to_str().ok_or(Errno::ENOENT)?;
        let node = match parent {
            Node::Root if name == "stats" => Node::Stats,
            Node::Root => Node::Dir(ContextId(name.parse().map_err(|_| Errno::ENOENT)?)),
            Node::Dir(c) => match name {
                "chunks" => Node::Chunks(c),
                "info" => Node::Info(c),
                "text" => Node::Text(c),
                "tokens" => Node::Tokens(c),
                "kv" => Node::Kv(c),
                "data" => Node::Data(c),
                _ => return Err(Errno::ENOENT),
            },
            Node::Chunks(c) => Node::Chunk(c, parse_index(name)?),
            _ => return Err(Errno::ENOTDIR),
        };
        if node.context().is_some_and(|c| c.0 == 0 || c.0 >= 1 << 32) {
            return Err(Errno::ENOENT);
        }
        Ok(node)
    }

    pub(super) fn entries(
        &self,
        uid: u32,
        node: Node,
    ) -> Result<Vec<(INodeNo, FileType, String)>, Errno> {
        let mut out = vec![
            (node.ino(), FileType::Directory, ".".to_owned()),
            (INodeNo(ROOT), FileType::Directory, "..".to_owned()),
        ];
        match node {
            Node::Root => {
                out.push((INodeNo(STATS), FileType::RegularFile, "stats".to_owned()));
                for c in self.store.list_contexts() {
                    if c.0 < 1 << 32 && self.owner(uid, c).is_ok() {
                        out.push((Node::Dir(c).ino(), FileType::Directory, c.to_string()));
                    }
                }
            }
            Node::Dir(c) => {
                self.owner(uid, c)?;
                out.push((
                    Node::Chunks(c).ino(),
                    FileType::Directory,
                    "chunks".to_owned(),
                ));
                out.push((
                    Node::Info(c).ino(),
                    FileType::RegularFile,
                    "info".to_owned(),
                ));
                out.push((
                    Node::Text(c).ino(),
                    FileType::RegularFile,
                    "text".to_owned(),
                ));
                out.push((
                    Node::Tokens(c).ino(),
                    FileType::RegularFile,
                    "tokens".to_owned(),
                ));
                out.push((Node::Kv(c).ino(), FileType::RegularFile, "kv".to_owned()));
                out.push((
                    Node::Data(c).ino(),
                    FileType::RegularFile,
                    "data".to_owned(),
                ));
            }
            Node::Chunks(c) => {
                self.owner(uid, c)?;
                out[1].0 = Node::Dir(c).ino();
                let info = self.store.context(c).map_err(store_err)?;
                for m in info.chunks {
                    if matches!(m.state, StoreState::Stored(_)) && m.index <= MAX_INDEX {
                        out.push((
                            Node::Chunk(c, m.index).ino(),
                            FileType::RegularFile,
                            m.index.to_string(),
                        ));
                    }
                }
            }
            _ => return Err(Errno::ENOTDIR),
        }
        Ok(out)
    }
}

pub(super) fn parse_index(name: &str) -> Result<u32, Errno> {
    // Only the canonical decimal spelling, so each chunk has exactly one name.
    let i: u32 = name.parse().map_err(|_| Errno::ENOENT)?;
    if i.to_string() != name || i > MAX_INDEX {
        return Err(Errno::ENOENT);
    }
    Ok(i)
}

pub(super) fn attr(
    node: Node,
    kind: FileType,
    perm: u16,
    uid: u32,
    size: u64,
    time: SystemTime,
) -> FileAttr {
    FileAttr {
        ino: node.ino(),
        size,
        blocks: size.div_ceil(512),
        atime: time,
        mtime: time,
        ctime: time,
        crtime: time,
        kind,
        perm,
        nlink: if kind == FileType::Directory { 2 } else { 1 },
        uid,
        gid: if uid == 0 { 0 } else { uid },
        rdev: 0,
        flags: 0,
        blksize: 4096,
    }
}

pub(super) fn node_or_enoent(ino: INodeNo) -> Result<Node, Errno> {
    Node::of(ino).ok_or(Errno::ENOENT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inode_numbers_round_trip() {
        let c = ContextId(7);
        for n in [
            Node::Root,
            Node::Stats,
            Node::Dir(c),
            Node::Chunks(c),
            Node::Info(c),
            Node::Text(c),
            Node::Tokens(c),
            Node::Kv(c),
            Node::Data(c),
            Node::Chunk(c, 0),
            Node::Chunk(ContextId(u32::MAX as u64), MAX_INDEX),
        ] {
            assert_eq!(Node::of(n.ino()), Some(n));
        }
        assert_eq!(Node::of(INodeNo(3)), None);
        assert_eq!(Node::of(INodeNo((5 << 32) | 9)), None);
    }

    #[test]
    fn chunk_names_are_canonical() {
        assert_eq!(parse_index("12"), Ok(12));
        for bad in ["012", "+1", "x", "", "-1", "99999999999"] {
            assert_eq!(parse_index(bad), Err(Errno::ENOENT), "{bad}");
        }
    }
}
