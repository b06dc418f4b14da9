//! `llama-burn-server`: an OpenAI-compatible HTTP server for one model.
//!
//! ```sh
//! cargo run --release --features server --bin llama-burn-server -- --port 8080
//! curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \
//!   -d '{"model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "user", "content": "Hi!"}]}'
//! ```
//!
//! Without `--model` it serves the demo model (fetched on first use). The backend is the
//! one the cargo features choose (`--features server,cuda` serves on a GPU). On SIGINT or
//! SIGTERM it refuses new requests (503), lets running ones finish for up to
//! `--shutdown-timeout` seconds, cancels the rest and exits with status 0.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use llama_burn::Loader;
use llama_burn::backend::{DefaultBackend, default_device};
use llama_burn::inference::{ContinuousConfig, ContinuousEngine};
use llama_burn::llama::Llama;
use llama_burn::server::{Engine, Server, ServerConfig};
use llama_burn::tokenizer::Tokenizer;
use tracing_subscriber::EnvFilter;

#[derive(Parser, Debug)]
#[command(
    name = "llama-burn-server",
    version,
    about = "An OpenAI-compatible server for a Llama-family model"
)]
struct Args {
    /// Print the server's OpenAPI 3.1 description (what `/openapi.json` serves) and exit,
    /// without loading a model.
    #[arg(long)]
    print_openapi: bool,
    /// A .gguf file or a Hugging Face model directory (default: the demo model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0 picks a free one).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on /v1 routes; repeat for several keys, each
    /// its own tenant (`key-1`, `key-2`, ...). Default: the LLAMA_BURN_API_KEY
    /// environment variable, if set.
    #[arg(long, env = "LLAMA_BURN_API_KEY", hide_env_values = true)]
    api_key: Vec<String>,
    /// A file of API keys, one a line: `TENANT:KEY` (or `KEY`, named `key-N`); blank
    /// lines and lines starting with `#` are skipped.
    #[arg(long)]
    api_keys_file: Option<PathBuf>,
    /// Require `Authorization: Bearer KEY` on /metrics (API keys do not open it). Without
    /// it /metrics is open, for scrapers, and does not name tenants (their per-tenant
    /// counters are shown only behind this key).
    #[arg(long, env = "LLAMA_BURN_METRICS_KEY", hide_env_values = true)]
    metrics_key: Option<String>,
    /// Open the admin routes (`POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`)
    /// to `Authorization: Bearer KEY` (API keys do not open them). Without it they
    /// answer 403.
    #[arg(long, env = "LLAMA_BURN_ADMIN_KEY", hide_env_values = true)]
    admin_key: Option<String>,
    /// Serve a LoRA adapter of the model as `NAME` (a request selects it with
    /// `"model": "NAME"`; `/v1/models` lists it): `NAME=PATH`, PATH a PEFT directory
    /// (`adapter_config.json`, `adapter_model.safetensors`) or a GGUF LoRA file.
    /// Repeatable.
    #[arg(long, value_name = "NAME=PATH")]
    lora: Vec<String>,
    /// Most LoRA adapters held in memory at once; one more (a request for an adapter
    /// that was evicted, or a load) evicts the least recently used one that no request
    /// is running with, and an evicted adapter is read again from its path when asked.
    #[arg(long, default_value_t = 8)]
    max_loras: usize,
    /// Most choices (`n`) per request.
    #[arg(long, default_value_t = 16)]
    max_n: usize,
    /// Most prompts in one /v1/completions request, and inputs in one /v1/embeddings
    /// request.
    #[arg(long, default_value_t = 64)]
    max_prompts: usize,
    /// How /v1/embeddings pools an input's final hidden states: `last` (the last token's,
    /// for decoder-only embedding models) or `mean`.
    #[arg(long, default_value = "last")]
    embedding_pooling: llama_burn::embed::Pooling,
    /// Bytes of stored /v1/responses, all tenants together (the oldest go first).
    #[arg(long, default_value_t = 64 * 1024 * 1024)]
    response_store_bytes: usize,
    /// Seconds a stored response is kept.
    #[arg(long, default_value_t = 3600)]
    response_ttl: u64,
    /// Most choices (prompts x n) in one request: its most slots of the waiting queue.
    #[arg(long, default_value_t = 64)]
    max_choices: usize,
    /// Most choices one tenant may have in flight at once (more get 429). A tenant is an
    /// API key, or without keys a client address (see --trust-forwarded-for).
    #[arg(long, default_value_t = 128)]
    max_choices_per_tenant: usize,
    /// Most requests of one tenant in the tokenizer queue at once (more get 429).
    #[arg(long, default_value_t = 16)]
    max_tokenizing_per_tenant: usize,
    /// Without API keys, take a request's client address (its tenant) from the last
    /// entry of the X-Forwarded-For header instead of the connection's peer. Only behind
    /// a proxy that adds that header (HAProxy's `option forwardfor`): a client could
    /// otherwise write it.
    #[arg(long)]
    trust_forwarded_for: bool,
    /// Most stop strings per request (at most 4, OpenAI's limit).
    #[arg(long, default_value_t = 4)]
    max_stop_strings: usize,
    /// Most bytes of a request's stop strings together.
    #[arg(long, default_value_t = 1024)]
    max_stop_bytes: usize,
    /// Most messages in one chat request.
    #[arg(long, default_value_t = 512)]
    max_messages: usize,
    /// Deepest JSON nesting of a request body.
    #[arg(long, default_value_t = 32)]
    max_json_depth: usize,
    /// Most bytes of a request's structured-output constraint (JSON Schema, regex,
    /// grammar or choices), checked before it is compiled.
    #[arg(long, default_value_t = 64 * 1024)]
    max_constraint_bytes: usize,
    /// Seconds to wait for a request's headers (also the idle keep-alive timeout).
    #[arg(long, default_value_t = 10.0)]
    header_timeout: f64,
    /// Seconds to wait for a request's body once its headers are in (408 after).
    #[arg(long, default_value_t = 30.0)]
    body_timeout: f64,
    /// Seconds a write may stay blocked (client not reading) before the connection is
    /// closed and its request cancelled.
    #[arg(long, default_value_t = 30.0)]
    write_timeout: f64,
    /// Most open connections; more wait in the kernel's accept queue.
    #[arg(long, default_value_t = 1024)]
    max_connections: usize,
    /// Tokens a request may have generated and not yet sent before its client is taken
    /// to have stopped reading and the request is cancelled (per choice).
    #[arg(long, default_value_t = 1024)]
    max_unsent_events: usize,
    /// Seconds between SSE keep-alive comments on streams.
    #[arg(long, default_value_t = 15.0)]
    sse_keep_alive: f64,
    /// Threads that tokenize prompts, off the engine thread (most requests tokenized at
    /// once).
    #[arg(long, default_value_t = 2)]
    tokenizer_threads: usize,
    /// Most requests waiting for a tokenizer thread; more get 429.
    #[arg(long, default_value_t = 64)]
    tokenizer_queue: usize,
    /// Tests only: a step running a request whose prompt contains this text panics.
    #[arg(long, hide = true)]
    test_panic_marker: Option<String>,
    /// Tests only: the engine thread ends when it takes a request whose prompt contains
    /// this text (then /health and new requests answer 503).
    #[arg(long, hide = true)]
    test_exit_marker: Option<String>,
    /// The model id clients use (default: the model file's stem).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Most requests running at once.
    #[arg(long, default_value_t = 32)]
    max_running: usize,
    /// KV cache size in tokens (allocated once at start).
    #[arg(long, default_value_t = 32 * 1024)]
    kv_budget_tokens: usize,
    /// KV cache size in bytes instead of tokens: the pool holds as many blocks as fit,
    /// so smaller `--kv-cache-type-*` hold more tokens in the same memory.
    #[arg(long)]
    kv_budget_bytes: Option<usize>,
    /// How the KV cache stores keys: f32 (the activations' type), f16, bf16, q8_0 or
    /// q4_0 (the types other than f32 run on the CPU and CubeCL backends).
    #[arg(long, default_value = "f32")]
    kv_cache_type_k: llama_burn::cache::KvCacheType,
    /// How the KV cache stores values (as `--kv-cache-type-k`).
    #[arg(long, default_value = "f32")]
    kv_cache_type_v: llama_burn::cache::KvCacheType,
    /// Keep the prefix cache in this directory too, so cached prompts survive a restart:
    /// full KV blocks are written as they are made (never holding up a step) and read
    /// back at start; files of another model, version, precision or KV cache type, and
    /// damaged ones, are refused with a log line.
    #[arg(long)]
    prefix_cache_dir: Option<PathBuf>,
    /// Most bytes of prefix cache files kept in `--prefix-cache-dir` (oldest removed
    /// first).
    #[arg(long, default_value_t = 4 << 30)]
    prefix_cache_disk_bytes: u64,
    /// Most requests waiting for admission; more get 429.
    #[arg(long, default_value_t = 256)]
    max_waiting: usize,
    /// Context length (prompt plus generated tokens).
    #[arg(long, default_value_t = 2048)]
    max_seq_len: usize,
    /// How the CPU kernels multiply quantized weights: `fast` (8-bit activations,
    /// integer dot products) or `exact` (f32 activations, exactly dequantized weights).
    /// Default: `exact` for models under one billion parameters (the demo model: `fast`
    /// gains little there and changes its answers most), else `fast` where the CPU has
    /// integer kernels (x86-64 with AVX-512 VNNI or AVX2), else `exact`.
    #[arg(long)]
    precision: Option<llama_burn::Precision>,
    /// Quantize a Hugging Face checkpoint's f32/f16/bf16 matrices in memory at load
    /// (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q3_K, Q4_K, Q5_K or Q6_K; a matrix whose rows are
    /// not whole K-quant blocks of 256 stays dense).
    #[arg(long)]
    quantize: Option<llama_burn::kernels::QuantFormat>,
    /// Seconds running requests may take to finish after SIGINT/SIGTERM.
    #[arg(long, default_value_t = 30)]
    shutdown_timeout: u64,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 2 * 1024 * 1024)]
    max_body_bytes: usize,
    /// Speculative decoding for every request: `ngram` (prompt lookup) or `draft` (a
    /// smaller model of the family, --draft-model). The tokens are the same; copy-heavy
    /// requests run faster.
    #[arg(long)]
    speculative: Option<llama_burn::speculative::SpeculationMethod>,
    /// The draft model of `--speculative draft`: a .gguf file or a Hugging Face
    /// directory with the model's tokenizer.
    #[arg(long)]
    draft_model: Option<PathBuf>,
    /// Most tokens proposed per step with --speculative.
    #[arg(long, default_value_t = 8)]
    draft_tokens: usize,
    /// A forward step's fixed cost in units of one more position: proposals are
    /// verified only while they are expected to raise tokens per unit of cost (2 fits a
    /// small model on a CPU; a GPU's decode step is larger, 16-64).
    #[arg(long, default_value_t = llama_burn::speculative::DEFAULT_STEP_OVERHEAD)]
    step_overhead: u32,
}

