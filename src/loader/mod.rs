//! Reading checkpoints: GGUF files and Hugging Face safetensors directories.
//!
//! Both formats are read through [`TensorSource`], which hands out tensors by their
//! Hugging Face names as row-major f32 data; [`build_transformer`] assembles the model
//! from any source, so the two formats cannot drift apart.

pub mod dequant;
pub mod gguf;
pub mod safetensors;

use std::io::IsTerminal;

use burn::tensor::{Tensor, TensorData, backend::Backend};

use crate::config::LlamaConfig;
use crate::error::{LlamaError, Result};
use crate::model::linear::default_blocks;
use crate::model::{Block, Projection, Transformer};
use gguf::GgufFile;

/// A checkpoint that hands out tensors by Hugging Face name (`model.layers.0.self_attn.q_proj.weight`, ...).
pub trait TensorSource {
    /// Whether the checkpoint holds this tensor.
    fn contains(&self, name: &str) -> bool;
    /// Reads a tensor as row-major f32 with its shape (PyTorch order).
    fn read(&mut self, name: &str) -> Result<(Vec<usize>, Vec<f32>)>;
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

fn layer_name(i: usize, suffix: &str) -> String {
    format!("model.layers.{i}.{suffix}")
}

/// Builds a [`Transformer`] from a checkpoint, checking every tensor's shape.
pub fn build_transformer<B: Backend>(
    config: &LlamaConfig,
    source: &mut dyn TensorSource,
    device: &B::Device,
    progress: ProgressFn<'_>,
) -> Result<Transformer<B>> {
    config.validate()?;
    let c = config;
    let tied = c.tie_embeddings || !source.contains("lm_head.weight");
    let total = 2 + usize::from(!tied) + 9 * c.n_layers;
    let mut done = 0usize;
    let mut step = |progress: &mut dyn FnMut(usize, usize)| {
        done += 1;
        progress(done, total);
    };
    let mut read = |name: &str, expected: Vec<usize>| -> Result<Vec<f32>> {
        if !source.contains(name) {
            return Err(LlamaError::MissingTensor(name.to_string()));
        }
        let (shape, data) = source.read(name)?;
        if shape != expected {
            return Err(LlamaError::ShapeMismatch {
                name: name.to_string(),
                expected,
                actual: shape,
            });
        }
        Ok(data)
    };
    let tensor2 = |data: Vec<f32>, rows: usize, cols: usize| {
        Tensor::<B, 2>::from_data(TensorData::new(data, [rows, cols]), device)
    };
    // Projections are stored `[in, out]`: checkpoints hold `[out, in]`, so transpose once.
    let blocks = default_blocks::<B>();
    let projection = |data: Vec<f32>, rows: usize, cols: usize| {
        let mut t = vec![0f32; data.len()];
        for r in 0..rows {
            for (c, &value) in data[r * cols..(r + 1) * cols].iter().enumerate() {
                t[c * rows + r] = value;
            }
        }
        Projection::from_host(&t, [cols, rows], blocks, device)
    };
    let tensor1 = |data: Vec<f32>| {
        let n = data.len();
        Tensor::<B, 1>::from_data(TensorData::new(data, [n]), device)
    };

    let (d, hd) = (c.d_model, c.head_dim);
    let embed = tensor2(
        read("model.embed_tokens.weight", vec![c.vocab_size, d])?,
        c.vocab_size,
        d,
    );
    step(progress);
    let mut blocks = Vec::with_capacity(c.n_layers);
    for i in 0..c.n_layers {
        let attn_norm = tensor1(read(&layer_name(i, "input_layernorm.weight"), vec![d])?);
        step(progress);
        let mut qk = read(
            &layer_name(i, "self_attn.q_proj.weight"),
            vec![c.n_heads * hd, d],
        )?;
        step(progress);
        qk.extend(read(
            &layer_name(i, "self_attn.k_proj.weight"),
            vec![c.n_kv_heads * hd, d],
        )?);
        step(progress);
        let wqk = projection(qk, (c.n_heads + c.n_kv_heads) * hd, d);
        let wv = projection(
            read(
                &layer_name(i, "self_attn.v_proj.weight"),
                vec![c.n_kv_heads * hd, d],
            )?,
            c.n_kv_heads * hd,
            d,
        );
        step(progress);
        let wo = projection(
            read(
                &layer_name(i, "self_attn.o_proj.weight"),
                vec![d, c.n_heads * hd],
            )?,
            d,
            c.n_heads * hd,
        );
        step(progress);
        let ffn_norm = tensor1(read(
            &layer_name(i, "post_attention_layernorm.weight"),
            vec![d],
        )?);
        step(progress);
        let w_gate = projection(
            read(
                &layer_name(i, "mlp.gate_proj.weight"),
                vec![c.ffn_hidden, d],
            )?,
            c.ffn_hidden,
            d,
        );
        step(progress);
        let w_up = projection(
            read(&layer_name(i, "mlp.up_proj.weight"), vec![c.ffn_hidden, d])?,
            c.ffn_hidden,
            d,
        );
        step(progress);
        let w_down = projection(
            read(
                &layer_name(i, "mlp.down_proj.weight"),
                vec![d, c.ffn_hidden],
            )?,
            d,
            c.ffn_hidden,
        );
        step(progress);
        blocks.push(Block {
            attn_norm,
            wqk,
            wv,
            wo,
            ffn_norm,
            w_gate,
            w_up,
            w_down,
        });
    }
    let norm = tensor1(read("model.norm.weight", vec![d])?);
    step(progress);
    let lm_head = if tied {
        None
    } else {
        let head = tensor2(
            read("lm_head.weight", vec![c.vocab_size, d])?,
            c.vocab_size,
            d,
        );
        step(progress);
        Some(head)
    };
    let mut config = config.clone();
    config.tie_embeddings = tied;
    Transformer::new(config, embed, blocks, norm, lm_head, device)
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

    /// The GGUF name of a Hugging Face tensor name, if it has one.
    pub fn gguf_name(name: &str) -> Option<String> {
        match name {
            "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
            "model.norm.weight" => return Some("output_norm.weight".into()),
            "lm_head.weight" => return Some("output.weight".into()),
            _ => {}
        }
        let rest = name.strip_prefix("model.layers.")?;
        let (layer, suffix) = rest.split_once('.')?;
        let mapped = match suffix {
            "input_layernorm.weight" => "attn_norm.weight",
            "self_attn.q_proj.weight" => "attn_q.weight",
            "self_attn.k_proj.weight" => "attn_k.weight",
            "self_attn.v_proj.weight" => "attn_v.weight",
            "self_attn.o_proj.weight" => "attn_output.weight",
            "post_attention_layernorm.weight" => "ffn_norm.weight",
            "mlp.gate_proj.weight" => "ffn_gate.weight",
            "mlp.up_proj.weight" => "ffn_up.weight",
            "mlp.down_proj.weight" => "ffn_down.weight",
            _ => return None,
        };
        Some(format!("blk.{layer}.{mapped}"))
    }
}

/// Undoes llama.cpp's query/key row permutation: GGUF stores each head's rows as
/// interleaved pairs (row `2i + h`) where Hugging Face stores halves (row `h * d/2 + i`).
fn unpermute_heads(data: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    let rows = data.len() / cols.max(1);
    let head_dim = rows / heads.max(1);
    let half = head_dim / 2;
    let mut out = vec![0.0; data.len()];
    for head in 0..heads {
        for i in 0..half {
            for h in 0..2 {
                let src = head * head_dim + 2 * i + h;
                let dst = head * head_dim + h * half + i;
                out[dst * cols..(dst + 1) * cols]
                    .copy_from_slice(&data[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

impl TensorSource for GgufSource<'_> {
    fn contains(&self, name: &str) -> bool {
        Self::gguf_name(name).is_some_and(|g| self.gguf.tensor_info(&g).is_some())
    }

    fn read(&mut self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let gguf_name =
            Self::gguf_name(name).ok_or_else(|| LlamaError::MissingTensor(name.to_string()))?;
        let (shape, data) = self.gguf.read_tensor_f32(&gguf_name)?;
        let heads = if name.ends_with("q_proj.weight") {
            self.n_heads
        } else if name.ends_with("k_proj.weight") {
            self.n_kv_heads
        } else {
            return Ok((shape, data));
        };
        let cols = shape.get(1).copied().unwrap_or(1);
        let rows = shape.first().copied().unwrap_or(0);
        if shape.len() != 2 || heads == 0 || rows % heads != 0 || (rows / heads) % 2 != 0 {
            return Err(LlamaError::ShapeMismatch {
                name: name.to_string(),
                expected: vec![heads * (rows / heads.max(1)), cols],
                actual: shape,
            });
        }
        Ok((shape, unpermute_heads(&data, heads, cols)))
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
            unpermute_heads(&gguf, 2, 1),
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
