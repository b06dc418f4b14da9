//! [`Llama`]: a model plus its tokenizer and KV limits, and a request's state between
//! tokens ([`GenerationState`]): how prompts become ids, how a state is created, how a
//! sampled token is recorded. The strategies that drive them are in
//! [`crate::inference`] (sequential generation and speculation in `sequential.rs`,
//! batches in [`crate::inference::batched`]); loading is [`crate::loader::Loader`].

use std::time::{Duration, Instant};

use burn::tensor::Tensor;

use crate::backend::LlamaBackend;

use std::sync::Arc;

use crate::cache::{KvCache, KvLedger, KvLimits, KvReservation, KvUsage};
/// Re-exported here because the API spec imports it from `llama_burn::llama`; it is
/// defined in [`crate::config`].
#[doc(no_inline)]
pub use crate::config::LlamaConfig;
use crate::error::{LlamaError, Result};
use crate::model::{Logits, Transformer};
use crate::sampling::{
    DeviceDraw, DeviceToken, History, Sampler, TokenLogprob, TokenLogprobs, token_logprobs,
};
use crate::speculative::{
    DraftModel, Proposer, SpeculationConfig, SpeculationStats, Speculator, speculator,
};
use crate::tokenizer::{DynTokenizer, StreamDecoder, Tokenizer};

/// Most bytes of text one token covers, in any tokenizer this crate reads (the longest
/// tokens of Llama-family vocabularies are a few dozen bytes): the bound that refuses an
/// over-long prompt before it is tokenized.
pub const MAX_TOKEN_BYTES: usize = 256;

/// How prompts become token ids, the same for every strategy: a tokenizer and the context
/// window that bounds a prompt's text before it is tokenized. [`Llama`] encodes through
/// it, and so does the continuous engine's submitting side (off the engine thread).
pub(crate) struct PromptEncoder<'a, T: ?Sized> {
    /// The tokenizer.
    pub tokenizer: &'a T,
    /// The context window, prompt plus generated tokens.
    pub max_seq_len: usize,
}

impl<T: Tokenizer + ?Sized> PromptEncoder<'_, T> {
    /// Refuses text of `bytes` bytes that cannot fit the context window whatever its
    /// tokens: no token covers more than [`MAX_TOKEN_BYTES`] bytes. Checked before
    /// tokenizing, so a huge prompt costs nothing.
    pub fn check_text_fits(&self, bytes: usize) -> Result<()> {
        let max = self.max_seq_len;
        if bytes > max.saturating_mul(MAX_TOKEN_BYTES) {
            return Err(LlamaError::invalid(
                "prompt",
                format!("{bytes} bytes"),
                "longer than the context window can hold in any tokenization",
            ));
        }
        Ok(())
    }

    /// See [`Llama::encode_prompt`].
    pub fn encode_prompt(&self, prompt: &str) -> Result<Vec<u32>> {
        if prompt.is_empty() {
            return Err(LlamaError::EmptyPrompt);
        }
        self.check_text_fits(prompt.len())?;
        let mut ids = self.tokenizer.encode(prompt, false, false)?;
        if ids.is_empty() {
            return Err(LlamaError::EmptyPrompt);
        }
        // A prompt that already starts with BOS (e.g. a formatted Llama 3 chat) gets no
        // second one.
        if self.tokenizer.add_bos_by_default()
            && let Some(bos) = self.tokenizer.bos_id()
            && ids[0] != bos
        {
            ids.insert(0, bos);
        }
        Ok(ids)
    }
}
/// The one check of a request's size against a context window of `context` positions,
/// for every strategy: `max_tokens` (when given) is at least 1 and at most `context`, and
/// a prompt of `prompt_len` tokens (when given) is not empty and leaves room for one
/// generated token.
///
/// Each value is checked once per request, where it is first known:
/// [`GenerateRequest::validate`](crate::inference::GenerateRequest::validate) checks `max_tokens` before tokenizing (`prompt_len`
/// `None`), and the strategies that run a validated request check only its prompt once
/// tokenized (`max_tokens` `None`: the handlers through `Llama::check_prompt`, the
/// continuous engine's submitting side). The methods that take a raw `max_tokens` beside
/// a prompt ([`Llama::check_budget`](crate::Llama::check_budget), and through it
/// [`Llama::create_generation_state`](crate::Llama::create_generation_state) and the
/// batched states) check both at once.
pub(crate) fn check_request_size(
    prompt_len: Option<usize>,
    max_tokens: Option<usize>,
    context: usize,
) -> Result<()> {
    if prompt_len == Some(0) {
        return Err(LlamaError::EmptyPrompt);
    }
    match max_tokens {
        Some(0) => return Err(LlamaError::invalid("max_tokens", 0, "must be at least 1")),
        Some(n) if n > context => {
            return Err(LlamaError::invalid(
                "max_tokens",
                n,
                "exceeds the model's context window",
            ));
        }
        _ => {}
    }
    match prompt_len {
        Some(tokens) if tokens >= context => Err(LlamaError::PromptTooLong {
            tokens,
            max: context.saturating_sub(1),
        }),
        _ => Ok(()),
    }
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// The model produced one of its stop tokens.
    StopToken,
    /// `max_tokens` tokens were generated.
    MaxTokens,
    /// The context window is full.
    ContextFull,
    /// The request was cancelled.
    Cancelled,
}

