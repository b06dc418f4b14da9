//! Folding an adapter into a checkpoint, offline: for users who serve one fine-tune
//! only, a merged file runs at the base model's speed with no adapter at run time.
//!
//! [`merge_gguf`] writes a GGUF file with every tensor of the base file, each tensor the
//! adapter changes replaced by `W + scale * B A` (computed in f32 from the dequantized
//! weight), in f32 or quantized again into the base tensor's own format.

use std::path::Path;

use super::{LoraAdapter, LoraTarget};
use crate::config::LlamaConfig;
use crate::error::{LlamaError, Result};
use crate::loader::gguf::{GgmlType, GgufFile};
use crate::loader::gguf_writer::{GgufWriter, TensorPlan};
use crate::loader::{HeadOrder, permute_heads, permuted_head_count};
use crate::quant::QuantFormat;

/// The type merged tensors are written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MergedType {
    /// f32: the merge exactly, four bytes a weight.
    #[default]
    F32,
    /// The base tensor's own format, quantized again (f32 where the format is not one
    /// we quantize into).
    Same,
}

/// What [`merge_gguf`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct MergeReport {
    /// Tensors changed by the adapter.
    pub merged: usize,
    /// Tensors copied as they were.
    pub copied: usize,
    /// Bytes of the written file.
    pub bytes: u64,
}

/// `(layer, target)` of a base tensor name the adapter may change.
fn target_of(name: &str) -> Option<(usize, LoraTarget)> {
    let rest = name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    Some((layer.parse().ok()?, LoraTarget::from_gguf(rest)?))
}

/// Writes `out`: the GGUF model `base` with `adapter` folded into its weights. The
/// adapter must have been read for this model ([`LoraAdapter::open`] with the model's
/// configuration). `progress(done, total)` is called after each tensor.
///
/// # Errors
///
/// [`LlamaError::InvalidAdapter`] if the adapter was read for a model of another
/// depth; what reading `base` or writing `out` reports.
pub fn merge_gguf(
    base: impl AsRef<Path>,
    adapter: &LoraAdapter,
    out: impl AsRef<Path>,
    ty: MergedType,
    mut progress: impl FnMut(usize, usize),
) -> Result<MergeReport> {
    let file = GgufFile::open(base.as_ref())?;
    let config = LlamaConfig::from_gguf(&file)?;
    if adapter.n_layers() != config.n_layers {
        return Err(super::invalid(
            adapter.source(),
            format!(
                "read for a model of {} layers; {} has {}",
                adapter.n_layers(),
                base.as_ref().display(),
                config.n_layers
            ),
        ));
    }
    let merged_type = |info_ty: GgmlType| match ty {
        MergedType::F32 => GgmlType::F32,
        MergedType::Same => match QuantFormat::from_ggml(info_ty) {
            Some(f) => f.ggml(),
            None => GgmlType::F32,
        },
    };
    let plans: Vec<TensorPlan> = file
        .tensors()
        .iter()
        .map(|info| {
            let changed =
                target_of(&info.name).is_some_and(|(layer, t)| adapter.factors(layer, t).is_some());
            let ty = if changed {
                merged_type(info.ty)
            } else {
                info.ty
            };
            TensorPlan::new(info.name.clone(), &info.shape(), ty)
        })
        .collect();
    let metadata: Vec<_> = file
        .metadata()
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let mut writer = GgufWriter::create(out.as_ref(), &metadata, plans.clone())?;
    let total = plans.len();
    let mut report = MergeReport {
        merged: 0,
        copied: 0,
        bytes: 0,
    };
    for (i, (info, plan)) in file.tensors().iter().zip(&plans).enumerate() {
        let factors = target_of(&info.name).and_then(|(l, t)| Some((t, adapter.factors(l, t)?)));
        match factors {
            None => {
                writer.write(&file.read_tensor_bytes(info)?)?;
                report.copied += 1;
            }
            Some((target, f)) => {
                let (shape, mut w) = file.read_tensor_f32(&info.name)?;
                let &[rows, cols] = shape.as_slice() else {
                    return Err(LlamaError::InvalidFormat(format!(
                        "`{}` is not a matrix",
                        info.name
                    )));
                };
                let mut delta = f.delta(cols, rows);
                let (n_heads, n_kv_heads) = (config.n_heads, config.n_kv_heads);
                if let Some(heads) = permuted_head_count(target.module(), n_heads, n_kv_heads) {
                    delta = permute_heads(&delta, heads, cols, HeadOrder::ToGguf);
                }
                for (w, d) in w.iter_mut().zip(&delta) {
                    *w += d;
                }
                let bytes = match QuantFormat::from_ggml(plan.ty) {
                    Some(format) => crate::quant::quantize::quantize(format, &w)?,
                    None => w.iter().flat_map(|v| v.to_le_bytes()).collect(),
                };
                writer.write(&bytes)?;
                report.merged += 1;
            }
        }
        progress(i + 1, total);
    }
    writer.finish()?;
    report.bytes = std::fs::metadata(out.as_ref())
        .map_err(|e| LlamaError::io(out.as_ref(), e))?
        .len();
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permuting_heads_to_gguf_and_back_gives_the_rows_back() {
        let data: Vec<f32> = (0..24).map(|i| i as f32).collect();
        let permuted = permute_heads(&data, 2, 2, HeadOrder::ToGguf);
        assert_ne!(permuted, data);
        assert_eq!(permute_heads(&permuted, 2, 2, HeadOrder::FromGguf), data);
    }
}
