//! Tokenizers: text to token ids and back.
//!
//! Three implementations share the [`Tokenizer`] trait:
//! - [`GgufBpeTokenizer`]: the byte-level BPE embedded in a GGUF file's metadata
//!   (`tokenizer.ggml.model = "gpt2"`), as SmolLM2 and Llama 3 GGUFs ship it;
//! - [`HfTokenizer`]: a Hugging Face `tokenizer.json` (optionally with the model
//!   directory's `tokenizer_config.json`, `generation_config.json` and `config.json`);
//! - `Llama3Tokenizer` (feature `llama3`): Meta's tiktoken `tokenizer.model` for Llama 3.
//!
//! The loaders return them as a [`DynTokenizer`] (`Arc<dyn Tokenizer>`), which is a
//! [`Tokenizer`] too, so an application names one model type whatever it loads.
//!
//! [`StreamDecoder`] turns generated ids into text piece by piece without ever splitting a
//! UTF-8 character, and [`ChatFormat`] writes conversations in the model's chat format.

mod bpe;
mod chat;
mod hf;
mod stream;
#[cfg(feature = "llama3")]
mod tiktoken;

pub use bpe::{GgufBpeTokenizer, GgufTokenizerData};
pub use chat::{ChatFormat, ChatMessage, ChatPiece, SMOLLM_DEFAULT_SYSTEM_PROMPT};
pub use hf::HfTokenizer;
pub use stream::StreamDecoder;
#[cfg(feature = "llama3")]
#[cfg_attr(docsrs, doc(cfg(feature = "llama3")))]
pub use tiktoken::Llama3Tokenizer;

use std::sync::Arc;

use crate::error::{LlamaError, Result};

/// Converts between text and token ids.
///
/// Implementations are immutable after construction and can be shared between threads.
pub trait Tokenizer: Send + Sync + 'static {
    /// Encodes `text`; special tokens written in the text (e.g. "<|im_start|>") are recognised as such.
    ///
    /// With `bos` the BOS id is put first and with `eos` the EOS id last; asking for one the
    /// tokenizer does not have is an error.
    fn encode(&self, text: &str, bos: bool, eos: bool) -> Result<Vec<u32>>;

    /// Encodes `text` as plain text: a special token written in it (`"<|im_end|>"`) is
    /// encoded as the characters it is made of, never as its special id. No BOS or EOS.
    ///
    /// This is how untrusted text (a chat message) must be encoded.
    fn encode_text(&self, text: &str) -> Result<Vec<u32>>;

    /// Decodes ids to text (special tokens are rendered as their text).
    ///
    /// An id outside the vocabulary is an error.
    fn decode(&self, ids: &[u32]) -> Result<String>;

    /// Raw bytes of one token (for streaming); None for an unknown id.
    fn token_bytes(&self, id: u32) -> Option<Vec<u8>>;

    /// Number of ids (largest id + 1).
    fn vocab_size(&self) -> usize;

    /// The beginning-of-sequence id, if the tokenizer has one.
    fn bos_id(&self) -> Option<u32>;

    /// The end-of-sequence id, if the tokenizer has one.
    fn eos_id(&self) -> Option<u32>;

    /// Ids that end generation (eos, end-of-turn, ...).
    fn stop_ids(&self) -> &[u32];

    /// Whether the model's own metadata says a BOS token is prepended to prompts.
    fn add_bos_by_default(&self) -> bool;

    /// The chat format this tokenizer's model uses, if known.
    fn chat_format(&self) -> Option<ChatFormat>;

    /// Whether `id` ends generation (is one of [`Tokenizer::stop_ids`]).
    fn is_stop(&self, id: u32) -> bool {
        self.stop_ids().contains(&id)
    }

    /// Formats `messages` in the model's [`ChatFormat`] and encodes the result.
    ///
    /// The template's own control tokens are encoded as their special ids and everything
    /// else (role names and message content) as plain text with [`Tokenizer::encode_text`],
    /// so a message that writes `"<|im_end|>"` or `"<|eot_id|>"` cannot end its turn or
    /// forge another one. For ordinary messages the ids equal those of encoding
    /// [`ChatFormat::format`]'s text with [`Tokenizer::encode`].
    ///
    /// No BOS id is added for [`ChatFormat::Llama3`] (its text already starts with
    /// `<|begin_of_text|>`); for [`ChatFormat::ChatMl`] one is added only when
    /// [`Tokenizer::add_bos_by_default`] says so. Fails when the chat format is unknown or
    /// a control token of the template is not one token of this vocabulary.
    fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        let format = self.chat_format().ok_or_else(|| {
            LlamaError::Tokenizer("the model's chat format is unknown".to_string())
        })?;
        let mut ids = Vec::new();
        for piece in format.pieces(messages, add_generation_prompt) {
            match piece {
                ChatPiece::Special(token) => match self.encode(token, false, false)?[..] {
                    [id] => ids.push(id),
                    _ => {
                        return Err(LlamaError::Tokenizer(format!(
                            "the chat template's control token `{token}` is not a single \
                             token of this vocabulary"
                        )));
                    }
                },
                ChatPiece::Text(text) => ids.extend(self.encode_text(&text)?),
            }
        }
        let bos = format == ChatFormat::ChatMl && self.add_bos_by_default();
        wrap_bos_eos(ids, bos, false, self.bos_id(), self.eos_id())
    }
}

