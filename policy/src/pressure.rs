//! Memory-pressure input: from the system's pressure signals (PSI, cgroup limit and usage) to a KV budget, with hysteresis.

/// One reading of the system's memory state, as the service samples it.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PressureSignals {
    /// PSI memory `some avg10`: percent of the last 10 s some task stalled on memory.
    pub some_avg10: f64,
    /// PSI memory `full avg10`: percent of the last 10 s every task stalled on memory.
    pub full_avg10: f64,
    /// The cgroup's memory limit, `None` when unlimited.
    pub limit_bytes: Option<u64>,
    /// The cgroup's memory usage, the KV memory included.
    pub usage_bytes: u64,
    /// The KV memory resident now (a part of `usage_bytes`).
    pub kv_resident_bytes: u64,
}

/// How the budget reacts; the gaps between the grow and shrink thresholds, and the calm readings
/// asked for before growing, are the hysteresis.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BudgetConfig {
    /// The budget never goes below this.
    pub min_bytes: u64,
    /// Nor above this (the `--kv-budget` the service was started with).
    pub max_bytes: u64,
    /// Shrink when `some avg10` reaches this (percent).
    pub shrink_some: f64,
    /// Or when `full avg10` reaches this (percent).
    pub shrink_full: f64,
    /// Grow only while `some avg10` is at most this...
    pub grow_some: f64,
    /// ...and `full avg10` at most this.
    pub grow_full: f64,
    /// A shrink multiplies the budget by this, in (0, 1).
    pub shrink_factor: f64,
    /// A grow adds this many bytes.
    pub grow_bytes: u64,
    /// Consecutive calm readings needed before one grow.
    pub calm_readings: u32,
    /// Bytes kept free under the cgroup limit for everything else.
    pub reserve_bytes: u64,
}

impl BudgetConfig {
    /// Thresholds for a budget between `min_bytes` and `max_bytes`: shrink by a quarter at 10%
    /// `some` or 2% `full`, grow by a sixteenth of the range after 3 readings under 1% and 0.1%,
    /// keep 64 MiB free under the cgroup limit.
    pub fn new(min_bytes: u64, max_bytes: u64) -> Self {
        Self {
            min_bytes,
            max_bytes,
            shrink_some: 10.0,
            shrink_full: 2.0,
            grow_some: 1.0,
            grow_full: 0.1,
            shrink_factor: 0.75,
            grow_bytes: (max_bytes.saturating_sub(min_bytes) / 16).max(1),
            calm_readings: 3,
            reserve_bytes: 64 << 20,
        }
    }
}

/// Why a configuration or a reading was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PressureError {
    #[error("the minimum budget {min_bytes} exceeds the maximum {max_bytes}")]
    MinAboveMax { min_bytes: u64, max_bytes: u64 },
    #[error("{name} = {value} is not a percentage in [0, 100]")]
    BadPercent { name: &'static str, value: f64 },
    #[error("the grow threshold {grow} must be below the shrink threshold {shrink} ({name})")]
    NoHysteresis {
        name: &'static str,
        grow: f64,
        shrink: f64,
    },
    #[error("the shrink factor {factor} must be in (0, 1)")]
    BadShrinkFactor { factor: f64 },
    #[error("calm_readings must be at least 1")]
    ZeroCalmReadings,
}

/// Why the budget moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShrinkReason {
    /// PSI crossed a shrink threshold.
    Pressure,
    /// The cgroup limit leaves less room than the budget.
    Limit,
}

/// What one reading did to the budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BudgetChange {
    Hold,
    Shrink { to: u64, reason: ShrinkReason },
    Grow { to: u64 },
}

/// Turns a stream of pressure readings into a KV budget.
#[derive(Debug, Clone)]
pub struct BudgetController {
    config: BudgetConfig,
    budget: u64,
    calm: u32,
}

fn percent(name: &'static str, value: f64) -> Result<(), PressureError> {
    if (0.0..=100.0).contains(&value) {
        Ok(())
    } else {
        Err(PressureError::BadPercent { name, value })
    }
}

