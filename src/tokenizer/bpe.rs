//! The byte-level BPE tokenizer embedded in GGUF metadata (`tokenizer.ggml.model = "gpt2"`).

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use super::{
    ChatFormat, ChatTemplate, SpecialTokens, Tokenizer, collect_stop_ids, decode_with_table,
    wrap_bos_eos,
};
use crate::error::{LlamaError, Result};
use crate::loader::gguf::GgufFile;

/// GGUF token type of a control token (`<|im_start|>`, `<|eot_id|>`, ...).
const TOKEN_TYPE_CONTROL: i32 = 3;
/// GGUF token type of a user-defined token.
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// The GPT-2 split regex.
const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// The Llama 3 split regex (also used by Meta's tiktoken tokenizer).
pub(crate) const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// The Qwen 2 split regex: Llama 3's with single digits.
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Splits every digit into its own piece.
const DIGIT_PATTERN: &str = r"\p{N}";

/// The tokenizer part of a GGUF file's metadata (the `tokenizer.*` keys).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GgufTokenizerData {
    /// `tokenizer.ggml.model`: the tokenizer family (`"gpt2"` for byte-level BPE).
    pub model: String,
    /// `tokenizer.ggml.pre`: the pre-tokenizer name (`"smollm"`, `"llama-bpe"`, `"gpt2"`, ...).
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`: token text by id.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.token_type`: token type by id (1 normal, 2 unknown, 3 control,
    /// 4 user-defined, 5 unused, 6 byte); empty when the file has none.
    pub token_types: Vec<i32>,
    /// `tokenizer.ggml.merges`: BPE merges, `"left right"`, highest priority first.
    pub merges: Vec<String>,
    /// `tokenizer.ggml.bos_token_id`.
    pub bos_id: Option<u32>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos_id: Option<u32>,
    /// `tokenizer.ggml.eot_token_id` (end of turn).
    pub eot_id: Option<u32>,
    /// `tokenizer.ggml.add_bos_token` (false when absent).
    pub add_bos: bool,
    /// `tokenizer.ggml.add_eos_token` (false when absent).
    pub add_eos: bool,
    /// `tokenizer.chat_template`: the Jinja chat template.
    pub chat_template: Option<String>,
}

/// A token id stored under `key`, if present.
fn token_id(file: &GgufFile, key: &str) -> Result<Option<u32>> {
    file.get_opt_u64(key)?
        .map(|v| {
            u32::try_from(v).map_err(|_| {
                LlamaError::Tokenizer(format!("`{key}` = {v} is not a valid token id"))
            })
        })
        .transpose()
}

impl GgufTokenizerData {
    /// Reads the `tokenizer.*` keys of a GGUF file. Only `tokenizer.ggml.model` and
    /// `tokenizer.ggml.tokens` are required; whether the model is supported is checked by
    /// [`GgufBpeTokenizer::from_gguf_data`].
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let missing =
            |key: &str| LlamaError::Tokenizer(format!("the GGUF file has no `{key}` metadata"));
        let model = file
            .get_opt_str("tokenizer.ggml.model")?
            .ok_or_else(|| missing("tokenizer.ggml.model"))?
            .to_string();
        let tokens = file
            .get_opt_string_array("tokenizer.ggml.tokens")?
            .ok_or_else(|| missing("tokenizer.ggml.tokens"))?;
        Ok(Self {
            model,
            pre: file.get_opt_str("tokenizer.ggml.pre")?.map(str::to_string),
            tokens,
            token_types: file
                .get_opt_i32_array("tokenizer.ggml.token_type")?
                .unwrap_or_default(),
            merges: file
                .get_opt_string_array("tokenizer.ggml.merges")?
                .unwrap_or_default(),
            bos_id: token_id(file, "tokenizer.ggml.bos_token_id")?,
            eos_id: token_id(file, "tokenizer.ggml.eos_token_id")?,
            eot_id: token_id(file, "tokenizer.ggml.eot_token_id")?,
            add_bos: file
                .get_opt_bool("tokenizer.ggml.add_bos_token")?
                .unwrap_or(false),
            add_eos: file
                .get_opt_bool("tokenizer.ggml.add_eos_token")?
                .unwrap_or(false),
            chat_template: file
                .get_opt_str("tokenizer.chat_template")?
                .map(str::to_string),
        })
    }
}

