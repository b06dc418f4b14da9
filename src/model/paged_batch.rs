//! The sequences of one paged attention step ([`PagedBatch`]): built once per step by
//! a paged forward pass, read by every layer's
//! [`paged_attention`](crate::backend::LlamaBackend::paged_attention), either as block
//! tables on the device or gathered into padded batches (the portable path).

use std::cell::OnceCell;

use burn::tensor::{Bool, Int, Tensor, TensorData, backend::Backend};

use crate::cache::BlockId;
use crate::cache::paged::gather_blocks;
use crate::error::{LlamaError, Result};
use crate::kernels::attention::PagedSeq;

/// Rows whose attention runs as one padded batch: rows of similar length share a group,
/// so padding never costs more than the rows' own work.
#[derive(Debug)]
struct AttentionGroup<B: Backend> {
    rows: usize,
    /// Longest chunk of the group (the padded query length).
    queries: usize,
    /// Flat token feeding each padded query slot, `[rows * queries]`.
    query_index: Tensor<B, 1, Int>,
    /// Block tables padded to the same length, `rows * blocks` ids.
    tables: Vec<BlockId>,
    /// `[rows, 1, groups * queries, blocks * block_size]`, true where a key is hidden.
    mask: Tensor<B, 4, Bool>,
}

/// The gathering path's layout of a step: its groups, and for every flat token its row
/// in the concatenated padded group outputs.
#[derive(Debug)]
struct Gathered<B: Backend> {
    groups: Vec<AttentionGroup<B>>,
    output_index: Tensor<B, 1, Int>,
}

/// The sequences of one paged attention step, as a backend's
/// [`paged_attention`](crate::backend::LlamaBackend::paged_attention) receives them: each sequence's new
/// tokens (one after another in the queries), how many tokens its blocks already hold
/// and its block table. The same for every layer of a step.
#[derive(Debug)]
pub struct PagedBatch<'a, B: Backend> {
    seqs: Vec<PagedSeq<'a>>,
    n_heads: usize,
    block_size: usize,
    device: B::Device,
    /// Built on first use, by backends that gather blocks.
    gathered: OnceCell<Gathered<B>>,
    /// Built on first use, by backends whose kernel reads the block tables on the device.
    table: OnceCell<DeviceTable<B>>,
    /// Per sequence, the first slot of its blocks that holds its own keys (the slots
    /// before it are left padding: the contiguous cache's rows of a batch of prompts of
    /// different lengths); empty when no sequence is padded. See
    /// [`with_left_padding`](Self::with_left_padding).
    firsts: Vec<usize>,
}

/// A step's block tables on the device (see [`PagedBatch::device_table`]).
#[derive(Debug)]
struct DeviceTable<B: Backend> {
    values: Tensor<B, 1, Int>,
    /// The largest block id named, checked against a layer's pool.
    max_block: usize,
}

impl<'a, B: Backend> PagedBatch<'a, B> {
    /// The sequences of a step over a pool of `blocks` blocks of `block_size`
    /// positions, for `n_heads` query heads: what a paged forward pass builds once per
    /// step, and what a test of a backend's
    /// [`paged_attention`](crate::backend::LlamaBackend::paged_attention) builds by hand.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidBatch`] if there are no sequences, one has no tokens, or a
    /// block table is too short for its tokens or names a block outside the pool.
    pub fn new(
        seqs: Vec<PagedSeq<'a>>,
        n_heads: usize,
        block_size: usize,
        blocks: usize,
        device: &B::Device,
    ) -> Result<Self> {
        if seqs.is_empty() || block_size == 0 || seqs.iter().any(|s| s.tokens == 0) {
            return Err(LlamaError::InvalidBatch(
                "a paged step needs sequences with at least one token each".into(),
            ));
        }
        for seq in &seqs {
            let end = seq.start + seq.tokens;
            if seq.blocks.len().saturating_mul(block_size) < end
                || seq.blocks.iter().any(|&b| b as usize >= blocks)
            {
                return Err(LlamaError::InvalidBatch(format!(
                    "a block table of {} blocks in a pool of {blocks} cannot hold {end} tokens",
                    seq.blocks.len()
                )));
            }
        }
        Ok(Self::from_checked(seqs, n_heads, block_size, device))
    }

