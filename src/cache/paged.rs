//! The paged KV cache: per layer one pool of fixed-size blocks, allocated once.
//!
//! Keys and values of layer `l` live in two tensors shaped
//! `[num_blocks, n_kv_heads, block_size, head_dim]`. A request's tokens sit in the blocks
//! of its block table (token `i` in block `table[i / block_size]`, slot
//! `i % block_size`); which block belongs to whom is the
//! [`BlockManager`](super::blocks::BlockManager)'s business, not this type's. The memory
//! held is the pool, always: writing a step's keys and values touches only their slots,
//! and nothing is copied when requests join or leave a batch.
//!
//! Attention reads a step's rows through their block tables: on the CPU backend our
//! kernel reads the pool in place ([`paged_attention`](crate::kernels::attention::paged_attention));
//! elsewhere `gather_blocks` copies the blocks of a group of rows into one
//! `[rows, n_kv_heads, blocks * block_size, head_dim]` tensor for the backend's fused
//! attention, and that copy is dropped when the layer's attention returns.
//!
//! On the CPU backend (Flex) writes and gathers go straight to the pool's memory
//! (Flex's `slice_assign` copies the whole destination tensor on every call, which for a
//! pool means hundreds of megabytes per layer and step); on every other backend they
//! are portable Burn operations (`slice_assign`, `select`).

use burn::tensor::{Int, Tensor, TensorData, backend::Backend};
use rayon::prelude::*;

use super::blocks::BlockId;
use crate::backend::LlamaBackend;
use crate::error::{LlamaError, Result};
use crate::model::paged_batch::PagedBatch;

/// Where one token's keys and values go: `(block, slot within the block)`.
pub type Slot = (BlockId, usize);

/// Keys and values of one layer, `[num_blocks, n_kv_heads, block_size, head_dim]` each.
#[derive(Debug, Clone)]
struct LayerPool<B: Backend> {
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
}

/// The block pool of every layer.
#[derive(Debug, Clone)]
pub struct PagedKvCache<B: Backend> {
    layers: Vec<LayerPool<B>>,
    num_blocks: usize,
    block_size: usize,
    kv_heads: usize,
    head_dim: usize,
}

/// Bytes one block of `block_size` tokens takes across all layers (keys and values of
/// `value_bytes` each: 4 for f32, 2 for a half type).
pub fn block_bytes(
    n_layers: usize,
    kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    value_bytes: usize,
) -> usize {
    n_layers
        .saturating_mul(2)
        .saturating_mul(kv_heads)
        .saturating_mul(head_dim)
        .saturating_mul(block_size)
        .saturating_mul(value_bytes)
}

impl<B: Backend> PagedKvCache<B> {
    /// Allocates the pool: `num_blocks` blocks of `block_size` tokens for each of
    /// `n_layers` layers.
    pub fn new(
        n_layers: usize,
        num_blocks: usize,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
        device: &B::Device,
    ) -> Result<Self> {
        if num_blocks == 0 || block_size == 0 || u32::try_from(num_blocks).is_err() {
            return Err(LlamaError::invalid(
                "kv_budget",
                num_blocks,
                "the KV pool needs between 1 and 2^32 - 1 blocks",
            ));
        }
        let shape = [num_blocks, kv_heads, block_size, head_dim];
        let layers = (0..n_layers)
            .map(|_| LayerPool {
                k: Tensor::zeros(shape, device),
                v: Tensor::zeros(shape, device),
            })
            .collect();
        Ok(Self {
            layers,
            num_blocks,
            block_size,
            kv_heads,
            head_dim,
        })
    }

    /// Blocks per layer pool.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Layers.
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// Key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }

    /// Size of one head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Bytes one block holds across every layer (in the pool's float type).
    pub fn block_bytes(&self) -> usize {
        let value_bytes = self.layers.first().map_or(4, |l| l.k.dtype().size());
        block_bytes(
            self.layers.len(),
            self.kv_heads,
            self.head_dim,
            self.block_size,
            value_bytes,
        )
    }

