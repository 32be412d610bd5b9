//! The vocabulary as a byte trie in preorder: which tokens an automaton state allows is found by
//! one scan that walks shared prefixes once and skips a whole subtree at the first dead byte.

/// Tokens longer than this are left out of structured answers (none of the known vocabularies
/// has one).
pub const MAX_TOKEN_BYTES: usize = 255;

/// A trie node: the byte that leads to it, its depth (its prefix's length), and where its
/// subtree ends in the preorder.
#[derive(Clone, Copy, Debug)]
struct Node {
    end: u32,
    /// The first of this node's tokens in `Vocab::tokens` (they run to the next node's).
    first_token: u32,
    depth: u8,
    byte: u8,
}

/// The tokens a structured answer may use, by their bytes.
#[derive(Debug)]
pub struct Vocab {
    size: usize,
    /// Each id's bytes: `bytes[offsets[id]..offsets[id + 1]]` (empty for ids left out).
    offsets: Vec<u32>,
    bytes: Vec<u8>,
    nodes: Vec<Node>,
    tokens: Vec<u32>,
    max_depth: usize,
}

impl Vocab {
    /// The vocabulary of `size` ids, of which `tokens` (id and bytes) may appear in answers:
    /// the text tokens, not control tokens. Empty tokens and tokens longer than
    /// [`MAX_TOKEN_BYTES`] are left out.
    pub fn new<'a>(size: usize, tokens: impl IntoIterator<Item = (u32, &'a [u8])>) -> Vocab {
        let mut list: Vec<(&[u8], u32)> = tokens
            .into_iter()
            .filter(|(id, b)| !b.is_empty() && b.len() <= MAX_TOKEN_BYTES && (*id as usize) < size)
            .map(|(id, b)| (b, id))
            .collect();
        let mut by_id: Vec<&[u8]> = vec![&[]; size];
        for &(b, id) in &list {
            by_id[id as usize] = b;
        }
        let mut offsets = Vec::with_capacity(size + 1);
        let mut all = Vec::new();
        offsets.push(0);
        for b in by_id {
            all.extend_from_slice(b);
            offsets.push(all.len() as u32);
        }
        list.sort_unstable();
        let mut nodes: Vec<Node> = Vec::with_capacity(list.len() * 2);
        let mut ids = Vec::with_capacity(list.len());
        // The open path: node indices from depth 1 down.
        let mut path: Vec<usize> = Vec::new();
        let mut prev: &[u8] = &[];
        for (bytes, id) in list {
            let common = prev
                .iter()
                .zip(bytes)
                .take_while(|(a, b)| a == b)
                .count()
                .min(path.len());
            for i in path.drain(common..) {
                nodes[i].end = nodes.len() as u32;
            }
            for (d, &b) in bytes.iter().enumerate().skip(common) {
                path.push(nodes.len());
                nodes.push(Node {
                    end: 0,
                    first_token: ids.len() as u32,
                    depth: (d + 1) as u8,
                    byte: b,
                });
            }
            ids.push(id);
            prev = bytes;
        }
        for i in path.drain(..) {
            nodes[i].end = nodes.len() as u32;
        }
        let max_depth = nodes.iter().map(|n| n.depth as usize).max().unwrap_or(0);
        Vocab {
            size,
            offsets,
            bytes: all,
            nodes,
            tokens: ids,
            max_depth,
        }
    }

    /// Ids in the vocabulary (those that never appear in answers included).
    pub fn size(&self) -> usize {
        self.size
    }

    /// The bytes of token `id` (empty if it never appears in answers).
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        match (
            self.offsets.get(id as usize),
            self.offsets.get(id as usize + 1),
        ) {
            (Some(&a), Some(&b)) => &self.bytes[a as usize..b as usize],
            _ => &[],
        }
    }

    /// Tokens that may appear in answers.
    pub fn text_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Trie nodes.
    pub fn nodes(&self) -> usize {
        self.nodes.len()
    }

    /// Calls `allow(token, state)` for every token whose bytes `step` takes from `start` to a
    /// live state (`step` gives `None` for a dead one), with the state it ends in.
    pub(crate) fn walk(
        &self,
        start: u32,
        step: impl Fn(u32, u8) -> Option<u32>,
        mut allow: impl FnMut(u32, u32),
    ) {
        let mut states = vec![0u32; self.max_depth + 1];
        states[0] = start;
        let mut i = 0;
        let n = self.nodes.len();
        while i < n {
            let node = self.nodes[i];
            let Some(s) = step(states[node.depth as usize - 1], node.byte) else {
                i = node.end as usize;
                continue;
            };
            states[node.depth as usize] = s;
            let last = self
                .nodes
                .get(i + 1)
                .map_or(self.tokens.len(), |x| x.first_token as usize);
            for &t in &self.tokens[node.first_token as usize..last] {
                allow(t, s);
            }
            i += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The trie's walk finds exactly the tokens a naive check of each token finds.
    #[test]
    fn the_walk_finds_what_a_token_by_token_check_finds() {
        let words: Vec<&[u8]> = vec![
            b"a", b"ab", b"abc", b"b", b"ba", b"abd", b"ab", b"", b"zz", b"a\xff", b"c",
        ];
        let v = Vocab::new(
            words.len() + 2,
            words.iter().enumerate().map(|(i, w)| (i as u32, *w)),
        );
        // States: the length of an "ab..." prefix read so far (only a, then b, then c or d).
        let step = |s: u32, b: u8| match (s, b) {
            (0, b'a') => Some(1),
            (1, b'b') => Some(2),
            (2, b'c') | (2, b'd') => Some(3),
            _ => None,
        };
        let mut got = Vec::new();
        v.walk(0, step, |t, s| got.push((t, s)));
        got.sort();
        let mut want = Vec::new();
        for (i, w) in words.iter().enumerate() {
            if w.is_empty() {
                continue;
            }
            let mut s = Some(0);
            for &b in *w {
                s = s.and_then(|s| step(s, b));
            }
            if let Some(s) = s {
                want.push((i as u32, s));
            }
        }
        want.sort();
        assert_eq!(got, want);
        assert_eq!(v.text_tokens(), words.len() - 1);
    }
}
