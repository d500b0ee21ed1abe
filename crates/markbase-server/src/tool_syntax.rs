//! Gemma 4's tool syntax (gemma4.md §5.3): values are written like JSON but with bare keys and
//! strings between `<|"|>` tokens; declarations `<|tool>declaration:NAME{…}<tool|>`, calls
//! `<|tool_call>call:NAME{…}<tool_call|>`, results `<|tool_response>response:NAME{…}<tool_response|>`.
//! This module writes those texts (for the prompt) and parses a generated call.

use serde_json::{Map, Value};

use crate::openai::FunctionDef;

/// The string delimiter token.
pub const QUOTE: &str = "<|\"|>";

/// Writes `v` in the tool syntax; object keys are sorted, as the template's `dictsort` does.
/// With `upper_types`, the values of `type` keys are upper-cased (declarations do this).
fn write_value(v: &Value, upper_types: bool, out: &mut String) {
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => out.push_str(&n.to_string()),
        Value::String(s) => {
            out.push_str(QUOTE);
            out.push_str(s);
            out.push_str(QUOTE);
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_value(item, upper_types, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(k);
                out.push(':');
                match (&map[k], upper_types && k == "type") {
                    (Value::String(t), true) => {
                        write_value(&Value::String(t.to_uppercase()), false, out)
                    }
                    (other, _) => write_value(other, upper_types, out),
                }
            }
            out.push('}');
        }
    }
}

/// `<|tool>declaration:NAME{description:…,parameters:…}<tool|>`.
pub fn declaration(f: &FunctionDef) -> String {
    let mut out = format!("<|tool>declaration:{}{{", f.name);
    out.push_str("description:");
    write_value(
        &Value::String(f.description.clone().unwrap_or_default()),
        false,
        &mut out,
    );
    if let Some(p) = &f.parameters {
        out.push_str(",parameters:");
        write_value(p, true, &mut out);
    }
    out.push_str("}<tool|>");
    out
}

/// `<|tool_call>call:NAME{…}<tool_call|>` for arguments given as a JSON object text.
pub fn call(name: &str, arguments: &str) -> Result<String, String> {
    let args: Value = serde_json::from_str(if arguments.trim().is_empty() {
        "{}"
    } else {
        arguments
    })
    .map_err(|e| format!("the arguments of the call to {name} are not JSON: {e}"))?;
    if !args.is_object() {
        return Err(format!(
            "the arguments of the call to {name} are not a JSON object"
        ));
    }
    let mut out = format!("<|tool_call>call:{name}");
    write_value(&args, false, &mut out);
    out.push_str("<tool_call|>");
    Ok(out)
}

/// `<|tool_response>response:NAME{…}<tool_response|>`: a JSON object result is written as
/// such, any other text as `{value:<|"|>TEXT<|"|>}`.
pub fn response(name: &str, content: &str) -> String {
    let value = match serde_json::from_str::<Value>(content) {
        Ok(v @ Value::Object(_)) => v,
        _ => {
            let mut m = Map::new();
            m.insert("value".into(), Value::String(content.to_string()));
            Value::Object(m)
        }
    };
    let mut out = format!("<|tool_response>response:{name}");
    write_value(&value, false, &mut out);
    out.push_str("<tool_response|>");
    out
}

/// A generated call's text, cut at the `<|"|>` tokens: text outside strings and string bodies.
#[derive(Clone, Debug, PartialEq)]
pub enum Piece {
    /// Syntax outside strings.
    Text(String),
    /// The body of a `<|"|>…<|"|>` string.
    Quoted(String),
}

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ch(char),
    Str(String),
}

