//! The victim-chooser contract: which resident chunks to give up when memory is needed.

use crate::level::Level;

/// One chunk of one context: the unit every chooser tracks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkId {
    pub context: u64,
    pub index: u32,
}

impl ChunkId {
    pub fn new(context: u64, index: u32) -> Self {
        Self { context, index }
    }
}

/// A chunk given up, with the bytes its eviction frees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Victim {
    pub id: ChunkId,
    pub bytes: u64,
}

/// What [`VictimChooser::pop_victims`] gave up, in eviction order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Victims {
    pub chunks: Vec<Victim>,
    /// The bytes the victims free; less than asked when too little was evictable.
    pub freed: u64,
}

/// Why a chooser refused an update.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VictimError {
    #[error("chunk {index} of context {context} is already tracked", index = id.index, context = id.context)]
    AlreadyTracked { id: ChunkId },
    #[error("chunk {index} of context {context} is not tracked", index = id.index, context = id.context)]
    NotTracked { id: ChunkId },
    #[error("context {context} is not locked")]
    NotLocked { context: u64 },
}

/// A policy choosing which resident chunks to evict, told of every residency change.
///
/// The chooser tracks resident chunks only: the caller inserts a chunk when it becomes resident and
/// removes it when it leaves memory for any reason other than [`pop_victims`](Self::pop_victims),
/// which removes what it returns.
/// A locked context (a call is running on it) never loses chunks; locks nest.
pub trait VictimChooser {
    /// A chunk became resident at `level`, occupying `bytes`; it counts as just used.
    fn on_insert(&mut self, id: ChunkId, level: Level, bytes: u64) -> Result<(), VictimError>;
    /// A resident chunk was used.
    fn on_access(&mut self, id: ChunkId) -> Result<(), VictimError>;
    /// A resident chunk was recompressed to `level` and now occupies `bytes`; its recency stays.
    fn on_level_change(&mut self, id: ChunkId, level: Level, bytes: u64)
    -> Result<(), VictimError>;
    /// A resident chunk left memory (reclaimed elsewhere, or its context was deleted).
    fn on_remove(&mut self, id: ChunkId) -> Result<(), VictimError>;
    /// Every chunk of `context` left memory; returns how many bytes they occupied.
    fn remove_context(&mut self, context: u64) -> u64;
    /// Protects `context`'s chunks from eviction until a matching [`unlock`](Self::unlock).
    fn lock(&mut self, context: u64);
    /// Releases one [`lock`](Self::lock) of `context`.
    fn unlock(&mut self, context: u64) -> Result<(), VictimError>;
    /// Chooses and removes victims until at least `need_bytes` are freed or nothing evictable is
    /// left.
    fn pop_victims(&mut self, need_bytes: u64) -> Victims;
    /// The victims [`pop_victims`](Self::pop_victims) would choose, without removing them, among
    /// the chunks `eligible` accepts: it returns the bytes reclaiming a chunk would free, or `None`
    /// to pass over it (being written out, say).
    /// The caller reports what it really reclaims with [`on_remove`](Self::on_remove); this is the
    /// shape of a pager that asks for victims and may skip some.
    fn peek_victims(
        &self,
        need_bytes: u64,
        eligible: &mut dyn FnMut(ChunkId) -> Option<u64>,
    ) -> Victims;
    /// Bytes occupied by tracked chunks.
    fn resident_bytes(&self) -> u64;
    /// Number of tracked chunks.
    fn len(&self) -> usize;
    /// Whether no chunk is tracked.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Whether victims are discarded (their context is killed and must be re-prefilled, as LMK
    /// does) rather than dropped with their data kept on the store.
    fn discards_victims(&self) -> bool {
        false
    }
}
