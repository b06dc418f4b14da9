//! The activations of a `fast` product quantized to 8 bits: runs of 32-value blocks that
//! share one scale, each block's scale and sums kept beside its values.

use super::super::cpu::{SimdPath, Slot, on_simd_path};
use super::super::pool::Disjoint;
use super::QK;
use std::mem::MaybeUninit;

/// Activation rows quantized in runs of 32-value blocks that share one scale (a run of
/// one block for the 32-value weight formats, as ggml's `Q8_0`; of eight for the
/// K-quants, as `Q8_K`), each block's scale and sums kept per block.
pub(crate) struct QuantizedRows {
    /// Values per row.
    pub(super) n_in: usize,
    /// The quantized values, row-major.
    pub(super) q: Vec<i8>,
    /// Each block's scale.
    pub(super) d: Vec<f32>,
    /// Each block's scale times the sum of its values.
    pub(super) sx: Vec<f32>,
    /// The sums of each block's two 16-value halves.
    pub(super) sum16: Vec<i32>,
}

impl QuantizedRows {
    /// Quantizes `rows` rows of `n_in` values (a multiple of `32 * run`) as ggml's
    /// `Q8_0` reference does, with the scale kept in f32, each run of `run` 32-value
    /// blocks sharing the scale of its largest magnitude.
    pub(crate) fn new(x: &[f32], rows: usize, n_in: usize, run: usize) -> Self {
        let blocks = rows * n_in / QK;
        let mut out = Self {
            n_in,
            q: vec![0; rows * n_in],
            d: Vec::with_capacity(blocks),
            sx: Vec::with_capacity(blocks),
            sum16: Vec::with_capacity(2 * blocks),
        };
        for (xr, qr) in x
            .chunks_exact(QK * run)
            .zip(out.q.chunks_exact_mut(QK * run))
        {
            let amax = xr.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            for (xb, qb) in xr.chunks_exact(QK).zip(qr.chunks_exact_mut(QK)) {
                for (q, &v) in qb.iter_mut().zip(xb) {
                    *q = (v * id).round() as i8;
                }
                let half = |h: &[i8]| h.iter().map(|&q| i32::from(q)).sum::<i32>();
                let (lo, hi) = (half(&qb[..16]), half(&qb[16..]));
                out.d.push(d);
                out.sx.push(d * (lo + hi) as f32);
                out.sum16.extend([lo, hi]);
            }
        }
        out
    }

    /// [`new`](Self::new) on `path`: the same bits, in the path's vectors (`round` is a
    /// library call per value in plain Rust; here it is a truncation and a comparison of
    /// the remainder, which gives its bits and vectorizes).
    pub(crate) fn new_on(path: SimdPath, x: &[f32], rows: usize, n_in: usize, run: usize) -> Self {
        let blocks = rows * n_in / QK;
        // A prompt's rows are split between the pool's threads in runs of whole blocks
        // (each run of blocks is quantized alone, so the split changes no bit); a decode
        // step's few rows are not worth a split. The split's runs are whole runs of
        // blocks (`PARALLEL_QUANTIZE_BLOCKS / 2` is a multiple of 8).
        let per = if blocks >= PARALLEL_QUANTIZE_BLOCKS {
            PARALLEL_QUANTIZE_BLOCKS / 2
        } else {
            blocks
        };
        let run = run.max(1);
        // The blocks in whole runs (all of them where `n_in` is a multiple of `32 * run`,
        // as the callers' weights make it); any others are zeros.
        let covered = blocks / run * run;
        let fill = |target: &Blocks| {
            super::super::pool::for_each_run(covered, per, &|first, end| {
                let x = &x[first * QK..end * QK];
                // SAFETY: this run alone writes blocks `first..end`, inside the buffers
                // (`end <= covered <= blocks`).
                let out = unsafe { target.part(first, end - first) };
                on_simd_path!(path, quantize_blocks[
                    Q: Slot<i8>, F: Slot<f32>, S: Slot<i32>
                ](
                    x: &[f32],
                    out: Outputs<'_, Q, F, S>,
                    run: usize,
                ));
            });
        };
        // SAFETY: the runs of the split cover blocks `0..covered` (`per` is a multiple of
        // `run`, or all the blocks), and `quantize_blocks` writes every value, scale and
        // sum of the whole runs it is given.
        unsafe { Self::written(n_in, blocks, covered, fill) }
    }

