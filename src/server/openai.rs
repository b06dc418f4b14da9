//! The OpenAI wire format: request bodies as clients send them, the checks OpenAI
//! applies to them, and the response objects and stream chunks.
//!
//! Unknown fields are ignored (clients send many); a known field with the wrong type or
//! an invalid value is refused with a 400 naming it. Every sampling control OpenAI, vLLM
//! and llama.cpp clients send is honoured (`temperature`, `top_p`, `frequency_penalty`,
//! `presence_penalty`, `logit_bias`, `logprobs`/`top_logprobs`, `seed`, and vLLM's `top_k`,
//! `min_p`, `repetition_penalty`, `stop_token_ids`, `ignore_eos`, `min_tokens`). Fields
//! for features this server does not have (`suffix`, `best_of`) are accepted at their
//! neutral value and refused otherwise, so a client never silently gets less than it
//! asked for. Tools and structured outputs are read from the body by the server's own
//! modules for them.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use super::error::ApiError;
use super::responses::{
    AssistantMessage, ChatChoice, ChatDelta, ChatLogprobs, ChatTokenLogprob, DeltaFunction,
    DeltaToolCall, FunctionCallObject, TextLogprobs, ToolCallObject, TopLogprob,
};
use crate::inference::request::MAX_STOP_TOKEN_IDS;
use crate::sampling::pipeline::MAX_LOGIT_BIAS;
use crate::sampling::{SamplingParams, TokenLogprob, TokenLogprobs};
use crate::tokenizer::ChatMessage;
use crate::tools::ToolCall;
use crate::tools::parse::ToolCallEvent;

/// Most stop strings a request may give (OpenAI's limit).
pub const MAX_STOP_STRINGS: usize = 4;

/// `stop`: one string or a list.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum StopField {
    /// One stop string.
    One(String),
    /// Up to four stop strings.
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, ToSchema)]
pub struct StreamOptions {
    /// Send a last chunk with `choices: []` and the request's usage.
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// The sampling and output fields `/v1/chat/completions` and `/v1/completions` share.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct CommonFields {
    /// The model to use; must be the served one when given.
    pub model: Option<String>,
    /// Most tokens to generate.
    pub max_tokens: Option<u64>,
    /// Sampling temperature in `[0, 2]` (default 1); 0 is greedy.
    #[schema(minimum = 0.0, maximum = 2.0)]
    pub temperature: Option<f64>,
    /// Nucleus-sampling mass in `(0, 1]` (default 1).
    #[schema(exclusive_minimum = 0.0, maximum = 1.0)]
    pub top_p: Option<f64>,
    /// Seed of the sampler; choice `i` uses `seed + i`.
    pub seed: Option<i64>,
    /// Stop strings.
    pub stop: Option<StopField>,
    /// Number of choices (each its own request to the engine).
    #[schema(minimum = 1)]
    pub n: Option<u64>,
    /// Stream the answer as server-sent events.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// An end-user id: accepted and ignored.
    pub user: Option<String>,
    /// Chat: `true` to get each token's log-probability. Completions: the number of
    /// alternatives per token, 0-5.
    #[serde(default, deserialize_with = "scalar_only")]
    pub logprobs: Option<Value>,
    /// Chat: alternatives per token, 0-20 (needs `logprobs: true`).
    #[schema(maximum = 20)]
    pub top_logprobs: Option<u64>,
    /// In `[-2, 2]`: lowers a token's logit by this much per time it was generated.
    #[schema(minimum = -2.0, maximum = 2.0)]
    pub frequency_penalty: Option<f64>,
    /// In `[-2, 2]`: lowers a token's logit by this much once it was generated.
    #[schema(minimum = -2.0, maximum = 2.0)]
    pub presence_penalty: Option<f64>,
    /// Token id (as a string) to a bias in `[-100, 100]`, at most 1024 entries.
    #[schema(value_type = Option<std::collections::HashMap<String, f64>>)]
    #[serde(default, deserialize_with = "bounded_map")]
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    /// vLLM: keep the `top_k` most likely tokens; -1 or 0 is off.
    #[schema(minimum = -1)]
    pub top_k: Option<i64>,
    /// vLLM: keep tokens at least `min_p` times as likely as the most likely, `[0, 1]`.
    #[schema(minimum = 0.0, maximum = 1.0)]
    pub min_p: Option<f64>,
    /// vLLM: CTRL's repetition penalty over prompt and output, `(0, 2]`; 1 is off.
    #[schema(exclusive_minimum = 0.0, maximum = 2.0)]
    pub repetition_penalty: Option<f64>,
    /// vLLM: token ids that also end a choice (at most 256).
    #[schema(max_items = 256)]
    pub stop_token_ids: Option<Vec<u32>>,
    /// vLLM: keep generating past the model's stop tokens.
    pub ignore_eos: Option<bool>,
    /// vLLM: no stop token before this many tokens.
    pub min_tokens: Option<u64>,
}

/// A message's `content`: a string, a list of parts, or null.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// Content parts; only `text` parts are supported.
    Parts(Vec<ContentPart>),
}

/// One content part.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentPart {
    /// A text part.
    Text {
        /// The text.
        text: String,
    },
}

/// One message of `messages`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, ToSchema)]
pub struct RequestMessage {
    /// `system`, `developer` (read as `system`), `user`, `assistant` or `tool`.
    #[schema(pattern = "^(system|developer|user|assistant|tool)$")]
    pub role: String,
    /// The content (null only for an assistant message).
    pub content: Option<MessageContent>,
    /// An assistant message's calls.
    pub tool_calls: Option<Vec<RequestToolCall>>,
    /// A `tool` message: the call it answers.
    pub tool_call_id: Option<String>,
}

/// One call of an assistant message's `tool_calls`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, ToSchema)]
pub struct RequestToolCall {
    /// The call's id.
    pub id: Option<String>,
    /// `function` (the only kind).
    #[serde(rename = "type")]
    pub kind: Option<String>,
    /// The function called.
    pub function: RequestFunctionCall,
}

/// The function of a [`RequestToolCall`].
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, ToSchema)]
pub struct RequestFunctionCall {
    /// Its name.
    pub name: String,
    /// Its arguments: JSON text (as OpenAI sends them back), or a JSON value.
    pub arguments: Value,
}

