//! Finds special pieces (control, user-defined, unknown) written literally in text: a byte
//! trie answering "the longest special piece starting here", so the text can be cut into raw
//! fragments and atomic special tokens before the subword model sees it.

/// One trie node: sorted children by byte, and the token that ends here, if any.
#[derive(Default)]
struct Node {
    children: Vec<(u8, u32)>,
    token: Option<u32>,
}

/// A byte trie over the special pieces of a vocabulary.
pub(super) struct SpecialMatcher {
    nodes: Vec<Node>,
    /// Child of the root for each first byte (0 = none), so most positions cost one load.
    root: Box<[u32; 256]>,
}

impl SpecialMatcher {
    /// Builds the matcher from (piece text, token id) pairs; empty texts are ignored and a
    /// text given twice keeps the later id (the vocabulary map does the same).
    pub(super) fn new<'a>(pieces: impl IntoIterator<Item = (&'a str, u32)>) -> Self {
        let mut nodes = vec![Node::default()];
        let mut root = Box::new([0u32; 256]);
        for (text, id) in pieces {
            let bytes = text.as_bytes();
            let Some((&first, rest)) = bytes.split_first() else {
                continue;
            };
            let mut node = match root[first as usize] {
                0 => {
                    nodes.push(Node::default());
                    let n = (nodes.len() - 1) as u32;
                    root[first as usize] = n;
                    n
                }
                n => n,
            };
            for &b in rest {
                node = match nodes[node as usize]
                    .children
                    .binary_search_by_key(&b, |&(c, _)| c)
                {
                    Ok(i) => nodes[node as usize].children[i].1,
                    Err(i) => {
                        nodes.push(Node::default());
                        let n = (nodes.len() - 1) as u32;
                        nodes[node as usize].children.insert(i, (b, n));
                        n
                    }
                };
            }
            nodes[node as usize].token = Some(id);
        }
        SpecialMatcher { nodes, root }
    }

    /// The longest special piece that starts at `text[pos..]`: (length in bytes, token id).
    pub(super) fn longest_at(&self, text: &[u8], pos: usize) -> Option<(usize, u32)> {
        let mut node = match self.root[text[pos] as usize] {
            0 => return None,
            n => n,
        };
        let mut best = self.nodes[node as usize].token.map(|id| (1, id));
        for (i, &b) in text[pos + 1..].iter().enumerate() {
            let children = &self.nodes[node as usize].children;
            match children.binary_search_by_key(&b, |&(c, _)| c) {
                Ok(k) => node = children[k].1,
                Err(_) => break,
            }
            if let Some(id) = self.nodes[node as usize].token {
                best = Some((i + 2, id));
            }
        }
        best
    }

    /// Cuts `text` into raw fragments and special tokens, leftmost-longest, in order.
    pub(super) fn split<'t>(&self, text: &'t str) -> Vec<Piece<'t>> {
        let bytes = text.as_bytes();
        let mut out = Vec::new();
        let (mut pos, mut raw_start) = (0, 0);
        while pos < bytes.len() {
            match self.longest_at(bytes, pos) {
                Some((len, id)) => {
                    if raw_start < pos {
                        out.push(Piece::Raw(&text[raw_start..pos]));
                    }
                    out.push(Piece::Special(id));
                    pos += len;
                    raw_start = pos;
                }
                None => pos += 1,
            }
        }
        if raw_start < bytes.len() {
            out.push(Piece::Raw(&text[raw_start..]));
        }
        out
    }
}

/// A part of the input text after special-token splitting.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Piece<'t> {
    /// Ordinary text, to be tokenized by the subword model.
    Raw(&'t str),
    /// A special token written literally in the text.
    Special(u32),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_leftmost_longest() {
        let m = SpecialMatcher::new([("<a>", 1), ("<ab>", 2), ("\n", 3), ("\n\n", 4), ("é", 5)]);
        assert_eq!(
            m.split("x<ab><a>\n\n\ny<a"),
            vec![
                Piece::Raw("x"),
                Piece::Special(2),
                Piece::Special(1),
                Piece::Special(4),
                Piece::Special(3),
                Piece::Raw("y<a"),
            ]
        );
        assert_eq!(
            m.split("aéb"),
            vec![Piece::Raw("a"), Piece::Special(5), Piece::Raw("b")]
        );
        assert_eq!(m.split(""), vec![]);
        assert_eq!(m.split("plain"), vec![Piece::Raw("plain")]);
    }

    #[test]
    fn later_duplicate_wins_and_empty_is_ignored() {
        let m = SpecialMatcher::new([("<x>", 1), ("", 9), ("<x>", 2)]);
        assert_eq!(m.split("<x>"), vec![Piece::Special(2)]);
    }
}
