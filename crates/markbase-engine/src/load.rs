//! Loading a model with its tokenizer and chat template, from a GGUF file or a Hugging Face
//! directory (config.json + *.safetensors + tokenizer.json + tokenizer_config.json).

use std::path::Path;

use markbase_core::tokenizer::{ChatTemplate, Tokenizer};
use markbase_core::{Error, Result};
use markbase_models::{LoadOptions, Model, ModelSource};

use crate::default_stop_tokens;

/// A model ready to generate.
pub struct LoadedModel {
    /// The weights and forward pass.
    pub model: Model,
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// The chat template (the model's own, else the built-in Gemma one).
    pub template: ChatTemplate,
    /// Where the model came from.
    pub source: ModelSource,
}

impl LoadedModel {
    /// Token ids that end generation (see [`stop_tokens`]).
    pub fn stop_tokens(&self) -> Result<Vec<u32>> {
        stop_tokens(&self.source, &self.tokenizer)
    }
}

/// Token ids that end generation: [`default_stop_tokens`] plus, for a Hugging Face directory,
/// `eos_token_id` (a number or a list) of its `generation_config.json`.
pub fn stop_tokens(source: &ModelSource, tokenizer: &Tokenizer) -> Result<Vec<u32>> {
    let mut ids = default_stop_tokens(tokenizer);
    if let ModelSource::HfDir(dir) = source {
        for id in generation_config_eos(&dir.join("generation_config.json"))? {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
    }
    Ok(ids)
}

/// `eos_token_id` of a `generation_config.json` (none when the file or the field is absent).
fn generation_config_eos(path: &Path) -> Result<Vec<u32>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io(path, e)),
    };
    let bad = |what: String| Error::Config(format!("{}: {what}", path.display()));
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("invalid JSON: {e}")))?;
    let id = |x: &serde_json::Value| {
        x.as_u64()
            .and_then(|i| u32::try_from(i).ok())
            .ok_or_else(|| bad(format!("eos_token_id entry {x} is not a token id")))
    };
    match v.get("eos_token_id") {
        None | Some(serde_json::Value::Null) => Ok(Vec::new()),
        Some(serde_json::Value::Array(list)) => list.iter().map(id).collect(),
        Some(x) => Ok(vec![id(x)?]),
    }
}

/// Loads only the tokenizer and chat template of the model at `path` (no weights are read).
pub fn load_tokenizer(path: &Path) -> Result<(Tokenizer, ChatTemplate)> {
    tokenizer_of(&ModelSource::open(path)?)
}

fn tokenizer_of(source: &ModelSource) -> Result<(Tokenizer, ChatTemplate)> {
    Ok(match source {
        ModelSource::Gguf(gguf) => (Tokenizer::from_gguf(gguf)?, ChatTemplate::for_gguf(gguf)?),
        ModelSource::HfDir(dir) => (
            Tokenizer::from_hf_file(&dir.join("tokenizer.json"))?,
            ChatTemplate::for_hf_dir(dir)?.unwrap_or_else(ChatTemplate::builtin_gemma),
        ),
    })
}

/// Loads the model at `path` (a .gguf file or a Hugging Face directory).
pub fn load(path: &Path, opts: &LoadOptions) -> Result<LoadedModel> {
    let source = ModelSource::open(path)?;
    let model = Model::load(&source, opts)?;
    let (tokenizer, template) = tokenizer_of(&source)?;
    Ok(LoadedModel {
        model,
        tokenizer,
        template,
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_config_eos_forms() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("generation_config.json");
        assert_eq!(generation_config_eos(&path).unwrap(), Vec::<u32>::new());
        for (text, want) in [
            (r#"{"eos_token_id": [1, 106, 50]}"#, vec![1, 106, 50]),
            (r#"{"eos_token_id": 7}"#, vec![7]),
            (r#"{"eos_token_id": null}"#, vec![]),
            (r#"{"bos_token_id": 2}"#, vec![]),
        ] {
            std::fs::write(&path, text).unwrap();
            assert_eq!(generation_config_eos(&path).unwrap(), want, "{text}");
        }
        for bad in [r#"{"eos_token_id": ["x"]}"#, r#"{"eos_token_id": -1}"#, "{"] {
            std::fs::write(&path, bad).unwrap();
            let e = generation_config_eos(&path).unwrap_err().to_string();
            assert!(e.contains("generation_config.json"), "{bad}: {e}");
        }
    }
}
