//! `/v1/responses`: OpenAI's Responses API on the chat machinery.
//!
//! A request is rewritten as a chat completions body (its `instructions` as the system
//! message, the stored conversation of `previous_response_id`, its input items as
//! messages, function tools in chat's shape, `text.format` as `response_format`,
//! `max_output_tokens` as `max_tokens`) and read by the chat endpoint's own reader, so
//! every limit, constraint and tool check applies unchanged; the answer is generated
//! like a chat answer and sent as a response object whose output items are the
//! assistant's message or its function calls. With `store` (the default) the response
//! and its conversation are kept for `GET /v1/responses/{id}` and
//! `previous_response_id`, per tenant ([`super::response_store`]).
//!
//! Built-in tools and non-text input items are refused by name.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Extension, Path, State};
use std::collections::VecDeque;
use std::convert::Infallible;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Json, Response};
use futures_util::stream::{self, Stream};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use utoipa::ToSchema;

use super::error::ApiError;
use super::generation::Update;
use super::openai::{CachedTokens, Endpoint, PromptInput};
use super::response_store::Stored;
use super::routes::{
    ClientRequestId, Envelope, Tenant, TenantOf, read_body, read_chat, start, with_tools,
};
use super::{ServerConfig, Shared};
use crate::tokenizer::ChatMessage;
use crate::tools::parse::{ToolCallEvent, ToolCallParser};

/// The body of `POST /v1/responses`.
#[derive(Debug, Deserialize, ToSchema)]
pub struct ResponseRequest {
    /// A string (one user message) or a list of input items.
    pub input: ResponseInput,
    /// The system message (not carried over to a later `previous_response_id`).
    #[serde(default)]
    pub instructions: Option<String>,
    /// The served model's id or an adapter's.
    #[serde(default)]
    pub model: Option<String>,
    /// Most tokens to generate.
    #[serde(default)]
    pub max_output_tokens: Option<u64>,
    /// Sampling temperature, `[0, 2]`.
    #[serde(default)]
    pub temperature: Option<f64>,
    /// Nucleus sampling, `(0, 1]`.
    #[serde(default)]
    pub top_p: Option<f64>,
    /// Function tools (`{type: "function", name, description, parameters, strict}`).
    #[serde(default)]
    pub tools: Option<Vec<ResponseTool>>,
    /// `none`, `auto`, `required` or `{type: "function", name}`.
    #[serde(default)]
    pub tool_choice: Option<ResponseToolChoice>,
    /// Whether the model may call several tools at once.
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    /// `{format: {type: "text" | "json_object" | "json_schema", ...}}`.
    #[serde(default)]
    pub text: Option<TextOptions>,
    /// Keep the response for `GET` and `previous_response_id` (default true).
    #[serde(default)]
    pub store: Option<bool>,
    /// Continue the conversation of this stored response.
    #[serde(default)]
    pub previous_response_id: Option<String>,
    /// Stream typed events.
    #[serde(default)]
    pub stream: Option<bool>,
    /// An end-user id (the tenant without API keys).
    #[serde(default)]
    pub user: Option<String>,
    /// The sampling seed (this server's extension, as on chat completions).
    #[serde(default)]
    pub seed: Option<i64>,
}

/// `input`: a string or items.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum ResponseInput {
    /// One user message.
    Text(String),
    /// Messages, function calls and their outputs.
    Items(Vec<InputItem>),
}

/// One input item: a message (`type` `message`, or absent), a `function_call` or a
/// `function_call_output`.
#[derive(Debug, Deserialize, ToSchema)]
pub struct InputItem {
    /// The item's type.
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
    /// A message's role.
    #[serde(default)]
    pub role: Option<String>,
    /// A message's content.
    #[serde(default)]
    pub content: Option<ItemContent>,
    /// A call's id (`function_call`, `function_call_output`).
    #[serde(default)]
    pub call_id: Option<String>,
    /// A call's function.
    #[serde(default)]
    pub name: Option<String>,
    /// A call's arguments (JSON text).
    #[serde(default)]
    pub arguments: Option<String>,
    /// A call's result.
    #[serde(default)]
    pub output: Option<String>,
}

/// A message's content: text or parts.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum ItemContent {
    /// Text.
    Text(String),
    /// Parts (`input_text`, `output_text`).
    Parts(Vec<ItemPart>),
}

/// One content part.
#[derive(Debug, Deserialize, ToSchema)]
pub struct ItemPart {
    /// `input_text` or `output_text` (others are refused).
    #[serde(rename = "type")]
    pub kind: String,
    /// The text.
    #[serde(default)]
    pub text: Option<String>,
}

/// A tool: only `function` is served.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ResponseTool {
    /// `function`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The function's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// What it does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Its parameters' JSON Schema.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub parameters: Option<Box<RawValue>>,
    /// Whether calls must match the schema exactly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// `tool_choice`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum ResponseToolChoice {
    /// `none`, `auto` or `required`.
    Mode(String),
    /// One function.
    Function {
        /// `function`.
        #[serde(rename = "type")]
        kind: String,
        /// Its name.
        name: String,
    },
}

