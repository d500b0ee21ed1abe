//! SentencePiece-BPE (score-ordered merges with byte fallback), the algorithm llama.cpp runs for
//! `tokenizer.ggml.model == "llama"` vocabularies (gemma3.md §4.2).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use super::special::{Piece, SpecialMatcher};
use super::TokenKind;
use crate::gguf::{GgufFile, MetaValue};
use crate::{Error, Result};

/// The SentencePiece marker that stands for a space inside pieces.
const SPACE_MARK: char = '\u{2581}';

/// A SentencePiece vocabulary with everything encoding needs precomputed.
pub(super) struct SpmModel {
    pieces: Vec<String>,
    scores: Vec<f32>,
    kinds: Vec<TokenKind>,
    ids: HashMap<String, u32>,
    byte_ids: Box<[Option<u32>; 256]>,
    specials: SpecialMatcher,
    unk: Option<u32>,
    add_space_prefix: bool,
}

impl SpmModel {
    /// Builds the model from pieces, scores and kinds (all the same length).
    pub(super) fn new(
        pieces: Vec<String>,
        scores: Vec<f32>,
        kinds: Vec<TokenKind>,
        unk: Option<u32>,
        add_space_prefix: bool,
    ) -> Result<Self> {
        if scores.len() != pieces.len() || kinds.len() != pieces.len() {
            return Err(Error::Tokenizer(format!(
                "vocabulary has {} pieces but {} scores and {} token types",
                pieces.len(),
                scores.len(),
                kinds.len()
            )));
        }
        if let Some(u) = unk.filter(|&u| u as usize >= pieces.len()) {
            return Err(Error::Tokenizer(format!(
                "unknown-token id {u} is outside the vocabulary of {} pieces",
                pieces.len()
            )));
        }
        let mut ids = HashMap::with_capacity(pieces.len());
        let mut byte_ids = Box::new([None; 256]);
        for (id, (piece, kind)) in pieces.iter().zip(&kinds).enumerate() {
            let id = id as u32;
            ids.insert(piece.clone(), id);
            if *kind == TokenKind::Byte {
                let byte = parse_byte_piece(piece).ok_or_else(|| {
                    Error::Tokenizer(format!(
                        "token {id} has the byte type but its text {piece:?} is not <0xXX>"
                    ))
                })?;
                byte_ids[byte as usize] = Some(id);
            }
        }
        // Special pieces are matched on the whitespace-escaped text, as SentencePiece matches
        // user-defined pieces; GGUF converters store user-defined pieces with bare spaces.
        let special_texts: Vec<(String, u32)> = pieces
            .iter()
            .zip(&kinds)
            .enumerate()
            .filter(|(_, (_, k))| k.is_special())
            .map(|(id, (p, _))| (escape(p), id as u32))
            .collect();
        let specials = SpecialMatcher::new(special_texts.iter().map(|(p, id)| (p.as_str(), *id)));
        Ok(SpmModel {
            pieces,
            scores,
            kinds,
            ids,
            byte_ids,
            specials,
            unk,
            add_space_prefix,
        })
    }

