//! Continuous batching: requests join and leave a running batch at every step.
//!
//! A [`ContinuousEngine`] owns the model on its own thread. Every step it
//!
//! 1. takes new requests off its queue (bounded: a full queue refuses with
//!    [`LlamaError::Overloaded`]) and drops cancelled ones, freeing their cache at once;
//! 2. admits waiting requests while the KV pool (a token budget counted in fixed-size
//!    blocks) has room for their prompt plus `max_tokens`;
//! 3. runs **one** forward pass for every decoding row (the running batch, one KV cache
//!    with a batch dimension, left-aligned as in the batched strategy);
//! 4. spends the rest of its per-step token budget on prompt processing (*chunked
//!    prefill*): a long prompt is processed over several steps, so running requests keep
//!    streaming while it is read. A request whose prompt is done samples its first token
//!    and joins the running batch (its cache is merged in);
//! 5. sends each request's token the moment it is produced and removes finished rows.
//!
//! Each row computes exactly what it would alone (masking, per-row positions), so greedy
//! results are identical to every other strategy. Switching from the concurrent handler
//! to continuous batching is one line:
//!
//! ```no_run
//! # fn main() -> llama_burn::Result<()> {
//! use llama_burn::backend::{DefaultBackend, default_device};
//! use llama_burn::inference::{ContinuousConfig, GenerateRequest, InferenceBuilder};
//! use llama_burn::llama::LlamaConfig;
//!
//! let llama = LlamaConfig::load_gguf::<DefaultBackend>(
//!     llama_burn::demo::demo_model_path()?, 2048, &default_device())?;
//! // was: InferenceBuilder::new().with_model(llama).build(concurrent_streaming_handler)
//! let inference = InferenceBuilder::new().with_model(llama).build_continuous(ContinuousConfig::default())?;
//! let job = inference.infer(GenerateRequest::new("Hello")).spawn();
//! for token in job.stream.iter() {
//!     print!("{}", token.token);
//! }
//! job.join()?;
//! let metrics = inference.with_model_blocking(|engine| engine.metrics())?;
//! println!("{} requests completed", metrics.completed);
//! # Ok(())
//! # }
//! ```

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use burn::tensor::backend::Backend;
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError};

use super::handlers::request_sampler;
use super::request::{GenerateRequest, TokenOutput};
use super::runtime::{
    CancelToken, In, Inference, InferenceBuilder, ModelAccessor, ModelDevice, OutStream,
};
use crate::batched::left_pad;
use crate::cache::KvCache;
use crate::error::{LlamaError, Result};
use crate::llama::{GenerationState, Llama, logits_to_vec};
use crate::model::Logits;
use crate::sampling::Sampler;
use crate::tokenizer::Tokenizer;

/// Sizing of a [`ContinuousEngine`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContinuousConfig {
    /// Most requests generating at once (rows of the running batch plus prompts being
    /// processed).
    pub max_running: usize,
    /// Most requests waiting for admission; one more is refused with
    /// [`LlamaError::Overloaded`].
    pub max_waiting: usize,
    /// KV cache pool size in tokens: a request reserves its prompt plus `max_tokens`
    /// (rounded up to whole blocks) while it runs.
    pub kv_budget_tokens: usize,
    /// Tokens per KV block (the pool's unit of accounting).
    pub block_size: usize,
    /// Tokens processed per step: one per decoding row, the rest for prompt chunks (at
    /// least `min_prefill_chunk` whenever a prompt is waiting to be processed).
    pub step_tokens: usize,
    /// Smallest prompt chunk per step, so prompts progress even when the batch is full.
    pub min_prefill_chunk: usize,
}

impl Default for ContinuousConfig {
    fn default() -> Self {
        Self {
            max_running: 32,
            max_waiting: 256,
            kv_budget_tokens: 32 * 1024,
            block_size: 16,
            step_tokens: 256,
            min_prefill_chunk: 32,
        }
    }
}

impl ContinuousConfig {
    fn validate(&self) -> Result<()> {
        let positive = [
            ("max_running", self.max_running),
            ("kv_budget_tokens", self.kv_budget_tokens),
            ("block_size", self.block_size),
            ("step_tokens", self.step_tokens),
            ("min_prefill_chunk", self.min_prefill_chunk),
        ];
        for (name, value) in positive {
            if value == 0 {
                return Err(LlamaError::invalid(name, 0, "must be at least 1"));
            }
        }
        Ok(())
    }

