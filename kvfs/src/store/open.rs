//! Opening a store: creating it, upgrading a format-1 store, and recovering from any crash point
//! (unfinished writes removed, the newest complete copy of each chunk kept, what fails a check
//! quarantined).

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::{Mutex, RwLock};

use super::contexts::{create_data, open_data};
use super::{
    ContextId, Counters, Ctx, CtxState, HEADER_PAGE, MARKER, MARKER_TEXT, MARKER_TEXT_V1,
    MAX_CHUNK_BYTES, Recovered, SLOT_BYTES, Store, StoreError, StoreOptions, StoreState,
    check_identity, covers, io, mkdir, now_nanos, slot_offset, stored_of,
};
use crate::format::{ChunkHeader, ContextMeta, HEADER_LEN, Link, decode_tokens};
use crate::io::{
    AlignedBuf, IoError, punch, read_file, read_slot, supports_direct, sync_dir, write_atomic,
};

impl Store {
    /// Whether `root` holds a kvfs store (its marker file), without opening or changing it.
    pub fn exists(root: &Path) -> bool {
        root.join(MARKER).is_file()
    }

    /// Opens the store at `root`, creating it if `root` is missing or empty, and recovers from any
    /// crash: leftovers of unfinished writes are removed, files that fail their checks are moved to
    /// `quarantine/` (see [`Store::recovered`]) and their chunks marked for recompute.
    pub fn open(root: &Path, options: StoreOptions) -> Result<Store, StoreError> {
        let marker = root.join(MARKER);
        if options.read_only && !marker.exists() {
            return Err(StoreError::NotAStore {
                path: root.to_owned(),
            });
        }
        if !marker.exists() {
            // Empty, or only what an interrupted creation leaves: the empty skeleton folders
            // and the marker's temp file (creation writes the marker last).
            let empty = match std::fs::read_dir(root) {
                Ok(d) => {
                    let mut only_skeleton = true;
                    for e in d {
                        let e = e.map_err(io("list", root))?;
                        let name = e.file_name();
                        let name = name.to_string_lossy();
                        let skeleton = ["contexts", "staging", "trash", "quarantine"]
                            .contains(&name.as_ref())
                            && std::fs::read_dir(e.path())
                                .map(|mut d| d.next().is_none())
                                .unwrap_or(false);
                        if !(skeleton || name.starts_with(".tmp-KVFS")) {
                            only_skeleton = false;
                            break;
                        }
                        if !skeleton {
                            std::fs::remove_file(e.path()).map_err(io("remove", &e.path()))?;
                        }
                    }
                    only_skeleton
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    std::fs::create_dir_all(root).map_err(io("mkdir", root))?;
                    true
                }
                Err(e) => return Err(IoError::new("list", root, e).into()),
            };
            if !empty {
                return Err(StoreError::NotAStore {
                    path: root.to_owned(),
                });
            }
            for sub in ["contexts", "staging", "trash", "quarantine"] {
                mkdir(&root.join(sub))?;
            }
            write_atomic(root, MARKER, ".tmp-KVFS", &[MARKER_TEXT])?;
        }
        for sub in ["contexts", "staging", "trash", "quarantine"] {
            if !options.read_only {
                mkdir(&root.join(sub))?;
            }
        }
        let lock = if options.read_only {
            None
        } else {
            let f = std::fs::File::open(&marker).map_err(io("open", &marker))?;
            match nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock) {
                Ok(l) => Some(l),
                Err((_, nix::errno::Errno::EWOULDBLOCK)) => {
                    return Err(StoreError::Locked {
                        path: root.to_owned(),
                    });
                }
                Err((_, e)) => return Err(IoError::new("flock", &marker, e.into()).into()),
            }
        };
        let mut store = Store {
            _lock: lock,
            root: root.to_owned(),
            direct: supports_direct(&marker),
            options,
            contexts: RwLock::new(BTreeMap::new()),
            next_id: AtomicU64::new(1),
            next_generation: AtomicU64::new(1),
            decoder: RwLock::new(None),
            residency: RwLock::new(None),
            recovered: Vec::new(),
            quarantined: AtomicU64::new(0),
            counters: Counters::default(),
        };
        let text = read_file(&marker, false, None)?;
        if text == MARKER_TEXT_V1 {
            store.upgrade_v1()?;
        } else if text != MARKER_TEXT {
            return Err(StoreError::Invalid {
                what: "store marker",
                why: format!(
                    "{} says {:?}, not {:?}; made by another kvfs version",
                    marker.display(),
                    String::from_utf8_lossy(&text).trim(),
                    String::from_utf8_lossy(MARKER_TEXT).trim()
                ),
            });
        }
        store.recover()?;
        Ok(store)
    }

    /// Upgrades a format-1 store (one file per chunk) in place: every context keeps its metadata
    /// and tokens, its chunk files are removed (chunks are recomputed from the tokens, as after
    /// any loss) and it gets an empty data file; the marker is rewritten last, so an upgrade cut
    /// short runs again at the next open.
    fn upgrade_v1(&mut self) -> Result<(), StoreError> {
        if self.options.read_only {
            return Err(StoreError::Invalid {
                what: "store",
                why: format!(
                    "{} is a format-1 store; open it for writing once to upgrade it",
                    self.root.display()
                ),
            });
        }
        let contexts = self.root.join("contexts");
        for entry in std::fs::read_dir(&contexts).map_err(io("list", &contexts))? {
            let dir = entry.map_err(io("list", &contexts))?.path();
            let chunks = dir.join("chunks");
            if chunks.is_dir() {
                std::fs::remove_dir_all(&chunks).map_err(io("remove", &chunks))?;
                self.note(&chunks, "removed", "format-1 chunk files (upgrade)".into());
            }
            if dir.is_dir() && !dir.join("data").exists() {
                create_data(&dir)?;
            }
        }
        write_atomic(&self.root, MARKER, ".tmp-KVFS", &[MARKER_TEXT])?;
        Ok(())
    }

    fn recover(&mut self) -> Result<(), StoreError> {
        for sub in ["staging", "trash"] {
            if self.options.read_only {
                break;
            }
            let dir = self.root.join(sub);
            for entry in std::fs::read_dir(&dir).map_err(io("list", &dir))? {
                let path = entry.map_err(io("list", &dir))?.path();
                let res = if path.is_dir() {
                    std::fs::remove_dir_all(&path)
                } else {
                    std::fs::remove_file(&path)
                };
                res.map_err(io("remove", &path))?;
                self.note(&path, "removed", format!("unfinished {sub} entry"));
            }
        }
        let mut max_id = 0;
        let mut max_gen = 0;
        let contexts_dir = self.root.join("contexts");
        let mut names: Vec<_> = std::fs::read_dir(&contexts_dir)
            .map_err(io("list", &contexts_dir))?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<Result<_, _>>()
            .map_err(io("list", &contexts_dir))?;
        names.sort();
        let mut loaded = BTreeMap::new();
        for name in names {
            let path = contexts_dir.join(&name);
            let Some(id) = name.to_str().and_then(|s| s.parse::<u64>().ok()) else {
                self.quarantine(&path, "not a context id".into())?;
                continue;
            };
            max_id = max_id.max(id);
            match self.load_context(ContextId(id), &path, &mut max_gen) {
                Ok(ctx) => {
                    loaded.insert(ctx.id, Arc::new(ctx));
                }
                Err(reason) => self.quarantine(&path, reason)?,
            }
        }
        if !self.options.read_only {
            sync_dir(&contexts_dir)?;
        }
        *self.contexts.get_mut() = loaded;
        self.next_id = AtomicU64::new(max_id + 1);
        self.next_generation = AtomicU64::new(max_gen + 1);
        self.recover_links()?;
        for r in &self.recovered {
            tracing::warn!(path = %r.path.display(), action = r.action, reason = %r.reason, "kvfs recovery");
        }
        Ok(())
    }

    /// Loads one context directory; an `Err` is the reason to quarantine it whole.
    fn load_context(
        &mut self,
        id: ContextId,
        dir: &Path,
        max_gen: &mut u64,
    ) -> Result<Ctx, String> {
        let meta_bytes = read_file(&dir.join("meta"), false, None).map_err(|e| e.to_string())?;
        let meta = ContextMeta::decode(&meta_bytes).map_err(|e| e.to_string())?;
        let token_bytes = read_file(&dir.join("tokens"), false, None).map_err(|e| e.to_string())?;
        let tokens = decode_tokens(&token_bytes).map_err(|e| e.to_string())?;
        if meta.chunk_tokens == 0 {
            return Err("chunk size of 0 tokens".into());
        }
        let data_path = dir.join("data");
        if !self.options.read_only && !data_path.exists() {
            // A context of a format-1 store: its chunk files were removed by the upgrade.
            create_data(dir).map_err(|e| e.to_string())?;
        }
        let (data, direct) = open_data(&data_path, self.options.read_only, self.direct)
            .map_err(|e| e.to_string())?;
        let mut chunks = BTreeMap::new();
        let mut touched = false;
        // The copies found, per chunk: (copy, header) for every slot whose header passed.
        let mut found: BTreeMap<u32, Vec<(u8, ChunkHeader)>> = BTreeMap::new();
        let mut scratch = AlignedBuf::default();
        for slot in occupied_slots(&data).map_err(|e| format!("scan data: {e}"))? {
            let (index, copy) = ((slot / 2) as u32, (slot % 2) as u8);
            let at = slot * SLOT_BYTES;
            let what = format!("{} chunk {index} slot {copy}", data_path.display());
            let file = direct.as_ref().unwrap_or(&data);
            let mut r = read_slot(file, direct.is_some(), at, HEADER_PAGE, &mut scratch)
                .map_err(|e| format!("read {what}: {e}"))?;
            if self.options.verify_on_open
                && let Ok(h) = ChunkHeader::decode(&scratch[r.clone()])
                && (h.stored_len as usize) <= MAX_CHUNK_BYTES
            {
                let len = HEADER_PAGE + h.stored_len as usize;
                r = read_slot(file, direct.is_some(), at, len, &mut scratch)
                    .map_err(|e| format!("read {what}: {e}"))?;
            }
            let bytes = &scratch[r];
            let head = &bytes[..bytes.len().min(HEADER_LEN)];
            if head.iter().all(|&b| b == 0) {
                // A payload without its header: a first write cut short.
                self.free_slot(&data, &data_path, index, copy, "unfinished write")?;
                touched = true;
                continue;
            }
            let checked = self.check_found_slot(head, bytes, id, index, &meta);
            match checked {
                Ok(h) => found.entry(index).or_default().push((copy, h)),
                Err(reason) => {
                    self.quarantine_slot(
                        &data,
                        &data_path,
                        id,
                        index,
                        copy,
                        bytes,
                        reason.clone(),
                    )?;
                    chunks.insert(index, StoreState::Quarantined { reason });
                    touched = true;
                }
            }
        }
        touched |= self.keep_newest(&data, &data_path, &tokens, found, &mut chunks, max_gen)?;
        if touched && !self.options.read_only {
            nix::unistd::fdatasync(&data).map_err(|e| format!("fdatasync data: {e}"))?;
        }
        let link = self.read_link(dir);
        Ok(Ctx {
            id,
            meta,
            dir: dir.to_owned(),
            data,
            direct,
            shared: dir.join("shared").exists(),
            write: Mutex::new(()),
            state: Mutex::new(CtxState {
                tokens,
                chunks,
                link,
            }),
            deleted: AtomicBool::new(false),
        })
    }

    /// A context directory's `link` file, if it has one that reads and checks (one that does not
    /// is noted and ignored: [`Store::recover_links`] removes it, and the borrowed chunks are
    /// recomputed).
    fn read_link(&mut self, dir: &Path) -> Option<Link> {
        let path = dir.join("link");
        if !path.exists() {
            return None;
        }
        match read_file(&path, false, None)
            .map_err(|e| e.to_string())
            .and_then(|b| Link::decode(&b).map_err(|e| e.to_string()))
        {
            Ok(l) => Some(l),
            Err(why) => {
                self.note(&path, "ignored", why);
                if !self.options.read_only {
                    let _ = std::fs::remove_file(&path);
                }
                None
            }
        }
    }

    /// A slot's header (and, with `verify_on_open`, its payload in `bytes`) checked against the
    /// context it is in; an `Err` is the reason to quarantine it.
    fn check_found_slot(
        &self,
        head: &[u8],
        bytes: &[u8],
        id: ContextId,
        index: u32,
        meta: &ContextMeta,
    ) -> Result<ChunkHeader, String> {
        let h = ChunkHeader::decode(head).map_err(|e| e.to_string())?;
        check_identity(&h, id, index, meta)?;
        if h.stored_len as usize > MAX_CHUNK_BYTES {
            return Err(format!("header says {} stored bytes", h.stored_len));
        }
        if self.options.verify_on_open {
            let payload = bytes
                .get(HEADER_PAGE..HEADER_PAGE + h.stored_len as usize)
                .ok_or("payload cut short")?;
            h.check_payload(payload).map_err(|e| e.to_string())?;
        }
        Ok(h)
    }

    /// Keeps each chunk's newest copy that still covers its tokens, freeing the others (an older
    /// copy is what a crash between a rewrite and the freeing of the slot it replaced leaves
    /// behind); returns whether it freed any.
    fn keep_newest(
        &mut self,
        data: &File,
        data_path: &Path,
        tokens: &[u32],
        found: BTreeMap<u32, Vec<(u8, ChunkHeader)>>,
        chunks: &mut BTreeMap<u32, StoreState>,
        max_gen: &mut u64,
    ) -> Result<bool, String> {
        let mut touched = false;
        for (index, mut copies) in found {
            copies.sort_by_key(|(_, h)| std::cmp::Reverse(h.generation));
            for (copy, _) in copies.iter().skip(1) {
                self.free_slot(data, data_path, index, *copy, "older copy")?;
                touched = true;
            }
            let (copy, h) = &copies[0];
            if !covers(tokens, &(h.token_start..h.token_end), h.tokens_crc) {
                self.free_slot(
                    data,
                    data_path,
                    index,
                    *copy,
                    "stale: its tokens were replaced",
                )?;
                touched = true;
                continue;
            }
            *max_gen = (*max_gen).max(h.generation);
            chunks.insert(index, StoreState::Stored(stored_of(h, *copy)));
        }
        Ok(touched)
    }

    /// Frees a slot at open (a leftover of an interrupted write, or a stale chunk) and notes why.
    fn free_slot(
        &mut self,
        data: &File,
        path: &Path,
        index: u32,
        copy: u8,
        reason: &str,
    ) -> Result<(), String> {
        if self.options.read_only {
            return Ok(());
        }
        punch(data, slot_offset(index, copy), SLOT_BYTES)
            .map_err(|e| format!("free chunk {index} slot {copy}: {e}"))?;
        self.note(
            &path.join(format!("{index}.{copy}")),
            "removed",
            reason.to_owned(),
        );
        Ok(())
    }

    /// Moves a slot that failed its checks at open into `quarantine/` and notes why.
    #[allow(clippy::too_many_arguments)]
    fn quarantine_slot(
        &mut self,
        data: &File,
        path: &Path,
        id: ContextId,
        index: u32,
        copy: u8,
        bytes: &[u8],
        reason: String,
    ) -> Result<(), String> {
        let shown = path.join(format!("{index}.{copy}"));
        if self.options.read_only {
            self.quarantined.fetch_add(1, Ordering::Relaxed);
            self.note(&shown, "not served (read-only: left in place)", reason);
            return Ok(());
        }
        self.keep_aside(data, id, index, copy, bytes)
            .map_err(|e| e.to_string())?;
        self.quarantined.fetch_add(1, Ordering::Relaxed);
        self.note(&shown, "quarantined", reason);
        Ok(())
    }

    pub(super) fn note(&mut self, path: &Path, action: &'static str, reason: String) {
        self.recovered.push(Recovered {
            path: path.to_owned(),
            action,
            reason,
        });
    }

    /// Moves `path` into `quarantine/` so it is never served again, and records why.
    fn quarantine(&mut self, path: &Path, reason: String) -> Result<(), StoreError> {
        if self.options.read_only {
            self.quarantined.fetch_add(1, Ordering::Relaxed);
            self.note(path, "not served (read-only: left in place)", reason);
            return Ok(());
        }
        let dest = self.quarantine_path(path);
        std::fs::rename(path, &dest).map_err(io("quarantine", path))?;
        self.quarantined.fetch_add(1, Ordering::Relaxed);
        self.note(path, "quarantined", reason);
        Ok(())
    }

    fn quarantine_path(&self, path: &Path) -> PathBuf {
        let rel = path
            .strip_prefix(self.root.join("contexts"))
            .unwrap_or(path);
        let flat = rel.to_string_lossy().replace('/', "-");
        self.root
            .join("quarantine")
            .join(format!("{flat}.{}", now_nanos()))
    }
}

/// The slots of a data file that hold any data (`slot` = 2 × index + copy), found with
/// `SEEK_DATA`/`SEEK_HOLE` so that the holes of a sparse file cost nothing.
fn occupied_slots(data: &File) -> std::io::Result<Vec<u64>> {
    use nix::unistd::{Whence, lseek};
    let len = data.metadata()?.len();
    let mut slots = Vec::new();
    let mut at = 0u64;
    while at < len {
        let start = match lseek(data, at as libc::off_t, Whence::SeekData) {
            Ok(o) => o as u64,
            Err(nix::errno::Errno::ENXIO) => break,
            Err(e) => return Err(e.into()),
        };
        let end = lseek(data, start as libc::off_t, Whence::SeekHole)? as u64;
        let (first, last) = (start / SLOT_BYTES, (end - 1) / SLOT_BYTES);
        for slot in first..=last {
            if slots.last() != Some(&slot) {
                slots.push(slot);
            }
        }
        at = end;
    }
    Ok(slots)
}
