//! The engine thread: takes submissions, asks the scheduler what to run, runs the model
//! once per step over the paged KV cache, samples and streams.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::backend::LlamaBackend;
use crossbeam_channel::{Receiver, RecvTimeoutError, TryRecvError};

use super::scheduler::{RequestId, Scheduler, SchedulerLimits, StepPlan};
use super::{
    ContinuousConfig, EmbedSubmission, Outcome, RequestMetrics, Shared, Sink, Submission, Work,
};
use crate::cache::disk::PrefixDisk;
use crate::cache::{BlockManager, PagedKvCache};
use crate::constraints::ConstraintState;
use crate::embed::EmbeddingJob;
use crate::error::{LlamaError, Result};
use crate::inference::TokenOutput;
use crate::inference::handlers::sampler_with;
use crate::inference::runtime::CancelToken;
use crate::llama::{GenerationState, Llama, PromptScorer, StopReason, logits_to_vec};
use crate::lora::LoraWeights;
use crate::model::PagedRow;
use crate::sampling::{DeviceDraw, DeviceToken, Sampler};
use crate::speculative::SpeculationStats;
use crate::tokenizer::Tokenizer;
use burn::tensor::{Int, Tensor, TensorData};

/// How long an idle engine waits for a submission before looking at its flags again.
const IDLE_WAIT: Duration = Duration::from_millis(50);

/// What a step reads back: (greedy rows, argmax on the device) every sampled row's
/// token, or the tokens of the rows drawn on the device and the logits of the others.
enum StepOutput {
    Tokens(Vec<u32>),
    Rows {
        /// The rows drawn on the device: their draw and token.
        device: HashMap<RequestId, (DeviceDraw, DeviceToken)>,
        /// The logits of the other rows, one after another.
        logits: Vec<f32>,
        /// Which rows of the step's logits those are, in order.
        rows: Vec<usize>,
    },
}

/// A step's `logits` read back: `device_rows` (request, row of the logits, draw) drawn on
/// the device where the backend can ([`LlamaBackend::sample_tokens`]), then the logits of
/// every row not drawn there.
fn read_rows<B: LlamaBackend>(
    logits: Tensor<B, 2>,
    device_rows: &[(RequestId, usize, DeviceDraw)],
) -> Result<StepOutput> {
    let total = logits.dims()[0];
    let mut device = HashMap::new();
    if !device_rows.is_empty() {
        let draws: Vec<DeviceDraw> = device_rows.iter().map(|&(_, _, d)| d).collect();
        let drawn = if device_rows.len() == total {
            B::sample_tokens(&logits, &draws)?
        } else {
            let at: Vec<usize> = device_rows.iter().map(|&(_, i, _)| i).collect();
            B::sample_tokens(&select_rows(logits.clone(), &at), &draws)?
        };
        for (&(id, _, draw), token) in device_rows.iter().zip(drawn.unwrap_or_default()) {
            if let Some(token) = token {
                device.insert(id, (draw, token));
            }
        }
    }
    let drawn: Vec<usize> = device_rows
        .iter()
        .filter(|(id, _, _)| device.contains_key(id))
        .map(|&(_, i, _)| i)
        .collect();
    let rows: Vec<usize> = (0..total).filter(|i| !drawn.contains(i)).collect();
    let logits = if rows.is_empty() {
        Vec::new()
    } else if rows.len() == total {
        logits_to_vec(logits)?
    } else {
        logits_to_vec(select_rows(logits, &rows))?
    };
    Ok(StepOutput::Rows {
        device,
        logits,
        rows,
    })
}

/// Rows `at` of `logits`, in that order, selected on its device.
fn select_rows<B: LlamaBackend>(logits: Tensor<B, 2>, at: &[usize]) -> Tensor<B, 2> {
    let at: Vec<i64> = at.iter().map(|&i| i as i64).collect();
    let n = at.len();
    let at = Tensor::<B, 1, Int>::from_data(TensorData::new(at, [n]), &logits.device());
    logits.select(0, at)
}

/// One request inside the engine: its generation state (tokens, decoder, stop rules),
/// its sampler, where its results go, and its timings. Its KV blocks are the
/// scheduler's business.
struct Active<B: LlamaBackend> {
    state: GenerationState<B>,
    sampler: Sampler,
    sink: Sink,
    cancel: CancelToken,
    submitted: Instant,
    admitted: Option<Instant>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    prefix_hit_tokens: usize,
    preemptions: u32,
    /// Fault injection (tests only): a step that runs this request panics.
    poisoned: bool,
    /// The request's LoRA adapter, held while it runs.
    adapter: Option<Arc<LoraWeights<B>>>,
}