impl BudgetController {
    /// A controller starting at the maximum budget.
    pub fn new(config: BudgetConfig) -> Result<Self, PressureError> {
        let c = &config;
        if c.min_bytes > c.max_bytes {
            return Err(PressureError::MinAboveMax {
                min_bytes: c.min_bytes,
                max_bytes: c.max_bytes,
            });
        }
        percent("shrink_some", c.shrink_some)?;
        percent("shrink_full", c.shrink_full)?;
        percent("grow_some", c.grow_some)?;
        percent("grow_full", c.grow_full)?;
        for (name, grow, shrink) in [
            ("some", c.grow_some, c.shrink_some),
            ("full", c.grow_full, c.shrink_full),
        ] {
            if grow >= shrink {
                return Err(PressureError::NoHysteresis { name, grow, shrink });
            }
        }
        if !(c.shrink_factor > 0.0 && c.shrink_factor < 1.0) {
            return Err(PressureError::BadShrinkFactor {
                factor: c.shrink_factor,
            });
        }
        if c.calm_readings == 0 {
            return Err(PressureError::ZeroCalmReadings);
        }
        Ok(Self {
            budget: config.max_bytes,
            config,
            calm: 0,
        })
    }

    /// The budget now.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// The most the KV memory may take under the cgroup limit, within the configured range.
    fn ceiling(&self, s: &PressureSignals) -> u64 {
        let c = &self.config;
        let room = match s.limit_bytes {
            None => c.max_bytes,
            Some(limit) => {
                let others = s.usage_bytes.saturating_sub(s.kv_resident_bytes);
                limit.saturating_sub(others).saturating_sub(c.reserve_bytes)
            }
        };
        room.clamp(c.min_bytes, c.max_bytes)
    }

