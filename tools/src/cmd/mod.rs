//! One module per `llms` command: each parses its arguments (clap), calls a library crate, and
//! prints; `bench` holds the benchmarks' commands, whose mechanisms live in the bench crate.

pub mod bench;
pub mod chat;
pub mod ctx;
pub mod engine;
pub mod http;
pub mod kv_mix;
pub mod kvfs;
pub mod model;
pub mod profile;
pub mod serve;
pub mod trace;
