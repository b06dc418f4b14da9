//! Continuous batching: requests join and leave a running batch at every step, over a
//! paged KV cache whose memory is exactly its budget.
//!
//! A [`ContinuousEngine`] owns the model on its own thread. The engine is split as vLLM
//! splits it:
//!
//! - the submitting side (vLLM's processor) validates and tokenizes each request on the
//!   caller's thread ([`ContinuousEngine::encode`], or any `submit`), so the engine
//!   thread deals in token ids only and a long prompt never stalls the running batch;
//! - the [`scheduler`] decides each step which requests run and how many tokens each
//!   (one for a decoding request, a chunk for a prompt), admits waiting requests first
//!   come first served when their prompt's blocks are free, and preempts the most
//!   recently admitted request when the pool is full (it is recomputed later, with the
//!   same tokens);
//! - the [`BlockManager`](crate::cache::BlockManager) hands out the pool's blocks and
//!   keeps full blocks in a prefix cache, so requests that share a prefix (a system
//!   prompt, a document) compute it once;
//! - the executor (the engine thread) runs **one** forward pass per step over every
//!   scheduled row through the [`PagedKvCache`](crate::cache::PagedKvCache), samples,
//!   and streams each token the moment it exists.
//!
//! Each row computes what it would alone (its own positions, its own blocks, padded keys
//! masked), so greedy results equal every other strategy's. Memory is the pool, allocated
//! once from [`ContinuousConfig::kv_budget`]: no request can make the engine allocate
//! more. Switching from the concurrent handler to continuous batching is one line:
//!
//! ```no_run
//! # fn main() -> llama_burn::Result<()> {
//! use llama_burn::backend::{DefaultBackend, default_device};
//! use llama_burn::inference::{ContinuousConfig, GenerateRequest, InferenceBuilder};
//! use llama_burn::llama::LlamaConfig;
//!
//! let llama = llama_burn::Loader::gguf(llama_burn::demo::demo_model_path()?)
//!     .max_seq_len(2048)
//!     .load::<DefaultBackend>(&default_device())?;
//! // was: InferenceBuilder::new().with_model(llama).build(concurrent_streaming_handler)
//! let inference = InferenceBuilder::new().with_model(llama).build_continuous(ContinuousConfig::default())?;
//! let job = inference.infer(GenerateRequest::new("Hello")).spawn();
//! for token in job.stream.iter() {
//!     print!("{}", token.token);
//! }
//! job.join()?;
//! let metrics = inference.with_model_blocking(|engine| engine.metrics())?;
//! println!("{} requests completed, {} KV bytes in use", metrics.completed, metrics.kv_bytes_used);
//! # Ok(())
//! # }
//! ```

mod executor;
pub mod scheduler;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::backend::LlamaBackend;
use crossbeam_channel::{Receiver, Sender};

use super::request::{GenerateRequest, TokenOutput, check_request_size};
use super::runtime::{
    CancelToken, DirectSubmit, In, Inference, InferenceBuilder, JobSink, ModelAccessor,
    ModelDevice, OutStream,
};
pub use crate::cache::KvBudget;
use crate::constraints::ConstraintState;
use crate::constraints::compile;
use crate::constraints::model::{VocabCell, vocab_in};
use crate::error::{LlamaError, Result};
use crate::llama::{Llama, PromptEncoder, StopReason};
use crate::lora::{AdapterRegistry, LoraWeights};
use crate::tokenizer::{DynTokenizer, Tokenizer};

/// Sizing of a [`ContinuousEngine`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContinuousConfig {
    /// Most requests admitted at once (decoding or having their prompt processed).
    pub max_running: usize,
    /// Most requests waiting for admission; one more is refused with
    /// [`LlamaError::Overloaded`].
    pub max_waiting: usize,
    /// The KV pool, allocated once when the engine starts: everything the engine's KV
    /// cache will ever hold. A request needs blocks for its prompt to be admitted and
    /// takes more as it grows; when none are left the newest request is preempted.
    pub kv_budget: KvBudget,
    /// How the pool stores keys and values (default: the activations' float type).
    /// The encoded types take fewer bytes per token, so a
    /// [`KvBudget::Bytes`] budget holds more tokens (`q8_0` about 1.9 times f16's, `q4_0`
    /// about 3.6 times); they run on the CPU and CubeCL backends (see
    /// [`KvCacheType`](crate::cache::KvCacheType)).
    pub kv_cache_types: crate::cache::KvCacheTypes,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Tokens processed per step: one per decoding request, the rest for prompt chunks
    /// (at least `min_prefill_chunk` whenever a prompt is waiting to be processed).
    pub step_tokens: usize,
    /// Smallest prompt chunk per step, so prompts progress even when the batch is full.
    pub min_prefill_chunk: usize,
    /// Reuse the KV blocks of prefixes computed before (shared system prompts,
    /// documents). On by default; results are identical either way.
    pub prefix_caching: bool,
    /// Keep the prefix cache on disk as well (`None`, the default: in memory only): full
    /// blocks are written to the directory as they are made, by a thread of their own,
    /// and read back into the pool when an engine starts, so a restart keeps its cached
    /// prefixes. Blocks of another model, version, backend, precision or cache type,
    /// and damaged files, are refused with a line on stderr and never used. Needs
    /// `prefix_caching`. See [`crate::cache::disk`].
    pub prefix_cache_disk: Option<crate::cache::PrefixCacheDisk>,
    /// Speculative decoding for requests that do not set their own
    /// ([`GenerateRequest::with_speculation`]); `None` (the default): only those that
    /// ask speculate. Tokens are the same either way.
    pub speculation: Option<crate::speculative::SpeculationConfig>,
    /// Most LoRA adapters held on the device at once (default 8): registering or
    /// reading back one more evicts the least recently used one that no running request
    /// holds and that has a file to be read again from. See
    /// [`ContinuousEngine::adapters`].
    pub max_lora_adapters: usize,
    /// Fault injection, for tests of fault isolation only: a step that runs a request
    /// whose prompt contains this marker panics inside the step. `None` (the default) in
    /// any real deployment.
    #[doc(hidden)]
    pub panic_marker: Option<String>,
    /// Fault injection, for tests only: the engine thread ends (a panic outside any step)
    /// when it takes a request whose prompt contains this marker, as it would on a bug
    /// that no step contains. `None` (the default) in any real deployment.
    #[doc(hidden)]
    pub exit_marker: Option<String>,
}

