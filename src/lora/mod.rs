//! LoRA adapters: many fine-tunes of one base model, served at once.
//!
//! A LoRA adapter changes a projection `W` (`[out, in]`, PyTorch order) into
//! `W + scale * B A`, with `A` `[rank, in]` and `B` `[out, rank]`. The base weights stay
//! as they are (in their quantized blocks): each row of a batch that uses an adapter
//! gets `scale * B (A x)` added beside the shared base product, gathered per row as
//! S-LoRA and Punica do, so rows of different adapters (and rows with none) run in one
//! step, and a row's result does not depend on its neighbours' adapters.
//!
//! - [`LoraAdapter`] is an adapter on the host, read from a Hugging Face PEFT directory
//!   ([`LoraAdapter::from_peft_dir`]) or a llama.cpp GGUF LoRA file
//!   ([`LoraAdapter::from_gguf`]), checked against the model's shapes before anything is
//!   allocated for its factors.
//! - [`LoraWeights`] is an adapter on the model's device, in the form the forward pass
//!   uses; the continuous engine keeps them in an [`AdapterRegistry`] and a request
//!   names one with [`GenerateRequest::with_adapter`](crate::inference::GenerateRequest::with_adapter).
//! - [`merge`] folds an adapter into a GGUF checkpoint, for users who serve one
//!   fine-tune only.
//!
//! The projections an adapter may change are the rows of the model's weight table
//! ([`crate::model::weights::BLOCK_WEIGHTS`]): an adapter target is one of its
//! checkpoint tensors, so a projection added there is a target here.

mod device;
mod gguf;
pub mod merge;
mod peft;
mod registry;

use std::path::Path;

use crate::config::LlamaConfig;
use crate::error::{LlamaError, Result};
use crate::model::weights::{BLOCK_WEIGHTS, WeightKind};

pub(crate) use device::LoraStep;
pub use device::LoraWeights;
pub use registry::{AdapterInfo, AdapterRegistry, MAX_NAME_BYTES};

/// The largest rank an adapter may have (vLLM's largest supported rank is 512).
pub const MAX_RANK: usize = 512;

/// One checkpoint tensor of a block that an adapter may change: a part of one of the
/// weight table's projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LoraTarget {
    /// Index of the projection in [`BLOCK_WEIGHTS`].
    weight: usize,
    /// Index of the checkpoint tensor among the projection's parts.
    part: usize,
}

impl LoraTarget {
    /// Every tensor an adapter may change, in the weight table's order (for a Llama: the
    /// query, key, value, output, gate, up and down projections).
    pub fn all() -> impl Iterator<Item = LoraTarget> {
        BLOCK_WEIGHTS
            .iter()
            .enumerate()
            .filter(|(_, w)| w.kind == WeightKind::Projection)
            .flat_map(|(weight, w)| (0..w.parts.len()).map(move |part| LoraTarget { weight, part }))
    }

    /// The Hugging Face module path after `model.layers.{i}.` (`self_attn.q_proj`).
    pub fn module_path(self) -> &'static str {
        let hf = BLOCK_WEIGHTS[self.weight].parts[self.part].hf;
        hf.strip_suffix(".weight").unwrap_or(hf)
    }

    /// The module's own name, as PEFT's `target_modules` lists it (`q_proj`).
    pub fn module(self) -> &'static str {
        let path = self.module_path();
        path.rsplit('.').next().unwrap_or(path)
    }

    /// The GGUF tensor name after `blk.{i}.` (`attn_q.weight`).
    pub fn gguf(self) -> &'static str {
        BLOCK_WEIGHTS[self.weight].parts[self.part].gguf
    }

    /// The target whose module name or path is `name` (`q_proj` or `self_attn.q_proj`).
    pub fn from_module(name: &str) -> Option<Self> {
        Self::all().find(|t| t.module() == name || t.module_path() == name)
    }

    /// The target whose GGUF name is `name` (`attn_q.weight`).
    pub fn from_gguf(name: &str) -> Option<Self> {
        Self::all().find(|t| t.gguf() == name)
    }

    /// `(in, out)`: the tensor's inputs and outputs in a model of `config`.
    pub fn dims(self, config: &LlamaConfig) -> (usize, usize) {
        let w = &BLOCK_WEIGHTS[self.weight];
        ((w.cols)(config), (w.parts[self.part].rows)(config))
    }

    /// The index in [`BLOCK_WEIGHTS`] of the projection this tensor is part of.
    pub(crate) fn weight(self) -> usize {
        self.weight
    }

    /// Where this tensor's outputs start among its projection's output columns.
    pub(crate) fn column_offset(self, config: &LlamaConfig) -> usize {
        BLOCK_WEIGHTS[self.weight].parts[..self.part]
            .iter()
            .map(|p| (p.rows)(config))
            .sum()
    }
}

