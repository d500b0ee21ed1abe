//! Generated tokens → the parts of an OpenAI reply: answer text, reasoning text (Gemma 4's
//! `<|channel>thought\n…<channel|>`) and tool calls (`<|tool_call>call:NAME{…}<tool_call|>`).
//!
//! The markers are recognised by token id, before detokenization, so the result is the same
//! whether a tokenizer renders those special tokens as text (GGUF) or skips them (HF). Text
//! between markers goes through one [`StreamDecoder`] per segment; answer text then goes
//! through the request's [`StopFilter`]. Streaming and non-streaming replies are both built
//! from the deltas of this one parser, so their text is the same by construction. A tokenizer
//! without the markers (Gemma 3) passes everything through as answer text.

use markbase_core::tokenizer::{StreamDecoder, Tokenizer};
use markbase_engine::StopFilter;

use crate::tool_syntax::{self, Piece};

/// The token ids of Gemma 4's reasoning and tool-call markers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Markers {
    /// `<|channel>`, `<channel|>`: a reasoning block.
    pub channel: Option<(u32, u32)>,
    /// `<|tool_call>`, `<tool_call|>`, `<|"|>`: a tool call and its string delimiter.
    pub tool_call: Option<(u32, u32, u32)>,
}

impl Markers {
    /// The markers the vocabulary has (none for Gemma 3).
    pub fn of(tok: &Tokenizer) -> Markers {
        let id = |t: &str| tok.token_id(t);
        Markers {
            channel: id("<|channel>").zip(id("<channel|>")),
            tool_call: match (
                id("<|tool_call>"),
                id("<tool_call|>"),
                id(tool_syntax::QUOTE),
            ) {
                (Some(a), Some(b), Some(q)) => Some((a, b, q)),
                _ => None,
            },
        }
    }

    /// Whether the model has Gemma 4's tool-call syntax.
    pub fn has_tools(&self) -> bool {
        self.tool_call.is_some()
    }
}

/// A tool call parsed from the output.
#[derive(Clone, Debug, PartialEq)]
pub struct ParsedCall {
    /// The function name.
    pub name: String,
    /// The arguments as a JSON object text.
    pub arguments: String,
}

/// What one token (or the end) added to the reply.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Delta {
    /// Answer text.
    pub content: String,
    /// Reasoning text.
    pub reasoning: String,
    /// Completed tool calls.
    pub tool_calls: Vec<ParsedCall>,
}

impl Delta {
    /// Whether nothing was added.
    pub fn is_empty(&self) -> bool {
        self.content.is_empty() && self.reasoning.is_empty() && self.tool_calls.is_empty()
    }

    /// Appends `other`.
    pub fn append(&mut self, other: Delta) {
        self.content.push_str(&other.content);
        self.reasoning.push_str(&other.reasoning);
        self.tool_calls.extend(other.tool_calls);
    }
}

/// The header that names the reasoning channel (`<|channel>thought\n…`), not part of the text.
const THOUGHT_HEADER: &str = "thought\n";

enum Mode {
    Content,
    /// Inside a reasoning block; `header` holds text that may still be [`THOUGHT_HEADER`].
    Reasoning {
        header: Option<String>,
    },
    /// Inside a tool call: its ids so far.
    ToolCall {
        ids: Vec<u32>,
    },
}

/// Turns a stream of generated token ids into [`Delta`]s.
pub struct OutputParser<'t> {
    tok: &'t Tokenizer,
    markers: Markers,
    mode: Mode,
    decoder: StreamDecoder<'t>,
    stops: StopFilter,
}

impl<'t> OutputParser<'t> {
    /// A parser for one reply; `markers` = [`Markers::default`] turns parsing off (raw text).
    pub fn new(tok: &'t Tokenizer, markers: Markers, stop_strings: &[String]) -> Self {
        OutputParser {
            tok,
            markers,
            mode: Mode::Content,
            decoder: tok.stream_decoder(),
            stops: StopFilter::new(stop_strings),
        }
    }

    /// Whether a stop string ended the answer (the caller stops generating).
    pub fn stopped(&self) -> bool {
        self.stops.stopped()
    }

    /// Adds one generated id.
    pub fn push(&mut self, id: u32) -> Delta {
        let mut out = Delta::default();
        if self.stops.stopped() {
            return out;
        }
        if let Mode::ToolCall { ids } = &mut self.mode {
            let (_, close, _) = self.markers.tool_call.unwrap_or_default();
            if id == close {
                let ids = std::mem::take(ids);
                self.mode = Mode::Content;
                self.end_call(&ids, true, &mut out);
            } else {
                ids.push(id);
            }
            return out;
        }
        match (self.markers.channel, self.markers.tool_call) {
            (Some((open, _)), _) if id == open => {
                self.flush(&mut out);
                self.mode = Mode::Reasoning {
                    header: Some(String::new()),
                };
            }
            (Some((_, close)), _) if id == close => {
                // Closes a reasoning block; a stray one carries no text.
                self.flush(&mut out);
                self.mode = Mode::Content;
            }
            (_, Some((open, _, _))) if id == open => {
                self.flush(&mut out);
                self.mode = Mode::ToolCall { ids: Vec::new() };
            }
            _ => {
                let text = self.decoder.push(id);
                self.route(text, &mut out);
            }
        }
        out
    }