/// The byte GPT-2's byte-level alphabet writes as `c`, if `c` is in that alphabet.
///
/// Printable Latin-1 bytes (`!`..=`~`, `¡`..=`¬`, `®`..=`ÿ`) stand for themselves; the 68
/// other bytes are written as U+0100 onwards, in byte order.
pub(crate) fn byte_level_char_to_byte(c: char) -> Option<u8> {
    let code = u32::from(c);
    match code {
        33..=126 | 161..=172 | 174..=255 => u8::try_from(code).ok(),
        256..=288 => u8::try_from(code - 256).ok(),
        289..=322 => u8::try_from(code - 289 + 127).ok(),
        323 => Some(173),
        _ => None,
    }
}

/// The bytes a byte-level token stands for. A token using characters outside the byte
/// alphabet (an added token with spaces, say) stands for its own UTF-8 text, as in the
/// Hugging Face byte-level decoder.
pub(crate) fn byte_level_token_bytes(token: &str) -> Vec<u8> {
    token
        .chars()
        .map(byte_level_char_to_byte)
        .collect::<Option<Vec<u8>>>()
        .unwrap_or_else(|| token.as_bytes().to_vec())
}

/// How text is split before BPE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PreTokenizerKind {
    /// The GPT-2 regex.
    Gpt2,
    /// Every digit on its own, then the GPT-2 regex (SmolLM, StarCoder).
    DigitsThenGpt2,
    /// The Llama 3 regex.
    Llama3,
    /// The Qwen 2 regex.
    Qwen2,
}

impl PreTokenizerKind {
    fn from_name(pre: Option<&str>) -> Result<Self> {
        Ok(match pre {
            None | Some("default" | "gpt2" | "gpt-2") => Self::Gpt2,
            Some("smollm" | "starcoder" | "refact") => Self::DigitsThenGpt2,
            Some("llama-bpe" | "llama3" | "llama-v3") => Self::Llama3,
            Some("qwen2") => Self::Qwen2,
            Some(other) => {
                return Err(LlamaError::Tokenizer(format!(
                    "unsupported GGUF pre-tokenizer `{other}` (supported: gpt2, default, smollm, \
                     starcoder, refact, llama-bpe, llama3, qwen2)"
                )));
            }
        })
    }

    fn patterns(self) -> &'static [&'static str] {
        match self {
            Self::Gpt2 => &[GPT2_PATTERN],
            Self::DigitsThenGpt2 => &[DIGIT_PATTERN, GPT2_PATTERN],
            Self::Llama3 => &[LLAMA3_PATTERN],
            Self::Qwen2 => &[QWEN2_PATTERN],
        }
    }

    /// Builds the `tokenizers` pre-tokenizer: the regex splits in order, then the
    /// byte-level mapping (without its own regex).
    fn build(self) -> Result<PreTokenizerWrapper> {
        let mut steps: Vec<PreTokenizerWrapper> = Vec::new();
        for pattern in self.patterns() {
            let split = Split::new(
                SplitPattern::Regex((*pattern).to_string()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| LlamaError::Tokenizer(format!("bad split regex: {e}")))?;
            steps.push(split.into());
        }
        steps.push(ByteLevel::new(false, true, false).into());
        Ok(Sequence::new(steps).into())
    }
}

/// Splits a GGUF merge `"left right"` at its first space after the first character.
fn parse_merge(merge: &str) -> Option<(String, String)> {
    let (at, _) = merge.char_indices().skip(1).find(|&(_, c)| c == ' ')?;
    let (left, right) = (&merge[..at], &merge[at + 1..]);
    if right.is_empty() {
        return None;
    }
    Some((left.to_string(), right.to_string()))
}

