//! Tokenizers from a Hugging Face `tokenizer.json` (and the model directory's config files).

use std::path::Path;

use serde_json::Value;

use super::bpe::byte_level_token_bytes;
use super::{
    ChatFormat, ChatTemplate, SpecialTokens, Tokenizer, collect_stop_ids, unknown_id, wrap_bos_eos,
};
use crate::error::{LlamaError, Result};

/// Token texts tried, in order, when nothing names the BOS token.
const BOS_GUESSES: &[&str] = &["<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>"];
/// Token texts tried, in order, when nothing names the EOS token.
const EOS_GUESSES: &[&str] = &["<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>"];

/// How a token's text maps to the bytes it stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ByteMode {
    /// GPT-2 byte-level alphabet (`Ġ` is a space, ...).
    ByteLevel,
    /// SentencePiece style: `▁` is a space; with byte fallback, `<0xNN>` is the byte NN.
    SentencePiece { byte_fallback: bool },
    /// Anything else: the decoder's output for the token alone.
    Decoder,
}

/// Settings read from the files around `tokenizer.json`; every field is optional.
#[derive(Debug, Clone, Default)]
struct ModelConfig {
    bos_token: Option<String>,
    eos_token: Option<String>,
    add_bos_token: Option<bool>,
    chat_template: Option<String>,
    /// `bos_token_id` from `generation_config.json`, then `config.json`.
    bos_ids: Vec<u32>,
    /// `eos_token_id` (a number or a list) from `generation_config.json`, then `config.json`.
    eos_ids: Vec<u32>,
}

/// A tokenizer described by a Hugging Face `tokenizer.json`.
///
/// Encoding and decoding run on the `tokenizers` crate. BOS/EOS are added by this type,
/// never by the file's post-processor, so `encode(text, false, false)` gives the bare ids.
/// [`Tokenizer::token_bytes`] understands byte-level vocabularies (GPT-2 alphabet) and
/// SentencePiece-style ones (`▁` for spaces, `<0xNN>` byte-fallback tokens), so
/// [`super::StreamDecoder`] works with both.
pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    /// `inner` with special-token matching off, for [`Tokenizer::encode_text`].
    plain: tokenizers::Tokenizer,
    mode: ByteMode,
    vocab_size: usize,
    special: SpecialTokens,
    chat_template: Option<String>,
    /// `chat_template` compiled (absent when it does not compile: the built-in
    /// [`ChatFormat`] is used then).
    template: Option<ChatTemplate>,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("mode", &self.mode)
            .field("special", &self.special)
            .finish_non_exhaustive()
    }
}

fn tokenizer_error(what: impl std::fmt::Display, err: impl std::fmt::Display) -> LlamaError {
    LlamaError::Tokenizer(format!("{what}: {err}"))
}

/// Reads a JSON file; `Ok(None)` when it does not exist.
fn read_json(path: &Path) -> Result<Option<Value>> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(LlamaError::io(path, e)),
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| tokenizer_error(path.display(), e))
}

