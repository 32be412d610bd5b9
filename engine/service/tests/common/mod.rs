//! What the service's integration tests share: the app that owns their contexts and their
//! deterministic prompts.

use service::Owner;

/// The app every test context belongs to.
pub fn owner() -> Owner {
    Owner {
        uid: 1000,
        app: "test".into(),
    }
}

/// Deterministic prompt tokens (ids within the tiny vocabulary).
pub fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2654435761).wrapping_add(seed * 97)) % 250 + 3)
        .collect()
}
