//! A fast hasher for the small integer keys of the choosers (context ids, chunk ids).
//!
//! The keys come from the service, not from clients, so flooding is no concern; std's SipHash
//! would cost more than the rest of a queue operation.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

/// Multiply-rotate mixing, as in rustc's FxHash.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct IdHasher(u64);

const K: u64 = 0xf135_7aea_2e62_a9c5;

impl IdHasher {
    fn add(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(26) ^ n).wrapping_mul(K);
    }
}

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.add(u64::from(b));
        }
    }

    fn write_u8(&mut self, n: u8) {
        self.add(u64::from(n));
    }

    fn write_u32(&mut self, n: u32) {
        self.add(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }

    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }
}

pub(crate) type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;
pub(crate) type IdSet<K> = HashSet<K, BuildHasherDefault<IdHasher>>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ChunkId;
    use std::hash::BuildHasher;

    #[test]
    fn distinct_ids_hash_apart() {
        let build = BuildHasherDefault::<IdHasher>::default();
        let mut seen = std::collections::HashSet::new();
        for context in 0..64u64 {
            for index in 0..64u32 {
                seen.insert(build.hash_one(ChunkId { context, index }));
            }
        }
        assert_eq!(seen.len(), 64 * 64);
    }
}
