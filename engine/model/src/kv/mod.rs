//! KV chunks: the codecs, one context's chunked cache, attention over it, and recompute.
//!
//! [`cache::KvCache`] holds a context's K/V in 16-token chunks over a [`ChunkMemory`], each
//! chunk encoded by [`codec`]; [`attention`] reads packed chunks and records the attention every
//! key receives ([`received`], per layer group); [`recompute`] rebuilds chunks from their
//! tokens; [`eval`] scores perplexity under any KV format or mix; [`sim`] simulates candidate
//! formats for it.

pub mod attention;
mod bits;
pub mod cache;
pub mod codec;
pub mod eval;
pub mod received;
pub mod recompute;
pub mod sim;
mod staging;

pub use cache::*;