    fn total_blocks(&self) -> usize {
        self.kv_budget_tokens / self.block_size
    }
}

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// It generated all its tokens or reached a stop token.
    Completed,
    /// It was cancelled.
    Cancelled,
    /// It failed (invalid request, model error).
    Failed,
}

/// Timings of one request.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestMetrics {
    /// Engine-assigned id.
    pub id: u64,
    /// How it ended.
    pub outcome: Outcome,
    /// Prompt length in tokens (0 if it never tokenized).
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub output_tokens: usize,
    /// From submission to admission (start of prompt processing).
    pub queue_time: Duration,
    /// From submission to the first generated token.
    pub time_to_first_token: Option<Duration>,
    /// Mean time between generated tokens after the first.
    pub time_per_output_token: Option<Duration>,
}

/// A snapshot of the engine's state, readable at any time.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineMetrics {
    /// Rows in the running batch (decoding).
    pub running: usize,
    /// Requests whose prompt is being processed.
    pub prefilling: usize,
    /// Requests waiting for admission.
    pub waiting: usize,
    /// KV blocks reserved by admitted requests.
    pub kv_blocks_used: usize,
    /// KV blocks in the pool.
    pub kv_blocks_total: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Bytes held by KV caches right now (running batch and prompts in progress).
    pub cache_bytes: usize,
    /// Forward-pass steps run.
    pub steps: u64,
    /// Requests that completed.
    pub completed: u64,
    /// Requests that were cancelled.
    pub cancelled: u64,
    /// Requests that failed.
    pub failed: u64,
    /// Requests refused because the queue was full.
    pub rejected: u64,
    /// The most recent finished requests (up to 1024), oldest first.
    pub recent: Vec<RequestMetrics>,
}

/// What a request's channel carries.
#[derive(Debug)]
pub enum EngineEvent {
    /// A generated token.
    Token(TokenOutput),
    /// The request ended; no more events follow.
    Done(Result<RequestMetrics>),
}

/// A request submitted to the engine: its events, and a way to cancel it.
#[derive(Debug)]
pub struct EngineJob {
    id: u64,
    events: Receiver<EngineEvent>,
    cancel: Arc<AtomicBool>,
}

impl EngineJob {
    /// The engine-assigned id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The request's events: tokens, then one `Done`.
    pub fn events(&self) -> &Receiver<EngineEvent> {
        &self.events
    }

    /// Asks the engine to drop the request at its next step (freeing its cache).
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Release);
    }

    /// Waits for the request to end, collecting its tokens.
    pub fn collect(self) -> Result<(Vec<TokenOutput>, RequestMetrics)> {
        let mut tokens = Vec::new();
        for event in self.events.iter() {
            match event {
                EngineEvent::Token(t) => tokens.push(t),
                EngineEvent::Done(result) => return result.map(|m| (tokens, m)),
            }
        }
        Err(LlamaError::ModelUnavailable("the engine stopped".into()))
    }
}

impl Drop for EngineJob {
    fn drop(&mut self) {
        // Nobody listens any more: free the request's resources.
        self.cancel();
    }
}

struct Submission {
    id: u64,
    request: GenerateRequest,
    events: Sender<EngineEvent>,
    cancel: Arc<AtomicBool>,
    submitted: Instant,
}

struct Shared {
    waiting: AtomicUsize,
    next_id: AtomicU64,
    metrics: Mutex<EngineMetrics>,
}

/// The continuous-batching engine: a model on its own thread serving every submitted
/// request in a running batch. Dropping it cancels what is left and stops the thread.
pub struct ContinuousEngine<B: Backend, T: Tokenizer> {
    queue: Option<Sender<Submission>>,
    shared: Arc<Shared>,
    config: ContinuousConfig,
    device: B::Device,
    thread: Option<JoinHandle<Llama<B, T>>>,
    _tokenizer: std::marker::PhantomData<fn() -> T>,
}

