//! Loading, all of it: GGUF files, Hugging Face safetensors directories and (feature
//! `pretrained`) hub downloads.
//!
//! - [`Loader`] (`builder.rs`): the front door, one builder for every format and option
//!   (`Loader::gguf(path).max_seq_len(n).quantize(..).precision(..).progress(..).load(&device)`);
//! - `load.rs`: the configuration readers [`LlamaConfig::from_gguf`] /
//!   [`LlamaConfig::from_hf_json`], the `*_pretrained` hub presets, and the old
//!   `load_*` constructors as deprecated wrappers over [`Loader`];
//! - [`gguf`]: the GGUF file reader (the ggml type table, dequantization and the
//!   quantizers are the block formats' own, in [`crate::quant`]);
//! - [`gguf_writer`]: a streaming GGUF writer; [`random`]: random-weight Llama GGUF
//!   files of real shapes, written with it;
//! - [`quantize`]: quantizing a checkpoint's matrices as they load ([`quantize::QuantizingSource`]);
//! - [`safetensors`]: safetensors files and shards;
//! - `pretrained` (feature `pretrained`): hub downloads;
//! - this file: [`TensorSource`], which hands out tensors by their Hugging Face names as
//!   row-major f32 data, and [`build_transformer`], which assembles the model from any
//!   source, so the formats cannot drift apart.

mod builder;
pub mod gguf;
pub mod gguf_writer;
mod load;
#[cfg(feature = "pretrained")]
#[cfg_attr(docsrs, doc(cfg(feature = "pretrained")))]
pub mod pretrained;
pub mod quantize;
pub mod random;

/// Dequantization of ggml blocks: the block formats' own ([`crate::quant::dequant`]),
/// here under its older path.
pub use crate::quant::dequant;
pub mod safetensors;

use std::io::IsTerminal;
use std::sync::Arc;

use burn::tensor::{Tensor, TensorData};

use crate::backend::{LlamaBackend, upload_matrix};

use crate::config::LlamaConfig;
use crate::error::{LlamaError, Result};
use crate::kernels::QuantMatrix;
use crate::model::linear::default_blocks;
use crate::model::weights::{
    BLOCK_WEIGHTS, EMBED, FINAL_NORM, LM_HEAD, WeightKind, layer_name, tensor_count,
};
use crate::model::{Block, BlockTensor, Projection, Transformer, VocabMatrix};
use crate::quant::QuantFormat;
use gguf::GgufFile;

pub use builder::{DEFAULT_MAX_SEQ_LEN, Embedded, Given, Loader, TokenizerChoice};

/// A checkpoint that hands out tensors by Hugging Face name (`model.layers.0.self_attn.q_proj.weight`, ...).
pub trait TensorSource {
    /// Whether the checkpoint holds this tensor.
    fn contains(&self, name: &str) -> bool;
    /// Reads a tensor as row-major f32 with its shape (PyTorch order).
    fn read(&mut self, name: &str) -> Result<(Vec<usize>, Vec<f32>)>;
    /// Reads a 2-D tensor in its block format, if it is stored in one the CPU kernels
    /// take ([`QuantFormat`]); `None` otherwise. Rows are in
    /// Hugging Face order, as [`read`](Self::read) gives them.
    fn read_quantized(&mut self, _name: &str) -> Result<Option<QuantMatrix>> {
        Ok(None)
    }
}

/// Reports loading progress: called with (tensors done, tensors total).
pub type ProgressFn<'a> = &'a mut dyn FnMut(usize, usize);

/// A progress reporter that draws a percentage on stderr when stderr is a terminal and
/// stays silent otherwise (logs, CI).
pub fn terminal_progress(label: &str) -> impl FnMut(usize, usize) + '_ {
    let enabled = std::io::stderr().is_terminal();
    let mut last = usize::MAX;
    move |done, total| {
        if !enabled || total == 0 {
            return;
        }
        let pct = done * 100 / total;
        if pct != last {
            last = pct;
            eprint!("\r{label}: {pct:3}%");
            if done == total {
                eprintln!();
            }
        }
    }
}

/// Reads named tensors from a source, checks their shapes and reports progress.
struct WeightReader<'s, 'p, B: LlamaBackend> {
    source: &'s mut dyn TensorSource,
    progress: ProgressFn<'p>,
    done: usize,
    total: usize,
    device: B::Device,
    /// Keep supported block formats quantized (the backend has kernels for them).
    quantized: bool,
    /// Column blocks of dense projections.
    blocks: usize,
}

