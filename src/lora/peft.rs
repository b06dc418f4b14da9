//! Hugging Face PEFT LoRA adapters: `adapter_config.json` and
//! `adapter_model.safetensors`, as `PeftModel.save_pretrained` writes them.
//!
//! Tensors are named `base_model.model.model.layers.{i}.{module}.lora_A.weight`
//! (`[rank, in]`) and `...lora_B.weight` (`[out, rank]`); older saves put the adapter's
//! name before `.weight`. A module's scale is `lora_alpha / rank`, or `/ sqrt(rank)` with
//! `use_rslora`; `alpha_pattern` overrides the alpha of the modules it names.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;

use super::{LoraAdapter, LoraFactors, LoraTarget, invalid, plan};
use crate::config::LlamaConfig;
use crate::error::{LlamaError, Result};
use crate::loader::TensorSource;
use crate::loader::safetensors::SafetensorsSource;

/// A larger `adapter_config.json` is refused unread (real ones are about 1 KiB).
const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// The fields of `adapter_config.json` we read; the others are PEFT's bookkeeping.
#[derive(Debug, Deserialize)]
struct PeftConfig {
    #[serde(default)]
    peft_type: Option<String>,
    r: usize,
    lora_alpha: f32,
    #[serde(default)]
    alpha_pattern: BTreeMap<String, f32>,
    #[serde(default)]
    use_rslora: bool,
    #[serde(default)]
    use_dora: bool,
    #[serde(default)]
    fan_in_fan_out: bool,
    #[serde(default)]
    bias: Option<String>,
    #[serde(default)]
    lora_bias: bool,
    #[serde(default)]
    layer_replication: Option<serde_json::Value>,
    #[serde(default)]
    trainable_token_indices: Option<serde_json::Value>,
    #[serde(default)]
    modules_to_save: Option<Vec<String>>,
    #[serde(default)]
    target_modules: Option<serde_json::Value>,
    #[serde(default)]
    base_model_name_or_path: Option<String>,
}

impl PeftConfig {
    /// What this configuration asks for that we do not run, if anything.
    fn unsupported(&self) -> Option<String> {
        if let Some(ty) = self.peft_type.as_deref().filter(|t| *t != "LORA") {
            return Some(format!("peft_type is {ty}, not LORA"));
        }
        if self.use_dora {
            return Some("DoRA (use_dora) is not served".into());
        }
        if self.fan_in_fan_out {
            return Some("fan_in_fan_out (GPT-2 style Conv1D weights) is not a Llama's".into());
        }
        if let Some(bias) = self.bias.as_deref().filter(|b| *b != "none") {
            return Some(format!("bias = {bias}: LoRA biases are not served"));
        }
        if self.lora_bias {
            return Some("lora_bias: LoRA biases are not served".into());
        }
        if self
            .layer_replication
            .as_ref()
            .is_some_and(|v| !v.is_null())
        {
            return Some("layer_replication is not served".into());
        }
        if self
            .trainable_token_indices
            .as_ref()
            .is_some_and(|v| !v.is_null())
        {
            return Some("trainable_token_indices (trained embedding rows) is not served".into());
        }
        if let Some(modules) = self.modules_to_save.as_ref().filter(|m| !m.is_empty()) {
            return Some(format!(
                "modules_to_save {modules:?}: weights saved whole are not served"
            ));
        }
        if self.r == 0 || !self.lora_alpha.is_finite() {
            return Some(format!("r = {}, lora_alpha = {}", self.r, self.lora_alpha));
        }
        // A list names modules; a string is a regex (or `all-linear`), which the
        // tensors themselves are checked against instead.
        if let Some(serde_json::Value::Array(names)) = &self.target_modules {
            for name in names {
                let name = name.as_str().unwrap_or_default();
                if LoraTarget::from_module(name).is_none() {
                    return Some(format!(
                        "target module `{name}` is not a block projection of a Llama \
                         (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)"
                    ));
                }
            }
        }
        None
    }

    /// The alpha of module `full` (`model.layers.3.self_attn.q_proj`): the
    /// `alpha_pattern` entry whose key is the module or a dotted suffix of it (keys are
    /// taken literally, not as regular expressions), else `lora_alpha`.
    fn alpha(&self, full: &str) -> f32 {
        self.alpha_pattern
            .iter()
            .find(|(key, _)| full == key.as_str() || full.ends_with(&format!(".{key}")))
            .map_or(self.lora_alpha, |(_, &a)| a)
    }

    fn scale(&self, full: &str, rank: usize) -> f32 {
        let alpha = self.alpha(full);
        if self.use_rslora {
            alpha / (rank as f32).sqrt()
        } else {
            alpha / rank as f32
        }
    }
}

