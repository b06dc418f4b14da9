//! The Llama transformer as a pure function of (tokens, cache) -> logits.
//!
//! No tokenizer, sampling or threading lives here: strategies in [`crate::llama`] and
//! [`crate::inference`] are thin layers that decide which rows go into a forward pass.

pub mod attention;
pub mod linear;
pub mod norm;
pub(crate) mod paged_batch;
pub mod rope;
pub mod weights;

use std::sync::Arc;

use burn::tensor::{Int, Tensor, TensorData, backend::Backend, module::embedding};

use crate::backend::{Around, LlamaBackend};
use crate::kernels::QuantMatrix;

use crate::cache::{KvCache, PagedKvCache};
use crate::config::{LlamaConfig, Precision};
use crate::error::{LlamaError, Result};
pub use attention::PagedRow;
use attention::{PagedPlan, QkvStep, grouped_query_attention};
pub use linear::Projection;
use norm::rms_norm;
use rope::RopeTable;
use weights::{BLOCK_WEIGHTS, WeightKind};

/// Indices of the block's projections in [`BLOCK_WEIGHTS`] (checked by a test), as an
/// adapter's changes are keyed.
const WQKV: usize = 1;
const WO: usize = 2;
const W_GATE: usize = 4;
const W_UP: usize = 5;
const W_DOWN: usize = 6;

/// Weights of one transformer block. Projection matrices are stored `[in, out]`, so a
/// projection is `x @ w` over contiguous memory: on the CPU backend that was 1.5-6x faster
/// at 8-32 rows than multiplying by the transpose of an `[out, in]` matrix, and equal at 1.
#[derive(Debug, Clone)]
pub struct Block<B: Backend> {
    /// RMSNorm weight before attention, `[d_model]`.
    pub attn_norm: Tensor<B, 1>,
    /// Fused query, key and value projections,
    /// `[d_model, (n_heads + 2 n_kv_heads) head_dim]`: one product (one launch on a GPU)
    /// where the three share a format, the queries and keys in one where only the values
    /// differ (as in Q4_K_M files).
    pub wqkv: Projection<B>,
    /// Attention output projection, `[n_heads head_dim, d_model]`.
    pub wo: Projection<B>,
    /// RMSNorm weight before the feed-forward block, `[d_model]`.
    pub ffn_norm: Tensor<B, 1>,
    /// Gate projection, `[d_model, ffn_hidden]`.
    pub w_gate: Projection<B>,
    /// Up projection, `[d_model, ffn_hidden]`.
    pub w_up: Projection<B>,
    /// Down projection, `[ffn_hidden, d_model]`.
    pub w_down: Projection<B>,
}

/// One weight of a [`Block`], owned: what [`Block::from_weights`] takes.
#[derive(Debug, Clone)]
pub enum BlockTensor<B: Backend> {
    /// An RMSNorm weight.
    Norm(Tensor<B, 1>),
    /// A projection.
    Projection(Projection<B>),
}

/// One weight of a [`Block`], borrowed: what [`Block::weights`] gives.
#[derive(Debug, Clone, Copy)]
pub enum BlockTensorRef<'a, B: Backend> {
    /// An RMSNorm weight.
    Norm(&'a Tensor<B, 1>),
    /// A projection.
    Projection(&'a Projection<B>),
}

impl<B: LlamaBackend> BlockTensorRef<'_, B> {
    /// Its shape: `[len]` for a norm, `[in, out]` for a projection.
    pub fn dims(&self) -> Vec<usize> {
        match self {
            Self::Norm(t) => t.dims().to_vec(),
            Self::Projection(p) => p.dims().to_vec(),
        }
    }

    /// Bytes of weights held.
    pub fn weight_bytes(&self) -> usize {
        match self {
            Self::Norm(t) => t.shape().num_elements() * t.dtype().size(),
            Self::Projection(p) => p.weight_bytes(),
        }
    }
}

impl<B: Backend> BlockTensor<B> {
    fn into_norm(self, name: &str) -> Result<Tensor<B, 1>> {
        match self {
            Self::Norm(t) => Ok(t),
            Self::Projection(_) => Err(LlamaError::Config(format!(
                "block weight {name}: a norm was expected, a projection given"
            ))),
        }
    }

    fn into_projection(self, name: &str) -> Result<Projection<B>> {
        match self {
            Self::Projection(p) => Ok(p),
            Self::Norm(_) => Err(LlamaError::Config(format!(
                "block weight {name}: a projection was expected, a norm given"
            ))),
        }
    }
}