    /// The sequences of a step whose shapes the caller has checked (as
    /// [`new`](Self::new) does).
    pub(crate) fn from_checked(
        seqs: Vec<PagedSeq<'a>>,
        n_heads: usize,
        block_size: usize,
        device: &B::Device,
    ) -> Self {
        Self {
            seqs,
            n_heads,
            block_size,
            device: device.clone(),
            gathered: OnceCell::new(),
            table: OnceCell::new(),
            firsts: Vec::new(),
        }
    }

    /// The batch with left padding: sequence `i`'s slots before `firsts[i]` hold no keys
    /// of its own. A token at a slot `p >= firsts[i]` (slots count from the table's first
    /// block, as positions do: `start + s` for token `s`) sees the keys of slots
    /// `firsts[i]..=p`; a padding token (`p < firsts[i]`) sees its own key only, so no
    /// softmax is empty (its output is the caller's to drop). A real token's result is
    /// the one it has in a sequence of its own, unpadded: the same keys, in the same
    /// order.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidBatch`] unless there is one first slot per sequence.
    pub(crate) fn with_left_padding(mut self, firsts: Vec<usize>) -> Result<Self> {
        if firsts.len() != self.seqs.len() {
            return Err(LlamaError::InvalidBatch(format!(
                "{} first slots for {} sequences",
                firsts.len(),
                self.seqs.len()
            )));
        }
        self.firsts = if firsts.iter().all(|&f| f == 0) {
            Vec::new()
        } else {
            firsts
        };
        Ok(self)
    }
}

impl<'a, B: Backend> PagedBatch<'a, B> {
    /// The sequences, in query order.
    pub fn seqs(&self) -> &[PagedSeq<'a>] {
        &self.seqs
    }

    /// Query heads.
    pub fn n_heads(&self) -> usize {
        self.n_heads
    }

    /// Positions per block of the pool.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Whether some sequence is left-padded (see
    /// [`first_key`](Self::first_key)): a kernel that attends from slot 0 would read its
    /// padding.
    pub fn is_left_padded(&self) -> bool {
        !self.firsts.is_empty()
    }

    /// The first slot whose key the token at slot `slot` of sequence `seq` sees: 0
    /// without left padding; with it, the sequence's first own slot, or `slot` itself for
    /// a padding token.
    pub fn first_key(&self, seq: usize, slot: usize) -> usize {
        match self.firsts.get(seq) {
            Some(&first) if slot >= first => first,
            Some(_) => slot,
            None => 0,
        }
    }

    /// Whether `angles` are those of this step's tokens, in query order (their positions
    /// each sequence's `start..start + tokens`): what a kernel that reads the angles at
    /// the positions of the block tables needs (a comparison of one integer a token).
    pub fn rotates_its_tokens(&self, angles: &crate::model::rope::RopeAngles<B>) -> bool {
        let positions = self.seqs.iter().flat_map(|s| s.start..s.start + s.tokens);
        positions.eq(angles.positions().iter().copied())
    }

