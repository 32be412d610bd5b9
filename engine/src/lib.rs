//! The engine: a llama-family model on candle-core with a chunked KV cache.
//!
//! [`model::Model`] loads a GGUF file and runs the forward pass; [`kv::KvCache`] holds one
//! context's K/V in 16-token chunks over a [`kv::ChunkMemory`]; [`generate`] samples tokens;
//! [`tokenizer::Tokenizer`] is built from the GGUF's own vocabulary; [`fetch`] gets the default
//! model and caches it.

pub mod attention;
pub mod codec;
pub mod config;
pub mod eval_mix;
pub mod fetch;
pub mod generate;
pub mod kernels;
pub mod kv;
pub mod model;
pub mod qmatvec;
pub mod recompute;
pub mod tiny;
pub mod tokenizer;