/// The result of [`Llama::generate`].
#[derive(Debug, Clone)]
pub struct GenerationOutput {
    /// Generated text (without the stop token).
    pub text: String,
    /// Generated token ids (including a final stop token, if one ended generation).
    pub tokens: Vec<u32>,
    /// The prompt's token ids.
    pub prompt_tokens: Vec<u32>,
    /// Time to process the prompt and pick the first token.
    pub prompt_time: Duration,
    /// Time spent generating the remaining tokens.
    pub decode_time: Duration,
    /// Why generation ended.
    pub stop_reason: StopReason,
    /// Proposed and accepted tokens, when the request decoded with speculation.
    pub speculation: Option<SpeculationStats>,
}

impl GenerationOutput {
    /// Decode speed: tokens after the first, per second of decode time.
    pub fn decode_tokens_per_s(&self) -> f64 {
        let n = self.tokens.len().saturating_sub(1);
        let secs = self.decode_time.as_secs_f64();
        if n == 0 || secs == 0.0 {
            0.0
        } else {
            n as f64 / secs
        }
    }
}

/// Everything one request needs between tokens: its ids, its own KV cache, its position,
/// its limits and its streaming decoder. States never share a cache, so requests can be
/// interleaved token by token without seeing each other.
///
/// A state made by [`Llama::create_generation_state`] holds a claim on the model's
/// [`KvLimits`] for the largest cache it can need, from creation until it ends or is
/// dropped.
#[derive(Debug)]
pub struct GenerationState<B: LlamaBackend> {
    pub(crate) prompt_tokens: Vec<u32>,
    pub(crate) tokens: Vec<u32>,
    pub(crate) cache: Option<KvCache<B>>,
    /// The claim on the model's KV budget (none for states of the continuous engine,
    /// whose pool is budgeted on its own, and for rows of a batch).
    pub(crate) reservation: Option<KvReservation>,
    pub(crate) max_tokens: usize,
    pub(crate) stop_reason: Option<StopReason>,
    pub(crate) decoder: StreamDecoder,
    pub(crate) text: String,
    pub(crate) honour_stop_tokens: bool,
    /// Stop ids of the request besides the tokenizer's (honoured even when those are not).
    pub(crate) extra_stop_ids: Vec<u32>,
    /// Stop tokens cannot be drawn before this many tokens.
    pub(crate) min_tokens: usize,
    /// Alternatives to report with each token's log-probability (`None`: no logprobs).
    pub(crate) logprobs: Option<usize>,
    /// The log-probabilities of the token sampled last, until taken.
    pub(crate) last_logprobs: Option<TokenLogprobs>,
    /// The prompt's log-probabilities, until taken.
    pub(crate) prompt_logprobs: Option<Vec<Option<TokenLogprobs>>>,
    pub(crate) started: Option<Instant>,
    pub(crate) first_token_at: Option<Instant>,
    pub(crate) finished_at: Option<Instant>,
    /// Speculative decoding's proposer and counts ([`Llama::with_speculation`]).
    pub(crate) speculation: Option<Speculator>,
}

impl<B: LlamaBackend> GenerationState<B> {
    /// A fresh state for `prompt_tokens` and `max_tokens`, checked by the caller (no claim
    /// on the KV budget, no cache yet).
    pub(crate) fn new(prompt_tokens: Vec<u32>, max_tokens: usize) -> Self {
        Self {
            prompt_tokens,
            tokens: Vec::new(),
            cache: None,
            reservation: None,
            max_tokens,
            stop_reason: None,
            decoder: StreamDecoder::new(),
            text: String::new(),
            honour_stop_tokens: true,
            extra_stop_ids: Vec::new(),
            min_tokens: 0,
            logprobs: None,
            last_logprobs: None,
            prompt_logprobs: None,
            started: None,
            first_token_at: None,
            finished_at: None,
            speculation: None,
        }
    }

    /// The prompt's token ids.
    pub fn prompt_tokens(&self) -> &[u32] {
        &self.prompt_tokens
    }

    /// Tokens generated so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Text generated so far (stop token excluded).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Steps taken (tokens generated).
    pub fn steps(&self) -> usize {
        self.tokens.len()
    }

    /// The token budget of this request.
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// Why the request ended, once it has.
    pub fn stop_reason(&self) -> Option<StopReason> {
        self.stop_reason
    }

    /// Whether the request has ended.
    pub fn is_done(&self) -> bool {
        self.stop_reason.is_some()
    }

    /// Ends the request now (for example on cancellation) and frees its KV cache.
    pub fn finish(&mut self, reason: StopReason) {
        if self.stop_reason.is_none() {
            self.stop_reason = Some(reason);
            self.finished_at = Some(Instant::now());
        }
        self.cache = None;
        self.reservation = None;
    }

    /// Bytes of the model's KV budget this request has reserved (0 once it has ended).
    pub fn reserved_bytes(&self) -> usize {
        self.reservation.as_ref().map_or(0, KvReservation::bytes)
    }

