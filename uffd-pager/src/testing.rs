//! Chunk sources for tests and benchmarks: a deterministic pattern, a deliberately faulty one, and
//! one that holds its fills until the test releases them.
//!
//! `FaultySource` plays the part firecracker's `malicious_handler.rs` plays for its page-fault
//! handler: it fails on purpose (missing, corrupt, I/O error, timeout, panic, slowness) so the
//! tests can show the pager neither hangs nor hands out wrong bytes. `GatedSource` lets a test
//! keep the fault thread inside a fill for exactly as long as it needs, with no timing involved.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use crate::{ChunkKey, ChunkSource, SourceError};

/// The deterministic byte at `offset` of chunk `key`: what `PatternSource` serves.
pub fn pattern_byte(key: ChunkKey, offset: usize) -> u8 {
    let h = key
        .ctx
        .0
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(u64::from(key.index).wrapping_mul(0xC2B2_AE3D_27D4_EB4F))
        .wrapping_add(offset as u64 / 8);
    (h ^ (h >> 29) ^ (offset as u64)) as u8
}

/// Fill `dst` with `key`'s pattern.
pub fn fill_pattern(key: ChunkKey, dst: &mut [u8]) {
    for (i, b) in dst.iter_mut().enumerate() {
        *b = pattern_byte(key, i);
    }
}

/// Serves every chunk's deterministic pattern, and counts the reads.
#[derive(Debug, Default)]
pub struct PatternSource {
    reads: AtomicU64,
}

impl PatternSource {
    /// A new source.
    pub fn new() -> PatternSource {
        PatternSource::default()
    }

    /// How many chunks were read.
    pub fn reads(&self) -> u64 {
        self.reads.load(Relaxed)
    }
}

impl ChunkSource for PatternSource {
    fn fill(&self, key: ChunkKey, dst: &mut [u8]) -> Result<(), SourceError> {
        self.reads.fetch_add(1, Relaxed);
        fill_pattern(key, dst);
        Ok(())
    }
}

/// How `FaultySource` misbehaves on one chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Misbehavior {
    /// Report the chunk missing.
    Missing,
    /// Report the chunk corrupt.
    Corrupt,
    /// Scribble garbage into the buffer, then report an I/O error.
    IoErrorAfterGarbage,
    /// Sleep, then report a timeout.
    Timeout(Duration),
    /// Panic.
    Panic,
    /// Sleep, then serve the right bytes.
    Slow(Duration),
}

/// A deliberately faulty source: serves the pattern except on the chunks it is told to break.
#[derive(Debug, Default)]
pub struct FaultySource {
    plan: Mutex<HashMap<ChunkKey, Misbehavior>>,
    reads: AtomicU64,
}

impl FaultySource {
    /// A source that misbehaves on no chunk yet.
    pub fn new() -> FaultySource {
        FaultySource::default()
    }

    /// Misbehave on `key` from now on.
    pub fn break_chunk(&self, key: ChunkKey, how: Misbehavior) {
        self.plan.lock().insert(key, how);
    }

    /// Serve `key` correctly again.
    pub fn heal(&self, key: ChunkKey) {
        self.plan.lock().remove(&key);
    }

    /// How many fills were asked for.
    pub fn reads(&self) -> u64 {
        self.reads.load(Relaxed)
    }
}

impl ChunkSource for FaultySource {
    fn fill(&self, key: ChunkKey, dst: &mut [u8]) -> Result<(), SourceError> {
        self.reads.fetch_add(1, Relaxed);
        let how = self.plan.lock().get(&key).cloned();
        match how {
            None => {
                fill_pattern(key, dst);
                Ok(())
            }
            Some(Misbehavior::Missing) => Err(SourceError::Missing { key }),
            Some(Misbehavior::Corrupt) => {
                dst.fill(0xA5);
                Err(SourceError::Corrupt {
                    key,
                    detail: "checksum mismatch".into(),
                })
            }
            Some(Misbehavior::IoErrorAfterGarbage) => {
                dst.fill(0x5A);
                Err(SourceError::Io {
                    key,
                    detail: "EIO".into(),
                })
            }
            Some(Misbehavior::Timeout(d)) => {
                std::thread::sleep(d);
                Err(SourceError::Timeout {
                    key,
                    millis: d.as_millis() as u64,
                })
            }
            Some(Misbehavior::Panic) => panic!("FaultySource told to panic on {key}"),
            Some(Misbehavior::Slow(d)) => {
                std::thread::sleep(d);
                fill_pattern(key, dst);
                Ok(())
            }
        }
    }
}

