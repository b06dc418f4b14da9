//! The bodies of the coverage-guided fuzz targets in `fuzz/`, here so that the unit test
//! below replays their regression inputs (`fuzz/regressions/<target>/`) on stable with
//! the same code. Not API: hidden from the documentation, and free to change with the
//! targets.
//!
//! Each function runs the crate's own code on arbitrary input, as it runs on a request
//! body, a file or a model's output: an error is an answer, a panic (including a failed
//! invariant below) is a bug.

use std::sync::OnceLock;

use serde_json::Value;

use crate::error::{LlamaError, Result};
use crate::loader::gguf::GgufFile;
use crate::tokenizer::{ChatMessage, ChatTemplate, GgufBpeTokenizer, StreamDecoder, Tokenizer};
use crate::tools::parse::{ToolCallEvent, ToolCallParser, collect};
use crate::tools::{Tool, ToolFormat};

/// Target `server_body`: runs `body` through every check a POST to
/// `/v1/chat/completions`, to `/v1/completions` and to `/v1/embeddings` passes before any
/// work is done, with
/// the server's default limits and the model name `smollm2` (the handlers' own code: the
/// depth, repeated-key and count limits, the parse, the constraint, the tools, the model
/// name, the conversation or prompts, the sampling settings).
///
/// # Panics
///
/// When a refusal is not a 4xx.
#[cfg(feature = "server")]
pub fn server_body(body: &[u8]) {
    static CONFIG: OnceLock<crate::server::ServerConfig> = OnceLock::new();
    let config = CONFIG.get_or_init(|| crate::server::ServerConfig::new("smollm2"));
    let refusals = [true, false]
        .map(|chat| crate::server::check_body(config, chat, body).err())
        .into_iter()
        .chain([crate::server::check_embedding_body(config, body).err()]);
    for error in refusals.flatten() {
        // The answer the client would get: a 4xx with an OpenAI error body.
        let status = error.status.as_u16();
        assert!((400..500).contains(&status), "status {status}: {error:?}");
        let _ = error.body().to_string();
    }
}

/// Target `gguf_header`: parses `bytes` as a whole GGUF file (header, metadata, tensor
/// infos) as [`GgufFile::open`] does, formats every value and dequantizes every tensor
/// whose type can be.
///
/// # Panics
///
/// On an error other than [`LlamaError::InvalidFormat`], [`LlamaError::Truncated`] or
/// [`LlamaError::UnsupportedTensorType`].
pub fn gguf_header(bytes: &[u8]) {
    match crate::loader::gguf::check_header_bytes(bytes) {
        Ok(_)
        | Err(
            LlamaError::InvalidFormat(_)
            | LlamaError::Truncated(_)
            | LlamaError::UnsupportedTensorType { .. },
        ) => {}
        Err(other) => panic!("unexpected error kind: {other:?}"),
    }
}

/// The tokenizers [`tokenizer_decode`] and [`chat_template`] use, loaded once: the demo
/// model's (GGUF BPE, with its chat template), the Llama 3 tokenizer (feature `llama3`)
/// and the bytes-only one. Fetches the demo model and the Llama 3 tokenizer if they are
/// not cached.
///
/// # Errors
///
/// When a file cannot be fetched or read.
pub fn tokenizers() -> Result<&'static [Box<dyn Tokenizer>]> {
    static TOKENIZERS: OnceLock<Vec<Box<dyn Tokenizer>>> = OnceLock::new();
    if let Some(loaded) = TOKENIZERS.get() {
        return Ok(loaded);
    }
    let gguf = GgufFile::open(crate::demo::demo_model_path()?)?;
    let mut loaded: Vec<Box<dyn Tokenizer>> = vec![Box::new(GgufBpeTokenizer::from_gguf(&gguf)?)];
    #[cfg(feature = "llama3")]
    loaded.push(Box::new(crate::tokenizer::Llama3Tokenizer::from_file(
        crate::demo::fetch_wheel_file(
            "llama-models",
            "0.3.0",
            "llama_models/llama3/tokenizer.model",
        )?,
    )?));
    loaded.push(Box::new(GgufBpeTokenizer::bytes_only()?));
    Ok(TOKENIZERS.get_or_init(|| loaded))
}