    /// [`new_on`](Self::new_on) of `rms_norm(x, weight, eps)` (as
    /// [`activation::rms_norm`](crate::kernels::activation::rms_norm) computes it) without
    /// the normalized rows in memory: each row normalized into a buffer of one row, which
    /// stays in the first-level cache, and quantized from there. The same bits as the
    /// norm and then the quantization; a prompt's rows split between the pool's threads.
    /// `n_in` is `weight.len()`, a multiple of `32 * run`, and `x` holds `rows` rows of it.
    pub(crate) fn normed_on(
        path: SimdPath,
        x: &[f32],
        weight: &[f32],
        eps: f32,
        rows: usize,
        run: usize,
    ) -> Self {
        let n_in = weight.len();
        debug_assert!(n_in.is_multiple_of(QK * run.max(1)) && x.len() >= rows * n_in);
        let (blocks, per_row) = (rows * n_in / QK, n_in / QK);
        let fill = |target: &Blocks| {
            // Split as the plain quantization splits (from the same number of blocks, in
            // runs of rows of about half as many).
            let split = PARALLEL_QUANTIZE_BLOCKS * QK;
            crate::kernels::activation::for_row_runs(rows, n_in, split, &|first, end| {
                let x = &x[first * n_in..end * n_in];
                // SAFETY: these rows alone write their blocks, inside the buffers (`end
                // <= rows`).
                let out = unsafe { target.part(first * per_row, (end - first) * per_row) };
                let mut buffer = vec![0f32; n_in];
                let row = buffer.as_mut_slice();
                on_simd_path!(path, norm_quantize_rows[
                    Q: Slot<i8>, F: Slot<f32>, S: Slot<i32>
                ](
                    x: &[f32],
                    weight: &[f32],
                    eps: f32,
                    row: &mut [f32],
                    out: Outputs<'_, Q, F, S>,
                    run: usize,
                ));
            });
        };
        // SAFETY: the runs of rows cover rows `0..rows`, and `norm_quantize_rows` writes
        // every value, scale and sum of each row it is given (whole runs: `n_in` is a
        // multiple of `32 * run`).
        unsafe { Self::written(n_in, blocks, blocks, fill) }
    }

    /// Rows of `n_in` values, `blocks` blocks in all, each block's values, scale and sums
    /// written once: blocks `0..covered` by `fill` (given the buffers unwritten, to split
    /// between the pool's threads), the others zeros. No clearing pass: a prompt's
    /// values are megabytes.
    ///
    /// # Safety
    ///
    /// `fill` writes every value, scale and sum of blocks `0..covered <= blocks`.
    unsafe fn written(
        n_in: usize,
        blocks: usize,
        covered: usize,
        fill: impl FnOnce(&Blocks),
    ) -> Self {
        let (mut q, mut d, mut sx, mut sum16) = (
            Vec::<i8>::with_capacity(blocks * QK),
            Vec::<f32>::with_capacity(blocks),
            Vec::<f32>::with_capacity(blocks),
            Vec::<i32>::with_capacity(2 * blocks),
        );
        {
            let target = Blocks {
                q: Disjoint::new(&mut q.spare_capacity_mut()[..blocks * QK]),
                d: Disjoint::new(&mut d.spare_capacity_mut()[..blocks]),
                sx: Disjoint::new(&mut sx.spare_capacity_mut()[..blocks]),
                sum16: Disjoint::new(&mut sum16.spare_capacity_mut()[..2 * blocks]),
            };
            // SAFETY: blocks `covered..blocks` lie inside the buffers, written here alone.
            let rest = unsafe { target.part(covered, blocks - covered) };
            rest.q.iter_mut().for_each(|v| {
                v.write(0);
            });
            rest.d.iter_mut().chain(rest.sx).for_each(|v| {
                v.write(0.0);
            });
            rest.sum16.iter_mut().for_each(|v| {
                v.write(0);
            });
            fill(&target);
        }
        // SAFETY: blocks `0..covered` written by `fill` (the caller's contract), the rest
        // above.
        unsafe {
            q.set_len(blocks * QK);
            d.set_len(blocks);
            sx.set_len(blocks);
            sum16.set_len(2 * blocks);
        }
        Self {
            n_in,
            q,
            d,
            sx,
            sum16,
        }
    }

    /// Sub-blocks per row.
    pub(super) fn blocks(&self) -> usize {
        self.n_in / QK
    }
}

/// From this many 32-value blocks (64 Ki values: 32 rows of 2,048), the activations of a
/// product are quantized by the pool's threads, in runs of half as many blocks; below it
/// (a decode step) on the calling thread. A prompt of 150 tokens spent 7% of its
/// projections' time quantizing on one thread while the other waited.
const PARALLEL_QUANTIZE_BLOCKS: usize = 2048;

/// Where some blocks' quantized values, scales, scales times sums and half sums are
/// written.
struct Outputs<'a, Q, F, S> {
    q: &'a mut [Q],
    d: &'a mut [F],
    sx: &'a mut [F],
    sum16: &'a mut [S],
}

/// The buffers of [`QuantizedRows`] being written, split between the pool's threads by
/// blocks.
struct Blocks {
    q: Disjoint<MaybeUninit<i8>>,
    d: Disjoint<MaybeUninit<f32>>,
    sx: Disjoint<MaybeUninit<f32>>,
    sum16: Disjoint<MaybeUninit<i32>>,
}

