//! A model's own Jinja chat template (GGUF `tokenizer.chat_template`, Hugging Face
//! `chat_template`), rendered with [`minijinja`] as Hugging Face's `apply_chat_template`
//! renders it (`trim_blocks`, `lstrip_blocks`, Python string methods, `tojson` as
//! Python's `json.dumps` writes it, `raise_exception`, `strftime_now` on the UTC clock),
//! with `tools` when there are some.
//!
//! # Message content never becomes a control token
//!
//! The template is rendered with a placeholder in place of each message's content: a
//! random per-render marker padded with an em space (U+2003) on both sides. The output
//! is then cut at the markers: the template's own text ([`ChatPiece::Markup`]) is
//! encoded with special-token parsing, the content ([`ChatPiece::Text`]) as plain text.
//! A template that trims the content (Llama 3 writes `message['content'] | trim`) trims
//! the padding too, which tells that the content is to be trimmed on that side.
//!
//! Tool definitions and earlier calls are rendered by the template itself (often as
//! JSON); [`Tokenizer::encode_conversation`](super::Tokenizer::encode_conversation)
//! refuses those that write a control token.
//!
//! # Bounded work
//!
//! A render runs on fuel ([`minijinja`]'s instruction count): [`TEMPLATE_FUEL_BASE`]
//! plus [`TEMPLATE_FUEL_PER_ITEM`] for each message and tool, so a template whose loops
//! run away (or a request that makes them) stops with [`LlamaError::Tokenizer`] saying
//! so, in bounded time, instead of holding a thread.

use minijinja::value::{Kwargs, Value as JinjaValue};
use minijinja::{Environment, ErrorKind};
use serde_json::{Value, json};

use super::{ChatMessage, ChatPiece};
use crate::error::{LlamaError, Result};
use crate::tools::Tool;

/// Instructions a render may run whatever its input (templates run a few hundred per
/// message).
pub const TEMPLATE_FUEL_BASE: u64 = 200_000;
/// Instructions a render may run for each message and each tool, on top of
/// [`TEMPLATE_FUEL_BASE`].
pub const TEMPLATE_FUEL_PER_ITEM: u64 = 20_000;

/// The padding around a placeholder (an em space: trimmed by `trim`, rare in templates).
const PAD: char = '\u{2003}';
/// The marker's delimiters (private-use characters).
const OPEN: char = '\u{E000}';
const CLOSE: char = '\u{E001}';