    /// Bytes held by this request's KV cache (0 before the first step and after the end).
    pub fn cache_bytes(&self) -> usize {
        self.cache.as_ref().map_or(0, KvCache::allocated_bytes)
    }

    /// Keep generating past stop tokens (until `max_tokens`), as reference
    /// implementations do when asked for a fixed number of tokens.
    pub fn ignore_stop_tokens(mut self) -> Self {
        self.honour_stop_tokens = false;
        self
    }

    /// The log-probabilities of the token generated last (its raw log-softmax value and
    /// the alternatives asked for), when the request asked for them; taking them leaves
    /// `None` until the next token.
    pub fn take_logprobs(&mut self) -> Option<TokenLogprobs> {
        self.last_logprobs.take()
    }

    /// The prompt's log-probabilities, once computed
    /// ([`Llama::with_prompt_logprobs`]); taking them leaves `None`.
    pub fn take_prompt_logprobs(&mut self) -> Option<Vec<Option<TokenLogprobs>>> {
        self.prompt_logprobs.take()
    }

    /// Records the start of processing (the first step), once.
    pub(crate) fn mark_started(&mut self) {
        if self.started.is_none() {
            self.started = Some(Instant::now());
        }
    }

    /// Whether this request's next draw with `sampler` is the plain greedy token of its
    /// logits (no ban, penalty, log-probabilities or constraint), so that
    /// [`record_greedy`](Self::record_greedy) of a device-computed argmax equals
    /// [`sample_next`](Self::sample_next).
    pub(crate) fn draws_plain_greedy(&self, sampler: &Sampler) -> bool {
        self.logprobs.is_none() && self.tokens.len() >= self.min_tokens && sampler.is_plain_greedy()
    }

    /// What [`sample_next`](Self::sample_next) records for a plain greedy draw (see
    /// [`draws_plain_greedy`](Self::draws_plain_greedy)), the token having been picked
    /// elsewhere.
    pub(crate) fn record_greedy(&mut self) {
        self.last_logprobs = None;
    }

    /// The device draw of this request's next token with `sampler`, or `None` where it
    /// must be sampled on the host (the rule is [`crate::sampling::device`]'s; this
    /// passes the request's bans and `logprobs`). A request that speculates is always
    /// sampled on the host: its rows with proposals must be (verification reads every
    /// position's logits), and whether a step gives it proposals depends on the batch, so
    /// drawing its other steps on the device would make its tokens depend on the batch
    /// near a boundary.
    pub(crate) fn device_draw(&self, sampler: &Sampler) -> Option<DeviceDraw> {
        if self.speculation.is_some() {
            return None;
        }
        crate::sampling::device::device_draw(
            sampler,
            self.tokens.len() < self.min_tokens,
            self.logprobs,
        )
    }

    /// What [`sample_next`](Self::sample_next) records for a token drawn on the device as
    /// `draw` said: `sampler`'s generator moved on, the chosen token's log-probability
    /// kept when asked for.
    pub(crate) fn record_device_token(
        &mut self,
        sampler: &mut Sampler,
        draw: &DeviceDraw,
        token: DeviceToken,
    ) {
        crate::sampling::device::commit(sampler, draw);
        self.last_logprobs = self.logprobs.map(|_| TokenLogprobs {
            chosen: TokenLogprob {
                token_id: token.token,
                logprob: token.logprob,
                bytes: Vec::new(),
            },
            top: Vec::new(),
        });
    }

    /// Picks the next token from this request's logits (`stop_ids`: the tokenizer's)
    /// with `sampler` (its [`params`](Sampler::params), checked at the front door), with
    /// its history for the penalties, its stop tokens banned before `min_tokens`, and its
    /// log-probabilities kept when asked for. Depends on nothing but the row.
    pub(crate) fn sample_next(
        &mut self,
        logits: &[f32],
        sampler: &mut Sampler,
        stop_ids: &[u32],
    ) -> Result<u32> {
        let banned: Vec<u32> = if self.tokens.len() < self.min_tokens {
            let model = stop_ids.iter().filter(|_| self.honour_stop_tokens);
            model.chain(&self.extra_stop_ids).copied().collect()
        } else {
            Vec::new()
        };
        let history = History {
            prompt: &self.prompt_tokens,
            output: &self.tokens,
            banned: &banned,
        };
        let token = sampler.draw(logits, history)?;
        self.last_logprobs = match self.logprobs {
            Some(n) => Some(token_logprobs(logits, token, n)?),
            None => None,
        };
        Ok(token)
    }

    /// Proposed and accepted tokens so far, when the request decodes with speculation.
    pub fn speculation_stats(&self) -> Option<SpeculationStats> {
        self.speculation.as_ref().map(Speculator::stats)
    }

    /// Records a verification of `proposed` of this request's proposals, of which
    /// `accepted` were accepted.
    pub(crate) fn observe_drafts(&mut self, proposed: usize, accepted: usize) {
        if let Some(spec) = self.speculation.as_mut() {
            spec.observe(proposed, accepted);
        }
    }

