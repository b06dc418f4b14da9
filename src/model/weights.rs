//! Every weight of the model, declared once: its name in a Hugging Face checkpoint, its
//! name in a GGUF file, and its shape as a function of the configuration.
//!
//! The loader reads checkpoints by these names, counts its progress from this table, and
//! maps Hugging Face names to GGUF names with it; [`Transformer`](super::Transformer)
//! checks shapes and builds random models from it. Adding a per-layer weight (a QKV bias,
//! say) is a row in [`BLOCK_WEIGHTS`], a field of [`Block`](super::Block) (with its place
//! in [`Block::from_weights`](super::Block::from_weights) and
//! [`Block::weights`](super::Block::weights)), and its use in the forward pass.

use crate::config::LlamaConfig;

/// How a block weight is held by the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightKind {
    /// A `[rows]` vector (an RMSNorm weight).
    Norm,
    /// A projection from `cols` inputs to the rows of its parts, held `[cols, rows]`.
    Projection,
}

/// One checkpoint tensor of a layer: a vector, or a matrix `[rows, cols]` (PyTorch order).
#[derive(Debug, Clone, Copy)]
pub struct LayerTensor {
    /// The Hugging Face name after `model.layers.{i}.`.
    pub hf: &'static str,
    /// The GGUF name after `blk.{i}.`.
    pub gguf: &'static str,
    /// Its rows (a vector's length).
    pub rows: fn(&LlamaConfig) -> usize,
}

/// One weight of a transformer block, made of one checkpoint tensor or several stacked
/// along the outputs (queries, keys and values share one projection).
#[derive(Debug, Clone, Copy)]
pub struct BlockWeight {
    /// Its name in the model (the [`Block`](super::Block) field), as shape errors give it.
    pub name: &'static str,
    /// How the model holds it.
    pub kind: WeightKind,
    /// Inputs of a projection (unused for a norm).
    pub cols: fn(&LlamaConfig) -> usize,
    /// The checkpoint tensors it is made of, in output order.
    pub parts: &'static [LayerTensor],
}

impl BlockWeight {
    /// Rows of all its parts together.
    pub fn rows(&self, config: &LlamaConfig) -> usize {
        self.parts.iter().map(|p| (p.rows)(config)).sum()
    }

    /// Its shape in the model: `[rows]` for a norm, `[cols, rows]` for a projection.
    pub fn shape(&self, config: &LlamaConfig) -> Vec<usize> {
        match self.kind {
            WeightKind::Norm => vec![self.rows(config)],
            WeightKind::Projection => vec![(self.cols)(config), self.rows(config)],
        }
    }
}

fn d_model(c: &LlamaConfig) -> usize {
    c.d_model
}

fn q_rows(c: &LlamaConfig) -> usize {
    c.n_heads * c.head_dim
}

fn kv_rows(c: &LlamaConfig) -> usize {
    c.n_kv_heads * c.head_dim
}

fn ffn_hidden(c: &LlamaConfig) -> usize {
    c.ffn_hidden
}

/// A norm weight of `d_model` values.
const fn norm(name: &'static str, parts: &'static [LayerTensor]) -> BlockWeight {
    BlockWeight {
        name,
        kind: WeightKind::Norm,
        cols: d_model,
        parts,
    }
}

/// A projection from `cols` inputs.
const fn projection(
    name: &'static str,
    cols: fn(&LlamaConfig) -> usize,
    parts: &'static [LayerTensor],
) -> BlockWeight {
    BlockWeight {
        name,
        kind: WeightKind::Projection,
        cols,
        parts,
    }
}

/// A checkpoint tensor of a layer.
const fn tensor(
    hf: &'static str,
    gguf: &'static str,
    rows: fn(&LlamaConfig) -> usize,
) -> LayerTensor {
    LayerTensor { hf, gguf, rows }
}

