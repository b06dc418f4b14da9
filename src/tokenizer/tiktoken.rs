//! Meta's Llama 3 tokenizer (`tokenizer.model`, tiktoken format).

use std::collections::{HashMap, HashSet};
use std::path::Path;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use tiktoken_rs::CoreBPE;

use super::bpe::LLAMA3_PATTERN;
use super::{ChatFormat, SpecialTokens, Tokenizer, decode_with_table, wrap_bos_eos};
use crate::error::{LlamaError, Result};

/// Number of special tokens after the base vocabulary.
const NUM_SPECIAL_TOKENS: usize = 256;
/// The named special tokens, in Meta's order; `<|reserved_special_token_N|>` (N from 2)
/// fill the rest of the 256.
const NAMED_SPECIAL_TOKENS: [&str; 12] = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<|image|>",
];
/// Longest run of white space or of non-white space handed to the regex at once (as in
/// Meta's reference code), which keeps the backtracking regex well inside its limits.
const MAX_RUN_CHARS: usize = 25_000;

/// The 256 special tokens in id order.
fn special_tokens() -> Vec<String> {
    let named = NAMED_SPECIAL_TOKENS.iter().map(|s| s.to_string());
    let reserved = (2..).map(|i| format!("<|reserved_special_token_{i}|>"));
    named.chain(reserved).take(NUM_SPECIAL_TOKENS).collect()
}

/// Splits `text` into slices none of which has more than `max` consecutive white-space or
/// consecutive non-white-space characters.
fn split_long_runs(text: &str, max: usize) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut start, mut run, mut run_is_space) = (0, 0, None);
    for (at, c) in text.char_indices() {
        let is_space = c.is_whitespace();
        if run_is_space == Some(is_space) {
            run += 1;
            if run > max {
                out.push(&text[start..at]);
                start = at;
                run = 1;
            }
        } else {
            run_is_space = Some(is_space);
            run = 1;
        }
    }
    if start < text.len() || out.is_empty() {
        out.push(&text[start..]);
    }
    out
}

/// Meta's Llama 3 (3, 3.1, 3.2) tokenizer: 128 000 byte-level BPE ranks from
/// `tokenizer.model` plus 256 special tokens (`<|begin_of_text|>` = 128000,
/// `<|end_of_text|>` = 128001, ..., `<|eot_id|>` = 128009).
///
/// Special tokens written in the text are recognised; BOS is added by default, and the
/// stop ids are `<|end_of_text|>`, `<|eom_id|>` and `<|eot_id|>`.
pub struct Llama3Tokenizer {
    bpe: CoreBPE,
    /// Bytes of every id, base ranks then special tokens.
    bytes: Vec<Vec<u8>>,
    special: SpecialTokens,
}

impl std::fmt::Debug for Llama3Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Llama3Tokenizer")
            .field("vocab_size", &self.bytes.len())
            .field("special", &self.special)
            .finish_non_exhaustive()
    }
}