impl Default for ContinuousConfig {
    fn default() -> Self {
        Self {
            max_running: 32,
            max_waiting: 256,
            kv_budget: KvBudget::Tokens(32 * 1024),
            kv_cache_types: crate::cache::KvCacheTypes::default(),
            block_size: 16,
            step_tokens: 256,
            min_prefill_chunk: 32,
            prefix_caching: true,
            prefix_cache_disk: None,
            speculation: None,
            max_lora_adapters: 8,
            panic_marker: None,
            exit_marker: None,
        }
    }
}

impl ContinuousConfig {
    /// Sets the KV pool to `tokens` tokens.
    #[must_use]
    pub fn with_kv_budget_tokens(mut self, tokens: usize) -> Self {
        self.kv_budget = KvBudget::Tokens(tokens);
        self
    }

    /// Sets the KV pool to at most `bytes` bytes.
    #[must_use]
    pub fn with_kv_budget_bytes(mut self, bytes: usize) -> Self {
        self.kv_budget = KvBudget::Bytes(bytes);
        self
    }

    /// Stores keys in `keys` and values in `values` (see
    /// [`kv_cache_types`](Self::kv_cache_types)).
    #[must_use]
    pub fn with_kv_cache_types(
        mut self,
        keys: crate::cache::KvCacheType,
        values: crate::cache::KvCacheType,
    ) -> Self {
        self.kv_cache_types = crate::cache::KvCacheTypes::new(keys, values);
        self
    }

    /// Holds at most `n` LoRA adapters on the device at once (see
    /// [`max_lora_adapters`](Self::max_lora_adapters)).
    #[must_use]
    pub fn with_max_lora_adapters(mut self, n: usize) -> Self {
        self.max_lora_adapters = n;
        self
    }

    /// Turns prefix caching on or off.
    #[must_use]
    pub fn with_prefix_caching(mut self, on: bool) -> Self {
        self.prefix_caching = on;
        self
    }

    /// Keeps the prefix cache on disk as well (see
    /// [`prefix_cache_disk`](Self::prefix_cache_disk)).
    #[must_use]
    pub fn with_prefix_cache_disk(mut self, disk: crate::cache::PrefixCacheDisk) -> Self {
        self.prefix_cache_disk = Some(disk);
        self
    }

    fn validate(&self) -> Result<()> {
        let positive = [
            ("max_running", self.max_running),
            ("block_size", self.block_size),
            ("step_tokens", self.step_tokens),
            ("min_prefill_chunk", self.min_prefill_chunk),
        ];
        for (name, value) in positive {
            if value == 0 {
                return Err(LlamaError::invalid(name, 0, "must be at least 1"));
            }
        }
        if let Some(speculation) = &self.speculation {
            speculation.validate()?;
        }
        if self.prefix_cache_disk.is_some() && !self.prefix_caching {
            return Err(LlamaError::invalid(
                "prefix_cache_disk",
                "set",
                "the prefix cache on disk needs prefix caching on",
            ));
        }
        Ok(())
    }

    /// Blocks in the pool for a model whose one block takes `block_bytes` bytes.
    fn num_blocks(&self, block_bytes: usize) -> usize {
        match self.kv_budget {
            KvBudget::Tokens(tokens) => tokens / self.block_size,
            KvBudget::Bytes(bytes) => bytes / block_bytes.max(1),
        }
    }
}

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// It generated all its tokens, reached a stop token or filled the context.
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
    /// Why generation stopped, for a completed request.
    pub stop_reason: Option<StopReason>,
    /// Prompt length in tokens (0 if it never tokenized).
    pub prompt_tokens: usize,
    /// Prompt tokens read from the prefix cache instead of computed.
    pub prefix_hit_tokens: usize,
    /// Tokens generated.
    pub output_tokens: usize,
    /// Times it was preempted (and recomputed).
    pub preemptions: u32,
    /// From submission to first admission (start of prompt processing).
    pub queue_time: Duration,
    /// From submission to the first generated token.
    pub time_to_first_token: Option<Duration>,
    /// Mean time between generated tokens after the first.
    pub time_per_output_token: Option<Duration>,
}

/// A snapshot of the engine's state, readable at any time.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineMetrics {
    /// Requests decoding.
    pub running: usize,
    /// Requests whose prompt is being processed.
    pub prefilling: usize,
    /// Requests waiting for admission (preempted ones included).
    pub waiting: usize,
    /// The most requests admitted at once (decoding or prefilling, as counted after each
    /// step): with a byte budget and no preemptions, how many requests the pool held
    /// together.
    pub peak_running: usize,
    /// KV blocks held by admitted requests.
    pub kv_blocks_used: usize,
    /// KV blocks nobody holds that keep a cached prefix (reused or evicted on demand).
    pub kv_blocks_cached: usize,
    /// KV blocks in the pool.
    pub kv_blocks_total: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Bytes of the KV pool: everything the engine's KV cache holds, allocated once.
    pub kv_pool_bytes: usize,
    /// Bytes of the blocks held by admitted requests (`kv_blocks_used` blocks).
    pub kv_bytes_used: usize,
    /// The largest `kv_bytes_used` seen.
    pub peak_kv_bytes_used: usize,
    /// Forward passes run.
    pub steps: u64,
    /// Requests that completed.
    pub completed: u64,
    /// Requests that were cancelled.
    pub cancelled: u64,
    /// Requests that failed.
    pub failed: u64,
    /// Requests refused because the queue was full.
    pub rejected: u64,
    /// Preemptions (a request gave its blocks back to be recomputed later).
    pub preemptions: u64,
    /// Prompt tokens served from the prefix cache.
    pub prefix_hit_tokens: u64,
    /// Of those, tokens served from blocks read from disk at start
    /// ([`ContinuousConfig::prefix_cache_disk`]).
    pub prefix_disk_hit_tokens: u64,
    /// Blocks read from disk into the pool at start.
    pub prefix_disk_loaded_blocks: u64,
    /// Block files refused at start (another model or configuration, or damaged).
    pub prefix_disk_refused_files: u64,
    /// Blocks written to disk.
    pub prefix_disk_written_blocks: u64,
    /// Blocks not written to disk: the writer's queue was full, or a write failed.
    pub prefix_disk_dropped_blocks: u64,
    /// Proposed tokens verified by speculative decoding (vLLM's
    /// `spec_decode_num_draft_tokens`).
    pub spec_decode_num_draft_tokens: u64,
    /// Proposed tokens accepted (vLLM's `spec_decode_num_accepted_tokens`).
    pub spec_decode_num_accepted_tokens: u64,
    /// The most recent finished requests (up to 1024), oldest first.
    pub recent: Vec<RequestMetrics>,
}

