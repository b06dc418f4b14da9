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
use llama_burn::backend::{DefaultBackend, default_device};
use llama_burn::inference::{ContinuousConfig, ContinuousEngine};
use llama_burn::llama::{Llama, LlamaConfig};
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
    /// A .gguf file or a Hugging Face model directory (default: the demo model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0 picks a free one).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on /v1 routes (default: the LLAMA_BURN_API_KEY
    /// environment variable, if set).
    #[arg(long, env = "LLAMA_BURN_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// The model id clients use (default: the model file's stem).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Most requests running at once.
    #[arg(long, default_value_t = 32)]
    max_running: usize,
    /// KV cache size in tokens (allocated once at start).
    #[arg(long, default_value_t = 32 * 1024)]
    kv_budget_tokens: usize,
    /// Most requests waiting for admission; more get 429.
    #[arg(long, default_value_t = 256)]
    max_waiting: usize,
    /// Context length (prompt plus generated tokens).
    #[arg(long, default_value_t = 2048)]
    max_seq_len: usize,
    /// How the CPU kernels multiply quantized weights: `fast` (8-bit activations,
    /// integer dot products) or `exact` (f32 activations, exactly dequantized weights).
    #[arg(long, default_value_t = llama_burn::Precision::default())]
    precision: llama_burn::Precision,
    /// Quantize a Hugging Face checkpoint's f32/f16/bf16 matrices in memory at load
    /// (Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1).
    #[arg(long)]
    quantize: Option<llama_burn::kernels::QuantFormat>,
    /// Seconds running requests may take to finish after SIGINT/SIGTERM.
    #[arg(long, default_value_t = 30)]
    shutdown_timeout: u64,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 2 * 1024 * 1024)]
    max_body_bytes: usize,
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
    Ok(Arc::new(ContinuousEngine::start(llama, config)?))
}

/// Loads the model, logging progress, and starts the engine.
fn load(path: &Path, args: &Args) -> llama_burn::Result<Arc<dyn Engine>> {
    let config = ContinuousConfig {
        max_running: args.max_running,
        max_waiting: args.max_waiting,
        ..ContinuousConfig::default()
    }
    .with_kv_budget_tokens(args.kv_budget_tokens);
    if args.kv_budget_tokens < args.max_seq_len {
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
    let engine = if path.is_dir() {
        let llama = match args.quantize {
            Some(format) => {
                LlamaConfig::load_hf_dir_quantized::<B>(path, args.max_seq_len, format, &device)?
            }
            None => LlamaConfig::load_hf_dir::<B>(path, args.max_seq_len, &device)?,
        };
        start_engine(llama.with_precision(args.precision), config)?
    } else {
        if args.quantize.is_some() {
            return Err(llama_burn::LlamaError::invalid(
                "--quantize",
                path.display(),
                "applies to Hugging Face checkpoint directories (a GGUF keeps its own types)",
            ));
        }
        let mut last = 0;
        let mut progress = |done: usize, total: usize| {
            let percent = (done * 100).checked_div(total).unwrap_or(100);
            if percent >= last + 10 || (percent == 100 && last != 100) {
                last = percent;
                tracing::info!("loading: {percent}%");
            }
        };
        let llama = LlamaConfig::load_gguf_with_progress::<B>(
            path,
            args.max_seq_len,
            &device,
            &mut progress,
        )?;
        start_engine(llama.with_precision(args.precision), config)?
    };
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

async fn serve(args: Args) -> Result<(), String> {
    let path = match &args.model {
        Some(p) => p.clone(),
        None => llama_burn::demo::demo_model_path().map_err(|e| e.to_string())?,
    };
    let mut config =
        ServerConfig::new(served_name(&args, &path)).with_max_body_bytes(args.max_body_bytes);
    config.api_key = args.api_key.clone().filter(|k| !k.is_empty());
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
    let app = server.router();
    let http = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = stop_rx.await;
            })
            .await
    });

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
