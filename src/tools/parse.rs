//! Reading tool calls out of a model's output as it streams.
//!
//! [`ToolCallParser`] takes the output's text piece by piece and gives
//! [`ToolCallEvent`]s: text that is not a call ([`ToolCallEvent::Content`]), the start of
//! a call with its name ([`ToolCallEvent::Start`]) and then its arguments' JSON text in
//! fragments ([`ToolCallEvent::Arguments`]) as soon as they arrive, as OpenAI streams
//! `tool_calls` deltas. Text that may be the start of a call is held back until it is
//! known not to be one.
//!
//! A call is read in the layout constrained decoding writes (`{"name": ..., "arguments":
//! {...}}`, name first) as it streams; any other order or a non-object argument is read
//! once the whole object has arrived. A call that is not valid JSON stays text.
//!
//! ```
//! use llama_burn::tools::ToolFormat;
//! use llama_burn::tools::parse::{ToolCallParser, ToolCallEvent, collect};
//!
//! let mut parser = ToolCallParser::new(ToolFormat::Hermes);
//! let mut events = parser.push("<tool_call>\n{\"name\": \"f\", \"argu");
//! events.extend(parser.push("ments\": {\"x\": 1}}\n</tool_call>"));
//! events.extend(parser.finish());
//! let (content, calls) = collect(events);
//! assert_eq!(content, "");
//! assert_eq!(calls[0].name, "f");
//! assert_eq!(calls[0].arguments, "{\"x\": 1}");
//! ```

use serde_json::Value;

use super::{ToolCall, ToolFormat, new_call_id};

/// What the parser read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolCallEvent {
    /// Text that is not a call.
    Content(String),
    /// Call `index` (0, 1, ...) starts: its id and function name.
    Start {
        /// The call's index in the answer.
        index: usize,
        /// Its fresh id (`call_...`).
        id: String,
        /// The function.
        name: String,
    },
    /// More of call `index`'s arguments (JSON text).
    Arguments {
        /// The call's index.
        index: usize,
        /// The next piece of the arguments.
        fragment: String,
    },
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Outside calls (Hermes: looking for `<tool_call>`; Llama: at the start).
    Text,
    /// Llama: the answer is text, not a call.
    Plain,
    /// After an opener: reading `{"name": "...", "arguments": `.
    Header,
    /// Streaming the arguments object.
    Arguments {
        depth: usize,
        in_string: bool,
        escape: bool,
    },
    /// A call in another layout: waiting for its whole object.
    Whole,
    /// After the arguments: the object's `}` and (Hermes) `</tool_call>`.
    Tail,
}

/// A streaming reader of tool calls (see the [module](self) documentation).
#[derive(Debug)]
pub struct ToolCallParser {
    format: ToolFormat,
    state: State,
    buf: String,
    /// Whitespace held back: dropped if a call follows, sent with the next text.
    held: String,
    calls: usize,
}

impl ToolCallParser {
    /// A parser of calls written in `format`.
    pub fn new(format: ToolFormat) -> Self {
        Self {
            format,
            state: State::Text,
            buf: String::new(),
            held: String::new(),
            calls: 0,
        }
    }

