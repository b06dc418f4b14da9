//! The objects the server answers with, typed: whole completions, stream chunks, models,
//! health. Each derives `Serialize` (what is sent) and `utoipa::ToSchema` (what
//! `/openapi.json` says is sent), so the description cannot drift from the answers.
//!
//! A field that OpenAI sends as `null` when it has no value is an `Option` serialized as
//! `null`; one that OpenAI leaves out is skipped when empty.

use serde::Serialize;
use utoipa::ToSchema;

use super::openai::Usage;

/// The fields every completion and chunk starts with.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ResponseHead {
    /// The response's id (`chatcmpl-...` or `cmpl-...`); a stream's chunks share it.
    pub id: String,
    /// `chat.completion`, `chat.completion.chunk` or `text_completion`.
    pub object: &'static str,
    /// Unix time of the request, in seconds.
    pub created: u64,
    /// The served model's id.
    pub model: String,
    /// `llama-burn-seed-{seed}`: the same seed and request give the same answer.
    pub system_fingerprint: String,
    /// The seed of choice 0 (choice `i` used `seed + i`), as the client sends seeds.
    pub seed: i64,
}

/// The answer of `POST /v1/chat/completions` (without `stream`).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatCompletion {
    /// Id, object, time, model, fingerprint and seed.
    #[serde(flatten)]
    pub head: ResponseHead,
    /// One per choice (`n`), in order.
    pub choices: Vec<ChatChoice>,
    /// Token counts.
    pub usage: Usage,
}

/// One choice of a [`ChatCompletion`].
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatChoice {
    /// The choice's index.
    pub index: usize,
    /// The answer.
    pub message: AssistantMessage,
    /// Each generated token's log-probability, when `logprobs` was asked for.
    pub logprobs: Option<ChatLogprobs>,
    /// `stop`, `length` or `tool_calls`.
    pub finish_reason: &'static str,
}

/// The assistant's answer in a [`ChatChoice`].
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct AssistantMessage {
    /// Always `assistant`.
    pub role: &'static str,
    /// The text; null when the answer is tool calls and nothing else.
    pub content: Option<String>,
    /// The calls the answer makes (left out when none).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallObject>,
}

/// One tool call of an answer.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ToolCallObject {
    /// The call's id (`call_...`), which the tool's result names.
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The function called.
    pub function: FunctionCallObject,
}

/// The function of a [`ToolCallObject`].
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct FunctionCallObject {
    /// Its name.
    pub name: String,
    /// Its arguments, as JSON text.
    pub arguments: String,
}

/// A chat choice's `logprobs`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatLogprobs {
    /// One entry per token.
    pub content: Vec<ChatTokenLogprob>,
    /// Always null.
    pub refusal: Option<String>,
}

/// One token's log-probability and its most likely alternatives.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatTokenLogprob {
    /// The token's text (invalid UTF-8 replaced).
    pub token: String,
    /// Its log-probability (-9999.0 for minus infinity, as OpenAI writes it).
    pub logprob: f64,
    /// The token's bytes.
    pub bytes: Vec<u8>,
    /// The `top_logprobs` most likely tokens at that position.
    pub top_logprobs: Vec<TopLogprob>,
}

/// An alternative token at one position.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TopLogprob {
    /// The token's text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f64,
    /// The token's bytes.
    pub bytes: Vec<u8>,
}

/// The answer of `POST /v1/completions` (without `stream`).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TextCompletion {
    /// Id, object, time, model, fingerprint and seed.
    #[serde(flatten)]
    pub head: ResponseHead,
    /// One per prompt and choice (`n` per prompt, prompt by prompt).
    pub choices: Vec<TextChoice>,
    /// Token counts.
    pub usage: Usage,
}

/// One choice of a [`TextCompletion`], or of a [`TextCompletionChunk`].
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TextChoice {
    /// The choice's index.
    pub index: usize,
    /// The text (with `echo`, the prompt first).
    pub text: String,
    /// Log-probabilities, when `logprobs` was asked for.
    pub logprobs: Option<TextLogprobs>,
    /// `stop` or `length`; in a stream, null until the choice's last chunk.
    pub finish_reason: Option<&'static str>,
}

/// A text choice's `logprobs`, in the legacy completions shape.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TextLogprobs {
    /// Each token's text.
    pub tokens: Vec<String>,
    /// Each token's log-probability (null for an echoed prompt's first token).
    pub token_logprobs: Vec<Option<f64>>,
    /// Each position's most likely tokens, text to log-probability (null where
    /// `token_logprobs` is).
    #[schema(value_type = Vec<Option<std::collections::HashMap<String, f64>>>)]
    pub top_logprobs: Vec<Option<serde_json::Map<String, serde_json::Value>>>,
    /// Each token's character offset in the choice's text.
    pub text_offset: Vec<usize>,
}

