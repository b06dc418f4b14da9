//! The CubeCL kernels themselves (compiled for CUDA, Vulkan/WGPU and Metal by CubeCL).

use cubecl::prelude::*;

use crate::quant::{IntForm, QuantFormat};

/// The kept format of GPU product code `code` (its row of `quant::QuantFormat`'s table).
fn format_of(code: u32) -> Option<QuantFormat> {
    QuantFormat::ALL.into_iter().find(|f| f.gpu_code() == code)
}

/// Bytes per block of the format of GPU code `code` (a kernel's comptime constant).
fn block_bytes_of(code: u32) -> usize {
    format_of(code).map_or(0, QuantFormat::block_bytes)
}

/// The integer form of the format of GPU code `code` (the `fast` kernel's comptime
/// constants: offset, minimum, run).
fn int_form_of(code: u32) -> IntForm {
    format_of(code).map_or(QuantFormat::Q8_0.int_form(), QuantFormat::int_form)
}

/// Sub-blocks per run (and per block) of the format of GPU code `code`: 8 for the
/// K-quants, 1 for the 32-value formats.
pub(crate) fn run_of(code: u32) -> usize {
    int_form_of(code).run
}

/// Paged attention: one cube per query token and group of query heads that share a
/// key/value head (`heads` of them, the cube's second dimension), one unit per value of
/// a head (`dim` units a head), in the CPU's order and roundings
/// ([`crate::kernels::attention::paged_attention`] on its SIMD paths): each key's score
/// is the dot product of the query and the key in 8 interleaved fused multiply-add sums
/// (value `e` into sum `e % 8`, added `t[l] = s[l] + s[l + 4]`, then `(t0 + t2) + (t1 +
/// t3)`; a plain sum in order when `dim` is not a multiple of 8) times the scale; the
/// largest score; `p = e^(s - max)` with the CPU's [`cpu_exp`]; their sum in 16
/// interleaved sums (the `p` of place `i` among the visible keys into sum `i % 16`),
/// finished `t[l] = s[l] + s[l + 8]` and as the dot product; each value column `sum_i p_i
/// v_i` in two sums (even and odd places, each in key order, products rounded on their
/// own), added, then divided by the sum (rounded to nearest). For `f32` that is the CPU's
/// result bit for bit. Keys are taken `key_tile` at a time (at most `dim`): the cube
/// reads (and decodes) a tile of keys into shared memory once for all its heads, each
/// unit scores one key for its head, then the tile's values the same way; scores are
/// taken twice (once for the maximum, once for the weights: the same bits both times)
/// rather than kept for the whole sequence. No sum's order depends on the tile or on
/// `heads`. A token's result depends on its own sequence only: no value crosses from
/// one cube to another, whatever the batch.
///
/// `meta` is [`PagedBatch::device_table`](crate::model::attention::PagedBatch::device_table)'s
/// layout: per token its table's offset, its position and its first key slot (the tile
/// loop starts there: a left-padded row's keys, in the order of the row alone), then the
/// tables. `zero` is 0 (see [`opaque`]); `native_fma` says whether the device's `fma` is
/// fused.
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
    zero: u32,
    #[comptime] dim: usize,
    #[comptime] heads: usize,
    #[comptime] key_tile: usize,
    #[comptime] native_fma: bool,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    attend_in_cpu_order::<F, I, F>(
        q, keys, values, meta, out, n_heads, groups, kv_heads, block_size, scale, 0, dim as u32, 0,
        dim as u32, zero, dim, heads, key_tile, false, native_fma,
    );
}

/// The body of [`paged_attention_kernel`] and [`paged_attention_encoded_kernel`]: keys and
/// values of `K` (the float type, or encoded words with `encoded`) in rows of `k_words`
/// and `v_words` elements, of type codes `k_ty` and `v_ty` when encoded.
#[cube]
#[allow(clippy::too_many_arguments)]
fn attend_in_cpu_order<F: Float, I: Numeric, K: Numeric>(
    q: &Tensor<F>,
    keys: &Tensor<K>,
    values: &Tensor<K>,
    meta: &Tensor<I>,
    out: &mut Tensor<F>,
    n_heads: u32,
    groups: u32,
    kv_heads: u32,
    block_size: u32,
    scale: f32,
    k_ty: u32,
    k_words: u32,
    v_ty: u32,
    v_words: u32,
    zero: u32,
    #[comptime] dim: usize,
    #[comptime] heads: usize,
    #[comptime] key_tile: usize,
    #[comptime] encoded: bool,
    #[comptime] native: bool,
) {
    let token = CUBE_POS_X as usize;
    let g = UNIT_POS_Y as usize;
    let head = CUBE_POS_Y as usize * heads + g;
    let d = UNIT_POS_X as usize;
    let unit = g * dim + d;
    let n_heads = n_heads as usize;
    let kv_heads = kv_heads as usize;
    let block_size = block_size as usize;
    // The cube's heads share one key/value head (`heads` divides `groups`).
    let kv_head = head / groups as usize;
    let (k_words, v_words) = (k_words as usize, v_words as usize);

    let table = table_at::<I>(meta, token);
    let first = first_key::<I>(meta, token);
    let len = token_position::<I>(meta, token) + 1;

    let mut qs = SharedMemory::<f32>::new(heads * dim);
    // A tile's keys, then its values, as f32: `key_tile` rows of `dim`, read (and
    // decoded) once for the cube's heads.
    let mut kv = SharedMemory::<f32>::new(key_tile * dim);
    // Per head: a tile's largest scores, then its weights `p`.
    let mut ps = SharedMemory::<f32>::new(heads * dim);
    let mut lanes = SharedMemory::<f32>::new(heads * 16usize);
    let mut total = SharedMemory::<f32>::new(heads);
    // `q`'s rows may be a column slice of a wider product: `stride(0)` apart.
    let q_at = token * q.stride(0) + head * dim;
    let out_at = (token * n_heads + head) * dim;
    qs[unit] = f32::cast_from(q[q_at + d]);
    let mut l = d;
    while l < 16usize {
        lanes[g * 16usize + l] = f32::new(0.0);
        l += dim;
    }

    // 1. The largest score. A finite stand-in for minus infinity: WGSL rejects an
    // infinite literal.
    let mut largest = f32::new(-1.0e30);
    let mut tile = first;
    while tile < len {
        sync_cube();
        stage_rows::<I, K>(
            &mut kv,
            keys,
            meta,
            table,
            tile,
            len,
            block_size,
            kv_heads,
            kv_head,
            k_ty,
            k_words,
            unit,
            heads * dim,
            dim,
            key_tile,
            encoded,
        );
        sync_cube();
        let j = tile + d;
        if d < key_tile && j < len {
            let s = cpu_score(&qs, g * dim, &kv, d * dim, scale, zero, dim, native);
            if s > largest {
                largest = s;
            }
        }
        tile += key_tile;
    }
    ps[unit] = largest;
    sync_cube();
    if d == 0 {
        let mut m = ps[g * dim];
        for i in 1..dim {
            if ps[g * dim + i] > m {
                m = ps[g * dim + i];
            }
        }
        total[g] = m;
    }
    sync_cube();
    let max = total[g];

    // 2. The weights, their sum and the weighted values, tile by tile.
    let mut even = f32::new(0.0);
    let mut odd = f32::new(0.0);
    let mut tile = first;
    while tile < len {
        sync_cube();
        stage_rows::<I, K>(
            &mut kv,
            keys,
            meta,
            table,
            tile,
            len,
            block_size,
            kv_heads,
            kv_head,
            k_ty,
            k_words,
            unit,
            heads * dim,
            dim,
            key_tile,
            encoded,
        );
        sync_cube();
        let j = tile + d;
        if d < key_tile && j < len {
            let s = cpu_score(&qs, g * dim, &kv, d * dim, scale, zero, dim, native);
            ps[unit] = cpu_exp(s - max, zero);
        }
        sync_cube();
        stage_rows::<I, K>(
            &mut kv,
            values,
            meta,
            table,
            tile,
            len,
            block_size,
            kv_heads,
            kv_head,
            v_ty,
            v_words,
            unit,
            heads * dim,
            dim,
            key_tile,
            encoded,
        );
        sync_cube();
        let mut n = len - tile;
        if n > key_tile {
            n = key_tile;
        }
        let place = tile - first;
        for i in 0..n {
            let term = product(ps[g * dim + i], kv[i * dim + d], zero);
            if (place + i) % 2usize == 1usize {
                odd = opaque(odd + term, zero);
            } else {
                even = opaque(even + term, zero);
            }
        }
        // Sum `l` takes the weights of places `l`, `l + 16`, ... in order.
        let mut l = d;
        while l < 16usize {
            let mut i = (l + 16usize - place % 16usize) % 16usize;
            let mut s = lanes[g * 16usize + l];
            while i < n {
                s = opaque(s + ps[g * dim + i], zero);
                i += 16usize;
            }
            lanes[g * 16usize + l] = s;
            l += dim;
        }
        tile += key_tile;
    }
    sync_cube();
    if d == 0 {
        let mut t = Array::<f32>::new(8usize);
        #[unroll]
        for l in 0..8usize {
            t[l] = opaque(lanes[g * 16usize + l] + lanes[g * 16usize + l + 8], zero);
        }
        total[g] = finish_eight(&t, zero);
    }
    sync_cube();
    let sum = total[g];
    let mut o = opaque(even + odd, zero);
    if sum > 0.0 {
        o = rounded_div(o, sum, zero, native);
    }
    out[out_at + d] = F::cast_from(o);
}

/// Rows `tile .. tile + key_tile` (those before `len`) of one key/value head of a paged
/// pool into `kv` as f32 (`key_tile` rows of `dim`), each value read (and with `encoded`
/// decoded) once by one of the cube's `units` units, `unit` being this one.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_rows<I: Numeric, K: Numeric>(
    kv: &mut SharedMemory<f32>,
    pool: &Tensor<K>,
    meta: &Tensor<I>,
    table: usize,
    tile: usize,
    len: usize,
    block_size: usize,
    kv_heads: usize,
    kv_head: usize,
    ty: u32,
    words: usize,
    unit: usize,
    units: usize,
    #[comptime] dim: usize,
    #[comptime] key_tile: usize,
    #[comptime] encoded: bool,
) {
    let mut at = unit;
    while at < key_tile * dim {
        let j = tile + at / dim;
        if j < len {
            let block = u32::cast_from(meta[table + j / block_size]) as usize;
            let row = (block * kv_heads + kv_head) * block_size + j % block_size;
            kv[at] = kv_value::<K>(pool, row * words, ty, at % dim, encoded);
        }
        at += units;
    }
}

/// The CPU's final sum of 8 partial sums ([`crate::kernels::cpu`]'s `finish`): `t[l] =
/// s[l] + s[l + 4]`, then `(t0 + t2) + (t1 + t3)`.
#[cube]
fn finish_eight(s: &Array<f32>, zero: u32) -> f32 {
    let t0 = opaque(s[0] + s[4], zero);
    let t1 = opaque(s[1] + s[5], zero);
    let t2 = opaque(s[2] + s[6], zero);
    let t3 = opaque(s[3] + s[7], zero);
    opaque(opaque(t0 + t2, zero) + opaque(t1 + t3, zero), zero)
}

/// Value `e` of the key or value row at element `at` of `pool`: the float itself, or
/// with `encoded` decoded from words of type code `ty` ([`encoded_value`]).
#[cube]
#[allow(unused_assignments)]
fn kv_value<K: Numeric>(
    pool: &Tensor<K>,
    at: usize,
    ty: u32,
    e: usize,
    #[comptime] encoded: bool,
) -> f32 {
    let mut v = f32::new(0.0);
    if comptime!(encoded) {
        v = encoded_value::<K>(pool, ty, at, e);
    } else {
        v = f32::cast_from(pool[at + e]);
    }
    v
}

/// A key's score as the CPU's attention takes it: the dot product of the query at
/// `qs[q_at..]` and the key at `ks[k_at..]` in 8 interleaved fused sums, finished as
/// [`finish_eight`] (in order, each product rounded on its own, when `dim` is not a
/// multiple of 8), times `scale`, rounded on its own.
#[cube]
#[allow(clippy::too_many_arguments, unused_assignments)]
fn cpu_score(
    qs: &SharedMemory<f32>,
    q_at: usize,
    ks: &SharedMemory<f32>,
    k_at: usize,
    scale: f32,
    zero: u32,
    #[comptime] dim: usize,
    #[comptime] native: bool,
) -> f32 {
    let mut dot = f32::new(0.0);
    if comptime!(dim.is_multiple_of(8)) {
        let mut acc = Array::<f32>::new(8usize);
        #[unroll]
        for l in 0..8usize {
            acc[l] = f32::new(0.0);
        }
        for c in 0..dim / 8 {
            #[unroll]
            for l in 0..8usize {
                let e = c * 8usize + l;
                acc[l] = fused_mul_add(qs[q_at + e], ks[k_at + e], acc[l], zero, native);
            }
        }
        dot = finish_eight(&acc, zero);
    } else {
        for e in 0..dim {
            dot = opaque(dot + product(qs[q_at + e], ks[k_at + e], zero), zero);
        }
    }
    product(dot, scale, zero)
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

/// The whole little-endian word `i` (four bytes of ggml's blocks).
#[cube]
fn word_at<I: Numeric>(words: &Tensor<I>, i: usize) -> u32 {
    u32::cast_from(words[i])
}

/// Sub-scale `j` (0..8, 6 bits) of a Q4_K/Q5_K block whose 12 packed scale bytes start at
/// byte `p`.
#[cube]
fn k_scale<I: Numeric>(words: &Tensor<I>, p: usize, j: usize) -> u32 {
    let mut v = byte_at::<I>(words, p + j) & 63;
    if j >= 4 {
        v = (byte_at::<I>(words, p + j + 4) & 15) | ((byte_at::<I>(words, p + j - 4) >> 6) << 4);
    }
    v
}

/// Sub-minimum `j` (0..8, 6 bits) of a Q4_K/Q5_K block, as [`k_scale`].
#[cube]
fn k_min<I: Numeric>(words: &Tensor<I>, p: usize, j: usize) -> u32 {
    let mut v = byte_at::<I>(words, p + j + 4) & 63;
    if j >= 4 {
        v = (byte_at::<I>(words, p + j + 4) >> 4) | ((byte_at::<I>(words, p + j) >> 6) << 4);
    }
    v
}

/// A signed byte's value.
#[cube]
fn signed_byte(b: u32) -> f32 {
    let mut v = f32::cast_from(b);
    if b >= 128 {
        v = f32::cast_from(b) - f32::new(256.0);
    }
    v
}

/// `x @ W^T` with `W` `[n_out, cols]` in ggml's blocks, row by row, as words: Q8_0
/// (`format` 0), Q4_0 (1), Q4_1 (2), Q4_K (3), Q6_K (4), Q5_K (5), Q5_0 (6), Q5_1 (7)
/// or Q3_K (8).
///
/// `lanes` units (a comptime power of two, chosen from the weight's shape alone, never
/// from the batch: [`super::quant_lanes`]) share each output value and tile of `tile` rows
/// of `x` (a comptime 1 for decode, more for prompts): lane `l` walks blocks `l`, `l +
/// lanes`, ... of the weight row, decodes each weight once and multiplies it into every
/// row of its tile (each scale times its sub-block's integer-weighted sum of `x`, a
/// minimum times the sub-block's sum of `x`, in f32), and the first lane adds the lanes'
/// sums in lane order. The weights are read once per tile rather than once per row, and a
/// row's length is walked by `lanes` units at once (a decode step of one row has only
/// `n_out` outputs to spread over the GPU). A cube is [`QUANT_OUTPUTS`] outputs along x
/// (the units of a warp: they read the same values of `x` at once) by `lanes` along y.
/// Each row keeps its own sums, built by the same operations in the same order whatever
/// the tile size: every output is its own sum, and no value depends on another row of
/// `x`. The rows past the end of the last tile repeat the last row and are never stored;
/// so are the outputs past `n_out` in the last cube.
///
/// With `pair` (the feed-forward's gate and up projections, `words` and `up` of the same
/// format and shape) each unit computes both products of its output the same way and
/// stores `silu(gate) * up` as the CPU computes it ([`cpu_swiglu`]): SwiGLU in the
/// product's epilogue, one launch for three operations. Without it `up` is not read.
/// `zero` is 0 (see [`opaque`]); `native_fma` says whether the device's `fma` is fused.
///
/// With `second` (a format code, else [`NO_SECOND`]), `up` is a second matrix of that
/// format and `n_second` outputs (the values beside the queries and keys, say), computed
/// in the same launch: the cubes past the first matrix's take the second's, each output
/// by the same steps as in a launch of its own, stored after the first's `n_out` outputs
/// in rows of `n_out + n_second`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn quantized_matmul_kernel<F: Float, I: Numeric>(
    x: &Tensor<F>,
    words: &Tensor<I>,
    up: &Tensor<I>,
    out: &mut Tensor<F>,
    rows: u32,
    n_out: u32,
    n_second: u32,
    cols: u32,
    zero: u32,
    #[comptime] format: u32,
    #[comptime] second: u32,
    #[comptime] tile: usize,
    #[comptime] lanes: usize,
    #[comptime] pair: bool,
    #[comptime] native_fma: bool,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let (rows, n_out, n_second, cols) = (
        rows as usize,
        n_out as usize,
        n_second as usize,
        cols as usize,
    );
    let width = n_out + n_second;
    let cube = CUBE_POS_X as usize;
    if comptime!(second == NO_SECOND) {
        quantized_product::<F, I>(
            x, words, up, out, rows, n_out, cols, cube, width, 0, zero, format, tile, lanes, pair,
            native_fma,
        );
    } else {
        let cubes = n_out.div_ceil(QUANT_OUTPUTS);
        if cube < cubes {
            quantized_product::<F, I>(
                x, words, up, out, rows, n_out, cols, cube, width, 0, zero, format, tile, lanes,
                false, native_fma,
            );
        } else {
            quantized_product::<F, I>(
                x,
                up,
                up,
                out,
                rows,
                n_second,
                cols,
                cube - cubes,
                width,
                n_out,
                zero,
                second,
                tile,
                lanes,
                false,
                native_fma,
            );
        }
    }
}