    /// Reads `tokenizer.ggml.{tokens,scores,token_type,unknown_token_id,add_space_prefix}`.
    pub(super) fn from_gguf(gguf: &GgufFile) -> Result<Self> {
        let where_ = gguf.path().display();
        let pieces = gguf_pieces(gguf)?;
        let scores = match gguf.get_array("tokenizer.ggml.scores")? {
            Some(a) => a
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    v.as_f64().map(|s| s as f32).ok_or_else(|| {
                        Error::Tokenizer(format!(
                            "{where_}: tokenizer.ggml.scores[{i}] is a {}, not a number",
                            v.type_name()
                        ))
                    })
                })
                .collect::<Result<Vec<_>>>()?,
            None => vec![0.0; pieces.len()],
        };
        let kinds = gguf_kinds(gguf, pieces.len())?;
        let unk = gguf
            .get_u64("tokenizer.ggml.unknown_token_id")?
            .map(|u| u as u32);
        let add_space_prefix = gguf
            .get_bool("tokenizer.ggml.add_space_prefix")?
            .unwrap_or(true);
        Self::new(pieces, scores, kinds, unk, add_space_prefix).map_err(|e| match e {
            Error::Tokenizer(m) => Error::Tokenizer(format!("{where_}: {m}")),
            other => other,
        })
    }

    /// Number of pieces.
    pub(super) fn len(&self) -> usize {
        self.pieces.len()
    }

    /// The id of a piece text.
    pub(super) fn id(&self, piece: &str) -> Option<u32> {
        self.ids.get(piece).copied()
    }

    /// The piece text of an id.
    pub(super) fn piece(&self, id: u32) -> Option<&str> {
        self.pieces.get(id as usize).map(String::as_str)
    }

    /// The kind of an id.
    pub(super) fn kind(&self, id: u32) -> Option<TokenKind> {
        self.kinds.get(id as usize).copied()
    }

    /// Appends the ids of `text` to `out`: spaces escaped as `▁`, special pieces cut out,
    /// each remaining fragment merged by score.
    pub(super) fn encode(&self, text: &str, out: &mut Vec<u32>) {
        let escaped = escape(text);
        let mut prev_special = true;
        let mut buf = String::new();
        for part in self.specials.split(&escaped) {
            match part {
                Piece::Special(id) => {
                    out.push(id);
                    prev_special = true;
                }
                Piece::Raw(raw) if self.add_space_prefix && prev_special => {
                    buf.clear();
                    buf.push(SPACE_MARK);
                    buf.push_str(raw);
                    self.encode_fragment(&buf, out);
                    prev_special = false;
                }
                Piece::Raw(raw) => {
                    self.encode_fragment(raw, out);
                    prev_special = false;
                }
            }
        }
    }

    /// Merges one whitespace-escaped fragment and appends its ids.
    fn encode_fragment(&self, text: &str, out: &mut Vec<u32>) {
        let mut syms: Vec<Symbol> = text
            .char_indices()
            .map(|(start, c)| Symbol {
                start,
                end: start + c.len_utf8(),
                prev: usize::MAX,
                next: usize::MAX,
            })
            .collect();
        let n = syms.len();
        for (i, s) in syms.iter_mut().enumerate() {
            s.prev = if i == 0 { usize::MAX } else { i - 1 };
            s.next = if i + 1 == n { usize::MAX } else { i + 1 };
        }
        let mut queue = BinaryHeap::new();
        for i in 1..n {
            self.push_candidate(text, &syms, i - 1, i, &mut queue);
        }
        while let Some(c) = queue.pop() {
            let (l, r) = (&syms[c.left], &syms[c.right]);
            if l.next != c.right || r.end - l.start != c.len || l.end == l.start {
                continue; // stale: one side changed since it was queued
            }
            let (new_end, new_next) = (r.end, r.next);
            syms[c.left].end = new_end;
            syms[c.left].next = new_next;
            syms[c.right].end = syms[c.right].start;
            if new_next != usize::MAX {
                syms[new_next].prev = c.left;
                self.push_candidate(text, &syms, c.left, new_next, &mut queue);
            }
            let prev = syms[c.left].prev;
            if prev != usize::MAX {
                self.push_candidate(text, &syms, prev, c.left, &mut queue);
            }
        }
        let mut i = if n == 0 { usize::MAX } else { 0 };
        while i != usize::MAX {
            let s = &syms[i];
            let piece = &text[s.start..s.end];
            match self.ids.get(piece) {
                Some(&id) => out.push(id),
                None => self.push_bytes(piece, out),
            }
            i = s.next;
        }
    }

    /// Byte fallback: one `<0xXX>` piece per byte, `<unk>` where such a piece is missing.
    fn push_bytes(&self, piece: &str, out: &mut Vec<u32>) {
        for &b in piece.as_bytes() {
            if let Some(id) = self.byte_ids[b as usize].or(self.unk) {
                out.push(id);
            }
        }
    }

    fn push_candidate(
        &self,
        text: &str,
        syms: &[Symbol],
        left: usize,
        right: usize,
        queue: &mut BinaryHeap<Candidate>,
    ) {
        let (start, end) = (syms[left].start, syms[right].end);
        if let Some(&id) = self.ids.get(&text[start..end]) {
            queue.push(Candidate {
                score: self.scores[id as usize],
                left,
                right,
                len: end - start,
            });
        }
    }

    /// The bytes a token stands for when decoding (nothing for control and unused tokens).
    pub(super) fn token_bytes(&self, id: u32, out: &mut Vec<u8>) {
        let Some(kind) = self.kind(id) else {
            out.extend_from_slice("\u{FFFD}".as_bytes());
            return;
        };
        let piece = &self.pieces[id as usize];
        match kind {
            TokenKind::Byte => out.extend(parse_byte_piece(piece)),
            TokenKind::Normal | TokenKind::UserDefined => {
                for c in piece.chars() {
                    let c = if c == SPACE_MARK { ' ' } else { c };
                    out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes());
                }
            }
            TokenKind::Control | TokenKind::Unknown | TokenKind::Unused => {}
        }
    }
}

