//! The sequential strategy: [`Llama::generate`] runs one request to its end, and
//! [`Llama::generate_single_token`] / [`Llama::generate_tokens`] step a
//! [`GenerationState`] made by [`Llama::create_generation_state`], one token (or, with
//! speculation, up to `k + 1` verified tokens) per call. The concurrent strategy
//! interleaves such states through the job runtime ([`crate::inference::runtime`]).
//!
//! Every public method here is a front door: it checks its `temperature` and sampler
//! once ([`Sampler::bind`]: the temperature becomes a `TopP` or `TopK` sampler's own)
//! and then steps with the sampler alone ([`Llama::next_token`], [`Llama::next_tokens`]),
//! which check nothing again.

use crate::backend::LlamaBackend;
use crate::error::{LlamaError, Result};
use crate::llama::{GenerationOutput, GenerationState, Llama, StopReason, logits_to_vec};
use crate::model::Logits;
use crate::sampling::Sampler;
use crate::speculative::{SpeculationConfig, verify};
use crate::tokenizer::Tokenizer;

impl<B: LlamaBackend, T: Tokenizer> Llama<B, T> {
    /// Generates one token for `state`: on the first call the whole prompt is processed.
    /// Returns `(token_id, text_piece, done)`; `text_piece` is the newly completed text
    /// (it can be empty while a multi-byte character is incomplete, and is empty for a
    /// stop token). `temperature` is a `TopP` or `TopK` sampler's; a
    /// [`Pipeline`](crate::sampling::Pipeline) has its own (`temperature` must then be
    /// valid but is not read).
    pub fn generate_single_token(
        &mut self,
        state: &mut GenerationState<B>,
        temperature: f64,
        sampler: &mut Sampler,
    ) -> Result<(u32, String, bool)> {
        sampler.bind(temperature)?;
        self.next_token(state, sampler)
    }

    /// [`generate_single_token`](Self::generate_single_token) with a sampler checked
    /// already (by a front door: [`Sampler::bind`], or
    /// [`GenerateRequest::validate`](crate::inference::GenerateRequest::validate) for a
    /// request's sampler).
    pub(crate) fn next_token(
        &mut self,
        state: &mut GenerationState<B>,
        sampler: &mut Sampler,
    ) -> Result<(u32, String, bool)> {
        if state.is_done() {
            return Err(LlamaError::invalid(
                "state",
                "finished",
                "this generation has already ended",
            ));
        }
        let first = state.tokens.is_empty();
        let input: Vec<u32> = match state.tokens.last() {
            None => {
                state.mark_started();
                let capacity = self.cache_positions(state.prompt_tokens.len(), state.max_tokens);
                state.cache = Some(self.model.new_cache(vec![0], capacity));
                state.prompt_tokens.clone()
            }
            Some(&last) => vec![last],
        };
        let cache = state
            .cache
            .as_mut()
            .ok_or_else(|| LlamaError::Runtime("generation state lost its cache".into()))?;
        let logits = self.step_logits(&input, cache, first)?;
        let token = state.sample_next(&logits, sampler, self.tokenizer.stop_ids())?;
        Ok(self.accept_token(state, token))
    }

    /// Sequential strategy: generates up to `max_tokens` tokens for `prompt`, stopping at
    /// the model's stop tokens. Temperature 0 is greedy.
    ///
    /// ```no_run
    /// # fn main() -> llama_burn::Result<()> {
    /// use llama_burn::{backend::{DefaultBackend, default_device}, llama::LlamaConfig};
    /// use llama_burn::sampling::{Sampler, TopP};
    ///
    /// let device = default_device();
    /// let path = llama_burn::demo::demo_model_path()?;
    /// let mut llama = llama_burn::Loader::gguf(path).max_seq_len(2048).load::<DefaultBackend>(&device)?;
    /// let out = llama.generate("What is AI?", 50, 0.7, &mut Sampler::TopP(TopP::new(0.9, 42)))?;
    /// println!("{} ({:.1} tokens/s)", out.text, out.decode_tokens_per_s());
    /// # Ok(())
    /// # }
    /// ```
    pub fn generate(
        &mut self,
        prompt: &str,
        max_tokens: usize,
        temperature: f64,
        sampler: &mut Sampler,
    ) -> Result<GenerationOutput> {
        sampler.bind(temperature)?;
        let mut state = self.create_generation_state(prompt, max_tokens)?;
        self.run(&mut state, sampler)
    }

    /// Runs a prepared state until it ends and summarises it.
    pub fn run_to_end(
        &mut self,
        state: &mut GenerationState<B>,
        temperature: f64,
        sampler: &mut Sampler,
    ) -> Result<GenerationOutput> {
        sampler.bind(temperature)?;
        self.run(state, sampler)
    }