    /// The step's block tables as one integer tensor on the device, for kernels that
    /// read them there, and the largest block id they name. For query token `t` (the
    /// sequences' new tokens one after another), entry `3 t` is where its sequence's
    /// block table starts in this tensor, entry `3 t + 1` its position (its slot in the
    /// table) and entry `3 t + 2` the first slot whose key it sees
    /// ([`first_key`](Self::first_key)); the tables follow, each holding the blocks of its
    /// sequence's `start + tokens` positions. Built on first use (one upload per step)
    /// and shared by every layer.
    pub fn device_table(&self) -> (&Tensor<B, 1, Int>, usize) {
        let table = self.table.get_or_init(|| {
            let tokens: usize = self.seqs.iter().map(|s| s.tokens).sum();
            let mut values = Vec::with_capacity(3 * tokens);
            let mut tables = Vec::new();
            for (i, seq) in self.seqs.iter().enumerate() {
                let at = 3 * tokens + tables.len();
                let used = (seq.start + seq.tokens).div_ceil(self.block_size.max(1));
                tables.extend(
                    seq.blocks[..used.min(seq.blocks.len())]
                        .iter()
                        .map(|&b| b as i64),
                );
                values.extend(
                    (seq.start..seq.start + seq.tokens)
                        .flat_map(|p| [at as i64, p as i64, self.first_key(i, p) as i64]),
                );
            }
            let max_block = tables.iter().copied().max().unwrap_or(0) as usize;
            values.extend(tables);
            DeviceTable {
                values: int_tensor(values, &self.device),
                max_block,
            }
        });
        (&table.values, table.max_block)
    }

    /// Attention by gathering each group of similar sequences' blocks into a padded
    /// batch and running `attend` (a backend's
    /// [`masked_attention`](crate::backend::LlamaBackend::masked_attention)) with a
    /// causal mask: the portable path, for backends without a kernel that reads block
    /// tables. `q` is `[tokens, n_heads * head_dim]`, `keys`/`values` a layer's pool
    /// `[blocks, kv_heads, block_size, head_dim]`; returns the shape of `q`.
    ///
    /// # Errors
    ///
    /// As `attend`.
    pub fn attention_by_gathering(
        &self,
        q: Tensor<B, 2>,
        keys: &Tensor<B, 4>,
        values: &Tensor<B, 4>,
        attend: impl Fn(
            Tensor<B, 4>,
            Tensor<B, 4>,
            Tensor<B, 4>,
            Option<Tensor<B, 4, Bool>>,
        ) -> Result<Tensor<B, 4>>,
    ) -> Result<Tensor<B, 2>> {
        let [_, kv, _, dim] = keys.dims();
        let heads = self.n_heads;
        let groups = heads / kv.max(1);
        let gathered = self.gathered.get_or_init(|| self.gather_layout(groups));
        let outputs: Vec<Tensor<B, 2>> = gathered
            .groups
            .iter()
            .map(|g| {
                let (keys, values) = (
                    gather_blocks(keys, &g.tables, g.rows),
                    gather_blocks(values, &g.tables, g.rows),
                );
                let query = q
                    .clone()
                    .select(0, g.query_index.clone())
                    .reshape([g.rows, g.queries, heads, dim])
                    .swap_dims(1, 2)
                    .reshape([g.rows, kv, groups * g.queries, dim]);
                Ok(attend(query, keys, values, Some(g.mask.clone()))?
                    .reshape([g.rows, heads, g.queries, dim])
                    .swap_dims(1, 2)
                    .reshape([g.rows * g.queries, heads * dim]))
            })
            .collect::<Result<_>>()?;
        let all = if outputs.len() == 1 {
            outputs.into_iter().next().unwrap_or_else(|| q.clone())
        } else {
            Tensor::cat(outputs, 0)
        };
        Ok(all.select(0, gathered.output_index.clone()))
    }