/// What a request's channel carries.
#[derive(Debug)]
pub enum EngineEvent {
    /// The request passed validation and its prompt is `prompt_tokens` tokens long; it
    /// waits for admission. Sent first, and only to jobs submitted with
    /// [`ContinuousEngine::submit_announced`].
    Accepted {
        /// Prompt length in tokens.
        prompt_tokens: usize,
    },
    /// A generated token.
    Token(TokenOutput),
    /// The request ended; no more events follow.
    Done(Result<RequestMetrics>),
}

/// A request submitted with [`ContinuousEngine::submit`]: its events, and a way to
/// cancel it. Dropping it cancels the request.
#[derive(Debug)]
pub struct EngineJob {
    id: u64,
    events: Receiver<EngineEvent>,
    cancel: CancelToken,
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

    /// Asks the engine to drop the request at its next step (freeing its blocks).
    pub fn cancel(&self) {
        self.cancel.cancel();
    }

    /// Waits for the request to end, collecting its tokens.
    pub fn collect(self) -> Result<(Vec<TokenOutput>, RequestMetrics)> {
        let mut tokens = Vec::new();
        for event in self.events.iter() {
            match event {
                EngineEvent::Token(t) => tokens.push(t),
                EngineEvent::Accepted { .. } => {}
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

/// Where a request's results go.
enum Sink {
    /// A handler called on the engine thread with every event, an
    /// [`EngineEvent::Accepted`] first: a caller's ([`ContinuousEngine::submit_to`]), or
    /// the one that feeds an [`EngineJob`]'s channel.
    Handler(EventHandler),
    /// A job of the job runtime ([`InferenceBuilder::build_continuous`]).
    Job(JobSink<TokenOutput>),
}

/// Receives one request's events on the engine thread, in order: `Accepted`, tokens,
/// then `Done` (a request refused before it was queued, invalid or cancelled already,
/// gets its `Done` on the submitting thread instead). It returns `false` when nobody
/// listens any more, and the request is then dropped at once. It must not block: every
/// request shares the thread.
pub type EventHandler = Box<dyn Fn(EngineEvent) -> bool + Send>;

impl Sink {
    /// Sends a token; false when nobody listens any more.
    fn token(&self, token: TokenOutput) -> bool {
        match self {
            Sink::Handler(f) => f(EngineEvent::Token(token)),
            Sink::Job(sink) => sink.emit(token),
        }
    }

    /// Tells the sink that its request was accepted; false when nobody listens any more.
    fn accepted(&self, prompt_tokens: usize) -> bool {
        match self {
            Sink::Handler(f) => f(EngineEvent::Accepted { prompt_tokens }),
            Sink::Job(_) => true,
        }
    }

    fn done(self, result: Result<RequestMetrics>) {
        match self {
            Sink::Handler(f) => {
                f(EngineEvent::Done(result));
            }
            Sink::Job(sink) => sink.finish(result.map(drop)),
        }
    }
}

/// Who a submission is for ([`ContinuousEngine::submit_scoped`]): its prefix-cache
/// partition and its tenant. The default (0, 0) is every unscoped submission's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Scope {
    /// The prefix-cache partition: the request reuses cached prefix blocks only of
    /// requests with the same salt, so tenants that must not learn each other's prompts
    /// from cache hits get different salts.
    pub salt: u128,
    /// The tenant: admission takes tenants in turn (round robin), so one tenant's burst
    /// cannot hold the others back.
    pub tenant: u64,
}

/// A request on its way to the engine thread: validated and tokenized already (by its
/// submitter), so the engine thread deals in token ids only.
struct Submission {
    id: u64,
    /// The request's settings; its prompt text and messages are left behind (the
    /// engine reads `prompt`).
    request: GenerateRequest,
    /// The prompt's token ids.
    prompt: Vec<u32>,
    /// The request's constraint, compiled by the submitter (the engine thread never
    /// compiles one).
    constraint: Option<ConstraintState>,
    /// Test-only faults this request injects.
    fault: Fault,
    sink: Sink,
    cancel: CancelToken,
    submitted: Instant,
    /// The request's prefix-cache partition and tenant.
    scope: Scope,
    /// The request's LoRA adapter on the device (a [`LoraWeights`] of the engine's
    /// backend, resolved by the submitter), or `None`.
    adapter: Option<AnyAdapter>,
}

/// What the engine's queue carries.
enum Work {
    /// A generation request (boxed: the queue's slots stay the size of a pointer).
    Generate(Box<Submission>),
    /// Inputs to embed.
    Embed(EmbedSubmission),
}

/// Inputs to embed ([`ContinuousEngine::embed_to`]), checked by the submitter.
struct EmbedSubmission {
    /// Each input's token ids.
    inputs: Vec<Vec<u32>>,
    options: crate::embed::EmbeddingOptions,
    cancel: CancelToken,
    /// Called once, on the engine thread, with the vectors or the reason there are none.
    reply: EmbedReply,
}

/// Receives an embedding's vectors (one per input, in order) or its error, on the
/// engine thread; it must not block.
pub type EmbedReply = Box<dyn FnOnce(Result<Vec<Vec<f32>>>) + Send>;

/// An adapter's device weights with the backend type erased, as submissions carry them
/// (the submitting side is not generic over the backend); the engine thread takes them
/// back as its backend's [`LoraWeights`].
pub(super) type AnyAdapter = Arc<dyn std::any::Any + Send + Sync>;

/// Finds a request's adapter by name for the submitting side: its device weights and
/// fingerprint.
trait AdapterLookup: Send + Sync {
    fn lookup(&self, name: &str) -> Result<(AnyAdapter, u128)>;
}

impl<B: LlamaBackend> AdapterLookup for AdapterRegistry<B>
where
    LoraWeights<B>: Send + Sync,
{
    fn lookup(&self, name: &str) -> Result<(AnyAdapter, u128)> {
        let weights = self.get(name)?;
        let fingerprint = weights.fingerprint();
        Ok((weights, fingerprint))
    }
}

/// The prefix-cache partition of a request of partition `salt` run with the adapter of
/// `fingerprint`: cached blocks are shared only by requests of the same adapter.
fn adapter_salt(salt: u128, fingerprint: u128) -> u128 {
    let mut bytes = [0u8; 32];
    bytes[..16].copy_from_slice(&salt.to_le_bytes());
    bytes[16..].copy_from_slice(&fingerprint.to_le_bytes());
    xxhash_rust::xxh3::xxh3_128(&bytes)
}

/// State shared between the engine handle, its clients and its thread.
struct Shared {
    /// Submitted requests not yet admitted for the first time.
    waiting: AtomicUsize,
    next_id: AtomicU64,
    metrics: Mutex<EngineMetrics>,
    /// Set when the engine handle is dropped: cancel everything and stop.
    stop: AtomicBool,
    /// Set by [`ContinuousEngine::shutdown`]: finish what is queued, then stop.
    drain: AtomicBool,
    /// Set when the engine thread has ended (normally or not).
    gone: AtomicBool,
}

/// Faults a request injects (tests of fault isolation only; see
/// [`ContinuousConfig::panic_marker`] and [`ContinuousConfig::exit_marker`]).
#[derive(Debug, Clone, Copy, Default)]
struct Fault {
    /// A step that runs the request panics.
    step_panic: bool,
    /// The engine thread ends when it takes the request.
    exit: bool,
}

impl Shared {
    /// One request fewer waits (saturating: once the engine thread has ended it has set
    /// the count to 0, and a submission that fails after that must not wrap it).
    fn unwait(&self) {
        let _ = self
            .waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                Some(w.saturating_sub(1))
            });
    }
}

/// What the submitting side needs to validate and tokenize a request off the engine
/// thread (vLLM's processor in front of its engine core).
struct Frontend<T> {
    /// The engine's tokenizer, shared with the engine thread (which decodes with it);
    /// gone once that thread has ended.
    tokenizer: Weak<T>,
    /// The model's constraint vocabulary (built by whichever side needs it first).
    constraints: VocabCell,
    max_seq_len: usize,
    vocab_size: usize,
    /// The model's width: the most components an embedding has.
    d_model: usize,
    panic_marker: Option<String>,
    exit_marker: Option<String>,
    /// The engine's adapters.
    adapters: Arc<dyn AdapterLookup>,
}

impl<T: Tokenizer> Frontend<T> {
    /// Runs `f`, a panic inside it (a tokenizer bug on a hostile prompt) failing this
    /// request only.
    fn guarded<R>(f: impl FnOnce() -> Result<R>) -> Result<R> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|_| {
            Err(LlamaError::StepFailed(
                "preparing the request panicked; other requests go on".into(),
            ))
        })
    }

    fn tokenizer(&self) -> Result<Arc<T>> {
        self.tokenizer
            .upgrade()
            .ok_or_else(|| LlamaError::ModelUnavailable("the engine has stopped".into()))
    }

    /// Tokenizes the prompt of a request that has no `prompt_ids`.
    fn tokenize(&self, request: &GenerateRequest) -> Result<Vec<u32>> {
        let tokenizer = self.tokenizer()?;
        PromptEncoder {
            tokenizer: &*tokenizer,
            max_seq_len: self.max_seq_len,
        }
        .encode_request(request)
    }

    /// Compiles the request's constraint, if any, against the model's vocabulary. Once a
    /// constraint compiled, the model's cache of compiled constraints holds it, so the
    /// choices of one request and repeated schemas compile once; what is returned is a
    /// fresh state of their own.
    fn compile(&self, request: &GenerateRequest) -> Result<Option<ConstraintState>> {
        let Some(constraint) = request.constraint.as_deref() else {
            return Ok(None);
        };
        let tokenizer = self.tokenizer()?;
        let vocab = vocab_in(&self.constraints, &*tokenizer, self.vocab_size)?;
        compile::compile(&vocab, constraint).map(Some)
    }

    /// The checks that need no tokens: every field, and the ids it names.
    fn check_request(&self, request: &GenerateRequest) -> Result<()> {
        request.validate(self.max_seq_len)?;
        request.validate_token_ids(self.vocab_size)
    }

    /// The checks of the prompt's tokens (`max_tokens` is checked already, by
    /// [`check_request`](Self::check_request)): not empty, room for one generated token,
    /// ids in the vocabulary.
    fn check_prompt(&self, ids: &[u32]) -> Result<()> {
        check_request_size(Some(ids.len()), None, self.max_seq_len)?;
        self.check_vocabulary(ids)
    }

    /// Every id of `ids` in the model's vocabulary.
    fn check_vocabulary(&self, ids: &[u32]) -> Result<()> {
        match ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            Some(&bad) => Err(LlamaError::invalid(
                "token id",
                bad,
                "outside the model's vocabulary",
            )),
            None => Ok(()),
        }
    }

    /// See [`ContinuousEngine::encode_text`].
    fn encode_text(&self, text: &str) -> Result<Vec<u32>> {
        Self::guarded(|| {
            let tokenizer = self.tokenizer()?;
            let ids = PromptEncoder {
                tokenizer: &*tokenizer,
                max_seq_len: self.max_seq_len,
            }
            .encode_prompt(text)?;
            self.check_embedding_input(&ids)?;
            Ok(ids)
        })
    }

    /// An input to embed: not empty, within the context window, ids in the vocabulary.
    fn check_embedding_input(&self, ids: &[u32]) -> Result<()> {
        if ids.is_empty() {
            return Err(LlamaError::EmptyPrompt);
        }
        if ids.len() > self.max_seq_len {
            return Err(LlamaError::PromptTooLong {
                tokens: ids.len(),
                max: self.max_seq_len,
            });
        }
        self.check_vocabulary(ids)
    }

    /// Inputs to embed and their options, checked before they are queued.
    fn check_embedding(
        &self,
        inputs: &[Vec<u32>],
        options: &crate::embed::EmbeddingOptions,
    ) -> Result<()> {
        options.width(self.d_model)?;
        if inputs.is_empty() {
            return Err(LlamaError::EmptyPrompt);
        }
        inputs
            .iter()
            .try_for_each(|ids| self.check_embedding_input(ids))
    }

    /// See [`ContinuousEngine::encode`].
    fn encode(&self, request: &GenerateRequest) -> Result<Vec<u32>> {
        Self::guarded(|| {
            self.check_request(request)?;
            let ids = match &request.prompt_ids {
                Some(ids) => ids.clone(),
                None => self.tokenize(request)?,
            };
            self.check_prompt(&ids)?;
            // Compiled here, on the caller's thread, for the cache: the submissions of
            // these ids then find it compiled.
            self.compile(request)?;
            Ok(ids)
        })
    }

    /// Validates `request` and takes its prompt out as token ids (tokenizing it unless
    /// it has ids), leaving no prompt text behind in it.
    fn prepare(&self, request: &mut GenerateRequest) -> Result<Prepared> {
        Self::guarded(|| {
            self.check_request(request)?;
            let ids = match request.prompt_ids.take() {
                Some(ids) => ids,
                None => self.tokenize(request)?,
            };
            self.check_prompt(&ids)?;
            let constraint = self.compile(request)?;
            request.prompt = String::new();
            request.messages = None;
            request.tools = Vec::new();
            let fault = self.fault(&ids);
            Ok((ids, constraint, fault))
        })
    }

    /// The faults a prompt injects: none unless a test set a marker (then the prompt is
    /// decoded to look for it, whatever form it came in).
    fn fault(&self, ids: &[u32]) -> Fault {
        if self.panic_marker.is_none() && self.exit_marker.is_none() {
            return Fault::default();
        }
        let text = self
            .tokenizer()
            .and_then(|t| t.decode(ids))
            .unwrap_or_default();
        let found = |marker: &Option<String>| marker.as_deref().is_some_and(|m| text.contains(m));
        Fault {
            step_panic: found(&self.panic_marker),
            exit: found(&self.exit_marker),
        }
    }
}