    /// [`run_to_end`](Self::run_to_end) with a sampler checked already.
    fn run(
        &mut self,
        state: &mut GenerationState<B>,
        sampler: &mut Sampler,
    ) -> Result<GenerationOutput> {
        while !state.is_done() {
            self.next_tokens(state, sampler)?;
        }
        Ok(GenerationOutput {
            text: state.text.clone(),
            tokens: state.tokens.clone(),
            prompt_tokens: state.prompt_tokens.clone(),
            prompt_time: state.time_to_first_token().unwrap_or_default(),
            decode_time: state.decode_time().unwrap_or_default(),
            stop_reason: state.stop_reason.unwrap_or(StopReason::MaxTokens),
            speculation: state.speculation_stats(),
        })
    }

    /// Like [`generate`](Self::generate), decoding with speculation (`config`): the
    /// same tokens, in fewer forward passes when proposals are accepted.
    ///
    /// ```no_run
    /// # fn main() -> llama_burn::Result<()> {
    /// use llama_burn::{backend::{DefaultBackend, default_device}, llama::LlamaConfig};
    /// use llama_burn::sampling::Sampler;
    /// use llama_burn::speculative::SpeculationConfig;
    ///
    /// let path = llama_burn::demo::demo_model_path()?;
    /// let mut llama = llama_burn::Loader::gguf(path).max_seq_len(2048).load::<DefaultBackend>(&default_device())?;
    /// let prompt = "Repeat exactly: the quick brown fox jumps over the lazy dog.";
    /// let out = llama.generate_speculative(prompt, 40, 0.0, &mut Sampler::Argmax, &SpeculationConfig::ngram(8))?;
    /// let stats = out.speculation.unwrap_or_default();
    /// println!("{} ({} of {} proposals accepted)", out.text, stats.accepted_draft_tokens, stats.draft_tokens);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// As [`generate`](Self::generate) and [`with_speculation`](Self::with_speculation).
    pub fn generate_speculative(
        &mut self,
        prompt: &str,
        max_tokens: usize,
        temperature: f64,
        sampler: &mut Sampler,
        config: &SpeculationConfig,
    ) -> Result<GenerationOutput> {
        sampler.bind(temperature)?;
        let state = self.create_generation_state(prompt, max_tokens)?;
        let mut state = self.with_speculation(state, config)?;
        self.run(&mut state, sampler)
    }

    /// Generates the next tokens of `state`: one, as
    /// [`generate_single_token`](Self::generate_single_token) does, or with speculation
    /// ([`with_speculation`](Self::with_speculation)) up to `k + 1` from one forward pass
    /// over the last token and `k` proposed ones, exactly the tokens one-token steps
    /// would give. Returns each token as `generate_single_token` does; the rejected
    /// positions' keys and values are rolled back. [`GenerationState::take_logprobs`]
    /// then holds the last token's log-probabilities.
    ///
    /// # Errors
    ///
    /// As [`generate_single_token`](Self::generate_single_token), and as the proposer.
    pub fn generate_tokens(
        &mut self,
        state: &mut GenerationState<B>,
        temperature: f64,
        sampler: &mut Sampler,
    ) -> Result<Vec<(u32, String, bool)>> {
        sampler.bind(temperature)?;
        self.next_tokens(state, sampler)
    }

    /// [`generate_tokens`](Self::generate_tokens) with a sampler checked already.
    pub(crate) fn next_tokens(
        &mut self,
        state: &mut GenerationState<B>,
        sampler: &mut Sampler,
    ) -> Result<Vec<(u32, String, bool)>> {
        let room = state.draft_room(self.config().max_seq_len);
        let drafts = if state.tokens.is_empty() || state.stop_reason.is_some() {
            Vec::new()
        } else {
            state
                .propose_drafts(room, 1)?
                .map_or_else(Vec::new, |(drafts, _)| drafts)
        };
        let Some(&last) = state.tokens.last().filter(|_| !drafts.is_empty()) else {
            return Ok(vec![self.next_token(state, sampler)?]);
        };
        self.config().check_token_ids(&drafts)?;
        let mut input = Vec::with_capacity(drafts.len() + 1);
        input.push(last);
        input.extend_from_slice(&drafts);
        let cache = state
            .cache
            .as_mut()
            .ok_or_else(|| LlamaError::Runtime("generation state lost its cache".into()))?;
        let before = cache.len();
        let logits = logits_to_vec(self.model.forward(&input, cache, Logits::All)?)?;
        let vocab = self.config().vocab_size;
        let stop_ids = self.tokenizer.stop_ids();
        let mut out = Vec::with_capacity(input.len());
        let accepted = verify(&drafts, logits.chunks(vocab), |row| {
            let token = state.sample_next(row, sampler, stop_ids)?;
            let emitted = self.accept_token(state, token);
            let done = emitted.2;
            out.push(emitted);
            Ok((token, done))
        })?;
        if let Some(cache) = state.cache.as_mut() {
            cache.truncate(before + 1 + accepted);
        }
        state.observe_drafts(drafts.len(), accepted);
        Ok(out)
    }
}