/// A token named in `tokenizer_config.json`: a string or an object with `content`.
fn token_name(value: Option<&Value>) -> Option<String> {
    match value? {
        Value::String(s) => Some(s.clone()),
        Value::Object(map) => map.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// Token ids written as a number or a list of numbers.
fn token_ids(value: Option<&Value>) -> Vec<u32> {
    let as_id = |v: &Value| v.as_u64().and_then(|n| u32::try_from(n).ok());
    match value {
        Some(Value::Array(items)) => items.iter().filter_map(as_id).collect(),
        Some(v) => as_id(v).into_iter().collect(),
        None => Vec::new(),
    }
}

/// The chat template of `tokenizer_config.json`: a string, or a list of named templates
/// (the one named `default`, else the first).
fn chat_template(value: Option<&Value>) -> Option<String> {
    match value? {
        Value::String(s) => Some(s.clone()),
        Value::Array(items) => {
            let template = |item: &Value| item.get("template")?.as_str().map(str::to_string);
            items
                .iter()
                .find(|item| item.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(template)
                .or_else(|| items.iter().find_map(template))
        }
        _ => None,
    }
}

/// Collects every `"type"` string in a serialized component (recursing into sequences).
fn component_types(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            if let Some(Value::String(ty)) = map.get("type") {
                out.push(ty.clone());
            }
            if map.get("type").and_then(Value::as_str) == Some("Replace")
                && map.get("content").and_then(Value::as_str) == Some(" ")
                && value.pointer("/pattern/String").and_then(Value::as_str) == Some("▁")
            {
                out.push("ReplaceMetaspace".to_string());
            }
            for v in map.values() {
                component_types(v, out);
            }
        }
        Value::Array(items) => items.iter().for_each(|v| component_types(v, out)),
        _ => {}
    }
}

/// Finds a `TemplateProcessing` post-processor and returns the special tokens it puts
/// before and after a single sequence.
fn template_specials(value: &Value) -> Option<(Vec<String>, Vec<String>)> {
    match value {
        Value::Object(map)
            if map.get("type").and_then(Value::as_str) == Some("TemplateProcessing") =>
        {
            let single = map.get("single")?.as_array()?;
            let (mut before, mut after, mut seen_sequence) = (Vec::new(), Vec::new(), false);
            for piece in single {
                if piece.get("Sequence").is_some() {
                    seen_sequence = true;
                } else if let Some(id) = piece.pointer("/SpecialToken/id").and_then(Value::as_str) {
                    if seen_sequence {
                        after.push(id.to_string());
                    } else {
                        before.push(id.to_string());
                    }
                }
            }
            Some((before, after))
        }
        Value::Object(map) => map.values().find_map(template_specials),
        Value::Array(items) => items.iter().find_map(template_specials),
        _ => None,
    }
}

/// The bytes a SentencePiece-style token stands for.
fn sentencepiece_token_bytes(token: &str, byte_fallback: bool) -> Vec<u8> {
    if byte_fallback
        && let Some(hex) = token.strip_prefix("<0x").and_then(|t| t.strip_suffix('>'))
        && hex.len() == 2
        && let Ok(byte) = u8::from_str_radix(hex, 16)
    {
        return vec![byte];
    }
    token.replace('▁', " ").into_bytes()
}

impl HfTokenizer {
    /// Loads a `tokenizer.json`. BOS/EOS and whether BOS is added come from its
    /// post-processor when it has a template, else from well-known token names.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| LlamaError::io(path, e))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| tokenizer_error(path.display(), e))?;
        Self::build(inner, ModelConfig::default())
    }

    /// Parses the contents of a `tokenizer.json`.
    pub fn from_bytes(json: &[u8]) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_bytes(json)
            .map_err(|e| tokenizer_error("invalid tokenizer.json", e))?;
        Self::build(inner, ModelConfig::default())
    }

    /// Loads `dir/tokenizer.json` together with what the model directory says about it:
    /// `tokenizer_config.json` (`bos_token`, `eos_token`, `add_bos_token`,
    /// `chat_template`), `chat_template.jinja`, and the `bos_token_id`/`eos_token_id`
    /// (a number or a list) of `generation_config.json` and `config.json`. Each file is
    /// optional except `tokenizer.json`.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let path = dir.join("tokenizer.json");
        let bytes = std::fs::read(&path).map_err(|e| LlamaError::io(&path, e))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| tokenizer_error(path.display(), e))?;

        let mut config = ModelConfig::default();
        if let Some(tc) = read_json(&dir.join("tokenizer_config.json"))? {
            config.bos_token = token_name(tc.get("bos_token"));
            config.eos_token = token_name(tc.get("eos_token"));
            config.add_bos_token = tc.get("add_bos_token").and_then(Value::as_bool);
            config.chat_template = chat_template(tc.get("chat_template"));
        }
        if config.chat_template.is_none() {
            let jinja = dir.join("chat_template.jinja");
            match std::fs::read_to_string(&jinja) {
                Ok(text) => config.chat_template = Some(text),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(LlamaError::io(&jinja, e)),
            }
        }
        for name in ["generation_config.json", "config.json"] {
            if let Some(cfg) = read_json(&dir.join(name))? {
                config.bos_ids.extend(token_ids(cfg.get("bos_token_id")));
                config.eos_ids.extend(token_ids(cfg.get("eos_token_id")));
            }
        }
        Self::build(inner, config)
    }

    fn build(inner: tokenizers::Tokenizer, config: ModelConfig) -> Result<Self> {
        let vocab_size = inner
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&max| max as usize + 1);

        let mut types = Vec::new();
        if let Some(decoder) = inner.get_decoder() {
            let value = serde_json::to_value(decoder)
                .map_err(|e| tokenizer_error("cannot inspect the decoder", e))?;
            component_types(&value, &mut types);
        }
        let has = |ty: &str| types.iter().any(|t| t == ty);
        let mode = if has("ByteLevel") {
            ByteMode::ByteLevel
        } else if has("ByteFallback") || has("Metaspace") || has("ReplaceMetaspace") {
            ByteMode::SentencePiece {
                byte_fallback: has("ByteFallback"),
            }
        } else {
            ByteMode::Decoder
        };

        let (prefix, suffix) = match inner.get_post_processor() {
            Some(pp) => {
                let value = serde_json::to_value(pp)
                    .map_err(|e| tokenizer_error("cannot inspect the post-processor", e))?;
                template_specials(&value).unwrap_or_default()
            }
            None => Default::default(),
        };

        let lookup = |name: &str| inner.token_to_id(name);
        let in_vocab = |id: &u32| (*id as usize) < vocab_size;
        let guess = |names: &[&str]| names.iter().find_map(|name| lookup(name));
        let bos_id = config
            .bos_token
            .as_deref()
            .and_then(lookup)
            .or_else(|| config.bos_ids.iter().copied().find(in_vocab))
            .or_else(|| prefix.first().and_then(|name| lookup(name)))
            .or_else(|| guess(BOS_GUESSES));
        let eos_id = config
            .eos_token
            .as_deref()
            .and_then(lookup)
            .or_else(|| config.eos_ids.iter().copied().find(in_vocab))
            .or_else(|| suffix.last().and_then(|name| lookup(name)))
            .or_else(|| guess(EOS_GUESSES));
        let add_bos = config.add_bos_token.unwrap_or_else(|| {
            prefix
                .first()
                .and_then(|name| lookup(name))
                .is_some_and(|id| Some(id) == bos_id)
        });

        let chat_format = config
            .chat_template
            .as_deref()
            .and_then(ChatFormat::from_template);
        let named: &[&str] = match chat_format {
            Some(ChatFormat::ChatMl) => &["<|im_end|>"],
            Some(ChatFormat::Llama3) => &["<|eot_id|>", "<|eom_id|>"],
            None => &[],
        };
        let extra: Vec<u32> = config.eos_ids.iter().copied().filter(in_vocab).collect();
        let stop_ids = collect_stop_ids(eos_id, extra, named, lookup);

        let mut plain = inner.clone();
        plain.set_encode_special_tokens(true);
        Ok(Self {
            inner,
            plain,
            mode,
            vocab_size,
            special: SpecialTokens {
                bos: bos_id,
                eos: eos_id,
                stop_ids,
                add_bos,
                chat_format,
            },
            template: config
                .chat_template
                .as_deref()
                .and_then(|source| ChatTemplate::new(source).ok()),
            chat_template: config.chat_template,
        })
    }

    /// The chat template (from `tokenizer_config.json` or `chat_template.jinja`), if any.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The id of a token given its vocabulary text.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The vocabulary text of token `id`.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }
}

