//! kvfs: the crash-safe, compressed KV chunk store and its FUSE filesystem. A chunk is bytes with a header.
//!
//! [`Store`] is the Rust API the service uses (it works with or without a mount);
//! [`fs::mount`] exposes a store as a filesystem, and [`MountReader`] moves chunks through a mount's
//! per-context `data` file (read, passed through to the disk) and `kv` file (written).
//!
//! This crate owns the bytes on disk and their crash safety; it never knows a model (a format is
//! a label, the model an opaque fingerprint, text comes from a decoder the service registers), a
//! pager, or who computes a chunk.

pub mod client;
pub mod format;
pub mod fs;
pub mod guard;
pub mod io;
pub mod store;

pub use client::{MountReader, RawSlot};
pub use format::{Codec, ContextMeta, Fingerprint, KvFormat, Link};
pub use fs::{Mount, MountConfig, MountCounters, MountError, kv_offset, mount};
pub use store::{
    ChunkMeta, ContextId, Decoder, HEADER_PAGE, MAX_CHUNK_BYTES, NewContext, Residency, SLOT_BYTES,
    Seed, Store, StoreError, StoreOptions, StoreState, StoredChunk, StoredContext, TextView,
    slot_offset, utc,
};
