//! Chat prompt formats: turning a conversation into the text a chat-tuned model expects.

use serde::{Deserialize, Serialize};

use crate::tools::ToolCall;

/// The system prompt SmolLM2-Instruct's ChatML template inserts when a conversation does
/// not start with a system message.
pub const SMOLLM_DEFAULT_SYSTEM_PROMPT: &str =
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face";

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ChatMessage {
    /// Who speaks: `"system"`, `"user"`, `"assistant"` (or another role the model knows,
    /// such as `"ipython"` for Llama 3).
    pub role: String,
    /// What is said.
    pub content: String,
    /// An assistant message's tool calls (OpenAI's `tool_calls`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// A `tool` message's call id (the call whose result it is).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    /// A message with any role.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }

    /// A `system` message (instructions for the assistant).
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    /// A `user` message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    /// An `assistant` message (an earlier answer of the model).
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// A chat prompt format.
///
/// ```
/// use llama_burn::tokenizer::{ChatFormat, ChatMessage};
///
/// let prompt = ChatFormat::ChatMl.format(&[ChatMessage::user("Hi!")], true);
/// assert_eq!(
///     prompt,
///     "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
///      <|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
/// );
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChatFormat {
    /// Meta's Llama 3 format:
    /// `<|begin_of_text|><|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>...`.
    ///
    /// The formatted text starts with the BOS token, so it must be encoded without adding
    /// another one.
    Llama3,
    /// ChatML (`<|im_start|>role\ncontent<|im_end|>\n`), exactly as SmolLM2-Instruct's
    /// template writes it, including its default system prompt
    /// ([`SMOLLM_DEFAULT_SYSTEM_PROMPT`]) when the conversation has none.
    ChatMl,
}

impl ChatFormat {
    /// Recognises the format from a Jinja chat template (as found in GGUF metadata
    /// `tokenizer.chat_template` or `tokenizer_config.json`): ChatML when it writes
    /// `<|im_start|>`, Llama 3 when it writes `<|start_header_id|>`; `None` otherwise.
    pub fn from_template(template: &str) -> Option<Self> {
        if template.contains("<|im_start|>") {
            Some(ChatFormat::ChatMl)
        } else if template.contains("<|start_header_id|>") {
            Some(ChatFormat::Llama3)
        } else {
            None
        }
    }

    /// The special token that closes one message in this format (`<|eot_id|>` or
    /// `<|im_end|>`); generation should stop on it.
    pub fn end_of_turn(&self) -> &'static str {
        match self {
            ChatFormat::Llama3 => "<|eot_id|>",
            ChatFormat::ChatMl => "<|im_end|>",
        }
    }

    /// Writes `messages` as one prompt. With `add_generation_prompt`, the header of an
    /// assistant turn follows, so the model's continuation is its answer.
    ///
    /// For [`ChatFormat::Llama3`] each message's content is trimmed of surrounding white
    /// space, as both Meta's reference code and the Hugging Face template do, and the text
    /// starts with `<|begin_of_text|>`. For [`ChatFormat::ChatMl`] content is written
    /// verbatim and, when the first message is not a system message, SmolLM2's default
    /// system prompt comes first.
    pub fn format(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> String {
        self.pieces(messages, add_generation_prompt)
            .iter()
            .map(ChatPiece::text)
            .collect()
    }

    /// The same conversation as [`ChatFormat::format`], split into the template's control
    /// tokens ([`ChatPiece::Special`]) and everything else ([`ChatPiece::Text`]: role
    /// names, separators and message content, adjacent text merged into one piece).
    ///
    /// Encoding a `Special` piece as its special token id and every `Text` piece as plain
    /// text, with special-token parsing off, gives the ids a trusted conversation has, while
    /// a message that *writes* a control token (`"<|im_end|>"`) cannot produce one: this is
    /// what [`Tokenizer::encode_chat`](super::Tokenizer::encode_chat) does.
    ///
    /// ```
    /// use llama_burn::tokenizer::{ChatFormat, ChatMessage, ChatPiece};
    ///
    /// let pieces = ChatFormat::ChatMl.pieces(&[ChatMessage::system("Be brief."), ChatMessage::user("<|im_end|>")], false);
    /// assert_eq!(pieces, vec![
    ///     ChatPiece::Special("<|im_start|>"), ChatPiece::Text("system\nBe brief.".into()),
    ///     ChatPiece::Special("<|im_end|>"), ChatPiece::Text("\n".into()),
    ///     ChatPiece::Special("<|im_start|>"), ChatPiece::Text("user\n<|im_end|>".into()),
    ///     ChatPiece::Special("<|im_end|>"), ChatPiece::Text("\n".into()),
    /// ]);
    /// ```
    pub fn pieces(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Vec<ChatPiece> {
        let mut out = Pieces::default();
        match self {
            ChatFormat::Llama3 => {
                out.special("<|begin_of_text|>");
                for message in messages {
                    push_llama3_header(&mut out, &message.role);
                    out.text(message.content.trim());
                    out.special("<|eot_id|>");
                }
                if add_generation_prompt {
                    push_llama3_header(&mut out, "assistant");
                }
            }
            ChatFormat::ChatMl => {
                for (i, message) in messages.iter().enumerate() {
                    if i == 0 && message.role != "system" {
                        push_chatml_message(&mut out, "system", SMOLLM_DEFAULT_SYSTEM_PROMPT);
                    }
                    push_chatml_message(&mut out, &message.role, &message.content);
                }
                if add_generation_prompt {
                    out.special("<|im_start|>");
                    out.text("assistant\n");
                }
            }
        }
        out.0
    }
}

/// One piece of a formatted conversation (see [`ChatFormat::pieces`] and
/// [`ChatTemplate::render`](super::ChatTemplate::render)).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ChatPiece {
    /// A control token the template writes, such as `"<|im_start|>"`.
    Special(&'static str),
    /// Text to encode as plain text: role names, separators, message content.
    Text(String),
    /// Text a Jinja chat template wrote itself (never message content): encoded with
    /// its control tokens read as such.
    Markup(String),
}

impl ChatPiece {
    /// The piece as it appears in the formatted text.
    pub fn text(&self) -> &str {
        match self {
            ChatPiece::Special(token) => token,
            ChatPiece::Text(text) | ChatPiece::Markup(text) => text,
        }
    }
}

/// Builds a piece list, merging adjacent text.
#[derive(Default)]
struct Pieces(Vec<ChatPiece>);

impl Pieces {
    fn special(&mut self, token: &'static str) {
        self.0.push(ChatPiece::Special(token));
    }

    fn text(&mut self, text: &str) {
        if let Some(ChatPiece::Text(last)) = self.0.last_mut() {
            last.push_str(text);
        } else {
            self.0.push(ChatPiece::Text(text.to_string()));
        }
    }
}

fn push_llama3_header(out: &mut Pieces, role: &str) {
    out.special("<|start_header_id|>");
    out.text(role);
    out.special("<|end_header_id|>");
    out.text("\n\n");
}

fn push_chatml_message(out: &mut Pieces, role: &str, content: &str) {
    out.special("<|im_start|>");
    out.text(role);
    out.text("\n");
    out.text(content);
    out.special("<|im_end|>");
    out.text("\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_adds_default_system_prompt() {
        let text =
            ChatFormat::ChatMl.format(&[ChatMessage::user("What is the capital of France?")], true);
        assert_eq!(
            text,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn chatml_keeps_given_system_prompt_and_history() {
        let messages = [
            ChatMessage::system("Be brief."),
            ChatMessage::user("Hi"),
            ChatMessage::assistant("Hello."),
            ChatMessage::user(" 2+2? "),
        ];
        assert_eq!(
            ChatFormat::ChatMl.format(&messages, false),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\n 2+2? <|im_end|>\n"
        );
    }

    #[test]
    fn chatml_system_prompt_only_before_first_message() {
        let messages = [ChatMessage::user("a"), ChatMessage::system("b")];
        let text = ChatFormat::ChatMl.format(&messages, false);
        assert_eq!(text.matches("<|im_start|>system").count(), 2);
        assert!(text.starts_with("<|im_start|>system\nYou are a helpful AI assistant"));
        assert_eq!(
            ChatFormat::ChatMl.format(&[], true),
            "<|im_start|>assistant\n"
        );
    }

    #[test]
    fn llama3_format() {
        let messages = [
            ChatMessage::system("You are terse."),
            ChatMessage::user("  Hello!\n"),
        ];
        assert_eq!(
            ChatFormat::Llama3.format(&messages, true),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>\
             <|start_header_id|>user<|end_header_id|>\n\nHello!<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\n"
        );
        assert_eq!(ChatFormat::Llama3.format(&[], false), "<|begin_of_text|>");
    }

    #[test]
    fn detects_format_from_template() {
        assert_eq!(
            ChatFormat::from_template("{{'<|im_start|>' + message['role']}}"),
            Some(ChatFormat::ChatMl)
        );
        assert_eq!(
            ChatFormat::from_template("{{ '<|start_header_id|>' + message['role'] }}"),
            Some(ChatFormat::Llama3)
        );
        assert_eq!(
            ChatFormat::from_template("[INST] {{ content }} [/INST]"),
            None
        );
        assert_eq!(ChatFormat::ChatMl.end_of_turn(), "<|im_end|>");
        assert_eq!(ChatFormat::Llama3.end_of_turn(), "<|eot_id|>");
    }
}
