//! The HTTP routes: request parsing, authentication, the completion endpoints (whole
//! and streamed), models, health and metrics, and one log line per request.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json};
use futures_util::stream::{self, Stream};

use super::error::{ApiError, ErrorBody};
use super::generation::{ChoiceSpec, Generation, Update};
use super::limits::{check_counts, check_depth, check_unique_keys};
use super::openai::{
    ChatCompletionRequest, CompletionRequest, Endpoint, OpenAiRequest, PromptInput, Sampling,
    Usage, chat_choice, chat_logprobs, parse_request, text_logprobs, tool_delta,
};
use super::openapi::{
    ChatCompletionBody, ChatCompletionEvent, CompletionBody, TextCompletionEvent,
};
use super::responses::{
    AdapterStatus, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatDelta, ChatLogprobs,
    Health, ModelList, ModelObject, ResponseHead, TextChoice, TextCompletion, TextCompletionChunk,
    TextLogprobs,
};
use super::structured;
use super::tools;
use super::{ServerConfig, Shared};
use crate::inference::{GenerateRequest, Scope};
use crate::sampling::TokenLogprobs;
use crate::tokenizer::ChatMessage;
use crate::tools::ToolChoice;
use crate::tools::grammar::tool_constraint;
use crate::tools::parse::{ToolCallEvent, ToolCallParser, collect};

type AppState = State<Arc<Shared>>;

pub(super) fn router(shared: Arc<Shared>) -> Router {
    let limit = shared.config.max_body_bytes;
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(super::embeddings::embeddings))
        .route("/v1/responses", post(super::responses_api::create_response))
        .route(
            "/v1/responses/{id}",
            get(super::responses_api::get_response).delete(super::responses_api::delete_response),
        )
        .route("/v1/models", get(list_models))
        .route("/v1/models/{*id}", get(get_model))
        .route_layer(middleware::from_fn_with_state(shared.clone(), authorize))
        .route("/v1/load_lora_adapter", post(load_lora_adapter))
        .route("/v1/unload_lora_adapter", post(unload_lora_adapter))
        .route("/health", get(health))
        .route("/openapi.json", get(super::openapi::openapi_json))
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
pub(super) struct ClientRequestId(pub(super) Option<String>);

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

/// The bearer token of a request, if any.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim())
}

/// Who a request is for: the tenant its API key names, else its connection's peer
/// (see [`ServerConfig::trust_forwarded_for`](super::ServerConfig::trust_forwarded_for)),
/// else nobody (a router served without [`Server::serve`](super::Server::serve)).
#[derive(Clone)]
pub(super) enum Tenant {
    /// An API key's tenant.
    Key(String),
    /// No API keys: the peer's address.
    Peer(std::net::IpAddr),
    /// No API keys and no known peer.
    Anonymous,
}

/// The address a connection comes from ([`Server::serve`](super::Server::serve) adds it
/// to every request of the connection).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Peer(pub std::net::IpAddr);

/// The last address of the last `X-Forwarded-For` header: the one the proxy in front
/// added (earlier ones are the client's to write).
fn forwarded_for(headers: &HeaderMap) -> Option<std::net::IpAddr> {
    headers
        .get_all("x-forwarded-for")
        .iter()
        .next_back()
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.rsplit(',').next())
        .and_then(|a| a.trim().parse().ok())
}

/// `/v1/*`: checks the API key and notes its tenant. Every key is compared (in
/// constant time), so the time taken does not tell which key was nearly right.
async fn authorize(State(shared): AppState, mut request: Request, next: Next) -> Response {
    let mut keys = shared.config.keys().peekable();
    let tenant = if keys.peek().is_some() {
        let given = bearer(request.headers()).unwrap_or("");
        let mut found = None;
        for (name, key) in keys {
            if constant_time_eq(given.as_bytes(), key.as_bytes()) && found.is_none() {
                found = Some(name.to_string());
            }
        }
        let Some(name) = found else {
            return ApiError::unauthorized().into_response();
        };
        Tenant::Key(name)
    } else {
        let peer = request.extensions().get::<Peer>().map(|p| p.0);
        let forwarded = shared
            .config
            .trust_forwarded_for
            .then(|| forwarded_for(request.headers()))
            .flatten();
        match forwarded.or(peer) {
            Some(ip) => Tenant::Peer(ip),
            None => Tenant::Anonymous,
        }
    };
    request.extensions_mut().insert(tenant);
    next.run(request).await
}

async fn not_found(request: Request) -> ApiError {
    ApiError::route_not_found(request.uri().path())
}

/// Whether the server can take requests.
#[utoipa::path(get, path = "/health", tag = "operations", responses(
    (status = 200, description = "The engine is running", body = Health),
    (status = 503, description = "Loading, shutting down, or the engine stopped", body = Health),
))]
pub(super) async fn health(State(shared): AppState) -> Response {
    let status = if shared.shutting_down.load(Ordering::Acquire) {
        "shutting_down"
    } else if shared.engine.get().is_none() {
        "loading"
    } else if shared.engine.get().is_some_and(|e| !e.is_alive()) {
        "engine_stopped"
    } else {
        return Json(Health { status: "ok" }).into_response();
    };
    (StatusCode::SERVICE_UNAVAILABLE, Json(Health { status })).into_response()
}

