//! Finding special tokens in text: user-defined tokens always, control tokens when asked, the
//! leftmost first and the longest of those that start there.

use super::TokenType;

/// The special tokens of a vocabulary, grouped by their first byte so a scan of the text looks
/// only at the tokens that can start where it stands.
pub(crate) struct Specials {
    /// For each first byte: (spelling, id, is control), longest first, ties by id.
    by_first: Vec<Vec<(Box<str>, u32, bool)>>,
}

impl Specials {
    /// The control and user-defined tokens of the vocabulary (empty spellings cannot be matched).
    pub(crate) fn new(tokens: &[String], types: &[TokenType]) -> Specials {
        let mut by_first: Vec<Vec<(Box<str>, u32, bool)>> = vec![Vec::new(); 256];
        for (id, (t, ty)) in tokens.iter().zip(types).enumerate() {
            let control = match ty {
                TokenType::Control => true,
                TokenType::UserDefined => false,
                _ => continue,
            };
            if let Some(&first) = t.as_bytes().first() {
                by_first[first as usize].push((t.as_str().into(), id as u32, control));
            }
        }
        for list in &mut by_first {
            list.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        }
        Specials { by_first }
    }

    /// The earliest special token in `text` (the longest one where several start at the same
    /// place): its byte offset, length and id. Control tokens count only if `control`.
    pub(crate) fn find(&self, text: &str, control: bool) -> Option<(usize, usize, u32)> {
        let bytes = text.as_bytes();
        for (at, &b) in bytes.iter().enumerate() {
            for (s, id, is_control) in &self.by_first[b as usize] {
                if (control || !is_control) && bytes[at..].starts_with(s.as_bytes()) {
                    return Some((at, s.len(), *id));
                }
            }
        }
        None
    }
}
