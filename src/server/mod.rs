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
//! Errors have OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`). A
//! request whose client disconnects is cancelled and its KV blocks are freed at the
//! engine's next step. The `llama-burn-server` binary serves a model file this way.
//!
//! ```no_run
//! # async fn serve() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use llama_burn::backend::{DefaultBackend, default_device};
//! use llama_burn::inference::{ContinuousConfig, ContinuousEngine};
//! use llama_burn::llama::LlamaConfig;
//! use llama_burn::server::{Server, ServerConfig};
//!
//! let llama = LlamaConfig::load_gguf::<DefaultBackend>(
//!     llama_burn::demo::demo_model_path()?, 2048, &default_device())?;
//! let engine = ContinuousEngine::start(llama, ContinuousConfig::default())?;
//! let server = Server::new(ServerConfig::new("smollm2"))?;
//! server.set_engine(Arc::new(engine))?;
//! let app = axum::Router::new().nest("/llm", server.router()); // or serve it alone
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! axum::serve(listener, app).await?;
//! # Ok(())
//! # }
//! ```

mod error;
mod generation;
pub mod metrics;
pub mod openai;
mod routes;
mod stop;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub use error::ApiError;
pub use metrics::ServerMetrics;
pub use stop::{StopMatcher, StopOutput};

use crate::backend::LlamaBackend;
use crate::error::{LlamaError, Result};
use crate::inference::{
    CancelToken, ContinuousEngine, EngineMetrics, EventHandler, GenerateRequest,
};
use crate::tokenizer::Tokenizer;

/// What the server needs from an engine. [`ContinuousEngine`] implements it whatever
/// its backend and tokenizer, so the router is not generic.
pub trait Engine: Send + Sync + 'static {
    /// Queues `request`, cancelled through `cancel`, its events delivered to
    /// `on_event`: first [`EngineEvent::Accepted`](crate::inference::EngineEvent::Accepted)
    /// or the `Done` error that refuses it (see [`ContinuousEngine::submit_to`]).
    fn submit(
        &self,
        request: GenerateRequest,
        cancel: CancelToken,
        on_event: EventHandler,
    ) -> Result<()>;
    /// A snapshot of the engine's metrics.
    fn metrics(&self) -> EngineMetrics;
    /// The context length: prompt plus generated tokens.
    fn max_seq_len(&self) -> usize;
}

impl<B: LlamaBackend, T: Tokenizer> Engine for ContinuousEngine<B, T>
where
    ContinuousEngine<B, T>: Send + Sync,
{
    fn submit(
        &self,
        request: GenerateRequest,
        cancel: CancelToken,
        on_event: EventHandler,
    ) -> Result<()> {
        self.submit_to(request, cancel, on_event).map(drop)
    }

    fn metrics(&self) -> EngineMetrics {
        ContinuousEngine::metrics(self)
    }

    fn max_seq_len(&self) -> usize {
        ContinuousEngine::max_seq_len(self)
    }
}

/// Settings of a [`Server`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// The model id clients use (`/v1/models`, the `model` field).
    pub served_model_name: String,
    /// When set, `/v1/*` requires `Authorization: Bearer <api_key>`.
    pub api_key: Option<String>,
    /// Largest request body in bytes (larger ones get 413).
    pub max_body_bytes: usize,
    /// Most choices (`n`) per request.
    pub max_n: usize,
    /// `max_tokens` when a request gives none (`None`: up to the context length).
    /// `/v1/completions` defaults to 16, as OpenAI's does.
    pub default_max_tokens: Option<usize>,
}

impl ServerConfig {
    /// Defaults for a model served as `served_model_name`: no API key, 2 MiB bodies,
    /// `n` up to 16, chat answers up to the context length.
    pub fn new(served_model_name: impl Into<String>) -> Self {
        Self {
            served_model_name: served_model_name.into(),
            api_key: None,
            max_body_bytes: 2 * 1024 * 1024,
            max_n: 16,
            default_max_tokens: None,
        }
    }

    /// Requires this API key.
    #[must_use]
    pub fn with_api_key(mut self, key: impl Into<String>) -> Self {
        self.api_key = Some(key.into());
        self
    }

    /// Sets the body size limit.
    #[must_use]
    pub fn with_max_body_bytes(mut self, bytes: usize) -> Self {
        self.max_body_bytes = bytes;
        self
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
    metrics: ServerMetrics,
    /// Unix time the server was made (the model's `created`).
    created: u64,
}

impl Shared {
    /// The engine, or 503 while loading or shutting down.
    fn engine(&self) -> std::result::Result<Arc<dyn Engine>, ApiError> {
        if self.shutting_down.load(Ordering::Acquire) {
            return Err(ApiError::unavailable("the server is shutting down"));
        }
        self.engine
            .get()
            .cloned()
            .ok_or_else(|| ApiError::unavailable("the model is still loading"))
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

    /// API request `id` is over.
    fn unregister(&self, id: u64) {
        if let Ok(mut running) = self.running.lock() {
            running.remove(&id);
        }
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
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
    /// [`LlamaError::InvalidParameter`] for an empty model name, `max_n` of 0 or a body
    /// limit of 0.
    pub fn new(config: ServerConfig) -> Result<Self> {
        if config.served_model_name.is_empty() {
            return Err(LlamaError::invalid(
                "served_model_name",
                "\"\"",
                "must not be empty",
            ));
        }
        if config.max_n == 0 {
            return Err(LlamaError::invalid("max_n", 0, "must be at least 1"));
        }
        if config.max_body_bytes == 0 {
            return Err(LlamaError::invalid(
                "max_body_bytes",
                0,
                "must be at least 1",
            ));
        }
        let metrics = ServerMetrics::new(&config.served_model_name)?;
        Ok(Self {
            shared: Arc::new(Shared {
                config,
                engine: OnceLock::new(),
                shutting_down: AtomicBool::new(false),
                next_id: AtomicU64::new(0),
                in_flight: AtomicUsize::new(0),
                running: Mutex::new(HashMap::new()),
                metrics,
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