/// `text`.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct TextOptions {
    /// The output's format.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<TextFormat>,
}

/// `text.format`.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct TextFormat {
    /// `text`, `json_object` or `json_schema`.
    #[serde(rename = "type")]
    pub kind: String,
    /// A schema's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The JSON Schema.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub schema: Option<Box<RawValue>>,
    /// Whether the output must match the schema exactly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
    /// What the format is for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
}

/// A chat message as the chat endpoint reads it.
#[derive(Serialize)]
struct ChatBodyMessage<'a> {
    role: &'a str,
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tool_calls: Vec<ChatBodyCall<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_call_id: Option<&'a str>,
}

#[derive(Serialize)]
struct ChatBodyCall<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    function: ChatBodyFunction<'a>,
}

#[derive(Serialize)]
struct ChatBodyFunction<'a> {
    name: &'a str,
    arguments: &'a str,
}

/// A chat tool: the function under `function`.
#[derive(Serialize)]
struct ChatBodyTool<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    function: &'a ResponseTool,
}

/// The chat body a response request is read as.
#[derive(Serialize)]
struct ChatBody<'a> {
    messages: Vec<ChatBodyMessage<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    model: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_p: Option<f64>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tools: Vec<ChatBodyTool<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_choice: Option<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    parallel_tool_calls: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    response_format: Option<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    user: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    seed: Option<i64>,
}

/// The conversation a request adds to its previous one: its input items as chat
/// messages (consecutive function calls are one assistant message).
fn input_messages(input: &ResponseInput) -> Result<Vec<ChatMessage>, ApiError> {
    let items = match input {
        ResponseInput::Text(text) => return Ok(vec![ChatMessage::new("user", text.clone())]),
        ResponseInput::Items(items) => items,
    };
    let mut messages: Vec<ChatMessage> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let param = |field: &str| format!("input[{i}]{field}");
        let missing = |field: &str| {
            ApiError::invalid(
                format!("`input[{i}].{field}` is required for this item"),
                Some(&param(&format!(".{field}"))),
            )
        };
        match item.kind.as_deref().unwrap_or("message") {
            "message" => {
                let role = item.role.as_deref().ok_or_else(|| missing("role"))?;
                let text = match &item.content {
                    None => return Err(missing("content")),
                    Some(ItemContent::Text(text)) => text.clone(),
                    Some(ItemContent::Parts(parts)) => {
                        let mut text = String::new();
                        for (j, part) in parts.iter().enumerate() {
                            match (part.kind.as_str(), &part.text) {
                                ("input_text" | "output_text" | "text", Some(t)) => {
                                    text.push_str(t)
                                }
                                (kind, _) => {
                                    return Err(ApiError::invalid(
                                        format!(
                                            "content parts of type `{kind}` are not supported \
                                             (text only)"
                                        ),
                                        Some(&param(&format!(".content[{j}].type"))),
                                    ));
                                }
                            }
                        }
                        text
                    }
                };
                messages.push(ChatMessage::new(role, text));
            }
            "function_call" => {
                let call = crate::tools::ToolCall {
                    id: item.call_id.clone().ok_or_else(|| missing("call_id"))?,
                    name: item.name.clone().ok_or_else(|| missing("name"))?,
                    arguments: item.arguments.clone().ok_or_else(|| missing("arguments"))?,
                };
                match messages.last_mut() {
                    Some(last) if last.role == "assistant" && !last.tool_calls.is_empty() => {
                        last.tool_calls.push(call)
                    }
                    _ => {
                        let mut message = ChatMessage::new("assistant", "");
                        message.tool_calls.push(call);
                        messages.push(message);
                    }
                }
            }
            "function_call_output" => {
                let mut message = ChatMessage::new(
                    "tool",
                    item.output.clone().ok_or_else(|| missing("output"))?,
                );
                message.tool_call_id =
                    Some(item.call_id.clone().ok_or_else(|| missing("call_id"))?);
                messages.push(message);
            }
            other => {
                return Err(ApiError::invalid(
                    format!(
                        "input items of type `{other}` are not supported (message, \
                         function_call, function_call_output)"
                    ),
                    Some(&param(".type")),
                ));
            }
        }
    }
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "`input` must hold at least one item",
            Some("input"),
        ));
    }
    Ok(messages)
}

