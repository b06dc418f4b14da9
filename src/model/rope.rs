//! Rotary position embeddings (the "rotate half" layout used by Hugging Face Llama
//! checkpoints; GGUF weights are converted to it on load).
//!
//! RoPE is applied to the 2-D projection output `[rows, heads * head_dim]` with
//! same-shaped cosine/sine tensors by [`LlamaBackend::rope`]: the CPU backend in one pass
//! of its own, other backends with Burn's operations, where the half rotation is a
//! product with a fixed permutation matrix so that every operation works on contiguous,
//! equally shaped tensors (which ran far faster than broadcasts over strided views); the
//! permutation product is exact (one term is `1 * x`, the others `0 * y`), so both give
//! the same bits.

use burn::tensor::{Int, Tensor, TensorData, backend::Backend};

use crate::backend::LlamaBackend;
use crate::config::LlamaConfig;
use crate::error::Result;

/// Precomputed cosines and sines for every position of the context window.
#[derive(Debug, Clone)]
pub struct RopeTable<B: Backend> {
    /// `[max_seq_len, head_dim]`: `cos(p * f_i)` repeated over both halves.
    cos: Tensor<B, 2>,
    /// `[max_seq_len, head_dim]`: `-sin` on the first half, `+sin` on the second.
    sin: Tensor<B, 2>,
    /// `[head_dim, head_dim]` permutation swapping the two halves of a head.
    swap_halves: Tensor<B, 2>,
    max_positions: usize,
}

/// The angles of one forward pass: each row's position in the table, and the cosines and
/// sines gathered for them (`[rows, heads * head_dim]`) on first use, once for every
/// layer; a kernel that reads the table at each row's position itself
/// ([`LlamaBackend::rope_paged_store`] on the CubeCL backends) never gathers them.
#[derive(Debug)]
pub struct RopeAngles<B: Backend> {
    cos_table: Tensor<B, 2>,
    sin_table: Tensor<B, 2>,
    positions: Vec<usize>,
    heads: usize,
    gathered: std::cell::OnceCell<(Tensor<B, 2>, Tensor<B, 2>)>,
}

impl<B: Backend> RopeAngles<B> {
    /// The angles of rows at `positions` for `heads` heads, from tables `cos_table` and
    /// `sin_table` `[positions in the table, head_dim]` (the sines negative on each
    /// head's first half, as [`LlamaBackend::rope`] takes them).
    ///
    /// # Errors
    ///
    /// [`LlamaError::ShapeMismatch`](crate::LlamaError::ShapeMismatch) if the tables'
    /// shapes differ; [`LlamaError::PromptTooLong`](crate::LlamaError::PromptTooLong) if a
    /// position is past them.
    pub fn new(
        cos_table: Tensor<B, 2>,
        sin_table: Tensor<B, 2>,
        positions: Vec<usize>,
        heads: usize,
    ) -> Result<Self> {
        if cos_table.dims() != sin_table.dims() {
            return Err(crate::LlamaError::ShapeMismatch {
                name: "rope sine table".into(),
                expected: cos_table.dims().to_vec(),
                actual: sin_table.dims().to_vec(),
            });
        }
        let max = cos_table.dims()[0];
        if let Some(&p) = positions.iter().find(|&&p| p >= max) {
            return Err(crate::LlamaError::PromptTooLong { tokens: p + 1, max });
        }
        Ok(Self {
            cos_table,
            sin_table,
            positions,
            heads,
            gathered: std::cell::OnceCell::new(),
        })
    }

    /// Each row's position.
    pub fn positions(&self) -> &[usize] {
        &self.positions
    }

    /// The tables, `[positions, head_dim]` each: cosines, then sines.
    pub fn tables(&self) -> (&Tensor<B, 2>, &Tensor<B, 2>) {
        (&self.cos_table, &self.sin_table)
    }

    /// Heads per row the gathered angles cover.
    pub fn heads(&self) -> usize {
        self.heads
    }

