//! A string schema's `pattern`: the pattern rewritten to match the JSON text of the strings it
//! matches, so the string's value (not its escaped spelling) is what matches.
//!
//! Literal characters that JSON escapes (`"`, `\`, control characters) become their escapes;
//! classes lose those characters (so what a class matches never needs an escape). A pattern
//! matches anywhere in the string unless it is anchored with `^` and `$`; anchors or word
//! boundaries inside it are not implemented.

use regex_syntax::hir::{Class, ClassUnicode, ClassUnicodeRange, Hir, HirKind, Look, Repetition};

use crate::GuideError;

/// A JSON string's character: anything but `"`, `\` and control characters, or an escape
/// (`\uXXXX` for any code point but a surrogate, so each escape is one character).
pub(crate) const CHAR: &str = r#"(?:[^"\\\x00-\x1F]|\\["\\/bfnrt]|\\u(?:[0-9A-Ca-c][0-9A-Fa-f]{3}|[Dd][0-7][0-9A-Fa-f]{2}|[EFef][0-9A-Fa-f]{3}))"#;

/// The regex of a JSON string, quotes included, whose value matches `pattern`.
pub(crate) fn string_pattern(pattern: &str, at: &str) -> Result<String, GuideError> {
    let hir = regex_syntax::ParserBuilder::new()
        .build()
        .parse(pattern)
        .map_err(|e| GuideError::InvalidSchema {
            at: at.to_owned(),
            what: format!("pattern {pattern:?} does not compile: {e}"),
        })?;
    let (start, end, body) = split_anchors(hir);
    let body = rewrite(&body, at)?;
    let open = if start { "" } else { "(?:{CHAR})*" };
    let close = if end { "" } else { "(?:{CHAR})*" };
    let (open, close) = (open.replace("{CHAR}", CHAR), close.replace("{CHAR}", CHAR));
    Ok(format!(r#""{open}(?:{body}){close}""#))
}

/// Takes `^` off the front and `$` off the end of a pattern, saying which were there.
fn split_anchors(hir: Hir) -> (bool, bool, Hir) {
    let is = |h: &Hir, l: Look| matches!(h.kind(), HirKind::Look(x) if *x == l);
    if is(&hir, Look::Start) {
        return (true, false, Hir::empty());
    }
    if is(&hir, Look::End) {
        return (false, true, Hir::empty());
    }
    let HirKind::Concat(parts) = hir.kind() else {
        return (false, false, hir);
    };
    let mut parts = parts.clone();
    let start = parts.first().is_some_and(|h| is(h, Look::Start));
    if start {
        parts.remove(0);
    }
    let end = parts.last().is_some_and(|h| is(h, Look::End));
    if end {
        parts.pop();
    }
    (start, end, Hir::concat(parts))
}

/// The characters a JSON string spells with an escape.
fn escaped() -> ClassUnicode {
    ClassUnicode::new([
        ClassUnicodeRange::new('\0', '\x1f'),
        ClassUnicodeRange::new('"', '"'),
        ClassUnicodeRange::new('\\', '\\'),
    ])
}

fn rewrite(h: &Hir, at: &str) -> Result<Hir, GuideError> {
    Ok(match h.kind() {
        HirKind::Empty => Hir::empty(),
        HirKind::Literal(lit) => {
            let text = std::str::from_utf8(&lit.0).map_err(|_| not_utf8(at))?;
            let mut spelled = String::with_capacity(text.len());
            for c in text.chars() {
                match c {
                    '"' => spelled.push_str("\\\""),
                    '\\' => spelled.push_str("\\\\"),
                    c if (c as u32) < 0x20 => spelled.push_str(&format!("\\u{:04x}", c as u32)),
                    c => spelled.push(c),
                }
            }
            Hir::literal(spelled.into_bytes())
        }
        HirKind::Class(Class::Unicode(c)) => {
            let mut c = c.clone();
            c.difference(&escaped());
            Hir::class(Class::Unicode(c))
        }
        HirKind::Class(Class::Bytes(b)) => {
            let mut c = b.to_unicode_class().ok_or_else(|| not_utf8(at))?;
            c.difference(&escaped());
            Hir::class(Class::Unicode(c))
        }
        HirKind::Look(_) => {
            return Err(GuideError::Unsupported {
                keyword: "pattern".into(),
                at: at.into(),
                why: "anchors or word boundaries other than a leading ^ and a trailing $".into(),
            });
        }
        HirKind::Repetition(r) => Hir::repetition(Repetition {
            sub: Box::new(rewrite(&r.sub, at)?),
            ..r.clone()
        }),
        HirKind::Capture(c) => rewrite(&c.sub, at)?,
        HirKind::Concat(v) => {
            Hir::concat(v.iter().map(|x| rewrite(x, at)).collect::<Result<_, _>>()?)
        }
        HirKind::Alternation(v) => {
            Hir::alternation(v.iter().map(|x| rewrite(x, at)).collect::<Result<_, _>>()?)
        }
    })
}

fn not_utf8(at: &str) -> GuideError {
    GuideError::InvalidSchema {
        at: at.to_owned(),
        what: "pattern matches bytes that are not UTF-8".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether the JSON text `json` (a string) is matched by the pattern's rewrite.
    fn check(pattern: &str, json: &str, expected: bool) {
        let re = string_pattern(pattern, "#").unwrap();
        let re = regex::Regex::new(&format!("^(?:{re})$")).unwrap();
        assert_eq!(re.is_match(json), expected, "{pattern} on {json}: {re}");
    }

    #[test]
    fn patterns_match_the_strings_value() {
        check("^[a-z]+$", r#""abc""#, true);
        check("^[a-z]+$", r#""ab1""#, false);
        check("^a.c$", r#""a\"c""#, false);
        check("^a.c$", r#""abc""#, true);
        check(r#"^"x"$"#, r#""\"x\"""#, true);
        check(r"^a\\b$", r#""a\\b""#, true);
        check("b", r#""abc""#, true);
        check("b", r#""ac""#, false);
        check(r"^\d{3}-\d{4}$", r#""555-1234""#, true);
        check("^(foo|bar)$", r#""bar""#, true);
    }

    #[test]
    fn inner_anchors_are_refused() {
        let e = string_pattern(r"a\bb", "#/p").unwrap_err();
        assert!(matches!(e, GuideError::Unsupported { ref keyword, .. } if keyword == "pattern"));
        assert!(matches!(
            string_pattern("(", "#").unwrap_err(),
            GuideError::InvalidSchema { .. }
        ));
    }
}