/// Parses the inside of `<|tool_call>…<tool_call|>` (`call:NAME{…}`) into the function name and
/// its arguments object; `None` when it does not follow the syntax.
pub fn parse_call(pieces: &[Piece]) -> Option<(String, Value)> {
    let mut toks = Vec::new();
    for p in pieces {
        match p {
            Piece::Text(t) => toks.extend(t.chars().map(Tok::Ch)),
            Piece::Quoted(s) => toks.push(Tok::Str(s.clone())),
        }
    }
    let mut p = Parser { toks, at: 0 };
    p.skip_ws();
    for c in "call:".chars() {
        p.expect(c)?;
    }
    let mut name = String::new();
    while let Some(Tok::Ch(c)) = p.peek() {
        if *c == '{' {
            break;
        }
        name.push(*c);
        p.at += 1;
    }
    let name = name.trim().to_string();
    let valid = |c: char| c.is_alphanumeric() || "_-.:/".contains(c);
    if name.is_empty() || !name.chars().all(valid) {
        return None;
    }
    let args = p.object()?;
    p.skip_ws();
    (p.at == p.toks.len()).then_some((name, args))
}

struct Parser {
    toks: Vec<Tok>,
    at: usize,
}

impl Parser {
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.at)
    }

    fn skip_ws(&mut self) {
        while matches!(self.peek(), Some(Tok::Ch(c)) if c.is_whitespace()) {
            self.at += 1;
        }
    }

    fn expect(&mut self, want: char) -> Option<()> {
        match self.peek() {
            Some(Tok::Ch(c)) if *c == want => {
                self.at += 1;
                Some(())
            }
            _ => None,
        }
    }

    fn eat(&mut self, want: char) -> bool {
        self.skip_ws();
        self.expect(want).is_some()
    }

    fn object(&mut self) -> Option<Value> {
        self.skip_ws();
        self.expect('{')?;
        let mut map = Map::new();
        if self.eat('}') {
            return Some(Value::Object(map));
        }
        loop {
            self.skip_ws();
            let key = match self.peek()? {
                Tok::Str(s) => {
                    let s = s.clone();
                    self.at += 1;
                    s
                }
                Tok::Ch('"') => self.json_string()?,
                Tok::Ch(_) => {
                    let mut k = String::new();
                    while let Some(Tok::Ch(c)) = self.peek() {
                        if *c == ':' {
                            break;
                        }
                        k.push(*c);
                        self.at += 1;
                    }
                    k.trim().to_string()
                }
            };
            if key.is_empty() || !self.eat(':') {
                return None;
            }
            let value = self.value()?;
            map.insert(key, value);
            if self.eat(',') {
                continue;
            }
            return self.eat('}').then_some(Value::Object(map));
        }
    }

    fn array(&mut self) -> Option<Value> {
        self.expect('[')?;
        let mut items = Vec::new();
        if self.eat(']') {
            return Some(Value::Array(items));
        }
        loop {
            items.push(self.value()?);
            if self.eat(',') {
                continue;
            }
            return self.eat(']').then_some(Value::Array(items));
        }
    }

    fn value(&mut self) -> Option<Value> {
        self.skip_ws();
        match self.peek()? {
            Tok::Str(s) => {
                let v = Value::String(s.clone());
                self.at += 1;
                Some(v)
            }
            Tok::Ch('{') => self.object(),
            Tok::Ch('[') => self.array(),
            Tok::Ch('"') => self.json_string().map(Value::String),
            Tok::Ch(_) => {
                let mut raw = String::new();
                while let Some(Tok::Ch(c)) = self.peek() {
                    if matches!(c, ',' | '}' | ']') {
                        break;
                    }
                    raw.push(*c);
                    self.at += 1;
                }
                let raw = raw.trim();
                match raw {
                    "" => None,
                    "true" => Some(Value::Bool(true)),
                    "false" => Some(Value::Bool(false)),
                    "null" | "None" => Some(Value::Null),
                    _ => Some(match serde_json::from_str::<serde_json::Number>(raw) {
                        Ok(n) => Value::Number(n),
                        Err(_) => Value::String(raw.to_string()),
                    }),
                }
            }
        }
    }

    /// A JSON-quoted string (some outputs quote with `"` instead of `<|"|>`).
    fn json_string(&mut self) -> Option<String> {
        let mut raw = String::new();
        self.expect('"')?;
        raw.push('"');
        let mut escaped = false;
        loop {
            let Tok::Ch(c) = self.peek()? else {
                return None;
            };
            let c = *c;
            self.at += 1;
            raw.push(c);
            match (escaped, c) {
                (false, '\\') => escaped = true,
                (false, '"') => break,
                _ => escaped = false,
            }
        }
        serde_json::from_str(&raw).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Cuts a call text at the quote delimiters, as the output parser does with the token.
    fn pieces(text: &str) -> Vec<Piece> {
        text.split(QUOTE)
            .enumerate()
            .map(|(i, s)| {
                if i % 2 == 1 {
                    Piece::Quoted(s.to_string())
                } else {
                    Piece::Text(s.to_string())
                }
            })
            .collect()
    }

    #[test]
    fn parses_calls_with_every_value_kind() {
        let text = r#"call:get_weather{city:<|"|>Paris, {FR}<|"|>,days:3,metric:true,ratio:-0.5,extra:null,tags:[<|"|>a<|"|>,<|"|>b<|"|>],nested:{k:<|"|>v<|"|>,n:[1,{x:2}]}}"#;
        let (name, args) = parse_call(&pieces(text)).unwrap();
        assert_eq!(name, "get_weather");
        assert_eq!(
            args,
            json!({"city": "Paris, {FR}", "days": 3, "metric": true, "ratio": -0.5,
                   "extra": null, "tags": ["a", "b"], "nested": {"k": "v", "n": [1, {"x": 2}]}})
        );
        let (name, args) = parse_call(&pieces("call:ping{}")).unwrap();
        assert_eq!((name.as_str(), args), ("ping", json!({})));
        let (_, args) = parse_call(&pieces(r#"call:f{"q":"a \"b\""}"#)).unwrap();
        assert_eq!(args, json!({"q": "a \"b\""}));
    }

    #[test]
    fn rejects_malformed_calls() {
        for bad in [
            "f{a:1}",
            "call:{a:1}",
            "call:bad name{a:1}",
            "call:f{a:1",
            "call:f{a:}",
            "call:f{a:1} trailing",
            r#"call:f{a:<|"|>open"#,
            "call:f{a:[1,2}",
        ] {
            assert_eq!(parse_call(&pieces(bad)), None, "{bad}");
        }
    }

    #[test]
    fn written_calls_parse_back() {
        let args = r#"{"b": [1, "two", {"c": false}], "a": "x y", "n": null}"#;
        let text = call("f_1", args).unwrap();
        assert_eq!(
            text,
            r#"<|tool_call>call:f_1{a:<|"|>x y<|"|>,b:[1,<|"|>two<|"|>,{c:false}],n:null}<tool_call|>"#
        );
        let inner = text
            .strip_prefix("<|tool_call>")
            .and_then(|t| t.strip_suffix("<tool_call|>"))
            .unwrap();
        let (name, parsed) = parse_call(&pieces(inner)).unwrap();
        assert_eq!(name, "f_1");
        assert_eq!(parsed, serde_json::from_str::<Value>(args).unwrap());
        assert!(call("f", "[1]").is_err());
        assert!(call("f", "{").is_err());
        assert_eq!(call("f", "").unwrap(), "<|tool_call>call:f{}<tool_call|>");
    }

    #[test]
    fn responses_and_declarations() {
        assert_eq!(
            response("f", "sunny"),
            r#"<|tool_response>response:f{value:<|"|>sunny<|"|>}<tool_response|>"#
        );
        assert_eq!(
            response("f", r#"{"temp": 21}"#),
            "<|tool_response>response:f{temp:21}<tool_response|>"
        );
        let f = FunctionDef {
            name: "get_weather".into(),
            description: Some("Weather now".into()),
            parameters: Some(json!({"type": "object",
                "properties": {"city": {"type": "string", "description": "City"}},
                "required": ["city"]})),
        };
        assert_eq!(
            declaration(&f),
            r#"<|tool>declaration:get_weather{description:<|"|>Weather now<|"|>,parameters:{properties:{city:{description:<|"|>City<|"|>,type:<|"|>STRING<|"|>}},required:[<|"|>city<|"|>],type:<|"|>OBJECT<|"|>}}<tool|>"#
        );
    }
}
