//! Compression levels: the set of bit-widths (or any costs, such as a chunk's stored bytes) a
//! chunk may be stored at, relative to the base format.

/// A compression level: an index into a [`LevelSet`], 0 being the heaviest (the base format).
///
/// Levels only ever go down for a chunk, that is their index only grows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Level(pub u8);

/// Why a level set was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LevelError {
    #[error("a level set needs at least one level")]
    Empty,
    #[error("a level set holds at most {max} levels, got {got}")]
    TooMany { got: usize, max: usize },
    #[error("the base format has {base_bits} bits; it must be between 1 and 16")]
    BadBase { base_bits: u8 },
    #[error(
        "level {level} has {bits} bits; levels must be between 1 and the base's {base_bits} bits"
    )]
    BadBits {
        level: usize,
        bits: u8,
        base_bits: u8,
    },
    #[error("level {level} has {bits} bits, not fewer than the level before it ({previous} bits)")]
    NotDecreasing {
        level: usize,
        bits: u32,
        previous: u32,
    },
    #[error("level {level} costs nothing; every level must cost at least 1")]
    ZeroCost { level: usize },
}

/// The levels a chunk may be compressed to, heaviest first, each with its cost relative to the
/// base: bit-widths, or any integer cost per chunk (its stored bytes, say).
///
/// The paper's default is {8/8, 4/8, 2/8} on an int8 base; a 4-bit base would use {4/4, 2/4, 1/4}.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LevelSet {
    base: u32,
    costs: Vec<u32>,
}

impl LevelSet {
    /// The most levels a set may hold.
    pub const MAX_LEVELS: usize = 8;

    /// Builds a level set from the base format's bit-width and each level's, heaviest first.
    pub fn new(base_bits: u8, bits: &[u8]) -> Result<Self, LevelError> {
        if base_bits == 0 || base_bits > 16 {
            return Err(LevelError::BadBase { base_bits });
        }
        if bits.is_empty() {
            return Err(LevelError::Empty);
        }
        if bits.len() > Self::MAX_LEVELS {
            return Err(LevelError::TooMany {
                got: bits.len(),
                max: Self::MAX_LEVELS,
            });
        }
        for (level, &b) in bits.iter().enumerate() {
            if b == 0 || b > base_bits {
                return Err(LevelError::BadBits {
                    level,
                    bits: b,
                    base_bits,
                });
            }
            if level > 0 && b >= bits[level - 1] {
                return Err(LevelError::NotDecreasing {
                    level,
                    bits: u32::from(b),
                    previous: u32::from(bits[level - 1]),
                });
            }
        }
        Ok(Self {
            base: u32::from(base_bits),
            costs: bits.iter().map(|&b| u32::from(b)).collect(),
        })
    }

    /// Builds a level set from each level's cost, heaviest first, the first being the base: any
    /// positive integers that strictly decrease, such as each level's stored bytes per chunk.
    pub fn weighted(costs: &[u32]) -> Result<Self, LevelError> {
        if costs.is_empty() {
            return Err(LevelError::Empty);
        }
        if costs.len() > Self::MAX_LEVELS {
            return Err(LevelError::TooMany {
                got: costs.len(),
                max: Self::MAX_LEVELS,
            });
        }
        for (level, &c) in costs.iter().enumerate() {
            if c == 0 {
                return Err(LevelError::ZeroCost { level });
            }
            if level > 0 && c >= costs[level - 1] {
                return Err(LevelError::NotDecreasing {
                    level,
                    bits: c,
                    previous: costs[level - 1],
                });
            }
        }
        Ok(Self {
            base: costs[0],
            costs: costs.to_vec(),
        })
    }

    /// The paper's set: int8 base, levels 8, 4 and 2 bits.
    pub fn paper_default() -> Self {
        Self {
            base: 8,
            costs: vec![8, 4, 2],
        }
    }

    /// How many levels the set holds.
    pub fn len(&self) -> usize {
        self.costs.len()
    }

