//! RMSNorm.

use burn::tensor::{Tensor, backend::Backend};

/// Root-mean-square normalisation over the last axis of `x` (`[rows, d]`), scaled by
/// `weight` (`[d]`).
pub fn rms_norm<B: Backend>(x: Tensor<B, 2>, weight: &Tensor<B, 1>, eps: f64) -> Tensor<B, 2> {
    let inv_rms = (x.clone() * x.clone())
        .mean_dim(1)
        .add_scalar(eps)
        .sqrt()
        .recip();
    x * inv_rms * weight.clone().unsqueeze::<2>()
}
