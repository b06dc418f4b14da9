//! LoRA changes on the CPU: for each row `x` of a step that uses an adapter,
//! `y += (x @ a) @ b`, with one fixed order of addition per value, so a row's change is
//! the same bits whatever the other rows, the SIMD path and the number of threads.
//!
//! One call takes every adapter group of a projection and writes into the projection's
//! output in place. It runs in two splits over the kernels' own thread pool
//! (`pool::for_each_chunk`, the one the quantized products use): first the rank
//! vectors `t = x @ a`, one chunk per row; then blocks of `COLUMN_BLOCK` output
//! columns, each for every row of every group, so each block of `b` is read once a step
//! while it is in the core's cache. Both loops are element-wise (separate multiplies and
//! adds, which the compiler never fuses), compiled for the widest vectors of the
//! [`SimdPath`]: every width gives the same bits.

use super::cpu::{SimdPath, on_simd_path};
use super::pool::{self, Disjoint};

/// One adapter's rows of a step and its factors for one projection.
#[derive(Debug, Clone, Copy)]
pub struct LoraGroup<'a> {
    /// The rows of `x` and `y` that use the adapter.
    pub rows: &'a [u32],
    /// `a`, `[n_in, rank]` row-major.
    pub a: &'a [f32],
    /// `scale * b`, `[rank, n_out]` row-major.
    pub b: &'a [f32],
    /// The rank.
    pub rank: usize,
}

/// Output columns per block of the second product: a block of `b`'s rows (`rank x
/// 256` values, 16 KiB at rank 16) stays in the core's cache while every row of every
/// group uses it.
const COLUMN_BLOCK: usize = 256;

/// Whether `group` fits a projection of `n_in` inputs and `n_out` outputs over a step
/// of `tokens` rows: its factors' lengths match its rank and every row is in the step.
pub fn fits(group: &LoraGroup<'_>, n_in: usize, n_out: usize, tokens: usize) -> bool {
    group.a.len() == n_in * group.rank
        && group.b.len() == group.rank * n_out
        && group.rows.iter().all(|&r| (r as usize) < tokens)
}

