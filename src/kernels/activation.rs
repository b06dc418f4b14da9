//! Element-wise and row-wise kernels between projections on the CPU: the feed-forward
//! gate, RoPE and RMSNorm.

use super::attention::exp;
use super::cpu::{SimdPath, Slot, on_simd_path};

/// `gate = silu(gate) * up = gate / (1 + e^-gate) * up`, element by element and in
/// place (the gate's buffer becomes the output: a prompt's gate is megabytes, and a fresh
/// buffer for it cost page faults and a clearing pass), with the softmax's [`exp`]: one
/// pass instead of Burn's three (sigmoid, multiply, multiply), and no call into the C
/// library per value. Only element-wise operations, so the bits do not depend on the
/// vector width or on how the values are batched.
///
/// `gate` and `up` must have the same length (extra values are ignored).
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    let path = SimdPath::active();
    let n = gate.len().min(up.len());
    if n < SWIGLU_SPLIT {
        on_simd_path!(path, swiglu_plain(gate: &mut [f32], up: &[f32]));
        return;
    }
    // A prompt's gate (128 rows of 1,536 values and a division each) took 2.4% of a
    // prefill on one core while the other waited: split it across the cores.
    let per_chunk = SWIGLU_SPLIT / 2;
    let target = super::pool::Disjoint::new(&mut gate[..n]);
    super::pool::for_each_run(n, per_chunk, &|start, end| {
        // SAFETY: values `start..end < n` of `gate` belong to this chunk alone.
        let gate = unsafe { target.part(start, end - start) };
        let up = &up[start..end];
        on_simd_path!(path, swiglu_plain(gate: &mut [f32], up: &[f32]));
    });
}

/// Values from which [`swiglu`] is split across threads (a decode step of a few rows
/// stays on one: a hand-over costs more than it saves).
const SWIGLU_SPLIT: usize = 32 * 1024;

#[inline(always)]
fn swiglu_plain(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + exp(-*g)) * u;
    }
}

/// Rotary position embedding in the rotate-half layout, one pass:
/// `out[i] = x[i] * cos[i] + x[j] * sin[i]` where `j` is `i`'s partner in the other half
/// of its `head_dim`-value head (the first half's sign folded into `sin`). A multiply,
/// a multiply and an add, rounded separately: the bits of Burn's
/// `x * cos + rotate_half(x) * sin`.
///
/// `x`, `cos`, `sin` and `out` must have the same length, a multiple of `head_dim`
/// (an even number; extra values are ignored).
pub fn rope(x: &[f32], cos: &[f32], sin: &[f32], head_dim: usize, out: &mut [f32]) {
    on_simd_path!(
        SimdPath::active(),
        rope_plain(x: &[f32], cos: &[f32], sin: &[f32], head_dim: usize, out: &mut [f32])
    );
}

#[inline(always)]
fn rope_plain(x: &[f32], cos: &[f32], sin: &[f32], head_dim: usize, out: &mut [f32]) {
    if head_dim < 2 {
        return;
    }
    let heads = out
        .chunks_exact_mut(head_dim)
        .zip(x.chunks_exact(head_dim))
        .zip(cos.chunks_exact(head_dim).zip(sin.chunks_exact(head_dim)));
    for ((o, x), (c, s)) in heads {
        rope_head(x, c, s, o);
    }
}

/// One head of [`rope`]: `x`, its cosines `c` and sines `s` (`head_dim` values each,
/// an even number) into `o`, every value written.
#[inline(always)]
fn rope_head<O: Slot<f32>>(x: &[f32], c: &[f32], s: &[f32], o: &mut [O]) {
    let half = x.len() / 2;
    let (x1, x2) = x.split_at(half);
    let (o1, o2) = o.split_at_mut(half);
    let (c1, c2) = c.split_at(half);
    let (s1, s2) = s.split_at(half);
    for i in 0..half {
        o1[i].set(x1[i] * c1[i] + x2[i] * s1[i]);
        o2[i].set(x2[i] * c2[i] + x1[i] * s2[i]);
    }
}