impl Llama3Tokenizer {
    /// Loads Meta's `tokenizer.model` (one `base64-token rank` pair per line).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let data = std::fs::read(path).map_err(|e| LlamaError::io(path, e))?;
        Self::from_bytes(&data)
            .map_err(|e| LlamaError::Tokenizer(format!("{}: {e}", path.display())))
    }

    /// Parses the contents of a `tokenizer.model`. The ranks must be exactly
    /// `0..n` (each once); the special tokens get ids `n..n + 256`.
    pub fn from_bytes(data: &[u8]) -> Result<Self> {
        let text = std::str::from_utf8(data)
            .map_err(|_| LlamaError::Tokenizer("tokenizer.model is not text".into()))?;
        let mut ranked: Vec<Option<Vec<u8>>> = Vec::new();
        let mut encoder: HashMap<Vec<u8>, u32> = HashMap::new();
        for (line_no, line) in text.lines().enumerate().map(|(i, l)| (i + 1, l.trim())) {
            if line.is_empty() {
                continue;
            }
            let bad = |what: &str| {
                LlamaError::Tokenizer(format!("tokenizer.model line {line_no}: {what}"))
            };
            let mut fields = line.split_whitespace();
            let (Some(token), Some(rank), None) = (fields.next(), fields.next(), fields.next())
            else {
                return Err(bad("expected `<base64 token> <rank>`"));
            };
            let token = BASE64.decode(token).map_err(|_| bad("invalid base64"))?;
            let rank: u32 = rank.parse().map_err(|_| bad("invalid rank"))?;
            let slot = rank as usize;
            if slot >= ranked.len() {
                if slot > 10_000_000 {
                    return Err(bad("rank out of range"));
                }
                ranked.resize(slot + 1, None);
            }
            if ranked[slot].is_some() {
                return Err(bad("duplicate rank"));
            }
            if encoder.insert(token.clone(), rank).is_some() {
                return Err(bad("duplicate token"));
            }
            ranked[slot] = Some(token);
        }
        if ranked.is_empty() {
            return Err(LlamaError::Tokenizer("tokenizer.model is empty".into()));
        }
        let mut bytes: Vec<Vec<u8>> = ranked
            .into_iter()
            .enumerate()
            .map(|(rank, token)| {
                token.ok_or_else(|| {
                    LlamaError::Tokenizer(format!("tokenizer.model has no token of rank {rank}"))
                })
            })
            .collect::<Result<_>>()?;

        let num_base = u32::try_from(bytes.len())
            .map_err(|_| LlamaError::Tokenizer("tokenizer.model is too large".into()))?;
        let specials: HashMap<String, u32> = special_tokens().into_iter().zip(num_base..).collect();
        let id_of = |name: &str| specials.get(name).copied();
        let (Some(bos_id), Some(eos_id), Some(eom_id), Some(eot_id)) = (
            id_of("<|begin_of_text|>"),
            id_of("<|end_of_text|>"),
            id_of("<|eom_id|>"),
            id_of("<|eot_id|>"),
        ) else {
            return Err(LlamaError::Tokenizer("special tokens are missing".into()));
        };
        let mut by_id: Vec<(&String, &u32)> = specials.iter().collect();
        by_id.sort_by_key(|&(_, id)| *id);
        bytes.extend(by_id.into_iter().map(|(name, _)| name.as_bytes().to_vec()));

        let bpe = CoreBPE::new(
            encoder.into_iter().collect(),
            specials.into_iter().collect(),
            LLAMA3_PATTERN,
        )
        .map_err(|e| LlamaError::Tokenizer(format!("cannot build the BPE: {e}")))?;
        Ok(Self {
            bpe,
            bytes,
            special: SpecialTokens {
                bos: Some(bos_id),
                eos: Some(eos_id),
                stop_ids: vec![eos_id, eom_id, eot_id],
                add_bos: true,
                chat_format: Some(ChatFormat::Llama3),
            },
        })
    }

    /// The id of a special token such as `"<|eot_id|>"`.
    pub fn special_token_id(&self, name: &str) -> Option<u32> {
        let first = self.bytes.len().checked_sub(NUM_SPECIAL_TOKENS)?;
        let offset = special_tokens().iter().position(|s| s == name)?;
        u32::try_from(first + offset).ok()
    }
}

impl Tokenizer for Llama3Tokenizer {
    fn encode_text(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        for part in split_long_runs(text, MAX_RUN_CHARS) {
            ids.extend(self.bpe.encode_ordinary(part));
        }
        Ok(ids)
    }

    fn encode(&self, text: &str, bos: bool, eos: bool) -> Result<Vec<u32>> {
        let allowed: HashSet<&str> = self.bpe.special_tokens();
        let mut ids = Vec::new();
        for part in split_long_runs(text, MAX_RUN_CHARS) {
            ids.extend(self.bpe.encode(part, &allowed).0);
        }
        wrap_bos_eos(ids, bos, eos, self.special.bos, self.special.eos)
    }

