//! One module per subcommand.

pub mod bench;
pub mod bench_serve;
pub mod chat;
pub mod inspect;
pub mod perplexity;
pub mod pull;
pub mod run;
pub mod sampling;
pub mod serve;
pub mod sse_client;
pub mod tokenize;
