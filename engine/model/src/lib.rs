//! model: the LLM and its KV chunks: GGUF loading, the tokenizer, the kernels, the forward pass,
//! sampling, and one context's chunked KV cache with its codecs, attention and recompute.
//!
//! [`Model`] loads a GGUF file and runs the forward pass ([`forward`]); [`generate`] samples
//! tokens, [`guided`] under a constraint (structured output); [`tokenizer::Tokenizer`] is built
//! from the GGUF's own vocabulary; [`fetch`] gets the
//! default model and caches it; [`tiny`] writes a tiny random-weight model for tests.
//! [`kv`] holds one context's K/V in 16-token chunks over a [`kv::ChunkMemory`].
//!
//! This crate owns the numbers: it knows nothing of contexts' owners, of the pager, of the
//! service's threads or of the wire protocol. Where its chunks live is the caller's
//! [`kv::ChunkMemory`]; it uses kvfs only for its buffer type and header size.

pub mod chosen;
pub mod config;
pub mod fetch;
pub mod forward;
pub mod generate;
pub mod guided;
pub mod int8gemm;
pub mod kernels;
pub mod kv;
mod load;
pub mod qmatrix;
pub mod rope;
pub mod simd;
pub mod stream;
pub mod tiny;
pub mod tokenizer;

pub use forward::{ForwardStats, Linear, Logits, Model, ModelError, WeightHolding};
pub use stream::{WeightOptions, WeightSource};
