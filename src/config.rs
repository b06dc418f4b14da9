//! Model hyper-parameters: what a [`LlamaConfig`] holds, presets for known Llama models,
//! and the checks and sizes derived from it. Reading one from a checkpoint (and loading a
//! whole model) is the loader's: see [`crate::loader`].

use crate::error::{LlamaError, Result};

/// Most layers a configuration may declare (the largest Llama models have 126).
const MAX_LAYERS: usize = 4096;

/// Most elements one weight matrix may have (2^40: 4 TiB of f32).
const MAX_WEIGHT_ELEMENTS: usize = 1 << 40;

/// Llama 3.1-style RoPE frequency scaling (as in Llama 3.1 / 3.2 checkpoints).
#[derive(Debug, Clone, PartialEq)]
pub struct RopeScaling {
    /// Overall scaling factor for long wavelengths (8 for Llama 3.1, 32 for 3.2).
    pub factor: f64,
    /// Wavelengths longer than `original_max_position / low_freq_factor` are scaled fully.
    pub low_freq_factor: f64,
    /// Wavelengths shorter than `original_max_position / high_freq_factor` are kept.
    pub high_freq_factor: f64,
    /// Context length the model was pre-trained with.
    pub original_max_position: usize,
}

/// How rotary frequencies are adjusted beyond the plain `theta^(-2i/d)` schedule.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeFrequencies {
    /// Plain RoPE.
    Plain,
    /// Llama 3.1-style scaling.
    Llama3(RopeScaling),
    /// One divisor per frequency, as GGUF files store them (`rope_freqs.weight`).
    Factors(Vec<f32>),
}

/// How the CPU kernels multiply weights kept in a quantized block format (other
/// backends dequantize at load and always compute in their own float precision).
///
/// Both are batch-invariant to the bit: a row's results depend only on its own values,
/// in one fixed order, whatever the batch, the prompt chunking or the thread count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Precision {
    /// f32 activations times exactly dequantized weights, f32 arithmetic: the fp32
    /// reference's logits to about 1e-6 (what `tests/integration/reference.rs` checks). Slower at
    /// several rows: the products are bound by the cores' f32 multiply-adds.
    Exact,
    /// Activations quantized to 8 bits per 32-value block (ggml's `Q8_0` rule; per 256
    /// values against the K-quants, as ggml's `Q8_K`) and integer dot products with the
    /// weights' own quantized values, as llama.cpp computes: several times the
    /// multiply-adds per instruction. The logits move by
    /// about 1% of their scale; greedy tokens mostly agree with `Exact`. The same bits on
    /// every SIMD path, and on the CubeCL GPU backends, whose integer product gives the
    /// CPU's `fast` product bit for bit.
    Fast,
}

impl Default for Precision {
    /// `Fast` where the CPU kernels' active path has its integer kernels (x86-64 with
    /// AVX-512 VNNI, Zen 4 and later or Intel since Ice Lake; or with AVX2, FMA and
    /// F16C), else `Exact`: on NEON and portable paths the `fast` products are computed
    /// by plain Rust and are slower than `exact`'s SIMD kernels, so they are there for
    /// tests and for results that match an x86 machine's bit for bit.
    fn default() -> Self {
        if crate::kernels::int8::has_integer_kernels() {
            Precision::Fast
        } else {
            Precision::Exact
        }
    }
}

impl Precision {
    /// Models with fewer parameters than this default to [`Exact`](Self::Exact) (see
    /// [`for_model`](Self::for_model)).
    pub const EXACT_BELOW_PARAMETERS: u64 = 1_000_000_000;

    /// The default precision for a model of `config`'s size: [`Exact`](Self::Exact)
    /// below [`EXACT_BELOW_PARAMETERS`](Self::EXACT_BELOW_PARAMETERS) (one billion),
    /// else the CPU's default ([`Precision::default`]).
    ///
    /// Small models are where 8-bit activations hurt most and gain least: on the
    /// 135M-parameter demo model `fast` changes the greedy answer to "What is the capital
    /// of France?" (a French word salad where `exact` says "Paris"), and the step is
    /// short enough that attention and sampling, which `fast` does not speed up, take
    /// much of it. From Llama 3.2 1B up the products dominate and `fast` gives
    /// llama.cpp's arithmetic at about 1.5 times `exact`'s one-row speed. Loading sets
    /// this on the configuration; `with_precision` or `--precision` overrides it.
    pub fn for_model(config: &LlamaConfig) -> Self {
        if config.parameter_count() < Self::EXACT_BELOW_PARAMETERS {
            Precision::Exact
        } else {
            Precision::default()
        }
    }

