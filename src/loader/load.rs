//! The configuration readers of [`LlamaConfig`] (GGUF metadata, a Hugging Face
//! `config.json`), the hub presets (feature `pretrained`), and the old loading
//! constructors, kept as deprecated wrappers over [`Loader`], the front door. What a configuration holds, its presets and its checks are in
//! [`crate::config`].

use std::path::Path;

use serde::Deserialize;

use super::gguf::GgufFile;
#[cfg(feature = "pretrained")]
use super::pretrained;
use super::{Loader, ProgressFn};
use crate::backend::LlamaBackend;
use crate::config::{LlamaConfig, RopeFrequencies, RopeScaling};
use crate::error::{LlamaError, Result};
use crate::llama::Llama;
use crate::tokenizer::{DynTokenizer, Tokenizer};

impl LlamaConfig {
    /// Reads the configuration from a GGUF file's `llama.*` metadata. The RoPE factors
    /// tensor (`rope_freqs.weight`), when present, is read too.
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self> {
        let arch = gguf.architecture()?;
        if arch != "llama" {
            return Err(LlamaError::Config(format!(
                "unsupported architecture `{arch}` (only `llama` is supported)"
            )));
        }
        let key = |name: &str| format!("{arch}.{name}");
        let usize_key = |name: &str| -> Result<usize> {
            let v = gguf.get_u64(&key(name))?;
            usize::try_from(v).map_err(|_| LlamaError::Config(format!("{name} = {v} is too large")))
        };
        let d_model = usize_key("embedding_length")?;
        let n_heads = usize_key("attention.head_count")?;
        let n_kv_heads = if gguf.get(&key("attention.head_count_kv")).is_some() {
            usize_key("attention.head_count_kv")?
        } else {
            n_heads
        };
        let head_dim = if gguf.get(&key("attention.key_length")).is_some() {
            usize_key("attention.key_length")?
        } else {
            d_model.checked_div(n_heads).unwrap_or(0)
        };
        let vocab_size = match gguf.tensor_info("token_embd.weight") {
            Some(info) => info.shape().first().copied().unwrap_or(0),
            None => return Err(LlamaError::MissingTensor("token_embd.weight".into())),
        };
        let rope_theta = match gguf.get(&key("rope.freq_base")) {
            Some(_) => f64::from(gguf.get_f32(&key("rope.freq_base"))?),
            None => 10_000.0,
        };
        let norm_eps = match gguf.get(&key("attention.layer_norm_rms_epsilon")) {
            Some(_) => f64::from(gguf.get_f32(&key("attention.layer_norm_rms_epsilon"))?),
            None => 1e-5,
        };
        let rope_frequencies = if gguf.tensor_info("rope_freqs.weight").is_some() {
            let (_, factors) = gguf.read_tensor_f32("rope_freqs.weight")?;
            RopeFrequencies::Factors(factors)
        } else {
            RopeFrequencies::Plain
        };
        let context_length = usize_key("context_length")?;
        let config = Self {
            vocab_size,
            d_model,
            n_layers: usize_key("block_count")?,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn_hidden: usize_key("feed_forward_length")?,
            norm_eps,
            rope_theta,
            rope_frequencies,
            tie_embeddings: gguf.tensor_info("output.weight").is_none(),
            context_length,
            max_seq_len: context_length,
            precision: crate::config::Precision::default(),
        };
        config.validate()?;
        Ok(config.with_default_precision())
    }

    /// Reads a Hugging Face `config.json` (Llama architecture).
    pub fn from_hf_json(json: &str) -> Result<Self> {
        let raw: HfConfig = serde_json::from_str(json)
            .map_err(|e| LlamaError::Config(format!("config.json: {e}")))?;
        if let Some(model_type) = &raw.model_type
            && model_type != "llama"
        {
            return Err(LlamaError::Config(format!(
                "unsupported model_type `{model_type}` (only `llama` is supported)"
            )));
        }
        let n_heads = raw.num_attention_heads;
        let rope_frequencies = match raw.rope_scaling {
            Some(s) if s.rope_type.as_deref().or(s.kind.as_deref()) == Some("llama3") => {
                RopeFrequencies::Llama3(RopeScaling {
                    factor: s.factor.unwrap_or(1.0),
                    low_freq_factor: s.low_freq_factor.unwrap_or(1.0),
                    high_freq_factor: s.high_freq_factor.unwrap_or(4.0),
                    original_max_position: s.original_max_position_embeddings.unwrap_or(8192),
                })
            }
            Some(s) => {
                let kind = s.rope_type.or(s.kind).unwrap_or_default();
                if kind != "default" {
                    return Err(LlamaError::Config(format!(
                        "unsupported rope_scaling type `{kind}`"
                    )));
                }
                RopeFrequencies::Plain
            }
            None => RopeFrequencies::Plain,
        };
        let config = Self {
            vocab_size: raw.vocab_size,
            d_model: raw.hidden_size,
            n_layers: raw.num_hidden_layers,
            n_heads,
            n_kv_heads: raw.num_key_value_heads.unwrap_or(n_heads),
            head_dim: raw
                .head_dim
                .unwrap_or(raw.hidden_size.checked_div(n_heads).unwrap_or(0)),
            ffn_hidden: raw.intermediate_size,
            norm_eps: raw.rms_norm_eps.unwrap_or(1e-5),
            rope_theta: raw.rope_theta.unwrap_or(10_000.0),
            rope_frequencies,
            tie_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            context_length: raw.max_position_embeddings.unwrap_or(2048),
            max_seq_len: raw.max_position_embeddings.unwrap_or(2048),
            precision: crate::config::Precision::default(),
        };
        config.validate()?;
        Ok(config.with_default_precision())
    }

