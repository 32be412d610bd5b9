//! bench: the measurements the project is judged by, and what they need: context-switching
//! traces ([`trace`]), cgroup v1 groups for memory peaks and disk throttles ([`cgroup`]), and the
//! switch-latency benchmark of one context swapped out and brought back ([`load`]).
//!
//! The library crates hold no benchmark code: each measurement drives their public API from
//! here, and `llms bench ...` prints what it returns.

pub mod cgroup;
pub mod daemon_proc;
pub mod disk;
pub mod http;
pub mod http_load;
pub mod kvfs;
pub mod load;
pub mod peer;
pub mod pixel_font;
pub mod plot;
pub mod switch;
pub mod trace;