    /// The precision's name, as `--precision` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Exact => "exact",
            Precision::Fast => "fast",
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Precision {
    type Err = LlamaError;

    /// `exact` or `fast`.
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "exact" => Ok(Precision::Exact),
            "fast" => Ok(Precision::Fast),
            _ => Err(LlamaError::invalid(
                "precision",
                s,
                "must be `exact` or `fast`",
            )),
        }
    }
}

/// The float type of a model's activations, dense weights and KV cache on a backend
/// (see [`crate::backend::set_float_type`]): `f32`, the default and the reference, or a
/// half type for the GPU backends, with our CubeCL kernels accumulating in f32 whatever
/// the storage type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum FloatType {
    /// 32-bit IEEE floats.
    #[default]
    F32,
    /// 16-bit IEEE floats (`half::f16`): 10 bits of mantissa, values up to 65504.
    F16,
    /// bfloat16 (`half::bf16`): f32's range, 7 bits of mantissa.
    Bf16,
}

impl FloatType {
    /// The type's name, as `--dtype` takes it.
    pub fn name(self) -> &'static str {
        match self {
            FloatType::F32 => "f32",
            FloatType::F16 => "f16",
            FloatType::Bf16 => "bf16",
        }
    }

    /// Burn's float data type.
    pub fn dtype(self) -> burn::tensor::FloatDType {
        match self {
            FloatType::F32 => burn::tensor::FloatDType::F32,
            FloatType::F16 => burn::tensor::FloatDType::F16,
            FloatType::Bf16 => burn::tensor::FloatDType::BF16,
        }
    }

    /// The type of Burn's float data type, if it is one of these.
    pub fn from_dtype(dtype: burn::tensor::FloatDType) -> Option<Self> {
        match dtype {
            burn::tensor::FloatDType::F32 => Some(FloatType::F32),
            burn::tensor::FloatDType::F16 => Some(FloatType::F16),
            burn::tensor::FloatDType::BF16 => Some(FloatType::Bf16),
            _ => None,
        }
    }

    /// Bytes of one value.
    pub fn size(self) -> usize {
        match self {
            FloatType::F32 => 4,
            FloatType::F16 | FloatType::Bf16 => 2,
        }
    }
}

impl std::fmt::Display for FloatType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for FloatType {
    type Err = LlamaError;

    /// `f32`, `f16` or `bf16`.
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "f32" => Ok(FloatType::F32),
            "f16" => Ok(FloatType::F16),
            "bf16" => Ok(FloatType::Bf16),
            _ => Err(LlamaError::invalid(
                "dtype",
                s,
                "must be `f32`, `f16` or `bf16`",
            )),
        }
    }
}

/// The hyper-parameters of a Llama-architecture transformer.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// Rows of the embedding table.
    pub vocab_size: usize,
    /// Model (residual stream) width.
    pub d_model: usize,
    /// Number of transformer blocks.
    pub n_layers: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (grouped-query attention when smaller than `n_heads`).
    pub n_kv_heads: usize,
    /// Width of one attention head.
    pub head_dim: usize,
    /// Hidden width of the SwiGLU feed-forward block.
    pub ffn_hidden: usize,
    /// RMSNorm epsilon.
    pub norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// RoPE frequency adjustments.
    pub rope_frequencies: RopeFrequencies,
    /// Whether the output head shares the embedding table.
    pub tie_embeddings: bool,
    /// Context length the model was trained for (an upper bound for `max_seq_len`).
    pub context_length: usize,
    /// Context window this instance allocates for (prompt + generated tokens).
    pub max_seq_len: usize,
    /// How the CPU kernels multiply quantized weights (see [`Precision`]): the presets
    /// and the loaders set [`Precision::for_model`], `exact` below one billion
    /// parameters.
    pub precision: Precision,
}

impl LlamaConfig {
    /// Checks that every id in `tokens` has an embedding in this model.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidParameter`] naming the first id outside the vocabulary.
    pub fn check_token_ids(&self, tokens: &[u32]) -> Result<()> {
        match tokens.iter().find(|&&t| t as usize >= self.vocab_size) {
            Some(&bad) => Err(LlamaError::invalid(
                "token id",
                bad,
                "outside the model's vocabulary",
            )),
            None => Ok(()),
        }
    }