/// The body of `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[schema(as = ChatCompletionFields)]
pub struct ChatCompletionRequest {
    /// The conversation.
    pub messages: Vec<RequestMessage>,
    /// Newer name of `max_tokens`; wins when both are given.
    pub max_completion_tokens: Option<u64>,
    /// `text`, `json_object` or `json_schema` (read into a constraint by the server's
    /// structured-outputs module).
    #[schema(value_type = Option<Object>)]
    pub response_format: Option<serde::de::IgnoredAny>,
    /// The shared fields (read by [`parse_request`]).
    #[serde(skip)]
    pub common: CommonFields,
}

/// `prompt` (and embeddings' `input`): a string, a list of strings, a list of token ids
/// or a list of such lists.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum PromptField {
    /// One prompt.
    Text(String),
    /// Several prompts.
    Texts(Vec<String>),
    /// One prompt as token ids.
    Ids(Vec<u32>),
    /// Several prompts as token ids.
    IdLists(Vec<Vec<u32>>),
}

/// The body of `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[schema(as = CompletionFields)]
pub struct CompletionRequest {
    /// What to continue.
    pub prompt: PromptField,
    /// Send the prompt back before the completion (with its log-probabilities when
    /// `logprobs` is given; the first prompt token's is null). With `echo`, `max_tokens`
    /// may be 0: the prompt's log-probabilities alone, as lm-evaluation-harness scores
    /// log-likelihoods. Token-id prompts echo their decoded text.
    pub echo: Option<bool>,
    /// Unsupported: must be absent or null.
    #[serde(default, deserialize_with = "scalar_only")]
    pub suffix: Option<Value>,
    /// Unsupported: must be absent, null or 1.
    #[serde(default, deserialize_with = "scalar_only")]
    pub best_of: Option<Value>,
    /// The shared fields (read by [`parse_request`]).
    #[serde(skip)]
    pub common: CommonFields,
}

/// The body of `POST /v1/embeddings`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[schema(as = EmbeddingFields)]
pub struct EmbeddingRequest {
    /// What to embed: a string, a list of strings, a list of token ids or a list of
    /// such lists (at most `--max-prompts` inputs); each input gets one vector.
    pub input: PromptField,
    /// The served model's id (or absent); adapters do not embed.
    #[serde(default)]
    pub model: Option<String>,
    /// `float` (the default): the vectors as lists of numbers; `base64`: each vector's
    /// little-endian f32 bytes in base64.
    #[serde(default)]
    pub encoding_format: Option<EncodingFormat>,
    /// Keep the first `dimensions` components (then normalize); at most the model's
    /// width. Meaningful for models trained for truncation (Matryoshka).
    #[serde(default)]
    #[schema(minimum = 1)]
    pub dimensions: Option<u64>,
}

/// How `/v1/embeddings` writes its vectors.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum EncodingFormat {
    /// Lists of numbers.
    #[default]
    Float,
    /// Each vector's little-endian f32 bytes, base64-encoded.
    Base64,
}

impl EmbeddingRequest {
    /// Parses a body that passed the server's size, depth, key and count checks: 400 for
    /// malformed JSON, a body that is not an object, or a known field of the wrong type
    /// (the error's `param` names it).
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        parse_object(body)
    }

    /// The inputs, each a text or token ids; 400 naming `input` for no inputs or an
    /// empty one.
    pub fn inputs(self) -> Result<Vec<PromptInput>, ApiError> {
        let inputs: Vec<PromptInput> = match self.input {
            PromptField::Text(t) => vec![PromptInput::Text(t)],
            PromptField::Texts(ts) => ts.into_iter().map(PromptInput::Text).collect(),
            PromptField::Ids(ids) => vec![PromptInput::Ids(ids)],
            PromptField::IdLists(lists) => lists.into_iter().map(PromptInput::Ids).collect(),
        };
        let empty = inputs.iter().any(|p| match p {
            PromptInput::Text(t) => t.is_empty(),
            PromptInput::Ids(ids) => ids.is_empty(),
            PromptInput::Chat(m) => m.is_empty(),
        });
        if inputs.is_empty() || empty {
            return Err(ApiError::invalid(
                "`input` must hold at least one input, and no input may be empty",
                Some("input"),
            ));
        }
        Ok(inputs)
    }
}

/// A request body with the [`CommonFields`].
pub trait OpenAiRequest: DeserializeOwned {
    /// Where the shared fields go.
    fn common_mut(&mut self) -> &mut CommonFields;
}

impl OpenAiRequest for ChatCompletionRequest {
    fn common_mut(&mut self) -> &mut CommonFields {
        &mut self.common
    }
}

impl OpenAiRequest for CompletionRequest {
    fn common_mut(&mut self) -> &mut CommonFields {
        &mut self.common
    }
}

/// Deserializes `body` (valid JSON) as `T`, straight from its bytes (the fields `T` does
/// not have are skipped, not kept); an error names the field at fault.
fn read<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        if path == "." {
            ApiError::invalid(format!("invalid request body: {}", e.inner()), None)
        } else {
            ApiError::invalid(
                format!("invalid request body at `{path}`: {}", e.inner()),
                Some(&path),
            )
        }
    })
}

/// Parses a request body: 400 for malformed JSON, a body that is not an object, or a
/// known field of the wrong type (the error's `param` names it). Unknown fields are
/// ignored.
pub fn parse_request<T: OpenAiRequest>(body: &[u8]) -> Result<T, ApiError> {
    let mut request: T = parse_object(body)?;
    *request.common_mut() = read(body)?;
    Ok(request)
}

/// Parses a body as `T`: 400 for malformed JSON, a body that is not an object, or a known
/// field of the wrong type (the error's `param` names it). No tree of the whole body:
/// its syntax is checked by a pass that keeps nothing, then the fields are read from the
/// bytes.
pub(crate) fn parse_object<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice::<serde::de::IgnoredAny>(body)
        .map_err(|e| ApiError::invalid(format!("the body is not valid JSON: {e}"), None))?;
    if body.trim_ascii_start().first() != Some(&b'{') {
        return Err(ApiError::invalid("the body must be a JSON object", None));
    }
    read(body)
}

/// What to encode for one prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptInput {
    /// A conversation, encoded with the chat template (content as plain text).
    Chat(Vec<ChatMessage>),
    /// Text, encoded as `generate` encodes prompts.
    Text(String),
    /// Token ids.
    Ids(Vec<u32>),
}

