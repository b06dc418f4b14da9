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
pub(crate) mod chat;
mod hf;
mod stream;
mod template;
#[cfg(feature = "llama3")]
mod tiktoken;

pub use bpe::{GgufBpeTokenizer, GgufTokenizerData};
pub use chat::{ChatFormat, ChatMessage, ChatPiece, SMOLLM_DEFAULT_SYSTEM_PROMPT};
pub use hf::HfTokenizer;
pub use stream::StreamDecoder;
pub use template::{ChatTemplate, TEMPLATE_FUEL_BASE, TEMPLATE_FUEL_PER_ITEM};
#[cfg(feature = "llama3")]
#[cfg_attr(docsrs, doc(cfg(feature = "llama3")))]
pub use tiktoken::Llama3Tokenizer;

use std::sync::Arc;

use crate::error::{LlamaError, Result};
use crate::tools::{Tool, ToolFormat};

/// Converts between text and token ids.
///
/// A tokenizer's special tokens and how prompts use them: what every [`Tokenizer`]
/// holds once, and its accessors ([`Tokenizer::bos_id`], [`Tokenizer::stop_ids`], ...)
/// read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    /// The beginning-of-sequence id, if any.
    pub bos: Option<u32>,
    /// The end-of-sequence id, if any.
    pub eos: Option<u32>,
    /// Ids that end generation (eos, end-of-turn, ...), each once.
    pub stop_ids: Vec<u32>,
    /// Whether the model's own metadata says a BOS token is prepended to prompts.
    pub add_bos: bool,
    /// The chat format the model uses, if known.
    pub chat_format: Option<ChatFormat>,
}

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

    /// The special tokens and how prompts use them; the five accessors below read it.
    fn special_tokens(&self) -> &SpecialTokens;

    /// The beginning-of-sequence id, if the tokenizer has one.
    fn bos_id(&self) -> Option<u32> {
        self.special_tokens().bos
    }

    /// The end-of-sequence id, if the tokenizer has one.
    fn eos_id(&self) -> Option<u32> {
        self.special_tokens().eos
    }

    /// Ids that end generation (eos, end-of-turn, ...).
    fn stop_ids(&self) -> &[u32] {
        &self.special_tokens().stop_ids
    }

    /// Whether the model's own metadata says a BOS token is prepended to prompts.
    fn add_bos_by_default(&self) -> bool {
        self.special_tokens().add_bos
    }

    /// The chat format this tokenizer's model uses, if known.
    fn chat_format(&self) -> Option<ChatFormat> {
        self.special_tokens().chat_format
    }

    /// Whether `id` ends generation (is one of [`Tokenizer::stop_ids`]).
    fn is_stop(&self, id: u32) -> bool {
        self.stop_ids().contains(&id)
    }

    /// The model's own Jinja chat template, compiled, if it has one that compiles.
    fn jinja_template(&self) -> Option<&ChatTemplate> {
        None
    }

    /// How this model writes tool calls: from its chat template
    /// ([`ToolFormat::for_template`]); Hermes blocks when it has none.
    fn tool_format(&self) -> ToolFormat {
        ToolFormat::for_template(self.jinja_template().map(ChatTemplate::source))
    }

    /// Formats `messages` with the model's chat template and encodes the result (see
    /// [`encode_conversation`](Self::encode_conversation), without tools).
    fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        self.encode_conversation(messages, &[], add_generation_prompt)
    }

    /// Formats `messages`, with `tools` the model may call, and encodes the result. With
    /// `add_generation_prompt` the header of an assistant turn follows, so the model's
    /// continuation is its answer.
    ///
    /// The model's own template ([`jinja_template`](Self::jinja_template)) writes the
    /// conversation when it has one, else its built-in [`ChatFormat`]. Tools go to a
    /// template that takes them; otherwise they are described in the system prompt and
    /// the tool history is written as text ([`crate::tools::prompt`]).
    ///
    /// Message content is encoded as plain text with [`Tokenizer::encode_text`], and only
    /// the template's own text with its control tokens, so a message that writes
    /// `"<|im_end|>"` or `"<|eot_id|>"` cannot end its turn or forge another one. What a
    /// template writes itself from the request (roles, tool definitions and earlier
    /// calls) is refused if it writes a control token.
    ///
    /// A BOS id is put first when [`Tokenizer::add_bos_by_default`] says so and the
    /// text does not start with it already (the built-in Llama 3 format writes
    /// `<|begin_of_text|>` itself).
    ///
    /// # Errors
    ///
    /// [`LlamaError::Tokenizer`] when the chat format is unknown, the template fails, a
    /// control token of the format is not one token of this vocabulary, or a role or
    /// tool writes a control token.
    fn encode_conversation(
        &self,
        messages: &[ChatMessage],
        tools: &[Tool],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        let template = self.jinja_template();
        let native_tools = template.is_some_and(ChatTemplate::supports_tools);
        let written;
        let (messages, tools) = if native_tools {
            (messages, tools)
        } else {
            written = crate::tools::prompt::with_tools_prompt(messages, tools);
            (&written[..], &[][..])
        };
        let pieces = match template {
            Some(template) => {
                check_template_inputs(self, messages, tools)?;
                let text_of = |id: Option<u32>| {
                    id.and_then(|id| self.token_bytes(id))
                        .map(|b| String::from_utf8_lossy(&b).into_owned())
                        .unwrap_or_default()
                };
                template.render(
                    messages,
                    tools,
                    add_generation_prompt,
                    &text_of(self.bos_id()),
                    &text_of(self.eos_id()),
                )?
            }
            None => self
                .chat_format()
                .ok_or_else(|| {
                    LlamaError::Tokenizer("the model's chat format is unknown".to_string())
                })?
                .pieces(messages, add_generation_prompt),
        };
        // Control tokens as their ids; the text between them (the template's own and
        // message content, which never holds one) as plain text, in runs as long as
        // possible so that the ids are those of the whole text.
        let mut ids = Vec::new();
        let mut run = String::new();
        for piece in pieces {
            match piece {
                ChatPiece::Special(token) => {
                    let id = match self.encode(token, false, false)?[..] {
                        [id] => id,
                        _ => {
                            return Err(LlamaError::Tokenizer(format!(
                                "the chat template's control token `{token}` is not a \
                                 single token of this vocabulary"
                            )));
                        }
                    };
                    ids.extend(self.encode_text(&std::mem::take(&mut run))?);
                    ids.push(id);
                }
                ChatPiece::Text(text) => run.push_str(&text),
                ChatPiece::Markup(text) => {
                    let mut rest = text.as_str();
                    for (id, special) in control_tokens(self, &text)? {
                        let Some(at) = rest.find(&special) else {
                            continue;
                        };
                        run.push_str(&rest[..at]);
                        ids.extend(self.encode_text(&std::mem::take(&mut run))?);
                        ids.push(id);
                        rest = &rest[at + special.len()..];
                    }
                    run.push_str(rest);
                }
            }
        }
        ids.extend(self.encode_text(&run)?);
        let bos =
            self.add_bos_by_default() && self.bos_id().is_some_and(|b| ids.first() != Some(&b));
        wrap_bos_eos(ids, bos, false, self.bos_id(), self.eos_id())
    }
}