    /// Groups sequences of similar shape: sorted by (chunk, length), a sequence joins
    /// the current group while the padded work stays within twice the real work.
    fn gather_layout(&self, groups_per_kv: usize) -> Gathered<B> {
        let (seqs, bs, device) = (&self.seqs, self.block_size, &self.device);
        let mut first_token = Vec::with_capacity(seqs.len());
        let mut total = 0;
        for seq in seqs {
            first_token.push(total);
            total += seq.tokens;
        }
        let mut order: Vec<usize> = (0..seqs.len()).collect();
        order.sort_by_key(|&i| (seqs[i].tokens, seqs[i].start + seqs[i].tokens));
        let mut grouped: Vec<Vec<usize>> = Vec::new();
        let (mut real, mut queries, mut keys) = (0usize, 0usize, 0usize);
        for &i in &order {
            let q = seqs[i].tokens;
            let len = seqs[i].start + q;
            let padded_keys = len.div_ceil(bs) * bs;
            if let Some(group) = grouped.last_mut() {
                let (nq, nk) = (queries.max(q), keys.max(padded_keys));
                let padded = (group.len() + 1) * nq * nk;
                if padded <= 2 * (real + q * len) {
                    group.push(i);
                    (real, queries, keys) = (real + q * len, nq, nk);
                    continue;
                }
            }
            grouped.push(vec![i]);
            (real, queries, keys) = (q * len, q, padded_keys);
        }

        let mut output_index = vec![0i64; total];
        let mut padded_offset = 0usize;
        let mut groups = Vec::with_capacity(grouped.len());
        for members in grouped {
            let queries = members.iter().map(|&i| seqs[i].tokens).max().unwrap_or(1);
            let blocks = members
                .iter()
                .map(|&i| (seqs[i].start + seqs[i].tokens).div_ceil(bs))
                .max()
                .unwrap_or(1);
            let keys = blocks * bs;
            let mut query_index = Vec::with_capacity(members.len() * queries);
            let mut tables = Vec::with_capacity(members.len() * blocks);
            let mut mask = Vec::with_capacity(members.len() * groups_per_kv * queries * keys);
            for (slot, &i) in members.iter().enumerate() {
                let seq = &seqs[i];
                let q = seq.tokens;
                let first = first_token[i];
                for s in 0..queries {
                    // Padding queries repeat the row's first token; their output is dropped.
                    query_index.push((first + s.min(q - 1)) as i64);
                }
                for s in 0..q {
                    output_index[first + s] = (padded_offset + slot * queries + s) as i64;
                }
                let used = (seq.start + q).div_ceil(bs);
                tables.extend_from_slice(&seq.blocks[..used]);
                tables.extend(std::iter::repeat_n(seq.blocks[0], blocks - used));
                let mut per_query = Vec::with_capacity(queries * keys);
                for s in 0..queries {
                    // A real query sees the keys from its first (0 without left padding)
                    // up to its own position; a padding query of the group sees key 0
                    // only, so no softmax row is empty.
                    let (first, last) = if s < q {
                        (self.first_key(i, seq.start + s), seq.start + s)
                    } else {
                        (0, 0)
                    };
                    per_query.extend((0..keys).map(|k| k < first || k > last));
                }
                for _ in 0..groups_per_kv {
                    mask.extend_from_slice(&per_query);
                }
            }
            let n = members.len();
            padded_offset += n * queries;
            groups.push(AttentionGroup {
                rows: n,
                queries,
                query_index: int_tensor(query_index, device),
                tables,
                mask: Tensor::from_data(
                    TensorData::new(mask, [n, 1, groups_per_kv * queries, keys]),
                    device,
                ),
            });
        }
        Gathered {
            groups,
            output_index: int_tensor(output_index, device),
        }
    }
}