impl<B: LlamaBackend> WeightReader<'_, '_, B> {
    fn step(&mut self) {
        self.done += 1;
        (self.progress)(self.done, self.total);
    }

    fn check_shape(name: &str, shape: Vec<usize>, expected: &[usize]) -> Result<()> {
        if shape != expected {
            return Err(LlamaError::ShapeMismatch {
                name: name.to_string(),
                expected: expected.to_vec(),
                actual: shape,
            });
        }
        Ok(())
    }

    /// A tensor as f32.
    fn f32(&mut self, name: &str, expected: &[usize]) -> Result<Vec<f32>> {
        if !self.source.contains(name) {
            return Err(LlamaError::MissingTensor(name.to_string()));
        }
        let (shape, data) = self.source.read(name)?;
        Self::check_shape(name, shape, expected)?;
        self.step();
        Ok(data)
    }

    /// A `[rows, cols]` matrix in its block format, when the backend keeps it so and the
    /// source holds it in a supported format.
    fn quantized(&mut self, name: &str, rows: usize, cols: usize) -> Result<Option<QuantMatrix>> {
        if !self.quantized {
            return Ok(None);
        }
        if !self.source.contains(name) {
            return Err(LlamaError::MissingTensor(name.to_string()));
        }
        let Some(m) = self.source.read_quantized(name)? else {
            return Ok(None);
        };
        Self::check_shape(name, vec![m.rows(), m.cols()], &[rows, cols])?;
        self.step();
        Ok(Some(m))
    }

    /// A `[len]` vector.
    fn vector(&mut self, name: &str, len: usize) -> Result<Tensor<B, 1>> {
        let data = self.f32(name, &[len])?;
        Ok(Tensor::from_data(
            TensorData::new(data, [len]),
            &self.device,
        ))
    }

    /// A `[vocab, d_model]` table.
    fn vocab(&mut self, name: &str, vocab: usize, d: usize) -> Result<VocabMatrix<B>> {
        if let Some(m) = self.quantized(name, vocab, d)? {
            return Ok(VocabMatrix::Quantized(Arc::new(m)));
        }
        let data = self.f32(name, &[vocab, d])?;
        Ok(VocabMatrix::Dense(upload_matrix::<B>(
            data,
            [vocab, d],
            &self.device,
        )))
    }

    /// A projection from `cols` inputs to the outputs of `parts` (checkpoint matrices
    /// `[rows_i, cols]`, stacked along the outputs).
    fn projection(&mut self, parts: &[(&str, usize)], cols: usize) -> Result<Projection<B>> {
        let mut quantized = Vec::with_capacity(parts.len());
        for &(name, rows) in parts {
            match self.quantized(name, rows, cols)? {
                Some(m) => quantized.push(m),
                None => break,
            }
        }
        if quantized.len() == parts.len() {
            return Projection::quantized(quantized);
        }
        // Dense: the parts not already read, dequantized, plus the dequantized forms of
        // those that were (a projection is all quantized or all dense).
        let mut data: Vec<f32> = Vec::new();
        for (i, &(name, rows)) in parts.iter().enumerate() {
            match quantized.get(i) {
                Some(m) => data.extend(m.dequantize()?),
                None => data.extend(self.f32(name, &[rows, cols])?),
            }
        }
        // Dense projections are stored `[in, out]`: checkpoints hold `[out, in]`.
        let rows = data.len() / cols;
        let mut t = vec![0f32; data.len()];
        for r in 0..rows {
            for (c, &value) in data[r * cols..(r + 1) * cols].iter().enumerate() {
                t[c * rows + r] = value;
            }
        }
        Ok(Projection::from_host(
            &t,
            [cols, rows],
            self.blocks,
            &self.device,
        ))
    }
}