    /// The cosines and sines of every row, `[rows, heads * head_dim]` each, gathered from
    /// the tables on the first call.
    pub fn gathered(&self) -> (&Tensor<B, 2>, &Tensor<B, 2>) {
        let (cos, sin) = self.gathered.get_or_init(|| {
            let device = self.cos_table.device();
            let idx: Vec<i64> = self.positions.iter().map(|&p| p as i64).collect();
            let idx = Tensor::<B, 1, Int>::from_data(
                TensorData::new(idx, [self.positions.len()]),
                &device,
            );
            let pick =
                |t: &Tensor<B, 2>| t.clone().select(0, idx.clone()).repeat_dim(1, self.heads);
            (pick(&self.cos_table), pick(&self.sin_table))
        });
        (cos, sin)
    }
}

impl<B: Backend> RopeTable<B> {
    /// Builds the table for positions `0..config.max_seq_len`, in f32 as the reference
    /// implementation does.
    pub fn new(config: &LlamaConfig, device: &B::Device) -> Self {
        let head_dim = config.head_dim;
        let half = head_dim / 2;
        let inv_freq: Vec<f32> = config.rope_inv_freq().iter().map(|&f| f as f32).collect();
        let n = config.max_seq_len;
        let mut cos = Vec::with_capacity(n * head_dim);
        let mut sin = Vec::with_capacity(n * head_dim);
        for pos in 0..n {
            let angles: Vec<f32> = inv_freq.iter().map(|&f| pos as f32 * f).collect();
            for _ in 0..2 {
                cos.extend(angles.iter().map(|a| a.cos()));
            }
            sin.extend(angles.iter().map(|a| -a.sin()));
            sin.extend(angles.iter().map(|a| a.sin()));
        }
        // swap[j][i] = 1 where i = (j + half) mod head_dim: (x @ swap)[i] = x[(i + half) mod d].
        let mut swap = vec![0f32; head_dim * head_dim];
        for j in 0..head_dim {
            swap[j * head_dim + (j + half) % head_dim] = 1.0;
        }
        let shape = [n, head_dim];
        Self {
            cos: Tensor::from_data(TensorData::new(cos, shape), device),
            sin: Tensor::from_data(TensorData::new(sin, shape), device),
            swap_halves: Tensor::from_data(TensorData::new(swap, [head_dim, head_dim]), device),
            max_positions: n,
        }
    }

    /// Number of positions in the table.
    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// The angles of rows at `positions` (one per row) for `heads` heads (gathered
    /// `[positions.len(), heads * head_dim]` where a kernel needs them so).
    ///
    /// # Errors
    ///
    /// [`LlamaError::PromptTooLong`](crate::LlamaError::PromptTooLong) if a position is
    /// past the table.
    pub fn angles(&self, positions: &[usize], heads: usize) -> Result<RopeAngles<B>> {
        RopeAngles::new(
            self.cos.clone(),
            self.sin.clone(),
            positions.to_vec(),
            heads,
        )
    }

