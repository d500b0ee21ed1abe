//! `markbase chat`: an interactive conversation; the KV cache keeps the turns already seen.

use std::io::{BufRead, IsTerminal, Write};

use anyhow::{Context, Result};
use markbase_core::tokenizer::ChatMessage;
use markbase_engine::{GenerateOptions, LoadedModel, Session};

use crate::cmd::sampling::SamplingArgs;
use crate::Global;

/// Default context of a chat when the model allows it.
const DEFAULT_CHAT_CTX: usize = 4096;

/// Arguments of `chat`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A system message for the whole conversation.
    #[arg(long)]
    pub system: Option<String>,
    /// Turn on the model's thinking mode (passes `enable_thinking` to the chat template).
    #[arg(long)]
    pub think: bool,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

/// Renders `messages` with the model's chat template (generation prompt added; thinking mode
/// on when `think`) and encodes it.
pub fn encode_conversation(
    loaded: &LoadedModel,
    messages: &[ChatMessage],
    think: bool,
) -> Result<Vec<u32>> {
    let tok = &loaded.tokenizer;
    let text_of = |id: Option<u32>, fallback: &str| {
        id.and_then(|i| tok.token_text(i))
            .unwrap_or(fallback)
            .to_string()
    };
    let bos = text_of(tok.bos_id(), "<bos>");
    let eos = text_of(tok.eos_id(), "<eos>");
    let text =
        loaded
            .template
            .render_with_thinking(messages, true, &bos, &eos, think.then_some(true))?;
    Ok(tok.encode(&text, false)?)
}

/// Runs `chat`.
pub fn run(global: &Global, args: Args) -> Result<()> {
    let loaded = crate::model::load_model(global)?;
    let limit = loaded.model.info().context_length;
    let ctx = args.sampling.ctx.unwrap_or(DEFAULT_CHAT_CTX.min(limit));
    let mut session = Session::new(&loaded.model, ctx)?;
    let stop_tokens = loaded.stop_tokens()?;
    let interactive = std::io::stdin().is_terminal();
    let mut messages: Vec<ChatMessage> = args
        .system
        .iter()
        .map(|s| ChatMessage::new("system", s.as_str()))
        .collect();
    let first_turn = messages.len();
    if interactive {
        eprintln!(
            "Chatting with {} (context {ctx} tokens). /clear starts over, /exit or Ctrl-D quits.",
            loaded.model.info().architecture
        );
    }
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    let mut params = args.sampling.params();
    loop {
        if interactive {
            eprint!("> ");
            std::io::stderr().flush()?;
        }
        let Some(line) = lines.next() else { break };
        let line = line.context("cannot read stdin")?;
        let line = line.trim();
        match line {
            "" => continue,
            "/exit" | "/quit" | "/bye" => break,
            "/clear" => {
                messages.truncate(first_turn);
                continue;
            }
            _ => {}
        }
        messages.push(ChatMessage::new("user", line));
        let prompt = encode_conversation(&loaded, &messages, args.think)?;
        let opts = GenerateOptions {
            max_tokens: args.sampling.max_tokens,
            stop_tokens: stop_tokens.clone(),
            stop_strings: args.sampling.stop.clone(),
            sampling: params.clone(),
        };
        let stdout = std::io::stdout();
        let mut on_text = |s: &str| {
            let mut out = stdout.lock();
            // A closed stdout ends the chat at the next read; nothing useful to do here.
            let _ = out.write_all(s.as_bytes()).and_then(|_| out.flush());
        };
        match session.generate(&loaded.tokenizer, &prompt, &opts, &mut on_text) {
            Ok(gen) => {
                println!();
                messages.push(ChatMessage::new("assistant", gen.text));
            }
            Err(markbase_core::Error::ContextOverflow { tokens, context }) if interactive => {
                messages.pop();
                eprintln!(
                    "error: the conversation ({tokens} tokens) no longer fits the context of {context} tokens; /clear to start over"
                );
            }
            Err(e) => return Err(e.into()),
        }
        // A new draw for the next turn, still reproducible from the first seed.
        params.seed = params.seed.wrapping_add(1);
    }
    Ok(())
}