    /// Bytes one token's keys and values take across all layers in f32. For the demo
    /// model (30 layers, 3 KV heads of 64) it is 46,080 bytes. A cache in a half type
    /// takes half of it (see [`kv_bytes_per_token_in`](Self::kv_bytes_per_token_in)).
    pub fn kv_bytes_per_token(&self) -> usize {
        self.kv_bytes_per_token_in(FloatType::F32)
    }

    /// Bytes one token's keys and values take across all layers in a cache of float
    /// type `ty`: the unit of the per-request KV budgets, counted in the model device's
    /// float type (23,040 bytes for the demo model in f16 or bf16).
    pub fn kv_bytes_per_token_in(&self, ty: FloatType) -> usize {
        crate::cache::paged::block_bytes(
            self.n_layers,
            self.n_kv_heads,
            self.head_dim,
            1,
            ty.size(),
        )
    }

    fn llama3_family(
        d_model: usize,
        n_layers: usize,
        n_heads: usize,
        ffn_hidden: usize,
        rope: RopeFrequencies,
        tie_embeddings: bool,
        context_length: usize,
    ) -> Self {
        Self {
            vocab_size: 128_256,
            d_model,
            n_layers,
            n_heads,
            n_kv_heads: 8,
            head_dim: d_model / n_heads,
            ffn_hidden,
            norm_eps: 1e-5,
            rope_theta: 500_000.0,
            rope_frequencies: rope,
            tie_embeddings,
            context_length,
            max_seq_len: context_length,
            precision: Precision::default(),
        }
        .with_default_precision()
    }

    /// The model's parameter count from its dimensions: the embedding table, each
    /// block's projections and norms, the final norm, and an untied output head
    /// (134,515,008 for the demo model, 1,235,814,400 for Llama 3.2 1B). Saturates
    /// instead of overflowing on absurd dimensions.
    pub fn parameter_count(&self) -> u64 {
        let n = |v: usize| v as u64;
        let (d, heads, kv) = (n(self.d_model), n(self.n_heads), n(self.n_kv_heads));
        let head_dim = n(self.head_dim);
        let attention = (2 * heads * head_dim)
            .saturating_mul(d)
            .saturating_add((2 * kv * head_dim).saturating_mul(d));
        let ffn = (3 * d).saturating_mul(n(self.ffn_hidden));
        let block = attention.saturating_add(ffn).saturating_add(2 * d);
        let embedding = n(self.vocab_size).saturating_mul(d);
        let head = if self.tie_embeddings { 0 } else { embedding };
        block
            .saturating_mul(n(self.n_layers))
            .saturating_add(embedding)
            .saturating_add(head)
            .saturating_add(d)
    }

    /// Sets [`precision`](Self::precision) to the default for this model's size
    /// ([`Precision::for_model`]).
    pub fn with_default_precision(mut self) -> Self {
        self.precision = Precision::for_model(&self);
        self
    }

    fn llama3_scaling(factor: f64) -> RopeFrequencies {
        RopeFrequencies::Llama3(RopeScaling {
            factor,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192,
        })
    }

    /// Llama 3.2 1B (Instruct or base).
    pub fn llama3_2_1b() -> Self {
        Self::llama3_family(
            2048,
            16,
            32,
            8192,
            Self::llama3_scaling(32.0),
            true,
            131_072,
        )
    }

    /// Llama 3.2 3B (Instruct or base).
    pub fn llama3_2_3b() -> Self {
        Self::llama3_family(
            3072,
            28,
            24,
            8192,
            Self::llama3_scaling(32.0),
            true,
            131_072,
        )
    }

    /// Llama 3.1 8B (Instruct or base).
    pub fn llama3_1_8b() -> Self {
        Self::llama3_family(
            4096,
            32,
            32,
            14336,
            Self::llama3_scaling(8.0),
            false,
            131_072,
        )
    }

    /// Llama 3 8B (Instruct or base).
    pub fn llama3_8b() -> Self {
        Self::llama3_family(4096, 32, 32, 14336, RopeFrequencies::Plain, false, 8192)
    }

    /// TinyLlama 1.1B (chat v1.0).
    pub fn tiny_llama() -> Self {
        Self {
            vocab_size: 32_000,
            d_model: 2048,
            n_layers: 22,
            n_heads: 32,
            n_kv_heads: 4,
            head_dim: 64,
            ffn_hidden: 5632,
            norm_eps: 1e-5,
            rope_theta: 10_000.0,
            rope_frequencies: RopeFrequencies::Plain,
            tie_embeddings: false,
            context_length: 2048,
            max_seq_len: 2048,
            precision: Precision::default(),
        }
        .with_default_precision()
    }

