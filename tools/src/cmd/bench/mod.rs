//! `llms bench ...`: one module per benchmark command; each measures through the bench crate or
//! a library crate's public API and prints the report (`crate::report`).

pub mod crash;
pub mod engine;
pub mod guide;
pub mod http;
pub mod http_load;
pub mod kv;
pub mod load;
pub mod pager;
pub mod switch;
pub mod weights;
