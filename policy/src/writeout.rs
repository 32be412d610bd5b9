//! Ahead-of-time write-out (paper §3.4): at the end of a call, which chunks to (re)write to the store and in what order.

use crate::level::Level;

/// A chunk of the context as the call leaves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteCandidate {
    /// Its position in the context.
    pub index: u32,
    /// The level it is assigned now (after [`assign_levels`](crate::assign_levels)).
    pub level: Level,
    /// The level of its copy on the store, `None` when it was never written.
    pub stored: Option<Level>,
    /// Whether its tokens changed since the stored copy was written (the partial last chunk grew,
    /// or the chunk is new).
    pub modified: bool,
    /// Its bytes at `level`.
    pub bytes: u64,
}

/// Why a chunk is to be written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum WriteReason {
    /// Never written: memory holding it cannot be reclaimed until it is.
    New,
    /// Its stored copy is stale: same as new for reclaim.
    Modified,
    /// Its stored copy is valid but heavier than its level: rewriting it makes the next Load
    /// read fewer bytes.
    Recompressed,
}

/// One chunk to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Write {
    pub index: u32,
    pub level: Level,
    pub reason: WriteReason,
    pub bytes: u64,
}

/// Why a write-out could not be planned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WriteOutError {
    #[error("chunk {index} is listed twice")]
    Duplicate { index: u32 },
    #[error(
        "chunk {index} is unmodified and assigned level {level:?}, heavier than its stored {stored:?}: levels only go down"
    )]
    LevelWentUp {
        index: u32,
        level: Level,
        stored: Level,
    },
}

/// The chunks to write at the end of a call, in the order to write them.
///
/// New and modified chunks come first, since until they are written their memory cannot be
/// reclaimed without I/O; among them the heaviest level first, since LCTRU evicts those first,
/// then by position.
/// Recompressed chunks follow in the same order: their stored copy already allows reclaim.
/// Unmodified chunks stored at their level are not written.
pub fn plan_writeout(chunks: &[WriteCandidate]) -> Result<Vec<Write>, WriteOutError> {
    let mut seen: Vec<u32> = chunks.iter().map(|c| c.index).collect();
    seen.sort_unstable();
    if let Some(w) = seen.windows(2).find(|w| w[0] == w[1]) {
        return Err(WriteOutError::Duplicate { index: w[0] });
    }
    let mut writes = Vec::new();
    for c in chunks {
        let reason = match c.stored {
            None => WriteReason::New,
            Some(_) if c.modified => WriteReason::Modified,
            Some(stored) if c.level > stored => WriteReason::Recompressed,
            Some(stored) if c.level == stored => continue,
            Some(stored) => {
                return Err(WriteOutError::LevelWentUp {
                    index: c.index,
                    level: c.level,
                    stored,
                });
            }
        };
        writes.push(Write {
            index: c.index,
            level: c.level,
            reason,
            bytes: c.bytes,
        });
    }
    writes.sort_by_key(|w| (w.reason == WriteReason::Recompressed, w.level, w.index));
    Ok(writes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(index: u32, level: u8, stored: Option<u8>, modified: bool) -> WriteCandidate {
        WriteCandidate {
            index,
            level: Level(level),
            stored: stored.map(Level),
            modified,
            bytes: 100 >> level,
        }
    }

    fn check(chunks: &[WriteCandidate], expected: &[(u32, WriteReason)]) {
        let got: Vec<(u32, WriteReason)> = plan_writeout(chunks)
            .unwrap()
            .iter()
            .map(|w| (w.index, w.reason))
            .collect();
        assert_eq!(got, expected);
    }

    #[test]
    fn cases() {
        use WriteReason::*;
        check(&[], &[]);
        // Stored at its level and unmodified: nothing to do.
        check(&[c(0, 1, Some(1), false)], &[]);
        check(
            &[
                c(0, 2, Some(1), false),
                c(1, 1, Some(1), false),
                c(2, 1, None, true),
                c(3, 0, Some(0), true),
                c(4, 0, None, true),
            ],
            &[(3, Modified), (4, New), (2, New), (0, Recompressed)],
        );
        // A modified chunk is rewritten whatever its stored level.
        check(&[c(5, 0, Some(2), true)], &[(5, Modified)]);
    }

    #[test]
    fn errors() {
        assert_eq!(
            plan_writeout(&[c(0, 0, Some(1), false)]),
            Err(WriteOutError::LevelWentUp {
                index: 0,
                level: Level(0),
                stored: Level(1)
            })
        );
        assert_eq!(
            plan_writeout(&[c(0, 0, None, true), c(0, 0, None, true)]),
            Err(WriteOutError::Duplicate { index: 0 })
        );
    }
}