/// The weights of one transformer block, in the order the loader reads them and
/// [`Block::weights`](super::Block::weights) lists them.
pub const BLOCK_WEIGHTS: [BlockWeight; 7] = [
    norm(
        "attn_norm",
        &[tensor(
            "input_layernorm.weight",
            "attn_norm.weight",
            d_model,
        )],
    ),
    projection(
        "wqkv",
        d_model,
        &[
            tensor("self_attn.q_proj.weight", "attn_q.weight", q_rows),
            tensor("self_attn.k_proj.weight", "attn_k.weight", kv_rows),
            tensor("self_attn.v_proj.weight", "attn_v.weight", kv_rows),
        ],
    ),
    projection(
        "wo",
        q_rows,
        &[tensor(
            "self_attn.o_proj.weight",
            "attn_output.weight",
            d_model,
        )],
    ),
    norm(
        "ffn_norm",
        &[tensor(
            "post_attention_layernorm.weight",
            "ffn_norm.weight",
            d_model,
        )],
    ),
    projection(
        "w_gate",
        d_model,
        &[tensor(
            "mlp.gate_proj.weight",
            "ffn_gate.weight",
            ffn_hidden,
        )],
    ),
    projection(
        "w_up",
        d_model,
        &[tensor("mlp.up_proj.weight", "ffn_up.weight", ffn_hidden)],
    ),
    projection(
        "w_down",
        ffn_hidden,
        &[tensor("mlp.down_proj.weight", "ffn_down.weight", d_model)],
    ),
];

/// The token embeddings, `[vocab, d_model]`: (Hugging Face name, GGUF name).
pub const EMBED: (&str, &str) = ("model.embed_tokens.weight", "token_embd.weight");
/// The final norm, `[d_model]`.
pub const FINAL_NORM: (&str, &str) = ("model.norm.weight", "output_norm.weight");
/// The output head, `[vocab, d_model]` (absent when tied to the embeddings).
pub const LM_HEAD: (&str, &str) = ("lm_head.weight", "output.weight");

/// The Hugging Face name of layer `layer`'s tensor `suffix`.
pub fn layer_name(layer: usize, suffix: &str) -> String {
    format!("model.layers.{layer}.{suffix}")
}

/// The GGUF name of a Hugging Face tensor name, if the model has such a tensor.
pub fn gguf_name(hf_name: &str) -> Option<String> {
    if let Some((_, gguf)) = [EMBED, FINAL_NORM, LM_HEAD]
        .iter()
        .find(|(hf, _)| *hf == hf_name)
    {
        return Some((*gguf).to_string());
    }
    let rest = hf_name.strip_prefix("model.layers.")?;
    let (layer, suffix) = rest.split_once('.')?;
    let tensor = BLOCK_WEIGHTS
        .iter()
        .flat_map(|w| w.parts)
        .find(|t| t.hf == suffix)?;
    Some(format!("blk.{layer}.{}", tensor.gguf))
}

/// How many checkpoint tensors a model of `config` reads (the loader's progress total):
/// the embeddings, the final norm, the head unless `tied`, and every layer's tensors.
pub fn tensor_count(config: &LlamaConfig, tied: bool) -> usize {
    let per_layer: usize = BLOCK_WEIGHTS.iter().map(|w| w.parts.len()).sum();
    2 + usize::from(!tied) + per_layer * config.n_layers
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{DefaultBackend, default_device};
    use crate::model::{BlockTensorRef, Transformer};

    #[test]
    fn blocks_hold_the_weights_the_table_declares() {
        let config = LlamaConfig {
            vocab_size: 16,
            d_model: 8,
            n_layers: 2,
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 4,
            ffn_hidden: 12,
            ..LlamaConfig::smollm2_135m()
        }
        .with_max_seq_len(8);
        let model =
            Transformer::<DefaultBackend>::random(config.clone(), 1, &default_device()).unwrap();
        for block in &model.blocks {
            for (spec, weight) in BLOCK_WEIGHTS.iter().zip(block.weights()) {
                assert_eq!(weight.dims(), spec.shape(&config), "{}", spec.name);
                let is_norm = matches!(weight, BlockTensorRef::Norm(_));
                assert_eq!(is_norm, spec.kind == WeightKind::Norm, "{}", spec.name);
            }
        }
        assert_eq!(tensor_count(&config, true), 2 + 9 * 2);
        assert_eq!(tensor_count(&config, false), 3 + 9 * 2);
        assert_eq!(
            gguf_name("model.embed_tokens.weight").as_deref(),
            Some("token_embd.weight")
        );
        assert_eq!(
            gguf_name("model.layers.3.self_attn.k_proj.weight").as_deref(),
            Some("blk.3.attn_k.weight")
        );
        assert_eq!(gguf_name("model.layers.3.bogus.weight"), None);
    }
}
