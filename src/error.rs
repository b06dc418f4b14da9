//! The crate's one error type.

use std::path::PathBuf;

/// Everything that can go wrong in llama-burn, from loading a checkpoint to serving a
/// request. Bad input is always reported through this type, never by a panic.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LlamaError {
    /// Reading or writing a file failed.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not in the expected format (wrong magic, unsupported version, corrupt
    /// header, foreign file).
    #[error("invalid model file: {0}")]
    InvalidFormat(String),
    /// The file ends before the data its header describes.
    #[error("truncated model file: {0}")]
    Truncated(String),
    /// A tensor is stored in a type this crate cannot dequantize.
    #[error("tensor `{name}` has unsupported type {ty}")]
    UnsupportedTensorType {
        /// Tensor name in the checkpoint.
        name: String,
        /// The type as the file names it.
        ty: String,
    },
    /// A tensor the architecture needs is absent from the checkpoint.
    #[error("missing tensor `{0}`")]
    MissingTensor(String),
    /// A tensor's shape differs from what the configuration implies.
    #[error("tensor `{name}` has shape {actual:?}, expected {expected:?}")]
    ShapeMismatch {
        /// Tensor name in the checkpoint.
        name: String,
        /// Shape implied by the model configuration.
        expected: Vec<usize>,
        /// Shape found in the file.
        actual: Vec<usize>,
    },
    /// The model configuration is missing a value or holds an impossible one.
    #[error("invalid model configuration: {0}")]
    Config(String),
    /// The tokenizer could not be built or used.
    #[error("tokenizer error: {0}")]
    Tokenizer(String),
    /// The tokenizer's vocabulary does not fit the model's embedding table.
    #[error("tokenizer has {tokenizer_vocab} tokens but the model's vocabulary is {model_vocab}")]
    TokenizerMismatch {
        /// Size of the tokenizer's vocabulary (largest id + 1).
        tokenizer_vocab: usize,
        /// Rows of the model's embedding table.
        model_vocab: usize,
    },
    /// The prompt encodes to no tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// The prompt (plus at least one generated token) does not fit the context window.
    #[error("prompt has {tokens} tokens but the context allows at most {max}")]
    PromptTooLong {
        /// Prompt length in tokens.
        tokens: usize,
        /// Largest prompt the context can hold.
        max: usize,
    },
    /// A LoRA adapter does not fit the model: a target the model has no projection for,
    /// factors whose shapes are not the projection's, a rank out of range, an option we
    /// do not run (DoRA, biases, weights saved whole), or another architecture.
    #[error("LoRA adapter {adapter}: {reason}")]
    InvalidAdapter {
        /// The adapter's path or name.
        adapter: String,
        /// What does not fit.
        reason: String,
    },
    /// A request names an adapter the engine does not know (never registered, or
    /// unloaded).
    #[error("no LoRA adapter named `{0}` is loaded")]
    UnknownAdapter(String),
    /// A generation parameter is out of range (`max_tokens`, temperature, top-p, ...).
    #[error("invalid parameter `{name}` = {value}: {reason}")]
    InvalidParameter {
        /// Parameter name.
        name: &'static str,
        /// The rejected value, as text.
        value: String,
        /// What the valid range is.
        reason: &'static str,
    },
    /// The model produced logits no token can be chosen from: a NaN, or no finite or
    /// `+inf` value at all (a corrupt checkpoint or an overflow).
    #[error("invalid logits: {0}")]
    InvalidLogits(String),
    /// A batch request is malformed (empty list, mismatched sampler count, ...).
    #[error("invalid batch: {0}")]
    InvalidBatch(String),
    /// The job was cancelled before it finished.
    #[error("the job was cancelled")]
    Cancelled,
    /// A configured limit is reached (the engine's queue, the requests holding a KV
    /// cache, the KV budget); nothing was allocated. Retry later.
    #[error(
        "overloaded: {resource} at its limit ({in_use} in use, {requested} more requested, \
         limit {limit}); retry later"
    )]
    Overloaded {
        /// What is exhausted, e.g. `"waiting requests"` or `"KV cache bytes"`.
        resource: &'static str,
        /// How much of it is in use.
        in_use: usize,
        /// How much this request asked for.
        requested: usize,
        /// The configured limit.
        limit: usize,
    },
    /// The model thread has stopped (the inference service was shut down or panicked).
    #[error("the model is no longer available: {0}")]
    ModelUnavailable(String),
    /// A handler or engine failed unexpectedly (for example it panicked).
    #[error("runtime error: {0}")]
    Runtime(String),
    /// The engine step running the request failed (it panicked); the request's cache was
    /// freed, and the engine goes on serving the others.
    #[error("engine step failed: {0}")]
    StepFailed(String),
    /// A structured-output constraint (JSON Schema, regex, grammar, choice) could not be
    /// compiled: it is malformed, uses something unsupported, or exceeds the constraint
    /// engine's limits. The request is refused before it runs (a 400 from the server).
    #[error("invalid constraint: {0}")]
    InvalidConstraint(String),
    /// The constraint engine failed while decoding a constrained request (a step went
    /// past its limits, or the grammar allows no token); the request ends with it.
    #[error("constraint failed during decoding: {0}")]
    ConstraintFailed(String),
    /// The demo model or a pretrained checkpoint could not be fetched.
    #[error("download failed: {0}")]
    Download(String),
}

/// Shorthand for `Result<T, LlamaError>`.
pub type Result<T, E = LlamaError> = std::result::Result<T, E>;

impl LlamaError {
    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        LlamaError::Io {
            path: path.into(),
            source,
        }
    }

    /// Builds an [`LlamaError::InvalidParameter`].
    pub fn invalid(
        name: &'static str,
        value: impl std::fmt::Display,
        reason: &'static str,
    ) -> Self {
        LlamaError::InvalidParameter {
            name,
            value: value.to_string(),
            reason,
        }
    }
}

/// Asserts that a `Result` is an `Err` matching a pattern, with an optional guard:
/// `assert_err!(r, LlamaError::InvalidParameter { name: "top_p", .. })` or
/// `assert_err!(r, LlamaError::InvalidFormat(m) if m.contains("block"))`. Otherwise it
/// panics with the error it got (`{:?}`) or with "got Ok" (the `Ok` type need not be
/// `Debug`).
#[cfg(test)]
macro_rules! assert_err {
    ($result:expr, $pattern:pat $(if $guard:expr)? $(,)?) => {
        match $result {
            Err($pattern) $(if $guard)? => {}
            Err(other) => panic!(
                "expected Err({}), got Err({:?})",
                stringify!($pattern $(if $guard)?),
                other
            ),
            Ok(_) => panic!("expected Err({}), got Ok", stringify!($pattern $(if $guard)?)),
        }
    };
}
#[cfg(test)]
pub(crate) use assert_err;