impl<B: Backend, T: Tokenizer> std::fmt::Debug for ContinuousEngine<B, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ContinuousEngine")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl<B: Backend, T: Tokenizer> ContinuousEngine<B, T> {
    /// Starts the engine thread with the model.
    pub fn start(llama: Llama<B, T>, config: ContinuousConfig) -> Result<Self> {
        config.validate()?;
        let (tx, rx) = crossbeam_channel::unbounded();
        let shared = Arc::new(Shared {
            waiting: AtomicUsize::new(0),
            next_id: AtomicU64::new(0),
            metrics: Mutex::new(EngineMetrics {
                kv_blocks_total: config.total_blocks(),
                block_size: config.block_size,
                ..EngineMetrics::default()
            }),
        });
        let device = llama.device().clone();
        let worker = Worker {
            llama,
            config: config.clone(),
            shared: shared.clone(),
            queue: rx,
            waiting: VecDeque::new(),
            prefilling: Vec::new(),
            running: Vec::new(),
            batch: None,
            blocks_used: 0,
            steps: 0,
        };
        let thread = std::thread::Builder::new()
            .name("llama-burn-continuous".into())
            .spawn(move || worker.run())
            .map_err(|e| LlamaError::Runtime(format!("could not start the engine thread: {e}")))?;
        Ok(Self {
            queue: Some(tx),
            shared,
            config,
            device,
            thread: Some(thread),
            _tokenizer: std::marker::PhantomData,
        })
    }

    /// Queues a request. Fails at once with [`LlamaError::Overloaded`] when
    /// `max_waiting` requests are already waiting; other problems with the request
    /// arrive as its `Done` event.
    pub fn submit(&self, request: GenerateRequest) -> Result<EngineJob> {
        let limit = self.config.max_waiting;
        let admitted = self
            .shared
            .waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                (w < limit).then_some(w + 1)
            });
        if let Err(waiting) = admitted {
            if let Ok(mut m) = self.shared.metrics.lock() {
                m.rejected += 1;
            }
            return Err(LlamaError::Overloaded { waiting, limit });
        }
        let (events, rx) = crossbeam_channel::unbounded();
        let cancel = Arc::new(AtomicBool::new(false));
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let submission = Submission {
            id,
            request,
            events,
            cancel: cancel.clone(),
            submitted: Instant::now(),
        };
        let sent = self
            .queue
            .as_ref()
            .map(|q| q.send(submission).is_ok())
            .unwrap_or(false);
        if !sent {
            self.shared.waiting.fetch_sub(1, Ordering::AcqRel);
            return Err(LlamaError::ModelUnavailable(
                "the engine has stopped".into(),
            ));
        }
        Ok(EngineJob {
            id,
            events: rx,
            cancel,
        })
    }

    /// A snapshot of the engine's metrics.
    pub fn metrics(&self) -> EngineMetrics {
        let mut m = self
            .shared
            .metrics
            .lock()
            .map(|m| m.clone())
            .unwrap_or_default();
        // Submissions not yet seen by the engine thread count as waiting too.
        m.waiting = m.waiting.max(self.shared.waiting.load(Ordering::Acquire));
        m
    }

    /// The engine's configuration.
    pub fn config(&self) -> &ContinuousConfig {
        &self.config
    }

    /// Stops the engine once its queued and running requests are done, and returns the
    /// model.
    pub fn shutdown(mut self) -> Result<Llama<B, T>> {
        self.queue = None;
        let thread = self
            .thread
            .take()
            .ok_or_else(|| LlamaError::ModelUnavailable("the engine has stopped".into()))?;
        thread
            .join()
            .map_err(|_| LlamaError::Runtime("the engine thread panicked".into()))
    }
}

