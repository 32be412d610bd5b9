//! The engine: a llama-family model on candle-core with a chunked KV cache.

pub mod fetch;
pub mod tokenizer;
