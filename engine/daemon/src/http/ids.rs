//! The ids the HTTP API hands out for what persists: a response is the state of a context just
//! after that answer, `resp_{context}_{turns}_{check}` (the turns the context held then, and a
//! hash of those before the answer), so an id is checked against the context's own transcript
//! (it survives restarts and `kill -9` with the context, with nothing kept beside it) and names
//! the latest response exactly when the context still has that many turns; a conversation is a
//! context of the app's conversations, `conv_{context}`.

use protocol::Turn;
use sha2::{Digest, Sha256};

/// The check of the turns before an answer.
fn check(turns: &[Turn]) -> String {
    let mut h = Sha256::new();
    for t in turns {
        h.update(t.role.as_bytes());
        h.update([0]);
        h.update(t.text.as_bytes());
        h.update([0]);
    }
    h.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The id of the response that answered after `before` (the context's turns then) in `context`.
pub fn response(context: u64, before: &[Turn]) -> String {
    format!("resp_{context}_{}_{}", before.len() + 1, check(before))
}

/// A response id's context, turn count and check, if it has the shape of one.
fn parse_response(id: &str) -> Option<(u64, usize, &str)> {
    let mut parts = id.strip_prefix("resp_")?.splitn(3, '_');
    let context = parts.next()?.parse().ok()?;
    let turns = parts.next()?.parse().ok()?;
    let check = parts.next()?;
    (turns >= 1).then_some((context, turns, check))
}

/// The context a response id names (none if it has not the shape of one).
pub fn response_context(id: &str) -> Option<u64> {
    parse_response(id).map(|(c, ..)| c)
}

/// Where the response `id` is in its context's `turns`: `Some(n)`, the context's turns just after
/// it, if the context holds it; `None` if the transcript is not the one the id was made from.
pub fn locate(id: &str, turns: &[Turn]) -> Option<usize> {
    let (_, n, want) = parse_response(id)?;
    (n <= turns.len() && check(&turns[..n - 1]) == want).then_some(n)
}

/// A message or function call item's id within response `id`.
pub fn item(prefix: &str, response: &str) -> String {
    format!(
        "{prefix}_{}",
        response.strip_prefix("resp_").unwrap_or(response)
    )
}

pub fn conversation(context: u64) -> String {
    format!("conv_{context}")
}

pub fn conversation_context(id: &str) -> Option<u64> {
    id.strip_prefix("conv_")?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::wire::turn;

    #[test]
    fn a_response_id_names_one_state_of_one_transcript() {
        let t = vec![
            turn("user", "a"),
            turn("assistant", "b"),
            turn("user", "c"),
            turn("assistant", "d"),
        ];
        let first = response(7, &t[..1]);
        let second = response(7, &t[..3]);
        assert_eq!(response_context(&first), Some(7));
        assert_eq!(locate(&first, &t), Some(2));
        assert_eq!(locate(&second, &t), Some(4));
        assert_eq!(locate(&second, &t[..2]), None, "not reached yet");
        let other = vec![turn("user", "x"), turn("assistant", "b")];
        assert_eq!(
            locate(&first, &other),
            None,
            "another conversation in a reused id"
        );
        for bad in ["resp_", "resp_x_1_aa", "resp_1_0_aa", "conv_1", ""] {
            assert_eq!(locate(bad, &t), None, "{bad}");
        }
        assert_eq!(conversation_context(&conversation(9)), Some(9));
        assert_eq!(conversation_context("conv_x"), None);
    }
}
