//! The demo model behind the OpenAI-compatible server, for the server tests.

use std::sync::Arc;

use llama_burn::inference::{ContinuousConfig, ContinuousEngine};
use llama_burn::server::{Engine, Server, ServerConfig};

use super::demo;

/// Serves the demo model on an ephemeral port, constraints limited to 4 KiB; returns its
/// base URL, the runtime and the server.
pub fn start_constrained_server() -> (String, tokio::runtime::Runtime, Server) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let config = ContinuousConfig::default().with_kv_budget_tokens(4096);
    let engine: Arc<dyn Engine> =
        Arc::new(ContinuousEngine::start(demo(512), config).expect("engine"));
    let mut server_config = ServerConfig::new("smol");
    server_config.max_constraint_bytes = 4096;
    let server = Server::new(server_config).expect("server");
    server.set_engine(engine).expect("engine");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.set_nonblocking(true).expect("nonblocking");
    let addr = listener.local_addr().expect("addr");
    let app = server.router();
    rt.spawn(async move {
        let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
        axum::serve(listener, app).await.expect("serve");
    });
    (format!("http://{addr}"), rt, server)
}