    /// Takes one reading and returns what it did to the budget.
    pub fn update(&mut self, s: &PressureSignals) -> Result<BudgetChange, PressureError> {
        percent("some_avg10", s.some_avg10)?;
        percent("full_avg10", s.full_avg10)?;
        let c = self.config;
        let ceiling = self.ceiling(s);
        let pressured = s.some_avg10 >= c.shrink_some || s.full_avg10 >= c.shrink_full;
        let calm = s.some_avg10 <= c.grow_some && s.full_avg10 <= c.grow_full;
        let (to, reason) = if pressured {
            let shrunk = (self.budget as f64 * c.shrink_factor) as u64;
            (shrunk.min(ceiling).max(c.min_bytes), ShrinkReason::Pressure)
        } else {
            (ceiling, ShrinkReason::Limit)
        };
        if to < self.budget {
            self.budget = to;
            self.calm = 0;
            return Ok(BudgetChange::Shrink { to, reason });
        }
        if !calm {
            self.calm = 0;
            return Ok(BudgetChange::Hold);
        }
        self.calm += 1;
        if self.calm < c.calm_readings {
            return Ok(BudgetChange::Hold);
        }
        self.calm = 0;
        let to = self.budget.saturating_add(c.grow_bytes).min(ceiling);
        if to <= self.budget {
            return Ok(BudgetChange::Hold);
        }
        self.budget = to;
        Ok(BudgetChange::Grow { to })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MIB: u64 = 1 << 20;

    fn reading(some: f64, full: f64) -> PressureSignals {
        PressureSignals {
            some_avg10: some,
            full_avg10: full,
            ..PressureSignals::default()
        }
    }

    /// Feeds `readings` to a controller over [100, 1600] MiB and checks each step's change.
    fn check(readings: &[PressureSignals], expected: &[BudgetChange]) {
        let mut config = BudgetConfig::new(100 * MIB, 1600 * MIB);
        config.grow_bytes = 100 * MIB;
        let mut ctl = BudgetController::new(config).unwrap();
        let got: Vec<BudgetChange> = readings.iter().map(|r| ctl.update(r).unwrap()).collect();
        assert_eq!(got, expected);
    }

    #[test]
    fn shrink_then_grow_with_hysteresis() {
        use BudgetChange::*;
        let pressure = ShrinkReason::Pressure;
        check(
            &[
                reading(0.0, 0.0),
                reading(12.0, 0.0),
                reading(5.0, 0.0),
                reading(0.5, 0.0),
                reading(0.5, 0.0),
                reading(3.0, 0.0),
                reading(0.5, 0.0),
                reading(0.5, 0.0),
                reading(0.5, 0.0),
                reading(0.0, 3.0),
            ],
            &[
                // Already at the maximum.
                Hold,
                Shrink {
                    to: 1200 * MIB,
                    reason: pressure,
                },
                // Between the thresholds: hold.
                Hold,
                Hold,
                Hold,
                // Not calm: the count restarts.
                Hold,
                Hold,
                Hold,
                Grow { to: 1300 * MIB },
                Shrink {
                    to: 975 * MIB,
                    reason: pressure,
                },
            ],
        );
    }

    #[test]
    fn never_below_minimum() {
        let mut ctl = BudgetController::new(BudgetConfig::new(100 * MIB, 200 * MIB)).unwrap();
        for _ in 0..10 {
            ctl.update(&reading(50.0, 50.0)).unwrap();
        }
        assert_eq!(ctl.budget(), 100 * MIB);
    }

    #[test]
    fn cgroup_limit_caps_the_budget() {
        let mut ctl = BudgetController::new(BudgetConfig::new(100 * MIB, 1600 * MIB)).unwrap();
        // 1 GiB limit, 600 MiB used of which 200 MiB is KV: others take 400 MiB, 64 MiB reserve.
        let s = PressureSignals {
            limit_bytes: Some(1024 * MIB),
            usage_bytes: 600 * MIB,
            kv_resident_bytes: 200 * MIB,
            ..PressureSignals::default()
        };
        assert_eq!(
            ctl.update(&s).unwrap(),
            BudgetChange::Shrink {
                to: 560 * MIB,
                reason: ShrinkReason::Limit
            }
        );
        // Calm readings cannot grow past the limit's room.
        for _ in 0..6 {
            assert_eq!(ctl.update(&s).unwrap(), BudgetChange::Hold);
        }
    }

    #[test]
    fn errors() {
        let mut c = BudgetConfig::new(10, 5);
        assert_eq!(
            BudgetController::new(c).err(),
            Some(PressureError::MinAboveMax {
                min_bytes: 10,
                max_bytes: 5
            })
        );
        c = BudgetConfig::new(1, 5);
        c.grow_some = 20.0;
        assert_eq!(
            BudgetController::new(c).err(),
            Some(PressureError::NoHysteresis {
                name: "some",
                grow: 20.0,
                shrink: 10.0
            })
        );
        c = BudgetConfig::new(1, 5);
        c.shrink_factor = 1.0;
        assert_eq!(
            BudgetController::new(c).err(),
            Some(PressureError::BadShrinkFactor { factor: 1.0 })
        );
        c = BudgetConfig::new(1, 5);
        c.calm_readings = 0;
        assert_eq!(
            BudgetController::new(c).err(),
            Some(PressureError::ZeroCalmReadings)
        );
        let mut ctl = BudgetController::new(BudgetConfig::new(1, 5)).unwrap();
        assert_eq!(
            ctl.update(&reading(101.0, 0.0)),
            Err(PressureError::BadPercent {
                name: "some_avg10",
                value: 101.0
            })
        );
    }

    fn signals() -> impl Strategy<Value = PressureSignals> {
        (
            0.0f64..30.0,
            0.0f64..5.0,
            prop::option::of(0u64..4096),
            0u64..4096,
            0u64..2048,
        )
            .prop_map(|(some, full, limit, usage, kv)| PressureSignals {
                some_avg10: some,
                full_avg10: full,
                limit_bytes: limit.map(|l| l * MIB),
                usage_bytes: usage * MIB,
                kv_resident_bytes: kv * MIB,
            })
    }

    proptest! {
        /// The budget stays in range, never exceeds the cgroup's room, only shrinks under
        /// pressure, and only grows after enough calm readings.
        #[test]
        fn budget_invariants(readings in prop::collection::vec(signals(), 0..60)) {
            let config = BudgetConfig::new(100 * MIB, 1600 * MIB);
            let mut ctl = BudgetController::new(config).unwrap();
            let mut calm = 0;
            for r in &readings {
                let before = ctl.budget();
                let change = ctl.update(r).unwrap();
                let after = ctl.budget();
                prop_assert!((config.min_bytes..=config.max_bytes).contains(&after));
                prop_assert!(after <= ctl.ceiling(r).max(config.min_bytes));
                let pressured = r.some_avg10 >= config.shrink_some || r.full_avg10 >= config.shrink_full;
                let is_calm = r.some_avg10 <= config.grow_some && r.full_avg10 <= config.grow_full;
                calm = if is_calm { calm + 1 } else { 0 };
                match change {
                    BudgetChange::Hold => prop_assert_eq!(after, before),
                    BudgetChange::Shrink { to, reason } => {
                        prop_assert!(to < before && to == after);
                        prop_assert_eq!(reason == ShrinkReason::Pressure, pressured);
                        calm = 0;
                    }
                    BudgetChange::Grow { to } => {
                        prop_assert!(to > before && to == after && !pressured);
                        prop_assert!(calm >= config.calm_readings);
                        calm = 0;
                    }
                }
                if pressured {
                    prop_assert!(after <= before);
                }
            }
        }
    }
}