    /// Proposals of this request for its next step of `rows` decoding rows, at most
    /// `room`, with its acceptance
    /// rate as [`allocate`](crate::speculative::allocate) weighs them in a batch; `None`
    /// when it does not speculate.
    ///
    /// # Errors
    ///
    /// As the proposer.
    pub(crate) fn propose_drafts(
        &mut self,
        room: usize,
        rows: usize,
    ) -> Result<Option<(Vec<u32>, crate::speculative::Candidate)>> {
        let Some(spec) = self.speculation.as_mut() else {
            return Ok(None);
        };
        let drafts = spec.propose(&self.prompt_tokens, &self.tokens, room, rows)?;
        let candidate = spec.candidate(drafts.len());
        Ok(Some((drafts, candidate)))
    }

    /// How many tokens one verification step may propose now: it emits at most one
    /// more than it proposes, within `max_tokens` and the context window.
    pub(crate) fn draft_room(&self, max_seq_len: usize) -> usize {
        let total = self.prompt_tokens.len() + self.tokens.len();
        (self.max_tokens.saturating_sub(self.tokens.len()))
            .saturating_sub(1)
            .min(max_seq_len.saturating_sub(total))
    }

    /// Time from the first step's start to the first token, once known.
    pub fn time_to_first_token(&self) -> Option<Duration> {
        Some(self.first_token_at? - self.started?)
    }

    /// Time from the first token to the end, once finished.
    pub fn decode_time(&self) -> Option<Duration> {
        Some(self.finished_at? - self.first_token_at?)
    }
}

/// A Llama-architecture model with its tokenizer, on backend `B`.
#[derive(Debug)]
pub struct Llama<B: LlamaBackend, T: Tokenizer = DynTokenizer> {
    /// The transformer.
    pub model: Transformer<B>,
    /// The tokenizer.
    pub tokenizer: T,
    device: B::Device,
    /// The account of per-request KV caches against their limits.
    kv_ledger: Arc<KvLedger>,
    /// The constraint engine's view of the vocabulary, built on first use
    /// (`crate::constraints::model`); shared with the continuous engine's submitters,
    /// which compile constraints off the engine thread.
    pub(crate) constraint_vocab: crate::constraints::model::VocabCell,
    /// The draft model of draft-model speculation ([`Llama::set_draft_model`]).
    draft: Option<Transformer<B>>,
}

impl<B: LlamaBackend, T: Tokenizer> Llama<B, T> {
    /// Pairs a model with a tokenizer; fails with [`LlamaError::TokenizerMismatch`] when
    /// the tokenizer has ids the model has no embedding for.
    pub fn new(model: Transformer<B>, tokenizer: T) -> Result<Self> {
        let model_vocab = model.config().vocab_size;
        if tokenizer.vocab_size() > model_vocab {
            return Err(LlamaError::TokenizerMismatch {
                tokenizer_vocab: tokenizer.vocab_size(),
                model_vocab,
            });
        }
        let device = model.device().clone();
        let config = model.config();
        let limits = KvLimits::default_for(config.max_seq_len);
        let kv_ledger = KvLedger::new(
            limits.max_requests,
            limits
                .budget
                .bytes(kv_bytes_per_token::<B>(config, &device)),
        );
        Ok(Self {
            model,
            tokenizer,
            device,
            kv_ledger,
            constraint_vocab: Default::default(),
            draft: None,
        })
    }

    /// Bounds the KV caches of the sequential, concurrent and batched strategies
    /// together (see [`KvLimits`]; the continuous engine budgets its own pool). Requests
    /// already running keep their reservations.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidParameter`] if `max_requests` is 0.
    pub fn set_kv_limits(&mut self, limits: KvLimits) -> Result<()> {
        if limits.max_requests == 0 {
            return Err(LlamaError::invalid("max_requests", 0, "must be at least 1"));
        }
        let bytes = limits.budget.bytes(self.kv_bytes_per_token());
        self.kv_ledger.set_limits(limits.max_requests, bytes);
        Ok(())
    }

    /// Like [`set_kv_limits`](Self::set_kv_limits), by value.
    pub fn with_kv_limits(mut self, limits: KvLimits) -> Result<Self> {
        self.set_kv_limits(limits)?;
        Ok(self)
    }

    /// The per-request KV caches' reservations now, against their limits.
    pub fn kv_usage(&self) -> KvUsage {
        self.kv_ledger.usage()
    }

    /// Starts [`KvUsage::peak_bytes`] again from what is reserved now.
    pub fn reset_kv_peak(&self) {
        self.kv_ledger.reset_peak();
    }

    /// Reserves KV memory for `requests` requests whose caches together span `tokens`
    /// positions.
    ///
    /// # Errors
    ///
    /// - [`LlamaError::InvalidParameter`] if `tokens` alone exceed the whole budget (it
    ///   could never be served);
    /// - [`LlamaError::Overloaded`] if it does not fit beside the reservations held now.
    pub(crate) fn reserve_kv(&self, requests: usize, tokens: usize) -> Result<KvReservation> {
        let bytes = tokens.saturating_mul(self.kv_bytes_per_token());
        let usage = self.kv_ledger.usage();
        if requests > usage.max_requests {
            return Err(LlamaError::InvalidBatch(format!(
                "{requests} rows but at most {} requests may hold a KV cache at once \
                 (Llama::set_kv_limits)",
                usage.max_requests
            )));
        }
        if bytes > usage.budget_bytes {
            return Err(LlamaError::invalid(
                "max_tokens",
                tokens,
                "the request's KV cache (prompt plus max_tokens) is larger than the whole KV \
                 budget (Llama::set_kv_limits)",
            ));
        }
        self.kv_ledger.reserve(requests, bytes)
    }