type B = DefaultBackend;

fn served_name(args: &Args, path: &Path) -> String {
    if let Some(name) = &args.served_model_name {
        return name.clone();
    }
    let stem = if path.is_dir() {
        path.file_name()
    } else {
        path.file_stem()
    };
    stem.map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".to_string())
}

fn start_engine<T: Tokenizer>(
    llama: Llama<B, T>,
    config: ContinuousConfig,
) -> llama_burn::Result<Arc<dyn Engine>> {
    // Structured outputs and tools need the constraint engine's table of every token:
    // built here, once, rather than by the first constrained request (a third of a
    // second on the demo's 49k vocabulary).
    let start = std::time::Instant::now();
    match llama.constraint_vocab() {
        Ok(_) => tracing::info!(
            seconds = start.elapsed().as_secs_f64(),
            "constraint vocabulary built"
        ),
        Err(e) => {
            tracing::warn!(error = %e, "no constraint vocabulary: constrained requests will fail")
        }
    }
    let disk = config.prefix_cache_disk.is_some();
    let start = std::time::Instant::now();
    let engine = ContinuousEngine::start(llama, config)?;
    if disk {
        let m = engine.metrics();
        tracing::info!(
            loaded_blocks = m.prefix_disk_loaded_blocks,
            refused_files = m.prefix_disk_refused_files,
            seconds = start.elapsed().as_secs_f64(),
            "prefix cache read from disk"
        );
    }
    Ok(Arc::new(engine))
}