    /// Ends the reply: releases held-back text; an unfinished tool call becomes answer text.
    pub fn finish(&mut self) -> Delta {
        let mut out = Delta::default();
        if self.stops.stopped() {
            return out;
        }
        if let Mode::ToolCall { ids } = &mut self.mode {
            let ids = std::mem::take(ids);
            self.mode = Mode::Content;
            self.end_call(&ids, false, &mut out);
        }
        self.flush(&mut out);
        out.content.push_str(&self.stops.finish());
        out
    }

    /// Ends the current text segment: its decoder's held bytes and a pending reasoning header.
    fn flush(&mut self, out: &mut Delta) {
        let rest = std::mem::replace(&mut self.decoder, self.tok.stream_decoder()).finish();
        self.route(rest, out);
        if let Mode::Reasoning { header } = &mut self.mode {
            if let Some(h) = header.take() {
                out.reasoning.push_str(&h);
            }
        }
    }

    /// Sends decoded text to the current mode's output.
    fn route(&mut self, text: String, out: &mut Delta) {
        if text.is_empty() {
            return;
        }
        match &mut self.mode {
            Mode::Content => out.content.push_str(&self.stops.push(&text)),
            Mode::Reasoning { header } => match header.take() {
                None => out.reasoning.push_str(&text),
                Some(mut h) => {
                    h.push_str(&text);
                    if let Some(rest) = h.strip_prefix(THOUGHT_HEADER) {
                        out.reasoning.push_str(rest);
                    } else if THOUGHT_HEADER.starts_with(h.as_str()) {
                        *header = Some(h);
                    } else {
                        out.reasoning.push_str(&h);
                    }
                }
            },
            Mode::ToolCall { .. } => unreachable!("tool-call ids are not decoded one by one"),
        }
    }

