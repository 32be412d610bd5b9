//! Compression levels: the set of bit-widths a chunk may be stored at, relative to the base format.

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
        bits: u8,
        previous: u8,
    },
}

/// The levels a chunk may be compressed to, heaviest first, as bit-widths relative to the base.
///
/// The paper's default is {8/8, 4/8, 2/8} on an int8 base; a 4-bit base would use {4/4, 2/4, 1/4}.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LevelSet {
    base_bits: u8,
    bits: Vec<u8>,
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
                    bits: b,
                    previous: bits[level - 1],
                });
            }
        }
        Ok(Self {
            base_bits,
            bits: bits.to_vec(),
        })
    }

    /// The paper's set: int8 base, levels 8, 4 and 2 bits.
    pub fn paper_default() -> Self {
        Self {
            base_bits: 8,
            bits: vec![8, 4, 2],
        }
    }

    /// How many levels the set holds.
    pub fn len(&self) -> usize {
        self.bits.len()
    }

    /// Whether the set is empty (never: a set holds at least one level).
    pub fn is_empty(&self) -> bool {
        self.bits.is_empty()
    }

    /// The base format's bit-width.
    pub fn base_bits(&self) -> u8 {
        self.base_bits
    }

    /// Whether `level` belongs to this set.
    pub fn contains(&self, level: Level) -> bool {
        usize::from(level.0) < self.bits.len()
    }

    /// The bit-width of `level`, or `None` when the set has no such level.
    pub fn bits(&self, level: Level) -> Option<u8> {
        self.bits.get(usize::from(level.0)).copied()
    }

    /// The ratio of `level` to the base (1.0 for the base itself), or `None` when absent.
    pub fn ratio(&self, level: Level) -> Option<f64> {
        self.bits(level)
            .map(|b| f64::from(b) / f64::from(self.base_bits))
    }

    /// The heaviest level (the base format's).
    pub fn heaviest(&self) -> Level {
        Level(0)
    }

    /// The lightest level.
    pub fn lightest(&self) -> Level {
        // The set holds between 1 and MAX_LEVELS levels, so this fits a u8.
        Level((self.bits.len() - 1) as u8)
    }

    /// Every level, heaviest first.
    pub fn levels(&self) -> impl Iterator<Item = Level> + '_ {
        (0..self.bits.len()).map(|i| Level(i as u8))
    }

    /// All bit-widths, heaviest first.
    pub fn all_bits(&self) -> &[u8] {
        &self.bits
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