    /// The model's configuration.
    pub fn config(&self) -> &LlamaConfig {
        self.model.config()
    }

    /// Bytes one token's keys and values take in this model's caches, in its device's
    /// float type (see [`LlamaConfig::kv_bytes_per_token_in`]): what a token of a
    /// [`KvBudget::Tokens`](crate::cache::KvBudget::Tokens) budget stands for.
    pub fn kv_bytes_per_token(&self) -> usize {
        kv_bytes_per_token::<B>(self.config(), &self.device)
    }

    /// Sets how the CPU kernels multiply quantized weights (see
    /// [`Precision`](crate::Precision)); free, the weights are the same in both.
    pub fn set_precision(&mut self, precision: crate::Precision) {
        self.model.set_precision(precision);
    }

    /// This model with `precision` (see [`set_precision`](Self::set_precision)).
    pub fn with_precision(mut self, precision: crate::Precision) -> Self {
        self.set_precision(precision);
        self
    }

    /// The device the model lives on.
    pub fn device(&self) -> &B::Device {
        &self.device
    }

    /// Encodes a prompt as the model expects it: special tokens written in the text are
    /// recognised, and BOS is prepended only where the model's metadata says so (and the
    /// text does not already start with it).
    pub fn encode_prompt(&self, prompt: &str) -> Result<Vec<u32>> {
        self.encoder().encode_prompt(prompt)
    }