    /// Bytes held by the pool: everything this cache ever allocates.
    pub fn allocated_bytes(&self) -> usize {
        self.block_bytes() * self.num_blocks
    }

    /// Writes this step's keys and values of `layer` (`[tokens, kv_heads * head_dim]`
    /// each, one row per token) into their slots, through the backend's
    /// [`paged_store`](LlamaBackend::paged_store).
    pub(crate) fn write(
        &mut self,
        layer: usize,
        k: Tensor<B, 2>,
        v: Tensor<B, 2>,
        slots: &[Slot],
        batch: &PagedBatch<'_, B>,
    ) where
        B: LlamaBackend,
    {
        let pool = &mut self.layers[layer];
        let LayerPool { k: keys, v: values } = pool;
        keys.inplace(|keys| {
            let mut written = None;
            values.inplace(|values| {
                let (keys, values) = B::paged_store((keys, values), k, v, slots, batch);
                written = Some(keys);
                values
            });
            // `inplace` ran the closure: `written` holds the keys.
            written.unwrap_or_else(|| unreachable!("Tensor::inplace runs its closure"))
        });
    }

    /// Layer `layer`'s pool: keys and values, `[blocks, kv_heads, block_size, head_dim]`
    /// each.
    pub(crate) fn layer(&self, layer: usize) -> (&Tensor<B, 4>, &Tensor<B, 4>) {
        let pool = &self.layers[layer];
        (&pool.k, &pool.v)
    }
}

/// Writes `values` (`[tokens, kv_heads * head_dim]`) into `pool` (`[blocks, kv_heads,
/// block_size, head_dim]`) at `slots`: on the host where the pool lives there, else one
/// slice assignment per run of consecutive slots in one block (the portable
/// [`LlamaBackend::paged_store`]).
pub(crate) fn write_slots<B: Backend>(
    pool: Tensor<B, 4>,
    values: Tensor<B, 2>,
    slots: &[Slot],
) -> Tensor<B, 4> {
    let [_, kv_heads, block_size, head_dim] = pool.dims();
    let written = super::host::write_in_place(pool, &values, |memory, rows| {
        for (i, &(block, slot)) in slots.iter().enumerate().take(rows.len()) {
            let row = rows.row(i);
            for h in 0..kv_heads {
                let dst = ((block as usize * kv_heads + h) * block_size + slot) * head_dim;
                memory[dst..dst + head_dim].copy_from_slice(&row[h * head_dim..(h + 1) * head_dim]);
            }
        }
    });
    // Portable: one slice assignment per run of consecutive slots in one block.
    let mut pool = match written {
        Ok(done) => return done,
        Err(pool) => pool,
    };
    let mut t = 0;
    while t < slots.len() {
        let (block, start) = slots[t];
        let mut n = 1;
        while t + n < slots.len() && slots[t + n] == (block, start + n) {
            n += 1;
        }
        let b = block as usize;
        let run = values
            .clone()
            .slice([t..t + n, 0..kv_heads * head_dim])
            .reshape([1, n, kv_heads, head_dim])
            .swap_dims(1, 2);
        pool = pool.slice_assign([b..b + 1, 0..kv_heads, start..start + n, 0..head_dim], run);
        t += n;
    }
    pool
}

