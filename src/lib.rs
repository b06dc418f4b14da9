#![doc = include_str!("../README.md")]
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod backend;
pub mod cache;
pub mod config;
pub mod constraints;
pub mod demo;
pub mod error;
#[cfg(feature = "cubecl-kernels")]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "cuda", feature = "wgpu", feature = "vulkan")))
)]
pub mod gpu;
pub mod inference;
pub mod kernels;
pub mod llama;
pub mod loader;
pub mod model;
pub mod sampling;
#[cfg(feature = "server")]
#[cfg_attr(docsrs, doc(cfg(feature = "server")))]
pub mod server;
pub mod speculative;

pub mod tokenizer;
pub mod tools;

pub use config::{FloatType, LlamaConfig, Precision};
pub use error::{LlamaError, Result};
pub use inference::BatchedGenerationState;
/// Batched generation's old home; it lives in [`inference::batched`].
#[doc(hidden)]
pub use inference::batched;
pub use llama::{GenerationOutput, GenerationState, Llama, Score, StopReason};
pub use loader::Loader;
pub use sampling::{Sampler, TopK, TopP};

/// The hub downloads' old path; they live in [`loader::pretrained`].
#[cfg(feature = "pretrained")]
#[doc(hidden)]
pub use loader::pretrained;
