//! Grouped-query self-attention over the contiguous KV cache and over the paged pool.

pub use super::paged_batch::PagedBatch;
pub use crate::kernels::attention::PagedSeq;

use burn::tensor::{Int, Tensor, backend::Backend};

use super::paged_batch::int_tensor;
use crate::backend::LlamaBackend;
use crate::cache::paged::Slot;
use crate::cache::{BlockId, KvCache, PagedKvCache};
use crate::config::LlamaConfig;
use crate::error::{LlamaError, Result};

/// Attention for one layer: `q` is `[batch * seq, n_heads * head_dim]` and `k`/`v` are
/// `[batch * seq, n_kv_heads * head_dim]` (projection outputs, RoPE applied to `q` and
/// `k`). Writes `k`/`v` into the cache and returns `[batch * seq, n_heads * head_dim]`.
///
/// Query heads that share a key/value head are folded into the query axis, so keys and
/// values are never repeated (see [`LlamaBackend::token_major_attention`]).
pub fn grouped_query_attention<B: LlamaBackend>(
    q: Tensor<B, 2>,
    k: Tensor<B, 2>,
    v: Tensor<B, 2>,
    cache: &mut KvCache<B>,
    layer: usize,
    mask: Option<&Tensor<B, 4, burn::tensor::Bool>>,
    n_heads: usize,
) -> Result<Tensor<B, 2>> {
    let batch = cache.batch();
    let (keys, values) = cache.write(layer, k, v);
    B::token_major_attention(q, keys, values, mask.cloned(), batch, n_heads)
}

/// [`grouped_query_attention`] through the backend's
/// [`paged_attention`](LlamaBackend::paged_attention), the contiguous cache seen as a
/// pool of one block per row (`view`: [`KvCache::as_paged_batch`], rows without left
/// padding): writes `k`/`v` into the cache, then each query attends its row's keys up to
/// its own position.
pub(crate) fn contiguous_in_place<B: LlamaBackend>(
    q: Tensor<B, 2>,
    k: Tensor<B, 2>,
    v: Tensor<B, 2>,
    cache: &mut KvCache<B>,
    layer: usize,
    view: &PagedBatch<'_, B>,
) -> Result<Tensor<B, 2>> {
    cache.write(layer, k, v);
    let (keys, values) = cache.layer(layer);
    B::paged_attention(q, keys, values, view)
}

/// One layer's queries, keys and values as the projection gave them, RoPE not yet
/// applied: the attention step rotates them itself, so that a backend may rotate and
/// store the keys in one kernel ([`LlamaBackend::rope_paged_store`]).
pub(crate) struct QkvStep<'a, B: Backend> {
    /// Queries then keys, `[tokens, q_dim + n_kv_heads * head_dim]` (possibly a column
    /// view of the fused projection's output).
    pub(crate) qk: Tensor<B, 2>,
    /// Values, `[tokens, n_kv_heads * head_dim]`.
    pub(crate) v: Tensor<B, 2>,
    /// Columns of the queries, `n_heads * head_dim`.
    pub(crate) q_dim: usize,
    pub(crate) rope: &'a super::rope::RopeTable<B>,
    pub(crate) angles: &'a super::rope::RopeAngles<B>,
}

impl<B: Backend> QkvStep<'_, B> {
    /// Queries and keys rotated (the backend's RoPE), with the values: `(q, k, v)`.
    pub(crate) fn rotated(self) -> Result<(Tensor<B, 2>, Tensor<B, 2>, Tensor<B, 2>)>
    where
        B: LlamaBackend,
    {
        let rotation = self.rope.rotation(self.angles);
        let (q, k) = rotation.rotate_split(self.qk, self.q_dim)?;
        Ok((q, k, self.v))
    }
}

