//! An OpenAI-compatible HTTP server over the [`ContinuousEngine`] (feature `server`).
//!
//! [`Server`] holds the state (the engine once it is loaded, the configuration,
//! metrics, the requests in flight) and builds an [`axum::Router`] that can be served as
//! it is or mounted in a larger application:
//!
//! | route | |
//! | --- | --- |
//! | `POST /v1/chat/completions` | chat, streamed (server-sent events) or not |
//! | `POST /v1/completions` | text completion, streamed or not |
//! | `GET /v1/models`, `GET /v1/models/{id}` | the served model |
//! | `GET /health` | 200 when ready, 503 while loading or shutting down |
//! | `GET /metrics` | Prometheus text, vLLM's metric names prefixed `llama_burn:` |
//!
//! Errors have OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`). Each
//! prompt is tokenized once, whatever `n`, on a bounded pool of blocking threads
//! ([`ServerConfig::tokenizer_threads`]), and the engine receives token ids. A request
//! whose client disconnects is cancelled and its KV blocks are freed at the engine's
//! next step. The `llama-burn-server` binary serves a model file this way.
//!
//! ```no_run
//! # async fn serve() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use llama_burn::backend::{DefaultBackend, default_device};
//! use llama_burn::inference::{ContinuousConfig, ContinuousEngine};
//! use llama_burn::llama::LlamaConfig;
//! use llama_burn::server::{Server, ServerConfig};
//!
//! let llama = llama_burn::Loader::gguf(llama_burn::demo::demo_model_path()?)
//!     .max_seq_len(2048)
//!     .load::<DefaultBackend>(&default_device())?;
//! let engine = ContinuousEngine::start(llama, ContinuousConfig::default())?;
//! let server = Server::new(ServerConfig::new("smollm2"))?;
//! server.set_engine(Arc::new(engine))?;
//! let app = axum::Router::new().nest("/llm", server.router()); // or serve it alone
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! axum::serve(listener, app).await?;
//! # Ok(())
//! # }
//! ```

mod embeddings;
mod error;
mod generation;
mod limits;
pub mod metrics;
pub mod openai;
mod openapi;

mod response_store;
pub mod responses;
mod responses_api;
mod routes;
mod serve;
mod stop;
mod structured;
mod tokenize;
mod tools;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub use error::ApiError;
pub use metrics::ServerMetrics;
pub use openapi::openapi;
pub use stop::{StopMatcher, StopOutput};

use crate::backend::LlamaBackend;
use crate::error::{LlamaError, Result};
use crate::inference::{
    CancelToken, ContinuousEngine, EngineMetrics, EventHandler, GenerateRequest, Scope,
};
use crate::lora::AdapterInfo;
use crate::tokenizer::Tokenizer;

/// Runs `body` through every check a POST to the chat (`chat`) or completions endpoint
/// passes before any work is done (the handlers' own code: limits, parse, constraint,
/// tools, model name, conversation or prompts, sampling settings). For
/// [`crate::fuzzing`].
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn check_body(
    config: &ServerConfig,
    chat: bool,
    body: &[u8],
) -> std::result::Result<(), ApiError> {
    match chat {
        true => routes::read_chat(config, body).map(drop),
        false => routes::read_completion(config, body).map(drop),
    }
}

/// Runs `body` through every check a POST to `/v1/embeddings` passes before the engine
/// is asked anything (see [`embeddings::read_embedding`]). For [`crate::fuzzing`].
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn check_embedding_body(
    config: &ServerConfig,
    body: &[u8],
) -> std::result::Result<(), ApiError> {
    embeddings::read_embedding(config, body).map(drop)
}