/// Target `tokenizer_decode`: decodes arbitrary ids with each of `tokenizers`.
///
/// Input: byte 0 chooses whether the ids (the rest, little-endian `u32`s) are folded
/// into a little more than each vocabulary (mostly known ids, a few unknown) or taken as
/// they are.
///
/// # Panics
///
/// When known ids are refused or unknown ones decoded, when streaming the ids one at a
/// time ([`StreamDecoder`]) gives another text than decoding them at once, or on an error
/// other than [`LlamaError::Tokenizer`].
pub fn tokenizer_decode(tokenizers: &[Box<dyn Tokenizer>], data: &[u8]) {
    let Some((&control, rest)) = data.split_first() else {
        return;
    };
    let raw: Vec<u32> = rest
        .as_chunks::<4>()
        .0
        .iter()
        .map(|c| u32::from_le_bytes(*c))
        .collect();
    for tokenizer in tokenizers {
        let fold = u32::try_from(tokenizer.vocab_size())
            .unwrap_or(u32::MAX)
            .saturating_add(8);
        let ids: Vec<u32> = match control & 1 {
            0 => raw.iter().map(|id| id % fold).collect(),
            _ => raw.clone(),
        };
        let known = ids.iter().all(|&id| tokenizer.token_bytes(id).is_some());
        match tokenizer.decode(&ids) {
            Ok(text) => {
                assert!(known, "unknown ids decoded: {ids:?}");
                let mut stream = StreamDecoder::new();
                let mut streamed: String = ids
                    .iter()
                    .map(|&id| stream.push(&**tokenizer, id))
                    .collect();
                streamed.push_str(&stream.finish());
                assert_eq!(streamed, text, "streamed and whole decodes differ: {ids:?}");
            }
            Err(LlamaError::Tokenizer(_)) => assert!(!known, "known ids refused: {ids:?}"),
            Err(other) => panic!("unexpected error kind: {other:?}"),
        }
    }
}

/// The messages, tools and generation-prompt flag of [`chat_template`]'s JSON (what does
/// not read is left out: the server's checks are [`server_body`]'s).
fn conversation(json: &[u8]) -> (Vec<ChatMessage>, Vec<Tool>, bool) {
    let value: Value = serde_json::from_slice(json).unwrap_or(Value::Null);
    let items = |key: &str| {
        value
            .get(key)
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default()
    };
    let messages = items("messages")
        .into_iter()
        .filter_map(|m| serde_json::from_value::<ChatMessage>(m).ok())
        .collect();
    let tools = items("tools")
        .iter()
        .filter_map(|t| {
            let parameters = t.get("parameters").cloned().unwrap_or(Value::Null);
            let mut tool = Tool::new(t.get("name")?.as_str()?, parameters);
            tool.description = t
                .get("description")
                .and_then(Value::as_str)
                .map(str::to_string);
            tool.strict = t.get("strict").and_then(Value::as_bool).unwrap_or(false);
            Some(tool)
        })
        .collect();
    let add_generation_prompt = value
        .get("add_generation_prompt")
        .and_then(Value::as_bool)
        .unwrap_or(true);
    (messages, tools, add_generation_prompt)
}

/// Target `chat_template`: renders arbitrary messages and tools with an arbitrary
/// template source under the crate's bounds (the fuel of [`ChatTemplate::render`]), or
/// with `demo`'s own template through
/// [`encode_conversation`](Tokenizer::encode_conversation) (a chat request's path).
///
/// Input: `<template source>\0<JSON>`, the JSON `{"messages": [...], "tools": [...],
/// "add_generation_prompt": bool}` (messages as [`ChatMessage`] reads them, tools as
/// `{"name", "description", "parameters", "strict"}`); an empty source means `demo`'s
/// template. Without a `\0` the whole input is the source, rendered with two messages.
///
/// # Panics
///
/// On an error other than [`LlamaError::Tokenizer`] or
/// [`LlamaError::InvalidParameter`].
pub fn chat_template(demo: &dyn Tokenizer, data: &[u8]) {
    const TWO: &[u8] = br#"{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}"#;
    let (source, json) = match data.iter().position(|&b| b == 0) {
        Some(at) => (&data[..at], &data[at + 1..]),
        None => (data, TWO),
    };
    let (messages, tools, add_generation_prompt) = conversation(json);
    let result = if source.is_empty() {
        demo.encode_conversation(&messages, &tools, add_generation_prompt)
            .map(drop)
    } else {
        let Ok(source) = std::str::from_utf8(source) else {
            return;
        };
        ChatTemplate::new(source).and_then(|template| {
            template
                .render(&messages, &tools, add_generation_prompt, "<s>", "</s>")
                .map(drop)
        })
    };
    match result {
        Ok(()) | Err(LlamaError::Tokenizer(_) | LlamaError::InvalidParameter { .. }) => {}
        Err(other) => panic!("unexpected error kind: {other:?}"),
    }
}

/// The content and (name, arguments) of each call of a parse.
fn tool_call_summary(events: Vec<ToolCallEvent>) -> (String, Vec<(String, String)>) {
    let (content, calls) = collect(events);
    let calls = calls.into_iter().map(|c| (c.name, c.arguments)).collect();
    (content, calls)
}

