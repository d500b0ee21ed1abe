//! An OpenAI conversation → the model's chat template → prompt token ids.
//!
//! Messages become the template's `{role, content}` turns: `developer` is `system`, text parts
//! are joined, consecutive turns of one role are merged (templates such as Gemma 3's require
//! alternation). On a model with Gemma 4's tool syntax, tool declarations are written into the
//! system turn, an assistant's tool calls and the tool results that answer them into its model
//! turn (gemma4.md §5.3). Without that syntax (Gemma 3) tool results are user turns and earlier
//! calls are written as JSON text; declaring tools is refused.

use markbase_core::tokenizer::{ChatMessage, ChatTemplate, Tokenizer};

use crate::error::ApiError;
use crate::openai::{ChatRequest, Content, Message};
use crate::tool_syntax;

/// What the prompt builder needs to know about the model.
pub struct PromptModel<'a> {
    /// The tokenizer.
    pub tokenizer: &'a Tokenizer,
    /// The chat template.
    pub template: &'a ChatTemplate,
    /// Whether the model has Gemma 4's tool syntax.
    pub has_tools: bool,
}

/// The text of a message's content (null = empty).
fn text_of(m: &Message, index: usize) -> Result<String, ApiError> {
    match &m.content {
        None => Ok(String::new()),
        Some(Content::Text(s)) => Ok(s.clone()),
        Some(Content::Parts(parts)) => {
            let mut out = String::new();
            for p in parts {
                match (p.kind.as_str(), &p.text) {
                    ("text", Some(t)) => out.push_str(t),
                    ("text", None) => {
                        return Err(ApiError::invalid_param(
                            &format!("messages[{index}].content"),
                            "a text part has no text",
                        ))
                    }
                    (other, _) => {
                        return Err(ApiError::invalid_param(
                            &format!("messages[{index}].content"),
                            format!(
                                "content parts of type '{other}' are not supported (text only)"
                            ),
                        ))
                    }
                }
            }
            Ok(out)
        }
    }
}

/// Appends a turn, merging it into the previous one of the same role.
fn push_turn(turns: &mut Vec<ChatMessage>, role: &str, text: String) {
    match turns.last_mut() {
        Some(last) if last.role == role => {
            if !last.content.is_empty() && !text.is_empty() {
                last.content.push_str("\n\n");
            }
            last.content.push_str(&text);
        }
        _ => turns.push(ChatMessage::new(role, text)),
    }
}

/// The template turns of a chat request.
pub fn turns(req: &ChatRequest, has_tools: bool) -> Result<Vec<ChatMessage>, ApiError> {
    if req.messages.is_empty() {
        return Err(ApiError::invalid_param(
            "messages",
            "messages must not be empty",
        ));
    }
    let mut turns: Vec<ChatMessage> = Vec::new();
    // Tool-call id → function name, to name the results.
    let mut call_names: Vec<(String, String)> = Vec::new();
    for (i, m) in req.messages.iter().enumerate() {
        let text = text_of(m, i)?;
        match m.role.as_str() {
            "system" | "developer" => push_turn(&mut turns, "system", text),
            "user" => push_turn(&mut turns, "user", text),
            "assistant" => {
                let mut body = text;
                for (k, call) in m.tool_calls.iter().flatten().enumerate() {
                    let f = &call.function;
                    if let Some(id) = &call.id {
                        call_names.push((id.clone(), f.name.clone()));
                    }
                    let written = if has_tools {
                        tool_syntax::call(&f.name, &f.arguments).map_err(|e| {
                            ApiError::invalid_param(
                                &format!("messages[{i}].tool_calls[{k}].function.arguments"),
                                e,
                            )
                        })?
                    } else {
                        serde_json::json!({"name": f.name, "arguments": f.arguments}).to_string()
                    };
                    if !body.is_empty() && !has_tools {
                        body.push('\n');
                    }
                    body.push_str(&written);
                }
                push_turn(&mut turns, "assistant", body);
            }
            "tool" => {
                if has_tools {
                    let name = m
                        .tool_call_id
                        .as_ref()
                        .and_then(|id| call_names.iter().find(|(c, _)| c == id))
                        .map(|(_, n)| n.clone())
                        .or_else(|| m.name.clone())
                        .ok_or_else(|| {
                            ApiError::invalid_param(
                                &format!("messages[{i}].tool_call_id"),
                                "a tool message must answer a tool call of an earlier assistant message",
                            )
                        })?;
                    // The result belongs to the model turn that made the call.
                    match turns.last_mut() {
                        Some(last) if last.role == "assistant" => {
                            last.content.push_str(&tool_syntax::response(&name, &text))
                        }
                        _ => return Err(ApiError::invalid_param(
                            &format!("messages[{i}]"),
                            "a tool message must follow the assistant message that called the tool",
                        )),
                    }
                } else {
                    push_turn(&mut turns, "user", text);
                }
            }
            other => {
                return Err(ApiError::invalid_param(
                    &format!("messages[{i}].role"),
                    format!("unknown role '{other}' (system, developer, user, assistant or tool)"),
                ))
            }
        }
    }
    let declared = declared_tools(req)?;
    if !declared.is_empty() {
        if !has_tools {
            return Err(ApiError::invalid_param(
                "tools",
                "this model has no tool-calling format; send the request without tools",
            ));
        }
        let block: String = declared
            .iter()
            .map(|f| tool_syntax::declaration(f))
            .collect();
        match turns.first_mut() {
            Some(first) if first.role == "system" => first.content.push_str(&block),
            _ => turns.insert(0, ChatMessage::new("system", block)),
        }
    }
    Ok(turns)
}