/// The chat body for `request` after `previous` (a stored conversation), and the
/// conversation this request stores (without the instructions).
fn chat_body(
    request: &ResponseRequest,
    previous: Vec<ChatMessage>,
) -> Result<(Vec<u8>, Vec<ChatMessage>), ApiError> {
    let mut conversation = previous;
    conversation.extend(input_messages(&request.input)?);
    let mut messages = Vec::with_capacity(conversation.len() + 1);
    if let Some(instructions) = &request.instructions {
        messages.push(ChatBodyMessage {
            role: "system",
            content: Some(instructions),
            tool_calls: Vec::new(),
            tool_call_id: None,
        });
    }
    for m in &conversation {
        messages.push(ChatBodyMessage {
            role: &m.role,
            content: (!m.content.is_empty() || m.tool_calls.is_empty())
                .then_some(m.content.as_str()),
            tool_calls: m
                .tool_calls
                .iter()
                .map(|c| ChatBodyCall {
                    id: &c.id,
                    kind: "function",
                    function: ChatBodyFunction {
                        name: &c.name,
                        arguments: &c.arguments,
                    },
                })
                .collect(),
            tool_call_id: m.tool_call_id.as_deref(),
        });
    }
    let mut tools = Vec::new();
    for (i, tool) in request.tools.iter().flatten().enumerate() {
        if tool.kind != "function" {
            return Err(ApiError::invalid(
                format!(
                    "tools of type `{}` are not supported (function tools only)",
                    tool.kind
                ),
                Some(&format!("tools[{i}].type")),
            ));
        }
        tools.push(ChatBodyTool {
            kind: "function",
            function: tool,
        });
    }
    let tool_choice = match &request.tool_choice {
        None => None,
        Some(ResponseToolChoice::Mode(mode)) => Some(serde_json::Value::from(mode.as_str())),
        Some(ResponseToolChoice::Function { name, .. }) => Some(serde_json::json!({
            "type": "function", "function": {"name": name}
        })),
    };
    let response_format = match request.text.as_ref().and_then(|t| t.format.as_ref()) {
        None => None,
        Some(format) => match format.kind.as_str() {
            "text" => None,
            "json_object" => Some(serde_json::json!({"type": "json_object"})),
            "json_schema" => Some(serde_json::json!({
                "type": "json_schema",
                "json_schema": {
                    "name": format.name.as_deref().unwrap_or("response"),
                    "schema": format.schema,
                    "strict": format.strict.unwrap_or(false),
                }
            })),
            other => {
                return Err(ApiError::invalid(
                    format!("`text.format.type` = `{other}` is not supported"),
                    Some("text.format.type"),
                ));
            }
        },
    };
    let body = ChatBody {
        messages,
        model: request.model.as_deref(),
        max_tokens: request.max_output_tokens,
        temperature: request.temperature,
        top_p: request.top_p,
        tools,
        tool_choice,
        parallel_tool_calls: request.parallel_tool_calls,
        response_format,
        user: request.user.as_deref(),
        seed: request.seed,
    };
    let bytes = serde_json::to_vec(&body)
        .map_err(|e| ApiError::internal(format!("rewriting the request: {e}")))?;
    Ok((bytes, conversation))
}

/// A response object.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ResponseObject {
    /// `resp_...`.
    pub id: String,
    /// `response`.
    pub object: &'static str,
    /// Unix time of the request, in seconds.
    pub created_at: u64,
    /// `completed` or `incomplete` (`max_output_tokens` reached).
    pub status: &'static str,
    /// Why it is incomplete.
    pub incomplete_details: Option<IncompleteDetails>,
    /// Always null: a failure is an error status.
    #[schema(value_type = Option<Object>)]
    pub error: Option<()>,
    /// The model (or adapter) that answered.
    pub model: String,
    /// The assistant's message, or its function calls.
    pub output: Vec<OutputItem>,
    /// Token counts (null while in progress).
    pub usage: Option<ResponseUsage>,
    /// As sent.
    pub instructions: Option<String>,
    /// As sent.
    pub max_output_tokens: Option<u64>,
    /// As sent (default 1).
    pub temperature: f64,
    /// As sent (default 1).
    pub top_p: f64,
    /// As sent (default true).
    pub parallel_tool_calls: bool,
    /// As sent.
    pub previous_response_id: Option<String>,
    /// Whether it was stored.
    pub store: bool,
    /// As sent (default `auto`).
    pub tool_choice: ResponseToolChoice,
    /// As sent.
    #[schema(value_type = Vec<Object>)]
    pub tools: Vec<serde_json::Value>,
    /// As sent (default `{format: {type: text}}`).
    #[schema(value_type = Object)]
    pub text: serde_json::Value,
    /// Always empty.
    #[schema(value_type = Object)]
    pub metadata: serde_json::Map<String, serde_json::Value>,
}

/// Why a response is incomplete.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct IncompleteDetails {
    /// `max_output_tokens`.
    pub reason: &'static str,
}

/// One output item.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputItem {
    /// The assistant's text.
    Message {
        /// `msg_...`.
        id: String,
        /// `completed`.
        status: &'static str,
        /// `assistant`.
        role: &'static str,
        /// One `output_text` part.
        content: Vec<OutputText>,
    },
    /// A call of one of the request's tools.
    FunctionCall {
        /// `fc_...`.
        id: String,
        /// The id a `function_call_output` names.
        call_id: String,
        /// The function.
        name: String,
        /// Its arguments (JSON text).
        arguments: String,
        /// `completed`.
        status: &'static str,
    },
}

/// An `output_text` part.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct OutputText {
    /// `output_text`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The text.
    pub text: String,
    /// Always empty.
    #[schema(value_type = Vec<Object>)]
    pub annotations: Vec<serde_json::Value>,
}