/// Loads `--draft-model` (if given) as `llama`'s draft model.
fn attach_draft<T: Tokenizer>(llama: &mut Llama<B, T>, args: &Args) -> llama_burn::Result<()> {
    let Some(path) = &args.draft_model else {
        return Ok(());
    };
    tracing::info!(model = %path.display(), "loading the draft model");
    let mut loader = Loader::path(path).max_seq_len(args.max_seq_len).quiet();
    if let Some(precision) = args.precision {
        loader = loader.precision(precision);
    }
    llama.set_draft_model(loader.load::<B>(&default_device())?)
}

/// Loads the model, logging progress, and starts the engine.
fn load(path: &Path, args: &Args) -> llama_burn::Result<Arc<dyn Engine>> {
    let config = ContinuousConfig {
        max_running: args.max_running,
        max_waiting: args.max_waiting,
        panic_marker: args.test_panic_marker.clone(),
        exit_marker: args.test_exit_marker.clone(),
        speculation: args
            .speculative
            .map(|method| llama_burn::speculative::SpeculationConfig {
                method,
                step_overhead: args.step_overhead,
                ..llama_burn::speculative::SpeculationConfig::ngram(args.draft_tokens)
            }),
        ..ContinuousConfig::default()
    }
    .with_max_lora_adapters(args.max_loras)
    .with_kv_budget_tokens(args.kv_budget_tokens)
    .with_kv_cache_types(args.kv_cache_type_k, args.kv_cache_type_v);
    let config = match args.kv_budget_bytes {
        Some(bytes) => config.with_kv_budget_bytes(bytes),
        None => config,
    };
    let config = match &args.prefix_cache_dir {
        Some(dir) => {
            let start = Instant::now();
            // How the loader changes the weights is part of the model's identity.
            let variant = format!("quantize {:?}", args.quantize);
            let model = llama_burn::cache::fingerprint_files(&[path.to_path_buf()], &variant)?;
            tracing::info!(
                dir = %dir.display(),
                seconds = start.elapsed().as_secs_f64(),
                "prefix cache on disk (model fingerprint {model:032x})"
            );
            config.with_prefix_cache_disk(llama_burn::cache::PrefixCacheDisk::new(
                dir,
                args.prefix_cache_disk_bytes,
                model,
            ))
        }
        None => config,
    };
    if args.kv_budget_bytes.is_none() && args.kv_budget_tokens < args.max_seq_len {
        tracing::warn!(
            "--kv-budget-tokens {} is below --max-seq-len {}: requests whose prompt plus \
             max_tokens exceed the KV budget (chat requests without max_tokens ask for the \
             whole context) are refused",
            args.kv_budget_tokens,
            args.max_seq_len
        );
    }
    let device = default_device();
    let start = Instant::now();
    tracing::info!(model = %path.display(), "loading the model");
    let mut last = 0;
    let progress = |done: usize, total: usize| {
        let percent = (done * 100).checked_div(total).unwrap_or(100);
        if percent >= last + 10 || (percent == 100 && last != 100) {
            last = percent;
            tracing::info!("loading: {percent}%");
        }
    };
    let mut loader = Loader::path(path)
        .max_seq_len(args.max_seq_len)
        .progress(progress);
    if let Some(format) = args.quantize {
        loader = loader.quantize(format);
    }
    if let Some(precision) = args.precision {
        loader = loader.precision(precision);
    }
    let mut llama = loader.load::<B>(&device)?;
    tracing::info!(precision = %llama.config().precision, "precision");
    attach_draft(&mut llama, args)?;
    let engine = start_engine(llama, config)?;
    for spec in &args.lora {
        let (name, path) = spec
            .split_once('=')
            .ok_or_else(|| llama_burn::LlamaError::invalid("lora", spec, "give NAME=PATH"))?;
        let info = engine.load_adapter(name, Path::new(path))?;
        tracing::info!(
            adapter = name,
            rank = info.rank,
            modules = ?info.modules,
            bytes = info.bytes,
            "LoRA adapter loaded"
        );
    }
    tracing::info!(seconds = start.elapsed().as_secs_f64(), "model loaded");
    Ok(engine)
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut terminate) => {
                tokio::select! {
                    _ = interrupt => {}
                    _ = terminate.recv() => {}
                }
            }
            Err(_) => {
                let _ = interrupt.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = interrupt.await;
    }
}