/// Prometheus metrics (behind `--metrics-key` when one is set).
#[utoipa::path(get, path = "/metrics", tag = "operations", responses(
    (status = 200, description = "Prometheus text format", body = String, content_type = "text/plain"),
    (status = 401, description = "The metrics key is missing or wrong", body = ErrorBody),
), security((), ("bearer" = [])))]
pub(super) async fn metrics(State(shared): AppState, headers: HeaderMap) -> Response {
    if let Some(key) = &shared.config.metrics_key {
        let given = bearer(&headers).unwrap_or("");
        if !constant_time_eq(given.as_bytes(), key.as_bytes()) {
            return ApiError::unauthorized().into_response();
        }
    }
    let engine = shared.engine.get().map(|e| e.metrics());
    shared
        .metrics
        .prompts_tokenized(shared.tokenizer.prompts_tokenized());
    let (bytes, entries) = shared.responses.usage();
    shared.metrics.response_store(bytes, entries);
    // Tenants are named only to whoever holds the metrics key: an open /metrics (the
    // default, for scrapers) would otherwise tell anyone who the API's customers are.
    let tenants = shared.config.metrics_key.is_some();
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        shared.metrics.render(engine.as_ref(), tenants),
    )
        .into_response()
}

fn model_object(shared: &Shared) -> ModelObject {
    ModelObject {
        id: shared.config.served_model_name.clone(),
        object: "model",
        created: shared.created,
        owned_by: "llama-burn",
        parent: None,
        root: None,
    }
}

/// The served model and its LoRA adapters (each with the served model as `parent`).
fn all_models(shared: &Shared) -> Vec<ModelObject> {
    let adapters = shared
        .engine
        .get()
        .map(|e| e.adapters())
        .unwrap_or_default();
    std::iter::once(model_object(shared))
        .chain(adapters.into_iter().map(|a| ModelObject {
            id: a.name,
            parent: Some(shared.config.served_model_name.clone()),
            root: Some(a.source),
            ..model_object(shared)
        }))
        .collect()
}

/// The served model and its LoRA adapters.
#[utoipa::path(get, path = "/v1/models", tag = "models", responses(
    (status = 200, description = "The served model, then its adapters", body = ModelList),
    (status = 401, description = "The API key is missing or wrong", body = ErrorBody),
), security((), ("bearer" = [])))]
pub(super) async fn list_models(State(shared): AppState) -> Response {
    Json(ModelList {
        object: "list",
        data: all_models(&shared),
    })
    .into_response()
}

/// The body of `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's).
#[derive(serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct AdapterRequest {
    /// The name requests will select it by (`model`).
    lora_name: String,
    /// Loading: a PEFT directory or a GGUF LoRA file on the server's disk.
    #[serde(default)]
    lora_path: Option<String>,
}

/// The admin key's check: 403 when the server has none, 401 for a wrong one.
fn admin(shared: &Shared, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &shared.config.admin_key else {
        return Err(ApiError::forbidden(
            "the admin routes are off: start the server with --admin-key",
        ));
    };
    let given = bearer(headers).unwrap_or("");
    if !constant_time_eq(given.as_bytes(), key.as_bytes()) {
        return Err(ApiError::unauthorized());
    }
    Ok(())
}

/// Reads an admin body (small: a name and a path).
async fn adapter_request(shared: &Shared, body: Body) -> Result<AdapterRequest, ApiError> {
    let bytes = read_body(shared, body).await?;
    serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::invalid(format!("the body is not an adapter request: {e}"), None))
}

/// Loads a LoRA adapter from the server's disk and serves it under `lora_name`
/// (replacing one of that name). Behind `--admin-key`.
#[utoipa::path(post, path = "/v1/load_lora_adapter", tag = "admin",
    request_body(content = AdapterRequest, content_type = "application/json"),
    responses(
        (status = 200, description = "The adapter is served", body = AdapterStatus),
        (status = 400, description = "The adapter does not fit the model, or the body is wrong", body = ErrorBody),
        (status = 401, description = "The admin key is missing or wrong", body = ErrorBody),
        (status = 403, description = "The server has no admin key", body = ErrorBody),
        (status = 429, description = "Every held adapter is in use", body = ErrorBody),
        (status = 503, description = "Loading or shutting down", body = ErrorBody),
    ),
    security(("bearer" = [])),
)]
pub(super) async fn load_lora_adapter(
    State(shared): AppState,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    admin(&shared, &headers)?;
    let request = adapter_request(&shared, body).await?;
    let Some(path) = request.lora_path else {
        return Err(ApiError::invalid(
            "`lora_path` is required",
            Some("lora_path"),
        ));
    };
    let engine = shared.engine()?.clone();
    let name = request.lora_name;
    let task_name = name.clone();
    let loaded = tokio::task::spawn_blocking(move || {
        engine.load_adapter(&task_name, std::path::Path::new(&path))
    })
    .await
    .map_err(|e| ApiError::internal(format!("loading the adapter failed: {e}")))?
    .map_err(|e| ApiError::from_llama(&e, "lora_path"))?;
    tracing::info!(
        adapter = name.as_str(),
        rank = loaded.rank,
        "LoRA adapter loaded"
    );
    Ok(Json(AdapterStatus {
        lora_name: name,
        status: "loaded",
        rank: Some(loaded.rank),
        modules: Some(loaded.modules),
    })
    .into_response())
}

