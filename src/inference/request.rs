//! What a client asks the inference service for, and what it gets back token by token.

use crate::error::{LlamaError, Result};
use crate::tokenizer::ChatMessage;

/// One text-generation request: a prompt and the sampling settings to continue it with.
///
/// Build it with [`GenerateRequest::new`] and the `with_*` methods, then check it against
/// the model's context length with [`GenerateRequest::validate`] before running it.
///
/// ```
/// use llama_burn::inference::GenerateRequest;
///
/// let request = GenerateRequest::new("What is AI?")
///     .with_max_tokens(32)
///     .with_temperature(0.7)
///     .with_top_p(0.9)
///     .with_seed(7);
/// assert!(request.validate(2048).is_ok());
/// assert!(!request.is_greedy());
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateRequest {
    /// The text to continue. Must not be empty (whitespace alone is a valid prompt)
    /// unless [`messages`](Self::messages) or [`prompt_ids`](Self::prompt_ids) is set.
    /// Special tokens written in it are recognised, as [`Llama::generate`] documents.
    ///
    /// [`Llama::generate`]: crate::llama::Llama::generate
    pub prompt: String,
    /// A conversation to continue instead of `prompt`: encoded with the model's chat
    /// template and an assistant header by
    /// [`Tokenizer::encode_chat`](crate::tokenizer::Tokenizer::encode_chat), message content
    /// as plain text (it can never be read as a control token).
    pub messages: Option<Vec<ChatMessage>>,
    /// Token ids to continue instead of `prompt` (taken as they are: no BOS is added).
    /// Takes precedence over `messages`.
    pub prompt_ids: Option<Vec<u32>>,
    /// Largest number of tokens to generate (at least 1, at most the context length).
    pub max_tokens: usize,
    /// Sampling temperature; `0.0` means greedy (argmax) decoding. Finite and `>= 0`.
    pub temperature: f64,
    /// Nucleus-sampling mass, in `(0, 1]`; `1.0` keeps the whole distribution.
    pub top_p: f64,
    /// Seed of the request's own random generator, so sampled results reproduce.
    pub seed: u64,
    /// Keep generating past the model's stop tokens until `max_tokens` (for benchmarks
    /// and fixed-length generation). Default `false`.
    pub ignore_eos: bool,
}

impl GenerateRequest {
    /// Default for [`GenerateRequest::max_tokens`].
    pub const DEFAULT_MAX_TOKENS: usize = 50;
    /// Default for [`GenerateRequest::temperature`] (greedy decoding).
    pub const DEFAULT_TEMPERATURE: f64 = 0.0;
    /// Default for [`GenerateRequest::top_p`] (no truncation).
    pub const DEFAULT_TOP_P: f64 = 1.0;
    /// Default for [`GenerateRequest::seed`].
    pub const DEFAULT_SEED: u64 = 42;

    /// A request for `prompt` with the defaults: 50 tokens, greedy decoding
    /// (temperature 0), top-p 1.0 and seed 42.
    ///
    /// ```
    /// use llama_burn::inference::GenerateRequest;
    ///
    /// let request = GenerateRequest::new("Hello");
    /// assert_eq!(request.max_tokens, 50);
    /// assert_eq!(request.temperature, 0.0);
    /// assert_eq!(request.top_p, 1.0);
    /// assert_eq!(request.seed, 42);
    /// ```
    pub fn new(prompt: impl Into<String>) -> Self {
        Self {
            prompt: prompt.into(),
            messages: None,
            prompt_ids: None,
            max_tokens: Self::DEFAULT_MAX_TOKENS,
            temperature: Self::DEFAULT_TEMPERATURE,
            top_p: Self::DEFAULT_TOP_P,
            seed: Self::DEFAULT_SEED,
            ignore_eos: false,
        }
    }

    /// A request to answer a conversation: the model's chat template is applied (with an
    /// assistant header to generate after), and message content is encoded as plain text,
    /// so a message writing `"<|im_end|>"` cannot end its turn.
    ///
    /// ```
    /// use llama_burn::inference::GenerateRequest;
    /// use llama_burn::tokenizer::ChatMessage;
    ///
    /// let request = GenerateRequest::chat(vec![ChatMessage::user("Hi!")]).with_max_tokens(8);
    /// assert!(request.validate(2048).is_ok());
    /// ```
    pub fn chat(messages: Vec<ChatMessage>) -> Self {
        Self {
            messages: Some(messages),
            ..Self::new("")
        }
    }