    /// Parses a finished (`closed`) or cut-off tool call; what does not parse is answer text,
    /// markers included, so nothing the model wrote is lost.
    fn end_call(&mut self, ids: &[u32], closed: bool, out: &mut Delta) {
        let (_, _, quote) = self.markers.tool_call.unwrap_or_default();
        let pieces: Vec<Piece> = ids
            .split(|&i| i == quote)
            .enumerate()
            .map(|(i, part)| {
                let text = self.tok.decode(part);
                if i % 2 == 1 {
                    Piece::Quoted(text)
                } else {
                    Piece::Text(text)
                }
            })
            .collect();
        if closed {
            if let Some((name, args)) = tool_syntax::parse_call(&pieces) {
                out.tool_calls.push(ParsedCall {
                    name,
                    arguments: args.to_string(),
                });
                return;
            }
        }
        let mut raw = String::from("<|tool_call>");
        for p in &pieces {
            match p {
                Piece::Text(t) => raw.push_str(t),
                Piece::Quoted(q) => {
                    raw.push_str(tool_syntax::QUOTE);
                    raw.push_str(q);
                    raw.push_str(tool_syntax::QUOTE);
                }
            }
        }
        // An odd number of pieces means every quote was matched; otherwise one is open.
        if pieces.len().is_multiple_of(2) {
            raw.truncate(raw.len() - tool_syntax::QUOTE.len());
        }
        if closed {
            raw.push_str("<tool_call|>");
        }
        out.content.push_str(&self.stops.push(&raw));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    /// The Gemma 4 tokenizer fixture (real special tokens at their real ids).
    fn gemma4() -> Tokenizer {
        let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/gemma4/e4b_like/tokenizer.json");
        Tokenizer::from_hf_file(&p).unwrap()
    }

    /// Feeds `text`'s ids one at a time; returns every delta (the end's last).
    fn run(tok: &Tokenizer, markers: Markers, stops: &[&str], text: &str) -> Vec<Delta> {
        let ids = tok.encode(text, false).unwrap();
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut p = OutputParser::new(tok, markers, &stops);
        let mut out: Vec<Delta> = ids.iter().map(|&id| p.push(id)).collect();
        out.push(p.finish());
        out
    }

    fn total(deltas: &[Delta]) -> Delta {
        let mut all = Delta::default();
        for d in deltas {
            all.append(d.clone());
        }
        all
    }

    #[test]
    fn fixture_has_the_gemma4_marker_ids() {
        let m = Markers::of(&gemma4());
        assert_eq!(m.channel, Some((100, 101)));
        assert_eq!(m.tool_call, Some((48, 49, 52)));
    }

    #[test]
    fn thinking_becomes_reasoning_content() {
        let tok = gemma4();
        let text = "<|channel>thought\nThe user greets me.\nBe brief.<channel|>Hello there!";
        let deltas = run(&tok, Markers::of(&tok), &[], text);
        let all = total(&deltas);
        assert_eq!(all.reasoning, "The user greets me.\nBe brief.");
        assert_eq!(all.content, "Hello there!");
        assert!(all.tool_calls.is_empty());
        // Reasoning streams before the answer starts.
        let first_content = deltas.iter().position(|d| !d.content.is_empty()).unwrap();
        let last_reasoning = deltas
            .iter()
            .rposition(|d| !d.reasoning.is_empty())
            .unwrap();
        assert!(last_reasoning < first_content);
        assert!(deltas.iter().filter(|d| !d.reasoning.is_empty()).count() > 3);
        // Without the header, and an empty (template-closed) block.
        let all = total(&run(
            &tok,
            Markers::of(&tok),
            &[],
            "<|channel>thou<channel|>ok",
        ));
        assert_eq!(
            (all.reasoning.as_str(), all.content.as_str()),
            ("thou", "ok")
        );
        let all = total(&run(
            &tok,
            Markers::of(&tok),
            &[],
            "<|channel>thought\n<channel|>ok",
        ));
        assert_eq!((all.reasoning.as_str(), all.content.as_str()), ("", "ok"));
    }

    #[test]
    fn tool_calls_are_parsed_from_token_ids() {
        let tok = gemma4();
        let text = r#"Let me check.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|><|tool_call>call:ping{}<tool_call|>"#;
        let deltas = run(&tok, Markers::of(&tok), &[], text);
        let all = total(&deltas);
        assert_eq!(all.content, "Let me check.");
        assert_eq!(
            all.tool_calls,
            [
                ParsedCall {
                    name: "get_weather".into(),
                    arguments: r#"{"city":"Paris","days":2}"#.into()
                },
                ParsedCall {
                    name: "ping".into(),
                    arguments: "{}".into()
                }
            ]
        );
        // Each call arrives whole, in the delta of its closing token.
        let ids = tok.encode(text, false).unwrap();
        let closes: Vec<usize> = ids
            .iter()
            .enumerate()
            .filter(|(_, &i)| i == 49)
            .map(|(k, _)| k)
            .collect();
        let with_calls: Vec<usize> = deltas
            .iter()
            .enumerate()
            .filter(|(_, d)| !d.tool_calls.is_empty())
            .map(|(k, _)| k)
            .collect();
        assert_eq!(closes, with_calls);
    }

    #[test]
    fn broken_or_cut_tool_calls_stay_text() {
        let tok = gemma4();
        let m = Markers::of(&tok);
        let bad = r#"A<|tool_call>call:f{x:<|"|>1<|"|><tool_call|>B"#;
        let all = total(&run(&tok, m, &[], bad));
        assert!(all.tool_calls.is_empty());
        assert_eq!(all.content, bad);
        let cut = r#"A<|tool_call>call:f{x:<|"|>1"#;
        let all = total(&run(&tok, m, &[], cut));
        assert_eq!(all.content, cut);
    }

    #[test]
    fn without_markers_everything_is_text() {
        let tok = gemma4();
        let text = "<|channel>thought\nhmm<channel|>Hi <|tool_call>call:f{}<tool_call|> é";
        let all = total(&run(&tok, Markers::default(), &[], text));
        assert_eq!(all.content, tok.decode(&tok.encode(text, false).unwrap()));
        assert!(all.reasoning.is_empty() && all.tool_calls.is_empty());
    }

    #[test]
    fn stop_strings_apply_to_the_answer_only() {
        let tok = gemma4();
        let m = Markers::of(&tok);
        let ids = tok
            .encode("<|channel>thought\nsay STOP<channel|>one STOP two", false)
            .unwrap();
        let stops = vec!["STOP".to_string()];
        let mut p = OutputParser::new(&tok, m, &stops);
        let mut all = Delta::default();
        let mut stopped_at = None;
        for (k, &id) in ids.iter().enumerate() {
            all.append(p.push(id));
            if p.stopped() {
                stopped_at = Some(k);
                break;
            }
        }
        all.append(p.finish());
        assert_eq!(all.reasoning, "say STOP");
        assert_eq!(all.content, "one ");
        assert!(stopped_at.unwrap() < ids.len() - 2);
    }

    #[test]
    fn multibyte_text_streams_whole_characters() {
        let tok = gemma4();
        let text = "<|channel>thought\ncafé 🙂<channel|>naïve ✓";
        let deltas = run(&tok, Markers::of(&tok), &[], text);
        let all = total(&deltas);
        assert_eq!(all.reasoning, "café 🙂");
        assert_eq!(all.content, "naïve ✓");
        assert!(deltas.iter().all(|d| !d.content.contains('\u{FFFD}')));
    }
}