/// No second matrix in a product launch (see [`quantized_matmul_kernel`]).
pub(crate) const NO_SECOND: u32 = u32::MAX;

/// One matrix's part of [`quantized_matmul_kernel`]: its cube `cube` (along the outputs),
/// outputs stored at `out_offset` in rows of `width`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn quantized_product<F: Float, I: Numeric>(
    x: &Tensor<F>,
    words: &Tensor<I>,
    up: &Tensor<I>,
    out: &mut Tensor<F>,
    rows: usize,
    n_out: usize,
    cols: usize,
    cube: usize,
    width: usize,
    out_offset: usize,
    zero: u32,
    #[comptime] format: u32,
    #[comptime] tile: usize,
    #[comptime] lanes: usize,
    #[comptime] pair: bool,
    #[comptime] native_fma: bool,
) {
    let lane = UNIT_POS_Y as usize;
    let column = UNIT_POS_X as usize;
    let wanted = cube * QUANT_OUTPUTS + column;
    let r0 = CUBE_POS_Y as usize * tile;
    // Every unit reaches the barrier below: one past the outputs works on the last one
    // and stores nothing.
    let live = wanted < n_out;
    let o = select(live, wanted, n_out - 1);
    let block_bytes = comptime!(block_bytes_of(format));
    let k_quant = comptime!(matches!(format, 3 | 4 | 5 | 8));
    let block_values = comptime!(if k_quant { 256usize } else { 32usize });
    let blocks = cols / block_values;
    let row_at = o * blocks * block_bytes;
    // Where each row of the tile starts in `x`.
    let mut x_at = Array::<u32>::new(tile);
    let mut acc = Array::<f32>::new(tile);
    let mut acc_up = Array::<f32>::new(tile);
    #[unroll]
    for t in 0..tile {
        let mut r = r0 + t;
        if r >= rows {
            r = rows - 1;
        }
        x_at[t] = (r * cols) as u32;
        acc[t] = f32::new(0.0);
        acc_up[t] = f32::new(0.0);
    }
    let mut b = lane;
    while b < blocks {
        let at = row_at + b * block_bytes;
        let xb = b * block_values;
        if comptime!(k_quant) {
            k_block::<F, I>(x, words, at, &x_at, xb, &mut acc, format, tile);
            if comptime!(pair) {
                k_block::<F, I>(x, up, at, &x_at, xb, &mut acc_up, format, tile);
            }
        } else {
            small_block::<F, I>(x, words, at, &x_at, xb, &mut acc, format, tile);
            if comptime!(pair) {
                small_block::<F, I>(x, up, at, &x_at, xb, &mut acc_up, format, tile);
            }
        }
        b += lanes;
    }
    // The lanes' sums, added in lane order by the first lane.
    let stride = comptime!(QUANT_OUTPUTS * lanes * tile);
    let mut sums = SharedMemory::<f32>::new(comptime!(
        (if pair { 2 } else { 1 }) * QUANT_OUTPUTS * lanes * tile
    ));
    #[unroll]
    for t in 0..tile {
        sums[(lane * QUANT_OUTPUTS + column) * tile + t] = acc[t];
        if comptime!(pair) {
            sums[stride + (lane * QUANT_OUTPUTS + column) * tile + t] = acc_up[t];
        }
    }
    sync_cube();
    if lane == 0 && live {
        #[unroll]
        for t in 0..tile {
            if r0 + t < rows {
                let mut total = f32::new(0.0);
                for l in 0..lanes {
                    total += sums[(l * QUANT_OUTPUTS + column) * tile + t];
                }
                if comptime!(pair) {
                    let mut total_up = f32::new(0.0);
                    for l in 0..lanes {
                        total_up += sums[stride + (l * QUANT_OUTPUTS + column) * tile + t];
                    }
                    total = cpu_swiglu(total, total_up, zero, native_fma);
                }
                out[(r0 + t) * width + out_offset + o] = F::cast_from(total);
            }
        }
    }
}

/// Outputs per cube of [`quantized_matmul_kernel`] (along x; its lanes along y).
pub(crate) const QUANT_OUTPUTS: usize = 32;

/// `x @ W` for a dense `W` in the backend's float type: `[cols, n_out]` row-major, or
/// with `transposed` `[n_out, cols]` (the output head's `[vocab, d_model]` table). One
/// unit per output value and tile of `tile` rows of `x`, as in
/// [`quantized_matmul_kernel`]: each weight is read once per tile and multiplied into
/// every row's own f32 sum over `cols` in order, so a row's outputs are the same at every
/// tile size and in any batch (Burn's matmul picks its tiling, and so its sums' order,
/// by the batch's shape). Untransposed, the units of a cube read adjacent weights.
#[cube(launch)]
pub(crate) fn dense_matmul_kernel<F: Float>(
    x: &Tensor<F>,
    w: &Tensor<F>,
    out: &mut Tensor<F>,
    rows: u32,
    n_out: u32,
    cols: u32,
    #[comptime] transposed: bool,
    #[comptime] tile: usize,
    #[define(F)] _dtype: StorageType,
) {
    let o = ABSOLUTE_POS_X as usize;
    let r0 = ABSOLUTE_POS_Y as usize * tile;
    let (rows, n_out, cols) = (rows as usize, n_out as usize, cols as usize);
    if o >= n_out || r0 >= rows {
        terminate!();
    }
    let mut x_at = Array::<u32>::new(tile);
    let mut acc = Array::<f32>::new(tile);
    #[unroll]
    for t in 0..tile {
        let mut r = r0 + t;
        if r >= rows {
            r = rows - 1;
        }
        x_at[t] = (r * cols) as u32;
        acc[t] = f32::new(0.0);
    }
    for c in 0..cols {
        let mut at = c * n_out + o;
        if comptime!(transposed) {
            at = o * cols + c;
        }
        let v = f32::cast_from(w[at]);
        #[unroll]
        for t in 0..tile {
            acc[t] += v * x_value::<F>(x, &x_at, t, c, 0);
        }
    }
    #[unroll]
    for t in 0..tile {
        if r0 + t < rows {
            out[(r0 + t) * n_out + o] = F::cast_from(acc[t]);
        }
    }
}

/// Value `i` of the tile's row `t`, from its block starting at `xb`, as f32.
#[cube]
fn x_value<F: Float>(x: &Tensor<F>, x_at: &Array<u32>, t: usize, xb: usize, i: usize) -> f32 {
    f32::cast_from(x[x_at[t] as usize + xb + i])
}

/// One 32-value block of Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1 at byte `at` times each row's
/// `x[xb..xb + 32]`, added to the row's `acc`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn small_block<F: Float, I: Numeric>(
    x: &Tensor<F>,
    words: &Tensor<I>,
    at: usize,
    x_at: &Array<u32>,
    xb: usize,
    acc: &mut Array<f32>,
    #[comptime] format: u32,
    #[comptime] tile: usize,
) {
    let scale = half_to_f32(byte_at::<I>(words, at) | (byte_at::<I>(words, at + 1) << 8));
    let mut sum = Array::<f32>::new(tile);
    let mut xs = Array::<f32>::new(tile);
    #[unroll]
    for t in 0..tile {
        sum[t] = f32::new(0.0);
        xs[t] = f32::new(0.0);
    }
    // The values' bytes are read four at a time ([`bytes4_at`]), each value's arithmetic
    // in the same order as one at a time.
    if comptime!(format == 0) {
        for w in 0..8usize {
            let four = bytes4_at::<I>(words, at + 2 + 4 * w);
            #[unroll]
            for j in 0..4usize {
                let q = (four >> ((8 * j) as u32)) & 255;
                let mut v = f32::cast_from(q);
                if q >= 128 {
                    v = f32::cast_from(q) - f32::new(256.0);
                }
                #[unroll]
                for t in 0..tile {
                    sum[t] += v * x_value::<F>(x, x_at, t, xb, 4 * w + j);
                }
            }
        }
        #[unroll]
        for t in 0..tile {
            acc[t] += scale * sum[t];
        }
    } else if comptime!(format == 1) {
        for w in 0..4usize {
            let four = bytes4_at::<I>(words, at + 2 + 4 * w);
            #[unroll]
            for j in 0..4usize {
                let i = 4 * w + j;
                let q = (four >> ((8 * j) as u32)) & 255;
                let lo = f32::cast_from(q & 15) - f32::new(8.0);
                let hi = f32::cast_from(q >> 4) - f32::new(8.0);
                #[unroll]
                for t in 0..tile {
                    sum[t] += lo * x_value::<F>(x, x_at, t, xb, i);
                    sum[t] += hi * x_value::<F>(x, x_at, t, xb, 16 + i);
                }
            }
        }
        #[unroll]
        for t in 0..tile {
            acc[t] += scale * sum[t];
        }
    } else {
        // Q4_1 (2: d, m, nibbles), Q5_0 (6: d, 32 fifth bits, nibbles; values offset by
        // 16) and Q5_1 (7: d, m, fifth bits, nibbles): with a minimum, `d * q + m` per
        // value. One loop: Q4_1 is Q5_1 without the fifth bits.
        let fifth = comptime!(format == 6 || format == 7);
        let has_min = comptime!(format != 6);
        let head = comptime!(if format == 6 { 2usize } else { 4usize });
        let nibbles = comptime!(if fifth { head + 4 } else { head });
        let mut qh = 0u32;
        if comptime!(fifth) {
            qh = bytes4_at::<I>(words, at + head);
        }
        let mut min = f32::new(0.0);
        if comptime!(has_min) {
            min = half_to_f32(byte_at::<I>(words, at + 2) | (byte_at::<I>(words, at + 3) << 8));
        }
        for w in 0..4usize {
            let four = bytes4_at::<I>(words, at + nibbles + 4 * w);
            #[unroll]
            for j in 0..4usize {
                let i = 4 * w + j;
                let q = (four >> ((8 * j) as u32)) & 255;
                let mut lo_bits = q & 15;
                let mut hi_bits = q >> 4;
                if comptime!(fifth) {
                    lo_bits |= ((qh >> (i as u32)) << 4) & 16;
                    hi_bits |= (qh >> ((i + 12) as u32)) & 16;
                }
                let mut lo = f32::cast_from(lo_bits);
                let mut hi = f32::cast_from(hi_bits);
                if comptime!(format == 6) {
                    lo -= f32::new(16.0);
                    hi -= f32::new(16.0);
                }
                #[unroll]
                for t in 0..tile {
                    let a = x_value::<F>(x, x_at, t, xb, i);
                    let b = x_value::<F>(x, x_at, t, xb, 16 + i);
                    sum[t] += lo * a;
                    sum[t] += hi * b;
                    if comptime!(has_min) {
                        xs[t] += a + b;
                    }
                }
            }
        }
        #[unroll]
        for t in 0..tile {
            if comptime!(has_min) {
                acc[t] += scale * sum[t] + min * xs[t];
            } else {
                acc[t] += scale * sum[t];
            }
        }
    }
}