/// One row of a paged forward pass, as the engine's executor describes it: no request,
/// only tokens, positions and blocks.
#[derive(Debug, Clone, Copy)]
pub struct PagedRow<'a> {
    /// The tokens to run (a prompt chunk, or the last sampled token).
    pub tokens: &'a [u32],
    /// Tokens of this row already in its blocks; `tokens[0]` sits at this position.
    pub start: usize,
    /// The row's block table, covering at least `start + tokens.len()` tokens.
    pub blocks: &'a [BlockId],
    /// Whether to return the logits of the row's last token.
    pub logits: bool,
    /// With `logits`, return the logits of every token of the row instead (speculative
    /// decoding's verification).
    pub all_logits: bool,
    /// The LoRA adapter the row runs with: an index into the adapters given to
    /// [`Transformer::forward_paged_adapted`](super::Transformer::forward_paged_adapted),
    /// or `None` for the base model.
    pub adapter: Option<usize>,
}

/// Everything a paged forward pass needs that does not change from layer to layer:
/// positions, the slots where new keys and values go, and the attention step. Built once
/// per step.
#[derive(Debug)]
pub(crate) struct PagedPlan<'a, B: Backend> {
    /// RoPE position of every flat token.
    pub(crate) positions: Vec<usize>,
    /// Flat tokens whose logits are wanted (`None`: every token).
    pub(crate) logit_rows: Option<Tensor<B, 1, Int>>,
    slots: Vec<Slot>,
    batch: PagedBatch<'a, B>,
}

impl<'a, B: Backend> PagedPlan<'a, B> {
    /// Checks the rows against the cache and the model and lays out the step.
    pub(crate) fn new(
        rows: &[PagedRow<'a>],
        cache: &PagedKvCache<B>,
        config: &LlamaConfig,
        device: &B::Device,
    ) -> Result<Self> {
        let bs = cache.block_size();
        if rows.is_empty() || rows.iter().any(|r| r.tokens.is_empty()) {
            return Err(LlamaError::InvalidBatch(
                "a paged step needs rows with at least one token each".into(),
            ));
        }
        if cache.n_layers() != config.n_layers
            || cache.kv_heads() != config.n_kv_heads
            || cache.head_dim() != config.head_dim
        {
            return Err(LlamaError::InvalidBatch(
                "the paged KV cache was built for another model".into(),
            ));
        }
        let mut positions = Vec::new();
        let mut slots = Vec::new();
        let mut logit_rows = Vec::new();
        let mut seqs = Vec::with_capacity(rows.len());
        for row in rows {
            let end = row.start + row.tokens.len();
            if end > config.max_seq_len {
                return Err(LlamaError::PromptTooLong {
                    tokens: end,
                    max: config.max_seq_len,
                });
            }
            if row.blocks.len() * bs < end
                || row.blocks.iter().any(|&b| b as usize >= cache.num_blocks())
            {
                return Err(LlamaError::InvalidBatch(format!(
                    "a block table of {} blocks cannot hold {end} tokens",
                    row.blocks.len()
                )));
            }
            config.check_token_ids(row.tokens)?;
            for p in row.start..end {
                positions.push(p);
                slots.push((row.blocks[p / bs], p % bs));
            }
            if row.logits && row.all_logits {
                let first = positions.len() - row.tokens.len();
                logit_rows.extend((first..positions.len()).map(|i| i as i64));
            } else if row.logits {
                logit_rows.push((positions.len() - 1) as i64);
            }
            seqs.push(PagedSeq {
                tokens: row.tokens.len(),
                start: row.start,
                blocks: row.blocks,
            });
        }
        let total = positions.len();
        let logit_rows = (logit_rows.len() != total).then(|| int_tensor::<B>(logit_rows, device));
        Ok(Self {
            positions,
            logit_rows,
            slots,
            batch: PagedBatch::from_checked(seqs, config.n_heads, bs, device),
        })
    }

    /// Attention of one layer: rotates this step's queries and keys and writes the keys
    /// and values into their slots (one kernel on the CubeCL backends), then the backend
    /// attends over each sequence's blocks. Returns `[tokens, n_heads * head_dim]`.
    pub(crate) fn attention(
        &self,
        layer: usize,
        step: QkvStep<'_, B>,
        cache: &mut PagedKvCache<B>,
    ) -> Result<Tensor<B, 2>>
    where
        B: LlamaBackend,
    {
        let q = cache.write_rotated(layer, step, &self.slots, &self.batch)?;
        cache.attention(layer, q, &self.batch)
    }
}