impl<B: LlamaBackend> Active<B> {
    fn metrics(&self, id: RequestId, outcome: Outcome) -> RequestMetrics {
        let n = self.state.tokens().len();
        RequestMetrics {
            id,
            outcome,
            stop_reason: self.state.stop_reason(),
            prompt_tokens: self.state.prompt_tokens().len(),
            prefix_hit_tokens: self.prefix_hit_tokens,
            output_tokens: n,
            preemptions: self.preemptions,
            queue_time: self.admitted.unwrap_or(self.submitted) - self.submitted,
            time_to_first_token: self.first_token.map(|t| t - self.submitted),
            time_per_output_token: match (self.first_token, self.last_token) {
                (Some(a), Some(b)) if n > 1 => Some((b - a) / (n as u32 - 1)),
                _ => None,
            },
        }
    }
}

/// The engine thread's state.
pub(super) struct Worker<B: LlamaBackend, T: Tokenizer> {
    llama: Llama<B, T>,
    cache: PagedKvCache<B>,
    scheduler: Scheduler,
    requests: HashMap<RequestId, Active<B>>,
    queue: Receiver<Work>,
    shared: Arc<Shared>,
    steps: u64,
    /// The engine's default speculation ([`ContinuousConfig::speculation`]).
    speculation: Option<crate::speculative::SpeculationConfig>,
    /// Proposed and accepted tokens, all requests together.
    spec_stats: SpeculationStats,
    /// Submissions that asked for their prompt's log-probabilities, waiting for them in
    /// arrival order ([`score_prompts`](Self::score_prompts)).
    scoring: VecDeque<Submission>,
    /// The scoring of the first of them, a chunk of positions further each step.
    scorer: Option<PromptScorer<B>>,
    /// The last scored prompt's log-probabilities `(ids, alternatives, result)`, kept
    /// while submissions wait for scoring: the `n` choices of an API request arrive
    /// together and share them, so the forward pass over their prompt runs once, not `n`
    /// times.
    last_prompt_logprobs: Option<(Vec<u32>, usize, Option<u128>, PromptLogprobs)>,
    /// The prefix cache's copy on disk ([`ContinuousConfig::prefix_cache_disk`]).
    disk: Option<PrefixDisk>,
    /// Inputs waiting to be embedded, in arrival order
    /// ([`embed_inputs`](Self::embed_inputs)).
    embeddings: VecDeque<EmbedSubmission>,
    /// The embedding of the first of them, a forward pass further each step.
    embedder: Option<EmbeddingJob<B>>,
}

/// A prompt's log-probabilities, a `None` for its first token.
type PromptLogprobs = Vec<Option<crate::sampling::TokenLogprobs>>;

/// Marks the engine gone when dropped, however its thread ends: submissions are refused
/// from then on and the engine's gauges read zero (nothing waits or runs any more).
pub(super) struct GoneGuard(Arc<Shared>);

impl Drop for GoneGuard {
    fn drop(&mut self) {
        mark_gone(&self.0);
    }
}

/// Marks the engine gone if dropped while a panic unwinds past it. Bound next to a local
/// that owns a request's sink, after it, so that it is dropped first: the request's
/// submitter, told that its request ended, finds the engine already marked gone.
struct GoneOnUnwind(Arc<Shared>);

impl Drop for GoneOnUnwind {
    fn drop(&mut self) {
        if std::thread::panicking() {
            mark_gone(&self.0);
        }
    }
}

/// Refuses submissions from now on and zeroes the engine's gauges.
fn mark_gone(shared: &Shared) {
    shared.gone.store(true, Ordering::Release);
    shared.waiting.store(0, Ordering::Release);
    if let Ok(mut m) = shared.metrics.lock() {
        m.running = 0;
        m.prefilling = 0;
        m.waiting = 0;
        m.kv_blocks_used = 0;
        m.kv_bytes_used = 0;
    }
}

impl<B: LlamaBackend, T: Tokenizer> Worker<B, T> {
    /// Allocates the pool (`num_blocks` blocks) for `llama`.
    pub(super) fn new(
        llama: Llama<B, T>,
        config: &ContinuousConfig,
        num_blocks: usize,
        shared: Arc<Shared>,
        queue: Receiver<Work>,
    ) -> Result<Self> {
        let c = llama.config();
        let mut cache = PagedKvCache::with_types(
            c.n_layers,
            num_blocks,
            config.block_size,
            c.n_kv_heads,
            c.head_dim,
            config.kv_cache_types,
            llama.device(),
        )?;
        let limits = SchedulerLimits {
            max_running: config.max_running,
            step_tokens: config.step_tokens,
            min_prefill_chunk: config.min_prefill_chunk,
        };
        let mut blocks = BlockManager::new(num_blocks, config.block_size, config.prefix_caching);
        let disk = match &config.prefix_cache_disk {
            Some(disk) if config.prefix_caching => {
                // Everything besides the model and the pool's layout that changes a
                // block's bits.
                let identity = format!(
                    "llama-burn {}; backend {}; precision {}; simd {}",
                    env!("CARGO_PKG_VERSION"),
                    std::any::type_name::<B>(),
                    c.precision,
                    crate::kernels::SimdPath::active().name(),
                );
                blocks.record_registrations(true);
                Some(PrefixDisk::open(disk, &identity, &mut blocks, &mut cache)?)
            }
            _ => None,
        };
        let worker = Self {
            llama,
            cache,
            scheduler: Scheduler::new(limits, blocks),
            requests: HashMap::new(),
            queue,
            shared,
            steps: 0,
            speculation: config.speculation,
            spec_stats: SpeculationStats::default(),
            scoring: VecDeque::new(),
            scorer: None,
            last_prompt_logprobs: None,
            disk,
            embeddings: VecDeque::new(),
            embedder: None,
        };
        worker.publish();
        Ok(worker)
    }