/// One 256-value block of Q4_K (`format` 3), Q6_K (4), Q5_K (5) or Q3_K (8) at byte `at` times
/// each row's `x[xb..xb + 256]`, added to the row's `acc`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn k_block<F: Float, I: Numeric>(
    x: &Tensor<F>,
    words: &Tensor<I>,
    at: usize,
    x_at: &Array<u32>,
    xb: usize,
    acc: &mut Array<f32>,
    #[comptime] format: u32,
    #[comptime] tile: usize,
) {
    // The block's own sum per row, added to `acc` at the end (as one value per block).
    let mut blk = Array::<f32>::new(tile);
    #[unroll]
    for t in 0..tile {
        blk[t] = f32::new(0.0);
    }
    if comptime!(format == 8) {
        // Q3_K: hmask [32] (the third bits), qs [64] (two bits per value), twelve bytes of
        // sixteen 6-bit scales offset by 32, d; values 3 bits offset by 4, one scale per
        // 16 values. Value `128 n + 32 j + l` (l < 32) is bits `2 j` of qs[32 n + l] and
        // bit `4 n + j` of hmask[l].
        let d = half_to_f32(byte_at::<I>(words, at + 108) | (byte_at::<I>(words, at + 109) << 8));
        for n in 0..2usize {
            for j in 0..4usize {
                let shift = (2 * j) as u32;
                let mask = 1u32 << ((4 * n + j) as u32);
                for h in 0..2usize {
                    let is = 8 * n + 2 * j + h;
                    let low = select(
                        is < 8,
                        byte_at::<I>(words, at + 96 + is) & 15,
                        byte_at::<I>(words, at + 96 + is - 8) >> 4,
                    );
                    let high =
                        (byte_at::<I>(words, at + 104 + is % 4) >> ((2 * (is / 4)) as u32)) & 3;
                    let dl = d * (f32::cast_from(low | (high << 4)) - f32::new(32.0));
                    let mut s = Array::<f32>::new(tile);
                    #[unroll]
                    for t in 0..tile {
                        s[t] = f32::new(0.0);
                    }
                    for lw in 0..4usize {
                        let twos = bytes4_at::<I>(words, at + 32 + 32 * n + 16 * h + 4 * lw);
                        let marks = bytes4_at::<I>(words, at + 16 * h + 4 * lw);
                        #[unroll]
                        for b in 0..4usize {
                            let idx = 16 * h + 4 * lw + b;
                            let byte_shift = (8 * b) as u32;
                            let two = ((twos >> byte_shift) >> shift) & 3;
                            let mut v = f32::cast_from(two);
                            if ((marks >> byte_shift) & mask) == 0 {
                                v -= f32::new(4.0);
                            }
                            #[unroll]
                            for t in 0..tile {
                                s[t] += v * x_value::<F>(x, x_at, t, xb, 128 * n + 32 * j + idx);
                            }
                        }
                    }
                    #[unroll]
                    for t in 0..tile {
                        blk[t] += dl * s[t];
                    }
                }
            }
        }
    } else if comptime!(format == 4) {
        // Q6_K: ql [128], qh [64], sixteen signed scales, d; values 6 bits offset by 32,
        // one scale per 16 values.
        let d = half_to_f32(byte_at::<I>(words, at + 208) | (byte_at::<I>(words, at + 209) << 8));
        for half in 0..2usize {
            let ql = at + 64 * half;
            let qh = at + 128 + 32 * half;
            let sc = at + 192 + 8 * half;
            let xh = xb + 128 * half;
            for is in 0..2usize {
                let mut s1 = Array::<f32>::new(tile);
                let mut s2 = Array::<f32>::new(tile);
                let mut s3 = Array::<f32>::new(tile);
                let mut s4 = Array::<f32>::new(tile);
                #[unroll]
                for t in 0..tile {
                    s1[t] = f32::new(0.0);
                    s2[t] = f32::new(0.0);
                    s3[t] = f32::new(0.0);
                    s4[t] = f32::new(0.0);
                }
                for kw in 0..4usize {
                    let l0 = is * 16 + 4 * kw;
                    let hs = bytes4_at::<I>(words, qh + l0);
                    let lows = bytes4_at::<I>(words, ql + l0);
                    let highs = bytes4_at::<I>(words, ql + l0 + 32);
                    #[unroll]
                    for b in 0..4usize {
                        let l = l0 + b;
                        let byte_shift = (8 * b) as u32;
                        let h = (hs >> byte_shift) & 255;
                        let a = (lows >> byte_shift) & 255;
                        let c = (highs >> byte_shift) & 255;
                        let q1 = f32::cast_from((a & 15) | ((h & 3) << 4)) - f32::new(32.0);
                        let q2 = f32::cast_from((c & 15) | (((h >> 2) & 3) << 4)) - f32::new(32.0);
                        let q3 = f32::cast_from((a >> 4) | (((h >> 4) & 3) << 4)) - f32::new(32.0);
                        let q4 = f32::cast_from((c >> 4) | (((h >> 6) & 3) << 4)) - f32::new(32.0);
                        #[unroll]
                        for t in 0..tile {
                            s1[t] += q1 * x_value::<F>(x, x_at, t, xh, l);
                            s2[t] += q2 * x_value::<F>(x, x_at, t, xh, l + 32);
                            s3[t] += q3 * x_value::<F>(x, x_at, t, xh, l + 64);
                            s4[t] += q4 * x_value::<F>(x, x_at, t, xh, l + 96);
                        }
                    }
                }
                let c1 = signed_byte(byte_at::<I>(words, sc + is));
                let c2 = signed_byte(byte_at::<I>(words, sc + is + 2));
                let c3 = signed_byte(byte_at::<I>(words, sc + is + 4));
                let c4 = signed_byte(byte_at::<I>(words, sc + is + 6));
                #[unroll]
                for t in 0..tile {
                    let sum = c1 * s1[t] + c2 * s2[t] + c3 * s3[t] + c4 * s4[t];
                    blk[t] += d * sum;
                }
            }
        }
    } else {
        // Q4_K / Q5_K: d, dmin, twelve bytes of 6-bit sub-scales and minimums, (Q5_K:
        // 32 bytes of fifth bits,) 128 bytes of nibbles: four chunks of 32 bytes, each two
        // 32-value groups (low nibbles, then high nibbles). Blocks are whole words (144
        // and 176 bytes), so the nibbles are read a word at a time.
        let d = half_to_f32(byte_at::<I>(words, at) | (byte_at::<I>(words, at + 1) << 8));
        let dmin = half_to_f32(byte_at::<I>(words, at + 2) | (byte_at::<I>(words, at + 3) << 8));
        let qs = comptime!(if format == 5 { 48usize } else { 16usize });
        for chunk in 0..4usize {
            let mut s_lo = Array::<f32>::new(tile);
            let mut s_hi = Array::<f32>::new(tile);
            let mut x_lo = Array::<f32>::new(tile);
            let mut x_hi = Array::<f32>::new(tile);
            #[unroll]
            for t in 0..tile {
                s_lo[t] = f32::new(0.0);
                s_hi[t] = f32::new(0.0);
                x_lo[t] = f32::new(0.0);
                x_hi[t] = f32::new(0.0);
            }
            let xc = xb + 64 * chunk;
            for w in 0..8usize {
                let q = word_at::<I>(words, (at + qs + 32 * chunk) / 4 + w);
                let mut hb = 0u32;
                if comptime!(format == 5) {
                    hb = word_at::<I>(words, (at + 16) / 4 + w);
                }
                for k in 0..4usize {
                    let byte = (q >> ((k * 8) as u32)) & 255;
                    let mut lo = byte & 15;
                    let mut hi = byte >> 4;
                    if comptime!(format == 5) {
                        let h = (hb >> ((k * 8) as u32)) >> ((2 * chunk) as u32);
                        lo += (h & 1) << 4;
                        hi += ((h >> 1) & 1) << 4;
                    }
                    let (lo, hi) = (f32::cast_from(lo), f32::cast_from(hi));
                    #[unroll]
                    for t in 0..tile {
                        let a = x_value::<F>(x, x_at, t, xc, 4 * w + k);
                        let c = x_value::<F>(x, x_at, t, xc, 32 + 4 * w + k);
                        s_lo[t] += lo * a;
                        s_hi[t] += hi * c;
                        x_lo[t] += a;
                        x_hi[t] += c;
                    }
                }
            }
            let p = at + 4;
            let j = 2 * chunk;
            let (sc_lo, m_lo) = (
                d * f32::cast_from(k_scale::<I>(words, p, j)),
                dmin * f32::cast_from(k_min::<I>(words, p, j)),
            );
            let (sc_hi, m_hi) = (
                d * f32::cast_from(k_scale::<I>(words, p, j + 1)),
                dmin * f32::cast_from(k_min::<I>(words, p, j + 1)),
            );
            #[unroll]
            for t in 0..tile {
                blk[t] += sc_lo * s_lo[t] - m_lo * x_lo[t];
                blk[t] += sc_hi * s_hi[t] - m_hi * x_hi[t];
            }
        }
    }
    #[unroll]
    for t in 0..tile {
        acc[t] += blk[t];
    }
}

/// An f16 of the weights at byte `at`.
#[cube]
fn half_at<I: Numeric>(words: &Tensor<I>, at: usize) -> f32 {
    half_to_f32(byte_at::<I>(words, at) | (byte_at::<I>(words, at + 1) << 8))
}

/// Four bytes from byte `at` of little-endian words, as one little-endian word (byte
/// `at + j` in bits `8 j..8 j + 8`), at any alignment: one load, or two where they
/// straddle a word (the next word then exists).
#[cube]
fn bytes4_at<I: Numeric>(words: &Tensor<I>, at: usize) -> u32 {
    let low = u32::cast_from(words[at / 4]);
    let shift = ((at % 4) * 8) as u32;
    let mut out = low;
    if shift != 0 {
        out = (low >> shift) | (u32::cast_from(words[at / 4 + 1]) << (32 - shift));
    }
    out
}

/// Values `k..k + 4` (`k` a multiple of 4 below 32) of sub-block `s` of the block at
/// byte `at`, in the format's integer form (`quant::int_form`: the value plus the
/// format's offset, 0..=255), one a byte (value `k + j` in bits `8 j..8 j + 8`). Every
/// format keeps four consecutive values' bits in four consecutive bytes, so one or two
/// word loads serve four values.
#[cube]
#[allow(unused_assignments)]
fn int_values4<I: Numeric>(
    words: &Tensor<I>,
    at: usize,
    s: usize,
    k: usize,
    #[comptime] format: u32,
) -> u32 {
    let nibbles = 0x0F0F_0F0Fu32;
    let mut u = 0u32;
    if comptime!(format == 0) {
        u = bytes4_at::<I>(words, at + 2 + k) ^ 0x8080_8080u32;
    } else if comptime!(format == 1 || format == 2) {
        let head = comptime!(if format == 1 { 2usize } else { 4usize });
        let b = bytes4_at::<I>(words, at + head + k % 16);
        u = select(k < 16, b & nibbles, (b >> 4) & nibbles);
    } else if comptime!(format == 6 || format == 7) {
        let head = comptime!(if format == 6 { 2usize } else { 4usize });
        let b = bytes4_at::<I>(words, at + head + 4 + k % 16);
        let low = select(k < 16, b & nibbles, (b >> 4) & nibbles);
        // The four fifth bits, one to each byte's bit 4.
        let h = (byte_at::<I>(words, at + head + k / 8) >> ((k % 8) as u32)) & 15;
        u = low | ((h & 1) << 4) | ((h & 2) << 11) | ((h & 4) << 18) | ((h & 8) << 25);
    } else if comptime!(format == 3 || format == 5) {
        let qs = comptime!(if format == 5 { 48usize } else { 16usize });
        let b = bytes4_at::<I>(words, at + qs + 32 * (s / 2) + k);
        u = select(s % 2 == 1, (b >> 4) & nibbles, b & nibbles);
        if comptime!(format == 5) {
            let high = bytes4_at::<I>(words, at + 16 + k);
            u |= ((high >> (s as u32)) & 0x0101_0101u32) << 4;
        }
    } else if comptime!(format == 4) {
        let (half, j) = (s / 4, s % 4);
        let low = bytes4_at::<I>(words, at + 64 * half + k + 32 * (j % 2));
        let low = select(j < 2, low & nibbles, (low >> 4) & nibbles);
        let qh = bytes4_at::<I>(words, at + 128 + 32 * half + k);
        u = low | (((qh >> ((2 * j) as u32)) & 0x0303_0303u32) << 4);
    } else {
        let (half, pass) = (s / 4, s % 4);
        let low = (bytes4_at::<I>(words, at + 32 + 32 * half + k) >> ((2 * pass) as u32))
            & 0x0303_0303u32;
        let high = (bytes4_at::<I>(words, at + k) >> ((4 * half + pass) as u32)) & 0x0101_0101u32;
        u = low | (high << 2);
    }
    u
}

/// The integer scale of half `h` of sub-block `s` of the block at byte `at`.
#[cube]
fn int_scale<I: Numeric>(
    words: &Tensor<I>,
    at: usize,
    s: usize,
    h: usize,
    #[comptime] format: u32,
) -> i32 {
    let mut sc = 1i32;
    if comptime!(format == 3 || format == 5) {
        sc = i32::cast_from(k_scale::<I>(words, at + 4, s));
    } else if comptime!(format == 4) {
        let b = byte_at::<I>(words, at + 192 + 8 * (s / 4) + 2 * (s % 4) + h);
        sc = i32::cast_from(b) - select(b >= 128, 256i32, 0i32);
    } else if comptime!(format == 8) {
        let i = 2 * s + h;
        let low = select(
            i < 8,
            byte_at::<I>(words, at + 96 + i) & 15,
            byte_at::<I>(words, at + 96 + i % 8) >> 4,
        );
        let high = (byte_at::<I>(words, at + 104 + i % 4) >> ((2 * (i / 4)) as u32)) & 3;
        sc = i32::cast_from(low | (high << 4)) - 32;
    }
    sc
}

/// The float scale `d` of the block at byte `at`.
#[cube]
#[allow(unused_assignments)]
fn int_d<I: Numeric>(words: &Tensor<I>, at: usize, #[comptime] format: u32) -> f32 {
    let mut d = f32::new(0.0);
    if comptime!(format == 4) {
        d = half_at::<I>(words, at + 208);
    } else if comptime!(format == 8) {
        d = half_at::<I>(words, at + 108);
    } else {
        d = half_at::<I>(words, at);
    }
    d
}

/// The coefficient `m` of the activations' sum for sub-block `s` of the block at byte
/// `at` (formats with a minimum: Q4_1, Q5_1, Q4_K, Q5_K).
#[cube]
#[allow(unused_assignments)]
fn int_m<I: Numeric>(words: &Tensor<I>, at: usize, s: usize, #[comptime] format: u32) -> f32 {
    let mut m = f32::new(0.0);
    if comptime!(format == 3 || format == 5) {
        m = -(half_at::<I>(words, at + 2) * f32::cast_from(k_min::<I>(words, at + 4, s)));
    } else {
        m = half_at::<I>(words, at + 2);
    }
    m
}

/// Words of [`stage_activations`]'s staged values per 32-value sub-block: four 8-bit
/// values a word.
const STAGED_WORDS: usize = 8;

/// Quantizes a chunk's activations once for the whole cube, into `staged`: lane `lane`'s
/// block (values `xb..` of each tile row, `rows` and `r0` as [`int_product`]'s) for
/// every row of the tile, by the CPU's rule with the run's inverse scale (`scales[2
/// (first + t) + 1]`): `q = round(v / d)`, halves away from zero, stored as `q + 128`
/// (1 to 255) four to a word, sub-block `s`'s words of row `t` at `((first + t) * subs +
/// s) * STAGED_WORDS`. The lane's 32 units take a word each in turn, so every value is
/// quantized once, where each unit quantized every value of its block for itself before;
/// the values are the same integers. Nothing is staged for a block past the row's end.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_activations<F: Float>(
    x: &Tensor<F>,
    extra: &Tensor<F>,
    invs: &SharedMemory<f32>,
    rows: usize,
    cols: usize,
    r0: usize,
    xb: usize,
    live_block: bool,
    scales: &SharedMemory<f32>,
    staged: &mut SharedMemory<u32>,
    first: usize,
    zero: u32,
    #[comptime] format: u32,
    #[comptime] tile: usize,
    #[comptime] io: u32,
) {
    let row_words = comptime!(run_of(format) * STAGED_WORDS);
    if live_block {
        let mut k = UNIT_POS_X as usize;
        while k < comptime!(tile * run_of(format) * STAGED_WORDS) {
            let t = k / row_words;
            let w = k % row_words;
            let mut r = r0 + t;
            if r >= rows {
                r = rows - 1;
            }
            let id = scales[2 * (first + t) + 1];
            let mut word = 0u32;
            #[unroll]
            for j in 0..4usize {
                let v = input_value::<F>(x, extra, invs, r * cols, t, xb + 4 * w + j, zero, io);
                let q = activation_code(v, id);
                word |= u32::cast_from(q + 128i32) << ((8 * j) as u32);
            }
            staged[(first + t) * row_words + w] = word;
            k += QUANT_OUTPUTS;
        }
    }
}

/// Each staged sub-block's sum of `q` into `qsums[(first + t) * subs + s]`, for the
/// formats with a minimum (their float steps need it), from [`stage_activations`]'s
/// words: the cube's units take a sub-block each in turn. Exact integers.
#[cube]
fn stage_q_sums(
    staged: &SharedMemory<u32>,
    qsums: &mut SharedMemory<i32>,
    #[comptime] format: u32,
    #[comptime] tile: usize,
    #[comptime] lanes: usize,
) {
    let mut k = UNIT_POS_Y as usize * QUANT_OUTPUTS + UNIT_POS_X as usize;
    while k < comptime!(lanes * tile * run_of(format)) {
        let mut total = 0i32;
        for w in 0..STAGED_WORDS {
            let word = staged[k * STAGED_WORDS + w];
            total += i32::cast_from(word & 255u32)
                + i32::cast_from((word >> 8u32) & 255u32)
                + i32::cast_from((word >> 16u32) & 255u32)
                + i32::cast_from(word >> 24u32);
        }
        // Each of the 32 values was stored as q + 128.
        qsums[k] = total - 4096i32;
        k += comptime!(QUANT_OUTPUTS * lanes);
    }
}