    /// How this model's prompts become token ids.
    pub(crate) fn encoder(&self) -> PromptEncoder<'_, T> {
        PromptEncoder {
            tokenizer: &self.tokenizer,
            max_seq_len: self.config().max_seq_len,
        }
    }

    /// Refuses text of `bytes` bytes that cannot fit the context window whatever its
    /// tokens (see [`PromptEncoder::check_text_fits`]).
    fn check_text_fits(&self, bytes: usize) -> Result<()> {
        self.encoder().check_text_fits(bytes)
    }

    /// The same model with its tokenizer passed through `f` (the continuous engine shares
    /// it with its submitters as an `Arc`, and takes it back at shutdown).
    pub(crate) fn map_tokenizer<U: Tokenizer>(self, f: impl FnOnce(T) -> U) -> Llama<B, U> {
        Llama {
            model: self.model,
            tokenizer: f(self.tokenizer),
            device: self.device,
            kv_ledger: self.kv_ledger,
            // The same vocabulary: `f` wraps the tokenizer, it does not change it.
            constraint_vocab: self.constraint_vocab,
            draft: self.draft,
        }
    }

    /// Checks a prompt length and token budget against the context window.
    pub fn check_budget(&self, prompt_len: usize, max_tokens: usize) -> Result<()> {
        check_request_size(
            Some(prompt_len),
            Some(max_tokens),
            self.config().max_seq_len,
        )
    }

    /// Checks the prompt of a request whose `max_tokens` is checked already
    /// ([`GenerateRequest::validate`](crate::inference::GenerateRequest::validate)): its
    /// length against the context window and its ids against the vocabulary.
    pub(crate) fn check_prompt(&self, ids: &[u32]) -> Result<()> {
        check_request_size(Some(ids.len()), None, self.config().max_seq_len)?;
        self.config().check_token_ids(ids)
    }

    /// Prepares a request: tokenizes and validates, nothing heavier. The prompt is
    /// processed by the first [`generate_single_token`](Self::generate_single_token).
    pub fn create_generation_state(
        &self,
        prompt: &str,
        max_tokens: usize,
    ) -> Result<GenerationState<B>> {
        let ids = self.encode_prompt(prompt)?;
        self.create_generation_state_from_ids(ids, max_tokens)
    }

    /// Like [`create_generation_state`](Self::create_generation_state), from token ids.
    ///
    /// # Errors
    ///
    /// Besides invalid input, [`LlamaError::Overloaded`] when the request's cache
    /// (`prompt + max_tokens` positions) does not fit in the model's [`KvLimits`] beside
    /// the requests running now.
    pub fn create_generation_state_from_ids(
        &self,
        prompt_tokens: Vec<u32>,
        max_tokens: usize,
    ) -> Result<GenerationState<B>> {
        let state = self.unreserved_state(prompt_tokens, max_tokens)?;
        self.reserved(state)
    }

    /// `state` with its claim on the model's KV budget for the largest cache it can need.
    pub(crate) fn reserved(&self, mut state: GenerationState<B>) -> Result<GenerationState<B>> {
        let positions = self.cache_positions(state.prompt_tokens.len(), state.max_tokens);
        state.reservation = Some(self.reserve_kv(1, positions)?);
        Ok(state)
    }

    /// Positions a request's cache is allocated for: the prompt and every generated
    /// token, within the context window.
    pub(crate) fn cache_positions(&self, prompt_len: usize, max_tokens: usize) -> usize {
        prompt_len
            .saturating_add(max_tokens)
            .min(self.config().max_seq_len)
    }

    /// A validated state with no claim on the KV budget (its cache is accounted for
    /// elsewhere: a batch's shared cache, the continuous engine's pool).
    pub(crate) fn unreserved_state(
        &self,
        prompt_tokens: Vec<u32>,
        max_tokens: usize,
    ) -> Result<GenerationState<B>> {
        self.check_budget(prompt_tokens.len(), max_tokens)?;
        self.config().check_token_ids(&prompt_tokens)?;
        Ok(GenerationState::new(prompt_tokens, max_tokens))
    }

    /// Records a sampled token in `state` and decides whether the request is done.
    pub(crate) fn accept_token(
        &self,
        state: &mut GenerationState<B>,
        token: u32,
    ) -> (u32, String, bool) {
        let now = Instant::now();
        if state.first_token_at.is_none() {
            state.first_token_at = Some(now);
        }
        state.tokens.push(token);
        if let Some(lp) = state.last_logprobs.as_mut() {
            for t in std::iter::once(&mut lp.chosen).chain(&mut lp.top) {
                t.bytes = self.tokenizer.token_bytes(t.token_id).unwrap_or_default();
            }
        }
        let is_stop = (state.honour_stop_tokens && self.tokenizer.stop_ids().contains(&token))
            || state.extra_stop_ids.contains(&token);
        let mut piece = if is_stop {
            String::new()
        } else {
            state.decoder.push(&self.tokenizer, token)
        };
        let total = state.prompt_tokens.len() + state.tokens.len();
        let reason = if is_stop {
            Some(StopReason::StopToken)
        } else if state.tokens.len() >= state.max_tokens {
            Some(StopReason::MaxTokens)
        } else if total >= self.config().max_seq_len {
            Some(StopReason::ContextFull)
        } else {
            None
        };
        if let Some(reason) = reason {
            piece.push_str(&state.decoder.finish());
            state.finish(reason);
        }
        state.text.push_str(&piece);
        (token, piece, reason.is_some())
    }

    /// Sets the draft model of [`SpeculationMethod::DraftModel`] speculation: any model
    /// on the same backend whose tokenizer is this model's (same vocabulary, same
    /// bytes for every token). A smaller model of the family drafts fastest; the tokens
    /// are the target's whatever the draft.
    ///
    /// [`SpeculationMethod::DraftModel`]: crate::speculative::SpeculationMethod::DraftModel
    ///
    /// # Errors
    ///
    /// [`LlamaError::TokenizerMismatch`] when the vocabularies differ.
    pub fn set_draft_model<U: Tokenizer>(&mut self, draft: Llama<B, U>) -> Result<()> {
        let (ours, theirs) = (self.config().vocab_size, draft.config().vocab_size);
        let same = ours == theirs
            && self.tokenizer.vocab_size() == draft.tokenizer.vocab_size()
            && (0..self.tokenizer.vocab_size() as u32)
                .all(|id| self.tokenizer.token_bytes(id) == draft.tokenizer.token_bytes(id));
        if !same {
            return Err(LlamaError::TokenizerMismatch {
                tokenizer_vocab: draft.tokenizer.vocab_size(),
                model_vocab: ours,
            });
        }
        self.draft = Some(draft.model);
        Ok(())
    }

    /// A proposer running the draft model, if one is set.
    pub(crate) fn draft_proposer(&self) -> Option<Box<dyn Proposer>> {
        self.draft
            .clone()
            .map(|m| Box::new(DraftModel::new(m)) as Box<dyn Proposer>)
    }

    /// Makes `state` decode with speculation as `config` says (see
    /// [`crate::speculative`]): its tokens stay exactly those without speculation.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidParameter`] for invalid settings, or draft-model
    /// speculation without a draft model ([`set_draft_model`](Self::set_draft_model)).
    pub fn with_speculation(
        &self,
        mut state: GenerationState<B>,
        config: &SpeculationConfig,
    ) -> Result<GenerationState<B>> {
        let proposer = match config.method {
            crate::speculative::SpeculationMethod::DraftModel => self.draft_proposer(),
            crate::speculative::SpeculationMethod::NGram => None,
        };
        state.speculation = Some(speculator(config, proposer)?);
        Ok(state)
    }

    /// Logits of every position of `tokens` (a fresh, single-row forward pass):
    /// `[tokens.len(), vocab]` as rows of f32. For scoring and tests.
    pub fn logits(&self, tokens: &[u32]) -> Result<Vec<Vec<f32>>> {
        let mut cache = self.model.new_cache(vec![0], tokens.len());
        let logits = self.model.forward(tokens, &mut cache, Logits::All)?;
        let vocab = self.config().vocab_size;
        Ok(logits_to_vec(logits)?
            .chunks(vocab)
            .map(<[f32]>::to_vec)
            .collect())
    }
}

