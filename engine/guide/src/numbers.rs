//! Numbers: JSON integers in a range as a regular expression (the classic digit-by-digit split),
//! and numbers with whole bounds.

use serde_json::{Map, Value};

use crate::GuideError;

/// The largest magnitude generated: 16 digits, exact in an f64 and an i64.
pub(crate) const MAX_MAGNITUDE: u64 = 9_999_999_999_999_999;

/// A fraction of up to 15 digits.
const FRACTION: &str = r"(?:\.[0-9]{1,15})?";

/// A fraction of zeros only (the value stays whole).
const ZERO_FRACTION: &str = r"(?:\.0{1,15})?";

fn bound(m: &Map<String, Value>, key: &str, at: &str) -> Result<Option<f64>, GuideError> {
    match m.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| GuideError::InvalidSchema {
                at: at.to_owned(),
                what: format!("{key} must be a number"),
            }),
    }
}

/// The integers of the schema's bounds (`minimum`, `maximum`, `exclusiveMinimum`,
/// `exclusiveMaximum`), within ±[`MAX_MAGNITUDE`]; `None` if none is.
pub(crate) fn integer(m: &Map<String, Value>, at: &str) -> Result<Option<String>, GuideError> {
    let mut lo = -(MAX_MAGNITUDE as i128);
    let mut hi = MAX_MAGNITUDE as i128;
    let clamp = |f: f64| f.clamp(-1e17, 1e17) as i128;
    if let Some(x) = bound(m, "minimum", at)? {
        lo = lo.max(clamp(x.ceil()));
    }
    if let Some(x) = bound(m, "exclusiveMinimum", at)? {
        lo = lo.max(clamp(x.floor()) + 1);
    }
    if let Some(x) = bound(m, "maximum", at)? {
        hi = hi.min(clamp(x.floor()));
    }
    if let Some(x) = bound(m, "exclusiveMaximum", at)? {
        hi = hi.min(clamp(x.ceil()) - 1);
    }
    Ok(int_range(lo, hi))
}

/// A number within whole inclusive bounds (`minimum`, `maximum`), or any number.
pub(crate) fn number(m: &Map<String, Value>, at: &str) -> Result<Option<String>, GuideError> {
    for k in ["exclusiveMinimum", "exclusiveMaximum"] {
        if m.contains_key(k) {
            return Err(GuideError::Unsupported {
                keyword: k.into(),
                at: at.into(),
                why: "on a number (it is implemented on integers); use minimum/maximum".into(),
            });
        }
    }
    let lo = bound(m, "minimum", at)?;
    let hi = bound(m, "maximum", at)?;
    if lo.is_none() && hi.is_none() {
        return Ok(Some(
            r"-?(?:0|[1-9][0-9]{0,15})(?:\.[0-9]{1,15})?(?:[eE][+-]?[0-9]{1,2})?".into(),
        ));
    }
    for (k, b) in [("minimum", lo), ("maximum", hi)] {
        if let Some(b) = b
            && (b.fract() != 0.0 || b.abs() > MAX_MAGNITUDE as f64)
        {
            return Err(GuideError::Unsupported {
                keyword: k.into(),
                at: at.into(),
                why: "on a number, only whole bounds are implemented".into(),
            });
        }
    }
    let lo = lo.map_or(-(MAX_MAGNITUDE as i128), |x| x as i128);
    let hi = hi.map_or(MAX_MAGNITUDE as i128, |x| x as i128);
    if lo > hi {
        return Ok(None);
    }
    // x = sign, whole part i, fraction f: a side's |x| lies in [a, b] when i is in [a, b - 1]
    // with any fraction, or i = b with a zero fraction.
    let side = |a: i128, b: i128| -> Option<String> {
        if a > b {
            return None;
        }
        let whole = pos_range(b as u64, b as u64).map(|r| format!("{r}{ZERO_FRACTION}"));
        let below = (a < b)
            .then(|| pos_range(a as u64, (b - 1) as u64))
            .flatten()
            .map(|r| format!("{r}{FRACTION}"));
        match (below, whole) {
            (Some(x), Some(y)) => Some(format!("(?:{x}|{y})")),
            (x, y) => x.or(y),
        }
    };
    let pos = (hi >= 0).then(|| side(lo.max(0), hi)).flatten();
    let neg = (lo < 0)
        .then(|| side((-hi).max(0), -lo).map(|r| format!("-{r}")))
        .flatten();
    Ok(match (pos, neg) {
        (Some(p), Some(n)) => Some(format!("(?:{p}|{n})")),
        (p, n) => p.or(n),
    })
}

/// The integers in `[lo, hi]` in JSON (no leading zeros, no `-0`); `None` if there are none.
pub(crate) fn int_range(lo: i128, hi: i128) -> Option<String> {
    let m = MAX_MAGNITUDE as i128;
    let (lo, hi) = (lo.max(-m), hi.min(m));
    if lo > hi {
        return None;
    }
    let mut alts = Vec::new();
    if lo < 0 {
        let (a, b) = ((-hi.min(-1)) as u64, (-lo) as u64);
        alts.extend(pos_range(a, b).map(|r| format!("-{r}")));
    }
    if hi >= 0 {
        alts.extend(pos_range(lo.max(0) as u64, hi as u64));
    }
    match alts.len() {
        0 => None,
        1 => alts.pop(),
        _ => Some(format!("(?:{})", alts.join("|"))),
    }
}