/// A request's checked settings, ready to become engine requests.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    /// Tokens to generate at most (`None`: the server's default).
    pub max_tokens: Option<usize>,
    /// The seed of choice 0 (`None`: a random one per choice).
    pub seed: Option<u64>,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Choices per prompt.
    pub n: usize,
    /// Stream the answer.
    pub stream: bool,
    /// Add a usage chunk at the end of the stream.
    pub include_usage: bool,
    /// Every sampling control (temperature, top-p, top-k, min-p, penalties, logit bias),
    /// read from the body once and checked ([`SamplingParams::validate`]): the engine
    /// requests carry it as it is.
    pub params: SamplingParams,
    /// Log-probabilities: alternatives per token (`None`: none asked for).
    pub logprobs: Option<usize>,
    /// Extra stop ids.
    pub stop_token_ids: Vec<u32>,
    /// Ignore the model's stop tokens.
    pub ignore_eos: bool,
    /// No stop token before this many tokens.
    pub min_tokens: usize,
    /// Completions: send the prompt back first (with its log-probabilities).
    pub echo: bool,
    /// Completions with `echo` and `max_tokens: 0`: one token is generated (the engine
    /// always generates one) and left out of the answer.
    pub prompt_only: bool,
    /// The structured-output constraint (`response_format`, `structured_outputs`, or a
    /// forced tool call).
    pub constraint: Option<std::sync::Arc<crate::constraints::Constraint>>,
    /// The field a constraint that does not compile is blamed on.
    pub constraint_param: &'static str,
    /// Tools shown to the model (chat).
    pub tools: Vec<crate::tools::Tool>,
    /// Read the answer for tool calls written in this format (chat with tools).
    pub tool_format: Option<crate::tools::ToolFormat>,
    /// The LoRA adapter the request's `model` names (`None`: the base model), checked
    /// against the engine's adapters before any work is done.
    pub adapter: Option<String>,
}

fn out_of_range(name: &str, value: impl std::fmt::Display, range: &str) -> ApiError {
    ApiError::invalid(format!("`{name}` = {value} is outside {range}"), Some(name))
}

fn is_neutral(value: &Option<Value>, neutral: &[Value]) -> bool {
    match value {
        None | Some(Value::Null) => true,
        Some(v) => neutral.contains(v),
    }
}

/// Refuses an unsupported feature asked for with a non-neutral value.
fn refuse_unsupported(
    name: &str,
    value: &Option<Value>,
    neutral: &[Value],
) -> Result<(), ApiError> {
    if is_neutral(value, neutral) {
        Ok(())
    } else {
        Err(ApiError::invalid(
            format!("`{name}` is not supported by this server"),
            Some(name),
        ))
    }
}

/// Reads a field that only a scalar can satisfy (`logprobs`, `suffix`, `best_of`): an
/// array or an object is read past without being kept (a million-element array in the
/// body costs nothing) and stands as an empty object, which every check of these fields
/// refuses as it would the original.
fn scalar_only<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    use serde::de::{IgnoredAny, MapAccess, SeqAccess};
    struct Scalar;
    impl<'de> serde::de::Visitor<'de> for Scalar {
        type Value = Value;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("any JSON value")
        }
        fn visit_unit<E: serde::de::Error>(self) -> Result<Value, E> {
            Ok(Value::Null)
        }
        fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Value, E> {
            Ok(Value::Bool(v))
        }
        fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Value, E> {
            Ok(Value::from(v))
        }
        fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Value, E> {
            Ok(Value::from(v))
        }
        fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Value, E> {
            Ok(Value::from(v))
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Value, E> {
            Ok(Value::from(v))
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            Ok(Value::Object(serde_json::Map::new()))
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
            while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
            Ok(Value::Object(serde_json::Map::new()))
        }
    }
    d.deserialize_any(Scalar).map(Some)
}

/// A JSON object read into a map of at most [`MAX_LOGIT_BIAS`] entries: the read stops
/// at the first entry past that, so a body of a million keys never becomes a map of them.
fn bounded_map<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<serde_json::Map<String, Value>>, D::Error> {
    struct Bounded;
    impl<'de> serde::de::Visitor<'de> for Bounded {
        type Value = Option<serde_json::Map<String, Value>>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "an object of at most {MAX_LOGIT_BIAS} entries")
        }
        fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(
            self,
            mut map: A,
        ) -> Result<Self::Value, A::Error> {
            let mut out = serde_json::Map::new();
            while let Some((key, value)) = map.next_entry::<String, Value>()? {
                if out.len() == MAX_LOGIT_BIAS {
                    return Err(serde::de::Error::custom(format!(
                        "more than {MAX_LOGIT_BIAS} entries (at most {MAX_LOGIT_BIAS})"
                    )));
                }
                out.insert(key, value);
            }
            Ok(Some(out))
        }
    }
    d.deserialize_any(Bounded)
}