/// Positions per forward pass when scoring ([`Llama::score`], [`Llama::prompt_logprobs`]).
const SCORE_CHUNK: usize = 64;

/// A prompt's log-probabilities in the making ([`Llama::prompt_scorer`]): the positions
/// scored so far, their results and the cache the next chunk reads.
pub(crate) struct PromptScorer<B: LlamaBackend> {
    /// The prompt.
    ids: Vec<u32>,
    /// Alternatives per position.
    top: usize,
    /// Positions run through the model so far.
    scored: usize,
    /// One entry per scored position that has a successor, after a `None` for the first.
    logprobs: Vec<Option<TokenLogprobs>>,
    cache: KvCache<B>,
    /// The LoRA adapter the prompt is scored with, if any.
    adapter: Option<std::sync::Arc<crate::lora::LoraWeights<B>>>,
}

impl<B: LlamaBackend> PromptScorer<B> {
    /// The prompt, the alternatives asked per position, and the result, once
    /// [`Llama::score_next_chunk`] has said the prompt is scored.
    pub(crate) fn into_parts(self) -> (Vec<u32>, usize, Vec<Option<TokenLogprobs>>) {
        (self.ids, self.top, self.logprobs)
    }
}

/// The result of [`Llama::score`]: how likely the model finds a continuation of a
/// context.
#[derive(Debug, Clone, PartialEq)]
pub struct Score {
    /// The continuation's total log-likelihood: the sum of its tokens' log-probabilities
    /// (raw log-softmax, natural log).
    pub logprob: f64,
    /// Whether greedy decoding from the context would produce exactly the continuation.
    pub is_greedy: bool,
    /// The continuation's token ids.
    pub tokens: Vec<u32>,
    /// Each continuation token's log-probability.
    pub token_logprobs: Vec<f32>,
}

impl<B: LlamaBackend, T: Tokenizer> Llama<B, T> {
    /// Scores `continuation` after `context`, as evaluation harnesses ask (lm-evaluation
    /// harness's `loglikelihood`): the context is encoded as a prompt
    /// ([`encode_prompt`](Self::encode_prompt), BOS included where the model wants it),
    /// the continuation as plain text after it; one forward pass over both.
    ///
    /// ```no_run
    /// # fn main() -> llama_burn::Result<()> {
    /// use llama_burn::{backend::{DefaultBackend, default_device}, llama::LlamaConfig};
    ///
    /// let path = llama_burn::demo::demo_model_path()?;
    /// let llama = llama_burn::Loader::gguf(path).max_seq_len(1024).load::<DefaultBackend>(&default_device())?;
    /// let score = llama.score("The capital of France is", " Paris")?;
    /// println!("log-likelihood {:.3}, greedy: {}", score.logprob, score.is_greedy);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// [`LlamaError::EmptyPrompt`] for an empty context or continuation,
    /// [`LlamaError::PromptTooLong`] when both do not fit the context window.
    pub fn score(&self, context: &str, continuation: &str) -> Result<Score> {
        let context = self.encode_prompt(context)?;
        if continuation.is_empty() {
            return Err(LlamaError::EmptyPrompt);
        }
        self.check_text_fits(continuation.len())?;
        let continuation = self.tokenizer.encode(continuation, false, false)?;
        self.score_ids(&context, &continuation)
    }

    /// [`score`](Self::score) on token ids (taken as they are).
    pub fn score_ids(&self, context: &[u32], continuation: &[u32]) -> Result<Score> {
        if context.is_empty() || continuation.is_empty() {
            return Err(LlamaError::EmptyPrompt);
        }
        let all: Vec<u32> = context.iter().chain(continuation).copied().collect();
        let max = self.config().max_seq_len;
        if all.len() > max {
            return Err(LlamaError::PromptTooLong {
                tokens: all.len(),
                max,
            });
        }
        self.config().check_token_ids(&all)?;
        let mut score = Score {
            logprob: 0.0,
            is_greedy: true,
            tokens: continuation.to_vec(),
            token_logprobs: Vec::with_capacity(continuation.len()),
        };
        self.for_each_logits_row(&all, |position, row| {
            // Row `position` predicts token `position + 1`.
            let Some(j) = (position + 1).checked_sub(context.len()) else {
                return Ok(());
            };
            let Some(&token) = continuation.get(j) else {
                return Ok(());
            };
            let lp = token_logprobs(row, token, 0)?.chosen.logprob;
            score.logprob += f64::from(lp);
            score.is_greedy &= crate::sampling::argmax(row) == token;
            score.token_logprobs.push(lp);
            Ok(())
        })?;
        Ok(score)
    }

    /// Each prompt token's log-probability and its `n` most likely alternatives (`n <=
    /// 20`), from one forward pass over `ids`; the first token has none (`None`).
    ///
    /// # Errors
    ///
    /// As [`score_ids`](Self::score_ids), and [`LlamaError::InvalidParameter`] for
    /// `n > 20`.
    pub fn prompt_logprobs(&self, ids: &[u32], n: usize) -> Result<Vec<Option<TokenLogprobs>>> {
        let mut scorer = self.prompt_scorer(ids.to_vec(), n, None)?;
        while !self.score_next_chunk(&mut scorer)? {}
        Ok(scorer.logprobs)
    }