/// Adds each group's change `(x[r] @ a) @ b` to row `r` of `y` (`[tokens, n_out]`
/// row-major), for every row `r` of the group; `x(r)` is row `r` of the projection's
/// input, `n_in` values. A value's change sums the rank in order from zero, each rank
/// value the inputs in order from zero, and is then added to `y` once.
///
/// # Panics
///
/// If a group does not [`fit`](fits) (the backend checks before calling), or a row of
/// `x` is not `n_in` values long.
pub fn add_changes<'x>(
    path: SimdPath,
    x: &(dyn Fn(usize) -> &'x [f32] + Sync),
    n_in: usize,
    n_out: usize,
    groups: &[LoraGroup<'_>],
    y: &mut [f32],
) {
    let tokens = y.len() / n_out.max(1);
    assert!(
        groups.iter().all(|g| fits(g, n_in, n_out, tokens)),
        "LoRA factors or rows that do not fit the projection"
    );
    // (group, row, offset of its rank vector in `t`), one per row of every group, in
    // group order, so a group's rank vectors lie side by side.
    let mut pairs = Vec::with_capacity(groups.iter().map(|g| g.rows.len()).sum());
    // (group, first pair, pairs): the first split's chunks, up to ROWS_AT_ONCE rows each.
    let mut chunks = Vec::new();
    let mut at = 0;
    for (gi, g) in groups.iter().enumerate() {
        for rows in g.rows.chunks(ROWS_AT_ONCE) {
            chunks.push((gi, pairs.len(), rows.len()));
            for &r in rows {
                pairs.push((gi, r as usize, at));
                at += g.rank;
            }
        }
    }
    if pairs.is_empty() || n_out == 0 {
        return;
    }
    let mut t = vec![0f32; at];
    {
        let parts = Disjoint::new(&mut t);
        pool::for_each_chunk(chunks.len(), &|c| {
            let (gi, first, n) = chunks[c];
            let g = &groups[gi];
            let offset = pairs[first].2;
            // Unused places repeat the last row (their values are not kept).
            let xs: [&[f32]; ROWS_AT_ONCE] =
                std::array::from_fn(|i| x(pairs[first + i.min(n - 1)].1));
            assert!(
                xs.iter().all(|x| x.len() == n_in),
                "a LoRA input row of the wrong width"
            );
            // SAFETY: each chunk owns its rows' rank vectors, side by side in `t`,
            // which outlives the split.
            let t = unsafe { parts.part(offset, n * g.rank) };
            rank_vectors_on(path, &xs, g.a, g.rank, t);
        });
    }
    let t = &t;
    let pairs = &pairs;
    let out = Disjoint::new(y);
    pool::for_each_chunk(n_out.div_ceil(COLUMN_BLOCK), &|c| {
        let c0 = c * COLUMN_BLOCK;
        let width = COLUMN_BLOCK.min(n_out - c0);
        let mut d = [0f32; COLUMN_BLOCK];
        let d = &mut d[..width];
        for &(gi, r, offset) in pairs {
            let g = &groups[gi];
            // SAFETY: this chunk alone touches columns `c0..c0 + width`, of rows inside
            // `y` (checked by `fits`), and `y` outlives the split.
            let y = unsafe { out.part(r * n_out + c0, width) };
            column_block_on(path, &t[offset..offset + g.rank], g.b, n_out, c0, d, y);
        }
    });
}

/// Rows whose rank vectors are made together: they share each row of `a` as it is read,
/// and their sums are independent chains of additions that the core overlaps.
const ROWS_AT_ONCE: usize = 4;

/// The rank vectors `t[j] = xs[j] @ a` of up to [`ROWS_AT_ONCE`] rows (`t` holds as many
/// as it has room for, `rank` values each), compiled for the widest vectors of `path`,
/// with the rank a constant for the common ranks (their sums then stay in registers).
fn rank_vectors_on(
    path: SimdPath,
    xs: &[&[f32]; ROWS_AT_ONCE],
    a: &[f32],
    rank: usize,
    t: &mut [f32],
) {
    match rank {
        8 => fixed_rank::<8>(path, xs, a, t),
        16 => fixed_rank::<16>(path, xs, a, t),
        32 => fixed_rank::<32>(path, xs, a, t),
        64 => fixed_rank::<64>(path, xs, a, t),
        _ => on_simd_path!(
            path,
            rank_vectors(xs: &[&[f32]; ROWS_AT_ONCE], a: &[f32], rank: usize, t: &mut [f32])
        ),
    }
}

/// [`rank_vectors_of`] for rank `R`.
fn fixed_rank<const R: usize>(
    path: SimdPath,
    xs: &[&[f32]; ROWS_AT_ONCE],
    a: &[f32],
    t: &mut [f32],
) {
    let (a, _) = a.as_chunks::<R>();
    let mut sums = [[0f32; R]; ROWS_AT_ONCE];
    let sums_ref = &mut sums;
    on_simd_path!(
        path,
        rank_vectors_of[const R: usize](
            xs: &[&[f32]; ROWS_AT_ONCE],
            a: &[[f32; R]],
            sums_ref: &mut [[f32; R]; ROWS_AT_ONCE],
        )
    );
    for (t, sums) in t.chunks_exact_mut(R).zip(&sums) {
        t.copy_from_slice(sums);
    }
}

/// `sums[j] = xs[j] @ a` for rank `R`: the inputs in order, each adding its multiple of
/// a row of `a` to the rank vector, the same additions as [`rank_vectors`].
#[inline(always)]
fn rank_vectors_of<const R: usize>(
    xs: &[&[f32]; ROWS_AT_ONCE],
    a: &[[f32; R]],
    sums: &mut [[f32; R]; ROWS_AT_ONCE],
) {
    let mut local = [[0f32; R]; ROWS_AT_ONCE];
    for (i, a_row) in a.iter().enumerate() {
        for (sum, x) in local.iter_mut().zip(xs) {
            let xi = x[i];
            for (s, &a) in sum.iter_mut().zip(a_row) {
                *s += xi * a;
            }
        }
    }
    *sums = local;
}

/// `t[j] = xs[j] @ a` for any rank (`t` zero on entry): the inputs in order, each adding
/// its multiple of a row of `a` to the whole rank vector.
#[inline(always)]
fn rank_vectors(xs: &[&[f32]; ROWS_AT_ONCE], a: &[f32], rank: usize, t: &mut [f32]) {
    for (t, x) in t.chunks_exact_mut(rank.max(1)).zip(xs) {
        for (&xi, a_row) in x.iter().zip(a.chunks_exact(rank.max(1))) {
            for (t, &a) in t.iter_mut().zip(a_row) {
                *t += xi * a;
            }
        }
    }
}

/// [`column_block`] compiled for the widest vectors of `path`.
fn column_block_on(
    path: SimdPath,
    t: &[f32],
    b: &[f32],
    n_out: usize,
    c0: usize,
    d: &mut [f32],
    y: &mut [f32],
) {
    on_simd_path!(
        path,
        column_block(
            t: &[f32],
            b: &[f32],
            n_out: usize,
            c0: usize,
            d: &mut [f32],
            y: &mut [f32],
        )
    );
}

/// One row's change for the columns `c0..c0 + y.len()`: `d = t @ b[.., cols]` (the
/// rank in order, from zero), then `y += d`.
#[inline(always)]
fn column_block(t: &[f32], b: &[f32], n_out: usize, c0: usize, d: &mut [f32], y: &mut [f32]) {
    let width = y.len();
    d.fill(0.0);
    for (k, &tk) in t.iter().enumerate() {
        let b_row = &b[k * n_out + c0..k * n_out + c0 + width];
        for (o, &b) in d.iter_mut().zip(b_row) {
            *o += tk * b;
        }
    }
    for (y, &d) in y.iter_mut().zip(d.iter()) {
        *y += d;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `add_changes` over one step, on `path`, from a zero `y` of `tokens` rows.
    fn changes(
        path: SimdPath,
        x: &[f32],
        (n_in, n_out): (usize, usize),
        groups: &[LoraGroup<'_>],
        tokens: usize,
    ) -> Vec<f32> {
        let mut y = vec![0f32; tokens * n_out];
        add_changes(
            path,
            &|r| &x[r * n_in..(r + 1) * n_in],
            n_in,
            n_out,
            groups,
            &mut y,
        );
        y
    }

    #[test]
    fn each_rows_change_is_its_own_whatever_the_others_and_the_path() {
        // A rank the kernel keeps in registers and one it does not; a group of more rows
        // than one chunk takes; more columns than a block, so both splits have several
        // chunks.
        for rank in [3, 16] {
            let (n_in, n_out, tokens) = (37, 600, 7);
            let shape = (n_in, n_out);
            let x: Vec<f32> = (0..tokens * n_in)
                .map(|i| (i as f32 * 0.37).sin())
                .collect();
            let a: Vec<f32> = (0..n_in * rank).map(|i| (i as f32 * 0.11).cos()).collect();
            let b: Vec<f32> = (0..rank * n_out)
                .map(|i| (i as f32 * 0.013).sin() - 0.2)
                .collect();
            let a2: Vec<f32> = a.iter().map(|v| v * -0.5).collect();
            let first: &[u32] = &[3, 0, 2, 5, 6];
            let group = |rows| LoraGroup {
                rows,
                a: &a,
                b: &b,
                rank,
            };
            let other = LoraGroup {
                rows: &[1, 4],
                a: &a2,
                b: &b,
                rank,
            };
            let all = changes(
                SimdPath::active(),
                &x,
                shape,
                &[group(first), other],
                tokens,
            );
            // Each row alone, on every path: the same bits as in the step.
            for path in SimdPath::ALL.into_iter().filter(|p| p.is_supported()) {
                for r in first {
                    let alone = changes(path, &x, shape, &[group(std::slice::from_ref(r))], tokens);
                    let r = *r as usize;
                    let row = r * n_out..(r + 1) * n_out;
                    assert_eq!(alone[row.clone()], all[row], "{path:?} rank {rank} row {r}");
                    assert_eq!(alone.iter().filter(|&&v| v != 0.0).count(), n_out);
                }
            }
            // And the plain product, for every row of both groups.
            for (rows, a) in [(first, &a), (&[1, 4][..], &a2)] {
                for &r in rows {
                    let r = r as usize;
                    for o in 0..n_out {
                        let mut want = 0f64;
                        for k in 0..rank {
                            let t: f64 = (0..n_in)
                                .map(|j| x[r * n_in + j] as f64 * a[j * rank + k] as f64)
                                .sum();
                            want += t * b[k * n_out + o] as f64;
                        }
                        let got = all[r * n_out + o] as f64;
                        assert!(
                            (got - want).abs() < 1e-3,
                            "rank {rank} row {r} column {o}: {got} {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "LoRA factors or rows that do not fit the projection")]
    fn a_row_outside_the_step_is_refused() {
        let a = [1.0f32; 4];
        let b = [1.0f32; 6];
        let group = LoraGroup {
            rows: &[2],
            a: &a,
            b: &b,
            rank: 2,
        };
        changes(SimdPath::active(), &[0.0; 4], (2, 3), &[group], 2);
    }
}