/// One tensor's change, `scale * B A`, on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraFactors {
    /// The rank.
    pub rank: usize,
    /// `A`, `[rank, in]`, row-major.
    pub a: Vec<f32>,
    /// `B`, `[out, rank]`, row-major.
    pub b: Vec<f32>,
    /// The scale (`alpha / rank`, or `alpha / sqrt(rank)` with rsLoRA).
    pub scale: f32,
}

impl LoraFactors {
    /// `scale * B A`, `[out, in]` row-major: what merging adds to the weight.
    pub fn delta(&self, n_in: usize, n_out: usize) -> Vec<f32> {
        let mut out = vec![0f32; n_in * n_out];
        for (o, row) in out.chunks_exact_mut(n_in.max(1)).enumerate().take(n_out) {
            for k in 0..self.rank {
                let bk = self.b[o * self.rank + k] * self.scale;
                for (w, a) in row.iter_mut().zip(&self.a[k * n_in..(k + 1) * n_in]) {
                    *w += bk * a;
                }
            }
        }
        out
    }
}

/// A LoRA adapter on the host: per layer, the factors of each tensor it changes, checked
/// against a model's shapes.
#[derive(Debug, Clone)]
pub struct LoraAdapter {
    /// Per layer, the changed tensors in target order.
    layers: Vec<Vec<(LoraTarget, LoraFactors)>>,
    /// The model this adapter was trained on, as its files name it.
    base_model: Option<String>,
    /// Where it was read from.
    source: String,
    fingerprint: u128,
}

impl LoraAdapter {
    /// Reads the adapter at `path`: a PEFT directory (with `adapter_config.json`) or a
    /// GGUF LoRA file, for a model of `config`.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidAdapter`] if it does not fit the model, and what reading the
    /// files reports.
    pub fn open(path: impl AsRef<Path>, config: &LlamaConfig) -> Result<Self> {
        let path = path.as_ref();
        if path.is_dir() {
            Self::from_peft_dir(path, config)
        } else {
            Self::from_gguf(path, config)
        }
    }