/// One `data:` event of a streamed chat answer.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatCompletionChunk {
    /// Id, object, time, model, fingerprint and seed.
    #[serde(flatten)]
    pub head: ResponseHead,
    /// The choices this chunk adds to (none in the usage chunk).
    pub choices: Vec<ChatChunkChoice>,
    /// With `stream_options.include_usage`: null, and the counts on the last chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Usage>)]
    pub usage: Option<Option<Usage>>,
}

/// A choice's part of a [`ChatCompletionChunk`].
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatChunkChoice {
    /// The choice's index.
    pub index: usize,
    /// What the choice adds.
    pub delta: ChatDelta,
    /// The new tokens' log-probabilities, when asked for.
    pub logprobs: Option<ChatLogprobs>,
    /// Null until the choice's last chunk.
    pub finish_reason: Option<&'static str>,
}

/// What a chunk adds to a chat choice.
#[derive(Debug, Clone, Default, Serialize, ToSchema)]
pub struct ChatDelta {
    /// `assistant`, on a choice's first chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// New text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// A call's start (index, id, type, name) or a fragment of its arguments.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<DeltaToolCall>,
}

/// A tool call's part of a [`ChatDelta`].
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct DeltaToolCall {
    /// Which call of the choice.
    pub index: usize,
    /// The call's id, on its first part.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// `function`, on its first part.
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    /// The function's name (first part) or arguments (later parts).
    pub function: DeltaFunction,
}

/// The function of a [`DeltaToolCall`].
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct DeltaFunction {
    /// The name, on the call's first part.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// A fragment of the arguments' JSON text (empty on the first part).
    pub arguments: String,
}

/// One `data:` event of a streamed text completion.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TextCompletionChunk {
    /// Id, object, time, model, fingerprint and seed.
    #[serde(flatten)]
    pub head: ResponseHead,
    /// The choices this chunk adds to (none in the usage chunk).
    pub choices: Vec<TextChoice>,
    /// With `stream_options.include_usage`: null, and the counts on the last chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Usage>)]
    pub usage: Option<Option<Usage>>,
}

/// The served model or one of its LoRA adapters, as `/v1/models` lists it.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ModelObject {
    /// The id requests name in `model`.
    pub id: String,
    /// Always `model`.
    pub object: &'static str,
    /// Unix time the server started, in seconds.
    pub created: u64,
    /// Always `llama-burn`.
    pub owned_by: &'static str,
    /// An adapter's base model: the served model's id (absent for the served model).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// An adapter's source (its path; absent for the served model).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub root: Option<String>,
}

/// The answer of the admin routes that load and unload LoRA adapters.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct AdapterStatus {
    /// The adapter's name.
    pub lora_name: String,
    /// `loaded` or `unloaded`.
    pub status: &'static str,
    /// Its largest rank (when loaded).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rank: Option<usize>,
    /// The modules it changes (when loaded).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub modules: Option<Vec<&'static str>>,
}

/// The answer of `GET /v1/models`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ModelList {
    /// Always `list`.
    pub object: &'static str,
    /// The served model, then its LoRA adapters.
    pub data: Vec<ModelObject>,
}

/// The answer of `GET /health`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Health {
    /// `ok` (200); `loading`, `shutting_down` or `engine_stopped` (503).
    pub status: &'static str,
}

/// The answer of `POST /v1/embeddings`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct EmbeddingList {
    /// `list`.
    pub object: &'static str,
    /// One per input, in order.
    pub data: Vec<EmbeddingObject>,
    /// The served model's id.
    pub model: String,
    /// Token counts.
    pub usage: EmbeddingUsage,
}

/// One input's vector.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct EmbeddingObject {
    /// `embedding`.
    pub object: &'static str,
    /// The input's position in the request.
    pub index: usize,
    /// The vector: numbers, or with `encoding_format: base64` its little-endian f32
    /// bytes in base64.
    pub embedding: EmbeddingVector,
}

/// A vector as `encoding_format` asks.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(untagged)]
pub enum EmbeddingVector {
    /// `float`.
    Float(Vec<f32>),
    /// `base64`.
    Base64(String),
}

/// The token counts of an embedding request.
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
pub struct EmbeddingUsage {
    /// Tokens of every input together.
    pub prompt_tokens: usize,
    /// The same: embeddings generate nothing.
    pub total_tokens: usize,
}