/// What the server needs from an engine. [`ContinuousEngine`] implements it whatever
/// its backend and tokenizer, so the router is not generic.
pub trait Engine: Send + Sync + 'static {
    /// Queues `request`, cancelled through `cancel`, its events delivered to
    /// `on_event`: first [`EngineEvent::Accepted`](crate::inference::EngineEvent::Accepted)
    /// or the `Done` error that refuses it (see [`ContinuousEngine::submit_to`]).
    ///
    /// `scope` is the request's prefix-cache partition and tenant (see
    /// [`ContinuousEngine::submit_scoped`]).
    fn submit(
        &self,
        request: GenerateRequest,
        cancel: CancelToken,
        scope: Scope,
        on_event: EventHandler,
    ) -> Result<()>;
    /// Validates `request` and returns its prompt's token ids (see
    /// [`ContinuousEngine::encode`]). The server calls it on its tokenizer pool's
    /// blocking threads, once per prompt, and submits token ids only, so that the
    /// engine's own thread never tokenizes.
    fn encode(&self, request: &GenerateRequest) -> Result<Vec<u32>>;
    /// The text of a prompt's token ids (see [`ContinuousEngine::decode`]), for echoing
    /// a prompt given as ids. Called on the tokenizer pool's threads.
    ///
    /// # Errors
    ///
    /// By default [`LlamaError::InvalidParameter`]: the engine cannot decode, so `echo`
    /// of token ids is refused.
    fn decode(&self, ids: &[u32]) -> Result<String> {
        let _ = ids;
        Err(LlamaError::invalid(
            "echo",
            "true",
            "this engine cannot give the text of token ids",
        ))
    }
    /// `text` as an input to embed (see [`ContinuousEngine::encode_text`]). Called on
    /// the tokenizer pool's threads.
    ///
    /// # Errors
    ///
    /// By default [`LlamaError::InvalidParameter`]: the engine cannot embed.
    fn encode_text(&self, text: &str) -> Result<Vec<u32>> {
        let _ = text;
        Err(cannot_embed())
    }
    /// Queues inputs to embed (see [`ContinuousEngine::embed_to`]).
    ///
    /// # Errors
    ///
    /// By default [`LlamaError::InvalidParameter`]: the engine cannot embed.
    fn embed_to(
        &self,
        inputs: Vec<Vec<u32>>,
        options: crate::embed::EmbeddingOptions,
        cancel: CancelToken,
        reply: crate::inference::EmbedReply,
    ) -> Result<()> {
        let _ = (inputs, options, cancel, reply);
        Err(cannot_embed())
    }
    /// The length of an embedding without `dimensions` (0: the engine cannot embed).
    fn embedding_width(&self) -> usize {
        0
    }
    /// A snapshot of the engine's metrics.
    fn metrics(&self) -> EngineMetrics;
    /// The context length: prompt plus generated tokens.
    fn max_seq_len(&self) -> usize;
    /// How the model writes tool calls (from its chat template).
    fn tool_format(&self) -> crate::tools::ToolFormat {
        crate::tools::ToolFormat::Hermes
    }
    /// Whether the engine still runs (false: it stopped for good; `/health` answers 503
    /// so that an orchestrator restarts the replica).
    fn is_alive(&self) -> bool {
        true
    }
    /// The LoRA adapters requests may name in `model` (none by default).
    fn adapters(&self) -> Vec<AdapterInfo> {
        Vec::new()
    }
    /// Whether `name` is one of [`adapters`](Self::adapters).
    fn has_adapter(&self, name: &str) -> bool {
        self.adapters().iter().any(|a| a.name == name)
    }
    /// Reads the adapter at `path` and serves it as `name` (see
    /// [`AdapterRegistry::register`](crate::lora::AdapterRegistry::register)). Called on
    /// a blocking thread.
    ///
    /// # Errors
    ///
    /// What registering reports; by default, [`LlamaError::InvalidParameter`]: the
    /// engine serves no adapters.
    fn load_adapter(&self, name: &str, path: &std::path::Path) -> Result<AdapterInfo> {
        let _ = path;
        Err(LlamaError::invalid(
            "lora_name",
            name,
            "this engine serves no LoRA adapters",
        ))
    }
    /// Stops serving the adapter `name` (requests running with it finish).
    ///
    /// # Errors
    ///
    /// [`LlamaError::UnknownAdapter`] if there is none of that name.
    fn unload_adapter(&self, name: &str) -> Result<()> {
        Err(LlamaError::UnknownAdapter(name.to_string()))
    }
}

