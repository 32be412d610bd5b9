//! A regular expression as a byte automaton: regex-automata determinizes it (anchored, every
//! match kept, so its language is the regex's whole-text matches), and its states are copied
//! into a flat table with what decoding asks of each: where a byte leads, whether the text may
//! end here, how many bytes at least to an end, and whether any byte leads on.
//! States from which no end is reachable are folded into the dead state.

use std::collections::{HashMap, VecDeque};

use regex_automata::dfa::{Automaton, StartKind, dense};
use regex_automata::nfa::thompson;
use regex_automata::util::primitives::StateID;
use regex_automata::util::syntax;
use regex_automata::{Anchored, Input, MatchKind};

/// The dead state: no text that goes through it matches.
pub(crate) const DEAD: u32 = u32::MAX;

/// What the automaton may take: the DFA's bytes, and the states of the table.
const DFA_BYTES: usize = 64 << 20;
const MAX_STATES: usize = 1 << 20;

/// Why a regex gives no automaton.
#[derive(Debug)]
pub(crate) enum BuildError {
    /// The regex does not compile (syntax, or a feature a DFA cannot run).
    Regex(String),
    /// The automaton would be larger than the limits.
    TooLarge(String),
    /// No text matches.
    Empty,
}

/// A DFA over bytes as a flat table.
#[derive(Debug)]
pub(crate) struct Table {
    /// Each byte's class: bytes of a class lead the same way from every state.
    classes: [u8; 256],
    stride: usize,
    /// `next[state * stride + class]`: the next state, or [`DEAD`].
    next: Vec<u32>,
    /// Whether the text may end in the state.
    pub(crate) accept: Vec<bool>,
    /// Fewest bytes from the state to an end.
    pub(crate) dist: Vec<u32>,
    /// Whether some byte leads on from the state.
    pub(crate) way_on: Vec<bool>,
    pub(crate) start: u32,
    /// The largest `dist`.
    pub(crate) max_dist: u32,
}

impl Table {
    pub(crate) fn build(pattern: &str) -> Result<Table, BuildError> {
        let dfa = determinize(pattern)?;
        let (classes, stride, next, accept) = flatten(&dfa)?;
        Table::with_distances(classes, stride, next, accept)
    }
}

/// The regex as regex-automata's dense DFA: anchored, every match kept, within the limits.
fn determinize(pattern: &str) -> Result<dense::DFA<Vec<u32>>, BuildError> {
    dense::Builder::new()
        .configure(
            dense::Config::new()
                .match_kind(MatchKind::All)
                .start_kind(StartKind::Anchored)
                .byte_classes(true)
                .dfa_size_limit(Some(DFA_BYTES))
                .determinize_size_limit(Some(DFA_BYTES)),
        )
        .syntax(syntax::Config::new().unicode(true).utf8(true))
        .thompson(
            thompson::Config::new()
                .which_captures(thompson::WhichCaptures::None)
                .nfa_size_limit(Some(DFA_BYTES)),
        )
        .build(pattern)
        .map_err(|e| {
            // The cause is in the error's sources ("error building NFA": "exceeded size
            // limit...").
            let mut text = e.to_string();
            let mut source = std::error::Error::source(&e);
            while let Some(s) = source {
                text = format!("{text}: {s}");
                source = s.source();
            }
            if text.contains("limit") {
                BuildError::TooLarge(text)
            } else {
                BuildError::Regex(text)
            }
        })
}

/// A flat transition table.
type Flat = ([u8; 256], usize, Vec<u32>, Vec<bool>);

/// The DFA's states reachable from its start, numbered breadth-first: each byte's class, the
/// stride, the transitions and whether each state accepts.
fn flatten(dfa: &dense::DFA<Vec<u32>>) -> Result<Flat, BuildError> {
    let start = dfa
        .start_state_forward(&Input::new(&[][..]).anchored(Anchored::Yes))
        .map_err(|e| BuildError::Regex(e.to_string()))?;
    let bc = dfa.byte_classes();
    let stride = bc.alphabet_len() - 1;
    let mut classes = [0u8; 256];
    let mut reps = vec![0u8; stride];
    for b in 0..=255u8 {
        let c = bc.get(b);
        classes[b as usize] = c;
        reps[c as usize] = b;
    }
    // Breadth-first from the start: the DFA's states in the table's numbering.
    let mut index: HashMap<StateID, u32> = HashMap::new();
    let mut order: Vec<StateID> = Vec::new();
    let mut queue = VecDeque::new();
    let gone = |s: StateID| dfa.is_dead_state(s) || dfa.is_quit_state(s);
    if gone(start) {
        return Err(BuildError::Empty);
    }
    index.insert(start, 0);
    order.push(start);
    queue.push_back(start);
    let mut next = Vec::new();
    while let Some(s) = queue.pop_front() {
        for &b in &reps {
            let n = dfa.next_state(s, b);
            let id = if gone(n) {
                DEAD
            } else {
                *index.entry(n).or_insert_with(|| {
                    order.push(n);
                    queue.push_back(n);
                    (order.len() - 1) as u32
                })
            };
            next.push(id);
        }
        if order.len() > MAX_STATES {
            return Err(BuildError::TooLarge(format!(
                "more than {MAX_STATES} automaton states"
            )));
        }
    }
    let accept: Vec<bool> = order
        .iter()
        .map(|&s| dfa.is_match_state(dfa.next_eoi_state(s)))
        .collect();
    Ok((classes, stride, next, accept))
}

