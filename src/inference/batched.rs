//! The batched strategy: many prompts advance together, one forward pass per step.
//!
//! Everything batching lives here: [`BatchedGenerationState`], the batched-state methods
//! of [`Llama`], the left padding, and [`generate_batch`], the strategy in one call
//! (re-exported as `llama_burn::inference::generate_batch`).
//!
//! Prompts are *left*-padded to a common length and padded keys are masked, so each row
//! computes exactly what it would alone (RoPE depends only on relative positions). Rows
//! that finish are dropped from the cache and from later forward passes, so a long row
//! does not make finished rows keep costing compute.

use crate::backend::LlamaBackend;

use crate::cache::{KvCache, KvReservation};
use crate::error::{LlamaError, Result};
use crate::llama::{GenerationState, Llama};
use crate::sampling::{Sampler, TopP, validate_temperature, validate_top_p};
use crate::tokenizer::Tokenizer;

/// Token id written into padding slots (masked, so its value never matters).
const PAD_TOKEN: u32 = 0;

/// Left-pads prompts into one row-major `[rows, width]` input (`width` = the longest
/// prompt; padding slots hold a token whose value never matters, since it is masked) and
/// returns it with each row's first real column.
pub(crate) fn left_pad(prompts: &[&[u32]]) -> (Vec<u32>, Vec<usize>) {
    let width = prompts.iter().map(|p| p.len()).max().unwrap_or(0);
    let mut input = Vec::with_capacity(width * prompts.len());
    let mut starts = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        let start = width - prompt.len();
        input.extend(std::iter::repeat_n(PAD_TOKEN, start));
        input.extend_from_slice(prompt);
        starts.push(start);
    }
    (input, starts)
}

/// The state of a batch of requests that advance together: per-row token buffers,
/// step counts, limits, stop reasons and streaming decoders (one [`GenerationState`]
/// each, without a cache of its own), and one KV cache with a batch dimension holding
/// only the rows still running.
#[derive(Debug)]
pub struct BatchedGenerationState<B: LlamaBackend> {
    rows: Vec<GenerationState<B>>,
    /// Rows still in the cache, in cache order.
    active: Vec<usize>,
    cache: Option<KvCache<B>>,
    /// The claim on the model's KV budget for the shared cache: every active row times
    /// the shared column axis.
    reservation: Option<KvReservation>,
    /// Columns of the shared cache (longest prompt plus largest budget).
    columns: usize,
}

/// What one row produced in one batched step.
pub type RowStep = (u32, String, bool);

impl<B: LlamaBackend> BatchedGenerationState<B> {
    /// Number of rows (requests) in the batch.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether the batch has no rows (never true for a state built by [`Llama`]).
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Per-row state: prompt, generated tokens, text, stop reason.
    pub fn rows(&self) -> &[GenerationState<B>] {
        &self.rows
    }

    /// Rows still generating.
    pub fn active_rows(&self) -> &[usize] {
        &self.active
    }

    /// Whether every row has ended.
    pub fn is_done(&self) -> bool {
        self.active.is_empty()
    }

    /// Rows currently held in the batch's KV cache (finished rows are compacted away).
    pub fn cache_rows(&self) -> usize {
        self.cache.as_ref().map_or(0, KvCache::batch)
    }

    /// Bytes of the model's KV budget the batch has reserved now (it shrinks as rows
    /// end).
    pub fn reserved_bytes(&self) -> usize {
        self.reservation.as_ref().map_or(0, KvReservation::bytes)
    }

    /// Bytes held by the batch's KV cache.
    pub fn cache_bytes(&self) -> usize {
        self.cache.as_ref().map_or(0, KvCache::allocated_bytes)
    }

    /// Keep every row generating past stop tokens until its `max_tokens`.
    pub fn ignore_stop_tokens(mut self) -> Self {
        self.rows = self
            .rows
            .into_iter()
            .map(GenerationState::ignore_stop_tokens)
            .collect();
        self
    }