/// What an engine that cannot embed answers.
fn cannot_embed() -> LlamaError {
    LlamaError::invalid("input", "(any)", "this engine cannot make embeddings")
}

impl<B: LlamaBackend, T: Tokenizer> Engine for ContinuousEngine<B, T>
where
    ContinuousEngine<B, T>: Send + Sync,
{
    fn submit(
        &self,
        request: GenerateRequest,
        cancel: CancelToken,
        scope: Scope,
        on_event: EventHandler,
    ) -> Result<()> {
        self.submit_scoped(request, cancel, scope, on_event)
            .map(drop)
    }

    fn encode(&self, request: &GenerateRequest) -> Result<Vec<u32>> {
        ContinuousEngine::encode(self, request)
    }

    fn decode(&self, ids: &[u32]) -> Result<String> {
        ContinuousEngine::decode(self, ids)
    }

    fn encode_text(&self, text: &str) -> Result<Vec<u32>> {
        ContinuousEngine::encode_text(self, text)
    }

    fn embed_to(
        &self,
        inputs: Vec<Vec<u32>>,
        options: crate::embed::EmbeddingOptions,
        cancel: CancelToken,
        reply: crate::inference::EmbedReply,
    ) -> Result<()> {
        ContinuousEngine::embed_to(self, inputs, options, cancel, reply)
    }

    fn embedding_width(&self) -> usize {
        ContinuousEngine::embedding_width(self)
    }

    fn is_alive(&self) -> bool {
        ContinuousEngine::is_alive(self)
    }

    fn adapters(&self) -> Vec<AdapterInfo> {
        ContinuousEngine::adapters(self).list()
    }

    fn has_adapter(&self, name: &str) -> bool {
        ContinuousEngine::adapters(self).contains(name)
    }

    fn load_adapter(&self, name: &str, path: &std::path::Path) -> Result<AdapterInfo> {
        ContinuousEngine::adapters(self).register(name, path)
    }

    fn unload_adapter(&self, name: &str) -> Result<()> {
        ContinuousEngine::adapters(self).remove(name)
    }

    fn metrics(&self) -> EngineMetrics {
        ContinuousEngine::metrics(self)
    }

    fn max_seq_len(&self) -> usize {
        ContinuousEngine::max_seq_len(self)
    }

    fn tool_format(&self) -> crate::tools::ToolFormat {
        ContinuousEngine::tool_format(self)
    }
}

