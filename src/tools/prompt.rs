//! Tools for a model whose chat template has none (the demo's SmolLM2 ChatML, and the
//! built-in [`ChatFormat`](crate::tokenizer::ChatFormat)s): a system prompt that
//! describes them and asks for Hermes-style calls, and the history rewritten so such a
//! template renders it.
//!
//! The system prompt ([`tools_system_prompt`]) is, for tools `T1..Tn`:
//!
//! ```text
//! # Tools
//!
//! You can call the functions below. Their signatures are JSON objects, one a line,
//! inside <tools></tools>:
//! <tools>
//! {"type": "function", "function": {"name": ..., "description": ..., "parameters": ...}}
//! ...
//! </tools>
//!
//! To call a function, answer with one <tool_call></tool_call> block per call, holding a
//! JSON object with the function's name and its arguments:
//! <tool_call>
//! {"name": "<function name>", "arguments": {<arguments as JSON>}}
//! </tool_call>
//! ```
//!
//! It follows the conversation's own system message (after a blank line), or is the
//! system message when there is none. In the history, an assistant message's calls are
//! written as such blocks after its text, and a `tool` message becomes a `user` message
//! `<tool_response>\n{content}\n</tool_response>`. All of it is message content: it is
//! encoded as plain text, never as control tokens.

use super::Tool;
use crate::tokenizer::chat::ChatMessage;

/// The system prompt describing `tools` (see the [module](self) documentation).
pub fn tools_system_prompt(tools: &[Tool]) -> String {
    let mut out = String::from(
        "# Tools\n\nYou can call the functions below. Their signatures are JSON objects, one \
         a line, inside <tools></tools>:\n<tools>\n",
    );
    for tool in tools {
        out.push_str(&tool.openai_json().to_string());
        out.push('\n');
    }
    out.push_str(
        "</tools>\n\nTo call a function, answer with one <tool_call></tool_call> block per \
         call, holding a JSON object with the function's name and its arguments:\n\
         <tool_call>\n{\"name\": \"<function name>\", \"arguments\": {<arguments as JSON>}}\n\
         </tool_call>",
    );
    out
}

/// One call as a Hermes block, laid out as constrained calls are:
/// `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`.
pub fn hermes_block(name: &str, arguments: &serde_json::Value) -> String {
    let name = serde_json::Value::from(name);
    format!("<tool_call>\n{{\"name\": {name}, \"arguments\": {arguments}}}\n</tool_call>")
}

/// `messages` with `tools` described in the system prompt (when there are tools) and the
/// tool history written as plain messages (see the [module](self) documentation).
pub fn with_tools_prompt(messages: &[ChatMessage], tools: &[Tool]) -> Vec<ChatMessage> {
    let mut out = Vec::with_capacity(messages.len() + 1);
    let mut rest = messages;
    if !tools.is_empty() {
        let prompt = tools_system_prompt(tools);
        match messages.first() {
            Some(first) if first.role == "system" => {
                out.push(ChatMessage::system(format!(
                    "{}\n\n{prompt}",
                    first.content
                )));
                rest = &messages[1..];
            }
            _ => out.push(ChatMessage::system(prompt)),
        }
    }
    for message in rest {
        out.push(plain_message(message));
    }
    out
}

/// A message with its calls or tool result written as text.
fn plain_message(message: &ChatMessage) -> ChatMessage {
    if message.role == "tool" {
        return ChatMessage::user(format!(
            "<tool_response>\n{}\n</tool_response>",
            message.content
        ));
    }
    if message.tool_calls.is_empty() {
        return ChatMessage::new(message.role.clone(), message.content.clone());
    }
    let mut parts: Vec<String> = Vec::with_capacity(message.tool_calls.len() + 1);
    if !message.content.is_empty() {
        parts.push(message.content.clone());
    }
    for call in &message.tool_calls {
        parts.push(hermes_block(&call.name, &call.arguments_json()));
    }
    ChatMessage::new(message.role.clone(), parts.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::ToolCall;

    #[test]
    fn history_and_system_prompt() {
        let tools = [Tool::new("f", serde_json::json!({"type": "object"}))];
        let mut call = ChatMessage::assistant("");
        call.tool_calls = vec![ToolCall {
            id: "call_1".into(),
            name: "f".into(),
            arguments: "{\"a\": 1}".into(),
        }];
        let mut result = ChatMessage::new("tool", "42");
        result.tool_call_id = Some("call_1".into());
        let messages = [ChatMessage::system("Be brief."), call, result];
        let out = with_tools_prompt(&messages, &tools);
        assert_eq!(out.len(), 3);
        assert!(out[0].content.starts_with("Be brief.\n\n# Tools\n"));
        assert!(out[0].content.contains(
            r#"{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}"#
        ));
        assert_eq!(
            out[1].content,
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\":1}}\n</tool_call>"
        );
        assert_eq!(out[2].role, "user");
        assert_eq!(out[2].content, "<tool_response>\n42\n</tool_response>");
        assert_eq!(
            with_tools_prompt(&messages[..1], &[]),
            messages[..1].to_vec()
        );
    }
}
