//! RMSNorm.

use burn::tensor::Tensor;

use crate::backend::LlamaBackend;
use crate::error::Result;

/// Root-mean-square normalisation over the last axis of `x` (`[rows, d]`), scaled by
/// `weight` (`[d]`), with the backend's [`LlamaBackend::rms_norm`].
///
/// # Errors
///
/// [`LlamaError::ShapeMismatch`](crate::LlamaError::ShapeMismatch) if `weight` does not
/// have `d` values.
pub fn rms_norm<B: LlamaBackend>(
    x: Tensor<B, 2>,
    weight: &Tensor<B, 1>,
    eps: f64,
) -> Result<Tensor<B, 2>> {
    B::rms_norm(x, weight, eps)
}