/// One symbol of a fragment being merged: a byte range of the escaped text in a linked list.
struct Symbol {
    start: usize,
    end: usize,
    prev: usize,
    next: usize,
}

/// A possible merge of two adjacent symbols.
struct Candidate {
    score: f32,
    left: usize,
    right: usize,
    len: usize,
}

impl Ord for Candidate {
    /// Higher score first, then the leftmost pair.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Candidate {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Candidate {}

/// `text` with every space replaced by the `▁` marker.
fn escape(text: &str) -> String {
    text.replace(' ', "\u{2581}")
}

/// The byte of a `<0xXX>` piece.
fn parse_byte_piece(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// `tokenizer.ggml.tokens`: the vocabulary's strings, by id.
pub(super) fn gguf_pieces(gguf: &GgufFile) -> Result<Vec<String>> {
    let where_ = gguf.path().display();
    let tokens = gguf
        .get_array("tokenizer.ggml.tokens")?
        .ok_or_else(|| Error::Tokenizer(format!("{where_}: no tokenizer.ggml.tokens")))?;
    tokens
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_str().map(str::to_owned).ok_or_else(|| {
                Error::Tokenizer(format!(
                    "{where_}: tokenizer.ggml.tokens[{i}] is a {}, not a string",
                    v.type_name()
                ))
            })
        })
        .collect()
}

/// `tokenizer.ggml.token_type` for `n` tokens (all normal when absent); an array of another
/// length is an error.
pub(super) fn gguf_kinds(gguf: &GgufFile, n: usize) -> Result<Vec<TokenKind>> {
    let where_ = gguf.path().display();
    let Some(a) = gguf.get_array("tokenizer.ggml.token_type")? else {
        return Ok(vec![TokenKind::Normal; n]);
    };
    if a.len() != n {
        return Err(Error::Tokenizer(format!(
            "{where_}: {} token types for {n} tokens",
            a.len()
        )));
    }
    a.iter()
        .enumerate()
        .map(|(i, v)| {
            kind_from_meta(v).map_err(|e| {
                Error::Tokenizer(format!("{where_}: tokenizer.ggml.token_type[{i}]: {e}"))
            })
        })
        .collect()
}

/// A GGUF token type (llama.cpp numbering; 0 = undefined is read as normal).
fn kind_from_meta(v: &MetaValue) -> std::result::Result<TokenKind, String> {
    match v.as_i64() {
        Some(0 | 1) => Ok(TokenKind::Normal),
        Some(2) => Ok(TokenKind::Unknown),
        Some(3) => Ok(TokenKind::Control),
        Some(4) => Ok(TokenKind::UserDefined),
        Some(5) => Ok(TokenKind::Unused),
        Some(6) => Ok(TokenKind::Byte),
        Some(t) => Err(format!("unknown token type {t}")),
        None => Err(format!("is a {}, not an integer", v.type_name())),
    }
}