/// A response's token counts.
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
pub struct ResponseUsage {
    /// Prompt tokens.
    pub input_tokens: usize,
    /// Of which cached.
    pub input_tokens_details: CachedTokens,
    /// Generated tokens.
    pub output_tokens: usize,
    /// Of which reasoning.
    pub output_tokens_details: ReasoningTokens,
    /// Both.
    pub total_tokens: usize,
}

/// `output_tokens_details`.
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
pub struct ReasoningTokens {
    /// Always 0.
    pub reasoning_tokens: usize,
}

/// A 24-hex-digit random id with `prefix`.
fn new_id(prefix: &str) -> String {
    format!("{prefix}{:024x}", rand::random::<u128>() >> 32)
}

/// The tenant name that scopes the store: the API key's tenant, else the peer's.
fn store_tenant(tenant: &Tenant) -> String {
    match tenant {
        Tenant::Key(name) => format!("key {name}"),
        Tenant::Peer(ip) => format!("peer {ip}"),
        Tenant::Anonymous => "anonymous".into(),
    }
}

/// The fields a response object echoes from its request, kept once the request is
/// dropped.
struct Echo {
    instructions: Option<String>,
    max_output_tokens: Option<u64>,
    temperature: f64,
    top_p: f64,
    parallel_tool_calls: bool,
    previous_response_id: Option<String>,
    store: bool,
    tool_choice: ResponseToolChoice,
    tools: Vec<serde_json::Value>,
    text: serde_json::Value,
}

impl Echo {
    fn of(request: &ResponseRequest) -> Self {
        Self {
            instructions: request.instructions.clone(),
            max_output_tokens: request.max_output_tokens,
            temperature: request.temperature.unwrap_or(1.0),
            top_p: request.top_p.unwrap_or(1.0),
            parallel_tool_calls: request.parallel_tool_calls.unwrap_or(true),
            previous_response_id: request.previous_response_id.clone(),
            store: request.store.unwrap_or(true),
            tool_choice: request
                .tool_choice
                .clone()
                .unwrap_or_else(|| ResponseToolChoice::Mode("auto".into())),
            tools: request
                .tools
                .iter()
                .flatten()
                .filter_map(|t| serde_json::to_value(t).ok())
                .collect(),
            text: request
                .text
                .as_ref()
                .and_then(|t| serde_json::to_value(t).ok())
                .unwrap_or_else(|| serde_json::json!({"format": {"type": "text"}})),
        }
    }

    /// The response object with this status, output and usage.
    fn response(
        &self,
        id: &str,
        envelope: &Envelope,
        status: &'static str,
        output: Vec<OutputItem>,
        usage: Option<ResponseUsage>,
    ) -> ResponseObject {
        ResponseObject {
            id: id.to_string(),
            object: "response",
            created_at: envelope.created,
            status,
            incomplete_details: (status == "incomplete").then_some(IncompleteDetails {
                reason: "max_output_tokens",
            }),
            error: None,
            model: envelope.model.clone(),
            output,
            usage,
            instructions: self.instructions.clone(),
            max_output_tokens: self.max_output_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            parallel_tool_calls: self.parallel_tool_calls,
            previous_response_id: self.previous_response_id.clone(),
            store: self.store,
            tool_choice: self.tool_choice.clone(),
            tools: self.tools.clone(),
            text: self.text.clone(),
            metadata: serde_json::Map::new(),
        }
    }
}

/// A response's token counts from the generation's.
fn response_usage(usage: super::openai::Usage) -> ResponseUsage {
    ResponseUsage {
        input_tokens: usage.prompt_tokens,
        input_tokens_details: usage.prompt_tokens_details,
        output_tokens: usage.completion_tokens,
        output_tokens_details: ReasoningTokens {
            reasoning_tokens: 0,
        },
        total_tokens: usage.total_tokens,
    }
}

/// Builds a response's output items from the answer's text as it arrives (read for
/// function calls when the request has tools), and the stream events that describe
/// each step: the same items whether the answer is streamed or not.
struct OutputBuilder {
    parser: Option<ToolCallParser>,
    items: Vec<OutputItem>,
    /// The open message's place in `items`.
    message: Option<usize>,
    /// Each call's place in `items`, by the parser's call index.
    calls: Vec<usize>,
    /// Whitespace held back until text follows (so that the whitespace around calls
    /// makes no message).
    held: String,
    /// Events not yet sent, each `(type, fields)`.
    events: Vec<(&'static str, serde_json::Value)>,
}

impl OutputBuilder {
    fn new(format: Option<crate::tools::ToolFormat>) -> Self {
        Self {
            parser: format.map(ToolCallParser::new),
            items: Vec::new(),
            message: None,
            calls: Vec::new(),
            held: String::new(),
            events: Vec::new(),
        }
    }

    /// Reads more of the answer.
    fn push(&mut self, text: &str) {
        let events = match &mut self.parser {
            Some(parser) => parser.push(text),
            None => vec![ToolCallEvent::Content(text.to_string())],
        };
        events.into_iter().for_each(|e| self.apply(e));
    }