/// Stops serving the adapter `lora_name` (requests running with it finish). Behind
/// `--admin-key`.
#[utoipa::path(post, path = "/v1/unload_lora_adapter", tag = "admin",
    request_body(content = AdapterRequest, content_type = "application/json"),
    responses(
        (status = 200, description = "The adapter is no longer served", body = AdapterStatus),
        (status = 400, description = "The body is wrong", body = ErrorBody),
        (status = 401, description = "The admin key is missing or wrong", body = ErrorBody),
        (status = 403, description = "The server has no admin key", body = ErrorBody),
        (status = 404, description = "No adapter has this name", body = ErrorBody),
        (status = 503, description = "Loading or shutting down", body = ErrorBody),
    ),
    security(("bearer" = [])),
)]
pub(super) async fn unload_lora_adapter(
    State(shared): AppState,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    admin(&shared, &headers)?;
    let request = adapter_request(&shared, body).await?;
    shared
        .engine()?
        .unload_adapter(&request.lora_name)
        .map_err(|e| ApiError::from_llama(&e, "lora_name"))?;
    tracing::info!(
        adapter = request.lora_name.as_str(),
        "LoRA adapter unloaded"
    );
    Ok(Json(AdapterStatus {
        lora_name: request.lora_name,
        status: "unloaded",
        rank: None,
        modules: None,
    })
    .into_response())
}

/// One model, by id.
#[utoipa::path(get, path = "/v1/models/{id}", tag = "models",
    params(("id" = String, Path, description = "The model's id")),
    responses(
        (status = 200, description = "The served model", body = ModelObject),
        (status = 401, description = "The API key is missing or wrong", body = ErrorBody),
        (status = 404, description = "No model has this id", body = ErrorBody),
    ),
    security((), ("bearer" = [])),
)]
pub(super) async fn get_model(State(shared): AppState, Path(id): Path<String>) -> Response {
    match all_models(&shared).into_iter().find(|m| m.id == id) {
        Some(model) => Json(model).into_response(),
        None => ApiError::model_not_found(&id, &shared.config.served_model_name).into_response(),
    }
}

/// Reads a body: 413 over `--max-body-bytes` (read no further), 408 when it does not
/// arrive within `--body-timeout`.
pub(super) async fn read_body(shared: &Shared, body: Body) -> Result<Bytes, ApiError> {
    let limit = shared.config.max_body_bytes;
    // A body whose declared length (`Content-Length`) is over the limit is refused before
    // a byte of it is read: the client learns it at once, and the connection is not held
    // while megabytes arrive only to be dropped.
    if axum::body::HttpBody::size_hint(&body).lower() > limit as u64 {
        return Err(ApiError::too_large(limit));
    }
    let timeout = shared.config.body_timeout;
    match tokio::time::timeout(timeout, axum::body::to_bytes(body, limit)).await {
        Err(_) => Err(ApiError::body_timeout(timeout)),
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(e)) => {
            // axum's error wraps http-body-util's `LengthLimitError`.
            let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
            let mut too_large = false;
            while let Some(err) = source {
                too_large |= err.to_string().contains("length limit exceeded");
                source = err.source();
            }
            if too_large {
                Err(ApiError::too_large(limit))
            } else {
                Err(ApiError::invalid(
                    format!("could not read the body: {e}"),
                    None,
                ))
            }
        }
    }
}

/// Fields read apart from the endpoint's own: `user` (checked, not used: it does not
/// make tenants) and `cache_salt` (shown in `/openapi.json` as `CacheFields`).
#[derive(Default, serde::Deserialize, utoipa::ToSchema)]
#[schema(as = CacheFields)]
pub(super) struct Extras {
    /// An end-user id, at most 256 bytes: accepted and ignored.
    user: Option<String>,
    /// At most 256 bytes: prompts with different salts share no cached prefix (so one
    /// tenant cannot time another's cache hits).
    cache_salt: Option<String>,
}

/// Longest `cache_salt` and `user` taken into account.
const MAX_SALT_BYTES: usize = 256;

/// Parses a JSON body whatever its content type, after the limits that need no parse
/// (nesting, then the counts of prompts, choices, stop strings and messages): 400 for
/// one of those, malformed JSON or a field of the wrong type (naming the field).
fn parse_body<T: OpenAiRequest>(
    config: &ServerConfig,
    endpoint: Endpoint,
    body: &[u8],
) -> Result<(T, Extras), ApiError> {
    check_depth(body, config.max_json_depth)?;
    // Every later read of the body (the counts, the request, the constraint, the tools,
    // the tenant's fields) then sees the one copy of each key.
    check_unique_keys(body)?;
    check_counts(body, endpoint, config)?;
    let request = parse_request(body)?;
    Ok((request, read_extras(body)?))
}

/// A checked body's `user` and `cache_salt`, each at most [`MAX_SALT_BYTES`].
pub(super) fn read_extras(body: &[u8]) -> Result<Extras, ApiError> {
    let extras: Extras = serde_json::from_slice(body).unwrap_or_default();
    for (name, value) in [("user", &extras.user), ("cache_salt", &extras.cache_salt)] {
        if value.as_ref().is_some_and(|v| v.len() > MAX_SALT_BYTES) {
            return Err(ApiError::invalid(
                format!("`{name}` is longer than {MAX_SALT_BYTES} bytes"),
                Some(name),
            ));
        }
    }
    Ok(extras)
}

/// The adapter a request's `model` names: `None` for the served model (or no `model`),
/// else the name, which [`run`] checks against the engine's adapters before any work is
/// done (404 `model_not_found` for one it does not know). A name too long to be an
/// adapter's is refused here.
pub(super) fn check_model(
    config: &ServerConfig,
    model: Option<&str>,
) -> Result<Option<String>, ApiError> {
    match model {
        Some(m) if m != config.served_model_name => {
            if m.len() > crate::lora::MAX_NAME_BYTES {
                return Err(ApiError::model_not_found(
                    &m.chars().take(64).collect::<String>(),
                    &config.served_model_name,
                ));
            }
            Ok(Some(m.to_string()))
        }
        _ => Ok(None),
    }
}

