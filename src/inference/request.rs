//! What a client asks the inference service for, and what it gets back token by token.

use crate::backend::LlamaBackend;
use crate::constraints::Constraint;
use crate::error::{LlamaError, Result};
pub(crate) use crate::llama::check_request_size;
use crate::llama::{GenerationState, Llama, PromptEncoder};
use crate::sampling::{MAX_TOP_LOGPROBS, SamplingParams, TokenLogprobs};
use crate::speculative::SpeculationConfig;
use crate::tokenizer::ChatMessage;
use crate::tokenizer::Tokenizer;

/// Most extra stop token ids a request may give.
pub const MAX_STOP_TOKEN_IDS: usize = 256;

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
    /// [`Tokenizer::encode_chat`], message content
    /// as plain text (it can never be read as a control token).
    pub messages: Option<Vec<ChatMessage>>,
    /// Functions the model may call in its answer to [`messages`](Self::messages): given
    /// to the chat template (or described in the system prompt of a template without
    /// tools, see [`crate::tools::prompt`]). Empty: none.
    pub tools: Vec<crate::tools::Tool>,
    /// Token ids to continue instead of `prompt` (taken as they are: no BOS is added).
    /// Takes precedence over `messages`.
    pub prompt_ids: Option<Vec<u32>>,
    /// Largest number of tokens to generate (at least 1, at most the context length).
    pub max_tokens: usize,
    /// Every sampling control (temperature, top-p, top-k, min-p, penalties, logit bias),
    /// as one value: checked by [`validate`](Self::validate)
    /// ([`SamplingParams::validate`]) and read as it is by the request's sampler
    /// ([`request_sampler`](crate::inference::request_sampler)). The default of
    /// [`GenerateRequest::new`] is greedy decoding (temperature 0) with every other
    /// control off.
    pub sampling: SamplingParams,
    /// Seed of the request's own random generator, so sampled results reproduce.
    /// [`GenerateRequest::new`] draws a fresh random one: read it here to reproduce a
    /// result, or set your own with [`with_seed`](Self::with_seed). Not part of
    /// [`sampling`](Self::sampling): it says which random stream draws, not from what
    /// distribution, and the choices of one API request share their controls but not
    /// their seeds.
    pub seed: u64,
    /// Keep generating past the model's stop tokens until `max_tokens` (for benchmarks
    /// and fixed-length generation). Default `false`.
    pub ignore_eos: bool,
    /// Token ids that end the request besides the model's stop tokens (at most
    /// [`MAX_STOP_TOKEN_IDS`]); honoured even with `ignore_eos`.
    pub stop_token_ids: Vec<u32>,
    /// Stop tokens (the model's and `stop_token_ids`) cannot be drawn before this many
    /// tokens are generated (at most `max_tokens`). Default 0.
    pub min_tokens: usize,
    /// Report each generated token's log-probability and this many alternatives
    /// (`0..=20`) in [`TokenOutput::logprobs`]; `None` (the default) reports nothing.
    pub logprobs: Option<usize>,
    /// Report each prompt token's log-probability and this many alternatives (`0..=20`)
    /// in the first [`TokenOutput::prompt_logprobs`]; `None` (the default) reports
    /// nothing. Costs one more forward pass over the prompt.
    pub prompt_logprobs: Option<usize>,
    /// What the output must be (a JSON Schema, a regex, a Lark grammar, a choice), or
    /// `None` (the default) for free text. See [`crate::constraints`]. Shared, not
    /// copied, by the requests made from one (a server's choices).
    pub constraint: Option<std::sync::Arc<Constraint>>,
    /// Speculative decoding ([`crate::speculative`]), or `None` (the default). The
    /// tokens are the same with it and without it; it only changes the speed.
    pub speculation: Option<SpeculationConfig>,
    /// The LoRA adapter to run with, by the name the engine's
    /// [`AdapterRegistry`](crate::lora::AdapterRegistry) knows it under, or `None` (the
    /// default) for the base model. Served by the continuous engine; rows of different
    /// adapters share its steps, and a request's tokens do not depend on its neighbours'
    /// adapters.
    pub adapter: Option<String>,
}

