//! Tool calling: functions a chat model may call, how they enter its prompt, the
//! constraint that makes a forced call valid, and reading calls back out of its output.
//!
//! - [`prompt`]: the system prompt that describes the tools to a model whose chat
//!   template has none (the demo's ChatML), and the history (earlier calls, tool
//!   results) written as such a model reads it;
//! - [`grammar`]: the [`Constraint`](crate::constraints::Constraint) of a forced call
//!   (`tool_choice` `required` or a named function): the call envelope of the model's
//!   [`ToolFormat`] around each function's parameter schema, so the arguments always
//!   validate;
//! - [`parse`]: a streaming reader of the model's output that turns tool calls into
//!   [`ToolCallEvent`](parse::ToolCallEvent)s (name first, then argument fragments), as
//!   OpenAI streams them.
//!
//! Templates that know tools (Hermes, Qwen, Llama 3.1+) get them as the `tools` variable
//! and render them themselves ([`ChatTemplate`](crate::tokenizer::ChatTemplate)).

pub mod grammar;
pub mod parse;
pub mod prompt;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// A function the model may call.
///
/// ```
/// use llama_burn::tools::Tool;
///
/// let tool = Tool::new("get_weather", serde_json::json!({
///     "type": "object",
///     "properties": {"city": {"type": "string"}},
///     "required": ["city"]
/// })).with_description("The weather in a city");
/// assert_eq!(tool.openai_json()["function"]["name"], "get_weather");
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    /// Its name (`[A-Za-z0-9_-]`, 1 to 64 characters, as OpenAI requires).
    pub name: String,
    /// What it does, for the model.
    pub description: Option<String>,
    /// The JSON Schema of its arguments (an object schema).
    pub parameters: Value,
    /// OpenAI's `strict`: the arguments must validate against `parameters`. Calls are
    /// constrained whenever a call is forced, and in `auto` mode when a tool is strict
    /// (see [`grammar::tool_constraint`]).
    pub strict: bool,
}

impl Tool {
    /// A tool without description, not strict.
    pub fn new(name: impl Into<String>, parameters: Value) -> Self {
        Self {
            name: name.into(),
            description: None,
            parameters,
            strict: false,
        }
    }

    /// With a description.
    pub fn with_description(mut self, description: impl Into<String>) -> Self {
        self.description = Some(description.into());
        self
    }

    /// The tool as OpenAI's `tools` entries (and chat templates) write it:
    /// `{"type": "function", "function": {"name", "description", "parameters"}}`.
    pub fn openai_json(&self) -> Value {
        let mut function = json!({"name": self.name});
        if let Some(description) = &self.description {
            function["description"] = description.clone().into();
        }
        function["parameters"] = self.parameters.clone();
        json!({"type": "function", "function": function})
    }
}

/// Whether and which tool the model must call (OpenAI's `tool_choice`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ToolChoice {
    /// No call: the tools are not shown to the model.
    None,
    /// The model decides: text or calls (its output is read for calls; constrained to
    /// text or valid calls when a tool is `strict`).
    #[default]
    Auto,
    /// At least one call, of any tool (constrained).
    Required,
    /// One call of this function (constrained).
    Function(String),
}

impl ToolChoice {
    /// Whether decoding is constrained to calls.
    pub fn is_forced(&self) -> bool {
        matches!(self, ToolChoice::Required | ToolChoice::Function(_))
    }
}

/// A call the model made (or made earlier, in a conversation's history).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ToolCall {
    /// Its id (`call_...`), which the tool's result names.
    pub id: String,
    /// The function called.
    pub name: String,
    /// The arguments, as JSON text.
    pub arguments: String,
}

impl ToolCall {
    /// The arguments as a JSON value (their text as a string when it is not JSON).
    pub fn arguments_json(&self) -> Value {
        serde_json::from_str(&self.arguments).unwrap_or_else(|_| self.arguments.clone().into())
    }
}

/// How a model writes its calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ToolFormat {
    /// `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per
    /// call (Hermes, Qwen, SmolLM templates; and the system prompt of [`prompt`] for
    /// templates without tools).
    Hermes,
    /// Llama 3.1+: the whole answer is one JSON object
    /// `{"name": ..., "parameters": {...}}`.
    Llama3Json,
}

impl ToolFormat {
    /// The key of the arguments in a call object.
    pub fn arguments_key(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "arguments",
            ToolFormat::Llama3Json => "parameters",
        }
    }

    /// The format a chat template's model uses: Llama 3's JSON calls when the template
    /// writes Llama 3 headers and takes `tools` without `<tool_call>` blocks, Hermes
    /// otherwise.
    pub fn for_template(template: Option<&str>) -> Self {
        match template {
            Some(t)
                if t.contains("<|start_header_id|>")
                    && t.contains("tools")
                    && !t.contains("<tool_call>") =>
            {
                ToolFormat::Llama3Json
            }
            _ => ToolFormat::Hermes,
        }
    }
}

/// A fresh call id, `call_` and 24 random letters and digits (as OpenAI's look).
pub fn new_call_id() -> String {
    use rand::Rng;
    const CHARS: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    let tail: String = (0..24)
        .map(|_| CHARS[rng.random_range(0..CHARS.len())] as char)
        .collect();
    format!("call_{tail}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_from_templates() {
        assert_eq!(ToolFormat::for_template(None), ToolFormat::Hermes);
        assert_eq!(
            ToolFormat::for_template(Some("<|start_header_id|>{{ tools }}")),
            ToolFormat::Llama3Json
        );
        assert_eq!(
            ToolFormat::for_template(Some("<|im_start|>{{ tools }}<tool_call>")),
            ToolFormat::Hermes
        );
        let id = new_call_id();
        assert_eq!(id.len(), 29);
        assert!(id.starts_with("call_"));
    }
}