/// The byte-level BPE tokenizer a GGUF file carries in its metadata.
///
/// Encoding runs on the `tokenizers` crate: the pre-tokenizer named by
/// `tokenizer.ggml.pre` (for SmolLM2's `smollm`: every digit alone, then the GPT-2 regex),
/// byte-level mapping, BPE with the file's merges. Control and user-defined tokens are
/// special tokens matched wherever they are written in the text, and decode to their text.
pub struct GgufBpeTokenizer {
    inner: tokenizers::Tokenizer,
    /// `inner` with special-token matching off, for [`Tokenizer::encode_text`].
    plain: tokenizers::Tokenizer,
    tokens: Vec<String>,
    bytes: Vec<Vec<u8>>,
    pre: Option<String>,
    special: SpecialTokens,
    eot_id: Option<u32>,
    add_eos: bool,
    chat_template: Option<String>,
    /// `chat_template` compiled (absent when it does not compile: the built-in
    /// [`ChatFormat`] is used then).
    template: Option<ChatTemplate>,
}

impl std::fmt::Debug for GgufBpeTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufBpeTokenizer")
            .field("vocab_size", &self.tokens.len())
            .field("pre", &self.pre)
            .field("special", &self.special)
            .field("eot_id", &self.eot_id)
            .finish_non_exhaustive()
    }
}

