//! Rotary position embeddings (the "rotate half" layout used by Hugging Face Llama
//! checkpoints; GGUF weights are converted to it on load).

use burn::tensor::{Int, Tensor, TensorData, backend::Backend};

use crate::config::LlamaConfig;

/// Precomputed cosines and sines for every position of the context window.
#[derive(Debug, Clone)]
pub struct RopeTable<B: Backend> {
    /// `[max_seq_len, head_dim]`: `cos(p * f_i)` repeated over both halves.
    cos: Tensor<B, 2>,
    /// `[max_seq_len, head_dim]`: `-sin` on the first half, `+sin` on the second.
    sin: Tensor<B, 2>,
    max_positions: usize,
}

impl<B: Backend> RopeTable<B> {
    /// Builds the table for positions `0..config.max_seq_len`, in f32 as the reference
    /// implementation does.
    pub fn new(config: &LlamaConfig, device: &B::Device) -> Self {
        let half = config.head_dim / 2;
        let inv_freq: Vec<f32> = config.rope_inv_freq().iter().map(|&f| f as f32).collect();
        let n = config.max_seq_len;
        let mut cos = Vec::with_capacity(n * 2 * half);
        let mut sin = Vec::with_capacity(n * 2 * half);
        for pos in 0..n {
            let angles: Vec<f32> = inv_freq.iter().map(|&f| pos as f32 * f).collect();
            for _ in 0..2 {
                cos.extend(angles.iter().map(|a| a.cos()));
            }
            sin.extend(angles.iter().map(|a| -a.sin()));
            sin.extend(angles.iter().map(|a| a.sin()));
        }
        let shape = [n, 2 * half];
        Self {
            cos: Tensor::from_data(TensorData::new(cos, shape), device),
            sin: Tensor::from_data(TensorData::new(sin, shape), device),
            max_positions: n,
        }
    }

    /// Number of positions in the table.
    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// Cosines and sines for the given positions (row-major `[batch, seq]`), each shaped
    /// `[batch, 1, seq, head_dim]` to broadcast over heads.
    pub fn gather(
        &self,
        positions: &[usize],
        batch: usize,
        seq: usize,
    ) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let device = self.cos.device();
        let idx: Vec<i64> = positions.iter().map(|&p| p as i64).collect();
        let idx = Tensor::<B, 1, Int>::from_data(TensorData::new(idx, [positions.len()]), &device);
        let dim = self.cos.dims()[1];
        let pick = |t: &Tensor<B, 2>| {
            t.clone()
                .select(0, idx.clone())
                .reshape([batch, 1, seq, dim])
        };
        (pick(&self.cos), pick(&self.sin))
    }
}

/// Rotates `x` (`[batch, heads, seq, head_dim]`) by the gathered angles.
pub fn apply_rope<B: Backend>(
    x: Tensor<B, 4>,
    cos: &Tensor<B, 4>,
    sin: &Tensor<B, 4>,
) -> Tensor<B, 4> {
    let [b, h, s, d] = x.dims();
    let half = d / 2;
    let x1 = x.clone().slice([0..b, 0..h, 0..s, 0..half]);
    let x2 = x.clone().slice([0..b, 0..h, 0..s, half..d]);
    let rotated = Tensor::cat(vec![x2, x1], 3);
    x * cos.clone() + rotated * sin.clone()
}