impl GenerateRequest {
    /// Default for [`GenerateRequest::max_tokens`].
    pub const DEFAULT_MAX_TOKENS: usize = 50;
    /// Default for the temperature of [`GenerateRequest::sampling`] (greedy decoding).
    pub const DEFAULT_TEMPERATURE: f64 = 0.0;
    /// Default for the top-p of [`GenerateRequest::sampling`] (no truncation).
    pub const DEFAULT_TOP_P: f64 = 1.0;

    /// A request for `prompt` with the defaults: 50 tokens, greedy decoding
    /// (temperature 0), every other sampling control off, and a fresh random seed (two
    /// requests made alike draw different samples; [`seed`](Self::seed) says which).
    ///
    /// ```
    /// use llama_burn::inference::GenerateRequest;
    ///
    /// let request = GenerateRequest::new("Hello");
    /// assert_eq!(request.max_tokens, 50);
    /// assert_eq!(request.sampling.temperature, 0.0);
    /// assert_eq!(request.sampling.top_p, 1.0);
    /// assert_ne!(request.seed, GenerateRequest::new("Hello").seed);
    /// ```
    pub fn new(prompt: impl Into<String>) -> Self {
        Self {
            prompt: prompt.into(),
            messages: None,
            tools: Vec::new(),
            prompt_ids: None,
            max_tokens: Self::DEFAULT_MAX_TOKENS,
            sampling: SamplingParams {
                temperature: Self::DEFAULT_TEMPERATURE,
                top_p: Self::DEFAULT_TOP_P,
                ..SamplingParams::default()
            },
            seed: rand::random(),
            ignore_eos: false,
            stop_token_ids: Vec::new(),
            min_tokens: 0,
            logprobs: None,
            prompt_logprobs: None,
            constraint: None,
            speculation: None,
            adapter: None,
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
    /// use llama_burn::LlamaError;
    /// use llama_burn::inference::GenerateRequest;
    ///
    /// assert!(GenerateRequest::from_ids(vec![1, 2, 3]).validate(2048).is_ok());
    /// assert!(matches!(
    ///     GenerateRequest::from_ids(vec![]).validate(2048),
    ///     Err(LlamaError::EmptyPrompt)
    /// ));
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
        self.sampling.temperature = temperature;
        self
    }

    /// Sets the nucleus-sampling mass.
    #[must_use]
    pub fn with_top_p(mut self, top_p: f64) -> Self {
        self.sampling.top_p = top_p;
        self
    }

    /// Sets the seed of the request's random generator.
    #[must_use]
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Keeps generating past stop tokens until `max_tokens`.
    #[must_use]
    pub fn with_ignore_eos(mut self, ignore_eos: bool) -> Self {
        self.ignore_eos = ignore_eos;
        self
    }

    /// Sets every sampling control at once (temperature and top-p included).
    ///
    /// ```
    /// use llama_burn::inference::GenerateRequest;
    /// use llama_burn::sampling::SamplingParams;
    ///
    /// let params = SamplingParams { temperature: 0.8, top_k: 40, ..Default::default() };
    /// let request = GenerateRequest::new("Hi").with_sampling(params.clone());
    /// assert_eq!(request.sampling, params);
    /// ```
    #[must_use]
    pub fn with_sampling(mut self, params: SamplingParams) -> Self {
        self.sampling = params;
        self
    }

    /// Sets top-k (0 is off).
    #[must_use]
    pub fn with_top_k(mut self, top_k: usize) -> Self {
        self.sampling.top_k = top_k;
        self
    }

    /// Sets min-p (0 is off).
    #[must_use]
    pub fn with_min_p(mut self, min_p: f64) -> Self {
        self.sampling.min_p = min_p;
        self
    }

    /// Asks for each generated token's log-probability and `n` alternatives (`0..=20`).
    ///
    /// ```
    /// use llama_burn::LlamaError;
    /// use llama_burn::inference::GenerateRequest;
    ///
    /// assert!(GenerateRequest::new("Hi").with_logprobs(5).validate(2048).is_ok());
    /// assert!(matches!(
    ///     GenerateRequest::new("Hi").with_logprobs(21).validate(2048),
    ///     Err(LlamaError::InvalidParameter { name: "logprobs", .. })
    /// ));
    /// ```
    #[must_use]
    pub fn with_logprobs(mut self, n: usize) -> Self {
        self.logprobs = Some(n);
        self
    }

    /// Asks for each prompt token's log-probability and `n` alternatives (`0..=20`),
    /// delivered with the first generated token.
    ///
    /// ```
    /// use llama_burn::LlamaError;
    /// use llama_burn::inference::GenerateRequest;
    ///
    /// assert!(GenerateRequest::new("Hi").with_prompt_logprobs(1).validate(2048).is_ok());
    /// assert!(matches!(
    ///     GenerateRequest::new("Hi").with_prompt_logprobs(21).validate(2048),
    ///     Err(LlamaError::InvalidParameter { name: "prompt_logprobs", .. })
    /// ));
    /// ```
    #[must_use]
    pub fn with_prompt_logprobs(mut self, n: usize) -> Self {
        self.prompt_logprobs = Some(n);
        self
    }

    /// Sets the extra stop token ids.
    #[must_use]
    pub fn with_stop_token_ids(mut self, ids: Vec<u32>) -> Self {
        self.stop_token_ids = ids;
        self
    }

    /// Sets the least number of tokens generated before a stop token may be drawn.
    #[must_use]
    pub fn with_min_tokens(mut self, min_tokens: usize) -> Self {
        self.min_tokens = min_tokens;
        self
    }

    /// Constrains the output to `constraint` (compiled against the model when the request
    /// starts; a bad one fails the request with
    /// [`LlamaError::InvalidConstraint`]). Every strategy honours it.
    ///
    /// ```
    /// use llama_burn::constraints::Constraint;
    /// use llama_burn::inference::GenerateRequest;
    ///
    /// let request = GenerateRequest::new("Is water wet? Answer:")
    ///     .with_constraint(Constraint::Choice(vec![" yes".into(), " no".into()]));
    /// assert!(request.validate(2048).is_ok());
    /// ```
    #[must_use]
    pub fn with_constraint(mut self, constraint: Constraint) -> Self {
        self.constraint = Some(std::sync::Arc::new(constraint));
        self
    }

    /// Decodes with speculation: proposals checked by the model in one forward pass
    /// per step (see [`crate::speculative`]; same tokens, greedy or sampled).
    ///
    /// ```
    /// use llama_burn::inference::GenerateRequest;
    /// use llama_burn::speculative::SpeculationConfig;
    ///
    /// let request = GenerateRequest::new("Repeat: a b c").with_speculation(SpeculationConfig::ngram(8));
    /// assert!(request.validate(2048).is_ok());
    /// ```
    #[must_use]
    pub fn with_speculation(mut self, config: SpeculationConfig) -> Self {
        self.speculation = Some(config);
        self
    }

    /// Runs the request with the LoRA adapter registered as `name` (see
    /// [`adapter`](Self::adapter)).
    ///
    /// ```
    /// use llama_burn::inference::GenerateRequest;
    ///
    /// let request = GenerateRequest::new("Bonjour").with_adapter("french-chat");
    /// assert_eq!(request.adapter.as_deref(), Some("french-chat"));
    /// ```
    #[must_use]
    pub fn with_adapter(mut self, name: impl Into<String>) -> Self {
        self.adapter = Some(name.into());
        self
    }

    /// Checks the token ids the request names (`logit_bias`, `stop_token_ids`) against a
    /// vocabulary of `vocab` tokens.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidParameter`] naming the field with an id outside it.
    pub fn validate_token_ids(&self, vocab: usize) -> Result<()> {
        self.sampling.validate_ids(vocab)?;
        match self.stop_token_ids.iter().find(|&&id| id as usize >= vocab) {
            Some(id) => Err(LlamaError::invalid(
                "stop_token_ids",
                id,
                "token id outside the model's vocabulary",
            )),
            None => Ok(()),
        }
    }

    /// Whether this request decodes greedily (temperature 0, or below
    /// [`MIN_SAMPLED_TEMPERATURE`](crate::sampling::MIN_SAMPLED_TEMPERATURE)).
    pub fn is_greedy(&self) -> bool {
        crate::sampling::greedy_at(self.sampling.temperature)
    }

    /// Checks every field against its valid range for a model whose context holds
    /// `max_context` tokens.
    ///
    /// # Errors
    ///
    /// - [`LlamaError::EmptyPrompt`] if the prompt is `""` (whitespace is accepted) and
    ///   neither messages nor ids are given, or if the ids are an empty list;
    /// - [`LlamaError::InvalidParameter`] naming the field if `max_tokens` is 0 or larger
    ///   than `max_context`, or a sampling control is out of its range
    ///   ([`SamplingParams::validate`]), or there are too many `stop_token_ids`,
    ///   `min_tokens` exceeds `max_tokens`, or `logprobs` exceeds 20. Token ids are
    ///   checked against the vocabulary by [`validate_token_ids`](Self::validate_token_ids).
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
        // The prompt is not tokenized yet: its length is checked when it is (and
        // `max_tokens` is not checked again then).
        check_request_size(None, Some(self.max_tokens), max_context)?;
        self.sampling.validate()?;
        if self.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
            return Err(LlamaError::invalid(
                "stop_token_ids",
                format!("{} ids", self.stop_token_ids.len()),
                "at most 256 ids",
            ));
        }
        if self.min_tokens > self.max_tokens {
            return Err(LlamaError::invalid(
                "min_tokens",
                self.min_tokens,
                "must be at most max_tokens",
            ));
        }
        if let Some(n) = self.logprobs.filter(|&n| n > MAX_TOP_LOGPROBS) {
            return Err(LlamaError::invalid("logprobs", n, "must be in [0, 20]"));
        }
        if let Some(n) = self.prompt_logprobs.filter(|&n| n > MAX_TOP_LOGPROBS) {
            return Err(LlamaError::invalid(
                "prompt_logprobs",
                n,
                "must be in [0, 20]",
            ));
        }
        if let Some(constraint) = &self.constraint {
            constraint.validate()?;
        }
        if let Some(speculation) = &self.speculation {
            speculation.validate()?;
        }
        Ok(())
    }
}

