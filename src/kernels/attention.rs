//! Scaled dot-product attention on the CPU in one fixed reduction order.
//!
//! Burn's fused attention reduces over every key column, masked ones included, so a row
//! padded in a batch sums over a different number of terms than the same row alone. Here
//! masked keys are skipped: a query's result depends only on the keys it sees, taken in
//! column order. Scores are dot products in the kernels' canonical order (see
//! [`super::cpu`]); the softmax takes the maximum, the exponentials and their sum in key
//! order; the output accumulates `p_j * v_j` in key order. So a row's attention is
//! bitwise the same alone, left-padded in a batch, or with its prompt read in chunks.

use rayon::prelude::*;

use super::cpu::{SimdPath, dot};
use crate::error::{LlamaError, Result};

/// Shapes of one attention call: queries `[batch, heads, queries, dim]`, keys and values
/// `[batch, heads, keys, dim]`, an optional mask `[batch, mask_heads, queries, keys]`
/// (`mask_heads` 1 or `heads`; `true` hides a key).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    /// Rows.
    pub batch: usize,
    /// Heads (key/value heads; grouped query heads are folded into `queries`).
    pub heads: usize,
    /// Queries per row and head.
    pub queries: usize,
    /// Keys per row and head.
    pub keys: usize,
    /// Values per head vector.
    pub dim: usize,
    /// Heads of the mask (1: shared by all heads).
    pub mask_heads: usize,
}

/// Keys or values `[batch, heads, keys, dim]` read in place: element `(b, h, j, d)` is
/// `data[offset + b * strides[0] + h * strides[1] + j * strides[2] + d]`. A cache's
/// filled columns are such a view of its memory, so attention reads them without a copy.
#[derive(Debug, Clone, Copy)]
pub struct Strided<'a> {
    /// The memory.
    pub data: &'a [f32],
    /// Where element `(0, 0, 0, 0)` is.
    pub offset: usize,
    /// Steps between rows, heads and keys (values along `dim` are adjacent).
    pub strides: [usize; 3],
}

impl<'a> Strided<'a> {
    /// A contiguous `[batch, heads, keys, dim]` tensor.
    pub fn contiguous(data: &'a [f32], shape: AttentionShape) -> Self {
        let dim = shape.dim;
        Self {
            data,
            offset: 0,
            strides: [shape.heads * shape.keys * dim, shape.keys * dim, dim],
        }
    }

    /// Whether every element of `shape` lies inside `data`.
    fn covers(&self, shape: AttentionShape) -> bool {
        if shape.batch == 0 || shape.heads == 0 || shape.keys == 0 || shape.dim == 0 {
            return true;
        }
        let last = self.offset
            + (shape.batch - 1) * self.strides[0]
            + (shape.heads - 1) * self.strides[1]
            + (shape.keys - 1) * self.strides[2]
            + shape.dim;
        last <= self.data.len()
    }

    /// The keys (or values) of row `b`, head `h`, as `keys` vectors of `dim`.
    fn vectors(
        &self,
        b: usize,
        h: usize,
        keys: usize,
        dim: usize,
    ) -> impl Iterator<Item = &'a [f32]> {
        let base = self.offset + b * self.strides[0] + h * self.strides[1];
        let (data, step) = (self.data, self.strides[2]);
        (0..keys).map(move |j| &data[base + j * step..base + j * step + dim])
    }
}

/// `softmax(q k^T / sqrt(dim), masked) v` over contiguous slices: returns
/// `[batch, heads, queries, dim]`.
///
/// # Errors
///
/// [`LlamaError::ShapeMismatch`] if a slice does not match `shape`.
pub fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: Option<&[bool]>,
    shape: AttentionShape,
) -> Result<Vec<f32>> {
    attention_strided(
        q,
        Strided::contiguous(k, shape),
        Strided::contiguous(v, shape),
        mask,
        shape,
    )
}

