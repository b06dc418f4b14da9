//! Projections (`x @ W`): dense f32 weights, optionally split by output columns so a CPU
//! backend runs one block per core, or weights kept in a quantized block format and
//! multiplied by the backend's [`LlamaBackend::quantized_matmul`].
//!
//! Burn's CPU backend runs a matrix product on a single thread below about 7 M
//! multiply-adds, which covers every projection of a small model while decoding a few
//! rows. Splitting the weight into contiguous column blocks and computing the blocks in
//! parallel uses every core. Each output element is the same dot product either way.

use std::sync::Arc;

use burn::tensor::{Tensor, backend::Backend};
use rayon::prelude::*;

use crate::backend::{Around, Beside, LlamaBackend, upload_matrix};
use crate::config::Precision;
use crate::error::{LlamaError, Result};
use crate::kernels::QuantMatrix;

/// One contiguous range of a projection's output columns.
#[derive(Debug, Clone)]
enum Part<B: Backend> {
    /// f32 weights `[in, columns]`.
    Dense(Tensor<B, 2>),
    /// Quantized weights `[columns, in]` (one row per output, ggml's layout).
    Quantized(Arc<QuantMatrix>),
}

impl<B: Backend> Part<B> {
    /// Output columns.
    fn columns(&self) -> usize {
        match self {
            Part::Dense(t) => t.dims()[1],
            Part::Quantized(m) => m.rows(),
        }
    }
}

/// A weight matrix `[in, out]`, stored as one or more contiguous column ranges, each
/// dense or quantized.
#[derive(Debug, Clone)]
pub struct Projection<B: Backend> {
    parts: Vec<Part<B>>,
    dims: [usize; 2],
}

impl<B: Backend> Projection<B> {
    /// A projection from a `[in, out]` tensor, as one block.
    pub fn new(weight: Tensor<B, 2>) -> Self {
        let dims = weight.dims();
        Self {
            parts: vec![Part::Dense(weight)],
            dims,
        }
    }