/// Settings of a [`Server`]. Every limit is checked before any work is done for a
/// request, and before anything proportional to its size is allocated beyond its body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// The model id clients use (`/v1/models`, the `model` field).
    pub served_model_name: String,
    /// When set, `/v1/*` requires `Authorization: Bearer <api_key>`. The key is tenant
    /// `default`; [`ServerConfig::tenants`] adds more.
    pub api_key: Option<String>,
    /// More API keys, each a tenant: `(tenant name, key)`.
    pub tenants: Vec<(String, String)>,
    /// When set, `/metrics` requires `Authorization: Bearer <metrics_key>` (API keys do
    /// not open it) and shows the per-tenant counters. Unset, `/metrics` is open (for
    /// scrapers) and does not name tenants.
    pub metrics_key: Option<String>,
    /// When set, the admin routes (`POST /v1/load_lora_adapter` and
    /// `/v1/unload_lora_adapter`, vLLM's) take `Authorization: Bearer <admin_key>` (API
    /// keys do not open them). Unset, they answer 403: loading reads a path on the
    /// server's disk, which no API client should name.
    pub admin_key: Option<String>,
    /// Largest request body in bytes (larger ones get 413).
    pub max_body_bytes: usize,
    /// Most choices (`n`) per request.
    pub max_n: usize,
    /// Most prompts in one `/v1/completions` request, and inputs in one
    /// `/v1/embeddings` request.
    pub max_prompts: usize,
    /// Bytes of stored `/v1/responses` (all tenants together; the oldest go first).
    pub response_store_bytes: usize,
    /// How long a stored response is kept.
    pub response_ttl: Duration,
    /// How `/v1/embeddings` pools an input's hidden states (last token by default, what
    /// decoder-only embedding models are trained for).
    pub embedding_pooling: crate::embed::Pooling,
    /// Most choices (prompts x `n`) in one request: also its most waiting-queue slots.
    pub max_choices: usize,
    /// Most choices one tenant may have in flight (waiting or running) at once; more
    /// get 429, so one tenant's burst leaves room for the others.
    pub max_choices_per_tenant: usize,
    /// Most stop strings per request.
    pub max_stop_strings: usize,
    /// Most bytes of all stop strings of a request together.
    pub max_stop_bytes: usize,
    /// Most messages in one chat request.
    pub max_messages: usize,
    /// Deepest JSON nesting of a request body (objects and arrays).
    pub max_json_depth: usize,
    /// Longest wait for the whole request body once its headers are read (408 after).
    pub body_timeout: Duration,
    /// Events (tokens) one request may have produced and not yet sent to its client;
    /// beyond it the client is taken to have stopped reading and the request is
    /// cancelled (its KV blocks freed).
    pub max_unsent_events: usize,
    /// Interval of the SSE keep-alive comments on streams.
    pub sse_keep_alive: Duration,
    /// Threads that tokenize prompts (off the engine thread): most requests tokenized
    /// at once.
    pub tokenizer_threads: usize,
    /// Most requests waiting for a tokenizer thread; more get 429. Each holds at most
    /// its body's prompts, so the pool holds at most `(tokenizer_threads +
    /// tokenizer_queue) x max_body_bytes`.
    pub tokenizer_queue: usize,
    /// [`Server::serve`]: longest wait for a request's headers, from the connection's
    /// start or the end of its previous response (so also the idle keep-alive timeout).
    pub header_timeout: Duration,
    /// [`Server::serve`]: longest a write to a client may stay blocked (the client not
    /// reading) before the connection is closed and its request cancelled.
    pub write_timeout: Duration,
    /// [`Server::serve`]: most open connections; more wait in the kernel's accept queue.
    pub max_connections: usize,
    /// Most requests of one tenant in the tokenizer pool at once (tokenizing or waiting
    /// for a thread); more get 429, so one tenant cannot fill the pool's queue and lock
    /// the others out. Not applied to requests with no tenant (see
    /// [`trust_forwarded_for`](Self::trust_forwarded_for)).
    pub max_tokenizing_per_tenant: usize,
    /// Without API keys a request's tenant is its connection's peer address (a tenant per
    /// client machine; the `user` field does not make tenants: a client picks it
    /// freely). Behind a reverse proxy every request comes from the proxy: set this to
    /// take the peer from the last address of the last `X-Forwarded-For` header (the
    /// one the proxy adds), and only behind a proxy that adds it (HAProxy's
    /// `option forwardfor`). A router served other than by [`Server::serve`] knows no
    /// peer: its requests without a key share one uncapped tenant, `anonymous`.
    pub trust_forwarded_for: bool,
    /// `max_tokens` when a request gives none (`None`: up to the context length).
    /// `/v1/completions` defaults to 16, as OpenAI's does.
    pub default_max_tokens: Option<usize>,
    /// Most bytes of a request's structured-output constraint (`response_format`'s or
    /// `structured_outputs`' schema serialized, regex, grammar or choices), checked
    /// before it is compiled. Default 64 KiB.
    pub max_constraint_bytes: usize,
}