/// The integer sum of one weight block (at byte `at`) times each tile row's activations
/// as [`stage_activations`] staged them (row `t`'s at `first + t`): over its sub-blocks
/// `s` and halves `h`, `sc * (sum of u * q - offset * sum of q)`, computed as `sc * (sum
/// of (u - offset) * (q + 128) - 128 * sum of (u - offset))` (the same integer), exact in
/// 32 bits, as f32 (`isum as f32`, the CPU's conversion), into `sums[t]`. With `pair`, the
/// block at the same byte of `up` (a matrix of the same format) is multiplied by the same
/// quantized values into `sums_up[t]`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn int_block<I: Numeric>(
    words: &Tensor<I>,
    up: &Tensor<I>,
    at: usize,
    staged: &SharedMemory<u32>,
    first: usize,
    sums: &mut Array<f32>,
    sums_up: &mut Array<f32>,
    #[comptime] format: u32,
    #[comptime] tile: usize,
    #[comptime] pair: bool,
) {
    let subs = comptime!(run_of(format));
    let offset = comptime!(int_form_of(format).offset);
    let row_words = comptime!(run_of(format) * STAGED_WORDS);
    let mut isum = Array::<i32>::new(tile);
    let mut isum_up = Array::<i32>::new(tile);
    #[unroll]
    for t in 0..tile {
        isum[t] = 0i32;
        isum_up[t] = 0i32;
    }
    for s in 0..subs {
        #[unroll]
        for h in 0..2usize {
            let sc = int_scale::<I>(words, at, s, h, format);
            let mut sc_up = 0i32;
            if comptime!(pair) {
                sc_up = int_scale::<I>(up, at, s, h, format);
            }
            let mut dot = Array::<i32>::new(tile);
            let mut dot_up = Array::<i32>::new(tile);
            #[unroll]
            for t in 0..tile {
                dot[t] = 0i32;
                dot_up[t] = 0i32;
            }
            let mut u_sum = 0i32;
            let mut u_sum_up = 0i32;
            for w in 0..4usize {
                let mut packed = Array::<u32>::new(tile);
                #[unroll]
                for t in 0..tile {
                    packed[t] = staged[(first + t) * row_words + s * STAGED_WORDS + 4 * h + w];
                }
                let k = 16 * h + 4 * w;
                let values = int_values4::<I>(words, at, s, k, format);
                let mut values_up = 0u32;
                if comptime!(pair) {
                    values_up = int_values4::<I>(up, at, s, k, format);
                }
                #[unroll]
                for j in 0..4usize {
                    let shift = (8 * j) as u32;
                    let u = i32::cast_from((values >> shift) & 255u32) - offset;
                    u_sum += u;
                    let mut u_up = 0i32;
                    if comptime!(pair) {
                        u_up = i32::cast_from((values_up >> shift) & 255u32) - offset;
                        u_sum_up += u_up;
                    }
                    #[unroll]
                    for t in 0..tile {
                        let b = i32::cast_from((packed[t] >> shift) & 255u32);
                        dot[t] += u * b;
                        if comptime!(pair) {
                            dot_up[t] += u_up * b;
                        }
                    }
                }
            }
            #[unroll]
            for t in 0..tile {
                isum[t] += sc * (dot[t] - 128i32 * u_sum);
                if comptime!(pair) {
                    isum_up[t] += sc_up * (dot_up[t] - 128i32 * u_sum_up);
                }
            }
        }
    }
    #[unroll]
    for t in 0..tile {
        sums[t] = f32::cast_from(isum[t]);
        sums_up[t] = f32::cast_from(isum_up[t]);
    }
}

/// `x` unchanged, through an integer operation with `zero` (a kernel argument that is
/// always 0): a compiler cannot see through it, so it cannot rewrite the error-free
/// float sequences below (`a - (a - b)` into `b`, say), which shader compilers may do to
/// operations not marked exact.
#[cube]
fn opaque(x: f32, zero: u32) -> f32 {
    f32::from_bits(x.to_bits() | zero)
}

/// `a * b + c` rounded once (an IEEE fused multiply-add), the CPU's `mul_add`. With
/// `native` the device's `fma` (CUDA's is fused by definition); else, for targets whose
/// `fma` may round twice (Vulkan's), from operations rounded once each: the product
/// exactly as two floats (Dekker's product with Veltkamp's split), the sum of `c` and the
/// product's high part exactly (Knuth's two-sum), the two low parts added with rounding to
/// odd, then one rounding to nearest (Boldo and Melquiond's emulation of the FMA, correct
/// without underflow or overflow; checked against the CPU's `mul_add` on 50 million
/// triples of the kernels' magnitudes, and bitwise in the `fast` product tests). `zero`
/// is 0 (see [`opaque`]).
#[cube]
#[allow(unused_assignments)]
fn fused_mul_add(a: f32, b: f32, c: f32, zero: u32, #[comptime] native: bool) -> f32 {
    let mut out = f32::new(0.0);
    if comptime!(native) {
        out = fma(a, b, c);
    } else {
        let split = f32::new(4097.0); // 2^12 + 1
        let ca = opaque(a * split, zero);
        let ah = opaque(ca - opaque(ca - a, zero), zero);
        let al = opaque(a - ah, zero);
        let cb = opaque(b * split, zero);
        let bh = opaque(cb - opaque(cb - b, zero), zero);
        let bl = opaque(b - bh, zero);
        let uh = opaque(a * b, zero);
        let e1 = opaque(opaque(ah * bh, zero) - uh, zero);
        let e2 = opaque(e1 + opaque(ah * bl, zero), zero);
        let e3 = opaque(e2 + opaque(al * bh, zero), zero);
        let ul = opaque(e3 + opaque(al * bl, zero), zero);
        let th = opaque(c + uh, zero);
        let z = opaque(th - c, zero);
        let tl = opaque(
            opaque(c - opaque(th - z, zero), zero) + opaque(uh - z, zero),
            zero,
        );
        let s = opaque(tl + ul, zero);
        let z2 = opaque(s - tl, zero);
        let r = opaque(
            opaque(tl - opaque(s - z2, zero), zero) + opaque(ul - z2, zero),
            zero,
        );
        let mut v = s;
        let bits = s.to_bits();
        if r != 0.0 && (bits & 1) == 0 {
            // The neighbour of `s` towards the exact sum, whose last bit is odd.
            let away = (s > 0.0) == (r > 0.0);
            v = f32::from_bits(select(away, bits + 1, bits - 1));
        }
        out = th + v;
    }
    out
}

/// `a / b` rounded to nearest for finite `a` and `b` whose quotient is normal or zero
/// (a shader's division may be a reciprocal and a product, or within 2.5 units of the
/// last place, Vulkan's bound): of the device's quotient and its two neighbours, the one
/// whose exact residual `a - q * b` is the smallest (a quotient is never halfway between
/// two floats, so there is no tie).
#[cube]
fn rounded_div(a: f32, b: f32, zero: u32, #[comptime] native: bool) -> f32 {
    let q = a / b;
    // Past 2^64 the residual's exact product would overflow in the emulated FMA's split:
    // `a` and `b` scaled by 2^-64 (exactly, the quotient the same; SwiGLU's denominator
    // reaches 1.7e38 where the gate is below -88).
    let big = b.abs() > f32::from_bits(0x5F80_0000u32);
    let scale = select(big, f32::from_bits(0x1F80_0000u32), f32::new(1.0));
    let (a, b) = (opaque(a * scale, zero), opaque(b * scale, zero));
    let bits = q.to_bits();
    let (lo, hi) = (f32::from_bits(bits - 1), f32::from_bits(bits + 1));
    nearest_of(
        q,
        fused_mul_add(-q, b, a, zero, native),
        lo,
        fused_mul_add(-lo, b, a, zero, native),
        hi,
        fused_mul_add(-hi, b, a, zero, native),
    )
}

/// Of a device's result `x` and its neighbours `lo` and `hi`, the one whose exact
/// residual (`r`, `r_lo`, `r_hi`, of either sign) is the smallest; `x` on a tie with it,
/// then `lo`: the last step of [`rounded_div`] and [`rounded_sqrt`].
#[cube]
fn nearest_of(x: f32, r: f32, lo: f32, r_lo: f32, hi: f32, r_hi: f32) -> f32 {
    let mut best = x;
    let mut best_r = r.abs();
    if r_lo.abs() < best_r {
        best = lo;
        best_r = r_lo.abs();
    }
    if r_hi.abs() < best_r {
        best = hi;
    }
    best
}

/// `sqrt(a)` rounded to nearest for positive normal `a` (Vulkan allows a shader's square
/// root some units of the last place): of the device's root and its two neighbours, the
/// one whose exact residual `a - s * s` is the smallest (a root is never halfway between
/// two floats, so there is no tie).
#[cube]
fn rounded_sqrt(a: f32, zero: u32, #[comptime] native: bool) -> f32 {
    let s = a.sqrt();
    let bits = s.to_bits();
    let (lo, hi) = (f32::from_bits(bits - 1), f32::from_bits(bits + 1));
    nearest_of(
        s,
        fused_mul_add(-s, s, a, zero, native),
        lo,
        fused_mul_add(-lo, lo, a, zero, native),
        hi,
        fused_mul_add(-hi, hi, a, zero, native),
    )
}

/// `a * b` rounded on its own: never fused with the add that follows it (CUDA's compiler
/// contracts `a * b + c` into one FMA, and so may Mesa's), as the CPU's plain multiply
/// and add round twice. `zero` is 0 (see [`opaque`]).
#[cube]
fn product(a: f32, b: f32, zero: u32) -> f32 {
    opaque(a * b, zero)
}

/// The CPU's `e^x` ([`crate::kernels::attention::exp`]: clamped to [-87, 88], a power
/// of two times Cephes' degree-7 polynomial of the remainder), step by step with the same
/// roundings, each kept from the compiler's rewriting by [`opaque`]: the same bits as the
/// CPU's for every `x`. `zero` is 0.
#[cube]
fn cpu_exp(x: f32, zero: u32) -> f32 {
    // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer.
    let round = f32::new(12_582_912.0);
    let mut x = x;
    if x < -87.0 {
        x = f32::new(-87.0);
    }
    if x > 88.0 {
        x = f32::new(88.0);
    }
    let t = opaque(
        product(x, f32::new(std::f32::consts::LOG2_E), zero) + round,
        zero,
    );
    let n = opaque(t - round, zero);
    // `t`'s bits are `round`'s plus `n` (their exponents are the same), so this is
    // `n + 127` as an integer: `n >= -126` after the clamp, so it is never negative.
    let biased = t.to_bits() + 127 - round.to_bits();
    let r = opaque(
        opaque(x - product(n, f32::new(0.693_359_4), zero), zero)
            - product(n, f32::new(-2.121_944_4e-4), zero),
        zero,
    );
    let mut p = f32::new(1.987_569_1e-4);
    p = opaque(product(p, r, zero) + 1.398_199_9e-3, zero);
    p = opaque(product(p, r, zero) + 8.333_452e-3, zero);
    p = opaque(product(p, r, zero) + 4.166_579_6e-2, zero);
    p = opaque(product(p, r, zero) + 1.666_666_5e-1, zero);
    p = opaque(product(p, r, zero) + 0.5, zero);
    let e = opaque(
        opaque(product(p, product(r, r, zero), zero) + r, zero) + 1.0,
        zero,
    );
    product(e, f32::from_bits(biased << 23), zero)
}

/// SwiGLU of one output as the CPU computes it
/// ([`crate::kernels::activation::swiglu`]): `gate / (1 + e^-gate) * up` with
/// [`cpu_exp`], a division rounded to nearest and the product rounded on its own.
#[cube]
fn cpu_swiglu(gate: f32, up: f32, zero: u32, #[comptime] native: bool) -> f32 {
    let denominator = opaque(f32::new(1.0) + cpu_exp(-gate, zero), zero);
    product(rounded_div(gate, denominator, zero, native), up, zero)
}

/// RoPE's rotation of one value as the CPU computes it
/// ([`crate::kernels::activation::rope`]): `x * cos + partner * sin`, two products and
/// an add, each rounded on its own.
#[cube]
fn cpu_rotate(x: f32, cos: f32, partner: f32, sin: f32, zero: u32) -> f32 {
    opaque(product(x, cos, zero) + product(partner, sin, zero), zero)
}

/// The float steps of one weight block (at byte `at`) for each tile row, in the CPU's
/// order (`kernels::int8`'s definition): per sub-block, at the end of the run `acc =
/// fma(isum, d * dx, acc)`, then for the formats with a minimum `acc = fma(m, dx * sum of
/// q, acc)`. The run's scale `dx` of row `t` is `scales[2 (first + t)]`, its integer sum
/// `isums[t]` (as f32), its sub-blocks' sums of `q` `qsums[(first + t) * subs + s]`. Only the rows `t` with `t % lanes == lane` (the calling lane's).
#[cube]
#[allow(clippy::too_many_arguments)]
fn int_steps<I: Numeric>(
    words: &Tensor<I>,
    at: usize,
    scales: &SharedMemory<f32>,
    qsums: &SharedMemory<i32>,
    first: usize,
    isums: &Array<f32>,
    acc: &mut Array<f32>,
    lane: usize,
    zero: u32,
    #[comptime] format: u32,
    #[comptime] tile: usize,
    #[comptime] lanes: usize,
    #[comptime] native_fma: bool,
) {
    let subs = comptime!(run_of(format));
    let mins = comptime!(int_form_of(format).mins);
    let d = int_d::<I>(words, at, format);
    #[unroll]
    for s in 0..subs {
        let mut m = f32::new(0.0);
        if comptime!(mins) {
            m = int_m::<I>(words, at, s, format);
        }
        #[unroll]
        for t in 0..tile {
            if t % lanes == lane {
                let dx = scales[2 * (first + t)];
                if s == subs - 1 {
                    acc[t] = fused_mul_add(isums[t], d * dx, acc[t], zero, native_fma);
                }
                if comptime!(mins) {
                    let sx = dx * f32::cast_from(qsums[(first + t) * subs + s]);
                    acc[t] = fused_mul_add(m, sx, acc[t], zero, native_fma);
                }
            }
        }
    }
}

/// `x @ W^T` in the `fast` precision, the CPU's `fast` product's bits: the activations
/// quantized as the CPU quantizes them (`kernels::int8::activations`: each run of 32
/// values, or of 256 against the K-quants, scaled by `d = max|x| / 127`, each value
/// `round(x / d)` with halves away from zero, computed as `x * (1 / d)`), the weights'
/// own integers (`quant::int_form`), exact integer block sums, and the float steps in the
/// CPU's order. `W` is `[n_out, cols]` in ggml's blocks (`format` as
/// [`quantized_matmul_kernel`]'s); a cube is [`QUANT_OUTPUTS`] outputs by `lanes` units
/// (the weight's shape alone chooses them, [`super::quant_lanes`]) and a tile of `tile`
/// rows, as there. The weight blocks of a row are taken `lanes` at a time, and for each
/// such chunk:
///
/// 1. the cube finds the scale of every run of the chunk for every row of the tile (each
///    lane's 32 units the largest magnitudes of their share of its block, then one unit
///    per row the run's; exact in any order), in the prologue, so the quantization costs
///    no launch of its own;
/// 2. each lane's 32 units quantize its block's activations for every row of the tile
///    into shared memory, each value once (8 bits, four to a word:
///    [`stage_activations`]), then lane `l` computes its exact integer sums for every
///    row of the tile from them (integers: any order);
/// 3. lane `t % lanes` takes the float steps of tile row `t` over the chunk's blocks in
///    order (the rows' chains are apart: any lane may take one).
///
/// So each output is one chain of float steps over its blocks in order, the CPU's,
/// whatever the tile, the lanes or the batch. A `second` matrix in `up` as in
/// [`quantized_matmul_kernel`]. With `pair`, `up` is multiplied the same
/// way and the output is `silu(gate) * up` in f32, as [`quantized_matmul_kernel`]'s.
///
/// `io` fuses the work on either side of the product that would otherwise be a launch
/// of its own, with the same bits: [`IO_NORM`] takes RMSNorm of `x`'s rows (the weight in
/// `extra`, `eps`) in the prologue, each cube computing its tile rows' norms by
/// [`norm_row`]'s steps and normalizing each value where it reads it; [`IO_RESIDUAL`]
/// adds the residual in `extra` to each output in the epilogue. With [`IO_PLAIN`]
/// `extra` and `eps` are not read.
/// `zero` is 0 (see [`opaque`]); `native_fma` says whether the device's `fma` is fused.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn int_matmul_kernel<F: Float, I: Numeric>(
    x: &Tensor<F>,
    words: &Tensor<I>,
    up: &Tensor<I>,
    extra: &Tensor<F>,
    out: &mut Tensor<F>,
    rows: u32,
    n_out: u32,
    n_second: u32,
    cols: u32,
    eps: f32,
    zero: u32,
    #[comptime] format: u32,
    #[comptime] second: u32,
    #[comptime] tile: usize,
    #[comptime] lanes: usize,
    #[comptime] pair: bool,
    #[comptime] io: u32,
    #[comptime] native_fma: bool,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let (rows, n_out, n_second, cols) = (
        rows as usize,
        n_out as usize,
        n_second as usize,
        cols as usize,
    );
    let width = n_out + n_second;
    let cube = CUBE_POS_X as usize;
    if comptime!(second == NO_SECOND) {
        int_product::<F, I>(
            x, words, up, extra, out, rows, n_out, cols, cube, width, 0, eps, zero, format, tile,
            lanes, pair, io, native_fma,
        );
    } else {
        let cubes = n_out.div_ceil(QUANT_OUTPUTS);
        if cube < cubes {
            int_product::<F, I>(
                x, words, up, extra, out, rows, n_out, cols, cube, width, 0, eps, zero, format,
                tile, lanes, false, io, native_fma,
            );
        } else {
            int_product::<F, I>(
                x,
                up,
                up,
                extra,
                out,
                rows,
                n_second,
                cols,
                cube - cubes,
                width,
                n_out,
                eps,
                zero,
                second,
                tile,
                lanes,
                false,
                io,
                native_fma,
            );
        }
    }
}