    /// Calls started so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// Reads the next piece of output.
    pub fn push(&mut self, text: &str) -> Vec<ToolCallEvent> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        while self.step(&mut out, false) {}
        out
    }

    /// The output ended: what was held back, as calls or text.
    pub fn finish(&mut self) -> Vec<ToolCallEvent> {
        let mut out = Vec::new();
        while self.step(&mut out, true) {}
        match self.state {
            State::Text | State::Plain | State::Tail | State::Arguments { .. } => {
                let rest = std::mem::take(&mut self.buf);
                if matches!(self.state, State::Text | State::Plain) {
                    self.content(&mut out, &rest);
                }
            }
            State::Header | State::Whole => {
                // A call cut short (no closer): whatever parses is a call, else text.
                let rest = std::mem::take(&mut self.buf);
                if !self.whole_call(&mut out, rest.trim()) {
                    let opener = match self.format {
                        ToolFormat::Hermes => OPEN,
                        ToolFormat::Llama3Json => "",
                    };
                    self.content(&mut out, &format!("{opener}{rest}"));
                }
            }
        }
        if self.calls == 0 && !self.held.is_empty() {
            let held = std::mem::take(&mut self.held);
            out.push(ToolCallEvent::Content(held));
        }
        self.state = State::Text;
        out
    }

    /// Sends `text` as content; trailing whitespace is held back (dropped if a call
    /// follows).
    fn content(&mut self, out: &mut Vec<ToolCallEvent>, text: &str) {
        self.held.push_str(text);
        let end = self.held.trim_end().len();
        if end > 0 {
            let rest = self.held.split_off(end);
            out.push(ToolCallEvent::Content(std::mem::replace(
                &mut self.held,
                rest,
            )));
        }
    }

    fn start_call(&mut self, out: &mut Vec<ToolCallEvent>, name: String) -> usize {
        self.held.clear();
        let index = self.calls;
        self.calls += 1;
        out.push(ToolCallEvent::Start {
            index,
            id: new_call_id(),
            name,
        });
        index
    }

    /// One step of the state machine; `false` when it needs more text.
    fn step(&mut self, out: &mut Vec<ToolCallEvent>, at_end: bool) -> bool {
        match self.state {
            State::Plain => {
                let text = std::mem::take(&mut self.buf);
                self.content(out, &text);
                false
            }
            State::Text => match self.format {
                ToolFormat::Hermes => {
                    if let Some(at) = self.buf.find(OPEN) {
                        let before: String = self.buf.drain(..at + OPEN.len()).collect();
                        // Whitespace before the opener stays held: dropped if a call
                        // follows (`start_call`), sent if the block is not one.
                        self.content(out, &before[..at]);
                        self.state = State::Header;
                        return true;
                    }
                    // Keep what may be the start of an opener.
                    let keep = (1..OPEN.len().min(self.buf.len() + 1))
                        .rev()
                        .find(|&n| {
                            let at = self.buf.len() - n;
                            self.buf.is_char_boundary(at) && OPEN.starts_with(&self.buf[at..])
                        })
                        .unwrap_or(0);
                    let cut = self.buf.len() - keep;
                    let text: String = self.buf.drain(..cut).collect();
                    self.content(out, &text);
                    false
                }
                ToolFormat::Llama3Json => {
                    let trimmed = self.buf.trim_start();
                    let trimmed = trimmed.strip_prefix(PYTHON_TAG).unwrap_or(trimmed);
                    let trimmed =
                        trimmed.trim_start_matches(|c: char| c.is_whitespace() || c == ';');
                    if trimmed.is_empty() {
                        return false;
                    }
                    if PYTHON_TAG.starts_with(trimmed) && !at_end {
                        return false;
                    }
                    if trimmed.starts_with('{') {
                        self.buf = trimmed.to_string();
                        self.state = State::Header;
                    } else {
                        self.state = State::Plain;
                    }
                    true
                }
            },
            State::Header => match header(&self.buf) {
                Header::Need if !at_end => false,
                Header::Need | Header::NoMatch => {
                    self.state = State::Whole;
                    true
                }
                Header::Match { name, consumed } => {
                    self.buf.drain(..consumed);
                    self.start_call(out, name);
                    self.state = State::Arguments {
                        depth: 0,
                        in_string: false,
                        escape: false,
                    };
                    true
                }
            },
            State::Arguments {
                mut depth,
                mut in_string,
                mut escape,
            } => {
                let mut end = None;
                for (i, c) in self.buf.char_indices() {
                    if in_string {
                        match (escape, c) {
                            (true, _) => escape = false,
                            (false, '\\') => escape = true,
                            (false, '"') => in_string = false,
                            _ => {}
                        }
                        continue;
                    }
                    match c {
                        '"' => in_string = true,
                        '{' | '[' => depth += 1,
                        '}' | ']' => {
                            depth = depth.saturating_sub(1);
                            if depth == 0 {
                                end = Some(i + 1);
                                break;
                            }
                        }
                        _ => {}
                    }
                }
                let index = self.calls - 1;
                let cut = end.unwrap_or(self.buf.len());
                let fragment: String = self.buf.drain(..cut).collect();
                if !fragment.is_empty() {
                    out.push(ToolCallEvent::Arguments { index, fragment });
                }
                if end.is_some() {
                    self.state = State::Tail;
                    true
                } else {
                    self.state = State::Arguments {
                        depth,
                        in_string,
                        escape,
                    };
                    false
                }
            }
            State::Whole => {
                let mut values = serde_json::Deserializer::from_str(&self.buf).into_iter::<Value>();
                match values.next() {
                    Some(Ok(value)) => {
                        let used = values.byte_offset();
                        if let Some((name, arguments)) = call_parts(&value) {
                            self.buf.drain(..used);
                            let index = self.start_call(out, name);
                            out.push(ToolCallEvent::Arguments {
                                index,
                                fragment: arguments,
                            });
                            self.state = State::Tail;
                            true
                        } else {
                            self.not_a_call();
                            true
                        }
                    }
                    Some(Err(e)) if e.is_eof() => false,
                    _ => {
                        self.not_a_call();
                        true
                    }
                }
            }
            State::Tail => {
                let rest = self.buf.trim_start();
                let rest = rest.strip_prefix('}').map(str::trim_start).unwrap_or(rest);
                match self.format {
                    ToolFormat::Hermes => {
                        if let Some(after) = rest.strip_prefix(CLOSE) {
                            self.buf = after.to_string();
                            self.state = State::Text;
                            return true;
                        }
                        if CLOSE.starts_with(rest) && !at_end {
                            return false;
                        }
                        // Anything else up to the closer is dropped.
                        match self.buf.find(CLOSE) {
                            Some(at) => {
                                self.buf.drain(..at + CLOSE.len());
                                self.state = State::Text;
                                true
                            }
                            None => {
                                if at_end {
                                    self.buf.clear();
                                }
                                false
                            }
                        }
                    }
                    ToolFormat::Llama3Json => {
                        if rest.is_empty() && !at_end {
                            return false;
                        }
                        self.buf = rest.to_string();
                        self.state = State::Text;
                        !self.buf.is_empty()
                    }
                }
            }
        }
    }

    /// The held call is not one: it is text.
    fn not_a_call(&mut self) {
        if self.format == ToolFormat::Hermes {
            self.buf.insert_str(0, OPEN);
            // Text from here on: no opener is looked for inside it again.
            self.state = State::Plain;
        } else {
            self.state = State::Plain;
        }
    }

    /// Reads `text` as one whole call; whether it was one.
    fn whole_call(&mut self, out: &mut Vec<ToolCallEvent>, text: &str) -> bool {
        let text = text.strip_suffix(CLOSE).unwrap_or(text).trim();
        match serde_json::from_str::<Value>(text)
            .ok()
            .as_ref()
            .and_then(call_parts)
        {
            Some((name, arguments)) => {
                let index = self.start_call(out, name);
                out.push(ToolCallEvent::Arguments {
                    index,
                    fragment: arguments,
                });
                true
            }
            None => false,
        }
    }
}