impl<B: Backend> Block<B> {
    /// Assembles a block from its weights in [`BLOCK_WEIGHTS`] order (the order
    /// [`Block::weights`] gives them back in). Shapes are checked by the [`Transformer`].
    ///
    /// # Errors
    ///
    /// [`LlamaError::Config`] if a weight is missing or of the wrong kind.
    pub fn from_weights(weights: impl IntoIterator<Item = BlockTensor<B>>) -> Result<Self> {
        let weights: Vec<BlockTensor<B>> = weights.into_iter().collect();
        let given = weights.len();
        let [attn_norm, wqkv, wo, ffn_norm, w_gate, w_up, w_down] =
            <[BlockTensor<B>; BLOCK_WEIGHTS.len()]>::try_from(weights).map_err(|_| {
                LlamaError::Config(format!(
                    "a block has {} weights, {given} were given",
                    BLOCK_WEIGHTS.len()
                ))
            })?;
        Ok(Self {
            attn_norm: attn_norm.into_norm("attn_norm")?,
            wqkv: wqkv.into_projection("wqkv")?,
            wo: wo.into_projection("wo")?,
            ffn_norm: ffn_norm.into_norm("ffn_norm")?,
            w_gate: w_gate.into_projection("w_gate")?,
            w_up: w_up.into_projection("w_up")?,
            w_down: w_down.into_projection("w_down")?,
        })
    }

    /// The block's weights, in [`BLOCK_WEIGHTS`] order.
    pub fn weights(&self) -> [BlockTensorRef<'_, B>; BLOCK_WEIGHTS.len()] {
        use BlockTensorRef::{Norm, Projection as Proj};
        [
            Norm(&self.attn_norm),
            Proj(&self.wqkv),
            Proj(&self.wo),
            Norm(&self.ffn_norm),
            Proj(&self.w_gate),
            Proj(&self.w_up),
            Proj(&self.w_down),
        ]
    }
}

/// Most prompt columns read in one forward pass by [`Transformer::forward_prompt`].
pub const PREFILL_CHUNK: usize = 512;

/// Which positions' logits a forward pass returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only the last position of each row (prompt processing, decoding).
    Last,
    /// Every position (scoring, tests).
    All,
}

/// A `[vocab, d_model]` table: the token embeddings, and the output head (the same
/// table when the two are tied).
#[derive(Debug, Clone)]
pub enum VocabMatrix<B: Backend> {
    /// f32 on the device.
    Dense(Tensor<B, 2>),
    /// Kept in its block format on the host (CPU backend), one row per token.
    Quantized(Arc<QuantMatrix>),
}

impl<B: LlamaBackend> VocabMatrix<B> {
    /// `[vocab, d_model]`.
    pub fn dims(&self) -> [usize; 2] {
        match self {
            VocabMatrix::Dense(t) => t.dims(),
            VocabMatrix::Quantized(m) => [m.rows(), m.cols()],
        }
    }

    /// The rows of `ids` (checked against the vocabulary by the caller): `[ids, d_model]`.
    fn lookup(&self, ids: &[u32], device: &B::Device) -> Result<Tensor<B, 2>> {
        let n = ids.len();
        match self {
            VocabMatrix::Dense(table) => {
                let ids: Vec<i64> = ids.iter().map(|&t| i64::from(t)).collect();
                let ids = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [1, n]), device);
                let d = table.dims()[1];
                Ok(embedding(table.clone(), ids).reshape([n, d]))
            }
            VocabMatrix::Quantized(m) => {
                let ids: Vec<usize> = ids.iter().map(|&t| t as usize).collect();
                let rows = m.dequantize_rows(&ids)?;
                Ok(Tensor::from_data(
                    TensorData::new(rows, [n, m.cols()]),
                    device,
                ))
            }
        }
    }

    /// `x @ table^T`: `[rows, d_model]` to `[rows, vocab]`, a quantized table in
    /// `precision`.
    fn project(&self, x: Tensor<B, 2>, precision: Precision) -> Result<Tensor<B, 2>> {
        match self {
            // The head is stored `[vocab, d_model]`: the backend's transposed product.
            VocabMatrix::Dense(table) => B::dense_matmul(x, table, true),
            VocabMatrix::Quantized(m) => B::quantized_matmul(x, m, precision),
        }
    }

    /// Bytes of weights held.
    pub fn weight_bytes(&self) -> usize {
        match self {
            VocabMatrix::Dense(t) => t.shape().num_elements() * t.dtype().size(),
            VocabMatrix::Quantized(m) => m.bytes(),
        }
    }
}