/// A positive number of seconds.
fn seconds(name: &str, value: f64) -> Result<Duration, String> {
    Duration::try_from_secs_f64(value)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| format!("--{name} must be a positive number of seconds, not {value}"))
}

/// The tenants: every `--api-key` (`key-1`, ...), then the keys file's.
fn tenants(args: &Args) -> Result<Vec<(String, String)>, String> {
    let mut keys: Vec<(String, String)> = Vec::new();
    for key in &args.api_key {
        // An empty key would turn authentication off without a word (an unset secret
        // in a container's environment, say): refused instead.
        if key.trim().is_empty() {
            return Err(
                "--api-key (or LLAMA_BURN_API_KEY) is empty: give a key, or leave \
                        it out to serve without authentication"
                    .into(),
            );
        }
        keys.push((format!("key-{}", keys.len() + 1), key.clone()));
    }
    if let Some(path) = &args.api_keys_file {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        for line in text.lines().map(str::trim) {
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (name, key) = match line.split_once(':') {
                Some((name, key)) => (name.trim().to_string(), key.trim().to_string()),
                None => (format!("key-{}", keys.len() + 1), line.to_string()),
            };
            if name.is_empty() || key.is_empty() {
                return Err(format!(
                    "{}: a line has an empty tenant or key",
                    path.display()
                ));
            }
            if keys.iter().any(|(n, _)| *n == name) {
                return Err(format!("{}: tenant `{name}` appears twice", path.display()));
            }
            keys.push((name, key));
        }
    }
    Ok(keys)
}

