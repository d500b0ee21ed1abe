//! Chat templates: the model's own Jinja template (GGUF `tokenizer.chat_template`, HF
//! `tokenizer_config.json` / `chat_template.jinja`) rendered with minijinja in the way HF
//! renders them (trim_blocks, lstrip_blocks, `raise_exception`, common Python string and dict
//! methods), or a built-in Gemma turn template when a file has none.

use std::path::Path;

use minijinja::value::{Value, ValueKind};
use minijinja::{Environment, ErrorKind, State};
use serde::Serialize;

use crate::gguf::GgufFile;
use crate::{Error, Result};

const NAME: &str = "chat";

/// The Gemma 3 turn format (gemma3.md §4.3): a leading system message is folded into the
/// first user turn after a blank line, `assistant` is rendered as `model`, message text is
/// trimmed, roles must alternate, and the generation prompt is `<start_of_turn>model\n`.
const BUILTIN_GEMMA: &str = r#"{{- bos_token -}}
{%- if messages and messages[0].role == "system" -%}
  {%- set prefix = messages[0].content ~ "\n\n" -%}
  {%- set turns = messages[1:] -%}
  {%- if not turns -%}
    {{- raise_exception("a system message must be followed by a user message") -}}
  {%- endif -%}
{%- else -%}
  {%- set prefix = "" -%}
  {%- set turns = messages -%}
{%- endif -%}
{%- for m in turns -%}
  {%- if loop.index0 is even -%}
    {%- if m.role != "user" -%}
      {{- raise_exception("message " ~ loop.index0 ~ " should be from the user, not " ~ m.role) -}}
    {%- endif -%}
    {{- "<start_of_turn>user\n" ~ (prefix if loop.first else "") ~ (m.content | trim) ~ "<end_of_turn>\n" -}}
  {%- else -%}
    {%- if m.role != "assistant" and m.role != "model" -%}
      {{- raise_exception("message " ~ loop.index0 ~ " should be from the model, not " ~ m.role) -}}
    {%- endif -%}
    {{- "<start_of_turn>model\n" ~ (m.content | trim) ~ "<end_of_turn>\n" -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- "<start_of_turn>model\n" -}}
{%- endif -%}
"#;

/// One chat message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` (or `model`).
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// A message from its role and text.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    builtin: bool,
}

impl ChatTemplate {
    /// Compiles a Jinja chat template.
    pub fn from_source(src: &str) -> Result<Self> {
        Self::compile(src, false)
    }

    /// The built-in Gemma 3 turn template, for files that carry none.
    pub fn builtin_gemma() -> Self {
        match Self::compile(BUILTIN_GEMMA, true) {
            Ok(t) => t,
            // The source is a constant covered by the tests below.
            Err(e) => panic!("built-in Gemma template does not compile: {e}"),
        }
    }

    /// The GGUF file's `tokenizer.chat_template`, else the built-in Gemma template.
    pub fn for_gguf(gguf: &GgufFile) -> Result<Self> {
        match gguf.get_str("tokenizer.chat_template")? {
            Some(src) => Self::from_source(src).map_err(|e| {
                Error::Template(format!(
                    "{}: tokenizer.chat_template: {e}",
                    gguf.path().display()
                ))
            }),
            None => Ok(Self::builtin_gemma()),
        }
    }

