//! LoRA changes on the CPU: for each row `x` of a step that uses an adapter,
//! `(x @ a) @ b`, one fixed order of addition per row, so a row's change is the same
//! bits whatever the other rows and however many threads run.

use rayon::prelude::*;

/// The factors' shape: `a` is `[n_in, rank]`, `b` `[rank, n_out]`, both row-major.
#[derive(Debug, Clone, Copy)]
pub struct LoraShape {
    /// Inputs of the projection.
    pub n_in: usize,
    /// The rank (of all the projection's tensors together).
    pub rank: usize,
    /// Outputs of the projection.
    pub n_out: usize,
}

/// Output columns per block of the second product: a block of `b`'s rows (`rank x
/// 256` values, 16 KiB at rank 16) stays in the core's cache while every row of the
/// group uses it.
const COLUMN_BLOCK: usize = 256;

/// `(x[r] @ a) @ b` for each `r` in `rows`, `[rows.len(), n_out]`, with `x` row-major
/// `[_, n_in]`. Each value has one order of addition whatever the rows and threads: the
/// rank vector sums the inputs in order, each output sums the rank in order. The rank
/// vectors are made first, then each block of output columns for every row of the
/// group at once (blocks in parallel), so `b` is read once a step, not once a row.
pub fn deltas(x: &[f32], rows: &[u32], a: &[f32], b: &[f32], shape: LoraShape) -> Vec<f32> {
    let LoraShape { n_in, rank, n_out } = shape;
    let n = rows.len();
    let mut out = vec![0f32; n * n_out];
    if n_out == 0 || rank == 0 || n == 0 {
        return out;
    }
    let mut t = vec![0f32; n * rank];
    for (t, &r) in t.chunks_exact_mut(rank).zip(rows) {
        let x = &x[r as usize * n_in..(r as usize + 1) * n_in];
        for (&xi, a_row) in x.iter().zip(a.chunks_exact(rank)) {
            for (t, &a) in t.iter_mut().zip(a_row) {
                *t += xi * a;
            }
        }
    }
    // Blocks of columns, each `[n, width]` row-major, then laid out as `[n, n_out]`.
    let blocks: Vec<(usize, Vec<f32>)> = (0..n_out)
        .step_by(COLUMN_BLOCK)
        .collect::<Vec<_>>()
        .into_par_iter()
        .map(|c0| {
            let width = COLUMN_BLOCK.min(n_out - c0);
            let mut d = vec![0f32; n * width];
            for (d, t) in d.chunks_exact_mut(width).zip(t.chunks_exact(rank)) {
                for (k, &tk) in t.iter().enumerate() {
                    let b_row = &b[k * n_out + c0..k * n_out + c0 + width];
                    for (o, &b) in d.iter_mut().zip(b_row) {
                        *o += tk * b;
                    }
                }
            }
            (c0, d)
        })
        .collect();
    for (c0, d) in blocks {
        let width = d.len() / n;
        for (i, d) in d.chunks_exact(width).enumerate() {
            out[i * n_out + c0..i * n_out + c0 + width].copy_from_slice(d);
        }
    }
    out
}

/// Adds [`deltas`] into `y` (`[_, n_out]` row-major) at `rows`.
pub fn add_deltas(x: &[f32], rows: &[u32], a: &[f32], b: &[f32], shape: LoraShape, y: &mut [f32]) {
    let n_out = shape.n_out;
    let d = deltas(x, rows, a, b, shape);
    for (&r, delta) in rows.iter().zip(d.chunks_exact(n_out.max(1))) {
        let row = &mut y[r as usize * n_out..(r as usize + 1) * n_out];
        for (y, d) in row.iter_mut().zip(delta) {
            *y += d;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rows_change_is_its_own_whatever_the_others() {
        let shape = LoraShape {
            n_in: 5,
            rank: 2,
            n_out: 3,
        };
        let x: Vec<f32> = (0..20).map(|i| (i as f32 * 0.37).sin()).collect();
        let a: Vec<f32> = (0..10).map(|i| (i as f32 * 0.11).cos()).collect();
        let b: Vec<f32> = (0..6).map(|i| i as f32 - 2.5).collect();
        let all = deltas(&x, &[3, 0, 2], &a, &b, shape);
        // Row 0 alone: the same bits as in the group.
        assert_eq!(deltas(&x, &[0], &a, &b, shape), all[3..6]);
        // And the plain product.
        for (i, &r) in [3usize, 0, 2].iter().enumerate() {
            for o in 0..3 {
                let mut want = 0f64;
                for k in 0..2 {
                    let t: f64 = (0..5)
                        .map(|j| x[r * 5 + j] as f64 * a[j * 2 + k] as f64)
                        .sum();
                    want += t * b[k * 3 + o] as f64;
                }
                assert!((all[i * 3 + o] as f64 - want).abs() < 1e-4, "{r} {o}");
            }
        }
    }
}