/// `logit_bias` as the engine takes it: `(token id, bias)` sorted by id (the map's order
/// is the body's: sorted, the same bias is the same request). Its size and values are
/// [`SamplingParams::validate`]'s to check.
fn logit_bias(bias: &serde_json::Map<String, Value>) -> Result<Vec<(u32, f32)>, ApiError> {
    let mut entries = bias
        .iter()
        .map(|(key, value)| {
            // Only the canonical decimal form: "01" and "+1" would otherwise be token 1
            // again, each with its own bias, adding up past the +-100 limit.
            let id: u32 = key
                .parse()
                .ok()
                .filter(|id: &u32| id.to_string() == *key)
                .ok_or_else(|| {
                    ApiError::invalid(
                        format!(
                            "`logit_bias` key `{key}` is not a token id (a decimal number \
                             without sign or leading zeros)"
                        ),
                        Some("logit_bias"),
                    )
                })?;
            let value = value.as_f64().ok_or_else(|| {
                ApiError::invalid(
                    format!("`logit_bias[{key}]` must be a number"),
                    Some("logit_bias"),
                )
            })?;
            Ok((id, value as f32))
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    entries.sort_by_key(|&(id, _)| id);
    Ok(entries)
}

impl CommonFields {
    /// Checks the shared fields for `endpoint`; `max_tokens` is the value the endpoint
    /// takes, `max_n` the most choices allowed. Every error names its field.
    pub fn sampling(
        &self,
        endpoint: Endpoint,
        max_tokens: Option<u64>,
        max_n: usize,
    ) -> Result<Sampling, ApiError> {
        let logprobs = self.logprobs(endpoint)?;
        let params = self.params(endpoint)?;
        let stop_token_ids = self.stop_token_ids.clone().unwrap_or_default();
        if stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
            return Err(ApiError::invalid(
                format!(
                    "`stop_token_ids` has {} ids; at most {MAX_STOP_TOKEN_IDS} are allowed",
                    stop_token_ids.len()
                ),
                Some("stop_token_ids"),
            ));
        }
        let min_tokens = usize::try_from(self.min_tokens.unwrap_or(0)).unwrap_or(usize::MAX);
        if let Some(max) = max_tokens
            && min_tokens as u64 > max
        {
            return Err(out_of_range("min_tokens", min_tokens, "[0, max_tokens]"));
        }

        let max_tokens = match max_tokens {
            None => None,
            Some(0) => {
                return Err(ApiError::invalid(
                    "`max_tokens` must be at least 1",
                    Some("max_tokens"),
                ));
            }
            Some(n) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
        };
        let n = self.n.unwrap_or(1);
        if n == 0 || n > max_n as u64 {
            return Err(ApiError::invalid(
                format!("`n` = {n} is outside [1, {max_n}]"),
                Some("n"),
            ));
        }
        let stop = match &self.stop {
            None => Vec::new(),
            Some(StopField::One(s)) => vec![s.clone()],
            Some(StopField::Many(list)) => list.clone(),
        };
        if stop.len() > MAX_STOP_STRINGS {
            return Err(ApiError::invalid(
                format!(
                    "`stop` has {} strings; at most {MAX_STOP_STRINGS} are allowed",
                    stop.len()
                ),
                Some("stop"),
            ));
        }
        if stop.iter().any(String::is_empty) {
            return Err(ApiError::invalid(
                "`stop` strings must not be empty",
                Some("stop"),
            ));
        }
        let stream = self.stream.unwrap_or(false);
        let include_usage = match &self.stream_options {
            None => false,
            Some(_) if !stream => {
                return Err(ApiError::invalid(
                    "`stream_options` is only allowed when `stream` is true",
                    Some("stream_options"),
                ));
            }
            Some(options) => options.include_usage.unwrap_or(false),
        };
        Ok(Sampling {
            max_tokens,
            // Negative seeds are valid OpenAI seeds: reinterpret the bits.
            seed: self.seed.map(|s| s as u64),
            stop,
            n: n as usize,
            stream,
            include_usage,
            params,
            logprobs,
            stop_token_ids,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            min_tokens,
            echo: false,
            prompt_only: false,
            constraint: None,
            constraint_param: "response_format",
            tools: Vec::new(),
            tool_format: None,
            adapter: None,
        })
    }

    /// The sampling controls of the body, read once into the one value the engine
    /// carries, and checked by [`SamplingParams::validate`] (every error names its
    /// field). Only what the wire format adds is checked here: OpenAI's narrower ranges
    /// (temperature and repetition penalty at most 2), vLLM's `top_k: -1`, and the
    /// `logit_bias` map's keys and values being token ids and numbers. A new control is
    /// one line here (and its field in [`CommonFields`]).
    fn params(&self, endpoint: Endpoint) -> Result<SamplingParams, ApiError> {
        let mut params = SamplingParams::default();
        if let Some(t) = self.temperature {
            if t > 2.0 {
                return Err(out_of_range("temperature", t, "[0, 2]"));
            }
            params.temperature = t;
        }
        if let Some(p) = self.top_p {
            params.top_p = p;
        }
        if let Some(k) = self.top_k {
            params.top_k = match k {
                -1 | 0 => 0,
                k if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
                k => return Err(out_of_range("top_k", k, "-1 (off), 0 (off) or >= 1")),
            };
        }
        if let Some(p) = self.min_p {
            params.min_p = p;
        }
        if let Some(r) = self.repetition_penalty {
            if r > 2.0 {
                return Err(out_of_range("repetition_penalty", r, "(0, 2]"));
            }
            params.repetition_penalty = r as f32;
        }
        if let Some(f) = self.frequency_penalty {
            params.frequency_penalty = f as f32;
        }
        if let Some(p) = self.presence_penalty {
            params.presence_penalty = p as f32;
        }
        if let Some(bias) = &self.logit_bias {
            params.logit_bias = logit_bias(bias)?;
        }
        params
            .validate()
            .map_err(|e| ApiError::from_llama(&e, endpoint.prompt_param()))?;
        Ok(params)
    }

    /// `logprobs` and `top_logprobs` as `endpoint` reads them: chat `logprobs: true` with
    /// `top_logprobs` 0-20; completions `logprobs` 0-5. `None`: no log-probabilities.
    fn logprobs(&self, endpoint: Endpoint) -> Result<Option<usize>, ApiError> {
        let logprobs = self.logprobs.as_ref().filter(|v| !v.is_null());
        match endpoint {
            Endpoint::Chat => {
                let on = match logprobs {
                    None => false,
                    Some(Value::Bool(b)) => *b,
                    Some(_) => {
                        return Err(ApiError::invalid(
                            "`logprobs` must be a boolean",
                            Some("logprobs"),
                        ));
                    }
                };
                match (on, self.top_logprobs) {
                    (_, Some(n)) if n > 20 => Err(out_of_range("top_logprobs", n, "[0, 20]")),
                    (false, Some(n)) if n > 0 => Err(ApiError::invalid(
                        "`top_logprobs` needs `logprobs` set to true",
                        Some("top_logprobs"),
                    )),
                    (false, _) => Ok(None),
                    (true, n) => Ok(Some(n.unwrap_or(0) as usize)),
                }
            }
            Endpoint::Completions => match logprobs {
                None => Ok(None),
                Some(v) => match v.as_u64() {
                    Some(n) if n <= 5 => Ok(Some(n as usize)),
                    _ => Err(out_of_range("logprobs", v, "[0, 5]")),
                },
            },
        }
    }
}

impl ChatCompletionRequest {
    /// The conversation as chat messages, checked.
    pub fn conversation(&self) -> Result<Vec<ChatMessage>, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::invalid(
                "`messages` must not be empty",
                Some("messages"),
            ));
        }
        self.messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let role = match m.role.as_str() {
                    "system" | "developer" => "system",
                    "user" => "user",
                    "assistant" => "assistant",
                    "tool" => "tool",
                    other => {
                        return Err(ApiError::invalid(
                            format!(
                                "`messages[{i}].role` = `{other}` is not supported (system, \
                                 developer, user, assistant or tool)"
                            ),
                            Some(&format!("messages[{i}].role")),
                        ));
                    }
                };
                let content = match &m.content {
                    Some(MessageContent::Text(text)) => text.clone(),
                    Some(MessageContent::Parts(parts)) => parts
                        .iter()
                        .map(|ContentPart::Text { text }| text.as_str())
                        .collect::<Vec<_>>()
                        .join("\n"),
                    None if role == "assistant" => String::new(),
                    None => {
                        return Err(ApiError::invalid(
                            format!("`messages[{i}].content` is required"),
                            Some(&format!("messages[{i}].content")),
                        ));
                    }
                };
                let mut message = ChatMessage::new(role, content);
                if let Some(calls) = &m.tool_calls {
                    if role != "assistant" {
                        return Err(ApiError::invalid(
                            format!("`messages[{i}].tool_calls` is for assistant messages"),
                            Some(&format!("messages[{i}].tool_calls")),
                        ));
                    }
                    message.tool_calls = calls
                        .iter()
                        .enumerate()
                        .map(|(j, call)| tool_call(i, j, call))
                        .collect::<Result<_, _>>()?;
                }
                if role == "tool" {
                    message.tool_call_id = m.tool_call_id.clone();
                }
                Ok(message)
            })
            .collect()
    }

    /// `max_completion_tokens`, else `max_tokens`.
    pub fn max_tokens(&self) -> Option<u64> {
        self.max_completion_tokens.or(self.common.max_tokens)
    }
}

