//! Loading a model with its tokenizer and chat template, from a GGUF file or a Hugging Face
//! directory (config.json + *.safetensors + tokenizer.json + tokenizer_config.json).

use std::path::Path;

use markbase_core::tokenizer::{ChatTemplate, Tokenizer};
use markbase_core::Result;
use markbase_models::{LoadOptions, Model, ModelSource};

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
