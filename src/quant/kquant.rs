//! The K-quant quantizers: f32 super-blocks of 256 values into `Q3_K`, `Q4_K`, `Q5_K`
//! and `Q6_K` blocks.
//!
//! Each follows the algorithm of ggml's reference quantizers (`quantize_row_*_K_ref`,
//! the ones `llama-quantize` runs when no importance matrix is given), with the same
//! floating-point operations in the same order, so that on a build of ggml without
//! fused multiply-adds (its portable reference path) the blocks are the same bytes
//! (`tests/integration/quantize.rs` checks them against blocks ggml wrote):
//!
//! - `Q4_K` / `Q5_K`: each 32-value group gets a scale and a minimum by a small search
//!   ([`fit_scale_min`]): start from the range, then try 21 (Q4) or 16 (Q5) nearby
//!   inverse scales, each followed by a weighted least-squares fit of scale and minimum
//!   to the rounded levels, keeping the fit of least weighted squared error (weights
//!   `rms(group) + |x|`). The eight scales and minimums are then coded in 6 bits against
//!   the block's largest, and the values rounded again against the coded ones.
//! - `Q6_K`: each 16-value group gets a symmetric scale ([`fit_scale`]): 19 candidate
//!   inverse scales around `-32 / max`, each with its least-squares scale under weights
//!   `x²`; sixteen 8-bit scales against the largest.
//! - `Q3_K`: each 16-value group gets a symmetric 3-bit fit refined coordinate by
//!   coordinate ([`fit_scale_3bit`], weights `x²`); sixteen 6-bit scales.

use half::f16;

/// Values in a K-quant super-block.
pub(crate) const QK_K: usize = 256;

/// Below this a group's largest magnitude counts as zero (ggml's `GROUP_MAX_EPS`).
const ZERO_GROUP: f32 = 1e-15;

/// Rounds to the nearest integer, ties to even, through the float adder: adding
/// `1.5 * 2^23` leaves the rounded value in the low mantissa bits. Exactly
/// `round_ties_even` for magnitudes below `2^22`; beyond that it wraps as ggml's
/// rounding does (the results are clamped by every caller), and it never panics.
#[inline]
fn nearest(v: f32) -> i32 {
    let bits = (v + 12_582_912.0).to_bits();
    (bits & 0x007F_FFFF) as i32 - 0x0040_0000
}