/// Call `j` of message `i`'s `tool_calls`, checked.
fn tool_call(i: usize, j: usize, call: &RequestToolCall) -> Result<ToolCall, ApiError> {
    let param = format!("messages[{i}].tool_calls[{j}]");
    if call.kind.as_deref().is_some_and(|k| k != "function") {
        return Err(ApiError::invalid(
            format!("`{param}.type` must be `function`"),
            Some(&format!("{param}.type")),
        ));
    }
    let arguments = match &call.function.arguments {
        Value::String(text) => text.clone(),
        Value::Null => "{}".to_string(),
        other => other.to_string(),
    };
    Ok(ToolCall {
        id: call.id.clone().unwrap_or_else(crate::tools::new_call_id),
        name: call.function.name.clone(),
        arguments,
    })
}

impl CompletionRequest {
    /// The prompts, checked.
    pub fn prompts(&self) -> Result<Vec<PromptInput>, ApiError> {
        refuse_unsupported("suffix", &self.suffix, &[])?;
        refuse_unsupported("best_of", &self.best_of, &[Value::from(1)])?;
        let prompts: Vec<PromptInput> = match &self.prompt {
            PromptField::Text(text) => vec![PromptInput::Text(text.clone())],
            PromptField::Texts(texts) => texts.iter().cloned().map(PromptInput::Text).collect(),
            PromptField::Ids(ids) => vec![PromptInput::Ids(ids.clone())],
            PromptField::IdLists(lists) => lists.iter().cloned().map(PromptInput::Ids).collect(),
        };
        if prompts.is_empty() {
            return Err(ApiError::invalid(
                "`prompt` must not be an empty list",
                Some("prompt"),
            ));
        }
        let empty = prompts.iter().any(|p| match p {
            PromptInput::Text(t) => t.is_empty(),
            PromptInput::Ids(ids) => ids.is_empty(),
            PromptInput::Chat(_) => false,
        });
        if empty {
            return Err(ApiError::invalid(
                "`prompt` must not be empty",
                Some("prompt"),
            ));
        }
        Ok(prompts)
    }
}

/// Token counts of a request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Usage {
    /// Prompt tokens (each prompt counted once, whatever `n`).
    pub prompt_tokens: usize,
    /// Generated tokens over all choices.
    pub completion_tokens: usize,
    /// The sum of both.
    pub total_tokens: usize,
    /// Of the prompt tokens, those read from the prefix cache.
    #[serde(default)]
    pub prompt_tokens_details: CachedTokens,
}

/// `prompt_tokens_details` (chat and text completions) and `input_tokens_details`
/// (responses).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct CachedTokens {
    /// Prompt tokens read from the engine's prefix cache instead of computed: whole
    /// blocks of a prefix an earlier request computed (never the prompt's last token).
    /// For a prompt with several choices (`n`), the fewest any of its choices read.
    pub cached_tokens: usize,
}

/// Which endpoint a response is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completions,
}

impl Endpoint {
    /// The field a prompt comes from, for errors.
    pub fn prompt_param(self) -> &'static str {
        match self {
            Endpoint::Chat => "messages",
            Endpoint::Completions => "prompt",
        }
    }

    /// The prefix of response ids.
    pub fn id_prefix(self) -> &'static str {
        match self {
            Endpoint::Chat => "chatcmpl-",
            Endpoint::Completions => "cmpl-",
        }
    }

    /// The `object` of a whole response.
    pub fn object(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat.completion",
            Endpoint::Completions => "text_completion",
        }
    }

    /// The `object` of a stream chunk.
    pub fn chunk_object(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completions => "text_completion",
        }
    }
}

/// A log-probability as OpenAI writes it: -9999.0 for minus infinity.
fn wire_logprob(lp: f32) -> f64 {
    if lp.is_finite() {
        f64::from(lp)
    } else {
        -9999.0
    }
}

/// A token's text (invalid UTF-8 replaced).
fn token_text(t: &TokenLogprob) -> String {
    String::from_utf8_lossy(&t.bytes).into_owned()
}

/// A chat choice's `logprobs`: each token's text, log-probability, bytes and top
/// alternatives.
pub fn chat_logprobs(entries: &[(TokenLogprobs, usize)]) -> ChatLogprobs {
    let top = |t: &TokenLogprob| TopLogprob {
        token: token_text(t),
        logprob: wire_logprob(t.logprob),
        bytes: t.bytes.clone(),
    };
    ChatLogprobs {
        content: entries
            .iter()
            .map(|(lp, _)| ChatTokenLogprob {
                token: token_text(&lp.chosen),
                logprob: wire_logprob(lp.chosen.logprob),
                bytes: lp.chosen.bytes.clone(),
                top_logprobs: lp.top.iter().map(top).collect(),
            })
            .collect(),
        refusal: None,
    }
}