    /// SmolLM2-135M(-Instruct), the demo model.
    pub fn smollm2_135m() -> Self {
        Self {
            vocab_size: 49_152,
            d_model: 576,
            n_layers: 30,
            n_heads: 9,
            n_kv_heads: 3,
            head_dim: 64,
            ffn_hidden: 1536,
            norm_eps: 1e-5,
            rope_theta: 100_000.0,
            rope_frequencies: RopeFrequencies::Plain,
            tie_embeddings: true,
            context_length: 8192,
            max_seq_len: 8192,
            precision: Precision::default(),
        }
        .with_default_precision()
    }

    /// Sets how the CPU kernels multiply quantized weights.
    pub fn with_precision(mut self, precision: Precision) -> Self {
        self.precision = precision;
        self
    }

    /// Sets the context window to allocate for, clamped to at least 1.
    pub fn with_max_seq_len(mut self, max_seq_len: usize) -> Self {
        self.max_seq_len = max_seq_len.max(1);
        self
    }

    /// Sets `max_seq_len`, refusing 0 and values beyond the trained context.
    pub fn checked_max_seq_len(self, max_seq_len: usize) -> Result<Self> {
        if max_seq_len < 2 || max_seq_len > self.context_length {
            return Err(LlamaError::InvalidParameter {
                name: "max_seq_len",
                value: max_seq_len.to_string(),
                reason: "must be between 2 and the model's trained context length",
            });
        }
        Ok(self.with_max_seq_len(max_seq_len))
    }