    /// The engine loop; returns the model when the engine stops.
    pub(super) fn run(mut self) -> Llama<B, T> {
        // Whatever ends the thread, even a panic outside a step, marks the engine gone.
        // A local is dropped before the worker (a parameter) while a panic unwinds, so
        // the engine reads gone before any request's sink is dropped: whoever learns
        // that its request ended with the engine finds `/health` saying so.
        let _gone = GoneGuard(self.shared.clone());
        loop {
            if self.shared.stop.load(Ordering::Acquire) {
                self.end_all(|| LlamaError::Cancelled);
                break;
            }
            if !self.take_submissions() {
                break;
            }
            self.score_prompts();
            self.embed_inputs();
            self.drop_cancelled();
            self.propose();
            let plan = self.scheduler.schedule();
            self.note_admissions(&plan);
            if !plan.rows.is_empty() {
                self.execute_isolated(&plan);
                self.persist();
            }
            self.publish();
        }
        self.publish();
        self.llama
    }

    /// Moves new submissions into the scheduler (validating them), or into the queue of
    /// those waiting for their prompt's log-probabilities. Waits for one when the engine
    /// is idle. Returns false when the engine should stop.
    fn take_submissions(&mut self) -> bool {
        let mut first = None;
        if self.scheduler.is_idle() && self.scoring.is_empty() && self.embeddings.is_empty() {
            if self.shared.drain.load(Ordering::Acquire) && self.queue.is_empty() {
                return false;
            }
            match self.queue.recv_timeout(IDLE_WAIT) {
                Ok(sub) => first = Some(sub),
                Err(RecvTimeoutError::Timeout) => return true,
                Err(RecvTimeoutError::Disconnected) => return false,
            }
        }
        loop {
            let work = match first.take() {
                Some(work) => work,
                None => match self.queue.try_recv() {
                    Ok(work) => work,
                    Err(TryRecvError::Empty | TryRecvError::Disconnected) => return true,
                },
            };
            let sub = match work {
                Work::Generate(sub) => *sub,
                Work::Embed(embedding) => {
                    self.embeddings.push_back(embedding);
                    continue;
                }
            };
            if sub.fault.exit {
                // Test-only (`exit_marker`): a bug that no step contains ends the thread.
                // `sub` is dropped after this guard, so its submitter learns of the end
                // only once the engine reads gone.
                let _gone_first = GoneOnUnwind(self.shared.clone());
                panic!("fault injected: the engine thread ends (exit_marker)");
            }
            if sub.request.prompt_logprobs.is_some() {
                // Checked before any scoring is spent on it.
                match self.check_fits(&sub) {
                    Ok(()) => self.scoring.push_back(sub),
                    Err(e) => self.refuse(sub, e),
                }
            } else {
                self.admit(sub, None);
            }
        }
    }

