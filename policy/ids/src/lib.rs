//! ids: the names of a context and of a chunk, shared by every layer that speaks of them.
//!
//! The pager, the store and the service each hold facts about the same contexts and chunks; this
//! crate gives them one id type each, so a context is `ContextId(7)` in all of them and no layer
//! converts between look-alike ids. It owns nothing else.
//!
//! It must never know what a context holds (a model, a KV format, memory or files): it depends on
//! nothing, and everything may depend on it.

use std::fmt;

/// A context's id, as the service numbers them: unique within one store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ContextId(pub u64);

impl fmt::Display for ContextId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A chunk: its context and its index (chunk `i` holds the context's tokens `t i .. t (i + 1)`
/// for chunks of `t` tokens).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkKey {
    /// The context the chunk belongs to.
    pub ctx: ContextId,
    /// The chunk's index in its context.
    pub index: u32,
}

impl ChunkKey {
    /// The key of chunk `index` of context `ctx`.
    pub const fn new(ctx: u64, index: u32) -> ChunkKey {
        ChunkKey {
            ctx: ContextId(ctx),
            index,
        }
    }
}

impl fmt::Display for ChunkKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ctx {} chunk {}", self.ctx.0, self.index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_print_as_the_logs_and_errors_name_them() {
        assert_eq!(ContextId(7).to_string(), "7");
        assert_eq!(ChunkKey::new(7, 3).to_string(), "ctx 7 chunk 3");
        assert!(
            ChunkKey::new(1, 9) < ChunkKey::new(2, 0),
            "ordered by context first"
        );
    }
}