    /// A request that continues token ids as they are (no BOS is added).
    ///
    /// ```
    /// use llama_burn::inference::GenerateRequest;
    ///
    /// assert!(GenerateRequest::from_ids(vec![1, 2, 3]).validate(2048).is_ok());
    /// assert!(GenerateRequest::from_ids(vec![]).validate(2048).is_err());
    /// ```
    pub fn from_ids(prompt_ids: Vec<u32>) -> Self {
        Self {
            prompt_ids: Some(prompt_ids),
            ..Self::new("")
        }
    }

    /// Sets the largest number of tokens to generate.
    #[must_use]
    pub fn with_max_tokens(mut self, max_tokens: usize) -> Self {
        self.max_tokens = max_tokens;
        self
    }

    /// Sets the sampling temperature (`0.0` for greedy decoding).
    #[must_use]
    pub fn with_temperature(mut self, temperature: f64) -> Self {
        self.temperature = temperature;
        self
    }

    /// Sets the nucleus-sampling mass.
    #[must_use]
    pub fn with_top_p(mut self, top_p: f64) -> Self {
        self.top_p = top_p;
        self
    }

    /// Sets the seed of the request's random generator.
    #[must_use]
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Keeps generating past stop tokens until `max_tokens`.
    pub fn with_ignore_eos(mut self, ignore_eos: bool) -> Self {
        self.ignore_eos = ignore_eos;
        self
    }

    /// Whether this request decodes greedily (temperature exactly zero).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Checks every field against its valid range for a model whose context holds
    /// `max_context` tokens.
    ///
    /// # Errors
    ///
    /// - [`LlamaError::EmptyPrompt`] if the prompt is `""` (whitespace is accepted) and
    ///   neither messages nor ids are given, or if the ids are an empty list;
    /// - [`LlamaError::InvalidParameter`] if `max_tokens` is 0 or larger than
    ///   `max_context`, if the temperature is NaN, infinite or negative, or if `top_p` is
    ///   NaN or outside `(0, 1]`.
    ///
    /// ```
    /// use llama_burn::error::LlamaError;
    /// use llama_burn::inference::GenerateRequest;
    ///
    /// let err = GenerateRequest::new("Hi").with_top_p(0.0).validate(2048).unwrap_err();
    /// assert!(matches!(err, LlamaError::InvalidParameter { name: "top_p", .. }));
    /// ```
    pub fn validate(&self, max_context: usize) -> Result<()> {
        let empty = match (&self.prompt_ids, &self.messages) {
            (Some(ids), _) => ids.is_empty(),
            (None, Some(_)) => false,
            (None, None) => self.prompt.is_empty(),
        };
        if empty {
            return Err(LlamaError::EmptyPrompt);
        }
        // The prompt is not tokenized yet: its length is checked when it is.
        check_request_size(None, self.max_tokens, max_context)?;
        crate::sampling::validate_temperature(self.temperature)?;
        crate::sampling::validate_top_p(self.top_p)?;
        Ok(())
    }
}

/// The one check of a request's size against a context window of `context` positions,
/// for every strategy: `max_tokens` is at least 1 and at most `context`, and a prompt of
/// `prompt_len` tokens (when known) is not empty and leaves room for one generated token.
///
/// [`GenerateRequest::validate`] calls it before tokenizing (`prompt_len` `None`),
/// [`Llama::check_budget`](crate::Llama::check_budget) after; the sequential, concurrent,
/// batched and continuous strategies all go through those two.
pub(crate) fn check_request_size(
    prompt_len: Option<usize>,
    max_tokens: usize,
    context: usize,
) -> Result<()> {
    if prompt_len == Some(0) {
        return Err(LlamaError::EmptyPrompt);
    }
    if max_tokens == 0 {
        return Err(LlamaError::invalid("max_tokens", 0, "must be at least 1"));
    }
    if max_tokens > context {
        return Err(LlamaError::invalid(
            "max_tokens",
            max_tokens,
            "exceeds the model's context window",
        ));
    }
    match prompt_len {
        Some(tokens) if tokens >= context => Err(LlamaError::PromptTooLong {
            tokens,
            max: context - 1,
        }),
        _ => Ok(()),
    }
}