/// A request made ready by its submitter: its prompt's ids, its compiled constraint and
/// its test-only faults.
type Prepared = (Vec<u32>, Option<ConstraintState>, Fault);

/// The submitting side of an engine; cheap to clone.
struct EngineClient<T> {
    queue: Sender<Work>,
    shared: Arc<Shared>,
    max_waiting: usize,
    frontend: Arc<Frontend<T>>,
}

impl<T> Clone for EngineClient<T> {
    fn clone(&self) -> Self {
        Self {
            queue: self.queue.clone(),
            shared: self.shared.clone(),
            max_waiting: self.max_waiting,
            frontend: self.frontend.clone(),
        }
    }
}

impl<T: Tokenizer> EngineClient<T> {
    /// Queues a request, or gives its sink back with the reason it was refused (the
    /// engine has stopped, or its queue is full). The request is validated and tokenized
    /// here, on the calling thread, after the queue's limit is checked and unless it is
    /// cancelled already; a request that fails there ends at once through its sink.
    fn send(
        &self,
        mut request: GenerateRequest,
        sink: Sink,
        cancel: CancelToken,
        scope: Scope,
    ) -> std::result::Result<u64, Box<(Sink, LlamaError)>> {
        if let Err(refused) = self.enter_waiting() {
            return Err(Box::new((sink, refused)));
        }
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let prepared = if cancel.is_cancelled() {
            Err(LlamaError::Cancelled)
        } else {
            self.frontend.prepare(&mut request)
        };
        // The adapter is found (read again from its file if it was evicted) once the
        // request has passed every other check.
        let prepared = prepared.and_then(|p| match request.adapter.as_deref() {
            None => Ok((p, None)),
            Some(name) => self.frontend.adapters.lookup(name).map(|a| (p, Some(a))),
        });
        let ((prompt, constraint, fault), adapter) = match prepared {
            Ok(prepared) => prepared,
            Err(error) => {
                self.shared.unwait();
                if let Ok(mut m) = self.shared.metrics.lock() {
                    match error {
                        LlamaError::Cancelled => m.cancelled += 1,
                        _ => m.failed += 1,
                    }
                }
                sink.done(Err(error));
                return Ok(id);
            }
        };
        let (adapter, scope) = match adapter {
            Some((weights, fingerprint)) => (
                Some(weights),
                Scope {
                    salt: adapter_salt(scope.salt, fingerprint),
                    ..scope
                },
            ),
            None => (None, scope),
        };
        let submission = Submission {
            id,
            request,
            prompt,
            constraint,
            fault,
            sink,
            cancel,
            submitted: Instant::now(),
            scope,
            adapter,
        };
        if let Err(returned) = self.queue.send(Work::Generate(Box::new(submission))) {
            self.shared.unwait();
            let stopped = LlamaError::ModelUnavailable("the engine has stopped".into());
            let Work::Generate(submission) = returned.into_inner() else {
                unreachable!("the queue returns what was sent")
            };
            return Err(Box::new((submission.sink, stopped)));
        }
        Ok(id)
    }