impl GgufBpeTokenizer {
    /// Reads the tokenizer from an open GGUF file's metadata.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        Self::from_gguf_data(GgufTokenizerData::from_gguf(file)?)
    }

    /// Builds the tokenizer from GGUF tokenizer metadata. Fails with
    /// [`LlamaError::Tokenizer`] for a model other than `gpt2`, an unknown pre-tokenizer,
    /// malformed merges or out-of-range special ids.
    pub fn from_gguf_data(data: GgufTokenizerData) -> Result<Self> {
        if data.model != "gpt2" {
            let hint = if data.model == "llama" {
                " (SentencePiece); load the model's tokenizer.json with HfTokenizer instead"
            } else {
                ""
            };
            return Err(LlamaError::Tokenizer(format!(
                "unsupported GGUF tokenizer model `{}`{hint}: only `gpt2` (byte-level BPE) is \
                 supported",
                data.model
            )));
        }
        let n = data.tokens.len();
        if n == 0 {
            return Err(LlamaError::Tokenizer(
                "the GGUF tokenizer has no tokens".into(),
            ));
        }
        if u32::try_from(n).is_err() {
            return Err(LlamaError::Tokenizer(format!("too many tokens ({n})")));
        }
        if !data.token_types.is_empty() && data.token_types.len() != n {
            return Err(LlamaError::Tokenizer(format!(
                "{} token types for {n} tokens",
                data.token_types.len()
            )));
        }
        for (name, id) in [
            ("bos", data.bos_id),
            ("eos", data.eos_id),
            ("eot", data.eot_id),
        ] {
            if let Some(id) = id
                && id as usize >= n
            {
                return Err(LlamaError::Tokenizer(format!(
                    "{name} token id {id} is outside the vocabulary ({n} tokens)"
                )));
            }
        }
        let kind = PreTokenizerKind::from_name(data.pre.as_deref())?;

        let mut vocab = Vocab::default();
        for (id, token) in (0u32..).zip(&data.tokens) {
            vocab.insert(token.clone(), id);
        }
        let merges = data
            .merges
            .iter()
            .map(|m| {
                parse_merge(m)
                    .ok_or_else(|| LlamaError::Tokenizer(format!("malformed BPE merge `{m}`")))
            })
            .collect::<Result<Vec<_>>>()?;
        let model = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .ignore_merges(kind == PreTokenizerKind::Llama3)
            .build()
            .map_err(|e| LlamaError::Tokenizer(format!("cannot build the BPE model: {e}")))?;

        let mut inner = tokenizers::Tokenizer::new(model);
        inner.with_pre_tokenizer(Some(kind.build()?));
        inner.with_decoder(Some(ByteLevelDecoder::default()));

        let is_special = |i: usize| {
            matches!(
                data.token_types.get(i),
                Some(&(TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED))
            )
        };
        let specials: Vec<AddedToken> = data
            .tokens
            .iter()
            .enumerate()
            .filter(|&(i, token)| is_special(i) && !token.is_empty())
            .map(|(_, token)| AddedToken::from(token.clone(), true))
            .collect();
        inner.add_special_tokens(&specials);

        let bytes = data
            .tokens
            .iter()
            .enumerate()
            .map(|(i, token)| {
                if is_special(i) {
                    token.as_bytes().to_vec()
                } else {
                    byte_level_token_bytes(token)
                }
            })
            .collect();

        let chat_format = data
            .chat_template
            .as_deref()
            .and_then(ChatFormat::from_template);
        let named: &[&str] = match chat_format {
            Some(ChatFormat::ChatMl) => &["<|im_end|>"],
            Some(ChatFormat::Llama3) => &["<|eot_id|>", "<|eom_id|>"],
            None => &[],
        };
        let stop_ids = collect_stop_ids(data.eos_id, data.eot_id, named, |name| {
            inner.token_to_id(name)
        });

        let mut plain = inner.clone();
        plain.set_encode_special_tokens(true);
        Ok(Self {
            inner,
            plain,
            tokens: data.tokens,
            bytes,
            pre: data.pre,
            special: SpecialTokens {
                bos: data.bos_id,
                eos: data.eos_id,
                stop_ids,
                add_bos: data.add_bos,
                chat_format,
            },
            eot_id: data.eot_id,
            add_eos: data.add_eos,
            template: data
                .chat_template
                .as_deref()
                .and_then(|source| ChatTemplate::new(source).ok()),
            chat_template: data.chat_template,
        })
    }

    /// A byte-level tokenizer with one token per byte (ids 0-255) plus
    /// `<|endoftext|>` (id 256, the stop token) and no merges. It needs no model file,
    /// which makes it the tokenizer for randomly initialised models in examples and tests.
    pub fn bytes_only() -> Result<Self> {
        Self::bytes_and_specials(&["<|endoftext|>"])
    }

    /// A byte-level tokenizer (ids 0-255, no merges) followed by the control tokens
    /// `specials` (ids 256 on; the first is the stop token).
    pub(crate) fn bytes_and_specials(specials: &[&str]) -> Result<Self> {
        let mut tokens: Vec<String> = (0..=255u8).map(|b| byte_to_char(b).to_string()).collect();
        tokens.extend(specials.iter().map(|s| s.to_string()));
        let mut token_types = vec![1; 256];
        token_types.extend(specials.iter().map(|_| 3));
        Self::from_gguf_data(GgufTokenizerData {
            model: "gpt2".into(),
            pre: Some("gpt2".into()),
            tokens,
            token_types,
            merges: Vec::new(),
            bos_id: None,
            eos_id: Some(256),
            eot_id: None,
            add_bos: false,
            add_eos: false,
            chat_template: None,
        })
    }

    /// The pre-tokenizer name from the metadata (`tokenizer.ggml.pre`).
    pub fn pre_tokenizer(&self) -> Option<&str> {
        self.pre.as_deref()
    }

    /// The end-of-turn id (`tokenizer.ggml.eot_token_id`), if the file names one.
    pub fn eot_id(&self) -> Option<u32> {
        self.eot_id
    }

    /// Whether the metadata says an EOS token is appended (`tokenizer.ggml.add_eos_token`).
    pub fn add_eos_by_default(&self) -> bool {
        self.add_eos
    }

    /// The Jinja chat template from the metadata (`tokenizer.chat_template`).
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The id of a token given its vocabulary text (byte-level form, e.g. `"Ġthe"`, or a
    /// special token such as `"<|im_end|>"`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The vocabulary text of token `id` (byte-level form).
    pub fn id_to_token(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }
}

