//! Chat templates: the Jinja template a model ships (`tokenizer_config.json`'s `chat_template`,
//! a `chat_template.jinja` file, or GGUF `tokenizer.chat_template`), rendered with minijinja the
//! way transformers' `apply_chat_template` renders it with Jinja2: `trim_blocks` and
//! `lstrip_blocks` on, loop controls, `raise_exception`, Python string and dict methods, and a
//! `tojson` that prints like Python's `json.dumps` (`", "` and `": "` separators, no ASCII or
//! HTML escaping), since templates embed tool schemas with it and the model saw that spelling.

use std::path::Path;

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, ErrorKind};
use serde_json::Value as Json;

use crate::error::{Error, Result};
use crate::formats::gguf::GgufFile;

const TEMPLATE_NAME: &str = "chat";

pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Compiles `source`; a syntax error is reported now, not at the first message.
    pub fn new(source: &str, bos_token: Option<&str>, eos_token: Option<&str>) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        let mut syntax = minijinja::syntax::SyntaxConfig::builder();
        syntax.trim_blocks(true).lstrip_blocks(true);
        env.set_syntax(syntax.build().map_err(|e| Error::Input(format!("chat template: {e}")))?);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<Value, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |fmt: String| -> String { strftime_now(&fmt) });
        env.add_filter("tojson", python_tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| Error::Input(format!("chat template does not compile: {e}")))?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.unwrap_or_default().to_string(),
            eos_token: eos_token.unwrap_or_default().to_string(),
        })
    }

    /// The template of a Hugging Face model directory, if it has one: `chat_template.jinja`, else
    /// `tokenizer_config.json`'s `chat_template` (a string, or a list of named templates of
    /// which `default` is taken).
    pub fn from_dir(dir: &Path) -> Result<Option<ChatTemplate>> {
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: Json = match std::fs::read(&cfg_path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| Error::format(&cfg_path, e.to_string()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Json::Null,
            Err(e) => return Err(Error::io(&cfg_path, e)),
        };
        let special = |key: &str| match &cfg[key] {
            Json::String(s) => Some(s.clone()),
            Json::Object(o) => o.get("content").and_then(|c| c.as_str()).map(str::to_string),
            _ => None,
        };
        let jinja_path = dir.join("chat_template.jinja");
        let source = if jinja_path.is_file() {
            std::fs::read_to_string(&jinja_path).map_err(|e| Error::io(&jinja_path, e))?
        } else {
            match &cfg["chat_template"] {
                Json::String(s) => s.clone(),
                Json::Array(list) => {
                    let named = list.iter().find(|t| t["name"] == "default").or_else(|| list.first());
                    match named.and_then(|t| t["template"].as_str()) {
                        Some(s) => s.to_string(),
                        None => return Err(Error::format(&cfg_path, "chat_template list has no `default` template")),
                    }
                }
                Json::Null => return Ok(None),
                other => return Err(Error::format(&cfg_path, format!("chat_template is {other}, expected a string"))),
            }
        };
        let t = ChatTemplate::new(&source, special("bos_token").as_deref(), special("eos_token").as_deref())
            .map_err(|e| Error::format(dir, e.to_string()))?;
        Ok(Some(t))
    }

    /// `tokenizer.chat_template` of a GGUF file, if present, with its BOS/EOS token texts.
    pub fn from_gguf(f: &GgufFile) -> Result<Option<ChatTemplate>> {
        let Some(source) = f.opt_str("tokenizer.chat_template")? else { return Ok(None) };
        let tokens = f.opt_str_array("tokenizer.ggml.tokens")?.unwrap_or(&[]);
        let token = |key: &str| -> Result<Option<&str>> {
            Ok(f.opt_usize(key)?.and_then(|id| tokens.get(id)).map(|s| s.as_str()))
        };
        let t = ChatTemplate::new(source, token("tokenizer.ggml.bos_token_id")?, token("tokenizer.ggml.eos_token_id")?)
            .map_err(|e| Error::format(f.path(), e.to_string()))?;
        Ok(Some(t))
    }

    /// Renders a conversation. `messages` are objects with at least `role` and `content`, as an
    /// OpenAI-style client sends them; `extra` adds template variables (`enable_thinking`,
    /// `tools`, …).
    pub fn render(&self, messages: &[Json], add_generation_prompt: bool, extra: &serde_json::Map<String, Json>) -> Result<String> {
        let mut ctx = serde_json::Map::new();
        ctx.insert("messages".into(), Json::Array(messages.to_vec()));
        ctx.insert("add_generation_prompt".into(), Json::Bool(add_generation_prompt));
        ctx.insert("bos_token".into(), Json::String(self.bos_token.clone()));
        ctx.insert("eos_token".into(), Json::String(self.eos_token.clone()));
        for (k, v) in extra {
            ctx.insert(k.clone(), v.clone());
        }
        let tmpl = self.env.get_template(TEMPLATE_NAME).map_err(|e| Error::Input(format!("chat template: {e}")))?;
        tmpl.render(Value::from(minijinja::value::Serde(Json::Object(ctx))))
            .map_err(|e| Error::Input(format!("chat template: {e}")))
    }
}