/// One matrix's part of [`int_matmul_kernel`], as [`quantized_product`] is of
/// [`quantized_matmul_kernel`].
#[cube]
#[allow(clippy::too_many_arguments)]
fn int_product<F: Float, I: Numeric>(
    x: &Tensor<F>,
    words: &Tensor<I>,
    up: &Tensor<I>,
    extra: &Tensor<F>,
    out: &mut Tensor<F>,
    rows: usize,
    n_out: usize,
    cols: usize,
    cube: usize,
    width: usize,
    out_offset: usize,
    eps: f32,
    zero: u32,
    #[comptime] format: u32,
    #[comptime] tile: usize,
    #[comptime] lanes: usize,
    #[comptime] pair: bool,
    #[comptime] io: u32,
    #[comptime] native_fma: bool,
) {
    let lane = UNIT_POS_Y as usize;
    let column = UNIT_POS_X as usize;
    let wanted = cube * QUANT_OUTPUTS + column;
    let r0 = CUBE_POS_Y as usize * tile;
    let live = wanted < n_out;
    let o = select(live, wanted, n_out - 1);
    let block_bytes = comptime!(block_bytes_of(format));
    let subs = comptime!(run_of(format));
    let block_values = comptime!(32 * subs);
    let blocks = cols / block_values;
    let row_at = o * blocks * block_bytes;
    let mut x_at = Array::<u32>::new(tile);
    let mut acc = Array::<f32>::new(tile);
    let mut acc_up = Array::<f32>::new(tile);
    let mut sums = Array::<f32>::new(tile);
    let mut sums_up = Array::<f32>::new(tile);
    #[unroll]
    for t in 0..tile {
        let mut r = r0 + t;
        if r >= rows {
            r = rows - 1;
        }
        x_at[t] = (r * cols) as u32;
        acc[t] = f32::new(0.0);
        acc_up[t] = f32::new(0.0);
    }
    // With `io` [`IO_NORM`], each tile row's inverse RMS, from the cube's units.
    let mut invs = SharedMemory::<f32>::new(tile);
    if comptime!(io == IO_NORM) {
        tile_norms::<F>(
            x, &x_at, cols, eps, zero, &mut invs, tile, lanes, native_fma,
        );
    }
    let stride = comptime!(QUANT_OUTPUTS * lanes * tile);
    let staged_words = comptime!(lanes * tile * run_of(format) * STAGED_WORDS);
    let scratch_words = comptime!((if pair { 2 } else { 1 }) * stride);
    // One array for what lives at different times in each chunk (bits of f32 or the
    // staged words): the units' largest magnitudes (`QUANT_OUTPUTS` per run and row),
    // then the quantized activations, then the lanes' integer sums.
    let mut scratch = SharedMemory::<u32>::new(comptime!(if staged_words > scratch_words {
        staged_words
    } else {
        scratch_words
    }));
    // Per run and row of the chunk: its scale and inverse scale.
    let mut scales = SharedMemory::<f32>::new(comptime!(2 * lanes * tile));
    // Per run, row and sub-block: the sum of its quantized values.
    let mut qsums = SharedMemory::<i32>::new(comptime!(lanes * tile * subs));
    let slot = (lane * QUANT_OUTPUTS + column) * tile;
    let first = lane * tile;
    let chunks = blocks.div_ceil(lanes);
    for c in 0..chunks {
        let b = c * lanes + lane;
        let live_block = b < blocks;
        let xb = b * block_values;
        // 1. The largest magnitudes of the runs.
        #[unroll]
        for t in 0..tile {
            let mut m = f32::new(0.0);
            if live_block {
                for i in 0..subs {
                    let v = input_value::<F>(
                        x,
                        extra,
                        &invs,
                        x_at[t] as usize,
                        t,
                        xb + 32 * i + column,
                        zero,
                        io,
                    )
                    .abs();
                    if v > m {
                        m = v;
                    }
                }
            }
            scratch[((first + t) * QUANT_OUTPUTS) + column] = m.to_bits();
        }
        sync_cube();
        if column < tile {
            let run = first + column;
            let mut amax = f32::new(0.0);
            for j in 0..QUANT_OUTPUTS {
                let v = f32::from_bits(scratch[run * QUANT_OUTPUTS + j]);
                if v > amax {
                    amax = v;
                }
            }
            store_run_scales(&mut scales, run, amax, zero, native_fma);
        }
        sync_cube();
        // 2. The activations quantized once for the cube, then the integer sums.
        stage_activations::<F>(
            x,
            extra,
            &invs,
            rows,
            cols,
            r0,
            xb,
            live_block,
            &scales,
            &mut scratch,
            first,
            zero,
            format,
            tile,
            io,
        );
        sync_cube();
        if comptime!(int_form_of(format).mins) {
            stage_q_sums(&scratch, &mut qsums, format, tile, lanes);
        }
        if live_block {
            // Gate and up from one quantization of the activations.
            int_block::<I>(
                words,
                up,
                row_at + b * block_bytes,
                &scratch,
                first,
                &mut sums,
                &mut sums_up,
                format,
                tile,
                pair,
            );
        }
        // The staged words are read by every unit before their space takes the sums.
        sync_cube();
        if live_block {
            #[unroll]
            for t in 0..tile {
                scratch[slot + t] = sums[t].to_bits();
                if comptime!(pair) {
                    scratch[stride + slot + t] = sums_up[t].to_bits();
                }
            }
        }
        sync_cube();
        // 3. The float steps, in block order: tile row `t`'s by lane `t % lanes`.
        for l in 0..lanes {
            let b = c * lanes + l;
            if b < blocks {
                let at = row_at + b * block_bytes;
                let from = (l * QUANT_OUTPUTS + column) * tile;
                #[unroll]
                for t in 0..tile {
                    if t % lanes == lane {
                        sums[t] = f32::from_bits(scratch[from + t]);
                        if comptime!(pair) {
                            sums_up[t] = f32::from_bits(scratch[stride + from + t]);
                        }
                    }
                }
                int_steps::<I>(
                    words,
                    at,
                    &scales,
                    &qsums,
                    l * tile,
                    &sums,
                    &mut acc,
                    lane,
                    zero,
                    format,
                    tile,
                    lanes,
                    native_fma,
                );
                if comptime!(pair) {
                    int_steps::<I>(
                        up,
                        at,
                        &scales,
                        &qsums,
                        l * tile,
                        &sums_up,
                        &mut acc_up,
                        lane,
                        zero,
                        format,
                        tile,
                        lanes,
                        native_fma,
                    );
                }
            }
        }
        sync_cube();
    }
    if live {
        #[unroll]
        for t in 0..tile {
            if r0 + t < rows && t % lanes == lane {
                let mut total = acc[t];
                if comptime!(pair) {
                    total = cpu_swiglu(total, acc_up[t], zero, native_fma);
                }
                let at = (r0 + t) * width + out_offset + o;
                if comptime!(io == IO_RESIDUAL) {
                    // The residual add, rounded to `F` as a tensor add rounds it.
                    out[at] = extra[at] + F::cast_from(total);
                } else {
                    out[at] = F::cast_from(total);
                }
            }
        }
    }
}

/// Tile rows of [`int_tiles_kernel`]: a fragment's `m`.
pub(crate) const TILE_ROWS: usize = 16;
/// Outputs per plane (warp) of [`int_tiles_kernel`]: a fragment's `n`.
pub(crate) const TILE_OUTPUTS: usize = 16;
/// Units per plane of [`int_tiles_kernel`] (a CUDA warp).
pub(crate) const PLANE: usize = 32;
/// Planes per cube of [`int_tiles_kernel`]: a cube of 64 outputs by 16 rows.
pub(crate) const TILE_PLANES: usize = 4;

/// [`int_matmul_kernel`]'s product, the CPU `fast` product's bits, with the integer sums
/// taken as fragment products of 16 x 16 x 16 (tensor cores: `mma` on CUDA from sm_72,
/// cooperative matrices on Vulkan, `i8` times `i8` into `i32`), for prompts and batches.
///
/// A cube is `planes` planes of 32 units and a tile of [`TILE_ROWS`] rows; plane `p` owns
/// [`TILE_OUTPUTS`] outputs. The weight's blocks are taken one at a time, in order:
///
/// 1. the cube finds each tile row's scale for the block's run (the largest magnitude:
///    exact in any order; `d = max / 127` and `1 / d` rounded to nearest, the CPU's rule);
/// 2. for each 32-value sub-block, the cube quantizes the tile's activations into shared
///    memory as `i8` (`round(v / d)`, halves away from zero) and each plane decodes its
///    outputs' weights as `u - offset` (`quant::int_form`: every kept format's values fit
///    in `i8` so), both in matrices of 16 x 16 values;
/// 3. each plane multiplies them: for every group of values that shares an integer scale
///    (the sub-block, or each 16-value half for Q6_K and Q3_K) one accumulator of
///    `sum (u - offset) * q`, exact in 32 bits, stored to shared memory, from where the
///    unit owning an entry adds `scale * sum` to the block's integer sum (the same
///    integer as [`int_block`]'s, whose order does not matter);
/// 4. each unit (an output and 8 tile rows) takes the block's float steps for its rows
///    with [`int_steps`], as [`int_product`] does: so each output is the same chain of
///    float steps over its blocks in order, the CPU's.
///
/// With `tensor_cores` the fragment products are `cmma` instructions on `E = i8`
/// matrices; without, each unit computes its own entries with plain multiply-adds
/// (`E = i32`), on any device: the same tiles, sums and steps, so lavapipe tests the
/// kernel's every step but the fragment instruction (whose sums are exact integers
/// either way). `second`, `pair` and `io` as [`int_matmul_kernel`]'s, but for
/// [`IO_NORM`] (the norm stays in [`int_matmul_kernel`]'s prologue or a launch of its
/// own).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn int_tiles_kernel<F: Float, I: Numeric, E: Numeric>(
    x: &Tensor<F>,
    words: &Tensor<I>,
    up: &Tensor<I>,
    extra: &Tensor<F>,
    out: &mut Tensor<F>,
    rows: u32,
    n_out: u32,
    n_second: u32,
    cols: u32,
    zero: u32,
    #[comptime] format: u32,
    #[comptime] second: u32,
    #[comptime] planes: usize,
    #[comptime] pair: bool,
    #[comptime] io: u32,
    #[comptime] native_fma: bool,
    #[comptime] tensor_cores: bool,
    #[define(F, I, E)] _dtypes: [StorageType; 3],
) {
    let (rows, n_out, n_second, cols) = (
        rows as usize,
        n_out as usize,
        n_second as usize,
        cols as usize,
    );
    let width = n_out + n_second;
    let cube = CUBE_POS_X as usize;
    if comptime!(second == NO_SECOND) {
        int_tiles_product::<F, I, E>(
            x,
            words,
            up,
            extra,
            out,
            rows,
            n_out,
            cols,
            cube,
            width,
            0,
            zero,
            format,
            planes,
            pair,
            io,
            native_fma,
            tensor_cores,
        );
    } else {
        let cubes = n_out.div_ceil(TILE_OUTPUTS * planes);
        if cube < cubes {
            int_tiles_product::<F, I, E>(
                x,
                words,
                up,
                extra,
                out,
                rows,
                n_out,
                cols,
                cube,
                width,
                0,
                zero,
                format,
                planes,
                false,
                io,
                native_fma,
                tensor_cores,
            );
        } else {
            int_tiles_product::<F, I, E>(
                x,
                up,
                up,
                extra,
                out,
                rows,
                n_second,
                cols,
                cube - cubes,
                width,
                n_out,
                zero,
                second,
                planes,
                false,
                io,
                native_fma,
                tensor_cores,
            );
        }
    }
}

/// Place of value `k` (0..32) of tile row or output `i` in a sub-block's staged matrices
/// ([`int_tiles_kernel`]): the values in two 16 x 16 matrices (values 0..16, then
/// 16..32), each row of 16 values in turn, so every fragment starts 256 values from the
/// array's start.
#[cube]
fn tile_at(i: usize, k: usize) -> usize {
    (k / 16) * 256 + i * 16 + k % 16
}

