//! Serving strategies over one model: the job runtime and its handlers, the continuous
//! engine, and (re-exported from [`crate::batched`]) batched generation in one call.

pub mod continuous;
pub mod handlers;
pub mod request;
pub mod runtime;

pub use crate::batched::{DEFAULT_MAX_BATCH, generate_batch, generate_batch_with_max};
pub use continuous::{
    ContinuousConfig, ContinuousEngine, EngineEvent, EngineJob, EngineMetrics, EventHandler,
    KvBudget, Outcome, RequestMetrics, Scope, continuous_batching_handler,
};
pub use handlers::{
    concurrent_streaming_handler, constrained_sampler, request_sampler, streaming_handler,
};
pub use request::{GenerateRequest, TokenOutput};
pub use runtime::{
    CancelToken, Handler, In, Inference, InferenceBuilder, Job, JobBuilder, JobHandle, JobIter,
    JobStream, ModelAccessor, ModelDevice, ModelHost, NoModel, OutStream,
};