    /// Checks that the dimensions are consistent, and small enough that every weight's
    /// size is a number ([`LlamaError::Config`] otherwise).
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(LlamaError::Config(msg));
        if self.vocab_size == 0 || self.d_model == 0 || self.n_layers == 0 {
            return bad(format!(
                "vocab_size {}, d_model {} and n_layers {} must all be positive",
                self.vocab_size, self.d_model, self.n_layers
            ));
        }
        if self.n_heads == 0
            || self.n_kv_heads == 0
            || !self.n_heads.is_multiple_of(self.n_kv_heads)
        {
            return bad(format!(
                "{} query heads cannot be grouped over {} key/value heads",
                self.n_heads, self.n_kv_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad(format!(
                "head_dim {} must be positive and even",
                self.head_dim
            ));
        }
        if self.ffn_hidden == 0 {
            return bad("ffn_hidden must be positive".into());
        }
        // Every weight's element count must be a number: a wrapped product would reach
        // the loader's shape checks and the projection splitter as a small one.
        let q_width = self.n_heads.checked_mul(self.head_dim);
        let kv_width = self.n_kv_heads.checked_mul(self.head_dim);
        let weights = [
            (
                "the query projection",
                q_width.and_then(|w| w.checked_mul(self.d_model)),
            ),
            (
                "a key/value projection",
                kv_width.and_then(|w| w.checked_mul(self.d_model)),
            ),
            ("the embedding", self.vocab_size.checked_mul(self.d_model)),
            (
                "a feed-forward projection",
                self.ffn_hidden.checked_mul(self.d_model),
            ),
        ];
        for (what, elements) in weights {
            if elements.is_none_or(|e| e > MAX_WEIGHT_ELEMENTS) {
                return bad(format!(
                    "{what} would have more than {MAX_WEIGHT_ELEMENTS} elements \
                     (vocab_size {}, d_model {}, heads {}/{} of {}, ffn_hidden {})",
                    self.vocab_size,
                    self.d_model,
                    self.n_heads,
                    self.n_kv_heads,
                    self.head_dim,
                    self.ffn_hidden
                ));
            }
        }
        if self.n_layers > MAX_LAYERS {
            return bad(format!(
                "{} layers (at most {MAX_LAYERS} are accepted)",
                self.n_layers
            ));
        }
        if !(self.norm_eps.is_finite() && self.norm_eps > 0.0) {
            return bad(format!("rms_norm_eps {} must be positive", self.norm_eps));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return bad(format!("rope theta {} must be > 1", self.rope_theta));
        }
        if let RopeFrequencies::Factors(f) = &self.rope_frequencies
            && f.len() != self.head_dim / 2
        {
            return bad(format!(
                "rope_freqs has {} factors, expected head_dim/2 = {}",
                f.len(),
                self.head_dim / 2
            ));
        }
        Ok(())
    }

    /// Rotary inverse frequencies (`head_dim / 2` values) after scaling.
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        let half = self.head_dim / 2;
        (0..half)
            .map(|i| {
                let base = 1.0 / self.rope_theta.powf((2 * i) as f64 / self.head_dim as f64);
                match &self.rope_frequencies {
                    RopeFrequencies::Plain => base,
                    RopeFrequencies::Factors(f) => base / f64::from(f[i]),
                    RopeFrequencies::Llama3(s) => {
                        let low_wavelen = s.original_max_position as f64 / s.low_freq_factor;
                        let high_wavelen = s.original_max_position as f64 / s.high_freq_factor;
                        let wavelen = 2.0 * std::f64::consts::PI / base;
                        if wavelen < high_wavelen {
                            base
                        } else if wavelen > low_wavelen {
                            base / s.factor
                        } else {
                            let smooth = (s.original_max_position as f64 / wavelen
                                - s.low_freq_factor)
                                / (s.high_freq_factor - s.low_freq_factor);
                            (1.0 - smooth) * base / s.factor + smooth * base
                        }
                    }
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_of_kv_takes_its_float_type_s_bytes() {
        let c = LlamaConfig::smollm2_135m();
        assert_eq!(c.kv_bytes_per_token(), 46_080);
        assert_eq!(c.kv_bytes_per_token_in(FloatType::F32), 46_080);
        assert_eq!(c.kv_bytes_per_token_in(FloatType::F16), 23_040);
        assert_eq!(c.kv_bytes_per_token_in(FloatType::Bf16), 23_040);
    }

    #[test]
    fn a_model_s_default_precision_follows_its_size() {
        // The counts Hugging Face's model pages give for the two checkpoints.
        let demo = LlamaConfig::smollm2_135m();
        assert_eq!(demo.parameter_count(), 134_515_008);
        assert_eq!(demo.precision, Precision::Exact);
        let one_b = LlamaConfig::llama3_2_1b();
        assert_eq!(one_b.parameter_count(), 1_235_814_400);
        assert_eq!(one_b.precision, Precision::default());
        assert_eq!(LlamaConfig::llama3_1_8b().parameter_count(), 8_030_261_248);
        let absurd = LlamaConfig {
            vocab_size: usize::MAX,
            ..demo
        };
        assert_eq!(absurd.parameter_count(), u64::MAX);
    }

    #[test]
    fn absurd_dimensions_are_config_errors() {
        let base = LlamaConfig::smollm2_135m();
        let cases = [
            LlamaConfig {
                n_layers: 4_000_000_000,
                ..base.clone()
            },
            LlamaConfig {
                n_heads: usize::MAX / 32 * 3,
                n_kv_heads: 3,
                ..base.clone()
            },
            LlamaConfig {
                head_dim: usize::MAX / 2 + 1,
                ..base.clone()
            },
            LlamaConfig {
                vocab_size: usize::MAX / 64,
                ..base.clone()
            },
            LlamaConfig {
                ffn_hidden: 1 << 40,
                ..base.clone()
            },
        ];
        for c in cases {
            assert!(matches!(c.validate(), Err(LlamaError::Config(_))), "{c:?}");
        }
        assert!(base.validate().is_ok());
    }

    #[test]
    fn presets_are_valid() {
        for c in [
            LlamaConfig::llama3_2_1b(),
            LlamaConfig::llama3_2_3b(),
            LlamaConfig::llama3_1_8b(),
            LlamaConfig::llama3_8b(),
            LlamaConfig::tiny_llama(),
            LlamaConfig::smollm2_135m(),
        ] {
            c.validate().unwrap();
            assert_eq!(c.rope_inv_freq().len(), c.head_dim / 2);
        }
    }

    #[test]
    fn llama3_scaling_keeps_high_and_scales_low_frequencies() {
        let c = LlamaConfig::llama3_2_1b();
        let plain = LlamaConfig {
            rope_frequencies: RopeFrequencies::Plain,
            ..c.clone()
        };
        let (scaled, base) = (c.rope_inv_freq(), plain.rope_inv_freq());
        assert_eq!(scaled[0], base[0]);
        let last = base.len() - 1;
        assert!((scaled[last] - base[last] / 32.0).abs() < 1e-15);
    }
}