/// Copies the blocks of a layer's `pool` (`[blocks, kv_heads, block_size, head_dim]`)
/// listed in `tables` (`rows` tables of the same length, padded with any valid id; the
/// caller masks what lies past a row's length) into one
/// `[rows, kv_heads, blocks * block_size, head_dim]` tensor.
pub(crate) fn gather_blocks<B: Backend>(
    pool: &Tensor<B, 4>,
    tables: &[BlockId],
    rows: usize,
) -> Tensor<B, 4> {
    let [_, kv_heads, block_size, head_dim] = pool.dims();
    let blocks = tables.len() / rows.max(1);
    let shape = [rows, kv_heads, blocks * block_size, head_dim];
    let gathered = super::host::read_in_place(pool, |memory| {
        let span = block_size * head_dim;
        let per_row = kv_heads * blocks * span;
        let mut out = vec![0f32; rows * per_row];
        out.par_chunks_mut(per_row.max(1))
            .zip(tables.par_chunks(blocks.max(1)))
            .for_each(|(dst, table)| {
                for h in 0..kv_heads {
                    for (j, &block) in table.iter().enumerate() {
                        let src = (block as usize * kv_heads + h) * span;
                        let at = (h * blocks + j) * span;
                        dst[at..at + span].copy_from_slice(&memory[src..src + span]);
                    }
                }
            });
        out
    });
    if let Some(out) = gathered {
        return Tensor::from_data(TensorData::new(out, shape), &pool.device());
    }
    let device = pool.device();
    let ids: Vec<i64> = tables.iter().map(|&b| i64::from(b)).collect();
    let ids = Tensor::<B, 1, Int>::from_data(TensorData::new(ids, [tables.len()]), &device);
    pool.clone()
        .select(0, ids)
        .reshape([rows, blocks, kv_heads, block_size * head_dim])
        .swap_dims(1, 2)
        .reshape([rows, kv_heads, blocks * block_size, head_dim])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{DefaultBackend as B, default_device};
    use crate::error::assert_err;

    fn values(tokens: usize, width: usize, base: f32) -> Tensor<B, 2> {
        let data: Vec<f32> = (0..tokens * width).map(|i| base + i as f32).collect();
        Tensor::from_data(TensorData::new(data, [tokens, width]), &default_device())
    }

    #[test]
    fn written_slots_are_read_back_through_block_tables() {
        let (heads, dim, bs) = (2, 3, 4);
        let mut cache = PagedKvCache::<B>::new(1, 5, bs, heads, dim, &default_device()).unwrap();
        // Row A: 6 tokens in blocks [3, 1]; row B: 2 tokens in block [0].
        let a_slots: Vec<Slot> = (0..6).map(|i| ([3, 1][i / bs], i % bs)).collect();
        let b_slots: Vec<Slot> = (0..2).map(|i| (0, i)).collect();
        let slots: Vec<Slot> = a_slots.iter().chain(&b_slots).copied().collect();
        let k = values(8, heads * dim, 0.0);
        let v = values(8, heads * dim, 1000.0);
        let seqs = vec![
            crate::model::attention::PagedSeq {
                tokens: 6,
                start: 0,
                blocks: &[3, 1],
            },
            crate::model::attention::PagedSeq {
                tokens: 2,
                start: 0,
                blocks: &[0],
            },
        ];
        let batch = PagedBatch::new(seqs, heads, bs, 5, &default_device()).unwrap();
        cache.write(0, k.clone(), v.clone(), &slots, &batch);
        let (pk, pv) = cache.layer(0);
        let tables = [3, 1, 0, 0];
        let (gk, gv) = (gather_blocks(pk, &tables, 2), gather_blocks(pv, &tables, 2));
        assert_eq!(gk.dims(), [2, heads, 2 * bs, dim]);
        let gk = gk.into_data().to_vec::<f32>().unwrap();
        let gv = gv.into_data().to_vec::<f32>().unwrap();
        let k = k.into_data().to_vec::<f32>().unwrap();
        let v = v.into_data().to_vec::<f32>().unwrap();
        let at = |row: usize, h: usize, pos: usize, d: usize| {
            ((row * heads + h) * 2 * bs + pos) * dim + d
        };
        for (row, first, len) in [(0, 0, 6), (1, 6, 2)] {
            for pos in 0..len {
                for h in 0..heads {
                    for d in 0..dim {
                        let src = (first + pos) * heads * dim + h * dim + d;
                        assert_eq!(gk[at(row, h, pos, d)], k[src]);
                        assert_eq!(gv[at(row, h, pos, d)], v[src]);
                    }
                }
            }
        }
        assert_eq!(cache.allocated_bytes(), 5 * 2 * heads * bs * dim * 4);
    }

    #[test]
    fn a_zero_block_pool_is_an_error() {
        assert_err!(
            PagedKvCache::<B>::new(1, 0, 16, 1, 1, &default_device()),
            LlamaError::InvalidParameter {
                name: "kv_budget",
                ..
            }
        );
    }
}