/// One generated token, as a streaming handler emits it.
///
/// ```
/// use llama_burn::inference::TokenOutput;
///
/// let first = TokenOutput {
///     token: "Hello".to_string(),
///     token_id: 19556,
///     index: 0,
///     logprobs: None,
///     prompt_logprobs: None,
///     cached_prompt_tokens: None,
/// };
/// assert_eq!(first.index, 0);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct TokenOutput {
    /// The token's text (may be empty when a multi-byte character is split across
    /// tokens and not complete yet).
    pub token: String,
    /// The token's id in the tokenizer's vocabulary.
    pub token_id: u32,
    /// Position in the generated sequence, starting at 0 (the prompt is not counted).
    pub index: usize,
    /// The token's log-probability under the model's raw log-softmax and the most likely
    /// alternatives, when the request asked ([`GenerateRequest::with_logprobs`]).
    pub logprobs: Option<TokenLogprobs>,
    /// On the first token only, when the request asked
    /// ([`GenerateRequest::with_prompt_logprobs`]): each prompt token's log-probability
    /// and alternatives, `None` for the first prompt token (nothing predicts it).
    pub prompt_logprobs: Option<Vec<Option<TokenLogprobs>>>,
    /// On the first token only, from the continuous engine: how many prompt tokens were
    /// read from its prefix cache instead of computed (OpenAI's `cached_tokens`). `None`
    /// on later tokens and from the engines without a prefix cache.
    pub cached_prompt_tokens: Option<usize>,
}