/// One matrix's part of [`int_tiles_kernel`].
#[cube]
// `if comptime!(..) { if runtime { .. } }` keeps the outer test at expansion time.
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
fn int_tiles_product<F: Float, I: Numeric, E: Numeric>(
    x: &Tensor<F>,
    words: &Tensor<I>,
    up: &Tensor<I>,
    extra: &Tensor<F>,
    out: &mut Tensor<F>,
    rows: usize,
    n_out: usize,
    cols: usize,
    cube: usize,
    width: usize,
    out_offset: usize,
    zero: u32,
    #[comptime] format: u32,
    #[comptime] planes: usize,
    #[comptime] pair: bool,
    #[comptime] io: u32,
    #[comptime] native_fma: bool,
    #[comptime] tensor_cores: bool,
) {
    let plane = UNIT_POS_Y as usize;
    let lane = UNIT_POS_X as usize;
    let units = comptime!(PLANE * planes);
    let unit = plane * PLANE + lane;
    let r0 = CUBE_POS_Y as usize * TILE_ROWS;
    let block_bytes = comptime!(block_bytes_of(format));
    let subs = comptime!(run_of(format));
    let block_values = comptime!(32 * subs);
    let offset = comptime!(int_form_of(format).offset);
    let mins = comptime!(int_form_of(format).mins);
    // Q6_K and Q3_K scale each 16 values of a sub-block on its own.
    let groups = comptime!(if format == 4 || format == 8 {
        2usize
    } else {
        1usize
    });
    let blocks = cols / block_values;
    let first_out = (cube * planes + plane) * TILE_OUTPUTS;
    // The unit's entries: output `j` of the plane, tile rows `t0..t0 + 8`.
    let j = lane % TILE_OUTPUTS;
    let t0 = (lane / TILE_OUTPUTS) * 8;
    let wanted = first_out + j;
    let live = wanted < n_out;
    let o = select(live, wanted, n_out - 1);
    let row_at = o * blocks * block_bytes;
    // The unit's share of the decoding: output `jd`, values `16 hd..16 hd + 16` of each
    // sub-block.
    let jd = lane / 2;
    let hd = lane % 2;
    let od = select(first_out + jd < n_out, first_out + jd, n_out - 1);
    let dec_at = od * blocks * block_bytes;

    let mut acc = Array::<f32>::new(8usize);
    let mut acc_up = Array::<f32>::new(8usize);
    let mut isum = Array::<i32>::new(8usize);
    let mut isum_up = Array::<i32>::new(8usize);
    #[unroll]
    for t in 0..8usize {
        acc[t] = f32::new(0.0);
        acc_up[t] = f32::new(0.0);
    }
    let parts = comptime!(PLANE * planes / TILE_ROWS);
    let mut amax = SharedMemory::<f32>::new(units);
    // Per tile row: the run's scale and inverse scale.
    let mut scales = SharedMemory::<f32>::new(comptime!(2 * TILE_ROWS));
    // Per tile row and sub-block: the sum of its quantized values (formats with a minimum).
    let mut qsums = SharedMemory::<i32>::new(comptime!(TILE_ROWS * run_of(format)));
    let mut a_tile = SharedMemory::<E>::new_aligned(512usize, 32usize);
    let mut b_tile = SharedMemory::<E>::new_aligned(comptime!(planes * 512), 32usize);
    let mut b_up =
        SharedMemory::<E>::new_aligned(comptime!(if pair { planes * 512 } else { 1 }), 32usize);
    let mut c_tile = SharedMemory::<i32>::new_aligned(comptime!(planes * 256), 32usize);
    let mut c_up =
        SharedMemory::<i32>::new_aligned(comptime!(if pair { planes * 256 } else { 1 }), 32usize);
    // The unit's block sums as f32, as [`int_steps`] takes them.
    let mut sums = Array::<f32>::new(8usize);
    let mut sums_up = Array::<f32>::new(8usize);

    for b in 0..blocks {
        let xb = b * block_values;
        // 1. The run's largest magnitude of each tile row, then its scales.
        let ta = unit / parts;
        let mut ra = r0 + ta;
        if ra >= rows {
            ra = rows - 1;
        }
        let mut m = f32::new(0.0);
        let mut i = unit % parts;
        while i < block_values {
            let v = f32::cast_from(x[ra * cols + xb + i]).abs();
            if v > m {
                m = v;
            }
            i += parts;
        }
        amax[unit] = m;
        sync_cube();
        if unit < TILE_ROWS {
            let mut top = f32::new(0.0);
            for p in 0..parts {
                let v = amax[unit * parts + p];
                if v > top {
                    top = v;
                }
            }
            store_run_scales(&mut scales, unit, top, zero, native_fma);
        }
        sync_cube();
        #[unroll]
        for t in 0..8usize {
            isum[t] = 0i32;
            isum_up[t] = 0i32;
        }
        for s in 0..subs {
            // 2. The sub-block's activations as i8, and the plane's weights.
            let mut e = unit;
            while e < 512usize {
                let t = e / 32;
                let k = e % 32;
                let mut r = r0 + t;
                if r >= rows {
                    r = rows - 1;
                }
                let v = f32::cast_from(x[r * cols + xb + 32 * s + k]);
                let q = activation_code(v, scales[2 * t + 1]);
                a_tile[tile_at(t, k)] = E::cast_from(q);
                e += units;
            }
            #[unroll]
            for w in 0..4usize {
                let k = 16 * hd + 4 * w;
                let values = int_values4::<I>(words, dec_at + b * block_bytes, s, k, format);
                let mut values_up = 0u32;
                if comptime!(pair) {
                    values_up = int_values4::<I>(up, dec_at + b * block_bytes, s, k, format);
                }
                #[unroll]
                for jj in 0..4usize {
                    let shift = (8 * jj) as u32;
                    let at = plane * 512 + tile_at(jd, k + jj);
                    b_tile[at] = E::cast_from(i32::cast_from((values >> shift) & 255u32) - offset);
                    if comptime!(pair) {
                        b_up[at] =
                            E::cast_from(i32::cast_from((values_up >> shift) & 255u32) - offset);
                    }
                }
            }
            sync_cube();
            if comptime!(mins) {
                if unit < TILE_ROWS {
                    let mut total = 0i32;
                    for k in 0..32usize {
                        total += i32::cast_from(a_tile[tile_at(unit, k)]);
                    }
                    qsums[unit * subs + s] = total;
                }
            }
            // 3. Each group's exact integer sums, then the unit's entries scaled.
            #[unroll]
            for g in 0..groups {
                tile_product::<E>(
                    &a_tile,
                    &b_tile,
                    &mut c_tile,
                    plane,
                    j,
                    t0,
                    g,
                    groups,
                    tensor_cores,
                );
                if comptime!(pair) {
                    tile_product::<E>(
                        &a_tile,
                        &b_up,
                        &mut c_up,
                        plane,
                        j,
                        t0,
                        g,
                        groups,
                        tensor_cores,
                    );
                }
                sync_cube();
                let sc = int_scale::<I>(words, row_at + b * block_bytes, s, g, format);
                let mut sc_up = 0i32;
                if comptime!(pair) {
                    sc_up = int_scale::<I>(up, row_at + b * block_bytes, s, g, format);
                }
                #[unroll]
                for t in 0..8usize {
                    let at = plane * 256 + (t0 + t) * TILE_OUTPUTS + j;
                    isum[t] += sc * c_tile[at];
                    if comptime!(pair) {
                        isum_up[t] += sc_up * c_up[at];
                    }
                }
                // Every entry is read before the next fragment product's store.
                sync_cube();
            }
        }
        // 4. The block's float steps for the unit's rows, in block order.
        #[unroll]
        for t in 0..8usize {
            sums[t] = f32::cast_from(isum[t]);
            sums_up[t] = f32::cast_from(isum_up[t]);
        }
        let at = row_at + b * block_bytes;
        let rows_each = comptime!(8usize);
        int_steps::<I>(
            words, at, &scales, &qsums, t0, &sums, &mut acc, 0usize, zero, format, rows_each,
            1usize, native_fma,
        );
        if comptime!(pair) {
            int_steps::<I>(
                up,
                at,
                &scales,
                &qsums,
                t0,
                &sums_up,
                &mut acc_up,
                0usize,
                zero,
                format,
                rows_each,
                1usize,
                native_fma,
            );
        }
        // The scales and sums of `q` are read before the next block's.
        sync_cube();
    }
    if live {
        #[unroll]
        for t in 0..8usize {
            let r = r0 + t0 + t;
            if r < rows {
                let mut total = acc[t];
                if comptime!(pair) {
                    total = cpu_swiglu(total, acc_up[t], zero, native_fma);
                }
                let at = r * width + out_offset + o;
                if comptime!(io == IO_RESIDUAL) {
                    // The residual add, rounded to `F` as a tensor add rounds it.
                    out[at] = extra[at] + F::cast_from(total);
                } else {
                    out[at] = F::cast_from(total);
                }
            }
        }
    }
}

/// Plane `plane`'s fragment product of group `g` of a sub-block ([`int_tiles_kernel`]):
/// `c[t][j] = sum over the group's values k of a[t][k] * b[j][k]` for the 16 tile rows
/// `t` and the plane's 16 outputs `j`, into its 16 x 16 `c` (rows of 16). With
/// `tensor_cores` one accumulator over the group's 16 x 16 x 16 `cmma` products (both
/// halves of the sub-block when `groups` is 1); without, the unit computes its own
/// entries (output `j`, rows `t0..t0 + 8`) with plain integer multiply-adds.
#[cube]
#[allow(clippy::too_many_arguments)]
fn tile_product<E: Numeric>(
    a: &SharedMemory<E>,
    b: &SharedMemory<E>,
    c: &mut SharedMemory<i32>,
    plane: usize,
    j: usize,
    t0: usize,
    g: usize,
    #[comptime] groups: usize,
    #[comptime] tensor_cores: bool,
) {
    let halves = comptime!(2 / groups);
    if comptime!(tensor_cores) {
        let acc = cmma::Matrix::<i32>::from_value(
            cmma::MatrixIdent::Accumulator,
            16usize,
            16usize,
            16usize,
            cmma::MatrixLayout::Undefined,
            0i32,
        );
        #[unroll]
        for hh in 0..halves {
            let h = g * halves + hh;
            let fa = cmma::Matrix::<E>::from_slice(
                cmma::MatrixIdent::A,
                16usize,
                16usize,
                16usize,
                cmma::MatrixLayout::RowMajor,
                &a.slice(h * 256, h * 256 + 256),
                16,
            );
            let fb = cmma::Matrix::<E>::from_slice(
                cmma::MatrixIdent::B,
                16usize,
                16usize,
                16usize,
                cmma::MatrixLayout::ColMajor,
                &b.slice(plane * 512 + h * 256, plane * 512 + h * 256 + 256),
                16,
            );
            cmma::execute::<E, E, i32, i32>(&fa, &fb, &acc, &acc);
        }
        cmma::store(
            &mut c.slice_mut(plane * 256, plane * 256 + 256),
            &acc,
            16,
            cmma::MatrixLayout::RowMajor,
        );
    } else {
        #[unroll]
        for t in 0..8usize {
            let mut total = 0i32;
            for hh in 0..halves {
                let h = g * halves + hh;
                for k in 0..16usize {
                    total += i32::cast_from(a[h * 256 + (t0 + t) * 16 + k])
                        * i32::cast_from(b[plane * 512 + h * 256 + j * 16 + k]);
                }
            }
            c[plane * 256 + (t0 + t) * TILE_OUTPUTS + j] = total;
        }
    }
}

/// A product's input as it is (see [`int_matmul_kernel`]'s `io`).
pub(crate) const IO_PLAIN: u32 = 0;
/// A product's input normalized in its prologue: RMSNorm of each row of `x` by the
/// weight in `extra` with `eps`, the bits [`rms_norm_kernel`] stores.
pub(crate) const IO_NORM: u32 = 1;
/// A product's output added to the residual in `extra` (of the output's shape) in its
/// epilogue, rounded to `F` as [`add_rms_norm_kernel`] rounds its sum.
pub(crate) const IO_RESIDUAL: u32 = 2;

/// The inverse RMS of each row of a product's tile (rows at `x_at`, `cols` values each)
/// into `invs[t]`, by [`norm_row`]'s steps: the cube's units take the tile's 16
/// interleaved sums of squares per row, then one unit per row adds them pairwise. Every
/// unit of the cube takes part (two barriers).
#[cube]
#[allow(clippy::too_many_arguments)]
fn tile_norms<F: Float>(
    x: &Tensor<F>,
    x_at: &Array<u32>,
    cols: usize,
    eps: f32,
    zero: u32,
    invs: &mut SharedMemory<f32>,
    #[comptime] tile: usize,
    #[comptime] lanes: usize,
    #[comptime] native: bool,
) {
    let unit = UNIT_POS_Y as usize * QUANT_OUTPUTS + UNIT_POS_X as usize;
    let units = comptime!(QUANT_OUTPUTS * lanes);
    let mut sums = SharedMemory::<f32>::new(comptime!(16 * tile));
    let mut k = unit;
    while k < comptime!(16 * tile) {
        let t = k / 16usize;
        sums[k] = square_sum::<F>(x, x, x_at[t] as usize, k % 16usize, cols, zero, false);
        k += units;
    }
    sync_cube();
    if unit < tile {
        invs[unit] = inverse_rms(&sums, unit * 16usize, cols, eps, zero, native);
    }
    sync_cube();
}

/// Value `i` of tile row `t` (starting at `at` in `x`) as a product takes it: as it is,
/// or with `io` [`IO_NORM`] normalized ([`normed_value`] with the row's `invs[t]` and the
/// weight in `extra`).
#[cube]
#[allow(clippy::too_many_arguments, unused_assignments)]
fn input_value<F: Float>(
    x: &Tensor<F>,
    extra: &Tensor<F>,
    invs: &SharedMemory<f32>,
    at: usize,
    t: usize,
    i: usize,
    zero: u32,
    #[comptime] io: u32,
) -> f32 {
    let v = f32::cast_from(x[at + i]);
    let mut value = v;
    if comptime!(io == IO_NORM) {
        value = normed_value::<F>(v, invs[t], extra, i, zero);
    }
    value
}

/// Units per row of [`argmax_kernel`].
pub(crate) const ARGMAX_WIDTH: usize = 256;

/// One row's largest value and its first index, and whether it holds a NaN, for a cube
/// of `width` units over `logits[base..base + n]`: each unit scans its strided share in
/// index order, then the units' bests are combined in shared memory (the larger value;
/// on a tie the smaller index), so the result is the same whatever the order of the
/// combination. On return `values[0]`, `indices[0]` (`n`, no token, if no value was
/// seen) and `nans[0]` (non-zero for a NaN) hold the row's.
#[cube]
fn row_argmax<F: Float>(
    logits: &Tensor<F>,
    base: usize,
    n: usize,
    values: &mut SharedMemory<f32>,
    indices: &mut SharedMemory<u32>,
    nans: &mut SharedMemory<u32>,
    #[comptime] width: usize,
) {
    let u = UNIT_POS_X as usize;
    let none = n as u32;
    let mut best = f32::new(0.0);
    let mut best_at = none;
    let mut nan = 0u32;
    let mut i = u;
    while i < n {
        let v = f32::cast_from(logits[base + i]);
        if v.is_nan() {
            nan = 1;
        } else {
            let mut take = best_at == none;
            if v > best {
                take = true;
            }
            if take {
                best = v;
                best_at = i as u32;
            }
        }
        i += width;
    }
    values[u] = best;
    indices[u] = best_at;
    nans[u] = nan;
    sync_cube();

    // The cube's width as a runtime value (a comptime one cannot be halved in a loop).
    let mut half = CUBE_DIM_X / 2;
    while half > 0 {
        let stride = half as usize;
        if u < stride {
            let other_at = indices[u + stride];
            let other = values[u + stride];
            if other_at != none {
                let mine_at = indices[u];
                let mine = values[u];
                let mut take = mine_at == none;
                if other > mine {
                    take = true;
                }
                if other == mine && other_at < mine_at {
                    take = true;
                }
                if take {
                    values[u] = other;
                    indices[u] = other_at;
                }
            }
            nans[u] = nans[u] | nans[u + stride];
        }
        sync_cube();
        half /= 2;
    }
}

/// The greedy token of each row of `logits` `[rows, vocab]`: the first index of the
/// largest value, as [`crate::sampling::argmax`] picks it, or `vocab` (no token) where the
/// row holds a NaN or nothing above minus infinity (which the host path reports as an
/// error). One cube per row, `width` units ([`row_argmax`]).
#[cube(launch)]
pub(crate) fn argmax_kernel<F: Float, I: Numeric>(
    logits: &Tensor<F>,
    out: &mut Tensor<I>,
    vocab: u32,
    #[comptime] width: usize,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let row = CUBE_POS_X as usize;
    let u = UNIT_POS_X as usize;
    let none = vocab;
    let vocab = vocab as usize;
    let mut values = SharedMemory::<f32>::new(width);
    let mut indices = SharedMemory::<u32>::new(width);
    let mut nans = SharedMemory::<u32>::new(width);
    row_argmax(
        logits,
        row * vocab,
        vocab,
        &mut values,
        &mut indices,
        &mut nans,
        width,
    );
    if u == 0 {
        let mut token = indices[0];
        // Below the least finite f32: minus infinity (the best of a row of -inf).
        if nans[0] != 0 || values[0] < f32::new(-3.402_823_5e38) {
            token = none;
        }
        out[row] = I::cast_from(token);
    }
}

/// Units per row of [`sample_kernel`].
pub(crate) const SAMPLE_WIDTH: usize = 256;

/// Words per row of [`sample_kernel`]'s output: the token, then its log-probability's
/// `f32` bits in two halves of 16 bits (exact in any integer type).
pub(crate) const SAMPLE_OUT: usize = 3;

/// The least finite f32: a logit below it is minus infinity (WGSL rejects an infinite
/// literal).
#[cube]
fn lowest() -> f32 {
    f32::new(-3.402_823_5e38)
}

/// The sum of every unit's `value` in a fixed tree order (unit `u + half` into unit
/// `u`), through `scratch` (a value per unit); every unit gets it. The order depends on
/// the cube's width only.
#[cube]
fn cube_sum(value: f32, scratch: &mut SharedMemory<f32>) -> f32 {
    let u = UNIT_POS_X as usize;
    scratch[u] = value;
    sync_cube();
    let mut half = CUBE_DIM_X / 2;
    while half > 0 {
        let stride = half as usize;
        if u < stride {
            scratch[u] = scratch[u] + scratch[u + stride];
        }
        sync_cube();
        half /= 2;
    }
    let total = scratch[0];
    sync_cube();
    total
}

/// [`cube_sum`] of counts.
#[cube]
fn cube_count(value: u32, scratch: &mut SharedMemory<u32>) -> u32 {
    let u = UNIT_POS_X as usize;
    scratch[u] = value;
    sync_cube();
    let mut half = CUBE_DIM_X / 2;
    while half > 0 {
        let stride = half as usize;
        if u < stride {
            scratch[u] = scratch[u] + scratch[u + stride];
        }
        sync_cube();
        half /= 2;
    }
    let total = scratch[0];
    sync_cube();
    total
}

/// A float's place in the total order of floats as an unsigned integer (larger float,
/// larger key; `-0` just below `+0`).
#[cube]
fn order_key(v: f32) -> u32 {
    let bits = v.to_bits();
    let mut key = bits | 0x8000_0000u32;
    if (bits >> 31) == 1 {
        key = 0xffff_ffffu32 ^ bits;
    }
    key
}

/// The float of an [`order_key`].
#[cube]
fn key_value(key: u32) -> f32 {
    let mut bits = 0xffff_ffffu32 ^ key;
    if (key >> 31) == 1 {
        bits = key & 0x7fff_ffffu32;
    }
    f32::from_bits(bits)
}

/// The host pipeline's weight of a logit: `e^((l - max) / t)` for logits at or above
/// `threshold` (top-k), 0 for the others and for minus infinity.
#[cube]
fn sample_weight(l: f32, max: f32, inv_t: f32, threshold: f32) -> f32 {
    let mut w = f32::new(0.0);
    if l >= threshold && l >= lowest() {
        w = ((l - max) * inv_t).exp();
    }
    w
}