/// Builds a [`Transformer`] from a checkpoint, checking every tensor's shape. On a
/// backend with quantized kernels ([`LlamaBackend::keeps_quantized_weights`]),
/// projections and embeddings stored in a supported block format stay in it.
pub fn build_transformer<B: LlamaBackend>(
    config: &LlamaConfig,
    source: &mut dyn TensorSource,
    device: &B::Device,
    progress: ProgressFn<'_>,
) -> Result<Transformer<B>> {
    config.validate()?;
    let c = config;
    // The declared layer count must match the tensors present before anything is
    // allocated for it.
    if !source.contains(&layer_name(c.n_layers - 1, BLOCK_WEIGHTS[0].parts[0].hf)) {
        return Err(LlamaError::Config(format!(
            "the configuration declares {} layers, the checkpoint's tensors do not",
            c.n_layers
        )));
    }
    let tied = c.tie_embeddings || !source.contains(LM_HEAD.0);
    let mut w = WeightReader::<B> {
        source,
        progress,
        done: 0,
        total: tensor_count(c, tied), // bounded by `validate`
        device: device.clone(),
        quantized: B::keeps_quantized_weights(),
        blocks: default_blocks::<B>(),
    };
    let d = c.d_model;

    let embed = w.vocab(EMBED.0, c.vocab_size, d)?;
    let mut blocks = Vec::with_capacity(c.n_layers);
    for i in 0..c.n_layers {
        let mut weights = Vec::with_capacity(BLOCK_WEIGHTS.len());
        for spec in &BLOCK_WEIGHTS {
            let names: Vec<(String, usize)> = spec
                .parts
                .iter()
                .map(|t| (layer_name(i, t.hf), (t.rows)(c)))
                .collect();
            weights.push(match spec.kind {
                WeightKind::Norm => BlockTensor::Norm(w.vector(&names[0].0, spec.rows(c))?),
                WeightKind::Projection => {
                    let parts: Vec<(&str, usize)> =
                        names.iter().map(|(n, rows)| (n.as_str(), *rows)).collect();
                    BlockTensor::Projection(w.projection(&parts, (spec.cols)(c))?)
                }
            });
        }
        blocks.push(Block::from_weights(weights)?);
    }
    let norm = w.vector(FINAL_NORM.0, d)?;
    let lm_head = if tied {
        None
    } else {
        Some(w.vocab(LM_HEAD.0, c.vocab_size, d)?)
    };
    let mut config = config.clone();
    config.tie_embeddings = tied;
    Transformer::from_weights(config, embed, blocks, norm, lm_head, device)
}

/// [`TensorSource`] over a GGUF file: maps Hugging Face names to GGUF names, dequantizes,
/// and undoes the row permutation llama.cpp applies to query and key projections.
pub struct GgufSource<'a> {
    gguf: &'a GgufFile,
    n_heads: usize,
    n_kv_heads: usize,
}

impl<'a> GgufSource<'a> {
    /// Wraps an open GGUF file; head counts are needed to undo the Q/K permutation.
    pub fn new(gguf: &'a GgufFile, config: &LlamaConfig) -> Self {
        Self {
            gguf,
            n_heads: config.n_heads,
            n_kv_heads: config.n_kv_heads,
        }
    }

    /// The GGUF name of a Hugging Face tensor name, if it has one (from the model's
    /// weight table, [`crate::model::weights`]).
    pub fn gguf_name(name: &str) -> Option<String> {
        crate::model::weights::gguf_name(name)
    }
}

/// Which way [`permute_heads`] moves query/key rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HeadOrder {
    /// From llama.cpp's GGUF order to Hugging Face's (reading a GGUF file).
    FromGguf,
    /// From Hugging Face's order to llama.cpp's (writing a GGUF file).
    ToGguf,
}