impl Tokenizer for GgufBpeTokenizer {
    fn encode_text(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self
            .plain
            .encode_fast(text, false)
            .map_err(|e| LlamaError::Tokenizer(format!("encoding failed: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    fn encode(&self, text: &str, bos: bool, eos: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| LlamaError::Tokenizer(format!("encoding failed: {e}")))?;
        wrap_bos_eos(
            encoding.get_ids().to_vec(),
            bos,
            eos,
            self.special.bos,
            self.special.eos,
        )
    }

    fn decode(&self, ids: &[u32]) -> Result<String> {
        decode_with_table(&self.bytes, ids)
    }

    fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        self.bytes.get(id as usize).cloned()
    }

    fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    fn special_tokens(&self) -> &SpecialTokens {
        &self.special
    }

    fn jinja_template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }
}

/// GPT-2's byte-to-character table: printable Latin-1 bytes map to themselves, the
/// others to U+0100 upwards in byte order.
pub(crate) fn byte_to_char(b: u8) -> char {
    let printable = |x: u8| (33..=126).contains(&x) || (161..=172).contains(&x) || x >= 174;
    if printable(b) {
        return char::from(b);
    }
    let rank = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + rank).unwrap_or(char::REPLACEMENT_CHARACTER)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::assert_err;

    #[test]
    fn byte_alphabet_round_trips() {
        for b in 0..=255u8 {
            assert_eq!(
                byte_level_char_to_byte(byte_to_char(b)),
                Some(b),
                "byte {b}"
            );
        }
        assert_eq!(byte_to_char(b' '), 'Ġ');
        assert_eq!(byte_to_char(b'\n'), 'Ċ');
        assert_eq!(byte_level_char_to_byte(' '), None);
        assert_eq!(byte_level_char_to_byte('Ő'), None);
        assert_eq!(byte_level_token_bytes("Ġhello"), b" hello");
        assert_eq!(byte_level_token_bytes("a b"), b"a b");
    }

    #[test]
    fn merges_parse_at_first_inner_space() {
        assert_eq!(parse_merge("Ġ t"), Some(("Ġ".into(), "t".into())));
        assert_eq!(parse_merge("é x"), Some(("é".into(), "x".into())));
        assert_eq!(parse_merge("ab"), None);
        assert_eq!(parse_merge("a "), None);
    }