fn server_config(args: &Args, name: String) -> Result<ServerConfig, String> {
    let mut config = ServerConfig::new(name).with_max_body_bytes(args.max_body_bytes);
    config.tenants = tenants(args)?;
    config.metrics_key = match &args.metrics_key {
        Some(key) if key.trim().is_empty() => {
            return Err(
                "--metrics-key (or LLAMA_BURN_METRICS_KEY) is empty: give a key, or \
                        leave it out"
                    .into(),
            );
        }
        key => key.clone(),
    };
    config.admin_key = match &args.admin_key {
        Some(key) if key.trim().is_empty() => {
            return Err(
                "--admin-key (or LLAMA_BURN_ADMIN_KEY) is empty: give a key, or leave it out"
                    .into(),
            );
        }
        key => key.clone(),
    };
    config.max_n = args.max_n;
    config.max_prompts = args.max_prompts;
    config.embedding_pooling = args.embedding_pooling;
    config.response_store_bytes = args.response_store_bytes;
    config.response_ttl = std::time::Duration::from_secs(args.response_ttl);
    config.max_choices = args.max_choices;
    config.max_choices_per_tenant = args.max_choices_per_tenant;
    config.max_tokenizing_per_tenant = args.max_tokenizing_per_tenant;
    config.trust_forwarded_for = args.trust_forwarded_for;
    config.max_stop_strings = args.max_stop_strings;
    config.max_stop_bytes = args.max_stop_bytes;
    config.max_messages = args.max_messages;
    config.max_json_depth = args.max_json_depth;
    config.max_constraint_bytes = args.max_constraint_bytes;
    config.max_connections = args.max_connections;
    config.max_unsent_events = args.max_unsent_events;
    config.tokenizer_threads = args.tokenizer_threads;
    config.tokenizer_queue = args.tokenizer_queue;
    config.header_timeout = seconds("header-timeout", args.header_timeout)?;
    config.body_timeout = seconds("body-timeout", args.body_timeout)?;
    config.write_timeout = seconds("write-timeout", args.write_timeout)?;
    config.sse_keep_alive = seconds("sse-keep-alive", args.sse_keep_alive)?;
    Ok(config)
}