/// How a request's prompt becomes token ids (the request is this module's; the encoder
/// is the model's, in `llama.rs`).
impl<T: Tokenizer + ?Sized> PromptEncoder<'_, T> {
    /// See [`Llama::encode_request`].
    pub fn encode_request(&self, request: &GenerateRequest) -> Result<Vec<u32>> {
        let ids = match (&request.prompt_ids, &request.messages) {
            (Some(ids), _) => ids.clone(),
            (None, Some(messages)) => {
                let tools: usize = request
                    .tools
                    .iter()
                    .map(|t| t.openai_json().to_string().len())
                    .sum();
                self.check_text_fits(
                    messages
                        .iter()
                        .map(|m| {
                            m.content.len()
                                + m.role.len()
                                + m.tool_calls
                                    .iter()
                                    .map(|c| c.name.len() + c.arguments.len())
                                    .sum::<usize>()
                        })
                        .sum::<usize>()
                        + tools,
                )?;
                self.tokenizer
                    .encode_conversation(messages, &request.tools, true)?
            }
            (None, None) => return self.encode_prompt(&request.prompt),
        };
        if ids.is_empty() {
            return Err(LlamaError::EmptyPrompt);
        }
        Ok(ids)
    }
}

impl<B: LlamaBackend, T: Tokenizer> Llama<B, T> {
    /// The prompt ids of `request`: its [`prompt_ids`](GenerateRequest::prompt_ids) as
    /// they are, else its [`messages`](GenerateRequest::messages) through
    /// [`Tokenizer::encode_chat`] (message content as plain text), else its `prompt`
    /// through [`Llama::encode_prompt`] (special tokens written in it recognised).
    pub fn encode_request(&self, request: &GenerateRequest) -> Result<Vec<u32>> {
        self.encoder().encode_request(request)
    }