/// A tokenizer chosen at run time, shared: what the loaders return, so an application
/// names one concrete model type, `Llama<B, DynTokenizer>`, whatever file it loads.
///
/// ```
/// use std::sync::Arc;
/// use llama_burn::tokenizer::{DynTokenizer, GgufBpeTokenizer, Tokenizer};
///
/// # fn main() -> llama_burn::Result<()> {
/// let tokenizer: DynTokenizer = Arc::new(GgufBpeTokenizer::bytes_only()?);
/// let ids = tokenizer.encode("hi", false, false)?;
/// assert_eq!(tokenizer.decode(&ids)?, "hi");
/// # Ok(())
/// # }
/// ```
pub type DynTokenizer = Arc<dyn Tokenizer>;

impl std::fmt::Debug for dyn Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("chat_format", &self.chat_format())
            .finish_non_exhaustive()
    }
}

/// A shared tokenizer is one: every method is the shared one's (its own `is_stop` and
/// `encode_chat` included).
impl<T: Tokenizer + ?Sized> Tokenizer for Arc<T> {
    fn encode(&self, text: &str, bos: bool, eos: bool) -> Result<Vec<u32>> {
        (**self).encode(text, bos, eos)
    }

    fn encode_text(&self, text: &str) -> Result<Vec<u32>> {
        (**self).encode_text(text)
    }

    fn decode(&self, ids: &[u32]) -> Result<String> {
        (**self).decode(ids)
    }

    fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        (**self).token_bytes(id)
    }

    fn vocab_size(&self) -> usize {
        (**self).vocab_size()
    }

    fn bos_id(&self) -> Option<u32> {
        (**self).bos_id()
    }

    fn eos_id(&self) -> Option<u32> {
        (**self).eos_id()
    }

    fn stop_ids(&self) -> &[u32] {
        (**self).stop_ids()
    }

    fn add_bos_by_default(&self) -> bool {
        (**self).add_bos_by_default()
    }

    fn chat_format(&self) -> Option<ChatFormat> {
        (**self).chat_format()
    }

    fn is_stop(&self, id: u32) -> bool {
        (**self).is_stop(id)
    }

    fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        (**self).encode_chat(messages, add_generation_prompt)
    }
}

/// Adds the BOS/EOS ids around `ids` as asked, failing when the tokenizer lacks them.
pub(crate) fn wrap_bos_eos(
    mut ids: Vec<u32>,
    bos: bool,
    eos: bool,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
) -> Result<Vec<u32>> {
    if bos {
        let bos_id = bos_id.ok_or_else(|| {
            LlamaError::Tokenizer("a BOS token was requested but the tokenizer has none".into())
        })?;
        ids.insert(0, bos_id);
    }
    if eos {
        let eos_id = eos_id.ok_or_else(|| {
            LlamaError::Tokenizer("an EOS token was requested but the tokenizer has none".into())
        })?;
        ids.push(eos_id);
    }
    Ok(ids)
}

/// Decodes ids through a table of each token's bytes (invalid UTF-8 becomes U+FFFD).
pub(crate) fn decode_with_table(table: &[Vec<u8>], ids: &[u32]) -> Result<String> {
    let mut bytes = Vec::with_capacity(ids.len() * 4);
    for &id in ids {
        let token = table
            .get(id as usize)
            .ok_or_else(|| unknown_id(id, table.len()))?;
        bytes.extend_from_slice(token);
    }
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// The error for an id outside the vocabulary.
pub(crate) fn unknown_id(id: u32, vocab_size: usize) -> LlamaError {
    LlamaError::Tokenizer(format!(
        "token id {id} is outside the vocabulary ({vocab_size} ids)"
    ))
}

/// Builds the stop-id list: `eos`, the given extra ids, then the ids of the named tokens
/// that exist, without duplicates.
pub(crate) fn collect_stop_ids(
    eos: Option<u32>,
    extra: impl IntoIterator<Item = u32>,
    named: &[&str],
    lookup: impl Fn(&str) -> Option<u32>,
) -> Vec<u32> {
    let mut out: Vec<u32> = Vec::new();
    let candidates = eos
        .into_iter()
        .chain(extra)
        .chain(named.iter().filter_map(|name| lookup(name)));
    for id in candidates {
        if !out.contains(&id) {
            out.push(id);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrap_adds_requested_ids() {
        let ids = wrap_bos_eos(vec![5, 6], true, true, Some(1), Some(2)).unwrap();
        assert_eq!(ids, vec![1, 5, 6, 2]);
        let ids = wrap_bos_eos(vec![5], false, false, None, None).unwrap();
        assert_eq!(ids, vec![5]);
        assert!(wrap_bos_eos(vec![5], true, false, None, Some(2)).is_err());
        assert!(wrap_bos_eos(vec![5], false, true, Some(1), None).is_err());
    }

    #[test]
    fn stop_ids_are_unique_and_ordered() {
        let lookup = |s: &str| match s {
            "<|im_end|>" => Some(2),
            "<|eot_id|>" => Some(9),
            _ => None,
        };
        let ids = collect_stop_ids(
            Some(2),
            [7, 2],
            &["<|im_end|>", "<|eot_id|>", "<x>"],
            lookup,
        );
        assert_eq!(ids, vec![2, 7, 9]);
    }
}
