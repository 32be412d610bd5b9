//! The model: GGUF loading, the tokenizer, the kernels, the forward pass and sampling.
//!
//! [`Model`] loads a GGUF file and runs the forward pass ([`forward`]); [`generate`] samples
//! tokens; [`tokenizer::Tokenizer`] is built from the GGUF's own vocabulary; [`fetch`] gets the
//! default model and caches it; [`tiny`] writes a tiny random-weight model for tests.

pub mod config;
pub mod fetch;
pub mod forward;
pub mod generate;
pub mod int8gemm;
pub mod kernels;
pub mod qmatrix;
pub mod simd;
pub mod stream;
pub mod tiny;
pub mod tokenizer;

pub use forward::{ForwardStats, Linear, Logits, Model, ModelError, WeightHolding};
pub use stream::{WeightOptions, WeightSource};