    /// Loads a GGUF checkpoint with its embedded tokenizer, allocating for
    /// `max_seq_len` tokens of context; shows progress on a terminal.
    #[deprecated(
        since = "0.1.0",
        note = "use `Loader::gguf(path).max_seq_len(n).load(device)`"
    )]
    pub fn load_gguf<B: LlamaBackend>(
        path: impl AsRef<Path>,
        max_seq_len: usize,
        device: &B::Device,
    ) -> Result<Llama<B, DynTokenizer>> {
        Loader::gguf(path).max_seq_len(max_seq_len).load(device)
    }

    /// [`Loader::gguf`] with a progress callback `(done, total)`.
    #[deprecated(
        since = "0.1.0",
        note = "use `Loader::gguf(path).max_seq_len(n).progress(f).load(device)`"
    )]
    pub fn load_gguf_with_progress<B: LlamaBackend>(
        path: impl AsRef<Path>,
        max_seq_len: usize,
        device: &B::Device,
        progress: ProgressFn<'_>,
    ) -> Result<Llama<B, DynTokenizer>> {
        Loader::gguf(path)
            .max_seq_len(max_seq_len)
            .progress(progress)
            .load(device)
    }

    /// Loads a Hugging Face model directory with its `tokenizer.json`.
    #[deprecated(
        since = "0.1.0",
        note = "use `Loader::hf_dir(dir).max_seq_len(n).load(device)`"
    )]
    pub fn load_hf_dir<B: LlamaBackend>(
        dir: impl AsRef<Path>,
        max_seq_len: usize,
        device: &B::Device,
    ) -> Result<Llama<B, DynTokenizer>> {
        Loader::hf_dir(dir).max_seq_len(max_seq_len).load(device)
    }

    /// Loads a Hugging Face model directory's weights with the given tokenizer.
    #[deprecated(
        since = "0.1.0",
        note = "use `Loader::hf_dir(dir).tokenizer(t).max_seq_len(n).progress(f).load(device)`"
    )]
    pub fn load_hf_dir_with_tokenizer<B: LlamaBackend, T: Tokenizer>(
        dir: impl AsRef<Path>,
        tokenizer: T,
        max_seq_len: usize,
        device: &B::Device,
        progress: ProgressFn<'_>,
    ) -> Result<Llama<B, T>> {
        Loader::hf_dir(dir)
            .tokenizer(tokenizer)
            .max_seq_len(max_seq_len)
            .progress(progress)
            .load(device)
    }

    /// Loads a Hugging Face model directory with its matrices quantized into `format`.
    #[deprecated(
        since = "0.1.0",
        note = "use `Loader::hf_dir(dir).max_seq_len(n).quantize(format).load(device)`"
    )]
    pub fn load_hf_dir_quantized<B: LlamaBackend>(
        dir: impl AsRef<Path>,
        max_seq_len: usize,
        format: crate::kernels::QuantFormat,
        device: &B::Device,
    ) -> Result<Llama<B, DynTokenizer>> {
        Loader::hf_dir(dir)
            .max_seq_len(max_seq_len)
            .quantize(format)
            .load(device)
    }

    /// Loads a Hugging Face model directory's weights, quantized into `format`, with the
    /// given tokenizer.
    #[deprecated(
        since = "0.1.0",
        note = "use `Loader::hf_dir(dir).tokenizer(t).max_seq_len(n).quantize(format).progress(f).load(device)`"
    )]
    pub fn load_hf_dir_quantized_with_tokenizer<B: LlamaBackend, T: Tokenizer>(
        dir: impl AsRef<Path>,
        tokenizer: T,
        max_seq_len: usize,
        format: crate::kernels::QuantFormat,
        device: &B::Device,
        progress: ProgressFn<'_>,
    ) -> Result<Llama<B, T>> {
        Loader::hf_dir(dir)
            .tokenizer(tokenizer)
            .max_seq_len(max_seq_len)
            .quantize(format)
            .progress(progress)
            .load(device)
    }

    /// Downloads (on first use) and loads
    /// [Llama 3.2 1B Instruct](https://huggingface.co/meta-llama/Llama-3.2-1B-Instruct),
    /// allocating for `max_seq_len` tokens of context (at most 131 072).
    ///
    /// The repository is gated: see the
    /// [module documentation](crate::loader::pretrained) for the token. Fails with [`LlamaError::InvalidParameter`] for an impossible
    /// `max_seq_len` (before downloading anything), [`LlamaError::Download`] when the
    /// files cannot be fetched, and the loader's errors for a damaged checkpoint.
    ///
    /// ```no_run
    /// # fn main() -> llama_burn::Result<()> {
    /// use llama_burn::backend::{DefaultBackend, default_device};
    /// use llama_burn::LlamaConfig;
    /// use llama_burn::sampling::Sampler;
    ///
    /// let mut llama = LlamaConfig::llama3_2_1b_pretrained::<DefaultBackend>(4096, &default_device())?;
    /// let out = llama.generate("The capital of France is", 32, 0.0, &mut Sampler::Argmax)?;
    /// println!("{}", out.text);
    /// # Ok(())
    /// # }
    /// ```
    #[cfg(all(feature = "pretrained", feature = "llama3"))]
    #[cfg_attr(docsrs, doc(cfg(all(feature = "pretrained", feature = "llama3"))))]
    pub fn llama3_2_1b_pretrained<B: LlamaBackend>(
        max_seq_len: usize,
        device: &B::Device,
    ) -> Result<Llama<B, DynTokenizer>> {
        pretrained::load_llama3(
            &pretrained::LLAMA3_2_1B_INSTRUCT,
            Self::llama3_2_1b(),
            max_seq_len,
            device,
        )
    }

    /// Downloads (on first use) and loads
    /// [Llama 3.2 3B Instruct](https://huggingface.co/meta-llama/Llama-3.2-3B-Instruct)
    /// (two shards), allocating for `max_seq_len` tokens of context (at most 131 072).
    ///
    /// Gated, and fails as [`llama3_2_1b_pretrained`](Self::llama3_2_1b_pretrained) does.
    ///
    /// ```no_run
    /// # fn main() -> llama_burn::Result<()> {
    /// use llama_burn::backend::{DefaultBackend, default_device};
    /// use llama_burn::LlamaConfig;
    ///
    /// let llama = LlamaConfig::llama3_2_3b_pretrained::<DefaultBackend>(8192, &default_device())?;
    /// println!("{} layers", llama.config().n_layers);
    /// # Ok(())
    /// # }
    /// ```
    #[cfg(all(feature = "pretrained", feature = "llama3"))]
    #[cfg_attr(docsrs, doc(cfg(all(feature = "pretrained", feature = "llama3"))))]
    pub fn llama3_2_3b_pretrained<B: LlamaBackend>(
        max_seq_len: usize,
        device: &B::Device,
    ) -> Result<Llama<B, DynTokenizer>> {
        pretrained::load_llama3(
            &pretrained::LLAMA3_2_3B_INSTRUCT,
            Self::llama3_2_3b(),
            max_seq_len,
            device,
        )
    }

    /// Downloads (on first use) and loads
    /// [Llama 3.1 8B Instruct](https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct)
    /// (four shards, 16 GB), allocating for `max_seq_len` tokens of context (at most
    /// 131 072).
    ///
    /// Gated, and fails as [`llama3_2_1b_pretrained`](Self::llama3_2_1b_pretrained) does.
    ///
    /// ```no_run
    /// # fn main() -> llama_burn::Result<()> {
    /// use llama_burn::backend::{DefaultBackend, default_device};
    /// use llama_burn::LlamaConfig;
    ///
    /// let llama = LlamaConfig::llama3_1_8b_pretrained::<DefaultBackend>(8192, &default_device())?;
    /// println!("{} layers", llama.config().n_layers);
    /// # Ok(())
    /// # }
    /// ```
    #[cfg(all(feature = "pretrained", feature = "llama3"))]
    #[cfg_attr(docsrs, doc(cfg(all(feature = "pretrained", feature = "llama3"))))]
    pub fn llama3_1_8b_pretrained<B: LlamaBackend>(
        max_seq_len: usize,
        device: &B::Device,
    ) -> Result<Llama<B, DynTokenizer>> {
        pretrained::load_llama3(
            &pretrained::LLAMA3_1_8B_INSTRUCT,
            Self::llama3_1_8b(),
            max_seq_len,
            device,
        )
    }

    /// Downloads (on first use) and loads
    /// [Llama 3 8B Instruct](https://huggingface.co/meta-llama/Meta-Llama-3-8B-Instruct)
    /// (four shards, 16 GB), allocating for `max_seq_len` tokens of context (at most
    /// 8192).
    ///
    /// Gated, and fails as [`llama3_2_1b_pretrained`](Self::llama3_2_1b_pretrained) does.
    ///
    /// ```no_run
    /// # fn main() -> llama_burn::Result<()> {
    /// use llama_burn::backend::{DefaultBackend, default_device};
    /// use llama_burn::LlamaConfig;
    ///
    /// let llama = LlamaConfig::llama3_8b_pretrained::<DefaultBackend>(8192, &default_device())?;
    /// println!("{} layers", llama.config().n_layers);
    /// # Ok(())
    /// # }
    /// ```
    #[cfg(all(feature = "pretrained", feature = "llama3"))]
    #[cfg_attr(docsrs, doc(cfg(all(feature = "pretrained", feature = "llama3"))))]
    pub fn llama3_8b_pretrained<B: LlamaBackend>(
        max_seq_len: usize,
        device: &B::Device,
    ) -> Result<Llama<B, DynTokenizer>> {
        pretrained::load_llama3(
            &pretrained::LLAMA3_8B_INSTRUCT,
            Self::llama3_8b(),
            max_seq_len,
            device,
        )
    }

    /// Downloads (on first use) and loads
    /// [TinyLlama 1.1B Chat v1.0](https://huggingface.co/TinyLlama/TinyLlama-1.1B-Chat-v1.0)
    /// with its `tokenizer.json`, allocating for `max_seq_len` tokens of context (at most
    /// 2048).
    ///
    /// The repository is public: no token is needed. Fails with
    /// [`LlamaError::InvalidParameter`] for an impossible `max_seq_len` (before
    /// downloading anything), [`LlamaError::Download`] when the files cannot be fetched,
    /// and the loader's errors for a damaged checkpoint.
    ///
    /// ```no_run
    /// # fn main() -> llama_burn::Result<()> {
    /// use llama_burn::backend::{DefaultBackend, default_device};
    /// use llama_burn::LlamaConfig;
    /// use llama_burn::sampling::Sampler;
    ///
    /// let mut llama = LlamaConfig::tiny_llama_pretrained::<DefaultBackend>(2048, &default_device())?;
    /// let out = llama.generate("Once upon a time", 32, 0.0, &mut Sampler::Argmax)?;
    /// println!("{}", out.text);
    /// # Ok(())
    /// # }
    /// ```
    #[cfg(feature = "pretrained")]
    #[cfg_attr(docsrs, doc(cfg(feature = "pretrained")))]
    pub fn tiny_llama_pretrained<B: LlamaBackend>(
        max_seq_len: usize,
        device: &B::Device,
    ) -> Result<Llama<B, DynTokenizer>> {
        Self::tiny_llama().checked_max_seq_len(max_seq_len)?;
        let dir = pretrained::TINY_LLAMA_1_1B_CHAT.download()?;
        Loader::hf_dir(&dir).max_seq_len(max_seq_len).load(device)
    }
}