/// One token per row of `logits` `[rows, vocab]`, drawn as the host pipeline draws it
/// ([`crate::sampling::pipeline`]: temperature, top-k, top-p, min-p, then the row's
/// uniform over the kept weights in id order), with its raw log-probability (the
/// model's log-softmax). `draws` holds [`DeviceDraw::words`](crate::sampling::DeviceDraw::words)
/// per row; `out` [`SAMPLE_OUT`] words per row, the token `vocab` where the row holds a
/// NaN, a `+inf` or no finite logit (the host path's business).
///
/// One cube per row, `width` units; every sum is over the units' strided (or, for the
/// draw, contiguous) shares in id order, then combined in a fixed tree, so a row's
/// token depends on the row alone, whatever the batch. The passes:
///
/// 1. the largest logit and its first index (the greedy token), and NaN;
/// 2. `sum(e^(l - max))`, the log-probability's normalizer;
/// 3. top-k: the `k`-th largest logit, by a search over the bits of its [`order_key`]
///    (32 counting passes): the largest key with at least `k` logits at or above it;
/// 4. top-p: the largest weight `c` such that the weights at or above `c` reach `top_p`
///    of the total, by a search over the bits of `c` (31 summing passes); min-p: the
///    larger of that and `min_p` (the largest weight is `e^0 = 1`);
/// 5. the draw: each unit sums the kept weights of its contiguous share of ids, unit 0
///    finds the share where `uniform * total` falls and walks it id by id.
#[cube(launch)]
pub(crate) fn sample_kernel<F: Float, I: Numeric>(
    logits: &Tensor<F>,
    draws: &Tensor<I>,
    out: &mut Tensor<I>,
    vocab: u32,
    #[comptime] width: usize,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let row = CUBE_POS_X as usize;
    let u = UNIT_POS_X as usize;
    let none = vocab;
    let n = vocab as usize;
    let base = row * n;
    let p = row * 6;
    let greedy = u32::cast_from(draws[p]);
    let uniform = f32::from_bits(u32::cast_from(draws[p + 1]));
    let inv_t = f32::from_bits(u32::cast_from(draws[p + 2]));
    let top_k = u32::cast_from(draws[p + 3]);
    let top_p = f32::from_bits(u32::cast_from(draws[p + 4]));
    let min_p = f32::from_bits(u32::cast_from(draws[p + 5]));

    let mut sums = SharedMemory::<f32>::new(width);
    let mut counts = SharedMemory::<u32>::new(width);
    let mut indices = SharedMemory::<u32>::new(width);

    // 1. The largest logit, its first index and NaN (as `argmax_kernel`).
    row_argmax(logits, base, n, &mut sums, &mut indices, &mut counts, width);
    let max = sums[0];
    let argmax = indices[0];
    let mut bad = counts[0] != 0 || argmax == none;
    if max < lowest() || max > f32::new(3.402_823_5e38) {
        bad = true;
    }
    sync_cube();

    // 2. The normalizer of the log-probabilities.
    let mut s = f32::new(0.0);
    let mut i = u;
    while i < n {
        let l = f32::cast_from(logits[base + i]);
        if l >= lowest() {
            s += (l - max).exp();
        }
        i += width;
    }
    let z = cube_sum(s, &mut sums);

    // 3. Top-k: the k-th largest logit.
    let mut threshold = lowest();
    if top_k > 0 {
        let mut t = 0u32;
        for bit in 0..32u32 {
            let candidate = t | (1u32 << (31 - bit));
            let mut c = 0u32;
            i = u;
            while i < n {
                if order_key(f32::cast_from(logits[base + i])) >= candidate {
                    c += 1;
                }
                i += width;
            }
            if cube_count(c, &mut counts) >= top_k {
                t = candidate;
            }
        }
        threshold = key_value(t);
    }

    // 4. Top-p and min-p: the smallest weight kept.
    let mut cut = f32::new(0.0);
    if top_p < f32::new(1.0) {
        let mut s = f32::new(0.0);
        i = u;
        while i < n {
            s += sample_weight(f32::cast_from(logits[base + i]), max, inv_t, threshold);
            i += width;
        }
        let target = top_p * cube_sum(s, &mut sums);
        let mut t = 0u32;
        for bit in 0..31u32 {
            let candidate = t | (1u32 << (30 - bit));
            let c = f32::from_bits(candidate);
            let mut s = f32::new(0.0);
            i = u;
            while i < n {
                let w = sample_weight(f32::cast_from(logits[base + i]), max, inv_t, threshold);
                if w >= c {
                    s += w;
                }
                i += width;
            }
            if cube_sum(s, &mut sums) >= target {
                t = candidate;
            }
        }
        cut = f32::from_bits(t);
    }
    if min_p > cut {
        cut = min_p;
    }

    // 5. The draw: the kept weights of each unit's contiguous share of ids.
    let units = CUBE_DIM_X as usize;
    let mut chunk = n / units;
    if chunk * units < n {
        chunk += 1;
    }
    let start = u * chunk;
    let mut end = start + chunk;
    if end > n {
        end = n;
    }
    let mut s = f32::new(0.0);
    let mut last = none;
    i = start;
    while i < end {
        let w = sample_weight(f32::cast_from(logits[base + i]), max, inv_t, threshold);
        if w > f32::new(0.0) && w >= cut {
            s += w;
            last = i as u32;
        }
        i += 1;
    }
    sums[u] = s;
    indices[u] = last;
    sync_cube();
    if u == 0 {
        let mut total = f32::new(0.0);
        for c in 0..units {
            total += sums[c];
        }
        let mut r = uniform * total;
        let mut found = units;
        let mut row_last = none;
        for c in 0..units {
            if found == units {
                if r < sums[c] {
                    found = c;
                } else {
                    r -= sums[c];
                }
            }
            if indices[c] != none {
                row_last = indices[c];
            }
        }
        let mut token = row_last;
        if found < units {
            // Rounding can leave `r` past the share's own walk: its last kept token.
            token = indices[found];
            let mut done = false;
            i = found * chunk;
            let mut end = i + chunk;
            if end > n {
                end = n;
            }
            while i < end {
                let w = sample_weight(f32::cast_from(logits[base + i]), max, inv_t, threshold);
                if !done && w > f32::new(0.0) && w >= cut {
                    if r < w {
                        token = i as u32;
                        done = true;
                    } else {
                        r -= w;
                    }
                }
                i += 1;
            }
        }
        if greedy == 1 {
            token = argmax;
        }
        if bad {
            token = none;
        }
        let mut logprob = f32::new(0.0);
        if token != none {
            let l = f32::cast_from(logits[base + token as usize]);
            logprob = (l - max) - z.ln();
            if logprob > f32::new(0.0) {
                logprob = f32::new(0.0);
            }
        }
        let bits = logprob.to_bits();
        out[row * 3] = I::cast_from(token);
        out[row * 3 + 1] = I::cast_from(bits >> 16);
        out[row * 3 + 2] = I::cast_from(bits & 0xffffu32);
    }
}

/// Units per cube of the row kernels ([`rms_norm_kernel`], [`add_rms_norm_kernel`]).
pub(crate) const NORM_WIDTH: usize = 256;

/// RMSNorm of the row of `d` values at `at` (of `x`, or of `x + delta` in `F` with `add`)
/// into `out`, as the CPU computes it ([`crate::kernels::activation::rms_norm`]): the
/// squares in 16 interleaved sums (value `i` into sum `i % 16`, each in order, one unit
/// each), added pairwise (`s[l] += s[l + 8]`, then 4, 2, 1), `1 / sqrt(sum / d + eps)`
/// with the division and root rounded to nearest, then `x * inv * weight`, each step
/// rounded on its own, so for `f32` the CPU's bits. The order depends on `d` alone,
/// never on the number of rows.
#[cube]
#[allow(clippy::too_many_arguments)]
fn norm_row<F: Float>(
    x: &Tensor<F>,
    delta: &Tensor<F>,
    weight: &Tensor<F>,
    out: &mut Tensor<F>,
    at: usize,
    d: usize,
    eps: f32,
    zero: u32,
    #[comptime] add: bool,
    #[comptime] native: bool,
) {
    let u = UNIT_POS_X as usize;
    let mut lanes = SharedMemory::<f32>::new(16usize);
    let mut inv_at = SharedMemory::<f32>::new(1usize);
    if u < 16usize {
        lanes[u] = square_sum::<F>(x, delta, at, u, d, zero, add);
    }
    sync_cube();
    if u == 0 {
        inv_at[0] = inverse_rms(&lanes, 0, d, eps, zero, native);
    }
    sync_cube();
    let inv = inv_at[0];
    let mut i = u;
    while i < d {
        let v = norm_input::<F>(x, delta, at + i, add);
        out[at + i] = normed::<F>(v, inv, weight, i, zero);
        i += CUBE_DIM_X as usize;
    }
}

/// The sum, in order, of the squares of values `lane`, `lane + 16`, ... below `d` of the
/// norm input at `at` ([`norm_input`]): one of the 16 interleaved sums of [`norm_row`].
#[cube]
fn square_sum<F: Float>(
    x: &Tensor<F>,
    delta: &Tensor<F>,
    at: usize,
    lane: usize,
    d: usize,
    zero: u32,
    #[comptime] add: bool,
) -> f32 {
    let mut squares = f32::new(0.0);
    let mut i = lane;
    while i < d {
        let v = norm_input::<F>(x, delta, at + i, add);
        squares = opaque(squares + product(v, v, zero), zero);
        i += 16usize;
    }
    squares
}

/// `1 / sqrt(sum / d + eps)` from the 16 interleaved sums of squares at
/// `sums[base..base + 16]`, added pairwise (`s[l] += s[l + 8]`, then 4, 2, 1), the
/// division and the root rounded to nearest: the CPU's steps (see [`norm_row`]).
#[cube]
fn inverse_rms(
    sums: &SharedMemory<f32>,
    base: usize,
    d: usize,
    eps: f32,
    zero: u32,
    #[comptime] native: bool,
) -> f32 {
    let mut s = Array::<f32>::new(16usize);
    #[unroll]
    for l in 0..16usize {
        s[l] = sums[base + l];
    }
    #[unroll]
    for l in 0..8usize {
        s[l] = opaque(s[l] + s[l + 8], zero);
    }
    #[unroll]
    for l in 0..4usize {
        s[l] = opaque(s[l] + s[l + 4], zero);
    }
    #[unroll]
    for l in 0..2usize {
        s[l] = opaque(s[l] + s[l + 2], zero);
    }
    s[0] = opaque(s[0] + s[1], zero);
    let mean = rounded_div(s[0], f32::cast_from(d as u32), zero, native);
    let root = rounded_sqrt(opaque(mean + eps, zero), zero, native);
    rounded_div(f32::new(1.0), root, zero, native)
}

/// Value `i` of a normed row: `v * inv` then times `weight[i]`, each product rounded on
/// its own, the result rounded to `F` (what [`norm_row`] stores).
#[cube]
fn normed<F: Float>(v: f32, inv: f32, weight: &Tensor<F>, i: usize, zero: u32) -> F {
    F::cast_from(product(
        product(v, inv, zero),
        f32::cast_from(weight[i]),
        zero,
    ))
}

/// [`normed`] as f32 (what a product's prologue takes).
#[cube]
fn normed_value<F: Float>(v: f32, inv: f32, weight: &Tensor<F>, i: usize, zero: u32) -> f32 {
    f32::cast_from(normed::<F>(v, inv, weight, i, zero))
}

/// Value `i` of a norm's input: `x[i]`, or with `add` the residual sum `x[i] + delta[i]`
/// rounded to `F` (the value [`add_rms_norm_kernel`] stores).
#[cube]
#[allow(unused_assignments)]
fn norm_input<F: Float>(x: &Tensor<F>, delta: &Tensor<F>, i: usize, #[comptime] add: bool) -> f32 {
    let mut v = f32::new(0.0);
    if comptime!(add) {
        v = f32::cast_from(x[i] + delta[i]);
    } else {
        v = f32::cast_from(x[i]);
    }
    v
}

/// RMSNorm: one cube of [`NORM_WIDTH`] units per row of `x` `[rows, d]` (see [`norm_row`]).
/// `zero` is 0 (see [`opaque`]); `native_fma` says whether the device's `fma` is fused.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn rms_norm_kernel<F: Float>(
    x: &Tensor<F>,
    weight: &Tensor<F>,
    out: &mut Tensor<F>,
    d: u32,
    eps: f32,
    zero: u32,
    #[comptime] native_fma: bool,
    #[define(F)] _dtype: StorageType,
) {
    let d = d as usize;
    norm_row::<F>(
        x,
        x,
        weight,
        out,
        CUBE_POS_X as usize * d,
        d,
        eps,
        zero,
        false,
        native_fma,
    );
}

/// The residual add and the next RMSNorm in one pass: `sum = x + delta` (in `F`, as a
/// plain tensor add rounds it), then `out` = RMSNorm of `sum`, one cube per row as
/// [`rms_norm_kernel`] (the norm recomputes the sum where it reads it rather than reading
/// another unit's store).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn add_rms_norm_kernel<F: Float>(
    x: &Tensor<F>,
    delta: &Tensor<F>,
    weight: &Tensor<F>,
    sum: &mut Tensor<F>,
    out: &mut Tensor<F>,
    d: u32,
    eps: f32,
    zero: u32,
    #[comptime] native_fma: bool,
    #[define(F)] _dtype: StorageType,
) {
    let d = d as usize;
    let at = CUBE_POS_X as usize * d;
    let mut i = UNIT_POS_X as usize;
    while i < d {
        sum[at + i] = x[at + i] + delta[at + i];
        i += NORM_WIDTH;
    }
    norm_row::<F>(x, delta, weight, out, at, d, eps, zero, true, native_fma);
}

/// Rotary position embedding in the rotate-half layout, one unit per value:
/// `x * cos + partner * sin` ([`cpu_rotate`], in f32), where a value's partner is the one
/// half a head away (the first half's sign is folded into `sin`). `x`, `cos`, `sin` and
/// `out` are `[rows, width]`, contiguous; `zero` is 0 (see [`opaque`]).
#[cube(launch)]
pub(crate) fn rope_kernel<F: Float>(
    x: &Tensor<F>,
    cos: &Tensor<F>,
    sin: &Tensor<F>,
    out: &mut Tensor<F>,
    head_dim: u32,
    zero: u32,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= out.len() {
        terminate!();
    }
    let head_dim = head_dim as usize;
    let half = head_dim / 2;
    let partner = select(i % head_dim < half, i + half, i - half);
    out[i] = F::cast_from(cpu_rotate(
        f32::cast_from(x[i]),
        f32::cast_from(cos[i]),
        f32::cast_from(x[partner]),
        f32::cast_from(sin[i]),
        zero,
    ));
}

/// SwiGLU element by element: `out = gate / (1 + e^-gate) * up` as the CPU computes it
/// ([`cpu_swiglu`], in f32, rounded once to `F`), one unit per value; `gate`, `up` and
/// `out` hold `out.len()` values, contiguous. `zero` is 0 (see [`opaque`]);
/// `native_fma` says whether the device's `fma` is fused.
#[cube(launch)]
pub(crate) fn swiglu_kernel<F: Float>(
    gate: &Tensor<F>,
    up: &Tensor<F>,
    out: &mut Tensor<F>,
    zero: u32,
    #[comptime] native_fma: bool,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= out.len() {
        terminate!();
    }
    out[i] = F::cast_from(cpu_swiglu(
        f32::cast_from(gate[i]),
        f32::cast_from(up[i]),
        zero,
        native_fma,
    ));
}

/// The position of query token `token` in a step's `meta` (the layout of
/// [`PagedBatch::device_table`](crate::model::attention::PagedBatch::device_table)).
#[cube]
fn token_position<I: Numeric>(meta: &Tensor<I>, token: usize) -> usize {
    u32::cast_from(meta[3 * token + 1]) as usize
}

/// The first slot of its table whose key query token `token` sees (0 unless its
/// sequence is left-padded: [`PagedBatch::first_key`](crate::model::attention::PagedBatch::first_key)).
#[cube]
fn first_key<I: Numeric>(meta: &Tensor<I>, token: usize) -> usize {
    u32::cast_from(meta[3 * token + 2]) as usize
}

/// Where query token `token`'s block table starts in `meta`.
#[cube]
fn table_at<I: Numeric>(meta: &Tensor<I>, token: usize) -> usize {
    u32::cast_from(meta[3 * token]) as usize
}