    /// The answer has ended: the parser's last events, and every item completed.
    fn finish(&mut self) -> Vec<OutputItem> {
        if let Some(parser) = &mut self.parser {
            let events = parser.finish();
            events.into_iter().for_each(|e| self.apply(e));
        }
        self.close_message();
        for at in std::mem::take(&mut self.calls) {
            if let Some(OutputItem::FunctionCall {
                id,
                name,
                arguments,
                status,
                ..
            }) = self.items.get_mut(at)
            {
                *status = "completed";
                let done = serde_json::json!({
                    "item_id": id, "output_index": at, "name": name, "arguments": arguments,
                });
                self.events
                    .push(("response.function_call_arguments.done", done));
                let item = serde_json::to_value(&self.items[at]).unwrap_or_default();
                self.events.push((
                    "response.output_item.done",
                    serde_json::json!({"output_index": at, "item": item}),
                ));
            }
        }
        std::mem::take(&mut self.items)
    }

    fn apply(&mut self, event: ToolCallEvent) {
        match event {
            ToolCallEvent::Content(text) => {
                if self.message.is_none() && text.trim().is_empty() {
                    self.held.push_str(&text);
                    return;
                }
                let delta = std::mem::take(&mut self.held) + &text;
                let at = self.open_message();
                if let Some(OutputItem::Message { id, content, .. }) = self.items.get_mut(at) {
                    if let Some(part) = content.first_mut() {
                        part.text.push_str(&delta);
                    }
                    let fields = serde_json::json!({
                        "item_id": id, "output_index": at, "content_index": 0,
                        "delta": delta, "logprobs": [],
                    });
                    self.events.push(("response.output_text.delta", fields));
                }
            }
            ToolCallEvent::Start { index, id, name } => {
                self.held.clear();
                self.close_message();
                let at = self.items.len();
                self.items.push(OutputItem::FunctionCall {
                    id: new_id("fc_"),
                    call_id: id,
                    name,
                    arguments: String::new(),
                    status: "in_progress",
                });
                if self.calls.len() <= index {
                    self.calls.resize(index + 1, at);
                }
                self.calls[index] = at;
                let item = serde_json::to_value(&self.items[at]).unwrap_or_default();
                self.events.push((
                    "response.output_item.added",
                    serde_json::json!({"output_index": at, "item": item}),
                ));
            }
            ToolCallEvent::Arguments { index, fragment } => {
                let Some(&at) = self.calls.get(index) else {
                    return;
                };
                if let Some(OutputItem::FunctionCall { id, arguments, .. }) = self.items.get_mut(at)
                {
                    arguments.push_str(&fragment);
                    let fields = serde_json::json!({
                        "item_id": id, "output_index": at, "delta": fragment,
                    });
                    self.events
                        .push(("response.function_call_arguments.delta", fields));
                }
            }
        }
    }

    /// The open message's place, opening one (its `added` events) if none is.
    fn open_message(&mut self) -> usize {
        if let Some(at) = self.message {
            return at;
        }
        let at = self.items.len();
        let id = new_id("msg_");
        self.items.push(OutputItem::Message {
            id: id.clone(),
            status: "in_progress",
            role: "assistant",
            content: Vec::new(),
        });
        let item = serde_json::to_value(&self.items[at]).unwrap_or_default();
        self.events.push((
            "response.output_item.added",
            serde_json::json!({"output_index": at, "item": item}),
        ));
        if let Some(OutputItem::Message { content, .. }) = self.items.get_mut(at) {
            content.push(OutputText {
                kind: "output_text",
                text: String::new(),
                annotations: Vec::new(),
            });
        }
        self.events.push((
            "response.content_part.added",
            serde_json::json!({
                "item_id": id, "output_index": at, "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": []},
            }),
        ));
        self.message = Some(at);
        at
    }

    /// Completes the open message, if any (its `done` events).
    fn close_message(&mut self) {
        let Some(at) = self.message.take() else {
            return;
        };
        if let Some(OutputItem::Message {
            id,
            status,
            content,
            ..
        }) = self.items.get_mut(at)
        {
            *status = "completed";
            let text = content.first().map(|p| p.text.clone()).unwrap_or_default();
            self.events.push((
                "response.output_text.done",
                serde_json::json!({
                    "item_id": id, "output_index": at, "content_index": 0,
                    "text": text, "logprobs": [],
                }),
            ));
            self.events.push((
                "response.content_part.done",
                serde_json::json!({
                    "item_id": id, "output_index": at, "content_index": 0,
                    "part": {"type": "output_text", "text": text, "annotations": []},
                }),
            ));
        }
        let item = serde_json::to_value(&self.items[at]).unwrap_or_default();
        self.events.push((
            "response.output_item.done",
            serde_json::json!({"output_index": at, "item": item}),
        ));
    }
}

/// What is kept of an answer for the store: the assistant's message as the chat
/// template reads it.
fn assistant_message(output: &[OutputItem]) -> ChatMessage {
    let mut message = ChatMessage::new("assistant", "");
    for item in output {
        match item {
            OutputItem::Message { content, .. } => {
                for part in content {
                    message.content.push_str(&part.text);
                }
            }
            OutputItem::FunctionCall {
                call_id,
                name,
                arguments,
                ..
            } => message.tool_calls.push(crate::tools::ToolCall {
                id: call_id.clone(),
                name: name.clone(),
                arguments: arguments.clone(),
            }),
        }
    }
    message
}

