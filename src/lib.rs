#![doc = include_str!("../README.md")]
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod backend;
pub mod cache;
pub mod config;
pub mod constraints;
pub mod demo;
pub mod embed;
pub mod error;
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
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
pub mod lora;
pub mod model;
pub mod quant;
pub mod sampling;
#[cfg(feature = "server")]
#[cfg_attr(docsrs, doc(cfg(feature = "server")))]
pub mod server;
pub mod speculative;

pub mod tokenizer;
pub mod tools;

/// The book's chapters (`docs/src/`), compiled as doctests (`cargo test --doc`): every
/// `rust` block in them must compile. The chapters that only include other files (the
/// strategy guides') are tested through those files, in [`guides`].
#[cfg(doctest)]
mod book {
    #[doc = include_str!("../docs/src/introduction.md")]
    mod introduction {}
    #[doc = include_str!("../docs/src/using.md")]
    mod using {}
    #[doc = include_str!("../docs/src/structured-outputs.md")]
    mod structured_outputs {}
    #[doc = include_str!("../docs/src/tool-calling.md")]
    mod tool_calling {}
    #[doc = include_str!("../docs/src/speculative-decoding.md")]
    mod speculative_decoding {}
    #[doc = include_str!("../docs/src/lora.md")]
    mod lora {}
    #[doc = include_str!("../docs/src/examples.md")]
    mod examples {}
    #[doc = include_str!("../docs/src/serving.md")]
    mod serving {}
    #[doc = include_str!("../docs/src/deployment.md")]
    mod deployment {}
    #[doc = include_str!("../docs/src/strategies.md")]
    mod strategies {}
    #[doc = include_str!("../docs/src/cpu-speed.md")]
    mod cpu_speed {}
    #[doc = include_str!("../docs/src/cpu-kernels.md")]
    mod cpu_kernels {}
    #[doc = include_str!("../docs/src/gpu.md")]
    mod gpu {}
    #[doc = include_str!("../docs/src/development.md")]
    mod development {}
}

/// The three strategy guides at the top of the repository (the book includes them),
/// compiled as doctests.
#[cfg(doctest)]
mod guides {
    #[doc = include_str!("../INFERENCE_STRATEGIES.md")]
    mod inference_strategies {}
    #[doc = include_str!("../CONCURRENT_INFERENCE.md")]
    mod concurrent_inference {}
    #[doc = include_str!("../BATCHED_INFERENCE.md")]
    mod batched_inference {}
}

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
