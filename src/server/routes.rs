//! The HTTP routes: request parsing, authentication, the completion endpoints (whole
//! and streamed), models, health and metrics, and one log line per request.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json};
use futures_util::stream::{self, Stream};
use serde_json::{Value, json};

use super::Shared;
use super::error::ApiError;
use super::generation::{ChoiceSpec, Generation, Update};
use super::openai::{
    ChatCompletionRequest, CompletionRequest, Endpoint, OpenAiRequest, PromptInput, Sampling,
    Usage, parse_request,
};
use crate::inference::GenerateRequest;
use crate::sampling::TokenLogprobs;

type AppState = State<Arc<Shared>>;

pub(super) fn router(shared: Arc<Shared>) -> Router {
    let limit = shared.config.max_body_bytes;
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{*id}", get(get_model))
        .route_layer(middleware::from_fn_with_state(shared.clone(), authorize))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(limit))
        .layer(middleware::from_fn(log_request))
        .with_state(shared)
}

/// Logs one line per request; the completion endpoints log their own line when the
/// answer is complete (with token counts), unless they fail early.
async fn log_request(mut request: Request, next: Next) -> Response {
    let method = request.method().clone();
    let path = request.uri().path().to_string();
    // Read once here; the completion handlers take it from the request's extensions.
    let id = ClientRequestId(client_request_id(request.headers()));
    let request_id = id.0.clone().unwrap_or_default();
    request.extensions_mut().insert(id);
    let start = Instant::now();
    let response = next.run(request).await;
    let status = response.status();
    let generation = path.ends_with("/completions");
    if !(generation && status.is_success()) {
        tracing::info!(
            %method,
            path = path.as_str(),
            status = status.as_u16(),
            request_id = request_id.as_str(),
            ms = start.elapsed().as_millis() as u64,
            "request"
        );
    }
    response
}

/// The client's well-formed `X-Request-Id`, if any ([`client_request_id`]), as the
/// logging middleware found it.
#[derive(Clone)]
struct ClientRequestId(Option<String>);

/// The client's `X-Request-Id`, if it is 1 to 128 characters of `[A-Za-z0-9._:-]` (so
/// that it is safe to log and to send back). A balancer or gateway that sets it can match
/// its own log lines to the replica's.
fn client_request_id(headers: &HeaderMap) -> Option<String> {
    let id = headers.get("x-request-id")?.to_str().ok()?;
    let safe = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-');
    ((1..=128).contains(&id.len()) && id.chars().all(safe)).then(|| id.to_string())
}

/// Compares in time independent of where the strings differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// `/v1/*`: checks the API key.
async fn authorize(State(shared): AppState, request: Request, next: Next) -> Response {
    if let Some(key) = &shared.config.api_key {
        let given = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim());
        if !given.is_some_and(|g| constant_time_eq(g.as_bytes(), key.as_bytes())) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(request).await
}

async fn not_found(request: Request) -> ApiError {
    ApiError::route_not_found(request.uri().path())
}

async fn health(State(shared): AppState) -> Response {
    let status = if shared.shutting_down.load(Ordering::Acquire) {
        "shutting_down"
    } else if shared.engine.get().is_none() {
        "loading"
    } else {
        return Json(json!({"status": "ok"})).into_response();
    };
    (
        StatusCode::SERVICE_UNAVAILABLE,
        Json(json!({ "status": status })),
    )
        .into_response()
}

async fn metrics(State(shared): AppState) -> Response {
    let engine = shared.engine.get().map(|e| e.metrics());
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        shared.metrics.render(engine.as_ref()),
    )
        .into_response()
}

fn model_object(shared: &Shared) -> Value {
    json!({
        "id": shared.config.served_model_name,
        "object": "model",
        "created": shared.created,
        "owned_by": "llama-burn",
    })
}

async fn list_models(State(shared): AppState) -> Response {
    Json(json!({"object": "list", "data": [model_object(&shared)]})).into_response()
}