    /// Whether the set is empty (never: a set holds at least one level).
    pub fn is_empty(&self) -> bool {
        self.costs.is_empty()
    }

    /// The base format's cost (its bit-width for a set of bit-widths).
    pub fn base_cost(&self) -> u32 {
        self.base
    }

    /// Whether `level` belongs to this set.
    pub fn contains(&self, level: Level) -> bool {
        usize::from(level.0) < self.costs.len()
    }

    /// The cost of `level` (its bit-width for a set of bit-widths), or `None` when the set has
    /// no such level.
    pub fn cost(&self, level: Level) -> Option<u32> {
        self.costs.get(usize::from(level.0)).copied()
    }

    /// The ratio of `level` to the base (1.0 for the base itself), or `None` when absent.
    pub fn ratio(&self, level: Level) -> Option<f64> {
        self.cost(level)
            .map(|b| f64::from(b) / f64::from(self.base))
    }

    /// The heaviest level (the base format's).
    pub fn heaviest(&self) -> Level {
        Level(0)
    }

    /// The lightest level.
    pub fn lightest(&self) -> Level {
        // The set holds between 1 and MAX_LEVELS levels, so this fits a u8.
        Level((self.costs.len() - 1) as u8)
    }

    /// Every level, heaviest first.
    pub fn levels(&self) -> impl Iterator<Item = Level> + '_ {
        (0..self.costs.len()).map(|i| Level(i as u8))
    }

    /// Every level's cost, heaviest first.
    pub fn costs(&self) -> &[u32] {
        &self.costs
    }
}

impl Default for LevelSet {
    fn default() -> Self {
        Self::paper_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(base: u8, bits: &[u8], expected: Result<(), LevelError>) {
        assert_eq!(
            LevelSet::new(base, bits).map(|_| ()),
            expected,
            "{base} {bits:?}"
        );
    }

    #[test]
    fn validation() {
        check(8, &[8, 4, 2], Ok(()));
        check(4, &[4, 2, 1], Ok(()));
        check(8, &[4, 2, 1], Ok(()));
        check(8, &[], Err(LevelError::Empty));
        check(0, &[1], Err(LevelError::BadBase { base_bits: 0 }));
        check(
            8,
            &[8, 8],
            Err(LevelError::NotDecreasing {
                level: 1,
                bits: 8,
                previous: 8,
            }),
        );
        check(
            8,
            &[9],
            Err(LevelError::BadBits {
                level: 0,
                bits: 9,
                base_bits: 8,
            }),
        );
        check(
            8,
            &[8, 0],
            Err(LevelError::BadBits {
                level: 1,
                bits: 0,
                base_bits: 8,
            }),
        );
        check(
            16,
            &[16, 15, 14, 13, 12, 11, 10, 9, 8],
            Err(LevelError::TooMany { got: 9, max: 8 }),
        );
    }

    #[test]
    fn weighted_sets() {
        let set = LevelSet::weighted(&[199_184, 107_024, 95_504]).unwrap();
        assert_eq!(set.base_cost(), 199_184);
        assert_eq!(set.ratio(Level(2)), Some(95_504.0 / 199_184.0));
        assert_eq!(LevelSet::weighted(&[]), Err(LevelError::Empty));
        assert_eq!(
            LevelSet::weighted(&[5, 0]),
            Err(LevelError::ZeroCost { level: 1 })
        );
        assert_eq!(
            LevelSet::weighted(&[5, 5]),
            Err(LevelError::NotDecreasing {
                level: 1,
                bits: 5,
                previous: 5
            })
        );
    }

    #[test]
    fn ratios() {
        let set = LevelSet::default();
        assert_eq!(set.ratio(Level(0)), Some(1.0));
        assert_eq!(set.ratio(Level(1)), Some(0.5));
        assert_eq!(set.ratio(Level(2)), Some(0.25));
        assert_eq!(set.ratio(Level(3)), None);
        assert_eq!(set.lightest(), Level(2));
        assert_eq!(set.levels().count(), 3);
    }
}
