//! The engine: a llama-family model with a chunked KV cache, and the service that runs it.
//!
//! [`model`] loads a GGUF file, tokenizes, runs the forward pass with the engine's own kernels
//! and samples tokens; [`kv`] holds one context's K/V in 16-token chunks over a
//! [`kv::ChunkMemory`], with the chunk codecs, attention over packed chunks and recompute;
//! [`service`] runs calls of many contexts on managed memory under one KV budget; [`trace`]
//! generates, reads and sums up the context-switching traces the service is measured with.

pub mod kv;
pub mod model;
pub mod service;
pub mod trace;