/// `tojson` as transformers defines it for chat templates: `json.dumps(x, ensure_ascii=False,
/// indent=indent)`, with Python's separators.
fn python_tojson(value: Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    write_python_json(&json, indent, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

fn write_python_json(v: &Json, indent: Option<usize>, depth: usize, out: &mut String) {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v {
        Json::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_python_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        Json::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                out.push_str(&Json::String(k.clone()).to_string());
                out.push_str(": ");
                write_python_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// The current UTC date and time for the directives templates use (`%d %b %Y`, `%Y-%m-%d`, …).
fn strftime_now(fmt: &str) -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rem) = ((secs / 86400) as i64, secs % 86400);
    // Civil date from days since 1970-01-01 (proleptic Gregorian).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    const MONTHS: [&str; 12] = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November", "December"];
    const DAYS: [&str; 7] = ["Thursday", "Friday", "Saturday", "Sunday", "Monday", "Tuesday", "Wednesday"];
    let month_name = MONTHS[(month - 1) as usize];
    let weekday = DAYS[days.rem_euclid(7) as usize];
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('B') => out.push_str(month_name),
            Some('b') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(weekday),
            Some('a') => out.push_str(&weekday[..3]),
            Some('H') => out.push_str(&format!("{:02}", rem / 3600)),
            Some('M') => out.push_str(&format!("{:02}", rem % 3600 / 60)),
            Some('S') => out.push_str(&format!("{:02}", rem % 60)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(src: &str, messages: Json, gen: bool) -> Result<String> {
        let t = ChatTemplate::new(src, Some("<s>"), Some("</s>"))?;
        t.render(messages.as_array().unwrap(), gen, &serde_json::Map::new())
    }

    #[test]
    fn jinja2_whitespace_and_python_methods() {
        let src = "{% for m in messages %}\n  {%- if m.role == 'user' %}U:{{ m.content.strip() }}{% else %}{{ m['role'].upper() }}:{{ m.content }}{% endif %}\n{% endfor %}{% if add_generation_prompt %}A:{% endif %}";
        let out = render(src, json!([{"role": "system", "content": "s"}, {"role": "user", "content": "  hi  "}]), true).unwrap();
        // (Jinja2 gives the same: trim_blocks eats the newline after each block tag.)
        assert_eq!(out, "SYSTEM:sU:hiA:");
        let out = render("{% for m in messages %}\n  {{ m.role }}\n{% endfor %}", json!([{"role": "a"}, {"role": "b"}]), false).unwrap();
        assert_eq!(out, "  a\n  b\n");
    }

    #[test]
    fn tojson_prints_like_python() {
        let src = "{{ messages[0].tool | tojson }}|{{ messages[0].tool | tojson(indent=2) }}";
        let out = render(src, json!([{"tool": {"name": "f", "args": [1, "é<"], "e": {}}}]), false).unwrap();
        assert_eq!(out, "{\"name\": \"f\", \"args\": [1, \"é<\"], \"e\": {}}|{\n  \"name\": \"f\",\n  \"args\": [\n    1,\n    \"é<\"\n  ],\n  \"e\": {}\n}");
    }

    #[test]
    fn raise_exception_is_an_error_with_its_message() {
        let src = "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be the user') }}{% endif %}";
        let err = render(src, json!([{"role": "assistant", "content": "x"}]), false).unwrap_err();
        assert!(err.to_string().contains("first message must be the user"), "{err}");
    }

    #[test]
    fn syntax_errors_are_reported_at_load() {
        let err = ChatTemplate::new("{% for m in messages %}", None, None).err().expect("must fail");
        assert!(err.to_string().contains("chat template does not compile"), "{err}");
    }

    #[test]
    fn strftime_now_formats_a_date() {
        let s = strftime_now("%Y-%m-%d %b");
        assert_eq!(s.len(), 14, "{s}");
        assert!(s.starts_with("20"), "{s}");
    }
}
