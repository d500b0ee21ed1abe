//! One module per subcommand.

pub mod bench;
pub mod chat;
pub mod inspect;
pub mod perplexity;
pub mod pull;
pub mod run;
pub mod sampling;
pub mod tokenize;