/// Creates a response: whole, or streamed as typed server-sent events (`event:` the
/// type, `data:` the event with its `sequence_number`).
#[utoipa::path(post, path = "/v1/responses", tag = "responses",
    request_body(content = ResponseRequest, content_type = "application/json"),
    responses(
        (status = 200, description = "The response", content(
            (ResponseObject = "application/json"),
            (super::openapi::ResponseStreamEvent = "text/event-stream"),
        )),
        super::routes::GenerationErrors,
    ),
    security((), ("bearer" = [])),
)]
pub(super) async fn create_response(
    State(shared): State<Arc<Shared>>,
    Extension(ClientRequestId(request_id)): Extension<ClientRequestId>,
    Extension(tenant): Extension<Tenant>,
    body: Body,
) -> Result<Response, ApiError> {
    let body = read_body(&shared, body).await?;
    let request = read_response_request(&shared.config, &body)?;
    drop(body);
    let owner = store_tenant(&tenant);
    let previous = match &request.previous_response_id {
        None => Vec::new(),
        Some(id) => match shared.responses.get(&owner, id) {
            Some(stored) => stored.conversation,
            None => {
                return Err(ApiError::not_found(
                    format!("no stored response `{id}`"),
                    Some("previous_response_id"),
                ));
            }
        },
    };
    let (chat, conversation) = chat_body(&request, previous)?;
    let echo = Echo::of(&request);
    let stream = request.stream == Some(true);
    drop(request);
    let checked = read_chat(&shared.config, &chat)?;
    drop(chat);
    let mut sampling = checked.sampling;
    if let Some(tool_request) = checked.tool_request {
        with_tools(&shared, &mut sampling, tool_request)?;
    }
    let default_max = shared.config.default_max_tokens;
    let started = start(
        shared.clone(),
        Endpoint::Chat,
        vec![PromptInput::Chat(checked.messages)],
        sampling,
        default_max,
        request_id,
        TenantOf::new(tenant, checked.extras),
    )
    .await?;
    let header = started.request_id.clone();
    let answer = Answer {
        shared: shared.clone(),
        id: new_id("resp_"),
        echo,
        owner,
        conversation,
        builder: OutputBuilder::new(started.envelope.tool_format),
        envelope: started.envelope,
        generation: started.generation,
        sequence: 0,
    };
    let mut response = if stream {
        let keep_alive = shared.config.sse_keep_alive;
        Sse::new(answer.events())
            .keep_alive(KeepAlive::new().interval(keep_alive))
            .into_response()
    } else {
        Json(answer.whole().await?).into_response()
    };
    if let Some(value) = header {
        response.headers_mut().insert("x-request-id", value);
    }
    Ok(response)
}

/// A response being answered.
struct Answer {
    shared: Arc<Shared>,
    id: String,
    echo: Echo,
    /// The store's tenant.
    owner: String,
    /// The conversation so far (without the instructions), for the store.
    conversation: Vec<ChatMessage>,
    builder: OutputBuilder,
    envelope: Envelope,
    generation: super::generation::Generation,
    /// The next event's `sequence_number`.
    sequence: u64,
}