/// A text choice's `logprobs` in the legacy shape: `tokens`, `token_logprobs`,
/// `top_logprobs` (`{token: logprob}`) and `text_offset` (each token's character offset
/// in the choice's text). The first token of an echoed prompt has none (null).
pub fn text_logprobs(entries: &[(TokenLogprobs, usize)]) -> TextLogprobs {
    let known = |lp: &TokenLogprobs| !lp.chosen.logprob.is_nan();
    TextLogprobs {
        tokens: entries
            .iter()
            .map(|(lp, _)| token_text(&lp.chosen))
            .collect(),
        token_logprobs: entries
            .iter()
            .map(|(lp, _)| known(lp).then(|| wire_logprob(lp.chosen.logprob)))
            .collect(),
        top_logprobs: entries
            .iter()
            .map(|(lp, _)| {
                known(lp).then(|| {
                    lp.top
                        .iter()
                        .map(|t| (token_text(t), wire_logprob(t.logprob).into()))
                        .collect()
                })
            })
            .collect(),
        text_offset: entries.iter().map(|&(_, o)| o).collect(),
    }
}

/// A chat choice of a whole response: its text, or its tool calls (`content` then null
/// unless there is text besides them).
pub fn chat_choice(
    index: usize,
    text: &str,
    calls: &[ToolCall],
    finish_reason: &'static str,
    logprobs: Option<ChatLogprobs>,
) -> ChatChoice {
    let content = match calls.is_empty() || !text.trim().is_empty() {
        true => Some(text.to_string()),
        false => None,
    };
    let tool_calls = calls
        .iter()
        .map(|c| ToolCallObject {
            id: c.id.clone(),
            kind: "function",
            function: FunctionCallObject {
                name: c.name.clone(),
                arguments: c.arguments.clone(),
            },
        })
        .collect();
    ChatChoice {
        index,
        message: AssistantMessage {
            role: "assistant",
            content,
            tool_calls,
        },
        logprobs,
        finish_reason,
    }
}

