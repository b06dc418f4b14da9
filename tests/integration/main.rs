//! The integration tests, in one binary: a module per concern. Each test file used to be
//! its own binary, and linking 23 binaries against the crate and Burn took most of a
//! first `cargo test`.
//!
//! Tests that take more than a few seconds (most whole-model and server tests) are
//! `#[ignore]`d, so that the README's `cargo test` is quick; `-- --include-ignored` runs
//! them too, and CI does. Select a concern with a filter on its module's name, e.g. the
//! whole-model checks:
//!
//! ```sh
//! cargo test --release --features llama3,server --test integration -- --include-ignored reference:: batch_invariance::
//! ```
//!
//! The fast ones (no model run): `gguf_format:: quantize:: tokenizers:: hostile_inputs::
//! kernels::`. The server's, which need the `server` feature, start real HTTP servers
//! (`server:: structured_server:: tools_server:: speculative_server:: hostile_server::`,
//! the last two run the `llama-burn-server` binary). The GPU backend's test is its own
//! binary, `tests/gpu_backend.rs` (features `wgpu` or `cuda`).

mod common;

// The README, the strategy guides and the book (docs/src/): fences, doctests, links.
mod docs;

// Files, checkpoints and tokenizers.
mod gguf_format;
mod hostile_inputs;
mod loading;
mod quantize;
mod random_gguf;
mod tokenizers;

// The CPU kernels and the model's numbers.
mod batch_invariance;
mod kernels;
mod reference;

// The strategies and what they share.
mod batched;
mod concurrent;
mod constraints;
mod continuous;
mod generate;
mod kv_limits;
mod lora;
mod paged_engine;
mod sampling_invariance;
mod speculative;

// The HTTP server (feature `server`; each file is gated inside).
mod hostile_server;
mod server;
mod speculative_server;
mod structured_server;
mod tools_server;