/// The control tokens `text` holds, in order: the ids of encoding it with special-token
/// matching whose own text does not encode back to them as plain text.
fn control_tokens<T: Tokenizer + ?Sized>(tokenizer: &T, text: &str) -> Result<Vec<(u32, String)>> {
    let mut out = Vec::new();
    for id in tokenizer.encode(text, false, false)? {
        let Some(bytes) = tokenizer.token_bytes(id) else {
            continue;
        };
        let Ok(token) = String::from_utf8(bytes) else {
            continue;
        };
        if !token.is_empty() && tokenizer.encode_text(&token)? != [id] {
            out.push((id, token));
        }
    }
    Ok(out)
}

/// Refuses what a template would write from the request as its own text (roles, tool
/// definitions, earlier calls) when it holds a control token of `tokenizer`.
fn check_template_inputs<T: Tokenizer + ?Sized>(
    tokenizer: &T,
    messages: &[ChatMessage],
    tools: &[Tool],
) -> Result<()> {
    let check = |what: &str, text: &str| -> Result<()> {
        if tokenizer.encode(text, false, false)? != tokenizer.encode_text(text)? {
            return Err(LlamaError::Tokenizer(format!(
                "{what} writes a control token of the model"
            )));
        }
        Ok(())
    };
    for message in messages {
        check("a message's role", &message.role)?;
        for call in &message.tool_calls {
            check(
                "a tool call",
                &format!("{}{}{}", call.id, call.name, call.arguments),
            )?;
        }
        if let Some(id) = &message.tool_call_id {
            check("a tool_call_id", id)?;
        }
    }
    for tool in tools {
        check("a tool definition", &tool.openai_json().to_string())?;
    }
    Ok(())
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

    fn special_tokens(&self) -> &SpecialTokens {
        (**self).special_tokens()
    }

    fn is_stop(&self, id: u32) -> bool {
        (**self).is_stop(id)
    }

    fn jinja_template(&self) -> Option<&ChatTemplate> {
        (**self).jinja_template()
    }

    fn tool_format(&self) -> ToolFormat {
        (**self).tool_format()
    }

    fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        (**self).encode_chat(messages, add_generation_prompt)
    }

    fn encode_conversation(
        &self,
        messages: &[ChatMessage],
        tools: &[Tool],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        (**self).encode_conversation(messages, tools, add_generation_prompt)
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
    use crate::error::assert_err;

    #[test]
    fn wrap_adds_requested_ids() {
        let ids = wrap_bos_eos(vec![5, 6], true, true, Some(1), Some(2)).unwrap();
        assert_eq!(ids, vec![1, 5, 6, 2]);
        let ids = wrap_bos_eos(vec![5], false, false, None, None).unwrap();
        assert_eq!(ids, vec![5]);
        assert_err!(
            wrap_bos_eos(vec![5], true, false, None, Some(2)),
            LlamaError::Tokenizer(m) if m.contains("a BOS token was requested")
        );
        assert_err!(
            wrap_bos_eos(vec![5], false, true, Some(1), None),
            LlamaError::Tokenizer(m) if m.contains("an EOS token was requested")
        );
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
