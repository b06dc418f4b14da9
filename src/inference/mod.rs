//! The serving strategies over one model, each in its own home:
//!
//! | strategy | where | entry points |
//! | --- | --- | --- |
//! | sequential | `sequential.rs` | [`Llama::generate`], [`Llama::create_generation_state`], [`Llama::generate_single_token`], speculation ([`Llama::generate_speculative`]) |
//! | concurrent | [`runtime`], [`handlers`] | [`InferenceBuilder`], [`concurrent_streaming_handler`]: per-request states interleaved token by token |
//! | batched | [`batched`] | [`generate_batch`], [`Llama::create_batched_generation_state`], [`Llama::generate_batched_single_token`] |
//! | continuous | [`continuous`] | [`ContinuousEngine`], [`continuous_batching_handler`]: a running batch over a paged KV cache |
//!
//! [`request`] holds what every strategy takes: [`GenerateRequest`] and its one size
//! check. The model and a request's state between tokens are [`crate::llama`]'s.
//!
//! [`Llama::generate`]: crate::Llama::generate
//! [`Llama::create_generation_state`]: crate::Llama::create_generation_state
//! [`Llama::generate_single_token`]: crate::Llama::generate_single_token
//! [`Llama::generate_speculative`]: crate::Llama::generate_speculative
//! [`Llama::create_batched_generation_state`]: crate::Llama::create_batched_generation_state
//! [`Llama::generate_batched_single_token`]: crate::Llama::generate_batched_single_token

pub mod batched;
pub mod continuous;
pub mod handlers;
pub mod request;
pub mod runtime;
mod sequential;

pub use batched::{
    BatchedGenerationState, DEFAULT_MAX_BATCH, generate_batch, generate_batch_with_max,
};
pub use continuous::{
    ContinuousConfig, ContinuousEngine, EmbedReply, EngineEvent, EngineJob, EngineMetrics,
    EventHandler, KvBudget, Outcome, RequestMetrics, Scope, continuous_batching_handler,
};
pub use handlers::{
    concurrent_streaming_handler, constrained_sampler, request_sampler, streaming_handler,
};
pub use request::{GenerateRequest, TokenOutput};
pub use runtime::{
    CancelToken, Handler, In, Inference, InferenceBuilder, Job, JobBuilder, JobHandle, JobIter,
    JobStream, ModelAccessor, ModelDevice, ModelHost, NoModel, OutStream,
};