impl ServerConfig {
    /// Defaults for a model served as `served_model_name`: no API key, 2 MiB bodies,
    /// `n` up to 16, 64 prompts and 64 choices per request, 128 choices per tenant, 4
    /// stop strings of 1024 bytes together, 512 messages, JSON nesting 32, 30 s for the
    /// body, 1024 unsent events, keep-alive comments every 15 s, 2 tokenizer threads and
    /// 64 requests waiting for them (16 of one tenant), 10 s for headers (and idle
    /// keep-alive), 30 s blocked writes, 1024 connections, chat answers up to the
    /// context length, tenants by connection peer without API keys.
    pub fn new(served_model_name: impl Into<String>) -> Self {
        Self {
            served_model_name: served_model_name.into(),
            api_key: None,
            tenants: Vec::new(),
            metrics_key: None,
            admin_key: None,
            max_body_bytes: 2 * 1024 * 1024,
            max_n: 16,
            max_prompts: 64,
            embedding_pooling: crate::embed::Pooling::Last,
            response_store_bytes: 64 * 1024 * 1024,
            response_ttl: Duration::from_secs(3600),
            max_choices: 64,
            max_choices_per_tenant: 128,
            max_stop_strings: 4,
            max_stop_bytes: 1024,
            max_messages: 512,
            max_json_depth: 32,
            body_timeout: Duration::from_secs(30),
            max_unsent_events: 1024,
            sse_keep_alive: Duration::from_secs(15),
            tokenizer_threads: 2,
            tokenizer_queue: 64,
            header_timeout: Duration::from_secs(10),
            write_timeout: Duration::from_secs(30),
            max_connections: 1024,
            default_max_tokens: None,
            max_constraint_bytes: 64 * 1024,
            max_tokenizing_per_tenant: 16,
            trust_forwarded_for: false,
        }
    }

    /// Requires this API key.
    #[must_use]
    pub fn with_api_key(mut self, key: impl Into<String>) -> Self {
        self.api_key = Some(key.into());
        self
    }

    /// Adds a tenant with its own API key (API keys become required).
    #[must_use]
    pub fn with_tenant(mut self, name: impl Into<String>, key: impl Into<String>) -> Self {
        self.tenants.push((name.into(), key.into()));
        self
    }

    /// Sets the body size limit.
    #[must_use]
    pub fn with_max_body_bytes(mut self, bytes: usize) -> Self {
        self.max_body_bytes = bytes;
        self
    }

    /// Every API key with its tenant name: the `api_key` (tenant `default`) first.
    pub(crate) fn keys(&self) -> impl Iterator<Item = (&str, &str)> {
        self.api_key
            .iter()
            .map(|k| ("default", k.as_str()))
            .chain(self.tenants.iter().map(|(n, k)| (n.as_str(), k.as_str())))
    }
}

/// State shared by the routes.
pub(crate) struct Shared {
    config: ServerConfig,
    engine: OnceLock<Arc<dyn Engine>>,
    shutting_down: AtomicBool,
    next_id: AtomicU64,
    in_flight: AtomicUsize,
    /// Cancellation of every engine request in flight, by API request.
    running: Mutex<HashMap<u64, Vec<CancelToken>>>,
    /// Choices in flight per tenant (entries leave at 0, so the map holds only tenants
    /// with requests in flight).
    tenants: Mutex<HashMap<String, usize>>,
    /// Requests in the tokenizer pool per tenant (entries leave at 0).
    tokenizing: Mutex<HashMap<String, usize>>,
    metrics: ServerMetrics,
    /// Where prompts are tokenized.
    tokenizer: tokenize::TokenizerPool,
    /// `/v1/responses`' stored responses.
    responses: response_store::ResponseStore,
    /// Unix time the server was made (the model's `created`).
    created: u64,
}

impl Shared {
    /// The engine, or 503 while loading or shutting down.
    fn engine(&self) -> std::result::Result<Arc<dyn Engine>, ApiError> {
        if self.shutting_down.load(Ordering::Acquire) {
            return Err(ApiError::unavailable("the server is shutting down"));
        }
        let engine = self
            .engine
            .get()
            .cloned()
            .ok_or_else(|| ApiError::unavailable("the model is still loading"))?;
        if !engine.is_alive() {
            return Err(ApiError::unavailable(
                "the engine has stopped; this replica must be restarted",
            ));
        }
        Ok(engine)
    }