/// A chat body read and checked: what its handler needs besides the engine.
pub(super) struct CheckedChat {
    pub(super) messages: Vec<ChatMessage>,
    pub(super) sampling: Sampling,
    pub(super) tool_request: Option<tools::ToolRequest>,
    pub(super) extras: Extras,
}

/// Every check a chat body passes before any work is done: the limits, the parse, the
/// constraint, the tools, the model name, the conversation and the sampling settings.
/// The body is dropped once read (what the generation needs was taken out of it).
pub(super) fn read_chat(
    config: &ServerConfig,
    body: impl AsRef<[u8]>,
) -> Result<CheckedChat, ApiError> {
    let bytes = body.as_ref();
    let (request, extras): (ChatCompletionRequest, _) = parse_body(config, Endpoint::Chat, bytes)?;
    let constraint = structured::constraint(bytes, config.max_constraint_bytes)?;
    let tool_request = tools::read(bytes, config.max_constraint_bytes)?;
    drop(body);
    let adapter = check_model(config, request.common.model.as_deref())?;
    let messages = request.conversation()?;
    let mut sampling =
        request
            .common
            .sampling(Endpoint::Chat, request.max_tokens(), config.max_n)?;
    sampling.constraint = constraint.map(Arc::new);
    sampling.adapter = adapter;
    Ok(CheckedChat {
        messages,
        sampling,
        tool_request,
        extras,
    })
}

/// A completions body read and checked: what its handler needs besides the engine.
pub(super) struct CheckedCompletion {
    prompts: Vec<PromptInput>,
    sampling: Sampling,
    extras: Extras,
}

/// Every check a completions body passes before any work is done (see [`read_chat`]).
pub(super) fn read_completion(
    config: &ServerConfig,
    body: impl AsRef<[u8]>,
) -> Result<CheckedCompletion, ApiError> {
    let bytes = body.as_ref();
    let (request, extras): (CompletionRequest, _) =
        parse_body(config, Endpoint::Completions, bytes)?;
    let constraint = structured::constraint(bytes, config.max_constraint_bytes)?;
    drop(body);
    let adapter = check_model(config, request.common.model.as_deref())?;
    let prompts = request.prompts()?;
    let echo = request.echo.unwrap_or(false);
    // `max_tokens: 0` with `echo` asks for the prompt alone: one token is generated and
    // left out.
    let prompt_only = echo && request.common.max_tokens == Some(0);
    let max_tokens = match prompt_only {
        true => Some(1),
        false => request.common.max_tokens,
    };
    let mut sampling = request
        .common
        .sampling(Endpoint::Completions, max_tokens, config.max_n)?;
    sampling.echo = echo;
    sampling.prompt_only = prompt_only;
    sampling.constraint = constraint.map(Arc::new);
    sampling.adapter = adapter;
    Ok(CheckedCompletion {
        prompts,
        sampling,
        extras,
    })
}