    /// Reads a Hugging Face PEFT adapter directory: `adapter_config.json` (`r`,
    /// `lora_alpha`, `alpha_pattern`, `use_rslora`, `target_modules`) and
    /// `adapter_model.safetensors` (f32, f16 or bf16 factors).
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidAdapter`] for an adapter that does not fit `config` (checked
    /// on the files' headers, before any factor is read) or uses what we do not run
    /// (DoRA, LoRA biases, `fan_in_fan_out`, modules saved whole, a target other than a
    /// block projection).
    pub fn from_peft_dir(dir: impl AsRef<Path>, config: &LlamaConfig) -> Result<Self> {
        peft::read(dir.as_ref(), config)
    }

    /// Reads a llama.cpp GGUF LoRA file (`general.type = adapter`, `adapter.type = lora`,
    /// tensors `blk.{i}.{name}.weight.lora_a` `[rank, in]` and `.lora_b` `[out, rank]`,
    /// scale `adapter.lora.alpha / rank`, or 1 without an alpha, as llama.cpp reads it).
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidAdapter`] for a file that is not a LoRA adapter of a Llama
    /// architecture or does not fit `config`, and what reading it reports.
    pub fn from_gguf(path: impl AsRef<Path>, config: &LlamaConfig) -> Result<Self> {
        gguf::read(path.as_ref(), config)
    }

    /// An adapter from factors: `(layer, target, factors)`, checked against `config`.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidAdapter`] for a layer, shape or rank that does not fit, or a
    /// tensor given twice.
    pub fn from_factors(
        name: impl Into<String>,
        config: &LlamaConfig,
        factors: impl IntoIterator<Item = (usize, LoraTarget, LoraFactors)>,
    ) -> Result<Self> {
        let source = name.into();
        let factors: Vec<(usize, LoraTarget, LoraFactors)> = factors.into_iter().collect();
        // The checks a file's header passes, on the factors' shapes.
        let mut declared: Vec<Declared> = Vec::with_capacity(2 * factors.len());
        for (i, (layer, target, f)) in factors.iter().enumerate() {
            let rank = f.rank.max(1);
            if !f.a.len().is_multiple_of(rank) || !f.b.len().is_multiple_of(rank) {
                return Err(invalid(&source, "factors not whole rows of their rank"));
            }
            let (a, b) = (
                vec![f.rank, f.a.len() / rank],
                vec![f.b.len() / rank, f.rank],
            );
            declared.push((format!("a{i}"), a, (*layer, *target, false)));
            declared.push((format!("b{i}"), b, (*layer, *target, true)));
        }
        plan(&source, config, declared)?;
        let mut layers = vec![Vec::new(); config.n_layers];
        for (layer, target, f) in factors {
            layers[layer].push((target, f));
        }
        Self::build(source, None, layers)
    }

    fn build(
        source: String,
        base_model: Option<String>,
        mut layers: Vec<Vec<(LoraTarget, LoraFactors)>>,
    ) -> Result<Self> {
        if layers.iter().all(Vec::is_empty) {
            return Err(invalid(&source, "it changes no tensor"));
        }
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        for (layer, entries) in layers.iter_mut().enumerate() {
            entries.sort_by_key(|(t, _)| *t);
            for (target, f) in entries.iter() {
                h.update(&(layer as u64).to_le_bytes());
                h.update(target.module_path().as_bytes());
                h.update(&f.scale.to_le_bytes());
                for v in f.a.iter().chain(&f.b) {
                    h.update(&v.to_le_bytes());
                }
            }
        }
        Ok(Self {
            layers,
            base_model,
            source,
            fingerprint: h.digest128(),
        })
    }

    /// A 128-bit hash of the adapter's factors and scales: two adapters with the same
    /// values have the same fingerprint, whatever their files. Cached prefixes are
    /// shared only by requests of one fingerprint.
    pub fn fingerprint(&self) -> u128 {
        self.fingerprint
    }

    /// Where it was read from (or the name it was made under).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The model it was trained on, as its files say (`base_model_name_or_path`,
    /// `general.basename`), if they do.
    pub fn base_model(&self) -> Option<&str> {
        self.base_model.as_deref()
    }

    /// The largest rank of its tensors.
    pub fn rank(&self) -> usize {
        self.tensors().map(|(_, _, f)| f.rank).max().unwrap_or(0)
    }

    /// The module names it changes (`q_proj`, `v_proj`, ...), in target order.
    pub fn modules(&self) -> Vec<&'static str> {
        let mut seen: Vec<LoraTarget> = self.tensors().map(|(_, t, _)| t).collect();
        seen.sort();
        seen.dedup();
        seen.into_iter().map(LoraTarget::module).collect()
    }

    /// Every changed tensor: `(layer, target, factors)`.
    pub fn tensors(&self) -> impl Iterator<Item = (usize, LoraTarget, &LoraFactors)> {
        self.layers
            .iter()
            .enumerate()
            .flat_map(|(layer, e)| e.iter().map(move |(t, f)| (layer, *t, f)))
    }

    /// The factors of `target` in `layer`, if the adapter changes it.
    pub fn factors(&self, layer: usize, target: LoraTarget) -> Option<&LoraFactors> {
        self.layers
            .get(layer)?
            .iter()
            .find(|(t, _)| *t == target)
            .map(|(_, f)| f)
    }

    /// Layers of the model it was checked against.
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// Bytes of its factors in f32.
    pub fn bytes(&self) -> usize {
        self.tensors()
            .map(|(_, _, f)| (f.a.len() + f.b.len()) * 4)
            .sum()
    }
}

/// The shapes of one tensor's factors as a file declares them, checked before they are
/// read.
#[derive(Debug, Clone, Copy)]
struct Shape {
    layer: usize,
    target: LoraTarget,
    rank: usize,
    /// `A`'s `[rank, in]`.
    a: [usize; 2],
    /// `B`'s `[out, rank]`.
    b: [usize; 2],
}

impl Shape {
    fn check(&self, adapter: &str, config: &LlamaConfig) -> Result<()> {
        let module = self.target.module();
        if self.layer >= config.n_layers {
            return Err(invalid(
                adapter,
                format!(
                    "layer {} of {module}, but the model has {} layers",
                    self.layer, config.n_layers
                ),
            ));
        }
        if self.rank == 0 || self.rank > MAX_RANK {
            return Err(invalid(
                adapter,
                format!(
                    "layer {} {module} has rank {}; ranks 1 to {MAX_RANK} are served",
                    self.layer, self.rank
                ),
            ));
        }
        let (n_in, n_out) = self.target.dims(config);
        if self.a != [self.rank, n_in] || self.b != [n_out, self.rank] {
            return Err(invalid(
                adapter,
                format!(
                    "layer {} {module}: A is {:?} and B {:?}, but this model needs [{}, \
                     {n_in}] and [{n_out}, {}] (an adapter of another base model?)",
                    self.layer, self.a, self.b, self.rank, self.rank
                ),
            ));
        }
        Ok(())
    }
}

/// A tensor a file declares: its name, its shape, and what it is (layer, target, and
/// whether it is the `B` factor).
type Declared = (String, Vec<usize>, (usize, LoraTarget, bool));