/// The name and arguments (JSON text) of a call object.
fn call_parts(value: &Value) -> Option<(String, String)> {
    let name = value.get("name")?.as_str()?.to_string();
    let arguments = value.get("arguments").or_else(|| value.get("parameters"));
    let arguments = match arguments {
        None => "{}".to_string(),
        Some(Value::String(text)) => text.clone(),
        Some(other) => other.to_string(),
    };
    Some((name, arguments))
}

enum Header {
    Need,
    NoMatch,
    Match { name: String, consumed: usize },
}

/// Reads `{"name": "<name>", "arguments": ` (or `"parameters"`) up to the arguments'
/// opening brace.
fn header(text: &str) -> Header {
    let bytes = text.as_bytes();
    let mut at = 0;
    let skip_ws = |at: &mut usize| {
        while *at < bytes.len() && bytes[*at].is_ascii_whitespace() {
            *at += 1;
        }
    };
    // Each literal in turn: all of it, a prefix at the end (need more), or a mismatch.
    let literal = |at: &mut usize, lit: &str| -> Option<bool> {
        let rest = &bytes[*at..];
        if rest.starts_with(lit.as_bytes()) {
            *at += lit.len();
            Some(true)
        } else if lit.as_bytes().starts_with(rest) {
            None
        } else {
            Some(false)
        }
    };
    macro_rules! expect {
        ($lit:expr) => {
            skip_ws(&mut at);
            match literal(&mut at, $lit) {
                None => return Header::Need,
                Some(false) => return Header::NoMatch,
                Some(true) => {}
            }
        };
    }
    expect!("{");
    expect!("\"name\"");
    expect!(":");
    skip_ws(&mut at);
    if at >= bytes.len() {
        return Header::Need;
    }
    if bytes[at] != b'"' {
        return Header::NoMatch;
    }
    let start = at;
    at += 1;
    let mut escape = false;
    loop {
        let Some(&b) = bytes.get(at) else {
            return Header::Need;
        };
        at += 1;
        match (escape, b) {
            (true, _) => escape = false,
            (false, b'\\') => escape = true,
            (false, b'"') => break,
            _ => {}
        }
    }
    let Ok(name) = serde_json::from_str::<String>(&text[start..at]) else {
        return Header::NoMatch;
    };
    expect!(",");
    skip_ws(&mut at);
    let key = if bytes[at..].starts_with(b"\"p") {
        "\"parameters\""
    } else {
        "\"arguments\""
    };
    expect!(key);
    expect!(":");
    skip_ws(&mut at);
    match bytes.get(at) {
        None => Header::Need,
        Some(b'{') => Header::Match { name, consumed: at },
        Some(_) => Header::NoMatch,
    }
}