/// The non-negative integers in `[a, b]`, without leading zeros.
pub(crate) fn pos_range(a: u64, b: u64) -> Option<String> {
    if a > b {
        return None;
    }
    let mut alts = Vec::new();
    let (mut lo, mut digits) = (a, digit_count(a));
    while lo <= b {
        let top = 10u64.saturating_pow(digits as u32).saturating_sub(1);
        let hi = top.min(b);
        alts.push(same_length(&lo.to_string(), &hi.to_string()));
        if hi == b {
            break;
        }
        lo = hi + 1;
        digits += 1;
    }
    Some(if alts.len() == 1 {
        alts.pop().expect("one")
    } else {
        format!("(?:{})", alts.join("|"))
    })
}

fn digit_count(n: u64) -> usize {
    n.checked_ilog10().map_or(1, |l| l as usize + 1)
}

/// The digit strings from `lo` to `hi`, both of the same length.
fn same_length(lo: &str, hi: &str) -> String {
    let (l, h) = (lo.as_bytes(), hi.as_bytes());
    debug_assert_eq!(l.len(), h.len());
    if l.len() == 1 {
        return class(l[0], h[0]);
    }
    let (l0, h0) = (l[0], h[0]);
    let (lr, hr) = (&lo[1..], &hi[1..]);
    if l0 == h0 {
        return format!("{}{}", l0 as char, same_length(lr, hr));
    }
    let n = lr.len();
    let zeros = "0".repeat(n);
    let nines = "9".repeat(n);
    let mut alts = Vec::new();
    // From lo to the end of its leading digit, the whole digits between, then up to hi.
    let (mut from, mut to) = (l0, h0);
    if lr != zeros {
        alts.push(format!("{}{}", l0 as char, same_length(lr, &nines)));
        from += 1;
    }
    let last = if hr != nines {
        to -= 1;
        Some(format!("{}{}", h0 as char, same_length(&zeros, hr)))
    } else {
        None
    };
    if from <= to {
        alts.push(format!("{}[0-9]{{{n}}}", class(from, to)));
    }
    alts.extend(last);
    if alts.len() == 1 {
        alts.pop().expect("one")
    } else {
        format!("(?:{})", alts.join("|"))
    }
}

fn class(lo: u8, hi: u8) -> String {
    if lo == hi {
        (lo as char).to_string()
    } else {
        format!("[{}-{}]", lo as char, hi as char)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn full(re: &str) -> regex::Regex {
        regex::Regex::new(&format!("^(?:{re})$")).unwrap()
    }

    proptest! {
        /// Every integer near the range matches exactly when it is in it, in its JSON spelling;
        /// leading zeros and `-0` never match.
        #[test]
        fn int_ranges_hold_exactly_their_integers(lo in -2000i128..2000, len in 0i128..3000) {
            let hi = lo + len;
            let re = full(&int_range(lo, hi).unwrap());
            for x in lo - 30..=hi + 30 {
                prop_assert_eq!(re.is_match(&x.to_string()), (lo..=hi).contains(&x), "{} in [{}, {}]", x, lo, hi);
            }
            prop_assert!(!re.is_match("-0"));
            let padded = format!("0{}", hi.abs());
            prop_assert!(!re.is_match(&padded));
        }

        #[test]
        fn wide_ranges(lo in 0u64..MAX_MAGNITUDE, span in 0u64..1_000_000_000_000) {
            let hi = (lo + span).min(MAX_MAGNITUDE);
            let re = full(&pos_range(lo, hi).unwrap());
            for x in [lo, hi, lo.saturating_sub(1), hi + 1, lo / 2 + hi / 2] {
                prop_assert_eq!(re.is_match(&x.to_string()), (lo..=hi).contains(&x), "{}", x);
            }
        }
    }

    #[test]
    fn numbers_with_whole_bounds() {
        let check = |lo: i64, hi: i64, text: &str, inside: bool| {
            let m: Map<String, Value> =
                serde_json::from_value(serde_json::json!({"minimum": lo, "maximum": hi})).unwrap();
            let re = full(&number(&m, "#").unwrap().unwrap());
            assert_eq!(re.is_match(text), inside, "{text} in [{lo}, {hi}]");
        };
        check(0, 1, "0.5", true);
        check(0, 1, "1", true);
        check(0, 1, "1.0", true);
        check(0, 1, "1.01", false);
        check(0, 1, "-0.5", false);
        check(-3, -1, "-2.75", true);
        check(-3, -1, "-0.5", false);
        check(-3, -1, "-3.0", true);
        check(-3, -1, "-3.1", false);
        check(-2, 5, "-1.5", true);
        check(-2, 5, "4.999", true);
        check(-2, 5, "5.5", false);
    }
}