/// The Llama transformer: embeddings, blocks, final norm and output head.
#[derive(Debug, Clone)]
pub struct Transformer<B: Backend> {
    /// Token embeddings, `[vocab, d_model]`.
    pub embed: VocabMatrix<B>,
    /// The transformer blocks.
    pub blocks: Vec<Block<B>>,
    /// Final RMSNorm weight, `[d_model]`.
    pub norm: Tensor<B, 1>,
    /// Output head, `[vocab, d_model]` (the embedding table itself when tied).
    pub lm_head: VocabMatrix<B>,
    rope: RopeTable<B>,
    config: LlamaConfig,
    device: B::Device,
}

/// Columns of a row-major `[batch, seq]` token input, or an error if the tokens cannot
/// be split evenly over `batch` rows.
fn columns(tokens: &[u32], batch: usize) -> Result<usize> {
    if batch == 0 || tokens.is_empty() || !tokens.len().is_multiple_of(batch) {
        return Err(LlamaError::InvalidBatch(format!(
            "{} tokens cannot be split over {batch} rows",
            tokens.len()
        )));
    }
    Ok(tokens.len() / batch)
}

/// Runs a forward pass on one of rayon's worker threads (the caller waits). The CPU
/// kernels split each projection across the pool; started from a worker, a split runs one
/// part on that thread, instead of handing every part over from an outside thread and
/// sleeping (about 180 hand-overs per decoded token on the demo model).
fn on_workers<R: Send>(pass: impl FnOnce() -> R + Send) -> R {
    let _running = crate::kernels::pool::ForwardPass::start();
    rayon::scope(|_| pass())
}

impl<B: LlamaBackend> Transformer<B> {
    /// Assembles a transformer from f32 weights (see [`crate::loader`] for reading them
    /// from checkpoints). Checks every shape against `config`.
    pub fn new(
        config: LlamaConfig,
        embed: Tensor<B, 2>,
        blocks: Vec<Block<B>>,
        norm: Tensor<B, 1>,
        lm_head: Option<Tensor<B, 2>>,
        device: &B::Device,
    ) -> Result<Self> {
        Self::from_weights(
            config,
            VocabMatrix::Dense(embed),
            blocks,
            norm,
            lm_head.map(VocabMatrix::Dense),
            device,
        )
    }

    /// Assembles a transformer from weights, dense or quantized; `lm_head: None` ties
    /// the output head to the embeddings. Checks every shape against `config`.
    pub fn from_weights(
        config: LlamaConfig,
        embed: VocabMatrix<B>,
        blocks: Vec<Block<B>>,
        norm: Tensor<B, 1>,
        lm_head: Option<VocabMatrix<B>>,
        device: &B::Device,
    ) -> Result<Self> {
        config.validate()?;
        let c = &config;
        let check = |name: &str, actual: Vec<usize>, expected: Vec<usize>| {
            if actual == expected {
                Ok(())
            } else {
                Err(LlamaError::ShapeMismatch {
                    name: name.to_string(),
                    expected,
                    actual,
                })
            }
        };
        check(
            "embed",
            embed.dims().to_vec(),
            vec![c.vocab_size, c.d_model],
        )?;
        check("norm", norm.dims().to_vec(), vec![c.d_model])?;
        if blocks.len() != c.n_layers {
            return Err(LlamaError::Config(format!(
                "{} blocks given, config says {}",
                blocks.len(),
                c.n_layers
            )));
        }
        for (i, b) in blocks.iter().enumerate() {
            for (spec, weight) in BLOCK_WEIGHTS.iter().zip(b.weights()) {
                check(
                    &format!("blk.{i}.{}", spec.name),
                    weight.dims(),
                    spec.shape(c),
                )?;
            }
        }
        let lm_head = match lm_head {
            Some(head) => {
                check(
                    "lm_head",
                    head.dims().to_vec(),
                    vec![c.vocab_size, c.d_model],
                )?;
                head
            }
            None => embed.clone(),
        };
        Ok(Self {
            rope: RopeTable::new(&config, device),
            embed,
            blocks,
            norm,
            lm_head,
            config,
            device: device.clone(),
        })
    }

