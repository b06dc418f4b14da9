//! Random-weight Llama GGUF files of real models' shapes, for measuring speed at the
//! sizes people run with no download (speed does not depend on the weights' values;
//! the text such a model writes is noise). `examples/random_gguf.rs` is the command.
//!
//! What is written is what `../shared/bench/make_random_llama.py` followed by
//! `llama-quantize` writes: the `llama` architecture's metadata (context 8192, RoPE
//! base 500000, RMSNorm epsilon 1e-5), the tokenizer of another GGUF copied in (its
//! `tokenizer.*` keys; the vocabulary size follows it), tied embeddings (no
//! `output.weight`), norms of ones, and every matrix drawn from N(0, 0.02²), then stored
//! in the chosen [`WeightTypes`]. Values are a pure function of (seed, tensor name,
//! row) ([`random_row`]), so a file can be checked against them and rows are made in
//! parallel; the file is streamed through [`GgufWriter`] a few megabytes at a time.

use std::path::Path;

use half::f16;
use rayon::prelude::*;

use super::gguf::{GgmlType, GgufFile, GgufValue};
use super::gguf_writer::{GgufWriter, TensorPlan};
use super::quantize::quantize;
use crate::config::{LlamaConfig, RopeFrequencies};
use crate::error::{LlamaError, Result};
use crate::model::weights::{BLOCK_WEIGHTS, EMBED, FINAL_NORM, WeightKind};
use crate::quant::QuantFormat;

/// Spread of the random matrices' values.
pub const WEIGHT_STD: f32 = 0.02;

/// The body of a named model shape (`1b`: Llama 3.2 1B, `3b`: Llama 3.2 3B, `8b`: Llama
/// 3.1 8B) with `vocab_size` rows of embeddings, tied embeddings, plain RoPE of base
/// 500000 and a context of 8192 (the random files' metadata).
///
/// # Errors
///
/// [`LlamaError::InvalidParameter`] for another name.
pub fn shape(name: &str, vocab_size: usize) -> Result<LlamaConfig> {
    let base = match name {
        "1b" => LlamaConfig::llama3_2_1b(),
        "3b" => LlamaConfig::llama3_2_3b(),
        "8b" => LlamaConfig::llama3_1_8b(),
        _ => return Err(LlamaError::invalid("shape", name, "not one of 1b, 3b, 8b")),
    };
    Ok(random_config(base, vocab_size))
}

/// `body` as the random files declare it: `vocab_size` embeddings, tied, plain RoPE of
/// base 500000, context 8192.
pub fn random_config(body: LlamaConfig, vocab_size: usize) -> LlamaConfig {
    LlamaConfig {
        vocab_size,
        tie_embeddings: true,
        rope_theta: 500_000.0,
        rope_frequencies: RopeFrequencies::Plain,
        norm_eps: 1e-5,
        context_length: 8192,
        max_seq_len: 8192,
        ..body
    }
}

/// The storage types of a file's matrices (norms are always F32): one type for all,
/// or a preset as `llama-quantize` makes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WeightTypes {
    /// The type of most matrices.
    pub base: GgmlType,
    /// The type of the (tied) embedding table, which is also the output head.
    pub embed: GgmlType,
    /// `Q4_K_M` / `Q5_K_M`: `attn_v` and `ffn_down` take `Q6_K` in the layers where
    /// `llama-quantize` gives them more bits (the first and last eighth of the layers
    /// and every third between).
    pub more_bits: bool,
    /// `general.file_type` (llama.cpp's `llama_ftype`).
    pub file_type: u32,
}