    /// A projection over quantized matrices `[out_i, in]`, their outputs side by side
    /// (`out = sum of out_i`). Consecutive matrices of one format are stacked into one
    /// (one product, one launch on a GPU).
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidFormat`] if there are none or their input sizes differ.
    pub fn quantized(matrices: Vec<QuantMatrix>) -> Result<Self> {
        let Some(first) = matrices.first() else {
            return Err(LlamaError::InvalidFormat(
                "a projection needs weights".into(),
            ));
        };
        let n_in = first.cols();
        if matrices.iter().any(|m| m.cols() != n_in) {
            return Err(LlamaError::InvalidFormat(
                "the parts of a projection differ in input size".into(),
            ));
        }
        let n_out = matrices.iter().map(QuantMatrix::rows).sum();
        let mut runs: Vec<Vec<QuantMatrix>> = Vec::new();
        for m in matrices {
            match runs.last_mut() {
                Some(run) if run[0].format() == m.format() => run.push(m),
                _ => runs.push(vec![m]),
            }
        }
        let parts = runs
            .into_iter()
            .map(|mut run| {
                let m = match run.len() {
                    1 => run.remove(0),
                    _ => QuantMatrix::stack(&run)?,
                };
                Ok(Part::Quantized(Arc::new(m)))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            parts,
            dims: [n_in, n_out],
        })
    }

    /// `[in, out]`.
    pub fn dims(&self) -> [usize; 2] {
        self.dims
    }

    /// The quantized matrix, where the projection is one (not split, not dense).
    pub fn as_quantized(&self) -> Option<&QuantMatrix> {
        match self.parts.as_slice() {
            [Part::Quantized(m)] => Some(m),
            _ => None,
        }
    }

    /// Whether any part is kept quantized.
    pub fn is_quantized(&self) -> bool {
        self.parts.iter().any(|p| matches!(p, Part::Quantized(_)))
    }

    /// Bytes of weights held (f32 or blocks).
    pub fn weight_bytes(&self) -> usize {
        self.parts
            .iter()
            .map(|p| match p {
                Part::Dense(t) => t.shape().num_elements() * t.dtype().size(),
                Part::Quantized(m) => m.bytes(),
            })
            .sum()
    }
}

impl<B: LlamaBackend> Projection<B> {
    /// A projection from row-major `[in, out]` host data, split into `blocks` contiguous
    /// column blocks (fewer if `out` is small).
    pub fn from_host(data: &[f32], dims: [usize; 2], blocks: usize, device: &B::Device) -> Self {
        let [rows, cols] = dims;
        let blocks = blocks.clamp(1, cols.div_ceil(64).max(1));
        let width = cols.div_ceil(blocks);
        let parts: Vec<Tensor<B, 2>> = (0..cols)
            .step_by(width)
            .map(|start| {
                let end = (start + width).min(cols);
                let mut block = Vec::with_capacity(rows * (end - start));
                for r in 0..rows {
                    block.extend_from_slice(&data[r * cols + start..r * cols + end]);
                }
                upload_matrix::<B>(block, [rows, end - start], device)
            })
            .collect();
        Self {
            parts: parts.into_iter().map(Part::Dense).collect(),
            dims,
        }
    }

    /// `x @ W` for `x` of shape `[rows, in]`, quantized parts in `precision`.
    ///
    /// # Errors
    ///
    /// What the backend's quantized product reports (a shape it cannot take).
    pub fn forward(&self, x: Tensor<B, 2>, precision: Precision) -> Result<Tensor<B, 2>> {
        Self::forward_parts(&self.parts, x, precision)
    }

    /// `x @ W` as two tensors, the output columns before `at` and from `at` on (a fused
    /// projection's outputs taken apart, such as the queries and keys from the values).
    /// Where a part ends at `at` each side is its own products (no copy, no
    /// concatenation), or, for two quantized parts, both in one launch where the backend
    /// can ([`LlamaBackend::quantized_matmul_two`]); elsewhere both are column views of
    /// the whole product.
    ///
    /// # Errors
    ///
    /// What [`forward`](Self::forward) reports; [`LlamaError::ShapeMismatch`] if `at`
    /// is past the outputs.
    pub fn forward_split(
        &self,
        x: Tensor<B, 2>,
        precision: Precision,
        at: usize,
    ) -> Result<(Tensor<B, 2>, Tensor<B, 2>)> {
        self.check_split(at)?;
        let mut end = 0;
        let boundary = self.parts.iter().position(|p| {
            let starts_at = end;
            end += p.columns();
            starts_at == at
        });
        if let ([Part::Quantized(a), Part::Quantized(b)], Some(1)) =
            (self.parts.as_slice(), boundary)
            && let Some(out) = B::quantized_matmul_two(x.clone(), a, b, precision)?
        {
            // Both parts in one launch, each side a column view of it.
            return Ok(split_columns(out, at));
        }
        match boundary {
            Some(i) if i > 0 => Ok((
                Self::forward_parts(&self.parts[..i], x.clone(), precision)?,
                Self::forward_parts(&self.parts[i..], x, precision)?,
            )),
            _ => Ok(split_columns(self.forward(x, precision)?, at)),
        }
    }

    /// `x @ W` with the work `around` it in the product's own launch, where the projection
    /// is one quantized matrix and the backend fuses it
    /// ([`LlamaBackend::fused_quantized_matmul`]); else `Ok(None)`, and the caller runs
    /// the norm or the add apart.
    ///
    /// # Errors
    ///
    /// What the backend's fused product reports (a shape it cannot take).
    pub fn forward_fused(
        &self,
        x: Tensor<B, 2>,
        around: Around<'_, B>,
        precision: Precision,
    ) -> Result<Option<Tensor<B, 2>>> {
        match self.parts.as_slice() {
            [Part::Quantized(m)] => {
                B::fused_quantized_matmul(x, m, Beside::Nothing, around, precision)
            }
            _ => Ok(None),
        }
    }

    /// [`forward_split`](Self::forward_split) with the work `around` the product in its
    /// launch, as [`forward_fused`](Self::forward_fused): for one quantized matrix, or two
    /// that meet at `at` (both in one launch); else `Ok(None)`.
    ///
    /// # Errors
    ///
    /// What [`forward_split`](Self::forward_split) reports.
    pub fn forward_split_fused(
        &self,
        x: Tensor<B, 2>,
        around: Around<'_, B>,
        precision: Precision,
        at: usize,
    ) -> Result<Option<(Tensor<B, 2>, Tensor<B, 2>)>> {
        self.check_split(at)?;
        let out = match self.parts.as_slice() {
            [Part::Quantized(m)] => {
                B::fused_quantized_matmul(x, m, Beside::Nothing, around, precision)?
            }
            [Part::Quantized(a), Part::Quantized(b)] if a.rows() == at => {
                B::fused_quantized_matmul(x, a, Beside::Second(b), around, precision)?
            }
            _ => None,
        };
        Ok(out.map(|out| split_columns(out, at)))
    }

    /// [`LlamaError::ShapeMismatch`] if a split at `at` is past the outputs.
    fn check_split(&self, at: usize) -> Result<()> {
        let n_out = self.dims[1];
        if at > n_out {
            return Err(LlamaError::ShapeMismatch {
                name: "projection split".into(),
                expected: vec![n_out],
                actual: vec![at],
            });
        }
        Ok(())
    }

    fn forward_parts(
        parts: &[Part<B>],
        x: Tensor<B, 2>,
        precision: Precision,
    ) -> Result<Tensor<B, 2>> {
        let part = |p: &Part<B>| match p {
            Part::Dense(w) => B::dense_matmul(x.clone(), w, false),
            Part::Quantized(m) => B::quantized_matmul(x.clone(), m, precision),
        };
        let quantized = parts.iter().any(|p| matches!(p, Part::Quantized(_)));
        match parts {
            [only] => part(only),
            parts if !quantized => {
                // Dense column blocks run one per core.
                let outs = parts.par_iter().map(part).collect::<Result<Vec<_>>>()?;
                Ok(Tensor::cat(outs, 1))
            }
            // Quantized kernels use every core themselves.
            parts => Ok(Tensor::cat(
                parts.iter().map(part).collect::<Result<Vec<_>>>()?,
                1,
            )),
        }
    }
}

/// How many column blocks to split projections into on backend `B`: one per core on
/// Burn's CPU backend (Flex), one elsewhere (GPU backends parallelise each product; a
/// router or remote backend over Flex sends each product as one operation).
pub fn default_blocks<B: Backend>() -> usize {
    if std::any::type_name::<B>().starts_with("burn_flex::") {
        std::thread::available_parallelism().map_or(1, usize::from)
    } else {
        1
    }
}

/// A product's output as two column views, the columns before `at` and from `at` on
/// (no copy).
fn split_columns<B: Backend>(out: Tensor<B, 2>, at: usize) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let [rows, n_out] = out.dims();
    (
        out.clone().slice([0..rows, 0..at]),
        out.slice([0..rows, at..n_out]),
    )
}

#[cfg(all(test, feature = "flex"))]
mod tests {
    use burn::backend::Flex;

    #[test]
    fn one_block_per_core_only_on_flex_itself() {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        assert_eq!(super::default_blocks::<Flex>(), cores);
        // A router over Flex names Flex in its type, and sends each product as one op.
        #[cfg(feature = "remote")]
        assert_eq!(
            super::default_blocks::<burn::backend::Router<(Flex, Flex)>>(),
            1
        );
    }
}