impl Answer {
    /// Reads the next update; `Some(status)` once the answer has ended.
    async fn step(&mut self) -> Result<Option<&'static str>, ApiError> {
        match self.generation.next().await {
            Some(Update::Text { text, .. }) => {
                self.builder.push(&text);
                Ok(None)
            }
            Some(Update::Finished { text, reason, .. }) => {
                self.builder.push(&text);
                Ok(Some(if reason == "length" {
                    "incomplete"
                } else {
                    "completed"
                }))
            }
            Some(Update::Failed(error)) => Err(error),
            None => Ok(Some("completed")),
        }
    }

    /// The finished response, stored if asked.
    fn finish(&mut self, status: &'static str) -> ResponseObject {
        let output = self.builder.finish();
        let usage = response_usage(self.generation.usage());
        let object = self
            .echo
            .response(&self.id, &self.envelope, status, output, Some(usage));
        if self.echo.store {
            let mut conversation = std::mem::take(&mut self.conversation);
            conversation.push(assistant_message(&object.output));
            let json = serde_json::to_string(&object).unwrap_or_default();
            self.shared
                .responses
                .insert(&self.owner, &self.id, Stored { json, conversation });
        }
        object
    }

    /// Waits for the whole answer.
    async fn whole(mut self) -> Result<ResponseObject, ApiError> {
        loop {
            if let Some(status) = self.step().await? {
                self.builder.events.clear();
                return Ok(self.finish(status));
            }
            self.builder.events.clear();
        }
    }

    /// An event with the next sequence number.
    fn event(&mut self, kind: &'static str, mut fields: serde_json::Value) -> Event {
        if let Some(map) = fields.as_object_mut() {
            map.insert("type".into(), kind.into());
            map.insert("sequence_number".into(), self.sequence.into());
        }
        self.sequence += 1;
        Event::default().event(kind).data(fields.to_string())
    }

    /// The answer as typed events: `response.created`, `response.in_progress`, each
    /// item's events, then `response.completed` (`error` if the generation failed). Dropping the stream cancels the generation.
    fn events(self) -> impl Stream<Item = Result<Event, Infallible>> {
        let mut state = (self, VecDeque::new(), false);
        let created = state.0.echo.response(
            &state.0.id,
            &state.0.envelope,
            "in_progress",
            Vec::new(),
            None,
        );
        let created = serde_json::json!({"response": created});
        let first = state.0.event("response.created", created.clone());
        let second = state.0.event("response.in_progress", created);
        state.1.push_back(first);
        state.1.push_back(second);
        stream::unfold(state, |(mut answer, mut queue, mut done)| async move {
            loop {
                if let Some(event) = queue.pop_front() {
                    return Some((Ok(event), (answer, queue, done)));
                }
                if done {
                    return None;
                }
                let step = answer.step().await;
                let pending = std::mem::take(&mut answer.builder.events);
                for (kind, fields) in pending {
                    let event = answer.event(kind, fields);
                    queue.push_back(event);
                }
                match step {
                    Ok(None) => {}
                    Ok(Some(status)) => {
                        let object = answer.finish(status);
                        let pending = std::mem::take(&mut answer.builder.events);
                        for (kind, fields) in pending {
                            let event = answer.event(kind, fields);
                            queue.push_back(event);
                        }
                        // `response.completed` whatever the status (an incomplete
                        // response says so in its `status`): the openai client's stream
                        // helper gives its final response only after that event.
                        let event = answer.event(
                            "response.completed",
                            serde_json::json!({"response": object}),
                        );
                        queue.push_back(event);
                        done = true;
                    }
                    Err(error) => {
                        let body = serde_json::json!({
                            "code": error.code,
                            "message": error.message,
                            "param": error.param,
                        });
                        let event = answer.event("error", body);
                        queue.push_back(event);
                        done = true;
                    }
                }
            }
        })
    }
}

/// Every check of a response body that needs no engine: the chat body's depth and key
/// checks on the bytes as sent, then the parse.
pub(super) fn read_response_request(
    config: &ServerConfig,
    body: &[u8],
) -> Result<ResponseRequest, ApiError> {
    super::limits::check_depth(body, config.max_json_depth)?;
    super::limits::check_unique_keys(body)?;
    super::openai::parse_object(body)
}

/// A stored response, as it was sent.
#[utoipa::path(get, path = "/v1/responses/{id}", tag = "responses",
    params(("id" = String, Path, description = "The response's id")),
    responses(
        (status = 200, description = "The stored response", body = ResponseObject),
        (status = 404, description = "No such response for this tenant", body = super::error::ErrorBody),
    ),
    security((), ("bearer" = [])),
)]
pub(super) async fn get_response(
    State(shared): State<Arc<Shared>>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    match shared.responses.get(&store_tenant(&tenant), &id) {
        Some(stored) => Ok((
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            stored.json,
        )
            .into_response()),
        None => Err(ApiError::not_found(
            format!("no stored response `{id}`"),
            None,
        )),
    }
}