/// Moves query/key rows between llama.cpp's order and Hugging Face's: GGUF stores each
/// head's rows as interleaved pairs (row `2i + h`) where Hugging Face stores halves (row
/// `h * d/2 + i`). Rows of `cols` values each; `heads` heads.
pub(crate) fn permute_heads<T: Copy + Default>(
    data: &[T],
    heads: usize,
    cols: usize,
    way: HeadOrder,
) -> Vec<T> {
    let rows = data.len() / cols.max(1);
    let head_dim = rows / heads.max(1);
    let half = head_dim / 2;
    let mut out = vec![T::default(); data.len()];
    for head in 0..heads {
        for i in 0..half {
            for h in 0..2 {
                let gguf = head * head_dim + 2 * i + h;
                let hf = head * head_dim + h * half + i;
                let (src, dst) = match way {
                    HeadOrder::FromGguf => (gguf, hf),
                    HeadOrder::ToGguf => (hf, gguf),
                };
                out[dst * cols..(dst + 1) * cols]
                    .copy_from_slice(&data[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

/// The head count of projection `module`'s rows that llama.cpp permutes: `q_proj` the
/// query heads (`n_heads`), `k_proj` the key/value heads (`n_kv_heads`); `None` for the
/// other projections.
pub(crate) fn permuted_head_count(
    module: &str,
    n_heads: usize,
    n_kv_heads: usize,
) -> Option<usize> {
    match module {
        "q_proj" => Some(n_heads),
        "k_proj" => Some(n_kv_heads),
        _ => None,
    }
}

impl TensorSource for GgufSource<'_> {
    fn contains(&self, name: &str) -> bool {
        Self::gguf_name(name).is_some_and(|g| self.gguf.tensor_info(&g).is_some())
    }

    fn read(&mut self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let gguf_name =
            Self::gguf_name(name).ok_or_else(|| LlamaError::MissingTensor(name.to_string()))?;
        let (shape, data) = self.gguf.read_tensor_f32(&gguf_name)?;
        match self.permuted_heads(name, &shape)? {
            Some(heads) => {
                let cols = shape[1];
                Ok((
                    shape,
                    permute_heads(&data, heads, cols, HeadOrder::FromGguf),
                ))
            }
            None => Ok((shape, data)),
        }
    }

    fn read_quantized(&mut self, name: &str) -> Result<Option<QuantMatrix>> {
        let gguf_name =
            Self::gguf_name(name).ok_or_else(|| LlamaError::MissingTensor(name.to_string()))?;
        let info = self
            .gguf
            .tensor_info(&gguf_name)
            .ok_or_else(|| LlamaError::MissingTensor(name.to_string()))?;
        let shape = info.shape();
        let (Some(format), [rows, cols]) = (QuantFormat::from_ggml(info.ty), shape.as_slice())
        else {
            return Ok(None);
        };
        let (rows, cols) = (*rows, *cols);
        if !cols.is_multiple_of(format.block_values()) {
            return Ok(None);
        }
        let mut bytes = self.gguf.read_tensor_bytes(info)?;
        if let Some(heads) = self.permuted_heads(name, &shape)? {
            // Whole rows move, so the permutation is undone on the blocks themselves.
            let row_bytes = cols / format.block_values() * format.block_bytes();
            bytes = permute_heads(&bytes, heads, row_bytes, HeadOrder::FromGguf);
        }
        QuantMatrix::new(format, rows, cols, bytes).map(Some)
    }
}

impl GgufSource<'_> {
    /// The head count whose llama.cpp row permutation `name` carries (queries and keys),
    /// after checking that its rows split into heads of even size.
    fn permuted_heads(&self, name: &str, shape: &[usize]) -> Result<Option<usize>> {
        let module = name
            .strip_suffix(".weight")
            .and_then(|n| n.rsplit('.').next());
        let Some(heads) =
            module.and_then(|m| permuted_head_count(m, self.n_heads, self.n_kv_heads))
        else {
            return Ok(None);
        };
        let rows = shape.first().copied().unwrap_or(0);
        if shape.len() != 2 || heads == 0 || rows % heads != 0 || (rows / heads) % 2 != 0 {
            return Err(LlamaError::ShapeMismatch {
                name: name.to_string(),
                expected: vec![
                    heads * (rows / heads.max(1)),
                    shape.get(1).copied().unwrap_or(1),
                ],
                actual: shape.to_vec(),
            });
        }
        Ok(Some(heads))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_inverts_llama_cpp_permutation() {
        // Two heads of dim 4, one column: HF rows [a0 a1 b0 b1 | c0 c1 d0 d1] where a/b
        // are the halves; llama.cpp interleaves to [a0 b0 a1 b1 | c0 d0 c1 d1].
        let gguf = [0., 2., 1., 3., 4., 6., 5., 7.];
        assert_eq!(
            permute_heads(&gguf, 2, 1, HeadOrder::FromGguf),
            vec![0., 1., 2., 3., 4., 5., 6., 7.]
        );
    }

    #[test]
    fn gguf_names() {
        assert_eq!(
            GgufSource::gguf_name("model.layers.12.mlp.down_proj.weight").as_deref(),
            Some("blk.12.ffn_down.weight")
        );
        assert_eq!(GgufSource::gguf_name("model.layers.1.bogus"), None);
    }
}
