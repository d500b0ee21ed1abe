//! Tokenizers and chat templates: SentencePiece-BPE built from GGUF metadata, HF
//! `tokenizer.json` through the `tokenizers` crate, a streaming detokenizer that never splits a
//! UTF-8 character, and the model's chat template rendered with minijinja.

mod gguf_bpe;
mod hf;
mod special;
mod spm;
mod stream;
mod template;

use std::path::Path;

use crate::gguf::GgufFile;
use crate::{Error, Result};

pub use stream::StreamDecoder;
pub use template::{ChatMessage, ChatTemplate};

/// What a vocabulary entry is (the GGUF / SentencePiece token types).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenKind {
    /// An ordinary subword piece.
    Normal,
    /// The unknown-token placeholder.
    Unknown,
    /// A control token (`<bos>`, `<start_of_turn>`, …): never rendered when decoding.
    Control,
    /// A user-defined piece, always matched literally in text (`\n\n`, `<table>`, …).
    UserDefined,
    /// A reserved, unused slot.
    Unused,
    /// A byte-fallback piece `<0xXX>`.
    Byte,
}

impl TokenKind {
    /// Whether text containing this piece literally is cut into this token before subword
    /// merging (control and unknown pieces: special-token parsing; user-defined: always).
    fn is_special(self) -> bool {
        matches!(
            self,
            TokenKind::Control | TokenKind::UserDefined | TokenKind::Unknown
        )
    }
}

/// A tokenizer: text to ids and back.
pub struct Tokenizer {
    backend: Backend,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
}

enum Backend {
    Spm(spm::SpmModel),
    Hf(Box<hf::HfModel>),
}

impl Tokenizer {
    /// Builds the tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata:
    /// score-based SentencePiece (`tokenizer.ggml.model == "llama"`, Gemma 3) or merge-rank
    /// BPE (`"gemma4"`, see `gguf_bpe`).
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self> {
        let path = gguf.path().display();
        let model = gguf.get_str("tokenizer.ggml.model")?.ok_or_else(|| {
            Error::Tokenizer(format!("{path}: no tokenizer.ggml.model in the metadata"))
        })?;
        let backend = match model {
            "llama" => Backend::Spm(spm::SpmModel::from_gguf(gguf)?),
            "gemma4" => {
                let (bpe, texts) = gguf_bpe::tokenizer(gguf)?;
                Backend::Hf(Box::new(hf::HfModel::with_texts(bpe, texts)))
            }
            other => {
                return Err(Error::Unsupported(format!(
                    "{path}: tokenizer model '{other}' (supported: SentencePiece 'llama', BPE \
                     'gemma4')"
                )))
            }
        };
        let mut tokenizer = Tokenizer {
            backend,
            bos: None,
            eos: None,
            add_bos: false,
        };
        let n = tokenizer.vocab_size() as u64;
        let id = |key: &str| -> Result<Option<u32>> {
            match gguf.get_u64(key)? {
                Some(v) if v < n => Ok(Some(v as u32)),
                Some(v) => Err(Error::Tokenizer(format!(
                    "{path}: {key} = {v} is outside the vocabulary of {n}"
                ))),
                None => Ok(None),
            }
        };
        tokenizer.bos = id("tokenizer.ggml.bos_token_id")?;
        tokenizer.eos = id("tokenizer.ggml.eos_token_id")?;
        tokenizer.add_bos = gguf
            .get_bool("tokenizer.ggml.add_bos_token")?
            .unwrap_or(true)
            && tokenizer.bos.is_some();
        Ok(tokenizer)
    }

    /// Loads an HF `tokenizer.json` (BOS/EOS from a `tokenizer_config.json` beside it, else
    /// the usual token names).
    pub fn from_hf_file(path: &Path) -> Result<Self> {
        let hf = hf::HfModel::from_file(path)?;
        Ok(Tokenizer {
            bos: hf.bos,
            eos: hf.eos,
            add_bos: hf.add_bos,
            backend: Backend::Hf(Box::new(hf)),
        })
    }

