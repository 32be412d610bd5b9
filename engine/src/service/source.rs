//! Where a swapped-out chunk comes from: the kvfs store, for the pager's fault path and for Load;
//! and the one place the engine's, kvfs's and the policy's names for a chunk's format meet.

use std::collections::HashMap;
use std::io::Read;
use std::path::Path;
use std::sync::{Arc, Mutex};

use kvfs::{Fingerprint, StoreError};
use policy::{Level, LevelSet};
use sha2::Digest;
use uffd_pager::{ChunkKey, ChunkSource, SourceError};

use crate::kv::{ChunkShape, KvFormat};
use crate::service::chunk_io::ChunkIo;

/// The engine's format as kvfs records it.
pub fn to_store(f: KvFormat) -> kvfs::KvFormat {
    match f {
        KvFormat::F16 => kvfs::KvFormat::F16,
        KvFormat::Int8 => kvfs::KvFormat::Int8,
        KvFormat::Int4 => kvfs::KvFormat::Int4,
        KvFormat::Int2 => kvfs::KvFormat::Int2,
    }
}

/// A format kvfs recorded, as the engine knows it.
pub fn from_store(f: kvfs::KvFormat) -> KvFormat {
    match f {
        kvfs::KvFormat::F16 => KvFormat::F16,
        kvfs::KvFormat::Int8 => KvFormat::Int8,
        kvfs::KvFormat::Int4 => KvFormat::Int4,
        kvfs::KvFormat::Int2 => KvFormat::Int2,
    }
}

/// The format of a policy level (its bits), if the engine has one.
pub fn format_of(set: &LevelSet, level: Level) -> Option<KvFormat> {
    let bits = set.bits(level)?;
    KvFormat::ALL
        .into_iter()
        .find(|f| f.bits() == u32::from(bits))
}

/// The policy level of a format, if the set has one with its bits.
pub fn level_of(set: &LevelSet, f: KvFormat) -> Option<Level> {
    set.levels()
        .find(|&l| set.bits(l) == u8::try_from(f.bits()).ok())
}

/// The model's fingerprint as kvfs checks it: sha256 of the GGUF file, read in 1 MiB pieces.
pub fn model_fingerprint(path: &Path) -> std::io::Result<Fingerprint> {
    let mut f = std::fs::File::open(path)?;
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(Fingerprint(h.finalize().into()))
}

/// The format each chunk of each context is expected in (what the engine's cache records), so a
/// stored copy in another format is never handed to the engine as if it were the right one; with
/// each chunk's density (for the header of a chunk written back on reclaim), and the chunks so
/// written since the manager last asked.
#[derive(Debug, Default)]
pub struct Expected {
    map: Mutex<HashMap<u64, CtxExpected>>,
}

#[derive(Debug, Default)]
struct CtxExpected {
    formats: Vec<KvFormat>,
    densities: Vec<f32>,
    written: Vec<u32>,
}

impl Expected {
    /// Records `ctx`'s chunk formats and densities.
    pub fn set(&self, ctx: u64, formats: &[KvFormat], densities: &[f64]) {
        let mut m = self.lock();
        let e = m.entry(ctx).or_default();
        e.formats = formats.to_vec();
        e.densities = densities.iter().map(|&d| d as f32).collect();
    }

    /// Forgets `ctx`.
    pub fn remove(&self, ctx: u64) {
        self.lock().remove(&ctx);
    }

    /// The format chunk `key` is expected in.
    pub fn get(&self, key: ChunkKey) -> Option<KvFormat> {
        self.lock()
            .get(&key.ctx.0)
            .and_then(|e| e.formats.get(key.index as usize).copied())
    }

    /// The chunks of `ctx` written back on reclaim since the last call of this.
    pub fn take_written(&self, ctx: u64) -> Vec<u32> {
        self.lock()
            .get_mut(&ctx)
            .map(|e| std::mem::take(&mut e.written))
            .unwrap_or_default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, CtxExpected>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Reads chunks from kvfs (through the mount when there is one): the pager's source for faults.
/// A chunk is read straight into the pager's buffer, with no allocation. Unless built not to,
/// it also writes a victim that was never written out before the pager reclaims it.
pub struct StoreSource {
    io: Arc<ChunkIo>,
    expected: Arc<Expected>,
    shape: ChunkShape,
    write_back: bool,
}

impl StoreSource {
    /// A source over `io`; `write_back` lets it write victims out on reclaim.
    pub fn new(
        io: Arc<ChunkIo>,
        expected: Arc<Expected>,
        shape: ChunkShape,
        write_back: bool,
    ) -> Self {
        Self {
            io,
            expected,
            shape,
            write_back,
        }
    }
}

/// A store error, classified for the pager.
pub fn classify(key: ChunkKey, e: &StoreError) -> SourceError {
    match e {
        StoreError::ChunkMissing { .. } | StoreError::NoSuchContext { .. } => {
            SourceError::Missing { key }
        }
        e if e.needs_recompute() => SourceError::Corrupt {
            key,
            detail: e.to_string(),
        },
        e => SourceError::Io {
            key,
            detail: e.to_string(),
        },
    }
}

impl ChunkSource for StoreSource {
    fn fill(&self, key: ChunkKey, dst: &mut [u8]) -> Result<(), SourceError> {
        let id = kvfs::ContextId(key.ctx.0);
        let want = self.expected.get(key).ok_or(SourceError::Missing { key })?;
        match self.io.store().chunk_state(id, key.index) {
            Ok(kvfs::ChunkState::Stored(s)) if from_store(s.format) == want => {}
            Ok(kvfs::ChunkState::Stored(s)) => {
                return Err(SourceError::Corrupt {
                    key,
                    detail: format!("stored as {}, expected {}", s.format, want.name()),
                });
            }
            Ok(_) => return Err(SourceError::Missing { key }),
            Err(e) => return Err(classify(key, &e)),
        }
        let meta = match self.io.read_into(key.ctx.0, key.index, dst) {
            Ok(meta) => meta,
            Err(StoreError::BufferTooSmall { need, have, .. }) => {
                return Err(SourceError::Corrupt {
                    key,
                    detail: format!("{need} bytes for a {have}-byte slot"),
                });
            }
            Err(e) => return Err(classify(key, &e)),
        };
        dst[meta.raw_len as usize..].fill(0);
        Ok(())
    }

    fn write_back(&self, key: ChunkKey, data: &[u8]) -> Result<bool, SourceError> {
        if !self.write_back {
            return Ok(false);
        }
        let (format, density) = {
            let m = self.expected.lock();
            let Some(e) = m.get(&key.ctx.0) else {
                return Ok(false);
            };
            let Some(&f) = e.formats.get(key.index as usize) else {
                return Ok(false);
            };
            (
                f,
                e.densities.get(key.index as usize).copied().unwrap_or(0.0),
            )
        };
        let len = self.shape.chunk_bytes(format);
        let Some(bytes) = data.get(..len) else {
            return Err(SourceError::Corrupt {
                key,
                detail: format!(
                    "a {}-byte slot for a {len}-byte {} chunk",
                    data.len(),
                    format.name()
                ),
            });
        };
        self.io
            .write(key.ctx.0, key.index, to_store(format), density, bytes)
            .map_err(|e| classify(key, &e))?;
        if let Some(e) = self.expected.lock().get_mut(&key.ctx.0) {
            e.written.push(key.index);
        }
        Ok(true)
    }
}