    /// A randomly initialised model (uniform weights scaled by `1/sqrt(fan_in)`, unit
    /// norms), reproducible from `seed`. Useful to exercise the API without a checkpoint.
    pub fn random(config: LlamaConfig, seed: u64, device: &B::Device) -> Result<Self> {
        use rand::{Rng, SeedableRng, rngs::StdRng};
        config.validate()?;
        let mut rng = StdRng::seed_from_u64(seed);
        // `[fan_in, fan_out]`, uniform in +-1/sqrt(fan_in).
        let mut matrix = |fan_in: usize, fan_out: usize| {
            let bound = 1.0 / (fan_in as f32).sqrt();
            let data: Vec<f32> = (0..fan_in * fan_out)
                .map(|_| rng.random_range(-bound..bound))
                .collect();
            Tensor::<B, 2>::from_data(TensorData::new(data, [fan_in, fan_out]), device)
        };
        let c = &config;
        let ones = || Tensor::<B, 1>::ones([c.d_model], device);
        let embed = matrix(c.vocab_size, c.d_model);
        let blocks = (0..c.n_layers)
            .map(|_| {
                Block::from_weights(BLOCK_WEIGHTS.iter().map(|w| match w.kind {
                    WeightKind::Norm => BlockTensor::Norm(Tensor::ones([w.rows(c)], device)),
                    WeightKind::Projection => {
                        BlockTensor::Projection(Projection::new(matrix((w.cols)(c), w.rows(c))))
                    }
                }))
            })
            .collect::<Result<Vec<_>>>()?;
        let lm_head = (!c.tie_embeddings).then(|| matrix(c.vocab_size, c.d_model));
        Self::new(config.clone(), embed, blocks, ones(), lm_head, device)
    }

    /// The configuration the model was built with.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// Sets how the kernels (the CPU's and the GPU backends') multiply quantized weights
    /// from the next forward pass on (the weights are the same in both precisions, so
    /// this is free).
    pub fn set_precision(&mut self, precision: Precision) {
        self.config.precision = precision;
    }

    /// The device the model lives on.
    pub fn device(&self) -> &B::Device {
        &self.device
    }

    /// Bytes of weights the model holds (float tensors in their type and quantized
    /// blocks; a tied head is counted once).
    pub fn weight_bytes(&self) -> usize {
        let norm_bytes = |t: &Tensor<B, 1>| t.shape().num_elements() * t.dtype().size();
        let blocks: usize = self
            .blocks
            .iter()
            .flat_map(|b| b.weights())
            .map(|w| w.weight_bytes())
            .sum();
        let head = if self.config.tie_embeddings {
            0
        } else {
            self.lm_head.weight_bytes()
        };
        self.embed.weight_bytes() + blocks + norm_bytes(&self.norm) + head
    }

    /// An empty cache for `starts.len()` rows with the given left padding, with room for
    /// `capacity` columns (it grows on demand up to the context window).
    pub fn new_cache(&self, starts: Vec<usize>, capacity: usize) -> KvCache<B> {
        let c = &self.config;
        KvCache::new(
            c.n_layers,
            c.n_kv_heads,
            c.head_dim,
            starts,
            capacity,
            c.max_seq_len,
            &self.device,
        )
    }

    /// Runs `tokens` (row-major `[batch, seq]`, one row per cache row) through the model,
    /// appending them to `cache` at columns `cache.len()..cache.len() + seq`, and returns
    /// logits `[batch, seq', vocab]` where `seq'` is 1 for [`Logits::Last`].
    ///
    /// Every row's result depends only on that row's own tokens: padding columns are
    /// masked and positions are relative to each row's start.
    pub fn forward(
        &self,
        tokens: &[u32],
        cache: &mut KvCache<B>,
        logits: Logits,
    ) -> Result<Tensor<B, 3>> {
        self.forward_adapted(tokens, cache, logits, None)
    }