async fn get_model(State(shared): AppState, Path(id): Path<String>) -> Response {
    if id == shared.config.served_model_name {
        Json(model_object(&shared)).into_response()
    } else {
        ApiError::model_not_found(&id, &shared.config.served_model_name).into_response()
    }
}

/// Parses a JSON body whatever its content type: 413 over the limit, 400 for malformed
/// JSON or a field of the wrong type (naming the field).
fn parse_body<T: OpenAiRequest>(
    shared: &Shared,
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let body = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(shared.config.max_body_bytes)
        } else {
            ApiError::invalid(format!("could not read the body: {rejection}"), None)
        }
    })?;
    parse_request(&body)
}

fn check_model(shared: &Shared, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != shared.config.served_model_name => Err(ApiError::model_not_found(
            m,
            &shared.config.served_model_name,
        )),
        _ => Ok(()),
    }
}

async fn chat_completions(
    State(shared): AppState,
    Extension(ClientRequestId(request_id)): Extension<ClientRequestId>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let request: ChatCompletionRequest = parse_body(&shared, body)?;
    check_model(&shared, request.common.model.as_deref())?;
    let messages = request.conversation()?;
    let sampling =
        request
            .common
            .sampling(Endpoint::Chat, request.max_tokens(), shared.config.max_n)?;
    let default_max = shared.config.default_max_tokens;
    run(
        shared,
        Endpoint::Chat,
        vec![PromptInput::Chat(messages)],
        sampling,
        default_max,
        request_id,
    )
    .await
}

async fn completions(
    State(shared): AppState,
    Extension(ClientRequestId(request_id)): Extension<ClientRequestId>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let request: CompletionRequest = parse_body(&shared, body)?;
    check_model(&shared, request.common.model.as_deref())?;
    let prompts = request.prompts()?;
    let echo = request.echo.unwrap_or(false);
    // `max_tokens: 0` with `echo` asks for the prompt alone: one token is generated and
    // left out.
    let prompt_only = echo && request.common.max_tokens == Some(0);
    let max_tokens = match prompt_only {
        true => Some(1),
        false => request.common.max_tokens,
    };
    let mut sampling =
        request
            .common
            .sampling(Endpoint::Completions, max_tokens, shared.config.max_n)?;
    sampling.echo = echo;
    sampling.prompt_only = prompt_only;
    // OpenAI's default for legacy completions.
    let default_max = Some(shared.config.default_max_tokens.unwrap_or(16));
    run(
        shared,
        Endpoint::Completions,
        prompts,
        sampling,
        default_max,
        request_id,
    )
    .await
}

/// The engine requests of an API request: `n` choices per prompt, choice `i` seeded
/// `seed + i` (`seed`: the request's, or a fresh random one when it gave none).
fn choice_specs(
    prompts: Vec<PromptInput>,
    sampling: &Sampling,
    max_tokens: usize,
    seed: u64,
) -> Vec<ChoiceSpec> {
    let mut specs = Vec::with_capacity(prompts.len() * sampling.n);
    for (p, prompt) in prompts.into_iter().enumerate() {
        for i in 0..sampling.n {
            let request = match &prompt {
                PromptInput::Chat(messages) => GenerateRequest::chat(messages.clone()),
                PromptInput::Text(text) => GenerateRequest::new(text.clone()),
                PromptInput::Ids(ids) => GenerateRequest::from_ids(ids.clone()),
            };
            let mut request = request
                .with_max_tokens(max_tokens)
                .with_sampling(sampling.params.clone())
                .with_seed(seed.wrapping_add(i as u64))
                .with_ignore_eos(sampling.ignore_eos)
                .with_stop_token_ids(sampling.stop_token_ids.clone())
                .with_min_tokens(sampling.min_tokens);
            request.logprobs = sampling.logprobs;
            let echo = match (&prompt, sampling.echo) {
                (PromptInput::Text(text), true) => {
                    request.prompt_logprobs = sampling.logprobs;
                    Some(text.clone())
                }
                _ => None,
            };
            specs.push(ChoiceSpec {
                request,
                echo,
                prompt_only: sampling.prompt_only,
                prompt: p,
                stop: sampling.stop.clone(),
            });
        }
    }
    specs
}