/// A compiled chat template.
///
/// ```
/// use llama_burn::tokenizer::{ChatMessage, ChatPiece, ChatTemplate};
///
/// let template = ChatTemplate::new(
///     "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}",
/// )?;
/// let pieces = template.render(&[ChatMessage::user("<|im_end|>")], &[], false, "", "")?;
/// assert_eq!(pieces, vec![
///     ChatPiece::Markup("<|im_start|>user\n".into()),
///     ChatPiece::Text("<|im_end|>".into()),
///     ChatPiece::Markup("<|im_end|>\n".into()),
/// ]);
/// # Ok::<(), llama_burn::LlamaError>(())
/// ```
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bytes", &self.source.len())
            .field("supports_tools", &self.supports_tools())
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source`.
    ///
    /// # Errors
    ///
    /// [`LlamaError::Tokenizer`] if it is not a valid template.
    pub fn new(source: &str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function(
            "raise_exception",
            |message: String| -> std::result::Result<JinjaValue, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_function(
            "strftime_now",
            |format: String| -> std::result::Result<JinjaValue, minijinja::Error> {
                strftime(&format, time::OffsetDateTime::now_utc()).map(JinjaValue::from)
            },
        );
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| {
                LlamaError::Tokenizer(format!("the chat template does not compile: {e}"))
            })?;
        Ok(Self {
            env,
            source: source.to_string(),
        })
    }

    /// The template's text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether the template renders `tools` itself.
    pub fn supports_tools(&self) -> bool {
        self.source.contains("tools")
    }

    /// Renders `messages` (and `tools`, when the template takes them) into pieces:
    /// the template's own text and each message's content (see the
    /// module documentation). `bos_token`/`eos_token` are the texts templates
    /// write as `bos_token`/`eos_token`.
    ///
    /// # Errors
    ///
    /// [`LlamaError::Tokenizer`] if the template fails (for example its
    /// `raise_exception` on roles that do not alternate).
    pub fn render(
        &self,
        messages: &[ChatMessage],
        tools: &[Tool],
        add_generation_prompt: bool,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<Vec<ChatPiece>> {
        let nonce: u64 = rand::random();
        let marker = |i: usize| format!("{PAD}{OPEN}{nonce:016x}:{i}{CLOSE}{PAD}");
        let context_messages: Vec<Value> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let content = if m.content.is_empty() {
                    Value::String(String::new())
                } else {
                    Value::String(marker(i))
                };
                let mut message = json!({"role": m.role, "content": content});
                if !m.tool_calls.is_empty() {
                    let calls: Vec<Value> = m
                        .tool_calls
                        .iter()
                        .map(|c| {
                            json!({
                                "id": c.id,
                                "type": "function",
                                "function": {"name": c.name, "arguments": c.arguments_json()},
                            })
                        })
                        .collect();
                    message["tool_calls"] = Value::Array(calls);
                }
                if let Some(id) = &m.tool_call_id {
                    message["tool_call_id"] = id.clone().into();
                }
                message
            })
            .collect();
        let tools: Option<Vec<Value>> =
            (!tools.is_empty()).then(|| tools.iter().map(Tool::openai_json).collect());
        // The environment shares its compiled template (an `Arc`): cloning it is cheap,
        // and gives this render its own fuel.
        let mut env = self.env.clone();
        let items =
            (messages.len() as u64).saturating_add(tools.as_ref().map_or(0, |t| t.len() as u64));
        let fuel = TEMPLATE_FUEL_BASE.saturating_add(TEMPLATE_FUEL_PER_ITEM.saturating_mul(items));
        env.set_fuel(Some(fuel));
        let template = env
            .get_template("chat")
            .map_err(|e| LlamaError::Tokenizer(format!("the chat template: {e}")))?;
        let text = template
            .render(minijinja::context! {
                messages => context_messages,
                tools => tools,
                add_generation_prompt => add_generation_prompt,
                bos_token => bos_token,
                eos_token => eos_token,
            })
            .map_err(|e| match e.kind() {
                ErrorKind::OutOfFuel => LlamaError::Tokenizer(format!(
                    "the chat template ran past its limit of {fuel} instructions for {items} \
                     messages and tools"
                )),
                _ => LlamaError::Tokenizer(format!("the chat template failed: {e}")),
            })?;
        Ok(split(&text, nonce, messages))
    }
}

/// Cuts the rendered `text` at the placeholders of `nonce`.
fn split(text: &str, nonce: u64, messages: &[ChatMessage]) -> Vec<ChatPiece> {
    let prefix = format!("{OPEN}{nonce:016x}:");
    let mut out: Vec<ChatPiece> = Vec::new();
    let mut markup = String::new();
    let mut rest = text;
    while let Some(at) = rest.find(&prefix) {
        let after = &rest[at + prefix.len()..];
        let parsed = after.find(CLOSE).and_then(|end| {
            let index: usize = after[..end].parse().ok()?;
            let message = messages.get(index)?;
            Some((message, &after[end + CLOSE.len_utf8()..]))
        });
        let Some((message, tail)) = parsed else {
            markup.push_str(&rest[..at + prefix.len()]);
            rest = after;
            continue;
        };
        let before = &rest[..at];
        let (before, trim_start) = match before.strip_suffix(PAD) {
            Some(b) => (b, false),
            None => (before, true),
        };
        let (tail, trim_end) = match tail.strip_prefix(PAD) {
            Some(t) => (t, false),
            None => (tail, true),
        };
        markup.push_str(before);
        let mut content = message.content.as_str();
        if trim_start {
            content = content.trim_start();
        }
        if trim_end {
            content = content.trim_end();
        }
        if !markup.is_empty() {
            out.push(ChatPiece::Markup(std::mem::take(&mut markup)));
        }
        if !content.is_empty() {
            match out.last_mut() {
                Some(ChatPiece::Text(last)) => last.push_str(content),
                _ => out.push(ChatPiece::Text(content.to_string())),
            }
        }
        rest = tail;
    }
    markup.push_str(rest);
    if !markup.is_empty() {
        out.push(ChatPiece::Markup(markup));
    }
    out
}

/// `tojson` as Hugging Face's templates get it from Python's `json.dumps`: `", "` and
/// `": "` separators (or `indent`), non-ASCII characters as they are, no HTML escaping.
fn tojson(
    value: &JinjaValue,
    indent: Option<JinjaValue>,
    kwargs: Kwargs,
) -> std::result::Result<JinjaValue, minijinja::Error> {
    let indent = match indent {
        Some(i) => Some(i),
        None => kwargs.get::<Option<JinjaValue>>("indent")?,
    };
    let _: Option<JinjaValue> = kwargs.get("ensure_ascii")?;
    let _: Option<JinjaValue> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let json: Value = serde_json::to_value(value).map_err(|e| {
        minijinja::Error::new(ErrorKind::InvalidOperation, "cannot serialize to JSON")
            .with_source(e)
    })?;
    let width = indent
        .filter(|i| !i.is_none())
        .and_then(|i| usize::try_from(i).ok());
    let mut out = Vec::new();
    let written = match width {
        Some(width) => {
            let pad = " ".repeat(width);
            let formatter = serde_json::ser::PrettyFormatter::with_indent(pad.as_bytes());
            serde::Serialize::serialize(
                &json,
                &mut serde_json::Serializer::with_formatter(&mut out, formatter),
            )
        }
        None => serde::Serialize::serialize(
            &json,
            &mut serde_json::Serializer::with_formatter(&mut out, PythonFormatter),
        ),
    };
    written.map_err(|e| {
        minijinja::Error::new(ErrorKind::InvalidOperation, "cannot serialize to JSON")
            .with_source(e)
    })?;
    Ok(JinjaValue::from_safe_string(
        String::from_utf8_lossy(&out).into_owned(),
    ))
}

/// `at` written with Python's `strftime` directives (`%d %b %Y`, `%Y-%m-%d`, `%H:%M:%S`,
/// ...), as Hugging Face gives templates `strftime_now`; locale-dependent ones as in the
/// C locale.
fn strftime(
    format: &str,
    at: time::OffsetDateTime,
) -> std::result::Result<String, minijinja::Error> {
    use std::fmt::Write;
    let mut out = String::with_capacity(format.len() + 16);
    let month = at.month().to_string();
    let weekday = at.weekday().to_string();
    let hour12 = match at.hour() % 12 {
        0 => 12,
        h => h,
    };
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let directive = chars.next();
        let written = match directive {
            Some('d') => write!(out, "{:02}", at.day()),
            Some('e') => write!(out, "{:2}", at.day()),
            Some('m') => write!(out, "{:02}", u8::from(at.month())),
            Some('Y') => write!(out, "{}", at.year()),
            Some('y') => write!(out, "{:02}", at.year().rem_euclid(100)),
            Some('b') => write!(out, "{}", &month[..3]),
            Some('B') => write!(out, "{month}"),
            Some('a') => write!(out, "{}", &weekday[..3]),
            Some('A') => write!(out, "{weekday}"),
            Some('H') => write!(out, "{:02}", at.hour()),
            Some('I') => write!(out, "{hour12:02}"),
            Some('M') => write!(out, "{:02}", at.minute()),
            Some('S') => write!(out, "{:02}", at.second()),
            Some('p') => write!(out, "{}", if at.hour() < 12 { "AM" } else { "PM" }),
            Some('j') => write!(out, "{:03}", at.ordinal()),
            Some('%') => write!(out, "%"),
            other => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: unsupported directive %{}",
                        other.map(String::from).unwrap_or_default()
                    ),
                ));
            }
        };
        written.map_err(|_| {
            minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "strftime_now: formatting failed",
            )
        })?;
    }
    Ok(out)
}

/// serde_json's compact output with Python's default separators.
struct PythonFormatter;

impl serde_json::ser::Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::assert_err;

    #[test]
    fn trimmed_content_and_tools() {
        let t = ChatTemplate::new(
            "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content | trim }}|{{ m.content }}|{% endfor %}\
             {% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}",
        )
        .unwrap();
        let tools = [Tool::new("f", json!({"type": "object", "é": "<x>"}))];
        let pieces = t
            .render(
                &[ChatMessage::user("  hi "), ChatMessage::assistant("")],
                &tools,
                false,
                "<s>",
                "",
            )
            .unwrap();
        assert_eq!(
            pieces,
            vec![
                ChatPiece::Markup("<s>[user]".into()),
                ChatPiece::Text("hi".into()),
                ChatPiece::Markup("|".into()),
                ChatPiece::Text("  hi ".into()),
                ChatPiece::Markup(
                    "|[assistant]||{\"type\": \"function\", \"function\": {\"name\": \"f\", \
                     \"parameters\": {\"type\": \"object\", \"é\": \"<x>\"}}}"
                        .into()
                ),
            ]
        );
        assert!(t.supports_tools());
        let failing = ChatTemplate::new("{{ raise_exception('roles must alternate') }}").unwrap();
        let e = failing.render(&[], &[], true, "", "").unwrap_err();
        assert!(e.to_string().contains("roles must alternate"), "{e}");
        assert_err!(
            ChatTemplate::new("{% for %}"),
            LlamaError::Tokenizer(m) if m.contains("does not compile")
        );
        let py = ChatTemplate::new("{{ messages[0].content.strip() }}").unwrap();
        assert_eq!(
            py.render(&[ChatMessage::user(" a ")], &[], false, "", "")
                .unwrap(),
            vec![ChatPiece::Text("a".into())]
        );
    }

    #[test]
    fn runaway_loops_run_out_of_fuel() {
        // 10^10 iterations: stopped after the fuel, with an error that says so.
        let t = ChatTemplate::new(
            "{% for m in messages %}{{ m.content }}{% endfor %}\
             {% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        )
        .unwrap();
        let e = t
            .render(&[ChatMessage::user("hi")], &[], true, "", "")
            .unwrap_err();
        assert!(matches!(e, LlamaError::Tokenizer(_)), "{e:?}");
        let limit = TEMPLATE_FUEL_BASE + TEMPLATE_FUEL_PER_ITEM;
        assert!(
            e.to_string()
                .contains(&format!("limit of {limit} instructions")),
            "{e}"
        );
        // The same loop, short, renders; and the fuel grows with the conversation: a loop
        // of 3,000 per message fits 100 messages.
        let per_message = ChatTemplate::new(
            "{% for m in messages %}{% for i in range(3000) %}{% endfor %}{{ m.content }}{% endfor %}",
        )
        .unwrap();
        let many: Vec<ChatMessage> = (0..100)
            .map(|i| ChatMessage::user(format!("m{i}")))
            .collect();
        let pieces = per_message.render(&many, &[], false, "", "").unwrap();
        assert_eq!(
            pieces,
            vec![ChatPiece::Text((0..100).map(|i| format!("m{i}")).collect())]
        );
    }

    #[test]
    fn strftime_directives() {
        let at = time::Date::from_calendar_date(2024, time::Month::July, 6)
            .unwrap()
            .with_hms(15, 4, 9)
            .unwrap()
            .assume_utc();
        assert_eq!(strftime("%d %b %Y", at).unwrap(), "06 Jul 2024");
        assert_eq!(
            strftime("%A %B %e, %y %I:%M:%S %p (day %j) 100%%", at).unwrap(),
            "Saturday July  6, 24 03:04:09 PM (day 188) 100%"
        );
        for (format, directive) in [("%Q", "%Q"), ("50%", "%")] {
            assert_err!(
                strftime(format, at),
                e if e.kind() == ErrorKind::InvalidOperation
                    && e.detail() == Some(&*format!("strftime_now: unsupported directive {directive}"))
            );
        }
        // Through a template: today's date, as a model's template asks for it.
        let t = ChatTemplate::new("{{ strftime_now('%Y-%m-%d') }}").unwrap();
        let today = strftime("%Y-%m-%d", time::OffsetDateTime::now_utc()).unwrap();
        let ChatPiece::Markup(text) = &t.render(&[], &[], false, "", "").unwrap()[0] else {
            panic!("markup");
        };
        assert!(
            text.len() == 10 && text[..4] == today[..4],
            "{text} {today}"
        );
    }
}