/// A tiny vocabulary for unit tests: all bytes, 'a'..'c', a few merges, one control and one
/// user-defined piece.
#[cfg(test)]
pub(super) fn tiny_model(add_space_prefix: bool) -> SpmModel {
    let mut pieces: Vec<String> = vec!["<unk>".into(), "<s>".into(), "<ctl>".into()];
    let mut kinds = vec![TokenKind::Unknown, TokenKind::Control, TokenKind::Control];
    for b in 0..=255u8 {
        pieces.push(format!("<0x{b:02X}>"));
        kinds.push(TokenKind::Byte);
    }
    for (p, k) in [
        ("a", TokenKind::Normal),
        ("b", TokenKind::Normal),
        ("c", TokenKind::Normal),
        ("▁", TokenKind::Normal),
        ("ab", TokenKind::Normal),
        ("bc", TokenKind::Normal),
        ("ba", TokenKind::Normal),
        ("abc", TokenKind::Normal),
        ("▁a", TokenKind::Normal),
        ("\n\n", TokenKind::UserDefined),
        ("  ", TokenKind::UserDefined),
    ] {
        pieces.push(p.into());
        kinds.push(k);
    }
    let scores = pieces
        .iter()
        .map(|p| match p.as_str() {
            "ab" | "ba" => -1.0,
            "bc" => -0.5,
            "abc" => -3.0,
            "▁a" => -2.0,
            _ => -10.0,
        })
        .collect();
    match SpmModel::new(pieces, scores, kinds, Some(0), add_space_prefix) {
        Ok(m) => m,
        Err(e) => panic!("tiny vocabulary: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny(add_space_prefix: bool) -> SpmModel {
        tiny_model(add_space_prefix)
    }

    fn ids(m: &SpmModel, text: &str) -> Vec<String> {
        let mut out = Vec::new();
        m.encode(text, &mut out);
        out.iter()
            .map(|&i| m.piece(i).unwrap().to_owned())
            .collect()
    }

    #[test]
    fn merges_by_score_then_leftmost() {
        let m = tiny(false);
        // "bc" outscores "ab", then a + bc forms "abc".
        assert_eq!(ids(&m, "abc"), ["abc"]);
        assert_eq!(ids(&m, "bcab"), ["bc", "ab"]);
        // "ab" and "ba" score the same: the leftmost pair merges first.
        assert_eq!(ids(&m, "aba"), ["ab", "a"]);
        assert_eq!(ids(&m, "bab"), ["ba", "b"]);
        assert_eq!(ids(&m, "a a"), ["a", "▁a"]);
    }

    #[test]
    fn byte_fallback_specials_and_space_prefix() {
        let m = tiny(false);
        assert_eq!(ids(&m, "é"), ["<0xC3>", "<0xA9>"]);
        assert_eq!(ids(&m, "a<ctl>\n\nb"), ["a", "<ctl>", "\n\n", "b"]);
        // A user-defined piece stored with bare spaces matches spaces and literal markers.
        assert_eq!(ids(&m, "a   b"), ["a", "  ", "▁", "b"]);
        assert_eq!(ids(&m, "a▁▁"), ["a", "  "]);
        assert_eq!(ids(&m, ""), Vec::<String>::new());
        let m = tiny(true);
        assert_eq!(ids(&m, "a<ctl>a"), ["▁a", "<ctl>", "▁a"]);
    }

    #[test]
    fn decodes_pieces() {
        let m = tiny(false);
        let mut out = Vec::new();
        for text in ["a a", "é", "a<ctl>\n\nb"] {
            let mut ids = Vec::new();
            m.encode(text, &mut ids);
            out.clear();
            for id in ids {
                m.token_bytes(id, &mut out);
            }
            assert_eq!(
                String::from_utf8(out.clone()).unwrap(),
                text.replace("<ctl>", "")
            );
        }
    }

    #[test]
    fn rejects_inconsistent_vocabularies() {
        let e = SpmModel::new(
            vec!["a".into()],
            vec![],
            vec![TokenKind::Normal],
            None,
            false,
        );
        assert!(e.is_err());
        let e = SpmModel::new(
            vec!["<0xZZ>".into()],
            vec![0.0],
            vec![TokenKind::Byte],
            None,
            false,
        );
        assert!(e.err().unwrap().to_string().contains("<0xZZ>"));
    }
}