impl Blocks {
    /// Blocks `first .. first + n`.
    ///
    /// # Safety
    ///
    /// They lie inside the buffers, and no other part given out overlaps them while this
    /// one lives.
    #[allow(clippy::type_complexity)]
    unsafe fn part(
        &self,
        first: usize,
        n: usize,
    ) -> Outputs<'_, MaybeUninit<i8>, MaybeUninit<f32>, MaybeUninit<i32>> {
        // SAFETY: the caller's contract.
        unsafe {
            Outputs {
                q: self.q.part(first * QK, n * QK),
                d: self.d.part(first, n),
                sx: self.sx.part(first, n),
                sum16: self.sum16.part(2 * first, 2 * n),
            }
        }
    }
}

/// [`QuantizedRows::normed_on`]'s rows: each row of `x` normalized into `row` (one
/// row's values) by RMSNorm's own steps, then quantized from there into its values,
/// scales and sums.
#[inline(always)]
fn norm_quantize_rows<Q: Slot<i8>, F: Slot<f32>, S: Slot<i32>>(
    x: &[f32],
    weight: &[f32],
    eps: f32,
    row: &mut [f32],
    out: Outputs<'_, Q, F, S>,
    run: usize,
) {
    let (n_in, per_row) = (weight.len(), weight.len() / QK);
    let Outputs { q, d, sx, sum16 } = out;
    let rows = x
        .chunks_exact(n_in)
        .zip(q.chunks_exact_mut(n_in))
        .zip(
            d.chunks_exact_mut(per_row)
                .zip(sx.chunks_exact_mut(per_row)),
        )
        .zip(sum16.chunks_exact_mut(2 * per_row));
    for (((x, q), (d, sx)), sum16) in rows {
        crate::kernels::activation::rms_norm_plain(x, weight, eps, row);
        quantize_blocks(row, Outputs { q, d, sx, sum16 }, run);
    }
}

/// [`QuantizedRows::new`]'s quantization of the 32-value blocks of `x` into `q`, each
/// block's scale into `d`, scale times sum into `sx` and half sums into `sum16`, written
/// so that the compiler vectorizes it: the maximum in 16 lanes (exact in any order), and
/// `round` (half away from zero) as `t = trunc(y)`, plus `sign(y)` where `|y - t| >=
/// 0.5` (`y - t` is exact).
#[inline(always)]
fn quantize_blocks<Q: Slot<i8>, F: Slot<f32>, S: Slot<i32>>(
    x: &[f32],
    out: Outputs<'_, Q, F, S>,
    run: usize,
) {
    let Outputs { q, d, sx, sum16 } = out;
    let runs = x
        .chunks_exact(QK * run)
        .zip(q.chunks_exact_mut(QK * run))
        .zip(d.chunks_exact_mut(run).zip(sx.chunks_exact_mut(run)))
        .zip(sum16.chunks_exact_mut(2 * run));
    for (((xr, qr), (dr, sxr)), sums) in runs {
        let mut lanes = [0f32; 16];
        for part in xr.chunks_exact(16) {
            for (m, v) in lanes.iter_mut().zip(part) {
                *m = m.max(v.abs());
            }
        }
        let amax = lanes.iter().fold(0f32, |m, &v| m.max(v));
        let scale = amax / 127.0;
        let id = if scale != 0.0 { 1.0 / scale } else { 0.0 };
        let blocks = xr
            .chunks_exact(QK)
            .zip(qr.chunks_exact_mut(QK))
            .zip(dr.iter_mut().zip(sxr.iter_mut()))
            .zip(sums.chunks_exact_mut(2));
        for (((xb, qb), (d, sx)), sums) in blocks {
            let mut ints = [0i32; QK];
            for ((q, int), &v) in qb.iter_mut().zip(ints.iter_mut()).zip(xb) {
                let y = v * id;
                let t = y.trunc();
                let r = if (y - t).abs() >= 0.5 {
                    t + 1f32.copysign(y)
                } else {
                    t
                };
                // |r| <= 127, or NaN, which `as` makes 0. The saturating `r as i32`
                // compiles to a scalar conversion and compare per value; with the NaN
                // taken to 0 first and the (no-op) clamp that proves the range, the
                // conversion is exact and vectorizes. 8.6% of a 150-token prefill went
                // to this function before.
                let r = if r.is_nan() {
                    0.0
                } else {
                    r.clamp(-127.0, 127.0)
                };
                // SAFETY: `r` is a finite whole number in `-127..=127`.
                *int = unsafe { r.to_int_unchecked::<i32>() };
                q.set(*int as i8);
            }
            let (lo, hi) = (
                ints[..16].iter().sum::<i32>(),
                ints[16..].iter().sum::<i32>(),
            );
            d.set(scale);
            sx.set(scale * (lo + hi) as f32);
            sums[0].set(lo);
            sums[1].set(hi);
        }
    }
}