    /// A new API request in flight.
    fn register(&self) -> u64 {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        if let Ok(mut running) = self.running.lock() {
            running.insert(id, Vec::new());
        }
        id
    }

    /// Remembers an engine request of API request `id`, to cancel it at shutdown.
    fn track(&self, id: u64, cancel: CancelToken) {
        if let Ok(mut running) = self.running.lock() {
            running.entry(id).or_default().push(cancel);
        }
    }

    /// Takes `choices` of `tenant`'s share, or 429 when that passes
    /// [`ServerConfig::max_choices_per_tenant`] (unless not `capped`: requests with no
    /// tenant at all share the engine's queue as before). The share comes back when the
    /// slot is dropped.
    fn reserve(
        self: &Arc<Self>,
        tenant: &str,
        choices: usize,
        capped: bool,
    ) -> std::result::Result<TenantSlot, ApiError> {
        self.take(Ledger::Choices, tenant, choices, capped)
    }

    /// Takes a place of `tenant` in the tokenizer pool, or 429 past
    /// [`ServerConfig::max_tokenizing_per_tenant`] (unless not `capped`).
    fn enter_tokenizer(
        self: &Arc<Self>,
        tenant: &str,
        capped: bool,
    ) -> std::result::Result<TenantSlot, ApiError> {
        self.take(Ledger::Tokenizing, tenant, 1, capped)
    }

    fn ledger(&self, ledger: Ledger) -> &Mutex<HashMap<String, usize>> {
        match ledger {
            Ledger::Choices => &self.tenants,
            Ledger::Tokenizing => &self.tokenizing,
        }
    }

    /// Takes `count` of `tenant`'s share of `ledger`: its configured limit when `capped`,
    /// none otherwise.
    fn take(
        self: &Arc<Self>,
        ledger: Ledger,
        tenant: &str,
        count: usize,
        capped: bool,
    ) -> std::result::Result<TenantSlot, ApiError> {
        let limit = match (capped, ledger) {
            (false, _) => usize::MAX,
            (true, Ledger::Choices) => self.config.max_choices_per_tenant,
            (true, Ledger::Tokenizing) => self.config.max_tokenizing_per_tenant,
        };
        let mut counts = self
            .ledger(ledger)
            .lock()
            .map_err(|_| ApiError::internal("the tenant table is poisoned"))?;
        let in_flight = counts.get(tenant).copied().unwrap_or(0);
        if in_flight.saturating_add(count) > limit {
            let (resource, param) = match ledger {
                Ledger::Choices => (
                    "choices in flight of this tenant (--max-choices-per-tenant)",
                    "n",
                ),
                Ledger::Tokenizing => (
                    "requests of this tenant waiting for tokenization \
                     (--max-tokenizing-per-tenant)",
                    "prompt",
                ),
            };
            return Err(ApiError::from_llama(
                &LlamaError::Overloaded {
                    resource,
                    in_use: in_flight,
                    requested: count,
                    limit,
                },
                param,
            ));
        }
        counts.insert(tenant.to_string(), in_flight + count);
        Ok(TenantSlot {
            shared: self.clone(),
            ledger,
            tenant: tenant.to_string(),
            choices: count,
        })
    }

