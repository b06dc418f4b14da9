//! The NEON path of the CPU kernels (aarch64).
//!
//! Weights are dequantized into scratch rows by the loader's own routines (bitwise the
//! loader's weights), then multiplied in the AVX2 path's order: one 8-lane accumulator
//! per output (two 4-lane NEON registers, lanes 0-3 and 4-7) with fused multiply-adds
//! over 8-value chunks, finished as `t[l] = acc[l] + acc[l + 4]`, `(t[0] + t[2]) +
//! (t[1] + t[3])`. So an ARM CPU gives the same bits as an x86-64 CPU on the AVX2 path.

use std::arch::aarch64::*;

use super::tiling::MAX_TILE_ROWS;

/// The final sum of an 8-lane accumulator held as two halves.
#[inline]
#[target_feature(enable = "neon")]
fn reduce(lo: float32x4_t, hi: float32x4_t) -> f32 {
    let t = vaddq_f32(lo, hi);
    let (t0, t1, t2, t3) = (
        vgetq_lane_f32::<0>(t),
        vgetq_lane_f32::<1>(t),
        vgetq_lane_f32::<2>(t),
        vgetq_lane_f32::<3>(t),
    );
    (t0 + t2) + (t1 + t3)
}

/// `out[r][c] = x[r] . w[c]` over f32 rows of `n` values (a multiple of 8).
///
/// # Safety
///
/// NEON; every row holds `n` values.
#[inline]
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "neon")]
unsafe fn tile<const R: usize, const C: usize>(
    w: [*const f32; C],
    x: [*const f32; R],
    n: usize,
    out: &mut [[f32; 8]; MAX_TILE_ROWS],
) {
    let zero = vdupq_n_f32(0.0);
    let mut lo = [[zero; C]; R];
    let mut hi = [[zero; C]; R];
    let mut k = 0;
    while k < n {
        // SAFETY: `k + 8 <= n` values in every row (the caller's contract).
        unsafe {
            let wl: [float32x4_t; C] = std::array::from_fn(|c| vld1q_f32(w[c].add(k)));
            let wh: [float32x4_t; C] = std::array::from_fn(|c| vld1q_f32(w[c].add(k + 4)));
            for r in 0..R {
                let (xl, xh) = (vld1q_f32(x[r].add(k)), vld1q_f32(x[r].add(k + 4)));
                for c in 0..C {
                    lo[r][c] = vfmaq_f32(lo[r][c], wl[c], xl);
                    hi[r][c] = vfmaq_f32(hi[r][c], wh[c], xh);
                }
            }
        }
        k += 8;
    }
    for r in 0..R {
        for c in 0..C {
            out[r][c] = reduce(lo[r][c], hi[r][c]);
        }
    }
}

/// A tile of up to 4 rows and 8 columns over f32 weight rows (scratch rows):
/// `out[r][c] = acts[r] . weights[c]`.
///
/// # Safety
///
/// NEON; every slice holds the same number of values, a multiple of 8.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "neon")]
pub(crate) unsafe fn dot_tile(
    weights: &[&[f32]],
    acts: &[&[f32]],
    out: &mut [[f32; 8]; MAX_TILE_ROWS],
) {
    let n = weights.first().map_or(0, |w| w.len());
    debug_assert!(n.is_multiple_of(8));
    debug_assert!(weights.iter().all(|w| w.len() == n) && acts.iter().all(|a| a.len() == n));
    let w = |c: usize| weights[c].as_ptr();
    let x = |r: usize| acts[r].as_ptr();
    // SAFETY: forwarded from this function's contract.
    unsafe {
        match (acts.len(), weights.len()) {
            (1, 8) => tile::<1, 8>(std::array::from_fn(w), [x(0)], n, out),
            (4, 3) => tile::<4, 3>(std::array::from_fn(w), std::array::from_fn(x), n, out),
            (3, 3) => tile::<3, 3>(std::array::from_fn(w), std::array::from_fn(x), n, out),
            (2, 3) => tile::<2, 3>(std::array::from_fn(w), std::array::from_fn(x), n, out),
            (1, 3) => tile::<1, 3>(std::array::from_fn(w), [x(0)], n, out),
            (r, c) => {
                for ci in 0..c {
                    let mut one = [[0f32; 8]; MAX_TILE_ROWS];
                    for ri in 0..r {
                        tile::<1, 1>([w(ci)], [x(ri)], n, &mut one);
                        out[ri][ci] = one[0][0];
                    }
                }
            }
        }
    }
}