/// A tensor name's parts: `(layer, target, is_b)`.
fn parse_name(name: &str) -> Option<(usize, LoraTarget, bool)> {
    let rest = name.strip_prefix("base_model.model.")?;
    let rest = rest.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (module, is_b, tail) = if let Some((m, t)) = rest.split_once(".lora_A") {
        (m, false, t)
    } else {
        let (m, t) = rest.split_once(".lora_B")?;
        (m, true, t)
    };
    // `.weight`, or `.{adapter name}.weight` in older saves.
    if !tail.ends_with(".weight") || tail.matches('.').count() > 2 {
        return None;
    }
    Some((layer, LoraTarget::from_module(module)?, is_b))
}

pub(super) fn read(dir: &Path, config: &LlamaConfig) -> Result<LoraAdapter> {
    let source = dir.display().to_string();
    let config_path = dir.join("adapter_config.json");
    let len = std::fs::metadata(&config_path)
        .map_err(|e| LlamaError::io(&config_path, e))?
        .len();
    if len > MAX_CONFIG_BYTES {
        return Err(invalid(
            &source,
            format!("adapter_config.json is {len} bytes; at most {MAX_CONFIG_BYTES} are read"),
        ));
    }
    let text =
        std::fs::read_to_string(&config_path).map_err(|e| LlamaError::io(&config_path, e))?;
    let peft: PeftConfig = serde_json::from_str(&text)
        .map_err(|e| invalid(&source, format!("adapter_config.json: {e}")))?;
    if let Some(reason) = peft.unsupported() {
        return Err(invalid(&source, reason));
    }

    let file = dir.join("adapter_model.safetensors");
    if !file.is_file() {
        return Err(invalid(
            &source,
            "no adapter_model.safetensors (adapter_model.bin, a pickle, is not read)",
        ));
    }
    let mut tensors = SafetensorsSource::open_files(std::slice::from_ref(&file))?;

    // Every shape is checked on the header before any factor is read.
    let mut declared = Vec::new();
    for (name, shape) in tensors.shapes()? {
        let Some(what) = parse_name(&name) else {
            return Err(invalid(
                &source,
                format!(
                    "tensor `{name}` is not the A or B factor of a block projection (LoRA \
                     on embeddings or the output head, DoRA magnitudes and biases are not \
                     served)"
                ),
            ));
        };
        declared.push((name, shape, what));
    }
    let plan = plan(&source, config, declared)?;

    let mut layers = vec![Vec::new(); config.n_layers];
    for (shape, a_name, b_name) in plan {
        let full = format!(
            "model.layers.{}.{}",
            shape.layer,
            shape.target.module_path()
        );
        let (_, a) = tensors.read(&a_name)?;
        let (_, b) = tensors.read(&b_name)?;
        let factors = LoraFactors {
            rank: shape.rank,
            a,
            b,
            scale: peft.scale(&full, shape.rank),
        };
        layers[shape.layer].push((shape.target, factors));
    }
    LoraAdapter::build(source, peft.base_model_name_or_path, layers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_to_layer_target_and_factor() {
        let q = LoraTarget::from_module("q_proj");
        assert_eq!(
            parse_name("base_model.model.model.layers.12.self_attn.q_proj.lora_A.weight"),
            q.map(|q| (12, q, false))
        );
        assert_eq!(
            parse_name("base_model.model.model.layers.0.mlp.down_proj.lora_B.default.weight")
                .map(|(l, t, b)| (l, t.module(), b)),
            Some((0, "down_proj", true))
        );
        for bad in [
            "base_model.model.lm_head.lora_A.weight",
            "base_model.model.model.embed_tokens.lora_embedding_A",
            "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector",
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias",
            "model.layers.0.self_attn.q_proj.lora_A.weight",
        ] {
            assert_eq!(parse_name(bad), None, "{bad}");
        }
    }

    #[test]
    fn scales_follow_alpha_rank_rslora_and_the_alpha_pattern() {
        let mut c: PeftConfig = serde_json::from_str(
            r#"{"r": 8, "lora_alpha": 16, "alpha_pattern": {"v_proj": 4}, "bias": "none",
                "target_modules": ["q_proj", "v_proj"], "peft_type": "LORA"}"#,
        )
        .expect("config");
        assert_eq!(c.unsupported(), None);
        assert_eq!(c.scale("model.layers.0.self_attn.q_proj", 8), 2.0);
        assert_eq!(c.scale("model.layers.0.self_attn.v_proj", 8), 0.5);
        c.use_rslora = true;
        assert_eq!(c.scale("model.layers.0.self_attn.q_proj", 16), 4.0);
        c.use_dora = true;
        assert!(c.unsupported().is_some_and(|r| r.contains("DoRA")));
        let lm_head: PeftConfig =
            serde_json::from_str(r#"{"r": 8, "lora_alpha": 16, "target_modules": ["lm_head"]}"#)
                .expect("config");
        assert!(lm_head.unsupported().is_some_and(|r| r.contains("lm_head")));
    }
}