impl Tokenizer for HfTokenizer {
    fn encode_text(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self
            .plain
            .encode_fast(text, false)
            .map_err(|e| tokenizer_error("encoding failed", e))?;
        Ok(encoding.get_ids().to_vec())
    }

    fn encode(&self, text: &str, bos: bool, eos: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| tokenizer_error("encoding failed", e))?;
        wrap_bos_eos(
            encoding.get_ids().to_vec(),
            bos,
            eos,
            self.special.bos,
            self.special.eos,
        )
    }

    fn decode(&self, ids: &[u32]) -> Result<String> {
        if let Some(&bad) = ids.iter().find(|&&id| self.inner.id_to_token(id).is_none()) {
            return Err(unknown_id(bad, self.vocab_size));
        }
        self.inner
            .decode(ids, false)
            .map_err(|e| tokenizer_error("decoding failed", e))
    }

    fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        let token = self.inner.id_to_token(id)?;
        match self.mode {
            ByteMode::ByteLevel => Some(byte_level_token_bytes(&token)),
            ByteMode::SentencePiece { byte_fallback } => {
                Some(sentencepiece_token_bytes(&token, byte_fallback))
            }
            ByteMode::Decoder => self.inner.decode(&[id], false).ok().map(String::into_bytes),
        }
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn special_tokens(&self) -> &SpecialTokens {
        &self.special
    }

    fn jinja_template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::assert_err;
    use crate::tokenizer::StreamDecoder;
    use serde_json::json;

    /// A SentencePiece-style (Llama 2 / TinyLlama) tokenizer.json in miniature.
    fn sentencepiece_json() -> Value {
        let mut vocab = serde_json::Map::new();
        for (i, t) in ["<unk>", "<s>", "</s>"].iter().enumerate() {
            vocab.insert(t.to_string(), json!(i));
        }
        for b in 0..=255u32 {
            vocab.insert(format!("<0x{b:02X}>"), json!(3 + b));
        }
        let pieces = [
            "▁",
            "h",
            "i",
            "▁h",
            "▁hi",
            "é",
            "<|im_start|>",
            "<|im_end|>",
        ];
        for (i, t) in pieces.iter().enumerate() {
            vocab.insert(t.to_string(), json!(259 + i));
        }
        let added = |id: u32, content: &str| {
            json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        };
        json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": [added(0, "<unk>"), added(1, "<s>"), added(2, "</s>"),
                             added(265, "<|im_start|>"), added(266, "<|im_end|>")],
            "normalizer": {"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
            ]},
            "pre_tokenizer": null,
            "post_processor": {
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                           {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}
            },
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}
            ]},
            "model": {
                "type": "BPE", "dropout": null, "unk_token": "<unk>",
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                "vocab": vocab, "merges": ["▁ h", "▁h i"]
            }
        })
    }

    fn sentencepiece() -> HfTokenizer {
        HfTokenizer::from_bytes(sentencepiece_json().to_string().as_bytes()).unwrap()
    }

    #[test]
    fn sentencepiece_encode_decode_and_bytes() {
        let tok = sentencepiece();
        assert_eq!(
            tok.mode,
            ByteMode::SentencePiece {
                byte_fallback: true
            }
        );
        assert_eq!(tok.vocab_size(), 267);
        assert_eq!(tok.bos_id(), Some(1));
        assert_eq!(tok.eos_id(), Some(2));
        assert!(tok.add_bos_by_default());
        assert_eq!(tok.stop_ids(), &[2]);
        assert_eq!(tok.chat_format(), None);

        let ids = tok.encode("hi 👍", true, false).unwrap();
        // <s> ▁hi ▁ <0xF0> <0x9F> <0x91> <0x8D>
        assert_eq!(
            ids,
            vec![1, 263, 259, 3 + 0xF0, 3 + 0x9F, 3 + 0x91, 3 + 0x8D]
        );
        assert_eq!(tok.decode(&ids[1..]).unwrap(), "hi 👍");
        assert_eq!(tok.token_bytes(263), Some(b" hi".to_vec()));
        assert_eq!(tok.token_bytes(3 + 0xF0), Some(vec![0xF0]));
        assert_eq!(tok.token_bytes(1), Some(b"<s>".to_vec()));
        assert_eq!(tok.token_bytes(9999), None);
        assert_err!(
            tok.decode(&[9999]),
            LlamaError::Tokenizer(m) if m.contains("token id 9999 is outside")
        );

        // Streaming keeps the emoji whole; the text is the decode with its leading space.
        let mut decoder = StreamDecoder::new();
        let pieces: Vec<String> = ids[1..].iter().map(|&id| decoder.push(&tok, id)).collect();
        assert_eq!(pieces, vec![" hi", " ", "", "", "", "👍"]);
        assert_eq!(decoder.finish(), "");
    }

    #[test]
    fn special_tokens_in_text_are_matched() {
        let tok = sentencepiece();
        let ids = tok.encode("<|im_start|>hi<|im_end|>", false, true).unwrap();
        assert_eq!(ids.first(), Some(&265));
        assert!(ids.contains(&266));
        assert_eq!(ids.last(), Some(&2));
        // As plain text they are not.
        let plain = tok.encode_text("<|im_start|>hi<|im_end|>").unwrap();
        assert!(!plain.contains(&265) && !plain.contains(&266), "{plain:?}");
        assert!(!plain.is_empty());
    }

    /// A GPT-2 style byte-level tokenizer.json in miniature.
    fn byte_level_json() -> Value {
        use crate::tokenizer::bpe::byte_to_char;
        let mut vocab = serde_json::Map::new();
        for b in 0..=255u8 {
            vocab.insert(byte_to_char(b).to_string(), json!(b));
        }
        let merges = ["h i", "Ġ hi", "ð Ł"];
        for (i, m) in merges.iter().enumerate() {
            vocab.insert(m.replace(' ', ""), json!(256 + i));
        }
        vocab.insert("<|endoftext|>".into(), json!(259));
        let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false,
                                "trim_offsets": true, "use_regex": true});
        json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [{"id": 259, "content": "<|endoftext|>", "single_word": false,
                              "lstrip": false, "rstrip": false, "normalized": false,
                              "special": true}],
            "normalizer": null,
            "pre_tokenizer": byte_level,
            "post_processor": null,
            "decoder": byte_level,
            "model": {
                "type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab, "merges": merges
            }
        })
    }

    #[test]
    fn byte_level_stream_matches_decode() {
        let tok = HfTokenizer::from_bytes(byte_level_json().to_string().as_bytes()).unwrap();
        assert_eq!(tok.mode, ByteMode::ByteLevel);
        assert_eq!(tok.vocab_size(), 260);
        assert_eq!(tok.bos_id(), None);
        assert_eq!(tok.eos_id(), Some(259));
        assert!(!tok.add_bos_by_default());
        assert_err!(
            tok.encode("hi", true, false),
            LlamaError::Tokenizer(m) if m.contains("a BOS token was requested")
        );
        let text = "hi hi 🦀👍🏽<|endoftext|>";
        let ids = tok.encode(text, false, false).unwrap();
        assert_eq!(ids[..4], [256, 257, 32, 258]);
        assert_eq!(ids.last(), Some(&259));
        assert_eq!(tok.decode(&ids).unwrap(), text);
        let mut decoder = StreamDecoder::new();
        let mut pieces: Vec<String> = ids.iter().map(|&id| decoder.push(&tok, id)).collect();
        pieces.push(decoder.finish());
        assert_eq!(pieces.concat(), text);
        assert!(pieces.iter().any(|p| p == "🦀"));
        // A lone partial character is rendered as U+FFFD by both paths.
        let partial = &ids[3..5];
        let mut decoder = StreamDecoder::new();
        let streamed: String = partial.iter().map(|&id| decoder.push(&tok, id)).collect();
        assert_eq!(streamed + &decoder.finish(), tok.decode(partial).unwrap());
    }

    fn temp_dir(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("llama-burn-hf-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn model_directory_configs_are_read() {
        let dir = temp_dir("dir");
        std::fs::write(dir.join("tokenizer.json"), sentencepiece_json().to_string()).unwrap();
        std::fs::write(
            dir.join("tokenizer_config.json"),
            json!({
                "bos_token": {"content": "<|im_start|>", "lstrip": false},
                "eos_token": "<|im_end|>",
                "add_bos_token": false,
                "chat_template": [{"name": "tool_use", "template": "x"},
                                  {"name": "default", "template": "{{'<|im_start|>'}}"}]
            })
            .to_string(),
        )
        .unwrap();
        std::fs::write(
            dir.join("generation_config.json"),
            json!({"eos_token_id": [266, 2]}).to_string(),
        )
        .unwrap();
        std::fs::write(
            dir.join("config.json"),
            json!({"eos_token_id": 2, "bos_token_id": 1}).to_string(),
        )
        .unwrap();
        let tok = HfTokenizer::from_dir(&dir).unwrap();
        assert_eq!(tok.bos_id(), Some(265));
        assert_eq!(tok.eos_id(), Some(266));
        assert!(!tok.add_bos_by_default());
        assert_eq!(tok.chat_format(), Some(ChatFormat::ChatMl));
        assert_eq!(tok.chat_template(), Some("{{'<|im_start|>'}}"));
        assert_eq!(tok.stop_ids(), &[266, 2]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn missing_or_broken_files_are_errors() {
        let dir = temp_dir("broken");
        assert!(matches!(
            HfTokenizer::from_dir(&dir),
            Err(LlamaError::Io { .. })
        ));
        std::fs::write(dir.join("tokenizer.json"), "{not json").unwrap();
        assert!(matches!(
            HfTokenizer::from_dir(&dir),
            Err(LlamaError::Tokenizer(_))
        ));
        assert_err!(
            HfTokenizer::from_file(dir.join("tokenizer.json")),
            LlamaError::Tokenizer(m) if m.contains("tokenizer.json: ")
        );
        std::fs::write(dir.join("tokenizer.json"), sentencepiece_json().to_string()).unwrap();
        std::fs::write(dir.join("config.json"), "[").unwrap();
        assert!(matches!(
            HfTokenizer::from_dir(&dir),
            Err(LlamaError::Tokenizer(_))
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn config_value_helpers() {
        assert_eq!(token_ids(Some(&json!([1, 2, -1]))), vec![1, 2]);
        assert_eq!(token_ids(Some(&json!(7))), vec![7]);
        assert_eq!(token_ids(None), Vec::<u32>::new());
        assert_eq!(
            token_name(Some(&json!({"content": "</s>"}))),
            Some("</s>".into())
        );
        assert_eq!(token_name(Some(&json!(null))), None);
        assert_eq!(
            chat_template(Some(&json!([{"name": "a", "template": "t"}]))),
            Some("t".into())
        );
        assert_eq!(sentencepiece_token_bytes("<0x0A>", true), vec![b'\n']);
        assert_eq!(
            sentencepiece_token_bytes("<0x0A>", false),
            b"<0x0A>".to_vec()
        );
        assert_eq!(sentencepiece_token_bytes("▁a▁b", true), b" a b".to_vec());
    }
}