    /// A scorer of `ids`' log-probabilities with `n` alternatives each, for
    /// [`score_next_chunk`](Self::score_next_chunk): what
    /// [`prompt_logprobs`](Self::prompt_logprobs) runs to the end at once and the
    /// continuous engine runs a chunk per step, between the steps of its other requests.
    ///
    /// # Errors
    ///
    /// As [`prompt_logprobs`](Self::prompt_logprobs).
    pub(crate) fn prompt_scorer(
        &self,
        ids: Vec<u32>,
        n: usize,
        adapter: Option<std::sync::Arc<crate::lora::LoraWeights<B>>>,
    ) -> Result<PromptScorer<B>> {
        if ids.is_empty() {
            return Err(LlamaError::EmptyPrompt);
        }
        if ids.len() > self.config().max_seq_len {
            return Err(LlamaError::PromptTooLong {
                tokens: ids.len(),
                max: self.config().max_seq_len,
            });
        }
        self.config().check_token_ids(&ids)?;
        if n > crate::sampling::MAX_TOP_LOGPROBS {
            return Err(LlamaError::invalid(
                "prompt_logprobs",
                n,
                "must be in [0, 20]",
            ));
        }
        let mut logprobs = Vec::with_capacity(ids.len());
        logprobs.push(None);
        Ok(PromptScorer {
            cache: self.model.new_cache(vec![0], ids.len()),
            ids,
            top: n,
            scored: 0,
            logprobs,
            adapter,
        })
    }

    /// Runs the next [`SCORE_CHUNK`] positions of `scorer` through the model (the chunks
    /// of [`prompt_logprobs`](Self::prompt_logprobs), so the numbers are the same) and
    /// returns whether the whole prompt is scored.
    ///
    /// # Errors
    ///
    /// A failed forward pass.
    pub(crate) fn score_next_chunk(&self, scorer: &mut PromptScorer<B>) -> Result<bool> {
        let len = scorer.ids.len();
        let start = scorer.scored;
        if start < len {
            let end = (start + SCORE_CHUNK).min(len);
            let chunk = &scorer.ids[start..end];
            let logits = logits_to_vec(self.model.forward_adapted(
                chunk,
                &mut scorer.cache,
                Logits::All,
                scorer.adapter.as_deref(),
            )?)?;
            for (i, row) in logits.chunks(self.config().vocab_size).enumerate() {
                // Row `position` predicts token `position + 1`.
                let Some(&token) = scorer.ids.get(start + i + 1) else {
                    continue;
                };
                let mut lp = token_logprobs(row, token, scorer.top)?;
                for t in std::iter::once(&mut lp.chosen).chain(&mut lp.top) {
                    t.bytes = self.tokenizer.token_bytes(t.token_id).unwrap_or_default();
                }
                scorer.logprobs.push(Some(lp));
            }
            scorer.scored = end;
        }
        Ok(scorer.scored >= len)
    }

    /// Runs `ids` through the model in chunks of [`SCORE_CHUNK`] positions (so the logits
    /// held at once are bounded whatever the length; a row's logits do not depend on the
    /// chunking) and calls `f(position, logits)` for every position in order.
    fn for_each_logits_row(
        &self,
        ids: &[u32],
        mut f: impl FnMut(usize, &[f32]) -> Result<()>,
    ) -> Result<()> {
        let vocab = self.config().vocab_size;
        let mut cache = self.model.new_cache(vec![0], ids.len());
        for (c, chunk) in ids.chunks(SCORE_CHUNK).enumerate() {
            let logits = logits_to_vec(self.model.forward(chunk, &mut cache, Logits::All)?)?;
            for (i, row) in logits.chunks(vocab).enumerate() {
                f(c * SCORE_CHUNK + i, row)?;
            }
        }
        Ok(())
    }

    /// One generation step's forward pass over `input` (row-major, one row per cache row):
    /// the prompts on the `first` step (read in chunks), else each row's last token. Returns
    /// the logits of each row's last position on the host, `[rows, vocab]` row-major.
    pub(crate) fn step_logits(
        &self,
        input: &[u32],
        cache: &mut KvCache<B>,
        first: bool,
    ) -> Result<Vec<f32>> {
        let logits = if first {
            self.model.forward_prompt(input, cache)?
        } else {
            self.model.forward(input, cache, Logits::Last)?
        };
        logits_to_vec(logits)
    }
}

/// Copies logits to the host as f32, row-major.
pub(crate) fn logits_to_vec<B: LlamaBackend, const D: usize>(
    logits: Tensor<B, D>,
) -> Result<Vec<f32>> {
    logits
        .into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .map_err(|e| LlamaError::Runtime(format!("reading logits: {e:?}")))
}

/// [`Llama::kv_bytes_per_token`] before the `Llama` exists.
fn kv_bytes_per_token<B: LlamaBackend>(config: &LlamaConfig, device: &B::Device) -> usize {
    config.kv_bytes_per_token_in(crate::backend::float_type::<B>(device).unwrap_or_default())
}