/// `v` through f16 and back: what a block stores for a scale.
#[inline]
fn via_f16(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

fn push_f16(out: &mut Vec<u8>, v: f32) {
    out.extend_from_slice(&f16::from_f32(v).to_le_bytes());
}

/// The value of largest magnitude (the first of equal ones) and that magnitude.
fn signed_max(x: &[f32]) -> (f32, f32) {
    let (mut max, mut amax) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    (max, amax)
}

/// Weighted squared error of `scale * l + min` against `x`.
fn weighted_error(x: &[f32], w: &[f32], levels: &[u8], scale: f32, min: f32) -> f32 {
    let mut err = 0f32;
    for ((&x, &w), &l) in x.iter().zip(w).zip(levels) {
        let diff = scale * f32::from(l) + min - x;
        err += w * (diff * diff);
    }
    err
}

/// Fits `x ≈ scale * l + min` with levels `l` in `0..=nmax` and `min <= 0` (an
/// asymmetric group of `Q4_K` / `Q5_K`), minimizing the `w`-weighted squared error over
/// the range's rounding and `steps + 1` other inverse scales `(nmax + first + delta *
/// i) / range`, each refitted by weighted least squares. Writes the levels into
/// `levels`; returns `(scale, -min)`.
fn fit_scale_min(
    x: &[f32],
    w: &[f32],
    nmax: i32,
    first: f32,
    delta: f32,
    steps: i32,
    levels: &mut [u8],
) -> (f32, f32) {
    let (mut lo, mut hi) = (x[0], x[0]);
    let mut sum_w = w[0];
    let mut sum_x = sum_w * x[0];
    for (&v, &wi) in x.iter().zip(w).skip(1) {
        if v < lo {
            lo = v;
        }
        if v > hi {
            hi = v;
        }
        sum_w += wi;
        sum_x += wi * v;
    }
    if lo > 0.0 {
        lo = 0.0;
    }
    if hi == lo {
        levels.fill(0);
        return (0.0, -lo);
    }
    let clamp = |v: i32| v.clamp(0, nmax) as u8;

    // As in ggml, the trials measure the range and offset from the best minimum so far.
    let inv = nmax as f32 / (hi - lo);
    let mut scale = 1.0 / inv;
    let mut min = lo;
    for (l, &v) in levels.iter_mut().zip(x) {
        *l = clamp(nearest(inv * (v - min)));
    }
    let mut best = weighted_error(x, w, levels, scale, min);

    let mut trial = [0u8; 32];
    let trial = &mut trial[..x.len()];
    for step in 0..=steps {
        let inv = (first + delta * step as f32 + nmax as f32) / (hi - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for ((t, &v), &wi) in trial.iter_mut().zip(x).zip(w) {
            let l = clamp(nearest(inv * (v - min)));
            *t = l;
            let l = f32::from(l);
            sum_l += wi * l;
            sum_l2 += wi * l * l;
            sum_xl += wi * l * v;
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut s = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut m = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if m > 0.0 {
                m = 0.0;
                s = sum_xl / sum_l2;
            }
            let err = weighted_error(x, w, trial, s, m);
            if err < best {
                levels.copy_from_slice(trial);
                best = err;
                scale = s;
                min = m;
            }
        }
    }
    (scale, -min)
}

/// Fits `x ≈ scale * l` with signed levels `l` in `-nmax..nmax` (a symmetric group of
/// `Q6_K`) under weights `x²`: the rounding at `-nmax / max` and 18 inverse scales
/// `-(nmax + 0.1 k) / max` around it, each with its least-squares scale, keeping the one
/// that explains most of the weighted energy. Writes `l + nmax` into `levels`; returns
/// the scale.
fn fit_scale(x: &[f32], nmax: i32, levels: &mut [u8]) -> f32 {
    let (max, amax) = signed_max(x);
    if amax < ZERO_GROUP {
        levels.fill(0);
        return 0.0;
    }
    let level = |inv: f32, v: f32| nearest(inv * v).clamp(-nmax, nmax - 1);
    let sums = |inv: f32| {
        let (mut sum_lx, mut sum_l2) = (0f32, 0f32);
        for &v in x {
            let l = level(inv, v) as f32;
            let w = v * v;
            sum_lx += w * v * l;
            sum_l2 += w * l * l;
        }
        (sum_lx, sum_l2)
    };
    let mut fill = |inv: f32| {
        for (l, &v) in levels.iter_mut().zip(x) {
            *l = (level(inv, v) + nmax) as u8;
        }
    };
    let inv = -(nmax as f32) / max;
    fill(inv);
    let (sum_lx, sum_l2) = sums(inv);
    let mut scale = if sum_l2 != 0.0 { sum_lx / sum_l2 } else { 0.0 };
    let mut best = scale * sum_lx;
    for k in (-9..=9).filter(|&k| k != 0) {
        let inv = -(nmax as f32 + 0.1 * k as f32) / max;
        let (sum_lx, sum_l2) = sums(inv);
        if sum_l2 > 0.0 && sum_lx * sum_lx > best * sum_l2 {
            fill(inv);
            scale = sum_lx / sum_l2;
            best = scale * sum_lx;
        }
    }
    scale
}

/// Fits `x ≈ scale * l` with signed levels `l` in `-nmax..nmax` (a group of `Q3_K`)
/// under weights `x²`: round at `-nmax / max`, then up to five passes that move single
/// levels to their least-squares optimum while that raises the explained weighted
/// energy. Writes `l + nmax` into `levels` (zeros for an all-zero group); returns the
/// scale.
fn fit_scale_3bit(x: &[f32], nmax: i32, levels: &mut [u8]) -> f32 {
    let (max, amax) = signed_max(x);
    if amax < ZERO_GROUP {
        levels.fill(0);
        return 0.0;
    }
    let inv = -(nmax as f32) / max;
    let mut l = [0i32; 16];
    let l = &mut l[..x.len()];
    let (mut sum_lx, mut sum_l2) = (0f32, 0f32);
    for (li, &v) in l.iter_mut().zip(x) {
        *li = nearest(inv * v).clamp(-nmax, nmax - 1);
        let w = v * v;
        sum_lx += w * v * *li as f32;
        sum_l2 += w * *li as f32 * *li as f32;
    }
    for _ in 0..5 {
        let mut changed = false;
        for (li, &v) in l.iter_mut().zip(x) {
            let w = v * v;
            let mut lx = sum_lx - w * v * *li as f32;
            if lx > 0.0 {
                let mut l2 = sum_l2 - w * *li as f32 * *li as f32;
                let new = nearest(v * l2 / lx).clamp(-nmax, nmax - 1);
                if new != *li {
                    lx += w * v * new as f32;
                    l2 += w * new as f32 * new as f32;
                    if l2 > 0.0 && lx * lx * sum_l2 > sum_lx * sum_lx * l2 {
                        *li = new;
                        sum_lx = lx;
                        sum_l2 = l2;
                        changed = true;
                    }
                }
            }
        }
        if !changed {
            break;
        }
    }
    for (dst, &li) in levels.iter_mut().zip(l.iter()) {
        *dst = (li + nmax) as u8;
    }
    if sum_l2 > 0.0 { sum_lx / sum_l2 } else { 0.0 }
}

/// Packs eight 6-bit scales and minimums into the 12 bytes of `Q4_K` / `Q5_K`: the
/// first four of each in the low 6 bits of bytes 0-3 (scales) and 4-7 (minimums), the
/// last four's low nibbles in bytes 8-11 and their top 2 bits in the top bits of bytes
/// 0-7.
fn pack_scales_mins(sc: &[u8; 8], mn: &[u8; 8]) -> [u8; 12] {
    let mut p = [0u8; 12];
    for j in 0..4 {
        p[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        p[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
        p[j + 8] = (sc[j + 4] & 0x0F) | ((mn[j + 4] & 0x0F) << 4);
    }
    p
}

/// The shared part of `Q4_K` and `Q5_K`: fits each 32-value group, codes the scales and
/// minimums, and rounds the values against the coded ones. Returns `(d, dmin, packed
/// scales, levels)`.
fn k_asymmetric(x: &[f32], nmax: i32, first: f32, steps: i32) -> (f32, f32, [u8; 12], [u8; QK_K]) {
    let mut levels = [0u8; QK_K];
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for (j, (group, lv)) in x
        .chunks_exact(32)
        .zip(levels.chunks_exact_mut(32))
        .enumerate()
    {
        let mut sum_x2 = 0f32;
        for &v in group {
            sum_x2 += v * v;
        }
        let rms = (sum_x2 / 32.0).sqrt();
        let w: [f32; 32] = std::array::from_fn(|i| rms + group[i].abs());
        let (s, m) = fit_scale_min(group, &w, nmax, first, 0.1, steps, lv);
        scales[j] = s;
        mins[j] = m;
        if s > max_scale {
            max_scale = s;
        }
        if m > max_min {
            max_min = m;
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let code = |v: f32| (nearest(v) as u8).min(63);
    let sc: [u8; 8] = std::array::from_fn(|j| code(inv_scale * scales[j]));
    let mn: [u8; 8] = std::array::from_fn(|j| code(inv_min * mins[j]));
    let d = max_scale / 63.0;
    let dmin = max_min / 63.0;
    let (d16, dmin16) = (via_f16(d), via_f16(dmin));
    for (j, (group, lv)) in x
        .chunks_exact(32)
        .zip(levels.chunks_exact_mut(32))
        .enumerate()
    {
        let step = d16 * f32::from(sc[j]);
        if step == 0.0 {
            continue;
        }
        let offset = dmin16 * f32::from(mn[j]);
        for (l, &v) in lv.iter_mut().zip(group) {
            *l = nearest((v + offset) / step).clamp(0, nmax) as u8;
        }
    }
    (d, dmin, pack_scales_mins(&sc, &mn), levels)
}

/// `Q4_K` (144 bytes): `d`, `dmin` (f16), 12 bytes of packed scales and minimums, then
/// 128 bytes of nibbles, each 32-byte run holding two groups (low, then high nibbles).
pub(crate) fn q4_k(x: &[f32], out: &mut Vec<u8>) {
    let (d, dmin, packed, levels) = k_asymmetric(x, 15, -1.0, 20);
    push_f16(out, d);
    push_f16(out, dmin);
    out.extend_from_slice(&packed);
    for pair in levels.chunks_exact(64) {
        out.extend((0..32).map(|l| pair[l] | (pair[l + 32] << 4)));
    }
}

/// `Q5_K` (176 bytes): as `Q4_K`, with 32 bytes of fifth bits after the scales (bit
/// `2c` / `2c + 1` of byte `l` for value `l` / `l + 32` of 64-value chunk `c`).
pub(crate) fn q5_k(x: &[f32], out: &mut Vec<u8>) {
    let (d, dmin, packed, levels) = k_asymmetric(x, 31, -0.5, 15);
    push_f16(out, d);
    push_f16(out, dmin);
    out.extend_from_slice(&packed);
    let mut high = [0u8; 32];
    for (c, pair) in levels.chunks_exact(64).enumerate() {
        for (l, h) in high.iter_mut().enumerate() {
            *h |= ((pair[l] >> 4) << (2 * c)) | ((pair[l + 32] >> 4) << (2 * c + 1));
        }
    }
    out.extend_from_slice(&high);
    for pair in levels.chunks_exact(64) {
        out.extend((0..32).map(|l| (pair[l] & 0x0F) | ((pair[l + 32] & 0x0F) << 4)));
    }
}

/// Fits each 16-value group of a 256-value block with `fit` (which writes the group's
/// levels and returns its scale): the sixteen scales, then the one of largest magnitude
/// (the first such) and that magnitude.
fn fit_groups(
    x: &[f32],
    levels: &mut [u8; QK_K],
    mut fit: impl FnMut(&[f32], &mut [u8]) -> f32,
) -> ([f32; 16], f32, f32) {
    let mut scales = [0f32; 16];
    let (mut max_scale, mut max_abs) = (0f32, 0f32);
    for (j, (group, lv)) in x
        .chunks_exact(16)
        .zip(levels.chunks_exact_mut(16))
        .enumerate()
    {
        let s = fit(group, lv);
        scales[j] = s;
        if s.abs() > max_abs {
            max_abs = s.abs();
            max_scale = s;
        }
    }
    (scales, max_scale, max_abs)
}

/// `Q6_K` (210 bytes): 128 bytes of low nibbles, 64 of high 2-bit pairs, sixteen signed
/// 8-bit scales, `d` (f16). An all-zero block is all zero bytes.
pub(crate) fn q6_k(x: &[f32], out: &mut Vec<u8>) {
    let mut levels = [0u8; QK_K];
    let (scales, max_scale, max_abs) = fit_groups(x, &mut levels, |g, lv| fit_scale(g, 32, lv));
    if max_abs < ZERO_GROUP {
        out.extend_from_slice(&[0u8; 210]);
        return;
    }
    let inv = -128.0 / max_scale;
    let d = 1.0 / inv;
    let sc: [i8; 16] = std::array::from_fn(|j| nearest(inv * scales[j]).min(127) as i8);
    let d16 = via_f16(d);
    for (j, (group, lv)) in x
        .chunks_exact(16)
        .zip(levels.chunks_exact_mut(16))
        .enumerate()
    {
        let step = d16 * f32::from(sc[j]);
        if step == 0.0 {
            continue;
        }
        for (l, &v) in lv.iter_mut().zip(group) {
            *l = (nearest(v / step).clamp(-32, 31) + 32) as u8;
        }
    }
    let mut ql = [0u8; 128];
    let mut qh = [0u8; 64];
    for (h, quarter) in levels.chunks_exact(128).enumerate() {
        for l in 0..32 {
            let q = [
                quarter[l],
                quarter[l + 32],
                quarter[l + 64],
                quarter[l + 96],
            ];
            ql[64 * h + l] = (q[0] & 0x0F) | ((q[2] & 0x0F) << 4);
            ql[64 * h + l + 32] = (q[1] & 0x0F) | ((q[3] & 0x0F) << 4);
            qh[32 * h + l] =
                (q[0] >> 4) | ((q[1] >> 4) << 2) | ((q[2] >> 4) << 4) | ((q[3] >> 4) << 6);
        }
    }
    out.extend_from_slice(&ql);
    out.extend_from_slice(&qh);
    out.extend(sc.iter().map(|&s| s as u8));
    push_f16(out, d);
}

/// `Q3_K` (110 bytes): 32 bytes of high-bit mask (bit `j / 32` of byte `j % 32` for
/// value `j`; a clear bit means the value is 4 lower), 64 bytes of 2-bit fields, 12
/// bytes of sixteen 6-bit scales offset by 32, `d` (f16).
pub(crate) fn q3_k(x: &[f32], out: &mut Vec<u8>) {
    let mut levels = [0u8; QK_K];
    let (scales, max_scale, _) = fit_groups(x, &mut levels, |g, lv| fit_scale_3bit(g, 4, lv));
    let mut coded = [0u8; 16];
    let d = if max_scale != 0.0 {
        let inv = -32.0 / max_scale;
        for (c, &s) in coded.iter_mut().zip(&scales) {
            *c = (i32::from(nearest(inv * s) as i8).clamp(-32, 31) + 32) as u8;
        }
        1.0 / inv
    } else {
        0.0
    };
    let mut packed = [0u8; 12];
    for (j, &c) in coded.iter().enumerate() {
        packed[j % 8] |= (c & 0x0F) << (4 * (j / 8));
        packed[8 + j % 4] |= (c >> 4) << (2 * (j / 4));
    }
    let d16 = via_f16(d);
    for (j, (group, lv)) in x
        .chunks_exact(16)
        .zip(levels.chunks_exact_mut(16))
        .enumerate()
    {
        let step = d16 * f32::from(coded[j] as i8 - 32);
        if step == 0.0 {
            continue;
        }
        for (l, &v) in lv.iter_mut().zip(group) {
            *l = (nearest(v / step).clamp(-4, 3) + 4) as u8;
        }
    }
    let mut hmask = [0u8; 32];
    for (j, l) in levels.iter_mut().enumerate() {
        if *l > 3 {
            hmask[j % 32] |= 1 << (j / 32);
            *l -= 4;
        }
    }
    out.extend_from_slice(&hmask);
    for half in levels.chunks_exact(128) {
        out.extend(
            (0..32)
                .map(|l| half[l] | (half[l + 32] << 2) | (half[l + 64] << 4) | (half[l + 96] << 6)),
        );
    }
    out.extend_from_slice(&packed);
    push_f16(out, d);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rounds_ties_to_even() {
        for (v, r) in [
            (0.5, 0),
            (1.5, 2),
            (2.5, 2),
            (-0.5, 0),
            (-1.5, -2),
            (3.49, 3),
        ] {
            assert_eq!(nearest(v), r, "{v}");
        }
        // Out of range and non-finite values do not panic.
        let _ = nearest(f32::NAN) + nearest(f32::INFINITY) + nearest(1e30);
    }

    #[test]
    fn packed_scales_unpack() {
        let sc = [1, 22, 63, 0, 17, 40, 63, 5];
        let mn = [63, 0, 9, 31, 48, 2, 33, 60];
        let p = pack_scales_mins(&sc, &mn);
        assert_eq!(super::super::dequant::k_scales_mins(&p), (sc, mn));
    }
}
