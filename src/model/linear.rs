//! Projections (`x @ W`), optionally split by output columns so a CPU backend runs one
//! block per core.
//!
//! Burn's CPU backend runs a matrix product on a single thread below about 7 M
//! multiply-adds, which covers every projection of a small model while decoding a few
//! rows. Splitting the weight into contiguous column blocks and computing the blocks in
//! parallel uses every core. Each output element is the same dot product either way.

use burn::tensor::{Tensor, TensorData, backend::Backend};
use rayon::prelude::*;

/// A weight matrix `[in, out]`, stored as one or more contiguous column blocks.
#[derive(Debug, Clone)]
pub struct Projection<B: Backend> {
    blocks: Vec<Tensor<B, 2>>,
    dims: [usize; 2],
}

impl<B: Backend> Projection<B> {
    /// A projection from a `[in, out]` tensor, as one block.
    pub fn new(weight: Tensor<B, 2>) -> Self {
        let dims = weight.dims();
        Self {
            blocks: vec![weight],
            dims,
        }
    }

    /// A projection from row-major `[in, out]` host data, split into `blocks` contiguous
    /// column blocks (fewer if `out` is small).
    pub fn from_host(data: &[f32], dims: [usize; 2], blocks: usize, device: &B::Device) -> Self {
        let [rows, cols] = dims;
        let blocks = blocks.clamp(1, cols.div_ceil(64).max(1));
        let width = cols.div_ceil(blocks);
        let parts = (0..cols)
            .step_by(width)
            .map(|start| {
                let end = (start + width).min(cols);
                let mut block = Vec::with_capacity(rows * (end - start));
                for r in 0..rows {
                    block.extend_from_slice(&data[r * cols + start..r * cols + end]);
                }
                Tensor::<B, 2>::from_data(TensorData::new(block, [rows, end - start]), device)
            })
            .collect();
        Self {
            blocks: parts,
            dims,
        }
    }

    /// `[in, out]`.
    pub fn dims(&self) -> [usize; 2] {
        self.dims
    }

    /// `x @ W` for `x` of shape `[rows, in]`.
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        if let [only] = self.blocks.as_slice() {
            return x.matmul(only.clone());
        }
        let outs: Vec<Tensor<B, 2>> = self
            .blocks
            .par_iter()
            .map(|w| x.clone().matmul(w.clone()))
            .collect();
        Tensor::cat(outs, 1)
    }
}

/// How many column blocks to split projections into on backend `B`: one per core on
/// Burn's CPU backend (Flex), one elsewhere (GPU backends parallelise each product).
pub fn default_blocks<B: Backend>() -> usize {
    if std::any::type_name::<B>().contains("burn_flex") {
        std::thread::available_parallelism().map_or(1, usize::from)
    } else {
        1
    }
}