/// [`rope`] of rows at their positions, reading the angles from the tables: row `r`
/// (`row(r)`, `width` values: whole heads of `head_dim`, an even number) is rotated by
/// the angles of position `positions[r]`, `cos_table` and `sin_table` being `[positions,
/// head_dim]` (the first half's sign folded into the sines), every head of the row by the
/// same angles. The bits of [`rope`] over the angles gathered and repeated for every head,
/// without gathering them (a prompt's angles were copied for every layer, megabytes each)
/// and with no pass that clears the output first; a prompt's rows are split across the
/// pool's threads (on one thread, RoPE was 2.7% of a 450-token prefill while the other
/// core waited).
///
/// # Panics
///
/// If `width` is not whole heads, a row is shorter than `width` or a position is past
/// the tables: the caller checks them.
pub fn rope_at<'a>(
    row: &(dyn Fn(usize) -> &'a [f32] + Sync),
    width: usize,
    cos_table: &[f32],
    sin_table: &[f32],
    positions: &[usize],
    head_dim: usize,
) -> Vec<f32> {
    assert!(head_dim >= 2 && head_dim.is_multiple_of(2) && width.is_multiple_of(head_dim));
    let path = SimdPath::active();
    let angles = &Angles {
        cos: cos_table,
        sin: sin_table,
        positions,
        head_dim,
    };
    let write = |start: usize, out: &mut [std::mem::MaybeUninit<f32>]| {
        on_simd_path!(path, rope_rows['a](
            row: &(dyn Fn(usize) -> &'a [f32] + Sync),
            start: usize,
            width: usize,
            angles: &Angles<'_>,
            out: &mut [std::mem::MaybeUninit<f32>],
        ));
    };
    // SAFETY: `rope_rows` writes every head of every row it is given.
    unsafe { rows_written(positions.len(), width, ROPE_SPLIT, &write) }
}

/// A fresh vector of `rows` rows of `width` values, each written once by `write(start,
/// out)`, which is given rows `start ..` (as many whole rows as `out` holds) not yet
/// written: on the calling thread below `split` values, else in runs of rows of about
/// half as many values across the pool's threads.
///
/// # Safety
///
/// `write` writes every value it is given.
unsafe fn rows_written(
    rows: usize,
    width: usize,
    split: usize,
    write: &(dyn Fn(usize, &mut [std::mem::MaybeUninit<f32>]) + Sync),
) -> Vec<f32> {
    let n = rows * width;
    if n == 0 {
        return Vec::new();
    }
    let fill = |out: &mut [std::mem::MaybeUninit<f32>]| {
        let target = super::pool::Disjoint::new(out);
        for_row_runs(rows, width, split, &|start, end| {
            // SAFETY: rows `start..end <= rows` own values `start * width ..` of the `n`,
            // and only this run writes them.
            write(start, unsafe {
                target.part(start * width, (end - start) * width)
            });
        });
    };
    // SAFETY: the runs cover rows `0..rows`, and `write` writes every value of each
    // (the caller's contract).
    unsafe { super::cpu::written(n, fill) }
}

/// Calls `run(start, end)` for runs of rows that cover `0..rows` (rows of `width`
/// values): all of them on the calling thread below `split` values (a decode step's few
/// rows: a hand-over costs more than it saves), else runs of about half as many values
/// across the pool's threads.
pub(crate) fn for_row_runs(
    rows: usize,
    width: usize,
    split: usize,
    run: &(dyn Fn(usize, usize) + Sync),
) {
    if rows * width < split {
        run(0, rows);
    } else {
        super::pool::for_each_run(rows, (split / 2 / width.max(1)).max(1), run);
    }
}

/// Values from which [`rope_at`] is split across threads (a decode step stays on one).
const ROPE_SPLIT: usize = 32 * 1024;

/// Values from which RMSNorm and the residual add are split across threads.
const ROW_SPLIT: usize = 64 * 1024;

/// [`rope_at`]'s tables and each row's position in them.
struct Angles<'a> {
    cos: &'a [f32],
    sin: &'a [f32],
    positions: &'a [usize],
    head_dim: usize,
}