/// Target `tool_call_parser`: the streaming tool-call parser on arbitrary text, pushed
/// whole and cut into pieces of 1 to 16 characters.
///
/// Input: byte 0 chooses the format (bit 0: Hermes or Llama 3 JSON) and seeds the cuts;
/// the rest (lossy UTF-8) is the model's output.
///
/// # Panics
///
/// When the pieces give other content or calls (names and arguments; ids are fresh) than
/// the whole text, or a Hermes answer without calls other content than its text.
pub fn tool_call_parser(data: &[u8]) {
    let Some((&control, rest)) = data.split_first() else {
        return;
    };
    let format = match control & 1 {
        0 => ToolFormat::Hermes,
        _ => ToolFormat::Llama3Json,
    };
    let text = String::from_utf8_lossy(rest);

    let mut whole = ToolCallParser::new(format);
    let mut events = whole.push(&text);
    events.extend(whole.finish());
    let expected = tool_call_summary(events);

    // Cut lengths from a xorshift generator seeded by the control byte.
    let mut parser = ToolCallParser::new(format);
    let mut events = Vec::new();
    let mut state = u32::from(control >> 1) | 1;
    let mut chars = text.char_indices().peekable();
    while let Some(&(start, _)) = chars.peek() {
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        let mut end = start;
        for (i, c) in chars.by_ref().take(state as usize % 16 + 1) {
            end = i + c.len_utf8();
        }
        events.extend(parser.push(&text[start..end]));
    }
    events.extend(parser.finish());
    assert_eq!(
        tool_call_summary(events),
        expected,
        "pieces and whole text disagree"
    );
    // Hermes text without a call is all content, as it was written (Llama 3's answer
    // drops its leading whitespace and `<|python_tag|>` when it opens like a call).
    if format == ToolFormat::Hermes && expected.1.is_empty() {
        assert_eq!(expected.0, text, "the content of an answer without calls");
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    /// The files of `fuzz/<kind>/<target>/` (none when it does not exist).
    fn inputs(kind: &str, target: &str) -> Vec<(String, Vec<u8>)> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fuzz")
            .join(kind)
            .join(target);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return Vec::new();
        };
        let mut files: Vec<_> = entries
            .map(|e| e.expect("a regression file").path())
            .filter(|p| p.is_file())
            .map(|p| {
                let data = std::fs::read(&p).expect("read a regression file");
                (p.display().to_string(), data)
            })
            .collect();
        files.sort();
        files
    }

    /// Whether `fuzz/` is here (a packaged crate leaves it out).
    fn have_fuzz_dir() -> bool {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz").is_dir()
    }

    /// The inputs a fuzz target once crashed on, fixed since.
    fn regressions(target: &str) -> Vec<(String, Vec<u8>)> {
        inputs("regressions", target)
    }

    /// The seeds and the regressions of a target whose body needs no model.
    fn seeds_and_regressions(target: &str) -> Vec<(String, Vec<u8>)> {
        let mut files = inputs("corpus", target);
        assert!(!files.is_empty(), "fuzz/corpus/{target} has seeds");
        files.extend(regressions(target));
        files
    }

    /// Every input a fuzz target once crashed on runs through the same entry point
    /// without a panic (and the seeds of the targets that need no model, in
    /// milliseconds). The tokenizer targets load the demo model: their regressions only,
    /// and only when there are some.
    #[test]
    fn fuzz_regressions_replay() {
        if !have_fuzz_dir() {
            return;
        }
        #[cfg(feature = "server")]
        for (name, data) in seeds_and_regressions("server_body") {
            eprintln!("{name}");
            super::server_body(&data);
        }
        for (name, data) in seeds_and_regressions("gguf_header") {
            eprintln!("{name}");
            super::gguf_header(&data);
        }
        for (name, data) in seeds_and_regressions("tool_call_parser") {
            eprintln!("{name}");
            super::tool_call_parser(&data);
        }
        let decode = regressions("tokenizer_decode");
        let template = regressions("chat_template");
        if !decode.is_empty() || !template.is_empty() {
            let tokenizers = super::tokenizers().expect("the fuzz targets' tokenizers");
            for (name, data) in decode {
                eprintln!("{name}");
                super::tokenizer_decode(tokenizers, &data);
            }
            for (name, data) in template {
                eprintln!("{name}");
                super::chat_template(&*tokenizers[0], &data);
            }
        }
    }

    /// The seeds are what they claim: the GGUF files parse (all but the cut-off prefix of
    /// the demo model), and the tool-call seeds hold calls.
    #[test]
    fn fuzz_seeds_are_real() {
        if !have_fuzz_dir() {
            return;
        }
        for (name, data) in inputs("corpus", "gguf_header") {
            let parsed = crate::loader::gguf::check_header_bytes(&data);
            assert_eq!(
                parsed.is_ok(),
                !name.contains("prefix"),
                "{name}: {parsed:?}"
            );
        }
        let calls = inputs("corpus", "tool_call_parser")
            .iter()
            .filter(|(name, _)| !name.contains("text"))
            .all(|(_, data)| {
                let format = match data[0] & 1 {
                    0 => crate::tools::ToolFormat::Hermes,
                    _ => crate::tools::ToolFormat::Llama3Json,
                };
                let mut parser = super::ToolCallParser::new(format);
                let mut events = parser.push(&String::from_utf8_lossy(&data[1..]));
                events.extend(parser.finish());
                !super::collect(events).1.is_empty()
            });
        assert!(calls, "every tool-call seed but the text ones holds a call");
    }
}
