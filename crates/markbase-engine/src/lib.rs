//! MarkBase engine: loading a model with its tokenizer, sampling, the generation loop,
//! perplexity, speed tests, pulling the default model, and the serving [`Engine`] (continuous
//! batching).

pub mod bench;
pub mod engine;
pub mod generate;
pub mod load;
pub mod perplexity;
pub mod pull;
pub mod sampling;
pub mod stop;

pub use bench::{bench, BenchOptions, BenchResult};
pub use engine::{
    Engine, EngineConfig, EngineStats, Event, Request, RequestHandle, SubmitError, KV_BLOCK_TOKENS,
};
pub use generate::{
    default_stop_tokens, generate, FinishReason, GenerateOptions, Generation, Session, Timings,
};
pub use load::{load, load_tokenizer, stop_tokens, LoadedModel};
pub use perplexity::{perplexity, Perplexity};
pub use sampling::{Sampler, SamplingParams};
pub use stop::StopFilter;