/// The chat delta of one [`ToolCallEvent`]: text as `content`; a call's start as its
/// index, id, type and name (with empty arguments); then argument fragments, as OpenAI
/// streams `tool_calls`.
pub fn tool_delta(event: &ToolCallEvent) -> ChatDelta {
    let call = match event {
        ToolCallEvent::Content(text) => {
            return ChatDelta {
                content: Some(text.clone()),
                ..ChatDelta::default()
            };
        }
        ToolCallEvent::Start { index, id, name } => DeltaToolCall {
            index: *index,
            id: Some(id.clone()),
            kind: Some("function"),
            function: DeltaFunction {
                name: Some(name.clone()),
                arguments: String::new(),
            },
        },
        ToolCallEvent::Arguments { index, fragment } => DeltaToolCall {
            index: *index,
            id: None,
            kind: None,
            function: DeltaFunction {
                name: None,
                arguments: fragment.clone(),
            },
        },
    };
    ChatDelta {
        tool_calls: vec![call],
        ..ChatDelta::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(json: &str) -> Result<ChatCompletionRequest, ApiError> {
        parse_request(json.as_bytes())
    }

    #[test]
    fn parses_content_forms_and_ignores_unknown_fields() {
        let r = chat(
            r#"{"model":"m","messages":[{"role":"developer","content":"Be brief."},
                {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},
                {"role":"assistant","content":null}],"whatever":{"x":1},"user":"u"}"#,
        )
        .unwrap();
        let messages = r.conversation().unwrap();
        assert_eq!(
            messages,
            vec![
                ChatMessage::system("Be brief."),
                ChatMessage::user("a\nb"),
                ChatMessage::assistant("")
            ]
        );
        let s = r
            .common
            .sampling(Endpoint::Chat, r.max_tokens(), 8)
            .unwrap();
        assert_eq!(s.params.temperature, 1.0);
        assert_eq!(s.n, 1);
        assert!(!s.stream);
    }

    #[test]
    fn refuses_wrong_types_and_values() {
        // Each refused body with the field its error must name (a 400 of OpenAI's
        // `invalid_request_error`): every mismatch is listed, not only the first.
        let bad = [
            (r#""temperature":2.5"#, "temperature"),
            (r#""top_p":0"#, "top_p"),
            (r#""n":0"#, "n"),
            (r#""max_tokens":0"#, "max_tokens"),
            (r#""stop":["a","b","c","d","e"]"#, "stop"),
            (r#""stop":"""#, "stop"),
            (
                r#""stream_options":{"include_usage":true}"#,
                "stream_options",
            ),
            (r#""top_logprobs":3"#, "top_logprobs"),
            (r#""logprobs":true,"top_logprobs":21"#, "top_logprobs"),
            (r#""logprobs":3"#, "logprobs"),
            (r#""frequency_penalty":2.5"#, "frequency_penalty"),
            (r#""presence_penalty":-3"#, "presence_penalty"),
            (r#""logit_bias":{"5":101}"#, "logit_bias"),
            (r#""logit_bias":{"x":1}"#, "logit_bias"),
            (r#""top_k":-2"#, "top_k"),
            (r#""min_p":1.5"#, "min_p"),
            (r#""repetition_penalty":0"#, "repetition_penalty"),
            (r#""max_tokens":3,"min_tokens":4"#, "min_tokens"),
        ];
        let named = |e: &ApiError| {
            (
                e.status.as_u16(),
                e.kind,
                e.param.clone().unwrap_or_default(),
            )
        };
        let mut wrong = Vec::new();
        for (fields, param) in bad {
            let json = format!(r#"{{"messages":[{{"role":"user","content":"x"}}],{fields}}}"#);
            let got = match chat(&json) {
                Err(e) => named(&e),
                Ok(r) => match r.common.sampling(Endpoint::Chat, r.max_tokens(), 8) {
                    Err(e) => named(&e),
                    Ok(_) => (200, "", String::new()),
                },
            };
            if got != (400, "invalid_request_error", param.to_string()) {
                wrong.push(format!("{fields}: {got:?}, want 400 naming {param}"));
            }
        }
        for (json, param) in [
            (
                r#"{"messages":[{"role":"user","content":"x"}],"temperature":"hot"}"#,
                "temperature",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":-1}"#,
                "max_tokens",
            ),
            (r#"{"messages":"hi"}"#, "messages"),
            (
                r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{}}]}]}"#,
                "messages[0].content",
            ),
            (r#"{"messages":[]}"#, "messages"),
            (
                r#"{"messages":[{"role":"robot","content":"x"}]}"#,
                "messages[0].role",
            ),
            (
                r#"{"messages":[{"role":"user","content":null}]}"#,
                "messages[0].content",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x","tool_calls":[]}]}"#,
                "messages[0].tool_calls",
            ),
        ] {
            let got = match chat(json).map(|r| r.conversation()) {
                Err(e) | Ok(Err(e)) => named(&e),
                Ok(Ok(_)) => (200, "", String::new()),
            };
            if got != (400, "invalid_request_error", param.to_string()) {
                wrong.push(format!("{json}: {got:?}, want 400 naming {param}"));
            }
        }
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    }

    #[test]
    fn every_sampling_control_is_read_and_errors_name_the_field() {
        let r = chat(
            r#"{"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":5,
                "frequency_penalty":0.5,"presence_penalty":-0.5,"logit_bias":{"7":-100,"3":2.5},
                "top_k":40,"min_p":0.1,"repetition_penalty":1.2,"stop_token_ids":[2],
                "ignore_eos":true,"min_tokens":2,"max_tokens":9,"seed":-1}"#,
        )
        .unwrap();
        let s = r
            .common
            .sampling(Endpoint::Chat, r.max_tokens(), 8)
            .unwrap();
        assert_eq!(s.logprobs, Some(5));
        assert_eq!(s.params.frequency_penalty, 0.5);
        assert_eq!(s.params.presence_penalty, -0.5);
        assert_eq!(s.params.logit_bias, vec![(3, 2.5), (7, -100.0)]);
        assert_eq!((s.params.top_k, s.params.min_p), (40, 0.1));
        assert_eq!(s.params.repetition_penalty, 1.2);
        assert_eq!(s.stop_token_ids, vec![2]);
        assert!(s.ignore_eos);
        assert_eq!(s.min_tokens, 2);
        assert_eq!(s.seed, Some(u64::MAX));
        let completions = |json: &str| {
            let r = parse_request::<CompletionRequest>(json.as_bytes()).unwrap();
            r.common
                .sampling(Endpoint::Completions, r.common.max_tokens, 8)
        };
        assert_eq!(
            completions(r#"{"prompt":"a","logprobs":5}"#)
                .unwrap()
                .logprobs,
            Some(5)
        );
        assert_eq!(
            completions(r#"{"prompt":"a","logprobs":0}"#)
                .unwrap()
                .logprobs,
            Some(0)
        );
        assert_eq!(completions(r#"{"prompt":"a"}"#).unwrap().logprobs, None);
        for (json, field) in [
            (r#"{"prompt":"a","logprobs":6}"#, "logprobs"),
            (r#"{"prompt":"a","logprobs":true}"#, "logprobs"),
            (r#"{"prompt":"a","top_k":-5}"#, "top_k"),
            (
                r#"{"prompt":"a","frequency_penalty":3}"#,
                "frequency_penalty",
            ),
            (r#"{"prompt":"a","logit_bias":{"1":-101}}"#, "logit_bias"),
        ] {
            let e = completions(json).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{json}");
        }
        // One token under three spellings would add three biases up past +-100.
        for key in ["01", "+1", " 1", "1.0", "4294967296"] {
            let body = format!(r#"{{"prompt":"a","logit_bias":{{"1":100,"{key}":100}}}}"#);
            let e = completions(&body).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("logit_bias"), "{body}");
            assert!(e.message.contains(&format!("`{key}`")), "{}", e.message);
        }
        let many: serde_json::Map<String, Value> =
            (0..1025).map(|i| (i.to_string(), Value::from(1))).collect();
        let body = serde_json::json!({"prompt": "a", "logit_bias": many}).to_string();
        // Refused while the body is read (the map stops at its limit).
        let e = parse_request::<CompletionRequest>(body.as_bytes()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("logit_bias"));
    }

    #[test]
    fn the_body_becomes_one_sampling_params() {
        let r = chat(
            r#"{"messages":[{"role":"user","content":"x"}],"temperature":0.3,"top_p":0.8,
                "top_k":-1,"min_p":0.2,"frequency_penalty":1,"logit_bias":{"9":1,"2":-1}}"#,
        )
        .unwrap();
        let s = r
            .common
            .sampling(Endpoint::Chat, r.max_tokens(), 8)
            .unwrap();
        assert_eq!(
            s.params,
            SamplingParams {
                temperature: 0.3,
                top_p: 0.8,
                top_k: 0,
                min_p: 0.2,
                frequency_penalty: 1.0,
                logit_bias: vec![(2, -1.0), (9, 1.0)],
                ..SamplingParams::default()
            }
        );
        // The ranges are `SamplingParams::validate`'s (and OpenAI's narrower ones), each
        // error naming its field.
        for (json, field) in [
            (r#""temperature":-0.5"#, "temperature"),
            (r#""temperature":2.5"#, "temperature"),
            (r#""top_p":1.5"#, "top_p"),
            (r#""min_p":-0.1"#, "min_p"),
            (r#""repetition_penalty":2.5"#, "repetition_penalty"),
            (r#""repetition_penalty":-1"#, "repetition_penalty"),
            (r#""presence_penalty":2.5"#, "presence_penalty"),
        ] {
            let r = chat(&format!(
                r#"{{"messages":[{{"role":"user","content":"x"}}],{json}}}"#
            ))
            .unwrap();
            let e = r
                .common
                .sampling(Endpoint::Chat, r.max_tokens(), 8)
                .unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{json}");
        }
    }

    #[test]
    fn large_fields_are_refused_without_being_kept() {
        // Fields that only a scalar satisfies: a large array is read past and refused as
        // the value itself would be.
        let many = format!("[{}0]", "0,".repeat(100_000));
        for (field, message) in [
            ("best_of", "not supported"),
            ("suffix", "not supported"),
            ("logprobs", "`logprobs`"),
        ] {
            let body = format!(r#"{{"prompt":"a","{field}":{many}}}"#);
            let r = parse_request::<CompletionRequest>(body.as_bytes()).unwrap();
            let e = match field {
                "logprobs" => r
                    .common
                    .sampling(Endpoint::Completions, r.common.max_tokens, 8)
                    .unwrap_err(),
                _ => r.prompts().unwrap_err(),
            };
            assert_eq!(e.param.as_deref(), Some(field), "{}", e.message);
            assert!(e.message.contains(message), "{}", e.message);
        }
        // `logit_bias`: read up to its limit, refused at the first key past it.
        let keys = |n: usize| {
            (0..n)
                .map(|i| format!(r#""{i}":1"#))
                .collect::<Vec<_>>()
                .join(",")
        };
        let body = format!(r#"{{"prompt":"a","logit_bias":{{{}}}}}"#, keys(1024));
        let r = parse_request::<CompletionRequest>(body.as_bytes()).unwrap();
        assert_eq!(r.common.logit_bias.map(|b| b.len()), Some(1024));
        let body = format!(r#"{{"prompt":"a","logit_bias":{{{}}}}}"#, keys(200_000));
        let e = parse_request::<CompletionRequest>(body.as_bytes()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("logit_bias"));
        assert!(
            e.message.contains("more than 1024 entries"),
            "{}",
            e.message
        );
        // The body's own errors are unchanged.
        let e = parse_request::<CompletionRequest>(b"[1]").unwrap_err();
        assert!(e.message.contains("must be a JSON object"), "{}", e.message);
        let e = parse_request::<CompletionRequest>(br#"{"prompt":"a","#).unwrap_err();
        assert!(e.message.contains("not valid JSON"), "{}", e.message);
    }

    #[test]
    fn logprobs_shapes() {
        let entry = TokenLogprobs {
            chosen: TokenLogprob {
                token_id: 5,
                logprob: -0.5,
                bytes: b"hi".to_vec(),
            },
            top: vec![
                TokenLogprob {
                    token_id: 5,
                    logprob: -0.5,
                    bytes: b"hi".to_vec(),
                },
                TokenLogprob {
                    token_id: 6,
                    logprob: f32::NEG_INFINITY,
                    bytes: b" x".to_vec(),
                },
            ],
        };
        let chat = serde_json::to_value(chat_logprobs(&[(entry.clone(), 0)])).unwrap();
        assert_eq!(chat["content"][0]["token"], "hi");
        assert_eq!(chat["content"][0]["logprob"], -0.5);
        assert_eq!(chat["content"][0]["bytes"], serde_json::json!([104, 105]));
        assert_eq!(chat["content"][0]["top_logprobs"][1]["logprob"], -9999.0);
        assert!(chat["refusal"].is_null());
        let c = serde_json::to_value(text_logprobs(&[(entry, 0)])).unwrap();
        assert_eq!(c["tokens"], serde_json::json!(["hi"]));
        assert_eq!(c["token_logprobs"], serde_json::json!([-0.5]));
        assert_eq!(c["top_logprobs"][0][" x"], -9999.0);
        assert_eq!(c["text_offset"], serde_json::json!([0]));
    }

    #[test]
    fn max_completion_tokens_wins() {
        let r = chat(
            r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":5,"max_completion_tokens":7}"#,
        )
        .unwrap();
        assert_eq!(r.max_tokens(), Some(7));
    }

    #[test]
    fn prompt_forms() {
        let parse = |json: &str| {
            parse_request::<CompletionRequest>(json.as_bytes())
                .unwrap()
                .prompts()
        };
        assert_eq!(
            parse(r#"{"prompt":"a"}"#).unwrap(),
            vec![PromptInput::Text("a".into())]
        );
        assert_eq!(parse(r#"{"prompt":["a","b"]}"#).unwrap().len(), 2);
        assert_eq!(
            parse(r#"{"prompt":[1,2]}"#).unwrap(),
            vec![PromptInput::Ids(vec![1, 2])]
        );
        assert_eq!(parse(r#"{"prompt":[[1],[2]]}"#).unwrap().len(), 2);
        let param = |r: Result<Vec<PromptInput>, ApiError>| r.unwrap_err().param;
        assert_eq!(param(parse(r#"{"prompt":""}"#)).as_deref(), Some("prompt"));
        assert_eq!(param(parse(r#"{"prompt":[]}"#)).as_deref(), Some("prompt"));
        assert!(parse(r#"{"prompt":"a","echo":true}"#).is_ok());
        // Token ids echo too (as evaluation harnesses send them).
        assert!(parse(r#"{"prompt":[[1,2],[3]],"echo":true}"#).is_ok());
        assert!(parse(r#"{"prompt":"a","echo":false,"best_of":1}"#).is_ok());
        let e = parse_request::<CompletionRequest>(br#"{"prompt":5}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
        let e = parse_request::<CompletionRequest>(br#"{"prompt":"a","top_p":"x"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("top_p"));
        // Not an object, and trailing bytes: a 400 that names no field.
        for body in [&b"[1]"[..], br#"{"prompt":"a"} x"#] {
            let e = parse_request::<CompletionRequest>(body).unwrap_err();
            assert_eq!((e.status.as_u16(), e.param), (400, None), "{body:?}");
        }
    }

    #[test]
    fn choice_and_delta_shapes() {
        let json = |v: &dyn erased::Json| v.json();
        // A plain answer: text content and no `tool_calls` key.
        let c = json(&chat_choice(1, "hi", &[], "stop", None));
        assert_eq!(c["message"]["content"], "hi");
        assert!(c["message"].get("tool_calls").is_none());
        assert!(c["logprobs"].is_null());
        // Calls alone: null content; text besides them stays.
        let call = ToolCall {
            id: "call_1".into(),
            name: "f".into(),
            arguments: "{}".into(),
        };
        let c = json(&chat_choice(
            0,
            " ",
            std::slice::from_ref(&call),
            "tool_calls",
            None,
        ));
        assert!(c["message"]["content"].is_null());
        assert_eq!(c["message"]["tool_calls"][0]["type"], "function");
        assert_eq!(c["message"]["tool_calls"][0]["function"]["arguments"], "{}");
        let c = json(&chat_choice(0, "x", &[call], "tool_calls", None));
        assert_eq!(c["message"]["content"], "x");
        // Deltas: a call's start has id, type and name; its fragments only arguments.
        let start = ToolCallEvent::Start {
            index: 0,
            id: "call_1".into(),
            name: "f".into(),
        };
        let d = json(&tool_delta(&start));
        assert_eq!(d["tool_calls"][0]["function"]["name"], "f");
        assert_eq!(d["tool_calls"][0]["function"]["arguments"], "");
        assert!(d.get("content").is_none());
        let fragment = ToolCallEvent::Arguments {
            index: 0,
            fragment: "{\"a\"".into(),
        };
        let d = json(&tool_delta(&fragment));
        assert_eq!(
            d,
            serde_json::json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\""}}]})
        );
        assert_eq!(
            json(&tool_delta(&ToolCallEvent::Content("t".into()))),
            serde_json::json!({"content": "t"})
        );
        assert_eq!(json(&ChatDelta::default()), serde_json::json!({}));
    }

    /// Serializes the typed answers for the shape checks.
    mod erased {
        pub trait Json {
            fn json(&self) -> serde_json::Value;
        }
        impl<T: serde::Serialize> Json for T {
            fn json(&self) -> serde_json::Value {
                serde_json::to_value(self).unwrap()
            }
        }
    }
}