impl Table {
    /// The table with each state's distance to an end; states that reach none become dead.
    fn with_distances(
        classes: [u8; 256],
        stride: usize,
        mut next: Vec<u32>,
        accept: Vec<bool>,
    ) -> Result<Table, BuildError> {
        let n = accept.len();
        // Fewest bytes to an end: breadth-first backwards from the accepting states.
        let mut back: Vec<Vec<u32>> = vec![Vec::new(); n];
        for s in 0..n {
            for &t in &next[s * stride..(s + 1) * stride] {
                if t != DEAD {
                    back[t as usize].push(s as u32);
                }
            }
        }
        let mut dist = vec![u32::MAX; n];
        let mut queue: VecDeque<u32> = VecDeque::new();
        for s in 0..n {
            if accept[s] {
                dist[s] = 0;
                queue.push_back(s as u32);
            }
        }
        while let Some(s) = queue.pop_front() {
            for &p in &back[s as usize] {
                if dist[p as usize] == u32::MAX {
                    dist[p as usize] = dist[s as usize] + 1;
                    queue.push_back(p);
                }
            }
        }
        if dist[0] == u32::MAX {
            return Err(BuildError::Empty);
        }
        // A state that reaches no end is as good as dead.
        for t in next.iter_mut() {
            if *t != DEAD && dist[*t as usize] == u32::MAX {
                *t = DEAD;
            }
        }
        let way_on = (0..n)
            .map(|s| {
                next[s * stride..(s + 1) * stride]
                    .iter()
                    .any(|&t| t != DEAD)
            })
            .collect();
        let max_dist = dist
            .iter()
            .filter(|&&d| d != u32::MAX)
            .max()
            .copied()
            .unwrap_or(0);
        Ok(Table {
            classes,
            stride,
            next,
            accept,
            dist,
            way_on,
            start: 0,
            max_dist,
        })
    }

    /// Where `byte` leads from `state` ([`DEAD`] if nowhere).
    #[inline]
    pub(crate) fn step(&self, state: u32, byte: u8) -> u32 {
        self.next[state as usize * self.stride + self.classes[byte as usize] as usize]
    }

    /// Where `bytes` lead from `state`.
    pub(crate) fn walk(&self, mut state: u32, bytes: &[u8]) -> u32 {
        for &b in bytes {
            state = self.step(state, b);
            if state == DEAD {
                break;
            }
        }
        state
    }

    /// Whether the whole of `text` is in the language.
    pub(crate) fn matches(&self, text: &[u8]) -> bool {
        let s = self.walk(self.start, text);
        s != DEAD && self.accept[s as usize]
    }

    pub(crate) fn states(&self) -> usize {
        self.accept.len()
    }

    /// Bytes the table holds.
    pub(crate) fn bytes(&self) -> usize {
        self.next.len() * 4 + self.accept.len() * 6
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_text_matches_with_distances() {
        let t = Table::build("a|ab|abc+").unwrap();
        for (text, ok) in [
            ("a", true),
            ("ab", true),
            ("abc", true),
            ("abccc", true),
            ("", false),
            ("abd", false),
            ("b", false),
        ] {
            assert_eq!(t.matches(text.as_bytes()), ok, "{text}");
        }
        assert_eq!(t.dist[t.start as usize], 1);
        let t = Table::build("x{5}").unwrap();
        assert_eq!((t.dist[0], t.max_dist), (5, 5));
        let end = t.walk(t.start, b"xxxxx");
        assert!(t.accept[end as usize] && !t.way_on[end as usize]);
        assert!(matches!(Table::build("a["), Err(BuildError::Regex(_))));
        assert!(matches!(Table::build("[a&&b]"), Err(BuildError::Empty)));
    }
}