/// Serves the pattern, but while it is held every fill waits at its gate until `release`: a test
/// keeps the fault thread inside a fill, and every thread that faults meanwhile blocked, for as
/// long as it needs, and knows when a fill has reached the gate.
///
/// Built with [`GatedSource::writing_back`] it also takes victims' write-backs (and serves the
/// pattern for them afterwards, which is what the tests populate), with a gate of their own:
/// while writes are held every write-back waits until `release_writes`, and the source records
/// which thread called it.
#[derive(Debug, Default)]
pub struct GatedSource {
    gate: Mutex<Gate>,
    changed: Condvar,
    keeps: bool,
}

#[derive(Debug, Default)]
struct Gate {
    held: bool,
    /// The chunks whose fills wait at the gate.
    waiting: Vec<ChunkKey>,
    reads: u64,
    writes_held: bool,
    /// The chunks whose write-backs wait at the gate.
    writing: Vec<ChunkKey>,
    /// The names of the threads that called `write_back`, in order.
    writers: Vec<String>,
}

impl GatedSource {
    /// A source that serves at once until [`GatedSource::hold`]; it keeps no victims.
    pub fn new() -> GatedSource {
        GatedSource::default()
    }

    /// A source that also takes victims' write-backs ([`ChunkSource::writes_back`]).
    pub fn writing_back() -> GatedSource {
        GatedSource {
            keeps: true,
            ..GatedSource::default()
        }
    }

    /// Make every later fill wait at the gate.
    pub fn hold(&self) {
        self.gate.lock().held = true;
    }

    /// Let every waiting and later fill through.
    pub fn release(&self) {
        self.gate.lock().held = false;
        self.changed.notify_all();
    }

    /// Wait until a fill waits at the gate, and return its chunk.
    pub fn wait_for_held_fill(&self) -> ChunkKey {
        let mut g = self.gate.lock();
        loop {
            if let Some(k) = g.waiting.first() {
                return *k;
            }
            self.changed.wait(&mut g);
        }
    }

    /// How many fills were asked for.
    pub fn reads(&self) -> u64 {
        self.gate.lock().reads
    }

    /// Make every later write-back wait at the gate.
    pub fn hold_writes(&self) {
        self.gate.lock().writes_held = true;
    }

    /// Let every waiting and later write-back through.
    pub fn release_writes(&self) {
        self.gate.lock().writes_held = false;
        self.changed.notify_all();
    }

    /// Wait until a write-back waits at the gate, and return its chunk.
    pub fn wait_for_held_write(&self) -> ChunkKey {
        let mut g = self.gate.lock();
        loop {
            if let Some(k) = g.writing.first() {
                return *k;
            }
            self.changed.wait(&mut g);
        }
    }

    /// The names of the threads that called `write_back`, in order.
    pub fn writers(&self) -> Vec<String> {
        self.gate.lock().writers.clone()
    }
}

impl ChunkSource for GatedSource {
    fn fill(&self, key: ChunkKey, dst: &mut [u8]) -> Result<(), SourceError> {
        let mut g = self.gate.lock();
        g.reads += 1;
        if g.held {
            g.waiting.push(key);
            self.changed.notify_all();
            while g.held {
                self.changed.wait(&mut g);
            }
            g.waiting.retain(|k| *k != key);
        }
        drop(g);
        fill_pattern(key, dst);
        Ok(())
    }

    fn write_back(&self, key: ChunkKey, _data: &[u8]) -> Result<bool, SourceError> {
        let mut g = self.gate.lock();
        let name = std::thread::current()
            .name()
            .unwrap_or("unnamed")
            .to_owned();
        g.writers.push(name);
        if g.writes_held {
            g.writing.push(key);
            self.changed.notify_all();
            while g.writes_held {
                self.changed.wait(&mut g);
            }
            g.writing.retain(|k| *k != key);
        }
        Ok(self.keeps)
    }

    fn writes_back(&self) -> bool {
        self.keeps
    }
}