impl<B: Backend, T: Tokenizer> Drop for ContinuousEngine<B, T> {
    fn drop(&mut self) {
        self.queue = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl<B: Backend, T: Tokenizer> ModelDevice for ContinuousEngine<B, T> {
    type Device = B::Device;

    fn devices(&self) -> Vec<B::Device> {
        vec![self.device.clone()]
    }
}

/// Per-request bookkeeping inside the engine.
struct Active<B: Backend> {
    id: u64,
    state: GenerationState<B>,
    sampler: Sampler,
    temperature: f64,
    events: Sender<EngineEvent>,
    cancel: Arc<AtomicBool>,
    blocks: usize,
    submitted: Instant,
    admitted: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    /// Prompt tokens processed so far (prefill) and this request's own cache meanwhile.
    prefilled: usize,
    cache: Option<KvCache<B>>,
}

impl<B: Backend> Active<B> {
    fn metrics(&self, outcome: Outcome) -> RequestMetrics {
        let n = self.state.tokens().len();
        RequestMetrics {
            id: self.id,
            outcome,
            prompt_tokens: self.state.prompt_tokens().len(),
            output_tokens: n,
            queue_time: self.admitted - self.submitted,
            time_to_first_token: self.first_token.map(|t| t - self.submitted),
            time_per_output_token: match (self.first_token, self.last_token) {
                (Some(a), Some(b)) if n > 1 => Some((b - a) / (n as u32 - 1)),
                _ => None,
            },
        }
    }
}

struct Worker<B: Backend, T: Tokenizer> {
    llama: Llama<B, T>,
    config: ContinuousConfig,
    shared: Arc<Shared>,
    queue: Receiver<Submission>,
    waiting: VecDeque<(Submission, Vec<u32>)>,
    prefilling: Vec<Active<B>>,
    /// Rows of `batch`, in cache order.
    running: Vec<Active<B>>,
    batch: Option<KvCache<B>>,
    blocks_used: usize,
    steps: u64,
}

impl<B: Backend, T: Tokenizer> Worker<B, T> {
    fn run(mut self) -> Llama<B, T> {
        loop {
            let idle =
                self.waiting.is_empty() && self.prefilling.is_empty() && self.running.is_empty();
            if !self.take_submissions(idle) {
                break;
            }
            self.drop_cancelled();
            self.admit();
            if let Err(e) = self.step() {
                self.fail_all(&e);
            }
            self.publish();
        }
        let stopped = LlamaError::ModelUnavailable("the engine was shut down".into());
        self.fail_all(&stopped);
        for (sub, _) in std::mem::take(&mut self.waiting) {
            let _ = sub
                .events
                .send(EngineEvent::Done(Err(LlamaError::ModelUnavailable(
                    "the engine was shut down".into(),
                ))));
        }
        self.publish();
        self.llama
    }

    /// Moves new submissions into the waiting queue (validating them). Blocks when the
    /// engine is idle. Returns false once the engine handle is gone and nothing is left.
    fn take_submissions(&mut self, idle: bool) -> bool {
        let mut first = if idle {
            match self.queue.recv_timeout(Duration::from_millis(200)) {
                Ok(sub) => Some(sub),
                Err(RecvTimeoutError::Timeout) => return true,
                Err(RecvTimeoutError::Disconnected) => return false,
            }
        } else {
            None
        };
        loop {
            let sub = match first.take() {
                Some(sub) => sub,
                None => match self.queue.try_recv() {
                    Ok(sub) => sub,
                    Err(TryRecvError::Empty) => return true,
                    Err(TryRecvError::Disconnected) => {
                        return !(self.waiting.is_empty()
                            && self.prefilling.is_empty()
                            && self.running.is_empty());
                    }
                },
            };
            match self.validate(&sub) {
                Ok(ids) => self.waiting.push_back((sub, ids)),
                Err(e) => {
                    self.shared.waiting.fetch_sub(1, Ordering::AcqRel);
                    self.count(Outcome::Failed, None);
                    let _ = sub.events.send(EngineEvent::Done(Err(e)));
                }
            }
        }
    }

    fn validate(&self, sub: &Submission) -> Result<Vec<u32>> {
        let request = &sub.request;
        request.validate(self.llama.config().max_seq_len)?;
        let ids = self.llama.encode_prompt(&request.prompt)?;
        self.llama.check_budget(ids.len(), request.max_tokens)?;
        let blocks = self.blocks_for(ids.len() + request.max_tokens);
        if blocks > self.config.total_blocks() {
            return Err(LlamaError::invalid(
                "max_tokens",
                request.max_tokens,
                "prompt plus max_tokens exceeds the engine's KV cache budget",
            ));
        }
        Ok(ids)
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.config.block_size)
    }

    fn drop_cancelled(&mut self) {
        let waiting = std::mem::take(&mut self.waiting);
        for (sub, ids) in waiting {
            if sub.cancel.load(Ordering::Acquire) {
                self.shared.waiting.fetch_sub(1, Ordering::AcqRel);
                self.count(Outcome::Cancelled, None);
                let _ = sub
                    .events
                    .send(EngineEvent::Done(Err(LlamaError::Cancelled)));
            } else {
                self.waiting.push_back((sub, ids));
            }
        }
        let (cancelled, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.prefilling)
            .into_iter()
            .partition(|a| a.cancel.load(Ordering::Acquire));
        self.prefilling = kept;
        for active in cancelled {
            self.finish(active, Err(LlamaError::Cancelled));
        }
        let keep: Vec<usize> = (0..self.running.len())
            .filter(|&i| !self.running[i].cancel.load(Ordering::Acquire))
            .collect();
        if keep.len() != self.running.len() {
            self.retain_running(&keep, |_| Err(LlamaError::Cancelled));
        }
    }

    /// Keeps the running rows at `keep` (in order) and finishes the others with `result`.
    /// The cache is compacted first, so a finished request's memory is gone before it
    /// hears that it ended.
    fn retain_running(&mut self, keep: &[usize], result: impl Fn(&Active<B>) -> Result<()>) {
        let rows = std::mem::take(&mut self.running);
        let mut dropped = Vec::with_capacity(rows.len() - keep.len());
        for (i, active) in rows.into_iter().enumerate() {
            if keep.contains(&i) {
                self.running.push(active);
            } else {
                dropped.push(active);
            }
        }
        if self.running.is_empty() {
            self.batch = None;
        } else if let Some(batch) = self.batch.as_mut()
            && let Err(e) = batch.retain_rows(keep)
        {
            self.fail_all(&e);
        }
        for active in dropped {
            let r = result(&active);
            self.finish(active, r);
        }
    }

    fn admit(&mut self) {
        while let Some((sub, ids)) = self.waiting.front() {
            if self.running.len() + self.prefilling.len() >= self.config.max_running {
                break;
            }
            let blocks = self.blocks_for(ids.len() + sub.request.max_tokens);
            if self.blocks_used + blocks > self.config.total_blocks() {
                break;
            }
            let Some((sub, ids)) = self.waiting.pop_front() else {
                break;
            };
            self.shared.waiting.fetch_sub(1, Ordering::AcqRel);
            let max_tokens = sub.request.max_tokens;
            let state = match self.llama.create_generation_state_from_ids(ids, max_tokens) {
                Ok(s) if sub.request.ignore_eos => s.ignore_stop_tokens(),
                Ok(s) => s,
                Err(e) => {
                    self.count(Outcome::Failed, None);
                    let _ = sub.events.send(EngineEvent::Done(Err(e)));
                    continue;
                }
            };
            self.blocks_used += blocks;
            self.prefilling.push(Active {
                id: sub.id,
                sampler: request_sampler(&sub.request),
                temperature: sub.request.temperature,
                events: sub.events,
                cancel: sub.cancel,
                blocks,
                submitted: sub.submitted,
                admitted: Instant::now(),
                first_token: None,
                last_token: None,
                prefilled: 0,
                cache: None,
                state,
            });
        }
    }

    /// One engine step: a decode pass over the running batch, then prompt chunks.
    fn step(&mut self) -> Result<()> {
        if !self.running.is_empty() {
            self.decode()?;
            self.steps += 1;
        }
        if !self.prefilling.is_empty() {
            self.prefill()?;
            self.steps += 1;
        }
        Ok(())
    }

    fn decode(&mut self) -> Result<()> {
        let input: Vec<u32> = self
            .running
            .iter()
            .map(|a| a.state.tokens().last().copied().unwrap_or(0))
            .collect();
        let batch = self
            .batch
            .as_mut()
            .ok_or_else(|| LlamaError::Runtime("running rows without a batch cache".into()))?;
        let logits = logits_to_vec(self.llama.model.forward(&input, batch, Logits::Last)?)?;
        let vocab = self.llama.config().vocab_size;
        let mut keep = Vec::with_capacity(self.running.len());
        for (row, active) in self.running.iter_mut().enumerate() {
            let done = emit_token(&self.llama, active, &logits[row * vocab..(row + 1) * vocab])?;
            if !done {
                keep.push(row);
            }
        }
        if keep.len() != self.running.len() {
            self.retain_running(&keep, |_| Ok(()));
        }
        Ok(())
    }

    fn prefill(&mut self) -> Result<()> {
        let mut budget = self
            .config
            .step_tokens
            .saturating_sub(self.running.len())
            .max(self.config.min_prefill_chunk);
        // Whole prompts at the head of the queue that fit this step's budget are read
        // together in one padded pass (as the batched strategy does), then join the
        // running batch with one merge.
        let mut whole = 0;
        let mut group_tokens = 0;
        for active in &self.prefilling {
            let len = active.state.prompt_tokens().len();
            if active.prefilled > 0 || group_tokens + len > budget {
                break;
            }
            group_tokens += len;
            whole += 1;
        }
        if whole >= 2 {
            let group: Vec<Active<B>> = self.prefilling.drain(..whole).collect();
            budget -= group_tokens;
            self.prefill_together(group)?;
        }
        let mut index = 0;
        while index < self.prefilling.len() && budget > 0 {
            let active = &mut self.prefilling[index];
            active.state.mark_started();
            let prompt_len = active.state.prompt_tokens().len();
            let chunk = (prompt_len - active.prefilled).min(budget);
            let tokens =
                active.state.prompt_tokens()[active.prefilled..active.prefilled + chunk].to_vec();
            let capacity = prompt_len + active.state.max_tokens();
            let cache = active
                .cache
                .get_or_insert_with(|| self.llama.model.new_cache(vec![0], capacity));
            let logits = self.llama.model.forward(&tokens, cache, Logits::Last)?;
            active.prefilled += chunk;
            budget -= chunk;
            if active.prefilled < prompt_len {
                index += 1;
                continue;
            }
            let mut active = self.prefilling.remove(index);
            let logits = logits_to_vec(logits)?;
            if emit_token(&self.llama, &mut active, &logits)? {
                self.finish(active, Ok(()));
                continue;
            }
            let cache = active
                .cache
                .take()
                .ok_or_else(|| LlamaError::Runtime("prefill lost its cache".into()))?;
            self.join_batch(cache, vec![active])?;
        }
        Ok(())
    }

    /// Reads several whole prompts in one left-padded, masked forward pass, sends each
    /// its first token, and moves those still generating into the running batch.
    fn prefill_together(&mut self, mut group: Vec<Active<B>>) -> Result<()> {
        let prompts: Vec<&[u32]> = group.iter().map(|a| a.state.prompt_tokens()).collect();
        let (input, starts) = left_pad(&prompts);
        let width = input.len() / prompts.len();
        let budget = group
            .iter()
            .map(|a| a.state.max_tokens())
            .max()
            .unwrap_or(0);
        for active in &mut group {
            active.state.mark_started();
            active.prefilled = active.state.prompt_tokens().len();
        }
        let mut cache = self.llama.model.new_cache(starts, width + budget);
        let logits = logits_to_vec(self.llama.model.forward(&input, &mut cache, Logits::Last)?)?;
        let vocab = self.llama.config().vocab_size;
        let mut keep = Vec::with_capacity(group.len());
        let mut joining = Vec::with_capacity(group.len());
        for (row, mut active) in group.into_iter().enumerate() {
            if emit_token(
                &self.llama,
                &mut active,
                &logits[row * vocab..(row + 1) * vocab],
            )? {
                self.finish(active, Ok(()));
            } else {
                keep.push(row);
                joining.push(active);
            }
        }
        if joining.is_empty() {
            return Ok(());
        }
        cache.retain_rows(&keep)?;
        self.join_batch(cache, joining)
    }

    /// Appends rows (with their cache, rows in the same order) to the running batch.
    fn join_batch(&mut self, cache: KvCache<B>, rows: Vec<Active<B>>) -> Result<()> {
        match self.batch.as_mut() {
            Some(batch) => batch.merge(cache)?,
            None => self.batch = Some(cache),
        }
        self.running.extend(rows);
        Ok(())
    }

    /// Ends a request: frees its blocks, records and sends its result.
    fn finish(&mut self, mut active: Active<B>, result: Result<()>) {
        self.blocks_used = self.blocks_used.saturating_sub(active.blocks);
        active.cache = None;
        let outcome = match &result {
            Ok(()) => Outcome::Completed,
            Err(LlamaError::Cancelled) => Outcome::Cancelled,
            Err(_) => Outcome::Failed,
        };
        let metrics = active.metrics(outcome);
        self.count(outcome, Some(metrics.clone()));
        // Metrics first: whoever hears that the request ended sees its blocks freed.
        self.publish();
        let _ = active
            .events
            .send(EngineEvent::Done(result.map(|()| metrics)));
    }

    /// Fails every admitted request (used when a forward pass fails).
    fn fail_all(&mut self, error: &LlamaError) {
        let message = error.to_string();
        let all: Vec<Active<B>> = std::mem::take(&mut self.running)
            .into_iter()
            .chain(std::mem::take(&mut self.prefilling))
            .collect();
        self.batch = None;
        for active in all {
            self.finish(active, Err(LlamaError::Runtime(message.clone())));
        }
    }

    fn count(&mut self, outcome: Outcome, metrics: Option<RequestMetrics>) {
        if let Ok(mut m) = self.shared.metrics.lock() {
            match outcome {
                Outcome::Completed => m.completed += 1,
                Outcome::Cancelled => m.cancelled += 1,
                Outcome::Failed => m.failed += 1,
            }
            if let Some(metrics) = metrics {
                if m.recent.len() == 1024 {
                    m.recent.remove(0);
                }
                m.recent.push(metrics);
            }
        }
    }

    fn publish(&mut self) {
        let cache_bytes = self.batch.as_ref().map_or(0, KvCache::allocated_bytes)
            + self
                .prefilling
                .iter()
                .filter_map(|a| a.cache.as_ref())
                .map(KvCache::allocated_bytes)
                .sum::<usize>();
        if let Ok(mut m) = self.shared.metrics.lock() {
            m.running = self.running.len();
            m.prefilling = self.prefilling.len();
            m.waiting = self.waiting.len();
            m.kv_blocks_used = self.blocks_used;
            m.cache_bytes = cache_bytes;
            m.steps = self.steps;
        }
    }
}

/// Samples the next token of `active` from its logits and sends it. Returns whether the
/// request is done.
fn emit_token<B: Backend, T: Tokenizer>(
    llama: &Llama<B, T>,
    active: &mut Active<B>,
    logits: &[f32],
) -> Result<bool> {
    let token = active
        .state
        .sample_next(logits, active.temperature, &mut active.sampler)?;
    let index = active.state.tokens().len();
    let (token_id, piece, done) = llama.accept_token(&mut active.state, token);
    let now = Instant::now();
    active.first_token.get_or_insert(now);
    active.last_token = Some(now);
    let _ = active.events.send(EngineEvent::Token(TokenOutput {
        token: piece,
        token_id,
        index,
    }));
    Ok(done)
}

/// Handler for the job runtime that forwards each request to a [`ContinuousEngine`]
/// and streams its tokens back; cancelling the job (or dropping its stream) removes the
/// request from the engine at its next step.
pub fn continuous_batching_handler<B: Backend, T: Tokenizer>(
    In(request): In<GenerateRequest>,
    engine: ModelAccessor<ContinuousEngine<B, T>>,
    cancel: CancelToken,
    output: OutStream<TokenOutput>,
) -> Result<()> {
    let job = engine.submit(move |engine| engine.submit(request))??;
    loop {
        if cancel.is_cancelled() {
            job.cancel();
            return Err(LlamaError::Cancelled);
        }
        match job.events.recv_timeout(Duration::from_millis(20)) {
            Ok(EngineEvent::Token(token)) => {
                if let Err(e) = output.emit(token) {
                    job.cancel();
                    return Err(e);
                }
            }
            Ok(EngineEvent::Done(result)) => return result.map(|_| ()),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => {
                return Err(LlamaError::ModelUnavailable("the engine stopped".into()));
            }
        }
    }
}

impl<B: Backend, T: Tokenizer> InferenceBuilder<Llama<B, T>> {
    /// Serves the model with continuous batching: starts a [`ContinuousEngine`] and a
    /// service whose jobs run [`continuous_batching_handler`], with the same
    /// [`GenerateRequest`] / [`TokenOutput`] job API as the other handlers.
    pub fn build_continuous(
        self,
        config: ContinuousConfig,
    ) -> Result<Inference<ContinuousEngine<B, T>, GenerateRequest, TokenOutput>> {
        let engine = ContinuousEngine::start(self.into_model(), config)?;
        Ok(InferenceBuilder::new()
            .with_model(engine)
            .build(continuous_batching_handler))
    }
}