/// [`rope_at`]'s rows `start ..` into `out`, `width` values each (whole rows).
#[inline(always)]
fn rope_rows<'a>(
    row: &(dyn Fn(usize) -> &'a [f32] + Sync),
    start: usize,
    width: usize,
    angles: &Angles<'_>,
    out: &mut [std::mem::MaybeUninit<f32>],
) {
    let head_dim = angles.head_dim;
    for (r, o) in (start..).zip(out.chunks_exact_mut(width)) {
        let p = angles.positions[r] * head_dim;
        let (c, s) = (&angles.cos[p..p + head_dim], &angles.sin[p..p + head_dim]);
        for (o, x) in o
            .chunks_exact_mut(head_dim)
            .zip(row(r)[..width].chunks_exact(head_dim))
        {
            rope_head(x, c, s, o);
        }
    }
}

/// RMSNorm of each `d`-value row of `x`, scaled by `weight` (`d` values):
/// `out = x * (1 / sqrt(mean(x^2) + eps)) * weight`. The squares are summed in 16
/// interleaved partial sums (value `i` into sum `i % 16`), added pairwise at the end,
/// with separate multiplies and adds: the same bits at every vector width and for a row
/// alone or in any batch. Rows are split across threads when there are many.
///
/// `x` and `out` must hold the same whole number of rows (extra values are ignored).
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    if d == 0 {
        return;
    }
    let rows = (x.len() / d).min(out.len() / d);
    let path = SimdPath::active();
    let target = super::pool::Disjoint::new(&mut out[..rows * d]);
    for_row_runs(rows, d, ROW_SPLIT, &|start, end| {
        // SAFETY: rows `start..end <= rows` own values `start * d ..` of `out`, and only
        // this run writes them.
        let out = unsafe { target.part(start * d, (end - start) * d) };
        let x = &x[start * d..end * d];
        on_simd_path!(path, rms_norm_plain(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]));
    });
}

/// [`rms_norm`] into a fresh vector, each value written once (no clearing pass), a
/// prompt's rows split across the pool's threads: the same bits.
pub fn rms_norm_new(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let d = weight.len();
    let rows = x.len().checked_div(d).unwrap_or(0);
    let path = SimdPath::active();
    let write = |start: usize, out: &mut [std::mem::MaybeUninit<f32>]| {
        let x = &x[start * d..][..out.len()];
        on_simd_path!(path, rms_norm_plain[O: Slot<f32>](
            x: &[f32],
            weight: &[f32],
            eps: f32,
            out: &mut [O],
        ));
    };
    // SAFETY: `rms_norm_plain` writes every value of each whole row it is given.
    unsafe { rows_written(rows, d, ROW_SPLIT, &write) }
}

/// `sum += row(r)` for each of the `width`-value rows of `sum` (a residual add in place),
/// a prompt's rows split across the pool's threads. Element-wise adds: the bits of any
/// other order.
pub fn add_rows<'a>(sum: &mut [f32], width: usize, row: &(dyn Fn(usize) -> &'a [f32] + Sync)) {
    let rows = sum.len().checked_div(width).unwrap_or(0);
    let target = super::pool::Disjoint::new(sum);
    for_row_runs(rows, width, ROW_SPLIT, &|start, end| {
        // SAFETY: rows `start..end <= rows` own values `start * width ..` of `sum`, and
        // only this run writes them.
        let sum = unsafe { target.part(start * width, (end - start) * width) };
        for (r, s) in (start..).zip(sum.chunks_exact_mut(width)) {
            for (s, &d) in s.iter_mut().zip(row(r)) {
                *s += d;
            }
        }
    });
}