    /// `angles` with this table's half swap, as [`LlamaBackend::rope_paged_store`] takes
    /// them.
    pub(crate) fn rotation<'a>(
        &'a self,
        angles: &'a RopeAngles<B>,
    ) -> crate::backend::Rotation<'a, B> {
        crate::backend::Rotation {
            angles,
            swap: &self.swap_halves,
        }
    }

    /// Rotates `x` (`[rows, heads * head_dim]`, heads contiguous) by `angles`, with the
    /// backend's [`LlamaBackend::rope`].
    ///
    /// # Errors
    ///
    /// [`LlamaError::ShapeMismatch`](crate::LlamaError::ShapeMismatch) if `x` does not
    /// have the angles' shape.
    pub fn apply(&self, x: Tensor<B, 2>, angles: &RopeAngles<B>) -> Result<Tensor<B, 2>>
    where
        B: LlamaBackend,
    {
        let (cos, sin) = angles.gathered();
        B::rope(x, cos, sin, &self.swap_halves)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{DefaultBackend as B, default_device};
    use crate::error::{LlamaError, assert_err};

    #[test]
    fn the_backend_rope_gives_the_bits_of_burn_operations() {
        let (rows, heads, head_dim) = (5, 3, 8);
        let width = heads * head_dim;
        let device = default_device();
        let tensor = |f: &dyn Fn(usize) -> f32| {
            let data: Vec<f32> = (0..rows * width).map(f).collect();
            Tensor::<B, 2>::from_data(TensorData::new(data, [rows, width]), &device)
        };
        let x = tensor(&|i| (i as f32 * 0.37).sin() * 3.0);
        let cos = tensor(&|i| (i as f32 * 0.11).cos());
        let sin = tensor(&|i| (i as f32 * 0.11).sin() * if i % 8 < 4 { -1.0 } else { 1.0 });
        let mut swap = vec![0f32; head_dim * head_dim];
        for j in 0..head_dim {
            swap[j * head_dim + (j + head_dim / 2) % head_dim] = 1.0;
        }
        let swap = Tensor::<B, 2>::from_data(TensorData::new(swap, [head_dim, head_dim]), &device);
        let rotated = x
            .clone()
            .reshape([rows * heads, head_dim])
            .matmul(swap.clone())
            .reshape([rows, width]);
        let want = (x.clone() * cos.clone() + rotated * sin.clone()).into_data();
        let got = B::rope(x.clone(), &cos, &sin, &swap).unwrap().into_data();
        let bits = |d: TensorData| -> Vec<u32> {
            d.to_vec::<f32>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        assert_eq!(bits(got), bits(want));
        let narrow = cos.clone().slice([0..rows, 0..head_dim]);
        assert_err!(
            B::rope(x, &narrow, &sin, &swap),
            LlamaError::ShapeMismatch { name, .. } if name == "rope cos"
        );
    }

    /// The backend's rotation at each row's position (the CPU backend reads the tables
    /// there, split across threads for a prompt's rows) against `rope` over the angles
    /// gathered for every row and head, on a column view of a wider tensor as a fused
    /// projection's queries and keys are.
    #[test]
    fn a_rotation_at_positions_gives_the_bits_of_the_gathered_angles() {
        let (rows, heads, head_dim, table) = (300, 4, 32, 50);
        let width = heads * head_dim;
        let device = default_device();
        let values = |n: usize, f: &dyn Fn(usize) -> f32| (0..n).map(f).collect::<Vec<f32>>();
        let cos = values(table * head_dim, &|i| (i as f32 * 0.013).cos());
        let sin = values(table * head_dim, &|i| {
            (i as f32 * 0.013).sin()
                * if i % head_dim < head_dim / 2 {
                    -1.0
                } else {
                    1.0
                }
        });
        let tensor =
            |v: Vec<f32>| Tensor::<B, 2>::from_data(TensorData::new(v, [table, head_dim]), &device);
        let positions: Vec<usize> = (0..rows).map(|i| (i * 7 + 3) % table).collect();
        let angles = RopeAngles::new(tensor(cos), tensor(sin), positions, heads).unwrap();
        let mut swap = vec![0f32; head_dim * head_dim];
        for j in 0..head_dim {
            swap[j * head_dim + (j + head_dim / 2) % head_dim] = 1.0;
        }
        let swap = Tensor::<B, 2>::from_data(TensorData::new(swap, [head_dim, head_dim]), &device);
        let wide = Tensor::<B, 2>::from_data(
            TensorData::new(
                values(rows * (width + 16), &|i| (i as f32 * 0.37).sin() * 3.0),
                [rows, width + 16],
            ),
            &device,
        );
        let x = wide.slice([0..rows, 8..8 + width]);
        let rotation = crate::backend::Rotation {
            angles: &angles,
            swap: &swap,
        };
        let bits = |t: Tensor<B, 2>| -> Vec<u32> {
            let v = t.into_data().to_vec::<f32>().unwrap();
            v.iter().map(|v| v.to_bits()).collect()
        };
        let (cos, sin) = angles.gathered();
        let want = bits(B::rope(x.clone(), cos, sin, &swap).unwrap());
        assert_eq!(bits(B::rope_rotation(x.clone(), &rotation).unwrap()), want);
        let narrow = x.slice([0..rows, 0..width - head_dim]);
        assert_err!(
            B::rope_rotation(narrow, &rotation),
            LlamaError::ShapeMismatch { name, .. } if name == "rope cos"
        );
    }
}