async fn serve(args: Args) -> Result<(), String> {
    if args.speculative == Some(llama_burn::speculative::SpeculationMethod::DraftModel)
        && args.draft_model.is_none()
    {
        return Err("--speculative draft needs --draft-model".into());
    }
    let path = match &args.model {
        Some(p) => p.clone(),
        None => llama_burn::demo::demo_model_path().map_err(|e| e.to_string())?,
    };
    let config = server_config(&args, served_name(&args, &path))?;
    let server = Server::new(config).map_err(|e| e.to_string())?;

    // Listen first, so /health answers 503 while the model loads.
    let addr = format!("{}:{}", args.host, args.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let local: SocketAddr = listener.local_addr().map_err(|e| e.to_string())?;
    tracing::info!(
        "listening on http://{local} (model `{}`)",
        server.config().served_model_name
    );

    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let http = {
        let server = server.clone();
        tokio::spawn(async move {
            server
                .serve(listener, async {
                    let _ = stop_rx.await;
                })
                .await
        })
    };

    let shutdown_timeout = Duration::from_secs(args.shutdown_timeout);
    let loader = {
        let server = server.clone();
        tokio::task::spawn_blocking(move || -> Result<(), String> {
            let engine = load(&path, &args).map_err(|e| e.to_string())?;
            server.set_engine(engine).map_err(|e| e.to_string())
        })
    };

    tokio::select! {
        loaded = loader => {
            loaded.map_err(|e| format!("the loader failed: {e}"))??;
            tracing::info!("ready");
            shutdown_signal().await;
        }
        _ = shutdown_signal() => {}
    }

    tracing::info!(
        in_flight = server.in_flight(),
        "shutting down: refusing new requests, waiting up to {} s for running ones",
        shutdown_timeout.as_secs()
    );
    let cancelled = server.drain(shutdown_timeout).await;
    if cancelled > 0 {
        tracing::warn!(
            cancelled,
            "cancelled the requests still running at the deadline"
        );
    }
    let _ = stop_tx.send(());
    match tokio::time::timeout(Duration::from_secs(5), http).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(e))) => return Err(format!("the HTTP server failed: {e}")),
        Ok(Err(e)) => return Err(format!("the HTTP server task failed: {e}")),
        Err(_) => tracing::warn!("connections still open after 5 s; closing them"),
    }
    tracing::info!("stopped");
    Ok(())
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_target(false)
        .init();
    let args = Args::parse();
    if args.print_openapi {
        return match llama_burn::server::openapi().to_pretty_json() {
            Ok(text) => {
                println!("{text}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                tracing::error!("cannot write the OpenAPI description: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!("cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(serve(args));
    // A model still loading when a signal came is not waited for.
    runtime.shutdown_timeout(Duration::from_secs(1));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            ExitCode::FAILURE
        }
    }
}
