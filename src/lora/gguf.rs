//! llama.cpp's GGUF LoRA adapters (`convert_lora_to_gguf.py`, `llama-finetune`).
//!
//! Metadata `general.type = adapter`, `adapter.type = lora`, `general.architecture` the
//! base model's, and `adapter.lora.alpha` (optional). Tensors are named after the base
//! model's, `blk.{i}.attn_q.weight.lora_a` (`ne = [in, rank]`, so `[rank, in]` row-major)
//! and `.lora_b` (`[out, rank]`), in any type the loader dequantizes. Like the base
//! model's query and key weights, the `B` factors of queries and keys carry llama.cpp's
//! row permutation, undone here. The scale is `alpha / rank`, or 1 with no alpha, as
//! llama.cpp reads it.

use std::path::Path;

use super::{LoraAdapter, LoraFactors, LoraTarget, invalid, plan};
use crate::config::LlamaConfig;
use crate::error::Result;
use crate::loader::gguf::GgufFile;
use crate::loader::{HeadOrder, permute_heads, permuted_head_count};

/// `(layer, target, is_b)` of a tensor name.
fn parse_name(name: &str) -> Option<(usize, LoraTarget, bool)> {
    let rest = name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (base, is_b) = match rest.strip_suffix(".lora_a") {
        Some(base) => (base, false),
        None => (rest.strip_suffix(".lora_b")?, true),
    };
    Some((layer, LoraTarget::from_gguf(base)?, is_b))
}

pub(super) fn read(path: &Path, config: &LlamaConfig) -> Result<LoraAdapter> {
    let source = path.display().to_string();
    let file = GgufFile::open(path)?;
    let text = |key: &str| file.get(key).and_then(|v| v.as_str()).map(str::to_owned);
    if text("general.type").as_deref() != Some("adapter")
        || text("adapter.type").as_deref() != Some("lora")
    {
        return Err(invalid(
            &source,
            "not a GGUF LoRA adapter (general.type must be `adapter`, adapter.type `lora`)",
        ));
    }
    let arch = text("general.architecture").unwrap_or_default();
    if arch != "llama" {
        return Err(invalid(
            &source,
            format!("an adapter for the `{arch}` architecture, not `llama`"),
        ));
    }
    let alpha = file.get_opt_f32("adapter.lora.alpha")?.unwrap_or(0.0);
    if !alpha.is_finite() {
        return Err(invalid(&source, format!("adapter.lora.alpha is {alpha}")));
    }

    // Every shape is checked on the header before any factor is read.
    let mut declared = Vec::new();
    for info in file.tensors() {
        let Some(what) = parse_name(&info.name) else {
            return Err(invalid(
                &source,
                format!(
                    "tensor `{}` is not the lora_a or lora_b factor of a block projection",
                    info.name
                ),
            ));
        };
        declared.push((info.name.clone(), info.shape(), what));
    }
    let plan = plan(&source, config, declared)?;

    let mut layers = vec![Vec::new(); config.n_layers];
    for (shape, a_name, b_name) in plan {
        let (_, a) = file.read_tensor_f32(&a_name)?;
        let (_, mut b) = file.read_tensor_f32(&b_name)?;
        let module = shape.target.module();
        if let Some(heads) = permuted_head_count(module, config.n_heads, config.n_kv_heads) {
            b = permute_heads(&b, heads, shape.rank, HeadOrder::FromGguf);
        }
        let scale = if alpha == 0.0 {
            1.0
        } else {
            alpha / shape.rank as f32
        };
        layers[shape.layer].push((
            shape.target,
            LoraFactors {
                rank: shape.rank,
                a,
                b,
                scale,
            },
        ));
    }
    LoraAdapter::build(source, text("general.basename"), layers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_to_layer_target_and_factor() {
        assert_eq!(
            parse_name("blk.7.attn_q.weight.lora_a").map(|(l, t, b)| (l, t.module(), b)),
            Some((7, "q_proj", false))
        );
        assert_eq!(
            parse_name("blk.0.ffn_down.weight.lora_b").map(|(l, t, b)| (l, t.module(), b)),
            Some((0, "down_proj", true))
        );
        for bad in [
            "token_embd.weight.lora_a",
            "blk.0.attn_norm.weight.lora_a",
            "blk.x.attn_q.weight.lora_a",
            "blk.0.attn_q.weight",
        ] {
            assert_eq!(parse_name(bad), None, "{bad}");
        }
    }
}
