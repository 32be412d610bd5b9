//! The FUSE filesystem over a [`Store`](crate::Store): `/stats`,
//! `/<context>/{info,text,tokens,kv,data,chunks/<index>}`.
//!
//! Shaped like fuser's `examples/simple.rs`: helpers return `Result<T, Errno>` and each
//! `Filesystem` method only adapts to its `reply`.
//! Files belong to the uid that owns the context (mode 0600 or 0400, directories 0700) and the
//! mount uses `default_permissions`, so the kernel enforces ownership; other uids are not even
//! shown a context they do not own. `data` is passed through to the context's data file for
//! `O_DIRECT` readers (FUSE passthrough: the kernel reads the disk itself); every other open is
//! served by the daemon with `FOPEN_DIRECT_IO`, so the page cache never holds chunk bytes and the
//! kernel forwards reads in requests of up to 1 MiB.
//!
//! The files beside this one, each using only those listed before it: `state.rs` (the
//! filesystem's handles and counters), `nodes.rs` (inode numbers, attributes, lookup and
//! listing), `views.rs` (the generated files and the per-chunk view), `data.rs` (the `data` and
//! `kv` files), `adapter.rs` (the `Filesystem` methods) and `mount.rs` (mounting, the guard,
//! unmounting).

mod adapter;
mod data;
mod mount;
mod nodes;
mod state;
mod views;

pub use data::kv_offset;
pub use mount::{
    Mount, MountConfig, MountError, block_termination_signals, clean_stale_mount, mount,
    wait_for_termination,
};
pub use state::{KvFs, MountCounters};