    /// Takes a place among the waiting requests, or says why there is none.
    fn enter_waiting(&self) -> Result<()> {
        if self.shared.gone.load(Ordering::Acquire) {
            return Err(LlamaError::ModelUnavailable(
                "the engine has stopped".into(),
            ));
        }
        let limit = self.max_waiting;
        self.shared
            .waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                (w < limit).then_some(w + 1)
            })
            .map(|_| ())
            .map_err(|waiting| {
                if let Ok(mut m) = self.shared.metrics.lock() {
                    m.rejected += 1;
                }
                LlamaError::Overloaded {
                    resource: "waiting requests",
                    in_use: waiting,
                    requested: 1,
                    limit,
                }
            })
    }

    /// Checks and queues inputs to embed (see [`ContinuousEngine::embed_to`]).
    fn send_embedding(
        &self,
        inputs: Vec<Vec<u32>>,
        options: crate::embed::EmbeddingOptions,
        cancel: CancelToken,
        reply: EmbedReply,
    ) -> Result<()> {
        self.frontend.check_embedding(&inputs, &options)?;
        self.enter_waiting()?;
        let work = Work::Embed(EmbedSubmission {
            inputs,
            options,
            cancel,
            reply,
        });
        if self.queue.send(work).is_err() {
            self.shared.unwait();
            return Err(LlamaError::ModelUnavailable(
                "the engine has stopped".into(),
            ));
        }
        Ok(())
    }

    /// Submits on behalf of a runtime job; a refusal ends the job at once.
    fn submit_job(&self, request: GenerateRequest, sink: JobSink<TokenOutput>) {
        let cancel = sink.cancel_token().clone();
        if let Err(refused) = self.send(request, Sink::Job(sink), cancel, Scope::default()) {
            let (sink, error) = *refused;
            sink.done(Err(error));
        }
    }

    /// Submits with an event channel, fed by a handler on the engine thread; without
    /// `announce` the [`EngineEvent::Accepted`] event is left out.
    fn submit_events(
        &self,
        request: GenerateRequest,
        cancel: CancelToken,
        announce: bool,
    ) -> Result<EngineJob> {
        let (tx, rx) = crossbeam_channel::unbounded();
        let on_event = move |event: EngineEvent| match event {
            EngineEvent::Accepted { .. } if !announce => true,
            event => tx.send(event).is_ok(),
        };
        let id = self
            .send(
                request,
                Sink::Handler(Box::new(on_event)),
                cancel.clone(),
                Scope::default(),
            )
            .map_err(|refused| refused.1)?;
        Ok(EngineJob {
            id,
            events: rx,
            cancel,
        })
    }
}