    /// The state of `request`, validated already ([`GenerateRequest::validate`]), for its
    /// prompt `ids`: checks what is new (the prompt, [`check_prompt`](Self::check_prompt)),
    /// applies the request's settings ([`GenerationState::with_request`]) and reserves its
    /// cache.
    ///
    /// # Errors
    ///
    /// As [`create_generation_state_from_ids`](Self::create_generation_state_from_ids).
    pub(crate) fn request_state(
        &self,
        ids: Vec<u32>,
        request: &GenerateRequest,
    ) -> Result<GenerationState<B>> {
        self.check_prompt(&ids)?;
        self.reserved(GenerationState::new(ids, request.max_tokens).with_request(request))
    }

    /// Computes `state`'s prompt log-probabilities when `request` asks for them
    /// ([`GenerateRequest::with_prompt_logprobs`]), for
    /// [`GenerationState::take_prompt_logprobs`]: one forward pass over the prompt (in
    /// chunks, the same in every strategy).
    pub fn with_prompt_logprobs(
        &self,
        mut state: GenerationState<B>,
        request: &GenerateRequest,
    ) -> Result<GenerationState<B>> {
        if let Some(n) = request.prompt_logprobs {
            state.prompt_logprobs = Some(self.prompt_logprobs(&state.prompt_tokens, n)?);
        }
        Ok(state)
    }
}