/// The content and calls of a whole answer's events (content empty when there is none).
pub fn collect(events: impl IntoIterator<Item = ToolCallEvent>) -> (String, Vec<ToolCall>) {
    let mut content = String::new();
    let mut calls: Vec<ToolCall> = Vec::new();
    for event in events {
        match event {
            ToolCallEvent::Content(text) => content.push_str(&text),
            ToolCallEvent::Start { id, name, .. } => calls.push(ToolCall {
                id,
                name,
                arguments: String::new(),
            }),
            ToolCallEvent::Arguments { index, fragment } => {
                if let Some(call) = calls.get_mut(index) {
                    call.arguments.push_str(&fragment);
                }
            }
        }
    }
    (content, calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `text` in pieces of `step` characters.
    fn run(format: ToolFormat, text: &str, step: usize) -> (String, Vec<ToolCall>, usize) {
        let mut parser = ToolCallParser::new(format);
        let mut events = Vec::new();
        let chars: Vec<char> = text.chars().collect();
        for piece in chars.chunks(step) {
            events.extend(parser.push(&piece.iter().collect::<String>()));
        }
        events.extend(parser.finish());
        let starts = events
            .iter()
            .filter(|e| matches!(e, ToolCallEvent::Start { .. }))
            .count();
        let (content, calls) = collect(events);
        (content, calls, starts)
    }

    #[test]
    fn whitespace_before_a_block_that_is_not_a_call_is_kept() {
        // Found by the fuzz target `tool_call_parser`: the newline before an opener was
        // dropped even when the block turned out not to be a call.
        let text = "See\n<tool_call>not json</tool_call>";
        for step in [1, 3, 1000] {
            let (content, calls, _) = run(ToolFormat::Hermes, text, step);
            assert_eq!(content, text, "step {step}");
            assert!(calls.is_empty());
        }
        // Before a call it is still dropped.
        let (content, calls, _) = run(
            ToolFormat::Hermes,
            "Sure.\n<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>",
            2,
        );
        assert_eq!(content, "Sure.");
        assert_eq!(calls.len(), 1);
    }

    #[test]
    fn hermes_calls_in_any_pieces() {
        let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Pa}ris\", \"days\": [1, {\"a\": 2}]}}\n</tool_call>\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>";
        for step in [1, 2, 3, 7, 1000] {
            let (content, calls, starts) = run(ToolFormat::Hermes, text, step);
            assert_eq!(content, "", "step {step}");
            assert_eq!(starts, 2);
            assert_eq!(calls[0].name, "get_weather");
            assert_eq!(
                calls[0].arguments,
                "{\"city\": \"Pa}ris\", \"days\": [1, {\"a\": 2}]}"
            );
            assert_eq!(calls[1].name, "f");
            assert_eq!(calls[1].arguments, "{}");
        }
    }

    #[test]
    fn text_and_other_layouts() {
        for step in [1, 4, 1000] {
            let (content, calls, _) = run(ToolFormat::Hermes, "Hello <tool world", step);
            assert_eq!(content, "Hello <tool world");
            assert!(calls.is_empty());
            let (content, calls, _) = run(
                ToolFormat::Hermes,
                "Sure.\n<tool_call>\n{\"arguments\": {\"x\": 1}, \"name\": \"g\"}\n</tool_call>",
                step,
            );
            assert_eq!(content, "Sure.");
            assert_eq!(
                (calls[0].name.as_str(), calls[0].arguments.as_str()),
                ("g", "{\"x\":1}")
            );
            // A call cut short before its closer still counts if it parses.
            let (_, calls, _) = run(
                ToolFormat::Hermes,
                "<tool_call>{\"name\": \"h\", \"arguments\": \"{}\"}",
                step,
            );
            assert_eq!(calls[0].name, "h");
            let (content, calls, _) = run(
                ToolFormat::Hermes,
                "<tool_call>not json</tool_call> ok",
                step,
            );
            assert!(calls.is_empty());
            assert_eq!(content, "<tool_call>not json</tool_call> ok");
            let (content, calls, _) = run(
                ToolFormat::Llama3Json,
                " <|python_tag|>{\"name\": \"f\", \"parameters\": {\"q\": \"x\"}}",
                step,
            );
            assert_eq!(content, "");
            assert_eq!(calls[0].arguments, "{\"q\": \"x\"}");
            let (content, calls, _) = run(ToolFormat::Llama3Json, "The {answer}", step);
            assert_eq!(content, "The {answer}");
            assert!(calls.is_empty());
        }
    }
}
