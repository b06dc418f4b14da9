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

/// Byte `at` of little-endian words (ggml's bytes packed four to a word).
#[cube]
fn byte_at<I: Numeric>(words: &Tensor<I>, at: usize) -> u32 {
    (u32::cast_from(words[at / 4]) >> (((at % 4) * 8) as u32)) & 255
}

/// An IEEE half's bits as an f32, exactly (ggml's block scales; never infinite).
#[cube]
fn half_to_f32(bits: u32) -> f32 {
    let exponent = (bits >> 10) & 31;
    let mantissa = bits & 1023;
    let mut value = f32::cast_from(mantissa) * f32::new(5.960_464_5e-8); // 2^-24
    if exponent > 0 {
        // (1024 + m) * 2^e * 2^-25: every factor and product exact in f32.
        value = f32::cast_from(1024 + mantissa)
            * f32::cast_from(1u32 << exponent)
            * f32::new(2.980_232_2e-8); // 2^-25
    }
    if (bits >> 15) == 1 {
        value = -value;
    }
    value
}

/// `x @ W^T` with `W` `[n_out, cols]` in ggml's Q8_0 (`format` 0), Q4_0 (`format` 1) or
/// Q4_1 (`format` 2) blocks, row by row, as words: one unit per output value, which walks its weight row
/// block by block (scale times the block's integer-weighted sum of `x`, in f32). Every
/// output is its own sum in a fixed order: no value depends on another row of `x`.
#[cube(launch)]
pub(crate) fn quantized_matmul_kernel<F: Float, I: Numeric>(
    x: &Tensor<F>,
    words: &Tensor<I>,
    out: &mut Tensor<F>,
    rows: u32,
    n_out: u32,
    cols: u32,
    #[comptime] format: u32,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let o = ABSOLUTE_POS_X as usize;
    let r = ABSOLUTE_POS_Y as usize;
    let (rows, n_out, cols) = (rows as usize, n_out as usize, cols as usize);
    if o >= n_out || r >= rows {
        terminate!();
    }
    let block_bytes = comptime!(match format {
        0 => 34usize,
        1 => 18usize,
        _ => 20usize,
    });
    let blocks = cols / 32;
    let row_at = o * blocks * block_bytes;
    let x_at = r * cols;
    let mut acc = f32::new(0.0);
    for b in 0..blocks {
        let at = row_at + b * block_bytes;
        let scale = half_to_f32(byte_at::<I>(words, at) | (byte_at::<I>(words, at + 1) << 8));
        let mut sum = f32::new(0.0);
        let xb = x_at + b * 32;
        if comptime!(format == 0) {
            for i in 0..32usize {
                let q = byte_at::<I>(words, at + 2 + i);
                let mut v = f32::cast_from(q);
                if q >= 128 {
                    v = f32::cast_from(q) - f32::new(256.0);
                }
                sum += v * f32::cast_from(x[xb + i]);
            }
            acc += scale * sum;
        } else if comptime!(format == 1) {
            for i in 0..16usize {
                let q = byte_at::<I>(words, at + 2 + i);
                let lo = f32::cast_from(q & 15) - f32::new(8.0);
                let hi = f32::cast_from(q >> 4) - f32::new(8.0);
                sum += lo * f32::cast_from(x[xb + i]);
                sum += hi * f32::cast_from(x[xb + 16 + i]);
            }
            acc += scale * sum;
        } else {
            // Q4_1: d * q + m per value.
            let min = half_to_f32(byte_at::<I>(words, at + 2) | (byte_at::<I>(words, at + 3) << 8));
            let mut xs = f32::new(0.0);
            for i in 0..16usize {
                let q = byte_at::<I>(words, at + 4 + i);
                let a = f32::cast_from(x[xb + i]);
                let b = f32::cast_from(x[xb + 16 + i]);
                sum += f32::cast_from(q & 15) * a;
                sum += f32::cast_from(q >> 4) * b;
                xs += a + b;
            }
            acc += scale * sum + min * xs;
        }
    }
    out[r * n_out + o] = F::cast_from(acc);
}