impl WeightTypes {
    /// Parses a type name: `F32`, `F16`, a [`QuantFormat`] (`Q8_0`, `Q4_0`, `Q4_1`,
    /// `Q5_0`, `Q5_1`, `Q3_K`, `Q4_K`, `Q5_K`, `Q6_K`) or a preset `Q4_K_M` / `Q5_K_M`,
    /// in any case. As `llama-quantize` does, a quantized type puts the tied embedding
    /// table (the output head) in `Q6_K` unless it is `Q8_0`; with `pure` every matrix
    /// is in the one type instead (`llama-quantize --pure`).
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidParameter`] for another name, or a preset with `pure`.
    pub fn parse(name: &str, pure: bool) -> Result<Self> {
        let upper = name.to_ascii_uppercase();
        let (base, more_bits) = match upper.as_str() {
            "F32" => (GgmlType::F32, false),
            "F16" => (GgmlType::F16, false),
            "Q4_K_M" => (GgmlType::Q4_K, true),
            "Q5_K_M" => (GgmlType::Q5_K, true),
            other => (
                other
                    .parse::<QuantFormat>()
                    .map_err(|_| {
                        LlamaError::invalid(
                            "type",
                            name,
                            "not F32, F16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q3_K, Q4_K, Q5_K, Q6_K, Q4_K_M or Q5_K_M",
                        )
                    })?
                    .ggml(),
                false,
            ),
        };
        if pure && more_bits {
            return Err(LlamaError::invalid(
                "type",
                name,
                "a mixed preset cannot be pure",
            ));
        }
        let quantized = !matches!(base, GgmlType::F32 | GgmlType::F16);
        let embed = if quantized && !pure && base != GgmlType::Q8_0 {
            GgmlType::Q6_K
        } else {
            base
        };
        let file_type = match upper.as_str() {
            "F32" => 0,
            "F16" => 1,
            "Q4_0" => 2,
            "Q4_1" => 3,
            "Q8_0" => 7,
            "Q5_0" => 8,
            "Q5_1" => 9,
            "Q3_K" => 11, // as Q3_K_S
            "Q4_K" => 14, // as Q4_K_S
            "Q5_K" => 16, // as Q5_K_S
            "Q4_K_M" => 15,
            "Q5_K_M" => 17,
            _ => 18, // Q6_K
        };
        Ok(Self {
            base,
            embed,
            more_bits,
            file_type,
        })
    }

    /// The type of layer `layer`'s tensor `gguf` (the name after `blk.{layer}.`) in a
    /// model of `n_layers` layers.
    pub fn layer_type(&self, gguf: &str, layer: usize, n_layers: usize) -> GgmlType {
        let eighth = n_layers / 8;
        let more = match layer.checked_sub(eighth) {
            None => true,
            Some(past) => layer >= 7 * n_layers / 8 || past % 3 == 2,
        };
        if self.more_bits && more && matches!(gguf, "attn_v.weight" | "ffn_down.weight") {
            GgmlType::Q6_K
        } else {
            self.base
        }
    }
}

/// The tensors of a random file of `config`'s shape in `types`, in the order they are
/// written (the embeddings, the final norm, then each layer's tensors).
pub fn plan(config: &LlamaConfig, types: &WeightTypes) -> Vec<TensorPlan> {
    let c = config;
    let mut plans = vec![
        TensorPlan::new(EMBED.1, &[c.vocab_size, c.d_model], types.embed),
        TensorPlan::new(FINAL_NORM.1, &[c.d_model], GgmlType::F32),
    ];
    for layer in 0..c.n_layers {
        for w in &BLOCK_WEIGHTS {
            for part in w.parts {
                let name = format!("blk.{layer}.{}", part.gguf);
                let rows = (part.rows)(c);
                plans.push(match w.kind {
                    WeightKind::Norm => TensorPlan::new(name, &[rows], GgmlType::F32),
                    WeightKind::Projection => TensorPlan::new(
                        name,
                        &[rows, (w.cols)(c)],
                        types.layer_type(part.gguf, layer, c.n_layers),
                    ),
                });
            }
        }
    }
    plans
}

/// The metadata of a random file: `general.*` and `llama.*` for `config`, then the
/// tokenizer (every `tokenizer.*` key of `tokenizer`, in its order).
pub fn metadata(
    config: &LlamaConfig,
    name: &str,
    types: &WeightTypes,
    tokenizer: &[(String, GgufValue)],
) -> Vec<(String, GgufValue)> {
    let u32_of = |v: usize| GgufValue::U32(u32::try_from(v).unwrap_or(u32::MAX));
    let mut m = vec![
        (
            "general.architecture".into(),
            GgufValue::String("llama".into()),
        ),
        ("general.name".into(), GgufValue::String(name.into())),
        ("llama.context_length".into(), u32_of(config.context_length)),
        ("llama.embedding_length".into(), u32_of(config.d_model)),
        ("llama.block_count".into(), u32_of(config.n_layers)),
        (
            "llama.feed_forward_length".into(),
            u32_of(config.ffn_hidden),
        ),
        ("llama.attention.head_count".into(), u32_of(config.n_heads)),
        (
            "llama.attention.head_count_kv".into(),
            u32_of(config.n_kv_heads),
        ),
        (
            "llama.rope.freq_base".into(),
            GgufValue::F32(config.rope_theta as f32),
        ),
        (
            "llama.attention.layer_norm_rms_epsilon".into(),
            GgufValue::F32(config.norm_eps as f32),
        ),
        ("llama.rope.dimension_count".into(), u32_of(config.head_dim)),
        ("general.file_type".into(), GgufValue::U32(types.file_type)),
    ];
    if types.file_type > 1 {
        m.push(("general.quantization_version".into(), GgufValue::U32(2)));
    }
    m.extend(
        tokenizer
            .iter()
            .filter(|(k, _)| k.starts_with("tokenizer."))
            .cloned(),
    );
    m
}

/// The `tokenizer.*` metadata of a GGUF file and its vocabulary size (the length of
/// `tokenizer.ggml.tokens`).
///
/// # Errors
///
/// [`LlamaError::Config`] if the file has no `tokenizer.ggml.tokens` array.
pub fn tokenizer_metadata(gguf: &GgufFile) -> Result<(Vec<(String, GgufValue)>, usize)> {
    let vocab = gguf
        .get("tokenizer.ggml.tokens")
        .and_then(GgufValue::as_array)
        .map(<[GgufValue]>::len)
        .ok_or_else(|| {
            LlamaError::Config(format!(
                "{} has no tokenizer.ggml.tokens to copy",
                gguf.path().display()
            ))
        })?;
    let keys = gguf
        .metadata()
        .iter()
        .filter(|(k, _)| k.starts_with("tokenizer."))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    Ok((keys, vocab))
}

/// SplitMix64: a 64-bit state stepped by a constant and mixed.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform value in (0, 1].
    fn unit(&mut self) -> f64 {
        ((self.next() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }
}

/// Row `row` of tensor `tensor`'s random values for `seed`: N(0, [`WEIGHT_STD`]²) by
/// Box-Muller from a SplitMix64 stream seeded by the three (FNV-1a of the name).
pub fn random_row(seed: u64, tensor: &str, row: usize, out: &mut [f32]) {
    let name_hash = tensor.bytes().fold(0xCBF2_9CE4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01B3)
    });
    let mut rng = SplitMix(
        seed ^ name_hash.rotate_left(17) ^ (row as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93),
    );
    for pair in out.chunks_mut(2) {
        let radius = (-2.0 * rng.unit().ln()).sqrt();
        let angle = std::f64::consts::TAU * rng.unit();
        let (s, c) = angle.sin_cos();
        pair[0] = (radius * c) as f32 * WEIGHT_STD;
        if let Some(second) = pair.get_mut(1) {
            *second = (radius * s) as f32 * WEIGHT_STD;
        }
    }
}

/// `values` stored as `ty` (F32, F16 or a [`QuantFormat`]).
///
/// # Errors
///
/// [`LlamaError::UnsupportedTensorType`] for another type; as [`quantize`] for partial
/// blocks.
pub fn encode(ty: GgmlType, values: &[f32]) -> Result<Vec<u8>> {
    match ty {
        GgmlType::F32 => Ok(values.iter().flat_map(|v| v.to_le_bytes()).collect()),
        GgmlType::F16 => Ok(values
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_le_bytes())
            .collect()),
        _ => match QuantFormat::from_ggml(ty) {
            Some(format) => quantize(format, values),
            None => Err(LlamaError::UnsupportedTensorType {
                name: "(random weights)".into(),
                ty: ty.to_string(),
            }),
        },
    }
}

/// The bytes of rows `rows` of a planned tensor: ones for a norm, else random rows
/// encoded in the tensor's type (in parallel).
///
/// # Errors
///
/// As [`encode`].
pub fn tensor_rows(seed: u64, plan: &TensorPlan, rows: std::ops::Range<usize>) -> Result<Vec<u8>> {
    if plan.shape.len() == 1 {
        return encode(plan.ty, &vec![1.0; plan.shape[0]]);
    }
    let cols = plan.shape[1];
    let encoded: Vec<Vec<u8>> = rows
        .into_par_iter()
        .map(|r| {
            let mut values = vec![0f32; cols];
            random_row(seed, &plan.name, r, &mut values);
            encode(plan.ty, &values)
        })
        .collect::<Result<_>>()?;
    Ok(encoded.concat())
}

/// What [`write_random_llama`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RandomFileSummary {
    /// Tensors written.
    pub tensors: usize,
    /// Bytes of tensor data (without padding).
    pub data_bytes: u64,
    /// Values in the file's tensors.
    pub parameters: u64,
}

/// Writes a random file of `config`'s shape in `types` to `path`, with `metadata`
/// (see [`metadata`]), reporting `(bytes of tensor data written, total)` to `progress`
/// after every piece. Memory stays at a few megabytes of rows at a time.
///
/// # Errors
///
/// [`LlamaError::Io`] if the file cannot be written; [`LlamaError::InvalidFormat`] if a
/// matrix's rows are not whole blocks of its type (a K-quant needs multiples of 256).
pub fn write_random_llama(
    path: &Path,
    config: &LlamaConfig,
    types: &WeightTypes,
    metadata: &[(String, GgufValue)],
    seed: u64,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<RandomFileSummary> {
    config.validate()?;
    let plans = plan(config, types);
    let sizes = plans
        .iter()
        .map(TensorPlan::n_bytes)
        .collect::<Result<Vec<_>>>()?;
    let total: u64 = sizes.iter().sum();
    let parameters = plans
        .iter()
        .map(|p| p.shape.iter().product::<usize>() as u64)
        .sum();
    let mut writer = GgufWriter::create(path, metadata, plans.clone())?;
    let mut done = 0u64;
    const PIECE_VALUES: usize = 1 << 20;
    for p in &plans {
        let rows = if p.shape.len() == 1 { 1 } else { p.shape[0] };
        let cols = p.shape.last().copied().unwrap_or(1).max(1);
        let step = (PIECE_VALUES / cols).max(1);
        let mut start = 0;
        while start < rows {
            let end = (start + step).min(rows);
            let bytes = tensor_rows(seed, p, start..end)?;
            writer.write(&bytes)?;
            done += bytes.len() as u64;
            progress(done, total);
            start = end;
        }
    }
    writer.finish()?;
    Ok(RandomFileSummary {
        tensors: plans.len(),
        data_bytes: total,
        parameters,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::assert_err;

    #[test]
    fn presets_follow_llama_quantize() {
        let t = WeightTypes::parse("q4_k_m", false).unwrap();
        // 16 layers: more bits in 0, 1, 4, 7, 10, 13, 14, 15 (as llama-quantize's
        // Q4_K_M of the 1B shape has them).
        let more: Vec<usize> = (0..16)
            .filter(|&i| t.layer_type("ffn_down.weight", i, 16) == GgmlType::Q6_K)
            .collect();
        assert_eq!(more, vec![0, 1, 4, 7, 10, 13, 14, 15]);
        assert_eq!(t.layer_type("attn_q.weight", 0, 16), GgmlType::Q4_K);
        assert_eq!(t.embed, GgmlType::Q6_K);
        assert_eq!(
            WeightTypes::parse("Q8_0", false).unwrap().embed,
            GgmlType::Q8_0
        );
        assert_eq!(
            WeightTypes::parse("Q4_0", true).unwrap().embed,
            GgmlType::Q4_0
        );
        assert_eq!(
            WeightTypes::parse("F16", false).unwrap().embed,
            GgmlType::F16
        );
        assert_err!(
            WeightTypes::parse("Q4_K_M", true),
            LlamaError::InvalidParameter { name: "type", reason, .. }
                if reason == "a mixed preset cannot be pure"
        );
        assert_err!(
            WeightTypes::parse("IQ2_XS", false),
            LlamaError::InvalidParameter { name: "type", value, .. } if value == "IQ2_XS"
        );
        assert_err!(
            shape("2b", 10),
            LlamaError::InvalidParameter { name: "shape", .. }
        );
    }

    #[test]
    fn random_rows_are_deterministic_and_spread() {
        let mut a = vec![0f32; 4097];
        let mut b = vec![0f32; 4097];
        random_row(7, "blk.0.attn_q.weight", 3, &mut a);
        random_row(7, "blk.0.attn_q.weight", 3, &mut b);
        assert_eq!(a, b);
        random_row(7, "blk.0.attn_q.weight", 4, &mut b);
        assert_ne!(a, b);
        let mean = a.iter().sum::<f32>() / a.len() as f32;
        let std = (a.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / a.len() as f32).sqrt();
        assert!(
            mean.abs() < 0.002 && (std - WEIGHT_STD).abs() < 0.002,
            "{mean} {std}"
        );
    }
}