    /// API request `id` is over.
    fn unregister(&self, id: u64) {
        if let Ok(mut running) = self.running.lock() {
            running.remove(&id);
        }
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A tenant's share taken by one API request; given back when dropped.
pub(crate) struct TenantSlot {
    shared: Arc<Shared>,
    ledger: Ledger,
    tenant: String,
    choices: usize,
}

/// What a [`TenantSlot`] holds a share of.
#[derive(Debug, Clone, Copy)]
enum Ledger {
    /// Choices in flight.
    Choices,
    /// Requests in the tokenizer pool.
    Tokenizing,
}

impl Drop for TenantSlot {
    fn drop(&mut self) {
        if let Ok(mut tenants) = self.shared.ledger(self.ledger).lock()
            && let Some(n) = tenants.get_mut(&self.tenant)
        {
            *n = n.saturating_sub(self.choices);
            if *n == 0 {
                tenants.remove(&self.tenant);
            }
        }
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The server: its state and its routes. Cheap to clone (one shared state).
#[derive(Clone)]
pub struct Server {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("config", &self.shared.config)
            .field("ready", &self.is_ready())
            .field("in_flight", &self.in_flight())
            .finish_non_exhaustive()
    }
}

impl Server {
    /// A server without a model yet: `/health` and `/v1/*` answer 503 until
    /// [`Server::set_engine`].
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidParameter`] for an empty model name, a limit of 0 or an empty
    /// API key.
    pub fn new(config: ServerConfig) -> Result<Self> {
        if config.served_model_name.is_empty() {
            return Err(LlamaError::invalid(
                "served_model_name",
                "\"\"",
                "must not be empty",
            ));
        }
        let limits = [
            ("max_n", config.max_n),
            ("max_body_bytes", config.max_body_bytes),
            ("max_prompts", config.max_prompts),
            ("max_choices", config.max_choices),
            ("max_choices_per_tenant", config.max_choices_per_tenant),
            (
                "max_tokenizing_per_tenant",
                config.max_tokenizing_per_tenant,
            ),
            ("max_messages", config.max_messages),
            ("max_json_depth", config.max_json_depth),
            ("max_unsent_events", config.max_unsent_events),
            ("max_connections", config.max_connections),
            ("tokenizer_threads", config.tokenizer_threads),
            ("max_constraint_bytes", config.max_constraint_bytes),
        ];
        for (name, value) in limits {
            if value == 0 {
                return Err(LlamaError::invalid(name, 0, "must be at least 1"));
            }
        }
        if config.max_stop_strings > openai::MAX_STOP_STRINGS {
            return Err(LlamaError::invalid(
                "max_stop_strings",
                config.max_stop_strings,
                "OpenAI's limit is 4",
            ));
        }
        let timeouts = [
            ("body_timeout", config.body_timeout),
            ("header_timeout", config.header_timeout),
            ("write_timeout", config.write_timeout),
            ("sse_keep_alive", config.sse_keep_alive),
        ];
        for (name, value) in timeouts {
            if value.is_zero() {
                return Err(LlamaError::invalid(name, 0, "must be positive"));
            }
        }
        if config.keys().any(|(_, key)| key.is_empty())
            || config.metrics_key.as_deref() == Some("")
            || config.admin_key.as_deref() == Some("")
        {
            return Err(LlamaError::invalid("api_key", "\"\"", "must not be empty"));
        }
        // A key names one tenant: the same key for two would make the second
        // unreachable (its requests counted, capped and cached as the first's). One
        // tenant may have several keys (a key being rotated).
        let keys: Vec<(&str, &str)> = config.keys().collect();
        for (i, &(name, key)) in keys.iter().enumerate() {
            if let Some(&(other, _)) = keys[..i].iter().find(|&&(_, k)| k == key) {
                return Err(LlamaError::invalid(
                    "tenants",
                    format!("`{name}` and `{other}` with one key"),
                    "each API key must be one tenant's",
                ));
            }
        }
        let metrics = ServerMetrics::new(&config.served_model_name)?;
        let tokenizer =
            tokenize::TokenizerPool::new(config.tokenizer_threads, config.tokenizer_queue);
        let (config_store_bytes, config_store_ttl) =
            (config.response_store_bytes, config.response_ttl);
        Ok(Self {
            shared: Arc::new(Shared {
                config,
                engine: OnceLock::new(),
                shutting_down: AtomicBool::new(false),
                next_id: AtomicU64::new(0),
                in_flight: AtomicUsize::new(0),
                running: Mutex::new(HashMap::new()),
                tenants: Mutex::new(HashMap::new()),
                tokenizing: Mutex::new(HashMap::new()),
                metrics,
                tokenizer,
                responses: response_store::ResponseStore::new(config_store_bytes, config_store_ttl),
                created: unix_now(),
            }),
        })
    }

    /// Puts the loaded engine in service; the server is ready from now on.
    ///
    /// # Errors
    ///
    /// [`LlamaError::Runtime`] if an engine was set before.
    pub fn set_engine(&self, engine: Arc<dyn Engine>) -> Result<()> {
        self.shared
            .engine
            .set(engine)
            .map_err(|_| LlamaError::Runtime("the server already has an engine".into()))
    }

    /// The configuration.
    pub fn config(&self) -> &ServerConfig {
        &self.shared.config
    }

    /// Whether the server has its engine and is not shutting down.
    pub fn is_ready(&self) -> bool {
        self.shared.engine.get().is_some() && !self.shared.shutting_down.load(Ordering::Acquire)
    }

    /// API requests being answered now.
    pub fn in_flight(&self) -> usize {
        self.shared.in_flight.load(Ordering::Acquire)
    }

    /// From now on new requests get 503 and `/health` says so; running ones go on.
    pub fn begin_shutdown(&self) {
        self.shared.shutting_down.store(true, Ordering::Release);
    }

    /// Cancels every request in flight (their clients get an error); returns how many
    /// API requests that concerned.
    pub fn cancel_all(&self) -> usize {
        let Ok(running) = self.shared.running.lock() else {
            return 0;
        };
        for cancel in running.values().flatten() {
            cancel.cancel();
        }
        running.len()
    }

    /// Graceful shutdown: refuses new requests, waits up to `timeout` for the running
    /// ones to finish, then cancels the rest and waits (briefly) for them to end.
    /// Returns how many were cancelled.
    pub async fn drain(&self, timeout: Duration) -> usize {
        self.begin_shutdown();
        let deadline = Instant::now() + timeout;
        while self.in_flight() > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if self.in_flight() == 0 {
            return 0;
        }
        let cancelled = self.cancel_all();
        let grace = Instant::now() + Duration::from_secs(2);
        while self.in_flight() > 0 && Instant::now() < grace {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        cancelled
    }

    /// The routes, ready to serve or to mount in a larger [`axum::Router`].
    pub fn router(&self) -> axum::Router {
        routes::router(self.shared.clone())
    }
}

/// Builds the router over a running `engine`: the shortest way to serve one.
///
/// # Errors
///
/// As [`Server::new`].
pub fn router(engine: Arc<dyn Engine>, config: ServerConfig) -> Result<axum::Router> {
    let server = Server::new(config)?;
    server.set_engine(engine)?;
    Ok(server.router())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(config: ServerConfig) -> (&'static str, String) {
        match Server::new(config) {
            Err(LlamaError::InvalidParameter { name, value, .. }) => (name, value),
            Err(e) => panic!("another error: {e}"),
            Ok(_) => panic!("accepted"),
        }
    }

    #[test]
    fn empty_and_shared_keys_are_refused() {
        let base = || ServerConfig::new("m");
        // An empty key would turn authentication off (or open /metrics) silently.
        assert_eq!(refused(base().with_api_key("")).0, "api_key");
        assert_eq!(refused(base().with_tenant("a", "")).0, "api_key");
        let mut metrics = base();
        metrics.metrics_key = Some(String::new());
        assert_eq!(refused(metrics).0, "api_key");
        // One key, two tenants: the second could never be told apart.
        let (name, value) = refused(base().with_tenant("a", "k1").with_tenant("b", "k1"));
        assert_eq!(
            (name, value.as_str()),
            ("tenants", "`b` and `a` with one key")
        );
        let (_, value) = refused(base().with_api_key("k1").with_tenant("b", "k1"));
        assert_eq!(value, "`b` and `default` with one key");
        // One tenant with two keys (a key being rotated) is fine.
        Server::new(base().with_tenant("a", "k1").with_tenant("a", "k2")).unwrap();
    }
}