/// The continuous-batching engine: a model on its own thread serving every submitted
/// request in a running batch over a paged KV cache. Dropping it cancels what is left
/// and stops the thread; [`ContinuousEngine::shutdown`] finishes the queue first.
pub struct ContinuousEngine<B: LlamaBackend, T: Tokenizer = DynTokenizer> {
    client: Option<EngineClient<T>>,
    shared: Arc<Shared>,
    config: ContinuousConfig,
    max_seq_len: usize,
    device: B::Device,
    adapters: Arc<AdapterRegistry<B>>,
    /// The engine thread, which returns the model (its tokenizer shared with the
    /// submitters, who hold it weakly) when it stops.
    thread: Option<JoinHandle<Llama<B, Arc<T>>>>,
}

impl<B: LlamaBackend, T: Tokenizer> std::fmt::Debug for ContinuousEngine<B, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ContinuousEngine")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl<B: LlamaBackend, T: Tokenizer> ContinuousEngine<B, T> {
    /// Allocates the KV pool and starts the engine thread with the model.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidParameter`] for a configuration with a zero limit or a KV
    /// budget smaller than one block, and (`kv_cache_type`) for a KV cache type that the
    /// backend or the model's head size cannot take.
    pub fn start(llama: Llama<B, T>, config: ContinuousConfig) -> Result<Self> {
        config.validate()?;
        // The pool holds the device's float type (a half-precision model's budget in
        // bytes holds twice the blocks), or the chosen encoded types.
        let types = config.kv_cache_types;
        let per_token = if types.is_float() {
            llama.kv_bytes_per_token()
        } else {
            let c = llama.config();
            types.bytes_per_token(c.n_layers, c.n_kv_heads, c.head_dim)?
        };
        let block = per_token.saturating_mul(config.block_size);
        let num_blocks = config.num_blocks(block);
        if num_blocks == 0 {
            return Err(LlamaError::invalid(
                "kv_budget",
                format!("{:?}", config.kv_budget),
                "smaller than one KV block",
            ));
        }
        let shared = Arc::new(Shared {
            waiting: AtomicUsize::new(0),
            next_id: AtomicU64::new(0),
            metrics: Mutex::new(EngineMetrics::default()),
            stop: AtomicBool::new(false),
            drain: AtomicBool::new(false),
            gone: AtomicBool::new(false),
        });
        let (tx, rx) = crossbeam_channel::unbounded();
        let device = llama.device().clone();
        let max_seq_len = llama.config().max_seq_len;
        let vocab_size = llama.config().vocab_size;
        // The tokenizer is shared: submitters tokenize with it on their own threads, the
        // engine thread decodes with it.
        let llama = llama.map_tokenizer(Arc::new);
        let adapters = Arc::new(AdapterRegistry::new(
            llama.config(),
            &device,
            config.max_lora_adapters,
        ));
        let frontend = Arc::new(Frontend {
            tokenizer: Arc::downgrade(&llama.tokenizer),
            constraints: llama.constraint_vocab.clone(),
            max_seq_len,
            vocab_size,
            d_model: llama.config().d_model,
            panic_marker: config.panic_marker.clone(),
            exit_marker: config.exit_marker.clone(),
            adapters: adapters.clone(),
        });
        let worker = executor::Worker::new(llama, &config, num_blocks, shared.clone(), rx)?;
        let thread = std::thread::Builder::new()
            .name("llama-burn-continuous".into())
            .spawn(move || worker.run())
            .map_err(|e| LlamaError::Runtime(format!("could not start the engine thread: {e}")))?;
        Ok(Self {
            client: Some(EngineClient {
                queue: tx,
                shared: shared.clone(),
                max_waiting: config.max_waiting,
                frontend,
            }),
            shared,
            config,
            max_seq_len,
            device,
            adapters,
            thread: Some(thread),
        })
    }

    /// The handle that queues requests, while the engine runs.
    fn client(&self) -> Result<&EngineClient<T>> {
        self.client
            .as_ref()
            .ok_or_else(|| LlamaError::ModelUnavailable("the engine has stopped".into()))
    }

    /// Validates `request` and returns its prompt's token ids, tokenized on the calling
    /// thread exactly as a submission would be: what a front end calls (on a thread of
    /// its own, once per prompt) before it submits one or more requests with those ids
    /// ([`GenerateRequest::from_ids`]), so that the engine thread never tokenizes.
    ///
    /// # Errors
    ///
    /// What [`GenerateRequest::validate`] and
    /// [`GenerateRequest::validate_token_ids`] refuse; [`LlamaError::EmptyPrompt`],
    /// [`LlamaError::PromptTooLong`] or [`LlamaError::InvalidParameter`] for the prompt
    /// itself; [`LlamaError::StepFailed`] if the tokenizer panicked;
    /// [`LlamaError::ModelUnavailable`] once the engine has stopped.
    ///
    /// ```no_run
    /// # fn main() -> llama_burn::Result<()> {
    /// use llama_burn::backend::{DefaultBackend, default_device};
    /// use llama_burn::inference::{ContinuousConfig, ContinuousEngine, GenerateRequest};
    /// use llama_burn::llama::LlamaConfig;
    ///
    /// let llama = llama_burn::Loader::gguf(llama_burn::demo::demo_model_path()?)
    ///     .max_seq_len(2048)
    ///     .load::<DefaultBackend>(&default_device())?;
    /// let engine = ContinuousEngine::start(llama, ContinuousConfig::default())?;
    /// let ids = engine.encode(&GenerateRequest::new("Once upon a time"))?;
    /// // Two samples of one prompt, tokenized once.
    /// let jobs = (0..2)
    ///     .map(|seed| engine.submit(GenerateRequest::from_ids(ids.clone()).with_seed(seed)))
    ///     .collect::<llama_burn::Result<Vec<_>>>()?;
    /// # drop(jobs);
    /// # Ok(())
    /// # }
    /// ```
    pub fn encode(&self, request: &GenerateRequest) -> Result<Vec<u32>> {
        self.client()?.frontend.encode(request)
    }

    /// The text of `ids` with the engine's tokenizer ([`Tokenizer::decode`]): what the
    /// server sends back for an echoed prompt of token ids.
    ///
    /// # Errors
    ///
    /// What decoding reports; [`LlamaError::ModelUnavailable`] once the engine has
    /// stopped.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.client()?.frontend.tokenizer()?.decode(ids)
    }

    /// `text` as an input to embed: encoded as a prompt (BOS included where the model
    /// wants it, as [`Llama::embed`] does) and checked, on the calling thread.
    ///
    /// # Errors
    ///
    /// [`LlamaError::EmptyPrompt`], [`LlamaError::PromptTooLong`] for a text over the
    /// context window; [`LlamaError::ModelUnavailable`] once the engine has stopped.
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>> {
        self.client()?.frontend.encode_text(text)
    }

    /// The model's width: the length of an embedding without `dimensions`.
    pub fn embedding_width(&self) -> usize {
        self.client().map_or(0, |c| c.frontend.d_model)
    }

    /// Queues `inputs` (token ids, each checked here) to be embedded on the engine
    /// thread, a forward pass at a time between the steps of the running requests (a
    /// long batch of inputs delays them by a pass per step, not by the whole batch), and
    /// calls `reply` there with one vector per input, the same bits as
    /// [`Llama::embed_ids`]'s. A cancelled `cancel` stops the work at the next pass
    /// (`reply` then gets [`LlamaError::Cancelled`]). The inputs count as one waiting
    /// request until their vectors are made.
    ///
    /// # Errors
    ///
    /// What the checks refuse ([`LlamaError::EmptyPrompt`],
    /// [`LlamaError::PromptTooLong`], [`LlamaError::InvalidParameter`] for a token id or
    /// `dimensions`), [`LlamaError::Overloaded`] when `max_waiting` requests wait
    /// already, [`LlamaError::ModelUnavailable`] once the engine has stopped; `reply` is
    /// not called then.
    pub fn embed_to(
        &self,
        inputs: Vec<Vec<u32>>,
        options: crate::embed::EmbeddingOptions,
        cancel: CancelToken,
        reply: impl FnOnce(Result<Vec<Vec<f32>>>) + Send + 'static,
    ) -> Result<()> {
        self.client()?
            .send_embedding(inputs, options, cancel, Box::new(reply))
    }

    /// One embedding per text ([`encode_text`](Self::encode_text) then
    /// [`embed_to`](Self::embed_to)), waiting for them.
    ///
    /// ```no_run
    /// # fn main() -> llama_burn::Result<()> {
    /// use llama_burn::backend::{DefaultBackend, default_device};
    /// use llama_burn::embed::EmbeddingOptions;
    /// use llama_burn::inference::{ContinuousConfig, ContinuousEngine};
    ///
    /// let llama = llama_burn::Loader::gguf(llama_burn::demo::demo_model_path()?)
    ///     .max_seq_len(2048)
    ///     .load::<DefaultBackend>(&default_device())?;
    /// let engine = ContinuousEngine::start(llama, ContinuousConfig::default())?;
    /// let vectors = engine.embed(&["first text", "second text"], EmbeddingOptions::default())?;
    /// assert_eq!(vectors.len(), 2);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// As [`encode_text`](Self::encode_text) and [`embed_to`](Self::embed_to), and a
    /// failed forward pass.
    pub fn embed(
        &self,
        texts: &[&str],
        options: crate::embed::EmbeddingOptions,
    ) -> Result<Vec<Vec<f32>>> {
        let inputs = texts
            .iter()
            .map(|t| self.encode_text(t))
            .collect::<Result<Vec<_>>>()?;
        let (tx, rx) = std::sync::mpsc::channel();
        self.embed_to(inputs, options, CancelToken::new(), move |result| {
            let _ = tx.send(result);
        })?;
        rx.recv()
            .map_err(|_| LlamaError::ModelUnavailable("the engine has stopped".into()))?
    }

    /// How the model writes tool calls ([`Tokenizer::tool_format`]; Hermes blocks once
    /// the engine has stopped).
    pub fn tool_format(&self) -> crate::tools::ToolFormat {
        self.client()
            .ok()
            .and_then(|c| c.frontend.tokenizer().ok())
            .map_or(crate::tools::ToolFormat::Hermes, |t| t.tool_format())
    }

    /// Queues a request. It is validated and, unless it gives
    /// [`prompt_ids`](GenerateRequest::prompt_ids), tokenized on the calling thread
    /// (the engine thread deals in token ids only). Fails at once with
    /// [`LlamaError::Overloaded`] when `max_waiting` requests are already waiting; other
    /// problems with the request arrive as its `Done` event.
    pub fn submit(&self, request: GenerateRequest) -> Result<EngineJob> {
        self.submit_with_cancel(request, CancelToken::new())
    }

    /// Queues a request whose cancellation is `cancel` (for example a runtime job's
    /// token), so the engine sees it directly.
    pub fn submit_with_cancel(
        &self,
        request: GenerateRequest,
        cancel: CancelToken,
    ) -> Result<EngineJob> {
        self.client()?.submit_events(request, cancel, false)
    }

    /// Like [`submit_with_cancel`](Self::submit_with_cancel), and the job's first event
    /// is [`EngineEvent::Accepted`] once the request has passed validation (or `Done` with
    /// the reason it did not). A server uses it to answer with an error status before it
    /// starts streaming, and to know the prompt's length even if the request is
    /// cancelled.
    pub fn submit_announced(
        &self,
        request: GenerateRequest,
        cancel: CancelToken,
    ) -> Result<EngineJob> {
        self.client()?.submit_events(request, cancel, true)
    }

    /// Queues `request` with a handler that receives its events on the engine thread
    /// (`Accepted` or the `Done` error that refuses it, then tokens, then `Done`), as
    /// [`submit_announced`](Self::submit_announced) delivers them to a job, without a
    /// channel in between: an async server passes a closure that sends into its own
    /// channel. Cancel the request through `cancel`. Returns the engine-assigned id.
    ///
    /// A request that fails validation or tokenization (or is cancelled already) gets
    /// its `Done` error at once, on the calling thread. Tokenizing a text prompt takes
    /// the calling thread's time: async code passes token ids from
    /// [`encode`](Self::encode), called on a blocking thread.
    ///
    /// # Errors
    ///
    /// [`LlamaError::Overloaded`] if the queue is full, and
    /// [`LlamaError::ModelUnavailable`] if the engine has stopped.
    pub fn submit_to(
        &self,
        request: GenerateRequest,
        cancel: CancelToken,
        on_event: impl Fn(EngineEvent) -> bool + Send + 'static,
    ) -> Result<u64> {
        self.submit_scoped(request, cancel, Scope::default(), on_event)
    }

    /// [`submit_to`](Self::submit_to) for a [`Scope`]: the request reuses cached prefix
    /// blocks only of requests with the same salt (a server gives each tenant its own,
    /// so a tenant cannot learn from its cache hits what another sent), and is admitted
    /// in its tenant's turn.
    ///
    /// # Errors
    ///
    /// As [`submit_to`](Self::submit_to).
    pub fn submit_scoped(
        &self,
        request: GenerateRequest,
        cancel: CancelToken,
        scope: Scope,
        on_event: impl Fn(EngineEvent) -> bool + Send + 'static,
    ) -> Result<u64> {
        self.client()?
            .send(request, Sink::Handler(Box::new(on_event)), cancel, scope)
            .map_err(|refused| refused.1)
    }

    /// Whether the engine thread is still running. It survives a panic inside a step
    /// (the step's requests fail); false means it has stopped for good and every
    /// submission is refused with [`LlamaError::ModelUnavailable`].
    pub fn is_alive(&self) -> bool {
        !self.shared.gone.load(Ordering::Acquire)
    }

    /// The model's context length (`max_seq_len`): prompt plus generated tokens.
    pub fn max_seq_len(&self) -> usize {
        self.max_seq_len
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

    /// The engine's LoRA adapters: register one from its files
    /// ([`AdapterRegistry::register`]) and requests name it with
    /// [`GenerateRequest::with_adapter`]. Shared: adapters may be added and removed while
    /// the engine runs.
    ///
    /// ```no_run
    /// # fn main() -> llama_burn::Result<()> {
    /// use llama_burn::backend::{DefaultBackend, default_device};
    /// use llama_burn::inference::{ContinuousConfig, ContinuousEngine, GenerateRequest};
    ///
    /// let llama = llama_burn::Loader::gguf("base.gguf").load::<DefaultBackend>(&default_device())?;
    /// let engine = ContinuousEngine::start(llama, ContinuousConfig::default())?;
    /// engine.adapters().register("sql", "adapters/sql-lora")?;
    /// let job = engine.submit(GenerateRequest::new("SELECT").with_adapter("sql"))?;
    /// # drop(job);
    /// # Ok(())
    /// # }
    /// ```
    pub fn adapters(&self) -> &Arc<AdapterRegistry<B>> {
        &self.adapters
    }

    /// The engine's configuration.
    pub fn config(&self) -> &ContinuousConfig {
        &self.config
    }

    /// Stops the engine once its queued and running requests are done, and returns the
    /// model.
    pub fn shutdown(mut self) -> Result<Llama<B, T>> {
        self.shared.drain.store(true, Ordering::Release);
        self.client = None;
        let thread = self
            .thread
            .take()
            .ok_or_else(|| LlamaError::ModelUnavailable("the engine has stopped".into()))?;
        let llama = thread
            .join()
            .map_err(|_| LlamaError::Runtime("the engine thread panicked".into()))?;
        Ok(llama.map_tokenizer(unshare))
    }

    fn direct_submit(&self) -> Option<DirectSubmit<GenerateRequest, TokenOutput>> {
        let client = self.client.clone()?;
        Some(Arc::new(move |request, sink| {
            client.submit_job(request, sink)
        }))
    }
}