    /// [`forward`](Self::forward) with every row run with `adapter`'s LoRA changes (or
    /// none).
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidBatch`] for an adapter made for another model; what
    /// [`forward`](Self::forward) reports.
    pub fn forward_adapted(
        &self,
        tokens: &[u32],
        cache: &mut KvCache<B>,
        logits: Logits,
        adapter: Option<&crate::lora::LoraWeights<B>>,
    ) -> Result<Tensor<B, 3>> {
        on_workers(|| self.forward_on_worker(tokens, cache, logits, adapter))
    }

    fn forward_on_worker(
        &self,
        tokens: &[u32],
        cache: &mut KvCache<B>,
        logits: Logits,
        adapter: Option<&crate::lora::LoraWeights<B>>,
    ) -> Result<Tensor<B, 3>> {
        let batch = cache.batch();
        let seq = columns(tokens, batch)?;
        let c = &self.config;
        let x = self.contiguous_blocks(tokens, cache, adapter)?;
        let (x, out_seq) = match logits {
            Logits::All => (x, seq),
            Logits::Last if seq == 1 => (x, 1),
            Logits::Last => {
                let x = x
                    .reshape([batch, seq, c.d_model])
                    .slice([0..batch, seq - 1..seq, 0..c.d_model])
                    .reshape([batch, c.d_model]);
                (x, 1)
            }
        };
        Ok(self.head(x)?.reshape([batch, out_seq, c.vocab_size]))
    }

    /// Runs `tokens` (row-major `[batch, seq]`) through the model like
    /// [`forward`](Self::forward) and returns every position's final hidden state after
    /// the model's last norm, `[batch * seq, d_model]` row by row: what embeddings pool
    /// ([`crate::embed`]). A row's states depend only on its own tokens.
    ///
    /// # Errors
    ///
    /// As [`forward`](Self::forward).
    pub fn forward_hidden(&self, tokens: &[u32], cache: &mut KvCache<B>) -> Result<Tensor<B, 2>> {
        on_workers(|| self.contiguous_blocks(tokens, cache, None))
    }

    /// The transformer blocks over a chunk of a contiguous cache's rows (appended to
    /// `cache`, which advances): the final hidden states (after the model's last norm),
    /// `[batch * seq, d_model]`.
    fn contiguous_blocks(
        &self,
        tokens: &[u32],
        cache: &mut KvCache<B>,
        adapter: Option<&crate::lora::LoraWeights<B>>,
    ) -> Result<Tensor<B, 2>> {
        let batch = cache.batch();
        let seq = columns(tokens, batch)?;
        let c = &self.config;
        if (cache.n_layers(), cache.kv_heads(), cache.head_dim())
            != (c.n_layers, c.n_kv_heads, c.head_dim)
        {
            return Err(LlamaError::InvalidBatch(format!(
                "the KV cache was built for another model ({} layers of {} x {}, this model \
                 has {} of {} x {})",
                cache.n_layers(),
                cache.kv_heads(),
                cache.head_dim(),
                c.n_layers,
                c.n_kv_heads,
                c.head_dim
            )));
        }
        c.check_token_ids(tokens)?;
        cache.reserve(seq)?;
        let device = self.device.clone();
        let positions = cache.chunk_positions(seq);
        let groups = c.n_heads / c.n_kv_heads;
        // On a backend with kernels of its own (the CubeCL backends), the rows attend
        // through its paged attention, each row's cache one block whose slots before the
        // row's start are left padding: the engine's kernel, no mask, no per-shape
        // compilation of Burn's attention.
        let rows: Vec<crate::cache::BlockId> = (0..batch as crate::cache::BlockId).collect();
        let in_place = if B::compiles_kernels() {
            Some(cache.as_paged_batch(&rows, seq, c.n_heads, &device)?)
        } else {
            None
        };
        let mask = match in_place {
            Some(_) => None,
            None => cache.chunk_mask(seq, groups, &device),
        };
        let lora = match adapter {
            Some(w) => crate::lora::LoraStep::new(&[w], [(tokens.len(), Some(0))], c, &device)?,
            None => crate::lora::LoraStep::none(),
        };
        let x = self.run_blocks(tokens, &positions, &lora, |layer, step| {
            let (q, k, v) = step.rotated()?;
            match &in_place {
                Some(view) => attention::contiguous_in_place(q, k, v, cache, layer, view),
                None => grouped_query_attention(q, k, v, cache, layer, mask.as_ref(), c.n_heads),
            }
        })?;
        cache.advance(seq);
        Ok(x)
    }

    /// Reads a prompt (row-major `[batch, seq]`, as [`forward`](Self::forward) takes it)
    /// in chunks of at most [`PREFILL_CHUNK`] columns and returns the logits of the last
    /// position of each row, `[batch, 1, vocab]`. Masks and attention scores then grow
    /// with chunk times context, never with the square of a long prompt.
    pub fn forward_prompt(&self, tokens: &[u32], cache: &mut KvCache<B>) -> Result<Tensor<B, 3>> {
        let batch = cache.batch();
        let seq = columns(tokens, batch)?;
        if seq <= PREFILL_CHUNK {
            return self.forward(tokens, cache, Logits::Last);
        }
        let mut logits = None;
        for start in (0..seq).step_by(PREFILL_CHUNK) {
            let end = (start + PREFILL_CHUNK).min(seq);
            let chunk: Vec<u32> = (0..batch)
                .flat_map(|r| tokens[r * seq + start..r * seq + end].iter().copied())
                .collect();
            logits = Some(self.forward(&chunk, cache, Logits::Last)?);
        }
        logits.ok_or_else(|| LlamaError::InvalidBatch("empty prompt".into()))
    }

    /// Runs a step of the continuous-batching engine over the paged KV cache: every row
    /// appends its `tokens` after the `start` tokens already in its blocks, all rows'
    /// tokens go through the projections together, and attention reads each row through
    /// its block table. Returns the logits of the last token of every row whose
    /// `logits` flag is set, `[rows with logits, vocab]`, in row order.
    ///
    /// A row's result depends only on its own tokens and blocks.
    pub fn forward_paged(
        &self,
        rows: &[PagedRow<'_>],
        cache: &mut PagedKvCache<B>,
    ) -> Result<Tensor<B, 2>> {
        self.forward_paged_adapted(rows, &[], cache)
    }

    /// [`forward_paged`](Self::forward_paged) with LoRA adapters: a row whose
    /// [`adapter`](PagedRow::adapter) is `Some(i)` gets `adapters[i]`'s change added to
    /// each projection it changes, beside the shared base product; rows without one run
    /// the base model. A row's result depends only on its own tokens, blocks and adapter.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidBatch`] for a row naming an adapter past `adapters`, or an
    /// adapter made for another model; what [`forward_paged`](Self::forward_paged)
    /// reports.
    pub fn forward_paged_adapted(
        &self,
        rows: &[PagedRow<'_>],
        adapters: &[&crate::lora::LoraWeights<B>],
        cache: &mut PagedKvCache<B>,
    ) -> Result<Tensor<B, 2>> {
        on_workers(|| self.forward_paged_on_worker(rows, adapters, cache))
    }

    fn forward_paged_on_worker(
        &self,
        rows: &[PagedRow<'_>],
        adapters: &[&crate::lora::LoraWeights<B>],
        cache: &mut PagedKvCache<B>,
    ) -> Result<Tensor<B, 2>> {
        let c = &self.config;
        let plan = PagedPlan::new(rows, cache, c, &self.device)?;
        let lora = crate::lora::LoraStep::new(
            adapters,
            rows.iter().map(|r| (r.tokens.len(), r.adapter)),
            c,
            &self.device,
        )?;
        let tokens: Vec<u32> = rows.iter().flat_map(|r| r.tokens.iter().copied()).collect();
        let x = self.run_blocks(&tokens, &plan.positions, &lora, |layer, step| {
            plan.attention(layer, step, cache)
        })?;
        let x = match &plan.logit_rows {
            Some(index) => x.select(0, index.clone()),
            None => x,
        };
        self.head(x)
    }

    /// Runs each kind of forward pass once on throwaway caches, so that a backend that
    /// compiles (and tunes) its kernels on first use does it now rather than in the
    /// first request: a prompt chunk of 8 rows and decode steps of 1, 4 and 8 rows on
    /// the paged path (the quantized products' three tile sizes, the device argmax),
    /// then a prompt and a decode step on the contiguous cache. The caches are dropped;
    /// the model is unchanged.
    ///
    /// # Errors
    ///
    /// What a forward pass reports (a device error).
    pub fn warm_up(&self) -> Result<()> {
        use crate::cache::BlockId;
        let c = &self.config;
        let block_size = 16;
        let len = (2 * block_size + 3)
            .min(c.max_seq_len.saturating_sub(1))
            .max(1);
        let vocab = c.vocab_size.max(1);
        let prompt: Vec<u32> = (0..len).map(|i| ((i * 7 + 1) % vocab) as u32).collect();
        let rows = 8;
        let per_row = (len + 1).div_ceil(block_size);
        let mut cache = PagedKvCache::<B>::new(
            c.n_layers,
            rows * per_row,
            block_size,
            c.n_kv_heads,
            c.head_dim,
            &self.device,
        )?;
        let tables: Vec<Vec<BlockId>> = (0..rows)
            .map(|r| ((r * per_row) as BlockId..((r + 1) * per_row) as BlockId).collect())
            .collect();
        fn step<'a>(
            tables: &'a [Vec<BlockId>],
            tokens: &'a [u32],
            start: usize,
        ) -> Vec<PagedRow<'a>> {
            tables
                .iter()
                .map(|blocks| PagedRow {
                    tokens,
                    start,
                    blocks,
                    logits: true,
                    all_logits: false,
                    adapter: None,
                })
                .collect()
        }
        let logits = self.forward_paged(&step(&tables, &prompt, 0), &mut cache)?;
        B::greedy_tokens(&logits)?;
        let next = [prompt[0]];
        if len < c.max_seq_len {
            for n in [1, 4, rows] {
                let logits = self.forward_paged(&step(&tables[..n], &next, len), &mut cache)?;
                B::greedy_tokens(&logits)?;
            }
        }
        let mut kv = KvCache::<B>::new(
            c.n_layers,
            c.n_kv_heads,
            c.head_dim,
            vec![0],
            len + 1,
            c.max_seq_len,
            &self.device,
        );
        self.forward(&prompt, &mut kv, Logits::Last)?;
        if len < c.max_seq_len {
            let logits = self.forward(&next, &mut kv, Logits::Last)?;
            logits
                .into_data()
                .convert::<f32>()
                .to_vec::<f32>()
                .map_err(|e| LlamaError::Runtime(format!("warm-up: {e:?}")))?;
        }
        Ok(())
    }

    /// The transformer blocks over `tokens` (one flat sequence of rows) at `positions`;
    /// `attend(layer, step)` computes attention from this chunk's queries, keys and
    /// values ([`QkvStep`]: RoPE not yet applied, so that a backend may rotate and store
    /// in one kernel) and returns `[tokens, n_heads * head_dim]`. Returns the final
    /// hidden states, after the model's last norm.
    fn run_blocks(
        &self,
        tokens: &[u32],
        positions: &[usize],
        lora: &crate::lora::LoraStep<'_, B>,
        mut attend: impl FnMut(usize, QkvStep<'_, B>) -> Result<Tensor<B, 2>>,
    ) -> Result<Tensor<B, 2>> {
        let c = &self.config;
        let angles = self.rope.angles(positions, c.n_heads + c.n_kv_heads)?;
        let rows = tokens.len();
        let mut x = self.embed.lookup(tokens, &self.device)?;

        let (q_dim, kv_dim) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        let p = c.precision;
        // Where the backend fuses them (`LlamaBackend::fused_quantized_matmul`, the
        // CubeCL backends in `fast`), each norm runs in the next product's prologue and
        // each residual add in the epilogue of the product before it. Elsewhere (and for
        // a projection an adapter changes) a residual add is done with the next norm
        // (`LlamaBackend::add_rms_norm`: one kernel on the CubeCL backends), and `x`
        // waits for it with the sub-layer's output `pending`; the last block's is done
        // after the loop. The bits are the same either way.
        let mut pending: Option<Tensor<B, 2>> = None;
        for (layer, block) in self.blocks.iter().enumerate() {
            let attn_norm = Around::Norm(&block.attn_norm, c.norm_eps);
            let fused = if pending.is_none() && !lora.touches(layer, WQKV) {
                let qkv = &block.wqkv;
                qkv.forward_split_fused(x.clone(), attn_norm, p, q_dim + kv_dim)?
            } else {
                None
            };
            let (qk, v) = match fused {
                Some(split) => split,
                None => {
                    let h = match pending.take() {
                        Some(delta) => {
                            let (sum, h) = B::add_rms_norm(x, delta, &block.attn_norm, c.norm_eps)?;
                            x = sum;
                            h
                        }
                        None => rms_norm(x.clone(), &block.attn_norm, c.norm_eps)?,
                    };
                    // Each projection's output gets the adapter rows' LoRA changes (none
                    // in a step without adapters); queries and keys before RoPE, as in
                    // the checkpoint's own model.
                    if lora.touches(layer, WQKV) {
                        let qkv = lora.apply(layer, WQKV, &h, block.wqkv.forward(h.clone(), p)?)?;
                        (
                            qkv.clone().slice([0..rows, 0..q_dim + kv_dim]),
                            qkv.slice([0..rows, q_dim + kv_dim..q_dim + 2 * kv_dim]),
                        )
                    } else {
                        block.wqkv.forward_split(h, p, q_dim + kv_dim)?
                    }
                }
            };
            let attn = attend(
                layer,
                QkvStep {
                    qk,
                    v,
                    q_dim,
                    rope: &self.rope,
                    angles: &angles,
                },
            )?;
            let fused = if lora.touches(layer, WO) {
                None
            } else {
                let residual = Around::Residual(x.clone());
                block.wo.forward_fused(attn.clone(), residual, p)?
            };
            let gated = match fused {
                Some(sum) => {
                    x = sum;
                    self.feed_forward_normed(block, layer, x.clone(), lora)?
                }
                None => {
                    let out = lora.apply(layer, WO, &attn, block.wo.forward(attn.clone(), p)?)?;
                    let (sum, h) = B::add_rms_norm(x, out, &block.ffn_norm, c.norm_eps)?;
                    x = sum;
                    self.feed_forward_gate(block, layer, h, lora)?
                }
            };
            let fused = if lora.touches(layer, W_DOWN) {
                None
            } else {
                let residual = Around::Residual(x.clone());
                block.w_down.forward_fused(gated.clone(), residual, p)?
            };
            match fused {
                Some(sum) => x = sum,
                None => {
                    let down = block.w_down.forward(gated.clone(), p)?;
                    pending = Some(lora.apply(layer, W_DOWN, &gated, down)?);
                }
            }
        }
        // The last block's residual add, with the model's final norm (one kernel on the
        // CubeCL backends).
        match pending {
            Some(delta) => Ok(B::add_rms_norm(x, delta, &self.norm, c.norm_eps)?.1),
            None => rms_norm(x, &self.norm, c.norm_eps),
        }
    }

    /// The feed-forward block's gated activations from the residual stream `x`: with the
    /// block's norm in the product's prologue where the backend fuses it (gate, up and
    /// SwiGLU in one launch) and no adapter changes gate or up, else the norm apart and
    /// [`feed_forward_gate`](Self::feed_forward_gate).
    fn feed_forward_normed(
        &self,
        block: &Block<B>,
        layer: usize,
        x: Tensor<B, 2>,
        lora: &crate::lora::LoraStep<'_, B>,
    ) -> Result<Tensor<B, 2>> {
        let c = &self.config;
        let untouched = !lora.touches(layer, W_GATE) && !lora.touches(layer, W_UP);
        if untouched
            && let (Some(gate), Some(up)) = (block.w_gate.as_quantized(), block.w_up.as_quantized())
        {
            let norm = Around::Norm(&block.ffn_norm, c.norm_eps);
            let beside = crate::backend::Beside::SwiGluUp(up);
            if let Some(gated) =
                B::fused_quantized_matmul(x.clone(), gate, beside, norm, c.precision)?
            {
                return Ok(gated);
            }
        }
        let h = rms_norm(x, &block.ffn_norm, c.norm_eps)?;
        self.feed_forward_gate(block, layer, h, lora)
    }

    /// The feed-forward block's gated activations, `silu(h @ gate) * (h @ up)`, with the
    /// LoRA changes of the step's adapter rows. Where the backend fuses the two
    /// quantized products and SwiGLU in one kernel, every row takes that kernel, and the
    /// rows of an adapter that changes the gate or up projection are then computed
    /// apart (unfused, their changes added) and put in place of theirs: a row's path
    /// is the same whatever its neighbours.
    fn feed_forward_gate(
        &self,
        block: &Block<B>,
        layer: usize,
        h: Tensor<B, 2>,
        lora: &crate::lora::LoraStep<'_, B>,
    ) -> Result<Tensor<B, 2>> {
        let p = self.config.precision;
        let unfused = |h: Tensor<B, 2>, lora: &crate::lora::LoraStep<'_, B>| {
            let gate = lora.apply(layer, W_GATE, &h, block.w_gate.forward(h.clone(), p)?)?;
            let up = lora.apply(layer, W_UP, &h, block.w_up.forward(h.clone(), p)?)?;
            B::swiglu(gate, up)
        };
        let fused = match (block.w_gate.as_quantized(), block.w_up.as_quantized()) {
            (Some(gate), Some(up)) => B::quantized_swiglu(h.clone(), gate, up, p)?,
            _ => None,
        };
        let Some(mut gated) = fused else {
            return unfused(h, lora);
        };
        let [rows, hidden] = gated.dims();
        for (group_rows, index, own) in lora.groups_touching(layer, [W_GATE, W_UP]) {
            let theirs = unfused(h.clone().select(0, index.clone()), &own)?;
            let placed = Tensor::<B, 2>::zeros([rows, hidden], &gated.device()).select_assign(
                0,
                index.clone(),
                theirs,
                burn::tensor::IndexingUpdateOp::Add,
            );
            let mut mask = vec![false; rows];
            for &r in group_rows {
                mask[r as usize] = true;
            }
            let mask = Tensor::<B, 2, burn::tensor::Bool>::from_data(
                TensorData::new(mask, [rows, 1]),
                &gated.device(),
            )
            .expand([rows, hidden]);
            gated = gated.mask_where(mask, placed);
        }
        Ok(gated)
    }

    /// The output head on final hidden states (normed by [`run_blocks`](Self::run_blocks)):
    /// `[rows, d_model]` to `[rows, vocab]`.
    fn head(&self, x: Tensor<B, 2>) -> Result<Tensor<B, 2>> {
        self.lm_head.project(x, self.config.precision)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn projection_indices_name_the_weight_tables_rows() {
        let names = [WQKV, WO, W_GATE, W_UP, W_DOWN].map(|i| BLOCK_WEIGHTS[i].name);
        assert_eq!(names, ["wqkv", "wo", "w_gate", "w_up", "w_down"]);
    }
}