    /// The template of an HF model directory: `chat_template.jinja`, else the
    /// `chat_template` of `tokenizer_config.json` (a string, or the entry named `default`
    /// of a list); `None` when the directory has neither.
    pub fn for_hf_dir(dir: &Path) -> Result<Option<Self>> {
        let jinja = dir.join("chat_template.jinja");
        match std::fs::read_to_string(&jinja) {
            Ok(src) => {
                return Self::from_source(&src)
                    .map(Some)
                    .map_err(|e| Error::Template(format!("{}: {e}", jinja.display())))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(jinja, e)),
        }
        let cfg = dir.join("tokenizer_config.json");
        let text = match std::fs::read_to_string(&cfg) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io(cfg, e)),
        };
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::Template(format!("{}: {e}", cfg.display())))?;
        let src = match json.get("chat_template") {
            None | Some(serde_json::Value::Null) => return Ok(None),
            Some(serde_json::Value::String(s)) => s.as_str(),
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template")?.as_str())
                .ok_or_else(|| {
                    Error::Template(format!(
                        "{}: chat_template list has no entry named 'default'",
                        cfg.display()
                    ))
                })?,
            Some(other) => {
                return Err(Error::Template(format!(
                    "{}: chat_template should be a string or a list, is {other}",
                    cfg.display()
                )))
            }
        };
        Self::from_source(src)
            .map(Some)
            .map_err(|e| Error::Template(format!("{}: {e}", cfg.display())))
    }

    /// Whether this is the built-in template rather than one read from a file.
    pub fn is_builtin(&self) -> bool {
        self.builtin
    }

    /// Renders a conversation. The Gemma templates start the text with `bos_token`, so the
    /// caller encodes the result with `add_bos = false`.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<String> {
        self.render_with_thinking(messages, add_generation_prompt, bos_token, eos_token, None)
    }

    /// Like [`ChatTemplate::render`], also passing `enable_thinking` to the template when
    /// given (Gemma 4's thinking mode; `None` leaves the template's own default, and templates
    /// that do not read the variable ignore it).
    pub fn render_with_thinking(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        bos_token: &str,
        eos_token: &str,
        enable_thinking: Option<bool>,
    ) -> Result<String> {
        let tmpl = self
            .env
            .get_template(NAME)
            .map_err(|e| Error::Template(describe(&e)))?;
        let base = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => bos_token,
            eos_token => eos_token,
        };
        let ctx = match enable_thinking {
            Some(on) => minijinja::context! { enable_thinking => on, ..base },
            None => base,
        };
        tmpl.render(ctx).map_err(|e| Error::Template(describe(&e)))
    }

    fn compile(src: &str, builtin: bool) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_function("raise_exception", raise_exception);
        env.set_unknown_method_callback(python_method);
        env.add_template_owned(NAME, src.to_owned())
            .map_err(|e| Error::Template(describe(&e)))?;
        Ok(ChatTemplate { env, builtin })
    }
}

/// A minijinja error with its detail and line.
fn describe(e: &minijinja::Error) -> String {
    let mut s = e.kind().to_string();
    if let Some(d) = e.detail() {
        s += ": ";
        s += d;
    }
    if let Some(line) = e.line() {
        s += &format!(" (line {line})");
    }
    s
}