    /// Runs one chunk of positions of the first waiting prompt's log-probabilities (so a
    /// long prompt delays the running streams by a chunk per step, not by the whole
    /// pass; vLLM's chunked prefill, for scoring) and admits the submissions whose
    /// prompt is scored: those of one prompt (the `n` choices of an API request) share
    /// one pass. A submission whose client has gone leaves the queue, its scoring
    /// stopped.
    fn score_prompts(&mut self) {
        let mut i = 0;
        while i < self.scoring.len() {
            if self.scoring[i].cancel.is_cancelled() {
                if i == 0 {
                    self.scorer = None;
                }
                if let Some(sub) = self.scoring.remove(i) {
                    self.refuse(sub, LlamaError::Cancelled);
                }
            } else {
                i += 1;
            }
        }
        let mut chunks = 1;
        while let Some(sub) = self.scoring.front() {
            let top = sub.request.prompt_logprobs.unwrap_or(0);
            let adapter = sub
                .adapter
                .clone()
                .and_then(|a| a.downcast::<LoraWeights<B>>().ok());
            let fingerprint = adapter.as_ref().map(|a| a.fingerprint());
            let scored = self
                .last_prompt_logprobs
                .as_ref()
                .filter(|(ids, n, f, _)| *ids == sub.prompt && *n == top && *f == fingerprint)
                .map(|(_, _, _, logprobs)| logprobs.clone());
            if let Some(logprobs) = scored {
                if let Some(sub) = self.scoring.pop_front() {
                    self.admit(sub, Some(logprobs));
                }
                continue;
            }
            if chunks == 0 {
                break;
            }
            chunks -= 1;
            let (llama, scorer) = (&self.llama, &mut self.scorer);
            // A panic while scoring fails this request only.
            let step = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let mut current = match scorer.take() {
                    Some(current) => current,
                    None => llama.prompt_scorer(sub.prompt.clone(), top, adapter)?,
                };
                let done = llama.score_next_chunk(&mut current)?;
                Ok((done, current))
            }))
            .unwrap_or_else(|_| {
                Err(LlamaError::StepFailed(
                    "scoring the prompt panicked; other requests go on".into(),
                ))
            });
            match step {
                Ok((false, current)) => self.scorer = Some(current),
                Ok((true, current)) => {
                    let (ids, n, logprobs) = current.into_parts();
                    self.last_prompt_logprobs = Some((ids, n, fingerprint, logprobs));
                }
                Err(e) => {
                    if let Some(sub) = self.scoring.pop_front() {
                        self.refuse(sub, e);
                    }
                }
            }
        }
        if self.scoring.is_empty() {
            self.last_prompt_logprobs = None;
        }
    }

    /// Runs one forward pass of the first waiting embedding (so a large batch of inputs
    /// delays the running streams by a pass per step) and replies to it once its
    /// vectors are made. Embeddings whose caller has gone leave the queue unrun.
    fn embed_inputs(&mut self) {
        let mut i = 0;
        while i < self.embeddings.len() {
            if self.embeddings[i].cancel.is_cancelled() {
                if i == 0 {
                    self.embedder = None;
                }
                if let Some(gone) = self.embeddings.remove(i) {
                    self.end_embedding(gone, Err(LlamaError::Cancelled));
                }
            } else {
                i += 1;
            }
        }
        let Some(front) = self.embeddings.front() else {
            return;
        };
        let (llama, embedder) = (&self.llama, &mut self.embedder);
        // A panic while embedding fails this embedding only.
        let step = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut job = match embedder.take() {
                Some(job) => job,
                None => llama.embedding_job(front.inputs.clone(), &front.options)?,
            };
            let done = llama.embed_step(&mut job)?;
            Ok((done, job))
        }))
        .unwrap_or_else(|_| {
            Err(LlamaError::StepFailed(
                "embedding panicked; other requests go on".into(),
            ))
        });
        let result = match step {
            Ok((false, job)) => {
                self.embedder = Some(job);
                return;
            }
            Ok((true, job)) => Ok(job.into_vectors()),
            Err(e) => Err(e),
        };
        if let Some(done) = self.embeddings.pop_front() {
            self.end_embedding(done, result);
        }
    }

    /// Counts an embedding out of the waiting requests and replies to it.
    fn end_embedding(&self, embedding: EmbedSubmission, result: Result<Vec<Vec<f32>>>) {
        self.shared.unwait();
        let outcome = match &result {
            Ok(_) => Outcome::Completed,
            Err(LlamaError::Cancelled) => Outcome::Cancelled,
            Err(_) => Outcome::Failed,
        };
        self.record(outcome, None);
        (embedding.reply)(result);
    }

    /// Prepares a submission (with its prompt's log-probabilities, if it asked for them)
    /// and hands it to the scheduler, or ends it with the reason it cannot run.
    fn admit(&mut self, mut sub: Submission, prompt_logprobs: Option<PromptLogprobs>) {
        // A panic that escapes this function ends the thread; `sub` is dropped after this
        // guard, so its submitter learns of the end only once the engine reads gone.
        let _gone_first = GoneOnUnwind(self.shared.clone());
        let constraint = sub.constraint.take();
        // A panic while preparing the request's state fails this request only.
        let prepared = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.prepare(&sub, constraint, prompt_logprobs)
        }))
        .unwrap_or_else(|_| {
            Err(LlamaError::StepFailed(
                "preparing the request panicked; other requests go on".into(),
            ))
        });
        let (state, sampler) = match prepared {
            Ok(prepared) => prepared,
            Err(e) => return self.refuse(sub, e),
        };
        let adapter = match sub.adapter.take().map(|a| a.downcast::<LoraWeights<B>>()) {
            None => None,
            Some(Ok(weights)) => Some(weights),
            Some(Err(_)) => {
                let e = LlamaError::InvalidBatch("an adapter of another backend".into());
                return self.refuse(sub, e);
            }
        };
        if !sub.sink.accepted(sub.prompt.len()) {
            // Nobody listens any more.
            return self.refuse(sub, LlamaError::Cancelled);
        }
        self.scheduler
            .add_for(sub.id, sub.prompt, sub.scope.salt, sub.scope.tenant);
        self.requests.insert(
            sub.id,
            Active {
                sampler,
                sink: sub.sink,
                cancel: sub.cancel,
                submitted: sub.submitted,
                admitted: None,
                first_token: None,
                last_token: None,
                prefix_hit_tokens: 0,
                preemptions: 0,
                poisoned: sub.fault.step_panic,
                adapter,
                state,
            },
        );
    }

    /// Ends a submission that never ran with `error`.
    fn refuse(&mut self, sub: Submission, error: LlamaError) {
        self.shared.waiting.fetch_sub(1, Ordering::AcqRel);
        let outcome = match error {
            LlamaError::Cancelled => Outcome::Cancelled,
            _ => Outcome::Failed,
        };
        self.record(outcome, None);
        sub.sink.done(Err(error));
    }

    /// Whether the engine's KV budget can ever hold the submission's prompt and
    /// `max_tokens`.
    fn check_fits(&self, sub: &Submission) -> Result<()> {
        if self
            .scheduler
            .fits(sub.prompt.len() + sub.request.max_tokens)
        {
            Ok(())
        } else {
            Err(LlamaError::invalid(
                "max_tokens",
                sub.request.max_tokens,
                "prompt plus max_tokens exceeds the engine's KV cache budget",
            ))
        }
    }

    /// Prepares the generation state and the sampler (with its constraint, compiled by
    /// the submitter, and its prompt's log-probabilities, scored already) of a request its
    /// submitter has validated and tokenized already (the engine thread never tokenizes
    /// or compiles, and checks none of those values again: the sampler reads the
    /// request's [`sampling`](crate::inference::GenerateRequest::sampling) as it is).
    fn prepare(
        &mut self,
        sub: &Submission,
        constraint: Option<ConstraintState>,
        prompt_logprobs: Option<PromptLogprobs>,
    ) -> Result<(GenerationState<B>, Sampler)> {
        let request = &sub.request;
        let ids = &sub.prompt;
        let mut state = GenerationState::new(ids.clone(), request.max_tokens).with_request(request);
        if let Some(config) = request.speculation.or(self.speculation) {
            state = self.llama.with_speculation(state, &config)?;
        }
        self.check_fits(sub)?;
        state.prompt_logprobs = prompt_logprobs;
        // The constraint's state lives in the sampler and, like the random generator,
        // survives preemption (a recompute keeps the generated tokens the state has
        // accepted).
        Ok((state, sampler_with(request, constraint)))
    }

    /// Asks every decoding request that speculates for its proposals, and hands them to
    /// the scheduler (which plans them as more tokens of the request's row).
    fn propose(&mut self) {
        let max_seq_len = self.llama.config().max_seq_len;
        let mut failed = Vec::new();
        let decoding = |scheduler: &Scheduler, id| {
            scheduler
                .running(id)
                .is_some_and(|seq| seq.computed + 1 == seq.tokens.len())
        };
        // The step's decoding rows bound what any row's proposals could be worth.
        let rows = self
            .requests
            .keys()
            .filter(|&&id| decoding(&self.scheduler, id))
            .count();
        for (&id, active) in &mut self.requests {
            if !decoding(&self.scheduler, id) || active.state.is_done() {
                continue;
            }
            let room = active.state.draft_room(max_seq_len);
            match active.state.propose_drafts(room, rows) {
                Ok(Some((drafts, candidate))) if !drafts.is_empty() => {
                    self.scheduler.propose(id, drafts, candidate);
                }
                Ok(_) => {}
                Err(e) => failed.push((id, e)),
            }
        }
        for (id, e) in failed {
            self.end(id, Err(e));
        }
    }

    /// Ends every cancelled request, freeing its blocks at once.
    fn drop_cancelled(&mut self) {
        let cancelled: Vec<RequestId> = self
            .requests
            .iter()
            .filter(|(_, a)| a.cancel.is_cancelled())
            .map(|(&id, _)| id)
            .collect();
        for id in cancelled {
            self.end(id, Err(LlamaError::Cancelled));
        }
    }

    fn note_admissions(&mut self, plan: &StepPlan) {
        let now = Instant::now();
        for &id in &plan.preempted {
            if let Some(active) = self.requests.get_mut(&id) {
                active.preemptions += 1;
            }
        }
        for row in &plan.rows {
            let Some(active) = self.requests.get_mut(&row.id) else {
                continue;
            };
            if plan.admitted.contains(&row.id) && active.admitted.is_none() {
                active.admitted = Some(now);
                active.prefix_hit_tokens = row.start;
                active.state.mark_started();
                self.shared.waiting.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }

    /// Runs one step with a panic inside it contained: the step's requests fail with
    /// [`LlamaError::StepFailed`] and free their blocks, and the engine goes on with the
    /// next step. The step's rows are the only state a step touches (their blocks in the
    /// pool, their generation states), and each of those requests ends here.
    fn execute_isolated(&mut self, plan: &StepPlan) {
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.execute(plan)));
        if let Err(payload) = run {
            let message = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".into());
            tracing_free_warn(&message);
            for row in &plan.rows {
                self.end(
                    row.id,
                    Err(LlamaError::StepFailed(format!(
                        "the engine step running this request failed ({message}); other \
                         requests go on"
                    ))),
                );
            }
        }
    }

    /// Runs one step: the forward pass over every scheduled row, then sampling.
    fn execute(&mut self, plan: &StepPlan) {
        if plan
            .rows
            .iter()
            .any(|r| self.requests.get(&r.id).is_some_and(|a| a.poisoned))
        {
            panic!("fault injected into an engine step (panic_marker)");
        }
        // Speculating rows run their pending token then their proposals.
        let mut drafts: HashMap<RequestId, Vec<u32>> = HashMap::new();
        let mut inputs: HashMap<RequestId, Vec<u32>> = HashMap::new();
        for row in plan.rows.iter().filter(|r| r.drafts > 0) {
            let Some(seq) = self.scheduler.running(row.id) else {
                continue;
            };
            let proposed = self.scheduler.drafts(row.id)[..row.drafts].to_vec();
            let mut input = seq.tokens[row.start..].to_vec();
            input.extend_from_slice(&proposed);
            inputs.insert(row.id, input);
            drafts.insert(row.id, proposed);
        }
        // Which rows of the logits each sampled row reads (its first, and with
        // proposals one per position).
        let mut slots: HashMap<RequestId, usize> = HashMap::new();
        let mut next = 0;
        for row in plan.rows.iter().filter(|r| r.sample) {
            slots.insert(row.id, next);
            next += 1 + drafts.get(&row.id).map_or(0, Vec::len);
        }
        // A step whose sampled rows all draw the plain greedy token reads back only token
        // ids where the backend computes the argmax on the device.
        let sampled = plan.rows.iter().filter(|r| r.sample).count();
        let device_greedy = drafts.is_empty()
            && plan.rows.iter().filter(|r| r.sample).all(|r| {
                self.requests
                    .get(&r.id)
                    .is_some_and(|a| a.state.draws_plain_greedy(&a.sampler))
            });
        // Otherwise each row the device may draw (the rule of `sampling::device`, the
        // row's own whatever the rest of the step) is drawn there, where the backend can
        // (on a backend that cannot, no draw is prepared and no row is selected).
        let device_rows: Vec<(RequestId, usize, DeviceDraw)> =
            if device_greedy || !B::samples_on_device() {
                Vec::new()
            } else {
                plan.rows
                    .iter()
                    .filter(|r| r.sample && !drafts.contains_key(&r.id))
                    .filter_map(|r| {
                        let a = self.requests.get(&r.id)?;
                        let draw = a.state.device_draw(&a.sampler)?;
                        Some((r.id, *slots.get(&r.id)?, draw))
                    })
                    .collect()
            };
        let output = {
            // The step's adapters, each once, and each row's index among them.
            let mut adapters: Vec<&LoraWeights<B>> = Vec::new();
            let mut rows = Vec::with_capacity(plan.rows.len());
            for row in &plan.rows {
                let Some(seq) = self.scheduler.running(row.id) else {
                    continue;
                };
                let tokens = match inputs.get(&row.id) {
                    Some(input) => input.as_slice(),
                    None => &seq.tokens[row.start..row.start + row.len],
                };
                let adapter = self
                    .requests
                    .get(&row.id)
                    .and_then(|a| a.adapter.as_deref())
                    .map(
                        |w| match adapters.iter().position(|&h| std::ptr::eq(h, w)) {
                            Some(i) => i,
                            None => {
                                adapters.push(w);
                                adapters.len() - 1
                            }
                        },
                    );
                rows.push(PagedRow {
                    tokens,
                    start: row.start,
                    blocks: &seq.blocks,
                    logits: row.sample,
                    all_logits: row.drafts > 0,
                    adapter,
                });
            }
            self.llama
                .model
                .forward_paged_adapted(&rows, &adapters, &mut self.cache)
                .and_then(|logits| {
                    if device_greedy
                        && let Some(ids) = B::greedy_tokens(&logits)?
                        && let Some(ids) = ids.into_iter().collect::<Option<Vec<u32>>>()
                        && ids.len() == sampled
                    {
                        return Ok(StepOutput::Tokens(ids));
                    }
                    // A row with a NaN or no finite logit: the host path reports it.
                    read_rows::<B>(logits, &device_rows)
                })
        };
        self.steps += 1;
        let (device, logits, host_rows) = match output {
            Ok(StepOutput::Rows {
                device,
                logits,
                rows,
            }) => (device, logits, rows),
            Ok(StepOutput::Tokens(ids)) => {
                self.scheduler.complete(plan);
                for (row, token) in plan.rows.iter().filter(|r| r.sample).zip(ids) {
                    if let Some(active) = self.requests.get_mut(&row.id) {
                        active.state.record_greedy();
                    }
                    match self.emit(row.id, token) {
                        Ok(Some(token)) => self.scheduler.append(row.id, token),
                        Ok(None) => self.end(row.id, Ok(())),
                        Err(e) => self.end(row.id, Err(e)),
                    }
                }
                return;
            }
            Err(e) => {
                // The step failed: the requests it concerns fail and free their blocks.
                let message = e.to_string();
                for row in &plan.rows {
                    self.end(row.id, Err(LlamaError::Runtime(message.clone())));
                }
                return;
            }
        };
        self.scheduler.complete(plan);
        let vocab = self.llama.config().vocab_size;
        // The host rows' places in the logits read back.
        let slots: HashMap<RequestId, usize> = slots
            .into_iter()
            .filter_map(|(id, slot)| Some((id, host_rows.binary_search(&slot).ok()?)))
            .collect();
        // Sample every host row of the step in parallel: each from its own logits,
        // history and random generator, so the tokens are those of a serial loop.
        let stop_ids = self.llama.tokenizer.stop_ids().to_vec();
        let stop_ids = stop_ids.as_slice();
        let mut jobs: Vec<(RequestId, &mut Active<B>, &[f32])> = self
            .requests
            .iter_mut()
            .filter(|(id, _)| !drafts.contains_key(id) && !device.contains_key(id))
            .filter_map(|(id, active)| {
                let i = *slots.get(id)?;
                Some((*id, active, logits.get(i * vocab..(i + 1) * vocab)?))
            })
            .collect();
        let tokens = crate::sampling::for_each_row(&mut jobs, |(_, active, logits)| {
            let Active { state, sampler, .. } = &mut **active;
            state.sample_next(logits, sampler, stop_ids)
        });
        let mut sampled: HashMap<RequestId, Result<u32>> =
            jobs.iter().map(|(id, _, _)| *id).zip(tokens).collect();
        drop(jobs);
        for row in plan.rows.iter().filter(|r| r.sample) {
            if let Some(proposed) = drafts.get(&row.id) {
                let first = slots.get(&row.id).copied().unwrap_or(0);
                let rows = logits
                    .get(first * vocab..(first + 1 + proposed.len()) * vocab)
                    .unwrap_or_default()
                    .chunks(vocab);
                self.verify_row(row.id, proposed, rows, stop_ids);
                continue;
            }
            let token = match device.get(&row.id) {
                Some(&(draw, token)) => match self.requests.get_mut(&row.id) {
                    Some(active) => {
                        let Active { state, sampler, .. } = active;
                        state.record_device_token(sampler, &draw, token);
                        Ok(token.token)
                    }
                    None => Err(LlamaError::Runtime(
                        "a scheduled request has no state".into(),
                    )),
                },
                None => sampled.remove(&row.id).unwrap_or_else(|| {
                    Err(LlamaError::Runtime(
                        "a scheduled request has no state".into(),
                    ))
                }),
            };
            match token.and_then(|token| self.emit(row.id, token)) {
                Ok(Some(token)) => self.scheduler.append(row.id, token),
                Ok(None) => self.end(row.id, Ok(())),
                Err(e) => self.end(row.id, Err(e)),
            }
        }
    }

    /// Verification of request `id`'s proposals against its logits `rows` (one per
    /// position): each token drawn with the request's sampler and sent as it would be
    /// without speculation, until a draw differs from its proposal; then the accepted
    /// positions stay in the request's blocks and the rest are rolled back.
    fn verify_row<'a>(
        &mut self,
        id: RequestId,
        proposed: &[u32],
        rows: impl Iterator<Item = &'a [f32]>,
        stop_ids: &[u32],
    ) {
        let mut ended: Option<Result<()>> = None;
        let verified = crate::speculative::verify(proposed, rows, |row| {
            let active = self
                .requests
                .get_mut(&id)
                .ok_or_else(|| LlamaError::Runtime("a scheduled request has no state".into()))?;
            let Active { state, sampler, .. } = active;
            let token = state.sample_next(row, sampler, stop_ids)?;
            match self.emit(id, token)? {
                Some(token) => {
                    self.scheduler.append(id, token);
                    Ok((token, false))
                }
                None => {
                    ended = Some(Ok(()));
                    Ok((token, true))
                }
            }
        });
        match verified {
            Ok(accepted) => {
                self.spec_stats.record(proposed.len(), accepted);
                if let Some(active) = self.requests.get_mut(&id) {
                    active.state.observe_drafts(proposed.len(), accepted);
                }
                match ended {
                    Some(result) => self.end(id, result),
                    None => self.scheduler.accept_drafts(id, accepted),
                }
            }
            Err(e) => self.end(id, Err(e)),
        }
    }

    /// Sends request `id`'s sampled `token`. Returns the token if the request goes on,
    /// `None` if it is done.
    fn emit(&mut self, id: RequestId, token: u32) -> Result<Option<u32>> {
        let active = self
            .requests
            .get_mut(&id)
            .ok_or_else(|| LlamaError::Runtime("a scheduled request has no state".into()))?;
        let index = active.state.tokens().len();
        let (token_id, piece, done) = self.llama.accept_token(&mut active.state, token);
        let now = Instant::now();
        active.first_token.get_or_insert(now);
        active.last_token = Some(now);
        let delivered = active.sink.token(TokenOutput {
            token: piece,
            token_id,
            index,
            logprobs: active.state.take_logprobs(),
            prompt_logprobs: active.state.take_prompt_logprobs(),
            cached_prompt_tokens: (index == 0).then_some(active.prefix_hit_tokens),
        });
        if !delivered {
            return Err(LlamaError::Cancelled);
        }
        Ok((!done).then_some(token_id))
    }

    /// Ends request `id`: frees its blocks, records and sends its result.
    fn end(&mut self, id: RequestId, result: Result<()>) {
        self.scheduler.finish(id);
        let Some(mut active) = self.requests.remove(&id) else {
            return;
        };
        if active.admitted.is_none() {
            self.shared.waiting.fetch_sub(1, Ordering::AcqRel);
        }
        let outcome = match &result {
            Ok(()) => Outcome::Completed,
            Err(LlamaError::Cancelled) => Outcome::Cancelled,
            Err(_) => Outcome::Failed,
        };
        if outcome == Outcome::Cancelled {
            active.state.finish(StopReason::Cancelled);
        }
        let metrics = active.metrics(id, outcome);
        self.record(outcome, Some(metrics.clone()));
        // Metrics first: whoever hears that the request ended sees its blocks freed.
        self.publish();
        active.sink.done(result.map(|()| metrics));
    }

    /// Ends every request with the error `why` makes.
    fn end_all(&mut self, why: impl Fn() -> LlamaError) {
        for id in self.scheduler.ids() {
            self.end(id, Err(why()));
        }
        let left: Vec<RequestId> = self.requests.keys().copied().collect();
        for id in left {
            self.end(id, Err(why()));
        }
        self.scorer = None;
        self.embedder = None;
        let mut waiting: Vec<Work> = self
            .scoring
            .drain(..)
            .map(|sub| Work::Generate(Box::new(sub)))
            .collect();
        waiting.extend(self.embeddings.drain(..).map(Work::Embed));
        for work in waiting.into_iter().chain(self.queue.try_iter()) {
            match work {
                Work::Generate(sub) => {
                    self.shared.waiting.fetch_sub(1, Ordering::AcqRel);
                    self.record(Outcome::Cancelled, None);
                    sub.sink.done(Err(why()));
                }
                Work::Embed(embedding) => self.end_embedding(embedding, Err(why())),
            }
        }
    }

    fn record(&self, outcome: Outcome, metrics: Option<RequestMetrics>) {
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

    /// Queues the blocks registered by the step for the disk (their contents are
    /// complete, and no block is handed out again before the next step's plan).
    fn persist(&mut self) {
        if let Some(disk) = &mut self.disk {
            let registered = self.scheduler.blocks_mut().take_registered();
            if !registered.is_empty() {
                disk.offer(registered, &self.cache);
            }
        }
    }

    fn publish(&self) {
        let blocks = self.scheduler.blocks();
        let used = blocks.in_use() * self.cache.block_bytes();
        if let Ok(mut m) = self.shared.metrics.lock() {
            m.running = self.scheduler.decoding();
            m.prefilling = self.scheduler.prefilling();
            m.waiting = self.scheduler.waiting();
            m.peak_running = m.peak_running.max(m.running + m.prefilling);
            m.kv_blocks_used = blocks.in_use();
            m.kv_blocks_cached = blocks.cached_unused();
            m.kv_blocks_total = blocks.total_blocks();
            m.block_size = blocks.block_size();
            m.kv_pool_bytes = self.cache.allocated_bytes();
            m.kv_bytes_used = used;
            m.peak_kv_bytes_used = m.peak_kv_bytes_used.max(used);
            m.steps = self.steps;
            m.preemptions = self.scheduler.preemptions();
            m.prefix_hit_tokens = blocks.hit_tokens();
            m.prefix_disk_hit_tokens = blocks.disk_hit_tokens();
            if let Some(disk) = &self.disk {
                let read = |n: &std::sync::atomic::AtomicU64| n.load(Ordering::Relaxed);
                m.prefix_disk_loaded_blocks = read(&disk.stats.loaded);
                m.prefix_disk_refused_files = read(&disk.stats.refused);
                m.prefix_disk_written_blocks = read(&disk.stats.written);
                m.prefix_disk_dropped_blocks = read(&disk.stats.dropped);
            }
            m.spec_decode_num_draft_tokens = self.spec_stats.draft_tokens;
            m.spec_decode_num_accepted_tokens = self.spec_stats.accepted_draft_tokens;
        }
    }
}

/// Reports a contained step panic on stderr (the library has no logger of its own; the
/// panic hook has printed the panic itself already).
fn tracing_free_warn(message: &str) {
    eprintln!(
        "llama-burn: an engine step panicked ({message}); its requests failed, the engine goes on"
    );
}