/// The tools to declare: none when `tool_choice` is `none`; `required` and named choices are
/// refused (the engine has no constrained decoding).
fn declared_tools(req: &ChatRequest) -> Result<Vec<&crate::openai::FunctionDef>, ApiError> {
    let Some(tools) = req.tools.as_ref().filter(|t| !t.is_empty()) else {
        return Ok(Vec::new());
    };
    match &req.tool_choice {
        None => {}
        Some(serde_json::Value::String(s)) if s == "auto" => {}
        Some(serde_json::Value::String(s)) if s == "none" => return Ok(Vec::new()),
        Some(_) => {
            return Err(ApiError::invalid_param(
                "tool_choice",
                "only tool_choice 'auto' and 'none' are supported",
            ))
        }
    }
    tools
        .iter()
        .enumerate()
        .map(|(i, t)| {
            if t.kind != "function" {
                return Err(ApiError::invalid_param(
                    &format!("tools[{i}].type"),
                    "only function tools are supported",
                ));
            }
            Ok(&t.function)
        })
        .collect()
}

/// The prompt ids of a chat request: turns rendered with the model's template (generation
/// prompt added, `enable_thinking` passed when given) and encoded.
pub fn chat_prompt(model: &PromptModel<'_>, req: &ChatRequest) -> Result<Vec<u32>, ApiError> {
    let turns = turns(req, model.has_tools)?;
    let tok = model.tokenizer;
    let text_of = |id: Option<u32>, fallback: &str| {
        id.and_then(|i| tok.token_text(i))
            .unwrap_or(fallback)
            .to_string()
    };
    let thinking = req
        .chat_template_kwargs
        .as_ref()
        .and_then(|k| k.enable_thinking);
    let text = model
        .template
        .render_with_thinking(
            &turns,
            true,
            &text_of(tok.bos_id(), "<bos>"),
            &text_of(tok.eos_id(), "<eos>"),
            thinking,
        )
        .map_err(|e| {
            ApiError::invalid_param("messages", format!("cannot render the conversation: {e}"))
        })?;
    tok.encode(&text, false).map_err(|e| {
        ApiError::invalid_param("messages", format!("cannot tokenize the conversation: {e}"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(json: serde_json::Value) -> ChatRequest {
        serde_json::from_value(json).unwrap()
    }

    fn pairs(t: &[ChatMessage]) -> Vec<(&str, &str)> {
        t.iter()
            .map(|m| (m.role.as_str(), m.content.as_str()))
            .collect()
    }

    #[test]
    fn roles_map_and_merge() {
        let r = req(serde_json::json!({"messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "user", "content": "c"},
            {"role": "assistant", "content": "d"},
        ]}));
        let t = turns(&r, false).unwrap();
        assert_eq!(
            pairs(&t),
            [
                ("system", "Be brief."),
                ("user", "ab\n\nc"),
                ("assistant", "d")
            ]
        );
    }

    #[test]
    fn tool_history_without_tool_syntax() {
        let r = req(serde_json::json!({"messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{\"c\":1}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ]}));
        let t = turns(&r, false).unwrap();
        assert_eq!(
            pairs(&t),
            [
                ("user", "weather?"),
                ("assistant", r#"{"arguments":"{\"c\":1}","name":"w"}"#),
                ("user", "sunny")
            ]
        );
        let mut with_tools = r;
        with_tools.tools = serde_json::from_value(serde_json::json!([
            {"type": "function", "function": {"name": "w"}}]))
        .unwrap();
        assert_eq!(
            turns(&with_tools, false).unwrap_err().param.as_deref(),
            Some("tools")
        );
    }

    #[test]
    fn tool_history_in_gemma4_syntax() {
        let r = req(serde_json::json!({
            "messages": [
                {"role": "system", "content": "S"},
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{\"city\":\"Oslo\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            ],
            "tools": [{"type": "function", "function": {"name": "w", "description": "Weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
        }));
        let t = turns(&r, true).unwrap();
        assert_eq!(
            pairs(&t),
            [
                (
                    "system",
                    r#"S<|tool>declaration:w{description:<|"|>Weather<|"|>,parameters:{properties:{city:{type:<|"|>STRING<|"|>}},type:<|"|>OBJECT<|"|>}}<tool|>"#
                ),
                ("user", "weather?"),
                (
                    "assistant",
                    r#"<|tool_call>call:w{city:<|"|>Oslo<|"|>}<tool_call|><|tool_response>response:w{value:<|"|>sunny<|"|>}<tool_response|>"#
                ),
            ]
        );
    }

    #[test]
    fn bad_conversations_name_the_field() {
        for (json, param) in [
            (serde_json::json!({"messages": []}), "messages"),
            (
                serde_json::json!({"messages": [{"role": "robot", "content": "x"}]}),
                "messages[0].role",
            ),
            (
                serde_json::json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
                "messages[0].content",
            ),
            (
                serde_json::json!({"messages": [{"role": "tool", "tool_call_id": "x", "content": "1"}]}),
                "messages[0].tool_call_id",
            ),
            (
                serde_json::json!({"messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}),
                "tool_choice",
            ),
        ] {
            let e = turns(&req(json.clone()), true).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{json}");
        }
    }

    #[test]
    fn gemma4_template_renders_tools_and_thinking_as_special_tokens() {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/gemma4/e4b_like");
        let tokenizer = Tokenizer::from_hf_file(&dir.join("tokenizer.json")).unwrap();
        let template = ChatTemplate::for_hf_dir(&dir).unwrap().unwrap();
        let model = PromptModel {
            tokenizer: &tokenizer,
            template: &template,
            has_tools: true,
        };
        let r = req(serde_json::json!({
            "messages": [
                {"role": "system", "content": "S"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{\"n\":1}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            ],
            "tools": [{"type": "function", "function": {"name": "w"}}],
            "chat_template_kwargs": {"enable_thinking": true}
        }));
        let ids = chat_prompt(&model, &r).unwrap();
        // <bos>, <|think|>, the tool tokens and the string delimiter are single special ids.
        assert_eq!(ids[0], 2);
        for special in [98, 46, 47, 48, 49, 50, 51, 52, 105, 106] {
            assert!(ids.contains(&special), "id {special} missing from {ids:?}");
        }
        let want = concat!(
            "<|turn>system\n<|think|>\nS<|tool>declaration:w{description:<|\"|><|\"|>}<tool|><turn|>\n",
            "<|turn>user\nhi<turn|>\n",
            "<|turn>model\n<|tool_call>call:w{n:1}<tool_call|>",
            "<|tool_response>response:w{value:<|\"|>ok<|\"|>}<tool_response|><turn|>\n",
            "<|turn>model\n"
        );
        assert_eq!(
            ids,
            tokenizer.encode(&format!("<bos>{want}"), false).unwrap()
        );
    }
}