/// What every response and chunk of one request shares.
struct Envelope {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    /// The seed of choice 0 (choice `i` uses `seed + i`): sent back as `seed` and in
    /// `system_fingerprint`, so a sampled answer can be reproduced.
    seed: u64,
    /// Whether the choices carry log-probabilities.
    logprobs: bool,
}

impl Envelope {
    /// The seed as clients send it: OpenAI's `seed` is a signed 64-bit integer, read as
    /// its bits.
    fn client_seed(&self) -> i64 {
        self.seed as i64
    }

    fn fingerprint(&self) -> String {
        format!("llama-burn-seed-{}", self.client_seed())
    }

    /// A choice's `logprobs` value: null unless asked for.
    fn logprobs(&self, entries: &[(TokenLogprobs, usize)]) -> Value {
        if self.logprobs {
            self.endpoint.logprobs(entries)
        } else {
            Value::Null
        }
    }

    fn chunk(&self, choices: Vec<Value>, usage: Option<Option<Usage>>) -> Value {
        let mut chunk = json!({
            "id": self.id,
            "object": self.endpoint.chunk_object(),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint(),
            "seed": self.client_seed(),
            "choices": choices,
        });
        if let (Some(usage), Some(object)) = (usage, chunk.as_object_mut()) {
            object.insert("usage".into(), json!(usage));
        }
        chunk
    }
}

async fn run(
    shared: Arc<Shared>,
    endpoint: Endpoint,
    prompts: Vec<PromptInput>,
    sampling: Sampling,
    default_max_tokens: Option<usize>,
    request_id: Option<String>,
) -> Result<Response, ApiError> {
    let max_seq_len = shared.engine()?.max_seq_len();
    let max_tokens = sampling
        .max_tokens
        .or(default_max_tokens.map(|d| d.min(max_seq_len)))
        .unwrap_or(max_seq_len);
    let seed = sampling.seed.unwrap_or_else(rand::random);
    let specs = choice_specs(prompts, &sampling, max_tokens, seed);
    let envelope = Envelope {
        endpoint,
        id: format!("{}{:032x}", endpoint.id_prefix(), rand::random::<u128>()),
        created: super::unix_now(),
        model: shared.config.served_model_name.clone(),
        seed,
        logprobs: sampling.logprobs.is_some(),
    };
    // The client's id, or else the response's own: the replica's log line carries it,
    // and so does the response.
    let request_id = request_id.unwrap_or_else(|| envelope.id.clone());
    let header_value = HeaderValue::from_str(&request_id).ok();
    let generation = Generation::start(shared, endpoint, specs, request_id).await?;
    let mut response = if sampling.stream {
        let events = sse_events(generation, envelope, sampling.include_usage);
        Sse::new(events)
            .keep_alive(KeepAlive::default())
            .into_response()
    } else {
        whole_response(generation, envelope).await?
    };
    if let Some(value) = header_value {
        response.headers_mut().insert("x-request-id", value);
    }
    Ok(response)
}