/// The value of `shared` once nobody else holds it. Submitters hold the tokenizer only
/// weakly, and strongly only for the length of one prompt's tokenization, so this waits
/// at most for the tokenizations under way.
fn unshare<T>(mut shared: Arc<T>) -> T {
    loop {
        match Arc::try_unwrap(shared) {
            Ok(value) => return value,
            Err(back) => {
                shared = back;
                std::thread::yield_now();
            }
        }
    }
}

impl<B: LlamaBackend, T: Tokenizer> Drop for ContinuousEngine<B, T> {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.client = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl<B: LlamaBackend, T: Tokenizer> ModelDevice for ContinuousEngine<B, T> {
    type Device = B::Device;

    fn devices(&self) -> Vec<B::Device> {
        vec![self.device.clone()]
    }
}

/// Handler for the job runtime that forwards each request to a [`ContinuousEngine`]
/// and streams its tokens back. The job's cancellation token goes to the engine with the
/// request, so cancelling the job (or dropping its stream) removes the request at the
/// engine's next step. [`InferenceBuilder::build_continuous`] does not need it (its jobs
/// go straight to the engine thread); it is here for services built by hand.
pub fn continuous_batching_handler<B: LlamaBackend, T: Tokenizer>(
    In(request): In<GenerateRequest>,
    engine: ModelAccessor<ContinuousEngine<B, T>>,
    cancel: CancelToken,
    output: OutStream<TokenOutput>,
) -> Result<()> {
    let token = cancel.clone();
    let job = engine.submit(move |engine| engine.submit_with_cancel(request, token))??;
    for event in job.events.iter() {
        match event {
            EngineEvent::Token(token) => output.emit(token)?,
            EngineEvent::Accepted { .. } => {}
            EngineEvent::Done(result) => return result.map(drop),
        }
    }
    Err(LlamaError::ModelUnavailable("the engine stopped".into()))
}

impl<B: LlamaBackend, T: Tokenizer> InferenceBuilder<Llama<B, T>> {
    /// Serves the model with continuous batching: starts a [`ContinuousEngine`] and a
    /// service with the same [`GenerateRequest`] / [`TokenOutput`] job API as the other
    /// handlers. A job goes straight to the engine thread and its tokens come straight
    /// back into its stream: no job thread, no polling.
    pub fn build_continuous(
        self,
        config: ContinuousConfig,
    ) -> Result<Inference<ContinuousEngine<B, T>, GenerateRequest, TokenOutput>> {
        let engine = ContinuousEngine::start(self.into_model(), config)?;
        let direct = engine.direct_submit();
        Ok(InferenceBuilder::new()
            .with_model(engine)
            .build_with(continuous_batching_handler, direct))
    }
}