/// The row of head 0 at query token `token`'s slot in a pool of rows laid out `(block,
/// head, slot)`: the block that its table in `meta` names for its position, slot
/// `position % block_size`. Head `h`'s row is `h * block_size` past it.
#[cube]
fn slot_row<I: Numeric>(
    meta: &Tensor<I>,
    token: usize,
    kv_heads: usize,
    block_size: usize,
) -> usize {
    let table = table_at::<I>(meta, token);
    let position = token_position::<I>(meta, token);
    let block = u32::cast_from(meta[table + position / block_size]) as usize;
    block * kv_heads * block_size + position % block_size
}

/// Writes a step's keys `k` and values `v` (`[tokens, kv_heads * head_dim]`, rows
/// `k.stride(0)` apart: a column slice of a wider product is read in place) into a
/// layer's pools `keys`/`values` (`[blocks, kv_heads, block_size, head_dim]`) at each
/// token's slot: the block its table names for its position, `position % block_size`.
/// `meta` is the layout of [`PagedBatch::device_table`](crate::model::attention::PagedBatch::device_table)
/// (per token its table's offset, its position and its first key, then the tables), the
/// same upload as
/// the attention's. One cube per token.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn paged_store_kernel<F: Float, I: Numeric>(
    k: &Tensor<F>,
    v: &Tensor<F>,
    meta: &Tensor<I>,
    keys: &mut Tensor<F>,
    values: &mut Tensor<F>,
    kv_heads: u32,
    block_size: u32,
    head_dim: u32,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let token = CUBE_POS_X as usize;
    let (kv_heads, block_size, head_dim) =
        (kv_heads as usize, block_size as usize, head_dim as usize);
    let row = slot_row::<I>(meta, token, kv_heads, block_size);
    let width = kv_heads * head_dim;
    let (k_row, v_row) = (token * k.stride(0), token * v.stride(0));
    let mut c = UNIT_POS_X as usize;
    while c < width {
        let h = c / head_dim;
        let dst = (row + h * block_size) * head_dim + c % head_dim;
        keys[dst] = k[k_row + c * k.stride(1)];
        values[dst] = v[v_row + c * v.stride(1)];
        c += CUBE_DIM_X as usize;
    }
}

/// RoPE on a step's queries and keys and the paged write of its keys and values, one
/// launch for [`rope_kernel`] and [`paged_store_kernel`]: `qk` `[tokens, q_width +
/// kv_heads * head_dim]` (the projection's queries then keys, rows `qk.stride(0)` apart)
/// is rotated with [`rope_kernel`]'s expression by the angles of each token's position,
/// read from the tables `cos`/`sin` (`[positions, head_dim]`, contiguous; the position is
/// the one `meta` gives for the store, so no gathered copy is made); the queries go to `q`
/// (`[tokens, q_width]`), the keys
/// and `v` (`[tokens, kv_heads * head_dim]`, rows `v.stride(0)` apart) to the pools at
/// each token's slot, as [`paged_store_kernel`] writes them (`meta` its table). One cube
/// per token.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn rope_paged_store_kernel<F: Float, I: Numeric>(
    qk: &Tensor<F>,
    v: &Tensor<F>,
    cos: &Tensor<F>,
    sin: &Tensor<F>,
    meta: &Tensor<I>,
    q: &mut Tensor<F>,
    keys: &mut Tensor<F>,
    values: &mut Tensor<F>,
    q_width: u32,
    kv_heads: u32,
    block_size: u32,
    head_dim: u32,
    zero: u32,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let token = CUBE_POS_X as usize;
    let (q_width, kv_heads, block_size, head_dim) = (
        q_width as usize,
        kv_heads as usize,
        block_size as usize,
        head_dim as usize,
    );
    let position = token_position::<I>(meta, token);
    let row = slot_row::<I>(meta, token, kv_heads, block_size);
    let kv_width = kv_heads * head_dim;
    let width = q_width + kv_width;
    let half = head_dim / 2;
    let (qk_row, v_row, angle_row) = (
        token * qk.stride(0),
        token * v.stride(0),
        position * head_dim,
    );
    let mut c = UNIT_POS_X as usize;
    while c < width {
        let partner = select(c % head_dim < half, c + half, c - half);
        let i = angle_row + c % head_dim;
        let rotated = F::cast_from(cpu_rotate(
            f32::cast_from(qk[qk_row + c * qk.stride(1)]),
            f32::cast_from(cos[i]),
            f32::cast_from(qk[qk_row + partner * qk.stride(1)]),
            f32::cast_from(sin[i]),
            zero,
        ));
        if c < q_width {
            q[token * q_width + c] = rotated;
        } else {
            let kc = c - q_width;
            let dst = (row + kc / head_dim * block_size) * head_dim + kc % head_dim;
            keys[dst] = rotated;
            values[dst] = v[v_row + kc * v.stride(1)];
        }
        c += CUBE_DIM_X as usize;
    }
}

/// The most quantized blocks (32 values each) one token's keys or values may hold in
/// [`paged_store_encoded_kernel`]: `kv_heads * head_dim / 32`, one scale each in shared
/// memory.
pub(crate) const ENCODED_SCALES: usize = 1024;

/// The bits of `x` rounded to an IEEE half, to nearest with ties to even (as the `half`
/// crate's `f16::from_f32`, which encodes the CPU's cache): overflow to infinity,
/// subnormals kept, a NaN quiet.
#[cube]
fn f32_to_half_bits(x: f32) -> u32 {
    let bits = x.to_bits();
    let sign = (bits >> 16) & 0x8000;
    let exp = (bits >> 23) & 255;
    let man = bits & 0x007f_ffff;
    let mut out = sign;
    if exp == 255 {
        out = sign | 0x7c00;
        if man != 0 {
            out = sign | 0x7e00 | (man >> 13);
        }
    } else if exp >= 143 {
        // 2^16 and above: past the largest half.
        out = sign | 0x7c00;
    } else if exp >= 113 {
        // A normal half: exponent `exp - 112`, ten bits of mantissa, rounded.
        let half_man = man >> 13;
        let round = man & 0x1000;
        out = sign | (((exp - 112) << 10) | half_man);
        if round != 0 && (man & 0x2fff) != 0 {
            out += 1;
        }
    } else if exp >= 102 {
        // A subnormal half: the implicit bit shifted in, rounded at the shift.
        let m = man | 0x0080_0000;
        let shift = 126 - exp;
        let half_man = m >> shift;
        let round = 1u32 << (shift - 1);
        out = sign | half_man;
        if (m & round) != 0 && (m & (3 * round - 1)) != 0 {
            out += 1;
        }
    }
    out
}

/// The bits of `x` rounded to a bfloat16, to nearest with ties to even (as
/// `half::bf16::from_f32`): a NaN quiet.
#[cube]
fn f32_to_bf16_bits(x: f32) -> u32 {
    let bits = x.to_bits();
    let mut out = bits >> 16;
    if (bits & 0x7fff_ffff) > 0x7f80_0000 {
        out |= 0x40;
    } else if (bits & 0x8000) != 0 && (bits & 0x17fff) != 0 {
        out += 1;
    }
    out
}

/// A run's activation scales as the CPU's quantizer takes them from its largest
/// magnitude `amax`: `d = amax / 127` and `1 / d`, each rounded to nearest (both 0 for
/// a run of zeros), stored at `scales[2 * run]` and `scales[2 * run + 1]`. The one place
/// both integer products (`int_product`, `int_tiles_product`) say it.
#[cube]
fn store_run_scales(
    scales: &mut SharedMemory<f32>,
    run: usize,
    amax: f32,
    zero: u32,
    #[comptime] native: bool,
) {
    let mut d = f32::new(0.0);
    let mut id = f32::new(0.0);
    if amax > 0.0 {
        d = rounded_div(amax, f32::new(127.0), zero, native);
        id = rounded_div(f32::new(1.0), d, zero, native);
    }
    scales[2 * run] = d;
    scales[2 * run + 1] = id;
}

/// An activation's 8-bit code as the CPU's quantizer takes it: `v * id` rounded half
/// away from zero, clamped to `-127..=127` (`|round(v / d)| <= 127` already; the clamp
/// keeps a rounding slip in range).
#[cube]
fn activation_code(v: f32, id: f32) -> i32 {
    i32::cast_from(round_half_away(v * id).clamp(-127.0, 127.0))
}

/// `t` rounded to the nearest integer, halves away from zero (Rust's `f32::round`, which
/// the CPU's `q8_0` uses; WGSL's `round` takes halves to even).
#[cube]
fn round_half_away(t: f32) -> f32 {
    let a = t.abs();
    let mut r = a.floor();
    if a - r >= 0.5 {
        r += 1.0;
    }
    if t < 0.0 {
        r = -r;
    }
    r
}

/// The value of a 4-bit `q4_0` code: `min(15, x * id + 8.5)` truncated (ggml's rule).
#[cube]
fn q4_0_code(v: f32, id: f32) -> u32 {
    let t = (v * id + 8.5).floor();
    u32::cast_from(t.clamp(0.0, 15.0))
}

/// Byte `i` of the encoded row (a `q8_0` or `q4_0` row of the type `ty`, 3 or 4) of the
/// values `x[at + e * stride]`, `e` in `0..head_dim`, whose blocks' scales start at
/// `scales[first]`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn quant_row_byte<F: Float>(
    x: &Tensor<F>,
    at: usize,
    stride: usize,
    scales: &SharedMemory<f32>,
    first: usize,
    ty: u32,
    i: usize,
) -> u32 {
    let mut block_bytes = 34usize;
    if ty == 4 {
        block_bytes = 18;
    }
    let b = i / block_bytes;
    let o = i % block_bytes;
    let d = scales[first + b];
    let mut id = f32::new(0.0);
    if d != 0.0 {
        id = 1.0 / d;
    }
    let base = at + b * 32 * stride;
    // The scale's two bytes first, then the codes.
    let mut byte = (f32_to_half_bits(d) >> (((o % 2) * 8) as u32)) & 255;
    if o < 2 {
        // The scale's byte, above.
    } else if ty == 3 {
        let q = round_half_away(f32::cast_from(x[base + (o - 2) * stride]) * id);
        byte = u32::cast_from(q.clamp(-128.0, 127.0) + 256.0) & 255;
    } else {
        let lo = q4_0_code(f32::cast_from(x[base + (o - 2) * stride]), id);
        let hi = q4_0_code(f32::cast_from(x[base + (o + 14) * stride]), id);
        byte = lo | (hi << 4);
    }
    byte
}

/// The paged store into an encoded pool: a step's rows `x` (`[tokens, kv_heads *
/// head_dim]`, `x.stride(0)` apart) encoded in the [`KvCacheType`](crate::cache::KvCacheType)
/// of code `ty` (`kernel_code`) into the word pool `pool` (rows of `row_words` words,
/// `(block, head, slot)` in order: the host encoded pool's bytes, four to a word) at each
/// token's slot, which `meta` (the attention's table) gives. One cube per token: its
/// units first find the scale of each 32-value block of the token (a `q8_0` or `q4_0`
/// type), then each writes whole words of the token's rows, so no word is written by two
/// units and a token's bytes are those of its own values alone, as the host's encoding
/// makes them.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn paged_store_encoded_kernel<F: Float, I: Numeric>(
    x: &Tensor<F>,
    meta: &Tensor<I>,
    pool: &mut Tensor<I>,
    ty: u32,
    kv_heads: u32,
    block_size: u32,
    head_dim: u32,
    row_words: u32,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let token = CUBE_POS_X as usize;
    let (kv_heads, block_size, head_dim, row_words) = (
        kv_heads as usize,
        block_size as usize,
        head_dim as usize,
        row_words as usize,
    );
    let row = slot_row::<I>(meta, token, kv_heads, block_size);
    let x_row = token * x.stride(0);
    let xs = x.stride(1);

    let mut scales = SharedMemory::<f32>::new(ENCODED_SCALES);
    if ty >= 3 {
        let n = kv_heads * head_dim / 32;
        let mut b = UNIT_POS_X as usize;
        while b < n {
            let mut amax = f32::new(0.0);
            let mut max = f32::new(0.0);
            for i in 0..32usize {
                let v = f32::cast_from(x[x_row + (b * 32 + i) * xs]);
                if amax < v.abs() {
                    amax = v.abs();
                    max = v;
                }
            }
            let mut d = amax / 127.0;
            if ty == 4 {
                d = max / -8.0;
            }
            scales[b] = d;
            b += CUBE_DIM_X as usize;
        }
    }
    sync_cube();

    let words = kv_heads * row_words;
    let mut w = UNIT_POS_X as usize;
    while w < words {
        let h = w / row_words;
        let rw = w % row_words;
        let at = x_row + h * head_dim * xs;
        let mut word = 0u32;
        if ty == 0 {
            word = f32::cast_from(x[at + rw * xs]).to_bits();
        } else if ty == 1 {
            word = f32_to_half_bits(f32::cast_from(x[at + 2 * rw * xs]))
                | (f32_to_half_bits(f32::cast_from(x[at + (2 * rw + 1) * xs])) << 16);
        } else if ty == 2 {
            word = f32_to_bf16_bits(f32::cast_from(x[at + 2 * rw * xs]))
                | (f32_to_bf16_bits(f32::cast_from(x[at + (2 * rw + 1) * xs])) << 16);
        } else {
            let first = h * head_dim / 32;
            for j in 0..4usize {
                let byte = quant_row_byte::<F>(x, at, xs, &scales, first, ty, 4 * rw + j);
                word |= byte << ((j * 8) as u32);
            }
        }
        let dst = (row + h * block_size) * row_words + rw;
        pool[dst] = I::cast_from(word);
        w += CUBE_DIM_X as usize;
    }
}

/// Value `e` of the encoded row starting at word `row` of `pool`, of the type of code
/// `ty` (as the host's `KvCacheType::decode` gives it: a half's or a bfloat16's value
/// exactly, a quantized code times its block's scale).
#[cube]
#[allow(unused_assignments)]
fn encoded_value<I: Numeric>(pool: &Tensor<I>, ty: u32, row: usize, e: usize) -> f32 {
    let mut v = f32::new(0.0);
    if ty == 0 {
        v = f32::from_bits(u32::cast_from(pool[row + e]));
    } else if ty <= 2 {
        let half = (u32::cast_from(pool[row + e / 2]) >> (((e % 2) * 16) as u32)) & 0xffff;
        if ty == 1 {
            v = half_to_f32(half);
        } else {
            v = f32::from_bits(half << 16);
        }
    } else {
        let mut block_bytes = 34usize;
        if ty == 4 {
            block_bytes = 18;
        }
        let at = row * 4 + (e / 32) * block_bytes;
        let d = half_to_f32(byte_at::<I>(pool, at) | (byte_at::<I>(pool, at + 1) << 8));
        let i = e % 32;
        if ty == 3 {
            v = signed_byte(byte_at::<I>(pool, at + 2 + i)) * d;
        } else {
            let byte = byte_at::<I>(pool, at + 2 + i % 16);
            let mut code = byte & 15;
            if i >= 16 {
                code = byte >> 4;
            }
            v = (f32::cast_from(code) - 8.0) * d;
        }
    }
    v
}

/// [`paged_attention_kernel`] over encoded word pools (see [`paged_store_encoded_kernel`]):
/// keys of type code `k_ty` in rows of `k_words` words, values of `v_ty` in rows of
/// `v_words`. Each key is decoded as its score is taken, each value as it is accumulated;
/// no decoded copy of the cache is made. The same cube layout, the same orders and
/// roundings (the CPU's), so a token's result depends on its own sequence alone.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn paged_attention_encoded_kernel<F: Float, I: Numeric>(
    q: &Tensor<F>,
    keys: &Tensor<I>,
    values: &Tensor<I>,
    meta: &Tensor<I>,
    out: &mut Tensor<F>,
    n_heads: u32,
    groups: u32,
    kv_heads: u32,
    block_size: u32,
    scale: f32,
    k_ty: u32,
    k_words: u32,
    v_ty: u32,
    v_words: u32,
    zero: u32,
    #[comptime] dim: usize,
    #[comptime] heads: usize,
    #[comptime] key_tile: usize,
    #[comptime] native_fma: bool,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    attend_in_cpu_order::<F, I, I>(
        q, keys, values, meta, out, n_heads, groups, kv_heads, block_size, scale, k_ty, k_words,
        v_ty, v_words, zero, dim, heads, key_tile, true, native_fma,
    );
}