/// `raise_exception(msg)`: templates call it to reject a conversation.
fn raise_exception(msg: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

/// The Python string and dict methods HF templates call (`.strip()`, `.startswith()`,
/// `.split()`, `.items()`, `.get()`, …).
fn python_method(
    _state: &State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> std::result::Result<Value, minijinja::Error> {
    let bad = || minijinja::Error::from(ErrorKind::UnknownMethod);
    let str_arg = |i: usize| -> std::result::Result<Option<String>, minijinja::Error> {
        match args.get(i) {
            None => Ok(None),
            Some(v) if v.is_none() || v.is_undefined() => Ok(None),
            Some(v) => v.as_str().map(|s| Some(s.to_owned())).ok_or_else(|| {
                minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!("{method}() expects a string argument"),
                )
            }),
        }
    };
    match value.kind() {
        ValueKind::String => {
            let s = value.as_str().unwrap_or_default();
            let chars = str_arg(0)?;
            let is_strip = |c: char| match &chars {
                Some(set) => set.contains(c),
                None => c.is_whitespace(),
            };
            Ok(match method {
                "strip" => Value::from(s.trim_matches(is_strip)),
                "lstrip" => Value::from(s.trim_start_matches(is_strip)),
                "rstrip" => Value::from(s.trim_end_matches(is_strip)),
                "startswith" => Value::from(s.starts_with(chars.as_deref().ok_or_else(bad)?)),
                "endswith" => Value::from(s.ends_with(chars.as_deref().ok_or_else(bad)?)),
                "upper" => Value::from(s.to_uppercase()),
                "lower" => Value::from(s.to_lowercase()),
                "replace" => {
                    let to = str_arg(1)?.ok_or_else(bad)?;
                    Value::from(s.replace(chars.as_deref().ok_or_else(bad)?, &to))
                }
                "split" => match chars {
                    Some(sep) => Value::from_iter(s.split(sep.as_str()).map(Value::from)),
                    None => Value::from_iter(s.split_whitespace().map(Value::from)),
                },
                _ => return Err(bad()),
            })
        }
        ValueKind::Map => match method {
            "items" => Ok(Value::from_iter(value.try_iter()?.map(|k| {
                let v = value.get_item(&k).unwrap_or_default();
                Value::from(vec![k, v])
            }))),
            "keys" => Ok(Value::from_iter(value.try_iter()?)),
            "values" => Ok(Value::from_iter(
                value
                    .try_iter()?
                    .map(|k| value.get_item(&k).unwrap_or_default()),
            )),
            "get" => {
                let key = args.first().ok_or_else(bad)?;
                let found = value.get_item(key)?;
                Ok(if found.is_undefined() {
                    args.get(1).cloned().unwrap_or(Value::from(()))
                } else {
                    found
                })
            }
            _ => Err(bad()),
        },
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs(list: &[(&str, &str)]) -> Vec<ChatMessage> {
        list.iter().map(|&(r, c)| ChatMessage::new(r, c)).collect()
    }

    #[test]
    fn builtin_gemma_exact_text() {
        let t = ChatTemplate::builtin_gemma();
        assert!(t.is_builtin());
        let text = t
            .render(
                &msgs(&[
                    ("system", "Be brief."),
                    ("user", "  Hi there \n"),
                    ("assistant", "Hello!"),
                    ("user", "Bye"),
                ]),
                true,
                "<bos>",
                "<eos>",
            )
            .unwrap();
        assert_eq!(
            text,
            "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n\
             <start_of_turn>model\nHello!<end_of_turn>\n\
             <start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
        );
        let text = t
            .render(&msgs(&[("user", "x")]), false, "<bos>", "<eos>")
            .unwrap();
        assert_eq!(text, "<bos><start_of_turn>user\nx<end_of_turn>\n");
    }

    #[test]
    fn builtin_gemma_rejects_bad_roles() {
        let t = ChatTemplate::builtin_gemma();
        for bad in [
            msgs(&[("user", "a"), ("user", "b")]),
            msgs(&[("assistant", "a")]),
            msgs(&[("system", "only")]),
            msgs(&[("user", "a"), ("system", "b")]),
        ] {
            let e = t.render(&bad, true, "<bos>", "<eos>").unwrap_err();
            assert!(matches!(e, Error::Template(_)), "{e}");
        }
    }

    #[test]
    fn python_methods_and_errors() {
        let t = ChatTemplate::from_source(
            "{{ messages[0].content.strip('x').upper() }}|{{ ' a b '.split() | join(',') }}|\
             {{ messages[0].role.startswith('us') }}|{% for k, v in {'a': 1}.items() %}{{ k }}={{ v }}{% endfor %}",
        )
        .unwrap();
        assert!(!t.is_builtin());
        let out = t
            .render(&msgs(&[("user", "xxhixx")]), false, "", "")
            .unwrap();
        assert_eq!(out, "HI|a,b|True|a=1");
        let e = ChatTemplate::from_source("{% if %}").err().unwrap();
        assert!(e.to_string().contains("line 1"), "{e}");
        let t = ChatTemplate::from_source("{{ raise_exception('no tools here') }}").unwrap();
        let e = t.render(&[], false, "", "").unwrap_err();
        assert!(e.to_string().contains("no tools here"), "{e}");
    }
}
