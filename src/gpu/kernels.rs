//! The CubeCL kernels themselves (compiled for CUDA, Vulkan/WGPU and Metal by CubeCL).

use cubecl::prelude::*;

/// Paged attention: one cube per (query token, query head), one unit per value of the
/// head (`dim` units). Keys are taken `dim` at a time: each unit scores one key of the
/// tile (a dot product of `dim` products in order), then every unit folds the tile's
/// scores into its running maximum and sum in the same order (online softmax, f32) and
/// accumulates its own value column. A token's result depends on its own sequence only:
/// no value crosses from one cube to another, whatever the batch.
///
/// `meta` is [`PagedBatch::device_table`](crate::model::attention::PagedBatch::device_table)'s
/// layout: per token its table's offset and its position, then the tables.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn paged_attention_kernel<F: Float, I: Numeric>(
    q: &Tensor<F>,
    keys: &Tensor<F>,
    values: &Tensor<F>,
    meta: &Tensor<I>,
    out: &mut Tensor<F>,
    n_heads: u32,
    groups: u32,
    kv_heads: u32,
    block_size: u32,
    scale: f32,
    #[comptime] dim: usize,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let token = CUBE_POS_X as usize;
    let head = CUBE_POS_Y as usize;
    let d = UNIT_POS_X as usize;
    let n_heads = n_heads as usize;
    let kv_heads = kv_heads as usize;
    let block_size = block_size as usize;
    let kv_head = head / groups as usize;

    let table = u32::cast_from(meta[2 * token]) as usize;
    let len = u32::cast_from(meta[2 * token + 1]) as usize + 1;

    let mut qs = SharedMemory::<f32>::new(dim);
    let mut scores = SharedMemory::<f32>::new(dim);
    let q_at = (token * n_heads + head) * dim;
    qs[d] = f32::cast_from(q[q_at + d]) * scale;
    sync_cube();

    // A finite stand-in for minus infinity: WGSL rejects an infinite literal.
    let mut max = f32::new(-1.0e30);
    let mut sum = f32::new(0.0);
    let mut acc = f32::new(0.0);
    let mut tile = 0usize;
    while tile < len {
        let j = tile + d;
        if j < len {
            let block = u32::cast_from(meta[table + j / block_size]) as usize;
            let at = ((block * kv_heads + kv_head) * block_size + j % block_size) * dim;
            let mut s = f32::new(0.0);
            for e in 0..dim {
                s += qs[e] * f32::cast_from(keys[at + e]);
            }
            scores[d] = s;
        }
        sync_cube();

        let mut n = len - tile;
        if n > dim {
            n = dim;
        }
        let mut tile_max = max;
        for i in 0..n {
            let s = scores[i];
            if s > tile_max {
                tile_max = s;
            }
        }
        let correction = (max - tile_max).exp();
        sum *= correction;
        acc *= correction;
        for i in 0..n {
            let p = (scores[i] - tile_max).exp();
            let j = tile + i;
            let block = u32::cast_from(meta[table + j / block_size]) as usize;
            let at = ((block * kv_heads + kv_head) * block_size + j % block_size) * dim;
            sum += p;
            acc += p * f32::cast_from(values[at + d]);
        }
        max = tile_max;
        sync_cube();
        tile += dim;
    }
    out[q_at + d] = F::cast_from(acc / sum);
}