/// Deletes a stored response.
#[utoipa::path(delete, path = "/v1/responses/{id}", tag = "responses",
    params(("id" = String, Path, description = "The response's id")),
    responses(
        (status = 200, description = "`{id, object: response.deleted, deleted: true}`", body = Object),
        (status = 404, description = "No such response for this tenant", body = super::error::ErrorBody),
    ),
    security((), ("bearer" = [])),
)]
pub(super) async fn delete_response(
    State(shared): State<Arc<Shared>>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    if shared.responses.delete(&store_tenant(&tenant), &id) {
        Ok(Json(serde_json::json!({
            "id": id, "object": "response.deleted", "deleted": true
        }))
        .into_response())
    } else {
        Err(ApiError::not_found(
            format!("no stored response `{id}`"),
            None,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(body: &str) -> Result<ResponseRequest, ApiError> {
        read_response_request(&ServerConfig::new("smol"), body.as_bytes())
    }

    /// The chat body a request becomes, as JSON.
    fn chat(body: &str, previous: Vec<ChatMessage>) -> serde_json::Value {
        let request = parse(body).expect("parses");
        let (bytes, _) = chat_body(&request, previous).expect("rewrites");
        serde_json::from_slice(&bytes).expect("JSON")
    }

    #[test]
    fn requests_become_chat_bodies() {
        let body = chat(
            r#"{"input":"Hi","instructions":"Be brief","max_output_tokens":5,"temperature":0}"#,
            Vec::new(),
        );
        assert_eq!(
            body["messages"],
            serde_json::json!([
                {"role": "system", "content": "Be brief"},
                {"role": "user", "content": "Hi"},
            ])
        );
        assert_eq!(body["max_tokens"], 5);
        assert_eq!(body["temperature"], 0.0);

        // A function call and its output after a stored turn; tools nested as chat's;
        // a forced function; `text.format` as `response_format`.
        let previous = vec![ChatMessage::new("user", "Weather?")];
        let body = chat(
            r#"{"input":[
                {"type":"function_call","call_id":"c1","name":"get","arguments":"{}"},
                {"type":"function_call_output","call_id":"c1","output":"sunny"},
                {"role":"user","content":[{"type":"input_text","text":"And "},{"type":"input_text","text":"now?"}]}],
              "tools":[{"type":"function","name":"get","parameters":{"type":"object"}}],
              "tool_choice":{"type":"function","name":"get"},
              "text":{"format":{"type":"json_schema","name":"w","schema":{"type":"object"},"strict":true}}}"#,
            previous,
        );
        let messages = body["messages"].as_array().unwrap();
        assert_eq!(messages[0]["content"], "Weather?");
        assert_eq!(messages[1]["role"], "assistant");
        assert!(messages[1]["content"].is_null());
        assert_eq!(messages[1]["tool_calls"][0]["id"], "c1");
        assert_eq!(messages[1]["tool_calls"][0]["function"]["name"], "get");
        assert_eq!(messages[2]["role"], "tool");
        assert_eq!(messages[2]["tool_call_id"], "c1");
        assert_eq!(messages[3]["content"], "And now?");
        assert_eq!(body["tools"][0]["type"], "function");
        assert_eq!(body["tools"][0]["function"]["name"], "get");
        assert_eq!(body["tool_choice"]["function"]["name"], "get");
        assert_eq!(body["response_format"]["type"], "json_schema");
        assert_eq!(body["response_format"]["json_schema"]["strict"], true);
        // The chat reader accepts it.
        let request = parse(r#"{"input":"Hi","tools":[{"type":"function","name":"f"}]}"#).unwrap();
        let (bytes, _) = chat_body(&request, Vec::new()).unwrap();
        assert!(super::super::routes::read_chat(&ServerConfig::new("smol"), &bytes).is_ok());
    }

    #[test]
    fn what_is_not_served_is_refused_by_name() {
        let refused = |body: &str| {
            let request = parse(body).expect("parses");
            chat_body(&request, Vec::new())
                .err()
                .and_then(|e| e.param)
                .unwrap_or_default()
        };
        assert_eq!(
            refused(
                r#"{"input":[{"role":"user","content":[{"type":"input_image","image_url":"x"}]}]}"#
            ),
            "input[0].content[0].type"
        );
        assert_eq!(
            refused(r#"{"input":[{"type":"reasoning"}]}"#),
            "input[0].type"
        );
        assert_eq!(refused(r#"{"input":[]}"#), "input");
        assert_eq!(
            refused(r#"{"input":"a","tools":[{"type":"web_search"}]}"#),
            "tools[0].type"
        );
        assert_eq!(
            refused(r#"{"input":"a","text":{"format":{"type":"yaml"}}}"#),
            "text.format.type"
        );
        assert_eq!(
            refused(r#"{"input":[{"type":"function_call","name":"f","arguments":"{}"}]}"#),
            "input[0].call_id"
        );
        let e = parse(r#"{"input":5}"#).err().and_then(|e| e.param);
        assert_eq!(e.as_deref(), Some("input"));
    }

    #[test]
    fn text_and_calls_become_items_and_events() {
        // Without tools: one message, its events in order.
        let mut builder = OutputBuilder::new(None);
        builder.push("Hello");
        builder.push(", world");
        let output = builder.finish();
        let kinds: Vec<&str> = builder.events.iter().map(|(k, _)| *k).collect();
        assert_eq!(
            kinds,
            [
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
            ]
        );
        match &output[..] {
            [
                OutputItem::Message {
                    content, status, ..
                },
            ] => {
                assert_eq!(content[0].text, "Hello, world");
                assert_eq!(*status, "completed");
            }
            other => panic!("{other:?}"),
        }
        // Hermes calls: function_call items with their arguments; the whitespace
        // around them makes no message.
        let mut builder = OutputBuilder::new(Some(crate::tools::ToolFormat::Hermes));
        builder.push("<tool_call>\n{\"name\": \"get\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n");
        let output = builder.finish();
        match &output[..] {
            [
                OutputItem::FunctionCall {
                    name,
                    arguments,
                    status,
                    ..
                },
            ] => {
                assert_eq!(name, "get");
                assert_eq!(
                    serde_json::from_str::<serde_json::Value>(arguments).unwrap(),
                    serde_json::json!({"city": "Paris"})
                );
                assert_eq!(*status, "completed");
            }
            other => panic!("{other:?}"),
        }
        let kinds: Vec<&str> = builder.events.iter().map(|(k, _)| *k).collect();
        assert_eq!(kinds.first(), Some(&"response.output_item.added"));
        assert!(kinds.contains(&"response.function_call_arguments.delta"));
        assert_eq!(
            &kinds[kinds.len() - 2..],
            [
                "response.function_call_arguments.done",
                "response.output_item.done"
            ]
        );
        let message = assistant_message(&output);
        assert_eq!(message.tool_calls.len(), 1);
        assert!(message.content.is_empty());
    }
}