    fn decode(&self, ids: &[u32]) -> Result<String> {
        decode_with_table(&self.bytes, ids)
    }

    fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        self.bytes.get(id as usize).cloned()
    }

    fn vocab_size(&self) -> usize {
        self.bytes.len()
    }

    fn special_tokens(&self) -> &SpecialTokens {
        &self.special
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::assert_err;

    /// A tokenizer.model with the 256 single bytes and a few merges.
    fn tiny_model() -> String {
        let mut lines: Vec<String> = (0..=255u8)
            .map(|b| format!("{} {b}", BASE64.encode([b])))
            .collect();
        for (i, token) in ["he", "ll", "hell", "hello", " w"].iter().enumerate() {
            lines.push(format!("{} {}", BASE64.encode(token), 256 + i));
        }
        lines.join("\n")
    }

    #[test]
    fn special_token_table_follows_meta() {
        let specials = special_tokens();
        assert_eq!(specials.len(), 256);
        assert_eq!(specials[0], "<|begin_of_text|>");
        assert_eq!(specials[9], "<|eot_id|>");
        assert_eq!(specials[12], "<|reserved_special_token_2|>");
        assert_eq!(specials[255], "<|reserved_special_token_245|>");
    }

    #[test]
    fn tiny_model_encodes_and_decodes() {
        let tok = Llama3Tokenizer::from_bytes(tiny_model().as_bytes()).unwrap();
        assert_eq!(tok.vocab_size(), 261 + 256);
        assert_eq!(tok.bos_id(), Some(261));
        assert_eq!(tok.eos_id(), Some(262));
        assert_eq!(tok.stop_ids(), &[262, 261 + 8, 261 + 9]);
        assert_eq!(tok.special_token_id("<|eot_id|>"), Some(270));
        assert!(tok.add_bos_by_default());
        assert_eq!(tok.chat_format(), Some(ChatFormat::Llama3));
        let ids = tok.encode("hello world<|eot_id|>", true, false).unwrap();
        assert_eq!(ids[..3], [261, 259, 260]);
        assert_eq!(ids.last(), Some(&270));
        assert_eq!(
            tok.decode(&ids).unwrap(),
            "<|begin_of_text|>hello world<|eot_id|>"
        );
        assert_eq!(tok.token_bytes(260), Some(b" w".to_vec()));
        assert_err!(
            tok.decode(&[100_000]),
            LlamaError::Tokenizer(m) if m.contains("token id 100000 is outside")
        );
    }

    #[test]
    fn malformed_models_are_rejected() {
        for (bad, why) in [
            ("", "is empty"),
            ("aGk=", "expected `<base64 token> <rank>`"),
            ("aGk= x", "invalid rank"),
            ("!!! 0", "invalid base64"),
            ("aGk= 1", "no token of rank 0"),
            ("aGk= 0\naGk= 1", "line 2: duplicate token"),
            ("aGk= 0\naQ== 0", "line 2: duplicate rank"),
        ] {
            assert_err!(
                Llama3Tokenizer::from_bytes(bad.as_bytes()),
                LlamaError::Tokenizer(m) if m.contains(why)
            );
        }
    }

    #[test]
    fn long_runs_are_split() {
        assert_eq!(split_long_runs("", 3), vec![""]);
        assert_eq!(split_long_runs("ab  cd", 3), vec!["ab  cd"]);
        assert_eq!(split_long_runs("abcdefg  x", 3), vec!["abc", "def", "g  x"]);
        assert_eq!(split_long_runs("a     b", 2), vec!["a  ", "  ", " b"]);
        let text = "x".repeat(60_000) + &" ".repeat(30_000);
        let tok = Llama3Tokenizer::from_bytes(tiny_model().as_bytes()).unwrap();
        let ids = tok.encode(&text, false, false).unwrap();
        assert_eq!(tok.decode(&ids).unwrap(), text);
    }
}
