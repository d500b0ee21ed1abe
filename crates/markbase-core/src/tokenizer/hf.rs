//! HF `tokenizer.json` through the `tokenizers` crate, with BOS/EOS read from the
//! `tokenizer_config.json` next to it when there is one (or, for a GGUF BPE vocabulary, from
//! the GGUF).

use std::path::Path;

use crate::{Error, Result};

/// A `tokenizers` tokenizer plus the facts the engine asks for.
pub(super) struct HfModel {
    inner: tokenizers::Tokenizer,
    texts: Vec<String>,
    special: Vec<bool>,
    pub(super) bos: Option<u32>,
    pub(super) eos: Option<u32>,
    pub(super) add_bos: bool,
}

impl HfModel {
    /// Loads `path` (a tokenizer.json) and, if present, its sibling tokenizer_config.json.
    pub(super) fn from_file(path: &Path) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))?;
        let mut model = Self::new(inner);
        let config = read_config(path)?;
        let inner = &model.inner;
        let named = |key: &str, fallbacks: &[&str]| -> Option<u32> {
            match config.as_ref().and_then(|c| token_name(c.get(key)?)) {
                Some(name) => inner.token_to_id(&name),
                None => fallbacks.iter().find_map(|f| inner.token_to_id(f)),
            }
        };
        let bos = named("bos_token", &["<bos>", "<s>", "<|begin_of_text|>"]);
        let eos = named(
            "eos_token",
            &["<eos>", "</s>", "<|end_of_text|>", "<|endoftext|>"],
        );
        // The post-processor says whether BOS belongs in front of every sequence.
        let add_bos = match bos {
            Some(b) => {
                let probe = inner
                    .encode("", true)
                    .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))?;
                probe.get_ids().first() == Some(&b)
            }
            None => false,
        };
        (model.bos, model.eos, model.add_bos) = (bos, eos, add_bos);
        Ok(model)
    }

    /// Wraps `inner`, with no BOS or EOS yet; each id's text is the string the vocabulary
    /// maps to it (empty for an id no string maps to).
    pub(super) fn new(inner: tokenizers::Tokenizer) -> Self {
        let vocab = inner.get_vocab(true);
        let n = vocab.values().map(|&id| id as usize + 1).max().unwrap_or(0);
        let mut texts = vec![String::new(); n];
        for (text, id) in vocab {
            texts[id as usize] = text;
        }
        Self::with_texts(inner, texts)
    }

    /// Wraps `inner` whose ids have the texts `texts` (a GGUF's token list, where a string
    /// stored twice maps to its later id but both ids keep their text), with no BOS or EOS yet.
    pub(super) fn with_texts(inner: tokenizers::Tokenizer, texts: Vec<String>) -> Self {
        let mut special = vec![false; texts.len()];
        for (id, tok) in inner.get_added_tokens_decoder() {
            if let Some(s) = special.get_mut(id as usize) {
                *s = tok.special;
            }
        }
        HfModel {
            inner,
            texts,
            special,
            bos: None,
            eos: None,
            add_bos: false,
        }
    }

    /// Number of ids, added tokens included.
    pub(super) fn len(&self) -> usize {
        self.texts.len()
    }

    /// The id of a token text.
    pub(super) fn id(&self, text: &str) -> Option<u32> {
        self.inner.token_to_id(text)
    }

    /// The text of an id as stored in the vocabulary.
    pub(super) fn text(&self, id: u32) -> Option<&str> {
        self.texts.get(id as usize).map(String::as_str)
    }

    /// Whether an id is a special added token (not rendered when decoding).
    pub(super) fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    /// Appends the ids of `text` (added tokens in the text recognised; no post-processing).
    pub(super) fn encode(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::Tokenizer(format!("encoding failed: {e}")))?;
        out.extend_from_slice(enc.get_ids());
        Ok(())
    }

    /// Text of `ids` with special tokens skipped; ids outside the vocabulary become U+FFFD.
    pub(super) fn decode(&self, ids: &[u32]) -> String {
        let mut out = String::new();
        for run in ids.split_inclusive(|&id| id as usize >= self.len()) {
            let (valid, bad) = match run.split_last() {
                Some((&last, rest)) if last as usize >= self.len() => (rest, true),
                _ => (run, false),
            };
            if !valid.is_empty() {
                // The ids are in range, so the decoders only fail on malformed configurations.
                match self.inner.decode(valid, true) {
                    Ok(s) => out.push_str(&s),
                    Err(_) => out.push('\u{FFFD}'),
                }
            }
            if bad {
                out.push('\u{FFFD}');
            }
        }
        out
    }
}

/// The parsed tokenizer_config.json beside `path`, if it exists.
fn read_config(path: &Path) -> Result<Option<serde_json::Map<String, serde_json::Value>>> {
    let cfg = path.with_file_name("tokenizer_config.json");
    let text = match std::fs::read_to_string(&cfg) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(cfg, e)),
    };
    match serde_json::from_str(&text) {
        Ok(serde_json::Value::Object(map)) => Ok(Some(map)),
        Ok(_) => Err(Error::Tokenizer(format!(
            "{}: not a JSON object",
            cfg.display()
        ))),
        Err(e) => Err(Error::Tokenizer(format!("{}: {e}", cfg.display()))),
    }
}

/// A token named in tokenizer_config.json: a string or `{"content": ...}`.
fn token_name(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}