    /// Token ids of `text`, with special tokens written in the text recognised as such, and
    /// the BOS id in front when `add_bos` is set (and the vocabulary has one). Never appends EOS.
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if let (true, Some(bos)) = (add_bos, self.bos) {
            out.push(bos);
        }
        match &self.backend {
            Backend::Spm(m) => m.encode(text, &mut out),
            Backend::Hf(m) => m.encode(text, &mut out)?,
        }
        Ok(out)
    }

    /// The text of `ids`; control tokens are not rendered, byte pieces are joined into UTF-8
    /// (invalid sequences and ids outside the vocabulary become U+FFFD).
    pub fn decode(&self, ids: &[u32]) -> String {
        match &self.backend {
            Backend::Spm(m) => {
                let mut bytes = Vec::with_capacity(ids.len() * 4);
                for &id in ids {
                    m.token_bytes(id, &mut bytes);
                }
                String::from_utf8_lossy(&bytes).into_owned()
            }
            Backend::Hf(m) => m.decode(ids),
        }
    }

    /// A decoder that turns ids into text one at a time, never splitting a character.
    pub fn stream_decoder(&self) -> StreamDecoder<'_> {
        StreamDecoder::new(self)
    }

    /// Number of token ids.
    pub fn vocab_size(&self) -> usize {
        match &self.backend {
            Backend::Spm(m) => m.len(),
            Backend::Hf(m) => m.len(),
        }
    }

    /// The begin-of-sequence id, if the vocabulary names one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// The end-of-sequence id, if the vocabulary names one.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// Whether the model expects BOS in front of a prompt (GGUF `add_bos_token`, or what the
    /// HF post-processor does).
    pub fn adds_bos(&self) -> bool {
        self.add_bos
    }

    /// The id of a token by its vocabulary text (e.g. `"<end_of_turn>"`).
    pub fn token_id(&self, text: &str) -> Option<u32> {
        match &self.backend {
            Backend::Spm(m) => m.id(text),
            Backend::Hf(m) => m.id(text),
        }
    }

    /// The vocabulary text of an id (raw: SentencePiece pieces keep their `▁`).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        match &self.backend {
            Backend::Spm(m) => m.piece(id),
            Backend::Hf(m) => m.text(id),
        }
    }

    /// Whether an id is a control / special token (not rendered by `decode`).
    pub fn is_control(&self, id: u32) -> bool {
        match &self.backend {
            Backend::Spm(m) => m.kind(id) == Some(TokenKind::Control),
            Backend::Hf(m) => m.is_special(id),
        }
    }

    /// The kind of an id, where the vocabulary records kinds (GGUF); `None` for HF
    /// tokenizers and ids outside the vocabulary.
    pub fn token_kind(&self, id: u32) -> Option<TokenKind> {
        match &self.backend {
            Backend::Spm(m) => m.kind(id),
            Backend::Hf(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> Tokenizer {
        Tokenizer {
            backend: Backend::Spm(spm::tiny_model(false)),
            bos: Some(1),
            eos: None,
            add_bos: true,
        }
    }

    #[test]
    fn stream_never_splits_characters() {
        let tok = tiny();
        for text in ["ab 😀 日本語 é", "🦀🦀", "a<ctl>é\n\nb", "", "\u{10FFFF}x"] {
            let ids = tok.encode(text, true).unwrap();
            let mut stream = tok.stream_decoder();
            let mut out = String::new();
            for &id in &ids {
                let piece = stream.push(id);
                assert!(!piece.contains('\u{FFFD}'), "{text:?}: {piece:?}");
                out += &piece;
            }
            out += &stream.finish();
            assert_eq!(out, tok.decode(&ids), "{text:?}");
            assert_eq!(out, text.replace("<ctl>", ""), "{text:?}");
        }
    }

    #[test]
    fn stream_emits_each_character_when_complete() {
        let tok = tiny();
        let ids = tok.encode("a😀", false).unwrap();
        assert_eq!(ids.len(), 5, "one piece and four byte pieces");
        let mut stream = tok.stream_decoder();
        let chunks: Vec<String> = ids.iter().map(|&id| stream.push(id)).collect();
        assert_eq!(chunks, ["a", "", "", "", "😀"]);
        assert_eq!(stream.finish(), "");
    }

    #[test]
    fn stream_flushes_a_cut_character_as_replacement() {
        let tok = tiny();
        let ids = tok.encode("😀", false).unwrap();
        let mut stream = tok.stream_decoder();
        for &id in &ids[..2] {
            assert_eq!(stream.push(id), "");
        }
        assert_eq!(stream.finish(), "\u{FFFD}");
        assert_eq!(tok.decode(&ids[..2]), "\u{FFFD}");
    }

    #[test]
    fn bos_and_lookups() {
        let tok = tiny();
        assert_eq!(tok.encode("ab", true).unwrap()[0], 1);
        assert_eq!(tok.encode("ab", false).unwrap().len(), 1);
        assert_eq!(tok.token_id("<ctl>"), Some(2));
        assert!(tok.is_control(2) && !tok.is_control(3));
        assert_eq!(tok.token_text(tok.token_id("▁a").unwrap()), Some("▁a"));
        assert_eq!(tok.token_kind(3), Some(TokenKind::Byte));
        assert_eq!(tok.decode(&[u32::MAX]), "\u{FFFD}");
        assert_eq!(tok.vocab_size(), 3 + 256 + 11);
    }
}