/// [`rms_norm`]'s steps on the whole rows of `x` into `out`, on the caller's path.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
pub(crate) fn rms_norm_plain<O: Slot<f32>>(x: &[f32], weight: &[f32], eps: f32, out: &mut [O]) {
    let d = weight.len();
    for (o, x) in out.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
        let mut acc = [0f32; 16];
        let mut chunks = x.chunks_exact(16);
        for c in &mut chunks {
            for l in 0..16 {
                acc[l] += c[l] * c[l];
            }
        }
        for (l, &v) in chunks.remainder().iter().enumerate() {
            acc[l] += v * v;
        }
        let mut width = 8;
        while width > 0 {
            for l in 0..width {
                acc[l] += acc[l + width];
            }
            width /= 2;
        }
        let inv = 1.0 / (acc[0] / d as f32 + eps).sqrt();
        for ((o, &x), &w) in o.iter_mut().zip(x).zip(weight) {
            o.set(x * inv * w);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_silu_times_up() {
        let gate: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 0.037).collect();
        let up: Vec<f32> = (0..1000).map(|i| ((i * 7) % 13) as f32 - 6.0).collect();
        let mut out = gate.clone();
        swiglu(&mut out, &up);
        for ((&o, &g), &u) in out.iter().zip(&gate).zip(&up) {
            let g64 = f64::from(g);
            let want = g64 / (1.0 + (-g64).exp()) * f64::from(u);
            assert!(
                (f64::from(o) - want).abs() <= 1e-6 * want.abs().max(1e-6),
                "{g}"
            );
        }
        // A value alone gives the same bits as in a long slice.
        let mut one = [gate[123]];
        swiglu(&mut one, &up[123..124]);
        assert_eq!(one[0].to_bits(), out[123].to_bits());
    }

    #[test]
    fn rope_rotates_each_half_by_the_other() {
        let head_dim = 8;
        let x: Vec<f32> = (0..32).map(|i| i as f32 * 0.25 - 3.0).collect();
        let cos: Vec<f32> = (0..32).map(|i| (i as f32 * 0.1).cos()).collect();
        let sin: Vec<f32> = (0..32)
            .map(|i| if i % 8 < 4 { -1.0 } else { 1.0 } * (i as f32 * 0.1).sin())
            .collect();
        let mut out = vec![0f32; 32];
        rope(&x, &cos, &sin, head_dim, &mut out);
        for i in 0..32 {
            let partner = i / 8 * 8 + (i % 8 + 4) % 8;
            assert_eq!(out[i], x[i] * cos[i] + x[partner] * sin[i], "{i}");
        }
    }

    #[test]
    fn rms_norm_matches_f64_and_is_the_same_alone_and_in_a_batch() {
        let d = 100;
        let x: Vec<f32> = (0..7 * d)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.03)
            .collect();
        let w: Vec<f32> = (0..d).map(|i| 0.5 + i as f32 * 0.01).collect();
        let mut out = vec![0f32; x.len()];
        rms_norm(&x, &w, 1e-5, &mut out);
        for (r, row) in x.chunks(d).enumerate() {
            let ms = row
                .iter()
                .map(|&v| f64::from(v) * f64::from(v))
                .sum::<f64>()
                / d as f64;
            let inv = 1.0 / (ms + 1e-5).sqrt();
            for i in 0..d {
                let want = f64::from(row[i]) * inv * f64::from(w[i]);
                assert!((f64::from(out[r * d + i]) - want).abs() <= 1e-5 * want.abs().max(1e-3));
            }
            let mut alone = vec![0f32; d];
            rms_norm(row, &w, 1e-5, &mut alone);
            assert_eq!(alone, out[r * d..(r + 1) * d]);
        }
    }

    /// A prompt's rows (split across the pool's threads) give each row's bits alone, into
    /// a given buffer or a fresh one.
    #[test]
    fn rms_norm_split_or_fresh_gives_each_rows_bits() {
        let (rows, d) = (1000, 100);
        let x: Vec<f32> = (0..rows * d)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.03)
            .collect();
        let w: Vec<f32> = (0..d).map(|i| 0.5 + i as f32 * 0.01).collect();
        let mut out = vec![0f32; x.len()];
        rms_norm(&x, &w, 1e-5, &mut out);
        let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
        assert_eq!(bits(&rms_norm_new(&x, &w, 1e-5)), bits(&out));
        for (r, row) in x.chunks(d).enumerate() {
            assert_eq!(
                bits(&rms_norm_new(row, &w, 1e-5)),
                bits(&out[r * d..(r + 1) * d])
            );
        }
    }
}
