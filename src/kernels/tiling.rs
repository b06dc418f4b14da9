//! Tiling helpers shared by the CPU kernels' drivers (`cpu`, `int8`) and their SIMD
//! files (`avx512`, `avx2`, `neon`), which sit above this module and never import each
//! other's drivers.

/// Most activation rows of any path's tile (the size of a tile's output).
pub(crate) const MAX_TILE_ROWS: usize = 8;

/// The output `[rows, n_out]` that the column chunks write into, each its own columns.
pub(crate) struct Columns {
    pub(crate) out: *mut f32,
    pub(crate) n_out: usize,
}

// SAFETY: every chunk writes only its own columns `start..end` of each row (disjoint
// ranges of the buffer), and the buffer outlives the parallel loop that writes it.
unsafe impl Sync for Columns {}

impl Columns {
    /// The columns of `out`, `n_out` values a row.
    pub(crate) fn new(out: &mut [f32], n_out: usize) -> Self {
        Self {
            out: out.as_mut_ptr(),
            n_out,
        }
    }

    /// Writes `values` at row `r`, columns `col..col + values.len()`.
    ///
    /// # Safety
    ///
    /// Inside the buffer, and no other thread writes those columns of that row.
    pub(crate) unsafe fn write(&self, r: usize, col: usize, values: &[f32]) {
        // SAFETY: the caller's contract.
        unsafe {
            std::ptr::copy_nonoverlapping(
                values.as_ptr(),
                self.out.add(r * self.n_out + col),
                values.len(),
            );
        }
    }
}

/// Row tiles `r0..r1` covering `0..rows`, as few as tiles of at most `most` rows allow
/// and balanced so that none is much smaller than the others (32 rows in tiles of up to 6
/// are 6, 6, 5, 5, 5, 5, not five of 6 and one of 2).
pub(crate) fn balanced_row_tiles(rows: usize, most: usize) -> impl Iterator<Item = (usize, usize)> {
    let tiles = rows.div_ceil(most.max(1));
    (0..tiles).map(move |t| (rows * t / tiles, rows * (t + 1) / tiles))
}

/// Boundaries `b[0] = 0 < b[1] < ... = units` of the chunks that a product of `units`
/// column units splits into for `threads` threads, guided: each chunk a `1 / (2 *
/// threads)` share of what is left (at least `least` units), so the first chunks are
/// large (few hand-overs, long sequential streams of weights) and the last ones small
/// (a thread that finishes waits for at most a small chunk of the other's).
pub(crate) fn guided_chunks(units: usize, threads: usize, least: usize) -> Vec<usize> {
    let mut bounds = vec![0];
    let mut done = 0;
    while done < units {
        let left = units - done;
        done += left.div_ceil(2 * threads.max(1)).max(least).min(left);
        bounds.push(done);
    }
    bounds
}

/// How far ahead (in bytes) the x86 kernels ask for a weight group's next bytes.
#[cfg(target_arch = "x86_64")]
const PREFETCH_BYTES: usize = 1024;

/// Asks for the bytes [`PREFETCH_BYTES`] past a group's step at `step`: three lines, as
/// a step of Q4_1 is 160 bytes. A group's bytes come from memory, read once per product.
/// Measured by alternating runs of `benchmark_concurrency --strategies batched`: in the
/// AVX-512 dequantization (32 rows) 494 -> 516 tokens/s with three lines against none; in
/// the AVX-512 fused kernel (4 rows) 283 -> 310 with three lines against two.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_step(step: *const u8) {
    use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
    for line in 0..3 {
        let at = step.wrapping_add(PREFETCH_BYTES + 64 * line).cast();
        // SAFETY: SSE is part of every x86-64 CPU, and a prefetch is a hint: any address
        // is allowed.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(at) };
    }
}

/// How far ahead (in bytes) the in-register kernels ask for a group's steps of `len`
/// bytes: the fewest whole steps that make at least 1 KiB (one step of Q4_K, Q5_K or
/// Q6_K; eight of Q4_0). Each group step is prefetched whole, all of its lines: the
/// weights stream from memory once per product, and the kernel's work between loads
/// hides the hardware prefetcher's stride.
///
/// Measured with `one_row_step FILE 6` (each format's products at one row beside a
/// plain read of their bytes, two threads, alternated, 3 rounds): a fixed 2 KiB held
/// Q4_K at 78-98% and Q6_K at 77-86% of the read, one step ahead 91-103% and 95-99%
/// (Q4_0 and Q8_0 at the read either way). More lines in flight than that fall off a
/// cliff: Q6_K at 1.5 steps (2.5 KiB) read at 51%. Before, without any hint, Q4_K_M
/// decoded at 29.4-30.4 tokens/s and with 2 KiB at 37.4-39.6 (`generate --json`).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn group_prefetch_ahead(len: usize) -> usize {
    let len = len.max(64);
    len * 1024usize.div_ceil(len)
}

/// Asks for a later group step of `len` bytes than the one at `step`, whole, a line at a
/// time, [`group_prefetch_ahead`] bytes past it.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_group_step(step: *const u8, len: usize) {
    use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
    let ahead = group_prefetch_ahead(len);
    let mut line = 0;
    while line < len {
        // SAFETY: SSE is part of every x86-64 CPU, and a prefetch is a hint: any address
        // is allowed.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(step.wrapping_add(ahead + line).cast()) };
        line += 64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guided_chunks_cover_every_unit_once_shrinking() {
        for units in [0, 1, 2, 5, 16, 128, 3072] {
            for threads in [1, 2, 3, 16] {
                let b = guided_chunks(units, threads, 2);
                assert_eq!((b[0], *b.last().unwrap()), (0, units));
                let sizes: Vec<usize> = b.windows(2).map(|w| w[1] - w[0]).collect();
                assert!(sizes.iter().all(|&s| s > 0));
                assert!(sizes.windows(2).all(|w| w[1] <= w[0]), "{sizes:?}");
            }
        }
        assert_eq!(guided_chunks(128, 2, 2).len() - 1, 13);
    }
}