/// The errors both generation endpoints answer with, for their OpenAPI description.
#[derive(utoipa::IntoResponses)]
#[allow(dead_code)] // Only described, never built: the handlers answer with `ApiError`.
pub(super) enum GenerationErrors {
    /// A field is invalid (`param` names it)
    #[response(status = 400)]
    Invalid(ErrorBody<'static>),
    /// The API key is missing or wrong
    #[response(status = 401)]
    Unauthorized(ErrorBody<'static>),
    /// `model` is not the served model
    #[response(status = 404)]
    ModelNotFound(ErrorBody<'static>),
    /// The body did not arrive in time
    #[response(status = 408)]
    BodyTimeout(ErrorBody<'static>),
    /// The body is over the size limit
    #[response(status = 413)]
    TooLarge(ErrorBody<'static>),
    /// Over a limit of the tenant or the server (`Retry-After`)
    #[response(status = 429)]
    TooMany(ErrorBody<'static>),
    /// Loading, shutting down, or the engine stopped
    #[response(status = 503)]
    Unavailable(ErrorBody<'static>),
}

/// A chat answer: whole, or streamed as server-sent events (`stream: true`), each
/// `data:` line a `ChatCompletionChunk`, then `data: [DONE]`.
#[utoipa::path(post, path = "/v1/chat/completions", tag = "completions",
    request_body(content = ChatCompletionBody, content_type = "application/json"),
    responses(
        (status = 200, description = "The answer", content(
            (ChatCompletion = "application/json"),
            (ChatCompletionEvent = "text/event-stream"),
        )),
        GenerationErrors,
    ),
    security((), ("bearer" = [])),
)]
pub(super) async fn chat_completions(
    State(shared): AppState,
    Extension(ClientRequestId(request_id)): Extension<ClientRequestId>,
    Extension(tenant): Extension<Tenant>,
    body: Body,
) -> Result<Response, ApiError> {
    let body = read_body(&shared, body).await?;
    // What the generation needs is taken out: the parsed body (messages as sent,
    // `response_format` and whatever else it held) is not kept while it runs.
    let CheckedChat {
        messages,
        mut sampling,
        tool_request,
        extras,
    } = read_chat(&shared.config, body)?;
    if let Some(tool_request) = tool_request {
        with_tools(&shared, &mut sampling, tool_request)?;
    }
    let default_max = shared.config.default_max_tokens;
    run(
        shared,
        Endpoint::Chat,
        vec![PromptInput::Chat(messages)],
        sampling,
        default_max,
        request_id,
        TenantOf::new(tenant, extras),
    )
    .await
}

/// Shows the tools to the model (unless `tool_choice` is `none`), reads its answer for
/// calls, and constrains decoding when a call is forced, and in `auto` when a tool is
/// `strict` (free text or valid calls; a `response_format` takes precedence there, and
/// the calls are then read unconstrained).
pub(super) fn with_tools(
    shared: &Shared,
    sampling: &mut Sampling,
    request: tools::ToolRequest,
) -> Result<(), ApiError> {
    if request.choice == ToolChoice::None {
        return Ok(());
    }
    let format = shared.engine()?.tool_format();
    if request.choice.is_forced() && sampling.constraint.is_some() {
        return Err(ApiError::invalid(
            "a forced `tool_choice` cannot be combined with `response_format` or \
             `structured_outputs`",
            Some("tool_choice"),
        ));
    }
    if sampling.constraint.is_none() {
        sampling.constraint =
            tool_constraint(&request.tools, &request.choice, request.parallel, format)
                .map(Arc::new);
        if sampling.constraint.is_some() {
            sampling.constraint_param = "tools";
        }
    }
    sampling.tools = request.tools;
    sampling.tool_format = Some(format);
    Ok(())
}

/// A text completion: whole, or streamed as server-sent events (`stream: true`), each
/// `data:` line a `TextCompletionChunk`, then `data: [DONE]`.
#[utoipa::path(post, path = "/v1/completions", tag = "completions",
    request_body(content = CompletionBody, content_type = "application/json"),
    responses(
        (status = 200, description = "The completion", content(
            (TextCompletion = "application/json"),
            (TextCompletionEvent = "text/event-stream"),
        )),
        GenerationErrors,
    ),
    security((), ("bearer" = [])),
)]
pub(super) async fn completions(
    State(shared): AppState,
    Extension(ClientRequestId(request_id)): Extension<ClientRequestId>,
    Extension(tenant): Extension<Tenant>,
    body: Body,
) -> Result<Response, ApiError> {
    let body = read_body(&shared, body).await?;
    let CheckedCompletion {
        prompts,
        sampling,
        extras,
    } = read_completion(&shared.config, body)?;
    // OpenAI's default for legacy completions.
    let default_max = Some(shared.config.default_max_tokens.unwrap_or(16));
    run(
        shared,
        Endpoint::Completions,
        prompts,
        sampling,
        default_max,
        request_id,
        TenantOf::new(tenant, extras),
    )
    .await
}

/// Who a request is for: its tenant (the API key's, else its peer's, else `anonymous`)
/// and its prefix-cache partition.
pub(super) struct TenantOf {
    pub(super) name: String,
    pub(super) scope: Scope,
    /// Whether the tenant's shares apply (not to `anonymous`: without an API key or a
    /// known peer there is nobody to tell apart).
    pub(super) capped: bool,
}

impl TenantOf {
    /// The prefix cache is partitioned by API-key tenant (one tenant's prompts give
    /// another no hits) and, within it, by `cache_salt`. Without API keys and without a
    /// `cache_salt` requests share partition 0.
    pub(super) fn new(tenant: Tenant, extras: Extras) -> Self {
        let keyed = matches!(tenant, Tenant::Key(_));
        let capped = !matches!(tenant, Tenant::Anonymous);
        let name = match tenant {
            Tenant::Key(name) => name,
            Tenant::Peer(ip) => format!("peer {ip}"),
            Tenant::Anonymous => "anonymous".into(),
        };
        let salt = if keyed || extras.cache_salt.is_some() {
            use std::hash::{Hash, Hasher};
            let half = |lead: u64| {
                let mut h = std::collections::hash_map::DefaultHasher::new();
                lead.hash(&mut h);
                keyed.then_some(name.as_str()).hash(&mut h);
                extras.cache_salt.hash(&mut h);
                h.finish()
            };
            (u128::from(half(1)) << 64) | u128::from(half(2))
        } else {
            0
        };
        let tenant = {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            name.hash(&mut h);
            h.finish()
        };
        Self {
            name,
            scope: Scope { salt, tenant },
            capped,
        }
    }
}

/// A constraint that does not compile (found by the tokenizer pool, which compiles it, or
/// by the engine) is blamed on the field that asked for it: `response_format`,
/// `structured_outputs` or, for a forced tool call, `tools`.
fn blame_constraint(mut e: ApiError, sampling: &Sampling) -> ApiError {
    if e.code == Some("invalid_constraint") {
        e.param = Some(sampling.constraint_param.to_string());
    }
    e
}

/// The engine request every choice of an API request starts from: its settings, no
/// prompt yet.
fn base_request(sampling: &Sampling, max_tokens: usize) -> GenerateRequest {
    let mut request = GenerateRequest::from_ids(Vec::new())
        .with_max_tokens(max_tokens)
        .with_sampling(sampling.params.clone())
        .with_ignore_eos(sampling.ignore_eos)
        .with_stop_token_ids(sampling.stop_token_ids.clone())
        .with_min_tokens(sampling.min_tokens);
    request.logprobs = sampling.logprobs;
    request.constraint = sampling.constraint.clone();
    request.adapter = sampling.adapter.clone();
    request
}

/// What a prompt's choices need besides its token ids.
struct PromptPlan {
    /// The prompt text to send back first (completions' `echo`: a text prompt as sent,
    /// a prompt of token ids decoded).
    echo: Option<String>,
    /// Whether `echo` is the text of the prompt's ids, which the tokenizer pool decodes.
    echo_ids: bool,
    /// The prompt's log-probabilities, asked for with `echo`.
    prompt_logprobs: Option<usize>,
}

/// Each prompt as an engine request to validate and tokenize (once, whatever `n`), and
/// what its choices need besides the ids. The prompts are moved, not copied.
fn prompt_requests(
    prompts: Vec<PromptInput>,
    base: &GenerateRequest,
    sampling: &Sampling,
) -> (Vec<GenerateRequest>, Vec<PromptPlan>) {
    let mut requests = Vec::with_capacity(prompts.len());
    let mut plans = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        let mut plan = PromptPlan {
            echo: None,
            echo_ids: false,
            prompt_logprobs: None,
        };
        let mut request = base.clone();
        request.prompt_ids = None;
        match prompt {
            PromptInput::Chat(messages) => {
                request.messages = Some(messages);
                request.tools = sampling.tools.clone();
            }
            PromptInput::Text(text) => {
                if sampling.echo {
                    plan.echo = Some(text.clone());
                    plan.prompt_logprobs = sampling.logprobs;
                    request.prompt_logprobs = sampling.logprobs;
                }
                request.prompt = text;
            }
            PromptInput::Ids(ids) => {
                if sampling.echo {
                    plan.echo_ids = true;
                    plan.prompt_logprobs = sampling.logprobs;
                    request.prompt_logprobs = sampling.logprobs;
                }
                request.prompt_ids = Some(ids);
            }
        }
        requests.push(request);
        plans.push(plan);
    }
    (requests, plans)
}

/// The engine requests of an API request: `n` choices per prompt, each with its
/// prompt's token ids, choice `i` seeded `seed + i` (`seed`: the request's, or a fresh
/// random one when it gave none).
fn choice_specs(
    prompts: Vec<(Vec<u32>, PromptPlan)>,
    base: &GenerateRequest,
    sampling: &Sampling,
    seed: u64,
) -> Vec<ChoiceSpec> {
    let mut specs = Vec::with_capacity(prompts.len().saturating_mul(sampling.n));
    for (p, (ids, plan)) in prompts.into_iter().enumerate() {
        for i in 0..sampling.n {
            let mut request = base.clone().with_seed(seed.wrapping_add(i as u64));
            request.prompt_ids = Some(ids.clone());
            request.prompt_logprobs = plan.prompt_logprobs;
            specs.push(ChoiceSpec {
                request,
                echo: plan.echo.clone(),
                prompt_only: sampling.prompt_only,
                prompt: p,
                stop: sampling.stop.clone(),
            });
        }
    }
    specs
}

/// What every response and chunk of one request shares.
pub(super) struct Envelope {
    endpoint: Endpoint,
    pub(super) id: String,
    pub(super) created: u64,
    pub(super) model: String,
    /// The seed of choice 0 (choice `i` uses `seed + i`): sent back as `seed` and in
    /// `system_fingerprint`, so a sampled answer can be reproduced.
    seed: u64,
    /// Whether the choices carry log-probabilities.
    logprobs: bool,
    /// Read the answers for tool calls in this format.
    pub(super) tool_format: Option<crate::tools::ToolFormat>,
}

impl Envelope {
    /// The seed as clients send it: OpenAI's `seed` is a signed 64-bit integer, read as
    /// its bits.
    fn client_seed(&self) -> i64 {
        self.seed as i64
    }

    /// The fields every answer and chunk of this request starts with.
    fn head(&self, object: &'static str) -> ResponseHead {
        ResponseHead {
            id: self.id.clone(),
            object,
            created: self.created,
            model: self.model.clone(),
            system_fingerprint: format!("llama-burn-seed-{}", self.client_seed()),
            seed: self.client_seed(),
        }
    }

    /// A chat choice's `logprobs`: none unless asked for.
    fn chat_logprobs(&self, entries: &[(TokenLogprobs, usize)]) -> Option<ChatLogprobs> {
        self.logprobs.then(|| chat_logprobs(entries))
    }

    /// A text choice's `logprobs`: none unless asked for.
    fn text_logprobs(&self, entries: &[(TokenLogprobs, usize)]) -> Option<TextLogprobs> {
        self.logprobs.then(|| text_logprobs(entries))
    }

    /// A stream event of this request's endpoint with these choices.
    fn chunk(&self, choices: ChunkChoices, usage: Option<Option<Usage>>) -> Event {
        let head = self.head(self.endpoint.chunk_object());
        let data = match choices {
            ChunkChoices::Chat(choices) => serde_json::to_string(&ChatCompletionChunk {
                head,
                choices,
                usage,
            }),
            ChunkChoices::Text(choices) => serde_json::to_string(&TextCompletionChunk {
                head,
                choices,
                usage,
            }),
        };
        // Serializing these types cannot fail (string keys, finite numbers).
        Event::default().data(data.unwrap_or_default())
    }
}

/// The choices of one stream chunk, of either endpoint.
enum ChunkChoices {
    Chat(Vec<ChatChunkChoice>),
    Text(Vec<TextChoice>),
}

async fn run(
    shared: Arc<Shared>,
    endpoint: Endpoint,
    prompts: Vec<PromptInput>,
    sampling: Sampling,
    default_max_tokens: Option<usize>,
    request_id: Option<String>,
    tenant: TenantOf,
) -> Result<Response, ApiError> {
    let stream = sampling.stream;
    let include_usage = sampling.include_usage;
    let keep_alive = shared.config.sse_keep_alive;
    let started = start(
        shared,
        endpoint,
        prompts,
        sampling,
        default_max_tokens,
        request_id,
        tenant,
    )
    .await?;
    let mut response = if stream {
        let events = sse_events(started.generation, started.envelope, include_usage);
        Sse::new(events)
            .keep_alive(KeepAlive::new().interval(keep_alive))
            .into_response()
    } else {
        whole_response(started.generation, started.envelope).await?
    };
    if let Some(value) = started.request_id {
        response.headers_mut().insert("x-request-id", value);
    }
    Ok(response)
}

/// A generation under way: its choices, what its answer carries, and the request id
/// for the `X-Request-Id` header.
pub(super) struct Started {
    pub(super) generation: Generation,
    pub(super) envelope: Envelope,
    pub(super) request_id: Option<HeaderValue>,
}

/// Everything a generation endpoint does before its answer: the adapter, the tenant's
/// share, tokenization on the pool, and the choices submitted to the engine.
pub(super) async fn start(
    shared: Arc<Shared>,
    endpoint: Endpoint,
    prompts: Vec<PromptInput>,
    sampling: Sampling,
    default_max_tokens: Option<usize>,
    request_id: Option<String>,
    tenant: TenantOf,
) -> Result<Started, ApiError> {
    let max_seq_len = shared.engine()?.max_seq_len();
    // A `model` that is neither the served model nor one of its adapters: 404 before
    // anything else.
    if let Some(name) = &sampling.adapter
        && !shared.engine()?.has_adapter(name)
    {
        return Err(ApiError::model_not_found(
            name,
            &shared.config.served_model_name,
        ));
    }
    // The tenant's share first: a request over it costs nothing more.
    let choices = prompts.len().saturating_mul(sampling.n);
    let slot = shared.reserve(&tenant.name, choices, tenant.capped)?;
    shared
        .metrics
        .tenant_request(&tenant.name, keyed_tenant(&shared, &tenant.name));
    let max_tokens = sampling
        .max_tokens
        .or(default_max_tokens.map(|d| d.min(max_seq_len)))
        .unwrap_or(max_seq_len);
    let seed = sampling.seed.unwrap_or_else(rand::random);
    // Each prompt is validated and tokenized once, whatever `n`, on the tokenizer pool
    // (never on the engine thread), before any choice is submitted: a prompt over the
    // context is refused here.
    let base = base_request(&sampling, max_tokens);
    let (requests, mut plans) = prompt_requests(prompts, &base, &sampling);
    let decode = plans.iter().map(|p| p.echo_ids).collect();
    let tokenizing = shared.enter_tokenizer(&tenant.name, tenant.capped)?;
    let encoded = shared
        .tokenizer
        .encode(shared.engine()?, requests, decode)
        .await
        .map_err(|e| {
            blame_constraint(ApiError::from_llama(&e, endpoint.prompt_param()), &sampling)
        })?;
    drop(tokenizing);
    let mut ids = Vec::with_capacity(encoded.len());
    for ((prompt_ids, text), plan) in encoded.into_iter().zip(&mut plans) {
        if text.is_some() {
            plan.echo = text;
        }
        ids.push(prompt_ids);
    }
    let specs = choice_specs(ids.into_iter().zip(plans).collect(), &base, &sampling, seed);
    let envelope = Envelope {
        endpoint,
        id: format!("{}{:032x}", endpoint.id_prefix(), rand::random::<u128>()),
        created: super::unix_now(),
        model: sampling
            .adapter
            .clone()
            .unwrap_or_else(|| shared.config.served_model_name.clone()),
        seed,
        logprobs: sampling.logprobs.is_some(),
        tool_format: sampling.tool_format,
    };
    // The client's id, or else the response's own: the replica's log line carries it,
    // and so does the response.
    let request_id = request_id.unwrap_or_else(|| envelope.id.clone());
    let header_value = HeaderValue::from_str(&request_id).ok();
    let generation = Generation::start(shared, endpoint, specs, request_id, tenant.scope, slot)
        .await
        .map_err(|e| blame_constraint(e, &sampling))?;
    Ok(Started {
        generation,
        envelope,
        request_id: header_value,
    })
}

/// Whether `name` is an API-key tenant (whose counters `/metrics` shows; `user` names are
/// the clients' own and unbounded, so they are not labels).
pub(super) fn keyed_tenant(shared: &Shared, name: &str) -> bool {
    shared.config.keys().any(|(n, _)| n == name)
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
    let usage = generation.usage();
    let head = envelope.head(envelope.endpoint.object());
    let response = match envelope.endpoint {
        Endpoint::Chat => {
            let choices = (0..n)
                .map(|i| {
                    let logprobs = envelope.chat_logprobs(&logprobs[i]);
                    if let Some(format) = envelope.tool_format {
                        let mut parser = ToolCallParser::new(format);
                        let mut events = parser.push(&texts[i]);
                        events.extend(parser.finish());
                        let (content, calls) = collect(events);
                        if !calls.is_empty() {
                            let reason = tool_finish_reason(reasons[i]);
                            return chat_choice(i, &content, &calls, reason, logprobs);
                        }
                    }
                    chat_choice(i, &texts[i], &[], reasons[i], logprobs)
                })
                .collect();
            Json(ChatCompletion {
                head,
                choices,
                usage,
            })
            .into_response()
        }
        Endpoint::Completions => {
            let choices = (0..n)
                .map(|i| TextChoice {
                    index: i,
                    text: std::mem::take(&mut texts[i]),
                    logprobs: envelope.text_logprobs(&logprobs[i]),
                    finish_reason: Some(reasons[i]),
                })
                .collect();
            Json(TextCompletion {
                head,
                choices,
                usage,
            })
            .into_response()
        }
    };
    Ok(response)
}

/// `tool_calls` for an answer with calls that ended by itself (`length` stays).
fn tool_finish_reason(reason: &'static str) -> &'static str {
    match reason {
        "stop" => "tool_calls",
        other => other,
    }
}

struct StreamState {
    generation: Generation,
    envelope: Envelope,
    include_usage: bool,
    queue: VecDeque<Event>,
    done: bool,
    /// Each choice's tool-call reader (chat with tools).
    parsers: Vec<ToolCallParser>,
}

impl StreamState {
    /// Queues a chunk with these choices (`usage` null when it was asked for).
    fn push(&mut self, choices: ChunkChoices) {
        let usage = self.include_usage.then_some(None);
        let event = self.envelope.chunk(choices, usage);
        self.queue.push_back(event);
    }

    /// Queues one chunk of choice `index` with new text (chat: as `content`), the
    /// finish reason on the last, and log-probabilities when asked for (`None`: none).
    fn push_text(
        &mut self,
        index: usize,
        text: Option<String>,
        finish_reason: Option<&'static str>,
        entries: Option<&[(TokenLogprobs, usize)]>,
    ) {
        let choices = match self.envelope.endpoint {
            Endpoint::Chat => ChunkChoices::Chat(vec![ChatChunkChoice {
                index,
                delta: ChatDelta {
                    content: text,
                    ..ChatDelta::default()
                },
                logprobs: entries.and_then(|e| self.envelope.chat_logprobs(e)),
                finish_reason,
            }]),
            Endpoint::Completions => ChunkChoices::Text(vec![TextChoice {
                index,
                text: text.unwrap_or_default(),
                logprobs: entries.and_then(|e| self.envelope.text_logprobs(e)),
                finish_reason,
            }]),
        };
        self.push(choices);
    }

    /// One chunk per tool-call event of choice `index` (the log-probabilities on the
    /// first; a chunk with an empty delta carries them when the text was held back), and
    /// the finishing chunk when `finish` is given.
    fn push_tool_events(
        &mut self,
        index: usize,
        events: Vec<ToolCallEvent>,
        mut logprobs: Option<ChatLogprobs>,
        finish: Option<&'static str>,
    ) {
        for event in &events {
            let choice = ChatChunkChoice {
                index,
                delta: tool_delta(event),
                logprobs: logprobs.take(),
                finish_reason: None,
            };
            self.push(ChunkChoices::Chat(vec![choice]));
        }
        if finish.is_some() || logprobs.is_some() {
            let choice = ChatChunkChoice {
                index,
                delta: ChatDelta::default(),
                logprobs,
                finish_reason: finish,
            };
            self.push(ChunkChoices::Chat(vec![choice]));
        }
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
    let parsers = match envelope.tool_format {
        Some(format) => (0..generation.len())
            .map(|_| ToolCallParser::new(format))
            .collect(),
        None => Vec::new(),
    };
    let mut state = StreamState {
        generation,
        envelope,
        include_usage,
        queue: VecDeque::new(),
        done: false,
        parsers,
    };
    if state.envelope.endpoint == Endpoint::Chat {
        // The first chunk of each choice names the role, as OpenAI's do.
        for index in 0..state.generation.len() {
            let delta = ChatDelta {
                role: Some("assistant"),
                content: Some(String::new()),
                ..ChatDelta::default()
            };
            let choice = ChatChunkChoice {
                index,
                delta,
                logprobs: None,
                finish_reason: None,
            };
            state.push(ChunkChoices::Chat(vec![choice]));
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
            match state.generation.next().await {
                Some(Update::Text {
                    index,
                    text,
                    logprobs,
                }) if !state.parsers.is_empty() => {
                    let logprobs = state.envelope.chat_logprobs(&logprobs);
                    let events = match state.parsers.get_mut(index) {
                        Some(parser) => parser.push(&text),
                        None => Vec::new(),
                    };
                    state.push_tool_events(index, events, logprobs, None);
                }
                Some(Update::Finished {
                    index,
                    text,
                    reason,
                    logprobs,
                }) if !state.parsers.is_empty() => {
                    let logprobs = match logprobs.is_empty() {
                        true => None,
                        false => state.envelope.chat_logprobs(&logprobs),
                    };
                    let (events, calls) = match state.parsers.get_mut(index) {
                        Some(parser) => {
                            let mut events = parser.push(&text);
                            events.extend(parser.finish());
                            (events, parser.calls())
                        }
                        None => (Vec::new(), 0),
                    };
                    let reason = match calls {
                        0 => reason,
                        _ => tool_finish_reason(reason),
                    };
                    state.push_tool_events(index, events, logprobs, Some(reason));
                }
                Some(Update::Text {
                    index,
                    text,
                    logprobs,
                }) => state.push_text(index, Some(text), None, Some(&logprobs)),
                Some(Update::Finished {
                    index,
                    text,
                    reason,
                    logprobs,
                }) => {
                    let text = (!text.is_empty()).then_some(text);
                    let entries = (!logprobs.is_empty()).then_some(&logprobs[..]);
                    state.push_text(index, text, Some(reason), entries);
                }
                Some(Update::Failed(error)) => {
                    // Headers are sent: the error travels as an event, and the stream ends.
                    let body = error.body().to_string();
                    state.queue.push_back(Event::default().data(body));
                    state.done = true;
                }
                None => {
                    if state.include_usage {
                        let usage = state.generation.usage();
                        let choices = match state.envelope.endpoint {
                            Endpoint::Chat => ChunkChoices::Chat(Vec::new()),
                            Endpoint::Completions => ChunkChoices::Text(Vec::new()),
                        };
                        let event = state.envelope.chunk(choices, Some(Some(usage)));
                        state.queue.push_back(event);
                    }
                    state.queue.push_back(Event::default().data("[DONE]"));
                    state.done = true;
                }
            }
        }
    })
}
