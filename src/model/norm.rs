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

#[cfg(test)]
mod tests {
    use burn::tensor::TensorData;

    use super::*;
    use crate::backend::{DefaultBackend as B, default_device};
    use crate::error::{LlamaError, assert_err};

    /// The backend's residual add and norm (on the CPU backend: in place in the residual
    /// where it is held once, split across threads for a prompt's rows) against Burn's
    /// add and the backend's norm, with the residual held once and held twice.
    #[test]
    fn the_residual_add_and_norm_give_the_bits_of_an_add_then_the_norm() {
        let (rows, d) = (70, 1024);
        let device = default_device();
        let tensor = |f: &dyn Fn(usize) -> f32| {
            let data: Vec<f32> = (0..rows * d).map(f).collect();
            Tensor::<B, 2>::from_data(TensorData::new(data, [rows, d]), &device)
        };
        let x = || tensor(&|i| (i as f32 * 0.37).sin() * 3.0);
        let delta = tensor(&|i| (i as f32 * 0.11).cos() * 0.7);
        let weight_values: Vec<f32> = (0..d).map(|i| 1.0 + (i % 7) as f32 * 0.1).collect();
        let weight = Tensor::<B, 1>::from_data(TensorData::new(weight_values, [d]), &device);
        let bits = |t: Tensor<B, 2>| -> Vec<u32> {
            let v = t.into_data().to_vec::<f32>().unwrap();
            v.iter().map(|v| v.to_bits()).collect()
        };
        let want_sum = x() + delta.clone();
        let want_norm = bits(rms_norm(want_sum.clone(), &weight, 1e-5).unwrap());
        let want_sum = bits(want_sum);
        // Held once: added in place.
        let (sum, normed) = B::add_rms_norm(x(), delta.clone(), &weight, 1e-5).unwrap();
        assert_eq!(bits(sum), want_sum);
        assert_eq!(bits(normed), want_norm);
        // Held twice: the other handle keeps its values.
        let shared = x();
        let (sum, normed) = B::add_rms_norm(shared.clone(), delta.clone(), &weight, 1e-5).unwrap();
        assert_eq!(bits(sum), want_sum);
        assert_eq!(bits(normed), want_norm);
        assert_eq!(bits(shared), bits(x()));
        let narrow = delta.slice([0..rows, 0..d - 1]);
        assert_err!(
            B::add_rms_norm(x(), narrow, &weight, 1e-5),
            LlamaError::ShapeMismatch { name, .. } if name == "residual"
        );
    }
}