/// Waits for every choice and answers with one JSON object. If the client goes away
/// meanwhile, this future is dropped with the generation, which cancels it.
async fn whole_response(
    mut generation: Generation,
    envelope: Envelope,
) -> Result<Response, ApiError> {
    let n = generation.len();
    let mut texts = vec![String::new(); n];
    let mut reasons = vec!["stop"; n];
    let mut logprobs: Vec<Vec<(TokenLogprobs, usize)>> = vec![Vec::new(); n];
    while let Some(update) = generation.next().await {
        match update {
            Update::Text {
                index,
                text,
                logprobs: lp,
            } => {
                texts[index].push_str(&text);
                logprobs[index].extend(lp);
            }
            Update::Finished {
                index,
                text,
                reason,
                logprobs: lp,
            } => {
                texts[index].push_str(&text);
                reasons[index] = reason;
                logprobs[index].extend(lp);
            }
            Update::Failed(error) => return Err(error),
        }
    }
    let endpoint = envelope.endpoint;
    let choices: Vec<Value> = (0..n)
        .map(|i| endpoint.choice(i, &texts[i], reasons[i], envelope.logprobs(&logprobs[i])))
        .collect();
    Ok(Json(json!({
        "id": envelope.id,
        "object": endpoint.object(),
        "created": envelope.created,
        "model": envelope.model,
        "system_fingerprint": envelope.fingerprint(),
        "seed": envelope.client_seed(),
        "choices": choices,
        "usage": generation.usage(),
    }))
    .into_response())
}

struct StreamState {
    generation: Generation,
    envelope: Envelope,
    include_usage: bool,
    queue: VecDeque<Event>,
    done: bool,
}

impl StreamState {
    fn push(&mut self, value: &Value) {
        self.queue
            .push_back(Event::default().data(value.to_string()));
    }

    fn usage_field(&self) -> Option<Option<Usage>> {
        self.include_usage.then_some(None)
    }
}

/// The answer as server-sent events: `data: {chunk}` lines, then `data: [DONE]`. Text
/// that could start a stop string is held back until it is known not to be one.
/// Dropping the stream (the client went away) drops the generation, which cancels it.
fn sse_events(
    generation: Generation,
    envelope: Envelope,
    include_usage: bool,
) -> impl Stream<Item = Result<Event, Infallible>> {
    let mut state = StreamState {
        generation,
        envelope,
        include_usage,
        queue: VecDeque::new(),
        done: false,
    };
    if state.envelope.endpoint == Endpoint::Chat {
        // The first chunk of each choice names the role, as OpenAI's do.
        for index in 0..state.generation.len() {
            let choice = Endpoint::Chat.chunk_choice(index, Some(""), true, None, Value::Null);
            let chunk = state.envelope.chunk(vec![choice], state.usage_field());
            state.push(&chunk);
        }
    }
    stream::unfold(state, |mut state| async move {
        loop {
            if let Some(event) = state.queue.pop_front() {
                return Some((Ok(event), state));
            }
            if state.done {
                return None;
            }
            let endpoint = state.envelope.endpoint;
            match state.generation.next().await {
                Some(Update::Text {
                    index,
                    text,
                    logprobs,
                }) => {
                    let logprobs = state.envelope.logprobs(&logprobs);
                    let choice = endpoint.chunk_choice(index, Some(&text), false, None, logprobs);
                    let chunk = state.envelope.chunk(vec![choice], state.usage_field());
                    state.push(&chunk);
                }
                Some(Update::Finished {
                    index,
                    text,
                    reason,
                    logprobs,
                }) => {
                    let text = (!text.is_empty()).then_some(text.as_str());
                    let logprobs = match logprobs.is_empty() {
                        true => Value::Null,
                        false => state.envelope.logprobs(&logprobs),
                    };
                    let choice = endpoint.chunk_choice(index, text, false, Some(reason), logprobs);
                    let chunk = state.envelope.chunk(vec![choice], state.usage_field());
                    state.push(&chunk);
                }
                Some(Update::Failed(error)) => {
                    // Headers are sent: the error travels as an event, and the stream ends.
                    let body = error.body();
                    state.push(&body);
                    state.done = true;
                }
                None => {
                    if state.include_usage {
                        let usage = state.generation.usage();
                        let chunk = state.envelope.chunk(Vec::new(), Some(Some(usage)));
                        state.push(&chunk);
                    }
                    state.queue.push_back(Event::default().data("[DONE]"));
                    state.done = true;
                }
            }
        }
    })
}