#[derive(Deserialize)]
struct HfRopeScaling {
    rope_type: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
    factor: Option<f64>,
    low_freq_factor: Option<f64>,
    high_freq_factor: Option<f64>,
    original_max_position_embeddings: Option<usize>,
}

#[derive(Deserialize)]
struct HfConfig {
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    intermediate_size: usize,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<HfRopeScaling>,
    tie_word_embeddings: Option<bool>,
    max_position_embeddings: Option<usize>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::assert_err;

    #[test]
    fn hf_config_parses_and_rejects_bad_values() {
        let json = r#"{"model_type":"llama","vocab_size":49152,"hidden_size":576,
            "num_hidden_layers":30,"num_attention_heads":9,"num_key_value_heads":3,
            "intermediate_size":1536,"rms_norm_eps":1e-5,"rope_theta":100000.0,
            "tie_word_embeddings":true,"max_position_embeddings":8192}"#;
        let c = LlamaConfig::from_hf_json(json).unwrap();
        assert_eq!(c, LlamaConfig::smollm2_135m());
        let bad = json.replace("\"num_key_value_heads\":3", "\"num_key_value_heads\":4");
        assert!(matches!(
            LlamaConfig::from_hf_json(&bad),
            Err(LlamaError::Config(_))
        ));
        let other = json.replace("\"llama\"", "\"gpt2\"");
        assert!(matches!(
            LlamaConfig::from_hf_json(&other),
            Err(LlamaError::Config(_))
        ));
        assert_err!(
            LlamaConfig::from_hf_json("{"),
            LlamaError::Config(m) if m.contains("config.json: EOF while parsing")
        );
    }
}