/// One generated token, as a streaming handler emits it.
///
/// ```
/// use llama_burn::inference::TokenOutput;
///
/// let first = TokenOutput { token: "Hello".to_string(), token_id: 19556, index: 0 };
/// assert_eq!(first.index, 0);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TokenOutput {
    /// The token's text (may be empty when a multi-byte character is split across
    /// tokens and not complete yet).
    pub token: String,
    /// The token's id in the tokenizer's vocabulary.
    pub token_id: u32,
    /// Position in the generated sequence, starting at 0 (the prompt is not counted).
    pub index: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_invalid(request: &GenerateRequest, max_context: usize, field: &str) {
        match request.validate(max_context) {
            Err(LlamaError::InvalidParameter { name, .. }) => assert_eq!(name, field),
            other => panic!("expected InvalidParameter({field}), got {other:?}"),
        }
    }

    #[test]
    fn defaults() {
        let r = GenerateRequest::new("Hello");
        assert_eq!(r.prompt, "Hello");
        assert_eq!(r.max_tokens, 50);
        assert_eq!(r.temperature, 0.0);
        assert_eq!(r.top_p, 1.0);
        assert_eq!(r.seed, 42);
        assert!(r.is_greedy());
        assert!(r.validate(2048).is_ok());
    }

    #[test]
    fn builders_set_fields() {
        let r = GenerateRequest::new(String::from("p"))
            .with_max_tokens(7)
            .with_temperature(0.5)
            .with_top_p(0.25)
            .with_seed(9)
            .with_ignore_eos(true);
        assert_eq!(
            r,
            GenerateRequest {
                prompt: "p".into(),
                messages: None,
                prompt_ids: None,
                max_tokens: 7,
                temperature: 0.5,
                top_p: 0.25,
                seed: 9,
                ignore_eos: true,
            }
        );
        assert!(!r.is_greedy());
        assert!(r.validate(7).is_ok());
    }

    #[test]
    fn empty_prompt_is_rejected_but_whitespace_is_not() {
        assert!(matches!(
            GenerateRequest::new("").validate(100),
            Err(LlamaError::EmptyPrompt)
        ));
        assert!(GenerateRequest::new(" ").validate(100).is_ok());
        assert!(GenerateRequest::new("\n\t").validate(100).is_ok());
    }

    #[test]
    fn max_tokens_bounds() {
        assert_invalid(
            &GenerateRequest::new("a").with_max_tokens(0),
            100,
            "max_tokens",
        );
        assert_invalid(
            &GenerateRequest::new("a").with_max_tokens(101),
            100,
            "max_tokens",
        );
        assert!(
            GenerateRequest::new("a")
                .with_max_tokens(1)
                .validate(100)
                .is_ok()
        );
        assert!(
            GenerateRequest::new("a")
                .with_max_tokens(100)
                .validate(100)
                .is_ok()
        );
        // A zero-length context admits nothing.
        assert_invalid(
            &GenerateRequest::new("a").with_max_tokens(1),
            0,
            "max_tokens",
        );
    }

    #[test]
    fn temperature_bounds() {
        for bad in [f64::NAN, -0.1, -1.0, f64::INFINITY, f64::NEG_INFINITY] {
            assert_invalid(
                &GenerateRequest::new("a").with_temperature(bad),
                100,
                "temperature",
            );
        }
        for good in [0.0, -0.0, 1e-9, 0.7, 1.0, 5.0] {
            assert!(
                GenerateRequest::new("a")
                    .with_temperature(good)
                    .validate(100)
                    .is_ok(),
                "temperature {good} should be valid"
            );
        }
    }

    #[test]
    fn top_p_bounds() {
        for bad in [
            f64::NAN,
            0.0,
            -0.0,
            -0.5,
            1.0 + 1e-9,
            2.0,
            f64::INFINITY,
            f64::NEG_INFINITY,
        ] {
            assert_invalid(&GenerateRequest::new("a").with_top_p(bad), 100, "top_p");
        }
        for good in [1e-9, 0.5, 0.9, 1.0] {
            assert!(
                GenerateRequest::new("a")
                    .with_top_p(good)
                    .validate(100)
                    .is_ok(),
                "top_p {good} should be valid"
            );
        }
    }

    #[test]
    fn error_message_names_the_value() {
        let err = GenerateRequest::new("a")
            .with_temperature(-2.0)
            .validate(100)
            .unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("temperature") && text.contains("-2"),
            "{text}"
        );
    }

    #[test]
    fn token_output_fields() {
        let t = TokenOutput {
            token: " world".into(),
            token_id: 1917,
            index: 1,
        };
        assert_eq!(t.clone(), t);
    }
}