/// [`attention`] with keys and values read in place through [`Strided`] views.
///
/// # Errors
///
/// [`LlamaError::ShapeMismatch`] if a slice or view does not match `shape`.
pub fn attention_strided(
    q: &[f32],
    k: Strided<'_>,
    v: Strided<'_>,
    mask: Option<&[bool]>,
    shape: AttentionShape,
) -> Result<Vec<f32>> {
    let AttentionShape {
        batch,
        heads,
        queries,
        keys,
        dim,
        mask_heads,
    } = shape;
    let check = |name: &str, len: usize, want: usize| {
        if len == want {
            Ok(())
        } else {
            Err(LlamaError::ShapeMismatch {
                name: format!("attention {name}"),
                expected: vec![want],
                actual: vec![len],
            })
        }
    };
    check("queries", q.len(), batch * heads * queries * dim)?;
    for (name, view) in [("keys", &k), ("values", &v)] {
        if !view.covers(shape) {
            return Err(LlamaError::ShapeMismatch {
                name: format!("attention {name}"),
                expected: vec![batch, heads, keys, dim],
                actual: vec![view.data.len()],
            });
        }
    }
    if let Some(m) = mask {
        if mask_heads != 1 && mask_heads != heads {
            return Err(LlamaError::invalid(
                "mask heads",
                mask_heads,
                "must be 1 or heads",
            ));
        }
        check("mask", m.len(), batch * mask_heads * queries * keys)?;
    }
    let path = SimdPath::active();
    let scale = 1.0 / (dim as f32).sqrt();
    let mut out = vec![0f32; q.len()];
    out.par_chunks_mut(queries * dim)
        .enumerate()
        .for_each(|(bh, out)| {
            let (b, h) = (bh / heads, bh % heads);
            let values: Vec<&[f32]> = v.vectors(b, h, keys, dim).collect();
            let mask_base = (b * mask_heads + if mask_heads == 1 { 0 } else { h }) * queries;
            let mut scores = Vec::with_capacity(keys);
            for (i, o) in out.chunks_exact_mut(dim).enumerate() {
                let qi = &q[(bh * queries + i) * dim..(bh * queries + i + 1) * dim];
                let hidden = mask.map(|m| &m[(mask_base + i) * keys..(mask_base + i + 1) * keys]);
                scores.clear();
                for (j, kj) in k.vectors(b, h, keys, dim).enumerate() {
                    if hidden.is_none_or(|m| !m[j]) {
                        scores.push((j, dot(path, qi, kj) * scale));
                    }
                }
                let max = scores.iter().fold(f32::NEG_INFINITY, |m, &(_, s)| m.max(s));
                let mut sum = 0f32;
                o.fill(0.0);
                for &(j, s) in &scores {
                    let p = (s - max).exp();
                    sum += p;
                    for (o, &x) in o.iter_mut().zip(values[j]) {
                        *o += p * x;
                    }
                }
                if sum > 0.0 {
                    for o in o.iter_mut() {
                        *o /= sum;
                    }
                }
            }
        });
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng, rngs::StdRng};

    fn random(n: usize, rng: &mut StdRng) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    #[test]
    fn matches_a_plain_softmax_and_ignores_hidden_keys() {
        let mut rng = StdRng::seed_from_u64(5);
        let (keys, dim) = (7, 64);
        let shape = AttentionShape {
            batch: 1,
            heads: 1,
            queries: 1,
            keys,
            dim,
            mask_heads: 1,
        };
        let (q, k, v) = (
            random(dim, &mut rng),
            random(keys * dim, &mut rng),
            random(keys * dim, &mut rng),
        );
        let out = attention(&q, &k, &v, None, shape).unwrap();
        let s: Vec<f64> = k
            .chunks(dim)
            .map(|kj| {
                kj.iter()
                    .zip(&q)
                    .map(|(a, b)| f64::from(a * b))
                    .sum::<f64>()
                    / 8.0
            })
            .collect();
        let max = s.iter().cloned().fold(f64::MIN, f64::max);
        let e: Vec<f64> = s.iter().map(|x| (x - max).exp()).collect();
        let total: f64 = e.iter().sum();
        for d in 0..dim {
            let want: f64 = (0..keys)
                .map(|j| e[j] * f64::from(v[j * dim + d]))
                .sum::<f64>()
                / total;
            assert!((f64::from(out[d]) - want).abs() < 1e-5);
        }
        // Hiding the first two keys equals dropping them, to the bit.
        let mut mask = vec![false; keys];
        mask[..2].fill(true);
        let hidden = attention(&q, &k, &v, Some(&mask), shape).unwrap();
        let dropped = attention(
            &q,
            &k[2 * dim..],
            &v[2 * dim..],
            None,
            AttentionShape {
                keys: keys - 2,
                ..shape
            },
        )
        .unwrap();
        assert_eq!(hidden, dropped);
        assert!(attention(&q, &k[1..], &v, None, shape).is_err());

        // Keys and values read in place from a larger cache (3 spare columns, and an
        // offset) give the same bits as contiguous copies.
        let cap = keys + 3;
        let pad = |src: &[f32]| {
            let mut buf = vec![f32::NAN; 5 + cap * dim];
            buf[5..5 + keys * dim].copy_from_slice(src);
            buf
        };
        let (kb, vb) = (pad(&k), pad(&v));
        let view = |data| Strided {
            data,
            offset: 5,
            strides: [cap * dim, cap * dim, dim],
        };
        let strided = attention_strided(&q, view(&kb), view(&vb), None, shape).unwrap();
        assert_eq!(strided, out);
        let short = Strided {
            data: &kb[..5 + (keys - 1) * dim],
            ..view(&kb)
        };
        assert!(attention_strided(&q, short, view(&vb), None, shape).is_err());
    }
}