/// The factor pairs a file declares, each checked against `config` on the header alone
/// (both factors present, matrices of one rank that fit the projection): per tensor its
/// shape and the names of its `A` and `B`, in layer and target order.
fn plan(
    adapter: &str,
    config: &LlamaConfig,
    declared: impl IntoIterator<Item = Declared>,
) -> Result<Vec<(Shape, String, String)>> {
    let mut pairs = std::collections::BTreeMap::<(usize, LoraTarget), [Option<_>; 2]>::new();
    for (name, shape, (layer, target, is_b)) in declared {
        let slot = &mut pairs.entry((layer, target)).or_default()[usize::from(is_b)];
        if slot.is_some() {
            let factor = if is_b { "B" } else { "A" };
            return Err(invalid(
                adapter,
                format!(
                    "layer {layer} {} has factor {factor} twice",
                    target.module()
                ),
            ));
        }
        *slot = Some((name, shape));
    }
    let mut plan = Vec::with_capacity(pairs.len());
    for ((layer, target), [a, b]) in pairs {
        let module = target.module();
        let (Some((a_name, a_shape)), Some((b_name, b_shape))) = (a, b) else {
            return Err(invalid(
                adapter,
                format!("layer {layer} {module} has one factor of two"),
            ));
        };
        let (&[ar, ai], &[bo, br]) = (a_shape.as_slice(), b_shape.as_slice()) else {
            return Err(invalid(
                adapter,
                format!("layer {layer} {module}: factors are not matrices"),
            ));
        };
        if ar != br {
            return Err(invalid(
                adapter,
                format!("layer {layer} {module}: A has rank {ar}, B rank {br}"),
            ));
        }
        let shape = Shape {
            layer,
            target,
            rank: ar,
            a: [ar, ai],
            b: [bo, br],
        };
        shape.check(adapter, config)?;
        plan.push((shape, a_name, b_name));
    }
    Ok(plan)
}

fn invalid(adapter: &str, reason: impl Into<String>) -> LlamaError {
    LlamaError::InvalidAdapter {
        adapter: adapter.to_string(),
        reason: reason.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_the_weight_tables_projection_tensors() {
        let modules: Vec<_> = LoraTarget::all().map(LoraTarget::module).collect();
        assert_eq!(
            modules,
            [
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj"
            ]
        );
        let k = LoraTarget::from_module("self_attn.k_proj").expect("k");
        assert_eq!(k, LoraTarget::from_module("k_proj").expect("k"));
        assert_eq!(k.gguf(), "attn_k.weight");
        assert_eq!(
            LoraTarget::from_gguf("ffn_down.weight").map(LoraTarget::module),
            Some("down_proj")
        );
        assert_eq!(LoraTarget::from_module("lm_head"), None);
        let c = LlamaConfig::smollm2_135m();
        assert_eq!(k.dims(&c), (c.d_model, c.n_kv_heads * c.head_dim));
        // Keys follow queries in the fused projection.
        assert_eq!(k.column_offset(&c), c.n_heads * c.head_dim);
    }

    #[test]
    fn factors_that_do_not_fit_the_model_are_refused_by_name() {
        let c = LlamaConfig::smollm2_135m();
        let q = LoraTarget::from_module("q_proj").expect("q");
        let (n_in, n_out) = q.dims(&c);
        let good = LoraFactors {
            rank: 2,
            a: vec![0.5; 2 * n_in],
            b: vec![0.25; 2 * n_out],
            scale: 2.0,
        };
        let adapter = LoraAdapter::from_factors("t", &c, [(3, q, good.clone())]).expect("fits");
        assert_eq!(adapter.rank(), 2);
        assert_eq!(adapter.modules(), ["q_proj"]);
        // delta = scale * B A: every entry 2 * (0.5 * 0.25 * 2 ranks).
        let delta = good.delta(n_in, n_out);
        assert!(delta.iter().all(|&d| d == 0.5));

        let refused =
            |layer, f: LoraFactors| match LoraAdapter::from_factors("t", &c, [(layer, q, f)]) {
                Err(LlamaError::InvalidAdapter { reason, .. }) => reason,
                other => panic!("not refused: {other:?}"),
            };
        assert!(refused(c.n_layers, good.clone()).contains("layers"));
        let narrow = LoraFactors {
            a: vec![0.0; 2 * (n_in - 1)],
            ..good.clone()
        };
        assert!(refused(0, narrow).contains("another base model"));
        let rank0 = LoraFactors {
            rank: 0,
            a: vec![],
            b: vec![],
            scale: 1.0,
        };
        assert!(refused(0, rank0).contains("rank 0"));
        match LoraAdapter::from_factors("t", &c, [(3, q, good.clone()), (3, q, good.clone())]) {
            Err(LlamaError::InvalidAdapter { reason, .. }) => {
                assert!(
                    reason.contains("layer 3 q_proj has factor A twice"),
                    "{reason}"
                )
            }
            other => panic!("a projection given twice: {other:?}"),
        }
        assert!(matches!(
            LoraAdapter::from_factors("t", &c, []),
            Err(LlamaError::InvalidAdapter { .. })
        ));
    }
}
