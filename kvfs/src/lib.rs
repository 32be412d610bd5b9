//! kvfs: the crash-safe, compressed KV chunk store and its FUSE filesystem. A chunk is bytes with a header.
