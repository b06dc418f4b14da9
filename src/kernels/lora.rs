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

/// `(x[r] @ a) @ b` for each `r` in `rows`, `[rows.len(), n_out]`, with `x` row-major
/// `[_, n_in]`. Rows are computed in parallel, each on one thread in one order: the
/// rank vector sums the inputs in order, each output sums the rank in order.
pub fn deltas(x: &[f32], rows: &[u32], a: &[f32], b: &[f32], shape: LoraShape) -> Vec<f32> {
    let LoraShape { n_in, rank, n_out } = shape;
    let mut out = vec![0f32; rows.len() * n_out];
    if n_out == 0 || rank == 0 {
        return out;
    }
    out.par_chunks_mut(n_out)
        .zip(rows.par_iter())
        .for_each(|(out, &r)| {
            let x = &x[r as usize * n_in..(r as usize + 1) * n_in];
            let mut t = vec![0f32; rank];
            for (&xi, a_row) in x.iter().zip(a.chunks_exact(rank)) {
                for (t, &a) in t.iter_mut().zip(a_row) {
                    *t += xi * a;
                }
            }
            for (&tk, b_row) in t.iter().zip(b.chunks_exact(n_out)) {
                for (o, &b) in out.iter_mut().zip(b_row) {
                    *o += tk * b;
                }
            }
        });
    out
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