    fn tiny_data(pre: Option<&str>) -> GgufTokenizerData {
        let mut tokens: Vec<String> = vec![
            "<|endoftext|>".into(),
            "<|im_start|>".into(),
            "<|im_end|>".into(),
        ];
        let mut token_types = vec![3, 3, 3];
        for b in 0..=255u8 {
            tokens.push(byte_to_char(b).to_string());
            token_types.push(1);
        }
        let merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "1 2", "Ġ 1"];
        for merge in merges {
            tokens.push(merge.replace(' ', ""));
            token_types.push(1);
        }
        GgufTokenizerData {
            model: "gpt2".into(),
            pre: pre.map(str::to_string),
            tokens,
            token_types,
            merges: merges.iter().map(|m| m.to_string()).collect(),
            bos_id: Some(1),
            eos_id: Some(2),
            eot_id: None,
            add_bos: false,
            add_eos: false,
            chat_template: Some("{{'<|im_start|>' + message['role']}}".into()),
        }
    }

    fn id_of(tok: &GgufBpeTokenizer, token: &str) -> u32 {
        tok.token_to_id(token).unwrap()
    }

    #[test]
    fn encodes_with_merges_and_specials() {
        let tok = GgufBpeTokenizer::from_gguf_data(tiny_data(Some("gpt2"))).unwrap();
        let ids = tok.encode("<|im_start|>hello w", true, true).unwrap();
        assert_eq!(ids, vec![1, 1, id_of(&tok, "hello"), id_of(&tok, "Ġw"), 2]);
        assert_eq!(
            tok.decode(&ids).unwrap(),
            "<|im_start|><|im_start|>hello w<|im_end|>"
        );
        assert_eq!(tok.vocab_size(), 3 + 256 + 7);
        assert_eq!(tok.chat_format(), Some(ChatFormat::ChatMl));
        assert_eq!(tok.stop_ids(), &[2]);
        assert!(tok.is_stop(2));
        assert!(!tok.add_bos_by_default());
        assert_eq!(tok.token_bytes(id_of(&tok, "Ġw")), Some(b" w".to_vec()));
        assert_eq!(tok.token_bytes(2), Some(b"<|im_end|>".to_vec()));
        assert_eq!(tok.token_bytes(100_000), None);
        assert_err!(
            tok.decode(&[100_000]),
            LlamaError::Tokenizer(m) if m.contains("token id 100000 is outside")
        );
    }

    #[test]
    fn digit_rule_depends_on_pre_tokenizer() {
        let gpt2 = GgufBpeTokenizer::from_gguf_data(tiny_data(None)).unwrap();
        let smollm = GgufBpeTokenizer::from_gguf_data(tiny_data(Some("smollm"))).unwrap();
        let one = id_of(&gpt2, "1");
        let two = id_of(&gpt2, "2");
        assert_eq!(
            gpt2.encode("12", false, false).unwrap(),
            vec![id_of(&gpt2, "12")]
        );
        assert_eq!(smollm.encode("12", false, false).unwrap(), vec![one, two]);
        // GPT-2 keeps the space with the number; smollm splits the digits first.
        assert_eq!(
            gpt2.encode(" 12", false, false).unwrap(),
            vec![id_of(&gpt2, "Ġ"), id_of(&gpt2, "12")]
        );
        assert_eq!(
            gpt2.encode(" 1", false, false).unwrap(),
            vec![id_of(&gpt2, "Ġ1")]
        );
        assert_eq!(
            smollm.encode(" 1", false, false).unwrap(),
            vec![id_of(&smollm, "Ġ"), one]
        );
        assert_eq!(
            smollm.encode(" 12", false, false).unwrap(),
            vec![id_of(&smollm, "Ġ"), one, two]
        );
        let llama = GgufBpeTokenizer::from_gguf_data(tiny_data(Some("llama-bpe"))).unwrap();
        assert_eq!(
            llama.encode("12", false, false).unwrap(),
            vec![id_of(&llama, "12")]
        );
        assert_eq!(
            llama
                .decode(&llama.encode("héllo 12\n", false, false).unwrap())
                .unwrap(),
            "héllo 12\n"
        );
    }

    #[test]
    fn rejects_unsupported_and_malformed_metadata() {
        let mut data = tiny_data(None);
        data.model = "llama".into();
        let err = GgufBpeTokenizer::from_gguf_data(data).unwrap_err();
        assert!(
            matches!(err, LlamaError::Tokenizer(ref m) if m.contains("llama")),
            "{err}"
        );

        let err = GgufBpeTokenizer::from_gguf_data(tiny_data(Some("mystery"))).unwrap_err();
        assert!(err.to_string().contains("mystery"));

        let mut data = tiny_data(None);
        data.merges.push("nospace".into());
        assert_err!(
            GgufBpeTokenizer::from_gguf_data(data),
            LlamaError::Tokenizer(m) if m.contains("malformed BPE merge `nospace`")
        );

        let mut data = tiny_data(None);
        data.merges.push("q zz".into());
        assert_err!(
            GgufBpeTokenizer::from_gguf_data(data),
            LlamaError::Tokenizer(m) if m.contains("cannot build the BPE model")
        );

        let mut data = tiny_data(None);
        data.eos_id = Some(1 << 20);
        assert_err!(
            GgufBpeTokenizer::from_gguf_data(data),
            LlamaError::Tokenizer(m) if m.contains("eos token id 1048576 is outside")
        );

        let mut data = tiny_data(None);
        data.token_types.pop();
        assert_err!(
            GgufBpeTokenizer::from_gguf_data(data),
            LlamaError::Tokenizer(m) if m.contains("token types for")
        );

        assert_err!(
            GgufBpeTokenizer::from_gguf_data(GgufTokenizerData {
                model: "gpt2".into(),
                ..Default::default()
            }),
            LlamaError::Tokenizer(m) if m.contains("has no tokens")
        );
    }

    #[test]
    fn llama3_template_sets_format_and_stops() {
        let mut data = tiny_data(Some("llama-bpe"));
        data.tokens[0] = "<|eot_id|>".into();
        data.eot_id = Some(0);
        data.chat_template = Some("{{ '<|start_header_id|>' }}".into());
        let tok = GgufBpeTokenizer::from_gguf_data(data).unwrap();
        assert_eq!(tok.chat_format(), Some(ChatFormat::Llama3));
        assert_eq!(tok.stop_ids(), &[2, 0]);
        assert_eq!(tok.eot_id(), Some(0));
    }
}