impl<B: LlamaBackend> GenerationState<B> {
    /// Applies a request's stop and reporting settings: `ignore_eos`, `stop_token_ids`,
    /// `min_tokens` and `logprobs` (its sampling controls go to its sampler,
    /// [`request_sampler`](crate::inference::request_sampler)).
    pub fn with_request(mut self, request: &GenerateRequest) -> Self {
        self.honour_stop_tokens = !request.ignore_eos;
        self.extra_stop_ids = request.stop_token_ids.clone();
        self.min_tokens = request.min_tokens;
        self.logprobs = request.logprobs;
        self
    }
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
        assert_eq!(r.sampling.temperature, 0.0);
        assert_eq!(r.sampling.top_p, 1.0);
        assert_ne!(r.seed, GenerateRequest::new("Hello").seed);
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
                tools: Vec::new(),
                prompt_ids: None,
                max_tokens: 7,
                // Every other control at its default, off
                // (`SamplingParams::default`, tested in `sampling::pipeline`).
                sampling: SamplingParams {
                    temperature: 0.5,
                    top_p: 0.25,
                    ..SamplingParams::default()
                },
                seed: 9,
                ignore_eos: true,
                stop_token_ids: Vec::new(),
                min_tokens: 0,
                logprobs: None,
                prompt_logprobs: None,
                constraint: None,
                speculation: None,
                adapter: None,
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
    fn every_control_is_checked_and_named() {
        let a = || GenerateRequest::new("a").with_max_tokens(10);
        assert_invalid(&a().with_min_p(1.5), 100, "min_p");
        assert_invalid(&a().with_min_p(-0.1), 100, "min_p");
        let mut r = a();
        r.sampling.repetition_penalty = 0.0;
        assert_invalid(&r, 100, "repetition_penalty");
        let mut r = a();
        r.sampling.frequency_penalty = 2.5;
        assert_invalid(&r, 100, "frequency_penalty");
        let mut r = a();
        r.sampling.presence_penalty = f32::NAN;
        assert_invalid(&r, 100, "presence_penalty");
        let mut r = a();
        r.sampling.logit_bias = vec![(1, 101.0)];
        assert_invalid(&r, 100, "logit_bias");
        r.sampling.logit_bias = vec![(1, 1.0); 1025];
        assert_invalid(&r, 100, "logit_bias");
        assert_invalid(&a().with_min_tokens(11), 100, "min_tokens");
        assert_invalid(&a().with_logprobs(21), 100, "logprobs");
        assert_invalid(&a().with_prompt_logprobs(21), 100, "prompt_logprobs");
        assert_invalid(
            &a().with_stop_token_ids(vec![1; 257]),
            100,
            "stop_token_ids",
        );
        let ok = a()
            .with_top_k(5)
            .with_min_p(0.1)
            .with_min_tokens(10)
            .with_logprobs(20)
            .with_stop_token_ids(vec![3]);
        assert!(ok.validate(100).is_ok());
        assert!(ok.validate_token_ids(4).is_ok());
        assert!(matches!(
            ok.validate_token_ids(3),
            Err(LlamaError::InvalidParameter {
                name: "stop_token_ids",
                ..
            })
        ));
        let mut r = a();
        r.sampling.logit_bias = vec![(7, -100.0)];
        assert!(matches!(
            r.validate_token_ids(7),
            Err(LlamaError::InvalidParameter {
                name: "logit_bias",
                ..
            })
        ));
    }

    #[test]
    fn each_size_is_checked_where_it_is_known() {
        // `validate`: `max_tokens`, before the prompt is tokenized.
        assert!(matches!(
            check_request_size(None, Some(0), 10),
            Err(LlamaError::InvalidParameter {
                name: "max_tokens",
                ..
            })
        ));
        assert!(check_request_size(None, Some(10), 10).is_ok());
        // Once tokenized, a validated request's prompt alone.
        assert!(check_request_size(Some(9), None, 10).is_ok());
        assert!(matches!(
            check_request_size(Some(10), None, 10),
            Err(LlamaError::PromptTooLong { tokens: 10, max: 9 })
        ));
        assert!(matches!(
            check_request_size(Some(0), None, 10),
            Err(LlamaError::EmptyPrompt)
        ));
        assert!(matches!(
            check_request_size(Some(1), None, 0),
            Err(LlamaError::PromptTooLong { tokens: 1, max: 0 })
        ));
        // Both at once for the methods that take a raw `max_tokens`.
        assert!(matches!(
            check_request_size(Some(5), Some(11), 10),
            Err(LlamaError::InvalidParameter {
                name: "max_tokens",
                ..
            })
        ));
    }

    #[test]
    fn the_sampling_controls_are_one_value() {
        let params = SamplingParams {
            temperature: 0.9,
            top_k: 7,
            top_p: 0.5,
            min_p: 0.1,
            repetition_penalty: 1.2,
            frequency_penalty: 0.3,
            logit_bias: vec![(4, 2.0)],
            ..SamplingParams::default()
        };
        let r = GenerateRequest::new("a").with_sampling(params.clone());
        assert_eq!(r.sampling, params);
        let built = GenerateRequest::new("a")
            .with_sampling(params.clone())
            .with_temperature(0.1)
            .with_top_p(0.2)
            .with_top_k(3)
            .with_min_p(0.3);
        assert_eq!(
            built.sampling,
            SamplingParams {
                temperature: 0.1,
                top_p: 0.2,
                top_k: 3,
                min_p: 0.3,
                ..params
            }
        );
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
            logprobs: None,
            prompt_logprobs: None,
            cached_prompt_tokens: None,
        };
        assert_eq!(t.clone(), t);
    }
}
