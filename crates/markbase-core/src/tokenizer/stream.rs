//! Streaming detokenizer: turns ids into text one at a time and only ever hands out complete
//! UTF-8 characters, holding back the bytes of a character split over several byte tokens.

use super::hf::HfModel;
use super::spm::SpmModel;
use super::{Backend, Tokenizer};

/// Incremental decoder over one token stream (see [`Tokenizer::stream_decoder`]).
pub struct StreamDecoder<'a> {
    state: State<'a>,
}

enum State<'a> {
    /// SentencePiece vocabularies: token bytes are known exactly, so buffer bytes.
    Bytes {
        model: &'a SpmModel,
        pending: Vec<u8>,
    },
    /// `tokenizers` vocabularies: re-decode a short window of ids (decoders may depend on
    /// neighbours) and emit what grew, unless it ends in an unfinished character.
    Window {
        model: &'a HfModel,
        ids: Vec<u32>,
        prefix: usize,
        read: usize,
    },
}

impl<'a> StreamDecoder<'a> {
    pub(super) fn new(tok: &'a Tokenizer) -> Self {
        let state = match &tok.backend {
            Backend::Spm(model) => State::Bytes {
                model,
                pending: Vec::new(),
            },
            Backend::Hf(model) => State::Window {
                model,
                ids: Vec::new(),
                prefix: 0,
                read: 0,
            },
        };
        StreamDecoder { state }
    }

    /// Adds one id; returns the text that is now complete (possibly empty).
    pub fn push(&mut self, id: u32) -> String {
        match &mut self.state {
            State::Bytes { model, pending } => {
                model.token_bytes(id, pending);
                take_utf8(pending, false)
            }
            State::Window {
                model,
                ids,
                prefix,
                read,
            } => {
                ids.push(id);
                let before = model.decode(&ids[*prefix..*read]);
                let now = model.decode(&ids[*prefix..]);
                match now.strip_prefix(before.as_str()) {
                    Some(delta) if !delta.is_empty() && !delta.ends_with('\u{FFFD}') => {
                        let delta = delta.to_owned();
                        *prefix = *read;
                        *read = ids.len();
                        delta
                    }
                    _ => String::new(),
                }
            }
        }
    }

    /// Ends the stream: returns whatever is still held, an unfinished character as U+FFFD.
    pub fn finish(self) -> String {
        match self.state {
            State::Bytes { mut pending, .. } => take_utf8(&mut pending, true),
            State::Window {
                model,
                ids,
                prefix,
                read,
            } => {
                let before = model.decode(&ids[prefix..read]);
                let now = model.decode(&ids[prefix..]);
                match now.strip_prefix(before.as_str()) {
                    Some(delta) => delta.to_owned(),
                    None => now,
                }
            }
        }
    }
}

/// Removes and returns the complete UTF-8 at the front of `pending`. Bytes that can never
/// start a valid character become U+FFFD at once (as `from_utf8_lossy` does); an unfinished
/// character at the end is kept for later, or becomes U+FFFD when `finish` is set.
fn take_utf8(pending: &mut Vec<u8>, finish: bool) -> String {
    let mut out = String::new();
    let mut start = 0;
    while start < pending.len() {
        match std::str::from_utf8(&pending[start..]) {
            Ok(s) => {
                out.push_str(s);
                start = pending.len();
            }
            Err(e) => {
                let good = start + e.valid_up_to();
                out.push_str(&String::from_utf8_lossy(&pending[start..good]));
                match e.error_len() {
                    Some(n) => {
                        out.push('\u{FFFD}');
                        start = good + n;
                    }
                    None if finish => {
                        out.push('\u{FFFD}');
                        start = pending.len();
                    }
                    None => {
                        start = good;
                        break;
                    }
                }
            }
        }
    }
    pending.drain(..start);
    out
}

#[cfg(test)]
mod tests {
    use super::take_utf8;

    #[test]
    fn holds_unfinished_characters() {
        let smile = "😀".as_bytes();
        let mut pending = Vec::new();
        for &b in &smile[..3] {
            pending.push(b);
            assert_eq!(take_utf8(&mut pending, false), "");
        }
        pending.push(smile[3]);
        assert_eq!(take_utf8(&mut pending, false), "😀");
        assert!(pending.is_empty());
    }

    #[test]
    fn invalid_bytes_match_lossy_decoding() {
        let cases: [&[u8]; 5] = [
            b"a\xffb",
            b"\xe6\x97",
            b"x\xe6\x97\xe6\x97\xa5",
            b"\xc3\x28ok",
            b"\xf0\x9f\x98",
        ];
        for bytes in cases {
            let mut all = String::new();
            let mut pending = Vec::new();
            for &b in bytes {
                pending.push(b);
                all += &take_utf8(&mut pending, false);
            }
            all += &take_utf8(&mut pending, true);
            assert_eq!(all, String::from_utf8_lossy(bytes), "{bytes:?}");
        }
    }
}