    /// Applies each row's request settings (`ignore_eos`, `stop_token_ids`, `min_tokens`,
    /// `logprobs`; see [`GenerationState::with_request`]): `requests[i]` to row `i`. The
    /// sampling controls go to the rows' samplers
    /// ([`request_sampler`](crate::inference::request_sampler)).
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidBatch`] when there is not one request per row.
    pub fn with_requests(mut self, requests: &[crate::inference::GenerateRequest]) -> Result<Self> {
        if requests.len() != self.rows.len() {
            return Err(LlamaError::InvalidBatch(format!(
                "{} requests for {} rows",
                requests.len(),
                self.rows.len()
            )));
        }
        self.rows = self
            .rows
            .into_iter()
            .zip(requests)
            .map(|(row, request)| row.with_request(request))
            .collect();
        Ok(self)
    }

    /// The log-probabilities of the token row `row` generated last, when its request
    /// asked for them (see [`GenerationState::take_logprobs`]).
    pub fn take_logprobs(&mut self, row: usize) -> Option<crate::sampling::TokenLogprobs> {
        self.rows.get_mut(row)?.take_logprobs()
    }

    /// Consumes the batch, returning each row's final state.
    pub fn into_rows(self) -> Vec<GenerationState<B>> {
        self.rows
    }
}

impl<B: LlamaBackend, T: Tokenizer> Llama<B, T> {
    /// Prepares a batch: tokenizes and validates every prompt (nothing heavier). Each row
    /// may generate up to `max_tokens` tokens.
    pub fn create_batched_generation_state<S: AsRef<str>>(
        &self,
        prompts: &[S],
        max_tokens: usize,
    ) -> Result<BatchedGenerationState<B>> {
        let ids = self.encode_prompts(prompts)?;
        let limits = vec![max_tokens; ids.len()];
        self.create_batched_generation_state_from_ids(ids, limits)
    }

    /// Encodes every prompt of a batch (see [`Llama::encode_prompt`]) before any runs, so
    /// a bad row fails fast.
    fn encode_prompts<S: AsRef<str>>(&self, prompts: &[S]) -> Result<Vec<Vec<u32>>> {
        if prompts.is_empty() {
            return Err(LlamaError::InvalidBatch("no prompts given".into()));
        }
        prompts
            .iter()
            .map(|p| self.encode_prompt(p.as_ref()))
            .collect()
    }

    /// Prepares a batch from token ids with a token budget per row.
    pub fn create_batched_generation_state_from_ids(
        &self,
        prompts: Vec<Vec<u32>>,
        max_tokens: Vec<usize>,
    ) -> Result<BatchedGenerationState<B>> {
        if prompts.is_empty() {
            return Err(LlamaError::InvalidBatch("no prompts given".into()));
        }
        if prompts.len() != max_tokens.len() {
            return Err(LlamaError::InvalidBatch(format!(
                "{} prompts but {} token budgets",
                prompts.len(),
                max_tokens.len()
            )));
        }
        let rows = prompts
            .into_iter()
            .zip(max_tokens)
            .map(|(ids, max)| self.unreserved_state(ids, max))
            .collect::<Result<Vec<_>>>()?;
        // Every row must fit the shared column axis: longest prompt + largest budget.
        let columns = rows
            .iter()
            .map(|r| r.prompt_tokens().len())
            .max()
            .unwrap_or(0)
            + rows
                .iter()
                .map(GenerationState::max_tokens)
                .max()
                .unwrap_or(0);
        let max = self.config().max_seq_len;
        if columns > max {
            return Err(LlamaError::InvalidBatch(format!(
                "the longest prompt plus the largest max_tokens needs {columns} positions but \
                 the context holds {max}; split the batch or lower max_tokens"
            )));
        }
        // The shared cache is a rectangle: every row pays for the longest.
        let reservation = self.reserve_kv(rows.len(), rows.len().saturating_mul(columns))?;
        let active = (0..rows.len()).collect();
        Ok(BatchedGenerationState {
            rows,
            active,
            cache: None,
            reservation: Some(reservation),
            columns,
        })
    }

    /// Advances every running row by one token in a single forward pass (the first call
    /// processes all prompts). `samplers` has one sampler per row; `temperature` is the
    /// `TopP` and `TopK` samplers' (a [`Pipeline`](crate::sampling::Pipeline) has its
    /// own). Returns, per row, `Some((token_id, text_piece, done))`, or `None` for rows
    /// that had already ended.
    pub fn generate_batched_single_token(
        &mut self,
        state: &mut BatchedGenerationState<B>,
        temperature: f64,
        samplers: &mut [Sampler],
    ) -> Result<Vec<Option<RowStep>>> {
        bind_batch(state, temperature, samplers)?;
        self.batched_step(state, samplers)
    }

    /// [`generate_batched_single_token`](Self::generate_batched_single_token) with
    /// samplers checked already ([`bind_batch`]).
    fn batched_step(
        &mut self,
        state: &mut BatchedGenerationState<B>,
        samplers: &mut [Sampler],
    ) -> Result<Vec<Option<RowStep>>> {
        let mut out: Vec<Option<RowStep>> = vec![None; state.rows.len()];
        if state.active.is_empty() {
            return Ok(out);
        }
        let first = state.cache.is_none();
        let input = match state.cache {
            None => {
                let prompts: Vec<&[u32]> = state
                    .active
                    .iter()
                    .map(|&r| state.rows[r].prompt_tokens())
                    .collect();
                let (input, starts) = left_pad(&prompts);
                let width = input.len() / prompts.len();
                for &r in &state.active {
                    state.rows[r].mark_started();
                }
                let budget = state
                    .active
                    .iter()
                    .map(|&r| state.rows[r].max_tokens())
                    .max()
                    .unwrap_or(0);
                state.cache = Some(self.model.new_cache(starts, width + budget));
                input
            }
            Some(_) => state
                .active
                .iter()
                .map(|&r| state.rows[r].tokens().last().copied().unwrap_or(PAD_TOKEN))
                .collect(),
        };
        let cache = state
            .cache
            .as_mut()
            .ok_or_else(|| LlamaError::Runtime("batch lost its cache".into()))?;
        let logits = self.step_logits(&input, cache, first)?;
        let vocab = self.config().vocab_size;

        // Sample every running row, in parallel: each from its own logits and sampler.
        let stop_ids = self.tokenizer.stop_ids();
        let mut jobs: Vec<(&mut GenerationState<B>, &mut Sampler, &[f32])> = state
            .rows
            .iter_mut()
            .zip(samplers.iter_mut())
            .enumerate()
            .filter_map(|(r, (row, sampler))| {
                let slot = state.active.iter().position(|&a| a == r)?;
                Some((row, sampler, &logits[slot * vocab..(slot + 1) * vocab]))
            })
            .collect();
        let tokens = crate::sampling::for_each_row(&mut jobs, |(row, sampler, logits)| {
            row.sample_next(logits, sampler, stop_ids)
        });
        drop(jobs);
        let mut tokens = tokens.into_iter();
        let mut by_row: Vec<Option<Result<u32>>> = (0..state.rows.len())
            .map(|r| {
                if state.active.contains(&r) {
                    tokens.next()
                } else {
                    None
                }
            })
            .collect();
        let mut still_running = Vec::with_capacity(state.active.len());
        for (slot, &r) in state.active.iter().enumerate() {
            let token = by_row[r]
                .take()
                .ok_or_else(|| LlamaError::Runtime("a running row was not sampled".into()))??;
            let step = self.accept_token(&mut state.rows[r], token);
            if !step.2 {
                still_running.push(slot);
            }
            out[r] = Some(step);
        }
        if still_running.len() != state.active.len() {
            let next_active: Vec<usize> = still_running
                .iter()
                .map(|&slot| state.active[slot])
                .collect();
            if next_active.is_empty() {
                state.cache = None;
                state.reservation = None;
            } else if let Some(cache) = state.cache.as_mut() {
                cache.retain_rows(&still_running)?;
                if let Some(reservation) = state.reservation.as_mut() {
                    let rows = next_active.len();
                    let positions = rows.saturating_mul(state.columns);
                    reservation
                        .shrink_to(rows, positions.saturating_mul(self.kv_bytes_per_token()));
                }
            }
            state.active = next_active;
        }
        Ok(out)
    }

    /// Runs a batch until every row has ended.
    pub fn run_batch_to_end(
        &mut self,
        state: &mut BatchedGenerationState<B>,
        temperature: f64,
        samplers: &mut [Sampler],
    ) -> Result<()> {
        bind_batch(state, temperature, samplers)?;
        while !state.is_done() {
            self.batched_step(state, samplers)?;
        }
        Ok(())
    }
}

/// The front door of the batched methods that take a `temperature` beside the rows'
/// samplers: one sampler per row, each checked and bound to `temperature`
/// ([`Sampler::bind`]), once per call.
fn bind_batch<B: LlamaBackend>(
    state: &BatchedGenerationState<B>,
    temperature: f64,
    samplers: &mut [Sampler],
) -> Result<()> {
    validate_temperature(temperature)?;
    if samplers.len() != state.rows.len() {
        return Err(LlamaError::InvalidBatch(format!(
            "{} samplers for {} rows",
            samplers.len(),
            state.rows.len()
        )));
    }
    samplers.iter_mut().try_for_each(|s| s.bind(temperature))
}

/// Largest number of rows [`generate_batch`] puts in one forward pass.
pub const DEFAULT_MAX_BATCH: usize = 32;

/// Generates up to `max_tokens` tokens for every prompt, batched, and returns each
/// prompt's generated text pieces in order. Row `i` samples with its own seed
/// `seed + i`, so results do not depend on how rows are grouped. Temperature 0 is
/// greedy. Batches larger than [`DEFAULT_MAX_BATCH`] are split.
///
/// ```no_run
/// # fn main() -> llama_burn::Result<()> {
/// use llama_burn::{backend::{DefaultBackend, default_device}, llama::LlamaConfig};
/// use llama_burn::inference::generate_batch;
///
/// let path = llama_burn::demo::demo_model_path()?;
/// let mut llama = llama_burn::Loader::gguf(path).max_seq_len(1024).load::<DefaultBackend>(&default_device())?;
/// let prompts = ["What is the capital of France?", "Explain quantum computing."];
/// let results = generate_batch(&mut llama, &prompts, 50, 0.7, 0.9, 42)?;
/// for (prompt, pieces) in prompts.iter().zip(&results) {
///     println!("{prompt}: {}", pieces.concat());
/// }
/// # Ok(())
/// # }
/// ```
pub fn generate_batch<B: LlamaBackend, T: Tokenizer, S: AsRef<str>>(
    llama: &mut Llama<B, T>,
    prompts: &[S],
    max_tokens: usize,
    temperature: f64,
    top_p: f64,
    seed: u64,
) -> Result<Vec<Vec<String>>> {
    generate_batch_with_max(
        llama,
        prompts,
        max_tokens,
        temperature,
        top_p,
        seed,
        DEFAULT_MAX_BATCH,
    )
}

/// [`generate_batch`] with an explicit largest batch size.
pub fn generate_batch_with_max<B: LlamaBackend, T: Tokenizer, S: AsRef<str>>(
    llama: &mut Llama<B, T>,
    prompts: &[S],
    max_tokens: usize,
    temperature: f64,
    top_p: f64,
    seed: u64,
    max_batch: usize,
) -> Result<Vec<Vec<String>>> {
    validate_temperature(temperature)?;
    validate_top_p(top_p)?;
    if max_batch == 0 {
        return Err(LlamaError::invalid("max_batch", 0, "must be at least 1"));
    }
    let ids = llama.encode_prompts(prompts)?;
    let mut results = Vec::with_capacity(prompts.len());
    for (chunk_index, chunk) in ids.chunks(max_batch).enumerate() {
        let first_row = chunk_index * max_batch;
        let mut state = llama.create_batched_generation_state_from_ids(
            chunk.to_vec(),
            vec![max_tokens; chunk.len()],
        )?;
        // Checked above: each row's sampler is made at `temperature`, not bound again.
        let mut samplers: Vec<Sampler> = (0..chunk.len())
            .map(|i| {
                let seed = seed.wrapping_add((first_row + i) as u64);
                Sampler::TopP(TopP::at(top_p, seed, temperature))
            })
            .collect();
        let mut pieces = vec![Vec::new(); chunk.len()];
        while !state.is_done() {
            let steps = llama.batched_step(&mut state, &mut samplers)?;
            for (row, step) in steps.into_iter().enumerate() {
                if let Some((_, piece, _)) = step
                    && !piece.is_empty()
                {
                    pieces[row].push(piece);
                }
            }
        }
        results.extend(pieces);
    }
    Ok(results)
}