/// An integer tensor of `values` on `device`.
pub(crate) fn int_tensor<B: Backend>(values: Vec<i64>, device: &B::Device) -> Tensor<B, 1, Int> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), device)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{DefaultBackend as B, default_device};
    use crate::model::rope::RopeAngles;

    #[test]
    fn a_step_knows_its_own_angles() {
        let device = default_device();
        let (table_a, table_b) = ([0u32, 1], [2u32]);
        let seqs = vec![
            PagedSeq {
                tokens: 2,
                start: 5,
                blocks: &table_a,
            },
            PagedSeq {
                tokens: 1,
                start: 0,
                blocks: &table_b,
            },
        ];
        let batch = PagedBatch::<B>::new(seqs, 2, 4, 3, &device).expect("batch");
        let table = || Tensor::<B, 2>::zeros([8, 4], &device);
        let angles = |positions: Vec<usize>| {
            RopeAngles::new(table(), table(), positions, 3).expect("angles")
        };
        let own = angles(vec![5, 6, 0]);
        let shifted = angles(vec![6, 7, 1]);
        let short = angles(vec![5, 6]);
        assert!(batch.rotates_its_tokens(&own));
        // Asked again (every layer asks), and for other angles.
        assert!(batch.rotates_its_tokens(&own));
        assert!(!batch.rotates_its_tokens(&shifted));
        assert!(!batch.rotates_its_tokens(&short));
        assert!(batch.rotates_its_tokens(&angles(vec![5, 6, 0])));
    }

    #[test]
    fn left_padding_hides_the_slots_before_a_rows_first_key() {
        use crate::backend::LlamaBackend;
        let device = default_device();
        let (kv_heads, block_size, dim, n_heads, n, pad) = (2, 8, 4, 4, 3, 4);
        let value = |i: usize, seed: usize| ((i * 7 + seed * 13) % 17) as f32 / 8.0 - 1.0;
        // Block 0 holds the row's keys at slots 0..n; block 1 the same keys after `pad`
        // slots of other values.
        let pool = |seed: usize| {
            let mut data = vec![0f32; 2 * kv_heads * block_size * dim];
            for h in 0..kv_heads {
                for slot in 0..block_size {
                    for e in 0..dim {
                        let at =
                            |b: usize, s: usize| ((b * kv_heads + h) * block_size + s) * dim + e;
                        let own = value((h * block_size + slot) * dim + e, seed);
                        data[at(0, slot)] = own;
                        if slot >= pad {
                            data[at(1, slot)] =
                                value((h * block_size + slot - pad) * dim + e, seed);
                        } else {
                            data[at(1, slot)] = 5.0 + own;
                        }
                    }
                }
            }
            Tensor::<B, 4>::from_data(
                burn::tensor::TensorData::new(data, [2, kv_heads, block_size, dim]),
                &device,
            )
        };
        let (keys, values) = (pool(1), pool(2));
        let width = n_heads * dim;
        let q: Vec<f32> = (0..n * width).map(|i| value(i, 3)).collect();
        let queries = |rows: usize, data: Vec<f32>| {
            Tensor::<B, 2>::from_data(burn::tensor::TensorData::new(data, [rows, width]), &device)
        };
        let (alone_table, padded_table) = ([0u32], [1u32]);
        let alone = PagedBatch::<B>::new(
            vec![PagedSeq {
                tokens: n,
                start: 0,
                blocks: &alone_table,
            }],
            n_heads,
            block_size,
            2,
            &device,
        )
        .expect("batch");
        let padded = PagedBatch::<B>::new(
            vec![PagedSeq {
                tokens: pad + n,
                start: 0,
                blocks: &padded_table,
            }],
            n_heads,
            block_size,
            2,
            &device,
        )
        .expect("batch")
        .with_left_padding(vec![pad])
        .expect("padding");
        assert!(padded.is_left_padded() && !alone.is_left_padded());
        assert_eq!(
            (0..pad + n)
                .map(|p| padded.first_key(0, p))
                .collect::<Vec<_>>(),
            [0, 1, 2, 3, 4, 4, 4]
        );
        let want = B::paged_attention(queries(n, q.clone()), &keys, &values, &alone)
            .expect("alone")
            .into_data()
            .into_vec::<f32>()
            .expect("f32");
        let mut padded_q = vec![0.5f32; pad * width];
        padded_q.extend(&q);
        let got = B::paged_attention(queries(pad + n, padded_q), &keys, &values, &padded)
            .expect("padded")
            .into_data()
            .into_vec::<f32>()
            .expect("f32");
        let diff = want
            .iter()
            .zip(&got[pad * width..])
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            diff <= 1e-6,
            "the padded row differs from the row alone by {diff}"
        );
        assert!(matches!(
            PagedBatch::<B>::new(
                vec![PagedSeq {
                    tokens: 1,
                    start: 0,
                    blocks: &alone_table
                }],
                n_heads,
                block_size,
                2,
                &device,
            )
            .expect("batch")
            .with_left_padding(vec![1, 2]),
            Err(LlamaError::InvalidBatch(_))
        ));
    }
}
